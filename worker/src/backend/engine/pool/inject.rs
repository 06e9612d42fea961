//! A claim's mounts ([`super`], step 2): the job directory and the workspace cloned on the
//! host, `nosuid,nodev` (read-only where the spec says) set on the detached copies, then
//! moved onto the container's placeholders from a thread inside its mount namespace, and
//! `/.cynode` detached. For Podman, the job's uid also gets passwd and group entries when
//! the image has none, as a cold container's does.
//!
//! Nothing here follows a link out of what it is given: the host directories are opened
//! without following a final link, and the placeholders (in the image, which a job's
//! author chose) are opened `O_PATH|O_NOFOLLOW`.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags, CWD};
use rustix::mount::{self as rmount, MoveMountFlags, OpenTreeFlags, UnmountFlags};

use super::CTL_MOUNT;

/// The uid whose passwd and group entries a Podman job gets when the image has none, and
/// the slot directory the files are made in.
#[derive(Debug)]
pub(super) struct Identity {
    pub uid: u32,
    pub workdir: String,
    pub dir: PathBuf,
}

/// `what: error`, for the claim's failure reason.
fn ctx(what: &'static str) -> impl Fn(rustix::io::Errno) -> std::io::Error {
    move |e| {
        let e = std::io::Error::from(e);
        std::io::Error::new(e.kind(), format!("{what}: {e}"))
    }
}

/// A detached clone of the mount tree at `host` (recursive when `recursive`), with `set`
/// mount attributes on all of it.
pub(super) fn clone_tree(host: &Path, recursive: bool, set: u64) -> std::io::Result<OwnedFd> {
    let mut flags = OpenTreeFlags::OPEN_TREE_CLONE
        | OpenTreeFlags::OPEN_TREE_CLOEXEC
        | OpenTreeFlags::AT_SYMLINK_NOFOLLOW;
    if recursive {
        flags |= OpenTreeFlags::AT_RECURSIVE;
    }
    let tree = rmount::open_tree(CWD, host, flags).map_err(ctx("open_tree"))?;
    set_attrs(&tree, set)?;
    Ok(tree)
}

/// Moves the detached `tree` onto `target` (opened without following a link) in the
/// calling thread's mount namespace.
pub(super) fn move_onto<P: rustix::path::Arg>(
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

/// `passwd` and `group` in the slot directory (new, root's, 0644), each open for writing
/// and cloned as a read-only mount, made on the host before the thread enters the
/// container (a mount can only be cloned in its own namespace).
fn identity_files(id: &Identity) -> std::io::Result<Vec<(&'static str, std::fs::File, OwnedFd)>> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut out = Vec::new();
    for name in ["passwd", "group"] {
        let host = id.dir.join(name);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&host)?;
        let tree = clone_tree(
            &host,
            false,
            MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
        )?;
        out.push((name, f, tree));
    }
    Ok(out)
}

/// In the container's mount namespace: for each of /etc/passwd and /etc/group that exists
/// and has no entry for the uid, writes the image's file plus Podman's line into the host
/// file and mounts it over the image's. Blocking; the calling thread is in the container.
fn add_identity(
    id: &Identity,
    files: &[(&'static str, std::fs::File, OwnedFd)],
) -> std::io::Result<()> {
    use std::io::{Read, Write};
    use std::os::unix::fs::OpenOptionsExt;
    for (name, file, tree) in files {
        let target = format!("/etc/{name}");
        let Ok(image) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&target)
        else {
            continue;
        };
        let mut text = Vec::new();
        image.take(1024 * 1024).read_to_end(&mut text)?;
        let uid = id.uid.to_string();
        let has = text
            .split(|b| *b == b'\n')
            .any(|l| l.split(|b| *b == b':').nth(2) == Some(uid.as_bytes()));
        if has {
            continue;
        }
        if !text.is_empty() && !text.ends_with(b"\n") {
            text.push(b'\n');
        }
        let line = if *name == "passwd" {
            format!(
                "{uid}:*:{uid}:{uid}:container user:{}:/bin/sh\n",
                id.workdir
            )
        } else {
            format!("{uid}:x:{uid}:{uid}\n")
        };
        text.extend_from_slice(line.as_bytes());
        let mut f = file;
        f.write_all(&text)?;
        move_onto(tree, target.as_str(), OFlags::empty())?;
    }
    Ok(())
}

/// Sets mount attributes on a detached tree (recursively). rustix has no
/// `mount_setattr`, so this one call is made by hand.
fn set_attrs(tree: &OwnedFd, set: u64) -> std::io::Result<()> {
    let attr = MountAttr {
        attr_set: set,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
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

/// The attributes of a job's directory in a container: `nosuid,nodev`, and read-only
/// unless `writable`.
pub(super) fn job_attrs(writable: bool) -> u64 {
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
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_NOEXEC: u64 = 0x8;

/// Clones each host directory's mount tree, then, on a thread of its own in the
/// container's mount namespace (entered through `pidfd`), moves each clone onto its
/// placeholder and detaches `/.cynode`. Blocking.
pub(super) fn inject(
    pidfd: &OwnedFd,
    mounts: &[(PathBuf, String, bool)],
    identity: Option<Identity>,
) -> std::io::Result<()> {
    let files = match &identity {
        Some(id) => identity_files(id)?,
        None => Vec::new(),
    };
    let mut trees = Vec::with_capacity(mounts.len());
    for (host, target, writable) in mounts {
        trees.push((
            clone_tree(host, true, job_attrs(*writable))?,
            target.as_str(),
        ));
    }
    std::thread::scope(|s| {
        s.spawn(|| -> std::io::Result<()> {
            // SAFETY: this thread only gets an fs struct of its own (its working directory
            // and root stop being shared with the process), then enters the container's
            // mount namespace; it ends right after, and nothing else runs on it.
            unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::FS) }
                .map_err(ctx("unshare"))?;
            rustix::thread::move_into_thread_name_spaces(
                pidfd.as_fd(),
                rustix::thread::ThreadNameSpaceType::MOUNT,
            )
            .map_err(ctx("setns"))?;
            for (tree, target) in &trees {
                // The placeholder goes, so the job's mount table is a cold job's.
                rmount::unmount(*target, UnmountFlags::DETACH)
                    .map_err(ctx("umount the placeholder"))?;
                move_onto(tree, *target, OFlags::DIRECTORY)?;
            }
            if let Some(id) = &identity {
                add_identity(id, &files)?;
            }
            rmount::unmount(CTL_MOUNT, UnmountFlags::DETACH).map_err(ctx("umount /.cynode"))?;
            Ok(())
        })
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("mount thread panicked")))
    })
}
