//! The job routes: `POST /v1/worker/jobs:run` (run and answer), `POST /v1/worker/jobs`
//! (submit: 202 when new, 200 for a repeat), `GET …/jobs/{id}`, `POST …/jobs/{id}:stop`
//! and `…:ack`, and `GET …/jobs/{id}/artifacts/{path}` (streamed).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cynode_protocol::worker_api::RunJobRequest;

use super::error::ApiError;
use super::extract::StrictJson;
use crate::node::Node;

pub(super) async fn run_sync(
    State(node): State<Arc<Node>>,
    StrictJson(req): StrictJson<RunJobRequest>,
) -> Result<Response, ApiError> {
    let resp = node.run_sync(req).await?;
    Ok(Json(resp).into_response())
}

pub(super) async fn submit(
    State(node): State<Arc<Node>>,
    StrictJson(req): StrictJson<RunJobRequest>,
) -> Result<Response, ApiError> {
    let (new, status) = node.submit(req).await?;
    Ok(super::new_or_repeat(new, StatusCode::ACCEPTED, status))
}

pub(super) async fn status(
    State(node): State<Arc<Node>>,
    Path(job_id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(node.status(&job_id).await?).into_response())
}

/// `POST /v1/worker/jobs/{job_id}:stop` and `…:ack` (the router cannot split a segment).
pub(super) async fn action(
    State(node): State<Arc<Node>>,
    Path(segment): Path<String>,
) -> Result<Response, ApiError> {
    if let Some(id) = segment.strip_suffix(":stop") {
        return Ok(Json(node.stop(id).await?).into_response());
    }
    if let Some(id) = segment.strip_suffix(":ack") {
        node.ack(id).await?;
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    Err(ApiError::NotFound(format!(
        "no action in `{segment}`: expected :stop or :ack"
    )))
}

pub(super) async fn artifact(
    State(node): State<Arc<Node>>,
    Path((job_id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let (file, len) = node.artifact(&job_id, &path).await?;
    let file = tokio::fs::File::from_std(file);
    let stream = tokio_util::io::ReaderStream::new(file);
    let mut resp = axum::body::Body::from_stream(stream).into_response();
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    if let Ok(v) = HeaderValue::from_str(&len.to_string()) {
        headers.insert(header::CONTENT_LENGTH, v);
    }
    Ok(resp)
}
