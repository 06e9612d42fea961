//! The job runner: validate, run the steps in order (or the agent loop of
//! [`crate::agent`]), collect artifacts, always write a complete result.json (also on
//! panics and SIGTERM), and report lifecycle callbacks.

use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cynode_protocol::job::{ExecutionMode, JobSpec};
use cynode_protocol::result::{JobStatus, StepRecord};
use cynode_protocol::time::now_rfc3339;
use cynode_protocol::version::PROTOCOL_VERSION;
use cynode_protocol::worker_api::{SbaLifecycle, SbaStatusCallback};
use cynode_protocol::{FailureCode, JobResult};

use crate::confine::Workspace;
use crate::steps::StepContext;
use crate::{artifacts, lifecycle, process, result_file, step_runner};

/// Where the runner reads and writes; resolved from flags and env by the CLI.
#[derive(Debug, Clone)]
pub struct Options {
    pub job: PathBuf,
    pub result: PathBuf,
    pub artifacts: PathBuf,
    pub workspace: PathBuf,
    /// Read the job from stdin and print the result on stdout.
    pub stdin_mode: bool,
    pub allow_root: bool,
    pub status_url: Option<String>,
    /// Agent mode settings (todo.json path, turn bound, model choice).
    pub agent: crate::agent::Settings,
}

/// Exit codes: 0 the job succeeded, 1 it failed or timed out (result.json says how), 2 the
/// result could not be written.
pub mod exit {
    pub const SUCCESS: i32 = 0;
    pub const FAILURE: i32 = 1;
    pub const NO_RESULT: i32 = 2;
}

/// SIGTERM/SIGINT seen by the runner: a flag for between-step checks and a pipe the
/// process supervisor polls, so a running step stops at once.
struct Interrupt {
    flag: Arc<AtomicBool>,
    pipe: Option<UnixStream>,
}

impl Interrupt {
    fn install() -> Self {
        let flag = Arc::new(AtomicBool::new(false));
        let mut pipe = None;
        for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
            if let Err(e) = signal_hook::flag::register(sig, Arc::clone(&flag)) {
                tracing::warn!(error = %e, "cannot install signal handler");
            }
        }
        if let Ok((read, write)) = UnixStream::pair() {
            let ok = [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT]
                .into_iter()
                .all(|sig| {
                    write
                        .try_clone()
                        .ok()
                        .is_some_and(|w| signal_hook::low_level::pipe::register(sig, w).is_ok())
                });
            if ok && read.set_nonblocking(true).is_ok() {
                pipe = Some(read);
            }
        }
        Self { flag, pipe }
    }
}

/// Runs the whole job and returns the process exit code.
pub fn run(opts: &Options) -> i32 {
    let interrupt = Interrupt::install();
    if let Err(e) = process::become_subreaper() {
        tracing::warn!(error = %e, "cannot become child subreaper; orphans may outlive steps");
    }
    let mut result = JobResult {
        protocol_version: PROTOCOL_VERSION.to_string(),
        job_id: String::new(),
        task_id: String::new(),
        status: JobStatus::Success,
        started_at: now_rfc3339(),
        finished_at: String::new(),
        steps: Vec::new(),
        artifacts: Vec::new(),
        resource_usage: Default::default(),
        failure_code: None,
        failure_message: None,
        error: None,
        final_answer: None,
        todo: None,
        tool_calls: Vec::new(),
    };
    let mut callbacks = Callbacks::new(opts.status_url.as_deref());
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        execute(opts, &interrupt, &mut result, &mut callbacks)
    }));
    if let Err(panic) = outcome {
        let msg = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        tracing::error!(panic = %msg, "runner panicked");
        result.set_failure(
            FailureCode::InternalError,
            format!("runner panicked: {msg}"),
        );
    }
    result.finished_at = now_rfc3339();
    result.resource_usage = process::children_usage();
    callbacks.send(SbaLifecycle::Completed, &result);
    let code = match result.status {
        JobStatus::Success => exit::SUCCESS,
        JobStatus::Failure | JobStatus::Timeout => exit::FAILURE,
    };
    let written = if opts.stdin_mode {
        serde_json::to_string(&result)
            .map_err(std::io::Error::other)
            .and_then(|s| {
                use std::io::Write;
                let mut out = std::io::stdout().lock();
                out.write_all(s.as_bytes())?;
                out.write_all(b"\n")?;
                out.flush()
            })
    } else {
        result_file::write_atomic(&opts.result, &result)
    };
    match written {
        Ok(()) => {
            tracing::info!(
                job_id = %result.job_id,
                status = ?result.status,
                failure_code = ?result.failure_code,
                "job finished"
            );
            code
        }
        Err(e) => {
            tracing::error!(error = %e, path = %opts.result.display(), "cannot write result");
            exit::NO_RESULT
        }
    }
}

