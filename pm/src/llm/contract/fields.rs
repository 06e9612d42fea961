//! The field checks both the reply validator and the `state_patch` rules use: a value's
//! kind, an object's keys, a bounded string, a task id, a plan entry and one of its fields.
//! Each failure is a [`ContractError`] that names the field's path.

use serde_json::{Map, Value};

use super::schema::PLAN_FIELDS;
use super::*;

pub(super) fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub(super) fn as_object<'a>(
    path: &str,
    v: &'a Value,
) -> Result<&'a Map<String, Value>, ContractError> {
    v.as_object()
        .ok_or_else(|| invalid(path, format!("must be a JSON object; got {}", kind_of(v))))
}

pub(super) fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// Unknown keys first (they usually explain a missing one), then missing required keys.
pub(super) fn check_keys(
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

pub(super) fn check_string(
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

pub(super) fn is_task_id(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && s.len() <= TASK_ID_MAX
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

pub(super) fn check_task_id<'a>(
    path: &str,
    v: Option<&'a Value>,
) -> Result<&'a str, ContractError> {
    match v {
        Some(Value::String(s)) if is_task_id(s) => Ok(s),
        Some(Value::String(s)) => Err(invalid(
            path,
            format!(
                "`{}` is not a task id: 1 to {TASK_ID_MAX} of A-Z a-z 0-9 . _ -, starting with a letter or digit (a short name such as t1 or fetch-deps)",
                clip_chars(s, TASK_ID_MAX + 8)
            ),
        )),
        Some(other) => Err(invalid(
            path,
            format!("must be a string; got {}", kind_of(other)),
        )),
        None => Err(invalid(path, "missing")),
    }
}

/// Checks one plan entry; returns its task id.
pub(super) fn check_entry<'a>(path: &str, v: &'a Value) -> Result<&'a str, ContractError> {
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
    if obj.get("status") == Some(&Value::String("skipped".into())) && !obj.contains_key("reason") {
        return Err(invalid(
            join(path, "reason"),
            "missing: a skipped task says why in its reason",
        ));
    }
    check_task_id(&join(path, "task_id"), obj.get("task_id"))
}

pub(super) fn check_plan_field(path: &str, field: &str, v: &Value) -> Result<(), ContractError> {
    match field {
        "task_id" => check_task_id(path, Some(v)).map(|_| ()),
        "description" => {
            check_string(path, Some(v), true, DESCRIPTION_MAX)?;
            check_one_line(path, v)
        }
        "reason" => {
            check_string(path, Some(v), true, REASON_MAX)?;
            check_one_line(path, v)
        }
        // Ours, or a seed's word that `TaskStatus` reads as ours; the plan is stored in
        // our words.
        "status" => match v.as_str() {
            Some(s) if TASK_STATUSES.contains(&s) || SEED_TASK_STATUSES.contains(&s) => Ok(()),
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

/// A task's description or reason is one line of text: no line breaks, tabs or other
/// control characters (it is printed as one progress line and one line of the report).
fn check_one_line(path: &str, v: &Value) -> Result<(), ContractError> {
    match v.as_str() {
        Some(s) if s.chars().any(char::is_control) => Err(invalid(
            path,
            "must be one line: no line breaks, tabs or other control characters",
        )),
        _ => Ok(()),
    }
}

/// At most `max` characters of `s`, with `…` when cut (an over-long value quoted back).
fn clip_chars(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}
