//! The validator: JSON parse, the compiled schema, then structural and semantic checks
//! that name the first problem precisely, then serde into [`LlmOutput`].

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use cynode_protocol::llm::LlmOutput;
use serde_json::{Map, Value};

use crate::skills::registry::CatalogEntry;

use super::fields::*;
use super::patch::check_op;
use super::*;

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
        const REPLY_KEYS: [&str; 3] = ["type", "state_patch", "payload"];
        check_keys("", obj, &REPLY_KEYS, &REPLY_KEYS, "a reply")?;
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
        check_prose(patch, payload)
    }

    fn check_job_request(
        &self,
        payload: &Map<String, Value>,
        tasks: &BTreeSet<String>,
    ) -> Result<(), ContractError> {
        const KEYS: [&str; 3] = ["task_id", "skill_id", "inputs"];
        check_keys("payload", payload, &KEYS, &KEYS, "a job_request")?;
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
pub(super) fn strip_fence(text: &str) -> &str {
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

/// `/files/0/path` under `payload.inputs` → `payload.inputs.files[0].path`.
pub(super) fn pointer_to_path(prefix: &str, pointer: &str) -> String {
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

/// The free texts of a reply (the payload's note, text or summary; the descriptions and
/// notes its state_patch writes) must not be babble ([`super::babble`]).
fn check_prose(patch: &[Value], payload: &Map<String, Value>) -> Result<(), ContractError> {
    let mut texts: Vec<(String, &str)> = Vec::new();
    for key in ["note", "text", "summary"] {
        if let Some(Value::String(t)) = payload.get(key) {
            texts.push((format!("payload.{key}"), t));
        }
    }
    for (i, op) in patch.iter().enumerate() {
        let at = format!("state_patch[{i}].value");
        match op.get("value") {
            Some(Value::String(t)) => texts.push((at, t)),
            Some(Value::Object(o)) => {
                for key in ["description", "reason"] {
                    if let Some(Value::String(t)) = o.get(key) {
                        texts.push((format!("{at}.{key}"), t));
                    }
                }
            }
            Some(Value::Array(items)) => {
                for (j, item) in items.iter().enumerate() {
                    match item {
                        Value::String(t) => texts.push((format!("{at}[{j}]"), t)),
                        Value::Object(o) => {
                            for key in ["description", "reason"] {
                                if let Some(Value::String(t)) = o.get(key) {
                                    texts.push((format!("{at}[{j}].{key}"), t));
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    for (path, text) in texts {
        if let Some(why) = super::babble::check(text) {
            return Err(ContractError::Babble { path, why });
        }
    }
    Ok(())
}
