//! Session requests checked before anything is created: the version, ids, image
//! allowlist and grammar, positive timeouts and env names, the network (a job's rules:
//! [`network`]) and inference ([`inference`]); then the defaults and caps (idle timeout,
//! max lifetime) applied.

use std::collections::BTreeMap;

use cynode_protocol::worker_api::{check_id, RunJobRequest, SandboxSpec, API_VERSION};
use cynode_protocol::worker_sessions::{CreateSessionRequest, ExecRequest};
use cynode_protocol::ValidationError;

use super::{DEFAULT_IDLE_TIMEOUT_SECONDS, DEFAULT_MAX_LIFETIME_SECONDS};
use crate::config::Config;
use crate::egress::Policy;

/// A create request after validation, defaults and caps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Validated {
    pub workspace_id: String,
    pub idle: u64,
    pub lifetime: u64,
    /// The session's egress proxy policy; `None`: no network at all.
    pub egress: Option<Policy>,
    /// The models the session may use through the node's inference listener; `None`:
    /// no listener.
    pub models: Option<Vec<String>>,
}

/// The session's network, by exactly a job's rules and messages: a job request carrying
/// only the session's `network_policy` and `egress_allow` goes through
/// [`RunJobRequest::validate`] (`allow` refused, `egress_allow` needs `restricted` and is
/// bounded) and [`crate::job_egress::policy`] (the node's backend and ceiling). An error
/// names the session's own field (`egress_allow`, not `sandbox.egress_allow`).
fn network(cfg: &Config, req: &CreateSessionRequest) -> Result<Option<Policy>, ValidationError> {
    let job = RunJobRequest {
        version: API_VERSION,
        task_id: req.task_id.clone(),
        job_id: req.session_id.clone(),
        sandbox: SandboxSpec {
            image: req.image.clone(),
            command: vec!["true".into()],
            network_policy: req.network_policy,
            egress_allow: req.egress_allow.clone(),
            ..SandboxSpec::default()
        },
        workspace_id: None,
        gateway: None,
        inference_key: None,
    };
    job.validate()
        .and_then(|()| crate::job_egress::policy(cfg, &job))
        .map_err(|e| {
            let path = e
                .path
                .strip_prefix("sandbox.")
                .unwrap_or(&e.path)
                .to_string();
            ValidationError::new(path, e.message)
        })
}

fn check_env(field: &str, env: &BTreeMap<String, String>) -> Result<(), ValidationError> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ValidationError::new(
                field,
                format!("invalid variable `{}`", k.replace('\0', "\\0")),
            ));
        }
    }
    Ok(())
}

fn positive(field: &str, v: Option<u64>) -> Result<(), ValidationError> {
    if v == Some(0) {
        return Err(ValidationError::new(field, "must be positive"));
    }
    Ok(())
}

fn check_version(v: u32) -> Result<(), ValidationError> {
    if v != API_VERSION {
        return Err(ValidationError::new(
            "version",
            format!("unsupported version {v}: expected {API_VERSION}"),
        ));
    }
    Ok(())
}

pub(super) fn validate_create(
    cfg: &Config,
    req: &CreateSessionRequest,
) -> Result<Validated, ValidationError> {
    check_version(req.version)?;
    check_id("session_id", &req.session_id)?;
    check_id("task_id", &req.task_id)?;
    if let Some(ws) = &req.workspace_id {
        check_id("workspace_id", ws)?;
    }
    if req.image.trim().is_empty() {
        return Err(ValidationError::new("image", "must not be empty"));
    }
    cfg.check_image(&req.image)
        .map_err(|e| ValidationError::new("image", e.to_string()))?;
    positive("idle_timeout_seconds", req.idle_timeout_seconds)?;
    positive("max_lifetime_seconds", req.max_lifetime_seconds)?;
    check_env("env", &req.env)?;
    let egress = network(cfg, req)?;
    let models = inference(cfg, req)?;
    let lifetime = req
        .max_lifetime_seconds
        .unwrap_or(DEFAULT_MAX_LIFETIME_SECONDS)
        .min(cfg.limits.max_timeout_seconds)
        .max(1);
    let idle = req
        .idle_timeout_seconds
        .unwrap_or(DEFAULT_IDLE_TIMEOUT_SECONDS)
        .min(lifetime);
    Ok(Validated {
        workspace_id: req
            .workspace_id
            .clone()
            .unwrap_or_else(|| req.task_id.clone()),
        idle,
        lifetime,
        egress,
        models,
    })
}

/// The session's models, by a command job's rules ([`crate::executor::inference_models`]:
/// the node's `inference.models`, refused on a backend that cannot bind the listener);
/// unlike a job, a session that asks for inference on a node without an upstream is
/// refused, never started without it.
fn inference(
    cfg: &Config,
    req: &CreateSessionRequest,
) -> Result<Option<Vec<String>>, ValidationError> {
    if req.use_inference != Some(true) {
        return Ok(None);
    }
    if cfg.inference.is_none() {
        return Err(ValidationError::new(
            "use_inference",
            "this node has no inference upstream (config `inference.base_url`)",
        ));
    }
    let job = RunJobRequest {
        version: API_VERSION,
        task_id: req.task_id.clone(),
        job_id: req.session_id.clone(),
        sandbox: SandboxSpec {
            image: req.image.clone(),
            command: vec!["true".into()],
            use_inference: Some(true),
            ..SandboxSpec::default()
        },
        workspace_id: None,
        gateway: None,
        inference_key: None,
    };
    crate::executor::inference_models(cfg, &job).map_err(|e| {
        let path = e
            .path
            .strip_prefix("sandbox.")
            .unwrap_or(&e.path)
            .to_string();
        ValidationError::new(path, e.message)
    })
}

