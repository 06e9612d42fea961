//! The waiter's gVisor mode (`cynode-pool-waiter SOCKET --gvisor`, for `runtime: runsc`).
//!
//! Under gVisor the job's file system is the sentry's own, and descriptors of host pipes
//! are not imported from a host socket, so a runc claim's two steps (mounts moved into
//! the container from the host, the job's stdout/stderr passed over the control socket)
//! cannot work. In this mode:
//! - **At start** (before the claim, nothing of any job in the container): the node's
//!   seccomp programs are read from `/.cynode/filter-<n>.bpf` (the container runs without
//!   an OCI profile, so the waiter may mount; the job gets these filters, the programs
//!   bubblewrap gets, installed before its exec), and two more host sockets of the slot,
//!   `out.sock` and `err.sock`, are connected before the control socket (`host-uds=open`).
//! - **At the claim** the worker has mounted the job's directories on the host under the
//!   slot's `mnt/` directory (`nosuid,nodev`, read-only where the job says, set before
//!   they reach it, so the copies that propagate carry them), which the container sees at
//!   `/.cynode-mnt` with `rslave` propagation. The waiter (root, with gVisor's own
//!   `CAP_SYS_ADMIN`) unmounts each placeholder, binds `/.cynode-mnt/<name>` onto it,
//!   adds Podman's passwd and group entries when asked, and detaches `/.cynode-mnt` and
//!   `/.cynode`.
//!   A failure here is reported as `M` and the errno: nothing of the job ran, and the
//!   worker runs it cold.
//! - **Output**: the job's stdout and stderr are pipes made here (a socket would make
//!   `echo x >/dev/stderr` fail with `ENXIO`), which the waiter copies to the two host
//!   sockets until the job has exited, then drains what the job wrote before it exited.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use crate::{errno, Job};

/// The slot's directory in the container (filters, sockets, the waiter itself).
const DIR: &str = "/.cynode";
/// Where the job's directories arrive.
const MNT: &str = "/.cynode-mnt";
/// How long the waiter drains the job's pipes after it exited (what a background process
/// of the job writes later is lost, as with a cold container, whose end kills it).
const DRAIN_BOUND: Duration = Duration::from_millis(200);

/// What the mode holds from its start.
pub struct Gvisor {
    pub filters: Vec<Vec<u8>>,
    pub out: UnixStream,
    pub err: UnixStream,
    /// Device and inode of the empty staging directories as first seen: a claim whose
    /// mount did not arrive (no propagation) still shows them.
    empty: Vec<(String, (u64, u64))>,
}

/// Device and inode of `path`.
fn identity_of(path: &str) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path)?;
    Ok((m.dev(), m.ino()))
}

/// Reads the filters and connects the output sockets (before the control socket: the
/// worker accepts those once it has accepted the control connection).
pub fn start() -> Result<Gvisor, String> {
    let filters = crate::load_filters(std::path::Path::new(DIR))?;
    let connect = |name: &str| {
        UnixStream::connect(format!("{DIR}/{name}"))
            .map_err(|e| format!("cannot connect to {DIR}/{name}: {e}"))
    };
    let mut empty = Vec::new();
    for name in ["job", "workspace"] {
        let path = format!("{MNT}/{name}");
        let id = identity_of(&path).map_err(|e| format!("{path}: {e}"))?;
        empty.push((name.to_string(), id));
    }
    Ok(Gvisor {
        filters,
        out: connect("out.sock")?,
        err: connect("err.sock")?,
        empty,
    })
}

fn c(s: &str) -> CString {
    CString::new(s).unwrap_or_default()
}

/// `Err((errno, what))` of the last call.
fn fail(what: String) -> (i32, String) {
    let e = errno();
    (
        e,
        format!("{what}: {}", std::io::Error::from_raw_os_error(e)),
    )
}

