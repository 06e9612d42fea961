//! The job's gateway socket (`/job/gateway.sock`, `gateway_forward.rs`) on the real
//! worker, against a hostile job: it floods the socket with connections and huge or
//! unfinished bodies, and sends its own `Authorization`. The node keeps answering, its
//! descriptors and memory stay bounded, nothing huge reaches the PM side, the PM side sees
//! the node's token only, and the token is in neither the node's state nor its log.
//! The PM side here is a small recording HTTP server on 127.0.0.1 (the real PM gateway
//! is exercised end to end in the workspace's `tests/tests/gateway.rs`).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::HeaderMap;
use cynode_testkit::flood;
use serde_json::json;

use crate::harness::{env, unique, Server};

const TOKEN: &str = "cgw_test_9f8e7d6c5b4a39281706f5e4d3c2b1a0";

#[derive(Clone, Default)]
struct Seen {
    auth: Arc<Mutex<Vec<String>>>,
    largest: Arc<AtomicU64>,
    calls: Arc<AtomicU64>,
}

async fn record(
    State(s): State<Seen>,
    headers: HeaderMap,
    body: Bytes,
) -> axum::Json<serde_json::Value> {
    s.calls.fetch_add(1, Ordering::SeqCst);
    s.largest.fetch_max(body.len() as u64, Ordering::SeqCst);
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("<none>")
        .to_string();
    s.auth.lock().unwrap().push(auth);
    axum::Json(json!({ "jsonrpc": "2.0", "id": 1, "result": { "ok": true } }))
}

/// The recording PM side on 127.0.0.1; its URL.
async fn pm_side(seen: Seen) -> String {
    let app = axum::Router::new()
        .route("/v1/gateway", axum::routing::post(record))
        .layer(DefaultBodyLimit::disable())
        .with_state(seen);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/gateway", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await });
    url
}

