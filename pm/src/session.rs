//! What the PM keeps about one session: the protocol's [`SessionState`] (objective,
//! plan, artifacts, history…) plus where the loop is ([`Phase`]), its budgets, and the
//! outcome. Serialised whole into the store.

pub mod egress;
pub mod evidence;

use std::collections::BTreeMap;

use cynode_protocol::llm::LlmOutput;
use cynode_protocol::session::{HistoryEvent, SessionState};
use serde::{Deserialize, Serialize};

/// Session status as the API and CLI show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionStatus {
    Running,
    AwaitingInput,
    Completed,
    Failed,
    Canceled,
}

impl SessionStatus {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            SessionStatus::Running => "running",
            SessionStatus::AwaitingInput => "awaiting_input",
            SessionStatus::Completed => "completed",
            SessionStatus::Failed => "failed",
            SessionStatus::Canceled => "canceled",
        }
    }

    /// True once nothing more will happen.
    pub fn is_terminal(self) -> bool {
        match self {
            SessionStatus::Running | SessionStatus::AwaitingInput => false,
            SessionStatus::Completed | SessionStatus::Failed | SessionStatus::Canceled => true,
        }
    }
}

/// The ways a session fails (its `failure.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The model kept answering outside the contract.
    ModelContractViolation,
    /// The model endpoint could not be reached.
    ModelUnavailable,
    /// A task ran out of attempts and its last one was denied by the policy (each denial
    /// is fed back to the model first).
    PolicyViolation,
    /// A task ran out of attempts and its last job's artifacts did not match their
    /// sha256 (each such job is fed back to the model first).
    ArtifactIntegrityFailure,
    /// The worker could not be reached after retries. The PM seed's `worker_failure` is
    /// read as this.
    #[serde(alias = "worker_failure")]
    WorkerUnavailable,
    /// A task ran out of attempts for any other reason (its jobs failed).
    TaskFailed,
    /// Turns, jobs or wall-clock ran out.
    BudgetExhausted,
    /// The session was canceled.
    Canceled,
    /// A bug or an unexpected state.
    InternalError,
}

impl FailureKind {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::ModelContractViolation => "model_contract_violation",
            FailureKind::ModelUnavailable => "model_unavailable",
            FailureKind::PolicyViolation => "policy_violation",
            FailureKind::ArtifactIntegrityFailure => "artifact_integrity_failure",
            FailureKind::WorkerUnavailable => "worker_unavailable",
            FailureKind::TaskFailed => "task_failed",
            FailureKind::BudgetExhausted => "budget_exhausted",
            FailureKind::Canceled => "canceled",
            FailureKind::InternalError => "internal_error",
        }
    }
}

/// Why a session failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    pub kind: FailureKind,
    pub message: String,
}

/// A job the loop dispatched (or is about to).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Dispatch {
    pub job_id: String,
    pub task_id: String,
    pub skill_id: String,
    pub attempt: u32,
    /// The canonical job.json.
    pub job_json: String,
    /// The registry id of the worker it runs on (the session's workspace worker).
    #[serde(default)]
    pub worker_id: String,
    /// The sandbox image that worker serves the skill's purpose with.
    #[serde(default)]
    pub image: String,
    /// This job placed the session's workspace: create it on the worker before submitting.
    #[serde(default)]
    pub new_workspace: bool,
}

/// Where the loop is. Each transition is saved before the work it leads to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum Phase {
    /// Ask the model for the reply of `turn` (unless the journal has it).
    Think,
    /// Act on a reply already journaled.
    Act { reply: LlmOutput },
    /// A dispatch decision is journaled; (re)submit and wait for the result.
    Await { dispatch: Dispatch },
    /// A question is out; wait for the user's answer.
    AwaitInput { question: String },
    /// Nothing left to do.
    Done,
}

/// The deliverable of a completed session: composed by the PM from the evidence it
/// verified ([`evidence`]); the model's words are only its bounded `summary`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Deliverable {
    /// The model's summary, at most [`evidence::SUMMARY_CHARS`] characters on one line.
    pub summary: String,
    /// Per task, its jobs and what each verifiably found, then the summary.
    #[serde(default)]
    pub report: evidence::EvidenceReport,
    /// `(path, sha256, size)` of every verified artifact.
    pub artifacts: Vec<cynode_protocol::result::ArtifactRecord>,
    /// The workspace changeset (`git diff` style), when files changed.
    pub changeset: Option<String>,
}

