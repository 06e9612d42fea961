//! Load test: 1, 2 and 3 `cynode-pm serve` replicas on one PostgreSQL and one or more
//! bwrap workers of a worker registry.
//!
//! ```text
//! # once: the tools, the static runner and the sandbox image (what tests/tests/e2e.rs does)
//! bash deploy/install-deps.sh
//! bash deploy/sba/build-test-image.sh "$(bash deploy/sba/build-static.sh)"
//! # the real binaries the test spawns, then the test itself
//! export CARGO_TARGET_DIR=/var/cache/cynode/target-load
//! cargo build --release -p cynode-pm -p cynode-worker
//! cargo bench -p cynode-pm --bench replicas
//! # options (defaults shown):
//! cargo bench -p cynode-pm --bench replicas -- --sessions 200 --replicas 1,2,3 \
//!     --modes nojob,job --max-running 2 --max-active 64 --post-concurrency 16 \
//!     --deadline 300 --workers 1 [--pm-bin PATH (another cynode-pm build, to compare)]
//! ```
//!
//! What one run is: a fresh PostgreSQL database (on the cluster `deploy/postgres/start.sh`
//! starts), `--workers` `cynode-worker`s (bwrap backend, the rootfs of
//! `localhost/cynode-sba-test:latest`, queue `max_running` 2 for 2 cores, `max_queued`
//! 4096) listed in a workers file (capacity 64 each, so placement spreads by their live
//! load), N `cynode-pm serve` processes from `$CARGO_TARGET_DIR/release`, and a scripted
//! OpenAI-compatible model in this process that answers instantly by looking at the
//! conversation (the idea of `benches/loop.rs`):
//! - mode `job`: `plan_update` → `job_request` (write-files, one file) → `final`;
//! - mode `nojob`: `plan_update` → `final`, to measure the PM and database side alone.
//!
//! After a warm-up of 2 sessions per replica, `--sessions` sessions are created at once
//! (`--post-concurrency` POSTs in flight, spread round robin over the replicas' HTTP
//! endpoints). The client does not watch each session while the run is on: 200 open
//! event streams would read the database 1,000 times a second and the test would measure
//! its own watcher. It polls the terminal count on `/metrics` every 250 ms, and after the
//! run reads each session's event stream once (`GET /v1/sessions/{id}/events`, which ends
//! at the terminal event). Time to final = the `final` event's server time stamp minus
//! the moment the client sent the POST (same host, same clock).
//!
//! Printed per run: sessions/s (sessions over first POST → last final), p50/p95 time to
//! final, p50/p95 of the claim delay (`created` → first `model_reply`: waiting for a
//! replica's slot and the model's first answer), failures, duplicates (model calls or jobs
//! beyond what the script needs for a session: the journal promises none), and the CPU
//! each process used over the run (replicas, worker with its sandboxes, PostgreSQL, this
//! process, the rest of the machine) with the load average, and how many jobs each
//! worker ran. JSON goes to
//! `/var/cache/cynode/bench/replicas-<unix time>.json`.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

const WORKER_TOKEN: &str = "load-test-worker-token-0123456789";
const API_TOKEN: &str = "load-test-api-token-0123456789";
const IMAGE: &str = "localhost/cynode-sba-test:latest";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// Milliseconds since the epoch of the service's `YYYY-MM-DDTHH:MM:SS.mmmZ` time stamps.
fn parse_at(s: &str) -> Option<f64> {
    let t = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()?;
    Some(t.unix_timestamp_nanos() as f64 / 1e6)
}

fn run_script(args: &[&str]) -> Result<String, String> {
    let out = Command::new("bash")
        .args(args)
        .current_dir(repo())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("{args:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{args:?} failed"));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

// ---------------------------------------------------------------------------------------
// The scripted model.

/// Counts the calls per session (the `[lt …]` marker in the objective).
#[derive(Clone, Default)]
struct Model {
    calls: Arc<Mutex<HashMap<String, u32>>>,
}

