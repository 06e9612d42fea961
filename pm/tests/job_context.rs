//! The job's context through the whole loop: the scripted model (real HTTP on 127.0.0.1)
//! asks for an `agent-task` job in a session whose objective carries a credential; the
//! context the PM fills from the session holds it, so the default policy denies the job
//! (`secret_in_context`) before it reaches the worker, which only ever answers the
//! placement probe.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use axum::{Json, Router};
use cynode_pm::config::{PmConfig, PolicySource, SkillSources};
use cynode_pm::dispatch::WorkerClient;
use cynode_pm::driver::Pm;
use cynode_pm::llm::ModelConfig;
use cynode_pm::session::{FailureKind, SessionRecord, SessionStatus};
use cynode_pm::workers::WorkerPool;
use cynode_testkit::scripted_model::{Reply, ScriptedModel};
use serde_json::{json, Value};

/// A worker that is ready and takes nothing: `GET /v1/worker/capacity` answers, every
/// other request is counted (and answered 500).
async fn probe_only_worker() -> (String, Arc<AtomicUsize>) {
    let other = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&other);
    let app = Router::new()
        .route(
            "/v1/worker/capacity",
            get(|| async {
                Json(json!({ "version": 1, "backend": "bwrap", "max_running": 1,
                             "max_queued": 1, "running": 0, "queued": 0, "ready": true }))
            }),
        )
        .fallback(move || {
            seen.fetch_add(1, Ordering::SeqCst);
            async { axum::http::StatusCode::INTERNAL_SERVER_ERROR }
        });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (url, other)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credential_in_the_objective_reaches_the_jobs_context_and_the_policy_denies_it() {
    let dir = tempfile::tempdir().unwrap();
    let token = format!("ghp_{}", "a1B2".repeat(6));
    let model = ScriptedModel::repeating_last(vec![
        Reply::from(
            json!({ "type": "plan_update", "payload": {}, "state_patch": [
            { "op": "add", "path": "/plan/-", "value":
              { "task_id": "t1", "description": "Write the greeting file", "status": "pending", "version": 0 } }
        ] }),
        ),
        Reply::from(
            json!({ "type": "job_request", "state_patch": [], "payload": {
            "task_id": "t1", "skill_id": "agent-task",
            "inputs": { "task": "create hello.txt", "acceptance_criteria": ["hello.txt exists"] } } }),
        ),
    ]);
    let (worker_url, submitted) = probe_only_worker().await;
    let mut m = ModelConfig::new(model.serve(), "scripted");
    m.timeout = Duration::from_secs(10);
    let config = PmConfig {
        model: m,
        state_dir: dir.path().to_path_buf(),
        datastore: None,
        skills: SkillSources::default(),
        policy: PolicySource::Builtin,
        tenant_file: None,
        worker_wait: Duration::from_secs(1),
    };
    let workers = WorkerPool::single(WorkerClient::new(&worker_url, "unused"), "img");
    let pm: Pm = cynode_pm::bootstrap::build_pm(&config, workers)
        .await
        .unwrap();
    let objective = format!("greet the team; the deploy key is {token}");
    let rec = SessionRecord::new("s-ctx", "default", &objective, Default::default());
    pm.create(&rec).await.unwrap();
    let rec = tokio::time::timeout(Duration::from_secs(60), pm.run("s-ctx", &mut |_| {}))
        .await
        .expect("the session ends within 60 s")
        .unwrap();

    let denials: Vec<&Value> = rec
        .state
        .history
        .iter()
        .filter(|e| e.kind == "policy_denied")
        .map(|e| &e.data)
        .collect();
    assert!(!denials.is_empty(), "{:?}", rec.state.history);
    for d in &denials {
        assert_eq!(
            d["reasons"],
            json!(["secret_in_context: context.project_context has a value that looks like a github token; secrets never go into jobs"]),
            "{d}"
        );
    }
    // Every attempt was denied and the session failed as a policy violation; nothing
    // was submitted.
    assert_eq!(rec.status, SessionStatus::Failed);
    assert_eq!(
        rec.failure.as_ref().map(|f| f.kind),
        Some(FailureKind::PolicyViolation)
    );
    assert_eq!(denials.len() as u32, rec.budgets.max_attempts_per_task);
    assert_eq!(submitted.load(Ordering::SeqCst), 0);
    assert!(!serde_json::to_string(&rec.state.history)
        .unwrap()
        .contains(&token));
}
