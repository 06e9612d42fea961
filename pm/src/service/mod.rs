//! `cynode-pm serve`: the PM as an HTTP service for orchestrator backends.
//!
//! - [`api`]: the `/v1` handlers (sessions, messages, cancel, artifacts, skills,
//!   jobs:validate) with their OpenAPI description;
//! - [`events`]: the Server-Sent Events stream of a session;
//! - [`extract`]: the one request-body extractor and the layer making every rejection
//!   problem+json;
//! - [`sandboxes`]: `/v1/sandboxes…`, a worker's sessions for the tenant (exec, streamed
//!   execs, files, suspend and resume, snapshots and forks).
//!
//! What the handlers share with the MCP tools (the state, tokens, operations, errors and
//! the scheduler) is [`crate::app`], below both; [`router`] mounts the API and MCP's
//! routers (`/v1/mcp`, `/v1/gateway`) on one listener.
//!
//! Stateless replicas share one database: any replica answers any request, and sessions
//! are driven by whichever replica holds their lease. `/healthz` is liveness, `/readyz`
//! checks the database and that at least one worker of the registry answers its `/readyz`, `/metrics`
//! is Prometheus text, `/openapi.json` the API description (checked in at
//! `docs/openapi.json`, drift-tested).

pub mod api;
pub mod events;
pub mod extract;
pub mod sandboxes;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use utoipa::OpenApi;

use crate::app::auth::Tokens;
use crate::app::problem::Problem;
use crate::app::{scheduler, AppState};
use crate::driver::Pm;

/// How the service runs: its address, limits, leases and HTTPS (the binary's `serve`
/// command fills it from flags and environment).
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub listen: SocketAddr,
    /// Who may call the API, and as which tenant.
    pub tokens: Tokens,
    /// Lease of a session on this replica.
    pub lease: Duration,
    /// Sessions this replica drives at once.
    pub max_active_sessions: usize,
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
    /// Largest request body the sandbox gateway (`/v1/gateway`) accepts: its own bound,
    /// so an 8 MiB `artifact.put` fits whatever the API's is.
    pub gateway_max_body_bytes: usize,
    /// Requests (other than event streams) taking longer are answered 408.
    pub request_timeout: Duration,
    /// On SIGTERM, how long sessions may take to finish their current step.
    pub shutdown_grace: Duration,
    /// This replica's name in leases (default: host name and process id).
    pub replica_id: Option<String>,
    /// HTTPS instead of plain HTTP.
    pub tls: Option<cynode_tls::ServerTls>,
    /// Bounds on the listener's connections (count, head and idle timeouts, head size,
    /// TLS handshake time), plain or HTTPS alike.
    pub listener: cynode_tls::ListenerLimits,
}

/// Why the service stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot set up HTTPS: {0}")]
    Tls(cynode_tls::TlsError),
    #[error("cannot listen on {addr}: {cause}")]
    Listen {
        addr: SocketAddr,
        cause: std::io::Error,
    },
    #[error("server: {0}")]
    Server(String),
}

/// The OpenAPI description of the API.
#[derive(OpenApi)]
#[openapi(
    info(title = "cynode-pm", description = "The CyNode project-manager control plane: sessions driven by an LLM loop through sandboxed jobs."),
    paths(api::create_session, api::list_sessions, api::get_session, api::get_report, api::post_message,
          api::session_action, api::get_artifact, api::list_skills, api::validate_job,
          events::session_events,
          sandboxes::create, sandboxes::list, sandboxes::show, sandboxes::action, sandboxes::exec,
          sandboxes::exec_state, sandboxes::exec_action, sandboxes::stdin, sandboxes::output,
          sandboxes::read_files, sandboxes::write_file, sandboxes::create_snapshot,
          sandboxes::list_snapshots, sandboxes::delete_snapshot),
    components(schemas(api::CreateSession, api::Constraints, api::WorkspaceSpec, api::SessionView,
                       api::SessionList, api::Answer, api::ValidateJob, api::Validation, Problem,
                       api::EvidenceReport, api::TaskEvidence, api::JobEvidence, api::StepEvidence,
                       cynode_protocol::pm_sandboxes::CreateSandbox,
                       cynode_protocol::pm_sandboxes::SandboxList,
                       cynode_protocol::pm_sandboxes::SandboxRef)),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The API document as pretty JSON (what `/openapi.json` serves and docs/openapi.json holds).
pub fn openapi_json() -> String {
    ApiDoc::openapi().to_pretty_json().unwrap_or_default()
}

