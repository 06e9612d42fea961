//! The per-job lifecycle socket: the SBA inside the sandbox POSTs its status to
//! `/job/status.sock`, a Unix socket in the job directory, so `in_progress` reaches the
//! node with no network in the sandbox.

use std::path::Path;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use cynode_protocol::worker_api::{SbaLifecycle, SbaStatusCallback};
use tokio_util::sync::CancellationToken;

use crate::sandbox::{bind_job_socket, STATUS_SOCKET};

/// Largest callback body (a completed callback carries the whole result).
const MAX_CALLBACK_BYTES: usize = 32 * 1024 * 1024;

/// What the node does with a callback.
pub type OnStatus = Arc<dyn Fn(SbaLifecycle) + Send + Sync>;

/// A running listener; dropping it stops the server and removes the socket.
pub struct CallbackServer {
    stop: CancellationToken,
    path: std::path::PathBuf,
}

impl Drop for CallbackServer {
    fn drop(&mut self) {
        self.stop.cancel();
        let _ = std::fs::remove_file(&self.path);
    }
}

#[derive(Clone)]
struct Ctx {
    job_id: String,
    on_status: OnStatus,
}

/// Binds `<dir>/status.sock` (see [`bind_job_socket`]) and serves callbacks for `job_id`.
pub fn listen(dir: &Path, job_id: &str, on_status: OnStatus) -> std::io::Result<CallbackServer> {
    let (path, listener) = bind_job_socket(dir, STATUS_SOCKET, None, 0o777)?;
    let ctx = Ctx {
        job_id: job_id.to_string(),
        on_status,
    };
    let app = Router::new()
        .route("/status", post(receive))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_CALLBACK_BYTES))
        .with_state(ctx);
    let stop = CancellationToken::new();
    let done = stop.clone();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { done.cancelled().await })
            .await;
    });
    Ok(CallbackServer { stop, path })
}

async fn receive(State(ctx): State<Ctx>, body: Bytes) -> StatusCode {
    let Ok(cb) = serde_json::from_slice::<SbaStatusCallback>(&body) else {
        return StatusCode::BAD_REQUEST;
    };
    if cb.job_id != ctx.job_id {
        tracing::warn!(job_id = %ctx.job_id, claimed = %cb.job_id, "callback for another job ignored");
        return StatusCode::FORBIDDEN;
    }
    (ctx.on_status)(cb.status);
    StatusCode::NO_CONTENT
}
