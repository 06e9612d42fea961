//! result.json: what the SBA reports. Always complete JSON.
//!
//! Written so that upstream CyNodeAI's `sbajob.Result` decodes it: each
//! step carries upstream's step-level `index`, `exit_code`, `output` and a string `error`
//! beside this project's own `id`, `duration_ms`, typed `result` and `failure_code`.
//!
//! Read tolerantly (it comes back from a peer, possibly an upstream worker that kept only
//! the fields of its own type): unknown fields are ignored, and what upstream does not
//! write (`task_id`, timestamps, `resource_usage`, step ids…) defaults. Upstream's Go
//! writes empty slices as `null`; `steps` and `artifacts` read `null` as empty.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::job::StepType;

mod output_text;

/// Final status of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    Success,
    Failure,
    Timeout,
}

/// Status of one step; `skipped` for steps after the one that stopped the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StepStatus {
    Success,
    Failure,
    Timeout,
    Skipped,
}

/// The stable failure codes. Never renamed; new ones only in a new minor version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FailureCode {
    /// job.json did not parse or validate.
    // Read also as the seeds' `schema_error` (docs/INTEROP.md, "The seeds' words").
    #[serde(alias = "schema_error")]
    SchemaValidation,
    /// A path escaped the workspace, or an allowlist refused a command or path.
    PolicyViolation,
    /// A step ran and failed (non-zero exit, hunk did not apply…).
    StepFailed,
    /// The job deadline passed.
    Timeout,
    /// A step's output went over `max_output_bytes`.
    ConstraintViolation,
    /// Out of memory, out of pids.
    ResourceLimitExceeded,
    /// The job needs external network it is not allowed.
    ExtNetRequired,
    /// A command could not be started.
    ExecutionFailure,
    /// A bug or an outside interruption of the runner itself.
    InternalError,
}

impl FailureCode {
    /// The wire name, e.g. `policy_violation`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureCode::SchemaValidation => "schema_validation",
            FailureCode::PolicyViolation => "policy_violation",
            FailureCode::StepFailed => "step_failed",
            FailureCode::Timeout => "timeout",
            FailureCode::ConstraintViolation => "constraint_violation",
            FailureCode::ResourceLimitExceeded => "resource_limit_exceeded",
            FailureCode::ExtNetRequired => "ext_net_required",
            FailureCode::ExecutionFailure => "execution_failure",
            FailureCode::InternalError => "internal_error",
        }
    }

    /// Every code, in wire order.
    pub const ALL: [FailureCode; 9] = [
        FailureCode::SchemaValidation,
        FailureCode::PolicyViolation,
        FailureCode::StepFailed,
        FailureCode::Timeout,
        FailureCode::ConstraintViolation,
        FailureCode::ResourceLimitExceeded,
        FailureCode::ExtNetRequired,
        FailureCode::ExecutionFailure,
        FailureCode::InternalError,
    ];
}

impl std::fmt::Display for FailureCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `{ "type": <failure code>, "message": ... }` (the rough spec's error shape).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorInfo {
    #[serde(rename = "type")]
    pub kind: FailureCode,
    pub message: String,
}

/// `null` or a value, read as the value or its default (Go writes nil slices as `null`).
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// A complete result.json.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct JobResult {
    pub protocol_version: String,
    pub job_id: String,
    /// Absent from upstream CyNodeAI's result (read as empty).
    #[serde(default)]
    pub task_id: String,
    pub status: JobStatus,
    /// RFC 3339; absent from upstream's result (read as empty).
    #[serde(default)]
    pub started_at: String,
    /// RFC 3339; absent from upstream's result (read as empty).
    #[serde(default)]
    pub finished_at: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub steps: Vec<StepRecord>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub artifacts: Vec<ArtifactRecord>,
    #[serde(default)]
    pub resource_usage: ResourceUsage,
    #[serde(default)]
    pub failure_code: Option<FailureCode>,
    #[serde(default)]
    pub failure_message: Option<String>,
    #[serde(default)]
    pub error: Option<ErrorInfo>,
    #[serde(default)]
    pub final_answer: Option<String>,
    #[serde(default)]
    pub todo: Option<Vec<TodoItem>>,
    /// Agent mode: every gateway tool call the model asked for, in order (refusals
    /// included). Absent when there were none; absent from upstream's result.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallRecord>,
}

