//! Sandbox backends behind one interface, [`SandboxBackend`]: Podman and Docker (same CLI
//! flags, [`engine`]), bubblewrap ([`bwrap`]) and the KVM microVM ([`microvm`]). The
//! worker decides nothing about what a job does; a backend only starts an isolated process
//! tree with the limits it is given, captures its output with caps, and guarantees it is
//! gone afterwards.
//!
//! Adding a backend: its module here implementing [`SandboxBackend`] and exporting a
//! [`Descriptor`], one line in [`BACKENDS`] ([`registry`]), its [`BackendKind`] variant
//! and config section (`config`), and its name in the contract suite's list
//! (`worker/tests/all.rs`, checked against the kinds).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cynode_protocol::worker_api::Truncated;
use tokio_util::sync::CancellationToken;

use crate::config::{BackendKind, Config};

pub mod bwrap;
pub mod capture;
pub mod engine;
pub mod exec_io;
#[cfg(test)]
pub mod fake;
pub mod idmap;
pub mod image_labels;
pub mod isolated;
pub mod microvm;
pub mod mount_tree;
pub mod netns_gate;
pub mod registry;
pub mod seccomp;

pub use isolated::{IsolatedError, IsolatedOutput, IsolatedRun};
pub use netns_gate::NetnsHook;
pub use registry::{can_gate, describe, from_config, shutdown, BACKENDS};

/// Kills and removes the node's sandbox cgroups, whichever backend made them (the janitor's
/// first sweep): see [`bwrap::cgroup`].
pub use bwrap::cgroup::remove_node_cgroups;

/// What the node knows of one backend before (and besides) building it.
#[derive(Debug, Clone, Copy)]
pub struct Descriptor {
    /// The kind the config names (`backend:`); its section of the config has that name.
    pub kind: BackendKind,
    /// Builds the backend `cfg` configures.
    pub build: fn(&Config) -> Arc<dyn SandboxBackend>,
    /// Whether sandboxes of this backend, as `cfg` configures it, can be started gated
    /// ([`SandboxBackend::run_gated`]): the egress proxy and the inference listener bind
    /// inside them. Asked of the configuration, before any backend exists.
    pub can_gate: fn(&Config) -> bool,
    /// The backend as `cfg` configures it, for messages: `podman with gVisor`.
    pub describe: fn(&Config) -> String,
    /// What a graceful stop undoes once no job runs (a starter pool drained, staging
    /// mounts unmounted), given the state directory. Every backend's runs at every stop:
    /// each undoes only what its own module made, and nothing when it made nothing.
    pub shutdown: fn(&Path),
}

/// The node's own kind's name, for a descriptor whose message is just that.
pub fn kind_name(cfg: &Config) -> String {
    cfg.backend.as_str().to_string()
}

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
///
/// A node that died before the signal was armed (during the child's cgroup join, say)
/// would never send it: the child then has another parent than the node, and fails here
/// instead of running orphaned (checked against the pid [`client_env`] recorded).
pub fn die_with_node() -> std::io::Result<()> {
    // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let node = NODE_PID.load(std::sync::atomic::Ordering::Relaxed);
    // SAFETY: getppid has no preconditions.
    if node != 0 && unsafe { libc::getppid() } != node {
        return Err(std::io::Error::other(
            "the node died before its child started",
        ));
    }
    Ok(())
}

/// The node's pid, recorded before a client is forked ([`client_env`]), for
/// [`die_with_node`]'s check in the child.
static NODE_PID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// Records this process's pid for [`die_with_node`] (before any fork of a client).
pub fn record_node_pid() {
    NODE_PID.store(
        std::process::id() as i32,
        std::sync::atomic::Ordering::Relaxed,
    );
}

