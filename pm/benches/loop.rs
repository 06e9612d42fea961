//! PM loop benchmark: the PM's own overhead per turn, and many concurrent sessions.
//!
//! `cargo bench -p cynode-pm --bench loop [-- --sessions N --worker URL --token T --image I --datastore URL]`
//!
//! 1. Overhead per turn: one session of 400 `plan_update` turns against a scripted model
//!    that answers instantly over real HTTP on 127.0.0.1, with SQLite. Every turn is a
//!    model request, reply validation, state patch, and a journaled save; the model's own
//!    time is measured on the server side and subtracted. Prints p50/p95 (target p50 < 5 ms).
//! 2. Concurrency: N sessions (default 200) on one process, each `plan_update` →
//!    `job_request` (write-files) → `final`, dispatched to the worker given with `--worker`
//!    (a bwrap worker is expected; without `--worker` the job step is skipped and each
//!    session is plan_update → final). Prints sessions/s and failures (target: none).

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use cynode_pm::dispatch::WorkerClient;
use cynode_pm::driver::Pm;
use cynode_pm::llm::{Contract, LlmClient, ModelConfig};
use cynode_pm::policy::{Mode, PolicyGate, TenantPolicy};
use cynode_pm::session::{Budgets, SessionRecord, SessionStatus};
use cynode_pm::skills::Registry;
use cynode_pm::store::Store;
use cynode_pm::workers::WorkerPool;
use serde_json::{json, Value};

#[derive(Clone)]
struct Model {
    with_job: bool,
    server_ns: Arc<AtomicU64>,
}

/// Answers by looking at the conversation: the reply depends only on how far the session is.
async fn completions(State(m): State<Model>, Json(body): Json<Value>) -> Json<Value> {
    let t = Instant::now();
    let text = common::data_text(&body);
    let content = if text.contains("bench-long") {
        if text.matches("bench-note").count() >= 400 {
            common::final_reply()
        } else {
            json!({ "type": "plan_update", "state_patch": [{ "op": "add", "path": "/notes/-", "value": "bench-note" }], "payload": {} })
        }
    } else {
        common::scripted_reply(&text, m.with_job)
    };
    let reply = common::completion(&content);
    m.server_ns
        .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    Json(reply)
}

async fn pm(model_url: &str, worker: Option<(String, String)>, image: &str, db: &str) -> Pm {
    let repo = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let registry = Registry::load(&[repo.join("skills")]).unwrap_or_default();
    let mut cfg = ModelConfig::new(model_url, "bench");
    cfg.max_tokens = 256;
    let (w, t) = worker.unwrap_or_else(|| ("http://127.0.0.1:9".into(), "none".into()));
    Pm {
        contract: Contract::new(registry.catalog()).unwrap_or_else(|e| panic!("contract: {e}")),
        registry,
        store: Store::connect(db)
            .await
            .unwrap_or_else(|e| panic!("store: {e}")),
        gate: PolicyGate::builtin(Mode::Enforce).unwrap_or_else(|e| panic!("policy: {e}")),
        tenant: TenantPolicy::default(),
        llm: LlmClient::new(cfg),
        workers: WorkerPool::single(WorkerClient::new(&w, &t), image),
        worker_wait: std::time::Duration::from_secs(60),
        artifacts_dir: std::env::temp_dir().join("cynode-bench-artifacts"),
        gateway_url: None,
    }
}

