//! What the PM benches share: the scripted instant model's replies and the chat
//! completion around them, command-line flags, and percentiles.

#![allow(dead_code)]

use serde_json::{json, Value};

/// The data messages of a chat request as one string (the system prompt's examples
/// mention `t1` too, so they are left out).
pub fn data_text(body: &Value) -> String {
    body["messages"]
        .as_array()
        .map(|m| {
            m.iter()
                .filter(|x| x["role"] != "system")
                .map(|x| x.to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// The scripted session, decided by how far the conversation is: `plan_update` adding
/// t1, then (with `with_job`) a write-files `job_request` for it, then `final`.
pub fn scripted_reply(text: &str, with_job: bool) -> Value {
    if !text.contains("\\\"t1\\\"") && !text.contains("\"t1\"") {
        json!({ "type": "plan_update", "state_patch": [{ "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "write", "status": "pending" } }], "payload": {} })
    } else if with_job && !text.contains("result of job") {
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": "write-files", "inputs": { "files": [{ "path": "a.txt", "content": "x" }] } } })
    } else {
        final_reply()
    }
}

pub fn final_reply() -> Value {
    json!({ "type": "final", "state_patch": [], "payload": { "summary": "done" } })
}

/// An OpenAI chat completion carrying `content` as the assistant's message.
pub fn completion(content: &Value) -> Value {
    json!({
        "id": "x", "object": "chat.completion", "created": 0, "model": "bench",
        "choices": [{ "index": 0, "message": { "role": "assistant", "content": content.to_string() }, "finish_reason": "stop" }],
        "usage": { "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2 }
    })
}

/// The value after `--name` on the command line.
pub fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// The number after `--name`, else `default`.
pub fn arg_num(name: &str, default: usize) -> usize {
    arg(name).and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// The comma-separated numbers after `--name` (e.g. `--replicas 1,2,3`), else `default`.
pub fn arg_list(name: &str, default: &str) -> Vec<usize> {
    arg(name)
        .unwrap_or_else(|| default.into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

/// The benches' runtime: 2 worker threads, like the machines they run on.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The `p` quantile (0–1) of `v`, nearest rank; NaN when empty.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}
