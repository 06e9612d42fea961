//! The keeper of a local worker: a small process (`cynode-pm` run as
//! [`KEEPER_ARG`]) that starts `cynode-worker serve`, holds the state directory's lease
//! and hands the worker to every `cynode-pm` that attaches, so a job outlives the PM that
//! dispatched it.
//!
//! The lease is a `flock` on `<state>/worker/keeper.lock` held for the keeper's life,
//! with `<state>/worker/keeper.json` (the keeper's and the worker's pids, the endpoint)
//! beside it. PMs attach through the Unix socket `<state>/worker/keeper.sock` (mode
//! 0600): the keeper answers with one JSON line (endpoint and token), and the PM keeps the
//! connection open while it uses the worker. A PM that ends cleanly writes `release`
//! first. When the last PM is gone:
//! - after a clean release, the keeper stops the worker at once;
//! - after a PM vanished (kill -9, Ctrl-C, a crash), it keeps the worker for the grace
//!   period, so the running job finishes and its result is kept; a PM attaching in that
//!   time (`sessions resume`) gets the worker and the result. When the grace period ends
//!   with nobody attached, the worker is stopped (SIGTERM, then SIGKILL) and the keeper
//!   exits: nothing outlives it.
//!
//! The keeper runs in a session of its own (`setsid`), so a Ctrl-C at the PM's terminal
//! does not reach it, and the worker dies with it (`PR_SET_PDEATHSIG`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The first argument that makes `cynode-pm` a keeper (not a command of its own: the
/// PM starts it).
pub const KEEPER_ARG: &str = "__local-worker-keeper";

/// The keeper's socket, lock and lease file in `<state>/worker`.
pub fn socket_path(dir: &Path) -> PathBuf {
    dir.join("keeper.sock")
}
fn lock_path(dir: &Path) -> PathBuf {
    dir.join("keeper.lock")
}
/// The lease record: `{ "keeper_pid", "worker_pid", "endpoint" }`.
pub fn lease_path(dir: &Path) -> PathBuf {
    dir.join("keeper.json")
}

/// What the keeper prints on stdout while it starts (one JSON object a line).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum KeeperEvent {
    /// Another process holds the worker's state lock; the worker waits for it.
    Waiting { holder_pid: String },
    /// The worker listens; PMs may attach.
    Ready { endpoint: String },
    /// Another keeper holds the lease: attach to it instead.
    Held,
    /// The worker did not start.
    Failed { reason: String },
}

/// What an attaching PM reads first on the socket.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Hello {
    pub endpoint: String,
    pub token: String,
    pub keeper_pid: u32,
    /// The directory the worker's workspaces may be seeded from.
    #[serde(default)]
    pub seed: Option<PathBuf>,
    /// The worker's `egress.allow` ceiling.
    #[serde(default)]
    pub egress_allow: Vec<String>,
    /// The worker's inference upstream (its base URL), if it has one.
    #[serde(default)]
    pub inference: Option<String>,
    /// That upstream is a PM's inference relay (`key_per_job`): a PM that attaches after
    /// that PM died serves its relay where the worker calls it.
    #[serde(default)]
    pub relay: bool,
}

/// The keeper's settings, from its command line.
#[derive(Debug, Clone)]
pub struct KeeperArgs {
    pub dir: PathBuf,
    pub program: PathBuf,
    pub config: PathBuf,
    pub token_file: PathBuf,
    pub grace: Duration,
    /// The worker's seed root (as its config says), told to attaching PMs.
    pub seed: Option<PathBuf>,
    /// The worker's `egress.allow` ceiling (as its config says), told to attaching PMs.
    pub egress_allow: Vec<String>,
    /// The worker's inference upstream (as its config says), told to attaching PMs.
    pub inference: Option<String>,
    /// That upstream is its PM's inference relay (`key_per_job`), told to attaching PMs.
    pub relay: bool,
}

