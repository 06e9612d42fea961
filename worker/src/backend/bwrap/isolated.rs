//! [`IsolatedRun`]s in bubblewrap, for every backend: new user, pid, network, ipc, uts and
//! cgroup namespaces, uid 1000 inside (the run's host uid outside), a cleared environment,
//! every capability dropped, only the host's `/usr` (with the `/bin`, `/lib`, `/lib64`,
//! `/sbin` links or read-only binds) plus the run's directories read-only, a small tmpfs
//! `/tmp`, a read-only `/dev` with a 1 MiB `/dev/shm`, and bounds on time, output and
//! address space. It is confined exactly as a job's bwrap sandbox is ([`Confinement`]): the
//! node's seccomp filter, `--disable-userns`, and a cgroup of its own with the run's
//! memory, pids and CPU limits. Whatever is left of it is killed when the run returns.

use std::path::Path;

use tokio::io::AsyncReadExt;

use super::{client_command, has_disable_userns, isolation_args, Confinement, Invocation};
use crate::backend::{IsolatedError, IsolatedOutput, IsolatedRun};
use crate::config::Config;

/// The node's bubblewrap for isolated runs.
#[derive(Debug, Clone)]
pub struct IsolatedBwrap {
    binary: String,
    /// The node, whose cgroup tree holds each run's cgroup.
    node: String,
    /// Whether this bwrap knows `--disable-userns`; `None`: asked at the first run.
    disable_userns: Option<bool>,
}

impl IsolatedBwrap {
    /// The bwrap of `cfg` (`bwrap.binary`, else `bwrap` on PATH), for the node of `cfg`.
    pub fn for_config(cfg: &Config) -> Self {
        Self::new(
            cfg.bwrap.binary.clone().unwrap_or_else(|| "bwrap".into()),
            crate::backend::node_id(cfg),
            None,
        )
    }

    /// `binary` for `node`; `disable_userns` when already known.
    pub fn new(binary: String, node: String, disable_userns: Option<bool>) -> Self {
        Self {
            binary,
            node,
            disable_userns,
        }
    }

    /// Runs `run` to its end within its bounds.
    pub async fn run(&self, run: IsolatedRun) -> Result<IsolatedOutput, IsolatedError> {
        let disable_userns = self
            .disable_userns
            .unwrap_or_else(|| has_disable_userns(&self.binary));
        let confinement = Confinement::new(
            &self.node,
            &cgroup_name(run.purpose),
            &run.limits,
            disable_userns,
            run.host_uid,
        )
        .map_err(|e| IsolatedError::Sandbox(e.to_string()))?;
        let mut args = base_args(run.purpose, &confinement);
        for (host, target) in &run.ro_binds {
            args.extend(ro_bind(host, target));
        }
        args.extend(["--chdir".into(), run.workdir.clone(), "--clearenv".into()]);
        for (k, v) in &run.env {
            args.extend(["--setenv".into(), k.clone(), v.clone()]);
        }
        let inv = Invocation {
            options: args,
            command: run.argv.clone(),
        };
        let (code, stdout, stderr) = spawn(&self.binary, &inv, confinement, &run).await?;
        Ok(IsolatedOutput {
            exit_code: code,
            stdout,
            stderr,
        })
    }
}

