//! The reaper: every [`REAP_INTERVAL`] it ends sessions past their max lifetime or idle
//! timeout (a session is never idle while a command runs) and sessions whose sandbox
//! died, removes their sandboxes, and forgets ended sessions after the node's
//! `retention_seconds`. An idle session created with `on_idle: suspend` is suspended
//! instead ([`super::suspend`]); a suspended one past
//! `session_state.suspended_retention_seconds` ends; every [`SNAPSHOT_SWEEP_TICKS`] ticks,
//! snapshots past their retention are deleted.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use cynode_protocol::worker_sessions::SessionEndReason;

use cynode_protocol::worker_session_state::{OnIdle, SuspendRequest};

use super::state::Phase;
use super::{Inner, Sessions, REAP_INTERVAL};

/// Reaper ticks between two sweeps of expired snapshots.
const SNAPSHOT_SWEEP_TICKS: u64 = 5;

impl Sessions {
    /// Starts the reaper: every [`REAP_INTERVAL`] it ends expired sessions and removes
    /// their sandboxes. It stops when the sessions are dropped.
    pub fn start_reaper(&self) {
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(REAP_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut n = 0u64;
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                let sessions = Sessions { inner };
                sessions.reap();
                n += 1;
                if n.is_multiple_of(SNAPSHOT_SWEEP_TICKS) {
                    sessions.expire_snapshots().await;
                }
            }
        });
    }

    /// One reaper pass.
    fn reap(&self) {
        let now = Instant::now();
        let retention = Duration::from_secs(self.inner.cfg.retention_seconds);
        let mut ended = Vec::new();
        let mut to_suspend = Vec::new();
        let Ok(mut map) = self.inner.map.lock() else {
            return;
        };
        let forgotten = self.expired_suspended(&mut map);
        for (id, e) in map.iter_mut() {
            let Phase::Running(sandbox) = &e.phase else {
                continue;
            };
            if e.suspending {
                continue;
            }
            let reason = if now >= e.deadline {
                SessionEndReason::MaxLifetime
            } else if !e.busy && now >= e.last_activity + e.idle && e.on_idle == OnIdle::Suspend {
                // Not again next tick while the suspend runs.
                e.last_activity = now;
                to_suspend.push(id.clone());
                continue;
            } else if !e.busy && now >= e.last_activity + e.idle {
                SessionEndReason::IdleTimeout
            } else if !sandbox.is_alive() {
                SessionEndReason::SandboxExited
            } else {
                continue;
            };
            if let Some(sb) = e.end(reason) {
                ended.push(sb);
            }
        }
        map.retain(|_, e| match e.phase {
            Phase::Ended { since } => now.duration_since(since) < retention,
            _ => true,
        });
        drop(map);
        for sb in ended {
            tokio::spawn(async move { sb.stop().await });
        }
        for id in to_suspend {
            let this = self.clone();
            tokio::spawn(async move {
                if let Err(e) = this.suspend(&id, SuspendRequest::default()).await {
                    tracing::warn!(session_id = %id, error = %e, "cannot suspend an idle session");
                }
            });
        }
        for id in forgotten {
            let this = self.clone();
            tokio::spawn(async move { this.forget_suspended(&id).await });
        }
    }
}
