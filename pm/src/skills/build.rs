//! The deterministic job builder: skill + inputs → canonical job.json.
//!
//! 1. Inputs are validated against the skill's input schema.
//! 2. The template renders with minijinja ([`super::template`]): every `{{ value }}`
//!    becomes one JSON value (a string is quoted and escaped), and escaping cannot be
//!    switched off (`|safe` and `{% autoescape %}` are refused). An input therefore lands
//!    as exactly one argv element or one file content; it can never close a string, add
//!    a step or splice into a shell command line (a template that tries to interpolate
//!    inside a string literal produces invalid JSON and fails to build). The render runs
//!    under a budget of instructions, output bytes and nesting.
//! 3. The PM's fields are set (`protocol_version`, `job_id`, `task_id`, `skill_id`); a
//!    template may not set them itself. The PM fills `context` from the session and the
//!    skill, and bounds it ([`super::context`]); a template may set only some of its
//!    fields.
//! 4. The result is serialised canonically (object keys sorted at every level, no
//!    whitespace) and validated with the protocol crate.
//!
//! Same skill version + same inputs + same (session, task, attempt) + same [`Brief`] ⇒
//! byte-identical bytes.

use cynode_protocol::job::JobSpec;
use serde_json::Value;
use uuid::Uuid;

use super::context::{self, Brief, SkillRef};
use super::registry::Skill;
use super::template::TemplateError;

/// Namespace of job ids: UUIDv5(namespace, "session/task/attempt").
pub const JOB_ID_NAMESPACE: Uuid = Uuid::from_u128(0x6a1f_3c2e_9b4d_4e8a_a5c7_0d2b_8e9f_1c34);

/// The deterministic job id of an attempt.
pub fn job_id(session_id: &str, task_id: &str, attempt: u32) -> Uuid {
    Uuid::new_v5(
        &JOB_ID_NAMESPACE,
        format!("{session_id}/{task_id}/{attempt}").as_bytes(),
    )
}

/// Who the job is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRef {
    pub session_id: String,
    pub task_id: String,
    pub attempt: u32,
}

/// A built job: the typed spec and its canonical bytes.
#[derive(Debug, Clone)]
pub struct BuiltJob {
    pub job: JobSpec,
    pub canonical: Vec<u8>,
    pub value: Value,
}

/// Why a job could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    #[error("inputs{path}: {message}")]
    Inputs { path: String, message: String },
    #[error("template {skill}: {message}")]
    Template { skill: String, message: String },
    /// The render went over its budget (instructions, output size or nesting).
    #[error("template {skill}: {message}")]
    Budget { skill: String, message: String },
    #[error("rendered job is not valid JSON at line {line} column {column}: {message}")]
    NotJson {
        line: usize,
        column: usize,
        message: String,
    },
    #[error("template {skill} sets `{field}`, which only the PM sets")]
    ReservedField { skill: String, field: String },
    #[error("rendered job is invalid: {0}")]
    Protocol(String),
}

/// Validates `inputs`, renders, and validates the job, outside any session: the context
/// names the skill, and the template's own fields.
pub fn build_job(skill: &Skill, inputs: &Value, r: &JobRef) -> Result<BuiltJob, BuildError> {
    build_job_in(skill, inputs, r, &Brief::default())
}

