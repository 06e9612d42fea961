//! The egress proxy on 127.0.0.1 with real clients (reqwest, curl, raw sockets), a plain
//! HTTP origin, an HTTPS origin with a CA made in the test, and a DNS server of the test's
//! own that the proxy's resolver is pointed at: what is allowed gets through, every attack
//! is refused with an audit record and never reaches an origin.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cynode_protocol::egress::{EgressAudit, EgressDecision, EgressRecord};
use cynode_testkit::gzip::{gunzip, gzip};
use cynode_worker::egress::{Allowlist, EgressLimits, EgressProxy, Policy, Resolver, Routes};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};

/// Every test's bound.
const TEST_TIME: Duration = Duration::from_secs(90);

// --- a DNS server of the test's own ----------------------------------------------------

/// A UDP DNS responder on 127.0.0.1: A queries for a known name get that name's next
/// answer (the last one repeats), with TTL 0; AAAA queries get no answer; unknown names
/// NXDOMAIN. It counts A queries per name.
pub(crate) struct Dns {
    pub(crate) addr: SocketAddr,
    queries: Arc<Mutex<HashMap<String, usize>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Dns {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Dns {
    pub(crate) async fn start(answers: &[(&str, &[Ipv4Addr])]) -> Dns {
        let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
        let answers: HashMap<String, Vec<Ipv4Addr>> = answers
            .iter()
            .map(|(n, a)| (n.to_string(), a.to_vec()))
            .collect();
        let queries = Arc::new(Mutex::new(HashMap::new()));
        let counts = queries.clone();
        let task = tokio::spawn(async move {
            let mut buf = [0u8; 1500];
            loop {
                let Ok((n, peer)) = sock.recv_from(&mut buf).await else {
                    return;
                };
                if let Some(reply) = answer(&buf[..n], &answers, &counts) {
                    let _ = sock.send_to(&reply, peer).await;
                }
            }
        });
        Dns {
            addr,
            queries,
            task,
        }
    }

    pub(crate) fn a_queries(&self, name: &str) -> usize {
        self.queries.lock().unwrap().get(name).copied().unwrap_or(0)
    }
}

fn answer(
    q: &[u8],
    answers: &HashMap<String, Vec<Ipv4Addr>>,
    counts: &Mutex<HashMap<String, usize>>,
) -> Option<Vec<u8>> {
    if q.len() < 12 {
        return None;
    }
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
    let question = &q[12..i + 4];
    let name = labels.join(".");
    let mut ips = Vec::new();
    let known = answers.get(&name);
    if let (Some(list), 1) = (known, qtype) {
        let mut c = counts.lock().unwrap();
        let n = c.entry(name.clone()).or_insert(0);
        ips.push(list[(*n).min(list.len() - 1)]);
        *n += 1;
    }
    let rcode: u8 = if known.is_some() { 0 } else { 3 };
    let mut r = Vec::new();
    r.extend_from_slice(&q[..2]);
    r.extend_from_slice(&[0x81, 0x80 | rcode]);
    r.extend_from_slice(&[0, 1]);
    r.extend_from_slice(&(ips.len() as u16).to_be_bytes());
    r.extend_from_slice(&[0, 0, 0, 0]);
    r.extend_from_slice(question);
    for ip in ips {
        r.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 0, 0, 4]);
        r.extend_from_slice(&ip.octets());
    }
    Some(r)
}

// --- origins ---------------------------------------------------------------------------

