//! A job's disk limit (`limits.disk_mb`, `limits.disk_max_files`): while the sandbox runs,
//! a thread walks the job's /workspace and /job every [`INTERVAL`] (links never followed,
//! the walk bounded in entries), sums the blocks allocated, and on a breach cancels the
//! sandbox; once more after the sandbox ended. The job then fails `resource_limit_exceeded`.
//!
//! The overshoot is bounded by what the job writes between a breach and its sandbox's end:
//! its write rate times [`INTERVAL`] (longer when a walk itself takes long: the pause is at
//! least twice the last walk) plus the backend's stop latency (bwrap: a cgroup kill;
//! podman: `podman rm --force`, up to a second or more on a loaded host). Measured with
//! `dd` into /workspace and a 64 MiB limit: ~75 MiB on bwrap, ~100 MiB on podman idle,
//! ~540 MiB on podman under heavy load. Sparse files count what they allocate, and a
//! `fallocate` counts what it reserves (blocks, not sizes).
//!
//! The walk goes by directory fds (`disk_usage`), so a tree past PATH_MAX is measured. The
//! guard fails closed: a walk that fails (a directory moved under it, a walk over its time
//! bound) is a breach ([`Breach::Unmeasured`]). On a breach, once the sandbox ended,
//! [`DiskGuard::finish`] empties the guarded directories, so the space comes back at once.
//! Session commands run under the same guard (over the workspace); a breach ends the
//! session. A file the job unlinks while keeping it open is not seen by a walk: each check
//! also adds what the sandbox's processes (those running as the guarded directories'
//! owner, the workspace's own uid, [`crate::uid_pool`]) hold open or mapped of files with
//! no link left on the guarded devices ([`crate::open_unlinked`], bounded; a scan that
//! fails is a breach). Residual: a descriptor in flight in a unix socket belongs to no
//! process and is not seen; its space is freed when the sandbox ends.

use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::config::Limits;
use crate::disk_usage::{self, Bounds, Unmeasured, Usage};
use crate::open_unlinked;
use crate::sandbox_files;

/// Pause between two checks.
pub const INTERVAL: Duration = Duration::from_millis(200);
/// How often a walk that met a moved directory starts again before that is a breach.
const MOVED_RETRIES: u32 = 8;
/// A walk slower than this is given up, and counts as a breach.
const WALK_BOUND: Duration = Duration::from_secs(30);
/// Descriptors and mappings of the sandbox's processes one check looks at; more is a
/// breach (a job's pids limit times its descriptor limit stays far below).
const OPEN_ENTRIES_BOUND: u64 = 262_144;

/// The limit for one job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskLimit {
    pub bytes: u64,
    pub max_files: u64,
}

impl DiskLimit {
    /// From the node's limits.
    pub fn from_limits(l: &Limits) -> Self {
        DiskLimit {
            bytes: l.disk_mb.saturating_mul(1024 * 1024),
            max_files: l.disk_max_files,
        }
    }
}

/// A job over its disk limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Breach {
    #[error("resource_limit_exceeded: /workspace and /job use more than {limit} bytes, the disk limit (limits.disk_mb); the sandbox was stopped")]
    Bytes { limit: u64 },
    #[error("resource_limit_exceeded: /workspace and /job hold more than {0} files and directories (limits.disk_max_files); the sandbox was stopped")]
    Files(u64),
    /// The walk failed (a path past PATH_MAX, a walk over its time bound…): what cannot
    /// be measured counts as over the limit.
    #[error("resource_limit_exceeded: the disk use of /workspace and /job could not be measured ({0}), so it counts as over the disk limit (limits.disk_mb); the sandbox was stopped")]
    Unmeasured(String),
}

