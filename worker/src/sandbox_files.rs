//! Host-side reads of files a sandbox wrote (everything under /job and /workspace is hostile input): every open goes beneath a
//! directory fd with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`
//! and `O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC`, only regular files are read (a FIFO neither
//! blocks nor is read), and every read is bounded in bytes and in time. Directory walks open
//! each directory the same way and stat entries with `AT_SYMLINK_NOFOLLOW`, bounded in
//! entries and time.

use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use sha2::{Digest, Sha256};

/// Chunk size of bounded reads.
const CHUNK: usize = 64 * 1024;

/// Why a sandbox file was not read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{path} does not exist")]
    Missing { path: String },
    #[error(
        "{path} is a symbolic link or resolves outside its directory; the node never follows links"
    )]
    Link { path: String },
    #[error("{path} is not a regular file but a {kind}")]
    NotRegular { path: String, kind: &'static str },
    #[error("{path} is {size} bytes, over the cap of {cap} bytes")]
    TooLarge { path: String, size: u64, cap: u64 },
    #[error("reading {path} took longer than the bound of {}s", .limit.as_secs_f64())]
    TooSlow { path: String, limit: Duration },
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

fn io_err(path: &str, e: rustix::io::Errno) -> ReadError {
    match e {
        rustix::io::Errno::NOENT => ReadError::Missing { path: path.into() },
        // ELOOP: a link on the way or at the end; EXDEV: `..` or an absolute path leaving
        // the directory.
        rustix::io::Errno::LOOP | rustix::io::Errno::XDEV => ReadError::Link { path: path.into() },
        other => ReadError::Io {
            path: path.into(),
            source: other.into(),
        },
    }
}

/// The name of a file type for messages.
pub fn kind_name(t: FileType) -> &'static str {
    match t {
        FileType::RegularFile => "regular file",
        FileType::Directory => "directory",
        FileType::Symlink => "symbolic link",
        FileType::Fifo => "fifo",
        FileType::Socket => "socket",
        FileType::CharacterDevice => "character device",
        FileType::BlockDevice => "block device",
        FileType::Unknown => "file of unknown type",
    }
}

/// Opens a directory the node itself created (its path is the node's, not the sandbox's),
/// refusing a link at its last component.
pub fn open_dir(path: &Path) -> std::io::Result<OwnedFd> {
    Ok(crate::fd_walk::open_node_dir(path)?)
}

fn resolve() -> ResolveFlags {
    ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS
}

/// Opens `rel` beneath `dir` without following any link; `extra` adds open flags.
pub fn open_beneath(dir: BorrowedFd<'_>, rel: &str, extra: OFlags) -> Result<OwnedFd, ReadError> {
    open_beneath_raw(dir, Path::new(rel), rel, extra)
}

/// [`open_beneath`] of a path that may not be UTF-8; `shown` names it in errors.
fn open_beneath_raw(
    dir: BorrowedFd<'_>,
    rel: &Path,
    shown: &str,
    extra: OFlags,
) -> Result<OwnedFd, ReadError> {
    rustix::fs::openat2(
        dir,
        rel,
        OFlags::RDONLY
            | OFlags::NOFOLLOW
            | OFlags::NONBLOCK
            | OFlags::CLOEXEC
            | OFlags::NOCTTY
            | extra,
        Mode::empty(),
        resolve(),
    )
    .map_err(|e| match e {
        // O_DIRECTORY on a link at the end says ENOTDIR: name the link.
        rustix::io::Errno::NOTDIR
            if rustix::fs::statat(dir, rel, AtFlags::SYMLINK_NOFOLLOW)
                .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Symlink) =>
        {
            ReadError::Link { path: shown.into() }
        }
        other => io_err(shown, other),
    })
}

/// Opens `rel` beneath `dir` as a regular file of at most `cap` bytes; returns it and its
/// size.
pub fn open_regular(
    dir: BorrowedFd<'_>,
    rel: &str,
    cap: u64,
) -> Result<(std::fs::File, u64), ReadError> {
    open_regular_raw(dir, Path::new(rel), rel, cap)
}

/// [`open_regular`] of a path that may not be UTF-8; `shown` names it in errors.
fn open_regular_raw(
    dir: BorrowedFd<'_>,
    raw: &Path,
    rel: &str,
    cap: u64,
) -> Result<(std::fs::File, u64), ReadError> {
    let fd = open_beneath_raw(dir, raw, rel, OFlags::empty())?;
    let st = rustix::fs::fstat(&fd).map_err(|e| io_err(rel, e))?;
    let kind = FileType::from_raw_mode(st.st_mode);
    if kind != FileType::RegularFile {
        return Err(ReadError::NotRegular {
            path: rel.into(),
            kind: kind_name(kind),
        });
    }
    let size = u64::try_from(st.st_size).unwrap_or(0);
    if size > cap {
        return Err(ReadError::TooLarge {
            path: rel.into(),
            size,
            cap,
        });
    }
    Ok((std::fs::File::from(fd), size))
}

