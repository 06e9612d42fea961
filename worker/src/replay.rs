//! `cynode-worker replay JOB_ID`: re-runs a retained job from its stored request, in a
//! fresh empty workspace under a new, random job id (an existing directory of that name
//! is refused), and reports whether the result matches the stored one, for audits.
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

use std::os::fd::AsFd;

use crate::config::Config;
use crate::executor::{self, JobPaths, PreparedJob};
use crate::job_dir;
use crate::remove_tree::remove_tree_async;
use crate::store::{Store, StoreError};
use crate::uid_pool::{UidError, UidPool};

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
    #[error(transparent)]
    Uid(#[from] UidError),
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
    let replay_id = replay_id(job_id);
    let mut req: RunJobRequest = rec.request;
    rewrite_ids(&mut req, &replay_id)?;
    let checked = executor::check(cfg, &req)?;
    let paths = JobPaths::new(cfg, &req);
    // A host uid of its own (released at the end), shared with no workspace of the node.
    let uids = UidPool::for_node(cfg, store.clone());
    let uid = uids.for_new_workspace(&replay_id).await?;
    let resp = replay_in(cfg, &req, &paths, checked, uid).await;
    if let Err(e) = uids.release(&replay_id).await {
        tracing::warn!(error = %e, "cannot release the replay's uid");
    }
    let differences = compare(&original, &resp?, req.sandbox.job_spec_json.is_none());
    Ok(ReplayReport {
        job_id: job_id.to_string(),
        replay_job_id: replay_id,
        matches: differences.is_empty(),
        differences,
    })
}

/// Runs the replay `req` in a fresh workspace owned by `uid`, then removes what it made.
async fn replay_in(
    cfg: &Config,
    req: &RunJobRequest,
    paths: &JobPaths,
    checked: executor::CheckedJob,
    uid: u32,
) -> Result<RunJobResponse, ReplayError> {
    // A fresh workspace of its own: an existing one of that name is refused, like the job
    // directory `prepare` creates.
    let (spaces, ws) = job_dir::split(&paths.workspace)?;
    let ws_fd = job_dir::create_new_dir(job_dir::open_node_dir(spaces)?.as_fd(), ws)?;
    job_dir::own(&ws_fd, Some(uid), 0o755)?;
    drop(ws_fd);
    let resp = match PreparedJob::prepare(cfg, req, checked.with_uid(uid)) {
        Ok(job) => {
            let backend = crate::backend::from_config(cfg);
            Ok(job.run(backend.as_ref(), &CancellationToken::new()).await)
        }
        Err(e) => Err(e),
    };
    // The job directory is the replay's unless `prepare` found one there already.
    let ours = match &resp {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => vec![&paths.workspace],
        _ => vec![&paths.root, &paths.workspace],
    };
    for dir in ours {
        if let Err(e) = remove_tree_async(dir.clone()).await {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot remove the replay's directory");
        }
    }
    Ok(resp?)
}

/// The replay's job id: the job's id and 128 random bits (hex), or only `replay-` and the
/// bits when that would be too long. Never predictable: a tenant who could guess it could
/// submit a job of that id first and have the replay prepare its directory.
fn replay_id(job_id: &str) -> String {
    let bits = uuid::Uuid::new_v4().simple().to_string();
    let id = format!("{job_id}-replay-{bits}");
    if id.len() <= MAX_ID_LEN {
        id
    } else {
        format!("replay-{bits}")
    }
}

/// The longest job id (`check_id`).
const MAX_ID_LEN: usize = 128;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_ids_are_random_and_valid() {
        let (a, b) = (replay_id("job-1"), replay_id("job-1"));
        assert_ne!(a, b);
        assert!(a.starts_with("job-1-replay-") && a.len() == "job-1-replay-".len() + 32);
        let long = "j".repeat(128);
        let c = replay_id(&long);
        assert!(c.starts_with("replay-"), "{c}");
        for id in [a, c] {
            cynode_protocol::worker_api::check_id("job_id", &id).unwrap();
        }
    }
}
