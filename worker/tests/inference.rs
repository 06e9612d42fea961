//! The per-job inference proxy on the real worker: a recording upstream in this process,
//! the proxy socket poked from the host while a job runs, a real SBA agent job in a
//! bubblewrap sandbox, and an end-to-end run against the local llama-server.

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::harness::{assert_field_starts, env, unique, Server};

const KEY: &str = "sk-upstream-secret-7f3a9c";

/// What the upstream saw of one request.
#[derive(Debug, Clone)]
struct Hit {
    path: String,
    auth: Option<String>,
    body: Value,
}

#[derive(Clone, Default)]
struct Upstream {
    hits: Arc<Mutex<Vec<Hit>>>,
    script: Arc<Mutex<Vec<Value>>>,
}

/// OpenAI's exact completion shape (testkit's), with usage figures the tests look for.
fn completion(content: &str) -> Value {
    let mut c = cynode_testkit::scripted_model::completion(content);
    c["usage"] = json!({ "prompt_tokens": 321, "completion_tokens": 12, "total_tokens": 333 });
    c
}

async fn up_models(State(u): State<Upstream>, h: HeaderMap) -> Json<Value> {
    u.hits.lock().unwrap().push(Hit {
        path: "/v1/models".into(),
        auth: h
            .get("authorization")
            .map(|v| v.to_str().unwrap().to_string()),
        body: Value::Null,
    });
    Json(json!({
        "object": "list",
        "data": [{ "id": "m1" }, { "id": "m2" }, { "id": "m3" }],
        "models": [{ "name": "m1", "model": "m1" }, { "name": "m3", "model": "m3" }]
    }))
}

async fn up_chat(State(u): State<Upstream>, h: HeaderMap, Json(body): Json<Value>) -> Json<Value> {
    u.hits.lock().unwrap().push(Hit {
        path: "/v1/chat/completions".into(),
        auth: h
            .get("authorization")
            .map(|v| v.to_str().unwrap().to_string()),
        body: body.clone(),
    });
    if body["messages"][0]["content"] == "big" {
        return Json(completion(&"x".repeat(200_000)));
    }
    let next = u.script.lock().unwrap().pop();
    Json(completion(
        &next.map_or_else(|| "ok".to_string(), |v| v.to_string()),
    ))
}

/// Starts the recording upstream; `script` are action replies, in order.
async fn upstream(script: Vec<Value>) -> (String, Upstream) {
    let u = Upstream::default();
    *u.script.lock().unwrap() = script.into_iter().rev().collect();
    let app = Router::new()
        .route("/v1/models", get(up_models))
        .route("/v1/chat/completions", post(up_chat))
        .route("/api/tags", get(up_models))
        .route("/api/chat", post(up_chat))
        .with_state(u.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move {
        axum::serve(l, app).await.unwrap();
    });
    (url, u)
}

/// The recording upstream over HTTPS only, with a certificate from `ca`.
async fn https_upstream(dir: &Path, ca: &cynode_testkit::TestCa) -> (String, Upstream) {
    let u = Upstream::default();
    let app = Router::new()
        .route("/v1/models", get(up_models))
        .route("/v1/chat/completions", post(up_chat))
        .with_state(u.clone());
    let cert = ca.server(dir, "upstream");
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("https://127.0.0.1:{}", l.local_addr().unwrap().port());
    let tls = cynode_tls::ServerTls {
        cert_file: cert.cert_file,
        key_file: cert.key_file,
        client_ca_file: None,
    };
    tokio::spawn(cynode_tls::serve(l, app, Some(tls), std::future::pending()));
    (url, u)
}

/// A bwrap worker whose inference upstream is `url`, with the key in a file.
fn worker(url: &str, extra: &str) -> Server {
    worker_on("bwrap", url, extra)
}

fn worker_on(backend: &'static str, url: &str, extra: &str) -> Server {
    let keydir = tempfile::tempdir().unwrap();
    let keyfile = keydir.path().join("key");
    std::fs::write(&keyfile, format!("{KEY}\n")).unwrap();
    let mut sv = Server::start(
        backend,
        &format!(
            "inference:\n  base_url: {url}/v1\n  api_key_file: {}\n{extra}",
            keyfile.display()
        ),
    );
    // The key's directory goes when the server does.
    sv.owned.push(keydir);
    sv
}

/// One HTTP/1.1 exchange over a Unix socket, as the SBA does it.
fn unix_http(sock: &Path, method: &str, path: &str, body: Option<&[u8]>) -> (u16, Value) {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let body = body.unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(body).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out);
    let (status, body) = crate::harness::status_and_body(&text);
    (
        status,
        serde_json::from_str(body).unwrap_or(Value::String(body.into())),
    )
}

/// `POST /v1/chat/completions` with `body` on the proxy socket.
fn post_chat(sock: &Path, body: &[u8]) -> (u16, Value) {
    unix_http(sock, "POST", "/v1/chat/completions", Some(body))
}

fn chat_body(model: &str, first: &str) -> Vec<u8> {
    serde_json::to_vec(
        &json!({ "model": model, "messages": [{ "role": "user", "content": first }] }),
    )
    .unwrap()
}

fn socket_of(sv: &Server, job_id: &str) -> PathBuf {
    sv.state_dir()
        .join("jobs")
        .join(job_id)
        .join("job/inference.sock")
}

async fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) {
    let until = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < until, "condition not reached");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every file under `dir`, read as text.
fn all_text(dir: &Path) -> String {
    let mut out = String::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() {
                out.push_str(&String::from_utf8_lossy(
                    &std::fs::read(e.path()).unwrap_or_default(),
                ));
            }
        }
    }
    out
}

fn log_text(sv: &Server) -> String {
    sv.log.lock().unwrap().join("\n")
}

/// The worker's hop to its inference upstream over real TLS: an upstream that speaks only
/// HTTPS, trusted through `inference.tls.ca_file`; without that CA the proxy gets no answer
/// from it and the upstream sees nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_reaches_an_https_only_upstream_it_trusts() {
    env();
    let dir = tempfile::tempdir().unwrap();
    let ca = cynode_testkit::TestCa::new(dir.path(), "upstream");
    let (url, up) = https_upstream(dir.path(), &ca).await;
    for (trusted, extra) in [
        (
            true,
            format!("  tls:\n    ca_file: {}\n", ca.cert_file.display()),
        ),
        (false, String::new()),
    ] {
        let sv = worker(&url, &format!("  models: [m1]\n{extra}"));
        let id = unique("tls");
        let body = json!({
            "version": 1, "task_id": "t", "job_id": id,
            "sandbox": { "image": env().image, "command": ["sleep", "60"], "use_inference": true }
        });
        let (code, _) = sv.post("/v1/worker/jobs", &body).await;
        assert_eq!(code, 202);
        let sock = socket_of(&sv, &id);
        wait_until(Duration::from_secs(30), || sock.exists()).await;
        let before = up.hits.lock().unwrap().len();
        let (code, v) = post_chat(&sock, &chat_body("m1", "hi"));
        let hits = up.hits.lock().unwrap().len() - before;
        if trusted {
            assert_eq!((code, hits), (200, 1), "{v}");
            assert_eq!(v["choices"][0]["message"]["content"], "ok");
        } else {
            assert!(code >= 500, "an untrusted upstream answered: {code} {v}");
            assert_eq!(
                hits, 0,
                "the request reached an upstream the node does not trust"
            );
        }
        let _ = sv
            .post(&format!("/v1/worker/jobs/{id}:stop"), &json!({}))
            .await;
    }
}

