//! Host-side creation in directories a sandbox can write: every directory is made with
//! `mkdirat` and opened with `O_NOFOLLOW | O_DIRECTORY` beneath its parent's fd, every file
//! is created with `O_CREAT | O_EXCL | O_NOFOLLOW`, and owner and mode are set with
//! `fchown`/`fchmod` on the opened fd: a name a job planted as a link is never followed,
//! so no host path is created, written, chowned or chmodded through it.

use std::ffi::OsStr;
use std::io::Write;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{self as rfs, Mode, OFlags};
use rustix::io::Errno;

fn io(e: Errno) -> std::io::Error {
    std::io::Error::from(e)
}

fn named(name: &OsStr, what: &str, e: Errno) -> std::io::Error {
    std::io::Error::new(
        std::io::Error::from(e).kind(),
        format!("{}: {what}: {e}", Path::new(name).display()),
    )
}

/// Opens the node's own directory `path` (created by the node; links in its parents are
/// the operator's), refusing a link at its last component.
pub fn open_node_dir(path: &Path) -> std::io::Result<OwnedFd> {
    crate::fd_walk::open_node_dir(path).map_err(|e| named(path.as_os_str(), "cannot open", e))
}

/// The parent directory and last component of the node's path `path`.
pub fn split(path: &Path) -> std::io::Result<(&Path, &OsStr)> {
    match (path.parent(), path.file_name()) {
        (Some(p), Some(n)) if !p.as_os_str().is_empty() => Ok((p, n)),
        _ => Err(std::io::Error::other(format!(
            "{} has no parent directory",
            path.display()
        ))),
    }
}

fn open_dir_at(dir: BorrowedFd<'_>, name: &OsStr) -> std::io::Result<OwnedFd> {
    crate::fd_walk::open_dir_at(dir, name).map_err(|e| match e {
        Errno::LOOP | Errno::NOTDIR => {
            named(name, "is a link or not a directory; never followed", e)
        }
        e => named(name, "cannot open", e),
    })
}

/// Creates the directory `name` in `dir` (mode 0700 until [`own`]) and opens it. An
/// existing name, whatever it is, is refused: nothing is reused.
pub fn create_new_dir(dir: BorrowedFd<'_>, name: &OsStr) -> std::io::Result<OwnedFd> {
    match rfs::mkdirat(dir, name, Mode::from_raw_mode(0o700)) {
        Ok(()) => open_dir_at(dir, name),
        Err(Errno::EXIST) => Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!(
                "{} exists already; a job directory is never reused",
                Path::new(name).display()
            ),
        )),
        Err(e) => Err(named(name, "cannot create", e)),
    }
}

/// Opens the directory `name` in `dir`, creating it (owned by `owner`, mode 0755) when it
/// is missing; a link or anything but a directory there is refused.
pub fn open_or_create_owned_dir(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    owner: u32,
) -> std::io::Result<OwnedFd> {
    match rfs::mkdirat(dir, name, Mode::from_raw_mode(0o700)) {
        Ok(()) => {
            let fd = open_dir_at(dir, name)?;
            own(&fd, Some(owner), 0o755)?;
            Ok(fd)
        }
        Err(Errno::EXIST) => open_dir_at(dir, name),
        Err(e) => Err(named(name, "cannot create", e)),
    }
}

/// Gives the opened `fd` to `owner` (uid and gid) when given, then sets its mode.
pub fn own(fd: &OwnedFd, owner: Option<u32>, mode: u32) -> std::io::Result<()> {
    if let Some(id) = owner {
        rfs::fchown(
            fd,
            Some(rfs::Uid::from_raw(id)),
            Some(rfs::Gid::from_raw(id)),
        )
        .map_err(io)?;
    }
    rfs::fchmod(fd, Mode::from_raw_mode(mode)).map_err(io)
}

/// Creates the file `name` in `dir` (refusing any existing name, a link included), gives
/// it to `owner` with `mode`, and writes `data` to it.
pub fn write_new_file(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    data: &[u8],
    owner: Option<u32>,
    mode: u32,
) -> std::io::Result<()> {
    let fd = rfs::openat(
        dir,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| named(name, "cannot create", e))?;
    own(&fd, owner, mode)?;
    std::fs::File::from(fd).write_all(data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};

    #[test]
    fn planted_links_are_refused_not_followed() {
        let t = tempfile::tempdir().unwrap();
        let target = tempfile::tempdir().unwrap();
        std::fs::set_permissions(target.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::write(target.path().join("f"), b"keep").unwrap();
        symlink(target.path(), t.path().join("d")).unwrap();
        symlink(target.path().join("f"), t.path().join("f")).unwrap();
        let dir = open_node_dir(t.path()).unwrap();
        let e = create_new_dir(dir.as_fd(), OsStr::new("d")).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists, "{e}");
        assert!(open_or_create_owned_dir(dir.as_fd(), OsStr::new("d"), 4242).is_err());
        assert!(write_new_file(dir.as_fd(), OsStr::new("f"), b"x", Some(4242), 0o644).is_err());
        let m = std::fs::metadata(target.path()).unwrap();
        assert_eq!(m.mode() & 0o777, 0o700);
        assert_ne!(m.uid(), 4242);
        assert_eq!(std::fs::read(target.path().join("f")).unwrap(), b"keep");
        // The real thing works.
        let sub = create_new_dir(dir.as_fd(), OsStr::new("new")).unwrap();
        write_new_file(sub.as_fd(), OsStr::new("g"), b"data", None, 0o640).unwrap();
        let g = std::fs::metadata(t.path().join("new/g")).unwrap();
        assert_eq!(g.mode() & 0o777, 0o640);
        assert_eq!(std::fs::read(t.path().join("new/g")).unwrap(), b"data");
    }
}
