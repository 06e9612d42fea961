//! Session sandboxes (an extension of the Worker API): a sandbox that lives across several
//! commands of one task, for interactive agents.
//!
//! - `POST /v1/worker/sessions` creates one (201; a repeat of a running session_id answers
//!   200 with it; an ended one 409), `GET /v1/worker/sessions/{id}` shows it,
//!   `POST …/{id}/exec` runs one command in it, `POST …/{id}/end` ends it (idempotent).
//! - The workspace of `workspace_id` (default `task_id`) is mounted at `/workspace` as for
//!   jobs, with the job sandbox's security flags and limits; it outlives the session.
//! - Podman/Docker run one keep-alive container per session (`cynode-session-<id>`,
//!   carrying the node label); bubblewrap runs each command as a fresh sandbox over the
//!   same workspace, so only the workspace persists between commands there. See
//!   [`crate::backend::session_ops`] for both, and for how a timed-out command is killed.
//! - One command at a time per session: a second concurrent exec answers 409. Every exec
//!   refreshes the idle timer, and a session is never idle while a command runs.
//! - A reaper task (every second) ends sessions past their idle timeout or max lifetime,
//!   and sessions whose container died, and removes their sandbox; a command still running
//!   then ends as failed. Ended sessions are remembered (409, idempotent end) for the
//!   node's `retention_seconds`.
//! - Sandbox env: the session's env, then the exec's, then `CYNODE_TASK_ID`,
//!   `CYNODE_JOB_ID` (= the session id), `CYNODE_SESSION_ID` and `CYNODE_WORKSPACE_DIR`,
//!   which requests cannot override. Sessions have no `/job` directory, so no artifacts.
//! - Session state is in memory only: sessions do not survive a node restart. Their
//!   containers carry the node label, so the restarted node's startup reconciliation
//!   (`remove_all_managed`) removes them, and they stop by themselves a minute after their
//!   max lifetime if it never restarts; bubblewrap commands die with the node.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cynode_protocol::worker_api::{
    check_id, NetworkPolicy, Truncated, WorkerJobStatus, API_VERSION, RESERVED_ENV,
};
use cynode_protocol::ValidationError;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::api::{ApiError, StrictJson};
use crate::backend::session_ops::{SessionOps, SessionSandbox};
use crate::backend::{Backend, EndReason, Mount, ResourceLimits, SandboxSpec};
use crate::config::Config;
use crate::executor::SANDBOX_UID;
use crate::node::{Node, NodeError};
use cynode_protocol::time::{format_rfc3339, now_rfc3339};

/// Idle timeout when the request gives none.
pub const DEFAULT_IDLE_TIMEOUT_SECONDS: u64 = 600;
/// Max lifetime when the request gives none (capped by `limits.max_timeout_seconds`).
pub const DEFAULT_MAX_LIFETIME_SECONDS: u64 = 3600;
/// Sessions that may be starting or running at once; more are refused with 503.
pub const MAX_ACTIVE_SESSIONS: usize = 32;
/// How often the reaper looks for expired sessions.
pub const REAP_INTERVAL: Duration = Duration::from_secs(1);
/// Env names the node sets in every session sandbox, beside [`RESERVED_ENV`].
const SESSION_ENV: &str = "CYNODE_SESSION_ID";
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// `POST /v1/worker/sessions` request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSessionRequest {
    pub version: u32,
    pub session_id: String,
    pub task_id: String,
    pub image: String,
    /// The workspace mounted at /workspace; defaults to `task_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_id: Option<String>,
    /// Ends the session after this long without a command (default 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_seconds: Option<u64>,
    /// Ends the session this long after it was created (default 3600, capped by the
    /// node's `limits.max_timeout_seconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_lifetime_seconds: Option<u64>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// `POST /v1/worker/sessions/{session_id}/exec` request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    pub version: u32,
    /// argv, run as uid 1000 in /workspace.
    pub command: Vec<String>,
    /// min(this or `limits.default_timeout_seconds`, `limits.max_timeout_seconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u64>,
    /// Added to the session's env for this command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// Whether a session can still run commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionStatus {
    Running,
    Ended,
}

