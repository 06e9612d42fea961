//! Measuring a tree a sandbox is writing (the disk guard's walk): the blocks allocated and
//! the entries beneath a directory fd, however deep the tree, without following a link.
//!
//! The walk is the node's one beneath-safe walk ([`crate::fd_walk`]): down one name at a
//! time without following a link, back up through `..` checked against the directory it
//! came from. No path longer than one name is ever formed, so a tree past PATH_MAX is
//! measured, not refused, with two fds open at most. A directory moved under the walk (so
//! that `..` is another directory) stops it with [`Unmeasured::Moved`]; the guard counts
//! that as a breach (fail closed).

use std::ffi::OsString;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::time::Instant;

use rustix::fs::{self as rfs, AtFlags, FileType};
use rustix::io::Errno;

use crate::fd_walk::WalkError;

/// What one measurement may meet before it stops.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub max_entries: u64,
    pub max_bytes: u64,
    pub deadline: Instant,
}

/// Why a measurement stopped before the end of the tree.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Unmeasured {
    #[error("more than {0} entries")]
    TooManyEntries(u64),
    #[error("more than {0} bytes allocated")]
    TooManyBytes(u64),
    #[error("the walk took longer than its bound")]
    TooSlow,
    #[error("a directory was moved during the walk")]
    Moved,
    #[error("cannot read a directory: {0}")]
    Io(Errno),
}

/// What a tree holds.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub entries: u64,
    pub bytes: u64,
}

/// Adds `usage` to `total` under `b`, or says which bound it crossed.
fn add(total: &mut Usage, entries: u64, bytes: u64, b: &Bounds) -> Result<(), Unmeasured> {
    total.entries = total.entries.saturating_add(entries);
    total.bytes = total.bytes.saturating_add(bytes);
    if total.entries > b.max_entries {
        return Err(Unmeasured::TooManyEntries(b.max_entries));
    }
    if total.bytes > b.max_bytes {
        return Err(Unmeasured::TooManyBytes(b.max_bytes));
    }
    if Instant::now() > b.deadline {
        return Err(Unmeasured::TooSlow);
    }
    Ok(())
}

/// Lists `dir`: every entry counts, with its allocated blocks; its subdirectories are
/// returned to be visited.
fn scan(dir: BorrowedFd<'_>, total: &mut Usage, b: &Bounds) -> Result<Vec<OsString>, Unmeasured> {
    let mut subdirs = Vec::new();
    for ent in rfs::Dir::read_from(dir).map_err(Unmeasured::Io)? {
        let ent = ent.map_err(Unmeasured::Io)?;
        let bytes = ent.file_name().to_bytes();
        if bytes == b"." || bytes == b".." {
            continue;
        }
        let st = match rfs::statat(dir, ent.file_name(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            // Removed since it was listed (the sandbox is running): not there.
            Err(Errno::NOENT) => continue,
            Err(e) => return Err(Unmeasured::Io(e)),
        };
        let allocated = u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512);
        add(total, 1, allocated, b)?;
        if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            subdirs.push(OsString::from_vec(bytes.to_vec()));
        }
    }
    Ok(subdirs)
}

/// Measures everything beneath `top` (a directory fd; `top` itself not counted).
pub fn measure(top: OwnedFd, b: Bounds) -> Result<Usage, Unmeasured> {
    let mut total = Usage::default();
    crate::fd_walk::walk(top, |dir| scan(dir, &mut total, &b)).map_err(|e| match e {
        WalkError::Scan(e) => e,
        WalkError::Io(e) => Unmeasured::Io(e),
        WalkError::Moved => Unmeasured::Moved,
    })?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::fd_walk::open_dir_at;
    use rustix::fs::{Mode, OFlags};
    use std::ffi::OsStr;
    use std::os::fd::AsFd;
    use std::time::Duration;

    fn bounds() -> Bounds {
        Bounds {
            max_entries: 1_000_000,
            max_bytes: u64::MAX,
            deadline: Instant::now() + Duration::from_secs(60),
        }
    }

    fn open(p: &std::path::Path) -> OwnedFd {
        rfs::open(p, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()).unwrap()
    }

    #[test]
    fn counts_entries_and_blocks_and_never_follows_links() {
        let t = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("big"), vec![1u8; 1 << 20]).unwrap();
        std::fs::create_dir_all(t.path().join("a/b")).unwrap();
        std::fs::write(t.path().join("a/b/f"), vec![1u8; 64 * 1024]).unwrap();
        std::os::unix::fs::symlink(outside.path(), t.path().join("a/out")).unwrap();
        let u = measure(open(t.path()), bounds()).unwrap();
        assert_eq!(u.entries, 4, "a, a/b, a/b/f, a/out");
        assert!(u.bytes >= 64 * 1024 && u.bytes < 1 << 20, "{u:?}");
    }

    /// A tree far deeper than PATH_MAX, made with relative names as a job would, is
    /// measured exactly, with no path longer than one name.
    #[test]
    fn a_tree_deeper_than_path_max_is_measured() {
        let t = tempfile::tempdir().unwrap();
        let name = "d".repeat(200);
        let mut fd = open(t.path());
        for _ in 0..100 {
            rfs::mkdirat(&fd, name.as_str(), Mode::from_raw_mode(0o755)).unwrap();
            fd = open_dir_at(fd.as_fd(), OsStr::new(&name)).unwrap();
        }
        let u = measure(open(t.path()), bounds()).unwrap();
        assert_eq!(u.entries, 100);
        crate::remove_tree::remove_tree(&t.path().join(&name)).unwrap();
    }

    #[test]
    fn each_bound_stops_the_walk() {
        let t = tempfile::tempdir().unwrap();
        for i in 0..10 {
            std::fs::write(t.path().join(format!("f{i}")), vec![1u8; 8192]).unwrap();
        }
        let b = Bounds {
            max_entries: 5,
            ..bounds()
        };
        assert_eq!(
            measure(open(t.path()), b),
            Err(Unmeasured::TooManyEntries(5))
        );
        let b = Bounds {
            max_bytes: 4096,
            ..bounds()
        };
        assert_eq!(
            measure(open(t.path()), b),
            Err(Unmeasured::TooManyBytes(4096))
        );
        let b = Bounds {
            deadline: Instant::now() - Duration::from_secs(1),
            ..bounds()
        };
        assert_eq!(measure(open(t.path()), b), Err(Unmeasured::TooSlow));
    }
}
