//! A host uid per workspace, from the configured range `sandbox_uids`.
//!
//! The kernel keeps some budgets per user: inotify instances and watches
//! (`fs.inotify.max_user_instances`, 128 by default), processes (`RLIMIT_NPROC`), pending
//! signals, POSIX message queue bytes. Sandboxes that share a host uid share those budgets,
//! so one job could take them all and starve every other tenant. So every workspace runs
//! as a host uid of its own: its files are owned by that uid on the host, and every
//! sandbox over it (jobs, session commands, the changeset's git) runs as that uid. A
//! workspace keeps its uid for its life (its files are owned by it); two workspaces never
//! share one. Inside a bwrap sandbox the job still sees uid 1000 (bwrap runs as the host
//! uid and maps it to 1000 in its user namespace); under Podman and Docker the container
//! runs as `--user N:N`, so the job sees N (a user namespace made by a root engine would
//! charge root's budget, the one every container shares).
//!
//! The assignment is kept in the node's database (`sandbox_uids` table: workspace id →
//! uid, the uid unique), so a restarted node, and `cynode-worker replay` beside it, keep
//! it. [`UidPool::for_workspace`] returns the workspace's uid, assigning the lowest free
//! one the first time (whoever creates the workspace directory makes it owned by that
//! uid); a workspace whose files another uid owns (made before the pool, or under another range) is given to its
//! uid first ([`crate::reown`]). When every uid is held, assignments whose workspace
//! directory is gone are released; if none is, the request is refused
//! ([`UidError::Exhausted`], 503): a uid is never shared.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::store::{Store, StoreError};

pub use crate::config::sandbox_uids::UidRange;

/// Why a workspace has no uid.
#[derive(Debug, thiserror::Error)]
pub enum UidError {
    /// Every uid of the range is held by a workspace that still exists (503).
    #[error("every host uid of sandbox_uids ({first}, {count} uids) is held by another workspace; none is shared, so workspace {workspace_id} cannot run until one is released (raise sandbox_uids.count)")]
    Exhausted {
        workspace_id: String,
        first: u32,
        count: u32,
    },
    #[error("sandbox uid assignment: {0}")]
    Store(#[from] StoreError),
    #[error("cannot prepare workspace {workspace_id} for its uid {uid}: {reason}")]
    Workspace {
        workspace_id: String,
        uid: u32,
        reason: String,
    },
}

/// Entries a workspace may hold when it is given to a new uid.
const REOWN_MAX_ENTRIES: u64 = 5_000_000;
/// An assignment younger than this is never released for a missing directory (its
/// workspace may be being created by another process, `replay`).
const RECLAIM_MIN_AGE: time::Duration = time::Duration::minutes(10);

/// The node's uid assignments.
#[derive(Debug)]
pub struct UidPool {
    range: UidRange,
    store: Store,
    workspaces: PathBuf,
    baselines: PathBuf,
    /// One assignment (and the re-owning it may need) at a time in this process; the
    /// database's unique constraint holds across processes.
    lock: tokio::sync::Mutex<()>,
    /// The workspaces with a live [`UidLease`] (an accepted job's), and how many: their
    /// assignments are never reclaimed, even while their directory does not exist yet.
    pinned: Arc<Mutex<HashMap<String, usize>>>,
}

/// A workspace's uid held for an accepted job, from [`UidPool::lease`]: while it lives,
/// the assignment is not reclaimed (a queued job's workspace may not exist yet), so the
/// uid the job was accepted with is still its workspace's, and no other's, when it runs.
#[derive(Debug)]
pub struct UidLease {
    pinned: Arc<Mutex<HashMap<String, usize>>>,
    workspace_id: String,
    uid: u32,
}

impl UidLease {
    /// The workspace's host uid.
    pub fn uid(&self) -> u32 {
        self.uid
    }
}

impl Drop for UidLease {
    fn drop(&mut self) {
        let mut pinned = self
            .pinned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = pinned.get_mut(&self.workspace_id) {
            *n -= 1;
            if *n == 0 {
                pinned.remove(&self.workspace_id);
            }
        }
    }
}

impl UidPool {
    /// The pool of `range`, recorded in `store`, for the workspaces (and baselines) under
    /// these directories.
    pub fn new(range: UidRange, store: Store, workspaces: PathBuf, baselines: PathBuf) -> Self {
        UidPool {
            range,
            store,
            workspaces,
            baselines,
            lock: tokio::sync::Mutex::new(()),
            pinned: Arc::default(),
        }
    }

