//! JSON Schemas generated from the wire types, checked in under `protocol/schemas/`.
//!
//! Regenerate with `CYNODE_REGENERATE_SCHEMAS=1 cargo test -p cynode-protocol --test all`;
//! the test `schemas_match_checked_in_files` fails on drift and prints that command.

use schemars::{schema_for, JsonSchema};

use crate::{
    job, llm, pm_api, problem, result, session, worker_api, worker_health, worker_sessions,
    worker_workspaces,
};

/// `(file name, pretty JSON)` for every published schema, in a fixed order.
pub fn all() -> Vec<(&'static str, String)> {
    vec![
        ("job.schema.json", render::<job::JobSpec>()),
        ("result.schema.json", render::<result::JobResult>()),
        (
            "worker-run-job-request.schema.json",
            render::<worker_api::RunJobRequest>(),
        ),
        (
            "worker-run-job-response.schema.json",
            render::<worker_api::RunJobResponse>(),
        ),
        (
            "worker-async-job-status.schema.json",
            render::<worker_api::AsyncJobStatus>(),
        ),
        (
            "worker-capacity.schema.json",
            render::<worker_api::WorkerCapacity>(),
        ),
        (
            "sba-status-callback.schema.json",
            render::<worker_api::SbaStatusCallback>(),
        ),
        (
            "worker-session-create-request.schema.json",
            render::<worker_sessions::CreateSessionRequest>(),
        ),
        (
            "worker-session-info.schema.json",
            render::<worker_sessions::SessionInfo>(),
        ),
        (
            "worker-session-exec-request.schema.json",
            render::<worker_sessions::ExecRequest>(),
        ),
        (
            "worker-session-exec-response.schema.json",
            render::<worker_sessions::ExecResponse>(),
        ),
        (
            "worker-workspace-create-request.schema.json",
            render::<worker_workspaces::CreateWorkspace>(),
        ),
        (
            "worker-workspace-info.schema.json",
            render::<worker_workspaces::WorkspaceInfo>(),
        ),
        (
            "worker-readiness.schema.json",
            render::<worker_health::Readiness>(),
        ),
        ("problem.schema.json", render::<problem::Problem>()),
        ("llm-output.schema.json", render::<llm::LlmOutput>()),
        (
            "session-state.schema.json",
            render::<session::SessionState>(),
        ),
        (
            "pm-create-session.schema.json",
            render::<pm_api::CreateSession>(),
        ),
        ("pm-session.schema.json", render::<pm_api::SessionView>()),
        (
            "pm-session-list.schema.json",
            render::<pm_api::SessionList>(),
        ),
        ("pm-answer.schema.json", render::<pm_api::Answer>()),
        (
            "pm-validate-job.schema.json",
            render::<pm_api::ValidateJob>(),
        ),
        ("pm-validation.schema.json", render::<pm_api::Validation>()),
    ]
}

fn render<T: JsonSchema>() -> String {
    let schema = schema_for!(T);
    let mut s =
        serde_json::to_string_pretty(&schema).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
    s.push('\n');
    s
}
