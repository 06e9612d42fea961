//! bubblewrap: namespaces without a container engine. The fast path, and the backend for
//! hosts that have no Podman or Docker.
//!
//! Each sandbox gets new user, pid, network, ipc, uts and cgroup namespaces (so no network
//! at all), uid/gid 1000 inside, every capability dropped, a read-only root taken from the
//! image's root filesystem directory (`bwrap.rootfs` in the config), a fresh /dev, /proc
//! and tmpfs /tmp, and only the job and workspace directories writable. `--die-with-parent`
//! ties the sandbox to the node. Memory, pids and CPU limits come from a per-sandbox
//! cgroup (v2 `memory.max`/`pids.max`/`cpu.max`, or the v1 `memory`, `pids` and `cpu`
//! hierarchies with `cpu.cfs_quota_us`) joined before bwrap executes, so even bwrap's
//! first child is inside it.
//!
//! The command runs under the node's seccomp filter ([`super::seccomp`], handed to bwrap
//! as BPF through memfds and `--add-seccomp-fd`), and with `--disable-userns` where this
//! bwrap has it, so no nested user namespace can be made.
//!
//! bwrap is PID 1 of the sandbox, so its `/proc/1/cmdline` and `/proc/1/environ` are
//! readable inside: it starts with an empty environment, and with every option (the root
//! filesystem, the job's directories, the node's descriptors: every host path) in a sealed
//! memfd it reads through `--args` ([`Invocation`]), so its command line is
//! `bwrap --args N -- <the sandbox's command>`.
//!
//! `/` is a read-only overlay view of the root filesystem directory ([`root_view`]) when
//! the node is root, so mountinfo inside shows `/` as its root and no layer's path.
//! Residuals (`worker/tests/host_paths.rs` matches exactly these): a node that is not root
//! binds the directory, and mountinfo then shows its path in the filesystem that holds it
//! as the root of `/`; as the root of a `/job` or `/workspace` that is not a volume of its
//! own, mountinfo shows its path in the filesystem of the state directory (a bind mount's
//! root is a path in its source filesystem). And
//! `/proc/1/maps` names bwrap's binary and the shared libraries it loads.
//!
//! When the node runs as root, bwrap itself is started as the workspace's host uid/gid
//! ([`crate::uid_pool`], after joining the cgroup), so the unprivileged user namespace maps
//! the sandbox's uid 1000 to that host uid: files in the workspace are owned by it on the
//! host, the kernel's per-user budgets (inotify instances, processes…) are the workspace's
//! own, and the sandbox holds no host privilege at all. This needs unprivileged user
//! namespaces and a state directory that every uid can traverse.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Instant;

use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use super::netns_gate::{Gate, NetnsHook};
use super::{
    capture, exec_io, seccomp, BackendError, IsolatedError, IsolatedOutput, IsolatedRun,
    PerCommand, ResourceLimits, SandboxBackend, SandboxOutcome, SandboxSpec, SessionSandbox,
};
use crate::config::{BackendKind, BwrapConfig};
use crate::sandbox::SANDBOX_UID_TEXT;

pub mod cgroup;
mod isolated;
pub mod root_view;
mod signal;
pub mod starter;
pub mod warm;
use cgroup::{join_cgroups, Cgroup, CgroupLayout};
pub use isolated::IsolatedBwrap;

/// bubblewrap's entry in the backend registry ([`super::BACKENDS`]): it always gates (the
/// proxy binds in the sandbox's own network namespace), and a stop drains its starters.
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    kind: BackendKind::Bwrap,
    build: |cfg| {
        Arc::new(
            BwrapBackend::new(cfg.bwrap.clone(), super::node_id(cfg))
                .with_root_views(&cfg.state_dir)
                .with_node_limits(cfg.sandbox_uids, ResourceLimits::from_limits(&cfg.limits)),
        )
    },
    can_gate: |_| true,
    describe: super::kind_name,
    shutdown: |_| starter::drain(),
};

/// What runs when an SBA job's image has no explicit command.
pub const SBA_ENTRYPOINT: &str = "/usr/local/bin/cynode-sba";

