//! The model's output contract (design.md §3.5) as a JSON Schema built from the live skill
//! registry, and the validator every reply goes through before the PM acts on it.
//!
//! The schema ([`response_schema`]) is what the client sends as `response_format`, so a
//! backend with grammar-constrained decoding (llama.cpp, vLLM, Ollama) can only produce
//! replies of this shape. It is an `anyOf` with one object per reply type, and one per
//! skill for `job_request`, so the payload is tied to `type` and `inputs` to `skill_id`
//! (the grammar-friendly form of "if skill_id then inputs"). `state_patch` operations are
//! spelled out per target (a plan entry, a field of one, a note…) so only patches that
//! keep the session state well-formed fit.
//!
//! The validator ([`ReplyValidator`], [`validate_reply`]) runs, in order: JSON parse; the
//! JSON Schema (jsonschema); the structural and semantic checks, which name the first
//! problem precisely (an `anyOf` failure alone only says "matches none"); serde into
//! [`LlmOutput`] and its typed payload. The semantic checks: `state_patch` paths only
//! under `/plan` and `/notes`, values that fit a plan entry or a note, `job_request`'s
//! `skill_id` in the catalog, its `task_id` known or added by this reply's `state_patch`,
//! and `inputs` valid against that skill's own `inputs_schema` (the original one: the copy
//! inside the response schema drops bounds too large for a grammar). A [`ContractError`]
//! is written to be shown to the model so it can correct its reply.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use cynode_protocol::llm::LlmOutput;
use serde_json::{json, Map, Value};

use crate::skills::registry::CatalogEntry;

/// The `json_schema.name` sent in `response_format`.
pub const RESPONSE_SCHEMA_NAME: &str = "cynode_pm_reply";

/// Every `state_patch` path (and `from`) must match this: the plan, the notes, or below.
pub const PATCH_PATH_PATTERN: &str = "^/(plan|notes)(/.*)?$";

/// What a task id looks like (it ends up in job ids and job.json).
pub const TASK_ID_PATTERN: &str = "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$";

/// The reply types, in the order the system prompt lists them.
pub const REPLY_TYPES: [&str; 4] = ["plan_update", "job_request", "message", "final"];

/// The statuses of a plan entry (`cynode_protocol::session::TaskStatus`).
pub const TASK_STATUSES: [&str; 5] = ["pending", "in_progress", "done", "failed", "blocked"];

/// At most this many `state_patch` operations per reply (a bound a grammar can enforce, so
/// a small model cannot loop in the list until it runs out of tokens).
pub const MAX_PATCH_OPS: usize = 10;
/// At most this many entries when the whole plan is set at once.
pub const MAX_PLAN_ENTRIES: usize = 50;
/// At most this many notes when the whole notes list is set at once.
pub const MAX_NOTES: usize = 100;
/// At most this many artifacts in a `final` reply.
pub const MAX_ARTIFACTS: usize = 100;
/// Length bounds (in characters) of the free-text fields. They are tight on purpose: a
/// grammar-constrained backend must close the string within the bound, so a small model
/// that starts repeating itself ends its sentence instead of running into max_tokens
/// (SmolLM2 did, in a 2000-character summary). Details belong in artifacts.
/// The note of a plan_update is the loop's most wasted text: SmolLM2-135M filled all 300
/// characters it once had with one repeated clause, on every plan-only turn.
pub const DESCRIPTION_MAX: usize = 200;
pub const NOTE_MAX: usize = 160;
pub const TEXT_MAX: usize = 500;
pub const SUMMARY_MAX: usize = 800;
pub const ARTIFACT_REF_MAX: usize = 128;

/// Bounds above this are dropped from the skill schemas embedded in the response schema:
/// grammar engines expand `{0,N}` into N rules. The skill's own schema still enforces them.
const GRAMMAR_BOUND_LIMIT: u64 = 1024;

/// At most this many schema errors are reported at once.
const MAX_REPORTED_ERRORS: usize = 5;

/// A JSON array index in a pointer: `0` or no leading zero.
const INDEX: &str = "(0|[1-9][0-9]*)";

/// Why a reply breaks the contract. The `Display` text is fed back to the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContractError {
    /// Nothing but whitespace came back.
    #[error("the reply is empty{}; answer with one JSON object", finish_reason.as_ref().map(|r| format!(" (finish_reason: {r})")).unwrap_or_default())]
    Empty { finish_reason: Option<String> },
    /// The reply does not parse as JSON.
    #[error("the reply is not valid JSON ({0}); answer with one JSON object and nothing else")]
    NotJson(String),
    /// The reply ran into the token limit before its JSON was complete.
    #[error("your reply was cut off after {max_tokens} tokens before the JSON was complete; reply again much shorter: one short sentence per text field and as few state_patch operations as possible")]
    Truncated { max_tokens: u32 },
    /// A field is missing, unknown, of the wrong type or out of range.
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
    /// A `state_patch` operation targets something other than the plan or the notes.
    #[error("state_patch[{index}].{field}: `{pointer}` is outside the plan and notes; only /plan, /notes and paths below them may be patched")]
    ForbiddenPatchPath {
        index: usize,
        field: String,
        pointer: String,
    },
    /// `job_request` names a skill that is not registered.
    #[error("payload.skill_id: unknown skill `{skill_id}`; known skills: {}", known.join(", "))]
    UnknownSkill {
        skill_id: String,
        known: Vec<String>,
    },
    /// `job_request` names a task that is neither in the plan nor added by this reply.
    #[error(
        "payload.task_id: unknown task `{task_id}`; {}",
        known_tasks_hint(known)
    )]
    UnknownTask { task_id: String, known: Vec<String> },
    /// `job_request.inputs` do not validate against the skill's input schema.
    #[error("payload.inputs do not match the input schema of skill `{skill_id}`: {}", errors.join("; "))]
    InvalidInputs {
        skill_id: String,
        errors: Vec<String>,
    },
    /// The reply breaks the response schema in a way the checks above do not name.
    #[error("the reply does not match the response schema: {}", errors.join("; "))]
    Schema { errors: Vec<String> },
    /// A check of the caller's refused the reply (e.g. its `state_patch` does not apply
    /// to the current state).
    #[error("{0}")]
    Rejected(String),
    /// A schema given to the validator does not compile (a PM bug, not the model's).
    #[error("{which} is not a valid JSON Schema: {message}")]
    InvalidSchema { which: String, message: String },
}

