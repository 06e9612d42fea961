//! Changesets computed by git inside a bubblewrap sandbox, never by git as root on the host.
//!
//! A workspace is sandbox-written content: its `.git` (config, hooks, index, attributes,
//! info/) is the attacker's. So git runs as the workspace's own host uid (dropped to before
//! bwrap starts when the node is root; uid 1000 inside) in new user, pid, network, ipc,
//! uts and cgroup namespaces, with a cleared environment, every capability dropped, only
//! the host's `/usr` (with the `/bin`, `/lib`, `/lib64`, `/sbin` links or read-only binds)
//! plus the workspace and
//! baseline read-only, a small tmpfs `/tmp`, a read-only `/dev` with a 1 MiB `/dev/shm`,
//! and bounds on time, output and address space. It is confined exactly as a job's bwrap
//! sandbox is ([`crate::backend::bwrap::Confinement`]): the node's seccomp filter (no new
//! namespaces, no keyring, io_uring, userfaultfd, perf, ptrace, vsock…), `--disable-userns`,
//! and a cgroup of its own with the node's memory, pids and CPU limits. The invocation
//! is hardened as well: no system or global config, command-line overrides of every
//! config key known to run a program, `--no-ext-diff --no-textconv`, no protocols.
//! Whatever a repository still makes git run (a clean filter, say) runs inside that
//! sandbox, sees nothing of the host, can write nothing and is held to a job's limits.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::process::Command;

use crate::backend::bwrap::{has_disable_userns, Confinement};
use crate::config::Config;
use crate::sandbox::{ResourceLimits, WORKSPACE_MOUNT};

/// Where and how a changeset's sandbox runs: the bwrap binary, the node (whose cgroup
/// tree holds the sandbox's cgroup) and the limits of that cgroup.
#[derive(Debug, Clone)]
pub struct ChangesetSandbox {
    pub bwrap: String,
    pub node: String,
    pub limits: ResourceLimits,
    /// This bwrap knows `--disable-userns`.
    pub disable_userns: bool,
    /// The workspace's host uid ([`crate::uid_pool`]): git runs as it.
    pub host_uid: u32,
}

impl ChangesetSandbox {
    /// The node's bwrap, id and job limits, for the workspace of `host_uid`.
    pub fn for_node(cfg: &Config, host_uid: u32) -> Self {
        let bwrap = cfg.bwrap.binary.clone().unwrap_or_else(|| "bwrap".into());
        ChangesetSandbox {
            disable_userns: has_disable_userns(&bwrap),
            bwrap,
            node: crate::backend::node_id(cfg),
            limits: ResourceLimits::from_limits(&cfg.limits),
            host_uid,
        }
    }
}

/// Bounds on one changeset.
#[derive(Debug, Clone, Copy)]
pub struct ChangesetLimits {
    pub max_time: Duration,
    pub max_output: u64,
}

impl Default for ChangesetLimits {
    fn default() -> Self {
        Self {
            max_time: Duration::from_secs(120),
            max_output: 256 << 20,
        }
    }
}

/// Why a changeset could not be computed.
#[derive(Debug, thiserror::Error)]
pub enum ChangesetError {
    #[error("bubblewrap is unusable, so no changeset can be computed safely: {0}")]
    Sandbox(String),
    #[error("git failed: {0}")]
    Git(String),
    #[error("changeset over {0} bytes")]
    TooLarge(u64),
    #[error("changeset took longer than {0}s")]
    Timeout(u64),
}

/// Config overrides (command-line precedence) for every key that makes git run a program
/// or reach out, plus output settings a repository must not change.
const GIT_CONFIG: [(&str, &str); 18] = [
    ("core.fsmonitor", "false"),
    ("core.hooksPath", "/dev/null"),
    ("core.pager", "cat"),
    ("core.attributesFile", "/dev/null"),
    ("core.sshCommand", "false"),
    ("core.untrackedCache", "false"),
    ("diff.external", ""),
    ("diff.noprefix", "false"),
    ("diff.mnemonicPrefix", "false"),
    ("diff.relative", "false"),
    ("diff.submodule", "short"),
    ("color.ui", "false"),
    ("protocol.allow", "never"),
    ("safe.directory", "*"),
    ("submodule.recurse", "false"),
    ("core.quotePath", "true"),
    // Pack windows that fit the address-space bound below.
    ("core.packedGitLimit", "1g"),
    ("core.packedGitWindowSize", "256m"),
];

/// Address space of git (and of anything a repository makes it run), inherited through bwrap.
const MAX_ADDRESS_SPACE: u64 = 4 << 30;

const DIFF_FLAGS: &str = "--no-ext-diff --no-textconv --no-color --binary";

