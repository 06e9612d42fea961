//! Suspend and resume: a suspended session's sandbox is stopped, and everything else is
//! kept: its workspace (its volume stays mounted, and a restarted node mounts it again),
//! its env, its network policy and egress allowlist, its inference grant and the rest of
//! its create request, and the max lifetime it had left (suspended time does not count).
//!
//! - `:suspend` answers the session with `status: suspended` once its sandbox is gone
//!   and its record is in the node's store (`suspended_sessions`), so a node restarted,
//!   cleanly or after a kill -9, loads it again as suspended ([`Sessions::restore`]).
//!   A session running a command is not suspended (409): every exec that answered has
//!   its writes in the workspace, and none is cut in the middle.
//! - `:resume` checks the stored request again (the node's policy may have changed),
//!   starts a new sandbox over the same workspace (a bwrap session's next command does),
//!   binds a new egress proxy and inference listener, and answers `status: running`.
//!   Resuming a running session and suspending a suspended one answer it as it is.
//! - An exec on a suspended session is refused (409, `session_suspended`): a client
//!   resumes on purpose, never by accident.
//! - `{"memory": true}` (keep the processes) is refused with `memory_suspend_unsupported`
//!   on every backend: it needs a checkpoint of the sandbox's processes (Podman with CRIU),
//!   which the node does not do; it is never downgraded to a filesystem suspend.
//! - `on_idle: suspend` makes the reaper suspend an idle session instead of ending it.
//!   A suspended session not resumed within `session_state.suspended_retention_seconds`
//!   ends (its workspace stays, as every ended session's does).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cynode_protocol::worker_api::check_id;
use cynode_protocol::worker_session_state::{
    SuspendRequest, MEMORY_SUSPEND_UNSUPPORTED, SESSION_SUSPENDED,
};
use cynode_protocol::worker_sessions::{SessionEndReason, SessionInfo, SessionStatus};
use cynode_protocol::ValidationError;
use tokio_util::sync::CancellationToken;

use super::egress::SessionNet;
use super::inference::SessionInference;
use super::state::{Entry, Phase};
use super::validate::validate_create;
use super::{SessionError, Sessions};
use crate::store::Store;

/// The message of an exec on a suspended session.
pub(super) fn suspended_conflict(session_id: &str) -> SessionError {
    SessionError::Conflict(format!(
        "{SESSION_SUSPENDED}: session {session_id} is suspended; resume it first"
    ))
}

impl Sessions {
    /// Gives the sessions the node's store, where suspended sessions and snapshots are
    /// kept. Without it, suspend and snapshots answer 500.
    pub fn attach_store(&self, store: Store) {
        let _ = self.inner.store.set(store);
    }

    pub(super) fn store(&self) -> Result<&Store, SessionError> {
        self.inner
            .store
            .get()
            .ok_or_else(|| SessionError::Internal("the session store is not attached".into()))
    }

    /// Loads the suspended sessions a previous run of the node left (after a restart or a
    /// kill), each as it was suspended; how many. Snapshots past their retention go.
    pub async fn restore(&self) -> Result<usize, SessionError> {
        let store = self.store()?.clone();
        let rows = store.suspended().await.map_err(store_err)?;
        let mut loaded = 0;
        for (req, mut info, remaining) in rows {
            let workspace = self.inner.cfg.workspaces_dir().join(&info.workspace_id);
            let host_uid = match self.inner.uids.for_workspace(&info.workspace_id).await {
                Ok(uid) => uid,
                Err(e) => {
                    tracing::warn!(session_id = %info.session_id, error = %e, "a suspended session cannot be loaded again");
                    continue;
                }
            };
            info.status = SessionStatus::Suspended;
            let now = Instant::now();
            let entry = Entry {
                phase: Phase::Suspended {
                    since: now,
                    remaining: Duration::from_secs(remaining),
                },
                env: req.env.clone(),
                workspace,
                host_uid,
                deadline: now + Duration::from_secs(remaining),
                idle: Duration::from_secs(info.idle_timeout_seconds),
                last_activity: now,
                busy: false,
                cancel: CancellationToken::new(),
                seq: 0,
                net: None,
                inference: None,
                suspending: false,
                network: (req.network_policy, req.egress_allow.clone()),
                on_idle: req.on_idle.unwrap_or_default(),
                request: req,
                info,
            };
            let mut map = self
                .inner
                .map
                .lock()
                .map_err(|_| SessionError::poisoned())?;
            map.insert(entry.info.session_id.clone(), entry);
            loaded += 1;
        }
        if loaded > 0 {
            tracing::info!(sessions = loaded, "suspended sessions loaded again");
        }
        self.expire_snapshots().await;
        self.remove_unrecorded_snapshots().await;
        Ok(loaded)
    }

