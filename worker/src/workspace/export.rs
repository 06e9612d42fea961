//! Tar export of a workspace with lstat semantics: the tree is walked through directory
//! fds with no-follow resolution, symlinks are exported as symlinks (never followed),
//! only regular files are read (opened `O_NOFOLLOW | O_NONBLOCK` and checked with fstat),
//! and the export is bounded in entries, bytes and time.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rustix::fs::FileType;

use super::beneath;

/// A running export as an `AsyncRead`: the tar is written on a blocking thread, and a
/// failure midway turns the stream's clean end into an error, so a broken export ends
/// the HTTP body with an error instead of a short, valid-looking tar.
pub struct TarStream {
    inner: tokio::io::DuplexStream,
    failed: Arc<AtomicBool>,
}

impl TarStream {
    /// Starts exporting `dir` within `limits`.
    pub fn start(dir: PathBuf, limits: ExportLimits) -> Self {
        let (reader, writer) = tokio::io::duplex(256 * 1024);
        let failed = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&failed);
        tokio::task::spawn_blocking(move || {
            let bridge = tokio_util::io::SyncIoBridge::new(writer);
            if let Err(e) = export(&dir, bridge, limits) {
                flag.store(true, Ordering::SeqCst);
                tracing::warn!(error = %e, "workspace tar export failed midway");
            }
        });
        TarStream {
            inner: reader,
            failed,
        }
    }
}

impl tokio::io::AsyncRead for TarStream {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if let std::task::Poll::Ready(Ok(())) = &r {
            if buf.filled().len() == before && self.failed.load(Ordering::SeqCst) {
                return std::task::Poll::Ready(Err(std::io::Error::other(
                    "workspace export failed",
                )));
            }
        }
        r
    }
}

/// How deep an exported tree may nest.
const MAX_DEPTH: usize = 256;

/// Bounds on one export.
#[derive(Debug, Clone, Copy)]
pub struct ExportLimits {
    pub max_entries: u64,
    pub max_bytes: u64,
    pub max_time: Duration,
}

impl Default for ExportLimits {
    fn default() -> Self {
        Self {
            max_entries: 500_000,
            max_bytes: 8 << 30,
            max_time: Duration::from_secs(600),
        }
    }
}

/// Writes the tree at `dir` as a tar to `out`.
pub fn export(dir: &Path, out: impl Write, limits: ExportLimits) -> std::io::Result<()> {
    let deadline = Instant::now() + limits.max_time;
    let mut b = tar::Builder::new(out);
    // Directories are opened when visited, beneath their (shared) parent's fd, so open
    // fds stay bounded by the depth, and the depth is bounded.
    let root = Rc::new(beneath::open_root(dir)?);
    let mut stack: Vec<(Rc<OwnedFd>, Option<OsString>, PathBuf)> =
        vec![(root, None, PathBuf::from("."))];
    let mut entries = 0u64;
    let mut bytes = 0u64;
    let over = |what: String| std::io::Error::other(format!("export over its {what} bound"));
    while let Some((parent, name, rel)) = stack.pop() {
        let dfd = match name {
            None => parent,
            // Left out if it was swapped for a link meanwhile.
            Some(n) => match beneath::open_dir(parent.as_fd(), Path::new(&n)) {
                Ok(fd) => Rc::new(fd),
                Err(_) => continue,
            },
        };
        if rel.components().count() > MAX_DEPTH {
            return Err(over(format!("{MAX_DEPTH} levels depth")));
        }
        let (_, st) = beneath::kind(dfd.as_fd(), std::ffi::OsStr::new("."))?;
        let mut h = header(&st, tar::EntryType::Directory, 0);
        b.append_data(&mut h, &rel, std::io::empty())?;
        let names: Vec<OsString> = beneath::list(dfd.as_fd(), limits.max_entries as usize)?;
        let mut subdirs = Vec::new();
        for name in names {
            entries += 1;
            if entries > limits.max_entries {
                return Err(over(format!("{} entries", limits.max_entries)));
            }
            if Instant::now() > deadline {
                return Err(over(format!("{}s time", limits.max_time.as_secs())));
            }
            let path = rel.join(&name);
            let Ok((ft, st)) = beneath::kind(dfd.as_fd(), &name) else {
                continue; // gone meanwhile
            };
            match ft {
                FileType::Directory => subdirs.push((Rc::clone(&dfd), Some(name), path)),
                FileType::RegularFile => {
                    let Ok((file, size)) = beneath::open_regular(dfd.as_fd(), &name) else {
                        continue; // swapped for something else meanwhile
                    };
                    bytes = bytes.saturating_add(size);
                    if bytes > limits.max_bytes {
                        return Err(over(format!("{} bytes", limits.max_bytes)));
                    }
                    let st = rustix::fs::fstat(&file).map_err(std::io::Error::from)?;
                    let mut h = header(&st, tar::EntryType::Regular, size);
                    // Exactly `size` bytes, whatever the file does meanwhile.
                    let data = Timed {
                        inner: file.take(size).chain(std::io::repeat(0)).take(size),
                        deadline,
                    };
                    b.append_data(&mut h, &path, data)?;
                }
                FileType::Symlink => {
                    let Ok(target) = beneath::read_link(dfd.as_fd(), &name) else {
                        continue;
                    };
                    let mut h = header(&st, tar::EntryType::Symlink, 0);
                    b.append_link(&mut h, &path, &target)?;
                }
                _ => {} // devices, FIFOs, sockets: not exported
            }
        }
        subdirs.reverse();
        stack.extend(subdirs);
    }
    b.into_inner()?.flush()
}

