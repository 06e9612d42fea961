//! The tools of `cynode-pm mcp`: what each one takes (a closed JSON Schema, generated
//! from the same types that parse the arguments) and what it calls in the service layer
//! ([`crate::app::ops`]), so MCP clients get the HTTP API's tenant check, policy and
//! limits, not a second copy of them.
//!
//! | tool | arguments | result |
//! |---|---|---|
//! | `sessions.create` | objective, constraints?, workspace?, tenant?, idempotency_key? | the session |
//! | `sessions.get` | session_id | the session |
//! | `sessions.events` | session_id, after?, wait_seconds? | events after `after`, `next_after`, `done` |
//! | `sessions.answer` | session_id, text | the session |
//! | `sessions.cancel` | session_id | the session |
//! | `skills.list` | – | the catalog |
//! | `skills.show` | skill_id | the skill's manifest |
//! | `artifacts.get` | session_id, sha256 | the verified bytes (base64), their sha256 and size |
//! | `sessions.report` | session_id | the evidence report the PM verified, and its text |
//! | `skills.run` | skill_id, inputs, workspace? | one job without the loop ([`crate::job_run`]): its result, every artifact verified (stdio only: [`LOCAL_ONLY`]) |
//! | `sandbox.*` | see [`super::sandbox_tools`] | a worker's session for the tenant: exec, streamed output, files, suspend, resume, snapshots, forks |

use std::time::Duration;

use base64::Engine;
use rmcp::schemars::{self, JsonSchema};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use cynode_protocol::pm_api::{Constraints, CreateSession, WorkspaceSpec};

use super::tool_kit::{parse, tool};
pub use super::tool_kit::{ToolError, ToolSpec};
use crate::app::auth::Tenant;
use crate::app::ops;
use crate::app::ops::session_view;
use crate::app::problem::Problem;
use crate::app::AppState;

/// How long `sessions.events` may wait for a new event, at most.
pub const MAX_WAIT_SECONDS: u64 = 30;
/// How often a waiting `sessions.events` looks for new events.
const POLL: Duration = Duration::from_millis(200);
/// The largest artifact `artifacts.get` returns inline (base64 in the JSON reply); a
/// larger one is fetched through the HTTP API.
pub const MAX_INLINE_ARTIFACT_BYTES: usize = 8 << 20;

/// Tools only `cynode-pm mcp` on stdio offers (they run on this machine's workers and
/// read this machine's paths; `/v1/mcp` of `serve` does not list them).
pub const LOCAL_ONLY: &[&str] = &["skills.run"];

/// `sessions.create`: the body of `POST /v1/sessions` and its Idempotency-Key.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateArgs {
    /// What to achieve.
    pub objective: String,
    /// Must equal the caller's tenant when given.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Budgets (defaults: 30 turns, 20 jobs, 3 attempts per task, 1 h).
    #[serde(default)]
    pub constraints: Constraints,
    /// Where the workspace is seeded from (a directory under a seed root of the worker).
    #[serde(default)]
    pub workspace: Option<WorkspaceSpec>,
    /// The same key (for the same tenant) always names the same session.
    #[serde(default)]
    pub idempotency_key: Option<String>,
}

/// The tools that name one session.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionArgs {
    pub session_id: String,
}

/// `sessions.events`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EventsArgs {
    pub session_id: String,
    /// Only events with a larger sequence number (default 0: all).
    #[serde(default)]
    pub after: u64,
    /// Wait up to this many seconds (at most 30) for an event when none is there yet.
    #[serde(default)]
    pub wait_seconds: u64,
}

/// `sessions.answer`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AnswerArgs {
    pub session_id: String,
    /// The answer to the session's open question.
    pub text: String,
}

/// `skills.show`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SkillArgs {
    pub skill_id: String,
}

/// `skills.list`: no arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoArgs {}

/// `artifacts.get`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ArtifactArgs {
    pub session_id: String,
    /// The artifact's sha256 (lowercase hex), as the session lists it.
    pub sha256: String,
}