/// Waits (at most 30 s) for the job's gateway socket to be there.
async fn appears(sock: &Path) {
    let until = Instant::now() + Duration::from_secs(30);
    while !sock.exists() {
        assert!(Instant::now() < until, "gateway.sock never appeared");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn exchange(sock: &Path, request: &[u8]) -> (u16, String) {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let _ = s.write_all(request);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out);
    let (status, body) = crate::harness::status_and_body(&text);
    (status, body.to_string())
}

fn post(path: &str, extra_headers: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\n{extra_headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

async fn healthz_ok(api: &str, during: &str) {
    let c = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    for _ in 0..3 {
        let r = c
            .get(format!("{api}/healthz"))
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        assert!(
            matches!(&r, Ok(r) if r.status() == 200),
            "/healthz during {during}: {r:?}"
        );
    }
}

/// The first file under `dir` (the node's state: job store, job directories) holding
/// `needle`.
fn any_file_contains(dir: &Path, needle: &str) -> Option<PathBuf> {
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let Ok(m) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            if m.is_dir() {
                stack.push(p);
            } else if m.is_file() && m.len() <= 64 << 20 {
                // (Larger files are the sandbox's disk images, which the token never
                // reaches: the sandbox never has it.)
                if let Ok(b) = std::fs::read(&p) {
                    if String::from_utf8_lossy(&b).contains(needle) {
                        return Some(p);
                    }
                }
            }
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cannot_starve_the_node_through_its_gateway_socket() {
    env();
    let seen = Seen::default();
    let url = pm_side(seen.clone()).await;
    let sv = Server::start("bwrap", "");
    let pid = sv.pid();
    let api = format!("http://{}", sv.addr);
    let id = unique("gw");
    let body = json!({
        "version": 1, "task_id": "t", "job_id": id,
        "sandbox": { "image": env().image, "command": ["sleep", "100"] },
        "gateway": { "url": url, "token": TOKEN }
    });
    let (code, v) = sv.post("/v1/worker/jobs", &body).await;
    assert_eq!(code, 202, "{v}");
    let sock = sv
        .state_dir()
        .join("jobs")
        .join(&id)
        .join("job")
        .join("gateway.sock");
    appears(&sock).await;
    // Accepted again with the same request and another token: the same job (the token
    // is not part of the request's identity).
    let mut again = body.clone();
    again["gateway"]["token"] = json!(format!("{TOKEN}x"));
    let (code, v) = sv.post("/v1/worker/jobs", &again).await;
    assert_eq!(code, 200, "{v}");
    again["gateway"]["token"] = json!(TOKEN);
    let (code, v) = sv.post("/v1/worker/jobs", &again).await;
    assert_eq!(code, 200, "{v}");

    // A call: the sandbox's own Authorization is dropped, the node's token added.
    let call = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"skills.list","arguments":{}}}"#;
    let (code, answer) = tokio::task::spawn_blocking({
        let sock = sock.clone();
        move || {
            exchange(
                &sock,
                &post("/", "Authorization: Bearer from-the-sandbox\r\n", call),
            )
        }
    })
    .await
    .unwrap();
    assert_eq!(code, 200, "{answer}");
    assert!(answer.contains("\"ok\":true"), "{answer}");
    assert_eq!(
        seen.auth.lock().unwrap().as_slice(),
        [format!("Bearer {TOKEN}")],
        "what the PM side saw"
    );
    let (code, _) = tokio::task::spawn_blocking({
        let sock = sock.clone();
        move || {
            exchange(
                &sock,
                b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            )
        }
    })
    .await
    .unwrap();
    assert_eq!(code, 405);
    let (code, _) = tokio::task::spawn_blocking({
        let sock = sock.clone();
        move || exchange(&sock, &post("/v1/elsewhere", "", call))
    })
    .await
    .unwrap();
    assert_eq!(code, 404);

    let fds_before = flood::held_descriptors(pid);
    let rss_before = flood::rss_kib(pid);
    // 1500 connections, more than the job socket's cap of 16.
    let mut held = Vec::new();
    for _ in 0..1500 {
        let c = tokio::time::timeout(
            Duration::from_secs(1),
            tokio::net::UnixStream::connect(&sock),
        )
        .await;
        if let Ok(Ok(s)) = c {
            held.push(s);
        }
    }
    healthz_ok(&api, "1500 gateway connections").await;
    let fds = flood::held_descriptors(pid);
    assert!(
        fds <= fds_before + 16 + 24,
        "the node holds {fds} descriptors (before: {fds_before}; {} connections made)",
        held.len()
    );
    drop(held);

    // A body of a declared 100 MiB: refused at the cap, never forwarded.
    let huge = tokio::task::spawn_blocking({
        let sock = sock.clone();
        move || {
            let mut s = UnixStream::connect(&sock).unwrap();
            s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let head = format!(
                "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                100u64 << 20
            );
            let _ = s.write_all(head.as_bytes());
            let chunk = vec![b'a'; 1 << 20];
            for _ in 0..100 {
                if s.write_all(&chunk).is_err() {
                    break;
                }
            }
            let mut out = Vec::new();
            let _ = s.read_to_end(&mut out);
            String::from_utf8_lossy(&out).into_owned()
        }
    })
    .await
    .unwrap();
    assert!(
        huge.starts_with("HTTP/1.1 413"),
        "{}",
        &huge[..huge.len().min(300)]
    );

    // Sixteen unfinished 30 MiB bodies at once: two are read (each up to the cap), the
    // others wait for a place and are refused; the node's memory stays bounded.
    let writers: Vec<_> = (0..16)
        .map(|_| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let mut s = UnixStream::connect(&sock).unwrap();
                s.set_write_timeout(Some(Duration::from_secs(15))).unwrap();
                let head = "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 33554432\r\n\r\n";
                let _ = s.write_all(head.as_bytes());
                let chunk = vec![b'a'; 1 << 20];
                for _ in 0..30 {
                    if s.write_all(&chunk).is_err() {
                        break;
                    }
                }
                s
            })
        })
        .collect();
    let unfinished: Vec<UnixStream> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    let rss = flood::rss_kib(pid);
    assert!(
        rss < rss_before + 64 * 1024,
        "the node's resident memory went from {rss_before} KiB to {rss} KiB"
    );
    healthz_ok(&api, "unfinished gateway bodies").await;
    drop(unfinished);
    assert!(
        seen.largest.load(Ordering::SeqCst) < 1 << 20,
        "the PM side received a body of {} bytes",
        seen.largest.load(Ordering::SeqCst)
    );
    eprintln!(
        "gateway flood: descriptors {fds_before} -> {fds}, rss {rss_before} -> {rss} KiB, PM side calls {}",
        seen.calls.load(Ordering::SeqCst)
    );

    // The job still gets through afterwards.
    let until = Instant::now() + Duration::from_secs(40);
    loop {
        let (code, answer) = tokio::task::spawn_blocking({
            let sock = sock.clone();
            move || exchange(&sock, &post("/", "", call))
        })
        .await
        .unwrap();
        if code == 200 {
            break;
        }
        assert!(
            Instant::now() < until,
            "no call got through after the flood: {code} {answer}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // The token is nowhere in the node's state (job store, job directory) nor its log.
    assert_eq!(any_file_contains(&sv.state_dir(), TOKEN), None);
    let (_, status) = sv.get(&format!("/v1/worker/jobs/{id}")).await;
    assert!(!status.to_string().contains(TOKEN));
    let _ = sv
        .post(&format!("/v1/worker/jobs/{id}:stop"), &json!({}))
        .await;
    sv.wait_terminal(&id).await;
    assert!(!sock.exists(), "the socket outlived its job");
    assert_eq!(any_file_contains(&sv.state_dir(), TOKEN), None);
    let log = sv.log.lock().unwrap().join("\n");
    assert!(!log.contains(TOKEN), "the token reached the node's log");
    assert!(log.contains("gateway socket closed"), "{log}");
}

/// The recording PM side over HTTPS, its certificate (for `localhost`) issued by a
/// private CA: (URL, CA PEM).
async fn pm_side_https(seen: Seen, dir: &Path) -> (String, String) {
    let (ca_pem, cert, key) = crate::egress::certificates("localhost");
    let (cert_file, key_file) = (dir.join("pm.pem"), dir.join("pm-key.pem"));
    std::fs::write(&cert_file, cert).unwrap();
    std::fs::write(&key_file, key).unwrap();
    let app = axum::Router::new()
        .route("/v1/gateway", axum::routing::post(record))
        .with_state(seen);
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!(
        "https://localhost:{}/v1/gateway",
        l.local_addr().unwrap().port()
    );
    let tls = cynode_tls::ServerTls {
        cert_file,
        key_file,
        client_ca_file: None,
    };
    tokio::spawn(async move {
        let _ = cynode_tls::serve(l, app, Some(tls), std::future::pending()).await;
    });
    (url, ca_pem)
}

/// A PM whose gateway is `https://` with a certificate of a private CA: a node without
/// that CA refuses the certificate (502 to the job, the reason in its log) and the PM side
/// sees nothing, so a node never sends a token to a server it cannot verify; a node given
/// the CA (`gateway.tls.ca_file`) forwards the call; a node whose `gateway.tls` names a
/// missing file does not start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_gateway_of_a_private_ca_is_reached_only_when_the_node_trusts_it() {
    env();
    let certs = tempfile::tempdir().unwrap();
    let seen = Seen::default();
    let (url, ca_pem) = pm_side_https(seen.clone(), certs.path()).await;
    let ca_file = certs.path().join("pm-ca.pem");
    std::fs::write(&ca_file, &ca_pem).unwrap();

    let call_through = |sv: &Server| {
        let (sv_addr, state) = (sv.addr.clone(), sv.state_dir());
        let url = url.clone();
        async move {
            let client = reqwest::Client::new();
            let id = unique("gw-tls");
            let body = json!({
                "version": 1, "task_id": "t", "job_id": id,
                "sandbox": { "image": env().image, "command": ["sleep", "100"] },
                "gateway": { "url": url, "token": TOKEN }
            });
            let r = client
                .post(format!("http://{sv_addr}/v1/worker/jobs"))
                .bearer_auth(crate::harness::TOKEN)
                .json(&body)
                .timeout(Duration::from_secs(60))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 202);
            let sock = state
                .join("jobs")
                .join(&id)
                .join("job")
                .join("gateway.sock");
            appears(&sock).await;
            let call = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"skills.list","arguments":{}}}"#;
            let answer = tokio::task::spawn_blocking(move || exchange(&sock, &post("/", "", call)))
                .await
                .unwrap();
            (id, answer)
        }
    };

    // A node without the CA.
    let untrusting = Server::start("bwrap", "");
    let (id, (code, answer)) = call_through(&untrusting).await;
    assert_eq!(
        code, 502,
        "an unverifiable gateway must not be reached: {answer}"
    );
    assert_eq!(
        seen.calls.load(Ordering::SeqCst),
        0,
        "the PM side was reached"
    );
    // The line may reach the log's reader a moment after the answer.
    let named = |log: &str| {
        log.lines()
            .any(|l| l.contains("gateway upstream failed") && l.contains("certificate"))
    };
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut log = untrusting.log.lock().unwrap().join("\n");
    while !named(&log) && std::time::Instant::now() < until {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        log = untrusting.log.lock().unwrap().join("\n");
    }
    assert!(
        named(&log),
        "the node's log should name the certificate problem: {log}"
    );
    let _ = untrusting
        .post(&format!("/v1/worker/jobs/{id}:stop"), &json!({}))
        .await;
    untrusting.wait_terminal(&id).await;
    drop(untrusting);

    // A node given the CA.
    let sv = Server::start(
        "bwrap",
        &format!("gateway:\n  tls:\n    ca_file: {}\n", ca_file.display()),
    );
    let (id, (code, answer)) = call_through(&sv).await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(
        seen.auth.lock().unwrap().as_slice(),
        [format!("Bearer {TOKEN}")],
        "what the PM side saw"
    );
    let _ = sv
        .post(&format!("/v1/worker/jobs/{id}:stop"), &json!({}))
        .await;
    sv.wait_terminal(&id).await;
    drop(sv);

    // A node whose gateway.tls names a file that is not there.
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, crate::harness::TOKEN).unwrap();
    let config = dir.path().join("worker.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nbackend: bwrap\nstate_dir: {}\ntoken_file: {}\ngateway:\n  tls:\n    ca_file: {}\n",
            dir.path().join("state").display(),
            token.display(),
            dir.path().join("no-such-ca.pem").display()
        ),
    )
    .unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_cynode-worker"));
    cmd.args(["serve", "--config"])
        .arg(&config)
        .current_dir(dir.path())
        .env_remove("WORKER_API_BEARER_TOKEN");
    let out = cynode_testkit::output_bounded(cmd, Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the node started: {stderr}");
    assert!(stderr.contains("gateway.tls"), "{stderr}");
}
