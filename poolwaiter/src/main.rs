//! `cynode-pool-waiter`: PID 1 of a pooled (warm) Podman/Docker sandbox of the worker
//! (`worker/src/backend/engine/pool.rs` has the design). Statically linked, so it runs in
//! any image; the worker mounts it read-only at `/.cynode/` with the slot's control socket.
//!
//! 1. Makes itself non-dumpable, connects to the control socket given as its first argument
//!    (the worker listens there; it unlinks the socket as soon as this connection is
//!    accepted), and says `R` (ready). With `--gvisor` after it, see [`gvisor`] (its
//!    output sockets and filters first, its mounts at the claim).
//! 2. Waits for one job: `u32` length (little endian) and that many bytes of NUL-terminated
//!    fields: `2`, uid, gid, cwd, home (the engine's fallback `HOME`), argc, argv…, envc,
//!    env…, mountc, mount targets… (gVisor only: `/job`, `/workspace`), identity (`1`:
//!    add Podman's passwd entry, gVisor only; else `0`), with the job's stdout and stderr
//!    (pipes of the worker) passed as two descriptors (`SCM_RIGHTS`) on the same message
//!    (none under gVisor). Then zeroes its own environment strings.
//!    End of file instead of a job (the worker went away): exits 0, so the container ends.
//! 3. Forks the job. The child: stdin `/dev/null`, stdout/stderr the passed pipes, a
//!    session of its own, every capability dropped from the bounding set, the job's gid as
//!    its only supplementary group (as runc sets it), gid and uid set to the job's (which
//!    clears the permitted, effective and
//!    ambient sets; checked with `capget`, and the job is not started when any is left),
//!    no_new_privs, the job's working directory, every other descriptor close-on-exec, then
//!    `execve` of argv[0] (looked up in the job's `PATH` when it has no slash) with the
//!    waiter's own environment (the image's and the engine's), `HOME` of the job's uid and
//!    the job's variables over them. The seccomp
//!    profile, cgroup limits and namespaces are the container's own, inherited.
//! 4. Drops its own capabilities (and under gVisor takes the node's filters). Says `S` once
//!    the job runs (exec succeeded: the close-on-exec error pipe closed), or
//!    `F` and the errno when it could not be started (and writes why on the job's stderr,
//!    exit code 127, or 126 for a permission error); under gVisor, `M` and the errno when
//!    the job's directories could not be bound (nothing ran).
//! 5. Reaps children until the job itself has exited, says `X` and its exit code (128 +
//!    signal when it was killed, as the engines report), and exits: as PID 1 its exit ends
//!    the container, and the kernel kills whatever the job left behind.
//!
//! **A session** (runc/crun): a first message `3` (uid, gid, hold) instead of a job makes
//! the waiter the session's PID 1, running each command it is sent ([`session`]).
//!
//! **`--seccomp-exec DIR -- COMMAND…`**, a second use: installs the node's seccomp filters
//! (`DIR/filter-0.bpf`, `filter-1.bpf`, …: raw `struct sock_filter` arrays, the programs
//! bubblewrap gets) with no_new_privs, then executes COMMAND (looked up in `PATH`). The
//! worker runs a gVisor session's commands through it: `runsc exec` does not apply the
//! container's OCI seccomp profile to them, gVisor's kernel applies a filter a process
//! installs. Any failure before the exec exits 126 (127: the command is not found)
//! without running the command.
//!
//! **`--bwrap EXE CTL READY`**, a third use: the command of a warm bubblewrap sandbox,
//! which waits for one job and becomes it ([`bwrap`]).
//!
//! The job (another uid, no capabilities) can neither signal nor ptrace this process (it
//! is root's, non-dumpable, and PID 1 of the namespace), nor open its descriptors through
//! `/proc/1/fd` (tested on runc and gVisor); the socket's name is gone and its directory
//! unmounted before the job is sent.

use std::ffi::{CStr, CString};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// The longest job message the waiter accepts.
const MAX_MESSAGE: usize = 8 * 1024 * 1024;
/// The PATH used when the job's environment has none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

