//! Podman and Docker: the same `run` flags, chosen by binary name.
//!
//! Every sandbox runs with `--rm`, no network, a read-only root, the workspace's host uid (`--user N:N`), all
//! capabilities dropped, no-new-privileges, the node's seccomp profile
//! ([`super::seccomp`], written to `<state_dir>/seccomp/`), memory/CPU/pids limits, a
//! tmpfs /tmp, and labels carrying task_id and job_id; nothing is pulled. The image comes
//! after `--`, so even a value that slipped past validation cannot be read as a flag. The
//! client runs with a cleared environment ([`super::client_env`]). On timeout or cancel the
//! container itself is killed and removed (not just the client process), again and again
//! until the client has exited, so a container still being created cannot outlive its job.
//!
//! Residual: as with bwrap, `/proc/self/mountinfo` inside names the host paths of the
//! `/job` and `/workspace` volumes (relative to the filesystem holding the state
//! directory); put `state_dir` on a filesystem of its own to show only paths below it.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use super::bwrap::IsolatedBwrap;
use super::netns_gate::NetnsHook;
use super::{
    capture, seccomp, BackendError, EndReason, IsolatedError, IsolatedOutput, IsolatedRun,
    ResourceLimits, SandboxBackend, SandboxOutcome, SandboxSpec, SessionSandbox, MANAGED_LABEL,
};
use crate::config::{BackendKind, EngineConfig, OciRuntime};
use crate::sandbox::engine_user;

/// How long a stopped container's client may take to exit before it is killed.
const STOP_BOUND: Duration = Duration::from_secs(60);
/// runsc's own flags (Podman: `--runtime-flag`; Docker: the registered runtime's
/// `runtimeArgs`, see deploy/install-deps.sh): `network=none`, or runsc refuses to start
/// in a network namespace it does not own; `oci-seccomp`, or runsc ignores the node's
/// seccomp profile (user namespaces, for one, were allowed inside gVisor without it);
/// `host-uds=open`, so a job can connect to the node's sockets under /job (status,
/// inference), which gVisor refuses by default.
pub const RUNSC_FLAGS: &[&str] = &["network=none", "oci-seccomp", "host-uds=open"];
/// Bound on the engine CLI calls of `check`.
const CLI_BOUND: Duration = Duration::from_secs(30);

/// Podman's default `init_path` (containers.conf), from the Debian package `catatonit`.
pub const PODMAN_DEFAULT_INIT: &str = "/usr/libexec/podman/catatonit";
/// Where Docker's `docker-init` may live when it is not on PATH.
const DOCKER_INIT_DIRS: &[&str] = &["/usr/libexec/docker", "/usr/local/libexec/docker"];

/// A container engine driven through its CLI.
#[derive(Debug, Clone)]
pub struct EngineBackend {
    kind: BackendKind,
    cfg: EngineConfig,
    node: String,
    /// The seccomp profile file every container is started with.
    profile: PathBuf,
    /// The working directory of every engine client: the node's own, under its state
    /// directory, so nothing an engine helper writes to its current directory (conmon
    /// leaves an `oom` file there after an OOM kill) lands where the node was started.
    workdir: PathBuf,
    /// Isolated runs (the changeset's git) go to the node's bubblewrap.
    tools: IsolatedBwrap,
    /// The warm pool ([`pool`]); size 0 when off.
    pool: pool::Pool,
    /// The node's limits, for the containers the pool starts ahead of their jobs.
    limits: ResourceLimits,
}

/// Whether an engine with `runtime` can start a container gated
/// ([`SandboxBackend::run_gated`]): runc or crun, on Podman and Docker. gVisor serves a
/// network of its own inside its sandbox (a listener in the container's host-side
/// namespace is not seen there).
pub fn can_gate(runtime: OciRuntime) -> bool {
    runtime != OciRuntime::Runsc
}

/// Podman's entry in the backend registry ([`super::BACKENDS`]).
pub const PODMAN: super::Descriptor = super::Descriptor {
    kind: BackendKind::Podman,
    build: |cfg| build(BackendKind::Podman, cfg.podman.clone(), cfg),
    can_gate: |cfg| can_gate(cfg.podman.runtime),
    describe: |cfg| describe("podman", cfg.podman.runtime),
    shutdown: pool::unmount_slots,
};

/// Docker's entry in the backend registry ([`super::BACKENDS`]).
pub const DOCKER: super::Descriptor = super::Descriptor {
    kind: BackendKind::Docker,
    build: |cfg| build(BackendKind::Docker, cfg.docker.clone(), cfg),
    can_gate: |cfg| can_gate(cfg.docker.runtime),
    describe: |cfg| describe("docker", cfg.docker.runtime),
    // The pool's directory is the same for both engines: Podman's entry unmounts it.
    shutdown: |_| {},
};