/// One gateway tool call of an agent job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ToolCallRecord {
    /// The tool the model named.
    pub tool: String,
    /// `ok`, `refused` (by the SBA, before any call, or by the gateway) or `error` (the
    /// call failed: no gateway, transport, a malformed reply).
    pub outcome: ToolCallOutcome,
    /// Bytes of the gateway's reply (0 when nothing was sent).
    pub bytes: u64,
    pub duration_ms: u64,
    /// Why it was refused or failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// How a tool call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallOutcome {
    Ok,
    Refused,
    Error,
}

/// One step as it ran (or was skipped).
///
/// `index`, `exit_code`, `output` and `error` (a string) are upstream CyNodeAI's
/// `sbajob.StepResult` fields, with the values it reads there; the rest is this project's.
/// The structured error is `failure_code` + `error` (the message): together they are the
/// step's [`ErrorInfo`] ([`StepRecord::error_info`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StepRecord {
    /// Position in `steps`, from 0 (upstream's `index`).
    #[serde(default)]
    pub index: u64,
    /// The job's step id (assigned `step-N` for upstream-form steps); absent upstream.
    #[serde(default)]
    pub id: String,
    #[serde(rename = "type")]
    pub step_type: StepType,
    pub status: StepStatus,
    #[serde(default)]
    pub duration_ms: u64,
    /// run_command's exit code (null when killed by a signal or not a command).
    #[serde(default)]
    pub exit_code: Option<i32>,
    /// What upstream reads as the step's output: run_command's stdout then stderr,
    /// read_file's content, list_tree's paths one a line (directories end in `/`),
    /// search_files' `path:line:text` lines, apply_unified_diff's `patching file P`
    /// lines; empty for write_file. Bounded like the typed result.
    #[serde(default)]
    pub output: String,
    /// The typed result; absent in upstream's results.
    #[serde(default)]
    pub result: Option<StepOutput>,
    /// Why the step failed, in words (upstream's string `error`).
    #[serde(default, deserialize_with = "step_error::deserialize")]
    pub error: Option<String>,
    /// The failure code of a failed step (null otherwise).
    #[serde(default)]
    pub failure_code: Option<FailureCode>,
}

/// A step's `error`: a message. Results written before the upstream alignment carried
/// `{type, message}` here; that shape is still read, as `"<type>: <message>"`.
mod step_error {
    use serde::Deserialize;

    use super::ErrorInfo;

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        Message(String),
        Legacy(ErrorInfo),
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        Ok(Option::<Either>::deserialize(d)?.map(|e| match e {
            Either::Message(m) => m,
            Either::Legacy(info) => format!("{}: {}", info.kind, info.message),
        }))
    }
}

impl StepRecord {
    /// A record of the step at `index` with nothing run yet (status `skipped`).
    pub fn skipped(index: usize, id: &str, step_type: StepType) -> StepRecord {
        StepRecord {
            index: index as u64,
            id: id.to_string(),
            step_type,
            status: StepStatus::Skipped,
            duration_ms: 0,
            exit_code: None,
            output: String::new(),
            result: None,
            error: None,
            failure_code: None,
        }
    }

    /// Sets the typed result and what upstream reads of it (`exit_code`, `output`).
    pub fn set_result(&mut self, out: Option<StepOutput>) {
        self.exit_code = match &out {
            Some(StepOutput::RunCommand(r)) => r.exit_code,
            _ => None,
        };
        self.output = out
            .as_ref()
            .map(StepOutput::upstream_output)
            .unwrap_or_default();
        self.result = out;
    }

    /// Sets the failure: its code and message.
    pub fn set_error(&mut self, code: FailureCode, message: impl Into<String>) {
        self.failure_code = Some(code);
        self.error = Some(message.into());
    }

    /// The structured error, when the step failed with a known code.
    pub fn error_info(&self) -> Option<ErrorInfo> {
        match (&self.failure_code, &self.error) {
            (Some(code), Some(message)) => Some(ErrorInfo {
                kind: *code,
                message: message.clone(),
            }),
            _ => None,
        }
    }
}

/// The typed result of a step; which variant is given by the step's `type`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum StepOutput {
    RunCommand(RunCommandOutput),
    WriteFile(WriteFileOutput),
    ReadFile(ReadFileOutput),
    ApplyUnifiedDiff(ApplyDiffOutput),
    ListTree(ListTreeOutput),
    SearchFiles(SearchFilesOutput),
}

