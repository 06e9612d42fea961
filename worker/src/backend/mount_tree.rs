//! Detached mount trees, for the warm sandboxes that receive a job's directories after
//! they were made (the engines' pools, warm bwrap sandboxes): a host directory's mount
//! tree cloned with `open_tree`, attributes set on the detached copy with
//! `mount_setattr`, and the copy moved onto a mount point inside the sandbox's mount
//! namespace from a thread of its own that entered it.
//!
//! Nothing here follows a link: the host directory is opened without following a final
//! link, and the mount point (in an image, which a job's author chose) `O_PATH|O_NOFOLLOW`.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;

use rustix::fs::{Mode, OFlags, CWD};
use rustix::mount::{self as rmount, MoveMountFlags, OpenTreeFlags};

/// `what: error`, for a claim's failure reason.
pub fn ctx(what: &'static str) -> impl Fn(rustix::io::Errno) -> std::io::Error {
    move |e| {
        let e = std::io::Error::from(e);
        std::io::Error::new(e.kind(), format!("{what}: {e}"))
    }
}

/// A detached clone of the mount tree at `host` (recursive when `recursive`), with `set`
/// mount attributes on all of it.
pub fn clone_tree(host: &Path, recursive: bool, set: u64) -> std::io::Result<OwnedFd> {
    clone_tree_at(CWD, host, recursive, set)
}

/// [`clone_tree`] of `path` beneath the directory `dir` (a detached mount of the caller's
/// own included).
pub fn clone_tree_at<P: rustix::path::Arg>(
    dir: impl AsFd,
    path: P,
    recursive: bool,
    set: u64,
) -> std::io::Result<OwnedFd> {
    let mut flags = OpenTreeFlags::OPEN_TREE_CLONE
        | OpenTreeFlags::OPEN_TREE_CLOEXEC
        | OpenTreeFlags::AT_SYMLINK_NOFOLLOW;
    if recursive {
        flags |= OpenTreeFlags::AT_RECURSIVE;
    }
    let tree = rmount::open_tree(dir, path, flags).map_err(ctx("open_tree"))?;
    set_attrs(&tree, set)?;
    Ok(tree)
}

/// Moves the detached `tree` onto `target` (opened without following a link) in the
/// calling thread's mount namespace.
pub fn move_onto<P: rustix::path::Arg>(
    tree: &OwnedFd,
    target: P,
    flags: OFlags,
) -> std::io::Result<()> {
    let t = rustix::fs::open(
        target,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC | flags,
        Mode::empty(),
    )
    .map_err(ctx("open the mount point"))?;
    rmount::move_mount(
        tree,
        "",
        &t,
        "",
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
    )
    .map_err(ctx("move_mount"))
}

/// Runs `f` on a thread of its own inside the mount namespace of the process `pidfd`
/// refers to, and waits for it. Blocking.
pub fn in_mount_namespace<F>(pidfd: &OwnedFd, f: F) -> std::io::Result<()>
where
    F: FnOnce() -> std::io::Result<()> + Send,
{
    std::thread::scope(|s| {
        s.spawn(|| -> std::io::Result<()> {
            // SAFETY: this thread only gets an fs struct of its own (its working directory
            // and root stop being shared with the process), then enters the sandbox's
            // mount namespace; it ends right after, and nothing else runs on it.
            unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::FS) }
                .map_err(ctx("unshare"))?;
            rustix::thread::move_into_thread_name_spaces(
                pidfd.as_fd(),
                rustix::thread::ThreadNameSpaceType::MOUNT,
            )
            .map_err(ctx("setns"))?;
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("mount thread panicked")))
    })
}

/// Sets mount attributes on a detached tree (recursively). rustix has no
/// `mount_setattr`, so this one call is made by hand.
fn set_attrs(tree: &OwnedFd, set: u64) -> std::io::Result<()> {
    mount_setattr(
        tree,
        MountAttr {
            attr_set: set,
            attr_clr: 0,
            propagation: 0,
            userns_fd: 0,
        },
    )
}

/// Idmaps a detached tree (recursively) with the id mapping of the user namespace
/// `userns` ([`super::idmap::mapping`]): a file of an id the mapping names is shown, and
/// created, as the id it maps to.
pub fn set_idmap(tree: &OwnedFd, userns: &OwnedFd) -> std::io::Result<()> {
    mount_setattr(
        tree,
        MountAttr {
            attr_set: MOUNT_ATTR_IDMAP,
            attr_clr: 0,
            propagation: 0,
            userns_fd: userns.as_raw_fd() as u64,
        },
    )
}

fn mount_setattr(tree: &OwnedFd, attr: MountAttr) -> std::io::Result<()> {
    // SAFETY: mount_setattr on our detached tree with a valid attr struct and its size.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_fd().as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint | AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        return Err(std::io::Error::new(e.kind(), format!("mount_setattr: {e}")));
    }
    Ok(())
}

/// The attributes of a job's directory in a sandbox: `nosuid,nodev`, and read-only
/// unless `writable` (what bwrap's `--bind` and `--ro-bind` set, and the engines' mounts).
pub fn job_attrs(writable: bool) -> u64 {
    let mut set = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
    if !writable {
        set |= MOUNT_ATTR_RDONLY;
    }
    set
}

/// `struct mount_attr` of mount_setattr(2).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

const AT_RECURSIVE: libc::c_uint = 0x8000;
pub const MOUNT_ATTR_RDONLY: u64 = 0x1;
pub const MOUNT_ATTR_NOSUID: u64 = 0x2;
pub const MOUNT_ATTR_NODEV: u64 = 0x4;
pub const MOUNT_ATTR_NOEXEC: u64 = 0x8;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