/// An engine backend of the node `cfg` configures, with the engine's own section.
fn build(
    kind: BackendKind,
    section: EngineConfig,
    cfg: &crate::config::Config,
) -> Arc<dyn SandboxBackend> {
    Arc::new(
        EngineBackend::new(
            kind,
            section,
            super::node_id(cfg),
            &cfg.state_dir,
            IsolatedBwrap::for_config(cfg),
        )
        .with_limits(ResourceLimits::from_limits(&cfg.limits)),
    )
}

/// `name`, and `with gVisor` when its runtime is runsc.
fn describe(name: &str, runtime: OciRuntime) -> String {
    match runtime {
        OciRuntime::Runsc => format!("{name} with gVisor"),
        _ => name.to_string(),
    }
}

impl EngineBackend {
    /// A backend for `kind` (podman or docker) of the node whose state lives in
    /// `state_dir`.
    pub fn new(
        kind: BackendKind,
        cfg: EngineConfig,
        node: String,
        state_dir: &Path,
        tools: IsolatedBwrap,
    ) -> Self {
        let text = seccomp::oci_profile().to_string();
        let digest = {
            use sha2::Digest;
            hex::encode(sha2::Sha256::digest(text.as_bytes()))
        };
        let profile = state_dir
            .join("seccomp")
            .join(format!("profile-{}.json", &digest[..16]));
        let pool = pool::Pool::new(
            cfg.pool_size,
            state_dir,
            cfg.pool_waiter.clone(),
            cfg.pool_images.clone(),
        );
        Self {
            kind,
            cfg,
            node,
            profile,
            workdir: client_workdir(state_dir),
            tools,
            pool,
            limits: ResourceLimits::from_limits(&crate::config::Limits::default()),
        }
    }

    /// The node's limits, which the pool's containers are started with ahead of their
    /// jobs (the default limits until set).
    pub fn with_limits(mut self, limits: ResourceLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Whether containers run under gVisor (`runtime: runsc`).
    pub fn gvisor(&self) -> bool {
        self.cfg.runtime == OciRuntime::Runsc
    }

    /// The warm pool.
    pub fn pool(&self) -> &pool::Pool {
        &self.pool
    }

    /// Writes the seccomp profile file if it is not there yet (its name carries its hash).
    pub fn ensure_profile(&self) -> Result<(), BackendError> {
        if self.profile.is_file() {
            return Ok(());
        }
        let fail = |e: std::io::Error| {
            BackendError::Unavailable(format!(
                "cannot write the seccomp profile {}: {e}",
                self.profile.display()
            ))
        };
        let dir = self.profile.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(fail)?;
        let tmp = tempfile::NamedTempFile::new_in(dir).map_err(fail)?;
        std::fs::write(tmp.path(), seccomp::oci_profile().to_string()).map_err(fail)?;
        tmp.persist(&self.profile).map_err(|e| fail(e.error))?;
        Ok(())
    }

    /// The directory of the node's seccomp files (the OCI profile, gVisor sessions'
    /// filters).
    fn profile_dir(&self) -> PathBuf {
        self.profile
            .parent()
            .unwrap_or(Path::new("."))
            .to_path_buf()
    }

    /// The init binary session containers need, and whether it is there.
    pub fn init_binary(&self) -> (String, bool) {
        if let Some(p) = &self.cfg.init_path {
            return (p.display().to_string(), p.is_file());
        }
        match self.kind {
            BackendKind::Docker => {
                let on_path = std::env::var_os("PATH")
                    .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
                    .unwrap_or_default();
                let found = on_path
                    .iter()
                    .map(PathBuf::as_path)
                    .chain(DOCKER_INIT_DIRS.iter().map(Path::new))
                    .any(|d| d.join("docker-init").is_file());
                ("docker-init".into(), found)
            }
            _ => (
                PODMAN_DEFAULT_INIT.into(),
                Path::new(PODMAN_DEFAULT_INIT).is_file(),
            ),
        }
    }

    /// The configured init binary, if any (passed as `--init-path` to Podman).
    pub fn init_path(&self) -> Option<&Path> {
        self.cfg.init_path.as_deref()
    }

    /// The client binary (`podman`, `docker`, or as configured).
    pub fn binary(&self) -> &str {
        &self.cfg.binary
    }

    /// A command of the engine's client: cleared environment, no stdin, killed when
    /// dropped, run in the node's own working directory (created when missing).
    pub fn command(&self) -> Command {
        let mut c = Command::new(&self.cfg.binary);
        super::client_env(&mut c)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        if std::fs::create_dir_all(&self.workdir).is_ok() {
            c.current_dir(&self.workdir);
        }
        c
    }

    /// The OCI runtime containers run with.
    pub fn runtime(&self) -> OciRuntime {
        self.cfg.runtime
    }

    /// The `--runtime` options of `run` (none for the engine's default). For gVisor,
    /// Podman gets the runsc binary and its flags [`RUNSC_FLAGS`], Docker the runtime
    /// registered as `runsc` in its daemon's configuration (which carries those flags).
    pub fn runtime_args(&self) -> Vec<String> {
        match (self.cfg.runtime, self.kind) {
            (OciRuntime::Default, _) => Vec::new(),
            (OciRuntime::Runsc, BackendKind::Podman) => {
                std::iter::once(format!("--runtime={}", self.cfg.runsc_path.display()))
                    .chain(RUNSC_FLAGS.iter().map(|f| format!("--runtime-flag={f}")))
                    .collect()
            }
            (r, _) => vec![format!("--runtime={}", r.as_str())],
        }
    }

    /// gVisor is there: Podman's `runsc_path` is a file; Docker's daemon lists a runtime
    /// named `runsc`.
    async fn check_runtime(&self) -> Result<(), BackendError> {
        if self.cfg.runtime != OciRuntime::Runsc {
            return Ok(());
        }
        let runsc = &self.cfg.runsc_path;
        if self.kind == BackendKind::Docker {
            let out = self
                .cli_output(&["info", "--format", "{{json .Runtimes}}"])
                .await?;
            if !out.status.success() {
                return Err(BackendError::Unavailable(format!(
                    "`{} info` failed ({}), so whether the daemon has runsc is unknown: {}",
                    self.cfg.binary,
                    out.status,
                    String::from_utf8_lossy(&out.stderr[..out.stderr.len().min(2048)]).trim()
                )));
            }
            let runtimes: serde_json::Value =
                serde_json::from_slice(&out.stdout).unwrap_or_default();
            let want: Vec<String> = RUNSC_FLAGS.iter().map(|f| format!("--{f}")).collect();
            let registered = runtimes.get("runsc");
            let args: Vec<&str> = registered
                .and_then(|r| r.get("runtimeArgs"))
                .and_then(|a| a.as_array())
                .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
                .unwrap_or_default();
            if registered.is_none() || want.iter().any(|w| !args.contains(&w.as_str())) {
                return Err(BackendError::Unavailable(format!(
                    "docker.runtime is runsc, but the Docker daemon has no runtime named runsc with runtimeArgs {want:?}: register it in /etc/docker/daemon.json (\"runtimes\": {{\"runsc\": {{\"path\": \"{}\", \"runtimeArgs\": {want:?}}}}}, as deploy/install-deps.sh does) and reload dockerd (SIGHUP)",
                    runsc.display()
                )));
            }
        } else if !runsc.is_file() {
            return Err(BackendError::Unavailable(format!(
                "podman.runtime is runsc, but {} is missing: install the Debian package `runsc` (gVisor) or set podman.runsc_path",
                runsc.display()
            )));
        }
        Ok(())
    }

    /// Runs the client with `args` to its end, bounded by [`CLI_BOUND`].
    async fn cli_output(&self, args: &[&str]) -> Result<std::process::Output, BackendError> {
        let binary = &self.cfg.binary;
        match tokio::time::timeout(CLI_BOUND, self.command().args(args).output()).await {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(e)) => Err(BackendError::Client(format!("{binary} not runnable: {e}"))),
            Err(_) => Err(BackendError::Client(format!(
                "{binary} {} did not answer within {} s",
                args.first().copied().unwrap_or(""),
                CLI_BOUND.as_secs()
            ))),
        }
    }

