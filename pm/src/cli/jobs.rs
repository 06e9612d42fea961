//! `cynode-pm skills run SKILL` and `cynode-pm jobs run JOB.json`: one job end to end
//! without the model loop, the skill author's loop. The job is built (a skill rendered
//! from `--inputs`, or a job.json read strictly), placed on a worker (`--worker-endpoint`,
//! `--workers-file`, or the local worker `run` starts), judged by the policy gate with the
//! placed worker's image, run in a workspace of its own (seeded from `--workspace` when
//! given), waited for, and
//! every artifact it reports fetched and checked against its sha256 before it is stored
//! in the state directory's artifact store. The local worker gets the model as `run`'s
//! does (`--model-base-url`, or, when `CYNODE_MODEL_API_KEY` is set, the inference relay
//! that keeps the key in this process), so an agent skill runs on it. The same pieces the session loop uses: the
//! skill renderer, [`cynode_pm::workers::WorkerPool`] placement, the policy gate,
//! [`cynode_pm::dispatch::WorkerClient`] and [`cynode_pm::artifacts::verify_and_store`].
//!
//! The pieces are the library's [`cynode_pm::job_run`] (shared with the MCP tool
//! `skills.run`); this module adds the flags, the local worker and the printing. Exit
//! codes: 0 the job completed and every artifact verified; 2 usage or load errors; the
//! others are [`cynode_pm::job_run`]'s. `--output json` prints one object:
//! `{"ok": true, "job": …}` or `{"ok": false, "error": {"kind", "message", "path"?, …}}`.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use cynode_pm::bootstrap::{gate, load_registry, tenant};
use cynode_pm::job_run::{self, Failure, ReadyJob, EXIT_INVALID};
use cynode_pm::policy::Mode;
use serde_json::{json, Value};

use super::args::{policy_source, LocalWorkerArgs, PmArgs};
use super::{find_skill, print_json, read_json, Global, Output};

/// `jobs …`
#[derive(Debug, Subcommand)]
pub enum JobsCmd {
    /// Run one job.json (validated strictly, then policy-checked) on a worker (the local
    /// one by default), wait for it and verify its artifacts. The local worker reaches the
    /// model at --model-base-url (through a relay that keeps CYNODE_MODEL_API_KEY in this
    /// process when it is set), so agent jobs run on it.
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

/// Where a single job runs: its workspace, the model, the workers, the state, the local
/// worker. Of the model flags, the local worker's inference upstream is
/// `--model-base-url` (with `--ca-file`), or the relay in front of it when
/// `CYNODE_MODEL_API_KEY` is set (`--model-timeout-seconds` bounds a relayed request);
/// a worker given with `--worker-endpoint` or `--workers-file` uses its own upstream.
#[derive(Debug, Clone, Args)]
pub struct JobRunArgs {
    /// The directory the job's workspace is seeded from (the job works on a copy at
    /// /workspace; this directory is not changed). Without it the job starts in an empty
    /// workspace.
    #[arg(long)]
    pub workspace: Option<PathBuf>,
    #[command(flatten)]
    pub pm: PmArgs,
    #[command(flatten)]
    pub local: LocalWorkerArgs,
}

/// `skills run SKILL --inputs FILE`: renders the skill (inputs checked against its
/// schema), then [`execute`].
pub async fn skill_run(cmd: &SkillRunCmd, g: &Global) -> anyhow::Result<i32> {
    let SkillRunCmd { id, inputs, args } = cmd;
    let reg = load_registry(&super::args::skill_sources(g))?;
    let skill = find_skill(&reg, id)?;
    let inputs = read_json(inputs)?;
    let job = match job_run::render(skill, &inputs) {
        Ok(j) => j,
        Err(f) => return Ok(report(g.output, Err(f))),
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
                f = f.at(job_run::dotted_to_pointer(&e.path));
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
    let store = &args.pm.store;
    std::fs::create_dir_all(&store.state_dir)?;
    // Declared before the local worker: dropped after it.
    let relay = super::run::inference_relay(&args.pm)?;
    let (pool, local) = super::run::worker_pool(
        &args.pm.workers,
        || {
            args.local.config(
                g,
                store,
                &args.pm.workers,
                seed.clone(),
                tenant.egress.allow.clone(),
                args.pm.model.local_inference(relay.as_ref()),
            )
        },
        relay.as_ref(),
        &|line| eprintln!("{line}"),
    )?;
    let env = job_run::Env {
        pool: &pool,
        gate: &gate,
        tenant: &tenant,
        seed: seed.as_deref(),
        artifacts_dir: &store.state_dir.join("artifacts"),
    };
    let outcome = job_run::execute(job, &env).await;
    // The local worker stops before the relay it reaches the model through.
    drop(local);
    drop(relay);
    Ok(outcome)
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
