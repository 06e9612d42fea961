//! The warm pool of the OCI engines (Podman, Docker): `pool_size` pre-started containers per
//! (image, limits), each serving exactly one job and destroyed after it.
//!
//! **Why.** A cold job pays `podman run` (the CLI, the image's layers mounted, runc, conmon):
//! about 115 ms on a quiet machine, 500+ ms under load. A pooled container has paid all of
//! it before the job comes; a claim needs no engine CLI call at all.
//!
//! **A pooled container** is created with the same flags as a cold job
//! ([`super::EngineBackend::run_args`]: `--rm`, the node's managed label, so startup
//! reconciliation removes it, the runtime, `--pull=never`, the node's seccomp profile,
//! `--network=none`, `--read-only`, no-new-privileges, the ulimits, memory/CPU limits, the
//! tmpfs /tmp) with these differences, each needed for the claim:
//! - `--user=0:0` with `--cap-drop=ALL --cap-add=SETUID,SETGID,SETPCAP`: its PID 1 is
//!   `cynode-pool-waiter` (the `poolwaiter` crate, static), which drops to the job's uid
//!   itself. So one pool serves every workspace (each has its own host uid,
//!   [`crate::uid_pool`]); keying the pool by uid as well would leave it cold for every
//!   workspace's first job and keep idle containers per workspace. The waiter removes every
//!   capability from the bounding set (SETPCAP), sets the job's gid as its only group, its gid and uid (which clears
//!   the permitted, effective and ambient sets; it checks with capget and refuses to start
//!   the job otherwise), sets no_new_privs and execs the job under the same seccomp profile
//!   (the container's, inherited). The job then has exactly a cold job's credentials:
//!   uid = gid = the workspace's, no capabilities, an empty bounding set.
//! - `--pids-limit` is one higher: the waiter stays as PID 1, so the job keeps `pids`.
//!   Memory: the waiter's resident size (about 100 KiB) is charged to the job's limit.
//! - `/job` and `/workspace` are empty root-owned placeholders (the job's are unknown
//!   until the claim), and the slot's directory `<state>/pool/<name>/` (the waiter binary
//!   and the control socket) is mounted read-only at `/.cynode`.
//! - No task/job labels (unknown at creation): the container is `cynode-pool-<n>`, labelled
//!   `io.cynode.pool=1`; the worker logs which job a slot served.
//!
//! **The control channel.** The worker binds `<slot>/ctl.sock` (root, 0600) before the
//! container starts. The waiter connects and says it is ready; the worker accepts once,
//! unlinks the socket's name and closes the listener, so nothing else can ever connect. It
//! takes the waiter's host pid from `SO_PEERCRED` and keeps a pidfd of it.
//!
//! **A claim** (no CLI call, a few milliseconds):
//! 1. `open_tree(OPEN_TREE_CLONE | AT_RECURSIVE)` of the job directory and the workspace on
//!    the host (their disk volumes included), `nosuid,nodev` (and read-only where the
//!    spec says so) set on the detached copies.
//! 2. On a fresh thread (`unshare(CLONE_FS)`, then `setns` into the container's mount
//!    namespace through the pidfd): its placeholder is unmounted and the copy `move_mount`ed onto the directory beneath
//!    (opened `O_PATH|O_NOFOLLOW`, so an image's symlink is not followed), and `/.cynode`
//!    is unmounted (detached). No host mount is made (under runc: gVisor's are below):
//!    nothing under the state directory stays mounted, and the mounts go with the
//!    container's namespace. The rslave
//!    propagation alternative would keep a shared mount per idle slot on the host and
//!    depends on the engine daemon's mount namespace (dockerd's); this does neither.
//! 3. The job (uid, gid, cwd, argv, env) goes to the waiter with the write ends of two
//!    fresh pipes as its stdout and stderr (`SCM_RIGHTS`); the worker drains the read ends
//!    exactly as a cold job's client output ([`crate::backend::capture`]).
//! 4. The waiter reports `S` when the job runs (or `F`: exec failed, exit 127/126 as the
//!    engines give) and `X` with its exit code (128 + signal when killed), then exits;
//!    as PID 1 its exit ends the container (the kernel kills what the job left), and
//!    `--rm` removes it. The worker reaps the client in the background.
//!
//! The argv is the engines' rule: a job that replaces the entrypoint runs its command;
//! otherwise the image's `Entrypoint` plus the command (or the image's `Cmd` when there is
//! none), read once per image with `image inspect` (off the hot path). The environment is
//! the waiter's own (the image's and the engine's, as a cold container gets it) with
//! `HOME` of the job's uid (from the image's /etc/passwd, else `/`), then the job's.
//!
//! **What the job can reach.** Nothing of the channel: the socket's name is gone, its
//! directory unmounted, and the waiter (root, non-dumpable, the namespace's init) can be
//! neither signalled nor ptraced nor have its `/proc/1/fd` opened by the job's uid. The
//! waiter's descriptors are close-on-exec; the job gets stdin `/dev/null` and its two pipes.
//!
//! **Timeouts, cancel, the disk guard**: as cold jobs. The run waits for the waiter's
//! report, the timeout or the cancel token; on the last two the container is killed and
//! removed (`stop_and_remove`, the same as a cold job's, CLI off the hot path). A
//! container that dies before it reports ends the job with its client's exit code, as a
//! cold one. The disk guard watches the same host directories.
//!
//! **Jobs with an egress proxy** (`run_gated`) take a slot too: its waiter's namespaces
//! exist and nothing of the job runs until the claim, so the hook binds the proxy in the
//! slot's network namespace (the pid from `SO_PEERCRED`, checked alive through the pidfd
//! before and after the hook) before the job is sent. When none is idle (or the pool is
//! off), a slot is made for the job ([`Pool::fresh`]): Docker has no `init` to hold a cold
//! container between its creation and its command, and on Podman it is faster than
//! `create`, `init`, `start` was (+171 ms over a cold job without network; this way -62
//! ms on Podman, -40 to -49 ms on Docker: `worker/benches/egress_engines.sh`).
//!
//! **Under gVisor** (`runtime: runsc`) steps 2 and 3 differ: the sentry has a VFS of its
//! own whose mount roots are opened at creation, so a mount put on a placeholder
//! afterwards never appears inside, and descriptors of host pipes are not imported. The
//! clones go onto the slot's shared staging directory on the host instead, the waiter
//! binds them inside, and the job's output comes over two more host sockets
//! ([`gvisor`]; the waiter's side in `poolwaiter/src/gvisor.rs`). There `SO_PEERCRED`
//! names a process of gVisor's (the sandbox), not the waiter: [`Slot::pid`] and
//! [`Slot::alive`] are used only for gated jobs, which gVisor refuses.
//!
//! **Sessions** (runc/crun) claim a slot too, or have one made for them: its waiter then
//! stays PID 1 as the session's uid and runs each command itself ([`session`]). **Not
//! pooled**: gVisor's sessions, and mounts other than `/job` and `/workspace`.
//!
//! **Bounds and refill.** At most `pool_size` idle or starting containers per key, and at
//! most [`MAX_KEYS`] keys (the least recently claimed key's idle containers go first). A
//! claim takes an idle container (checking its client still runs) and starts a refill in
//! the background; a miss starts one too and the job runs cold. A failed creation backs
//! off before the next. Idle containers end with the node: their waiter reads end of file
//! on its socket when the worker's process is gone (even after SIGKILL), exits, and the
//! container is removed (`--rm`); reconciliation at the next start removes any left.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use super::EngineBackend;
use crate::backend::{SandboxSpec, MANAGED_LABEL};
use crate::sandbox::{JOB_MOUNT, WORKSPACE_MOUNT};

