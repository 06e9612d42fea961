//! A claim's mounts ([`super`], step 2): the job directory and the workspace cloned on the
//! host, `nosuid,nodev` (read-only where the spec says) set on the detached copies, then
//! moved onto the container's placeholders from a thread inside its mount namespace, and
//! `/.cynode` detached. For Podman, the job's uid also gets passwd and group entries when
//! the image has none, as a cold container's does, from files on a detached tmpfs of the
//! claim's own (so their mounts name no host path).
//!
//! Nothing here follows a link out of what it is given: the host directories are opened
//! without following a final link, and the placeholders (in the image, which a job's
//! author chose) are opened `O_PATH|O_NOFOLLOW`.

use std::os::fd::OwnedFd;
use std::path::PathBuf;

use rustix::fs::{Mode, OFlags};
use rustix::mount::{self as rmount, FsMountFlags, FsOpenFlags, MountAttrFlags, UnmountFlags};

use super::CTL_MOUNT;
use crate::backend::mount_tree::{
    clone_tree, clone_tree_at, ctx, in_mount_namespace, job_attrs, move_onto, MOUNT_ATTR_NODEV,
    MOUNT_ATTR_NOEXEC, MOUNT_ATTR_NOSUID, MOUNT_ATTR_RDONLY,
};
use crate::sandbox::{JOB_MOUNT, WORKSPACE_MOUNT};

/// The uid whose passwd and group entries a Podman job gets when the image has none.
#[derive(Debug)]
pub(super) struct Identity {
    pub uid: u32,
    pub workdir: String,
}

/// The most the claim's tmpfs holds: the image's `passwd` and `group` are read up to
/// 1 MiB each ([`add_identity`]), plus one line each.
const IDENTITY_FS_SIZE: &str = "4m";

/// `passwd` and `group` (new, root's, 0644), each open for writing and cloned as a
/// read-only mount, made on the host before the thread enters the container (a mount can
/// only be cloned in its own namespace).
///
/// They are made on a tmpfs of the claim's own that is mounted nowhere (`fsopen` and
/// `fsmount` give a detached mount, the files are created beneath its descriptor): the
/// root of each clone in the job's mountinfo is then `/passwd` or `/group` of that tmpfs,
/// which names nothing of the host. The tmpfs lives as long as a clone of it is mounted
/// or one of these descriptors is open, so it goes with the container's mount namespace
/// (or with the descriptors when the image had the entries), and nothing of it is ever
/// mounted on the host.
fn identity_files() -> std::io::Result<Vec<(&'static str, std::fs::File, OwnedFd)>> {
    let fs = rmount::fsopen("tmpfs", FsOpenFlags::FSOPEN_CLOEXEC).map_err(ctx("fsopen tmpfs"))?;
    for (key, value) in [
        ("source", "tmpfs"),
        ("size", IDENTITY_FS_SIZE),
        ("nr_inodes", "16"),
        ("mode", "0755"),
    ] {
        rmount::fsconfig_set_string(&fs, key, value).map_err(ctx("fsconfig tmpfs"))?;
    }
    rmount::fsconfig_create(&fs).map_err(ctx("create the tmpfs"))?;
    let root = rmount::fsmount(
        &fs,
        FsMountFlags::FSMOUNT_CLOEXEC,
        MountAttrFlags::MOUNT_ATTR_NOSUID
            | MountAttrFlags::MOUNT_ATTR_NODEV
            | MountAttrFlags::MOUNT_ATTR_NOEXEC,
    )
    .map_err(ctx("fsmount tmpfs"))?;
    let mode = Mode::from_raw_mode(0o644);
    let mut out = Vec::new();
    for name in ["passwd", "group"] {
        let fd = rustix::fs::openat(
            &root,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            mode,
        )
        .map_err(ctx("create the identity file"))?;
        // 0644 whatever the node's umask.
        rustix::fs::fchmod(&fd, mode).map_err(ctx("chmod the identity file"))?;
        let tree = clone_tree_at(
            &root,
            name,
            false,
            MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
        )?;
        out.push((name, std::fs::File::from(fd), tree));
    }
    Ok(out)
}

/// In the container's mount namespace: for each of /etc/passwd and /etc/group that exists
/// and has no entry for the uid, writes the image's file plus Podman's line into the
/// claim's file and mounts it over the image's. Blocking; the calling thread is in the container.
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

/// Clones each host directory's mount tree, then, on a thread of its own in the
/// container's mount namespace (entered through `pidfd`), moves each clone onto its
/// placeholder, detaches the placeholders no clone takes (a session has no `/job`: its
/// empty directory stays, and no mount naming the node's state directory) and `/.cynode`.
/// Blocking.
pub(super) fn inject(
    pidfd: &OwnedFd,
    mounts: &[(PathBuf, String, bool)],
    identity: Option<Identity>,
) -> std::io::Result<()> {
    let files = match &identity {
        Some(_) => identity_files()?,
        None => Vec::new(),
    };
    let mut trees = Vec::with_capacity(mounts.len());
    for (host, target, writable) in mounts {
        trees.push((
            clone_tree(host, true, job_attrs(*writable))?,
            target.as_str(),
        ));
    }
    in_mount_namespace(pidfd, || {
        for (tree, target) in &trees {
            // The placeholder goes, so the job's mount table is a cold job's.
            rmount::unmount(*target, UnmountFlags::DETACH)
                .map_err(ctx("umount the placeholder"))?;
            move_onto(tree, *target, OFlags::DIRECTORY)?;
        }
        for placeholder in [JOB_MOUNT, WORKSPACE_MOUNT] {
            if !trees.iter().any(|(_, t)| *t == placeholder) {
                rmount::unmount(placeholder, UnmountFlags::DETACH)
                    .map_err(ctx("umount an unused placeholder"))?;
            }
        }
        if let Some(id) = &identity {
            add_identity(id, &files)?;
        }
        rmount::unmount(CTL_MOUNT, UnmountFlags::DETACH).map_err(ctx("umount /.cynode"))?;
        Ok(())
    })
}
