//! User namespaces that exist only for their id mapping, the argument of an idmapped mount
//! ([`super::mount_tree::set_idmap`]): the microVM's share shows a workspace of host uid
//! N to QEMU and the guest as uid 1000, and what they create there is stored as N.
//!
//! A namespace is made by a child cloned into it (`clone(CLONE_NEWUSER)`, which a
//! multi-threaded process may do, unlike `unshare`): the child only blocks on a pipe, so
//! it runs nothing but async-signal-safe calls. The node writes its `uid_map` and
//! `gid_map` (one line each, the node being root in the initial namespace), opens
//! `/proc/<child>/ns/user`, and ends the child: the descriptor keeps the namespace.

use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};

/// A user namespace mapping uid and gid `from` (inside it) to `to` (outside): through a
/// mount idmapped with it, a file owned by `from` is shown as owned by `to`, and a file
/// created by `to` is stored as `from`. Blocking (a child's start and end).
pub fn mapping(from: u32, to: u32) -> std::io::Result<OwnedFd> {
    let mut pipe = [0; 2];
    // SAFETY: an array of two ints.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both ends are ours from here on.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };
    // SAFETY: a clone without a new stack behaves as fork; the child only reads its pipe
    // and exits (async-signal-safe calls), so the parent's threads do not matter to it.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_NEWUSER | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if pid == 0 {
        let mut b = [0u8; 1];
        // SAFETY: blocking on our pipe until the parent closes its end, then leaving
        // without unwinding or running any destructor.
        unsafe {
            libc::close(pipe[1]);
            libc::read(pipe[0], b.as_mut_ptr().cast(), 1);
            libc::_exit(0);
        }
    }
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    drop(read_end);
    let pid = pid as libc::pid_t;
    let opened = (|| {
        let proc = std::path::PathBuf::from(format!("/proc/{pid}"));
        for map in ["uid_map", "gid_map"] {
            std::fs::OpenOptions::new()
                .write(true)
                .open(proc.join(map))?
                .write_all(format!("{from} {to} 1\n").as_bytes())?;
        }
        let ns = std::fs::File::open(proc.join("ns/user"))?;
        Ok(OwnedFd::from(ns))
    })();
    drop(write_end);
    let mut status = 0;
    // SAFETY: reaping the child we cloned.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    opened
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::mount_tree::{clone_tree, move_onto, set_idmap};
    use std::os::unix::fs::MetadataExt;

    /// Through a mount idmapped with `mapping(N, 1000)`, a file of N is 1000's (the node
    /// runs as root, as it must to mount).
    #[test]
    fn an_idmapped_mount_shows_the_mapped_owner() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        std::fs::create_dir(&src).unwrap();
        std::fs::create_dir(&dst).unwrap();
        let f = src.join("f");
        std::fs::write(&f, b"x").unwrap();
        std::os::unix::fs::chown(&f, Some(4_000_123), Some(4_000_123)).unwrap();
        let tree = clone_tree(&src, false, 0).unwrap();
        set_idmap(&tree, &mapping(4_000_123, 1000).unwrap()).unwrap();
        move_onto(&tree, &dst, rustix::fs::OFlags::DIRECTORY).unwrap();
        let shown = std::fs::metadata(dst.join("f"));
        rustix::mount::unmount(&dst, rustix::mount::UnmountFlags::DETACH).unwrap();
        let shown = shown.unwrap();
        assert_eq!((shown.uid(), shown.gid()), (1000, 1000));
        let kept = std::fs::metadata(&f).unwrap();
        assert_eq!((kept.uid(), kept.gid()), (4_000_123, 4_000_123));
    }
}
