//! The contract's unit tests: schema and checks agree, classification, fences, paths.

use super::patch::*;
use super::schema::*;
use super::validate::*;
use crate::skills::registry::CatalogEntry;
use serde_json::json;

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
        in_scope("/plan") && in_scope("/notes/-") && !in_scope("/planx") && !in_scope("/objective")
    );
}

/// The schema and the checks agree on what a patch may be.
#[test]
fn schema_and_checks_agree_on_patches() {
    let cat = catalog();
    let schema = response_schema(&cat, &["t1".into()]);
    let v = ReplyValidator::new(&schema, &cat).unwrap();
    let entry = json!({ "task_id": "t2", "description": "d", "status": "pending" });
    let accepted = [
        json!({ "op": "add", "path": "/plan/-", "value": entry }),
        json!({ "op": "add", "path": "/plan/0", "value": entry }),
        json!({ "op": "replace", "path": "/plan/0", "value": entry }),
        json!({ "op": "replace", "path": "/plan", "value": [entry] }),
        json!({ "op": "replace", "path": "/plan/0/status", "value": "done" }),
        json!({ "op": "replace", "path": "/plan/0/description", "value": "d2" }),
        json!({ "op": "add", "path": "/plan/-", "value": { "task_id": "t2", "description": "d", "status": "done", "version": 1 } }),
        json!({ "op": "remove", "path": "/plan/1" }),
        json!({ "op": "add", "path": "/notes/-", "value": "n" }),
        json!({ "op": "add", "path": "/notes", "value": ["n"] }),
        json!({ "op": "move", "from": "/plan/2", "path": "/plan/0" }),
        json!({ "op": "copy", "from": "/notes/0", "path": "/notes/-" }),
        json!({ "op": "test", "path": "/plan/0/status", "value": "done" }),
    ];
    let refused = [
        json!({ "op": "replace", "path": "/plan/-", "value": entry }),
        json!({ "op": "replace", "path": "/plan", "value": entry }),
        json!({ "op": "replace", "path": "/plan/0/status", "value": "finished" }),
        json!({ "op": "replace", "path": "/plan/0/version", "value": 2 }),
        json!({ "op": "replace", "path": "/plan/0/task_id", "value": "t3" }),
        json!({ "op": "add", "path": "/plan/-", "value": { "task_id": "t 2", "description": "d", "status": "done" } }),
        json!({ "op": "add", "path": "/plan/-", "value": { "task_id": "t2", "description": "x".repeat(201), "status": "done" } }),
        json!({ "op": "add", "path": "/notes/-", "value": "x".repeat(501) }),
        json!({ "op": "replace", "path": "/plan/0/owner", "value": "x" }),
        json!({ "op": "remove", "path": "/plan" }),
        json!({ "op": "remove", "path": "/plan/0/status" }),
        json!({ "op": "add", "path": "/notes", "value": "n" }),
        json!({ "op": "add", "path": "/notes/-", "value": 3 }),
        json!({ "op": "copy", "from": "/plan/2", "path": "/plan/-" }),
        json!({ "op": "move", "from": "/notes/0", "path": "/plan/-" }),
        json!({ "op": "add", "path": "/objective", "value": "x" }),
        json!({ "op": "add", "path": "/plan/-" }),
        json!({ "op": "add", "path": "/plan/-", "value": entry, "x": 1 }),
        json!({ "op": "merge", "path": "/plan" }),
    ];
    let cases = (accepted.into_iter().map(|op| (op, true)))
        .chain(refused.into_iter().map(|op| (op, false)));
    for (op, ok) in cases {
        let reply = json!({ "type": "plan_update", "state_patch": [op], "payload": {} });
        let by_schema = jsonschema::is_valid(&schema, &reply);
        let by_checks = v.check_value(&reply, &["t1".into()]);
        assert_eq!(by_schema, ok, "schema on {op}");
        assert_eq!(by_checks.is_ok(), ok, "checks on {op}: {by_checks:?}");
    }
}