/// The bubblewrap backend.
#[derive(Debug, Clone)]
pub struct BwrapBackend {
    cfg: BwrapConfig,
    node: String,
    /// This bwrap knows `--disable-userns` (0.8 and later).
    disable_userns: bool,
    /// Pre-spawned starters ([`starter`]), shared by the backend's clones.
    starters: Arc<std::sync::OnceLock<Option<Arc<starter::Starters>>>>,
    /// Warm sandboxes ([`warm`], `bwrap.warm_slots`), shared by the backend's clones.
    warm: Arc<std::sync::OnceLock<Option<Arc<warm::Warm>>>>,
    /// The node's `sandbox_uids` (warm sandboxes are made for these uids only) and its
    /// limits (those of the slots made ahead of any job, [`SandboxBackend::expect_uid`]).
    node_limits: Option<(crate::uid_pool::UidRange, ResourceLimits)>,
    /// The overlays bound as `/` in place of the root filesystem directories
    /// ([`root_view`]); `None` binds the directories themselves.
    root_views: Option<Arc<root_view::RootViews>>,
}

/// The compiled seccomp programs, built once.
fn seccomp_programs() -> Result<&'static [Vec<u8>], BackendError> {
    static PROGS: std::sync::OnceLock<Result<Vec<Vec<u8>>, BackendError>> =
        std::sync::OnceLock::new();
    PROGS
        .get_or_init(|| {
            seccomp::bpf_programs().map_err(|e| BackendError::Unavailable(e.to_string()))
        })
        .as_deref()
        .map_err(Clone::clone)
}

/// A sealed memfd (close-on-exec, no further write, growth or shrinking) named `name`,
/// holding `bytes`, read from its start.
fn sealed_memfd(name: &std::ffi::CStr, bytes: &[u8]) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::io::{Seek, Write};
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: memfd_create with a valid NUL-terminated name.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just created and is owned by nothing else.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.write_all(bytes)?;
    seal(file.as_raw_fd())?;
    file.seek(std::io::SeekFrom::Start(0))?;
    Ok(file.into())
}

/// Seals the memfd `fd` against any change.
fn seal(fd: i32) -> std::io::Result<()> {
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl on a descriptor the caller owns.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// One start of bwrap: its options, with every host path among them (the root filesystem,
/// the job's directories, the node's descriptors), which bwrap reads from a sealed memfd
/// (`--args FD`, [`client_command`]), and the sandbox's command, after `--`. Inside the
/// sandbox PID 1 is bwrap, and its `/proc/1/cmdline` reads `bwrap --args N -- <command>`:
/// nothing of the host. Every bwrap of the node (cold, starter, warm, isolated) starts
/// from one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Invocation {
    pub options: Vec<String>,
    pub command: Vec<String>,
}

impl Invocation {
    /// The options as `--args` reads them: each NUL-terminated. `Err` when one holds a NUL.
    pub fn options_data(&self) -> Result<Vec<u8>, String> {
        let mut out = Vec::with_capacity(self.options.iter().map(|a| a.len() + 1).sum());
        for a in &self.options {
            if a.as_bytes().contains(&0) {
                return Err("a bwrap option holds a NUL byte".into());
            }
            out.extend_from_slice(a.as_bytes());
            out.push(0);
        }
        Ok(out)
    }

    /// bwrap's arguments after the program, its options in descriptor `fd`.
    pub fn argv(&self, fd: i32) -> Vec<String> {
        let mut a = vec!["--args".to_string(), fd.to_string(), "--".to_string()];
        a.extend(self.command.iter().cloned());
        a
    }

    /// A sealed memfd holding [`Invocation::options_data`].
    fn options_memfd(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        let data = self.options_data().map_err(std::io::Error::other)?;
        sealed_memfd(c"cynode-bwrap-args", &data)
    }
}

