//! What one listener allows a connection: how many connections it holds, how long a
//! request head and an idle connection may take, how large a head may be, and how long a
//! TLS handshake may last. Every server of the workspace (the Worker API, the PM's
//! `serve`, the per-job sockets) is bounded by these.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Bounds on one listener's connections (see [`crate::serve_with`]).
///
/// When `max_connections` are open, a new connection displaces the one that has waited
/// longest without a request in flight (a slow or idle client); when every connection has
/// a request in flight, the new one is answered 503 (plain HTTP) or closed (TLS) at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ListenerLimits {
    /// Connections held at once.
    pub max_connections: usize,
    /// A request head (request line and headers) must arrive within this time, counted
    /// from when the connection starts waiting for it.
    pub header_read_timeout_seconds: u64,
    /// A connection with no request in flight for this long is closed (keep-alive idle,
    /// and a client that connects and sends nothing).
    pub idle_timeout_seconds: u64,
    /// Largest request head (HTTP/1 read buffer, HTTP/2 header list); larger: 431.
    pub max_header_bytes: usize,
    /// A TLS handshake must finish within this time.
    pub tls_handshake_timeout_seconds: u64,
}

/// hyper's smallest HTTP/1 read buffer.
const MIN_HEADER_BYTES: usize = 8192;

impl Default for ListenerLimits {
    fn default() -> Self {
        ListenerLimits {
            max_connections: 512,
            header_read_timeout_seconds: 10,
            idle_timeout_seconds: 60,
            max_header_bytes: 64 * 1024,
            tls_handshake_timeout_seconds: 10,
        }
    }
}

impl ListenerLimits {
    /// These limits with `max_connections` replaced.
    pub fn with_max_connections(&self, max_connections: usize) -> ListenerLimits {
        ListenerLimits {
            max_connections,
            ..self.clone()
        }
    }

    pub(crate) fn connections(&self) -> usize {
        self.max_connections.max(1)
    }

    pub(crate) fn header_read_timeout(&self) -> Duration {
        Duration::from_secs(self.header_read_timeout_seconds.max(1))
    }

    pub(crate) fn idle_timeout(&self) -> Duration {
        Duration::from_secs(self.idle_timeout_seconds.max(1))
    }

    pub(crate) fn header_bytes(&self) -> usize {
        self.max_header_bytes.max(MIN_HEADER_BYTES)
    }

    pub(crate) fn tls_handshake_timeout(&self) -> Duration {
        Duration::from_secs(self.tls_handshake_timeout_seconds.max(1))
    }
}
