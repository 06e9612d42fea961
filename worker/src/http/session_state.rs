//! The routes of a session's state: `POST /v1/worker/sessions/{id}:suspend` (an optional
//! body, `{"memory": bool}`) and `…:resume`, `POST`/`GET …/{id}/snapshots`, and
//! `DELETE /v1/worker/snapshots/{snapshot_id}`. What they do is in
//! [`crate::sessions`] (`suspend`, `snapshot`).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post};
use axum::{Json, Router};
use cynode_protocol::worker_api::API_VERSION;
use cynode_protocol::worker_session_state::{SnapshotList, SuspendRequest};
use cynode_protocol::ValidationError;

use super::error::ApiError;
use crate::node::Node;

/// The snapshot routes, for the authenticated `/v1` router (suspend and resume share the
/// session's own path: [`action`]).
pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route(
            "/v1/worker/sessions/{session_id}/snapshots",
            post(create_snapshot).get(list_snapshots),
        )
        .route(
            "/v1/worker/snapshots/{snapshot_id}",
            delete(delete_snapshot),
        )
}

/// `POST /v1/worker/sessions/{id}:suspend` and `…:resume` (the router cannot split a
/// segment). An empty body is an empty request; any other is parsed strictly.
pub async fn action(
    State(node): State<Arc<Node>>,
    Path(segment): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    if let Some(id) = segment.strip_suffix(":suspend") {
        let req: SuspendRequest = if body.iter().all(u8::is_ascii_whitespace) {
            SuspendRequest::default()
        } else {
            serde_json::from_slice(&body)
                .map_err(|e| ApiError::Invalid(ValidationError::new("body", e.to_string())))?
        };
        return Ok(Json(node.sessions.suspend(id, req).await?).into_response());
    }
    if let Some(id) = segment.strip_suffix(":resume") {
        return Ok(Json(node.sessions.resume(id).await?).into_response());
    }
    Err(ApiError::NotFound(format!(
        "no action in `{segment}`: expected :suspend or :resume"
    )))
}

async fn create_snapshot(
    State(node): State<Arc<Node>>,
    Path(session_id): Path<String>,
) -> Result<Response, ApiError> {
    let snap = node.sessions.snapshot(&session_id).await?;
    Ok((StatusCode::CREATED, Json(snap)).into_response())
}

async fn list_snapshots(
    State(node): State<Arc<Node>>,
    Path(session_id): Path<String>,
) -> Result<Response, ApiError> {
    let snapshots = node.sessions.snapshots(&session_id).await?;
    Ok(Json(SnapshotList {
        version: API_VERSION,
        snapshots,
    })
    .into_response())
}

async fn delete_snapshot(
    State(node): State<Arc<Node>>,
    Path(snapshot_id): Path<String>,
) -> Result<Response, ApiError> {
    node.sessions.delete_snapshot(&snapshot_id).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