    /// The `run` argv for `spec` (without the binary).
    pub fn run_args(&self, spec: &SandboxSpec) -> Vec<String> {
        let l = &spec.limits;
        let mut a: Vec<String> = vec![
            "run".into(),
            "--rm".into(),
            "--name".into(),
            spec.name.clone(),
            "--label".into(),
            format!("{MANAGED_LABEL}={}", self.node),
        ];
        for (k, v) in &spec.labels {
            a.push("--label".into());
            a.push(format!("{k}={v}"));
        }
        a.extend(self.runtime_args());
        a.push("--pull=never".into());
        a.push(format!("--security-opt=seccomp={}", self.profile.display()));
        a.extend([
            "--network=none".into(),
            "--read-only".into(),
            format!("--user={}", engine_user(spec.host_uid)),
            "--cap-drop=ALL".into(),
            "--security-opt=no-new-privileges".into(),
            "--ulimit=nofile=1024:1024".into(),
            "--ulimit=nproc=4096:4096".into(),
        ]);
        a.push(format!("--memory={}m", l.memory_mb));
        a.push(format!("--memory-swap={}m", l.memory_mb));
        a.push(format!("--pids-limit={}", l.pids));
        a.push(format!("--cpus={}", l.cpus));
        a.push(format!("--tmpfs=/tmp:rw,size={}m,mode=1777", l.tmpfs_mb));
        for m in &spec.mounts {
            let mode = if m.writable { "rw" } else { "ro" };
            a.push(format!("--volume={}:{}:{mode}", m.host.display(), m.target));
        }
        a.push(format!("--workdir={}", spec.workdir));
        for (k, v) in &spec.env {
            a.push(format!("--env={k}={v}"));
        }
        let mut cmd = spec.command.iter();
        if spec.override_entrypoint {
            if let Some(first) = cmd.next() {
                a.push(format!("--entrypoint={first}"));
            }
        }
        a.push("--".into());
        a.push(spec.image.clone());
        a.extend(cmd.cloned());
        a
    }