/// The router of the service: the API and MCP under `max_body`, the sandbox gateway
/// under `gateway_max_body`.
pub fn router(
    state: Arc<AppState>,
    max_body: usize,
    gateway_max_body: usize,
    timeout: Duration,
) -> Router {
    let limited = Router::new()
        .route(
            "/v1/sessions",
            post(api::create_session).get(api::list_sessions),
        )
        .route(
            "/v1/sessions/{id}",
            get(api::get_session).post(api::session_action),
        )
        .route("/v1/sessions/{id}/messages", post(api::post_message))
        .route("/v1/sessions/{id}/report", get(api::get_report))
        .route(
            "/v1/sessions/{id}/artifacts/{sha256}",
            get(api::get_artifact),
        )
        .route("/v1/skills", get(api::list_skills))
        .route("/v1/jobs:validate", post(api::validate_job))
        .merge(sandboxes::routes())
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route(
            "/openapi.json",
            get(|| async { ([("content-type", "application/json")], openapi_json()) }),
        )
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            timeout,
        ));
    let api = Router::new()
        .route("/v1/sessions/{id}/events", get(events::session_events))
        .merge(sandboxes::long_routes())
        .merge(limited)
        // MCP at /v1/mcp, behind the same tokens, body limit and timeout.
        .merge(
            crate::mcp::http::router(Arc::clone(&state), max_body).layer(
                TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, timeout),
            ),
        )
        .fallback(|| async { Problem::not_found("route") })
        .layer(DefaultBodyLimit::disable())
        .layer(RequestBodyLimitLayer::new(max_body))
        .layer(axum::middleware::map_response(move |r: Response| {
            extract::problem_responses(max_body, r)
        }));
    // The sandbox agents' gateway at /v1/gateway, behind job tokens, with its own bound.
    let gateway = crate::mcp::gateway::router(Arc::clone(&state), gateway_max_body)
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            timeout,
        ))
        .layer(DefaultBodyLimit::disable())
        .layer(RequestBodyLimitLayer::new(gateway_max_body))
        .layer(axum::middleware::map_response(move |r: Response| {
            extract::problem_responses(gateway_max_body, r)
        }));
    api.merge(gateway).with_state(state)
}

async fn readyz(State(st): State<Arc<AppState>>) -> Response {
    if !st.pm.store.ping().await {
        return Problem::unavailable("the datastore does not answer").into_response();
    }
    if !st.pm.workers.any_ready().await {
        return Problem::unavailable("no worker is ready").into_response();
    }
    "ready".into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let m = crate::metrics::metrics();
    if let Ok(counts) = st.pm.store.count_by_status().await {
        for status in [
            "running",
            "awaiting_input",
            "completed",
            "failed",
            "canceled",
        ] {
            let n = counts
                .iter()
                .find(|(s, _)| s == status)
                .map_or(0, |(_, n)| *n);
            m.sessions
                .get_or_create(&crate::metrics::StatusLabel {
                    status: status.into(),
                })
                .set(n);
        }
    }
    if let Ok(n) = st.pm.store.unclaimed().await {
        m.queue_depth.set(n);
    }
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.encode(),
    )
        .into_response()
}

/// Resolves on SIGTERM or SIGINT, after cancelling `stop` (no new sessions are claimed).
async fn shutdown_signal(stop: CancellationToken) {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down: no new sessions are claimed here");
    stop.cancel();
}

/// Runs the service until SIGTERM / SIGINT, then shuts down in order: stop claiming,
/// end event streams and finish in-flight requests, let sessions finish their step (up
/// to the grace), release every lease, exit.
pub async fn serve(pm: Pm, cfg: ServeConfig) -> Result<(), ServeError> {
    let listener = std::net::TcpListener::bind(cfg.listen).map_err(|cause| ServeError::Listen {
        addr: cfg.listen,
        cause,
    })?;
    serve_on(pm, cfg, listener).await
}

/// [`serve`] on a listener the caller bound (`cfg.listen` is then only its name in
/// errors): the caller knows the bound address first, e.g. for a `:0` port.
pub async fn serve_on(
    pm: Pm,
    cfg: ServeConfig,
    listener: std::net::TcpListener,
) -> Result<(), ServeError> {
    let pm = Arc::new(pm);
    let wake = Arc::new(Notify::new());
    let owner = cfg.replica_id.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
        format!("{}-{}", host.trim(), std::process::id())
    });
    let schedule = scheduler::Schedule {
        owner: owner.clone(),
        lease: cfg.lease.max(Duration::from_secs(1)),
        capacity: cfg.max_active_sessions.max(1),
        tick: Duration::from_millis(500),
        grace: cfg.shutdown_grace,
    };
    let stop = CancellationToken::new();
    let scheduler = tokio::spawn(scheduler::run(
        Arc::clone(&pm),
        schedule,
        Arc::clone(&wake),
        stop.clone(),
    ));
    let state = Arc::new(AppState {
        pm,
        tokens: cfg.tokens,
        wake,
        stop: stop.clone(),
    });
    let app = router(
        state,
        cfg.max_body_bytes,
        cfg.gateway_max_body_bytes,
        cfg.request_timeout.max(Duration::from_secs(1)),
    );
    // Checked before listening: a bad certificate or key fails the start, naming the file.
    if let Some(t) = &cfg.tls {
        cynode_tls::server_config(t).map_err(ServeError::Tls)?;
    }
    let listen_error = |cause| ServeError::Listen {
        addr: cfg.listen,
        cause,
    };
    let addr = listener.local_addr().map_err(listen_error)?;
    let scheme = if cfg.tls.is_some() { "https" } else { "http" };
    tracing::info!(addr = %addr, scheme, replica = %owner, "cynode-pm listening");
    // HTTPS: the certificate, key and client CA are reloaded on change or SIGHUP. Plain or
    // not, connections go through the one bounded accept loop.
    cynode_tls::serve_with(
        listener,
        app,
        cfg.tls,
        cfg.listener,
        shutdown_signal(stop.clone()),
    )
    .await
    .map_err(|e| ServeError::Server(format!("{scheme}: {e}")))?;
    if let Err(e) = scheduler.await {
        tracing::warn!(error = %e, "the scheduler ended abnormally");
    }
    tracing::info!("cynode-pm stopped");
    Ok(())
}
