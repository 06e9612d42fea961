//! The model's output contract as a JSON Schema built from the live skill
//! registry, and the validator every reply goes through before the PM acts on it.
//!
//! The schema ([`response_schema`]) is what the client sends as `response_format`, so a
//! backend with grammar-constrained decoding (llama.cpp, vLLM, Ollama) can only produce
//! replies of this shape. It is an `anyOf` with one object per reply type, and one per
//! skill for `job_request`, so the payload is tied to `type` and `inputs` to `skill_id`
//! (the grammar-friendly form of "if skill_id then inputs"). `state_patch` operations are
//! spelled out per target (a plan entry, a field of one, a note…) so only patches that
//! keep the session state well-formed fit.
//!
//! The validator ([`ReplyValidator`], [`validate_reply`]) runs, in order: JSON parse; the
//! JSON Schema (jsonschema); the structural and semantic checks, which name the first
//! problem precisely (an `anyOf` failure alone only says "matches none"); serde into
//! [`LlmOutput`] and its typed payload. The semantic checks: `state_patch` paths only
//! under `/plan` and `/notes`, values that fit a plan entry or a note, `job_request`'s
//! `skill_id` in the catalog, its `task_id` known or added by this reply's `state_patch`,
//! and `inputs` valid against that skill's own `inputs_schema` (the original one: the copy
//! inside the response schema drops bounds too large for a grammar). A plan entry's
//! `task_id` is short ([`TASK_ID_PATTERN`]), its `description` one bounded line, and a
//! `skipped` entry says why in its `reason`. A `final` that leaves tasks open is refused
//! by [`check_final_closes_plan`], which the loop runs on the state the reply's patch
//! would make. A [`ContractError`]
//! is written to be shown to the model so it can correct its reply.
//!
//! One file a concern: [`schema`] builds the schema, [`validate`] checks a reply,
//! [`patch`] holds the `state_patch` rules and applies a patch to the session's state, and
//! [`fields`] holds the field checks those two share.

pub mod babble;
mod fields;
mod patch;
mod schema;
#[cfg(test)]
mod tests;
mod validate;

pub use patch::{apply_state_patch, check_final_closes_plan, PatchError};
pub use schema::{response_schema, response_schema_for};
pub use validate::{validate_reply, ReplyValidator};

/// The `json_schema.name` sent in `response_format`.
pub const RESPONSE_SCHEMA_NAME: &str = "cynode_pm_reply";

/// Every `state_patch` path (and `from`) must match this: the plan, the notes, or below.
pub const PATCH_PATH_PATTERN: &str = "^/(plan|notes)(/.*)?$";

/// What a task id looks like (it ends up in job ids, job.json and every progress line):
/// a short name such as `t1` or `fetch-deps`, at most [`TASK_ID_MAX`] characters.
pub const TASK_ID_PATTERN: &str = "^[A-Za-z0-9][A-Za-z0-9._-]{0,31}$";
/// The longest task id, in characters (ASCII).
pub const TASK_ID_MAX: usize = 32;

/// The reply types, in the order the system prompt lists them.
pub const REPLY_TYPES: [&str; 4] = ["plan_update", "job_request", "message", "final"];

/// The statuses of a plan entry (`cynode_protocol::session::TaskStatus`).
pub const TASK_STATUSES: [&str; 6] = [
    "pending",
    "in_progress",
    "done",
    "failed",
    "blocked",
    "skipped",
];

/// The seeds' words for a plan entry's status, which `TaskStatus` reads as ours
/// (`running` is `in_progress`, `completed` is `done`: docs/INTEROP.md): a reply may
/// write them, and the plan is stored in ours.
pub const SEED_TASK_STATUSES: [&str; 2] = ["running", "completed"];

/// Every status a reply may write: ours, then the seeds'.
pub fn reply_task_statuses() -> Vec<&'static str> {
    TASK_STATUSES
        .iter()
        .chain(SEED_TASK_STATUSES.iter())
        .copied()
        .collect()
}

/// The statuses of a task still open: a `final` with one of these in the plan is refused
/// (the model runs the task, or closes it as `skipped` with a `reason`).
pub const OPEN_STATUSES: [&str; 3] = ["pending", "in_progress", "blocked"];

/// At most this many `state_patch` operations per reply (a bound a grammar can enforce, so
/// a small model cannot loop in the list until it runs out of tokens).
pub const MAX_PATCH_OPS: usize = 10;
/// At most this many entries when the whole plan is set at once.
pub const MAX_PLAN_ENTRIES: usize = 50;
/// At most this many notes when the whole notes list is set at once.
pub const MAX_NOTES: usize = 100;
/// At most this many artifacts in a `final` reply.
pub const MAX_ARTIFACTS: usize = 100;
/// Length bounds (in characters) of the free-text fields. They are tight on purpose: a
/// grammar-constrained backend must close the string within the bound, so a small model
/// that starts repeating itself ends its sentence instead of running into max_tokens
/// (SmolLM2 did, in a 2000-character summary). Details belong in artifacts.
/// The note of a plan_update is the loop's most wasted text: SmolLM2-135M filled all 300
/// characters it once had with one repeated clause, on every plan-only turn.
pub const DESCRIPTION_MAX: usize = 200;
pub const NOTE_MAX: usize = 160;
/// Why a task was skipped (a plan entry's `reason`): one short sentence.
pub const REASON_MAX: usize = 160;
pub const TEXT_MAX: usize = 500;
pub const SUMMARY_MAX: usize = 800;
pub const ARTIFACT_REF_MAX: usize = 128;

