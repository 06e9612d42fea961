//! Workspace confinement: every path a step touches is resolved beneath the workspace root.
//!
//! Paths are first normalised lexically (relative, or absolute under the root or under the
//! contract's `/workspace`); a `..` that climbs above the root is refused. They are then
//! opened relative to a directory fd of the root with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_MAGICLINKS)`, so the kernel refuses any symlink (final or intermediate, old or
//! created by an earlier step) that leads out, and a swap between check and use cannot
//! escape: there is no check separate from the use. Where the kernel lacks openat2 (or, as
//! gVisor, answers EINVAL to its resolve flags) the walk is done component by component
//! with `O_NOFOLLOW`, refusing every symlink.
//!
//! Files with more than one hard link are refused for reading (a hard link to a file outside
//! cannot be told apart by path); writes always go to a new inode (temp file + rename), so a
//! hard link never lets a write reach outside.

use std::ffi::OsStr;
use std::fs::File;
use std::io::{Read, Write};

use sha2::{Digest, Sha256};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags, ResolveFlags};
use rustix::io::Errno;

use crate::error::{Result, StepError};

/// The contract's name for the workspace root; absolute paths under it map to the real root.
pub const CONTRACT_ROOT: &str = "/workspace";

/// An opened workspace root.
#[derive(Debug)]
pub struct Workspace {
    root: OwnedFd,
    root_path: PathBuf,
    use_openat2: AtomicBool,
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl Workspace {
    /// Opens `path` as the workspace root.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let root_path = std::fs::canonicalize(path)?;
        let root = rustix::fs::open(
            &root_path,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Self {
            root,
            root_path,
            use_openat2: AtomicBool::new(true),
        })
    }

    /// Forces the `O_NOFOLLOW` walk even where openat2 exists (for tests of the fallback).
    pub fn force_walk(&self) {
        self.use_openat2.store(false, Ordering::Relaxed);
    }

    /// The canonical root path.
    pub fn root_path(&self) -> &Path {
        &self.root_path
    }

    /// Normalises a step's path to one relative to the root (empty = the root itself).
    pub fn relative(&self, input: &str) -> Result<PathBuf> {
        if input.as_bytes().contains(&0) {
            return Err(StepError::escape(input, "contains a NUL byte"));
        }
        let path = Path::new(input);
        let rest: &Path = if path.is_absolute() {
            if let Ok(r) = path.strip_prefix(&self.root_path) {
                r
            } else if let Ok(r) = path.strip_prefix(CONTRACT_ROOT) {
                r
            } else {
                return Err(StepError::escape(
                    input,
                    "absolute path outside the workspace",
                ));
            }
        } else {
            path
        };
        let mut out = PathBuf::new();
        for comp in rest.components() {
            match comp {
                Component::Normal(c) => out.push(c),
                Component::CurDir => {}
                Component::ParentDir => {
                    if !out.pop() {
                        return Err(StepError::escape(input, "`..` climbs above the root"));
                    }
                }
                Component::RootDir | Component::Prefix(_) => {
                    return Err(StepError::escape(input, "unexpected root component"));
                }
            }
        }
        Ok(out)
    }

