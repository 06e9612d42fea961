//! Await: create the session's workspace on its worker, submit the journaled job
//! (idempotent on job_id), and poll it to its end, saving each new state as an event.
//! When the PM serves the sandbox gateway and the job lists tools in its
//! `context.mcp_tools`, the job gets a job token for them in the Worker
//! API request (not in job.json), revoked when the job ends whatever the outcome; the
//! calls it made and the artifacts it put join the session then.

use cynode_protocol::worker_api::*;
use serde_json::json;

use cynode_protocol::result::ArtifactRecord;
use cynode_protocol::session::SessionArtifact;

use crate::dispatch::{DispatchError, WorkerClient};
use crate::gateway::{self, Grant};
use crate::session::{Dispatch, FailureKind, Phase, SessionRecord};
use crate::store::StoreError;
use crate::workers::PlaceError;

use super::{failpoint, DriverError, Pm, Progress};
/// Why watching a job stopped.
#[derive(Debug, thiserror::Error)]
pub(super) enum WatchError {
    #[error("{0}")]
    Dispatch(#[from] DispatchError),
    #[error("{0}")]
    Store(#[from] StoreError),
}

impl Pm {
    /// A job whose constraints ask for network (`ext_net_allowed`, which the policy gate
    /// let through) runs with `network_policy: restricted`, reaching only its skill's
    /// declared `egress` (or, when the skill declares none, the tenant's `egress.allow`;
    /// with neither, the worker's own allowlist) through the worker's egress proxy.
    fn egress_for(&self, d: &Dispatch, req: &mut RunJobRequest) {
        let wants = serde_json::from_str::<serde_json::Value>(&d.job_json)
            .ok()
            .and_then(|j| {
                let c = j.get("constraints")?;
                Some(
                    c.get("ext_net_allowed") == Some(&json!(true))
                        || c.get("network_allowed") == Some(&json!(true)),
                )
            })
            .unwrap_or(false);
        if !wants {
            return;
        }
        let declared = self
            .registry
            .get(&d.skill_id)
            .map(|s| s.manifest.egress.clone())
            .unwrap_or_default();
        let allow = if declared.is_empty() {
            self.tenant.egress.allow.clone()
        } else {
            declared
        };
        req.sandbox.network_policy = Some(NetworkPolicy::Restricted);
        req.sandbox.egress_allow = (!allow.is_empty()).then_some(allow);
    }

    /// Polls the worker until the job ends. Each new state is saved as a `job_state`
    /// event (so event streams show `in_progress` live, from any replica) and reported.
    pub(super) async fn watch_job(
        &self,
        worker: &WorkerClient,
        rec: &mut SessionRecord,
        version: &mut i64,
        job_id: &str,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<RunJobResponse, WatchError> {
        let (mut delay, max_delay) = worker.poll;
        let mut last = None;
        loop {
            let s = worker.status(job_id).await?;
            if last != Some(s.status) {
                last = Some(s.status);
                progress(Progress::JobState {
                    job_id: job_id.to_string(),
                    state: s.status,
                });
                rec.event("job_state", json!({ "job_id": job_id, "state": s.status }));
                *version = self.store.save(rec, *version, &[]).await?;
            }
            if s.status.is_terminal() {
                return s.result.ok_or_else(|| {
                    DispatchError::Unavailable(format!("job {job_id} ended without a result"))
                        .into()
                });
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(max_delay);
        }
    }

    #[tracing::instrument(skip_all, fields(job_id = %d.job_id, task_id = %d.task_id, skill_id = %d.skill_id))]
    pub(super) async fn await_job(
        &self,
        rec: &mut SessionRecord,
        version: i64,
        d: Dispatch,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<(), DriverError> {
        let (context, model) = super::job_brief(&d.job_json);
        progress(Progress::Dispatched {
            job_id: d.job_id.clone(),
            task_id: d.task_id.clone(),
            skill_id: d.skill_id.clone(),
            worker_id: d.worker_id.clone(),
            image: d.image.clone(),
            context,
            model,
        });
        let Some(worker) = self.workers.client(&d.worker_id) else {
            rec.fail(
                FailureKind::WorkerUnavailable,
                PlaceError::Unknown(d.worker_id.clone()).to_string(),
            );
            self.store.save(rec, version, &[]).await?;
            return Ok(());
        };
        let mut req = RunJobRequest::sba(
            &d.task_id,
            &d.job_id,
            &d.image,
            d.job_json.clone(),
            Some(rec.workspace_id.clone()),
        );
        self.egress_for(&d, &mut req);
        let token = self.gateway_token(rec, &d, &mut req);
        // A key of its own for the run's inference relay, when one serves here; revoked
        // when the job is over for this driver (dropped below, or with the future).
        let inference_key = crate::inference_relay::job_keys::for_request(&d.job_json, &mut req);
        let mut version = version;
        let outcome = match self.prepare_workspace(worker, rec, &d).await {
            Ok(()) => match worker.submit(&req).await {
                Ok(_) => {
                    self.watch_job(worker, rec, &mut version, &d.job_id, progress)
                        .await
                }
                Err(e) => Err(e.into()),
            },
            Err(e) => Err(e.into()),
        };
        // Whatever the outcome (result, cancel, worker failure), the job is over for
        // this driver: its token goes now, before anything is saved.
        if let Some(t) = token {
            record_gateway(rec, &d, t.revoke());
        }
        drop(inference_key);
        let resp = match outcome {
            Ok(r) => r,
            Err(WatchError::Store(e)) => return Err(e.into()),
            Err(WatchError::Dispatch(
                e @ (DispatchError::Unavailable(_)
                | DispatchError::Auth { .. }
                | DispatchError::Tls { .. }),
            )) => {
                rec.fail(FailureKind::WorkerUnavailable, e.to_string());
                self.store.save(rec, version, &[]).await?;
                return Ok(());
            }
            Err(WatchError::Dispatch(e)) => {
                rec.fail(
                    FailureKind::InternalError,
                    format!("worker refused job {}: {e}", d.job_id),
                );
                self.store.save(rec, version, &[]).await?;
                return Ok(());
            }
        };
        if let Some(records) = &resp.egress {
            // What the job's sandbox reached, or tried to, through the worker's egress
            // proxy: in the session's events and `sessions show`.
            rec.event(
                "job_egress",
                json!({ "job_id": d.job_id, "records": records, "dropped": resp.egress_dropped }),
            );
        }
        crate::metrics::metrics().job(&format!("{:?}", resp.status).to_lowercase());
        self.take_result(worker, rec, &d, &resp, progress).await;
        rec.state.active_job_id = None;
        rec.phase = Phase::Think;
        self.store
            .save(
                rec,
                version,
                &[(
                    "job_result",
                    json!({ "job_id": d.job_id, "status": resp.status }),
                )],
            )
            .await?;
        failpoint("after_result");
        if let Err(e) = worker.ack(&d.job_id).await {
            tracing::warn!(job_id = %d.job_id, error = %e, "ack failed; the worker's retention will clean up");
        }
        Ok(())
    }

    /// Mints the job's gateway token (when this PM serves a gateway and the job lists
    /// tools in its `context.mcp_tools`; the token admits those only) and puts it in the
    /// Worker API request beside the gateway's URL. It lives until the job's deadline
    /// (its `max_runtime_seconds`, or the Worker API default, plus a grace) unless
    /// revoked first, which the returned guard does when the job ends or is dropped.
    fn gateway_token(
        &self,
        rec: &SessionRecord,
        d: &Dispatch,
        req: &mut RunJobRequest,
    ) -> Option<JobGatewayToken> {
        let url = self.gateway_url.as_ref()?;
        let job = serde_json::from_str::<serde_json::Value>(&d.job_json).ok()?;
        // Only a job that lists tools gets a token, for those tools only.
        let tools: Vec<String> = job["context"]["mcp_tools"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|t| t.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        if tools.is_empty() {
            return None;
        }
        let runtime = job["constraints"]["max_runtime_seconds"]
            .as_u64()
            .unwrap_or(DEFAULT_TIMEOUT_SECONDS)
            .min(MAX_TIMEOUT_SECONDS);
        let ttl = std::time::Duration::from_secs(runtime + TOKEN_GRACE_SECONDS);
        let token = gateway::tokens().mint(
            Grant {
                tenant: rec.tenant_id.clone(),
                session_id: rec.state.session_id.clone(),
                task_id: d.task_id.clone(),
                job_id: d.job_id.clone(),
                skill_id: d.skill_id.clone(),
                tools,
            },
            ttl,
        );
        req.gateway = Some(GatewayGrant {
            url: url.clone(),
            token: token.expose().to_string(),
        });
        Some(JobGatewayToken {
            job_id: Some(d.job_id.clone()),
        })
    }

    /// Creates the session's workspace (seeded as asked) on the worker its first job was
    /// placed on. Idempotent, so a resumed session repeats it safely.
    pub(super) async fn prepare_workspace(
        &self,
        worker: &WorkerClient,
        rec: &SessionRecord,
        d: &Dispatch,
    ) -> Result<(), DispatchError> {
        if !d.new_workspace {
            return Ok(());
        }
        let seed = rec.workspace_seed.as_deref().map(std::path::Path::new);
        worker
            .create_workspace(&rec.workspace_id, seed)
            .await
            .map_err(|e| match e {
                DispatchError::Rejected { status, detail } => DispatchError::Rejected {
                    status,
                    detail: format!(
                        "worker {} refused to create the session's workspace: {detail}",
                        d.worker_id
                    ),
                },
                other => other,
            })
    }
}

/// Beyond the job's own runtime, how long its gateway token may outlive a driver that
/// never saw the job end (queueing, start-up, a lost PM): the deadline that bounds it.
const TOKEN_GRACE_SECONDS: u64 = 600;

/// A dispatched job's live gateway token: revoked by [`JobGatewayToken::revoke`] when
/// the job ends, or on drop (a driver future dropped mid-job, a panic).
struct JobGatewayToken {
    job_id: Option<String>,
}

impl JobGatewayToken {
    fn revoke(mut self) -> gateway::Revoked {
        match self.job_id.take() {
            Some(j) => gateway::tokens().revoke_job(&j),
            None => gateway::Revoked::default(),
        }
    }
}

impl Drop for JobGatewayToken {
    fn drop(&mut self) {
        if let Some(j) = self.job_id.take() {
            gateway::tokens().revoke_job(&j);
        }
    }
}

/// What the job did through the gateway joins the session: each call (tool, outcome,
/// bytes) as a `gateway_calls` event, each verified `artifact.put` as an artifact of the
/// job (its bytes were checked against their sha256 when they were put).
fn record_gateway(rec: &mut SessionRecord, d: &Dispatch, revoked: gateway::Revoked) {
    if !revoked.audit.is_empty() {
        let refused = revoked.audit.iter().filter(|a| a.outcome != "ok").count();
        rec.event(
            "gateway_calls",
            json!({ "job_id": d.job_id, "calls": revoked.audit, "refused": refused }),
        );
    }
    for a in revoked.artifacts {
        rec.state
            .artifacts
            .retain(|x| !(x.job_id == d.job_id && x.record.path == a.path));
        rec.state.artifacts.push(SessionArtifact {
            record: ArtifactRecord {
                path: a.path,
                sha256: a.sha256,
                size_bytes: a.size_bytes,
            },
            job_id: d.job_id.clone(),
            location: a.location,
        });
    }
}
