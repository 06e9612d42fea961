//! What every MCP tool module shares: the error a tool call ends in ([`ToolError`]), a
//! tool's listing ([`ToolSpec`]), its closed input schema generated from the type that
//! parses its arguments ([`schema`]), and that parsing, naming the field at fault
//! ([`parse`]).

use rmcp::schemars::{self, JsonSchema};
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};

use crate::app::problem::Problem;

/// Why a tool call failed.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// No tool of that name: a protocol error (JSON-RPC invalid params).
    #[error("unknown tool `{0}`")]
    UnknownTool(String),
    /// Arguments that do not fit the tool's schema, naming the field: a protocol error.
    #[error("{0}")]
    BadArguments(String),
    /// The operation ran and was refused or failed (not found, conflict, forbidden…):
    /// a tool result with `isError` and the problem as its structured content.
    #[error("{}", .0 .0.detail.clone().unwrap_or_default())]
    Problem(Problem),
    /// A job that ran (or was refused) without success: a tool result with `isError`
    /// and `{"ok": false, "error": {kind, message, exit_code, path?, job?}}`.
    #[error("{0}")]
    Failed(Value),
}

impl From<Problem> for ToolError {
    fn from(p: Problem) -> Self {
        ToolError::Problem(p)
    }
}

/// One tool as `tools/list` shows it.
pub struct ToolSpec {
    pub name: &'static str,
    pub description: &'static str,
    pub input_schema: Map<String, Value>,
    /// The tool only reads.
    pub read_only: bool,
}

/// The listing of tool `name` whose arguments parse as `T`.
pub fn tool<T: JsonSchema>(
    name: &'static str,
    description: &'static str,
    read_only: bool,
) -> ToolSpec {
    ToolSpec {
        name,
        description,
        input_schema: schema::<T>(),
        read_only,
    }
}

/// The closed input schema of a tool whose arguments parse as `T`.
pub fn schema<T: JsonSchema>() -> Map<String, Value> {
    let mut v = serde_json::to_value(schemars::schema_for!(T)).unwrap_or(Value::Null);
    if let Some(o) = v.as_object_mut() {
        o.remove("$schema");
        o.remove("title");
        o.entry("type").or_insert(json!("object"));
        return o.clone();
    }
    Map::new()
}

/// Parses `args` for `tool`, naming the field at fault.
pub fn parse<T: DeserializeOwned>(tool: &str, args: &Map<String, Value>) -> Result<T, ToolError> {
    let v = Value::Object(args.clone());
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let at = if path == "." {
            String::new()
        } else {
            format!("{path}: ")
        };
        ToolError::BadArguments(format!("{tool}: {at}{}", e.inner()))
    })
}
