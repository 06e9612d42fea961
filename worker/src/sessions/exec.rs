//! Running one command in a session: one at a time (a second concurrent exec is a
//! conflict), in its own task so a client that goes away leaves neither the session busy
//! nor the command unbounded, and answered as an [`ExecResponse`] whose status and failure
//! reason say how the command ended. A streamed exec ([`super::stream`]) is started the
//! same way, with its output tapped as it is written.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cynode_protocol::time::now_rfc3339;
use cynode_protocol::worker_api::{check_id, WorkerJobStatus, API_VERSION};
use cynode_protocol::worker_sessions::{ExecRequest, ExecResponse, SessionEndReason};

use super::egress::ExecNet;
use super::spec::{container_name, sandbox_env, sandbox_spec};
use super::state::Phase;
use super::validate::validate_exec;
use super::{SessionError, Sessions};
use crate::backend::capture::Tap;
use crate::backend::exec_io::ExecIo;
use crate::backend::{EndReason, SandboxOutcome};
use crate::disk_guard::{Breach, DiskLimit};
use crate::inference::listener::JobInference;
use crate::sandbox::SandboxSpec;

impl Sessions {
    /// Runs one command in the session. The command runs in its own task, so a client
    /// that goes away does not leave the session marked busy or the command unbounded.
    pub async fn exec(
        &self,
        session_id: &str,
        req: ExecRequest,
    ) -> Result<ExecResponse, SessionError> {
        if req.stdin {
            return Err(SessionError::Invalid(
                cynode_protocol::ValidationError::new(
                    "stdin",
                    "a stdin needs a streamed exec (\"stream\": true)",
                ),
            ));
        }
        self.launch(session_id, req, None, None)?
            .await
            .map_err(|e| SessionError::Internal(format!("exec task failed: {e}")))
    }

