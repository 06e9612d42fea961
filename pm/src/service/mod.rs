//! `cynode-pm serve`: the PM as an HTTP service for orchestrator backends.
//!
//! - [`api`]: the `/v1` handlers (sessions, messages, cancel, artifacts, skills,
//!   jobs:validate) with their OpenAPI description;
//! - [`events`]: the Server-Sent Events stream of a session;
//! - [`auth`]: bearer tokens mapped to tenants;
//! - [`problem`]: RFC 9457 errors;
//! - [`extract`]: the one request-body extractor and the layer making every rejection
//!   problem+json;
//! - [`scheduler`]: leases and drives the sessions of this replica.
//!
//! Stateless replicas share one database: any replica answers any request, and sessions
//! are driven by whichever replica holds their lease. `/healthz` is liveness, `/readyz`
//! checks the database and that at least one worker of the registry answers its `/readyz`, `/metrics`
//! is Prometheus text, `/openapi.json` the API description (checked in at
//! `docs/openapi.json`, drift-tested).

pub mod api;
pub mod auth;
pub mod events;
pub mod extract;
pub mod problem;
pub mod scheduler;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use clap::Args;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use utoipa::OpenApi;

use crate::driver::Pm;
use auth::Tokens;
use problem::Problem;

/// Flags of `cynode-pm serve` (plus the model, worker and datastore flags of `run`).
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "CYNODE_PM_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// `TOKEN TENANT` per line: who may call the API, and as which tenant.
    #[arg(long, env = "CYNODE_PM_API_TOKENS_FILE")]
    pub api_tokens_file: PathBuf,
    /// Lease of a session on this replica; another replica takes over a session whose
    /// lease expired (a replica died) within this time.
    #[arg(long, default_value_t = 30)]
    pub lease_seconds: u64,
    /// Sessions this replica drives at once.
    #[arg(long, default_value_t = 64)]
    pub max_active_sessions: usize,
    /// Largest request body accepted (413 above).
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Requests (other than event streams) taking longer are answered 408.
    #[arg(long, default_value_t = 30)]
    pub request_timeout_seconds: u64,
    /// On SIGTERM, how long sessions may take to finish their current step (a model call,
    /// a job's result) before their leases are released anyway.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace_seconds: u64,
    /// This replica's name in leases (default: host name and process id).
    #[arg(long, env = "CYNODE_PM_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// PEM certificate (chain): serve HTTPS instead of plain HTTP. Reloaded when the file
    /// changes or on SIGHUP.
    #[arg(long, env = "CYNODE_PM_TLS_CERT_FILE", requires = "tls_key_file")]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `--tls-cert-file`.
    #[arg(long, env = "CYNODE_PM_TLS_KEY_FILE", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,
    /// PEM CA: every client must then present a certificate issued by it (mutual TLS).
    #[arg(long, env = "CYNODE_PM_TLS_CLIENT_CA_FILE", requires = "tls_cert_file")]
    pub tls_client_ca_file: Option<PathBuf>,
    #[command(flatten)]
    pub run: crate::run::RunArgs,
}

/// What every handler shares.
pub struct AppState {
    pub pm: Arc<Pm>,
    pub tokens: Tokens,
    /// Wakes this replica's scheduler when a session became runnable here.
    pub wake: Arc<Notify>,
    /// Cancelled when the replica shuts down: event streams end (clients resume on
    /// another replica with `Last-Event-ID`) and the scheduler hands sessions back.
    pub stop: CancellationToken,
}

/// The OpenAPI description of the API.
#[derive(OpenApi)]
#[openapi(
    info(title = "cynode-pm", description = "The CyNode project-manager control plane: sessions driven by an LLM loop through sandboxed jobs."),
    paths(api::create_session, api::list_sessions, api::get_session, api::post_message,
          api::session_action, api::get_artifact, api::list_skills, api::validate_job,
          events::session_events),
    components(schemas(api::CreateSession, api::Constraints, api::WorkspaceSpec, api::SessionView,
                       api::SessionList, api::Answer, api::ValidateJob, api::Validation, Problem)),
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

/// The router of the service.
pub fn router(state: Arc<AppState>, max_body: usize, timeout: Duration) -> Router {
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
        .route(
            "/v1/sessions/{id}/artifacts/{sha256}",
            get(api::get_artifact),
        )
        .route("/v1/skills", get(api::list_skills))
        .route("/v1/jobs:validate", post(api::validate_job))
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
    Router::new()
        .route("/v1/sessions/{id}/events", get(events::session_events))
        .merge(limited)
        .fallback(|| async { Problem::not_found("route") })
        .layer(DefaultBodyLimit::disable())
        .layer(RequestBodyLimitLayer::new(max_body))
        .layer(axum::middleware::map_response(move |r: Response| {
            extract::problem_responses(max_body, r)
        }))
        .with_state(state)
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

impl ServeArgs {
    /// The HTTPS settings, when `--tls-cert-file` and `--tls-key-file` are given.
    pub fn server_tls(&self) -> Option<cynode_tls::ServerTls> {
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(cert), Some(key)) => Some(cynode_tls::ServerTls {
                cert_file: cert.clone(),
                key_file: key.clone(),
                client_ca_file: self.tls_client_ca_file.clone(),
            }),
            _ => None,
        }
    }
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
pub async fn serve(args: &ServeArgs, global: &crate::cli::Global) -> anyhow::Result<i32> {
    let tokens = Tokens::load(&args.api_tokens_file)?;
    let workers = crate::run::configured_workers(&args.run)?.context(
        "serve needs --workers-file (CYNODE_WORKERS_FILE) or --worker-endpoint (CYNODE_WORKER_ENDPOINT)",
    )?;
    let pm = Arc::new(crate::run::build_pm(&args.run, global, workers).await?);
    let wake = Arc::new(Notify::new());
    let owner = args.replica_id.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
        format!("{}-{}", host.trim(), std::process::id())
    });
    let schedule = scheduler::Schedule {
        owner: owner.clone(),
        lease: Duration::from_secs(args.lease_seconds.max(1)),
        capacity: args.max_active_sessions.max(1),
        tick: Duration::from_millis(500),
        grace: Duration::from_secs(args.shutdown_grace_seconds),
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
        tokens,
        wake,
        stop: stop.clone(),
    });
    let app = router(
        state,
        args.max_body_bytes,
        Duration::from_secs(args.request_timeout_seconds.max(1)),
    );
    let tls = args.server_tls();
    // Checked before listening: a bad certificate or key fails the start, naming the file.
    if let Some(t) = &tls {
        cynode_tls::server_config(t).context("cannot set up HTTPS")?;
    }
    let listener = std::net::TcpListener::bind(args.listen)
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    tracing::info!(addr = %addr, scheme, replica = %owner, "cynode-pm listening");
    match tls {
        // HTTPS: the certificate, key and client CA are reloaded on change or SIGHUP.
        Some(t) => cynode_tls::serve(listener, app, Some(t), shutdown_signal(stop.clone()))
            .await
            .context("https server")?,
        None => {
            listener.set_nonblocking(true)?;
            axum::serve(tokio::net::TcpListener::from_std(listener)?, app)
                .with_graceful_shutdown(shutdown_signal(stop.clone()))
                .await?
        }
    }
    if let Err(e) = scheduler.await {
        tracing::warn!(error = %e, "the scheduler ended abnormally");
    }
    tracing::info!("cynode-pm stopped");
    Ok(0)
}