fn execute(
    opts: &Options,
    interrupt: &Interrupt,
    result: &mut JobResult,
    callbacks: &mut Callbacks,
) {
    let started = Instant::now();
    let bytes = match read_job(opts) {
        Ok(b) => b,
        Err(e) => {
            let from = if opts.stdin_mode {
                "stdin".into()
            } else {
                opts.job.display().to_string()
            };
            result.set_failure(
                FailureCode::SchemaValidation,
                format!("cannot read job from {from}: {e}"),
            );
            return;
        }
    };
    fill_ids(result, &bytes);
    let job = match JobSpec::from_json(&bytes) {
        Ok(job) => job,
        Err(errs) => {
            tracing::warn!(job_id = %result.job_id, errors = %errs, "job rejected");
            result.set_failure(FailureCode::SchemaValidation, errs.to_string());
            return;
        }
    };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 && !opts.allow_root {
        result.set_failure(
            FailureCode::PolicyViolation,
            "refusing to run as uid 0: run as a non-root user or pass --allow-root",
        );
        return;
    }
    tracing::info!(job_id = %job.job_id, task_id = %job.task_id, steps = job.steps.len(), "job validated");
    callbacks.job_id = job.job_id.clone();
    callbacks.send(SbaLifecycle::InProgress, result);
    let ws = match Workspace::open(&opts.workspace) {
        Ok(ws) => ws,
        Err(e) => {
            result.set_failure(
                FailureCode::ExecutionFailure,
                format!("cannot open workspace {}: {e}", opts.workspace.display()),
            );
            return;
        }
    };
    let out_dir = match std::fs::create_dir_all(&opts.artifacts)
        .and_then(|()| Workspace::open(&opts.artifacts))
    {
        Ok(w) => w,
        Err(e) => {
            result.set_failure(
                FailureCode::ExecutionFailure,
                format!(
                    "cannot open artifacts directory {}: {e}",
                    opts.artifacts.display()
                ),
            );
            return;
        }
    };
    let base_env = base_env(&job, &ws, &out_dir);
    let ctx = StepContext {
        ws: &ws,
        job: &job,
        deadline: started + Duration::from_secs(job.constraints.max_runtime_seconds),
        runtime_seconds: job.constraints.max_runtime_seconds,
        base_env: &base_env,
        artifacts_dir: out_dir.root_path().to_path_buf(),
        interrupt: interrupt.pipe.as_ref().map(|p| p.as_fd()),
        interrupted: &interrupt.flag,
    };
    if job.effective_mode() == ExecutionMode::AgentInference {
        crate::agent::run(&ctx, &opts.agent, result);
        if interrupt.flag.load(Ordering::Relaxed) && result.status == JobStatus::Success {
            result.set_failure(FailureCode::InternalError, "runner interrupted by SIGTERM");
        }
    } else {
        run_steps(&ctx, result);
    }
    match artifacts::collect(&ws, &out_dir, &job.artifacts) {
        Ok(list) => result.artifacts = list,
        Err(e) if result.status == JobStatus::Success => {
            result.set_failure(e.code, format!("artifacts: {}", e.message));
        }
        Err(e) => tracing::warn!(job_id = %job.job_id, error = %e, "artifact collection failed"),
    }
}

fn run_steps(ctx: &StepContext<'_>, result: &mut JobResult) {
    for step in &ctx.job.steps {
        if result.status != JobStatus::Success {
            let rec = StepRecord::skipped(result.steps.len(), &step.id, step.action.step_type());
            result.push_step(rec);
            continue;
        }
        let rec = step_runner::run_step(ctx, &step.id, &step.action);
        if let Some(e) = rec.error_info() {
            result.set_failure(e.kind, format!("step {}: {}", step.id, e.message));
        }
        result.push_step(rec);
    }
    if ctx.interrupted.load(Ordering::Relaxed) && result.status == JobStatus::Success {
        result.set_failure(FailureCode::InternalError, "runner interrupted by SIGTERM");
    }
}

