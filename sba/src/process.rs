//! Running one child process under a deadline with bounded output capture.
//!
//! The child gets its own process group. One poll loop watches stdout, stderr, stdin (when
//! given), a pidfd for the child's exit and the runner's interrupt pipe, so nothing sleeps
//! and nothing blocks. On the deadline (or an interrupt) the whole group gets SIGTERM, then
//! SIGKILL after a short grace. After the child exits, pipes are drained for a bounded time;
//! if a descendant still holds them, the group is killed and the pipes closed, so an orphan
//! cannot hang the runner. Finally every remaining descendant is killed and reaped (the
//! runner is a child subreaper, so orphans come back to it).

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};

use crate::capture::HeadTail;
use crate::launch;

/// Time between SIGTERM and SIGKILL.
pub const TERM_GRACE: Duration = Duration::from_millis(1000);
/// How long pipes may stay open after the child exited.
pub const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// What to run.
#[derive(Debug)]
pub struct Spec<'a> {
    pub program: &'a str,
    pub args: &'a [String],
    pub env: Vec<(String, String)>,
    /// Directory fd the child changes into before exec.
    pub cwd: BorrowedFd<'a>,
    pub stdin: Option<&'a [u8]>,
    pub deadline: Instant,
    /// stdout+stderr cap; each stream keeps at most this much.
    pub cap: usize,
    /// Readable when the runner was asked to stop.
    pub interrupt: Option<BorrowedFd<'a>>,
}

/// How the child ended.
#[derive(Debug)]
pub struct Outcome {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub stdout: HeadTail,
    pub stderr: HeadTail,
    pub timed_out: bool,
    pub interrupted: bool,
    pub duration: Duration,
}

/// Marks the calling process a child subreaper, so orphaned descendants are reparented to
/// it and can be reaped.
pub fn become_subreaper() -> io::Result<()> {
    prctl_set(libc::PR_SET_CHILD_SUBREAPER, 1)
}

/// Makes the runner non-dumpable, so the steps it runs (same uid) can neither ptrace it
/// nor read its `/proc/<pid>/mem`, `environ` or fds: they could otherwise rewrite its
/// limits or its result. Steps are exec'd and so dumpable again; only the runner is not.
pub fn make_non_dumpable() -> io::Result<()> {
    prctl_set(libc::PR_SET_DUMPABLE, 0)
}

