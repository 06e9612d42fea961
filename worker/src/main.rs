//! Thin binary shim for cynode-worker: the command line ([`cli`]) over the library.

mod cli;

fn main() {
    // Descriptors this process inherited without close-on-exec (a shell's, a supervisor's)
    // would pass through every client to every sandbox: none is the node's to hand on.
    // SAFETY: close_range only sets a flag on descriptors; nothing else runs yet.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        );
    }
    match cli::main() {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("cynode-worker: {e:#}");
            std::process::exit(1);
        }
    }
}
