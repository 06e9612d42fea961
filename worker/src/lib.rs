//! cynode-worker: the Worker API node (see ARCHITECTURE.md). It runs each job in a sandbox
//! with timeouts, output caps and no network, records it durably, and keeps the result
//! until the caller acks it. It decides nothing about what a job should do.
//!
//! - [`api`]: the HTTP surface (`app(node) -> Router`), auth, problem+json errors.
//! - [`node`]: sync and async jobs, backpressure, ack, restart reconciliation.
//! - [`executor`]: job directory, sandbox spec, result verification.
//! - [`backend`]: Podman/Docker ([`backend::engine`]) and bubblewrap ([`backend::bwrap`]).
//! - [`store`]: the node-local SQLite job records; [`callback`]: the SBA status socket.
//! - [`inference`]: the per-job inference proxy socket (allowed models, caps, the key).
//! - [`workspace`]: per-task workspaces: seeding, tar export, changesets.
//! - [`sessions`]: long-lived session sandboxes (create, exec, end, reaper).
//! - [`replay`]: re-running a retained job for audits.
//! - [`config`], [`cli`]: configuration and the `serve`/`check`/`replay` commands.

pub mod backend;
pub mod callback;
pub mod cli;
pub mod config;
pub mod disk_guard;
pub mod executor;
pub mod http;
pub mod image_ref;
pub mod inference;
pub mod node;
pub mod replay;
pub mod sandbox;
pub mod sandbox_files;
pub mod sessions;
pub mod store;
pub mod trace;
pub mod workspace;