mod gvisor;
mod inject;
mod session;
pub use gvisor::{remove_slot_dir, unmount_beneath};
use inject::{inject, Identity};
pub use session::WarmSession;

/// The label every pooled container carries (besides the node's).
pub const POOL_LABEL: &str = "io.cynode.pool";
/// Where the slot's directory appears in the container.
const CTL_MOUNT: &str = "/.cynode";
/// The waiter's name in the slot directory.
const WAITER_NAME: &str = "cynode-pool-waiter";
/// The control socket's name in the slot directory.
const SOCKET_NAME: &str = "ctl.sock";
/// How long a container may take to start and connect.
const READY_BOUND: Duration = Duration::from_secs(90);
/// At most this many keys (image and limits) have a pool at once.
pub const MAX_KEYS: usize = 4;
/// The host threads a warm gVisor container's limit allows beyond a cold one's.
const GVISOR_EXTRA_THREADS: u64 = 64;
/// After a failed creation, the key's refill waits this long.
const BACKOFF: Duration = Duration::from_secs(5);

/// What fixes a container at creation: the image and the limits (engine, runtime, seccomp
/// profile and node are the backend's own).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    pub image: String,
    memory_mb: u64,
    pids: u64,
    cpus_bits: u64,
    tmpfs_mb: u64,
}

impl Key {
    /// The key of `spec`.
    pub fn of(spec: &SandboxSpec) -> Key {
        let l = &spec.limits;
        Key {
            image: spec.image.clone(),
            memory_mb: l.memory_mb,
            pids: l.pids,
            cpus_bits: l.cpus.to_bits(),
            tmpfs_mb: l.tmpfs_mb,
        }
    }
}

/// Counters and gauges for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// `pool_size`: idle containers kept per key.
    pub size: u64,
    pub idle: u64,
    pub starting: u64,
    /// Jobs and sessions that got a pooled container.
    pub claims: u64,
    /// Jobs and sessions that found none (a job ran cold, a session got one made for it).
    pub misses: u64,
    /// Containers that failed to start or to take their job.
    pub failures: u64,
}

impl PoolStats {
    /// The figures in Prometheus text format, each series labelled `backend="<label>"`.
    pub fn write_metrics(&self, label: &str, out: &mut String) {
        use std::fmt::Write;
        let series: [(&str, &str, &str, u64); 6] = [
            (
                "pool_size",
                "gauge",
                "warm containers kept per image (pool_size)",
                self.size,
            ),
            (
                "pool_idle",
                "gauge",
                "warm containers waiting for a job",
                self.idle,
            ),
            (
                "pool_starting",
                "gauge",
                "warm containers being started",
                self.starting,
            ),
            (
                "pool_claims_total",
                "counter",
                "jobs and sessions started in a warm container",
                self.claims,
            ),
            (
                "pool_misses_total",
                "counter",
                "jobs and sessions that found no warm container (started cold, or in one made for them)",
                self.misses,
            ),
            (
                "pool_failures_total",
                "counter",
                "warm containers that failed to start or to take a job",
                self.failures,
            ),
        ];
        for (name, kind, help, v) in series {
            let _ = write!(
                out,
                "# HELP cynode_worker_{name} {help}\n# TYPE cynode_worker_{name} {kind}\ncynode_worker_{name}{{backend=\"{label}\"}} {v}\n",
            );
        }
    }
}

/// The pool.
#[derive(Debug, Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    size: usize,
    dir: PathBuf,
    waiter: PathBuf,
    images: Vec<String>,
    seq: AtomicU64,
    state: Mutex<State>,
    claims: AtomicU64,
    misses: AtomicU64,
    failures: AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    idle: HashMap<Key, Vec<Slot>>,
    starting: HashMap<Key, usize>,
    /// When each key was last claimed or missed (which key goes when [`MAX_KEYS`] is hit).
    used: HashMap<Key, Instant>,
    backoff: HashMap<Key, Instant>,
    /// Each image's entrypoint and cmd.
    images: HashMap<String, ImageArgs>,
}

/// An image's `Entrypoint`, `Cmd` and `HOME`, and the engine's `HOME` for a uid without
/// one (Podman: the working directory of the passwd entry it adds; Docker: `/`).
#[derive(Debug, Clone, Default)]
struct ImageArgs {
    entrypoint: Vec<String>,
    cmd: Vec<String>,
    home: Option<String>,
    podman: bool,
}

/// A started container waiting for its job.
#[derive(Debug)]
pub struct Slot {
    pub name: String,
    dir: PathBuf,
    child: tokio::process::Child,
    sock: UnixStream,
    /// The waiter's host pid (from `SO_PEERCRED`) and a pidfd of it.
    pid: u32,
    pidfd: OwnedFd,
    args: ImageArgs,
    /// gVisor: the job's stdout and stderr sockets, which the waiter copies its pipes to.
    output: Option<[UnixStream; 2]>,
}

/// A warm job's stdout or stderr, as the worker reads it: the read end of a pipe whose
/// write end the job has (runc), or a socket the waiter copies the job's pipe to (gVisor).
pub type Output = Box<dyn tokio::io::AsyncRead + Send + Unpin>;

/// How a warm run went.
#[derive(Debug)]
pub enum Claimed {
    /// The job runs in the slot's container: its stdout/stderr pipes and what to wait on.
    Running(Box<Running>),
    /// The slot could not take the job (the container died, a mount failed); nothing of
    /// the job ran. The caller runs it cold.
    Failed(String),
    /// The job was sent but the waiter never said it runs: it may have started, so it is
    /// not run again.
    Lost(String),
}