fn main() {
    common::runtime().block_on(async {
        let worker = common::arg("--worker").map(|w| (w, common::arg("--token").unwrap_or_default()));
        let image = common::arg("--image").unwrap_or_else(|| "localhost/cynode-sba-test:latest".into());
        let sessions = common::arg_num("--sessions", 200);
        let model = Model { with_job: worker.is_some(), server_ns: Arc::new(AtomicU64::new(0)) };
        let app = Router::new().route("/v1/chat/completions", post(completions)).with_state(model.clone());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("{e}"));
        let url = format!("http://{}/v1", l.local_addr().unwrap_or_else(|e| panic!("{e}")));
        tokio::spawn(async move { axum::serve(l, app).await });
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));

        // 1. Overhead per turn.
        let p = pm(&url, None, &image, &format!("sqlite://{}", dir.path().join("turns.db").display())).await;
        let rec = SessionRecord::new("bench-long", "t", "bench-long objective", Budgets { max_turns: 1000, max_plan_only_streak: 0, ..Budgets::default() });
        p.create(&rec).await.unwrap_or_else(|e| panic!("{e}"));
        let mut stamps = Vec::new();
        let mut last = Instant::now();
        let mut last_server = 0u64;
        let rec = p
            .run("bench-long", &mut |ev| {
                if let cynode_pm::driver::Progress::Turn(_) = ev {
                    let now = Instant::now();
                    let server = model.server_ns.load(Ordering::Relaxed);
                    let wall = now.duration_since(last).as_secs_f64() * 1000.0;
                    let model_ms = (server - last_server) as f64 / 1e6;
                    stamps.push(wall - model_ms);
                    last = now;
                    last_server = server;
                }
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(rec.status, SessionStatus::Completed, "{:?}", rec.failure);
        let turns: Vec<f64> = stamps.into_iter().skip(2).collect();
        let n = turns.len();
        let p50 = common::percentile(&turns, 0.5);
        let p95 = common::percentile(&turns, 0.95);
        println!("pm overhead per turn (SQLite, {n} turns): p50 {p50:.2} ms, p95 {p95:.2} ms (target p50 < 5 ms)");

        // 2. Concurrent sessions, on SQLite or on the datastore given with --datastore.
        let db = common::arg("--datastore")
            .unwrap_or_else(|| format!("sqlite://{}", dir.path().join("many.db").display()));
        let store_kind = if db.starts_with("postgres") { "PostgreSQL" } else { "SQLite" };
        let p = Arc::new(pm(&url, worker.clone(), &image, &db).await);
        let run_tag = uuid::Uuid::new_v4().simple().to_string();
        let t = Instant::now();
        let mut handles = Vec::new();
        for i in 0..sessions {
            let p = Arc::clone(&p);
            let tag = run_tag.clone();
            handles.push(tokio::spawn(async move {
                let started = Instant::now();
                let id = format!("bench-{tag}-{i}");
                let rec = SessionRecord::new(&id, "t", "concurrent objective", Budgets::default());
                p.create(&rec).await.map_err(|e| e.to_string())?;
                let out = p.run(&id, &mut |_| {}).await.map_err(|e| e.to_string())?;
                if out.status == SessionStatus::Completed {
                    Ok(started.elapsed().as_secs_f64() * 1000.0)
                } else {
                    Err(format!("{:?}", out.failure))
                }
            }));
        }
        let mut failures = Vec::new();
        let mut to_final = Vec::new();
        for h in handles {
            match h.await {
                Ok(Ok(ms)) => to_final.push(ms),
                Ok(Err(e)) => failures.push(e),
                Err(e) => failures.push(e.to_string()),
            }
        }
        let secs = t.elapsed().as_secs_f64();
        let p95_final = common::percentile(&to_final, 0.95);
        println!(
            "{sessions} concurrent sessions on {store_kind} ({}): {secs:.2} s, {:.1} sessions/s, p95 time to final {p95_final:.0} ms, peak RSS {} MiB, {} failures{}",
            if worker.is_some() { "with a write-files job each" } else { "no jobs" },
            sessions as f64 / secs,
            peak_rss_kib() / 1024,
            failures.len(),
            failures.first().map(|f| format!(" (first: {f})")).unwrap_or_default()
        );
        let _ = Duration::from_secs(0);
    });
}

/// This process's peak resident set (VmHWM), in KiB.
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}
