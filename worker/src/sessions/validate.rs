//! Session requests checked before anything is created: the version, ids, image
//! allowlist and grammar, positive timeouts and env names; then the defaults and caps
//! (idle timeout, max lifetime) applied.

use std::collections::BTreeMap;

use cynode_protocol::worker_api::{check_id, API_VERSION};
use cynode_protocol::worker_sessions::{CreateSessionRequest, ExecRequest};
use cynode_protocol::ValidationError;

use super::{DEFAULT_IDLE_TIMEOUT_SECONDS, DEFAULT_MAX_LIFETIME_SECONDS};
use crate::config::Config;

/// A create request after validation, defaults and caps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Validated {
    pub workspace_id: String,
    pub idle: u64,
    pub lifetime: u64,
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
                lifetime: 100
            }
        );
        cfg.limits.max_timeout_seconds = 10800;
        assert_eq!(
            validate_create(&cfg, &req).unwrap(),
            Validated {
                workspace_id: "t".into(),
                idle: 600,
                lifetime: 3600
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
                lifetime: 10800
            }
        );
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
