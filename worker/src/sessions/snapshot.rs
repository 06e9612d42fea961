//! Snapshots of a session's workspace and sessions started from one.
//!
//! - `POST …/{id}/snapshots` takes one of a running or suspended session: no command may
//!   run meanwhile (the session is marked busy: an exec, a suspend or a resume answers
//!   409 until it is done); its volume's filesystem is frozen, the workspace's tree hash
//!   is computed while it is ([`super::tree_hash`], beneath-safe and bounded), so it is
//!   the hash of the copy, and the image is copied
//!   ([`crate::loopfs::snapshot::snapshot_volume`]), into
//!   `<state>/snapshots/<id>.img`, and recorded in the store. The id is `snap-` and 122
//!   random bits: unguessable.
//! - A task's snapshots together hold at most `session_state.snapshot_budget_mb` of disk
//!   and number at most `session_state.max_snapshots_per_task`; past either a snapshot is
//!   refused (409, `snapshot_budget_exceeded`); deleting one frees its bytes. Each is
//!   deleted `session_state.snapshot_retention_seconds` after it was taken (the reaper).
//! - `POST /v1/worker/sessions {"from_snapshot": ID}` makes the new session's workspace
//!   (which must not exist) a volume whose image is a copy of the snapshot's
//!   ([`crate::loopfs::snapshot::volume_from`]): a clone where the node's filesystem can
//!   (`reflink`), else a copy of its data extents (`copy`), as the session's
//!   `workspace_copy` says. Two sessions from one snapshot share nothing. A snapshot is
//!   its task's: another task's id is not found (404), as an unknown one.
//! - A workspace that is no volume (a node without disk volumes) cannot be snapshotted
//!   (`snapshot_unsupported`); one whose tree passes the hash's bounds (a 20,000-deep
//!   tree) neither (`workspace_unhashable`), and nothing is written.

use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use cynode_protocol::time::format_rfc3339;
use cynode_protocol::worker_api::{check_id, API_VERSION};
use cynode_protocol::worker_session_state::{
    SnapshotInfo, WorkspaceCopy, SNAPSHOT_BUDGET_EXCEEDED, SNAPSHOT_UNSUPPORTED,
    WORKSPACE_UNHASHABLE,
};
use cynode_protocol::ValidationError;
use rustix::fs::{self as rfs, Mode};

use super::state::Phase;
use super::suspend::store_err;
use super::tree_hash::{tree_hash, Bounds};
use super::{SessionError, Sessions};
use crate::loopfs::snapshot::{snapshot_volume, volume_from, CopyKind, SnapshotError};

/// The snapshot id's prefix.
const PREFIX: &str = "snap-";

fn copy_kind(k: CopyKind) -> WorkspaceCopy {
    match k {
        CopyKind::Reflink => WorkspaceCopy::Reflink,
        CopyKind::Copy => WorkspaceCopy::Copy,
    }
}

fn not_found(snapshot_id: &str) -> SessionError {
    SessionError::SnapshotNotFound {
        snapshot_id: snapshot_id.to_string(),
    }
}

impl Sessions {
    /// The bound on an image's size: the node's volumes are `limits.disk_mb` (1.05 × at
    /// most); twice that leaves room and still bounds the copy.
    fn image_bound(&self) -> u64 {
        self.inner.cfg.limits.disk_mb.saturating_mul(2 << 20)
    }

    fn snapshot_path(&self, snapshot_id: &str) -> PathBuf {
        self.inner
            .cfg
            .snapshots_dir()
            .join(format!("{snapshot_id}.img"))
    }

    /// Takes a snapshot of the session's workspace.
    pub async fn snapshot(&self, session_id: &str) -> Result<SnapshotInfo, SessionError> {
        check_id("session_id", session_id)?;
        let (workspace, info) = self.with_entry(session_id, |e| match e.phase {
            Phase::Running(_) | Phase::Suspended { .. } if e.busy => {
                Err(SessionError::Conflict(format!(
                    "session {session_id} is running a command or a snapshot; retry once it ends"
                )))
            }
            Phase::Running(_) | Phase::Suspended { .. } => {
                e.busy = true;
                Ok((e.workspace.clone(), e.info.clone()))
            }
            Phase::Starting => Err(SessionError::Conflict(format!(
                "session {session_id} is being created or resumed; retry"
            ))),
            Phase::Ended { .. } => Err(SessionError::Conflict(format!(
                "session {session_id} has ended"
            ))),
        })?;
        let taken = self.take_snapshot(workspace, &info).await;
        let _ = self.with_entry(session_id, |e| {
            e.busy = false;
            e.last_activity = Instant::now();
            Ok(())
        });
        taken
    }

