//! Why a session call was refused or failed; the HTTP layer maps each to a status.

use cynode_protocol::ValidationError;

/// Why a session call was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The request is invalid (400).
    #[error("{0}")]
    Invalid(#[from] ValidationError),
    /// [`super::MAX_ACTIVE_SESSIONS`] are starting or running (503).
    #[error("the node is at capacity")]
    TooMany,
    #[error("{0}")]
    NotFound(String),
    /// The session is starting, ended, busy, or exists with another request (409).
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Internal(String),
}

impl SessionError {
    pub(super) fn poisoned() -> Self {
        SessionError::Internal("session table lock poisoned".into())
    }
}
