//! Sandbox backends behind one interface: Podman and Docker (same CLI flags) and
//! bubblewrap. The worker decides nothing about what a job does; a backend only starts an
//! isolated process tree with the limits it is given, captures its output with caps, and
//! guarantees it is gone afterwards.

use std::time::Duration;

use cynode_protocol::worker_api::Truncated;
use tokio_util::sync::CancellationToken;

use crate::config::{BackendKind, Config};

pub mod bwrap;
pub mod capture;
pub mod engine;
pub mod microvm;
pub mod netns_gate;
pub mod seccomp;
pub mod session_ops;

/// Label every sandbox of a node carries, valued with the node's id, so that node's
/// orphans (and only its own) can be found and removed.
pub const MANAGED_LABEL: &str = "io.cynode.node";

/// A node's id: derived from its state directory, so several nodes can share a host and a
/// restarted node finds what it left.
pub fn node_id(cfg: &Config) -> String {
    use sha2::Digest;
    let dir = std::fs::canonicalize(&cfg.state_dir).unwrap_or_else(|_| cfg.state_dir.clone());
    let digest = sha2::Sha256::digest(dir.display().to_string().as_bytes());
    hex::encode(digest)[..12].to_string()
}

pub use crate::sandbox::{Mount, ResourceLimits, SandboxSpec};

/// Why a backend cannot serve, or could not start a session sandbox. The text names the
/// client binary and what it said.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// The client binary cannot be run, or did not answer within its bound.
    #[error("{0}")]
    Client(String),
    /// The client ran and refused.
    #[error("{0}")]
    Refused(String),
    /// A host prerequisite is missing: cgroups, the init binary, the seccomp filter or
    /// its profile file.
    #[error("{0}")]
    Unavailable(String),
}

/// Why the sandbox ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndReason {
    Exited,
    TimedOut,
    Canceled,
    /// The sandbox could not be started at all.
    StartFailed(String),
}

/// How a sandbox run ended.
#[derive(Debug, Clone)]
pub struct SandboxOutcome {
    pub exit_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub truncated: Truncated,
    pub end: EndReason,
    pub duration: Duration,
}

/// Arranges for the calling (forked, not yet exec'd) process to get SIGKILL when the node
/// dies, so no sandbox client outlives a node killed with SIGKILL. Must run after any
/// credential change, which clears it.
pub fn die_with_node() -> std::io::Result<()> {
    // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Variables a sandbox client (bwrap, podman, docker) may inherit from the node: what the
/// client itself needs to find its binaries, its configuration and its runtime directory.
/// Nothing else of the node's environment (its bearer token, API keys) reaches a client,
/// and so none reaches a sandbox, not even as bwrap's own `/proc/1/environ`.
const CLIENT_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "XDG_RUNTIME_DIR",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "TMPDIR",
    "CONTAINERS_CONF",
    "CONTAINERS_STORAGE_CONF",
    "CONTAINERS_REGISTRIES_CONF",
    "CONTAINER_HOST",
    "CONTAINER_CONNECTION",
    "DOCKER_HOST",
    "DOCKER_CONFIG",
    "DOCKER_CONTEXT",
];

/// Clears `cmd`'s environment down to [`CLIENT_ENV`].
pub fn client_env(cmd: &mut tokio::process::Command) -> &mut tokio::process::Command {
    cmd.env_clear();
    for k in CLIENT_ENV {
        if let Some(v) = std::env::var_os(k) {
            cmd.env(k, v);
        }
    }
    if std::env::var_os("PATH").is_none() {
        cmd.env("PATH", crate::sandbox::DEFAULT_PATH);
    }
    cmd
}

/// Removes the named sandbox if it exists (reconciliation of one job).
pub async fn remove_named(backend: &Backend, name: &str) {
    if let Backend::Engine(e) = backend {
        e.force_remove(name).await;
    }
}

impl SandboxOutcome {
    /// The outcome of a client that ran: its exit code and what it wrote (collected within
    /// [`capture::DRAIN_BOUND`] of its exit).
    pub async fn collected(
        exit_code: Option<i32>,
        out: capture::Pending,
        err: capture::Pending,
        end: EndReason,
        started: std::time::Instant,
    ) -> Self {
        let stdout = capture::collect(out, capture::DRAIN_BOUND).await;
        let stderr = capture::collect(err, capture::DRAIN_BOUND).await;
        SandboxOutcome {
            exit_code,
            truncated: Truncated {
                stdout: stdout.truncated,
                stderr: stderr.truncated,
            },
            stdout: stdout.text,
            stderr: stderr.text,
            end,
            duration: started.elapsed(),
        }
    }

