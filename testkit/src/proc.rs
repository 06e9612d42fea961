//! Processes a test owns: their own process group, a parent-death signal, killed on drop.
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the
//! process. Tests fork from short-lived threads (tokio's blocking pool, helper threads), so
//! every owned child is forked by one spawner thread that lives as long as the test
//! process: the signal then fires exactly when the test process dies.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

fn spawner() -> &'static std::sync::Mutex<mpsc::Sender<SpawnRequest>> {
    static SPAWNER: OnceLock<std::sync::Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("testkit-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
                // The channel's sender lives in a static: this loop never ends, so the
                // thread (and with it every child's parent-death signal) lasts as long as
                // the process.
            })
            .map_err(|e| panic!("cannot start the spawner thread: {e}"))
            .ok();
        std::sync::Mutex::new(tx)
    })
}

/// A child process the test owns, with every process in its group.
#[derive(Debug)]
pub struct OwnedChild {
    child: Child,
    pgid: i32,
    what: String,
    /// The leader's exit status once reaped. Until then its pid, and so the group id,
    /// cannot be reused, which makes signalling the group safe.
    reaped: Option<ExitStatus>,
}

impl OwnedChild {
    /// Spawns `cmd` in a new process group with `PR_SET_PDEATHSIG = SIGKILL`.
    ///
    /// # Panics
    /// When the command cannot be started: a test cannot go on without it.
    pub fn spawn(mut cmd: Command) -> OwnedChild {
        let what = describe(&cmd);
        cmd.process_group(0);
        // SAFETY: between fork and exec this only calls prctl and getppid, both
        // async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may already be gone (the signal would never come): give up.
                if libc::getppid() == 1 {
                    return Err(std::io::Error::other("parent exited before exec"));
                }
                Ok(())
            });
        }
        let (tx, rx) = mpsc::channel();
        spawner()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send((cmd, tx))
            .unwrap_or_else(|_| panic!("the spawner thread is gone"));
        let child = rx
            .recv()
            .unwrap_or_else(|_| panic!("the spawner thread is gone"))
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        let pgid = child.id() as i32;
        OwnedChild {
            child,
            pgid,
            what,
            reaped: None,
        }
    }

    /// The child's pid (also its process group id).
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The child itself, e.g. to take its pipes.
    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Whether the leader has exited, without reaping it.
    fn exited(&self) -> bool {
        // SAFETY: waitid on our own child with WNOWAIT only inspects it; the zeroed
        // siginfo is valid output storage.
        unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            let r = libc::waitid(
                libc::P_PID,
                self.pgid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            );
            r == 0 && info.si_pid() != 0
        }
    }

    /// The exit status once the child has exited; what it left in its group is killed
    /// before the child is reaped.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.reaped.is_none() && self.exited() {
            self.kill();
        }
        self.reaped
    }

    /// Sends `signal` to the child only (not its group), unless it is reaped.
    pub fn signal(&self, signal: i32) {
        if self.reaped.is_none() {
            // SAFETY: signalling the child we spawned and have not reaped.
            unsafe {
                libc::kill(self.pgid, signal);
            }
        }
    }

    /// Waits for the child to exit, at most `limit`; `None` when it is still running.
    pub fn wait_timeout(&mut self, limit: Duration) -> Option<ExitStatus> {
        let until = Instant::now() + limit;
        loop {
            if let Some(s) = self.try_wait() {
                return Some(s);
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILLs the whole process group and reaps the child.
    pub fn kill(&mut self) {
        if self.reaped.is_some() {
            return;
        }
        // SAFETY: signalling the process group we created; its leader is not reaped yet,
        // so the id still names our group.
        unsafe {
            libc::kill(-self.pgid, libc::SIGKILL);
        }
        let _ = self.child.kill();
        self.reaped = self.child.wait().ok();
    }

    /// What was started, for messages.
    pub fn describe(&self) -> &str {
        &self.what
    }
}

impl Drop for OwnedChild {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `program arg…`, shortened, for messages.
fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
        if s.len() > 200 {
            s.push('…');
            break;
        }
    }
    s
}

/// A command that outlived its limit: it was killed; this is what it had printed.
#[derive(Debug)]
pub struct TimedOut {
    pub what: String,
    pub elapsed: Duration,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl std::fmt::Display for TimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`{}` did not finish within {:?} (the test's own bound); it was killed.\nstdout: {}\nstderr (last 4 KiB): {}",
            self.what,
            self.elapsed,
            tail(&self.stdout, 4096),
            tail(&self.stderr, 4096)
        )
    }
}

