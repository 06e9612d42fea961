//! Lifecycle callbacks: POST `{"status":"in_progress",…}` and `{"status":"completed",…}` to
//! `SBA_JOB_STATUS_URL`, over [`crate::http`] (TCP or a Unix socket), with
//! a bounded time. Callbacks are best effort: a failure is logged, never fails the job.

use std::time::{Duration, Instant};

pub use crate::http::{parse_url, Target};

/// Bound on connecting, sending and reading the answer.
pub const CALLBACK_TIMEOUT: Duration = Duration::from_secs(5);

/// POSTs `body` as JSON; returns the HTTP status code.
pub fn post(target: &Target, body: &[u8]) -> std::io::Result<u16> {
    let lim = crate::http::Limits {
        deadline: Instant::now() + CALLBACK_TIMEOUT,
        max_body: 64 * 1024,
        cancel: None,
    };
    crate::http::send(target, "POST", Some(body), &lim)
        .map(|r| r.status)
        .map_err(std::io::Error::other)
}