    /// A sandbox that never started.
    pub fn start_failed(message: String, started: std::time::Instant) -> Self {
        SandboxOutcome {
            exit_code: None,
            stdout: String::new(),
            stderr: String::new(),
            truncated: Truncated::default(),
            end: EndReason::StartFailed(message),
            duration: started.elapsed(),
        }
    }
}

/// Waits for `child` to exit, for the timeout, or for cancellation, whichever comes first.
/// `None` means the child is still running and must be stopped by the caller.
pub async fn wait_or_stop(
    child: &mut tokio::process::Child,
    timeout: Duration,
    cancel: &CancellationToken,
) -> (Option<std::process::ExitStatus>, EndReason) {
    tokio::select! {
        s = child.wait() => (s.ok(), EndReason::Exited),
        _ = tokio::time::sleep(timeout) => (None, EndReason::TimedOut),
        _ = cancel.cancelled() => (None, EndReason::Canceled),
    }
}

/// The configured backend.
#[derive(Debug, Clone)]
pub enum Backend {
    Engine(engine::EngineBackend),
    Bwrap(bwrap::BwrapBackend),
    Microvm(microvm::MicrovmBackend),
}

impl Backend {
    /// Builds the backend the config names.
    pub fn from_config(cfg: &Config) -> Backend {
        let node = node_id(cfg);
        match cfg.backend {
            BackendKind::Podman => Backend::Engine(engine::EngineBackend::new(
                BackendKind::Podman,
                cfg.podman.clone(),
                node,
                &cfg.state_dir,
            )),
            BackendKind::Docker => Backend::Engine(engine::EngineBackend::new(
                BackendKind::Docker,
                cfg.docker.clone(),
                node,
                &cfg.state_dir,
            )),
            BackendKind::Bwrap => Backend::Bwrap(bwrap::BwrapBackend::new(cfg.bwrap.clone(), node)),
            BackendKind::Microvm => Backend::Microvm(microvm::MicrovmBackend::new(
                cfg.microvm.clone(),
                &cfg.bwrap.rootfs,
                ResourceLimits::from_limits(&cfg.limits),
                &cfg.state_dir,
            )),
        }
    }

    /// `podman`, `docker` or `bwrap`.
    pub fn kind(&self) -> BackendKind {
        match self {
            Backend::Engine(e) => e.kind(),
            Backend::Bwrap(_) => BackendKind::Bwrap,
            Backend::Microvm(_) => BackendKind::Microvm,
        }
    }

    /// Checks that the backend answers; `Ok` carries a version line.
    pub async fn check(&self) -> Result<String, BackendError> {
        match self {
            Backend::Engine(e) => e.check().await,
            Backend::Bwrap(b) => b.check().await,
            Backend::Microvm(m) => m.check().await,
        }
    }

    /// Whether `image` can be run by this backend (exists locally / has a rootfs).
    pub async fn has_image(&self, image: &str) -> bool {
        match self {
            Backend::Engine(e) => e.has_image(image).await,
            Backend::Bwrap(b) => b.rootfs_for(image).is_some(),
            Backend::Microvm(m) => m.rootfs_for(image).is_some(),
        }
    }

    /// Runs one sandbox to the end; never leaves it running.
    pub async fn run(&self, spec: &SandboxSpec, cancel: &CancellationToken) -> SandboxOutcome {
        match self {
            Backend::Engine(e) => e.run(spec, cancel).await,
            Backend::Bwrap(b) => b.run(spec, cancel).await,
            Backend::Microvm(m) => m.run(spec, cancel).await,
        }
    }

    /// Removes every sandbox this node manages (startup reconciliation). Returns how many.
    pub async fn remove_all_managed(&self) -> usize {
        match self {
            Backend::Engine(e) => e.remove_all_managed().await,
            Backend::Bwrap(b) => b.remove_all_managed().await,
            Backend::Microvm(m) => m.remove_all_managed().await,
        }
    }
}
