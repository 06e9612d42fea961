//! A volume's image: a sparse file the node creates itself (`O_CREAT | O_EXCL`, never a
//! name a sandbox could reach), formatted with `mke2fs` (e2fsprogs) before anything else
//! touches it, then bound to a loop device and mounted detached (`fsopen`/`fsmount`): the
//! result is a mount fd nobody sees until it is moved onto a directory.
//!
//! The filesystem is ext4 without a journal (scratch space, rebuilt rather than repaired),
//! no reserved blocks (the sandbox user would not get them anyway), the inode count from
//! `limits.disk_max_files`, and its root owned by the sandbox user. Mounted `nosuid`,
//! `nodev` and `noinit_itable`, without `discard`: blocks the job frees stay allocated in
//! the image (never more than its size), so the image's allocation is the volume's
//! high-water mark, which tells the guard a volume filled even when what filled it (a
//! file unlinked and held open) is gone by the time it looks.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use rustix::fs::{self as rfs, Mode, OFlags};
use rustix::mount::{self as rmount, FsMountFlags, FsOpenFlags, MountAttrFlags};

use super::loopdev;

/// Bytes per inode in ext4's inode table (mke2fs's default inode size).
const INODE_BYTES: u64 = 256;
/// Room for the superblock copies, group descriptors, bitmaps and root directory.
const FIXED_OVERHEAD: u64 = 2 * 1024 * 1024;
/// The smallest image mke2fs formats comfortably.
const MIN_BYTES: u64 = 8 * 1024 * 1024;
const MIB: u64 = 1024 * 1024;

/// The shape of a volume, from the node's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// The image's size: what the volume can ever take on the host.
    pub image_bytes: u64,
    /// Inodes: files and directories it can hold.
    pub inodes: u64,
    /// Owner of its root directory.
    pub owner: u32,
}

impl Shape {
    /// A volume for `disk_mb` and `max_files`: the data limit plus room for the inode
    /// table and fixed metadata, never more than 1.05 × the limit (the host never gives
    /// a sandbox more than that; the inode table then comes out of the limit).
    pub fn new(disk_mb: u64, max_files: u64, owner: u32) -> Shape {
        let limit = disk_mb.saturating_mul(MIB);
        let inodes = max_files.clamp(64, 1 << 31);
        let wanted = limit
            .saturating_add(inodes.saturating_mul(INODE_BYTES))
            .saturating_add(FIXED_OVERHEAD);
        let cap = limit.saturating_add(limit / 20);
        let bytes = wanted.min(cap).max(MIN_BYTES);
        Shape {
            image_bytes: bytes / 4096 * 4096,
            inodes,
            owner,
        }
    }
}

/// Why a volume could not be made.
#[derive(Debug, thiserror::Error)]
pub enum MakeError {
    #[error("cannot create the image {path}: {source}")]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("mke2fs: {0}")]
    Mkfs(String),
    #[error("loop device: {0}")]
    Loop(std::io::Error),
    #[error("mount: {0}")]
    Mount(std::io::Error),
}

/// The first mke2fs found on the usual system paths (the node runs it with a cleared
/// environment, so without PATH).
pub fn mke2fs() -> Option<&'static Path> {
    ["/usr/sbin/mke2fs", "/sbin/mke2fs", "/usr/bin/mke2fs"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.is_file())
}

