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
