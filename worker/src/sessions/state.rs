//! One session's state machine: `Starting` while its sandbox starts, `Running` while it
//! takes commands, `Ended` (remembered for the node's retention) once it was ended on
//! request, by the reaper, or because its sandbox died. [`Entry::end`] is the one
//! transition to `Ended`: it stamps the info and cancels a running command.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cynode_protocol::time::now_rfc3339;
use cynode_protocol::worker_sessions::{SessionEndReason, SessionInfo, SessionStatus};
use tokio_util::sync::CancellationToken;

use crate::backend::SessionSandbox;

/// Where a session is in its life.
pub(super) enum Phase {
    /// The sandbox is being started.
    Starting,
    Running(Arc<dyn SessionSandbox>),
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
}

impl Entry {
    /// Marks the session ended; returns the sandbox to remove, if it was running.
    pub(super) fn end(&mut self, reason: SessionEndReason) -> Option<Arc<dyn SessionSandbox>> {
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
        tracing::info!(session_id = %self.info.session_id, task_id = %self.info.task_id, reason = reason.as_str(), "session ended");
        Some(sandbox)
    }
}