/// A cgroup name no other isolated run of this node uses: `<purpose>-<pid>-<n>`.
fn cgroup_name(purpose: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{purpose}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn base_args(hostname: &str, confinement: &Confinement) -> Vec<String> {
    let mut a = isolation_args(hostname);
    a.extend(confinement.args());
    a.extend(
        [
            "--ro-bind",
            "/usr",
            "/usr",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            "1048576",
            "--tmpfs",
            "/dev/shm",
            "--remount-ro",
            "/dev",
            "--size",
            "67108864",
            "--tmpfs",
            "/tmp",
        ]
        .map(String::from),
    );
    for top in ["bin", "lib", "lib64", "lib32", "sbin"] {
        let host = Path::new("/").join(top);
        match std::fs::symlink_metadata(&host) {
            Ok(m) if m.file_type().is_symlink() => {
                if let Ok(t) = std::fs::read_link(&host) {
                    a.extend([
                        "--symlink".into(),
                        t.display().to_string(),
                        host.display().to_string(),
                    ]);
                }
            }
            Ok(m) if m.is_dir() => a.extend(ro_bind(&host, &host.display().to_string())),
            _ => {}
        }
    }
    a
}

fn ro_bind(host: &Path, target: &str) -> [String; 3] {
    [
        "--ro-bind".into(),
        host.display().to_string(),
        target.into(),
    ]
}

/// Runs bwrap as `inv` says, as the sandbox user under `confinement`, bounded in time and
/// output; whatever is left of it is killed when this returns.
async fn spawn(
    bwrap: &str,
    inv: &Invocation,
    mut confinement: Confinement,
    run: &IsolatedRun,
) -> Result<(i32, String, String), IsolatedError> {
    let (mut cmd, options) = client_command(bwrap, inv)
        .map_err(|e| IsolatedError::Sandbox(format!("cannot pass {bwrap} its arguments: {e}")))?;
    confinement.apply(&mut cmd);
    let space = run.max_address_space;
    // SAFETY: between fork and exec this only makes the async-signal-safe setrlimit on
    // stack values (after the confinement's own steps, so as the sandbox user).
    unsafe {
        cmd.pre_exec(move || {
            let core = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::setrlimit(libc::RLIMIT_CORE, &core);
            let space = libc::rlimit {
                rlim_cur: space,
                rlim_max: space,
            };
            libc::setrlimit(libc::RLIMIT_AS, &space);
            Ok(())
        });
    }
    let spawned = cmd.spawn();
    drop(options);
    confinement.started();
    let mut child =
        spawned.map_err(|e| IsolatedError::Sandbox(format!("cannot start {bwrap}: {e}")))?;
    let pgid = child.id();
    let mut stdout = child.stdout.take();
    let mut stderr = child.stderr.take();
    let cap = run.max_output;
    let kill = move || {
        if let Some(pg) = pgid {
            // SAFETY: signalling the process group this function created.
            unsafe {
                libc::kill(-(pg as i32), libc::SIGKILL);
            }
        }
    };
    let work = async {
        let read_out = async {
            let mut buf = Vec::new();
            if let Some(s) = stdout.as_mut() {
                s.take(cap + 1).read_to_end(&mut buf).await.ok();
            }
            if buf.len() as u64 > cap {
                kill(); // so stderr ends too
            }
            buf
        };
        let read_err = async {
            let mut buf = Vec::new();
            if let Some(s) = stderr.as_mut() {
                s.take(64 * 1024).read_to_end(&mut buf).await.ok();
            }
            buf
        };
        let (out, err) = tokio::join!(read_out, read_err);
        if out.len() as u64 > cap {
            return Err(IsolatedError::TooLarge(cap));
        }
        let status = child
            .wait()
            .await
            .map_err(|e| IsolatedError::Sandbox(e.to_string()))?;
        Ok((status, out, err))
    };
    let res = tokio::time::timeout(run.max_time, work).await;
    let (status, out, err) = match res {
        Err(_) => {
            kill();
            return Err(IsolatedError::Timeout(run.max_time.as_secs()));
        }
        Ok(Err(e)) => {
            kill();
            return Err(e);
        }
        Ok(Ok(v)) => v,
    };
    let err = String::from_utf8_lossy(&err).into_owned();
    let code = status.code().unwrap_or(-1);
    // bwrap reports its own failures (exit 1, like a no-index diff with changes) as
    // `bwrap: …` lines; an output produced without the sandbox is never returned.
    if code != 0 && err.lines().any(|l| l.starts_with("bwrap: ")) {
        return Err(IsolatedError::Sandbox(err.trim().to_string()));
    }
    Ok((code, String::from_utf8_lossy(&out).into_owned(), err))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn run_of(max_time: Duration, max_output: u64) -> IsolatedRun {
        IsolatedRun {
            purpose: "isolated-unit-test",
            host_uid: 4_000_000,
            limits: crate::sandbox::ResourceLimits::from_limits(&crate::config::Limits::default()),
            ro_binds: Vec::new(),
            workdir: "/".into(),
            env: Vec::new(),
            argv: vec!["true".into()],
            max_time,
            max_output,
            max_address_space: 4 << 30,
        }
    }

    #[tokio::test]
    async fn time_and_output_are_bounded() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        // The script runs as the run's host uid when the tests run as root.
        std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let script = |name: &str, body: &str| {
            let p = t.path().join(name);
            std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
            p.display().to_string()
        };
        let tool =
            |binary: String| IsolatedBwrap::new(binary, "isolated-unit-test".into(), Some(false));
        let slow = script("slow", "exec sleep 60");
        let started = std::time::Instant::now();
        let e = tool(slow)
            .run(run_of(Duration::from_secs(1), 1 << 20))
            .await
            .unwrap_err();
        assert_eq!(e, IsolatedError::Timeout(1));
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{:?}",
            started.elapsed()
        );
        let loud = script("loud", "exec yes");
        let e = tool(loud)
            .run(run_of(Duration::from_secs(1), 1 << 20))
            .await
            .unwrap_err();
        assert_eq!(e, IsolatedError::TooLarge(1 << 20));
    }
}