/// Checks `dirs` once against `limit`. A missing directory counts as empty; one that
/// cannot be walked (a walk error, a walk over its time bound) is a breach: a guard that
/// fails open is no limit.
pub fn check(dirs: &[PathBuf], limit: DiskLimit) -> Result<(), Breach> {
    let mut used = Usage::default();
    let deadline = Instant::now() + WALK_BOUND;
    // Whose processes may hold unlinked files, on which devices: the directories' owners
    // (a workspace's uid runs its sandboxes and nothing else) and devices.
    let (mut owners, mut devs) = (Vec::new(), Vec::new());
    let node_uid = rustix::process::geteuid().as_raw();
    for d in dirs {
        let Ok(fd) = sandbox_files::open_dir(d) else {
            continue;
        };
        if let Ok(st) = rustix::fs::fstat(&fd) {
            if st.st_uid != 0 && st.st_uid != node_uid && !owners.contains(&st.st_uid) {
                owners.push(st.st_uid);
            }
            if !devs.contains(&st.st_dev) {
                devs.push(st.st_dev);
            }
        }
        let bounds = Bounds {
            max_entries: limit.max_files.saturating_sub(used.entries),
            max_bytes: limit.bytes.saturating_sub(used.bytes),
            deadline,
        };
        // A directory moved under the walk (a build renaming its output) restarts it; one
        // that keeps moving is a breach, so moving trees cannot hide what they hold.
        let mut res = disk_usage::measure(fd, bounds);
        for _ in 0..MOVED_RETRIES {
            if res != Err(Unmeasured::Moved) {
                break;
            }
            let Ok(fd) = sandbox_files::open_dir(d) else {
                res = Ok(Usage::default());
                break;
            };
            res = disk_usage::measure(fd, bounds);
        }
        match res {
            Ok(u) => {
                used.entries += u.entries;
                used.bytes += u.bytes;
            }
            Err(Unmeasured::TooManyBytes(_)) => return Err(Breach::Bytes { limit: limit.bytes }),
            Err(Unmeasured::TooManyEntries(_)) => return Err(Breach::Files(limit.max_files)),
            Err(e) => {
                tracing::warn!(dir = %d.display(), error = %e, "disk usage walk failed: a breach");
                return Err(Breach::Unmeasured(e.to_string()));
            }
        }
    }
    let scan = open_unlinked::Bounds {
        max_entries: OPEN_ENTRIES_BOUND,
        deadline,
    };
    match open_unlinked::unlinked_bytes(&owners, &devs, scan) {
        Ok(b) if used.bytes.saturating_add(b) > limit.bytes => {
            Err(Breach::Bytes { limit: limit.bytes })
        }
        Ok(_) => Ok(()),
        Err(e) => {
            tracing::warn!(error = %e, "open-file scan failed: a breach");
            Err(Breach::Unmeasured(e.to_string()))
        }
    }
}

/// A running guard; [`DiskGuard::finish`] ends it.
#[derive(Debug)]
pub struct DiskGuard {
    stop: Option<mpsc::Sender<()>>,
    breach: Arc<Mutex<Option<Breach>>>,
    dirs: Vec<PathBuf>,
    limit: DiskLimit,
}

impl DiskGuard {
    /// Starts checking `dirs`; a breach cancels `trip`.
    pub fn start(dirs: Vec<PathBuf>, limit: DiskLimit, trip: CancellationToken) -> DiskGuard {
        let (tx, rx) = mpsc::channel::<()>();
        let breach = Arc::new(Mutex::new(None));
        let (b, d) = (Arc::clone(&breach), dirs.clone());
        let spawned = std::thread::Builder::new()
            .name("disk-guard".into())
            .spawn(move || loop {
                let t = Instant::now();
                if let Err(e) = check(&d, limit) {
                    if let Ok(mut g) = b.lock() {
                        *g = Some(e);
                    }
                    trip.cancel();
                    return;
                }
                let pause = INTERVAL.max(t.elapsed() * 2);
                match rx.recv_timeout(pause) {
                    Err(mpsc::RecvTimeoutError::Timeout) => continue,
                    _ => return,
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the disk guard; the disk limit is checked only after the job");
        }
        DiskGuard {
            stop: Some(tx),
            breach,
            dirs,
            limit,
        }
    }

    /// Stops the guard and checks once more: the breach, if any. On a breach the
    /// contents of the guarded directories are removed (links never followed), so the
    /// space is returned at once; call this after the sandbox has ended.
    pub async fn finish(mut self) -> Option<Breach> {
        self.stop.take();
        let (dirs, limit) = (std::mem::take(&mut self.dirs), self.limit);
        let tripped = self.breach.lock().ok().and_then(|g| g.clone());
        let res = tokio::task::spawn_blocking(move || {
            let breach = tripped.or_else(|| check(&dirs, limit).err());
            if breach.is_some() {
                for d in &dirs {
                    if let Err(e) = purge(d) {
                        tracing::warn!(dir = %d.display(), error = %e, "cannot empty a directory over the disk limit");
                    }
                }
            }
            breach
        })
        .await;
        match res {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "final disk check failed");
                Some(Breach::Unmeasured(e.to_string()))
            }
        }
    }
}

