//! The external gate: the same input sent to an OPA-compatible server (Data API).
//!
//! `POST <endpoint>/v1/data/<package_path>?strict-builtin-errors=true` with
//! `{"input": …}`; the answer must be `{"result": {"deny": [...], "warn": [...]}}`.
//!
//! Fail closed, in both modes:
//! - the policy fails to evaluate: OPA answers an error document (`{"code": …,
//!   "message": "… eval_conflict_error: …"}`) naming an `eval_…_error` — a complete rule
//!   with two values, or, because the request asks for strict builtin errors (OPA's
//!   default would make such a rule body silently undefined), a builtin error such as
//!   `to_number("x")` or an invalid regex. That is a denial with rule
//!   [`RULE_EVALUATION_FAILED`], as for the in-process gate;
//! - anything else — connection refused, timeout, another non-2xx status, an oversized
//!   or unparsable body, a missing `result` or `deny` — is a denial with rule
//!   [`RULE_ENGINE_UNAVAILABLE`].

use std::time::Duration;

use serde::Serialize;
use tracing::{debug, warn};

use super::decision::{
    parse_violations, Decision, Mode, Violation, RULE_ENGINE_UNAVAILABLE, RULE_EVALUATION_FAILED,
};
use super::input::PolicyInput;

/// Default whole-request timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest response body read from the engine.
const MAX_RESPONSE_BYTES: usize = 1024 * 1024;
/// Asks OPA to fail the evaluation on a builtin error instead of making the rule body
/// undefined (which would silently drop a denial).
const STRICT_QUERY: &str = "strict-builtin-errors=true";

/// Why the engine gave no decision.
enum NoDecision {
    /// The engine answered that the policy failed to evaluate.
    Evaluation(String),
    /// No usable answer.
    Unavailable(String),
}

impl From<String> for NoDecision {
    fn from(reason: String) -> Self {
        Self::Unavailable(reason)
    }
}

/// An OPA-compatible policy server.
#[derive(Debug, Clone)]
pub struct RemoteGate {
    client: Result<reqwest::Client, String>,
    url: String,
    mode: Mode,
    timeout: Duration,
}

#[derive(Serialize)]
struct OpaRequest<'a> {
    input: &'a PolicyInput,
}

impl RemoteGate {
    /// A gate asking `endpoint` (base URL, e.g. `http://127.0.0.1:8181`) for package
    /// `package_path` (`cynode/policy` or `cynode.policy`).
    pub fn new(endpoint: &str, package_path: &str, mode: Mode) -> Self {
        Self::with_timeout(endpoint, package_path, mode, DEFAULT_TIMEOUT)
    }

    /// Like [`RemoteGate::new`] with another request timeout.
    pub fn with_timeout(endpoint: &str, package_path: &str, mode: Mode, timeout: Duration) -> Self {
        let package = package_path
            .trim_matches(|c| c == '/' || c == '.')
            .replace('.', "/");
        let url = format!("{}/v1/data/{package}", endpoint.trim_end_matches('/'));
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()
            .map_err(|e| format!("cannot build the http client: {e}"));
        Self {
            client,
            url,
            mode,
            timeout,
        }
    }

    /// The full URL the input is posted to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The mode decisions are made in.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Asks the engine. Never fails: no usable answer is a denial.
    pub async fn evaluate(&self, input: &PolicyInput) -> Decision {
        match self.ask(input).await {
            Ok((deny, warn)) => {
                debug!(url = %self.url, denied = deny.len(), "external policy answered");
                Decision::from_findings(deny, warn, self.mode)
            }
            Err(NoDecision::Evaluation(reason)) => {
                warn!(url = %self.url, reason = %reason, "the external policy failed to evaluate; denying (fail closed)");
                Decision::fail_closed(
                    RULE_EVALUATION_FAILED,
                    format!(
                        "policy engine at {} failed to evaluate the policy: {reason}",
                        self.url
                    ),
                    self.mode,
                )
            }
            Err(NoDecision::Unavailable(reason)) => {
                warn!(url = %self.url, reason = %reason, "policy engine unavailable; denying (fail closed)");
                Decision::fail_closed(
                    RULE_ENGINE_UNAVAILABLE,
                    format!("policy engine at {} gave no decision: {reason}", self.url),
                    self.mode,
                )
            }
        }
    }

    async fn ask(
        &self,
        input: &PolicyInput,
    ) -> Result<(Vec<Violation>, Vec<Violation>), NoDecision> {
        let client = self.client.as_ref().map_err(Clone::clone)?;
        let request = client
            .post(format!("{}?{STRICT_QUERY}", self.url))
            .json(&OpaRequest { input })
            .send();
        // reqwest's own timeout covers the headers; this one also covers the body.
        let body = tokio::time::timeout(self.timeout, async {
            let mut response = request.await.map_err(|e| describe(&e))?;
            let status = response.status();
            let mut body = Vec::new();
            while let Some(chunk) = response.chunk().await.map_err(|e| describe(&e))? {
                if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
                    return Err(format!("response body over {MAX_RESPONSE_BYTES} bytes").into());
                }
                body.extend_from_slice(&chunk);
            }
            if !status.is_success() {
                if let Some(message) = evaluation_error(&body) {
                    return Err(NoDecision::Evaluation(message));
                }
                return Err(format!("http status {status}: {}", snippet(&body)).into());
            }
            Ok(body)
        })
        .await
        .map_err(|_| format!("no answer within {} ms", self.timeout.as_millis()))??;

        let document: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| format!("response is not json ({e}): {}", snippet(&body)))?;
        let result = match document.get("result") {
            Some(serde_json::Value::Object(result)) => result,
            Some(_) => return Err("`result` is not an object".to_string().into()),
            None => {
                return Err("response has no `result` (is the package loaded?)"
                    .to_string()
                    .into());
            }
        };
        let deny = match result.get("deny") {
            Some(deny) => parse_violations("deny", deny)?,
            None => return Err("`result` has no `deny` rule".to_string().into()),
        };
        let warn = parse_violations(
            "warn",
            result.get("warn").unwrap_or(&serde_json::Value::Null),
        )?;
        Ok((deny, warn))
    }
}

/// The message of an OPA error document that reports a failed evaluation: one whose
/// `message` (or one of its `errors[].message`/`code`) names an `eval_…_error`
/// (`eval_conflict_error`, `eval_builtin_error`, `eval_type_error`, …).
fn evaluation_error(body: &[u8]) -> Option<String> {
    let document: serde_json::Value = serde_json::from_slice(body).ok()?;
    let is_eval = |text: &str| {
        text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .any(|word| word.starts_with("eval_") && word.ends_with("_error"))
    };
    let text = |v: &serde_json::Value, key: &str| {
        v.get(key)
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    let message = text(&document, "message");
    let nested = document
        .get("errors")
        .and_then(serde_json::Value::as_array)
        .into_iter()
        .flatten()
        .any(|e| is_eval(&text(e, "code")) || is_eval(&text(e, "message")));
    (is_eval(&message) || nested).then(|| {
        let message = if message.is_empty() {
            snippet(body)
        } else {
            message
        };
        snippet(message.as_bytes())
    })
}

fn describe(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "cannot connect"
    } else if e.is_body() || e.is_decode() {
        "bad response body"
    } else {
        "request failed"
    };
    // The source chain holds the useful part (e.g. "connection refused").
    let mut detail = String::new();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        detail = s.to_string();
        source = s.source();
    }
    if detail.is_empty() {
        kind.to_string()
    } else {
        format!("{kind}: {detail}")
    }
}

fn snippet(body: &[u8]) -> String {
    const MAX: usize = 200;
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    match text.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}