/// Upstream's worker_inference_proxy scenarios "Inference proxy rejects request body
/// exceeding size limit" and "Inference proxy listens on Unix domain socket": every call
/// here goes over the job's Unix socket, and the proxy also refuses other models and paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(non_snake_case)]
async fn worker_inference_proxy__listens_on_a_unix_socket_and_rejects_oversized_bodies_foreign_models_and_paths(
) {
    env();
    let (url, up) = upstream(vec![]).await;
    let sv = worker(
        &url,
        "  models: [m1, m2]\n  max_request_bytes: 4096\n  max_response_bytes: 65536\n",
    );
    let id = unique("inf");
    let body = json!({
        "version": 1, "task_id": "t", "job_id": id,
        "sandbox": { "image": env().image, "command": ["sleep", "60"], "use_inference": true,
                     "env": { "INFERENCE_PROXY_URL": "http://evil" } }
    });
    let (code, _) = sv.post("/v1/worker/jobs", &body).await;
    assert_eq!(code, 202);
    let sock = socket_of(&sv, &id);
    wait_until(Duration::from_secs(30), || sock.exists()).await;
    let meta = std::fs::metadata(&sock).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o600);
    // The socket belongs to the workspace's own host uid (task `t`'s workspace).
    let ws_uid = std::fs::metadata(sv.state_dir().join("workspaces").join("t"))
        .unwrap()
        .uid();
    assert_eq!(meta.uid(), ws_uid);
    assert_ne!(ws_uid, 1000, "the shared uid 1000");

    // A model outside the job's list: 403 with a JSON error, nothing sent upstream.
    let (code, v) = post_chat(&sock, &chat_body("m3", "hi"));
    assert_eq!(code, 403);
    assert_eq!(v["error"]["type"], "model_not_allowed");
    assert_eq!(
        v["error"]["message"],
        "model `m3` is not allowed for this job (allowed: m1, m2)"
    );
    assert!(up.hits.lock().unwrap().is_empty());

    // An allowed model goes through, with the key added on the upstream request only.
    let (code, v) = post_chat(&sock, &chat_body("m1", "hi"));
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "ok");
    let hit = up.hits.lock().unwrap().last().cloned().unwrap();
    assert_eq!(hit.auth.as_deref(), Some(format!("Bearer {KEY}").as_str()));
    assert_eq!(
        hit.body,
        serde_json::from_slice::<Value>(&chat_body("m1", "hi")).unwrap()
    );

    // The model list is cut to the allowed models, in both list shapes.
    let (code, v) = unix_http(&sock, "GET", "/v1/models", None);
    assert_eq!(code, 200);
    assert_eq!(v["data"], json!([{ "id": "m1" }, { "id": "m2" }]));
    assert_eq!(v["models"], json!([{ "name": "m1", "model": "m1" }]));

    // Upstream CyNodeAI's extras: /healthz, and Ollama's native API translated to the
    // OpenAI-compatible upstream with the same checks (a model the job may not use is
    // refused; the upstream is never asked to stream).
    assert_eq!(
        unix_http(&sock, "GET", "/healthz", None),
        (200, json!("ok"))
    );
    let (code, v) = unix_http(&sock, "POST", "/api/chat", Some(&chat_body("m3", "hi")));
    assert_eq!(
        (code, v["error"]["type"].clone()),
        (403, json!("model_not_allowed"))
    );
    let (code, v) = unix_http(&sock, "POST", "/api/chat", Some(&chat_body("m1", "native")));
    assert_eq!(code, 200, "{v}");
    let hit = up.hits.lock().unwrap().last().cloned().unwrap();
    assert_eq!(
        (
            hit.body["messages"][0]["content"].clone(),
            hit.body["stream"].clone()
        ),
        (json!("native"), json!(false))
    );
    assert_eq!(hit.auth.as_deref(), Some(format!("Bearer {KEY}").as_str()));
    let (code, v) = unix_http(&sock, "GET", "/api/tags", None);
    let names: Vec<&str> = v["models"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["name"].as_str())
        .collect();
    assert_eq!((code, names), (200, vec!["m1", "m2"]));

    // Nothing else is served.
    assert_eq!(unix_http(&sock, "GET", "/v1/embeddings", None).0, 404);
    assert_eq!(
        unix_http(&sock, "POST", "/api/embeddings", Some(b"{}")).0,
        404
    );
    assert_eq!(unix_http(&sock, "GET", "/v1/chat/completions", None).0, 405);
    assert_eq!(unix_http(&sock, "POST", "/v1/models", Some(b"{}")).0, 405);

    // Size caps: a request over 4096 bytes, a response over 65536 bytes.
    let (code, v) = post_chat(&sock, &chat_body("m1", &"y".repeat(5000)));
    assert_eq!(code, 413);
    assert_eq!(v["error"]["type"], "request_too_large");
    let (code, v) = post_chat(&sock, &chat_body("m2", "big"));
    assert_eq!(code, 502);
    assert_eq!(v["error"]["type"], "response_too_large");
    let mut streaming: Value = serde_json::from_slice(&chat_body("m1", "hi")).unwrap();
    streaming["stream"] = true.into();
    let (code, _) = post_chat(&sock, &serde_json::to_vec(&streaming).unwrap());
    assert_eq!(code, 400);

    // The sandbox got the node's proxy URL, not the request's; the socket goes with the job.
    let request_json =
        std::fs::read_to_string(sv.state_dir().join("jobs").join(&id).join("request.json"))
            .unwrap();
    assert!(!request_json.contains(KEY));
    sv.post(&format!("/v1/worker/jobs/{id}:stop"), &json!({}))
        .await;
    sv.wait_terminal(&id).await;
    assert!(!sock.exists(), "the proxy socket outlived its job");

    let log = log_text(&sv);
    assert!(!log.contains(KEY), "the key reached the log");
    let usage: Vec<Value> = sv
        .log
        .lock()
        .unwrap()
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| {
            v["fields"]["message"] == "inference request"
                && v["fields"]["status"] == 200
                && v["fields"]["prompt_tokens"].is_u64()
        })
        .collect();
    // One line per completion that went through: the OpenAI route's and the native one's.
    assert_eq!(usage.len(), 2, "{log}");
    assert!(
        usage.iter().all(|u| u["fields"]["job_id"] == id.as_str()),
        "{log}"
    );
    assert_eq!(usage[0]["fields"]["prompt_tokens"], 321);
    assert_eq!(usage[0]["fields"]["completion_tokens"], 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_job_uses_the_proxy_and_never_sees_the_key() {
    agent_job_through_the_proxy("bwrap").await;
}

/// The same through Podman: the socket must be reachable by the container's uid 1000.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_job_uses_the_proxy_under_podman() {
    agent_job_through_the_proxy("podman").await;
}

