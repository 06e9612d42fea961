//! Copies of a volume's image: a snapshot of a workspace's volume taken frozen
//! ([`snapshot_volume`]) and a new workspace volume made from one ([`volume_from`]).
//!
//! - A snapshot is the volume's image file copied while its filesystem is frozen
//!   (`FIFREEZE`, which also writes its dirty data to the image; thawed however the copy
//!   ends), so it is one consistent state of the filesystem whatever a sandbox still does.
//! - Copy-on-write where the backing filesystem allows: `FICLONE` shares the image's
//!   blocks (XFS with reflink, Btrfs). Elsewhere (ext4) the image's data extents are copied
//!   in the kernel (`SEEK_DATA`/`SEEK_HOLE` and `copy_file_range`: holes stay holes), never
//!   more than the image's size, which the node made (`limits.disk_mb`). [`CopyKind`] says
//!   which happened.
//! - Every image is the node's own, in directories no sandbox mounts: a snapshot goes to
//!   the snapshots directory, a fork's volume to `<state>/volumes/ws-<id>.img`, so a
//!   restarted node mounts it again ([`super::Volumes::reclaim`]). No filesystem is ever
//!   made from or mounted on a file a sandbox could write: the image's content is the
//!   sandbox's, but the file and the filesystem around it are the node's, as for every
//!   volume.

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{self as rfs, Mode, OFlags, SeekFrom};
use rustix::mount::{self as rmount, MoveMountFlags};

use super::{image, volume_image, VOLUMES};

/// `_IOWR('X', 119, int)`: freeze a filesystem (syncing it first).
const FIFREEZE: libc::c_ulong = 0xC004_5877;
/// `_IOWR('X', 120, int)`: thaw it.
const FITHAW: libc::c_ulong = 0xC004_5878;

/// How an image was copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// `FICLONE`: the blocks are shared, none copied.
    Reflink,
    /// The data extents were copied.
    Copy,
}

/// A snapshot's image, written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copied {
    pub how: CopyKind,
    /// Bytes the copy allocates on disk.
    pub bytes: u64,
}

