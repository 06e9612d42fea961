//! Link-safe file operations beneath a directory fd: every path is resolved by the kernel
//! with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS` (openat2), and every final component is
//! created, opened, chowned or read without following a link.

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

/// Resolution that never leaves the directory and never follows a link.
pub const NO_LINKS: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS);

/// The most links one resolution may pass, as the kernel's own bound.
const MAX_HOPS: usize = 40;

fn io(e: Errno) -> std::io::Error {
    std::io::Error::from(e)
}

/// Opens the directory at `path` (its last component must not be a link).
pub fn open_root(path: &Path) -> std::io::Result<OwnedFd> {
    crate::fd_walk::open_node_dir(path).map_err(io)
}

/// Opens the directory `rel` beneath `root` without passing any link.
pub fn open_dir(root: BorrowedFd<'_>, rel: &Path) -> std::io::Result<OwnedFd> {
    let rel = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    rfs::openat2(
        root,
        rel,
        OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
        NO_LINKS,
    )
    .map_err(io)
}

/// Opens the regular file `name` in `dir` for reading: no link, no FIFO that could block,
/// nothing but a regular file. Returns the file and its size.
pub fn open_regular(dir: BorrowedFd<'_>, name: &OsStr) -> std::io::Result<(std::fs::File, u64)> {
    let fd = rfs::openat2(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
        NO_LINKS,
    )
    .map_err(io)?;
    let st = rfs::fstat(&fd).map_err(io)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok((std::fs::File::from(fd), st.st_size as u64))
}

/// The type of `name` in `dir`, not following a link.
pub fn kind(dir: BorrowedFd<'_>, name: &OsStr) -> std::io::Result<(FileType, rfs::Stat)> {
    let st = rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(io)?;
    Ok((FileType::from_raw_mode(st.st_mode), st))
}

/// The target of the link `name` in `dir`.
pub fn read_link(dir: BorrowedFd<'_>, name: &OsStr) -> std::io::Result<PathBuf> {
    let t = rfs::readlinkat(dir, name, Vec::new()).map_err(io)?;
    Ok(PathBuf::from(OsString::from_vec(t.into_bytes())))
}

/// The names in the directory `dir`, sorted, without `.` and `..`; at most `max` of them.
pub fn list(dir: BorrowedFd<'_>, max: usize) -> std::io::Result<Vec<OsString>> {
    let mut names = Vec::new();
    for e in rfs::Dir::read_from(dir).map_err(io)? {
        let e = e.map_err(io)?;
        let n = e.file_name().to_bytes();
        if n == b"." || n == b".." {
            continue;
        }
        if names.len() >= max {
            return Err(std::io::Error::other(format!(
                "directory has more than {max} entries"
            )));
        }
        names.push(OsString::from_vec(n.to_vec()));
    }
    names.sort();
    Ok(names)
}

/// Gives `name` in `dir` (not following a link) to `owner` (uid and gid).
pub fn chown_to(dir: BorrowedFd<'_>, name: &OsStr, owner: u32) -> std::io::Result<()> {
    let id = rfs::Uid::from_raw(owner);
    let gid = rfs::Gid::from_raw(owner);
    rfs::chownat(dir, name, Some(id), Some(gid), AtFlags::SYMLINK_NOFOLLOW).map_err(io)
}

/// Creates (or reuses) the directory `name` in `dir`, owned by `owner`, and opens it;
/// fails when `name` is a link or anything but a directory.
pub fn make_dir(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    mode: u32,
    owner: u32,
) -> std::io::Result<OwnedFd> {
    match rfs::mkdirat(dir, name, Mode::from_raw_mode(0o700)) {
        Ok(()) | Err(Errno::EXIST) => {}
        Err(e) => return Err(io(e)),
    }
    let fd = rfs::openat2(
        dir,
        name,
        OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
        NO_LINKS,
    )
    .map_err(|e| match e {
        Errno::LOOP | Errno::XDEV | Errno::NOTDIR => std::io::Error::other(format!(
            "{} is a link or not a directory",
            Path::new(name).display()
        )),
        e => io(e),
    })?;
    owned_by(&fd, (mode & 0o777) | 0o700, owner)?;
    Ok(fd)
}

fn owned_by(fd: &OwnedFd, mode: u32, owner: u32) -> std::io::Result<()> {
    let id = rfs::Uid::from_raw(owner);
    let gid = rfs::Gid::from_raw(owner);
    rfs::fchown(fd, Some(id), Some(gid)).map_err(io)?;
    rfs::fchmod(fd, Mode::from_raw_mode(mode)).map_err(io)
}