fn marker(text: &str) -> Option<String> {
    let start = text.find("[lt ")?;
    let end = text[start..].find(']')?;
    Some(text[start..start + end + 1].to_string())
}

async fn completions(State(m): State<Model>, Json(body): Json<Value>) -> Json<Value> {
    let text = common::data_text(&body);
    if let Some(k) = marker(&text) {
        if let Ok(mut c) = m.calls.lock() {
            *c.entry(k).or_default() += 1;
        }
    }
    let content = common::scripted_reply(&text, !text.contains("mode=nojob"));
    Json(common::completion(&content))
}

// ---------------------------------------------------------------------------------------
// Processes.

/// A child process killed on drop.
struct Proc {
    child: Child,
}

impl Proc {
    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn bin_dir() -> PathBuf {
    // target/release/deps/replicas-HASH → target/release
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("current_exe: {e}"));
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| panic!("no target dir above {}", exe.display()));
    for b in ["cynode-pm", "cynode-worker"] {
        assert!(
            dir.join(b).is_file(),
            "{} is missing: run `cargo build --release -p cynode-pm -p cynode-worker` with the same CARGO_TARGET_DIR",
            dir.join(b).display()
        );
    }
    dir
}

fn start_worker(dir: &Path, bins: &Path, rootfs: &str, max_running: usize) -> (Proc, String) {
    use std::io::BufRead;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("chmod: {e}"));
    std::fs::write(dir.join("token"), WORKER_TOKEN).unwrap_or_else(|e| panic!("token: {e}"));
    let cfg = format!(
        "listen: 127.0.0.1:0\nbackend: bwrap\nstate_dir: {}\ntoken_file: {}\nbwrap:\n  rootfs:\n    \"{IMAGE}\": {rootfs}\nqueue:\n  max_running: {max_running}\n  max_queued: 4096\n",
        dir.join("state").display(),
        dir.join("token").display(),
    );
    std::fs::write(dir.join("w.yaml"), cfg).unwrap_or_else(|e| panic!("w.yaml: {e}"));
    let mut child = Command::new(bins.join("cynode-worker"))
        .args(["serve", "--config"])
        .arg(dir.join("w.yaml"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cynode-worker: {e}"));
    let stderr = child
        .stderr
        .take()
        .unwrap_or_else(|| panic!("worker stderr"));
    let (tx, rx) = std::sync::mpsc::channel();
    let mut log =
        std::fs::File::create(dir.join("worker.log")).unwrap_or_else(|e| panic!("worker.log: {e}"));
    std::thread::spawn(move || {
        use std::io::Write;
        let mut tx = Some(tx);
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = writeln!(log, "{line}");
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if v["fields"]["message"] == "cynode-worker listening" {
                    if let (Some(t), Some(a)) = (tx.take(), v["fields"]["addr"].as_str()) {
                        let _ = t.send(a.to_string());
                    }
                }
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("the worker did not start: {e}"));
    (Proc { child }, format!("http://{addr}"))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("free port: {e}"))
}

struct ReplicaCfg<'a> {
    dir: &'a Path,
    bins: &'a Path,
    db: &'a str,
    model: &'a str,
    workers_file: &'a Path,
    max_active: usize,
}

fn start_replica(c: &ReplicaCfg, name: &str) -> (Proc, String) {
    let port = free_port();
    let log = std::fs::File::create(c.dir.join(format!("{name}.log")))
        .unwrap_or_else(|e| panic!("log: {e}"));
    let pm = common::arg("--pm-bin").map_or_else(|| c.bins.join("cynode-pm"), PathBuf::from);
    let child = Command::new(pm)
        .arg("serve")
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--api-tokens-file")
        .arg(c.dir.join("tokens"))
        .args(["--replica-id", name, "--datastore-endpoint", c.db])
        .arg("--workers-file")
        .arg(c.workers_file)
        .args(["--model-base-url", c.model, "--model-name", "bench"])
        .args(["--max-active-sessions", &c.max_active.to_string()])
        .arg("--state-dir")
        .arg(c.dir.join(name))
        .current_dir(repo())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cynode-pm: {e}"));
    let p = Proc { child };
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "replica {name} did not start: {}",
            std::fs::read_to_string(c.dir.join(format!("{name}.log"))).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (p, format!("http://127.0.0.1:{port}"))
}