/// A job started in a pooled container.
pub struct Running {
    pub name: String,
    pub child: tokio::process::Child,
    pub sock: UnixStream,
    pub stdout: Output,
    pub stderr: Output,
    pub dir: PathBuf,
    /// Claim to the job's exec (the waiter's `S`).
    pub to_start: Duration,
    /// Whether exec failed (`F`); the exit code follows.
    pub exec_failed: bool,
}

impl Pool {
    /// A pool of `size` containers per key under `<state>/pool`, started with `waiter`;
    /// `images` are filled at startup.
    pub fn new(size: usize, state_dir: &Path, waiter: PathBuf, images: Vec<String>) -> Pool {
        Pool {
            inner: Arc::new(Inner {
                size,
                dir: state_dir.join("pool"),
                waiter,
                images,
                seq: AtomicU64::new(0),
                state: Mutex::new(State::default()),
                claims: AtomicU64::new(0),
                misses: AtomicU64::new(0),
                failures: AtomicU64::new(0),
            }),
        }
    }

    /// The configured size per key (0: off).
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// The waiter binary.
    pub fn waiter(&self) -> &Path {
        &self.inner.waiter
    }

    /// The images filled at startup.
    pub fn images(&self) -> &[String] {
        &self.inner.images
    }

    /// Counters and gauges.
    pub fn stats(&self) -> PoolStats {
        let (idle, starting) = self
            .inner
            .state
            .lock()
            .map(|s| {
                (
                    s.idle.values().map(Vec::len).sum::<usize>(),
                    s.starting.values().sum::<usize>(),
                )
            })
            .unwrap_or((0, 0));
        PoolStats {
            size: self.inner.size as u64,
            idle: idle as u64,
            starting: starting as u64,
            claims: self.inner.claims.load(Ordering::Relaxed),
            misses: self.inner.misses.load(Ordering::Relaxed),
            failures: self.inner.failures.load(Ordering::Relaxed),
        }
    }

    /// Counts a pooled container that could not take its job and removes its slot
    /// directory (the caller has removed the container first: its gVisor mounts go
    /// with it).
    pub async fn failed(&self, name: &str) {
        self.inner.failures.fetch_add(1, Ordering::Relaxed);
        let dir = self.inner.dir.join(name);
        let _ = tokio::task::spawn_blocking(move || remove_slot_dir(&dir)).await;
    }

    /// Removes the slot directories of a previous run (their containers are gone:
    /// reconciliation removed every managed container first) and makes the pool's
    /// directory, root's only.
    pub fn reset_dir(&self) {
        // A gVisor slot's staging mounts of a killed node go first, and never through a
        // recursive removal: it would delete the workspaces they show.
        gvisor::remove_pool_dir(&self.inner.dir);
        let _ = self.ensure_dir();
    }

