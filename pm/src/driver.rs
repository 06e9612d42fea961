//! The session loop: load state, ask the model, act on plan_update / job_request /
//! message / final, wait for results, update, repeat.
//!
//! Every transition is saved (with its journal entry) before the work it leads to:
//! - a model reply is journaled and the phase moves to `Act` in one transaction, so a
//!   resumed session acts on the stored reply instead of asking again;
//! - a dispatch decision (deterministic job_id) is journaled before the job is submitted,
//!   and the worker's async API is idempotent on job_id, so a resumed session re-submits
//!   and waits without ever running the job twice;
//! - a result is verified, stored and saved before the worker is told it may forget it.
//!
//! `CYNODE_PM_FAILPOINT=<name>` aborts the process right after the named save
//! (`after_model_reply`, `after_dispatch`, `after_result`): fault injection for the
//! crash-resume tests, inert unless set.

use std::path::PathBuf;
use std::time::Duration;

use cynode_protocol::llm::{LlmOutput, TypedPayload};
use cynode_protocol::result::ArtifactRecord;
use cynode_protocol::session::{PlanEntry, SessionArtifact, TaskStatus};
use cynode_protocol::worker_api::{
    AsyncJobState, RunJobRequest, RunJobResponse, SandboxSpec, WorkerJobStatus,
};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::artifacts::{verify_and_store, ArtifactError};
use crate::dispatch::{DispatchError, WorkerClient};
use crate::llm::{self, LlmClient, LlmError};
use crate::policy::{PolicyGate, PolicyInput, TenantPolicy};
use crate::session::{Deliverable, Dispatch, FailureKind, Phase, SessionRecord, SessionStatus};
use crate::skills::{build_job, JobRef, Registry};
use crate::store::{Store, StoreError};
use crate::workers::{PlaceError, Placement, WorkerPool};

/// What the loop reports while it works.
#[derive(Debug, Clone, PartialEq)]
pub enum Progress {
    Turn(u32),
    /// An accepted reply: its type, and what it asks in a few words (the skill, task and
    /// inputs of a job_request; the note of a plan_update; the text of a message or final).
    Reply {
        kind: String,
        detail: String,
    },
    Plan(Vec<PlanEntry>),
    /// A job handed to a worker (also when a resumed session waits for it again).
    Dispatched {
        job_id: String,
        task_id: String,
        skill_id: String,
        worker_id: String,
        image: String,
    },
    JobState {
        job_id: String,
        state: AsyncJobState,
    },
    /// A job's result, after its artifacts were fetched and their sha256 verified.
    JobDone {
        job_id: String,
        status: String,
        /// Why it failed, in one line (the runner's failure code and message).
        failure: Option<String>,
        /// The artifacts verified and stored for this job.
        artifacts: Vec<ArtifactRecord>,
    },
    PolicyDenied {
        task_id: String,
        reasons: Vec<String>,
    },
    Question(String),
    Finished(SessionStatus),
}

/// Why watching a job stopped.
#[derive(Debug, thiserror::Error)]
enum WatchError {
    #[error("{0}")]
    Dispatch(#[from] DispatchError),
    #[error("{0}")]
    Store(#[from] StoreError),
}

/// Errors that stop the driver itself (not the session: those are recorded in it).
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("session {0} not found")]
    NotFound(String),
}

/// Everything the loop uses.
pub struct Pm {
    pub store: Store,
    pub registry: Registry,
    /// The catalog, compiled validator and system prompt ([`llm::Contract`]).
    pub contract: llm::Contract,
    pub gate: PolicyGate,
    pub tenant: TenantPolicy,
    pub llm: LlmClient,
    /// The workers jobs go to, and what each offers ([`WorkerPool`]).
    pub workers: WorkerPool,
    /// How long a session's first job waits for a worker offering its purpose to answer
    /// before the session fails `worker_unavailable`.
    pub worker_wait: std::time::Duration,
    /// Where verified artifacts are stored.
    pub artifacts_dir: PathBuf,
}