    /// Suspends the session: its sandbox stops; the rest is kept for [`Sessions::resume`].
    pub async fn suspend(
        &self,
        session_id: &str,
        req: SuspendRequest,
    ) -> Result<SessionInfo, SessionError> {
        check_id("session_id", session_id)?;
        if req.memory {
            return Err(SessionError::Invalid(ValidationError::new(
                "memory",
                format!(
                    "{MEMORY_SUSPEND_UNSUPPORTED}: this node cannot checkpoint the processes of a \
                     {} sandbox; suspend without `memory` keeps the workspace only",
                    self.inner.cfg.backend.as_str()
                ),
            )));
        }
        let store = self.store()?.clone();
        // Marked busy and suspending while its sandbox stops: no exec, snapshot or reaper
        // end meanwhile; `suspended` is answered (and shown) once the sandbox is gone.
        let taken = self.with_entry(session_id, |e| match &e.phase {
            Phase::Suspended { .. } => Ok(None),
            Phase::Starting => Err(SessionError::Conflict(format!(
                "session {session_id} is being created or resumed; retry"
            ))),
            Phase::Ended { .. } => Err(SessionError::Conflict(format!(
                "session {session_id} has ended"
            ))),
            Phase::Running(_) if e.busy => Err(SessionError::Conflict(format!(
                "session {session_id} is running a command, a snapshot or a suspend; retry \
                 once that ends"
            ))),
            Phase::Running(sandbox) => {
                let remaining = e.deadline.saturating_duration_since(Instant::now());
                let sandbox = Arc::clone(sandbox);
                e.busy = true;
                e.suspending = true;
                e.cancel.cancel();
                if let Some(i) = e.inference.take() {
                    i.finish();
                }
                let mut info = e.info.clone();
                info.status = SessionStatus::Suspended;
                info.egress = None;
                Ok(Some((
                    sandbox,
                    e.net.take(),
                    e.request.clone(),
                    info,
                    remaining,
                )))
            }
        })?;
        let Some((sandbox, net, request, info, remaining)) = taken else {
            return self.show(session_id);
        };
        // Recorded before the sandbox goes: a node killed from here on knows the session.
        let stored = store
            .put_suspended(&request, &info, remaining.as_secs())
            .await
            .map_err(store_err);
        // In its own task, so the sandbox is removed even if the client goes away.
        let this = self.clone();
        let id = session_id.to_string();
        tokio::spawn(async move {
            if let Some(net) = net {
                net.finish().await;
            }
            sandbox.stop().await;
            // Ended meanwhile (`…/end`, its lifetime): it stays ended, and is not stored.
            let ended = this.with_entry(&id, |e| {
                let suspending = std::mem::take(&mut e.suspending);
                if !suspending || !matches!(e.phase, Phase::Running(_)) {
                    return Ok(true);
                }
                e.phase = Phase::Suspended {
                    since: Instant::now(),
                    remaining,
                };
                e.info.status = SessionStatus::Suspended;
                e.busy = false;
                Ok(false)
            });
            if ended.unwrap_or(true) {
                this.forget_suspended(&id).await;
            }
        })
        .await
        .map_err(|e| SessionError::Internal(format!("session suspend failed: {e}")))?;
        stored?;
        tracing::info!(session_id, task_id = %info.task_id, remaining_seconds = remaining.as_secs(), "session suspended");
        // As it stands now (ended, if it was ended meanwhile).
        self.show(session_id)
    }