/// Why a session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionEndReason {
    /// `POST …/end`.
    Requested,
    IdleTimeout,
    MaxLifetime,
    /// The keep-alive container is gone (a command killed it, or the engine did).
    SandboxExited,
}

impl SessionEndReason {
    fn as_str(self) -> &'static str {
        match self {
            SessionEndReason::Requested => "requested",
            SessionEndReason::IdleTimeout => "idle_timeout",
            SessionEndReason::MaxLifetime => "max_lifetime",
            SessionEndReason::SandboxExited => "sandbox_exited",
        }
    }
}

/// A session as create, show and end answer it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionInfo {
    pub version: u32,
    pub session_id: String,
    pub task_id: String,
    pub workspace_id: String,
    pub image: String,
    pub status: SessionStatus,
    pub created_at: String,
    /// When the max lifetime ends the session at the latest.
    pub expires_at: String,
    /// The effective limits, after defaults and caps.
    pub idle_timeout_seconds: u64,
    pub max_lifetime_seconds: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_reason: Option<SessionEndReason>,
}

/// `POST /v1/worker/sessions/{session_id}/exec` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecResponse {
    pub version: u32,
    pub session_id: String,
    pub status: WorkerJobStatus,
    /// -1 when the command timed out or could not run.
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
    pub truncated: Truncated,
    pub started_at: String,
    pub ended_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
}

/// A create request after validation, defaults and caps.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Validated {
    workspace_id: String,
    idle: u64,
    lifetime: u64,
}

fn check_env(field: &str, env: &BTreeMap<String, String>) -> Result<(), ValidationError> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ValidationError::new(
                field,
                format!("invalid variable `{}`", k.replace('\0', "\\0")),
            ));
        }
    }
    Ok(())
}

fn positive(field: &str, v: Option<u64>) -> Result<(), ValidationError> {
    if v == Some(0) {
        return Err(ValidationError::new(field, "must be positive"));
    }
    Ok(())
}

fn check_version(v: u32) -> Result<(), ValidationError> {
    if v != API_VERSION {
        return Err(ValidationError::new(
            "version",
            format!("unsupported version {v}: expected {API_VERSION}"),
        ));
    }
    Ok(())
}

fn validate_create(cfg: &Config, req: &CreateSessionRequest) -> Result<Validated, ValidationError> {
    check_version(req.version)?;
    check_id("session_id", &req.session_id)?;
    check_id("task_id", &req.task_id)?;
    if let Some(ws) = &req.workspace_id {
        check_id("workspace_id", ws)?;
    }
    if req.image.trim().is_empty() {
        return Err(ValidationError::new("image", "must not be empty"));
    }
    cfg.check_image(&req.image)
        .map_err(|e| ValidationError::new("image", e))?;
    positive("idle_timeout_seconds", req.idle_timeout_seconds)?;
    positive("max_lifetime_seconds", req.max_lifetime_seconds)?;
    check_env("env", &req.env)?;
    let lifetime = req
        .max_lifetime_seconds
        .unwrap_or(DEFAULT_MAX_LIFETIME_SECONDS)
        .min(cfg.limits.max_timeout_seconds)
        .max(1);
    let idle = req
        .idle_timeout_seconds
        .unwrap_or(DEFAULT_IDLE_TIMEOUT_SECONDS)
        .min(lifetime);
    Ok(Validated {
        workspace_id: req
            .workspace_id
            .clone()
            .unwrap_or_else(|| req.task_id.clone()),
        idle,
        lifetime,
    })
}

fn validate_exec(req: &ExecRequest) -> Result<(), ValidationError> {
    check_version(req.version)?;
    if req.command.is_empty() {
        return Err(ValidationError::new("command", "must not be empty"));
    }
    if req.command.iter().any(|a| a.contains('\0')) {
        return Err(ValidationError::new(
            "command",
            "must not contain NUL bytes",
        ));
    }
    positive("timeout_seconds", req.timeout_seconds)?;
    check_env("env", &req.env)
}