impl ContractError {
    /// True when asking the model again (with this error) may give a valid reply; false for
    /// the PM's own mistakes.
    pub fn is_retryable(&self) -> bool {
        match self {
            ContractError::Empty { .. }
            | ContractError::Truncated { .. }
            | ContractError::NotJson(_)
            | ContractError::Invalid { .. }
            | ContractError::ForbiddenPatchPath { .. }
            | ContractError::UnknownSkill { .. }
            | ContractError::UnknownTask { .. }
            | ContractError::InvalidInputs { .. }
            | ContractError::Schema { .. }
            | ContractError::Rejected(_) => true,
            ContractError::InvalidSchema { .. } => false,
        }
    }
}

fn known_tasks_hint(known: &[String]) -> String {
    if known.is_empty() {
        "the plan has no tasks yet: add the task to /plan in this reply's state_patch \
         ({\"op\": \"add\", \"path\": \"/plan/-\", \"value\": {\"task_id\": \"t1\", \
         \"description\": \"…\", \"status\": \"pending\"}})"
            .to_string()
    } else {
        format!(
            "known tasks: {}; a new task must be added to /plan in this reply's state_patch",
            known.join(", ")
        )
    }
}

fn invalid(path: impl Into<String>, message: impl Into<String>) -> ContractError {
    ContractError::Invalid {
        path: path.into(),
        message: message.into(),
    }
}

// ---------------------------------------------------------------------------------------
// The response schema
// ---------------------------------------------------------------------------------------

/// The JSON Schema of one reply, built from the skill catalog. `task_ids` (the plan's) are
/// named in the `task_id` descriptions; the schema cannot enumerate them because a reply
/// may add a task and request a job for it at once. `state_patch` and the plan entry are
/// `$defs` so a grammar engine builds their rules once.
pub fn response_schema(catalog: &[CatalogEntry], task_ids: &[String]) -> Value {
    response_schema_for(catalog, task_ids, &REPLY_TYPES)
}

/// [`response_schema`] limited to the reply types in `kinds` (a subset of
/// [`REPLY_TYPES`]): the loop's progress guard drops `plan_update` for a turn after too
/// many plan-only replies in a row, so a grammar-constrained model has to act.
pub fn response_schema_for(catalog: &[CatalogEntry], task_ids: &[String], kinds: &[&str]) -> Value {
    let task_desc = if task_ids.is_empty() {
        "the task_id of a plan entry added by this reply's state_patch".to_string()
    } else {
        format!(
            "the task_id of a plan entry: one of {} or one added by this reply's state_patch",
            task_ids.join(", ")
        )
    };
    let mut variants = vec![variant(
        "plan_update",
        object(&[("note", bounded_string(0, NOTE_MAX))], &[]),
    )];
    if !catalog.is_empty() {
        let payloads: Vec<Value> = catalog
            .iter()
            .map(|c| {
                object(
                    &[
                        ("task_id", task_id_schema(&task_desc)),
                        ("skill_id", json!({ "type": "string", "const": c.skill_id })),
                        ("inputs", grammar_friendly(&c.inputs_schema)),
                    ],
                    &["task_id", "skill_id", "inputs"],
                )
            })
            .collect();
        let payload = if payloads.len() == 1 {
            payloads.into_iter().next().unwrap_or(Value::Null)
        } else {
            json!({ "anyOf": payloads })
        };
        variants.push(variant("job_request", payload));
    }
    variants.push(variant(
        "message",
        object(&[("text", bounded_string(1, TEXT_MAX))], &["text"]),
    ));
    variants.push(variant(
        "final",
        object(
            &[
                ("summary", bounded_string(1, SUMMARY_MAX)),
                (
                    "artifacts",
                    json!({ "type": "array", "maxItems": MAX_ARTIFACTS,
                            "items": bounded_string(1, ARTIFACT_REF_MAX) }),
                ),
            ],
            &["summary"],
        ),
    ));
    variants.retain(|v| {
        v["properties"]["type"]["const"]
            .as_str()
            .is_some_and(|k| kinds.contains(&k))
    });
    json!({
        "title": RESPONSE_SCHEMA_NAME,
        "description": "one reply of the CyNode PM planner: {type, state_patch, payload}",
        "type": "object",
        "anyOf": variants,
        "$defs": {
            "state_patch": state_patch_schema(),
            "plan_entry": plan_entry_schema(),
        },
    })
}

/// `{type: <const>, state_patch, payload}`, nothing else.
fn variant(kind: &str, payload: Value) -> Value {
    object(
        &[
            ("type", json!({ "type": "string", "const": kind })),
            ("state_patch", json!({ "$ref": "#/$defs/state_patch" })),
            ("payload", payload),
        ],
        &["type", "state_patch", "payload"],
    )
}

fn bounded_string(min: usize, max: usize) -> Value {
    json!({ "type": "string", "minLength": min, "maxLength": max })
}