/// Whether `binary` knows `--disable-userns` (bwrap 0.8 and later); asked once per binary.
pub fn has_disable_userns(binary: &str) -> bool {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static SEEN: Mutex<Option<HashMap<String, bool>>> = Mutex::new(None);
    if let Some(known) = SEEN
        .lock()
        .ok()
        .and_then(|g| g.as_ref().and_then(|m| m.get(binary).copied()))
    {
        return known;
    }
    let has = std::process::Command::new(binary)
        .arg("--help")
        .env_clear()
        .env(
            "PATH",
            std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()),
        )
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("--disable-userns"))
        .unwrap_or(false);
    if let Ok(mut g) = SEEN.lock() {
        g.get_or_insert_with(HashMap::new)
            .insert(binary.to_string(), has);
    }
    has
}

/// What confines one bwrap sandbox besides its namespaces, the same for a job, a session
/// command and a changeset: the seccomp programs (memfds bwrap reads through
/// `--add-seccomp-fd`), `--disable-userns` where bwrap has it, and a cgroup of its own with
/// the node's memory, pids and CPU limits, which bwrap joins before it executes (so even
/// its first child is inside). When the node is root, bwrap starts as the sandbox's host
/// uid (its workspace's, [`crate::uid_pool`]), which the user namespace maps to uid 1000.
/// Dropping it kills whatever is still in the cgroup and removes the cgroup.
pub struct Confinement {
    memfds: Vec<std::os::fd::OwnedFd>,
    fds: Vec<i32>,
    cgroup: Cgroup,
    disable_userns: bool,
    host_uid: u32,
}

impl Confinement {
    /// The seccomp memfds and the cgroup `<node>/<name>` with `limits`, for a sandbox that
    /// runs as `host_uid` on the host.
    pub fn new(
        node: &str,
        name: &str,
        limits: &ResourceLimits,
        disable_userns: bool,
        host_uid: u32,
    ) -> Result<Confinement, BackendError> {
        use std::os::fd::AsRawFd;
        let mut lap = crate::trace::Lap::start();
        let memfds = seccomp_programs()?
            .iter()
            .map(|p| {
                sealed_memfd(c"cynode-seccomp", p).map_err(|e| {
                    BackendError::Unavailable(format!("cannot pass the seccomp filter: {e}"))
                })
            })
            .collect::<Result<Vec<_>, BackendError>>()?;
        let fds = memfds.iter().map(AsRawFd::as_raw_fd).collect();
        let seccomp_us = lap.us();
        let cgroup = Cgroup::create(node, name, limits).map_err(|e| {
            BackendError::Unavailable(format!("cannot create cgroup for limits: {e}"))
        })?;
        tracing::debug!(
            sandbox = name,
            seccomp_us,
            cgroup_create_us = lap.us(),
            "phases: confinement"
        );
        Ok(Confinement {
            memfds,
            fds,
            cgroup,
            disable_userns,
            host_uid,
        })
    }

