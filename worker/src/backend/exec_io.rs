//! The standard input and the signals of a running streamed session exec, between the
//! session layer (which holds an [`ExecIo`] per exec) and the backend that runs the
//! command (which finds it in scope, as it finds the output's [`super::capture::Tap`]).
//!
//! - Standard input: an exec started with `"stdin": true` wants a piped stdin
//!   ([`wants_stdin`]); the backend spawns its client so and hands the pipe to [`feed`],
//!   which writes each chunk the session layer queues, in order, and closes the pipe when
//!   the session layer closes its end (the command then reads end of file). Every other
//!   command keeps a closed stdin (`/dev/null`).
//! - Signals: once the command runs, the backend [`attach`]es a [`Signaller`] that
//!   reaches that command's processes only (bubblewrap: the processes of the sandbox's
//!   own cgroup, through pidfds; Podman/Docker/gVisor: the pid the command's wrapper
//!   recorded in the container, signalled from a second exec there). The session layer
//!   [`ExecIo::revoke`]s it once the backend's exec returned, after any delivery in
//!   flight, so no signal is ever sent for an exec that has ended.

use std::sync::{Arc, Mutex};

use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot, RwLock};

/// A signal a client may send to an exec: the allow-list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Term,
    Int,
    Kill,
    Hup,
    Quit,
    Usr1,
    Usr2,
}

impl Signal {
    /// Every allowed signal, by its name without `SIG`.
    pub const ALL: [Signal; 7] = [
        Signal::Term,
        Signal::Int,
        Signal::Kill,
        Signal::Hup,
        Signal::Quit,
        Signal::Usr1,
        Signal::Usr2,
    ];

    /// The name without `SIG` (`TERM`), as the API and `kill -s` take it.
    pub fn name(self) -> &'static str {
        match self {
            Signal::Term => "TERM",
            Signal::Int => "INT",
            Signal::Kill => "KILL",
            Signal::Hup => "HUP",
            Signal::Quit => "QUIT",
            Signal::Usr1 => "USR1",
            Signal::Usr2 => "USR2",
        }
    }

    /// The signal's number on Linux.
    pub fn number(self) -> i32 {
        match self {
            Signal::Term => libc::SIGTERM,
            Signal::Int => libc::SIGINT,
            Signal::Kill => libc::SIGKILL,
            Signal::Hup => libc::SIGHUP,
            Signal::Quit => libc::SIGQUIT,
            Signal::Usr1 => libc::SIGUSR1,
            Signal::Usr2 => libc::SIGUSR2,
        }
    }

    /// The allowed signal named `name` (exactly, upper case, without `SIG`).
    pub fn parse(name: &str) -> Option<Signal> {
        Signal::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// Why a signal was not delivered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignalError {
    /// The command has no process left to signal (it ended).
    #[error("the command has ended")]
    Ended,
    /// The command is not running yet (its signaller is not attached): retry.
    #[error("the command is not running yet; retry")]
    NotStarted,
    /// The delivery itself failed.
    #[error("{0}")]
    Failed(String),
}

/// How long a signal waits for a command that is still starting (its sandbox being set
/// up, its pid not yet recorded) before it answers [`SignalError::NotStarted`].
pub const START_BOUND: std::time::Duration = std::time::Duration::from_secs(5);

/// Calls `attempt` until it answers other than [`SignalError::NotStarted`], for at most
/// [`START_BOUND`].
pub async fn retry_while_starting<F, Fut>(mut attempt: F) -> Result<(), SignalError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), SignalError>>,
{
    let until = tokio::time::Instant::now() + START_BOUND;
    loop {
        match attempt().await {
            Err(SignalError::NotStarted) if tokio::time::Instant::now() < until => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            other => return other,
        }
    }
}

/// How a backend signals the processes of one command.
#[async_trait::async_trait]
pub trait Signaller: Send + Sync + std::fmt::Debug {
    /// Delivers `sig` to the command's process group; bounded in time.
    async fn signal(&self, sig: Signal) -> Result<(), SignalError>;
}

/// One chunk for the command's stdin, and where the write's result goes.
pub type StdinChunk = (Vec<u8>, oneshot::Sender<std::io::Result<()>>);

/// The stdin and signals of one exec.
#[derive(Debug)]
pub struct ExecIo {
    /// The receiving end of the stdin queue, until the backend takes it ([`feed`]);
    /// `None` from the start for an exec without stdin.
    stdin: Mutex<Option<mpsc::Receiver<StdinChunk>>>,
    /// Whether the exec was started with a stdin.
    wants_stdin: bool,
    /// The backend's signaller while the command runs.
    signaller: RwLock<Option<Arc<dyn Signaller>>>,
    /// Set once revoked: nothing attaches after the exec returned.
    revoked: std::sync::atomic::AtomicBool,
}

