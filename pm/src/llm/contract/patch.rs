//! `state_patch`: the one rule of what a patch may touch (only `/plan` and `/notes`, see
//! [`in_scope`]), the check of each operation against the shape of a plan entry or a
//! note, and its application to a session's state.

use std::collections::BTreeSet;

use cynode_protocol::llm::LlmOutput;
use serde_json::{json, Value};

use super::fields::*;
use super::schema::*;
use super::*;
use crate::session::SessionRecord;
use cynode_protocol::session::{PlanEntry, TaskStatus};

/// What a patch pointer designates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Target {
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

pub(super) fn is_index(s: &str) -> bool {
    s == "0" || (!s.is_empty() && !s.starts_with('0') && s.bytes().all(|b| b.is_ascii_digit()))
}

/// Classifies a pointer already known to be under /plan or /notes.
pub(super) fn classify(pointer: &str) -> Result<Target, String> {
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

pub(super) fn in_scope(pointer: &str) -> bool {
    ["/plan", "/notes"].iter().any(|root| {
        pointer == *root
            || pointer
                .strip_prefix(root)
                .is_some_and(|rest| rest.starts_with('/'))
    })
}

/// Checks one `state_patch` operation; records the task ids it adds.
pub(super) fn check_op(
    i: usize,
    op: &Value,
    tasks: &mut BTreeSet<String>,
) -> Result<(), ContractError> {
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

/// Why a patch that passed the contract could not be applied to this session's state (a
/// task id it adds twice, an index past the end); fed back to the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PatchError(pub String);

/// Applies the reply's RFC 6902 patch to `{plan, notes}` only; plan entries that change
/// get their version bumped, new ones start at 1.
pub fn apply_state_patch(rec: &mut SessionRecord, reply: &LlmOutput) -> Result<(), PatchError> {
    if reply.state_patch.is_empty() {
        return Ok(());
    }
    if let Some(op) = reply.state_patch.iter().find(|op| !in_scope(&op.path)) {
        return Err(PatchError(format!(
            "path {} is outside /plan and /notes",
            op.path
        )));
    }
    let before = rec.state.plan.clone();
    let mut doc = json!({ "plan": rec.state.plan, "notes": rec.state.notes });
    let patch: json_patch::Patch = serde_json::from_value(
        serde_json::to_value(&reply.state_patch).map_err(|e| PatchError(e.to_string()))?,
    )
    .map_err(|e| PatchError(e.to_string()))?;
    json_patch::patch(&mut doc, &patch).map_err(|e| PatchError(e.to_string()))?;
    let mut plan_values = doc["plan"].as_array().cloned().unwrap_or_default();
    for v in &mut plan_values {
        if let Some(o) = v.as_object_mut() {
            o.entry("status").or_insert(json!("pending"));
            o.entry("version").or_insert(json!(0));
        }
    }
    let mut plan: Vec<PlanEntry> = serde_json::from_value(Value::Array(plan_values))
        .map_err(|e| PatchError(format!("plan: {e}")))?;
    let notes: Vec<String> = serde_json::from_value(doc["notes"].clone())
        .map_err(|e| PatchError(format!("notes: {e}")))?;
    for p in &mut plan {
        match before.iter().find(|b| b.task_id == p.task_id) {
            Some(b) if b == p => {}
            Some(b) => p.version = b.version + 1,
            None => p.version = 1,
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(dup) = plan.iter().find(|p| !seen.insert(p.task_id.clone())) {
        return Err(PatchError(format!("duplicate task_id {}", dup.task_id)));
    }
    if let Some((i, p)) = plan.iter().enumerate().find(|(_, p)| {
        p.status == TaskStatus::Skipped && p.reason.as_deref().is_none_or(|r| r.trim().is_empty())
    }) {
        return Err(PatchError(format!(
            "/plan/{i}/reason: task {} is skipped without a reason; set its reason (one short sentence) in the same state_patch",
            p.task_id
        )));
    }
    rec.state.plan = plan;
    rec.state.notes = notes;
    Ok(())
}

/// A `final` must leave no task open: every plan entry done, failed or `skipped` (with
/// its `reason`) once the reply's own `state_patch` is applied to `rec`'s state (the state
/// as it is when that patch does not apply). Any other reply passes. The refusal names each open task by its JSON pointer and says how to
/// close it, so the model can run it or skip it explicitly on its next attempt.
pub fn check_final_closes_plan(
    rec: &SessionRecord,
    reply: &LlmOutput,
) -> Result<(), ContractError> {
    if reply.kind != cynode_protocol::llm::LlmOutputType::Final {
        return Ok(());
    }
    // A patch that does not apply is refused on its own when the reply is acted on (as
    // for any reply: small models re-add existing tasks); the plan is then judged as it is.
    let mut after = rec.clone();
    let unapplied = apply_state_patch(&mut after, reply).err();
    if unapplied.is_some() {
        after = rec.clone();
    }
    let open: Vec<String> = after
        .state
        .plan
        .iter()
        .enumerate()
        .filter(|(_, p)| {
            let status = serde_json::to_value(p.status).unwrap_or_default();
            OPEN_STATUSES.iter().any(|s| status == *s)
        })
        .map(|(i, p)| {
            let status = serde_json::to_value(p.status).unwrap_or_default();
            format!(
                "/plan/{i}/status ({}: {})",
                p.task_id,
                status.as_str().unwrap_or("")
            )
        })
        .collect();
    if open.is_empty() {
        return Ok(());
    }
    let unapplied = unapplied
        .map(|e| format!(" (this reply's state_patch does not apply: {e})"))
        .unwrap_or_default();
    Err(ContractError::Rejected(format!(
        "final refused: tasks still open at {}{unapplied}. Run them with job_request, or close each one in this reply's state_patch: {{\"op\": \"replace\", \"path\": \"/plan/N/status\", \"value\": \"skipped\"}} and {{\"op\": \"add\", \"path\": \"/plan/N/reason\", \"value\": \"why\"}}",
        open.join(", ")
    )))
}