    /// Ends a container whose client is still running (timeout or cancel). A client that
    /// is still creating the container would start it after a single remove found nothing,
    /// so the container is removed again every second until the client has exited (it
    /// exits once its container is gone), then once more, when nothing can create it any
    /// longer. A client that outlives [`STOP_BOUND`] is killed first.
    async fn stop_and_remove(
        &self,
        name: &str,
        child: &mut tokio::process::Child,
    ) -> Option<std::process::ExitStatus> {
        let until = Instant::now() + STOP_BOUND;
        let status = loop {
            self.force_remove(name).await;
            match tokio::time::timeout(Duration::from_secs(1), child.wait()).await {
                Ok(s) => break s.ok(),
                Err(_) if Instant::now() < until => continue,
                Err(_) => {
                    let _ = child.start_kill();
                    break child.wait().await.ok();
                }
            }
        };
        self.force_remove(name).await;
        status
    }

    /// Kills (SIGKILL, no grace period) and removes a container by name; absent is fine.
    pub async fn force_remove(&self, name: &str) {
        let mut c = self.command();
        c.args(self.remove_args());
        let _ = c
            .arg(name)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await;
    }

    /// `rm` and its options: Podman `rm --force --time 0 --ignore`; Docker has neither
    /// `--time` nor `--ignore` (and refuses the whole command when given them), and its
    /// `rm --force` kills with SIGKILL at once.
    fn remove_args(&self) -> &'static [&'static str] {
        match self.kind {
            BackendKind::Docker => &["rm", "--force"],
            _ => &["rm", "--force", "--time", "0", "--ignore"],
        }
    }

    /// Names of running or stopped containers of this node.
    pub async fn list_managed(&self) -> Vec<String> {
        let out = self
            .command()
            .args(["ps", "--all", "--filter"])
            .arg(format!("label={MANAGED_LABEL}={}", self.node))
            .args(["--format", "{{.Names}}"])
            .output()
            .await;
        match out {
            Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(|l| l.trim().to_string())
                .filter(|l| !l.is_empty())
                .collect(),
            _ => Vec::new(),
        }
    }
}

#[async_trait::async_trait]
impl SandboxBackend for EngineBackend {
    fn kind(&self) -> BackendKind {
        self.kind
    }

    /// The engine answers (Docker: its daemon, not only the client), the OCI runtime is
    /// there (runsc: Podman's `runsc_path` exists, Docker's daemon has `runsc`
    /// registered), the seccomp profile is in place, the init binary that session
    /// containers need (`run --init`) exists, and under gVisor the pool waiter its session
    /// commands run through ([`exec_filter`]). `Err` says what is missing and how to fix it.
    async fn check(&self) -> Result<String, BackendError> {
        let binary = &self.cfg.binary;
        // Docker's client answers `version` without a daemon; the server's version needs one.
        let side = match self.kind {
            BackendKind::Docker => "{{.Server.Version}}",
            _ => "{{.Client.Version}}",
        };
        let out = self.cli_output(&["version", "--format", side]).await?;
        if !out.status.success() {
            let said = last_line(&out.stderr);
            return Err(BackendError::Refused(match self.kind {
                BackendKind::Docker => format!(
                    "no Docker daemon answers `{binary} version` ({said}): start dockerd (deploy/docker/start.sh does, without systemd) or set DOCKER_HOST"
                ),
                _ => format!("{binary} version failed: {said}"),
            }));
        }
        let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
        self.check_runtime().await?;
        self.ensure_profile()?;
        let (init, present) = self.init_binary();
        if !present {
            let package = match self.kind {
                BackendKind::Docker => "tini",
                _ => "catatonit",
            };
            return Err(BackendError::Unavailable(format!(
                "{} {version}; session sandboxes need the init binary {init} (`run --init`), which is missing: install the Debian package `{package}` or set {}.init_path",
                self.kind.as_str(),
                self.kind.as_str()
            )));
        }
        let waiter_missing = |why: &str| {
            format!(
                "{why} the pool waiter {}, which is missing: build it with deploy/worker/build-waiter.sh or set {}.pool_waiter",
                self.pool.waiter().display(),
                self.kind.as_str()
            )
        };
        let has_waiter = self.pool.waiter().is_file();
        if self.cfg.runtime == OciRuntime::Runsc && !has_waiter {
            return Err(BackendError::Unavailable(format!(
                "{} {version}; {}",
                self.kind.as_str(),
                waiter_missing(
                    "gVisor session commands run under the node's seccomp filter through"
                )
            )));
        }
        let runtime = match self.cfg.runtime {
            OciRuntime::Default => String::new(),
            r => format!(" (runtime {})", r.as_str()),
        };
        let pool = if self.pool.size() == 0 {
            // `restricted` jobs start in a waiter's container with the pool off.
            let gated = if can_gate(self.cfg.runtime) && !has_waiter {
                format!(
                    "; `restricted` (egress) jobs will fail: {}",
                    waiter_missing("they need")
                )
            } else {
                String::new()
            };
            format!(
                "; warm pool off ({}.pool_size 0){gated}",
                self.kind.as_str()
            )
        } else if !has_waiter {
            return Err(BackendError::Unavailable(waiter_missing(&format!(
                "{}.pool_size is {}, but it needs",
                self.kind.as_str(),
                self.pool.size()
            ))));
        } else {
            format!(
                "; warm pool {} per image (waiter {}, filled at start: {})",
                self.pool.size(),
                self.pool.waiter().display(),
                if self.pool.images().is_empty() {
                    "none".to_string()
                } else {
                    self.pool.images().join(", ")
                }
            )
        };
        Ok(format!("{} {version}{runtime}{pool}", self.kind.as_str()))
    }