// ---------------------------------------------------------------------------------------
// CPU accounting from /proc.

fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// (comm, utime + stime, cutime + cstime) of a process, in clock ticks.
fn proc_ticks(pid: u32) -> Option<(String, u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let open = s.find('(')?;
    let close = s.rfind(')')?;
    let comm = s[open + 1..close].to_string();
    let f: Vec<&str> = s[close + 2..].split(' ').collect();
    // Fields 14..17 of stat(5); f[0] is field 3.
    let n = |i: usize| {
        f.get(i - 3)
            .and_then(|x| x.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Some((comm, n(14) + n(15), n(16) + n(17)))
}

/// Busy and total ticks of the whole machine.
fn machine_ticks() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = s
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

fn postgres_ticks() -> HashMap<u32, u64> {
    let mut m = HashMap::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if let Some((comm, own, _)) = proc_ticks(pid) {
            if comm.starts_with("postgres") {
                m.insert(pid, own);
            }
        }
    }
    m
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

struct CpuSnap {
    at: Instant,
    machine: (u64, u64),
    replicas: Vec<u64>,
    worker: u64,
    postgres: HashMap<u32, u64>,
    this: u64,
}

fn snap(replicas: &[u32], workers: &[u32]) -> CpuSnap {
    let own = |pid: u32| proc_ticks(pid).map(|(_, o, c)| o + c).unwrap_or(0);
    CpuSnap {
        at: Instant::now(),
        machine: machine_ticks(),
        replicas: replicas.iter().map(|p| own(*p)).collect(),
        worker: workers.iter().map(|p| own(*p)).sum(),
        postgres: postgres_ticks(),
        this: own(std::process::id()),
    }
}

/// Cores used over the interval: per replica, worker (with its sandboxes), postgres, this
/// process (model + client), the rest of the machine, and the machine's busy share.
fn cpu_between(a: &CpuSnap, b: &CpuSnap) -> Value {
    let secs = b.at.duration_since(a.at).as_secs_f64().max(1e-9);
    let tck = clk_tck();
    let cores = |t: u64| (t as f64 / tck / secs * 100.0).round() / 100.0;
    let replicas: Vec<f64> = a
        .replicas
        .iter()
        .zip(&b.replicas)
        .map(|(x, y)| cores(y.saturating_sub(*x)))
        .collect();
    let pg: u64 = b
        .postgres
        .iter()
        .map(|(pid, t)| t.saturating_sub(a.postgres.get(pid).copied().unwrap_or(0)))
        .sum();
    let (busy, total) = (
        b.machine.0.saturating_sub(a.machine.0),
        b.machine.1.saturating_sub(a.machine.1).max(1),
    );
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let machine = busy as f64 / total as f64 * ncpu;
    let worker = cores(b.worker.saturating_sub(a.worker));
    let postgres = cores(pg);
    let this = cores(b.this.saturating_sub(a.this));
    let known: f64 = replicas.iter().sum::<f64>() + worker + postgres + this;
    json!({
        "replicas": replicas, "replicas_total": (replicas.iter().sum::<f64>() * 100.0).round() / 100.0,
        "worker_and_sandboxes": worker, "postgres": postgres, "bench_process": this,
        "other": ((machine - known).max(0.0) * 100.0).round() / 100.0,
        "machine_busy_cores": (machine * 100.0).round() / 100.0, "cores": ncpu,
    })
}

// ---------------------------------------------------------------------------------------
// The client.

/// Creates sessions `objectives` spread round robin over `bases`; returns per session
/// `Ok((id, sent_at_ms))` or the error.
async fn submit(
    http: &reqwest::Client,
    bases: &[String],
    objectives: Vec<String>,
    concurrency: usize,
) -> Vec<Result<(String, f64), String>> {
    let sem = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
    let mut handles = Vec::new();
    for (i, objective) in objectives.into_iter().enumerate() {
        let base = bases[i % bases.len()].clone();
        let http = http.clone();
        let sem = Arc::clone(&sem);
        handles.push(tokio::spawn(async move {
            let _p = sem.acquire_owned().await.map_err(|e| e.to_string())?;
            let sent = now_ms();
            let r = http
                .post(format!("{base}/v1/sessions"))
                .bearer_auth(API_TOKEN)
                .json(&json!({ "objective": objective }))
                .send()
                .await
                .map_err(|e| format!("POST: {e}"))?;
            let status = r.status().as_u16();
            let v: Value = r.json().await.map_err(|e| format!("POST body: {e}"))?;
            if status != 201 {
                return Err(format!("POST answered {status}: {v}"));
            }
            let id = v["session_id"]
                .as_str()
                .ok_or_else(|| format!("no session_id in {v}"))?;
            Ok((id.to_string(), sent))
        }));
    }
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap_or_else(|e| Err(e.to_string())));
    }
    out
}

