//! Jobs: `jobs:run` (run and answer), submit (queue and answer at once), status, stop and
//! ack. Every job is validated completely and recorded durably before anything runs; a
//! job_id names one request (a repeat with another request is a conflict); at most
//! `queue.max_running` run and `queue.max_queued` wait, more are refused as busy.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cynode_protocol::job::{ExecutionMode, JobSpec};
use cynode_protocol::worker_api::{
    AsyncJobState, AsyncJobStatus, RunJobRequest, RunJobResponse, WorkerJobStatus, API_VERSION,
};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::servers::JobServers;
use super::{Node, NodeError};
use crate::backend::image_labels;
use crate::executor::response::{self, state_of};
use crate::executor::{self, AcceptedJob, JobPaths, PreparedJob};
use crate::job_grants::{self, Handed};
use crate::remove_tree::remove_tree_async;
use crate::store::{request_digest, JobRecord, Mode};

/// Attempts at recording a job's final state (about a minute with the backoff).
const RESULT_WRITE_TRIES: u32 = 15;

/// An empty `sandbox.image` becomes the node's `default_image`, when it has one (upstream
/// CyNodeAI's fallback); the allowlist and the image grammar still apply to it.
fn default_image(node: &Node, req: &mut RunJobRequest) {
    if req.sandbox.image.trim().is_empty() {
        if let Some(image) = &node.cfg.default_image {
            req.sandbox.image = image.clone();
        }
    }
}

/// An agent job (`execution_mode: agent_inference`) runs only on an image labelled
/// agent-compatible ([`crate::backend::image_labels`]); other jobs never need the label.
async fn agent_image(
    node: &Node,
    req: &RunJobRequest,
    job: Option<&JobSpec>,
) -> Result<(), NodeError> {
    if job.is_some_and(|j| j.effective_mode() == ExecutionMode::AgentInference) {
        image_labels::check_agent_image(&node.cfg, &req.sandbox.image, "sandbox.image").await?;
    }
    Ok(())
}

impl Node {
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