/// Binds `source` onto `target` (`MS_BIND`, no flags: gVisor takes none).
fn bind(source: &str, target: &str) -> Result<(), (i32, String)> {
    let (s, t) = (c(source), c(target));
    // SAFETY: mount with valid C strings and null type and data.
    let r = unsafe {
        libc::mount(
            s.as_ptr(),
            t.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(fail(format!("bind {source} onto {target}")));
    }
    Ok(())
}

/// The job's mounts and identity, then the staging mounts go (see the module doc).
pub fn prepare(job: &Job, g: &Gvisor) -> Result<(), (i32, String)> {
    for m in &job.mounts {
        let path = format!("{MNT}/{}", m.name);
        let arrived = identity_of(&path).map_err(|_| fail(format!("stat {path}")))?;
        if g.empty.iter().any(|(n, id)| *n == m.name && *id == arrived) {
            return Err((
                libc::ENOENT,
                format!("the worker's mount of {path} did not reach the container"),
            ));
        }
        // gVisor (runsc 2022) takes no remount, and no flags with MS_BIND: the options are
        // the host mount's, which the worker made `nosuid,nodev` (and read-only where the
        // job says) before it reached the staging directory.
        let target = &m.target;
        // SAFETY: umount2 with a valid C string.
        if unsafe { libc::umount2(c(target).as_ptr(), libc::MNT_DETACH) } != 0 {
            return Err(fail(format!("umount the placeholder {target}")));
        }
        bind(&path, target)?;
    }
    if let Some(workdir) = &job.identity {
        identity(job.uid, workdir)?;
    }
    for dir in [MNT, DIR] {
        // SAFETY: a valid C string.
        if unsafe { libc::umount2(c(dir).as_ptr(), libc::MNT_DETACH) } != 0 {
            return Err(fail(format!("umount {dir}")));
        }
    }
    Ok(())
}

/// For each of /etc/passwd and /etc/group that exists and has no entry for `uid`: the
/// image's file plus Podman's line, written to the staging directory (root's, 0644) and
/// bound over it (as the worker does from the host for runc).
fn identity(uid: u32, workdir: &str) -> Result<(), (i32, String)> {
    use std::io::{Read, Write};
    use std::os::unix::fs::OpenOptionsExt;
    for name in ["passwd", "group"] {
        let target = format!("/etc/{name}");
        let Ok(image) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&target)
        else {
            continue;
        };
        let mut text = Vec::new();
        image
            .take(1024 * 1024)
            .read_to_end(&mut text)
            .map_err(|_| fail(format!("read {target}")))?;
        let id = uid.to_string();
        if text
            .split(|b| *b == b'\n')
            .any(|l| l.split(|b| *b == b':').nth(2) == Some(id.as_bytes()))
        {
            continue;
        }
        if !text.is_empty() && !text.ends_with(b"\n") {
            text.push(b'\n');
        }
        let line = if name == "passwd" {
            format!("{id}:*:{id}:{id}:container user:{workdir}:/bin/sh\n")
        } else {
            format!("{id}:x:{id}:{id}\n")
        };
        text.extend_from_slice(line.as_bytes());
        let staged = format!("{MNT}/{name}");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&staged)
            .map_err(|_| fail(format!("create {staged}")))?;
        f.write_all(&text)
            .map_err(|_| fail(format!("write {staged}")))?;
        drop(f);
        bind(&staged, &target)?;
    }
    Ok(())
}

/// The write end of the self-pipe SIGCHLD wakes the relay through.
static WAKE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_child(_: libc::c_int) {
    let fd = WAKE.load(Ordering::Relaxed);
    if fd >= 0 {
        // SAFETY: write(2) is async-signal-safe; one byte from a static.
        unsafe { libc::write(fd, b"c".as_ptr().cast(), 1) };
    }
}

/// The read ends of the job's two pipes and the self-pipe, made before the fork.
pub struct Pipes {
    read: [OwnedFd; 2],
    wake: OwnedFd,
    _wake_w: OwnedFd,
}

fn pipe(flags: libc::c_int) -> Result<[OwnedFd; 2], i32> {
    let mut p = [0; 2];
    // SAFETY: an array of two ints.
    if unsafe { libc::pipe2(p.as_mut_ptr(), flags) } != 0 {
        return Err(errno());
    }
    // SAFETY: both descriptors are new and ours.
    Ok(unsafe { [OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])] })
}

