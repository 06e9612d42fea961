//! The egress audit of one job: every attempt is logged as a structured `tracing` event
//! (target `cynode_worker::egress`), and the first `max_records` are kept for the job's
//! response; later ones are only counted, so a job that floods the proxy cannot grow the
//! node's memory or its result.

use std::sync::Mutex;

use cynode_protocol::egress::{EgressAudit, EgressDecision, EgressRecord};

/// A job's bounded audit.
#[derive(Debug)]
pub struct AuditLog {
    job_id: String,
    max_records: usize,
    state: Mutex<EgressAudit>,
}

impl AuditLog {
    pub fn new(job_id: impl Into<String>, max_records: usize) -> AuditLog {
        AuditLog {
            job_id: job_id.into(),
            max_records,
            state: Mutex::new(EgressAudit::default()),
        }
    }

    /// Logs `record` and keeps it if the bound allows.
    pub fn record(&self, record: EgressRecord) {
        let decision = match record.decision {
            EgressDecision::Allowed => "allowed",
            EgressDecision::Denied => "denied",
        };
        tracing::info!(
            target: "cynode_worker::egress",
            job_id = %self.job_id,
            host = %record.host,
            port = record.port,
            method = %record.method,
            decision,
            reason = %record.reason,
            bytes_up = record.bytes_up,
            bytes_down = record.bytes_down,
            "egress attempt"
        );
        let mut state = match self.state.lock() {
            Ok(s) => s,
            Err(poisoned) => poisoned.into_inner(),
        };
        if state.records.len() < self.max_records {
            state.records.push(record);
        } else {
            state.dropped = state.dropped.saturating_add(1);
        }
    }

    /// What has been recorded so far.
    pub fn snapshot(&self) -> EgressAudit {
        match self.state.lock() {
            Ok(s) => s.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(n: u16) -> EgressRecord {
        EgressRecord {
            host: "a.com".into(),
            port: n,
            method: "GET".into(),
            decision: EgressDecision::Denied,
            reason: "not in the egress allowlist".into(),
            bytes_up: 0,
            bytes_down: 0,
        }
    }

    #[test]
    fn keeps_the_first_records_and_counts_the_rest() {
        let log = AuditLog::new("j1", 3);
        for n in 0..10 {
            log.record(rec(n));
        }
        let a = log.snapshot();
        assert_eq!(
            a.records.iter().map(|r| r.port).collect::<Vec<_>>(),
            [0, 1, 2]
        );
        assert_eq!(a.dropped, 7);
        let json = serde_json::to_value(&a.records[0]).unwrap();
        assert_eq!(json["decision"], "denied");
    }
}