/// `skills.run`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SkillRunArgs {
    pub skill_id: String,
    /// The skill's inputs (checked against its inputs schema).
    #[serde(default)]
    pub inputs: Value,
    /// An absolute directory the job's workspace is seeded from (a copy; the directory is
    /// not changed). It must be under the worker's seed root (`mcp --workspace-root`).
    #[serde(default)]
    pub workspace: Option<String>,
}

/// Every tool of `cynode-pm mcp`, in a fixed order.
pub fn catalog() -> Vec<ToolSpec> {
    vec![
        tool::<CreateArgs>("sessions.create", "Create a session that works toward an objective (the PM plans, runs sandboxed jobs and reports). Idempotent with idempotency_key.", false),
        tool::<SessionArgs>("sessions.get", "A session: status, plan, active job, verified artifacts, open question, deliverable.", true),
        tool::<EventsArgs>("sessions.events", "The session's events after `after` (waiting up to wait_seconds for one); `done` once the session ended.", true),
        tool::<AnswerArgs>("sessions.answer", "Answer the session's open question.", false),
        tool::<SessionArgs>("sessions.cancel", "Cancel the session and stop its running job.", false),
        tool::<NoArgs>("skills.list", "The skill catalog: id, version, description and inputs schema of each skill.", true),
        tool::<SkillArgs>("skills.show", "One skill's manifest.", true),
        tool::<ArtifactArgs>("artifacts.get", "The bytes of one of the session's artifacts (base64), verified against their sha256.", true),
        tool::<SessionArgs>("sessions.report", "The session's evidence report: per task, its jobs and what each verifiably found (steps, verified artifacts), then the model's summary; and the same as text.", true),
        tool::<SkillRunArgs>("skills.run", "Run one skill as a single job without the model loop: inputs checked, policy-checked, run in a sandbox on a copy of `workspace`, every artifact verified against its sha256.", false),
    ]
    .into_iter()
    .chain(super::sandbox_tools::catalog())
    .collect()
}

/// Runs `tool` with `args` as `tenant`.
pub async fn call(
    st: &AppState,
    tenant: &Tenant,
    tool: &str,
    args: &Map<String, Value>,
) -> Result<Value, ToolError> {
    if let Some(r) = super::sandbox_tools::call(st, tenant, tool, args).await {
        return r;
    }
    match tool {
        "sessions.create" => {
            let a: CreateArgs = parse(tool, args)?;
            let req = CreateSession {
                objective: a.objective,
                tenant: a.tenant,
                constraints: a.constraints,
                workspace: a.workspace,
            };
            let c = ops::create_session(st, tenant, &req, a.idempotency_key.as_deref()).await?;
            Ok(json!({ "created": c.created, "session": session_view(&c.record) }))
        }
        "sessions.get" => {
            let a: SessionArgs = parse(tool, args)?;
            let (rec, _) = ops::owned(st, tenant, &a.session_id).await?;
            Ok(json!(session_view(&rec)))
        }
        "sessions.events" => {
            let a: EventsArgs = parse(tool, args)?;
            if a.wait_seconds > MAX_WAIT_SECONDS {
                return Err(ToolError::BadArguments(format!(
                    "{tool}: wait_seconds: at most {MAX_WAIT_SECONDS}"
                )));
            }
            events(st, tenant, &a).await
        }
        "sessions.answer" => {
            let a: AnswerArgs = parse(tool, args)?;
            let rec = ops::answer(st, tenant, &a.session_id, &a.text).await?;
            Ok(json!(session_view(&rec)))
        }
        "sessions.cancel" => {
            let a: SessionArgs = parse(tool, args)?;
            let rec = ops::cancel(st, tenant, &a.session_id).await?;
            Ok(json!(session_view(&rec)))
        }
        "skills.list" => {
            let _: NoArgs = parse(tool, args)?;
            Ok(ops::skills(st))
        }
        "skills.show" => {
            let a: SkillArgs = parse(tool, args)?;
            Ok(ops::skill(st, &a.skill_id)?)
        }
        "artifacts.get" => {
            let a: ArtifactArgs = parse(tool, args)?;
            let bytes = ops::artifact(st, tenant, &a.session_id, &a.sha256).await?;
            if bytes.len() > MAX_INLINE_ARTIFACT_BYTES {
                return Err(Problem::status(
                    axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                    format!(
                        "artifact {} is {} bytes, over the {MAX_INLINE_ARTIFACT_BYTES} an MCP reply carries: GET /v1/sessions/{}/artifacts/{} instead",
                        a.sha256,
                        bytes.len(),
                        a.session_id,
                        a.sha256
                    ),
                )
                .into());
            }
            Ok(json!({
                "sha256": a.sha256,
                "size_bytes": bytes.len(),
                "content_base64": base64::engine::general_purpose::STANDARD.encode(&bytes),
            }))
        }
        "sessions.report" => {
            let a: SessionArgs = parse(tool, args)?;
            let (rec, _) = ops::owned(st, tenant, &a.session_id).await?;
            let report = rec.report();
            let text = format!(
                "{}\n{}",
                report.evidence_text().trim_end(),
                report.summary_line()
            );
            Ok(json!({
                "session_id": a.session_id,
                "status": rec.status.as_str(),
                "report": report,
                "text": text,
            }))
        }
        "skills.run" => {
            let a: SkillRunArgs = parse(tool, args)?;
            skill_run(st, a).await
        }
        other => Err(ToolError::UnknownTool(other.to_string())),
    }
}