    /// Opens `rel` beneath the root with `flags` (CLOEXEC is added).
    pub fn open_at(&self, rel: &Path, flags: OFlags, mode: Mode) -> Result<OwnedFd> {
        let shown = display(rel);
        let target: &Path = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        };
        if self.use_openat2.load(Ordering::Relaxed) {
            let res = rustix::fs::openat2(
                &self.root,
                target,
                flags | OFlags::CLOEXEC,
                mode,
                ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
            );
            match res {
                Ok(fd) => return Ok(fd),
                Err(Errno::NOSYS) => self.use_openat2.store(false, Ordering::Relaxed),
                // gVisor (runsc) answers EINVAL to these resolve flags: when even the
                // root itself cannot be opened so, the kernel lacks them.
                Err(Errno::INVAL) if !self.openat2_works() => {
                    self.use_openat2.store(false, Ordering::Relaxed)
                }
                Err(e) => return Err(map_errno(e, &shown)),
            }
        }
        self.walk_open(rel, flags, mode)
    }

    /// Whether openat2 with the resolve flags [`Self::open_at`] uses opens the root itself.
    fn openat2_works(&self) -> bool {
        rustix::fs::openat2(
            &self.root,
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
        )
        .is_ok()
    }

    /// The fallback: component by component with O_NOFOLLOW; any symlink is refused.
    fn walk_open(&self, rel: &Path, flags: OFlags, mode: Mode) -> Result<OwnedFd> {
        let shown = display(rel);
        let comps: Vec<&OsStr> = rel.iter().collect();
        let Some((last, dirs)) = comps.split_last() else {
            return rustix::fs::openat(&self.root, ".", flags | OFlags::CLOEXEC, mode)
                .map_err(|e| map_errno(e, &shown));
        };
        let mut cur = rustix::io::dup(&self.root).map_err(|e| map_errno(e, &shown))?;
        for comp in dirs {
            cur = match rustix::fs::openat(
                &cur,
                *comp,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => fd,
                Err(e) => return Err(self.walk_error(&cur, comp, e, &shown)),
            };
        }
        rustix::fs::openat(
            &cur,
            *last,
            flags | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            mode,
        )
        .map_err(|e| self.walk_error(&cur, last, e, &shown))
    }

    fn walk_error(&self, dir: &OwnedFd, comp: &OsStr, e: Errno, shown: &str) -> StepError {
        let is_link = rustix::fs::statat(dir, comp, AtFlags::SYMLINK_NOFOLLOW)
            .map(|st| FileType::from_raw_mode(st.st_mode) == FileType::Symlink)
            .unwrap_or(false);
        if is_link {
            StepError::escape(shown, "symlinks are not followed without openat2")
        } else {
            map_errno(e, shown)
        }
    }

    /// Opens a directory for reading entries.
    pub fn open_dir(&self, rel: &Path) -> Result<OwnedFd> {
        self.open_at(rel, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())
    }

    /// Opens a regular file for reading, refusing hard-linked files.
    pub fn open_read(&self, rel: &Path) -> Result<(File, u64)> {
        let fd = self.open_at(
            rel,
            OFlags::RDONLY | OFlags::NOCTTY | OFlags::NONBLOCK,
            Mode::empty(),
        )?;
        let st = rustix::fs::fstat(&fd).map_err(|e| map_errno(e, &display(rel)))?;
        check_regular(&st, &display(rel))?;
        Ok((File::from(fd), st.st_size as u64))
    }

    /// Lstat of `rel`, `None` when it does not exist.
    pub fn lstat(&self, rel: &Path) -> Result<Option<rustix::fs::Stat>> {
        let (parent, name) = self.parent_of(rel, false)?;
        match rustix::fs::statat(&parent, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(st)),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(map_errno(e, &display(rel))),
        }
    }

    /// The parent directory fd and final name of `rel`, creating parents when asked.
    pub fn parent_of<'p>(&self, rel: &'p Path, create: bool) -> Result<(OwnedFd, &'p OsStr)> {
        let name = rel
            .file_name()
            .ok_or_else(|| StepError::failed("path names the workspace root, not a file"))?;
        let parent = rel.parent().unwrap_or(Path::new(""));
        let fd = if create {
            self.mkdir_all(parent)?
        } else {
            self.open_at(parent, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())?
        };
        Ok((fd, name))
    }

    /// `mkdir -p` beneath the root; every level is re-resolved beneath the root.
    pub fn mkdir_all(&self, rel: &Path) -> Result<OwnedFd> {
        let dir_flags = OFlags::PATH | OFlags::DIRECTORY;
        let mut prefix = PathBuf::new();
        let mut cur = self.open_at(&prefix, dir_flags, Mode::empty())?;
        for comp in rel.iter() {
            prefix.push(comp);
            cur = match self.open_at(&prefix, dir_flags, Mode::empty()) {
                Ok(fd) => fd,
                Err(_) if !exists(&cur, comp) => {
                    match rustix::fs::mkdirat(&cur, comp, Mode::from_raw_mode(0o755)) {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => return Err(map_errno(e, &display(&prefix))),
                    }
                    self.open_at(&prefix, dir_flags, Mode::empty())?
                }
                Err(e) => return Err(e),
            };
        }
        Ok(cur)
    }

    /// Writes everything `src` yields to `rel` atomically (temp file + rename), hashing it on
    /// the way. An existing file is replaced only when `overwrite` is true.
    pub fn write_atomic(
        &self,
        rel: &Path,
        src: &mut dyn Read,
        mode: u32,
        overwrite: bool,
    ) -> Result<Written> {
        let shown = display(rel);
        let (dir, name) = self.parent_of(rel, true)?;
        let refuse = || {
            StepError::policy(format!(
                "refusing to overwrite existing file {shown}: constraints.allow_overwrite is false"
            ))
        };
        let existed = match rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
                return Err(StepError::failed(format!("{shown} is a directory")));
            }
            Ok(_) if !overwrite => return Err(refuse()),
            Ok(_) => true,
            Err(Errno::NOENT) => false,
            Err(e) => return Err(map_errno(e, &shown)),
        };
        let tmp = format!(
            ".{}.cynode-tmp-{}-{}",
            name.to_string_lossy(),
            std::process::id(),
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let fd = rustix::fs::openat(
            &dir,
            tmp.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| map_errno(e, &shown))?;
        let mut file = File::from(fd);
        let copied = copy_hashing(src, &mut file).and_then(|(size, sha)| {
            rustix::fs::fchmod(&file, Mode::from_raw_mode(mode))?;
            Ok((size, sha))
        });
        let (size_bytes, sha256) = match copied {
            Ok(v) => v,
            Err(e) => {
                let _ = rustix::fs::unlinkat(&dir, tmp.as_str(), AtFlags::empty());
                return Err(StepError::io("write", &shown, &e));
            }
        };
        drop(file);
        let flags = if overwrite {
            RenameFlags::empty()
        } else {
            RenameFlags::NOREPLACE
        };
        if let Err(e) = rename_into_place(&dir, tmp.as_str(), name, flags) {
            let _ = rustix::fs::unlinkat(&dir, tmp.as_str(), AtFlags::empty());
            return Err(if e == Errno::EXIST {
                refuse()
            } else {
                map_errno(e, &shown)
            });
        }
        Ok(Written {
            created: !existed,
            size_bytes,
            sha256,
        })
    }

    /// Removes the file (not directory) `rel`.
    pub fn remove_file(&self, rel: &Path) -> Result<()> {
        let (dir, name) = self.parent_of(rel, false)?;
        rustix::fs::unlinkat(&dir, name, AtFlags::empty()).map_err(|e| map_errno(e, &display(rel)))
    }

    /// Sets permission bits on an existing regular file.
    pub fn chmod(&self, rel: &Path, mode: u32) -> Result<()> {
        let fd = self.open_at(rel, OFlags::RDONLY | OFlags::NONBLOCK, Mode::empty())?;
        let st = rustix::fs::fstat(&fd).map_err(|e| map_errno(e, &display(rel)))?;
        check_regular(&st, &display(rel))?;
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode)).map_err(|e| map_errno(e, &display(rel)))
    }

    /// Fails unless `rel` lies under one of `allowed` (each normalised like a step path).
    pub fn check_allowed(&self, rel: &Path, allowed: Option<&[String]>) -> Result<()> {
        let Some(allowed) = allowed else {
            return Ok(());
        };
        for entry in allowed {
            if let Ok(prefix) = self.relative(entry) {
                if rel.starts_with(&prefix) {
                    return Ok(());
                }
            }
        }
        Err(StepError::policy(format!(
            "path {} is outside constraints.allowed_paths",
            display(rel)
        )))
    }
}

