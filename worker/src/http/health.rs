//! `GET /readyz` (`GET /healthz` is a constant `ok` in the router): readiness as the node
//! checks it now, in upstream CyNodeAI's text form or as JSON
//! ([`cynode_protocol::worker_health::Readiness`]).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::node::Node;

/// `GET /readyz`: 200 `ready` (exactly, as upstream CyNodeAI and its BDD steps expect) or
/// 503 `not ready: <reason>`. With `Accept: application/json` the answer is
/// `{"ready": bool, "detail": "<backend and checks>"}` with the same status.
pub(super) async fn readyz(
    State(node): State<Arc<Node>>,
    headers: axum::http::HeaderMap,
) -> Response {
    let r = node.check_ready().await;
    let status = if r.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let wants_json = headers
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/json"));
    if wants_json {
        return (status, Json(r)).into_response();
    }
    if r.ready {
        (StatusCode::OK, "ready").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}", r.detail),
        )
            .into_response()
    }
}
