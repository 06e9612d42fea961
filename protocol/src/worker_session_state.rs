//! Worker API bodies for a session's state (this project's extension): suspend and
//! resume (`POST /v1/worker/sessions/{id}:suspend`, `…:resume`), snapshots of its
//! workspace (`POST`/`GET …/{id}/snapshots`, `DELETE /v1/worker/snapshots/{snapshot_id}`)
//! and sessions started from one (`from_snapshot` in the create request).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What the node does with a session idle past its `idle_timeout_seconds`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnIdle {
    /// End it (the default).
    #[default]
    End,
    /// Suspend it: its sandbox stops, its workspace and settings are kept for `:resume`.
    Suspend,
}

/// `POST /v1/worker/sessions/{id}:suspend` request (the body may be empty).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SuspendRequest {
    /// Keep the session's processes (a checkpoint of their memory). Refused, with the
    /// named error [`MEMORY_SUSPEND_UNSUPPORTED`], where the node's engine cannot
    /// checkpoint; never downgraded to a filesystem suspend.
    #[serde(default)]
    pub memory: bool,
}

/// The named error of a memory suspend the node cannot do.
pub const MEMORY_SUSPEND_UNSUPPORTED: &str = "memory_suspend_unsupported";
/// The named error of an exec on a suspended session.
pub const SESSION_SUSPENDED: &str = "session_suspended";
/// The named error of a snapshot of a workspace that is no disk volume.
pub const SNAPSHOT_UNSUPPORTED: &str = "snapshot_unsupported";
/// The named error of a snapshot over the task's snapshot disk budget.
pub const SNAPSHOT_BUDGET_EXCEEDED: &str = "snapshot_budget_exceeded";
/// The named error of a workspace whose tree cannot be hashed within the node's bounds.
pub const WORKSPACE_UNHASHABLE: &str = "workspace_unhashable";

/// How a workspace image was copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WorkspaceCopy {
    /// A copy-on-write clone (`FICLONE`): no data block copied.
    Reflink,
    /// The backing filesystem cannot clone: the image's data extents were copied
    /// (bounded by the node's disk limit).
    Copy,
}

/// A snapshot of a session's workspace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotInfo {
    pub version: u32,
    /// 128 random bits: unguessable.
    pub snapshot_id: String,
    pub session_id: String,
    pub task_id: String,
    pub workspace_id: String,
    /// `sha256:` and the hex digest of the workspace's tree: names, types, modes, file
    /// contents and link targets (no owners, no times), links never followed.
    pub tree_hash: String,
    /// Disk bytes the snapshot holds (counted against the task's snapshot budget).
    pub bytes: u64,
    /// How the workspace's image was copied.
    pub copy: WorkspaceCopy,
    pub created_at: String,
    /// When the node deletes it (its `session_state.snapshot_retention_seconds`).
    pub expires_at: String,
}

/// `GET /v1/worker/sessions/{id}/snapshots` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotList {
    pub version: u32,
    pub snapshots: Vec<SnapshotInfo>,
}