/// [`build_job`] for a job of a session: `brief` fills the context ([`super::context`]).
pub fn build_job_in(
    skill: &Skill,
    inputs: &Value,
    r: &JobRef,
    brief: &Brief,
) -> Result<BuiltJob, BuildError> {
    check_inputs(skill, inputs)?;
    let id = job_id(&r.session_id, &r.task_id, r.attempt).to_string();
    let ctx = serde_json::json!({
        "inputs": inputs,
        "job": { "job_id": id, "task_id": r.task_id, "session_id": r.session_id, "attempt": r.attempt },
        "skill": { "skill_id": skill.manifest.skill_id, "version": skill.manifest.version, "limits": skill.manifest.limits },
    });
    let text = render(skill, &ctx)?;
    let mut value: Value = serde_json::from_str(&text).map_err(|e| BuildError::NotJson {
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })?;
    let obj = value
        .as_object_mut()
        .ok_or_else(|| BuildError::Protocol(".: the job must be a JSON object".into()))?;
    for field in ["protocol_version", "job_id", "task_id", "skill_id"] {
        if obj.contains_key(field) {
            return Err(BuildError::ReservedField {
                skill: skill.manifest.skill_id.clone(),
                field: field.into(),
            });
        }
    }
    let template_ctx: cynode_protocol::job::JobContext = match obj.remove("context") {
        None => Default::default(),
        Some(v) => {
            if let Some(field) = context::PM_FIELDS
                .iter()
                .find(|f| v.get(**f).is_some_and(|x| !x.is_null()))
            {
                return Err(BuildError::ReservedField {
                    skill: skill.manifest.skill_id.clone(),
                    field: format!("context.{field}"),
                });
            }
            serde_json::from_value(v).map_err(|e| BuildError::Protocol(format!("context: {e}")))?
        }
    };
    let ctx = context::fill(
        template_ctx,
        brief,
        SkillRef {
            skill_id: &skill.manifest.skill_id,
            version: &skill.manifest.version,
            description: &skill.manifest.description,
        },
    );
    obj.insert("context".into(), context::to_value(&ctx));
    obj.insert(
        "protocol_version".into(),
        cynode_protocol::version::PROTOCOL_VERSION.into(),
    );
    obj.insert("job_id".into(), id.into());
    obj.insert("task_id".into(), r.task_id.clone().into());
    obj.insert("skill_id".into(), skill.manifest.skill_id.clone().into());
    if !obj.contains_key("constraints") {
        obj.insert(
            "constraints".into(),
            serde_json::json!({
                "max_runtime_seconds": skill.manifest.limits.max_runtime_seconds,
                "max_output_bytes": skill.manifest.limits.max_output_bytes,
                "allowed_commands": skill.manifest.allowed_commands,
                "allowed_paths": ["/workspace"],
            }),
        );
    }
    let value = canonicalize(value);
    let canonical = serde_json::to_vec(&value).map_err(|e| BuildError::Protocol(e.to_string()))?;
    let job = JobSpec::from_json(&canonical).map_err(|e| BuildError::Protocol(e.to_string()))?;
    Ok(BuiltJob {
        job,
        canonical,
        value,
    })
}

/// Inputs against the skill's schema; the first error with its JSON pointer.
pub fn check_inputs(skill: &Skill, inputs: &Value) -> Result<(), BuildError> {
    let validator = jsonschema::validator_for(&skill.manifest.inputs_schema).map_err(|e| {
        BuildError::Template {
            skill: skill.manifest.skill_id.clone(),
            message: format!("inputs_schema is not a valid schema: {e}"),
        }
    })?;
    if let Some(e) = validator.iter_errors(inputs).next() {
        let path = e.instance_path().to_string();
        return Err(BuildError::Inputs {
            path: if path.is_empty() { String::new() } else { path },
            message: e.to_string(),
        });
    }
    Ok(())
}

fn render(skill: &Skill, ctx: &Value) -> Result<String, BuildError> {
    super::template::render(&skill.template, ctx).map_err(|e| match &e {
        TemplateError::Budget(message) => BuildError::Budget {
            skill: skill.manifest.skill_id.clone(),
            message: message.clone(),
        },
        TemplateError::Unescaped { line, .. } => BuildError::Template {
            skill: skill.manifest.skill_id.clone(),
            message: format!("line {line}: {e}"),
        },
        TemplateError::Other(message) => BuildError::Template {
            skill: skill.manifest.skill_id.clone(),
            message: message.clone(),
        },
    })
}

/// Sorts object keys at every level, so the bytes depend only on the content.
pub fn canonicalize(v: Value) -> Value {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, canonicalize(v)))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.into_iter().map(canonicalize).collect()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids_are_deterministic_uuid_v5() {
        let a = job_id("s1", "t1", 0);
        assert_eq!(a, job_id("s1", "t1", 0));
        assert_ne!(a, job_id("s1", "t1", 1));
        assert_eq!(a.get_version_num(), 5);
    }

    #[test]
    fn canonical_order_is_sorted() {
        let v = serde_json::json!({ "b": 1, "a": { "d": 2, "c": 3 } });
        assert_eq!(
            serde_json::to_string(&canonicalize(v)).unwrap(),
            r#"{"a":{"c":3,"d":2},"b":1}"#
        );
    }
}
