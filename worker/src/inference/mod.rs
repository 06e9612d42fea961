//! The per-job inference proxy: one set of rules ([`app`]) on two transports. The Unix
//! socket in the job directory (`/job/inference.sock` inside the sandbox, announced as
//! `INFERENCE_PROXY_URL`, the SBA's), and a loopback listener at `127.0.0.1:11434` inside
//! the sandbox's own network namespace ([`listener`]), announced as `OPENAI_BASE_URL`,
//! `OLLAMA_BASE_URL` and a per-job `OPENAI_API_KEY`, so ordinary clients (the `openai`
//! and `ollama` libraries, curl, wget, a coding agent's CLI) reach the node's configured
//! OpenAI-compatible upstream, and nothing else.
//!
//! - Served: `POST /v1/chat/completions`, `GET /v1/models`, and Ollama's `POST /api/chat`,
//!   `POST /api/generate`, `GET /api/tags`, `GET /api/version`, translated to and from the
//!   OpenAI-compatible upstream ([`ollama`]); other paths 404, other methods 405.
//! - A chat request must name one of the job's allowed models (403 otherwise); what goes
//!   upstream is re-serialised from the parsed (or translated) form, so the upstream sees
//!   exactly what was checked. OpenAI streaming is refused (400); Ollama's `stream: true`
//!   (its default) is answered as one NDJSON line holding the whole answer. A request
//!   carrying any field of [`MODEL_SELECTORS`] is refused (400): fields by which routers
//!   (OpenRouter, LiteLLM) pick another model or upstream than `model` names.
//! - Request and response bodies are capped (413 / 502: `inference.max_request_bytes`,
//!   1 MiB by default, and `max_response_bytes`, 4 MiB); a request body must arrive within
//!   [`BODY_READ_TIMEOUT`] (408); the model list is filtered to the allowed models. A job
//!   may send `inference.max_requests_per_job` requests upstream (256 by default; 429
//!   `request_budget_exhausted` beyond), both transports together.
//! - The job is the only client and may be hostile: both transports are served by the
//!   node's bounded accept loop (the node's `listener` timeouts and header cap, and
//!   `limits.job_socket_connections` connections, 16 by default; beyond them, with every
//!   connection mid-request, a new one is answered 503 at once).
//! - The upstream API key is added here, on the upstream request only: it never enters
//!   the sandbox, job.json or a log line. With `inference.key_per_job` it is the key the
//!   job's dispatcher gave with the job ([`crate::job_grants`]), and a job given none is
//!   answered 401 `no_job_key` without a call upstream. The loopback listener's `/v1` wants the job's
//!   own random token as its bearer (what `OPENAI_API_KEY` holds inside), never a key of
//!   the node's.
//! - Every request is audited: one JSON line `inference request` (`job_id`, `via`,
//!   `route`, `model`, `status`, `prompt_tokens`, `completion_tokens`), and the totals
//!   per job when the proxy closes.

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

pub mod listener;
pub mod ollama;
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
    #[error("inference.key_per_job excludes inference.api_key_file and inference.api_key_env")]
    KeyPerJob,
}

/// The node's upstream: where requests go and the key they carry.
pub struct Upstream {
    base: String,
    api_key: Option<String>,
    /// Each job's requests carry the key its dispatcher gave with the job
    /// ([`crate::job_grants::inference_keys`]), never the node's.
    key_per_job: bool,
    client: reqwest::Client,
    max_request_bytes: usize,
    max_response_bytes: usize,
    max_requests: u64,
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
        if cfg.key_per_job && (cfg.api_key_file.is_some() || cfg.api_key_env.is_some()) {
            return Err(UpstreamError::KeyPerJob);
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
            key_per_job: cfg.key_per_job,
            client,
            max_request_bytes: cfg.max_request_bytes,
            max_response_bytes: cfg.max_response_bytes,
            max_requests: cfg.max_requests_per_job,
        })
    }
}

impl Upstream {
    /// Whether each job's requests carry a key of their own (sessions have none).
    pub fn key_per_job(&self) -> bool {
        self.key_per_job
    }
}

/// One job's (or session's) proxy state, shared by its two transports: the socket and the
/// loopback listener ([`listener`]).
pub struct Proxy {
    job_id: String,
    allowed: Vec<String>,
    upstream: Arc<Upstream>,
    max_requests: u64,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    requests: AtomicU64,
}

impl Proxy {
    pub fn new(job_id: &str, allowed: Vec<String>, upstream: Arc<Upstream>) -> Arc<Proxy> {
        Arc::new(Proxy {
            job_id: job_id.to_string(),
            allowed,
            max_requests: upstream.max_requests,
            upstream,
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            requests: AtomicU64::new(0),
        })
    }

    /// The job (or session) this proxy serves.
    pub fn job_id(&self) -> &str {
        &self.job_id
    }
}

/// Which transport a request came by (the audit line's `via`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// `/job/inference.sock`.
    Socket,
    /// The loopback listener at [`listener::ADDR`] in the sandbox's network namespace.
    Loopback,
}

