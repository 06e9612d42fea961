//! RFC 9457 problem details: every error of the HTTP API is an
//! `application/problem+json` body with a stable `type`, a `title`, the `status`, and a
//! `detail` that names what was wrong.

use std::borrow::Cow;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

/// One problem (RFC 9457): the workspace's one problem type,
/// [`cynode_protocol::problem::Problem`], whose `type` is `urn:cynodeai:error:<kind>`.
/// The service always sets `detail`.
#[derive(Debug, Clone, Serialize)]
#[serde(transparent)]
pub struct Problem(pub cynode_protocol::problem::Problem);

// The OpenAPI description of [`Problem`] as this service sends it (`detail` always set).
/// One problem (RFC 9457).
#[allow(dead_code)]
#[derive(Serialize, ToSchema)]
#[schema(as = Problem)]
struct ProblemSchema {
    /// A URI reference naming the problem type, e.g. `urn:cynodeai:error:not-found`.
    #[serde(rename = "type")]
    kind: String,
    title: String,
    status: u16,
    detail: String,
}

impl utoipa::PartialSchema for Problem {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        ProblemSchema::schema()
    }
}

impl ToSchema for Problem {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("Problem")
    }
}

impl Problem {
    /// A problem of `kind` (the last part of its `urn:cynodeai:error:` type).
    pub fn new(status: StatusCode, kind: &str, detail: impl Into<String>) -> Self {
        Problem(cynode_protocol::problem::Problem::new(
            status.as_u16(),
            kind,
            status.canonical_reason().unwrap_or("error"),
            Some(detail.into()),
        ))
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
        let status =
            StatusCode::from_u16(self.0.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_string(&self).unwrap_or_default();
        (
            status,
            [(header::CONTENT_TYPE, cynode_protocol::problem::CONTENT_TYPE)],
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
