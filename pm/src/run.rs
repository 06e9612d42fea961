//! `cynode-pm run "objective"` and `cynode-pm sessions …`: one objective end to end on
//! embedded defaults (SQLite in the state directory, a local `cynode-worker` the PM starts
//! and stops itself unless `--worker-endpoint` is given, the model endpoint from flags or
//! env), with live progress and terminal clarification questions.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tracing::Instrument;

use crate::dispatch::WorkerClient;
use crate::driver::{Pm, Progress};
use crate::llm::{LlmClient, ModelConfig};
use crate::policy::{Mode, PolicyGate, TenantPolicy};
use crate::session::{Budgets, SessionRecord, SessionStatus};
use crate::store::Store;
use crate::workers::WorkerPool;

/// Exit code when the session waits for an answer and no terminal can give it.
pub const EXIT_AWAITING_INPUT: i32 = 3;

/// Flags and env of seed §15 plus this project's additions.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// OpenAI-compatible endpoint, e.g. http://127.0.0.1:8089/v1.
    #[arg(
        long,
        env = "CYNODE_MODEL_BASE_URL",
        default_value = "http://127.0.0.1:8089/v1"
    )]
    pub model_base_url: String,
    /// openai-compatible (the only provider protocol spoken).
    #[arg(long, default_value = "openai-compatible")]
    pub model_provider: String,
    #[arg(long, env = "CYNODE_MODEL_NAME", default_value = "smollm2")]
    pub model_name: String,
    #[arg(long, default_value_t = 1024)]
    pub max_tokens: u32,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// A running worker; without it (and without --workers-file) a local cynode-worker
    /// is started and stopped.
    #[arg(long, env = "CYNODE_WORKER_ENDPOINT", conflicts_with = "workers_file")]
    pub worker_endpoint: Option<String>,
    /// The worker registry: a YAML file listing several workers with their tokens,
    /// purposes, images and capacity (see docs and `crate::workers`).
    #[arg(long, env = "CYNODE_WORKERS_FILE")]
    pub workers_file: Option<PathBuf>,
    /// How long a session's first job waits for a worker offering its purpose to answer
    /// before the session fails worker_unavailable.
    #[arg(long, default_value_t = 60)]
    pub worker_wait_seconds: u64,
    /// File with the worker's bearer token (else CYNODE_WORKER_TOKEN).
    #[arg(long)]
    pub worker_token_file: Option<PathBuf>,
    /// Backend of the local worker.
    #[arg(long, default_value = "podman")]
    pub local_backend: String,
    /// bwrap root filesystem of the sandbox image (local worker with --local-backend bwrap).
    #[arg(long)]
    pub local_bwrap_rootfs: Option<PathBuf>,
    /// Sandbox image jobs run in (with --worker-endpoint or the local worker; a workers
    /// file names an image per purpose).
    #[arg(long, default_value = "localhost/cynode-sba-test:latest")]
    pub sandbox_image: String,
    /// Where the PM keeps its database and artifacts.
    #[arg(long, env = "CYNODE_STATE_DIR", default_value = ".cynode")]
    pub state_dir: PathBuf,
    /// sqlite://PATH (default: <state-dir>/pm.db) or postgres://…
    #[arg(long, env = "CYNODE_DATASTORE_ENDPOINT")]
    pub datastore_endpoint: Option<String>,
    #[arg(long, env = "CYNODE_TENANT_ID", default_value = "default")]
    pub tenant_id: String,
    #[arg(long, default_value_t = 30)]
    pub max_turns: u32,
    #[arg(long, default_value_t = 20)]
    pub max_jobs: u32,
}

/// A local worker started for this run; stopped on drop.
struct LocalWorker {
    child: Child,
    endpoint: String,
    token: String,
}