fn header(st: &rustix::fs::Stat, kind: tar::EntryType, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(st.st_mode & 0o7777 & !0o7000);
    h.set_uid(u64::from(st.st_uid));
    h.set_gid(u64::from(st.st_gid));
    h.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
    h
}

/// A reader that fails once its deadline has passed.
struct Timed<R> {
    inner: R,
    deadline: Instant,
}

impl<R: Read> Read for Timed<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if Instant::now() > self.deadline {
            return Err(std::io::Error::other("export over its time bound"));
        }
        self.inner.read(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_exported_as_links_and_bounds_hold() {
        let t = tempfile::tempdir().unwrap();
        let ws = t.path().join("ws");
        std::fs::create_dir_all(ws.join("d")).unwrap();
        std::fs::write(ws.join("d/a.txt"), "aaa").unwrap();
        std::os::unix::fs::symlink("/etc/shadow", ws.join("shadow")).unwrap();
        std::os::unix::fs::symlink("/", ws.join("root")).unwrap();
        let mut out = Vec::new();
        export(&ws, &mut out, ExportLimits::default()).unwrap();
        let mut seen = Vec::new();
        for e in tar::Archive::new(&out[..]).entries().unwrap() {
            let e = e.unwrap();
            let p = e.path().unwrap().display().to_string();
            let link = e.link_name().unwrap().map(|l| l.display().to_string());
            seen.push((p, e.header().entry_type(), link, e.header().size().unwrap()));
        }
        assert!(
            seen.contains(&(
                "shadow".into(),
                tar::EntryType::Symlink,
                Some("/etc/shadow".into()),
                0
            )),
            "{seen:?}"
        );
        assert!(
            seen.contains(&("d/a.txt".into(), tar::EntryType::Regular, None, 3)),
            "{seen:?}"
        );
        assert!(!seen.iter().any(|s| s.0.starts_with("root/")), "{seen:?}");
        let tight = ExportLimits {
            max_bytes: 2,
            ..ExportLimits::default()
        };
        let e = export(&ws, std::io::sink(), tight).unwrap_err();
        assert!(e.to_string().contains("bytes bound"), "{e}");
        let few = ExportLimits {
            max_entries: 1,
            ..ExportLimits::default()
        };
        assert!(export(&ws, std::io::sink(), few).is_err());
    }
}
