//! Suspend and resume on the real server, once per backend: the workspace's tree hash is
//! the same after every suspend and resume (20 cycles in one test), after a clean restart
//! and after a kill -9 of the node; a memory suspend is refused by name; an idle session
//! with `on_idle: suspend` is suspended, not ended; a suspend while commands write loses
//! no acknowledged write; every new route wants the bearer token.

use std::path::PathBuf;
use std::time::Duration;

use cynode_worker::sessions::tree_hash::{tree_hash, Bounds};
use serde_json::{json, Value};

use crate::harness::{assert_field_starts, env, session_guard, unique, RemoveOnDrop, Server};

on_both_backends!(
    session_suspend:
    twenty_cycles_keep_the_workspace_byte_for_byte,
    suspended_sessions_survive_a_restart_and_a_kill9,
    memory_suspend_is_refused_by_name,
    idle_session_with_on_idle_suspend_is_suspended,
    suspend_during_writes_loses_no_acknowledged_write,
    every_route_wants_the_token,
);

// On the microVM (each command a VM of its own under TCG here): the cases that show its
// sessions keep their promises, not every one again.
on_both_backends!(@one session_suspend microvm [
    twenty_cycles_keep_the_workspace_byte_for_byte,
    suspended_sessions_survive_a_restart_and_a_kill9,
    memory_suspend_is_refused_by_name,
    suspend_during_writes_loses_no_acknowledged_write
]);

/// Small volumes: a snapshot or a fork copies less.
pub const CONFIG: &str = "limits:\n  disk_mb: 256\n  disk_max_files: 40000\n";

/// A session a test created: its id, task, workspace and container guard.
pub struct Session {
    pub id: String,
    pub task: String,
    pub workspace: String,
    pub _cleanup: RemoveOnDrop,
}

/// Creates a session with `extra` fields in its create body; asserts 201.
pub async fn create(sv: &Server, extra: Value) -> Session {
    let id = unique("s");
    let task = unique("t");
    let cleanup = session_guard(sv.backend, &id);
    let mut body = json!({
        "version": 1, "session_id": id, "task_id": task, "image": env().image,
    });
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        body[k] = v;
    }
    let (code, info) = sv.post("/v1/worker/sessions", &body).await;
    assert_eq!(code, 201, "{info}");
    let workspace = info["workspace_id"].as_str().unwrap().to_string();
    Session {
        id,
        task,
        workspace,
        _cleanup: cleanup,
    }
}

/// Runs `sh -c script` in the session; the response.
pub async fn sh(sv: &Server, id: &str, script: &str) -> (u16, Value) {
    sv.post(
        &format!("/v1/worker/sessions/{id}/exec"),
        &json!({ "version": 1, "command": ["sh", "-c", script], "timeout_seconds": 120 }),
    )
    .await
}

/// Runs `script` and asserts it completed; its stdout.
pub async fn sh_ok(sv: &Server, id: &str, script: &str) -> String {
    let (code, r) = sh(sv, id, script).await;
    assert_eq!(
        (code, r["status"].as_str()),
        (200, Some("completed")),
        "{r}"
    );
    r["stdout"].as_str().unwrap().to_string()
}

pub fn workspace_dir(sv: &Server, ws: &str) -> PathBuf {
    sv.state_dir().join("workspaces").join(ws)
}

/// The workspace's tree hash, computed by the test on the host.
pub fn hash(sv: &Server, ws: &str) -> String {
    tree_hash(&workspace_dir(sv, ws), Bounds::default()).expect("tree hash")
}

pub async fn suspend(sv: &Server, id: &str) -> Value {
    let (code, info) = sv
        .post(&format!("/v1/worker/sessions/{id}:suspend"), &json!({}))
        .await;
    assert_eq!(code, 200, "{info}");
    assert_eq!(info["status"], "suspended", "{info}");
    info
}

pub async fn resume(sv: &Server, id: &str) -> Value {
    let (code, info) = sv
        .post(&format!("/v1/worker/sessions/{id}:resume"), &json!({}))
        .await;
    assert_eq!(code, 200, "{info}");
    assert_eq!(info["status"], "running", "{info}");
    info
}

/// Containers named for the session (engines only).
fn containers(sv: &Server, id: &str) -> Vec<String> {
    crate::harness::engine_cli(sv.backend).map_or_else(Vec::new, |cli| {
        crate::harness::engine_names(cli, &format!("name=^cynode-session-{id}$"))
    })
}

/// Files of several kinds and sizes, a link and a nested directory.
const FILL: &str = "mkdir -p /workspace/a/b && head -c 300000 /dev/urandom > /workspace/a/b/blob \
     && echo hello > /workspace/a/f && ln -s a/f /workspace/link && chmod 600 /workspace/a/f";

