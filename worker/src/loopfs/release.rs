//! Letting go of a node's mounts when it is gone: its workspaces' and job directories'
//! volumes (and a gVisor pool slot's staging mounts) are unmounted, so their loop devices
//! let go of their images (autoclear) and no later mount namespace of the host copies
//! them. The images stay: a node that starts again mounts what it needs
//! (`Volumes::reclaim`).
//!
//! The mounts are found in `/proc/self/mountinfo`, strictly beneath the state directory,
//! never by walking the state directory (a workspace's content is the sandbox's), and
//! only the node's: a filesystem on a loop device whose image is in `<state>/volumes/`, a
//! mount beneath `<state>/pool/` (the engine pool's slots), or one beneath `<state>/roots/`
//! (bwrap's views of the root filesystems, `backend::bwrap::root_view`). A mount an operator made
//! there (a disk for the workspaces) stays. Each is
//! unmounted by its place: its parent directory opened from the state directory with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`, then
//! `umount2("/proc/self/fd/<parent>/<name>", UMOUNT_NOFOLLOW)`, after `statx` showed that
//! the mount there is the one mountinfo named. A path that needs a link is left, and
//! logged. Nothing in a volume is read or opened. A mount still in use (`EBUSY`: a
//! process holds a file or its working directory on it) is detached instead
//! (`MNT_DETACH`), and logged: it goes, and its loop device with it, when the last user
//! lets go.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{self as rfs, AtFlags, Mode, OFlags, ResolveFlags, StatxFlags};
use rustix::mount::{self as rmount, UnmountFlags};

use super::mountinfo::{self, Mount};

/// How many times the mount table is read again (mounts stacked on one directory go one
/// a pass).
const PASSES: usize = 8;
/// The engine pool's directory under the state directory (`backend::engine::pool`),
/// where a gVisor slot's staging mounts are.
const POOL_DIR: &str = "pool";

/// What [`release_node`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Mounts unmounted.
    pub unmounted: usize,
    /// Mounts in use, detached (they go when their last user lets go).
    pub detached: usize,
    /// The node's mounts still beneath the state directory afterwards.
    pub left: usize,
}

enum Outcome {
    Unmounted,
    Detached,
    /// Not the top mount at its place now, or gone meanwhile: a later pass sees.
    Skipped,
    /// Its place cannot be reached without following a link, or the kernel refused.
    Failed(std::io::Error),
}

/// Unmounts every mount of the node's strictly beneath `state_dir` (deepest first;
/// detached when in use). Blocking; a no-op when nothing of the node's is mounted there.
pub fn release_node(state_dir: &Path) -> Released {
    let mut out = Released::default();
    let Ok(root) = std::fs::canonicalize(state_dir) else {
        return out;
    };
    let Ok(dir) = rfs::open(
        &root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    ) else {
        return out;
    };
    let mut failed: Vec<(PathBuf, std::io::Error)> = Vec::new();
    for _ in 0..PASSES {
        let under = mounts_beneath(&root);
        failed.clear();
        let mut progress = false;
        for m in &under {
            match unmount_one(dir.as_fd(), &root, m) {
                Outcome::Unmounted => {
                    out.unmounted += 1;
                    progress = true;
                }
                Outcome::Detached => {
                    out.detached += 1;
                    progress = true;
                }
                Outcome::Skipped => {}
                Outcome::Failed(e) => failed.push((m.point.clone(), e)),
            }
        }
        if !progress {
            break;
        }
    }
    for (point, e) in &failed {
        tracing::warn!(dir = %point.display(), error = %e, "a mount beneath the state directory cannot be unmounted (its path holds a link, or the kernel refused); it is left mounted");
    }
    out.left = mounts_beneath(&root).len();
    out
}

