//! The session files routes: `GET /v1/worker/sessions/{id}/files?path=P` (the file's
//! bytes, streamed, `application/octet-stream`), `GET …/files?path=D&list=true` (a
//! `FileListing`) and `PUT …/files?path=P` (the body is the file; a `FileWritten`). What
//! they do, and every bound, is in [`crate::sessions::files`].

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use cynode_protocol::ValidationError;
use tokio::io::{AsyncRead, AsyncReadExt, ReadBuf};

use super::error::ApiError;
use crate::node::Node;

/// The files routes, for the authenticated `/v1` router.
pub fn routes() -> Router<Arc<Node>> {
    Router::new().route(
        "/v1/worker/sessions/{session_id}/files",
        get(read).put(write),
    )
}

/// The files query: `path`, and `list` for a listing.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FilesQuery {
    #[serde(default)]
    path: String,
    #[serde(default)]
    list: bool,
}

fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, ApiError> {
    q.map(|Query(q)| q)
        .map_err(|e| ApiError::Invalid(ValidationError::new("query", e.body_text())))
}

async fn read(
    State(node): State<Arc<Node>>,
    Path(session_id): Path<String>,
    q: Result<Query<FilesQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    if q.list {
        return Ok(Json(node.sessions.list_files(&session_id, &q.path).await?).into_response());
    }
    let f = node.sessions.read_file(&session_id, &q.path).await?;
    // Never more than the size it had when opened, however the sandbox grows it.
    let file = tokio::fs::File::from_std(f.file).take(f.size);
    let mut resp = Body::from_stream(tokio_util::io::ReaderStream::new(file)).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(f.size));
    Ok(resp)
}

async fn write(
    State(node): State<Arc<Node>>,
    Path(session_id): Path<String>,
    q: Result<Query<FilesQuery>, QueryRejection>,
    body: Body,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    if q.list {
        return Err(ApiError::Invalid(ValidationError::new(
            "list",
            "a write takes no list",
        )));
    }
    let reader = BodyReader {
        body,
        rest: Bytes::new(),
    };
    Ok(Json(
        node.sessions
            .write_file(&session_id, &q.path, reader)
            .await?,
    )
    .into_response())
}

/// A request body as an [`AsyncRead`]: a body that fails (the client went away) is a read
/// error, never an early end of file.
struct BodyReader {
    body: Body,
    rest: Bytes,
}

impl AsyncRead for BodyReader {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        loop {
            if !self.rest.is_empty() {
                let n = self.rest.len().min(buf.remaining());
                buf.put_slice(&self.rest.split_to(n));
                return Poll::Ready(Ok(()));
            }
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                None => return Poll::Ready(Ok(())),
                Some(Err(e)) => return Poll::Ready(Err(std::io::Error::other(e))),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.rest = data;
                    }
                }
            }
        }
    }
}
