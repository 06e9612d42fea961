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

/// The flags and environment of `run` (and of `serve`, which flattens them).
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
    /// How long one model request may take; a reply is asked at most 3 times on
    /// timeouts and transport errors, so a model that never answers fails the session
    /// after about 3 × this.
    #[arg(long, env = "CYNODE_MODEL_TIMEOUT_SECONDS", default_value_t = 120,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub model_timeout_seconds: u64,
    /// PEM file of extra CA certificates to trust for an https:// model endpoint (the
    /// system's roots, and SSL_CERT_FILE, are trusted too).
    #[arg(long, env = "CYNODE_MODEL_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// A running worker; without it (and without --workers-file) a local cynode-worker
    /// is started and stopped.
    #[arg(long, env = "CYNODE_WORKER_ENDPOINT", conflicts_with = "workers_file")]
    pub worker_endpoint: Option<String>,
    /// PEM file of extra CA certificates to trust for an https:// --worker-endpoint (the
    /// system's roots are trusted too).
    #[arg(long, requires = "worker_endpoint")]
    pub worker_ca_file: Option<PathBuf>,
    /// PEM client certificate presented to a --worker-endpoint that requires one (mutual
    /// TLS); needs --worker-client-key.
    #[arg(long, requires_all = ["worker_endpoint", "worker_client_key"])]
    pub worker_client_cert: Option<PathBuf>,
    /// PEM private key of --worker-client-cert.
    #[arg(long, requires_all = ["worker_endpoint", "worker_client_cert"])]
    pub worker_client_key: Option<PathBuf>,
    /// Allows a plain http:// --worker-endpoint on a non-loopback host (the worker token
    /// then crosses the network in clear); a workers file says `allow_plain_http: true`
    /// per entry instead.
    #[arg(long, requires = "worker_endpoint")]
    pub allow_plain_http_worker: bool,
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
    /// An empty value (e.g. `CYNODE_SANDBOX_IMAGE=`) is refused here, not by the worker.
    #[arg(
        long,
        env = "CYNODE_SANDBOX_IMAGE",
        default_value = "localhost/cynode-sba-test:latest",
        value_parser = clap::builder::NonEmptyStringValueParser::new()
    )]
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
///
/// It lives and dies with this PM: the child gets `PR_SET_PDEATHSIG = SIGKILL`, so a PM
/// killed with SIGKILL (or crashing) takes its worker along, and the worker's bwrap
/// sandboxes follow it (`--die-with-parent`). The parent-death signal fires when the
/// *thread* that forked the child exits, not only the process, so the child is spawned
/// from a dedicated thread ([`supervise`]) that lives until this value is dropped, never
/// from a runtime thread that tokio may retire.
///
/// The worker locks its state directory (`cynode-worker serve` holds a `flock` on
/// `<state>/worker/state/worker.lock`), so a second PM on the same `--state-dir` starts a
/// worker that waits for the first one to be gone before it reconciles anything; this
/// PM waits for it, saying so, and never runs a rival beside it.
struct LocalWorker {
    endpoint: String,
    token: String,
    /// Dropping it tells the supervising thread to stop the worker.
    stop: Option<std::sync::mpsc::Sender<()>>,
    supervisor: Option<std::thread::JoinHandle<()>>,
    /// This run's token and config files, removed once the worker stopped.
    files: Vec<PathBuf>,
}

impl Drop for LocalWorker {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.supervisor.take() {
            let _ = t.join();
        }
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// Environment variables the local worker gets from this process, when set: what it needs
/// to find and run its sandbox engine, its logs and its traces. Nothing else passes (no
/// `CYNODE_MODEL_API_KEY`, no tokens, no other secret): the worker starts from a cleared
/// environment.
pub const LOCAL_WORKER_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    "XDG_RUNTIME_DIR",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "CONTAINERS_CONF",
    "CONTAINERS_STORAGE_CONF",
    "CONTAINERS_REGISTRIES_CONF",
    "RUST_LOG",
    "CYNODE_OTLP_ENDPOINT",
    // The roots its https clients (OTLP, an https inference upstream) trust.
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
];

