//! From a validated request to a response the caller can trust: lay out the job
//! directory, build the sandbox spec (mounts, env, limits), run it, and read back what the
//! sandbox left, verifying every artifact's hash on the host. Everything the sandbox left is
//! read through [`crate::sandbox_files`] (beneath the job directory, no links, regular
//! files only, bounded), and the job's disk use is held to its limit by
//! [`crate::disk_guard`].
//!
//! Job directory layout (`<state>/jobs/<job_id>/`): `request.json`, and `job/` which is
//! mounted at `/job` (job.json, result.json, artifacts/, status.sock, and for jobs that use
//! inference inference.sock and the agent's todo.json).

use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cynode_protocol::job::{ExecutionMode, JobSpec};
use cynode_protocol::result::{ArtifactRecord, JobStatus};
use cynode_protocol::worker_api::{
    NetworkPolicy, RunJobRequest, RunJobResponse, WorkerJobStatus, API_VERSION,
};
use cynode_protocol::{JobResult, ValidationError};
use tokio_util::sync::CancellationToken;

use crate::backend::{EndReason, SandboxBackend};
use crate::config::{Config, Limits};
use crate::disk_guard::DiskLimit;
use crate::job_dir;
use crate::job_egress::JobEgress;
use crate::sandbox::{self, SandboxRequest, SandboxSpec};
use crate::sandbox_files::{self, ReadError, TreeBounds, TreeError};
use cynode_protocol::time::now_rfc3339;

/// Validates a request completely before anything is created or started.
pub fn validate(cfg: &Config, req: &RunJobRequest) -> Result<Option<JobSpec>, ValidationError> {
    req.validate()?;
    let network = crate::job_egress::policy(cfg, req)?;
    if !cfg.image_allowed(&req.sandbox.image) {
        return Err(ValidationError::new(
            "sandbox.image",
            format!(
                "image `{}` is not in this node's image allowlist",
                req.sandbox.image
            ),
        ));
    }
    let Some(text) = &req.sandbox.job_spec_json else {
        inference_models(cfg, req)?;
        return Ok(None);
    };
    let job = JobSpec::from_json(text.as_bytes()).map_err(|errs| {
        let first = errs
            .0
            .into_iter()
            .next()
            .unwrap_or_else(|| ValidationError::new(".", "invalid"));
        let path = if first.path == "." {
            "sandbox.job_spec_json".to_string()
        } else {
            format!("sandbox.job_spec_json.{}", first.path)
        };
        ValidationError::new(path, first.message)
    })?;
    if job.job_id != req.job_id {
        return Err(ValidationError::new(
            "sandbox.job_spec_json.job_id",
            "must equal job_id",
        ));
    }
    if job.task_id != req.task_id {
        return Err(ValidationError::new(
            "sandbox.job_spec_json.task_id",
            "must equal task_id",
        ));
    }
    inference_models(cfg, req)?;
    if job.constraints.ext_net_allowed && network.is_none() {
        return Err(ValidationError::new(
            "sandbox.job_spec_json.constraints.ext_net_allowed",
            "needs sandbox.network_policy `restricted` (the node's egress proxy); \
             a sandbox has no other network",
        ));
    }
    Ok(Some(job))
}

