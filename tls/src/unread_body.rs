//! A response sent before its request's body was read to the end closes its HTTP/1
//! connection, and says so with `Connection: close`.
//!
//! A handler that refuses a request early (401, 404, 413, a bad query) leaves the rest of
//! the body on the wire. hyper then cannot reuse the connection and closes it once the
//! response is written, but without telling the client: a client that pools connections
//! may send its next request on that one and get a broken connection instead of an answer
//! (hyper's `IncompleteMessage`). With the header, the client knows not to reuse it.
//! HTTP/2 needs none of this: an unread body ends its own stream only.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, HttpBody};
use axum::http::{header, HeaderValue, Request, Response, Version};
use hyper::body::{Frame, SizeHint};

/// Whether a request's body was read to its end.
#[derive(Clone, Debug, Default)]
pub(crate) struct ReadToEnd(Arc<AtomicBool>);

impl ReadToEnd {
    fn done(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    fn set(&self) {
        self.0.store(true, Ordering::Release);
    }
}

/// A request body that records when it has been read to its end.
struct Tracked {
    inner: Body,
    seen: ReadToEnd,
}

impl HttpBody for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.seen.set();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// `req` with its body tracked, and the handle that tells whether it was read to the end
/// (already true for a request without a body).
pub(crate) fn track(req: Request<Body>) -> (Request<Body>, ReadToEnd) {
    let seen = ReadToEnd::default();
    if req.body().is_end_stream() {
        seen.set();
        return (req, seen);
    }
    let version = req.version();
    let (parts, inner) = req.into_parts();
    let body = Body::new(Tracked {
        inner,
        seen: seen.clone(),
    });
    let mut req = Request::from_parts(parts, body);
    *req.version_mut() = version;
    (req, seen)
}

/// Adds `Connection: close` to an HTTP/1 response whose request body was left unread.
pub(crate) fn close_if_unread<B>(version: Version, seen: &ReadToEnd, resp: &mut Response<B>) {
    if version < Version::HTTP_2 && !seen.done() {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
}

#[cfg(test)]
mod tests {
    use axum::routing::put;
    use axum::Router;
    use tower::ServiceExt;

    use super::*;

    async fn answer(app: &Router, body: &'static [u8]) -> Response<Body> {
        let req = Request::put("/").body(Body::from(body)).unwrap();
        let version = req.version();
        let (req, seen) = track(req);
        let mut resp = app.clone().oneshot(req).await.unwrap();
        close_if_unread(version, &seen, &mut resp);
        resp
    }

    #[tokio::test]
    async fn only_an_unread_body_closes_the_connection() {
        let refuses = Router::new().route("/", put(|| async { "refused" }));
        let reads = Router::new().route(
            "/",
            put(|b: axum::body::Bytes| async move { b.len().to_string() }),
        );
        let close = |r: &Response<Body>| r.headers().get(header::CONNECTION).cloned();
        assert_eq!(
            close(&answer(&refuses, b"x").await),
            Some(HeaderValue::from_static("close"))
        );
        assert_eq!(close(&answer(&reads, b"x").await), None);
        assert_eq!(close(&answer(&refuses, b"").await), None);
    }

    /// On a real listener, a pooled client that is refused before its body was read
    /// sends its next request on a fresh connection, every time.
    #[tokio::test]
    async fn a_pooled_client_refused_early_never_meets_a_closed_connection() {
        let app = Router::new()
            // A handler that holds the body while it works (a lookup, a check), then
            // refuses without reading it: the body is dropped in the same poll that
            // answers, after the whole body is on the wire.
            .route(
                "/refuse",
                put(|body: Body| async move {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    drop(body);
                    (axum::http::StatusCode::NOT_FOUND, "no")
                }),
            )
            .route("/ok", axum::routing::post(|| async { "ok" }));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let server = tokio::spawn(crate::serve_with(
            listener,
            app,
            None,
            crate::ListenerLimits::default(),
            stop.clone().cancelled_owned(),
        ));
        let client = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(10))
            .build()
            .unwrap();
        let big = vec![b'x'; 800 * 1024];
        for i in 0..40 {
            let r = client
                .put(format!("http://{addr}/refuse"))
                .body(big.clone())
                .send()
                .await
                .unwrap_or_else(|e| panic!("refused put {i}: {e:?}"));
            assert_eq!(r.status().as_u16(), 404);
            assert_eq!(r.headers().get(header::CONNECTION).unwrap(), "close");
            let r = client
                .post(format!("http://{addr}/ok"))
                .body("{}")
                .send()
                .await
                .unwrap_or_else(|e| panic!("request {i} after a refused put: {e:?}"));
            assert_eq!(r.text().await.unwrap(), "ok");
        }
        stop.cancel();
        tokio::time::timeout(std::time::Duration::from_secs(10), server)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}
