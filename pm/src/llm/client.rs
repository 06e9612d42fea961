//! The model client: one chat completion against any OpenAI-compatible endpoint (OpenAI,
//! Ollama, vLLM, llama.cpp's llama-server) through async-openai, with the reply constrained
//! by `response_format: json_schema`, and the turn loop that validates the reply and asks
//! again until it fits the contract.
//!
//! Retries, two kinds, never mixed up:
//! - transport: a timeout, an unreachable endpoint, HTTP 408/429/5xx. A completion is an
//!   idempotent read, so the same request is sent again, [`TRANSPORT_TRIES`] times in all,
//!   with exponential backoff. Each try is bounded by [`ModelConfig::timeout`]
//!   (`--model-timeout-seconds`), so a model that never answers fails a reply after
//!   `TRANSPORT_TRIES × timeout` plus the backoff, and a turn is bounded by that times
//!   `1 + max_contract_retries`. async-openai's own retry layer is replaced so this is
//!   the only one.
//! - contract: a reply that fails [`ReplyValidator`] goes back to the model with the error,
//!   up to [`ModelConfig::max_contract_retries`] times, then
//!   [`LlmError::ModelContractViolation`].
//!
//! The API key (from [`API_KEY_ENV`]) is sent as a bearer token and appears in no log, no
//! error and no `Debug` output.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use async_openai::config::Config;
use async_openai::error::OpenAIError;
use async_openai::middleware::{HttpRequestFactory, ReqwestService};
use async_openai::types::chat::{
    ChatCompletionRequestAssistantMessage, ChatCompletionRequestMessage,
    ChatCompletionRequestSystemMessage, ChatCompletionRequestUserMessage,
    CreateChatCompletionRequest, ResponseFormat, ResponseFormatJsonSchema,
};
use cynode_protocol::llm::LlmOutput;
use reqwest::header::{HeaderMap, HeaderValue, AUTHORIZATION};
use secrecy::SecretString;
use serde::Deserialize;
use serde_json::Value;
use tracing::{debug, info, instrument, warn};

use super::contract::{ContractError, ReplyValidator, RESPONSE_SCHEMA_NAME};
use super::key_order::KeyOrdered;
use super::prompt::contract_feedback;
use super::{ChatMessage, Role};
use crate::skills::registry::CatalogEntry;

/// How much warmer each retry of a rejected reply is sampled than the one before (up to
/// [`RETRY_TEMPERATURE_MAX`]): at a low temperature a model asked again in nearly the
/// same context writes nearly the same reply, so a retry without it rarely fixes anything
/// (measured with SmolLM2-135M: the same rejected reply four times in a row).
pub const RETRY_TEMPERATURE_STEP: f32 = 0.3;
/// `frequency_penalty` of a retry after a reply refused as babble (OpenAI range -2..2).
pub const FREQUENCY_PENALTY: f32 = 0.6;
/// `presence_penalty` of that retry.
pub const PRESENCE_PENALTY: f32 = 0.4;
/// `repeat_penalty` of that retry, for llama.cpp's server (1.0 is none).
pub const REPEAT_PENALTY: f32 = 1.18;

/// The warmest a retry is sampled.
pub const RETRY_TEMPERATURE_MAX: f32 = 1.0;

/// The temperature of the `attempt`-th request for one reply (1: the first).
pub fn retry_temperature(base: f32, attempt: u32) -> f32 {
    let warmer = base + RETRY_TEMPERATURE_STEP * attempt.saturating_sub(1) as f32;
    if base >= RETRY_TEMPERATURE_MAX {
        base
    } else {
        warmer.min(RETRY_TEMPERATURE_MAX)
    }
}

/// The environment variable the model API key is read from.
pub const API_KEY_ENV: &str = "CYNODE_MODEL_API_KEY";

/// How many times one completion is sent when it fails with a retryable error.
pub const TRANSPORT_TRIES: u32 = 3;

/// First backoff delay between transport tries; doubled each time.
const BACKOFF_BASE: Duration = Duration::from_millis(250);

/// An error body is cut to this many characters in [`LlmError::HttpStatus`].
const MAX_ERROR_TEXT: usize = 500;

