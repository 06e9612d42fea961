//! Warm bwrap sandboxes (`bwrap.warm_slots`): a sandbox made before its job, with
//! everything a cold bwrap sandbox has but the job's own parts, which a claim adds.
//!
//! **Why.** A trivial bwrap job spends most of its time in bwrap itself: the namespaces,
//! the mounts of the root filesystem, /dev, /proc and /tmp, the pivot, the user
//! namespace's maps (about 9 ms on the 2-core test machine, a bare bwrap's whole run).
//! A warm sandbox has done all of that before the job arrives.
//!
//! **A slot** is bwrap run exactly as for a cold job ([`super::BwrapBackend::sandbox_args`]:
//! every namespace new, uid 1000 inside mapped to the workspace's host uid, no
//! capabilities, the node's seccomp filters, `--disable-userns`, the cgroup with the
//! node's limits joined before bwrap executes, a new session, death with the node) with
//! `/` as its working directory, an empty environment and, as its command, the static
//! `cynode-pool-waiter --bwrap` (poolwaiter/src/bwrap.rs), executed through
//! `/proc/self/fd/N` so that nothing of the host is mounted for it. The waiter is PID 2 of
//! the sandbox, already under the filters, as the sandbox user; it says it is ready on a
//! pipe and waits on another for one job. What bwrap still does for a cold job after its
//! setup (chdir, the environment, execvp) the waiter does at the claim, with bwrap's own
//! error messages and exit codes.
//!
//! **Keyed by the workspace's host uid.** The user namespace's map is written before
//! bwrap's setup, so a slot serves one host uid (with one root filesystem and the node's
//! limits). After each job, slots are made in the background for its workspace's uid
//! (two: the workspace's next jobs, which may come back to back) and for the uid after it
//! (a guess at the next new workspace's: the node gives each the lowest free uid, most
//! often the one after the newest; never a uid outside `sandbox_uids`), and at the
//! node's start one for the lowest free uid
//! ([`crate::backend::SandboxBackend::expect_uid`], with the node's limits, per configured
//! image). A wrong guess costs one idle sandbox until it is pushed out or expires. At most
//! `warm_slots` slots are idle or being made; the one idle longest makes room for a new
//! key, and a slot idle for [`IDLE_MAX`] is removed. A job that finds no slot of its uid
//! (a workspace's first job when the guess failed, a third job of a workspace at the same
//! time) starts the cold way.
//!
//! **A claim** (blocking, a fraction of a millisecond):
//! 1. the slot's bwrap is checked alive;
//! 2. each of the job's mounts (its job directory, its workspace) is cloned on the host
//!    (`open_tree`, recursive, so its disk volume comes with it), given what bwrap's
//!    `--bind`/`--ro-bind` give (`nosuid,nodev`, read-only where the spec says) and moved
//!    onto its mount point from a thread in the sandbox's mount namespace
//!    ([`crate::backend::mount_tree`]); no host mount is made;
//! 3. the cgroup is renamed to the job's sandbox name;
//! 4. the job (cwd, argv, environment) goes to the waiter, and its pipe is closed.
//!
//! After step 4 the job is the slot's: bwrap's exit is the job's, waited for, timed out,
//! cancelled, killed and collected exactly as a cold job's. A claim that fails before it
//! hands the job over kills the slot; the job then starts cold, none of it having run.
//!
//! **Made on a thread of its own**, which lives as long as the backend: bwrap's
//! parent-death signal is tied to the thread that forked it.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use rustix::fs::OFlags;
use tokio::process::Child;

use super::{client_command, sandbox_args, Confinement, Invocation, SBA_ENTRYPOINT};
use crate::backend::mount_tree::{clone_tree, in_mount_namespace, job_attrs, move_onto};
use crate::backend::{ResourceLimits, SandboxSpec};
use crate::uid_pool::UidRange;