    /// Whether the image exists locally (nothing is ever pulled).
    async fn has_image(&self, image: &str) -> bool {
        let sub = match self.kind {
            BackendKind::Docker => ["image", "inspect"],
            _ => ["image", "exists"],
        };
        self.command()
            .args(sub)
            .arg("--")
            .arg(image)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await
            .map(|s| s.success())
            .unwrap_or(false)
    }

    /// Runs the container to the end: in a pooled container when the pool has one
    /// ([`pool`]), else cold.
    async fn run(&self, spec: &SandboxSpec, cancel: &CancellationToken) -> SandboxOutcome {
        let started = Instant::now();
        if let Err(e) = self.ensure_profile() {
            return SandboxOutcome::start_failed(e.to_string(), started);
        }
        if self.pool.size() > 0 {
            if let Some(slot) = self.pool.claim(self, spec) {
                let slot_name = slot.name.clone();
                match self.run_in_slot(slot, spec, cancel, started).await {
                    Ok(outcome) => return outcome,
                    Err(u)
                        if !u.retry
                            || cancel.is_cancelled()
                            || started.elapsed() >= spec.timeout =>
                    {
                        return SandboxOutcome::start_failed(u.why, started)
                    }
                    Err(u) => {
                        tracing::warn!(sandbox = %spec.name, slot = %slot_name, reason = %u.why, "pooled container could not take the job; it runs cold");
                    }
                }
            }
        }
        let mut cmd = self.command();
        cmd.args(self.run_args(spec));
        let (mut child, out, err) = match spawn_client(cmd, &self.cfg.binary, spec.output_cap) {
            Ok(spawned) => spawned,
            Err(e) => return SandboxOutcome::start_failed(e, started),
        };
        let (status, end) = super::wait_or_stop(&mut child, spec.timeout, cancel).await;
        let status = match status {
            Some(s) => Some(s),
            None => self.stop_and_remove(&spec.name, &mut child).await,
        };
        let exit_code = status.and_then(|s| s.code());
        let outcome = SandboxOutcome::collected(exit_code, out, err, end, started).await;
        engine_refused(outcome, &self.cfg.binary, "start the container")
    }

    /// The pool's figures, when it is on.
    fn write_metrics(&self, label: &str, out: &mut String) {
        if self.pool.size() > 0 {
            self.pool.stats().write_metrics(label, out);
        }
    }

    /// A gated job runs in a pooled container: an idle one (warm), else one made for it
    /// ([`pool::Pool::fresh`]), whose waiter holds the job until the hook has run. gVisor
    /// refuses ([`can_gate`]).
    async fn run_gated(
        &self,
        spec: &SandboxSpec,
        cancel: &CancellationToken,
        hook: NetnsHook,
    ) -> SandboxOutcome {
        if !can_gate(self.cfg.runtime) {
            return super::cannot_gate(self.kind);
        }
        let started = Instant::now();
        if let Err(e) = self.ensure_profile() {
            return SandboxOutcome::start_failed(e.to_string(), started);
        }
        let deadline = started + spec.timeout;
        // An idle container whose waiter died (its pid may since be another process's)
        // is never handed to the hook: it goes, and one is made for the job.
        let warm = if self.pool.size() > 0 {
            self.pool.claim(self, spec)
        } else {
            None
        };
        let warm = match warm {
            Some(slot) if slot.alive() => Some(slot),
            Some(dead) => {
                self.pool.discard(self, dead);
                None
            }
            None => None,
        };
        let slot = match warm {
            Some(slot) => slot,
            None => match before(self.fresh_slot(spec, false), deadline, cancel).await {
                Ok(Ok(slot)) => slot,
                Ok(Err(e)) | Err(e) => return SandboxOutcome::start_failed(e, started),
            },
        };
        // The pid is the waiter's while it lives: alive before the hook opens its
        // namespace and after, so the namespace the proxy listens in is the container's.
        let hooked = match before(hook(slot.pid()), deadline, cancel).await {
            Ok(Ok(())) if slot.alive() => Ok(()),
            Ok(Ok(())) => Err("the container ended before its job was sent".to_string()),
            Ok(Err(e)) | Err(e) => Err(e),
        };
        if let Err(why) = hooked {
            // The proxy may already listen in this container's namespace: the job does
            // not run anywhere else.
            let name = slot.name.clone();
            drop(slot);
            self.force_remove(&name).await;
            self.pool.failed(&name).await;
            return SandboxOutcome::start_failed(why, started);
        }
        self.run_in_slot(slot, spec, cancel, started)
            .await
            .unwrap_or_else(|u| SandboxOutcome::start_failed(u.why, started))
    }

