//! `cynode-pm skills run SKILL` and `cynode-pm jobs run JOB.json`: one job end to end
//! without the model loop, the skill author's loop. The job is built (a skill rendered
//! from `--inputs`, or a job.json read strictly), placed on a worker (`--worker-endpoint`,
//! `--workers-file`, or the local worker `run` starts), judged by the policy gate with the
//! placed worker's image, run in a workspace of its own (seeded from `--workspace` when
//! given), waited for, and
//! every artifact it reports fetched and checked against its sha256 before it is stored
//! in the state directory's artifact store. The same pieces the session loop uses: the
//! skill renderer, [`cynode_pm::workers::WorkerPool`] placement, the policy gate,
//! [`cynode_pm::dispatch::WorkerClient`] and [`cynode_pm::artifacts::verify_and_store`].
//!
//! The job runs offline (`network_policy` none) and without the sandbox gateway or an
//! inference upstream: a job that needs them is a session's, not this command's.
//!
//! Exit codes: 0 the job completed and every artifact verified; 1 the job ran and failed;
//! 2 usage or load errors; 4 invalid inputs or job.json ([`EXIT_INVALID`]); 5 denied by the
//! policy ([`EXIT_DENIED`]); 6 an artifact failed verification ([`EXIT_ARTIFACT`]); 7 no
//! worker could take or run the job ([`EXIT_WORKER`]). `--output json` prints one object:
//! `{"ok": true, "job": …}` or `{"ok": false, "error": {"kind", "message", "path"?, …}}`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use cynode_pm::artifacts::{verify_and_store, ArtifactError};
use cynode_pm::bootstrap::{gate, load_registry, tenant};
use cynode_pm::dispatch::WorkerClient;
use cynode_pm::policy::{Mode, PolicyInput};
use cynode_pm::skills::{build_job, BuildError, JobRef, Skill};
use cynode_protocol::worker_api::{RunJobRequest, RunJobResponse, WorkerJobStatus};
use serde_json::{json, Value};

use super::args::{policy_source, LocalWorkerArgs, StoreArgs, WorkerArgs};
use super::{find_skill, print_json, read_json, Global, Output};

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

/// Beyond the job's own `max_runtime_seconds`, how long this command waits for its end
/// (queueing, start-up, collecting the result) before giving up on the worker.
const WAIT_MARGIN: Duration = Duration::from_secs(120);

/// `jobs …`
#[derive(Debug, Subcommand)]
pub enum JobsCmd {
    /// Run one job.json (validated strictly, then policy-checked) on a worker, wait for
    /// it and verify its artifacts.
    Run {
        /// The job.json (`-` for stdin); its skill_id must be a registered skill.
        job: PathBuf,
        #[command(flatten)]
        args: JobRunArgs,
    },
}

/// `skills run ID --inputs FILE`.
#[derive(Debug, Args)]
pub struct SkillRunCmd {
    /// The skill to run.
    pub id: String,
    /// JSON file with the inputs (`-` for stdin).
    #[arg(long)]
    pub inputs: PathBuf,
    #[command(flatten)]
    pub args: JobRunArgs,
}

/// Where a single job runs: its workspace, the workers, the state, the local worker.
#[derive(Debug, Clone, Args)]
pub struct JobRunArgs {
    /// The directory the job's workspace is seeded from (the job works on a copy at
    /// /workspace; this directory is not changed). Without it the job starts in an empty
    /// workspace.
    #[arg(long)]
    pub workspace: Option<PathBuf>,
    #[command(flatten)]
    pub workers: WorkerArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub local: LocalWorkerArgs,
}

/// Why the command did not succeed: a kind, the exit code, a message, and the field it
/// is about (a JSON pointer into the inputs or the job) when there is one.
#[derive(Debug)]
struct Failure {
    kind: &'static str,
    exit: i32,
    message: String,
    path: Option<String>,
    details: Value,
}

impl Failure {
    fn new(kind: &'static str, exit: i32, message: impl Into<String>) -> Self {
        Self {
            kind,
            exit,
            message: message.into(),
            path: None,
            details: Value::Null,
        }
    }

    fn at(mut self, path: impl Into<String>) -> Self {
        self.path = Some(path.into());
        self
    }

    fn with(mut self, details: Value) -> Self {
        self.details = details;
        self
    }

