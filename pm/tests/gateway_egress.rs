//! The gateway's `web.fetch` and `api.call` (pm/src/mcp/egress.rs) against real origins on
//! 127.0.0.1: a plain HTTP origin, an HTTPS origin and a credentialed API upstream with a
//! CA made in the test (rcgen), and a DNS server of the test's own that the gateway's
//! resolver is pointed at (as the worker's egress tests point the proxy's). The gateway is
//! served by the library's own `mcp::gateway::host` on a real listener, with job tokens
//! minted as the driver mints them; calls are real JSON-RPC over HTTP.
//!
//! Attacks first: a host outside the allowlist, an allowed name that resolves to
//! 127.0.0.1 when 127.0.0.1 is not listed, an IP literal, a redirect to an unlisted host
//! (never followed: the unlisted origin and its name are never touched), an endless body
//! (cut at the cap, `truncated`), a slow origin (bounded), a skill whose declared egress
//! leaves the origin out, a job whose grant lacks the tool, a route not allowed. Then what
//! is allowed works, and a route's secret reaches the origin and nothing else (not the
//! reply, even when the origin echoes it; not the audit; not the log).

use std::collections::HashMap;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::RawQuery;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use cynode_pm::gateway::{self, AuditEntry, Grant};
use cynode_testkit::gzip::gzip;
use serde_json::{json, Value};

/// The route's secret: it must reach the API origin and nothing else.
const SECRET: &str = "h5-route-secret-4f1c9a0b7e";
/// The gateway's body cap and time bound in these tests.
const CAP: usize = 1 << 20;
const TIMEOUT_S: u64 = 3;

/// What the origins saw.
#[derive(Default)]
struct Seen {
    /// Requests to the unlisted origin.
    evil_hits: usize,
    /// The `authorization` header the API origin got, last.
    api_auth: Option<String>,
    /// Request headers the plain origin's `/headers` got.
    headers: Vec<String>,
}

struct Fixture {
    plain: u16,
    https: u16,
    evil: u16,
    /// The gateway of a tenant that lists 127.0.0.1 (so names may resolve to it).
    gw_listed: String,
    /// The gateway of a tenant that lists `origin.test:<plain>` but not 127.0.0.1.
    gw_unlisted: String,
    seen: Arc<Mutex<Seen>>,
    dns_queries: Arc<Mutex<HashMap<String, usize>>>,
    log: Arc<Mutex<Vec<u8>>>,
    _dir: tempfile::TempDir,
}

/// The log of this process, kept for the secret search.
#[derive(Clone)]
struct LogBuf(Arc<Mutex<Vec<u8>>>);

impl Write for LogBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The fixture's temp directory: a static is never dropped, so it is removed at the
/// process's exit (after the test, whether it passed or panicked).
static FIXTURE_DIR: OnceLock<std::path::PathBuf> = OnceLock::new();

extern "C" fn remove_fixture_dir() {
    if let Some(d) = FIXTURE_DIR.get() {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// One fixture per process (nextest runs each test in its own), served by a runtime of
/// its own on a background thread so it outlives any one test's runtime.
fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                tx.send(start().await).unwrap();
                std::future::pending::<()>().await
            });
        });
        rx.recv_timeout(Duration::from_secs(60))
            .expect("the fixture did not start")
    })
}

fn listener() -> std::net::TcpListener {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap()
}

fn serve(l: std::net::TcpListener, app: Router, tls: Option<cynode_tls::ServerTls>) {
    tokio::spawn(async move {
        let _ = cynode_tls::serve_with(
            l,
            app,
            tls,
            cynode_tls::ListenerLimits::default(),
            std::future::pending(),
        )
        .await;
    });
}

/// An endless body of `x`s, 64 KiB at a time.
fn endless() -> Body {
    let chunk = bytes_of(64 << 10);
    Body::from_stream(futures_util::stream::unfold(chunk, |c| async move {
        Some((Ok::<_, std::io::Error>(c.clone()), c))
    }))
}

fn bytes_of(n: usize) -> axum::body::Bytes {
    axum::body::Bytes::from(vec![b'x'; n])
}