/// The sandbox env: `session` then `exec` (without reserved names), then the node's own.
fn sandbox_env(
    info: &SessionInfo,
    session: &BTreeMap<String, String>,
    exec: &BTreeMap<String, String>,
) -> Vec<(String, String)> {
    let mut env: BTreeMap<String, String> = session
        .iter()
        .chain(exec)
        .filter(|(k, _)| !RESERVED_ENV.contains(&k.as_str()) && k.as_str() != SESSION_ENV)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    env.insert("CYNODE_TASK_ID".into(), info.task_id.clone());
    env.insert("CYNODE_JOB_ID".into(), info.session_id.clone());
    env.insert(SESSION_ENV.into(), info.session_id.clone());
    env.insert("CYNODE_WORKSPACE_DIR".into(), "/workspace".into());
    env.entry("PATH".into())
        .or_insert_with(|| DEFAULT_PATH.into());
    env.into_iter().collect()
}

/// The sandbox spec of a session (`command` empty) or of one of its commands.
fn sandbox_spec(
    cfg: &Config,
    name: String,
    info: &SessionInfo,
    workspace: PathBuf,
    command: Vec<String>,
    env: Vec<(String, String)>,
    timeout: Duration,
) -> SandboxSpec {
    let l = &cfg.limits;
    SandboxSpec {
        name,
        image: info.image.clone(),
        command,
        override_entrypoint: true,
        env,
        mounts: vec![Mount {
            host: workspace,
            target: "/workspace".into(),
            writable: true,
        }],
        workdir: "/workspace".into(),
        network: NetworkPolicy::None,
        limits: ResourceLimits {
            memory_mb: l.memory_mb,
            pids: l.pids,
            cpus: l.cpus,
            tmpfs_mb: l.tmpfs_mb,
        },
        labels: vec![
            ("cynodeai.task_id".into(), info.task_id.clone()),
            ("cynodeai.session_id".into(), info.session_id.clone()),
        ],
        timeout,
        output_cap: l.output_cap_bytes,
    }
}

