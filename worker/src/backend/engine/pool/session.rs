//! A session in a pooled container (runc/crun; gVisor keeps the keep-alive container of
//! [`crate::backend::engine::session`]): the slot's waiter stays its PID 1 and runs each of
//! the session's commands itself (the waiter's side: `poolwaiter/src/session.rs`), so a
//! command costs a fork in the container instead of an engine `exec` (the CLI, the
//! engine's lock, conmon and `runc exec`: 150–200 ms on Podman here).
//!
//! **Start.** An idle slot of the session's key is claimed, else one is made for it named
//! as the session's container (`cynode-session-<id>`, with its labels). The workspace is
//! mounted in as a job's is (Podman's passwd entry too, [`super::inject`]), then the
//! session message makes the waiter the session's uid for good (every capability gone,
//! no_new_privs, non-dumpable) and it says `H`. The hold it is given is the session's max
//! lifetime plus a margin: a waiter outlives its session by at most that even if the node
//! never comes back, and it exits at once when the node's end of the socket closes.
//!
//! **A command** is the one-job message with the command's argv (never the image's
//! entrypoint: an engine `exec` runs the command as given), its cwd, uid and environment,
//! and two fresh pipes for stdout and stderr (a third for a streamed exec's stdin). The
//! waiter says `S` (or `F`: exec failed, exit 127/126) and `X` with the exit code.
//! Commands run one at a time (a lock); a signal is a `K` message the waiter turns into a
//! `kill` of the command's process group, with no shell and nothing written in the
//! sandbox. A timed-out command is killed from the host as a keep-alive container's are:
//! every process of the container's PID namespace but the waiter gets SIGKILL.
//!
//! **Ends.** `stop` removes the container (its socket closes, the waiter exits) and the
//! slot directory; a container that dies (OOM of the waiter, an engine stop) makes the
//! session not alive: the socket hung up or the pidfd says the waiter is gone.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;

use super::{
    claim_mounts, encode, framed, identity, inject, read_exact, send, ImageArgs, Running, Slot,
    READY_BOUND,
};
use crate::backend::capture::{self, Which};
use crate::backend::engine::session::{kill_in_namespace, pid_ns_of, KEEPALIVE_MARGIN};
use crate::backend::engine::EngineBackend;
use crate::backend::exec_io::{self, Signal, SignalError, Signaller};
use crate::backend::{EndReason, SandboxOutcome, SandboxSpec, SessionSandbox};

/// How long a killed command's exit may take to be reported before the exec gives up on it.
const KILLED_BOUND: Duration = Duration::from_secs(10);

/// A session served by a pooled container's waiter.
#[derive(Debug)]
pub struct WarmSession {
    engine: EngineBackend,
    name: String,
    dir: PathBuf,
    /// The engine client of the container, reaped at the end.
    client: Mutex<Option<tokio::process::Child>>,
    /// The waiter's host pid and a pidfd of it.
    pid: u32,
    pidfd: OwnedFd,
    /// The container's PID namespace, as `/proc/<pid>/ns/pid` reads.
    pid_ns: String,
    sock: Arc<UnixStream>,
    /// Whole messages to the waiter, one at a time (a command's and a signal's).
    writing: Arc<tokio::sync::Mutex<()>>,
    /// One command at a time.
    running: tokio::sync::Mutex<()>,
    /// Set when an exec gave up on the waiter's answer (it may still come, and would be
    /// read as the next command's): the session is then not alive.
    lost: AtomicBool,
    args: ImageArgs,
}

