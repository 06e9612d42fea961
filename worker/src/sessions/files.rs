//! A running session's files without an exec: read one, write one, list a directory, all
//! beneath the session's workspace and never through a link.
//!
//! - Paths are relative to `/workspace`: `..`, an absolute path, a NUL byte, an empty
//!   component name or a path over [`MAX_PATH_BYTES`] is refused (400) before anything is
//!   opened.
//! - Every directory on the way is opened beneath the workspace's fd with `openat2`
//!   (`RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`): a symlinked parent,
//!   or a link at the last component, is refused (400), never followed.
//! - Reads open regular files only, `O_NONBLOCK` (a FIFO is refused from its `lstat`
//!   before any open, and an open never waits for a writer), at most [`MAX_READ_BYTES`],
//!   and never more than the size the file had when opened. A hard link to a file the
//!   session's uid does not own is refused: only the host could have made one (a link to
//!   a file outside the workspace volume is `EXDEV` from inside), and the node does not
//!   serve what it did not give the session.
//! - Writes are atomic: the bytes go to a fresh temporary file beside the target
//!   (`O_CREAT | O_EXCL`, owned by the session's host uid as a command's files are, mode
//!   `0644` or the replaced file's), bounded by `limits.max_request_bytes`, synced, checked
//!   against the session's disk limit ([`crate::disk_guard::check`]) and renamed over the
//!   target; on any failure the temporary file is removed and the target is untouched.
//! - Listings give one directory's entries (name, kind, size, mode; `lstat`, never
//!   followed), at most [`MAX_LIST_ENTRIES`] of them, sorted by name.
//! - FIFOs, sockets and devices are neither read nor replaced (400).
//! - Every call is audited: one structured log line (`session files`) with the session,
//!   operation, path, bytes and outcome.

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use cynode_protocol::worker_api::{check_id, API_VERSION};
use cynode_protocol::worker_session_io::{FileEntry, FileKind, FileListing, FileWritten};
use cynode_protocol::ValidationError;
use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::state::Phase;
use super::{SessionError, Sessions};

/// Resolution that never leaves the directory and never follows a link.
const NO_LINKS: rfs::ResolveFlags = rfs::ResolveFlags::BENEATH
    .union(rfs::ResolveFlags::NO_SYMLINKS)
    .union(rfs::ResolveFlags::NO_MAGICLINKS);

/// The longest path the files API takes, in bytes (the kernel's `PATH_MAX`).
pub const MAX_PATH_BYTES: usize = 4096;
/// The largest file a read returns.
pub const MAX_READ_BYTES: u64 = 256 * 1024 * 1024;
/// The most entries one listing returns.
pub const MAX_LIST_ENTRIES: usize = 10_000;
/// The prefix of a write's temporary file beside its target.
const TEMP_PREFIX: &str = ".cynode-put-";

/// A file opened for reading: stream at most `size` bytes of it.
#[derive(Debug)]
pub struct FileRead {
    pub file: std::fs::File,
    pub size: u64,
}

/// A checked files-API path: the directories on the way and the last name.
struct RelPath {
    shown: String,
    parents: PathBuf,
    name: Option<OsString>,
}

fn invalid(msg: impl Into<String>) -> SessionError {
    SessionError::Invalid(ValidationError::new("path", msg.into()))
}

/// Checks `path` (relative to `/workspace`); `""` and `"."` are the workspace itself.
fn parse_path(path: &str) -> Result<RelPath, SessionError> {
    if path.len() > MAX_PATH_BYTES {
        return Err(invalid(format!(
            "path is {} bytes, over the bound of {MAX_PATH_BYTES}",
            path.len()
        )));
    }
    if path.as_bytes().contains(&0) {
        return Err(invalid("path contains a NUL byte"));
    }
    if path.starts_with('/') {
        return Err(invalid("path must be relative to /workspace, not absolute"));
    }
    let mut parts: Vec<&OsStr> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err(invalid("path must not contain `..`")),
            p if p.len() > 255 => {
                return Err(invalid("a path component is over 255 bytes"));
            }
            p => parts.push(OsStr::new(p)),
        }
    }
    let name = parts.pop().map(OsStr::to_os_string);
    Ok(RelPath {
        shown: path.to_string(),
        parents: parts.iter().collect(),
        name,
    })
}