impl Drop for LocalWorker {
    fn drop(&mut self) {
        // SAFETY: SIGTERM to the worker we started, for a graceful stop.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

fn start_local_worker(args: &RunArgs, seed: Option<&Path>) -> anyhow::Result<LocalWorker> {
    let exe = std::env::current_exe().context("cannot find the cynode-pm executable")?;
    let bin = exe.with_file_name("cynode-worker");
    anyhow::ensure!(
        bin.is_file(),
        "no cynode-worker next to {}: build it or pass --worker-endpoint",
        exe.display()
    );
    let dir = std::fs::canonicalize(&args.state_dir)?.join("worker");
    std::fs::create_dir_all(&dir)?;
    use std::os::unix::fs::PermissionsExt;
    for d in [args.state_dir.as_path(), dir.as_path()] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
    }
    let token =
        format!("{}", uuid::Uuid::new_v4().simple()) + &uuid::Uuid::new_v4().simple().to_string();
    let token_file = dir.join("token");
    std::fs::write(&token_file, &token)?;
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600))?;
    let mut cfg = format!(
        "listen: 127.0.0.1:0\nbackend: {}\nstate_dir: {}\ntoken_file: {}\n",
        args.local_backend,
        dir.join("state").display(),
        token_file.display()
    );
    if let Some(seed) = seed {
        cfg.push_str(&format!("seed_roots:\n  - {}\n", seed.display()));
    }
    if let Some(rootfs) = &args.local_bwrap_rootfs {
        cfg.push_str(&format!(
            "bwrap:\n  rootfs:\n    \"{}\": {}\n",
            args.sandbox_image,
            rootfs.display()
        ));
    }
    let cfg_path = dir.join("worker.yaml");
    std::fs::write(&cfg_path, cfg)?;
    let mut child = Command::new(&bin)
        .args(["serve", "--config"])
        .arg(&cfg_path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {}", bin.display()))?;
    let stderr = child.stderr.take().context("worker stderr")?;
    let log_path = dir.join("worker.log");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut log = std::fs::File::create(&log_path).ok();
        let mut tx = Some(tx);
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if let Some(l) = log.as_mut() {
                let _ = writeln!(l, "{line}");
            }
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                if v["fields"]["message"] == "cynode-worker listening" {
                    if let Some(tx) = tx.take() {
                        let _ =
                            tx.send(v["fields"]["addr"].as_str().unwrap_or_default().to_string());
                    }
                }
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(60)).map_err(|_| {
        anyhow::anyhow!(
            "the local worker did not start; see {}",
            dir.join("worker.log").display()
        )
    })?;
    Ok(LocalWorker {
        child,
        endpoint: format!("http://{addr}"),
        token,
    })
}

/// The registry given by `--workers-file` or `--worker-endpoint`; `None` when neither is
/// given (`run` then starts a local worker).
pub(crate) fn configured_workers(args: &RunArgs) -> anyhow::Result<Option<WorkerPool>> {
    if let Some(path) = &args.workers_file {
        let file = crate::workers::WorkersFile::load(path)?;
        return Ok(Some(WorkerPool::from_file(&file)?));
    }
    match &args.worker_endpoint {
        Some(e) => Ok(Some(WorkerPool::single(
            WorkerClient::new(e, &worker_token(args)?),
            &args.sandbox_image,
        ))),
        None => Ok(None),
    }
}