/// One byte, then nothing for a minute.
fn dribble() -> Body {
    Body::from_stream(futures_util::stream::unfold(0u8, |i| async move {
        if i > 0 {
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        Some((
            Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"x")),
            1,
        ))
    }))
}

async fn start() -> Fixture {
    cynode_tls::install_provider();
    let dir = tempfile::tempdir().unwrap();
    if FIXTURE_DIR.set(dir.path().to_path_buf()).is_ok() {
        // SAFETY: registers a plain function with no arguments to run at exit.
        unsafe {
            libc::atexit(remove_fixture_dir);
        }
    }
    let log = Arc::new(Mutex::new(Vec::new()));
    let writer = LogBuf(log.clone());
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .try_init();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let ca = cynode_testkit::TestCa::new(dir.path(), "h5");
    let cert = ca.server(dir.path(), "origin");
    let tls = cynode_tls::ServerTls {
        cert_file: cert.cert_file.clone(),
        key_file: cert.key_file.clone(),
        client_ca_file: None,
    };

    let (lp, lh, le, la) = (listener(), listener(), listener(), listener());
    let port = |l: &std::net::TcpListener| l.local_addr().unwrap().port();
    let (plain, https, evil, api) = (port(&lp), port(&lh), port(&le), port(&la));

    let s = seen.clone();
    let plain_app = Router::new()
        .route("/hello", get(|| async { "hello from the plain origin" }))
        .route(
            "/binary",
            get(|| async { axum::body::Bytes::from_static(&[0xff, 0x00, 0xfe]) }),
        )
        .route(
            "/redirect",
            get(move || async move {
                Response::builder()
                    .status(StatusCode::FOUND)
                    .header("location", format!("http://evil.test:{evil}/steal"))
                    .body(Body::empty())
                    .unwrap()
            }),
        )
        .route("/big", get(|| async { endless() }))
        .route("/slow", get(|| async { dribble() }))
        .route(
            "/headers",
            get(move |h: HeaderMap| async move {
                s.lock().unwrap().headers = h.keys().map(|k| k.to_string()).collect();
                "seen"
            }),
        );
    serve(lp, plain_app, None);
    serve(
        lh,
        Router::new().route("/secure", get(|| async { "hello over tls" })),
        Some(tls.clone()),
    );
    let s = seen.clone();
    serve(
        le,
        Router::new().fallback(move || async move {
            s.lock().unwrap().evil_hits += 1;
            "stolen"
        }),
        None,
    );
    let s = seen.clone();
    let api_app = Router::new()
        .route(
            "/api/whoami",
            get(move |h: HeaderMap| async move {
                s.lock().unwrap().api_auth = h
                    .get("authorization")
                    .map(|v| v.to_str().unwrap().to_string());
                "you are known"
            }),
        )
        .route(
            "/api/leak",
            get(|h: HeaderMap| async move {
                // A careless upstream echoing the credential, in a header and the body.
                let auth = h
                    .get("authorization")
                    .map(|v| v.to_str().unwrap().to_string())
                    .unwrap_or_default();
                ([("etag", auth.clone())], format!("you sent: {auth}")).into_response()
            }),
        )
        .route(
            "/api/gzip",
            get(|q: RawQuery, h: HeaderMap| async move {
                // The same echo, gzip-compressed when the caller accepts gzip (`?always`:
                // whatever it accepts), where a text scan would not see the credential.
                let auth = h
                    .get("authorization")
                    .map(|v| v.to_str().unwrap().to_string())
                    .unwrap_or_default();
                let accepts = h
                    .get("accept-encoding")
                    .is_some_and(|v| v.to_str().unwrap().contains("gzip"));
                let body = format!("you sent: {auth}");
                if !accepts && q.0.as_deref() != Some("always") {
                    return body.into_response();
                }
                ([("content-encoding", "gzip")], gzip(body.as_bytes())).into_response()
            }),
        );
    serve(la, api_app, Some(tls));

    let (dns, dns_queries) = dns_server(&[
        ("origin.test", Ipv4Addr::LOCALHOST),
        ("evil.test", Ipv4Addr::LOCALHOST),
        ("localhost", Ipv4Addr::LOCALHOST),
    ])
    .await;

    let settings: cynode_pm::mcp::egress::Settings = serde_yaml::from_str(&format!(
        r#"
routes:
  vault:
    upstream: "https://localhost:{api}/api"
    headers: {{ Authorization: {{ env: H5_VAULT_TOKEN }} }}
    ca_file: "{ca}"
nameservers: ["{dns}"]
ca_file: "{ca}"
max_body_bytes: {CAP}
timeout_seconds: {TIMEOUT_S}
"#,
        ca = ca.cert_file.display()
    ))
    .unwrap();
    cynode_pm::mcp::egress::install_with(&settings, |v| {
        (v == "H5_VAULT_TOKEN").then(|| format!("Bearer {SECRET}"))
    })
    .unwrap();

    // `localhost` is answered by the resolver itself (127.0.0.1 and ::1), so both are listed.
    let listed = format!(
        "egress:\n  allow: [\"origin.test:{plain}\", \"localhost:{https}\", \"127.0.0.1\", \"[::1]\", \"proxy.golang.org\", \"sum.golang.org\", \"storage.googleapis.com\"]\n  routes_allowed: [vault]\n"
    );
    let unlisted = format!("egress:\n  allow: [\"origin.test:{plain}\"]\n");
    let gw_listed = gateway_for(dir.path(), "listed", &listed).await;
    let gw_unlisted = gateway_for(dir.path(), "unlisted", &unlisted).await;
    Fixture {
        plain,
        https,
        evil,
        gw_listed,
        gw_unlisted,
        seen,
        dns_queries,
        log,
        _dir: dir,
    }
}