    async fn take_snapshot(
        &self,
        workspace: PathBuf,
        info: &cynode_protocol::worker_sessions::SessionInfo,
    ) -> Result<SnapshotInfo, SessionError> {
        let store = self.store()?.clone();
        let st = &self.inner.cfg.session_state;
        if !crate::loopfs::is_volume(&workspace) {
            return Err(SessionError::Conflict(format!(
                "{SNAPSHOT_UNSUPPORTED}: the workspace is not a disk volume on this node"
            )));
        }
        // What the copy will hold at most: the image's allocated blocks now.
        let estimate = crate::loopfs::image_of(&workspace)
            .and_then(|fd| rfs::fstat(fd).ok())
            .map_or(0, |s| {
                u64::try_from(s.st_blocks).unwrap_or(0).saturating_mul(512)
            });
        let (count, used) = store
            .snapshot_usage_of_task(&info.task_id)
            .await
            .map_err(store_err)?;
        let budget = st.snapshot_budget_mb.saturating_mul(1 << 20);
        if count >= st.max_snapshots_per_task || used.saturating_add(estimate) > budget {
            return Err(SessionError::Conflict(format!(
                "{SNAPSHOT_BUDGET_EXCEEDED}: task {} holds {count} snapshots of {used} bytes; \
                 another of about {estimate} bytes would pass its budget of {} snapshots and \
                 {budget} bytes",
                info.task_id, st.max_snapshots_per_task
            )));
        }
        let snapshot_id = format!("{PREFIX}{}", uuid::Uuid::new_v4().simple());
        let dir = self.inner.cfg.snapshots_dir();
        let max = self.image_bound();
        let name = format!("{snapshot_id}.img");
        let (hash, copied) = tokio::task::spawn_blocking(move || {
            let dir_fd = snapshots_dir(&dir)?;
            // The hash is taken while the volume is frozen: it is the hash of the copy.
            let hashed = || {
                tree_hash(&workspace, Bounds::default()).map_err(|e| {
                    SessionError::Invalid(ValidationError::new(
                        "workspace",
                        format!("{WORKSPACE_UNHASHABLE}: {e}"),
                    ))
                })
            };
            let (copied, hash) =
                snapshot_volume(&workspace, dir_fd.as_fd(), OsStr::new(&name), max, hashed)
                    .map_err(|e| match e {
                        SnapshotError::NotAVolume(m) => {
                            SessionError::Conflict(format!("{SNAPSHOT_UNSUPPORTED}: {m}"))
                        }
                        e => SessionError::Internal(format!("cannot copy the workspace: {e}")),
                    })??;
            Ok::<_, SessionError>((hash, copied))
        })
        .await
        .map_err(|e| SessionError::Internal(format!("snapshot task failed: {e}")))??;
        // The copy's real size (the estimate misses what was not yet written to the image).
        if used.saturating_add(copied.bytes) > budget {
            let _ = std::fs::remove_file(self.snapshot_path(&snapshot_id));
            return Err(SessionError::Conflict(format!(
                "{SNAPSHOT_BUDGET_EXCEEDED}: task {} holds {used} bytes of snapshots; this one \
                 of {} bytes would pass its budget of {budget} bytes",
                info.task_id, copied.bytes
            )));
        }
        let now = time::OffsetDateTime::now_utc();
        let snap = SnapshotInfo {
            version: API_VERSION,
            snapshot_id: snapshot_id.clone(),
            session_id: info.session_id.clone(),
            task_id: info.task_id.clone(),
            workspace_id: info.workspace_id.clone(),
            tree_hash: hash,
            bytes: copied.bytes,
            copy: copy_kind(copied.how),
            created_at: format_rfc3339(now),
            expires_at: format_rfc3339(now + Duration::from_secs(st.snapshot_retention_seconds)),
        };
        if let Err(e) = store.insert_snapshot(&snap).await {
            let _ = std::fs::remove_file(self.snapshot_path(&snapshot_id));
            return Err(store_err(e));
        }
        tracing::info!(snapshot_id = %snap.snapshot_id, session_id = %snap.session_id, task_id = %snap.task_id, bytes = snap.bytes, copy = ?copied.how, "workspace snapshot taken");
        Ok(snap)
    }

    /// The snapshots of a session (known to the node, running, suspended or ended).
    pub async fn snapshots(&self, session_id: &str) -> Result<Vec<SnapshotInfo>, SessionError> {
        check_id("session_id", session_id)?;
        self.with_entry(session_id, |_| Ok(()))?;
        self.store()?
            .snapshots_of(session_id)
            .await
            .map_err(store_err)
    }