impl Via {
    fn as_str(self) -> &'static str {
        match self {
            Via::Socket => "socket",
            Via::Loopback => "loopback",
        }
    }
}

/// A router's state: the proxy, and the transport it serves.
#[derive(Clone)]
struct Ctx {
    p: Arc<Proxy>,
    via: Via,
}

/// The proxy's routes (the same on both transports; the loopback listener adds its bearer
/// check on `/v1`, [`listener::app`]).
pub fn app(proxy: Arc<Proxy>) -> Router {
    routes(proxy, Via::Socket)
}

fn routes(proxy: Arc<Proxy>, via: Via) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/healthz", get(|| async { "ok" }))
        // Ollama's native API, translated to the OpenAI-compatible upstream
        // ([`ollama`]): the same checks apply there.
        .route("/api/chat", post(ollama_chat))
        .route("/api/generate", post(ollama_generate))
        .route("/api/tags", get(ollama_tags))
        .route("/api/version", get(ollama::version))
        .fallback(|| async {
            error(
                StatusCode::NOT_FOUND,
                "not_found",
                "served: POST /v1/chat/completions, GET /v1/models, POST /api/chat, \
                 POST /api/generate, GET /api/tags, GET /api/version",
            )
        })
        .with_state(Ctx { p: proxy, via })
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
        self.proxy.log_totals();
    }
}

impl Proxy {
    /// The job's (or session's) totals, logged once its proxy closes.
    pub fn log_totals(&self) {
        tracing::info!(
            job_id = %self.job_id,
            requests = self.requests.load(Ordering::Relaxed),
            prompt_tokens = self.prompt_tokens.load(Ordering::Relaxed),
            completion_tokens = self.completion_tokens.load(Ordering::Relaxed),
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

/// What the audit line of one request records beside its status.
#[derive(Debug, Default)]
struct Audit {
    model: Option<String>,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
}

/// The audit: one JSON line per request, whatever its outcome.
fn audited(c: &Ctx, route: &'static str, (resp, a): (Response, Audit)) -> Response {
    tracing::info!(
        target: "cynode_worker::inference",
        job_id = %c.p.job_id,
        via = c.via.as_str(),
        route,
        model = a.model.as_deref(),
        status = resp.status().as_u16(),
        prompt_tokens = a.prompt_tokens,
        completion_tokens = a.completion_tokens,
        "inference request"
    );
    resp
}

async fn chat(State(c): State<Ctx>, body: Body) -> Response {
    let out = forward_completion(&c.p, body, Shape::OpenAi).await;
    audited(&c, "/v1/chat/completions", out)
}

async fn ollama_chat(State(c): State<Ctx>, body: Body) -> Response {
    let out = forward_completion(&c.p, body, Shape::OllamaChat).await;
    audited(&c, "/api/chat", out)
}

async fn ollama_generate(State(c): State<Ctx>, body: Body) -> Response {
    let out = forward_completion(&c.p, body, Shape::OllamaGenerate).await;
    audited(&c, "/api/generate", out)
}

async fn models(State(c): State<Ctx>) -> Response {
    let out = list_models(&c.p)
        .await
        .map(|v| json_response(StatusCode::OK, v.to_string()));
    audited(
        &c,
        "/v1/models",
        (out.unwrap_or_else(|r| r), Audit::default()),
    )
}

/// Ollama's model list: the upstream's OpenAI list, cut to the job's models.
async fn ollama_tags(State(c): State<Ctx>) -> Response {
    let out = list_models(&c.p)
        .await
        .map(|v| json_response(StatusCode::OK, ollama::tags(&v).to_string()));
    audited(
        &c,
        "/api/tags",
        (out.unwrap_or_else(|r| r), Audit::default()),
    )
}

/// The request shape a completion route speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    OpenAi,
    OllamaChat,
    OllamaGenerate,
}

/// One completion request (OpenAI's shape, or Ollama's translated to it) forwarded to the
/// upstream's `/v1/chat/completions` after the checks every route shares: the size cap, a
/// JSON object, no model selector beside `model`, a model the job may use, the job's
/// request budget, no OpenAI streaming (Ollama's `stream: true` is answered as one NDJSON
/// line, [`ollama`]); usage is counted per job.
async fn forward_completion(p: &Proxy, body: Body, shape: Shape) -> (Response, Audit) {
    let mut audit = Audit::default();
    let cap = p.upstream.max_request_bytes;
    let read = tokio::time::timeout(BODY_READ_TIMEOUT, axum::body::to_bytes(body, cap)).await;
    let bytes = match read {
        Ok(Ok(b)) => b,
        Ok(Err(_)) => {
            let r = error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                &format!("request body over the proxy's cap of {cap} bytes"),
            );
            return (r, audit);
        }
        Err(_) => {
            let r = error(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                &format!(
                    "the request body did not arrive within {} s",
                    BODY_READ_TIMEOUT.as_secs()
                ),
            );
            return (r, audit);
        }
    };
    let Ok(Value::Object(req)) = serde_json::from_slice::<Value>(&bytes) else {
        let r = error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "the body must be a JSON object",
        );
        return (r, audit);
    };
    if let Some(field) = MODEL_SELECTORS.iter().find(|f| req.contains_key(**f)) {
        tracing::warn!(job_id = %p.job_id, field = %field, "inference request with a model selector beside `model` refused");
        let r = error(
            StatusCode::BAD_REQUEST,
            "model_selector_refused",
            &format!(
                "field `{field}` is not accepted: the proxy allows a model by `model` alone (refused fields: {})",
                MODEL_SELECTORS.join(", ")
            ),
        );
        return (r, audit);
    }
    let model = req
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    audit.model = Some(model.clone());
    if !p.allowed.contains(&model) {
        tracing::warn!(job_id = %p.job_id, model = %model, "inference request for a model the job may not use");
        let r = error(
            StatusCode::FORBIDDEN,
            "model_not_allowed",
            &format!(
                "model `{model}` is not allowed for this job (allowed: {})",
                p.allowed.join(", ")
            ),
        );
        return (r, audit);
    }
    let (forward, ndjson) = match shape {
        Shape::OpenAi => {
            if req.get("stream").and_then(Value::as_bool) == Some(true) {
                let r = error(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    "streaming is not supported by the inference proxy: send `stream: false`",
                );
                return (r, audit);
            }
            (req, false)
        }
        Shape::OllamaChat | Shape::OllamaGenerate => {
            let ndjson = ollama::wants_stream(&req);
            let translated = if shape == Shape::OllamaChat {
                ollama::chat_request(&req)
            } else {
                ollama::generate_request(&req)
            };
            match translated {
                Ok(t) => (t, ndjson),
                Err(why) => {
                    return (
                        error(StatusCode::BAD_REQUEST, "invalid_request", &why),
                        audit,
                    )
                }
            }
        }
    };
    let Ok(forward) = serde_json::to_vec(&forward) else {
        let r = error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "cannot encode the request",
        );
        return (r, audit);
    };
    let (status, body) = match forward_to(
        p,
        reqwest::Method::POST,
        "/v1/chat/completions",
        Some(forward),
    )
    .await
    {
        Ok(r) => r,
        Err(r) => return (r, audit),
    };
    let parsed = serde_json::from_slice::<Value>(&body).ok();
    if let (true, Some(v)) = (status.is_success(), parsed.as_ref()) {
        audit.prompt_tokens = v["usage"]["prompt_tokens"].as_u64();
        audit.completion_tokens = v["usage"]["completion_tokens"].as_u64();
        p.prompt_tokens
            .fetch_add(audit.prompt_tokens.unwrap_or(0), Ordering::Relaxed);
        p.completion_tokens
            .fetch_add(audit.completion_tokens.unwrap_or(0), Ordering::Relaxed);
    }
    let resp = match (shape, status.is_success(), parsed) {
        (Shape::OpenAi, _, _) | (_, false, _) | (_, true, None) => json_response(status, body),
        (Shape::OllamaChat, true, Some(v)) => {
            ollama::answer(ollama::chat_response(&model, &v), ndjson)
        }
        (Shape::OllamaGenerate, true, Some(v)) => {
            ollama::answer(ollama::generate_response(&model, &v), ndjson)
        }
    };
    (resp, audit)
}