fn kind_of(t: FileType) -> FileKind {
    match t {
        FileType::RegularFile => FileKind::File,
        FileType::Directory => FileKind::Dir,
        FileType::Symlink => FileKind::Symlink,
        FileType::Fifo => FileKind::Fifo,
        FileType::Socket => FileKind::Socket,
        FileType::CharacterDevice => FileKind::CharDevice,
        FileType::BlockDevice => FileKind::BlockDevice,
        FileType::Unknown => FileKind::Unknown,
    }
}

/// The error for `e` met while resolving `shown`.
fn resolve_error(shown: &str, e: Errno) -> SessionError {
    match e {
        Errno::NOENT => SessionError::FileNotFound {
            path: shown.to_string(),
        },
        Errno::LOOP | Errno::XDEV => invalid(format!(
            "{shown} passes a symbolic link or leaves the workspace; links are never followed"
        )),
        Errno::NOTDIR => invalid(format!("a parent of {shown} is not a directory")),
        Errno::NAMETOOLONG => invalid(format!("{shown} is too long")),
        Errno::NOSPC | Errno::DQUOT => invalid(format!(
            "writing {shown} would pass the session's disk limit"
        )),
        other => SessionError::Internal(format!("cannot open {shown}: {other}")),
    }
}

/// Opens the directory `rel` beneath `root`, never through a link. `O_DIRECTORY` on a
/// link at the last component says `ENOTDIR`: that one is named as the link it is (looked
/// at beneath its own parent, opened the same way).
fn open_dir_beneath(
    root: BorrowedFd<'_>,
    rel: &Path,
    shown: &str,
) -> Result<OwnedFd, SessionError> {
    let open = |p: &Path| {
        rfs::openat2(
            root,
            if p.as_os_str().is_empty() {
                Path::new(".")
            } else {
                p
            },
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
            NO_LINKS,
        )
    };
    match open(rel) {
        Ok(fd) => Ok(fd),
        Err(Errno::NOTDIR) => {
            let is_link = match (rel.parent(), rel.file_name()) {
                (Some(up), Some(last)) => open(up).ok().is_some_and(|d| {
                    rfs::statat(&d, last, AtFlags::SYMLINK_NOFOLLOW)
                        .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Symlink)
                }),
                _ => false,
            };
            Err(if is_link {
                resolve_error(shown, Errno::LOOP)
            } else {
                resolve_error(shown, Errno::NOTDIR)
            })
        }
        Err(e) => Err(resolve_error(shown, e)),
    }
}

/// The workspace's fd and the directory `rel.parents` beneath it.
fn open_parent(workspace: &Path, rel: &RelPath) -> Result<OwnedFd, SessionError> {
    let root = crate::sandbox_files::open_dir(workspace)
        .map_err(|e| SessionError::Internal(format!("cannot open the workspace: {e}")))?;
    if rel.parents.as_os_str().is_empty() {
        return Ok(root);
    }
    open_dir_beneath(root.as_fd(), &rel.parents, &rel.shown)
}

/// `name`'s type in `dir`, not following a link; `None` when absent.
fn lstat(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    shown: &str,
) -> Result<Option<rfs::Stat>, SessionError> {
    match rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(st)),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(resolve_error(shown, e)),
    }
}

/// Refuses anything but a regular file (a directory, a link, a FIFO, a socket, a device).
fn must_be_regular(st: &rfs::Stat, shown: &str) -> Result<(), SessionError> {
    let t = FileType::from_raw_mode(st.st_mode);
    match t {
        FileType::RegularFile => Ok(()),
        FileType::Symlink => Err(invalid(format!(
            "{shown} is a symbolic link; links are never followed"
        ))),
        other => Err(invalid(format!(
            "{shown} is not a regular file but a {}",
            crate::sandbox_files::kind_name(other)
        ))),
    }
}