    /// Removes every container of this node (the pool's too), then fills the warm pool
    /// for its configured images.
    async fn remove_all_managed(&self) -> usize {
        let removed = self.remove_orphans().await;
        // Slot directories of a previous run go, also with the pool off (Docker's gated
        // jobs use slots: `run_gated`).
        self.pool.reset_dir();
        // Old waiters' filter directories and old profiles: no container uses them now.
        exec_filter::sweep(&self.profile_dir(), &self.profile);
        if self.pool.size() > 0 && self.ensure_profile().is_ok() {
            let template = pool::template(self.limits);
            self.pool.prewarm(self, &template).await;
        }
        removed
    }

    async fn remove_named(&self, name: &str) {
        self.force_remove(name).await;
    }

    /// The node's containers, running or not (conmon or the daemon keeps a container of a
    /// dead node running); the pool is not filled again.
    async fn remove_orphans(&self) -> usize {
        let names = self.list_managed().await;
        for n in &names {
            self.force_remove(n).await;
        }
        names.len()
    }

    /// A pooled container whose waiter runs the session's commands
    /// ([`pool::WarmSession`]): an idle one of the session's key, else one made for it.
    /// Under gVisor, or when no pooled container can be had (no waiter binary, a failed
    /// start), one keep-alive container per session ([`session`]).
    async fn start_session(
        &self,
        spec: &SandboxSpec,
    ) -> Result<Arc<dyn SessionSandbox>, BackendError> {
        if !self.gvisor() && self.pool.waiter().is_file() {
            let slot = match self.pool.claim(self, spec) {
                Some(slot) => Ok(slot),
                None => self.fresh_slot(spec, true).await,
            };
            let started = match slot {
                Ok(slot) => {
                    let name = slot.name.clone();
                    match slot.start_session(self, spec).await {
                        Ok(s) => return Ok(Arc::new(s)),
                        Err(e) => {
                            self.force_remove(&name).await;
                            self.pool.failed(&name).await;
                            e
                        }
                    }
                }
                Err(e) => e,
            };
            tracing::warn!(sandbox = %spec.name, error = %started, "no pooled container for the session; starting a keep-alive container");
        }
        Ok(Arc::new(
            session::KeepAliveSession::start(self, spec).await?,
        ))
    }

    /// In the node's bubblewrap, as on every backend.
    async fn run_isolated(&self, run: IsolatedRun) -> Result<IsolatedOutput, IsolatedError> {
        self.tools.run(run).await
    }
}

/// Why a pooled container did not run a job, and whether it may run cold
/// ([`EngineBackend::run_in_slot`]).
struct Unclaimed {
    why: String,
    /// Nothing of the job ran.
    retry: bool,
}

/// `fut`, unless `cancel` fires or `deadline` passes first (then why, as `Err`).
async fn before<T>(
    fut: impl std::future::Future<Output = T>,
    deadline: Instant,
    cancel: &CancellationToken,
) -> Result<T, String> {
    tokio::select! {
        r = fut => Ok(r),
        _ = cancel.cancelled() => Err("canceled".into()),
        _ = tokio::time::sleep_until(deadline.into()) => Err("timed out before it started".into()),
    }
}

impl EngineBackend {
    /// A pooled container made now for `spec` ([`pool::Pool::fresh`]; `named`: as
    /// `spec.name`), in a task of its own: a caller that stops waiting (cancel, timeout)
    /// leaves it to finish, and the container and its slot directory are then discarded.
    async fn fresh_slot(&self, spec: &SandboxSpec, named: bool) -> Result<pool::Slot, String> {
        struct Orphan(
            Option<tokio::task::JoinHandle<Result<pool::Slot, String>>>,
            EngineBackend,
        );
        impl Drop for Orphan {
            fn drop(&mut self) {
                if let Some(task) = self.0.take() {
                    let engine = self.1.clone();
                    tokio::spawn(async move {
                        if let Ok(Ok(slot)) = task.await {
                            engine.pool.discard(&engine, slot);
                        }
                    });
                }
            }
        }
        let (engine, spec) = (self.clone(), spec.clone());
        let task = tokio::spawn(async move { engine.pool.fresh(&engine, &spec, named).await });
        let mut orphan = Orphan(Some(task), self.clone());
        let made = match orphan.0.as_mut() {
            Some(task) => task
                .await
                .unwrap_or_else(|e| Err(format!("the container task failed: {e}"))),
            None => Err("no container task".into()),
        };
        orphan.0 = None;
        made
    }

