//! The node: accepts jobs (sync and async), bounds how many run and wait, records every
//! job durably before acting, serves results until they are acked, and reconciles after a
//! restart so nothing is silently lost.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cynode_protocol::worker_api::{
    AsyncJobState, AsyncJobStatus, RunJobRequest, RunJobResponse, SbaLifecycle, WorkerCapacity,
    WorkerJobStatus, API_VERSION,
};
use cynode_protocol::ValidationError;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::backend::Backend;
use crate::callback;
use crate::config::Config;
use crate::executor::{self, JobPaths};
use crate::store::{request_digest, JobRecord, Mode, Store};

/// Attempts at recording a job's final state (about a minute with the backoff).
const RESULT_WRITE_TRIES: u32 = 15;

/// Why the node refused or could not serve a call.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{0}")]
    Invalid(#[from] ValidationError),
    #[error("the node is at capacity")]
    Busy,
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Internal(String),
}

impl From<crate::store::StoreError> for NodeError {
    fn from(e: crate::store::StoreError) -> Self {
        NodeError::Internal(e.to_string())
    }
}

/// Readiness as last checked.
#[derive(Debug, Clone)]
pub struct Readiness {
    pub ready: bool,
    pub detail: String,
}

/// The node's shared state.
pub struct Node {
    pub cfg: Arc<Config>,
    pub backend: Backend,
    pub store: Store,
    pub token: String,
    pub sessions: crate::sessions::Sessions,
    /// The inference upstream, when configured.
    pub inference: Option<Arc<crate::inference::Upstream>>,
    running: Mutex<HashMap<String, CancellationToken>>,
    permits: Arc<Semaphore>,
    waiting: AtomicUsize,
    readiness: Mutex<Readiness>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("backend", &self.backend.kind())
            .finish()
    }
}