impl Slot {
    /// Makes this slot's container `spec`'s session (its workspace mounted in, the waiter
    /// the session's uid); on error the caller removes the container.
    pub async fn start_session(
        self,
        engine: &EngineBackend,
        spec: &SandboxSpec,
    ) -> Result<WarmSession, String> {
        let Slot {
            name,
            dir,
            child,
            mut sock,
            pid,
            pidfd,
            args,
            output,
        } = self;
        if output.is_some() {
            return Err("a gVisor slot cannot serve a session".into());
        }
        let mounts = claim_mounts(spec);
        let identity = identity(spec, &args);
        let pidfd =
            tokio::task::spawn_blocking(move || inject(&pidfd, &mounts, identity).map(|()| pidfd))
                .await
                .map_err(|e| format!("mount task: {e}"))?
                .map_err(|e| format!("cannot mount the session's workspace: {e}"))?;
        let hold = spec.timeout + KEEPALIVE_MARGIN;
        sock.write_all(&session_message(spec.host_uid, hold))
            .await
            .map_err(|e| format!("cannot send the session to the waiter: {e}"))?;
        let mut tag = [0u8; 1];
        match tokio::time::timeout(READY_BOUND, sock.read_exact(&mut tag)).await {
            Ok(Ok(_)) if tag[0] == b'H' => {}
            Ok(Ok(_)) if tag[0] == b'F' => {
                let mut e = [0u8; 4];
                let _ = sock.read_exact(&mut e).await;
                return Err(format!(
                    "the waiter could not become the session's user: {}",
                    std::io::Error::from_raw_os_error(i32::from_le_bytes(e))
                ));
            }
            _ => return Err("the waiter did not take the session".into()),
        }
        let pid_ns = pid_ns_of(pid as i32)
            .ok_or_else(|| format!("cannot read the PID namespace of pid {pid}"))?;
        Ok(WarmSession {
            engine: engine.clone(),
            name,
            dir,
            client: Mutex::new(Some(child)),
            pid,
            pidfd,
            pid_ns,
            sock: Arc::new(sock),
            writing: Arc::new(tokio::sync::Mutex::new(())),
            running: tokio::sync::Mutex::new(()),
            lost: AtomicBool::new(false),
            args,
        })
    }
}

/// `3`, uid, gid, hold seconds (`poolwaiter/src/session.rs`).
fn session_message(uid: u32, hold: Duration) -> Vec<u8> {
    framed(format!("3\0{uid}\0{uid}\0{}\0", hold.as_secs().max(1)).as_bytes())
}

/// `K`, the signal's number.
fn signal_message(sig: Signal) -> Vec<u8> {
    framed(format!("K\0{}\0", sig.number()).as_bytes())
}

impl WarmSession {
    /// Sends `spec`'s command with its pipes; its stdout and stderr read ends, and the
    /// stdin write end when the exec in scope wants one.
    async fn send_command(
        &self,
        spec: &SandboxSpec,
    ) -> Result<
        (
            super::Output,
            super::Output,
            Option<tokio::net::unix::pipe::Sender>,
        ),
        String,
    > {
        if spec.command.is_empty() {
            return Err("no command".into());
        }
        let msg = encode(spec, &spec.command, &self.args, false);
        let pipe = || -> Result<(OwnedFd, tokio::net::unix::pipe::Receiver), String> {
            let (w, r) = tokio::net::unix::pipe::pipe().map_err(|e| format!("pipe: {e}"))?;
            Ok((w.into_blocking_fd().map_err(|e| format!("pipe: {e}"))?, r))
        };
        let (out_w, out_r) = pipe()?;
        let (err_w, err_r) = pipe()?;
        let mut fds = Vec::new();
        let stdin = if exec_io::wants_stdin() {
            let (w, r) = tokio::net::unix::pipe::pipe().map_err(|e| format!("pipe: {e}"))?;
            let r = r.into_blocking_fd().map_err(|e| format!("pipe: {e}"))?;
            fds.push(r);
            Some(w)
        } else {
            None
        };
        fds.push(out_w);
        fds.push(err_w);
        let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
        {
            let _w = self.writing.lock().await;
            send(&self.sock, &msg, &raw)
                .await
                .map_err(|e| format!("cannot send the command to the waiter: {e}"))?;
        }
        drop(fds);
        Ok((Box::new(out_r), Box::new(err_r), stdin))
    }
}

