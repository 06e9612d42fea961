//! Agent mode (`execution_mode: agent_inference`): the runner asks a model for one action
//! at a time and carries it out, until the model finishes or a bound is reached.
//!
//! - [`client`]: endpoint discovery, the served model list, chat completions.
//! - [`contract`]: the JSON action contract (`response_format` schema and strict parser).
//! - [`prompt`]: system prompt, job message, observations.
//! - [`text`]: the byte bound of every text the agent sends or shows.
//! - [`todo`]: the todo list, persisted to todo.json after every change.
//! - [`tools`]: gateway tools (`tool_call`), limited to the job's `context.mcp_tools`.
//!
//! Every step the model asks for goes through [`crate::step_runner::run_step`], the same code
//! direct steps use (confinement, allowlists, output caps, deadlines), and is recorded in
//! result.json `steps`. The model is checked before any step runs: it must be in
//! `inference.allowed_models` and served by the endpoint.
//!
//! A `tool_call` of a tool the job does not list is refused before anything is sent; every
//! call (refusals included) is recorded in result.json `tool_calls` and its outcome, cut
//! to size, is the model's next observation. Tool refusals and failures do not end the
//! job (the model may work around them); the deadline and an interrupt do.

pub mod client;
pub mod contract;
pub mod prompt;
pub mod text;
pub mod todo;
pub mod tools;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Instant;

use cynode_protocol::result::JobResult;
use cynode_protocol::FailureCode;
use serde_json::{json, Value};

use crate::steps::StepContext;
use client::{ClientError, Endpoint};
use contract::Action;
use todo::Todo;

/// Replies in a row that may fail to parse before the job fails.
pub const MAX_INVALID_REPLIES: u32 = 3;
/// Default bound on model calls per job.
pub const DEFAULT_MAX_TURNS: u32 = 30;
/// `max_tokens` of every completion.
pub const MAX_COMPLETION_TOKENS: u32 = 1024;
/// Budget of the conversation history sent each turn, in bytes (oldest turns drop first;
/// the system prompt and the job message always stay).
pub const HISTORY_BUDGET_BYTES: usize = 24 * 1024;

/// Agent settings the node or the command line gives (never the job).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where todo.json goes; none in stdin mode unless set.
    pub todo_path: Option<PathBuf>,
    pub max_turns: u32,
    /// A model to use instead of the first allowed one the endpoint serves.
    pub model: Option<String>,
    /// The node's gateway socket ([`tools::DEFAULT_GATEWAY_URL`] unless the node says
    /// otherwise with `SBA_GATEWAY_URL`).
    pub gateway_url: String,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            todo_path: None,
            max_turns: DEFAULT_MAX_TURNS,
            model: None,
            gateway_url: tools::DEFAULT_GATEWAY_URL.to_string(),
        }
    }
}

/// Step codes that end an agent job, as they end a direct one. Others (a command that
/// failed or could not start, a missing network) are fed back for the model to handle.
fn ends_job(code: FailureCode) -> bool {
    match code {
        FailureCode::Timeout
        | FailureCode::InternalError
        | FailureCode::PolicyViolation
        | FailureCode::ConstraintViolation
        | FailureCode::ResourceLimitExceeded
        | FailureCode::SchemaValidation => true,
        FailureCode::StepFailed | FailureCode::ExecutionFailure | FailureCode::ExtNetRequired => {
            false
        }
    }
}

/// Runs the agent loop; fills `result` (steps, todo, final_answer, failure).
pub fn run(ctx: &StepContext<'_>, settings: &Settings, result: &mut JobResult) {
    let todo = Todo::seed(ctx.job, settings.todo_path.clone());
    todo.persist();
    let mut agent = Agent {
        ctx,
        settings,
        todo,
        messages: Vec::new(),
        usage: client::Usage::default(),
    };
    if let Err((code, message)) = agent.run(result) {
        result.set_failure(code, message);
    }
    agent.todo.persist();
    result.todo = Some(agent.todo.items().to_vec());
    tracing::info!(
        job_id = %ctx.job.job_id,
        prompt_tokens = agent.usage.prompt_tokens,
        completion_tokens = agent.usage.completion_tokens,
        "agent finished"
    );
}

struct Agent<'a, 'c> {
    ctx: &'a StepContext<'c>,
    settings: &'a Settings,
    todo: Todo,
    messages: Vec<Value>,
    usage: client::Usage,
}

type Failure = (FailureCode, String);

impl From<ClientError> for (FailureCode, String) {
    fn from(e: ClientError) -> Self {
        (e.code, e.message)
    }
}

impl Agent<'_, '_> {
    fn remaining_secs(&self) -> u64 {
        self.ctx
            .deadline
            .saturating_duration_since(Instant::now())
            .as_secs()
    }

