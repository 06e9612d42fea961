//! Logging and tracing: JSON log lines on stderr, and OpenTelemetry traces over OTLP/HTTP
//! (protobuf) when an endpoint is configured.
//!
//! - Log lines: `CYNODE_LOG_LEVEL` filters events; the PM's own spans (`session`, `turn`,
//!   `request_job`, `await_job`, `worker_call`) are always kept as context, so every line
//!   logged inside a session carries its `session_id`, and lines about a job carry
//!   `job_id`, `task_id` and `skill_id` (in the line's `spans`), whatever the level.
//! - Traces: with `CYNODE_OTLP_ENDPOINT` (or `--otlp-endpoint`) the PM's info spans are
//!   exported in batches from a background thread to `<endpoint>/v1/traces`
//!   ([`cynode_otel`], the worker's set-up too), and every
//!   Worker API call carries a W3C `traceparent` header (see [`traceparent`]). Without an
//!   endpoint there is no exporter, no OpenTelemetry layer and no header.
//! - An `https://` endpoint is reached over rustls, trusting the system's roots; a private
//!   CA comes in through `SSL_CERT_FILE` / `SSL_CERT_DIR`, which replace those roots for
//!   the process (put public roots in the bundle too when the process needs them).
//! - [`Telemetry::shutdown`] flushes the exporter; `run` and `serve` call it on exit.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::level_filters::LevelFilter;
use tracing::subscriber::Interest;
use tracing::Metadata;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::FilterExt;
use tracing_subscriber::layer::{Context as LayerContext, Filter};
use tracing_subscriber::{EnvFilter, Layer};

/// Set once an OTLP exporter is installed: [`traceparent`] does nothing before.
static TRACING: AtomicBool = AtomicBool::new(false);

/// The installed exporter, if any; flush it with [`Telemetry::shutdown`].
#[derive(Debug, Default)]
#[must_use = "call shutdown() on exit so the last spans are exported"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether traces are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports what is still buffered and stops the exporter (blocks up to its timeout).
    /// Call it outside the async runtime.
    pub fn shutdown(self) {
        if let Some(p) = self.provider {
            if let Err(e) = p.shutdown() {
                eprintln!("cynode-pm: exporting the last traces failed: {e}");
            }
        }
    }
}

/// Keeps the PM's own spans (info and above) for the log layer whatever the event level,
/// so log lines always have their session and job context.
struct PmSpans;

impl PmSpans {
    fn keep(meta: &Metadata<'_>) -> bool {
        meta.is_span()
            && meta.target().starts_with("cynode_pm")
            && *meta.level() <= LevelFilter::INFO
    }
}

impl<S> Filter<S> for PmSpans {
    fn enabled(&self, meta: &Metadata<'_>, _: &LayerContext<'_, S>) -> bool {
        Self::keep(meta)
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        if Self::keep(meta) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::INFO)
    }
}

/// The trace exporter could not be set up.
pub type TelemetryError = cynode_otel::ExporterError;

/// Installs the global subscriber: JSON lines on stderr at `CYNODE_LOG_LEVEL` (else
/// `default_level`), plus the OTLP trace exporter when `otlp_endpoint` is given
/// ([`cynode_otel::install`]). A second call (tests) leaves the first subscriber in place.
pub fn init(default_level: &str, otlp_endpoint: Option<&str>) -> Result<Telemetry, TelemetryError> {
    let filter = EnvFilter::try_from_env("CYNODE_LOG_LEVEL")
        .unwrap_or_else(|_| EnvFilter::new(default_level));
    let fmt = tracing_subscriber::fmt::layer()
        .json()
        .with_writer(std::io::stderr)
        .with_filter(filter.or(PmSpans));
    let exporter = cynode_otel::install(fmt, "cynode-pm", otlp_endpoint)?;
    if exporter.as_ref().is_some_and(|e| e.installed) {
        TRACING.store(true, Ordering::SeqCst);
    }
    Ok(Telemetry {
        provider: exporter.map(|e| e.provider),
    })
}

/// The W3C `traceparent` of the current span, when traces are exported and the span is
/// sampled into one (`00-<trace id>-<span id>-<flags>`).
pub fn traceparent() -> Option<String> {
    if !TRACING.load(Ordering::Relaxed) {
        return None;
    }
    traceparent_of(&tracing::Span::current())
}

fn traceparent_of(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let mut carrier: HashMap<String, String> = HashMap::new();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut carrier));
    carrier.remove("traceparent")
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn traceparent_carries_the_current_span_context() {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("session", session_id = "s-1");
            let tp = traceparent_of(&span).expect("a traceparent");
            let sc = span.context().span().span_context().clone();
            assert_eq!(
                tp,
                format!("00-{}-{}-01", sc.trace_id(), sc.span_id()),
                "version 00, the span's ids, sampled"
            );
            let child = span.in_scope(|| tracing::info_span!("turn"));
            let child_tp = traceparent_of(&child).expect("a traceparent");
            assert_eq!(&child_tp[3..35], &tp[3..35], "one trace per session");
            assert_ne!(child_tp, tp, "each span has its own id");
        });
        assert_eq!(
            traceparent_of(&tracing::Span::none()),
            None,
            "no span, no header"
        );
    }
}
