//! Upstream CyNodeAI's step form, `{"type": "run_command", "args": {"argv": [...], "cwd":
//! "..."}}` (its `sbajob.StepSpec` and the argument structs of
//! agents/internal/sba/runner.go), read as a second documented form of job.json steps and
//! written when a job goes to an upstream worker.
//!
//! Reading is as strict as this project's own form: unknown fields in a step or in its
//! `args` are refused, with the field path. Upstream paths are relative to the workspace
//! even with a leading `/` (its runner strips it), so a leading `/` is stripped here too.
//! Steps get the ids `step-1`, `step-2`… by position. Writing refuses what upstream's
//! step arguments cannot say (stdin, base64 content, a file mode other than 0644), and
//! says which field.

use std::collections::BTreeMap;

use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Serialize};

use super::{
    ApplyUnifiedDiffArgs, ListTreeArgs, ReadFileArgs, RunCommandArgs, SearchFilesArgs, StepAction,
    StepType, WriteFileArgs,
};
use crate::error::ValidationError;

/// One step in upstream's form.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamStep {
    #[serde(rename = "type")]
    pub ty: StepType,
    /// Upstream omits it when empty (`json.RawMessage` with omitempty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<serde_json::Value>,
}

/// `run_command` args upstream: argv only, and a directory under the workspace.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "UpstreamRunCommandArgs")]
struct RunCommandUp {
    argv: Vec<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    cwd: String,
}

/// `write_file` args upstream (written 0644, overwriting).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "UpstreamWriteFileArgs")]
struct WriteFileUp {
    path: String,
    content: String,
}

/// `read_file` args upstream.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "UpstreamReadFileArgs")]
struct ReadFileUp {
    path: String,
}

/// `apply_unified_diff` args upstream.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "UpstreamApplyUnifiedDiffArgs")]
struct ApplyDiffUp {
    diff: String,
}

/// `list_tree` args upstream.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "UpstreamListTreeArgs")]
struct ListTreeUp {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    path: String,
}

/// `search_files` args upstream.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "UpstreamSearchFilesArgs")]
struct SearchFilesUp {
    pattern: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    path: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    include: String,
}

/// Each step type with the schema of its upstream `args`, for the job schema.
pub(crate) fn args_schemas(g: &mut SchemaGenerator) -> Vec<(StepType, Schema)> {
    vec![
        (StepType::RunCommand, g.subschema_for::<RunCommandUp>()),
        (StepType::WriteFile, g.subschema_for::<WriteFileUp>()),
        (StepType::ReadFile, g.subschema_for::<ReadFileUp>()),
        (StepType::ApplyUnifiedDiff, g.subschema_for::<ApplyDiffUp>()),
        (StepType::ListTree, g.subschema_for::<ListTreeUp>()),
        (StepType::SearchFiles, g.subschema_for::<SearchFilesUp>()),
    ]
}

/// The id an upstream-form step at `index` (from 0) gets.
pub fn step_id(index: usize) -> String {
    format!("step-{}", index + 1)
}

/// Upstream's paths are joined onto the workspace after a leading `/` is stripped.
fn beneath(path: &str) -> String {
    let rel = path.trim_start_matches('/');
    if rel.is_empty() && !path.is_empty() {
        ".".to_string()
    } else {
        rel.to_string()
    }
}

fn opt(path: String) -> Option<String> {
    (!path.is_empty()).then(|| beneath(&path))
}

fn typed<T: serde::de::DeserializeOwned>(
    args: Option<serde_json::Value>,
) -> Result<T, ValidationError> {
    let v = args.unwrap_or_else(|| serde_json::Value::Object(serde_json::Map::new()));
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." || path.is_empty() {
            "args".to_string()
        } else {
            format!("args.{path}")
        };
        ValidationError::new(path, e.into_inner().to_string())
    })
}