    /// The pool's directory (root's only) and its empty placeholder, if missing.
    fn ensure_dir(&self) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let empty = self.inner.dir.join("empty");
        if empty.is_dir() {
            return Ok(());
        }
        std::fs::create_dir_all(&empty)?;
        std::fs::set_permissions(&self.inner.dir, std::fs::Permissions::from_mode(0o711))?;
        std::fs::set_permissions(&empty, std::fs::Permissions::from_mode(0o555))
    }

    /// An idle container for `spec`, or `None` (a miss, counted). Starts a refill either
    /// way. `None` too when the spec does not fit a pooled container (mounts other than
    /// `/job` and `/workspace`, or no argv), uncounted.
    pub fn claim(&self, engine: &EngineBackend, spec: &SandboxSpec) -> Option<Slot> {
        if !poolable(spec) {
            return None;
        }
        let key = Key::of(spec);
        let found = {
            let Ok(mut st) = self.inner.state.lock() else {
                return None;
            };
            st.used.insert(key.clone(), Instant::now());
            let mut found = None;
            if let Some(list) = st.idle.get_mut(&key) {
                while let Some(mut slot) = list.pop() {
                    if matches!(slot.child.try_wait(), Ok(None)) {
                        found = Some(slot);
                        break;
                    }
                    self.discard(engine, slot);
                }
            }
            found
        };
        match &found {
            Some(_) => self.inner.claims.fetch_add(1, Ordering::Relaxed),
            None => self.inner.misses.fetch_add(1, Ordering::Relaxed),
        };
        self.refill(engine, &key, spec);
        found
    }

    /// A container started now for `spec`, outside the pool's counts: for a gated job
    /// when none is idle ([`super::EngineBackend::run_gated`]), and for a session (then
    /// named `spec.name`, [`WarmSession`]). It carries `spec`'s labels. Works with
    /// `pool_size` 0.
    pub async fn fresh(
        &self,
        engine: &EngineBackend,
        spec: &SandboxSpec,
        named: bool,
    ) -> Result<Slot, String> {
        if !poolable(spec) {
            return Err("the sandbox has mounts a pooled container cannot take".into());
        }
        self.ensure_dir()
            .map_err(|e| format!("cannot make {}: {e}", self.inner.dir.display()))?;
        let name = if named {
            spec.name.clone()
        } else {
            self.next_name()
        };
        self.create(engine, &Key::of(spec), spec, name).await
    }

    /// Starts containers in the background until `key` has `size` idle or starting.
    pub fn refill(&self, engine: &EngineBackend, key: &Key, spec: &SandboxSpec) {
        let want = {
            let Ok(mut st) = self.inner.state.lock() else {
                return;
            };
            if st.backoff.get(key).is_some_and(|t| t.elapsed() < BACKOFF) {
                return;
            }
            self.evict_keys(engine, &mut st, key);
            let idle = st.idle.get(key).map_or(0, Vec::len);
            let starting = st.starting.entry(key.clone()).or_insert(0);
            let want = self.inner.size.saturating_sub(idle + *starting);
            *starting += want;
            want
        };
        // An idle container serves any sandbox of its key: it carries no job's labels.
        let mut unlabelled = spec.clone();
        unlabelled.labels.clear();
        for _ in 0..want {
            let (pool, engine, key, spec) = (
                self.clone(),
                engine.clone(),
                key.clone(),
                unlabelled.clone(),
            );
            tokio::spawn(async move {
                let name = pool.next_name();
                let made = pool.create(&engine, &key, &spec, name).await;
                let Ok(mut st) = pool.inner.state.lock() else {
                    return;
                };
                if let Some(n) = st.starting.get_mut(&key) {
                    *n = n.saturating_sub(1);
                }
                match made {
                    Ok(slot) => {
                        tracing::debug!(image = %key.image, slot = %slot.name, "pooled container ready");
                        st.idle.entry(key).or_default().push(slot);
                    }
                    Err(e) => {
                        pool.inner.failures.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(image = %key.image, error = %e, "pooled container failed to start");
                        st.backoff.insert(key, Instant::now());
                    }
                }
            });
        }
    }

    /// Fills the pool for the configured images and waits (bounded) until they are full.
    pub async fn prewarm(&self, engine: &EngineBackend, template: &SandboxSpec) {
        if self.inner.size == 0 || self.inner.images.is_empty() {
            return;
        }
        for image in &self.inner.images {
            let mut spec = template.clone();
            spec.image = image.clone();
            let key = Key::of(&spec);
            self.refill(engine, &key, &spec);
        }
        let until = Instant::now() + READY_BOUND;
        while Instant::now() < until {
            let s = self.stats();
            if s.starting == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let s = self.stats();
        tracing::info!(idle = s.idle, failures = s.failures, "warm pool filled");
    }

    /// With [`MAX_KEYS`] keys pooled and `key` new, the least recently used other key's
    /// idle containers go.
    fn evict_keys(&self, engine: &EngineBackend, st: &mut State, key: &Key) {
        let pooled: Vec<Key> = st
            .idle
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, _)| k.clone())
            .collect();
        if pooled.contains(key) || pooled.len() < MAX_KEYS {
            return;
        }
        let oldest = pooled
            .into_iter()
            .min_by_key(|k| st.used.get(k).copied().unwrap_or_else(Instant::now));
        if let Some(old) = oldest {
            for slot in st.idle.remove(&old).unwrap_or_default() {
                self.discard(engine, slot);
            }
        }
    }

    /// Removes a slot's container and directory in the background.
    pub fn discard(&self, engine: &EngineBackend, slot: Slot) {
        let engine = engine.clone();
        tokio::spawn(async move {
            let Slot {
                name,
                dir,
                mut child,
                sock,
                ..
            } = slot;
            drop(sock);
            engine.force_remove(&name).await;
            let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
            let _ = tokio::task::spawn_blocking(move || remove_slot_dir(&dir)).await;
        });
    }

    /// Ends a slot after its job: the container ends when its waiter exits (it does after
    /// reporting); the client is reaped in the background, and the container removed if it
    /// is still there after a while.
    pub fn finish(
        engine: &EngineBackend,
        name: String,
        mut child: tokio::process::Child,
        dir: PathBuf,
    ) {
        let engine = engine.clone();
        tokio::spawn(async move {
            // A gVisor slot's job mounts go now: the job has ended.
            let staged = dir.clone();
            let _ = tokio::task::spawn_blocking(move || gvisor::unmount_beneath(&staged)).await;
            if tokio::time::timeout(Duration::from_secs(30), child.wait())
                .await
                .is_err()
            {
                engine.force_remove(&name).await;
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
            let _ = tokio::task::spawn_blocking(move || remove_slot_dir(&dir)).await;
        });
    }

    fn next_name(&self) -> String {
        let n = self.inner.seq.fetch_add(1, Ordering::SeqCst);
        format!("cynode-pool-{}-{n}", std::process::id())
    }

    /// Starts one container for `key` and waits for its waiter to connect.
    async fn create(
        &self,
        engine: &EngineBackend,
        key: &Key,
        spec: &SandboxSpec,
        name: String,
    ) -> Result<Slot, String> {
        let args = self.image_args(engine, &key.image).await?;
        let dir = self.inner.dir.join(&name);
        let result = self.start(engine, spec, &name, &dir, args).await;
        if result.is_err() {
            engine.force_remove(&name).await;
            let _ = tokio::task::spawn_blocking(move || remove_slot_dir(&dir)).await;
        }
        result
    }

    async fn start(
        &self,
        engine: &EngineBackend,
        spec: &SandboxSpec,
        name: &str,
        dir: &Path,
        args: ImageArgs,
    ) -> Result<Slot, String> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let waiter = dir.join(WAITER_NAME);
        if std::fs::hard_link(&self.inner.waiter, &waiter).is_err() {
            std::fs::copy(&self.inner.waiter, &waiter).map_err(|e| {
                format!(
                    "cannot place the pool waiter {} (build it with deploy/worker/build-waiter.sh): {e}",
                    self.inner.waiter.display()
                )
            })?;
            let _ = std::fs::set_permissions(&waiter, std::fs::Permissions::from_mode(0o555));
        }
        let gvisor = engine.gvisor();
        let outputs = if gvisor {
            gvisor::prepare(dir).map_err(|e| format!("cannot prepare the gVisor slot: {e}"))?;
            let mut l = Vec::new();
            for name in gvisor::OUTPUT_SOCKETS {
                l.push(
                    bind_socket(dir, name)
                        .map_err(|e| format!("cannot bind the output socket {name}: {e}"))?,
                );
            }
            l
        } else {
            Vec::new()
        };
        let listener = bind_socket(dir, SOCKET_NAME)
            .map_err(|e| format!("cannot bind the control socket: {e}"))?;
        let mut cmd = engine.command();
        cmd.args(engine.pool_args(spec, name, dir, &self.inner.dir.join("empty")));
        cmd.stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        // Unlike a job's client, this one neither dies with the node nor shares its
        // process group: killed between the runtime's create and start, it would leave the
        // container created, its `runc init` waiting for a start forever (two were found
        // so, after their test killed its node's group). Left alone, it starts the
        // container, whose waiter finds no listener (or EOF) and exits, `--rm` removes it,
        // and the client exits too.
        cmd.process_group(0);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", engine.binary()))?;
        let stderr = crate::backend::capture::spawn(child.stderr.take(), 4096);
        let accepted = tokio::select! {
            a = tokio::time::timeout(READY_BOUND, listener.accept()) => a,
            s = child.wait() => {
                let said = crate::backend::capture::collect(stderr, Duration::from_secs(2)).await;
                return Err(format!("the container exited before it was ready ({}): {}",
                    s.map(|s| s.to_string()).unwrap_or_default(), said.text.trim()));
            }
        };
        let _ = std::fs::remove_file(dir.join(SOCKET_NAME));
        drop(listener);
        let (mut sock, _) = match accepted {
            Ok(Ok(a)) => a,
            Ok(Err(e)) => return Err(format!("accept: {e}")),
            Err(_) => return Err(format!("not ready within {} s", READY_BOUND.as_secs())),
        };
        let cred = sock
            .peer_cred()
            .map_err(|e| format!("peer credentials: {e}"))?;
        let pid = cred.pid().ok_or("no peer pid")?;
        if cred.uid() != 0 {
            return Err(format!("the waiter runs as uid {}, not 0", cred.uid()));
        }
        let mut r = [0u8; 1];
        match tokio::time::timeout(READY_BOUND, sock.read_exact(&mut r)).await {
            Ok(Ok(_)) if r[0] == b'R' => {}
            _ => return Err("the waiter did not say it is ready".into()),
        }
        let pidfd = rustix::process::Pid::from_raw(pid)
            .ok_or_else(|| format!("the waiter's pid is {pid}"))
            .and_then(|p| {
                rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty())
                    .map_err(|e| format!("pidfd_open: {e}"))
            })?;
        // The waiter holds the socket's other end: still connected after pidfd_open, it
        // still lived then, so the pid (and the pidfd) is its, not a reused one's.
        let mut poll = libc::pollfd {
            fd: sock.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: poll of one valid descriptor with a zero timeout.
        let polled = unsafe { libc::poll(&mut poll, 1, 0) };
        if polled < 0 || poll.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            return Err("the waiter went away before it was ready".into());
        }
        // gVisor: the waiter connected its output sockets before the control socket.
        let mut output = Vec::new();
        for (l, name) in outputs.into_iter().zip(gvisor::OUTPUT_SOCKETS) {
            let accepted = tokio::time::timeout(Duration::from_secs(5), l.accept()).await;
            let _ = std::fs::remove_file(dir.join(name));
            let (s, _) = accepted
                .map_err(|_| format!("the waiter did not connect {name}"))?
                .map_err(|e| format!("accept {name}: {e}"))?;
            let peer = s
                .peer_cred()
                .map_err(|e| format!("peer credentials: {e}"))?;
            if peer.pid() != Some(pid) || peer.uid() != 0 {
                return Err(format!("{name} was connected by another process"));
            }
            // The worker only reads: nothing goes back to the sandbox.
            let std = s.into_std().map_err(|e| format!("{name}: {e}"))?;
            let _ = std.shutdown(std::net::Shutdown::Write);
            output.push(UnixStream::from_std(std).map_err(|e| format!("{name}: {e}"))?);
        }
        let output = match <[UnixStream; 2]>::try_from(output) {
            Ok(o) => Some(o),
            Err(v) if v.is_empty() => None,
            Err(_) => return Err("the output sockets".into()),
        };
        // The client's stderr is drained in the background (it holds nothing of a job).
        drop(stderr);
        Ok(Slot {
            name: name.to_string(),
            dir: dir.to_path_buf(),
            child,
            sock,
            pid: u32::try_from(pid).map_err(|_| format!("peer pid {pid}"))?,
            pidfd,
            args,
            output,
        })
    }

    /// The image's entrypoint and cmd (cached; `image inspect`).
    async fn image_args(&self, engine: &EngineBackend, image: &str) -> Result<ImageArgs, String> {
        if let Some(a) = self
            .inner
            .state
            .lock()
            .ok()
            .and_then(|s| s.images.get(image).cloned())
        {
            return Ok(a);
        }
        let out = engine
            .command()
            .args([
                "image",
                "inspect",
                "--format",
                "{{json .Config}}",
                "--",
                image,
            ])
            .output()
            .await
            .map_err(|e| format!("image inspect: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "image inspect {image}: {}",
                super::last_line(&out.stderr)
            ));
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .map_err(|e| format!("image inspect {image}: {e}"))?;
        let list = |k: &str| -> Vec<String> {
            match &v[k] {
                serde_json::Value::Array(a) => a
                    .iter()
                    .filter_map(|x| x.as_str().map(str::to_string))
                    .collect(),
                serde_json::Value::String(s) if !s.is_empty() => vec![s.clone()],
                _ => Vec::new(),
            }
        };
        let home = list("Env")
            .iter()
            .find_map(|e| e.strip_prefix("HOME=").map(str::to_string));
        let args = ImageArgs {
            entrypoint: list("Entrypoint"),
            cmd: list("Cmd"),
            home,
            podman: engine.kind == crate::config::BackendKind::Podman,
        };
        if let Ok(mut s) = self.inner.state.lock() {
            s.images.insert(image.to_string(), args.clone());
        }
        Ok(args)
    }
}