    /// Deletes a snapshot: its image and its record.
    pub async fn delete_snapshot(&self, snapshot_id: &str) -> Result<(), SessionError> {
        check_id("snapshot_id", snapshot_id)?;
        let store = self.store()?;
        if store
            .snapshot(snapshot_id)
            .await
            .map_err(store_err)?
            .is_none()
        {
            return Err(not_found(snapshot_id));
        }
        self.remove_snapshot(snapshot_id).await
    }

    async fn remove_snapshot(&self, snapshot_id: &str) -> Result<(), SessionError> {
        match std::fs::remove_file(self.snapshot_path(snapshot_id)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(SessionError::Internal(format!(
                    "cannot remove snapshot {snapshot_id}: {e}"
                )))
            }
        }
        self.store()?
            .delete_snapshot(snapshot_id)
            .await
            .map_err(store_err)?;
        tracing::info!(snapshot_id, "workspace snapshot deleted");
        Ok(())
    }

    /// Deletes the snapshots past their retention (the reaper's part).
    pub(super) async fn expire_snapshots(&self) {
        let Ok(store) = self.store() else { return };
        let now = cynode_protocol::time::now_rfc3339();
        let Ok(ids) = store.expired_snapshots(&now).await else {
            return;
        };
        for id in ids {
            if let Err(e) = self.remove_snapshot(&id).await {
                tracing::warn!(snapshot_id = %id, error = %e, "cannot delete an expired snapshot");
            }
        }
    }

    /// Removes snapshot images no record names (a node killed between the copy and the
    /// record).
    pub(super) async fn remove_unrecorded_snapshots(&self) {
        let Ok(store) = self.store() else { return };
        let Ok(ids) = store.snapshot_ids().await else {
            return;
        };
        let Ok(entries) = std::fs::read_dir(self.inner.cfg.snapshots_dir()) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let id = name.strip_suffix(".img").unwrap_or(&name);
            if !ids.iter().any(|k| k == id) {
                tracing::info!(file = %name, "removing a snapshot image no record names");
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    /// Makes the workspace `workspace_id` (new) from the snapshot `snapshot_id` of task
    /// `task_id`; how its image was copied.
    pub(super) async fn workspace_from_snapshot(
        &self,
        snapshot_id: &str,
        task_id: &str,
        workspace_id: &str,
    ) -> Result<WorkspaceCopy, SessionError> {
        check_id("from_snapshot", snapshot_id)?;
        let snap = self
            .store()?
            .snapshot(snapshot_id)
            .await
            .map_err(store_err)?
            .filter(|s| s.task_id == task_id)
            .ok_or_else(|| not_found(snapshot_id))?;
        let image = self.snapshot_path(&snap.snapshot_id);
        let parent = self.inner.cfg.workspaces_dir();
        let ws = workspace_id.to_string();
        let max = self.image_bound();
        let how = tokio::task::spawn_blocking(move || {
            // The workspace-creation lock, as a job's or a seed's creation holds it: a
            // job or session making the same workspace sees the fork's volume whole or
            // not at all.
            let _creating = crate::workspace::creation_lock(&parent.join(&ws));
            let parent_fd = crate::fd_walk::open_node_dir(&parent)
                .map_err(|e| SessionError::Internal(format!("cannot open the workspaces: {e}")))?;
            let label = crate::loopfs::workspace_label(OsStr::new(&ws));
            volume_from(&image, parent_fd.as_fd(), OsStr::new(&ws), &label, max).map_err(
                |e| match e {
                    SnapshotError::Exists(_) => SessionError::Conflict(format!(
                        "workspace {ws} exists: a session from a snapshot needs a new workspace_id"
                    )),
                    SnapshotError::NotAVolume(m) => {
                        SessionError::Conflict(format!("{SNAPSHOT_UNSUPPORTED}: {m}"))
                    }
                    e => SessionError::Internal(format!("cannot copy the snapshot: {e}")),
                },
            )
        })
        .await
        .map_err(|e| SessionError::Internal(format!("fork task failed: {e}")))??;
        tracing::info!(snapshot_id, workspace_id, copy = ?how, "workspace made from a snapshot");
        Ok(copy_kind(how))
    }
}

/// The snapshots directory, made (0700, the node's) when missing, opened.
fn snapshots_dir(dir: &std::path::Path) -> Result<std::os::fd::OwnedFd, SessionError> {
    match rfs::mkdir(dir, Mode::from_raw_mode(0o700)) {
        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
        Err(e) => {
            return Err(SessionError::Internal(format!(
                "cannot make {}: {e}",
                dir.display()
            )))
        }
    }
    crate::fd_walk::open_node_dir(dir)
        .map_err(|e| SessionError::Internal(format!("cannot open {}: {e}", dir.display())))
}