/// The models a job may use through the node's inference proxy, or `None` when the job
/// needs no proxy: only jobs with `use_inference` or in agent mode get one. The job's
/// `inference.allowed_models` (a command job: the node's list), cut to the models the node
/// offers. On a node without an upstream the job runs without a proxy, as upstream CyNodeAI
/// runs it (its prompt-mode tasks always set `use_inference`): a job that really needs a
/// model then fails on its own. A job left with no model the node offers is refused.
pub fn inference_models(
    cfg: &Config,
    req: &RunJobRequest,
) -> Result<Option<Vec<String>>, ValidationError> {
    let job = req
        .sandbox
        .job_spec_json
        .as_deref()
        .and_then(|t| JobSpec::from_json(t.as_bytes()).ok());
    let agent = job
        .as_ref()
        .is_some_and(|j| j.effective_mode() == ExecutionMode::AgentInference);
    if !agent && req.sandbox.use_inference != Some(true) {
        return Ok(None);
    }
    let field = if agent {
        "sandbox.job_spec_json.inference.allowed_models"
    } else {
        "sandbox.use_inference"
    };
    let Some(inf) = &cfg.inference else {
        tracing::info!(
            job_id = %req.job_id,
            field,
            "the job asks for inference and this node has no upstream (config `inference.base_url`): it runs without a proxy"
        );
        return Ok(None);
    };
    let wanted: Vec<String> = match job.as_ref().and_then(|j| j.inference.as_ref()) {
        Some(i) if !i.allowed_models.is_empty() => i.allowed_models.clone(),
        _ => inf.models.clone(),
    };
    let models: Vec<String> = wanted
        .into_iter()
        .filter(|m| inf.models.is_empty() || inf.models.contains(m))
        .collect();
    if models.is_empty() {
        return Err(ValidationError::new(
            field,
            format!(
                "no model the job allows is offered by this node (inference.models: {})",
                inf.models.join(", ")
            ),
        ));
    }
    Ok(Some(models))
}

/// How long the node reads result.json at most.
const RESULT_READ_TIME: Duration = Duration::from_secs(10);

/// result.json's name in the job directory.
pub const RESULT_FILE: &str = "result.json";
/// The artifacts directory's name in the job directory.
pub const ARTIFACTS_DIR: &str = "artifacts";

/// Paths of one job on the host, and the bounds on what the node reads from them.
#[derive(Debug, Clone)]
pub struct JobPaths {
    pub root: PathBuf,
    pub mount: PathBuf,
    pub workspace: PathBuf,
    pub bounds: HostBounds,
}

/// Bounds on the node's work over what a sandbox left (config `limits`).
#[derive(Debug, Clone, Copy)]
pub struct HostBounds {
    pub disk: DiskLimit,
    pub result_max_bytes: u64,
    pub artifacts: TreeBounds,
}

impl HostBounds {
    /// From the node's limits.
    pub fn from_limits(l: &Limits) -> Self {
        const MB: u64 = 1024 * 1024;
        HostBounds {
            disk: DiskLimit::from_limits(l),
            result_max_bytes: l.result_max_bytes,
            artifacts: TreeBounds {
                max_files: l.artifact_max_files,
                max_file_bytes: l.artifact_max_file_mb.saturating_mul(MB),
                max_total_bytes: l.artifact_max_total_mb.saturating_mul(MB),
                time: Duration::from_secs(l.artifact_hash_seconds.max(1)),
            },
        }
    }
}

impl JobPaths {
    /// The paths for `req` under `cfg`'s state directory.
    pub fn new(cfg: &Config, req: &RunJobRequest) -> Self {
        let root = cfg.jobs_dir().join(&req.job_id);
        let ws = req
            .workspace_id
            .clone()
            .unwrap_or_else(|| req.task_id.clone());
        JobPaths {
            mount: root.join("job"),
            root,
            workspace: cfg.workspaces_dir().join(ws),
            bounds: HostBounds::from_limits(&cfg.limits),
        }
    }

    pub fn result(&self) -> PathBuf {
        self.mount.join(RESULT_FILE)
    }

    pub fn artifacts(&self) -> PathBuf {
        self.mount.join(ARTIFACTS_DIR)
    }
}

