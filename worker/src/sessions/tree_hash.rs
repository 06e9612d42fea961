//! The tree hash of a workspace: one sha256 over every entry's name, type, mode, and
//! content (a regular file's bytes, a link's target, a device's number, a directory's own
//! hash), in name order; owners and times are left out (a fork's workspace has another
//! host uid). Snapshots report it, and tests compare it across suspend and resume.
//!
//! The walk is beneath-safe, like the node's other walks (`disk_usage`, `reown`,
//! `remove_tree`): each directory is opened by one name relative to its parent's fd with
//! `O_NOFOLLOW | O_DIRECTORY`, entries are `fstatat(AT_SYMLINK_NOFOLLOW)`-ed, a link is read
//! (`readlinkat`), never followed, a regular file is opened `O_NOFOLLOW | O_NONBLOCK`
//! beneath its directory and checked to be the same regular file once open (a FIFO or
//! device swapped in is never read). Everything is opened `O_NOATIME`, so hashing changes
//! nothing. It is bounded in depth ([`Bounds::max_depth`] fds open at most), entries,
//! bytes read and time; past a bound it stops with a [`TreeHashError`] naming it.

use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags};
use sha2::{Digest, Sha256};

/// What one hash may meet before it stops.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub max_depth: usize,
    pub max_entries: u64,
    pub max_bytes: u64,
    pub time: Duration,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            max_depth: 256,
            max_entries: 1_000_000,
            max_bytes: 64 << 30,
            time: Duration::from_secs(120),
        }
    }
}

/// Why a tree was not hashed.
#[derive(Debug, thiserror::Error)]
pub enum TreeHashError {
    #[error("the tree is deeper than {0} directories")]
    TooDeep(usize),
    #[error("the tree has more than {0} entries")]
    TooManyEntries(u64),
    #[error("the files hold more than {0} bytes")]
    TooManyBytes(u64),
    #[error("hashing took longer than its bound of {}s", .0.as_secs())]
    TooSlow(Duration),
    #[error("{path}: changed while it was hashed")]
    Changed { path: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

fn io(path: &[u8], e: impl Into<std::io::Error>) -> TreeHashError {
    TreeHashError::Io {
        path: crate::sandbox_files::escape_name(path),
        source: e.into(),
    }
}

/// One directory being hashed.
struct Frame {
    fd: OwnedFd,
    /// Its path from the root (for errors).
    path: Vec<u8>,
    /// Its entries, sorted, and the next to hash.
    names: Vec<OsString>,
    next: usize,
    hasher: Sha256,
    /// The name this directory has in its parent (empty for the root).
    name: OsString,
    mode: u32,
}

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC)
    .union(OFlags::NOATIME);

/// The hash of the tree at `root` (a directory, not followed if a link): `sha256:<hex>`.
/// Blocking.
pub fn tree_hash(root: &Path, b: Bounds) -> Result<String, TreeHashError> {
    let fd = rfs::open(root, DIR_FLAGS, Mode::empty()).map_err(|e| io(b"", e))?;
    hash_dir_fd(fd, b)
}

/// As [`tree_hash`], from an open directory.
pub fn hash_dir_fd(fd: OwnedFd, b: Bounds) -> Result<String, TreeHashError> {
    let deadline = Instant::now() + b.time;
    let mut entries = 0u64;
    let mut bytes = 0u64;
    let mode = rfs::fstat(&fd).map_err(|e| io(b"", e))?.st_mode;
    let mut stack = vec![open_frame(fd, Vec::new(), OsString::new(), mode)?];
    loop {
        if Instant::now() > deadline {
            return Err(TreeHashError::TooSlow(b.time));
        }
        let depth = stack.len();
        let Some(top) = stack.last_mut() else {
            unreachable!("the root frame is popped only at the end");
        };
        if top.next == top.names.len() {
            let Some(done) = stack.pop() else {
                unreachable!("a frame is on the stack");
            };
            let digest = done.hasher.finalize();
            match stack.last_mut() {
                None => return Ok(format!("sha256:{}", hex::encode(digest))),
                Some(parent) => {
                    record(&mut parent.hasher, b'd', &done.name, done.mode, &digest);
                    continue;
                }
            }
        }
        let name = top.names[top.next].clone();
        top.next += 1;
        entries += 1;
        if entries > b.max_entries {
            return Err(TreeHashError::TooManyEntries(b.max_entries));
        }
        let mut path = top.path.clone();
        if !path.is_empty() {
            path.push(b'/');
        }
        path.extend_from_slice(name.as_bytes());
        let st = match rfs::statat(top.fd.as_fd(), &name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(e) => return Err(io(&path, e)),
        };
        let perm = st.st_mode & 0o7777;
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Directory => {
                if depth >= b.max_depth {
                    return Err(TreeHashError::TooDeep(b.max_depth));
                }
                let fd = rfs::openat(top.fd.as_fd(), &name, DIR_FLAGS, Mode::empty())
                    .map_err(|e| io(&path, e))?;
                let seen = rfs::fstat(&fd).map_err(|e| io(&path, e))?;
                if (seen.st_dev, seen.st_ino) != (st.st_dev, st.st_ino) {
                    return Err(TreeHashError::Changed {
                        path: crate::sandbox_files::escape_name(&path),
                    });
                }
                stack.push(open_frame(fd, path, name, perm)?);
            }
            FileType::RegularFile => {
                let digest = hash_file(top.fd.as_fd(), &name, &path, &st, deadline, b, &mut bytes)?;
                record(&mut top.hasher, b'f', &name, perm, &digest);
            }
            FileType::Symlink => {
                let target =
                    rfs::readlinkat(top.fd.as_fd(), &name, Vec::new()).map_err(|e| io(&path, e))?;
                record(&mut top.hasher, b'l', &name, 0, target.as_bytes());
            }
            kind => {
                let (tag, rdev) = match kind {
                    FileType::Fifo => (b'p', 0),
                    FileType::Socket => (b's', 0),
                    FileType::CharacterDevice => (b'c', st.st_rdev),
                    FileType::BlockDevice => (b'b', st.st_rdev),
                    _ => (b'?', 0),
                };
                record(&mut top.hasher, tag, &name, perm, &rdev.to_le_bytes());
            }
        }
    }
}

