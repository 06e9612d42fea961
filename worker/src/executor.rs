//! From a validated request to a response the caller can trust, as one pipeline:
//! [`check`] (before the job is accepted: the request validated and what it asks of the
//! node worked out once, a [`CheckedJob`]), [`CheckedJob::accept`] (the workspace's host
//! uid, leased: an [`AcceptedJob`]), then [`PreparedJob::prepare`] (lay out the
//! job directory, build the sandbox spec: mounts, env, limits) and [`PreparedJob::run`]
//! (run it on the backend and read back what the sandbox left, verifying every artifact's
//! hash on the host); every response is built in [`response`]. Everything the sandbox left is
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
use cynode_protocol::result::ArtifactRecord;
use cynode_protocol::worker_api::{NetworkPolicy, RunJobRequest, RunJobResponse};
use cynode_protocol::{JobResult, ValidationError};
use tokio_util::sync::CancellationToken;

use crate::backend::SandboxBackend;
use crate::config::{Config, Limits};
use crate::disk_guard::DiskLimit;
use crate::egress::Policy;
use crate::inference::listener::JobInference;
use crate::job_dir;
use crate::job_egress::JobEgress;
use crate::sandbox::{self, SandboxRequest, SandboxSpec};
use crate::sandbox_files::{self, ReadError, TreeBounds, TreeError};
use crate::uid_pool::{UidError, UidLease, UidPool};
use cynode_protocol::time::now_rfc3339;

pub mod response;

/// What a request asks of the node, worked out once by [`check`] from the request and the
/// node's configuration, before the job is accepted.
#[derive(Debug, Clone)]
pub struct CheckedJob {
    /// The SBA job (`sandbox.job_spec_json`, parsed once); `None` for a command job.
    pub job: Option<JobSpec>,
    /// The models it may use through the node's inference proxy; `None`: no proxy
    /// ([`inference_models`]).
    pub models: Option<Vec<String>>,
    /// Its egress policy ([`crate::job_egress::policy`]); `None`: no network.
    pub egress: Option<Policy>,
    /// The workspace it runs over: its `workspace_id`, else its task's.
    pub workspace_id: String,
}

/// A job the node accepted: its [`CheckedJob`] and its workspace's host uid, held (a
/// [`UidLease`]) until the job is dropped, so the uid stays the workspace's while the job
/// waits and runs.
#[derive(Debug)]
pub struct AcceptedJob {
    pub checked: CheckedJob,
    pub host_uid: u32,
    _lease: Option<UidLease>,
}

impl CheckedJob {
    /// Accepts the job: its workspace's uid from `uids`, leased for the job's life.
    pub async fn accept(self, uids: &UidPool) -> Result<AcceptedJob, UidError> {
        let lease = uids.lease(&self.workspace_id).await?;
        Ok(AcceptedJob {
            checked: self,
            host_uid: lease.uid(),
            _lease: Some(lease),
        })
    }

    /// Accepts the job with a uid its caller holds itself (a replay's new workspace).
    pub fn with_uid(self, host_uid: u32) -> AcceptedJob {
        AcceptedJob {
            checked: self,
            host_uid,
            _lease: None,
        }
    }
}

/// Validates a request completely before anything is created or started, and works out
/// once what it asks of the node.
pub fn check(cfg: &Config, req: &RunJobRequest) -> Result<CheckedJob, ValidationError> {
    req.validate()?;
    let network = crate::job_egress::policy(cfg, req)?;
    let workspace_id = workspace_of(req).to_string();
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
        return Ok(CheckedJob {
            job: None,
            models: models_for(cfg, req, None)?,
            egress: network,
            workspace_id,
        });
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
    let models = models_for(cfg, req, Some(&job))?;
    if job.constraints.ext_net_allowed && network.is_none() {
        return Err(ValidationError::new(
            "sandbox.job_spec_json.constraints.ext_net_allowed",
            "needs sandbox.network_policy `restricted` (the node's egress proxy); \
             a sandbox has no other network",
        ));
    }
    Ok(CheckedJob {
        job: Some(job),
        models,
        egress: network,
        workspace_id,
    })
}