mod bwrap;
mod gvisor;
mod session;

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|a| a == "--seccomp-exec") {
        seccomp_exec(&args[2..]);
    }
    if args.get(1).is_some_and(|a| a == "--bwrap") {
        bwrap::main(&args[2..]);
    }
    // SAFETY: prctl with an integer argument.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    let Some(path) = args.get(1) else {
        eprintln!("cynode-pool-waiter: usage: cynode-pool-waiter SOCKET [--gvisor]");
        std::process::exit(2);
    };
    let gvisor = match args.get(2) {
        None => None,
        Some(a) if a == "--gvisor" => match gvisor::start() {
            Ok(g) => Some(g),
            Err(e) => {
                eprintln!("cynode-pool-waiter: {e}");
                std::process::exit(2);
            }
        },
        Some(a) => {
            eprintln!("cynode-pool-waiter: unknown argument {a:?}");
            std::process::exit(2);
        }
    };
    let mut sock = match UnixStream::connect(path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cynode-pool-waiter: cannot connect to {path:?}: {e}");
            std::process::exit(2);
        }
    };
    if send(&sock, b"R").is_err() {
        std::process::exit(2);
    }
    let base = base_environment();
    let want_fds = if gvisor.is_some() { 0 } else { 2 };
    let (body, fds) = match receive(&mut sock, 2) {
        Ok(Some(m)) => m,
        Ok(None) => std::process::exit(0),
        Err(e) => {
            eprintln!("cynode-pool-waiter: bad job message: {e}");
            std::process::exit(2);
        }
    };
    if body.starts_with(session::KIND) && gvisor.is_none() && fds.is_empty() {
        session::serve(sock, &body, base);
    }
    let job = match decode(&body, &base) {
        Ok(job) if fds.len() == want_fds && (want_fds == 0 || job.plain()) => job,
        Ok(_) => {
            eprintln!("cynode-pool-waiter: bad job message: its descriptors or gVisor fields");
            std::process::exit(2);
        }
        Err(e) => {
            eprintln!("cynode-pool-waiter: bad job message: {e}");
            std::process::exit(2);
        }
    };
    wipe_environment();
    let code = match &gvisor {
        Some(g) => {
            if let Err((e, why)) = gvisor::prepare(&job, g) {
                eprintln!("cynode-pool-waiter: {why}");
                let mut msg = vec![b'M'];
                msg.extend_from_slice(&e.to_le_bytes());
                let _ = send(&sock, &msg);
                std::process::exit(0);
            }
            run(&sock, &job, Output::Relay(g))
        }
        None => match <[OwnedFd; 2]>::try_from(fds) {
            Ok(fds) => run(&sock, &job, Output::Passed(fds)),
            Err(_) => std::process::exit(2),
        },
    };
    let mut msg = vec![b'X'];
    msg.extend_from_slice(&code.to_le_bytes());
    let _ = send(&sock, &msg);
    std::process::exit(0);
}

/// Zeroes the waiter's environment strings once the job's environment is made from them:
/// gVisor lets a process of another uid read `/proc/1/environ`, which shows this memory.
fn wipe_environment() {
    extern "C" {
        static mut environ: *mut *mut libc::c_char;
    }
    // SAFETY: single-threaded; each entry is a NUL-terminated string of the initial
    // environment (the waiter never sets a variable), overwritten within its length.
    unsafe {
        let mut p = environ;
        while !p.is_null() && !(*p).is_null() {
            std::ptr::write_bytes(*p, 0, libc::strlen(*p));
            p = p.add(1);
        }
    }
}

/// The waiter's own environment (the image's and the engine's variables), copied before
/// [`wipe_environment`] zeroes it: every job's environment starts from it.
pub(crate) type BaseEnv = Vec<(Vec<u8>, Vec<u8>)>;

fn base_environment() -> BaseEnv {
    std::env::vars_os()
        .map(|(k, v)| (k.into_encoded_bytes(), v.into_encoded_bytes()))
        .collect()
}