/// What the worker's log says while it starts.
enum StartEvent {
    Waiting(String),
    Listening(String),
}

/// Spawns the worker from the calling thread (which must outlive it, see [`LocalWorker`])
/// and then waits there for the stop signal (the sender dropped), then stops it with
/// SIGTERM and reaps it.
fn supervise(
    mut cmd: Command,
    spawned: std::sync::mpsc::Sender<std::io::Result<(u32, std::process::ChildStderr)>>,
    stop: std::sync::mpsc::Receiver<()>,
) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: between fork and exec only async-signal-safe calls: prctl and getppid.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The PM died before the signal was armed: do not outlive it.
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::other("the cynode-pm process is gone"));
            }
            Ok(())
        });
    }
    let mut child: Child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let _ = spawned.send(Err(e));
            return;
        }
    };
    let sent = match child.stderr.take() {
        Some(stderr) => spawned.send(Ok((child.id(), stderr))).is_ok(),
        None => false,
    };
    if sent {
        // Blocks until the LocalWorker is dropped (or the PM exits, taking us along).
        let _ = stop.recv();
    }
    // SAFETY: SIGTERM to the worker we started and have not reaped yet, for a graceful stop.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let _ = child.wait();
}

fn start_local_worker(
    args: &RunArgs,
    global: &crate::cli::Global,
    seed: Option<&Path>,
    reporter: &Reporter,
) -> anyhow::Result<LocalWorker> {
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
    // Per PM: a second PM on this state directory writes its own files, so the first
    // one's worker keeps the token and config it started with.
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let token =
        format!("{}", uuid::Uuid::new_v4().simple()) + &uuid::Uuid::new_v4().simple().to_string();
    let token_file = dir.join(format!("token-{tag}"));
    {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&token_file)?;
        f.write_all(token.as_bytes())?;
    }
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
    let cfg_path = dir.join(format!("worker-{tag}.yaml"));
    std::fs::write(&cfg_path, cfg)?;
    let mut cmd = Command::new(&bin);
    cmd.args(["serve", "--config"])
        .arg(&cfg_path)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for name in LOCAL_WORKER_ENV {
        if let Some(v) = std::env::var_os(name) {
            cmd.env(name, v);
        }
    }
    if let Some(e) = &global.otlp_endpoint {
        cmd.env("CYNODE_OTLP_ENDPOINT", e);
    }
    let (spawned_tx, spawned_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel();
    let supervisor = std::thread::Builder::new()
        .name("local-worker".into())
        .spawn(move || supervise(cmd, spawned_tx, stop_rx))
        .context("cannot start the local worker's supervising thread")?;
    let mut worker = LocalWorker {
        endpoint: String::new(),
        token,
        stop: Some(stop_tx),
        supervisor: Some(supervisor),
        files: vec![token_file, cfg_path],
    };
    let (pid, stderr) = spawned_rx
        .recv()
        .map_err(|_| anyhow::anyhow!("the local worker's supervising thread ended"))?
        .with_context(|| format!("cannot start {}", bin.display()))?;
    let log_path = dir.join("worker.log");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .ok();
        let mut tx = Some(tx);
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if let Some(l) = log.as_mut() {
                let _ = writeln!(l, "{line}");
            }
            let Some(t) = tx.as_ref() else { continue };
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                let message = &v["fields"]["message"];
                if *message == "cynode-worker listening" {
                    let addr = v["fields"]["addr"].as_str().unwrap_or_default().to_string();
                    let _ = t.send(StartEvent::Listening(addr));
                    tx = None;
                } else if *message == LOCK_WAIT_MESSAGE {
                    let holder = v["fields"]["holder_pid"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    let _ = t.send(StartEvent::Waiting(holder));
                }
            }
        }
    });
    let not_started = || {
        anyhow::anyhow!(
            "the local worker did not start; see {}",
            dir.join("worker.log").display()
        )
    };
    let mut limit = Some(Duration::from_secs(60));
    let addr = loop {
        let event = match limit {
            Some(l) => rx.recv_timeout(l).map_err(|_| not_started())?,
            None => rx.recv().map_err(|_| not_started())?,
        };
        match event {
            StartEvent::Listening(addr) => break addr,
            StartEvent::Waiting(holder) => {
                // Another PM's worker runs on this state directory: wait for it to finish
                // (however long its session takes), never start beside it.
                reporter.line(format!(
                    "another cynode-pm's worker (pid {holder}) uses {}; waiting for it to finish",
                    dir.display()
                ));
                tracing::warn!(holder_pid = %holder, state_dir = %dir.display(), "waiting for the running local worker");
                limit = None;
            }
        }
    };
    tracing::info!(pid, addr = %addr, "local worker started");
    worker.endpoint = format!("http://{addr}");
    Ok(worker)
}

