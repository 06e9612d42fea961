//! cynode-worker: the Worker API node (see ARCHITECTURE.md). It runs each job in a sandbox
//! with timeouts, output caps and no network, records it durably, and keeps the result
//! until the caller acks it. It decides nothing about what a job should do.
//!
//! Layers, top to bottom (ARCHITECTURE.md has the rules):
//!
//! - [`http`]: the Worker API over HTTP (`http::app(node) -> Router`), auth, problem+json.
//! - [`node`]: sync and async jobs, backpressure, ack, restart reconciliation;
//!   [`replay`]: re-running a retained job for audits.
//! - [`sessions`]: long-lived session sandboxes (create, exec, end, reaper);
//!   [`workspace`]: per-task workspaces (seeding, tar export, changesets);
//!   [`executor`]: job directory, sandbox spec, result verification.
//! - [`backend`]: Podman/Docker ([`backend::engine`]) and bubblewrap ([`backend::bwrap`]);
//!   [`inference`]: the per-job inference proxy socket; [`callback`]: the SBA status
//!   socket; [`store`]: the node-local SQLite job records; [`disk_guard`]: the disk limit.
//! - Leaves: [`sandbox`] (the sandbox contract and the one spec builder),
//!   [`sandbox_files`] (host reads of sandbox-written files), [`image_ref`], [`config`],
//!   [`trace`].
//! - [`janitor`]: the process that removes a node's sandboxes once the node is gone.
//!
//! The command line (`serve`, `check`, `replay`) is the binary's (`src/cli.rs`), the only
//! place an error is an `anyhow::Error`.

pub mod backend;
pub mod callback;
pub mod config;
pub mod disk_guard;
pub mod disk_limit;
pub mod disk_usage;
pub mod egress;
pub mod executor;
pub mod fd_walk;
pub mod gateway_forward;
pub mod http;
pub mod image_ref;
pub mod inference;
pub mod janitor;
pub mod job_dir;
pub mod job_egress;
pub mod job_grants;
pub mod loopfs;
pub mod node;
pub mod open_unlinked;
pub mod remove_tree;
pub mod reown;
pub mod replay;
pub mod sandbox;
pub mod sandbox_files;
pub mod sessions;
pub mod store;
pub mod trace;
pub mod uid_pool;
pub mod workspace;
