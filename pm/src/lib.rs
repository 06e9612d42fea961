//! cynode-pm: the project-manager control plane (see ARCHITECTURE.md, "cynode-pm").
//!
//! - [`skills`]: skill packages, their registry, and the deterministic job builder.
//! - [`policy`]: the policy gate (Rego in-process with regorus, or an external OPA).
//! - [`llm`]: the model client, the reply contract and the prompt.
//! - [`session`], [`store`]: the durable session record in SQLite or PostgreSQL.
//! - [`driver`]: the loop; [`dispatch`]: the Worker API client; [`workers`]: the worker
//!   registry and job placement; [`artifacts`]: verified, content-addressed artifact storage.
//! - [`cli`]: `cynode-pm skills …`, `policy check`, `run`, `sessions …`.

pub mod artifacts;
pub mod cli;
pub mod dispatch;
pub mod driver;
pub mod llm;
pub mod metrics;
pub mod policy;
pub mod run;
pub mod service;
pub mod session;
pub mod skills;
pub mod store;
pub mod telemetry;
pub mod workers;
