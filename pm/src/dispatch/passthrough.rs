//! One Worker API call whose answer is handed on rather than read: the PM's sandbox API
//! forwards a tenant's request to the worker that holds the sandbox
//! (`crate::app::sandboxes`) and streams the worker's answer back, status and body.
//!
//! - Never retried: an exec, a stdin write or a file write is not idempotent.
//! - A stream (an exec's output) has no overall deadline; every other call keeps the
//!   client's 60 s.
//! - Transport and TLS failures are [`DispatchError`]s like any other call's; a worker
//!   that refuses this PM's token is [`DispatchError::Auth`]. Any other answer, 4xx or
//!   5xx included, is returned for the caller to judge.

use std::time::Duration;

use super::{tls_failure, DispatchError, WorkerClient};

/// What to send.
#[derive(Debug)]
pub struct Forward<'a> {
    pub method: reqwest::Method,
    /// Path segments below the base, each percent-encoded as one segment.
    pub segments: &'a [&'a str],
    /// Query pairs, encoded by `url`.
    pub query: &'a [(&'a str, String)],
    /// Request headers to pass on (e.g. `Last-Event-ID`).
    pub headers: &'a [(&'static str, String)],
    /// The body and its content type.
    pub body: Option<(reqwest::Body, &'static str)>,
    /// The answer is a stream (no overall deadline).
    pub stream: bool,
}

/// How long a streamed answer may last at most (the worker ends an exec's output when
/// the exec ends; this only bounds a worker that never does).
const STREAM_LIMIT: Duration = Duration::from_secs(24 * 3600);

impl WorkerClient {
    /// Sends `f` once and returns the worker's answer as it is.
    pub async fn forward(&self, f: Forward<'_>) -> Result<reqwest::Response, DispatchError> {
        let mut url = self.url(f.segments)?;
        if !f.query.is_empty() {
            url.query_pairs_mut()
                .extend_pairs(f.query.iter().map(|(k, v)| (*k, v.as_str())));
        }
        let mut req = self
            .http
            .request(f.method.clone(), url.clone())
            .bearer_auth(&self.token);
        if let Some(tp) = crate::telemetry::traceparent() {
            req = req.header("traceparent", tp);
        }
        for (name, value) in f.headers {
            req = req.header(*name, value);
        }
        if f.stream {
            req = req.timeout(STREAM_LIMIT);
        }
        if let Some((body, content_type)) = f.body {
            req = req
                .header(reqwest::header::CONTENT_TYPE, content_type)
                .body(body);
        }
        match req.send().await {
            Ok(r) if matches!(r.status().as_u16(), 401 | 403) => Err(DispatchError::Auth {
                worker: self.base.clone(),
                status: r.status().as_u16(),
            }),
            Ok(r) => {
                tracing::debug!(method = %f.method, path = url.path(), status = r.status().as_u16(), "worker answered");
                Ok(r)
            }
            Err(e) => Err(match tls_failure(&e) {
                Some(detail) => DispatchError::Tls {
                    worker: self.base.clone(),
                    detail,
                },
                None => DispatchError::Unavailable(format!("{}: {e}", self.base)),
            }),
        }
    }
}
