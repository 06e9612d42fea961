//! Fallback for a worker that speaks only upstream CyNodeAI's Worker API (`GET /healthz`,
//! `GET /readyz`, synchronous `POST /v1/worker/jobs:run`): what the PM remembers about
//! such a worker, and how its jobs are shaped for it and read back.
//!
//! A worker is taken for upstream when `GET /v1/worker/capacity` answers 404; the client
//! remembers that for the worker ([`Flavor`]). The driver keeps using the async calls;
//! the client maps them:
//!
//! - `submit` starts one `jobs:run` in a task of its own and answers `accepted`; `status`
//!   answers `in_progress` until the synchronous answer arrives, then the terminal state
//!   with it; `ack` forgets it. A second `submit` of the same job id answers the job
//!   already known (as long as this process runs; after a restart the job runs again).
//! - `stop` drops the request: upstream's handler runs the job under the request's
//!   context, so a closed connection cancels it (best effort: whether the container goes
//!   too is up to its runtime).
//! - `capacity` is synthesised: ready from `/readyz`, no node limits (`max_running` is
//!   unbounded), and as load only the jobs this PM has running there.
//! - workspaces: upstream gives each job a fresh workspace and deletes it after, so
//!   `create_workspace` succeeds only without a seed, and a session's jobs do not see
//!   each other's files; `changeset` and artifact downloads do not exist (404).
//! - job.json is written in upstream's form ([`JobSpec::to_upstream`]); a job upstream
//!   cannot express, or an image whose name lacks `cynode-sba` (the only images
//!   upstream's worker hands a job.json to), ends as a failed job whose
//!   `failure_reason` says why, so the model can choose differently.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cynode_protocol::job::JobSpec;
use cynode_protocol::worker_api::{
    AsyncJobState, AsyncJobStatus, RunJobRequest, RunJobResponse, WorkerJobStatus, API_VERSION,
    MAX_TIMEOUT_SECONDS,
};
use serde_json::{json, Value};

use super::DispatchError;

/// Which Worker API a worker speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// This project's API, with its extensions.
    Native,
    /// Upstream CyNodeAI's: health, readiness and synchronous jobs only.
    Upstream,
}

/// Seconds a sandbox gets beyond the job's own deadline to start and to write its result.
const START_GRACE_SECONDS: u64 = 30;
/// Seconds the HTTP call waits beyond the sandbox timeout for the worker's answer.
const ANSWER_GRACE_SECONDS: u64 = 60;

/// One job sent to an upstream worker.
enum Slot {
    Running(tokio::task::AbortHandle),
    Done(Result<Box<RunJobResponse>, DispatchError>),
    Canceled,
}

/// What a client knows about its worker's API, shared by its clones.
#[derive(Default)]
pub(super) struct State {
    flavor: Mutex<Option<Flavor>>,
    jobs: Mutex<HashMap<String, Slot>>,
}

impl State {
    pub(super) fn flavor(&self) -> Option<Flavor> {
        self.flavor.lock().ok().and_then(|f| *f)
    }

    pub(super) fn set_flavor(&self, f: Flavor) {
        if let Ok(mut g) = self.flavor.lock() {
            if *g != Some(f) && f == Flavor::Upstream {
                tracing::info!("the worker speaks only upstream CyNodeAI's Worker API: synchronous jobs, no workspaces, no artifact download");
            }
            *g = Some(f);
        }
    }

    /// Jobs running now.
    pub(super) fn running(&self) -> u64 {
        self.jobs.lock().map_or(0, |j| {
            j.values().filter(|s| matches!(s, Slot::Running(_))).count() as u64
        })
    }

    /// The status of a known job, `None` when this process never sent it.
    pub(super) fn status(
        &self,
        req_task: &str,
        job_id: &str,
    ) -> Option<Result<AsyncJobStatus, DispatchError>> {
        let jobs = self.jobs.lock().ok()?;
        let slot = jobs.get(job_id)?;
        let (status, result) = match slot {
            Slot::Running(_) => (AsyncJobState::InProgress, None),
            Slot::Canceled => (AsyncJobState::Canceled, None),
            Slot::Done(Err(e)) => return Some(Err(e.clone())),
            Slot::Done(Ok(r)) => {
                let s = match r.status {
                    WorkerJobStatus::Completed => AsyncJobState::Completed,
                    WorkerJobStatus::Failed => AsyncJobState::Failed,
                    WorkerJobStatus::Timeout => AsyncJobState::Timeout,
                };
                (s, Some((**r).clone()))
            }
        };
        let task_id = result
            .as_ref()
            .map_or_else(|| req_task.to_string(), |r| r.task_id.clone());
        Some(Ok(AsyncJobStatus {
            version: API_VERSION,
            task_id,
            job_id: job_id.to_string(),
            status,
            result,
        }))
    }

