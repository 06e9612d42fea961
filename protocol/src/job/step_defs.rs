//! Each step type defined once: [`StepType::def`] gives its wire name, the argument the
//! policy checks as a workspace path, what the agent's prompt says it does, and the
//! arguments offered to a model. Its arguments' full shape is its `*Args` struct, its
//! upstream form is [`super::upstream_form`]; both are matched exhaustively, so a new
//! step type does not compile until each has it.
//!
//! Generated from this table: the agent's `response_format` and its action list and
//! prompt lines (`sba/src/agent/contract.rs`, `prompt.rs`), and the policy's
//! `path_fields` block (`policies/cynode.rego`, between its generated markers; a drift
//! test regenerates it with `CYNODE_REGENERATE_POLICY=1`). Tests check the table against
//! the `*Args` structs' schemas.

use serde_json::{json, Value};

use super::StepType;

/// How an argument offered to a model is typed in the agent's reply schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgKind {
    /// A string.
    Text,
    /// An array of strings.
    TextList,
    /// An integer of at least 1 (a size, a depth, seconds).
    Count,
}

impl ArgKind {
    /// Its JSON Schema in the agent's reply schema.
    pub fn schema(self) -> Value {
        match self {
            ArgKind::Text => json!({ "type": "string" }),
            ArgKind::TextList => json!({ "type": "array", "items": { "type": "string" } }),
            ArgKind::Count => json!({ "type": "integer", "minimum": 1 }),
        }
    }
}

/// One argument offered to a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentArg {
    pub name: &'static str,
    pub kind: ArgKind,
    /// Whether the reply schema requires it.
    pub required: bool,
    /// Its placeholder in the prompt's example (`"<file>"`, `["<arg>"]`); `None`: the
    /// prompt does not show it.
    pub example: Option<&'static str>,
}

/// One step type's definition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepDef {
    pub ty: StepType,
    /// The argument the policy checks as a workspace path (`None`: the step names no path
    /// argument; `apply_unified_diff`'s paths are its diff headers, checked by the policy
    /// itself).
    pub path_field: Option<&'static str>,
    /// What the prompt says it does.
    pub purpose: &'static str,
    /// The arguments offered to a model, in the order the schema and the prompt list them
    /// (the parser accepts the rest of the step's arguments too).
    pub agent_args: &'static [AgentArg],
}

const fn arg(
    name: &'static str,
    kind: ArgKind,
    required: bool,
    example: Option<&'static str>,
) -> AgentArg {
    AgentArg {
        name,
        kind,
        required,
        example,
    }
}

use ArgKind::{Count, Text, TextList};

/// Every step type's definition, in the order the agent's prompt and schema list them.
pub const STEP_DEFS: [StepDef; 6] = [
    StepDef {
        ty: StepType::WriteFile,
        path_field: Some("path"),
        purpose: "create a file",
        agent_args: &[
            arg("path", Text, true, Some("\"<file>\"")),
            arg("content", Text, true, Some("\"<text>\"")),
        ],
    },
    StepDef {
        ty: StepType::ReadFile,
        path_field: Some("path"),
        purpose: "read a file",
        agent_args: &[
            arg("path", Text, true, Some("\"<file>\"")),
            arg("max_bytes", Count, false, None),
        ],
    },
    StepDef {
        ty: StepType::RunCommand,
        path_field: Some("working_dir"),
        purpose: "run a program directly (no shell)",
        agent_args: &[
            arg("command", Text, true, Some("\"<program>\"")),
            arg("args", TextList, true, Some("[\"<arg>\"]")),
            arg("working_dir", Text, false, None),
            arg("stdin", Text, false, None),
            arg("timeout_seconds", Count, false, None),
        ],
    },
    StepDef {
        ty: StepType::ListTree,
        path_field: Some("path"),
        purpose: "list files",
        agent_args: &[
            arg("path", Text, true, Some("\"<dir>\"")),
            arg("max_depth", Count, false, None),
        ],
    },
    StepDef {
        ty: StepType::SearchFiles,
        path_field: Some("path"),
        purpose: "search text in files",
        agent_args: &[
            arg("pattern", Text, true, Some("\"<regex>\"")),
            arg("path", Text, false, Some("\"<dir>\"")),
            arg("include", Text, false, None),
        ],
    },
    StepDef {
        ty: StepType::ApplyUnifiedDiff,
        path_field: None,
        purpose: "change files",
        agent_args: &[arg("diff", Text, true, Some("\"<unified diff>\""))],
    },
];

impl StepType {
    /// Every step type (in [`STEP_DEFS`]' order).
    pub fn all() -> impl Iterator<Item = StepType> {
        STEP_DEFS.iter().map(|d| d.ty)
    }