/// Feeds at most `cap` bytes of `f` to `sink`, giving up at `deadline`; returns the bytes
/// read. A file that grows past `cap` while read is refused too.
fn read_chunks(
    f: &mut std::fs::File,
    rel: &str,
    cap: u64,
    deadline: Instant,
    limit: Duration,
    mut sink: impl FnMut(&[u8]),
) -> Result<u64, ReadError> {
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0u64;
    loop {
        if Instant::now() > deadline {
            return Err(ReadError::TooSlow {
                path: rel.into(),
                limit,
            });
        }
        let n = match f.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(ReadError::Io {
                    path: rel.into(),
                    source: e,
                })
            }
        };
        if n == 0 {
            return Ok(total);
        }
        total += n as u64;
        if total > cap {
            return Err(ReadError::TooLarge {
                path: rel.into(),
                size: total,
                cap,
            });
        }
        sink(&buf[..n]);
    }
}

/// Reads the regular file `rel` beneath `dir`: at most `cap` bytes, within `limit`.
pub fn read_bounded(
    dir: BorrowedFd<'_>,
    rel: &str,
    cap: u64,
    limit: Duration,
) -> Result<Vec<u8>, ReadError> {
    let deadline = Instant::now() + limit;
    let (mut f, size) = open_regular(dir, rel, cap)?;
    let mut out = Vec::with_capacity(usize::try_from(size.min(cap)).unwrap_or(0));
    read_chunks(&mut f, rel, cap, deadline, limit, |b| {
        out.extend_from_slice(b)
    })?;
    Ok(out)
}

/// [`read_bounded`] of `rel` beneath the node's directory `dir`.
pub fn read_file_beneath(
    dir: &Path,
    rel: &str,
    cap: u64,
    limit: Duration,
) -> Result<Vec<u8>, ReadError> {
    let fd = open_dir(dir).map_err(|e| ReadError::Io {
        path: dir.display().to_string(),
        source: e,
    })?;
    read_bounded(fd.as_fd(), rel, cap, limit)
}

/// One entry met by [`walk`].
#[derive(Debug, Clone)]
pub struct Entry {
    /// Path relative to the walked directory, `/`-separated, for showing: bytes of a name
    /// that are not UTF-8 are written `\xNN` (see [`escape_name`]).
    pub rel: String,
    /// The same path as it is on disk, for opening.
    pub path: PathBuf,
    /// Whether every name on the path is UTF-8 (then `rel` is the path exactly).
    pub utf8: bool,
    pub kind: FileType,
    pub size: u64,
    /// Bytes allocated on disk (`st_blocks * 512`).
    pub allocated: u64,
}

/// `bytes` as text: UTF-8 as it is, every other byte as `\xNN`.
pub fn escape_name(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        out.push_str(chunk.valid());
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// Why a walk stopped.
#[derive(Debug, thiserror::Error)]
pub enum WalkError<E: std::error::Error + 'static> {
    #[error("more than {0} entries")]
    TooManyEntries(u64),
    #[error("the walk took longer than its bound of {}s", .0.as_secs_f64())]
    TooSlow(Duration),
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error(transparent)]
    Visit(E),
}

