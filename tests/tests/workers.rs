//! The worker registry through the real `cynode-pm serve`: two real bwrap workers with
//! different sandbox purposes, the scripted model, SQLite. Jobs go only to workers
//! offering the skill's purpose; a session's later jobs follow its workspace; placement
//! spreads by free capacity (read live from the workers); a dead worker is skipped and
//! used again once it is back.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::service::{call, start_replica_with, wait_status, Replica, TENANT_A};
use cynode_tests::{model_server, start_worker, Worker, TOKEN};

const IMAGE: &str = "localhost/cynode-sba-test:latest";

/// Writes the workers' token file and `dir/workers.yaml` listing `entries` (YAML list
/// items, where `TOKEN_FILE` stands for the token file's path); returns the file's path.
fn registry(dir: &Path, entries: &str) -> String {
    let token = dir.join("worker-token");
    std::fs::write(&token, TOKEN).unwrap();
    let path = dir.join("workers.yaml");
    let text = format!(
        "workers:\n{}",
        entries.replace("TOKEN_FILE", &token.display().to_string())
    );
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// `cynode-pm serve` on SQLite in `dir`, with the scripted model at `model`.
fn serve(dir: &Path, model: &str, workers: &[&str], extra: &[&str]) -> Replica {
    let db = format!("sqlite://{}", dir.join("pm.db").display());
    start_replica_with(dir, "r1", &db, model, workers, extra)
}

/// `GET /readyz`: the status code and body.
async fn readyz(base: &str) -> (u16, Value) {
    call(
        reqwest::Method::GET,
        &format!("{base}/readyz"),
        TENANT_A,
        None,
    )
    .await
}

fn plan(task: &str) -> Value {
    json!({ "type": "plan_update", "state_patch": [
        { "op": "add", "path": "/plan/-", "value": { "task_id": task, "description": "do it", "status": "pending" } }
    ], "payload": { "note": "plan" } })
}

fn job(task: &str, skill: &str, inputs: Value) -> Value {
    json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": task, "skill_id": skill, "inputs": inputs } })
}

fn write(task: &str) -> Value {
    job(
        task,
        "write-files",
        json!({ "files": [{ "path": "hello.txt", "content": "hi\n" }] }),
    )
}

fn fin() -> Value {
    json!({ "type": "final", "state_patch": [], "payload": { "summary": "done" } })
}

/// A final that closes t1 as skipped (a final is refused while a task is open).
fn fin_skipping_t1() -> Value {
    json!({ "type": "final", "state_patch": [
        { "op": "replace", "path": "/plan/0/status", "value": "skipped" },
        { "op": "add", "path": "/plan/0/reason", "value": "cannot run here" }
    ], "payload": { "summary": "t1 could not run" } })
}

/// Creates a session, waits for it to complete, returns it and its events.
async fn session(base: &str) -> (Value, Vec<Value>) {
    let done = session_ending(base, json!({ "objective": "route my jobs" })).await;
    assert_eq!(done["status"], "completed", "{done}");
    let id = done["session_id"].as_str().unwrap();
    let events = crate::service::sse(base, id, None, None)
        .await
        .into_iter()
        .map(|(_, kind, data)| json!({ "kind": kind, "data": data["data"] }))
        .collect();
    (done, events)
}

/// `(kind, worker_id)` of the session's job events.
fn routed(events: &[Value]) -> Vec<(String, String)> {
    events
        .iter()
        .filter(|e| e["kind"] == "job_dispatched" || e["kind"] == "job_refused")
        .map(|e| {
            (
                e["kind"].as_str().unwrap().to_string(),
                e["data"]["worker_id"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

async fn worker_get(w: &Worker, path: &str) -> u16 {
    w.get(path).await.status().as_u16()
}

/// Fills both run slots of `w` with sleeping jobs; returns their ids.
async fn make_busy(w: &Worker, tag: &str) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..2 {
        let id = format!("busy-{tag}-{i}");
        let r = reqwest::Client::new()
            .post(format!("http://{}/v1/worker/jobs", w.addr))
            .bearer_auth(TOKEN)
            .json(&json!({ "version": 1, "task_id": "busy", "job_id": id,
                "sandbox": { "image": IMAGE, "command": ["sleep", "60"] } }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
        ids.push(id);
    }
    ids
}

async fn stop(w: &Worker, ids: &[String]) {
    for id in ids {
        reqwest::Client::new()
            .post(format!("http://{}/v1/worker/jobs/{id}:stop", w.addr))
            .bearer_auth(TOKEN)
            .json(&json!({}))
            .send()
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_follow_purpose_workspace_and_free_capacity_and_skip_a_dead_worker() {
    let w1 = start_worker(0);
    let mut w2 = start_worker(0);
    let w2_port: u16 = w2.addr.rsplit(':').next().unwrap().parse().unwrap();
    let dir = cynode_tests::tempdir().unwrap();
    let workers = registry(
        dir.path(),
        &format!(
            "- id: w1\n  endpoint: http://{}\n  token_file: TOKEN_FILE\n  capacity: 4\n  purposes:\n    base-tools: {IMAGE}\n  labels: {{ zone: a }}\n\
             - id: w2\n  endpoint: http://{}\n  token_file: TOKEN_FILE\n  capacity: 4\n  purposes:\n    base-tools: {IMAGE}\n    python-tools: {IMAGE}\n",
            w1.addr, w2.addr
        ),
    );
    let script = vec![
        // s1: base-tools twice (pinned to its first worker), then python-tools, which
        // that worker (w1) does not offer: refused and fed back, no job.
        plan("t1"),
        write("t1"),
        job("t1", "search-code", json!({ "pattern": "hi" })),
        job("t1", "python-test", json!({})),
        fin(),
        // s2: a tie on free room goes to the worker this replica placed fewer jobs on (w2).
        plan("t1"),
        write("t1"),
        fin(),
        // s3: python-tools only exists on w2 (the tie-break alone would say w1). The
        // workspace has no Python project: the job fails and t1 stays open.
        plan("t1"),
        job("t1", "python-test", json!({})),
        fin_skipping_t1(),
        // s4: go-tools is offered by no worker: go-test is not in the model's catalog, so
        // the reply is rejected by the contract and asked again.
        plan("t1"),
        job("t1", "go-test", json!({})),
        fin_skipping_t1(),
        // s5: w1 is busy (both run slots taken): more free room on w2 wins although
        // this replica placed more jobs there.
        plan("t1"),
        write("t1"),
        fin(),
        // s6: w2 is dead: skipped, the job goes to w1.
        plan("t1"),
        write("t1"),
        fin(),
        // s7: w2 is back and w1 busy again: w2 is asked again and chosen.
        plan("t1"),
        write("t1"),
        fin(),
    ];
    let (model, m) = model_server(script);
    let r = serve(
        dir.path(),
        &model,
        &["--workers-file", &workers],
        &["--worker-wait-seconds", "20"],
    );

    let (s1, e1) = session(&r.base).await;
    let refused: Vec<&Value> = e1.iter().filter(|e| e["kind"] == "job_refused").collect();
    assert_eq!(
        routed(&e1),
        [
            ("job_dispatched".into(), "w1".into()),
            ("job_dispatched".into(), "w1".into()),
            ("job_refused".into(), "".into())
        ],
        "{e1:?}"
    );
    let why = refused[0]["data"]["reason"].as_str().unwrap();
    assert!(
        why.contains("worker `w1`, which does not offer sandbox purpose `python-tools`"),
        "{why}"
    );
    assert_eq!(s1["worker_id"], "w1");
    assert_eq!(s1["jobs_dispatched"], 2);
    // The workspace exists on w1 only.
    let ws = format!(
        "/v1/worker/workspaces/{}/tar",
        s1["workspace_id"].as_str().unwrap()
    );
    assert_eq!(
        (worker_get(&w1, &ws).await, worker_get(&w2, &ws).await),
        (200, 404)
    );

    let (_, e2) = session(&r.base).await;
    assert_eq!(routed(&e2), [("job_dispatched".into(), "w2".into())]);

    let (_, e3) = session(&r.base).await;
    assert_eq!(routed(&e3), [("job_dispatched".into(), "w2".into())]);

    let asked_before = m.requests().len();
    let (s4, e4) = session(&r.base).await;
    assert_eq!(routed(&e4), []);
    assert_eq!(s4["worker_id"], Value::Null);
    let requests = m.requests();
    // plan, the go-test reply (rejected: not in the schema's skill list), final.
    assert_eq!(requests.len() - asked_before, 3);
    let schema = requests[asked_before]["response_format"].to_string();
    assert!(
        schema.contains("python-test") && !schema.contains("go-test"),
        "{schema}"
    );
    let url = format!("{}/v1/skills", r.base);
    let (_, skills) = call(reqwest::Method::GET, &url, TENANT_A, None).await;
    let ids = cynode_testkit::field_strs(&skills["skills"], "skill_id");
    assert!(
        ids.contains(&"write-files") && ids.contains(&"python-test") && !ids.contains(&"go-test"),
        "{ids:?}"
    );

    let busy = make_busy(&w1, "a").await;
    let (_, e5) = session(&r.base).await;
    assert_eq!(routed(&e5), [("job_dispatched".into(), "w2".into())]);
    stop(&w1, &busy).await;

    drop(w2);
    let (_, e6) = session(&r.base).await;
    assert_eq!(routed(&e6), [("job_dispatched".into(), "w1".into())]);
    let (code, ready) = readyz(&r.base).await;
    assert_eq!(code, 200, "one worker of two is enough: {ready}");

    w2 = start_worker(w2_port);
    // Past w2's backoff (1 s after its first failure).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let busy = make_busy(&w1, "b").await;
    let (_, e7) = session(&r.base).await;
    assert_eq!(routed(&e7), [("job_dispatched".into(), "w2".into())]);
    stop(&w1, &busy).await;
    let metrics = reqwest::get(format!("{}/metrics", r.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "cynode_pm_placements_total{worker=\"w1\"} 2",
        "cynode_pm_placements_total{worker=\"w2\"} 4",
        "cynode_pm_worker_up{worker=\"w2\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} missing from:\n{metrics}");
    }
    drop(w2);
}

/// Creates a session (with `body`'s extra fields) and waits for a terminal state.
async fn session_ending(base: &str, body: Value) -> Value {
    let (code, v) = call(
        reqwest::Method::POST,
        &format!("{base}/v1/sessions"),
        TENANT_A,
        Some(body),
    )
    .await;
    assert_eq!(code, 201, "{v}");
    wait_status(
        base,
        v["session_id"].as_str().unwrap(),
        &["completed", "failed", "canceled"],
        Duration::from_secs(120),
    )
    .await
}

/// A seed path the worker refuses (outside its seed roots) fails the session when the
/// first job places the workspace, naming the worker and its reason; no job runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_seed_fails_the_session_naming_the_worker() {
    let w = start_worker(0);
    let dir = cynode_tests::tempdir().unwrap();
    let (model, _m) = model_server(vec![plan("t1"), write("t1"), fin()]);
    let endpoint = format!("http://{}", w.addr);
    let r = serve(dir.path(), &model, &["--worker-endpoint", &endpoint], &[]);
    let v = session_ending(
        &r.base,
        json!({ "objective": "seed from /etc", "workspace": { "seed_path": "/etc" } }),
    )
    .await;
    assert_eq!(v["status"], "failed", "{v}");
    let msg = v["failure"]["message"].as_str().unwrap();
    assert!(
        msg.contains("worker default refused to create the session's workspace"),
        "{msg}"
    );
    assert_eq!(v["worker_id"], "default");
}

/// With every worker offering the purpose unreachable, the first job waits
/// `--worker-wait-seconds` and the session fails `worker_unavailable`, naming each
/// worker and why; `/readyz` says no worker is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_reachable_worker_fails_the_session_after_the_wait() {
    let dir = cynode_tests::tempdir().unwrap();
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_port = dead.local_addr().unwrap().port();
    drop(dead);
    let workers = registry(
        dir.path(),
        &format!(
            "- id: gone-a\n  endpoint: http://127.0.0.1:{dead_port}\n  token_file: TOKEN_FILE\n  purposes: {{ \"*\": {IMAGE} }}\n- id: gone-b\n  endpoint: http://127.0.0.1:1\n  token_file: TOKEN_FILE\n  purposes: {{ base-tools: {IMAGE} }}\n"
        ),
    );
    let (model, _m) = model_server(vec![plan("t1"), write("t1"), fin()]);
    let r = serve(
        dir.path(),
        &model,
        &["--workers-file", &workers],
        &["--worker-wait-seconds", "3"],
    );
    let t = std::time::Instant::now();
    let v = session_ending(&r.base, json!({ "objective": "nowhere to run" })).await;
    assert_eq!(v["status"], "failed", "{v}");
    assert_eq!(v["failure"]["kind"], "worker_unavailable", "{v}");
    let msg = v["failure"]["message"].as_str().unwrap();
    assert!(
        msg.contains("no worker offering `base-tools` is reachable")
            && msg.contains("gone-a")
            && msg.contains("gone-b"),
        "{msg}"
    );
    assert!(
        t.elapsed() >= Duration::from_secs(3),
        "it waited {:?}",
        t.elapsed()
    );
    assert_eq!(v["jobs_dispatched"], 0);
    let (code, ready) = readyz(&r.base).await;
    assert_eq!(code, 503, "{ready}");
}

/// A registry under which no skill can run is a startup error that names what is offered.
#[test]
fn no_runnable_skill_is_a_startup_error() {
    let dir = cynode_tests::tempdir().unwrap();
    std::fs::write(dir.path().join("tokens"), format!("{TENANT_A} acme\n")).unwrap();
    let workers = registry(
        dir.path(),
        &format!("- id: w1\n  endpoint: http://127.0.0.1:1\n  token_file: TOKEN_FILE\n  purposes: {{ cobol-tools: {IMAGE} }}\n"),
    );
    let out = std::process::Command::new(cynode_tests::bin("cynode-pm"))
        .args(["serve", "--listen", "127.0.0.1:0", "--api-tokens-file"])
        .arg(dir.path().join("tokens"))
        .args(["--workers-file", &workers])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .current_dir(cynode_tests::workspace_root())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("no worker offers the sandbox purpose of any skill (offered: cobol-tools)"),
        "{err}"
    );
}
