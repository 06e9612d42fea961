//! The inference relay: how a local worker's agent jobs reach a hosted model whose API
//! key stays in the PM's process. `cynode-pm run` (and `mcp`) host it on a loopback
//! listener for the life of the run and give the local worker its URL as the inference
//! upstream, with `key_per_job`: each job's requests carry a key of that job's own.
//!
//! - Served: `POST /v1/chat/completions` and `GET /v1/models` (what the worker's
//!   inference proxy sends upstream), forwarded to the model's base URL as the PM's own
//!   client calls it (`{base}/chat/completions`, `{base}/models`) with the real key as the
//!   bearer; other paths 404, other methods 405.
//! - Every request must carry a live job key as its bearer ([`job_keys`]: minted per job
//!   at dispatch, sent in the job's Worker API request, revoked when the job ends;
//!   compared in constant time): 401 otherwise, before the body is read. A key is random,
//!   never the model's key, and the worker holds it only while its job runs: it holds no
//!   standing credential of the relay's.
//! - Only the body and `content-type: application/json` go upstream: none of the caller's
//!   headers. The answer comes back with its status and body only.
//! - Bounded: a request body over `max_request_bytes` is 413; an answer over
//!   `max_response_bytes` is 502 `response_too_large`; an upstream that does not answer
//!   within `timeout` is 504 `upstream_timeout`; a whole request over `timeout` plus
//!   [`READ_MARGIN`] is 408. Connections go through the node's bounded accept loop
//!   (`cynode_tls::serve_with`, default listener limits).
//! - Logged: one line per request (route, status, bytes), never the key or the token.
//! - Taken over on resume: a local worker outlives a killed PM (its grace period) and
//!   keeps calling that PM's relay address. The PM that resumes and attaches to it learns
//!   the address from the worker's keeper and serves its relay there too
//!   ([`Relay::also_serve`]); re-submitting the running job gives it a key of this PM's,
//!   so that job and the worker's next ones reach the model again.

pub mod job_keys;

use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use secrecy::{ExposeSecret, SecretString};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// Largest request body relayed by default (the worker's own cap is 1 MiB).
pub const MAX_REQUEST_BYTES: usize = 2 << 20;
/// Largest answer relayed by default (the worker's own cap is 4 MiB).
pub const MAX_RESPONSE_BYTES: usize = 8 << 20;
/// Beyond the upstream's timeout, how long a whole request may take (reading its body,
/// writing the answer) before it is answered 408.
pub const READ_MARGIN: Duration = Duration::from_secs(15);

/// Why the relay could not start.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("the model base URL `{0}` must be an http:// or https:// URL")]
    BaseUrl(String),
    #[error("the model's TLS settings")]
    Tls(#[source] cynode_tls::TlsError),
    #[error("cannot build the relay's http client")]
    Client(#[source] reqwest::Error),
    #[error("the API key contains characters not allowed in an HTTP header")]
    Key,
    #[error("the relay's listener")]
    Listener(#[source] std::io::Error),
}

/// Where the relay forwards and with which key.
pub struct RelaySettings {
    /// The model's OpenAI-compatible base URL, as the PM's client uses it
    /// (`https://host/v1`).
    pub base_url: String,
    /// The hosted model's key: sent upstream only.
    pub api_key: SecretString,
    /// Extra CA certificates to trust for an `https://` base URL.
    pub ca_file: Option<PathBuf>,
    pub max_request_bytes: usize,
    pub max_response_bytes: usize,
    /// Bound on one upstream call.
    pub timeout: Duration,
}

impl std::fmt::Debug for RelaySettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelaySettings")
            .field("base_url", &self.base_url)
            .field("api_key", &"<redacted>")
            .finish_non_exhaustive()
    }
}

/// A running relay; it stops when dropped.
pub struct Relay {
    url: String,
    stop: CancellationToken,
    upstream: Arc<Upstream>,
    timeout: Duration,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay").field("url", &self.url).finish()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.cancel();
        job_keys::stopped();
    }
}

impl Relay {
    /// `http://127.0.0.1:PORT`: the base URL the worker is given (it adds `/v1/…`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Also serves the relay at `url` (an `http://127.0.0.1:PORT` base) until this relay
    /// stops: how a PM that resumes a session takes over the relay of the PM before it,
    /// whose local worker still runs and still calls the address it was started with. The
    /// port must be free again (its PM is gone); anything but a loopback `http://`
    /// address is refused.
    pub fn also_serve(&self, url: &str) -> Result<(), RelayError> {
        let addr = url
            .strip_prefix("http://")
            .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
            .filter(|a| a.ip().is_loopback())
            .ok_or_else(|| RelayError::BaseUrl(url.to_string()))?;
        let listener = TcpListener::bind(addr).map_err(RelayError::Listener)?;
        serve(
            listener,
            Arc::clone(&self.upstream),
            self.timeout,
            self.stop.child_token(),
        );
        tracing::info!(relay = %url, "inference relay taken over from the local worker's previous PM");
        Ok(())
    }
}