/// Walks `root` (a directory fd) depth-first without following links, calling `visit` for
/// every entry with `root`'s fd. Stops after `max_entries` entries or at `deadline`.
pub fn walk<E: std::error::Error + 'static>(
    root: BorrowedFd<'_>,
    max_entries: u64,
    deadline: Instant,
    limit: Duration,
    mut visit: impl FnMut(BorrowedFd<'_>, &Entry) -> Result<(), E>,
) -> Result<u64, WalkError<E>> {
    // (path on disk, path shown, all UTF-8)
    let mut stack: Vec<(PathBuf, String, bool)> = vec![(PathBuf::new(), String::new(), true)];
    let mut seen = 0u64;
    while let Some((dir_path, dir_rel, dir_utf8)) = stack.pop() {
        let fd = if dir_rel.is_empty() {
            open_beneath(root, ".", OFlags::DIRECTORY)?
        } else {
            match open_beneath_raw(root, &dir_path, &dir_rel, OFlags::DIRECTORY) {
                Ok(fd) => fd,
                // Removed or swapped for a link since it was listed (a sandbox still
                // running): nothing to walk there, and a link is never followed.
                Err(ReadError::Missing { .. } | ReadError::Link { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        let mut dir = rustix::fs::Dir::new(fd).map_err(|e| io_err(&dir_rel, e))?;
        while let Some(ent) = dir.read() {
            let ent = ent.map_err(|e| io_err(&dir_rel, e))?;
            let name = ent.file_name();
            let bytes = name.to_bytes();
            if bytes == b"." || bytes == b".." {
                continue;
            }
            seen += 1;
            if seen > max_entries {
                return Err(WalkError::TooManyEntries(max_entries));
            }
            if Instant::now() > deadline {
                return Err(WalkError::TooSlow(limit));
            }
            let (name_str, name_utf8) = match std::str::from_utf8(bytes) {
                Ok(s) => (s.to_string(), true),
                Err(_) => (escape_name(bytes), false),
            };
            let rel = if dir_rel.is_empty() {
                name_str
            } else {
                format!("{dir_rel}/{name_str}")
            };
            let path = dir_path.join(std::ffi::OsStr::from_bytes(bytes));
            let utf8 = dir_utf8 && name_utf8;
            let dfd = dir.fd().map_err(|e| io_err(&rel, e))?;
            let st = match rustix::fs::statat(dfd, name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                // Removed meanwhile (a sandbox still running): not there.
                Err(rustix::io::Errno::NOENT) => continue,
                Err(e) => return Err(io_err(&rel, e).into()),
            };
            let kind = FileType::from_raw_mode(st.st_mode);
            let entry = Entry {
                rel: rel.clone(),
                path: path.clone(),
                utf8,
                kind,
                size: u64::try_from(st.st_size).unwrap_or(0),
                allocated: u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512),
            };
            visit(root, &entry).map_err(WalkError::Visit)?;
            if kind == FileType::Directory {
                stack.push((path, rel, utf8));
            }
        }
    }
    Ok(seen)
}

/// Bounds on hashing a tree of sandbox files.
#[derive(Debug, Clone, Copy)]
pub struct TreeBounds {
    pub max_files: u64,
    pub max_file_bytes: u64,
    pub max_total_bytes: u64,
    pub time: Duration,
}

/// Why a tree was not hashed.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error("more than {0} files or directories (the cap on their number)")]
    TooManyFiles(u64),
    #[error("{path} is {size} bytes, over the per-file cap of {cap} bytes")]
    FileTooLarge { path: String, size: u64, cap: u64 },
    #[error("the files total more than the cap of {cap} bytes")]
    TotalTooLarge { cap: u64 },
    #[error("hashing took longer than the bound of {}s", .0.as_secs_f64())]
    TooSlow(Duration),
    /// A file whose name (or a directory's on its path) is not UTF-8: artifact paths are
    /// UTF-8 text on the wire, and no lossy spelling may stand for it (`x\xff` would be
    /// listed as `x\u{fffd}`, the name of another file).
    #[error("{path}: the name is not UTF-8 (its other bytes shown as \\xNN); artifact names must be UTF-8")]
    NotUtf8 { path: String },
    #[error("{0}")]
    Read(ReadError),
}

impl From<ReadError> for TreeError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::TooLarge { path, size, cap } => TreeError::FileTooLarge { path, size, cap },
            ReadError::TooSlow { limit, .. } => TreeError::TooSlow(limit),
            other => TreeError::Read(other),
        }
    }
}

impl From<WalkError<TreeError>> for TreeError {
    fn from(e: WalkError<TreeError>) -> Self {
        match e {
            WalkError::TooManyEntries(n) => TreeError::TooManyFiles(n),
            WalkError::TooSlow(d) => TreeError::TooSlow(d),
            WalkError::Read(r) => r.into(),
            WalkError::Visit(v) => v,
        }
    }
}

/// One hashed file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hashed {
    pub rel: String,
    pub size: u64,
    pub sha256: String,
}