async fn agent_job_through_the_proxy(backend: &'static str) {
    env();
    let act = |ty: &str, args: Value| json!({ "thought": "", "action": { "type": ty, "arguments": args } });
    let (url, up) = upstream(vec![
        act("run_command", json!({ "command": "env", "args": [] })),
        act(
            "write_file",
            json!({ "path": "hello.txt", "content": "hi" }),
        ),
        act(
            "finish",
            json!({ "status": "success", "final_answer": "wrote hello.txt" }),
        ),
    ])
    .await;
    let sv = worker_on(backend, &url, "");
    let id = unique("agent");
    let spec = json!({
        "protocol_version": "1.0", "job_id": id, "task_id": "t-agent",
        "execution_mode": "agent_inference",
        "inference": { "allowed_models": ["m2"] },
        "constraints": { "max_runtime_seconds": 60, "max_output_bytes": 65536 },
        "context": { "task_context": "create hello.txt containing hi" }
    });
    let body = json!({
        "version": 1, "task_id": "t-agent", "job_id": id,
        "sandbox": { "image": env().image, "job_spec_json": spec.to_string() }
    });
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["status"], "completed", "{v}");
    let result = &v["sba_result"];
    assert_eq!(result["final_answer"], "wrote hello.txt");
    assert_eq!(result["steps"][0]["type"], "run_command");
    let sandbox_env = result["steps"][0]["result"]["stdout"].as_str().unwrap();
    // Commands the model runs get the runner's explicit environment: not even the proxy URL.
    assert!(sandbox_env.contains("CYNODE_JOB_ID="), "{sandbox_env}");
    assert!(
        !sandbox_env.contains("INFERENCE_PROXY_URL"),
        "{sandbox_env}"
    );
    assert!(!sandbox_env.contains(KEY));
    assert_eq!(
        std::fs::read_to_string(sv.state_dir().join("workspaces/t-agent/hello.txt")).unwrap(),
        "hi"
    );

    // Every upstream request carried the key; none carried it in its body.
    let hits = up.hits.lock().unwrap().clone();
    let paths: Vec<&str> = hits.iter().map(|h| h.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/v1/models",
            "/v1/chat/completions",
            "/v1/chat/completions",
            "/v1/chat/completions"
        ]
    );
    for h in &hits {
        assert_eq!(h.auth.as_deref(), Some(format!("Bearer {KEY}").as_str()));
        assert!(!h.body.to_string().contains(KEY));
        if h.path == "/v1/chat/completions" {
            assert_eq!(h.body["model"], "m2");
        }
    }
    // The second request carries the sandbox's `env` output: no key there either.
    assert!(hits[2].body.to_string().contains("CYNODE_JOB_ID="));

    // No file the sandbox could see, and no log line, holds the key.
    let job_dir = sv.state_dir().join("jobs").join(&id);
    assert!(!all_text(&job_dir).contains(KEY));
    assert!(!all_text(&sv.state_dir().join("workspaces")).contains(KEY));
    assert!(!log_text(&sv).contains(KEY));
    assert!(!job_dir.join("job/inference.sock").exists());
    let todo: Value =
        serde_json::from_str(&std::fs::read_to_string(job_dir.join("job/todo.json")).unwrap())
            .unwrap();
    assert_eq!(todo["job_id"], id.as_str());
}

/// Upstream CyNodeAI runs a job that asks for inference on a node without an upstream, and
/// lets it fail if it really needs a model; a model the node does not offer is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_needing_inference_run_without_a_proxy_where_none_is_configured() {
    env();
    let spec = |id: &str| {
        json!({
            "protocol_version": "1.0", "job_id": id, "task_id": "t",
            "inference": { "allowed_models": ["m9"] },
            "constraints": { "max_runtime_seconds": 60, "max_output_bytes": 65536 }
        })
        .to_string()
    };
    let req = |id: &str| {
        json!({ "version": 1, "task_id": "t", "job_id": id,
                "sandbox": { "image": env().image, "job_spec_json": spec(id) } })
    };
    let plain = Server::start("bwrap", "");
    let (code, v) = plain.post("/v1/worker/jobs:run", &req("a1")).await;
    assert_eq!(
        (
            code,
            v["status"].clone(),
            v["sba_result"]["failure_code"].clone()
        ),
        (200, json!("failed"), json!("execution_failure")),
        "{v}"
    );
    let (code, v) = plain
        .post(
            "/v1/worker/jobs:run",
            &json!({ "version": 1, "task_id": "t", "job_id": "c1",
                     "sandbox": { "image": env().image, "command": ["true"], "use_inference": true } }),
        )
        .await;
    assert_eq!(
        (code, v["status"].clone()),
        (200, json!("completed")),
        "{v}"
    );

    let (url, _up) = upstream(vec![]).await;
    let sv = worker(&url, "  models: [m1]\n");
    let (code, v) = sv.post("/v1/worker/jobs:run", &req("a2")).await;
    assert_eq!(code, 400);
    assert_eq!(
        v["detail"],
        "sandbox.job_spec_json.inference.allowed_models: no model the job allows is offered by this node (inference.models: m1)"
    );
}

