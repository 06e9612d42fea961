//! Giving a tree a sandbox wrote to another host uid (a workspace moving to the uid the
//! pool assigned it, see [`crate::uid_pool`]), without following a link and without
//! recursion, however deep the tree.
//!
//! The walk is the node's one beneath-safe walk ([`crate::fd_walk`]): down one name at a
//! time without following a link, back up through `..` checked against the device and
//! inode recorded on the way down, two directory fds open at most. Every entry owned by `from` is given to `to` (uid and gid) with `fchownat(…,
//! AT_SYMLINK_NOFOLLOW)` on its parent's fd, so a link is re-owned itself, never its
//! target; an entry owned by anyone else (root, another uid) is left as it is.

use std::ffi::OsString;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;

use rustix::fs::{self as rfs, AtFlags, FileType};
use rustix::io::Errno;

use crate::fd_walk::WalkError;

/// Why a tree was not (completely) re-owned.
#[derive(Debug, thiserror::Error)]
pub enum ReownError {
    #[error("cannot re-own an entry: {0}")]
    Io(#[from] Errno),
    #[error("more than {0} entries")]
    TooManyEntries(u64),
    #[error("a directory was moved during the walk")]
    Moved,
}

fn ids(id: u32) -> (rfs::Uid, rfs::Gid) {
    (rfs::Uid::from_raw(id), rfs::Gid::from_raw(id))
}

/// Re-owns the entries of `dir` owned by `from`; returns its subdirectories.
fn scan(
    dir: BorrowedFd<'_>,
    from: u32,
    to: u32,
    seen: &mut u64,
    max: u64,
) -> Result<Vec<OsString>, ReownError> {
    let (uid, gid) = ids(to);
    let mut subdirs = Vec::new();
    for ent in rfs::Dir::read_from(dir)? {
        let ent = ent?;
        let name = ent.file_name();
        let bytes = name.to_bytes();
        if bytes == b"." || bytes == b".." {
            continue;
        }
        *seen += 1;
        if *seen > max {
            return Err(ReownError::TooManyEntries(max));
        }
        let st = match rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => continue,
            Err(e) => return Err(e.into()),
        };
        if st.st_uid == from {
            match rfs::chownat(dir, name, Some(uid), Some(gid), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            subdirs.push(OsString::from_vec(bytes.to_vec()));
        }
    }
    Ok(subdirs)
}

/// Gives `top` (an opened directory) and every entry beneath it that `from` owns to
/// `to`; at most `max_entries` entries are visited. Blocking.
pub fn reown(top: OwnedFd, from: u32, to: u32, max_entries: u64) -> Result<(), ReownError> {
    let st = rfs::fstat(&top)?;
    if st.st_uid == from {
        let (uid, gid) = ids(to);
        rfs::fchown(&top, Some(uid), Some(gid))?;
    }
    let mut seen = 0u64;
    crate::fd_walk::walk(top, |dir| scan(dir, from, to, &mut seen, max_entries)).map_err(
        |e| match e {
            WalkError::Scan(e) => e,
            WalkError::Io(e) => ReownError::Io(e),
            WalkError::Moved => ReownError::Moved,
        },
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::fd_walk::open_dir_at;
    use rustix::fs::{Mode, OFlags};
    use std::ffi::OsStr;
    use std::os::fd::AsFd;
    use std::os::unix::fs::{lchown, symlink, MetadataExt};

    fn open(p: &std::path::Path) -> OwnedFd {
        rfs::open(p, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()).unwrap()
    }

    /// Everything `from` owned moves to `to`, however deep; links are re-owned, never
    /// followed; entries of other owners stay.
    #[test]
    fn moves_what_from_owned_and_nothing_else() {
        if !rustix::process::geteuid().is_root() {
            return; // chown needs root; the node runs as root
        }
        let t = tempfile::tempdir().unwrap();
        let outside = tempfile::NamedTempFile::new().unwrap();
        let r = t.path();
        let name = "d".repeat(200);
        let mut fd = open(r);
        for _ in 0..30 {
            rfs::mkdirat(&fd, name.as_str(), Mode::from_raw_mode(0o755)).unwrap();
            fd = open_dir_at(fd.as_fd(), OsStr::new(&name)).unwrap();
        }
        let f = rfs::openat(
            &fd,
            "f",
            OFlags::CREATE | OFlags::WRONLY,
            Mode::from_raw_mode(0o600),
        )
        .unwrap();
        drop(f);
        std::fs::write(r.join("rootfile"), "x").unwrap();
        symlink(outside.path(), r.join("out")).unwrap();
        for p in [r.join("out"), r.to_path_buf()] {
            lchown(&p, Some(4100), Some(4100)).unwrap();
        }
        // Deep entries by fd (past PATH_MAX).
        let mut fd = open(r);
        for _ in 0..30 {
            rfs::chownat(
                &fd,
                name.as_str(),
                Some(rfs::Uid::from_raw(4100)),
                Some(rfs::Gid::from_raw(4100)),
                AtFlags::SYMLINK_NOFOLLOW,
            )
            .unwrap();
            fd = open_dir_at(fd.as_fd(), OsStr::new(&name)).unwrap();
        }
        rfs::chownat(
            &fd,
            "f",
            Some(rfs::Uid::from_raw(4100)),
            Some(rfs::Gid::from_raw(4100)),
            AtFlags::empty(),
        )
        .unwrap();
        reown(open(r), 4100, 4200, 1000).unwrap();
        assert_eq!(std::fs::metadata(r).unwrap().uid(), 4200);
        assert_eq!(
            std::fs::symlink_metadata(r.join("out")).unwrap().uid(),
            4200
        );
        assert_eq!(std::fs::metadata(outside.path()).unwrap().uid(), 0);
        assert_eq!(std::fs::metadata(r.join("rootfile")).unwrap().uid(), 0);
        let st = rfs::statat(&fd, "f", AtFlags::SYMLINK_NOFOLLOW).unwrap();
        assert_eq!((st.st_uid, st.st_gid), (4200, 4200));
        assert!(matches!(
            reown(open(r), 4200, 4300, 5),
            Err(ReownError::TooManyEntries(5))
        ));
        crate::remove_tree::remove_tree(&r.join(&name)).unwrap();
    }
}