/// An HTTP origin on 127.0.0.1 counting the requests it gets: `/hello`, `/echo` (POST,
/// echoes the body), `/big` (100 000 bytes), `/headers` (the request headers it saw).
pub(crate) struct Origin {
    pub(crate) port: u16,
    hits: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Origin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn origin_app(hits: Arc<AtomicUsize>) -> axum::Router {
    use axum::routing::{get, post};
    let counted = move |req: axum::extract::Request, next: axum::middleware::Next| {
        let hits = hits.clone();
        async move {
            hits.fetch_add(1, Ordering::SeqCst);
            next.run(req).await
        }
    };
    axum::Router::new()
        .route("/hello", get(|| async { "hello from origin" }))
        .route("/echo", post(|body: axum::body::Bytes| async move { body }))
        .route("/big", get(|| async { vec![b'x'; 100_000] }))
        .route(
            "/api/whoami",
            get(|h: axum::http::HeaderMap| async move {
                let auth = h.get("authorization").and_then(|v| v.to_str().ok());
                if auth == Some(&format!("Bearer {ROUTE_SECRET}")) {
                    (axum::http::StatusCode::OK, "authorized")
                } else {
                    (axum::http::StatusCode::UNAUTHORIZED, "no credential")
                }
            }),
        )
        .route(
            "/api/echo",
            post(|body: axum::body::Bytes| async move { body }),
        )
        .route("/api/reflect", get(reflect))
        .route("/api/split", get(reflect_split))
        .route("/api/gzip", get(reflect_gzip))
        .route(
            "/headers",
            get(|h: axum::http::HeaderMap| async move {
                let mut names: Vec<String> = h
                    .iter()
                    .map(|(k, v)| format!("{k}: {}", v.to_str().unwrap_or("?")))
                    .collect();
                names.sort();
                names.join("\n")
            }),
        )
        .layer(axum::middleware::from_fn(counted))
}

/// What an echo service (httpbin, many error pages) gives back of the request's
/// `Authorization`: (the value, a JSON body holding it).
fn echoed(h: &axum::http::HeaderMap) -> (String, String) {
    let auth = h
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = format!("{{\"headers\": {{\"Authorization\": \"{auth}\"}}}}\n");
    (auth, body)
}

/// The body [`echoed`] gives once the route's secret is redacted.
pub(crate) const REDACTED_ECHO: &str = "{\"headers\": {\"Authorization\": \"<redacted>\"}}\n";

/// `/api/reflect`: the `Authorization` back in a header and in the body.
async fn reflect(h: axum::http::HeaderMap) -> impl axum::response::IntoResponse {
    let (auth, body) = echoed(&h);
    ([("x-echo-authorization", auth)], body)
}

/// `/api/split?at=N`: the echoed body in two writes 20 ms apart, split `N` bytes into the
/// `Authorization` value.
async fn reflect_split(
    axum::extract::RawQuery(q): axum::extract::RawQuery,
    h: axum::http::HeaderMap,
) -> axum::body::Body {
    use futures_util::StreamExt;
    let at: usize = q
        .as_deref()
        .and_then(|q| q.strip_prefix("at="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let (auth, body) = echoed(&h);
    let cut = body.find(&auth).unwrap_or(0) + at.min(auth.len());
    let (a, b) = body.as_bytes().split_at(cut);
    let pieces = [a.to_vec(), b.to_vec()];
    axum::body::Body::from_stream(futures_util::stream::iter(pieces).then(|p| async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        Ok::<_, std::io::Error>(p)
    }))
}

/// `/api/gzip`: the echoed body gzip-compressed (by gzip(1)), `Content-Encoding: gzip`,
/// when the request accepts gzip (`?always`: whatever it accepts); plain otherwise.
async fn reflect_gzip(
    axum::extract::RawQuery(q): axum::extract::RawQuery,
    h: axum::http::HeaderMap,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let (_, body) = echoed(&h);
    let accepts = h
        .get("accept-encoding")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("gzip"));
    if !accepts && q.as_deref() != Some("always") {
        return body.into_response();
    }
    ([("content-encoding", "gzip")], gzip(body.as_bytes())).into_response()
}

impl Origin {
    pub(crate) async fn http() -> Origin {
        let hits = Arc::new(AtomicUsize::new(0));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let app = origin_app(hits.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        Origin { port, hits, task }
    }

    /// An HTTPS origin whose certificate, for `name`, is issued by a CA made here; the
    /// CA's PEM is returned.
    pub(crate) async fn https(dir: &Path, name: &str) -> (Origin, String) {
        let (ca_pem, cert, key) = certificates(name);
        let cert_file = dir.join("origin.pem");
        let key_file = dir.join("origin-key.pem");
        std::fs::write(&cert_file, cert).unwrap();
        std::fs::write(&key_file, key).unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let app = origin_app(hits.clone());
        let tls = cynode_tls::ServerTls {
            cert_file,
            key_file,
            client_ca_file: None,
        };
        let task = tokio::spawn(async move {
            let _ = cynode_tls::serve(l, app, Some(tls), std::future::pending()).await;
        });
        (Origin { port, hits, task }, ca_pem)
    }

    pub(crate) fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

/// A CA and a server certificate for `name`: (CA PEM, certificate PEM, key PEM).
pub(crate) fn certificates(name: &str) -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // Distinct names: OpenSSL takes a leaf whose issuer is its own subject as self-signed.
    ca.distinguished_name
        .push(DnType::CommonName, "egress test CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let mut leaf = CertificateParams::new(vec![name.to_string()]).unwrap();
    leaf.distinguished_name.push(DnType::CommonName, name);
    let cert = leaf.signed_by(&key, &issuer).unwrap();
    (ca_cert.pem(), cert.pem(), key.serialize_pem())
}

// --- the proxy -------------------------------------------------------------------------

fn start_proxy(ceiling: &[String], dns: &Dns, limits: EgressLimits) -> EgressProxy {
    start_proxy_with_routes(ceiling, dns, limits, Routes::default())
}

fn start_proxy_with_routes(
    ceiling: &[String],
    dns: &Dns,
    limits: EgressLimits,
    routes: Routes,
) -> EgressProxy {
    let ceiling = Allowlist::parse(ceiling).unwrap();
    let policy = Policy::for_job::<&str>(&ceiling, None).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    EgressProxy::start(
        listener,
        "job-egress-test",
        policy,
        Resolver::with_nameservers(&[dns.addr]),
        Arc::new(routes),
        limits,
        None,
    )
    .unwrap()
}

fn client(proxy: &EgressProxy, ca_pem: Option<&str>) -> reqwest::Client {
    cynode_tls::install_provider();
    let mut b = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(format!("http://{}", proxy.local_addr())).unwrap())
        .timeout(Duration::from_secs(20));
    if let Some(pem) = ca_pem {
        b = b.add_root_certificate(reqwest::Certificate::from_pem(pem.as_bytes()).unwrap());
    }
    b.build().unwrap()
}

/// Sends `raw` to the proxy on a new connection and reads until it closes.
async fn raw(proxy: &EgressProxy, raw: &[u8]) -> String {
    String::from_utf8_lossy(&raw_bytes(proxy, raw).await).into_owned()
}

/// [`raw`], the answer as bytes.
async fn raw_bytes(proxy: &EgressProxy, raw: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(proxy.local_addr()).await.unwrap();
    // The proxy may refuse before it has read everything.
    let _ = s.write_all(raw).await;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    out
}

fn find<'a>(audit: &'a EgressAudit, host: &str, method: &str) -> &'a EgressRecord {
    audit
        .records
        .iter()
        .find(|r| r.host == host && r.method == method)
        .unwrap_or_else(|| panic!("no {method} {host} record in {audit:#?}"))
}

fn denied_because(audit: &EgressAudit, host: &str, method: &str, reason: &str) {
    let r = find(audit, host, method);
    assert_eq!(r.decision, EgressDecision::Denied, "{r:?}");
    assert!(r.reason.contains(reason), "{r:?} should say {reason:?}");
    assert_eq!((r.bytes_up, r.bytes_down), (0, 0), "{r:?}");
}

const LOCAL: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// The credential a route adds; the sandbox side must never see it.
pub(crate) const ROUTE_SECRET: &str = "s3cret-route-token-7f3a9c";

/// A node with one credentialed route `api` to an HTTPS origin of its own (an rcgen CA),
/// whose `Authorization` is `Bearer <ROUTE_SECRET>` from the node's environment.
pub(crate) async fn route_server(
    backend: &'static str,
    dir: &std::path::Path,
) -> (crate::harness::Server, Origin) {
    route_server_with(backend, dir, "").await
}