/// Bounds above this are dropped from the skill schemas embedded in the response schema:
/// grammar engines expand `{0,N}` into N rules. The skill's own schema still enforces them.
pub(super) const GRAMMAR_BOUND_LIMIT: u64 = 1024;

/// At most this many schema errors are reported at once.
pub(super) const MAX_REPORTED_ERRORS: usize = 5;

/// A JSON array index in a pointer: `0` or no leading zero.
pub(super) const INDEX: &str = "(0|[1-9][0-9]*)";

/// Why a reply breaks the contract. The `Display` text is fed back to the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContractError {
    /// Nothing but whitespace came back.
    #[error("the reply is empty{}; answer with one JSON object", finish_reason.as_ref().map(|r| format!(" (finish_reason: {r})")).unwrap_or_default())]
    Empty { finish_reason: Option<String> },
    /// The reply does not parse as JSON.
    #[error("the reply is not valid JSON ({0}); answer with one JSON object and nothing else")]
    NotJson(String),
    /// The reply ran into the token limit before its JSON was complete.
    #[error("your reply was cut off after {max_tokens} tokens before the JSON was complete; reply again much shorter: one short sentence per text field and as few state_patch operations as possible")]
    Truncated { max_tokens: u32 },
    /// A field is missing, unknown, of the wrong type or out of range.
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
    /// A `state_patch` operation targets something other than the plan or the notes.
    #[error("state_patch[{index}].{field}: `{pointer}` is outside the plan and notes; only /plan, /notes and paths below them may be patched")]
    ForbiddenPatchPath {
        index: usize,
        field: String,
        pointer: String,
    },
    /// `job_request` names a skill that is not registered.
    #[error("payload.skill_id: unknown skill `{skill_id}`; known skills: {}", known.join(", "))]
    UnknownSkill {
        skill_id: String,
        known: Vec<String>,
    },
    /// `job_request` names a task that is neither in the plan nor added by this reply.
    #[error(
        "payload.task_id: unknown task `{task_id}`; {}",
        known_tasks_hint(known)
    )]
    UnknownTask { task_id: String, known: Vec<String> },
    /// `job_request.inputs` do not validate against the skill's input schema.
    #[error("payload.inputs do not match the input schema of skill `{skill_id}`: {}", errors.join("; "))]
    InvalidInputs {
        skill_id: String,
        errors: Vec<String>,
    },
    /// The reply breaks the response schema in a way the checks above do not name.
    #[error("the reply does not match the response schema: {}", errors.join("; "))]
    Schema { errors: Vec<String> },
    /// A text of the reply (summary, note, message, task description) is babble: a
    /// repeated clause or text that copies itself ([`babble`]).
    #[error("{path} is refused as babble: {why}")]
    Babble { path: String, why: babble::Babble },
    /// A check of the caller's refused the reply (e.g. its `state_patch` does not apply
    /// to the current state).
    #[error("{0}")]
    Rejected(String),
    /// A schema given to the validator does not compile (a PM bug, not the model's).
    #[error("{which} is not a valid JSON Schema: {message}")]
    InvalidSchema { which: String, message: String },
}

impl ContractError {
    /// True when asking the model again (with this error) may give a valid reply; false for
    /// the PM's own mistakes.
    pub fn is_retryable(&self) -> bool {
        match self {
            ContractError::Empty { .. }
            | ContractError::Truncated { .. }
            | ContractError::NotJson(_)
            | ContractError::Invalid { .. }
            | ContractError::ForbiddenPatchPath { .. }
            | ContractError::UnknownSkill { .. }
            | ContractError::UnknownTask { .. }
            | ContractError::InvalidInputs { .. }
            | ContractError::Schema { .. }
            | ContractError::Babble { .. }
            | ContractError::Rejected(_) => true,
            ContractError::InvalidSchema { .. } => false,
        }
    }
}

pub(super) fn known_tasks_hint(known: &[String]) -> String {
    if known.is_empty() {
        "the plan has no tasks yet: add the task to /plan in this reply's state_patch \
         ({\"op\": \"add\", \"path\": \"/plan/-\", \"value\": {\"task_id\": \"t1\", \
         \"description\": \"…\", \"status\": \"pending\"}})"
            .to_string()
    } else {
        format!(
            "known tasks: {}; a new task must be added to /plan in this reply's state_patch",
            known.join(", ")
        )
    }
}

pub(super) fn invalid(path: impl Into<String>, message: impl Into<String>) -> ContractError {
    ContractError::Invalid {
        path: path.into(),
        message: message.into(),
    }
}
