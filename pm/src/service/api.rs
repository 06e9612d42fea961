//! The handlers of the PM's HTTP API (`/v1/…`) and their OpenAPI description (utoipa).
//!
//! Every session route checks the caller's tenant against the session's; another tenant's
//! session is answered 404, exactly like a missing one. Bodies are closed
//! (`deny_unknown_fields`): an unknown field is a 400 naming it.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use utoipa::IntoParams;

pub use cynode_protocol::pm_api::{
    Answer, Constraints, CreateSession, SessionList, SessionView, ValidateJob, Validation,
    WorkspaceSpec,
};

use super::extract::ApiJson;
use crate::app::auth::Tenant;
use crate::app::ops::{self, session_view};
use crate::app::problem::Problem;
use crate::app::AppState;
use crate::policy::PolicyInput;
pub use crate::session::evidence::{EvidenceReport, JobEvidence, StepEvidence, TaskEvidence};
use crate::skills::{build_job, JobRef};

/// Filters and paging of `GET /v1/sessions`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    pub status: Option<String>,
    pub cursor: Option<String>,
    /// 1–200, default 50.
    pub limit: Option<i64>,
}

/// Create a session (idempotent with `Idempotency-Key`).
#[utoipa::path(post, path = "/v1/sessions", request_body = CreateSession,
    params(("Idempotency-Key" = Option<String>, Header, description = "the same key gives the same session")),
    responses((status = 201, body = SessionView), (status = 200, description = "an existing session for this Idempotency-Key", body = SessionView),
              (status = 400, body = Problem), (status = 401, body = Problem), (status = 403, body = Problem)),
    security(("bearer" = [])))]
pub async fn create_session(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CreateSession>,
) -> Result<Response, Problem> {
    let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok());
    let c = ops::create_session(&st, &tenant, &req, key).await?;
    let status = if c.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(session_view(&c.record))).into_response())
}

/// List the tenant's sessions, newest first.
#[utoipa::path(get, path = "/v1/sessions", params(ListQuery),
    responses((status = 200, body = SessionList), (status = 400, body = Problem), (status = 401, body = Problem)),
    security(("bearer" = [])))]
pub async fn list_sessions(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Query(q): Query<ListQuery>,
) -> Result<Json<SessionList>, Problem> {
    let limit = q.limit.unwrap_or(50);
    if !(1..=200).contains(&limit) {
        return Err(Problem::bad_request("limit: must be between 1 and 200"));
    }
    let page = st
        .pm
        .store
        .page(&tenant.0, q.status.as_deref(), q.cursor.as_deref(), limit)
        .await?;
    Ok(Json(SessionList {
        sessions: page.sessions.iter().map(session_view).collect(),
        next_cursor: page.next_cursor,
    }))
}

/// One session: status, plan, active job, artifacts, deliverable.
#[utoipa::path(get, path = "/v1/sessions/{id}", params(("id" = String, Path)),
    responses((status = 200, body = SessionView), (status = 404, body = Problem), (status = 401, body = Problem)),
    security(("bearer" = [])))]
pub async fn get_session(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path(id): Path<String>,
) -> Result<Json<SessionView>, Problem> {
    let (rec, _) = ops::owned(&st, &tenant, &id).await?;
    Ok(Json(session_view(&rec)))
}

/// The session's evidence report: per task, its jobs with their skill, each step's
/// outcome and the verified artifacts (sha256), composed by the PM from what it verified;
/// then the model's summary, bounded. For a session without a deliverable it is the
/// evidence so far (`summary` null).
#[utoipa::path(get, path = "/v1/sessions/{id}/report", params(("id" = String, Path)),
    responses((status = 200, body = EvidenceReport), (status = 404, body = Problem), (status = 401, body = Problem)),
    security(("bearer" = [])))]
pub async fn get_report(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path(id): Path<String>,
) -> Result<Json<EvidenceReport>, Problem> {
    let (rec, _) = ops::owned(&st, &tenant, &id).await?;
    Ok(Json(rec.report()))
}

