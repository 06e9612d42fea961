//! A hosted model (one that takes an API key) runs agent jobs on `cynode-pm run`'s local
//! worker while the key stays in the PM's process: the worker's inference upstream is the
//! run's relay, which adds the key. The model here is the scripted one behind a check
//! that demands the key (401 without it). While the agent job runs, the key is looked for
//! in the worker's and keeper's environment and command line, the worker's config and
//! every file of the state directory (job.json included); after the run, in every file of
//! the state directory again (result.json, logs, the PM's database) and the PM's output.
//! It is found nowhere but in the requests the model got. The worker holds no standing
//! credential of the relay's (each job carries a key of its own, `key_per_job`); the
//! relay refuses a caller without a live job key, and is gone once the run ends. A PM
//! killed mid-job leaves its worker calling its relay's address: the PM that resumes
//! serves the relay there, and the worker's next agent job reaches the model.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use cynode_testkit::scripted_model::{serve_in_background, Reply, ScriptedModel};

/// The hosted model's key: random per test run.
fn key() -> String {
    format!("sk-hosted-{}", uuid::Uuid::new_v4().simple())
}

/// What the key check saw while the job ran.
#[derive(Default)]
struct Seen {
    /// Requests refused for want of the key.
    refused: usize,
    /// Places the key was found in a look taken during a request (should stay empty).
    leaks: Vec<String>,
    /// Looks taken while a job.json existed.
    looks_during_a_job: usize,
    /// The relay's answers to callers without its token (status codes).
    relay_without_token: Vec<u16>,
    /// The relays' base URLs, as the worker's config names them.
    relays: Vec<String>,
}

struct Check {
    key: String,
    state: PathBuf,
    seen: Mutex<Seen>,
}

/// Files larger than this are the worker's filesystem images (sparse, mounted): their
/// contents are read through their mount points, which the walk enters as directories.
const IMAGE_BYTES: u64 = 64 << 20;

/// Every regular file under `dir` (no links followed) whose bytes contain `needle`
/// (filesystem images, over [`IMAGE_BYTES`], are read through their mounts instead).
pub(crate) fn files_containing(dir: &Path, needle: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(t) = e.file_type() else { continue };
            let p = e.path();
            if t.is_dir() {
                stack.push(p);
            } else if t.is_file() && e.metadata().is_ok_and(|m| m.len() <= IMAGE_BYTES) {
                if let Ok(bytes) = std::fs::read(&p) {
                    if bytes.windows(needle.len()).any(|w| w == needle) {
                        found.push(p.display().to_string());
                    }
                }
            }
        }
    }
    found
}

/// Every job.json under `dir`.
fn job_files(dir: &Path) -> usize {
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let Ok(t) = e.file_type() else { continue };
            if t.is_dir() {
                stack.push(e.path());
            } else if e.file_name() == "job.json" {
                n += 1;
            }
        }
    }
    n
}

/// The keeper's and worker's process ids, from the keeper's lease file.
fn worker_pids(state: &Path) -> Vec<u32> {
    let Ok(text) = std::fs::read_to_string(state.join("worker").join("keeper.json")) else {
        return Vec::new();
    };
    let v: Value = serde_json::from_str(&text).unwrap_or_default();
    ["keeper_pid", "worker_pid"]
        .iter()
        .filter_map(|k| v[k].as_u64().map(|p| p as u32))
        .collect()
}

/// The local worker's config files (worker-TAG.yaml).
fn worker_configs(state: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(state.join("worker"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("worker-") && n.ends_with(".yaml"))
        })
        .collect()
}

