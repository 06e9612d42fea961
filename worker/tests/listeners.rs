//! The node's listeners under floods, on the real worker: a job flooding its own
//! inference and status sockets, and clients without a token flooding
//! the Worker API over HTTP and HTTPS with slowloris heads, silent connections and huge
//! heads. The node's `/healthz` keeps answering, its descriptors and resident
//! memory stay bounded, and stalled connections are closed.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cynode_testkit::flood::{self, Stall};
use cynode_testkit::{Reply, ScriptedModel, TestCa};
use serde_json::json;

use crate::harness::{env, unique, Server};

/// Runs `f` (which starts a worker) with this process's soft descriptor limit at `soft`,
/// so the worker inherits it; the limit is restored after.
fn with_descriptor_limit<T>(soft: u64, f: impl FnOnce() -> T) -> T {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let old = getrlimit(Resource::Nofile);
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(soft),
            maximum: old.maximum,
        },
    )
    .unwrap();
    let r = f();
    setrlimit(Resource::Nofile, old).unwrap();
    r
}

/// `GET /healthz` on a fresh connection, bounded at two seconds: the status or why not.
async fn healthz(client: &reqwest::Client, url: &str) -> Result<u16, String> {
    client
        .get(format!("{url}/healthz"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .map_err(|e| format!("{e:?}"))
}

/// Five probes of `/healthz`, each on a new connection: all must answer 200 within 2 s.
async fn assert_healthz_answers(client: &reqwest::Client, url: &str, during: &str) {
    for i in 0..5 {
        let r = healthz(client, url).await;
        assert_eq!(r, Ok(200), "/healthz probe {i} during {during}");
    }
}

fn fresh_client(builder: reqwest::ClientBuilder) -> reqwest::Client {
    builder.pool_max_idle_per_host(0).build().unwrap()
}

/// One request written raw on a Unix socket; the answer's status line and body.
fn unix_exchange(sock: &Path, request: &[u8]) -> (u16, String) {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.write_all(request);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out);
    let (status, body) = crate::harness::status_and_body(&text);
    (status, body.to_string())
}

/// Connects to `sock` without ever blocking (a full backlog is an error, not a wait).
async fn connect_nowait(sock: &Path) -> Option<UnixStream> {
    let s = tokio::time::timeout(
        Duration::from_secs(1),
        tokio::net::UnixStream::connect(sock),
    )
    .await
    .ok()?
    .ok()?;
    let s = s.into_std().ok()?;
    s.set_nonblocking(false).ok()?;
    Some(s)
}

fn job_socket(sv: &Server, job_id: &str, name: &str) -> PathBuf {
    sv.state_dir()
        .join("jobs")
        .join(job_id)
        .join("job")
        .join(name)
}

/// The node's descriptor count once its background work after a job's start (the bwrap
/// starters' and disk volumes' refill) has settled: three readings 200 ms apart agree
/// (at most 10 s, then the last reading). The floods below are measured against it.
async fn settled_descriptors(pid: u32) -> usize {
    let until = Instant::now() + Duration::from_secs(10);
    let mut last = flood::held_descriptors(pid);
    let mut same = 0;
    while same < 2 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = flood::held_descriptors(pid);
        same = if now == last { same + 1 } else { 0 };
        last = now;
    }
    last
}

