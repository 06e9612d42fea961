//! Feedback: take a job's result in. Artifacts are fetched and their sha256 verified
//! before they are stored, the plan is updated, and a compact summary (never raw
//! megabytes) is queued for the model's next turn.

use cynode_protocol::session::{SessionArtifact, TaskStatus};
use cynode_protocol::worker_api::*;
use serde_json::{json, Value};

use crate::artifacts::{verify_and_store, ArtifactError};
use crate::dispatch::WorkerClient;
use crate::gateway::clip;
use crate::session::evidence::job_evidence;
use crate::session::{Dispatch, SessionRecord};

use super::act::set_task_status;
use super::{Pm, Progress};

impl Pm {
    /// Verifies and stores artifacts, updates the plan, and writes the model's summary.
    pub(super) async fn take_result(
        &self,
        worker: &WorkerClient,
        rec: &mut SessionRecord,
        d: &Dispatch,
        resp: &RunJobResponse,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) {
        let mut ok = resp.status == WorkerJobStatus::Completed;
        if resp.job_id != d.job_id {
            ok = false;
            rec.feedback.push(format!(
                "the worker answered for job {} instead of {}",
                resp.job_id, d.job_id
            ));
        }
        let claimed = resp
            .sba_result
            .as_ref()
            .map(|r| r.artifacts.clone())
            .unwrap_or_default();
        let mut integrity = Vec::new();
        for a in &claimed {
            let fetched = worker.artifact(&d.job_id, &a.path).await;
            let stored = fetched
                .map_err(|e| ArtifactError::Fetch(e.to_string()))
                .and_then(|bytes| {
                    verify_and_store(
                        &self.artifacts_dir,
                        &a.path,
                        &a.sha256,
                        a.size_bytes,
                        &bytes,
                    )
                });
            match stored {
                Ok(loc) => {
                    let location = loc.display().to_string();
                    let _ = self
                        .store
                        .put_artifact(&a.sha256, a.size_bytes, &location)
                        .await;
                    rec.state.artifacts.push(SessionArtifact {
                        record: a.clone(),
                        job_id: d.job_id.clone(),
                        location,
                    });
                }
                Err(ArtifactError::Integrity(e)) => {
                    crate::metrics::metrics().artifact_integrity_failures.inc();
                    integrity.push(e.to_string());
                }
                Err(e) => integrity.push(format!("artifact {}: {e}", a.path)),
            }
        }
        if !integrity.is_empty() {
            ok = false;
            rec.event(
                "artifact_integrity_failure",
                json!({ "job_id": d.job_id, "task_id": d.task_id, "errors": integrity }),
            );
            rec.feedback.push(format!(
                "artifact_integrity_failure: artifacts of job {} were rejected: {}",
                d.job_id,
                integrity.join("; ")
            ));
        }
        let exhausted =
            rec.attempts.get(&d.task_id).copied().unwrap_or(0) >= rec.budgets.max_attempts_per_task;
        let status = if ok {
            TaskStatus::Done
        } else if exhausted || !integrity.is_empty() {
            TaskStatus::Failed
        } else {
            TaskStatus::Pending
        };
        set_task_status(rec, &d.task_id, status);
        let label = format!("{:?}", resp.status).to_lowercase();
        rec.event(
            "job_finished",
            json!({ "job_id": d.job_id, "status": label, "task_status": status }),
        );
        rec.feedback.push(summarize(d, resp));
        let failure = resp
            .sba_result
            .as_ref()
            .and_then(|r| match (&r.failure_code, &r.failure_message) {
                (Some(c), Some(m)) => Some(format!("{c}: {}", clip(m, MAX_FAILURE_MESSAGE_BYTES))),
                (Some(c), None) => Some(c.to_string()),
                _ => None,
            })
            .or_else(|| resp.failure_reason.clone())
            .filter(|_| !ok);
        let failure = failure.or_else(|| (!integrity.is_empty()).then(|| integrity.join("; ")));
        let verified: Vec<_> = rec
            .state
            .artifacts
            .iter()
            .filter(|a| a.job_id == d.job_id)
            .map(|a| a.record.clone())
            .collect();
        rec.evidence.push(job_evidence(
            &d.job_id,
            &d.task_id,
            &d.skill_id,
            d.attempt,
            resp,
            failure.clone().or_else(|| (!ok).then(|| label.clone())),
            verified.clone(),
        ));
        progress(Progress::JobDone {
            job_id: d.job_id.clone(),
            status: label,
            failure,
            artifacts: verified,
        });
    }
}

/// Most tool calls of one job the model reads (the rest are `tool_calls_dropped`).
const MAX_TOOL_CALLS_SHOWN: usize = 30;
/// Longest tool-call error the model reads.
const MAX_TOOL_ERROR_BYTES: usize = 200;
/// Longest `failure_message` of a result.json the model and the session keep.
const MAX_FAILURE_MESSAGE_BYTES: usize = 2000;

