//! The one beneath-safe way the node walks a tree a sandbox could have written: by
//! directory descriptors, one name at a time, never following a link, never forming a
//! path longer than one name.
//!
//! - [`open_node_dir`] opens a directory of the node's own by its path, refusing a link at
//!   its last component (the start of every walk);
//! - [`open_dir_at`] opens the directory `name` beneath `dir`: `openat2` with
//!   `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS` where the kernel has it
//!   (5.6 and later), else `openat(O_DIRECTORY | O_NOFOLLOW)`; either way a link, or a name
//!   that is not a directory, is refused (`ELOOP`, `ENOTDIR`), never followed.
//! - [`parent_checked`] goes back up with `openat("..")` and checks that the directory
//!   reached is the one recorded on the way down (device and inode): a directory moved
//!   under the walk is seen, never walked out of.
//! - [`walk`] is the depth-first walk over both, with two directory descriptors open at
//!   most, however deep the tree: the disk guard's measurement ([`crate::disk_usage`]) and
//!   re-owning ([`crate::reown`]) are each one `scan` of a directory. Removal
//!   ([`crate::remove_tree`]) unlinks on its way up and walks with the two helpers itself.

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{self as rfs, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

/// Opens the directory `name` (one component) beneath `dir`, never following a link.
pub fn open_dir_at(dir: BorrowedFd<'_>, name: &OsStr) -> Result<OwnedFd, Errno> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    static NO_OPENAT2: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !NO_OPENAT2.load(std::sync::atomic::Ordering::Relaxed) {
        match rfs::openat2(
            dir,
            name,
            flags,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
        ) {
            Err(Errno::NOSYS) => NO_OPENAT2.store(true, std::sync::atomic::Ordering::Relaxed),
            // The kernel retries a lookup it saw race with a rename; so does this walk.
            Err(Errno::AGAIN) => {}
            r => return r,
        }
    }
    rfs::openat(dir, name, flags, Mode::empty())
}

