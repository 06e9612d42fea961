//! The per-job lifecycle socket: the SBA inside the sandbox POSTs its status to
//! `/job/status.sock`, a Unix socket in the job directory, so `in_progress` reaches the
//! node with no network in the sandbox.
//!
//! The job is the only client and may be hostile: the socket is served by the bounded
//! accept loop (`cynode_tls::serve_unix`: the node's `listener` timeouts and header cap,
//! `limits.job_socket_connections` connections), a body is read within
//! [`BODY_READ_TIMEOUT`] and only up to [`MAX_CALLBACK_BYTES`] (413 above; the node needs
//! only `status` and `job_id`, and reads the result from result.json).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use cynode_protocol::worker_api::SbaLifecycle;
use cynode_tls::ListenerLimits;
use serde::Deserialize;

use crate::sandbox::{serve_job_socket, JobSocket, STATUS_SOCKET};

/// Largest callback body read. An `in_progress` callback is a few hundred bytes; a
/// `completed` one carries the whole result, which the node does not use (a larger one is
/// answered 413, and the result is read from result.json all the same).
pub const MAX_CALLBACK_BYTES: usize = 1024 * 1024;

/// A callback body must arrive within this time (408 otherwise).
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// What the node does with a callback.
pub type OnStatus = Arc<dyn Fn(SbaLifecycle) + Send + Sync>;

/// A running listener; dropping it stops the server and removes the socket.
pub type CallbackServer = JobSocket;

#[derive(Clone)]
struct Ctx {
    job_id: String,
    on_status: OnStatus,
}

/// Binds `<dir>/status.sock` (see [`bind_job_socket`]) and serves callbacks for `job_id`,
/// with connections bounded by `limits`.
pub fn listen(
    dir: &Path,
    job_id: &str,
    on_status: OnStatus,
    limits: &ListenerLimits,
) -> std::io::Result<CallbackServer> {
    let ctx = Ctx {
        job_id: job_id.to_string(),
        on_status,
    };
    let app = Router::new()
        .route("/status", post(receive))
        .with_state(ctx);
    serve_job_socket(dir, STATUS_SOCKET, None, 0o777, app, limits)
}

/// What the node reads of a callback (`SbaStatusCallback` without its result).
#[derive(Deserialize)]
struct Callback {
    status: SbaLifecycle,
    job_id: String,
}

async fn receive(State(ctx): State<Ctx>, body: Body) -> StatusCode {
    let body = match tokio::time::timeout(
        BODY_READ_TIMEOUT,
        axum::body::to_bytes(body, MAX_CALLBACK_BYTES),
    )
    .await
    {
        Ok(Ok(b)) => b,
        Ok(Err(_)) => return StatusCode::PAYLOAD_TOO_LARGE,
        Err(_) => return StatusCode::REQUEST_TIMEOUT,
    };
    let Ok(cb) = serde_json::from_slice::<Callback>(&body) else {
        return StatusCode::BAD_REQUEST;
    };
    if cb.job_id != ctx.job_id {
        tracing::warn!(job_id = %ctx.job_id, claimed = %cb.job_id, "callback for another job ignored");
        return StatusCode::FORBIDDEN;
    }
    (ctx.on_status)(cb.status);
    StatusCode::NO_CONTENT
}
