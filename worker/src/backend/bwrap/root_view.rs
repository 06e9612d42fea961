//! The root a bwrap sandbox sees as `/`: a read-only overlay of the image's root
//! filesystem directory, made by the node, so that nothing inside names where the image
//! lives on the host.
//!
//! A bind mount's root in mountinfo is its source's path in the filesystem that holds it:
//! `--ro-bind /var/cache/…/rootfs/<id> /` shows that path to every process inside
//! (`/proc/self/mountinfo`, field 4). An overlay is a filesystem of its own, so the root
//! of its mount is `/`; and its layers are given as descriptors of mounts that are
//! attached nowhere (`open_tree(OPEN_TREE_CLONE)` of the directory, and an empty tmpfs
//! from `fsopen`/`fsmount`, since a read-only overlay needs two lower layers), so its
//! options read `lowerdir+=/,lowerdir+=/`, a path in each detached mount.
//!
//! One view per root filesystem directory, made at its first use and kept until the node
//! stops: attached at `<state>/roots/<hash of the directory's path>` (the directory is
//! 0711 and each view 0755, so bwrap, started as a workspace's uid, can reach it), read
//! only, `nosuid` and `nodev`. The node's stop and the janitor unmount them with the
//! node's volumes ([`crate::loopfs::release_node`], by place, never following a link). A
//! node that is not root, or a kernel without these calls, binds the directory as before
//! and says so once in its log (the mountinfo residual in THREAT_MODEL).

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rustix::fs::{Mode, OFlags, CWD};
use rustix::mount::{
    self as rmount, FsMountFlags, FsOpenFlags, MountAttrFlags, MoveMountFlags, OpenTreeFlags,
    UnmountFlags,
};

use crate::loopfs::ROOTS_DIR;

/// The node's root views, by root filesystem directory.
#[derive(Debug)]
pub struct RootViews {
    dir: PathBuf,
    made: Mutex<HashMap<PathBuf, Option<PathBuf>>>,
}

impl RootViews {
    /// Views attached beneath `<state_dir>/roots`.
    pub fn new(state_dir: &Path) -> Self {
        Self {
            dir: state_dir.join(ROOTS_DIR),
            made: Mutex::new(HashMap::new()),
        }
    }

    /// What bwrap binds as `/` for `rootfs`: its view (made now if it is the first use),
    /// or `rootfs` itself where no view can be made.
    pub fn root_for(&self, rootfs: &Path) -> PathBuf {
        let mut made = self.made.lock().unwrap_or_else(|e| e.into_inner());
        let view = made.entry(rootfs.to_path_buf()).or_insert_with(|| {
            match make_view(&self.dir, rootfs) {
                Ok(at) => Some(at),
                Err(e) => {
                    tracing::warn!(rootfs = %rootfs.display(), error = %e, "no overlay view of the root filesystem: bwrap binds the directory, and mountinfo inside shows its path");
                    None
                }
            }
        });
        view.clone().unwrap_or_else(|| rootfs.to_path_buf())
    }
}

/// The place of `rootfs`'s view beneath `dir`: a hash of its path, so the name says
/// nothing of it.
pub fn place(dir: &Path, rootfs: &Path) -> PathBuf {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(rootfs.as_os_str().as_encoded_bytes());
    dir.join(hex::encode(&digest[..8]))
}

/// Makes the read-only overlay of `rootfs` and attaches it at [`place`] (replacing a
/// view a previous run of the node left there).
fn make_view(dir: &Path, rootfs: &Path) -> std::io::Result<PathBuf> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(std::io::Error::other("the node is not root"));
    }
    let overlay = detached_overlay(rootfs)?;
    std::fs::DirBuilder::new()
        .mode(0o711)
        .recursive(true)
        .create(dir)?;
    let at = place(dir, rootfs);
    match std::fs::DirBuilder::new().mode(0o755).create(&at) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            // A previous run's view, if the node was killed before it could let go.
            while rmount::unmount(&at, UnmountFlags::NOFOLLOW | UnmountFlags::DETACH).is_ok() {}
        }
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(&at)?;
    if !meta.is_dir() {
        return Err(std::io::Error::other("the view's place is not a directory"));
    }
    rmount::move_mount(
        overlay.as_fd(),
        "",
        CWD,
        &at,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )?;
    Ok(at)
}

/// A read-only overlay of `rootfs` (over an empty layer), attached nowhere.
fn detached_overlay(rootfs: &Path) -> std::io::Result<OwnedFd> {
    let dir = rustix::fs::open(
        rootfs,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let image = rmount::open_tree(
        &dir,
        "",
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC
            | OpenTreeFlags::AT_EMPTY_PATH,
    )?;
    let empty = {
        let fs = rmount::fsopen("tmpfs", FsOpenFlags::FSOPEN_CLOEXEC)?;
        rmount::fsconfig_set_string(&fs, "size", "4k")?;
        rmount::fsconfig_set_string(&fs, "mode", "0755")?;
        rmount::fsconfig_create(&fs)?;
        rmount::fsmount(
            &fs,
            FsMountFlags::FSMOUNT_CLOEXEC,
            MountAttrFlags::MOUNT_ATTR_RDONLY,
        )?
    };
    let fs = rmount::fsopen("overlay", FsOpenFlags::FSOPEN_CLOEXEC)?;
    for layer in [&image, &empty] {
        rmount::fsconfig_set_fd(&fs, "lowerdir+", layer.as_fd())?;
    }
    rmount::fsconfig_create(&fs)?;
    Ok(rmount::fsmount(
        &fs,
        FsMountFlags::FSMOUNT_CLOEXEC,
        MountAttrFlags::MOUNT_ATTR_RDONLY
            | MountAttrFlags::MOUNT_ATTR_NOSUID
            | MountAttrFlags::MOUNT_ATTR_NODEV,
    )?)
}
