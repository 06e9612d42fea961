//! From a validated request to a response the caller can trust: lay out the job
//! directory, build the sandbox spec (mounts, env, limits), run it, and read back what the
//! sandbox left, verifying every artifact's hash on the host.
//!
//! Job directory layout (`<state>/jobs/<job_id>/`): `request.json`, and `job/` which is
//! mounted at `/job` (job.json, result.json, artifacts/, status.sock, and for jobs that use
//! inference inference.sock and the agent's todo.json).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cynode_protocol::job::{ExecutionMode, JobSpec};
use cynode_protocol::result::{ArtifactRecord, JobStatus};
use cynode_protocol::worker_api::{
    NetworkPolicy, RunJobRequest, RunJobResponse, WorkerJobStatus, API_VERSION,
};
use cynode_protocol::{JobResult, ValidationError};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, EndReason, Mount, ResourceLimits, SandboxSpec};
use crate::clock::now_rfc3339;
use crate::config::Config;

/// The uid/gid sandboxes run as.
pub const SANDBOX_UID: u32 = 1000;
/// Where the SBA's lifecycle socket appears inside the sandbox.
pub const STATUS_URL: &str = "http+unix://%2Fjob%2Fstatus.sock/status";

/// Validates a request completely before anything is created or started.
pub fn validate(cfg: &Config, req: &RunJobRequest) -> Result<Option<JobSpec>, ValidationError> {
    req.validate()?;
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
    if job.constraints.ext_net_allowed {
        return Err(ValidationError::new(
            "sandbox.job_spec_json.constraints.ext_net_allowed",
            "this node gives sandboxes no network (network_policy none|restricted)",
        ));
    }
    Ok(Some(job))
}

/// The models a job may use through the node's inference proxy, or `None` when the job
/// needs no proxy: only jobs with `use_inference` or in agent mode get one. The job's
/// `inference.allowed_models` (a command job: the node's list), cut to the models the node
/// offers. A job that needs inference on a node without an upstream, or ends up with no
/// model, is refused.
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
        return Err(ValidationError::new(
            field,
            "this node has no inference upstream (config `inference.base_url`)",
        ));
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

/// Paths of one job on the host.
#[derive(Debug, Clone)]
pub struct JobPaths {
    pub root: PathBuf,
    pub mount: PathBuf,
    pub workspace: PathBuf,
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
        }
    }

    pub fn result(&self) -> PathBuf {
        self.mount.join("result.json")
    }

    pub fn artifacts(&self) -> PathBuf {
        self.mount.join("artifacts")
    }
}

fn sandbox_owned_dir(p: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(p)?;
    std::os::unix::fs::chown(p, Some(SANDBOX_UID), Some(SANDBOX_UID))?;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755))
}