    /// The node's pool.
    pub fn for_node(cfg: &crate::config::Config, store: Store) -> Self {
        UidPool::new(
            cfg.sandbox_uids,
            store,
            cfg.workspaces_dir(),
            cfg.baselines_dir(),
        )
    }

    pub fn range(&self) -> UidRange {
        self.range
    }

    /// The uid of `workspace_id` (assigned now if it has none); an existing workspace (and
    /// its baseline) that another uid owns is given to it first. The caller creates a
    /// missing workspace directory owned by it.
    pub async fn for_workspace(&self, workspace_id: &str) -> Result<u32, UidError> {
        let _held = self.lock.lock().await;
        self.settled(workspace_id).await
    }

    /// [`UidPool::for_workspace`], held for an accepted job until the lease is dropped.
    pub async fn lease(&self, workspace_id: &str) -> Result<UidLease, UidError> {
        let _held = self.lock.lock().await;
        let uid = self.settled(workspace_id).await?;
        *self
            .pinned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(workspace_id.to_string())
            .or_default() += 1;
        Ok(UidLease {
            pinned: Arc::clone(&self.pinned),
            workspace_id: workspace_id.to_string(),
            uid,
        })
    }

    /// The workspace's uid, assigned and its directories given to it; under `lock`.
    async fn settled(&self, workspace_id: &str) -> Result<u32, UidError> {
        let uid = self.assigned(workspace_id).await?;
        let (workspaces, baselines) = (self.workspaces.clone(), self.baselines.clone());
        let ws = workspace_id.to_string();
        let fail = |reason: String| UidError::Workspace {
            workspace_id: workspace_id.to_string(),
            uid,
            reason,
        };
        tokio::task::spawn_blocking(move || settle(&workspaces, &baselines, &ws, uid))
            .await
            .map_err(|e| fail(e.to_string()))?
            .map_err(fail)?;
        Ok(uid)
    }

    /// A uid for a new workspace that must not exist yet (a replay's): the caller creates
    /// the directory (refusing an existing one) and calls [`UidPool::release`] when done.
    pub async fn for_new_workspace(&self, workspace_id: &str) -> Result<u32, UidError> {
        let _held = self.lock.lock().await;
        self.assigned(workspace_id).await
    }

    /// The uid the next new workspace will get, if one is free (a hint: another
    /// assignment may take it first).
    pub async fn next_free(&self) -> Result<Option<u32>, UidError> {
        let r = self.range;
        Ok(self.store.lowest_free_uid(r.first, r.end()).await?)
    }

    /// Forgets the uid of a workspace that is gone.
    pub async fn release(&self, workspace_id: &str) -> Result<(), UidError> {
        let _held = self.lock.lock().await;
        self.store.release_uid(workspace_id).await?;
        Ok(())
    }

    /// The uid recorded for `workspace_id`, or a new one.
    async fn assigned(&self, workspace_id: &str) -> Result<u32, UidError> {
        let r = self.range;
        if let Some(uid) = self.store.workspace_uid(workspace_id).await? {
            if r.contains(uid) {
                return Ok(uid);
            }
            // Assigned under another range: the workspace moves into this one.
            self.store.release_uid(workspace_id).await?;
        }
        if let Some(uid) = self
            .store
            .assign_uid(workspace_id, r.first, r.end())
            .await?
        {
            return Ok(uid);
        }
        if self.reclaim(RECLAIM_MIN_AGE).await? > 0 {
            if let Some(uid) = self
                .store
                .assign_uid(workspace_id, r.first, r.end())
                .await?
            {
                return Ok(uid);
            }
        }
        tracing::warn!(
            workspace_id,
            first = r.first,
            count = r.count,
            "no free sandbox uid"
        );
        Err(UidError::Exhausted {
            workspace_id: workspace_id.to_string(),
            first: r.first,
            count: r.count,
        })
    }