#[async_trait::async_trait]
impl SessionSandbox for WarmSession {
    async fn exec(&self, spec: &SandboxSpec, cancel: &CancellationToken) -> SandboxOutcome {
        let started = Instant::now();
        let _one = self.running.lock().await;
        let (stdout, stderr, stdin) = match self.send_command(spec).await {
            Ok(sent) => sent,
            Err(e) => return SandboxOutcome::start_failed(e, started),
        };
        // A process the command leaves behind may hold its pipes: their capture ends with
        // the command.
        let ended = CancellationToken::new();
        let _end_on_return = ended.clone().drop_guard();
        let out = capture::spawn_until(
            Some(stdout),
            spec.output_cap,
            Which::Stdout,
            Some(ended.clone()),
        );
        let err = capture::spawn_until(
            Some(stderr),
            spec.output_cap,
            Which::Stderr,
            Some(ended.clone()),
        );
        let mut tag = [0u8; 1];
        let said = tokio::select! {
            r = read_exact(&self.sock, &mut tag) => r.ok().map(|()| tag[0]),
            _ = cancel.cancelled() => None,
            _ = tokio::time::sleep(READY_BOUND) => None,
        };
        match said {
            Some(b'S') => {}
            Some(b'F') => {
                let mut e = [0u8; 4];
                let _ = read_exact(&self.sock, &mut e).await;
            }
            _ => {
                self.lost.store(true, Ordering::SeqCst);
                return SandboxOutcome::start_failed(
                    "the session's container did not start the command".into(),
                    started,
                );
            }
        }
        exec_io::feed(stdin);
        if exec_io::in_scope() {
            exec_io::attach(Arc::new(WaiterSignaller {
                sock: self.sock.clone(),
                writing: self.writing.clone(),
            }))
            .await;
        }
        let (code, end) = tokio::select! {
            c = Running::exit_code(&self.sock) => (c, EndReason::Exited),
            _ = tokio::time::sleep(spec.timeout.saturating_sub(started.elapsed())) => (None, EndReason::TimedOut),
            _ = cancel.cancelled() => (None, EndReason::Canceled),
        };
        let code = match end {
            // Killed from the host; the waiter then reports its end.
            EndReason::TimedOut => {
                kill_in_namespace(&self.pid_ns, &[self.pid as i32], &self.name).await;
                tokio::time::timeout(KILLED_BOUND, Running::exit_code(&self.sock))
                    .await
                    .ok()
                    .flatten()
            }
            _ => code,
        };
        if code.is_none() {
            self.lost.store(true, Ordering::SeqCst);
        }
        ended.cancel();
        let outcome = SandboxOutcome::collected(code, out, err, end, started).await;
        super::super::engine_refused(
            outcome,
            self.engine.binary(),
            "run the command in the session container",
        )
    }

    /// The waiter's host pid: the container's network namespace.
    fn netns_pid(&self) -> Option<u32> {
        Some(self.pid)
    }

    /// The waiter lives (its pidfd), its socket is not hung up, and no answer of it was
    /// given up on.
    fn is_alive(&self) -> bool {
        if self.lost.load(Ordering::SeqCst) {
            return false;
        }
        let mut poll = libc::pollfd {
            fd: self.sock.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: poll of one valid descriptor with a zero timeout; pidfd_send_signal with
        // signal 0 (an existence check) on our own pidfd.
        unsafe {
            libc::poll(&mut poll, 1, 0) >= 0
                && poll.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) == 0
                && libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    self.pidfd.as_raw_fd(),
                    0,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                ) == 0
        }
    }

    async fn stop(&self) {
        self.engine.force_remove(&self.name).await;
        let client = self.client.lock().ok().and_then(|mut c| c.take());
        if let Some(mut child) = client {
            if tokio::time::timeout(Duration::from_secs(30), child.wait())
                .await
                .is_err()
            {
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
        }
        let dir = self.dir.clone();
        let _ = tokio::task::spawn_blocking(move || super::remove_slot_dir(&dir)).await;
    }
}

/// Signals the running command of a warm session through its waiter.
#[derive(Debug)]
struct WaiterSignaller {
    sock: Arc<UnixStream>,
    writing: Arc<tokio::sync::Mutex<()>>,
}

#[async_trait::async_trait]
impl Signaller for WaiterSignaller {
    async fn signal(&self, sig: Signal) -> Result<(), SignalError> {
        let _w = self.writing.lock().await;
        tokio::time::timeout(
            Duration::from_secs(10),
            send(&self.sock, &signal_message(sig), &[]),
        )
        .await
        .map_err(|_| SignalError::Failed("the session's container did not take the signal".into()))?
        .map_err(|e| SignalError::Failed(format!("cannot reach the session's container: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_message_names_the_uid_twice_and_the_hold() {
        let m = session_message(4_000_123, Duration::from_secs(3660));
        assert_eq!(&m[..4], &(m.len() as u32 - 4).to_le_bytes());
        assert_eq!(&m[4..], b"3\x004000123\x004000123\x003660\x00");
        assert!(session_message(1, Duration::ZERO).ends_with(b"\x001\x00"));
    }

    #[test]
    fn a_signal_message_is_its_number() {
        let m = signal_message(Signal::Term);
        assert_eq!(&m[4..], format!("K\0{}\0", libc::SIGTERM).as_bytes());
    }
}
