//! The per-job gateway socket: `/job/gateway.sock` inside the sandbox, through which a
//! job calls the PM's tool gateway (MCP over streamable HTTP, `/v1/gateway` of
//! `cynode-pm serve`) although it has no network and holds no token.
//!
//! - The PM hands the node the gateway's URL and the job's token in the Worker API
//!   request (`gateway`, never in job.json). The node keeps them in memory only
//!   ([`crate::job_grants`]): they are taken out of the request before it is digested or stored, so
//!   neither the job store nor a log line ever holds the token, and a PM that re-submits
//!   the same job (after a restart, with a new token) is the same request and updates the
//!   grant in place.
//! - Each request on the socket is forwarded to that URL with `Authorization: Bearer
//!   <token>` added here; of the sandbox's headers only `Content-Type`, `Accept` and
//!   the MCP ones (`Mcp-Protocol-Version`, `Mcp-Method`, `Mcp-Name`) go on (the sandbox's own `Authorization`, if any, is
//!   dropped). No redirects are followed, no proxy is used. An `https://` gateway is
//!   verified against the system's roots and config `gateway.tls` (a private CA, a client
//!   identity). When the job ends its grant
//!   is removed and the socket closed; the PM revokes the token too.
//! - The job is the only client and may be hostile. The socket is served by the bounded
//!   accept loop (`cynode_tls::serve_unix`: the node's `listener` timeouts and header cap,
//!   `limits.job_socket_connections` connections); at most [`IN_FLIGHT`] requests are
//!   forwarded at once (more wait up to [`QUEUE_WAIT`], then 503), and only then is a
//!   body read: at most [`MAX_REQUEST_BYTES`] (413), within [`BODY_READ_TIMEOUT`] (408).
//!   Replies are cut at [`MAX_RESPONSE_BYTES`] (502) and the whole exchange at
//!   [`UPSTREAM_TIMEOUT`]. So one job's gateway costs the node a bounded number of
//!   descriptors and at most `IN_FLIGHT × (MAX_REQUEST_BYTES + MAX_RESPONSE_BYTES)` of
//!   memory.
//! - Only `POST /` (and `POST /mcp`) exist; other paths 404, other methods 405.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use cynode_tls::ListenerLimits;
use serde_json::json;
use tokio::sync::Semaphore;

use crate::sandbox::{serve_job_socket, JobSocket};

/// The socket's file name in the job directory (`/job/gateway.sock` in the sandbox).
pub const SOCKET_NAME: &str = "gateway.sock";
/// Largest request body forwarded (an 8 MiB `artifact.put`, base64, and its envelope).
pub const MAX_REQUEST_BYTES: usize = 12 << 20;
/// Largest reply passed back (an 8 MiB `artifact.get`, base64 once in the reply's
/// `structuredContent`, and its envelope).
pub const MAX_RESPONSE_BYTES: usize = 12 << 20;
/// Requests of one job forwarded at once.
pub const IN_FLIGHT: usize = 2;
/// How long a request waits for one of the [`IN_FLIGHT`] places (503 after).
pub const QUEUE_WAIT: Duration = Duration::from_secs(10);
/// A request body must arrive within this time (408 otherwise).
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// The PM must answer within this time (504 otherwise).
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(60);

/// One job's forwarder.
pub struct Forwarder {
    job_id: String,
    client: reqwest::Client,
    places: Semaphore,
    requests: AtomicU64,
    refused: AtomicU64,
}

impl Forwarder {
    /// The forwarder of `job_id`, reading its grant from [`grants`] at each request and
    /// sending through `client` (the node's, from [`client`]).
    pub fn new(job_id: &str, client: reqwest::Client) -> Arc<Forwarder> {
        Arc::new(Forwarder {
            job_id: job_id.to_string(),
            client,
            places: Semaphore::new(IN_FLIGHT),
            requests: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        })
    }
}

/// The node's one client to the PM's gateway, built when the node starts (so a bad
/// `gateway.tls` stops the node, not every job): no redirects, no proxy, bounded connect
/// and exchange, trusting the system's roots and `tls` (config `gateway.tls`).
pub fn client(tls: &cynode_tls::ClientTls) -> Result<reqwest::Client, String> {
    let builder = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .connect_timeout(Duration::from_secs(10))
        .timeout(UPSTREAM_TIMEOUT);
    tls.apply(builder)
        .map_err(|e| format!("gateway.tls: {e}"))?
        .build()
        .map_err(|e| format!("gateway.tls: {e}"))
}

/// The socket's routes.
pub fn app(f: Arc<Forwarder>) -> Router {
    Router::new()
        .route("/", post(forward))
        .route("/mcp", post(forward))
        .fallback(|| async {
            error(
                StatusCode::NOT_FOUND,
                "not_found",
                "only POST / (MCP streamable HTTP, JSON replies) is served",
            )
        })
        .with_state(f)
}

fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        json!({ "error": { "type": kind, "message": message } }).to_string(),
    )
        .into_response()
}