/// Where the model is and how to ask it.
#[derive(Clone)]
pub struct ModelConfig {
    /// The OpenAI-compatible base URL, including `/v1` (e.g. `http://127.0.0.1:8089/v1`).
    pub base_url: String,
    /// The model name sent with every request.
    pub model: String,
    /// Bearer token; from [`API_KEY_ENV`]. Never logged; redacted in `Debug`.
    pub api_key: Option<String>,
    pub max_tokens: u32,
    pub temperature: f32,
    /// Deadline of one HTTP request (connect, generate, read).
    /// `--model-timeout-seconds` / `CYNODE_MODEL_TIMEOUT_SECONDS`.
    pub timeout: Duration,
    /// Extra CA certificates (PEM) for an https:// endpoint, beside the system's roots.
    pub ca_file: Option<std::path::PathBuf>,
    /// How many times an invalid reply is sent back for correction (so at most
    /// `1 + max_contract_retries` replies are asked for per turn).
    pub max_contract_retries: u32,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            base_url: "http://127.0.0.1:8089/v1".into(),
            model: "smollm2".into(),
            api_key: None,
            max_tokens: 1024,
            temperature: 0.2,
            timeout: Duration::from_secs(120),
            ca_file: None,
            max_contract_retries: 3,
        }
    }
}

impl fmt::Debug for ModelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelConfig")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("max_tokens", &self.max_tokens)
            .field("temperature", &self.temperature)
            .field("timeout", &self.timeout)
            .field("max_contract_retries", &self.max_contract_retries)
            .finish()
    }
}

impl ModelConfig {
    /// Defaults with this endpoint and model.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            model: model.into(),
            ..Self::default()
        }
    }

    /// The key in [`API_KEY_ENV`], if set and not blank.
    pub fn api_key_from_env() -> Option<String> {
        std::env::var(API_KEY_ENV)
            .ok()
            .filter(|k| !k.trim().is_empty())
    }

    /// OpenAI's own API: it wants `max_completion_tokens`, and strict mode only for schemas
    /// in its subset (root an object, every property required), which a skill's optional
    /// inputs are not, so the schema goes as guidance there. Everything else
    /// (llama-server, vLLM, Ollama) gets `max_tokens` and `strict: true`.
    fn is_openai_api(&self) -> bool {
        let rest = self
            .base_url
            .split_once("://")
            .map(|(_, r)| r)
            .unwrap_or(&self.base_url);
        let host = rest.split(['/', ':']).next().unwrap_or_default();
        host.eq_ignore_ascii_case("api.openai.com")
    }
}

/// How much of a rejected reply the warning log shows.
const REJECTED_HEAD_CHARS: usize = 300;

/// Why no usable reply came back.
#[derive(Debug, thiserror::Error)]
pub enum LlmError {
    /// The request did not finish within [`ModelConfig::timeout`].
    #[error("model endpoint timed out after {} ms", after.as_millis())]
    Timeout { after: Duration },
    /// Connecting, sending or reading failed.
    #[error("model endpoint unreachable: {0}")]
    Transport(String),
    /// The endpoint answered with a non-success status.
    #[error("model endpoint answered HTTP {status}: {message}")]
    HttpStatus { status: u16, message: String },
    /// A success status, but the body is not a chat completion.
    #[error("model endpoint sent something that is not a chat completion: {0}")]
    InvalidResponse(String),
    /// A chat completion without content (no choice, null or blank content, a refusal).
    #[error("model returned an empty reply (finish_reason: {}{})", finish_reason.as_deref().unwrap_or("none"), refusal.as_ref().map(|r| format!(", refusal: {r}")).unwrap_or_default())]
    EmptyReply {
        finish_reason: Option<String>,
        refusal: Option<String>,
    },
    /// The reply stopped at `max_tokens` (`finish_reason: length`) before its JSON was
    /// complete; fed back to the model as [`ContractError::Truncated`].
    #[error(
        "the model's reply was cut off at max_tokens ({max_tokens}) before its JSON was complete"
    )]
    Truncated { max_tokens: u32, head: String },
    /// The model kept answering outside the contract (`model_contract_violation`).
    #[error("model reply broke the output contract {attempts} times; last: {last_error}")]
    ModelContractViolation {
        attempts: u32,
        last_error: ContractError,
    },
    /// The configuration cannot work (bad URL, a key that cannot go in a header…).
    #[error("invalid model configuration: {0}")]
    Config(String),
    /// The response schema or a skill's input schema does not compile (a PM bug).
    #[error("invalid response schema: {0}")]
    InvalidSchema(String),
}

