//! The node's janitor: a small process of its own (`cynode-worker janitor`, started by
//! `serve`) that kills and removes the node's sandboxes once the node is gone, however it
//! went (SIGKILL and the OOM killer included).
//!
//! Why: bwrap's PID 1 arms its parent-death signal only when its setup is done, so a node
//! killed while a sandbox was being set up (a job's, a starter's, a warm slot's) leaves that
//! setup running, orphaned, until the node's restart reconciles it. The janitor closes that
//! window for a node that is never restarted. It holds the read end of a pipe whose only
//! write end is the node's (close-on-exec, so no client or sandbox has it); end-of-file
//! means the node has exited, and the janitor then does what a restart's reconciliation
//! does to the node's sandbox cgroups ([`remove_node_cgroups`]) and exits.
//!
//! Invariants:
//! - It shares the node's state-directory lock (the same open file description, inherited),
//!   so a new node on the same state directory waits until the janitor is done: a
//!   predecessor's janitor never kills a successor's sandboxes.
//! - It runs in a session of its own (a terminal's SIGINT does not reach it) and ignores
//!   SIGINT, SIGTERM and SIGHUP: it ends when the node does, not before.
//! - It sweeps only on end-of-file of a pipe: started with anything else as its stdin (a
//!   terminal, a file) it refuses and sweeps nothing. The node id it is given must be the
//!   12 hex digits of [`crate::backend::node_id`], never a path.
//! - Its environment is empty; it reads nothing a sandbox wrote (only `cgroup.procs`,
//!   which is the kernel's).

use std::io::Read;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::backend::bwrap::cgroup::remove_node_cgroups;

/// The subcommand that runs [`run`].
pub const SUBCOMMAND: &str = "janitor";

/// How long a node that stops cleanly waits for its janitor's sweep.
const FINISH_WAIT: Duration = Duration::from_secs(10);

/// Why the janitor cannot run or refused to.
#[derive(Debug, thiserror::Error)]
pub enum JanitorError {
    /// The node id is not 12 lowercase hex digits.
    #[error("not a node id: {0:?} (expected 12 lowercase hex digits)")]
    NodeId(String),
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

fn check_node_id(node: &str) -> Result<(), JanitorError> {
    if node.len() == 12 && node.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(())
    } else {
        Err(JanitorError::NodeId(node.to_string()))
    }
}

impl Janitor {
    /// Starts the janitor of node `node` (this executable, [`SUBCOMMAND`]), handing it
    /// `lock`, the node's state-directory lock, and the read end of the node's pipe.
    pub fn spawn(node: &str, lock: BorrowedFd<'_>) -> Result<Janitor, JanitorError> {
        check_node_id(node)?;
        let (reader, pipe) = std::io::pipe().map_err(JanitorError::Spawn)?;
        let lock_fd = lock.as_raw_fd();
        // This very binary, even if its file was replaced since; named as the worker.
        let mut cmd = Command::new("/proc/self/exe");
        std::os::unix::process::CommandExt::arg0(&mut cmd, "cynode-worker");
        cmd.args([SUBCOMMAND, "--node", node])
            .env_clear()
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
        tracing::info!(janitor_pid = child.id(), node, "janitor started");
        Ok(Janitor { pipe, child })
    }

    /// For a node that stops cleanly: closes the pipe and waits (at most 10 s) for the
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

/// The janitor itself: waits for end-of-file on stdin (the node's pipe), then kills and
/// removes node `node`'s sandbox cgroups. Returns how many sandboxes it removed.
pub fn run(node: &str) -> Result<usize, JanitorError> {
    check_node_id(node)?;
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
    let removed = remove_node_cgroups(node);
    tracing::info!(
        node,
        removed,
        sweep_ms = started.elapsed().as_millis() as u64,
        "the node is gone; its janitor removed its sandboxes"
    );
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_node_id_is_accepted() {
        check_node_id("0123456789ab").unwrap();
        for bad in [
            "",
            "../../../..",
            "0123456789AB",
            "0123456789abc",
            "0123456789a/",
            ".",
        ] {
            assert!(
                matches!(check_node_id(bad), Err(JanitorError::NodeId(_))),
                "{bad:?} was accepted"
            );
        }
    }
}