/// A closed object schema.
fn object(props: &[(&str, Value)], required: &[&str]) -> Value {
    let properties: Map<String, Value> = props
        .iter()
        .map(|(k, v)| ((*k).to_string(), v.clone()))
        .collect();
    json!({
        "type": "object",
        "additionalProperties": false,
        "required": required,
        "properties": properties,
    })
}

fn task_id_schema(description: &str) -> Value {
    json!({ "type": "string", "pattern": TASK_ID_PATTERN, "description": description })
}

fn plan_entry_schema() -> Value {
    object(
        &[
            (
                "task_id",
                task_id_schema("a short unique id for this task, e.g. t1"),
            ),
            ("description", bounded_string(1, DESCRIPTION_MAX)),
            ("status", json!({ "type": "string", "enum": TASK_STATUSES })),
            ("version", json!({ "type": "integer", "minimum": 0 })),
        ],
        &["task_id", "description", "status"],
    )
}

/// The value a patch may put at a plan entry field.
fn plan_field_schema(field: &str) -> Value {
    match field {
        "description" => bounded_string(1, DESCRIPTION_MAX),
        _ => json!({ "type": "string", "enum": TASK_STATUSES }),
    }
}

const PLAN_FIELDS: [&str; 4] = ["task_id", "description", "status", "version"];

/// The fields of a plan entry a patch may change one by one: a task's id names it (in
/// attempts, jobs and history) and its version is the PM's.
const PATCHABLE_FIELDS: [&str; 2] = ["description", "status"];

/// One closed patch operation schema.
fn op(ops: &[&str], members: &[(&str, Value)]) -> Value {
    let mut props: Vec<(&str, Value)> = vec![("op", json!({ "type": "string", "enum": ops }))];
    props.extend(members.iter().cloned());
    let required: Vec<&str> = props.iter().map(|(k, _)| *k).collect();
    object(&props, &required)
}

fn pat(p: String) -> Value {
    json!({ "type": "string", "pattern": p })
}

/// RFC 6902 operations restricted to what keeps the plan and notes well-formed.
fn state_patch_schema() -> Value {
    let entry = json!({ "$ref": "#/$defs/plan_entry" });
    let note = bounded_string(0, NOTE_MAX);
    let mut ops = vec![
        // The whole plan or the whole notes list.
        op(
            &["add", "replace"],
            &[
                ("path", json!({ "type": "string", "const": "/plan" })),
                (
                    "value",
                    json!({ "type": "array", "maxItems": MAX_PLAN_ENTRIES, "items": entry.clone() }),
                ),
            ],
        ),
        op(
            &["add", "replace"],
            &[
                ("path", json!({ "type": "string", "const": "/notes" })),
                (
                    "value",
                    json!({ "type": "array", "maxItems": MAX_NOTES, "items": note.clone() }),
                ),
            ],
        ),
        // One entry.
        op(
            &["add"],
            &[
                ("path", pat(format!("^/plan/(-|{INDEX})$"))),
                ("value", entry.clone()),
            ],
        ),
        op(
            &["replace"],
            &[("path", pat(format!("^/plan/{INDEX}$"))), ("value", entry)],
        ),
        op(
            &["add"],
            &[
                ("path", pat(format!("^/notes/(-|{INDEX})$"))),
                ("value", note.clone()),
            ],
        ),
        op(
            &["replace"],
            &[("path", pat(format!("^/notes/{INDEX}$"))), ("value", note)],
        ),
        op(
            &["remove"],
            &[("path", pat(format!("^/(plan|notes)/{INDEX}$")))],
        ),
        // Reordering.
        op(
            &["move"],
            &[
                ("from", pat(format!("^/plan/{INDEX}$"))),
                ("path", pat(format!("^/plan/(-|{INDEX})$"))),
            ],
        ),
        op(
            &["move", "copy"],
            &[
                ("from", pat(format!("^/notes/{INDEX}$"))),
                ("path", pat(format!("^/notes/(-|{INDEX})$"))),
            ],
        ),
        op(
            &["test"],
            &[
                ("path", pat(PATCH_PATH_PATTERN.to_string())),
                ("value", json!({})),
            ],
        ),
    ];
    // One field of an entry.
    for field in PATCHABLE_FIELDS {
        ops.push(op(
            &["add", "replace"],
            &[
                ("path", pat(format!("^/plan/{INDEX}/{field}$"))),
                ("value", plan_field_schema(field)),
            ],
        ));
    }
    json!({
        "type": "array",
        "description": "RFC 6902 operations on /plan and /notes only; [] for no change",
        "maxItems": MAX_PATCH_OPS,
        "items": { "anyOf": ops },
    })
}

/// A copy of a skill's input schema a grammar engine can use: no `$schema`/`$id`/`format`,
/// no length or count bound above [`GRAMMAR_BOUND_LIMIT`], no unanchored `pattern`; a
/// schema with `$ref` becomes `{type: object}` (its references would not resolve once
/// embedded). The original schema is still enforced by [`ReplyValidator`].
fn grammar_friendly(schema: &Value) -> Value {
    if contains_ref(schema) {
        return json!({ "type": "object" });
    }
    strip_schema(schema)
}

fn contains_ref(v: &Value) -> bool {
    match v {
        Value::Object(m) => m.iter().any(|(k, v)| k == "$ref" || contains_ref(v)),
        Value::Array(a) => a.iter().any(contains_ref),
        _ => false,
    }
}

