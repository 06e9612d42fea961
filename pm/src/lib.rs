//! cynode-pm: the project-manager control plane (see ARCHITECTURE.md, "cynode-pm").
//!
//! - [`skills`]: skill packages, their registry, and the deterministic job builder.
//! - [`policy`]: the policy gate (Rego in-process with regorus, or an external OPA).
//! - [`llm`]: the model client, the reply contract and the prompt.
//! - [`session`], [`store`]: the durable session record in SQLite or PostgreSQL.
//! - [`driver`]: the loop; [`dispatch`]: the Worker API client; [`workers`]: the worker
//!   registry and job placement; [`artifacts`]: verified, content-addressed artifact storage.
//! - [`config`]: the PM's settings as plain values; [`bootstrap`]: builds a PM from them;
//!   [`local_worker`]: the worker `cynode-pm run` starts itself; [`inference_relay`]: how its
//!   agent jobs reach a hosted model whose key stays in the PM.
//! - [`service`]: the HTTP API of `cynode-pm serve`; [`metrics`], [`telemetry`]: what it
//!   exports; [`mcp`]: the same operations as MCP tools (`cynode-pm mcp`, `/v1/mcp`);
//!   [`app`]: what both share (state, tokens, operations, errors, the scheduler).
//!
//! The command line is the binary's (`src/cli/`): it turns flags into [`config`] values
//! and is the only place an error is an `anyhow::Error`.

pub mod app;
pub mod artifacts;
pub mod bootstrap;
pub mod config;
pub mod dispatch;
pub mod driver;
pub mod gateway;
pub mod inference_relay;
pub mod job_run;
pub mod llm;
pub mod local_worker;
pub mod mcp;
pub mod metrics;
pub mod policy;
pub mod service;
pub mod session;
pub mod settings_file;
pub mod skills;
pub mod store;
pub mod telemetry;
pub mod workers;
