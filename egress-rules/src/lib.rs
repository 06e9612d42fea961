//! The egress rules, one copy for every place that lets a sandbox's request out:
//! the worker's per-job proxy and the PM's MCP gateway (`web.fetch`, `api.call`). Pure
//! policy only; the servers that apply it live in their crates.
//!
//! - [`allowlist`]: destination patterns (`host`, `*.suffix`, IP, optional `:port`; 80 and
//!   443 when none), a ceiling and a narrower list ([`allowlist::Allowlist::narrow`]).
//! - [`addr`]: the addresses never connected to unless listed (loopback, private,
//!   metadata, …).
//! - [`resolve`]: the resolver; answers checked, then pinned per connection by the caller
//!   connecting only to the returned addresses.
//! - [`routes`]: credentialed routes; the configured headers, with values read from the
//!   environment once, are added to requests sent to an `https://` upstream.
//! - [`redact`]: a route's secrets replaced by `<redacted>` in what its upstream answers,
//!   a body streamed in pieces included.
//! - [`Policy`]: one job's allowlist with the special addresses the operator listed.

pub mod addr;
pub mod allowlist;
pub mod redact;
pub mod resolve;
pub mod routes;

use std::collections::BTreeSet;
use std::net::IpAddr;

pub use allowlist::{Allowlist, NarrowError, Pattern};
pub use redact::Redactor;
pub use resolve::Resolver;
pub use routes::{RouteConfig, Routes};

/// What one job may reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// The destinations the job may ask for (the job's list, or the ceiling).
    pub allow: Allowlist,
    /// The special addresses (private, loopback, …) a name may resolve to: those the
    /// operator listed as IP literals in the ceiling.
    pub listed_ips: BTreeSet<IpAddr>,
}

impl Policy {
    /// The policy for a job under `ceiling`: `job` (e.g. the request's
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
