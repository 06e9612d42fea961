//! Agent mode against a scripted OpenAI-compatible server: the real binary, real steps,
//! real sockets; only the model's replies are scripted.

use std::time::{Duration, Instant};

use cynode_protocol::result::{JobStatus, StepStatus, TodoItem, TodoStatus};
use serde_json::{json, Value};

use crate::harness::{Run, Sandbox};
use crate::model::{act, finish, Model, Reply};

fn agent_job(context: Value) -> Value {
    json!({
        "protocol_version": "1.0",
        "job_id": "job-1",
        "task_id": "task-1",
        "execution_mode": "agent_inference",
        "inference": { "allowed_models": ["m1"] },
        "constraints": { "max_runtime_seconds": 30, "max_output_bytes": 65536 },
        "context": context
    })
}

/// Runs the default agent job against a TCP model scripted with `replies`.
fn run_scripted(sb: &Sandbox, replies: Vec<Reply>) -> (Model, Run) {
    let model = Model::tcp(&["m1"], replies, None);
    let run = sb.run_env(
        &agent_job(json!({ "task_context": "x" })),
        &[("OLLAMA_BASE_URL", &model.url)],
    );
    (model, run)
}

fn todo(id: &str, description: &str, status: TodoStatus) -> TodoItem {
    TodoItem {
        id: id.into(),
        description: description.into(),
        status,
    }
}

#[test]
fn agent_writes_reads_and_keeps_its_todo_list_on_disk() {
    let sb = Sandbox::new();
    let todo_path = sb.job_dir().join("todo.json");
    let model = Model::unix(
        &["m1"],
        vec![
            act(
                "todo",
                json!({ "add": ["read it back"], "start": ["req-1"] }),
            ),
            act(
                "write_file",
                json!({ "path": "hello.txt", "content": "hi" }),
            ),
            act("read_file", json!({ "path": "hello.txt" })),
            act("todo", json!({ "complete": ["req-1", "t-1"] })),
            finish("success", "hello.txt contains hi"),
        ],
        Some(&todo_path),
    );
    let job = agent_job(json!({
        "task_context": "create hello.txt containing hi, then read it back",
        "requirements": ["hello.txt contains hi"]
    }));
    // The proxy URL wins over OLLAMA_BASE_URL (which points nowhere here).
    let run = sb.run_env(
        &job,
        &[
            ("INFERENCE_PROXY_URL", &model.url),
            ("OLLAMA_BASE_URL", "http://127.0.0.1:9"),
        ],
    );
    assert_eq!(run.result.status, JobStatus::Success, "{}", run.message());
    assert_eq!(run.code, Some(0));
    assert_eq!(
        run.result.final_answer.as_deref(),
        Some("hello.txt contains hi")
    );
    assert_eq!(sb.read("hello.txt"), "hi");
    let steps: Vec<(&str, &str, &str)> = run.raw["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["id"].as_str().unwrap(),
                s["type"].as_str().unwrap(),
                s["status"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        steps,
        [
            ("agent-1", "write_file", "success"),
            ("agent-2", "read_file", "success")
        ]
    );
    assert_eq!(run.step(1)["result"]["content"], "hi");
    let done = vec![
        todo("req-1", "hello.txt contains hi", TodoStatus::Done),
        todo("t-1", "read it back", TodoStatus::Done),
    ];
    assert_eq!(run.result.todo.as_ref(), Some(&done));
    let on_disk: Value = serde_json::from_slice(&std::fs::read(&todo_path).unwrap()).unwrap();
    assert_eq!(on_disk["items"], serde_json::to_value(&done).unwrap());
    assert_eq!(on_disk["job_id"], "job-1");

    // todo.json as it was on disk when each model call arrived: written before the first
    // call and after every change.
    let seen = model.seen();
    assert_eq!(seen.len(), 5);
    let statuses: Vec<Vec<(String, String)>> = seen
        .iter()
        .map(|s| {
            s.todo_json.as_ref().unwrap()["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| {
                    (
                        i["id"].as_str().unwrap().to_string(),
                        i["status"].as_str().unwrap().to_string(),
                    )
                })
                .collect()
        })
        .collect();
    let p = |id: &str, st: &str| (id.to_string(), st.to_string());
    assert_eq!(statuses[0], [p("req-1", "pending")]);
    assert_eq!(
        statuses[1],
        [p("req-1", "in_progress"), p("t-1", "pending")]
    );
    assert_eq!(statuses[4], [p("req-1", "done"), p("t-1", "done")]);

    // The request: the model, the constrained response format, the prompt in seed order.
    let first = &seen[0].body;
    assert_eq!(first["model"], "m1");
    assert_eq!(first["stream"], false);
    assert_eq!(first["response_format"]["type"], "json_schema");
    assert_eq!(first["response_format"]["json_schema"]["strict"], true);
    assert_eq!(
        first["response_format"]["json_schema"]["name"],
        "cynode_sba_action"
    );
    let job_msg = first["messages"][1]["content"].as_str().unwrap();
    let heads: Vec<&str> = job_msg.lines().filter(|l| l.starts_with("## ")).collect();
    let seed_order = cynode_sba::agent::prompt::SECTIONS.map(|s| format!("## {s}"));
    assert_eq!(heads, seed_order);
    assert!(job_msg.contains("remaining time: "), "{job_msg}");
    assert!(job_msg.contains("at most 65536 bytes"), "{job_msg}");
    assert!(model.last_message(3).contains("content:\nhi"));
}