/// The models a job may use through the node's inference proxy, or `None` when the job
/// needs no proxy: only jobs with `use_inference` or in agent mode get one. The job's
/// `inference.allowed_models` (a command job: the node's list), cut to the models the node
/// offers. On a node without an upstream the job runs without a proxy, as upstream CyNodeAI
/// runs it (its prompt-mode tasks always set `use_inference`): a job that really needs a
/// model then fails on its own. A job left with no model the node offers is refused, and
/// so is every job with inference on a backend that cannot bind the inference listener
/// inside its sandboxes ([`crate::inference::listener::refusal`]).
pub fn inference_models(
    cfg: &Config,
    req: &RunJobRequest,
) -> Result<Option<Vec<String>>, ValidationError> {
    let job = req
        .sandbox
        .job_spec_json
        .as_deref()
        .and_then(|t| JobSpec::from_json(t.as_bytes()).ok());
    models_for(cfg, req, job.as_ref())
}

/// [`inference_models`] of `req` with its SBA job already parsed.
fn models_for(
    cfg: &Config,
    req: &RunJobRequest,
    job: Option<&JobSpec>,
) -> Result<Option<Vec<String>>, ValidationError> {
    let agent = job.is_some_and(|j| j.effective_mode() == ExecutionMode::AgentInference);
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
    let wanted: Vec<String> = match job.and_then(|j| j.inference.as_ref()) {
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
    if let Some(why) = crate::inference::listener::refusal(cfg) {
        return Err(ValidationError::new(field, why));
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
        let ws = workspace_of(req);
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

/// The workspace a job runs over: its `workspace_id`, else its task's.
pub fn workspace_of(req: &RunJobRequest) -> &str {
    req.workspace_id.as_deref().unwrap_or(&req.task_id)
}

/// Creates the job directory (`request.json`, `job/`, `job/artifacts/`, and `job/job.json`
/// for SBA jobs) and the workspace when missing. The job directory must not exist: one
/// that does (a retained job's, with links a job planted in it) is refused, never reused.
/// Every step goes through a directory fd without following links ([`crate::job_dir`]).
/// What the sandbox writes is owned by `host_uid`, the workspace's ([`crate::uid_pool`]).
fn make_dirs(paths: &JobPaths, req: &RunJobRequest, host_uid: u32) -> std::io::Result<()> {
    let mut lap = crate::trace::Lap::start();
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
    let dir_us = lap.us();
    // The kernel's disk limit: a volume of its own on `job/`, before anything is in it.
    let label = format!("job-{}", req.job_id);
    let mount = crate::loopfs::cover(root.as_fd(), OsStr::new("job"), &label).unwrap_or(mount);
    let volume_us = lap.us();
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
    let files_us = lap.us();
    crate::workspace::make_workspace(&paths.workspace, host_uid)?;
    tracing::debug!(job_id = %req.job_id, dir_us, volume_us, files_us, workspace_us = lap.us(), "phases: job directory");
    Ok(())
}

/// The sandbox spec for `req`: its env (the request's, then the node's job variables;
/// an SBA job's own `SBA_*` and `INFERENCE_PROXY_URL` come from the node only), the job
/// directory and workspace mounts, the node's limits, and the workspace's `host_uid`.
/// `inference`: the job's loopback-listener token when it gets the node's inference proxy
/// (then `OPENAI_BASE_URL`, `OPENAI_API_KEY` and `OLLAMA_BASE_URL` are the node's too);
/// `egress`: whether it gets the egress proxy.
fn sandbox_spec(
    cfg: &Config,
    req: &RunJobRequest,
    paths: &JobPaths,
    host_uid: u32,
    inference: Option<&str>,
    egress: bool,
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
    if let Some(token) = inference {
        node.push((sandbox::ENV_INFERENCE_PROXY_URL, sandbox::PROXY_URL.into()));
        node.extend(crate::inference::listener::env(token));
        if let Some(turns) = cfg.inference.as_ref().and_then(|i| i.agent_max_turns) {
            node.push((sandbox::ENV_SBA_AGENT_MAX_TURNS, turns.to_string()));
        }
    }
    node.extend(crate::job_egress::env(egress));
    let env = sandbox::env(
        &req.sandbox.env,
        |k| {
            k == sandbox::ENV_INFERENCE_PROXY_URL
                || (inference.is_some() && crate::inference::listener::ENV_NAMES.contains(&k))
                || (is_sba && k.starts_with("SBA_"))
        },
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

/// A job ready to run, from [`PreparedJob::prepare`]: its directory and workspace made,
/// its sandbox spec built, and what it gets of the node (inference models, an egress
/// policy) decided once. The node attaches its per-job servers between the two steps
/// (they listen in [`PreparedJob::paths`]' job directory), then [`PreparedJob::run`] runs
/// it once and answers it.
#[derive(Debug)]
pub struct PreparedJob {
    req: RunJobRequest,
    paths: JobPaths,
    spec: SandboxSpec,
    accepted: AcceptedJob,
    inference_token: Option<String>,
    egress: Option<JobEgress>,
    inference: Option<JobInference>,
}

impl PreparedJob {
    /// Creates the job directory (`request.json`, `job/`, `job/artifacts/`, and
    /// `job/job.json` for SBA jobs) and the workspace when missing, and builds the sandbox
    /// spec. The job directory must not exist: one that does (a retained job's, with links
    /// a job planted in it) is refused, never reused. Every step goes through a directory
    /// fd without following links ([`crate::job_dir`]). What the sandbox writes is owned
    /// by the accepted job's host uid, its workspace's ([`crate::uid_pool`]).
    pub fn prepare(
        cfg: &Config,
        req: &RunJobRequest,
        accepted: AcceptedJob,
    ) -> std::io::Result<PreparedJob> {
        let paths = JobPaths::new(cfg, req);
        let host_uid = accepted.host_uid;
        make_dirs(&paths, req, host_uid)?;
        let inference_token = accepted
            .checked
            .models
            .as_ref()
            .map(|_| crate::inference::listener::new_token());
        let spec = sandbox_spec(
            cfg,
            req,
            &paths,
            host_uid,
            inference_token.as_deref(),
            accepted.checked.egress.is_some(),
        );
        Ok(PreparedJob {
            req: req.clone(),
            paths,
            spec,
            accepted,
            inference_token,
            egress: None,
            inference: None,
        })
    }

    /// The job's paths on the host.
    pub fn paths(&self) -> &JobPaths {
        &self.paths
    }

    /// The sandbox spec it runs with.
    pub fn spec(&self) -> &SandboxSpec {
        &self.spec
    }

    /// The models the job may use through the node's inference proxy; `None`: no proxy
    /// ([`inference_models`]).
    pub fn inference_models(&self) -> Option<&[String]> {
        self.accepted.checked.models.as_deref()
    }

    /// The host uid it runs as, its workspace's.
    pub fn host_uid(&self) -> u32 {
        self.accepted.host_uid
    }

    /// The bearer token of the job's inference listener (its sandbox's `OPENAI_API_KEY`);
    /// `None` without inference.
    pub fn inference_token(&self) -> Option<&str> {
        self.inference_token.as_deref()
    }

    /// The job's inference listener, bound inside its sandbox before its command runs
    /// (after the egress proxy, when it has one).
    pub fn with_inference(mut self, inference: JobInference) -> Self {
        self.inference = Some(inference);
        self
    }

    /// The job's egress policy ([`crate::job_egress::policy`]); `None` for a job without
    /// network.
    pub fn egress_policy(&self) -> Option<&Policy> {
        self.accepted.checked.egress.as_ref()
    }

    /// The job's egress proxy, started inside its sandbox before its command runs; its
    /// audit goes into the response.
    pub fn with_egress(mut self, egress: JobEgress) -> Self {
        self.egress = Some(egress);
        self
    }

    /// Runs the job once on `backend` and builds its response; `cancel` stops it.
    pub async fn run(
        self,
        backend: &dyn SandboxBackend,
        cancel: &CancellationToken,
    ) -> RunJobResponse {
        let PreparedJob {
            req,
            paths,
            spec,
            mut egress,
            inference,
            ..
        } = self;
        let mut lap = crate::trace::Lap::start();
        let started_at = now_rfc3339();
        // The disk guard stops the sandbox through a child token: a breach is not a cancel.
        let trip = cancel.child_token();
        let guard = crate::disk_limit::start(
            vec![paths.workspace.clone(), paths.mount.clone()],
            paths.bounds.disk,
            trip.clone(),
        );
        let guard_start_us = lap.us();
        let hook = crate::backend::netns_gate::chain(
            egress.as_mut().map(JobEgress::hook),
            inference.as_ref().map(JobInference::hook),
        );
        let out = backend.run_with_hook(&spec, &trip, hook).await;
        // The listener stops with the sandbox.
        drop(inference);
        let backend_us = lap.us();
        let audit = match egress {
            Some(e) => e.finish().await,
            None => None,
        };
        let egress_us = lap.us();
        let breach = guard.finish().await;
        let guard_finish_us = lap.us();
        let end = response::RunEnd {
            out,
            started_at,
            ended_at: now_rfc3339(),
            timeout_secs: spec.timeout.as_secs(),
            audit,
            breach,
        };
        let resp = response::after_run(&req, &paths, end).await;
        tracing::debug!(job_id = %req.job_id, guard_start_us, backend_us, egress_us, guard_finish_us, response_us = lap.us(), "phases: run");
        resp
    }
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
