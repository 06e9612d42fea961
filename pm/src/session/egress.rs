//! What a session's jobs reached, or tried to reach, through their worker's egress proxy,
//! read back from the `job_egress` history events the driver stores with each job's
//! result ([`of`]), and shown bounded for a person ([`text`]).
//!
//! The records come from the worker, and their host and reason from what a hostile
//! sandbox asked for: the text form escapes control characters and bounds each field, so
//! a record cannot move a terminal's cursor or flood the screen.

use cynode_protocol::egress::{EgressDecision, EgressRecord};
use serde::{Deserialize, Serialize};

use super::SessionRecord;

/// Records shown per job by [`text`] before "… N more".
pub const SHOWN_PER_JOB: usize = 20;

/// Longest host or reason [`text`] shows, in characters.
const FIELD_CHARS: usize = 120;

/// One job's egress audit as stored: the records the worker kept, and how many attempts
/// beyond its bound it only counted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobEgress {
    pub job_id: String,
    pub records: Vec<EgressRecord>,
    #[serde(default)]
    pub dropped: u64,
}

impl JobEgress {
    /// Attempts the proxy let through, among the kept records.
    pub fn allowed(&self) -> usize {
        self.records
            .iter()
            .filter(|r| r.decision == EgressDecision::Allowed)
            .count()
    }
}

/// Every `job_egress` event of `rec`'s history, in order (an event that does not parse is
/// skipped: the history is the record, this is only its view).
pub fn of(rec: &SessionRecord) -> Vec<JobEgress> {
    rec.state
        .history
        .iter()
        .filter(|e| e.kind == "job_egress")
        .filter_map(|e| serde_json::from_value(e.data.clone()).ok())
        .collect()
}

/// The human form: per job, a count line, then its first `limit` records (`decision
/// METHOD host:port  reason  up N B, down N B`), then "… N more" for the rest kept and
/// those the worker only counted. Empty when no job used the proxy.
pub fn text(jobs: &[JobEgress], limit: usize) -> String {
    let mut out = String::new();
    for j in jobs {
        let total = j.records.len() as u64 + j.dropped;
        let allowed = j.allowed();
        out.push_str(&format!(
            "egress of job {}: {total} attempt{} ({allowed} allowed, {} denied{})\n",
            clean(&j.job_id),
            if total == 1 { "" } else { "s" },
            j.records.len() - allowed,
            if j.dropped > 0 {
                format!(", {} beyond the worker's audit bound", j.dropped)
            } else {
                String::new()
            }
        ));
        for r in j.records.iter().take(limit) {
            let decision = match r.decision {
                EgressDecision::Allowed => "allowed",
                EgressDecision::Denied => "denied",
            };
            out.push_str(&format!(
                "  {decision:<7} {} {}  {}  up {} B, down {} B\n",
                clean(&r.method),
                authority(r),
                clean(&r.reason),
                r.bytes_up,
                r.bytes_down
            ));
        }
        let more = j.records.len().saturating_sub(limit) as u64 + j.dropped;
        if more > 0 {
            out.push_str(&format!(
                "  … {more} more (--output json lists every kept record)\n"
            ));
        }
    }
    out
}

/// `host:port`, `[v6]:port` for an IPv6 address, `?` for an unparsed host.
fn authority(r: &EgressRecord) -> String {
    let host = if r.host.is_empty() {
        "?".to_string()
    } else if r.host.contains(':') && !r.host.starts_with('[') {
        format!("[{}]", clean(&r.host))
    } else {
        clean(&r.host)
    };
    format!("{host}:{}", r.port)
}

/// `s` on one line: control characters escaped, at most [`FIELD_CHARS`] characters.
fn clean(s: &str) -> String {
    let mut out = String::new();
    for (n, c) in s.chars().enumerate() {
        if n == FIELD_CHARS {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(host: &str, decision: EgressDecision, reason: &str) -> EgressRecord {
        EgressRecord {
            host: host.into(),
            port: 443,
            method: "CONNECT".into(),
            decision,
            reason: reason.into(),
            bytes_up: 10,
            bytes_down: 20,
        }
    }

    #[test]
    fn control_characters_and_long_fields_are_defused() {
        let j = JobEgress {
            job_id: "j1".into(),
            records: vec![rec(
                "a.example",
                EgressDecision::Denied,
                &format!("\x1b[2Jbad\n{}", "x".repeat(500)),
            )],
            dropped: 0,
        };
        let t = text(&[j], SHOWN_PER_JOB);
        assert!(!t.contains('\x1b'), "{t:?}");
        assert!(t.contains("\\u{1b}[2Jbad\\nxxx"), "{t:?}");
        assert_eq!(t.lines().count(), 2, "{t:?}");
        assert!(t.lines().nth(1).unwrap().chars().count() < 200, "{t:?}");
    }

    #[test]
    fn ipv6_and_unparsed_hosts_read_as_authorities() {
        let mut r = rec("::1", EgressDecision::Denied, "not listed");
        assert_eq!(authority(&r), "[::1]:443");
        r.host = String::new();
        assert_eq!(authority(&r), "?:443");
        r.host = "[::1]".into();
        assert_eq!(authority(&r), "[::1]:443");
    }
}
