//! One session's state machine: `Starting` while its sandbox starts, `Running` while it
//! takes commands, `Suspended` while its sandbox is stopped and its workspace and settings
//! kept (`super::suspend`; back to `Starting` on resume), `Ended` (remembered for the
//! node's retention) once it was ended on request, by the reaper, or because its sandbox
//! died. [`Entry::end`] is the one transition to `Ended`: it stamps the info and cancels a
//! running command.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cynode_protocol::time::now_rfc3339;
use cynode_protocol::worker_sessions::{SessionEndReason, SessionInfo, SessionStatus};
use tokio_util::sync::CancellationToken;

use super::egress::SessionNet;
use super::inference::SessionInference;
use crate::backend::SessionSandbox;

/// Where a session is in its life.
pub(super) enum Phase {
    /// The sandbox is being started.
    Starting,
    Running(Arc<dyn SessionSandbox>),
    /// Its sandbox is stopped; the store holds it until it is resumed or ends.
    Suspended {
        since: Instant,
        /// The max lifetime left when it was suspended (suspended time does not count).
        remaining: Duration,
    },
    Ended {
        since: Instant,
    },
}

/// A session in the node's table.
pub(super) struct Entry {
    pub(super) info: SessionInfo,
    pub(super) phase: Phase,
    pub(super) env: BTreeMap<String, String>,
    pub(super) workspace: PathBuf,
    /// The workspace's host uid ([`crate::uid_pool`]).
    pub(super) host_uid: u32,
    pub(super) deadline: Instant,
    pub(super) idle: Duration,
    pub(super) last_activity: Instant,
    /// A command is running.
    pub(super) busy: bool,
    /// Canceled when the session ends: stops a running command.
    pub(super) cancel: CancellationToken,
    /// Commands run so far (names bubblewrap's per-command sandboxes).
    pub(super) seq: u64,
    /// The session's egress (`restricted` on a node with egress on); kept after the end
    /// for its totals.
    pub(super) net: Option<Arc<SessionNet>>,
    /// The session's inference listener (`use_inference`).
    pub(super) inference: Option<Arc<SessionInference>>,
    /// The request's `network_policy` and `egress_allow` (a repeat must ask the same).
    pub(super) network: (
        Option<cynode_protocol::worker_api::NetworkPolicy>,
        Option<Vec<String>>,
    ),
    /// The create request (checked again on resume, stored while suspended).
    pub(super) request: cynode_protocol::worker_sessions::CreateSessionRequest,
    /// Its sandbox is being stopped for a suspend (the reaper leaves it alone).
    pub(super) suspending: bool,
    /// What the reaper does once the session is idle.
    pub(super) on_idle: cynode_protocol::worker_session_state::OnIdle,
}

/// What an ended session leaves to remove: its sandbox and its egress proxy.
pub(super) struct Teardown {
    sandbox: Arc<dyn SessionSandbox>,
    net: Option<Arc<SessionNet>>,
}

impl Teardown {
    /// Closes the egress proxy (its listener and connections), then removes the sandbox.
    pub(super) async fn stop(self) {
        if let Some(net) = &self.net {
            net.finish().await;
        }
        self.sandbox.stop().await;
    }
}

impl Entry {
    /// The info as it stands, with the session's egress totals.
    pub(super) fn current(&self) -> SessionInfo {
        let mut info = self.info.clone();
        info.egress = self.net.as_ref().map(|n| n.info());
        info
    }

    /// Marks the session ended; returns what to remove, if it was running. A suspended
    /// session ends too (nothing to remove; its stored record is the caller's to delete).
    pub(super) fn end(&mut self, reason: SessionEndReason) -> Option<Teardown> {
        if let Phase::Suspended { .. } = self.phase {
            self.phase = Phase::Ended {
                since: Instant::now(),
            };
            self.info.status = SessionStatus::Ended;
            self.info.ended_at = Some(now_rfc3339());
            self.info.end_reason = Some(reason);
            tracing::info!(session_id = %self.info.session_id, task_id = %self.info.task_id, reason = reason.as_str(), "suspended session ended");
            return None;
        }
        let Phase::Running(_) = self.phase else {
            return None;
        };
        let Phase::Running(sandbox) = std::mem::replace(
            &mut self.phase,
            Phase::Ended {
                since: Instant::now(),
            },
        ) else {
            return None;
        };
        self.info.status = SessionStatus::Ended;
        self.info.ended_at = Some(now_rfc3339());
        self.info.end_reason = Some(reason);
        self.cancel.cancel();
        if let Some(i) = &self.inference {
            i.finish();
        }
        tracing::info!(session_id = %self.info.session_id, task_id = %self.info.task_id, reason = reason.as_str(), "session ended");
        Some(Teardown {
            sandbox,
            net: self.net.clone(),
        })
    }
}
