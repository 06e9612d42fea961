//! A session's egress (`network_policy: restricted`, checked as a job's by
//! [`crate::job_egress::policy`]): the node's proxy at [`crate::job_egress::PROXY_ADDR`]
//! inside the session's network namespace, its budgets (connections, bytes, idle) the
//! session's, its audit split per exec and totalled for the session.
//!
//! - A session container (Podman or Docker with runc/crun) keeps one network namespace
//!   for the session's life: the proxy binds there once, when the session starts and before any
//!   command runs, and ends when the session ends. An exec's records are those the
//!   session's audit gained while it ran, once the proxy serves no connection (at most
//!   [`SETTLE_BOUND`] after the command's end: a connection is recorded when it closes,
//!   so one a background process keeps open is listed by the exec during which it
//!   closed).
//! - bubblewrap runs each command as a sandbox of its own: each exec binds a proxy of its
//!   own in that sandbox's namespace ([`crate::backend::SessionSandbox::exec_gated`]),
//!   given what is left of the session's byte budget; one exec at a time keeps the
//!   connection bound the session's. Its audit is the exec's, and is added to the
//!   session's total (bounded the same way).

use std::sync::{Arc, Mutex, MutexGuard};

use cynode_protocol::egress::{EgressAudit, EgressRecord};
use cynode_protocol::worker_sessions::SessionEgress;

use crate::backend::netns_gate::NetnsHook;
use crate::egress::Policy;
use crate::job_egress::{JobEgress, NodeEgress};

/// How long an exec's end waits for the session-long proxy's connections to be audited.
const SETTLE_BOUND: std::time::Duration = std::time::Duration::from_millis(250);

/// One session's egress.
#[derive(Debug)]
pub(super) struct SessionNet {
    node: Arc<NodeEgress>,
    policy: Policy,
    session_id: String,
    /// The session has an inference listener the proxy also serves.
    inference: bool,
    state: Mutex<NetState>,
}

#[derive(Debug, Default)]
struct NetState {
    /// The session-long proxy of a keep-alive container, while it runs.
    whole: Option<JobEgress>,
    /// Whether the proxy is the session-long one (set once it is bound).
    is_whole: bool,
    /// The per-command proxies' totals, or the session-long proxy's once it ended.
    total: SessionEgress,
    /// The session ended: no proxy starts any more.
    ended: bool,
}

/// One exec's share of the session's egress, from [`SessionNet::exec_start`].
#[derive(Debug)]
pub(super) enum ExecNet {
    /// The session-long proxy; where its audit stood when the exec started.
    Whole { kept: usize, attempts: u64 },
    /// A proxy of the exec's own, bound by the hook it gives.
    PerCommand(JobEgress),
}

impl ExecNet {
    /// The hook that binds this exec's own proxy, if it has one.
    pub(super) fn hook(&mut self) -> Option<NetnsHook> {
        match self {
            ExecNet::PerCommand(e) => Some(e.hook()),
            ExecNet::Whole { .. } => None,
        }
    }
}

fn attempts(a: &EgressAudit) -> u64 {
    a.records.len() as u64 + a.dropped
}

impl SessionNet {
    pub(super) fn new(
        node: Arc<NodeEgress>,
        policy: Policy,
        session_id: &str,
        inference: bool,
    ) -> Arc<Self> {
        Arc::new(SessionNet {
            node,
            policy,
            session_id: session_id.into(),
            inference,
            state: Mutex::new(NetState::default()),
        })
    }

    fn state(&self) -> MutexGuard<'_, NetState> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Binds the session-long proxy in the network namespace of `pid` (the keep-alive
    /// container's init). `Err`: the session must not start.
    pub(super) async fn bind_whole(&self, pid: u32) -> Result<(), String> {
        let mut egress = self.proxy();
        egress.hook()(pid).await?;
        let late = {
            let mut s = self.state();
            if s.ended {
                Some(egress)
            } else {
                s.whole = Some(egress);
                s.is_whole = true;
                None
            }
        };
        match late {
            None => Ok(()),
            Some(egress) => {
                egress.finish().await;
                Err("the session ended while its egress proxy started".into())
            }
        }
    }