/// Runs `cmd` to the end like `Command::output`, in a process group the test owns, for at
/// most `limit`; on time-out the group is killed and what it printed is returned as the
/// error. Whatever the command left in its group is killed when it exits.
///
/// # Panics
/// When the command cannot start.
pub fn output_within(cmd: Command, limit: Duration) -> Result<Output, TimedOut> {
    run_within(cmd, None, limit)
}

/// [`output_bounded`] with `input` written to the command's stdin (then closed).
///
/// # Panics
/// When the command cannot start or outlives `limit`.
pub fn output_bounded_with_input(cmd: Command, input: &[u8], limit: Duration) -> Output {
    run_within(cmd, Some(input.to_vec()), limit).unwrap_or_else(|t| panic!("{t}"))
}

fn run_within(
    mut cmd: Command,
    input: Option<Vec<u8>>,
    limit: Duration,
) -> Result<Output, TimedOut> {
    // As `Command::output`: both outputs captured; stdin only when there is input.
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let started = Instant::now();
    let mut owned = OwnedChild::spawn(cmd);
    if let (Some(input), Some(mut stdin)) = (input, owned.child.stdin.take()) {
        // A writer thread: a command that does not read cannot block the test.
        std::thread::spawn(move || {
            let _ = stdin.write_all(&input);
        });
    }
    let out = drain(owned.child.stdout.take());
    let err = drain(owned.child.stderr.take());
    let status = owned.wait_timeout(limit);
    owned.kill();
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    match status {
        Some(status) => Ok(Output {
            status,
            stdout,
            stderr,
        }),
        None => Err(TimedOut {
            what: owned.what.clone(),
            elapsed: started.elapsed(),
            stdout,
            stderr,
        }),
    }
}

/// Reads a stream to its end on a thread of its own.
fn drain<R: Read + Send + 'static>(r: Option<R>) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut r) = r {
            let _ = r.read_to_end(&mut buf);
        }
        buf
    })
}

/// [`output_within`] for a command that must finish: a time-out fails the test with the
/// command's own output.
///
/// # Panics
/// When the command cannot start or outlives `limit`.
pub fn output_bounded(cmd: Command, limit: Duration) -> Output {
    output_within(cmd, limit).unwrap_or_else(|t| panic!("{t}"))
}

fn tail(bytes: &[u8], n: usize) -> String {
    let start = bytes.len().saturating_sub(n);
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

/// Runs one of the project's set-up scripts (`bash <args…>` from `root`, the smoke test
/// skipped) within 240 s, fails the test with the script's stderr unless it succeeds, and
/// returns the last line it printed (what the script produced: a path, an image name).
/// The scripts are cached by `deploy/test-env.sh` before the tests run: seconds, not
/// minutes.
pub fn setup_script(root: &std::path::Path, args: &[&str]) -> String {
    let mut cmd = Command::new("bash");
    cmd.args(args)
        .current_dir(root)
        .env("CYNODE_SKIP_SMOKE", "1");
    let out = output_bounded(cmd, Duration::from_secs(240));
    assert!(
        out.status.success(),
        "setup script {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .lines()
        .last()
        .unwrap_or("")
        .to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn alive(pid: i32) -> bool {
        // A zombie still answers kill(0): read its state instead.
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                !s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            })
            .unwrap_or(false)
    }

    #[test]
    fn drop_kills_the_whole_group() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "sleep 300 & echo $!; wait"])
            .stdout(Stdio::piped());
        let mut owned = OwnedChild::spawn(cmd);
        let mut line = String::new();
        let mut out = owned.child_mut().stdout.take().unwrap();
        let mut byte = [0u8; 1];
        while out.read(&mut byte).unwrap() == 1 && byte[0] != b'\n' {
            line.push(byte[0] as char);
        }
        let grandchild: i32 = line.trim().parse().unwrap();
        assert!(alive(grandchild));
        drop(owned);
        let until = Instant::now() + Duration::from_secs(10);
        while alive(grandchild) {
            assert!(
                Instant::now() < until,
                "grandchild {grandchild} outlived the drop"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn output_bounded_returns_the_output() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo out; echo err >&2; exit 3"]);
        let out = output_bounded(cmd, Duration::from_secs(30));
        assert_eq!(
            (out.status.code(), out.stdout, out.stderr),
            (Some(3), b"out\n".to_vec(), b"err\n".to_vec())
        );
    }

    #[test]
    fn output_bounded_fails_with_its_own_message() {
        let r = std::panic::catch_unwind(|| {
            let mut cmd = Command::new("sh");
            cmd.args(["-c", "echo started; sleep 300"]);
            output_bounded(cmd, Duration::from_millis(300))
        });
        let msg = r
            .err()
            .and_then(|e| e.downcast::<String>().ok())
            .expect("a panic with a message");
        assert!(msg.contains("did not finish within"), "{msg}");
        assert!(msg.contains("stdout: started"), "{msg}");
    }
}