/// Strips one schema, recursing only into keywords that hold subschemas (so a property
/// named `pattern` or `format` is kept).
fn strip_schema(schema: &Value) -> Value {
    let Value::Object(map) = schema else {
        return schema.clone();
    };
    let mut out = Map::new();
    for (k, v) in map {
        let kept = match k.as_str() {
            "$schema" | "$id" | "$comment" | "format" => None,
            "maxLength" | "minLength" | "maxItems" | "minItems" | "maxProperties"
            | "minProperties"
                if v.as_u64().is_some_and(|n| n > GRAMMAR_BOUND_LIMIT) =>
            {
                None
            }
            "pattern" => v
                .as_str()
                .filter(|p| p.starts_with('^') && p.ends_with('$'))
                .map(|_| v.clone()),
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                Some(match v {
                    Value::Object(m) => Value::Object(
                        m.iter()
                            .map(|(name, s)| (name.clone(), strip_schema(s)))
                            .collect(),
                    ),
                    other => other.clone(),
                })
            }
            "items"
            | "additionalProperties"
            | "additionalItems"
            | "not"
            | "if"
            | "then"
            | "else"
            | "contains"
            | "propertyNames"
            | "unevaluatedProperties"
            | "unevaluatedItems" => Some(match v {
                Value::Array(a) => Value::Array(a.iter().map(strip_schema).collect()),
                other => strip_schema(other),
            }),
            "allOf" | "anyOf" | "oneOf" | "prefixItems" => Some(match v {
                Value::Array(a) => Value::Array(a.iter().map(strip_schema).collect()),
                other => other.clone(),
            }),
            _ => Some(v.clone()),
        };
        if let Some(v) = kept {
            out.insert(k.clone(), v);
        }
    }
    Value::Object(out)
}

// ---------------------------------------------------------------------------------------
// The validator
// ---------------------------------------------------------------------------------------

/// A compiled response schema plus each skill's compiled input schema; reuse it for the
/// retries of one turn.
pub struct ReplyValidator {
    full: jsonschema::Validator,
    skills: BTreeMap<String, jsonschema::Validator>,
}

impl fmt::Debug for ReplyValidator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplyValidator")
            .field("skills", &self.skills.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl ReplyValidator {
    /// Compiles `schema` (normally [`response_schema`]'s) and every skill's input schema.
    pub fn new(schema: &Value, catalog: &[CatalogEntry]) -> Result<Self, ContractError> {
        let full = jsonschema::validator_for(schema).map_err(|e| ContractError::InvalidSchema {
            which: "the response schema".into(),
            message: e.to_string(),
        })?;
        let mut skills = BTreeMap::new();
        for c in catalog {
            let v = jsonschema::validator_for(&c.inputs_schema).map_err(|e| {
                ContractError::InvalidSchema {
                    which: format!("the inputs_schema of skill `{}`", c.skill_id),
                    message: e.to_string(),
                }
            })?;
            skills.insert(c.skill_id.clone(), v);
        }
        Ok(Self { full, skills })
    }

    /// Ids of the skills this validator accepts.
    pub fn skill_ids(&self) -> Vec<String> {
        self.skills.keys().cloned().collect()
    }

    /// Validates one raw reply (see the module doc for the order of checks).
    pub fn validate(
        &self,
        raw: &str,
        known_task_ids: &[String],
    ) -> Result<LlmOutput, ContractError> {
        let text = strip_fence(raw.trim());
        if text.is_empty() {
            return Err(ContractError::Empty {
                finish_reason: None,
            });
        }
        let value: Value =
            serde_json::from_str(text).map_err(|e| ContractError::NotJson(e.to_string()))?;
        let schema_errors: Vec<String> = self
            .full
            .iter_errors(&value)
            .take(MAX_REPORTED_ERRORS)
            .map(|e| {
                format!(
                    "{}: {e}",
                    pointer_to_path("", &e.instance_path().to_string())
                )
            })
            .collect();
        // Named, precise problems first; the schema's own messages only as a backstop.
        self.check_value(&value, known_task_ids)?;
        if !schema_errors.is_empty() {
            return Err(ContractError::Schema {
                errors: schema_errors,
            });
        }
        let out: LlmOutput =
            serde_json::from_value(value).map_err(|e| invalid("reply", e.to_string()))?;
        out.typed_payload()
            .map_err(|e| invalid(e.path, e.message))?;
        Ok(out)
    }

    /// The structural and semantic checks on a parsed reply; the first problem found.
    pub fn check_value(
        &self,
        reply: &Value,
        known_task_ids: &[String],
    ) -> Result<(), ContractError> {
        let obj = as_object("reply", reply)?;
        check_keys(
            "",
            obj,
            &["type", "state_patch", "payload"],
            &["type", "state_patch", "payload"],
            "a reply",
        )?;
        let kind = match obj.get("type") {
            Some(Value::String(s)) if REPLY_TYPES.contains(&s.as_str()) => s.as_str(),
            Some(other) => {
                return Err(invalid(
                    "type",
                    format!("must be one of {}; got {other}", REPLY_TYPES.join(", ")),
                ))
            }
            None => return Err(invalid("type", "missing")),
        };
        let mut tasks: BTreeSet<String> = known_task_ids.iter().cloned().collect();
        let patch = match obj.get("state_patch") {
            Some(Value::Array(a)) => a,
            _ => {
                return Err(invalid(
                    "state_patch",
                    "must be an array of RFC 6902 operations ([] for no change)",
                ))
            }
        };
        if patch.len() > MAX_PATCH_OPS {
            return Err(invalid(
                "state_patch",
                format!(
                    "at most {MAX_PATCH_OPS} operations in one reply; got {} (set a whole plan \
                     with one replace of /plan)",
                    patch.len()
                ),
            ));
        }
        for (i, op) in patch.iter().enumerate() {
            check_op(i, op, &mut tasks)?;
        }
        let payload = obj.get("payload").unwrap_or(&Value::Null);
        let payload = as_object("payload", payload)?;
        match kind {
            "plan_update" => {
                check_keys("payload", payload, &["note"], &[], "a plan_update")?;
                check_string("payload.note", payload.get("note"), false, NOTE_MAX)?;
            }
            "message" => {
                check_keys("payload", payload, &["text"], &["text"], "a message")?;
                check_string("payload.text", payload.get("text"), true, TEXT_MAX)?;
            }
            "final" => {
                check_keys(
                    "payload",
                    payload,
                    &["summary", "artifacts"],
                    &["summary"],
                    "a final reply",
                )?;
                check_string("payload.summary", payload.get("summary"), true, SUMMARY_MAX)?;
                if let Some(a) = payload.get("artifacts") {
                    let items = a.as_array().ok_or_else(|| {
                        invalid(
                            "payload.artifacts",
                            format!("must be an array of sha256 strings; got {}", kind_of(a)),
                        )
                    })?;
                    if items.len() > MAX_ARTIFACTS {
                        return Err(invalid(
                            "payload.artifacts",
                            format!("at most {MAX_ARTIFACTS} artifacts; got {}", items.len()),
                        ));
                    }
                    for (j, item) in items.iter().enumerate() {
                        check_string(
                            &format!("payload.artifacts[{j}]"),
                            Some(item),
                            true,
                            ARTIFACT_REF_MAX,
                        )?;
                    }
                }
            }
            _ => self.check_job_request(payload, &tasks)?,
        }
        Ok(())
    }

    fn check_job_request(
        &self,
        payload: &Map<String, Value>,
        tasks: &BTreeSet<String>,
    ) -> Result<(), ContractError> {
        check_keys(
            "payload",
            payload,
            &["task_id", "skill_id", "inputs"],
            &["task_id", "skill_id", "inputs"],
            "a job_request",
        )?;
        let task_id = check_task_id("payload.task_id", payload.get("task_id"))?;
        let skill_id = match payload.get("skill_id") {
            Some(Value::String(s)) => s,
            Some(other) => {
                return Err(invalid(
                    "payload.skill_id",
                    format!("must be a string; got {}", kind_of(other)),
                ))
            }
            None => return Err(invalid("payload.skill_id", "missing")),
        };
        let Some(validator) = self.skills.get(skill_id) else {
            return Err(ContractError::UnknownSkill {
                skill_id: skill_id.clone(),
                known: self.skill_ids(),
            });
        };
        if !tasks.contains(task_id) {
            return Err(ContractError::UnknownTask {
                task_id: task_id.to_string(),
                known: tasks.iter().cloned().collect(),
            });
        }
        let inputs = payload.get("inputs").unwrap_or(&Value::Null);
        let errors: Vec<String> = validator
            .iter_errors(inputs)
            .take(MAX_REPORTED_ERRORS)
            .map(|e| {
                format!(
                    "{}: {e}",
                    pointer_to_path("payload.inputs", &e.instance_path().to_string())
                )
            })
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ContractError::InvalidInputs {
                skill_id: skill_id.clone(),
                errors,
            })
        }
    }
}

