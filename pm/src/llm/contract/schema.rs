//! The response schema: one `anyOf` variant per reply type and per skill, `state_patch`
//! spelled out per target, and the grammar-friendly copy of each skill's inputs schema.

use serde_json::{json, Map, Value};

use crate::skills::registry::CatalogEntry;

use super::*;

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
pub(super) fn variant(kind: &str, payload: Value) -> Value {
    object(
        &[
            ("type", json!({ "type": "string", "const": kind })),
            ("state_patch", json!({ "$ref": "#/$defs/state_patch" })),
            ("payload", payload),
        ],
        &["type", "state_patch", "payload"],
    )
}

pub(super) fn bounded_string(min: usize, max: usize) -> Value {
    json!({ "type": "string", "minLength": min, "maxLength": max })
}

/// A closed object schema.
pub(super) fn object(props: &[(&str, Value)], required: &[&str]) -> Value {
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

pub(super) fn task_id_schema(description: &str) -> Value {
    json!({ "type": "string", "pattern": TASK_ID_PATTERN, "description": description })
}

pub(super) fn plan_entry_schema() -> Value {
    object(
        &[
            (
                "task_id",
                task_id_schema("a short unique id for this task, e.g. t1"),
            ),
            ("description", bounded_string(1, DESCRIPTION_MAX)),
            (
                "status",
                json!({ "type": "string", "enum": reply_task_statuses() }),
            ),
            ("version", json!({ "type": "integer", "minimum": 0 })),
            ("reason", bounded_string(1, REASON_MAX)),
        ],
        &["task_id", "description", "status"],
    )
}

/// The value a patch may put at a plan entry field.
pub(super) fn plan_field_schema(field: &str) -> Value {
    match field {
        "description" => bounded_string(1, DESCRIPTION_MAX),
        "reason" => bounded_string(1, REASON_MAX),
        _ => json!({ "type": "string", "enum": reply_task_statuses() }),
    }
}

pub(super) const PLAN_FIELDS: [&str; 5] = ["task_id", "description", "status", "version", "reason"];

/// The fields of a plan entry a patch may change one by one: a task's id names it (in
/// attempts, jobs and history) and its version is the PM's.
pub(super) const PATCHABLE_FIELDS: [&str; 3] = ["description", "status", "reason"];

/// One closed patch operation schema.
pub(super) fn op(ops: &[&str], members: &[(&str, Value)]) -> Value {
    let mut props: Vec<(&str, Value)> = vec![("op", json!({ "type": "string", "enum": ops }))];
    props.extend(members.iter().cloned());
    let required: Vec<&str> = props.iter().map(|(k, _)| *k).collect();
    object(&props, &required)
}

pub(super) fn pat(p: String) -> Value {
    json!({ "type": "string", "pattern": p })
}

/// RFC 6902 operations restricted to what keeps the plan and notes well-formed.
pub(super) fn state_patch_schema() -> Value {
    let entry = json!({ "$ref": "#/$defs/plan_entry" });
    let note = bounded_string(0, NOTE_MAX);
    let lists = [
        ("plan", entry, MAX_PLAN_ENTRIES),
        ("notes", note, MAX_NOTES),
    ];
    // The whole plan or the whole notes list.
    let whole = lists.iter().map(|(name, item, max)| {
        op(
            &["add", "replace"],
            &[
                (
                    "path",
                    json!({ "type": "string", "const": format!("/{name}") }),
                ),
                (
                    "value",
                    json!({ "type": "array", "maxItems": max, "items": item }),
                ),
            ],
        )
    });
    // One entry.
    let one = lists.iter().flat_map(|(name, item, _)| {
        [
            op(
                &["add"],
                &[
                    ("path", pat(format!("^/{name}/(-|{INDEX})$"))),
                    ("value", item.clone()),
                ],
            ),
            op(
                &["replace"],
                &[
                    ("path", pat(format!("^/{name}/{INDEX}$"))),
                    ("value", item.clone()),
                ],
            ),
        ]
    });
    let mut ops: Vec<Value> = whole.chain(one).collect();
    ops.extend([
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
    ]);
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
pub(super) fn grammar_friendly(schema: &Value) -> Value {
    if contains_ref(schema) {
        return json!({ "type": "object" });
    }
    strip_schema(schema)
}

pub(super) fn contains_ref(v: &Value) -> bool {
    match v {
        Value::Object(m) => m.iter().any(|(k, v)| k == "$ref" || contains_ref(v)),
        Value::Array(a) => a.iter().any(contains_ref),
        _ => false,
    }
}

/// Strips one schema, recursing only into keywords that hold subschemas (so a property
/// named `pattern` or `format` is kept).
pub(super) fn strip_schema(schema: &Value) -> Value {
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
