//! The node's janitor: a small process of its own (`cynode-worker janitor`, started by
//! `serve` with the node's own flags) that removes the node's sandboxes once the node is
//! gone, however it went (SIGKILL and the OOM killer included).
//!
//! Why: bwrap's PID 1 arms its parent-death signal only when its setup is done, so a node
//! killed while a sandbox was being set up (a job's, a starter's, a warm slot's) leaves that
//! setup running, orphaned; and an engine keeps a dead node's containers running. Until
//! now both waited for the node's restart. The janitor holds the read end of a pipe whose
//! only write end is the node's (close-on-exec, so no client or sandbox has it);
//! end-of-file means the node has exited, and the janitor then does what a restart's
//! reconciliation does, without making anything again: it kills and removes the node's
//! sandbox cgroups ([`remove_node_cgroups`]), then the backend's sandboxes that outlive
//! their node ([`SandboxBackend::remove_orphans`]: an engine's containers), then unmounts
//! the mounts the node left beneath its state directory (its workspaces' and job
//! directories' disk volumes, a gVisor slot's staging mounts:
//! [`crate::loopfs::release_node`]), so their loop devices let go, and exits. A node that stops cleanly closes the pipe too: its janitor sweeps then
//! as well.
//!
//! Invariants:
//! - It shares the node's state-directory lock (the same open file description, inherited),
//!   so a new node on the same state directory waits until the janitor is done: a
//!   predecessor's janitor never removes a successor's sandboxes. Its sweep is bounded
//!   ([`ENGINE_BOUND`] for the engine's part), so it never holds the lock for long.
//! - It runs in a session of its own (a terminal's SIGINT does not reach it) and ignores
//!   SIGINT, SIGTERM and SIGHUP: it ends when the node does, not before.
//! - It sweeps only on end-of-file of a pipe: started with anything else as its stdin (a
//!   terminal, a file) it refuses and sweeps nothing.
//! - Its configuration is the node's (the same flags, read when it starts, right after the
//!   node read them); its environment is only the clients' ([`client_vars`]): never the
//!   node's bearer token. It reads nothing a sandbox wrote (`cgroup.procs` is the
//!   kernel's; the engine's container list is filtered by the node's label; the mounts
//!   come from the kernel's mountinfo, and are unmounted by their place without following
//!   a link or entering a volume).
//! - It removes no workspace and no snapshot: a volume is only unmounted (its image, with a
//!   suspended session's workspace in it, stays for the next start to mount again), and
//!   snapshot images (`<state>/snapshots/`) are plain files the node's reaper expires.

use std::io::Read;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::backend::{client_vars, remove_node_cgroups, SandboxBackend};
use crate::config::Config;

/// The subcommand that runs [`run`].
pub const SUBCOMMAND: &str = "janitor";

/// How long a node that stops cleanly waits for its janitor's sweep.
const FINISH_WAIT: Duration = Duration::from_secs(70);
/// The bound on the engine's part of the sweep (a hung daemon must not hold the lock).
pub const ENGINE_BOUND: Duration = Duration::from_secs(60);

/// Why the janitor cannot run or refused to.
#[derive(Debug, thiserror::Error)]
pub enum JanitorError {
    /// Its stdin is not the node's pipe.
    #[error("stdin is not a pipe: the janitor runs only as `cynode-worker serve` starts it")]
    NotAPipe,
    /// Starting it failed.
    #[error("cannot start the janitor: {0}")]
    Spawn(std::io::Error),
}

/// A running janitor, seen from its node. Dropping it (the node's exit does the same)
/// closes the pipe, and the janitor sweeps.
#[derive(Debug)]
pub struct Janitor {
    pipe: std::io::PipeWriter,
    child: Child,
}

