//! The node's logic on the fake backend ([`crate::backend::fake`]): a real node (its
//! SQLite store, uid pool, queue and retention) whose sandboxes are the fake's in-process
//! runs, so queueing, idempotency, timeouts, stops and acks are tested without a sandbox.
//! Isolation is tested on the real engines (`worker/tests`).

use std::sync::Arc;
use std::time::Duration;

use cynode_protocol::worker_api::{AsyncJobState, RunJobRequest, WorkerJobStatus};
use serde_json::json;

use super::{Node, NodeError};
use crate::config::{BackendKind, Config};

/// A node on the fake backend in a temporary state directory (kept as long as the
/// returned guard), its disk volumes off (the poller guards the disk: nothing is mounted).
async fn fake_node(max_running: usize, max_queued: usize) -> (Arc<Node>, tempfile::TempDir) {
    // Each test is a process of its own under nextest: this touches no other test.
    std::env::set_var(crate::loopfs::OFF_VAR, "off");
    let dir = tempfile::tempdir().expect("temp dir");
    let mut cfg = Config {
        backend: BackendKind::Fake,
        state_dir: dir.path().join("state"),
        ..Config::default()
    };
    cfg.queue.max_running = max_running;
    cfg.queue.max_queued = max_queued;
    let node = Node::start(cfg, "t".repeat(32))
        .await
        .expect("the node starts");
    (node, dir)
}

fn job(job_id: &str, command: &[&str], timeout_seconds: u64) -> RunJobRequest {
    serde_json::from_value(json!({
        "version": 1, "task_id": "t1", "job_id": job_id,
        "sandbox": { "image": "img", "command": command, "timeout_seconds": timeout_seconds }
    }))
    .expect("a valid request")
}

/// Polls `job_id` until it is terminal (within 10 s).
async fn settled(node: &Arc<Node>, job_id: &str) -> cynode_protocol::worker_api::AsyncJobStatus {
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = node.status(job_id).await.expect("status");
        if !matches!(
            s.status,
            AsyncJobState::Accepted | AsyncJobState::InProgress
        ) {
            return s;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "{job_id} never ended: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_job_runs_once_and_its_repeat_gets_the_stored_answer() {
    let (node, _dir) = fake_node(2, 2).await;
    let first = node
        .run_sync(job("j1", &["echo", "hello"], 10))
        .await
        .unwrap();
    assert_eq!(first.status, WorkerJobStatus::Completed);
    assert_eq!(first.stdout, "hello\n");
    let again = node
        .run_sync(job("j1", &["echo", "hello"], 10))
        .await
        .unwrap();
    assert_eq!(
        again, first,
        "a repeat is answered from the record, not run again"
    );
    let other = node.run_sync(job("j1", &["echo", "bye"], 10)).await;
    assert!(
        matches!(other, Err(NodeError::Conflict(_))),
        "the same job_id with another request is a conflict: {other:?}"
    );
}

#[tokio::test]
async fn a_job_past_its_timeout_ends_timeout_and_a_failing_one_failed() {
    let (node, _dir) = fake_node(2, 2).await;
    let slow = node
        .run_sync(job("slow", &["sleep", "30"], 1))
        .await
        .unwrap();
    assert_eq!(slow.status, WorkerJobStatus::Timeout, "{slow:?}");
    assert_eq!(slow.exit_code, -1);
    let bad = node.run_sync(job("bad", &["exit", "3"], 10)).await.unwrap();
    assert_eq!((bad.status, bad.exit_code), (WorkerJobStatus::Failed, 3));
}

#[tokio::test]
async fn an_async_job_is_kept_until_its_caller_acks_it() {
    let (node, _dir) = fake_node(2, 2).await;
    let (new, _) = node.submit(job("a1", &["echo", "kept"], 10)).await.unwrap();
    assert!(new);
    let done = settled(&node, "a1").await;
    assert_eq!(done.status, AsyncJobState::Completed);
    assert_eq!(
        done.result.as_ref().map(|r| r.stdout.as_str()),
        Some("kept\n")
    );
    // Asked again, it is still there: results wait for their caller.
    assert_eq!(
        node.status("a1").await.unwrap().status,
        AsyncJobState::Completed
    );
    node.ack("a1").await.unwrap();
    assert!(matches!(
        node.status("a1").await,
        Err(NodeError::NotFound(_))
    ));
}

#[tokio::test]
async fn a_stopped_job_ends_canceled_and_a_full_node_says_busy() {
    let (node, _dir) = fake_node(1, 0).await;
    node.submit(job("long", &["sleep", "30"], 60))
        .await
        .unwrap();
    let busy = node.submit(job("more", &["true"], 10)).await;
    assert!(matches!(busy, Err(NodeError::Busy)), "{busy:?}");
    node.stop("long").await.unwrap();
    assert_eq!(settled(&node, "long").await.status, AsyncJobState::Canceled);
    let (new, _) = node.submit(job("more", &["true"], 10)).await.unwrap();
    assert!(new, "the stopped job's place is free again");
    assert_eq!(
        settled(&node, "more").await.status,
        AsyncJobState::Completed
    );
}

#[tokio::test]
async fn a_session_keeps_its_workspace_through_suspend_and_resume() {
    use std::io::Read;
    let (node, _dir) = fake_node(1, 1).await;
    let s = &node.sessions;
    let missing = s
        .create(from(json!({
            "version": 1, "session_id": "s0", "task_id": "t1",
            "image": format!("{}x", crate::backend::fake::MISSING_IMAGE)
        })))
        .await;
    assert!(
        missing.is_err(),
        "an image the backend has not got is refused: {missing:?}"
    );
    s.create(from(
        json!({"version": 1, "session_id": "s1", "task_id": "t1", "image": "img"}),
    ))
    .await
    .expect("a session starts");
    let exec = |command: &[&str]| from(json!({"version": 1, "command": command}));
    let w = s
        .exec("s1", exec(&["write", "note", "kept"]))
        .await
        .unwrap();
    assert_eq!(w.exit_code, 0, "{w:?}");
    s.suspend("s1", from(json!({}))).await.expect("suspend");
    assert!(
        s.exec("s1", exec(&["true"])).await.is_err(),
        "a suspended session runs nothing"
    );
    s.resume("s1").await.expect("resume");
    let mut text = String::new();
    s.read_file("s1", "note")
        .await
        .unwrap()
        .file
        .read_to_string(&mut text)
        .unwrap();
    assert_eq!(
        text, "kept",
        "the workspace is the one written before the suspend"
    );
    assert_eq!(
        s.exec("s1", exec(&["echo", "on"])).await.unwrap().stdout,
        "on\n"
    );
    s.end("s1").await.expect("end");
}

/// A protocol value from its JSON.
fn from<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).expect("a valid request")
}
