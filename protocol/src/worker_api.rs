//! Worker API v1 bodies, wire-compatible with the CyNodeAI Worker API.
//!
//! Field names follow upstream exactly (`sandbox.job_spec_json`, `truncated.stdout`…);
//! this project's extensions (async jobs, workspaces, sessions) add types but never change
//! an upstream field.
//!
//! Requests are read strictly (unknown fields refused). What a PM reads back from a peer
//! of the same major version ([`RunJobResponse`], [`AsyncJobStatus`],
//! [`WorkerCapacity`]) is read tolerantly: unknown fields (upstream's `run_diagnostics`,
//! `step_executor_result`) are ignored and fields a peer may leave out default
//! (upstream omits `exit_code` when it is 0).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::egress::EgressRecord;
use crate::error::ValidationError;
use crate::result::{ArtifactRecord, JobResult};

/// The only Worker API body version.
pub const API_VERSION: u32 = 1;
/// Default cap on each of stdout and stderr in a response (256 KiB).
pub const DEFAULT_OUTPUT_CAP_BYTES: usize = 256 * 1024;
/// Default request body limit (10 MiB).
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 10 * 1024 * 1024;
/// Default job timeout when the request gives none.
pub const DEFAULT_TIMEOUT_SECONDS: u64 = 3600;
/// Largest timeout a request may get.
pub const MAX_TIMEOUT_SECONDS: u64 = 10800;

/// Env names the node sets in a sandbox; a request's env cannot set them (they are
/// dropped). The proxy variables are the node's alone: a job with `restricted` network
/// gets them pointing at its egress proxy, any other job has none.
pub const RESERVED_ENV: [&str; 15] = [
    "CYNODE_TASK_ID",
    "CYNODE_JOB_ID",
    "CYNODE_WORKSPACE_DIR",
    "CYNODE_ARTIFACTS_DIR",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "http_proxy",
    "https_proxy",
    "ALL_PROXY",
    "all_proxy",
    "NO_PROXY",
    "no_proxy",
    "CYNODE_EGRESS_ROUTES_URL",
    "CYNODE_EGRESS_PROXY",
    "CYNODE_EGRESS_ALLOW",
];

/// Most entries a request's `sandbox.egress_allow` may have.
pub const MAX_EGRESS_ALLOW: usize = 256;
/// Longest entry of `sandbox.egress_allow` (a DNS name is at most 253 bytes, then `:port`).
pub const MAX_EGRESS_PATTERN_LEN: usize = 300;

/// Network access for the sandbox, upstream's values. `none` (the default): no network at
/// all. `restricted`: only the node's egress proxy, which lets through the destinations
/// of the node's `egress.allow` (narrowed by `sandbox.egress_allow`). `allow`
/// (unrestricted) is read but refused by [`RunJobRequest::validate`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum NetworkPolicy {
    #[default]
    None,
    Restricted,
    Allow,
}

/// `null` or a list, read as a list (absent and `null` are the same).
fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    Ok(Option::<Vec<String>>::deserialize(d)?.unwrap_or_default())
}

/// What to run and how.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxSpec {
    /// The image to run in. Absent is the same as empty: the node's `default_image`, or a
    /// 400 naming `sandbox.image` when it has none (as upstream CyNodeAI).
    #[serde(default)]
    pub image: String,
    /// argv; may be empty for SBA jobs, where the image's entrypoint runs. `null` (what
    /// upstream CyNodeAI sends on every SBA dispatch) means absent.
    #[serde(default, deserialize_with = "null_as_empty")]
    #[schemars(with = "Option<Vec<String>>")]
    pub command: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_policy: Option<NetworkPolicy>,
    /// Extension: with `network_policy: restricted`, the destinations this job may reach
    /// (`host`, `*.suffix`, an IP, each with an optional `:port`): a narrowing of the
    /// node's `egress.allow`, never a widening. Absent: the node's whole list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_allow: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_inference: Option<bool>,
    /// The SBA job.json, as a string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_spec_json: Option<String>,
}

