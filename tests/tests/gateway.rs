//! The sandbox gateway end to end, with real processes: `cynode-pm serve` (its gateway at
//! `/v1/gateway`), a real bwrap worker, the real SBA and a scripted model. Two jobs of two
//! tasks call the gateway from inside their sandboxes over `/job/gateway.sock` (with a
//! tiny static Unix-socket client the job writes itself: the test image is busybox, with
//! no client for Unix sockets): `artifact.put` and `skills.get` succeed, `db.query` is
//! refused, another task's artifact is refused. After the jobs the tokens (captured
//! between the PM and the worker) are refused, and they appear nowhere in the sandbox
//! (its environment and every file of /job and /workspace, collected as an artifact),
//! the session's record or the PM's log.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::service::{call, start_replica_with, wait_status, TENANT_A};
use cynode_tests::{model_server, start_worker};

/// `unc SOCKET`: stdin to a Unix socket, the socket to stdout (x86-64, no libc).
const UNC_C: &str = r#"
static long sc(long n, long a, long b, long c) {
  long r; __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
  return r;
}
struct sun { unsigned short f; char p[108]; };
static char buf[65536];
void _start_c(long *sp) {
  char *path = (char *)sp[2];
  struct sun a; a.f = 1; int i = 0;
  for (; path[i] && i < 107; i++) a.p[i] = path[i];
  a.p[i] = 0;
  long s = sc(41, 1, 1, 0);
  if (s < 0 || sc(42, s, (long)&a, 2 + i + 1) < 0) sc(60, 2, 0, 0);
  long n;
  while ((n = sc(0, 0, (long)buf, sizeof buf)) > 0)
    for (long o = 0; o < n;) { long w = sc(1, s, (long)buf + o, n - o); if (w <= 0) sc(60, 3, 0, 0); o += w; }
  while ((n = sc(0, s, (long)buf, sizeof buf)) > 0)
    for (long o = 0; o < n;) { long w = sc(1, 1, (long)buf + o, n - o); if (w <= 0) break; o += w; }
  sc(60, 0, 0, 0);
}
__asm__(".globl _start\n_start:\n mov %rsp, %rdi\n and $-16, %rsp\n call _start_c\n");
"#;

