//! What the policy sees: the rendered job, the skill manifest and the tenant's policy.

use serde::{Deserialize, Serialize};

/// 16 MiB, the default per-step output ceiling of a tenant.
pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 16 * 1024 * 1024;
/// One hour, the default whole-job runtime ceiling of a tenant.
pub const DEFAULT_MAX_RUNTIME_SECONDS: u64 = 3600;

/// The operator's configuration for one tenant, given to the policy as `input.tenant`.
///
/// Every field has a safe default (no network, ceilings of 3600 s and 16 MiB), so a
/// partial YAML/JSON document fills the rest in. Empty `allowed_purposes` or
/// `allowed_images` mean "any".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantPolicy {
    /// Tenant name, used in messages.
    pub tenant_id: String,
    /// Whether jobs of this tenant may ever have network access.
    pub allow_network: bool,
    /// Sandbox purposes (skill `purpose`, e.g. `go-tools`) the tenant may use; empty = any.
    pub allowed_purposes: Vec<String>,
    /// Sandbox images (exact, or a prefix ending in `*`) the tenant may use; empty = any.
    pub allowed_images: Vec<String>,
    /// Commands every skill of this tenant may run, on top of the skill's own list.
    pub global_allowed_commands: Vec<String>,
    /// Ceiling for `constraints.max_runtime_seconds`.
    pub max_runtime_seconds: u64,
    /// Ceiling for `constraints.max_output_bytes`.
    pub max_output_bytes: u64,
    /// Where this tenant's jobs may reach through a worker's egress proxy (a job with
    /// network runs with `network_policy: restricted`). A non-empty `allow` also lets the
    /// tenant's jobs have network, as `allow_network` does.
    pub egress: TenantEgress,
}

/// A tenant's egress settings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantEgress {
    /// Destinations (`host`, `*.suffix`, each with an optional `:port`) a skill's
    /// declared `egress` must stay within; also where the gateway's `web.fetch` may go
    /// (narrowed by the skill's `egress`).
    pub allow: Vec<String>,
    /// The PM's credentialed routes (its `egress.routes`) this tenant's jobs may call
    /// with the gateway's `api.call` (a job must also list `api.call`).
    pub routes_allowed: Vec<String>,
}

impl Default for TenantPolicy {
    fn default() -> Self {
        Self {
            tenant_id: "default".to_string(),
            allow_network: false,
            allowed_purposes: Vec::new(),
            allowed_images: Vec::new(),
            global_allowed_commands: Vec::new(),
            max_runtime_seconds: DEFAULT_MAX_RUNTIME_SECONDS,
            max_output_bytes: DEFAULT_MAX_OUTPUT_BYTES,
            egress: TenantEgress::default(),
        }
    }
}

/// The policy's `input` document.
///
/// `job` is the rendered job.json; `skill` is the skill manifest as JSON
/// (`skill_id`, `version`, `description`, `purpose`, `allowed_commands`, `network`,
/// `limits {max_runtime_seconds, max_output_bytes}`, `inputs_schema`) plus `image`, the
/// sandbox image the job runs in, once a worker is chosen ([`PolicyInput::for_job`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyInput {
    /// The rendered job.json.
    pub job: serde_json::Value,
    /// The skill manifest the job was rendered from.
    pub skill: serde_json::Value,
    /// The tenant's policy.
    pub tenant: TenantPolicy,
}

impl PolicyInput {
    /// Bundles the three parts.
    pub fn new(job: serde_json::Value, skill: serde_json::Value, tenant: TenantPolicy) -> Self {
        Self { job, skill, tenant }
    }

    /// The input for `job` of the skill `manifest`, with `skill.image` set to the sandbox
    /// image the job will run in when it is known (the worker it is placed on decides it;
    /// the tenant's `allowed_images` are checked against it).
    pub fn for_job(
        job: serde_json::Value,
        manifest: &impl Serialize,
        image: Option<&str>,
        tenant: TenantPolicy,
    ) -> Self {
        let mut skill = serde_json::to_value(manifest).unwrap_or(serde_json::Value::Null);
        if let (Some(image), Some(fields)) = (image, skill.as_object_mut()) {
            fields.insert("image".to_string(), image.into());
        }
        Self { job, skill, tenant }
    }
}
