//! The egress audit: one [`EgressRecord`] per attempt a sandbox made through the node's
//! egress proxy, allowed or denied, kept in a bounded [`EgressAudit`] per job.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Whether the proxy let an attempt through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EgressDecision {
    Allowed,
    Denied,
}

/// One attempt: the destination as the sandbox asked for it, the method (`CONNECT` for a
/// tunnel), the decision and its reason, and the bytes carried each way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EgressRecord {
    /// The host as requested, lower-cased; empty when the request could not be parsed.
    pub host: String,
    pub port: u16,
    pub method: String,
    pub decision: EgressDecision,
    /// Why it was denied, or how an allowed attempt ended (`ok`, `idle timeout`, …).
    pub reason: String,
    /// Bytes from the sandbox to the destination (request bodies, tunnel bytes).
    pub bytes_up: u64,
    /// Bytes from the destination to the sandbox.
    pub bytes_down: u64,
}

/// A job's audit: the first records up to the node's bound, and how many were left out.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EgressAudit {
    pub records: Vec<EgressRecord>,
    /// Attempts beyond the bound, counted but not kept.
    #[serde(default)]
    pub dropped: u64,
}