impl Node {
    /// Opens the state directory, reconciles what a previous run left, checks readiness.
    pub async fn start(cfg: Config, token: String) -> anyhow::Result<Arc<Node>> {
        use anyhow::Context;
        for d in [cfg.state_dir.clone(), cfg.jobs_dir(), cfg.workspaces_dir()] {
            std::fs::create_dir_all(&d)
                .with_context(|| format!("cannot create {}", d.display()))?;
            // Sandboxes run as uid 1000 and must traverse to their job and workspace.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755))
                .with_context(|| format!("cannot set permissions on {}", d.display()))?;
        }
        let store = Store::open(&cfg.database_path())
            .await
            .context("cannot open the job database")?;
        let backend = Backend::from_config(&cfg);
        let inference = match &cfg.inference {
            Some(i) => Some(Arc::new(crate::inference::Upstream::from_config(i)?)),
            None => None,
        };
        let node = Arc::new(Node {
            inference,
            sessions: crate::sessions::Sessions::new(&cfg, backend.clone()),
            permits: Arc::new(Semaphore::new(cfg.queue.max_running.max(1))),
            cfg: Arc::new(cfg),
            backend,
            store,
            token,
            running: Mutex::new(HashMap::new()),
            waiting: AtomicUsize::new(0),
            readiness: Mutex::new(Readiness {
                ready: false,
                detail: "starting".into(),
            }),
        });
        node.reconcile().await?;
        node.sessions.start_reaper();
        node.check_ready().await;
        let weak = Arc::downgrade(&node);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(60));
            loop {
                tick.tick().await;
                let Some(node) = weak.upgrade() else { return };
                node.expire_retained().await;
            }
        });
        Ok(node)
    }

    /// Re-runs the startup checks and records the outcome.
    pub async fn check_ready(&self) -> Readiness {
        let r = match (self.backend.check().await, self.store.ping().await) {
            (Ok(v), Ok(())) => Readiness {
                ready: true,
                detail: format!("backend {}: {v}", self.backend.kind().as_str()),
            },
            (Err(e), _) => Readiness {
                ready: false,
                detail: format!("backend {}: {e}", self.backend.kind().as_str()),
            },
            (_, Err(e)) => Readiness {
                ready: false,
                detail: format!("database: {e}"),
            },
        };
        if let Ok(mut g) = self.readiness.lock() {
            *g = r.clone();
        }
        r
    }

    /// The last readiness outcome.
    pub fn readiness(&self) -> Readiness {
        self.readiness
            .lock()
            .map(|g| g.clone())
            .unwrap_or(Readiness {
                ready: false,
                detail: "readiness lock poisoned".into(),
            })
    }

    /// After a restart: remove every sandbox a previous run left, and settle every job that
    /// was accepted or running. A job whose result.json is complete keeps that result; any
    /// other is failed with reason `worker_restarted`.
    pub async fn reconcile(&self) -> anyhow::Result<()> {
        let removed = self.backend.remove_all_managed().await;
        if removed > 0 {
            tracing::warn!(removed, "removed sandboxes left by a previous run");
        }
        let unfinished = self.store.unfinished().await?;
        // A client killed with the node may still have been creating its container: sweep
        // those names once more a little later.
        let names: Vec<String> = unfinished
            .iter()
            .map(|r| format!("cynode-{}", r.job_id))
            .collect();
        if !names.is_empty() {
            let backend = self.backend.clone();
            tokio::spawn(async move {
                for delay in [1, 3, 10] {
                    tokio::time::sleep(std::time::Duration::from_secs(delay)).await;
                    for n in &names {
                        crate::backend::remove_named(&backend, n).await;
                    }
                }
            });
        }
        for rec in unfinished {
            crate::backend::remove_named(&self.backend, &format!("cynode-{}", rec.job_id)).await;
            let paths = JobPaths::new(&self.cfg, &rec.request);
            let mut resp = restarted_response(&rec);
            if rec.request.sandbox.job_spec_json.is_some() {
                // The same reads as after a run: beneath the job directory, no links,
                // bounded; a result that cannot be read or verified leaves the job
                // `worker_restarted`.
                if let Ok(result) = executor::read_result(&paths).await {
                    match executor::collect_artifacts(&paths).await {
                        Ok(artifacts) => {
                            let mut settled = resp.clone();
                            settled.failure_reason = None;
                            settled.artifacts = Some(artifacts.clone());
                            executor::apply_sba_result(&mut settled, result, &artifacts, false);
                            if settled.failure_reason.is_none() {
                                resp = settled;
                            }
                        }
                        Err(e) => {
                            resp.failure_reason = Some(format!(
                                "worker_restarted; {}",
                                executor::artifacts_reason(&e)
                            ));
                        }
                    }
                }
            }
            let state = state_of(&resp);
            tracing::warn!(job_id = %rec.job_id, task_id = %rec.task_id, state = ?state, "reconciled job after restart");
            self.store.finish(&rec.job_id, state, &resp).await?;
        }
        Ok(())
    }

    /// Records a job while holding a slot taken by [`Node::take_slot`]; when recording
    /// fails the slot is given back, so a database error never shrinks the queue for good.
    async fn insert_holding_slot(
        &self,
        req: &RunJobRequest,
        mode: Mode,
    ) -> Result<bool, NodeError> {
        match self.store.insert(req, mode).await {
            Ok(new) => Ok(new),
            Err(e) => {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                Err(e.into())
            }
        }
    }

    /// What this node can take: configured limits and the jobs it holds now.
    pub fn capacity(&self) -> WorkerCapacity {
        let max_running = self.cfg.queue.max_running.max(1);
        let active = self.waiting.load(Ordering::SeqCst);
        let running = max_running - self.permits.available_permits().min(max_running);
        WorkerCapacity {
            version: API_VERSION,
            backend: self.backend.kind().as_str().to_string(),
            max_running: max_running as u64,
            max_queued: self.cfg.queue.max_queued as u64,
            running: running as u64,
            queued: active.saturating_sub(running) as u64,
            ready: self.readiness().ready,
        }
    }

    fn take_slot(&self) -> Result<(), NodeError> {
        let limit = self.cfg.queue.max_queued + self.cfg.queue.max_running.max(1);
        let prev = self.waiting.fetch_add(1, Ordering::SeqCst);
        if prev >= limit {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(NodeError::Busy);
        }
        Ok(())
    }

    /// `jobs:run`: validate, record, run, answer. A repeat of a finished job returns its
    /// stored response without running it again.
    pub async fn run_sync(
        self: &Arc<Self>,
        req: RunJobRequest,
    ) -> Result<RunJobResponse, NodeError> {
        executor::validate(&self.cfg, &req)?;
        let digest = request_digest(&req)?;
        self.take_slot()?;
        if !self.insert_holding_slot(&req, Mode::Sync).await? {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return match self.store.get(&req.job_id).await? {
                Some(rec) if rec.request_digest != digest => Err(different_request(&req.job_id)),
                Some(JobRecord {
                    response: Some(resp),
                    ..
                }) => Ok(resp),
                _ => Err(NodeError::Conflict(format!(
                    "job {} is already running",
                    req.job_id
                ))),
            };
        }
        Ok(self.execute(req).await)
    }

    /// `POST /jobs`: validate, record, queue. Idempotent on job_id: a repeat returns the
    /// existing job (`false`) and never runs it twice.
    pub async fn submit(
        self: &Arc<Self>,
        req: RunJobRequest,
    ) -> Result<(bool, AsyncJobStatus), NodeError> {
        executor::validate(&self.cfg, &req)?;
        let digest = request_digest(&req)?;
        if let Some(existing) = self.store.get(&req.job_id).await? {
            if existing.request_digest != digest {
                return Err(different_request(&req.job_id));
            }
            return Ok((false, status_of(existing)));
        }
        self.take_slot()?;
        if !self.insert_holding_slot(&req, Mode::Async).await? {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            let existing = self
                .store
                .get(&req.job_id)
                .await?
                .ok_or_else(|| NodeError::NotFound(format!("job {} not found", req.job_id)))?;
            if existing.request_digest != digest {
                return Err(different_request(&req.job_id));
            }
            return Ok((false, status_of(existing)));
        }
        let status = AsyncJobStatus {
            version: API_VERSION,
            task_id: req.task_id.clone(),
            job_id: req.job_id.clone(),
            status: AsyncJobState::Accepted,
            result: None,
        };
        let node = Arc::clone(self);
        // The job runs in a `job` span under the submitting request's span (its caller's
        // trace_id), so its log lines and exported span join the caller's trace.
        let span = tracing::info_span!("job", job_id = %req.job_id, task_id = %req.task_id);
        tokio::spawn(
            async move {
                node.execute(req).await;
            }
            .instrument(span),
        );
        Ok((true, status))
    }

    /// Records a job's final state, retrying with backoff: a result that is never
    /// recorded leaves the job `in_progress` for ever and its caller waiting (seen once
    /// under heavy disk load, when SQLite gave up after its busy timeout).
    async fn record_result(&self, job_id: &str, state: AsyncJobState, resp: &RunJobResponse) {
        let mut delay = std::time::Duration::from_millis(100);
        for attempt in 1..=RESULT_WRITE_TRIES {
            match self.store.finish(job_id, state, resp).await {
                Ok(()) => return,
                Err(e) if attempt < RESULT_WRITE_TRIES => {
                    tracing::warn!(job_id = %job_id, attempt, error = %e, "cannot record job result; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(std::time::Duration::from_secs(5));
                }
                Err(e) => {
                    tracing::error!(job_id = %job_id, attempt, error = %e, "cannot record job result; giving up");
                }
            }
        }
    }

    /// Runs a recorded job to its end; the caller has taken a waiting slot.
    async fn execute(self: &Arc<Self>, req: RunJobRequest) -> RunJobResponse {
        let cancel = CancellationToken::new();
        if let Ok(mut g) = self.running.lock() {
            g.insert(req.job_id.clone(), cancel.clone());
        }
        let permit = Arc::clone(&self.permits).acquire_owned().await;
        let resp = if cancel.is_cancelled() {
            canceled_before_start(&req)
        } else {
            self.execute_inner(&req, &cancel).await
        };
        drop(permit);
        let state = if cancel.is_cancelled() && resp.status != WorkerJobStatus::Completed {
            AsyncJobState::Canceled
        } else {
            state_of(&resp)
        };
        self.record_result(&req.job_id, state, &resp).await;
        if let Ok(mut g) = self.running.lock() {
            g.remove(&req.job_id);
        }
        // Only now: a graceful shutdown waits for `active() == 0`, and must not exit
        // between the sandbox's end and the recorded result (the job would come back as
        // `worker_restarted`).
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        tracing::info!(job_id = %req.job_id, task_id = %req.task_id, state = ?state, exit_code = resp.exit_code, "job finished");
        resp
    }

    async fn execute_inner(
        self: &Arc<Self>,
        req: &RunJobRequest,
        cancel: &CancellationToken,
    ) -> RunJobResponse {
        let paths = JobPaths::new(&self.cfg, req);
        if let Err(e) = executor::prepare(&paths, req) {
            let mut resp = restarted_response_for(req);
            resp.failure_reason = Some(format!("cannot prepare job directory: {e}"));
            return resp;
        }
        let _callbacks = if req.sandbox.job_spec_json.is_some() {
            let store = self.store.clone();
            let job_id = req.job_id.clone();
            let on_status: callback::OnStatus = Arc::new(move |s| {
                if s == SbaLifecycle::InProgress {
                    let store = store.clone();
                    let job_id = job_id.clone();
                    tokio::spawn(async move {
                        let _ = store.set_state(&job_id, AsyncJobState::InProgress).await;
                    });
                }
            });
            match callback::listen(&paths.mount, &req.job_id, on_status) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(job_id = %req.job_id, error = %e, "no lifecycle socket; in_progress will not be reported");
                    None
                }
            }
        } else {
            let _ = self
                .store
                .set_state(&req.job_id, AsyncJobState::InProgress)
                .await;
            None
        };
        let _proxy = match (executor::inference_models(&self.cfg, req), &self.inference) {
            (Ok(Some(models)), Some(upstream)) => {
                let proxy = crate::inference::Proxy::new(&req.job_id, models, Arc::clone(upstream));
                match crate::inference::listen(&paths.mount, proxy) {
                    Ok(s) => Some(s),
                    Err(e) => {
                        let mut resp = restarted_response_for(req);
                        resp.failure_reason =
                            Some(format!("cannot start the inference proxy: {e}"));
                        return resp;
                    }
                }
            }
            _ => None,
        };
        let spec = executor::sandbox_spec(&self.cfg, req, &paths);
        tracing::info!(job_id = %req.job_id, task_id = %req.task_id, image = %req.sandbox.image, "job started");
        executor::run(&self.backend, &spec, req, &paths, cancel).await
    }

    /// `GET /jobs/{id}`.
    pub async fn status(&self, job_id: &str) -> Result<AsyncJobStatus, NodeError> {
        let rec = self
            .store
            .get(job_id)
            .await?
            .ok_or_else(|| NodeError::NotFound(format!("job {job_id} not found")))?;
        Ok(status_of(rec))
    }

    /// `POST /jobs/{id}:stop`: cancels a waiting or running job (its sandbox is killed).
    pub async fn stop(&self, job_id: &str) -> Result<AsyncJobStatus, NodeError> {
        let token = self
            .running
            .lock()
            .ok()
            .and_then(|g| g.get(job_id).cloned());
        if let Some(t) = token {
            t.cancel();
        }
        self.status(job_id).await
    }

    /// `POST /jobs/{id}:ack`: the caller has the result; only now are the record and the
    /// job directory deleted. A job still running cannot be acked.
    pub async fn ack(&self, job_id: &str) -> Result<(), NodeError> {
        let rec = self
            .store
            .get(job_id)
            .await?
            .ok_or_else(|| NodeError::NotFound(format!("job {job_id} not found")))?;
        if !rec.state.is_terminal() {
            return Err(NodeError::Conflict(format!("job {job_id} is not finished")));
        }
        let paths = JobPaths::new(&self.cfg, &rec.request);
        if let Err(e) = std::fs::remove_dir_all(&paths.root) {
            if e.kind() != std::io::ErrorKind::NotFound {
                return Err(NodeError::Internal(format!(
                    "cannot remove job directory: {e}"
                )));
            }
        }
        self.store.delete(job_id).await?;
        Ok(())
    }

    /// An artifact of a finished job, opened beneath the job's artifacts directory without
    /// following links (a regular file only); with its size.
    pub async fn artifact(
        &self,
        job_id: &str,
        rel: &str,
    ) -> Result<(std::fs::File, u64), NodeError> {
        let rec = self
            .store
            .get(job_id)
            .await?
            .ok_or_else(|| NodeError::NotFound(format!("job {job_id} not found")))?;
        if !rec.state.is_terminal() {
            return Err(NodeError::Conflict(format!("job {job_id} is not finished")));
        }
        if rel.is_empty()
            || !std::path::Path::new(rel)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)))
        {
            return Err(NodeError::Invalid(ValidationError::new(
                "path",
                "artifact paths are relative and contain no `..`",
            )));
        }
        // Beneath the job directory: a job that swapped `artifacts` itself for a link is
        // refused like a link inside it.
        let base = JobPaths::new(&self.cfg, &rec.request).mount;
        let rel_owned = format!("{}/{rel}", executor::ARTIFACTS_DIR);
        let opened = tokio::task::spawn_blocking(move || {
            let dir = crate::sandbox_files::open_dir(&base).map_err(|e| {
                crate::sandbox_files::ReadError::Io {
                    path: "job directory".into(),
                    source: e,
                }
            })?;
            crate::sandbox_files::open_regular(std::os::fd::AsFd::as_fd(&dir), &rel_owned, u64::MAX)
        })
        .await
        .map_err(|e| NodeError::Internal(e.to_string()))?;
        opened.map_err(|e| {
            tracing::info!(job_id = %job_id, error = %e, "artifact refused");
            NodeError::NotFound(format!("artifact {rel}"))
        })
    }

    /// Deletes finished jobs nobody acked within `retention_seconds`.
    pub async fn expire_retained(&self) {
        let cutoff = time::OffsetDateTime::now_utc()
            - time::Duration::seconds(
                i64::try_from(self.cfg.retention_seconds).unwrap_or(i64::MAX),
            );
        let cutoff = cynode_protocol::time::format_rfc3339(cutoff);
        match self.store.expired(&cutoff).await {
            Ok(ids) => {
                for id in ids {
                    match self.ack(&id).await {
                        Ok(()) => tracing::info!(job_id = %id, "retention expired; job deleted"),
                        Err(e) => tracing::warn!(job_id = %id, error = %e, "cannot expire job"),
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "retention sweep failed"),
        }
    }

    /// Cancels every running job (graceful shutdown after the grace period).
    pub fn cancel_all(&self) {
        if let Ok(g) = self.running.lock() {
            for t in g.values() {
                t.cancel();
            }
        }
    }

    /// Jobs currently waiting or running.
    pub fn active(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }
}

/// A job_id reused for another request: idempotency is keyed on the request.
fn different_request(job_id: &str) -> NodeError {
    NodeError::Conflict(format!(
        "job {job_id} already exists with a different request; a job_id names one request"
    ))
}

fn state_of(resp: &RunJobResponse) -> AsyncJobState {
    match resp.status {
        WorkerJobStatus::Completed => AsyncJobState::Completed,
        WorkerJobStatus::Failed => AsyncJobState::Failed,
        WorkerJobStatus::Timeout => AsyncJobState::Timeout,
    }
}

fn status_of(rec: JobRecord) -> AsyncJobStatus {
    AsyncJobStatus {
        version: API_VERSION,
        task_id: rec.task_id,
        job_id: rec.job_id,
        status: rec.state,
        result: if rec.state.is_terminal() {
            rec.response
        } else {
            None
        },
    }
}

fn restarted_response_for(req: &RunJobRequest) -> RunJobResponse {
    let now = cynode_protocol::time::now_rfc3339();
    RunJobResponse {
        version: API_VERSION,
        task_id: req.task_id.clone(),
        job_id: req.job_id.clone(),
        status: WorkerJobStatus::Failed,
        exit_code: -1,
        stdout: String::new(),
        stderr: String::new(),
        started_at: now.clone(),
        ended_at: now,
        truncated: Default::default(),
        sba_result: None,
        artifacts: None,
        failure_reason: None,
    }
}

fn restarted_response(rec: &JobRecord) -> RunJobResponse {
    let mut r = restarted_response_for(&rec.request);
    r.failure_reason = Some("worker_restarted".into());
    r
}

fn canceled_before_start(req: &RunJobRequest) -> RunJobResponse {
    let mut r = restarted_response_for(req);
    r.failure_reason = Some("canceled before it started".into());
    r
}