/// Unmounts the gVisor slots' staging mounts under `<state_dir>/pool` (at a graceful
/// stop, once no job runs: idle slots' containers end with the node, and the next start
/// removes their directories). Blocking.
pub fn unmount_slots(state_dir: &Path) {
    let dir = state_dir.join("pool");
    if !unmount_beneath(&dir) {
        tracing::warn!(dir = %dir.display(), "mounts are left under the pool's directory");
    }
}

/// The spec the pool is filled with at startup: the node's `limits`, the job directory
/// and workspace mounts (placeholders: only the key and the mount targets matter).
pub fn template(limits: crate::backend::ResourceLimits) -> SandboxSpec {
    SandboxSpec {
        name: String::new(),
        image: String::new(),
        command: Vec::new(),
        override_entrypoint: true,
        env: Vec::new(),
        mounts: Vec::new(),
        workdir: WORKSPACE_MOUNT.into(),
        network: cynode_protocol::worker_api::NetworkPolicy::None,
        limits,
        labels: Vec::new(),
        timeout: Duration::from_secs(1),
        output_cap: 0,
        host_uid: 1,
    }
}

/// Whether a job of `spec` can run in a pooled container: its mounts are the job
/// directory and the workspace only.
fn poolable(spec: &SandboxSpec) -> bool {
    spec.mounts
        .iter()
        .all(|m| m.target == JOB_MOUNT || m.target == WORKSPACE_MOUNT)
        && spec.host_uid != 0
}

/// `spec`'s mounts as a claim moves them in: (host directory, target, writable).
fn claim_mounts(spec: &SandboxSpec) -> Vec<(PathBuf, String, bool)> {
    spec.mounts
        .iter()
        .map(|m| (m.host.clone(), m.target.clone(), m.writable))
        .collect()
}

/// The passwd and group entries a claim adds for `spec`'s uid: Podman gives a cold
/// container's uid one when the image has none, and a pooled container started as root.
fn identity(spec: &SandboxSpec, args: &ImageArgs) -> Option<Identity> {
    args.podman.then(|| Identity {
        uid: spec.host_uid,
        workdir: spec.workdir.clone(),
    })
}

