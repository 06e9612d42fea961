//! The gate's verdict: `deny` and `warn` violations, and whether the job may go.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Rule name of the denial written when an external engine gives no usable answer.
pub const RULE_ENGINE_UNAVAILABLE: &str = "policy_engine_unavailable";
/// Rule name of the denial written when the in-process engine fails to evaluate.
pub const RULE_EVALUATION_FAILED: &str = "policy_evaluation_failed";
/// Rule name given to a violation the policy wrote as a bare string.
pub const RULE_UNNAMED: &str = "policy";

/// How a decision is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Any `deny` blocks the job.
    #[default]
    Enforce,
    /// Audit only: violations are reported but `allowed` stays true. An engine that
    /// cannot decide at all still blocks (fail closed), since there is nothing to audit.
    DryRun,
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Enforce => "enforce",
            Self::DryRun => "dry_run",
        })
    }
}

/// The mode string was none of `enforce`, `dry_run`, `dry-run`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown policy mode `{0}`: expected enforce or dry-run")]
pub struct UnknownMode(pub String);

impl FromStr for Mode {
    type Err = UnknownMode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "enforce" => Ok(Self::Enforce),
            "dry_run" | "dry-run" | "dryrun" => Ok(Self::DryRun),
            other => Err(UnknownMode(other.to_string())),
        }
    }
}

/// One finding of the policy.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Violation {
    /// Stable rule name, e.g. `command_not_allowed`.
    pub rule: String,
    /// Lowercase explanation naming the step and the offending value.
    pub message: String,
}

impl Violation {
    /// Builds a violation.
    pub fn new(rule: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            rule: rule.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.rule, self.message)
    }
}

/// The verdict on one job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// Whether the job may be dispatched.
    pub allowed: bool,
    /// Violations that block the job in [`Mode::Enforce`], sorted by rule then message.
    pub deny: Vec<Violation>,
    /// Findings that never block, sorted by rule then message.
    pub warn: Vec<Violation>,
    /// The mode the decision was made in.
    pub mode: Mode,
}

impl Decision {
    /// The decision for the policy's findings: allowed when nothing is denied, or always
    /// in [`Mode::DryRun`]. Both lists are sorted and deduplicated.
    pub fn from_findings(mut deny: Vec<Violation>, mut warn: Vec<Violation>, mode: Mode) -> Self {
        deny.sort();
        deny.dedup();
        warn.sort();
        warn.dedup();
        let allowed = deny.is_empty() || mode == Mode::DryRun;
        Self {
            allowed,
            deny,
            warn,
            mode,
        }
    }

    /// Fail closed: the engine produced no verdict, so the job is denied in every mode.
    pub fn fail_closed(rule: &str, message: impl Into<String>, mode: Mode) -> Self {
        Self {
            allowed: false,
            deny: vec![Violation::new(rule, message)],
            warn: Vec::new(),
            mode,
        }
    }

    /// Whether the engine itself failed (as opposed to the policy denying the job).
    pub fn is_engine_failure(&self) -> bool {
        self.deny
            .iter()
            .any(|v| v.rule == RULE_ENGINE_UNAVAILABLE || v.rule == RULE_EVALUATION_FAILED)
    }

    /// One line per denial, `rule: message`, for logs and for feeding back to the model.
    pub fn denial_summary(&self) -> String {
        self.deny
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Reads a `deny` or `warn` document: an array (a Rego set) whose items are
/// `{"rule", "message"}` objects or bare message strings. A missing document (`null`)
/// is an empty list. Anything else is an error naming what was wrong.
pub fn parse_violations(name: &str, value: &serde_json::Value) -> Result<Vec<Violation>, String> {
    let items = match value {
        serde_json::Value::Null => return Ok(Vec::new()),
        serde_json::Value::Array(items) => items,
        other => {
            return Err(format!(
                "`{name}` must be a set or array, got {}",
                json_type(other)
            ))
        }
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match item {
            serde_json::Value::String(message) => Ok(Violation::new(RULE_UNNAMED, message.clone())),
            serde_json::Value::Object(fields) => {
                let message = match fields.get("message").or_else(|| fields.get("msg")) {
                    Some(serde_json::Value::String(m)) => m.clone(),
                    _ => return Err(format!("`{name}[{i}]` has no string `message`")),
                };
                let rule = match fields.get("rule") {
                    Some(serde_json::Value::String(r)) => r.clone(),
                    None => RULE_UNNAMED.to_string(),
                    Some(other) => {
                        return Err(format!(
                            "`{name}[{i}].rule` must be a string, got {}",
                            json_type(other)
                        ))
                    }
                };
                Ok(Violation { rule, message })
            }
            other => Err(format!(
                "`{name}[{i}]` must be an object or a string, got {}",
                json_type(other)
            )),
        })
        .collect()
}

fn json_type(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn dry_run_keeps_allowed_and_lists_denials() {
        let d = Decision::from_findings(vec![Violation::new("r", "m")], vec![], Mode::DryRun);
        assert_eq!(
            d,
            Decision {
                allowed: true,
                deny: vec![Violation::new("r", "m")],
                warn: vec![],
                mode: Mode::DryRun
            }
        );
    }

    #[test]
    fn findings_are_sorted_and_deduplicated() {
        let d = Decision::from_findings(
            vec![
                Violation::new("b", "x"),
                Violation::new("a", "y"),
                Violation::new("b", "x"),
            ],
            vec![],
            Mode::Enforce,
        );
        assert_eq!(
            d.deny,
            vec![Violation::new("a", "y"), Violation::new("b", "x")]
        );
        assert!(!d.allowed);
    }

    #[test]
    fn fail_closed_denies_even_in_dry_run() {
        let d = Decision::fail_closed(RULE_ENGINE_UNAVAILABLE, "down", Mode::DryRun);
        assert!(!d.allowed);
        assert!(d.is_engine_failure());
    }

    #[test]
    fn parses_objects_strings_and_null() {
        let v = json!([{"rule": "r", "message": "m"}, "bare", {"msg": "opa style"}]);
        assert_eq!(
            parse_violations("deny", &v),
            Ok(vec![
                Violation::new("r", "m"),
                Violation::new(RULE_UNNAMED, "bare"),
                Violation::new(RULE_UNNAMED, "opa style"),
            ])
        );
        assert_eq!(parse_violations("warn", &json!(null)), Ok(vec![]));
    }

    #[test]
    fn rejects_malformed_documents() {
        assert_eq!(
            parse_violations("deny", &json!({"a": 1})),
            Err("`deny` must be a set or array, got an object".to_string())
        );
        assert_eq!(
            parse_violations("deny", &json!([1])),
            Err("`deny[0]` must be an object or a string, got a number".to_string())
        );
        assert_eq!(
            parse_violations("deny", &json!([{"rule": "r"}])),
            Err("`deny[0]` has no string `message`".to_string())
        );
    }

    #[test]
    fn mode_parses_and_prints() {
        assert_eq!("dry-run".parse::<Mode>(), Ok(Mode::DryRun));
        assert_eq!("enforce".parse::<Mode>(), Ok(Mode::Enforce));
        assert_eq!(
            "audit".parse::<Mode>(),
            Err(UnknownMode("audit".to_string()))
        );
        assert_eq!(Mode::DryRun.to_string(), "dry_run");
        assert_eq!(
            serde_json::to_value(Mode::DryRun).ok(),
            Some(json!("dry_run"))
        );
    }
}
