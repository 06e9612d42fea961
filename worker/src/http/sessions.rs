//! The session routes: `POST /v1/worker/sessions` (201 when new, 200 for a repeat of a
//! running one), `GET …/sessions/{id}`, `POST …/{id}/exec` and `POST …/{id}/end`. What they
//! do is in [`crate::sessions`].

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cynode_protocol::worker_sessions::{CreateSessionRequest, ExecRequest};

use super::error::ApiError;
use super::extract::StrictJson;
use crate::node::Node;

/// The session routes, for the authenticated `/v1` router.
pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route("/v1/worker/sessions", post(create))
        .route(
            "/v1/worker/sessions/{session_id}",
            get(show).post(super::session_state::action),
        )
        .route("/v1/worker/sessions/{session_id}/exec", post(exec))
        .route("/v1/worker/sessions/{session_id}/end", post(end))
        .merge(super::session_state::routes())
}

async fn create(
    State(node): State<Arc<Node>>,
    StrictJson(req): StrictJson<CreateSessionRequest>,
) -> Result<Response, ApiError> {
    let (new, info) = node.sessions.create(req).await?;
    Ok(super::new_or_repeat(new, StatusCode::CREATED, info))
}

async fn show(
    State(node): State<Arc<Node>>,
    Path(session_id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(node.sessions.show(&session_id)?).into_response())
}

async fn exec(
    State(node): State<Arc<Node>>,
    Path(session_id): Path<String>,
    StrictJson(req): StrictJson<ExecRequest>,
) -> Result<Response, ApiError> {
    // Streamed: 202 with the exec id at once (`super::session_execs` reads it).
    if req.stream {
        let started = node.sessions.exec_streamed(&session_id, req)?;
        return Ok((StatusCode::ACCEPTED, Json(started)).into_response());
    }
    Ok(Json(node.sessions.exec(&session_id, req).await?).into_response())
}

/// Takes no body (any body is ignored), like `jobs/{id}:stop`.
async fn end(
    State(node): State<Arc<Node>>,
    Path(session_id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(node.sessions.end(&session_id).await?).into_response())
}
