//! The one request extractor of every `serve` route with a body ([`ApiJson`]), and the
//! layer that turns every other rejection into problem+json ([`problem_responses`]).
//!
//! A body is accepted only as `Content-Type: application/json` (parameters such as
//! `charset` allowed; anything else, or none, is 415), only up to `--max-body-bytes`
//! (413, with or without Content-Length), and only as a JSON object (serde would read
//! `["objective"]` as a struct, position by position, so arrays and scalars are 400
//! before deserialising). Every rejection is `application/problem+json`.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

use crate::app::problem::Problem;

/// A JSON-object request body deserialised as `T` (closed types: unknown fields are a 400
/// naming them).
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

/// Whether the request says `application/json` (any case, parameters allowed).
fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
}

/// The 413 problem.
pub fn too_large(limit: Option<usize>) -> Problem {
    Problem::status(
        StatusCode::PAYLOAD_TOO_LARGE,
        match limit {
            Some(n) => format!("the request body is larger than {n} bytes (--max-body-bytes)"),
            None => "the request body is larger than this service accepts (--max-body-bytes)"
                .to_string(),
        },
    )
}

/// Deserialises `body` as `T`, after checking it is a JSON object.
pub fn parse_object<T: DeserializeOwned>(body: &[u8]) -> Result<T, Problem> {
    let first = body.iter().copied().find(|b| !b.is_ascii_whitespace());
    if first != Some(b'{') {
        return Err(Problem::bad_request(
            "the request body must be a JSON object",
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        Problem::bad_request(if path == "." {
            e.inner().to_string()
        } else {
            format!("{path}: {}", e.inner())
        })
    })
}

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Problem> {
        if !is_json(req.headers()) {
            let got = req
                .headers()
                .get(header::CONTENT_TYPE)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
            return Err(Problem::status(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                match got {
                    Some(t) => format!("Content-Type `{t}` is not accepted: send application/json"),
                    None => "no Content-Type: send application/json".to_string(),
                },
            ));
        }
        let body = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                too_large(None)
            } else {
                Problem::bad_request(format!("cannot read the request body: {}", e.body_text()))
            }
        })?;
        parse_object(&body).map(ApiJson)
    }
}

/// Largest error body of another layer kept as a problem's detail.
const DETAIL_BYTES: usize = 4096;

/// Response mapper: an error response (4xx/5xx) that is not already problem+json (axum's
/// own rejections, the body-limit layer's 413, 405, the timeout layer's 408) becomes one,
/// with its text as the detail; a 413 says the limit.
pub async fn problem_responses(max_body: usize, r: Response) -> Response {
    let status = r.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return r;
    }
    let is_problem = r
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
    if is_problem {
        return r;
    }
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        return too_large(Some(max_body)).into_response();
    }
    let (parts, body) = r.into_parts();
    let text = axum::body::to_bytes(body, DETAIL_BYTES)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let detail = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_lowercase()
    } else {
        text
    };
    let mut p = Problem::status(status, detail).into_response();
    // Keep what the original said about methods and retrying.
    for h in [header::ALLOW, header::RETRY_AFTER, header::WWW_AUTHENTICATE] {
        if let Some(v) = parts.headers.get(&h) {
            p.headers_mut().insert(h, v.clone());
        }
    }
    p
}
