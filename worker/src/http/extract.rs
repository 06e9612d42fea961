//! Request extractors: [`StrictJson`], a body within the node's limit parsed strictly
//! (unknown fields refused), its errors naming the field; an unsupported `version` is
//! refused as such before any other field is read.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use cynode_protocol::ValidationError;

use super::error::ApiError;

/// The request body limit in force, as the router's layer records it for [`StrictJson`].
#[derive(Clone, Copy)]
pub(super) struct BodyLimit(pub usize);

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
        let v = cynode_protocol::worker_api::parse_request(&bytes).map_err(ApiError::Invalid)?;
        Ok(StrictJson(v))
    }
}