    fn run(&mut self, result: &mut JobResult) -> Result<(), Failure> {
        let job = self.ctx.job;
        let allowed = job
            .inference
            .as_ref()
            .map(|i| i.allowed_models.clone())
            .unwrap_or_default();
        if allowed.is_empty() {
            return Err((
                FailureCode::SchemaValidation,
                "inference.allowed_models: agent_inference needs at least one allowed model".into(),
            ));
        }
        if let Some(m) = &self.settings.model {
            if !allowed.contains(m) {
                return Err((
                    FailureCode::PolicyViolation,
                    format!(
                        "model `{m}` is not in inference.allowed_models ({})",
                        allowed.join(", ")
                    ),
                ));
            }
        }
        let endpoint =
            Endpoint::discover().map_err(|e| (FailureCode::ExecutionFailure, e.to_string()))?;
        let served = endpoint.models(self.ctx.deadline, self.ctx.interrupted)?;
        let wanted: Vec<&String> = match &self.settings.model {
            Some(m) => vec![m],
            None => allowed.iter().collect(),
        };
        let Some(model) = wanted.into_iter().find(|m| served.contains(m)).cloned() else {
            return Err((
                FailureCode::ExecutionFailure,
                format!(
                    "inference endpoint {} (from {}) serves none of the allowed models ({}); it serves: {}",
                    endpoint.url,
                    endpoint.source,
                    allowed.join(", "),
                    if served.is_empty() { "nothing".into() } else { served.join(", ") }
                ),
            ));
        };
        tracing::info!(job_id = %job.job_id, model = %model, endpoint = %endpoint.url, source = endpoint.source, "agent started");
        let ws = self.ctx.ws.root_path().display().to_string();
        let tools: Vec<String> = job
            .context
            .as_ref()
            .map(|c| c.mcp_tools.clone())
            .unwrap_or_default();
        let mut gateway = if tools.is_empty() {
            None
        } else {
            Some(
                tools::Gateway::new(&self.settings.gateway_url).map_err(|e| {
                    (
                        FailureCode::ExecutionFailure,
                        format!("gateway url {}: {e}", self.settings.gateway_url),
                    )
                })?,
            )
        };
        let response_format = contract::response_format(&tools);
        self.messages = vec![
            json!({ "role": "system", "content": prompt::system(&ws, &tools) }),
            json!({ "role": "user", "content": prompt::job_message(job, self.remaining_secs(), self.settings.max_turns, &self.todo.render()) }),
        ];
        let mut invalid = 0u32;
        let mut finish_refused = false;
        let mut steps_run = 0usize;
        for turn in 1..=self.settings.max_turns {
            if self.ctx.interrupted.load(Ordering::Relaxed) {
                return Err((
                    FailureCode::InternalError,
                    "runner interrupted by SIGTERM".into(),
                ));
            }
            if Instant::now() >= self.ctx.deadline {
                return Err((
                    FailureCode::Timeout,
                    format!(
                        "job deadline of {}s (constraints.max_runtime_seconds) reached after {} model turns",
                        self.ctx.runtime_seconds,
                        turn - 1
                    ),
                ));
            }
            let turns_left = self.settings.max_turns - turn;
            let body = json!({
                "model": model,
                "messages": self.window(),
                "response_format": response_format,
                "temperature": 0.2,
                "max_tokens": MAX_COMPLETION_TOKENS,
                "stream": false
            });
            let t = Instant::now();
            let reply = endpoint.chat(&body, self.ctx.deadline, self.ctx.interrupted)?;
            if let Some(u) = reply.usage {
                self.usage.prompt_tokens += u.prompt_tokens;
                self.usage.completion_tokens += u.completion_tokens;
            }
            let parsed = if reply.truncated {
                Err(contract::ReplyError::CutOff(MAX_COMPLETION_TOKENS))
            } else {
                contract::parse(&reply.content)
            };
            tracing::info!(
                job_id = %job.job_id,
                turn,
                duration_ms = t.elapsed().as_millis() as u64,
                prompt_tokens = reply.usage.map(|u| u.prompt_tokens),
                completion_tokens = reply.usage.map(|u| u.completion_tokens),
                action = parsed.as_ref().map(|r| action_name(&r.action)).unwrap_or("invalid"),
                thought = parsed.as_ref().map(|r| r.thought.as_str()).unwrap_or(""),
                "model turn"
            );
            self.messages.push(
                json!({ "role": "assistant", "content": text::cut(&reply.content, 8 * 1024) }),
            );
            let reply = match parsed {
                Ok(r) => {
                    invalid = 0;
                    r
                }
                Err(why) => {
                    invalid += 1;
                    if invalid >= MAX_INVALID_REPLIES {
                        return Err((
                            FailureCode::ExecutionFailure,
                            format!(
                                "the model gave no valid action in {invalid} replies in a row; last problem: {why}"
                            ),
                        ));
                    }
                    self.feedback(
                        format!("Your reply was not a valid action: {why}\nReply with exactly one JSON object as described."),
                        turns_left,
                    );
                    continue;
                }
            };
            match reply.action {
                Action::Step(action) => {
                    steps_run += 1;
                    let id = format!("agent-{steps_run}");
                    let rec = crate::step_runner::run_step(self.ctx, &id, &action);
                    let obs = prompt::observation(&rec, self.remaining_secs(), turns_left);
                    let stop = rec
                        .error_info()
                        .filter(|e| ends_job(e.kind))
                        .map(|e| (e.kind, format!("step {id}: {}", e.message)));
                    result.push_step(rec);
                    if let Some(f) = stop {
                        return Err(f);
                    }
                    self.messages
                        .push(json!({ "role": "user", "content": obs }));
                }
                Action::ToolCall { name, arguments } => {
                    // Listed tools imply a gateway (`tools` is not empty).
                    let called = match (tools::unlisted(&name, &tools), gateway.as_mut()) {
                        (Some(why), _) => tools::Called::refused(&name, why),
                        (None, Some(gw)) => {
                            gw.call(&name, &arguments, self.ctx.deadline, self.ctx.interrupted)
                        }
                        (None, None) => {
                            tools::Called::refused(&name, "no gateway for this job".into())
                        }
                    };
                    tracing::info!(
                        job_id = %job.job_id,
                        tool = %name,
                        outcome = ?called.record.outcome,
                        bytes = called.record.bytes,
                        duration_ms = called.record.duration_ms,
                        "tool call"
                    );
                    let obs = prompt::tool_observation(
                        &name,
                        called.record.outcome,
                        &called.text,
                        self.remaining_secs(),
                        turns_left,
                    );
                    result.tool_calls.push(called.record);
                    if let Some(f) = called.fatal {
                        return Err(f);
                    }
                    self.messages
                        .push(json!({ "role": "user", "content": obs }));
                }
                Action::Todo(upd) => match self.todo.apply(&upd) {
                    Ok(()) => {
                        self.todo.persist();
                        self.feedback(
                            format!("Todo list updated:\n{}", self.todo.render()),
                            turns_left,
                        );
                    }
                    Err(why) => {
                        invalid += 1;
                        if invalid >= MAX_INVALID_REPLIES {
                            return Err((
                                FailureCode::ExecutionFailure,
                                format!("the model gave no valid action in {invalid} replies in a row; last problem: {why}"),
                            ));
                        }
                        self.feedback(
                            format!("{why}\nTodo list:\n{}", self.todo.render()),
                            turns_left,
                        );
                    }
                },
                Action::Finish {
                    success: true,
                    final_answer,
                } => {
                    let open: Vec<String> = self
                        .todo
                        .open()
                        .iter()
                        .map(|i| format!("{} ({})", i.id, i.description))
                        .collect();
                    if open.is_empty() {
                        result.final_answer = Some(final_answer);
                        return Ok(());
                    }
                    if finish_refused {
                        return Err((
                            FailureCode::StepFailed,
                            format!(
                                "the agent finished with {} todo items not done: {}; its answer: {final_answer}",
                                open.len(),
                                open.join("; ")
                            ),
                        ));
                    }
                    finish_refused = true;
                    self.feedback(
                        format!(
                            "You cannot finish with success yet: these todo items are not done: {}. \
Do them and complete them with the todo action, or finish with status failure.",
                            open.join("; ")
                        ),
                        turns_left,
                    );
                }
                Action::Finish {
                    success: false,
                    final_answer,
                } => {
                    return Err((
                        FailureCode::StepFailed,
                        format!("the agent gave up: {final_answer}"),
                    ));
                }
            }
        }
        Err((
            FailureCode::ExecutionFailure,
            format!(
                "the agent used all {} turns without finishing",
                self.settings.max_turns
            ),
        ))
    }