    /// Records a job that is starting; false when it is already known.
    pub(super) fn start(&self, job_id: &str, abort: tokio::task::AbortHandle) -> bool {
        let Ok(mut jobs) = self.jobs.lock() else {
            return false;
        };
        if jobs.contains_key(job_id) {
            abort.abort();
            return false;
        }
        jobs.insert(job_id.to_string(), Slot::Running(abort));
        true
    }

    pub(super) fn finish(&self, job_id: &str, r: Result<RunJobResponse, DispatchError>) {
        if let Ok(mut jobs) = self.jobs.lock() {
            if let Some(Slot::Canceled) = jobs.get(job_id) {
                return;
            }
            jobs.insert(job_id.to_string(), Slot::Done(r.map(Box::new)));
        }
    }

    /// Stops a running job (drops its request); known jobs only.
    pub(super) fn cancel(&self, job_id: &str) -> bool {
        let Ok(mut jobs) = self.jobs.lock() else {
            return false;
        };
        match jobs.get(job_id) {
            Some(Slot::Running(h)) => {
                h.abort();
                jobs.insert(job_id.to_string(), Slot::Canceled);
                true
            }
            Some(_) => true,
            None => false,
        }
    }

    pub(super) fn forget(&self, job_id: &str) {
        if let Ok(mut jobs) = self.jobs.lock() {
            jobs.remove(job_id);
        }
    }
}

/// A `jobs:run` body for an upstream worker, the step ids of the job (by position), and
/// how long the HTTP call may wait; or why upstream cannot run this job.
pub(super) struct Prepared {
    pub body: Value,
    pub step_ids: Vec<String>,
    pub wait: Duration,
}

/// Shapes `req` for upstream (see the module doc).
pub(super) fn prepare(req: &RunJobRequest) -> Result<Prepared, String> {
    let sandbox = &req.sandbox;
    let mut step_ids = Vec::new();
    let mut timeout = sandbox.timeout_seconds;
    let job_spec_json = match &sandbox.job_spec_json {
        None => None,
        Some(text) => {
            if !cynode_is_sba_image(&sandbox.image) {
                return Err(format!(
                    "an upstream CyNodeAI worker hands job_spec_json only to an image whose name contains `cynode-sba`; `{}` does not (name such an image for this worker's purposes)",
                    sandbox.image
                ));
            }
            let job = JobSpec::from_json(text.as_bytes())
                .map_err(|e| format!("the job does not validate: {e}"))?;
            let up = job
                .to_upstream()
                .map_err(|e| format!("this job cannot run on an upstream CyNodeAI worker: {e}"))?;
            step_ids = job.steps.iter().map(|s| s.id.clone()).collect();
            timeout.get_or_insert(job.constraints.max_runtime_seconds + START_GRACE_SECONDS);
            Some(up.to_string())
        }
    };
    let timeout = timeout
        .unwrap_or(cynode_protocol::worker_api::DEFAULT_TIMEOUT_SECONDS)
        .min(MAX_TIMEOUT_SECONDS);
    let mut sb = serde_json::Map::new();
    sb.insert("image".into(), json!(sandbox.image));
    sb.insert(
        "command".into(),
        if sandbox.command.is_empty() {
            Value::Null
        } else {
            json!(sandbox.command)
        },
    );
    if !sandbox.env.is_empty() {
        sb.insert("env".into(), json!(sandbox.env));
    }
    sb.insert("timeout_seconds".into(), json!(timeout));
    if let Some(p) = sandbox.network_policy {
        sb.insert("network_policy".into(), json!(p));
    }
    if sandbox.use_inference == Some(true) {
        sb.insert("use_inference".into(), json!(true));
    }
    if let Some(j) = job_spec_json {
        sb.insert("job_spec_json".into(), json!(j));
    }
    Ok(Prepared {
        body: json!({ "version": API_VERSION, "task_id": req.task_id, "job_id": req.job_id, "sandbox": sb }),
        step_ids,
        wait: Duration::from_secs(timeout + ANSWER_GRACE_SECONDS),
    })
}

