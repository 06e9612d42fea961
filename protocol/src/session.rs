//! The PM's durable session state model.
//!
//! The objective is immutable; plan entries carry a version bumped on every change;
//! artifacts are referenced by sha256 and storage location; history is a list of events,
//! not a raw transcript.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::result::ArtifactRecord;

/// Status of a plan entry; `skipped`: closed without running, on purpose (the entry's
/// `reason` says why).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TaskStatus {
    Pending,
    // Read also as the seeds' `running` (docs/INTEROP.md, "The seeds' words").
    #[serde(alias = "running")]
    InProgress,
    // Read also as the seeds' `completed` (docs/INTEROP.md, "The seeds' words").
    #[serde(alias = "completed")]
    Done,
    Failed,
    Blocked,
    Skipped,
}

/// One entry of the plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PlanEntry {
    pub task_id: String,
    pub description: String,
    pub status: TaskStatus,
    /// Bumped on every change of this entry.
    pub version: u64,
    /// Why the task was closed without running (status `skipped`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Limits a session runs under.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionConstraints {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_turns: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_jobs: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts_per_task: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wall_clock_seconds: Option<u64>,
    #[serde(default)]
    pub ext_net_allowed: bool,
}

/// An artifact the session holds, verified by sha256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionArtifact {
    #[serde(flatten)]
    pub record: ArtifactRecord,
    pub job_id: String,
    /// Where the verified bytes are stored (a path or URL of the PM's store).
    pub location: String,
}

/// One event of the session's history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HistoryEvent {
    pub seq: u64,
    /// RFC 3339.
    pub at: String,
    pub kind: String,
    #[serde(default)]
    pub data: serde_json::Value,
}

/// The whole state of one PM session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionState {
    pub session_id: String,
    pub objective: String,
    pub constraints: SessionConstraints,
    pub plan: Vec<PlanEntry>,
    pub artifacts: Vec<SessionArtifact>,
    pub active_job_id: Option<String>,
    pub history: Vec<HistoryEvent>,
    /// Skill id → the skill version the session pinned when it first used it.
    pub skill_context: BTreeMap<String, String>,
    /// Free notes the model may keep through `state_patch`.
    #[serde(default)]
    pub notes: Vec<String>,
}