pub(crate) async fn build_pm(
    args: &RunArgs,
    global: &crate::cli::Global,
    workers: WorkerPool,
) -> anyhow::Result<Pm> {
    std::fs::create_dir_all(&args.state_dir)?;
    let url = match &args.datastore_endpoint {
        Some(u) => u.clone(),
        None => format!(
            "sqlite://{}",
            std::fs::canonicalize(&args.state_dir)?
                .join("pm.db")
                .display()
        ),
    };
    let store = Store::connect(&url)
        .await
        .with_context(|| format!("cannot open the datastore {url}"))?;
    let registry = crate::cli::load_registry(global)?;
    let gate: PolicyGate = crate::cli::gate(global, Mode::Enforce)?;
    let tenant: TenantPolicy = crate::cli::tenant(global)?;
    let mut cfg = ModelConfig::new(&args.model_base_url, &args.model_name);
    cfg.max_tokens = args.max_tokens;
    cfg.temperature = args.temperature;
    cfg.api_key = ModelConfig::api_key_from_env();
    // The model (and `GET /v1/skills`) sees only the skills some worker can run.
    let catalog = registry.catalog_of(|skill| {
        let m = &skill.manifest;
        let runnable = workers.offers(&m.purpose);
        if !runnable {
            tracing::warn!(skill_id = %m.skill_id, purpose = %m.purpose, "no worker offers this skill's sandbox purpose; the model is not offered it");
        }
        runnable
    });
    anyhow::ensure!(
        !catalog.is_empty() || registry.iter().next().is_none(),
        "no worker offers the sandbox purpose of any skill (offered: {})",
        workers.offered().join(", ")
    );
    Ok(Pm {
        contract: crate::llm::Contract::new(catalog)?,
        registry,
        store,
        gate,
        tenant,
        llm: LlmClient::new(cfg),
        workers,
        worker_wait: Duration::from_secs(args.worker_wait_seconds),
        artifacts_dir: args.state_dir.join("artifacts"),
    })
}

pub(crate) fn worker_token(args: &RunArgs) -> anyhow::Result<String> {
    match &args.worker_token_file {
        Some(p) => Ok(std::fs::read_to_string(p)?.trim().to_string()),
        None => std::env::var("CYNODE_WORKER_TOKEN")
            .context("give --worker-token-file or CYNODE_WORKER_TOKEN with --worker-endpoint"),
    }
}

/// Prints progress: a spinner on a terminal, plain lines otherwise.
struct Reporter {
    bar: Option<indicatif::ProgressBar>,
}

impl Reporter {
    fn new(json: bool) -> Self {
        let bar = (!json && std::io::stderr().is_terminal()).then(|| {
            let b = indicatif::ProgressBar::new_spinner();
            b.enable_steady_tick(Duration::from_millis(120));
            b
        });
        Reporter { bar }
    }

    fn line(&self, msg: String) {
        match &self.bar {
            Some(b) => b.set_message(msg),
            None => eprintln!("{msg}"),
        }
    }