/// The pipes (the write ends, the job's stdout and stderr, apart), and the SIGCHLD handler
/// that writes to the self-pipe.
pub fn pipes() -> Result<([OwnedFd; 2], Pipes), i32> {
    let [out_r, out_w] = pipe(libc::O_CLOEXEC)?;
    let [err_r, err_w] = pipe(libc::O_CLOEXEC)?;
    let [wake, wake_w] = pipe(libc::O_CLOEXEC | libc::O_NONBLOCK)?;
    for fd in [&out_r, &err_r] {
        // SAFETY: fcntl on our own descriptors.
        unsafe {
            let fl = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
    }
    WAKE.store(wake_w.as_raw_fd(), Ordering::Relaxed);
    // SAFETY: a zeroed sigaction with our handler; the job's exec resets it to default.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_child as extern "C" fn(libc::c_int) as usize;
        sa.sa_flags = libc::SA_RESTART | libc::SA_NOCLDSTOP;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGCHLD, &sa, std::ptr::null_mut()) != 0 {
            return Err(errno());
        }
    }
    Ok((
        [out_w, err_w],
        Pipes {
            read: [out_r, err_r],
            wake,
            _wake_w: wake_w,
        },
    ))
}

/// Copies the job's output to the host sockets until `pid` has exited (reaping orphans
/// as PID 1 does), then drains what is left, bounded; the job's exit code.
pub fn relay(pid: libc::pid_t, p: Pipes, g: &Gvisor) -> i32 {
    let socks = [g.out.as_raw_fd(), g.err.as_raw_fd()];
    let mut open = [true, true];
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if let Some(code) = crate::reap(pid, libc::WNOHANG) {
            let until = Instant::now() + DRAIN_BOUND;
            for i in 0..2 {
                while open[i]
                    && Instant::now() < until
                    && copy(p.read[i].as_raw_fd(), socks[i], &mut buf) == Copied::Some
                {
                }
            }
            return code;
        }
        let mut fds = [
            poll_fd(&p.read[0], open[0]),
            poll_fd(&p.read[1], open[1]),
            poll_fd(&p.wake, true),
        ];
        // SAFETY: an array of three pollfd.
        if unsafe { libc::poll(fds.as_mut_ptr(), 3, -1) } < 0 {
            continue;
        }
        for i in 0..2 {
            if open[i] && fds[i].revents != 0 {
                open[i] = copy(p.read[i].as_raw_fd(), socks[i], &mut buf) != Copied::End;
            }
        }
        if fds[2].revents != 0 {
            // SAFETY: reading our non-blocking self-pipe into a local buffer.
            while unsafe { libc::read(p.wake.as_raw_fd(), buf.as_mut_ptr().cast(), 64) } > 0 {}
        }
    }
}

fn poll_fd(fd: &OwnedFd, on: bool) -> libc::pollfd {
    libc::pollfd {
        fd: if on { fd.as_raw_fd() } else { -1 },
        events: libc::POLLIN,
        revents: 0,
    }
}

/// What one [`copy`] found.
#[derive(PartialEq, Eq)]
enum Copied {
    Some,
    /// Nothing waiting (the pipe is non-blocking).
    Empty,
    /// The pipe is at its end: every writer closed it.
    End,
}

/// One read from the pipe `from`, sent on the socket `to`. Output the host no longer takes
/// is read and dropped, so the job never blocks on it.
fn copy(from: RawFd, to: RawFd, buf: &mut [u8]) -> Copied {
    // SAFETY: reading into our buffer.
    let n = unsafe { libc::read(from, buf.as_mut_ptr().cast(), buf.len()) };
    match n {
        0 => Copied::End,
        n if n < 0 => match errno() {
            libc::EAGAIN | libc::EINTR => Copied::Empty,
            _ => Copied::End,
        },
        n => {
            let _ = crate::send_fd(to, &buf[..n as usize]);
            Copied::Some
        }
    }
}