impl LlmError {
    /// True when the same request may succeed if sent again.
    pub fn is_retryable(&self) -> bool {
        match self {
            LlmError::Timeout { .. } | LlmError::Transport(_) => true,
            LlmError::HttpStatus { status, .. } => {
                *status == 408 || *status == 429 || *status >= 500
            }
            LlmError::InvalidResponse(_)
            | LlmError::EmptyReply { .. }
            | LlmError::Truncated { .. }
            | LlmError::ModelContractViolation { .. }
            | LlmError::Config(_)
            | LlmError::InvalidSchema(_) => false,
        }
    }
}

/// async-openai configuration: the base URL and, only when there is a key, the bearer
/// header (marked sensitive). No `OPENAI_*` environment variable is read.
#[derive(Clone)]
struct Endpoint {
    base: String,
    key: SecretString,
    auth: Option<HeaderValue>,
}

impl Config for Endpoint {
    fn headers(&self) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(v) = &self.auth {
            h.insert(AUTHORIZATION, v.clone());
        }
        h
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn query(&self) -> Vec<(&str, &str)> {
        Vec::new()
    }

    fn api_base(&self) -> &str {
        &self.base
    }

    fn api_key(&self) -> &SecretString {
        &self.key
    }
}

/// A non-success HTTP answer, carried out of the transport through `OpenAIError::Boxed`
/// so the status survives whatever the body is.
#[derive(Debug)]
struct HttpStatusError {
    status: u16,
    body: String,
}

impl fmt::Display for HttpStatusError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HTTP {}", self.status)
    }
}

impl std::error::Error for HttpStatusError {}

type Response = <ReqwestService as tower::Service<HttpRequestFactory>>::Response;

/// The model's HTTP client: rustls (ring) with the system's roots (`SSL_CERT_FILE` and
/// `SSL_CERT_DIR` honoured) and, with `ca_file`, that file's certificates as well.
fn model_http_client(ca_file: Option<&std::path::Path>) -> Result<reqwest_model::Client, String> {
    cynode_tls::install_provider();
    let mut builder = reqwest_model::Client::builder();
    if let Some(path) = ca_file {
        let pem = std::fs::read(path)
            .map_err(|e| format!("cannot read the model CA file {}: {e}", path.display()))?;
        let certs = reqwest_model::Certificate::from_pem_bundle(&pem)
            .map_err(|e| format!("model CA file {}: {e}", path.display()))?;
        if certs.is_empty() {
            return Err(format!(
                "model CA file {}: no certificate in the file",
                path.display()
            ));
        }
        builder = builder.tls_certs_merge(certs);
    }
    builder
        .build()
        .map_err(|e| format!("cannot build the model's http client: {e}"))
}

/// The transport: plain reqwest (no retry layer) plus the status check above.
#[derive(Clone)]
struct Transport {
    inner: ReqwestService,
}

impl tower::Service<HttpRequestFactory> for Transport {
    type Response = Response;
    type Error = OpenAIError;
    type Future = Pin<Box<dyn Future<Output = Result<Response, OpenAIError>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), OpenAIError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: HttpRequestFactory) -> Self::Future {
        let sent = self.inner.call(request);
        Box::pin(async move {
            let response = sent.await?;
            let status = response.status();
            if status.is_success() {
                return Ok(response);
            }
            let body = response.text().await.unwrap_or_default();
            Err(OpenAIError::Boxed(Box::new(HttpStatusError {
                status: status.as_u16(),
                body,
            })))
        })
    }
}

/// The chat completion fields the PM reads; everything else is ignored, so any
/// OpenAI-compatible server's extras are fine.
#[derive(Debug, Deserialize)]
struct CompletionBody {
    #[serde(default)]
    choices: Vec<CompletionChoice>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Debug, Deserialize)]
