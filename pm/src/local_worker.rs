//! The worker `cynode-pm run` uses when no worker is configured: a `cynode-worker serve`
//! bound to 127.0.0.1 on a fresh token, started and kept by a [`keeper`] process that
//! holds the state directory's lease. A PM attaches to the keeper already running on its
//! state directory (a `sessions resume` after kill -9 finds the job still running, or its
//! result kept) or starts one; a job outlives a killed PM for the grace period.
//!
//! Architecture invariant: the keeper and the worker start from a cleared environment
//! plus [`LOCAL_WORKER_ENV`]; no secret of the PM (model key, tokens) reaches them or the
//! sandboxes.

pub mod keeper;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::config::{LocalInference, LocalWorkerConfig};
use keeper::{Hello, KeeperArgs, KeeperEvent};

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
    #[error("the local worker did not start ({reason}); see {}", log.display())]
    NotStarted { reason: String, log: PathBuf },
}

/// What [`LocalWorker::start`] tells its caller while it starts.
#[derive(Debug, Clone, PartialEq)]
pub enum Notice {
    /// Another process holds the worker's state lock (`holder_pid`); the worker waits.
    Waiting { holder_pid: String, dir: PathBuf },
    /// A keeper already ran on this state directory: its worker is used.
    Attached { keeper_pid: u32, dir: PathBuf },
}

/// This PM's use of the local worker. Dropping it releases the worker: when no other PM
/// uses it, the keeper stops it at once. A PM that dies without dropping it (kill -9,
/// Ctrl-C) leaves the worker to its keeper's grace period.
pub struct LocalWorker {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    /// The worker's bearer token.
    pub token: String,
    /// The keeper's process id.
    pub keeper_pid: u32,
    /// The connection to the keeper, open while this PM uses the worker.
    conn: Option<UnixStream>,
    /// The keeper, when this PM started it (reaped once it stopped).
    keeper: Option<Child>,
    /// The inference relay of an earlier PM that this already running worker still
    /// calls (its base URL), when it is not this run's: this PM serves it
    /// ([`crate::inference_relay::Relay::also_serve`]).
    pub previous_relay: Option<String>,
}

impl Drop for LocalWorker {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let _ = conn.set_read_timeout(Some(Duration::from_secs(40)));
        let _ = conn.write_all(b"release\n");
        let mut answer = String::new();
        let _ = BufReader::new(&conn).read_line(&mut answer);
        if answer.trim() == "kept" {
            return;
        }
        // Stopped (or gone): reap the keeper this PM started.
        if let Some(k) = self.keeper.as_mut() {
            let t = Instant::now();
            while matches!(k.try_wait(), Ok(None)) && t.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(20));
            }
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