/// A PM whose tenant settings are `tenant_yaml`, its gateway hosted on 127.0.0.1: the URL.
async fn gateway_for(dir: &Path, name: &str, tenant_yaml: &str) -> String {
    let state = dir.join(name);
    std::fs::create_dir_all(&state).unwrap();
    let tenant = state.join("tenant.yaml");
    std::fs::write(&tenant, tenant_yaml).unwrap();
    let config = cynode_pm::config::PmConfig {
        model: cynode_pm::llm::ModelConfig::new("http://127.0.0.1:9/v1", "none"),
        state_dir: state.clone(),
        datastore: None,
        skills: cynode_pm::config::SkillSources::default(),
        policy: cynode_pm::config::PolicySource::Builtin,
        tenant_file: Some(tenant),
        worker_wait: Duration::from_secs(1),
    };
    let workers = cynode_pm::workers::WorkerPool::single(
        cynode_pm::dispatch::WorkerClient::new("http://127.0.0.1:9", "unused"),
        "img",
    );
    let pm = cynode_pm::bootstrap::build_pm(&config, workers)
        .await
        .unwrap();
    let l = listener();
    let addr = l.local_addr().unwrap();
    let hosted = cynode_pm::mcp::gateway::host(Arc::new(pm), l, 12 << 20, None);
    // The fixture lives as long as the process.
    std::mem::forget(hosted);
    format!("http://{addr}/v1/gateway")
}

/// A UDP DNS responder on 127.0.0.1: A queries for a known name get its address (TTL 0),
/// AAAA none, unknown names NXDOMAIN; A queries are counted per name.
async fn dns_server(
    answers: &[(&str, Ipv4Addr)],
) -> (SocketAddr, Arc<Mutex<HashMap<String, usize>>>) {
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = sock.local_addr().unwrap();
    let answers: HashMap<String, Ipv4Addr> =
        answers.iter().map(|(n, a)| (n.to_string(), *a)).collect();
    let queries = Arc::new(Mutex::new(HashMap::new()));
    let counts = queries.clone();
    tokio::spawn(async move {
        let mut buf = [0u8; 1500];
        while let Ok((n, peer)) = sock.recv_from(&mut buf).await {
            if let Some(r) = dns_answer(&buf[..n], &answers, &counts) {
                let _ = sock.send_to(&r, peer).await;
            }
        }
    });
    (addr, queries)
}

