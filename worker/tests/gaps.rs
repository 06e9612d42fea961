//! Known engine gaps: cases of the shared suites that do not hold on one backend, each with
//! the reason (reported for docs/THREAT_MODEL.md). Such a case is not skipped: its test
//! runs it and passes only while it still fails; once it holds, the test fails and says
//! to remove the entry here.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

/// (backend, module, case, why it does not hold there).
const GAPS: &[(&str, &str, &str, &str)] = &[
    (
        "runsc",
        "sandbox_escapes",
        "escape_runner_cannot_be_traced",
        "gVisor's /proc lets a step of the same uid read the non-dumpable runner's /proc/<pid>/environ",
    ),
    (
        "runsc",
        "host_reads",
        "fifo_result_does_not_hang_the_node",
        "gVisor does not create a FIFO on the host's /job (host-fifo=none): the job ends without result.json",
    ),
    (
        "runsc",
        "host_writes",
        "a_deep_tree_is_removed_by_ack_and_by_the_retention_sweep",
        "gVisor refuses the very deep mkdir the case needs to plant its tree",
    ),
    (
        "microvm",
        "cases",
        "in_progress_is_reported_from_the_sandbox",
        "the SBA's lifecycle status.sock does not cross the VM boundary (connection refused in the guest)",
    ),
];

/// The documented gap of `case` on `backend`, if any.
pub fn known(backend: &str, module: &str, case: &str) -> Option<&'static str> {
    GAPS.iter()
        .find(|(b, m, c, _)| *b == backend && *m == module && *c == case)
        .map(|(_, _, _, why)| *why)
}

/// Runs `case`, which is known not to hold (`gap` says why): passes when it fails (panics),
/// fails when it passes, so a fixed gap is noticed and its entry removed.
pub async fn still_fails(gap: &str, case: impl Future<Output = ()>) {
    eprintln!("known gap, expected to fail: {gap}");
    let failed = CatchUnwind(Box::pin(case)).await.is_err();
    assert!(
        failed,
        "this case now holds: remove its entry from worker/tests/gaps.rs ({gap})"
    );
}

/// A future that turns a panic of the inner one into `Err`.
struct CatchUnwind<F>(Pin<Box<F>>);

impl<F: Future<Output = ()>> Future for CatchUnwind<F> {
    type Output = Result<(), ()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.0.as_mut();
        match std::panic::catch_unwind(AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(())) => Poll::Ready(Ok(())),
            Err(_) => Poll::Ready(Err(())),
        }
    }
}