struct CompletionChoice {
    #[serde(default)]
    message: Option<CompletionMessage>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct CompletionMessage {
    /// A string, or (some servers) an array of `{type: text, text}` parts.
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    refusal: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct ModelList {
    #[serde(default)]
    data: Vec<ModelEntry>,
}

#[derive(Debug, Deserialize)]
struct ModelEntry {
    id: String,
}

/// The model client. Cheap to share behind an `Arc`; one per process is enough.
pub struct LlmClient {
    cfg: ModelConfig,
    client: async_openai::Client<Endpoint>,
    /// Set when the key cannot be sent as a header; every call then fails with it.
    config_error: Option<String>,
}

impl fmt::Debug for LlmClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmClient")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl LlmClient {
    /// A client for `cfg`. Nothing is contacted yet.
    pub fn new(cfg: ModelConfig) -> Self {
        let mut config_error = None;
        let base = cfg.base_url.trim().trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            config_error = Some(format!(
                "model base URL `{base}` must start with http:// or https://"
            ));
        }
        let key = cfg.api_key.clone().unwrap_or_default();
        let auth = match cfg.api_key.as_deref() {
            Some(k) if !k.is_empty() => match HeaderValue::from_str(&format!("Bearer {k}")) {
                Ok(mut v) => {
                    v.set_sensitive(true);
                    Some(v)
                }
                Err(_) => {
                    config_error = Some(format!(
                        "the API key in {API_KEY_ENV} contains characters not allowed in an HTTP header"
                    ));
                    None
                }
            },
            _ => None,
        };
        let endpoint = Endpoint {
            base,
            key: SecretString::from(key),
            auth,
        };
        let http = match model_http_client(cfg.ca_file.as_deref()) {
            Ok(c) => c,
            Err(e) => {
                config_error = Some(e);
                reqwest_model::Client::new()
            }
        };
        let client = async_openai::Client::with_config(endpoint).with_http_service(Transport {
            inner: ReqwestService::new(http),
        });
        Self {
            cfg,
            client,
            config_error,
        }
    }

    /// The configuration (its `Debug` redacts the key).
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn check_config(&self) -> Result<(), LlmError> {
        match &self.config_error {
            Some(e) => Err(LlmError::Config(e.clone())),
            None => Ok(()),
        }
    }

    /// The request body: messages, model, limits, and the schema as `response_format`.
    fn request(
        &self,
        messages: &[ChatMessage],
        schema: &Value,
        temperature: f32,
        penalize: bool,
    ) -> CreateChatCompletionRequest {
        let messages: Vec<ChatCompletionRequestMessage> = messages
            .iter()
            .map(|m| match m.role {
                Role::System => ChatCompletionRequestSystemMessage::from(m.content.as_str()).into(),
                Role::User => ChatCompletionRequestUserMessage::from(m.content.as_str()).into(),
                Role::Assistant => {
                    ChatCompletionRequestAssistantMessage::from(m.content.as_str()).into()
                }
            })
            .collect();
        let openai = self.cfg.is_openai_api();
        let mut req = CreateChatCompletionRequest {
            messages,
            model: self.cfg.model.clone(),
            temperature: Some(temperature),
            response_format: Some(ResponseFormat::JsonSchema {
                json_schema: ResponseFormatJsonSchema {
                    name: RESPONSE_SCHEMA_NAME.to_string(),
                    description: Some(
                        "one reply of the CyNode PM planner: {type, state_patch, payload}".into(),
                    ),
                    schema: schema.clone(),
                    strict: Some(!openai),
                },
            }),
            ..Default::default()
        };
        if penalize {
            req.frequency_penalty = Some(FREQUENCY_PENALTY);
            req.presence_penalty = Some(PRESENCE_PENALTY);
        }
        if openai {
            req.max_completion_tokens = Some(self.cfg.max_tokens);
        } else {
            #[allow(deprecated)]
            {
                req.max_tokens = Some(self.cfg.max_tokens);
            }
        }
        req
    }

    /// One chat completion constrained by `schema`; the content string of the first choice.
    /// No retry here (see [`LlmClient::next_reply`]).
    #[instrument(skip_all, fields(model = %self.cfg.model, messages = messages.len()))]
    pub async fn complete(
        &self,
        messages: &[ChatMessage],
        schema: &Value,
    ) -> Result<String, LlmError> {
        self.complete_at(messages, schema, self.cfg.temperature, false)
            .await
    }

