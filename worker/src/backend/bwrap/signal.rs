//! Signals to the command of a bubblewrap sandbox ([`crate::backend::exec_io`]).
//!
//! A bwrap sandbox is three processes deep on the host: the client bwrap the node
//! spawned, bwrap's init (PID 1 of the sandbox's PID namespace, which `--new-session`
//! made the leader of a session and process group of its own), and the command, in that
//! group with whatever it forks. Neither bwrap forwards signals, and the init of a PID
//! namespace ignores every signal it has no handler for, so the node signals the
//! command's process group itself: the processes of the sandbox's own cgroup (every one
//! of them the sandbox's) whose process group is the init's, the init excepted.
//!
//! A signal sent while bwrap is still setting the sandbox up waits for the command
//! (bounded, [`crate::backend::exec_io::START_BOUND`]).
//!
//! No pid is signalled that the node does not hold: each candidate is opened as a pidfd,
//! its `/proc` entry read, then the cgroup's list read again and the pidfd checked alive;
//! a process that is still alive and still listed is the one the pid named throughout,
//! and the signal goes through its pidfd (`pidfd_send_signal`), which never reaches a
//! process that later took the same pid.

use std::os::fd::OwnedFd;
use std::path::PathBuf;

use crate::backend::exec_io::{
    pidfd_open, pidfd_send_signal, retry_while_starting, Signal, SignalError, Signaller,
};

/// Signals the command of the sandbox whose cgroup's `cgroup.procs` is `procs`.
#[derive(Debug)]
pub struct CgroupSignaller {
    pub procs: PathBuf,
}

#[async_trait::async_trait]
impl Signaller for CgroupSignaller {
    async fn signal(&self, sig: Signal) -> Result<(), SignalError> {
        retry_while_starting(|| {
            let procs = self.procs.clone();
            async move {
                tokio::task::spawn_blocking(move || deliver(&procs, sig.number()))
                    .await
                    .map_err(|e| SignalError::Failed(format!("the signal task failed: {e}")))?
            }
        })
        .await
    }
}

/// A process of the cgroup, held.
struct Held {
    pid: i32,
    fd: OwnedFd,
    pgid: i32,
    /// Its pid in the innermost PID namespace it is in.
    inner_pid: i32,
}

fn listed(procs: &std::path::Path) -> Option<Vec<i32>> {
    let text = std::fs::read_to_string(procs).ok()?;
    Some(
        text.lines()
            .filter_map(|l| l.trim().parse::<i32>().ok())
            .collect(),
    )
}

/// (process group, innermost pid) of `pid`, from `/proc`.
fn identity(pid: i32) -> Option<(i32, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let pgid = rest.split_whitespace().nth(2)?.parse().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let inner = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()?;
    Some((pgid, inner))
}

/// Signals the command's process group in the cgroup of `procs`.
fn deliver(procs: &std::path::Path, sig: i32) -> Result<(), SignalError> {
    let Some(first) = listed(procs) else {
        return Err(SignalError::Ended);
    };
    if first.is_empty() {
        return Err(SignalError::Ended);
    }
    let mut held: Vec<Held> = first
        .into_iter()
        .filter_map(|pid| {
            let fd = pidfd_open(pid).ok()?;
            let (pgid, inner_pid) = identity(pid)?;
            Some(Held {
                pid,
                fd,
                pgid,
                inner_pid,
            })
        })
        .collect();
    let again = listed(procs).unwrap_or_default();
    held.retain(|h| again.contains(&h.pid) && pidfd_send_signal(&h.fd, 0).is_ok());
    // The sandbox's init: PID 1 of its namespace, the leader of the command's group.
    // None yet (bwrap is still setting the sandbox up) or none left (it is ending): the
    // caller retries for a bounded time; an empty cgroup above is the end.
    let Some(init) = held.iter().find(|h| h.inner_pid == 1).map(|h| h.pid) else {
        return Err(SignalError::NotStarted);
    };
    let mut delivered = 0;
    for h in held.iter().filter(|h| h.pgid == init && h.pid != init) {
        match pidfd_send_signal(&h.fd, sig) {
            Ok(()) => delivered += 1,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(e) => {
                return Err(SignalError::Failed(format!(
                    "cannot signal the command's process: {e}"
                )))
            }
        }
    }
    if delivered == 0 {
        return Err(SignalError::NotStarted);
    }
    Ok(())
}
