//! Bearer-token authentication of every `/v1/` route, compared in constant time.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use subtle::ConstantTimeEq;

use super::error::ApiError;
use crate::node::Node;

/// Passes the request on when it carries the node's bearer token; 401 otherwise.
pub(super) async fn auth(
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
