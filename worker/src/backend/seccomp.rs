//! The seccomp deny list every sandbox runs under, on both backends: one list, compiled
//! to BPF with `seccompiler` for bubblewrap (`--add-seccomp-fd`), and written as an OCI
//! (Docker/Podman) JSON profile for `--security-opt seccomp=<file>`.
//!
//! Build and test jobs never need what it denies: new namespaces of any kind (so no nested
//! user namespace: `unshare -r`, `clone(CLONE_NEWUSER)`), `setns`, every mount call (old
//! and new API), ptrace and cross-process memory access, the kernel keyring, bpf,
//! perf_event_open, kexec and module loading, userfaultfd, io_uring, personality flags that
//! weaken ASLR or NX, and the rest of Docker's default-deny list (clock and time setting,
//! swap, reboot, quotactl, acct, syslog, handle-based opens, NUMA policy, obsolete
//! syscalls). Denied calls fail with `EPERM`; `clone3` fails with `ENOSYS` (its flags live
//! in memory a filter cannot read), so libc falls back to `clone`, whose flags it can.
//!
//! Sockets: only the families a build or test job uses can be made (`socket` and
//! `socketpair` with `AF_UNIX`, `AF_INET`, `AF_INET6` or `AF_NETLINK`); every other family
//! fails with `EPERM`. Above all `AF_VSOCK`: a network namespace does not separate vsock,
//! so on a VM host (`/dev/vsock`) a sandbox with `--network none` would otherwise share the
//! VM's vsock port space with the host. The OCI profile also refuses the i386 `socketcall`
//! multiplexer, whose arguments live in memory no filter can read.
//!
//! On x86_64 the whole x32 ABI (syscall numbers with `__X32_SYSCALL_BIT` set) fails with
//! `EPERM`: a separate BPF program for bwrap, and no `SCMP_ARCH_X32` in the OCI profile
//! (its x32 calls then take the profile's bad-architecture action). x32 has numbers of
//! its own (512–547: `kexec_load` is 528, `move_pages` 533…) that a by-number deny list
//! would have to repeat; refusing the ABI needs no list. i386 calls are killed by the
//! bwrap filter's architecture check.
//!
//! Everything else is allowed: the sandbox's other walls (namespaces, uid 1000, no
//! capabilities, no-new-privileges, read-only root) stay what they were.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Every flag that makes a new namespace (`CLONE_NEWTIME` only for `unshare`: in `clone`
/// its bit is part of the exit signal field).
const NEW_NAMESPACE_FLAGS: [u64; 7] = [
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWCGROUP as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
];
const CLONE_NEWTIME: u64 = 0x80;

/// personality(2) flags that weaken the process: no ASLR, executable data, page zero.
const UNSAFE_PERSONALITY: [u64; 4] = [
    0x0040000, // ADDR_NO_RANDOMIZE
    0x0400000, // READ_IMPLIES_EXEC
    0x0200000, // ADDR_COMPAT_LAYOUT
    0x0100000, // MMAP_PAGE_ZERO
];
/// personality(0xffffffff) only queries.
const PERSONALITY_QUERY: u64 = 0xffff_ffff;

/// When a listed syscall is denied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    Always,
    /// Argument `arg` has any of `flags` set.
    AnyFlag {
        arg: u8,
        flags: &'static [u64],
    },
    /// personality(2) with an unsafe flag (the query value excepted).
    UnsafePersonality,
    /// Argument `arg` (an `int`: its low 32 bits) is none of `allowed`.
    NoneOf {
        arg: u8,
        allowed: &'static [u64],
    },
}

/// The socket families a job may use: local sockets, IPv4/IPv6 (loopback only, without a
/// network) and netlink (glibc's `getaddrinfo` asks the kernel for its addresses).
pub const ALLOWED_SOCKET_FAMILIES: [u64; 4] = [
    libc::AF_UNIX as u64,
    libc::AF_INET as u64,
    libc::AF_INET6 as u64,
    libc::AF_NETLINK as u64,
];

