//! The OpenAI-compatible inference endpoint: discovery, the served model list, and chat
//! completions, each bounded by the job deadline and the runner's interrupt flag.
//!
//! Discovery order: `INFERENCE_PROXY_URL` (the node's per-job proxy, `http+unix://` or
//! `http://`), then `OLLAMA_BASE_URL`, then `http://localhost:11434`. A base URL may end in
//! `/v1` or not; requests go to `<base>/v1/models` and `<base>/v1/chat/completions`. The
//! runner never holds a credential: it sends no Authorization header (the node's proxy adds
//! the upstream key on its side).

use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use cynode_protocol::FailureCode;
use serde_json::Value;

use crate::http::{self, HttpError, Limits, Target};

/// Cap on a model list or chat completion response.
pub const MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;
/// Bound on the model list request (it is also bounded by the job deadline).
const MODELS_TIMEOUT: Duration = Duration::from_secs(30);
/// Retries of a chat call after a transient failure (5xx, connection reset).
const CHAT_RETRIES: u32 = 2;

/// An endpoint failure, with the failure code the job gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientError {
    pub code: FailureCode,
    pub message: String,
    transient: bool,
}

/// Token counts of one completion, when the endpoint reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

/// One completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub content: String,
    /// `finish_reason` was `length`: the reply was cut off.
    pub truncated: bool,
    pub usage: Option<Usage>,
}

/// The endpoint and where it was found.
#[derive(Debug, Clone)]
pub struct Endpoint {
    base: Target,
    /// The env variable (or default) the URL came from, for messages.
    pub source: &'static str,
    pub url: String,
}

/// The inference endpoint's URL, from `source`, is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("inference endpoint from {from}: {url}")]
pub struct EndpointError {
    /// The env variable (or `default`) the URL came from.
    pub from: &'static str,
    pub url: http::UrlError,
}

impl Endpoint {
    /// Finds the endpoint from the environment, in the documented order.
    pub fn discover() -> Result<Endpoint, EndpointError> {
        let (source, url) = [("INFERENCE_PROXY_URL"), ("OLLAMA_BASE_URL")]
            .into_iter()
            .find_map(|k| {
                std::env::var(k)
                    .ok()
                    .filter(|v| !v.trim().is_empty())
                    .map(|v| (k, v.trim().to_string()))
            })
            .unwrap_or(("default", "http://localhost:11434".into()));
        let target = http::parse_url(&url).map_err(|url| EndpointError { from: source, url })?;
        let prefix = target.path().trim_end_matches('/');
        let prefix = prefix.strip_suffix("/v1").unwrap_or(prefix).to_string();
        Ok(Endpoint {
            base: target.with_path(&prefix),
            source,
            url,
        })
    }

    fn at(&self, path: &str) -> Target {
        self.base
            .with_path(&format!("{}{path}", self.base.path().trim_end_matches('/')))
    }