/// The errno of the last call.
fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Writes `bytes` without raising SIGPIPE (the waiter changes no signal disposition, so the
/// job inherits the defaults).
fn send(sock: &UnixStream, bytes: &[u8]) -> std::io::Result<()> {
    send_fd(sock.as_raw_fd(), bytes)
}

/// [`send`] on a raw socket descriptor.
fn send_fd(fd: RawFd, bytes: &[u8]) -> std::io::Result<()> {
    let mut off = 0;
    while off < bytes.len() {
        // SAFETY: a valid buffer and length.
        let n = unsafe {
            libc::send(
                fd,
                bytes[off..].as_ptr().cast(),
                bytes.len() - off,
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        off += n as usize;
    }
    Ok(())
}

/// One job, decoded.
struct Job {
    uid: u32,
    gid: u32,
    cwd: CString,
    argv: Vec<CString>,
    env: Vec<CString>,
    /// gVisor mode: the directories to bind from the staging directory.
    mounts: Vec<JobMount>,
    /// gVisor mode with Podman: the home directory of the passwd entry to add when the
    /// image has none for the uid.
    identity: Option<String>,
}

impl Job {
    /// Whether the job has no gVisor-mode fields (mounts, identity).
    fn plain(&self) -> bool {
        self.mounts.is_empty() && self.identity.is_none()
    }
}

/// A directory of the job, `/.cynode-mnt/<name>` bound onto `target`.
struct JobMount {
    name: String,
    target: String,
}

/// Reads one message (its body) and the descriptors sent with it, at most `max_fds`, and
/// nothing of the next; `None` on end of file first.
pub(crate) fn receive(
    sock: &mut UnixStream,
    max_fds: usize,
) -> std::io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    // Only the length first: a session's waiter may find the next message queued behind
    // this one, which must stay in the socket.
    let mut buf = [0u8; 4];
    // Room for three descriptors' control message.
    let mut cmsg = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: zeroed msghdr, then pointers to live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cmsg);
    let n = loop {
        // SAFETY: msg points at live buffers.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    if n == 0 {
        return Ok(None);
    }
    let mut fds: Vec<OwnedFd> = Vec::new();
    // SAFETY: walking the control messages recvmsg filled in.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() > max_fds {
        return Err(std::io::Error::other(format!(
            "at most {max_fds} descriptors, got {}",
            fds.len()
        )));
    }
    let mut data = buf[..n].to_vec();
    while data.len() < 4 {
        let mut more = [0u8; 4];
        let m = sock.read(&mut more[..4 - data.len()])?;
        if m == 0 {
            return Err(std::io::Error::other("message cut short"));
        }
        data.extend_from_slice(&more[..m]);
    }
    let len = u32::from_le_bytes([data[0], data[1], data[2], data[3]]) as usize;
    if len > MAX_MESSAGE {
        return Err(std::io::Error::other("message too long"));
    }
    let mut body = vec![0u8; len];
    sock.read_exact(&mut body)?;
    Ok(Some((body, fds)))
}

/// The job message's fields (see the module doc), its environment made from `base`.
pub(crate) fn decode(body: &[u8], base: &BaseEnv) -> std::io::Result<Job> {
    let bad = |what: &str| std::io::Error::other(format!("field {what}"));
    let mut fields = body.split(|b| *b == 0);
    let mut next =
        |what: &str| -> std::io::Result<&[u8]> { fields.next().ok_or_else(|| bad(what)) };
    let text = |b: &[u8], what: &str| -> std::io::Result<String> {
        String::from_utf8(b.to_vec()).map_err(|_| bad(what))
    };
    if next("version")? != b"2" {
        return Err(bad("version"));
    }
    let num = |b: &[u8], what: &str| -> std::io::Result<u64> {
        text(b, what)?.parse().map_err(|_| bad(what))
    };
    // u32::MAX is -1 to setresuid ("unchanged"): refused with everything above it.
    let id = |b: &[u8], what: &str| -> std::io::Result<u32> {
        u32::try_from(num(b, what)?)
            .ok()
            .filter(|v| *v != u32::MAX)
            .ok_or_else(|| bad(what))
    };
    let uid = id(next("uid")?, "uid")?;
    let gid = id(next("gid")?, "gid")?;
    if uid == 0 || gid == 0 {
        return Err(bad("uid (root refused)"));
    }
    let c = |b: &[u8], what: &str| CString::new(b.to_vec()).map_err(|_| bad(what));
    let cwd = c(next("cwd")?, "cwd")?;
    let home = next("home")?.to_vec();
    let argc = num(next("argc")?, "argc")? as usize;
    let mut argv = Vec::with_capacity(argc.min(4096));
    for _ in 0..argc {
        argv.push(c(next("argv")?, "argv")?);
    }
    if argv.is_empty() {
        return Err(bad("argv (empty)"));
    }
    let envc = num(next("envc")?, "envc")? as usize;
    let mut env = Vec::with_capacity(envc.min(4096));
    for _ in 0..envc {
        env.push(c(next("env")?, "env")?);
    }
    let mountc = num(next("mountc")?, "mountc")? as usize;
    let mut mounts = Vec::new();
    for _ in 0..mountc.min(2) {
        let target = text(next("mount target")?, "mount target")?;
        // Only the job's two directories; the source is `/.cynode-mnt/<name>`.
        let name = match target.as_str() {
            "/job" => "job",
            "/workspace" => "workspace",
            _ => return Err(bad("mount target")),
        }
        .to_string();
        mounts.push(JobMount { name, target });
    }
    if mountc > 2 {
        return Err(bad("mountc"));
    }
    let identity = match next("identity")? {
        b"1" => Some(text(cwd.as_bytes(), "cwd")?),
        b"0" => None,
        _ => return Err(bad("identity")),
    };
    Ok(Job {
        uid,
        gid,
        cwd,
        argv,
        env: environment(uid, env, home, base),
        mounts,
        identity,
    })
}