/// One denied syscall.
#[derive(Debug, Clone, Copy)]
pub struct Deny {
    pub name: &'static str,
    pub nr: i64,
    pub errno: i32,
    pub when: When,
}

/// Why the filter could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("seccomp filter: {0}")]
    Compile(#[from] seccompiler::BackendError),
    #[error("seccomp filters are not built for this architecture")]
    UnsupportedArch,
}

/// Denied unconditionally with EPERM.
const ALWAYS: &[(&str, i64)] = &[
    ("setns", libc::SYS_setns),
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("pivot_root", libc::SYS_pivot_root),
    ("fsopen", libc::SYS_fsopen),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fspick", libc::SYS_fspick),
    ("move_mount", libc::SYS_move_mount),
    ("open_tree", libc::SYS_open_tree),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("ptrace", libc::SYS_ptrace),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("kcmp", libc::SYS_kcmp),
    ("keyctl", libc::SYS_keyctl),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("userfaultfd", libc::SYS_userfaultfd),
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    ("acct", libc::SYS_acct),
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("reboot", libc::SYS_reboot),
    ("settimeofday", libc::SYS_settimeofday),
    ("clock_settime", libc::SYS_clock_settime),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("syslog", libc::SYS_syslog),
    ("quotactl", libc::SYS_quotactl),
    ("quotactl_fd", libc::SYS_quotactl_fd),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("mbind", libc::SYS_mbind),
    ("set_mempolicy", libc::SYS_set_mempolicy),
    ("move_pages", libc::SYS_move_pages),
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
];

/// Obsolete or hardware-poking syscalls only x86_64 has.
#[cfg(target_arch = "x86_64")]
const ALWAYS_X86_64: &[(&str, i64)] = &[
    ("lookup_dcookie", libc::SYS_lookup_dcookie),
    ("iopl", libc::SYS_iopl),
    ("ioperm", libc::SYS_ioperm),
    ("nfsservctl", libc::SYS_nfsservctl),
    ("uselib", libc::SYS_uselib),
    ("ustat", libc::SYS_ustat),
    ("sysfs", libc::SYS_sysfs),
    ("_sysctl", libc::SYS__sysctl),
];

/// The deny list for the architecture this worker was built for.
pub fn deny_list() -> Vec<Deny> {
    let always = |&(name, nr): &(&'static str, i64)| Deny {
        name,
        nr,
        errno: libc::EPERM,
        when: When::Always,
    };
    let mut list: Vec<Deny> = ALWAYS.iter().map(always).collect();
    #[cfg(target_arch = "x86_64")]
    list.extend(ALWAYS_X86_64.iter().map(always));
    static UNSHARE_FLAGS: [u64; 8] = [
        NEW_NAMESPACE_FLAGS[0],
        NEW_NAMESPACE_FLAGS[1],
        NEW_NAMESPACE_FLAGS[2],
        NEW_NAMESPACE_FLAGS[3],
        NEW_NAMESPACE_FLAGS[4],
        NEW_NAMESPACE_FLAGS[5],
        NEW_NAMESPACE_FLAGS[6],
        CLONE_NEWTIME,
    ];
    list.extend([
        Deny {
            name: "unshare",
            nr: libc::SYS_unshare,
            errno: libc::EPERM,
            when: When::AnyFlag {
                arg: 0,
                flags: &UNSHARE_FLAGS,
            },
        },
        Deny {
            name: "clone",
            nr: libc::SYS_clone,
            errno: libc::EPERM,
            when: When::AnyFlag {
                arg: 0,
                flags: &NEW_NAMESPACE_FLAGS,
            },
        },
        Deny {
            name: "clone3",
            nr: libc::SYS_clone3,
            errno: libc::ENOSYS,
            when: When::Always,
        },
        Deny {
            name: "personality",
            nr: libc::SYS_personality,
            errno: libc::EPERM,
            when: When::UnsafePersonality,
        },
        Deny {
            name: "socket",
            nr: libc::SYS_socket,
            errno: libc::EPERM,
            when: When::NoneOf {
                arg: 0,
                allowed: &ALLOWED_SOCKET_FAMILIES,
            },
        },
        Deny {
            name: "socketpair",
            nr: libc::SYS_socketpair,
            errno: libc::EPERM,
            when: When::NoneOf {
                arg: 0,
                allowed: &ALLOWED_SOCKET_FAMILIES,
            },
        },
    ]);
    list
}

