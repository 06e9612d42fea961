//! A host tool run over sandbox-written content, in isolation: the node never runs a tool
//! (git, tar, a shell) with privilege over what a sandbox wrote (design §6), so such a run
//! goes through the backend ([`super::SandboxBackend::run_isolated`]) as an
//! [`IsolatedRun`]: the host's `/usr` read-only, the named directories read-only, a
//! cleared environment, the workspace's host uid, the node's limits and a bound on time,
//! output and address space. Today every backend serves it with bubblewrap
//! ([`super::bwrap::IsolatedBwrap`]), confined exactly as a job's bwrap sandbox.

use std::path::PathBuf;
use std::time::Duration;

use super::ResourceLimits;

/// One isolated run of a host tool.
#[derive(Debug, Clone)]
pub struct IsolatedRun {
    /// What the run is for (`changeset`): the sandbox's hostname and the prefix of its
    /// cgroup's name.
    pub purpose: &'static str,
    /// The host uid it runs as (the workspace's, [`crate::uid_pool`]).
    pub host_uid: u32,
    /// The memory, pids and CPU limits of its cgroup.
    pub limits: ResourceLimits,
    /// Host directories bound read-only: (host path, path inside).
    pub ro_binds: Vec<(PathBuf, String)>,
    /// The working directory inside.
    pub workdir: String,
    /// Its whole environment.
    pub env: Vec<(String, String)>,
    /// The command.
    pub argv: Vec<String>,
    /// Wall-clock bound; past it the run is killed.
    pub max_time: Duration,
    /// Bound on stdout; past it the run is killed.
    pub max_output: u64,
    /// `RLIMIT_AS` of the tool and whatever it starts.
    pub max_address_space: u64,
}

/// How an isolated run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IsolatedOutput {
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Why an isolated run gave no output.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IsolatedError {
    /// The sandbox could not be made or started, or reported its own failure.
    #[error("{0}")]
    Sandbox(String),
    /// Its stdout went past [`IsolatedRun::max_output`] bytes.
    #[error("output over {0} bytes")]
    TooLarge(u64),
    /// It ran past [`IsolatedRun::max_time`] (seconds).
    #[error("took longer than {0}s")]
    Timeout(u64),
}
