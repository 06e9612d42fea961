//! Session mode: the waiter as PID 1 of a session's container (runc/crun; not gVisor),
//! running each of the session's commands in turn. `worker/src/backend/engine/pool/
//! session.rs` is the worker's side.
//!
//! 1. Its first message is `3`, uid, gid, hold (seconds) instead of a job: the waiter
//!    becomes that uid and gid for good, with that gid its only group, every capability
//!    gone (bounding set first; checked with `capget`), no_new_privs, non-dumpable, and
//!    says `H`; or `F` and the errno, and exits. Then it zeroes its environment strings
//!    (every command's environment starts from the copy made before).
//! 2. It waits (`poll`) on the control socket, on `SIGCHLD` and the stop signals (a
//!    `signalfd`) and on the hold's end. On a message:
//!    - a job message (`2`, the one-job format, which must name the session's uid and
//!      gid, and no gVisor fields) with two descriptors (stdout, stderr; stdin is
//!      `/dev/null`) or three (stdin, stdout, stderr): forks it as a job is forked, but
//!      the child changes no credentials (it has the waiter's, checked: the session's uid
//!      and gid, no capability), then says `S`, or `F` and the errno; `F` and `EBUSY`
//!      while a command still runs (one at a time);
//!    - `K`, a signal number: signals the running command's process group (else the
//!      command alone); nothing runs: nothing is signalled.
//! 3. On `SIGCHLD` it reaps every child that has exited (PID 1 inherits the commands'
//!    orphans) and says `X` and the exit code when the command is among them (128 +
//!    signal when it was killed).
//! 4. End of file on the socket (the worker ended the session, or is gone, even after
//!    SIGKILL), a malformed message, the hold's end, or `SIGTERM`, `SIGINT`, `SIGHUP` or
//!    `SIGQUIT` from outside the container (an engine's `stop`; the signalfd's sender pid
//!    is 0 for a sender outside the namespace): it exits, and as PID 1 its exit ends the
//!    container: the kernel kills whatever is left, `--rm` removes it.
//!
//! What the session's processes can do to it: they run as its uid, but it is
//! non-dumpable (no ptrace, no `/proc/1/mem`, `/proc/1/fd` or `pidfd_getfd` without
//! `CAP_SYS_PTRACE`) and the namespace's init (a signal from inside its namespace is
//! dropped unless it handles it; it handles none: the signals it watches are blocked
//! and read from the signalfd, and one sent from inside is dropped there). What they can do (lower its rlimits, say) ends their own session only; it
//! holds no privilege to gain and no secret: its only input is the worker's socket.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::{
    become_user, decode, errno, receive, send, spawn, tell_exec_failure, wipe_environment, BaseEnv,
    Creds, Spawned, Stdio,
};

/// The first field of the session message.
pub const KIND: &[u8] = b"3\0";
/// The first field of a signal message.
const SIGNAL: &[u8] = b"K\0";
/// The longest hold a session asks for (a week): a bound on a bad number, not a policy.
const MAX_HOLD: u64 = 7 * 24 * 3600;

