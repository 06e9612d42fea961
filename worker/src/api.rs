//! The Worker API v1 over HTTP: `fn app(node) -> Router`.
//!
//! Health endpoints are open; every `/v1/` route needs the bearer token (constant-time
//! compare). Bodies are limited (413), parsed strictly with field-named errors (400), and
//! every error is RFC 9457 problem+json through the one [`ApiError`].

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cynode_protocol::worker_api::{Problem, RunJobRequest, WorkerCapacity};
use cynode_protocol::ValidationError;
use subtle::ConstantTimeEq;

use crate::node::{Node, NodeError};

/// Every error the API returns.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("missing or wrong bearer token")]
    Unauthorized,
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(ValidationError),
    #[error("request body over the {0} byte limit")]
    TooLarge(usize),
    #[error("the node is at capacity; retry later")]
    Busy,
    #[error("{0}")]
    Conflict(String),
    #[error("internal error")]
    Internal(String),
}

impl ApiError {
    fn parts(&self) -> (StatusCode, &'static str, &'static str) {
        match self {
            ApiError::Unauthorized => (StatusCode::UNAUTHORIZED, "authentication", "Unauthorized"),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found", "Not Found"),
            ApiError::Invalid(_) => (StatusCode::BAD_REQUEST, "validation", "Invalid request"),
            ApiError::TooLarge(_) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "validation",
                "Payload Too Large",
            ),
            ApiError::Busy => (
                StatusCode::SERVICE_UNAVAILABLE,
                "rate_limit",
                "Node at capacity",
            ),
            ApiError::Conflict(_) => (StatusCode::CONFLICT, "validation", "Conflict"),
            ApiError::Internal(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "Internal Server Error",
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind, title) = self.parts();
        if let ApiError::Internal(detail) = &self {
            tracing::error!(error = %detail, "internal error");
        }
        let problem = Problem {
            kind: format!("urn:cynodeai:error:{kind}"),
            title: title.to_string(),
            status: status.as_u16(),
            detail: Some(self.to_string()),
            instance: None,
        };
        let mut resp = (status, Json(problem)).into_response();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if matches!(self, ApiError::Busy) {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        }
        resp
    }
}

impl From<NodeError> for ApiError {
    fn from(e: NodeError) -> Self {
        match e {
            NodeError::Invalid(v) => ApiError::Invalid(v),
            NodeError::Busy => ApiError::Busy,
            NodeError::NotFound(what) => ApiError::NotFound(what),
            NodeError::Conflict(m) => ApiError::Conflict(m),
            NodeError::Internal(m) => ApiError::Internal(m),
        }
    }
}

/// A JSON body parsed strictly, errors naming the field.
pub struct StrictJson<T>(pub T);

impl<S, T> FromRequest<S> for StrictJson<T>
where
    S: Send + Sync,
    T: serde::de::DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .map(|l| l.0)
            .unwrap_or(cynode_protocol::worker_api::DEFAULT_MAX_REQUEST_BYTES);
        let bytes = Bytes::from_request(req, state).await.map_err(|e| match e {
            BytesRejection::FailedToBufferBody(_) => ApiError::TooLarge(limit),
            other => ApiError::Invalid(ValidationError::new(".", other.body_text())),
        })?;
        let v = cynode_protocol::error::parse_strict(&bytes).map_err(ApiError::Invalid)?;
        Ok(StrictJson(v))
    }
}

#[derive(Clone, Copy)]
struct BodyLimit(usize);

/// The router for `node`.
pub fn app(node: Arc<Node>) -> Router {
    let limit = node.cfg.limits.max_request_bytes;
    let v1 = Router::new()
        .route("/v1/worker/jobs:run", post(run_sync))
        .route("/v1/worker/jobs", post(submit))
        .route("/v1/worker/jobs/{job_id}", get(job_status).post(job_action))
        .route("/v1/worker/jobs/{job_id}/artifacts/{*path}", get(artifact))
        .route("/v1/worker/capacity", get(capacity))
        .merge(crate::workspace::routes())
        .merge(crate::sessions::routes())
        .route_layer(middleware::from_fn_with_state(Arc::clone(&node), auth));
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
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

async fn auth(
    State(node): State<Arc<Node>>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if bool::from(given.as_bytes().ct_eq(node.token.as_bytes())) {
        Ok(next.run(req).await)
    } else {
        Err(ApiError::Unauthorized)
    }
}

/// `GET /readyz`: 200 `ready` (exactly, as upstream CyNodeAI and its BDD steps expect) or
/// 503 `not ready: <reason>`. With `Accept: application/json` the answer is
/// `{"ready": bool, "detail": "<backend and checks>"}` with the same status.
async fn readyz(State(node): State<Arc<Node>>, headers: axum::http::HeaderMap) -> Response {
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
        return (
            status,
            Json(serde_json::json!({ "ready": r.ready, "detail": r.detail })),
        )
            .into_response();
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

/// `GET /v1/worker/capacity`: limits and current load, for PMs spreading jobs.
async fn capacity(State(node): State<Arc<Node>>) -> Json<WorkerCapacity> {
    Json(node.capacity())
}

async fn run_sync(
    State(node): State<Arc<Node>>,
    StrictJson(mut req): StrictJson<RunJobRequest>,
) -> Result<Response, ApiError> {
    default_image(&node, &mut req);
    let resp = node.run_sync(req).await?;
    Ok(Json(resp).into_response())
}

/// An empty `sandbox.image` becomes the node's `default_image`, when it has one (upstream
/// CyNodeAI's fallback); the allowlist and the image grammar still apply to it.
fn default_image(node: &Node, req: &mut RunJobRequest) {
    if req.sandbox.image.trim().is_empty() {
        if let Some(image) = &node.cfg.default_image {
            req.sandbox.image = image.clone();
        }
    }
}

async fn submit(
    State(node): State<Arc<Node>>,
    StrictJson(mut req): StrictJson<RunJobRequest>,
) -> Result<Response, ApiError> {
    default_image(&node, &mut req);
    let (new, status) = node.submit(req).await?;
    let code = if new {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    Ok((code, Json(status)).into_response())
}

async fn job_status(
    State(node): State<Arc<Node>>,
    Path(job_id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(node.status(&job_id).await?).into_response())
}

/// `POST /v1/worker/jobs/{job_id}:stop` and `…:ack` (the router cannot split a segment).
async fn job_action(
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

async fn artifact(
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