pub async fn twenty_cycles_keep_the_workspace_byte_for_byte(backend: &'static str) {
    let sv = Server::start(backend, CONFIG);
    let s = create(&sv, json!({ "env": { "KEPT": "yes" } })).await;
    sh_ok(&sv, &s.id, FILL).await;
    for i in 0..20 {
        let before = hash(&sv, &s.workspace);
        suspend(&sv, &s.id).await;
        assert_eq!(
            containers(&sv, &s.id),
            Vec::<String>::new(),
            "cycle {i}: the sandbox stays"
        );
        let (code, r) = sh(&sv, &s.id, "true").await;
        assert_eq!(code, 409, "cycle {i}: {r}");
        assert_field_starts(&r, "detail", "session_suspended");
        assert_eq!(
            hash(&sv, &s.workspace),
            before,
            "cycle {i}: changed while suspended"
        );
        // A second suspend answers it as it is.
        suspend(&sv, &s.id).await;
        resume(&sv, &s.id).await;
        assert_eq!(
            hash(&sv, &s.workspace),
            before,
            "cycle {i}: changed by resume"
        );
        // Resuming a running session answers it as it is.
        resume(&sv, &s.id).await;
        let out = sh_ok(
            &sv,
            &s.id,
            &format!("echo $KEPT; echo {i} > /workspace/cycle-{i}"),
        )
        .await;
        assert_eq!(out, "yes\n", "cycle {i}: the env is kept");
    }
    let out = sh_ok(
        &sv,
        &s.id,
        "ls /workspace | grep -c cycle-; cat /workspace/a/f",
    )
    .await;
    assert_eq!(out, "20\nhello\n");
    let (code, _) = sv
        .post(&format!("/v1/worker/sessions/{}/end", s.id), &json!({}))
        .await;
    assert_eq!(code, 200);
}

pub async fn suspended_sessions_survive_a_restart_and_a_kill9(backend: &'static str) {
    let mut sv = Server::start(backend, CONFIG);
    let s = create(
        &sv,
        json!({ "env": { "KEPT": "yes" }, "idle_timeout_seconds": 900 }),
    )
    .await;
    sh_ok(&sv, &s.id, FILL).await;
    let h = hash(&sv, &s.workspace);
    suspend(&sv, &s.id).await;
    sv.terminate_and_restart();
    let (code, info) = sv.get(&format!("/v1/worker/sessions/{}", s.id)).await;
    assert_eq!(
        (code, info["status"].as_str()),
        (200, Some("suspended")),
        "{info}"
    );
    assert_eq!(info["idle_timeout_seconds"], 900, "{info}");
    assert_eq!(hash(&sv, &s.workspace), h, "after a clean restart");
    resume(&sv, &s.id).await;
    assert_eq!(hash(&sv, &s.workspace), h, "resumed after a clean restart");
    assert_eq!(
        sh_ok(&sv, &s.id, "echo $KEPT; cat /workspace/a/f").await,
        "yes\nhello\n"
    );
    sh_ok(&sv, &s.id, "echo more > /workspace/more").await;
    let h2 = hash(&sv, &s.workspace);
    suspend(&sv, &s.id).await;
    sv.kill9_and_restart();
    let (code, info) = sv.get(&format!("/v1/worker/sessions/{}", s.id)).await;
    assert_eq!(
        (code, info["status"].as_str()),
        (200, Some("suspended")),
        "{info}"
    );
    assert_eq!(hash(&sv, &s.workspace), h2, "after a kill -9");
    resume(&sv, &s.id).await;
    assert_eq!(hash(&sv, &s.workspace), h2, "resumed after a kill -9");
    assert_eq!(sh_ok(&sv, &s.id, "cat /workspace/more").await, "more\n");
    // Ending a suspended session forgets it in the store: it is not loaded again.
    suspend(&sv, &s.id).await;
    let (code, info) = sv
        .post(&format!("/v1/worker/sessions/{}/end", s.id), &json!({}))
        .await;
    assert_eq!(
        (code, info["status"].as_str()),
        (200, Some("ended")),
        "{info}"
    );
    sv.terminate_and_restart();
    let (code, _) = sv.get(&format!("/v1/worker/sessions/{}", s.id)).await;
    assert_eq!(code, 404);
}

pub async fn memory_suspend_is_refused_by_name(backend: &'static str) {
    let sv = Server::start(backend, CONFIG);
    let s = create(&sv, json!({})).await;
    sh_ok(&sv, &s.id, "echo x > /workspace/x").await;
    let (code, r) = sv
        .post(
            &format!("/v1/worker/sessions/{}:suspend", s.id),
            &json!({ "memory": true }),
        )
        .await;
    assert_eq!(code, 400, "{r}");
    assert_field_starts(&r, "detail", "memory: memory_suspend_unsupported");
    // Never downgraded: the session still runs.
    let (_, info) = sv.get(&format!("/v1/worker/sessions/{}", s.id)).await;
    assert_eq!(info["status"], "running", "{info}");
    assert_eq!(sh_ok(&sv, &s.id, "cat /workspace/x").await, "x\n");
    // A body that is not a suspend request is a 400 too.
    let (code, r) = sv
        .post(
            &format!("/v1/worker/sessions/{}:suspend", s.id),
            &json!({ "memory": true, "extra": 1 }),
        )
        .await;
    assert_eq!(code, 400, "{r}");
    let (code, r) = sv
        .post(&format!("/v1/worker/sessions/{}:pause", s.id), &json!({}))
        .await;
    assert_eq!(code, 404, "{r}");
}