fn exists(dir: &OwnedFd, name: &OsStr) -> bool {
    rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).is_ok()
}

/// Refuses anything but a regular file with a single link.
pub fn check_regular(st: &rustix::fs::Stat, shown: &str) -> Result<()> {
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(StepError::failed(format!("{shown} is not a regular file")));
    }
    if st.st_nlink > 1 {
        return Err(StepError::escape(shown, "file has several hard links"));
    }
    Ok(())
}

/// Renames `tmp` to `name` in `dir`. Where `RENAME_NOREPLACE` is answered EINVAL (gVisor's
/// file systems), a hard link gives the same no-replace guarantee (EEXIST when `name`
/// exists), and the temporary name is then removed.
fn rename_into_place(
    dir: &OwnedFd,
    tmp: &str,
    name: &OsStr,
    flags: RenameFlags,
) -> rustix::io::Result<()> {
    match rustix::fs::renameat_with(dir, tmp, dir, name, flags) {
        Err(Errno::INVAL) if flags == RenameFlags::NOREPLACE => {
            rustix::fs::linkat(dir, tmp, dir, name, AtFlags::empty())?;
            rustix::fs::unlinkat(dir, tmp, AtFlags::empty())
        }
        other => other,
    }
}

/// Maps a resolution errno: EXDEV/ELOOP from RESOLVE_BENEATH mean an escape attempt.
pub fn map_errno(e: Errno, shown: &str) -> StepError {
    match e {
        Errno::XDEV => StepError::escape(shown, "resolves outside the root"),
        Errno::LOOP => StepError::escape(shown, "symlink loop or magic link"),
        other => StepError::io("access", shown, &std::io::Error::from(other)),
    }
}