impl LocalWorker {
    /// Attaches to the keeper running on `cfg`'s state directory, or starts one (and its
    /// worker) and waits until the worker listens (up to 60 s; as long as it takes while
    /// another process holds the worker's state lock, which `notice` is told).
    pub fn start(
        cfg: &LocalWorkerConfig,
        notice: &dyn Fn(Notice),
    ) -> Result<LocalWorker, LocalWorkerError> {
        if !cfg.program.is_file() {
            return Err(LocalWorkerError::Missing(cfg.program.clone()));
        }
        let prepare_error = |cause| LocalWorkerError::Prepare {
            dir: cfg.state_dir.join("worker"),
            cause,
        };
        let dir = prepare_dir(cfg).map_err(prepare_error)?;
        let not_started = |reason: String| LocalWorkerError::NotStarted {
            reason,
            log: dir.join("worker.log"),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut delay = Duration::from_millis(20);
        loop {
            if let Some((mut w, mut hello)) = attach(&dir) {
                // Its egress ceiling must be this run's exactly: a wider one would let
                // this run's jobs go where it does not allow, a narrower one would stop
                // them. Its model need not be: a resume after kill -9 must reach the job
                // its worker still runs, whatever the model's address is now; the
                // running worker's agent jobs keep its upstream, and the log says so.
                if (cfg.seed.is_none() || cfg.seed == hello.seed)
                    && hello.egress_allow == cfg.egress_allow
                {
                    if hello.inference != inference_url(cfg) {
                        let relays =
                            hello.relay && cfg.inference.as_ref().is_some_and(|i| i.key_per_job);
                        if let Some(url) = hello.inference.take().filter(|_| relays) {
                            w.previous_relay = Some(url);
                        } else {
                            tracing::warn!(
                            worker_inference = hello.inference.as_deref().unwrap_or("none"),
                            "the local worker already running keeps its own inference upstream; this run's agent jobs use it"
                        );
                        }
                    }
                    notice(Notice::Attached {
                        keeper_pid: w.keeper_pid,
                        dir: dir.clone(),
                    });
                    return Ok(w);
                }
                // Its worker may not seed from our workspace, or its egress differs:
                // wait for it to end.
                // Leave without `release`: this must not stop the worker.
                let keeper_pid = w.keeper_pid;
                drop(w.conn.take());
                notice(Notice::Waiting {
                    holder_pid: keeper_pid.to_string(),
                    dir: dir.clone(),
                });
                while UnixStream::connect(keeper::socket_path(&dir)).is_ok() {
                    std::thread::sleep(Duration::from_millis(500));
                }
                continue;
            }
            match spawn_keeper(cfg, &dir, notice)? {
                Spawned::Ready(mut keeper) => {
                    // Ours: attach to it (it listens before it says ready).
                    let t = Instant::now();
                    loop {
                        if let Some((mut w, _)) = attach(&dir) {
                            w.keeper = Some(keeper);
                            tracing::info!(endpoint = %w.endpoint, keeper_pid = w.keeper_pid, "local worker started");
                            return Ok(w);
                        }
                        if t.elapsed() > Duration::from_secs(10) {
                            let _ = keeper.kill();
                            let _ = keeper.wait();
                            return Err(not_started("its keeper does not answer".into()));
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
                // Another keeper holds the lease and is starting: attach to it.
                Spawned::Held => {}
                Spawned::Failed(reason) => return Err(not_started(reason)),
            }
            if Instant::now() > deadline {
                return Err(not_started("the running keeper does not answer".into()));
            }
            std::thread::sleep(delay);
            delay = (delay * 2).min(Duration::from_millis(500));
        }
    }
}

/// The keeper on `dir`, if one answers: the worker (with the open connection) and what
/// the keeper says of it (seed root, egress ceiling, inference upstream).
fn attach(dir: &Path) -> Option<(LocalWorker, Hello)> {
    let conn = UnixStream::connect(keeper::socket_path(dir)).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line).ok()?;
    let mut hello: Hello = serde_json::from_str(&line).ok()?;
    conn.set_read_timeout(None).ok()?;
    let w = LocalWorker {
        endpoint: std::mem::take(&mut hello.endpoint),
        token: std::mem::take(&mut hello.token),
        keeper_pid: hello.keeper_pid,
        conn: Some(conn),
        keeper: None,
        previous_relay: None,
    };
    Some((w, hello))
}

enum Spawned {
    Ready(Child),
    Held,
    Failed(String),
}

/// Starts a keeper for `dir` (in a session of its own, from a cleared environment) and
/// reads its start events.
fn spawn_keeper(
    cfg: &LocalWorkerConfig,
    dir: &Path,
    notice: &dyn Fn(Notice),
) -> Result<Spawned, LocalWorkerError> {
    use std::os::unix::process::CommandExt;
    let (cfg_path, token_file) = prepare(cfg, dir).map_err(|cause| LocalWorkerError::Prepare {
        dir: dir.to_path_buf(),
        cause,
    })?;
    let args = KeeperArgs {
        dir: dir.to_path_buf(),
        program: cfg.program.clone(),
        config: cfg_path.clone(),
        token_file: token_file.clone(),
        grace: cfg.grace,
        seed: cfg.seed.clone(),
        egress_allow: cfg.egress_allow.clone(),
        inference: inference_url(cfg),
        relay: cfg.inference.as_ref().is_some_and(|i| i.key_per_job),
    };
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("keeper.log"))
        .map_err(|cause| LocalWorkerError::Prepare {
            dir: dir.to_path_buf(),
            cause,
        })?;
    let mut cmd = Command::new(&cfg.keeper);
    cmd.arg(keeper::KEEPER_ARG)
        .args(args.to_args())
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log);
    for name in LOCAL_WORKER_ENV {
        if let Some(v) = std::env::var_os(name) {
            cmd.env(name, v);
        }
    }
    if let Some(e) = &cfg.otlp_endpoint {
        cmd.env("CYNODE_OTLP_ENDPOINT", e);
    }
    // SAFETY: setsid is async-signal-safe. The keeper leaves the PM's session so a
    // Ctrl-C at the PM's terminal does not reach it.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let remove_files = || {
        let _ = std::fs::remove_file(&cfg_path);
        let _ = std::fs::remove_file(&token_file);
    };
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(cause) => {
            remove_files();
            return Err(LocalWorkerError::Spawn {
                program: cfg.keeper.clone(),
                cause,
            });
        }
    };
    let Some(stdout) = child.stdout.take() else {
        return Ok(Spawned::Failed("no keeper output".into()));
    };
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        match serde_json::from_str::<KeeperEvent>(&line) {
            Ok(KeeperEvent::Ready { .. }) => return Ok(Spawned::Ready(child)),
            Ok(KeeperEvent::Waiting { holder_pid }) => {
                tracing::warn!(holder_pid = %holder_pid, state_dir = %dir.display(), "waiting for the running local worker");
                notice(Notice::Waiting {
                    holder_pid,
                    dir: dir.to_path_buf(),
                })
            }
            Ok(KeeperEvent::Held) => {
                let _ = child.wait();
                remove_files();
                return Ok(Spawned::Held);
            }
            Ok(KeeperEvent::Failed { reason }) => {
                let _ = child.wait();
                return Ok(Spawned::Failed(reason));
            }
            Err(_) => {}
        }
    }
    let _ = child.wait();
    remove_files();
    Ok(Spawned::Failed("its keeper ended".into()))
}