    fn report(&self, p: Progress) {
        let msg = match p {
            Progress::Turn(t) => format!("turn {t}: asking the model"),
            Progress::Reply { kind } => format!("model replied: {kind}"),
            Progress::Plan(plan) => format!(
                "plan: {}",
                plan.iter()
                    .map(|e| format!("{} [{:?}]", e.task_id, e.status))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Progress::Dispatched {
                job_id,
                task_id,
                skill_id,
            } => format!("job {job_id}: {skill_id} for {task_id}"),
            Progress::JobState { job_id, state } => format!("job {job_id}: {state:?}"),
            Progress::JobDone { job_id, status } => format!("job {job_id}: {status}"),
            Progress::PolicyDenied { task_id, reasons } => {
                format!("policy denied {task_id}: {}", reasons.join("; "))
            }
            Progress::Question(q) => format!("question: {q}"),
            Progress::Finished(s) => format!("session {}", s.as_str()),
        };
        self.line(msg);
    }

    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// Runs (or resumes) a session to its end; returns the exit code. Everything it does is
/// inside one `session` span (one trace when traces are exported).
pub async fn run_session(
    args: &RunArgs,
    global: &crate::cli::Global,
    objective: Option<&str>,
    resume: Option<&str>,
    workspace: Option<&Path>,
    answer: Option<&str>,
) -> anyhow::Result<i32> {
    let session_id = match resume {
        Some(id) => id.to_string(),
        None => format!("s-{}", uuid::Uuid::new_v4()),
    };
    let span = tracing::info_span!("session", session_id = %session_id);
    drive_session(
        args,
        global,
        objective,
        resume,
        workspace,
        answer,
        &session_id,
    )
    .instrument(span)
    .await
}

async fn drive_session(
    args: &RunArgs,
    global: &crate::cli::Global,
    objective: Option<&str>,
    resume: Option<&str>,
    workspace: Option<&Path>,
    answer: Option<&str>,
    session_id: &str,
) -> anyhow::Result<i32> {
    std::fs::create_dir_all(&args.state_dir)?;
    let seed = workspace
        .map(std::fs::canonicalize)
        .transpose()
        .context("--workspace")?;
    let local;
    let workers = match configured_workers(args)? {
        Some(pool) => pool,
        None => {
            local = start_local_worker(args, seed.as_deref())?;
            WorkerPool::single(
                WorkerClient::new(&local.endpoint, &local.token),
                &args.sandbox_image,
            )
        }
    };
    let pm = build_pm(args, global, workers).await?;
    let session_id = match (objective, resume) {
        (_, Some(id)) => {
            if let Some(text) = answer {
                pm.answer(id, text).await?;
            }
            id.to_string()
        }
        (Some(obj), None) => {
            let id = session_id.to_string();
            let budgets = Budgets {
                max_turns: args.max_turns,
                max_jobs: args.max_jobs,
                ..Budgets::default()
            };
            let mut rec = SessionRecord::new(&id, &args.tenant_id, obj, budgets);
            // The workspace is created, seeded from here, on the worker its first job
            // is placed on.
            rec.workspace_seed = seed.as_ref().map(|p| p.display().to_string());
            pm.create(&rec).await?;
            id
        }
        (None, None) => anyhow::bail!("give an objective or a session to resume"),
    };
    let json_out = global.output == crate::cli::Output::Json;
    let reporter = Reporter::new(json_out);
    reporter.line(format!("session {session_id}"));
    let interactive = std::io::stdin().is_terminal();
    let rec = loop {
        let rec = pm.run(&session_id, &mut |p| reporter.report(p)).await?;
        if rec.status == SessionStatus::AwaitingInput && interactive {
            let crate::session::Phase::AwaitInput { question } = &rec.phase else {
                break rec;
            };
            reporter.finish();
            eprint!("{question}\n> ");
            let mut answer = String::new();
            std::io::stdin().lock().read_line(&mut answer)?;
            pm.answer(&session_id, answer.trim()).await?;
            continue;
        }
        break rec;
    };
    reporter.finish();
    Ok(print_outcome(&rec, json_out))
}

/// Prints the deliverable or the failure; returns the exit code.
pub fn print_outcome(rec: &SessionRecord, json_out: bool) -> i32 {
    if json_out {
        println!("{}", serde_json::to_string_pretty(rec).unwrap_or_default());
    }
    match rec.status {
        SessionStatus::Completed => {
            if !json_out {
                if let Some(d) = &rec.deliverable {
                    println!("{}", d.summary);
                    for a in &d.artifacts {
                        println!(
                            "  artifact {} sha256:{} ({} bytes)",
                            a.path, a.sha256, a.size_bytes
                        );
                    }
                    if let Some(c) = &d.changeset {
                        println!("\n{c}");
                    }
                }
            }
            0
        }
        SessionStatus::AwaitingInput => {
            if !json_out {
                if let crate::session::Phase::AwaitInput { question } = &rec.phase {
                    println!("awaiting input: {question}");
                    println!(
                        "answer with: cynode-pm sessions resume {} --answer TEXT",
                        rec.state.session_id
                    );
                }
            }
            EXIT_AWAITING_INPUT
        }
        _ => {
            if !json_out {
                let f = rec.failure.as_ref();
                eprintln!(
                    "session {} {}: {}",
                    rec.state.session_id,
                    f.map(|f| f.kind.as_str()).unwrap_or("failed"),
                    f.map(|f| f.message.as_str()).unwrap_or("")
                );
            }
            1
        }
    }
}
