//! Removing a tree a sandbox wrote (a job directory, a replay's workspace) without
//! following a link, without recursion and with two directory fds open at most, however
//! deep the tree: a job can leave `/job/a/a/…` tens of thousands of levels deep (made with
//! relative `mkdir` and `mv`, never naming a path longer than PATH_MAX), which overflowed
//! the stack of a recursive removal and aborted the whole worker.
//!
//! The walk goes down with `openat(O_DIRECTORY | O_NOFOLLOW)` one name at a time and back
//! up with `openat("..")`, checking that the parent reached is the directory it came from
//! (device and inode recorded on the way down): a tree moved under the walk stops it with
//! an error, it never climbs out. Per level it keeps only the names of the subdirectories
//! still to visit; everything else is unlinked as soon as it is listed.

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStringExt;
use std::path::Path;

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

/// How often one directory may be found non-empty again after it was emptied (something
/// else writing in the tree) before the removal gives up.
const MAX_RESCANS: u32 = 16;

/// Why a tree was not removed.
#[derive(Debug, thiserror::Error)]
pub enum RemoveError {
    #[error("cannot remove {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{0} was moved while it was being removed")]
    Moved(String),
    #[error("{0} keeps being written while it is removed")]
    Busy(String),
}

fn err(path: &OsStr, e: Errno) -> RemoveError {
    RemoveError::Io {
        path: Path::new(path).display().to_string(),
        source: e.into(),
    }
}

/// Removes `path` and everything beneath it; a missing `path` is fine. `path` is the
/// node's own (its parent directories are trusted); its last component and everything
/// below are not: a link there is removed, never followed. The disk volumes mounted at
/// or beneath `path` are released first ([`crate::loopfs::release_beneath`]): their
/// contents go with their images, and what is left is their empty mount points. Blocking.
pub fn remove_tree(path: &Path) -> Result<(), RemoveError> {
    crate::loopfs::release_beneath(path);
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(RemoveError::Io {
            path: path.display().to_string(),
            source: std::io::Error::other("not a removable path"),
        });
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let pfd = match rfs::open(
        parent,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(err(parent.as_os_str(), e)),
    };
    remove_beneath(pfd.as_fd(), name)
}

/// [`remove_tree`] on a blocking thread.
pub async fn remove_tree_async(path: std::path::PathBuf) -> Result<(), RemoveError> {
    match tokio::task::spawn_blocking(move || remove_tree(&path)).await {
        Ok(r) => r,
        Err(e) => Err(RemoveError::Io {
            path: "tree".into(),
            source: std::io::Error::other(e.to_string()),
        }),
    }
}

/// One directory on the way down.
struct Level {
    name: OsString,
    dev: u64,
    ino: u64,
    /// Subdirectories listed here and not yet removed.
    pending: Vec<OsString>,
    rescans: u32,
    /// Whether its last listing found it empty.
    emptied: bool,
}

use crate::fd_walk::open_dir_at;

fn dev_ino(fd: BorrowedFd<'_>, name: &OsStr) -> Result<(u64, u64), RemoveError> {
    crate::fd_walk::dev_ino(fd).map_err(|e| err(name, e))
}

/// Removes `name` in `parent` (a directory fd), not following links.
pub fn remove_beneath(parent: BorrowedFd<'_>, name: &OsStr) -> Result<(), RemoveError> {
    let top = match open_dir_at(parent, name) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(()),
        // A link (ELOOP), or not a directory: unlinked like a file.
        Err(Errno::LOOP | Errno::NOTDIR) => return unlink(parent, name, AtFlags::empty()),
        Err(e) => return Err(err(name, e)),
    };
    let (dev, ino) = dev_ino(top.as_fd(), name)?;
    let mut chain = vec![Level {
        name: name.to_os_string(),
        dev,
        ino,
        pending: Vec::new(),
        rescans: 0,
        emptied: false,
    }];
    let mut cur = top;
    let mut list = true;
    loop {
        let Some(level) = chain.last_mut() else {
            return Ok(());
        };
        if list {
            level.emptied = empty_out(cur.as_fd(), &level.name, &mut level.pending)? == 0;
            list = false;
        }
        if let Some(child) = level.pending.pop() {
            match open_dir_at(cur.as_fd(), &child) {
                Ok(fd) => {
                    let (dev, ino) = dev_ino(fd.as_fd(), &child)?;
                    chain.push(Level {
                        name: child,
                        dev,
                        ino,
                        pending: Vec::new(),
                        rescans: 0,
                        emptied: false,
                    });
                    cur = fd;
                    list = true;
                }
                Err(Errno::NOENT) => {}
                Err(Errno::LOOP | Errno::NOTDIR) => unlink(cur.as_fd(), &child, AtFlags::empty())?,
                Err(e) => return Err(err(&child, e)),
            }
            continue;
        }
        if !level.emptied {
            // The last listing met entries: list again until one finds the directory empty.
            level.rescans += 1;
            if level.rescans > MAX_RESCANS {
                return Err(RemoveError::Busy(
                    Path::new(&level.name).display().to_string(),
                ));
            }
            list = true;
            continue;
        }
        let Some(done) = chain.pop() else {
            return Ok(());
        };
        let Some(up_level) = chain.last() else {
            return unlink(parent, &done.name, AtFlags::REMOVEDIR);
        };
        let Some(up) = crate::fd_walk::parent_checked(cur.as_fd(), (up_level.dev, up_level.ino))
            .map_err(|e| err(&done.name, e))?
        else {
            return Err(RemoveError::Moved(
                Path::new(&done.name).display().to_string(),
            ));
        };
        unlink(up.as_fd(), &done.name, AtFlags::REMOVEDIR)?;
        cur = up;
    }
}