    /// The bwrap options: `--disable-userns` (where known) and one `--add-seccomp-fd` per
    /// program.
    pub fn args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if self.disable_userns {
            a.push("--disable-userns".into());
        }
        for fd in &self.fds {
            a.extend(["--add-seccomp-fd".into(), fd.to_string()]);
        }
        a
    }

    /// Makes `cmd`, between fork and exec, keep the seccomp fds open, join the cgroup,
    /// become the sandbox user when the node is root, and die with the node.
    pub fn apply(&self, cmd: &mut Command) {
        let procs = self.cgroup.procs_files();
        let inherit = self.fds.clone();
        let host_uid = self.host_uid;
        // SAFETY: geteuid has no preconditions.
        let drop_to_sandbox_user = unsafe { libc::geteuid() } == 0;
        // SAFETY: between fork and exec this only calls getpid/open/write/close on paths
        // prepared before the fork, formats the pid into a stack buffer, clears
        // close-on-exec on fds opened before the fork, and makes the async-signal-safe
        // setgroups/setgid/setuid/prctl syscalls.
        unsafe {
            cmd.pre_exec(move || {
                for fd in &inherit {
                    if libc::fcntl(*fd, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                join_cgroups(&procs)?;
                if drop_to_sandbox_user {
                    become_sandbox_user(host_uid)?;
                }
                super::die_with_node()
            });
        }
    }

    /// After bwrap started (or failed to): the node's copies of the seccomp fds close.
    pub fn started(&mut self) {
        self.memfds.clear();
    }

    /// SIGKILLs every process still in the cgroup.
    pub fn kill_all(&self) {
        self.cgroup.kill_all();
    }

    /// A signaller of the sandbox's command, through its cgroup ([`signal`]).
    fn signaller(&self) -> Option<signal::CgroupSignaller> {
        use std::os::unix::ffi::OsStrExt;
        let procs = self.cgroup.procs_files().into_iter().next()?;
        Some(signal::CgroupSignaller {
            procs: PathBuf::from(std::ffi::OsStr::from_bytes(procs.as_bytes())),
        })
    }
}

impl Drop for Confinement {
    fn drop(&mut self) {
        self.cgroup.kill_all();
        self.cgroup.destroy();
    }
}

impl BwrapBackend {
    /// A backend with `cfg`.
    pub fn new(cfg: BwrapConfig, node: String) -> Self {
        let binary = cfg.binary.clone().unwrap_or_else(|| "bwrap".into());
        let disable_userns = has_disable_userns(&binary);
        Self {
            cfg,
            node,
            disable_userns,
            starters: Arc::default(),
            warm: Arc::default(),
            node_limits: None,
            root_views: None,
        }
    }

    /// Binds, as each sandbox's `/`, a read-only overlay view of its root filesystem
    /// directory attached beneath `state_dir` ([`root_view`]) instead of the directory.
    pub fn with_root_views(mut self, state_dir: &Path) -> Self {
        self.root_views = Some(Arc::new(root_view::RootViews::new(state_dir)));
        self
    }

    /// The node's `sandbox_uids`, the only uids warm sandboxes are made for (none
    /// without), and its limits.
    pub fn with_node_limits(
        mut self,
        uids: crate::uid_pool::UidRange,
        limits: ResourceLimits,
    ) -> Self {
        self.node_limits = Some((uids, limits));
        self
    }

    /// The backend's warm sandboxes, started at their first use (the node's start or its
    /// first job); `None` when off.
    fn warm(&self) -> Option<&warm::Warm> {
        self.warm
            .get_or_init(|| {
                warm::Warm::start(
                    self.binary(),
                    &self.node,
                    self.disable_userns,
                    self.cfg.warm_slots,
                    &self.cfg.pool_waiter,
                    self.node_limits?.0,
                )
            })
            .as_deref()
    }

    fn binary(&self) -> &str {
        self.cfg.binary.as_deref().unwrap_or("bwrap")
    }

    /// The root filesystem directory configured for `image`.
    fn rootfs_dir(&self, image: &str) -> Option<&Path> {
        self.cfg
            .rootfs
            .get(image)
            .map(PathBuf::as_path)
            .filter(|p| p.is_dir())
    }

    /// What bwrap binds as `/` for `image`: the view of its root filesystem directory
    /// ([`root_view`]), or the directory itself.
    pub fn rootfs_for(&self, image: &str) -> Option<PathBuf> {
        self.rootfs_dir(image).map(|dir| self.root_of(dir))
    }

    fn root_of(&self, dir: &Path) -> PathBuf {
        match &self.root_views {
            Some(views) => views.root_for(dir),
            None => dir.to_path_buf(),
        }
    }

    /// The bwrap invocation for `spec` with `rootfs` as `/`, confined by `confinement` (its
    /// [`Confinement::args`]).
    pub fn invocation(
        &self,
        spec: &SandboxSpec,
        rootfs: &Path,
        confinement: &[String],
    ) -> Invocation {
        let mut a = sandbox_args(rootfs, &spec.limits, confinement);
        for m in &spec.mounts {
            let flag = if m.writable { "--bind" } else { "--ro-bind" };
            a.extend([flag.into(), m.host.display().to_string(), m.target.clone()]);
        }
        a.extend(["--chdir".into(), spec.workdir.clone(), "--clearenv".into()]);
        for (k, v) in &spec.env {
            a.extend(["--setenv".into(), k.clone(), v.clone()]);
        }
        let mut command = Vec::new();
        if !spec.override_entrypoint {
            command.push(SBA_ENTRYPOINT.into());
        }
        command.extend(spec.command.iter().cloned());
        Invocation {
            options: a,
            command,
        }
    }

    /// The backend's starter pool, started at its first job; `None` where it cannot run.
    fn starters(&self, spec: &SandboxSpec) -> Option<&starter::Starters> {
        self.starters
            .get_or_init(|| {
                starter::Starters::start(
                    self.binary(),
                    &self.node,
                    spec.limits,
                    self.disable_userns,
                )
            })
            .as_deref()
    }

    /// Starts bwrap for `spec` the cold way: a cgroup made now, joined between fork and
    /// exec; with `gated`, bwrap's info and block pipes ([`Gate`]).
    fn spawn_cold(
        &self,
        spec: &SandboxSpec,
        rootfs: &Path,
        gated: bool,
    ) -> Result<(tokio::process::Child, Confinement, Option<Gate>), String> {
        let mut confinement = Confinement::new(
            &self.node,
            &spec.name,
            &spec.limits,
            self.disable_userns,
            spec.host_uid,
        )
        .map_err(|e| e.to_string())?;
        let mut gate = gated
            .then(Gate::new)
            .transpose()
            .map_err(|e| format!("cannot make bwrap's info and block pipes: {e}"))?;
        let mut args = confinement.args();
        args.extend(gate.iter().flat_map(Gate::args));
        let (mut cmd, options) =
            client_command(self.binary(), &self.invocation(spec, rootfs, &args))
                .map_err(|e| format!("cannot pass bwrap its arguments: {e}"))?;
        // A streamed exec with a stdin: a pipe, fed by [`exec_io::feed`].
        if exec_io::wants_stdin() {
            cmd.stdin(Stdio::piped());
        }
        confinement.apply(&mut cmd);
        if let Some(g) = &gate {
            g.apply(&mut cmd);
        }
        let spawned = cmd.spawn();
        drop(options);
        confinement.started();
        if let Some(g) = &mut gate {
            g.spawned();
        }
        match spawned {
            Ok(c) => Ok((c, confinement, gate)),
            Err(e) => Err(format!("cannot start {}: {e}", self.binary())),
        }
    }

    /// The job handed to an idle warm sandbox of its key ([`warm`]), if there is one and
    /// the claim succeeds (else nothing of it ran, and it starts as before).
    async fn claim_slot(
        &self,
        spec: &SandboxSpec,
        rootfs: &Path,
    ) -> Option<(tokio::process::Child, Confinement)> {
        let w = self.warm()?;
        let slot = w.take(spec, rootfs)?;
        let s = spec.clone();
        let claimed = tokio::task::spawn_blocking(move || slot.claim(&s))
            .await
            .unwrap_or_else(|e| Err(format!("the claim panicked: {e}")));
        match claimed {
            Ok(c) => Some(c),
            Err(e) => {
                w.failed();
                tracing::warn!(sandbox = %spec.name, error = %e, "warm bwrap sandbox not used; starting as before");
                None
            }
        }
    }

    /// Runs the sandbox to the end; with a `hook`, bwrap reports the sandbox's pid and
    /// waits ([`Gate`]) until the hook has run (a failed hook ends it unstarted).
    pub async fn run_with(
        &self,
        spec: &SandboxSpec,
        cancel: &CancellationToken,
        hook: Option<NetnsHook>,
    ) -> SandboxOutcome {
        let started = Instant::now();
        let mut lap = crate::trace::Lap::start();
        let fail = |msg: String| SandboxOutcome::start_failed(msg, started);
        let Some(rootfs) = self.rootfs_for(&spec.image) else {
            return fail(format!(
                "no root filesystem configured for image `{}`",
                spec.image
            ));
        };
        // A warm sandbox of the workspace's uid, else a pre-spawned starter (already in
        // its cgroup), when the job needs no gate and no stdin (theirs is `/dev/null`).
        let cold_only = hook.is_some() || exec_io::wants_stdin();
        let from_slot = match cold_only {
            false => self.claim_slot(spec, &rootfs).await,
            true => None,
        };
        let warm_slot = from_slot.is_some();
        let warm = match (cold_only, &from_slot) {
            (false, None) => self.starters(spec).and_then(|p| p.take(&spec.limits)),
            _ => None,
        };
        let started_warm = match warm {
            Some(t) => {
                let inv = self.invocation(spec, &rootfs, &t.confinement_args());
                match t.start(&spec.name, &inv, spec.host_uid) {
                    Ok(c) => Some(c),
                    Err(e) => {
                        tracing::warn!(sandbox = %spec.name, error = %e, "bwrap starter not used; starting cold");
                        None
                    }
                }
            }
            None => None,
        };
        let (mut child, mut confinement, gate) = match (from_slot, started_warm) {
            (Some((child, confinement)), _) => (child, confinement, None),
            (None, Some(c)) => (c.child, c.confinement, None),
            (None, None) => match self.spawn_cold(spec, &rootfs, hook.is_some()) {
                Ok(x) => x,
                Err(e) => return fail(e),
            },
        };
        confinement.started();
        let pgid = child.id().map(|p| p as i32);
        let start_us = lap.us();
        if let (Some(gate), Some(hook)) = (gate, hook) {
            let ready = match gate.child_pid().await {
                Ok(pid) => hook(pid).await,
                Err(e) => Err(e),
            };
            // On failure the gate stays open until the sandbox is dead: a closed block fd
            // would let its command run.
            let (released, gate) = match ready {
                Ok(()) => (
                    gate.release()
                        .map_err(|e| format!("cannot release the sandbox: {e}")),
                    None,
                ),
                Err(e) => (Err(e), Some(gate)),
            };
            if let Err(e) = released {
                if let Some(pg) = pgid {
                    // SAFETY: signalling the process group we created.
                    unsafe {
                        libc::kill(-pg, libc::SIGKILL);
                    }
                }
                confinement.kill_all();
                let _ = child.wait().await;
                drop(gate);
                return fail(e);
            }
        }
        let hook_us = lap.us();
        // A streamed exec: its stdin and signals ([`exec_io`]).
        exec_io::feed(child.stdin.take());
        if let Some(s) = confinement.signaller().filter(|_| exec_io::in_scope()) {
            exec_io::attach(Arc::new(s)).await;
        }
        let out = capture::spawn_stdout(child.stdout.take(), spec.output_cap);
        let err = capture::spawn_stderr(child.stderr.take(), spec.output_cap);
        let (status, end) = super::wait_or_stop(&mut child, spec.timeout, cancel).await;
        let wait_us = lap.us();
        let status = match status {
            Some(s) => Some(s),
            None => {
                if let Some(pg) = pgid {
                    // SAFETY: signalling the process group we created.
                    unsafe {
                        libc::kill(-pg, libc::SIGKILL);
                    }
                }
                confinement.kill_all();
                child.wait().await.ok()
            }
        };
        confinement.kill_all();
        let kill_us = lap.us();
        use std::os::unix::process::ExitStatusExt;
        let exit_code = status.and_then(|s| s.code().or_else(|| s.signal().map(|sig| 128 + sig)));
        let outcome = SandboxOutcome::collected(exit_code, out, err, end, started).await;
        let collect_us = lap.us();
        drop(confinement);
        tracing::debug!(sandbox = %spec.name, warm_slot, start_us, hook_us, wait_us, kill_us, collect_us, cgroup_remove_us = lap.us(), "phases: bwrap");
        outcome
    }
}

#[async_trait::async_trait]
impl SandboxBackend for BwrapBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Bwrap
    }

    /// The starters' and the warm sandboxes' figures (nothing for a pool never started).
    fn write_metrics(&self, _label: &str, out: &mut String) {
        out.push_str(&starter::metrics_text());
        out.push_str(&warm::metrics_text());
    }

    /// bwrap runs, and cgroups are usable for limits.
    async fn check(&self) -> Result<String, BackendError> {
        let out = super::client_env(&mut Command::new(self.binary()))
            .arg("--version")
            .output()
            .await
            .map_err(|e| BackendError::Client(format!("{} not runnable: {e}", self.binary())))?;
        if !out.status.success() {
            return Err(BackendError::Refused(format!(
                "{} --version failed",
                self.binary()
            )));
        }
        let limits = match Cgroup::layout() {
            Some(CgroupLayout::V2) => "cgroup v2 limits",
            Some(CgroupLayout::V1) => "cgroup v1 limits",
            None => {
                return Err(BackendError::Unavailable(
                    "no writable cgroup hierarchy for memory/pids/cpu limits".into(),
                ))
            }
        };
        seccomp_programs()?;
        let userns = if self.disable_userns {
            ", --disable-userns"
        } else {
            ""
        };
        let warm = match self.cfg.warm_slots {
            0 => String::new(),
            n if !rustix::process::geteuid().is_root() => {
                format!(", warm_slots {n} unused (the node is not root)")
            }
            n if !self.cfg.pool_waiter.is_file() => format!(
                ", warm_slots {n} unused (no pool waiter at {}: deploy/worker/build-waiter.sh)",
                self.cfg.pool_waiter.display()
            ),
            n => format!(", {n} warm sandboxes"),
        };
        Ok(format!(
            "{}, {limits}, seccomp{userns}{warm}",
            String::from_utf8_lossy(&out.stdout).trim()
        ))
    }

    async fn has_image(&self, image: &str) -> bool {
        self.rootfs_dir(image).is_some()
    }

    /// Runs the sandbox to the end.
    async fn run(&self, spec: &SandboxSpec, cancel: &CancellationToken) -> SandboxOutcome {
        self.run_with(spec, cancel, None).await
    }

    async fn run_gated(
        &self,
        spec: &SandboxSpec,
        cancel: &CancellationToken,
        hook: NetnsHook,
    ) -> SandboxOutcome {
        self.run_with(spec, cancel, Some(hook)).await
    }

    /// Warm sandboxes for a new workspace's uid, one per configured image, with the
    /// node's limits (when they are on).
    fn expect_uid(&self, uid: u32) {
        let (Some(w), Some((_, limits))) = (self.warm(), self.node_limits) else {
            return;
        };
        for dir in self.cfg.rootfs.values().filter(|p| p.is_dir()) {
            w.expect(uid, &self.root_of(dir), limits);
        }
    }

    /// Kills and removes what a previous run left in the node's sandbox cgroups.
    async fn remove_all_managed(&self) -> usize {
        let node = self.node.clone();
        tokio::task::spawn_blocking(move || cgroup::remove_node_cgroups(&node))
            .await
            .unwrap_or(0)
    }

    /// Nothing of a bwrap sandbox outlives its run but its cgroup, which
    /// [`SandboxBackend::remove_all_managed`] removes.
    async fn remove_named(&self, _name: &str) {}

    /// bubblewrap has no natural long-lived sandbox: each command of a session is a fresh
    /// sandbox over the same workspace ([`PerCommand`]).
    async fn start_session(
        &self,
        _spec: &SandboxSpec,
    ) -> Result<Arc<dyn SessionSandbox>, BackendError> {
        Ok(Arc::new(PerCommand(self.clone())))
    }

    async fn run_isolated(&self, run: IsolatedRun) -> Result<IsolatedOutput, IsolatedError> {
        IsolatedBwrap::new(
            self.binary().to_string(),
            self.node.clone(),
            Some(self.disable_userns),
        )
        .run(run)
        .await
    }
}

