//! The session loop: load state, ask the model, act on plan_update / job_request /
//! message / final, wait for results, update, repeat. One file a phase: [`think`] (ask
//! the model), [`act`] (carry out the reply), [`await_job`] (run the job on its worker),
//! [`feedback`] (take the result in for the next turn).
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

mod act;
mod await_job;
mod feedback;
mod think;

pub use crate::llm::contract::apply_state_patch;
pub use feedback::summarize;

use std::path::PathBuf;

use cynode_protocol::result::ArtifactRecord;
use cynode_protocol::session::PlanEntry;
use cynode_protocol::worker_api::AsyncJobState;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::llm::{self, LlmClient};
use crate::policy::{PolicyGate, TenantPolicy};
use crate::session::{Phase, SessionRecord, SessionStatus};
use crate::skills::Registry;
use crate::store::{Store, StoreError};
use crate::workers::WorkerPool;

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
        /// What the job tells the sandbox of the work, in one line ([`job_brief`]).
        context: Option<String>,
        /// The models the job may reach and how, in one line ([`job_brief`]); `None`
        /// for a job without inference.
        model: Option<String>,
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
    /// The sandbox gateway (`/v1/gateway` of `serve`) as the workers reach it. When set,
    /// each dispatched job that lists tools in its `context.mcp_tools` gets a job token
    /// for them ([`crate::gateway`]), handed to the
    /// worker in the Worker API request (never in job.json) and revoked when the job ends.
    pub gateway_url: Option<String>,
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
}

/// The context and model lines of a job's progress: from its job.json, the task it is
/// given (`task_context`, cut to 120 characters) and how many acceptance criteria and
/// requirements it carries; and, for a job that may use inference, its mode, the models
/// it allows and the endpoints the sandbox reaches them at (the node's inference proxy;
/// the node's upstream and key never enter the sandbox).
pub fn job_brief(job_json: &str) -> (Option<String>, Option<String>) {
    let Ok(job) = serde_json::from_str::<serde_json::Value>(job_json) else {
        return (None, None);
    };
    let ctx = &job["context"];
    let context = ctx["task_context"].as_str().map(|task| {
        let mut t: String = task.chars().take(120).collect();
        if t.len() < task.len() {
            t.push('…');
        }
        let count = |k: &str| ctx[k].as_array().map_or(0, Vec::len);
        format!(
            "\"{t}\", {} acceptance criteria, {} requirements",
            count("acceptance_criteria"),
            count("requirements")
        )
    });
    let models: Vec<&str> = job["inference"]["allowed_models"]
        .as_array()
        .map(|a| a.iter().filter_map(|m| m.as_str()).collect())
        .unwrap_or_default();
    let mode = job["execution_mode"].as_str().unwrap_or("basic");
    let model = (!models.is_empty()).then(|| {
        format!(
            "{mode}, models {} through the node's inference proxy (OPENAI_BASE_URL \
             http://127.0.0.1:11434/v1, OLLAMA_BASE_URL http://127.0.0.1:11434)",
            models.join(", ")
        )
    });
    (context, model)
}

#[cfg(test)]
mod brief_tests {
    use super::job_brief;

    #[test]
    fn the_brief_names_the_task_its_checks_and_the_models() {
        let job = serde_json::json!({
            "execution_mode": "agent_inference",
            "inference": { "allowed_models": ["smollm2", "m2"] },
            "context": { "task_context": "x".repeat(200), "acceptance_criteria": ["a", "b"] }
        });
        let (context, model) = job_brief(&job.to_string());
        let context = context.unwrap();
        assert!(
            context.starts_with(&format!("\"{}…\"", "x".repeat(120))),
            "{context}"
        );
        assert!(
            context.ends_with("2 acceptance criteria, 0 requirements"),
            "{context}"
        );
        let model = model.unwrap();
        assert!(
            model.starts_with("agent_inference, models smollm2, m2 through"),
            "{model}"
        );
        assert!(
            model.contains("OPENAI_BASE_URL http://127.0.0.1:11434/v1"),
            "{model}"
        );
    }

    #[test]
    fn a_job_without_inference_or_context_has_no_lines() {
        assert_eq!(job_brief(r#"{"steps": []}"#), (None, None));
        assert_eq!(job_brief("not json"), (None, None));
    }
}
