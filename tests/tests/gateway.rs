//! The sandbox gateway end to end, with real processes: `cynode-pm serve` (its gateway at
//! `/v1/gateway`), a real bwrap worker, the real SBA and a scripted model. Two jobs of two
//! tasks call the gateway from inside their sandboxes over `/job/gateway.sock` (with a
//! tiny static Unix-socket client the job writes itself: the test image is busybox, with
//! no client for Unix sockets): `artifact.put` and `skills.get` succeed, `db.query` is
//! refused, another task's artifact is refused. After the jobs the tokens (captured
//! between the PM and the worker) are refused, and they appear nowhere in the sandbox
//! (its environment and every file of /job and /workspace, collected as an artifact),
//! the session's record or the PM's log.
//!
//! An agent-mode job (the SBA driven by its own scripted model through the worker's
//! inference proxy) calls the tools its `context.mcp_tools` lists as actions; a tool it
//! does not list is refused by the SBA and never reaches the gateway (the gateway's own
//! audit of the job shows only the listed calls). `cynode-pm run` hosts the gateway for
//! its own session: the same agent job under `run` gets its tools, a job on `run`'s
//! own local worker reaches the gateway too, and an agent job on that local worker gets
//! `run`'s (keyless) model as its inference upstream. A running job's token
//! is refused once its session is canceled, and once its worker dies and the job fails.

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
pub(crate) fn unc_base64(dir: &Path) -> String {
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
pub(crate) fn http_call(tool: &str, args: Value) -> String {
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

/// A shell function `req` for [`gateway_skill`]'s `extra`: sends the JSON-RPC body in
/// the file `body` to /job/gateway.sock as one HTTP request (`UNC` is the client), the
/// reply to the file `reply`.
const SH_REQ: &str = r#"req() { n=$(wc -c < body); printf 'POST / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nMcp-Protocol-Version: 2025-06-18\r\nContent-Length: %s\r\n\r\n' $n > req; cat body >> req; ./UNC /job/gateway.sock < req > reply; }; "#;

/// A test-only skill `id` listing `tools` in its `context.mcp_tools`, whose job writes
/// the client and the requests `calls`, sends each over /job/gateway.sock, runs the
/// shell `extra` (where `UNC` is the client), and collects its environment, `ls /job`
/// and every file of /job and /workspace as the artifact `dump.txt`.
pub(crate) fn gateway_skill(
    dir: &Path,
    id: &str,
    unc: &str,
    tools: &[&str],
    calls: &[(&str, String)],
    extra: &str,
) {
    let mut steps = vec![json!({ "id": "client", "type": "write_file",
        "arguments": { "path": format!("{id}.b64"), "content": unc } })];
    let mut names = Vec::new();
    for (name, req) in calls {
        steps.push(json!({ "id": format!("req-{name}"), "type": "write_file",
            "arguments": { "path": format!("{id}-{name}.http"), "content": req } }));
        names.push(*name);
    }
    let script = format!(
        "base64 -d {id}.b64 > {id}.unc && chmod 700 {id}.unc && for r in {}; do ./{id}.unc /job/gateway.sock < {id}-$r.http > {id}-$r.out; echo \"== $r\"; tail -n 1 {id}-$r.out; echo; done; {}(env; echo '== ls /job'; ls -a /job; find /job /workspace -type f ! -name dump.txt -exec cat {{}} +) > /tmp/dump 2>&1; mv /tmp/dump dump.txt; true",
        names.join(" "),
        extra.replace("UNC", &format!("{id}.unc"))
    );
    steps.push(json!({ "id": "call", "type": "run_command",
        "arguments": { "command": "sh", "args": ["-c", script] } }));
    let mut template = json!({
        "constraints": { "max_runtime_seconds": 120, "max_output_bytes": 262144,
            "allowed_commands": ["sh"], "allowed_paths": ["/workspace"] },
        "artifacts": ["dump.txt"],
        "steps": steps
    });
    if !tools.is_empty() {
        template["context"] = json!({ "mcp_tools": tools });
    }
    cynode_tests::write_skill(
        &dir.join(id),
        &format!("skill_id: {id}\nversion: 1.0.0\ndescription: call the sandbox gateway\npurpose: base-tools\nallowed_commands: [sh]\nlimits:\n  max_runtime_seconds: 120\n  max_output_bytes: 262144\ninputs_schema:\n  type: object\n  additionalProperties: false\n  properties: {{}}\n"),
        &template.to_string(),
        "{}",
    );
}

/// The data of the session's events of `kind` (its event stream, read to its end).
pub(crate) fn of_kind(events: &[(u64, String, Value)], kind: &str) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e.1 == kind)
        .map(|e| e.2.get("data").cloned().unwrap_or_else(|| e.2.clone()))
        .collect()
}

