//! job.json (protocol 1.x): what the SBA is asked to do.
//!
//! Parsing is strict: unknown fields are rejected everywhere except inside
//! `context.preferences` and `context.skills`, and [`JobSpec::from_json`] finishes all
//! validation before a caller can run anything. Every error names its field path.
//!
//! Steps come in two documented forms, one per job: this project's `{"id", "type",
//! "arguments"}` and upstream CyNodeAI's `{"type", "args"}` ([`upstream_form`]), each
//! strict about its own fields. A step with `id` or `arguments` is read in this project's
//! form, any other in upstream's; a job that mixes them is refused at the first step of
//! the other form.

use std::collections::{BTreeMap, HashSet};

use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Serialize};

use crate::error::{parse_strict, ValidationError, ValidationErrors};
use crate::version;

pub mod step_defs;
mod to_upstream;
pub mod upstream_form;

pub use step_defs::{AgentArg, ArgKind, StepDef, STEP_DEFS};

/// Where the sandbox mounts the workspace; absolute step paths must lie under it.
pub const WORKSPACE_ROOT: &str = "/workspace";

/// A complete job specification.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// `"1"`, `"1.0"`, `"1.3"`…: major must be 1.
    pub protocol_version: String,
    pub job_id: String,
    pub task_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skill_id: Option<String>,
    /// Defaults to `direct_steps` when steps are present, `agent_inference` otherwise. In
    /// `agent_inference` the steps, if any, are suggestions that seed the runner's todo list;
    /// they are not run as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution_mode: Option<ExecutionMode>,
    pub constraints: Constraints,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference: Option<Inference>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<JobContext>,
    /// Workspace globs collected as artifacts after the steps (protocol 1.1).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifacts: Vec<String>,
    /// In this project's form or in upstream's (see the module doc).
    #[serde(default, deserialize_with = "either_form::deserialize")]
    pub steps: Vec<Step>,
}

/// How the SBA works through the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionMode {
    DirectSteps,
    AgentInference,
}

/// Limits the job runs under.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Constraints {
    /// Whole-job deadline in seconds; must be positive.
    pub max_runtime_seconds: u64,
    /// Per step, stdout and stderr together; must be positive.
    pub max_output_bytes: u64,
    /// Whether the job may reach external networks (alias: `network_allowed`).
    #[serde(default, alias = "network_allowed")]
    pub ext_net_allowed: bool,
    /// When present, run_command may only start these commands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_commands: Option<Vec<String>>,
    /// When present, every path a step touches must lie under one of these.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_paths: Option<Vec<String>>,
    /// write_file may replace an existing file only when true.
    #[serde(default)]
    pub allow_overwrite: bool,
}

/// Models the job may use (agent mode). An `agent_inference` job must name at least one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Inference {
    #[serde(default)]
    pub allowed_models: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// Context handed to the SBA; free-form only in `preferences` and `skills`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct JobContext {
    /// The agent persona's title (upstream `mvp/phase-2`, REQ-SBAGNT-0113): the first
    /// block of the agent's prompt when present.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub persona_title: String,
    /// The agent persona's description (upstream `mvp/phase-2`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub persona_description: String,
    pub baseline_context: String,
    pub project_context: String,
    pub task_context: String,
    pub requirements: Vec<String>,
    pub acceptance_criteria: Vec<String>,
    pub preferences: serde_json::Map<String, serde_json::Value>,
    pub additional_context: String,
    pub skill_ids: Vec<String>,
    pub skills: Option<serde_json::Value>,
    /// The gateway tools the agent may call (agent mode's `tool_call` action), e.g.
    /// `["artifact.put", "skills.get"]`. A name not listed is refused by the SBA before any
    /// call; the gateway applies its own allowlist and the token's scope on top. Upstream
    /// CyNodeAI has no such field (its SBA is told nothing); this project's name.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mcp_tools: Vec<String>,
}

/// Most tools `context.mcp_tools` may list (each name once).
pub const MAX_MCP_TOOLS: usize = 32;

