//! How a step's process is started. Everything the child would do between `fork` and
//! `exec` is done in the runner instead, so std can start it with `posix_spawn` (a
//! vfork-like clone that copies none of the runner's page tables) rather than `fork`:
//!
//! - a bare program name is looked up in the runner on the step's own `PATH`, as
//!   `execvp` would in the child, so the child needs no `PATH` walk;
//! - the child changes directory only when the runner is not already in the step's
//!   directory (the sandbox starts the runner in `/workspace`, the usual step directory).
//!   A statically linked glibc offers std no `posix_spawn` chdir action, so a step in
//!   another directory is still forked, through `/proc/self/fd/N` of the step's fd;
//! - a file the kernel will not execute (`ENOEXEC`, a script without `#!`) is run by
//!   `/bin/sh`, as `execvp` does and `posix_spawn` does not;
//! - where `posix_spawn` is refused with `EPERM` (a seccomp filter that denies `clone3`
//!   so, as gVisor does with the node's profile), the child is forked after all.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::{Access, Mode, OFlags};

/// The shell a file without `#!` is run by.
const SHELL: &str = "/bin/sh";

/// Where to find `program`: itself when it names a path, else the first executable file
/// of that name in the absolute entries of `PATH` from `env`. `None` when a relative entry
/// comes first or nothing is found: the child then searches, as before.
pub fn resolve(program: &str, env: &[(String, String)]) -> Option<PathBuf> {
    if program.contains('/') || program.is_empty() {
        return None;
    }
    let path = env.iter().rev().find(|(k, _)| k == "PATH")?.1.as_str();
    for dir in path.split(':') {
        if !dir.starts_with('/') {
            return None;
        }
        let candidate = Path::new(dir).join(program);
        if is_executable_file(&candidate) {
            return Some(candidate);
        }
    }
    None
}

fn is_executable_file(p: &Path) -> bool {
    rustix::fs::access(p, Access::EXEC_OK).is_ok()
        && rustix::fs::stat(p).is_ok_and(|st| {
            rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile
        })
}

/// True when `dir` is the runner's own working directory, so the child starts there
/// without changing directory.
pub fn is_current_dir(dir: BorrowedFd<'_>) -> bool {
    let here = rustix::fs::open(
        ".",
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    );
    match (here.and_then(rustix::fs::fstat), rustix::fs::fstat(dir)) {
        (Ok(a), Ok(b)) => a.st_dev == b.st_dev && a.st_ino == b.st_ino,
        _ => false,
    }
}

/// Sets `cmd`'s working directory to `dir` unless the runner is already there.
pub fn set_dir(cmd: &mut Command, dir: BorrowedFd<'_>) {
    if !is_current_dir(dir) {
        cmd.current_dir(format!("/proc/self/fd/{}", dir.as_raw_fd()));
    }
}

/// Spawns `build(program, leading args)`; when the kernel refuses the file as not
/// executable, spawns it again as `/bin/sh program args…`.
pub fn spawn(program: &str, build: impl Fn(&str, &[&str]) -> Command) -> io::Result<Child> {
    match start(build(program, &[])) {
        Err(e) if e.raw_os_error() == Some(libc::ENOEXEC) && program != SHELL => {
            start(build(SHELL, &[program])).map_err(|_| e)
        }
        other => other,
    }
}

/// Spawns `cmd`, and when that fails with `EPERM` spawns it again through `fork`. A
/// seccomp filter that answers `clone3` with `EPERM` rather than `ENOSYS` (gVisor applying
/// the node's OCI profile; older container profiles) makes glibc's `posix_spawn` fail
/// where a fork works. A real `EPERM` from `execve` fails the same way twice.
/// Once that has happened, the runner's later steps are forked straight away.
fn start(mut cmd: Command) -> io::Result<Child> {
    static FORK_ONLY: AtomicBool = AtomicBool::new(false);
    let fork = |cmd: &mut Command| {
        // SAFETY: the closure does nothing; its presence makes std fork and exec.
        unsafe {
            cmd.pre_exec(|| Ok(()));
        }
        cmd.spawn()
    };
    if FORK_ONLY.load(Ordering::Relaxed) {
        return fork(&mut cmd);
    }
    match cmd.spawn() {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
            FORK_ONLY.store(true, Ordering::Relaxed);
            fork(&mut cmd)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;

    fn env(path: &str) -> Vec<(String, String)> {
        vec![("PATH".into(), path.into())]
    }

    #[test]
    fn a_bare_name_is_found_on_the_steps_path_in_order() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        for d in [&a, &b] {
            let p = d.path().join("tool");
            std::fs::write(&p, "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .unwrap();
        }
        // Not executable, so skipped, as execvp skips it.
        std::fs::write(a.path().join("data"), "").unwrap();
        let path = format!("{}:{}", a.path().display(), b.path().display());
        assert_eq!(resolve("tool", &env(&path)), Some(a.path().join("tool")));
        assert_eq!(resolve("data", &env(&path)), None);
        assert_eq!(
            resolve("./tool", &env(&path)),
            None,
            "a path is the child's to open"
        );
        let later = env(&path)
            .into_iter()
            .chain(env(&b.path().display().to_string()));
        assert_eq!(
            resolve("tool", &later.collect::<Vec<_>>()),
            Some(b.path().join("tool")),
            "the last PATH the step sets wins, as in the child's environment"
        );
        let relative_first = format!("bin:{}", a.path().display());
        assert_eq!(resolve("tool", &env(&relative_first)), None);
        assert_eq!(resolve("tool", &[]), None);
    }

    #[test]
    fn the_current_directory_is_recognised_and_another_is_not() {
        let here = rustix::fs::open(".", OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap();
        assert!(is_current_dir(here.as_fd()));
        let other = tempfile::tempdir().unwrap();
        let there = rustix::fs::open(
            other.path(),
            OFlags::PATH | OFlags::DIRECTORY,
            Mode::empty(),
        )
        .unwrap();
        assert!(!is_current_dir(there.as_fd()));
    }
}