fn failpoint(name: &str) {
    if std::env::var("CYNODE_PM_FAILPOINT").is_ok_and(|v| v == name) {
        eprintln!("cynode-pm: failpoint {name}: aborting");
        std::process::abort();
    }
}

impl Pm {
    /// Creates a session (idempotent on its id).
    pub async fn create(&self, rec: &SessionRecord) -> Result<bool, DriverError> {
        Ok(self.store.create(rec).await?)
    }

    /// Gives a parked session the user's answer and makes it runnable.
    pub async fn answer(&self, session_id: &str, text: &str) -> Result<SessionRecord, DriverError> {
        let (mut rec, version) = self
            .store
            .load(session_id)
            .await?
            .ok_or_else(|| DriverError::NotFound(session_id.to_string()))?;
        if let Phase::AwaitInput { question } = &rec.phase {
            rec.feedback.push(format!(
                "the user answered your question \"{question}\": {text}"
            ));
            rec.event("user_answer", json!({ "text": text }));
            rec.phase = Phase::Think;
            rec.status = SessionStatus::Running;
            rec.turn += 1;
            self.store
                .save(&rec, version, &[("user_answer", json!({ "text": text }))])
                .await?;
        }
        Ok(rec)
    }

    /// Drives the session until it ends or waits for the user.
    pub async fn run(
        &self,
        session_id: &str,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<SessionRecord, DriverError> {
        self.run_until(session_id, progress, &CancellationToken::new())
            .await
    }

    /// Like [`Pm::run`], but returns at the next step boundary once `stop` is cancelled
    /// (the session still `running`, its last step saved): a replica shutting down hands
    /// its sessions over without cutting a model call or a result in two.
    pub async fn run_until(
        &self,
        session_id: &str,
        progress: &mut (dyn FnMut(Progress) + Send),
        stop: &CancellationToken,
    ) -> Result<SessionRecord, DriverError> {
        loop {
            let (mut rec, version) = self
                .store
                .load(session_id)
                .await?
                .ok_or_else(|| DriverError::NotFound(session_id.to_string()))?;
            if rec.status.is_terminal()
                || matches!(rec.phase, Phase::AwaitInput { .. } | Phase::Done)
            {
                if let Phase::AwaitInput { question } = &rec.phase {
                    progress(Progress::Question(question.clone()));
                }
                progress(Progress::Finished(rec.status));
                return Ok(rec);
            }
            if stop.is_cancelled() {
                return Ok(rec);
            }
            self.step(&mut rec, version, progress).await?;
        }
    }

    async fn step(
        &self,
        rec: &mut SessionRecord,
        version: i64,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<(), DriverError> {
        let span = tracing::info_span!("turn", session_id = %rec.state.session_id, turn = rec.turn);
        async {
            match rec.phase.clone() {
                Phase::Think => self.think(rec, version, progress).await,
                Phase::Act { reply } => self.act(rec, version, reply, progress).await,
                Phase::Await { dispatch } => self.await_job(rec, version, dispatch, progress).await,
                Phase::AwaitInput { .. } | Phase::Done => Ok(()),
            }
        }
        .instrument(span)
        .await
    }

    fn over_budget(&self, rec: &SessionRecord) -> Option<String> {
        let b = rec.budgets;
        if rec.turn >= b.max_turns {
            return Some(format!("max_turns {} reached", b.max_turns));
        }
        let elapsed = (crate::session::now_ms() - rec.started_at_ms) / 1000;
        if elapsed > i64::try_from(b.wall_clock_seconds).unwrap_or(i64::MAX) {
            return Some(format!("wall clock of {}s reached", b.wall_clock_seconds));
        }
        None
    }

    async fn think(
        &self,
        rec: &mut SessionRecord,
        version: i64,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<(), DriverError> {
        if let Some(why) = self.over_budget(rec) {
            rec.fail(FailureKind::BudgetExhausted, why);
            self.store.save(rec, version, &[]).await?;
            return Ok(());
        }
        progress(Progress::Turn(rec.turn));
        // A reply this turn already got (journaled before a crash) is never asked again.
        let stored = self
            .store
            .last_journal(&rec.state.session_id, "model_reply")
            .await?
            .filter(|e| e.data["turn"] == json!(rec.turn));
        let reply: LlmOutput =
            match stored.and_then(|e| serde_json::from_value(e.data["reply"].clone()).ok()) {
                Some(r) => r,
                None => {
                    let task_ids: Vec<String> =
                        rec.state.plan.iter().map(|p| p.task_id.clone()).collect();
                    let rules = llm::TurnRules::for_session(rec, &self.contract.catalog);
                    let schema = rules.schema(&self.contract.catalog, &task_ids);
                    let mut feedback = feedback_text(rec);
                    if let Some(notice) = &rules.notice {
                        let joined = feedback.map_or_else(String::new, |f| f + "\n");
                        feedback = Some(joined + notice);
                    }
                    match self
                        .llm
                        .next_reply_with(
                            &llm::compose_context(
                                &self.contract.system_prompt,
                                &rec.state.objective,
                                &state_summary(rec),
                                feedback.as_deref(),
                            ),
                            &schema,
                            &self.contract.validator,
                            &task_ids,
                            |r| rules.check(r),
                        )
                        .await
                    {
                        Ok((reply, raw, attempts)) => {
                            rec.phase = Phase::Act {
                                reply: reply.clone(),
                            };
                            rec.feedback.clear();
                            rec.event(
                            "model_reply",
                            json!({ "turn": rec.turn, "type": reply.kind, "attempts": attempts }),
                        );
                            self.store
                                .save(
                                    rec,
                                    version,
                                    &[(
                                        "model_reply",
                                        json!({ "turn": rec.turn, "raw": raw, "reply": reply }),
                                    )],
                                )
                                .await?;
                            failpoint("after_model_reply");
                            return Ok(());
                        }
                        Err(e) => {
                            let kind = match &e {
                                LlmError::ModelContractViolation { .. } => {
                                    FailureKind::ModelContractViolation
                                }
                                _ => FailureKind::ModelUnavailable,
                            };
                            rec.fail(kind, e.to_string());
                            self.store.save(rec, version, &[]).await?;
                            return Ok(());
                        }
                    }
                }
            };
        rec.phase = Phase::Act { reply };
        self.store.save(rec, version, &[]).await?;
        Ok(())
    }

    async fn act(
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
                rec.deliverable = Some(Deliverable {
                    summary: f.summary.clone(),
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
    async fn request_job(
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
            rec.fail(
                FailureKind::TaskFailed,
                format!("task {} failed after {attempt} attempts", j.task_id),
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
        let built = match build_job(skill, &j.inputs, &r) {
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
        let input = PolicyInput {
            job: built.value.clone(),
            skill: serde_json::to_value(&skill.manifest).unwrap_or(Value::Null),
            tenant: self.tenant.clone(),
        };
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
    async fn placement(&self, rec: &SessionRecord, purpose: &str) -> Result<Placement, PlaceError> {
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

    /// Polls the worker until the job ends. Each new state is saved as a `job_state`
    /// event (so event streams show `in_progress` live, from any replica) and reported.
    async fn watch_job(
        &self,
        worker: &WorkerClient,
        rec: &mut SessionRecord,
        version: &mut i64,
        job_id: &str,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<RunJobResponse, WatchError> {
        let (mut delay, max_delay) = worker.poll;
        let mut last = None;
        loop {
            let s = worker.status(job_id).await?;
            if last != Some(s.status) {
                last = Some(s.status);
                progress(Progress::JobState {
                    job_id: job_id.to_string(),
                    state: s.status,
                });
                rec.event("job_state", json!({ "job_id": job_id, "state": s.status }));
                *version = self.store.save(rec, *version, &[]).await?;
            }
            if s.status.is_terminal() {
                return s.result.ok_or_else(|| {
                    DispatchError::Unavailable(format!("job {job_id} ended without a result"))
                        .into()
                });
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(max_delay);
        }
    }

    #[tracing::instrument(skip_all, fields(job_id = %d.job_id, task_id = %d.task_id, skill_id = %d.skill_id))]
    async fn await_job(
        &self,
        rec: &mut SessionRecord,
        version: i64,
        d: Dispatch,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<(), DriverError> {
        progress(Progress::Dispatched {
            job_id: d.job_id.clone(),
            task_id: d.task_id.clone(),
            skill_id: d.skill_id.clone(),
            worker_id: d.worker_id.clone(),
            image: d.image.clone(),
        });
        let Some(worker) = self.workers.client(&d.worker_id) else {
            rec.fail(
                FailureKind::WorkerUnavailable,
                PlaceError::Unknown(d.worker_id.clone()).to_string(),
            );
            self.store.save(rec, version, &[]).await?;
            return Ok(());
        };
        let req = RunJobRequest {
            version: 1,
            task_id: d.task_id.clone(),
            job_id: d.job_id.clone(),
            sandbox: SandboxSpec {
                image: d.image.clone(),
                job_spec_json: Some(d.job_json.clone()),
                ..Default::default()
            },
            workspace_id: Some(rec.workspace_id.clone()),
        };
        let mut version = version;
        let outcome = match self.prepare_workspace(worker, rec, &d).await {
            Ok(()) => match worker.submit(&req).await {
                Ok(_) => {
                    self.watch_job(worker, rec, &mut version, &d.job_id, progress)
                        .await
                }
                Err(e) => Err(e.into()),
            },
            Err(e) => Err(e.into()),
        };
        let resp = match outcome {
            Ok(r) => r,
            Err(WatchError::Store(e)) => return Err(e.into()),
            Err(WatchError::Dispatch(
                e @ (DispatchError::Unavailable(_)
                | DispatchError::Auth { .. }
                | DispatchError::Tls { .. }),
            )) => {
                rec.fail(FailureKind::WorkerUnavailable, e.to_string());
                self.store.save(rec, version, &[]).await?;
                return Ok(());
            }
            Err(WatchError::Dispatch(e)) => {
                rec.fail(
                    FailureKind::InternalError,
                    format!("worker refused job {}: {e}", d.job_id),
                );
                self.store.save(rec, version, &[]).await?;
                return Ok(());
            }
        };
        crate::metrics::metrics().job(&format!("{:?}", resp.status).to_lowercase());
        self.take_result(worker, rec, &d, &resp, progress).await;
        rec.state.active_job_id = None;
        rec.phase = Phase::Think;
        self.store
            .save(
                rec,
                version,
                &[(
                    "job_result",
                    json!({ "job_id": d.job_id, "status": resp.status }),
                )],
            )
            .await?;
        failpoint("after_result");
        if let Err(e) = worker.ack(&d.job_id).await {
            tracing::warn!(job_id = %d.job_id, error = %e, "ack failed; the worker's retention will clean up");
        }
        Ok(())
    }

    /// Creates the session's workspace (seeded as asked) on the worker its first job was
    /// placed on. Idempotent, so a resumed session repeats it safely.
    async fn prepare_workspace(
        &self,
        worker: &WorkerClient,
        rec: &SessionRecord,
        d: &Dispatch,
    ) -> Result<(), DispatchError> {
        if !d.new_workspace {
            return Ok(());
        }
        let seed = rec.workspace_seed.as_deref().map(std::path::Path::new);
        worker
            .create_workspace(&rec.workspace_id, seed)
            .await
            .map_err(|e| match e {
                DispatchError::Rejected { status, detail } => DispatchError::Rejected {
                    status,
                    detail: format!(
                        "worker {} refused to create the session's workspace: {detail}",
                        d.worker_id
                    ),
                },
                other => other,
            })
    }

    /// Verifies and stores artifacts, updates the plan, and writes the model's summary.
    async fn take_result(
        &self,
        worker: &WorkerClient,
        rec: &mut SessionRecord,
        d: &Dispatch,
        resp: &RunJobResponse,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) {
        let mut ok = resp.status == WorkerJobStatus::Completed;
        if resp.job_id != d.job_id {
            ok = false;
            rec.feedback.push(format!(
                "the worker answered for job {} instead of {}",
                resp.job_id, d.job_id
            ));
        }
        let claimed = resp
            .sba_result
            .as_ref()
            .map(|r| r.artifacts.clone())
            .unwrap_or_default();
        let mut integrity = Vec::new();
        for a in &claimed {
            let fetched = worker.artifact(&d.job_id, &a.path).await;
            let stored = fetched
                .map_err(|e| ArtifactError::Fetch(e.to_string()))
                .and_then(|bytes| {
                    verify_and_store(
                        &self.artifacts_dir,
                        &a.path,
                        &a.sha256,
                        a.size_bytes,
                        &bytes,
                    )
                });
            match stored {
                Ok(loc) => {
                    let location = loc.display().to_string();
                    let _ = self
                        .store
                        .put_artifact(&a.sha256, a.size_bytes, &location)
                        .await;
                    rec.state.artifacts.push(SessionArtifact {
                        record: a.clone(),
                        job_id: d.job_id.clone(),
                        location,
                    });
                }
                Err(ArtifactError::Integrity(e)) => {
                    crate::metrics::metrics().artifact_integrity_failures.inc();
                    integrity.push(e.to_string());
                }
                Err(e) => integrity.push(format!("artifact {}: {e}", a.path)),
            }
        }
        if !integrity.is_empty() {
            ok = false;
            rec.event(
                "artifact_integrity_failure",
                json!({ "job_id": d.job_id, "errors": integrity }),
            );
            rec.feedback.push(format!(
                "artifact_integrity_failure: artifacts of job {} were rejected: {}",
                d.job_id,
                integrity.join("; ")
            ));
        }
        let exhausted =
            rec.attempts.get(&d.task_id).copied().unwrap_or(0) >= rec.budgets.max_attempts_per_task;
        let status = if ok {
            TaskStatus::Done
        } else if exhausted || !integrity.is_empty() {
            TaskStatus::Failed
        } else {
            TaskStatus::Pending
        };
        set_task_status(rec, &d.task_id, status);
        let label = format!("{:?}", resp.status).to_lowercase();
        rec.event(
            "job_finished",
            json!({ "job_id": d.job_id, "status": label, "task_status": status }),
        );
        rec.feedback.push(summarize(d, resp));
        let failure = resp
            .sba_result
            .as_ref()
            .and_then(|r| match (&r.failure_code, &r.failure_message) {
                (Some(c), Some(m)) => Some(format!("{c}: {m}")),
                (Some(c), None) => Some(c.to_string()),
                _ => None,
            })
            .or_else(|| resp.failure_reason.clone())
            .filter(|_| !ok);
        progress(Progress::JobDone {
            job_id: d.job_id.clone(),
            status: label,
            failure: failure.or_else(|| (!integrity.is_empty()).then(|| integrity.join("; "))),
            artifacts: rec
                .state
                .artifacts
                .iter()
                .filter(|a| a.job_id == d.job_id)
                .map(|a| a.record.clone())
                .collect(),
        });
    }
}

/// What a reply asks, in a few words, for progress lines.
fn reply_detail(reply: &LlmOutput) -> String {
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

fn set_task_status(rec: &mut SessionRecord, task_id: &str, status: TaskStatus) {
    if let Some(p) = rec.state.plan.iter_mut().find(|p| p.task_id == task_id) {
        if p.status != status {
            p.status = status;
            p.version += 1;
        }
    }
}

/// Applies the reply's RFC 6902 patch to `{plan, notes}` only; plan entries that change
/// get their version bumped, new ones start at 1.
pub fn apply_state_patch(rec: &mut SessionRecord, reply: &LlmOutput) -> Result<(), String> {
    if reply.state_patch.is_empty() {
        return Ok(());
    }
    for op in &reply.state_patch {
        let allowed = ["/plan", "/notes"]
            .iter()
            .any(|p| op.path == *p || op.path.starts_with(&format!("{p}/")));
        if !allowed {
            return Err(format!("path {} is outside /plan and /notes", op.path));
        }
    }
    let before = rec.state.plan.clone();
    let mut doc = json!({ "plan": rec.state.plan, "notes": rec.state.notes });
    let patch: json_patch::Patch = serde_json::from_value(
        serde_json::to_value(&reply.state_patch).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    json_patch::patch(&mut doc, &patch).map_err(|e| e.to_string())?;
    let mut plan_values = doc["plan"].as_array().cloned().unwrap_or_default();
    for v in &mut plan_values {
        if let Some(o) = v.as_object_mut() {
            o.entry("status").or_insert(json!("pending"));
            o.entry("version").or_insert(json!(0));
        }
    }
    let mut plan: Vec<PlanEntry> =
        serde_json::from_value(Value::Array(plan_values)).map_err(|e| format!("plan: {e}"))?;
    let notes: Vec<String> =
        serde_json::from_value(doc["notes"].clone()).map_err(|e| format!("notes: {e}"))?;
    for p in &mut plan {
        match before.iter().find(|b| b.task_id == p.task_id) {
            Some(b) if b == p => {}
            Some(b) => p.version = b.version + 1,
            None => p.version = 1,
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(dup) = plan.iter().find(|p| !seen.insert(p.task_id.clone())) {
        return Err(format!("duplicate task_id {}", dup.task_id));
    }
    rec.state.plan = plan;
    rec.state.notes = notes;
    Ok(())
}

fn tail(s: &str, n: usize) -> &str {
    let start = s.len().saturating_sub(n);
    let mut i = start;
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}

/// A compact result for the model: statuses, codes, tails, artifacts; never raw megabytes.
pub fn summarize(d: &Dispatch, resp: &RunJobResponse) -> String {
    let mut v = json!({
        "job_id": d.job_id, "task_id": d.task_id, "skill_id": d.skill_id,
        "status": resp.status, "failure_reason": resp.failure_reason,
    });
    if let Some(r) = &resp.sba_result {
        v["failure_code"] = json!(r.failure_code);
        v["failure_message"] = json!(r.failure_message);
        v["steps"] = Value::Array(
            r.steps
                .iter()
                .map(|s| {
                    let mut o = json!({ "id": s.id, "type": s.step_type, "status": s.status });
                    // An upstream worker's result has no typed `result`: its text output.
                    if s.result.is_none() && !s.output.is_empty() {
                        o["output_tail"] = json!(tail(&s.output, 1500));
                    }
                    if let Some(out) = &s.result {
                        let full = serde_json::to_value(out).unwrap_or(Value::Null);
                        for k in [
                            "exit_code",
                            "truncated",
                            "files_modified",
                            "files_created",
                            "files_deleted",
                            "size_bytes",
                            "path",
                        ] {
                            if !full[k].is_null() {
                                o[k] = full[k].clone();
                            }
                        }
                        for k in ["stdout", "stderr", "content"] {
                            if let Some(t) = full[k].as_str() {
                                o[format!("{k}_tail")] = json!(tail(t, 1500));
                            }
                        }
                        if let Some(m) = full["matches"].as_array() {
                            o["matches"] = Value::Array(m.iter().take(30).cloned().collect());
                        }
                        if !full["tree"].is_null() {
                            let t = full["tree"].to_string();
                            o["tree"] = json!(tail(&t, 3000));
                        }
                    }
                    o
                })
                .collect(),
        );
        v["artifacts"] = json!(r.artifacts);
    }
    format!("result of job {}: {}", d.job_id, v)
}

fn state_summary(rec: &SessionRecord) -> Value {
    json!({
        "plan": rec.state.plan,
        "notes": rec.state.notes,
        "artifacts": rec.state.artifacts.iter().map(|a| json!({ "path": a.record.path, "sha256": a.record.sha256 })).collect::<Vec<_>>(),
        "turn": rec.turn,
        "jobs_dispatched": rec.jobs_dispatched,
        "budgets": rec.budgets,
    })
}

fn feedback_text(rec: &SessionRecord) -> Option<String> {
    (!rec.feedback.is_empty()).then(|| rec.feedback.join("\n"))
}

/// Default poll bounds used by callers that do not configure the client.
pub const DEFAULT_POLL: (Duration, Duration) = (Duration::from_millis(50), Duration::from_secs(1));