/// `prctl(option, value)` for an option that takes one integer argument.
fn prctl_set(option: libc::c_int, value: libc::c_ulong) -> io::Result<()> {
    // SAFETY: the options passed here (PR_SET_CHILD_SUBREAPER, PR_SET_DUMPABLE) take one
    // integer argument and no pointer.
    let rc = unsafe { libc::prctl(option, value, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Spawns and supervises the child. `Err` only when it could not start.
pub fn run(spec: Spec<'_>) -> io::Result<Outcome> {
    let started = Instant::now();
    let resolved = launch::resolve(spec.program, &spec.env);
    let program = resolved
        .as_deref()
        .and_then(|p| p.to_str())
        .unwrap_or(spec.program);
    let mut child = launch::spawn(program, |program, leading| {
        let mut cmd = Command::new(program);
        if leading.is_empty() {
            // argv[0] stays the name the step gave, as the child's own PATH walk kept it.
            cmd.arg0(spec.program);
        }
        cmd.args(leading)
            .args(spec.args)
            .env_clear()
            .envs(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(if spec.stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        launch::set_dir(&mut cmd, spec.cwd);
        cmd
    })?;
    let pid = child.id() as i32;
    let mut sup = Supervisor {
        pid,
        stdout: child.stdout.take(),
        stderr: child.stderr.take(),
        stdin: child.stdin.take(),
        stdin_data: spec.stdin.unwrap_or_default(),
        stdin_pos: 0,
        out: HeadTail::new(spec.cap),
        err: HeadTail::new(spec.cap),
        status: None,
        timed_out: false,
        interrupted: false,
    };
    let result = sup.supervise(&mut child, spec.deadline, spec.interrupt);
    kill_group(pid, libc::SIGKILL);
    if sup.status.is_none() {
        sup.status = child.wait().ok().map(|s| raw_status(&s));
    }
    reap_strays();
    result?;
    let (exit_code, signal) = match sup.status {
        Some(raw) if libc::WIFEXITED(raw) => (Some(libc::WEXITSTATUS(raw)), None),
        Some(raw) if libc::WIFSIGNALED(raw) => (None, Some(libc::WTERMSIG(raw))),
        _ => (None, None),
    };
    Ok(Outcome {
        exit_code,
        signal,
        stdout: sup.out,
        stderr: sup.err,
        timed_out: sup.timed_out,
        interrupted: sup.interrupted,
        duration: started.elapsed(),
    })
}

fn raw_status(s: &std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    s.into_raw()
}

struct Supervisor<'a> {
    pid: i32,
    stdout: Option<ChildStdout>,
    stderr: Option<ChildStderr>,
    stdin: Option<ChildStdin>,
    stdin_data: &'a [u8],
    stdin_pos: usize,
    out: HeadTail,
    err: HeadTail,
    status: Option<i32>,
    timed_out: bool,
    interrupted: bool,
}

/// Where the supervisor is in stopping the child.
#[derive(Clone, Copy, PartialEq)]
enum Phase {
    Running,
    Terminating { kill_at: Instant },
    Killed,
}

impl Supervisor<'_> {
    fn supervise(
        &mut self,
        child: &mut Child,
        deadline: Instant,
        interrupt: Option<BorrowedFd<'_>>,
    ) -> io::Result<()> {
        for fd in [
            self.stdout.as_ref().map(|f| f.as_fd()),
            self.stderr.as_ref().map(|f| f.as_fd()),
            self.stdin.as_ref().map(|f| f.as_fd()),
        ]
        .into_iter()
        .flatten()
        {
            rustix::io::ioctl_fionbio(fd, true)?;
        }
        if self.stdin_data.is_empty() {
            self.stdin = None;
        }
        let pidfd = rustix::process::pidfd_open(
            rustix::process::Pid::from_child(child),
            rustix::process::PidfdFlags::empty(),
        )
        .ok();
        let mut phase = Phase::Running;
        let mut drain_until: Option<Instant> = None;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if self.status.is_none() {
                self.try_reap()?;
                if self.status.is_some() && drain_until.is_none() {
                    drain_until = Some(Instant::now() + DRAIN_GRACE);
                }
            }
            let pipes_open = self.stdout.is_some() || self.stderr.is_some();
            if self.status.is_some() && !pipes_open {
                return Ok(());
            }
            let now = Instant::now();
            // Decide what the next wake-up is for.
            let mut wake = deadline;
            match phase {
                Phase::Running if self.status.is_none() && now >= deadline => {
                    self.timed_out = true;
                    phase = self.terminate(now);
                }
                Phase::Terminating { kill_at } if now >= kill_at => {
                    kill_group(self.pid, libc::SIGKILL);
                    phase = Phase::Killed;
                }
                _ => {}
            }
            if let Phase::Terminating { kill_at } = phase {
                wake = kill_at;
            }
            if let Some(until) = drain_until {
                if now >= until {
                    // The child is gone but something still holds the pipes.
                    kill_group(self.pid, libc::SIGKILL);
                    self.drain_nonblocking(&mut buf);
                    self.stdout = None;
                    self.stderr = None;
                    return Ok(());
                }
                wake = wake.min(until);
            }
            if phase == Phase::Killed && self.status.is_none() {
                wake = now + Duration::from_millis(50);
            }
            let timeout = wake.saturating_duration_since(now);
            let ts = Timespec {
                tv_sec: timeout.as_secs() as i64,
                tv_nsec: i64::from(timeout.subsec_nanos()),
            };
            let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(5);
            let mut slots = [usize::MAX; 5];
            if let Some(f) = &self.stdout {
                slots[0] = fds.len();
                fds.push(PollFd::new(f, PollFlags::IN));
            }
            if let Some(f) = &self.stderr {
                slots[1] = fds.len();
                fds.push(PollFd::new(f, PollFlags::IN));
            }
            if let Some(f) = &self.stdin {
                slots[2] = fds.len();
                fds.push(PollFd::new(f, PollFlags::OUT));
            }
            if let (Some(p), None) = (&pidfd, self.status) {
                slots[3] = fds.len();
                fds.push(PollFd::new(p, PollFlags::IN));
            }
            if let (Some(i), false) = (interrupt, self.interrupted) {
                slots[4] = fds.len();
                fds.push(PollFd::from_borrowed_fd(i, PollFlags::IN));
            }
            if pidfd.is_none() && self.status.is_none() {
                // No pidfd: poll the child every 10 ms.
                let short = Timespec {
                    tv_sec: 0,
                    tv_nsec: 10_000_000,
                };
                poll(
                    &mut fds,
                    if timeout > Duration::from_millis(10) {
                        &short
                    } else {
                        &ts
                    },
                )?;
            } else {
                poll(&mut fds, &ts)?;
            }
            let ready = |slot: usize| -> bool {
                slot != usize::MAX && fds.get(slot).is_some_and(|f| !f.revents().is_empty())
            };
            let (r_out, r_err, r_in, r_int) = (
                ready(slots[0]),
                ready(slots[1]),
                ready(slots[2]),
                ready(slots[4]),
            );
            drop(fds);
            if r_out {
                read_some(&mut self.stdout, &mut self.out, &mut buf);
            }
            if r_err {
                read_some(&mut self.stderr, &mut self.err, &mut buf);
            }
            if r_in {
                self.feed_stdin();
            }
            if r_int {
                self.interrupted = true;
                if phase == Phase::Running && self.status.is_none() {
                    phase = self.terminate(Instant::now());
                }
            }
        }
    }

    fn terminate(&mut self, now: Instant) -> Phase {
        kill_group(self.pid, libc::SIGTERM);
        Phase::Terminating {
            kill_at: now + TERM_GRACE,
        }
    }

    fn try_reap(&mut self) -> io::Result<()> {
        let mut status = 0;
        // SAFETY: waitpid on our own child pid with a valid out pointer.
        let rc = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) };
        if rc == self.pid {
            self.status = Some(status);
        } else if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn feed_stdin(&mut self) {
        let Some(pipe) = self.stdin.as_mut() else {
            return;
        };
        match pipe.write(&self.stdin_data[self.stdin_pos..]) {
            Ok(n) => {
                self.stdin_pos += n;
                if self.stdin_pos >= self.stdin_data.len() {
                    self.stdin = None;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => self.stdin = None,
        }
    }

    fn drain_nonblocking(&mut self, buf: &mut [u8]) {
        read_some(&mut self.stdout, &mut self.out, buf);
        read_some(&mut self.stderr, &mut self.err, buf);
    }
}

fn poll(fds: &mut [PollFd<'_>], ts: &Timespec) -> io::Result<()> {
    match rustix::event::poll(fds, Some(ts)) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Reads until the pipe would block (bounded to a few chunks so one stream cannot starve
/// the loop); closes it on EOF or error.
fn read_some<R: Read>(pipe: &mut Option<R>, sink: &mut HeadTail, buf: &mut [u8]) {
    let Some(p) = pipe.as_mut() else { return };
    for _ in 0..16 {
        match p.read(buf) {
            Ok(0) => {
                *pipe = None;
                return;
            }
            Ok(n) => sink.push(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => {
                *pipe = None;
                return;
            }
        }
    }
}

/// Signals a whole process group; a group that is already gone is fine.
pub fn kill_group(pgid: i32, sig: i32) {
    // SAFETY: kill with a negative pid signals the group; no memory is involved.
    unsafe {
        libc::kill(-pgid, sig);
    }
}

/// Kills and reaps every remaining descendant: those reparented to this subreaper after
/// leaving the step's process group (setsid) included. Bounded to about one second.
pub fn reap_strays() {
    let me = std::process::id();
    let until = Instant::now() + Duration::from_secs(1);
    loop {
        let mut status = 0;
        // SAFETY: reaping any of our exited children; WNOHANG never blocks.
        let rc = loop {
            let rc = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if rc <= 0 {
                break rc;
            }
        };
        if rc < 0 || Instant::now() >= until {
            return; // ECHILD: no descendants left.
        }
        if let Ok(entries) = std::fs::read_dir("/proc") {
            for entry in entries.flatten() {
                let name = entry.file_name();
                let Some(pid) = name.to_str().and_then(|s| s.parse::<i32>().ok()) else {
                    continue;
                };
                if parent_of(pid) == Some(me) {
                    // SAFETY: signalling a pid that is our own child.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn parent_of(pid: i32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    after.split(' ').nth(1)?.parse().ok()
}

/// CPU time and peak RSS of all reaped descendants, from getrusage(RUSAGE_CHILDREN).
pub fn children_usage() -> cynode_protocol::result::ResourceUsage {
    // SAFETY: getrusage fills the zeroed struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a rusage struct.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    if rc != 0 {
        return Default::default();
    }
    let ms = |tv: libc::timeval| (tv.tv_sec as u64) * 1000 + (tv.tv_usec as u64) / 1000;
    cynode_protocol::result::ResourceUsage {
        cpu_time_ms: ms(ru.ru_utime) + ms(ru.ru_stime),
        max_rss_bytes: (ru.ru_maxrss as u64) * 1024,
    }
}