/// Longest gateway tool name `context.mcp_tools` accepts.
pub const MAX_TOOL_NAME: usize = 64;

/// Whether `name` has the shape of a gateway tool name: 1 to [`MAX_TOOL_NAME`] bytes of
/// ASCII letters, digits, `.`, `_` and `-`.
pub fn is_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TOOL_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The six step types, as named on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StepType {
    RunCommand,
    WriteFile,
    ReadFile,
    ApplyUnifiedDiff,
    ListTree,
    SearchFiles,
}

impl StepType {
    /// The wire name, e.g. `run_command`.
    pub fn as_str(self) -> &'static str {
        match self {
            StepType::RunCommand => "run_command",
            StepType::WriteFile => "write_file",
            StepType::ReadFile => "read_file",
            StepType::ApplyUnifiedDiff => "apply_unified_diff",
            StepType::ListTree => "list_tree",
            StepType::SearchFiles => "search_files",
        }
    }
}

/// `run_command`: argv only, never a shell unless the job names one as the command.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCommandArgs {
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u64>,
}

/// How `write_file` content is encoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ContentEncoding {
    #[default]
    Utf8,
    Base64,
}

/// `write_file`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteFileArgs {
    pub path: String,
    pub content: String,
    /// Octal permission bits such as `"0644"`; no setuid/setgid/sticky bits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<ContentEncoding>,
}

/// `read_file`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadFileArgs {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
}

/// `apply_unified_diff`: all-or-nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApplyUnifiedDiffArgs {
    pub diff: String,
}

/// `list_tree`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListTreeArgs {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_depth: Option<u32>,
}

/// `search_files`: a regular expression over text files.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SearchFilesArgs {
    pub pattern: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// A glob on the path relative to the workspace, e.g. `**/*.rs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include: Option<String>,
}

/// What a step does, with its typed arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepAction {
    RunCommand(RunCommandArgs),
    WriteFile(WriteFileArgs),
    ReadFile(ReadFileArgs),
    ApplyUnifiedDiff(ApplyUnifiedDiffArgs),
    ListTree(ListTreeArgs),
    SearchFiles(SearchFilesArgs),
}

impl StepAction {
    /// The wire type of this action.
    pub fn step_type(&self) -> StepType {
        match self {
            StepAction::RunCommand(_) => StepType::RunCommand,
            StepAction::WriteFile(_) => StepType::WriteFile,
            StepAction::ReadFile(_) => StepType::ReadFile,
            StepAction::ApplyUnifiedDiff(_) => StepType::ApplyUnifiedDiff,
            StepAction::ListTree(_) => StepType::ListTree,
            StepAction::SearchFiles(_) => StepType::SearchFiles,
        }
    }

    fn arguments_value(&self) -> Result<serde_json::Value, serde_json::Error> {
        match self {
            StepAction::RunCommand(a) => serde_json::to_value(a),
            StepAction::WriteFile(a) => serde_json::to_value(a),
            StepAction::ReadFile(a) => serde_json::to_value(a),
            StepAction::ApplyUnifiedDiff(a) => serde_json::to_value(a),
            StepAction::ListTree(a) => serde_json::to_value(a),
            StepAction::SearchFiles(a) => serde_json::to_value(a),
        }
    }

    /// Parses `arguments` for a step of type `ty`, reporting paths relative to the step.
    pub fn from_arguments(
        ty: StepType,
        arguments: serde_json::Value,
    ) -> Result<Self, ValidationError> {
        fn typed<T: serde::de::DeserializeOwned>(
            v: serde_json::Value,
        ) -> Result<T, ValidationError> {
            serde_path_to_error::deserialize(v).map_err(|e| {
                let path = e.path().to_string();
                let path = if path == "." || path.is_empty() {
                    "arguments".to_string()
                } else {
                    format!("arguments.{path}")
                };
                ValidationError::new(path, e.into_inner().to_string())
            })
        }
        Ok(match ty {
            StepType::RunCommand => StepAction::RunCommand(typed(arguments)?),
            StepType::WriteFile => StepAction::WriteFile(typed(arguments)?),
            StepType::ReadFile => StepAction::ReadFile(typed(arguments)?),
            StepType::ApplyUnifiedDiff => StepAction::ApplyUnifiedDiff(typed(arguments)?),
            StepType::ListTree => StepAction::ListTree(typed(arguments)?),
            StepType::SearchFiles => StepAction::SearchFiles(typed(arguments)?),
        })
    }
}