    /// Resumes a suspended session: a new sandbox over the same workspace, with the
    /// session's env, network and inference as created.
    pub async fn resume(&self, session_id: &str) -> Result<SessionInfo, SessionError> {
        check_id("session_id", session_id)?;
        let store = self.store()?.clone();
        let taken = self.with_entry(session_id, |e| match e.phase {
            Phase::Running(_) => Ok(None),
            Phase::Starting => Err(SessionError::Conflict(format!(
                "session {session_id} is being created or resumed; retry"
            ))),
            Phase::Ended { .. } => Err(SessionError::Conflict(format!(
                "session {session_id} has ended"
            ))),
            Phase::Suspended { .. } if e.busy => Err(SessionError::Conflict(format!(
                "session {session_id} is being snapshotted; retry"
            ))),
            Phase::Suspended { since, remaining } => {
                e.phase = Phase::Starting;
                Ok(Some((
                    since,
                    remaining,
                    e.request.clone(),
                    e.info.clone(),
                    e.workspace.clone(),
                    e.host_uid,
                )))
            }
        })?;
        let Some((since, remaining, req, mut info, workspace, host_uid)) = taken else {
            return self.show(session_id);
        };
        let back_to_suspended = |this: &Sessions| {
            let _ = this.with_entry(session_id, |e| {
                e.phase = Phase::Suspended { since, remaining };
                Ok(())
            });
        };
        let attachments = self.attachments(&req, &workspace);
        let (net, inference) = match attachments {
            Ok(a) => a,
            Err(e) => {
                back_to_suspended(self);
                return Err(e);
            }
        };
        info.status = SessionStatus::Running;
        let this = self.clone();
        let id = session_id.to_string();
        let task = tokio::spawn(async move {
            let started = this
                .start_sandbox(
                    &info,
                    &req.env,
                    (workspace, host_uid),
                    net.as_deref(),
                    inference.as_deref(),
                )
                .await;
            let sandbox = match started {
                Ok(sb) => sb,
                Err(e) => {
                    return Err(SessionError::Internal(format!(
                        "cannot resume session {id}: {e}"
                    )))
                }
            };
            let kept = this.with_entry(&id, |e| {
                let now = Instant::now();
                e.phase = Phase::Running(Arc::clone(&sandbox));
                e.info.status = SessionStatus::Running;
                e.deadline = now + remaining;
                e.last_activity = now;
                e.cancel = CancellationToken::new();
                e.net = net.clone();
                e.inference = inference.clone();
                Ok(e.current())
            });
            if kept.is_err() {
                sandbox.stop().await;
            }
            kept
        });
        let resumed = task
            .await
            .map_err(|e| SessionError::Internal(format!("session resume task failed: {e}")))
            .and_then(|r| r);
        match resumed {
            Ok(info) => {
                store
                    .delete_suspended(session_id)
                    .await
                    .map_err(store_err)?;
                tracing::info!(session_id, task_id = %info.task_id, "session resumed");
                Ok(info)
            }
            Err(e) => {
                back_to_suspended(self);
                Err(e)
            }
        }
    }

    /// The egress proxy and inference listener of the session `req` created, checked
    /// again against the node's configuration now; the workspace must be there, on its
    /// volume.
    #[allow(clippy::type_complexity)]
    fn attachments(
        &self,
        req: &cynode_protocol::worker_sessions::CreateSessionRequest,
        workspace: &std::path::Path,
    ) -> Result<(Option<Arc<SessionNet>>, Option<Arc<SessionInference>>), SessionError> {
        let cfg = &self.inner.cfg;
        if std::fs::symlink_metadata(workspace).is_err() {
            return Err(SessionError::Conflict(format!(
                "the workspace of session {} is gone",
                req.session_id
            )));
        }
        if let Some(image) = crate::loopfs::unmounted_image(workspace) {
            return Err(SessionError::Internal(format!(
                "the workspace's volume {} is not mounted",
                image.display()
            )));
        }
        let v = validate_create(cfg, req)?;
        self.services(&v, &req.session_id)
    }

    /// Forgets the stored record of a session that ended while suspended.
    pub(super) async fn forget_suspended(&self, session_id: &str) {
        if let Ok(store) = self.store() {
            if let Err(e) = store.delete_suspended(session_id).await {
                tracing::warn!(session_id, error = %e, "cannot forget a suspended session");
            }
        }
    }

    /// Ends the suspended sessions past `session_state.suspended_retention_seconds`
    /// (the reaper's part); their ids.
    pub(super) fn expired_suspended(
        &self,
        map: &mut std::collections::HashMap<String, Entry>,
    ) -> Vec<String> {
        let keep = Duration::from_secs(self.inner.cfg.session_state.suspended_retention_seconds);
        let now = Instant::now();
        let mut out = Vec::new();
        for (id, e) in map.iter_mut() {
            if let Phase::Suspended { since, .. } = e.phase {
                if !e.busy && now >= since + keep {
                    e.end(SessionEndReason::IdleTimeout);
                    out.push(id.clone());
                }
            }
        }
        out
    }
}

pub(super) fn store_err(e: crate::store::StoreError) -> SessionError {
    SessionError::Internal(format!("session store: {e}"))
}