/// bwrap `binary` started as `inv` says, as a sandbox's client: its options in a sealed
/// memfd (`--args`, left open across exec; the caller drops the returned descriptor once
/// bwrap is spawned), an empty environment (bwrap needs none: the sandbox's is set by
/// `--clearenv` and `--setenv`, and bwrap is PID 1 inside, its environ readable there),
/// `bwrap` as its argv\[0\] (not the binary's path), stdin `/dev/null`, stdout and stderr piped, a process group of its own, killed when
/// dropped.
fn client_command(
    binary: &str,
    inv: &Invocation,
) -> std::io::Result<(Command, std::os::fd::OwnedFd)> {
    use std::os::fd::AsRawFd;
    let options = inv.options_memfd()?;
    let fd = options.as_raw_fd();
    super::record_node_pid();
    let mut cmd = Command::new(starter::resolve(binary).unwrap_or_else(|| binary.into()));
    cmd.arg0("bwrap")
        .env_clear()
        .args(inv.argv(fd))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    // SAFETY: between fork and exec this only clears close-on-exec (fcntl) on a
    // descriptor opened before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok((cmd, options))
}

/// A job's bwrap arguments up to its own parts (mounts, working directory, environment,
/// command): the isolation, `confinement`'s options, the read-only root, /dev, /proc and
/// the tmpfs /tmp of `limits`' size. A warm sandbox ([`warm`]) is made with exactly these.
pub fn sandbox_args(rootfs: &Path, limits: &ResourceLimits, confinement: &[String]) -> Vec<String> {
    let mut a = isolation_args("sandbox");
    a.extend(confinement.iter().cloned());
    a.extend(["--ro-bind".into(), rootfs.display().to_string(), "/".into()]);
    a.extend(["--dev", "/dev", "--proc", "/proc"].map(String::from));
    a.extend([
        "--size".into(),
        (limits.tmpfs_mb * 1024 * 1024).to_string(),
        "--tmpfs".into(),
        "/tmp".into(),
    ]);
    a
}

