//! One job end to end without the model loop, the skill author's loop (`cynode-pm skills
//! run`, `jobs run`, and the MCP tool `skills.run`). The job (a skill rendered from
//! inputs with [`render`], or a job.json) is placed on a worker of the pool, judged by
//! the policy gate with the placed worker's image, run in a workspace of its own (seeded
//! when asked), waited for, and every artifact it reports fetched and checked against
//! its sha256 before it is stored ([`crate::artifacts::verify_and_store`]). The same
//! pieces the session loop uses: the skill renderer, [`WorkerPool`] placement, the
//! policy gate and [`WorkerClient`].
//!
//! The job runs offline (`network_policy` none) and without the sandbox gateway: a job
//! that needs it is a session's. An agent job reaches the model through its worker's
//! inference upstream (a local worker's is the command's model or its relay).
//!
//! Each failure has a kind and the exit code the command line gives it: 1 the job ran and
//! failed; 4 invalid inputs or job.json ([`EXIT_INVALID`]); 5 denied by the policy
//! ([`EXIT_DENIED`]); 6 an artifact failed verification ([`EXIT_ARTIFACT`]); 7 no worker
//! could take or run the job ([`EXIT_WORKER`]).

use std::path::Path;
use std::time::Duration;

use cynode_protocol::worker_api::{RunJobRequest, RunJobResponse, WorkerJobStatus};
use serde_json::{json, Value};

use crate::artifacts::{verify_and_store, ArtifactError};
use crate::dispatch::WorkerClient;
use crate::policy::{PolicyGate, PolicyInput, TenantPolicy};
use crate::skills::{build_job, BuildError, JobRef, Skill};
use crate::workers::WorkerPool;

/// The job ran and did not complete.
pub const EXIT_FAILED: i32 = 1;
/// The inputs do not match the skill's schema, or the job.json is invalid.
pub const EXIT_INVALID: i32 = 4;
/// The policy gate denied the job.
pub const EXIT_DENIED: i32 = 5;
/// An artifact's bytes do not match the sha256 (or size) the sandbox reported, or it
/// could not be fetched or stored.
pub const EXIT_ARTIFACT: i32 = 6;
/// No worker could take the job, or the worker refused or lost it.
pub const EXIT_WORKER: i32 = 7;

/// Beyond the job's own `max_runtime_seconds`, how long to wait for its end
/// (queueing, start-up, collecting the result) before giving up on the worker.
const WAIT_MARGIN: Duration = Duration::from_secs(120);

/// Why a job run did not succeed: a kind, the exit code, a message, and the field it
/// is about (a JSON pointer into the inputs or the job) when there is one.
#[derive(Debug)]
pub struct Failure {
    pub kind: &'static str,
    pub exit: i32,
    pub message: String,
    pub path: Option<String>,
    pub details: Value,
}

impl Failure {
    pub fn new(kind: &'static str, exit: i32, message: impl Into<String>) -> Self {
        Self {
            kind,
            exit,
            message: message.into(),
            path: None,
            details: Value::Null,
        }
    }

    pub fn at(mut self, path: impl Into<String>) -> Self {
        self.path = Some(path.into());
        self
    }

    pub fn with(mut self, details: Value) -> Self {
        self.details = details;
        self
    }

    /// `{kind, message, exit_code, path?, …details}`.
    pub fn json(&self) -> Value {
        let mut e = json!({ "kind": self.kind, "message": self.message, "exit_code": self.exit });
        if let Some(p) = &self.path {
            e["path"] = json!(p);
        }
        if let Value::Object(extra) = &self.details {
            for (k, v) in extra {
                e[k] = v.clone();
            }
        }
        e
    }
}

/// A job ready to be placed: its canonical bytes, parsed value, ids and skill.
pub struct ReadyJob<'a> {
    pub canonical: String,
    pub value: Value,
    pub job_id: String,
    pub task_id: String,
    pub skill: &'a Skill,
}

/// Renders `skill` with `inputs` (checked against its schema) as a job of its own.
pub fn render<'a>(skill: &'a Skill, inputs: &Value) -> Result<ReadyJob<'a>, Failure> {
    let r = JobRef {
        session_id: format!("skills-run-{}", uuid::Uuid::new_v4()),
        task_id: "run".into(),
        attempt: 0,
    };
    let built = build_job(skill, inputs, &r).map_err(build_failure)?;
    Ok(ReadyJob {
        canonical: String::from_utf8_lossy(&built.canonical).into_owned(),
        value: built.value,
        job_id: built.job.job_id.clone(),
        task_id: built.job.task_id.clone(),
        skill,
    })
}