/// Upstream's `isSBARunnerImage`.
fn cynode_is_sba_image(image: &str) -> bool {
    image.contains("cynode-sba")
}

/// Fills in what upstream's answer lacks and this PM knows: the task id and the job's
/// step ids (upstream numbers steps, `index`).
pub(super) fn adopt(
    mut resp: RunJobResponse,
    req: &RunJobRequest,
    step_ids: &[String],
) -> RunJobResponse {
    if let Some(r) = &mut resp.sba_result {
        if r.task_id.is_empty() {
            r.task_id = req.task_id.clone();
        }
        for s in &mut r.steps {
            if s.id.is_empty() {
                if let Some(id) = usize::try_from(s.index).ok().and_then(|i| step_ids.get(i)) {
                    s.id = id.clone();
                }
            }
        }
    }
    resp
}

/// The failed answer of a job upstream cannot run, saying why.
pub(super) fn refused(req: &RunJobRequest, why: String) -> RunJobResponse {
    RunJobResponse::not_run(req, Some(why))
}

/// The error for what an upstream worker does not offer.
pub(super) fn not_offered(what: &str) -> DispatchError {
    DispatchError::NotFound(format!(
        "{what}: the worker speaks only upstream CyNodeAI's Worker API"
    ))
}

/// Shared state handle.
pub(super) type Shared = Arc<State>;

#[cfg(test)]
mod tests {
    use super::*;

    fn req(image: &str, steps: Value) -> RunJobRequest {
        let job = json!({
            "protocol_version": "1.0", "job_id": "j-1", "task_id": "t-1",
            "constraints": { "max_runtime_seconds": 90, "max_output_bytes": 100, "allowed_commands": ["echo"] },
            "steps": steps
        });
        RunJobRequest::sba("t-1", "j-1", image, job.to_string(), Some("ws".into()))
    }

    #[test]
    fn a_job_goes_in_upstreams_shape_with_its_own_timeout() {
        let r = req(
            "localhost/cynode-sba:latest",
            json!([{ "id": "say", "type": "run_command", "arguments": { "command": "echo", "args": ["hi"] } }]),
        );
        let p = prepare(&r).unwrap();
        let spec: Value =
            serde_json::from_str(p.body["sandbox"]["job_spec_json"].as_str().unwrap()).unwrap();
        assert_eq!(
            spec["steps"],
            json!([{ "type": "run_command", "args": { "argv": ["echo", "hi"] } }])
        );
        assert!(spec["constraints"].get("allowed_commands").is_none());
        assert_eq!(p.body["sandbox"]["command"], Value::Null);
        assert_eq!(p.body["sandbox"]["timeout_seconds"], 120);
        assert!(p.body.get("workspace_id").is_none());
        assert_eq!(p.step_ids, ["say"]);
        assert_eq!(p.wait, Duration::from_secs(180));
    }

    #[test]
    fn an_image_upstream_would_not_hand_the_job_is_refused_with_the_reason() {
        let r = req(
            "localhost/tools:latest",
            json!([{ "id": "a", "type": "list_tree", "arguments": {} }]),
        );
        let why = prepare(&r).err().unwrap();
        assert!(why.contains("contains `cynode-sba`"), "{why}");
        let resp = refused(&r, why);
        assert_eq!((resp.status, resp.exit_code), (WorkerJobStatus::Failed, -1));
    }

    #[test]
    fn upstreams_answer_gets_the_step_ids_back() {
        let r = req("cynode-sba", json!([]));
        let resp: RunJobResponse = serde_json::from_value(json!({
            "version": 1, "task_id": "t-1", "job_id": "j-1", "status": "completed",
            "stdout": "", "stderr": "", "started_at": "", "ended_at": "",
            "truncated": { "stdout": false, "stderr": false },
            "sba_result": { "protocol_version": "1.0", "job_id": "j-1", "status": "success",
                "steps": [{ "index": 1, "type": "list_tree", "status": "success", "output": "a\n" },
                          { "index": 0, "type": "list_tree", "status": "success" }],
                "artifacts": null }
        }))
        .unwrap();
        let got = adopt(resp, &r, &["first".into(), "second".into()]);
        let sba = got.sba_result.unwrap();
        let ids: Vec<&str> = sba.steps.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(
            (ids, sba.task_id.as_str()),
            (vec!["second", "first"], "t-1")
        );
    }
}
