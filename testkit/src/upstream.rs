//! Faithful Rust mirrors of upstream CyNodeAI's contract types
//! (`go_shared_libs/contracts/sbajob` and `workerapi`, commit
//! 2dc5936bd236f0f425953179d8e2b4b72478df90), with Go's `encoding/json` semantics, so
//! tests can decode our output the way upstream does and speak upstream's API:
//!
//! - unknown fields are ignored (`json.Unmarshal`), except where upstream decodes with
//!   `DisallowUnknownFields` (`ParseAndValidateJobSpec`: the [`JobSpec`] family refuses
//!   them);
//! - a JSON `null` leaves a non-pointer field at its zero value (the `go` helper); a
//!   pointer field (`*int`, `*string`, `*bool`, `*Result`) is an `Option`;
//! - a type mismatch (an object where a string is declared) is an error;
//! - marshalling follows the tags: `omitempty` fields are skipped when zero, nil slices
//!   without `omitempty` are written as `null` (slices are `Option<Vec<_>>` to keep nil
//!   and empty apart).
//!
//! Not mirrored: Go's case-insensitive key matching (every key here is lowercase).

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

/// The upstream commit these types were copied from.
pub const UPSTREAM_COMMIT: &str = "2dc5936bd236f0f425953179d8e2b4b72478df90";

/// Go's decoding of `null` into a non-pointer field: the field keeps its zero value.
fn go<'de, D: Deserializer<'de>, T: Default + Deserialize<'de>>(d: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

fn is_zero_i64(v: &i64) -> bool {
    *v == 0
}

fn is_false(v: &bool) -> bool {
    !*v
}

fn none_or_empty<T>(v: &Option<Vec<T>>) -> bool {
    v.as_ref().is_none_or(Vec::is_empty)
}

fn none_or_empty_map<K, V>(v: &Option<BTreeMap<K, V>>) -> bool {
    v.as_ref().is_none_or(BTreeMap::is_empty)
}

// ---- sbajob -------------------------------------------------------------------------

/// `sbajob.JobSpec`, decoded as `ParseAndValidateJobSpec` does (unknown fields refused).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobSpec {
    #[serde(deserialize_with = "go")]
    pub protocol_version: String,
    #[serde(deserialize_with = "go")]
    pub job_id: String,
    #[serde(deserialize_with = "go")]
    pub task_id: String,
    #[serde(deserialize_with = "go", skip_serializing_if = "String::is_empty")]
    pub execution_mode: String,
    #[serde(deserialize_with = "go")]
    pub constraints: JobConstraints,
    #[serde(skip_serializing_if = "none_or_empty")]
    pub steps: Option<Vec<StepSpec>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inference: Option<InferenceSpec>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<ContextSpec>,
}

/// `sbajob.JobConstraints`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobConstraints {
    #[serde(deserialize_with = "go")]
    pub max_runtime_seconds: i64,
    #[serde(deserialize_with = "go")]
    pub max_output_bytes: i64,
    #[serde(deserialize_with = "go", skip_serializing_if = "is_false")]
    pub ext_net_allowed: bool,
}

/// `sbajob.StepSpec`: `args` is a `json.RawMessage` (anything).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StepSpec {
    #[serde(rename = "type", deserialize_with = "go")]
    pub step_type: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub args: Option<Value>,
}

/// `sbajob.InferenceSpec`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InferenceSpec {
    pub allowed_models: Option<Vec<String>>,
    #[serde(deserialize_with = "go", skip_serializing_if = "String::is_empty")]
    pub source: String,
}

/// `sbajob.ContextSpec` (`preferences` is a string map; `skills` an `interface{}`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ContextSpec {
    #[serde(deserialize_with = "go", skip_serializing_if = "String::is_empty")]
    pub baseline_context: String,
    #[serde(deserialize_with = "go", skip_serializing_if = "String::is_empty")]
    pub project_context: String,
    #[serde(deserialize_with = "go", skip_serializing_if = "String::is_empty")]
    pub task_context: String,
    #[serde(skip_serializing_if = "none_or_empty")]
    pub requirements: Option<Vec<String>>,
    #[serde(skip_serializing_if = "none_or_empty")]
    pub acceptance_criteria: Option<Vec<String>>,
    #[serde(skip_serializing_if = "none_or_empty_map")]
    pub preferences: Option<BTreeMap<String, String>>,
    #[serde(deserialize_with = "go", skip_serializing_if = "String::is_empty")]
    pub additional_context: String,
    #[serde(skip_serializing_if = "none_or_empty")]
    pub skill_ids: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skills: Option<Value>,
}

