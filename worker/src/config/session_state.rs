//! The `session_state` section: how long suspended sessions and workspace snapshots are
//! kept, and each task's disk budget for snapshots.

use serde::{Deserialize, Serialize};

/// Suspended sessions and snapshots ([`crate::config::Config::session_state`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionStateConfig {
    /// A suspended session not resumed within this time ends (its workspace stays).
    pub suspended_retention_seconds: u64,
    /// A snapshot is deleted this long after it was taken.
    pub snapshot_retention_seconds: u64,
    /// The disk bytes (MiB) one task's snapshots may hold together; a snapshot past it is
    /// refused (`snapshot_budget_exceeded`).
    pub snapshot_budget_mb: u64,
    /// The most snapshots one task may hold.
    pub max_snapshots_per_task: u64,
}

impl Default for SessionStateConfig {
    fn default() -> Self {
        Self {
            suspended_retention_seconds: 7 * 24 * 3600,
            snapshot_retention_seconds: 7 * 24 * 3600,
            snapshot_budget_mb: 4096,
            max_snapshots_per_task: 64,
        }
    }
}
