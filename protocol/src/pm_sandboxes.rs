//! The PM's sandbox API bodies (`/v1/sandboxes…`): a worker's session offered to a
//! tenant through `cynode-pm serve` and `cynode-pm mcp`, under the tenant's policy. The
//! PM names the sandbox (`sb-` and a random UUID), places it on a worker offering the
//! `purpose`, and answers with the worker's own bodies (`worker_sessions`,
//! `worker_session_state`, `worker_session_io`) for everything after the create.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::worker_api::NetworkPolicy;
use crate::worker_session_state::OnIdle;

/// `POST /v1/sandboxes` body.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// The sandbox purpose (a skill's `purpose`, e.g. `base-tools`, the default): the
    /// sandbox runs the image a worker offers for it. Must be in the tenant's
    /// `allowed_purposes` (when that is not empty), its image in `allowed_images`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub purpose: Option<String>,
    /// Added to every command's environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// `none` (the default) or `restricted` (the worker's egress proxy, within the
    /// tenant's `egress.allow`); `allow` is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub network_policy: Option<NetworkPolicy>,
    /// With `restricted`: where the sandbox may go, each entry one of the tenant's
    /// `egress.allow` (absent: all of them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_allow: Option<Vec<String>>,
    /// The worker's models inside the sandbox (`OPENAI_BASE_URL`, `OLLAMA_BASE_URL`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_inference: Option<bool>,
    /// Ends (or suspends, with `on_idle: suspend`) the sandbox after this long idle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_seconds: Option<u64>,
    /// Ends the sandbox this long after its creation; at most the tenant's
    /// `max_runtime_seconds` (its default too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_lifetime_seconds: Option<u64>,
    /// `end` (the default) or `suspend`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub on_idle: Option<OnIdle>,
    /// Start from one of the tenant's snapshots (a fork): the new sandbox runs on the
    /// snapshot's worker, its workspace a copy of the snapshot's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
}

/// `GET /v1/sandboxes`: the tenant's sandboxes, newest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SandboxList {
    pub sandboxes: Vec<SandboxRef>,
}

/// One sandbox of a [`SandboxList`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SandboxRef {
    pub sandbox_id: String,
    pub worker_id: String,
}