/// Opens the node's own directory `path` (a path the node made; links in its parents are
/// the operator's), refusing a link at its last component.
pub fn open_node_dir(path: &std::path::Path) -> Result<OwnedFd, Errno> {
    rfs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// A directory's device and inode.
pub fn dev_ino(fd: BorrowedFd<'_>) -> Result<(u64, u64), Errno> {
    let st = rfs::fstat(fd)?;
    Ok((st.st_dev, st.st_ino))
}

/// The parent of `dir`, when it is still the directory whose device and inode were
/// recorded on the way down (`expect`); `None` when `dir` was moved beneath another.
pub fn parent_checked(dir: BorrowedFd<'_>, expect: (u64, u64)) -> Result<Option<OwnedFd>, Errno> {
    let up = rfs::openat(
        dir,
        "..",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    Ok((dev_ino(up.as_fd())? == expect).then_some(up))
}

/// Why a [`walk`] stopped.
#[derive(Debug)]
pub enum WalkError<E> {
    /// The caller's scan of a directory refused.
    Scan(E),
    /// A directory could not be opened or looked at.
    Io(Errno),
    /// A directory was moved during the walk.
    Moved,
}

/// One directory on the way down.
struct Level {
    dev_ino: (u64, u64),
    /// Subdirectories listed here and not yet visited.
    pending: Vec<OsString>,
}

/// Visits `top` and every directory beneath it, depth first: `scan` is called once with
/// each directory's descriptor and returns the names of its subdirectories to visit. A
/// subdirectory gone, or no longer a directory, when the walk reaches it is skipped (it is
/// never followed).
pub fn walk<E>(
    top: OwnedFd,
    mut scan: impl FnMut(BorrowedFd<'_>) -> Result<Vec<OsString>, E>,
) -> Result<(), WalkError<E>> {
    let pending = scan(top.as_fd()).map_err(WalkError::Scan)?;
    let mut chain = vec![Level {
        dev_ino: dev_ino(top.as_fd()).map_err(WalkError::Io)?,
        pending,
    }];
    let mut cur = top;
    loop {
        let Some(level) = chain.last_mut() else {
            return Ok(());
        };
        if let Some(child) = level.pending.pop() {
            match open_dir_at(cur.as_fd(), &child) {
                Ok(fd) => {
                    let id = dev_ino(fd.as_fd()).map_err(WalkError::Io)?;
                    let pending = scan(fd.as_fd()).map_err(WalkError::Scan)?;
                    chain.push(Level {
                        dev_ino: id,
                        pending,
                    });
                    cur = fd;
                }
                Err(Errno::NOENT | Errno::LOOP | Errno::NOTDIR | Errno::XDEV) => {}
                Err(e) => return Err(WalkError::Io(e)),
            }
            continue;
        }
        chain.pop();
        let Some(up_level) = chain.last() else {
            return Ok(());
        };
        cur = parent_checked(cur.as_fd(), up_level.dev_ino)
            .map_err(WalkError::Io)?
            .ok_or(WalkError::Moved)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn open(p: &std::path::Path) -> OwnedFd {
        rfs::open(p, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()).unwrap()
    }

    #[test]
    fn links_and_files_are_refused_and_dot_dot_is_not_beneath() {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir(t.path().join("d")).unwrap();
        std::fs::write(t.path().join("f"), "x").unwrap();
        symlink("/", t.path().join("root")).unwrap();
        symlink("d", t.path().join("to_d")).unwrap();
        let top = open(t.path());
        assert!(open_dir_at(top.as_fd(), OsStr::new("d")).is_ok());
        for (name, why) in [
            ("root", Errno::LOOP),
            ("to_d", Errno::LOOP),
            ("f", Errno::NOTDIR),
        ] {
            let e = open_dir_at(top.as_fd(), OsStr::new(name)).unwrap_err();
            assert!(
                e == why || (why == Errno::LOOP && e == Errno::NOTDIR),
                "{name}: {e:?}"
            );
        }
        // Down steps never climb: `..` is outside (openat2 refuses it with EXDEV).
        let up = open_dir_at(top.as_fd(), OsStr::new(".."));
        assert!(
            up.is_err() || !has_openat2(),
            "`..` opened beneath the walk's directory"
        );
    }

    fn has_openat2() -> bool {
        let r = rfs::openat2(
            rfs::CWD,
            ".",
            OFlags::RDONLY,
            Mode::empty(),
            ResolveFlags::BENEATH,
        );
        !matches!(r, Err(Errno::NOSYS))
    }

    #[test]
    fn the_walk_visits_every_directory_once_and_sees_a_move() {
        let t = tempfile::tempdir().unwrap();
        let deep = t.path().join("a/b/c");
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::create_dir_all(t.path().join("x/y")).unwrap();
        symlink("/", t.path().join("a/out")).unwrap();
        let mut seen = 0;
        walk::<Errno>(open(t.path()), |dir| {
            seen += 1;
            let mut subs = Vec::new();
            for ent in rfs::Dir::read_from(dir)? {
                let ent = ent?;
                let n = ent.file_name().to_bytes();
                if n != b"." && n != b".." {
                    subs.push(OsString::from(String::from_utf8_lossy(n).into_owned()));
                }
            }
            Ok(subs)
        })
        .unwrap();
        // top, a, a/b, a/b/c, x, x/y; the link a/out is listed and never entered.
        assert_eq!(seen, 6);
        // A directory moved under the walk: its `..` is no longer the recorded parent.
        let a = open(&t.path().join("a"));
        let b = open_dir_at(a.as_fd(), OsStr::new("b")).unwrap();
        std::fs::rename(t.path().join("a/b"), t.path().join("x/b")).unwrap();
        let recorded = dev_ino(a.as_fd()).unwrap();
        assert!(parent_checked(b.as_fd(), recorded).unwrap().is_none());
    }
}
