//! The model's action contract: the JSON Schema sent as `response_format` (so a server
//! with grammar-constrained decoding, such as llama.cpp or Ollama, can only produce a
//! well-formed reply, and small models that cannot call tools still work) and the strict
//! parser every reply goes through.
//!
//! A reply is `{"thought": "...", "action": {"type": T, "arguments": {...}}}` where `T` is
//! one of the six step types (arguments exactly as in job.json, parsed by the protocol
//! crate and checked like a job's steps), `tool_call` (`name`, `arguments`: a gateway
//! tool; offered in the schema only when the job lists tools in `context.mcp_tools`),
//! `todo` (`add`, `start`, `complete`, `reorder`), or `finish` (`status`, `final_answer`). The schema names the arguments a model needs;
//! the parser also accepts the rest of a step's job.json arguments (`env`, `mode`…).

use cynode_protocol::job::{ArgKind, StepAction, StepType, STEP_DEFS};
use cynode_protocol::{ValidationError, ValidationErrors};
use serde::Deserialize;
use serde_json::{json, Value};

/// Name of the schema in `response_format.json_schema.name`.
pub const SCHEMA_NAME: &str = "cynode_sba_action";

/// What the model asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Step(StepAction),
    /// A gateway tool: its name (checked against the job's list by the loop, not here)
    /// and its arguments (an object).
    ToolCall {
        name: String,
        arguments: Value,
    },
    Todo(TodoUpdate),
    Finish {
        success: bool,
        final_answer: String,
    },
}

/// A change to the todo list; applied all or nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TodoUpdate {
    /// Descriptions of new items, appended in order.
    pub add: Vec<String>,
    /// Ids to mark `in_progress`.
    pub start: Vec<String>,
    /// Ids to mark `done`.
    pub complete: Vec<String>,
    /// Ids to move to the front, in this order; the others keep their order after them.
    pub reorder: Vec<String>,
}