/// Where the relay forwards, with which key and bounds: one per relay, shared by each
/// address it serves.
struct Upstream {
    base: String,
    auth: header::HeaderValue,
    client: reqwest::Client,
    max_request_bytes: usize,
    max_response_bytes: usize,
}

/// Starts the relay on `listener` (a loopback one: the caller binds it) in the current
/// tokio runtime.
pub fn start(listener: TcpListener, s: RelaySettings) -> Result<Relay, RelayError> {
    let base = s.base_url.trim().trim_end_matches('/').to_string();
    if !(base.starts_with("http://") || base.starts_with("https://")) {
        return Err(RelayError::BaseUrl(s.base_url.clone()));
    }
    let mut auth = header::HeaderValue::from_str(&format!("Bearer {}", s.api_key.expose_secret()))
        .map_err(|_| RelayError::Key)?;
    auth.set_sensitive(true);
    cynode_tls::install_provider();
    let tls = cynode_tls::ClientTls {
        ca_file: s.ca_file.clone(),
        cert_file: None,
        key_file: None,
    };
    let client = tls
        .apply(reqwest::Client::builder())
        .map_err(RelayError::Tls)?
        .timeout(s.timeout)
        .connect_timeout(Duration::from_secs(10).min(s.timeout))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(RelayError::Client)?;
    let addr = listener.local_addr().map_err(RelayError::Listener)?;
    let upstream = Arc::new(Upstream {
        base,
        auth,
        client,
        max_request_bytes: s.max_request_bytes,
        max_response_bytes: s.max_response_bytes,
    });
    let stop = CancellationToken::new();
    job_keys::started();
    serve(listener, Arc::clone(&upstream), s.timeout, stop.clone());
    let url = format!("http://{addr}");
    tracing::info!(relay = %url, upstream = %s.base_url, "inference relay for the local worker");
    Ok(Relay {
        url,
        stop,
        upstream,
        timeout: s.timeout,
    })
}

/// Serves the relay to `upstream` on `listener`, for callers holding a live job key,
/// until `done` is cancelled.
fn serve(
    listener: TcpListener,
    upstream: Arc<Upstream>,
    timeout: Duration,
    done: CancellationToken,
) {
    let app = Router::new().fallback(relay).with_state(upstream).layer(
        tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            timeout + READ_MARGIN,
        ),
    );
    tokio::spawn(async move {
        let shutdown = async move { done.cancelled().await };
        if let Err(e) = cynode_tls::serve_with(
            listener,
            app,
            None,
            cynode_tls::ListenerLimits::default(),
            shutdown,
        )
        .await
        {
            tracing::warn!(error = %e, "the inference relay stopped");
        }
    });
}

fn problem(status: StatusCode, kind: &str, detail: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        json!({ "error": { "type": kind, "message": detail } }).to_string(),
    )
        .into_response()
}

/// Whether `req` carries a live job key as its bearer.
fn authorized(req: &Request) -> bool {
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|given| job_keys::keys().admits(given))
}

async fn relay(State(up): State<Arc<Upstream>>, req: Request) -> Response {
    let route = req.uri().path().to_string();
    let resp = handle(&up, req).await;
    tracing::info!(route = %route.chars().take(64).collect::<String>(), status = resp.status().as_u16(), "inference relay request");
    resp
}

