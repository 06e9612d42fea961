//! The PM's side of docs/INTEROP.md's "The seeds' words": a session's failure kind read
//! from the PM seed's word, a model reply that writes the seeds' plan statuses accepted
//! and stored in ours, and the table's rows for both.

use cynode_pm::llm::{response_schema, ReplyValidator};
use cynode_pm::session::FailureKind;
use serde_json::json;

#[test]
fn the_seeds_failure_type_reads_as_ours_and_ours_is_written() {
    let kind: FailureKind = serde_json::from_value(json!("worker_failure")).unwrap();
    assert_eq!(kind, FailureKind::WorkerUnavailable);
    assert_eq!(
        serde_json::to_value(kind).unwrap(),
        json!("worker_unavailable")
    );
    assert!(serde_json::from_value::<FailureKind>(json!("worker_failed")).is_err());
}

#[test]
fn a_reply_may_write_the_seeds_plan_statuses() {
    let schema = response_schema(&[], &["t1".to_string()]);
    let validator = ReplyValidator::new(&schema, &[]).unwrap();
    for (seed, ours) in [("running", "in_progress"), ("completed", "done")] {
        let reply = json!({
            "type": "plan_update",
            "state_patch": [{ "op": "replace", "path": "/plan/0/status", "value": seed }],
            "payload": {}
        });
        let out = validator
            .validate(&reply.to_string(), &["t1".to_string()])
            .unwrap_or_else(|e| panic!("{seed}: {e}"));
        assert_eq!(out.state_patch[0].value, Some(json!(seed)));
        let status: cynode_protocol::session::TaskStatus =
            serde_json::from_value(json!(seed)).unwrap();
        assert_eq!(serde_json::to_value(status).unwrap(), json!(ours));
    }
    // A word of neither is still refused, by name.
    let reply = json!({
        "type": "plan_update",
        "state_patch": [{ "op": "replace", "path": "/plan/0/status", "value": "finished" }],
        "payload": {}
    });
    let e = validator
        .validate(&reply.to_string(), &["t1".to_string()])
        .unwrap_err();
    assert!(e.to_string().contains("must be one of"), "{e}");
}

#[test]
fn the_interop_table_lists_the_pms_mappings() {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/INTEROP.md"),
    )
    .unwrap();
    for row in [
        "| `worker_failure` | `worker_unavailable` |",
        "the PM's failure type `schema_error`",
        "the PM's failure type `sandbox_timeout`",
        "the PM's policy error `{\"type\": \"error\", \"reason\": \"policy_violation\"}`",
    ] {
        assert!(doc.contains(row), "docs/INTEROP.md lacks {row}");
    }
}
