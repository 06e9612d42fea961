//! The per-job inference proxy: a Unix socket in the job directory (`/job/inference.sock`
//! inside the sandbox, announced as `INFERENCE_PROXY_URL`), so a sandbox with no network
//! can still reach the node's configured OpenAI-compatible upstream, and nothing else.
//!
//! - Only `POST /v1/chat/completions` and `GET /v1/models` exist (other paths 404, other
//!   methods 405).
//! - A chat request must name one of the job's allowed models (403 otherwise); it is
//!   re-serialised from its parsed form, so the upstream sees exactly what was checked.
//!   Streaming is refused (400), and so is a request carrying any field of
//!   [`MODEL_SELECTORS`] (400): fields by which routers (OpenRouter, LiteLLM) pick another
//!   model or upstream than `model` names.
//! - Request and response bodies are capped (413 / 502: `inference.max_request_bytes`,
//!   1 MiB by default, and `max_response_bytes`, 4 MiB); a request body must arrive within
//!   [`BODY_READ_TIMEOUT`] (408); the model list is filtered to the allowed models.
//! - The job is the only client and may be hostile: the socket is served by the bounded
//!   accept loop (`cynode_tls::serve_unix`: the node's `listener` timeouts and header
//!   cap, and `limits.job_socket_connections` connections, 16 by default; beyond them, with
//!   every connection mid-request, a new one is answered 503 at once). So the node's
//!   descriptors and memory spent on one job's proxy stay bounded.
//! - The upstream API key is added here, on the upstream request only: it never enters
//!   the sandbox, job.json or a log line.
//! - Token usage is logged per request and in total per job (`job_id`, `prompt_tokens`,
//!   `completion_tokens`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};

use cynode_tls::ListenerLimits;

use crate::config::InferenceConfig;
use crate::sandbox::{serve_job_socket, JobSocket, INFERENCE_SOCKET as SOCKET_NAME};