/// A slot idle this long is removed.
pub const IDLE_MAX: Duration = Duration::from_secs(300);
/// How long a new slot may take to say it is ready.
const READY_BOUND: Duration = Duration::from_secs(10);
/// The largest job message a claim sends (larger jobs start cold).
const MAX_JOB: usize = 1024 * 1024;
/// The longest pause of the maker after a failure.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// What a slot is made for.
#[derive(Debug, Clone)]
struct Key {
    uid: u32,
    rootfs: PathBuf,
    limits: ResourceLimits,
}

impl Key {
    fn matches(&self, other: &Key) -> bool {
        self.uid == other.uid
            && self.rootfs == other.rootfs
            && same_limits(&self.limits, &other.limits)
    }
}

fn same_limits(a: &ResourceLimits, b: &ResourceLimits) -> bool {
    a.memory_mb == b.memory_mb
        && a.pids == b.pids
        && a.cpus.to_bits() == b.cpus.to_bits()
        && a.tmpfs_mb == b.tmpfs_mb
}

/// One warm sandbox, idle.
pub struct Slot {
    key: Key,
    child: Child,
    confinement: Confinement,
    /// The write end of the waiter's job pipe.
    ctl: OwnedFd,
    /// The sandbox's PID 1 (its mount namespace is the job's).
    pidfd: OwnedFd,
    since: Instant,
}

#[derive(Default)]
struct State {
    idle: VecDeque<Slot>,
    wanted: VecDeque<Key>,
    making: usize,
    /// Slots to remove, which the maker drops (killing a cgroup waits; never on a job's
    /// path, never under the lock).
    doomed: Vec<Slot>,
}

impl State {
    /// Wants a slot for `key` unless `depth` are idle or wanted already; when `cap` slots
    /// are idle or on their way, the one idle longest is doomed to make room. Whether it
    /// was wanted.
    fn want(&mut self, key: Key, depth: usize, cap: usize) -> bool {
        let have = self.idle.iter().filter(|s| s.key.matches(&key)).count()
            + self.wanted.iter().filter(|k| k.matches(&key)).count();
        if have >= depth {
            return false;
        }
        if self.idle.len() + self.wanted.len() + self.making >= cap {
            if let Some(old) = self.idle.pop_front() {
                self.doomed.push(old);
            }
        }
        if self.idle.len() + self.wanted.len() + self.making >= cap {
            return false;
        }
        self.wanted.push_back(key);
        true
    }

    /// Slots idle for [`IDLE_MAX`] are doomed.
    fn expire(&mut self) {
        let now = Instant::now();
        while let Some(old) = self
            .idle
            .pop_front_if(|s| now.duration_since(s.since) >= IDLE_MAX)
        {
            self.doomed.push(old);
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    claims: AtomicU64,
    misses: AtomicU64,
    made: AtomicU64,
    failures: AtomicU64,
}

/// The warm slots of one backend.
pub struct Warm {
    cap: usize,
    waiter: PathBuf,
    /// bwrap, the node's name, and whether bwrap knows `--disable-userns`.
    binary: String,
    node: String,
    disable_userns: bool,
    /// `sandbox_uids`: no slot is made for a uid outside it.
    uids: UidRange,
    state: Mutex<State>,
    wake: Condvar,
    seq: AtomicU64,
    counters: Counters,
}

impl std::fmt::Debug for Warm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Warm")
            .field("cap", &self.cap)
            .field("stats", &self.stats())
            .finish()
    }
}

/// What `/metrics` shows.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    pub idle: u64,
    /// Wanted or being made.
    pub pending: u64,
    pub cap: u64,
    pub claims: u64,
    pub misses: u64,
    pub made: u64,
    pub failures: u64,
}

/// This process's warm pools, for `/metrics`.
static ALL: Mutex<Vec<Weak<Warm>>> = Mutex::new(Vec::new());

