//! Test harness: installs and builds what the tests need through the project's own
//! scripts (once per test binary), and runs the real `cynode-worker serve` on 127.0.0.1.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cynode_testkit::{output_bounded, output_within, OwnedChild};
use serde_json::{json, Value};

pub const TOKEN: &str = "test-token-0123456789abcdef";

/// What the environment setup produced.
pub struct Env {
    pub image: String,
    pub rootfs: PathBuf,
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn script(args: &[&str]) -> String {
    cynode_testkit::setup_script(&repo_root(), args)
}

/// Installs podman/runc/bubblewrap, builds the static runner and the offline test image,
/// and exports its root filesystem for bwrap. Runs once per test binary.
pub fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        script(&["deploy/install-deps.sh"]);
        let bin = script(&["deploy/sba/build-static.sh"]);
        script(&["deploy/sba/build-test-image.sh", &bin]);
        let image = "localhost/cynode-sba-test:latest".to_string();
        let rootfs = PathBuf::from(script(&["deploy/sba/export-rootfs.sh", &image]));
        Env { image, rootfs }
    })
}

/// The engine CLI of a test backend name: `podman` for podman and runsc (gVisor under
/// Podman), `docker` for docker, `None` for bwrap.
pub fn engine_cli(backend: &str) -> Option<&'static str> {
    match backend {
        "podman" | "runsc" | "podman_warm" | "runsc_warm" => Some("podman"),
        "docker" | "docker_warm" => Some("docker"),
        _ => None,
    }
}

/// The backend the node itself reports (readyz, capacity) for a test backend name: runsc
/// is Podman with gVisor's runtime.
pub fn node_backend(backend: &str) -> &str {
    match backend {
        "runsc" | "podman_warm" | "runsc_warm" => "podman",
        "docker_warm" => "docker",
        "bwrap_warm" => "bwrap",
        other => other,
    }
}

/// Whether `backend` can bind the egress proxy inside its sandboxes, as the worker's
/// backend registry answers for the configuration the harness gives that test backend
/// (gVisor and the microVM cannot: `restricted` is refused there with a 400).
pub fn gates_egress(backend: &str) -> bool {
    let mut cfg = cynode_worker::config::Config {
        backend: serde_json::from_value(json!(node_backend(backend)))
            .unwrap_or_else(|e| panic!("{backend} names no backend kind: {e}")),
        ..Default::default()
    };
    if backend.starts_with("runsc") {
        cfg.podman.runtime = cynode_worker::config::OciRuntime::Runsc;
    }
    cynode_worker::backend::can_gate(&cfg)
}

/// Whether the backend runs containers through an engine (not bwrap).
pub fn is_engine(backend: &str) -> bool {
    engine_cli(backend).is_some()
}

/// The worker config lines that select a test backend: `runsc` (Podman with gVisor's
/// runtime), `docker`, else the backend of that name. Docker gets its daemon started and
/// the test image loaded into it first (deploy/docker/start.sh, once per test binary).
fn backend_config(backend: &str, extra: &str) -> String {
    match backend {
        "runsc" => {
            // gVisor sessions' commands run through the pool waiter's seccomp filter:
            // built to the worker's default path.
            crate::warm_pool::waiter();
            if extra.lines().any(|l| l.starts_with("podman:")) {
                assert!(
                    extra.contains("\n  runtime: runsc\n"),
                    "a podman section for runsc keeps runtime: runsc"
                );
                "backend: podman\n".to_string()
            } else {
                "backend: podman\npodman:\n  runtime: runsc\n".to_string()
            }
        }
        "docker" => {
            docker_ready();
            "backend: docker\n".to_string()
        }
        // The engines with their warm pool on (`warm_pool.rs`).
        "podman_warm" | "docker_warm" | "runsc_warm" => {
            crate::warm_pool::backend_config(backend, extra)
        }
        // bwrap with warm sandboxes (`bwrap_warm.rs`): the bwrap section gets them.
        "bwrap_warm" => {
            crate::warm_pool::waiter();
            "backend: bwrap\n".to_string()
        }
        // Every other name is a `backend:` of its own (a name the worker does not know
        // fails its config).
        other => format!("backend: {other}\n"),
    }
}