/// Answer the session's open question.
#[utoipa::path(post, path = "/v1/sessions/{id}/messages", params(("id" = String, Path)), request_body = Answer,
    responses((status = 200, body = SessionView), (status = 404, body = Problem), (status = 409, body = Problem)),
    security(("bearer" = [])))]
pub async fn post_message(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path(id): Path<String>,
    ApiJson(a): ApiJson<Answer>,
) -> Result<Json<SessionView>, Problem> {
    let rec = ops::answer(&st, &tenant, &id, &a.text).await?;
    Ok(Json(session_view(&rec)))
}

/// `POST /v1/sessions/{id}:cancel` (axum cannot route a `{id}:cancel` segment, so the
/// segment is parsed here).
#[utoipa::path(post, path = "/v1/sessions/{id}:cancel", params(("id" = String, Path)),
    responses((status = 200, body = SessionView), (status = 404, body = Problem), (status = 409, body = Problem)),
    security(("bearer" = [])))]
pub async fn session_action(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path(segment): Path<String>,
) -> Result<Json<SessionView>, Problem> {
    let Some(id) = segment.strip_suffix(":cancel") else {
        return Err(Problem::not_found(format!("action in `{segment}`")));
    };
    let rec = ops::cancel(&st, &tenant, id).await?;
    Ok(Json(session_view(&rec)))
}

/// The verified bytes of one of the session's artifacts.
#[utoipa::path(get, path = "/v1/sessions/{id}/artifacts/{sha256}", params(("id" = String, Path), ("sha256" = String, Path)),
    responses((status = 200, content_type = "application/octet-stream", description = "the bytes"), (status = 404, body = Problem)),
    security(("bearer" = [])))]
pub async fn get_artifact(
    State(st): State<Arc<AppState>>,
    tenant: Tenant,
    Path((id, sha)): Path<(String, String)>,
) -> Result<Response, Problem> {
    let bytes = ops::artifact(&st, &tenant, &id, &sha).await?;
    Ok((
        [(axum::http::header::CONTENT_TYPE, "application/octet-stream")],
        bytes,
    )
        .into_response())
}

/// The skill catalog the model sees.
#[utoipa::path(get, path = "/v1/skills",
    responses((status = 200, description = "skill_id, version, description, inputs_schema of every skill", body = Object)),
    security(("bearer" = [])))]
pub async fn list_skills(State(st): State<Arc<AppState>>, _t: Tenant) -> Json<Value> {
    Json(ops::skills(&st))
}

/// Render a skill with inputs and run the policy gate, without dispatching.
#[utoipa::path(post, path = "/v1/jobs:validate", request_body = ValidateJob,
    responses((status = 200, body = Validation), (status = 400, body = Problem), (status = 404, body = Problem)),
    security(("bearer" = [])))]
pub async fn validate_job(
    State(st): State<Arc<AppState>>,
    _t: Tenant,
    ApiJson(req): ApiJson<ValidateJob>,
) -> Result<Json<Validation>, Problem> {
    let skill = st
        .pm
        .registry
        .get(&req.skill_id)
        .ok_or_else(|| Problem::not_found(format!("skill {}", req.skill_id)))?;
    let r = JobRef {
        session_id: "s-validate".into(),
        task_id: req.task_id.unwrap_or_else(|| "t1".into()),
        attempt: 0,
    };
    let built = build_job(skill, &req.inputs, &r)
        .map_err(|e| Problem::bad_request(format!("inputs: {e}")))?;
    let decision = st
        .pm
        .gate
        .evaluate(&PolicyInput {
            job: built.value.clone(),
            skill: serde_json::to_value(&skill.manifest).unwrap_or(Value::Null),
            tenant: st.pm.tenant.clone(),
        })
        .await;
    Ok(Json(Validation {
        allowed: decision.allowed,
        job: built.value,
        decision: json!(decision),
    }))
}