/// A parsed reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub thought: String,
    pub action: Action,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    #[serde(default)]
    thought: String,
    action: WireAction,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WireAction {
    #[serde(rename = "type")]
    ty: String,
    #[serde(default = "empty_object")]
    arguments: Value,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolCallArgs {
    name: String,
    #[serde(default = "empty_object")]
    arguments: Value,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FinishArgs {
    status: FinishStatus,
    final_answer: String,
}

#[derive(Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
enum FinishStatus {
    Success,
    Failure,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

/// Why a reply is not a valid action; its text says what to fix, for feeding back to the
/// model.
#[derive(Debug, thiserror::Error)]
pub enum ReplyError {
    #[error("not a valid reply: {0}")]
    NotJson(serde_json::Error),
    #[error("action.arguments: {0}")]
    Arguments(serde_json::Error),
    #[error("action.arguments: a todo action needs at least one of add, start, complete, reorder")]
    EmptyTodo,
    #[error("action.arguments.final_answer: must not be empty")]
    EmptyAnswer,
    #[error("action.arguments.name: `{0}` is not a tool name")]
    ToolName(String),
    #[error("action.arguments.arguments: must be an object")]
    ToolArguments,
    #[error("action.type: unknown action `{0}`; expected one of {list}", list = action_types().join(", "))]
    UnknownAction(String),
    #[error("action.{}: {}", .0.path, .0.message)]
    Step(ValidationError),
    #[error("{0}")]
    Invalid(ValidationErrors),
    /// The reply hit the completion token cap before it ended.
    #[error("the reply was cut off at max_tokens ({0}); reply with a shorter action")]
    CutOff(u32),
}

/// Parses and checks one reply.
pub fn parse(content: &str) -> Result<Reply, ReplyError> {
    let text = strip_fences(content.trim());
    let wire: Wire = serde_json::from_str(text).map_err(ReplyError::NotJson)?;
    let action = match wire.action.ty.as_str() {
        "todo" => {
            let upd: TodoUpdate =
                serde_json::from_value(wire.action.arguments).map_err(ReplyError::Arguments)?;
            if upd.add.is_empty()
                && upd.start.is_empty()
                && upd.complete.is_empty()
                && upd.reorder.is_empty()
            {
                return Err(ReplyError::EmptyTodo);
            }
            Action::Todo(upd)
        }
        "tool_call" => {
            let t: ToolCallArgs =
                serde_json::from_value(wire.action.arguments).map_err(ReplyError::Arguments)?;
            if !cynode_protocol::job::is_tool_name(&t.name) {
                return Err(ReplyError::ToolName(t.name));
            }
            if !t.arguments.is_object() {
                return Err(ReplyError::ToolArguments);
            }
            Action::ToolCall {
                name: t.name,
                arguments: t.arguments,
            }
        }
        "finish" => {
            let f: FinishArgs =
                serde_json::from_value(wire.action.arguments).map_err(ReplyError::Arguments)?;
            if f.final_answer.trim().is_empty() {
                return Err(ReplyError::EmptyAnswer);
            }
            Action::Finish {
                success: f.status == FinishStatus::Success,
                final_answer: f.final_answer,
            }
        }
        other => {
            let ty: StepType = serde_json::from_value(Value::String(other.to_string()))
                .map_err(|_| ReplyError::UnknownAction(other.to_string()))?;
            let step =
                StepAction::from_arguments(ty, wire.action.arguments).map_err(ReplyError::Step)?;
            step.validate("action.arguments")
                .map_err(ReplyError::Invalid)?;
            Action::Step(step)
        }
    };
    Ok(Reply {
        thought: wire.thought,
        action,
    })
}

/// Tolerates a reply wrapped in a Markdown code fence (servers without grammar support).
fn strip_fences(s: &str) -> &str {
    let Some(rest) = s.strip_prefix("```") else {
        return s;
    };
    let rest = rest.strip_prefix("json").unwrap_or(rest);
    rest.strip_suffix("```").unwrap_or(rest).trim()
}

/// The agent's own actions, after the step types ([`STEP_DEFS`]) in the prompt's order.
const OWN_ACTIONS: [&str; 3] = ["tool_call", "todo", "finish"];

/// Every action type, in the order the prompt lists them: the step types, then the
/// agent's own.
pub fn action_types() -> Vec<&'static str> {
    StepType::all()
        .map(StepType::as_str)
        .chain(OWN_ACTIONS)
        .collect()
}

/// One action's variant of the reply schema, its `arguments` described by `arguments`.
fn variant_of(ty: &str, arguments: Value) -> Value {
    json!({
        "type": "object",
        "properties": {
            "type": { "const": ty },
            "arguments": arguments
        },
        "required": ["type", "arguments"],
        "additionalProperties": false
    })
}

fn variant(ty: &str, properties: Value, required: &[&str]) -> Value {
    variant_of(
        ty,
        json!({
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": false
        }),
    )
}

/// The JSON Schema of a reply; `tool_call` is offered only when `tools` (the job's
/// `context.mcp_tools`) is not empty, with `name` one of them.
pub fn schema(tools: &[String]) -> Value {
    let s = ArgKind::Text.schema();
    let strings = ArgKind::TextList.schema();
    let mut variants: Vec<Value> = STEP_DEFS
        .iter()
        .map(|d| variant_of(d.ty.as_str(), d.agent_schema()))
        .collect();
    if !tools.is_empty() {
        variants.push(variant(
            "tool_call",
            json!({ "name": { "enum": tools }, "arguments": { "type": "object" } }),
            &["name", "arguments"],
        ));
    }
    variants.extend([
        variant(
            "todo",
            json!({ "add": strings, "start": strings, "complete": strings, "reorder": strings }),
            &[],
        ),
        variant(
            "finish",
            json!({ "status": { "enum": ["success", "failure"] }, "final_answer": s }),
            &["status", "final_answer"],
        ),
    ]);
    json!({
        "type": "object",
        "properties": {
            "thought": { "type": "string", "maxLength": 400 },
            "action": { "anyOf": variants }
        },
        "required": ["thought", "action"],
        "additionalProperties": false
    })
}

/// The `response_format` request field.
pub fn response_format(tools: &[String]) -> Value {
    json!({
        "type": "json_schema",
        "json_schema": { "name": SCHEMA_NAME, "strict": true, "schema": schema(tools) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cynode_protocol::job::{ReadFileArgs, WriteFileArgs};

    #[test]
    fn step_replies_parse_into_protocol_actions() {
        let r = parse(r#"{"thought":"t","action":{"type":"write_file","arguments":{"path":"a","content":"hi"}}}"#)
            .unwrap();
        assert_eq!(
            r,
            Reply {
                thought: "t".into(),
                action: Action::Step(StepAction::WriteFile(WriteFileArgs {
                    path: "a".into(),
                    content: "hi".into(),
                    ..Default::default()
                }))
            }
        );
        let r = parse("```json\n{\"thought\":\"\",\"action\":{\"type\":\"read_file\",\"arguments\":{\"path\":\"a\"}}}\n```").unwrap();
        assert_eq!(
            r.action,
            Action::Step(StepAction::ReadFile(ReadFileArgs {
                path: "a".into(),
                max_bytes: None
            }))
        );
    }

    #[test]
    fn bad_replies_say_what_to_fix() {
        let e = parse(r#"{"thought":"","action":{"type":"launch","arguments":{}}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("action.type: unknown action `launch`"), "{e}");
        let e = parse(r#"{"thought":"","action":{"type":"write_file","arguments":{"path":""}}}"#)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "action.arguments: missing field `content`");
        let e = parse(r#"{"thought":"","action":{"type":"read_file","arguments":{"path":""}}}"#)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "action.arguments.path: must not be empty");
        let e = parse(r#"{"thought":"","action":{"type":"todo","arguments":{}}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least one of"), "{e}");
        assert!(parse("hello")
            .unwrap_err()
            .to_string()
            .starts_with("not a valid reply"));
    }

    #[test]
    fn finish_and_todo_parse() {
        let r = parse(r#"{"thought":"","action":{"type":"finish","arguments":{"status":"success","final_answer":"done"}}}"#).unwrap();
        assert_eq!(
            r.action,
            Action::Finish {
                success: true,
                final_answer: "done".into()
            }
        );
        let r = parse(r#"{"thought":"","action":{"type":"todo","arguments":{"add":["x"],"complete":["r1"]}}}"#).unwrap();
        assert_eq!(
            r.action,
            Action::Todo(TodoUpdate {
                add: vec!["x".into()],
                complete: vec!["r1".into()],
                ..Default::default()
            })
        );
    }

    fn types(s: &Value) -> Vec<&str> {
        s["properties"]["action"]["anyOf"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["properties"]["type"]["const"].as_str().unwrap())
            .collect()
    }

    #[test]
    fn schema_lists_every_action_type() {
        let tools = vec!["skills.get".to_string()];
        let s = schema(&tools);
        assert_eq!(types(&s), action_types());
        let tool = &s["properties"]["action"]["anyOf"][6]["properties"]["arguments"];
        assert_eq!(tool["properties"]["name"]["enum"], json!(["skills.get"]));
        // A job listing no tools is not offered the action.
        let none = schema(&[]);
        assert!(!types(&none).contains(&"tool_call"));
        assert_eq!(types(&none).len(), action_types().len() - 1);
    }

    /// The step variants generated from the protocol's definitions are, byte for byte,
    /// the schema models are sent (what grammar-constrained decoding compiles).
    #[test]
    fn step_variants_are_generated_from_the_definitions_unchanged() {
        let s = json!({ "type": "string" });
        let strings = json!({ "type": "array", "items": { "type": "string" } });
        let count = json!({ "type": "integer", "minimum": 1 });
        let want = [
            variant(
                "write_file",
                json!({ "path": s, "content": s }),
                &["path", "content"],
            ),
            variant(
                "read_file",
                json!({ "path": s, "max_bytes": count }),
                &["path"],
            ),
            variant(
                "run_command",
                json!({ "command": s, "args": strings, "working_dir": s, "stdin": s, "timeout_seconds": count }),
                &["command", "args"],
            ),
            variant(
                "list_tree",
                json!({ "path": s, "max_depth": count }),
                &["path"],
            ),
            variant(
                "search_files",
                json!({ "pattern": s, "path": s, "include": s }),
                &["pattern"],
            ),
            variant("apply_unified_diff", json!({ "diff": s }), &["diff"]),
        ];
        let got = schema(&[]);
        assert_eq!(
            got["properties"]["action"]["anyOf"].as_array().unwrap()[..6],
            want
        );
    }

    #[test]
    fn tool_calls_parse_with_a_name_and_object_arguments() {
        let r = parse(r#"{"thought":"","action":{"type":"tool_call","arguments":{"name":"skills.get","arguments":{"skill_id":"x"}}}}"#).unwrap();
        assert_eq!(
            r.action,
            Action::ToolCall {
                name: "skills.get".into(),
                arguments: json!({ "skill_id": "x" })
            }
        );
        // Arguments default to {}; any well-formed name parses (the loop checks the list).
        let r = parse(
            r#"{"thought":"","action":{"type":"tool_call","arguments":{"name":"db.query"}}}"#,
        )
        .unwrap();
        assert_eq!(
            r.action,
            Action::ToolCall {
                name: "db.query".into(),
                arguments: json!({})
            }
        );
        for (bad, want) in [
            (r#"{"name":"a b"}"#, "is not a tool name"),
            (r#"{"name":""}"#, "is not a tool name"),
            (r#"{"name":"x","arguments":[1]}"#, "must be an object"),
            (r#"{"arguments":{}}"#, "missing field `name`"),
            (r#"{"name":"x","extra":1}"#, "unknown field `extra`"),
        ] {
            let e = parse(&format!(
                r#"{{"thought":"","action":{{"type":"tool_call","arguments":{bad}}}}}"#
            ))
            .unwrap_err()
            .to_string();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }
}