fn read_at(workspace: &Path, host_uid: u32, rel: &RelPath) -> Result<FileRead, SessionError> {
    let Some(name) = &rel.name else {
        return Err(invalid(
            "the workspace is a directory; list it with list=true",
        ));
    };
    let dir = open_parent(workspace, rel)?;
    let st = lstat(dir.as_fd(), name, &rel.shown)?.ok_or_else(|| SessionError::FileNotFound {
        path: rel.shown.clone(),
    })?;
    must_be_regular(&st, &rel.shown)?;
    let fd = rfs::openat2(
        &dir,
        name.as_os_str(),
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
        NO_LINKS,
    )
    .map_err(|e| resolve_error(&rel.shown, e))?;
    // What was opened, not what was looked at: the name may have been swapped between.
    let st = rfs::fstat(&fd).map_err(|e| resolve_error(&rel.shown, e))?;
    must_be_regular(&st, &rel.shown)?;
    if st.st_nlink > 1 && st.st_uid != host_uid {
        return Err(invalid(format!(
            "{} is a hard link to a file the session does not own",
            rel.shown
        )));
    }
    let size = st.st_size as u64;
    if size > MAX_READ_BYTES {
        return Err(invalid(format!(
            "{} is {size} bytes, over the read bound of {MAX_READ_BYTES}",
            rel.shown
        )));
    }
    Ok(FileRead {
        file: std::fs::File::from(fd),
        size,
    })
}

fn list_at(workspace: &Path, rel: &RelPath) -> Result<(Vec<FileEntry>, bool), SessionError> {
    let parent = open_parent(workspace, rel)?;
    let dir = match &rel.name {
        None => parent,
        Some(name) => open_dir_beneath(parent.as_fd(), Path::new(name), &rel.shown)?,
    };
    let mut entries = Vec::new();
    let mut truncated = false;
    let iter = rfs::Dir::read_from(&dir)
        .map_err(|e| SessionError::Internal(format!("cannot list {}: {e}", rel.shown)))?;
    for e in iter {
        let e = e.map_err(|e| SessionError::Internal(format!("cannot list {}: {e}", rel.shown)))?;
        let n = e.file_name().to_bytes();
        if n == b"." || n == b".." {
            continue;
        }
        if entries.len() >= MAX_LIST_ENTRIES {
            truncated = true;
            break;
        }
        let name = OsStr::from_bytes(n);
        // Gone since it was listed: left out.
        let Ok(st) = rfs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) else {
            continue;
        };
        entries.push(FileEntry {
            name: crate::sandbox_files::escape_name(n),
            kind: kind_of(FileType::from_raw_mode(st.st_mode)),
            size: st.st_size as u64,
            mode: st.st_mode & 0o7777,
        });
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((entries, truncated))
}

/// A write's temporary file: removed when dropped unless renamed into place.
struct Temp {
    dir: OwnedFd,
    name: OsString,
    placed: bool,
}

impl Drop for Temp {
    fn drop(&mut self) {
        if !self.placed {
            let _ = rfs::unlinkat(&self.dir, self.name.as_os_str(), AtFlags::empty());
        }
    }
}