/// Parses, schema-checks and semantically checks one reply (compiles the schemas each call:
/// use [`ReplyValidator`] to validate several replies against the same schema).
pub fn validate_reply(
    raw: &str,
    schema: &Value,
    known_task_ids: &[String],
    catalog: &[CatalogEntry],
) -> Result<LlmOutput, ContractError> {
    ReplyValidator::new(schema, catalog)?.validate(raw, known_task_ids)
}

/// A reply wrapped in a Markdown code fence (models without constrained decoding do that)
/// is unwrapped; anything else is returned as is.
fn strip_fence(text: &str) -> &str {
    let Some(rest) = text.strip_prefix("```") else {
        return text;
    };
    let Some(body) = rest.strip_suffix("```") else {
        return text;
    };
    // Drop the info string (`json`) on the opening line.
    match body.find('\n') {
        Some(i) => body[i + 1..].trim(),
        None => body.trim(),
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn as_object<'a>(path: &str, v: &'a Value) -> Result<&'a Map<String, Value>, ContractError> {
    v.as_object()
        .ok_or_else(|| invalid(path, format!("must be a JSON object; got {}", kind_of(v))))
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// Unknown keys first (they usually explain a missing one), then missing required keys.
fn check_keys(
    prefix: &str,
    obj: &Map<String, Value>,
    allowed: &[&str],
    required: &[&str],
    what: &str,
) -> Result<(), ContractError> {
    if let Some(k) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        let allowed = if allowed.is_empty() {
            "none".to_string()
        } else {
            allowed.join(", ")
        };
        return Err(invalid(
            join(prefix, k),
            format!("unknown field; the fields of {what} are: {allowed}"),
        ));
    }
    if let Some(k) = required.iter().find(|k| !obj.contains_key(**k)) {
        return Err(invalid(
            join(prefix, k),
            format!("missing (required in {what})"),
        ));
    }
    Ok(())
}

fn check_string(
    path: &str,
    v: Option<&Value>,
    non_empty: bool,
    max_chars: usize,
) -> Result<(), ContractError> {
    match v {
        None => Ok(()),
        Some(Value::String(s)) if non_empty && s.trim().is_empty() => {
            Err(invalid(path, "must not be empty"))
        }
        Some(Value::String(s)) if s.chars().count() > max_chars => Err(invalid(
            path,
            format!(
                "too long: {} characters, at most {max_chars}",
                s.chars().count()
            ),
        )),
        Some(Value::String(_)) => Ok(()),
        Some(other) => Err(invalid(
            path,
            format!("must be a string; got {}", kind_of(other)),
        )),
    }
}