/// Tracked changes against HEAD, then every untracked, not ignored file as an addition.
/// Fixed text: no request value is interpolated.
const GIT_SCRIPT: &str = r#"set -e
git diff --no-ext-diff --no-textconv --no-color --binary --ignore-submodules=dirty HEAD --
git ls-files --others --exclude-standard -z > /tmp/untracked
xargs -0 -r -n 1 sh -c 'git diff --no-index --no-ext-diff --no-textconv --no-color --binary -- /dev/null "$1"; test $? -le 1' sh < /tmp/untracked
"#;

/// The changeset of `workspace`: a git diff against HEAD when it has `.git`, else against
/// `baseline` (`git diff --no-index`), paths as `a/…` and `b/…`.
pub async fn changeset(
    sandbox: &ChangesetSandbox,
    workspace: &Path,
    baseline: &Path,
    has_git: bool,
    limits: ChangesetLimits,
) -> Result<String, ChangesetError> {
    let confinement = Confinement::new(
        &sandbox.node,
        &cgroup_name(),
        &sandbox.limits,
        sandbox.disable_userns,
        sandbox.host_uid,
    )
    .map_err(|e| ChangesetError::Sandbox(e.to_string()))?;
    let mut args = sandbox_args(&confinement);
    if has_git {
        args.extend(ro_bind(workspace, WORKSPACE_MOUNT));
        args.extend(["--chdir".into(), WORKSPACE_MOUNT.into()]);
        args.extend(env_args());
        args.extend([
            "--".into(),
            "/bin/sh".into(),
            "-c".into(),
            GIT_SCRIPT.into(),
        ]);
    } else {
        args.extend(ro_bind(baseline, "/a"));
        args.extend(ro_bind(workspace, "/b"));
        args.extend(["--chdir".into(), "/".into()]);
        args.extend(env_args());
        args.push("--".into());
        args.extend(["git", "diff", "--no-index", "--no-prefix"].map(String::from));
        args.extend(DIFF_FLAGS.split(' ').map(String::from));
        args.extend(["--", "a", "b"].map(String::from));
    }
    let (code, out, err) = run(&sandbox.bwrap, &args, confinement, limits).await?;
    // git diff --no-index exits 1 when there are differences.
    let ok = code == 0 || (code == 1 && !has_git);
    if !ok {
        return Err(ChangesetError::Git(format!("exit {code}: {}", err.trim())));
    }
    if has_git {
        Ok(out)
    } else {
        Ok(fix_no_index_headers(&out))
    }
}

/// A cgroup name no other changeset of this node uses.
fn cgroup_name() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "changeset-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn sandbox_args(confinement: &Confinement) -> Vec<String> {
    let mut a = crate::backend::bwrap::isolation_args("changeset");
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

