//! Pre-spawned bwrap starters: a bounded pool of processes forked ahead of time, each
//! already inside a fresh cgroup of its own (with the node's limits) and holding the
//! seccomp memfds, waiting to become one job's bwrap. Joining a cgroup is the slow part of
//! a bwrap start (on cgroup v1 every write to `cgroup.procs` takes the kernel's
//! threadgroup lock for writing, which waits for an RCU grace period: about 10 ms on the
//! node's 2-core test machine, the largest single cost of a trivial job); here it happens
//! in the background, before the job arrives.
//!
//! A starter is the worker's forked child stopped inside `pre_exec`: it has joined its
//! cgroup and closed every descriptor but its stdio pipes, the seccomp memfds, two memfds
//! for the job's bwrap (its options, its command) and a control pipe, and it blocks
//! reading the control pipe. A job claims one ([`Starters::take`]), writes its bwrap
//! options into the first memfd (then sealed) and the sandbox's command into the second,
//! and its host uid into the pipe; the starter reads the command and the uid, closes the
//! command memfd and the pipe, drops to that uid (no groups), arms `PR_SET_PDEATHSIG`
//! again and executes `bwrap --args <options memfd> -- <command>` with an empty
//! environment: exactly what the cold path does ([`super::Invocation`]), only earlier.
//! bwrap reads the options and closes their memfd. Its cgroup is renamed to the job's
//! sandbox name on the claim, so a job's cgroup is named as before.
//!
//! - One starter, one job: the pool hands each out once (`VecDeque::pop_front` under its
//!   lock, moved into the job) and never takes one back; a job's [`super::Confinement`]
//!   kills and removes it as on the cold path.
//! - A starter never claimed dies with the node: its control pipe's write end is the
//!   node's (EOF ends it) and it has `PR_SET_PDEATHSIG` (SIGKILL) armed, tied to the
//!   filler thread that forked it, which lives as long as the backend. Its empty cgroup
//!   is removed at the next start (`remove_all_managed`).
//! - The filler is one thread that keeps at most [`TARGET`] starters ready; it pauses
//!   after failures. Jobs that need a gated start (egress) or whose command is larger than
//!   a starter's buffer take the cold path.
//! - What `/metrics` shows: [`stats`].

use std::collections::VecDeque;
use std::ffi::{CString, OsStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use tokio::process::{Child, Command};

use super::{join_cgroups, Confinement};
use crate::backend::ResourceLimits;

/// Starters kept ready.
pub const TARGET: usize = 2;
/// The largest sandbox command (NUL-terminated strings, bytes) a starter takes.
const ARGS_CAP: usize = 256 * 1024;
/// The most command arguments a starter takes.
const MAX_ARGS: usize = 8192;
/// The longest pause of the filler after a failure.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// What `/metrics` reports of the starters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    pub ready: u64,
    pub target: u64,
    pub claimed: u64,
    /// Jobs that started cold: the pool was empty, or the job could not use a starter.
    pub cold: u64,
    pub made: u64,
    pub failures: u64,
}

#[derive(Debug, Default)]
struct Counters {
    claimed: AtomicU64,
    cold: AtomicU64,
    made: AtomicU64,
    failures: AtomicU64,
}

/// This process's pools, for `/metrics` and [`drain`]; a pool lives as long as its
/// backend.
static POOLS: Mutex<Vec<Weak<Starters>>> = Mutex::new(Vec::new());

fn pools() -> Vec<Arc<Starters>> {
    POOLS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .filter_map(Weak::upgrade)
        .collect()
}

/// Kills every ready starter of this process and removes its cgroup, and stops the
/// refilling (a node's graceful stop, after its jobs ended).
pub fn drain() {
    for p in pools() {
        p.closed.store(true, Ordering::SeqCst);
        let ready: Vec<Starter> = p
            .pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain(..)
            .collect();
        drop(ready);
    }
}