fn is_task_id(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && s.len() <= 64
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

fn check_task_id<'a>(path: &str, v: Option<&'a Value>) -> Result<&'a str, ContractError> {
    match v {
        Some(Value::String(s)) if is_task_id(s) => Ok(s),
        Some(Value::String(s)) => Err(invalid(
            path,
            format!("`{s}` is not a task id: 1 to 64 of A-Z a-z 0-9 . _ -, starting with a letter or digit"),
        )),
        Some(other) => Err(invalid(
            path,
            format!("must be a string; got {}", kind_of(other)),
        )),
        None => Err(invalid(path, "missing")),
    }
}

/// Checks one plan entry; returns its task id.
fn check_entry<'a>(path: &str, v: &'a Value) -> Result<&'a str, ContractError> {
    let obj = as_object(path, v)?;
    check_keys(
        path,
        obj,
        &PLAN_FIELDS,
        &["task_id", "description", "status"],
        "a plan entry",
    )?;
    for field in PLAN_FIELDS {
        if let Some(fv) = obj.get(field) {
            check_plan_field(&join(path, field), field, fv)?;
        }
    }
    check_task_id(&join(path, "task_id"), obj.get("task_id"))
}

fn check_plan_field(path: &str, field: &str, v: &Value) -> Result<(), ContractError> {
    match field {
        "task_id" => check_task_id(path, Some(v)).map(|_| ()),
        "description" => check_string(path, Some(v), true, DESCRIPTION_MAX),
        "status" => match v.as_str() {
            Some(s) if TASK_STATUSES.contains(&s) => Ok(()),
            _ => Err(invalid(
                path,
                format!("must be one of {}; got {v}", TASK_STATUSES.join(", ")),
            )),
        },
        _ => match v.as_u64() {
            Some(_) => Ok(()),
            None => Err(invalid(
                path,
                format!("must be a non-negative integer; got {v}"),
            )),
        },
    }
}

/// What a patch pointer designates.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    PlanAll,
    /// `/plan/N` (`end` for `/plan/-`).
    PlanEntry {
        end: bool,
    },
    PlanField(String),
    NotesAll,
    NoteEntry {
        end: bool,
    },
}

fn is_index(s: &str) -> bool {
    s == "0" || (!s.is_empty() && !s.starts_with('0') && s.bytes().all(|b| b.is_ascii_digit()))
}

/// Classifies a pointer already known to be under /plan or /notes.
fn classify(pointer: &str) -> Result<Target, String> {
    let segs: Vec<&str> = pointer.split('/').skip(1).collect();
    let entry = |s: &str| -> Result<bool, String> {
        if s == "-" {
            Ok(true)
        } else if is_index(s) {
            Ok(false)
        } else {
            Err(format!(
                "`{s}` is not a list index (0, 1, … or - for the end of the list)"
            ))
        }
    };
    match segs.as_slice() {
        ["plan"] => Ok(Target::PlanAll),
        ["notes"] => Ok(Target::NotesAll),
        ["plan", i] => Ok(Target::PlanEntry { end: entry(i)? }),
        ["notes", i] => Ok(Target::NoteEntry { end: entry(i)? }),
        ["plan", i, field] => {
            if entry(i)? {
                return Err("`-` (the end of the list) has no fields".into());
            }
            if PATCHABLE_FIELDS.contains(field) {
                Ok(Target::PlanField((*field).to_string()))
            } else if *field == "task_id" {
                Err("a task's task_id cannot be changed: add a new task instead".into())
            } else if *field == "version" {
                Err("a plan entry's version is kept by the PM".into())
            } else {
                Err(format!(
                    "a plan entry has no field `{field}`; its fields are: {}",
                    PLAN_FIELDS.join(", ")
                ))
            }
        }
        ["notes", _, ..] => Err("a note is a string; it has no fields".into()),
        _ => Err(format!(
            "`{pointer}` goes below a field of a plan entry; patch the field itself (e.g. /plan/0/status)"
        )),
    }
}

fn in_scope(pointer: &str) -> bool {
    ["/plan", "/notes"].iter().any(|root| {
        pointer == *root
            || pointer
                .strip_prefix(root)
                .is_some_and(|rest| rest.starts_with('/'))
    })
}

