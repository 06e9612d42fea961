//! Starting a sandbox in two halves ([`super::SandboxBackend::run_gated`]), so the node
//! can act inside its network namespace before its command runs: the backend creates the
//! sandbox (its namespaces exist, its command has not started), hands the pid of a process
//! inside to a [`NetnsHook`] (the egress proxy and the inference listener bind there, see
//! [`chain`]), and only then lets the command run. A hook that fails ends the sandbox
//! before its command ever ran.
//!
//! - bubblewrap: `--info-fd` reports the sandbox's pid (`{"child-pid": N}`), and
//!   `--block-fd` holds the sandbox before it executes the command until the node writes
//!   a byte ([`Gate`]).
//! - Podman and Docker: a pooled container ([`super::engine::pool`]), whose PID 1 (the
//!   pool waiter) holds the job until the node sends it; the hook gets the waiter's pid.

use std::future::Future;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::time::Duration;

use rustix::pipe::{pipe_with, PipeFlags};

/// What runs between the sandbox's creation and its command: given the pid of a process
/// in the sandbox's namespaces. `Err` is the reason the sandbox is not started.
pub type NetnsHook =
    Box<dyn FnOnce(u32) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send>;

/// How long a created sandbox may take to report its pid.
pub const PID_BOUND: Duration = Duration::from_secs(30);

/// bwrap's `--info-fd` and `--block-fd` pipes: the node keeps the info pipe's read end and
/// the block pipe's write end; bwrap inherits the other two (close-on-exec cleared only in
/// its child, between fork and exec, so no other child of the node inherits them).
#[derive(Debug)]
pub struct Gate {
    info_read: OwnedFd,
    info_write: Option<OwnedFd>,
    block_read: Option<OwnedFd>,
    block_write: OwnedFd,
}

impl Gate {
    /// Both pipes, close-on-exec.
    pub fn new() -> std::io::Result<Gate> {
        let (info_read, info_write) = pipe_with(PipeFlags::CLOEXEC)?;
        let (block_read, block_write) = pipe_with(PipeFlags::CLOEXEC)?;
        Ok(Gate {
            info_read,
            info_write: Some(info_write),
            block_read: Some(block_read),
            block_write,
        })
    }

    /// The fds bwrap inherits: (info write end, block read end).
    fn child_fds(&self) -> (i32, i32) {
        (
            self.info_write.as_ref().map_or(-1, AsRawFd::as_raw_fd),
            self.block_read.as_ref().map_or(-1, AsRawFd::as_raw_fd),
        )
    }

    /// `--info-fd N --block-fd M`.
    pub fn args(&self) -> Vec<String> {
        let (info, block) = self.child_fds();
        vec![
            "--info-fd".into(),
            info.to_string(),
            "--block-fd".into(),
            block.to_string(),
        ]
    }

    /// Makes `cmd` inherit the two child ends.
    pub fn apply(&self, cmd: &mut tokio::process::Command) {
        let (info, block) = self.child_fds();
        // SAFETY: between fork and exec this only clears close-on-exec (fcntl) on two fds
        // opened before the fork.
        unsafe {
            cmd.pre_exec(move || {
                for fd in [info, block] {
                    if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
    }

    /// After the spawn: the node's copies of the child ends close, so the info pipe reads
    /// end-of-file if bwrap dies before reporting.
    pub fn spawned(&mut self) {
        self.info_write = None;
        self.block_read = None;
    }

    /// The sandbox's pid, from bwrap's info JSON; bounded by [`PID_BOUND`].
    pub async fn child_pid(&self) -> Result<u32, String> {
        let fd = self
            .info_read
            .try_clone()
            .map_err(|e| format!("cannot read bwrap's info fd: {e}"))?;
        let read = tokio::task::spawn_blocking(move || read_child_pid(fd));
        match tokio::time::timeout(PID_BOUND, read).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(format!("reading bwrap's info fd failed: {e}")),
            Err(_) => Err(format!(
                "bwrap did not report its sandbox within {} s",
                PID_BOUND.as_secs()
            )),
        }
    }

    /// Lets the sandbox's command run.
    pub fn release(self) -> std::io::Result<()> {
        rustix::io::write(&self.block_write, b"x")?;
        Ok(())
    }
}

/// Reads `{"child-pid": N, …}` (bwrap writes it and keeps the fd open).
pub(crate) fn read_child_pid(fd: OwnedFd) -> Result<u32, String> {
    let mut f = std::fs::File::from(fd);
    let mut text = Vec::new();
    let mut buf = [0u8; 256];
    while !text.contains(&b'}') {
        let n = f
            .read(&mut buf)
            .map_err(|e| format!("cannot read bwrap's info fd: {e}"))?;
        if n == 0 || text.len() > 4096 {
            return Err(format!(
                "bwrap ended before reporting its sandbox: {}",
                String::from_utf8_lossy(&text)
            ));
        }
        text.extend_from_slice(&buf[..n]);
    }
    let v: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| format!("bwrap's info is not JSON ({e})"))?;
    v.get("child-pid")
        .and_then(serde_json::Value::as_u64)
        .and_then(|p| u32::try_from(p).ok())
        .ok_or_else(|| "bwrap's info has no child-pid".to_string())
}

/// One hook that runs `first`, then `second` (the egress proxy's and the inference
/// listener's, in the same sandbox): `None` when neither is given; the first failure is
/// the reason the sandbox is not started.
pub fn chain(first: Option<NetnsHook>, second: Option<NetnsHook>) -> Option<NetnsHook> {
    match (first, second) {
        (None, None) => None,
        (Some(h), None) | (None, Some(h)) => Some(h),
        (Some(a), Some(b)) => Some(Box::new(move |pid: u32| {
            Box::pin(async move {
                a(pid).await?;
                b(pid).await
            })
        })),
    }
}