/// Creates the regular file `name` in `dir` (replacing a file or link of that name, never
/// writing through one), fills it from `data` and gives it to `owner`.
pub fn write_file(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    mode: u32,
    owner: u32,
    data: &mut dyn std::io::Read,
) -> std::io::Result<u64> {
    remove_non_dir(dir, name)?;
    let fd = rfs::openat2(
        dir,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
        NO_LINKS,
    )
    .map_err(io)?;
    owned_by(&fd, mode & 0o777, owner)?;
    let mut file = std::fs::File::from(fd);
    std::io::copy(data, &mut file)
}

/// Creates the link `name` → `target` in `dir`, owned by `owner`.
pub fn write_link(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    target: &Path,
    owner: u32,
) -> std::io::Result<()> {
    remove_non_dir(dir, name)?;
    rfs::symlinkat(target, dir, name).map_err(io)?;
    chown_to(dir, name, owner)
}

/// Removes `name` in `dir` unless it is a directory; a missing name is fine.
pub fn remove_non_dir(dir: BorrowedFd<'_>, name: &OsStr) -> std::io::Result<()> {
    match rfs::unlinkat(dir, name, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(Errno::ISDIR) => Err(std::io::Error::other(format!(
            "{} is already a directory",
            Path::new(name).display()
        ))),
        Err(e) => Err(io(e)),
    }
}

/// The directory components of a relative path, refusing `..`, absolute paths and NULs.
pub fn plain_components(p: &Path) -> Option<Vec<&OsStr>> {
    let mut out = Vec::new();
    for c in p.components() {
        match c {
            Component::Normal(n) if !n.as_bytes().contains(&0) => out.push(n),
            Component::CurDir => {}
            _ => return None,
        }
    }
    Some(out)
}

/// Whether the link at `link` (relative to `root`, whose parent directories are real
/// directories) resolves inside `root`, resolving every link it passes against the tree as
/// it is on disk. A part that does not exist is taken lexically.
pub fn link_stays_inside(root: BorrowedFd<'_>, link: &Path) -> std::io::Result<bool> {
    let Some(parts) = plain_components(link) else {
        return Ok(false);
    };
    let Some((name, parents)) = parts.split_last() else {
        return Ok(false);
    };
    let mut cur: Vec<OsString> = parents.iter().map(|p| p.to_os_string()).collect();
    let mut pending: std::collections::VecDeque<OsString> = Default::default();
    let target = read_link(open_dir(root, &join(&cur))?.as_fd(), name)?;
    if !push_target(&mut pending, &target) {
        return Ok(false);
    }
    let mut hops = 1;
    let mut missing = false;
    while let Some(c) = pending.pop_front() {
        match c.as_bytes() {
            b"" | b"." => continue,
            b".." => {
                if cur.pop().is_none() {
                    return Ok(false);
                }
                continue;
            }
            _ => {}
        }
        if missing {
            cur.push(c);
            continue;
        }
        let dir = open_dir(root, &join(&cur))?;
        match kind(dir.as_fd(), &c) {
            Ok((FileType::Symlink, _)) => {
                hops += 1;
                if hops > MAX_HOPS {
                    return Ok(false);
                }
                let t = read_link(dir.as_fd(), &c)?;
                let mut rest: Vec<OsString> = pending.drain(..).collect();
                if !push_target(&mut pending, &t) {
                    return Ok(false);
                }
                pending.extend(rest.drain(..));
            }
            Ok((FileType::Directory, _)) => cur.push(c),
            Ok(_) | Err(_) => {
                // A file, or nothing: whatever follows is taken lexically.
                missing = true;
                cur.push(c);
            }
        }
    }
    Ok(true)
}

fn push_target(pending: &mut std::collections::VecDeque<OsString>, target: &Path) -> bool {
    if target.is_absolute() || target.as_os_str().is_empty() {
        return false;
    }
    for c in target.as_os_str().as_bytes().split(|b| *b == b'/') {
        pending.push_back(OsString::from_vec(c.to_vec()));
    }
    true
}

fn join(parts: &[OsString]) -> PathBuf {
    parts.iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn links_are_resolved_against_the_real_tree() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        std::fs::create_dir_all(r.join("x/y")).unwrap();
        symlink(".", r.join("d")).unwrap();
        symlink("../d/d/../..", r.join("x/l")).unwrap();
        symlink("../../inside", r.join("x/y/ok")).unwrap();
        symlink("/etc/passwd", r.join("abs")).unwrap();
        symlink("missing/../../etc", r.join("m")).unwrap();
        symlink("loop2", r.join("loop1")).unwrap();
        symlink("loop1", r.join("loop2")).unwrap();
        symlink("y/../../x", r.join("x/back")).unwrap();
        let root = open_root(r).unwrap();
        let inside = |p: &str| link_stays_inside(root.as_fd(), Path::new(p)).unwrap();
        assert!(inside("d"));
        assert!(!inside("x/l"), "d -> . makes ../d/d/../.. climb out");
        assert!(inside("x/y/ok"));
        assert!(!inside("abs"));
        assert!(!inside("m"));
        assert!(!inside("loop1"));
        assert!(inside("x/back"));
    }
}