/// A running gateway socket; dropping it stops serving, removes the socket and logs the
/// job's totals.
pub struct ForwardServer {
    _socket: JobSocket,
    forwarder: Arc<Forwarder>,
}

impl Drop for ForwardServer {
    fn drop(&mut self) {
        let f = &self.forwarder;
        tracing::info!(
            job_id = %f.job_id,
            requests = f.requests.load(Ordering::Relaxed),
            refused = f.refused.load(Ordering::Relaxed),
            "gateway socket closed"
        );
    }
}

/// Binds `<dir>/gateway.sock` for `job_id` and serves it through the node's `client`,
/// connections bounded by `limits`; the socket belongs to the sandbox uid with mode 0600
/// (see [`bind_job_socket`]).
pub fn listen(
    dir: &Path,
    job_id: &str,
    limits: &ListenerLimits,
    client: &reqwest::Client,
    host_uid: u32,
) -> std::io::Result<ForwardServer> {
    let forwarder = Forwarder::new(job_id, client.clone());
    serve(dir, forwarder, limits, Some(host_uid))
}

/// [`listen`] with a forwarder of the caller's (tests).
pub fn serve(
    dir: &Path,
    forwarder: Arc<Forwarder>,
    limits: &ListenerLimits,
    owner: Option<u32>,
) -> std::io::Result<ForwardServer> {
    let router = app(Arc::clone(&forwarder));
    let socket = serve_job_socket(dir, SOCKET_NAME, owner, 0o600, router, limits)?;
    Ok(ForwardServer {
        _socket: socket,
        forwarder,
    })
}

/// The sandbox's headers that go on to the gateway.
const PASSED_HEADERS: [&str; 5] = [
    "content-type",
    "accept",
    "mcp-protocol-version",
    "mcp-method",
    "mcp-name",
];

async fn forward(State(f): State<Arc<Forwarder>>, headers: HeaderMap, body: Body) -> Response {
    let refuse = |status, kind, msg: &str| {
        f.refused.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(job_id = %f.job_id, status = %status, kind, "gateway request refused");
        error(status, kind, msg)
    };
    let Ok(Ok(_place)) = tokio::time::timeout(QUEUE_WAIT, f.places.acquire()).await else {
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            "busy",
            &format!("{IN_FLIGHT} gateway requests of this job are already in flight"),
        );
    };
    let Some(grant) = crate::job_grants::gateway().get(&f.job_id) else {
        return refuse(
            StatusCode::GONE,
            "job_ended",
            "this job has no gateway any more",
        );
    };
    let read = tokio::time::timeout(
        BODY_READ_TIMEOUT,
        axum::body::to_bytes(body, MAX_REQUEST_BYTES),
    )
    .await;
    let bytes = match read {
        Ok(Ok(b)) => b,
        Ok(Err(_)) => {
            return refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                &format!("request body over the gateway socket's cap of {MAX_REQUEST_BYTES} bytes"),
            )
        }
        Err(_) => {
            return refuse(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                &format!(
                    "the request body did not arrive within {} s",
                    BODY_READ_TIMEOUT.as_secs()
                ),
            )
        }
    };
    f.requests.fetch_add(1, Ordering::Relaxed);
    let mut rb = f.client.post(&grant.url).bearer_auth(&grant.token);
    for name in PASSED_HEADERS {
        if let Some(v) = headers.get(name) {
            rb = rb.header(name, v.as_bytes());
        }
    }
    let sent = rb.body(bytes).send().await;
    let unavailable = |e: reqwest::Error| {
        let status = if e.is_timeout() {
            StatusCode::GATEWAY_TIMEOUT
        } else {
            StatusCode::BAD_GATEWAY
        };
        let e = e.without_url();
        let mut reason = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            reason.push_str(&format!(": {s}"));
            source = s.source();
        }
        tracing::warn!(job_id = %f.job_id, error = %reason, "gateway upstream failed");
        error(
            status,
            "upstream_unavailable",
            "the PM's gateway did not answer; see the node's log",
        )
    };
    let mut resp = match sent {
        Ok(r) => r,
        Err(e) => return unavailable(e),
    };
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = resp.headers().get(reqwest::header::CONTENT_TYPE).cloned();
    let mut buf = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                if buf.len() + chunk.len() > MAX_RESPONSE_BYTES {
                    tracing::warn!(job_id = %f.job_id, cap = MAX_RESPONSE_BYTES, "gateway reply over the cap");
                    return error(
                        StatusCode::BAD_GATEWAY,
                        "response_too_large",
                        &format!(
                            "the gateway's reply is over the cap of {MAX_RESPONSE_BYTES} bytes"
                        ),
                    );
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(None) => break,
            Err(e) => return unavailable(e),
        }
    }
    tracing::info!(job_id = %f.job_id, status = status.as_u16(), bytes_in = buf.len(), "gateway request");
    let mut out = (status, Bytes::from(buf)).into_response();
    if let Some(ct) = content_type.and_then(|v| header::HeaderValue::from_bytes(v.as_bytes()).ok())
    {
        out.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    out
}