impl ExecIo {
    /// An exec's io; with `stdin`, the sending end of its stdin queue too.
    pub fn new(stdin: bool) -> (Arc<ExecIo>, Option<mpsc::Sender<StdinChunk>>) {
        let (tx, rx) = match stdin {
            true => {
                let (tx, rx) = mpsc::channel(1);
                (Some(tx), Some(rx))
            }
            false => (None, None),
        };
        let io = Arc::new(ExecIo {
            stdin: Mutex::new(rx),
            wants_stdin: stdin,
            signaller: RwLock::new(None),
            revoked: std::sync::atomic::AtomicBool::new(false),
        });
        (io, tx)
    }

    /// Delivers `sig` through the attached signaller (a revoke waits for it).
    pub async fn signal(&self, sig: Signal) -> Result<(), SignalError> {
        let held = self.signaller.read().await;
        match held.as_ref() {
            Some(s) => s.signal(sig).await,
            None if self.revoked.load(std::sync::atomic::Ordering::SeqCst) => {
                Err(SignalError::Ended)
            }
            None => Err(SignalError::NotStarted),
        }
    }

    /// Drops the signaller once any delivery in flight is done; later signals answer
    /// [`SignalError::Ended`].
    pub async fn revoke(&self) {
        self.revoked
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.signaller.write().await.take();
        if let Ok(mut rx) = self.stdin.lock() {
            rx.take();
        }
    }
}

tokio::task_local! {
    static IO: Arc<ExecIo>;
}

/// Runs `f` (a backend's exec) with `io` in scope.
pub async fn scoped<F: std::future::Future>(io: Arc<ExecIo>, f: F) -> F::Output {
    IO.scope(io, f).await
}

/// Whether the exec in scope wants a piped stdin (none in scope: no).
pub fn wants_stdin() -> bool {
    IO.try_with(|io| io.wants_stdin).unwrap_or(false)
}

/// Whether a streamed exec is in scope (its command should be signallable).
pub fn in_scope() -> bool {
    IO.try_with(|_| ()).is_ok()
}

/// Hands the command's stdin pipe to a task that writes the queued chunks into it, in
/// order, and closes it when the queue closes (or a write fails: the reader is gone).
pub fn feed<W: tokio::io::AsyncWrite + Unpin + Send + 'static>(pipe: Option<W>) {
    let Some(mut pipe) = pipe else { return };
    let rx = IO
        .try_with(|io| io.stdin.lock().ok().and_then(|mut rx| rx.take()))
        .ok()
        .flatten();
    let Some(mut rx) = rx else { return };
    tokio::spawn(async move {
        while let Some((bytes, done)) = rx.recv().await {
            let wrote = match pipe.write_all(&bytes).await {
                Ok(()) => pipe.flush().await,
                Err(e) => Err(e),
            };
            let failed = wrote.is_err();
            let _ = done.send(wrote);
            if failed {
                break;
            }
        }
        let _ = pipe.shutdown().await;
    });
}

/// Attaches `signaller` to the exec in scope (none in scope, or already revoked:
/// nothing).
pub async fn attach(signaller: Arc<dyn Signaller>) {
    let Ok(io) = IO.try_with(Arc::clone) else {
        return;
    };
    let mut held = io.signaller.write().await;
    if !io.revoked.load(std::sync::atomic::Ordering::SeqCst) {
        *held = Some(signaller);
    }
}

/// Opens a pidfd for `pid` (`pidfd_open(2)`).
pub fn pidfd_open(pid: i32) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: a plain syscall on integers; the descriptor it answers is ours to own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor no one else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// Sends `sig` (0: only checks) to the process of `pidfd` (`pidfd_send_signal(2)`): a
/// process that ended is `ESRCH`, never another one that took its pid.
pub fn pidfd_send_signal(pidfd: &std::os::fd::OwnedFd, sig: i32) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain syscall on a descriptor we own; no siginfo is passed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allow_list_is_exact() {
        for s in Signal::ALL {
            assert_eq!(Signal::parse(s.name()), Some(s));
        }
        for bad in ["term", "SIGTERM", "STOP", "9", "", "TERM ", "CONT"] {
            assert_eq!(Signal::parse(bad), None, "{bad}");
        }
    }

    #[tokio::test]
    async fn a_revoked_io_answers_ended_and_takes_no_signaller() {
        #[derive(Debug)]
        struct Never;
        #[async_trait::async_trait]
        impl Signaller for Never {
            async fn signal(&self, _: Signal) -> Result<(), SignalError> {
                Ok(())
            }
        }
        let (io, _) = ExecIo::new(false);
        assert_eq!(io.signal(Signal::Term).await, Err(SignalError::NotStarted));
        scoped(io.clone(), attach(Arc::new(Never))).await;
        assert_eq!(io.signal(Signal::Term).await, Ok(()));
        io.revoke().await;
        assert_eq!(io.signal(Signal::Term).await, Err(SignalError::Ended));
        scoped(io.clone(), attach(Arc::new(Never))).await;
        assert_eq!(io.signal(Signal::Term).await, Err(SignalError::Ended));
    }

    #[test]
    fn a_pidfd_of_an_ended_child_signals_nothing() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let fd = pidfd_open(child.id() as i32).unwrap();
        child.wait().unwrap();
        let e = pidfd_send_signal(&fd, libc::SIGTERM).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ESRCH));
    }
}
