//! cynode-sba: the deterministic runner that executes a job.json inside the sandbox.
//!
//! It never plans and never holds secrets: it validates the job completely, runs its steps
//! confined to the workspace, and always leaves a complete result.json.
//!
//! - [`cli`] / [`runner`]: command line, job lifecycle, result writing.
//! - [`agent`]: agent mode, the model loop over the same steps (via [`http`]).
//! - [`step_runner`]: one step run and recorded, for the runner and the agent alike.
//! - [`steps`]: the six step types; [`patch`] is the native diff engine.
//! - [`confine`] / [`walk`]: every path resolved beneath the workspace root.
//! - [`process`] / [`capture`]: child processes under deadlines with bounded output.
//! - [`artifacts`], [`lifecycle`], [`result_file`]: what leaves the sandbox; [`http`] is
//!   the tiny HTTP/1.1 client for callbacks and inference.

pub mod agent;
pub mod artifacts;
pub mod capture;
pub mod cli;
pub mod confine;
pub mod error;
pub mod http;
pub mod launch;
pub mod lifecycle;
pub mod patch;
pub mod process;
pub mod result_file;
pub mod runner;
pub mod step_runner;
pub mod steps;
pub mod walk;
