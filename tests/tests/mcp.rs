//! `cynode-pm mcp` driven by a real MCP client (rmcp's): over stdio (the real binary as a
//! child process) and over streamable HTTP at `/v1/mcp` of `serve`, each with a real
//! bwrap worker, the real SBA and a scripted model. A session is created, followed to its
//! end through `sessions.events`, and its artifact fetched and verified; unknown tools and
//! bad arguments are structured JSON-RPC errors, refused operations are `isError` results
//! with the HTTP API's problem; tenants see only their own sessions.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use base64::Engine;
use rmcp::model::{CallToolRequestParams, CallToolResult, ErrorCode};
use rmcp::service::{RoleClient, RunningService, ServiceError};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::ServiceExt;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::service::{start_replica_with, TENANT_A};
use cynode_tests::{model_server, start_worker, workspace_root, TOKEN};

type Client = RunningService<RoleClient, ()>;

const README: &str = "# hello from the MCP session\n";

/// Plans two tasks, writes README.md (t1), reads it back as an artifact with
/// repo-inspect (t2), finishes.
fn artifact_script() -> Vec<Value> {
    vec![
        json!({ "type": "plan_update", "state_patch": [
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "write the readme", "status": "pending" } },
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t2", "description": "read it back", "status": "pending" } }
        ], "payload": {} }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": "write-files",
            "inputs": { "files": [{ "path": "README.md", "content": README }] } } }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t2", "skill_id": "repo-inspect",
            "inputs": { "files": ["README.md"] } } }),
        json!({ "type": "final", "state_patch": [], "payload": { "summary": "wrote and read README.md" } }),
    ]
}

fn args(v: Value) -> rmcp::model::JsonObject {
    v.as_object().cloned().unwrap()
}

/// Calls `tool`; the protocol error, if the server refused the call itself.
async fn try_call(c: &Client, tool: &str, a: Value) -> Result<CallToolResult, ServiceError> {
    let params = CallToolRequestParams::new(tool.to_string()).with_arguments(args(a));
    tokio::time::timeout(Duration::from_secs(60), c.call_tool(params))
        .await
        .unwrap_or_else(|_| panic!("{tool} did not answer within 60 s"))
}

/// Calls `tool` and returns its structured result, failing on an error of any kind.
async fn call(c: &Client, tool: &str, a: Value) -> Value {
    let r = try_call(c, tool, a.clone())
        .await
        .unwrap_or_else(|e| panic!("{tool} {a}: {e}"));
    assert_eq!(r.is_error, Some(false), "{tool} {a}: {r:?}");
    r.structured_content.unwrap()
}

/// Calls `tool`, which must run and be refused: its problem.
async fn refused(c: &Client, tool: &str, a: Value) -> Value {
    let r = try_call(c, tool, a.clone())
        .await
        .unwrap_or_else(|e| panic!("{tool} {a}: {e}"));
    assert_eq!(r.is_error, Some(true), "{tool} {a}: {r:?}");
    r.structured_content.unwrap()
}

/// Calls `tool`, which the server must refuse as a protocol error: (code, data).
async fn protocol_error(c: &Client, tool: &str, a: Value) -> (ErrorCode, Value) {
    match try_call(c, tool, a.clone()).await {
        Err(ServiceError::McpError(e)) => (e.code, e.data.unwrap_or(Value::Null)),
        other => panic!("{tool} {a}: expected a JSON-RPC error, got {other:?}"),
    }
}

/// Follows the session through `sessions.events` until it is done; its events in order.
async fn follow(c: &Client, id: &str) -> Vec<Value> {
    let t = Instant::now();
    let (mut after, mut all) = (0u64, Vec::new());
    loop {
        let page = call(
            c,
            "sessions.events",
            json!({ "session_id": id, "after": after, "wait_seconds": 5 }),
        )
        .await;
        all.extend(page["events"].as_array().unwrap().iter().cloned());
        after = page["next_after"].as_u64().unwrap();
        if page["done"] == true {
            return all;
        }
        assert!(
            t.elapsed() < Duration::from_secs(150),
            "session {id} not done: {all:?}"
        );
    }
}