/// The job's environment as a cold container's: the waiter's own (the image's and the
/// engine's variables), then the job's variables over them; without a `HOME` among the
/// job's (the worker sends the image's), the uid's home in the image's /etc/passwd, else
/// `fallback` (the engine's: Podman the working directory, Docker `/`).
fn environment(uid: u32, job: Vec<CString>, fallback: Vec<u8>, base: &BaseEnv) -> Vec<CString> {
    let key = |e: &[u8]| -> Vec<u8> { e.split(|b| *b == b'=').next().unwrap_or(e).to_vec() };
    let job_keys: Vec<Vec<u8>> = job.iter().map(|e| key(e.as_bytes())).collect();
    let mut env: Vec<CString> = base
        .iter()
        .filter_map(|(k, v)| {
            if k == b"HOME" || job_keys.contains(k) {
                return None;
            }
            let mut e = k.clone();
            e.push(b'=');
            e.extend_from_slice(v);
            CString::new(e).ok()
        })
        .collect();
    if !job_keys.iter().any(|k| k == b"HOME") {
        let mut home = b"HOME=".to_vec();
        home.extend_from_slice(&home_of(uid).unwrap_or(fallback));
        if let Ok(h) = CString::new(home) {
            env.push(h);
        }
    }
    env.extend(job);
    env
}

/// `uid`'s home directory in the image's /etc/passwd.
fn home_of(uid: u32) -> Option<Vec<u8>> {
    let text = image_file("/etc/passwd")?;
    for line in text.split(|b| *b == b'\n') {
        let f: Vec<&[u8]> = line.split(|b| *b == b':').collect();
        if f.len() >= 6 && f[2] == uid.to_string().as_bytes() && !f[5].is_empty() {
            return Some(f[5].to_vec());
        }
    }
    None
}

/// A file of the image (which the job's author chose): a regular file only, opened
/// without following a link or blocking on a FIFO, at most 1 MiB.
fn image_file(path: &str) -> Option<Vec<u8>> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut text = Vec::new();
    f.take(1024 * 1024).read_to_end(&mut text).ok()?;
    Some(text)
}

/// The program to exec: argv[0] itself when it has a slash, else the first executable
/// file of that name on the job's PATH (or the first match at all, whose exec then fails
/// with the right errno).
fn program(job: &Job) -> CString {
    let name = job.argv[0].as_bytes();
    if name.contains(&b'/') {
        return job.argv[0].clone();
    }
    let path = job
        .env
        .iter()
        .find_map(|e| e.as_bytes().strip_prefix(b"PATH="))
        .unwrap_or(DEFAULT_PATH.as_bytes());
    let mut first = None;
    for dir in path.split(|b| *b == b':') {
        let dir = if dir.is_empty() { &b"."[..] } else { dir };
        let mut full = dir.to_vec();
        full.push(b'/');
        full.extend_from_slice(name);
        let Ok(c) = CString::new(full) else { continue };
        // SAFETY: a valid C string.
        if unsafe { libc::access(c.as_ptr(), libc::F_OK) } == 0 {
            // SAFETY: as above.
            if unsafe { libc::access(c.as_ptr(), libc::X_OK) } == 0 {
                return c;
            }
            first.get_or_insert(c);
        }
    }
    first.unwrap_or_else(|| job.argv[0].clone())
}

/// Where the job's stdout and stderr go.
enum Output<'a> {
    /// The worker's pipes, passed over the control socket (runc).
    Passed([OwnedFd; 2]),
    /// Pipes made here, copied to the gVisor mode's sockets.
    Relay(&'a gvisor::Gvisor),
}

