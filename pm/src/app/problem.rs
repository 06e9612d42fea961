//! RFC 9457 problem details: every error of the HTTP API is an
//! `application/problem+json` body with a stable `type`, a `title`, the `status`, and a
//! `detail` that names what was wrong.

use std::borrow::Cow;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use cynode_protocol::problem::ProblemKind;
use serde::Serialize;
use utoipa::ToSchema;

/// One problem (RFC 9457): the workspace's one problem type,
/// [`cynode_protocol::problem::Problem`], whose `type` is `urn:cynodeai:error:<kind>` with
/// a kind of the one vocabulary the worker uses too, [`ProblemKind`].
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
    /// A URI naming the problem type: `urn:cynodeai:error:` and one of `validation`,
    /// `authentication`, `authorization`, `not_found`, `rate_limit`, `internal`,
    /// `conflict`, `timeout`, `unavailable` (the worker's vocabulary too), e.g.
    /// `urn:cynodeai:error:not_found`.
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
    /// A problem of `kind` with HTTP `status`.
    pub fn new(status: StatusCode, kind: ProblemKind, detail: impl Into<String>) -> Self {
        Problem(cynode_protocol::problem::Problem::new(
            status.as_u16(),
            kind,
            status.canonical_reason().unwrap_or("error"),
            Some(detail.into()),
        ))
    }

    /// A problem with HTTP `status` and the vocabulary's kind for it
    /// ([`ProblemKind::for_status`]).
    pub fn status(status: StatusCode, detail: impl Into<String>) -> Self {
        Self::new(status, ProblemKind::for_status(status.as_u16()), detail)
    }

    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, ProblemKind::Validation, detail)
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            ProblemKind::Authentication,
            "a valid bearer token is required (Authorization: Bearer TOKEN)",
        )
    }

    /// Valid credentials that may not do this (403).
    pub fn forbidden(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, ProblemKind::Authorization, detail)
    }

    /// Also used for another tenant's resources: their existence is not revealed.
    pub fn not_found(what: impl Into<String>) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            ProblemKind::NotFound,
            format!("{} not found", what.into()),
        )
    }

    pub fn conflict(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, ProblemKind::Conflict, detail)
    }

    pub fn internal(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ProblemKind::Internal,
            detail,
        )
    }

    pub fn unavailable(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ProblemKind::Unavailable,
            detail,
        )
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