/// Serves the session that `first` (the session message) describes; never returns.
pub fn serve(mut sock: UnixStream, first: &[u8], base: BaseEnv) -> ! {
    let Some((uid, gid, hold)) = parse(first) else {
        eprintln!("cynode-pool-waiter: bad session message");
        std::process::exit(2);
    };
    if let Err(e) = become_user(uid, gid) {
        let mut msg = vec![b'F'];
        msg.extend_from_slice(&e.to_le_bytes());
        let _ = send(&sock, &msg);
        std::process::exit(2);
    }
    // SAFETY: prctl with integer arguments (a change of credentials may have reset it).
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    wipe_environment();
    let Ok(children) = child_signals() else {
        let mut msg = vec![b'F'];
        msg.extend_from_slice(&errno().to_le_bytes());
        let _ = send(&sock, &msg);
        std::process::exit(2);
    };
    if send(&sock, b"H").is_err() {
        std::process::exit(0);
    }
    let until = Instant::now() + hold;
    let mut running: Option<libc::pid_t> = None;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            std::process::exit(0);
        }
        let mut fds = [
            libc::pollfd {
                fd: sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: children.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = left.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: two valid pollfds.
        if unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) } < 0 {
            if errno() == libc::EINTR {
                continue;
            }
            std::process::exit(2);
        }
        if fds[1].revents != 0 {
            if drain(&children) {
                // The engine stops the container: its end is the waiter's.
                std::process::exit(0);
            }
            if let Some(code) = reap_all(running) {
                running = None;
                let mut msg = vec![b'X'];
                msg.extend_from_slice(&code.to_le_bytes());
                if send(&sock, &msg).is_err() {
                    std::process::exit(0);
                }
            }
        }
        if fds[0].revents != 0 {
            let (body, passed) = match receive(&mut sock, 3) {
                Ok(Some(m)) => m,
                // The worker is gone (or spoke nonsense): the session ends with this.
                _ => std::process::exit(0),
            };
            if body.starts_with(SIGNAL) {
                if let (Some(pid), Some(sig)) = (running, parse_signal(&body)) {
                    // SAFETY: signalling the command's own group, else the command.
                    unsafe {
                        if libc::kill(-pid, sig) != 0 {
                            libc::kill(pid, sig);
                        }
                    }
                }
                continue;
            }
            if running.is_some() {
                let mut msg = vec![b'F'];
                msg.extend_from_slice(&libc::EBUSY.to_le_bytes());
                let _ = send(&sock, &msg);
                continue;
            }
            match start(&sock, &body, passed, &base, (uid, gid)) {
                Ok(pid) => running = pid,
                Err(()) => std::process::exit(0),
            }
        }
    }
}

/// Starts one command and says `S` or `F`: its pid (also when its exec failed: it exits
/// 127 or 126 and is reaped as any other), `None` when it could not be forked (its `F`
/// and `X` are said), `Err` when the message is malformed or the socket is gone.
fn start(
    sock: &UnixStream,
    body: &[u8],
    passed: Vec<OwnedFd>,
    base: &BaseEnv,
    (uid, gid): (u32, u32),
) -> Result<Option<libc::pid_t>, ()> {
    let job = decode(body, base).map_err(|_| ())?;
    if job.uid != uid || job.gid != gid || !job.mounts.is_empty() || job.identity.is_some() {
        return Err(());
    }
    let (stdin, out, err) = match <[OwnedFd; 3]>::try_from(passed) {
        Ok([i, o, e]) => (Some(i), o, e),
        Err(v) => {
            let [o, e] = <[OwnedFd; 2]>::try_from(v).map_err(|_| ())?;
            (None, o, e)
        }
    };
    let stdio = Stdio {
        stdin: stdin.as_ref().map(AsRawFd::as_raw_fd),
        stdout: out.as_raw_fd(),
        stderr: err.as_raw_fd(),
    };
    let spawned = spawn(&job, &stdio, &[], Creds::Inherited);
    drop((stdin, out));
    match spawned {
        Spawned::Running(pid) => {
            drop(err);
            send(sock, b"S").map_err(|_| ())?;
            Ok(Some(pid))
        }
        Spawned::ExecFailed(pid, e) => {
            tell_exec_failure(sock, err, &job, e);
            Ok(Some(pid))
        }
        Spawned::NotForked(e) => {
            // Nothing runs: said as a failed exec whose exit follows at once.
            let mut msg = vec![b'F'];
            msg.extend_from_slice(&e.to_le_bytes());
            msg.push(b'X');
            msg.extend_from_slice(&127i32.to_le_bytes());
            send(sock, &msg).map_err(|_| ())?;
            Ok(None)
        }
    }
}

/// `3`, uid, gid, hold seconds.
fn parse(body: &[u8]) -> Option<(u32, u32, Duration)> {
    let mut f = body.strip_prefix(KIND)?.split(|b| *b == 0);
    let mut num = || -> Option<u64> { std::str::from_utf8(f.next()?).ok()?.parse().ok() };
    let uid = u32::try_from(num()?).ok()?;
    let gid = u32::try_from(num()?).ok()?;
    let hold = num()?;
    // Never root, never -1 ("unchanged" to setresuid).
    if uid == 0 || gid == 0 || uid == u32::MAX || gid == u32::MAX || hold == 0 {
        return None;
    }
    Some((uid, gid, Duration::from_secs(hold.min(MAX_HOLD))))
}

