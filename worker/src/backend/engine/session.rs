//! Session sandboxes on Podman and Docker under gVisor, and under runc/crun where the pool
//! waiter is missing (otherwise a session is a pooled container whose waiter runs its
//! commands, [`super::pool::WarmSession`]): one keep-alive container per session, started
//! detached with exactly the job flags ([`EngineBackend::run_args`]: no network, read-only
//! root, the workspace's host uid, all capabilities dropped, no-new-privileges,
//! memory/CPU/pids limits, tmpfs /tmp, the node label) plus `--init`, running `sleep` for
//! the session's max lifetime plus a margin (the node's janitor removes the container when
//! the node is gone, [`crate::janitor`]; should the janitor die with it, the container
//! outlives the node by at most that, even if the node never restarts). The init
//! (catatonit / tini) is PID 1 so the orphans of finished commands are reaped and never
//! pile up against the pids limit. Each command is an `exec --user N:N --workdir … --env …`.
//!
//! Killing a timed-out command: killing the `podman exec` client leaves the command
//! running inside the container, and `timeout`/`pkill` may not exist in the image. So the
//! node kills it from the host: every process in the container's PID namespace except the
//! keep-alive pair (the init and its `sleep`, recorded when the session starts) gets
//! SIGKILL, repeated until none is left. That reaches every descendant, including ones
//! that double-forked or cleared their environment; it also ends background processes
//! earlier commands left, which is why a session runs one command at a time. It needs the
//! node to see the container's processes (rootful engine on the same host, node as root).
//! Under gVisor (`runtime: runsc`) the container's processes live in gVisor's kernel and
//! the engine reports gVisor's sandbox process, which sits in the host's own PID
//! namespace: the node never kills "every process of the namespace" there (that would be
//! the host's), but lists and kills the command's processes with `runsc ps` and
//! `runsc kill --pid`. A container in the node's own PID namespace under any other
//! runtime is refused. `runsc exec` does not apply the OCI seccomp profile, so under gVisor
//! each command runs through the node's filter ([`super::exec_filter`]).
//!
//! A streamed command may have a stdin (`exec --interactive`, its pipe fed by
//! [`exec_io::feed`]) and takes signals through a pid it records in the container
//! ([`super::exec_signal`]).

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use super::{last_line, EngineBackend};
use crate::backend::{
    exec_io, BackendError, EndReason, SandboxOutcome, SandboxSpec, SessionSandbox,
};
use crate::config::{BackendKind, OciRuntime};
use crate::sandbox::engine_user;

/// How long a keep-alive container outlives its session's max lifetime by itself; the
/// reaper removes it at the max lifetime.
pub(crate) const KEEPALIVE_MARGIN: Duration = Duration::from_secs(60);
/// Bound on `run -d` and `inspect` calls of the engine CLI.
const CLI_BOUND: Duration = Duration::from_secs(60);

/// A running keep-alive container.
#[derive(Debug, Clone)]
pub struct KeepAlive {
    pub name: String,
    /// `pid:[inode]` of the container's PID namespace, as `/proc/<pid>/ns/pid` reads.
    pid_ns: String,
    /// Host pids of the init and the `sleep` it runs: never killed by [`kill_commands`].
    /// Under gVisor only the host pid of its sandbox process.
    keep: Vec<i32>,
    /// Set when the container runs under gVisor: its processes are not the host's.
    gvisor: Option<Gvisor>,
}

/// A session container under gVisor (`runtime: runsc`). Its processes live in gVisor's
/// own kernel: the host sees only gVisor's sandbox process, in the host's own PID
/// namespace, so they are listed and killed through `runsc ps` / `runsc kill --pid`.
#[derive(Debug, Clone)]
struct Gvisor {
    /// The runsc binary (the sandbox process's own executable).
    runsc: std::path::PathBuf,
    /// runsc's `--root` state directory the engine gave the sandbox.
    root: String,
    /// The container's full id.
    id: String,
    /// gVisor pids of the init and its `sleep`: never killed.
    keep: Vec<u32>,
}

/// A session's keep-alive container.
#[derive(Debug)]
pub struct KeepAliveSession {
    engine: EngineBackend,
    k: KeepAlive,
}

impl KeepAliveSession {
    /// Starts the session's container described by `spec`, whose `timeout` is the
    /// session's max lifetime (its command is ignored: the container runs `sleep`). On
    /// error nothing is left behind.
    pub async fn start(engine: &EngineBackend, spec: &SandboxSpec) -> Result<Self, BackendError> {
        let ops = Ops { engine };
        match ops.start_container(spec).await {
            Ok(k) => Ok(KeepAliveSession {
                engine: engine.clone(),
                k,
            }),
            Err(e) => {
                engine.force_remove(&spec.name).await;
                Err(e)
            }
        }
    }
}

