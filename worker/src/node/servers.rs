//! A job's own servers, owned by one [`JobServers`] for the job's life: the lifecycle
//! socket of an SBA job (`/job/status.sock`, which reports `in_progress`), the inference
//! proxy's socket and loopback listener, the PM gateway's socket, and the egress proxy.
//! Each listens in the job's directory (or, for the listener and the proxy, inside its
//! sandbox, bound by the backend's gate); dropping the servers stops them and removes
//! their sockets.

use std::sync::Arc;

use cynode_protocol::worker_api::{AsyncJobState, RunJobRequest, SbaLifecycle};

use super::Node;
use crate::callback;
use crate::executor::PreparedJob;
use crate::gateway_forward;
use crate::inference::{self, Proxy};
use crate::job_grants;

/// The servers of one running job; they stop when it is dropped.
pub(super) struct JobServers {
    _status: Option<callback::CallbackServer>,
    _inference: Option<inference::ProxyServer>,
    _gateway: Option<gateway_forward::ForwardServer>,
}

impl JobServers {
    /// Starts what `job` gets of the node and attaches the egress proxy and the inference
    /// listener to it (the backend binds them inside its sandbox); a server that cannot
    /// start ends the job unrun, for the reason returned.
    pub(super) fn start(
        node: &Arc<Node>,
        req: &RunJobRequest,
        job: PreparedJob,
    ) -> Result<(PreparedJob, JobServers), String> {
        let mount = job.paths().mount.clone();
        let host_uid = job.host_uid();
        let status = if req.sandbox.job_spec_json.is_some() {
            let store = node.store.clone();
            let job_id = req.job_id.clone();
            let on_status: callback::OnStatus = Arc::new(move |s| {
                if s == SbaLifecycle::InProgress {
                    let store = store.clone();
                    let job_id = job_id.clone();
                    tokio::spawn(async move {
                        let _ = store.set_state(&job_id, AsyncJobState::InProgress).await;
                    });
                }
            });
            match callback::listen(&mount, &req.job_id, on_status, &node.job_sockets()) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(job_id = %req.job_id, error = %e, "no lifecycle socket; in_progress will not be reported");
                    None
                }
            }
        } else {
            None
        };
        let mut listener = None;
        let inference = match (
            job.inference_models(),
            &node.inference,
            job.inference_token(),
        ) {
            (Some(models), Some(upstream), Some(token)) => {
                let proxy = Proxy::new(&req.job_id, models.to_vec(), Arc::clone(upstream));
                listener = Some(inference::listener::JobInference::new(
                    Arc::clone(&proxy),
                    token.to_string(),
                    node.job_sockets(),
                ));
                match inference::listen(&mount, proxy, &node.job_sockets(), host_uid) {
                    Ok(s) => Some(s),
                    Err(e) => return Err(format!("cannot start the inference proxy: {e}")),
                }
            }
            _ => None,
        };
        let gateway = if job_grants::gateway().has(&req.job_id) {
            match gateway_forward::listen(
                &mount,
                &req.job_id,
                &node.job_sockets(),
                &node.gateway,
                host_uid,
            ) {
                Ok(s) => Some(s),
                Err(e) => return Err(format!("cannot start the gateway socket: {e}")),
            }
        } else {
            None
        };
        let egress = match (job.egress_policy(), &node.egress) {
            (Some(policy), Some(shared)) => {
                let e = crate::job_egress::JobEgress::new(
                    Arc::clone(shared),
                    &req.job_id,
                    policy.clone(),
                );
                Some(if listener.is_some() {
                    e.with_inference_listener()
                } else {
                    e
                })
            }
            (None, _) => None,
            (Some(_), None) => {
                return Err("the node no longer offers this job's egress (network_policy)".into());
            }
        };
        let job = match egress {
            Some(e) => job.with_egress(e),
            None => job,
        };
        let job = match listener {
            Some(l) => job.with_inference(l),
            None => job,
        };
        Ok((
            job,
            JobServers {
                _status: status,
                _inference: inference,
                _gateway: gateway,
            },
        ))
    }
}