/// Why the configured upstream cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("inference.base_url `{0}`: must be an http:// or https:// URL")]
    BaseUrl(String),
    #[error("cannot read inference.api_key_file {}", path.display())]
    KeyFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("inference.api_key_env names `{0}`, which is not set")]
    KeyEnv(String, #[source] std::env::VarError),
    #[error("inference.tls")]
    Tls(#[source] cynode_tls::TlsError),
    #[error("cannot build the inference http client")]
    Client(#[source] reqwest::Error),
}

/// The node's upstream: where requests go and the key they carry.
pub struct Upstream {
    base: String,
    api_key: Option<String>,
    client: reqwest::Client,
    max_request_bytes: usize,
    max_response_bytes: usize,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("base", &self.base)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl Upstream {
    /// Builds the upstream from the config, reading the key from its file or env variable.
    pub fn from_config(cfg: &InferenceConfig) -> Result<Upstream, UpstreamError> {
        let base = cfg.base_url.trim().trim_end_matches('/');
        let base = base.strip_suffix("/v1").unwrap_or(base).to_string();
        if !base.starts_with("http://") && !base.starts_with("https://") {
            return Err(UpstreamError::BaseUrl(cfg.base_url.clone()));
        }
        let api_key = match (&cfg.api_key_file, &cfg.api_key_env) {
            (Some(p), _) => Some(
                std::fs::read_to_string(p)
                    .map_err(|source| UpstreamError::KeyFile {
                        path: p.clone(),
                        source,
                    })?
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .trim()
                    .to_string(),
            ),
            (None, Some(var)) => {
                Some(std::env::var(var).map_err(|e| UpstreamError::KeyEnv(var.clone(), e))?)
            }
            (None, None) => None,
        }
        .filter(|k| !k.is_empty());
        let builder = cfg
            .tls
            .apply(reqwest::Client::builder())
            .map_err(UpstreamError::Tls)?;
        let client = builder
            .timeout(Duration::from_secs(cfg.timeout_seconds.max(1)))
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(UpstreamError::Client)?;
        Ok(Upstream {
            base,
            api_key,
            client,
            max_request_bytes: cfg.max_request_bytes,
            max_response_bytes: cfg.max_response_bytes,
        })
    }
}

/// One job's proxy state.
pub struct Proxy {
    job_id: String,
    allowed: Vec<String>,
    upstream: Arc<Upstream>,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    requests: AtomicU64,
}

impl Proxy {
    pub fn new(job_id: &str, allowed: Vec<String>, upstream: Arc<Upstream>) -> Arc<Proxy> {
        Arc::new(Proxy {
            job_id: job_id.to_string(),
            allowed,
            upstream,
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            requests: AtomicU64::new(0),
        })
    }
}

/// The proxy's routes.
pub fn app(proxy: Arc<Proxy>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        // Upstream CyNodeAI's proxy answers /healthz, and its SBA and scripts speak
        // Ollama's native API through OLLAMA_BASE_URL: the same checks apply there.
        .route("/healthz", get(|| async { "ok" }))
        .route("/api/chat", post(ollama_chat))
        .route("/api/generate", post(ollama_generate))
        .route("/api/tags", get(ollama_tags))
        .fallback(|| async {
            error(
                StatusCode::NOT_FOUND,
                "not_found",
                "only POST /v1/chat/completions and GET /v1/models are served",
            )
        })
        .with_state(proxy)
}

/// Request fields other than `model` that choose the model or the upstream a request goes
/// to, in the routers the upstream may be: OpenRouter's fallback list (`models`,
/// `route: "fallback"`) and provider routing (`provider`, `preset`); LiteLLM's fallbacks
/// (`fallbacks`, `context_window_fallbacks`, `content_policy_fallbacks`), its
/// per-request deployments (`model_list`, `litellm_params`, `custom_llm_provider`) and
/// client-side upstream (`api_base`, `base_url`, `api_key`, `api_version`); Azure's
/// `deployment_id` and the legacy `engine`. The allowlist is checked on `model` alone, so
/// a request carrying any of these is refused (400 `model_selector_refused`).
pub const MODEL_SELECTORS: &[&str] = &[
    "models",
    "route",
    "provider",
    "preset",
    "fallbacks",
    "context_window_fallbacks",
    "content_policy_fallbacks",
    "model_list",
    "litellm_params",
    "custom_llm_provider",
    "api_base",
    "base_url",
    "api_key",
    "api_version",
    "deployment_id",
    "engine",
];

/// A request body must arrive within this time (408 otherwise).
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// A running proxy; dropping it stops serving (closing every connection), removes the
/// socket and logs the totals.
pub struct ProxyServer {
    _socket: JobSocket,
    proxy: Arc<Proxy>,
}

impl Drop for ProxyServer {
    fn drop(&mut self) {
        let p = &self.proxy;
        tracing::info!(
            job_id = %p.job_id,
            requests = p.requests.load(Ordering::Relaxed),
            prompt_tokens = p.prompt_tokens.load(Ordering::Relaxed),
            completion_tokens = p.completion_tokens.load(Ordering::Relaxed),
            "inference proxy closed"
        );
    }
}

/// Binds `<dir>/inference.sock` for `proxy` and serves it, with connections bounded by
/// `limits`. The socket belongs to the sandbox uid (when the node may chown) with mode
/// 0600: only the sandbox and root reach it.
pub fn listen(
    dir: &Path,
    proxy: Arc<Proxy>,
    limits: &ListenerLimits,
    host_uid: u32,
) -> std::io::Result<ProxyServer> {
    let router = app(Arc::clone(&proxy));
    let socket = serve_job_socket(dir, SOCKET_NAME, Some(host_uid), 0o600, router, limits)?;
    Ok(ProxyServer {
        _socket: socket,
        proxy,
    })
}

fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        json!({ "error": { "type": kind, "message": message } }).to_string(),
    )
        .into_response()
}

async fn chat(State(p): State<Arc<Proxy>>, body: Body) -> Response {
    forward_completion(p, body, "/v1/chat/completions").await
}

async fn ollama_chat(State(p): State<Arc<Proxy>>, body: Body) -> Response {
    forward_completion(p, body, "/api/chat").await
}

async fn ollama_generate(State(p): State<Arc<Proxy>>, body: Body) -> Response {
    forward_completion(p, body, "/api/generate").await
}

/// Ollama's model list, cut to the job's models like `/v1/models`.
async fn ollama_tags(State(p): State<Arc<Proxy>>) -> Response {
    list_models(p, "/api/tags").await
}

/// One completion request (OpenAI's or Ollama's native shape) forwarded to `path` after
/// the checks every route shares: the size cap, a JSON object, a model the job may use,
/// no streaming (Ollama's native routes stream unless told not to: `stream` is set to
/// false when absent), and usage logged per job.
async fn forward_completion(p: Arc<Proxy>, body: Body, path: &'static str) -> Response {
    let cap = p.upstream.max_request_bytes;
    let read = tokio::time::timeout(BODY_READ_TIMEOUT, axum::body::to_bytes(body, cap)).await;
    let bytes = match read {
        Ok(Ok(b)) => b,
        Ok(Err(_)) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                &format!("request body over the proxy's cap of {cap} bytes"),
            )
        }
        Err(_) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                &format!(
                    "the request body did not arrive within {} s",
                    BODY_READ_TIMEOUT.as_secs()
                ),
            )
        }
    };
    let Ok(Value::Object(mut req)) = serde_json::from_slice::<Value>(&bytes) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "the body must be a JSON object",
        );
    };
    if let Some(field) = MODEL_SELECTORS.iter().find(|f| req.contains_key(**f)) {
        tracing::warn!(job_id = %p.job_id, field = %field, "inference request with a model selector beside `model` refused");
        return error(
            StatusCode::BAD_REQUEST,
            "model_selector_refused",
            &format!(
                "field `{field}` is not accepted: the proxy allows a model by `model` alone (refused fields: {})",
                MODEL_SELECTORS.join(", ")
            ),
        );
    }
    let model = req.get("model").and_then(Value::as_str).unwrap_or_default();
    if !p.allowed.iter().any(|m| m == model) {
        tracing::warn!(job_id = %p.job_id, model = %model, "inference request for a model the job may not use");
        return error(
            StatusCode::FORBIDDEN,
            "model_not_allowed",
            &format!(
                "model `{model}` is not allowed for this job (allowed: {})",
                p.allowed.join(", ")
            ),
        );
    }
    if req.get("stream").and_then(Value::as_bool) == Some(true) {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "streaming is not supported by the inference proxy",
        );
    }
    let model = model.to_string();
    if path.starts_with("/api/") {
        req.entry("stream").or_insert(Value::Bool(false));
    }
    let Ok(forward) = serde_json::to_vec(&req) else {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "cannot encode the request",
        );
    };
    p.requests.fetch_add(1, Ordering::Relaxed);
    let resp = match forward_to(&p, reqwest::Method::POST, path, Some(forward)).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    if let (true, Ok(v)) = (
        resp.0.is_success(),
        serde_json::from_slice::<Value>(&resp.1),
    ) {
        // OpenAI's usage, or Ollama's counts.
        let prompt = v["usage"]["prompt_tokens"]
            .as_u64()
            .or_else(|| v["prompt_eval_count"].as_u64());
        let completion = v["usage"]["completion_tokens"]
            .as_u64()
            .or_else(|| v["eval_count"].as_u64());
        p.prompt_tokens
            .fetch_add(prompt.unwrap_or(0), Ordering::Relaxed);
        p.completion_tokens
            .fetch_add(completion.unwrap_or(0), Ordering::Relaxed);
        tracing::info!(job_id = %p.job_id, model = %model, prompt_tokens = prompt, completion_tokens = completion, "inference usage");
    }
    json_response(resp.0, resp.1)
}