/// Opens the write's temporary file beside `rel`'s target, owned by `host_uid`.
fn begin_write(
    workspace: &Path,
    host_uid: u32,
    rel: &RelPath,
) -> Result<(Temp, std::fs::File), SessionError> {
    let Some(name) = &rel.name else {
        return Err(invalid("the workspace is a directory, not a file"));
    };
    if name.as_bytes().starts_with(TEMP_PREFIX.as_bytes()) {
        return Err(invalid(format!(
            "names starting with {TEMP_PREFIX} are the node's own"
        )));
    }
    let dir = open_parent(workspace, rel)?;
    let mode = match lstat(dir.as_fd(), name, &rel.shown)? {
        Some(st) => {
            must_be_regular(&st, &rel.shown)?;
            st.st_mode & 0o777
        }
        None => 0o644,
    };
    let tmp = OsString::from(format!("{TEMP_PREFIX}{}", uuid::Uuid::new_v4().simple()));
    let fd = rfs::openat2(
        &dir,
        tmp.as_os_str(),
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
        NO_LINKS,
    )
    .map_err(|e| resolve_error(&rel.shown, e))?;
    let temp = Temp {
        dir,
        name: tmp,
        placed: false,
    };
    rfs::fchown(
        &fd,
        Some(rfs::Uid::from_raw(host_uid)),
        Some(rfs::Gid::from_raw(host_uid)),
    )
    .map_err(|e| SessionError::Internal(format!("cannot own {}: {e}", rel.shown)))?;
    rfs::fchmod(&fd, Mode::from_raw_mode(mode))
        .map_err(|e| SessionError::Internal(format!("cannot mode {}: {e}", rel.shown)))?;
    Ok((temp, std::fs::File::from(fd)))
}

/// Renames the temporary file over the target (the target's own name: a link there is
/// replaced, never written through; a directory there fails).
fn finish_write(temp: &mut Temp, rel: &RelPath) -> Result<(), SessionError> {
    let Some(name) = &rel.name else {
        return Err(invalid("the workspace is a directory, not a file"));
    };
    // Checked again: a sandbox may have made a FIFO or a directory there meanwhile.
    if let Some(st) = lstat(temp.dir.as_fd(), name, &rel.shown)? {
        must_be_regular(&st, &rel.shown)?;
    }
    rfs::renameat(
        &temp.dir,
        temp.name.as_os_str(),
        &temp.dir,
        name.as_os_str(),
    )
    .map_err(|e| resolve_error(&rel.shown, e))?;
    temp.placed = true;
    Ok(())
}

impl Sessions {
    /// The running session's workspace and its host uid.
    fn files_of(&self, session_id: &str) -> Result<(PathBuf, u32), SessionError> {
        check_id("session_id", session_id)?;
        self.with_entry(session_id, |e| match e.phase {
            Phase::Running(_) => Ok((e.workspace.clone(), e.host_uid)),
            Phase::Starting => Err(SessionError::Conflict(format!(
                "session {session_id} is being created; retry"
            ))),
            Phase::Suspended { .. } => Err(super::suspend::suspended_conflict(session_id)),
            _ => Err(SessionError::Conflict(format!(
                "session {session_id} has ended"
            ))),
        })
    }

    /// Opens the regular file `path` of the session's workspace for reading.
    pub async fn read_file(&self, session_id: &str, path: &str) -> Result<FileRead, SessionError> {
        let r = async {
            let rel = parse_path(path)?;
            let (workspace, uid) = self.files_of(session_id)?;
            blocking(move || read_at(&workspace, uid, &rel)).await
        }
        .await;
        audit(
            session_id,
            "read",
            path,
            r.as_ref().map_or(0, |f| f.size),
            &r,
        );
        r
    }

    /// Lists the directory `path` of the session's workspace.
    pub async fn list_files(
        &self,
        session_id: &str,
        path: &str,
    ) -> Result<FileListing, SessionError> {
        let r = async {
            let rel = parse_path(path)?;
            let (workspace, _) = self.files_of(session_id)?;
            let shown = rel.shown.clone();
            let (entries, truncated) = blocking(move || list_at(&workspace, &rel)).await?;
            Ok(FileListing {
                version: API_VERSION,
                session_id: session_id.to_string(),
                path: shown,
                entries,
                truncated,
            })
        }
        .await;
        audit(
            session_id,
            "list",
            path,
            r.as_ref().map_or(0, |l| l.entries.len() as u64),
            &r,
        );
        r
    }

