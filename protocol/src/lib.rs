//! cynode-protocol: every contract the three programs share.
//!
//! This crate holds serde types and their validation only. It must never depend on an
//! async runtime, an HTTP stack or a database driver (a test checks `cargo tree`), so the
//! sandbox runner can link it statically and stay small.
//!
//! - [`job`]: job.json, the SBA's input, with strict parsing ([`job::JobSpec::from_json`]).
//! - [`result`]: result.json, the SBA's output, and the stable [`result::FailureCode`]s.
//! - [`worker_api`]: the Worker API v1 job and capacity bodies (upstream CyNodeAI compatible).
//! - [`worker_sessions`], [`worker_workspaces`], [`worker_health`]: the Worker API's
//!   session, workspace and readiness bodies; [`worker_session_io`] a session's files and
//!   streamed execs.
//! - [`worker_session_state`]: a session's suspend and resume, snapshots and forks.
//! - [`problem`]: the one problem+json error body of every HTTP API, and its `type` scheme.
//! - [`pm_api`]: the PM's HTTP API bodies (what an orchestrator sends and reads).
//! - [`llm`]: the PM's LLM output contract.
//! - [`session`]: the PM's durable session state model.
//! - [`schema`]: JSON Schemas generated from these types.
//! - [`time`]: the one RFC 3339 timestamp format; [`bearer`]: the one rule for a token
//!   kept in a file.

pub mod bearer;
pub mod egress;
pub mod error;
pub mod job;
pub mod llm;
pub mod pm_api;
pub mod pm_sandboxes;
pub mod problem;
pub mod result;
pub mod schema;
pub mod session;
pub mod time;
pub mod version;
pub mod worker_api;
pub mod worker_health;
pub mod worker_session_io;
pub mod worker_session_state;
pub mod worker_sessions;
pub mod worker_workspaces;

pub use error::{ValidationError, ValidationErrors};
pub use job::JobSpec;
pub use result::{FailureCode, JobResult};