impl UpstreamStep {
    /// This step as an action of this project's form; errors name `args.<field>`.
    pub fn into_action(self) -> Result<StepAction, ValidationError> {
        Ok(match self.ty {
            StepType::RunCommand => {
                let a: RunCommandUp = typed(self.args)?;
                let mut argv = a.argv.into_iter();
                let Some(command) = argv.next() else {
                    return Err(ValidationError::new("args.argv", "must not be empty"));
                };
                StepAction::RunCommand(RunCommandArgs {
                    command,
                    args: argv.collect(),
                    working_dir: opt(a.cwd),
                    ..Default::default()
                })
            }
            StepType::WriteFile => {
                let a: WriteFileUp = typed(self.args)?;
                StepAction::WriteFile(WriteFileArgs {
                    path: beneath(&a.path),
                    content: a.content,
                    mode: None,
                    encoding: None,
                })
            }
            StepType::ReadFile => {
                let a: ReadFileUp = typed(self.args)?;
                StepAction::ReadFile(ReadFileArgs {
                    path: beneath(&a.path),
                    max_bytes: None,
                })
            }
            StepType::ApplyUnifiedDiff => {
                let a: ApplyDiffUp = typed(self.args)?;
                StepAction::ApplyUnifiedDiff(ApplyUnifiedDiffArgs { diff: a.diff })
            }
            StepType::ListTree => {
                let a: ListTreeUp = typed(self.args)?;
                StepAction::ListTree(ListTreeArgs {
                    path: opt(a.path),
                    max_depth: None,
                })
            }
            StepType::SearchFiles => {
                let a: SearchFilesUp = typed(self.args)?;
                StepAction::SearchFiles(SearchFilesArgs {
                    pattern: a.pattern,
                    path: opt(a.path),
                    include: (!a.include.is_empty()).then_some(a.include),
                })
            }
        })
    }

    /// `action` in upstream's form. What upstream cannot say is an error naming the field
    /// (relative to the step's `arguments`); what only narrows this project's behaviour
    /// is dropped: `timeout_seconds` (the job's deadline still holds), `max_bytes` and
    /// `max_depth` (upstream caps output at `max_output_bytes`). `env` is kept by running
    /// the command through `env NAME=VALUE…`.
    pub fn from_action(action: &StepAction) -> Result<UpstreamStep, ValidationError> {
        let args = match action {
            StepAction::RunCommand(a) => {
                if a.stdin.is_some() {
                    return Err(unsayable("arguments.stdin", "run_command has no stdin"));
                }
                let mut argv = Vec::with_capacity(a.args.len() + a.env.len() + 2);
                if !a.env.is_empty() {
                    if a.command.contains('=') || a.command.starts_with('-') {
                        return Err(unsayable(
                            "arguments.command",
                            "with env, the command runs through `env`, which would read this name as an option or a variable",
                        ));
                    }
                    argv.push("env".to_string());
                    argv.extend(env_pairs(&a.env));
                }
                argv.push(a.command.clone());
                argv.extend(a.args.iter().cloned());
                to_value(RunCommandUp {
                    argv,
                    cwd: upstream_path("arguments.working_dir", a.working_dir.as_deref())?,
                })?
            }
            StepAction::WriteFile(a) => {
                if a.encoding == Some(super::ContentEncoding::Base64) {
                    return Err(unsayable(
                        "arguments.encoding",
                        "write_file writes its content as text (no base64)",
                    ));
                }
                if let Some(mode) = &a.mode {
                    if super::parse_mode(mode) != Ok(0o644) {
                        return Err(unsayable(
                            "arguments.mode",
                            "write_file always writes mode 0644",
                        ));
                    }
                }
                to_value(WriteFileUp {
                    path: upstream_path("arguments.path", Some(&a.path))?,
                    content: a.content.clone(),
                })?
            }
            StepAction::ReadFile(a) => to_value(ReadFileUp {
                path: upstream_path("arguments.path", Some(&a.path))?,
            })?,
            StepAction::ApplyUnifiedDiff(a) => to_value(ApplyDiffUp {
                diff: a.diff.clone(),
            })?,
            StepAction::ListTree(a) => to_value(ListTreeUp {
                path: upstream_path("arguments.path", a.path.as_deref())?,
            })?,
            StepAction::SearchFiles(a) => to_value(SearchFilesUp {
                pattern: a.pattern.clone(),
                path: upstream_path("arguments.path", a.path.as_deref())?,
                include: a.include.clone().unwrap_or_default(),
            })?,
        };
        Ok(UpstreamStep {
            ty: action.step_type(),
            args: Some(args),
        })
    }
}