/// Variables a client the node runs (podman, docker, the microVM's tools, `bwrap
/// --version`) may inherit from the node: what the client itself needs to find its
/// binaries, its configuration and its runtime directory. Nothing else of the node's
/// environment (its bearer token, API keys) reaches a client, and so none reaches a
/// sandbox. A sandbox's bwrap inherits none of these: it starts with an empty environment
/// and takes its options through `--args` ([`bwrap`]).
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
    record_node_pid();
    cmd.env_clear().envs(client_vars())
}

/// The node's [`CLIENT_ENV`] variables that are set (PATH always: the default when unset),
/// for a client's environment, or the janitor's ([`crate::janitor`]).
pub fn client_vars() -> Vec<(&'static str, std::ffi::OsString)> {
    let mut vars: Vec<_> = CLIENT_ENV
        .iter()
        .filter_map(|k| std::env::var_os(k).map(|v| (*k, v)))
        .collect();
    if std::env::var_os("PATH").is_none() {
        vars.push(("PATH", crate::sandbox::DEFAULT_PATH.into()));
    }
    vars
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

/// What every backend does, each in its own module ([`bwrap`], [`engine`] for Podman and
/// Docker, [`microvm`]): check itself, run one sandbox to its end (optionally gated for the
/// egress proxy), hold a session's sandbox, run a host tool over sandbox-written content in
/// isolation (the changeset's git), and remove what a previous run of the node left.
///
/// The node holds it as `Arc<dyn SandboxBackend>` ([`from_config`], through the
/// [`registry`], is the one place that picks the implementation): one virtual call per sandbox operation is nothing next to
/// starting a process, and each backend keeps its own state (session handles included)
/// without a `match` over every backend in every method.
#[async_trait::async_trait]
pub trait SandboxBackend: Send + Sync + std::fmt::Debug {
    /// The kind the config names (`podman`, `docker`, `bwrap`, `microvm`).
    fn kind(&self) -> BackendKind;

    /// Checks that the backend answers; `Ok` carries a version line, `Err` says what is
    /// missing.
    async fn check(&self) -> Result<String, BackendError>;

    /// Whether a streamed session command can take a stdin and signals
    /// ([`exec_io`]); a backend that cannot answers `false` and both are refused by name.
    fn exec_io(&self) -> bool {
        true
    }

    /// Whether `image` can be run by this backend (exists locally / has a rootfs).
    async fn has_image(&self, image: &str) -> bool;

    /// Runs one sandbox to the end; never leaves it running.
    async fn run(&self, spec: &SandboxSpec, cancel: &CancellationToken) -> SandboxOutcome;

    /// [`SandboxBackend::run`], calling `hook` once the sandbox's namespaces exist and
    /// before its command runs ([`netns_gate`]). A backend that cannot refuses, which is
    /// this default: the executor refuses such jobs before they get here.
    async fn run_gated(
        &self,
        _spec: &SandboxSpec,
        _cancel: &CancellationToken,
        _hook: NetnsHook,
    ) -> SandboxOutcome {
        cannot_gate(self.kind())
    }

    /// [`SandboxBackend::run_gated`] with a hook, [`SandboxBackend::run`] without.
    async fn run_with_hook(
        &self,
        spec: &SandboxSpec,
        cancel: &CancellationToken,
        hook: Option<NetnsHook>,
    ) -> SandboxOutcome {
        match hook {
            Some(hook) => self.run_gated(spec, cancel, hook).await,
            None => self.run(spec, cancel).await,
        }
    }

    /// Removes every sandbox this node manages (startup reconciliation). Returns how many.
    async fn remove_all_managed(&self) -> usize;

    /// Removes the named sandbox if it still exists (reconciliation of one job).
    async fn remove_named(&self, name: &str);

    /// For the node's janitor once the node is gone ([`crate::janitor`], which removes the
    /// node's sandbox cgroups itself): removes this node's sandboxes that do not end with
    /// their node (an engine's containers, which their engine keeps running), and makes
    /// nothing again (no pool is filled). Returns how many. None by default: a bwrap or
    /// microVM sandbox lives in the node's cgroups or dies with its client.
    async fn remove_orphans(&self) -> usize {
        0
    }

    /// Starts the session sandbox described by `spec`, whose `timeout` is the session's max
    /// lifetime. On error nothing is left behind.
    async fn start_session(
        &self,
        spec: &SandboxSpec,
    ) -> Result<Arc<dyn SessionSandbox>, BackendError>;

    /// Runs a host tool over sandbox-written content in isolation ([`isolated`]).
    async fn run_isolated(&self, run: IsolatedRun) -> Result<IsolatedOutput, IsolatedError>;

    /// A hint that a new workspace will likely run as host uid `uid` (the next free one
    /// of `sandbox_uids`): a backend whose warm sandboxes are made per uid may make one
    /// ahead (bwrap's [`bwrap::warm`]). The default ignores it.
    fn expect_uid(&self, _uid: u32) {}

    /// Appends the backend's own figures to `/metrics` in Prometheus text format (its
    /// warm pools' gauges and counters), each series labelled `backend="<label>"` where
    /// it has that label. Nothing by default.
    fn write_metrics(&self, _label: &str, _out: &mut String) {}
}

/// The outcome of a gated run on a backend that cannot gate.
pub fn cannot_gate(kind: BackendKind) -> SandboxOutcome {
    SandboxOutcome::start_failed(
        format!(
            "the {} backend cannot start a sandbox with an egress proxy",
            kind.as_str()
        ),
        std::time::Instant::now(),
    )
}

/// A session's sandbox on its backend, from [`SandboxBackend::start_session`].
#[async_trait::async_trait]
pub trait SessionSandbox: Send + Sync + std::fmt::Debug {
    /// Runs `spec.command` in the session's sandbox to its end, within `spec.timeout`;
    /// `cancel` (the session ending) stops it.
    async fn exec(&self, spec: &SandboxSpec, cancel: &CancellationToken) -> SandboxOutcome;

    /// The pid of a process in the network namespace the session's commands share for
    /// its whole life (the session container's init: the pool waiter, or a keep-alive's
    /// init), where the session's egress proxy
    /// binds once; `None` when there is none the node can bind in (each command a sandbox
    /// of its own, or gVisor's network stack).
    fn netns_pid(&self) -> Option<u32> {
        None
    }

    /// [`SessionSandbox::exec`] in a fresh sandbox of its own, `hook` called once its
    /// network namespace exists and before the command runs (a session whose commands
    /// are each a sandbox: the egress proxy binds per command). The default refuses.
    async fn exec_gated(
        &self,
        _spec: &SandboxSpec,
        _cancel: &CancellationToken,
        _hook: NetnsHook,
    ) -> SandboxOutcome {
        SandboxOutcome::start_failed(
            "this session's sandbox cannot bind an egress proxy per command".into(),
            std::time::Instant::now(),
        )
    }

    /// Whether the sandbox still lives and can run commands.
    fn is_alive(&self) -> bool;

    /// Removes the session's sandbox (kills whatever runs in it); absent is fine.
    async fn stop(&self);
}

/// A session with no sandbox living between its commands: each command is a fresh sandbox
/// of the backend over the same persisted workspace (bubblewrap, the microVM), so nothing
/// but the workspace survives between commands (no background processes, no /tmp).
#[derive(Debug, Clone)]
pub struct PerCommand<B>(pub B);

#[async_trait::async_trait]
impl<B: SandboxBackend> SessionSandbox for PerCommand<B> {
    async fn exec(&self, spec: &SandboxSpec, cancel: &CancellationToken) -> SandboxOutcome {
        self.0.run(spec, cancel).await
    }

    async fn exec_gated(
        &self,
        spec: &SandboxSpec,
        cancel: &CancellationToken,
        hook: NetnsHook,
    ) -> SandboxOutcome {
        self.0.run_gated(spec, cancel, hook).await
    }

    fn is_alive(&self) -> bool {
        true
    }

    async fn stop(&self) {}
}