/// Waits until `want` sessions are terminal (completed, failed or canceled) on `base`.
async fn wait_terminal(
    http: &reqwest::Client,
    base: &str,
    want: u64,
    within: Duration,
) -> Result<(), String> {
    let t = Instant::now();
    loop {
        let text = http
            .get(format!("{base}/metrics"))
            .send()
            .await
            .map_err(|e| e.to_string())?
            .text()
            .await
            .map_err(|e| e.to_string())?;
        let done: u64 = text
            .lines()
            .filter(|l| {
                ["completed", "failed", "canceled"]
                    .iter()
                    .any(|s| l.starts_with(&format!("cynode_pm_sessions{{status=\"{s}\"}}")))
            })
            .filter_map(|l| l.rsplit(' ').next().and_then(|n| n.parse::<u64>().ok()))
            .sum();
        if done >= want {
            return Ok(());
        }
        if t.elapsed() > within {
            return Err(format!(
                "only {done} of {want} sessions terminal after {within:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The session's whole event history `(kind, at_ms, data)` from its SSE stream.
async fn history(
    http: &reqwest::Client,
    base: &str,
    id: &str,
) -> Result<Vec<(String, f64, Value)>, String> {
    let mut resp = http
        .get(format!("{base}/v1/sessions/{id}/events"))
        .bearer_auth(API_TOKEN)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = String::new();
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let chunk = tokio::time::timeout_at(deadline, resp.chunk())
            .await
            .map_err(|_| format!("events of {id}: timed out"))?
            .map_err(|e| e.to_string())?;
        let Some(chunk) = chunk else { break };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("data:") {
                    if let Ok(d) = serde_json::from_str::<Value>(v.trim()) {
                        let at = d["at"].as_str().and_then(parse_at).unwrap_or(f64::NAN);
                        out.push((
                            d["kind"].as_str().unwrap_or("").to_string(),
                            at,
                            d["data"].clone(),
                        ));
                    }
                }
            }
        }
    }
    Ok(out)
}

struct RunCfg<'a> {
    bins: &'a Path,
    pg_base: &'a str,
    rootfs: &'a str,
    model_url: &'a str,
    model: &'a Model,
    replicas: usize,
    mode: &'a str,
    sessions: usize,
    max_running: usize,
    max_active: usize,
    post_concurrency: usize,
    workers: usize,
}

async fn fresh_db(pg_base: &str, name: &str) -> String {
    sqlx::any::install_default_drivers();
    let pool = sqlx::AnyPool::connect(pg_base)
        .await
        .unwrap_or_else(|e| panic!("postgres {pg_base}: {e}"));
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&pool)
        .await
        .unwrap_or_else(|e| panic!("CREATE DATABASE: {e}"));
    pool.close().await;
    let (prefix, _) = pg_base
        .rsplit_once('/')
        .unwrap_or_else(|| panic!("bad postgres url {pg_base}"));
    format!("{prefix}/{name}")
}

