//! Every answer the node gives for a job, built in one place: the response of a job that
//! ran (from its sandbox's outcome, the disk guard's verdict, the egress audit, the
//! artifacts the node hashed and result.json), of one that never ran (failed before its
//! sandbox started, canceled while waiting), of one a restart interrupted (settled from
//! what its sandbox left, else `worker_restarted`), and the async state each maps to.

use cynode_protocol::egress::EgressAudit;
use cynode_protocol::result::{ArtifactRecord, JobStatus};
use cynode_protocol::worker_api::{
    AsyncJobState, RunJobRequest, RunJobResponse, WorkerJobStatus, API_VERSION,
};
use cynode_protocol::JobResult;

use super::{collect_artifacts, read_result, JobPaths};
use crate::backend::{EndReason, SandboxOutcome};
use crate::disk_guard::Breach;
use crate::sandbox_files::TreeError;

/// The failed answer for a job that never ran, with `reason`.
pub fn not_run(req: &RunJobRequest, reason: impl Into<String>) -> RunJobResponse {
    RunJobResponse::not_run(req, Some(reason.into()))
}

/// A job canceled while it waited for a slot.
pub fn canceled_before_start(req: &RunJobRequest) -> RunJobResponse {
    not_run(req, "canceled before it started")
}

/// A job a restart of the node interrupted, with nothing of its run to keep.
pub fn restarted(req: &RunJobRequest) -> RunJobResponse {
    not_run(req, "worker_restarted")
}

/// The async state a finished job's response means.
pub fn state_of(resp: &RunJobResponse) -> AsyncJobState {
    match resp.status {
        WorkerJobStatus::Completed => AsyncJobState::Completed,
        WorkerJobStatus::Failed => AsyncJobState::Failed,
        WorkerJobStatus::Timeout => AsyncJobState::Timeout,
    }
}

/// What a run left for its response, besides the files in its job directory.
pub(super) struct RunEnd {
    pub out: SandboxOutcome,
    pub started_at: String,
    pub ended_at: String,
    /// The sandbox's timeout, named in a timed-out job's reason.
    pub timeout_secs: u64,
    pub audit: Option<EgressAudit>,
    pub breach: Option<Breach>,
}

/// The response of a job whose sandbox ran (or failed to start): its outcome, then the
/// disk guard's breach, the artifacts the node hashed, and for an SBA job that exited,
/// result.json verified against them.
pub(super) async fn after_run(
    req: &RunJobRequest,
    paths: &JobPaths,
    end: RunEnd,
) -> RunJobResponse {
    let RunEnd {
        out,
        started_at,
        ended_at,
        timeout_secs,
        audit,
        breach,
    } = end;
    let mut resp = RunJobResponse {
        version: API_VERSION,
        task_id: req.task_id.clone(),
        job_id: req.job_id.clone(),
        status: WorkerJobStatus::Failed,
        exit_code: out.exit_code.unwrap_or(-1),
        stdout: out.stdout,
        stderr: out.stderr,
        started_at,
        ended_at,
        truncated: out.truncated,
        sba_result: None,
        artifacts: None,
        failure_reason: None,
        egress_dropped: audit.as_ref().map_or(0, |a| a.dropped),
        egress: audit.map(|a| a.records),
    };
    let artifacts = collect_artifacts(paths).await;
    match &out.end {
        EndReason::StartFailed(msg) => {
            resp.failure_reason = Some(msg.clone());
            return resp;
        }
        EndReason::TimedOut => {
            resp.status = WorkerJobStatus::Timeout;
            resp.exit_code = -1;
            resp.failure_reason = Some(format!(
                "sandbox killed after its timeout of {timeout_secs}s"
            ));
        }
        EndReason::Canceled => {
            resp.exit_code = -1;
            resp.failure_reason = Some("canceled".into());
        }
        EndReason::Exited => {
            resp.status = if resp.exit_code == 0 {
                WorkerJobStatus::Completed
            } else {
                WorkerJobStatus::Failed
            };
            if resp.exit_code == 137 {
                resp.failure_reason =
                    Some("sandbox killed by SIGKILL: memory or pids limit reached".into());
            }
        }
    }
    if let Some(b) = breach {
        tracing::warn!(job_id = %req.job_id, reason = %b, "job over its disk limit");
        resp.status = WorkerJobStatus::Failed;
        if out.end != EndReason::Exited {
            resp.exit_code = -1;
        }
        resp.failure_reason = Some(b.to_string());
        resp.artifacts = artifacts.ok();
        return resp;
    }
    let artifacts = match artifacts {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(job_id = %req.job_id, reason = %e, "artifacts refused");
            resp.status = WorkerJobStatus::Failed;
            resp.failure_reason = Some(artifacts_reason(&e));
            return resp;
        }
    };
    resp.artifacts = Some(artifacts.clone());
    if req.sandbox.job_spec_json.is_some() && out.end == EndReason::Exited {
        match read_result(paths).await {
            Ok(result) => apply_sba_result(&mut resp, result, &artifacts, true),
            Err(reason) => {
                resp.status = WorkerJobStatus::Failed;
                resp.failure_reason = Some(reason.to_string());
            }
        }
    }
    resp
}

