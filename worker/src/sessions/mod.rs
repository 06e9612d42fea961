//! Session sandboxes (an extension of the Worker API): a sandbox that lives across several
//! commands of one task, for interactive agents. The HTTP routes are in
//! [`crate::http::sessions`]; this module knows no HTTP.
//!
//! - `POST /v1/worker/sessions` creates one (201; a repeat of a running session_id answers
//!   200 with it; an ended one 409), `GET /v1/worker/sessions/{id}` shows it,
//!   `POST …/{id}/exec` runs one command in it, `POST …/{id}/end` ends it (idempotent).
//! - The workspace of `workspace_id` (default `task_id`) is mounted at `/workspace` as for
//!   jobs, with the job sandbox's security flags and limits; it outlives the session.
//! - Podman/Docker run one keep-alive container per session (`cynode-session-<id>`,
//!   carrying the node label); bubblewrap runs each command as a fresh sandbox over the
//!   same workspace, so only the workspace persists between commands there. Each backend
//!   starts its own ([`crate::backend::SandboxBackend::start_session`]); see
//!   [`crate::backend::engine::session`] for how a timed-out command is killed in a
//!   container.
//! - One command at a time per session: a second concurrent exec answers 409. Every exec
//!   refreshes the idle timer, and a session is never idle while a command runs.
//! - A reaper task (every second) ends sessions past their idle timeout or max lifetime,
//!   and sessions whose container died, and removes their sandbox; a command still running
//!   then ends as failed. Ended sessions are remembered (409, idempotent end) for the
//!   node's `retention_seconds`.
//! - Sandbox env: the session's env, then the exec's, then `CYNODE_TASK_ID`,
//!   `CYNODE_JOB_ID` (= the session id), `CYNODE_SESSION_ID` and `CYNODE_WORKSPACE_DIR`
//!   (and the proxy variables for a session with egress), which requests cannot override.
//!   Sessions have no `/job` directory, so no artifacts.
//! - Network: none by default. `network_policy: restricted` (and `egress_allow`) is
//!   checked exactly as a job's ([`crate::job_egress::policy`]); the session then has the
//!   node's egress proxy at 127.0.0.1:3128 in its own network namespace: bound once for a
//!   keep-alive container, per command under bubblewrap ([`egress`]). Budgets are the
//!   session's; each exec's response lists that exec's attempts, `GET` the session's
//!   totals; the proxy closes when the session ends, however it ends.
//! - Inference: `use_inference: true` gives the session the node's inference listener at
//!   127.0.0.1:11434 in its own network namespace (`OPENAI_BASE_URL`, `OPENAI_API_KEY`,
//!   `OLLAMA_BASE_URL`), a command job's models and rules, bound as the egress proxy is
//!   ([`inference`]).
//! - A running session's state is in memory only: it does not survive a node restart. Its
//!   container carries the node label, so the restarted node's startup reconciliation
//!   (`remove_all_managed`) removes it, and it stops by itself a minute after its max
//!   lifetime. A suspended session is in the node's store and does survive ([`suspend`]);
//!   so do workspace snapshots ([`snapshot`]), and a session may start from one
//!   (`from_snapshot`).

mod egress;
mod error;
mod exec;
pub mod files;
mod inference;
mod reaper;
mod snapshot;
mod spec;
mod state;
pub mod stream;
mod suspend;
pub mod tree_hash;
mod validate;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cynode_protocol::time::format_rfc3339;
use cynode_protocol::worker_api::{check_id, API_VERSION};
use cynode_protocol::worker_sessions::{
    CreateSessionRequest, SessionEndReason, SessionInfo, SessionStatus,
};
use cynode_protocol::ValidationError;
use tokio_util::sync::CancellationToken;

pub use error::SessionError;
use spec::{container_name, sandbox_env, sandbox_spec};
use state::{Entry, Phase};
use validate::validate_create;

use crate::backend::{BackendError, SandboxBackend, SessionSandbox};
use crate::config::Config;
use crate::inference::Upstream;
use crate::job_egress::NodeEgress;
use egress::SessionNet;
use inference::SessionInference;