/// Creates the job directory (`request.json`, `job/`, `job/artifacts/`, and `job/job.json`
/// for SBA jobs) and the workspace when missing. The job directory must not exist: one
/// that does (a retained job's, with links a job planted in it) is refused, never reused.
/// Every step goes through a directory fd without following links ([`crate::job_dir`]).
/// What the sandbox writes is owned by `host_uid`, the workspace's ([`crate::uid_pool`]).
pub fn prepare(paths: &JobPaths, req: &RunJobRequest, host_uid: u32) -> std::io::Result<()> {
    let (jobs, name) = job_dir::split(&paths.root)?;
    let root = job_dir::create_new_dir(job_dir::open_node_dir(jobs)?.as_fd(), name)?;
    job_dir::write_new_file(
        root.as_fd(),
        OsStr::new("request.json"),
        &serde_json::to_vec_pretty(req)?,
        None,
        0o600,
    )?;
    job_dir::own(&root, None, 0o755)?;
    let mount = job_dir::create_new_dir(root.as_fd(), OsStr::new("job"))?;
    // The kernel's disk limit: a volume of its own on `job/`, before anything is in it.
    let label = format!("job-{}", req.job_id);
    let mount = crate::loopfs::cover(root.as_fd(), OsStr::new("job"), &label).unwrap_or(mount);
    let artifacts = job_dir::create_new_dir(mount.as_fd(), OsStr::new(ARTIFACTS_DIR))?;
    job_dir::own(&artifacts, Some(host_uid), 0o755)?;
    if let Some(spec) = &req.sandbox.job_spec_json {
        job_dir::write_new_file(
            mount.as_fd(),
            OsStr::new("job.json"),
            spec.as_bytes(),
            Some(host_uid),
            0o644,
        )?;
    }
    job_dir::own(&mount, Some(host_uid), 0o755)?;
    let (spaces, ws) = job_dir::split(&paths.workspace)?;
    let spaces = job_dir::open_node_dir(spaces)?;
    let label = format!("ws-{}", ws.to_string_lossy());
    if !crate::loopfs::new_volume_dir(spaces.as_fd(), ws, &label, host_uid)? {
        job_dir::open_or_create_owned_dir(spaces.as_fd(), ws, host_uid)?;
    }
    Ok(())
}

/// The sandbox spec for `req`: its env (the request's, then the node's job variables;
/// an SBA job's own `SBA_*` and `INFERENCE_PROXY_URL` come from the node only), the job
/// directory and workspace mounts, the node's limits, and the workspace's `host_uid`.
pub fn sandbox_spec(
    cfg: &Config,
    req: &RunJobRequest,
    paths: &JobPaths,
    host_uid: u32,
) -> SandboxSpec {
    let is_sba = req.sandbox.job_spec_json.is_some();
    let mut node = vec![
        (sandbox::ENV_TASK_ID, req.task_id.clone()),
        (sandbox::ENV_JOB_ID, req.job_id.clone()),
        (sandbox::ENV_WORKSPACE_DIR, sandbox::WORKSPACE_MOUNT.into()),
        (sandbox::ENV_ARTIFACTS_DIR, sandbox::ARTIFACTS_MOUNT.into()),
    ];
    if is_sba {
        node.push((sandbox::ENV_SBA_STATUS_URL, sandbox::STATUS_URL.into()));
    }
    if matches!(inference_models(cfg, req), Ok(Some(_))) {
        node.push((sandbox::ENV_INFERENCE_PROXY_URL, sandbox::PROXY_URL.into()));
        if let Some(turns) = cfg.inference.as_ref().and_then(|i| i.agent_max_turns) {
            node.push((sandbox::ENV_SBA_AGENT_MAX_TURNS, turns.to_string()));
        }
    }
    node.extend(crate::job_egress::env(matches!(
        crate::job_egress::policy(cfg, req),
        Ok(Some(_))
    )));
    let env = sandbox::env(
        &req.sandbox.env,
        |k| k == sandbox::ENV_INFERENCE_PROXY_URL || (is_sba && k.starts_with("SBA_")),
        node,
    );
    let l = &cfg.limits;
    sandbox::spec(
        l,
        SandboxRequest {
            name: format!("cynode-{}", req.job_id),
            image: req.sandbox.image.clone(),
            command: req.sandbox.command.clone(),
            override_entrypoint: !is_sba,
            env,
            workspace: paths.workspace.clone(),
            job_dir: Some(paths.mount.clone()),
            network: req.sandbox.network_policy.unwrap_or(NetworkPolicy::None),
            labels: vec![
                ("cynodeai.task_id".into(), req.task_id.clone()),
                ("cynodeai.job_id".into(), req.job_id.clone()),
            ],
            timeout: Duration::from_secs(l.effective_timeout(req.sandbox.timeout_seconds)),
            host_uid,
        },
    )
}