/// Runs the artifact session as the client's tenant and checks every tool on it.
async fn session_to_a_verified_artifact(c: &Client) -> String {
    let tools: Vec<String> = c
        .list_all_tools()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name.to_string())
        // `skills.run` is offered on stdio only (checked by each transport's test).
        .filter(|t| t != "skills.run")
        .collect();
    assert_eq!(
        tools,
        [
            "sessions.create",
            "sessions.get",
            "sessions.events",
            "sessions.answer",
            "sessions.cancel",
            "skills.list",
            "skills.show",
            "artifacts.get",
            "sessions.report",
            "sandbox.create",
            "sandbox.get",
            "sandbox.exec",
            "sandbox.exec_output",
            "sandbox.exec_state",
            "sandbox.stdin",
            "sandbox.signal",
            "sandbox.suspend",
            "sandbox.resume",
            "sandbox.end",
            "sandbox.files",
            "sandbox.file_read",
            "sandbox.file_write",
            "sandbox.snapshot",
            "sandbox.snapshots",
            "sandbox.snapshot_delete",
            "sandbox.fork"
        ]
    );
    let created = call(
        c,
        "sessions.create",
        json!({ "objective": "write a readme and read it back", "idempotency_key": "k-1" }),
    )
    .await;
    assert_eq!(created["created"], true, "{created}");
    let id = created["session"]["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let again = call(
        c,
        "sessions.create",
        json!({ "objective": "write a readme and read it back", "idempotency_key": "k-1" }),
    )
    .await;
    assert_eq!(
        (
            again["created"].clone(),
            again["session"]["session_id"].clone()
        ),
        (json!(false), json!(id))
    );

    let events = follow(c, &id).await;
    let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
    let kinds: Vec<&str> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds.first(), Some(&"created"));
    assert_eq!(kinds.last(), Some(&"final"), "{kinds:?}");
    assert_eq!(
        kinds.iter().filter(|k| **k == "job_finished").count(),
        2,
        "{kinds:?}"
    );

    let s = call(c, "sessions.get", json!({ "session_id": id })).await;
    assert_eq!(s["status"], "completed", "{s}");
    let art = s["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["path"] == "README.md")
        .unwrap_or_else(|| panic!("no README.md artifact: {s}"))
        .clone();
    let sha = art["sha256"].as_str().unwrap();
    let got = call(
        c,
        "artifacts.get",
        json!({ "session_id": id, "sha256": sha }),
    )
    .await;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(got["content_base64"].as_str().unwrap())
        .unwrap();
    assert_eq!(hex::encode(Sha256::digest(&bytes)), sha);
    assert_eq!(
        (bytes.as_slice(), got["size_bytes"].clone()),
        (README.as_bytes(), json!(README.len()))
    );

    // Skills.
    let skills = call(c, "skills.list", json!({})).await;
    assert!(skills["skills"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["skill_id"] == "write-files"));
    let skill = call(c, "skills.show", json!({ "skill_id": "write-files" })).await;
    assert_eq!(skill["skill_id"], "write-files", "{skill}");

    // Refused operations: the HTTP API's problems, as isError results.
    let kind = |p: &Value| p["type"].as_str().unwrap().to_string();
    let p = refused(c, "skills.show", json!({ "skill_id": "no-such-skill" })).await;
    assert_eq!(kind(&p), "urn:cynodeai:error:not_found", "{p}");
    let p = refused(c, "sessions.get", json!({ "session_id": "s-missing" })).await;
    assert_eq!(
        (kind(&p), p["status"].clone()),
        ("urn:cynodeai:error:not_found".into(), json!(404))
    );
    let p = refused(c, "sessions.cancel", json!({ "session_id": id })).await;
    assert_eq!(kind(&p), "urn:cynodeai:error:conflict", "{p}");
    let p = refused(
        c,
        "sessions.answer",
        json!({ "session_id": id, "text": "hi" }),
    )
    .await;
    assert_eq!(kind(&p), "urn:cynodeai:error:conflict", "{p}");
    let p = refused(
        c,
        "artifacts.get",
        json!({ "session_id": id, "sha256": "0".repeat(64) }),
    )
    .await;
    assert_eq!(kind(&p), "urn:cynodeai:error:not_found", "{p}");
    let p = refused(
        c,
        "sessions.create",
        json!({ "objective": "x", "tenant": "someone-else" }),
    )
    .await;
    assert_eq!(kind(&p), "urn:cynodeai:error:authorization", "{p}");

    // Protocol errors: an unknown tool, arguments off the schema (naming the field).
    let (code, data) = protocol_error(c, "db.query", json!({})).await;
    assert_eq!(
        (code, data["type"].clone()),
        (
            ErrorCode::INVALID_PARAMS,
            json!("urn:cynodeai:error:not_found")
        )
    );
    let (code, data) = protocol_error(c, "sessions.get", json!({ "session": id })).await;
    assert_eq!(code, ErrorCode::INVALID_PARAMS);
    assert_eq!(data["type"], "urn:cynodeai:error:validation");
    assert!(
        data["detail"].as_str().unwrap().contains("session"),
        "{data}"
    );
    let (code, data) = protocol_error(
        c,
        "sessions.events",
        json!({ "session_id": id, "after": "many" }),
    )
    .await;
    assert_eq!(code, ErrorCode::INVALID_PARAMS);
    assert!(data["detail"].as_str().unwrap().contains("after"), "{data}");
    let (code, _) = protocol_error(
        c,
        "sessions.events",
        json!({ "session_id": id, "wait_seconds": 3600 }),
    )
    .await;
    assert_eq!(code, ErrorCode::INVALID_PARAMS);
    id
}

