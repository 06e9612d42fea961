//! The workspace routes: `POST /v1/worker/workspaces` (201 when created, 200 when it
//! already had content), `PUT …/{id}/tar` (seed from a tar), `GET …/{id}/tar` (streamed
//! export) and `GET …/{id}/changeset` (a `git diff`). What they do is in
//! [`crate::workspace`].

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cynode_protocol::worker_workspaces::CreateWorkspace;

use super::error::ApiError;
use super::extract::StrictJson;
use crate::node::Node;
use crate::workspace;

/// The workspace routes, for the authenticated `/v1` router.
pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route("/v1/worker/workspaces", post(create))
        .route(
            "/v1/worker/workspaces/{id}/tar",
            get(export_tar).put(seed_tar),
        )
        .route("/v1/worker/workspaces/{id}/changeset", get(changeset))
}

async fn create(
    State(node): State<Arc<Node>>,
    StrictJson(req): StrictJson<CreateWorkspace>,
) -> Result<Response, ApiError> {
    let info = workspace::create(&node.cfg, &node.uids, req).await?;
    Ok(super::new_or_repeat(
        info.created,
        StatusCode::CREATED,
        info,
    ))
}

async fn seed_tar(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let info = workspace::seed_tar(&node.cfg, &node.uids, id, body).await?;
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

async fn export_tar(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let tar = workspace::export_tar(&node.cfg, &id)?;
    let mut resp = Body::from_stream(tokio_util::io::ReaderStream::new(tar)).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-tar"),
    );
    Ok(resp)
}

async fn changeset(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let text = workspace::changeset(&node.cfg, &node.uids, node.backend.as_ref(), &id).await?;
    let mut resp = text.into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/x-diff; charset=utf-8"),
    );
    Ok(resp)
}
