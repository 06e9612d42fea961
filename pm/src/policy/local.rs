//! The in-process gate: Rego evaluated by regorus' interpreter.
//!
//! The policies are parsed and analysed once, when the gate is built; each evaluation
//! runs a clone of that prepared engine, so the gate is `Send + Sync` and one instance
//! serves every task.
//!
//! Fail closed: any error while evaluating is a denial ([`RULE_EVALUATION_FAILED`]).
//! Builtin errors are strict (`to_number("x")`, an invalid regex, a type error fail the
//! evaluation) instead of OPA's default of silently making the rule body undefined, and
//! a complete rule or function that produces two different values is an error, not an
//! undefined value: either way a broken deny rule would otherwise let everything pass.
//! That is why the gate does not run regorus' register VM, although it is about 4x
//! faster: the VM swallows every non-resource error inside a rule body (strict or not)
//! and turns conflicting values into "undefined", so it cannot fail closed.

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::time::Duration;

use regorus::utils::limits::ExecutionTimerConfig;
use regorus::Engine;
use serde::Deserialize;
use tracing::{debug, warn};

use super::decision::{parse_violations, Decision, Mode, RULE_EVALUATION_FAILED};
use super::input::PolicyInput;
use super::{PolicyError, Violation, DEFAULT_PACKAGE};

/// The default policy, compiled into the binary (same text as `policies/cynode.rego`).
pub const BUILTIN_POLICY: &str = include_str!("../../../policies/cynode.rego");
/// Name under which [`BUILTIN_POLICY`] is loaded.
pub const BUILTIN_POLICY_NAME: &str = "builtin:policies/cynode.rego";

/// Wall-clock budget of one evaluation; a policy or input that needs more is denied.
const EVALUATION_TIME_LIMIT: Duration = Duration::from_secs(2);

fn timer_config() -> ExecutionTimerConfig {
    ExecutionTimerConfig {
        limit: EVALUATION_TIME_LIMIT,
        check_interval: NonZeroU32::MIN.saturating_add(255),
    }
}

/// Rego policies evaluated in-process.
#[derive(Debug, Clone)]
pub struct LocalGate {
    /// Parsed, analysed and warmed up: the interpreter, ready to clone per evaluation.
    engine: Engine,
    /// `data.<package>.deny` / `.warn`, for messages.
    deny_rule: String,
    /// The internal rule that evaluates `deny` and `warn` together (helper rules the two
    /// share are then computed once).
    decision_rule: String,
    mode: Mode,
    sources: Vec<String>,
}

impl LocalGate {
    /// Loads every `*.rego` file of `dir` (not recursive, sorted by name, `*_test.rego`
    /// skipped) and evaluates package [`DEFAULT_PACKAGE`].
    pub fn from_dir(dir: &Path, mode: Mode) -> Result<Self, PolicyError> {
        Self::from_dir_with_package(dir, DEFAULT_PACKAGE, mode)
    }

    /// Like [`LocalGate::from_dir`] for another package (`a.b` or `a/b`).
    pub fn from_dir_with_package(
        dir: &Path,
        package: &str,
        mode: Mode,
    ) -> Result<Self, PolicyError> {
        let files = rego_files(dir)?;
        if files.is_empty() {
            return Err(PolicyError::NoPolicies {
                dir: dir.to_path_buf(),
            });
        }
        let mut sources = Vec::with_capacity(files.len());
        for path in files {
            let text = std::fs::read_to_string(&path).map_err(|source| PolicyError::Io {
                path: path.clone(),
                source,
            })?;
            sources.push((path.display().to_string(), text));
        }
        Self::from_sources(sources, package, mode)
    }

    /// The built-in default policy ([`BUILTIN_POLICY`]).
    pub fn builtin(mode: Mode) -> Result<Self, PolicyError> {
        Self::from_sources(
            vec![(BUILTIN_POLICY_NAME.to_string(), BUILTIN_POLICY.to_string())],
            DEFAULT_PACKAGE,
            mode,
        )
    }

