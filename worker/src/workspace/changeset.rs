//! Changesets computed by git in a sandbox, never by git as root on the host.
//!
//! A workspace is sandbox-written content: its `.git` (config, hooks, index, attributes,
//! info/) is the attacker's. So git runs as an isolated run of the node's backend
//! ([`crate::backend::SandboxBackend::run_isolated`], [`crate::backend::isolated`]): as
//! the workspace's own host uid, in new namespaces, with only the host's `/usr` plus the
//! workspace and baseline read-only, the node's job limits, the seccomp filter and bounds
//! on time, output and address space. The invocation is hardened as well: no system or
//! global config, command-line overrides of every config key known to run a program,
//! `--no-ext-diff --no-textconv`, no protocols. Whatever a repository still makes git run
//! (a clean filter, say) runs inside that sandbox, sees nothing of the host, can write
//! nothing and is held to a job's limits.

use std::path::Path;
use std::time::Duration;

use crate::backend::{IsolatedError, IsolatedRun, SandboxBackend};
use crate::config::Config;
use crate::sandbox::{ResourceLimits, WORKSPACE_MOUNT};

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
/// `baseline` (`git diff --no-index`), paths as `a/…` and `b/…`. Git runs as `host_uid`
/// (the workspace's) under `cfg`'s job limits, isolated by `backend`.
pub async fn changeset(
    backend: &dyn SandboxBackend,
    cfg: &Config,
    host_uid: u32,
    workspace: &Path,
    baseline: &Path,
    has_git: bool,
    limits: ChangesetLimits,
) -> Result<String, ChangesetError> {
    let run = isolated_run(cfg, host_uid, workspace, baseline, has_git, limits);
    let out = backend.run_isolated(run).await.map_err(|e| match e {
        IsolatedError::Sandbox(why) => ChangesetError::Sandbox(why),
        IsolatedError::TooLarge(n) => ChangesetError::TooLarge(n),
        IsolatedError::Timeout(s) => ChangesetError::Timeout(s),
    })?;
    let code = out.exit_code;
    // git diff --no-index exits 1 when there are differences.
    let ok = code == 0 || (code == 1 && !has_git);
    if !ok {
        return Err(ChangesetError::Git(format!(
            "exit {code}: {}",
            out.stderr.trim()
        )));
    }
    if has_git {
        Ok(out.stdout)
    } else {
        Ok(fix_no_index_headers(&out.stdout))
    }
}

/// The isolated run of git for a changeset. Fixed argv and environment: no request value
/// is interpolated.
fn isolated_run(
    cfg: &Config,
    host_uid: u32,
    workspace: &Path,
    baseline: &Path,
    has_git: bool,
    limits: ChangesetLimits,
) -> IsolatedRun {
    let (ro_binds, workdir, argv) = if has_git {
        (
            vec![(workspace.to_path_buf(), WORKSPACE_MOUNT.to_string())],
            WORKSPACE_MOUNT.to_string(),
            ["/bin/sh", "-c", GIT_SCRIPT].map(String::from).to_vec(),
        )
    } else {
        let mut argv: Vec<String> = ["git", "diff", "--no-index", "--no-prefix"]
            .map(String::from)
            .to_vec();
        argv.extend(DIFF_FLAGS.split(' ').map(String::from));
        argv.extend(["--", "a", "b"].map(String::from));
        (
            vec![
                (baseline.to_path_buf(), "/a".to_string()),
                (workspace.to_path_buf(), "/b".to_string()),
            ],
            "/".to_string(),
            argv,
        )
    };
    IsolatedRun {
        purpose: "changeset",
        host_uid,
        limits: ResourceLimits::from_limits(&cfg.limits),
        ro_binds,
        workdir,
        env: git_env(),
        argv,
        max_time: limits.max_time,
        max_output: limits.max_output,
        max_address_space: MAX_ADDRESS_SPACE,
    }
}

/// Git's whole environment: no system or global config, no prompts, pagers or external
/// diffs, and [`GIT_CONFIG`] as command-line-precedence config.
fn git_env() -> Vec<(String, String)> {
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
    env
}

/// `--no-index` names an added file/// `--no-index` names an added file `b/x b/x` and a removed one `a/x a/x`; make both
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn unusable_bwrap_is_a_clear_error_never_an_empty_diff() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let cfg = Config::default();
        let lim = ChangesetLimits::default();
        let backend = |binary: &str| {
            let bwrap = crate::config::BwrapConfig {
                binary: Some(binary.into()),
                ..Default::default()
            };
            crate::backend::bwrap::BwrapBackend::new(bwrap, "changeset-unit-test".into())
        };
        let e = changeset(
            &backend("/nonexistent/bwrap"),
            &cfg,
            4_000_000,
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
            &backend(fake.to_str().unwrap()),
            &cfg,
            4_000_000,
            t.path(),
            t.path(),
            false,
            lim,
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("bwrap: setting up uid map"), "{e}");
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