async fn handle(up: &Upstream, req: Request) -> Response {
    if !authorized(&req) {
        return problem(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a live job key of this PM's is required",
        );
    }
    let (method, upstream_path) = match req.uri().path() {
        "/v1/chat/completions" => (Method::POST, "/chat/completions"),
        "/v1/models" => (Method::GET, "/models"),
        _ => return problem(StatusCode::NOT_FOUND, "not_found", "no such route"),
    };
    if req.method() != method {
        return problem(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "method not allowed",
        );
    }
    let body = if method == Method::POST {
        match axum::body::to_bytes(req.into_body(), up.max_request_bytes).await {
            Ok(b) => Some(b),
            Err(_) => {
                return problem(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "request_too_large",
                    &format!(
                        "the request body is over the relay's cap of {} bytes",
                        up.max_request_bytes
                    ),
                )
            }
        }
    } else {
        None
    };
    let mut rb = up
        .client
        .request(method, format!("{}{upstream_path}", up.base))
        .header(header::AUTHORIZATION, up.auth.clone());
    if let Some(b) = body {
        rb = rb.header(header::CONTENT_TYPE, "application/json").body(b);
    }
    let failed = |e: reqwest::Error| {
        let timeout = e.is_timeout();
        tracing::warn!(error = %e.without_url(), timeout, "the model upstream failed");
        if timeout {
            problem(
                StatusCode::GATEWAY_TIMEOUT,
                "upstream_timeout",
                "the model did not answer in time",
            )
        } else {
            problem(
                StatusCode::BAD_GATEWAY,
                "upstream_unavailable",
                "the model upstream failed; see the PM's log",
            )
        }
    };
    let mut resp = match rb.send().await {
        Ok(r) => r,
        Err(e) => return failed(e),
    };
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut buf = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                if buf.len() + chunk.len() > up.max_response_bytes {
                    return problem(
                        StatusCode::BAD_GATEWAY,
                        "response_too_large",
                        &format!(
                            "the model's answer is over the relay's cap of {} bytes",
                            up.max_response_bytes
                        ),
                    );
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(None) => break,
            Err(e) => return failed(e),
        }
    }
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from(Bytes::from(buf)),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::{get, post};
    use std::sync::Mutex;

    const KEY: &str = "sk-relay-test-key-0123456789";

    /// What the upstream got: each request's authorization and header names.
    type Seen = Arc<Mutex<Vec<(String, Vec<String>)>>>;

    /// A model upstream that demands [`KEY`], records the authorization and the headers it
    /// got, answers a chat completion, a huge answer on `/v1/huge`'s model, or never.
    async fn upstream() -> (String, Seen) {
        let seen: Seen = Arc::default();
        let s1 = seen.clone();
        let s2 = seen.clone();
        let record = |seen: &Seen, h: &axum::http::HeaderMap| {
            let auth = h
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            let names = h.keys().map(|k| k.as_str().to_string()).collect();
            seen.lock().unwrap().push((auth.clone(), names));
            auth == format!("Bearer {KEY}")
        };
        let app = Router::new()
            .route(
                "/v1/chat/completions",
                post(move |h: axum::http::HeaderMap, body: String| {
                    let ok = record(&s1, &h);
                    async move {
                        if !ok {
                            return (StatusCode::UNAUTHORIZED, "no key".to_string());
                        }
                        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
                        match v["model"].as_str() {
                            Some("hang") => {
                                tokio::time::sleep(Duration::from_secs(3600)).await;
                                (StatusCode::OK, String::new())
                            }
                            Some("huge") => (StatusCode::OK, "x".repeat(64 << 10)),
                            _ => (StatusCode::OK, json!({ "echo": v }).to_string()),
                        }
                    }
                }),
            )
            .route(
                "/v1/models",
                get(move |h: axum::http::HeaderMap| {
                    let ok = record(&s2, &h);
                    async move {
                        if ok {
                            (StatusCode::OK, r#"{"data":[{"id":"m"}]}"#.to_string())
                        } else {
                            (StatusCode::UNAUTHORIZED, "no key".to_string())
                        }
                    }
                }),
            );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        (format!("http://{addr}/v1"), seen)
    }

    /// A live job key of this process's relays, revoked when the guard drops.
    fn key_for(job: &str) -> (String, job_keys::KeyGuard) {
        let (k, g) = job_keys::job_key(job, Duration::from_secs(300)).unwrap();
        (k.0, g)
    }

    fn relay_to(base: &str, timeout: Duration) -> Relay {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        start(
            l,
            RelaySettings {
                base_url: base.into(),
                api_key: SecretString::from(KEY.to_string()),
                ca_file: None,
                max_request_bytes: 16 << 10,
                max_response_bytes: 32 << 10,
                timeout,
            },
        )
        .unwrap()
    }

    /// The relay adds the key, and only the key: the caller's token and headers stay on
    /// this side; a caller without a live job key is refused before anything goes
    /// upstream.
    #[tokio::test]
    async fn the_key_is_added_upstream_and_a_caller_needs_a_live_job_key() {
        let (base, seen) = upstream().await;
        let r = relay_to(&base, Duration::from_secs(30));
        let (key, _guard) = key_for("jr-1");
        let http = reqwest::Client::new();
        let chat = format!("{}/v1/chat/completions", r.url());
        let body = json!({ "model": "m", "messages": [] });
        let ok = http
            .post(&chat)
            .bearer_auth(&key)
            .header("x-forwarded-for", "10.0.0.1")
            .header("cookie", "a=b")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(ok.status(), 200);
        let v: serde_json::Value = ok.json().await.unwrap();
        assert_eq!(v["echo"], body);
        let models = http
            .get(format!("{}/v1/models", r.url()))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap();
        assert_eq!(models.status(), 200);
        {
            let seen = seen.lock().unwrap();
            assert_eq!(seen.len(), 2);
            for (auth, names) in seen.iter() {
                assert_eq!(auth, &format!("Bearer {KEY}"));
                assert!(
                    !names
                        .iter()
                        .any(|n| n == "cookie" || n == "x-forwarded-for"),
                    "{names:?}"
                );
            }
        }
        // No token, a wrong one, the key itself, a token one byte short: 401, nothing
        // upstream.
        let wrong = "0".repeat(key.len());
        let short = &key[1..];
        for token in [None, Some(wrong.as_str()), Some(KEY), Some(short)] {
            let mut rq = http.post(&chat).json(&body);
            if let Some(t) = token {
                rq = rq.bearer_auth(t);
            }
            let resp = rq.send().await.unwrap();
            assert_eq!(resp.status(), 401, "{token:?}");
            let text = resp.text().await.unwrap();
            assert!(!text.contains(KEY), "{text}");
        }
        assert_eq!(seen.lock().unwrap().len(), 2);
        // Other routes and methods.
        let other = http
            .post(format!("{}/v1/embeddings", r.url()))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap();
        assert_eq!(other.status(), 404);
        let method = http.get(&chat).bearer_auth(&key).send().await.unwrap();
        assert_eq!(method.status(), 405);
        assert!(!format!("{r:?}").contains(&key));
    }

    /// A huge body is refused (413), a huge answer is cut off (502), an upstream that
    /// never answers is a 504 once the timeout passes.
    #[tokio::test]
    async fn bodies_are_bounded_and_a_silent_upstream_times_out() {
        let (base, seen) = upstream().await;
        let r = relay_to(&base, Duration::from_secs(2));
        let (key, _guard) = key_for("jr-2");
        let http = reqwest::Client::new();
        let chat = format!("{}/v1/chat/completions", r.url());
        let big = json!({ "model": "m", "messages": [{ "role": "user", "content": "a".repeat(64 << 10) }] });
        let resp = http
            .post(&chat)
            .bearer_auth(&key)
            .json(&big)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 413);
        assert!(seen.lock().unwrap().is_empty(), "a huge body went upstream");
        let huge = http
            .post(&chat)
            .bearer_auth(&key)
            .json(&json!({ "model": "huge" }))
            .send()
            .await
            .unwrap();
        assert_eq!(huge.status(), 502);
        let v: serde_json::Value = huge.json().await.unwrap();
        assert_eq!(v["error"]["type"], "response_too_large");
        let hang = http
            .post(&chat)
            .bearer_auth(&key)
            .json(&json!({ "model": "hang" }))
            .send()
            .await
            .unwrap();
        assert_eq!(hang.status(), 504);
    }

    /// A dropped relay stops listening.
    #[tokio::test]
    async fn a_dropped_relay_stops() {
        let (base, _) = upstream().await;
        let r = relay_to(&base, Duration::from_secs(5));
        let url = format!("{}/v1/models", r.url());
        drop(r);
        let http = reqwest::Client::new();
        let mut gone = false;
        for _ in 0..100 {
            if http.get(&url).send().await.is_err() {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(gone, "the relay still answers after it was dropped");
    }

    /// A relay taken over at another address answers there to the live job keys (the
    /// same as at its own), adds the key upstream, refuses a revoked key, stops with the
    /// relay, and is refused off loopback.
    #[tokio::test]
    async fn a_taken_over_address_takes_the_live_job_keys() {
        let (base, seen) = upstream().await;
        let relay = relay_to(&base, Duration::from_secs(10));
        let (key, guard) = key_for("jr-takeover");
        let free = TcpListener::bind("127.0.0.1:0").unwrap();
        let old = format!("http://{}", free.local_addr().unwrap());
        drop(free);
        relay.also_serve(&old).unwrap();
        let http = reqwest::Client::new();
        let models = |t: &str| {
            http.get(format!("{old}/v1/models"))
                .bearer_auth(t.to_string())
                .send()
        };
        assert_eq!(models(&key).await.unwrap().status().as_u16(), 200);
        assert_eq!(seen.lock().unwrap()[0].0, format!("Bearer {KEY}"));
        for url in ["http://10.0.0.1:80", "https://127.0.0.1:1", "127.0.0.1:1"] {
            assert!(matches!(relay.also_serve(url), Err(RelayError::BaseUrl(_))));
        }
        drop(guard);
        assert_eq!(
            models(&key).await.unwrap().status().as_u16(),
            401,
            "a revoked key"
        );
        let (key, _guard) = key_for("jr-takeover-2");
        drop(relay);
        let gone = tokio::time::timeout(Duration::from_secs(10), async {
            while models(&key).await.is_ok() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(gone.is_ok(), "the taken-over address outlived its relay");
    }
}