/// Starts dockerd when none answers and loads the test image into it (once).
pub fn docker_ready() {
    static READY: OnceLock<()> = OnceLock::new();
    READY.get_or_init(|| {
        script(&["deploy/docker/start.sh", &env().image]);
        // Docker's gated (egress) jobs start in a pooled container, whose PID 1 is the
        // waiter: built to the worker's default path.
        crate::warm_pool::waiter();
    });
}

/// A unique id for jobs and tasks of this test process.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// A number unique to this call, usable as a long `sleep` argument that tags a process.
pub fn marker() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "99{:03}.{}",
        N.fetch_add(1, Ordering::SeqCst),
        std::process::id()
    )
}

/// The id of the node whose state directory is `state_dir`, as the node derives it.
pub fn node_id(state_dir: &Path) -> String {
    cynode_worker::backend::node_id(&cynode_worker::config::Config {
        state_dir: state_dir.to_path_buf(),
        ..Default::default()
    })
}

/// Where that node's sandbox cgroups are (the v1 pids hierarchy's and the v2 one's),
/// whether or not they exist.
pub fn node_cgroup_dirs(state_dir: &Path) -> Vec<PathBuf> {
    let node = node_id(state_dir);
    ["/sys/fs/cgroup/pids/cynode", "/sys/fs/cgroup/cynode"]
        .iter()
        .map(|p| Path::new(p).join(&node))
        .collect()
}