impl Check {
    /// Looks for the key everywhere on the worker's side, and knocks at the relay without
    /// its token.
    async fn look(&self) {
        let key = self.key.as_bytes();
        let mut leaks = files_containing(&self.state, key);
        let pids = worker_pids(&self.state);
        // The job's volumes are mounted in the worker's mount namespace: its view.
        let worker_view = pids.last().map(|pid| {
            Path::new(&format!("/proc/{pid}/root"))
                .join(self.state.strip_prefix("/").unwrap_or(&self.state))
        });
        if let Some(v) = &worker_view {
            leaks.extend(files_containing(v, key));
        }
        for pid in &pids {
            for what in ["environ", "cmdline"] {
                let p = format!("/proc/{pid}/{what}");
                match std::fs::read(&p) {
                    Ok(b) if b.windows(key.len()).any(|w| w == key) => leaks.push(p),
                    Ok(_) => {}
                    Err(e) => leaks.push(format!("{p} unreadable: {e}")),
                }
            }
        }
        let mut statuses = Vec::new();
        let mut relays = Vec::new();
        for cfg in worker_configs(&self.state) {
            let text = std::fs::read_to_string(&cfg).unwrap_or_default();
            let v: serde_yaml::Value = serde_yaml::from_str(&text).unwrap_or_default();
            let Some(base) = v["inference"]["base_url"].as_str() else {
                leaks.push(format!("{} has no inference upstream", cfg.display()));
                continue;
            };
            // No standing credential: each job carries a key of its own.
            if v["inference"]["key_per_job"].as_bool() != Some(true)
                || !v["inference"]["api_key_file"].is_null()
            {
                leaks.push(format!(
                    "{} names a key file or lacks key_per_job: {text}",
                    cfg.display()
                ));
            }
            relays.push(base.to_string());
            let http = reqwest::Client::builder()
                .timeout(std::time::Duration::from_secs(10))
                .build()
                .unwrap();
            let url = format!("{base}/v1/chat/completions");
            let body = json!({ "model": "smollm2", "messages": [] });
            for token in [None, Some("not-the-token"), Some(self.key.as_str())] {
                let mut rq = http.post(&url).json(&body);
                if let Some(t) = token {
                    rq = rq.bearer_auth(t);
                }
                statuses.push(rq.send().await.map_or(0, |r| r.status().as_u16()));
            }
        }
        let during_job = worker_view.is_some_and(|v| job_files(&v.join("worker")) > 0);
        let mut seen = self.seen.lock().unwrap();
        seen.leaks.extend(leaks);
        seen.relay_without_token.extend(statuses);
        seen.relays.extend(relays);
        if during_job {
            seen.looks_during_a_job += 1;
        }
    }
}

/// Demands the key; looks around on every chat request.
async fn demand_key(State(c): State<Arc<Check>>, req: Request, next: Next) -> Response {
    let ok = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == format!("Bearer {}", c.key));
    if !ok {
        c.seen.lock().unwrap().refused += 1;
        return (axum::http::StatusCode::UNAUTHORIZED, "a key is required").into_response();
    }
    if req.uri().path() == "/v1/chat/completions" {
        c.look().await;
    }
    next.run(req).await
}

/// The scripted model answering `script` behind the check that demands `key` and looks
/// for it around `state`; with its base URL.
fn keyed_model(script: Vec<Value>, key: &str, state: &Path) -> (ScriptedModel, Arc<Check>, String) {
    let model = ScriptedModel::new(
        script.into_iter().map(Reply::from),
        Reply::Status(500, "script exhausted".into()),
    );
    let check = Arc::new(Check {
        key: key.to_string(),
        state: state.to_path_buf(),
        seen: Mutex::default(),
    });
    let app = model.router().layer(axum::middleware::from_fn_with_state(
        Arc::clone(&check),
        demand_key,
    ));
    let base = format!("http://{}/v1", serve_in_background(app));
    (model, check, base)
}

/// An agent skill with no tools: the SBA asks the model, which finishes.
fn agent_skill(skills: &Path) {
    let template = json!({
        "execution_mode": "agent_inference",
        "inference": { "allowed_models": ["smollm2"] },
        "constraints": { "max_runtime_seconds": 90, "max_output_bytes": 65536 },
        "context": { "task_context": "say that the hosted model answered" }
    });
    cynode_tests::write_skill(
        &skills.join("hosted-agent"),
        "skill_id: hosted-agent\nversion: 1.0.0\ndescription: an agent on the hosted model\npurpose: base-tools\nallowed_commands: [sh]\nlimits:\n  max_runtime_seconds: 90\n  max_output_bytes: 65536\ninputs_schema:\n  type: object\n  additionalProperties: false\n  properties: {}\n",
        &template.to_string(),
        "{}",
    );
}

#[test]
fn a_hosted_model_runs_an_agent_job_and_its_key_stays_in_the_pm() {
    hosted_model_runs_an_agent_job("bwrap");
}