/// `POST /v1/worker/jobs:run` and `POST /v1/worker/jobs` request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunJobRequest {
    pub version: u32,
    pub task_id: String,
    pub job_id: String,
    pub sandbox: SandboxSpec,
    /// Extension: the workspace the job runs in; defaults to `task_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_id: Option<String>,
    /// Extension: the PM's tool gateway for this job. The node serves it to the sandbox
    /// as `/job/gateway.sock` and adds the token itself; the token is never stored with
    /// the job, never part of its idempotency digest, and never enters the sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<GatewayGrant>,
    /// Extension: the key the node presents to its inference upstream for this job's
    /// requests, when that upstream takes a key per job (`inference.key_per_job`, as the
    /// PM's inference relay does). The PM mints it per job and revokes it when the job
    /// ends; the node keeps it in memory only, as the gateway's token: never stored with
    /// the job, never part of its digest, never in the sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_key: Option<JobKey>,
}

/// A key of one job's (`Debug` never shows it).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(transparent)]
pub struct JobKey(pub String);

impl std::fmt::Debug for JobKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobKey(<redacted>)")
    }
}

impl JobKey {
    /// 1-[`MAX_GATEWAY_TOKEN_LEN`] visible ASCII characters; the error names `field` and
    /// never echoes the key.
    pub fn validate(&self, field: &str) -> Result<(), ValidationError> {
        check_token(field, &self.0)
    }
}

/// A bearer token of 1-[`MAX_GATEWAY_TOKEN_LEN`] visible ASCII characters; the error
/// names `field` and never echoes the token.
fn check_token(field: &str, token: &str) -> Result<(), ValidationError> {
    let t = token.as_bytes();
    if t.is_empty() || t.len() > MAX_GATEWAY_TOKEN_LEN || t.iter().any(|b| !b.is_ascii_graphic()) {
        return Err(ValidationError::new(
            field,
            format!("must be 1-{MAX_GATEWAY_TOKEN_LEN} visible ASCII characters"),
        ));
    }
    Ok(())
}

/// Longest gateway URL a request may carry.
pub const MAX_GATEWAY_URL_LEN: usize = 2048;
/// Longest gateway token a request may carry.
pub const MAX_GATEWAY_TOKEN_LEN: usize = 512;

/// Where a job's gateway calls go (`url`: the PM's `/v1/gateway`) and the job token the
/// node presents there as `Authorization: Bearer`. `Debug` never shows the token.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GatewayGrant {
    pub url: String,
    pub token: String,
}

impl std::fmt::Debug for GatewayGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayGrant")
            .field("url", &self.url)
            .field("token", &"<redacted>")
            .finish()
    }
}

impl GatewayGrant {
    /// An http(s) URL and a token of visible ASCII, both bounded; errors name the field
    /// and never echo the token.
    pub fn validate(&self) -> Result<(), ValidationError> {
        let u = self.url.as_str();
        if !(u.starts_with("http://") || u.starts_with("https://"))
            || u.len() > MAX_GATEWAY_URL_LEN
            || u.bytes().any(|b| !b.is_ascii_graphic())
        {
            return Err(ValidationError::new(
                "gateway.url",
                format!("must be an http:// or https:// URL of at most {MAX_GATEWAY_URL_LEN} visible ASCII characters"),
            ));
        }
        check_token("gateway.token", &self.token)
    }
}

impl RunJobRequest {
    /// The request that runs the runner on `job_spec_json` (an SBA job) in `image`: what
    /// the PM dispatches.
    pub fn sba(
        task_id: &str,
        job_id: &str,
        image: &str,
        job_spec_json: String,
        workspace_id: Option<String>,
    ) -> Self {
        RunJobRequest {
            version: API_VERSION,
            task_id: task_id.into(),
            job_id: job_id.into(),
            sandbox: SandboxSpec {
                image: image.into(),
                job_spec_json: Some(job_spec_json),
                ..SandboxSpec::default()
            },
            workspace_id,
            gateway: None,
            inference_key: None,
        }
    }

