//! Disk limits the kernel enforces: each job directory and each new workspace is its own
//! ext4 filesystem on a loop device, of the node's `limits.disk_mb` (at most 1.05 × it,
//! the inode table included) with `limits.disk_max_files` inodes, mounted `nosuid,nodev`
//! on the directory before the sandbox starts. A job that writes past it gets ENOSPC from
//! the kernel, however fast it writes, through whatever kind of file (sparse, fallocated,
//! unlinked and held open, a flood of small ones).
//!
//! - Images are made only by the node, in `<state>/volumes/`, which no sandbox mounts:
//!   created with `O_EXCL`, formatted (`image`), bound to a loop device and mounted
//!   detached (`fsmount`). A bounded pool of such detached mounts is kept ready by a
//!   background thread, so a job start only moves one onto its directory (`move_mount`).
//! - The image is renamed after its directory (`job-<job_id>.img`, `ws-<workspace>.img`),
//!   so a node that starts after a reboot mounts it again ([`Volumes::reclaim`]); pool
//!   images and images whose directory is gone are deleted then, and no other: one that
//!   cannot be mounted again is kept and logged, and its workspace refused
//!   ([`unmounted_image`]) rather than used empty. A volume still held by a loop device
//!   (a sandbox that outlived the node keeps a copy of its mount) is mounted through that
//!   device, never a second one.
//! - Volumes never outlive their node: when it stops (SIGTERM, SIGINT) its pool is
//!   emptied ([`close_pool`]) and, once its sandboxes are gone, its mounts beneath its
//!   state directory are unmounted ([`release_node`], found in mountinfo, detached when
//!   still in use), so the loop devices let go of the images; after a kill, its janitor
//!   does the same. The images keep the content: the next start mounts them again.
//! - [`release_beneath`] unmounts (detached) the volumes under a directory about to be
//!   removed and deletes their images; the loop device lets go of the image when its
//!   last mount goes (autoclear). `remove_tree_async` calls it, so `:ack`, the retention
//!   sweep and replay clean-up free them.
//! - The volume's root is the root of its filesystem, so a sandbox's
//!   `/proc/self/mountinfo` shows `/` as the root of `/job` and `/workspace`, not the
//!   state directory's path.
//!
//! Where the node cannot do this (not root, no `/dev/loop-control`, no mke2fs, no ext4),
//! [`init`] says why, [`enforcement`] names the fallback, and the disk poller
//! (`disk_guard`) holds the limit as before.

mod image;
mod loopdev;
pub mod mountinfo;
mod release;
pub mod snapshot;

use std::collections::VecDeque;
use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use rustix::fs::{self as rfs, Mode, OFlags};
use rustix::mount::{self as rmount, MoveMountFlags, UnmountFlags};

pub use image::{MakeError, Shape};
pub use release::{release_node, Released};

/// The loop block devices' major number.
const LOOP_MAJOR: u32 = 7;
/// The volumes directory under the state directory.
pub const VOLUMES_DIR: &str = "volumes";
/// The directory beneath the state directory where bwrap's read-only views of the root
/// filesystems are attached (`backend::bwrap::root_view`); [`release_node`] unmounts them.
pub const ROOTS_DIR: &str = "roots";
/// Pool images' name prefix.
const POOL_PREFIX: &str = "pool-";
/// The node's environment variable that, set to `off`, makes it use the poller (to
/// measure or rule out the volumes).
pub const OFF_VAR: &str = "CYNODE_DISK_VOLUMES";
/// The longest pause of the pool's filler after a failure.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// How the node holds disk limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Enforcement {
    /// Per-sandbox ext4 volumes on loop devices.
    Kernel,
    /// The disk poller, and why the kernel's limit is not available.
    Poller(String),
}

impl std::fmt::Display for Enforcement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Enforcement::Kernel => write!(
                f,
                "kernel-enforced: an ext4 volume on a loop device per job directory and workspace"
            ),
            Enforcement::Poller(why) => {
                write!(f, "fallback: the disk poller (disk_guard), because {why}")
            }
        }
    }
}

/// The node's volumes: where they live, their shape, the pool.
#[derive(Debug)]
pub struct Volumes {
    dir: PathBuf,
    jobs: PathBuf,
    workspaces: PathBuf,
    shape: Shape,
    target: usize,
    pool: Mutex<VecDeque<Ready>>,
    wake: Condvar,
    seq: AtomicU64,
    stats: Counters,
    /// Set when the node stops: the filler ends and the pool stays empty.
    closed: AtomicBool,
}