    /// What an exec starting now gets: its place in the session-long proxy's audit, or a
    /// proxy of its own with what is left of the session's byte budget.
    pub(super) fn exec_start(&self) -> ExecNet {
        let s = self.state();
        if s.is_whole {
            let audit = s.whole.as_ref().and_then(JobEgress::snapshot).map_or_else(
                || (s.total.records.len(), total_attempts(&s.total)),
                |(a, _)| (a.records.len(), attempts(&a)),
            );
            return ExecNet::Whole {
                kept: audit.0,
                attempts: audit.1,
            };
        }
        let left = self
            .node
            .limits()
            .max_total_bytes
            .saturating_sub(s.total.bytes);
        ExecNet::PerCommand(self.proxy().with_byte_budget(left))
    }

    /// A proxy for the session's policy (serving its inference listener when it has one).
    fn proxy(&self) -> JobEgress {
        let e = JobEgress::new(
            Arc::clone(&self.node),
            &self.session_id,
            self.policy.clone(),
        );
        if self.inference {
            e.with_inference_listener()
        } else {
            e
        }
    }

    /// The exec's records and how many more it made beyond the bound.
    pub(super) async fn exec_end(&self, net: ExecNet) -> (Vec<EgressRecord>, u64) {
        match net {
            ExecNet::Whole {
                kept,
                attempts: before,
            } => {
                self.settle().await;
                let s = self.state();
                let now = match s.whole.as_ref().and_then(JobEgress::snapshot) {
                    Some((a, _)) => a,
                    None => EgressAudit {
                        records: s.total.records.clone(),
                        dropped: s.total.dropped,
                    },
                };
                let records: Vec<EgressRecord> =
                    now.records.get(kept..).unwrap_or_default().to_vec();
                let made = attempts(&now).saturating_sub(before);
                let dropped = made.saturating_sub(records.len() as u64);
                (records, dropped)
            }
            ExecNet::PerCommand(egress) => {
                let Some((audit, bytes)) = egress.finish_counted().await else {
                    return (Vec::new(), 0);
                };
                let bound = self.node.limits().max_audit_records;
                let mut s = self.state();
                let t = &mut s.total;
                // (No await below: the guard is held to the end.)
                t.bytes = t.bytes.saturating_add(bytes);
                let room = bound.saturating_sub(t.records.len());
                let keep = audit.records.len().min(room);
                t.records.extend(audit.records[..keep].iter().cloned());
                t.dropped = t
                    .dropped
                    .saturating_add((audit.records.len() - keep) as u64 + audit.dropped);
                (audit.records, audit.dropped)
            }
        }
    }

    /// Waits (at most [`SETTLE_BOUND`]) until the session-long proxy serves no
    /// connection: a command's own connections close with it, and each is audited once
    /// its proxy task has seen the close, which may come just after the command's exit.
    /// One a process left behind keeps open ends the wait at the bound.
    async fn settle(&self) {
        let until = tokio::time::Instant::now() + SETTLE_BOUND;
        loop {
            let open = {
                let s = self.state();
                s.whole.as_ref().and_then(JobEgress::open_connections)
            };
            if open.unwrap_or(0) == 0 || tokio::time::Instant::now() >= until {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    }

    /// The session's egress so far.
    pub(super) fn info(&self) -> SessionEgress {
        let s = self.state();
        match s.whole.as_ref().and_then(JobEgress::snapshot) {
            Some((a, bytes)) => SessionEgress {
                records: a.records,
                dropped: a.dropped,
                bytes,
            },
            None => s.total.clone(),
        }
    }

    /// Ends the session-long proxy (its listener closes, its connections are cut) and
    /// keeps its audit as the session's total; no proxy starts afterwards.
    pub(super) async fn finish(&self) {
        let whole = {
            let mut s = self.state();
            s.ended = true;
            let whole = s.whole.take();
            // What GET shows while the proxy closes.
            if let Some((a, bytes)) = whole.as_ref().and_then(JobEgress::snapshot) {
                s.total = SessionEgress {
                    records: a.records,
                    dropped: a.dropped,
                    bytes,
                };
            }
            whole
        };
        let Some(egress) = whole else { return };
        if let Some((audit, bytes)) = egress.finish_counted().await {
            self.state().total = SessionEgress {
                records: audit.records,
                dropped: audit.dropped,
                bytes,
            };
        }
    }
}

fn total_attempts(t: &SessionEgress) -> u64 {
    t.records.len() as u64 + t.dropped
}