/// One step: `{ "id": "...", "type": "...", "arguments": { ... } }`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub id: String,
    pub action: StepAction,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StepWire {
    id: String,
    #[serde(rename = "type")]
    ty: StepType,
    #[serde(default = "empty_object")]
    arguments: serde_json::Value,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(serde_json::Map::new())
}

impl Serialize for Step {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let arguments = self
            .action
            .arguments_value()
            .map_err(serde::ser::Error::custom)?;
        StepWire {
            id: self.id.clone(),
            ty: self.action.step_type(),
            arguments,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Step {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let wire = StepWire::deserialize(d)?;
        let action = StepAction::from_arguments(wire.ty, wire.arguments).map_err(|e| {
            serde::de::Error::custom(ValidationError::nested_message(&e.path, &e.message))
        })?;
        Ok(Step {
            id: wire.id,
            action,
        })
    }
}

/// Reads `steps` in either form (see the module doc), numbering upstream-form steps.
mod either_form {
    use std::fmt;

    use serde::de::{DeserializeSeed, SeqAccess, Visitor};
    use serde::Deserialize;

    use super::upstream_form::{self, UpstreamStep};
    use super::Step;
    use crate::error::ValidationError;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Form {
        Ours,
        Upstream,
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Step>, D::Error> {
        d.deserialize_seq(Steps)
    }

    struct Steps;

    impl<'de> Visitor<'de> for Steps {
        type Value = Vec<Step>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a list of steps")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Step>, A::Error> {
            let mut out = Vec::new();
            let mut form = None;
            while let Some((step, f)) = seq.next_element_seed(One {
                index: out.len(),
                form,
            })? {
                form = Some(f);
                out.push(step);
            }
            Ok(out)
        }
    }

    struct One {
        index: usize,
        form: Option<Form>,
    }

    impl<'de> DeserializeSeed<'de> for One {
        type Value = (Step, Form);

        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(Step, Form), D::Error> {
            use serde::de::Error;
            let map = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
            let form = if map.contains_key("id") || map.contains_key("arguments") {
                Form::Ours
            } else {
                Form::Upstream
            };
            if let Some(first) = self.form.filter(|f| *f != form) {
                let (this, that) = match first {
                    Form::Ours => ("{id, type, arguments}", "upstream's {type, args}"),
                    Form::Upstream => ("upstream's {type, args}", "{id, type, arguments}"),
                };
                return Err(D::Error::custom(ValidationError::nested_message(
                    "",
                    &format!("this step is in {that} form but the job's first step is in {this} form: use one form per job"),
                )));
            }
            let value = serde_json::Value::Object(map);
            let step = match form {
                Form::Ours => serde_path_to_error::deserialize::<_, Step>(value)
                    .map_err(|e| D::Error::custom(ValidationError::from_serde(e).relative()))?,
                Form::Upstream => {
                    let up: UpstreamStep = serde_path_to_error::deserialize(value)
                        .map_err(|e| D::Error::custom(ValidationError::from_serde(e).relative()))?;
                    let action = up
                        .into_action()
                        .map_err(|e| D::Error::custom(e.relative()))?;
                    Step {
                        id: upstream_form::step_id(self.index),
                        action,
                    }
                }
            };
            Ok((step, form))
        }
    }
}

impl JsonSchema for Step {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Step".into()
    }