    /// [`LlmClient::complete`] at `temperature`, with the repetition penalties when
    /// `penalize` (after a reply refused as babble).
    async fn complete_at(
        &self,
        messages: &[ChatMessage],
        schema: &Value,
        temperature: f32,
        penalize: bool,
    ) -> Result<String, LlmError> {
        self.check_config()?;
        let request = self.request(messages, schema, temperature, penalize);
        // The body goes out with its keys in the reply's order (key_order.rs): a grammar
        // built from the schema then has the model decide before it details.
        let mut body = serde_json::to_value(&request)
            .map_err(|e| LlmError::Config(format!("cannot encode the request: {e}")))?;
        if penalize && !self.cfg.is_openai_api() {
            // llama.cpp's own penalty (others ignore a field they do not know).
            body["repeat_penalty"] = serde_json::json!(REPEAT_PENALTY);
        }
        let started = Instant::now();
        let chat = self.client.chat();
        let sent = chat.create_byot::<_, CompletionBody>(KeyOrdered(&body));
        let m = crate::metrics::metrics();
        let body = match tokio::time::timeout(self.cfg.timeout, sent).await {
            Err(_) => {
                m.model_call(false, started.elapsed(), 0, 0);
                return Err(LlmError::Timeout {
                    after: self.cfg.timeout,
                });
            }
            Ok(Err(e)) => {
                m.model_call(false, started.elapsed(), 0, 0);
                return Err(self.map_error(e));
            }
            Ok(Ok(body)) => body,
        };
        let elapsed_ms = started.elapsed().as_millis() as u64;
        let (prompt_tokens, completion_tokens) = body
            .usage
            .as_ref()
            .map(|u| (u.prompt_tokens, u.completion_tokens))
            .unwrap_or((None, None));
        m.model_call(
            true,
            started.elapsed(),
            prompt_tokens.unwrap_or(0),
            completion_tokens.unwrap_or(0),
        );
        let Some(choice) = body.choices.into_iter().next() else {
            return Err(LlmError::EmptyReply {
                finish_reason: None,
                refusal: None,
            });
        };
        let finish_reason = choice.finish_reason;
        let (content, refusal) = match choice.message {
            Some(m) => (m.content.map(content_text).unwrap_or_default(), m.refusal),
            None => (String::new(), None),
        };
        debug!(
            elapsed_ms,
            prompt_tokens,
            completion_tokens,
            finish_reason = finish_reason.as_deref().unwrap_or(""),
            chars = content.len(),
            "model replied"
        );
        if content.trim().is_empty() {
            return Err(LlmError::EmptyReply {
                finish_reason,
                refusal,
            });
        }
        if finish_reason.as_deref() == Some("length")
            && serde_json::from_str::<serde::de::IgnoredAny>(content.trim()).is_err()
        {
            return Err(LlmError::Truncated {
                max_tokens: self.cfg.max_tokens,
                head: content.chars().take(REJECTED_HEAD_CHARS).collect(),
            });
        }
        Ok(content)
    }

    /// [`LlmClient::complete`] with the transport retries of the module doc.
    async fn complete_retrying(
        &self,
        messages: &[ChatMessage],
        schema: &Value,
        temperature: f32,
        penalize: bool,
    ) -> Result<String, LlmError> {
        let mut delay = BACKOFF_BASE;
        let mut tries = 1;
        loop {
            match self
                .complete_at(messages, schema, temperature, penalize)
                .await
            {
                Err(e) if e.is_retryable() && tries < TRANSPORT_TRIES => {
                    warn!(
                        try_number = tries,
                        delay_ms = delay.as_millis() as u64,
                        error = %e,
                        "model call failed; retrying"
                    );
                    tokio::time::sleep(delay).await;
                    delay = delay.saturating_mul(2);
                    tries += 1;
                }
                other => return other,
            }
        }
    }

    /// Asks for the next reply and returns it once it passes [`ReplyValidator`], with the
    /// raw text (for the journal) and how many replies were asked for (1 when the first
    /// was valid). An invalid reply is appended to `messages` with a user message naming
    /// the error ([`contract_feedback`]), replacing the previous rejected pair so the
    /// context does not grow; an empty reply is simply asked for again.
    pub async fn next_reply(
        &self,
        messages: &[ChatMessage],
        schema: &Value,
        known_task_ids: &[String],
        catalog: &[CatalogEntry],
    ) -> Result<(LlmOutput, String, u32), LlmError> {
        self.next_reply_checked(messages, schema, known_task_ids, catalog, |_| Ok(()))
            .await
    }