/// [`route_server`] with `extra` config lines in front of its `egress:` section (e.g. the
/// continuation of the harness's `bwrap.rootfs` map for another image).
pub(crate) async fn route_server_with(
    backend: &'static str,
    dir: &std::path::Path,
    extra: &str,
) -> (crate::harness::Server, Origin) {
    let (origin, ca) = Origin::https(dir, "localhost").await;
    let ca_file = dir.join("route-ca.pem");
    std::fs::write(&ca_file, ca).unwrap();
    let config = format!(
        "{extra}egress:\n  routes:\n    api:\n      upstream: \"https://localhost:{}/api\"\n      headers:\n        Authorization: {{env: ROUTE_TOKEN}}\n      ca_file: {}\n",
        origin.port,
        ca_file.display()
    );
    let server = crate::harness::Server::start_with_env(
        backend,
        &config,
        &[("ROUTE_TOKEN", "Bearer s3cret-route-token-7f3a9c")],
    );
    (server, origin)
}

/// A call of the route from inside the sandbox (HTTP/1.0: the answer, redacted, comes
/// close-delimited, without chunk framing).
pub(crate) const ROUTE_CALL: &str =
    "printf 'GET /routes/api/whoami HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n' | nc -w 10 127.0.0.1 3128; echo; ";

/// Searches the sandbox for [`ROUTE_SECRET`] (its environment, every process's environ and
/// cmdline but the search's own, the job and workspace directories, /tmp and /etc); prints
/// the count in `env`, any file holding it, then `searched`. The pattern is split so the
/// script itself does not hold it.
pub(crate) const SECRET_SEARCH: &str = "s1=s3cret-route; s2=token-7f3a9c; pat=\"$s1-$s2\"; \
     env | grep -c \"$pat\"; \
     for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do grep -l -F \"$pat\" \"$f\" 2>/dev/null; done \
       | grep -v \"^/proc/$$/\" | grep -v '/proc/self/' ; \
     grep -r -l -F \"$pat\" /job /workspace /tmp /etc 2>/dev/null; echo searched";