fn dns_answer(
    q: &[u8],
    answers: &HashMap<String, Ipv4Addr>,
    counts: &Mutex<HashMap<String, usize>>,
) -> Option<Vec<u8>> {
    let mut i = 12;
    let mut labels = Vec::new();
    loop {
        let len = *q.get(i)? as usize;
        i += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(q.get(i..i + len)?).to_ascii_lowercase());
        i += len;
    }
    let qtype = u16::from_be_bytes([*q.get(i)?, *q.get(i + 1)?]);
    let name = labels.join(".");
    let known = answers.get(&name);
    let ip = match (known, qtype) {
        (Some(ip), 1) => {
            *counts.lock().unwrap().entry(name).or_insert(0) += 1;
            Some(*ip)
        }
        _ => None,
    };
    let mut r = q.get(..2)?.to_vec();
    r.extend_from_slice(&[0x81, if known.is_some() { 0x80 } else { 0x83 }, 0, 1]);
    r.extend_from_slice(&[0, ip.is_some() as u8, 0, 0, 0, 0]);
    r.extend_from_slice(q.get(12..i + 4)?);
    if let Some(ip) = ip {
        r.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 0, 0, 4]);
        r.extend_from_slice(&ip.octets());
    }
    Some(r)
}

/// A token for a job of skill `skill` listing `tools`; its job id.
fn token(skill: &str, tools: &[&str]) -> (String, String) {
    let job = format!("j-{}", uuid::Uuid::new_v4().simple());
    let t = gateway::tokens().mint(
        Grant {
            tenant: "default".into(),
            session_id: "s-h5".into(),
            task_id: "t-h5".into(),
            job_id: job.clone(),
            skill_id: skill.into(),
            tools: tools.iter().map(|t| t.to_string()).collect(),
        },
        Duration::from_secs(300),
    );
    (t.expose().to_string(), job)
}