    /// Sends `spec`'s job to `slot` (bounded by the job's timeout and `cancel`) and runs
    /// it to its end. `Err`: the slot could not take it and its container is removed;
    /// with `retry` nothing of the job ran (the caller may run it cold), without it the
    /// job may have started.
    async fn run_in_slot(
        &self,
        slot: pool::Slot,
        spec: &SandboxSpec,
        cancel: &CancellationToken,
        started: Instant,
    ) -> Result<SandboxOutcome, Unclaimed> {
        let deadline = started + spec.timeout;
        let name = slot.name.clone();
        // The claim runs in a task of its own: one given up on (cancel, timeout) may be
        // mounting the job's directories; its container goes first, then the claim is
        // awaited (it ends once its waiter is gone), then its slot directory.
        let job = spec.clone();
        let mut claim = tokio::spawn(async move { slot.start_job(&job).await });
        let lost = match before(&mut claim, deadline, cancel).await {
            Ok(Ok(pool::Claimed::Running(r))) => {
                // Making the container and binding the proxy count against the timeout.
                let mut rest = spec.clone();
                rest.timeout = deadline.saturating_duration_since(Instant::now());
                return Ok(self.run_warm(&rest, cancel, *r, started).await);
            }
            Ok(Ok(pool::Claimed::Failed(why))) => Unclaimed { why, retry: true },
            Ok(Ok(pool::Claimed::Lost(why))) => Unclaimed { why, retry: false },
            Ok(Err(e)) => Unclaimed {
                why: format!("the claim task failed: {e}"),
                retry: false,
            },
            Err(why) => {
                // The container goes before the claim is awaited (its waiter's end ends it).
                self.force_remove(&name).await;
                let _ = claim.await;
                self.pool.failed(&name).await;
                return Err(Unclaimed { why, retry: false });
            }
        };
        self.force_remove(&name).await;
        self.pool.failed(&name).await;
        Err(lost)
    }

    /// Runs the job `r` started in a pooled container to its end: its exit code from the
    /// waiter, or the timeout or cancel (the container is then killed and removed as a
    /// cold one), or the container's end without a report (its client's exit code).
    async fn run_warm(
        &self,
        spec: &SandboxSpec,
        cancel: &CancellationToken,
        r: pool::Running,
        started: Instant,
    ) -> SandboxOutcome {
        let pool::Running {
            name,
            mut child,
            sock,
            stdout,
            stderr,
            dir,
            to_start,
            exec_failed,
        } = r;
        tracing::info!(
            sandbox = %spec.name,
            slot = %name,
            claim_to_start_us = to_start.as_micros() as u64,
            exec_failed,
            "warm job started"
        );
        let out = capture::spawn_stdout(Some(stdout), spec.output_cap);
        let err = capture::spawn_stderr(Some(stderr), spec.output_cap);
        let (code, end) = tokio::select! {
            c = pool::Running::exit_code(&sock) => match c {
                Some(c) => (Some(Some(c)), EndReason::Exited),
                // No report: the container ended (killed, OOM of the waiter); its client's
                // code, as a cold job's.
                None => {
                    let s = tokio::time::timeout(STOP_BOUND, child.wait()).await;
                    (Some(s.ok().and_then(|s| s.ok()).and_then(|s| s.code())), EndReason::Exited)
                }
            },
            _ = tokio::time::sleep(spec.timeout) => (None, EndReason::TimedOut),
            _ = cancel.cancelled() => (None, EndReason::Canceled),
        };
        let exit_code = match code {
            Some(c) => {
                drop(sock);
                pool::Pool::finish(self, name, child, dir);
                c
            }
            None => {
                drop(sock);
                let s = self.stop_and_remove(&name, &mut child).await;
                let _ = tokio::task::spawn_blocking(move || pool::remove_slot_dir(&dir)).await;
                s.and_then(|s| s.code())
            }
        };
        SandboxOutcome::collected(exit_code, out, err, end, started).await
    }
}

/// The last line of a client's output, trimmed (what an error message quotes).
pub(super) fn last_line(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .lines()
        .last()
        .unwrap_or("")
        .trim()
        .to_string()
}

/// The node's own working directory for engine clients, under its state directory.
pub fn client_workdir(state_dir: &Path) -> PathBuf {
    state_dir.join("engine-cwd")
}

/// Starts an engine client with piped output, drained from the start, that dies with the
/// node; `Err` says why it could not start.
pub(super) fn spawn_client(
    mut cmd: Command,
    binary: &str,
    output_cap: usize,
) -> Result<(tokio::process::Child, capture::Pending, capture::Pending), String> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    // SAFETY: the closure only calls prctl between fork and exec.
    unsafe {
        cmd.pre_exec(super::die_with_node);
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {binary}: {e}"))?;
    let out = capture::spawn_stdout(child.stdout.take(), output_cap);
    let err = capture::spawn_stderr(child.stderr.take(), output_cap);
    Ok((child, out, err))
}