/// Runs a prepared job and builds its response.
pub async fn run(
    backend: &dyn SandboxBackend,
    spec: &SandboxSpec,
    req: &RunJobRequest,
    paths: &JobPaths,
    cancel: &CancellationToken,
) -> RunJobResponse {
    run_with_egress(backend, spec, req, paths, cancel, None).await
}

/// [`run`], with the job's egress proxy started inside the sandbox before its command
/// runs; its audit goes into the response.
pub async fn run_with_egress(
    backend: &dyn SandboxBackend,
    spec: &SandboxSpec,
    req: &RunJobRequest,
    paths: &JobPaths,
    cancel: &CancellationToken,
    mut egress: Option<JobEgress>,
) -> RunJobResponse {
    let started_at = now_rfc3339();
    // The disk guard stops the sandbox through a child token: a breach is not a cancel.
    let trip = cancel.child_token();
    let guard = crate::disk_limit::start(
        vec![paths.workspace.clone(), paths.mount.clone()],
        paths.bounds.disk,
        trip.clone(),
    );
    let hook = egress.as_mut().map(JobEgress::hook);
    let out = backend.run_with_hook(spec, &trip, hook).await;
    let audit = match egress {
        Some(e) => e.finish().await,
        None => None,
    };
    let breach = guard.finish().await;
    let ended_at = now_rfc3339();
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
                "sandbox killed after its timeout of {}s",
                spec.timeout.as_secs()
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

/// Hashes the job's artifacts on a blocking thread, within the job's bounds.
pub async fn collect_artifacts(paths: &JobPaths) -> Result<Vec<ArtifactRecord>, TreeError> {
    let (dir, bounds) = (paths.mount.clone(), paths.bounds.artifacts);
    match tokio::task::spawn_blocking(move || hash_tree(&dir, ARTIFACTS_DIR, bounds)).await {
        Ok(r) => r,
        Err(e) => Err(TreeError::Read(ReadError::Io {
            path: "artifacts".into(),
            source: std::io::Error::other(e.to_string()),
        })),
    }
}

/// Why result.json gave no result; the text is the job's failure reason.
#[derive(Debug, thiserror::Error)]
pub enum ResultError {
    #[error("cannot read result.json: {0}")]
    Task(String),
    #[error("result.json missing: the sandbox exited without a result")]
    Missing,
    #[error("resource_limit_exceeded: {0} (limits.result_max_bytes)")]
    TooLarge(ReadError),
    #[error("result.json refused: {0}")]
    Refused(ReadError),
    #[error("result.json invalid: {0}")]
    Invalid(serde_json::Error),
}

/// Reads and parses result.json beneath the job directory (never through a link, regular
/// file only, bounded).
pub async fn read_result(paths: &JobPaths) -> Result<JobResult, ResultError> {
    let (dir, cap) = (paths.mount.clone(), paths.bounds.result_max_bytes);
    let read = tokio::task::spawn_blocking(move || {
        sandbox_files::read_file_beneath(&dir, RESULT_FILE, cap, RESULT_READ_TIME)
    })
    .await
    .map_err(|e| ResultError::Task(e.to_string()))?;
    let text = match read {
        Ok(t) => t,
        Err(ReadError::Missing { .. }) => return Err(ResultError::Missing),
        Err(e @ ReadError::TooLarge { .. }) => return Err(ResultError::TooLarge(e)),
        Err(e) => return Err(ResultError::Refused(e)),
    };
    serde_json::from_slice(&text).map_err(ResultError::Invalid)
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

/// sha256 and size of every regular file under `rel` beneath `dir`, never following links,
/// within `bounds`; sorted. Blocking.
pub fn hash_tree(
    dir: &Path,
    rel: &str,
    bounds: TreeBounds,
) -> Result<Vec<ArtifactRecord>, TreeError> {
    Ok(sandbox_files::hash_tree(dir, rel, bounds)?
        .into_iter()
        .map(|h| ArtifactRecord {
            path: h.rel,
            sha256: h.sha256,
            size_bytes: h.size,
        })
        .collect())
}