impl Warm {
    /// Slots of the bwrap `binary` for node `node`, at most `cap`, with the waiter binary
    /// `waiter`; `None` when the node is not root (a claim's mounts need it), outside a
    /// runtime, or the waiter is missing.
    pub fn start(
        binary: &str,
        node: &str,
        disable_userns: bool,
        cap: usize,
        waiter: &Path,
        uids: UidRange,
    ) -> Option<Arc<Warm>> {
        if cap == 0 || !rustix::process::geteuid().is_root() {
            return None;
        }
        if !waiter.is_file() {
            tracing::warn!(waiter = %waiter.display(), "bwrap.warm_slots is set but the pool waiter is missing (deploy/worker/build-waiter.sh): every job starts cold");
            return None;
        }
        let handle = tokio::runtime::Handle::try_current().ok()?;
        let w = Arc::new(Warm {
            cap,
            waiter: waiter.to_path_buf(),
            binary: binary.to_string(),
            node: node.to_string(),
            disable_userns,
            uids,
            state: Mutex::default(),
            wake: Condvar::new(),
            seq: AtomicU64::new(0),
            counters: Counters::default(),
        });
        let weak = Arc::downgrade(&w);
        std::thread::Builder::new()
            .name("bwrap-warm".into())
            .spawn(move || {
                let _rt = handle.enter();
                maker(weak);
            })
            .ok()?;
        let mut all = ALL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&w));
        Some(w)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An idle slot for `spec` on `rootfs`, if one is alive; either way a slot for the
    /// same key is wanted next (made in the background).
    pub fn take(&self, spec: &SandboxSpec, rootfs: &Path) -> Option<Slot> {
        let key = Key {
            uid: spec.host_uid,
            rootfs: rootfs.to_path_buf(),
            limits: spec.limits,
        };
        let mut st = self.state();
        st.expire();
        let got = st
            .idle
            .iter()
            .position(|s| s.key.matches(&key))
            .and_then(|i| st.idle.remove(i));
        if got.is_some() {
            self.counters.claims.fetch_add(1, Ordering::Relaxed);
        } else {
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
        }
        // The workspace's next job, and a new workspace's first (the node gives each new
        // workspace the lowest free uid: after the newest workspace's, most often).
        let next = Key {
            uid: key.uid.saturating_add(1),
            ..key.clone()
        };
        // Two for the workspace itself, so that jobs sent back to back find one ready
        // while the next is made.
        for (k, depth) in [(key.clone(), 1), (next, 1), (key, 2)] {
            if !self.in_range(k.uid) {
                continue;
            }
            if st.want(k, depth, self.cap) {
                self.wake.notify_one();
            }
        }
        drop(st);
        got
    }

    /// Whether `uid` is one of the node's sandbox uids.
    fn in_range(&self, uid: u32) -> bool {
        uid >= self.uids.first && uid - self.uids.first < self.uids.count
    }

    /// Wants a slot for `uid` on `rootfs` with `limits` (a new workspace's, expected).
    pub fn expect(&self, uid: u32, rootfs: &Path, limits: ResourceLimits) {
        if !self.in_range(uid) {
            return;
        }
        let key = Key {
            uid,
            rootfs: rootfs.to_path_buf(),
            limits,
        };
        if self.state().want(key, 1, self.cap) {
            self.wake.notify_one();
        }
    }

    /// Makes one slot for `key` (on the maker thread).
    fn make(&self, key: &Key) -> Result<Slot, String> {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        let name = format!("warm-{}-{n}", std::process::id());
        let mut confinement =
            Confinement::new(&self.node, &name, &key.limits, self.disable_userns, key.uid)
                .map_err(|e| e.to_string())?;
        let exe = std::fs::File::open(&self.waiter)
            .map_err(|e| format!("cannot open {}: {e}", self.waiter.display()))?;
        let pipe = || {
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                .map_err(|e| format!("cannot make a pipe: {e}"))
        };
        let (ctl_r, ctl_w) = pipe()?;
        let (ready_r, ready_w) = pipe()?;
        let (info_r, info_w) = pipe()?;
        let (e, c, r, i) = (
            exe.as_raw_fd(),
            ctl_r.as_raw_fd(),
            ready_w.as_raw_fd(),
            info_w.as_raw_fd(),
        );
        let mut confine = confinement.args();
        confine.extend(["--info-fd".into(), i.to_string()]);
        let mut options = sandbox_args(&key.rootfs, &key.limits, &confine);
        options.extend(["--chdir", "/", "--clearenv"].map(String::from));
        let inv = Invocation {
            options,
            command: vec![
                format!("/proc/self/fd/{e}"),
                "--bwrap".into(),
                e.to_string(),
                c.to_string(),
                r.to_string(),
            ],
        };
        let (mut cmd, options) = client_command(&self.binary, &inv)
            .map_err(|e| format!("cannot pass bwrap its arguments: {e}"))?;
        confinement.apply(&mut cmd);
        // SAFETY: between fork and exec this only clears close-on-exec (fcntl) on four
        // descriptors opened before the fork.
        unsafe {
            cmd.pre_exec(move || {
                for fd in [e, c, r, i] {
                    if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let spawned = cmd.spawn();
        confinement.started();
        drop((exe, ctl_r, ready_w, info_w, options));
        let child = spawned.map_err(|e| format!("cannot start {}: {e}", self.binary))?;
        let mut child = child;
        let ready = crate::backend::netns_gate::read_child_pid(info_r).and_then(|pid| {
            let pidfd = rustix::process::pidfd_open(
                rustix::process::Pid::from_raw(pid as i32).ok_or("bwrap reported pid 0")?,
                rustix::process::PidfdFlags::empty(),
            )
            .map_err(|e| format!("pidfd_open: {e}"))?;
            wait_ready(&ready_r)?;
            Ok(pidfd)
        });
        let pidfd = match ready {
            Ok(p) => p,
            Err(e) => return Err(format!("{e}: {}", stderr_of(&mut child))),
        };
        Ok(Slot {
            key: key.clone(),
            child,
            confinement,
            ctl: ctl_w,
            pidfd,
            since: Instant::now(),
        })
    }

    /// What `/metrics` shows of this pool.
    fn stats(&self) -> Stats {
        let c = &self.counters;
        let (idle, pending) = {
            let st = self.state();
            (st.idle.len(), st.wanted.len() + st.making)
        };
        Stats {
            idle: idle as u64,
            pending: pending as u64,
            cap: self.cap as u64,
            claims: c.claims.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            made: c.made.load(Ordering::Relaxed),
            failures: c.failures.load(Ordering::Relaxed),
        }
    }

    /// Counts a claim that failed after the slot was taken.
    pub fn failed(&self) {
        self.counters.failures.fetch_add(1, Ordering::Relaxed);
    }
}

/// The maker: makes the wanted slots, one at a time, while the pool exists; pauses after
/// failures. Never returns while the pool exists (see the module docs).
fn maker(pool: Weak<Warm>) {
    let mut backoff = Duration::from_millis(500);
    loop {
        let Some(w) = pool.upgrade() else { return };
        let doomed = std::mem::take(&mut w.state().doomed);
        drop(doomed);
        let key = {
            let mut st = w.state();
            match st.wanted.pop_front() {
                Some(k) => {
                    st.making += 1;
                    k
                }
                None => {
                    st.expire();
                    if !st.doomed.is_empty() {
                        continue;
                    }
                    let _ = w
                        .wake
                        .wait_timeout(st, Duration::from_secs(1))
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    continue;
                }
            }
        };
        let made = w.make(&key);
        let mut st = w.state();
        st.making -= 1;
        match made {
            Ok(slot) => {
                w.counters.made.fetch_add(1, Ordering::Relaxed);
                st.idle.push_back(slot);
                backoff = Duration::from_millis(500);
            }
            Err(e) => {
                drop(st);
                w.counters.failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "cannot make a warm bwrap sandbox");
                drop(w);
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// What a failed slot's bwrap wrote on stderr (killed first; at most 4 KiB).
fn stderr_of(child: &mut Child) -> String {
    let _ = child.start_kill();
    let Some(err) = child.stderr.take().and_then(|e| e.into_owned_fd().ok()) else {
        return String::new();
    };
    let mut text = Vec::new();
    let mut buf = [0u8; 4096];
    // The pipe is non-blocking: what is there now, with a short grace for the rest.
    for _ in 0..20 {
        match rustix::io::read(&err, &mut buf) {
            Ok(0) => break,
            Ok(n) => text.extend_from_slice(&buf[..n]),
            Err(rustix::io::Errno::AGAIN) => std::thread::sleep(Duration::from_millis(5)),
            Err(_) => break,
        }
        if text.len() >= 4096 {
            break;
        }
    }
    text.truncate(4096);
    String::from_utf8_lossy(&text).trim().to_string()
}

/// Waits (bounded) for the waiter's `R`.
fn wait_ready(ready: &OwnedFd) -> Result<(), String> {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut fds = [PollFd::new(ready, PollFlags::IN)];
    let bound = rustix::event::Timespec {
        tv_sec: READY_BOUND.as_secs() as i64,
        tv_nsec: 0,
    };
    match poll(&mut fds, Some(&bound)) {
        Ok(0) => {
            return Err(format!(
                "the warm sandbox was not ready within {} s",
                READY_BOUND.as_secs()
            ))
        }
        Ok(_) => {}
        Err(e) => return Err(format!("poll: {e}")),
    }
    let mut b = [0u8; 1];
    match rustix::io::read(ready, &mut b) {
        Ok(1) if b[0] == b'R' => Ok(()),
        Ok(_) => Err("the warm sandbox ended before it was ready".into()),
        Err(e) => Err(format!("reading the warm sandbox's readiness: {e}")),
    }
}

/// The job message of [`Slot::claim`]: `b1`, cwd, argc, argv…, envc, env… (each
/// NUL-terminated); `None` when the job cannot be sent this way (a NUL or `=` where
/// bwrap would refuse it, no command, or too large): it starts cold.
fn message(spec: &SandboxSpec) -> Option<Vec<u8>> {
    let mut argv: Vec<&str> = Vec::new();
    if !spec.override_entrypoint {
        argv.push(SBA_ENTRYPOINT);
    }
    argv.extend(spec.command.iter().map(String::as_str));
    if argv.is_empty() {
        return None;
    }
    // bwrap's --setenv is setenv(3): a later value of a name replaces the earlier in place.
    let mut env: Vec<(&str, &str)> = Vec::new();
    for (k, v) in &spec.env {
        if k.is_empty() || k.contains('=') {
            return None;
        }
        match env.iter_mut().find(|(n, _)| n == k) {
            Some(e) => e.1 = v,
            None => env.push((k, v)),
        }
    }
    let mut out = Vec::new();
    let mut field = |f: &[u8]| -> Option<()> {
        if f.contains(&0) {
            return None;
        }
        out.extend_from_slice(f);
        out.push(0);
        Some(())
    };
    field(b"b1")?;
    field(spec.workdir.as_bytes())?;
    field(argv.len().to_string().as_bytes())?;
    for a in &argv {
        field(a.as_bytes())?;
    }
    field(env.len().to_string().as_bytes())?;
    for (k, v) in &env {
        field(format!("{k}={v}").as_bytes())?;
    }
    (out.len() <= MAX_JOB).then_some(out)
}

impl Slot {
    /// Hands `spec`'s job to this slot (see the module docs); blocking. `Ok`: bwrap's
    /// client and the job's confinement, to be waited for as a cold job's. `Err`: nothing
    /// of the job ran, and the slot is gone.
    pub fn claim(mut self, spec: &SandboxSpec) -> Result<(Child, Confinement), String> {
        let msg = message(spec).ok_or("the job cannot be sent to a warm sandbox")?;
        if !matches!(self.child.try_wait(), Ok(None)) {
            return Err("the warm sandbox had ended".into());
        }
        let mut trees = Vec::with_capacity(spec.mounts.len());
        for m in &spec.mounts {
            let tree = clone_tree(&m.host, true, job_attrs(m.writable))
                .map_err(|e| format!("cannot clone {}: {e}", m.host.display()))?;
            trees.push((tree, m.target.as_str()));
        }
        in_mount_namespace(&self.pidfd, || {
            for (tree, target) in &trees {
                move_onto(tree, *target, OFlags::DIRECTORY)?;
            }
            Ok(())
        })
        .map_err(|e| format!("cannot mount the job's directories: {e}"))?;
        self.confinement.cgroup.rename(&spec.name);
        let mut ctl = std::fs::File::from(self.ctl);
        use std::io::Write;
        ctl.write_all(&msg)
            .map_err(|e| format!("cannot hand the job to the warm sandbox: {e}"))?;
        drop(ctl);
        Ok((self.child, self.confinement))
    }
}

/// The warm pool's counters, of this process's first pool (`None` without one).
pub fn stats() -> Option<Stats> {
    let all = ALL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    all.iter().find_map(Weak::upgrade).map(|w| w.stats())
}

/// The warm pool's counters in Prometheus text format (empty without a pool).
pub fn metrics_text() -> String {
    let Some(s) = stats() else {
        return String::new();
    };
    format!(
        "# TYPE cynode_worker_bwrap_warm_idle gauge\ncynode_worker_bwrap_warm_idle {}\n\
         # TYPE cynode_worker_bwrap_warm_pending gauge\ncynode_worker_bwrap_warm_pending {}\n\
         # TYPE cynode_worker_bwrap_warm_slots gauge\ncynode_worker_bwrap_warm_slots {}\n\
         # TYPE cynode_worker_bwrap_warm_claims_total counter\ncynode_worker_bwrap_warm_claims_total {}\n\
         # TYPE cynode_worker_bwrap_warm_misses_total counter\ncynode_worker_bwrap_warm_misses_total {}\n\
         # TYPE cynode_worker_bwrap_warm_made_total counter\ncynode_worker_bwrap_warm_made_total {}\n\
         # TYPE cynode_worker_bwrap_warm_failures_total counter\ncynode_worker_bwrap_warm_failures_total {}\n",
        s.idle, s.pending, s.cap, s.claims, s.misses, s.made, s.failures
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::Mount;
    use cynode_protocol::worker_api::NetworkPolicy;

    fn spec(command: &[&str], env: &[(&str, &str)]) -> SandboxSpec {
        SandboxSpec {
            name: "cynode-j".into(),
            image: "i".into(),
            command: command.iter().map(|s| s.to_string()).collect(),
            override_entrypoint: true,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            mounts: vec![Mount {
                host: "/tmp".into(),
                target: "/job".into(),
                writable: true,
            }],
            workdir: "/job".into(),
            network: NetworkPolicy::None,
            limits: ResourceLimits {
                memory_mb: 1,
                pids: 1,
                cpus: 1.0,
                tmpfs_mb: 1,
            },
            labels: vec![],
            timeout: Duration::from_secs(1),
            output_cap: 1,
            host_uid: 1,
        }
    }

    #[test]
    fn the_message_is_what_bwrap_would_set() {
        let m = message(&spec(
            &["sh", "-c", "x"],
            &[("A", "1"), ("B", "2"), ("A", "3")],
        ))
        .unwrap();
        assert_eq!(m, b"b1\0/job\x003\0sh\0-c\0x\x002\0A=3\0B=2\0".to_vec());
    }

    #[test]
    fn jobs_bwrap_would_refuse_start_cold() {
        assert!(message(&spec(&[], &[])).is_none());
        assert!(message(&spec(&["a\0b"], &[])).is_none());
        assert!(message(&spec(&["true"], &[("A=B", "1")])).is_none());
        assert!(message(&spec(&["true"], &[("", "1")])).is_none());
        let big = "x".repeat(MAX_JOB);
        assert!(message(&spec(&["true", &big], &[])).is_none());
    }

    #[test]
    fn keys_match_on_uid_rootfs_and_limits() {
        let s = spec(&["true"], &[]);
        let k = Key {
            uid: 7,
            rootfs: "/r".into(),
            limits: s.limits,
        };
        assert!(k.matches(&k.clone()));
        assert!(!k.matches(&Key {
            uid: 8,
            ..k.clone()
        }));
        assert!(!k.matches(&Key {
            rootfs: "/s".into(),
            ..k.clone()
        }));
        let mut l = s.limits;
        l.tmpfs_mb = 2;
        assert!(!k.matches(&Key {
            limits: l,
            ..k.clone()
        }));
    }
}
