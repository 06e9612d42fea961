//! result.json: what the SBA reports. Always complete JSON.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::job::StepType;

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
#[serde(deny_unknown_fields)]
pub struct ErrorInfo {
    #[serde(rename = "type")]
    pub kind: FailureCode,
    pub message: String,
}

/// A complete result.json.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobResult {
    pub protocol_version: String,
    pub job_id: String,
    pub task_id: String,
    pub status: JobStatus,
    /// RFC 3339.
    pub started_at: String,
    /// RFC 3339.
    pub finished_at: String,
    pub steps: Vec<StepRecord>,
    pub artifacts: Vec<ArtifactRecord>,
    pub resource_usage: ResourceUsage,
    pub failure_code: Option<FailureCode>,
    pub failure_message: Option<String>,
    pub error: Option<ErrorInfo>,
    pub final_answer: Option<String>,
    pub todo: Option<Vec<TodoItem>>,
}

/// One step as it ran (or was skipped).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StepRecord {
    pub id: String,
    #[serde(rename = "type")]
    pub step_type: StepType,
    pub status: StepStatus,
    pub duration_ms: u64,
    pub result: Option<StepOutput>,
    pub error: Option<ErrorInfo>,
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

/// A collected artifact, relative to the artifacts directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ArtifactRecord {
    pub path: String,
    pub sha256: String,
    pub size_bytes: u64,
}

/// What the job's processes used, from wait4/getrusage of the runner's children.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
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