#[async_trait::async_trait]
impl SessionSandbox for KeepAliveSession {
    async fn exec(&self, spec: &SandboxSpec, cancel: &CancellationToken) -> SandboxOutcome {
        Ops {
            engine: &self.engine,
        }
        .exec_in(&self.k, spec, cancel)
        .await
    }

    /// The init's host pid: the container's network namespace (runc/crun). Under gVisor
    /// the host sees only its sandbox process, whose namespace gVisor's own network stack
    /// does not serve: none.
    fn netns_pid(&self) -> Option<u32> {
        if self.k.gvisor.is_some() {
            return None;
        }
        self.k.keep.first().and_then(|p| u32::try_from(*p).ok())
    }

    /// A keep-alive container whose init is gone (a command killed its `sleep`, the
    /// engine stopped it) cannot run commands any more.
    fn is_alive(&self) -> bool {
        let k = &self.k;
        k.keep.first().is_some_and(|init| {
            pid_ns_of(*init).as_deref() == Some(k.pid_ns.as_str()) && !is_zombie(*init)
        })
    }

    async fn stop(&self) {
        self.engine.force_remove(&self.k.name).await;
    }
}

/// The engine's client calls of a session.
struct Ops<'a> {
    engine: &'a EngineBackend,
}

impl Ops<'_> {
    fn cmd(&self) -> Command {
        self.engine.command()
    }

    async fn start_container(&self, spec: &SandboxSpec) -> Result<KeepAlive, BackendError> {
        let engine = self.engine;
        let mut keepalive = spec.clone();
        let keep_for = spec.timeout + KEEPALIVE_MARGIN;
        keepalive.command = vec!["sleep".into(), keep_for.as_secs().to_string()];
        keepalive.override_entrypoint = true;
        engine.ensure_profile()?;
        if engine.runtime() == OciRuntime::Runsc {
            // Its commands run under the node's filter ([`super::exec_filter`]).
            keepalive.mounts.push(engine.exec_filter_mount()?);
        }
        let mut args = engine.run_args(&keepalive);
        // `run --rm …` becomes `run --detach --init [--init-path=…] --rm …`.
        let mut extra = vec!["--detach".to_string(), "--init".to_string()];
        if let (BackendKind::Podman, Some(p)) = (engine.kind, engine.init_path()) {
            extra.push(format!("--init-path={}", p.display()));
        }
        args.splice(1..1, extra);
        let out = self.output(self.cmd().args(&args)).await?;
        if !out.status.success() {
            return Err(BackendError::Refused(format!(
                "{} could not start the session container: {}",
                self.engine.binary(),
                last_line(&out.stderr)
            )));
        }
        let out = self
            .output(
                self.cmd()
                    .args(["inspect", "--format", "{{.State.Pid}}"])
                    .arg(&spec.name),
            )
            .await?;
        let init: i32 = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| {
                BackendError::Refused(format!(
                    "the session container is not running: {}",
                    last_line(&out.stderr)
                ))
            })?;
        let pid_ns = pid_ns_of(init).ok_or_else(|| {
            BackendError::Unavailable(format!("cannot read the PID namespace of pid {init}"))
        })?;
        if pid_ns_of(std::process::id() as i32).as_deref() == Some(pid_ns.as_str()) {
            // Not a namespace of the container's own (gVisor's sandbox process runs in the
            // host's): "every process in it" would be every process of the host.
            let gvisor = self.gvisor_of(init, &spec.name).await?;
            return Ok(KeepAlive {
                name: spec.name.clone(),
                pid_ns,
                keep: vec![init],
                gvisor: Some(gvisor),
            });
        }
        // The init forks the keep-alive `sleep` right away; wait for it (bounded).
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let children: Vec<i32> = processes_in(&pid_ns)
                .into_iter()
                .filter(|p| ppid_of(*p) == Some(init))
                .collect();
            if !children.is_empty() {
                let mut keep = vec![init];
                keep.extend(children);
                return Ok(KeepAlive {
                    name: spec.name.clone(),
                    pid_ns,
                    keep,
                    gvisor: None,
                });
            }
            if Instant::now() > until {
                return Err(BackendError::Refused(
                    "the session container's keep-alive process did not start".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// gVisor's handle on the session container whose sandbox process is host pid
    /// `sandbox`, once its init and `sleep` run (bounded). Refused for any other runtime:
    /// a container in the host's own PID namespace cannot be confined by host pids.
    async fn gvisor_of(&self, sandbox: i32, name: &str) -> Result<Gvisor, BackendError> {
        if self.engine.runtime() != crate::config::OciRuntime::Runsc {
            return Err(BackendError::Unavailable(format!(
                "the session container {name} shares the node's PID namespace; refusing it"
            )));
        }
        let proc = Path::new("/proc").join(sandbox.to_string());
        let runsc = std::fs::read_link(proc.join("exe")).map_err(|e| {
            BackendError::Unavailable(format!("cannot read gVisor's sandbox executable: {e}"))
        })?;
        let cmdline = std::fs::read(proc.join("cmdline")).unwrap_or_default();
        let root = cmdline
            .split(|b| *b == 0)
            .filter_map(|a| std::str::from_utf8(a).ok())
            .find_map(|a| a.strip_prefix("--root="))
            .map(str::to_string)
            .ok_or_else(|| {
                BackendError::Unavailable("gVisor's sandbox process names no --root".into())
            })?;
        let out = self
            .output(
                self.cmd()
                    .args(["inspect", "--format", "{{.Id}}"])
                    .arg(name),
            )
            .await?;
        let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(BackendError::Refused(format!(
                "the session container has no id: {}",
                last_line(&out.stderr)
            )));
        }
        let mut g = Gvisor {
            runsc,
            root,
            id,
            keep: Vec::new(),
        };
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let procs = g.processes().await;
            let children: Vec<u32> = procs
                .iter()
                .filter(|(_, ppid)| *ppid == 1)
                .map(|(p, _)| *p)
                .collect();
            if procs.iter().any(|(p, _)| *p == 1) && !children.is_empty() {
                g.keep = std::iter::once(1).chain(children).collect();
                return Ok(g);
            }
            if Instant::now() > until {
                return Err(BackendError::Refused(
                    "the session container's keep-alive process did not start".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn output(&self, cmd: &mut Command) -> Result<std::process::Output, BackendError> {
        match tokio::time::timeout(CLI_BOUND, cmd.output()).await {
            Ok(Ok(o)) => Ok(o),
            Ok(Err(e)) => Err(BackendError::Client(format!(
                "cannot run {}: {e}",
                self.engine.binary()
            ))),
            Err(_) => Err(BackendError::Client(format!(
                "{} did not answer within {}s",
                self.engine.binary(),
                CLI_BOUND.as_secs()
            ))),
        }
    }

    async fn exec_in(
        &self,
        k: &KeepAlive,
        spec: &SandboxSpec,
        cancel: &CancellationToken,
    ) -> SandboxOutcome {
        let started = Instant::now();
        let mut cmd = self.cmd();
        let mut run = spec.clone();
        // A streamed command records its pid for signals ([`super::exec_signal`]).
        let streamed = exec_io::in_scope();
        let record = super::exec_signal::record_path(&spec.name);
        if streamed {
            run.command = super::exec_signal::recorded(&record, &run.command);
        }
        if k.gvisor.is_some() {
            run.command = super::exec_filter::wrap(&run.command);
        }
        let mut args = exec_args(&k.name, &run);
        // A streamed exec with a stdin: `exec --interactive`, fed by [`exec_io::feed`].
        if exec_io::wants_stdin() {
            args.insert(1, "--interactive".into());
            cmd.stdin(Stdio::piped());
        }
        cmd.args(args);
        let (mut child, out, err) =
            match super::spawn_client(cmd, self.engine.binary(), spec.output_cap) {
                Ok(spawned) => spawned,
                Err(e) => return SandboxOutcome::start_failed(e, started),
            };
        exec_io::feed(child.stdin.take());
        if streamed {
            exec_io::attach(std::sync::Arc::new(super::exec_signal::EngineSignaller {
                engine: self.engine.clone(),
                container: k.name.clone(),
                user: engine_user(spec.host_uid),
                record,
                gvisor: k.gvisor.is_some(),
            }))
            .await;
        }
        let (status, end) = crate::backend::wait_or_stop(&mut child, spec.timeout, cancel).await;
        let status = match status {
            Some(s) => Some(s),
            None => {
                // Canceled: the session is ending and its container is being removed,
                // which ends the command. Timed out: kill it from the host.
                if end == EndReason::TimedOut {
                    kill_commands(k).await;
                }
                let waited = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
                if waited.is_err() {
                    let _ = child.start_kill();
                }
                waited.ok().and_then(Result::ok)
            }
        };
        let exit_code = status.and_then(|s| s.code());
        let outcome = SandboxOutcome::collected(exit_code, out, err, end, started).await;
        // e.g. the container is gone
        super::engine_refused(
            outcome,
            self.engine.binary(),
            "run the command in the session container",
        )
    }
}

/// The `exec` argv (without the binary) for `spec` in container `name`.
pub fn exec_args(name: &str, spec: &SandboxSpec) -> Vec<String> {
    let mut a: Vec<String> = vec![
        "exec".into(),
        format!("--user={}", engine_user(spec.host_uid)),
        format!("--workdir={}", spec.workdir),
    ];
    for (k, v) in &spec.env {
        a.push(format!("--env={k}={v}"));
    }
    a.push(name.to_string());
    a.extend(spec.command.iter().cloned());
    a
}

/// SIGKILLs every process of the container except the keep-alive pair, until none is left
/// (bounded: the pids limit bounds how many can appear).
async fn kill_commands(k: &KeepAlive) {
    if let Some(g) = &k.gvisor {
        return g.kill_commands().await;
    }
    kill_in_namespace(&k.pid_ns, &k.keep, &k.name).await;
}

/// SIGKILLs every process of PID namespace `pid_ns` (a session container's, whose name is
/// `container`) but the host pids `keep`, until none is left (bounded: the pids limit
/// bounds how many can appear).
pub(crate) async fn kill_in_namespace(pid_ns: &str, keep: &[i32], container: &str) {
    for _ in 0..100 {
        let victims: Vec<i32> = processes_in(pid_ns)
            .into_iter()
            .filter(|p| !keep.contains(p))
            .collect();
        if victims.is_empty() {
            return;
        }
        for pid in victims {
            // SAFETY: signalling a process inside this session's own PID namespace.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tracing::warn!(container, "processes of a timed-out command kept appearing");
}

impl Gvisor {
    fn runsc(&self) -> Command {
        let mut c = Command::new(&self.runsc);
        crate::backend::client_env(&mut c)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .arg(format!("--root={}", self.root));
        c
    }

    /// (pid, parent pid) of every process in the container, as gVisor numbers them
    /// (`runsc ps`: UID PID PPID …); empty when runsc does not answer within 10 s.
    async fn processes(&self) -> Vec<(u32, u32)> {
        let mut c = self.runsc();
        c.arg("ps").arg(&self.id);
        let Ok(Ok(out)) = tokio::time::timeout(Duration::from_secs(10), c.output()).await else {
            return Vec::new();
        };
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .skip(1)
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                Some((f.get(1)?.parse().ok()?, f.get(2)?.parse().ok()?))
            })
            .collect()
    }

    /// SIGKILLs every process of the container but the init and its `sleep`, until none
    /// is left (bounded).
    async fn kill_commands(&self) {
        for _ in 0..100 {
            let victims: Vec<u32> = self
                .processes()
                .await
                .into_iter()
                .map(|(p, _)| p)
                .filter(|p| !self.keep.contains(p))
                .collect();
            if victims.is_empty() {
                return;
            }
            for pid in victims {
                let mut c = self.runsc();
                c.args(["kill", &format!("--pid={pid}"), &self.id, "KILL"])
                    .stdout(Stdio::null());
                let _ = tokio::time::timeout(Duration::from_secs(10), c.status()).await;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tracing::warn!(container = %self.id, "processes of a timed-out command kept appearing");
    }
}

/// `pid:[inode]` of `pid`'s PID namespace.
pub(crate) fn pid_ns_of(pid: i32) -> Option<String> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid"))
        .ok()
        .map(|p| p.display().to_string())
}

/// Host pids of the live processes whose PID namespace is `ns`.
fn processes_in(ns: &str) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| pid_ns_of(*pid).as_deref() == Some(ns))
        .filter(|pid| !is_zombie(*pid))
        .collect()
}

fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let text =
        std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("stat")).ok()?;
    // The command name may contain spaces and parentheses: fields follow the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_string).collect())
}

fn ppid_of(pid: i32) -> Option<i32> {
    stat_fields(pid)?.get(1)?.parse().ok()
}

fn is_zombie(pid: i32) -> bool {
    stat_fields(pid)
        .and_then(|f| f.first().cloned())
        .is_some_and(|s| s == "Z" || s == "X")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_args_carry_user_workdir_and_env() {
        let mut spec = crate::sandbox::example_spec("img", &["sh", "-c", "echo hi"]);
        spec.env = vec![("A".into(), "b c".into())];
        assert_eq!(
            exec_args("cynode-session-s", &spec),
            [
                "exec",
                "--user=4000000:4000000",
                "--workdir=/workspace",
                "--env=A=b c",
                "cynode-session-s",
                "sh",
                "-c",
                "echo hi"
            ]
        );
    }

    #[test]
    fn own_process_is_found_in_its_pid_namespace() {
        let me = std::process::id() as i32;
        let ns = pid_ns_of(me).unwrap();
        assert!(processes_in(&ns).contains(&me));
        assert_eq!(
            ppid_of(me),
            Some(std::os::unix::process::parent_id() as i32)
        );
    }
}