/// The response of a job a restart interrupted: an SBA job whose result.json is complete
/// and verified (the same reads as after a run: beneath the job directory, no links,
/// bounded) keeps that result; any other fails as `worker_restarted`.
pub async fn after_restart(req: &RunJobRequest, paths: &JobPaths) -> RunJobResponse {
    let mut resp = restarted(req);
    if req.sandbox.job_spec_json.is_none() {
        return resp;
    }
    let Ok(result) = read_result(paths).await else {
        return resp;
    };
    match collect_artifacts(paths).await {
        Ok(artifacts) => {
            let mut settled = resp.clone();
            settled.failure_reason = None;
            settled.artifacts = Some(artifacts.clone());
            apply_sba_result(&mut settled, result, &artifacts, false);
            if settled.failure_reason.is_none() {
                resp = settled;
            }
        }
        Err(e) => {
            resp.failure_reason = Some(format!("worker_restarted; {}", artifacts_reason(&e)));
        }
    }
    resp
}

/// The failure reason for artifacts the node refused to collect, naming the cap.
pub fn artifacts_reason(e: &TreeError) -> String {
    let key = match e {
        TreeError::TooManyFiles(_) => "limits.artifact_max_files",
        TreeError::FileTooLarge { .. } => "limits.artifact_max_file_mb",
        TreeError::TotalTooLarge { .. } => "limits.artifact_max_total_mb",
        TreeError::TooSlow(_) => "limits.artifact_hash_seconds",
        TreeError::Read(r) => return format!("cannot collect artifacts: {r}"),
        TreeError::NotUtf8 { .. } => return format!("artifacts refused: {e}"),
    };
    format!("resource_limit_exceeded: artifacts: {e} ({key})")
}

/// Derives status from result.json; a missing or invalid one is a failure, never success.
/// With `exit_known`, a result claiming success from a sandbox that exited non-zero is a
/// failure too.
pub fn apply_sba_result(
    resp: &mut RunJobResponse,
    result: JobResult,
    host: &[ArtifactRecord],
    exit_known: bool,
) {
    if result.job_id != resp.job_id {
        resp.status = WorkerJobStatus::Failed;
        resp.failure_reason = Some(format!(
            "result.json is for job `{}`, not `{}`",
            result.job_id, resp.job_id
        ));
        return;
    }
    resp.status = match result.status {
        JobStatus::Success => WorkerJobStatus::Completed,
        JobStatus::Failure => WorkerJobStatus::Failed,
        JobStatus::Timeout => WorkerJobStatus::Timeout,
    };
    if exit_known && resp.status == WorkerJobStatus::Completed && resp.exit_code != 0 {
        resp.status = WorkerJobStatus::Failed;
        resp.failure_reason = Some(format!(
            "result.json reports success but the sandbox exited with code {}",
            resp.exit_code
        ));
        return;
    }
    for claimed in &result.artifacts {
        let found = host.iter().find(|h| h.path == claimed.path);
        if found != Some(claimed) {
            resp.status = WorkerJobStatus::Failed;
            resp.failure_reason = Some(format!(
                "artifact {} reported by the sandbox does not match the file the node hashed",
                claimed.path
            ));
        }
    }
    resp.sba_result = Some(result);
}