/// Exit 125 is the engine's own "could not run" code: the sandbox never ran, and the
/// engine's last stderr line says why.
pub(super) fn engine_refused(mut o: SandboxOutcome, binary: &str, what: &str) -> SandboxOutcome {
    if o.end == EndReason::Exited && o.exit_code == Some(125) {
        o.end = EndReason::StartFailed(format!(
            "{binary} could not {what}: {}",
            o.stderr.lines().last().unwrap_or("").trim()
        ));
    }
    o
}

mod exec_filter;
mod exec_signal;
pub mod pool;
pub mod session;

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> IsolatedBwrap {
        IsolatedBwrap::new("bwrap".into(), "n".into(), Some(false))
    }

    fn spec(image: &str, command: &[&str]) -> SandboxSpec {
        crate::sandbox::example_spec(image, command)
    }

    /// The image is the first argument after `--`, so nothing from the request that
    /// follows the options can be read as one; the seccomp profile and `--pull=never` are
    /// always there.
    #[test]
    fn image_follows_the_end_of_options() {
        for kind in [BackendKind::Podman, BackendKind::Docker] {
            let e = EngineBackend::new(
                kind,
                EngineConfig::default(),
                "n".into(),
                Path::new("/s"),
                tools(),
            );
            let a = e.run_args(&spec("img:1", &["sh", "--user=0:0", "img:1", "-c", "id"]));
            let end = a.iter().position(|x| x == "--").unwrap();
            assert_eq!(&a[end + 1..], ["img:1", "--user=0:0", "img:1", "-c", "id"]);
            assert!(a[..end].contains(&"--entrypoint=sh".to_string()));
            assert!(a[..end].contains(&"--pull=never".to_string()));
            assert!(a[..end]
                .iter()
                .any(|x| x.starts_with("--security-opt=seccomp=/s/seccomp/profile-")));
            assert!(!a[..end].iter().any(|x| x.contains("--user=0")));
        }
    }

    /// gVisor under Podman is the runsc binary with its own `network=none` flag; under
    /// Docker the registered runtime's name; runc and crun by name; the default, nothing.
    #[test]
    fn runtime_options_follow_the_engine() {
        let args = |kind, runtime| {
            let cfg = EngineConfig {
                runtime,
                ..EngineConfig::default()
            };
            let e = EngineBackend::new(kind, cfg, "n".into(), Path::new("/s"), tools());
            let a = e.run_args(&spec("img:1", &["true"]));
            let end = a.iter().position(|x| x == "--").unwrap();
            a[..end]
                .iter()
                .filter(|x| x.starts_with("--runtime"))
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(
            args(BackendKind::Podman, OciRuntime::Runsc),
            [
                "--runtime=/usr/bin/runsc",
                "--runtime-flag=network=none",
                "--runtime-flag=oci-seccomp",
                "--runtime-flag=host-uds=open"
            ]
        );
        assert_eq!(
            args(BackendKind::Docker, OciRuntime::Runsc),
            ["--runtime=runsc"]
        );
        assert_eq!(
            args(BackendKind::Podman, OciRuntime::Runc),
            ["--runtime=runc"]
        );
        assert!(args(BackendKind::Docker, OciRuntime::Default).is_empty());
    }

    /// Docker refuses `rm --time` and `--ignore` (the whole command fails, and the
    /// container lived on): it gets plain `rm --force`, which kills at once.
    #[test]
    fn docker_rm_takes_only_force() {
        let e = |kind| {
            EngineBackend::new(
                kind,
                EngineConfig::default(),
                "n".into(),
                Path::new("/s"),
                tools(),
            )
        };
        assert_eq!(e(BackendKind::Docker).remove_args(), ["rm", "--force"]);
        assert_eq!(
            e(BackendKind::Podman).remove_args(),
            ["rm", "--force", "--time", "0", "--ignore"]
        );
    }

    /// Engine clients run in the node's own directory under its state directory.
    #[test]
    fn clients_run_in_the_nodes_directory() {
        let state = tempfile::tempdir().unwrap();
        let e = EngineBackend::new(
            BackendKind::Podman,
            EngineConfig::default(),
            "n".into(),
            state.path(),
            tools(),
        );
        let cmd = e.command();
        assert_eq!(
            cmd.as_std().get_current_dir(),
            Some(state.path().join("engine-cwd").as_path())
        );
    }

    #[test]
    fn a_configured_init_path_is_checked() {
        let cfg = EngineConfig {
            init_path: Some("/nonexistent/catatonit".into()),
            ..EngineConfig::default()
        };
        let e = EngineBackend::new(
            BackendKind::Podman,
            cfg,
            "n".into(),
            Path::new("/s"),
            tools(),
        );
        assert_eq!(
            e.init_binary(),
            ("/nonexistent/catatonit".to_string(), false)
        );
    }
}