impl Janitor {
    /// Starts the janitor (this executable, [`SUBCOMMAND`]) with `node_args`, the flags the
    /// node was started with, handing it `lock`, the node's state-directory lock, and the
    /// read end of the node's pipe.
    pub fn spawn(
        node_args: &[std::ffi::OsString],
        lock: BorrowedFd<'_>,
    ) -> Result<Janitor, JanitorError> {
        let (reader, pipe) = std::io::pipe().map_err(JanitorError::Spawn)?;
        let lock_fd = lock.as_raw_fd();
        // This very binary, even if its file was replaced since; named as the worker.
        let mut cmd = Command::new("/proc/self/exe");
        std::os::unix::process::CommandExt::arg0(&mut cmd, "cynode-worker");
        cmd.arg(SUBCOMMAND)
            .args(node_args)
            .env_clear()
            .envs(client_vars())
            .envs(std::env::var_os("CYNODE_LOG_LEVEL").map(|v| ("CYNODE_LOG_LEVEL", v)))
            .stdin(Stdio::from(reader))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        // SAFETY: between fork and exec this makes only the async-signal-safe setsid and
        // fcntl syscalls, on the lock's descriptor (open for the whole call).
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                if libc::setsid() < 0 || libc::fcntl(lock_fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(JanitorError::Spawn)?;
        tracing::info!(janitor_pid = child.id(), "janitor started");
        Ok(Janitor { pipe, child })
    }

    /// For a node that stops cleanly: closes the pipe and waits (at most 70 s) for the
    /// janitor's sweep. Returns whether it ended in time.
    pub fn finish(self) -> bool {
        let Janitor { pipe, mut child } = self;
        drop(pipe);
        let until = Instant::now() + FINISH_WAIT;
        loop {
            match child.try_wait() {
                Ok(Some(_)) | Err(_) => return true,
                Ok(None) if Instant::now() >= until => return false,
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }
}

/// The janitor itself, for the node configured by `cfg`: waits for end-of-file on stdin
/// (the node's pipe), then removes the node's sandbox cgroups and its backend's orphans,
/// then unmounts what the node left mounted beneath its state directory. Returns how many
/// sandboxes it removed.
pub fn run(cfg: &Config) -> Result<usize, JanitorError> {
    let stdin = std::io::stdin();
    let st = rustix::fs::fstat(&stdin).map_err(|_| JanitorError::NotAPipe)?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Fifo {
        return Err(JanitorError::NotAPipe);
    }
    // Its name in ps and /proc (exec through /proc/self/exe would show "exe").
    // SAFETY: PR_SET_NAME with a NUL-terminated name of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"cynode-janitor".as_ptr(), 0, 0, 0) };
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: setting a signal's disposition to ignore.
        unsafe { libc::signal(sig, libc::SIG_IGN) };
    }
    let node = crate::backend::node_id(cfg);
    let backend = crate::backend::from_config(cfg);
    let mut buf = [0u8; 64];
    let mut input = stdin.lock();
    loop {
        match input.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // A pipe's read fails only if the descriptor is broken: the node is gone too.
            Err(_) => break,
        }
    }
    let started = Instant::now();
    let cgroups = remove_node_cgroups(&node);
    let orphans = remove_orphans(backend.as_ref());
    // Last: a sandbox gone lets go of its copies of the volumes.
    let volumes = crate::loopfs::release_node(&cfg.state_dir);
    tracing::info!(
        node,
        removed = cgroups + orphans,
        cgroups,
        orphans,
        unmounted = volumes.unmounted,
        detached = volumes.detached,
        left_mounted = volumes.left,
        sweep_ms = started.elapsed().as_millis() as u64,
        "the node is gone; its janitor removed its sandboxes"
    );
    Ok(cgroups + orphans)
}

/// `backend`'s orphans, within [`ENGINE_BOUND`] (0 and a log line past it).
fn remove_orphans(backend: &dyn SandboxBackend) -> usize {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::warn!(error = %e, "the janitor cannot remove the engine's containers");
            return 0;
        }
    };
    rt.block_on(async {
        tokio::time::timeout(ENGINE_BOUND, backend.remove_orphans())
            .await
            .unwrap_or_else(|_| {
                tracing::warn!(
                    bound_s = ENGINE_BOUND.as_secs(),
                    "the engine did not remove the node's containers in time; its restart will"
                );
                0
            })
    })
}