/// `run_command` result. `exit_code` is null when the process was killed by a signal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCommandOutput {
    pub exit_code: Option<i32>,
    /// The signal that ended the process, if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub duration_ms: u64,
    /// True when stdout+stderr went over `max_output_bytes` and the middle was dropped.
    pub truncated: bool,
}

/// `write_file` result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteFileOutput {
    pub path: String,
    pub size_bytes: u64,
    pub sha256: String,
    /// False when an existing file was replaced (allow_overwrite).
    pub created: bool,
}

/// `read_file` result; `sha256` and `size_bytes` describe the whole file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadFileOutput {
    pub content: String,
    pub encoding: crate::job::ContentEncoding,
    pub size_bytes: u64,
    pub truncated: bool,
    pub sha256: String,
}

/// `apply_unified_diff` result.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApplyDiffOutput {
    pub files_modified: Vec<String>,
    pub files_created: Vec<String>,
    pub files_deleted: Vec<String>,
}

/// Kind of a tree entry; symlinks are reported, never followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum EntryType {
    Dir,
    File,
    Symlink,
    Other,
}

/// One node of a `list_tree` result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TreeNode {
    pub name: String,
    #[serde(rename = "type")]
    pub entry_type: EntryType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<TreeNode>,
}

/// `list_tree` result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListTreeOutput {
    pub tree: TreeNode,
    pub truncated: bool,
}

/// One `search_files` hit; `line` is 1-based.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SearchMatch {
    pub path: String,
    pub line: u64,
    pub text: String,
}

/// `search_files` result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SearchFilesOutput {
    pub matches: Vec<SearchMatch>,
    pub truncated: bool,
}

/// A collected artifact, relative to the artifacts directory. Upstream CyNodeAI's
/// `ArtifactRef` has `path` (and `ref`) only: its `sha256` reads as empty, which no
/// artifact download verifies against.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ArtifactRecord {
    #[serde(default)]
    pub path: String,
    #[serde(default)]
    pub sha256: String,
    #[serde(default)]
    pub size_bytes: u64,
}

/// What the job's processes used, from wait4/getrusage of the runner's children.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct ResourceUsage {
    pub cpu_time_ms: u64,
    pub max_rss_bytes: u64,
}

/// State of a todo item (agent mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TodoStatus {
    Pending,
    InProgress,
    Done,
}

/// One entry of the SBA's own todo list (agent mode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TodoItem {
    pub id: String,
    pub description: String,
    pub status: TodoStatus,
}

impl JobResult {
    /// Appends a step record, numbering it (`index`) by its position.
    pub fn push_step(&mut self, mut rec: StepRecord) {
        rec.index = self.steps.len() as u64;
        self.steps.push(rec);
    }

    /// Sets both failure shapes (`failure_code`/`failure_message` and `error`) at once,
    /// so they can never disagree.
    pub fn set_failure(&mut self, code: FailureCode, message: impl Into<String>) {
        let message = message.into();
        self.failure_code = Some(code);
        self.failure_message = Some(message.clone());
        self.error = Some(ErrorInfo {
            kind: code,
            message,
        });
        self.status = if code == FailureCode::Timeout {
            JobStatus::Timeout
        } else {
            JobStatus::Failure
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_codes_serialize_to_their_wire_names() {
        for code in FailureCode::ALL {
            assert_eq!(
                serde_json::to_value(code).unwrap(),
                serde_json::json!(code.as_str())
            );
        }
    }

    #[test]
    fn step_output_variants_are_distinguishable() {
        let out = StepOutput::WriteFile(WriteFileOutput {
            path: "a".into(),
            size_bytes: 1,
            sha256: "00".into(),
            created: true,
        });
        let back: StepOutput = serde_json::from_value(serde_json::to_value(&out).unwrap()).unwrap();
        assert_eq!(back, out);
        let rc = StepOutput::RunCommand(RunCommandOutput {
            exit_code: Some(0),
            signal: None,
            stdout: String::new(),
            stderr: String::new(),
            duration_ms: 1,
            truncated: false,
        });
        let back: StepOutput = serde_json::from_value(serde_json::to_value(&rc).unwrap()).unwrap();
        assert_eq!(back, rc);
    }
}