async fn models(State(p): State<Arc<Proxy>>) -> Response {
    list_models(p, "/v1/models").await
}

/// The upstream's model list at `path`, cut to the job's models (OpenAI's `data[].id` and
/// Ollama's `models[].name`/`model`).
async fn list_models(p: Arc<Proxy>, path: &'static str) -> Response {
    let (status, body) = match forward_to(&p, reqwest::Method::GET, path, None).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let Ok(mut v) = serde_json::from_slice::<Value>(&body) else {
        return json_response(status, body);
    };
    let allowed = |m: &Value, keys: &[&str]| {
        keys.iter().any(|k| {
            m[*k]
                .as_str()
                .is_some_and(|id| p.allowed.iter().any(|a| a == id))
        })
    };
    if let Some(data) = v.get_mut("data").and_then(Value::as_array_mut) {
        data.retain(|m| allowed(m, &["id"]));
    }
    if let Some(list) = v.get_mut("models").and_then(Value::as_array_mut) {
        list.retain(|m| allowed(m, &["name", "model"]));
    }
    json_response(status, Bytes::from(v.to_string()))
}

fn json_response(status: StatusCode, body: Bytes) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// Sends one request upstream (adding the key) and reads the answer within the cap.
async fn forward_to(
    p: &Proxy,
    method: reqwest::Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> Result<(StatusCode, Bytes), Response> {
    let up = &p.upstream;
    let mut rb = up.client.request(method, format!("{}{path}", up.base));
    if let Some(key) = &up.api_key {
        rb = rb.bearer_auth(key);
    }
    if let Some(b) = body {
        rb = rb
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(b);
    }
    let unavailable = |what: String| {
        tracing::warn!(job_id = %p.job_id, path, error = %what, "inference upstream failed");
        error(
            StatusCode::BAD_GATEWAY,
            "upstream_unavailable",
            "the inference upstream failed; see the node's log",
        )
    };
    let mut resp = rb
        .send()
        .await
        .map_err(|e| unavailable(e.without_url().to_string()))?;
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let cap = up.max_response_bytes;
    let mut buf = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| unavailable(e.without_url().to_string()))?
    {
        if buf.len() + chunk.len() > cap {
            tracing::warn!(job_id = %p.job_id, path, cap, "inference response over the cap");
            return Err(error(
                StatusCode::BAD_GATEWAY,
                "response_too_large",
                &format!("the upstream response is over the proxy's cap of {cap} bytes"),
            ));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok((status, Bytes::from(buf)))
}