pub async fn idle_session_with_on_idle_suspend_is_suspended(backend: &'static str) {
    let sv = Server::start(backend, CONFIG);
    let s = create(
        &sv,
        json!({ "idle_timeout_seconds": 1, "on_idle": "suspend" }),
    )
    .await;
    sh_ok(&sv, &s.id, "echo kept > /workspace/k").await;
    let path = format!("/v1/worker/sessions/{}", s.id);
    let until = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (_, info) = sv.get(&path).await;
        if info["status"] == "suspended" {
            break;
        }
        assert_ne!(info["status"], "ended", "{info}");
        assert!(std::time::Instant::now() < until, "not suspended: {info}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    resume(&sv, &s.id).await;
    assert_eq!(sh_ok(&sv, &s.id, "cat /workspace/k").await, "kept\n");
    // The default stays `end`.
    let e = create(&sv, json!({ "idle_timeout_seconds": 1 })).await;
    let path = format!("/v1/worker/sessions/{}", e.id);
    let until = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (_, info) = sv.get(&path).await;
        if info["status"] == "ended" {
            break;
        }
        assert!(std::time::Instant::now() < until, "not ended: {info}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub async fn suspend_during_writes_loses_no_acknowledged_write(backend: &'static str) {
    let sv = std::sync::Arc::new(Server::start(backend, CONFIG));
    let s = create(&sv, json!({})).await;
    let writer = {
        let sv = sv.clone();
        let id = s.id.clone();
        tokio::spawn(async move {
            let mut acked = Vec::new();
            for i in 0..400 {
                let (code, r) = sh(&sv, &id, &format!("echo {i} >> /workspace/log")).await;
                if code == 409
                    && r["detail"]
                        .as_str()
                        .unwrap_or("")
                        .starts_with("session_suspended")
                {
                    break;
                }
                if code == 200 && r["status"] == "completed" {
                    acked.push(i);
                }
            }
            acked
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let until = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let (code, r) = sv
            .post(&format!("/v1/worker/sessions/{}:suspend", s.id), &json!({}))
            .await;
        if code == 200 {
            break;
        }
        // Refused while a command runs; never cut one.
        assert_eq!(code, 409, "{r}");
        assert!(std::time::Instant::now() < until, "never suspended");
    }
    let acked = writer.await.unwrap();
    resume(&sv, &s.id).await;
    let log = sh_ok(&sv, &s.id, "cat /workspace/log").await;
    let written: Vec<u32> = log.lines().map(|l| l.parse().unwrap()).collect();
    for i in &acked {
        assert!(
            written.contains(i),
            "acknowledged write {i} lost: {written:?}"
        );
    }
    eprintln!(
        "{backend}: {} acknowledged writes before the suspend",
        acked.len()
    );
}

pub async fn every_route_wants_the_token(backend: &'static str) {
    let sv = Server::start(backend, CONFIG);
    let s = create(&sv, json!({})).await;
    let c = reqwest::Client::new();
    for (method, path) in [
        ("POST", format!("/v1/worker/sessions/{}:suspend", s.id)),
        ("POST", format!("/v1/worker/sessions/{}:resume", s.id)),
        ("POST", format!("/v1/worker/sessions/{}/snapshots", s.id)),
        ("GET", format!("/v1/worker/sessions/{}/snapshots", s.id)),
        ("DELETE", "/v1/worker/snapshots/snap-0".to_string()),
    ] {
        for token in [None, Some("wrong-token")] {
            let mut rq = c.request(method.parse().unwrap(), sv.url(&path));
            if let Some(t) = token {
                rq = rq.bearer_auth(t);
            }
            let r = rq.send().await.unwrap();
            assert_eq!(r.status().as_u16(), 401, "{method} {path} with {token:?}");
        }
    }
    // Nothing happened: the session still runs, and has no snapshot.
    let (_, info) = sv.get(&format!("/v1/worker/sessions/{}", s.id)).await;
    assert_eq!(info["status"], "running", "{info}");
    let (_, list) = sv
        .get(&format!("/v1/worker/sessions/{}/snapshots", s.id))
        .await;
    assert_eq!(list["snapshots"], json!([]), "{list}");
    // Unknown ids are 404s.
    for path in [
        "/v1/worker/sessions/nope:suspend",
        "/v1/worker/sessions/nope:resume",
    ] {
        let (code, _) = sv.post(path, &json!({})).await;
        assert_eq!(code, 404, "{path}");
    }
}