/// Idle timeout when the request gives none.
pub const DEFAULT_IDLE_TIMEOUT_SECONDS: u64 = 600;
/// Max lifetime when the request gives none (capped by `limits.max_timeout_seconds`).
pub const DEFAULT_MAX_LIFETIME_SECONDS: u64 = 3600;
/// Sessions that may be starting or running at once; more are refused with 503.
pub const MAX_ACTIVE_SESSIONS: usize = 32;
/// How often the reaper looks for expired sessions.
pub const REAP_INTERVAL: Duration = Duration::from_secs(1);

/// Why a session's sandbox did not start.
#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error("{0}")]
    Workspace(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("{0}")]
    Egress(String),
    #[error("{0}")]
    Inference(String),
}

struct Inner {
    cfg: Config,
    uids: Arc<crate::uid_pool::UidPool>,
    backend: Arc<dyn SandboxBackend>,
    /// The node's egress (`None`: egress off).
    egress: Option<Arc<NodeEgress>>,
    /// The node's inference upstream (`None`: none configured).
    inference: Option<Arc<Upstream>>,
    map: Mutex<HashMap<String, Entry>>,
    /// Streamed execs ([`stream`]).
    execs: stream::Execs,
    /// Where suspended sessions and snapshots are kept ([`Sessions::attach_store`]).
    store: std::sync::OnceLock<crate::store::Store>,
}

/// The node's sessions (in memory).
#[derive(Clone)]
pub struct Sessions {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions").finish_non_exhaustive()
    }
}