/// `cynode-pm mcp` for `tenant` as a child process of an rmcp client.
async fn stdio_client(dir: &Path, db: &str, model: &str, worker: &str, tenant: &str) -> Client {
    let log = std::fs::File::create(dir.join(format!("mcp-{tenant}.log"))).unwrap();
    let mut cmd = tokio::process::Command::new(cynode_tests::bin("cynode-pm"));
    cmd.arg("mcp")
        .args(["--tenant-id", tenant, "--datastore-endpoint", db])
        .args(["--worker-endpoint", &format!("http://{worker}")])
        .args(["--model-base-url", model])
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env("CYNODE_WORKER_TOKEN", TOKEN)
        .current_dir(workspace_root());
    let (transport, _) = TokioChildProcess::builder(cmd)
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(60), ().serve(transport))
        .await
        .expect("cynode-pm mcp did not initialize within 60 s")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_stdio_client_runs_a_session_to_a_verified_artifact() {
    let dir = cynode_tests::tempdir().unwrap();
    let worker = start_worker(0);
    let (model, _script) = model_server(artifact_script());
    let db = format!("sqlite://{}", dir.path().join("pm.db").display());
    let acme = stdio_client(dir.path(), &db, &model, &worker.addr, "acme").await;
    let id = session_to_a_verified_artifact(&acme).await;

    // Another tenant on the same datastore sees nothing of acme's.
    let globex = stdio_client(dir.path(), &db, &model, &worker.addr, "globex").await;
    let p = refused(&globex, "sessions.get", json!({ "session_id": id })).await;
    assert_eq!(p["type"], "urn:cynodeai:error:not_found", "{p}");
    let s = call(&acme, "sessions.get", json!({ "session_id": id })).await;
    let sha = s["artifacts"][0]["sha256"].as_str().unwrap().to_string();
    let p = refused(
        &globex,
        "artifacts.get",
        json!({ "session_id": id, "sha256": sha }),
    )
    .await;
    assert_eq!(p["type"], "urn:cynodeai:error:not_found", "{p}");
    globex.cancel().await.unwrap();
    acme.cancel().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_over_http_in_serve_behind_the_api_tokens() {
    cynode_tls::install_provider();
    let dir = cynode_tests::tempdir().unwrap();
    let worker = start_worker(0);
    let (model, _script) = model_server(artifact_script());
    let db = format!("sqlite://{}", dir.path().join("pm.db").display());
    let endpoint = format!("http://{}", worker.addr);
    let r = start_replica_with(
        dir.path(),
        "r1",
        &db,
        &model,
        &["--worker-endpoint", &endpoint],
        &[],
    );
    let url = format!("{}/v1/mcp", r.base);

    // No token, a wrong token: 401 problem+json before any MCP handling.
    let init = json!({ "jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {} });
    for token in [None, Some("wrong-token-0123456789")] {
        let mut req = reqwest::Client::new()
            .post(&url)
            .header("accept", "application/json, text/event-stream")
            .json(&init);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401, "{token:?}");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["type"], "urn:cynodeai:error:authentication");
    }

    let client = |token: &str| {
        let url = url.clone();
        let token = token.to_string();
        async move {
            let transport = StreamableHttpClientTransport::from_config(
                StreamableHttpClientTransportConfig::with_uri(url).auth_header(token),
            );
            tokio::time::timeout(Duration::from_secs(30), ().serve(transport))
                .await
                .unwrap()
                .unwrap()
        }
    };
    let a = client(TENANT_A).await;
    let id = session_to_a_verified_artifact(&a).await;
    // `skills.run` runs on this machine's paths: not offered over HTTP, refused by name.
    let listed = a.list_all_tools().await.unwrap();
    assert!(!listed.iter().any(|t| t.name == "skills.run"));
    let (code, _) = protocol_error(&a, "skills.run", json!({ "skill_id": "write-files" })).await;
    assert_eq!(code, ErrorCode::INVALID_PARAMS);
    let report = call(&a, "sessions.report", json!({ "session_id": id })).await;
    assert_eq!(report["status"], "completed", "{report}");
    assert!(
        report["text"].as_str().unwrap().contains("README.md"),
        "{report}"
    );
    // A sandbox through the tools: a file written and read without an exec, a command,
    // a streamed command's output, suspend and resume with the workspace kept.
    let sb = call(&a, "sandbox.create", json!({})).await;
    let sid = sb["session_id"].as_str().unwrap().to_string();
    call(
        &a,
        "sandbox.file_write",
        json!({ "sandbox_id": sid, "path": "n.txt", "content": "via mcp\n" }),
    )
    .await;
    let read = call(
        &a,
        "sandbox.file_read",
        json!({ "sandbox_id": sid, "path": "n.txt" }),
    )
    .await;
    assert_eq!(
        base64::engine::general_purpose::STANDARD
            .decode(read["content_base64"].as_str().unwrap())
            .unwrap(),
        b"via mcp\n"
    );
    let ran = call(
        &a,
        "sandbox.exec",
        json!({ "sandbox_id": sid, "command": ["cat", "n.txt"] }),
    )
    .await;
    assert_eq!(ran["stdout"], "via mcp\n", "{ran}");
    let started = call(
        &a,
        "sandbox.exec",
        json!({ "sandbox_id": sid, "command": ["sh", "-c", "echo one; echo two"], "stream": true }),
    )
    .await;
    let eid = started["exec_id"].as_str().unwrap();
    let out = call(
        &a,
        "sandbox.exec_output",
        json!({ "sandbox_id": sid, "exec_id": eid, "wait_seconds": 20 }),
    )
    .await;
    assert_eq!(out["ended"], true, "{out}");
    assert_eq!(out["stdout_offset"], 8, "{out}");
    let suspended = call(&a, "sandbox.suspend", json!({ "sandbox_id": sid })).await;
    assert_eq!(suspended["status"], "suspended", "{suspended}");
    call(&a, "sandbox.resume", json!({ "sandbox_id": sid })).await;
    let listed = call(
        &a,
        "sandbox.files",
        json!({ "sandbox_id": sid, "path": "." }),
    )
    .await;
    assert!(listed.to_string().contains("n.txt"), "{listed}");
    let b = client(crate::service::TENANT_B).await;
    let p = refused(&b, "sandbox.get", json!({ "sandbox_id": sid })).await;
    assert_eq!(p["type"], "urn:cynodeai:error:not_found", "{p}");
    let p = refused(
        &b,
        "sandbox.file_read",
        json!({ "sandbox_id": sid, "path": "n.txt" }),
    )
    .await;
    assert_eq!(p["type"], "urn:cynodeai:error:not_found", "{p}");
    call(&a, "sandbox.end", json!({ "sandbox_id": sid })).await;
    let p = refused(&b, "sessions.get", json!({ "session_id": id })).await;
    assert_eq!(p["type"], "urn:cynodeai:error:not_found", "{p}");
    a.cancel().await.unwrap();
    b.cancel().await.unwrap();
}

/// The sandbox gateway at `/v1/gateway` of `serve` admits only live job tokens: none, a
/// forged one and an API token are refused (401, the reason naming no token), 1,000 such
/// calls in a loop leave the service answering, and the forged token is in no log line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_refuses_absent_forged_and_api_tokens() {
    let dir = cynode_tests::tempdir().unwrap();
    let worker = start_worker(0);
    let (model, _script) = model_server(vec![]);
    let db = format!("sqlite://{}", dir.path().join("pm.db").display());
    let endpoint = format!("http://{}", worker.addr);
    let r = start_replica_with(
        dir.path(),
        "g1",
        &db,
        &model,
        &["--worker-endpoint", &endpoint],
        &[],
    );
    let url = format!("{}/v1/gateway", r.base);
    let forged = format!("cgw_{}", "7".repeat(64));
    let body = json!({ "jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": { "name": "artifact.list", "arguments": {} } });
    let http = reqwest::Client::new();
    let post = |token: Option<&str>| {
        let mut req = http
            .post(&url)
            .header("accept", "application/json, text/event-stream")
            .timeout(Duration::from_secs(10))
            .json(&body);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send()
    };
    for (token, reason) in [
        (None, "a valid bearer token is required"),
        (Some(forged.as_str()), "unknown or revoked gateway token"),
        (Some(TENANT_A), "unknown or revoked gateway token"),
    ] {
        let resp = post(token).await.unwrap();
        assert_eq!(resp.status(), 401, "{token:?}");
        let p: Value = resp.json().await.unwrap();
        assert_eq!(p["type"], "urn:cynodeai:error:authentication");
        assert!(p["detail"].as_str().unwrap().contains(reason), "{p}");
    }
    let t = Instant::now();
    for _ in 0..1000 {
        assert_eq!(post(Some(forged.as_str())).await.unwrap().status(), 401);
    }
    let loop_time = t.elapsed();
    // Still answering the API (and MCP) after the loop.
    let (s, _) = crate::service::call(
        reqwest::Method::GET,
        &format!("{}/v1/skills", r.base),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!(s, 200);
    eprintln!("1000 refused gateway calls in {loop_time:?}");
    drop(r);
    let log = std::fs::read_to_string(dir.path().join("g1.log")).unwrap();
    assert!(!log.contains(&forged[4..]), "a token reached the log");
}

/// `cynode-pm mcp` with no worker flags starts its own local worker (bwrap on the test
/// image), offers `sessions.report` and `skills.run`, runs a built-in skill on a copy of
/// a workspace to a verified artifact, and stops the worker when the client closes stdin:
/// the worker's process is gone and nothing is left mounted (the temporary directory's
/// drop checks that).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_stdio_without_worker_flags_runs_a_skill_on_its_own_local_worker() {
    let dir = cynode_tests::tempdir().unwrap();
    let project = dir.path().join("project");
    std::fs::create_dir_all(&project).unwrap();
    std::fs::write(project.join("README.md"), README).unwrap();
    let (model, _script) = model_server(vec![]);
    let state = dir.path().join("state");
    let log = std::fs::File::create(dir.path().join("mcp-local.log")).unwrap();
    let mut cmd = tokio::process::Command::new(cynode_tests::bin("cynode-pm"));
    cmd.arg("mcp")
        .args(["--local-backend", "bwrap", "--local-bwrap-rootfs"])
        .arg(cynode_tests::rootfs())
        .arg("--workspace-root")
        .arg(&project)
        .args(["--model-base-url", &model])
        .arg("--state-dir")
        .arg(&state)
        .env_remove("CYNODE_WORKER_ENDPOINT")
        .env_remove("CYNODE_WORKERS_FILE")
        .env("CYNODE_LOCAL_WORKER_GRACE_SECONDS", "30")
        .current_dir(workspace_root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .kill_on_drop(true);
    let mut child = cmd.spawn().unwrap();
    let stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let c = tokio::time::timeout(Duration::from_secs(90), ().serve((stdout, stdin)))
        .await
        .expect("cynode-pm mcp did not initialize within 90 s")
        .unwrap();
    let tools: Vec<String> = c
        .list_all_tools()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name.to_string())
        .collect();
    for t in ["sessions.create", "sessions.report", "skills.run"] {
        assert!(tools.iter().any(|n| n == t), "{t} missing: {tools:?}");
    }
    let keeper: Value = serde_json::from_str(
        &std::fs::read_to_string(state.join("worker").join("keeper.json")).unwrap(),
    )
    .unwrap();
    let worker_pid = keeper["worker_pid"].as_u64().unwrap();

    let ran = call(
        &c,
        "skills.run",
        json!({ "skill_id": "repo-inspect", "inputs": { "files": ["README.md"] },
                "workspace": project.display().to_string() }),
    )
    .await;
    assert_eq!(ran["ok"], true, "{ran}");
    assert_eq!(ran["job"]["status"], "completed", "{ran}");
    let art = ran["job"]["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["path"] == "README.md")
        .unwrap_or_else(|| panic!("no README.md artifact: {ran}"))
        .clone();
    let stored = std::fs::read(art["location"].as_str().unwrap()).unwrap();
    assert_eq!(stored, README.as_bytes());
    assert_eq!(
        art["sha256"].as_str().unwrap(),
        hex::encode(Sha256::digest(README.as_bytes()))
    );
    // Bad inputs: a failed run, named; a relative workspace: a protocol error.
    let bad = refused(
        &c,
        "skills.run",
        json!({ "skill_id": "repo-inspect", "inputs": { "nope": 1 } }),
    )
    .await;
    assert_eq!(bad["error"]["kind"], "invalid_inputs", "{bad}");
    let (code, _) = protocol_error(
        &c,
        "skills.run",
        json!({ "skill_id": "repo-inspect", "inputs": {}, "workspace": "project" }),
    )
    .await;
    assert_eq!(code, ErrorCode::INVALID_PARAMS);
    let p = refused(&c, "sessions.report", json!({ "session_id": "s-missing" })).await;
    assert_eq!(p["type"], "urn:cynodeai:error:not_found", "{p}");

    // The client goes away (stdin closed): the server stops its worker and exits.
    drop(c);
    let status = tokio::time::timeout(Duration::from_secs(90), child.wait())
        .await
        .expect("cynode-pm mcp did not exit within 90 s of stdin closing")
        .unwrap();
    assert!(status.success(), "{status:?}");
    let proc_dir = std::path::PathBuf::from(format!("/proc/{worker_pid}"));
    let t = Instant::now();
    while proc_dir.exists() && t.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        !proc_dir.exists(),
        "the local worker {worker_pid} outlived cynode-pm mcp"
    );
}