/// Log message of a worker waiting for its state-directory lock
/// (`cynode_worker::cli::LOCK_WAIT_MESSAGE`; the PM does not link the worker).
const LOCK_WAIT_MESSAGE: &str = "waiting for the state directory lock";

/// The registry given by `--workers-file` or `--worker-endpoint`; `None` when neither is
/// given (`run` then starts a local worker).
pub(crate) fn configured_workers(args: &RunArgs) -> anyhow::Result<Option<WorkerPool>> {
    if let Some(path) = &args.workers_file {
        let file = crate::workers::WorkersFile::load(path)?;
        return Ok(Some(WorkerPool::from_file(&file)?));
    }
    let Some(endpoint) = &args.worker_endpoint else {
        return Ok(None);
    };
    let tls = cynode_tls::ClientTls {
        ca_file: args.worker_ca_file.clone(),
        cert_file: args.worker_client_cert.clone(),
        key_file: args.worker_client_key.clone(),
    };
    crate::workers::check_endpoint(
        endpoint,
        !tls.is_default(),
        args.allow_plain_http_worker,
        "--allow-plain-http-worker",
    )
    .map_err(|e| anyhow::anyhow!("--worker-endpoint: {e}"))?;
    let client = WorkerClient::with_tls(endpoint, &worker_token(args)?, &tls)
        .context("--worker-endpoint: tls")?;
    Ok(Some(WorkerPool::single(client, &args.sandbox_image)))
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
    cfg.timeout = Duration::from_secs(args.model_timeout_seconds);
    cfg.ca_file = args.ca_file.clone();
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

/// Prints progress to stderr: the chain of what happens (each reply, the plan, each job
/// with its sandbox, its result and verified artifacts) as lines that stay, and what is
/// under way (asking the model, a job's state) on a spinner line on a terminal.
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

    /// A line that stays.
    fn line(&self, msg: String) {
        match &self.bar {
            Some(b) => b.println(msg),
            None => eprintln!("{msg}"),
        }
    }

    /// What is under way: the spinner's message on a terminal, a line otherwise.
    fn status(&self, msg: String) {
        match &self.bar {
            Some(b) => b.set_message(msg),
            None => eprintln!("{msg}"),
        }
    }

    fn report(&self, p: Progress) {
        match p {
            Progress::Turn(t) => self.status(format!("turn {t}: asking the model")),
            Progress::Reply { kind, detail } => self.line(format!("model: {kind}: {detail}")),
            Progress::Plan(plan) => {
                self.line("plan:".to_string());
                for e in plan {
                    self.line(format!(
                        "  {} [{:?}] {}",
                        e.task_id, e.status, e.description
                    ));
                }
            }
            Progress::Dispatched {
                job_id,
                task_id,
                skill_id,
                worker_id,
                image,
            } => self.line(format!(
                "job {job_id}: skill {skill_id} for task {task_id}, on worker {worker_id} in \
                 sandbox {image}"
            )),
            Progress::JobState { job_id, state } => self.status(format!("job {job_id}: {state:?}")),
            Progress::JobDone {
                job_id,
                status,
                failure,
                artifacts,
            } => {
                let why = failure.map(|f| format!(" ({f})")).unwrap_or_default();
                self.line(format!("job {job_id}: {status}{why}"));
                for a in artifacts {
                    self.line(format!(
                        "  artifact {} sha256:{} ({} bytes, verified)",
                        a.path, a.sha256, a.size_bytes
                    ));
                }
            }
            Progress::PolicyDenied { task_id, reasons } => {
                self.line(format!("policy denied {task_id}: {}", reasons.join("; ")))
            }
            Progress::Question(q) => self.line(format!("question: {q}")),
            Progress::Finished(s) => self.line(format!("session {}", s.as_str())),
        }
    }

    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// What [`run_session`] starts from.
#[derive(Debug, Clone, Copy)]
pub enum Start<'a> {
    /// A new session for `objective`, its workspace seeded from `workspace`.
    /// `interactive`: a person answers the model's questions at this terminal (else the
    /// model is never offered `message`, see `llm::turn`).
    New {
        objective: &'a str,
        workspace: Option<&'a Path>,
        interactive: bool,
    },
    /// A stored session, given `answer` first when it waits for one.
    Resume {
        id: &'a str,
        answer: Option<&'a str>,
    },
}

