//! The job's context as the PM fills it, reaching the agent's prompt: the `agent-task`
//! skill's rendered job (the PM's golden file, `pm/tests/golden/agent-task.job.json`) run
//! by the real binary, first against a scripted model, then against the real local model
//! (llama-server with SmolLM2) through a relay that records what the model was sent.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use cynode_protocol::result::{JobStatus, TodoStatus};
use serde_json::{json, Value};

use crate::harness::Sandbox;
use crate::model::{act, finish, Model};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The agent-task job exactly as the PM renders it for its golden session.
fn golden_job() -> Value {
    let path = repo().join("pm/tests/golden/agent-task.job.json");
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

/// Asserts that `m` holds every one of `parts`, in this order.
fn assert_in_order(m: &str, parts: &[&str]) {
    let mut from = 0;
    for p in parts {
        let at = m[from..]
            .find(p)
            .unwrap_or_else(|| panic!("{p:?} not found after byte {from} of:\n{m}"));
        from += at + p.len();
    }
}

/// The sections of the job message and what the golden job puts in each, in the seed's
/// order.
const GOLDEN_SECTIONS: [&str; 11] = [
    "## Baseline context\nYou are the sandbox agent of one CyNode job",
    "## Project context\nGreet the team in the workspace",
    "## Task\nCreate hello.txt in the workspace containing the single line: hi",
    "## Requirements\n(none)",
    "## Acceptance criteria\n- hello.txt exists\n- hello.txt contains hi",
    "## Preferences\n{\n  \"attempt\": \"1 of 3\"\n}",
    "## Additional context\nPlan step t1: Write the greeting file",
    "## Skills\nids: agent-task\n{\n  \"agent-task\": {",
    "## Limits\n",
    "## Todo list\n",
    "ac-2",
];

#[test]
fn the_agent_task_context_reaches_the_prompt_in_the_seeds_order() {
    let sb = Sandbox::new();
    let model = Model::tcp(
        &["smollm2"],
        vec![
            act(
                "write_file",
                json!({ "path": "hello.txt", "content": "hi\n" }),
            ),
            act("todo", json!({ "complete": ["ac-1", "ac-2"] })),
            finish("success", "hello.txt holds hi"),
        ],
        None,
    );
    let run = sb.run_env(&golden_job(), &[("OLLAMA_BASE_URL", &model.url)]);
    assert_eq!(run.result.status, JobStatus::Success, "{}", run.message());
    assert_eq!(sb.read("hello.txt"), "hi\n");
    let m = model.last_message(0);
    assert_in_order(&m, &GOLDEN_SECTIONS);
    // Each criterion is a todo item the agent had to close.
    let todo = run.result.todo.clone().unwrap();
    assert_eq!(
        todo.iter()
            .map(|i| (i.id.as_str(), i.description.as_str(), i.status))
            .collect::<Vec<_>>(),
        [
            ("ac-1", "hello.txt exists", TodoStatus::Done),
            ("ac-2", "hello.txt contains hi", TodoStatus::Done)
        ]
    );
}

/// The real local model: the job's context is in what the model was sent, and the job
/// ends either `success` with every criterion done or as a structured failure (a failure
/// code and a message); the tiny model is not expected to do the task, only to be asked.
#[test]
fn a_real_model_is_asked_with_the_agent_task_context_and_the_job_ends_cleanly() {
    let model = cynode_testkit::LocalModel::start(
        &repo(),
        cynode_testkit::model::free_port(),
        Duration::from_secs(120),
    );
    let upstream = model
        .base_url
        .trim_start_matches("http://")
        .trim_end_matches("/v1")
        .to_string();
    let relay = Model::relay(&upstream);
    let sb = Sandbox::new();
    let mut job = golden_job();
    // Well inside the harness's 120 s bound, even at a few tokens a second.
    job["constraints"]["max_runtime_seconds"] = json!(90);
    let t = Instant::now();
    let run = sb.run_env(
        &job,
        &[
            ("OLLAMA_BASE_URL", &relay.url),
            ("SBA_AGENT_MAX_TURNS", "6"),
        ],
    );
    let seen = relay.seen();
    eprintln!(
        "real model agent-task job: {:?}, {} model calls, status {:?}, failure {:?}: {:?}, \
answer {:?}, last speed {:?} tokens/s",
        t.elapsed(),
        seen.len(),
        run.result.status,
        run.result.failure_code,
        run.result.failure_message,
        run.result.final_answer,
        model.last_tokens_per_second()
    );
    assert!(
        !seen.is_empty(),
        "the model was never asked: {}",
        run.message()
    );
    let first = seen[0].body["messages"].as_array().unwrap();
    assert_eq!(first[0]["role"], "system");
    let m = first.last().unwrap()["content"].as_str().unwrap();
    assert_in_order(m, &GOLDEN_SECTIONS);
    assert_eq!(seen[0].body["model"], "smollm2");
    let todo = run
        .result
        .todo
        .clone()
        .expect("agent results carry the todo list");
    match run.result.status {
        JobStatus::Success => {
            assert!(run
                .result
                .final_answer
                .as_deref()
                .is_some_and(|a| !a.is_empty()));
            assert!(
                todo.iter().all(|i| i.status == TodoStatus::Done),
                "{todo:?}"
            );
        }
        _ => {
            assert!(run.result.failure_code.is_some(), "{:?}", run.raw);
            assert!(!run.message().is_empty(), "{:?}", run.raw);
            assert_eq!(run.result.final_answer, None);
        }
    }
}
