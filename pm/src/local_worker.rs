//! The worker `cynode-pm run` starts (and stops) itself when no worker is configured: a
//! `cynode-worker serve` child on a fresh token, bound to 127.0.0.1, living and dying with
//! this PM.
//!
//! Architecture invariant: the child starts from a cleared environment plus
//! [`LOCAL_WORKER_ENV`]; no secret of the PM (model key, tokens) reaches it or its
//! sandboxes.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::config::LocalWorkerConfig;

/// Why the local worker did not start.
#[derive(Debug, thiserror::Error)]
pub enum LocalWorkerError {
    #[error("no cynode-worker at {}: build it or pass --worker-endpoint", .0.display())]
    Missing(PathBuf),
    #[error("cannot prepare the local worker's directory {}: {cause}", dir.display())]
    Prepare { dir: PathBuf, cause: std::io::Error },
    #[error("cannot start {}: {cause}", program.display())]
    Spawn {
        program: PathBuf,
        cause: std::io::Error,
    },
    #[error("the local worker did not start; see {}", .0.display())]
    NotStarted(PathBuf),
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
pub struct LocalWorker {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    /// The bearer token made for this run.
    pub token: String,
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

impl LocalWorker {
    /// Starts the worker of `cfg` and waits until it listens (up to 60 s). When another
    /// PM's worker holds the state directory, `waiting` is told the holder's pid and this
    /// waits for it as long as it takes.
    pub fn start(
        cfg: &LocalWorkerConfig,
        waiting: &dyn Fn(&str, &std::path::Path),
    ) -> Result<LocalWorker, LocalWorkerError> {
        let bin = &cfg.program;
        if !bin.is_file() {
            return Err(LocalWorkerError::Missing(bin.clone()));
        }
        let (dir, cfg_path, token_file, token) =
            prepare(cfg).map_err(|cause| LocalWorkerError::Prepare {
                dir: cfg.state_dir.join("worker"),
                cause,
            })?;
        let mut cmd = Command::new(bin);
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
        if let Some(e) = &cfg.otlp_endpoint {
            cmd.env("CYNODE_OTLP_ENDPOINT", e);
        }
        let spawn_error = |cause| LocalWorkerError::Spawn {
            program: bin.clone(),
            cause,
        };
        let (spawned_tx, spawned_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel();
        let supervisor = std::thread::Builder::new()
            .name("local-worker".into())
            .spawn(move || supervise(cmd, spawned_tx, stop_rx))
            .map_err(spawn_error)?;
        let mut worker = LocalWorker {
            endpoint: String::new(),
            token,
            stop: Some(stop_tx),
            supervisor: Some(supervisor),
            files: vec![token_file, cfg_path],
        };
        let (pid, stderr) = spawned_rx
            .recv()
            .map_err(|_| spawn_error(std::io::Error::other("the supervising thread ended")))?
            .map_err(spawn_error)?;
        let rx = watch_log(stderr, dir.join("worker.log"));
        let not_started = || LocalWorkerError::NotStarted(dir.join("worker.log"));
        let mut limit = Some(Duration::from_secs(60));
        let addr = loop {
            let event = match limit {
                Some(l) => rx.recv_timeout(l).map_err(|_| not_started())?,
                None => rx.recv().map_err(|_| not_started())?,
            };
            match event {
                StartEvent::Listening(addr) => break addr,
                StartEvent::Waiting(holder) => {
                    // Another PM's worker runs on this state directory: wait for it to
                    // finish (however long its session takes), never start beside it.
                    waiting(&holder, &dir);
                    tracing::warn!(holder_pid = %holder, state_dir = %dir.display(), "waiting for the running local worker");
                    limit = None;
                }
            }
        };
        tracing::info!(pid, addr = %addr, "local worker started");
        worker.endpoint = format!("http://{addr}");
        Ok(worker)
    }
}

/// Creates `<state_dir>/worker` and writes this run's token and worker config there;
/// returns the directory (canonical), the config's path, the token file's path and the
/// token.
fn prepare(cfg: &LocalWorkerConfig) -> std::io::Result<(PathBuf, PathBuf, PathBuf, String)> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let dir = cfg.state_dir.join("worker");
    std::fs::create_dir_all(&dir)?;
    let dir = std::fs::canonicalize(&dir)?;
    for d in [cfg.state_dir.as_path(), dir.as_path()] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
    }
    // Per PM: a second PM on this state directory writes its own files, so the first
    // one's worker keeps the token and config it started with.
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let token =
        format!("{}", uuid::Uuid::new_v4().simple()) + &uuid::Uuid::new_v4().simple().to_string();
    let token_file = dir.join(format!("token-{tag}"));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&token_file)?
        .write_all(token.as_bytes())?;
    let mut yaml = format!(
        "listen: 127.0.0.1:0\nbackend: {}\nstate_dir: {}\ntoken_file: {}\n",
        cfg.backend,
        dir.join("state").display(),
        token_file.display()
    );
    if let Some(seed) = &cfg.seed {
        yaml.push_str(&format!("seed_roots:\n  - {}\n", seed.display()));
    }
    if let Some(rootfs) = &cfg.bwrap_rootfs {
        yaml.push_str(&format!(
            "bwrap:\n  rootfs:\n    \"{}\": {}\n",
            cfg.image,
            rootfs.display()
        ));
    }
    let cfg_path = dir.join(format!("worker-{tag}.yaml"));
    std::fs::write(&cfg_path, yaml)?;
    Ok((dir, cfg_path, token_file, token))
}

/// Copies the worker's log lines to `log_path` and reports, on the returned channel, when
/// it waits for the state directory's lock and when it listens.
fn watch_log(
    stderr: std::process::ChildStderr,
    log_path: PathBuf,
) -> std::sync::mpsc::Receiver<StartEvent> {
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
    rx
}

/// Log message of a worker waiting for its state-directory lock
/// (`LOCK_WAIT_MESSAGE` in cynode-worker's `src/cli.rs`; the PM does not link the worker).
const LOCK_WAIT_MESSAGE: &str = "waiting for the state directory lock";