/// The argv the engine would run for `spec` in an image with `args`.
fn job_argv(spec: &SandboxSpec, args: &ImageArgs) -> Vec<String> {
    if spec.override_entrypoint && !spec.command.is_empty() {
        return spec.command.clone();
    }
    let tail = if spec.command.is_empty() {
        &args.cmd
    } else {
        &spec.command
    };
    args.entrypoint.iter().chain(tail).cloned().collect()
}

/// Binds `<dir>/<name>` (root only) through the directory's fd, so a long state path
/// still fits a socket address.
fn bind_socket(dir: &Path, name: &str) -> std::io::Result<tokio::net::UnixListener> {
    let d = std::fs::File::open(dir)?;
    let short = format!("/proc/self/fd/{}/{name}", d.as_raw_fd());
    let l = std::os::unix::net::UnixListener::bind(&short)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.join(name), std::fs::Permissions::from_mode(0o600))?;
    l.set_nonblocking(true)?;
    tokio::net::UnixListener::from_std(l)
}

impl Slot {
    /// The host pid of the container's init (the waiter): its namespaces are the job's.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the waiter still lives (checked through its pidfd, so a pid reused after
    /// its death is never mistaken for it): true after a hook that opened
    /// `/proc/<pid>/ns/…` means the namespace it opened was this container's.
    pub fn alive(&self) -> bool {
        // SAFETY: pidfd_send_signal with signal 0 (existence check) on our own pidfd.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_raw_fd(),
                0,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            ) == 0
        }
    }

    /// Gives the slot `spec`'s job: mounts its directories into the container, sends the
    /// job with two fresh pipes, and waits for the waiter's word that it runs.
    pub async fn start_job(self, spec: &SandboxSpec) -> Claimed {
        let t = Instant::now();
        let Slot {
            name,
            dir,
            mut child,
            mut sock,
            pidfd,
            args,
            output,
            ..
        } = self;
        let fail = |why: String| Claimed::Failed(why);
        let argv = job_argv(spec, &args);
        if argv.is_empty() {
            return fail("no command and no image entrypoint".into());
        }
        let mounts = claim_mounts(spec);
        let gvisor = output.is_some();
        let msg = encode(spec, &argv, &args, gvisor);
        let (stdout, stderr): (Output, Output) = match output {
            // gVisor: the job's directories go under the staging directory on the host
            // (the waiter binds them inside, and adds Podman's passwd entry itself).
            Some([out, err]) => {
                let staged = dir.clone();
                match tokio::task::spawn_blocking(move || gvisor::mount_job(&staged, &mounts)).await
                {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return fail(format!("cannot mount the job's directories: {e}")),
                    Err(e) => return fail(format!("mount task: {e}")),
                }
                if let Err(e) = sock.write_all(&msg).await {
                    return fail(format!("cannot send the job to the waiter: {e}"));
                }
                (Box::new(out), Box::new(err))
            }
            None => {
                // Podman gives a cold job's uid an entry in passwd and group when the image
                // has none; a pooled container was started as root, so the claim adds them.
                let identity = identity(spec, &args);
                let injected =
                    tokio::task::spawn_blocking(move || inject(&pidfd, &mounts, identity)).await;
                match injected {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return fail(format!("cannot mount the job's directories: {e}")),
                    Err(e) => return fail(format!("mount task: {e}")),
                }
                let (out_w, out_r) = match tokio::net::unix::pipe::pipe() {
                    Ok(p) => p,
                    Err(e) => return fail(format!("pipe: {e}")),
                };
                let (err_w, err_r) = match tokio::net::unix::pipe::pipe() {
                    Ok(p) => p,
                    Err(e) => return fail(format!("pipe: {e}")),
                };
                let (Ok(out_w), Ok(err_w)) = (out_w.into_blocking_fd(), err_w.into_blocking_fd())
                else {
                    return fail("pipe descriptors".into());
                };
                if let Err(e) = send(&sock, &msg, &[out_w.as_raw_fd(), err_w.as_raw_fd()]).await {
                    return fail(format!("cannot send the job to the waiter: {e}"));
                }
                (Box::new(out_r), Box::new(err_r))
            }
        };
        let mut tag = [0u8; 1];
        let word = tokio::time::timeout(READY_BOUND, sock.read_exact(&mut tag)).await;
        let exec_failed = match word {
            Ok(Ok(_)) if tag[0] == b'S' => false,
            Ok(Ok(_)) if tag[0] == b'F' => {
                let mut e = [0u8; 4];
                let _ = sock.read_exact(&mut e).await;
                true
            }
            // gVisor: the waiter could not bind the job's directories; nothing ran.
            Ok(Ok(_)) if tag[0] == b'M' => {
                let mut e = [0u8; 4];
                let _ = sock.read_exact(&mut e).await;
                let _ = child.start_kill();
                return fail(format!(
                    "the waiter could not mount the job's directories: {}",
                    std::io::Error::from_raw_os_error(i32::from_le_bytes(e))
                ));
            }
            _ => {
                // The job was sent and may run: the container must not live on, and the
                // job is not run again.
                let _ = child.start_kill();
                return Claimed::Lost("the waiter did not say whether the job started".into());
            }
        };
        Claimed::Running(Box::new(Running {
            name,
            child,
            sock,
            stdout,
            stderr,
            dir,
            to_start: t.elapsed(),
            exec_failed,
        }))
    }
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("name", &self.name)
            .field("to_start", &self.to_start)
            .field("exec_failed", &self.exec_failed)
            .finish_non_exhaustive()
    }
}

impl Running {
    /// The job's exit code from the waiter (`X`), or `None` when the connection ended
    /// without one (the container died).
    pub async fn exit_code(sock: &UnixStream) -> Option<i32> {
        let mut m = [0u8; 5];
        read_exact(sock, &mut m).await.ok()?;
        (m[0] == b'X').then(|| i32::from_le_bytes([m[1], m[2], m[3], m[4]]))
    }
}

