//! The contract's unit tests: schema and checks agree, classification, fences, paths.

use super::patch::*;
use super::schema::*;
use super::validate::*;
use super::DESCRIPTION_MAX;
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

fn validator() -> ReplyValidator {
    ReplyValidator::new(&response_schema(&catalog(), &[]), &catalog()).unwrap()
}

fn plan_add(entry: serde_json::Value) -> String {
    json!({ "type": "plan_update", "payload": {},
            "state_patch": [{ "op": "add", "path": "/plan/-", "value": entry }] })
    .to_string()
}

#[test]
fn a_task_id_is_short_and_named_when_refused() {
    let v = validator();
    let ok = "t".repeat(super::TASK_ID_MAX);
    assert!(v
        .validate(
            &plan_add(json!({ "task_id": ok, "description": "d", "status": "pending" })),
            &[]
        )
        .is_ok());
    // The 60-hex-character id a small model once wrote.
    let long = format!("t324158769-{}", "bddf".repeat(12));
    let e = v
        .validate(
            &plan_add(json!({ "task_id": long, "description": "d", "status": "pending" })),
            &[],
        )
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("state_patch[0].value.task_id: "), "{e}");
    assert!(e.contains("1 to 32"), "{e}");
    // The schema the model is constrained by says the same.
    let schema = response_schema(&catalog(), &[]);
    assert!(!jsonschema::is_valid(
        &schema,
        &serde_json::from_str(&plan_add(
            json!({ "task_id": "a".repeat(33), "description": "d", "status": "pending" })
        ))
        .unwrap()
    ));
}

#[test]
fn a_description_is_one_bounded_line_and_a_skipped_task_has_a_reason() {
    let v = validator();
    let e = v
        .validate(
            &plan_add(json!({ "task_id": "t1", "description": "one\ntwo", "status": "pending" })),
            &[],
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("state_patch[0].value.description: must be one line"),
        "{e}"
    );
    let e = v
        .validate(
            &plan_add(json!({ "task_id": "t1", "description": "x".repeat(DESCRIPTION_MAX + 1), "status": "pending" })),
            &[],
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("too long"), "{e}");
    let e = v
        .validate(
            &plan_add(json!({ "task_id": "t1", "description": "d", "status": "skipped" })),
            &[],
        )
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("state_patch[0].value.reason: missing"), "{e}");
    assert!(v
        .validate(
            &plan_add(json!({ "task_id": "t1", "description": "d", "status": "skipped", "reason": "not needed" })),
            &[]
        )
        .is_ok());
}

fn final_reply(patch: serde_json::Value) -> cynode_protocol::llm::LlmOutput {
    serde_json::from_value(
        json!({ "type": "final", "state_patch": patch, "payload": { "summary": "s" } }),
    )
    .unwrap()
}

#[test]
fn a_final_leaves_no_task_open() {
    let mut rec = crate::session::SessionRecord::new("s-1", "default", "o", Default::default());
    rec.state.plan = serde_json::from_value(json!([
        { "task_id": "t1", "description": "a", "status": "done", "version": 1 },
        { "task_id": "t2", "description": "b", "status": "in_progress", "version": 1 },
        { "task_id": "t3", "description": "c", "status": "pending", "version": 1 },
    ]))
    .unwrap();
    let e = check_final_closes_plan(&rec, &final_reply(json!([])))
        .unwrap_err()
        .to_string();
    assert!(e.contains("/plan/1/status (t2: in_progress)"), "{e}");
    assert!(e.contains("/plan/2/status (t3: pending)"), "{e}");
    // Skipping one leaves the other open.
    let skip = |i: usize| {
        [
            json!({ "op": "replace", "path": format!("/plan/{i}/status"), "value": "skipped" }),
            json!({ "op": "add", "path": format!("/plan/{i}/reason"), "value": "not needed" }),
        ]
    };
    let e = check_final_closes_plan(&rec, &final_reply(json!(skip(1))))
        .unwrap_err()
        .to_string();
    assert!(!e.contains("t2") && e.contains("t3"), "{e}");
    // Skipped without a reason: refused by the patch.
    let e = check_final_closes_plan(
        &rec,
        &final_reply(json!([
            { "op": "replace", "path": "/plan/1/status", "value": "skipped" },
            { "op": "replace", "path": "/plan/2/status", "value": "done" },
        ])),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("/plan/1/reason"), "{e}");
    let both: Vec<_> = skip(1).into_iter().chain(skip(2)).collect();
    check_final_closes_plan(&rec, &final_reply(json!(both))).unwrap();
    // A patch that does not apply (re-adding t1) is refused on its own when acted on; the
    // final is judged on the plan as it is.
    let mut closed = rec.clone();
    for p in &mut closed.state.plan {
        p.status = cynode_protocol::session::TaskStatus::Done;
    }
    let readd = json!([{ "op": "add", "path": "/plan/-",
        "value": { "task_id": "t1", "description": "a", "status": "done" } }]);
    check_final_closes_plan(&closed, &final_reply(readd.clone())).unwrap();
    let e = check_final_closes_plan(&rec, &final_reply(readd))
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not apply: duplicate task_id t1"), "{e}");
    // Other replies are not this rule's business.
    let plan: cynode_protocol::llm::LlmOutput =
        serde_json::from_value(json!({ "type": "plan_update", "state_patch": [], "payload": {} }))
            .unwrap();
    check_final_closes_plan(&rec, &plan).unwrap();
}
