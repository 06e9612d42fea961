//! The one accept loop of every server in the workspace (TCP with or without TLS, and the
//! per-job Unix sockets): hyper-util connections bounded by [`ListenerLimits`].
//!
//! - At most `max_connections` at once, through [`Slots`]: when full, the connection
//!   that has waited longest with no request in flight is closed to make room; when all
//!   have a request in flight, the new one is answered 503 (plain) or closed (TLS) at
//!   once, so the descriptors a listener holds stay bounded whatever the clients do.
//! - A request head must arrive within `header_read_timeout` (hyper's HTTP/1 timer, and
//!   from accept to the first request here, which also covers HTTP/2 and the protocol
//!   sniffing before either); a connection with no request in flight for `idle_timeout`
//!   is closed; heads are capped at `max_header_bytes` (431 above).
//! - A TLS handshake must finish within `tls_handshake_timeout`.
//! - A response sent before its request's body was read closes its HTTP/1 connection and
//!   says so ([`crate::unread_body`]).
//! - Shutdown stops accepting, lets in-flight requests finish for `grace`, then closes
//!   what is left; dropping the serving future closes every connection at once.

use std::future::Future;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use crate::limits::ListenerLimits;
use crate::slots::{Slot, Slots};
use crate::unread_body;

/// The TLS config a listener uses for its next handshake (replaced on reload).
pub(crate) type TlsConfig = Arc<RwLock<Arc<ServerConfig>>>;

/// Streams in HTTP/2 served at once on one connection.
const MAX_STREAMS: u32 = 64;

/// What a refused plain-HTTP connection is told (RFC 9457 problem details).
const REFUSED: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/problem+json\r\nConnection: close\r\nRetry-After: 1\r\nContent-Length: 139\r\n\r\n{\"type\":\"about:blank\",\"title\":\"Service Unavailable\",\"status\":503,\"detail\":\"too many connections: every connection has a request in flight\"}";

/// A listener the loop accepts from.
pub(crate) trait Listen: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn next(&mut self) -> impl Future<Output = std::io::Result<Self::Io>> + Send;
    /// Best effort, never blocking: tells a refused client why before it is closed.
    fn refuse(io: &Self::Io);
}

impl Listen for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;

    async fn next(&mut self) -> std::io::Result<Self::Io> {
        let (s, _) = self.accept().await?;
        let _ = s.set_nodelay(true);
        Ok(s)
    }

    fn refuse(io: &Self::Io) {
        let _ = io.try_read(&mut [0; 4096]);
        let _ = io.try_write(REFUSED);
    }
}

impl Listen for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;

    async fn next(&mut self) -> std::io::Result<Self::Io> {
        Ok(self.accept().await?.0)
    }

    fn refuse(io: &Self::Io) {
        let _ = io.try_write(REFUSED);
    }
}

/// Serves `app` on `listener` until `shutdown` resolves (see the module doc).
pub(crate) async fn run<L: Listen>(
    mut listener: L,
    app: Router,
    tls: Option<TlsConfig>,
    limits: ListenerLimits,
    grace: Duration,
    shutdown: impl Future<Output = ()> + Send,
) {
    let slots = Slots::new(limits.connections());
    let builder = Arc::new(builder(&limits));
    let draining = CancellationToken::new();
    let closing = CancellationToken::new();
    // Dropping this future (an aborted task) closes every connection too.
    let _close_on_drop = closing.clone().drop_guard();
    let tasks = TaskTracker::new();
    let limits = Arc::new(limits);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            r = listener.next() => r,
        };
        let io = match accepted {
            Ok(io) => io,
            Err(e) => {
                // Out of descriptors or a connection reset before accept: wait a moment
                // rather than spin.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let slot = match slots.admit() {
            Ok(s) => s,
            Err(refused) => {
                if tls.is_none() {
                    L::refuse(&io);
                }
                // Logged at the 1st, 2nd, 4th, 8th… refusal: a flood cannot flood the log.
                if refused.is_power_of_two() {
                    tracing::warn!(
                        max_connections = limits.connections(),
                        refused_total = refused,
                        "connection refused: every connection has a request in flight"
                    );
                }
                continue;
            }
        };
        let conn = Conn {
            slot,
            app: app.clone(),
            builder: Arc::clone(&builder),
            limits: Arc::clone(&limits),
            draining: draining.clone(),
            closing: closing.clone(),
        };
        let tls = tls
            .as_ref()
            .map(|c| Arc::clone(&c.read().unwrap_or_else(PoisonError::into_inner)));
        tasks.spawn(conn.run(io, tls));
    }
    draining.cancel();
    tasks.close();
    if tokio::time::timeout(grace, tasks.wait()).await.is_err() {
        closing.cancel();
        tasks.wait().await;
    }
}

fn builder(limits: &ListenerLimits) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout())
        .max_buf_size(limits.header_bytes())
        .keep_alive(true);
    b.http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.header_bytes()).unwrap_or(u32::MAX))
        .max_concurrent_streams(MAX_STREAMS);
    b
}

/// One accepted connection and what it needs.
struct Conn {
    slot: Slot,
    app: Router,
    builder: Arc<auto::Builder<TokioExecutor>>,
    limits: Arc<ListenerLimits>,
    draining: CancellationToken,
    closing: CancellationToken,
}

impl Conn {
    async fn run<I>(self, io: I, tls: Option<Arc<ServerConfig>>)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let Some(tls) = tls else {
            return self.serve(io).await;
        };
        let handshake = tokio::time::timeout(
            self.limits.tls_handshake_timeout(),
            tokio_rustls::TlsAcceptor::from(tls).accept(io),
        );
        let stream = tokio::select! {
            r = handshake => r,
            () = self.slot.evicted() => return,
            () = self.closing.cancelled() => return,
        };
        match stream {
            Ok(Ok(s)) => self.serve(s).await,
            Ok(Err(e)) => tracing::debug!(error = %e, "tls handshake failed"),
            Err(_) => tracing::debug!("tls handshake timed out"),
        }
    }

    async fn serve<I>(self, io: I)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let activity = self.slot.activity();
        let app = self.app.clone();
        let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let in_flight = activity.request();
            let app = app.clone();
            async move {
                let version = req.version();
                let (req, seen) = unread_body::track(req.map(Body::new));
                let mut resp = app.oneshot(req).await?;
                unread_body::close_if_unread(version, &seen, &mut resp);
                // In flight until the response body is done (or dropped): a stream of
                // events keeps its connection busy, not idle.
                Ok::<_, std::convert::Infallible>(resp.map(|b| {
                    Body::new(b.map_frame(move |f| {
                        let _ = &in_flight;
                        f
                    }))
                }))
            }
        });
        let conn = self.builder.serve_connection(TokioIo::new(io), service);
        tokio::pin!(conn);
        let (first, idle) = (
            self.limits.header_read_timeout(),
            self.limits.idle_timeout(),
        );
        let mut draining = false;
        loop {
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                    return;
                }
                () = self.draining.cancelled(), if !draining => {
                    draining = true;
                    conn.as_mut().graceful_shutdown();
                }
                () = self.slot.evicted() => return,
                () = self.slot.idle(first, idle) => return,
                () = self.closing.cancelled() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::REFUSED;

    #[test]
    fn the_refusal_is_one_well_formed_response() {
        let text = std::str::from_utf8(REFUSED).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("Content-Length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(length, body.len());
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["status"], 503);
    }
}