/// `K`, a signal number from 1 to 64.
fn parse_signal(body: &[u8]) -> Option<i32> {
    let mut f = body.strip_prefix(SIGNAL)?.split(|b| *b == 0);
    let sig: i32 = std::str::from_utf8(f.next()?).ok()?.parse().ok()?;
    (1..=64).contains(&sig).then_some(sig)
}

/// The signals the waiter reads from its signalfd: a child's end, and the ones an engine
/// stops a container with (heeded only from outside the container).
const WATCHED: [libc::c_int; 5] = [
    libc::SIGCHLD,
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGQUIT,
];

/// A signalfd of [`WATCHED`], which are blocked (so they are never delivered, and read
/// here).
fn child_signals() -> std::io::Result<OwnedFd> {
    // SAFETY: a zeroed sigset filled by sigemptyset/sigaddset; signalfd returns a new
    // descriptor we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in WATCHED {
            libc::sigaddset(&mut set, sig);
        }
        if libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// Reads what the signalfd holds (each read takes one queued signal); whether a stop
/// signal came from outside the container (`ssi_pid` 0: a sender in no process of this
/// PID namespace, the engine or the host). One from a process of the session's own is
/// dropped, as the kernel drops every signal it sends to its namespace's init.
fn drain(fd: &OwnedFd) -> bool {
    let mut stop = false;
    loop {
        // SAFETY: an all-zero signalfd_siginfo is valid; read fills at most its size.
        let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
        let want = std::mem::size_of::<libc::signalfd_siginfo>();
        // SAFETY: reading into a buffer of a signalfd_siginfo's size.
        let n = unsafe { libc::read(fd.as_raw_fd(), (&raw mut info).cast(), want) };
        if n != want as isize {
            return stop;
        }
        if info.ssi_signo != libc::SIGCHLD as u32 && info.ssi_pid == 0 {
            stop = true;
        }
    }
}

/// Reaps every child that has exited; the exit code of `running` when it is among them
/// (128 + the signal when killed).
fn reap_all(running: Option<libc::pid_t>) -> Option<i32> {
    let mut code = None;
    loop {
        let mut status = 0;
        // SAFETY: a valid status pointer.
        let r = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if r <= 0 {
            if r < 0 && errno() == libc::EINTR {
                continue;
            }
            return code;
        }
        if Some(r) == running {
            if libc::WIFEXITED(status) {
                code = Some(libc::WEXITSTATUS(status));
            } else if libc::WIFSIGNALED(status) {
                code = Some(128 + libc::WTERMSIG(status));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_message_is_checked() {
        assert_eq!(
            parse(b"3\x001000\x001000\x0060\x00"),
            Some((1000, 1000, Duration::from_secs(60)))
        );
        assert_eq!(
            parse(b"3\x00\x31\x002\x00999999999\x00").map(|p| p.2),
            Some(Duration::from_secs(MAX_HOLD))
        );
        for bad in [
            &b"3\x000\x001000\x0060\x00"[..],
            b"3\x001000\x000\x0060\x00",
            b"3\x004294967295\x001000\x0060\x00",
            b"3\x001000\x001000\x000\x00",
            b"3\x001000\x001000\x00",
            b"3\x00-1\x001000\x0060\x00",
            b"2\x001000\x001000\x0060\x00",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_signal_is_a_number_in_range() {
        assert_eq!(parse_signal(b"K\x0015\x00"), Some(15));
        assert_eq!(parse_signal(b"K\x0064\x00"), Some(64));
        for bad in [&b"K\x000\x00"[..], b"K\x0065\x00", b"K\x00x\x00", b"K\x00"] {
            assert_eq!(parse_signal(bad), None, "{bad:?}");
        }
    }
}