fn build_failure(e: BuildError) -> Failure {
    match e {
        BuildError::Inputs { path, message } => {
            let pointer = if path.is_empty() { "/".into() } else { path };
            Failure::new(
                "invalid_inputs",
                EXIT_INVALID,
                format!("inputs{pointer}: {message}"),
            )
            .at(pointer)
        }
        other => Failure::new("invalid_job", EXIT_INVALID, other.to_string()),
    }
}

/// `constraints.max_runtime_seconds` → `/constraints/max_runtime_seconds`; `.` → `/`.
pub fn dotted_to_pointer(path: &str) -> String {
    if path == "." || path.is_empty() {
        return "/".into();
    }
    let mut out = String::new();
    for seg in path.split('.') {
        // `steps[0]` → `/steps/0`
        let mut rest = seg;
        if let Some(i) = rest.find('[') {
            out.push('/');
            out.push_str(&rest[..i]);
            rest = &rest[i..];
            while let Some(end) = rest.find(']') {
                out.push('/');
                out.push_str(&rest[1..end]);
                rest = &rest[end + 1..];
            }
        } else {
            out.push('/');
            out.push_str(rest);
        }
    }
    out
}

/// Where [`execute`] runs a job: the workers, the gate, the tenant's settings, the
/// workspace's seed and where verified artifacts are stored.
pub struct Env<'a> {
    pub pool: &'a WorkerPool,
    pub gate: &'a PolicyGate,
    pub tenant: &'a TenantPolicy,
    /// The directory the job's workspace is seeded from (canonical; the worker checks it
    /// is under one of its seed roots). None: an empty workspace.
    pub seed: Option<&'a Path>,
    pub artifacts_dir: &'a Path,
}

/// Places, policy-checks, runs and waits for `job`, then verifies its artifacts: the
/// job's result (`job_id`, `status`, verified `artifacts`, `changeset`, the runner's
/// `result`…), or why not.
pub async fn execute(job: ReadyJob<'_>, env: &Env<'_>) -> Result<Value, Failure> {
    let pool = env.pool;
    let tenant = env.tenant;
    let gate = env.gate;
    let seed = env.seed;
    let manifest = &job.skill.manifest;
    let placement = match pool.place(&manifest.purpose).await {
        Ok(p) => p,
        Err(e) => {
            return Err(Failure::new(
                "worker_unavailable",
                EXIT_WORKER,
                e.to_string(),
            ))
        }
    };
    let input = PolicyInput::for_job(
        job.value.clone(),
        manifest,
        Some(&placement.image),
        tenant.clone(),
    );
    let decision = gate.evaluate(&input).await;
    if !decision.allowed {
        let deny: Vec<Value> = decision
            .deny
            .iter()
            .map(|v| json!({ "rule": v.rule, "message": v.message }))
            .collect();
        return Err(Failure::new(
            "policy_denied",
            EXIT_DENIED,
            format!("the policy denies the job: {}", decision.denial_summary()),
        )
        // The PM seed's shape of a policy error (`type`, `reason`) beside ours.
        .with(json!({ "deny": deny, "type": "error", "reason": "policy_violation" })));
    }
    let Some(worker) = pool.client(&placement.worker_id) else {
        return Err(Failure::new(
            "worker_unavailable",
            EXIT_WORKER,
            format!("worker {} is not in the pool", placement.worker_id),
        ));
    };
    let workspace_id = format!("run-{}", uuid::Uuid::new_v4());
    let worker_err = |what: &str, e: crate::dispatch::DispatchError| {
        Failure::new(
            "worker_error",
            EXIT_WORKER,
            format!("worker {}: {what}: {e}", placement.worker_id),
        )
    };
    if let Err(e) = worker.create_workspace(&workspace_id, seed).await {
        return Err(worker_err("cannot create the workspace", e));
    }
    let mut req = RunJobRequest::sba(
        &job.task_id,
        &job.job_id,
        &placement.image,
        job.canonical.clone(),
        Some(workspace_id.clone()),
    );
    // Revoked when this returns (the job ended, or waiting for it failed).
    let _inference_key = crate::inference_relay::job_keys::for_request(&job.canonical, &mut req);
    if let Err(e) = worker.submit(&req).await {
        return Err(worker_err("refused the job", e));
    }
    let runtime = job.value["constraints"]["max_runtime_seconds"]
        .as_u64()
        .unwrap_or(manifest.limits.max_runtime_seconds);
    let resp = match wait(
        worker,
        &job.job_id,
        Duration::from_secs(runtime) + WAIT_MARGIN,
    )
    .await
    {
        Ok(r) => r,
        Err(f) => return Err(f),
    };
    let dir = env.artifacts_dir;
    let (verified, rejected) = collect_artifacts(worker, &job.job_id, &resp, dir).await;
    // What the job changed in its workspace, when it completed.
    let changeset = if resp.status == WorkerJobStatus::Completed {
        worker
            .changeset(&workspace_id)
            .await
            .ok()
            .filter(|d| !d.trim().is_empty())
    } else {
        None
    };
    if let Err(e) = worker.ack(&job.job_id).await {
        tracing::warn!(job_id = %job.job_id, error = %e, "ack failed; the worker's retention will clean up");
    }
    let status = format!("{:?}", resp.status).to_lowercase();
    let failure = resp.sba_result.as_ref().and_then(|r| {
        r.failure_code
            .as_ref()
            .map(|c| json!({ "code": c, "message": r.failure_message }))
    });
    let result = json!({
        "job_id": job.job_id,
        "task_id": job.task_id,
        "skill_id": manifest.skill_id,
        "worker_id": placement.worker_id,
        "image": placement.image,
        "workspace_id": workspace_id,
        "status": status,
        "exit_code": resp.exit_code,
        "failure": failure.or_else(|| resp.failure_reason.as_ref().map(|r| json!({ "message": r }))),
        "artifacts": verified,
        "rejected_artifacts": rejected,
        "changeset": changeset,
        "result": resp.sba_result,
    });
    if !rejected.is_empty() {
        return Err(Failure::new(
            "artifact_integrity_failure",
            EXIT_ARTIFACT,
            format!(
                "{} artifact(s) of job {} failed verification",
                rejected.len(),
                job.job_id
            ),
        )
        .with(json!({ "job": result })));
    }
    if resp.status != WorkerJobStatus::Completed {
        return Err(Failure::new(
            "job_failed",
            EXIT_FAILED,
            format!("job {} ended {status}", job.job_id),
        )
        .with(json!({ "job": result })));
    }
    Ok(result)
}