fn env_args() -> Vec<String> {
    let mut env: Vec<(String, String)> = [
        ("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ("HOME", "/nonexistent"),
        ("XDG_CONFIG_HOME", "/nonexistent"),
        ("LC_ALL", "C"),
        ("GIT_CONFIG_NOSYSTEM", "1"),
        ("GIT_CONFIG_SYSTEM", "/dev/null"),
        ("GIT_CONFIG_GLOBAL", "/dev/null"),
        ("GIT_ATTR_NOSYSTEM", "1"),
        ("GIT_TERMINAL_PROMPT", "0"),
        ("GIT_OPTIONAL_LOCKS", "0"),
        ("GIT_NO_REPLACE_OBJECTS", "1"),
        ("GIT_PROTOCOL_FROM_USER", "0"),
        ("GIT_ALLOW_PROTOCOL", ""),
        ("GIT_PAGER", "cat"),
        ("PAGER", "cat"),
        ("GIT_EXTERNAL_DIFF", ""),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .to_vec();
    env.push(("GIT_CONFIG_COUNT".into(), GIT_CONFIG.len().to_string()));
    for (i, (k, v)) in GIT_CONFIG.iter().enumerate() {
        env.push((format!("GIT_CONFIG_KEY_{i}"), (*k).into()));
        env.push((format!("GIT_CONFIG_VALUE_{i}"), (*v).into()));
    }
    let mut a = vec!["--clearenv".to_string()];
    for (k, v) in env {
        a.extend(["--setenv".into(), k, v]);
    }
    a
}

/// `--no-index` names an added file `b/x b/x` and a removed one `a/x a/x`; make both
/// `a/x b/x` as in every other git diff. Only `diff --git` header lines are touched.
fn fix_no_index_headers(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        let Some(rest) = line.strip_prefix("diff --git ") else {
            out.push_str(line);
            continue;
        };
        let body = rest.trim_end_matches('\n');
        let half = body.len() / 2;
        let same = body.len() % 2 == 1
            && body.is_char_boundary(half)
            && body.as_bytes().get(half) == Some(&b' ')
            && body[..half] == body[half + 1..];
        if !same {
            out.push_str(line);
            continue;
        }
        let side = &body[..half];
        let (quote, name) = match side.strip_prefix('"') {
            Some(s) => ("\"", s),
            None => ("", side),
        };
        let name = name
            .strip_prefix("a/")
            .or_else(|| name.strip_prefix("b/"))
            .unwrap_or(name);
        out.push_str(&format!(
            "diff --git {quote}a/{name} {quote}b/{name}{}",
            &line[11 + body.len()..]
        ));
    }
    out
}

/// Runs bwrap with `args` as the sandbox user under `confinement`, bounded in time and
/// output; whatever is left of it is killed when this returns.
async fn run(
    bwrap: &str,
    args: &[String],
    mut confinement: Confinement,
    limits: ChangesetLimits,
) -> Result<(i32, String, String), ChangesetError> {
    let mut cmd = Command::new(bwrap);
    cmd.args(args)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    confinement.apply(&mut cmd);
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
                rlim_cur: MAX_ADDRESS_SPACE,
                rlim_max: MAX_ADDRESS_SPACE,
            };
            libc::setrlimit(libc::RLIMIT_AS, &space);
            Ok(())
        });
    }
    let spawned = cmd.spawn();
    confinement.started();
    let mut child =
        spawned.map_err(|e| ChangesetError::Sandbox(format!("cannot start {bwrap}: {e}")))?;
    let pgid = child.id();
    let mut stdout = child.stdout.take();
    let mut stderr = child.stderr.take();
    let cap = limits.max_output;
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
            return Err(ChangesetError::TooLarge(cap));
        }
        let status = child
            .wait()
            .await
            .map_err(|e| ChangesetError::Sandbox(e.to_string()))?;
        Ok((status, out, err))
    };
    let res = tokio::time::timeout(limits.max_time, work).await;
    let (status, out, err) = match res {
        Err(_) => {
            kill();
            return Err(ChangesetError::Timeout(limits.max_time.as_secs()));
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
    // `bwrap: …` lines; a changeset computed without the sandbox is never returned.
    if code != 0 && err.lines().any(|l| l.starts_with("bwrap: ")) {
        return Err(ChangesetError::Sandbox(err.trim().to_string()));
    }
    Ok((code, String::from_utf8_lossy(&out).into_owned(), err))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(bwrap: &str) -> ChangesetSandbox {
        ChangesetSandbox {
            bwrap: bwrap.into(),
            node: "changeset-unit-test".into(),
            limits: ResourceLimits::from_limits(&crate::config::Limits::default()),
            disable_userns: false,
            host_uid: 4_000_000,
        }
    }

    #[tokio::test]
    async fn unusable_bwrap_is_a_clear_error_never_an_empty_diff() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let lim = ChangesetLimits::default();
        let e = changeset(
            &sandbox("/nonexistent/bwrap"),
            t.path(),
            t.path(),
            false,
            lim,
        )
        .await
        .unwrap_err();
        assert!(e.to_string().starts_with("bubblewrap is unusable"), "{e}");
        // bwrap fails with exit 1, which a no-index diff also uses for "differences".
        let fake = t.path().join("bwrap");
        std::fs::write(
            &fake,
            "#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n",
        )
        .unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = changeset(
            &sandbox(fake.to_str().unwrap()),
            t.path(),
            t.path(),
            false,
            lim,
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("bwrap: setting up uid map"), "{e}");
    }

    #[tokio::test]
    async fn time_and_output_are_bounded() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let script = |name: &str, body: &str| {
            let p = t.path().join(name);
            std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
            p.display().to_string()
        };
        let slow = script("slow", "exec sleep 60");
        let lim = ChangesetLimits {
            max_time: Duration::from_secs(1),
            max_output: 1 << 20,
        };
        let started = std::time::Instant::now();
        let e = changeset(&sandbox(&slow), t.path(), t.path(), true, lim)
            .await
            .unwrap_err();
        assert!(matches!(e, ChangesetError::Timeout(1)), "{e}");
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{:?}",
            started.elapsed()
        );
        let loud = script("loud", "exec yes");
        let e = changeset(&sandbox(&loud), t.path(), t.path(), true, lim)
            .await
            .unwrap_err();
        assert!(matches!(e, ChangesetError::TooLarge(_)), "{e}");
    }

    #[test]
    fn no_index_headers_name_both_sides() {
        let t = "diff --git b/new b/new\nnew file mode 100644\n--- /dev/null\n+++ b/new\n+diff --git b/x b/x\ndiff --git a/f b/f\ndiff --git a/old a/old\n";
        assert_eq!(
            fix_no_index_headers(t),
            "diff --git a/new b/new\nnew file mode 100644\n--- /dev/null\n+++ b/new\n+diff --git b/x b/x\ndiff --git a/f b/f\ndiff --git a/old b/old\n"
        );
    }
}