/// Creates the job directory and workspace and writes job.json; idempotent.
pub fn prepare(paths: &JobPaths, req: &RunJobRequest) -> std::io::Result<()> {
    std::fs::create_dir_all(&paths.root)?;
    std::fs::write(
        paths.root.join("request.json"),
        serde_json::to_vec_pretty(req)?,
    )?;
    sandbox_owned_dir(&paths.mount)?;
    sandbox_owned_dir(&paths.artifacts())?;
    if !paths.workspace.exists() {
        sandbox_owned_dir(&paths.workspace)?;
    }
    if let Some(spec) = &req.sandbox.job_spec_json {
        let job = paths.mount.join("job.json");
        std::fs::write(&job, spec)?;
        std::os::unix::fs::chown(&job, Some(SANDBOX_UID), Some(SANDBOX_UID))?;
    }
    // A stale result from an earlier attempt must never be read as this run's.
    match std::fs::remove_file(paths.result()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    Ok(())
}

/// The sandbox spec for `req`.
pub fn sandbox_spec(cfg: &Config, req: &RunJobRequest, paths: &JobPaths) -> SandboxSpec {
    let is_sba = req.sandbox.job_spec_json.is_some();
    let mut env: Vec<(String, String)> = req
        .sandbox
        .env
        .iter()
        .filter(|(k, _)| {
            !cynode_protocol::worker_api::RESERVED_ENV.contains(&k.as_str())
                && k.as_str() != "INFERENCE_PROXY_URL"
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    env.extend([
        ("CYNODE_TASK_ID".into(), req.task_id.clone()),
        ("CYNODE_JOB_ID".into(), req.job_id.clone()),
        ("CYNODE_WORKSPACE_DIR".into(), "/workspace".into()),
        ("CYNODE_ARTIFACTS_DIR".into(), "/job/artifacts".into()),
    ]);
    if is_sba {
        env.retain(|(k, _)| !k.starts_with("SBA_"));
        env.push(("SBA_JOB_STATUS_URL".into(), STATUS_URL.into()));
    }
    if matches!(inference_models(cfg, req), Ok(Some(_))) {
        env.push((
            "INFERENCE_PROXY_URL".into(),
            crate::inference::PROXY_URL.into(),
        ));
        if let Some(turns) = cfg.inference.as_ref().and_then(|i| i.agent_max_turns) {
            env.push(("SBA_AGENT_MAX_TURNS".into(), turns.to_string()));
        }
    }
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push((
            "PATH".into(),
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
        ));
    }
    let l = &cfg.limits;
    SandboxSpec {
        name: format!("cynode-{}", req.job_id),
        image: req.sandbox.image.clone(),
        command: req.sandbox.command.clone(),
        override_entrypoint: !is_sba,
        env,
        mounts: vec![
            Mount {
                host: paths.mount.clone(),
                target: "/job".into(),
                writable: true,
            },
            Mount {
                host: paths.workspace.clone(),
                target: "/workspace".into(),
                writable: true,
            },
        ],
        workdir: "/workspace".into(),
        network: req.sandbox.network_policy.unwrap_or(NetworkPolicy::None),
        limits: ResourceLimits {
            memory_mb: l.memory_mb,
            pids: l.pids,
            cpus: l.cpus,
            tmpfs_mb: l.tmpfs_mb,
        },
        labels: vec![
            ("cynodeai.task_id".into(), req.task_id.clone()),
            ("cynodeai.job_id".into(), req.job_id.clone()),
        ],
        timeout: Duration::from_secs(l.effective_timeout(req.sandbox.timeout_seconds)),
        output_cap: l.output_cap_bytes,
    }
}

/// Runs a prepared job and builds its response.
pub async fn run(
    backend: &Backend,
    spec: &SandboxSpec,
    req: &RunJobRequest,
    paths: &JobPaths,
    cancel: &CancellationToken,
) -> RunJobResponse {
    let started_at = now_rfc3339();
    let out = backend.run(spec, cancel).await;
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
    };
    let artifacts = hash_tree(&paths.artifacts());
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
    resp.artifacts = Some(artifacts.clone());
    if req.sandbox.job_spec_json.is_some() && out.end == EndReason::Exited {
        apply_sba_result(&mut resp, &paths.result(), &artifacts);
    }
    resp
}

/// Derives status from result.json; a missing or invalid one is a failure, never success.
fn apply_sba_result(resp: &mut RunJobResponse, path: &Path, host: &[ArtifactRecord]) {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) => {
            resp.status = WorkerJobStatus::Failed;
            resp.failure_reason = Some(format!(
                "result.json missing ({e}): the sandbox exited with code {} without a result",
                resp.exit_code
            ));
            return;
        }
    };
    let result: JobResult = match serde_json::from_slice(&text) {
        Ok(r) => r,
        Err(e) => {
            resp.status = WorkerJobStatus::Failed;
            resp.failure_reason = Some(format!("result.json invalid: {e}"));
            return;
        }
    };
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

/// sha256 and size of every regular file under `dir`, never following symlinks; sorted.
pub fn hash_tree(dir: &Path) -> Vec<ArtifactRecord> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(ft) = e.file_type() else { continue };
            let p = e.path();
            if ft.is_dir() {
                stack.push(p);
            } else if ft.is_file() {
                if let Some((size_bytes, sha256)) = hash_file(&p) {
                    let rel = p.strip_prefix(dir).unwrap_or(&p).display().to_string();
                    out.push(ArtifactRecord {
                        path: rel,
                        sha256,
                        size_bytes,
                    });
                }
            }
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

fn hash_file(p: &Path) -> Option<(u64, String)> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(p)
        .ok()?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut n_total = 0u64;
    loop {
        let n = f.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        n_total += n as u64;
    }
    Some((n_total, hex::encode(h.finalize())))
}