async fn drop_db(pg_base: &str, name: &str) {
    if let Ok(pool) = sqlx::AnyPool::connect(pg_base).await {
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .execute(&pool)
            .await;
        pool.close().await;
    }
}

async fn one_run(c: &RunCfg<'_>) -> Value {
    let tag = format!("{}{}w{}", c.mode, c.replicas, c.workers);
    let dbname = format!("load_{}_{}", tag, uuid::Uuid::new_v4().simple());
    let db = fresh_db(c.pg_base, &dbname).await;
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    std::fs::write(dir.path().join("tokens"), format!("{API_TOKEN} loadtest\n"))
        .unwrap_or_else(|e| panic!("tokens: {e}"));
    let token = dir.path().join("worker-token");
    std::fs::write(&token, WORKER_TOKEN).unwrap_or_else(|e| panic!("token: {e}"));
    let mut workers = Vec::new();
    let mut registry = String::from("workers:\n");
    for i in 1..=c.workers.max(1) {
        let wdir = dir.path().join(format!("worker{i}"));
        std::fs::create_dir_all(&wdir).unwrap_or_else(|e| panic!("worker dir: {e}"));
        let (w, url) = start_worker(&wdir, c.bins, c.rootfs, c.max_running);
        registry.push_str(&format!(
            "  - id: w{i}\n    endpoint: {url}\n    token_file: {}\n    capacity: 64\n    purposes:\n      \"*\": {IMAGE}\n",
            token.display()
        ));
        workers.push(w);
    }
    let workers_file = dir.path().join("workers.yaml");
    std::fs::write(&workers_file, registry).unwrap_or_else(|e| panic!("workers.yaml: {e}"));
    let worker_pids: Vec<u32> = workers.iter().map(Proc::pid).collect();
    let rc = ReplicaCfg {
        dir: dir.path(),
        bins: c.bins,
        db: &db,
        model: c.model_url,
        workers_file: &workers_file,
        max_active: c.max_active,
    };
    let mut procs = Vec::new();
    let mut bases = Vec::new();
    for i in 0..c.replicas {
        let (p, b) = start_replica(&rc, &format!("r{}", i + 1));
        procs.push(p);
        bases.push(b);
    }
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()
        .unwrap_or_else(|e| panic!("client: {e}"));

    // Warm-up: connections, policy, caches.
    let warm: Vec<String> = (0..2 * c.replicas)
        .map(|i| format!("load test mode={} [lt warm-{tag}-{i}]", c.mode))
        .collect();
    let nwarm = warm.len() as u64;
    for r in submit(&http, &bases, warm, 8).await {
        r.unwrap_or_else(|e| panic!("warm-up: {e}"));
    }
    wait_terminal(&http, &bases[0], nwarm, Duration::from_secs(120))
        .await
        .unwrap_or_else(|e| panic!("warm-up: {e}"));

    let pids: Vec<u32> = procs.iter().map(Proc::pid).collect();
    let load_before = loadavg();
    let before = snap(&pids, &worker_pids);
    let objectives: Vec<String> = (0..c.sessions)
        .map(|i| format!("load test mode={} [lt {tag}-{i}]", c.mode))
        .collect();
    let created = submit(&http, &bases, objectives, c.post_concurrency).await;
    let waited = wait_terminal(
        &http,
        &bases[0],
        nwarm + created.iter().filter(|r| r.is_ok()).count() as u64,
        Duration::from_secs(common::arg_num("--deadline", 300) as u64),
    )
    .await;
    let after = snap(&pids, &worker_pids);
    let load_after = loadavg();
    let cpu = cpu_between(&before, &after);

    // Read every session's history (a few at a time, outside the measured interval).
    let mut failures: Vec<String> = Vec::new();
    if let Err(e) = waited {
        failures.push(e);
    }
    let mut ttf = Vec::new();
    let mut claim = Vec::new();
    let mut first_sent = f64::INFINITY;
    let mut last_final = f64::NEG_INFINITY;
    let mut extra_jobs = 0u32;
    let mut per_worker: std::collections::BTreeMap<String, u32> = Default::default();
    for (i, r) in created.iter().enumerate() {
        let (id, sent) = match r {
            Ok(x) => x,
            Err(e) => {
                failures.push(e.clone());
                continue;
            }
        };
        first_sent = first_sent.min(*sent);
        let h = match history(&http, &bases[i % bases.len()], id).await {
            Ok(h) => h,
            Err(e) => {
                failures.push(e);
                continue;
            }
        };
        let jobs = h.iter().filter(|e| e.0 == "job_dispatched").count() as u32;
        for e in h.iter().filter(|e| e.0 == "job_dispatched") {
            let w = e.2["worker_id"].as_str().unwrap_or("?").to_string();
            *per_worker.entry(w).or_default() += 1;
        }
        extra_jobs += jobs.saturating_sub(u32::from(c.mode == "job"));
        match h.iter().find(|e| e.0 == "final") {
            Some((_, at, _)) => {
                ttf.push(at - sent);
                last_final = last_final.max(*at);
            }
            None => failures.push(format!(
                "{id} ended with {:?}",
                h.last().map(|e| (&e.0, &e.2))
            )),
        }
        let created_at = h.iter().find(|e| e.0 == "created").map(|e| e.1);
        let first_reply = h.iter().find(|e| e.0 == "model_reply").map(|e| e.1);
        if let (Some(a), Some(b)) = (created_at, first_reply) {
            claim.push(b - a);
        }
    }
    let want_calls = if c.mode == "job" { 3 } else { 2 };
    let extra_calls: u32 = c
        .model
        .calls
        .lock()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| k.starts_with(&format!("[lt {tag}-")))
                .map(|(_, n)| n.saturating_sub(want_calls))
                .sum()
        })
        .unwrap_or(0);
    let wall = (last_final - first_sent) / 1000.0;
    let result = json!({
        "mode": c.mode, "replicas": c.replicas, "workers": c.workers, "jobs_per_worker": per_worker, "sessions": c.sessions,
        "worker_max_running": c.max_running, "max_active_sessions_per_replica": c.max_active,
        "wall_seconds": (wall * 100.0).round() / 100.0,
        "sessions_per_second": (c.sessions as f64 / wall * 10.0).round() / 10.0,
        "time_to_final_ms": { "p50": common::percentile(&ttf, 0.5).round(), "p95": common::percentile(&ttf, 0.95).round(), "max": common::percentile(&ttf, 1.0).round() },
        "claim_delay_ms": { "p50": common::percentile(&claim, 0.5).round(), "p95": common::percentile(&claim, 0.95).round() },
        "failures": failures.len(), "first_failure": failures.first(),
        "extra_model_calls": extra_calls, "extra_jobs": extra_jobs,
        "cpu_cores": cpu, "loadavg_before": load_before, "loadavg_after": load_after,
    });
    println!(
        "{:>5} x{} w{}: {:6.1} sessions/s, {:6.2} s, time to final p50 {:6.0} ms p95 {:6.0} ms, claim delay p50 {:5.0} ms p95 {:5.0} ms, {} failures, {} extra model calls, {} extra jobs | cores: replicas {} worker {} postgres {} bench {} other {} busy {} | load {} -> {}",
        c.mode,
        c.replicas,
        c.workers,
        c.sessions as f64 / wall,
        wall,
        common::percentile(&ttf, 0.5),
        common::percentile(&ttf, 0.95),
        common::percentile(&claim, 0.5),
        common::percentile(&claim, 0.95),
        failures.len(),
        extra_calls,
        extra_jobs,
        result["cpu_cores"]["replicas"],
        result["cpu_cores"]["worker_and_sandboxes"],
        result["cpu_cores"]["postgres"],
        result["cpu_cores"]["bench_process"],
        result["cpu_cores"]["other"],
        result["cpu_cores"]["machine_busy_cores"],
        result["loadavg_before"].as_str().unwrap_or(""),
        result["loadavg_after"].as_str().unwrap_or(""),
    );
    if c.mode == "job" {
        println!("      jobs per worker: {per_worker:?}");
    }
    if let Some(f) = failures.first() {
        println!("      first failure: {f}");
    }
    drop(procs);
    drop(workers);
    if failures.is_empty() {
        drop_db(c.pg_base, &dbname).await;
    } else {
        // Keep the logs and the database of a failed run for a post-mortem.
        let kept = dir.keep();
        println!("      kept {} and database {dbname}", kept.display());
    }
    result
}