/// A formatted volume, mounted detached, and its image.
#[derive(Debug)]
struct Ready {
    mnt: OwnedFd,
    image: PathBuf,
}

impl Ready {
    /// Unmounts it (its mount goes with its last fd, and its loop device with the mount)
    /// and deletes its image.
    fn discard(self) {
        drop(self.mnt);
        let _ = std::fs::remove_file(&self.image);
    }
}

/// For a node that stops: ends the pool's filler and discards the ready volumes (their
/// loop devices let go, their images are deleted). A no-op without volumes.
pub fn close_pool() {
    let Some(v) = VOLUMES.get() else { return };
    v.closed.store(true, Ordering::Release);
    let ready: Vec<Ready> = v
        .pool
        .lock()
        .map(|mut p| p.drain(..).collect())
        .unwrap_or_default();
    v.wake.notify_all();
    for r in ready {
        r.discard();
    }
}

#[derive(Debug, Default)]
struct Counters {
    warm: AtomicU64,
    cold: AtomicU64,
    made: AtomicU64,
    failed: AtomicU64,
    released: AtomicU64,
}

/// What `/metrics` reports of the volumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    /// Volumes ready in the pool, and the pool's bound.
    pub ready: u64,
    pub target: u64,
    /// Claims served from the pool, and those that had to make one first.
    pub claimed_warm: u64,
    pub claimed_cold: u64,
    pub made: u64,
    pub make_failures: u64,
    pub released: u64,
    /// Each volume's image size in bytes.
    pub image_bytes: u64,
}

static VOLUMES: OnceLock<Arc<Volumes>> = OnceLock::new();
static MODE: OnceLock<Enforcement> = OnceLock::new();
/// The node's layout, also when its disk limits are the poller's ([`unmounted_image`]).
static LAYOUT: OnceLock<Layout> = OnceLock::new();

/// How this process holds disk limits (the poller until [`init`] succeeded).
pub fn enforcement() -> Enforcement {
    MODE.get()
        .cloned()
        .unwrap_or_else(|| Enforcement::Poller("kernel-enforced volumes were not set up".into()))
}

/// The pool's counters, when volumes are in use.
pub fn stats() -> Option<Stats> {
    let v = VOLUMES.get()?;
    let c = &v.stats;
    Some(Stats {
        ready: v.pool.lock().map(|p| p.len() as u64).unwrap_or(0),
        target: v.target as u64,
        claimed_warm: c.warm.load(Ordering::Relaxed),
        claimed_cold: c.cold.load(Ordering::Relaxed),
        made: c.made.load(Ordering::Relaxed),
        make_failures: c.failed.load(Ordering::Relaxed),
        released: c.released.load(Ordering::Relaxed),
        image_bytes: v.shape.image_bytes,
    })
}

/// The volume counters in Prometheus text format (empty without volumes).
pub fn metrics_text() -> String {
    let Some(s) = stats() else {
        return String::new();
    };
    format!(
        "# TYPE cynode_worker_disk_volumes_ready gauge\ncynode_worker_disk_volumes_ready {}\n\
         # TYPE cynode_worker_disk_volumes_pool_target gauge\ncynode_worker_disk_volumes_pool_target {}\n\
         # TYPE cynode_worker_disk_volumes_claimed_total counter\ncynode_worker_disk_volumes_claimed_total{{pool=\"warm\"}} {}\ncynode_worker_disk_volumes_claimed_total{{pool=\"cold\"}} {}\n\
         # TYPE cynode_worker_disk_volumes_made_total counter\ncynode_worker_disk_volumes_made_total {}\n\
         # TYPE cynode_worker_disk_volumes_make_failures_total counter\ncynode_worker_disk_volumes_make_failures_total {}\n\
         # TYPE cynode_worker_disk_volumes_released_total counter\ncynode_worker_disk_volumes_released_total {}\n",
        s.ready, s.target, s.claimed_warm, s.claimed_cold, s.made, s.make_failures, s.released
    )
}

/// Where the node keeps its volumes, and for which directories.
#[derive(Debug, Clone)]
pub struct Layout {
    pub state_dir: PathBuf,
    pub jobs_dir: PathBuf,
    pub workspaces_dir: PathBuf,
}