/// A `run`'s session history (its `--output json` record) as [`calls_of`] and
/// [`of_kind`] read events.
pub(crate) fn history(v: &Value) -> Vec<(u64, String, Value)> {
    v["state"]["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (0, e["kind"].as_str().unwrap_or_default().into(), e.clone()))
        .collect()
}

/// The job of a one-task session's record.
pub(crate) fn only_job(v: &Value) -> String {
    let jobs: Vec<String> = of_kind(&history(v), "job_dispatched")
        .iter()
        .filter_map(|d| d["job_id"].as_str().map(str::to_string))
        .collect();
    assert_eq!(jobs.len(), 1, "{v}");
    jobs[0].clone()
}

/// The `gateway_calls` of a job: (tool, outcome) in order.
pub(crate) fn calls_of(events: &[(u64, String, Value)], job_id: &str) -> Vec<(String, String)> {
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
        &["artifact.put", "skills.get", "db.query", "artifact.get"],
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
        "",
    );
    gateway_skill(
        &skills,
        "gw-two",
        &unc,
        &["artifact.put", "artifact.get"],
        &[
            ("put", put(theirs)),
            (
                "other",
                http_call("artifact.get", json!({ "sha256": sha(mine) })),
            ),
        ],
        "",
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
    let (r, id, v) =
        serve_session(&dir, "gw", &model, &front, &skills, "use the gateway", &[]).await;
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

/// Hostile jobs on the gateway path (serve, a real bwrap worker behind the recording
/// front, real SBA): a job listing no tools gets no token and no socket; a job listing
/// `skills.get` that posts `artifact.put` to the socket itself is refused by the gateway;
/// 50 calls with a 1 MiB tool name or path leave a small audit and nothing of them in the
/// log; of 100 one-byte puts the 65th is refused and the session keeps 64.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_jobs_are_bounded_by_the_gateway() {
    let dir = cynode_tests::tempdir().unwrap();
    let unc = unc_base64(dir.path());
    let skills = dir.path().join("skills");
    let x = sha(b"x");
    let one = |content: &[u8]| {
        http_call(
            "artifact.put",
            json!({ "path": "narrow.txt",
            "content_base64": base64::engine::general_purpose::STANDARD.encode(content),
            "sha256": sha(content) }),
        )
    };
    gateway_skill(&skills, "gw-none", &unc, &[], &[], "");
    gateway_skill(
        &skills,
        "gw-narrow",
        &unc,
        &["skills.get"],
        &[
            ("put", one(b"not listed\n")),
            (
                "skill",
                http_call("skills.get", json!({ "skill_id": "write-files" })),
            ),
        ],
        "",
    );
    let flood = format!(
        r#"{SH_REQ}head -c 1048576 /dev/zero | tr '\0' a > big; {{ printf '{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"'; cat big; printf '","arguments":{{}}}}}}'; }} > body; for i in $(seq 25); do req; done; {{ printf '{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"artifact.put","arguments":{{"path":"'; cat big; printf '","content_base64":"eA==","sha256":"{x}"}}}}}}'; }} > body; for i in $(seq 25); do req; done; rm -f big body req reply; "#
    );
    gateway_skill(&skills, "gw-flood", &unc, &["artifact.put"], &[], &flood);
    let many = format!(
        r#"{SH_REQ}for i in $(seq 100); do printf '{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"artifact.put","arguments":{{"path":"m%s.txt","content_base64":"eA==","sha256":"{x}"}}}}}}' $i > body; req; done; rm -f body req reply; "#
    );
    gateway_skill(&skills, "gw-many", &unc, &["artifact.put"], &[], &many);
    // The largest artifact (8 MiB) put and read back through the worker's socket.
    let big = format!(
        r#"{SH_REQ}head -c 8388608 /dev/urandom > blob; s=$(sha256sum blob | cut -d' ' -f1); {{ printf '{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"artifact.put","arguments":{{"path":"big.bin","sha256":"%s","content_base64":"' $s; base64 blob | tr -d '\n'; printf '"}}}}}}'; }} > body; req; echo "put: $(head -n 1 reply)" > big.txt; printf '{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"artifact.get","arguments":{{"sha256":"%s"}}}}}}' $s > body; req; echo "get: $(head -n 1 reply) bytes $(wc -c < reply) sha $(grep -c $s reply) error $(grep -c '"isError":true' reply)" >> big.txt; rm -f blob body req reply; "#
    );
    gateway_skill(
        &skills,
        "gw-big",
        &unc,
        &["artifact.put", "artifact.get"],
        &[],
        &big,
    );

    let worker = start_worker(0);
    let requests = Arc::new(Mutex::new(Vec::new()));
    let front = cynode_tests::worker::recording_front(worker.addr.clone(), requests.clone()).await;
    let tasks = ["gw-none", "gw-narrow", "gw-flood", "gw-many", "gw-big"];
    let mut script = vec![json!({ "type": "plan_update", "payload": {}, "state_patch":
        tasks.iter().enumerate().map(|(i, t)| json!({ "op": "add", "path": "/plan/-",
            "value": { "task_id": format!("t{i}"), "description": t, "status": "pending" } }))
            .collect::<Vec<_>>() })];
    for (i, t) in tasks.iter().enumerate() {
        script.push(json!({ "type": "job_request", "state_patch": [],
            "payload": { "task_id": format!("t{i}"), "skill_id": t, "inputs": {} } }));
    }
    script.push(json!({ "type": "final", "state_patch": [], "payload": { "summary": "done" } }));
    let (model, _m) = model_server(script);
    let (r, id, v) = serve_session(
        &dir,
        "gwh",
        &model,
        &front,
        &skills,
        "be hostile",
        // serve's defaults: the gateway's own 12 MiB bound (as run's), not the API's
        // 1 MiB, lets an 8 MiB put reach the handler.
        &[],
    )
    .await;
    let log = || std::fs::read_to_string(dir.path().join("gwh.log")).unwrap_or_default();
    assert_eq!(v["status"], "completed", "{v}\n{}", log());
    let events = crate::service::sse(&r.base, &id, None, None).await;
    let jobs: Vec<String> = v["deliverable"]["report"]["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["jobs"][0]["job_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(jobs.len(), 5, "{v}");

    // A job listing no tools: no token in its worker request, no socket in its sandbox.
    let seen = requests.lock().unwrap().clone();
    let req_of = |job: &str| {
        seen.iter()
            .find(|r| r["job_id"] == job)
            .cloned()
            .unwrap_or_else(|| panic!("no request for {job}: {seen:?}"))
    };
    assert!(
        req_of(&jobs[0]).get("gateway").is_none_or(Value::is_null),
        "{:?}",
        req_of(&jobs[0])
    );
    assert!(req_of(&jobs[1])["gateway"]["token"].is_string());
    let http = reqwest::Client::new();
    let dump = |job: &str| {
        let sha = v["artifacts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["path"] == "dump.txt" && a["job_id"] == job)
            .and_then(|a| a["sha256"].as_str())
            .unwrap_or_else(|| panic!("no dump of {job}: {v}"))
            .to_string();
        let (http, base, id) = (http.clone(), r.base.clone(), id.clone());
        async move {
            http.get(format!("{base}/v1/sessions/{id}/artifacts/{sha}"))
                .bearer_auth(TENANT_A)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        }
    };
    // `ls -a /job` (the files after it, job.json among them, name the socket's path).
    let ls = |d: &str| -> String {
        let at = d
            .find("== ls /job")
            .unwrap_or_else(|| panic!("no ls in {d}"));
        d[at..]
            .lines()
            .skip(1)
            .take_while(|l| !l.starts_with('{'))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let none = ls(&dump(&jobs[0]).await);
    assert!(
        none.contains("job.json") && !none.contains("gateway.sock"),
        "a socket without tools: {none}"
    );
    let narrow = ls(&dump(&jobs[1]).await);
    assert!(narrow.contains("gateway.sock"), "{narrow}");
    assert!(calls_of(&events, &jobs[0]).is_empty(), "{events:?}");

    // Listing skills.get, posting artifact.put itself: the gateway refuses it.
    let s = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(
        calls_of(&events, &jobs[1]),
        [s("artifact.put", "refused"), s("skills.get", "ok")],
        "{events:?}"
    );
    let narrow = of_kind(&events, "gateway_calls")
        .into_iter()
        .find(|d| d["job_id"] == jobs[1].as_str())
        .unwrap();
    assert!(
        narrow["calls"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("context.mcp_tools"),
        "{narrow}"
    );
    assert!(
        !v["artifacts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["path"] == "narrow.txt"),
        "{v}"
    );

    // 50 calls with a 1 MiB name or path: refused, a small audit, nothing in the log.
    let flood = of_kind(&events, "gateway_calls")
        .into_iter()
        .find(|d| d["job_id"] == jobs[2].as_str())
        .unwrap_or_else(|| panic!("no gateway_calls of the flood: {events:?}"));
    let size = flood.to_string().len();
    eprintln!("the flood's gateway_calls event: {size} bytes");
    assert!(size < 100 * 1024, "{size} bytes");
    let calls = calls_of(&events, &jobs[2]);
    assert_eq!(calls.len(), 50, "{calls:?}");
    assert!(
        calls[..25].iter().all(|c| *c == s("<invalid>", "refused")),
        "{calls:?}"
    );
    assert!(
        calls[25..]
            .iter()
            .all(|c| *c == s("artifact.put", "refused")),
        "{calls:?}"
    );
    let a1k = "a".repeat(1024);
    assert!(!log().contains(&a1k), "the log repeats a hostile name");
    assert!(
        !format!("{v}{events:?}").contains(&a1k),
        "the session repeats a hostile name"
    );

    // 100 one-byte puts: 64 stored, the 65th and later refused.
    let calls = calls_of(&events, &jobs[3]);
    assert_eq!(calls.len(), 100, "{calls:?}");
    assert!(
        calls[..64].iter().all(|c| *c == s("artifact.put", "ok")),
        "{calls:?}"
    );
    assert!(
        calls[64..]
            .iter()
            .all(|c| *c == s("artifact.put", "refused")),
        "{calls:?}"
    );
    let kept = v["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["job_id"] == jobs[3].as_str() && a["path"] != "dump.txt")
        .count();
    assert_eq!(kept, 64, "{v}");

    // 8 MiB put and got back whole through the worker's socket.
    let big = dump(&jobs[4]).await;
    // (The dump concatenates files: a line may follow the end of the previous file.)
    let line = |p: &str| {
        big.lines()
            .find_map(|l| l.find(p).map(|at| l[at..].to_string()))
            .unwrap_or_else(|| panic!("no {p} in {big}"))
    };
    assert!(line("put: HTTP/").contains(" 200 "), "{big}");
    let get = line("get: HTTP/");
    assert!(get.contains(" 200 ") && get.contains(" error 0"), "{get}");
    // The whole artifact's base64 (11,184,812 bytes) is in the reply, once.
    let bytes: u64 = get
        .split(" bytes ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!((11_184_812..12 << 20).contains(&bytes), "{get}");
    assert!(get.contains(" sha 1 "), "{get}");
    assert_eq!(
        calls_of(&events, &jobs[4]),
        [s("artifact.put", "ok"), s("artifact.get", "ok")],
        "{events:?}"
    );
    drop(r);
}

/// A session of a `serve` replica `name` (its scripted model at `model`, its worker at
/// `front`, the skills of `skills` too) for `objective`: the replica, the session's id
/// and its final record.
async fn serve_session(
    dir: &cynode_tests::TempDir,
    name: &str,
    model: &str,
    front: &str,
    skills: &Path,
    objective: &str,
    more: &[&str],
) -> (crate::service::Replica, String, Value) {
    let db = format!("sqlite://{}", dir.path().join("pm.db").display());
    let skill_dir = skills.display().to_string();
    let r = start_replica_with(
        dir.path(),
        name,
        &db,
        model,
        &[&["--worker-endpoint", front][..], more].concat(),
        &["--skill-dir", "skills", "--skill-dir", &skill_dir],
    );
    let (s, v) = call(
        reqwest::Method::POST,
        &format!("{}/v1/sessions", r.base),
        TENANT_A,
        Some(json!({ "objective": objective })),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let id = v["session_id"].as_str().unwrap().to_string();
    let v = wait_status(
        &r.base,
        &id,
        &["completed", "failed"],
        Duration::from_secs(300),
    )
    .await;
    (r, id, v)
}

/// A bwrap worker whose inference upstream is `model` (serving `smollm2`); its directory
/// goes with the returned guard.
/// A worker and its directory. The fields drop in order: the worker stops before its
/// directory checks that it left nothing mounted.
struct InferenceWorker {
    _child: cynode_testkit::OwnedChild,
    addr: String,
    _dir: cynode_tests::TempDir,
}

fn worker_with_inference(model: &str) -> InferenceWorker {
    use std::os::unix::fs::PermissionsExt;
    let dir = cynode_tests::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(dir.path().join("token"), cynode_tests::TOKEN).unwrap();
    let cfg = format!(
        "listen: 127.0.0.1:0\nbackend: bwrap\nstate_dir: {}\ntoken_file: {}\nbwrap:\n  rootfs:\n    \"localhost/cynode-sba-test:latest\": {}\ninference:\n  base_url: {model}\n  models: [smollm2]\n",
        dir.path().join("state").display(),
        dir.path().join("token").display(),
        cynode_tests::rootfs().display()
    );
    std::fs::write(dir.path().join("w.yaml"), &cfg).unwrap();
    let (child, addr) = cynode_tests::worker::serve_worker(&dir.path().join("w.yaml"));
    InferenceWorker {
        _child: child,
        addr,
        _dir: dir,
    }
}

/// What the agent of [`agent_model`] puts as `agent/note.txt`.
const NOTE: &str = "written by the agent through the gateway\n";

/// The SBA's scripted model: put a note, read a skill, try a tool the job does not list
/// (`artifact.list`, which the gateway would allow), finish.
fn agent_model() -> (String, cynode_tests::Model) {
    model_server(vec![
        act(
            "tool_call",
            json!({ "name": "artifact.put",
            "arguments": { "path": "agent/note.txt", "content": NOTE } }),
        ),
        act(
            "tool_call",
            json!({ "name": "skills.get", "arguments": { "skill_id": "write-files" } }),
        ),
        act(
            "tool_call",
            json!({ "name": "artifact.list", "arguments": {} }),
        ),
        act(
            "finish",
            json!({ "status": "success", "final_answer": "note stored" }),
        ),
    ])
}

/// The skill `gw-agent` in `skills`: an agent job that lists `artifact.put` and
/// `skills.get`.
fn agent_skill(skills: &Path) {
    let template = json!({
        "execution_mode": "agent_inference",
        "inference": { "allowed_models": ["smollm2"] },
        "constraints": { "max_runtime_seconds": 90, "max_output_bytes": 65536 },
        "context": { "task_context": "store a note as an artifact of this task",
                     "mcp_tools": ["artifact.put", "skills.get"] }
    });
    cynode_tests::write_skill(
        &skills.join("gw-agent"),
        "skill_id: gw-agent\nversion: 1.0.0\ndescription: an agent that uses the gateway\npurpose: base-tools\nallowed_commands: [sh]\nlimits:\n  max_runtime_seconds: 90\n  max_output_bytes: 65536\ninputs_schema:\n  type: object\n  additionalProperties: false\n  properties: {}\n",
        &template.to_string(),
        "{}",
    );
}

/// One action of the SBA's scripted model.
fn act(ty: &str, arguments: Value) -> Value {
    json!({ "thought": ty, "action": { "type": ty, "arguments": arguments } })
}

/// The PM's turns: one task (plan), the `gw-agent` job, final.
fn agent_pm_script() -> [Value; 3] {
    [
        json!({ "type": "plan_update", "payload": {}, "state_patch": [
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "note", "status": "pending" } }] }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": "gw-agent", "inputs": {} } }),
        json!({ "type": "final", "state_patch": [], "payload": { "summary": "done" } }),
    ]
}

/// The PM's scripted model: [`agent_pm_script`].
fn agent_pm_model() -> (String, cynode_tests::Model) {
    model_server(agent_pm_script().to_vec())
}

/// `cynode-pm run OBJECTIVE` on its own local worker with the skills in `skills`: the
/// completed session.
fn run_on_local_worker(dir: &Path, model: &str, objective: &str, skills: &Path) -> Value {
    let skill_dir = skills.display().to_string();
    let out = cynode_tests::pm_with(
        &dir.join("state"),
        model,
        &["run", objective, "--skill-dir", &skill_dir],
        &[],
    );
    cynode_tests::completed(&out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_job_calls_its_listed_tools_and_an_unlisted_one_never_reaches_the_gateway() {
    let dir = cynode_tests::tempdir().unwrap();
    let note = NOTE;
    let (sba_model_url, sba_model) = agent_model();
    let worker = worker_with_inference(&sba_model_url);
    let worker_addr = worker.addr.clone();
    let skills = dir.path().join("skills");
    agent_skill(&skills);
    let (pm_model, pm_model_handle) = agent_pm_model();
    let endpoint = format!("http://{worker_addr}");
    let (r, id, v) = serve_session(
        &dir,
        "gwa",
        &pm_model,
        &endpoint,
        &skills,
        "let an agent use the gateway",
        &[],
    )
    .await;
    let log = || std::fs::read_to_string(dir.path().join("gwa.log")).unwrap_or_default();
    assert_eq!(v["status"], "completed", "{v}\n{}", log());
    let job = v["deliverable"]["report"]["tasks"][0]["jobs"][0]["job_id"]
        .as_str()
        .unwrap()
        .to_string();

    // The gateway's audit of the job: the two listed calls, nothing of artifact.list.
    let events = crate::service::sse(&r.base, &id, None, None).await;
    let s = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(
        calls_of(&events, &job),
        [s("artifact.put", "ok"), s("skills.get", "ok")],
        "{events:?}"
    );
    // The put joined the session, verified.
    assert!(
        v["artifacts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["sha256"] == sha(note.as_bytes()) && a["path"] == "agent/note.txt"),
        "{v}"
    );
    // The SBA's model read the skill, then the refusal of the unlisted tool.
    let turns = sba_model.requests();
    assert_eq!(turns.len(), 4, "{turns:?}");
    let last_user = |i: usize| {
        turns[i]["messages"].as_array().unwrap().last().unwrap()["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert!(
        last_user(1).starts_with("Result of tool_call artifact.put: ok"),
        "{}",
        last_user(1)
    );
    assert!(
        last_user(2).starts_with("Result of tool_call skills.get: ok"),
        "{}",
        last_user(2)
    );
    assert!(last_user(2).contains("write-files"), "{}", last_user(2));
    assert!(
        last_user(3).starts_with("Result of tool_call artifact.list: refused\ntool `artifact.list` refused: not in context.mcp_tools"),
        "{}",
        last_user(3)
    );
    // result.json recorded all three (the PM's model reads them in the job's result).
    let fed: Vec<String> = pm_model_handle
        .requests()
        .iter()
        .flat_map(|b| b["messages"].as_array().cloned().unwrap_or_default())
        .filter_map(|m| m["content"].as_str().map(str::to_string))
        .filter_map(|c| {
            let prefix = format!("result of job {job}: ");
            let at = c.find(&prefix)? + prefix.len();
            c[at..].lines().next().map(str::to_string)
        })
        .collect();
    assert!(!fed.is_empty(), "the PM's model never saw the job's result");
    let result: Value = serde_json::from_str(&fed[0]).unwrap();
    let recorded: Vec<(String, String)> = result["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("no tool_calls in {result}"))
        .iter()
        .map(|c| s(c["tool"].as_str().unwrap(), c["outcome"].as_str().unwrap()))
        .collect();
    assert_eq!(
        recorded,
        [
            s("artifact.put", "ok"),
            s("skills.get", "ok"),
            s("artifact.list", "refused")
        ]
    );
    assert_eq!(result["tool_calls"][2]["bytes"], 0);
    assert!(result["tool_calls"][0]["bytes"].as_u64().unwrap() > 0);
}

/// A session of `serve` (scripted model, real bwrap worker behind a recording front) whose
/// one job sleeps, and the gateway token the PM handed the worker for it, once the job
/// runs and the token is accepted.
struct RunningJob {
    r: crate::service::Replica,
    worker: Option<cynode_tests::Worker>,
    session: String,
    token: String,
    _model: cynode_tests::Model,
    dir: cynode_tests::TempDir,
}

/// `artifact.list` on the PM's gateway with `token`: the status and the problem's detail.
async fn list_with(base: &str, token: &str) -> (u16, String) {
    let resp = reqwest::Client::new()
        .post(format!("{base}/v1/gateway"))
        .header("accept", "application/json, text/event-stream")
        .bearer_auth(token)
        .json(&json!({ "jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": { "name": "artifact.list", "arguments": {} } }))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let v: Value = resp.json().await.unwrap_or(Value::Null);
    (status, v["detail"].as_str().unwrap_or_default().to_string())
}

/// Polls until `token` is refused (401) or `within` passes; returns how long it took.
async fn refused_within(base: &str, token: &str, within: Duration) -> Duration {
    let t = std::time::Instant::now();
    loop {
        let (status, detail) = list_with(base, token).await;
        if status == 401 {
            assert!(detail.contains("unknown or revoked"), "{detail}");
            return t.elapsed();
        }
        assert_eq!(status, 200, "{detail}");
        assert!(
            t.elapsed() < within,
            "the token is still accepted after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn running_job(name: &str) -> RunningJob {
    let dir = cynode_tests::tempdir().unwrap();
    let skills = dir.path().join("skills");
    let template = json!({
        "constraints": { "max_runtime_seconds": 120, "max_output_bytes": 65536,
            "allowed_commands": ["sh"], "allowed_paths": ["/workspace"] },
        "context": { "mcp_tools": ["artifact.list"] },
        "steps": [{ "id": "wait", "type": "run_command",
            "arguments": { "command": "sh", "args": ["-c", "sleep 100"] } }]
    });
    cynode_tests::write_skill(
        &skills.join("gw-sleep"),
        "skill_id: gw-sleep\nversion: 1.0.0\ndescription: sleep while holding a gateway token\npurpose: base-tools\nallowed_commands: [sh]\nlimits:\n  max_runtime_seconds: 120\n  max_output_bytes: 65536\ninputs_schema:\n  type: object\n  additionalProperties: false\n  properties: {}\n",
        &template.to_string(),
        "{}",
    );
    let worker = start_worker(0);
    let requests = Arc::new(Mutex::new(Vec::new()));
    let front = cynode_tests::worker::recording_front(worker.addr.clone(), requests.clone()).await;
    let plan = json!({ "type": "plan_update", "payload": {}, "state_patch": [
        { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "wait", "status": "pending" } }] });
    let (model, m) = model_server(vec![
        plan,
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": "gw-sleep", "inputs": {} } }),
    ]);
    let db = format!("sqlite://{}", dir.path().join("pm.db").display());
    let skill_dir = skills.display().to_string();
    let r = start_replica_with(
        dir.path(),
        name,
        &db,
        &model,
        &["--worker-endpoint", &front],
        &["--skill-dir", "skills", "--skill-dir", &skill_dir],
    );
    let (s, v) = call(
        reqwest::Method::POST,
        &format!("{}/v1/sessions", r.base),
        TENANT_A,
        Some(json!({ "objective": "hold a token" })),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let session = v["session_id"].as_str().unwrap().to_string();
    // The job's token, once the worker has the job and reports it running.
    let t = std::time::Instant::now();
    let token = loop {
        let seen = requests.lock().unwrap().clone();
        if let Some(tok) = seen.iter().find_map(|r| r["gateway"]["token"].as_str()) {
            let job = seen[0]["job_id"].as_str().unwrap().to_string();
            let s = worker.get(&format!("/v1/worker/jobs/{job}")).await;
            let st: Value = s.json().await.unwrap();
            if st["status"] == "in_progress" {
                break tok.to_string();
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(90),
            "no running job with a token: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (status, detail) = list_with(&r.base, &token).await;
    assert_eq!(status, 200, "a running job's token is accepted: {detail}");
    RunningJob {
        r,
        worker: Some(worker),
        session,
        token,
        _model: m,
        dir,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_is_refused_once_its_session_is_canceled() {
    let j = running_job("gwc").await;
    let (s, v) = call(
        reqwest::Method::POST,
        &format!("{}/v1/sessions/{}:cancel", j.r.base, j.session),
        TENANT_A,
        None,
    )
    .await;
    assert!(s == 200 || s == 202, "{s} {v}");
    let took = refused_within(&j.r.base, &j.token, Duration::from_secs(60)).await;
    eprintln!("token refused {took:?} after the cancel");
    let v = wait_status(
        &j.r.base,
        &j.session,
        &["canceled"],
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(v["status"], "canceled", "{v}");
    let log = std::fs::read_to_string(j.dir.path().join("gwc.log")).unwrap_or_default();
    assert!(!log.contains(&j.token[4..]), "a token in the PM's log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_is_refused_once_its_worker_dies_and_the_job_fails() {
    let mut j = running_job("gwd").await;
    // The worker and its sandbox go (the process group is killed).
    drop(j.worker.take());
    let took = refused_within(&j.r.base, &j.token, Duration::from_secs(150)).await;
    eprintln!("token refused {took:?} after the worker died");
    let v = wait_status(
        &j.r.base,
        &j.session,
        &["failed", "completed", "canceled"],
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(v["status"], "failed", "{v}");
}

/// `cynode-pm run` hosts the gateway for its own session: an agent job of a `run` (on a
/// worker of this machine) calls its listed tools, and the calls are in the session.
#[test]
fn run_hosts_the_gateway_for_its_own_session() {
    let dir = cynode_tests::tempdir().unwrap();
    let (sba_model_url, _sba_model) = agent_model();
    let worker = worker_with_inference(&sba_model_url);
    let worker_addr = worker.addr.clone();
    let skills = dir.path().join("skills");
    agent_skill(&skills);
    let (pm_model, _pm_model) = agent_pm_model();
    // The worker behind the recording front: the token run hands it is the test's.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let requests = Arc::new(Mutex::new(Vec::new()));
    let endpoint = rt.block_on(cynode_tests::worker::recording_front(
        worker_addr.clone(),
        requests.clone(),
    ));
    let skill_dir = skills.display().to_string();
    let state = dir.path().join("state");
    let out = cynode_tests::pm_with(
        &state,
        &pm_model,
        &[
            "run",
            "let an agent use the gateway",
            "--worker-endpoint",
            &endpoint,
            "--skill-dir",
            &skill_dir,
        ],
        &[("CYNODE_WORKER_TOKEN", cynode_tests::TOKEN)],
    );
    let v = cynode_tests::completed(&out);
    // The token is nowhere in run's output, its state directory (store, log) or record.
    let tokens: Vec<String> = requests
        .lock()
        .unwrap()
        .iter()
        .filter_map(|r| r["gateway"]["token"].as_str().map(str::to_string))
        .collect();
    assert_eq!(tokens.len(), 1, "{:?}", requests.lock().unwrap());
    let secret = tokens[0].as_bytes()[4..].to_vec();
    let holds = |hay: &[u8]| hay.windows(secret.len()).any(|w| w == secret.as_slice());
    assert!(
        !holds(&out.stdout) && !holds(&out.stderr),
        "a token in run's output"
    );
    let mut files = 0;
    let mut todo = vec![state.clone()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let t = e.file_type().unwrap();
            if t.is_dir() {
                todo.push(e.path());
            } else if t.is_file() {
                files += 1;
                let bytes = std::fs::read(e.path()).unwrap_or_default();
                assert!(!holds(&bytes), "a token in {}", e.path().display());
            }
        }
    }
    assert!(files > 0, "nothing in {}", state.display());
    drop(rt);
    let calls = calls_of(&history(&v), &only_job(&v));
    let s = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(
        calls,
        [s("artifact.put", "ok"), s("skills.get", "ok")],
        "{v}"
    );
    assert!(
        v["state"]["artifacts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["sha256"] == sha(NOTE.as_bytes())),
        "{v}"
    );
}

/// `cynode-pm run` on its own local worker: the gateway URL reaches that worker too, and a
/// job calls the gateway through `/job/gateway.sock` (direct steps with the test's
/// Unix-socket client: the local worker has no inference upstream for an agent).
#[test]
fn run_hands_its_gateway_to_its_local_worker() {
    let dir = cynode_tests::tempdir().unwrap();
    let unc = unc_base64(dir.path());
    let skills = dir.path().join("skills");
    gateway_skill(
        &skills,
        "gw-local",
        &unc,
        &["skills.get", "artifact.list"],
        &[
            (
                "skill",
                http_call("skills.get", json!({ "skill_id": "write-files" })),
            ),
            ("list", http_call("artifact.list", json!({}))),
        ],
        "",
    );
    let (pm_model, _m) = model_server(cynode_tests::one_job_script(
        "call the gateway",
        "gw-local",
        json!({}),
        "done",
    ));
    let v = run_on_local_worker(
        dir.path(),
        &pm_model,
        "call the gateway from a local job",
        &skills,
    );
    let calls = calls_of(&history(&v), &only_job(&v));
    let s = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(
        calls,
        [s("skills.get", "ok"), s("artifact.list", "ok")],
        "{v}"
    );
}

/// `cynode-pm run` gives its own local worker its model (keyless here) as the inference
/// upstream, so an agent job of a `run` on that worker gets a model and calls the gateway.
/// One scripted model serves both: the PM's turns, then the agent's, then the PM's final.
#[test]
fn run_gives_its_local_worker_its_model_so_an_agent_job_runs() {
    let dir = cynode_tests::tempdir().unwrap();
    let skills = dir.path().join("skills");
    agent_skill(&skills);
    let [plan, job, fin] = agent_pm_script();
    let (model, m) = model_server(vec![
        plan,
        job,
        act(
            "tool_call",
            json!({ "name": "artifact.put",
            "arguments": { "path": "agent/note.txt", "content": NOTE } }),
        ),
        act(
            "finish",
            json!({ "status": "success", "final_answer": "note stored" }),
        ),
        fin,
    ]);
    let v = run_on_local_worker(
        dir.path(),
        &model,
        "let an agent use the gateway on the local worker",
        &skills,
    );
    let calls = calls_of(&history(&v), &only_job(&v));
    assert_eq!(
        calls,
        [("artifact.put".to_string(), "ok".to_string())],
        "{v}"
    );
    assert!(
        v["state"]["artifacts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["sha256"] == sha(NOTE.as_bytes())),
        "{v}"
    );
    // The agent's two turns reached the model through the worker: 5 requests in all.
    assert_eq!(m.requests().len(), 5, "{:?}", m.requests());
}