#[test]
fn podman_a_hosted_model_runs_an_agent_job_and_its_key_stays_in_the_pm() {
    hosted_model_runs_an_agent_job("podman");
}

#[test]
fn docker_a_hosted_model_runs_an_agent_job_and_its_key_stays_in_the_pm() {
    hosted_model_runs_an_agent_job("docker");
}

/// `cynode-pm run` with a keyed model and its local worker on `backend`: the agent job
/// reaches the model through the PM's relay, and the key is found nowhere but in the
/// requests the model server got.
fn hosted_model_runs_an_agent_job(backend: &str) {
    let dir = cynode_tests::tempdir().unwrap();
    let state = dir.path().join("state");
    let key = key();
    let skills = dir.path().join("skills");
    agent_skill(&skills);
    // The PM's turns and the SBA's one turn, in the order they are asked.
    let script = vec![
        json!({ "type": "plan_update", "payload": {}, "state_patch": [
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "ask the agent", "status": "pending" } }] }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": "hosted-agent", "inputs": {} } }),
        json!({ "thought": "done", "action": { "type": "finish",
            "arguments": { "status": "success", "final_answer": "the hosted model answered" } } }),
        json!({ "type": "final", "state_patch": [], "payload": { "summary": "the agent finished" } }),
    ];
    let (model, check, base) = keyed_model(script, &key, &state);
    let skill_dir = skills.display().to_string();
    let out = cynode_tests::pm_on(
        backend,
        &state,
        &base,
        &[
            "run",
            "let an agent answer on the hosted model",
            "--skill-dir",
            &skill_dir,
        ],
        &[("CYNODE_MODEL_API_KEY", key.as_str())],
    );
    let v = cynode_tests::completed(&out);
    let job = &v["deliverable"]["report"]["tasks"][0]["jobs"][0];
    assert_eq!(job["status"], "completed", "{v}");

    // The model got the PM's three turns and the agent's one, each with the key.
    let requests = model.requests();
    let chats: Vec<_> = requests
        .iter()
        .filter(|r| r.path == "/v1/chat/completions")
        .collect();
    assert_eq!(chats.len(), 4, "{requests:?}");
    let bearer = format!("Bearer {key}");
    assert!(requests
        .iter()
        .all(|r| r.authorization.as_deref() == Some(bearer.as_str())));
    let seen = check.seen.lock().unwrap();
    assert_eq!(seen.refused, 0, "a request came without the key");
    assert!(
        seen.looks_during_a_job >= 1,
        "no look was taken while the job ran"
    );
    assert!(seen.leaks.is_empty(), "the key was found: {:?}", seen.leaks);
    // Without a live job key (none, a wrong one, the model's key): 401 from the relay.
    assert!(!seen.relay_without_token.is_empty());
    assert!(
        seen.relay_without_token.iter().all(|s| *s == 401),
        "{:?}",
        seen.relay_without_token
    );
    drop(seen);

    // After the run: nowhere in the state directory (result.json, logs, the PM's
    // database), nowhere in what the PM printed.
    assert_key_stayed_in_the_pm(&state, &key, &out);
    // The relay ended with the run.
    let relays = check.seen.lock().unwrap().relays.clone();
    assert!(!relays.is_empty());
    for base in relays {
        let addr = base.trim_start_matches("http://");
        assert!(
            std::net::TcpStream::connect(addr).is_err(),
            "the relay at {base} still listens"
        );
    }
}

/// After a run with a keyed model: `key` is in no file of the PM's `state` directory
/// (result.json, logs, the PM's database) and nowhere in what the PM printed (`out`).
pub(crate) fn assert_key_stayed_in_the_pm(state: &Path, key: &str, out: &std::process::Output) {
    let leaks = files_containing(state, key.as_bytes());
    assert!(leaks.is_empty(), "the key was found in {leaks:?}");
    for (name, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
        assert!(
            !bytes.windows(key.len()).any(|w| w == key.as_bytes()),
            "the key is in the PM's {name}"
        );
    }
}