pub(super) fn validate_exec(req: &ExecRequest) -> Result<(), ValidationError> {
    check_version(req.version)?;
    if req.command.is_empty() {
        return Err(ValidationError::new("command", "must not be empty"));
    }
    if req.command.iter().any(|a| a.contains('\0')) {
        return Err(ValidationError::new(
            "command",
            "must not contain NUL bytes",
        ));
    }
    positive("timeout_seconds", req.timeout_seconds)?;
    check_env("env", &req.env)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn create_req(body: serde_json::Value) -> Result<CreateSessionRequest, ValidationError> {
        cynode_protocol::error::parse_strict(body.to_string().as_bytes())
    }

    #[test]
    fn defaults_and_caps() {
        let mut cfg = Config::default();
        cfg.limits.max_timeout_seconds = 100;
        let req = create_req(serde_json::json!({
            "version": 1, "session_id": "s", "task_id": "t", "image": "i"
        }))
        .unwrap();
        assert_eq!(
            validate_create(&cfg, &req).unwrap(),
            Validated {
                workspace_id: "t".into(),
                idle: 100,
                lifetime: 100,
                egress: None,
                models: None,
            }
        );
        cfg.limits.max_timeout_seconds = 10800;
        assert_eq!(
            validate_create(&cfg, &req).unwrap(),
            Validated {
                workspace_id: "t".into(),
                idle: 600,
                lifetime: 3600,
                egress: None,
                models: None,
            }
        );
        let req = create_req(serde_json::json!({
            "version": 1, "session_id": "s", "task_id": "t", "image": "i",
            "workspace_id": "w", "idle_timeout_seconds": 5, "max_lifetime_seconds": 99999
        }))
        .unwrap();
        assert_eq!(
            validate_create(&cfg, &req).unwrap(),
            Validated {
                workspace_id: "w".into(),
                idle: 5,
                lifetime: 10800,
                egress: None,
                models: None,
            }
        );
    }

    #[test]
    fn network_follows_the_jobs_rules_and_names_the_sessions_field() {
        let mut cfg = Config {
            images: vec!["ok".into()],
            backend: crate::config::BackendKind::Bwrap,
            ..Config::default()
        };
        let body = |extra: serde_json::Value| {
            let mut b = serde_json::json!({
                "version": 1, "session_id": "s", "task_id": "t", "image": "ok"
            });
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            create_req(b).unwrap()
        };
        // Egress off: `restricted` is deny-all, no proxy; naming destinations is refused.
        let v = validate_create(
            &cfg,
            &body(serde_json::json!({"network_policy": "restricted"})),
        );
        assert_eq!(v.unwrap().egress, None);
        cfg.egress.allow = crate::egress::Allowlist::parse(&["origin.test".to_string()]).unwrap();
        let v = validate_create(&cfg, &body(serde_json::json!({}))).unwrap();
        assert_eq!(v.egress, None, "`none` is the default");
        let v = validate_create(
            &cfg,
            &body(serde_json::json!({"network_policy": "restricted", "egress_allow": ["origin.test:80"]})),
        )
        .unwrap();
        assert!(v.egress.is_some());
        let cases = [
            (
                serde_json::json!({"network_policy": "allow"}),
                "network_policy",
            ),
            (
                serde_json::json!({"egress_allow": ["origin.test"]}),
                "egress_allow",
            ),
            (
                serde_json::json!({"network_policy": "restricted", "egress_allow": ["pypi.org"]}),
                "egress_allow",
            ),
        ];
        for (extra, path) in cases {
            let err = validate_create(&cfg, &body(extra.clone())).unwrap_err();
            assert_eq!(err.path, path, "{extra}: {err}");
        }
        // gVisor cannot bind the proxy inside its sandboxes.
        cfg.backend = crate::config::BackendKind::Docker;
        cfg.docker.runtime = crate::config::OciRuntime::Runsc;
        let err = validate_create(
            &cfg,
            &body(serde_json::json!({"network_policy": "restricted"})),
        )
        .unwrap_err();
        assert_eq!(err.path, "network_policy", "{err}");
    }

    #[test]
    fn invalid_requests_name_the_field() {
        let cfg = Config {
            images: vec!["ok".into()],
            ..Config::default()
        };
        let base =
            serde_json::json!({ "version": 1, "session_id": "s", "task_id": "t", "image": "ok" });
        let cases = [
            ("version", serde_json::json!(2), "version"),
            ("session_id", serde_json::json!("../x"), "session_id"),
            ("workspace_id", serde_json::json!(".."), "workspace_id"),
            ("image", serde_json::json!("other"), "image"),
            (
                "idle_timeout_seconds",
                serde_json::json!(0),
                "idle_timeout_seconds",
            ),
            ("env", serde_json::json!({ "A=B": "x" }), "env"),
        ];
        for (field, value, path) in cases {
            let mut body = base.clone();
            body[field] = value;
            let err = validate_create(&cfg, &create_req(body).unwrap()).unwrap_err();
            assert_eq!(err.path, path, "{err}");
        }
        let mut body = base.clone();
        body["surprise"] = serde_json::json!(1);
        let err = create_req(body).unwrap_err();
        assert_eq!(err.path, "surprise", "{err}");
        assert!(err.message.starts_with("unknown field `surprise`"), "{err}");
        let exec: ExecRequest =
            cynode_protocol::error::parse_strict(br#"{"version":1,"command":[]}"#).unwrap();
        assert_eq!(validate_exec(&exec).unwrap_err().path, "command");
    }
}
