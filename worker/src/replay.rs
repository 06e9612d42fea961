//! `cynode-worker replay JOB_ID`: re-runs a retained job from its stored request, in a
//! fresh empty workspace under a new job id, and reports whether the result matches the
//! stored one, for audits.
//!
//! Compared: status, exit code, the SBA result's status, failure code and each step's id,
//! type, status and result (durations left out), and the artifact hashes; for plain
//! command jobs also stdout and stderr. Timestamps, durations and the SBA's own log lines
//! are not compared: they differ on every run by nature. The original workspace is not
//! used because a job's edits have changed it since; a job that depends on earlier jobs'
//! workspace state will therefore not match, and the report says what differs.

use cynode_protocol::worker_api::{RunJobRequest, RunJobResponse};
use cynode_protocol::ValidationError;
use serde::Serialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::backend::Backend;
use crate::config::Config;
use crate::executor::{self, JobPaths};
use crate::store::{Store, StoreError};

/// Why a job could not be replayed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("job {0} is not retained on this node")]
    NotRetained(String),
    #[error("job {0} has not finished; nothing to compare")]
    Unfinished(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    #[error(transparent)]
    JobSpec(#[from] serde_json::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// The outcome of a replay.
#[derive(Debug, Serialize)]
pub struct ReplayReport {
    pub job_id: String,
    pub replay_job_id: String,
    pub matches: bool,
    pub differences: Vec<String>,
}

/// Replays `job_id` from the node's store with the configured backend.
pub async fn replay(cfg: &Config, job_id: &str) -> Result<ReplayReport, ReplayError> {
    let store = Store::open(&cfg.database_path()).await?;
    let rec = store
        .get(job_id)
        .await?
        .ok_or_else(|| ReplayError::NotRetained(job_id.to_string()))?;
    let original = rec
        .response
        .ok_or_else(|| ReplayError::Unfinished(job_id.to_string()))?;
    let suffix = cynode_protocol::time::now_rfc3339().replace([':', '.', '-'], "");
    let replay_id = format!("{job_id}-replay-{suffix}");
    let mut req: RunJobRequest = rec.request;
    rewrite_ids(&mut req, &replay_id)?;
    executor::validate(cfg, &req)?;
    let paths = JobPaths::new(cfg, &req);
    executor::prepare(&paths, &req)?;
    let backend = Backend::from_config(cfg);
    let spec = executor::sandbox_spec(cfg, &req, &paths);
    let resp = executor::run(&backend, &spec, &req, &paths, &CancellationToken::new()).await;
    let _ = std::fs::remove_dir_all(&paths.root);
    let _ = std::fs::remove_dir_all(&paths.workspace);
    let differences = compare(&original, &resp, req.sandbox.job_spec_json.is_none());
    Ok(ReplayReport {
        job_id: job_id.to_string(),
        replay_job_id: replay_id,
        matches: differences.is_empty(),
        differences,
    })
}

fn rewrite_ids(req: &mut RunJobRequest, replay_id: &str) -> Result<(), serde_json::Error> {
    req.job_id = replay_id.to_string();
    req.workspace_id = Some(replay_id.to_string());
    if let Some(spec) = &req.sandbox.job_spec_json {
        let mut v: Value = serde_json::from_str(spec)?;
        v["job_id"] = Value::String(replay_id.to_string());
        req.sandbox.job_spec_json = Some(serde_json::to_string(&v)?);
    }
    Ok(())
}

/// What of a response must be reproducible.
fn essence(r: &RunJobResponse, with_output: bool) -> Value {
    let mut v = serde_json::json!({
        "status": r.status,
        "exit_code": r.exit_code,
        "artifacts": r.artifacts,
    });
    if with_output {
        v["stdout"] = Value::String(r.stdout.clone());
        v["stderr"] = Value::String(r.stderr.clone());
    }
    if let Some(s) = &r.sba_result {
        let steps: Vec<Value> = s
            .steps
            .iter()
            .map(|st| {
                let mut result = serde_json::to_value(&st.result).unwrap_or(Value::Null);
                if let Some(o) = result.as_object_mut() {
                    o.remove("duration_ms");
                }
                serde_json::json!({ "id": st.id, "type": st.step_type, "status": st.status, "result": result })
            })
            .collect();
        v["sba"] = serde_json::json!({
            "status": s.status, "failure_code": s.failure_code, "steps": steps, "artifacts": s.artifacts,
        });
    }
    v
}

/// Field-level differences between two responses' essences.
pub fn compare(a: &RunJobResponse, b: &RunJobResponse, with_output: bool) -> Vec<String> {
    let (ea, eb) = (essence(a, with_output), essence(b, with_output));
    let mut out = Vec::new();
    diff_values("", &ea, &eb, &mut out);
    out
}

fn diff_values(path: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                diff_values(
                    &p,
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    out,
                );
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                diff_values(&format!("{path}[{i}]"), p, q, out);
            }
        }
        _ if a != b => out.push(format!("{path}: {a} != {b}")),
        _ => {}
    }
}
