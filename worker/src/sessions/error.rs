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
    /// No such session (ended ones are remembered for the node's retention).
    #[error("session {session_id} not found")]
    NotFound { session_id: String },
    /// No such file in the session's workspace, or no such exec in the session (404).
    #[error("{path} not found")]
    FileNotFound { path: String },
    /// No such snapshot, or not the task's (404).
    #[error("snapshot {snapshot_id} not found")]
    SnapshotNotFound { snapshot_id: String },
    /// The session is starting, ended, busy, or exists with another request (409).
    #[error("{0}")]
    Conflict(String),
    /// No host uid for the session's workspace (503 when `sandbox_uids` is exhausted).
    #[error(transparent)]
    Uid(#[from] crate::uid_pool::UidError),
    /// A body over the node's bound of this many bytes (413; nothing of it kept).
    #[error("request body over the {0} byte limit")]
    TooLarge(usize),
    /// The session table or its sandbox failed.
    #[error("{0}")]
    Internal(String),
}

impl SessionError {
    pub(super) fn poisoned() -> Self {
        SessionError::Internal("session table lock poisoned".into())
    }
}