impl KeeperArgs {
    /// The command line a PM starts the keeper with (after [`KEEPER_ARG`]).
    pub fn to_args(&self) -> Vec<std::ffi::OsString> {
        vec![
            "--dir".into(),
            self.dir.clone().into(),
            "--program".into(),
            self.program.clone().into(),
            "--config".into(),
            self.config.clone().into(),
            "--token-file".into(),
            self.token_file.clone().into(),
            "--grace-seconds".into(),
            self.grace.as_secs().to_string().into(),
        ]
        .into_iter()
        .chain(
            self.seed
                .iter()
                .flat_map(|s| ["--seed".into(), s.clone().into_os_string()]),
        )
        .chain(
            self.egress_allow
                .iter()
                .flat_map(|p| ["--egress-allow".into(), p.into()]),
        )
        .chain(
            self.inference
                .iter()
                .flat_map(|u| ["--inference".into(), u.into()]),
        )
        .chain(
            self.relay
                .then(|| ["--relay".into(), "true".into()])
                .into_iter()
                .flatten(),
        )
        .collect()
    }

    fn parse(args: &[std::ffi::OsString]) -> Option<KeeperArgs> {
        let mut it = args.iter();
        let (mut dir, mut program, mut config, mut token_file, mut grace, mut seed) =
            (None, None, None, None, None, None);
        let mut egress_allow = Vec::new();
        let mut inference = None;
        let mut relay = false;
        while let Some(k) = it.next() {
            let v = it.next()?;
            match k.to_str()? {
                "--dir" => dir = Some(PathBuf::from(v)),
                "--program" => program = Some(PathBuf::from(v)),
                "--config" => config = Some(PathBuf::from(v)),
                "--token-file" => token_file = Some(PathBuf::from(v)),
                "--grace-seconds" => grace = v.to_str()?.parse::<u64>().ok(),
                "--seed" => seed = Some(PathBuf::from(v)),
                "--egress-allow" => egress_allow.push(v.to_str()?.to_string()),
                "--inference" => inference = Some(v.to_str()?.to_string()),
                "--relay" => relay = v.to_str()? == "true",
                _ => return None,
            }
        }
        Some(KeeperArgs {
            dir: dir?,
            program: program?,
            config: config?,
            token_file: token_file?,
            grace: Duration::from_secs(grace?),
            seed,
            egress_allow,
            inference,
            relay,
        })
    }
}

/// Runs the keeper when this process was started as one (`argv[1] == KEEPER_ARG`);
/// returns its exit code, or None for any other command line.
pub fn main_if_keeper() -> Option<i32> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args.get(1).and_then(|a| a.to_str()) != Some(KEEPER_ARG) {
        return None;
    }
    let Some(k) = KeeperArgs::parse(&args[2..]) else {
        eprintln!("cynode-pm {KEEPER_ARG}: bad arguments (started by cynode-pm run only)");
        return Some(2);
    };
    Some(run(&k))
}

fn say(event: &KeeperEvent) {
    let mut out = std::io::stdout().lock();
    let _ = serde_json::to_writer(&mut out, event);
    let _ = out.write_all(b"\n");
    let _ = out.flush();
}

/// What the keeper's loop hears.
enum Event {
    /// A PM attached.
    Attached,
    /// A PM left: cleanly (`release`, answered on `done` once handled: true when the
    /// worker was stopped) or not.
    Left {
        clean: bool,
        done: Option<mpsc::Sender<bool>>,
    },
    /// The worker's log said something while it starts.
    Log(StartEvent),
}

fn run(k: &KeeperArgs) -> i32 {
    // The lease: one keeper per state directory.
    let lock = match std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(lock_path(&k.dir))
    {
        Ok(f) => f,
        Err(e) => {
            say(&KeeperEvent::Failed {
                reason: format!("cannot open the lease: {e}"),
            });
            return 1;
        }
    };
    if let Err(e) = rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        if e == rustix::io::Errno::WOULDBLOCK {
            say(&KeeperEvent::Held);
            return 0;
        }
        say(&KeeperEvent::Failed {
            reason: format!("cannot take the lease: {e}"),
        });
        return 1;
    }
    let files = [k.token_file.clone(), k.config.clone()];
    let code = serve(k);
    for f in files
        .iter()
        .chain([socket_path(&k.dir), lease_path(&k.dir)].iter())
    {
        let _ = std::fs::remove_file(f);
    }
    drop(lock);
    code
}