/// The isolation every bwrap sandbox of the node starts with: every namespace new (no
/// network), uid/gid 1000 inside, all capabilities dropped, a new session, and death with
/// the parent.
pub fn isolation_args(hostname: &str) -> Vec<String> {
    [
        "--unshare-all",
        "--unshare-user",
        "--die-with-parent",
        "--new-session",
        "--uid",
        SANDBOX_UID_TEXT,
        "--gid",
        SANDBOX_UID_TEXT,
        "--hostname",
        hostname,
        "--cap-drop",
        "ALL",
    ]
    .map(String::from)
    .to_vec()
}

/// Drops from root to uid/gid `id` with no supplementary groups (between fork and exec).
fn become_sandbox_user(id: u32) -> std::io::Result<()> {
    // SAFETY: plain syscalls on integers; called in the forked child only.
    unsafe {
        if libc::setgroups(0, std::ptr::null()) != 0
            || libc::setgid(id) != 0
            || libc::setuid(id) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_go_through_the_descriptor_and_only_the_command_after_it() {
        let inv = Invocation {
            options: ["--ro-bind", "/srv/rootfs", "/", "--setenv", "A", ""]
                .map(String::from)
                .to_vec(),
            command: ["sh", "-c", "echo --bind /x /y"].map(String::from).to_vec(),
        };
        assert_eq!(
            inv.options_data().unwrap(),
            b"--ro-bind\0/srv/rootfs\0/\0--setenv\0A\0\0".to_vec()
        );
        assert_eq!(
            inv.argv(7),
            ["--args", "7", "--", "sh", "-c", "echo --bind /x /y"].map(String::from)
        );
        let nul = Invocation {
            options: vec!["--chdir".into(), "/a\0b".into()],
            command: vec!["true".into()],
        };
        assert!(nul.options_data().is_err());
    }

    #[test]
    fn the_options_memfd_is_sealed_and_read_from_its_start() {
        use std::io::Read;
        use std::os::fd::AsRawFd;
        let inv = Invocation {
            options: vec!["--unshare-all".into()],
            command: vec![],
        };
        let fd = inv.options_memfd().unwrap();
        // SAFETY: fcntl on a descriptor this test owns.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        let all = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
        assert_eq!(seals & all, all);
        let mut f = std::fs::File::from(fd);
        let mut got = Vec::new();
        f.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"--unshare-all\0");
        use std::io::Write;
        assert!(f.write_all(b"x").is_err());
    }
}