/// Runs (or resumes) a session to its end; returns the exit code. Everything it does is
/// inside one `session` span (one trace when traces are exported).
pub async fn run_session(
    args: &RunArgs,
    global: &crate::cli::Global,
    start: Start<'_>,
) -> anyhow::Result<i32> {
    let session_id = match start {
        Start::Resume { id, .. } => id.to_string(),
        Start::New { .. } => format!("s-{}", uuid::Uuid::new_v4()),
    };
    let span = tracing::info_span!("session", session_id = %session_id);
    drive_session(args, global, start, &session_id)
        .instrument(span)
        .await
}

async fn drive_session(
    args: &RunArgs,
    global: &crate::cli::Global,
    start: Start<'_>,
    session_id: &str,
) -> anyhow::Result<i32> {
    std::fs::create_dir_all(&args.state_dir)?;
    let seed = match start {
        Start::New {
            workspace: Some(w), ..
        } => Some(std::fs::canonicalize(w).context("--workspace")?),
        _ => None,
    };
    let json_out = global.output == crate::cli::Output::Json;
    let reporter = Reporter::new(json_out);
    let local;
    let workers = match configured_workers(args)? {
        Some(pool) => pool,
        None => {
            local = start_local_worker(args, global, seed.as_deref(), &reporter)?;
            WorkerPool::single(
                WorkerClient::new(&local.endpoint, &local.token),
                &args.sandbox_image,
            )
        }
    };
    let pm = build_pm(args, global, workers).await?;
    match start {
        Start::Resume { id, answer } => {
            if let Some(text) = answer {
                pm.answer(id, text).await?;
            }
        }
        Start::New {
            objective,
            interactive,
            ..
        } => {
            let budgets = Budgets {
                max_turns: args.max_turns,
                max_jobs: args.max_jobs,
                ..Budgets::default()
            };
            let mut rec = SessionRecord::new(session_id, &args.tenant_id, objective, budgets);
            rec.interactive = interactive;
            // The workspace is created, seeded from here, on the worker its first job
            // is placed on.
            rec.workspace_seed = seed.as_ref().map(|p| p.display().to_string());
            pm.create(&rec).await?;
        }
    }
    reporter.line(format!("session {session_id}"));
    let interactive = std::io::stdin().is_terminal();
    let rec = loop {
        let rec = pm.run(session_id, &mut |p| reporter.report(p)).await?;
        if rec.status == SessionStatus::AwaitingInput && interactive {
            let crate::session::Phase::AwaitInput { question } = &rec.phase else {
                break rec;
            };
            reporter.finish();
            eprint!("{question}\n> ");
            let mut answer = String::new();
            std::io::stdin().lock().read_line(&mut answer)?;
            pm.answer(session_id, answer.trim()).await?;
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
                    println!("deliverable: {}", d.summary);
                    for a in &d.artifacts {
                        println!(
                            "  artifact {} sha256:{} ({} bytes, verified)",
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    #[test]
    fn an_empty_sandbox_image_is_refused_at_the_command_line() {
        let parse = |image: &str| {
            crate::cli::Cli::try_parse_from(["cynode-pm", "run", "o", "--sandbox-image", image])
        };
        let err = parse("").unwrap_err().to_string();
        assert!(err.contains("--sandbox-image"), "{err}");
        assert!(parse("localhost/x:1").is_ok());
    }
}