/// Calls `tool` on `gw` with `args`: the JSON-RPC reply, whole.
async fn call(gw: &str, token: &str, tool: &str, args: Value) -> Value {
    let body = json!({ "jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": { "name": tool, "arguments": args } });
    let r = reqwest::Client::new()
        .post(gw)
        .bearer_auth(token)
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-06-18")
        .json(&body)
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// The result of a call that ran (`structuredContent`), and whether it is an error.
fn result(reply: &Value) -> (&Value, bool) {
    let r = &reply["result"];
    (&r["structuredContent"], r["isError"] == true)
}

/// The one audit entry of `job` (its token revoked).
fn audit_of(job: &str) -> AuditEntry {
    let mut a = gateway::tokens().revoke_job(job).audit;
    assert_eq!(a.len(), 1, "{a:?}");
    a.remove(0)
}

/// A web.fetch of `url` on `gw` by a job listing web.fetch: the refusal's detail and the
/// audit entry, asserting it was refused.
async fn refused_fetch(gw: &str, url: &str) -> (String, AuditEntry) {
    let (tok, job) = token("none", &["web.fetch"]);
    let reply = call(gw, &tok, "web.fetch", json!({ "url": url })).await;
    let (v, is_error) = result(&reply);
    assert!(is_error, "{url} was fetched: {reply}");
    let e = audit_of(&job);
    assert_eq!(e.outcome, "refused");
    assert_eq!(e.decision.as_deref(), Some("denied"), "{e:?}");
    assert_eq!(e.bytes, 0);
    (v["detail"].as_str().unwrap_or_default().to_string(), e)
}

const LIMIT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn web_fetch_refuses_what_the_task_does_not_allow() {
    tokio::time::timeout(LIMIT, async {
        let f = fixture();
        let p = f.plain;
        // Not in the allowlist.
        let (d, e) = refused_fetch(&f.gw_listed, &format!("http://evil.test:{}/x", f.evil)).await;
        assert!(
            d.contains("evil.test is not in the task's egress allowlist"),
            "{d}"
        );
        assert_eq!(
            (e.host.as_deref(), e.port),
            (Some("evil.test"), Some(f.evil))
        );
        // Allowed name, but it resolves to 127.0.0.1, which this tenant does not list.
        let (d, e) = refused_fetch(&f.gw_unlisted, &format!("http://origin.test:{p}/hello")).await;
        assert!(d.contains("loopback address 127.0.0.1"), "{d}");
        assert_eq!(e.host.as_deref(), Some("origin.test"));
        // IP literals: not listed at all, or listed for other ports only.
        let (d, _) = refused_fetch(&f.gw_unlisted, &format!("http://127.0.0.1:{p}/hello")).await;
        assert!(
            d.contains("127.0.0.1 is not in the task's egress allowlist"),
            "{d}"
        );
        let (d, _) = refused_fetch(&f.gw_listed, &format!("http://127.0.0.1:{p}/hello")).await;
        assert!(d.contains(&format!("port {p} of 127.0.0.1")), "{d}");
        let (d, _) = refused_fetch(&f.gw_listed, &format!("http://[::ffff:127.0.0.1]:{p}/")).await;
        assert!(d.contains("allowlist"), "{d}");
        // Odd spellings of the same things.
        for url in [
            format!("http://ORIGIN.test.:{}/hello", f.evil),
            format!("http://user:pw@origin.test:{p}/hello"),
            format!("ftp://origin.test:{p}/"),
            "file:///etc/passwd".to_string(),
            format!("http://127.1:{p}/"),
            "http://169.254.169.254/latest/meta-data/".to_string(),
        ] {
            refused_fetch(&f.gw_listed, &url).await;
        }
        // The skill's declared egress (go-test: the Go module hosts) narrows the tenant's.
        let (tok, job) = token("go-test", &["web.fetch"]);
        let reply = call(
            &f.gw_listed,
            &tok,
            "web.fetch",
            json!({ "url": format!("http://origin.test:{p}/hello") }),
        )
        .await;
        assert!(result(&reply).1, "{reply}");
        assert_eq!(audit_of(&job).decision.as_deref(), Some("denied"));
        // A job whose grant lacks web.fetch: refused before any work.
        let (tok, job) = token("none", &["artifact.list"]);
        let reply = call(
            &f.gw_listed,
            &tok,
            "web.fetch",
            json!({ "url": format!("http://origin.test:{p}/hello") }),
        )
        .await;
        let msg = reply["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains("not in the job's context.mcp_tools"),
            "{reply}"
        );
        let e = audit_of(&job);
        assert_eq!((e.outcome.as_str(), e.host.as_deref()), ("refused", None));
        // Nothing above reached the unlisted origin.
        assert_eq!(f.seen.lock().unwrap().evil_hits, 0);
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn web_fetch_follows_no_redirect_and_bounds_the_reply() {
    tokio::time::timeout(LIMIT, async {
        let f = fixture();
        let p = f.plain;
        let (tok, job) = token("none", &["web.fetch"]);
        // A redirect to an unlisted host comes back as it is; nobody goes there.
        let reply = call(
            &f.gw_listed,
            &tok,
            "web.fetch",
            json!({ "url": format!("http://origin.test:{p}/redirect") }),
        )
        .await;
        let (v, is_error) = result(&reply);
        assert!(!is_error, "{reply}");
        assert_eq!(v["status"], 302);
        assert_eq!(
            v["headers"]["location"],
            format!("http://evil.test:{}/steal", f.evil)
        );
        assert_eq!(f.seen.lock().unwrap().evil_hits, 0);
        assert_eq!(f.dns_queries.lock().unwrap().get("evil.test"), None);
        gateway::tokens().revoke_job(&job);

        // An endless body: cut at the cap.
        let (tok, job) = token("none", &["web.fetch"]);
        let t0 = Instant::now();
        let reply = call(
            &f.gw_listed,
            &tok,
            "web.fetch",
            json!({ "url": format!("http://origin.test:{p}/big") }),
        )
        .await;
        let (v, is_error) = result(&reply);
        assert!(!is_error, "{reply}");
        assert_eq!(v["truncated"], true);
        assert_eq!(v["body_bytes"], CAP);
        assert_eq!(v["body"].as_str().unwrap().len(), CAP);
        let e = audit_of(&job);
        assert_eq!(
            (e.decision.as_deref(), e.bytes),
            (Some("allowed"), CAP as u64)
        );
        eprintln!("endless body cut at {CAP} bytes in {:?}", t0.elapsed());

        // A slow origin: bounded by the gateway's time.
        let (tok, job) = token("none", &["web.fetch"]);
        let t0 = Instant::now();
        let reply = call(
            &f.gw_listed,
            &tok,
            "web.fetch",
            json!({ "url": format!("http://origin.test:{p}/slow") }),
        )
        .await;
        let took = t0.elapsed();
        let (v, is_error) = result(&reply);
        assert!(is_error, "{reply}");
        assert!(
            v["detail"]
                .as_str()
                .unwrap()
                .contains(&format!("no whole reply within {TIMEOUT_S} s")),
            "{v}"
        );
        assert!(took < Duration::from_secs(TIMEOUT_S + 3), "{took:?}");
        assert_eq!(audit_of(&job).decision.as_deref(), Some("denied"));
        eprintln!("slow origin refused after {took:?}");
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn web_fetch_gets_allowed_http_and_https_origins() {
    tokio::time::timeout(LIMIT, async {
        let f = fixture();
        let p = f.plain;
        let (tok, job) = token("none", &["web.fetch"]);
        let reply = call(&f.gw_listed, &tok, "web.fetch", json!({ "url": format!("http://Origin.Test.:{p}/hello") })).await;
        let (v, is_error) = result(&reply);
        assert!(!is_error, "{reply}");
        assert_eq!(v["status"], 200);
        assert_eq!(v["body"], "hello from the plain origin");
        assert_eq!(v["encoding"], "text");
        assert_eq!(v["truncated"], false);
        let e = audit_of(&job);
        assert_eq!(
            (e.host.as_deref(), e.port, e.decision.as_deref(), e.bytes),
            (Some("origin.test"), Some(p), Some("allowed"), 27)
        );

        // Over HTTPS, the origin's certificate from the test's CA (the gateway's ca_file).
        let (tok, job) = token("none", &["web.fetch"]);
        let reply = call(&f.gw_listed, &tok, "web.fetch", json!({ "url": format!("https://localhost:{}/secure", f.https), "method": "GET" })).await;
        let (v, is_error) = result(&reply);
        assert!(!is_error, "{reply}");
        assert_eq!((v["status"].clone(), v["body"].clone()), (json!(200), json!("hello over tls")));
        assert_eq!(audit_of(&job).port, Some(f.https));

        // Bytes that are not UTF-8 come as base64; HEAD has no body.
        let (tok, job) = token("none", &["web.fetch"]);
        let reply = call(&f.gw_listed, &tok, "web.fetch", json!({ "url": format!("http://origin.test:{p}/binary") })).await;
        assert_eq!(result(&reply).0["encoding"], "base64");
        assert_eq!(result(&reply).0["body"], "/wD+");
        gateway::tokens().revoke_job(&job);

        // Credentials and hop-by-hop headers of the caller never reach the origin.
        let (tok, job) = token("none", &["web.fetch"]);
        let reply = call(&f.gw_listed, &tok, "web.fetch", json!({ "url": format!("http://origin.test:{p}/headers"),
            "headers": { "Authorization": "Bearer stolen", "Cookie": "a=b", "Proxy-Authorization": "x", "X-Ok": "1" } })).await;
        assert!(!result(&reply).1, "{reply}");
        let seen = f.seen.lock().unwrap().headers.clone();
        assert!(seen.contains(&"x-ok".to_string()), "{seen:?}");
        for h in ["authorization", "cookie", "proxy-authorization"] {
            assert!(!seen.contains(&h.to_string()), "{h} reached the origin: {seen:?}");
        }
        gateway::tokens().revoke_job(&job);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_call_never_passes_a_compressed_echo_of_the_secret() {
    tokio::time::timeout(LIMIT, async {
        let f = fixture();
        // The caller asks for gzip: the route asks its upstream for identity, so the echo
        // comes back plain and is redacted.
        let (tok, _) = token("none", &["api.call"]);
        let reply = call(
            &f.gw_listed,
            &tok,
            "api.call",
            json!({ "route": "vault", "method": "GET", "path": "/gzip",
                    "headers": { "Accept-Encoding": "gzip" } }),
        )
        .await;
        let (v, is_error) = result(&reply);
        assert!(!is_error, "{reply}");
        assert_eq!(v["body"], "you sent: <redacted>", "{reply}");
        // An upstream that compresses whatever it is asked: refused, never passed on.
        let (tok, job) = token("none", &["api.call"]);
        let reply = call(
            &f.gw_listed,
            &tok,
            "api.call",
            json!({ "route": "vault", "method": "GET", "path": "/gzip?always" }),
        )
        .await;
        let (v, is_error) = result(&reply);
        assert!(is_error, "{reply}");
        assert!(
            v.to_string().contains("compressed"),
            "the refusal names the reason: {reply}"
        );
        // Audited as refused, and nothing of the secret in the reply.
        assert_eq!(audit_of(&job).decision.as_deref(), Some("denied"));
        assert!(!reply.to_string().contains(SECRET), "{reply}");
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn api_call_adds_the_secret_which_appears_nowhere_else() {
    tokio::time::timeout(LIMIT, async {
        let f = fixture();
        // Not granted: the tenant of gw_unlisted allows no route.
        let (tok, job) = token("none", &["api.call"]);
        let reply = call(
            &f.gw_unlisted,
            &tok,
            "api.call",
            json!({ "route": "vault", "method": "GET", "path": "/whoami" }),
        )
        .await;
        let (v, is_error) = result(&reply);
        assert!(is_error, "{reply}");
        assert!(
            v["detail"]
                .as_str()
                .unwrap()
                .contains("not in the tenant's egress.routes_allowed"),
            "{v}"
        );
        assert_eq!(audit_of(&job).decision.as_deref(), Some("denied"));
        assert_eq!(f.seen.lock().unwrap().api_auth, None);
        // An unknown route, a path leaving the base, a job without api.call.
        for (args, tools) in [
            (
                json!({ "route": "nope", "method": "GET", "path": "/x" }),
                &["api.call"][..],
            ),
            (
                json!({ "route": "vault", "method": "GET", "path": "/../admin" }),
                &["api.call"][..],
            ),
            (
                json!({ "route": "vault", "method": "GET", "path": "/%2e%2e/admin" }),
                &["api.call"][..],
            ),
            (
                json!({ "route": "vault", "method": "GET", "path": "/whoami" }),
                &["web.fetch"][..],
            ),
        ] {
            let (tok, job) = token("none", tools);
            let reply = call(&f.gw_listed, &tok, "api.call", args.clone()).await;
            assert!(
                result(&reply).1 || reply.get("error").is_some(),
                "{args}: {reply}"
            );
            assert_eq!(audit_of(&job).outcome, "refused");
        }
        assert_eq!(f.seen.lock().unwrap().api_auth, None);

        // Granted: the origin sees the secret; the reply does not carry it.
        let (tok, job) = token("none", &["api.call"]);
        let reply = call(
            &f.gw_listed,
            &tok,
            "api.call",
            json!({ "route": "vault", "method": "GET", "path": "/whoami",
            "headers": { "Authorization": "Bearer the-job-s-own" } }),
        )
        .await;
        let (v, is_error) = result(&reply);
        assert!(!is_error, "{reply}");
        assert_eq!(
            (v["status"].clone(), v["body"].clone()),
            (json!(200), json!("you are known"))
        );
        assert_eq!(
            f.seen.lock().unwrap().api_auth.as_deref(),
            Some(format!("Bearer {SECRET}").as_str())
        );
        let mut audit = vec![audit_of(&job)];
        let mut replies = vec![reply.to_string()];
        // An upstream that echoes the credential: the reply has it redacted.
        let (tok, job) = token("none", &["api.call"]);
        let reply = call(
            &f.gw_listed,
            &tok,
            "api.call",
            json!({ "route": "vault", "method": "GET", "path": "/leak" }),
        )
        .await;
        let (v, _) = result(&reply);
        assert_eq!(v["body"], "you sent: <redacted>");
        assert_eq!(v["headers"]["etag"], "<redacted>");
        audit.push(audit_of(&job));
        replies.push(reply.to_string());
        assert_eq!(audit[0].host.as_deref(), Some("localhost"));
        assert_eq!(audit[0].decision.as_deref(), Some("allowed"));

        let audit_text = serde_json::to_string(&audit).unwrap();
        let log = String::from_utf8_lossy(&f.log.lock().unwrap()).to_string();
        assert!(log.contains("gateway call"), "the log was not captured");
        for (what, text) in [
            ("reply", replies.join("\n")),
            ("audit", audit_text),
            ("log", log),
        ] {
            assert!(
                !text.contains(SECRET),
                "the route's secret is in the {what}"
            );
        }
    })
    .await
    .unwrap();
}