/// Starts the job, reports `S`/`F`, and returns its exit code once it has exited.
fn run(sock: &UnixStream, job: &Job, output: Output) -> i32 {
    let (fds, relay, filters): (_, _, &[Vec<u8>]) = match output {
        Output::Passed(fds) => (fds, None, &[]),
        Output::Relay(g) => match gvisor::pipes() {
            Ok((fds, pipes)) => (fds, Some((pipes, g)), &g.filters),
            Err(e) => return report_failure(sock, g.err.as_raw_fd(), job, e),
        },
    };
    // Where a failure before the fork is told: the job's stderr as the worker reads it.
    let report = match &relay {
        Some((_, g)) => g.err.as_raw_fd(),
        None => fds[1].as_raw_fd(),
    };
    let [out, err] = fds;
    let stdio = Stdio {
        stdin: None,
        stdout: out.as_raw_fd(),
        stderr: err.as_raw_fd(),
    };
    let started = spawn(job, &stdio, filters, Creds::Drop);
    // The job is forked (or could not be): the waiter needs no privilege any more.
    drop_own_privileges(filters);
    drop(out);
    let pid = match started {
        Spawned::Running(pid) => {
            drop(err);
            let _ = send(sock, b"S");
            pid
        }
        Spawned::ExecFailed(pid, e) => {
            tell_exec_failure(sock, err, job, e);
            pid
        }
        Spawned::NotForked(e) => {
            let code = report_failure(sock, report, job, e);
            drop(err);
            return code;
        }
    };
    match relay {
        Some((pipes, g)) => gvisor::relay(pid, pipes, g),
        None => wait_for(pid),
    }
}

/// The descriptors a job's command gets as its standard streams (`stdin` `None`:
/// `/dev/null`).
pub(crate) struct Stdio {
    pub stdin: Option<RawFd>,
    pub stdout: RawFd,
    pub stderr: RawFd,
}

/// Whether the forked child sets the job's credentials itself (a one-job waiter, root
/// with SETUID/SETGID/SETPCAP) or has them already (a session's waiter, which dropped to
/// the session's uid and every capability before its first command).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Creds {
    Drop,
    Inherited,
}

/// How [`spawn`] went.
pub(crate) enum Spawned {
    /// The command runs (its exec succeeded).
    Running(libc::pid_t),
    /// The child could not exec the command (its errno); it exits 127, or 126 for a
    /// permission error.
    ExecFailed(libc::pid_t, i32),
    /// No child (the errno of the pipe or the fork).
    NotForked(i32),
}