    /// Builds a gate from `(name, rego text)` pairs. `package` must define `deny`;
    /// `warn` is optional.
    pub fn from_sources(
        sources: Vec<(String, String)>,
        package: &str,
        mode: Mode,
    ) -> Result<Self, PolicyError> {
        let package = package
            .trim_matches(|c| c == '/' || c == '.')
            .replace('/', ".");
        let data_package = format!("data.{package}");
        let mut engine = Engine::new();
        engine.set_execution_timer_config(timer_config());
        engine.set_strict_builtin_errors(true);
        let mut in_package = Vec::new();
        let mut names = Vec::with_capacity(sources.len());
        for (name, text) in sources {
            let declared =
                engine
                    .add_policy(name.clone(), text)
                    .map_err(|e| PolicyError::Parse {
                        path: name.clone(),
                        message: format!("{e:#}"),
                    })?;
            if declared == data_package {
                in_package.push(name.clone());
            }
            names.push(name);
        }
        let declares = |rule: &str| -> Result<bool, PolicyError> {
            for name in &in_package {
                let found = engine
                    .has_declared_rule_rooted_at(name, rule)
                    .map_err(|e| PolicyError::Parse {
                        path: name.clone(),
                        message: format!("{e:#}"),
                    })?;
                if found {
                    return Ok(true);
                }
            }
            Ok(false)
        };
        if !declares("deny")? {
            return Err(PolicyError::MissingRule {
                rule: format!("{data_package}.deny"),
            });
        }
        let has_warn = declares("warn")?;
        let deny_rule = format!("{data_package}.deny");
        engine
            .add_policy(
                DECISION_MODULE_NAME.to_string(),
                decision_module(&data_package, has_warn),
            )
            .map_err(|e| PolicyError::Parse {
                path: DECISION_MODULE_NAME.to_string(),
                message: format!("{e:#}"),
            })?;
        let decision_rule = format!("data.{DECISION_PACKAGE}.decision");

        // Analyse once (and prove the policy evaluates) so every clone starts prepared.
        engine.set_input(regorus::Value::new_object());
        engine
            .eval_rule(decision_rule.clone())
            .map_err(|e| PolicyError::Compile {
                rule: deny_rule.clone(),
                message: format!("{e:#}"),
            })?;
        let gate = Self {
            engine,
            deny_rule,
            decision_rule,
            mode,
            sources: names,
        };
        debug!(package = %package, sources = ?gate.sources, "policy loaded");
        Ok(gate)
    }

    /// The mode decisions are made in.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The same policies in another mode.
    pub fn with_mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Names of the loaded policy files, in load order.
    pub fn sources(&self) -> &[String] {
        &self.sources
    }

    /// Evaluates the policy for one job. Never fails: an evaluation error is a denial
    /// with rule [`RULE_EVALUATION_FAILED`].
    pub fn evaluate_sync(&self, input: &PolicyInput) -> Decision {
        match self.findings(input) {
            Ok((deny, warn)) => Decision::from_findings(deny, warn, self.mode),
            Err(message) => {
                warn!(error = %message, "policy evaluation failed; denying (fail closed)");
                Decision::fail_closed(
                    RULE_EVALUATION_FAILED,
                    format!("policy evaluation failed: {message}"),
                    self.mode,
                )
            }
        }
    }

    fn findings(&self, input: &PolicyInput) -> Result<(Vec<Violation>, Vec<Violation>), String> {
        let input = to_rego_value(input)?;
        let mut engine = self.engine.clone();
        engine.set_input(input);
        let value = engine
            .eval_rule(self.decision_rule.clone())
            .map_err(|e| format!("{}: {e:#}", self.deny_rule))?;
        let json = serde_json::to_value(&value).map_err(|e| format!("{}: {e}", self.deny_rule))?;
        // Both keys always exist (defaults); anything else means the engine misbehaved.
        let (Some(deny), Some(warn)) = (json.get("deny"), json.get("warn")) else {
            return Err(format!("{}: evaluated to no decision", self.deny_rule));
        };
        let deny = parse_violations("deny", deny)?;
        let warn = parse_violations("warn", warn)?;
        Ok((deny, warn))
    }
}

/// Package of the internal module that gathers `deny` and `warn` in one evaluation.
const DECISION_PACKAGE: &str = "cynode_gate_internal";
const DECISION_MODULE_NAME: &str = "internal:decision.rego";

fn decision_module(data_package: &str, has_warn: bool) -> String {
    let warn = if has_warn {
        format!("\nwarn := {data_package}.warn\n")
    } else {
        String::new()
    };
    format!(
        "package {DECISION_PACKAGE}\n\nimport rego.v1\n\n\
         default deny := []\n\ndeny := {data_package}.deny\n\n\
         default warn := []\n{warn}\n\
         decision := {{\"deny\": deny, \"warn\": warn}}\n"
    )
}

fn to_rego_value(input: &PolicyInput) -> Result<regorus::Value, String> {
    let json = serde_json::to_value(input).map_err(|e| format!("cannot encode input: {e}"))?;
    regorus::Value::deserialize(json).map_err(|e| format!("cannot encode input: {e}"))
}

fn rego_files(dir: &Path) -> Result<Vec<PathBuf>, PolicyError> {
    let io = |source| PolicyError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        let is_policy = path.extension().is_some_and(|e| e == "rego")
            && !path
                .file_stem()
                .and_then(|s| s.to_str())
                .is_some_and(|s| s.ends_with("_test"))
            && path.is_file();
        if is_policy {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}