/// `cynode-pm run` with a keyed model is killed (-9) while its local worker runs a job;
/// the worker outlives it, still calling the dead PM's relay. `sessions resume` attaches
/// to that worker and serves the relay at that address with that token, so the agent job
/// it dispatches next reaches the model, with the key added by the resumed PM only.
#[test]
fn after_a_kill_9_the_resumed_pm_serves_the_relay_its_worker_calls() {
    use crate::reliability::{slow_skill, spawn_pm, wait_for, workspace, Keeper};
    use std::time::Duration;
    let logs = cynode_tests::tempdir().unwrap();
    let dir = cynode_tests::tempdir().unwrap();
    let state = dir.path().join("state");
    let key = key();
    let skills = dir.path().join("skills");
    agent_skill(&skills);
    slow_skill(&skills);
    let script = vec![
        json!({ "type": "plan_update", "payload": {}, "state_patch": [
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "a slow job", "status": "pending" } },
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t2", "description": "ask the agent", "status": "pending" } }] }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": "slow-mark", "inputs": { "seconds": 6 } } }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t2", "skill_id": "hosted-agent", "inputs": {} } }),
        json!({ "thought": "done", "action": { "type": "finish",
            "arguments": { "status": "success", "final_answer": "the hosted model answered" } } }),
        json!({ "type": "final", "state_patch": [], "payload": { "summary": "both tasks done" } }),
    ];
    let (model, check, base) = keyed_model(script, &key, &state);
    let skill_dir = skills.display().to_string();
    let envs = [
        ("CYNODE_MODEL_API_KEY", key.as_str()),
        ("CYNODE_LOCAL_WORKER_GRACE_SECONDS", "120"),
    ];
    let mut first = spawn_pm(
        logs.path(),
        "first",
        &state,
        &base,
        &[
            "--skill-dir",
            &skill_dir,
            "run",
            "a slow job, then an agent",
        ],
        &envs,
    );
    let id = first.session_id(Duration::from_secs(120));
    let keeper = Keeper::of(&state, Duration::from_secs(120));
    let runs = workspace(&state, &id).join("runs.txt");
    wait_for(Duration::from_secs(120), "the slow job to start", || {
        runs.is_file()
    });
    // SAFETY: SIGKILL to the cynode-pm process this test started, not yet reaped.
    unsafe {
        libc::kill(first.pid() as i32, libc::SIGKILL);
    }
    let _ = first.child.wait();
    assert!(keeper.alive(), "the local worker died with its PM");

    let mut resumed = spawn_pm(
        logs.path(),
        "resume",
        &state,
        &base,
        &["--skill-dir", &skill_dir, "sessions", "resume", &id],
        &envs,
    );
    let (code, v) = resumed.finish(Duration::from_secs(180));
    let stderr = resumed.stderr();
    assert_eq!(code, Some(0), "{v} {stderr}");
    assert!(
        stderr.contains("using the local worker already running"),
        "{stderr}"
    );
    assert!(
        stderr.contains("serving the inference relay the local worker calls at"),
        "{stderr}"
    );
    let tasks = &v["deliverable"]["report"]["tasks"];
    assert_eq!(tasks[1]["jobs"][0]["status"], "completed", "{v}");
    // Every model request carried the key (none came without it), and the agent's turn
    // was among them: plan, two jobs, the agent, final.
    let chats = model
        .requests()
        .iter()
        .filter(|r| r.path == "/v1/chat/completions")
        .count();
    assert_eq!(chats, 5, "{:?}", model.requests());
    let seen = check.seen.lock().unwrap();
    assert_eq!(seen.refused, 0, "a request came without the key");
    assert!(seen.leaks.is_empty(), "the key was found: {:?}", seen.leaks);
    drop(seen);
    wait_for(
        Duration::from_secs(60),
        "the keeper and the worker to stop after the resumed PM",
        || !keeper.alive(),
    );
    assert_key_stayed_in_the_pm(&state, &key, &resumed_output(&v, &stderr));
}

/// What the resumed PM printed, as [`assert_key_stayed_in_the_pm`] reads it.
fn resumed_output(v: &Value, stderr: &str) -> std::process::Output {
    use std::os::unix::process::ExitStatusExt;
    std::process::Output {
        status: std::process::ExitStatus::from_raw(0),
        stdout: v.to_string().into_bytes(),
        stderr: stderr.as_bytes().to_vec(),
    }
}
