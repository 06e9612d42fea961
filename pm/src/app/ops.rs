//! The API's operations, shared by its two front ends: the HTTP handlers
//! (`crate::service`) and the MCP tools (`crate::mcp`). Each takes the caller's
//! authenticated [`Tenant`] and checks it against the session, so both front ends keep
//! one policy: another tenant's session is "not found", exactly like a missing one, and
//! every error is one [`Problem`].

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use cynode_protocol::pm_api::{CreateSession, SessionView};

use super::auth::Tenant;
use super::problem::Problem;
use super::AppState;
use crate::session::{Budgets, Phase, SessionRecord, SessionStatus};

/// A session as the API shows it.
pub fn session_view(rec: &SessionRecord) -> SessionView {
    SessionView {
        session_id: rec.state.session_id.clone(),
        tenant: rec.tenant_id.clone(),
        status: rec.status.as_str().to_string(),
        objective: rec.state.objective.clone(),
        plan: json!(rec.state.plan),
        active_job_id: rec.state.active_job_id.clone(),
        artifacts: json!(rec.state.artifacts),
        question: match &rec.phase {
            crate::session::Phase::AwaitInput { question } => Some(question.clone()),
            _ => None,
        },
        deliverable: json!(rec.deliverable),
        failure: json!(rec.failure),
        turn: rec.turn,
        jobs_dispatched: rec.jobs_dispatched,
        workspace_id: rec.workspace_id.clone(),
        worker_id: rec.worker_id.clone(),
    }
}

/// A created session, or the existing one its idempotency key names.
#[derive(Debug)]
pub struct Created {
    /// False when the idempotency key named a session that already existed.
    pub created: bool,
    pub record: SessionRecord,
}

/// The session if it exists and belongs to `tenant`.
pub async fn owned(
    st: &AppState,
    tenant: &Tenant,
    id: &str,
) -> Result<(SessionRecord, i64), Problem> {
    match st.pm.store.load(id).await? {
        Some((rec, v)) if rec.tenant_id == tenant.0 => Ok((rec, v)),
        _ => Err(Problem::not_found(format!("session {id}"))),
    }
}

/// The id of a session created with an idempotency key: the same tenant and key always
/// name the same session.
fn idempotent_id(tenant: &str, key: &str) -> String {
    let d = Sha256::digest(format!("{tenant}\n{key}").as_bytes());
    format!("s-{}", &hex::encode(d)[..32])
}

/// Creates a session for `tenant` (the same `idempotency_key` gives the same session)
/// and wakes the scheduler.
pub async fn create_session(
    st: &AppState,
    tenant: &Tenant,
    req: &CreateSession,
    idempotency_key: Option<&str>,
) -> Result<Created, Problem> {
    if req.objective.trim().is_empty() {
        return Err(Problem::bad_request("objective: must not be empty"));
    }
    if let Some(t) = &req.tenant {
        if *t != tenant.0 {
            return Err(Problem::forbidden(format!(
                "tenant: the token belongs to another tenant than `{t}`"
            )));
        }
    }
    let id = match idempotency_key.map(str::trim) {
        Some(k) if !k.is_empty() => idempotent_id(&tenant.0, k),
        _ => format!("s-{}", uuid::Uuid::new_v4()),
    };
    let d = Budgets::default();
    let c = &req.constraints;
    let budgets = Budgets {
        max_turns: c.max_turns.unwrap_or(d.max_turns),
        max_jobs: c.max_jobs.unwrap_or(d.max_jobs),
        max_attempts_per_task: c.max_attempts_per_task.unwrap_or(d.max_attempts_per_task),
        wall_clock_seconds: c.wall_clock_seconds.unwrap_or(d.wall_clock_seconds),
        ..d
    };
    if let Some((existing, _)) = st.pm.store.load(&id).await? {
        if existing.tenant_id == tenant.0 {
            return Ok(Created {
                created: false,
                record: existing,
            });
        }
        return Err(Problem::conflict("Idempotency-Key: already used"));
    }
    let mut rec = SessionRecord::new(&id, &tenant.0, &req.objective, budgets);
    // The workspace is created (and seeded) on the worker the first job is placed on.
    rec.workspace_seed = req.workspace.as_ref().map(|w| w.seed_path.clone());
    rec.event("created", json!({ "objective": rec.state.objective }));
    if !st.pm.create(&rec).await? {
        let (existing, _) = owned(st, tenant, &id).await?;
        return Ok(Created {
            created: false,
            record: existing,
        });
    }
    st.wake.notify_one();
    tracing::info!(session_id = %id, tenant = %tenant.0, "session created");
    Ok(Created {
        created: true,
        record: rec,
    })
}

