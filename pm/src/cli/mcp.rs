//! `cynode-pm mcp`: the PM as an MCP server on stdin/stdout (see [`cynode_pm::mcp`]), for
//! one tenant, on the workers of a workers file or one `--worker-endpoint` (as `serve`),
//! or, with neither, on a local worker it starts and stops as `run` does (its workspaces
//! seeded from under `--workspace-root`; a keyed model's agent jobs through the
//! inference relay). One line in an MCP client's configuration is then enough:
//! `cynode-pm mcp --workspace-root /path/to/project`.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use cynode_pm::bootstrap;
use cynode_pm::mcp::stdio::{serve_stdio, StdioConfig};

use super::args::{LocalWorkerArgs, PmArgs};
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
    /// Without worker flags: the directory under which the local worker may seed
    /// workspaces (`skills.run`'s `workspace`, `sessions.create`'s `workspace.seed_path`).
    /// Without it, jobs start in empty workspaces.
    #[arg(long, env = "CYNODE_MCP_WORKSPACE_ROOT")]
    pub workspace_root: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub pm: PmArgs,
    #[command(flatten)]
    pub local: LocalWorkerArgs,
}

/// Serves MCP on stdio until the client closes it.
pub async fn mcp(args: &McpArgs, g: &Global) -> anyhow::Result<i32> {
    let seed = match &args.workspace_root {
        Some(w) => Some(
            std::fs::canonicalize(w)
                .with_context(|| format!("--workspace-root {}", w.display()))?,
        ),
        None => None,
    };
    std::fs::create_dir_all(&args.pm.store.state_dir)?;
    // Declared before the local worker: dropped after it.
    let relay = super::run::inference_relay(&args.pm)?;
    let (workers, local) = super::run::worker_pool(
        &args.pm.workers,
        || {
            let tenant = bootstrap::tenant(g.tenant.as_deref())?;
            args.local.config(
                g,
                &args.pm.store,
                &args.pm.workers,
                seed.clone(),
                tenant.egress.allow,
                args.pm.model.local_inference(relay.as_ref()),
            )
        },
        relay.as_ref(),
        // stdout carries MCP messages only.
        &|line| eprintln!("{line}"),
    )?;
    let pm = bootstrap::build_pm(&args.pm.config(g), workers).await?;
    let served = serve_stdio(
        pm,
        StdioConfig {
            tenant: args.tenant_id.clone(),
            max_message_bytes: args.max_message_bytes,
            max_active_sessions: args.max_active_sessions,
            lease: Duration::from_secs(args.lease_seconds),
            shutdown_grace: Duration::from_secs(args.shutdown_grace_seconds),
        },
    )
    .await;
    // The local worker stops now (its keeper's release), not at a later drop.
    drop(local);
    drop(relay);
    served?;
    Ok(0)
}