#[test]
fn a_model_outside_the_allowed_list_is_refused_before_any_step() {
    let sb = Sandbox::new();
    let model = Model::tcp(&["m1", "evil"], vec![], None);
    let run = sb.run_env(
        &agent_job(json!({ "task_context": "x" })),
        &[
            ("OLLAMA_BASE_URL", &model.url),
            ("SBA_INFERENCE_MODEL", "evil"),
        ],
    );
    assert_eq!(run.failure(), "policy_violation");
    assert_eq!(
        run.message(),
        "model `evil` is not in inference.allowed_models (m1)"
    );
    assert!(run.result.steps.is_empty());
    assert_eq!(model.seen().len(), 0);
    assert_eq!(*model.models_calls.lock().unwrap(), 0);
}

/// Upstream CyNodeAI's name for the model, INFERENCE_MODEL, selects it too.
#[test]
fn upstream_inference_model_selects_the_model() {
    let sb = Sandbox::new();
    let model = Model::tcp(&["m1", "evil"], vec![], None);
    let run = sb.run_env(
        &agent_job(json!({ "task_context": "x" })),
        &[("OLLAMA_BASE_URL", &model.url), ("INFERENCE_MODEL", "evil")],
    );
    assert_eq!(
        (run.failure(), run.message()),
        (
            "policy_violation".to_string(),
            "model `evil` is not in inference.allowed_models (m1)".to_string()
        )
    );
}

#[test]
fn an_allowed_model_the_endpoint_does_not_serve_fails_before_any_step() {
    let sb = Sandbox::new();
    let model = Model::tcp(&["other"], vec![], None);
    let run = sb.run_env(
        &agent_job(json!({ "task_context": "x" })),
        &[("OLLAMA_BASE_URL", &format!("{}/v1", model.url))],
    );
    assert_eq!(run.failure(), "execution_failure");
    assert_eq!(
        run.message(),
        format!(
            "inference endpoint {}/v1 (from OLLAMA_BASE_URL) serves none of the allowed models (m1); it serves: other",
            model.url
        )
    );
    assert!(run.result.steps.is_empty());
    assert_eq!(model.seen().len(), 0);
    assert_eq!(run.result.todo, Some(vec![]));
}

#[test]
fn a_job_without_allowed_models_does_not_validate() {
    let sb = Sandbox::new();
    let mut job = agent_job(json!({ "task_context": "x" }));
    job.as_object_mut().unwrap().remove("inference");
    let run = sb.run_env(&job, &[]);
    assert_eq!(run.failure(), "schema_validation");
    assert_eq!(
        run.message(),
        "inference.allowed_models: agent_inference needs at least one allowed model"
    );
}

#[test]
fn invalid_replies_are_fed_back_and_retried() {
    let sb = Sandbox::new();
    let (model, run) = run_scripted(
        &sb,
        vec![
            Reply::Raw("sure! here is the file".into()),
            Reply::Action(
                json!({ "thought": "", "action": { "type": "launch_missiles", "arguments": {} } }),
            ),
            finish("success", "nothing to do"),
        ],
    );
    assert_eq!(run.result.status, JobStatus::Success, "{}", run.message());
    assert_eq!(run.result.final_answer.as_deref(), Some("nothing to do"));
    let second = model.last_message(1);
    assert!(
        second.starts_with("Your reply was not a valid action: not a valid reply:"),
        "{second}"
    );
    let third = model.last_message(2);
    assert!(
        third.contains("action.type: unknown action `launch_missiles`"),
        "{third}"
    );
    // The invalid reply itself stays in the history, so the model sees what it said.
    let msgs = model.seen()[1].body["messages"].clone();
    assert_eq!(msgs[2]["role"], "assistant");
    assert_eq!(msgs[2]["content"], "sure! here is the file");
}