    /// Checks the request beyond its shape; errors name the field.
    pub fn validate(&self) -> Result<(), ValidationError> {
        if self.version != API_VERSION {
            return Err(ValidationError::new(
                "version",
                format!(
                    "unsupported version {}: expected {API_VERSION}",
                    self.version
                ),
            ));
        }
        check_id("task_id", &self.task_id)?;
        check_id("job_id", &self.job_id)?;
        if let Some(ws) = &self.workspace_id {
            check_id("workspace_id", ws)?;
        }
        if self.sandbox.image.trim().is_empty() {
            return Err(ValidationError::new("sandbox.image", "must not be empty"));
        }
        if self.sandbox.command.is_empty() && self.sandbox.job_spec_json.is_none() {
            return Err(ValidationError::new(
                "sandbox.command",
                "must not be empty unless sandbox.job_spec_json is given",
            ));
        }
        if self.sandbox.timeout_seconds == Some(0) {
            return Err(ValidationError::new(
                "sandbox.timeout_seconds",
                "must be positive",
            ));
        }
        self.validate_network()?;
        if let Some(g) = &self.gateway {
            g.validate()?;
        }
        if let Some(k) = &self.inference_key {
            k.validate("inference_key")?;
        }
        for key in self.sandbox.env.keys() {
            if key.is_empty() || key.contains('=') || key.contains('\0') {
                return Err(ValidationError::new(
                    "sandbox.env",
                    format!("invalid variable name `{key}`"),
                ));
            }
        }
        Ok(())
    }
}

impl RunJobRequest {
    /// `allow` is refused; `egress_allow` needs `restricted` and is bounded. Whether the
    /// node offers `restricted`, and whether the list stays within its ceiling, is the
    /// node's check.
    fn validate_network(&self) -> Result<(), ValidationError> {
        let policy = self.sandbox.network_policy.unwrap_or_default();
        if policy == NetworkPolicy::Allow {
            return Err(ValidationError::new(
                "sandbox.network_policy",
                "`allow` (unrestricted network) is not offered: use `restricted`, which \
                 reaches the destinations of the node's egress allowlist through its egress \
                 proxy (narrowed by sandbox.egress_allow)",
            ));
        }
        let Some(list) = &self.sandbox.egress_allow else {
            return Ok(());
        };
        if policy != NetworkPolicy::Restricted {
            return Err(ValidationError::new(
                "sandbox.egress_allow",
                "needs sandbox.network_policy `restricted`",
            ));
        }
        if list.len() > MAX_EGRESS_ALLOW {
            return Err(ValidationError::new(
                "sandbox.egress_allow",
                format!("at most {MAX_EGRESS_ALLOW} entries"),
            ));
        }
        if let Some(bad) = list
            .iter()
            .find(|p| p.is_empty() || p.len() > MAX_EGRESS_PATTERN_LEN)
        {
            return Err(ValidationError::new(
                "sandbox.egress_allow",
                format!(
                    "entries are 1-{MAX_EGRESS_PATTERN_LEN} characters (`{}` is not)",
                    bad.chars().take(40).collect::<String>()
                ),
            ));
        }
        Ok(())
    }
}

/// Reads a Worker API request body: its top-level `version` first, so a request of
/// another version is refused as such ("version: unsupported version 2: expected 1")
/// rather than by whichever of its fields this version does not know; then the whole
/// body strictly ([`crate::error::parse_strict`]), errors naming the field.
pub fn parse_request<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ValidationError> {
    check_body_version(bytes)?;
    crate::error::parse_strict(bytes)
}

/// An integer `version` other than [`API_VERSION`] is refused. Anything else (no JSON
/// object, no `version`, one that is not an integer) is left to the strict parse, which
/// says where the body is wrong.
fn check_body_version(bytes: &[u8]) -> Result<(), ValidationError> {
    #[derive(Deserialize)]
    struct Probe {
        #[serde(default)]
        version: Option<serde_json::Value>,
    }
    let Ok(Probe { version: Some(v) }) = serde_json::from_slice::<Probe>(bytes) else {
        return Ok(());
    };
    match v.as_u64() {
        Some(n) if n != u64::from(API_VERSION) => Err(ValidationError::new(
            "version",
            format!("unsupported version {n}: expected {API_VERSION}"),
        )),
        _ => Ok(()),
    }
}

/// Ids become directory and container names, so they are kept to a safe alphabet.
pub fn check_id(field: &str, id: &str) -> Result<(), ValidationError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(ValidationError::new(
            field,
            "must be 1-128 characters of [A-Za-z0-9._-] and not `.` or `..`",
        ))
    }
}