/// The real thing: llama-server with SmolLM2 (deploy/llm/start.sh), the worker's proxy, the
/// SBA in a bubblewrap sandbox with no network. The tiny model may well fail the goal; the
/// result must then say so, schema-valid, and never crash or hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_model_drives_an_agent_job_through_the_proxy() {
    env();
    let port = std::env::var("CYNODE_TEST_LLM_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(cynode_testkit::model::free_port);
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    // This test's own server: stopped when the test ends, pass or fail.
    let model = cynode_testkit::LocalModel::start(&root, port, std::time::Duration::from_secs(120));
    let base = model.base_url.clone();
    let sv = Server::start(
        "bwrap",
        &format!("inference:\n  base_url: {base}\n  models: [smollm2]\n  agent_max_turns: 6\n"),
    );
    let id = unique("real");
    let spec = json!({
        "protocol_version": "1.0", "job_id": id, "task_id": id,
        "execution_mode": "agent_inference",
        "inference": { "allowed_models": ["smollm2"] },
        // The job bounds itself well inside nextest's 300 s backstop, even on a loaded
        // machine where the model generates a few tokens a second: it then ends `timeout`.
        "constraints": { "max_runtime_seconds": 120, "max_output_bytes": 65536 },
        "context": { "task_context": "create hello.txt containing hi, then read it back" }
    });
    let body = json!({
        "version": 1, "task_id": id, "job_id": id,
        "sandbox": { "image": env().image, "job_spec_json": spec.to_string(), "timeout_seconds": 150 }
    });
    let t = Instant::now();
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    let took = t.elapsed();
    assert_eq!(code, 200, "{v}");
    eprintln!(
        "real model agent job: {took:?}: {}",
        serde_json::to_string_pretty(&v["sba_result"]).unwrap()
    );
    assert!(
        took < Duration::from_secs(170),
        "took {took:?}; the model's last speed: {:?} tokens/s",
        model.last_tokens_per_second()
    );

    // Schema-valid, and honest: the worker's status is the result's.
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("protocol/schemas/result.schema.json")).unwrap(),
    )
    .unwrap();
    let result = v["sba_result"].clone();
    let validator = jsonschema::validator_for(&schema).unwrap();
    assert!(
        validator.is_valid(&result),
        "result does not match its schema: {result}"
    );
    let parsed: cynode_protocol::JobResult = serde_json::from_value(result.clone()).unwrap();
    let todo = parsed
        .todo
        .clone()
        .expect("agent results carry the todo list");
    match parsed.status {
        cynode_protocol::result::JobStatus::Success => {
            assert_eq!(v["status"], "completed");
            assert!(parsed.final_answer.is_some_and(|a| !a.is_empty()));
            assert!(todo
                .iter()
                .all(|i| i.status == cynode_protocol::result::TodoStatus::Done));
        }
        _ => {
            assert_ne!(v["status"], "completed");
            assert!(parsed.failure_code.is_some());
            assert!(!parsed.failure_message.unwrap_or_default().is_empty());
            assert_eq!(parsed.final_answer, None);
        }
    }
    for s in &parsed.steps {
        assert!(s.id.starts_with("agent-"), "{}", s.id);
    }
    // The model was really called through the proxy, and the usage was logged per job.
    let usage = sv
        .log
        .lock()
        .unwrap()
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| {
            l["fields"]["message"] == "inference request"
                && l["fields"]["job_id"] == id.as_str()
                && l["fields"]["status"] == 200
        })
        .count();
    assert!(usage >= 1, "no inference usage logged");
}

/// The job's model allowlist is checked on `model`, so a request that
/// names a model (or an upstream) in another field is refused (400) and never reaches the
/// upstream: OpenRouter's `models`, `route: fallback` and `provider`, LiteLLM's
/// `fallbacks` and its client-side `api_base`, on the OpenAI and the Ollama routes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_refuses_model_selectors_beside_model() {
    env();
    let model = cynode_testkit::ScriptedModel::new([], cynode_testkit::Reply::Content("ok".into()));
    let url = model.serve();
    let sv = worker(url.trim_end_matches("/v1"), "  models: [m1]\n");
    let id = unique("sel");
    let body = json!({
        "version": 1, "task_id": "t", "job_id": id,
        "sandbox": { "image": env().image, "command": ["sleep", "60"], "use_inference": true }
    });
    let (code, _) = sv.post("/v1/worker/jobs", &body).await;
    assert_eq!(code, 202);
    let sock = socket_of(&sv, &id);
    wait_until(Duration::from_secs(30), || sock.exists()).await;
    let messages = json!([{ "role": "user", "content": "hi" }]);
    for (field, value) in [
        ("models", json!(["m1", "m3"])),
        ("route", json!("fallback")),
        ("fallbacks", json!(["m3"])),
        ("provider", json!({ "order": ["m3"] })),
        ("context_window_fallbacks", json!([{ "m1": ["m3"] }])),
        ("api_base", json!("http://127.0.0.1:9")),
    ] {
        let mut req = json!({ "model": "m1", "messages": messages });
        req[field] = value;
        for path in ["/v1/chat/completions", "/api/chat"] {
            let (code, v) = unix_http(
                &sock,
                "POST",
                path,
                Some(&serde_json::to_vec(&req).unwrap()),
            );
            assert_eq!(code, 400, "{field} on {path}: {v}");
            assert_eq!(v["error"]["type"], "model_selector_refused", "{v}");
            assert!(
                v["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains(&format!("`{field}`")),
                "{v}"
            );
        }
    }
    assert!(
        model.chat_bodies().is_empty(),
        "a request with a model selector reached the upstream: {:?}",
        model.chat_bodies()
    );
    // `model` alone goes through.
    let plain = json!({ "model": "m1", "messages": messages });
    let (code, v) = post_chat(&sock, &serde_json::to_vec(&plain).unwrap());
    assert_eq!(code, 200, "{v}");
    assert_eq!(model.chat_bodies(), vec![plain]);
    let _ = sv
        .post(&format!("/v1/worker/jobs/{id}:stop"), &json!({}))
        .await;
}

