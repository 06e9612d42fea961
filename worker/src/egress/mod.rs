//! The node-local egress proxy: the only way out of a sandbox that may use the
//! network. One proxy per job, served on a listener the node binds inside the sandbox's
//! own network namespace; the sandbox reaches it through `HTTP_PROXY`/`HTTPS_PROXY`.
//!
//! The rules themselves (allowlists, addresses, the resolver, routes, [`Policy`]) are the
//! `cynode-egress` crate, shared with the PM's gateway, and re-exported here under their
//! old paths:
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
//! - [`routes`]: credentialed routes; the node adds the secret headers and speaks TLS
//!   (the proxy serves them under [`routes::ROUTES_PREFIX`]).
//! - [`job`]: one job's egress: the request checked against the node, the sandbox's
//!   variables, the proxy started inside the sandbox before its command, the audit.

pub mod audit;
pub mod http1;
pub mod netns;
pub mod proxy;
mod relay;

use std::time::Duration;

pub use cynode_egress::{addr, allowlist, resolve, routes};
pub use cynode_egress::{Allowlist, NarrowError, Pattern, Policy, Resolver, RouteConfig, Routes};
pub use proxy::{EgressProxy, SandboxLoopback};

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
