//! A syscall probe for attack tests: a tiny static x86_64 ELF, written here byte by byte so
//! no compiler or libc is needed and any image (even busybox) can run it. It makes one
//! raw syscall with up to three 32-bit arguments and exits 0 when the call succeeded, or
//! with the errno when it failed (EPERM = 1, ENOSYS = 38…). A probe killed by seccomp
//! exits 128 + SIGSYS (159) through the shell that ran it.

/// The syscall number of an x32 call: `__X32_SYSCALL_BIT` set.
pub const X32: u32 = 0x4000_0000;

/// The ELF bytes of a probe making syscall `nr` with `args`.
pub fn elf(nr: u32, args: [u32; 3]) -> Vec<u8> {
    let mut code = Vec::new();
    let mov = |code: &mut Vec<u8>, op: u8, v: u32| {
        code.push(op);
        code.extend_from_slice(&v.to_le_bytes());
    };
    mov(&mut code, 0xB8, nr); // mov eax, nr
    mov(&mut code, 0xBF, args[0]); // mov edi, a0
    mov(&mut code, 0xBE, args[1]); // mov esi, a1
    mov(&mut code, 0xBA, args[2]); // mov edx, a2
    code.extend_from_slice(&[
        0x0F, 0x05, // syscall
        0x48, 0x85, 0xC0, // test rax, rax
        0x79, 0x06, // jns ok
        0xF7, 0xD8, // neg eax
        0x89, 0xC7, // mov edi, eax
        0xEB, 0x02, // jmp exit
        0x31, 0xFF, // ok: xor edi, edi
        0xB8, 0x3C, 0x00, 0x00, 0x00, // exit: mov eax, 60 (exit)
        0x0F, 0x05, // syscall
    ]);
    elf_of(&code)
}

/// A static x86_64 ELF whose one loadable segment is `code`, entered at its first byte.
pub fn elf_of(code: &[u8]) -> Vec<u8> {
    const BASE: u64 = 0x40_0000;
    const HEADERS: u64 = 64 + 56;
    let total = HEADERS + code.len() as u64;
    let mut e = Vec::new();
    e.extend_from_slice(b"\x7fELF\x02\x01\x01\x00");
    e.extend_from_slice(&[0; 8]);
    e.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e.extend_from_slice(&0x3Eu16.to_le_bytes()); // x86_64
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&(BASE + HEADERS).to_le_bytes()); // entry
    e.extend_from_slice(&64u64.to_le_bytes()); // phoff
    e.extend_from_slice(&0u64.to_le_bytes()); // shoff
    e.extend_from_slice(&0u32.to_le_bytes()); // flags
    for v in [64u16, 56, 1, 0, 0, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    e.extend_from_slice(&5u32.to_le_bytes()); // R + X
    e.extend_from_slice(&0u64.to_le_bytes()); // offset
    e.extend_from_slice(&BASE.to_le_bytes()); // vaddr
    e.extend_from_slice(&BASE.to_le_bytes()); // paddr
    e.extend_from_slice(&total.to_le_bytes()); // filesz
    e.extend_from_slice(&total.to_le_bytes()); // memsz
    e.extend_from_slice(&0x1000u64.to_le_bytes()); // align
    e.extend_from_slice(code);
    e
}

/// A shell line that writes probe `name` making syscall `nr` with `args` into the current
/// directory (with printf octal escapes, so busybox sh can), then runs it and prints
/// `name=<exit code>`.
pub fn run_line(name: &str, nr: u32, args: [u32; 3]) -> String {
    let escaped = printf_escaped(&elf(nr, args));
    format!("printf '{escaped}' > ./{name} && chmod 755 ./{name}; ./{name}; echo {name}=$?; rm -f ./{name}")
}

/// `bytes` as printf octal escapes, for writing a binary from busybox sh.
pub fn printf_escaped(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("\\{b:03o}")).collect()
}

/// The value printed as `name=<n>` in `out`.
pub fn result(out: &str, name: &str) -> Option<i32> {
    out.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}=")))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn probe_reports_success_and_errno() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let run = |nr: u32, args: [u32; 3]| {
        let p = d.path().join("p");
        std::fs::write(&p, elf(nr, args)).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::process::Command::new(&p).status().unwrap().code()
    };
    assert_eq!(run(libc::SYS_getpid as u32, [0; 3]), Some(0));
    // close(-1): EBADF.
    assert_eq!(
        run(libc::SYS_close as u32, [u32::MAX, 0, 0]),
        Some(libc::EBADF)
    );
}
