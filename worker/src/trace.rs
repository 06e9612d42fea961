//! Logging and W3C trace context.
//!
//! - [`Lap`]: the stopwatch of the debug-level phase timings of a job.
//! - Log lines: JSON on stderr at `CYNODE_LOG_LEVEL` (default `info`).
//! - Incoming Worker API calls with a valid `traceparent` header run (with the job they
//!   start) in a `request` span carrying the caller's `trace_id` and `parent_span_id`, so
//!   the worker's log lines for that job join the caller's trace.
//! - With `CYNODE_OTLP_ENDPOINT` (e.g. `http://collector:4318`; `/v1/traces` is appended)
//!   the worker also exports its spans over OTLP/HTTP protobuf (service `cynode-worker`):
//!   the `request` span becomes a child of the caller's span, and each job runs in a
//!   `job` span under it, so one trace shows the PM's call and the sandbox's run. A
//!   submit's `request` span lasts until its job ends (the job runs inside it).
//! - The exporter is set up by [`cynode_otel`], the PM's too; an `https://` endpoint is
//!   reached over rustls, trusting the system's roots, or the bundle in `SSL_CERT_FILE` /
//!   `SSL_CERT_DIR`, which replaces them.

use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::Request;
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::Response;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The OTLP exporter could not be set up.
pub type TraceError = cynode_otel::ExporterError;

/// Set once an OTLP exporter is installed: only then are remote parents attached.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Installs the global subscriber: JSON log lines, plus the OTLP exporter when
/// `otlp_endpoint` is given ([`cynode_otel::install`]). Returns the exporter's provider,
/// to flush with `shutdown()` outside the async runtime on exit.
pub fn init(otlp_endpoint: Option<&str>) -> Result<Option<SdkTracerProvider>, TraceError> {
    let filter =
        EnvFilter::try_from_env("CYNODE_LOG_LEVEL").unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer()
        .json()
        .with_current_span(false)
        .with_target(false)
        .with_writer(std::io::stderr)
        .with_filter(filter);
    let exporter = cynode_otel::install(fmt, "cynode-worker", otlp_endpoint)?;
    if exporter.as_ref().is_some_and(|e| e.installed) {
        EXPORTING.store(true, Ordering::SeqCst);
    }
    Ok(exporter.map(|e| e.provider))
}

/// Reads propagation headers from a request.
struct Headers<'a>(&'a HeaderMap);

impl opentelemetry::propagation::Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// The trace id and parent span id of a W3C `traceparent` value
/// (`{version}-{trace-id}-{parent-id}-{flags}`, lowercase hex), or `None` when it is not
/// valid: a wrong length or character, version `ff`, or an all-zero id.
pub fn parse_traceparent(value: &str) -> Option<(&str, &str)> {
    let mut parts = value.trim().split('-');
    let version = parts.next()?;
    let trace_id = parts.next()?;
    let parent_id = parts.next()?;
    let flags = parts.next()?;
    let hex = |s: &str, n: usize| {
        s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
    let ok = hex(version, 2)
        && version != "ff"
        // Version 00 has exactly four fields; later versions may append more.
        && (version != "00" || parts.next().is_none())
        && hex(trace_id, 32)
        && nonzero(trace_id)
        && hex(parent_id, 16)
        && nonzero(parent_id)
        && hex(flags, 2);
    ok.then_some((trace_id, parent_id))
}

/// Middleware: runs a request that carries a valid `traceparent` inside a `request`
/// span with its `trace_id` and `parent_span_id` (and, when exporting, the caller's span
/// as its parent); other requests run as before.
pub async fn traced(req: Request, next: Next) -> Response {
    let ids = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_traceparent)
        .map(|(t, p)| (t.to_string(), p.to_string()));
    match ids {
        Some((trace_id, parent)) => {
            let span = tracing::info_span!(
                "request",
                trace_id = %trace_id,
                parent_span_id = %parent,
                method = %req.method(),
                path = %req.uri().path(),
            );
            if EXPORTING.load(Ordering::Relaxed) {
                let parent = opentelemetry::global::get_text_map_propagator(|p| {
                    p.extract(&Headers(req.headers()))
                });
                let _ = span.set_parent(parent);
            }
            next.run(req).instrument(span).await
        }
        None => next.run(req).await,
    }
}

/// A stopwatch for the debug-level phase timings of a job (`CYNODE_LOG_LEVEL=debug`; read
/// by `worker/benches/bwrap_phases.sh`): [`Lap::us`] is the time since the last call, in
/// microseconds. Two clock reads per phase; nothing else.
#[derive(Debug, Clone, Copy)]
pub struct Lap(std::time::Instant);

impl Lap {
    /// Starts now.
    pub fn start() -> Self {
        Lap(std::time::Instant::now())
    }

    /// Microseconds since the start or the last call, and restarts.
    pub fn us(&mut self) -> u64 {
        let now = std::time::Instant::now();
        let us = now.duration_since(self.0).as_micros();
        self.0 = now;
        u64::try_from(us).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::parse_traceparent;

    #[test]
    fn valid_traceparents_give_their_ids() {
        assert_eq!(
            parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            Some(("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"))
        );
        // A future version may carry more fields.
        assert_eq!(
            parse_traceparent("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-xyz"),
            Some(("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"))
        );
    }

    #[test]
    fn invalid_traceparents_are_ignored() {
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        ] {
            assert_eq!(parse_traceparent(bad), None, "{bad:?}");
        }
    }
}
