//! What the PM's two front ends share, below both: the HTTP API (`crate::service`) and
//! the MCP tools and gateway (`crate::mcp`) import from here and never from each other.
//!
//! - [`AppState`]: what every handler and tool holds;
//! - [`auth`]: bearer tokens mapped to tenants;
//! - [`problem`]: RFC 9457 errors, the one error shape of both front ends;
//! - [`ops`]: the tenant-checked operations behind the handlers and the tools, so both
//!   keep one tenant check and one policy;
//! - [`sandboxes`]: the tenant-checked sandbox operations (a worker's sessions under the
//!   tenant's policy);
//! - [`scheduler`]: leases and drives the sessions of this replica (`serve`, and
//!   `cynode-pm mcp` on stdio).

pub mod auth;
pub mod ops;
pub mod problem;
pub mod sandboxes;
pub mod scheduler;

use std::sync::Arc;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::driver::Pm;
use auth::Tokens;

/// What every handler shares.
pub struct AppState {
    pub pm: Arc<Pm>,
    pub tokens: Tokens,
    /// Wakes this replica's scheduler when a session became runnable here.
    pub wake: Arc<Notify>,
    /// Cancelled when the replica shuts down: event streams end (clients resume on
    /// another replica with `Last-Event-ID`) and the scheduler hands sessions back.
    pub stop: CancellationToken,
}