    fn json_schema(g: &mut SchemaGenerator) -> Schema {
        let variants = [
            (StepType::RunCommand, g.subschema_for::<RunCommandArgs>()),
            (StepType::WriteFile, g.subschema_for::<WriteFileArgs>()),
            (StepType::ReadFile, g.subschema_for::<ReadFileArgs>()),
            (
                StepType::ApplyUnifiedDiff,
                g.subschema_for::<ApplyUnifiedDiffArgs>(),
            ),
            (StepType::ListTree, g.subschema_for::<ListTreeArgs>()),
            (StepType::SearchFiles, g.subschema_for::<SearchFilesArgs>()),
        ];
        let mut one_of: Vec<serde_json::Value> = variants
            .into_iter()
            .map(|(ty, args)| {
                serde_json::json!({
                    "type": "object",
                    "additionalProperties": false,
                    "required": ["id", "type", "arguments"],
                    "properties": {
                        "id": { "type": "string", "minLength": 1 },
                        "type": { "const": ty.as_str() },
                        "arguments": args,
                    }
                })
            })
            .collect();
        // Upstream CyNodeAI's form (one form per job; ids are assigned by position).
        one_of.extend(
            upstream_form::args_schemas(g)
                .into_iter()
                .map(|(ty, args)| {
                    serde_json::json!({
                        "type": "object",
                        "additionalProperties": false,
                        "required": ["type"],
                        "properties": {
                            "type": { "const": ty.as_str() },
                            "args": args,
                        }
                    })
                }),
        );
        json_schema!({
            "description": "One step of a job: {id, type, arguments}, or upstream CyNodeAI's {type, args} (one form per job)",
            "oneOf": one_of
        })
    }
}

impl JobSpec {
    /// Parses and fully validates job.json bytes: the only way the runner reads a job.
    pub fn from_json(bytes: &[u8]) -> Result<JobSpec, ValidationErrors> {
        let job: JobSpec = parse_strict(bytes)?;
        job.validate()?;
        Ok(job)
    }

    /// The mode the runner uses: the explicit one, else `agent_inference` when there are
    /// no steps but an `inference` block, else `direct_steps`. A job with neither steps nor
    /// inference is valid (as upstream CyNodeAI has it): a job with nothing to do.
    pub fn effective_mode(&self) -> ExecutionMode {
        match self.execution_mode {
            Some(m) => m,
            None if self.steps.is_empty() && self.inference.is_some() => {
                ExecutionMode::AgentInference
            }
            None => ExecutionMode::DirectSteps,
        }
    }

