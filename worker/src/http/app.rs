//! The router: open health endpoints, the authenticated `/v1/worker/…` routes, the request
//! body limit, and the trace layer that joins each request to its caller's trace.

use std::sync::Arc;

use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::routing::{get, post};
use axum::Router;

use super::extract::BodyLimit;
use super::{
    auth, capacity, health, jobs, metrics, session_execs, session_files, sessions, workspaces,
};
use crate::node::Node;

/// The router for `node`.
pub fn app(node: Arc<Node>) -> Router {
    let limit = node.cfg.limits.max_request_bytes;
    let v1 = Router::new()
        .route("/v1/worker/jobs:run", post(jobs::run_sync))
        .route("/v1/worker/jobs", post(jobs::submit))
        .route(
            "/v1/worker/jobs/{job_id}",
            get(jobs::status).post(jobs::action),
        )
        .route(
            "/v1/worker/jobs/{job_id}/artifacts/{*path}",
            get(jobs::artifact),
        )
        .route("/v1/worker/capacity", get(capacity::capacity))
        .route("/metrics", get(metrics::metrics))
        .merge(workspaces::routes())
        .merge(sessions::routes())
        .merge(session_files::routes())
        .merge(session_execs::routes())
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&node),
            auth::auth,
        ));
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(health::readyz))
        .merge(v1)
        .layer(middleware::from_fn(
            move |mut req: Request, next: Next| async move {
                req.extensions_mut().insert(BodyLimit(limit));
                next.run(req).await
            },
        ))
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn(crate::trace::traced))
        .with_state(node)
}