    fn feedback(&mut self, text: String, turns_left: u32) {
        let content = text + &prompt::footer(self.remaining_secs(), turns_left);
        self.messages
            .push(json!({ "role": "user", "content": content }));
    }

    /// The system prompt and job message, then the newest messages that fit the budget,
    /// starting with an assistant message so roles keep alternating.
    fn window(&self) -> Vec<Value> {
        let size = |m: &Value| m["content"].as_str().map_or(0, str::len);
        let (head, tail) = self.messages.split_at(2.min(self.messages.len()));
        let mut used = 0;
        let mut start = tail.len();
        for (i, m) in tail.iter().enumerate().rev() {
            used += size(m);
            if used > HISTORY_BUDGET_BYTES {
                break;
            }
            start = i;
        }
        while start < tail.len() && tail[start]["role"] != "assistant" {
            start += 1;
        }
        if start == tail.len() && !tail.is_empty() {
            // Even the newest exchange is over budget: send it anyway.
            start = tail.len().saturating_sub(2);
        }
        head.iter().chain(&tail[start..]).cloned().collect()
    }
}

fn action_name(a: &Action) -> &'static str {
    match a {
        Action::Step(s) => s.step_type().as_str(),
        Action::ToolCall { .. } => "tool_call",
        Action::Todo(_) => "todo",
        Action::Finish { .. } => "finish",
    }
}