/// Whether this host can give kernel-enforced disk limits: makes, mounts and drops one
/// volume in `<state>/volumes`. `Ok` or why not.
pub fn probe(state_dir: &Path, shape: Shape) -> Result<(), String> {
    if !rustix::process::geteuid().is_root() {
        return Err("the node is not root (loop devices and mounts need it)".into());
    }
    if !Path::new("/dev/loop-control").exists() {
        return Err("this host has no /dev/loop-control".into());
    }
    if image::mke2fs().is_none() {
        return Err("mke2fs is not installed (package e2fsprogs)".into());
    }
    let dir = state_dir.join(VOLUMES_DIR);
    make_private_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let img = dir.join(format!("probe-{}.img", std::process::id()));
    let _ = std::fs::remove_file(&img);
    let made = image::create(&img, shape).and_then(|()| image::mount_detached(&img));
    let _ = std::fs::remove_file(&img);
    made.map(drop).map_err(|e| e.to_string())
}

fn make_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Sets up kernel-enforced disk limits for this process: checks the host ([`probe`]),
/// settles what a previous run left ([`Volumes::reclaim`]) and starts the pool's filler
/// (at most `pool` ready volumes). Returns the mode; on any failure it is the poller's.
pub fn init(layout: Layout, shape: Shape, pool: usize) -> Enforcement {
    if let Some(m) = MODE.get() {
        return m.clone();
    }
    let _ = LAYOUT.set(layout.clone());
    let probed = if std::env::var_os(OFF_VAR).is_some_and(|v| v == "off") {
        Err(format!("{OFF_VAR}=off"))
    } else {
        probe(&layout.state_dir, shape)
    };
    let mode = match probed {
        Err(why) => Enforcement::Poller(why),
        Ok(()) => {
            let v = Arc::new(Volumes {
                dir: layout.state_dir.join(VOLUMES_DIR),
                jobs: layout.jobs_dir,
                workspaces: layout.workspaces_dir,
                shape,
                target: pool.max(1),
                pool: Mutex::new(VecDeque::new()),
                wake: Condvar::new(),
                seq: AtomicU64::new(0),
                stats: Counters::default(),
                closed: AtomicBool::new(false),
            });
            v.reclaim();
            let filler = Arc::clone(&v);
            match std::thread::Builder::new()
                .name("volume-pool".into())
                .spawn(move || filler.fill())
            {
                Ok(_) => {
                    let _ = VOLUMES.set(v);
                    Enforcement::Kernel
                }
                Err(e) => Enforcement::Poller(format!("cannot start the volume pool: {e}")),
            }
        }
    };
    match &mode {
        Enforcement::Kernel => tracing::info!(
            image_bytes = shape.image_bytes,
            inodes = shape.inodes,
            pool,
            "disk limits: {mode}"
        ),
        Enforcement::Poller(_) => tracing::warn!("disk limits: {mode}"),
    }
    let _ = MODE.set(mode.clone());
    mode
}

