//! Worker API session bodies (this project's extension): a sandbox that lives across
//! several commands of one task. `POST /v1/worker/sessions` takes a
//! [`CreateSessionRequest`]; create, show and end answer a [`SessionInfo`];
//! `POST …/{session_id}/exec` takes an [`ExecRequest`] and answers an [`ExecResponse`].
//! A session may have the node's egress proxy (`network_policy: restricted`, as a job):
//! each exec's response lists that exec's attempts, the session's info their total.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::egress::EgressRecord;
use crate::worker_api::{NetworkPolicy, Truncated, WorkerJobStatus};

/// `POST /v1/worker/sessions` request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSessionRequest {
    pub version: u32,
    pub session_id: String,
    pub task_id: String,
    /// Absent is the same as empty, which is refused naming `image`.
    #[serde(default)]
    pub image: String,
    /// The workspace mounted at /workspace; defaults to `task_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_id: Option<String>,
    /// Ends the session after this long without a command (default 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_seconds: Option<u64>,
    /// Ends the session this long after it was created (default 3600, capped by the
    /// node's `limits.max_timeout_seconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_lifetime_seconds: Option<u64>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Network, with a job's `sandbox.network_policy` values and rules: `none` (the
    /// default) is no network at all; `restricted` is the node's egress proxy for the
    /// session's whole life; `allow` is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_policy: Option<NetworkPolicy>,
    /// With `restricted`: a narrowing of the node's `egress.allow`, as a job's
    /// `sandbox.egress_allow` (never a widening). Absent: the node's whole list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_allow: Option<Vec<String>>,
    /// The node's models for the session's commands, as a job's `sandbox.use_inference`:
    /// the node's inference listener at `127.0.0.1:11434` inside the session's network
    /// namespace (`OPENAI_BASE_URL`, `OPENAI_API_KEY`, `OLLAMA_BASE_URL` set), the node's
    /// `inference.models` allowed. Refused on a node without an upstream or whose backend
    /// cannot bind the listener.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_inference: Option<bool>,
    /// What the node does once the session is idle: `end` (the default) or `suspend`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_idle: Option<crate::worker_session_state::OnIdle>,
    /// Start from this snapshot of one of the task's sessions: the new workspace
    /// (`workspace_id`, which must not exist yet) is a copy of the snapshot's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
}

/// `POST /v1/worker/sessions/{session_id}/exec` request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    pub version: u32,
    /// argv, run as uid 1000 in /workspace.
    pub command: Vec<String>,
    /// min(this or `limits.default_timeout_seconds`, `limits.max_timeout_seconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u64>,
    /// Added to the session's env for this command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Answer an `ExecStarted` at once and keep the output for `…/execs/{exec_id}/output`
    /// (see `worker_session_io`), instead of the `ExecResponse` once the command ended.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stream: bool,
    /// Give the command a standard input written through `…/execs/{exec_id}/stdin`
    /// (streamed execs only); without it the command's stdin is closed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stdin: bool,
}

/// Whether a session can still run commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SessionStatus {
    Running,
    /// Its sandbox is stopped; workspace and settings are kept for `:resume`.
    Suspended,
    Ended,
}

/// Why a session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SessionEndReason {
    /// `POST …/end`.
    Requested,
    IdleTimeout,
    MaxLifetime,
    /// The keep-alive container is gone (a command killed it, or the engine did).
    SandboxExited,
}

impl SessionEndReason {
    /// The wire name (`idle_timeout`…).
    pub fn as_str(self) -> &'static str {
        match self {
            SessionEndReason::Requested => "requested",
            SessionEndReason::IdleTimeout => "idle_timeout",
            SessionEndReason::MaxLifetime => "max_lifetime",
            SessionEndReason::SandboxExited => "sandbox_exited",
        }
    }
}

/// A session as create, show and end answer it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionInfo {
    pub version: u32,
    pub session_id: String,
    pub task_id: String,
    pub workspace_id: String,
    pub image: String,
    pub status: SessionStatus,
    pub created_at: String,
    /// When the max lifetime ends the session at the latest.
    pub expires_at: String,
    /// The effective limits, after defaults and caps.
    pub idle_timeout_seconds: u64,
    pub max_lifetime_seconds: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_reason: Option<SessionEndReason>,
    /// The session's egress so far; absent when it has no proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<SessionEgress>,
    /// A session started `from_snapshot`: how its workspace was made from the snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_copy: Option<crate::worker_session_state::WorkspaceCopy>,
}

/// A session's egress over its life: its attempts through the node's proxy, up to the
/// node's bound (`egress.max_audit_records`), and the bytes counted against its budget.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionEgress {
    pub records: Vec<EgressRecord>,
    /// Attempts beyond the bound, counted but not listed.
    #[serde(default)]
    pub dropped: u64,
    /// Bytes carried both ways, all connections (the session's `egress.max_total_bytes`
    /// budget counts these).
    #[serde(default)]
    pub bytes: u64,
}

/// `POST /v1/worker/sessions/{session_id}/exec` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecResponse {
    pub version: u32,
    pub session_id: String,
    pub status: WorkerJobStatus,
    /// -1 when the command timed out or could not run.
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
    pub truncated: Truncated,
    pub started_at: String,
    pub ended_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// The attempts made through the session's egress proxy during this exec (as a job
    /// response's `egress`), up to the node's bound; absent when the session has no proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<Vec<EgressRecord>>,
    /// This exec's attempts beyond that bound, counted but not listed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub egress_dropped: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_reason_names_match_the_wire() {
        for r in [
            SessionEndReason::Requested,
            SessionEndReason::IdleTimeout,
            SessionEndReason::MaxLifetime,
            SessionEndReason::SandboxExited,
        ] {
            assert_eq!(serde_json::to_value(r).unwrap(), r.as_str());
        }
    }
}