/// The upstream's model list (OpenAI's shape), cut to the job's models (`data[].id`, and
/// `models[].name`/`model` where an upstream adds Ollama's list beside it).
async fn list_models(p: &Proxy) -> Result<Value, Response> {
    let (status, body) = forward_to(p, reqwest::Method::GET, "/v1/models", None).await?;
    let Ok(mut v) = serde_json::from_slice::<Value>(&body) else {
        return Err(json_response(status, body));
    };
    if !status.is_success() {
        return Err(json_response(status, body));
    }
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
    Ok(v)
}

fn json_response(status: StatusCode, body: impl Into<Body>) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.into(),
    )
        .into_response()
}

/// Sends one request upstream (adding the key) and reads the answer within the cap.
async fn forward_to(
    p: &Proxy,
    method: reqwest::Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> Result<(StatusCode, Bytes), Response> {
    let up = &p.upstream;
    let sent = p.requests.fetch_add(1, Ordering::Relaxed);
    if sent >= p.max_requests {
        tracing::warn!(job_id = %p.job_id, path, budget = p.max_requests, "inference request over the job's budget");
        return Err(error(
            StatusCode::TOO_MANY_REQUESTS,
            "request_budget_exhausted",
            &format!(
                "this job has used its {} inference requests (inference.max_requests_per_job)",
                p.max_requests
            ),
        ));
    }
    let key = if up.key_per_job {
        let Some(k) = crate::job_grants::inference_keys().get(&p.job_id) else {
            tracing::warn!(job_id = %p.job_id, path, "no inference key for this job; refused");
            return Err(error(
                StatusCode::UNAUTHORIZED,
                "no_job_key",
                "the node's inference upstream takes a key per job, and this job was given none",
            ));
        };
        Some(k.0)
    } else {
        up.api_key.clone()
    };
    let mut rb = up.client.request(method, format!("{}{path}", up.base));
    if let Some(key) = key {
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
