//! RFC 9457 problem details: every error of the HTTP API is an
//! `application/problem+json` body with a stable `type`, a `title`, the `status`, and a
//! `detail` that names what was wrong.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

/// One problem (RFC 9457).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Problem {
    /// A URI reference naming the problem type, e.g. `urn:cynode:problem:not-found`.
    #[serde(rename = "type")]
    pub kind: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
}

impl Problem {
    /// A problem of `kind` (the last part of the `urn:cynode:problem:` type).
    pub fn new(status: StatusCode, kind: &str, detail: impl Into<String>) -> Self {
        Problem {
            kind: format!("urn:cynode:problem:{kind}"),
            title: status.canonical_reason().unwrap_or("error").to_string(),
            status: status.as_u16(),
            detail: detail.into(),
        }
    }

    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid-request", detail)
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid bearer token is required (Authorization: Bearer TOKEN)",
        )
    }

    /// Also used for another tenant's resources: their existence is not revealed.
    pub fn not_found(what: impl Into<String>) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not-found",
            format!("{} not found", what.into()),
        )
    }

    pub fn conflict(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", detail)
    }

    pub fn internal(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", detail)
    }

    pub fn unavailable(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", detail)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_string(&self).unwrap_or_default();
        (
            status,
            [(header::CONTENT_TYPE, "application/problem+json")],
            body,
        )
            .into_response()
    }
}

impl From<crate::store::StoreError> for Problem {
    fn from(e: crate::store::StoreError) -> Self {
        match e {
            crate::store::StoreError::Conflict(id) => {
                Problem::conflict(format!("session {id} changed concurrently; retry"))
            }
            other => Problem::unavailable(format!("datastore: {other}")),
        }
    }
}

impl From<crate::driver::DriverError> for Problem {
    fn from(e: crate::driver::DriverError) -> Self {
        match e {
            crate::driver::DriverError::Store(s) => s.into(),
            crate::driver::DriverError::NotFound(id) => Problem::not_found(format!("session {id}")),
        }
    }
}
