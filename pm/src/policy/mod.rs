//! The policy gate: decides whether a rendered job.json may be dispatched.
//!
//! The input ([`PolicyInput`]) is the rendered job, the skill manifest and the tenant's
//! policy. The verdict ([`Decision`]) carries `deny` and `warn` violations like an
//! admission controller; in [`Mode::DryRun`] denials are only reported.
//!
//! Two engines answer the same question with the same input:
//! - [`LocalGate`]: Rego (`policies/*.rego`, package `cynode.policy`) evaluated in-process
//!   by regorus' interpreter with strict builtin errors (`cargo bench -p cynode-pm --bench
//!   policy` times it).
//! - [`RemoteGate`]: an OPA-compatible server (`POST /v1/data/cynode/policy`).
//!
//! Either way the gate fails closed, in both modes: a policy whose evaluation errors (a
//! builtin error such as `to_number("x")` or an invalid regex, a complete rule or function
//! with two different values) denies the job with rule `policy_evaluation_failed`, and an
//! external engine that gives no verdict at all denies it with `policy_engine_unavailable`.

mod decision;
mod input;
mod local;
mod remote;

use std::path::{Path, PathBuf};

pub use decision::{
    parse_violations, Decision, Mode, UnknownMode, Violation, RULE_ENGINE_UNAVAILABLE,
    RULE_EVALUATION_FAILED, RULE_UNNAMED,
};
pub use input::{
    PolicyInput, TenantEgress, TenantPolicy, DEFAULT_MAX_OUTPUT_BYTES, DEFAULT_MAX_RUNTIME_SECONDS,
};
pub use local::{LocalGate, BUILTIN_POLICY, BUILTIN_POLICY_NAME};
pub use remote::{RemoteGate, DEFAULT_TIMEOUT};

/// The Rego package the gate evaluates (`deny` and `warn` rules).
pub const DEFAULT_PACKAGE: &str = "cynode.policy";

/// Why a policy could not be loaded. Evaluation never errors (it fails closed instead).
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// A policy file or directory could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The directory holds no `.rego` file.
    #[error("no .rego policy files in {}", dir.display())]
    NoPolicies { dir: PathBuf },
    /// A policy file is not valid Rego.
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    /// The package does not define a required rule.
    #[error("policy does not define `{rule}`")]
    MissingRule { rule: String },
    /// The policy parses but cannot be evaluated (unsafe variables, recursion, …).
    #[error("cannot evaluate `{rule}`: {message}")]
    Compile { rule: String, message: String },
}

impl PolicyError {
    /// Whether trying again unchanged could succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Io { .. } => true,
            Self::NoPolicies { .. } => false,
            Self::Parse { .. } => false,
            Self::MissingRule { .. } => false,
            Self::Compile { .. } => false,
        }
    }
}

/// The gate in front of the dispatcher.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // one gate per process; boxing buys nothing
pub enum PolicyGate {
    /// Rego evaluated in-process.
    Local(LocalGate),
    /// An external OPA-compatible engine.
    Remote(RemoteGate),
}

impl PolicyGate {
    /// Loads `dir/*.rego` (package [`DEFAULT_PACKAGE`]).
    pub fn local_from_dir(dir: &Path, mode: Mode) -> Result<Self, PolicyError> {
        LocalGate::from_dir(dir, mode).map(Self::Local)
    }

    /// The default policy compiled into the binary.
    pub fn builtin(mode: Mode) -> Result<Self, PolicyError> {
        LocalGate::builtin(mode).map(Self::Local)
    }

    /// An external engine at base URL `endpoint`, asked for `package_path`
    /// (e.g. `cynode/policy`).
    pub fn remote(endpoint: &str, package_path: &str, mode: Mode) -> Self {
        Self::Remote(RemoteGate::new(endpoint, package_path, mode))
    }

    /// The mode decisions are made in.
    pub fn mode(&self) -> Mode {
        match self {
            Self::Local(gate) => gate.mode(),
            Self::Remote(gate) => gate.mode(),
        }
    }

    /// Where decisions come from, for logs and `--output` headers.
    pub fn describe(&self) -> String {
        match self {
            Self::Local(gate) => format!("regorus: {}", gate.sources().join(", ")),
            Self::Remote(gate) => format!("external: {}", gate.url()),
        }
    }

    /// Decides on one job. Never fails: no verdict means denied.
    #[tracing::instrument(skip_all, fields(job_id = tracing::field::Empty))]
    pub async fn evaluate(&self, input: &PolicyInput) -> Decision {
        if let Some(id) = input.job.get("job_id").and_then(|v| v.as_str()) {
            tracing::Span::current().record("job_id", id);
        }
        let decision = match self {
            Self::Local(gate) => gate.evaluate_sync(input),
            Self::Remote(gate) => gate.evaluate(input).await,
        };
        tracing::debug!(
            allowed = decision.allowed,
            denied = decision.deny.len(),
            warned = decision.warn.len(),
            "policy decision"
        );
        decision
    }
}