/// The job message ([`poolwaiter`'s format](../../../../poolwaiter/src/main.rs)): a
/// length, then NUL-terminated fields. For gVisor it names the job's mounts' targets for
/// the waiter to bind, and whether it adds Podman's passwd entry.
fn encode(spec: &SandboxSpec, argv: &[String], image: &ImageArgs, gvisor: bool) -> Vec<u8> {
    let mut body = Vec::new();
    let mut field = |b: &[u8]| {
        body.extend_from_slice(b);
        body.push(0);
    };
    field(b"2");
    field(spec.host_uid.to_string().as_bytes());
    field(spec.host_uid.to_string().as_bytes());
    field(spec.workdir.as_bytes());
    field(if image.podman {
        spec.workdir.as_bytes()
    } else {
        b"/"
    });
    field(argv.len().to_string().as_bytes());
    for a in argv {
        field(a.as_bytes());
    }
    // The image's HOME is the job's unless the job sets one (as the engines do).
    let image_home = image
        .home
        .as_ref()
        .filter(|_| !spec.env.iter().any(|(k, _)| k == "HOME"));
    field(
        (spec.env.len() + usize::from(image_home.is_some()))
            .to_string()
            .as_bytes(),
    );
    if let Some(h) = image_home {
        field(format!("HOME={h}").as_bytes());
    }
    for (k, v) in &spec.env {
        field(format!("{k}={v}").as_bytes());
    }
    let mounts: &[crate::sandbox::Mount] = if gvisor { &spec.mounts } else { &[] };
    field(mounts.len().to_string().as_bytes());
    for m in mounts {
        field(m.target.as_bytes());
    }
    field(if gvisor && image.podman { b"1" } else { b"0" });
    framed(&body)
}

/// `body` after its length (u32, little endian), as the waiter reads a message.
fn framed(body: &[u8]) -> Vec<u8> {
    let mut msg = (body.len() as u32).to_le_bytes().to_vec();
    msg.extend_from_slice(body);
    msg
}