    /// `jobs:run`: validate, record, run, answer. A repeat of a finished job returns its
    /// stored response without running it again.
    pub async fn run_sync(
        self: &Arc<Self>,
        mut req: RunJobRequest,
    ) -> Result<RunJobResponse, NodeError> {
        let mut lap = crate::trace::Lap::start();
        default_image(self, &mut req);
        let checked = executor::check(&self.cfg, &req)?;
        agent_image(self, &req, checked.job.as_ref()).await?;
        // The gateway token and inference key are held in memory only: never digested,
        // stored or logged.
        let handed = Handed::take(&mut req);
        let digest = request_digest(&req)?;
        let validate_us = lap.us();
        // The workspace's host uid, before the job is accepted: none free is a 503.
        let accepted = checked.accept(&self.uids).await?;
        let uid_us = lap.us();
        self.take_slot()?;
        let inserted = self.insert_holding_slot(&req, Mode::Sync).await?;
        tracing::debug!(job_id = %req.job_id, validate_us, uid_us, insert_us = lap.us(), "phases: accept");
        if !inserted {
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
        handed.hold(&req.job_id);
        Ok(self.execute(req, accepted).await)
    }

    /// `POST /jobs`: validate, record, queue. Idempotent on job_id: a repeat returns the
    /// existing job (`false`) and never runs it twice.
    pub async fn submit(
        self: &Arc<Self>,
        mut req: RunJobRequest,
    ) -> Result<(bool, AsyncJobStatus), NodeError> {
        default_image(self, &mut req);
        let checked = executor::check(&self.cfg, &req)?;
        agent_image(self, &req, checked.job.as_ref()).await?;
        // The gateway token and inference key are held in memory only: never digested,
        // stored or logged. A repeat of a job still running (a PM resuming with fresh
        // ones) replaces those it holds.
        let handed = Handed::take(&mut req);
        let digest = request_digest(&req)?;
        if let Some(existing) = self.store.get(&req.job_id).await? {
            if existing.request_digest != digest {
                return Err(different_request(&req.job_id));
            }
            if !existing.state.is_terminal() {
                handed.renew(&req.job_id);
            }
            return Ok((false, status_of(existing)));
        }
        let accepted = checked.accept(&self.uids).await?;
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
        handed.hold(&req.job_id);
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
                node.execute(req, accepted).await;
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
    async fn execute(
        self: &Arc<Self>,
        req: RunJobRequest,
        accepted: AcceptedJob,
    ) -> RunJobResponse {
        let cancel = CancellationToken::new();
        if let Ok(mut g) = self.running.lock() {
            g.insert(req.job_id.clone(), cancel.clone());
        }
        let permit = Arc::clone(&self.permits).acquire_owned().await;
        let resp = if cancel.is_cancelled() {
            response::canceled_before_start(&req)
        } else {
            self.execute_inner(&req, accepted, &cancel).await
        };
        drop(permit);
        let mut lap = crate::trace::Lap::start();
        job_grants::forget(&req.job_id);
        let state = if cancel.is_cancelled() && resp.status != WorkerJobStatus::Completed {
            AsyncJobState::Canceled
        } else {
            state_of(&resp)
        };
        self.record_result(&req.job_id, state, &resp).await;
        let record_us = lap.us();
        if let Ok(mut g) = self.running.lock() {
            g.remove(&req.job_id);
        }
        // Only now: a graceful shutdown waits for `active() == 0`, and must not exit
        // between the sandbox's end and the recorded result (the job would come back as
        // `worker_restarted`).
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        tracing::debug!(job_id = %req.job_id, record_us, "phases: finish");
        tracing::info!(job_id = %req.job_id, task_id = %req.task_id, state = ?state, exit_code = resp.exit_code, "job finished");
        resp
    }

    async fn execute_inner(
        self: &Arc<Self>,
        req: &RunJobRequest,
        accepted: AcceptedJob,
        cancel: &CancellationToken,
    ) -> RunJobResponse {
        let mut lap = crate::trace::Lap::start();
        let job = match PreparedJob::prepare(&self.cfg, req, accepted) {
            Ok(job) => job,
            Err(e) => return response::not_run(req, format!("cannot prepare job directory: {e}")),
        };
        let prepare_us = lap.us();
        let (job, servers) = match JobServers::start(self, req, job) {
            Ok(started) => started,
            Err(why) => return response::not_run(req, why),
        };
        tracing::debug!(job_id = %req.job_id, prepare_us, servers_us = lap.us(), "phases: start");
        tracing::info!(job_id = %req.job_id, task_id = %req.task_id, image = %req.sandbox.image, egress = job.egress_policy().is_some(), "job started");
        // A command job has no lifecycle socket: its `in_progress` is written while the
        // sandbox starts (no early return after this point) and awaited before the job's
        // answer, so the final state comes after it.
        let in_progress = req.sandbox.job_spec_json.is_none().then(|| {
            let store = self.store.clone();
            let job_id = req.job_id.clone();
            tokio::spawn(async move {
                let _ = store.set_state(&job_id, AsyncJobState::InProgress).await;
            })
        });
        let resp = job.run(self.backend.as_ref(), cancel).await;
        if let Some(w) = in_progress {
            let _ = w.await;
        }
        drop(servers);
        resp
    }

    /// `GET /jobs/{id}`.
    pub async fn status(&self, job_id: &str) -> Result<AsyncJobStatus, NodeError> {
        Ok(status_of(self.record(job_id).await?))
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
        let rec = self.finished_record(job_id).await?;
        let paths = JobPaths::new(&self.cfg, &rec.request);
        // Iterative and link-safe: a job can leave a tree far deeper than any stack.
        if let Err(e) = remove_tree_async(paths.root).await {
            return Err(NodeError::Internal(format!(
                "cannot remove job directory: {e}"
            )));
        }
        self.store.delete(job_id).await?;
        Ok(())
    }
}

/// A job_id reused for another request: idempotency is keyed on the request.
fn different_request(job_id: &str) -> NodeError {
    NodeError::Conflict(format!(
        "job {job_id} already exists with a different request; a job_id names one request"
    ))
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