    /// Writes `body` to `path` in the session's workspace, atomically, at most
    /// `limits.max_request_bytes` bytes.
    pub async fn write_file(
        &self,
        session_id: &str,
        path: &str,
        body: impl tokio::io::AsyncRead + Unpin,
    ) -> Result<FileWritten, SessionError> {
        let mut written = 0u64;
        let r = self.write_inner(session_id, path, body, &mut written).await;
        audit(session_id, "write", path, written, &r);
        r
    }

    async fn write_inner(
        &self,
        session_id: &str,
        path: &str,
        mut body: impl tokio::io::AsyncRead + Unpin,
        written: &mut u64,
    ) -> Result<FileWritten, SessionError> {
        let rel = parse_path(path)?;
        let (workspace, uid) = self.files_of(session_id)?;
        let cap = self.inner.cfg.limits.max_request_bytes as u64;
        let limit = crate::disk_guard::DiskLimit::from_limits(&self.inner.cfg.limits);
        let (rel, mut temp, file) = {
            let ws = workspace.clone();
            blocking(move || begin_write(&ws, uid, &rel).map(|(t, f)| (rel, t, f))).await?
        };
        let mut file = tokio::fs::File::from_std(file);
        let mut hash = Sha256::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = body
                .read(&mut buf)
                .await
                .map_err(|e| invalid(format!("cannot read the body: {e}")))?;
            if n == 0 {
                break;
            }
            let chunk = &buf[..n];
            *written += n as u64;
            if *written > cap {
                return Err(SessionError::Invalid(ValidationError::new(
                    "body",
                    format!("the file is over the bound of {cap} bytes"),
                )));
            }
            hash.update(chunk);
            file.write_all(chunk)
                .await
                .map_err(|e| match e.raw_os_error() {
                    Some(libc::ENOSPC) | Some(libc::EDQUOT) => invalid(format!(
                        "writing {path} would pass the session's disk limit"
                    )),
                    _ => SessionError::Internal(format!("cannot write {path}: {e}")),
                })?;
        }
        file.sync_data().await.map_err(|e| match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => invalid(format!(
                "writing {path} would pass the session's disk limit"
            )),
            _ => SessionError::Internal(format!("cannot write {path}: {e}")),
        })?;
        drop(file);
        let shown = rel.shown.clone();
        blocking(move || {
            if let Err(b) = crate::disk_guard::check(&[workspace], limit) {
                return Err(invalid(format!(
                    "writing {} would pass the session's disk limit: {b}",
                    rel.shown
                )));
            }
            finish_write(&mut temp, &rel)
        })
        .await?;
        Ok(FileWritten {
            version: API_VERSION,
            session_id: session_id.to_string(),
            path: shown,
            bytes: *written,
            sha256: hex::encode(hash.finalize()),
        })
    }
}

/// Runs `f` on the blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, SessionError> + Send + 'static,
) -> Result<T, SessionError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| SessionError::Internal(format!("files task failed: {e}")))?
}

/// The audit line of one files call.
fn audit<T>(session_id: &str, op: &str, path: &str, bytes: u64, r: &Result<T, SessionError>) {
    match r {
        Ok(_) => tracing::info!(session_id, op, path, bytes, outcome = "ok", "session files"),
        Err(e) => {
            tracing::info!(session_id, op, path, bytes, outcome = "refused", error = %e, "session files")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_checked_before_anything_is_opened() {
        for bad in ["/etc/shadow", "../x", "a/../../x", "a\0b", "/"] {
            assert!(
                matches!(parse_path(bad), Err(SessionError::Invalid(_))),
                "{bad:?} accepted"
            );
        }
        let long = "a/".repeat(MAX_PATH_BYTES);
        assert!(matches!(parse_path(&long), Err(SessionError::Invalid(_))));
        let p = parse_path("a/./b//c").unwrap();
        assert_eq!(
            (p.parents, p.name),
            (PathBuf::from("a/b"), Some("c".into()))
        );
        let p = parse_path("").unwrap();
        assert_eq!((p.parents, p.name), (PathBuf::new(), None));
    }
}
