//! `cynode-pm mcp`: the PM as an MCP server on stdin/stdout (see [`cynode_pm::mcp`]), for
//! one tenant, on the workers of a workers file or one `--worker-endpoint` (as `serve`).

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use cynode_pm::bootstrap;
use cynode_pm::mcp::stdio::{serve_stdio, StdioConfig};

use super::args::PmArgs;
use super::Global;

/// Flags of `cynode-pm mcp` (plus the model, worker and state flags).
#[derive(Debug, Clone, Args)]
pub struct McpArgs {
    /// The tenant every tool call runs as (its sessions and artifacts; its policy
    /// settings: --tenant).
    #[arg(long, env = "CYNODE_TENANT_ID", default_value = "default")]
    pub tenant_id: String,
    /// Largest MCP message accepted (one JSON-RPC line).
    #[arg(long, default_value_t = 1 << 20)]
    pub max_message_bytes: usize,
    /// Sessions driven at once.
    #[arg(long, default_value_t = 8)]
    pub max_active_sessions: usize,
    /// Lease of a session on this process (another `mcp` or `serve` on the same
    /// datastore takes it over within this time if this one dies).
    #[arg(long, default_value_t = 30)]
    pub lease_seconds: u64,
    /// When stdin closes, how long sessions may take to finish their current step.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace_seconds: u64,
    #[command(flatten)]
    pub pm: PmArgs,
}

/// Serves MCP on stdio until the client closes it.
pub async fn mcp(args: &McpArgs, g: &Global) -> anyhow::Result<i32> {
    let workers = args.pm.workers.config()?.context(
        "mcp needs --workers-file (CYNODE_WORKERS_FILE) or --worker-endpoint (CYNODE_WORKER_ENDPOINT)",
    )?;
    let workers = bootstrap::workers(&workers)?;
    let pm = bootstrap::build_pm(&args.pm.config(g), workers).await?;
    serve_stdio(
        pm,
        StdioConfig {
            tenant: args.tenant_id.clone(),
            max_message_bytes: args.max_message_bytes,
            max_active_sessions: args.max_active_sessions,
            lease: Duration::from_secs(args.lease_seconds),
            shutdown_grace: Duration::from_secs(args.shutdown_grace_seconds),
        },
    )
    .await?;
    Ok(0)
}
