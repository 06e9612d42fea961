//! A Podman container started in two halves ([`super::super::netns_gate`]): `create` (the
//! same options as `run`), `init` (the runtime has made the container's namespaces; its
//! command waits on the runtime's exec fifo), `inspect` for the pid of its init process,
//! the hook (the egress proxy binds its listener in that network namespace), then
//! `start --attach`, whose output and exit code are the job's. Whatever fails on the way,
//! the container is removed; it never runs its command without the hook having run.
//!
//! Used for a gated job on Podman when no pooled container is idle. Docker has no `init`:
//! its gated jobs run in a pooled container ([`super::pool`]), whose waiter holds the job
//! until the hook has run. gVisor serves a network of its own inside its sandbox (a
//! listener in the container's host-side namespace is not seen there): it cannot gate.

use std::time::Instant;

use tokio_util::sync::CancellationToken;

use super::super::netns_gate::NetnsHook;
use super::{engine_refused, last_line, spawn_client, EngineBackend, CLI_BOUND};
use crate::backend::{SandboxOutcome, SandboxSpec};

impl EngineBackend {
    /// Runs the container to the end, `hook` called between its creation and its start
    /// (Podman with runc or crun: [`super::can_gate`]).
    pub(super) async fn run_in_halves(
        &self,
        spec: &SandboxSpec,
        cancel: &CancellationToken,
        hook: NetnsHook,
    ) -> SandboxOutcome {
        let started = Instant::now();
        let prepared = tokio::select! {
            r = self.create_and_init(spec, hook) => r,
            _ = cancel.cancelled() => Err("canceled".into()),
            _ = tokio::time::sleep(spec.timeout) => Err("timed out before it started".into()),
        };
        if let Err(e) = prepared {
            self.force_remove(&spec.name).await;
            return SandboxOutcome::start_failed(e, started);
        }
        let mut cmd = self.command();
        cmd.args(["start", "--attach", "--"]).arg(&spec.name);
        let (mut child, out, err) = match spawn_client(cmd, &self.cfg.binary, spec.output_cap) {
            Ok(spawned) => spawned,
            Err(e) => {
                self.force_remove(&spec.name).await;
                return SandboxOutcome::start_failed(e, started);
            }
        };
        let left = spec.timeout.saturating_sub(started.elapsed());
        let (status, end) = crate::backend::wait_or_stop(&mut child, left, cancel).await;
        let status = match status {
            Some(s) => Some(s),
            None => self.stop_and_remove(&spec.name, &mut child).await,
        };
        self.force_remove(&spec.name).await;
        let exit_code = status.and_then(|s| s.code());
        let outcome = SandboxOutcome::collected(exit_code, out, err, end, started).await;
        engine_refused(outcome, &self.cfg.binary, "start the container")
    }

    /// `create`, `init`, `inspect`, then the hook; `Err` says which step failed.
    async fn create_and_init(&self, spec: &SandboxSpec, hook: NetnsHook) -> Result<(), String> {
        self.ensure_profile().map_err(|e| e.to_string())?;
        let mut create = self.run_args(spec);
        if let Some(first) = create.first_mut() {
            *first = "create".into();
        }
        let create: Vec<&str> = create.iter().map(String::as_str).collect();
        self.step(&create, "create the container").await?;
        self.step(&["init", "--", &spec.name], "initialise the container")
            .await?;
        let out = self
            .step(
                &["inspect", "--format", "{{.State.Pid}}", "--", &spec.name],
                "inspect the container",
            )
            .await?;
        let pid: u32 = String::from_utf8_lossy(&out)
            .trim()
            .parse()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("{} inspect gave no pid for the container", self.cfg.binary))?;
        hook(pid).await
    }

    /// One client call, bounded by [`CLI_BOUND`]; its stdout, or why it failed.
    async fn step(&self, args: &[&str], what: &str) -> Result<Vec<u8>, String> {
        let binary = &self.cfg.binary;
        let out = tokio::time::timeout(CLI_BOUND, self.command().args(args).output())
            .await
            .map_err(|_| format!("{binary} could not {what} within {} s", CLI_BOUND.as_secs()))?
            .map_err(|e| format!("{binary} not runnable: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "{binary} could not {what}: {}",
                last_line(&out.stderr)
            ));
        }
        Ok(out.stdout)
    }
}