impl Volumes {
    fn make(&self, name: &str) -> Result<Ready, MakeError> {
        let image = self.dir.join(name);
        let made = image::create(&image, self.shape).and_then(|()| image::mount_detached(&image));
        match made {
            Ok(mnt) => {
                self.stats.made.fetch_add(1, Ordering::Relaxed);
                Ok(Ready { mnt, image })
            }
            Err(e) => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                let _ = std::fs::remove_file(&image);
                Err(e)
            }
        }
    }

    fn pool_name(&self) -> String {
        format!(
            "{POOL_PREFIX}{}-{}.img",
            std::process::id(),
            self.seq.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// The filler: keeps the pool at its bound, pausing (up to [`MAX_BACKOFF`]) after
    /// failures.
    fn fill(&self) {
        let mut backoff = Duration::from_millis(500);
        loop {
            {
                let Ok(mut p) = self.pool.lock() else { return };
                while p.len() >= self.target && !self.closed.load(Ordering::Acquire) {
                    p = match self.wake.wait(p) {
                        Ok(p) => p,
                        Err(_) => return,
                    };
                }
                if self.closed.load(Ordering::Acquire) {
                    return;
                }
            }
            match self.make(&self.pool_name()) {
                Ok(r) => {
                    backoff = Duration::from_millis(500);
                    if let Ok(mut p) = self.pool.lock() {
                        if self.closed.load(Ordering::Acquire) {
                            drop(p);
                            r.discard();
                            return;
                        }
                        p.push_back(r);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot make a disk volume for the pool");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// A ready volume: from the pool, or made now when the pool is empty.
    fn claim(&self) -> Result<Ready, MakeError> {
        let got = self.pool.lock().ok().and_then(|mut p| p.pop_front());
        self.wake.notify_one();
        if let Some(r) = got {
            self.stats.warm.fetch_add(1, Ordering::Relaxed);
            return Ok(r);
        }
        self.stats.cold.fetch_add(1, Ordering::Relaxed);
        self.make(&self.pool_name())
    }

    /// Mounts a volume named `label` on the empty directory `name` in `parent`, and
    /// opens its root.
    fn cover(&self, parent: BorrowedFd<'_>, name: &OsStr, label: &str) -> std::io::Result<OwnedFd> {
        let r = self.claim().map_err(std::io::Error::other)?;
        let image = self.dir.join(format!("{label}.img"));
        if let Err(e) = std::fs::rename(&r.image, &image) {
            let _ = std::fs::remove_file(&r.image);
            return Err(e);
        }
        if let Err(e) = rmount::move_mount(
            r.mnt.as_fd(),
            "",
            parent,
            name,
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        ) {
            let _ = std::fs::remove_file(&image);
            return Err(e.into());
        }
        drop(r.mnt);
        crate::fd_walk::open_dir_at(parent, name).map_err(Into::into)
    }

    /// What a previous run left: pool images (their mounts died with it) and images
    /// whose directory is gone are deleted; an image whose directory is still there but
    /// no longer mounted (after a reboot, or an operator's unmount) is mounted on
    /// it again, as it is (a `lost+found` a sandbox made stays).
    fn reclaim(&self) {
        let attached = attached_images();
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            let target = name.strip_suffix(".img").and_then(|n| {
                n.strip_prefix("job-")
                    .map(|id| self.jobs.join(id).join("job"))
                    .or_else(|| n.strip_prefix("ws-").map(|id| self.workspaces.join(id)))
            });
            let wanted = target.as_deref().filter(|t| wants_volume(t));
            if let Some(device) = attached.get(&path) {
                // Still held: mounted on its directory (the usual case after any stop), or
                // only by a sandbox that outlived the node after the mount was taken off
                // its directory (an operator's unmount). In the second case it goes back
                // on its directory through the same device (a second device would put a
                // second filesystem on the image); an attached image is never removed.
                if let Some(t) = wanted {
                    if !self.remount(&path, t, Some(device))
                        && !attached_images().contains_key(&path)
                    {
                        // Its last holder let go meanwhile: a new device.
                        self.remount(&path, t, None);
                    }
                }
                continue;
            }
            match target.as_deref() {
                // A pool image (its mount died with the run), or no volume of this node's.
                None => remove_left_image(&path),
                // Its directory is gone (acknowledged, swept, removed): so is its content.
                Some(t) if std::fs::symlink_metadata(t).is_err() => remove_left_image(&path),
                Some(t) => {
                    if !wanted.is_some_and(|w| self.remount(&path, w, None)) {
                        // Never deleted while its directory is there: the image is the
                        // content. `make_workspace` refuses such a workspace until the
                        // operator has looked (the log names both).
                        tracing::error!(image = %path.display(), dir = %t.display(), "a disk volume could not be mounted again on its directory; its image is kept");
                    }
                }
            }
        }
    }

    /// Mounts `image` again on `target` (an empty directory, [`wants_volume`]): through
    /// `device` when a loop device still holds the image, else a new one.
    fn remount(&self, image: &Path, target: &Path, device: Option<&Path>) -> bool {
        let (Some(parent), Some(name)) = (target.parent(), target.file_name()) else {
            return false;
        };
        let moved = image::mount_again(image, device)
            .map_err(std::io::Error::other)
            .and_then(|mnt| {
                let p = crate::fd_walk::open_node_dir(parent)?;
                rmount::move_mount(
                    mnt.as_fd(),
                    "",
                    p.as_fd(),
                    name,
                    MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
                )
                .map_err(std::io::Error::from)
            });
        match moved {
            Ok(()) => {
                tracing::info!(image = %image.display(), dir = %target.display(), "disk volume mounted again");
                true
            }
            Err(e) => {
                tracing::warn!(image = %image.display(), error = %e, "cannot mount a disk volume again");
                false
            }
        }
    }
}

fn remove_left_image(path: &Path) {
    tracing::info!(image = %path.display(), "removing a disk volume a previous run left");
    let _ = std::fs::remove_file(path);
}

/// The image of the workspace directory `dir`, when one is on disk but not mounted on it
/// (it could not be mounted again at start, or this start has no volumes): a job there
/// would run on the empty directory beneath and hide the content. `None` otherwise.
pub fn unmounted_image(dir: &Path) -> Option<PathBuf> {
    let layout = LAYOUT.get()?;
    let image = layout
        .state_dir
        .join(VOLUMES_DIR)
        .join(format!("{}.img", workspace_label(dir.file_name()?)));
    (std::fs::symlink_metadata(&image).is_ok() && !is_volume(dir)).then_some(image)
}

/// Whether `target` is an empty directory that is no mount: a volume's directory whose
/// volume is not on it.
fn wants_volume(target: &Path) -> bool {
    std::fs::read_dir(target).is_ok_and(|mut d| d.next().is_none()) && !is_volume(target)
}

/// The image files loop devices hold now, each with its device (from sysfs).
fn attached_images() -> std::collections::HashMap<PathBuf, PathBuf> {
    let Ok(d) = std::fs::read_dir("/sys/block") else {
        return Default::default();
    };
    d.flatten()
        .filter_map(|e| {
            let dev = e.file_name().to_string_lossy().into_owned();
            let image = backing_file(&format!("/dev/{dev}"))?;
            Some((image, PathBuf::from(format!("/dev/{dev}"))))
        })
        .collect()
}

/// The image behind `/dev/loopN`, from sysfs.
pub(super) fn backing_file(source: &str) -> Option<PathBuf> {
    let n = source.strip_prefix("/dev/loop")?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let s = std::fs::read_to_string(format!("/sys/block/loop{n}/loop/backing_file")).ok()?;
    Some(PathBuf::from(s.trim_end_matches('\n')))
}

/// Mounts a fresh volume, labelled `label` (`job-<id>`, `ws-<id>`), on the directory
/// `name` the caller just created (empty) in `parent`, and returns the volume's root
/// opened; `None` when this node holds disk limits with the poller.
/// A volume that cannot be had is logged and `None` too: the poller holds the limit.
pub fn cover(parent: BorrowedFd<'_>, name: &OsStr, label: &str) -> Option<OwnedFd> {
    let v = VOLUMES.get()?;
    match v.cover(parent, name, label) {
        Ok(fd) => Some(fd),
        Err(e) => {
            tracing::warn!(volume = label, error = %e, "no disk volume: the disk poller holds the limit");
            None
        }
    }
}

/// The image behind the volume whose root is `dir` (opened `O_PATH`, for `fstat`: its
/// allocated blocks are the volume's high-water mark), when it is one of this node's.
pub fn image_of(dir: &Path) -> Option<OwnedFd> {
    let image = volume_image(dir)?;
    rfs::open(
        &image,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()
}

/// The path of the image behind the loop-device filesystem at `dir`, when it is one of
/// this node's volumes (its image in the node's volume directory).
fn volume_image(dir: &Path) -> Option<PathBuf> {
    let v = VOLUMES.get()?;
    let s = rfs::statx(
        rfs::CWD,
        dir,
        rfs::AtFlags::SYMLINK_NOFOLLOW,
        rfs::StatxFlags::BASIC_STATS,
    )
    .ok()?;
    if s.stx_dev_major != LOOP_MAJOR {
        return None;
    }
    backing_file(&format!("/dev/loop{}", s.stx_dev_minor))
        .filter(|image| image.parent() == Some(v.dir.as_path()))
}

/// The label of workspace `name`'s volume (its image `ws-<name>.img`, which a restarting
/// node mounts again on the workspace: [`Volumes::reclaim`]).
pub fn workspace_label(name: &OsStr) -> String {
    format!("ws-{}", name.to_string_lossy())
}

/// Whether `dir` is the root of a loop-device filesystem (a volume).
pub fn is_volume(dir: &Path) -> bool {
    rfs::statx(
        rfs::CWD,
        dir,
        rfs::AtFlags::SYMLINK_NOFOLLOW,
        rfs::StatxFlags::BASIC_STATS,
    )
    .is_ok_and(|s| {
        s.stx_attributes_mask
            .contains(rfs::StatxAttributes::MOUNT_ROOT)
            && s.stx_attributes.contains(rfs::StatxAttributes::MOUNT_ROOT)
            && s.stx_dev_major == LOOP_MAJOR
    })
}

/// Unmounts every volume at or beneath `root` (detached: a sandbox still holding one
/// keeps it until it lets go) and deletes its image. A no-op without volumes.
pub fn release_beneath(root: &Path) {
    let Some(v) = VOLUMES.get() else { return };
    let Ok(mounts) = mountinfo::read() else {
        return;
    };
    for m in mountinfo::beneath(&mounts, root) {
        if m.fstype != "ext4" {
            continue;
        }
        let Some(image) = backing_file(&m.source) else {
            continue;
        };
        if image.parent() != Some(v.dir.as_path()) {
            continue;
        }
        let _ = std::fs::remove_file(&image);
        match rmount::unmount(&m.point, UnmountFlags::DETACH | UnmountFlags::NOFOLLOW) {
            Ok(()) => {
                v.stats.released.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(dir = %m.point.display(), error = %e, "cannot unmount a disk volume");
            }
        }
    }
}

/// Renames the image of the volume whose root is `dir` to `<label>.img`, never over an
/// existing image (a node restarting mounts it again on the directory its label names).
pub fn relabel(dir: &Path, label: &str) -> std::io::Result<()> {
    let v = VOLUMES
        .get()
        .ok_or_else(|| std::io::Error::other("this node has no disk volumes"))?;
    let image = volume_image(dir)
        .ok_or_else(|| std::io::Error::other(format!("{} is no volume", dir.display())))?;
    rfs::renameat_with(
        rfs::CWD,
        &image,
        rfs::CWD,
        v.dir.join(format!("{label}.img")),
        rfs::RenameFlags::NOREPLACE,
    )
    .map_err(Into::into)
}

/// Moves the volume mounted at `from` (its root) onto the empty directory `name` in
/// `parent`: a detached clone of the mount is attached there, then the mount at `from` is
/// detached (the filesystem stays, held by the clone). Moving the attached mount itself
/// would fail (EINVAL) where its parent mount is shared, as systemd makes them.
pub fn move_volume(from: &Path, parent: BorrowedFd<'_>, name: &OsStr) -> std::io::Result<()> {
    let tree = rmount::open_tree(
        rfs::CWD,
        from,
        rmount::OpenTreeFlags::OPEN_TREE_CLONE
            | rmount::OpenTreeFlags::OPEN_TREE_CLOEXEC
            | rmount::OpenTreeFlags::AT_SYMLINK_NOFOLLOW,
    )?;
    rmount::move_mount(
        tree.as_fd(),
        "",
        parent,
        name,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )?;
    rmount::unmount(from, UnmountFlags::DETACH | UnmountFlags::NOFOLLOW).map_err(Into::into)
}

/// Creates the directory `name` in `parent` with a fresh volume (labelled `label`)
/// mounted on it, its root given to `owner` with mode 0755: `true`. `false`, and nothing
/// done, when `name` exists already or this node holds disk limits with the poller. A
/// volume that cannot be had leaves a plain directory (logged; the poller holds the
/// limit there).
pub fn new_volume_dir(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    label: &str,
    owner: u32,
) -> std::io::Result<bool> {
    let Some(v) = VOLUMES.get() else {
        return Ok(false);
    };
    match rfs::mkdirat(parent, name, Mode::from_raw_mode(0o700)) {
        Ok(()) => {}
        Err(rustix::io::Errno::EXIST) => return Ok(false),
        Err(e) => return Err(e.into()),
    }
    let fd = match v.cover(parent, name, label) {
        Ok(fd) => fd,
        Err(e) => {
            tracing::warn!(volume = label, error = %e, "no disk volume: the disk poller holds the limit");
            crate::fd_walk::open_dir_at(parent, name)?
        }
    };
    let id = Some(rfs::Uid::from_raw(owner));
    rfs::fchown(&fd, id, Some(rfs::Gid::from_raw(owner)))?;
    rfs::fchmod(&fd, Mode::from_raw_mode(0o755))?;
    Ok(true)
}

/// The volumes of a node configured by `cfg`: where, what shape (from `limits.disk_mb`
/// and `limits.disk_max_files`, the root owned by the sandbox user), and the pool's bound
/// (two per running job, so a job and a new workspace both find one).
pub fn plan(cfg: &crate::config::Config) -> (Layout, Shape, usize) {
    (
        Layout {
            state_dir: cfg.state_dir.clone(),
            jobs_dir: cfg.jobs_dir(),
            workspaces_dir: cfg.workspaces_dir(),
        },
        Shape::new(
            cfg.limits.disk_mb,
            cfg.limits.disk_max_files,
            crate::sandbox::SANDBOX_UID,
        ),
        cfg.queue.max_running.saturating_mul(2).clamp(2, 16),
    )
}