fn unlink(dir: BorrowedFd<'_>, name: &OsStr, flags: AtFlags) -> Result<(), RemoveError> {
    match rfs::unlinkat(dir, name, flags) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(err(name, e)),
    }
}

/// Unlinks every non-directory in `dir` and every empty subdirectory; the others are
/// added to `pending`. Returns how many entries it met.
fn empty_out(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    pending: &mut Vec<OsString>,
) -> Result<usize, RemoveError> {
    let mut found = 0;
    let entries = rfs::Dir::read_from(dir).map_err(|e| err(name, e))?;
    for ent in entries {
        let ent = ent.map_err(|e| err(name, e))?;
        let bytes = ent.file_name().to_bytes();
        if bytes == b"." || bytes == b".." {
            continue;
        }
        found += 1;
        let child = OsString::from_vec(bytes.to_vec());
        let kind = match ent.file_type() {
            FileType::Unknown => match rfs::statat(dir, &*child, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => FileType::from_raw_mode(st.st_mode),
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(err(&child, e)),
            },
            k => k,
        };
        if kind != FileType::Directory {
            unlink(dir, &child, AtFlags::empty())?;
            continue;
        }
        match rfs::unlinkat(dir, &*child, AtFlags::REMOVEDIR) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(Errno::NOTEMPTY | Errno::EXIST) => pending.push(child),
            Err(e) => return Err(err(&child, e)),
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn removes_a_tree_without_following_links() {
        let t = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), b"k").unwrap();
        let r = t.path().join("tree");
        std::fs::create_dir_all(r.join("a/b/c")).unwrap();
        std::fs::create_dir_all(r.join("a/e")).unwrap();
        std::fs::write(r.join("a/b/c/f"), b"x").unwrap();
        std::fs::write(r.join("a/g"), b"x").unwrap();
        symlink(outside.path(), r.join("a/b/out")).unwrap();
        symlink(outside.path().join("keep"), r.join("file-link")).unwrap();
        remove_tree(&r).unwrap();
        assert!(!r.exists());
        assert!(outside.path().join("keep").exists());
        // Missing: fine. A link at the top: removed, its target kept.
        remove_tree(&r).unwrap();
        symlink(outside.path(), &r).unwrap();
        remove_tree(&r).unwrap();
        assert!(std::fs::symlink_metadata(&r).is_err());
        assert!(outside.path().join("keep").exists());
    }

    #[test]
    fn removes_a_tree_deeper_than_path_max_on_a_small_stack() {
        let t = tempfile::tempdir().unwrap();
        let top = t.path().join("deep");
        std::fs::create_dir(&top).unwrap();
        let mut fd = open_dir_at(
            rfs::open(t.path(), OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())
                .unwrap()
                .as_fd(),
            OsStr::new("deep"),
        )
        .unwrap();
        for i in 0..5000 {
            rfs::mkdirat(&fd, "a", Mode::from_raw_mode(0o755)).unwrap();
            if i % 100 == 0 {
                rfs::openat(&fd, "f", OFlags::CREATE | OFlags::WRONLY, Mode::RUSR).unwrap();
            }
            fd = open_dir_at(fd.as_fd(), OsStr::new("a")).unwrap();
        }
        drop(fd);
        let h = std::thread::Builder::new()
            .stack_size(64 * 1024)
            .spawn(move || remove_tree(&top).map(|()| top))
            .unwrap();
        let top = h.join().unwrap().unwrap();
        assert!(!top.exists());
    }
}