/// The node's upstream for the listener tests: a forwarder in front of the real
/// llama-server that wants the node's key (401 without it), so a request that reached the
/// model carried the key, added by the node.
async fn keyed_model() -> (String, cynode_testkit::LocalModel) {
    let port = std::env::var("CYNODE_TEST_LLM_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(cynode_testkit::model::free_port);
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let model = tokio::task::spawn_blocking(move || {
        cynode_testkit::LocalModel::start(&root, port, Duration::from_secs(120))
    })
    .await
    .unwrap();
    let base = model.base_url.trim_end_matches("/v1").to_string();
    let client = reqwest::Client::new();
    let app = Router::new().fallback(move |req: axum::extract::Request| {
        let (client, base) = (client.clone(), base.clone());
        async move {
            let want = format!("Bearer {KEY}");
            if req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                != Some(&want)
            {
                return (
                    axum::http::StatusCode::UNAUTHORIZED,
                    "the node's key is wanted".to_string(),
                );
            }
            let method = req.method().clone();
            let path = req.uri().path().to_string();
            let body = axum::body::to_bytes(req.into_body(), 1 << 20)
                .await
                .unwrap();
            let r = client
                .request(method, format!("{base}{path}"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            let status = axum::http::StatusCode::from_u16(r.status().as_u16()).unwrap();
            (status, r.text().await.unwrap())
        }
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move {
        axum::serve(l, app).await.unwrap();
    });
    (url, model)
}

/// What a plain command job runs to reach the model as any client would: the variables,
/// every process's environment, the OpenAI and Ollama routes with busybox wget, a foreign
/// model and a request without the job's token (both refused).
const CLIENT_SCRIPT: &str = r#"
wget_=wget; [ -n "$WGET_FLAGS" ] && wget_="wget $WGET_FLAGS"
auth="Authorization: Bearer $OPENAI_API_KEY"
echo "== env"; env
echo "== environ"; cat /proc/[0-9]*/environ 2>/dev/null | tr '\0' '\n'
echo "== models"; $wget_ -qO- --header "$auth" "$OPENAI_BASE_URL/models"; echo
echo "== chat"; $wget_ -qO- --header "$auth" --header 'Content-Type: application/json' \
  --post-data '{"model":"smollm2","messages":[{"role":"user","content":"Say hi"}],"max_tokens":8}' \
  "$OPENAI_BASE_URL/chat/completions"; echo
echo "== tags"; $wget_ -qO- "$OLLAMA_BASE_URL/api/tags"; echo
echo "== version"; $wget_ -qO- "$OLLAMA_BASE_URL/api/version"; echo
echo "== ollama-chat"; $wget_ -qO- --post-data \
  '{"model":"smollm2","messages":[{"role":"user","content":"Say hi"}],"stream":false,"options":{"num_predict":8}}' \
  "$OLLAMA_BASE_URL/api/chat"; echo
echo "== foreign"; $wget_ -qO- --header "$auth" --post-data \
  '{"model":"other","messages":[{"role":"user","content":"hi"}]}' \
  "$OPENAI_BASE_URL/chat/completions" 2>&1 || echo "refused"
echo "== no-token"; $wget_ -qO- "$OPENAI_BASE_URL/models" 2>&1 || echo "refused"
echo "== end"
"#;

/// The part of the job's stdout under `== name`.
fn section<'a>(out: &'a str, name: &str) -> &'a str {
    let start = out
        .find(&format!("== {name}\n"))
        .unwrap_or_else(|| panic!("no section {name}: {out}"));
    let rest = &out[start + name.len() + 4..];
    &rest[..rest.find("\n== ").unwrap_or(rest.len())]
}

/// Checks what [`CLIENT_SCRIPT`] printed, and the node's audit of it.
fn check_client_output(sv: &Server, id: &str, out: &str) {
    let env = section(out, "env");
    assert!(
        env.contains("OPENAI_BASE_URL=http://127.0.0.1:11434/v1\n"),
        "{out}"
    );
    assert!(
        env.contains("OLLAMA_BASE_URL=http://127.0.0.1:11434\n"),
        "{out}"
    );
    assert!(env.contains("OPENAI_API_KEY=cynode-"), "{out}");
    let models: Value = serde_json::from_str(section(out, "models").trim())
        .unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(models["data"][0]["id"], "smollm2", "{out}");
    assert_eq!(models["data"].as_array().unwrap().len(), 1, "{out}");
    let chat: Value =
        serde_json::from_str(section(out, "chat").trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(
        chat["choices"][0]["message"]["content"].is_string(),
        "{out}"
    );
    let tags: Value =
        serde_json::from_str(section(out, "tags").trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(tags["models"][0]["name"], "smollm2", "{out}");
    let version: Value = serde_json::from_str(section(out, "version").trim())
        .unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(version["version"].is_string(), "{out}");
    let ochat: Value = serde_json::from_str(section(out, "ollama-chat").trim())
        .unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(
        (ochat["done"].clone(), ochat["message"]["role"].clone()),
        (json!(true), json!("assistant")),
        "{out}"
    );
    assert!(ochat["eval_count"].as_u64().is_some_and(|n| n > 0), "{out}");
    assert!(section(out, "foreign").contains("refused"), "{out}");
    assert!(section(out, "no-token").contains("refused"), "{out}");
    // The node's key is in no environment and no answer inside.
    assert!(
        !out.contains(KEY),
        "the node's key reached the sandbox: {out}"
    );
    // Every request was audited, with its status.
    let audit: Vec<Value> = sv
        .log
        .lock()
        .unwrap()
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["fields"]["message"] == "inference request" && l["fields"]["job_id"] == id)
        .collect();
    let seen: Vec<(String, u64)> = audit
        .iter()
        .map(|l| {
            (
                l["fields"]["route"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                l["fields"]["status"].as_u64().unwrap_or_default(),
            )
        })
        .collect();
    for want in [
        ("/v1/models", 200),
        ("/v1/chat/completions", 200),
        ("/api/tags", 200),
        ("/api/chat", 200),
        ("/v1/chat/completions", 403),
    ] {
        assert!(
            seen.contains(&(want.0.to_string(), want.1)),
            "{want:?} not audited: {seen:?}"
        );
    }
    assert!(
        audit.iter().all(|l| l["fields"]["via"] == "loopback"),
        "{audit:?}"
    );
    assert!(
        audit.iter().any(|l| l["fields"]["completion_tokens"]
            .as_u64()
            .is_some_and(|n| n > 0)),
        "{audit:?}"
    );
    assert!(!log_text(sv).contains(KEY), "the key reached the log");
}

/// A node whose upstream is `url` (the key in a file), offering `smollm2`, on `backend`.
fn model_worker(backend: &'static str, url: &str, extra: &str) -> Server {
    worker_on(
        backend,
        url,
        &format!("  models: [smollm2]\n  timeout_seconds: 60\n{extra}"),
    )
}

/// Ordinary clients inside a plain command job reach the model at 127.0.0.1:11434:
/// OpenAI's and Ollama's routes, the job's token as bearer, never the node's key.
async fn ordinary_clients_reach_the_model(backend: &'static str) {
    env();
    let (url, _model) = keyed_model().await;
    let sv = model_worker(backend, &url, "");
    let id = unique("loopback");
    let body = json!({
        "version": 1, "task_id": id, "job_id": id,
        "sandbox": { "image": env().image, "command": ["sh", "-c", CLIENT_SCRIPT],
                     "use_inference": true, "timeout_seconds": 120,
                     "env": { "OPENAI_API_KEY": "from-the-request", "OPENAI_BASE_URL": "http://elsewhere" } }
    });
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(code, 200, "{v}");
    let out = v["stdout"].as_str().unwrap_or_default();
    assert_eq!(v["status"], "completed", "{v}");
    assert!(
        !out.contains("from-the-request") && !out.contains("elsewhere"),
        "{out}"
    );
    assert!(
        section(out, "env").contains("INFERENCE_PROXY_URL="),
        "{out}"
    );
    check_client_output(&sv, &id, out);

    // A job without inference has no listener.
    let (code, v) = sv
        .run_job(
            &unique("plain"),
            "t",
            &["sh", "-c", "wget -qO- -T 3 http://127.0.0.1:11434/api/version 2>&1 || echo none; env | grep -c OPENAI_ || true"],
        )
        .await;
    assert_eq!(code, 200, "{v}");
    let out = v["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("none") && out.ends_with("0\n"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_listener_ordinary_clients_reach_the_model_under_bwrap() {
    ordinary_clients_reach_the_model("bwrap").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_listener_ordinary_clients_reach_the_model_under_podman() {
    ordinary_clients_reach_the_model("podman").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_listener_ordinary_clients_reach_the_model_under_docker() {
    ordinary_clients_reach_the_model("docker").await;
}

/// What a client that ignores `NO_PROXY` sends beside the egress proxy: busybox wget's
/// GETs in absolute form (it sends every request through a proxy as a GET, so a POST is
/// written by hand with nc, as such a client would send it), and another loopback port.
const BESIDE_SCRIPT: &str = r#"
auth="Authorization: Bearer $OPENAI_API_KEY"
post() {
  printf 'POST http://127.0.0.1:11434/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:11434\r\n%s\r\nContent-Type: application/json\r\nContent-Length: %s\r\nConnection: close\r\n\r\n%s' \
    "$auth" "${#1}" "$1" | nc -w 60 127.0.0.1 3128 > /tmp/resp
  head -n 1 /tmp/resp; grep -c '"choices"' /tmp/resp
}
echo "== models"; wget -qO- --header "$auth" "$OPENAI_BASE_URL/models"; echo
echo "== tags"; wget -qO- "$OLLAMA_BASE_URL/api/tags"; echo
echo "== chat"; post '{"model":"smollm2","messages":[{"role":"user","content":"Say hi"}],"max_tokens":8}'
echo "== foreign"; post '{"model":"other","messages":[{"role":"user","content":"hi"}]}'
echo "== other-port"; wget -qO- http://127.0.0.1:11435/ 2>&1; echo "rc=$?"
echo "== end"
"#;

/// A job with both egress and inference: a client that ignores `NO_PROXY` sends
/// `GET http://127.0.0.1:11434/...` (or a POST) to the egress proxy, and the proxy connects
/// it inside the sandbox's own namespace to the sandbox's listener, whose rules still
/// hold (a foreign model is refused), audited as allowed. Another loopback port still goes
/// through the allowlist (403).
async fn beside_the_egress_proxy(backend: &'static str) {
    env();
    let (url, _model) = keyed_model().await;
    let sv = model_worker(backend, &url, "egress:\n  allow: [\"allowed.test\"]\n");
    let id = unique("both");
    let body = json!({
        "version": 1, "task_id": id, "job_id": id,
        "sandbox": { "image": env().image, "command": ["sh", "-c", BESIDE_SCRIPT],
                     "use_inference": true, "timeout_seconds": 120,
                     "network_policy": "restricted" }
    });
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(code, 200, "{v}");
    let out = v["stdout"].as_str().unwrap_or_default();
    let models: Value = serde_json::from_str(section(out, "models").trim())
        .unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(models["data"][0]["id"], "smollm2", "{out}");
    let tags: Value =
        serde_json::from_str(section(out, "tags").trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(tags["models"][0]["name"], "smollm2", "{out}");
    let chat = section(out, "chat");
    assert!(
        chat.starts_with("HTTP/1.1 200") && chat.trim_end().ends_with('1'),
        "{out}"
    );
    let foreign = section(out, "foreign");
    assert!(
        foreign.starts_with("HTTP/1.1 403") && foreign.trim_end().ends_with('0'),
        "{out}"
    );
    let other = section(out, "other-port");
    assert!(other.contains("403") && other.contains("rc=1"), "{out}");
    assert!(
        !out.contains(KEY),
        "the node's key reached the sandbox: {out}"
    );
    let records = v["egress"].as_array().cloned().unwrap_or_default();
    let to = |port: u64, method: &str, decision: &str| {
        records
            .iter()
            .filter(|r| {
                r["host"] == "127.0.0.1"
                    && r["port"] == port
                    && r["method"] == method
                    && r["decision"] == decision
            })
            .count()
    };
    assert_eq!(to(11434, "GET", "allowed"), 2, "{}", v["egress"]);
    assert_eq!(to(11434, "POST", "allowed"), 2, "{}", v["egress"]);
    assert_eq!(to(11435, "GET", "denied"), 1, "{}", v["egress"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_listener_works_beside_the_egress_proxy_under_bwrap() {
    beside_the_egress_proxy("bwrap").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_listener_works_beside_the_egress_proxy_under_podman() {
    beside_the_egress_proxy("podman").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_listener_works_beside_the_egress_proxy_under_docker() {
    beside_the_egress_proxy("docker").await;
}

/// The attack on that path: a node whose ceiling lists `127.0.0.1`, with a server of the
/// node's own on its loopback port 11434. A request for `127.0.0.1:11434` through the
/// proxy reaches the sandbox's listener, never the node's port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_listener_through_the_proxy_is_the_sandboxs_never_the_nodes() {
    env();
    let (url, up) = upstream(vec![]).await;
    let node_side = std::net::TcpListener::bind("127.0.0.1:11434")
        .expect("this test needs the node's 127.0.0.1:11434 free (it plays the node's port)");
    node_side.set_nonblocking(true).unwrap();
    let node_side = tokio::net::TcpListener::from_std(node_side).unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&hits);
    let server = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = node_side.accept().await else {
                return;
            };
            counted.fetch_add(1, Ordering::SeqCst);
            let _ = tokio::io::AsyncWriteExt::write_all(
                &mut s,
                b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnode-side",
            )
            .await;
        }
    });
    let sv = worker(&url, "  models: [m1]\negress:\n  allow: [\"127.0.0.1\"]\n");
    let id = unique("lo-attack");
    let body = json!({
        "version": 1, "task_id": id, "job_id": id,
        "sandbox": { "image": env().image, "use_inference": true, "network_policy": "restricted",
                     "command": ["sh", "-c", "wget -qO- \"$OLLAMA_BASE_URL/api/version\" 2>&1; echo; wget -qO- http://localhost:11434/api/version 2>&1"] }
    });
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    server.abort();
    assert_eq!(code, 200, "{v}");
    let out = v["stdout"].as_str().unwrap_or_default();
    assert!(
        !out.contains("node-side"),
        "the proxy reached the node's port: {out}"
    );
    assert_eq!(out.matches("\"version\"").count(), 2, "{out}");
    assert_eq!(hits.load(Ordering::SeqCst), 0, "{out}");
    drop(up);
}

/// gVisor cannot bind the listener inside its sandboxes: a job asking for inference is
/// refused by name, never run without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_listener_runsc_refuses_inference_jobs_by_name() {
    env();
    let (url, _up) = upstream(vec![]).await;
    let sv = worker_on("runsc", &url, "  models: [m1]\n");
    let id = unique("runsc");
    let body = json!({
        "version": 1, "task_id": id, "job_id": id,
        "sandbox": { "image": env().image, "command": ["true"], "use_inference": true }
    });
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(code, 400, "{v}");
    assert_field_starts(
        &v,
        "detail",
        "sandbox.use_inference: inference_listener_unavailable",
    );
    // A session too.
    let body = json!({
        "version": 1, "session_id": unique("srunsc"), "task_id": unique("t"),
        "image": env().image, "use_inference": true
    });
    let (code, v) = sv.post("/v1/worker/sessions", &body).await;
    assert_eq!(code, 400, "{v}");
    assert_field_starts(
        &v,
        "detail",
        "use_inference: inference_listener_unavailable",
    );
    // An agent job too (its models are the job's `inference.allowed_models`).
    let id = unique("runsc-agent");
    let spec = json!({
        "protocol_version": "1.0", "job_id": id, "task_id": "t-agent",
        "execution_mode": "agent_inference",
        "inference": { "allowed_models": ["m1"] },
        "constraints": { "max_runtime_seconds": 60, "max_output_bytes": 65536 },
        "context": { "task_context": "anything" }
    });
    let body = json!({
        "version": 1, "task_id": "t-agent", "job_id": id,
        "sandbox": { "image": env().image, "job_spec_json": spec.to_string() }
    });
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(code, 400, "{v}");
    assert!(
        v["detail"]
            .as_str()
            .is_some_and(|d| d.contains("inference_listener_unavailable")),
        "{v}"
    );
    // `check` says so.
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_cynode-worker"));
    cmd.arg("check")
        .arg("--config")
        .arg(sv.dir.path().join("worker.yaml"));
    let out = cynode_testkit::output_bounded(cmd, Duration::from_secs(60));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(
            "note inference: jobs and sessions with inference are refused: inference_listener_unavailable"
        ),
        "{text}"
    );
}

/// One chat completion for `m1` through the loopback listener with the job's token, as a
/// shell command inside the sandbox: prints `ok` when it succeeds, `no` when refused.
const CHAT_M1: &str = "wget -qO- --header \"Authorization: Bearer $OPENAI_API_KEY\" \
    --post-data '{\"model\":\"m1\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}' \
    \"$OPENAI_BASE_URL/chat/completions\" >/dev/null 2>&1 && echo ok || echo no";

/// The job's request budget: beyond `max_requests_per_job`, 429, on both transports
/// together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_listener_the_request_budget_answers_429() {
    env();
    let (url, up) = upstream(vec![]).await;
    let sv = worker(&url, "  models: [m1]\n  max_requests_per_job: 3\n");
    let id = unique("budget");
    let script = format!("for i in 1 2 3; do {CHAT_M1}; done");
    let body = json!({
        "version": 1, "task_id": id, "job_id": id,
        "sandbox": { "image": env().image, "command": ["sh", "-c", format!("sleep 1; {script}")], "use_inference": true }
    });
    let sock = socket_of(&sv, &id);
    let run = sv.post("/v1/worker/jobs:run", &body);
    let poke = async {
        wait_until(Duration::from_secs(20), || sock.exists()).await;
        post_chat(&sock, &chat_body("m1", "hi"))
    };
    let ((code, v), (first, _)) = tokio::join!(run, poke);
    assert_eq!(first, 200);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["stdout"], "ok\nok\nno\n", "{v}");
    assert_eq!(up.hits.lock().unwrap().len(), 3);
    let over = sv
        .log
        .lock()
        .unwrap()
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["fields"]["message"] == "inference request" && l["fields"]["status"] == 429)
        .count();
    assert_eq!(over, 1);
}

/// A session that asks for inference: every exec reaches the model at 127.0.0.1:11434
/// (bound once in a keep-alive container, per command under bubblewrap) with the session's
/// token, never the node's key; a session without it has no listener.
async fn a_session_exec_gets_a_completion(backend: &'static str) {
    env();
    let (url, _model) = keyed_model().await;
    let sv = model_worker(backend, &url, "");
    let id = unique("sinf");
    let _guard = crate::harness::session_guard(sv.backend, &id);
    let body = json!({
        "version": 1, "session_id": id, "task_id": unique("t"), "image": env().image,
        "use_inference": true
    });
    let (code, info) = sv.post("/v1/worker/sessions", &body).await;
    assert_eq!(code, 201, "{info}");
    let exec = format!("/v1/worker/sessions/{id}/exec");
    for _ in 0..2 {
        let (code, r) = sv
            .post(
                &exec,
                &json!({ "version": 1, "command": ["sh", "-c", CLIENT_SCRIPT], "timeout_seconds": 120 }),
            )
            .await;
        assert_eq!(code, 200, "{r}");
        let out = r["stdout"].as_str().unwrap_or_default();
        let env = section(out, "env");
        assert!(
            env.contains("OPENAI_BASE_URL=http://127.0.0.1:11434/v1\n"),
            "{out}"
        );
        let chat: Value = serde_json::from_str(section(out, "chat").trim())
            .unwrap_or_else(|e| panic!("{e}: {out}"));
        assert!(
            chat["choices"][0]["message"]["content"].is_string(),
            "{out}"
        );
        let ochat: Value = serde_json::from_str(section(out, "ollama-chat").trim())
            .unwrap_or_else(|e| panic!("{e}: {out}"));
        assert_eq!(ochat["done"], true, "{out}");
        assert!(section(out, "foreign").contains("refused"), "{out}");
        assert!(section(out, "no-token").contains("refused"), "{out}");
        assert!(
            !out.contains(KEY),
            "the node's key reached the session: {out}"
        );
    }
    let (code, _) = sv
        .post(&format!("/v1/worker/sessions/{id}/end"), &json!({}))
        .await;
    assert_eq!(code, 200);

    // The session's totals, once it ended: both execs' requests, under the session's id.
    crate::harness::eventually(
        "the session's inference totals",
        Duration::from_secs(10),
        || {
            sv.log
                .lock()
                .unwrap()
                .iter()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .any(|l| {
                    l["fields"]["message"] == "inference proxy closed"
                        && l["fields"]["job_id"] == id.as_str()
                        && l["fields"]["requests"].as_u64().is_some_and(|n| n >= 8)
                })
        },
    )
    .await;

    // Without `use_inference`: no listener, no variables.
    let plain = unique("snoinf");
    let _guard2 = crate::harness::session_guard(sv.backend, &plain);
    let body =
        json!({ "version": 1, "session_id": plain, "task_id": unique("t"), "image": env().image });
    let (code, info) = sv.post("/v1/worker/sessions", &body).await;
    assert_eq!(code, 201, "{info}");
    let (code, r) = sv
        .post(
            &format!("/v1/worker/sessions/{plain}/exec"),
            &json!({ "version": 1, "command": ["sh", "-c",
                "wget -qO- -T 3 http://127.0.0.1:11434/api/version 2>&1 || echo none; env | grep -c OPENAI_ || true"] }),
        )
        .await;
    assert_eq!(code, 200, "{r}");
    let out = r["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("none") && out.ends_with("0\n"), "{out}");
    sv.post(&format!("/v1/worker/sessions/{plain}/end"), &json!({}))
        .await;
    assert!(!log_text(&sv).contains(KEY));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_listener_a_session_exec_gets_a_completion_under_bwrap() {
    a_session_exec_gets_a_completion("bwrap").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_listener_a_session_exec_gets_a_completion_under_podman() {
    a_session_exec_gets_a_completion("podman").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_listener_a_session_exec_gets_a_completion_under_docker() {
    a_session_exec_gets_a_completion("docker").await;
}

/// An SBA job's `run_command` step gets the listener's variables from the runner, as it
/// gets the egress proxy's: the same clients reach the model from a step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_listener_a_run_command_step_reaches_the_model() {
    env();
    let (url, _model) = keyed_model().await;
    let sv = model_worker("bwrap", &url, "");
    let id = unique("step");
    let mut body = crate::harness::sba_job(
        &id,
        &id,
        json!([{ "id": "s", "type": "run_command",
                 "arguments": { "command": "sh", "args": ["-c", CLIENT_SCRIPT] } }]),
        json!([]),
    );
    body["sandbox"]["use_inference"] = json!(true);
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(code, 200, "{v}");
    let out = v["sba_result"]["steps"][0]["result"]["stdout"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"));
    check_client_output(&sv, &id, out);
}

/// The bench of the loopback listener against the socket (worker/benches/inference_proxy.py,
/// run inside a job's network namespace against the real llama-server) answers every request
/// on both transports. Quick here (`CYNODE_BENCH_QUICK=1`: a few requests, nothing timed);
/// the figures in docs/PERFORMANCE.md come from a run with `CYNODE_BENCH_QUICK=0`, whose
/// output this test prints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_listener_bench_serves_both_transports() {
    env();
    let (url, _model) = keyed_model().await;
    let sv = model_worker("bwrap", &url, "  max_requests_per_job: 100000\n");
    let id = unique("bench");
    let body = json!({
        "version": 1, "task_id": id, "job_id": id,
        "sandbox": { "image": env().image, "command": ["sleep", "299"], "use_inference": true, "timeout_seconds": 300 }
    });
    let (code, v) = sv.post("/v1/worker/jobs", &body).await;
    assert!(code == 200 || code == 202, "{v}");
    let sock = socket_of(&sv, &id);
    let mut pid = None;
    wait_until(Duration::from_secs(30), || {
        pid = std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
            let p = e.path();
            let comm = std::fs::read_to_string(p.join("comm")).ok()?;
            let cmd = std::fs::read(p.join("cmdline")).ok()?;
            (comm.trim() == "sleep" && cmd == b"sleep\x00299\x00")
                .then(|| e.file_name().to_string_lossy().to_string())
        });
        pid.is_some() && sock.exists()
    })
    .await;
    let pid = pid.unwrap();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let token = String::from_utf8_lossy(&environ)
        .split('\0')
        .find_map(|kv| kv.strip_prefix("OPENAI_API_KEY=").map(str::to_string))
        .unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/inference_proxy.py");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("nsenter")
            .env(
                "CYNODE_BENCH_QUICK",
                std::env::var("CYNODE_BENCH_QUICK").unwrap_or_else(|_| "1".into()),
            )
            .args(["-t", &pid, "-n", "python3"])
            .arg(script)
            .arg(&sock)
            .args(["--loopback", &token])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    eprintln!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    sv.post(&format!("/v1/worker/jobs/{id}:stop"), &json!({}))
        .await;
    sv.wait_terminal(&id).await;
    assert!(out.status.success(), "the bench failed: {out:?}");
}

/// A node whose upstream takes a key per job (`inference.key_per_job`, as the PM's
/// local worker is): a job given no key is answered 401 `no_job_key` with no call
/// upstream; a job given one reaches the upstream with that key and no other; a
/// session, which is never given one, cannot ask for models.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_listener_a_key_per_job_node_sends_each_jobs_own_key() {
    env();
    let (url, up) = upstream(vec![]).await;
    let sv = Server::start(
        "bwrap",
        &format!("inference:\n  base_url: {url}/v1\n  key_per_job: true\n  models: [m1]\n"),
    );
    let script = format!("sleep 1; {CHAT_M1}");
    let job = |id: &str, key: Option<&str>| {
        let mut b = json!({
            "version": 1, "task_id": id, "job_id": id,
            "sandbox": { "image": env().image, "command": ["sh", "-c", &script], "use_inference": true }
        });
        if let Some(k) = key {
            b["inference_key"] = json!(k);
        }
        b
    };
    let bound = Duration::from_secs(90);

    // No key: refused on the node, nothing upstream.
    let bare = unique("nokey");
    let (code, v) = tokio::time::timeout(bound, sv.post("/v1/worker/jobs:run", &job(&bare, None)))
        .await
        .expect("the keyless job ends");
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["stdout"], "no\n", "{v}");
    assert!(up.hits.lock().unwrap().is_empty());
    assert!(
        log_text(&sv).contains("no inference key for this job; refused"),
        "{}",
        log_text(&sv)
    );

    // Its own key: the upstream sees that key, and the job never sees it.
    let keyed = unique("withkey");
    let job_key = "jk-0123456789abcdef-own-key";
    let (code, v) = tokio::time::timeout(
        bound,
        sv.post("/v1/worker/jobs:run", &job(&keyed, Some(job_key))),
    )
    .await
    .expect("the keyed job ends");
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["stdout"], "ok\n", "{v}");
    let hits = up.hits.lock().unwrap().clone();
    assert_eq!(hits.len(), 1, "{hits:?}");
    assert_eq!(
        hits[0].auth.as_deref(),
        Some(format!("Bearer {job_key}").as_str())
    );
    assert!(!v.to_string().contains(job_key), "the key came back: {v}");
    assert!(
        !log_text(&sv).contains(job_key),
        "a log line holds the job's key"
    );

    // A session cannot be given a key, so it cannot ask for models here.
    let sid = unique("skey");
    let (code, e) = tokio::time::timeout(
        bound,
        sv.post(
            "/v1/worker/sessions",
            &json!({ "version": 1, "session_id": sid, "task_id": unique("t"),
                     "image": env().image, "use_inference": true }),
        ),
    )
    .await
    .expect("the session create answers");
    assert_eq!(code, 400, "{e}");
    assert!(e.to_string().contains("key_per_job"), "{e}");
}