#[test]
fn retries_are_bounded() {
    let sb = Sandbox::new();
    let bad = || Reply::Raw("{\"thought\": 1}".into());
    let model = Model::tcp(&["m1"], vec![bad(), bad(), bad(), bad()], None);
    let run = sb.run_env(
        &agent_job(json!({ "task_context": "x" })),
        &[("OLLAMA_BASE_URL", &model.url)],
    );
    run.assert_failure(
        "execution_failure",
        "the model gave no valid action in 3 replies in a row; last problem: not a valid reply",
    );
    assert_eq!(model.seen().len(), 3);
}

#[test]
fn a_slow_model_times_out_at_the_job_deadline() {
    let sb = Sandbox::new();
    let model = Model::tcp(
        &["m1"],
        vec![Reply::Slow(
            Duration::from_secs(60),
            json!({ "thought": "", "action": { "type": "finish", "arguments": { "status": "success", "final_answer": "late" } } }),
        )],
        None,
    );
    let mut job = agent_job(json!({ "task_context": "x" }));
    job["constraints"]["max_runtime_seconds"] = 2.into();
    let t = Instant::now();
    let run = sb.run_env(&job, &[("OLLAMA_BASE_URL", &model.url)]);
    let took = t.elapsed();
    assert_eq!(run.result.status, JobStatus::Timeout);
    assert_eq!(run.failure(), "timeout");
    assert_eq!(
        run.message(),
        "job deadline (constraints.max_runtime_seconds) reached while waiting for the inference endpoint (POST /v1/chat/completions)"
    );
    assert_eq!(run.code, Some(1));
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[test]
fn a_failed_step_is_recorded_and_fed_back() {
    let sb = Sandbox::new();
    let (model, run) = run_scripted(
        &sb,
        vec![
            act(
                "run_command",
                json!({ "command": "ls", "args": ["no-such-dir"] }),
            ),
            finish("failure", "the directory does not exist"),
        ],
    );
    assert_eq!(run.failure(), "step_failed");
    assert_eq!(
        run.message(),
        "the agent gave up: the directory does not exist"
    );
    assert_eq!(run.result.steps[0].status, StepStatus::Failure);
    assert_eq!(
        (
            run.step(0)["failure_code"].clone(),
            run.step(0)["error"].clone()
        ),
        (
            json!("step_failed"),
            json!("command `ls` exited with status 2")
        )
    );
    let obs = model.last_message(1);
    assert!(
        obs.starts_with("Result of agent-1 (run_command): failure\nerror (step_failed): command `ls` exited with status 2\nexit_code: 2"),
        "{obs}"
    );
    assert!(obs.contains("no-such-dir"), "{obs}");
    assert_eq!(run.result.final_answer, None);
}

#[test]
fn the_output_cap_holds_for_a_command_the_model_runs() {
    let sb = Sandbox::new();
    let model = Model::tcp(
        &["m1"],
        vec![
            act(
                "run_command",
                json!({ "command": "seq", "args": ["1", "100000"] }),
            ),
            finish("success", "unreachable"),
        ],
        None,
    );
    let mut job = agent_job(json!({ "task_context": "x" }));
    job["constraints"]["max_output_bytes"] = 200.into();
    let run = sb.run_env(&job, &[("OLLAMA_BASE_URL", &model.url)]);
    run.assert_failure(
        "constraint_violation",
        "step agent-1: output of `seq` exceeded max_output_bytes",
    );
    let out = &run.step(0)["result"];
    assert_eq!(out["truncated"], true);
    let kept = out["stdout"].as_str().unwrap().len() + out["stderr"].as_str().unwrap().len();
    assert!(kept < 400, "kept {kept} bytes");
    // The job ended at the violation, as a direct step would end it.
    assert_eq!(model.seen().len(), 1);
}

#[test]
fn a_path_escape_by_the_model_is_refused() {
    let sb = Sandbox::new();
    let (model, run) = run_scripted(
        &sb,
        vec![
            act("read_file", json!({ "path": "../outside/secret.txt" })),
            finish("success", "unreachable"),
        ],
    );
    assert_eq!(run.failure(), "policy_violation");
    assert_eq!(
        run.message(),
        "step agent-1: path escapes workspace: ../outside/secret.txt (`..` climbs above the root)"
    );
    assert_eq!(run.result.steps[0].status, StepStatus::Failure);
    assert!(!run.raw.to_string().contains("top secret"));
    assert_eq!(model.seen().len(), 1);
}

#[test]
fn an_endpoint_that_is_down_fails_clearly() {
    let sb = Sandbox::new();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let t = Instant::now();
    let run = sb.run_env(
        &agent_job(json!({ "task_context": "x" })),
        &[("OLLAMA_BASE_URL", &format!("http://127.0.0.1:{port}"))],
    );
    run.assert_failure("execution_failure", &format!(
            "inference endpoint http://127.0.0.1:{port} (from OLLAMA_BASE_URL) failed: GET /v1/models: cannot connect:"
        ));
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn an_endpoint_error_status_fails_with_its_message() {
    let sb = Sandbox::new();
    let model = Model::tcp(
        &["m1"],
        vec![Reply::Status(400, r#"{"error":"bad schema"}"#.into())],
        None,
    );
    let run = sb.run_env(
        &agent_job(json!({ "task_context": "x" })),
        &[("OLLAMA_BASE_URL", &model.url)],
    );
    assert_eq!(run.failure(), "execution_failure");
    assert_eq!(
        run.message(),
        format!(
            "inference endpoint {}: POST /v1/chat/completions answered HTTP 400: {{\"error\":\"bad schema\"}}",
            model.url
        )
    );
}

#[test]
fn turns_are_bounded() {
    let sb = Sandbox::new();
    let look = || act("list_tree", json!({ "path": "." }));
    let model = Model::tcp(&["m1"], vec![look(), look(), look()], None);
    let run = sb.run_env(
        &agent_job(json!({ "task_context": "x" })),
        &[
            ("OLLAMA_BASE_URL", &model.url),
            ("SBA_AGENT_MAX_TURNS", "2"),
        ],
    );
    assert_eq!(run.failure(), "execution_failure");
    assert_eq!(
        run.message(),
        "the agent used all 2 turns without finishing"
    );
    assert_eq!(run.result.steps.len(), 2);
}

#[test]
fn finishing_with_open_todo_items_is_refused_then_reported_honestly() {
    let sb = Sandbox::new();
    let model = Model::tcp(
        &["m1"],
        vec![finish("success", "done!"), finish("success", "really done")],
        None,
    );
    let run = sb.run_env(
        &agent_job(json!({ "task_context": "x", "acceptance_criteria": ["tests pass"] })),
        &[("OLLAMA_BASE_URL", &model.url)],
    );
    assert!(model.last_message(1).starts_with(
        "You cannot finish with success yet: these todo items are not done: ac-1 (tests pass)."
    ));
    assert_eq!(run.failure(), "step_failed");
    assert_eq!(
        run.message(),
        "the agent finished with 1 todo items not done: ac-1 (tests pass); its answer: really done"
    );
    assert_eq!(
        run.result.todo,
        Some(vec![todo("ac-1", "tests pass", TodoStatus::Pending)])
    );
    assert_eq!(run.result.final_answer, None);
}

#[test]
fn suggested_steps_seed_the_todo_list_and_are_not_run() {
    let sb = Sandbox::new();
    let model = Model::tcp(
        &["m1"],
        vec![
            act("todo", json!({ "complete": ["step-s1"] })),
            finish("success", "ok"),
        ],
        None,
    );
    let mut job = agent_job(json!({ "task_context": "x" }));
    job["steps"] = json!([{ "id": "s1", "type": "run_command", "arguments": { "command": "touch", "args": ["ran"] } }]);
    let run = sb.run_env(&job, &[("OLLAMA_BASE_URL", &model.url)]);
    assert_eq!(run.result.status, JobStatus::Success, "{}", run.message());
    assert!(!sb.ws().join("ran").exists());
    assert_eq!(
        run.result.todo,
        Some(vec![todo(
            "step-s1",
            "suggested step: run_command touch ran",
            TodoStatus::Done
        )])
    );
}

/// A stand-in for the node's gateway socket: answers every `tools/call` with the tool's
/// name as its result and records the request bodies.
fn fake_gateway(path: &std::path::Path) -> std::sync::Arc<std::sync::Mutex<Vec<Value>>> {
    use std::io::{BufRead, BufReader, Read, Write};
    let l = std::os::unix::net::UnixListener::bind(path).unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let out = seen.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut len = 0;
            loop {
                let mut line = String::new();
                if r.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap();
                }
            }
            let mut b = vec![0; len];
            r.read_exact(&mut b).unwrap();
            let req: Value = serde_json::from_slice(&b).unwrap();
            let body = json!({ "jsonrpc": "2.0", "id": req["id"], "result": {
                "content": [], "structuredContent": { "called": req["params"]["name"] } } })
            .to_string();
            seen.lock().unwrap().push(req);
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
        }
    });
    out
}

