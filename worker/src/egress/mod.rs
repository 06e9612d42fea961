//! The node-local egress proxy (issue 25): the only way out of a sandbox that may use the
//! network. One proxy per job, served on a listener the node binds inside the sandbox's
//! own network namespace; the sandbox reaches it through `HTTP_PROXY`/`HTTPS_PROXY`.
//!
//! - [`allowlist`]: destination patterns (`host`, `*.suffix`, IP, optional `:port`), the
//!   node's ceiling and a job's narrower list ([`allowlist::Allowlist::narrow`]).
//! - [`addr`]: the addresses never connected to unless listed (loopback, private,
//!   metadata, …).
//! - [`resolve`]: the proxy's own resolver; answers checked, then pinned per connection.
//! - [`http1`]: the strict HTTP/1.1 request heads the proxy accepts.
//! - [`proxy`]: the server: plain HTTP forwarding and CONNECT tunnels, bounded per job.
//! - [`relay`]: moving a connection's bytes between its two sockets (splice(2) through a
//!   pipe), within the job's byte budget and the idle timeout.
//! - [`netns`]: binding the listener inside a sandbox's network namespace.
//! - [`audit`]: one record per attempt, logged, and kept up to a bound for the job.
//! - [`routes`]: credentialed routes; the node adds the secret headers and speaks TLS.
//! - [`job`]: one job's egress: the request checked against the node, the sandbox's
//!   variables, the proxy started inside the sandbox before its command, the audit.

pub mod addr;
pub mod allowlist;
pub mod audit;
pub mod http1;
pub mod netns;
pub mod proxy;
mod relay;
pub mod resolve;
pub mod routes;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

pub use allowlist::{Allowlist, NarrowError, Pattern};
pub use proxy::EgressProxy;
pub use resolve::Resolver;
pub use routes::{RouteConfig, Routes};

/// What one job's proxy lets through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// The destinations the job may ask for (the job's list, or the node's ceiling).
    pub allow: Allowlist,
    /// The special addresses (private, loopback, …) a name may resolve to: those the
    /// operator listed as IP literals in the node's ceiling.
    pub listed_ips: BTreeSet<IpAddr>,
}

impl Policy {
    /// The policy for a job under the node's `ceiling`: `job` (the request's
    /// `sandbox.egress_allow`) narrows it; `None` takes the whole ceiling.
    pub fn for_job<S: AsRef<str>>(
        ceiling: &Allowlist,
        job: Option<&[S]>,
    ) -> Result<Policy, NarrowError> {
        Ok(Policy {
            allow: ceiling.narrow(job)?,
            listed_ips: ceiling.listed_ips(),
        })
    }
}

/// Bounds on one job's proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressLimits {
    /// A request head larger than this is answered 431.
    pub max_header_bytes: usize,
    /// Connections open at once; more are answered 503.
    pub max_connections: usize,
    /// Bytes carried both ways over the job's life; beyond, connections are cut and new
    /// ones answered 429.
    pub max_total_bytes: u64,
    /// A connection with no byte either way for this long is closed (and a request head
    /// must arrive within it).
    pub idle_timeout: Duration,
    /// Bound on the name lookup and on the TCP connect.
    pub connect_timeout: Duration,
    /// Audit records kept for the job; later ones are only counted.
    pub max_audit_records: usize,
}

impl Default for EgressLimits {
    fn default() -> Self {
        EgressLimits {
            max_header_bytes: 32 * 1024,
            max_connections: 64,
            max_total_bytes: 4 * 1024 * 1024 * 1024,
            idle_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(10),
            max_audit_records: 256,
        }
    }
}
