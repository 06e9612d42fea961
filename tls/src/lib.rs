//! TLS for every hop that can cross machines, with rustls (ring provider) throughout.
//!
//! - [`ServerTls`]: a certificate and key, and optionally a client CA that makes client
//!   certificates (mutual TLS) required; [`serve`] serves an axum app over it and reloads
//!   the files when they change or on SIGHUP, without dropping the listener.
//! - [`ListenerLimits`]: the bounds of every listener of the workspace (connections, head
//!   and idle timeouts, head size, TLS handshake time), enforced by the one accept loop
//!   behind [`serve_with`] (TCP, with or without TLS) and [`serve_unix`] (the per-job
//!   sockets).
//! - [`ClientTls`]: extra trusted roots (beside the system's, which honour `SSL_CERT_FILE`
//!   and `SSL_CERT_DIR`) and an optional client identity, applied to a reqwest builder.

mod accept;
mod client;
mod limits;
mod server;
mod slots;
mod unread_body;

pub use client::ClientTls;
pub use limits::ListenerLimits;
pub use server::{serve, serve_unix, serve_with, server_config, ServerTls};

/// A TLS set-up problem, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Pem { path: String, message: String },
    #[error("tls configuration: {0}")]
    Config(String),
    #[error("server: {0}")]
    Serve(std::io::Error),
}

/// Crate-local result alias.
pub type Result<T, E = TlsError> = std::result::Result<T, E>;

/// Installs ring as the process's rustls provider (idempotent). Every binary calls it at
/// start; the helpers here call it too.
pub fn install_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn read(path: &std::path::Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.display().to_string(),
        source,
    })
}