/// Forks `job` with `stdio` and waits until its exec succeeded or failed (a close-on-exec
/// error pipe).
pub(crate) fn spawn(job: &Job, stdio: &Stdio, filters: &[Vec<u8>], creds: Creds) -> Spawned {
    let prog = program(job);
    let mut argv: Vec<*const libc::c_char> = job.argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = job.env.iter().map(|e| e.as_ptr()).collect();
    envp.push(std::ptr::null());
    let mut pipe = [0; 2];
    // SAFETY: an array of two ints.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Spawned::NotForked(errno());
    }
    // SAFETY: the waiter is single-threaded: the child may allocate; it only execs or exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: the read end is ours to close.
        unsafe { libc::close(pipe[0]) };
        let errno = child(job, &prog, &argv, &envp, stdio, filters, creds);
        let bytes = errno.to_le_bytes();
        // SAFETY: writing four bytes to our pipe, then leaving without unwinding.
        unsafe {
            libc::write(pipe[1], bytes.as_ptr().cast(), 4);
            libc::_exit(if errno == libc::EACCES { 126 } else { 127 });
        }
    }
    // SAFETY: the write end is the child's now.
    unsafe { libc::close(pipe[1]) };
    if pid < 0 {
        let e = errno();
        // SAFETY: closing our read end.
        unsafe { libc::close(pipe[0]) };
        return Spawned::NotForked(e);
    }
    // SAFETY: the read end is ours; File closes it.
    let mut p = unsafe { std::fs::File::from_raw_fd(pipe[0]) };
    let mut errno = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match p.read(&mut errno[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    if got == 4 {
        Spawned::ExecFailed(pid, i32::from_le_bytes(errno))
    } else {
        Spawned::Running(pid)
    }
}

/// Writes why the job's command could not be started on its stderr (`err`, then closed)
/// and says `F` with the errno.
pub(crate) fn tell_exec_failure(sock: &UnixStream, err: OwnedFd, job: &Job, e: i32) {
    let mut stderr = std::fs::File::from(err);
    let _ = writeln!(
        stderr,
        "cynode-pool-waiter: cannot run {:?}: {}",
        job.argv[0],
        std::io::Error::from_raw_os_error(e)
    );
    drop(stderr);
    let mut msg = vec![b'F'];
    msg.extend_from_slice(&e.to_le_bytes());
    let _ = send(sock, &msg);
}

/// Reports a job that could not even be forked.
fn report_failure(sock: &UnixStream, err: RawFd, job: &Job, errno: i32) -> i32 {
    let line = format!(
        "cynode-pool-waiter: cannot start {:?}: {}\n",
        job.argv[0],
        std::io::Error::from_raw_os_error(errno)
    );
    // SAFETY: writing a buffer to a descriptor we hold.
    unsafe { libc::write(err, line.as_ptr().cast(), line.len()) };
    let mut msg = vec![b'F'];
    msg.extend_from_slice(&errno.to_le_bytes());
    let _ = send(sock, &msg);
    127
}

/// Reaps children (PID 1 inherits the job's orphans) until `pid` has exited; its exit code
/// as the engines give it.
fn wait_for(pid: libc::pid_t) -> i32 {
    loop {
        if let Some(code) = reap(pid, 0) {
            return code;
        }
    }
}

/// Reaps children (`waitpid` with `flags`) until `pid` has exited (its code: 128 + the
/// signal when killed), or none is left to reap now (`None`; 255 when waiting failed).
fn reap(pid: libc::pid_t, flags: libc::c_int) -> Option<i32> {
    loop {
        let mut status = 0;
        // SAFETY: a valid status pointer.
        let r = unsafe { libc::waitpid(-1, &mut status, flags) };
        if r == pid {
            if libc::WIFEXITED(status) {
                return Some(libc::WEXITSTATUS(status));
            }
            if libc::WIFSIGNALED(status) {
                return Some(128 + libc::WTERMSIG(status));
            }
            continue;
        }
        if r == 0 {
            return None;
        }
        if r < 0 {
            return match errno() {
                libc::EINTR => None,
                // No child at all: the job is gone without a status we saw.
                _ => Some(255),
            };
        }
    }
}

/// In the forked child: drops to the job's credentials and execs it; returns the errno of
/// the step that failed.
fn child(
    job: &Job,
    prog: &CStr,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    stdio: &Stdio,
    filters: &[Vec<u8>],
    creds: Creds,
) -> i32 {
    // SAFETY: plain syscalls on values we own; the child is single-threaded.
    unsafe {
        let stdin = match stdio.stdin {
            Some(fd) => fd,
            None => libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC),
        };
        if stdin < 0
            || libc::dup2(stdin, 0) < 0
            || libc::dup2(stdio.stdout, 1) < 0
            || libc::dup2(stdio.stderr, 2) < 0
        {
            return errno();
        }
        libc::setsid();
        if creds == Creds::Drop {
            if let Err(e) = become_user(job.uid, job.gid) {
                return e;
            }
        }
        if !no_capabilities_left() || libc::getuid() != job.uid || libc::getgid() != job.gid {
            return libc::EPERM;
        }
        if libc::chdir(job.cwd.as_ptr()) != 0 {
            return errno();
        }
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        // Everything above stdio closes on exec: the control socket already does; this
        // catches anything else.
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        );
        // gVisor mode: the node's filters, last (the container has no OCI profile).
        if let Err(e) = install_filters(filters) {
            return e;
        }
        libc::execve(prog.as_ptr(), argv.as_ptr(), envp.as_ptr());
    }
    errno()
}

/// Makes the calling process `uid`:`gid` with `gid` its only group, every capability gone
/// (the bounding set first, then the permitted, effective and ambient sets, checked with
/// `capget`) and no_new_privs set; the errno of the step that failed.
pub(crate) fn become_user(uid: u32, gid: u32) -> Result<(), i32> {
    // SAFETY: plain syscalls on integers and a one-element group list.
    unsafe {
        // Every capability out of the bounding set (EINVAL past the kernel's last one).
        for cap in 0..64 {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 {
                if errno() == libc::EINVAL {
                    break;
                }
                return Err(errno());
            }
        }
        if libc::setgroups(1, &gid) != 0
            || libc::setresgid(gid, gid, gid) != 0
            || libc::setresuid(uid, uid, uid) != 0
        {
            return Err(errno());
        }
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        );
        if !no_capabilities_left() {
            return Err(libc::EPERM);
        }
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            return Err(errno());
        }
    }
    Ok(())
}

