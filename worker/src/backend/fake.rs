//! The fake backend, for the worker's own unit tests only: an in-process [`SandboxBackend`]
//! that starts no process at all, so the node's logic (queueing, records, retention,
//! timeouts, cancellation, sessions) is tested without a sandbox. It is registered as
//! every backend is: its [`DESCRIPTOR`], one line in [`super::BACKENDS`] and its
//! [`BackendKind`] variant, all under `cfg(test)`, so no built node can be configured
//! with it.
//!
//! A sandbox's command is read as a tiny language, one program per run:
//! - `true`, `false`, `exit N`: exit 0, 1 or N;
//! - `echo WORDS…`: the words on stdout, cut at the spec's output cap;
//! - `sleep SECONDS`: waits, within the spec's timeout and its cancellation;
//! - `write NAME TEXT`: writes TEXT to NAME in the directory mounted at `/workspace`
//!   (NAME one plain component);
//! - anything else exits 127 with the reason on stderr; an empty command fails to start.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::{
    BackendError, EndReason, IsolatedError, IsolatedOutput, IsolatedRun, PerCommand,
    SandboxBackend, SandboxOutcome, SandboxSpec, SessionSandbox,
};
use crate::config::BackendKind;
use cynode_protocol::worker_api::Truncated;

/// The fake's entry in the backend registry: it cannot gate (it has no network namespace
/// to bind in) and has nothing to undo at a stop.
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    kind: BackendKind::Fake,
    build: |_| Arc::new(FakeBackend::default()),
    can_gate: |_| false,
    describe: super::kind_name,
    shutdown: |_| {},
};

/// The in-process backend; `runs` counts the sandboxes it ran.
#[derive(Debug, Default)]
pub struct FakeBackend {
    pub runs: AtomicUsize,
}

/// An image the fake has not got: every name that starts with this.
pub const MISSING_IMAGE: &str = "missing/";

fn outcome(code: i32, stdout: String, stderr: String, started: Instant) -> SandboxOutcome {
    SandboxOutcome {
        exit_code: Some(code),
        stdout,
        stderr,
        truncated: Truncated::default(),
        end: EndReason::Exited,
        duration: started.elapsed(),
    }
}

/// Writes `text` to `name` in the directory `spec` mounts at `/workspace`.
fn write(spec: &SandboxSpec, name: &str, text: &str) -> Result<(), String> {
    let plain = !name.is_empty() && name != "." && name != ".." && !name.contains('/');
    if !plain {
        return Err(format!("not one plain name: {name:?}"));
    }
    let ws = spec
        .mounts
        .iter()
        .find(|m| m.target == crate::sandbox::WORKSPACE_MOUNT)
        .ok_or("no workspace is mounted")?;
    std::fs::write(ws.host.join(name), text).map_err(|e| e.to_string())
}

#[async_trait::async_trait]
impl SandboxBackend for FakeBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Fake
    }

    async fn check(&self) -> Result<String, BackendError> {
        Ok("fake (in-process, tests only)".into())
    }

    async fn has_image(&self, image: &str) -> bool {
        !image.starts_with(MISSING_IMAGE)
    }

    async fn run(&self, spec: &SandboxSpec, cancel: &CancellationToken) -> SandboxOutcome {
        let started = Instant::now();
        self.runs.fetch_add(1, Ordering::SeqCst);
        let Some((program, args)) = spec.command.split_first() else {
            return SandboxOutcome::start_failed("the fake runs no empty command".into(), started);
        };
        match (program.as_str(), args) {
            ("true", []) => outcome(0, String::new(), String::new(), started),
            ("false", []) => outcome(1, String::new(), String::new(), started),
            ("exit", [n]) => match n.parse() {
                Ok(n) => outcome(n, String::new(), String::new(), started),
                Err(_) => outcome(2, String::new(), format!("exit: {n:?}\n"), started),
            },
            ("echo", words) => {
                let mut text = words.join(" ") + "\n";
                let cut = text.len() > spec.output_cap;
                text.truncate(spec.output_cap);
                let mut o = outcome(0, text, String::new(), started);
                o.truncated.stdout = cut;
                o
            }
            ("sleep", [secs]) => {
                let Ok(secs) = secs.parse::<f64>() else {
                    return outcome(2, String::new(), format!("sleep: {secs:?}\n"), started);
                };
                let end = tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs_f64(secs)) => None,
                    _ = tokio::time::sleep(spec.timeout) => Some(EndReason::TimedOut),
                    _ = cancel.cancelled() => Some(EndReason::Canceled),
                };
                let mut o = outcome(0, String::new(), String::new(), started);
                if let Some(end) = end {
                    o.exit_code = None;
                    o.end = end;
                }
                o
            }
            ("write", [name, text]) => match write(spec, name, text) {
                Ok(()) => outcome(0, String::new(), String::new(), started),
                Err(e) => outcome(1, String::new(), format!("write: {e}\n"), started),
            },
            _ => outcome(
                127,
                String::new(),
                format!("fake: no such program: {:?}\n", spec.command),
                started,
            ),
        }
    }

    async fn remove_all_managed(&self) -> usize {
        0
    }

    async fn remove_named(&self, _name: &str) {}

    /// Each session command is a run of its own over the session's workspace.
    async fn start_session(
        &self,
        _spec: &SandboxSpec,
    ) -> Result<Arc<dyn SessionSandbox>, BackendError> {
        Ok(Arc::new(PerCommand(FakeBackend::default())))
    }

    async fn run_isolated(&self, _run: IsolatedRun) -> Result<IsolatedOutput, IsolatedError> {
        Err(IsolatedError::Sandbox(
            "the fake backend runs no host tool".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(command: &[&str]) -> SandboxSpec {
        let mut s = crate::backend::engine::pool::template(
            crate::backend::ResourceLimits::from_limits(&crate::config::Limits::default()),
        );
        s.command = command.iter().map(|c| c.to_string()).collect();
        s.timeout = Duration::from_secs(10);
        s
    }

    #[tokio::test]
    async fn the_fake_runs_its_language_within_the_timeout_and_the_cap() {
        let b = FakeBackend::default();
        let none = CancellationToken::new();
        assert_eq!(b.run(&spec(&["exit", "7"]), &none).await.exit_code, Some(7));
        let mut s = spec(&["echo", "abc", "def"]);
        s.output_cap = 4;
        let o = b.run(&s, &none).await;
        assert_eq!((o.stdout.as_str(), o.truncated.stdout), ("abc ", true));
        let mut s = spec(&["sleep", "30"]);
        s.timeout = Duration::from_millis(50);
        assert_eq!(b.run(&s, &none).await.end, EndReason::TimedOut);
        assert_eq!(b.run(&spec(&["ls"]), &none).await.exit_code, Some(127));
        assert!(matches!(
            b.run(&spec(&[]), &none).await.end,
            EndReason::StartFailed(_)
        ));
        assert_eq!(b.runs.load(Ordering::SeqCst), 5);
    }
}