fn read_job(opts: &Options) -> std::io::Result<Vec<u8>> {
    const MAX_JOB_BYTES: u64 = 64 * 1024 * 1024;
    let mut buf = Vec::new();
    if opts.stdin_mode {
        std::io::stdin()
            .lock()
            .take(MAX_JOB_BYTES)
            .read_to_end(&mut buf)?;
    } else {
        std::fs::File::open(&opts.job)?
            .take(MAX_JOB_BYTES)
            .read_to_end(&mut buf)?;
    }
    Ok(buf)
}

/// Copies job_id and task_id from a job that may not validate, so even a rejection names
/// the job it rejects.
fn fill_ids(result: &mut JobResult, bytes: &[u8]) {
    if let Ok(serde_json::Value::Object(map)) = serde_json::from_slice(bytes) {
        if let Some(serde_json::Value::String(id)) = map.get("job_id") {
            result.job_id = id.clone();
        }
        if let Some(serde_json::Value::String(id)) = map.get("task_id") {
            result.task_id = id.clone();
        }
    }
}

/// The node's egress proxy variables (set only for a job with `network_policy:
/// restricted`): passed on, so pip, npm, cargo and go in a step find the proxy. And its
/// inference listener's (set only for a job with inference): passed on, so the `openai`
/// and `ollama` clients, curl and a coding agent's CLI in a step find the model.
const PROXY_VARS: [&str; 9] = [
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "http_proxy",
    "https_proxy",
    "NO_PROXY",
    "no_proxy",
    "OPENAI_BASE_URL",
    "OPENAI_API_KEY",
    "OLLAMA_BASE_URL",
];

/// The environment every command starts from: PATH, HOME, LANG from the runner, the
/// node's CYNODE_*, egress proxy and inference listener variables, and the job's ids and
/// directories.
/// Nothing else leaks in.
fn base_env(job: &JobSpec, ws: &Workspace, out: &Workspace) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = Vec::new();
    let get = |k: &str| std::env::var(k).ok();
    env.push((
        "PATH".into(),
        get("PATH").unwrap_or_else(|| {
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()
        }),
    ));
    env.push(("HOME".into(), get("HOME").unwrap_or_else(|| "/tmp".into())));
    env.push((
        "LANG".into(),
        get("LANG").unwrap_or_else(|| "C.UTF-8".into()),
    ));
    for (k, v) in std::env::vars() {
        if k.starts_with("CYNODE_") || PROXY_VARS.contains(&k.as_str()) {
            env.push((k, v));
        }
    }
    let mut set_default = |k: &str, v: String| {
        if !env.iter().any(|(name, _)| name == k) {
            env.push((k.to_string(), v));
        }
    };
    set_default("CYNODE_JOB_ID", job.job_id.clone());
    set_default("CYNODE_TASK_ID", job.task_id.clone());
    set_default("CYNODE_WORKSPACE_DIR", ws.root_path().display().to_string());
    set_default(
        "CYNODE_ARTIFACTS_DIR",
        out.root_path().display().to_string(),
    );
    env
}

/// Lifecycle callback sender; silent when no URL is configured.
struct Callbacks {
    target: Option<lifecycle::Target>,
    job_id: String,
}

impl Callbacks {
    fn new(url: Option<&str>) -> Self {
        let target = url.and_then(|u| match lifecycle::parse_url(u) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(error = %e, "ignoring SBA_JOB_STATUS_URL");
                None
            }
        });
        Self {
            target,
            job_id: String::new(),
        }
    }

    fn send(&self, status: SbaLifecycle, result: &JobResult) {
        let Some(target) = &self.target else { return };
        let body = SbaStatusCallback {
            status,
            job_id: if self.job_id.is_empty() {
                result.job_id.clone()
            } else {
                self.job_id.clone()
            },
            result: (status == SbaLifecycle::Completed).then(|| result.clone()),
        };
        let Ok(bytes) = serde_json::to_vec(&body) else {
            return;
        };
        match lifecycle::post(target, &bytes) {
            Ok(code) if (200..300).contains(&code) => {
                tracing::info!(job_id = %body.job_id, status = ?status, "lifecycle callback sent");
            }
            Ok(code) => {
                tracing::warn!(job_id = %body.job_id, http_status = code, "lifecycle callback refused")
            }
            Err(e) => {
                tracing::warn!(job_id = %body.job_id, error = %e, "lifecycle callback failed")
            }
        }
    }
}
