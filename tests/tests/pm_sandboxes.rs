//! The sandbox API of `cynode-pm serve` (`/v1/sandboxes…`) as a real process, with a real
//! bwrap worker: a tenant creates a sandbox, writes and reads files without an exec, runs
//! commands (plain and streamed, with stdin, its output reattached from an offset),
//! suspends and resumes it with its workspace kept, snapshots and forks it (the fork
//! independent); another tenant gets "not found" for every one of those ids and calls,
//! path attacks are refused by the worker's beneath-safe file code and handed on as 400,
//! and the tenant's policy is checked before anything is placed. The round trip runs on
//! SQLite and on PostgreSQL (the ownership records).

use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{json, Value};

use crate::service::{call, start_replica_with, Replica, TENANT_A, TENANT_B};
use cynode_tests::{model_server, start_worker, Worker};

/// A replica on `db` (SQLite in `dir` when `None`) with one bwrap worker; `extra` are
/// more `serve` flags.
fn replica(dir: &Path, db: Option<&str>, worker: &Worker, extra: &[&str]) -> Replica {
    let (model, _) = model_server(vec![]);
    let db = db.map_or_else(
        || format!("sqlite://{}", dir.join("pm.db").display()),
        str::to_string,
    );
    let endpoint = format!("http://{}", worker.addr);
    start_replica_with(
        dir,
        "r1",
        &db,
        &model,
        &["--worker-endpoint", &endpoint],
        extra,
    )
}

async fn api(
    method: reqwest::Method,
    r: &Replica,
    path: &str,
    token: &str,
    body: Option<Value>,
) -> (u16, Value) {
    call(method, &format!("{}{path}", r.base), token, body).await
}

/// A raw call (bytes in, bytes out) for the files and stdin routes.
async fn raw(
    method: reqwest::Method,
    r: &Replica,
    path: &str,
    token: &str,
    body: &[u8],
) -> (u16, Vec<u8>) {
    let resp = reqwest::Client::new()
        .request(method, format!("{}{path}", r.base))
        .bearer_auth(token)
        .header("content-type", "application/octet-stream")
        .body(body.to_vec())
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    // What a sandbox wrote is never served as something to sniff and run.
    if resp.status().is_success() {
        assert_eq!(resp.headers()["x-content-type-options"], "nosniff");
    }
    (status, resp.bytes().await.unwrap().to_vec())
}

fn exec_body(cmd: &str) -> Value {
    json!({ "version": 1, "command": ["sh", "-c", cmd] })
}

/// The stdout of the exec `cmd` in sandbox `id` (as tenant A).
async fn run(r: &Replica, id: &str, cmd: &str) -> String {
    let (code, v) = api(
        reqwest::Method::POST,
        r,
        &format!("/v1/sandboxes/{id}/exec"),
        TENANT_A,
        Some(exec_body(cmd)),
    )
    .await;
    assert_eq!(code, 200, "{v}");
    v["stdout"].as_str().unwrap_or_default().to_string()
}

/// The SSE output of exec `eid` from `query`: the stdout it carried and the event names.
async fn output(r: &Replica, id: &str, eid: &str, query: &str) -> (String, Vec<String>) {
    let mut resp = reqwest::Client::new()
        .get(format!(
            "{}/v1/sandboxes/{id}/execs/{eid}/output{query}",
            r.base
        ))
        .bearer_auth(TENANT_A)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let (mut text, mut stdout, mut kinds) = (String::new(), Vec::new(), Vec::new());
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Ok(Ok(Some(c))) = tokio::time::timeout_at(deadline.into(), resp.chunk()).await {
        text.push_str(&String::from_utf8_lossy(&c));
    }
    for block in text.split("\n\n") {
        let kind = block
            .lines()
            .find_map(|l| l.strip_prefix("event: "))
            .unwrap_or("");
        let data = block
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .unwrap_or("null");
        if kind.is_empty() {
            continue;
        }
        kinds.push(kind.to_string());
        if kind == "stdout" {
            let d: Value = serde_json::from_str(data).unwrap();
            stdout.extend(
                base64::engine::general_purpose::STANDARD
                    .decode(d["data"].as_str().unwrap())
                    .unwrap(),
            );
        }
    }
    (String::from_utf8_lossy(&stdout).into_owned(), kinds)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_through_the_pm_keep_their_workspace_and_stay_their_tenants() {
    sandbox_round_trip(None).await;
}

/// The same on PostgreSQL (the ownership records in its migration).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_through_the_pm_on_postgres() {
    sandbox_round_trip(Some(&crate::service::fresh_postgres().await)).await;
}

