//! [`ApiError`]: every error the Worker API returns, as an RFC 9457 problem+json body
//! ([`cynode_protocol::problem::Problem`]), and the one place where the domain errors
//! (node, sessions, workspaces) become HTTP statuses.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cynode_protocol::problem::{Problem, ProblemKind, CONTENT_TYPE};
use cynode_protocol::ValidationError;

use crate::node::NodeError;
use crate::sessions::SessionError;
use crate::workspace::WorkspaceError;

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
    /// No host uid is free for the workspace (`sandbox_uids` exhausted): 503.
    #[error("{0}")]
    NoSandboxUid(String),
    #[error("internal error")]
    Internal(String),
}

impl ApiError {
    /// Status, problem kind and title. The kinds are upstream CyNodeAI's where upstream's
    /// Worker API defines them (`validation` for 400 and 413, `authentication`,
    /// `not_found`, `rate_limit`, `internal`); a 409, which upstream's Worker API never
    /// answers, is the vocabulary's `conflict`.
    fn parts(&self) -> (StatusCode, ProblemKind, &'static str) {
        match self {
            ApiError::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                ProblemKind::Authentication,
                "Unauthorized",
            ),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, ProblemKind::NotFound, "Not Found"),
            ApiError::Invalid(_) => (
                StatusCode::BAD_REQUEST,
                ProblemKind::Validation,
                "Invalid request",
            ),
            ApiError::TooLarge(_) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                ProblemKind::Validation,
                "Payload Too Large",
            ),
            ApiError::Busy => (
                StatusCode::SERVICE_UNAVAILABLE,
                ProblemKind::RateLimit,
                "Node at capacity",
            ),
            ApiError::Conflict(_) => (StatusCode::CONFLICT, ProblemKind::Conflict, "Conflict"),
            ApiError::NoSandboxUid(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                ProblemKind::RateLimit,
                "No sandbox uid free",
            ),
            ApiError::Internal(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                ProblemKind::Internal,
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
        let problem = Problem::new(status.as_u16(), kind, title, Some(self.to_string()));
        let mut resp = (status, Json(problem)).into_response();
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
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
            NodeError::Uid(e) => e.into(),
            NodeError::Internal(m) => ApiError::Internal(m),
        }
    }
}

impl From<SessionError> for ApiError {
    fn from(e: SessionError) -> Self {
        match e {
            SessionError::Invalid(v) => ApiError::Invalid(v),
            SessionError::TooMany => ApiError::Busy,
            e @ SessionError::NotFound { .. } => ApiError::NotFound(e.to_string()),
            e @ SessionError::SnapshotNotFound { .. } => ApiError::NotFound(e.to_string()),
            e @ SessionError::FileNotFound { .. } => ApiError::NotFound(e.to_string()),
            SessionError::Conflict(m) => ApiError::Conflict(m),
            SessionError::TooLarge(n) => ApiError::TooLarge(n),
            SessionError::Uid(e) => e.into(),
            SessionError::Internal(m) => ApiError::Internal(m),
        }
    }
}

impl From<WorkspaceError> for ApiError {
    fn from(e: WorkspaceError) -> Self {
        match e {
            WorkspaceError::Invalid(v) => ApiError::Invalid(v),
            e @ WorkspaceError::NotFound { .. } => ApiError::NotFound(e.to_string()),
            WorkspaceError::HasContent(m) => ApiError::Conflict(m),
            WorkspaceError::Changeset(e) => ApiError::Internal(e.to_string()),
            WorkspaceError::Internal(m) => ApiError::Internal(m),
            WorkspaceError::Uid(e) => e.into(),
        }
    }
}

impl From<crate::uid_pool::UidError> for ApiError {
    fn from(e: crate::uid_pool::UidError) -> Self {
        match e {
            e @ crate::uid_pool::UidError::Exhausted { .. } => {
                ApiError::NoSandboxUid(e.to_string())
            }
            e => ApiError::Internal(e.to_string()),
        }
    }
}