/// A compact result for the model: statuses, codes, tails, artifacts; never raw megabytes.
pub fn summarize(d: &Dispatch, resp: &RunJobResponse) -> String {
    let mut v = json!({
        "job_id": d.job_id, "task_id": d.task_id, "skill_id": d.skill_id,
        "status": resp.status, "failure_reason": resp.failure_reason,
    });
    if let Some(r) = &resp.sba_result {
        v["failure_code"] = json!(r.failure_code);
        v["failure_message"] = json!(r
            .failure_message
            .as_deref()
            .map(|m| clip(m, MAX_FAILURE_MESSAGE_BYTES)));
        v["steps"] = Value::Array(
            r.steps
                .iter()
                .map(|s| {
                    let mut o = json!({ "id": s.id, "type": s.step_type, "status": s.status });
                    // An upstream worker's result has no typed `result`: its text output.
                    if s.result.is_none() && !s.output.is_empty() {
                        o["output_tail"] = json!(tail(&s.output, 1500));
                    }
                    if let Some(out) = &s.result {
                        let full = serde_json::to_value(out).unwrap_or(Value::Null);
                        for k in [
                            "exit_code",
                            "truncated",
                            "files_modified",
                            "files_created",
                            "files_deleted",
                            "size_bytes",
                            "path",
                        ] {
                            if !full[k].is_null() {
                                o[k] = full[k].clone();
                            }
                        }
                        for k in ["stdout", "stderr", "content"] {
                            if let Some(t) = full[k].as_str() {
                                o[format!("{k}_tail")] = json!(tail(t, 1500));
                            }
                        }
                        if let Some(m) = full["matches"].as_array() {
                            o["matches"] = Value::Array(m.iter().take(30).cloned().collect());
                        }
                        if !full["tree"].is_null() {
                            let t = full["tree"].to_string();
                            o["tree"] = json!(tail(&t, 3000));
                        }
                    }
                    o
                })
                .collect(),
        );
        v["artifacts"] = json!(r.artifacts);
        // An agent job's gateway tool calls (tool, outcome, bytes). result.json is the
        // sandbox's (up to 16 MiB): the first MAX_TOOL_CALLS_SHOWN with a tool name that
        // is one, errors cut, the rest counted.
        if !r.tool_calls.is_empty() {
            let kept: Vec<Value> = r
                .tool_calls
                .iter()
                .filter(|c| cynode_protocol::job::is_tool_name(&c.tool))
                .take(MAX_TOOL_CALLS_SHOWN)
                .map(|c| {
                    let mut o = json!({ "tool": c.tool, "outcome": c.outcome,
                        "bytes": c.bytes, "duration_ms": c.duration_ms });
                    if let Some(e) = &c.error {
                        o["error"] = json!(clip(e, MAX_TOOL_ERROR_BYTES));
                    }
                    o
                })
                .collect();
            let dropped = r.tool_calls.len() - kept.len();
            v["tool_calls"] = Value::Array(kept);
            if dropped > 0 {
                v["tool_calls_dropped"] = json!(dropped);
            }
        }
    }
    format!("result of job {}: {}", d.job_id, v)
}
pub(super) fn tail(s: &str, n: usize) -> &str {
    let start = s.len().saturating_sub(n);
    let mut i = start;
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hostile result.json's tool calls and failure message reach the model bounded.
    #[test]
    fn a_flood_of_tool_calls_is_summarized_small() {
        let mut resp: RunJobResponse = serde_json::from_value(json!({
            "version": 1, "task_id": "t1", "job_id": "j1", "status": "failed",
        }))
        .unwrap();
        let calls: Vec<Value> = (0..10_000)
            .map(|i| {
                let tool = if i % 2 == 0 {
                    "skills.get".to_string()
                } else {
                    "x".repeat(5000)
                };
                json!({ "tool": tool, "outcome": "error", "bytes": 0,
                    "duration_ms": 1, "error": "e".repeat(1024) })
            })
            .collect();
        resp.sba_result = Some(
            serde_json::from_value(json!({
                "protocol_version": "1", "job_id": "j1", "task_id": "t1",
                "status": "failure", "started_at": "", "finished_at": "",
                "steps": [], "artifacts": [], "tool_calls": calls,
                "failure_code": "step_failed", "failure_message": "m".repeat(1 << 20),
                "resource_usage": {"cpu_time_ms": 0, "max_rss_bytes": 0},
            }))
            .unwrap(),
        );
        let d = Dispatch {
            job_id: "j1".into(),
            task_id: "t1".into(),
            skill_id: "s".into(),
            attempt: 1,
            job_json: "{}".into(),
            worker_id: String::new(),
            image: String::new(),
            new_workspace: false,
        };
        let s = summarize(&d, &resp);
        assert!(s.len() < 16 * 1024, "{} bytes", s.len());
        let v: Value = serde_json::from_str(s.split_once(": ").unwrap().1).unwrap();
        let kept = v["tool_calls"].as_array().unwrap();
        assert_eq!(kept.len(), 30);
        assert!(kept.iter().all(|c| c["tool"] == "skills.get"));
        assert!(kept[0]["error"].as_str().unwrap().len() <= 200);
        assert_eq!(v["tool_calls_dropped"], 10_000 - 30);
    }
}