    /// Semantic checks beyond the shape: versions, ids, limits, step arguments.
    pub fn validate(&self) -> Result<(), ValidationErrors> {
        let mut errs = Vec::new();
        if let Err(e) = version::check("protocol_version", &self.protocol_version) {
            errs.push(e);
        }
        non_empty(&mut errs, "job_id", &self.job_id);
        non_empty(&mut errs, "task_id", &self.task_id);
        if let Some(skill) = &self.skill_id {
            non_empty(&mut errs, "skill_id", skill);
        }
        let c = &self.constraints;
        if c.max_runtime_seconds == 0 {
            errs.push(ValidationError::new(
                "constraints.max_runtime_seconds",
                "must be positive",
            ));
        }
        if c.max_output_bytes == 0 {
            errs.push(ValidationError::new(
                "constraints.max_output_bytes",
                "must be positive",
            ));
        }
        if let Some(cmds) = &c.allowed_commands {
            for (i, cmd) in cmds.iter().enumerate() {
                non_empty(
                    &mut errs,
                    &format!("constraints.allowed_commands[{i}]"),
                    cmd,
                );
            }
        }
        if let Some(paths) = &c.allowed_paths {
            for (i, p) in paths.iter().enumerate() {
                non_empty(&mut errs, &format!("constraints.allowed_paths[{i}]"), p);
            }
        }
        for (i, glob) in self.artifacts.iter().enumerate() {
            no_nul(&mut errs, &format!("artifacts[{i}]"), glob);
            non_empty(&mut errs, &format!("artifacts[{i}]"), glob);
        }
        if self.effective_mode() == ExecutionMode::AgentInference {
            match &self.inference {
                Some(inf) if !inf.allowed_models.is_empty() => {
                    for (i, m) in inf.allowed_models.iter().enumerate() {
                        non_empty(&mut errs, &format!("inference.allowed_models[{i}]"), m);
                    }
                }
                _ => errs.push(ValidationError::new(
                    "inference.allowed_models",
                    "agent_inference needs at least one allowed model",
                )),
            }
        }
        if let Some(ctx) = &self.context {
            if ctx.mcp_tools.len() > MAX_MCP_TOOLS {
                errs.push(ValidationError::new(
                    "context.mcp_tools",
                    format!("at most {MAX_MCP_TOOLS} tools"),
                ));
            }
            let mut listed = HashSet::new();
            for (i, t) in ctx.mcp_tools.iter().enumerate() {
                if !listed.insert(t.as_str()) {
                    errs.push(ValidationError::new(
                        format!("context.mcp_tools[{i}]"),
                        "listed twice",
                    ));
                }
                if !is_tool_name(t) {
                    errs.push(ValidationError::new(
                        format!("context.mcp_tools[{i}]"),
                        format!(
                            "`{t}` is not a tool name (1 to {MAX_TOOL_NAME} of A-Z a-z 0-9 . _ -)"
                        ),
                    ));
                }
            }
        }
        if self.execution_mode == Some(ExecutionMode::DirectSteps) && self.steps.is_empty() {
            errs.push(ValidationError::new(
                "steps",
                "direct_steps mode needs at least one step",
            ));
        }
        let mut seen = HashSet::new();
        for (i, step) in self.steps.iter().enumerate() {
            let at = format!("steps[{i}]");
            if step.id.trim().is_empty() {
                errs.push(ValidationError::new(
                    format!("{at}.id"),
                    "must not be empty",
                ));
            } else if !seen.insert(step.id.as_str()) {
                errs.push(ValidationError::new(
                    format!("{at}.id"),
                    format!("duplicate step id `{}`", step.id),
                ));
            }
            validate_action(&mut errs, &format!("{at}.arguments"), &step.action);
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ValidationErrors(errs))
        }
    }
}

fn non_empty(errs: &mut Vec<ValidationError>, path: &str, value: &str) {
    if value.trim().is_empty() {
        errs.push(ValidationError::new(path, "must not be empty"));
    }
}

fn no_nul(errs: &mut Vec<ValidationError>, path: &str, value: &str) {
    if value.contains('\0') {
        errs.push(ValidationError::new(path, "must not contain NUL bytes"));
    }
}

impl StepAction {
    /// The semantic checks a step's arguments get in [`JobSpec::validate`], for actions that
    /// arrive outside a job.json (the agent loop's model replies). `at` prefixes the paths.
    pub fn validate(&self, at: &str) -> Result<(), ValidationErrors> {
        let mut errs = Vec::new();
        validate_action(&mut errs, at, self);
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ValidationErrors(errs))
        }
    }
}

fn validate_action(errs: &mut Vec<ValidationError>, at: &str, action: &StepAction) {
    match action {
        StepAction::RunCommand(a) => {
            non_empty(errs, &format!("{at}.command"), &a.command);
            no_nul(errs, &format!("{at}.command"), &a.command);
            for (i, arg) in a.args.iter().enumerate() {
                no_nul(errs, &format!("{at}.args[{i}]"), arg);
            }
            for (k, v) in &a.env {
                if k.is_empty() || k.contains('=') || k.contains('\0') {
                    errs.push(ValidationError::new(
                        format!("{at}.env"),
                        format!("invalid variable name `{k}`"),
                    ));
                }
                no_nul(errs, &format!("{at}.env.{k}"), v);
            }
            if let Some(wd) = &a.working_dir {
                no_nul(errs, &format!("{at}.working_dir"), wd);
            }
            if a.timeout_seconds == Some(0) {
                errs.push(ValidationError::new(
                    format!("{at}.timeout_seconds"),
                    "must be positive",
                ));
            }
        }
        StepAction::WriteFile(a) => {
            path_arg(errs, &format!("{at}.path"), &a.path);
            if let Some(mode) = &a.mode {
                if let Err(msg) = parse_mode(mode) {
                    errs.push(ValidationError::new(format!("{at}.mode"), msg));
                }
            }
        }
        StepAction::ReadFile(a) => {
            path_arg(errs, &format!("{at}.path"), &a.path);
            if a.max_bytes == Some(0) {
                errs.push(ValidationError::new(
                    format!("{at}.max_bytes"),
                    "must be positive",
                ));
            }
        }
        StepAction::ApplyUnifiedDiff(a) => {
            non_empty(errs, &format!("{at}.diff"), &a.diff);
        }
        StepAction::ListTree(a) => {
            if let Some(p) = &a.path {
                no_nul(errs, &format!("{at}.path"), p);
            }
        }
        StepAction::SearchFiles(a) => {
            non_empty(errs, &format!("{at}.pattern"), &a.pattern);
            if let Some(p) = &a.path {
                no_nul(errs, &format!("{at}.path"), p);
            }
        }
    }
}