fn serve(k: &KeeperArgs) -> i32 {
    let token = match std::fs::read_to_string(&k.token_file) {
        Ok(t) => t.trim().to_string(),
        Err(e) => {
            say(&KeeperEvent::Failed {
                reason: format!("cannot read {}: {e}", k.token_file.display()),
            });
            return 1;
        }
    };
    let sock = socket_path(&k.dir);
    let listener = match listen(&sock) {
        Ok(l) => l,
        Err(e) => {
            say(&KeeperEvent::Failed {
                reason: format!("cannot listen on {}: {e}", sock.display()),
            });
            return 1;
        }
    };
    let mut child = match spawn_worker(k) {
        Ok(c) => c,
        Err(e) => {
            say(&KeeperEvent::Failed {
                reason: format!("cannot start {}: {e}", k.program.display()),
            });
            return 1;
        }
    };
    let (tx, rx) = mpsc::channel::<Event>();
    if let Some(stderr) = child.stderr.take() {
        watch_log(stderr, k.dir.join("worker.log"), tx.clone());
    }
    // Until the worker listens: relay its start to the PM that started us.
    let endpoint = loop {
        match rx.recv_timeout(Duration::from_millis(250)) {
            Ok(Event::Log(StartEvent::Listening(addr))) => break format!("http://{addr}"),
            Ok(Event::Log(StartEvent::Waiting(holder))) => {
                say(&KeeperEvent::Waiting { holder_pid: holder })
            }
            Ok(_) => {}
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if !matches!(child.try_wait(), Ok(None)) {
                    say(&KeeperEvent::Failed {
                        reason: "the worker exited before it listened".into(),
                    });
                    return 1;
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                stop(&mut child);
                return 1;
            }
        }
    };
    let lease = serde_json::json!({
        "keeper_pid": std::process::id(),
        "worker_pid": child.id(),
        "endpoint": endpoint,
    });
    let _ = std::fs::write(lease_path(&k.dir), lease.to_string());
    let hello = serde_json::to_string(&Hello {
        endpoint: endpoint.clone(),
        token,
        keeper_pid: std::process::id(),
        seed: k.seed.clone(),
        egress_allow: k.egress_allow.clone(),
        inference: k.inference.clone(),
        relay: k.relay,
    })
    .unwrap_or_default();
    accept_in_background(listener, hello, tx);
    say(&KeeperEvent::Ready { endpoint });
    tracing::info!(worker_pid = child.id(), "local worker kept");
    supervise(k, &mut child, &rx)
}

/// Counts attached PMs and decides when the worker stops; returns the exit code.
fn supervise(k: &KeeperArgs, child: &mut Child, rx: &mpsc::Receiver<Event>) -> i32 {
    let mut attached = 0usize;
    // Nobody attached yet: the PM that started us attaches next; give it the grace.
    let mut deadline = Some(Instant::now() + k.grace);
    loop {
        match rx.recv_timeout(Duration::from_millis(500)) {
            Ok(Event::Attached) => {
                attached += 1;
                deadline = None;
            }
            Ok(Event::Left { clean, done }) => {
                attached = attached.saturating_sub(1);
                if attached == 0 {
                    if clean {
                        stop(child);
                        if let Some(d) = done {
                            let _ = d.send(true);
                        }
                        return 0;
                    }
                    eprintln!(
                        "cynode-pm keeper: its PM vanished; the worker is kept for {} s",
                        k.grace.as_secs()
                    );
                    deadline = Some(Instant::now() + k.grace);
                }
                if let Some(d) = done {
                    let _ = d.send(false);
                }
            }
            Ok(Event::Log(_)) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {}
        }
        if !matches!(child.try_wait(), Ok(None)) {
            eprintln!("cynode-pm keeper: the worker exited");
            return 1;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            eprintln!("cynode-pm keeper: grace period over, nobody attached; stopping the worker");
            stop(child);
            return 0;
        }
    }
}

