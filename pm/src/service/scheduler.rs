//! The replica's share of the work: claim runnable sessions under a lease, drive each one
//! with the loop, renew the lease while it runs, give it back when the session ends or
//! parks.
//!
//! Invariants:
//! - a session is driven by at most one replica at a time: it is claimed with a lease in
//!   the database (`Store::claim`, `FOR UPDATE SKIP LOCKED` on PostgreSQL) and renewed
//!   every third of the lease; a replica that loses its lease (it stalled past expiry and
//!   another took over) stops driving at once;
//! - a replica killed mid-session leaves its lease to expire; another replica claims the
//!   session within one lease time and resumes it from the journal, so no accepted model
//!   reply is asked for again and no job is dispatched twice;
//! - every state change is also guarded by the record's version, so even a stale replica
//!   can never overwrite newer state (its save fails with a conflict and it stops).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tracing::{info, warn, Instrument};

use crate::driver::{DriverError, Pm};
use crate::store::StoreError;

/// How the replica schedules sessions.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// This replica's lease owner name (unique per process).
    pub owner: String,
    pub lease: Duration,
    /// Sessions driven at once by this replica.
    pub capacity: usize,
    /// How often to look for work when nothing wakes the scheduler.
    pub tick: Duration,
}

/// Claims and drives sessions until the process ends. `wake` is notified when a session
/// becomes runnable here (created, answered) or a driven session frees its slot, so
/// waiting sessions are picked up without waiting a tick.
pub async fn run(pm: Arc<Pm>, s: Schedule, wake: Arc<Notify>) {
    let running = Arc::new(tokio::sync::Semaphore::new(s.capacity));
    let lease_ms = i64::try_from(s.lease.as_millis()).unwrap_or(i64::MAX);
    loop {
        let free = running.available_permits();
        if free > 0 {
            match pm.store.claim(&s.owner, lease_ms, free as i64).await {
                Ok(ids) => {
                    for id in ids {
                        let Ok(permit) = Arc::clone(&running).acquire_owned().await else {
                            return;
                        };
                        let pm = Arc::clone(&pm);
                        let s = s.clone();
                        let wake = Arc::clone(&wake);
                        let span = tracing::info_span!("session", session_id = %id);
                        tokio::spawn(
                            async move {
                                drive(&pm, &s, &id).await;
                                drop(permit);
                                // A slot is free: claim waiting sessions now, not a tick later.
                                wake.notify_one();
                            }
                            .instrument(span),
                        );
                    }
                }
                Err(e) => warn!(error = %e, "cannot claim sessions"),
            }
        }
        tokio::select! {
            _ = wake.notified() => {}
            _ = tokio::time::sleep(s.tick) => {}
        }
    }
}

/// Drives one claimed session while renewing its lease.
async fn drive(pm: &Pm, s: &Schedule, id: &str) {
    let m = crate::metrics::metrics();
    m.active_sessions.inc();
    let lease_ms = i64::try_from(s.lease.as_millis()).unwrap_or(i64::MAX);
    let renew = async {
        loop {
            tokio::time::sleep(s.lease / 3).await;
            match pm.store.renew(id, &s.owner, lease_ms).await {
                Ok(true) => {}
                Ok(false) => return "the lease was lost",
                Err(e) => {
                    warn!(error = %e, "cannot renew the lease");
                }
            }
        }
    };
    info!(owner = %s.owner, "driving session");
    let mut quiet = |_| {};
    tokio::select! {
        r = pm.run(id, &mut quiet) => match r {
            Ok(rec) => info!(status = rec.status.as_str(), "session left this replica"),
            Err(DriverError::Store(StoreError::Conflict(_))) => {
                info!("session changed elsewhere (answered, canceled or taken over); stopping here");
            }
            Err(e) => warn!(error = %e, "driving the session failed; it will be claimed again"),
        },
        why = renew => warn!(why, "stopped driving the session"),
    }
    if let Err(e) = pm.store.release(id, &s.owner).await {
        warn!(error = %e, "cannot release the lease; it will expire");
    }
    m.active_sessions.dec();
}