/// Creates `path` (a new file) of `shape.image_bytes`, sparse, and formats it.
pub fn create(path: &Path, shape: Shape) -> Result<(), MakeError> {
    let created = |source| MakeError::Create {
        path: path.to_path_buf(),
        source,
    };
    let fd = rfs::open(
        path,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| created(e.into()))?;
    rfs::ftruncate(&fd, shape.image_bytes).map_err(|e| created(e.into()))?;
    drop(fd);
    let Some(mkfs) = mke2fs() else {
        return Err(MakeError::Mkfs("not installed (package e2fsprogs)".into()));
    };
    let out = Command::new(mkfs)
        .env_clear()
        .args([
            "-q", "-F", "-t", "ext4", "-m", "0", "-b", "4096", "-I", "256",
        ])
        .args(["-O", "^has_journal,^resize_inode"])
        .arg("-N")
        .arg(shape.inodes.to_string())
        .arg("-E")
        .arg(format!(
            "lazy_itable_init=1,nodiscard,root_owner={0}:{0}",
            shape.owner
        ))
        .arg("--")
        .arg(path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| MakeError::Mkfs(e.to_string()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(MakeError::Mkfs(format!(
            "{}: {}",
            out.status,
            err.chars().take(400).collect::<String>().trim()
        )));
    }
    Ok(())
}

/// Binds the new `image` to a loop device and mounts it detached: the mount's fd, to be
/// moved onto a directory with `move_mount`. Closing the fd unmounts it and frees the
/// device. The `lost+found` mke2fs made is removed, so the volume starts empty.
pub fn mount_detached(image: &Path) -> Result<OwnedFd, MakeError> {
    let mnt = mount_again(image, None)?;
    match rfs::unlinkat(mnt.as_fd(), "lost+found", rfs::AtFlags::REMOVEDIR) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(mnt),
        Err(e) => Err(MakeError::Mount(e.into())),
    }
}

/// Mounts the existing `image` detached, as it is (a sandbox's own `lost+found` stays):
/// through `device` when a loop device still holds it (a mount of the previous run held
/// elsewhere; the kernel gives both mounts the one filesystem), else bound to a new one.
pub fn mount_again(image: &Path, device: Option<&Path>) -> Result<OwnedFd, MakeError> {
    // The device stays open (and on the image) until the mount holds it.
    let (mut _held, mut _attached) = (None, None);
    let source = match device {
        Some(d) => {
            _held = Some(loopdev::hold(d, image).map_err(MakeError::Loop)?);
            d.to_path_buf()
        }
        None => {
            let file = rfs::open(
                image,
                OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| MakeError::Loop(e.into()))?;
            let dev = loopdev::attach(file.as_fd()).map_err(MakeError::Loop)?;
            let path = dev.path();
            _attached = Some(dev);
            path
        }
    };
    let m = |e: rustix::io::Errno| MakeError::Mount(e.into());
    let fs = rmount::fsopen("ext4", FsOpenFlags::FSOPEN_CLOEXEC).map_err(m)?;
    rmount::fsconfig_set_string(fs.as_fd(), "source", source.as_path()).map_err(m)?;
    rmount::fsconfig_set_flag(fs.as_fd(), "noinit_itable").map_err(m)?;
    rmount::fsconfig_set_string(fs.as_fd(), "errors", "remount-ro").map_err(m)?;
    rmount::fsconfig_create(fs.as_fd()).map_err(m)?;
    // The mount holds the device now; with autoclear, it detaches when the mount goes.
    rmount::fsmount(
        fs.as_fd(),
        FsMountFlags::FSMOUNT_CLOEXEC,
        MountAttrFlags::MOUNT_ATTR_NOSUID
            | MountAttrFlags::MOUNT_ATTR_NODEV
            | MountAttrFlags::MOUNT_ATTR_RELATIME,
    )
    .map_err(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_image_never_exceeds_105_percent_of_the_limit() {
        for (mb, files) in [
            (256, 4000),
            (256, 100_000),
            (48, 4000),
            (10 * 1024, 100_000),
            (1, 10),
        ] {
            let s = Shape::new(mb, files, 1000);
            let limit = mb * MIB;
            assert!(
                s.image_bytes <= (limit + limit / 20).max(MIN_BYTES),
                "{mb} MiB, {files} files: {s:?}"
            );
            assert_eq!(s.image_bytes % 4096, 0);
        }
        // Small inode tables fit on top of the limit.
        assert!(Shape::new(256, 4000, 1000).image_bytes > 256 * MIB);
    }
}
