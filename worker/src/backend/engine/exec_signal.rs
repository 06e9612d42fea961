//! Signals to a streamed command of a session container (Podman, Docker, gVisor;
//! [`crate::backend::exec_io`]).
//!
//! Neither engine's `exec` client forwards a signal to the process it started (killing
//! the client leaves the command running), and neither has an API to signal one exec. So
//! a streamed command runs under a one-line `sh` wrapper that records its own pid in the
//! container, at `/tmp/.cynode-exec-<sandbox name>`, then executes the command in its
//! place (same process, same argv from there on; the records of earlier commands of the
//! session are removed first, so at most one is left). A signal is a second `exec` in the
//! container, as the session's user, that reads the record and runs `kill -s SIG` on the
//! process group of that pid (or the pid alone, when it leads no group).
//!
//! The record is in the sandbox and the sandbox may rewrite it; that gains it nothing:
//! the `kill` runs inside the container as the user its commands run as, so it can only
//! signal what the sandbox's own commands could, and the record must be a plain number.
//! The node never interpolates anything into the scripts: the record's path and the
//! signal's name (from the allow-list) are positional arguments. The signaller is revoked
//! once the command's exec returned, before the session can run another command.

use std::process::Stdio;
use std::time::Duration;

use super::EngineBackend;
use crate::backend::exec_io::{retry_while_starting, Signal, SignalError, Signaller};

/// The bound on one signal's `exec`.
const SIGNAL_BOUND: Duration = Duration::from_secs(10);

/// The wrapper: records its pid at `$0`, then becomes `"$@"`.
const RECORD: &str =
    "rm -f /tmp/.cynode-exec-* 2>/dev/null; { echo $$ >\"$0\"; } 2>/dev/null; exec \"$@\"";

/// The signal: reads the pid at `$0`, signals its group (else it) with `$1`. The group
/// first as busybox's and bash's `kill` take it, `-PID` (dash refuses that option before
/// it signals anything), then as dash's, `-- -PID` (not first: busybox signals the group
/// and then fails on the `--`, and the next form would signal it again). Exit 3: no
/// pid recorded (or 0, 1 or a leading zero: never the init or every process); 4: no such
/// process.
const KILL: &str =
    "p=$(cat \"$0\" 2>/dev/null) || exit 3; case $p in ''|0*|1|*[!0-9]*) exit 3;; esac; \
kill -s \"$1\" \"-$p\" 2>/dev/null || kill -s \"$1\" -- \"-$p\" 2>/dev/null || \
kill -s \"$1\" \"$p\" 2>/dev/null || exit 4";

/// Where the command of sandbox `name` records its pid in the container.
pub fn record_path(name: &str) -> String {
    format!("/tmp/.cynode-exec-{name}")
}

/// `command` under the wrapper that records its pid at `record`.
pub fn recorded(record: &str, command: &[String]) -> Vec<String> {
    let mut argv = vec!["sh".into(), "-c".into(), RECORD.into(), record.into()];
    argv.extend(command.iter().cloned());
    argv
}

/// Signals the recorded command of one exec in a session container.
#[derive(Debug)]
pub struct EngineSignaller {
    pub engine: EngineBackend,
    pub container: String,
    /// `--user` of the session's commands.
    pub user: String,
    pub record: String,
    /// Under gVisor: the signal's `exec` runs through the node's filter, as commands do.
    pub gvisor: bool,
}

#[async_trait::async_trait]
impl Signaller for EngineSignaller {
    async fn signal(&self, sig: Signal) -> Result<(), SignalError> {
        retry_while_starting(|| self.once(sig)).await
    }
}

impl EngineSignaller {
    /// One attempt: a command whose wrapper has not recorded its pid yet is
    /// [`SignalError::NotStarted`].
    async fn once(&self, sig: Signal) -> Result<(), SignalError> {
        let mut script: Vec<String> = vec![
            "sh".into(),
            "-c".into(),
            KILL.into(),
            self.record.clone(),
            sig.name().into(),
        ];
        if self.gvisor {
            script = super::exec_filter::wrap(&script);
        }
        let mut cmd = self.engine.command();
        cmd.arg("exec")
            .arg(format!("--user={}", self.user))
            .arg(&self.container)
            .args(&script)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let out = match tokio::time::timeout(SIGNAL_BOUND, cmd.output()).await {
            Ok(Ok(o)) => o,
            Ok(Err(e)) => {
                return Err(SignalError::Failed(format!(
                    "cannot run {}: {e}",
                    self.engine.binary()
                )))
            }
            Err(_) => {
                return Err(SignalError::Failed(format!(
                    "{} did not deliver the signal within {}s",
                    self.engine.binary(),
                    SIGNAL_BOUND.as_secs()
                )))
            }
        };
        match out.status.code() {
            Some(0) => Ok(()),
            Some(3) => Err(SignalError::NotStarted),
            Some(4) => Err(SignalError::Ended),
            _ => Err(SignalError::Failed(format!(
                "{} could not signal the command: {}",
                self.engine.binary(),
                super::last_line(&out.stderr)
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wrapper_records_its_pid_and_becomes_the_command() {
        let dir = tempfile::tempdir().unwrap();
        let record = dir.path().join("rec").display().to_string();
        let argv = recorded(&record, &["sh".into(), "-c".into(), "echo $$".into()]);
        let out = std::process::Command::new(&argv[0])
            .args(&argv[1..])
            .output()
            .unwrap();
        let printed = String::from_utf8(out.stdout).unwrap();
        let kept = std::fs::read_to_string(&record).unwrap();
        assert_eq!(printed.trim(), kept.trim());
    }

    #[test]
    fn the_kill_script_signals_the_recorded_group() {
        use std::os::unix::process::{CommandExt, ExitStatusExt};
        let dir = tempfile::tempdir().unwrap();
        let record = dir.path().join("rec");
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .unwrap();
        std::fs::write(&record, child.id().to_string()).unwrap();
        let st = std::process::Command::new("sh")
            .args(["-c", KILL, &record.display().to_string(), "TERM"])
            .status()
            .unwrap();
        assert_eq!(st.code(), Some(0));
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGTERM));
    }

    #[test]
    fn the_kill_script_refuses_a_record_that_is_no_pid() {
        let dir = tempfile::tempdir().unwrap();
        let record = dir.path().join("rec");
        for (text, code) in [
            ("", 3),
            ("1 2", 3),
            ("-1", 3),
            ("1", 3),
            ("0", 3),
            ("007", 3),
            ("$(id)", 3),
        ] {
            std::fs::write(&record, text).unwrap();
            let st = std::process::Command::new("sh")
                .args(["-c", KILL, &record.display().to_string(), "TERM"])
                .status()
                .unwrap();
            assert_eq!(st.code(), Some(code), "{text:?}");
        }
        std::fs::remove_file(&record).unwrap();
        let st = std::process::Command::new("sh")
            .args(["-c", KILL, &record.display().to_string(), "TERM"])
            .status()
            .unwrap();
        assert_eq!(st.code(), Some(3));
    }
}
