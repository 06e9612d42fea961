//! Step errors: every failure a step can have, tied to its stable failure code.

use std::io;

use cynode_protocol::FailureCode;

/// Why a step (or the job) failed. The code goes to `failure_code` and `error.type`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct StepError {
    pub code: FailureCode,
    pub message: String,
}

/// Crate-wide result alias.
pub type Result<T, E = StepError> = std::result::Result<T, E>;

impl StepError {
    /// An error with an explicit code.
    pub fn new(code: FailureCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// The one message every confinement refusal carries.
    pub fn escape(path: &str, why: &str) -> Self {
        Self::new(
            FailureCode::PolicyViolation,
            format!("path escapes workspace: {path} ({why})"),
        )
    }

    /// An allowlist or overwrite refusal.
    pub fn policy(message: impl Into<String>) -> Self {
        Self::new(FailureCode::PolicyViolation, message)
    }

    /// A step that ran and failed.
    pub fn failed(message: impl Into<String>) -> Self {
        Self::new(FailureCode::StepFailed, message)
    }

    /// A failure of the runner itself.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(FailureCode::InternalError, message)
    }

    /// An I/O error on `path` during `what`, as a step failure with the OS reason.
    pub fn io(what: &str, path: &str, err: &io::Error) -> Self {
        Self::failed(format!("{what} {path}: {}", describe_io(err)))
    }
}

/// Lowercase OS error text without the "(os error N)" suffix.
pub fn describe_io(err: &io::Error) -> String {
    let text = err.to_string();
    let text = match text.find(" (os error") {
        Some(i) => text[..i].to_string(),
        None => text,
    };
    let mut chars = text.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_read_naturally() {
        let e = io::Error::from_raw_os_error(libc::ENOENT);
        assert_eq!(
            StepError::io("read_file", "a.txt", &e),
            StepError::failed("read_file a.txt: no such file or directory")
        );
    }
}
