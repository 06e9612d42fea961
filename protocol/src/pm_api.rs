//! The PM's HTTP API bodies (`/v1/sessions…`, `/v1/jobs:validate`): what an orchestrator
//! sends to `cynode-pm serve` and reads back. Requests are closed
//! (`deny_unknown_fields`). With the `openapi` feature the types describe themselves to
//! utoipa, so the PM's OpenAPI document is generated from these same types.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `POST /v1/sessions` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// What to achieve.
    pub objective: String,
    /// Must equal the token's tenant when given.
    #[serde(default)]
    pub tenant: Option<String>,
    #[serde(default)]
    pub constraints: Constraints,
    #[serde(default)]
    pub workspace: Option<WorkspaceSpec>,
}

/// Budgets of the session (defaults: 30 turns, 20 jobs, 3 attempts per task, 1 h).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Constraints {
    pub max_turns: Option<u32>,
    pub max_jobs: Option<u32>,
    pub max_attempts_per_task: Option<u32>,
    pub wall_clock_seconds: Option<u64>,
}

/// Where the session's workspace on the worker is seeded from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct WorkspaceSpec {
    /// A directory on the worker's host, under one of its allowlisted seed roots. It is
    /// copied when the session's first job places the workspace on a worker; a path the
    /// worker refuses fails the session then (`internal_error`, naming the worker).
    pub seed_path: String,
}

/// A session as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SessionView {
    pub session_id: String,
    pub tenant: String,
    /// running, awaiting_input, completed, failed or canceled.
    pub status: String,
    pub objective: String,
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub plan: Value,
    pub active_job_id: Option<String>,
    /// Verified artifacts: path, sha256, size, job_id.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub artifacts: Value,
    /// The open question when status is awaiting_input.
    pub question: Option<String>,
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub deliverable: Value,
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub failure: Value,
    pub turn: u32,
    pub jobs_dispatched: u32,
    pub workspace_id: String,
    /// The registry id of the worker holding the workspace (set by the first job).
    pub worker_id: Option<String>,
}

/// One page of sessions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SessionList {
    pub sessions: Vec<SessionView>,
    /// Pass as `cursor` for the next page; absent on the last page.
    pub next_cursor: Option<String>,
}

/// `POST /v1/sessions/{id}/messages` body: the answer to the open question.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Answer {
    pub text: String,
}

/// `POST /v1/jobs:validate` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ValidateJob {
    pub skill_id: String,
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub inputs: Value,
    /// Used in the rendered job's ids (default `t1`).
    pub task_id: Option<String>,
}

/// The rendered job and the policy decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Validation {
    pub allowed: bool,
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub job: Value,
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub decision: Value,
}
