//! The session store on a real SQLite file and a real PostgreSQL (started by
//! deploy/postgres/start.sh): the same state tests on both.

use cynode_pm::session::{Budgets, Phase, SessionRecord, SessionStatus};
use cynode_pm::store::{Store, StoreError};
use cynode_testkit::postgres_url;
use serde_json::json;

fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4())
}

async fn state_round_trip(store: &Store) {
    let id = unique("s");
    let mut rec = SessionRecord::new(&id, "tenant-a", "make the tests pass", Budgets::default());
    assert!(store.create(&rec).await.unwrap());
    assert!(
        !store.create(&rec).await.unwrap(),
        "create is idempotent on session_id"
    );
    let (loaded, v1) = store.load(&id).await.unwrap().unwrap();
    assert_eq!((loaded, v1), (rec.clone(), 1));

    rec.phase = Phase::AwaitInput {
        question: "which branch?".into(),
    };
    rec.status = SessionStatus::AwaitingInput;
    let v2 = store
        .save(
            &rec,
            v1,
            &[
                ("model_reply", json!({ "turn": 0, "raw": "{}" })),
                ("note", json!({ "x": 1 })),
            ],
        )
        .await
        .unwrap();
    assert_eq!(v2, 2);
    // A writer holding the old version loses: no lost update.
    match store.save(&rec, v1, &[("late", json!({}))]).await {
        Err(StoreError::Conflict(s)) => assert_eq!(s, id),
        other => panic!("expected a conflict, got {other:?}"),
    }
    let journal = store.journal(&id).await.unwrap();
    let kinds: Vec<(i64, &str)> = journal.iter().map(|e| (e.seq, e.kind.as_str())).collect();
    assert_eq!(kinds, [(1, "model_reply"), (2, "note")]);
    assert_eq!(journal[0].data, json!({ "turn": 0, "raw": "{}" }));
    let (loaded, v) = store.load(&id).await.unwrap().unwrap();
    assert_eq!((loaded.status, v), (SessionStatus::AwaitingInput, 2));
    let waiting = store.list(Some("awaiting_input")).await.unwrap();
    assert!(waiting.iter().any(|r| r.state.session_id == id));
    assert!(store.load("no-such-session").await.unwrap().is_none());
    store
        .put_artifact("ab".repeat(32).as_str(), 3, "/x")
        .await
        .unwrap();
    store
        .put_artifact("ab".repeat(32).as_str(), 3, "/x")
        .await
        .unwrap();
}

#[tokio::test]
async fn sqlite_state() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::connect(&format!("sqlite://{}", dir.path().join("pm.db").display()))
        .await
        .unwrap();
    state_round_trip(&store).await;
    // Reopening the file keeps everything.
    drop(store);
    let again = Store::connect(&format!("sqlite://{}", dir.path().join("pm.db").display()))
        .await
        .unwrap();
    assert_eq!(again.list(None).await.unwrap().len(), 1);
}

#[tokio::test]
async fn postgres_state() {
    let store = Store::connect(postgres_url()).await.unwrap();
    state_round_trip(&store).await;
}

#[tokio::test]
async fn unsupported_datastore_is_a_clear_error() {
    let e = Store::connect("mysql://x").await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "unsupported datastore `mysql://x`: use sqlite://PATH or postgres://…"
    );
}