/// Checks one `state_patch` operation; records the task ids it adds.
fn check_op(i: usize, op: &Value, tasks: &mut BTreeSet<String>) -> Result<(), ContractError> {
    let p = format!("state_patch[{i}]");
    let obj = as_object(&p, op)?;
    let name = match obj.get("op") {
        Some(Value::String(s)) => s.as_str(),
        Some(other) => {
            return Err(invalid(
                join(&p, "op"),
                format!("must be a string; got {}", kind_of(other)),
            ))
        }
        None => return Err(invalid(join(&p, "op"), "missing")),
    };
    let (allowed, what): (&[&str], _) = match name {
        "add" | "replace" | "test" => (&["op", "path", "value"], "an add, replace or test operation"),
        "remove" => (&["op", "path"], "a remove operation"),
        "move" | "copy" => (&["op", "from", "path"], "a move or copy operation"),
        other => {
            return Err(invalid(
                join(&p, "op"),
                format!("`{other}` is not an RFC 6902 operation; use add, remove, replace, move, copy or test"),
            ))
        }
    };
    check_keys(&p, obj, allowed, allowed, what)?;
    // A pointer under /plan or /notes; `test` may look anywhere there, the others only at
    // what a plan entry or a note is made of.
    let scoped = |field: &str| -> Result<String, ContractError> {
        let v = obj.get(field).unwrap_or(&Value::Null);
        let s = v.as_str().ok_or_else(|| {
            invalid(
                join(&p, field),
                format!("must be a JSON pointer string; got {}", kind_of(v)),
            )
        })?;
        if !in_scope(s) {
            return Err(ContractError::ForbiddenPatchPath {
                index: i,
                field: field.to_string(),
                pointer: s.to_string(),
            });
        }
        Ok(s.to_string())
    };
    let pointer = |field: &str| -> Result<(String, Target), ContractError> {
        let s = scoped(field)?;
        let target = classify(&s).map_err(|m| invalid(join(&p, field), m))?;
        Ok((s, target))
    };
    if name == "test" {
        scoped("path")?;
        return Ok(());
    }
    let (path, target) = pointer("path")?;
    let path_field = join(&p, "path");
    if matches!(
        target,
        Target::PlanEntry { end: true } | Target::NoteEntry { end: true }
    ) && name != "add"
        && name != "move"
        && name != "copy"
    {
        return Err(invalid(
            path_field,
            format!("`{path}`: `-` (the end of the list) only works with add, move and copy"),
        ));
    }
    let value_path = join(&p, "value");
    let value = obj.get("value").unwrap_or(&Value::Null);
    match name {
        "remove" => match target {
            Target::PlanEntry { .. } | Target::NoteEntry { .. } => Ok(()),
            Target::PlanAll | Target::NotesAll => Err(invalid(
                path_field,
                format!("`{path}` itself cannot be removed; remove single entries ({path}/0) or replace it with []"),
            )),
            Target::PlanField(_) => Err(invalid(
                path_field,
                "a field of a plan entry cannot be removed; replace it instead",
            )),
        },
        "move" | "copy" => {
            let (from, from_target) = pointer("from")?;
            let ok = match (&from_target, &target) {
                (Target::PlanEntry { end: false }, Target::PlanEntry { .. }) => name == "move",
                (Target::NoteEntry { end: false }, Target::NoteEntry { .. }) => true,
                _ => false,
            };
            if ok {
                Ok(())
            } else {
                Err(invalid(
                    join(&p, "from"),
                    format!("cannot {name} `{from}` to `{path}`: move only reorders whole entries within /plan or within /notes, and copy works only within /notes"),
                ))
            }
        }
        // add | replace
        _ => match target {
            Target::PlanAll => {
                let items = value.as_array().ok_or_else(|| {
                    invalid(&value_path, format!("/plan is a list of plan entries; got {}", kind_of(value)))
                })?;
                if items.len() > MAX_PLAN_ENTRIES {
                    return Err(invalid(
                        &value_path,
                        format!("at most {MAX_PLAN_ENTRIES} plan entries; got {}", items.len()),
                    ));
                }
                tasks.clear();
                for (j, item) in items.iter().enumerate() {
                    let id = check_entry(&format!("{value_path}[{j}]"), item)?;
                    if !tasks.insert(id.to_string()) {
                        return Err(invalid(
                            format!("{value_path}[{j}].task_id"),
                            format!("task `{id}` appears twice in the plan"),
                        ));
                    }
                }
                Ok(())
            }
            Target::PlanEntry { .. } => {
                // Adding a task that is already in the plan is not a contract error: the
                // reply's action stands, and its patch is refused as a whole when it is
                // applied, with the reason fed back (`driver::apply_state_patch`). Small
                // models re-add the first turn's task with every later reply; rejecting
                // the whole reply for it failed every session of SmolLM2-135M.
                let id = check_entry(&value_path, value)?;
                tasks.insert(id.to_string());
                Ok(())
            }
            Target::PlanField(field) => check_plan_field(&value_path, &field, value),
            Target::NotesAll => match value.as_array() {
                Some(items) => {
                    if items.len() > MAX_NOTES {
                        return Err(invalid(
                            &value_path,
                            format!("at most {MAX_NOTES} notes; got {}", items.len()),
                        ));
                    }
                    for (j, item) in items.iter().enumerate() {
                        check_string(&format!("{value_path}[{j}]"), Some(item), false, NOTE_MAX)?;
                    }
                    Ok(())
                }
                None => Err(invalid(
                    value_path,
                    format!("/notes is a list of strings; to add one note use the path /notes/-; got {}", kind_of(value)),
                )),
            },
            Target::NoteEntry { .. } => match value {
                Value::String(_) => check_string(&value_path, Some(value), false, NOTE_MAX),
                other => Err(invalid(
                    value_path,
                    format!("a note must be a string; got {}", kind_of(other)),
                )),
            },
        },
    }
}