/// Creates the workspace owned by the sandbox user, as jobs do; an existing one is kept.
fn prepare_workspace(dir: &std::path::Path) -> std::io::Result<()> {
    if dir.exists() {
        return Ok(());
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::os::unix::fs::chown(dir, Some(SANDBOX_UID), Some(SANDBOX_UID))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
}

fn container_name(session_id: &str) -> String {
    format!("cynode-session-{session_id}")
}

enum Phase {
    /// The sandbox is being started.
    Starting,
    Running(SessionSandbox),
    Ended {
        since: Instant,
    },
}

struct Entry {
    info: SessionInfo,
    phase: Phase,
    env: BTreeMap<String, String>,
    workspace: PathBuf,
    deadline: Instant,
    idle: Duration,
    last_activity: Instant,
    /// A command is running.
    busy: bool,
    /// Canceled when the session ends: stops a running command.
    cancel: CancellationToken,
    /// Commands run so far (names bubblewrap's per-command sandboxes).
    seq: u64,
}

impl Entry {
    /// Marks the session ended; returns the sandbox to remove, if it was running.
    fn end(&mut self, reason: SessionEndReason) -> Option<SessionSandbox> {
        let Phase::Running(_) = self.phase else {
            return None;
        };
        let Phase::Running(sandbox) = std::mem::replace(
            &mut self.phase,
            Phase::Ended {
                since: Instant::now(),
            },
        ) else {
            return None;
        };
        self.info.status = SessionStatus::Ended;
        self.info.ended_at = Some(now_rfc3339());
        self.info.end_reason = Some(reason);
        self.cancel.cancel();
        tracing::info!(session_id = %self.info.session_id, task_id = %self.info.task_id, reason = reason.as_str(), "session ended");
        Some(sandbox)
    }
}

struct Inner {
    cfg: Config,
    ops: SessionOps,
    map: Mutex<HashMap<String, Entry>>,
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

fn poisoned() -> NodeError {
    NodeError::Internal("session table lock poisoned".into())
}

impl Sessions {
    /// No sessions yet, on `backend` as `cfg` configures it.
    pub fn new(cfg: &Config, backend: Backend) -> Self {
        Self {
            inner: Arc::new(Inner {
                ops: SessionOps::new(cfg, backend),
                cfg: cfg.clone(),
                map: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Starts the reaper: every [`REAP_INTERVAL`] it ends expired sessions and removes
    /// their sandboxes. It stops when the sessions are dropped.
    pub fn start_reaper(&self) {
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(REAP_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                Sessions { inner }.reap();
            }
        });
    }

    /// One reaper pass.
    fn reap(&self) {
        let now = Instant::now();
        let retention = Duration::from_secs(self.inner.cfg.retention_seconds);
        let mut ended = Vec::new();
        let Ok(mut map) = self.inner.map.lock() else {
            return;
        };
        for e in map.values_mut() {
            let Phase::Running(sandbox) = &e.phase else {
                continue;
            };
            let reason = if now >= e.deadline {
                SessionEndReason::MaxLifetime
            } else if !e.busy && now >= e.last_activity + e.idle {
                SessionEndReason::IdleTimeout
            } else if !SessionOps::is_alive(sandbox) {
                SessionEndReason::SandboxExited
            } else {
                continue;
            };
            if let Some(sb) = e.end(reason) {
                ended.push(sb);
            }
        }
        map.retain(|_, e| match e.phase {
            Phase::Ended { since } => now.duration_since(since) < retention,
            _ => true,
        });
        drop(map);
        for sb in ended {
            let ops = self.inner.ops.clone();
            tokio::spawn(async move { ops.remove(&sb).await });
        }
    }

    fn with_entry<T>(
        &self,
        session_id: &str,
        f: impl FnOnce(&mut Entry) -> Result<T, NodeError>,
    ) -> Result<T, NodeError> {
        let mut map = self.inner.map.lock().map_err(|_| poisoned())?;
        let e = map
            .get_mut(session_id)
            .ok_or_else(|| NodeError::NotFound(format!("session {session_id} not found")))?;
        f(e)
    }

    /// Creates and starts a session; `true` when new, `false` for a repeat of a running one.
    pub async fn create(
        &self,
        req: CreateSessionRequest,
    ) -> Result<(bool, SessionInfo), NodeError> {
        let cfg = &self.inner.cfg;
        let v = validate_create(cfg, &req)?;
        if let Some(existing) = self.repeat(&req)? {
            return Ok((false, existing));
        }
        if !self.inner.ops.backend().has_image(&req.image).await {
            return Err(NodeError::Invalid(ValidationError::new(
                "image",
                format!("image `{}` is not available on this node", req.image),
            )));
        }
        let workspace = cfg.workspaces_dir().join(&v.workspace_id);
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
        };
        {
            let mut map = self.inner.map.lock().map_err(|_| poisoned())?;
            if map.contains_key(&req.session_id) {
                drop(map);
                return self
                    .repeat(&req)?
                    .map(|i| (false, i))
                    .ok_or_else(|| NodeError::Internal("session vanished".into()));
            }
            let active = map
                .values()
                .filter(|e| !matches!(e.phase, Phase::Ended { .. }))
                .count();
            if active >= MAX_ACTIVE_SESSIONS {
                return Err(NodeError::Busy);
            }
            let started = Instant::now();
            map.insert(
                req.session_id.clone(),
                Entry {
                    info: info.clone(),
                    phase: Phase::Starting,
                    env: req.env.clone(),
                    workspace: workspace.clone(),
                    deadline: started + lifetime,
                    idle: Duration::from_secs(v.idle),
                    last_activity: started,
                    busy: false,
                    cancel: CancellationToken::new(),
                    seq: 0,
                },
            );
        }
        // In its own task: a client that goes away must not leave the session half made.
        let this = self.clone();
        let task = tokio::spawn(async move {
            let started = this.start_sandbox(&info, &req.env, workspace).await;
            let Ok(mut map) = this.inner.map.lock() else {
                if let Ok(sb) = started {
                    this.inner.ops.remove(&sb).await;
                }
                return Err(poisoned());
            };
            match started {
                Ok(sandbox) => {
                    if let Some(e) = map.get_mut(&req.session_id) {
                        e.phase = Phase::Running(sandbox);
                        e.last_activity = Instant::now();
                    }
                    tracing::info!(session_id = %info.session_id, task_id = %info.task_id, image = %info.image, idle_timeout_seconds = v.idle, max_lifetime_seconds = v.lifetime, "session started");
                    Ok((true, info))
                }
                Err(e) => {
                    map.remove(&req.session_id);
                    Err(NodeError::Internal(format!(
                        "cannot start session {}: {e}",
                        req.session_id
                    )))
                }
            }
        });
        task.await
            .map_err(|e| NodeError::Internal(format!("session start task failed: {e}")))?
    }

    async fn start_sandbox(
        &self,
        info: &SessionInfo,
        env: &BTreeMap<String, String>,
        workspace: PathBuf,
    ) -> Result<SessionSandbox, String> {
        prepare_workspace(&workspace)
            .map_err(|e| format!("cannot prepare workspace {}: {e}", workspace.display()))?;
        let spec = sandbox_spec(
            &self.inner.cfg,
            container_name(&info.session_id),
            info,
            workspace,
            Vec::new(),
            sandbox_env(info, env, &BTreeMap::new()),
            Duration::from_secs(info.max_lifetime_seconds),
        );
        self.inner.ops.start(&spec).await
    }

    /// The answer to a repeated create, if the session exists.
    fn repeat(&self, req: &CreateSessionRequest) -> Result<Option<SessionInfo>, NodeError> {
        let map = self.inner.map.lock().map_err(|_| poisoned())?;
        let Some(e) = map.get(&req.session_id) else {
            return Ok(None);
        };
        let id = &req.session_id;
        match e.phase {
            Phase::Starting => Err(NodeError::Conflict(format!(
                "session {id} is being created; retry"
            ))),
            Phase::Ended { .. } => Err(NodeError::Conflict(format!("session {id} has ended"))),
            Phase::Running(_) if e.info.task_id != req.task_id || e.info.image != req.image => Err(
                NodeError::Conflict(format!("session {id} exists with another task_id or image")),
            ),
            Phase::Running(_) => Ok(Some(e.info.clone())),
        }
    }

    /// The session as it stands.
    pub fn show(&self, session_id: &str) -> Result<SessionInfo, NodeError> {
        check_id("session_id", session_id)?;
        self.with_entry(session_id, |e| Ok(e.info.clone()))
    }

    /// Runs one command in the session. The command runs in its own task, so a client
    /// that goes away does not leave the session marked busy or the command unbounded.
    pub async fn exec(
        &self,
        session_id: &str,
        req: ExecRequest,
    ) -> Result<ExecResponse, NodeError> {
        check_id("session_id", session_id)?;
        validate_exec(&req)?;
        let cfg = &self.inner.cfg;
        let timeout = Duration::from_secs(cfg.limits.effective_timeout(req.timeout_seconds));
        let (sandbox, spec, cancel) = self.with_entry(session_id, |e| {
            let sandbox = match &e.phase {
                Phase::Running(sb) => sb.clone(),
                Phase::Starting => {
                    return Err(NodeError::Conflict(format!(
                        "session {session_id} is being created; retry"
                    )))
                }
                Phase::Ended { .. } => {
                    let why = e.info.end_reason.map_or("ended", SessionEndReason::as_str);
                    return Err(NodeError::Conflict(format!(
                        "session {session_id} has ended ({why})"
                    )));
                }
            };
            if e.busy {
                return Err(NodeError::Conflict(format!(
                    "session {session_id} is running another command"
                )));
            }
            e.busy = true;
            e.last_activity = Instant::now();
            e.seq += 1;
            let spec = sandbox_spec(
                cfg,
                format!("{}-{}", container_name(session_id), e.seq),
                &e.info,
                e.workspace.clone(),
                req.command.clone(),
                sandbox_env(&e.info, &e.env, &req.env),
                timeout,
            );
            Ok((sandbox, spec, e.cancel.clone()))
        })?;
        let this = self.clone();
        let id = session_id.to_string();
        let task = tokio::spawn(async move {
            let started_at = now_rfc3339();
            let out = this.inner.ops.exec(&sandbox, &spec, &cancel).await;
            let ended_at = now_rfc3339();
            let mut gone = None;
            if let Ok(mut map) = this.inner.map.lock() {
                if let Some(e) = map.get_mut(&id) {
                    e.busy = false;
                    e.last_activity = Instant::now();
                    if matches!(out.end, EndReason::StartFailed(_))
                        && !SessionOps::is_alive(&sandbox)
                    {
                        gone = e.end(SessionEndReason::SandboxExited);
                    }
                }
            }
            if let Some(sb) = gone {
                this.inner.ops.remove(&sb).await;
            }
            exec_response(&id, &spec, out, started_at, ended_at)
        });
        task.await
            .map_err(|e| NodeError::Internal(format!("exec task failed: {e}")))
    }

    /// Ends the session and removes its sandbox; ending an ended session answers it again.
    pub async fn end(&self, session_id: &str) -> Result<SessionInfo, NodeError> {
        check_id("session_id", session_id)?;
        let (info, sandbox) = self.with_entry(session_id, |e| match e.phase {
            Phase::Starting => Err(NodeError::Conflict(format!(
                "session {session_id} is being created; retry"
            ))),
            _ => {
                let sb = e.end(SessionEndReason::Requested);
                Ok((e.info.clone(), sb))
            }
        })?;
        if let Some(sb) = sandbox {
            // In its own task, so the sandbox is removed even if the client goes away.
            let ops = self.inner.ops.clone();
            tokio::spawn(async move { ops.remove(&sb).await })
                .await
                .map_err(|e| NodeError::Internal(format!("session removal failed: {e}")))?;
        }
        Ok(info)
    }
}

fn exec_response(
    session_id: &str,
    spec: &SandboxSpec,
    out: crate::backend::SandboxOutcome,
    started_at: String,
    ended_at: String,
) -> ExecResponse {
    let mut exit_code = out.exit_code.unwrap_or(-1);
    let (status, failure_reason) = match out.end {
        EndReason::Exited if exit_code == 0 => (WorkerJobStatus::Completed, None),
        EndReason::Exited if exit_code == 137 => (
            WorkerJobStatus::Failed,
            Some("command killed by SIGKILL: memory or pids limit reached".to_string()),
        ),
        EndReason::Exited => (WorkerJobStatus::Failed, None),
        EndReason::TimedOut => {
            exit_code = -1;
            (
                WorkerJobStatus::Timeout,
                Some(format!(
                    "command killed after its timeout of {}s",
                    spec.timeout.as_secs()
                )),
            )
        }
        EndReason::Canceled => {
            exit_code = -1;
            (
                WorkerJobStatus::Failed,
                Some("the session ended while the command ran".to_string()),
            )
        }
        EndReason::StartFailed(msg) => {
            exit_code = -1;
            (WorkerJobStatus::Failed, Some(msg))
        }
    };
    ExecResponse {
        version: API_VERSION,
        session_id: session_id.to_string(),
        status,
        exit_code,
        stdout: out.stdout,
        stderr: out.stderr,
        truncated: out.truncated,
        started_at,
        ended_at,
        failure_reason,
    }
}

/// The session routes, for the authenticated `/v1` router.
pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route("/v1/worker/sessions", post(create))
        .route("/v1/worker/sessions/{session_id}", get(show))
        .route("/v1/worker/sessions/{session_id}/exec", post(exec))
        .route("/v1/worker/sessions/{session_id}/end", post(end))
}

async fn create(
    State(node): State<Arc<Node>>,
    StrictJson(req): StrictJson<CreateSessionRequest>,
) -> Result<Response, ApiError> {
    let (new, info) = node.sessions.create(req).await?;
    let code = if new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((code, Json(info)).into_response())
}

async fn show(
    State(node): State<Arc<Node>>,
    Path(session_id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(node.sessions.show(&session_id)?).into_response())
}

async fn exec(
    State(node): State<Arc<Node>>,
    Path(session_id): Path<String>,
    StrictJson(req): StrictJson<ExecRequest>,
) -> Result<Response, ApiError> {
    Ok(Json(node.sessions.exec(&session_id, req).await?).into_response())
}

/// Takes no body (any body is ignored), like `jobs/{id}:stop`.
async fn end(
    State(node): State<Arc<Node>>,
    Path(session_id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(node.sessions.end(&session_id).await?).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn create_req(body: serde_json::Value) -> Result<CreateSessionRequest, ValidationError> {
        cynode_protocol::error::parse_strict(body.to_string().as_bytes())
    }

    #[test]
    fn defaults_and_caps() {
        let mut cfg = Config::default();
        cfg.limits.max_timeout_seconds = 100;
        let req = create_req(serde_json::json!({
            "version": 1, "session_id": "s", "task_id": "t", "image": "i"
        }))
        .unwrap();
        assert_eq!(
            validate_create(&cfg, &req).unwrap(),
            Validated {
                workspace_id: "t".into(),
                idle: 100,
                lifetime: 100
            }
        );
        cfg.limits.max_timeout_seconds = 10800;
        assert_eq!(
            validate_create(&cfg, &req).unwrap(),
            Validated {
                workspace_id: "t".into(),
                idle: 600,
                lifetime: 3600
            }
        );
        let req = create_req(serde_json::json!({
            "version": 1, "session_id": "s", "task_id": "t", "image": "i",
            "workspace_id": "w", "idle_timeout_seconds": 5, "max_lifetime_seconds": 99999
        }))
        .unwrap();
        assert_eq!(
            validate_create(&cfg, &req).unwrap(),
            Validated {
                workspace_id: "w".into(),
                idle: 5,
                lifetime: 10800
            }
        );
    }

    #[test]
    fn invalid_requests_name_the_field() {
        let cfg = Config {
            images: vec!["ok".into()],
            ..Config::default()
        };
        let base =
            serde_json::json!({ "version": 1, "session_id": "s", "task_id": "t", "image": "ok" });
        let cases = [
            ("version", serde_json::json!(2), "version"),
            ("session_id", serde_json::json!("../x"), "session_id"),
            ("workspace_id", serde_json::json!(".."), "workspace_id"),
            ("image", serde_json::json!("other"), "image"),
            (
                "idle_timeout_seconds",
                serde_json::json!(0),
                "idle_timeout_seconds",
            ),
            ("env", serde_json::json!({ "A=B": "x" }), "env"),
        ];
        for (field, value, path) in cases {
            let mut body = base.clone();
            body[field] = value;
            let err = validate_create(&cfg, &create_req(body).unwrap()).unwrap_err();
            assert_eq!(err.path, path, "{err}");
        }
        let mut body = base.clone();
        body["surprise"] = serde_json::json!(1);
        let err = create_req(body).unwrap_err();
        assert_eq!(err.path, "surprise", "{err}");
        assert!(err.message.starts_with("unknown field `surprise`"), "{err}");
        let exec: ExecRequest =
            cynode_protocol::error::parse_strict(br#"{"version":1,"command":[]}"#).unwrap();
        assert_eq!(validate_exec(&exec).unwrap_err().path, "command");
    }

    #[test]
    fn reserved_env_cannot_be_overridden_and_exec_env_wins() {
        let info = SessionInfo {
            version: 1,
            session_id: "s".into(),
            task_id: "t".into(),
            workspace_id: "t".into(),
            image: "i".into(),
            status: SessionStatus::Running,
            created_at: String::new(),
            expires_at: String::new(),
            idle_timeout_seconds: 1,
            max_lifetime_seconds: 1,
            ended_at: None,
            end_reason: None,
        };
        let session: BTreeMap<String, String> = [
            ("A", "session"),
            ("B", "session"),
            ("CYNODE_TASK_ID", "forged"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let exec: BTreeMap<String, String> = [("B", "exec"), ("CYNODE_SESSION_ID", "forged")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let env = sandbox_env(&info, &session, &exec);
        let expected: Vec<(String, String)> = [
            ("A", "session"),
            ("B", "exec"),
            ("CYNODE_JOB_ID", "s"),
            ("CYNODE_SESSION_ID", "s"),
            ("CYNODE_TASK_ID", "t"),
            ("CYNODE_WORKSPACE_DIR", "/workspace"),
            ("PATH", DEFAULT_PATH),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(env, expected);
    }
}