/// The node's mounts strictly beneath `root`, deepest first.
fn mounts_beneath(root: &Path) -> Vec<Mount> {
    let Ok(all) = mountinfo::read() else {
        return Vec::new();
    };
    let (volumes, pool) = (root.join(super::VOLUMES_DIR), root.join(POOL_DIR));
    let roots = root.join(super::ROOTS_DIR);
    mountinfo::beneath(&all, root)
        .into_iter()
        .filter(|m| m.point != root)
        .filter(|m| {
            m.point.starts_with(&pool)
                || m.point.starts_with(&roots)
                || super::backing_file(&m.source).is_some_and(|image| image.starts_with(&volumes))
        })
        .collect()
}

fn unmount_one(state: BorrowedFd<'_>, root: &Path, m: &Mount) -> Outcome {
    let Ok(rel) = m.point.strip_prefix(root) else {
        return Outcome::Skipped;
    };
    let Some(name) = rel.file_name() else {
        return Outcome::Skipped;
    };
    let parent = match rel.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let parent = match rfs::openat2(
        state,
        parent,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    ) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Outcome::Skipped,
        Err(e) => return Outcome::Failed(e.into()),
    };
    match rfs::statx(&parent, name, AtFlags::SYMLINK_NOFOLLOW, StatxFlags::MNT_ID) {
        Ok(s) if s.stx_mnt_id == m.id => {}
        Ok(_) | Err(rustix::io::Errno::NOENT) => return Outcome::Skipped,
        Err(e) => return Outcome::Failed(e.into()),
    }
    let place = PathBuf::from(format!("/proc/self/fd/{}", parent.as_raw_fd())).join(name);
    match rmount::unmount(&place, UnmountFlags::NOFOLLOW) {
        Ok(()) => Outcome::Unmounted,
        Err(rustix::io::Errno::BUSY) => {
            match rmount::unmount(&place, UnmountFlags::NOFOLLOW | UnmountFlags::DETACH) {
                Ok(()) => {
                    tracing::warn!(dir = %m.point.display(), source = %m.source, "a mount beneath the state directory is still in use: detached, it goes when its last user lets go");
                    Outcome::Detached
                }
                Err(e) => Outcome::Failed(e.into()),
            }
        }
        // Gone meanwhile, or no longer a mount.
        Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT) => Outcome::Skipped,
        Err(e) => Outcome::Failed(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount_tmpfs(at: &Path) {
        std::fs::create_dir_all(at).unwrap();
        rmount::mount("tmpfs", at, "tmpfs", rmount::MountFlags::empty(), None).unwrap();
    }

    /// Beneath a state directory that is itself a mount: the node's (here in the pool's
    /// directory) a mount, one nested in it, and one held open, and an operator's mount on
    /// the workspaces' directory. The nested and the plain one are unmounted, the held one
    /// detached; the state directory's own mount and the operator's stay.
    #[test]
    fn the_nodes_mounts_beneath_go_and_the_others_stay() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: mounting needs root");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        mount_tmpfs(&state);
        let operators = state.join("workspaces");
        mount_tmpfs(&operators);
        let pool = state.join(POOL_DIR);
        let (outer, nested, held) = (pool.join("a"), pool.join("a/b"), pool.join("c"));
        mount_tmpfs(&outer);
        mount_tmpfs(&nested);
        mount_tmpfs(&held);
        let holder = std::fs::File::open(&held).unwrap();
        let r = release_node(&state);
        assert_eq!(
            r,
            Released {
                unmounted: 2,
                detached: 1,
                left: 0
            }
        );
        let all = mountinfo::read().unwrap();
        let real = std::fs::canonicalize(&state).unwrap();
        assert!(
            all.iter().any(|m| m.point == real),
            "the state directory's own mount went"
        );
        assert!(
            all.iter().any(|m| m.point == real.join("workspaces")),
            "the operator's mount went"
        );
        drop(holder);
        rmount::unmount(&operators, UnmountFlags::DETACH).unwrap();
        rmount::unmount(&state, UnmountFlags::DETACH).unwrap();
    }
}