/// `sbajob.Result` (decoded with `json.Unmarshal`: unknown fields ignored).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SbaResult {
    #[serde(deserialize_with = "go")]
    pub protocol_version: String,
    #[serde(deserialize_with = "go")]
    pub job_id: String,
    #[serde(deserialize_with = "go")]
    pub status: String,
    #[serde(deserialize_with = "go", skip_serializing_if = "String::is_empty")]
    pub final_answer: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inference_used: Option<bool>,
    pub steps: Option<Vec<StepResult>>,
    pub artifacts: Option<Vec<ArtifactRef>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure_code: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure_message: Option<String>,
}

/// `sbajob.StepResult`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepResult {
    #[serde(deserialize_with = "go")]
    pub index: i64,
    #[serde(rename = "type", deserialize_with = "go")]
    pub step_type: String,
    #[serde(deserialize_with = "go")]
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i64>,
    #[serde(deserialize_with = "go", skip_serializing_if = "String::is_empty")]
    pub output: String,
    #[serde(deserialize_with = "go", skip_serializing_if = "String::is_empty")]
    pub error: String,
}

/// `sbajob.ArtifactRef`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ArtifactRef {
    #[serde(deserialize_with = "go", skip_serializing_if = "String::is_empty")]
    pub path: String,
    #[serde(
        rename = "ref",
        deserialize_with = "go",
        skip_serializing_if = "String::is_empty"
    )]
    pub reference: String,
}

/// `sbajob.ParseAndValidateJobSpec`: strict decode, then `ValidateJobSpec`. The error
/// is upstream's message (`field: message`).
pub fn parse_and_validate_job_spec(data: &[u8]) -> Result<JobSpec, String> {
    let spec: JobSpec =
        serde_json::from_slice(data).map_err(|e| format!("invalid JSON or unknown field: {e}"))?;
    validate_job_spec(&spec)?;
    Ok(spec)
}

/// `sbajob.ValidateJobSpec`.
pub fn validate_job_spec(spec: &JobSpec) -> Result<(), String> {
    if spec.protocol_version.is_empty() {
        return Err("protocol_version: required".into());
    }
    let major = spec
        .protocol_version
        .trim()
        .split('.')
        .next()
        .and_then(|m| m.trim().parse::<i64>().ok())
        .filter(|m| *m >= 0)
        .ok_or("protocol_version: invalid version format")?;
    if major != 1 {
        return Err(format!(
            "protocol_version: unsupported major version {major} (supported: 1)"
        ));
    }
    if spec.job_id.is_empty() {
        return Err("job_id: required".into());
    }
    if spec.task_id.is_empty() {
        return Err("task_id: required".into());
    }
    if !["", "agent_inference", "direct_steps"].contains(&spec.execution_mode.as_str()) {
        return Err("execution_mode: must be one of: agent_inference, direct_steps".into());
    }
    if spec.constraints.max_runtime_seconds <= 0 {
        return Err("constraints.max_runtime_seconds: must be positive".into());
    }
    if spec.constraints.max_output_bytes <= 0 {
        return Err("constraints.max_output_bytes: must be positive".into());
    }
    Ok(())
}

/// `sbajob.EffectiveExecutionMode`.
pub fn effective_execution_mode(spec: &JobSpec) -> &str {
    match spec.execution_mode.trim() {
        "" if spec.steps.as_ref().is_some_and(|s| !s.is_empty()) => "direct_steps",
        "" => "agent_inference",
        m => m,
    }
}

// ---- workerapi ----------------------------------------------------------------------

/// `workerapi.RunJobRequest` (decoded without `DisallowUnknownFields`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RunJobRequest {
    #[serde(deserialize_with = "go")]
    pub version: i64,
    #[serde(deserialize_with = "go")]
    pub task_id: String,
    #[serde(deserialize_with = "go")]
    pub job_id: String,
    #[serde(deserialize_with = "go")]
    pub sandbox: SandboxSpec,
}