fn env_pairs(env: &BTreeMap<String, String>) -> impl Iterator<Item = String> + '_ {
    env.iter().map(|(k, v)| format!("{k}={v}"))
}

fn unsayable(path: &str, why: &str) -> ValidationError {
    ValidationError::new(
        path,
        format!("upstream CyNodeAI cannot express this: {why}"),
    )
}

fn to_value<T: Serialize>(v: T) -> Result<serde_json::Value, ValidationError> {
    serde_json::to_value(v).map_err(|e| ValidationError::new("arguments", e.to_string()))
}

/// A workspace path as upstream reads it: relative (upstream strips a leading `/` and
/// joins onto its workspace). This project's absolute paths under `/workspace` become
/// relative; other absolute paths cannot be said.
fn upstream_path(field: &str, path: Option<&str>) -> Result<String, ValidationError> {
    let Some(p) = path else {
        return Ok(String::new());
    };
    if !p.starts_with('/') {
        return Ok(p.to_string());
    }
    match p.strip_prefix(super::WORKSPACE_ROOT) {
        Some("") => Ok(".".to_string()),
        Some(rest) if rest.starts_with('/') => Ok(rest.trim_start_matches('/').to_string()),
        _ => Err(unsayable(
            field,
            "absolute paths are read beneath the workspace; give a path relative to /workspace",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(v: serde_json::Value) -> Result<StepAction, ValidationError> {
        serde_json::from_value::<UpstreamStep>(v)
            .unwrap()
            .into_action()
    }

    #[test]
    fn run_command_maps_argv_and_cwd() {
        let a = up(serde_json::json!({"type": "run_command", "args": {"argv": ["echo", "ok"], "cwd": "/src"}})).unwrap();
        assert_eq!(
            a,
            StepAction::RunCommand(RunCommandArgs {
                command: "echo".into(),
                args: vec!["ok".into()],
                working_dir: Some("src".into()),
                ..Default::default()
            })
        );
        let e = up(serde_json::json!({"type": "run_command", "args": {"argv": []}})).unwrap_err();
        assert_eq!(e, ValidationError::new("args.argv", "must not be empty"));
        let e = up(serde_json::json!({"type": "run_command"})).unwrap_err();
        assert_eq!(e, ValidationError::new("args", "missing field `argv`"));
        let e =
            up(serde_json::json!({"type": "run_command", "args": {"argv": ["x"], "shell": true}}))
                .unwrap_err();
        assert_eq!(e.path, "args.shell");
    }

    #[test]
    fn env_goes_through_env_and_stdin_cannot() {
        let mut a = RunCommandArgs {
            command: "go".into(),
            args: vec!["test".into()],
            working_dir: Some("/workspace/mod".into()),
            ..Default::default()
        };
        a.env.insert("GOFLAGS".into(), "-mod=mod".into());
        let s = UpstreamStep::from_action(&StepAction::RunCommand(a.clone())).unwrap();
        assert_eq!(
            s.args,
            Some(
                serde_json::json!({"argv": ["env", "GOFLAGS=-mod=mod", "go", "test"], "cwd": "mod"})
            )
        );
        a.stdin = Some("x".into());
        let e = UpstreamStep::from_action(&StepAction::RunCommand(a)).unwrap_err();
        assert_eq!(e.path, "arguments.stdin");
    }

    #[test]
    fn paths_outside_the_workspace_cannot_be_said() {
        let a = StepAction::ReadFile(ReadFileArgs {
            path: "/etc/passwd".into(),
            max_bytes: None,
        });
        assert_eq!(
            UpstreamStep::from_action(&a).unwrap_err().path,
            "arguments.path"
        );
    }
}
