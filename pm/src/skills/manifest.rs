//! `skill.yaml`: what a skill is, what it may do, and what inputs it takes.

use serde::{Deserialize, Serialize};

/// The manifest of one skill package.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SkillManifest {
    /// Stable id the model names (`[a-z0-9-]+`).
    pub skill_id: String,
    /// Semantic version `MAJOR.MINOR.PATCH`.
    pub version: String,
    /// What the skill does, written for the model choosing it.
    pub description: String,
    /// The sandbox purpose it needs (`base-tools`, `python-tools`, `go-tools`…).
    pub purpose: String,
    /// Commands its jobs may run.
    #[serde(default)]
    pub allowed_commands: Vec<String>,
    /// Whether its jobs need external network.
    #[serde(default)]
    pub network: bool,
    /// The destinations its jobs reach when they have network (`host`, `*.suffix`, each
    /// with an optional `:port`): a job with network runs with `network_policy:
    /// restricted` and this list as `egress_allow`, and the policy gate refuses it when
    /// the list goes beyond the tenant's `egress.allow`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<String>,
    pub limits: SkillLimits,
    /// JSON Schema of the inputs.
    pub inputs_schema: serde_json::Value,
    /// A read-only skill that, run with its default inputs (`{}`), shows the model what
    /// the workspace holds: an autonomous session's first job (`llm::turn`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub first_look: bool,
}

/// The largest limits a job of this skill may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SkillLimits {
    pub max_runtime_seconds: u64,
    pub max_output_bytes: u64,
}

/// A manifest field that breaks a rule serde cannot check.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ManifestError(pub String);

impl SkillManifest {
    /// Checks the fields serde cannot: id alphabet, semver, positive limits.
    pub fn check(&self) -> Result<(), ManifestError> {
        if !is_id(&self.skill_id) {
            return Err(ManifestError(format!(
                "skill_id `{}`: use lowercase letters, digits and `-`",
                self.skill_id
            )));
        }
        if !is_semver(&self.version) {
            return Err(ManifestError(format!(
                "version `{}`: expected semver MAJOR.MINOR.PATCH",
                self.version
            )));
        }
        if self.description.trim().is_empty() {
            return Err(ManifestError("description: must not be empty".into()));
        }
        if self.limits.max_runtime_seconds == 0 || self.limits.max_output_bytes == 0 {
            return Err(ManifestError("limits: must be positive".into()));
        }
        if !self.inputs_schema.is_object() {
            return Err(ManifestError(
                "inputs_schema: must be a JSON Schema object".into(),
            ));
        }
        Ok(())
    }
}

/// A non-empty name of lowercase letters, digits and `-` (skill and worker ids).
pub fn is_id(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// `MAJOR.MINOR.PATCH` with an optional `-pre` / `+build` suffix.
pub fn is_semver(v: &str) -> bool {
    let core = v.split(['-', '+']).next().unwrap_or("");
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.bytes().all(|b| b.is_ascii_digit())
                && (p.len() == 1 || !p.starts_with('0'))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn semver_shapes() {
        for ok in ["1.0.0", "0.1.2", "10.20.30-rc.1", "1.2.3+build"] {
            assert!(is_semver(ok), "{ok}");
        }
        for bad in ["1.0", "1.0.0.0", "01.0.0", "a.b.c", ""] {
            assert!(!is_semver(bad), "{bad}");
        }
    }
}
