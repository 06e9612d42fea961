//! A gVisor slot's host side (`runtime: runsc` with `pool_size` > 0). The waiter's side,
//! and why a runc claim cannot work under gVisor, are in `poolwaiter/src/gvisor.rs`.
//!
//! **At creation** the slot directory gets, besides the waiter and the control socket:
//! - the node's seccomp programs (`filter-<n>.bpf`, those bubblewrap gets): the container
//!   runs without an OCI profile so that its waiter may mount, and the waiter installs
//!   them on the job before its exec;
//! - two more sockets, `out.sock` and `err.sock`, which the waiter connects before the
//!   control socket; the worker accepts each once and unlinks it, as the control socket;
//! - `mnt/`, with an empty `job/` and `workspace/`, bound onto itself and made `shared`,
//!   and mounted in the container at `/.cynode-mnt` with `rslave` propagation: a mount the
//!   worker makes under it later appears inside, and nothing the container mounts comes
//!   back (gVisor refuses `shared` anyway).
//!
//! **At the claim** the job directory and the workspace are cloned on the host exactly as
//! for runc (`nosuid,nodev`, read-only where the spec says, the disk volumes with them)
//! and moved onto `mnt/job` and `mnt/workspace`; the waiter binds them onto the
//! placeholders inside and detaches `/.cynode-mnt`. These two are the only mounts a node
//! makes on the host for a pooled container, all beneath the slot directory, which is
//! root's (0700) and never a sandbox's: nothing here opens a path a job chose, and the
//! mount points are opened without following a link.
//!
//! **At the end** ([`remove_slot_dir`]) every mount beneath a slot directory is unmounted
//! (detached), and its staging directory is removed without recursion (known files, then
//! `rmdir`), so a mount still there (or one landing late) stops the removal instead of
//! letting it delete a workspace through it. The same runs over the whole pool directory
//! at start ([`remove_pool_dir`]), for what a killed node left.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use rustix::fs::OFlags;
use rustix::mount::{self as rmount, MountPropagationFlags, UnmountFlags};

use crate::backend::mount_tree::{clone_tree, job_attrs, move_onto};
use crate::backend::seccomp;
use crate::loopfs::mountinfo;
use crate::sandbox::{JOB_MOUNT, WORKSPACE_MOUNT};

/// The staging directory's name in the slot directory.
pub(super) const STAGING: &str = "mnt";
/// Where the staging directory appears in the container.
pub(super) const STAGING_MOUNT: &str = "/.cynode-mnt";
/// The output sockets' names in the slot directory: stdout, stderr.
pub(super) const OUTPUT_SOCKETS: [&str; 2] = ["out.sock", "err.sock"];

/// The name under the staging directory of a job mount's target (`/job` → `job`).
pub(super) fn staged_name(target: &str) -> &str {
    target.trim_start_matches('/')
}

/// The filters and the shared staging directory of a new slot directory `dir`.
pub(super) fn prepare(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let programs = seccomp::bpf_programs().map_err(std::io::Error::other)?;
    for (i, p) in programs.iter().enumerate() {
        let f = dir.join(format!("filter-{i}.bpf"));
        std::fs::write(&f, p)?;
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o444))?;
    }
    let staging = dir.join(STAGING);
    let mut b = std::fs::DirBuilder::new();
    b.mode(0o700);
    b.create(&staging)?;
    for target in [JOB_MOUNT, WORKSPACE_MOUNT] {
        b.create(staging.join(staged_name(target)))?;
    }
    rmount::mount_bind(&staging, &staging)?;
    rmount::mount_change(&staging, MountPropagationFlags::SHARED)?;
    Ok(())
}

/// Clones each host directory of the job onto its place under the slot's staging
/// directory (which the container receives). Blocking.
pub(super) fn mount_job(dir: &Path, mounts: &[(PathBuf, String, bool)]) -> std::io::Result<()> {
    for (host, target, writable) in mounts {
        let tree = clone_tree(host, true, job_attrs(*writable))?;
        let place = dir.join(STAGING).join(staged_name(target));
        move_onto(&tree, &place, OFlags::DIRECTORY)?;
    }
    Ok(())
}

/// Unmounts (detached, deepest first) every mount at or beneath `dir` (its real path: the
/// kernel's names are); whether none is left. Blocking.
pub fn unmount_beneath(dir: &Path) -> bool {
    let real = std::fs::canonicalize(dir);
    let dir = real.as_deref().unwrap_or(dir);
    for _ in 0..4 {
        let Ok(mounts) = mountinfo::read() else {
            return false;
        };
        let under = mountinfo::beneath(&mounts, dir);
        if under.is_empty() {
            return true;
        }
        for m in under {
            if let Err(e) = rmount::unmount(&m.point, UnmountFlags::DETACH | UnmountFlags::NOFOLLOW)
            {
                tracing::warn!(dir = %m.point.display(), error = %e, "cannot unmount beneath a pool slot");
            }
        }
    }
    false
}

/// Removes a slot directory. Its staging directory is never removed recursively: after
/// the unmounts, only its known files go, then each directory by `rmdir`, which fails on
/// a mount point (or anything left in it) rather than entering it; a slot whose staging
/// directory stays is left and logged. Blocking.
pub fn remove_slot_dir(dir: &Path) {
    let staging = dir.join(STAGING);
    if std::fs::symlink_metadata(&staging).is_ok() {
        unmount_beneath(dir);
        for file in ["passwd", "group"] {
            let _ = std::fs::remove_file(staging.join(file));
        }
        let dirs = [JOB_MOUNT, WORKSPACE_MOUNT].map(|t| staging.join(staged_name(t)));
        for d in dirs.iter().chain([&staging]) {
            match std::fs::remove_dir(d) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::error!(dir = %d.display(), error = %e, "a pool slot's staging directory cannot be removed (still mounted?); the slot is left");
                    return;
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Removes the pool's directory (at start: what a previous run left), each slot by
/// [`remove_slot_dir`] first; left when a slot is. Blocking.
pub fn remove_pool_dir(dir: &Path) {
    unmount_beneath(dir);
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_slot_dir(&e.path());
            }
        }
    }
    let left = std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| std::fs::symlink_metadata(e.path().join(STAGING)).is_ok())
    });
    if left {
        tracing::error!(dir = %dir.display(), "the pool directory keeps a slot it cannot remove; it is left");
        return;
    }
    let _ = std::fs::remove_dir_all(dir);
}