    /// Its definition.
    pub fn def(self) -> &'static StepDef {
        let i = match self {
            StepType::WriteFile => 0,
            StepType::ReadFile => 1,
            StepType::RunCommand => 2,
            StepType::ListTree => 3,
            StepType::SearchFiles => 4,
            StepType::ApplyUnifiedDiff => 5,
        };
        &STEP_DEFS[i]
    }
}

impl StepDef {
    /// Its `arguments` object in the agent's reply schema.
    pub fn agent_schema(&self) -> Value {
        let properties: serde_json::Map<String, Value> = self
            .agent_args
            .iter()
            .map(|a| (a.name.to_string(), a.kind.schema()))
            .collect();
        let required: Vec<&str> = self
            .agent_args
            .iter()
            .filter(|a| a.required)
            .map(|a| a.name)
            .collect();
        json!({
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": false
        })
    }

    /// Its line in the agent's prompt: `write_file {"path": "<file>", …}: create a file.`
    pub fn prompt_line(&self) -> String {
        let shown: Vec<String> = self
            .agent_args
            .iter()
            .filter_map(|a| a.example.map(|e| format!("\"{}\": {e}", a.name)))
            .collect();
        format!(
            "{} {{{}}}: {}.",
            self.ty.as_str(),
            shown.join(", "),
            self.purpose
        )
    }
}

/// The policy's `path_fields` block (`policies/cynode.rego`): step type → the argument
/// checked as a workspace path, for every step type that has one.
pub fn rego_path_fields() -> String {
    let mut out = String::from("path_fields := {\n");
    for d in &STEP_DEFS {
        if let Some(f) = d.path_field {
            out.push_str(&format!("\t\"{}\": \"{f}\",\n", d.ty.as_str()));
        }
    }
    out.push_str("}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::{
        ApplyUnifiedDiffArgs, ListTreeArgs, ReadFileArgs, RunCommandArgs, SearchFilesArgs,
        WriteFileArgs,
    };

    /// The properties of an `*Args` struct's schema, and the JSON type each allows.
    fn properties(schema: schemars::Schema) -> Vec<(String, Value)> {
        let v = schema.to_value();
        v["properties"]
            .as_object()
            .expect("an object schema")
            .iter()
            .map(|(k, p)| (k.clone(), p["type"].clone()))
            .collect()
    }

    fn args_schema(ty: StepType) -> Vec<(String, Value)> {
        properties(match ty {
            StepType::RunCommand => schemars::schema_for!(RunCommandArgs),
            StepType::WriteFile => schemars::schema_for!(WriteFileArgs),
            StepType::ReadFile => schemars::schema_for!(ReadFileArgs),
            StepType::ApplyUnifiedDiff => schemars::schema_for!(ApplyUnifiedDiffArgs),
            StepType::ListTree => schemars::schema_for!(ListTreeArgs),
            StepType::SearchFiles => schemars::schema_for!(SearchFilesArgs),
        })
    }

    /// Whether a schemars `type` (a name, or `[name, "null"]` for an option) is `kind`.
    fn is_kind(ty: &Value, kind: ArgKind) -> bool {
        let names: Vec<&str> = match ty {
            Value::String(s) => vec![s.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        let want = match kind {
            ArgKind::Text => "string",
            ArgKind::TextList => "array",
            ArgKind::Count => "integer",
        };
        names.contains(&want)
    }

    #[test]
    fn every_step_type_has_one_definition_in_order() {
        for (i, d) in STEP_DEFS.iter().enumerate() {
            assert_eq!(d.ty.def(), d, "STEP_DEFS[{i}] is def() of its type");
        }
        let mut names: Vec<&str> = StepType::all().map(StepType::as_str).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), STEP_DEFS.len(), "each type once");
    }

    #[test]
    fn the_table_matches_each_steps_arguments() {
        for d in &STEP_DEFS {
            let props = args_schema(d.ty);
            for a in d.agent_args {
                let ty = props
                    .iter()
                    .find(|(k, _)| k == a.name)
                    .map(|(_, t)| t)
                    .unwrap_or_else(|| panic!("{}: no argument {}", d.ty.as_str(), a.name));
                assert!(
                    is_kind(ty, a.kind),
                    "{}.{}: {ty} is not {:?}",
                    d.ty.as_str(),
                    a.name,
                    a.kind
                );
            }
            if let Some(f) = d.path_field {
                let ty = props.iter().find(|(k, _)| k == f).map(|(_, t)| t);
                assert!(
                    ty.is_some_and(|t| is_kind(t, ArgKind::Text)),
                    "{}: its path field {f} is a string argument",
                    d.ty.as_str()
                );
            }
        }
    }

    #[test]
    fn the_rego_block_names_every_path_field() {
        let block = rego_path_fields();
        assert!(
            block.contains("\t\"run_command\": \"working_dir\",\n"),
            "{block}"
        );
        assert!(!block.contains("apply_unified_diff"), "{block}");
        assert_eq!(block.lines().count(), 2 + 5);
    }
}
