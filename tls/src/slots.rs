//! The connection table of one listener: at most `max` connections, each knowing whether
//! a request is in flight on it and since when it has had none.
//!
//! A new connection when the table is full displaces the connection that has waited
//! longest with no request in flight (a slowloris client mid-head, a client that sent
//! nothing, an idle keep-alive connection, a TLS handshake that is dragging on); only when
//! every connection has a request in flight is the new one refused. So holding
//! connections open costs an attacker its slots the moment anyone else connects, and a
//! health probe always gets through.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// The table.
pub(crate) struct Slots {
    max: usize,
    table: Mutex<Table>,
    refused: AtomicU64,
}

#[derive(Default)]
struct Table {
    next_id: u64,
    open: HashMap<u64, Arc<Activity>>,
}

/// What the table knows of one connection.
pub(crate) struct Activity {
    in_flight: AtomicUsize,
    /// When the last request ended (or the connection was accepted).
    last_active: Mutex<Instant>,
    /// Whether a request has started on this connection yet.
    served: AtomicUsize,
    evicted: Notify,
}

/// A place in the table; dropping it frees the place.
pub(crate) struct Slot {
    id: u64,
    activity: Arc<Activity>,
    slots: Arc<Slots>,
}

/// Marks a request in flight on its connection until dropped.
pub(crate) struct InFlight(Arc<Activity>);

impl Slots {
    pub(crate) fn new(max: usize) -> Arc<Slots> {
        Arc::new(Slots {
            max: max.max(1),
            table: Mutex::new(Table::default()),
            refused: AtomicU64::new(0),
        })
    }

    /// A place for a new connection, displacing the longest-waiting connection with no
    /// request in flight when the table is full; `Err(refused so far)` when every
    /// connection has a request in flight.
    pub(crate) fn admit(self: &Arc<Self>) -> Result<Slot, u64> {
        let mut t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if t.open.len() >= self.max {
            let victim = t
                .open
                .iter()
                .filter(|(_, a)| a.in_flight.load(Ordering::SeqCst) == 0)
                .min_by_key(|(_, a)| a.last_active())
                .map(|(id, _)| *id);
            match victim.and_then(|id| t.open.remove(&id)) {
                Some(a) => a.evicted.notify_one(),
                None => return Err(self.refused.fetch_add(1, Ordering::Relaxed) + 1),
            }
        }
        let id = t.next_id;
        t.next_id += 1;
        let activity = Arc::new(Activity {
            in_flight: AtomicUsize::new(0),
            last_active: Mutex::new(Instant::now()),
            served: AtomicUsize::new(0),
            evicted: Notify::new(),
        });
        t.open.insert(id, Arc::clone(&activity));
        Ok(Slot {
            id,
            activity,
            slots: Arc::clone(self),
        })
    }

    /// Connections open now.
    #[cfg(test)]
    pub(crate) fn open(&self) -> usize {
        self.table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .open
            .len()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut t = self
            .slots
            .table
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        t.open.remove(&self.id);
    }
}

impl Activity {
    fn last_active(&self) -> Instant {
        *self
            .last_active
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn touch(&self) {
        *self
            .last_active
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
    }
}

impl Slot {
    pub(crate) fn activity(&self) -> Arc<Activity> {
        Arc::clone(&self.activity)
    }

    /// Resolves when another connection displaced this one.
    pub(crate) async fn evicted(&self) {
        self.activity.evicted.notified().await
    }

    /// Resolves once the connection has had no request in flight for `first` (before its
    /// first request: the head must come within it) or `idle` (after one).
    pub(crate) async fn idle(&self, first: Duration, idle: Duration) {
        let a = &self.activity;
        loop {
            let busy = a.in_flight.load(Ordering::SeqCst) > 0;
            let wait = if a.served.load(Ordering::SeqCst) == 0 {
                first
            } else {
                idle
            };
            let since = if busy {
                Instant::now()
            } else {
                a.last_active()
            };
            tokio::time::sleep_until(since + wait).await;
            if a.in_flight.load(Ordering::SeqCst) == 0 && a.last_active() + wait <= Instant::now() {
                return;
            }
        }
    }
}

impl Activity {
    /// A request starts; it is in flight until the returned guard is dropped.
    pub(crate) fn request(self: &Arc<Self>) -> InFlight {
        self.served.store(1, Ordering::SeqCst);
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.touch();
        InFlight(Arc::clone(self))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_table_displaces_the_longest_idle_connection_and_refuses_when_all_are_busy() {
        let slots = Slots::new(2);
        let a = slots.admit().unwrap();
        let b = slots.admit().unwrap();
        let busy = b.activity().request();
        // Full: `a` (idle) makes way, `b` (busy) stays.
        let c = slots.admit().unwrap();
        tokio::time::timeout(Duration::from_secs(5), a.evicted())
            .await
            .unwrap();
        assert_eq!(slots.open(), 2);
        let _c_busy = c.activity().request();
        // Every connection is busy: refused, and counted.
        assert_eq!(slots.admit().err(), Some(1));
        drop(busy);
        assert!(slots.admit().is_ok());
        drop(a);
        drop(c);
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_after_its_timeout_and_not_while_a_request_is_in_flight() {
        let slots = Slots::new(4);
        let s = slots.admit().unwrap();
        let first = Duration::from_secs(2);
        let idle = Duration::from_secs(10);
        // Nothing sent: idle after `first`.
        let t = Instant::now();
        s.idle(first, idle).await;
        assert_eq!(t.elapsed().as_secs(), 2);
        // A request in flight keeps it open past both timeouts.
        let r = s.activity().request();
        let still = tokio::time::timeout(Duration::from_secs(30), s.idle(first, idle)).await;
        assert!(still.is_err(), "idle while a request was in flight");
        drop(r);
        let t = Instant::now();
        s.idle(first, idle).await;
        assert_eq!(t.elapsed().as_secs(), 10);
    }
}