/// Removes everything inside `dir` (the node's own directory), keeping `dir`. Each entry
/// goes by [`crate::remove_tree::remove_beneath`] on `dir`'s fd: no link is followed and
/// no recursion happens, so a tree of any depth cannot overflow the stack.
pub fn purge(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let fd = match crate::fd_walk::open_node_dir(dir) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let mut names = Vec::new();
    for e in rustix::fs::Dir::read_from(&fd)? {
        let name = e?.file_name().to_bytes().to_vec();
        if name != b"." && name != b".." {
            names.push(name);
        }
    }
    for name in names {
        crate::remove_tree::remove_beneath(fd.as_fd(), std::ffi::OsStr::from_bytes(&name))
            .map_err(std::io::Error::other)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_allocated_bytes_and_entries_not_sparse_sizes() {
        let d = tempfile::tempdir().unwrap();
        let f = std::fs::File::create(d.path().join("sparse")).unwrap();
        f.set_len(1 << 40).unwrap();
        let dirs = vec![d.path().to_path_buf()];
        let lim = DiskLimit {
            bytes: 1 << 20,
            max_files: 10,
        };
        assert_eq!(check(&dirs, lim), Ok(()));
        std::fs::write(d.path().join("real"), vec![1u8; 2 << 20]).unwrap();
        assert_eq!(check(&dirs, lim), Err(Breach::Bytes { limit: 1 << 20 }));
        let lim = DiskLimit {
            bytes: 1 << 30,
            max_files: 2,
        };
        std::fs::create_dir(d.path().join("sub")).unwrap();
        assert_eq!(check(&dirs, lim), Err(Breach::Files(2)));
        // A link to a big tree outside is not followed.
        let d2 = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/usr", d2.path().join("usr")).unwrap();
        let lim = DiskLimit {
            bytes: 1 << 20,
            max_files: 10,
        };
        assert_eq!(check(&[d2.path().to_path_buf()], lim), Ok(()));
    }

    /// A tree deeper than PATH_MAX is measured (the walk goes by directory fds), so what it
    /// holds counts: over the entry limit it is a breach, under it none.
    #[test]
    fn a_tree_deeper_than_path_max_is_measured() {
        use rustix::fs::{mkdirat, openat, Mode, OFlags};
        let d = tempfile::tempdir().unwrap();
        let name = "d".repeat(200);
        let mut fd = sandbox_files::open_dir(d.path()).unwrap();
        for _ in 0..30 {
            mkdirat(&fd, name.as_str(), Mode::from_raw_mode(0o755)).unwrap();
            fd = openat(
                &fd,
                name.as_str(),
                OFlags::DIRECTORY | OFlags::RDONLY,
                Mode::empty(),
            )
            .unwrap();
        }
        let lim = |max_files| DiskLimit {
            bytes: 1 << 30,
            max_files,
        };
        assert_eq!(check(&[d.path().to_path_buf()], lim(1000)), Ok(()));
        assert_eq!(
            check(&[d.path().to_path_buf()], lim(20)),
            Err(Breach::Files(20))
        );
        crate::remove_tree::remove_tree(&d.path().join(&name)).unwrap();
    }

    #[tokio::test]
    async fn a_breach_while_running_cancels() {
        let d = tempfile::tempdir().unwrap();
        let trip = CancellationToken::new();
        let lim = DiskLimit {
            bytes: 1 << 20,
            max_files: 100,
        };
        let g = DiskGuard::start(vec![d.path().to_path_buf()], lim, trip.clone());
        std::fs::write(d.path().join("real"), vec![1u8; 2 << 20]).unwrap();
        tokio::time::timeout(Duration::from_secs(30), trip.cancelled())
            .await
            .expect("the guard never tripped");
        assert_eq!(g.finish().await, Some(Breach::Bytes { limit: 1 << 20 }));
        // The data is gone, the directory stays.
        assert!(d.path().is_dir());
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }
}
