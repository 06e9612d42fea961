//! Which guard holds a job's disk limit. When every guarded directory is a volume
//! ([`crate::loopfs`]), the kernel holds it (ENOSPC at the volume's size, inodes from
//! `limits.disk_max_files`) and the guard only reads `statfs` every [`INTERVAL`]: a
//! volume found full (or out of inodes), or the volumes together over `limits.disk_mb`,
//! or a volume whose image's allocation (its high-water mark: no `discard`) reached its
//! size during the job (so it filled, if only for a moment, as a file unlinked and held
//! open does until its writer exits), is a breach that stops the sandbox and fails the job `resource_limit_exceeded`, once
//! more after the sandbox ended; the guarded directories are then emptied, as the
//! poller does. Otherwise the poller ([`crate::disk_guard`]) walks the directories.

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::disk_guard::{self, Breach, DiskGuard, DiskLimit};
use crate::loopfs;

/// Pause between two `statfs` reads.
pub const INTERVAL: Duration = Duration::from_millis(20);
/// A volume with less than this free counts as full (ext4 refuses a write a few blocks
/// before the last one).
const FULL_SLACK_MIN: u64 = 1024 * 1024;

/// A running guard; [`Guard::finish`] ends it.
#[derive(Debug)]
pub enum Guard {
    /// The kernel holds the limit; `statfs` tells whether it was reached.
    Volumes(VolumeGuard),
    /// The disk poller.
    Walk(DiskGuard),
}

/// Starts the guard for `dirs`: over volumes when they all are, the poller otherwise.
/// A breach cancels `trip`.
pub fn start(dirs: Vec<PathBuf>, limit: DiskLimit, trip: CancellationToken) -> Guard {
    if !dirs.is_empty() && dirs.iter().all(|d| loopfs::is_volume(d)) {
        let fds: Vec<OwnedFd> = dirs
            .iter()
            .filter_map(|d| crate::sandbox_files::open_dir(d).ok())
            .collect();
        if fds.len() == dirs.len() {
            let marks = dirs.iter().map(|d| HighWater::of(d)).collect();
            return Guard::Volumes(VolumeGuard::start(dirs, fds, marks, limit, trip));
        }
    }
    Guard::Walk(DiskGuard::start(dirs, limit, trip))
}

impl Guard {
    /// Stops the guard and checks once more: the breach, if any (call it after the
    /// sandbox ended; on a breach the guarded directories are emptied).
    pub async fn finish(self) -> Option<Breach> {
        match self {
            Guard::Volumes(g) => g.finish().await,
            Guard::Walk(g) => g.finish().await,
        }
    }

    /// Whether the kernel holds the limit.
    pub fn is_kernel(&self) -> bool {
        matches!(self, Guard::Volumes(_))
    }
}

/// A volume's image and the allocation at which the job has taken all the room the
/// volume had when it started: the image grows only as blocks never used before are
/// written (no `discard`), so growing by the free space means the volume filled, if only
/// for a moment. On a volume whose freed blocks get reused (a workspace used before) the
/// image grows less than what was written, so this signal can only come late or not at
/// all, never early; the `statfs` reads remain.
#[derive(Debug)]
pub struct HighWater {
    image: OwnedFd,
    full_at: u64,
}

impl HighWater {
    fn of(dir: &std::path::Path) -> Option<HighWater> {
        let image = loopfs::image_of(dir)?;
        let s = rustix::fs::statfs(dir).ok()?;
        let bsize = u64::try_from(s.f_bsize).ok()?;
        let total = s.f_blocks.saturating_mul(bsize);
        let avail = s.f_bavail.saturating_mul(bsize);
        let full_at = allocated(&image)
            .saturating_add(avail)
            .saturating_sub(slack(total));
        Some(HighWater { image, full_at })
    }

    /// Whether the image grew by the volume's free space since the job started.
    fn filled(&self) -> bool {
        allocated(&self.image) >= self.full_at
    }
}

fn allocated(fd: &OwnedFd) -> u64 {
    rustix::fs::fstat(fd)
        .ok()
        .and_then(|s| u64::try_from(s.st_blocks).ok())
        .map_or(0, |b| b.saturating_mul(512))
}

/// What counts as full on a volume of `total` bytes.
fn slack(total: u64) -> u64 {
    FULL_SLACK_MIN.max(total / 200)
}

/// The `statfs` reader over volumes.
#[derive(Debug)]
pub struct VolumeGuard {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Option<Breach>>,
    dirs: Vec<PathBuf>,
    fds: std::sync::Arc<(Vec<OwnedFd>, Vec<Option<HighWater>>)>,
    limit: DiskLimit,
}

/// The volumes' state against `limit`: a breach when one is full or out of inodes, or
/// all of them together hold more than the limit.
pub fn check_volumes(
    fds: &[OwnedFd],
    marks: &[Option<HighWater>],
    limit: DiskLimit,
) -> Result<(), Breach> {
    if marks.iter().flatten().any(HighWater::filled) {
        return Err(Breach::Bytes { limit: limit.bytes });
    }
    let mut used = 0u64;
    for fd in fds {
        let s = match rustix::fs::fstatfs(fd) {
            Ok(s) => s,
            Err(e) => return Err(Breach::Unmeasured(format!("statfs: {e}"))),
        };
        let bsize = u64::try_from(s.f_bsize).unwrap_or(4096);
        let total = s.f_blocks.saturating_mul(bsize);
        let avail = s.f_bavail.saturating_mul(bsize);
        if avail < slack(total) {
            return Err(Breach::Bytes { limit: limit.bytes });
        }
        if s.f_ffree == 0 {
            return Err(Breach::Files(limit.max_files));
        }
        used = used.saturating_add(s.f_blocks.saturating_sub(s.f_bfree).saturating_mul(bsize));
    }
    if used > limit.bytes {
        return Err(Breach::Bytes { limit: limit.bytes });
    }
    Ok(())
}

impl VolumeGuard {
    fn start(
        dirs: Vec<PathBuf>,
        fds: Vec<OwnedFd>,
        marks: Vec<Option<HighWater>>,
        limit: DiskLimit,
        trip: CancellationToken,
    ) -> VolumeGuard {
        let fds = std::sync::Arc::new((fds, marks));
        let stop = CancellationToken::new();
        let (f, s) = (std::sync::Arc::clone(&fds), stop.clone());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = s.cancelled() => return None,
                    _ = tick.tick() => {}
                }
                if let Err(b) = check_volumes(&f.0, &f.1, limit) {
                    trip.cancel();
                    return Some(b);
                }
            }
        });
        VolumeGuard {
            stop,
            task,
            dirs,
            fds,
            limit,
        }
    }

    async fn finish(self) -> Option<Breach> {
        self.stop.cancel();
        let tripped = self.task.await.ok().flatten();
        let breach = tripped.or_else(|| check_volumes(&self.fds.0, &self.fds.1, self.limit).err());
        breach.as_ref()?;
        let dirs = self.dirs;
        drop(self.fds);
        let purged = tokio::task::spawn_blocking(move || {
            for d in &dirs {
                if let Err(e) = disk_guard::purge(d) {
                    tracing::warn!(dir = %d.display(), error = %e, "cannot empty a volume over the disk limit");
                }
            }
        })
        .await;
        if let Err(e) = purged {
            tracing::warn!(error = %e, "emptying volumes over the disk limit failed");
        }
        breach
    }
}