async fn sandbox_round_trip(db: Option<&str>) {
    use reqwest::Method;
    let dir = cynode_tests::tempdir().unwrap();
    let worker = start_worker(0);
    let r = replica(dir.path(), db, &worker, &[]);

    let (code, v) = api(Method::POST, &r, "/v1/sandboxes", TENANT_A, Some(json!({}))).await;
    assert!((200..300).contains(&code), "{v}");
    let id = v["session_id"].as_str().unwrap().to_string();
    assert!(id.starts_with("sb-") && id.len() > 30, "{id}");
    assert!(!v["task_id"].as_str().unwrap().contains("acme"), "{v}");

    // Files without an exec.
    let (code, body) = raw(
        Method::PUT,
        &r,
        &format!("/v1/sandboxes/{id}/files?path=notes.txt"),
        TENANT_A,
        b"hello\n",
    )
    .await;
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    let (code, body) = raw(
        Method::GET,
        &r,
        &format!("/v1/sandboxes/{id}/files?path=notes.txt"),
        TENANT_A,
        b"",
    )
    .await;
    assert_eq!((code, body.as_slice()), (200, b"hello\n".as_slice()));
    let (code, v) = api(
        Method::GET,
        &r,
        &format!("/v1/sandboxes/{id}/files?path=.&list=true"),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!(code, 200, "{v}");
    assert!(v.to_string().contains("notes.txt"), "{v}");
    assert_eq!(run(&r, &id, "cat notes.txt").await, "hello\n");
    // Path attacks reach the worker's beneath-safe code and come back as 400; nothing is
    // written.
    for path in ["../escape.txt", "/etc/passwd", "a%00b", "..%2F..%2Fx"] {
        let (code, body) = raw(
            Method::PUT,
            &r,
            &format!("/v1/sandboxes/{id}/files?path={path}"),
            TENANT_A,
            b"x",
        )
        .await;
        assert_eq!(code, 400, "{path}: {}", String::from_utf8_lossy(&body));
    }
    let (_, v) = api(
        Method::GET,
        &r,
        &format!("/v1/sandboxes/{id}/files?path=.&list=true"),
        TENANT_A,
        None,
    )
    .await;
    let names: Vec<&str> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert_eq!(names, ["notes.txt"], "{v}");
    let (code, v) = api(
        Method::GET,
        &r,
        &format!("/v1/sandboxes/{id}/files?path=x&mode=raw"),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!(code, 400, "{v}");
    assert!(v["detail"].as_str().unwrap().contains("`mode`"), "{v}");

    // Another tenant: every id and call is "not found", and its list is empty.
    let b_calls: Vec<(Method, String, Option<Value>)> = vec![
        (Method::GET, format!("/v1/sandboxes/{id}"), None),
        (
            Method::POST,
            format!("/v1/sandboxes/{id}/exec"),
            Some(exec_body("cat notes.txt")),
        ),
        (
            Method::GET,
            format!("/v1/sandboxes/{id}/files?path=notes.txt"),
            None,
        ),
        (Method::POST, format!("/v1/sandboxes/{id}:suspend"), None),
        (Method::POST, format!("/v1/sandboxes/{id}:end"), None),
        (Method::POST, format!("/v1/sandboxes/{id}/snapshots"), None),
        (Method::GET, format!("/v1/sandboxes/{id}/snapshots"), None),
    ];
    for (m, path, body) in &b_calls {
        let (code, v) = api(m.clone(), &r, path, TENANT_B, body.clone()).await;
        assert_eq!(code, 404, "{m} {path}: {v}");
        assert_eq!(v["type"], "urn:cynodeai:error:not_found", "{v}");
    }
    let (code, _) = raw(
        Method::PUT,
        &r,
        &format!("/v1/sandboxes/{id}/files?path=notes.txt"),
        TENANT_B,
        b"B was here",
    )
    .await;
    assert_eq!(code, 404);
    let (_, v) = api(Method::GET, &r, "/v1/sandboxes", TENANT_B, None).await;
    assert_eq!(v["sandboxes"], json!([]), "{v}");
    let (_, v) = api(Method::GET, &r, "/v1/sandboxes", TENANT_A, None).await;
    assert_eq!(v["sandboxes"][0]["sandbox_id"], id.as_str(), "{v}");

    // Suspend and resume: the workspace is kept.
    let (code, v) = api(
        Method::POST,
        &r,
        &format!("/v1/sandboxes/{id}:suspend"),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!(
        (code, v["status"].as_str()),
        (200, Some("suspended")),
        "{v}"
    );
    let (code, v) = api(
        Method::POST,
        &r,
        &format!("/v1/sandboxes/{id}/exec"),
        TENANT_A,
        Some(exec_body("true")),
    )
    .await;
    assert_eq!(code, 409, "{v}");
    let (code, v) = api(
        Method::POST,
        &r,
        &format!("/v1/sandboxes/{id}:resume"),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!((code, v["status"].as_str()), (200, Some("running")), "{v}");
    assert_eq!(run(&r, &id, "cat notes.txt").await, "hello\n");

    // A snapshot is the tenant's: the other tenant can neither fork nor delete it.
    let (code, snap) = api(
        Method::POST,
        &r,
        &format!("/v1/sandboxes/{id}/snapshots"),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!(code, 201, "{snap}");
    let sid = snap["snapshot_id"].as_str().unwrap().to_string();
    let (code, v) = api(
        Method::POST,
        &r,
        "/v1/sandboxes",
        TENANT_B,
        Some(json!({ "from_snapshot": sid })),
    )
    .await;
    assert_eq!(code, 404, "{v}");
    let (code, v) = api(
        Method::DELETE,
        &r,
        &format!("/v1/snapshots/{sid}"),
        TENANT_B,
        None,
    )
    .await;
    assert_eq!(code, 404, "{v}");
    let (code, v) = api(
        Method::POST,
        &r,
        "/v1/sandboxes",
        TENANT_A,
        Some(json!({ "from_snapshot": "snap-00000000-0000-4000-8000-000000000000" })),
    )
    .await;
    assert_eq!(code, 404, "{v}");

    // A fork has the snapshot's workspace, and the two are independent.
    let (code, v) = api(
        Method::POST,
        &r,
        "/v1/sandboxes",
        TENANT_A,
        Some(json!({ "from_snapshot": sid })),
    )
    .await;
    assert!((200..300).contains(&code), "{v}");
    let fork = v["session_id"].as_str().unwrap().to_string();
    assert_ne!(fork, id);
    assert_eq!(run(&r, &fork, "cat notes.txt").await, "hello\n");
    run(&r, &fork, "echo forked > notes.txt").await;
    assert_eq!(run(&r, &id, "cat notes.txt").await, "hello\n");
    assert_eq!(run(&r, &fork, "cat notes.txt").await, "forked\n");
    let (code, v) = api(
        Method::GET,
        &r,
        &format!("/v1/sandboxes/{id}/snapshots"),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!(code, 200, "{v}");
    assert!(v.to_string().contains(&sid), "{v}");

    // A streamed exec with stdin; its output read, then read again from an offset.
    let body = json!({ "version": 1, "command": ["sh", "-c", "read x; echo got $x"], "stream": true, "stdin": true });
    let (code, v) = api(
        Method::POST,
        &r,
        &format!("/v1/sandboxes/{id}/exec"),
        TENANT_A,
        Some(body),
    )
    .await;
    assert_eq!(code, 202, "{v}");
    let eid = v["exec_id"].as_str().unwrap().to_string();
    let (code, body) = raw(
        Method::POST,
        &r,
        &format!("/v1/sandboxes/{id}/execs/{eid}/stdin?close=true"),
        TENANT_A,
        b"hi\n",
    )
    .await;
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    let (code, v) = api(
        Method::GET,
        &r,
        &format!("/v1/sandboxes/{id}/execs/{eid}?wait=true"),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!(code, 200, "{v}");
    let (out, kinds) = output(&r, &id, &eid, "").await;
    assert_eq!(out, "got hi\n");
    assert_eq!(kinds.last().map(String::as_str), Some("exit"), "{kinds:?}");
    let (out, _) = output(&r, &id, &eid, "?stdout_offset=4").await;
    assert_eq!(out, "hi\n");
    let (code, _) = api(
        Method::GET,
        &r,
        &format!("/v1/sandboxes/{id}/execs/{eid}/output"),
        TENANT_B,
        None,
    )
    .await;
    assert_eq!(code, 404);

    // Deleting the snapshot, then ending both.
    let (code, v) = api(
        Method::DELETE,
        &r,
        &format!("/v1/snapshots/{sid}"),
        TENANT_A,
        None,
    )
    .await;
    assert!((200..300).contains(&code), "{v}");
    let (code, _) = api(
        Method::DELETE,
        &r,
        &format!("/v1/snapshots/{sid}"),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!(code, 404);
    for s in [&id, &fork] {
        let (code, v) = api(
            Method::POST,
            &r,
            &format!("/v1/sandboxes/{s}:end"),
            TENANT_A,
            None,
        )
        .await;
        assert_eq!((code, v["status"].as_str()), (200, Some("ended")), "{v}");
    }
}

/// The tenant's policy is checked before any sandbox is placed: a purpose, network or
/// lifetime it does not allow is refused naming the field, and nothing is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenants_policy_is_checked_before_a_sandbox_is_placed() {
    use reqwest::Method;
    let dir = cynode_tests::tempdir().unwrap();
    let tenant = dir.path().join("tenant.yaml");
    std::fs::write(&tenant, "allowed_purposes: [base-tools]\nmax_runtime_seconds: 100\nallowed_images: [\"localhost/cynode-*\"]\n").unwrap();
    let worker = start_worker(0);
    let tenant_arg = tenant.display().to_string();
    let r = replica(dir.path(), None, &worker, &["--tenant", &tenant_arg]);
    let refusals = [
        (json!({ "purpose": "go-tools" }), 403, "purpose"),
        (
            json!({ "network_policy": "restricted" }),
            403,
            "network_policy",
        ),
        (json!({ "network_policy": "allow" }), 400, "network_policy"),
        (
            json!({ "egress_allow": ["example.com"] }),
            400,
            "egress_allow",
        ),
        (
            json!({ "max_lifetime_seconds": 101 }),
            400,
            "max_lifetime_seconds",
        ),
        (json!({ "image": "docker.io/evil" }), 400, "image"),
    ];
    for (body, want, field) in refusals {
        let (code, v) = api(
            Method::POST,
            &r,
            "/v1/sandboxes",
            TENANT_A,
            Some(body.clone()),
        )
        .await;
        assert_eq!(code, want, "{body}: {v}");
        assert!(
            v["detail"].as_str().unwrap_or_default().contains(field),
            "{body}: {v}"
        );
    }
    // A create the worker refuses (an env name with `=`) leaves no sandbox either.
    let (code, v) = api(
        Method::POST,
        &r,
        "/v1/sandboxes",
        TENANT_A,
        Some(json!({ "env": { "A=B": "x" } })),
    )
    .await;
    assert_eq!(code, 400, "{v}");
    let (_, v) = api(Method::GET, &r, "/v1/sandboxes", TENANT_A, None).await;
    assert_eq!(v["sandboxes"], json!([]), "{v}");
    // Within the policy: created, with the tenant's ceiling as its lifetime.
    let (code, v) = api(
        Method::POST,
        &r,
        "/v1/sandboxes",
        TENANT_A,
        Some(json!({ "max_lifetime_seconds": 100 })),
    )
    .await;
    assert!((200..300).contains(&code), "{v}");
    let id = v["session_id"].as_str().unwrap().to_string();
    let (code, v) = api(
        Method::POST,
        &r,
        &format!("/v1/sandboxes/{id}:end"),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!(code, 200, "{v}");
}