    fn json(&self) -> Value {
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
struct ReadyJob<'a> {
    canonical: String,
    value: Value,
    job_id: String,
    task_id: String,
    skill: &'a Skill,
}

/// `skills run SKILL --inputs FILE`: renders the skill (inputs checked against its
/// schema), then [`execute`].
pub async fn skill_run(cmd: &SkillRunCmd, g: &Global) -> anyhow::Result<i32> {
    let SkillRunCmd { id, inputs, args } = cmd;
    let reg = load_registry(&super::args::skill_sources(g))?;
    let skill = find_skill(&reg, id)?;
    let inputs = read_json(inputs)?;
    let r = JobRef {
        session_id: format!("skills-run-{}", uuid::Uuid::new_v4()),
        task_id: "run".into(),
        attempt: 0,
    };
    let built = match build_job(skill, &inputs, &r) {
        Ok(b) => b,
        Err(e) => return Ok(report(g.output, Err(build_failure(e)))),
    };
    let job = ReadyJob {
        canonical: String::from_utf8_lossy(&built.canonical).into_owned(),
        value: built.value,
        job_id: built.job.job_id.clone(),
        task_id: built.job.task_id.clone(),
        skill,
    };
    let outcome = execute(job, args, g).await?;
    Ok(report(g.output, outcome))
}

/// `jobs run JOB.json`: the job validated strictly (the protocol's own parser: unknown
/// fields refused, every field checked), its skill looked up, then [`execute`].
pub async fn jobs(cmd: &JobsCmd, g: &Global) -> anyhow::Result<i32> {
    let JobsCmd::Run { job, args } = cmd;
    let value = read_json(job)?;
    let canonical = serde_json::to_vec(&value)?;
    let spec = match cynode_protocol::JobSpec::from_json(&canonical) {
        Ok(s) => s,
        Err(errors) => {
            let first = errors.first();
            let mut f = Failure::new(
                "invalid_job",
                EXIT_INVALID,
                format!("invalid job.json: {errors}"),
            );
            if let Some(e) = first {
                f = f.at(dotted_to_pointer(&e.path));
            }
            return Ok(report(g.output, Err(f)));
        }
    };
    let reg = load_registry(&super::args::skill_sources(g))?;
    let skill_id = spec.skill_id.as_deref().unwrap_or_default();
    let Some(skill) = reg.get(skill_id) else {
        let f = Failure::new(
            "invalid_job",
            EXIT_INVALID,
            format!(
                "unknown skill `{skill_id}`: a job runs as one of the registered skills ({})",
                reg.iter()
                    .map(|s| s.manifest.skill_id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
        .at("/skill_id");
        return Ok(report(g.output, Err(f)));
    };
    let job = ReadyJob {
        canonical: String::from_utf8_lossy(&canonical).into_owned(),
        value,
        job_id: spec.job_id.clone(),
        task_id: spec.task_id.clone(),
        skill,
    };
    let outcome = execute(job, args, g).await?;
    Ok(report(g.output, outcome))
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
fn dotted_to_pointer(path: &str) -> String {
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

/// Places, policy-checks, runs and waits for `job`, then verifies its artifacts. `Err`
/// only for problems of this command's own setup (unreadable files, a worker that will not
/// start); everything about the job is in the returned outcome.
async fn execute(
    job: ReadyJob<'_>,
    args: &JobRunArgs,
    g: &Global,
) -> anyhow::Result<Result<Value, Failure>> {
    let seed = match &args.workspace {
        Some(w) => {
            let seed =
                std::fs::canonicalize(w).with_context(|| format!("--workspace {}", w.display()))?;
            anyhow::ensure!(
                seed.is_dir(),
                "--workspace {}: not a directory",
                w.display()
            );
            Some(seed)
        }
        None => None,
    };
    let tenant = tenant(g.tenant.as_deref())?;
    let gate = gate(&policy_source(g), Mode::Enforce)?;
    std::fs::create_dir_all(&args.store.state_dir)?;
    let (pool, _local) = super::run::worker_pool(
        &args.workers,
        || {
            args.local.config(
                g,
                &args.store,
                &args.workers,
                seed.clone(),
                tenant.egress.allow.clone(),
                None,
            )
        },
        &|line| eprintln!("{line}"),
    )?;
    let manifest = &job.skill.manifest;
    let placement = match pool.place(&manifest.purpose).await {
        Ok(p) => p,
        Err(e) => {
            return Ok(Err(Failure::new(
                "worker_unavailable",
                EXIT_WORKER,
                e.to_string(),
            )))
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
        return Ok(Err(Failure::new(
            "policy_denied",
            EXIT_DENIED,
            format!("the policy denies the job: {}", decision.denial_summary()),
        )
        .with(json!({ "deny": deny }))));
    }
    let Some(worker) = pool.client(&placement.worker_id) else {
        return Ok(Err(Failure::new(
            "worker_unavailable",
            EXIT_WORKER,
            format!("worker {} is not in the pool", placement.worker_id),
        )));
    };
    let workspace_id = format!("run-{}", uuid::Uuid::new_v4());
    let worker_err = |what: &str, e: cynode_pm::dispatch::DispatchError| {
        Failure::new(
            "worker_error",
            EXIT_WORKER,
            format!("worker {}: {what}: {e}", placement.worker_id),
        )
    };
    if let Err(e) = worker
        .create_workspace(&workspace_id, seed.as_deref())
        .await
    {
        return Ok(Err(worker_err("cannot create the workspace", e)));
    }
    let req = RunJobRequest::sba(
        &job.task_id,
        &job.job_id,
        &placement.image,
        job.canonical.clone(),
        Some(workspace_id.clone()),
    );
    if let Err(e) = worker.submit(&req).await {
        return Ok(Err(worker_err("refused the job", e)));
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
        Err(f) => return Ok(Err(f)),
    };
    let dir = args.store.state_dir.join("artifacts");
    let (verified, rejected) = collect_artifacts(worker, &job.job_id, &resp, &dir).await;
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
        return Ok(Err(Failure::new(
            "artifact_integrity_failure",
            EXIT_ARTIFACT,
            format!(
                "{} artifact(s) of job {} failed verification",
                rejected.len(),
                job.job_id
            ),
        )
        .with(json!({ "job": result }))));
    }
    if resp.status != WorkerJobStatus::Completed {
        return Ok(Err(Failure::new(
            "job_failed",
            EXIT_FAILED,
            format!("job {} ended {status}", job.job_id),
        )
        .with(json!({ "job": result }))));
    }
    Ok(Ok(result))
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

/// Prints the outcome; returns the exit code.
fn report(output: Output, outcome: Result<Value, Failure>) -> i32 {
    match (output, outcome) {
        (Output::Json, Ok(job)) => {
            print_json(&json!({ "ok": true, "job": job }));
            0
        }
        (Output::Json, Err(f)) => {
            print_json(&json!({ "ok": false, "error": f.json() }));
            f.exit
        }
        (Output::Human, Ok(job)) => {
            print_job(&job);
            0
        }
        (Output::Human, Err(f)) => {
            if let Some(job) = f.details.get("job") {
                print_job(job);
            }
            match &f.path {
                Some(p) => eprintln!("error ({}) at {p}: {}", f.kind, f.message),
                None => eprintln!("error ({}): {}", f.kind, f.message),
            }
            if let Some(deny) = f.details.get("deny").and_then(Value::as_array) {
                for d in deny {
                    eprintln!(
                        "  deny  {}: {}",
                        d["rule"].as_str().unwrap_or(""),
                        d["message"].as_str().unwrap_or("")
                    );
                }
            }
            f.exit
        }
    }
}

fn print_job(job: &Value) {
    let s = |v: &Value| v.as_str().unwrap_or("").to_string();
    outln!(
        "job {} ({} on {}, image {}): {}, exit code {}",
        s(&job["job_id"]),
        s(&job["skill_id"]),
        s(&job["worker_id"]),
        s(&job["image"]),
        s(&job["status"]),
        job["exit_code"]
    );
    if let Some(f) = job.get("failure").filter(|f| !f.is_null()) {
        outln!("failure: {} {}", s(&f["code"]), s(&f["message"]));
    }
    for a in job["artifacts"].as_array().into_iter().flatten() {
        outln!(
            "artifact {} sha256 {} ({} bytes) verified",
            s(&a["path"]),
            s(&a["sha256"]),
            a["size_bytes"]
        );
    }
    for a in job["rejected_artifacts"].as_array().into_iter().flatten() {
        outln!("artifact {} REJECTED: {}", s(&a["path"]), s(&a["error"]));
    }
    if let Some(c) = job["changeset"].as_str() {
        outln!("changeset:\n{}", c.trim_end());
    }
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
