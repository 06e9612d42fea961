//! The reaper: every [`REAP_INTERVAL`] it ends sessions past their max lifetime or idle
//! timeout (a session is never idle while a command runs) and sessions whose sandbox
//! died, removes their sandboxes, and forgets ended sessions after the node's
//! `retention_seconds`.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use cynode_protocol::worker_sessions::SessionEndReason;

use super::state::Phase;
use super::{Inner, Sessions, REAP_INTERVAL};

impl Sessions {
    /// Starts the reaper: every [`REAP_INTERVAL`] it ends expired sessions and removes
    /// their sandboxes. It stops when the sessions are dropped.
    pub fn start_reaper(&self) {
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(REAP_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                Sessions { inner }.reap();
            }
        });
    }

    /// One reaper pass.
    fn reap(&self) {
        let now = Instant::now();
        let retention = Duration::from_secs(self.inner.cfg.retention_seconds);
        let mut ended = Vec::new();
        let Ok(mut map) = self.inner.map.lock() else {
            return;
        };
        for e in map.values_mut() {
            let Phase::Running(sandbox) = &e.phase else {
                continue;
            };
            let reason = if now >= e.deadline {
                SessionEndReason::MaxLifetime
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
    }
}