/// Writes `msg` to `sock` with `fds` (`SCM_RIGHTS`) on its first bytes; through a shared
/// reference, so a session's signal can be sent while its command's answer is awaited.
async fn send(sock: &UnixStream, msg: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    let mut off = 0;
    while off < msg.len() {
        sock.writable().await?;
        let sent = sock.try_io(tokio::io::Interest::WRITABLE, || {
            let part = &msg[off..];
            if off == 0 && !fds.is_empty() {
                sendmsg_fds(sock.as_raw_fd(), part, fds)
            } else {
                sendmsg_fds(sock.as_raw_fd(), part, &[])
            }
        });
        match sent {
            Ok(n) => off += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes from `sock`, through a shared reference.
async fn read_exact(sock: &UnixStream, buf: &mut [u8]) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        sock.readable().await?;
        match sock.try_read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `sendmsg` of `msg` with `fds` (at most three) as `SCM_RIGHTS`; the bytes sent.
fn sendmsg_fds(fd: RawFd, msg: &[u8], fds: &[RawFd]) -> std::io::Result<usize> {
    if fds.len() > 3 {
        return Err(std::io::Error::other("at most three descriptors"));
    }
    let mut cmsg = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: msg.as_ptr() as *mut libc::c_void,
        iov_len: msg.len(),
    };
    // SAFETY: a zeroed msghdr filled with pointers to live buffers; the control message
    // is laid out with the CMSG macros within `cmsg`.
    unsafe {
        let mut m: libc::msghdr = std::mem::zeroed();
        m.msg_iov = &mut iov;
        m.msg_iovlen = 1;
        m.msg_control = cmsg.as_mut_ptr().cast();
        let space = libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) as usize;
        m.msg_controllen = space;
        let c = libc::CMSG_FIRSTHDR(&m);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as usize;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast::<RawFd>(), fds.len());
        let n = libc::sendmsg(fd, &m, libc::MSG_NOSIGNAL);
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

impl EngineBackend {
    /// The `run` argv of a pooled container for `spec`'s key (see the module doc for how
    /// it differs from [`EngineBackend::run_args`]).
    pub fn pool_args(
        &self,
        spec: &SandboxSpec,
        name: &str,
        dir: &Path,
        empty: &Path,
    ) -> Vec<String> {
        let l = &spec.limits;
        let mut a: Vec<String> = vec![
            "run".into(),
            "--rm".into(),
            "--name".into(),
            name.to_string(),
            "--label".into(),
            format!("{MANAGED_LABEL}={}", self.node),
            "--label".into(),
            format!("{POOL_LABEL}=1"),
        ];
        for (k, v) in &spec.labels {
            a.push("--label".into());
            a.push(format!("{k}={v}"));
        }
        a.extend(self.runtime_args());
        a.push("--pull=never".into());
        let gvisor = self.gvisor();
        if gvisor {
            // The waiter mounts inside gVisor; the job gets the node's filters from it
            // (gvisor.rs). Nothing runs in the container before the job but the waiter.
            a.push("--security-opt=seccomp=unconfined".into());
            a.push("--cap-add=SYS_ADMIN".into());
        } else {
            a.push(format!("--security-opt=seccomp={}", self.profile.display()));
        }
        a.extend([
            "--network=none".into(),
            "--read-only".into(),
            "--user=0:0".into(),
            "--cap-drop=ALL".into(),
            "--cap-add=SETUID".into(),
            "--cap-add=SETGID".into(),
            "--cap-add=SETPCAP".into(),
            "--security-opt=no-new-privileges".into(),
            "--ulimit=nofile=1024:1024".into(),
            "--ulimit=nproc=4096:4096".into(),
        ]);
        a.push(format!("--memory={}m", l.memory_mb));
        a.push(format!("--memory-swap={}m", l.memory_mb));
        // Under gVisor the engine's pids limit counts the sandbox's host threads (the
        // sentry's and the gofer's), not the job's processes, which are gVisor's tasks: a
        // warm container, with its waiter's three host sockets and output relay, runs
        // about 30 more of them than a cold one (54 idle, 74 with a job, against 42; a
        // limit of 65 crashed the sentry).
        let pids = if gvisor {
            l.pids + 1 + GVISOR_EXTRA_THREADS
        } else {
            l.pids + 1
        };
        a.push(format!("--pids-limit={pids}"));
        a.push(format!("--cpus={}", l.cpus));
        a.push(format!("--tmpfs=/tmp:rw,size={}m,mode=1777", l.tmpfs_mb));
        a.push(format!("--volume={}:{CTL_MOUNT}:ro", dir.display()));
        if gvisor {
            a.push(format!(
                "--mount=type=bind,source={},target={},bind-propagation=rslave",
                dir.join(gvisor::STAGING).display(),
                gvisor::STAGING_MOUNT
            ));
        }
        for target in [JOB_MOUNT, WORKSPACE_MOUNT] {
            a.push(format!("--volume={}:{target}:ro", empty.display()));
        }
        a.push("--workdir=/".into());
        a.push(format!("--entrypoint={CTL_MOUNT}/{WAITER_NAME}"));
        a.push("--".into());
        a.push(spec.image.clone());
        a.push(format!("{CTL_MOUNT}/{SOCKET_NAME}"));
        if gvisor {
            a.push("--gvisor".into());
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(cmd: &[&str], over: bool) -> SandboxSpec {
        let mut s = crate::sandbox::example_spec("img:1", cmd);
        s.override_entrypoint = over;
        s
    }

    /// The engines' rule: a replaced entrypoint runs the command; otherwise the image's
    /// entrypoint takes the command, or the image's cmd when there is none.
    #[test]
    fn argv_follows_the_engines_rule() {
        let img = ImageArgs {
            entrypoint: vec!["/sba".into()],
            cmd: vec!["--default".into()],
            ..ImageArgs::default()
        };
        assert_eq!(
            job_argv(&spec(&["sh", "-c", "x"], true), &img),
            ["sh", "-c", "x"]
        );
        assert_eq!(job_argv(&spec(&["--x"], false), &img), ["/sba", "--x"]);
        assert_eq!(job_argv(&spec(&[], false), &img), ["/sba", "--default"]);
        assert_eq!(job_argv(&spec(&[], true), &img), ["/sba", "--default"]);
    }

    /// The message is the waiter's format: length, then NUL-terminated fields; for runc
    /// no mounts and no identity (the worker makes both from the host).
    #[test]
    fn the_job_message_is_length_prefixed_fields() {
        let mut s = spec(&["echo", "hi"], true);
        s.env = vec![("A".into(), "1".into())];
        s.host_uid = 2001;
        let podman = ImageArgs {
            podman: true,
            ..ImageArgs::default()
        };
        let m = encode(&s, &s.command.clone(), &podman, false);
        let len = u32::from_le_bytes([m[0], m[1], m[2], m[3]]) as usize;
        assert_eq!(len, m.len() - 4);
        let fields: Vec<&[u8]> = m[4..].split(|b| *b == 0).collect();
        assert_eq!(
            &fields[..fields.len() - 1],
            [
                &b"2"[..],
                b"2001",
                b"2001",
                s.workdir.as_bytes(),
                s.workdir.as_bytes(),
                b"2",
                b"echo",
                b"hi",
                b"1",
                b"A=1",
                b"0",
                b"0"
            ]
        );
    }

    /// For gVisor the message names the job's mounts' targets, and asks the waiter
    /// for Podman's passwd entry (never for Docker's).
    #[test]
    fn a_gvisor_message_names_the_mounts() {
        let mut s = spec(&["true"], true);
        s.mounts = vec![
            crate::sandbox::Mount {
                host: "/h/job".into(),
                target: JOB_MOUNT.into(),
                writable: false,
            },
            crate::sandbox::Mount {
                host: "/h/ws".into(),
                target: WORKSPACE_MOUNT.into(),
                writable: true,
            },
        ];
        for (podman, identity) in [(true, &b"1"[..]), (false, b"0")] {
            let img = ImageArgs {
                podman,
                ..ImageArgs::default()
            };
            let m = encode(&s, &s.command.clone(), &img, true);
            let fields: Vec<&[u8]> = m[4..].split(|b| *b == 0).collect();
            let n = fields.len() - 1;
            assert_eq!(
                &fields[n - 4..n],
                [&b"2"[..], b"/job", b"/workspace", identity]
            );
        }
    }

    /// The `run` argv of a Podman slot for `spec` of a node with `cfg`.
    fn slot_args(cfg: crate::config::EngineConfig, spec: &SandboxSpec) -> Vec<String> {
        let e = EngineBackend::new(
            crate::config::BackendKind::Podman,
            cfg,
            "n".into(),
            Path::new("/s"),
            crate::backend::bwrap::IsolatedBwrap::new("bwrap".into(), "n".into(), Some(false)),
        );
        e.pool_args(
            spec,
            "cynode-pool-1",
            Path::new("/s/pool/x"),
            Path::new("/s/pool/empty"),
        )
    }

    /// A pooled container keeps a cold one's walls: no network, read-only root, the
    /// node's seccomp profile, no-new-privileges, all capabilities dropped but the three
    /// the waiter needs to drop to the job's uid, the limits (one more pid for the waiter),
    /// the node's label; the image after `--`.
    #[test]
    fn pool_args_keep_the_cold_walls() {
        let s = spec(&["true"], true);
        let a = slot_args(crate::config::EngineConfig::default(), &s);
        let end = a.iter().position(|x| x == "--").unwrap_or(0);
        for want in [
            "--rm",
            "--network=none",
            "--read-only",
            "--cap-drop=ALL",
            "--security-opt=no-new-privileges",
            "--pull=never",
            "--label",
            "io.cynode.node=n",
        ] {
            assert!(a[..end].iter().any(|x| x == want), "{want} missing: {a:?}");
        }
        assert!(a[..end]
            .iter()
            .any(|x| x.starts_with("--security-opt=seccomp=/s/seccomp/")));
        assert!(a[..end].contains(&format!("--pids-limit={}", s.limits.pids + 1)));
        let added: Vec<&String> = a.iter().filter(|x| x.starts_with("--cap-add")).collect();
        assert_eq!(
            added,
            ["--cap-add=SETUID", "--cap-add=SETGID", "--cap-add=SETPCAP"]
        );
        assert_eq!(&a[end + 1..], ["img:1", "/.cynode/ctl.sock"]);
    }

    /// Under gVisor the waiter mounts: no OCI profile (the waiter installs the node's
    /// filters on the job) and `CAP_SYS_ADMIN` in gVisor's kernel, the staging directory
    /// with `rslave` propagation, the waiter in its gVisor mode; every other wall stays.
    #[test]
    fn gvisor_pool_args_stage_the_mounts() {
        let cfg = crate::config::EngineConfig {
            runtime: crate::config::OciRuntime::Runsc,
            ..crate::config::EngineConfig::default()
        };
        let a = slot_args(cfg, &spec(&["true"], true));
        let end = a.iter().position(|x| x == "--").unwrap_or(0);
        for want in [
            "--security-opt=seccomp=unconfined",
            "--cap-add=SYS_ADMIN",
            "--mount=type=bind,source=/s/pool/x/mnt,target=/.cynode-mnt,bind-propagation=rslave",
            "--network=none",
            "--read-only",
            "--cap-drop=ALL",
            "--security-opt=no-new-privileges",
        ] {
            assert!(a[..end].iter().any(|x| x == want), "{want} missing: {a:?}");
        }
        let pids = spec(&["true"], true).limits.pids + 1 + GVISOR_EXTRA_THREADS;
        assert!(a[..end].contains(&format!("--pids-limit={pids}")), "{a:?}");
        assert_eq!(&a[end + 1..], ["img:1", "/.cynode/ctl.sock", "--gvisor"]);
    }
}