/// sha256 and size of every regular file under `rel` beneath the node's directory `base`,
/// sorted by path. Links, FIFOs and other special files are never opened nor listed; `rel`
/// itself being a link is an error. A missing `rel` is an empty tree. A regular file whose
/// path is not UTF-8 refuses the whole tree ([`TreeError::NotUtf8`], the name escaped):
/// it is never listed under a lossy name nor left out unsaid.
pub fn hash_tree(base: &Path, rel: &str, b: TreeBounds) -> Result<Vec<Hashed>, TreeError> {
    let base_fd = open_dir(base).map_err(|e| {
        TreeError::Read(ReadError::Io {
            path: rel.into(),
            source: e,
        })
    })?;
    let root = match open_beneath(base_fd.as_fd(), rel, OFlags::DIRECTORY) {
        Ok(fd) => fd,
        Err(ReadError::Missing { .. }) => return Ok(Vec::new()),
        Err(e) => return Err(TreeError::Read(e)),
    };
    let deadline = Instant::now() + b.time;
    let mut total = 0u64;
    let mut out = Vec::new();
    walk(root.as_fd(), b.max_files, deadline, b.time, |root, e| {
        if e.kind != FileType::RegularFile {
            return Ok(());
        }
        if !e.utf8 {
            return Err(TreeError::NotUtf8 {
                path: e.rel.clone(),
            });
        }
        if e.size > b.max_file_bytes {
            return Err(TreeError::FileTooLarge {
                path: e.rel.clone(),
                size: e.size,
                cap: b.max_file_bytes,
            });
        }
        if total.saturating_add(e.size) > b.max_total_bytes {
            return Err(TreeError::TotalTooLarge {
                cap: b.max_total_bytes,
            });
        }
        let (mut f, _) = open_regular_raw(root, &e.path, &e.rel, b.max_file_bytes)?;
        let mut h = Sha256::new();
        let n = read_chunks(&mut f, &e.rel, b.max_file_bytes, deadline, b.time, |c| {
            h.update(c)
        })?;
        total = total.saturating_add(n);
        if total > b.max_total_bytes {
            return Err(TreeError::TotalTooLarge {
                cap: b.max_total_bytes,
            });
        }
        out.push(Hashed {
            rel: e.rel.clone(),
            size: n,
            sha256: hex::encode(h.finalize()),
        });
        Ok(())
    })?;
    out.sort_by(|a, b| a.rel.cmp(&b.rel));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    const SEC: Duration = Duration::from_secs(5);

    fn dir() -> (tempfile::TempDir, OwnedFd) {
        let d = tempfile::tempdir().unwrap();
        let fd = open_dir(d.path()).unwrap();
        (d, fd)
    }

    #[test]
    fn reads_a_regular_file() {
        let (d, fd) = dir();
        std::fs::write(d.path().join("r.json"), b"{}").unwrap();
        assert_eq!(read_bounded(fd.as_fd(), "r.json", 10, SEC).unwrap(), b"{}");
    }

    #[test]
    fn refuses_a_symlink_even_to_a_file_beside_it() {
        let (d, fd) = dir();
        std::fs::write(d.path().join("real"), b"x").unwrap();
        symlink("real", d.path().join("r.json")).unwrap();
        let e = read_bounded(fd.as_fd(), "r.json", 10, SEC).unwrap_err();
        assert!(matches!(e, ReadError::Link { .. }), "{e}");
        // A link on the way is refused too.
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("sub/f"), b"x").unwrap();
        symlink("sub", d.path().join("via")).unwrap();
        let e = read_bounded(fd.as_fd(), "via/f", 10, SEC).unwrap_err();
        assert!(matches!(e, ReadError::Link { .. }), "{e}");
    }

    #[test]
    fn refuses_an_absolute_link_and_dotdot() {
        let (d, fd) = dir();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"secret").unwrap();
        symlink(outside.path().join("secret"), d.path().join("r.json")).unwrap();
        let e = read_bounded(fd.as_fd(), "r.json", 100, SEC).unwrap_err();
        assert!(matches!(e, ReadError::Link { .. }), "{e}");
        let rel = format!(
            "../{}/secret",
            outside.path().file_name().unwrap().to_str().unwrap()
        );
        let e = read_bounded(fd.as_fd(), &rel, 100, SEC).unwrap_err();
        assert!(matches!(e, ReadError::Link { .. }), "{e}");
        let abs = outside.path().join("secret").display().to_string();
        let e = read_bounded(fd.as_fd(), &abs, 100, SEC).unwrap_err();
        assert!(matches!(e, ReadError::Link { .. }), "{e}");
    }

    #[test]
    fn a_fifo_neither_blocks_nor_is_read() {
        let (d, fd) = dir();
        let p = std::ffi::CString::new(d.path().join("r.json").display().to_string()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(p.as_ptr(), 0o644) }, 0);
        let t = Instant::now();
        let e = read_bounded(fd.as_fd(), "r.json", 10, SEC).unwrap_err();
        assert!(
            matches!(e, ReadError::NotRegular { kind: "fifo", .. }),
            "{e}"
        );
        assert!(t.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn oversize_is_refused_without_reading() {
        let (d, fd) = dir();
        let f = std::fs::File::create(d.path().join("big")).unwrap();
        f.set_len(1 << 40).unwrap();
        let e = read_bounded(fd.as_fd(), "big", 1 << 20, SEC).unwrap_err();
        assert_eq!(
            e.to_string(),
            "big is 1099511627776 bytes, over the cap of 1048576 bytes"
        );
        assert!(matches!(
            read_bounded(fd.as_fd(), "missing", 1, SEC).unwrap_err(),
            ReadError::Missing { .. }
        ));
    }

    fn bounds() -> TreeBounds {
        TreeBounds {
            max_files: 10,
            max_file_bytes: 100,
            max_total_bytes: 150,
            time: SEC,
        }
    }

    #[test]
    fn hash_tree_lists_regular_files_and_skips_links() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("sub/a"), b"abc").unwrap();
        std::fs::write(d.path().join("b"), b"").unwrap();
        symlink("/etc/passwd", d.path().join("l")).unwrap();
        symlink("/etc", d.path().join("ld")).unwrap();
        let got = hash_tree(d.path(), ".", bounds()).unwrap();
        let names: Vec<_> = got.iter().map(|h| (h.rel.as_str(), h.size)).collect();
        assert_eq!(names, vec![("b", 0), ("sub/a", 3)]);
        assert_eq!(
            got[1].sha256,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(hash_tree(d.path(), "none", bounds()).unwrap().is_empty());
        // The tree's own directory being a link is refused, not followed.
        let e = hash_tree(d.path(), "ld", bounds()).unwrap_err();
        assert!(matches!(e, TreeError::Read(ReadError::Link { .. })), "{e}");
    }

    #[test]
    fn a_name_that_is_not_utf8_refuses_the_tree_and_never_collides() {
        use std::os::unix::ffi::OsStrExt;
        let d = tempfile::tempdir().unwrap();
        let raw = d.path().join(std::ffi::OsStr::from_bytes(b"x\xff"));
        std::fs::write(&raw, b"raw").unwrap();
        std::fs::write(d.path().join("x\u{fffd}"), b"lossy").unwrap();
        let e = hash_tree(d.path(), ".", bounds()).unwrap_err();
        assert!(
            matches!(&e, TreeError::NotUtf8 { path } if path == "x\\xff"),
            "{e}"
        );
        // Under a directory whose name is not UTF-8, too.
        std::fs::remove_file(&raw).unwrap();
        let sub = d.path().join(std::ffi::OsStr::from_bytes(b"d\xfe"));
        std::fs::create_dir(&sub).unwrap();
        std::fs::write(sub.join("f"), b"").unwrap();
        let e = hash_tree(d.path(), ".", bounds()).unwrap_err();
        assert!(
            matches!(&e, TreeError::NotUtf8 { path } if path == "d\\xfe/f"),
            "{e}"
        );
        std::fs::remove_file(sub.join("f")).unwrap();
        let got = hash_tree(d.path(), ".", bounds()).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].rel.as_str(), got[0].size), ("x\u{fffd}", 5));
        assert_eq!(escape_name(b"a\xffb\xc3"), "a\\xffb\\xc3");
    }

    #[test]
    fn hash_tree_bounds_count_file_size_and_total() {
        let d = tempfile::tempdir().unwrap();
        for i in 0..11 {
            std::fs::write(d.path().join(format!("f{i}")), b"").unwrap();
        }
        let e = hash_tree(d.path(), ".", bounds()).unwrap_err();
        assert!(matches!(e, TreeError::TooManyFiles(10)), "{e}");

        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("big"), [0u8; 101]).unwrap();
        let e = hash_tree(d.path(), ".", bounds()).unwrap_err();
        assert!(
            matches!(e, TreeError::FileTooLarge { size: 101, .. }),
            "{e}"
        );

        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a"), [0u8; 80]).unwrap();
        std::fs::write(d.path().join("b"), [0u8; 80]).unwrap();
        let e = hash_tree(d.path(), ".", bounds()).unwrap_err();
        assert!(matches!(e, TreeError::TotalTooLarge { cap: 150 }), "{e}");
    }

    #[test]
    fn hash_tree_is_bounded_in_time() {
        let d = tempfile::tempdir().unwrap();
        let f = std::fs::File::create(d.path().join("sparse")).unwrap();
        f.set_len(64 << 30).unwrap();
        let b = TreeBounds {
            max_files: 10,
            max_file_bytes: u64::MAX,
            max_total_bytes: u64::MAX,
            time: Duration::from_millis(200),
        };
        let t = Instant::now();
        let e = hash_tree(d.path(), ".", b).unwrap_err();
        assert!(matches!(e, TreeError::TooSlow(_)), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    }
}