// --- the tests -------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_and_connect_reach_allowlisted_names() {
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let origin = Origin::http().await;
        let (secure, ca) = Origin::https(dir.path(), "secure.test").await;
        let dns = Dns::start(&[("origin.test", &[LOCAL]), ("secure.test", &[LOCAL])]).await;
        let proxy = start_proxy(
            &[
                format!("origin.test:{}", origin.port),
                format!("*.test:{}", secure.port),
                "127.0.0.1".into(),
            ],
            &dns,
            EgressLimits::default(),
        );
        let c = client(&proxy, Some(&ca));
        let base = format!("http://Origin.Test.:{}", origin.port);
        let r = c.get(format!("{base}/hello")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "hello from origin");
        let body = "x".repeat(70_000);
        let r = c
            .post(format!("{base}/echo"))
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.text().await.unwrap(), body);
        // Proxy-* and hop-by-hop headers stop at the proxy.
        let seen = c
            .get(format!("{base}/headers"))
            .header("Proxy-Authorization", "Basic c2VjcmV0")
            .header("Connection", "X-Hop")
            .header("X-Hop", "h")
            .header("X-Kept", "k")
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(seen.contains("x-kept: k"), "{seen}");
        assert!(!seen.contains("proxy-authorization"), "{seen}");
        assert!(!seen.contains("x-hop"), "{seen}");
        assert!(
            seen.contains(&format!("host: origin.test:{}", origin.port)),
            "{seen}"
        );

        let r = c
            .get(format!("https://secure.test:{}/hello", secure.port))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "hello from origin");
        assert_eq!(secure.hits(), 1);
        assert_eq!(origin.hits(), 3);

        let audit = proxy.finish().await;
        let get = find(&audit, "origin.test", "GET");
        assert_eq!(get.decision, EgressDecision::Allowed);
        assert_eq!(get.port, origin.port);
        assert_eq!(get.reason, "ok");
        assert!(get.bytes_down > 17 && get.bytes_up > 0, "{get:?}");
        let post = find(&audit, "origin.test", "POST");
        assert!(
            post.bytes_up > 70_000 && post.bytes_down > 70_000,
            "{post:?}"
        );
        let connect = find(&audit, "secure.test", "CONNECT");
        assert_eq!(connect.decision, EgressDecision::Allowed);
        assert!(
            connect.bytes_up > 0 && connect.bytes_down > 0,
            "{connect:?}"
        );
        assert_eq!(audit.dropped, 0);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_reaches_an_https_origin_through_https_proxy() {
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let (secure, ca) = Origin::https(dir.path(), "pkg.test").await;
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, ca).unwrap();
        let dns = Dns::start(&[("pkg.test", &[LOCAL])]).await;
        let proxy = start_proxy(
            &[format!("pkg.test:{}", secure.port), "127.0.0.1".into()],
            &dns,
            EgressLimits::default(),
        );
        let proxy_url = format!("http://{}", proxy.local_addr());
        let curl = |url: String| {
            let ca_file = ca_file.clone();
            let proxy_url = proxy_url.clone();
            tokio::task::spawn_blocking(move || {
                std::process::Command::new("curl")
                    .env_clear()
                    .env("HTTPS_PROXY", &proxy_url)
                    .env("https_proxy", &proxy_url)
                    .args(["-sS", "--max-time", "20", "--cacert"])
                    .arg(&ca_file)
                    .arg(url)
                    .output()
                    .expect("curl is installed")
            })
        };
        let out = curl(format!("https://pkg.test:{}/hello", secure.port))
            .await
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "hello from origin");
        // Another port of the same name: the proxy refuses the CONNECT.
        let out = curl(format!("https://pkg.test:{}/hello", secure.port + 1))
            .await
            .unwrap();
        assert!(!out.status.success(), "{out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("403"),
            "{out:?}"
        );
        let audit = proxy.finish().await;
        assert_eq!(
            find(&audit, "pkg.test", "CONNECT").decision,
            EgressDecision::Allowed
        );
        assert_eq!(audit.records.len(), 2);
        assert_eq!(audit.records[1].port, secure.port + 1);
        assert!(audit.records[1].reason.contains("port"), "{audit:?}");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_destinations_are_refused_audited_and_never_reached() {
    tokio::time::timeout(TEST_TIME, async {
        let origin = Origin::http().await;
        let p = origin.port;
        let dns = Dns::start(&[
            ("allowed.test", &[LOCAL]),
            ("other.test", &[LOCAL]),
            ("metadata.test", &[Ipv4Addr::new(169, 254, 169, 254)]),
            ("private.test", &[Ipv4Addr::new(10, 0, 0, 1)]),
        ])
        .await;
        // The names are allowed, 127.0.0.1 is not listed.
        let proxy = start_proxy(
            &[
                format!("allowed.test:{p}"),
                format!("metadata.test:{p}"),
                format!("private.test:{p}"),
                "allowed.test:443".into(),
            ],
            &dns,
            EgressLimits::default(),
        );
        let c = client(&proxy, None);
        let status = |url: String| {
            let c = c.clone();
            async move {
                let r = c.get(url).send().await.unwrap();
                let s = r.status().as_u16();
                (s, r.text().await.unwrap())
            }
        };
        // A host outside the allowlist.
        let (s, body) = status(format!("http://other.test:{p}/hello")).await;
        assert_eq!(s, 403, "{body}");
        assert!(body.contains("not in the egress allowlist"), "{body}");
        // An allowed name that resolves to 127.0.0.1, which is not listed.
        let (s, body) = status(format!("http://allowed.test:{p}/hello")).await;
        assert_eq!(s, 403, "{body}");
        assert!(body.contains("loopback address 127.0.0.1"), "{body}");
        // Metadata and private answers.
        let (s, body) = status(format!("http://metadata.test:{p}/")).await;
        assert_eq!(
            (s, body.contains("metadata address 169.254.169.254")),
            (403, true),
            "{body}"
        );
        let (s, body) = status(format!("http://private.test:{p}/")).await;
        assert_eq!(
            (s, body.contains("private address 10.0.0.1")),
            (403, true),
            "{body}"
        );
        // IP literals, however written.
        for url in [
            format!("http://127.0.0.1:{p}/hello"),
            format!("http://[::ffff:127.0.0.1]:{p}/hello"),
            format!("http://[::1]:{p}/hello"),
        ] {
            let (s, body) = status(url.clone()).await;
            assert_eq!(s, 403, "{url}: {body}");
            assert!(body.contains("IP literal not listed"), "{url}: {body}");
        }
        let odd = raw(
            &proxy,
            format!("GET http://127.1:{p}/hello HTTP/1.1\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(odd.starts_with("HTTP/1.1 400"), "{odd}");
        // CONNECT to an allowed name on a port that is not allowed.
        let resp = raw(
            &proxy,
            b"CONNECT allowed.test:8443 HTTP/1.1\r\nHost: allowed.test:8443\r\n\r\n",
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 403"), "{resp}");
        assert!(resp.contains("port 8443 is not allowed"), "{resp}");
        // https:// without CONNECT, and a request for the proxy itself.
        let resp = raw(&proxy, b"GET https://allowed.test/ HTTP/1.1\r\n\r\n").await;
        assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
        let resp = raw(&proxy, b"GET /hello HTTP/1.1\r\nHost: allowed.test\r\n\r\n").await;
        assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");

        assert_eq!(origin.hits(), 0, "no denied request reached the origin");
        let audit = proxy.finish().await;
        denied_because(&audit, "other.test", "GET", "not in the egress allowlist");
        denied_because(&audit, "allowed.test", "GET", "loopback address 127.0.0.1");
        denied_because(&audit, "metadata.test", "GET", "metadata address");
        denied_because(&audit, "127.0.0.1", "GET", "IP literal not listed");
        denied_because(&audit, "[::1]", "GET", "IP literal not listed");
        denied_because(
            &audit,
            "allowed.test",
            "CONNECT",
            "port 8443 is not allowed",
        );
        assert_eq!(find(&audit, "allowed.test", "CONNECT").port, 8443);
        assert_eq!(
            dns.a_queries("other.test"),
            0,
            "unlisted names are not even resolved"
        );
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smuggled_and_oversized_heads_are_refused() {
    tokio::time::timeout(TEST_TIME, async {
        let origin = Origin::http().await;
        let p = origin.port;
        let dns = Dns::start(&[("origin.test", &[LOCAL])]).await;
        let limits = EgressLimits {
            max_header_bytes: 4096,
            ..EgressLimits::default()
        };
        let proxy = start_proxy(&[format!("origin.test:{p}"), "127.0.0.1".into()], &dns, limits);
        let target = format!("http://origin.test:{p}/echo");
        let cases: Vec<(String, &str)> = vec![
            (
                format!("POST {target} HTTP/1.1\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /hello HTTP/1.1\r\n\r\n"),
                "HTTP/1.1 400",
            ),
            (
                format!("POST {target} HTTP/1.1\r\nContent-Length: 0\r\nContent-Length: 40\r\n\r\n"),
                "HTTP/1.1 400",
            ),
            (
                format!("POST {target} HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n"),
                "HTTP/1.1 400",
            ),
            (
                format!("GET {target} HTTP/1.1\r\nX-A: 1\r\n Transfer-Encoding: chunked\r\n\r\n"),
                "HTTP/1.1 400",
            ),
            (
                format!("GET {target} HTTP/1.1\nHost: origin.test\n\n"),
                "HTTP/1.1 400",
            ),
            (
                format!("GET {target} HTTP/1.1\r\nX-Big: {}\r\n\r\n", "a".repeat(5000)),
                "HTTP/1.1 431",
            ),
            (
                format!("GET {target} HTTP/1.1\r\nX-Big: {}", "a".repeat(100_000)),
                "HTTP/1.1 431",
            ),
        ];
        for (request, expected) in &cases {
            let resp = raw(&proxy, request.as_bytes()).await;
            assert!(resp.starts_with(expected), "{request:?} -> {resp:?}");
        }
        assert_eq!(origin.hits(), 0, "no refused request reached the origin");
        // A malformed chunk shows only once the body is read, after the head was
        // allowed and sent: the request is cut there and refused.
        let bad_chunk = raw(
            &proxy,
            format!("POST {target} HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(bad_chunk.starts_with("HTTP/1.1 400"), "{bad_chunk}");
        // A well-framed chunked body goes through.
        let ok = raw(
            &proxy,
            format!("POST {target} HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        assert!(ok.ends_with("abcde"), "{ok}");
        let audit = proxy.finish().await;
        let denied: Vec<&EgressRecord> = audit
            .records
            .iter()
            .filter(|r| r.decision == EgressDecision::Denied)
            .collect();
        assert_eq!(denied.len(), cases.len() + 1, "{audit:#?}");
        for reason in [
            "both Content-Length and Transfer-Encoding",
            "more than one Content-Length",
            "Transfer-Encoding other than a single `chunked`",
            "obs-fold",
            "bare LF",
            "request header too large",
            "bad chunk size",
        ] {
            assert!(
                denied.iter().any(|r| r.reason.contains(reason)),
                "{reason}: {denied:#?}"
            );
        }
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebinding_name_stays_pinned_and_its_second_answer_is_refused() {
    tokio::time::timeout(TEST_TIME, async {
        let origin = Origin::http().await;
        let p = origin.port;
        // First answer the listed 127.0.0.1, then an unlisted private address.
        let dns = Dns::start(&[("rebind.test", &[LOCAL, Ipv4Addr::new(10, 0, 0, 1)])]).await;
        let proxy = start_proxy(
            &[format!("rebind.test:{p}"), "127.0.0.1".into()],
            &dns,
            EgressLimits::default(),
        );
        let mut tunnel = TcpStream::connect(proxy.local_addr()).await.unwrap();
        tunnel
            .write_all(format!("CONNECT rebind.test:{p} HTTP/1.1\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut buf = vec![0u8; 4096];
        let n = tunnel.read(&mut buf).await.unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        assert_eq!(dns.a_queries("rebind.test"), 1);
        // The next lookup would say 10.0.0.1: a new connection is refused …
        let c = client(&proxy, None);
        let r = c
            .get(format!("http://rebind.test:{p}/hello"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403);
        assert!(r.text().await.unwrap().contains("private address 10.0.0.1"));
        assert_eq!(dns.a_queries("rebind.test"), 2);
        // … while the open tunnel still goes where it was checked to go, twice.
        for _ in 0..2 {
            tunnel
                .write_all(b"GET /hello HTTP/1.1\r\nHost: rebind.test\r\n\r\n")
                .await
                .unwrap();
            let mut got = Vec::new();
            while !String::from_utf8_lossy(&got).ends_with("hello from origin") {
                let n = tunnel.read(&mut buf).await.unwrap();
                assert!(n > 0, "tunnel closed: {}", String::from_utf8_lossy(&got));
                got.extend_from_slice(&buf[..n]);
            }
        }
        assert_eq!(
            dns.a_queries("rebind.test"),
            2,
            "the tunnel never re-resolved"
        );
        assert_eq!(origin.hits(), 2);
        drop(tunnel);
        let audit = proxy.finish().await;
        assert_eq!(
            find(&audit, "rebind.test", "CONNECT").decision,
            EgressDecision::Allowed
        );
        denied_because(&audit, "rebind.test", "GET", "private address 10.0.0.1");
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_denied_attempts_keep_the_proxy_responsive_and_the_audit_bounded() {
    tokio::time::timeout(TEST_TIME, async {
        let origin = Origin::http().await;
        let p = origin.port;
        let dns = Dns::start(&[("origin.test", &[LOCAL])]).await;
        let limits = EgressLimits {
            max_audit_records: 50,
            ..EgressLimits::default()
        };
        let proxy = start_proxy(
            &[format!("origin.test:{p}"), "127.0.0.1".into()],
            &dns,
            limits,
        );
        let c = client(&proxy, None);
        let mut set = tokio::task::JoinSet::new();
        for i in 0..300 {
            let c = c.clone();
            set.spawn(async move {
                let url = format!("http://denied-{i}.test:{p}/");
                c.get(url).send().await.map(|r| r.status().as_u16())
            });
            if set.len() >= 16 {
                assert_eq!(set.join_next().await.unwrap().unwrap().unwrap(), 403);
            }
        }
        while let Some(r) = set.join_next().await {
            assert_eq!(r.unwrap().unwrap(), 403);
        }
        let r = c
            .get(format!("http://origin.test:{p}/hello"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.text().await.unwrap(), "hello from origin");
        let audit = proxy.finish().await;
        assert_eq!(audit.records.len(), 50);
        assert_eq!(audit.dropped, 251);
        assert!(audit
            .records
            .iter()
            .all(|r| r.decision == EgressDecision::Denied));
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_bytes_and_idle_time_are_bounded() {
    tokio::time::timeout(TEST_TIME, async {
        let origin = Origin::http().await;
        let p = origin.port;
        let dns = Dns::start(&[("origin.test", &[LOCAL])]).await;
        let limits = EgressLimits {
            max_connections: 2,
            max_total_bytes: 50_000,
            idle_timeout: Duration::from_secs(1),
            ..EgressLimits::default()
        };
        let proxy = start_proxy(
            &[format!("origin.test:{p}"), "127.0.0.1".into()],
            &dns,
            limits,
        );
        // Two silent connections hold both slots; a third is turned away at once.
        let mut a = TcpStream::connect(proxy.local_addr()).await.unwrap();
        let mut b = TcpStream::connect(proxy.local_addr()).await.unwrap();
        a.write_all(b"GET ").await.unwrap();
        b.write_all(b"GET ").await.unwrap();
        let third = raw(&proxy, b"").await;
        assert!(third.starts_with("HTTP/1.1 503"), "{third}");
        // The silent ones time out.
        for s in [&mut a, &mut b] {
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            assert!(out.starts_with("HTTP/1.1 408"), "{out}");
        }
        // A 100 000-byte download is cut at the 50 000-byte budget, and then nothing
        // more goes through.
        let big = raw(
            &proxy,
            format!("GET http://origin.test:{p}/big HTTP/1.1\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(
            big.starts_with("HTTP/1.1 200"),
            "{}",
            &big[..big.len().min(200)]
        );
        assert!(big.len() < 50_000, "{}", big.len());
        let after = raw(
            &proxy,
            format!("GET http://origin.test:{p}/hello HTTP/1.1\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(after.starts_with("HTTP/1.1 429"), "{after}");
        assert!(proxy.bytes_used() >= 50_000);
        let audit = proxy.finish().await;
        let reasons: Vec<&str> = audit.records.iter().map(|r| r.reason.as_str()).collect();
        assert!(
            reasons.contains(&"too many connections for this job"),
            "{reasons:?}"
        );
        assert_eq!(
            reasons
                .iter()
                .filter(|r| r.contains("timed out waiting for the request head"))
                .count(),
            2,
            "{reasons:?}"
        );
        let cut = find(&audit, "origin.test", "GET");
        assert_eq!(cut.decision, EgressDecision::Allowed);
        assert_eq!(cut.reason, "byte budget exhausted");
        assert!(reasons.contains(&"byte budget exhausted"));
        assert_eq!(
            audit.records.last().unwrap().decision,
            EgressDecision::Denied
        );
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_adds_its_secret_which_never_reaches_the_sandbox_side() {
    use cynode_worker::egress::routes::{HeaderSource, RouteConfig};
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let (origin, ca) = Origin::https(dir.path(), "localhost").await;
        let ca_file = dir.path().join("route-ca.pem");
        std::fs::write(&ca_file, ca).unwrap();
        let headers = [(
            "Authorization".to_string(),
            HeaderSource {
                env: "ROUTE_TOKEN".into(),
            },
        )]
        .into();
        let config = [(
            "api".to_string(),
            RouteConfig {
                upstream: format!("https://localhost:{}/api", origin.port),
                headers,
                ca_file: Some(ca_file),
            },
        )]
        .into();
        let routes = Routes::build(
            &config,
            |n| (n == "ROUTE_TOKEN").then(|| format!("Bearer {ROUTE_SECRET}")),
            Duration::from_secs(5),
        )
        .unwrap();
        assert!(!format!("{routes:?}").contains(ROUTE_SECRET));
        let dns = Dns::start(&[]).await;
        // No destination is allowlisted: routes do not need the allowlist.
        let proxy = start_proxy_with_routes(&[], &dns, EgressLimits::default(), routes);
        let base = format!("http://{}/routes/api", proxy.local_addr());
        let plain = reqwest::Client::builder().no_proxy().build().unwrap();
        // The sandbox's own Authorization is replaced by the route's.
        let r = plain
            .get(format!("{base}/whoami"))
            .header("Authorization", "Bearer forged")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let shown = format!("{:?}", r.headers());
        assert!(!shown.contains(ROUTE_SECRET), "{shown}");
        assert_eq!(r.text().await.unwrap(), "authorized");
        let r = plain
            .post(format!("{base}/echo"))
            .body("payload")
            .send()
            .await
            .unwrap();
        assert_eq!(r.text().await.unwrap(), "payload");
        // Nothing leaves the base path (/headers would echo the credential back).
        for path in [
            "/routes/api/../headers",
            "/routes/api/%2e%2e/headers",
            "/routes/api/%2E%2E%2Fheaders",
        ] {
            let resp = raw(&proxy, format!("GET {path} HTTP/1.1\r\n\r\n").as_bytes()).await;
            assert!(resp.starts_with("HTTP/1.1 400"), "{path}: {resp}");
            assert!(!resp.contains(ROUTE_SECRET));
        }
        let resp = raw(&proxy, b"GET /routes/nope/x HTTP/1.1\r\n\r\n").await;
        assert!(resp.starts_with("HTTP/1.1 404"), "{resp}");
        assert_eq!(origin.hits(), 2);
        let audit = proxy.finish().await;
        let json = serde_json::to_string(&audit).unwrap();
        assert!(!json.contains(ROUTE_SECRET), "{json}");
        let get = find(&audit, "route:api", "GET");
        assert_eq!(get.decision, EgressDecision::Allowed);
        assert_eq!((get.port, get.reason.as_str()), (origin.port, "ok"));
        assert!(get.bytes_down > 0);
        denied_because(&audit, "route:nope", "GET", "no such route");
    })
    .await
    .unwrap();
}

/// A proxy on 127.0.0.1 with one route `api` to an HTTPS origin of the test's own, adding
/// `Authorization: Bearer <ROUTE_SECRET>`; nothing allowlisted.
async fn route_proxy(dir: &Path) -> (Origin, EgressProxy, Dns) {
    use cynode_worker::egress::routes::{HeaderSource, RouteConfig};
    let (origin, ca) = Origin::https(dir, "localhost").await;
    let ca_file = dir.join("route-ca.pem");
    std::fs::write(&ca_file, ca).unwrap();
    let headers = [(
        "Authorization".to_string(),
        HeaderSource {
            env: "ROUTE_TOKEN".into(),
        },
    )]
    .into();
    let config = [(
        "api".to_string(),
        RouteConfig {
            upstream: format!("https://localhost:{}/api", origin.port),
            headers,
            ca_file: Some(ca_file),
        },
    )]
    .into();
    let routes = Routes::build(
        &config,
        |n| (n == "ROUTE_TOKEN").then(|| format!("Bearer {ROUTE_SECRET}")),
        Duration::from_secs(5),
    )
    .unwrap();
    let dns = Dns::start(&[]).await;
    let proxy = start_proxy_with_routes(&[], &dns, EgressLimits::default(), routes);
    (origin, proxy, dns)
}

/// An upstream that reflects the request's headers: the secret the node added comes back
/// as `<redacted>`, in the answer's headers and in its body, and the route's audit holds
/// no value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_answer_echoing_the_secret_has_it_redacted_in_headers_and_body() {
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let (origin, proxy, _dns) = route_proxy(dir.path()).await;
        let plain = reqwest::Client::builder().no_proxy().build().unwrap();
        let url = format!("http://{}/routes/api/reflect", proxy.local_addr());
        let r = plain.get(&url).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let shown = format!("{:?}", r.headers());
        assert!(!shown.contains(ROUTE_SECRET), "{shown}");
        assert_eq!(r.headers()["x-echo-authorization"], "<redacted>");
        assert_eq!(r.text().await.unwrap(), REDACTED_ECHO);
        // HTTP/1.0: no chunked framing, the answer ends with the connection.
        let resp = raw(
            &proxy,
            b"GET /routes/api/reflect HTTP/1.0\r\nHost: x\r\n\r\n",
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(!resp.contains(ROUTE_SECRET), "{resp}");
        assert!(
            !resp.to_ascii_lowercase().contains("transfer-encoding"),
            "{resp}"
        );
        assert!(
            resp.ends_with(&format!("\r\n\r\n{REDACTED_ECHO}")),
            "{resp}"
        );
        assert_eq!(origin.hits(), 2);
        let audit = proxy.finish().await;
        let json = serde_json::to_string(&audit).unwrap();
        assert!(!json.contains(ROUTE_SECRET), "{json}");
    })
    .await
    .unwrap();
}

/// The echoed secret arrives in two writes, split at every offset of the header value:
/// each answer has it redacted, whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_answer_with_the_secret_split_across_two_writes_has_it_redacted() {
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let (_origin, proxy, _dns) = route_proxy(dir.path()).await;
        let plain = reqwest::Client::builder().no_proxy().build().unwrap();
        let value_len = "Bearer ".len() + ROUTE_SECRET.len();
        for at in 0..=value_len {
            let url = format!("http://{}/routes/api/split?at={at}", proxy.local_addr());
            let r = plain.get(&url).send().await.unwrap();
            assert_eq!(r.status(), 200);
            assert_eq!(r.text().await.unwrap(), REDACTED_ECHO, "split at {at}");
        }
    })
    .await
    .unwrap();
}

/// A compressed answer could carry the secret past the check: the node asks the upstream
/// for an uncompressed one whatever the sandbox accepts, and refuses a compressed one with
/// a 502 that holds none of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_route_answer_is_never_passed_unchecked() {
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let (_origin, proxy, _dns) = route_proxy(dir.path()).await;
        // The sandbox accepts gzip; the upstream is asked for identity and answers plain.
        let resp = raw(
            &proxy,
            b"GET /routes/api/gzip HTTP/1.0\r\nHost: x\r\nAccept-Encoding: gzip, br\r\n\r\n",
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(
            !resp.to_ascii_lowercase().contains("content-encoding"),
            "{resp}"
        );
        assert!(resp.ends_with(REDACTED_ECHO), "{resp}");
        // An upstream that compresses anyway is refused.
        let resp = raw_bytes(
            &proxy,
            b"GET /routes/api/gzip?always HTTP/1.0\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n",
        )
        .await;
        let text = String::from_utf8_lossy(&resp);
        let body_at = text.find("\r\n\r\n").map_or(0, |i| i + 4);
        if resp[body_at..].starts_with(&[0x1f, 0x8b]) {
            let plain = gunzip(&resp[body_at..]);
            panic!(
                "a compressed answer passed: {text} (decoded: {})",
                String::from_utf8_lossy(&plain)
            );
        }
        assert!(text.starts_with("HTTP/1.1 502"), "{text}");
        assert!(
            text.contains("route answer is compressed and cannot be checked"),
            "{text}"
        );
        assert!(!text.contains(ROUTE_SECRET), "{text}");
    })
    .await
    .unwrap();
}

/// A client that ignores `NO_PROXY` sends the route request to its proxy in absolute form,
/// addressed to the proxy itself: it is served as the route (by the listen address or as
/// `localhost` with the proxy's port). Absolute-form requests to another port of the same
/// address, or to the proxy's address outside `/routes/`, are still checked against the
/// allowlist and refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absolute_form_route_request_to_the_proxy_itself_is_served() {
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let (origin, proxy, _dns) = route_proxy(dir.path()).await;
        let own = proxy.local_addr();
        let port = own.port();
        // reqwest through the proxy: absolute form, as busybox wget sends it.
        let via = client(&proxy, None);
        let r = via
            .get(format!("http://{own}/routes/api/whoami"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "authorized");
        let r = via
            .get(format!("http://localhost:{port}/routes/api/reflect?x=1"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), REDACTED_ECHO);
        assert_eq!(origin.hits(), 2);
        // Anything else is checked as before: nothing is allowlisted here.
        for (tag, target) in [
            (
                "other port",
                format!("http://127.0.0.1:{}/routes/api/whoami", origin.port),
            ),
            ("outside /routes", format!("http://{own}/api/whoami")),
            ("no route prefix", format!("http://{own}/routesapi/whoami")),
            (
                "another address",
                format!("http://127.0.0.2:{port}/routes/api/whoami"),
            ),
        ] {
            let resp = raw(&proxy, format!("GET {target} HTTP/1.1\r\n\r\n").as_bytes()).await;
            assert!(resp.starts_with("HTTP/1.1 403"), "{tag}: {resp}");
        }
        // Traversal out of the route's base is refused in absolute form too.
        let resp = raw(
            &proxy,
            format!("GET http://{own}/routes/api/../headers HTTP/1.1\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
        assert_eq!(origin.hits(), 2);
        let audit = proxy.finish().await;
        let routed = audit
            .records
            .iter()
            .filter(|r| r.host == "route:api")
            .count();
        assert_eq!(routed, 2, "{audit:#?}");
        denied_because(&audit, "127.0.0.1", "GET", "IP literal not listed");
        denied_because(&audit, "route", "GET", "may not contain");
    })
    .await
    .unwrap();
}

/// The pid bwrap reports on its `--info-fd` (`{"child-pid": N}`).
fn read_child_pid(info: std::os::fd::OwnedFd) -> u32 {
    use std::io::Read;
    let mut f = std::fs::File::from(info);
    let mut text = Vec::new();
    let mut buf = [0u8; 256];
    while !text.contains(&b'}') {
        let n = f.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "bwrap closed its info fd: {}",
            String::from_utf8_lossy(&text)
        );
        text.extend_from_slice(&buf[..n]);
    }
    let v: serde_json::Value = serde_json::from_slice(&text).unwrap();
    v["child-pid"].as_u64().unwrap() as u32
}

/// A pipe whose first end (`keep`: 0 read, 1 write) stays in this process and whose other
/// end a child inherits.
fn pipe_for_child(keep: usize) -> (std::os::fd::OwnedFd, std::os::fd::OwnedFd) {
    use rustix::io::{fcntl_setfd, FdFlags};
    use rustix::pipe::{pipe_with, PipeFlags};
    let (r, w) = pipe_with(PipeFlags::CLOEXEC).unwrap();
    let (mine, theirs) = if keep == 0 { (r, w) } else { (w, r) };
    fcntl_setfd(&theirs, FdFlags::empty()).unwrap();
    (mine, theirs)
}

/// A real bubblewrap sandbox with its own network namespace: the proxy's listener is
/// bound inside it (setns on a dedicated thread) before its command runs. Inside, curl
/// reaches an HTTPS origin through `HTTPS_PROXY`, and a direct connection to the host's
/// 127.0.0.1 fails: the sandbox has no route out but the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bwrap_sandbox_gets_out_only_through_the_proxy_bound_in_its_namespace() {
    use std::os::fd::AsRawFd;
    tokio::time::timeout(TEST_TIME, async {
        let dir = tempfile::tempdir().unwrap();
        let (secure, ca) = Origin::https(dir.path(), "secure.test").await;
        let bypass = Origin::http().await;
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, ca).unwrap();
        let dns = Dns::start(&[("secure.test", &[LOCAL])]).await;
        let script = format!(
            "curl -sS --max-time 10 --cacert {} https://secure.test:{}/hello; echo; \
             if curl -sS --noproxy '*' --max-time 3 http://127.0.0.1:{}/hello; \
             then echo BYPASSED; else echo bypass-refused; fi",
            ca_file.display(),
            secure.port,
            bypass.port
        );
        let (info_r, info_w) = pipe_for_child(0);
        let (block_w, block_r) = pipe_for_child(1);
        let proxy_url = "http://127.0.0.1:3128";
        let mut cmd = tokio::process::Command::new("bwrap");
        cmd.env_clear()
            .args(["--unshare-all", "--die-with-parent", "--new-session"])
            .args(["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"])
            .args(["--clearenv", "--setenv", "PATH", "/usr/bin:/bin"])
            .args(["--setenv", "HTTPS_PROXY", proxy_url])
            .args(["--setenv", "https_proxy", proxy_url])
            .args(["--setenv", "NO_PROXY", "localhost,127.0.0.1"])
            .args(["--info-fd", &info_w.as_raw_fd().to_string()])
            .args(["--block-fd", &block_r.as_raw_fd().to_string()])
            .args(["--", "sh", "-c", &script])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let child = cmd.spawn().unwrap();
        drop((info_w, block_r));
        let pid = tokio::task::spawn_blocking(move || read_child_pid(info_r))
            .await
            .unwrap();
        let listener =
            cynode_worker::egress::netns::bind_in_netns(pid, "127.0.0.1:3128".parse().unwrap())
                .unwrap();
        let ceiling =
            Allowlist::parse(&[format!("secure.test:{}", secure.port), "127.0.0.1".into()])
                .unwrap();
        let proxy = EgressProxy::start(
            listener,
            "job-bwrap",
            Policy::for_job::<&str>(&ceiling, None).unwrap(),
            Resolver::with_nameservers(&[dns.addr]),
            Arc::new(Routes::default()),
            EgressLimits::default(),
            None,
        )
        .unwrap();
        // Only now may the sandbox's command run.
        std::io::Write::write_all(&mut std::fs::File::from(block_w), b"x").unwrap();
        let out = child.wait_with_output().await.unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            stdout.lines().collect::<Vec<_>>(),
            ["hello from origin", "bypass-refused"],
            "{out:?}"
        );
        assert_eq!(bypass.hits(), 0);
        assert_eq!(secure.hits(), 1);
        let audit = proxy.finish().await;
        let connect = find(&audit, "secure.test", "CONNECT");
        assert_eq!(connect.decision, EgressDecision::Allowed);
        assert_eq!(audit.records.len(), 1, "{audit:#?}");
    })
    .await
    .unwrap();
}

/// Removes a container when the test ends, also on a panic.
struct RemoveContainer(String);

impl Drop for RemoveContainer {
    fn drop(&mut self) {
        let _ = std::process::Command::new("podman")
            .args(["rm", "-f", "-t", "0", &self.0])
            .output();
    }
}

async fn podman(args: &[&str]) -> std::process::Output {
    let out = tokio::process::Command::new("podman")
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "podman {args:?}: {out:?}");
    out
}

/// The same with a Podman container (`--network=none`): created and initialised (its
/// namespaces exist, its command has not started), the listener bound in its network
/// namespace, then started. Inside, a request through the proxy gets its answer; a direct
/// connection to the host fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_podman_container_gets_out_only_through_the_proxy_bound_in_its_namespace() {
    tokio::time::timeout(TEST_TIME, async {
        let origin = Origin::http().await;
        let bypass = Origin::http().await;
        let dns = Dns::start(&[("origin.test", &[LOCAL])]).await;
        let name = format!("cynode-egress-test-{}", std::process::id());
        let _guard = RemoveContainer(name.clone());
        // busybox wget crashes in the test image; nc speaks to the proxy directly.
        let script = format!(
            "printf 'GET http://origin.test:{}/hello HTTP/1.1\\r\\n\\r\\n' \
             | nc -w 10 127.0.0.1 3128 | tail -n 1; echo; \
             if nc -w 3 127.0.0.1 {} </dev/null; \
             then echo BYPASSED; else echo bypass-refused; fi",
            origin.port, bypass.port
        );
        podman(&[
            "create",
            "--name",
            &name,
            "--network=none",
            "--runtime",
            "runc",
            "--pull=never",
            "--env",
            "http_proxy=http://127.0.0.1:3128",
            "--entrypoint",
            "sh",
            "localhost/cynode-sba-test:latest",
            "-c",
            &script,
        ])
        .await;
        podman(&["init", &name]).await;
        let pid = podman(&["inspect", "--format", "{{.State.Pid}}", &name]).await;
        let pid: u32 = String::from_utf8_lossy(&pid.stdout).trim().parse().unwrap();
        let listener =
            cynode_worker::egress::netns::bind_in_netns(pid, "127.0.0.1:3128".parse().unwrap())
                .unwrap();
        let ceiling =
            Allowlist::parse(&[format!("origin.test:{}", origin.port), "127.0.0.1".into()])
                .unwrap();
        let proxy = EgressProxy::start(
            listener,
            "job-podman",
            Policy::for_job::<&str>(&ceiling, None).unwrap(),
            Resolver::with_nameservers(&[dns.addr]),
            Arc::new(Routes::default()),
            EgressLimits::default(),
            None,
        )
        .unwrap();
        let out = podman(&["start", "--attach", &name]).await;
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            stdout.lines().collect::<Vec<_>>(),
            ["hello from origin", "bypass-refused"],
            "{out:?}"
        );
        assert_eq!((origin.hits(), bypass.hits()), (1, 0));
        let audit = proxy.finish().await;
        let get = find(&audit, "origin.test", "GET");
        assert_eq!(get.decision, EgressDecision::Allowed);
        assert_eq!(audit.records.len(), 1, "{audit:#?}");
    })
    .await
    .unwrap();
}