/// Why a volume was not copied.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The directory is not one of this node's volumes (no volumes, or a plain directory).
    #[error("{0} is not a disk volume of this node")]
    NotAVolume(String),
    /// The image is larger than the bound.
    #[error("the volume's image is {size} bytes, over the bound of {cap} bytes")]
    TooLarge { size: u64, cap: u64 },
    /// The target exists already.
    #[error("{0} exists already")]
    Exists(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl From<rustix::io::Errno> for SnapshotError {
    fn from(e: rustix::io::Errno) -> Self {
        SnapshotError::Io(e.into())
    }
}

/// A frozen filesystem, thawed when dropped.
struct Frozen(OwnedFd);

impl Frozen {
    fn freeze(root: OwnedFd) -> std::io::Result<Frozen> {
        // SAFETY: FIFREEZE takes no argument memory; the fd is open.
        let r = unsafe { libc::ioctl(root.as_raw_fd(), FIFREEZE as _, 0) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Frozen(root))
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        // SAFETY: as above.
        let r = unsafe { libc::ioctl(self.0.as_raw_fd(), FITHAW as _, 0) };
        if r != 0 {
            tracing::error!(error = %std::io::Error::last_os_error(), "cannot thaw a frozen volume");
        }
    }
}

/// Copies the image of the volume whose root is `dir` to the new file `name` in `dest`
/// (a directory of the node's), its filesystem frozen meanwhile; at most `max_bytes`.
/// `while_frozen` runs once the filesystem is frozen and before the copy (the tree hash,
/// so it describes exactly the bytes copied); its error ends the snapshot with no copy.
/// Blocking. A copy that fails leaves no file.
pub fn snapshot_volume<T, E>(
    dir: &Path,
    dest: BorrowedFd<'_>,
    name: &OsStr,
    max_bytes: u64,
    while_frozen: impl FnOnce() -> Result<T, E>,
) -> Result<Result<(Copied, T), E>, SnapshotError> {
    let image =
        volume_image(dir).ok_or_else(|| SnapshotError::NotAVolume(dir.display().to_string()))?;
    let root = crate::fd_walk::open_node_dir(dir)?;
    let src = File::from(rfs::open(
        &image,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?);
    let dst = create_new(dest, name)?;
    let copied = (|| {
        let frozen = Frozen::freeze(root)?;
        let seen = match while_frozen() {
            Ok(seen) => seen,
            Err(e) => return Ok(Err(e)),
        };
        let how = clone_into(&src, &dst, max_bytes)?;
        drop(frozen);
        dst.sync_all()?;
        let bytes = allocated(&dst)?;
        Ok(Ok((Copied { how, bytes }, seen)))
    })();
    if !matches!(copied, Ok(Ok(_))) {
        let _ = rfs::unlinkat(dest, name, rfs::AtFlags::empty());
    }
    copied
}

/// Makes the directory `name` in `parent` (which must not exist) with a volume whose
/// image is a copy of `image` (a snapshot's), labelled `label` (`ws-<id>`): the copy is
/// `<state>/volumes/<label>.img`, mounted as it is. At most `max_bytes` are copied.
/// Blocking.
pub fn volume_from(
    image: &Path,
    parent: BorrowedFd<'_>,
    name: &OsStr,
    label: &str,
    max_bytes: u64,
) -> Result<CopyKind, SnapshotError> {
    let v = VOLUMES
        .get()
        .ok_or_else(|| SnapshotError::NotAVolume("this node has no disk volumes".into()))?;
    let src = File::from(rfs::open(
        image,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?);
    let vol_dir = crate::fd_walk::open_node_dir(&v.dir)?;
    let img_name = format!("{label}.img");
    let dst = create_new(vol_dir.as_fd(), OsStr::new(&img_name)).map_err(|e| match e {
        SnapshotError::Io(io) if io.kind() == std::io::ErrorKind::AlreadyExists => {
            SnapshotError::Exists(img_name.clone())
        }
        other => other,
    })?;
    let target = v.dir.join(&img_name);
    let made = (|| {
        let how = clone_into(&src, &dst, max_bytes)?;
        dst.sync_all()?;
        drop(dst);
        let mnt = image::mount_again(&target, None).map_err(std::io::Error::other)?;
        match rfs::mkdirat(parent, name, Mode::from_raw_mode(0o700)) {
            Ok(()) => {}
            Err(rustix::io::Errno::EXIST) => {
                return Err(SnapshotError::Exists(name.to_string_lossy().into_owned()))
            }
            Err(e) => return Err(e.into()),
        }
        if let Err(e) = rmount::move_mount(
            mnt.as_fd(),
            "",
            parent,
            name,
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        ) {
            let _ = rfs::unlinkat(parent, name, rfs::AtFlags::REMOVEDIR);
            return Err(e.into());
        }
        Ok(how)
    })();
    if made.is_err() {
        let _ = std::fs::remove_file(&target);
    }
    made
}

fn create_new(dir: BorrowedFd<'_>, name: &OsStr) -> Result<File, SnapshotError> {
    Ok(File::from(rfs::openat(
        dir,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?))
}

fn allocated(f: &File) -> std::io::Result<u64> {
    let st = rfs::fstat(f)?;
    Ok(u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512))
}

/// Copies `src` into the empty `dst`: a clone where the filesystem can, else its data
/// extents (holes kept); refused past `max_bytes` of image size.
fn clone_into(src: &File, dst: &File, max_bytes: u64) -> Result<CopyKind, SnapshotError> {
    let size = u64::try_from(rfs::fstat(src)?.st_size).unwrap_or(u64::MAX);
    if size > max_bytes {
        return Err(SnapshotError::TooLarge {
            size,
            cap: max_bytes,
        });
    }
    if rfs::ioctl_ficlone(dst, src).is_ok() {
        return Ok(CopyKind::Reflink);
    }
    rfs::ftruncate(dst, size)?;
    let mut pos = 0u64;
    while pos < size {
        let start = match rfs::seek(src, SeekFrom::Data(pos)) {
            Ok(p) => p,
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let end = rfs::seek(src, SeekFrom::Hole(start))?.min(size);
        let (mut off_in, mut off_out) = (start, start);
        while off_in < end {
            let want = usize::try_from(end - off_in)
                .unwrap_or(usize::MAX)
                .min(1 << 30);
            let n = rfs::copy_file_range(src, Some(&mut off_in), dst, Some(&mut off_out), want)?;
            if n == 0 {
                return Err(SnapshotError::Io(std::io::Error::other(
                    "the image ended while it was copied",
                )));
            }
        }
        pos = end;
    }
    Ok(CopyKind::Copy)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, Write};

    #[test]
    fn a_copy_keeps_data_and_holes_and_is_bounded() {
        let d = tempfile::tempdir().unwrap();
        let mut src = File::create(d.path().join("src")).unwrap();
        src.set_len(64 << 20).unwrap();
        src.seek(std::io::SeekFrom::Start(1 << 20)).unwrap();
        src.write_all(&[7u8; 4096]).unwrap();
        src.seek(std::io::SeekFrom::Start(40 << 20)).unwrap();
        src.write_all(b"end").unwrap();
        src.sync_all().unwrap();
        let src = File::open(d.path().join("src")).unwrap();
        let dst = File::create(d.path().join("dst")).unwrap();
        clone_into(&src, &dst, 64 << 20).unwrap();
        let a = std::fs::read(d.path().join("src")).unwrap();
        let b = std::fs::read(d.path().join("dst")).unwrap();
        assert!(a == b, "the copy differs");
        assert!(allocated(&dst).unwrap() < 8 << 20, "holes were filled");
        let dst2 = File::create(d.path().join("dst2")).unwrap();
        assert!(matches!(
            clone_into(&src, &dst2, 1 << 20),
            Err(SnapshotError::TooLarge { .. })
        ));
    }
}