/// Limits of one session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budgets {
    pub max_turns: u32,
    pub max_jobs: u32,
    pub max_attempts_per_task: u32,
    pub wall_clock_seconds: u64,
    /// Plan-only replies in a row before a turn must act (the progress guard of
    /// `llm::turn`); 0 turns the guard off.
    #[serde(default = "default_plan_only_streak")]
    pub max_plan_only_streak: u32,
}

/// After this many `plan_update` replies in a row, the next turn must act (the default of
/// [`Budgets::max_plan_only_streak`]; the guard is in `llm::turn`).
pub const MAX_PLAN_ONLY_STREAK: u32 = 3;

fn default_plan_only_streak() -> u32 {
    MAX_PLAN_ONLY_STREAK
}

impl Default for Budgets {
    fn default() -> Self {
        Self {
            max_turns: 30,
            max_jobs: 20,
            max_attempts_per_task: 3,
            wall_clock_seconds: 3600,
            max_plan_only_streak: default_plan_only_streak(),
        }
    }
}

/// Everything stored about a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionRecord {
    pub state: SessionState,
    pub tenant_id: String,
    pub status: SessionStatus,
    pub phase: Phase,
    /// The turn whose reply the loop needs next (or acts on).
    pub turn: u32,
    pub jobs_dispatched: u32,
    /// task_id → attempts used.
    pub attempts: BTreeMap<String, u32>,
    /// What the model has not seen yet (job summaries, denials, answers), oldest first.
    pub feedback: Vec<String>,
    pub budgets: Budgets,
    pub workspace_id: String,
    /// The worker holding the workspace, chosen by the first job; every later job goes
    /// there too.
    #[serde(default)]
    pub worker_id: Option<String>,
    /// Host directory (on the worker) the workspace is seeded from when it is created.
    #[serde(default)]
    pub workspace_seed: Option<String>,
    pub started_at_ms: i64,
    /// A person can answer the model's questions (`message`); without one the turn rules
    /// never offer `message` (`llm::turn`).
    #[serde(default = "interactive_by_default")]
    pub interactive: bool,
    pub deliverable: Option<Deliverable>,
    pub failure: Option<Failure>,
    /// The verified outcome of every job whose result was taken in, in order.
    #[serde(default)]
    pub evidence: Vec<evidence::JobEvidence>,
}

fn interactive_by_default() -> bool {
    true
}

impl SessionRecord {
    /// A new running session.
    pub fn new(session_id: &str, tenant_id: &str, objective: &str, budgets: Budgets) -> Self {
        SessionRecord {
            state: SessionState {
                session_id: session_id.to_string(),
                objective: objective.to_string(),
                constraints: Default::default(),
                plan: Vec::new(),
                artifacts: Vec::new(),
                active_job_id: None,
                history: Vec::new(),
                skill_context: BTreeMap::new(),
                notes: Vec::new(),
            },
            tenant_id: tenant_id.to_string(),
            status: SessionStatus::Running,
            phase: Phase::Think,
            turn: 0,
            jobs_dispatched: 0,
            attempts: BTreeMap::new(),
            feedback: Vec::new(),
            budgets,
            workspace_id: session_id.to_string(),
            worker_id: None,
            workspace_seed: None,
            started_at_ms: now_ms(),
            interactive: true,
            deliverable: None,
            failure: None,
            evidence: Vec::new(),
        }
    }

    /// Appends a history event.
    pub fn event(&mut self, kind: &str, data: serde_json::Value) {
        let seq = self.state.history.len() as u64 + 1;
        self.state.history.push(HistoryEvent {
            seq,
            at: cynode_protocol::time::now_rfc3339(),
            kind: kind.to_string(),
            data,
        });
    }

    /// The session's evidence report: the stored deliverable's, or composed from what was
    /// verified so far (no summary) when the session has no deliverable.
    pub fn report(&self) -> evidence::EvidenceReport {
        match &self.deliverable {
            Some(d) if !d.report.tasks.is_empty() || d.report.summary.is_some() => d.report.clone(),
            Some(d) => evidence::compose(&self.state.plan, &self.evidence, Some(&d.summary)),
            None => evidence::compose(&self.state.plan, &self.evidence, None),
        }
    }

    /// Ends the session as failed.
    pub fn fail(&mut self, kind: FailureKind, message: impl Into<String>) {
        let message = message.into();
        self.event(
            "failed",
            serde_json::json!({ "kind": kind.as_str(), "message": message }),
        );
        self.failure = Some(Failure { kind, message });
        self.status = SessionStatus::Failed;
        self.phase = Phase::Done;
        self.state.active_job_id = None;
    }
}

/// Milliseconds since the epoch.
pub fn now_ms() -> i64 {
    (time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}
