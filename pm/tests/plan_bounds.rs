//! The plan the model writes is bounded, through the whole loop with the scripted model
//! (real HTTP on 127.0.0.1): an over-long task id or a multi-line description is refused
//! with the field named and the model asked again; a `final` that leaves tasks open is
//! refused until the model runs them or closes them as `skipped` with a reason, and the
//! deliverable lists skipped tasks as such. No job runs, so the worker is never called.

use std::time::Duration;

use cynode_pm::config::{PmConfig, PolicySource, SkillSources};
use cynode_pm::dispatch::WorkerClient;
use cynode_pm::driver::Pm;
use cynode_pm::llm::ModelConfig;
use cynode_pm::session::{FailureKind, SessionRecord, SessionStatus};
use cynode_pm::workers::WorkerPool;
use cynode_testkit::scripted_model::{Reply, ScriptedModel};
use serde_json::{json, Value};

/// A PM on `model`, its state in `dir`, a worker that is never reached.
async fn pm(dir: &std::path::Path, model: &ScriptedModel) -> Pm {
    let mut m = ModelConfig::new(model.serve(), "scripted");
    m.timeout = Duration::from_secs(10);
    let config = PmConfig {
        model: m,
        state_dir: dir.to_path_buf(),
        datastore: None,
        skills: SkillSources::default(),
        policy: PolicySource::Builtin,
        tenant_file: None,
        worker_wait: Duration::from_secs(1),
    };
    let workers = WorkerPool::single(WorkerClient::new("http://127.0.0.1:9", "unused"), "img");
    cynode_pm::bootstrap::build_pm(&config, workers)
        .await
        .unwrap()
}

/// Runs one session of `script` (its last reply repeating) to its end; the record and
/// the user messages the model got, one string per request.
async fn session(script: Vec<Value>) -> (SessionRecord, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let model = ScriptedModel::repeating_last(script.into_iter().map(Reply::from).collect());
    let pm = pm(dir.path(), &model).await;
    let rec = SessionRecord::new(
        "s-plan",
        "default",
        "tidy the repository",
        Default::default(),
    );
    pm.create(&rec).await.unwrap();
    let rec = tokio::time::timeout(Duration::from_secs(60), pm.run("s-plan", &mut |_| {}))
        .await
        .expect("the session ends within 60 s")
        .unwrap();
    let asked = model
        .chat_bodies()
        .iter()
        .map(|b| {
            b["messages"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|m| m["role"] == "user")
                .filter_map(|m| m["content"].as_str())
                .collect::<Vec<_>>()
                .join("\n")
        })
        .collect();
    (rec, asked)
}

fn plan(entries: Value) -> Value {
    let ops: Vec<Value> = entries
        .as_array()
        .unwrap()
        .iter()
        .map(|e| json!({ "op": "add", "path": "/plan/-", "value": e }))
        .collect();
    json!({ "type": "plan_update", "state_patch": ops, "payload": {} })
}

fn final_with(patch: Value) -> Value {
    json!({ "type": "final", "state_patch": patch, "payload": { "summary": "nothing needed doing" } })
}

fn skip(i: usize, why: &str) -> [Value; 2] {
    [
        json!({ "op": "replace", "path": format!("/plan/{i}/status"), "value": "skipped" }),
        json!({ "op": "add", "path": format!("/plan/{i}/reason"), "value": why }),
    ]
}

#[tokio::test]
async fn an_overlong_task_id_is_refused_by_name_and_asked_again() {
    let long = format!("t324158769-{}", "bddf".repeat(12));
    let (rec, asked) = session(vec![
        plan(json!([{ "task_id": long, "description": "look", "status": "pending" }])),
        plan(json!([{ "task_id": "t1", "description": "look", "status": "pending" }])),
        final_with(json!(skip(0, "the listing was not needed"))),
    ])
    .await;
    assert_eq!(rec.status, SessionStatus::Completed, "{:?}", rec.failure);
    // The retry told the model which field and why.
    assert!(
        asked[1].contains("state_patch[0].value.task_id: `t324158769-bddf")
            && asked[1].contains("1 to 32"),
        "{}",
        asked[1]
    );
    assert_eq!(rec.state.plan.len(), 1);
    assert_eq!(rec.state.plan[0].task_id, "t1");
}

#[tokio::test]
async fn a_multi_line_description_is_refused_by_name() {
    let (rec, asked) = session(vec![
        plan(json!([{ "task_id": "t1", "description": "look\nand look again", "status": "pending" }])),
        plan(json!([{ "task_id": "t1", "description": "look", "status": "pending" }])),
        final_with(json!(skip(0, "not needed"))),
    ])
    .await;
    assert_eq!(rec.status, SessionStatus::Completed, "{:?}", rec.failure);
    assert!(
        asked[1].contains("state_patch[0].value.description: must be one line"),
        "{}",
        asked[1]
    );
}

#[tokio::test]
async fn a_final_with_open_tasks_is_refused_until_they_are_skipped_with_a_reason() {
    let both: Vec<Value> = skip(0, "the tests already pass")
        .into_iter()
        .chain(skip(1, "nothing to format"))
        .collect();
    let (rec, asked) = session(vec![
        plan(json!([
            { "task_id": "t1", "description": "run the tests", "status": "in_progress" },
            { "task_id": "t2", "description": "format the code", "status": "pending" }
        ])),
        // Open tasks: refused.
        final_with(json!([])),
        // Skipped without a reason: refused.
        final_with(json!([
            { "op": "replace", "path": "/plan/0/status", "value": "skipped" },
            { "op": "replace", "path": "/plan/1/status", "value": "skipped" }
        ])),
        final_with(json!(both)),
    ])
    .await;
    assert_eq!(rec.status, SessionStatus::Completed, "{:?}", rec.failure);
    assert!(
        asked[2].contains("final refused: tasks still open at /plan/0/status (t1: in_progress), /plan/1/status (t2: pending)"),
        "{}",
        asked[2]
    );
    assert!(asked[3].contains("/plan/0/reason"), "{}", asked[3]);
    // The deliverable lists them as skipped, with the model's reasons.
    let report = rec.report();
    let tasks: Vec<(String, Value, Option<String>)> = report
        .tasks
        .iter()
        .map(|t| (t.task_id.clone(), json!(t.status), t.reason.clone()))
        .collect();
    assert_eq!(
        tasks,
        [
            (
                "t1".into(),
                json!("skipped"),
                Some("the tests already pass".into())
            ),
            (
                "t2".into(),
                json!("skipped"),
                Some("nothing to format".into())
            ),
        ]
    );
    let text = report.evidence_text();
    assert!(
        text.contains(
            "task t1 [skipped]: run the tests\n  skipped by the model: the tests already pass"
        ),
        "{text}"
    );
}

#[tokio::test]
async fn a_model_that_keeps_finishing_with_open_tasks_fails_the_session() {
    let (rec, asked) = session(vec![
        plan(json!([{ "task_id": "t1", "description": "run the tests", "status": "pending" }])),
        final_with(json!([])),
    ])
    .await;
    assert_eq!(rec.status, SessionStatus::Failed);
    assert_eq!(
        rec.failure.as_ref().map(|f| f.kind),
        Some(FailureKind::ModelContractViolation),
        "{:?}",
        rec.failure
    );
    assert!(rec.deliverable.is_none());
    assert!(asked.len() >= 3, "{asked:?}");
}