impl Sessions {
    /// No sessions yet, on `backend`; workspaces get their host uids from `uids`,
    /// sessions with `restricted` network a proxy of `egress`, and sessions with
    /// `use_inference` a listener of `inference`.
    pub fn new(
        cfg: &Config,
        backend: Arc<dyn SandboxBackend>,
        uids: Arc<crate::uid_pool::UidPool>,
        egress: Option<Arc<NodeEgress>>,
        inference: Option<Arc<Upstream>>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                uids,
                backend,
                egress,
                inference,
                cfg: cfg.clone(),
                map: Mutex::new(HashMap::new()),
                execs: stream::Execs::default(),
                store: std::sync::OnceLock::new(),
            }),
        }
    }

    fn with_entry<T>(
        &self,
        session_id: &str,
        f: impl FnOnce(&mut Entry) -> Result<T, SessionError>,
    ) -> Result<T, SessionError> {
        let mut map = self
            .inner
            .map
            .lock()
            .map_err(|_| SessionError::poisoned())?;
        let e = map
            .get_mut(session_id)
            .ok_or_else(|| SessionError::NotFound {
                session_id: session_id.to_string(),
            })?;
        f(e)
    }

    /// The egress proxy and inference listener a validated session `v` gets from the
    /// node (at its creation and at each resume): none where it asks for none; an error
    /// where the node lacks what it asks for.
    #[allow(clippy::type_complexity)]
    fn services(
        &self,
        v: &validate::Validated,
        session_id: &str,
    ) -> Result<(Option<Arc<SessionNet>>, Option<Arc<SessionInference>>), SessionError> {
        let cfg = &self.inner.cfg;
        let net = match (&v.egress, &self.inner.egress) {
            (None, _) => None,
            (Some(policy), Some(node)) => Some(SessionNet::new(
                Arc::clone(node),
                policy.clone(),
                session_id,
                v.models.is_some(),
            )),
            (Some(_), None) => {
                return Err(SessionError::Internal(
                    "the node's egress proxy is not running".into(),
                ))
            }
        };
        let inference = match (&v.models, &self.inner.inference) {
            (None, _) => None,
            (Some(_), Some(upstream)) if upstream.key_per_job() => {
                return Err(SessionError::Invalid(cynode_protocol::ValidationError::new(
                    "inference",
                    "this node's inference upstream takes a key per job (inference.key_per_job), which a session is never given",
                )))
            }
            (Some(models), Some(upstream)) => Some(SessionInference::new(
                session_id,
                models.clone(),
                Arc::clone(upstream),
                cfg.listener
                    .with_max_connections(cfg.limits.job_socket_connections),
            )),
            (Some(_), None) => {
                return Err(SessionError::Internal(
                    "the node's inference upstream is not configured".into(),
                ))
            }
        };
        Ok((net, inference))
    }

    /// Creates and starts a session; `true` when new, `false` for a repeat of a running one.
    pub async fn create(
        &self,
        req: CreateSessionRequest,
    ) -> Result<(bool, SessionInfo), SessionError> {
        let cfg = &self.inner.cfg;
        let v = validate_create(cfg, &req)?;
        // A session with the node's models hosts an agent: its image must say it can.
        if v.models.is_some() {
            crate::backend::image_labels::check_agent_image(cfg, &req.image, "image").await?;
        }
        let (net, inference) = self.services(&v, &req.session_id)?;
        if let Some(existing) = self.repeat(&req)? {
            return Ok((false, existing));
        }
        if !self.inner.backend.has_image(&req.image).await {
            return Err(SessionError::Invalid(ValidationError::new(
                "image",
                format!("image `{}` is not available on this node", req.image),
            )));
        }
        let workspace = cfg.workspaces_dir().join(&v.workspace_id);
        // From a snapshot: the new workspace is made now, before its uid settles its owner.
        let workspace_copy = match &req.from_snapshot {
            Some(id) => Some(
                self.workspace_from_snapshot(id, &req.task_id, &v.workspace_id)
                    .await?,
            ),
            None => None,
        };
        // The workspace's own host uid (its directory made, owned by it): 503 when none.
        let host_uid = self.inner.uids.for_workspace(&v.workspace_id).await?;
        let now = time::OffsetDateTime::now_utc();
        let lifetime = Duration::from_secs(v.lifetime);
        let info = SessionInfo {
            version: API_VERSION,
            session_id: req.session_id.clone(),
            task_id: req.task_id.clone(),
            workspace_id: v.workspace_id.clone(),
            image: req.image.clone(),
            status: SessionStatus::Running,
            created_at: format_rfc3339(now),
            expires_at: format_rfc3339(now + lifetime),
            idle_timeout_seconds: v.idle,
            max_lifetime_seconds: v.lifetime,
            ended_at: None,
            end_reason: None,
            egress: net.as_ref().map(|_| Default::default()),
            workspace_copy,
        };
        {
            let mut map = self
                .inner
                .map
                .lock()
                .map_err(|_| SessionError::poisoned())?;
            if map.contains_key(&req.session_id) {
                drop(map);
                return self
                    .repeat(&req)?
                    .map(|i| (false, i))
                    .ok_or_else(|| SessionError::Internal("session vanished".into()));
            }
            let active = map
                .values()
                .filter(|e| !matches!(e.phase, Phase::Ended { .. }))
                .count();
            if active >= MAX_ACTIVE_SESSIONS {
                return Err(SessionError::TooMany);
            }
            let started = Instant::now();
            map.insert(
                req.session_id.clone(),
                Entry {
                    info: info.clone(),
                    phase: Phase::Starting,
                    env: req.env.clone(),
                    workspace: workspace.clone(),
                    host_uid,
                    deadline: started + lifetime,
                    idle: Duration::from_secs(v.idle),
                    last_activity: started,
                    busy: false,
                    cancel: CancellationToken::new(),
                    seq: 0,
                    net: net.clone(),
                    inference: inference.clone(),
                    network: (req.network_policy, req.egress_allow.clone()),
                    on_idle: req.on_idle.unwrap_or_default(),
                    request: req.clone(),
                    suspending: false,
                },
            );
        }
        // In its own task: a client that goes away must not leave the session half made.
        let this = self.clone();
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
            let Ok(mut map) = this.inner.map.lock() else {
                if let Ok(sb) = started {
                    sb.stop().await;
                }
                return Err(SessionError::poisoned());
            };
            match started {
                Ok(sandbox) => {
                    if let Some(e) = map.get_mut(&req.session_id) {
                        e.phase = Phase::Running(sandbox);
                        e.last_activity = Instant::now();
                    }
                    tracing::info!(session_id = %info.session_id, task_id = %info.task_id, image = %info.image, idle_timeout_seconds = v.idle, max_lifetime_seconds = v.lifetime, egress = net.is_some(), "session started");
                    Ok((true, info))
                }
                Err(e) => {
                    map.remove(&req.session_id);
                    Err(SessionError::Internal(format!(
                        "cannot start session {}: {e}",
                        req.session_id
                    )))
                }
            }
        });
        task.await
            .map_err(|e| SessionError::Internal(format!("session start task failed: {e}")))?
    }

    async fn start_sandbox(
        &self,
        info: &SessionInfo,
        env: &BTreeMap<String, String>,
        (workspace, host_uid): (PathBuf, u32),
        net: Option<&SessionNet>,
        inference: Option<&SessionInference>,
    ) -> Result<Arc<dyn SessionSandbox>, StartError> {
        // Owned by the workspace's uid, as jobs make it; an existing workspace is kept.
        if !workspace.exists() {
            crate::workspace::make_workspace(&workspace, host_uid).map_err(|e| {
                StartError::Workspace(format!(
                    "cannot prepare workspace {}: {e}",
                    workspace.display()
                ))
            })?;
        }
        let spec = sandbox_spec(
            &self.inner.cfg,
            container_name(&info.session_id),
            info,
            (workspace, host_uid),
            Vec::new(),
            sandbox_env(
                info,
                env,
                &BTreeMap::new(),
                net.is_some(),
                inference.map(SessionInference::token),
            ),
            Duration::from_secs(info.max_lifetime_seconds),
            net.is_some(),
        );
        let sandbox = self.inner.backend.start_session(&spec).await?;
        // A sandbox that keeps one network namespace for the session's life gets the
        // proxy there now, before any command runs; otherwise each command binds its own.
        if let (Some(net), Some(pid)) = (net, sandbox.netns_pid()) {
            if let Err(e) = net.bind_whole(pid).await {
                sandbox.stop().await;
                return Err(StartError::Egress(e));
            }
        }
        if let (Some(inference), Some(pid)) = (inference, sandbox.netns_pid()) {
            if let Err(e) = inference.bind_whole(pid).await {
                if let Some(net) = net {
                    net.finish().await;
                }
                sandbox.stop().await;
                return Err(StartError::Inference(e));
            }
        }
        Ok(sandbox)
    }

    /// The answer to a repeated create, if the session exists.
    fn repeat(&self, req: &CreateSessionRequest) -> Result<Option<SessionInfo>, SessionError> {
        let map = self
            .inner
            .map
            .lock()
            .map_err(|_| SessionError::poisoned())?;
        let Some(e) = map.get(&req.session_id) else {
            return Ok(None);
        };
        let id = &req.session_id;
        match e.phase {
            Phase::Starting => Err(SessionError::Conflict(format!(
                "session {id} is being created; retry"
            ))),
            Phase::Ended { .. } => Err(SessionError::Conflict(format!("session {id} has ended"))),
            Phase::Running(_) | Phase::Suspended { .. }
                if e.info.task_id != req.task_id
                    || e.info.image != req.image
                    || e.network != (req.network_policy, req.egress_allow.clone()) =>
            {
                Err(SessionError::Conflict(format!(
                    "session {id} exists with another task_id, image or network"
                )))
            }
            Phase::Running(_) | Phase::Suspended { .. } => Ok(Some(e.current())),
        }
    }

    /// The session as it stands.
    pub fn show(&self, session_id: &str) -> Result<SessionInfo, SessionError> {
        check_id("session_id", session_id)?;
        self.with_entry(session_id, |e| Ok(e.current()))
    }

    /// Ends the session and removes its sandbox; ending an ended session answers it again.
    pub async fn end(&self, session_id: &str) -> Result<SessionInfo, SessionError> {
        check_id("session_id", session_id)?;
        let (mut info, sandbox, net, was_suspended) =
            self.with_entry(session_id, |e| match e.phase {
                Phase::Starting => Err(SessionError::Conflict(format!(
                    "session {session_id} is being created; retry"
                ))),
                _ => {
                    let was_suspended = matches!(e.phase, Phase::Suspended { .. });
                    let sb = e.end(SessionEndReason::Requested);
                    Ok((e.info.clone(), sb, e.net.clone(), was_suspended))
                }
            })?;
        if was_suspended {
            self.forget_suspended(session_id).await;
        }
        if let Some(sb) = sandbox {
            // In its own task, so the sandbox is removed even if the client goes away.
            tokio::spawn(async move { sb.stop().await })
                .await
                .map_err(|e| SessionError::Internal(format!("session removal failed: {e}")))?;
        }
        // With the egress totals as they stand once the proxy closed.
        info.egress = net.map(|n| n.info());
        Ok(info)
    }
}