/// Answers the session's open question (409 when it has none) and wakes the scheduler.
pub async fn answer(
    st: &AppState,
    tenant: &Tenant,
    id: &str,
    text: &str,
) -> Result<SessionRecord, Problem> {
    let (rec, _) = owned(st, tenant, id).await?;
    if !matches!(rec.phase, Phase::AwaitInput { .. }) || rec.status != SessionStatus::AwaitingInput
    {
        return Err(Problem::conflict(format!(
            "session {id} is {} and has no open question",
            rec.status.as_str()
        )));
    }
    let rec = st.pm.answer(id, text).await?;
    st.wake.notify_one();
    Ok(rec)
}

/// Cancels the session (409 when it already ended) and stops its active job on its worker.
pub async fn cancel(st: &AppState, tenant: &Tenant, id: &str) -> Result<SessionRecord, Problem> {
    for _ in 0..5 {
        let (mut rec, v) = owned(st, tenant, id).await?;
        if rec.status.is_terminal() {
            return Err(Problem::conflict(format!(
                "session {id} already {}",
                rec.status.as_str()
            )));
        }
        let job = rec.state.active_job_id.clone();
        let worker = rec.worker_id.clone().unwrap_or_default();
        rec.status = SessionStatus::Canceled;
        rec.phase = Phase::Done;
        rec.event("canceled", json!({ "active_job_id": job }));
        match st.pm.store.save(&rec, v, &[]).await {
            Ok(_) => {
                if let (Some(job), Some(client)) = (job, st.pm.workers.client(&worker)) {
                    if let Err(e) = client.stop(&job).await {
                        tracing::warn!(session_id = %id, job_id = %job, worker = %worker, error = %e, "cannot stop the job");
                    }
                }
                tracing::info!(session_id = %id, "session canceled");
                return Ok(rec);
            }
            Err(crate::store::StoreError::Conflict(_)) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(Problem::conflict(format!(
        "session {id} kept changing; retry the cancel"
    )))
}

/// The bytes of one of the session's artifacts, checked against their sha256 as they are
/// read (a mismatch is an integrity failure, never the bytes).
pub async fn artifact(
    st: &AppState,
    tenant: &Tenant,
    id: &str,
    sha: &str,
) -> Result<Vec<u8>, Problem> {
    let (rec, _) = owned(st, tenant, id).await?;
    if !rec.state.artifacts.iter().any(|a| a.record.sha256 == sha) {
        return Err(Problem::not_found(format!(
            "artifact {sha} of session {id}"
        )));
    }
    let location = st
        .pm
        .store
        .artifact_location(sha)
        .await?
        .ok_or_else(|| Problem::not_found(format!("artifact {sha}")))?;
    let bytes = tokio::fs::read(&location)
        .await
        .map_err(|e| Problem::internal(format!("artifact {sha} unreadable: {e}")))?;
    if hex::encode(Sha256::digest(&bytes)) != sha {
        crate::metrics::metrics().artifact_integrity_failures.inc();
        return Err(Problem::internal(format!(
            "artifact_integrity_failure: the stored bytes of {sha} no longer match"
        )));
    }
    Ok(bytes)
}

/// The session's events after sequence number `after`, as `{seq, at, kind, data}`, and
/// whether the session has ended (no event will follow).
pub async fn events_after(
    st: &AppState,
    tenant: &Tenant,
    id: &str,
    after: u64,
) -> Result<(Vec<Value>, bool), Problem> {
    let (rec, _) = owned(st, tenant, id).await?;
    let events = rec
        .state
        .history
        .iter()
        .filter(|h| h.seq > after)
        .map(|h| json!({ "seq": h.seq, "at": h.at, "kind": h.kind, "data": h.data }))
        .collect();
    Ok((events, rec.status.is_terminal()))
}

/// The skill catalog the model sees.
pub fn skills(st: &AppState) -> Value {
    json!({ "skills": st.pm.contract.catalog })
}

/// One skill of the catalog: its manifest (id, version, description, inputs schema,
/// purpose, limits). A skill the catalog leaves out (no worker offers its purpose) is
/// not found, as in the catalog.
pub fn skill(st: &AppState, id: &str) -> Result<Value, Problem> {
    let not_found = || Problem::not_found(format!("skill {id}"));
    if !st.pm.contract.catalog.iter().any(|c| c.skill_id == id) {
        return Err(not_found());
    }
    let skill = st.pm.registry.get(id).ok_or_else(not_found)?;
    Ok(serde_json::to_value(&skill.manifest).unwrap_or(Value::Null))
}