    /// Releases the assignments whose workspace directory is gone (removed by the
    /// operator), that are older than `min_age` and that no [`UidLease`] holds; how many.
    async fn reclaim(&self, min_age: time::Duration) -> Result<usize, UidError> {
        let cutoff =
            cynode_protocol::time::format_rfc3339(time::OffsetDateTime::now_utc() - min_age);
        let mut freed = 0;
        for (ws, uid) in self.store.uid_assignments_before(&cutoff).await? {
            let leased = self
                .pinned
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .contains_key(&ws);
            if !leased && std::fs::symlink_metadata(self.workspaces.join(&ws)).is_err() {
                self.store.release_uid(&ws).await?;
                tracing::info!(workspace_id = %ws, uid, "sandbox uid released: its workspace is gone");
                freed += 1;
            }
        }
        Ok(freed)
    }
}

/// Gives the existing workspace directory `ws` (and its baseline) to `uid` when another
/// uid owns it. A missing one is left to its creator (a job's `prepare`, which may give it
/// a volume of its own; a session; seeding), which makes it owned by `uid`.
fn settle(workspaces: &Path, baselines: &Path, ws: &str, uid: u32) -> Result<(), String> {
    for (parent, what) in [(workspaces, "workspace"), (baselines, "baseline")] {
        let Ok(parent) = crate::job_dir::open_node_dir(parent) else {
            continue;
        };
        match crate::fd_walk::open_dir_at(
            std::os::fd::AsFd::as_fd(&parent),
            std::ffi::OsStr::new(ws),
        ) {
            Ok(dir) => reown_to(dir, uid).map_err(|e| format!("{what}: {e}"))?,
            Err(rustix::io::Errno::NOENT) => {}
            Err(e) => return Err(format!("{what}: {e}")),
        }
    }
    Ok(())
}

/// Gives the tree at `dir` to `uid` when its top is owned by another uid: every entry of
/// that uid moves. A root-owned top (made by the node, never written by a sandbox) moves
/// alone.
fn reown_to(dir: std::os::fd::OwnedFd, uid: u32) -> Result<(), String> {
    let st = rustix::fs::fstat(&dir).map_err(|e| e.to_string())?;
    if st.st_uid == uid && st.st_gid == uid {
        return Ok(());
    }
    if st.st_uid == 0 {
        let (u, g) = (
            rustix::fs::Uid::from_raw(uid),
            rustix::fs::Gid::from_raw(uid),
        );
        return rustix::fs::fchown(&dir, Some(u), Some(g)).map_err(|e| e.to_string());
    }
    tracing::info!(
        from = st.st_uid,
        to = uid,
        "giving a workspace to its sandbox uid"
    );
    crate::reown::reown(dir, st.st_uid, uid, REOWN_MAX_ENTRIES).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn ranges_are_checked() {
        assert!(UidRange::new(0, 10).is_err());
        assert!(UidRange::new(10, 0).is_err());
        assert!(UidRange::new(u32::MAX - 5, 5).is_ok());
        assert!(UidRange::new(u32::MAX - 5, 6).is_err());
        assert!(UidRange::new(65_000, 1000).is_err(), "nobody");
        let d = UidRange::default();
        assert_eq!(UidRange::new(d.first, d.count), Ok(d));
        assert!(d.contains(d.first) && d.contains(d.first + d.count - 1));
        assert!(!d.contains(d.first - 1) && !d.contains(d.first + d.count));
        let parsed: crate::config::Config =
            serde_yaml::from_str("sandbox_uids:\n  first: 300000\n  count: 16\n").unwrap();
        assert_eq!(parsed.sandbox_uids, UidRange::new(300_000, 16).unwrap());
        for bad in [
            "sandbox_uids:\n  first: 0\n  count: 16\n",
            "sandbox_uids:\n  first: 10\n  count: 0\n",
            "sandbox_uids:\n  first: 10\n  count: 4294967290\n",
            "sandbox_uids:\n  first: 10\n  cont: 1\n",
        ] {
            assert!(
                serde_yaml::from_str::<crate::config::Config>(bad).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn subordinate_ranges_and_users_overlap() {
        let r = UidRange::new(200_000, 100).unwrap();
        assert!(r.overlaps(165_536, 65_536));
        assert!(r.overlaps(200_099, 1));
        assert!(!r.overlaps(200_100, 5));
        assert!(!r.overlaps(100_000, 100_000));
        assert!(UidRange::new(1000, 1).unwrap().host_conflicts().len() <= 2);
    }

    async fn pool(range: UidRange) -> (tempfile::TempDir, UidPool) {
        let t = tempfile::tempdir().unwrap();
        let store = Store::open(&t.path().join("w.db")).await.unwrap();
        for d in ["workspaces", "baselines"] {
            std::fs::create_dir(t.path().join(d)).unwrap();
        }
        let p = UidPool::new(
            range,
            store,
            t.path().join("workspaces"),
            t.path().join("baselines"),
        );
        (t, p)
    }

    /// One uid per workspace, kept across calls (and a restart: the database), never
    /// shared; exhaustion is refused until a workspace is gone.
    #[tokio::test]
    async fn one_uid_per_workspace_until_exhausted() {
        if !rustix::process::geteuid().is_root() {
            return; // the pool chowns; the node runs as root
        }
        use std::os::unix::fs::MetadataExt;
        let (t, p) = pool(UidRange::new(4_000_100, 2).unwrap()).await;
        let a = p.for_workspace("a").await.unwrap();
        let b = p.for_workspace("b").await.unwrap();
        assert_ne!(a, b);
        std::fs::create_dir(t.path().join("workspaces/a")).unwrap();
        assert_eq!(p.for_workspace("a").await.unwrap(), a);
        let m = std::fs::metadata(t.path().join("workspaces/a")).unwrap();
        assert_eq!(
            (m.uid(), m.gid()),
            (a, a),
            "a root-made directory is given to its uid"
        );
        let e = p.for_workspace("c").await.unwrap_err();
        assert!(matches!(e, UidError::Exhausted { .. }), "{e}");
        // Reopened (a restart): the same assignment.
        let store = Store::open(&t.path().join("w.db")).await.unwrap();
        let again = UidPool::new(
            p.range(),
            store,
            t.path().join("workspaces"),
            t.path().join("baselines"),
        );
        assert_eq!(again.for_workspace("b").await.unwrap(), b);
        again.release("b").await.unwrap();
        assert_eq!(again.for_workspace("c").await.unwrap(), b);
    }

    /// An accepted job's workspace keeps its uid while its lease lives, though its
    /// directory does not exist yet; once the lease is gone the assignment can be
    /// reclaimed.
    #[tokio::test]
    async fn a_leased_workspace_keeps_its_uid_until_the_lease_ends() {
        if !rustix::process::geteuid().is_root() {
            return;
        }
        let (_t, p) = pool(UidRange::new(4_000_300, 1).unwrap()).await;
        let lease = p.lease("queued").await.unwrap();
        let again = p.lease("queued").await.unwrap();
        assert_eq!(lease.uid(), again.uid());
        drop(again);
        let none = time::Duration::ZERO;
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        assert_eq!(
            p.reclaim(none).await.unwrap(),
            0,
            "a leased assignment stays"
        );
        assert!(matches!(
            p.for_workspace("other").await,
            Err(UidError::Exhausted { .. })
        ));
        drop(lease);
        assert_eq!(
            p.reclaim(none).await.unwrap(),
            1,
            "then it can be reclaimed"
        );
    }

    /// A workspace made before the pool (owned by another uid) is given to its uid,
    /// contents and baseline included.
    #[tokio::test]
    async fn an_older_workspace_moves_to_its_uid() {
        if !rustix::process::geteuid().is_root() {
            return;
        }
        use std::os::unix::fs::{chown, MetadataExt};
        let (t, p) = pool(UidRange::new(4_000_200, 4).unwrap()).await;
        let ws = t.path().join("workspaces/old");
        let base = t.path().join("baselines/old");
        for d in [&ws, &base] {
            std::fs::create_dir_all(d.join("sub")).unwrap();
            std::fs::write(d.join("sub/f"), "x").unwrap();
            for p in [d.clone(), d.join("sub"), d.join("sub/f")] {
                chown(&p, Some(1000), Some(1000)).unwrap();
            }
        }
        let uid = p.for_workspace("old").await.unwrap();
        for d in [&ws, &base] {
            let m = std::fs::metadata(d.join("sub/f")).unwrap();
            assert_eq!((m.uid(), m.gid()), (uid, uid), "{}", d.display());
            assert_eq!(std::fs::metadata(d).unwrap().uid(), uid);
        }
    }
}