/// `/files/0/path` under `payload.inputs` → `payload.inputs.files[0].path`.
fn pointer_to_path(prefix: &str, pointer: &str) -> String {
    let mut out = prefix.to_string();
    for seg in pointer.split('/').skip(1) {
        let seg = seg.replace("~1", "/").replace("~0", "~");
        if !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit()) {
            out.push_str(&format!("[{seg}]"));
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(&seg);
        }
    }
    if out.is_empty() {
        "reply".to_string()
    } else {
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog() -> Vec<CatalogEntry> {
        vec![CatalogEntry {
            skill_id: "search-code".into(),
            version: "1.0.0".into(),
            description: "search".into(),
            inputs_schema: json!({
                "type": "object", "additionalProperties": false, "required": ["pattern"],
                "properties": {
                    "pattern": { "type": "string", "minLength": 1, "maxLength": 100000 },
                    "format": { "type": "string", "pattern": "[a-z]+" }
                }
            }),
            first_look: false,
        }]
    }

    #[test]
    fn grammar_copy_keeps_property_names_and_drops_large_bounds() {
        let s = grammar_friendly(&catalog()[0].inputs_schema);
        assert_eq!(
            s,
            json!({
                "type": "object", "additionalProperties": false, "required": ["pattern"],
                "properties": {
                    "pattern": { "type": "string", "minLength": 1 },
                    "format": { "type": "string" }
                }
            })
        );
        assert_eq!(
            grammar_friendly(&json!({ "$ref": "#/$defs/x" })),
            json!({ "type": "object" })
        );
    }

    #[test]
    fn pointers_become_dotted_paths() {
        assert_eq!(
            pointer_to_path("payload.inputs", "/files/0/path"),
            "payload.inputs.files[0].path"
        );
        assert_eq!(pointer_to_path("", ""), "reply");
        assert_eq!(pointer_to_path("", "/a~1b"), "a/b");
    }

    #[test]
    fn fences_are_unwrapped() {
        assert_eq!(strip_fence("```json\n{\"a\":1}\n```"), "{\"a\":1}");
        assert_eq!(strip_fence("{}"), "{}");
    }

    #[test]
    fn classify_targets() {
        assert_eq!(classify("/plan"), Ok(Target::PlanAll));
        assert_eq!(classify("/plan/-"), Ok(Target::PlanEntry { end: true }));
        assert_eq!(
            classify("/plan/3/status"),
            Ok(Target::PlanField("status".into()))
        );
        assert!(classify("/plan/01").is_err());
        assert!(classify("/plan/0/owner").is_err());
        assert!(classify("/notes/0/x").is_err());
        assert!(
            in_scope("/plan")
                && in_scope("/notes/-")
                && !in_scope("/planx")
                && !in_scope("/objective")
        );
    }

    /// The schema and the checks agree on what a patch may be.
    #[test]
    fn schema_and_checks_agree_on_patches() {
        let cat = catalog();
        let schema = response_schema(&cat, &["t1".into()]);
        let v = ReplyValidator::new(&schema, &cat).unwrap();
        let entry = json!({ "task_id": "t2", "description": "d", "status": "pending" });
        let cases = [
            (
                json!({ "op": "add", "path": "/plan/-", "value": entry }),
                true,
            ),
            (
                json!({ "op": "add", "path": "/plan/0", "value": entry }),
                true,
            ),
            (
                json!({ "op": "replace", "path": "/plan/0", "value": entry }),
                true,
            ),
            (
                json!({ "op": "replace", "path": "/plan/-", "value": entry }),
                false,
            ),
            (
                json!({ "op": "replace", "path": "/plan", "value": [entry] }),
                true,
            ),
            (
                json!({ "op": "replace", "path": "/plan", "value": entry }),
                false,
            ),
            (
                json!({ "op": "replace", "path": "/plan/0/status", "value": "done" }),
                true,
            ),
            (
                json!({ "op": "replace", "path": "/plan/0/status", "value": "finished" }),
                false,
            ),
            (
                json!({ "op": "replace", "path": "/plan/0/version", "value": 2 }),
                false,
            ),
            (
                json!({ "op": "replace", "path": "/plan/0/task_id", "value": "t3" }),
                false,
            ),
            (
                json!({ "op": "replace", "path": "/plan/0/description", "value": "d2" }),
                true,
            ),
            (
                json!({ "op": "add", "path": "/plan/-", "value": { "task_id": "t2", "description": "d", "status": "done", "version": 1 } }),
                true,
            ),
            (
                json!({ "op": "add", "path": "/plan/-", "value": { "task_id": "t 2", "description": "d", "status": "done" } }),
                false,
            ),
            (
                json!({ "op": "add", "path": "/plan/-", "value": { "task_id": "t2", "description": "x".repeat(201), "status": "done" } }),
                false,
            ),
            (
                json!({ "op": "add", "path": "/notes/-", "value": "x".repeat(501) }),
                false,
            ),
            (
                json!({ "op": "replace", "path": "/plan/0/owner", "value": "x" }),
                false,
            ),
            (json!({ "op": "remove", "path": "/plan/1" }), true),
            (json!({ "op": "remove", "path": "/plan" }), false),
            (json!({ "op": "remove", "path": "/plan/0/status" }), false),
            (
                json!({ "op": "add", "path": "/notes/-", "value": "n" }),
                true,
            ),
            (
                json!({ "op": "add", "path": "/notes", "value": "n" }),
                false,
            ),
            (
                json!({ "op": "add", "path": "/notes", "value": ["n"] }),
                true,
            ),
            (
                json!({ "op": "add", "path": "/notes/-", "value": 3 }),
                false,
            ),
            (
                json!({ "op": "move", "from": "/plan/2", "path": "/plan/0" }),
                true,
            ),
            (
                json!({ "op": "copy", "from": "/plan/2", "path": "/plan/-" }),
                false,
            ),
            (
                json!({ "op": "copy", "from": "/notes/0", "path": "/notes/-" }),
                true,
            ),
            (
                json!({ "op": "move", "from": "/notes/0", "path": "/plan/-" }),
                false,
            ),
            (
                json!({ "op": "test", "path": "/plan/0/status", "value": "done" }),
                true,
            ),
            (
                json!({ "op": "add", "path": "/objective", "value": "x" }),
                false,
            ),
            (json!({ "op": "add", "path": "/plan/-" }), false),
            (
                json!({ "op": "add", "path": "/plan/-", "value": entry, "x": 1 }),
                false,
            ),
            (json!({ "op": "merge", "path": "/plan" }), false),
        ];
        for (op, ok) in cases {
            let reply = json!({ "type": "plan_update", "state_patch": [op], "payload": {} });
            let by_schema = jsonschema::is_valid(&schema, &reply);
            let by_checks = v.check_value(&reply, &["t1".into()]);
            assert_eq!(by_schema, ok, "schema on {op}");
            assert_eq!(by_checks.is_ok(), ok, "checks on {op}: {by_checks:?}");
        }
    }
}