/// A job that floods its own `/job/inference.sock` with connections and
/// `/job/status.sock` with unfinished 30 MiB bodies. The node (given the common soft limit
/// of 1024 descriptors) keeps answering `/healthz`, holds at most the per-socket cap of
/// connections, refuses the connection beyond a full set of requests in flight with a 503
/// that says why, and does not buffer the bodies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cannot_starve_the_node_through_its_sockets() {
    env();
    let model = ScriptedModel::new([], Reply::Content("ok".into()));
    let url = model.serve();
    let sv = with_descriptor_limit(1024, || {
        Server::start(
            "bwrap",
            &format!("inference:\n  base_url: {url}\n  models: [m1]\n"),
        )
    });
    let pid = sv.pid();
    let id = unique("starve");
    let spec = json!({
        "protocol_version": "1.0", "job_id": id, "task_id": "t",
        "inference": { "allowed_models": ["m1"] },
        "constraints": { "max_runtime_seconds": 120, "max_output_bytes": 65536 },
        "steps": [{ "id": "s", "type": "run_command", "arguments": { "command": "sleep", "args": ["100"] } }]
    });
    let body = json!({
        "version": 1, "task_id": "t", "job_id": id,
        "sandbox": { "image": env().image, "job_spec_json": spec.to_string(), "use_inference": true }
    });
    let (code, v) = sv.post("/v1/worker/jobs", &body).await;
    assert_eq!(code, 202, "{v}");
    let inference = job_socket(&sv, &id, "inference.sock");
    let status = job_socket(&sv, &id, "status.sock");
    let until = Instant::now() + Duration::from_secs(30);
    while !(inference.exists() && status.exists()) {
        if Instant::now() > until {
            let (_, v) = sv.get(&format!("/v1/worker/jobs/{id}")).await;
            panic!("the job's sockets never appeared; the job: {v}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let client = fresh_client(reqwest::Client::builder());
    let api = format!("http://{}", sv.addr);
    assert_healthz_answers(&client, &api, "the job's start").await;
    let fds_before = settled_descriptors(pid).await;
    let rss_before = flood::rss_kib(pid);

    // 1500 connections to the inference socket, more than the node's 1024 descriptors.
    let mut held = Vec::new();
    for _ in 0..1500 {
        if let Some(s) = connect_nowait(&inference).await {
            held.push(s);
        }
    }
    assert_healthz_answers(&client, &api, "a flood of inference connections").await;
    // What the node holds once the flood's accepted-and-displaced connections are closed
    // (a count taken mid-flood also sees those in flight).
    let fds = settled_descriptors(pid).await;
    assert!(
        fds <= fds_before + 16 + 24,
        "the node holds {fds} descriptors (before the flood: {fds_before}; {} connections made): {:?}",
        held.len(),
        flood::descriptor_kinds(pid)
    );
    // The job's own requests still get through: a new connection displaces an idle one.
    let chat = br#"{"model":"m1","messages":[{"role":"user","content":"hi"}]}"#;
    let mut request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        chat.len()
    )
    .into_bytes();
    request.extend_from_slice(chat);
    let (code, answer) = unix_exchange(&inference, &request);
    assert_eq!(code, 200, "{answer}");
    drop(held);

    // Requests in flight (bodies that never finish) fill the socket's sixteen places: the
    // next connection is answered 503, saying why. A probe that lands before a request's
    // head is read displaces that connection, so requests are added until one is refused.
    let open_busy = || {
        let mut s = UnixStream::connect(&inference).unwrap();
        s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
            .unwrap();
        s
    };
    let mut busy: Vec<UnixStream> = (0..16).map(|_| open_busy()).collect();
    let until = Instant::now() + Duration::from_secs(20);
    let refusal = loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (code, body) = unix_exchange(
            &inference,
            b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
        );
        if code == 503 {
            break body;
        }
        assert!(
            Instant::now() < until,
            "no connection was refused with {} requests in flight; last answer: {code} {body}",
            busy.len()
        );
        busy.push(open_busy());
    };
    assert!(refusal.contains("too many connections"), "{refusal}");
    let until = Instant::now() + Duration::from_secs(10);
    while !sv
        .log
        .lock()
        .unwrap()
        .iter()
        .any(|l| l.contains("connection refused"))
    {
        assert!(
            Instant::now() < until,
            "the refusal was not logged: {:?}",
            sv.log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(busy);

    // Sixteen unfinished bodies of 30 MiB (of a declared 32 MiB) to the status socket:
    // the node reads them without keeping them.
    let writers: Vec<_> = (0..16)
        .map(|_| {
            let sock = status.clone();
            let job = id.clone();
            std::thread::spawn(move || {
                let mut s = UnixStream::connect(&sock).unwrap();
                s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
                let head = format!(
                    "POST /status HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{{\"status\":\"in_progress\",\"job_id\":\"{job}\",\"result\":\"",
                    32 * 1024 * 1024
                );
                let _ = s.write_all(head.as_bytes());
                let chunk = vec![b'a'; 1024 * 1024];
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
    assert_healthz_answers(&client, &api, "unfinished status bodies").await;
    drop(unfinished);

    let _ = sv
        .post(&format!("/v1/worker/jobs/{id}:stop"), &json!({}))
        .await;
    sv.wait_terminal(&id).await;
}

/// The Worker API listener's limits for the flood tests: a cap of 32 connections and
/// two-second timeouts.
const TIGHT_LISTENER: &str = "listener:\n  max_connections: 32\n  header_read_timeout_seconds: 2\n  idle_timeout_seconds: 2\n  tls_handshake_timeout_seconds: 2\n  max_header_bytes: 65536\n";

/// Over plain HTTP: 64 slowloris heads and 8 unfinished 400 KB heads
/// against a cap of 32. `/healthz` keeps answering, descriptors and memory stay bounded,
/// huge heads are answered 431 and closed, stalled and idle connections are closed after
/// the two-second timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_and_huge_heads_cannot_starve_the_worker_api() {
    env();
    let sv = Server::start("bwrap", TIGHT_LISTENER);
    let client = fresh_client(reqwest::Client::builder());
    let url = format!("http://{}", sv.addr);
    flood_the_api(&sv, &client, &url, Stall::PartialHead).await;

    let huge_before = flood::rss_kib(sv.pid());
    let huge = flood::open(&sv.addr, 8, Stall::HugeHead(400_000));
    assert_healthz_answers(&client, &url, "huge heads").await;
    let rss = flood::rss_kib(sv.pid());
    assert!(
        rss < huge_before + 32 * 1024,
        "resident memory went from {huge_before} KiB to {rss} KiB"
    );
    let closed = flood::tcp_closed_within(huge, Duration::from_secs(5));
    assert_eq!(closed, 8, "huge heads left open");

    // A kept-alive connection with nothing more to ask is closed after the idle timeout.
    assert!(
        flood::idle_keepalive_closed_within(&sv.addr, Duration::from_secs(6)),
        "an idle keep-alive connection stayed open"
    );
}

/// Item 5 over HTTPS: 64 connections that never start their TLS handshake, against a cap
/// of 32 and a two-second handshake timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_tls_handshakes_cannot_starve_the_worker_api() {
    env();
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "nodes");
    let cert = ca.server(dir.path(), "worker");
    let sv = Server::start(
        "bwrap",
        &format!(
            "{TIGHT_LISTENER}tls:\n  cert_file: {}\n  key_file: {}\n",
            cert.cert_file.display(),
            cert.key_file.display()
        ),
    );
    let tls = cynode_tls::ClientTls {
        ca_file: Some(ca.cert_file.clone()),
        ..Default::default()
    };
    let client = fresh_client(tls.apply(reqwest::Client::builder()).unwrap());
    let url = format!("https://{}", sv.addr);
    assert_eq!(healthz(&client, &url).await, Ok(200));
    flood_the_api(&sv, &client, &url, Stall::Silent).await;
}

/// 64 connections stalled with `stall` against the cap of 32: probes answer, the node's
/// descriptors and memory stay bounded, and every stalled connection is closed (displaced
/// or timed out) within a few seconds.
async fn flood_the_api(sv: &Server, client: &reqwest::Client, url: &str, stall: Stall) {
    let pid = sv.pid();
    assert_healthz_answers(client, url, "no flood").await;
    let fds_before = settled_descriptors(pid).await;
    let rss_before = flood::rss_kib(pid);
    let attackers = flood::open(&sv.addr, 64, stall);
    assert_eq!(attackers.len(), 64);
    assert_healthz_answers(client, url, &format!("64 connections stalled ({stall:?})")).await;
    let fds = flood::held_descriptors(pid);
    assert!(
        fds <= fds_before + 32 + 16,
        "the node holds {fds} descriptors (before: {fds_before}): {:?}",
        flood::descriptor_kinds(pid)
    );
    let rss = flood::rss_kib(pid);
    assert!(
        rss < rss_before + 32 * 1024,
        "resident memory went from {rss_before} KiB to {rss} KiB"
    );
    let closed = flood::tcp_closed_within(attackers, Duration::from_secs(6));
    assert_eq!(closed, 64, "stalled connections left open ({stall:?})");
}