/// Once the job is forked: every capability of the waiter goes (the bounding set, then
/// all sets), and in gVisor mode the node's filters with no_new_privs, so nothing that
/// could reach the waiter later finds `CAP_SYS_ADMIN` or mount calls there. What it
/// still does (read, poll, send, waitpid) needs none of them. Best effort: the job is
/// already confined on its own.
fn drop_own_privileges(filters: &[Vec<u8>]) {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    // SAFETY: prctl with integer arguments; capset with a v3 header and two zeroed data
    // words (three u32 each).
    unsafe {
        for cap in 0..64 {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno() == libc::EINVAL {
                break;
            }
        }
        let mut h = Header {
            version: 0x2008_0522,
            pid: 0,
        };
        let data = [0u32; 6];
        libc::syscall(libc::SYS_capset, &mut h, data.as_ptr());
        if !filters.is_empty() && libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 {
            let _ = install_filters(filters);
        }
    }
}

/// Whether the permitted, effective and inheritable sets are all empty.
fn no_capabilities_left() -> bool {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut h = Header {
        version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
        pid: 0,
    };
    let mut d = [Data::default(); 2];
    // SAFETY: capget with a v3 header and two data words.
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()) };
    r == 0
        && d.iter()
            .all(|x| x.effective == 0 && x.permitted == 0 && x.inheritable == 0)
}

/// `--seccomp-exec DIR -- COMMAND…` (see the module docs); never returns.
fn seccomp_exec(args: &[std::ffi::OsString]) -> ! {
    use std::os::unix::process::CommandExt;
    let fail = |why: String| -> ! {
        eprintln!("cynode-pool-waiter --seccomp-exec: {why}");
        std::process::exit(126);
    };
    let (Some(dir), Some(sep)) = (args.first(), args.get(1)) else {
        fail("usage: --seccomp-exec DIR -- COMMAND...".into());
    };
    if sep != "--" || args.len() < 3 {
        fail("usage: --seccomp-exec DIR -- COMMAND...".into());
    }
    let programs = load_filters(std::path::Path::new(dir)).unwrap_or_else(|e| fail(e));
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        fail(format!("no_new_privs: {}", std::io::Error::last_os_error()));
    }
    if let Err(e) = install_filters(&programs) {
        fail(format!(
            "cannot install a filter: {}",
            std::io::Error::from_raw_os_error(e)
        ));
    }
    let e = std::process::Command::new(&args[2]).args(&args[3..]).exec();
    eprintln!("cynode-pool-waiter --seccomp-exec: {:?}: {e}", args[2]);
    std::process::exit(if e.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    });
}

/// The node's BPF programs `DIR/filter-0.bpf`, `filter-1.bpf`, … (at least one).
fn load_filters(dir: &std::path::Path) -> Result<Vec<Vec<u8>>, String> {
    let mut programs = Vec::new();
    for i in 0.. {
        let path = dir.join(format!("filter-{i}.bpf"));
        match std::fs::read(&path) {
            Ok(p) if !p.is_empty() && p.len() % 8 == 0 && p.len() / 8 <= 4096 => programs.push(p),
            Ok(_) => return Err(format!("{} is not a BPF program", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        }
    }
    if programs.is_empty() {
        return Err(format!("no filter in {}", dir.display()));
    }
    Ok(programs)
}

/// Installs `programs` (no_new_privs must be set); the errno of a refusal.
fn install_filters(programs: &[Vec<u8>]) -> Result<(), i32> {
    for p in programs {
        let prog = libc::sock_fprog {
            len: (p.len() / 8) as u16,
            filter: p.as_ptr() as *mut libc::sock_filter,
        };
        // SAFETY: `prog` points at `len` instructions that live until the call returns
        // (the kernel copies them).
        let rc = unsafe {
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &prog as *const libc::sock_fprog,
                0,
                0,
            )
        };
        if rc != 0 {
            return Err(errno());
        }
    }
    Ok(())
}
