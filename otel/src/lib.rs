//! The one OTLP set-up of the PM and the worker: [`install`] sets the process's global
//! subscriber to the caller's log layer and, when an endpoint is given, an OpenTelemetry
//! layer that exports the service's own spans (info and above, of the crate named after
//! the service) in batches over OTLP/HTTP protobuf to `<endpoint>/v1/traces`, with the
//! W3C trace-context propagator installed. Without an endpoint there is no exporter and
//! no OpenTelemetry layer.
//!
//! An `https://` endpoint is reached over rustls, trusting the system's roots, or the
//! bundle in `SSL_CERT_FILE` / `SSL_CERT_DIR`, which replaces them for the process.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

/// The exporter of `url` could not be built.
#[derive(Debug, thiserror::Error)]
#[error("cannot set up the OTLP exporter for {url}: {source}")]
pub struct ExporterError {
    pub url: String,
    #[source]
    pub source: opentelemetry_otlp::ExporterBuildError,
}

/// An installed exporter: flush it with `provider.shutdown()` outside the async runtime
/// on exit. `installed` is false when a subscriber was set before (a second call in one
/// process, as tests make): that earlier subscriber stays.
#[derive(Debug)]
pub struct Exporter {
    pub provider: SdkTracerProvider,
    pub installed: bool,
}

/// The OTLP/HTTP traces URL for a base endpoint such as `http://collector:4318` (a URL
/// already ending in `/v1/traces` is taken as it is).
pub fn traces_url(endpoint: &str) -> String {
    let e = endpoint.trim_end_matches('/');
    if e.ends_with("/v1/traces") {
        e.to_string()
    } else {
        format!("{e}/v1/traces")
    }
}

/// Installs the global subscriber: `log` (the caller's JSON lines, with its own filter)
/// and, when `endpoint` is given and not blank, the exporter of `service`'s spans
/// (`cynode-pm` exports the spans of target `cynode_pm`). A second call leaves the first
/// subscriber in place.
pub fn install<L>(
    log: L,
    service: &'static str,
    endpoint: Option<&str>,
) -> Result<Option<Exporter>, ExporterError>
where
    L: Layer<Registry> + Send + Sync + 'static,
{
    let Some(endpoint) = endpoint.map(str::trim).filter(|e| !e.is_empty()) else {
        let _ = tracing_subscriber::registry().with(log).try_init();
        return Ok(None);
    };
    let url = traces_url(endpoint);
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(&url)
        .build()
        .map_err(|source| ExporterError {
            url: url.clone(),
            source,
        })?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service)
                .build(),
        )
        .build();
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(service))
        .with_filter(Targets::new().with_target(service.replace('-', "_"), LevelFilter::INFO));
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let installed = tracing_subscriber::registry()
        .with(log)
        .with(otel)
        .try_init()
        .is_ok();
    Ok(Some(Exporter {
        provider,
        installed,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_url_appends_the_signal_path_once() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            traces_url("http://c:4318/v1/traces"),
            "http://c:4318/v1/traces"
        );
        assert_eq!(traces_url("https://c/otlp"), "https://c/otlp/v1/traces");
    }
}