fn target_arch() -> Result<TargetArch, SeccompError> {
    if cfg!(target_arch = "x86_64") {
        Ok(TargetArch::x86_64)
    } else if cfg!(target_arch = "aarch64") {
        Ok(TargetArch::aarch64)
    } else {
        Err(SeccompError::UnsupportedArch)
    }
}

fn rules_for(when: When) -> Result<Vec<SeccompRule>, SeccompError> {
    let cond = |arg: u8, op: SeccompCmpOp, value: u64| {
        SeccompCondition::new(arg, SeccompCmpArgLen::Qword, op, value)
    };
    Ok(match when {
        When::Always => Vec::new(),
        When::AnyFlag { arg, flags } => flags
            .iter()
            .map(|f| {
                Ok(SeccompRule::new(vec![cond(
                    arg,
                    SeccompCmpOp::MaskedEq(*f),
                    *f,
                )?])?)
            })
            .collect::<Result<_, SeccompError>>()?,
        When::UnsafePersonality => UNSAFE_PERSONALITY
            .iter()
            .map(|f| {
                Ok(SeccompRule::new(vec![
                    cond(0, SeccompCmpOp::MaskedEq(*f), *f)?,
                    cond(0, SeccompCmpOp::Ne, PERSONALITY_QUERY)?,
                ])?)
            })
            .collect::<Result<_, SeccompError>>()?,
        // One rule, all conditions required: the low 32 bits (the kernel reads an `int`)
        // differ from every allowed value.
        When::NoneOf { arg, allowed } => vec![SeccompRule::new(
            allowed
                .iter()
                .map(|v| SeccompCondition::new(arg, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, *v))
                .collect::<Result<_, _>>()?,
        )?],
    })
}

/// x32 syscalls reach the x86_64 filter with this bit set in the number.
pub const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// The x86_64 audit architecture (`AUDIT_ARCH_X86_64`).
const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;

/// One classic BPF instruction as the kernel's `struct sock_filter` bytes.
fn insn(code: u16, jt: u8, jf: u8, k: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..2].copy_from_slice(&code.to_ne_bytes());
    b[2] = jt;
    b[3] = jf;
    b[4..].copy_from_slice(&k.to_ne_bytes());
    b
}