    /// The ids of the models the endpoint serves (OpenAI `data[].id` and llama.cpp's
    /// aliases, or Ollama's `models[].name`).
    pub fn models(
        &self,
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Result<Vec<String>, ClientError> {
        let lim = Limits {
            deadline: deadline.min(Instant::now() + MODELS_TIMEOUT),
            max_body: MAX_RESPONSE_BYTES,
            cancel: Some(cancel),
        };
        let r = http::send(&self.at("/v1/models"), "GET", None, &lim)
            .map_err(|e| self.transport_error("GET /v1/models", e, deadline))?;
        let v = self.json_ok("GET /v1/models", r)?;
        let mut ids = Vec::new();
        for m in v["data"].as_array().into_iter().flatten() {
            ids.extend(m["id"].as_str().map(String::from));
            for a in m["aliases"].as_array().into_iter().flatten() {
                ids.extend(a.as_str().map(String::from));
            }
        }
        for m in v["models"].as_array().into_iter().flatten() {
            ids.extend(m["name"].as_str().map(String::from));
            ids.extend(m["model"].as_str().map(String::from));
        }
        ids.sort();
        ids.dedup();
        Ok(ids)
    }

    /// One chat completion; transient failures are retried a bounded number of times.
    pub fn chat(
        &self,
        body: &Value,
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Result<Completion, ClientError> {
        let bytes = serde_json::to_vec(body).map_err(|e| ClientError {
            code: FailureCode::InternalError,
            message: format!("cannot encode the chat request: {e}"),
            transient: false,
        })?;
        let mut attempt = 0;
        loop {
            match self.chat_once(&bytes, deadline, cancel) {
                Err(e) if e.transient && attempt < CHAT_RETRIES => {
                    attempt += 1;
                    let pause = Duration::from_millis(500 * u64::from(attempt));
                    if Instant::now() + pause >= deadline {
                        return Err(e);
                    }
                    tracing::warn!(attempt, error = %e.message, "inference call failed; retrying");
                    std::thread::sleep(pause);
                }
                other => return other,
            }
        }
    }

    fn chat_once(
        &self,
        body: &[u8],
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Result<Completion, ClientError> {
        const WHAT: &str = "POST /v1/chat/completions";
        let lim = Limits {
            deadline,
            max_body: MAX_RESPONSE_BYTES,
            cancel: Some(cancel),
        };
        let r = http::send(&self.at("/v1/chat/completions"), "POST", Some(body), &lim)
            .map_err(|e| self.transport_error(WHAT, e, deadline))?;
        let v = self.json_ok(WHAT, r)?;
        let choice = &v["choices"][0];
        let content = choice["message"]["content"]
            .as_str()
            .ok_or_else(|| ClientError {
                code: FailureCode::ExecutionFailure,
                message: format!(
                    "inference endpoint {}: {WHAT} answered without choices[0].message.content",
                    self.url
                ),
                transient: false,
            })?
            .to_string();
        let usage = v["usage"]["prompt_tokens"].as_u64().map(|p| Usage {
            prompt_tokens: p,
            completion_tokens: v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
        });
        Ok(Completion {
            content,
            truncated: choice["finish_reason"] == "length",
            usage,
        })
    }

    fn transport_error(&self, what: &str, e: HttpError, deadline: Instant) -> ClientError {
        let (code, transient) = match &e {
            HttpError::Timeout if Instant::now() >= deadline => (FailureCode::Timeout, false),
            HttpError::Timeout => (FailureCode::ExecutionFailure, false),
            HttpError::Interrupted => (FailureCode::InternalError, false),
            HttpError::Connect(_) => (FailureCode::ExecutionFailure, false),
            HttpError::Io(_) | HttpError::Malformed(_) => (FailureCode::ExecutionFailure, true),
            HttpError::TooLarge(_) => (FailureCode::ExecutionFailure, false),
        };
        let message = match code {
            FailureCode::Timeout => format!(
                "job deadline (constraints.max_runtime_seconds) reached while waiting for the inference endpoint ({what})"
            ),
            FailureCode::InternalError => "runner interrupted by SIGTERM".to_string(),
            _ => format!(
                "inference endpoint {} (from {}) failed: {what}: {e}",
                self.url, self.source
            ),
        };
        ClientError {
            code,
            message,
            transient,
        }
    }

    fn json_ok(&self, what: &str, r: http::Response) -> Result<Value, ClientError> {
        if !(200..300).contains(&r.status) {
            let text = String::from_utf8_lossy(&r.body);
            let snippet: String = text.chars().take(300).collect();
            return Err(ClientError {
                code: FailureCode::ExecutionFailure,
                message: format!(
                    "inference endpoint {}: {what} answered HTTP {}: {}",
                    self.url,
                    r.status,
                    snippet.trim()
                ),
                transient: r.status >= 500,
            });
        }
        serde_json::from_slice(&r.body).map_err(|e| ClientError {
            code: FailureCode::ExecutionFailure,
            message: format!(
                "inference endpoint {}: {what} answered invalid JSON: {e}",
                self.url
            ),
            transient: false,
        })
    }
}