/// A relative path for messages; the root shows as `.`.
pub fn display(rel: &Path) -> String {
    if rel.as_os_str().is_empty() {
        ".".into()
    } else {
        String::from_utf8_lossy(rel.as_os_str().as_bytes()).into_owned()
    }
}

/// What [`Workspace::write_atomic`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub created: bool,
    pub size_bytes: u64,
    pub sha256: String,
}

/// Copies `src` to `dst`, returning the byte count and the hex sha256 of what was copied.
pub fn copy_hashing(src: &mut dyn Read, dst: &mut dyn Write) -> std::io::Result<(u64, String)> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        dst.write_all(&buf[..n])?;
        total += n as u64;
    }
    Ok((total, hex::encode(hasher.finalize())))
}

/// The hex sha256 and size of everything `src` yields.
pub fn hash_reader(src: &mut dyn Read) -> std::io::Result<(u64, String)> {
    copy_hashing(src, &mut std::io::sink())
}

/// Reads a whole file through an fd, at most `limit` bytes.
pub fn read_all(file: &mut File, limit: u64) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    file.take(limit).read_to_end(&mut buf)?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn ws() -> (tempfile::TempDir, Workspace) {
        let dir = tempfile::tempdir().unwrap();
        let ws = Workspace::open(dir.path()).unwrap();
        (dir, ws)
    }

    /// `e` is the refusal of a path that leads out of the workspace; `what` names the case.
    fn assert_escape(e: &crate::error::StepError, what: &str) {
        assert!(
            e.message.starts_with("path escapes workspace"),
            "{what}: {e}"
        );
    }

    #[test]
    fn relative_paths_normalise() {
        let (dir, ws) = ws();
        assert_eq!(ws.relative("a/./b").unwrap(), PathBuf::from("a/b"));
        assert_eq!(ws.relative("a/../b").unwrap(), PathBuf::from("b"));
        assert_eq!(ws.relative("/workspace/x").unwrap(), PathBuf::from("x"));
        let abs = dir.path().canonicalize().unwrap().join("y");
        assert_eq!(
            ws.relative(abs.to_str().unwrap()).unwrap(),
            PathBuf::from("y")
        );
        assert_eq!(ws.relative(".").unwrap(), PathBuf::new());
    }

    #[test]
    fn lexical_escapes_are_refused() {
        let (_d, ws) = ws();
        for bad in ["..", "../x", "a/../../x", "/etc/passwd", "/workspacefoo/x"] {
            let e = ws.relative(bad).unwrap_err();
            assert_eq!(
                e.code,
                cynode_protocol::FailureCode::PolicyViolation,
                "{bad}"
            );
            assert_escape(&e, bad);
        }
    }

    #[test]
    fn symlink_out_is_refused_in_both_modes() {
        let (dir, ws) = ws();
        symlink("/etc", dir.path().join("etc")).unwrap();
        symlink("../../..", dir.path().join("up")).unwrap();
        for walk in [false, true] {
            if walk {
                ws.force_walk();
            }
            for p in ["etc/passwd", "up/etc/passwd"] {
                let e = ws.open_read(Path::new(p)).unwrap_err();
                assert_escape(&e, &format!("{walk} {p}"));
            }
        }
    }

    #[test]
    fn symlink_inside_is_followed_with_openat2() {
        let (dir, ws) = ws();
        std::fs::write(dir.path().join("real.txt"), "hi").unwrap();
        symlink("real.txt", dir.path().join("link.txt")).unwrap();
        let (mut f, size) = ws.open_read(Path::new("link.txt")).unwrap();
        assert_eq!(size, 2);
        assert_eq!(read_all(&mut f, 10).unwrap(), b"hi");
    }

    #[test]
    fn hard_links_are_refused_for_reading() {
        let (dir, ws) = ws();
        std::fs::write(dir.path().join("a"), "x").unwrap();
        std::fs::hard_link(dir.path().join("a"), dir.path().join("b")).unwrap();
        let e = ws.open_read(Path::new("b")).unwrap_err();
        assert_eq!(
            e.message,
            "path escapes workspace: b (file has several hard links)"
        );
    }

    #[test]
    fn write_atomic_creates_parents_and_respects_overwrite() {
        let (dir, ws) = ws();
        let w = ws
            .write_atomic(Path::new("d/e/f.txt"), &mut &b"one"[..], 0o644, false)
            .unwrap();
        assert_eq!(
            w,
            Written {
                created: true,
                size_bytes: 3,
                sha256: "7692c3ad3540bb803c020b3aee66cd8887123234ea0c6e7143c0add73ff431ed".into()
            }
        );
        assert_eq!(std::fs::read(dir.path().join("d/e/f.txt")).unwrap(), b"one");
        let e = ws
            .write_atomic(Path::new("d/e/f.txt"), &mut &b"two"[..], 0o644, false)
            .unwrap_err();
        assert_eq!(e.code, cynode_protocol::FailureCode::PolicyViolation);
        let w = ws
            .write_atomic(Path::new("d/e/f.txt"), &mut &b"two"[..], 0o644, true)
            .unwrap();
        assert!(!w.created);
        assert_eq!(std::fs::read(dir.path().join("d/e/f.txt")).unwrap(), b"two");
        let leftovers: Vec<_> = std::fs::read_dir(dir.path().join("d/e")).unwrap().collect();
        assert_eq!(leftovers.len(), 1);
    }

    #[test]
    fn mkdir_through_outward_symlink_is_refused() {
        let (dir, ws) = ws();
        let outside = tempfile::tempdir().unwrap();
        symlink(outside.path(), dir.path().join("out")).unwrap();
        let e = ws
            .write_atomic(Path::new("out/x/y.txt"), &mut &b"z"[..], 0o644, false)
            .unwrap_err();
        assert_escape(&e, "mkdir through a link");
        assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
    }

    #[test]
    fn allowed_paths_are_prefix_checked() {
        let (_d, ws) = ws();
        let allowed = vec!["/workspace/src".to_string()];
        ws.check_allowed(Path::new("src/a.rs"), Some(&allowed))
            .unwrap();
        assert!(ws
            .check_allowed(Path::new("srcx/a.rs"), Some(&allowed))
            .is_err());
        ws.check_allowed(Path::new("anything"), None).unwrap();
    }
}