#[test]
fn listed_gateway_tools_are_called_and_unlisted_ones_refused_before_any_call() {
    let sb = Sandbox::new();
    let sock = sb.job_dir().join("gateway.sock");
    let calls = fake_gateway(&sock);
    let model = Model::tcp(
        &["m1"],
        vec![
            act(
                "tool_call",
                json!({ "name": "artifact.put", "arguments": { "path": "n.txt", "content": "hi" } }),
            ),
            act(
                "tool_call",
                json!({ "name": "db.query", "arguments": { "sql": "select 1" } }),
            ),
            act(
                "tool_call",
                json!({ "name": "skills.get", "arguments": { "skill_id": "x" } }),
            ),
            finish("success", "stored n.txt"),
        ],
        None,
    );
    let mut job = agent_job(json!({ "task_context": "x" }));
    job["context"]["mcp_tools"] = json!(["artifact.put", "skills.get"]);
    let url = format!(
        "http+unix://{}/",
        sock.display().to_string().replace('/', "%2F")
    );
    let run = sb.run_env(
        &job,
        &[("OLLAMA_BASE_URL", &model.url), ("SBA_GATEWAY_URL", &url)],
    );
    assert_eq!(run.result.status, JobStatus::Success, "{}", run.message());
    // Only the listed tools reached the gateway; the put was encoded and hashed.
    let calls = calls.lock().unwrap().clone();
    let names: Vec<&str> = calls
        .iter()
        .map(|c| c["params"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["artifact.put", "skills.get"]);
    assert_eq!(calls[0]["params"]["arguments"]["content_base64"], "aGk=");
    // result.json records all three, the refusal with its reason.
    let recorded: Vec<(String, String, bool)> = run.raw["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["tool"].as_str().unwrap().to_string(),
                c["outcome"].as_str().unwrap().to_string(),
                c["bytes"].as_u64().unwrap() > 0,
            )
        })
        .collect();
    let r = |t: &str, o: &str, b: bool| (t.to_string(), o.to_string(), b);
    assert_eq!(
        recorded,
        [
            r("artifact.put", "ok", true),
            r("db.query", "refused", false),
            r("skills.get", "ok", true)
        ]
    );
    // The model was offered only the listed tools, and read the refusal.
    let seen = model.seen.lock().unwrap().clone();
    let schema = &seen[0].body["response_format"]["json_schema"]["schema"];
    assert!(
        schema
            .to_string()
            .contains(r#""enum":["artifact.put","skills.get"]"#),
        "{schema}"
    );
    let obs = seen[2].body["messages"].as_array().unwrap().last().unwrap()["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        obs.starts_with("Result of tool_call db.query: refused\ntool `db.query` refused: not in context.mcp_tools"),
        "{obs}"
    );
}

#[test]
fn a_job_listing_no_tools_is_not_offered_tool_calls() {
    let sb = Sandbox::new();
    let (model, run) = run_scripted(
        &sb,
        vec![
            act("tool_call", json!({ "name": "skills.list" })),
            finish("success", "done"),
        ],
    );
    assert_eq!(run.result.status, JobStatus::Success, "{}", run.message());
    assert_eq!(run.raw["tool_calls"][0]["outcome"], "refused");
    let seen = model.seen.lock().unwrap().clone();
    assert!(!seen[0].body["response_format"]
        .to_string()
        .contains("tool_call"));
    assert!(!seen[0].body["messages"][0]["content"]
        .as_str()
        .unwrap()
        .contains("tool_call"));
}