/// Terminal status reported by the Worker API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WorkerJobStatus {
    Completed,
    Failed,
    Timeout,
}

/// Which streams were cut.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct Truncated {
    pub stdout: bool,
    pub stderr: bool,
}

/// `POST /v1/worker/jobs:run` response (read tolerantly, see the module doc).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunJobResponse {
    pub version: u32,
    pub task_id: String,
    pub job_id: String,
    pub status: WorkerJobStatus,
    /// -1 when the process never produced an exit code (timeout, runtime error). Always
    /// written here; upstream omits it when 0, so absent reads as 0, and `null` (upstream
    /// `mvp/phase-2`'s `*int` with no code) reads as -1.
    #[serde(default, deserialize_with = "exit_code_or_null")]
    pub exit_code: i32,
    #[serde(default)]
    pub stdout: String,
    #[serde(default)]
    pub stderr: String,
    #[serde(default)]
    pub started_at: String,
    #[serde(default)]
    pub ended_at: String,
    #[serde(default)]
    pub truncated: Truncated,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sba_result: Option<JobResult>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifacts: Option<Vec<ArtifactRecord>>,
    /// Extension: why a job failed when the sandbox itself could not say (e.g.
    /// `result.json missing`, `worker_restarted`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// Extension: every attempt the sandbox made through the node's egress proxy (jobs
    /// with `network_policy: restricted`), up to the node's bound
    /// (`egress.max_audit_records`); absent when the job had no proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<Vec<EgressRecord>>,
    /// Extension: attempts beyond that bound, counted but not listed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub egress_dropped: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl RunJobResponse {
    /// The failed answer for `req` when its job never ran (or its run was lost): exit code
    /// -1, no output, both times now, and `failure_reason`.
    pub fn not_run(req: &RunJobRequest, failure_reason: Option<String>) -> Self {
        let now = crate::time::now_rfc3339();
        RunJobResponse {
            version: API_VERSION,
            task_id: req.task_id.clone(),
            job_id: req.job_id.clone(),
            status: WorkerJobStatus::Failed,
            exit_code: -1,
            stdout: String::new(),
            stderr: String::new(),
            started_at: now.clone(),
            ended_at: now,
            truncated: Truncated::default(),
            sba_result: None,
            artifacts: None,
            failure_reason,
            egress: None,
            egress_dropped: 0,
        }
    }
}

/// Lifecycle state of an async job (extension).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AsyncJobState {
    Accepted,
    InProgress,
    Completed,
    Failed,
    Timeout,
    Canceled,
}

impl AsyncJobState {
    /// True once the job will not change again.
    pub fn is_terminal(self) -> bool {
        match self {
            AsyncJobState::Accepted | AsyncJobState::InProgress => false,
            AsyncJobState::Completed
            | AsyncJobState::Failed
            | AsyncJobState::Timeout
            | AsyncJobState::Canceled => true,
        }
    }
}

/// `GET /v1/worker/jobs/{job_id}` response and `POST /v1/worker/jobs` 202 body (extension).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AsyncJobStatus {
    pub version: u32,
    pub task_id: String,
    pub job_id: String,
    pub status: AsyncJobState,
    /// Present once the job is terminal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<RunJobResponse>,
}

/// `GET /v1/worker/capacity` (extension): what a node can take and holds now, so a PM
/// with several workers can send each job where there is room. Counts are the node's own,
/// so they include the jobs of every PM replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct WorkerCapacity {
    pub version: u32,
    /// `podman`, `docker` or `bwrap`.
    pub backend: String,
    /// Jobs run at once.
    pub max_running: u64,
    /// Jobs accepted beyond those before the node answers 503.
    pub max_queued: u64,
    /// Jobs running now.
    pub running: u64,
    /// Jobs accepted and waiting for a run slot.
    pub queued: u64,
    /// The node's last readiness check passed (backend and database).
    pub ready: bool,
}

impl WorkerCapacity {
    /// Jobs the node would still accept before refusing (never negative).
    pub fn free(&self) -> u64 {
        (self.max_running + self.max_queued).saturating_sub(self.running + self.queued)
    }
}

/// The SBA's lifecycle callback body (`POST $SBA_JOB_STATUS_URL`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SbaStatusCallback {
    pub status: SbaLifecycle,
    pub job_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<JobResult>,
}

