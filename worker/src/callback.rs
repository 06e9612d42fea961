//! The per-job lifecycle socket: the SBA inside the sandbox POSTs its status to
//! `/job/status.sock`, a Unix socket in the job directory, so `in_progress` reaches the
//! node with no network in the sandbox.

use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use cynode_protocol::worker_api::{SbaLifecycle, SbaStatusCallback};
use tokio_util::sync::CancellationToken;

use crate::sandbox::STATUS_SOCKET;

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

/// Binds `<dir>/status.sock` (through `/proc/self/fd`, so long state paths still fit in a
/// socket address) and serves callbacks for `job_id`.
pub fn listen(dir: &Path, job_id: &str, on_status: OnStatus) -> std::io::Result<CallbackServer> {
    let path = dir.join(STATUS_SOCKET);
    let _ = std::fs::remove_file(&path);
    let dir_fd = std::fs::File::open(dir)?;
    let short = format!("/proc/self/fd/{}/{STATUS_SOCKET}", dir_fd.as_raw_fd());
    let std_listener = std::os::unix::net::UnixListener::bind(&short)?;
    drop(dir_fd);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777))?;
    std_listener.set_nonblocking(true)?;
    let listener = tokio::net::UnixListener::from_std(std_listener)?;
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