    /// Starts one command in the session, in its own task; `tap`, when given, receives
    /// its output as it is written, and `io` gives it its stdin and signals
    /// ([`super::stream`]); `io`'s signaller is revoked once the backend's exec returned,
    /// before the session can run another command.
    pub(super) fn launch(
        &self,
        session_id: &str,
        req: ExecRequest,
        tap: Option<Arc<dyn Tap>>,
        io: Option<Arc<ExecIo>>,
    ) -> Result<tokio::task::JoinHandle<ExecResponse>, SessionError> {
        check_id("session_id", session_id)?;
        validate_exec(&req)?;
        let cfg = &self.inner.cfg;
        let timeout = Duration::from_secs(cfg.limits.effective_timeout(req.timeout_seconds));
        let (sandbox, spec, cancel, workspace, net, inference) =
            self.with_entry(session_id, |e| {
                let sandbox = match &e.phase {
                    Phase::Running(sb) => sb.clone(),
                    Phase::Starting => {
                        return Err(SessionError::Conflict(format!(
                            "session {session_id} is being created; retry"
                        )))
                    }
                    Phase::Suspended { .. } => {
                        return Err(super::suspend::suspended_conflict(session_id))
                    }
                    Phase::Ended { .. } => {
                        let why = e.info.end_reason.map_or("ended", SessionEndReason::as_str);
                        return Err(SessionError::Conflict(format!(
                            "session {session_id} has ended ({why})"
                        )));
                    }
                };
                if e.busy {
                    return Err(SessionError::Conflict(format!(
                        "session {session_id} is running another command"
                    )));
                }
                e.busy = true;
                e.last_activity = Instant::now();
                e.seq += 1;
                let spec = sandbox_spec(
                    cfg,
                    format!("{}-{}", container_name(session_id), e.seq),
                    &e.info,
                    (e.workspace.clone(), e.host_uid),
                    req.command.clone(),
                    sandbox_env(
                        &e.info,
                        &e.env,
                        &req.env,
                        e.net.is_some(),
                        e.inference.as_ref().map(|i| i.token()),
                    ),
                    timeout,
                    e.net.is_some(),
                );
                Ok((
                    sandbox,
                    spec,
                    e.cancel.clone(),
                    e.workspace.clone(),
                    e.net.clone(),
                    e.inference.clone(),
                ))
            })?;
        let limit = DiskLimit::from_limits(&cfg.limits);
        let this = self.clone();
        let id = session_id.to_string();
        let task = tokio::spawn(async move {
            let started_at = now_rfc3339();
            // The job's disk guard, over the workspace (`statfs` of its volume, else the
            // poller): a breach stops the command (a child token: not a cancel of the
            // session).
            let trip = cancel.child_token();
            let guard = crate::disk_limit::start(vec![workspace], limit, trip.clone());
            // The session's proxy, or one of the command's own bound in its sandbox.
            let mut share = net.as_ref().map(|n| n.exec_start());
            // The session's inference listener, or one of the command's own.
            let listener = inference.as_ref().and_then(|i| i.exec_listener());
            let hook = crate::backend::netns_gate::chain(
                share.as_mut().and_then(ExecNet::hook),
                listener.as_ref().map(JobInference::hook),
            );
            let run = async {
                match hook {
                    Some(hook) => sandbox.exec_gated(&spec, &trip, hook).await,
                    None => sandbox.exec(&spec, &trip).await,
                }
            };
            let run = async {
                match &io {
                    Some(io) => crate::backend::exec_io::scoped(io.clone(), run).await,
                    None => run.await,
                }
            };
            let out = match tap {
                Some(tap) => crate::backend::capture::tapped(tap, run).await,
                None => run.await,
            };
            if let Some(io) = &io {
                io.revoke().await;
            }
            drop(listener);
            let egress = match (&net, share) {
                (Some(n), Some(share)) => Some(n.exec_end(share).await),
                _ => None,
            };
            let breach = guard.finish().await;
            let ended_at = now_rfc3339();
            let mut gone = None;
            if let Ok(mut map) = this.inner.map.lock() {
                if let Some(e) = map.get_mut(&id) {
                    e.busy = false;
                    e.last_activity = Instant::now();
                    if matches!(out.end, EndReason::StartFailed(_)) && !sandbox.is_alive() {
                        gone = e.end(SessionEndReason::SandboxExited);
                    }
                    // Over the disk limit: the session's sandbox goes (with whatever a
                    // command left running or holding open in it).
                    if breach.is_some() {
                        gone = gone.or_else(|| e.end(SessionEndReason::SandboxExited));
                    }
                }
            }
            if let Some(sb) = gone {
                sb.stop().await;
            }
            let mut resp = exec_response(&id, &spec, out, breach, started_at, ended_at);
            if let Some((records, dropped)) = egress {
                resp.egress = Some(records);
                resp.egress_dropped = dropped;
            }
            resp
        });
        Ok(task)
    }
}

fn exec_response(
    session_id: &str,
    spec: &SandboxSpec,
    out: SandboxOutcome,
    breach: Option<Breach>,
    started_at: String,
    ended_at: String,
) -> ExecResponse {
    let mut exit_code = out.exit_code.unwrap_or(-1);
    let (status, failure_reason) = match out.end {
        _ if breach.is_some() => {
            if out.end != EndReason::Exited {
                exit_code = -1;
            }
            (WorkerJobStatus::Failed, breach.map(|b| b.to_string()))
        }
        EndReason::Exited if exit_code == 0 => (WorkerJobStatus::Completed, None),
        EndReason::Exited if exit_code == 137 => (
            WorkerJobStatus::Failed,
            Some("command killed by SIGKILL: memory or pids limit reached".to_string()),
        ),
        EndReason::Exited => (WorkerJobStatus::Failed, None),
        EndReason::TimedOut => {
            exit_code = -1;
            (
                WorkerJobStatus::Timeout,
                Some(format!(
                    "command killed after its timeout of {}s",
                    spec.timeout.as_secs()
                )),
            )
        }
        EndReason::Canceled => {
            exit_code = -1;
            (
                WorkerJobStatus::Failed,
                Some("the session ended while the command ran".to_string()),
            )
        }
        EndReason::StartFailed(msg) => {
            exit_code = -1;
            (WorkerJobStatus::Failed, Some(msg))
        }
    };
    ExecResponse {
        version: API_VERSION,
        session_id: session_id.to_string(),
        status,
        exit_code,
        stdout: out.stdout,
        stderr: out.stderr,
        truncated: out.truncated,
        started_at,
        ended_at,
        failure_reason,
        egress: None,
        egress_dropped: 0,
    }
}
