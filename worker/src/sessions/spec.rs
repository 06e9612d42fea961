//! A session's sandbox: its env (the session's, then the command's, then the node's own
//! variables, which requests cannot override: a session with the egress proxy gets the
//! proxy variables of [`crate::job_egress::env`], as a job) and its spec, built by the one
//! [`crate::sandbox::spec`] builder: the workspace at `/workspace`, no `/job`, no network
//! but the proxy.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use cynode_protocol::worker_api::NetworkPolicy;
use cynode_protocol::worker_sessions::SessionInfo;

use crate::config::Config;
use crate::sandbox::{self, SandboxRequest, SandboxSpec};

/// The sandbox env: `session` then `exec` (without reserved names), then the node's own
/// (with the proxy variables when `egress`, and the inference listener's when
/// `inference`, its token); sorted by name.
pub(super) fn sandbox_env(
    info: &SessionInfo,
    session: &BTreeMap<String, String>,
    exec: &BTreeMap<String, String>,
    egress: bool,
    inference: Option<&str>,
) -> Vec<(String, String)> {
    let mut merged = session.clone();
    merged.extend(exec.iter().map(|(k, v)| (k.clone(), v.clone())));
    let mut env = sandbox::env(
        &merged,
        |k| {
            k == sandbox::ENV_SESSION_ID
                || (inference.is_some() && crate::inference::listener::ENV_NAMES.contains(&k))
        },
        [
            (sandbox::ENV_TASK_ID, info.task_id.clone()),
            (sandbox::ENV_JOB_ID, info.session_id.clone()),
            (sandbox::ENV_SESSION_ID, info.session_id.clone()),
            (sandbox::ENV_WORKSPACE_DIR, sandbox::WORKSPACE_MOUNT.into()),
        ]
        .into_iter()
        .chain(crate::job_egress::env(egress))
        .chain(
            inference
                .map(crate::inference::listener::env)
                .unwrap_or_default(),
        ),
    );
    env.sort();
    env
}

/// The sandbox spec of a session (`command` empty) or of one of its commands, over
/// `workspace`: its directory and its host uid ([`crate::uid_pool`]); `egress`: whether it
/// has the node's proxy.
#[allow(clippy::too_many_arguments)]
pub(super) fn sandbox_spec(
    cfg: &Config,
    name: String,
    info: &SessionInfo,
    workspace: (PathBuf, u32),
    command: Vec<String>,
    env: Vec<(String, String)>,
    timeout: Duration,
    egress: bool,
) -> SandboxSpec {
    let (workspace, host_uid) = workspace;
    sandbox::spec(
        &cfg.limits,
        SandboxRequest {
            name,
            image: info.image.clone(),
            command,
            override_entrypoint: true,
            env,
            workspace,
            job_dir: None,
            network: if egress {
                NetworkPolicy::Restricted
            } else {
                NetworkPolicy::None
            },
            labels: vec![
                ("cynodeai.task_id".into(), info.task_id.clone()),
                ("cynodeai.session_id".into(), info.session_id.clone()),
            ],
            timeout,
            host_uid,
        },
    )
}

/// The keep-alive container's name; a command's sandbox adds `-<seq>`.
pub(super) fn container_name(session_id: &str) -> String {
    format!("cynode-session-{session_id}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::{DEFAULT_HOME, DEFAULT_PATH};
    use cynode_protocol::worker_sessions::SessionStatus;

    /// A running session `s` of task `t`.
    fn info() -> SessionInfo {
        SessionInfo {
            version: 1,
            session_id: "s".into(),
            task_id: "t".into(),
            workspace_id: "t".into(),
            image: "i".into(),
            status: SessionStatus::Running,
            created_at: String::new(),
            expires_at: String::new(),
            idle_timeout_seconds: 1,
            max_lifetime_seconds: 1,
            ended_at: None,
            end_reason: None,
            egress: None,
            workspace_copy: None,
        }
    }

    #[test]
    fn reserved_env_cannot_be_overridden_and_exec_env_wins() {
        let info = info();
        let session: BTreeMap<String, String> = [
            ("A", "session"),
            ("B", "session"),
            ("CYNODE_TASK_ID", "forged"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let exec: BTreeMap<String, String> = [("B", "exec"), ("CYNODE_SESSION_ID", "forged")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let env = sandbox_env(&info, &session, &exec, false, None);
        let expected: Vec<(String, String)> = [
            ("A", "session"),
            ("B", "exec"),
            ("CYNODE_JOB_ID", "s"),
            ("CYNODE_SESSION_ID", "s"),
            ("CYNODE_TASK_ID", "t"),
            ("CYNODE_WORKSPACE_DIR", "/workspace"),
            ("HOME", DEFAULT_HOME),
            ("PATH", DEFAULT_PATH),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(env, expected);
    }

    #[test]
    fn proxy_variables_are_the_nodes_and_only_with_egress() {
        let info = info();
        let forged: BTreeMap<String, String> = [
            ("HTTP_PROXY", "http://evil:1"),
            ("no_proxy", "*"),
            ("CYNODE_EGRESS_ROUTES_URL", "http://evil:2"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let with = sandbox_env(&info, &forged, &forged, true, None);
        let get = |k: &str| -> Vec<&str> {
            with.iter()
                .filter(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
                .collect()
        };
        assert_eq!(get("HTTP_PROXY"), [crate::job_egress::PROXY_URL]);
        assert_eq!(get("https_proxy"), [crate::job_egress::PROXY_URL]);
        assert_eq!(get("no_proxy"), [crate::job_egress::NO_PROXY]);
        assert_eq!(
            get("CYNODE_EGRESS_ROUTES_URL"),
            [crate::job_egress::ROUTES_URL]
        );
        let without = sandbox_env(&info, &forged, &forged, false, None);
        assert!(
            !without
                .iter()
                .any(|(k, _)| k.contains("PROXY") || k.contains("proxy") || k.contains("EGRESS")),
            "{without:?}"
        );
    }
}