/// Polls the job until it ends (the worker's own backoff), at most `limit`.
async fn wait(
    worker: &WorkerClient,
    job_id: &str,
    limit: Duration,
) -> Result<RunJobResponse, Failure> {
    let deadline = tokio::time::Instant::now() + limit;
    let (mut delay, max_delay) = worker.poll;
    loop {
        let s = worker.status(job_id).await.map_err(|e| {
            Failure::new(
                "worker_error",
                EXIT_WORKER,
                format!("status of job {job_id}: {e}"),
            )
        })?;
        if s.status.is_terminal() {
            return s.result.ok_or_else(|| {
                Failure::new(
                    "worker_error",
                    EXIT_WORKER,
                    format!("job {job_id} ended without a result"),
                )
            });
        }
        if tokio::time::Instant::now() >= deadline {
            let _ = worker.stop(job_id).await;
            return Err(Failure::new(
                "worker_error",
                EXIT_WORKER,
                format!(
                    "job {job_id} did not end within {}s; stopped",
                    limit.as_secs()
                ),
            ));
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(max_delay);
    }
}

/// Fetches every artifact the job's result reports and stores those whose bytes match
/// their sha256 and size ([`verify_and_store`]); returns the verified ones and the
/// rejected ones, each with why.
async fn collect_artifacts(
    worker: &WorkerClient,
    job_id: &str,
    resp: &RunJobResponse,
    dir: &Path,
) -> (Vec<Value>, Vec<Value>) {
    let claimed = resp
        .sba_result
        .as_ref()
        .map(|r| r.artifacts.clone())
        .unwrap_or_default();
    let mut verified = Vec::new();
    let mut rejected = Vec::new();
    for a in &claimed {
        let stored = worker
            .artifact(job_id, &a.path)
            .await
            .map_err(|e| ArtifactError::Fetch(e.to_string()))
            .and_then(|bytes| verify_and_store(dir, &a.path, &a.sha256, a.size_bytes, &bytes));
        match stored {
            Ok(loc) => verified.push(json!({
                "path": a.path, "sha256": a.sha256, "size_bytes": a.size_bytes,
                "location": loc.display().to_string(),
            })),
            Err(e) => rejected.push(json!({
                "path": a.path, "sha256": a.sha256, "size_bytes": a.size_bytes,
                "error": e.to_string(),
            })),
        }
    }
    (verified, rejected)
}

#[cfg(test)]
mod tests {
    #[test]
    fn protocol_paths_become_json_pointers() {
        assert_eq!(
            super::dotted_to_pointer("constraints.max_runtime_seconds"),
            "/constraints/max_runtime_seconds"
        );
        assert_eq!(
            super::dotted_to_pointer("steps[0].argv[2]"),
            "/steps/0/argv/2"
        );
        assert_eq!(super::dotted_to_pointer("."), "/");
    }
}