/// `skills.run`: [`crate::job_run`] on the PM's workers, gate and tenant settings.
async fn skill_run(st: &AppState, a: SkillRunArgs) -> Result<Value, ToolError> {
    let failed =
        |f: crate::job_run::Failure| ToolError::Failed(json!({ "ok": false, "error": f.json() }));
    let Some(skill) = st.pm.registry.get(&a.skill_id) else {
        return Err(Problem::not_found(format!("skill {}", a.skill_id)).into());
    };
    let seed = match &a.workspace {
        None => None,
        Some(w) => {
            let p = std::path::Path::new(w);
            if !p.is_absolute() {
                return Err(ToolError::BadArguments(
                    "skills.run: workspace: must be an absolute path".into(),
                ));
            }
            match std::fs::canonicalize(p) {
                Ok(c) if c.is_dir() => Some(c),
                _ => {
                    return Err(
                        Problem::bad_request(format!("workspace {w}: not a directory")).into(),
                    )
                }
            }
        }
    };
    let job = crate::job_run::render(skill, &a.inputs).map_err(failed)?;
    let env = crate::job_run::Env {
        pool: &st.pm.workers,
        gate: &st.pm.gate,
        tenant: &st.pm.tenant,
        seed: seed.as_deref(),
        artifacts_dir: &st.pm.artifacts_dir,
    };
    let job = crate::job_run::execute(job, &env).await.map_err(failed)?;
    Ok(json!({ "ok": true, "job": job }))
}

/// `sessions.events`: the events after `after`, waiting up to `wait_seconds` for one.
async fn events(st: &AppState, tenant: &Tenant, a: &EventsArgs) -> Result<Value, ToolError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(a.wait_seconds);
    loop {
        let (events, done) = ops::events_after(st, tenant, &a.session_id, a.after).await?;
        if !events.is_empty()
            || done
            || st.stop.is_cancelled()
            || tokio::time::Instant::now() >= deadline
        {
            let next_after = events
                .last()
                .and_then(|e| e["seq"].as_u64())
                .unwrap_or(a.after);
            return Ok(json!({ "events": events, "next_after": next_after, "done": done }));
        }
        tokio::select! {
            _ = tokio::time::sleep(POLL) => {}
            _ = st.stop.cancelled() => {}
        }
    }
}