/// Lifecycle stages the SBA reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SbaLifecycle {
    InProgress,
    Completed,
}

/// RFC 9457 problem details, as the Worker API returns them (defined in [`crate::problem`]).
pub use crate::problem::Problem;

/// `exit_code`: a number, or `null` for "no exit code" (-1).
fn exit_code_or_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
    Ok(Option::<i32>::deserialize(d)?.unwrap_or(-1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_is_read_before_any_field() {
        let e = parse_request::<RunJobRequest>(br#"{"version":2,"sandbox":{"x":1}}"#).unwrap_err();
        assert_eq!(e.to_string(), "version: unsupported version 2: expected 1");
        // Not an integer: the strict parse names it.
        let e = parse_request::<RunJobRequest>(br#"{"version":"2"}"#).unwrap_err();
        assert!(e.to_string().starts_with("version: invalid type"), "{e}");
        let r: RunJobRequest = parse_request(
            br#"{"version":1,"task_id":"t","job_id":"j","sandbox":{"command":["true"]}}"#,
        )
        .unwrap();
        assert_eq!(r.sandbox.image, "");
        assert_eq!(
            r.validate().unwrap_err().to_string(),
            "sandbox.image: must not be empty"
        );
    }

    fn req() -> serde_json::Value {
        serde_json::json!({
            "version": 1, "task_id": "t-1", "job_id": "j-1",
            "sandbox": { "image": "localhost/x", "command": ["echo", "hello"] }
        })
    }

    #[test]
    fn upstream_request_parses_and_validates() {
        let r: RunJobRequest = serde_json::from_value(req()).unwrap();
        r.validate().unwrap();
        assert_eq!(r.sandbox.command, ["echo", "hello"]);
    }

    /// The gateway extension: optional, validated, and its token never in `Debug` nor in
    /// a validation error.
    #[test]
    fn gateway_grant_is_optional_checked_and_redacted() {
        let secret = "cgw_0123456789abcdef";
        let mut v = req();
        v["gateway"] =
            serde_json::json!({ "url": "http://127.0.0.1:8080/v1/gateway", "token": secret });
        let r: RunJobRequest = serde_json::from_value(v.clone()).unwrap();
        r.validate().unwrap();
        assert!(!format!("{r:?}").contains(secret), "{r:?}");
        for (field, bad) in [
            ("url", "file:///etc/passwd"),
            ("url", "http://a b"),
            ("token", ""),
            ("token", "cgw_with space"),
        ] {
            let mut w = v.clone();
            w["gateway"][field] = bad.into();
            let e = serde_json::from_value::<RunJobRequest>(w)
                .unwrap()
                .validate()
                .unwrap_err();
            assert!(
                e.to_string().starts_with(&format!("gateway.{field}:")),
                "{e}"
            );
            assert!(!e.to_string().contains("cgw_"), "{e}");
        }
        v["gateway"]["extra"] = 1.into();
        assert!(serde_json::from_value::<RunJobRequest>(v).is_err());
        let plain: RunJobRequest = serde_json::from_value(req()).unwrap();
        assert!(!serde_json::to_string(&plain).unwrap().contains("gateway"));
    }

    /// The per-job inference key: optional, validated, and never in `Debug` nor in a
    /// validation error.
    #[test]
    fn inference_key_is_optional_checked_and_redacted() {
        let secret = "cik_0123456789abcdef";
        let mut v = req();
        v["inference_key"] = secret.into();
        let r: RunJobRequest = serde_json::from_value(v.clone()).unwrap();
        r.validate().unwrap();
        assert!(!format!("{r:?}").contains(secret), "{r:?}");
        for bad in ["", "cik_with space", &"k".repeat(MAX_GATEWAY_TOKEN_LEN + 1)] {
            v["inference_key"] = bad.into();
            let e = serde_json::from_value::<RunJobRequest>(v.clone())
                .unwrap()
                .validate()
                .unwrap_err();
            assert!(e.to_string().starts_with("inference_key:"), "{e}");
            assert!(!e.to_string().contains("cik_"), "{e}");
        }
        let plain: RunJobRequest = serde_json::from_value(req()).unwrap();
        assert!(!serde_json::to_string(&plain)
            .unwrap()
            .contains("inference_key"));
    }

    /// Upstream CyNodeAI sends `"command": null` on every SBA dispatch (its field has no
    /// omitempty): null means absent, as the job spec then says what runs.
    #[test]
    fn upstream_null_command_is_absent() {
        let mut v = req();
        v["sandbox"]["command"] = serde_json::Value::Null;
        v["sandbox"]["job_spec_json"] = "{}".into();
        let r: RunJobRequest = serde_json::from_value(v).unwrap();
        assert_eq!(r.sandbox.command, Vec::<String>::new());
        let mut v = req();
        v["sandbox"]["command"] = serde_json::json!([1]);
        assert!(serde_json::from_value::<RunJobRequest>(v).is_err());
    }

    #[test]
    fn bad_ids_are_rejected_by_field() {
        let mut v = req();
        v["job_id"] = "../etc".into();
        let r: RunJobRequest = serde_json::from_value(v).unwrap();
        assert_eq!(r.validate().unwrap_err().path, "job_id");
    }

    #[test]
    fn empty_command_needs_job_spec() {
        let mut v = req();
        v["sandbox"]["command"] = serde_json::json!([]);
        let r: RunJobRequest = serde_json::from_value(v).unwrap();
        assert_eq!(r.validate().unwrap_err().path, "sandbox.command");
    }

    #[test]
    fn network_policies_are_upstreams_and_allow_is_refused() {
        let with = |policy: &str, allow: Option<serde_json::Value>| {
            let mut v = req();
            v["sandbox"]["network_policy"] = policy.into();
            if let Some(a) = allow {
                v["sandbox"]["egress_allow"] = a;
            }
            serde_json::from_value::<RunJobRequest>(v)
                .unwrap()
                .validate()
        };
        with("none", None).unwrap();
        with("restricted", None).unwrap();
        with(
            "restricted",
            Some(serde_json::json!(["pypi.org", "*.example.com:8443"])),
        )
        .unwrap();
        let e = with("allow", None).unwrap_err();
        assert_eq!(e.path, "sandbox.network_policy");
        assert!(
            e.to_string()
                .contains("`allow` (unrestricted network) is not offered"),
            "{e}"
        );
        let e = with("none", Some(serde_json::json!(["pypi.org"]))).unwrap_err();
        assert_eq!(e.path, "sandbox.egress_allow");
        let many: Vec<String> = (0..=MAX_EGRESS_ALLOW)
            .map(|i| format!("h{i}.example"))
            .collect();
        let e = with("restricted", Some(serde_json::json!(many))).unwrap_err();
        assert_eq!(e.path, "sandbox.egress_allow");
        let mut v = req();
        v["sandbox"]["network_policy"] = "open".into();
        assert!(serde_json::from_value::<RunJobRequest>(v).is_err());
    }

    #[test]
    fn proxy_variables_are_reserved() {
        for name in [
            "HTTP_PROXY",
            "https_proxy",
            "NO_PROXY",
            "no_proxy",
            "CYNODE_EGRESS_ROUTES_URL",
        ] {
            assert!(RESERVED_ENV.contains(&name), "{name}");
        }
    }

    #[test]
    fn the_egress_audit_is_an_extension_of_the_response() {
        let r = RunJobResponse::not_run(
            &serde_json::from_value::<RunJobRequest>(req()).unwrap(),
            None,
        );
        let v = serde_json::to_value(&r).unwrap();
        assert!(v.get("egress").is_none() && v.get("egress_dropped").is_none());
        let mut v = v;
        v["egress"] = serde_json::json!([{"host": "pypi.org", "port": 443, "method": "CONNECT",
            "decision": "allowed", "reason": "ok", "bytes_up": 1, "bytes_down": 2}]);
        v["egress_dropped"] = 3.into();
        let back: RunJobResponse = serde_json::from_value(v).unwrap();
        assert_eq!(back.egress.unwrap()[0].host, "pypi.org");
        assert_eq!(back.egress_dropped, 3);
    }

    #[test]
    fn terminal_states() {
        assert!(!AsyncJobState::InProgress.is_terminal());
        assert!(AsyncJobState::Canceled.is_terminal());
    }
}
