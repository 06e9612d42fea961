//! `cynode-pm mcp`: the MCP server on stdin/stdout for one local caller. Sessions it
//! creates are driven in this process by the same scheduler `serve` runs (leases in the
//! datastore), so a session left running when the client goes away is taken up by the
//! next `mcp` or `serve` on the same datastore. Log lines go to stderr; stdout carries
//! only MCP messages.

use std::sync::Arc;
use std::time::Duration;

use rmcp::transport::async_rw::AsyncRwTransport;
use rmcp::ServiceExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::server::PmMcp;
use crate::app::auth::{Tenant, Tokens};
use crate::app::{scheduler, AppState};
use crate::driver::Pm;

/// How `cynode-pm mcp` runs.
#[derive(Debug, Clone)]
pub struct StdioConfig {
    /// The tenant every call runs as (its sessions, its artifacts).
    pub tenant: String,
    /// Largest message accepted (one JSON-RPC line), as the HTTP API's body limit.
    pub max_message_bytes: usize,
    /// Sessions driven at once.
    pub max_active_sessions: usize,
    /// Lease of a session on this process.
    pub lease: Duration,
    /// When stdin closes, how long sessions may take to finish their current step.
    pub shutdown_grace: Duration,
}

/// Why the stdio server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum StdioError {
    #[error("mcp: {0}")]
    Mcp(String),
}

/// Serves MCP on stdin/stdout until the client closes stdin (or SIGTERM / SIGINT), then
/// hands every session it drives back (leases released).
pub async fn serve_stdio(pm: Pm, cfg: StdioConfig) -> Result<(), StdioError> {
    let pm = Arc::new(pm);
    let wake = Arc::new(Notify::new());
    let stop = CancellationToken::new();
    let host = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
    let schedule = scheduler::Schedule {
        owner: format!("mcp-{}-{}", host.trim(), std::process::id()),
        lease: cfg.lease.max(Duration::from_secs(1)),
        capacity: cfg.max_active_sessions.max(1),
        tick: Duration::from_millis(500),
        grace: cfg.shutdown_grace,
    };
    let scheduler = tokio::spawn(scheduler::run(
        Arc::clone(&pm),
        schedule,
        Arc::clone(&wake),
        stop.clone(),
    ));
    let st = Arc::new(AppState {
        pm,
        tokens: Tokens::default(),
        wake,
        stop: stop.clone(),
    });
    let transport = AsyncRwTransport::new_server(tokio::io::stdin(), tokio::io::stdout())
        .with_max_line_length(cfg.max_message_bytes);
    let tools = PmMcp::for_tenant(Arc::clone(&st), Tenant(cfg.tenant.clone()));
    tracing::info!(tenant = %cfg.tenant, "cynode-pm mcp on stdio");
    let result = match tools.serve(transport).await {
        Ok(running) => {
            let ct = running.cancellation_token();
            tokio::select! {
                r = running.waiting() => r.map(|_| ()).map_err(|e| StdioError::Mcp(e.to_string())),
                _ = signal() => { ct.cancel(); Ok(()) }
            }
        }
        Err(e) => Err(StdioError::Mcp(e.to_string())),
    };
    stop.cancel();
    if let Err(e) = scheduler.await {
        tracing::warn!(error = %e, "the scheduler ended abnormally");
    }
    tracing::info!("cynode-pm mcp stopped");
    result
}

async fn signal() {
    let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