/// The node's starter counters (its first live pool); `None` when no pool was started.
pub fn stats() -> Option<Stats> {
    let s = pools().into_iter().next()?;
    let c = &s.counters;
    Some(Stats {
        ready: s.pool.lock().map(|p| p.len() as u64).unwrap_or(0),
        target: TARGET as u64,
        claimed: c.claimed.load(Ordering::Relaxed),
        cold: c.cold.load(Ordering::Relaxed),
        made: c.made.load(Ordering::Relaxed),
        failures: c.failures.load(Ordering::Relaxed),
    })
}

/// The starter counters in Prometheus text format (empty without a pool).
pub fn metrics_text() -> String {
    let Some(s) = stats() else {
        return String::new();
    };
    format!(
        "# TYPE cynode_worker_bwrap_starters_ready gauge\ncynode_worker_bwrap_starters_ready {}\n\
         # TYPE cynode_worker_bwrap_starters_target gauge\ncynode_worker_bwrap_starters_target {}\n\
         # TYPE cynode_worker_bwrap_starts_total counter\ncynode_worker_bwrap_starts_total{{pool=\"warm\"}} {}\ncynode_worker_bwrap_starts_total{{pool=\"cold\"}} {}\n\
         # TYPE cynode_worker_bwrap_starters_made_total counter\ncynode_worker_bwrap_starters_made_total {}\n\
         # TYPE cynode_worker_bwrap_starter_failures_total counter\ncynode_worker_bwrap_starter_failures_total {}\n",
        s.ready, s.target, s.claimed, s.cold, s.made, s.failures
    )
}

/// One starter: the waiting child, its confinement (cgroup and seccomp memfds), the
/// memfds of bwrap's options and of the sandbox's command, and the control pipe's write
/// end.
struct Starter {
    child: Child,
    confinement: Confinement,
    options: std::fs::File,
    args: std::fs::File,
    ctrl: OwnedFd,
}

/// The pool of one bwrap backend.
pub struct Starters {
    binary: CString,
    node: String,
    limits: ResourceLimits,
    disable_userns: bool,
    pool: Mutex<VecDeque<Starter>>,
    wake: Condvar,
    seq: AtomicU64,
    counters: Counters,
    /// [`drain`]ed: no more starters are made.
    closed: AtomicBool,
}

impl std::fmt::Debug for Starters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Starters")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

/// A claimed starter, running bwrap for one job.
pub struct Claimed {
    pub child: Child,
    pub confinement: Confinement,
}

