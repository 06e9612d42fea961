//! Act: carry out an accepted reply. A plan_update patches the plan and notes; a
//! job_request is built from its skill (its `context` filled from the session's
//! objective and plan, [`crate::skills::context`]), placed on a worker (which fixes the
//! sandbox image), checked by the policy gate with that image, and journaled before it is
//! submitted; a message parks the session for an answer; a final ends it with its
//! verified deliverable.

use cynode_protocol::llm::{LlmOutput, TypedPayload};
use cynode_protocol::session::TaskStatus;
use serde_json::{json, Value};

use crate::policy::PolicyInput;
use crate::session::{
    evidence, Deliverable, Dispatch, FailureKind, Phase, SessionRecord, SessionStatus,
};
use crate::skills::{build_job_in, Brief, JobRef};
use crate::workers::{PlaceError, Placement};

use crate::llm::contract::apply_state_patch;

use super::{failpoint, DriverError, Pm, Progress};

impl Pm {
    pub(super) async fn act(
        &self,
        rec: &mut SessionRecord,
        version: i64,
        reply: LlmOutput,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<(), DriverError> {
        progress(Progress::Reply {
            kind: format!("{:?}", reply.kind),
            detail: reply_detail(&reply),
        });
        if let Err(e) = apply_state_patch(rec, &reply) {
            rec.feedback
                .push(format!("your state_patch was rejected: {e}"));
        } else if !reply.state_patch.is_empty() {
            progress(Progress::Plan(rec.state.plan.clone()));
        }
        let next_turn = |rec: &mut SessionRecord| {
            rec.turn += 1;
            rec.phase = Phase::Think;
        };
        match reply.typed_payload() {
            Err(e) => {
                rec.feedback.push(format!("your payload was invalid: {e}"));
                next_turn(rec);
            }
            Ok(TypedPayload::PlanUpdate(_)) => next_turn(rec),
            Ok(TypedPayload::Message(m)) => {
                rec.status = SessionStatus::AwaitingInput;
                rec.phase = Phase::AwaitInput {
                    question: m.text.clone(),
                };
                rec.event("question", json!({ "text": m.text }));
            }
            Ok(TypedPayload::Final(f)) => {
                let changeset = match rec
                    .worker_id
                    .as_deref()
                    .and_then(|w| self.workers.client(w))
                {
                    Some(worker) => worker
                        .changeset(&rec.workspace_id)
                        .await
                        .ok()
                        .filter(|d| !d.trim().is_empty()),
                    None => None,
                };
                // The PM composes the deliverable from what it verified; the model's
                // words are one bounded field of it.
                let report = evidence::compose(&rec.state.plan, &rec.evidence, Some(&f.summary));
                rec.deliverable = Some(Deliverable {
                    summary: report.summary.clone().unwrap_or_default(),
                    report,
                    artifacts: rec
                        .state
                        .artifacts
                        .iter()
                        .map(|a| a.record.clone())
                        .collect(),
                    changeset,
                });
                rec.status = SessionStatus::Completed;
                rec.phase = Phase::Done;
                rec.event("final", json!({ "summary": f.summary }));
            }
            Ok(TypedPayload::JobRequest(j)) => {
                return self.request_job(rec, version, j, progress).await;
            }
        }
        self.store.save(rec, version, &[]).await?;
        Ok(())
    }

    #[tracing::instrument(skip_all, fields(task_id = %j.task_id, skill_id = %j.skill_id, job_id = tracing::field::Empty))]
    pub(super) async fn request_job(
        &self,
        rec: &mut SessionRecord,
        version: i64,
        j: cynode_protocol::llm::JobRequestPayload,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<(), DriverError> {
        rec.turn += 1;
        rec.phase = Phase::Think;
        if rec.jobs_dispatched >= rec.budgets.max_jobs {
            rec.fail(
                FailureKind::BudgetExhausted,
                format!("max_jobs {} reached", rec.budgets.max_jobs),
            );
            self.store.save(rec, version, &[]).await?;
            return Ok(());
        }
        let attempt = rec.attempts.get(&j.task_id).copied().unwrap_or(0);
        if attempt >= rec.budgets.max_attempts_per_task {
            set_task_status(rec, &j.task_id, TaskStatus::Failed);
            let (kind, why) = match last_attempt_end(rec, &j.task_id) {
                Some("policy_denied") => (
                    FailureKind::PolicyViolation,
                    ", the last denied by the policy",
                ),
                Some("artifact_integrity_failure") => (
                    FailureKind::ArtifactIntegrityFailure,
                    ", the last with artifacts that did not match their sha256",
                ),
                _ => (FailureKind::TaskFailed, ""),
            };
            rec.fail(
                kind,
                format!("task {} failed after {attempt} attempts{why}", j.task_id),
            );
            self.store.save(rec, version, &[]).await?;
            return Ok(());
        }
        let Some(skill) = self.registry.get(&j.skill_id) else {
            rec.feedback.push(format!("unknown skill `{}`", j.skill_id));
            self.store.save(rec, version, &[]).await?;
            return Ok(());
        };
        let r = JobRef {
            session_id: rec.state.session_id.clone(),
            task_id: j.task_id.clone(),
            attempt,
        };
        // The job's context comes from the session's state, never from the reply itself
        // (the plan step is model text, but the policy gate below judges it in the job).
        let brief = Brief {
            objective: rec.state.objective.clone(),
            step: rec
                .state
                .plan
                .iter()
                .find(|p| p.task_id == j.task_id)
                .map(|p| (p.task_id.clone(), p.description.clone())),
            attempt: Some((attempt + 1, rec.budgets.max_attempts_per_task)),
        };
        let built = match build_job_in(skill, &j.inputs, &r, &brief) {
            Ok(b) => {
                tracing::Span::current().record("job_id", b.job.job_id.as_str());
                b
            }
            Err(e) => {
                rec.feedback.push(format!(
                    "job_request for task {} could not be built: {e}",
                    j.task_id
                ));
                self.store.save(rec, version, &[]).await?;
                return Ok(());
            }
        };
        let purpose = skill.manifest.purpose.clone();
        let placement = match self.placement(rec, &purpose).await {
            Ok(p) => p,
            Err(e)
                if matches!(
                    e,
                    PlaceError::NoPurpose { .. } | PlaceError::PinnedLacksPurpose { .. }
                ) =>
            {
                rec.attempts.insert(j.task_id.clone(), attempt + 1);
                rec.event(
                    "job_refused",
                    json!({ "task_id": j.task_id, "skill_id": j.skill_id, "reason": e.to_string() }),
                );
                rec.feedback.push(format!(
                    "the job for task {} was not run: skill {} needs a sandbox this deployment cannot give it: {e}. Choose another skill.",
                    j.task_id, j.skill_id
                ));
                self.store.save(rec, version, &[]).await?;
                return Ok(());
            }
            Err(e) => {
                rec.fail(FailureKind::WorkerUnavailable, e.to_string());
                self.store.save(rec, version, &[]).await?;
                return Ok(());
            }
        };
        // The policy judges the job as it will run: on the placed worker's image.
        let input = PolicyInput::for_job(
            built.value.clone(),
            &skill.manifest,
            Some(&placement.image),
            self.tenant.clone(),
        );
        let decision = self.gate.evaluate(&input).await;
        if !decision.allowed {
            let reasons: Vec<String> = decision
                .deny
                .iter()
                .map(|v| format!("{}: {}", v.rule, v.message))
                .collect();
            crate::metrics::metrics().policy_denials.inc();
            rec.attempts.insert(j.task_id.clone(), attempt + 1);
            rec.event(
                "policy_denied",
                json!({ "task_id": j.task_id, "skill_id": j.skill_id, "reasons": reasons }),
            );
            rec.feedback.push(format!(
                "policy_violation: the job for task {} was denied and not run: {}. Choose different inputs or another skill.",
                j.task_id,
                reasons.join("; ")
            ));
            progress(Progress::PolicyDenied {
                task_id: j.task_id.clone(),
                reasons,
            });
            self.store.save(rec, version, &[]).await?;
            return Ok(());
        }
        let new_workspace = rec.worker_id.is_none();
        rec.worker_id = Some(placement.worker_id.clone());
        let dispatch = Dispatch {
            job_id: built.job.job_id.clone(),
            task_id: j.task_id.clone(),
            skill_id: j.skill_id.clone(),
            attempt,
            job_json: String::from_utf8_lossy(&built.canonical).into_owned(),
            worker_id: placement.worker_id,
            image: placement.image,
            new_workspace,
        };
        rec.attempts.insert(j.task_id.clone(), attempt + 1);
        rec.jobs_dispatched += 1;
        rec.state.active_job_id = Some(dispatch.job_id.clone());
        rec.state.skill_context.insert(
            skill.manifest.skill_id.clone(),
            skill.manifest.version.clone(),
        );
        set_task_status(rec, &j.task_id, TaskStatus::InProgress);
        rec.phase = Phase::Await {
            dispatch: dispatch.clone(),
        };
        rec.event("job_dispatched", json!({ "job_id": dispatch.job_id, "task_id": dispatch.task_id, "skill_id": dispatch.skill_id, "worker_id": dispatch.worker_id }));
        self.store
            .save(
                rec,
                version,
                &[(
                    "dispatch",
                    serde_json::to_value(&dispatch).unwrap_or(Value::Null),
                )],
            )
            .await?;
        failpoint("after_dispatch");
        Ok(())
    }
    /// Where a job of `purpose` runs: on the session's worker once it has one, else on
    /// the worker [`WorkerPool::place`] picks, waiting (with backoff, up to
    /// `worker_wait`) while every worker offering the purpose is unreachable.
    pub(super) async fn placement(
        &self,
        rec: &SessionRecord,
        purpose: &str,
    ) -> Result<Placement, PlaceError> {
        if let Some(w) = &rec.worker_id {
            return self.workers.pinned(w, purpose);
        }
        let deadline = tokio::time::Instant::now() + self.worker_wait;
        let mut delay = std::time::Duration::from_millis(200);
        loop {
            match self.workers.place(purpose).await {
                Err(e) if e.is_retryable() => {
                    // Wait the whole `worker_wait`: the last try is at the deadline.
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    if left.is_zero() {
                        return Err(e);
                    }
                    let nap = delay.min(left);
                    tracing::warn!(purpose, error = %e, retry_in_ms = nap.as_millis() as u64, "no worker can take the job yet");
                    tokio::time::sleep(nap).await;
                    delay = (delay * 2).min(std::time::Duration::from_secs(5));
                }
                r => return r,
            }
        }
    }
}

/// What a reply asks, in a few words, for progress lines.
pub(super) fn reply_detail(reply: &LlmOutput) -> String {
    let clip = |t: &str| -> String {
        let one: String = t.split_whitespace().collect::<Vec<_>>().join(" ");
        match one.char_indices().nth(160) {
            Some((i, _)) => format!("{}…", &one[..i]),
            None => one,
        }
    };
    match reply.typed_payload() {
        Ok(TypedPayload::JobRequest(j)) => {
            format!(
                "{} for {}, inputs {}",
                j.skill_id,
                j.task_id,
                clip(&j.inputs.to_string())
            )
        }
        Ok(TypedPayload::PlanUpdate(p)) => clip(p.note.as_deref().unwrap_or("")),
        Ok(TypedPayload::Message(m)) => clip(&m.text),
        Ok(TypedPayload::Final(f)) => clip(&f.summary),
        Err(e) => e.to_string(),
    }
}
pub(super) fn set_task_status(rec: &mut SessionRecord, task_id: &str, status: TaskStatus) {
    if let Some(p) = rec.state.plan.iter_mut().find(|p| p.task_id == task_id) {
        if p.status != status {
            p.status = status;
            p.version += 1;
        }
    }
}

/// How the last attempt at `task_id` ended, as the kind of its newest event:
/// `policy_denied` (refused before dispatch), `artifact_integrity_failure` (its job's
/// artifacts did not verify) or `job_dispatched` (anything else); `None` without one.
fn last_attempt_end<'a>(rec: &'a SessionRecord, task_id: &str) -> Option<&'a str> {
    const ENDS: [&str; 3] = [
        "policy_denied",
        "artifact_integrity_failure",
        "job_dispatched",
    ];
    rec.state
        .history
        .iter()
        .rev()
        .find(|e| ENDS.contains(&e.kind.as_str()) && e.data["task_id"] == task_id)
        .map(|e| e.kind.as_str())
}