/// The client, built with the host's gcc, as base64.
fn unc_base64(dir: &Path) -> String {
    std::fs::write(dir.join("unc.c"), UNC_C).unwrap();
    let out = std::process::Command::new("gcc")
        .args([
            "-static",
            "-nostdlib",
            "-Os",
            "-s",
            "-fno-stack-protector",
            "-o",
        ])
        .arg(dir.join("unc"))
        .arg(dir.join("unc.c"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gcc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    base64::engine::general_purpose::STANDARD.encode(std::fs::read(dir.join("unc")).unwrap())
}

/// One raw HTTP request calling `tool` with `args` on the gateway socket.
fn http_call(tool: &str, args: Value) -> String {
    let body = json!({ "jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": { "name": tool, "arguments": args } })
    .to_string();
    format!(
        "POST / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nMcp-Protocol-Version: 2025-06-18\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn sha(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// A test-only skill `id` whose job writes the client and the requests `calls`, sends
/// each over /job/gateway.sock, and collects its environment and every file of /job
/// and /workspace as the artifact `dump.txt`.
fn gateway_skill(dir: &Path, id: &str, unc: &str, calls: &[(&str, String)]) {
    let mut steps = vec![json!({ "id": "client", "type": "write_file",
        "arguments": { "path": format!("{id}.b64"), "content": unc } })];
    let mut names = Vec::new();
    for (name, req) in calls {
        steps.push(json!({ "id": format!("req-{name}"), "type": "write_file",
            "arguments": { "path": format!("{id}-{name}.http"), "content": req } }));
        names.push(*name);
    }
    let script = format!(
        "base64 -d {id}.b64 > {id}.unc && chmod 700 {id}.unc && for r in {}; do ./{id}.unc /job/gateway.sock < {id}-$r.http > {id}-$r.out; echo \"== $r\"; tail -n 1 {id}-$r.out; echo; done; (env; find /job /workspace -type f ! -name dump.txt -exec cat {{}} +) > /tmp/dump 2>&1; mv /tmp/dump dump.txt; true",
        names.join(" ")
    );
    steps.push(json!({ "id": "call", "type": "run_command",
        "arguments": { "command": "sh", "args": ["-c", script] } }));
    let template = json!({
        "constraints": { "max_runtime_seconds": 60, "max_output_bytes": 262144,
            "allowed_commands": ["sh"], "allowed_paths": ["/workspace"] },
        "artifacts": ["dump.txt"],
        "steps": steps
    });
    cynode_tests::write_skill(
        &dir.join(id),
        &format!("skill_id: {id}\nversion: 1.0.0\ndescription: call the sandbox gateway\npurpose: base-tools\nallowed_commands: [sh]\nlimits:\n  max_runtime_seconds: 60\n  max_output_bytes: 262144\ninputs_schema:\n  type: object\n  additionalProperties: false\n  properties: {{}}\n"),
        &template.to_string(),
        "{}",
    );
}

/// The data of the session's events of `kind` (its event stream, read to its end).
fn of_kind(events: &[(u64, String, Value)], kind: &str) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e.1 == kind)
        .map(|e| e.2.get("data").cloned().unwrap_or_else(|| e.2.clone()))
        .collect()
}

/// The `gateway_calls` of a job: (tool, outcome) in order.
fn calls_of(events: &[(u64, String, Value)], job_id: &str) -> Vec<(String, String)> {
    of_kind(events, "gateway_calls")
        .iter()
        .filter(|d| d["job_id"] == job_id)
        .flat_map(|d| d["calls"].as_array().cloned().unwrap_or_default())
        .map(|c| {
            (
                c["tool"].as_str().unwrap_or_default().into(),
                c["outcome"].as_str().unwrap_or_default().into(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_jobs_use_the_gateway_through_the_node_without_seeing_the_token() {
    let dir = cynode_tests::tempdir().unwrap();
    let unc = unc_base64(dir.path());
    let mine = b"written through the gateway by t1\n";
    let theirs = b"written through the gateway by t2\n";
    let put = |content: &[u8]| {
        http_call(
            "artifact.put",
            json!({ "path": "gw/note.txt",
            "content_base64": base64::engine::general_purpose::STANDARD.encode(content),
            "sha256": sha(content) }),
        )
    };
    let skills = dir.path().join("skills");
    gateway_skill(
        &skills,
        "gw-one",
        &unc,
        &[
            ("put", put(mine)),
            (
                "skill",
                http_call("skills.get", json!({ "skill_id": "write-files" })),
            ),
            ("db", http_call("db.query", json!({ "sql": "select 1" }))),
            (
                "get",
                http_call("artifact.get", json!({ "sha256": sha(mine) })),
            ),
        ],
    );
    gateway_skill(
        &skills,
        "gw-two",
        &unc,
        &[
            ("put", put(theirs)),
            (
                "other",
                http_call("artifact.get", json!({ "sha256": sha(mine) })),
            ),
        ],
    );
    let worker = start_worker(0);
    let requests = Arc::new(Mutex::new(Vec::new()));
    let front = cynode_tests::worker::recording_front(worker.addr.clone(), requests.clone()).await;
    let plan = json!({ "type": "plan_update", "payload": {}, "state_patch": [
        { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "one", "status": "pending" } },
        { "op": "add", "path": "/plan/-", "value": { "task_id": "t2", "description": "two", "status": "pending" } }] });
    let (model, _m) = model_server(vec![
        plan,
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": "gw-one", "inputs": {} } }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t2", "skill_id": "gw-two", "inputs": {} } }),
        json!({ "type": "final", "state_patch": [], "payload": { "summary": "done" } }),
    ]);
    let db = format!("sqlite://{}", dir.path().join("pm.db").display());
    let skill_dir = skills.display().to_string();
    let r = start_replica_with(
        dir.path(),
        "gw",
        &db,
        &model,
        &["--worker-endpoint", &front],
        &["--skill-dir", "skills", "--skill-dir", &skill_dir],
    );
    let (s, v) = call(
        reqwest::Method::POST,
        &format!("{}/v1/sessions", r.base),
        TENANT_A,
        Some(json!({ "objective": "use the gateway" })),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let id = v["session_id"].as_str().unwrap().to_string();
    let v = wait_status(
        &r.base,
        &id,
        &["completed", "failed"],
        Duration::from_secs(240),
    )
    .await;
    let log = || std::fs::read_to_string(dir.path().join("gw.log")).unwrap_or_default();
    assert_eq!(v["status"], "completed", "{v}\n{}", log());
    let events = crate::service::sse(&r.base, &id, None, None).await;
    let jobs: Vec<String> = v["deliverable"]["report"]["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["jobs"][0]["job_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(jobs.len(), 2, "{v}");
    let s = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(
        calls_of(&events, &jobs[0]),
        [
            s("artifact.put", "ok"),
            s("skills.get", "ok"),
            s("db.query", "refused"),
            s("artifact.get", "ok")
        ],
        "{events:?}"
    );
    assert_eq!(
        calls_of(&events, &jobs[1]),
        [s("artifact.put", "ok"), s("artifact.get", "refused")],
        "{events:?}"
    );
    // t1's put is an artifact of the session, verified.
    assert!(
        v["artifacts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["sha256"] == sha(mine)),
        "{v}"
    );

    // The tokens the PM handed the worker: one a job, refused now that the jobs ended.
    let tokens: Vec<String> = requests
        .lock()
        .unwrap()
        .iter()
        .filter_map(|r| r["gateway"]["token"].as_str().map(str::to_string))
        .collect();
    assert!(tokens.len() >= 2, "{tokens:?}");
    let http = reqwest::Client::new();
    for t in &tokens {
        let resp = http
            .post(format!("{}/v1/gateway", r.base))
            .header("accept", "application/json, text/event-stream")
            .bearer_auth(t)
            .json(&json!({ "jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": { "name": "artifact.list", "arguments": {} } }))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401);
        let p: Value = resp.json().await.unwrap();
        assert!(
            p["detail"].as_str().unwrap().contains("unknown or revoked"),
            "{p}"
        );
    }

    // Nowhere: the sandbox's environment and files (each job's dump), the session, the log.
    let record = format!("{v}{events:?}");
    let mut dumps = 0;
    for a in v["artifacts"].as_array().unwrap() {
        if a["path"] != "dump.txt" {
            continue;
        }
        let sha = a["sha256"].as_str().unwrap();
        let resp = http
            .get(format!("{}/v1/sessions/{id}/artifacts/{sha}", r.base))
            .bearer_auth(TENANT_A)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let dump = resp.text().await.unwrap();
        assert!(
            dump.contains("CYNODE_JOB_ID"),
            "the dump has no environment: {dump}"
        );
        for t in &tokens {
            assert!(!dump.contains(t.as_str()), "a token in the sandbox");
            assert!(!dump.contains(&t[4..]), "a token in the sandbox");
        }
        dumps += 1;
    }
    assert_eq!(dumps, 2, "{v}");
    drop(r);
    let log = log();
    for t in &tokens {
        assert!(!record.contains(&t[4..]), "a token in the session");
        assert!(!log.contains(&t[4..]), "a token in the PM's log");
    }
}