impl Starters {
    /// Starts the pool for bwrap `binary` (resolved on `PATH`) and sandboxes with `limits`
    /// under `node`'s cgroups, and its filler thread (which enters the current tokio
    /// runtime). `None` when the binary cannot be found or the thread not started.
    pub fn start(
        binary: &str,
        node: &str,
        limits: ResourceLimits,
        disable_userns: bool,
    ) -> Option<Arc<Starters>> {
        let path = resolve(binary)?;
        let handle = tokio::runtime::Handle::try_current().ok()?;
        let s = Arc::new(Starters {
            binary: CString::new(path.as_os_str().as_bytes()).ok()?,
            node: node.to_string(),
            limits,
            disable_userns,
            pool: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            seq: AtomicU64::new(0),
            counters: Counters::default(),
            closed: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&s);
        std::thread::Builder::new()
            .name("bwrap-starters".into())
            .spawn(move || {
                let _rt = handle.enter();
                fill(weak);
            })
            .ok()?;
        let mut all = POOLS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&s));
        Some(s)
    }

    /// A ready starter for a sandbox with `limits`, or `None` (counted cold).
    pub fn take(&self, limits: &ResourceLimits) -> Option<Taken<'_>> {
        let got = if same_cgroup_limits(limits, &self.limits) && !self.closed.load(Ordering::SeqCst)
        {
            self.pool
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .pop_front()
        } else {
            None
        };
        self.wake.notify_one();
        match got {
            Some(mut s) => {
                if matches!(s.child.try_wait(), Ok(None)) {
                    return Some(Taken {
                        pool: self,
                        starter: Some(s),
                    });
                }
                self.counters.failures.fetch_add(1, Ordering::Relaxed);
                self.counters.cold.fetch_add(1, Ordering::Relaxed);
                None
            }
            None => {
                self.counters.cold.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Forks one starter into a fresh cgroup.
    fn make(&self) -> std::io::Result<Starter> {
        let name = format!(
            "starter-{}-{}",
            std::process::id(),
            self.seq.fetch_add(1, Ordering::Relaxed)
        );
        let confinement = Confinement::new(&self.node, &name, &self.limits, self.disable_userns, 0)
            .map_err(std::io::Error::other)?;
        let options = memfd("cynode-bwrap-args", libc::MFD_ALLOW_SEALING)?;
        let args = memfd("cynode-bwrap-command", 0)?;
        let (ctrl_r, ctrl_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        let mut keep: Vec<i32> = confinement.fds.clone();
        keep.extend([options.as_raw_fd(), args.as_raw_fd(), ctrl_r.as_raw_fd()]);
        keep.sort_unstable();
        let plan = Plan {
            inherit: confinement
                .fds
                .iter()
                .copied()
                .chain([options.as_raw_fd(), args.as_raw_fd()])
                .collect(),
            procs: confinement.cgroup.procs_files(),
            keep,
            args_fd: args.as_raw_fd(),
            ctrl_fd: ctrl_r.as_raw_fd(),
            buf: vec![0; ARGS_CAP],
            argv: vec![0; MAX_ARGS + 5],
            fixed: [
                c"bwrap".into(),
                c"--args".into(),
                CString::new(options.as_raw_fd().to_string()).map_err(std::io::Error::other)?,
                c"--".into(),
            ],
            envp: vec![0],
            binary: self.binary.clone(),
            root: rustix::process::geteuid().is_root(),
        };
        super::super::record_node_pid();
        let mut cmd = Command::new(OsStr::from_bytes(self.binary.as_bytes()));
        cmd.env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        plan.apply(&mut cmd);
        // Returns once the child has joined its cgroup and closed the status pipe.
        let child = cmd.spawn()?;
        drop(ctrl_r);
        self.counters.made.fetch_add(1, Ordering::Relaxed);
        Ok(Starter {
            child,
            confinement,
            options,
            args,
            ctrl: ctrl_w,
        })
    }
}

/// A starter taken from the pool: [`Taken::args`] for its argv, then [`Taken::start`].
/// Dropped unstarted, it is killed and its cgroup removed.
pub struct Taken<'a> {
    pool: &'a Starters,
    starter: Option<Starter>,
}

impl Taken<'_> {
    /// Its confinement's bwrap options (the seccomp fds as the starter holds them).
    pub fn confinement_args(&self) -> Vec<String> {
        self.starter
            .as_ref()
            .map(|s| s.confinement.args())
            .unwrap_or_default()
    }

    /// Renames its cgroup to `name`, hands it `inv` (bwrap's options and the sandbox's
    /// command) and `host_uid`: it executes bwrap. `Err` when it could not be handed
    /// over (then it is killed and removed, and the caller starts cold).
    pub fn start(
        mut self,
        name: &str,
        inv: &super::Invocation,
        host_uid: u32,
    ) -> Result<Claimed, String> {
        use std::io::Write;
        use std::os::unix::fs::FileExt;
        let Some(mut s) = self.starter.take() else {
            return Err("no starter".into());
        };
        let command = super::Invocation {
            options: inv.command.clone(),
            command: Vec::new(),
        }
        .options_data();
        let (options, command) = match (inv.options_data(), command) {
            (Ok(o), Ok(c)) => (o, c),
            (Err(e), _) | (_, Err(e)) => {
                self.pool.counters.cold.fetch_add(1, Ordering::Relaxed);
                return Err(e);
            }
        };
        if command.is_empty() || command.len() >= ARGS_CAP || inv.command.len() > MAX_ARGS {
            self.pool.counters.cold.fetch_add(1, Ordering::Relaxed);
            return Err("a command a starter does not take".into());
        }
        s.confinement.cgroup.rename(name);
        let handed = s
            .options
            .write_all_at(&options, 0)
            .and_then(|()| super::seal(s.options.as_raw_fd()))
            .and_then(|()| s.args.write_all_at(&command, 0))
            .and_then(|()| {
                let mut ctrl = std::fs::File::from(s.ctrl.try_clone()?);
                ctrl.write_all(&host_uid.to_ne_bytes())
            })
            .map_err(|e| format!("cannot hand the job to a bwrap starter: {e}"));
        if let Err(e) = handed {
            self.pool.counters.failures.fetch_add(1, Ordering::Relaxed);
            self.pool.counters.cold.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        self.pool.counters.claimed.fetch_add(1, Ordering::Relaxed);
        s.confinement.host_uid = host_uid;
        Ok(Claimed {
            child: s.child,
            confinement: s.confinement,
        })
    }
}

/// The filler: keeps [`TARGET`] starters ready while the pool exists; pauses after
/// failures. Never returns while the pool exists: the starters it forked (and the bwrap
/// they became) have their parent-death signal tied to this thread.
fn fill(pool: Weak<Starters>) {
    let mut backoff = Duration::from_millis(500);
    loop {
        let Some(s) = pool.upgrade() else { return };
        {
            let p = s
                .pool
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if p.len() >= TARGET || s.closed.load(Ordering::SeqCst) {
                let (_p, _) = s
                    .wake
                    .wait_timeout(p, Duration::from_secs(1))
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                continue;
            }
        }
        match s.make() {
            Ok(st) => {
                backoff = Duration::from_millis(500);
                s.pool
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push_back(st);
            }
            Err(e) => {
                s.counters.failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "cannot make a bwrap starter");
                drop(s);
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// What the forked child does, prepared before the fork (nothing is allocated after it).
struct Plan {
    inherit: Vec<i32>,
    procs: Vec<CString>,
    keep: Vec<i32>,
    args_fd: i32,
    ctrl_fd: i32,
    buf: Vec<u8>,
    argv: Vec<usize>,
    /// `bwrap` (its argv\[0\], not the binary's path), `--args`, the options memfd's
    /// number, `--`: bwrap's arguments before the command.
    fixed: [CString; 4],
    /// The empty environment bwrap starts with.
    envp: Vec<usize>,
    binary: CString,
    root: bool,
}

impl Plan {
    fn apply(mut self, cmd: &mut Command) {
        // SAFETY: between fork and exec the closure only makes syscalls (fcntl, open,
        // write, close, close_range, read, pread, prctl, setgroups/setgid/setuid, execve,
        // _exit) on descriptors and buffers prepared before the fork, and writes pointers
        // into the preallocated `argv`; it never allocates. After close_range (which
        // closes the standard library's exec-status pipe, so the parent's spawn returns)
        // it never returns: it executes bwrap or calls _exit.
        unsafe {
            cmd.pre_exec(move || self.child());
        }
    }

    /// In the forked child.
    fn child(&mut self) -> std::io::Result<()> {
        for fd in &self.inherit {
            // SAFETY: fcntl on an fd opened before the fork.
            if unsafe { libc::fcntl(*fd, libc::F_SETFD, 0) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        join_cgroups(&self.procs)?;
        super::super::die_with_node()?;
        // Close everything but stdio, the seccomp memfds, the options and command memfds
        // and the control pipe: the standard library's status pipe too, so the parent's
        // spawn returns now.
        let mut next: u32 = 3;
        for &k in &self.keep {
            let k = k as u32;
            if k > next {
                close_range(next, k - 1);
            }
            next = next.max(k + 1);
        }
        close_range(next, u32::MAX);
        // From here on: exec or _exit, never return.
        let mut uid = [0u8; 4];
        if !read_full(self.ctrl_fd, &mut uid) {
            exit(0);
        }
        let n = read_at_most(self.args_fd, &mut self.buf);
        if n == 0 || n >= self.buf.len() || self.buf[n - 1] != 0 {
            exit(126);
        }
        // SAFETY: closing fds this child owns.
        unsafe {
            libc::close(self.args_fd);
            libc::close(self.ctrl_fd);
        }
        if self.root && super::become_sandbox_user(u32::from_ne_bytes(uid)).is_err() {
            exit(126);
        }
        if super::super::die_with_node().is_err() {
            exit(126);
        }
        self.argv[0] = self.fixed[0].as_ptr() as usize;
        for (i, a) in self.fixed.iter().enumerate().skip(1) {
            self.argv[i] = a.as_ptr() as usize;
        }
        let mut count = self.fixed.len();
        let mut start = 0;
        for i in 0..n {
            if self.buf[i] == 0 {
                if count >= MAX_ARGS + self.fixed.len() {
                    exit(126);
                }
                self.argv[count] = self.buf[start..].as_ptr() as usize;
                count += 1;
                start = i + 1;
            }
        }
        self.argv[count] = 0;
        // SAFETY: argv and envp are NUL-terminated arrays of pointers to NUL-terminated
        // strings that live in this process (the child's copy of the closure's buffers).
        unsafe {
            libc::execve(
                self.binary.as_ptr(),
                self.argv.as_ptr().cast(),
                self.envp.as_ptr().cast(),
            );
        }
        exit(127)
    }
}

/// Whether a starter's cgroup, made for `b`, holds `a`'s limits (tmpfs is a bwrap option).
fn same_cgroup_limits(a: &ResourceLimits, b: &ResourceLimits) -> bool {
    a.memory_mb == b.memory_mb && a.pids == b.pids && a.cpus.to_bits() == b.cpus.to_bits()
}

fn exit(code: i32) -> ! {
    // SAFETY: _exit is async-signal-safe and ends the child.
    unsafe { libc::_exit(code) }
}

fn close_range(first: u32, last: u32) {
    // SAFETY: close_range on a range of this child's descriptors.
    unsafe {
        libc::syscall(libc::SYS_close_range, first, last, 0u32);
    }
}

/// Reads `buf.len()` bytes from `fd`; `false` on EOF or an error.
fn read_full(fd: i32, buf: &mut [u8]) -> bool {
    let mut got = 0;
    while got < buf.len() {
        // SAFETY: reading into the unread rest of `buf`.
        let n = unsafe { libc::read(fd, buf[got..].as_mut_ptr().cast(), buf.len() - got) };
        if n > 0 {
            got += n as usize;
        } else if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
        {
            continue;
        } else {
            return false;
        }
    }
    true
}

/// Reads the file `fd` from offset 0 into `buf` (at most its length); the bytes read.
fn read_at_most(fd: i32, buf: &mut [u8]) -> usize {
    let mut got = 0;
    while got < buf.len() {
        // SAFETY: reading into the unread rest of `buf`.
        let n = unsafe {
            libc::pread(
                fd,
                buf[got..].as_mut_ptr().cast(),
                buf.len() - got,
                got as libc::off_t,
            )
        };
        if n > 0 {
            got += n as usize;
        } else if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
        {
            continue;
        } else {
            break;
        }
    }
    got
}

/// A memfd (close-on-exec, with `flags` besides) named `name`.
fn memfd(name: &str, flags: libc::c_uint) -> std::io::Result<std::fs::File> {
    let name = CString::new(name).map_err(std::io::Error::other)?;
    // SAFETY: memfd_create with a valid NUL-terminated name.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just created and is owned by nothing else.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// `binary` as a path: itself when it holds a `/`, else the first executable match on
/// `PATH` (the client's).
pub(super) fn resolve(binary: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if binary.contains('/') {
        return Some(PathBuf::from(binary));
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| crate::sandbox::DEFAULT_PATH.into());
    std::env::split_paths(&path)
        .map(|d| d.join(binary))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}