/// The processes listed in cgroup `dir` (none when it is gone).
pub fn cgroup_pids(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Waits (bounded by `within`, polling every 20 ms) until `f` holds; fails naming `what`.
pub async fn eventually(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let until = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < until, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A running worker.
pub struct Server {
    pub backend: &'static str,
    pub dir: tempfile::TempDir,
    pub addr: String,
    pub extra_config: String,
    /// The node's state directory: `<dir>/state`, or one the test prepared
    /// ([`Server::start_on_state`]).
    state: PathBuf,
    /// Variables the worker is started with (kept for restarts).
    env: Vec<(&'static str, &'static str)>,
    child: OwnedChild,
    pub log: Arc<Mutex<Vec<String>>>,
    pub client: reqwest::Client,
    /// Temp directories the test made for this server (its key files…), removed with it.
    pub owned: Vec<tempfile::TempDir>,
}

impl Server {
    /// Starts a worker with `backend` and extra YAML config lines.
    pub fn start(backend: &'static str, extra_config: &str) -> Server {
        Server::start_with_env(backend, extra_config, &[])
    }

    /// Starts a worker with these variables in its environment as well. With
    /// `WORKER_API_BEARER_TOKEN` among them, the config names no token file, so the node
    /// takes its token from the environment.
    pub fn start_with_env(
        backend: &'static str,
        extra_config: &str,
        env: &[(&'static str, &'static str)],
    ) -> Server {
        Server::start_in(backend, extra_config, env, None)
    }

    /// Starts a worker whose state directory is `state`, a directory the test prepared
    /// (on a filesystem of its own, say) and removes after the server.
    pub fn start_on_state(backend: &'static str, extra_config: &str, state: PathBuf) -> Server {
        Server::start_in(backend, extra_config, &[], Some(state))
    }

    fn start_in(
        backend: &'static str,
        extra_config: &str,
        env: &[(&'static str, &'static str)],
        state: Option<PathBuf>,
    ) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        // Sandboxes run as uid 1000 and must traverse to the state directory.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let state = state.unwrap_or_else(|| dir.path().join("state"));
        let (child, addr, log) = launch(backend, dir.path(), &state, extra_config, env);
        if backend == "bwrap_warm" {
            crate::bwrap_warm::wait_first_slot(&addr);
        }
        Server {
            backend,
            dir,
            addr,
            extra_config: extra_config.to_string(),
            state,
            env: env.to_vec(),
            child,
            log,
            // Every request bounded: a hung worker fails the test, not the runner.
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(200))
                .build()
                .expect("client"),
            owned: Vec::new(),
        }
    }

    /// SIGKILLs the worker (no graceful anything) and starts it again on the same state.
    pub fn kill9_and_restart(&mut self) {
        self.kill9();
        self.restart();
    }

    /// SIGKILLs the worker and waits (bounded) for it to exit; [`Server::restart`] starts
    /// it again.
    pub fn kill9(&mut self) {
        self.child.signal(libc::SIGKILL);
        assert!(
            self.child.wait_timeout(Duration::from_secs(30)).is_some(),
            "worker did not exit within 30 s of SIGKILL"
        );
    }

    /// SIGTERMs the worker, waits for it to exit (bounded), and starts it again.
    pub fn terminate_and_restart(&mut self) -> std::time::Duration {
        let took = self.terminate();
        self.restart();
        took
    }

    /// SIGTERMs the worker and waits for it to exit (bounded); how long it took. Call
    /// [`Server::restart`] before using the server again.
    pub fn terminate(&mut self) -> std::time::Duration {
        let t = Instant::now();
        self.child.signal(libc::SIGTERM);
        assert!(
            self.child.wait_timeout(Duration::from_secs(60)).is_some(),
            "worker did not exit within 60 s of SIGTERM"
        );
        t.elapsed()
    }

    /// Starts the worker again on the same state (after [`Server::terminate`] or
    /// [`Server::kill9`]).
    pub fn restart(&mut self) {
        let (child, addr, log) = self.relaunch();
        self.child = child;
        self.addr = addr;
        self.log = log;
    }

    fn relaunch(&self) -> (OwnedChild, String, Arc<Mutex<Vec<String>>>) {
        launch(
            self.backend,
            self.dir.path(),
            &self.state,
            &self.extra_config,
            &self.env,
        )
    }

    /// The worker's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .client
            .post(self.url(path))
            .bearer_auth(TOKEN)
            .json(body)
            .send()
            .await
            .expect("post");
        answer(r).await
    }

    /// `POST /v1/worker/jobs:run` of [`command_job`]`(id, task, argv)`: runs it to the end.
    pub async fn run_job(&self, id: &str, task: &str, argv: &[&str]) -> (u16, Value) {
        self.post("/v1/worker/jobs:run", &command_job(id, task, argv))
            .await
    }

    /// `POST /v1/worker/workspaces`: creates workspace `ws` seeded from `seed_from` (a
    /// path, or any JSON value a test sends there).
    pub async fn seed_workspace(&self, ws: &str, seed_from: impl serde::Serialize) -> (u16, Value) {
        let body = serde_json::json!({ "version": 1, "workspace_id": ws, "seed_from": seed_from });
        self.post("/v1/worker/workspaces", &body).await
    }

    /// `PUT /v1/worker/workspaces/{ws}/tar` with `body`.
    pub async fn put_tar(&self, ws: &str, body: Vec<u8>) -> (u16, Value) {
        let r = self
            .client
            .put(self.url(&format!("/v1/worker/workspaces/{ws}/tar")))
            .bearer_auth(TOKEN)
            .body(body)
            .send()
            .await
            .expect("put");
        answer(r).await
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        answer(self.get_raw(path).await).await
    }

    /// An authorised GET of `path` (bounded at 120 s), its response as it came.
    pub async fn get_raw(&self, path: &str) -> reqwest::Response {
        self.client
            .get(self.url(path))
            .bearer_auth(TOKEN)
            .timeout(Duration::from_secs(120))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    /// Polls an async job until `pred` holds on its status (bounded).
    pub async fn wait_for(
        &self,
        job_id: &str,
        limit: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let until = Instant::now() + limit;
        loop {
            let (_, v) = self.get(&format!("/v1/worker/jobs/{job_id}")).await;
            if pred(&v) {
                return v;
            }
            assert!(
                Instant::now() < until,
                "job {job_id} never reached the state; last: {v}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn wait_terminal(&self, job_id: &str) -> Value {
        self.wait_for(job_id, Duration::from_secs(120), |v| {
            matches!(
                v["status"].as_str(),
                Some("completed" | "failed" | "timeout" | "canceled")
            )
        })
        .await
    }

    pub fn state_dir(&self) -> PathBuf {
        self.state.clone()
    }
}

impl Drop for Server {
    /// The worker (and its process group) ends first. A worker killed this way leaves its
    /// running Podman containers behind (conmon outlives the `podman run` client; a
    /// restarted worker would reconcile them): they are removed here, by this node's
    /// label, before the state directory goes.
    fn drop(&mut self) {
        self.child.kill();
        // A failing test shows what its node logged.
        if std::thread::panicking() {
            let log = self.log.lock().map(|g| g.clone()).unwrap_or_default();
            eprintln!("harness: the node's log ({} lines):", log.len());
            for line in log.iter().rev().take(200).rev() {
                eprintln!("  {line}");
            }
        }
        // The node's janitor kills what its sandbox cgroups hold and removes them (a
        // setup bwrap was still doing when the node died included): waited for here, so
        // the test's processes are gone when it ends. Should it not come (`janitor.rs`
        // tests that it does), this kills them itself.
        let dirs = node_cgroup_dirs(&self.state_dir());
        let until = Instant::now() + Duration::from_secs(10);
        while dirs.iter().any(|d| d.exists()) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        for d in dirs.iter().filter(|d| d.exists()) {
            eprintln!(
                "harness: the janitor left {}; killing what it holds",
                d.display()
            );
            kill_cgroup_tree(d);
        }
        if let Some(cli) = engine_cli(self.backend) {
            remove_engine_containers(cli, &self.state_dir());
        }
        // The janitor unmounts the node's disk volumes (and any other mount it left
        // beneath its state directory) last: once it let go of the state directory's
        // lock, nothing of the node's may be left mounted. The harness unmounts nothing
        // itself; a leak fails the test.
        wait_janitor_done(&self.state_dir(), Duration::from_secs(75));
        let left =
            cynode_testkit::mounts::wait_nothing_left(self.dir.path(), Duration::from_secs(10))
                .and_then(|()| {
                    cynode_testkit::mounts::wait_nothing_left(&self.state, Duration::from_secs(10))
                });
        if let Err(left) = left {
            if !std::thread::panicking() {
                panic!(
                    "the killed node left these beneath its state directory: {left:#?}\nlog: {:?}",
                    self.log.lock().map(|g| g.clone()).unwrap_or_default()
                );
            }
        }
    }
}

/// Waits (at most `within`) until nothing holds the state directory's lock of the node at
/// `state`: the node and its janitor (which shares the lock) are done.
pub fn wait_janitor_done(state: &Path, within: Duration) {
    use std::os::fd::AsRawFd;
    let Ok(lock) = std::fs::File::open(state.join("worker.lock")) else {
        return;
    };
    let until = Instant::now() + within;
    // SAFETY: flock on a descriptor `lock` owns, alive for each call.
    while unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } != 0 {
        if Instant::now() >= until {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// SIGKILLs every process in the cgroups beneath `dir` (a node's sandboxes).
fn kill_cgroup_tree(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        for pid in cgroup_pids(&e.path()) {
            // SAFETY: kill(2) of a process in this test node's own sandbox cgroup.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Removes the containers (engine CLI `cli`: podman or docker) of the worker whose state
/// directory is `state` (by its node label), after that worker was killed. A container
/// the killed worker was still creating can appear a moment later, so this looks again
/// until two looks in a row, half a second apart, find none (at most ~10 s). Podman's
/// orphaned conmons are killed too; Docker has none (its daemon owns the containers).
pub fn remove_engine_containers(cli: &str, state: &Path) {
    remove_listed_containers(cli, state);
    if cli == "podman" {
        kill_orphan_conmons();
    }
}

/// Podman's monitors (`conmon`) of this test process's containers that outlived them, and
/// the container processes under them, are killed. A worker killed while its client was
/// creating a container leaves the creation to conmon; a `podman rm` that lands before the
/// container is recorded as created removes its record and leaves conmon running. The
/// names of this process's sandboxes carry its pid (see [`unique`]).
fn kill_orphan_conmons() {
    let pid = std::process::id();
    let mine = [
        format!("cynode-j-{pid}-"),
        format!("cynode-session-s-{pid}-"),
    ];
    for _ in 0..20 {
        let orphans: Vec<i32> = processes()
            .into_iter()
            .filter(|(_, _, cmd)| {
                let program = cmd.split_whitespace().next().unwrap_or("");
                (program == "conmon" || program.ends_with("/conmon"))
                    && mine.iter().any(|m| cmd.contains(m.as_str()))
            })
            .map(|(p, _, _)| p)
            .collect();
        if orphans.is_empty() {
            return;
        }
        let all = processes();
        for conmon in orphans {
            for (child, _, _) in all.iter().filter(|(_, ppid, _)| *ppid == conmon) {
                // SAFETY: kill(2) on a pid read from /proc just now.
                unsafe { libc::kill(*child, libc::SIGKILL) };
            }
            // SAFETY: as above.
            unsafe { libc::kill(conmon, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every process as (pid, parent pid, command line).
pub fn processes() -> Vec<(i32, i32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let ppid = stat
                .rsplit(')')
                .next()?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            let cmd = String::from_utf8_lossy(&std::fs::read(e.path().join("cmdline")).ok()?)
                .replace('\0', " ");
            Some((pid, ppid, cmd))
        })
        .collect()
}

/// The removal loop of [`remove_node_containers`].
fn remove_listed_containers(cli: &str, state: &Path) {
    let node = node_id(state);
    let mut empty_looks = 0;
    for _ in 0..20 {
        let mut ps = Command::new(cli);
        ps.args(["ps", "--all", "--quiet", "--filter"])
            .arg(format!("label=io.cynode.node={node}"));
        let out = output_bounded(ps, Duration::from_secs(60));
        let ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(str::to_string)
            .collect();
        // A look that failed (a storage lock held too long…) proves nothing.
        if !out.status.success() {
            empty_looks = 0;
        } else if ids.is_empty() {
            empty_looks += 1;
            if empty_looks == 2 {
                return;
            }
        } else {
            empty_looks = 0;
            let mut rm = Command::new(cli);
            rm.args(["rm", "--force"]).args(&ids);
            let _ = output_bounded(rm, Duration::from_secs(120));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// A response's status and its body as JSON (or as a string when it is not JSON).
pub async fn answer(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    let text = r.text().await.expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Removes an engine's container (engine CLI, name) when the test ends, also by a panic:
/// the harness SIGKILLs the node, which cannot remove it then.
pub struct RemoveOnDrop(Option<(&'static str, String)>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some((cli, name)) = &self.0 {
            // `rm --force` of an absent container fails, which is fine here.
            let mut rm = Command::new(cli);
            rm.args(["rm", "--force", name]);
            let _ = output_within(rm, Duration::from_secs(120));
        }
    }
}

/// The guard that removes session `session_id`'s container (engines only).
pub fn session_guard(backend: &str, session_id: &str) -> RemoveOnDrop {
    RemoveOnDrop(engine_cli(backend).map(|cli| (cli, format!("cynode-session-{session_id}"))))
}

fn launch(
    backend: &str,
    dir: &Path,
    state: &Path,
    extra: &str,
    vars: &[(&str, &str)],
) -> (OwnedChild, String, Arc<Mutex<Vec<String>>>) {
    let e = env();
    let token_in_env = vars.iter().any(|(k, _)| *k == "WORKER_API_BEARER_TOKEN");
    let token_line = if token_in_env {
        String::new()
    } else {
        let token = dir.join("token");
        std::fs::write(&token, TOKEN).expect("token");
        format!("token_file: {}\n", token.display())
    };
    let config = dir.join("worker.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\n{}state_dir: {}\n{token_line}bwrap:\n{}  rootfs:\n    \"{}\": {}\n{extra}\n",
            backend_config(backend, extra),
            state.display(),
            crate::bwrap_warm::bwrap_lines(backend),
            e.image,
            e.rootfs.display()
        ),
    )
    .expect("config");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cynode-worker"));
    // The node runs in its test's directory: whatever lands in its working directory is
    // seen there (and goes with it), never in the crate's source tree.
    cmd.args(["serve", "--config"])
        .arg(&config)
        .current_dir(dir)
        .env_remove("WORKER_API_BEARER_TOKEN")
        .envs(vars.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = OwnedChild::spawn(cmd);
    let stderr = child.child_mut().stderr.take().expect("stderr");
    let log = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let sink = Arc::clone(&log);
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if v["fields"]["message"] == "cynode-worker listening" {
                    if let Some(tx) = tx.take() {
                        let _ =
                            tx.send(v["fields"]["addr"].as_str().unwrap_or_default().to_string());
                    }
                }
            }
            if let Ok(mut g) = sink.lock() {
                g.push(line);
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| {
            panic!(
                "worker did not start; log: {:?}",
                log.lock().map(|g| g.clone()).unwrap_or_default()
            )
        });
    (child, addr, log)
}

/// A plain command job request.
/// Asserts that `v[field]` is a string starting with `prefix`, showing `v` when not.
/// The status code and the body of a raw HTTP/1.1 response (0 and "" when unreadable).
pub fn status_and_body(text: &str) -> (u16, &str) {
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text.split_once("\r\n\r\n").map_or("", |(_, b)| b))
}

pub fn assert_field_starts(v: &Value, field: &str, prefix: &str) {
    assert!(
        v[field].as_str().is_some_and(|s| s.starts_with(prefix)),
        "{field} does not start with {prefix:?}: {v}"
    );
}

pub fn command_job(job_id: &str, task_id: &str, command: &[&str]) -> Value {
    json!({
        "version": 1, "task_id": task_id, "job_id": job_id,
        "sandbox": { "image": env().image, "command": command }
    })
}

/// An SBA job request wrapping `steps`.
pub fn sba_job(job_id: &str, task_id: &str, steps: Value, artifacts: Value) -> Value {
    let spec = json!({
        "protocol_version": "1.0", "job_id": job_id, "task_id": task_id,
        "constraints": { "max_runtime_seconds": 60, "max_output_bytes": 65536 },
        "artifacts": artifacts,
        "steps": steps
    });
    json!({
        "version": 1, "task_id": task_id, "job_id": job_id,
        "sandbox": { "image": env().image, "job_spec_json": spec.to_string() }
    })
}

/// Containers of job `job_id` still known to the engine of `backend` (none for bwrap).
pub fn job_containers(backend: &str, job_id: &str) -> Vec<String> {
    engine_cli(backend).map_or_else(Vec::new, |cli| {
        engine_names(cli, &format!("label=cynodeai.job_id={job_id}"))
    })
}

/// Names of the containers the engine CLI `cli` knows that match `filter`.
pub fn engine_names(cli: &str, filter: &str) -> Vec<String> {
    let mut ps = Command::new(cli);
    ps.args(["ps", "--all", "--format", "{{.Names}}", "--filter", filter]);
    let out = output_bounded(ps, Duration::from_secs(60));
    assert!(
        out.status.success(),
        "{cli} ps failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// The full id of container `name` on the engine of `backend` (`None` for bwrap). Engine
/// helpers on the host (conmon, containerd's shim, gVisor's sandbox and gofer) name it in
/// their command lines, so [`process_with_arg`] of it finds what the container left.
pub fn container_id(backend: &str, name: &str) -> Option<String> {
    let cli = engine_cli(backend)?;
    let mut inspect = Command::new(cli);
    inspect.args(["inspect", "--format", "{{.Id}}", name]);
    let out = output_bounded(inspect, Duration::from_secs(60));
    assert!(
        out.status.success(),
        "{cli} inspect {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Whether any process has `needle` in its command line.
/// Processes inside gVisor sandboxes count too: they live in gVisor's kernel, not the
/// host's, so each running gVisor container is asked for its command lines.
pub fn process_with_arg(needle: &str) -> bool {
    processes().iter().any(|(_, _, cmd)| cmd.contains(needle))
        || gvisor_command_lines()
            .iter()
            .any(|cmd| cmd.contains(needle))
}

/// runsc's state directories: Podman's, and Docker's for its registered runsc.
const RUNSC_ROOTS: &[&str] = &["/var/run/runsc", "/var/run/docker/runtime-runc/moby"];

/// The command lines of every process in every running gVisor container on the host
/// (`runsc exec ID cat /proc/*/cmdline`, bounded), empty when there is none.
fn gvisor_command_lines() -> Vec<String> {
    let mut lines = Vec::new();
    for root in RUNSC_ROOTS {
        if !Path::new(root).is_dir() {
            continue;
        }
        let mut list = Command::new("runsc");
        list.arg(format!("--root={root}")).arg("list");
        let Ok(out) = output_within(list, Duration::from_secs(20)) else {
            continue;
        };
        let running: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .skip(1)
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.get(2) == Some(&"running")).then(|| f[0].to_string())
            })
            .collect();
        for id in running {
            let mut exec = Command::new("runsc");
            exec.arg(format!("--root={root}"))
                .args(["exec", &id, "/bin/sh", "-c"])
                .arg("for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done");
            if let Ok(out) = output_within(exec, Duration::from_secs(20)) {
                lines.extend(
                    String::from_utf8_lossy(&out.stdout)
                        .lines()
                        .map(str::to_string),
                );
            }
        }
    }
    lines
}

/// Mounts whose path mentions `needle`, but for the node's own disk volumes (ext4 on a
/// loop device, mounted on job directories and workspaces for as long as they exist).
pub fn mounts_with(needle: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle) && !l.contains(" - ext4 /dev/loop"))
        .map(str::to_string)
        .collect()
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// A worker config whose only seed root is `root`.
pub fn seed_config(root: &std::path::Path) -> String {
    format!("seed_roots:\n  - {}\n", root.display())
}

/// A pure-Python wheel of `package` 0.1 whose `__init__` sets `VALUE = value`, written
/// with the host's python3 and its standard zipfile module (RECORD hashes included, as pip
/// checks them). Its file name is `<package>-0.1-py3-none-any.whl`.
pub fn wheel(package: &str, value: &str) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{package}-0.1-py3-none-any.whl"));
    let script = r#"
import base64, hashlib, sys, zipfile
pkg, value = sys.argv[2], sys.argv[3]
info = f"{pkg}-0.1.dist-info"
files = {
    f"{pkg}/__init__.py": f"VALUE = {value!r}\n".encode(),
    f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {pkg}\nVersion: 0.1\n".encode(),
    f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: cynode-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = ""
for name, data in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record += f"{name},sha256={digest},{len(data)}\n"
record += f"{info}/RECORD,,\n"
with zipfile.ZipFile(sys.argv[1], "w") as z:
    for name, data in files.items():
        z.writestr(name, data)
    z.writestr(f"{info}/RECORD", record)
"#;
    let mut cmd = Command::new("python3");
    cmd.args(["-c", script]).arg(&path).args([package, value]);
    let out = output_bounded(cmd, Duration::from_secs(30));
    assert!(out.status.success(), "{out:?}");
    std::fs::read(&path).unwrap()
}
