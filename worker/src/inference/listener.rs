//! The inference proxy's second transport: a TCP listener at [`ADDR`] (`127.0.0.1:11434`,
//! Ollama's port) inside the sandbox's own network namespace, bound by the node through
//! the backend's [`NetnsHook`] before the sandbox's command runs, exactly as the egress
//! proxy is ([`crate::job_egress`]). The listener's socket is the node's (the sandbox only
//! connects to it); its routes are the socket's ([`super::app`]), and `/v1` also wants
//! `Authorization: Bearer <the job's token>` (401 otherwise): a random token made per
//! job, given to the sandbox as `OPENAI_API_KEY`, never a key of the node's.
//!
//! Only backends that start sandboxes gated ([`crate::backend::can_gate`]) can bind it:
//! elsewhere (gVisor, the microVM) a job or session that asks for inference is refused
//! ([`refusal`]), never run without it.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use tokio_util::sync::CancellationToken;

use cynode_tls::ListenerLimits;

use super::{error, routes, Proxy, Via};
use crate::backend::netns_gate::NetnsHook;
use crate::config::Config;

/// Where the listener is bound inside the sandbox's network namespace.
pub const ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 11434);
/// `OLLAMA_BASE_URL` inside the sandbox.
pub const OLLAMA_BASE_URL: &str = "http://127.0.0.1:11434";
/// `OPENAI_BASE_URL` inside the sandbox.
pub const OPENAI_BASE_URL: &str = "http://127.0.0.1:11434/v1";
/// The variables a sandbox with inference gets (beside `INFERENCE_PROXY_URL` for jobs);
/// a request's own values of these names are dropped.
pub const ENV_NAMES: [&str; 3] = ["OPENAI_BASE_URL", "OPENAI_API_KEY", "OLLAMA_BASE_URL"];

/// A fresh random token for one job's listener (256 bits, hex).
pub fn new_token() -> String {
    format!(
        "cynode-{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// The sandbox's variables for a listener whose bearer is `token`.
pub fn env(token: &str) -> Vec<(&'static str, String)> {
    vec![
        ("OPENAI_BASE_URL", OPENAI_BASE_URL.into()),
        ("OPENAI_API_KEY", token.into()),
        ("OLLAMA_BASE_URL", OLLAMA_BASE_URL.into()),
    ]
}

/// Why a job (`field`) asking for inference is refused on `cfg`'s backend, `None` where
/// the listener can be bound. The message starts with [`UNAVAILABLE`].
pub fn refusal(cfg: &Config) -> Option<String> {
    if crate::backend::can_gate(cfg) {
        return None;
    }
    Some(format!(
        "{UNAVAILABLE}: this node's backend ({}) cannot bind the inference listener \
         (127.0.0.1:11434) inside its sandboxes; use bwrap, or podman or docker with runc/crun",
        crate::backend::describe(cfg),
    ))
}

/// The name a refused job's error starts with.
pub const UNAVAILABLE: &str = "inference_listener_unavailable";

/// The loopback router: the proxy's routes, `/v1` behind the job's bearer token.
pub fn app(proxy: Arc<Proxy>, token: String) -> Router {
    let token = Arc::new(format!("Bearer {token}"));
    routes(proxy, Via::Loopback).layer(axum::middleware::from_fn(
        move |req: Request, next: Next| {
            let token = Arc::clone(&token);
            async move {
                let path = req.uri().path();
                let needs = path == "/v1" || path.starts_with("/v1/");
                let given = req
                    .headers()
                    .get(header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok());
                if needs && !given.is_some_and(|g| constant_eq(g.as_bytes(), token.as_bytes())) {
                    return unauthorized();
                }
                next.run(req).await
            }
        },
    ))
}

fn unauthorized() -> Response {
    let mut r = error(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "send `Authorization: Bearer $OPENAI_API_KEY` (the job's token)",
    );
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    r
}

fn constant_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// One job's (or session command's) loopback listener: bound by [`JobInference::hook`]
/// once the sandbox exists; dropping this stops it (closing every connection).
#[derive(Debug)]
pub struct JobInference {
    proxy: Arc<Proxy>,
    token: String,
    limits: ListenerLimits,
    stop: CancellationToken,
}

impl JobInference {
    /// A listener for `proxy` whose `/v1` bearer is `token`, bounded by `limits`.
    pub fn new(proxy: Arc<Proxy>, token: String, limits: ListenerLimits) -> JobInference {
        JobInference {
            proxy,
            token,
            limits,
            stop: CancellationToken::new(),
        }
    }

    /// The backend's hook: binds [`ADDR`] in the network namespace of the pid it is
    /// given (on a blocking thread, as the egress proxy's) and serves the proxy there
    /// until this value is dropped.
    pub fn hook(&self) -> NetnsHook {
        let router = app(Arc::clone(&self.proxy), self.token.clone());
        let limits = self.limits.clone();
        let stop = self.stop.clone();
        let job_id = self.proxy.job_id().to_string();
        Box::new(move |pid: u32| {
            Box::pin(async move {
                let listener = tokio::task::spawn_blocking(move || {
                    crate::egress::netns::bind_in_netns(pid, ADDR)
                })
                .await
                .map_err(|e| format!("inference listener: the binding thread failed: {e}"))?
                .map_err(|e| {
                    format!("inference listener: cannot listen inside the sandbox's network: {e}")
                })?;
                tracing::debug!(job_id = %job_id, "inference listener bound in the sandbox");
                tokio::spawn(async move {
                    let done = stop.clone();
                    if let Err(e) =
                        cynode_tls::serve_with(listener, router, None, limits, async move {
                            done.cancelled().await
                        })
                        .await
                    {
                        tracing::warn!(job_id = %job_id, error = %e, "inference listener failed");
                    }
                });
                Ok(())
            })
        })
    }
}

impl Drop for JobInference {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("job_id", &self.job_id)
            .field("allowed", &self.allowed)
            .finish_non_exhaustive()
    }
}