/// `workerapi.SandboxSpec`: `command` has no omitempty, so nil is written as `null`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SandboxSpec {
    #[serde(deserialize_with = "go")]
    pub image: String,
    pub command: Option<Vec<String>>,
    #[serde(skip_serializing_if = "none_or_empty_map")]
    pub env: Option<BTreeMap<String, String>>,
    #[serde(deserialize_with = "go", skip_serializing_if = "is_zero_i64")]
    pub timeout_seconds: i64,
    #[serde(deserialize_with = "go", skip_serializing_if = "String::is_empty")]
    pub network_policy: String,
    #[serde(deserialize_with = "go", skip_serializing_if = "is_false")]
    pub use_inference: bool,
    #[serde(deserialize_with = "go", skip_serializing_if = "String::is_empty")]
    pub job_spec_json: String,
}

/// `workerapi.RunJobResponse`: `exit_code` is omitted when 0.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RunJobResponse {
    #[serde(deserialize_with = "go")]
    pub version: i64,
    #[serde(deserialize_with = "go")]
    pub task_id: String,
    #[serde(deserialize_with = "go")]
    pub job_id: String,
    #[serde(deserialize_with = "go")]
    pub status: String,
    #[serde(deserialize_with = "go", skip_serializing_if = "is_zero_i64")]
    pub exit_code: i64,
    #[serde(deserialize_with = "go")]
    pub stdout: String,
    #[serde(deserialize_with = "go")]
    pub stderr: String,
    #[serde(deserialize_with = "go")]
    pub started_at: String,
    #[serde(deserialize_with = "go")]
    pub ended_at: String,
    #[serde(deserialize_with = "go")]
    pub truncated: TruncatedInfo,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sba_result: Option<SbaResult>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_executor_result: Option<Value>,
    #[serde(skip_serializing_if = "none_or_empty")]
    pub artifacts: Option<Vec<Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_diagnostics: Option<RunDiagnostics>,
}

/// `workerapi.RunDiagnostics`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RunDiagnostics {
    #[serde(deserialize_with = "go")]
    pub runtime: String,
    pub runtime_argv: Option<Vec<String>>,
    #[serde(deserialize_with = "go", skip_serializing_if = "String::is_empty")]
    pub job_dir: String,
    #[serde(deserialize_with = "go", skip_serializing_if = "String::is_empty")]
    pub workspace_dir: String,
    #[serde(deserialize_with = "go", skip_serializing_if = "String::is_empty")]
    pub image: String,
    #[serde(deserialize_with = "go")]
    pub container_started: bool,
}

/// `workerapi.TruncatedInfo`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TruncatedInfo {
    #[serde(deserialize_with = "go")]
    pub stdout: bool,
    #[serde(deserialize_with = "go")]
    pub stderr: bool,
}

/// `workerapi.ValidateRequest` plus worker-api's `validateRunJobRequest`.
pub fn validate_run_job_request(req: &RunJobRequest) -> Result<(), String> {
    if req.sandbox.job_spec_json.is_empty()
        && req.sandbox.command.as_ref().is_none_or(Vec::is_empty)
    {
        return Err("sandbox.command is required when job_spec_json is not set".into());
    }
    if req.version != 1 {
        return Err("unsupported version".into());
    }
    if req.task_id.is_empty() || req.job_id.is_empty() {
        return Err("task_id and job_id are required".into());
    }
    Ok(())
}

/// The worker executor's `isSBARunnerImage`: only these images get the job.json.
pub fn is_sba_runner_image(image: &str) -> bool {
    image.contains("cynode-sba") || image.contains("cynodeai-cynode-sba")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn go_semantics_null_unknown_and_mismatch() {
        let r: StepResult = serde_json::from_str(
            r#"{"index":1,"type":"run_command","status":"failure","error":null,"extra":{}}"#,
        )
        .unwrap();
        assert_eq!((r.index, r.error.as_str()), (1, ""));
        let e = serde_json::from_str::<StepResult>(r#"{"error":{"type":"x","message":"y"}}"#);
        assert!(e.is_err());
        let resp = RunJobResponse {
            version: 1,
            status: "completed".into(),
            ..Default::default()
        };
        let v = serde_json::to_value(&resp).unwrap();
        assert!(
            v.get("exit_code").is_none() && v.get("sba_result").is_none(),
            "{v}"
        );
        let spec = SandboxSpec::default();
        assert_eq!(serde_json::to_value(spec).unwrap()["command"], Value::Null);
        assert!(parse_and_validate_job_spec(br#"{"protocol_version":"1.0","x":1}"#).is_err());
    }
}