fn accept_in_background(listener: UnixListener, hello: String, tx: mpsc::Sender<Event>) {
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            if writeln!(conn, "{hello}").is_err() {
                continue;
            }
            if tx.send(Event::Attached).is_err() {
                return;
            }
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut clean = false;
                let mut reader = BufReader::new(&conn);
                let mut line = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
                    if line.trim() == "release" {
                        clean = true;
                        break;
                    }
                    line.clear();
                }
                let (done_tx, done_rx) = mpsc::channel();
                let done = clean.then_some(done_tx);
                if tx.send(Event::Left { clean, done }).is_ok() && clean {
                    // Answered once the worker stopped, or was kept for other PMs.
                    let answer = match done_rx.recv_timeout(Duration::from_secs(30)) {
                        Ok(true) => "stopped",
                        _ => "kept",
                    };
                    let _ = writeln!(&conn, "{answer}");
                }
                let _ = conn.shutdown(std::net::Shutdown::Both);
            });
        }
    });
}

/// Binds the socket under a temporary name, makes it 0600 (only this user may connect)
/// and only then moves it to `sock`, so it is never reachable with a wider mode.
fn listen(sock: &Path) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let tmp = sock.with_extension(format!("sock.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let l = UnixListener::bind(&tmp)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
    std::fs::rename(&tmp, sock)?;
    Ok(l)
}

fn spawn_worker(k: &KeeperArgs) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(&k.program);
    cmd.args(["serve", "--config"])
        .arg(&k.config)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let parent = std::process::id();
    // SAFETY: between fork and exec only async-signal-safe calls: prctl and getppid. The
    // keeper is single-purpose: the thread that forks (its main thread) lives as long as
    // the keeper, so the parent-death signal fires only when the keeper is gone.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::other("the keeper is gone"));
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// SIGTERM, up to 20 s to finish, then SIGKILL; reaped.
fn stop(child: &mut Child) {
    // SAFETY: a signal to our own child, not yet reaped.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let t = Instant::now();
    while matches!(child.try_wait(), Ok(None)) {
        if t.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.wait();
}

/// What the worker's log says while it starts.
enum StartEvent {
    Waiting(String),
    Listening(String),
}

/// Copies the worker's log lines to `log_path` and reports when it waits for the state
/// directory's lock and when it listens.
fn watch_log(stderr: std::process::ChildStderr, log_path: PathBuf, tx: mpsc::Sender<Event>) {
    std::thread::spawn(move || {
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .ok();
        let mut listening = false;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(l) = log.as_mut() {
                let _ = writeln!(l, "{line}");
            }
            if listening {
                continue;
            }
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                let message = &v["fields"]["message"];
                if *message == "cynode-worker listening" {
                    let addr = v["fields"]["addr"].as_str().unwrap_or_default().to_string();
                    let _ = tx.send(Event::Log(StartEvent::Listening(addr)));
                    listening = true;
                } else if *message == LOCK_WAIT_MESSAGE {
                    let holder = v["fields"]["holder_pid"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    let _ = tx.send(Event::Log(StartEvent::Waiting(holder)));
                }
            }
        }
    });
}

/// Log message of a worker waiting for its state-directory lock
/// (`LOCK_WAIT_MESSAGE` in cynode-worker's `src/cli.rs`; the PM does not link the worker).
const LOCK_WAIT_MESSAGE: &str = "waiting for the state directory lock";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_round_trips() {
        let k = KeeperArgs {
            dir: "/s/worker".into(),
            program: "/bin/cynode-worker".into(),
            config: "/s/worker/w.yaml".into(),
            token_file: "/s/worker/t".into(),
            grace: Duration::from_secs(600),
            seed: Some("/src/tree".into()),
            egress_allow: vec!["127.0.0.1:8080".into(), "*.pythonhosted.org".into()],
            inference: Some("http://127.0.0.1:8089/v1".into()),
            relay: true,
        };
        let back = KeeperArgs::parse(&k.to_args()).unwrap();
        assert_eq!(back.grace, k.grace);
        assert_eq!(back.token_file, k.token_file);
        assert_eq!(back.seed, k.seed);
        assert_eq!(back.egress_allow, k.egress_allow);
        assert_eq!(back.inference, k.inference);
        assert!(back.relay);
        assert!(
            !KeeperArgs::parse(&KeeperArgs { relay: false, ..k }.to_args())
                .unwrap()
                .relay
        );
        assert!(KeeperArgs::parse(&["--dir".into()]).is_none());
    }
}