fn main() {
    common::runtime().block_on(async {
        let sessions = common::arg_num("--sessions", 200);
        let max_running = common::arg_num("--max-running", 2);
        let max_active = common::arg_num("--max-active", 64);
        let post_concurrency = common::arg_num("--post-concurrency", 16);
        let nworkers = common::arg_list("--workers", "1");
        let replicas = common::arg_list("--replicas", "1,2,3");
        let modes: Vec<String> = common::arg("--modes")
            .unwrap_or_else(|| "nojob,job".into())
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|m| m == "job" || m == "nojob")
            .collect();

        let bins = bin_dir();
        if Command::new("podman")
            .args(["image", "exists", IMAGE])
            .status()
            .map_or(true, |s| !s.success())
        {
            run_script(&["deploy/install-deps.sh"]).unwrap_or_else(|e| panic!("{e}"));
            let sba = run_script(&["deploy/sba/build-static.sh"]).unwrap_or_else(|e| panic!("{e}"));
            run_script(&["deploy/sba/build-test-image.sh", &sba]).unwrap_or_else(|e| panic!("{e}"));
        }
        let rootfs = run_script(&["deploy/sba/export-rootfs.sh", IMAGE]).unwrap_or_else(|e| panic!("{e}"));
        let pg_base = match std::env::var("CYNODE_TEST_POSTGRES_URL") {
            Ok(u) if !u.is_empty() => u,
            _ => run_script(&["deploy/postgres/start.sh"])
                .unwrap_or_else(|e| panic!("{e}"))
                .lines()
                .find_map(|l| l.strip_prefix("CYNODE_TEST_POSTGRES_URL=").map(str::to_string))
                .unwrap_or_else(|| panic!("deploy/postgres/start.sh printed no URL")),
        };

        let model = Model::default();
        let app = Router::new()
            .route("/v1/chat/completions", post(completions))
            .with_state(model.clone());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let model_url = format!("http://{}/v1", l.local_addr().unwrap_or_else(|e| panic!("{e}")));
        tokio::spawn(async move { axum::serve(l, app).await });

        println!(
            "load test: {sessions} sessions per run, replicas {replicas:?}, modes {modes:?}, worker max_running {max_running}, {} cores, load {}",
            std::thread::available_parallelism().map_or(1, |n| n.get()),
            loadavg()
        );
        let mut results = Vec::new();
        for mode in &modes {
            for &workers in &nworkers {
                for &n in &replicas {
                    let run = RunCfg {
                        bins: &bins,
                        pg_base: &pg_base,
                        rootfs: &rootfs,
                        model_url: &model_url,
                        model: &model,
                        replicas: n,
                        mode,
                        sessions,
                        max_running,
                        max_active,
                        post_concurrency,
                        workers,
                    };
                    results.push(one_run(&run).await);
                }
            }
        }
        let out = Path::new("/var/cache/cynode/bench");
        let stamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        if std::fs::create_dir_all(out).is_ok() {
            let file = out.join(format!("replicas-{stamp}.json"));
            let body = serde_json::to_string_pretty(&json!({ "runs": results })).unwrap_or_default();
            if std::fs::write(&file, body).is_ok() {
                println!("results: {}", file.display());
            }
        }
    });
}