/// Creates `<state_dir>/worker` (mode 0755, as the state directory) and returns it,
/// canonical.
fn prepare_dir(cfg: &LocalWorkerConfig) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let dir = cfg.state_dir.join("worker");
    std::fs::create_dir_all(&dir)?;
    let dir = std::fs::canonicalize(&dir)?;
    for d in [cfg.state_dir.as_path(), dir.as_path()] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(dir)
}

/// Writes a new keeper's token and worker config into `dir`; returns the config's path
/// and the token file's path.
fn prepare(cfg: &LocalWorkerConfig, dir: &Path) -> std::io::Result<(PathBuf, PathBuf)> {
    use std::os::unix::fs::OpenOptionsExt;
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
    yaml.push_str(&egress_yaml(&cfg.egress_allow));
    yaml.push_str(&inference_yaml(cfg.inference.as_ref()));
    let cfg_path = dir.join(format!("worker-{tag}.yaml"));
    std::fs::write(&cfg_path, yaml)?;
    Ok((cfg_path, token_file))
}

/// The base URL of the local worker's inference upstream, if it has one.
fn inference_url(cfg: &LocalWorkerConfig) -> Option<String> {
    cfg.inference.as_ref().map(|i| i.base_url.clone())
}

/// The worker.yaml `inference` section: the model's base URL and its extra CA, each a
/// JSON string (a YAML double-quoted scalar, so no value can add a key), and, for the
/// run's inference relay, `key_per_job`; no key and no model list (the node offers
/// whatever model a job allows; the upstream is the run's).
fn inference_yaml(inference: Option<&LocalInference>) -> String {
    let Some(i) = inference else {
        return String::new();
    };
    let quote = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    let mut yaml = format!("inference:\n  base_url: {}\n", quote(&i.base_url));
    if i.key_per_job {
        yaml.push_str("  key_per_job: true\n");
    }
    if let Some(ca) = &i.ca_file {
        yaml.push_str(&format!(
            "  tls:\n    ca_file: {}\n",
            quote(&ca.to_string_lossy())
        ));
    }
    yaml
}

/// The worker.yaml `egress` section of the ceiling `allow`: each pattern a JSON string (a
/// YAML double-quoted scalar, so `*.suffix` is no alias and no pattern can add a key).
/// Nothing when `allow` is empty: the worker's default, no destination allowed.
fn egress_yaml(allow: &[String]) -> String {
    if allow.is_empty() {
        return String::new();
    }
    let list: Vec<String> = allow
        .iter()
        .map(|p| serde_json::Value::String(p.clone()).to_string())
        .collect();
    format!("egress:\n  allow: [{}]\n", list.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_egress_ceiling_is_written_quoted_and_only_when_given() {
        assert_eq!(egress_yaml(&[]), "");
        let allow = vec![
            "*.pythonhosted.org".to_string(),
            "127.0.0.1:8080".to_string(),
            "x\"]\nlisten: 0.0.0.0:1".to_string(),
        ];
        let yaml = format!("listen: 127.0.0.1:0\n{}", egress_yaml(&allow));
        let v: serde_yaml::Value = serde_yaml::from_str(&yaml).unwrap();
        assert_eq!(v["listen"], "127.0.0.1:0");
        let back: Vec<String> = serde_yaml::from_value(v["egress"]["allow"].clone()).unwrap();
        assert_eq!(back, allow);
    }

    #[test]
    fn the_inference_upstream_is_written_quoted_and_only_when_given() {
        assert_eq!(inference_yaml(None), "");
        let i = LocalInference {
            base_url: "http://127.0.0.1:8089/v1\"\nlisten: 0.0.0.0:1".into(),
            ca_file: Some("/etc/ca\n  api_key_env: HOME.pem".into()),
            key_per_job: false,
        };
        let yaml = format!("listen: 127.0.0.1:0\n{}", inference_yaml(Some(&i)));
        let v: serde_yaml::Value = serde_yaml::from_str(&yaml).unwrap();
        assert_eq!(v["listen"], "127.0.0.1:0");
        assert_eq!(v["inference"]["base_url"], i.base_url.as_str());
        assert_eq!(
            v["inference"]["tls"]["ca_file"],
            "/etc/ca\n  api_key_env: HOME.pem"
        );
        assert_eq!(v["inference"].as_mapping().unwrap().len(), 2, "{yaml}");
        // The run's relay: a key per job, and no key file at all.
        let i = LocalInference {
            key_per_job: true,
            ..i
        };
        let v: serde_yaml::Value = serde_yaml::from_str(&inference_yaml(Some(&i))).unwrap();
        assert_eq!(v["inference"]["key_per_job"], true);
        assert_eq!(v["inference"].as_mapping().unwrap().len(), 3);
    }
}