    /// [`LlmClient::next_reply`] with one more check of the caller's after the contract's
    /// (e.g. "the state_patch applies to the current state"); its error is fed back to the
    /// model like any other contract error.
    pub async fn next_reply_checked<F>(
        &self,
        messages: &[ChatMessage],
        schema: &Value,
        known_task_ids: &[String],
        catalog: &[CatalogEntry],
        check: F,
    ) -> Result<(LlmOutput, String, u32), LlmError>
    where
        F: Fn(&LlmOutput) -> Result<(), ContractError>,
    {
        let validator = ReplyValidator::new(schema, catalog)
            .map_err(|e| LlmError::InvalidSchema(e.to_string()))?;
        self.next_reply_with(messages, schema, &validator, known_task_ids, check)
            .await
    }

    /// [`LlmClient::next_reply_checked`] with a validator compiled once by the caller (the
    /// loop keeps one per skill catalog, so a turn does not recompile the schemas).
    #[instrument(skip_all, fields(model = %self.cfg.model, attempt = tracing::field::Empty))]
    pub async fn next_reply_with<F>(
        &self,
        messages: &[ChatMessage],
        schema: &Value,
        validator: &ReplyValidator,
        known_task_ids: &[String],
        check: F,
    ) -> Result<(LlmOutput, String, u32), LlmError>
    where
        F: Fn(&LlmOutput) -> Result<(), ContractError>,
    {
        let mut conversation = messages.to_vec();
        let max_attempts = self.cfg.max_contract_retries.saturating_add(1);
        let mut attempt = 0;
        // Set once a reply was refused as babble: every later retry of this reply carries
        // the repetition penalties.
        let mut penalize = false;
        loop {
            attempt += 1;
            tracing::Span::current().record("attempt", attempt);
            let mut head = String::new();
            let temperature = retry_temperature(self.cfg.temperature, attempt);
            let error = match self
                .complete_retrying(&conversation, schema, temperature, penalize)
                .await
            {
                Ok(raw) => match validator
                    .validate(&raw, known_task_ids)
                    .and_then(|reply| check(&reply).map(|()| reply))
                {
                    Ok(reply) => {
                        info!(attempt, kind = ?reply.kind, "model reply accepted");
                        return Ok((reply, raw, attempt));
                    }
                    Err(e) => {
                        penalize |= matches!(e, ContractError::Babble { .. });
                        // Only the latest rejected reply and its error: the context stays
                        // bounded however many retries (small models have small windows).
                        conversation.truncate(messages.len());
                        head = raw.chars().take(REJECTED_HEAD_CHARS).collect();
                        conversation.push(ChatMessage::assistant(raw));
                        conversation.push(ChatMessage::user(contract_feedback(&e)));
                        e
                    }
                },
                Err(LlmError::EmptyReply { finish_reason, .. }) => {
                    ContractError::Empty { finish_reason }
                }
                Err(LlmError::Truncated {
                    max_tokens,
                    head: h,
                }) => {
                    head = h;
                    // Without this feedback a deterministic model would write the same
                    // over-long reply again.
                    let e = ContractError::Truncated { max_tokens };
                    conversation.truncate(messages.len());
                    conversation.push(ChatMessage::user(contract_feedback(&e)));
                    e
                }
                Err(e) => return Err(e),
            };
            warn!(attempt, max_attempts, error = %error, reply_head = %head, "model reply rejected");
            if attempt >= max_attempts {
                return Err(LlmError::ModelContractViolation {
                    attempts: attempt,
                    last_error: error,
                });
            }
        }
    }

    /// The model ids the endpoint serves (`GET /models`).
    #[instrument(skip_all)]
    pub async fn models(&self) -> Result<Vec<String>, LlmError> {
        self.check_config()?;
        let models = self.client.models();
        let listed = models.list_byot::<ModelList>();
        match tokio::time::timeout(self.cfg.timeout, listed).await {
            Err(_) => Err(LlmError::Timeout {
                after: self.cfg.timeout,
            }),
            Ok(Err(e)) => Err(self.map_error(e)),
            Ok(Ok(list)) => Ok(list.data.into_iter().map(|m| m.id).collect()),
        }
    }

