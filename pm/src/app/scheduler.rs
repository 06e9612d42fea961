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
//! - a replica told to stop (SIGTERM) claims nothing more, lets each session finish the
//!   step it is in (a model call, a job's result) for up to the shutdown grace, then
//!   releases every lease it holds, so another replica takes the sessions over at once
//!   instead of after the lease time;
//! - every state change is also guarded by the record's version, so even a stale replica
//!   can never overwrite newer state (its save fails with a conflict and it stops).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
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
    /// After a stop, how long a session may take to finish its current step before it
    /// is left mid-step (safe: the journal resumes it, at worst repeating that step).
    pub grace: Duration,
}

/// Claims and drives sessions until `stop` is cancelled, then returns once every
/// session it drove has been handed back. `wake` is notified when a session becomes
/// runnable here (created, answered) or a driven session frees its slot, so waiting
/// sessions are picked up without waiting a tick.
pub async fn run(pm: Arc<Pm>, s: Schedule, wake: Arc<Notify>, stop: CancellationToken) {
    let running = Arc::new(tokio::sync::Semaphore::new(s.capacity));
    let lease_ms = i64::try_from(s.lease.as_millis()).unwrap_or(i64::MAX);
    while !stop.is_cancelled() {
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
                        let stop = stop.clone();
                        let span = tracing::info_span!("session", session_id = %id);
                        tokio::spawn(
                            async move {
                                drive(&pm, &s, &id, &stop).await;
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
            _ = stop.cancelled() => {}
        }
    }
    let held = s.capacity - running.available_permits();
    info!(held, "stopping: handing sessions back");
    let all = u32::try_from(s.capacity).unwrap_or(u32::MAX);
    let _ = running.acquire_many(all).await;
    // Anything a driver could not release (the database was unreachable then).
    match pm.store.release_all(&s.owner).await {
        Ok(n) if n > 0 => info!(released = n, "released the remaining leases"),
        Ok(_) => {}
        Err(e) => warn!(error = %e, "cannot release leases; they will expire"),
    }
}

/// Drives one claimed session while renewing its lease, until it ends, parks, loses its
/// lease, or `stop` (after the grace) ends it here.
async fn drive(pm: &Pm, s: &Schedule, id: &str, stop: &CancellationToken) {
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
    let grace_over = async {
        stop.cancelled().await;
        tokio::time::sleep(s.grace).await;
    };
    info!(owner = %s.owner, "driving session");
    let mut quiet = |_| {};
    tokio::select! {
        r = pm.run_until(id, &mut quiet, stop) => match r {
            Ok(rec) => info!(status = rec.status.as_str(), "session left this replica"),
            Err(DriverError::Store(StoreError::Conflict(_))) => {
                info!("session changed elsewhere (answered, canceled or taken over); stopping here");
            }
            Err(e) => warn!(error = %e, "driving the session failed; it will be claimed again"),
        },
        why = renew => warn!(why, "stopped driving the session"),
        _ = grace_over => warn!("shutdown grace over: the session is handed back mid-step"),
    }
    if let Err(e) = pm.store.release(id, &s.owner).await {
        warn!(error = %e, "cannot release the lease; it will expire");
    }
    m.active_sessions.dec();
}
