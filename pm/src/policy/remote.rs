//! The external gate: the same input sent to an OPA-compatible server (Data API).
//!
//! `POST <endpoint>/v1/data/<package_path>` with `{"input": …}`; the answer must be
//! `{"result": {"deny": [...], "warn": [...]}}`. Anything else — connection refused,
//! timeout, a non-2xx status, an oversized or unparsable body, a missing `result` or
//! `deny` — is a denial with rule [`RULE_ENGINE_UNAVAILABLE`] (fail closed).

use std::time::Duration;

use serde::Serialize;
use tracing::{debug, warn};

use super::decision::{parse_violations, Decision, Mode, Violation, RULE_ENGINE_UNAVAILABLE};
use super::input::PolicyInput;

/// Default whole-request timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest response body read from the engine.
const MAX_RESPONSE_BYTES: usize = 1024 * 1024;

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
            Err(reason) => {
                warn!(url = %self.url, reason = %reason, "policy engine unavailable; denying (fail closed)");
                Decision::fail_closed(
                    RULE_ENGINE_UNAVAILABLE,
                    format!("policy engine at {} gave no decision: {reason}", self.url),
                    self.mode,
                )
            }
        }
    }

    async fn ask(&self, input: &PolicyInput) -> Result<(Vec<Violation>, Vec<Violation>), String> {
        let client = self.client.as_ref().map_err(Clone::clone)?;
        let request = client.post(&self.url).json(&OpaRequest { input }).send();
        // reqwest's own timeout covers the headers; this one also covers the body.
        let body = tokio::time::timeout(self.timeout, async {
            let mut response = request.await.map_err(|e| describe(&e))?;
            let status = response.status();
            let mut body = Vec::new();
            while let Some(chunk) = response.chunk().await.map_err(|e| describe(&e))? {
                if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
                    return Err(format!("response body over {MAX_RESPONSE_BYTES} bytes"));
                }
                body.extend_from_slice(&chunk);
            }
            if !status.is_success() {
                return Err(format!("http status {status}: {}", snippet(&body)));
            }
            Ok(body)
        })
        .await
        .map_err(|_| format!("no answer within {} ms", self.timeout.as_millis()))??;

        let document: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| format!("response is not json ({e}): {}", snippet(&body)))?;
        let result = match document.get("result") {
            Some(serde_json::Value::Object(result)) => result,
            Some(_) => return Err("`result` is not an object".to_string()),
            None => {
                return Err("response has no `result` (is the package loaded?)".to_string());
            }
        };
        let deny = match result.get("deny") {
            Some(deny) => parse_violations("deny", deny)?,
            None => return Err("`result` has no `deny` rule".to_string()),
        };
        let warn = parse_violations(
            "warn",
            result.get("warn").unwrap_or(&serde_json::Value::Null),
        )?;
        Ok((deny, warn))
    }
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