fn open_frame(
    fd: OwnedFd,
    path: Vec<u8>,
    name: OsString,
    mode: u32,
) -> Result<Frame, TreeHashError> {
    let dup = rfs::openat(&fd, ".", DIR_FLAGS, Mode::empty()).map_err(|e| io(&path, e))?;
    let mut dir = rfs::Dir::new(dup).map_err(|e| io(&path, e))?;
    let mut names = Vec::new();
    while let Some(ent) = dir.read() {
        let ent = ent.map_err(|e| io(&path, e))?;
        let n = ent.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(OsString::from_vec(n.to_vec()));
        }
    }
    names.sort();
    Ok(Frame {
        fd,
        path,
        names,
        next: 0,
        hasher: Sha256::new(),
        name,
        mode: mode & 0o7777,
    })
}

/// One entry in its directory's hash: type, name (length-prefixed), mode, content digest.
fn record(h: &mut Sha256, tag: u8, name: &OsStr, mode: u32, content: &[u8]) {
    h.update([tag]);
    h.update((name.len() as u64).to_le_bytes());
    h.update(name.as_bytes());
    h.update(mode.to_le_bytes());
    h.update((content.len() as u64).to_le_bytes());
    h.update(content);
}

#[allow(clippy::too_many_arguments)]
fn hash_file(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    path: &[u8],
    st: &rfs::Stat,
    deadline: Instant,
    b: Bounds,
    bytes: &mut u64,
) -> Result<Vec<u8>, TreeHashError> {
    let fd = rfs::openat(
        dir,
        name,
        OFlags::RDONLY
            | OFlags::NOFOLLOW
            | OFlags::NONBLOCK
            | OFlags::NOCTTY
            | OFlags::CLOEXEC
            | OFlags::NOATIME,
        Mode::empty(),
    )
    .map_err(|e| io(path, e))?;
    let seen = rfs::fstat(&fd).map_err(|e| io(path, e))?;
    if FileType::from_raw_mode(seen.st_mode) != FileType::RegularFile
        || (seen.st_dev, seen.st_ino) != (st.st_dev, st.st_ino)
    {
        return Err(TreeHashError::Changed {
            path: crate::sandbox_files::escape_name(path),
        });
    }
    let mut f = std::fs::File::from(fd);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 256 << 10];
    loop {
        let n = f.read(&mut buf).map_err(|e| io(path, e))?;
        if n == 0 {
            break;
        }
        *bytes += n as u64;
        if *bytes > b.max_bytes {
            return Err(TreeHashError::TooManyBytes(b.max_bytes));
        }
        if Instant::now() > deadline {
            return Err(TreeHashError::TooSlow(b.time));
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn b() -> Bounds {
        Bounds::default()
    }

    #[test]
    fn same_tree_same_hash_and_every_change_shows() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        std::fs::create_dir_all(r.join("a/b")).unwrap();
        std::fs::write(r.join("a/b/f"), "x").unwrap();
        symlink("/etc/passwd", r.join("link")).unwrap();
        let h1 = tree_hash(r, b()).unwrap();
        assert_eq!(h1, tree_hash(r, b()).unwrap());
        std::fs::write(r.join("a/b/f"), "y").unwrap();
        let h2 = tree_hash(r, b()).unwrap();
        assert_ne!(h1, h2);
        std::fs::remove_file(r.join("link")).unwrap();
        symlink("/etc/shadow", r.join("link")).unwrap();
        assert_ne!(h2, tree_hash(r, b()).unwrap());
    }

    #[test]
    fn links_and_fifos_are_never_opened_and_depth_is_bounded() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        symlink("/", r.join("root")).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            r.join("fifo"),
            FileType::Fifo,
            Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
        // A FIFO with no writer: opening it for reading without O_NONBLOCK would hang.
        tree_hash(r, b()).unwrap();
        let mut p = r.to_path_buf();
        for _ in 0..40 {
            p.push("d");
        }
        std::fs::create_dir_all(&p).unwrap();
        let small = Bounds {
            max_depth: 10,
            ..b()
        };
        assert!(matches!(
            tree_hash(r, small),
            Err(TreeHashError::TooDeep(10))
        ));
        let few = Bounds {
            max_entries: 5,
            ..b()
        };
        assert!(matches!(
            tree_hash(r, few),
            Err(TreeHashError::TooManyEntries(5))
        ));
    }
}