fn path_arg(errs: &mut Vec<ValidationError>, at: &str, path: &str) {
    non_empty(errs, at, path);
    no_nul(errs, at, path);
}

/// A file mode that is not octal permission bits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ModeError(String);

impl From<ModeError> for String {
    fn from(e: ModeError) -> String {
        e.0
    }
}

/// Parses a file mode string such as `"0644"` or `"755"`; only permission bits are allowed.
pub fn parse_mode(mode: &str) -> Result<u32, ModeError> {
    let digits = mode.strip_prefix("0o").unwrap_or(mode);
    if digits.is_empty() || digits.len() > 4 || !digits.bytes().all(|b| (b'0'..=b'7').contains(&b))
    {
        return Err(ModeError(format!(
            "invalid mode `{mode}`: expected octal such as \"0644\""
        )));
    }
    let value = u32::from_str_radix(digits, 8)
        .map_err(|e| ModeError(format!("invalid mode `{mode}`: {e}")))?;
    if value & !0o777 != 0 {
        return Err(ModeError(format!(
            "mode `{mode}` sets setuid, setgid or sticky bits"
        )));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> serde_json::Value {
        serde_json::json!({
            "protocol_version": "1.0",
            "job_id": "j1",
            "task_id": "t1",
            "constraints": { "max_runtime_seconds": 30, "max_output_bytes": 1024 },
            "steps": [ { "id": "s1", "type": "run_command", "arguments": { "command": "true" } } ]
        })
    }

    fn parse(v: &serde_json::Value) -> Result<JobSpec, ValidationErrors> {
        JobSpec::from_json(serde_json::to_vec(v).unwrap().as_slice())
    }

    fn first_error(v: &serde_json::Value) -> ValidationError {
        parse(v).unwrap_err().0.remove(0)
    }

    #[test]
    fn parses_minimal_job() {
        let job = parse(&base()).unwrap();
        assert_eq!(
            job.steps,
            vec![Step {
                id: "s1".into(),
                action: StepAction::RunCommand(RunCommandArgs {
                    command: "true".into(),
                    ..Default::default()
                })
            }]
        );
        assert_eq!(job.effective_mode(), ExecutionMode::DirectSteps);
    }

    #[test]
    fn mcp_tools_are_few_and_each_listed_once() {
        let mut v = base();
        v["context"] = serde_json::json!({ "mcp_tools": ["skills.get", "artifact.put"] });
        assert!(parse(&v).is_ok());
        v["context"]["mcp_tools"] = serde_json::json!(["skills.get", "skills.get"]);
        let e = first_error(&v);
        assert_eq!(e.path, "context.mcp_tools[1]", "{e:?}");
        let many: Vec<String> = (0..=MAX_MCP_TOOLS).map(|i| format!("help.t{i}")).collect();
        v["context"]["mcp_tools"] = serde_json::json!(many);
        assert_eq!(first_error(&v).path, "context.mcp_tools");
        v["context"]["mcp_tools"] = serde_json::json!(many[..MAX_MCP_TOOLS]);
        assert!(parse(&v).is_ok());
    }

    #[test]
    fn round_trips_through_json() {
        let job = parse(&base()).unwrap();
        let again = JobSpec::from_json(&serde_json::to_vec(&job).unwrap()).unwrap();
        assert_eq!(job, again);
    }

    #[test]
    fn major_99_names_protocol_version() {
        let mut v = base();
        v["protocol_version"] = "99.0".into();
        assert_eq!(first_error(&v).path, "protocol_version");
    }

    #[test]
    fn empty_job_id_names_job_id() {
        let mut v = base();
        v["job_id"] = "".into();
        assert_eq!(
            first_error(&v),
            ValidationError::new("job_id", "must not be empty")
        );
    }

    #[test]
    fn zero_runtime_names_constraint() {
        let mut v = base();
        v["constraints"]["max_runtime_seconds"] = 0.into();
        assert_eq!(
            first_error(&v),
            ValidationError::new("constraints.max_runtime_seconds", "must be positive")
        );
    }

    #[test]
    fn unknown_top_level_field_rejected() {
        let mut v = base();
        v["surprise"] = true.into();
        let e = first_error(&v);
        assert_eq!(e.path, "surprise");
        assert!(e.message.starts_with("unknown field `surprise`"), "{e}");
    }

    #[test]
    fn unknown_argument_field_names_full_path() {
        let mut v = base();
        v["steps"][0]["arguments"]["shell"] = true.into();
        let e = first_error(&v);
        assert_eq!(e.path, "steps[0].arguments.shell");
        assert!(e.message.starts_with("unknown field `shell`"), "{e}");
    }

    #[test]
    fn missing_argument_names_step() {
        let mut v = base();
        v["steps"][0]["arguments"] = serde_json::json!({});
        let e = first_error(&v);
        assert_eq!(e.path, "steps[0].arguments");
        assert_eq!(e.message, "missing field `command`");
    }

    #[test]
    fn wrong_type_in_arguments_names_field() {
        let mut v = base();
        v["steps"][0]["arguments"]["args"] = serde_json::json!([1]);
        let e = first_error(&v);
        assert_eq!(e.path, "steps[0].arguments.args[0]");
    }

    #[test]
    fn duplicate_step_ids_rejected() {
        let mut v = base();
        let step = v["steps"][0].clone();
        v["steps"].as_array_mut().unwrap().push(step);
        assert_eq!(
            first_error(&v),
            ValidationError::new("steps[1].id", "duplicate step id `s1`")
        );
    }

    #[test]
    fn network_allowed_alias_is_read() {
        let mut v = base();
        v["constraints"]["network_allowed"] = true.into();
        assert!(parse(&v).unwrap().constraints.ext_net_allowed);
    }

    #[test]
    fn preferences_and_skills_are_free_form() {
        let mut v = base();
        v["context"] = serde_json::json!({
            "task_context": "x",
            "preferences": { "anything": { "goes": [1, 2] } },
            "skills": { "also": "free" }
        });
        parse(&v).unwrap();
        v["context"]["unknown"] = 1.into();
        let e = first_error(&v);
        assert_eq!(e.path, "context.unknown");
    }

    #[test]
    fn unknown_step_type_names_type() {
        let mut v = base();
        v["steps"][0]["type"] = "launch_missiles".into();
        let e = first_error(&v);
        assert_eq!(e.path, "steps[0].type");
    }

    #[test]
    fn collects_several_semantic_errors() {
        let mut v = base();
        v["job_id"] = "".into();
        v["task_id"] = " ".into();
        v["constraints"]["max_output_bytes"] = 0.into();
        let errs = parse(&v).unwrap_err();
        let paths: Vec<_> = errs.0.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["job_id", "task_id", "constraints.max_output_bytes"]);
    }

    #[test]
    fn modes_parse() {
        assert_eq!(parse_mode("0644"), Ok(0o644));
        assert_eq!(parse_mode("755"), Ok(0o755));
        assert!(parse_mode("4755").is_err());
        assert!(parse_mode("0999").is_err());
        assert!(parse_mode("").is_err());
    }

    #[test]
    fn no_steps_means_agent_mode_with_inference_and_nothing_to_do_without() {
        let mut v = base();
        v["steps"] = serde_json::json!([]);
        // Upstream CyNodeAI: `steps: []` without `inference` is a job with nothing to do.
        assert_eq!(
            parse(&v).unwrap().effective_mode(),
            ExecutionMode::DirectSteps
        );
        v["inference"] = serde_json::json!({ "allowed_models": [] });
        assert_eq!(
            first_error(&v),
            ValidationError::new(
                "inference.allowed_models",
                "agent_inference needs at least one allowed model"
            )
        );
        v["inference"] = serde_json::json!({ "allowed_models": ["smollm2"] });
        assert_eq!(
            parse(&v).unwrap().effective_mode(),
            ExecutionMode::AgentInference
        );
        v["execution_mode"] = "direct_steps".into();
        assert_eq!(first_error(&v).path, "steps");
    }

    #[test]
    fn upstream_form_steps_get_ids_by_position() {
        let mut v = base();
        v["steps"] = serde_json::json!([
            { "type": "run_command", "args": { "argv": ["echo", "ok"] } },
            { "type": "write_file", "args": { "path": "/out.txt", "content": "x" } },
            { "type": "list_tree" }
        ]);
        let job = parse(&v).unwrap();
        let ids: Vec<&str> = job.steps.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, ["step-1", "step-2", "step-3"]);
        assert_eq!(
            job.steps[1].action,
            StepAction::WriteFile(WriteFileArgs {
                path: "out.txt".into(),
                content: "x".into(),
                ..Default::default()
            })
        );
    }

    #[test]
    fn upstream_form_is_strict_and_not_mixed() {
        let mut v = base();
        v["steps"] =
            serde_json::json!([{ "type": "run_command", "args": { "argv": ["x"], "env": {} } }]);
        let e = first_error(&v);
        assert_eq!(e.path, "steps[0].args.env");
        assert!(e.message.starts_with("unknown field `env`"), "{e}");
        v["steps"] = serde_json::json!([{ "type": "run_command", "args": { "argv": [] } }]);
        assert_eq!(
            first_error(&v),
            ValidationError::new("steps[0].args.argv", "must not be empty")
        );
        v["steps"] =
            serde_json::json!([{ "type": "read_file", "args": { "path": "a" }, "extra": 1 }]);
        assert_eq!(first_error(&v).path, "steps[0].extra");
        v["steps"] = serde_json::json!([
            { "id": "a", "type": "read_file", "arguments": { "path": "a" } },
            { "type": "read_file", "args": { "path": "b" } }
        ]);
        let e = first_error(&v);
        assert_eq!(e.path, "steps[1]");
        assert!(e.message.contains("use one form per job"), "{e}");
    }

    #[test]
    fn a_job_goes_to_upstream_with_only_upstreams_fields() {
        let mut v = base();
        v["skill_id"] = "go-test".into();
        v["artifacts"] = serde_json::json!(["out/**"]);
        v["constraints"]["allowed_commands"] = serde_json::json!(["true"]);
        v["context"] = serde_json::json!({ "task_context": "t", "preferences": { "n": 3 } });
        let up = parse(&v).unwrap().to_upstream().unwrap();
        assert_eq!(
            up,
            serde_json::json!({
                "protocol_version": "1.0", "job_id": "j1", "task_id": "t1",
                "constraints": { "max_runtime_seconds": 30, "max_output_bytes": 1024 },
                "steps": [ { "type": "run_command", "args": { "argv": ["true"] } } ],
                "context": { "task_context": "t", "preferences": { "n": "3" } }
            })
        );
        // And it reads back as the same steps (ids by position).
        let again = JobSpec::from_json(&serde_json::to_vec(&up).unwrap()).unwrap();
        assert_eq!(again.steps[0].action, parse(&v).unwrap().steps[0].action);
    }
}