/// A program that refuses every x32 syscall with `EPERM`: on the x86_64 architecture, a
/// number with [`X32_SYSCALL_BIT`] set. Anything else it allows (the other programs
/// decide).
pub fn x32_program() -> Vec<u8> {
    const LD_W_ABS: u16 = 0x20;
    const JEQ_K: u16 = 0x15;
    const JSET_K: u16 = 0x45;
    const RET_K: u16 = 0x06;
    [
        insn(LD_W_ABS, 0, 0, 4), // seccomp_data.arch
        insn(JEQ_K, 0, 3, AUDIT_ARCH_X86_64),
        insn(LD_W_ABS, 0, 0, 0), // seccomp_data.nr
        insn(JSET_K, 0, 1, X32_SYSCALL_BIT),
        insn(RET_K, 0, 0, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
        insn(RET_K, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]
    .concat()
}

/// The deny list compiled to BPF programs, one per errno, each as the raw bytes of its
/// `struct sock_filter` array (what bwrap's `--add-seccomp-fd` reads); on x86_64 also
/// [`x32_program`].
pub fn bpf_programs() -> Result<Vec<Vec<u8>>, SeccompError> {
    let arch = target_arch()?;
    let mut by_errno: BTreeMap<i32, BTreeMap<i64, Vec<SeccompRule>>> = BTreeMap::new();
    for d in deny_list() {
        let rules = rules_for(d.when)?;
        by_errno.entry(d.errno).or_default().insert(d.nr, rules);
    }
    let mut programs = by_errno
        .into_iter()
        .map(|(errno, rules)| {
            let filter = SeccompFilter::new(
                rules,
                SeccompAction::Allow,
                SeccompAction::Errno(errno as u32),
                arch,
            )?;
            let program: BpfProgram = filter.try_into()?;
            Ok(program
                .iter()
                .flat_map(|i| insn(i.code, i.jt, i.jf, i.k))
                .collect())
        })
        .collect::<Result<Vec<Vec<u8>>, SeccompError>>()?;
    if cfg!(target_arch = "x86_64") {
        programs.push(x32_program());
    }
    Ok(programs)
}

/// The same deny list as an OCI runtime seccomp profile (the JSON that
/// `podman/docker run --security-opt seccomp=<file>` reads): allow by default, and one entry
/// per condition, since conditions within one entry are all required.
pub fn oci_profile() -> serde_json::Value {
    use serde_json::json;
    let mut syscalls = Vec::new();
    let arches = if cfg!(target_arch = "aarch64") {
        json!(["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"])
    } else {
        // No SCMP_ARCH_X32: the x32 ABI is refused (see the module doc).
        json!(["SCMP_ARCH_X86_64", "SCMP_ARCH_X86"])
    };
    for d in deny_list() {
        let entry = |args: serde_json::Value| json!({ "names": [d.name], "action": "SCMP_ACT_ERRNO", "errnoRet": d.errno, "args": args });
        match d.when {
            When::Always => syscalls.push(entry(json!([]))),
            When::AnyFlag { arg, flags } => {
                for f in flags {
                    syscalls.push(entry(json!([
                        { "index": arg, "value": f, "valueTwo": f, "op": "SCMP_CMP_MASKED_EQ" }
                    ])));
                }
            }
            When::UnsafePersonality => {
                // libseccomp (and so runc and crun) cannot take two conditions on one
                // argument in one rule: compare the flag bits only. The query value
                // 0xffffffff is then refused too, which is harmless.
                for f in UNSAFE_PERSONALITY {
                    syscalls.push(entry(json!([
                        { "index": 0, "value": f, "valueTwo": f, "op": "SCMP_CMP_MASKED_EQ" }
                    ])));
                }
            }
            When::NoneOf { arg, allowed } => {
                // One condition per rule again: every value below the largest allowed one
                // that is not allowed, then everything above it.
                let max = allowed.iter().copied().max().unwrap_or(0);
                for v in (0..=max).filter(|v| !allowed.contains(v)) {
                    syscalls.push(entry(json!([
                        { "index": arg, "value": v, "op": "SCMP_CMP_EQ" }
                    ])));
                }
                syscalls.push(entry(json!([
                    { "index": arg, "value": max + 1, "op": "SCMP_CMP_GE" }
                ])));
            }
        }
    }
    if cfg!(target_arch = "x86_64") {
        // i386's socket multiplexer: its arguments are in memory.
        syscalls.push(json!({ "names": ["socketcall"], "action": "SCMP_ACT_ERRNO", "errnoRet": libc::EPERM, "args": [] }));
    }
    json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "defaultErrnoRet": libc::EPERM,
        "architectures": arches,
        "syscalls": syscalls,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compiles_one_program_per_errno() {
        let progs = bpf_programs().unwrap();
        assert_eq!(progs.len(), 3, "EPERM, ENOSYS and x32");
        for p in &progs {
            assert_eq!(p.len() % 8, 0);
            assert!(p.len() / 8 < 4096, "within BPF_MAXINSNS");
        }
    }

    #[test]
    fn profile_names_every_denied_syscall() {
        let p = oci_profile();
        let names: Vec<&str> = p["syscalls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["names"][0].as_str().unwrap())
            .collect();
        for must in [
            "unshare",
            "clone",
            "setns",
            "mount",
            "umount2",
            "pivot_root",
            "fsopen",
            "fsmount",
            "move_mount",
            "open_tree",
            "ptrace",
            "process_vm_readv",
            "process_vm_writev",
            "keyctl",
            "add_key",
            "request_key",
            "bpf",
            "perf_event_open",
            "kexec_load",
            "kexec_file_load",
            "init_module",
            "finit_module",
            "delete_module",
            "userfaultfd",
            "personality",
        ] {
            assert!(names.contains(&must), "{must} missing");
        }
        assert_eq!(p["defaultAction"], "SCMP_ACT_ALLOW");
    }

    /// The compiled filter really refuses, in a forked child: a new user namespace and a
    /// mount fail with EPERM, clone3 with ENOSYS, and an ordinary fork still works.
    #[test]
    fn filter_denies_in_a_real_process() {
        let progs = bpf_programs().unwrap();
        // SAFETY: fork in a test; the child only makes raw syscalls and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = (|| -> i32 {
                // SAFETY: prctl(PR_SET_NO_NEW_PRIVS) lets an unprivileged process install
                // a filter; the programs are valid sock_filter arrays.
                unsafe {
                    if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                        return 10;
                    }
                    for p in &progs {
                        let prog = libc::sock_fprog {
                            len: (p.len() / 8) as u16,
                            filter: p.as_ptr() as *mut libc::sock_filter,
                        };
                        if libc::prctl(
                            libc::PR_SET_SECCOMP,
                            libc::SECCOMP_MODE_FILTER,
                            &prog as *const libc::sock_fprog,
                        ) != 0
                        {
                            return 11;
                        }
                    }
                    let errno = || *libc::__errno_location();
                    if libc::unshare(libc::CLONE_NEWUSER) != -1 || errno() != libc::EPERM {
                        return 12;
                    }
                    if libc::syscall(libc::SYS_clone3, 0, 0) != -1 || errno() != libc::ENOSYS {
                        return 13;
                    }
                    let src = c"none".as_ptr();
                    if libc::mount(src, c"/".as_ptr(), src, 0, std::ptr::null()) != -1
                        || errno() != libc::EPERM
                    {
                        return 14;
                    }
                    if libc::personality(0x0040000) != -1 || errno() != libc::EPERM {
                        return 15;
                    }
                    if libc::personality(0xffff_ffff) == -1 {
                        return 16;
                    }
                    // Refused by the filter, so EPERM even on kernels without x32 (ENOSYS).
                    if libc::syscall(X32_SYSCALL_BIT as i64 | libc::SYS_getpid) != -1
                        || errno() != libc::EPERM
                    {
                        return 18;
                    }
                    if libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM, 0) != -1
                        || errno() != libc::EPERM
                    {
                        return 19;
                    }
                    let s = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                    if s < 0 {
                        return 20;
                    }
                    libc::close(s);
                    let child = libc::fork();
                    if child == 0 {
                        libc::_exit(0);
                    }
                    let mut st = 0;
                    if child < 0 || libc::waitpid(child, &mut st, 0) != child || st != 0 {
                        return 17;
                    }
                }
                0
            })();
            // SAFETY: leaving the forked child without running the test harness's code.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waiting for the child forked above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status));
        assert_eq!(libc::WEXITSTATUS(status), 0);
    }

    /// Runs one classic BPF program (the instructions seccompiler and [`x32_program`]
    /// emit) on a `seccomp_data` of `arch`, `nr` and `args`.
    fn run_bpf(prog: &[u8], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let mut data = Vec::new();
        data.extend_from_slice(&nr.to_ne_bytes());
        data.extend_from_slice(&arch.to_ne_bytes());
        data.extend_from_slice(&0u64.to_ne_bytes());
        for a in args {
            data.extend_from_slice(&a.to_ne_bytes());
        }
        let insns: Vec<(u16, u8, u8, u32)> = prog
            .chunks(8)
            .map(|c| {
                (
                    u16::from_ne_bytes([c[0], c[1]]),
                    c[2],
                    c[3],
                    u32::from_ne_bytes([c[4], c[5], c[6], c[7]]),
                )
            })
            .collect();
        let (mut a, mut pc) = (0u32, 0usize);
        loop {
            let (code, jt, jf, k) = insns[pc];
            pc += 1;
            let jump = |cond: bool| if cond { jt as usize } else { jf as usize };
            match code {
                0x20 => {
                    let o = k as usize;
                    a = u32::from_ne_bytes(data[o..o + 4].try_into().unwrap());
                }
                0x00 => a = k,
                0x54 => a &= k,
                0x05 => pc += k as usize,
                0x15 => pc += jump(a == k),
                0x25 => pc += jump(a > k),
                0x35 => pc += jump(a >= k),
                0x45 => pc += jump(a & k != 0),
                0x06 => return k,
                other => panic!("instruction {other:#x} not interpreted"),
            }
        }
    }

    /// What the kernel returns for all programs together: the action of highest
    /// precedence.
    fn verdict(nr: u32, args: [u64; 6]) -> u32 {
        let arch = if cfg!(target_arch = "x86_64") {
            AUDIT_ARCH_X86_64
        } else {
            0xC000_00B7
        };
        bpf_programs()
            .unwrap()
            .iter()
            .map(|p| run_bpf(p, arch, nr, args))
            .min_by_key(|r| (r & libc::SECCOMP_RET_ACTION_FULL) as i32)
            .unwrap()
    }

    const EPERM: u32 = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;

    #[test]
    fn sockets_of_unused_families_are_refused() {
        let sock = |nr: i64, family: u64| verdict(nr as u32, [family, 1, 0, 0, 0, 0]);
        for nr in [libc::SYS_socket, libc::SYS_socketpair] {
            for family in [
                libc::AF_VSOCK as u64,
                0,
                3,
                17,
                38,
                44,
                0xffff_ffff,
                1 << 32 | 40,
            ] {
                assert_eq!(sock(nr, family), EPERM, "nr {nr} family {family:#x}");
            }
            for family in ALLOWED_SOCKET_FAMILIES {
                assert_eq!(sock(nr, family), libc::SECCOMP_RET_ALLOW, "{family}");
            }
        }
        let p = oci_profile();
        let socket_rules: Vec<_> = p["syscalls"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["names"][0] == "socket")
            .collect();
        let refused = |v: u64| {
            socket_rules.iter().any(|r| {
                let c = &r["args"][0];
                let value = c["value"].as_u64().unwrap();
                match c["op"].as_str().unwrap() {
                    "SCMP_CMP_EQ" => v == value,
                    "SCMP_CMP_GE" => v >= value,
                    op => panic!("{op}"),
                }
            })
        };
        for v in 0..64u64 {
            assert_eq!(refused(v), !ALLOWED_SOCKET_FAMILIES.contains(&v), "{v}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_x32_abi_is_refused_whole() {
        for nr in [
            libc::SYS_getpid as u32,
            521,
            528,
            533,
            539,
            540,
            547,
            0x3fff_ffff,
        ] {
            assert_eq!(verdict(X32_SYSCALL_BIT | nr, [0; 6]), EPERM, "x32 {nr}");
        }
        assert_eq!(
            verdict(libc::SYS_getpid as u32, [0; 6]),
            libc::SECCOMP_RET_ALLOW
        );
        assert_eq!(verdict(libc::SYS_kexec_load as u32, [0; 6]), EPERM);
        let p = oci_profile();
        assert!(
            !p["architectures"]
                .as_array()
                .unwrap()
                .iter()
                .any(|a| a == "SCMP_ARCH_X32"),
            "{p}"
        );
    }
}