    fn map_error(&self, e: OpenAIError) -> LlmError {
        let redact = |s: String| match self.cfg.api_key.as_deref() {
            Some(k) if !k.is_empty() => s.replace(k, "<redacted>"),
            _ => s,
        };
        match e {
            OpenAIError::Reqwest(e) => {
                if e.is_timeout() {
                    LlmError::Timeout {
                        after: self.cfg.timeout,
                    }
                } else if e.is_builder() {
                    LlmError::Config(redact(error_chain(&e)))
                } else if e.is_decode() {
                    LlmError::InvalidResponse(redact(error_chain(&e)))
                } else {
                    LlmError::Transport(redact(error_chain(&e)))
                }
            }
            OpenAIError::Boxed(b) => match b.downcast::<HttpStatusError>() {
                Ok(h) => LlmError::HttpStatus {
                    status: h.status,
                    message: redact(error_text(&h.body)),
                },
                Err(other) => LlmError::Transport(redact(error_chain(other.as_ref()))),
            },
            OpenAIError::ApiError(r) => LlmError::HttpStatus {
                status: r.status_code.as_u16(),
                message: redact(truncate(&r.api_error.message)),
            },
            OpenAIError::JSONDeserialize(e, body) => {
                LlmError::InvalidResponse(redact(format!("{e}; body: {}", truncate(&body))))
            }
            OpenAIError::StreamError(e) => LlmError::InvalidResponse(redact(e.to_string())),
            OpenAIError::InvalidArgument(m)
            | OpenAIError::FileSaveError(m)
            | OpenAIError::FileReadError(m) => LlmError::Config(redact(m)),
        }
    }
}

/// A message content: a string, or the text parts of an array.
fn content_text(v: Value) -> String {
    match v {
        Value::String(s) => s,
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// An error and its sources, `a: b: c`.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// The useful part of an error body: OpenAI's `{error: {message}}`, `{error: "…"}`,
/// `{message}`, or the text itself, cut to [`MAX_ERROR_TEXT`].
fn error_text(body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let msg = parsed.as_ref().and_then(|v| {
        v.pointer("/error/message")
            .or_else(|| v.get("error"))
            .or_else(|| v.get("message"))
            .and_then(Value::as_str)
            .map(str::to_string)
    });
    truncate(msg.as_deref().unwrap_or(body).trim())
}

fn truncate(s: &str) -> String {
    match s.char_indices().nth(MAX_ERROR_TEXT) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_host_is_recognised() {
        assert!(ModelConfig::new("https://api.openai.com/v1", "gpt").is_openai_api());
        assert!(!ModelConfig::new("http://127.0.0.1:8089/v1", "m").is_openai_api());
        assert!(!ModelConfig::new("http://api.openai.com.example/v1", "m").is_openai_api());
    }

    #[test]
    fn error_bodies_are_reduced_to_their_message() {
        assert_eq!(
            error_text(r#"{"error":{"message":"bad","type":"x"}}"#),
            "bad"
        );
        assert_eq!(error_text(r#"{"error":"nope"}"#), "nope");
        assert_eq!(error_text("plain text\n"), "plain text");
        assert_eq!(
            truncate(&"é".repeat(600)).chars().count(),
            MAX_ERROR_TEXT + 1
        );
    }

    #[test]
    fn each_retry_is_sampled_warmer_up_to_a_cap() {
        let t: Vec<f32> = (1..=5).map(|a| retry_temperature(0.0, a)).collect();
        for (got, want) in t.iter().zip([0.0, 0.3, 0.6, 0.9, 1.0]) {
            assert!((got - want).abs() < 1e-6, "{t:?}");
        }
        assert_eq!(retry_temperature(0.2, 1), 0.2);
        assert_eq!(retry_temperature(1.5, 3), 1.5);
    }

    #[test]
    fn retryable_statuses() {
        let s = |status| LlmError::HttpStatus {
            status,
            message: String::new(),
        };
        assert!(s(500).is_retryable() && s(503).is_retryable() && s(429).is_retryable());
        assert!(!s(400).is_retryable() && !s(401).is_retryable() && !s(404).is_retryable());
    }

    #[test]
    fn bad_configuration_is_reported_not_sent() {
        let c = LlmClient::new(ModelConfig::new("127.0.0.1:8089/v1", "m"));
        assert!(matches!(c.check_config(), Err(LlmError::Config(_))));
        let mut cfg = ModelConfig::new("http://127.0.0.1:8089/v1", "m");
        cfg.api_key = Some("bad\nkey".into());
        let c = LlmClient::new(cfg);
        let e = c.check_config().unwrap_err().to_string();
        assert!(!e.contains("bad\nkey"), "{e}");
    }
}
