//! `cynode-pm run` end to end: the real binary, a real local `cynode-worker` (bwrap
//! backend) running the real SBA, SQLite, and a scripted OpenAI-compatible model server
//! (real HTTP) whose replies drive the loop. Crash-resume uses the PM's failpoints.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::Router;
use cynode_testkit::{output_bounded, LocalModel};
use cynode_tests::pm::{pm_command, PM_LIMIT};
use cynode_tests::{
    completed, final_state, happy_script, model_server, pm_with, session_id, start_worker,
    workspace_root, write_then_search, TOKEN,
};
use serde_json::{json, Value};

fn pm(state: &Path, model: &str, args: &[&str], failpoint: Option<&str>) -> Output {
    let envs: Vec<_> = failpoint
        .map(|f| ("CYNODE_PM_FAILPOINT", f))
        .into_iter()
        .collect();
    pm_with(state, model, args, &envs)
}

/// The reply types a model request's response schema offers.
fn offered_kinds(request: &Value) -> Vec<String> {
    request["response_format"]["json_schema"]["schema"]["anyOf"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            v["properties"]["type"]["const"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

#[test]
fn objective_completes_through_worker_and_sba() {
    let state = cynode_tests::tempdir().unwrap();
    let (url, model) = model_server(happy_script());
    let out = pm(state.path(), &url, &["run", "greet the world"], None);
    let v = final_state(&out);
    assert_eq!(out.status.code(), Some(0), "{v}");
    assert_eq!(v["status"], "completed");
    assert_eq!(v["deliverable"]["summary"], "wrote hello.txt and found it");
    // The progress lines name the loop's model endpoint and each job's context.
    let progress = String::from_utf8_lossy(&out.stderr);
    assert!(
        progress.lines().any(|l| l.starts_with("model ")
            && l.trim_end_matches('/')
                .ends_with(&format!(" at {}", url.trim_end_matches('/')))),
        "{progress}"
    );
    assert_eq!(
        progress
            .lines()
            .filter(|l| l.starts_with("  context: \""))
            .count(),
        2,
        "{progress}"
    );
    let plan = cynode_tests::plan_statuses(&v);
    assert_eq!(
        plan,
        [
            ("t1".to_string(), "done".to_string()),
            ("t2".to_string(), "done".to_string())
        ]
    );
    assert_eq!(v["jobs_dispatched"], 2);
    let changeset = v["deliverable"]["changeset"].as_str().unwrap_or("");
    assert!(changeset.contains("+hello from the model"), "{changeset}");
    let reqs = model.requests();
    assert_eq!(reqs.len(), 4);
    assert_eq!(reqs[0]["response_format"]["type"], "json_schema");
    // The search result reached the model as a compact summary.
    let last = reqs[3].to_string();
    assert!(last.contains("hello.txt"), "{last}");
}

/// `run --workspace DIR`: the workspace is created, seeded from DIR, on the worker the
/// first job is placed on, before that job runs; the changeset is against the seed.
#[test]
fn seeded_workspace_is_created_where_the_first_job_runs() {
    let state = cynode_tests::tempdir().unwrap();
    let seed = cynode_tests::tempdir().unwrap();
    std::fs::write(seed.path().join("notes.txt"), "a seeded line\n").unwrap();
    let (url, model) = model_server(write_then_search("hi\n", "seeded"));
    let seed_arg = seed.path().display().to_string();
    let out = pm(
        state.path(),
        &url,
        &["run", "work on the seeded tree", "--workspace", &seed_arg],
        None,
    );
    let v = completed(&out);
    assert_eq!(v["worker_id"], "default");
    // The local worker let go of the workspace's volume when the run ended: its image
    // holds the seed.
    assert_eq!(
        cynode_tests::workspace_file(state.path(), &session_id(&out), "notes.txt").as_deref(),
        Some("a seeded line\n")
    );
    let changeset = v["deliverable"]["changeset"].as_str().unwrap_or("");
    assert!(
        changeset.contains("+hi") && !changeset.contains("notes.txt"),
        "{changeset}"
    );
    // The search ran in the seeded tree.
    let last = model.requests().last().unwrap().to_string();
    assert!(last.contains("notes.txt"), "{last}");
}

/// The progress guard: after three plan-only replies the next turn's schema has no
/// plan_update variant and the model is told to act; a fourth plan_update (from a backend
/// that ignores the schema) is rejected and asked again, and the session still completes.
#[test]
fn plan_only_replies_are_cut_short_by_the_progress_guard() {
    let state = cynode_tests::tempdir().unwrap();
    let plan_only =
        json!({ "type": "plan_update", "state_patch": [], "payload": { "note": "thinking" } });
    let (url, model) = model_server(vec![
        plan_only.clone(),
        plan_only.clone(),
        plan_only.clone(),
        plan_only,
        json!({ "type": "final", "state_patch": [], "payload": { "summary": "nothing to do" } }),
    ]);
    let out = pm(state.path(), &url, &["run", "do nothing"], None);
    let v = final_state(&out);
    assert_eq!(v["status"], "completed", "{v}");
    let reqs = model.requests();
    assert_eq!(reqs.len(), 5);
    assert!(offered_kinds(&reqs[2]).contains(&"plan_update".to_string()));
    assert_eq!(offered_kinds(&reqs[3]), ["job_request", "message", "final"]);
    assert!(reqs[3].to_string().contains("plan_update 3 times in a row"));
    // The rejected fourth plan_update was fed back, not acted on.
    assert!(
        reqs[4].to_string().contains("not accepted this turn"),
        "{}",
        reqs[4]
    );
    let replies = cynode_tests::history_count(&v, "model_reply");
    assert_eq!(replies, 4);
}

/// Without a person to answer (`run --non-interactive`; also the default when stdin is not
/// a terminal), the response schema never offers `message`, the first turn must act, a
/// job may not be requested once every task is done, and `final` may list only the
/// session's verified artifacts. A backend that ignores the schema is held to the same
/// rules: its off-schema replies are fed back and asked again.
#[test]
fn autonomous_run_acts_first_never_asks_and_finishes_on_evidence() {
    let state = cynode_tests::tempdir().unwrap();
    let write = json!({ "type": "job_request",
        "state_patch": [{ "op": "add", "path": "/plan/-", "value":
            { "task_id": "t1", "description": "write the greeting", "status": "in_progress" } }],
        "payload": { "task_id": "t1", "skill_id": "write-files",
            "inputs": { "files": [{ "path": "hello.txt", "content": "hi\n" }] } } });
    let (url, model) = model_server(vec![
        // Turn 0: only a job_request of the first-look skill (repo-inspect, with its
        // defaults) is accepted.
        json!({ "type": "message", "state_patch": [], "payload": { "text": "Which name?" } }),
        json!({ "type": "final", "state_patch": [], "payload": { "summary": "done already" } }),
        write.clone(),
        json!({ "type": "job_request",
            "state_patch": [{ "op": "add", "path": "/plan/-", "value":
                { "task_id": "t1", "description": "look", "status": "in_progress" } }],
            "payload": { "task_id": "t1", "skill_id": "repo-inspect", "inputs": {} } }),
        // Turn 1: t1 is done, so no job_request; a made-up artifact is refused; then a
        // plain final.
        write,
        json!({ "type": "final", "state_patch": [], "payload": { "summary": "wrote it",
            "artifacts": ["0".repeat(64)] } }),
        json!({ "type": "final", "state_patch": [], "payload": { "summary": "wrote hello.txt",
            "artifacts": [] } }),
    ]);
    let out = pm(
        state.path(),
        &url,
        &["run", "greet the world", "--non-interactive"],
        None,
    );
    let v = completed(&out);
    assert_eq!(v["jobs_dispatched"], 1, "{v}");
    assert_eq!(v["interactive"], false, "{v}");
    let reqs = model.requests();
    assert_eq!(reqs.len(), 7, "{reqs:?}");
    assert_eq!(offered_kinds(&reqs[0]), ["job_request"]);
    assert_eq!(offered_kinds(&reqs[4]), ["plan_update", "final"]);
    for (i, r) in reqs.iter().enumerate() {
        assert!(
            !offered_kinds(r).contains(&"message".to_string()),
            "request {i}"
        );
    }
    let fed_back: Vec<String> = reqs[1..].iter().map(|r| r.to_string()).collect();
    for (i, told) in [
        (0, "`message` is not accepted this turn"),
        (1, "`final` is not accepted this turn"),
        (2, "the first job looks at the workspace"),
        (4, "`job_request` is not accepted this turn"),
        (5, "is not the sha256 of an artifact of this session"),
        (0, "No job has run yet"),
    ] {
        assert!(fed_back[i].contains(told), "{}", fed_back[i]);
    }
    // Progress shows the chain: the job, its sandbox, its verified artifacts.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("skill repo-inspect for task t1, on worker"),
        "{err}"
    );
}

/// The built-in skills and policy are in the binary: `run` works from an empty directory.
#[test]
fn run_works_from_an_empty_directory() {
    let state = cynode_tests::tempdir().unwrap();
    let empty = cynode_tests::tempdir().unwrap();
    let (url, _model) = model_server(happy_script());
    let mut cmd = pm_command(state.path(), &url, &["run", "greet the world"], &[]);
    cmd.current_dir(empty.path());
    let out = output_bounded(cmd, PM_LIMIT);
    let v = completed(&out);
    assert_eq!(v["jobs_dispatched"], 2, "{v}");
    assert_eq!(
        std::fs::read_dir(empty.path()).unwrap().count(),
        0,
        "run wrote into its working directory"
    );
}

fn crash_then_resume(failpoint: &str) {
    let state = cynode_tests::tempdir().unwrap();
    let (url, model) = model_server(happy_script());
    let out = pm(
        state.path(),
        &url,
        &["run", "greet the world"],
        Some(failpoint),
    );
    assert_ne!(out.status.code(), Some(0), "the failpoint did not fire");
    let id = session_id(&out);
    let out = pm(state.path(), &url, &["sessions", "resume", &id], None);
    let v = completed(&out);
    // No duplicate model call: exactly one request per scripted reply.
    assert_eq!(model.requests().len(), 4, "{failpoint}");
    // No duplicate job: write-files refuses to overwrite, so a second run would have failed.
    assert_eq!(v["jobs_dispatched"], 2);
    let events = cynode_tests::history_kinds(&v);
    assert_eq!(
        events.iter().filter(|k| **k == "job_dispatched").count(),
        2,
        "{events:?}"
    );
    assert!(
        v["state"]["plan"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["status"] == "done"),
        "{v}"
    );
}

#[test]
fn crash_after_model_reply_resumes_without_asking_again() {
    crash_then_resume("after_model_reply");
}

#[test]
fn crash_after_dispatch_resumes_without_a_second_job() {
    crash_then_resume("after_dispatch");
}

#[test]
fn crash_after_result_resumes_without_a_second_job() {
    crash_then_resume("after_result");
}

#[test]
fn invalid_model_output_fails_with_model_contract_violation() {
    let state = cynode_tests::tempdir().unwrap();
    let garbage: Vec<Value> = (0..10)
        .map(|_| Value::String("this is not json".into()))
        .collect();
    let (url, model) = model_server(garbage);
    let out = pm(state.path(), &url, &["run", "anything"], None);
    let v = final_state(&out);
    assert_eq!(out.status.code(), Some(1), "{v}");
    assert_eq!(v["failure"]["kind"], "model_contract_violation");
    let n = model.requests().len();
    assert!((2..=5).contains(&n), "asked {n} times");
}

#[test]
fn policy_denial_is_fed_back_and_the_model_replans() {
    let state = cynode_tests::tempdir().unwrap();
    let script = vec![
        json!({ "type": "plan_update", "state_patch": [
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "write a file", "status": "pending" } }
        ], "payload": {} }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": "write-files",
            "inputs": { "files": [{ "path": "../../etc/cron.d/evil", "content": "x" }] } } }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": "write-files",
            "inputs": { "files": [{ "path": "ok.txt", "content": "x" }] } } }),
        json!({ "type": "final", "state_patch": [], "payload": { "summary": "wrote ok.txt instead" } }),
    ];
    let (url, model) = model_server(script);
    let out = pm(state.path(), &url, &["run", "write a file"], None);
    let v = final_state(&out);
    assert_eq!(out.status.code(), Some(0), "{v}");
    let reqs = model.requests();
    let third = reqs[2].to_string();
    assert!(
        third.contains("policy_violation") && third.contains("path_traversal"),
        "{third}"
    );
    assert_eq!(v["jobs_dispatched"], 1);
}

#[test]
fn clarification_round_trip() {
    let state = cynode_tests::tempdir().unwrap();
    let script = vec![
        json!({ "type": "message", "state_patch": [], "payload": { "text": "Which file name should I use?" } }),
        json!({ "type": "final", "state_patch": [], "payload": { "summary": "used the answer" } }),
    ];
    let (url, model) = model_server(script);
    let out = pm(state.path(), &url, &["run", "write something"], None);
    let v = final_state(&out);
    assert_eq!(out.status.code(), Some(3), "{v}");
    assert_eq!(v["status"], "awaiting_input");
    let id = session_id(&out);
    let out = pm(
        state.path(),
        &url,
        &["sessions", "resume", &id, "--answer", "notes.md"],
        None,
    );
    completed(&out);
    let second = model.requests()[1].to_string();
    assert!(second.contains("notes.md"), "{second}");
}

/// A test-only skill whose job leaves an artifact.
fn report_skill(dir: &Path) -> PathBuf {
    cynode_tests::write_skill(
        &dir.join("make-report"),
        "skill_id: make-report\nversion: 1.0.0\ndescription: write report.txt and collect it\npurpose: base-tools\nallowed_commands: []\nlimits:\n  max_runtime_seconds: 60\n  max_output_bytes: 65536\ninputs_schema:\n  type: object\n  additionalProperties: false\n  required: [text]\n  properties:\n    text: { type: string, maxLength: 1000 }\n",
        r#"{ "artifacts": ["report.txt"], "steps": [ { "id": "w", "type": "write_file", "arguments": { "path": "report.txt", "content": {{ inputs.text }} } } ] }"#,
        r#"{ "text": "x" }"#,
    );
    dir.to_path_buf()
}

pub(crate) async fn tampering_proxy(upstream: String) -> String {
    async fn forward(
        State(up): State<String>,
        req: axum::extract::Request,
    ) -> axum::response::Response {
        let (parts, body) = req.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        let url = format!("http://{up}{}", parts.uri);
        let mut r = reqwest::Client::new()
            .request(parts.method.clone(), url)
            .body(bytes.to_vec());
        if let Some(a) = parts.headers.get("authorization") {
            r = r.header("authorization", a.to_str().unwrap());
        }
        if let Some(c) = parts.headers.get("content-type") {
            r = r.header("content-type", c.to_str().unwrap());
        }
        let resp = r.send().await.unwrap();
        let status = resp.status().as_u16();
        let mut body = resp.bytes().await.unwrap().to_vec();
        if parts.uri.path().contains("/artifacts/") {
            body.extend_from_slice(b"tampered");
        }
        axum::response::Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body))
            .unwrap()
    }
    let app = Router::new().fallback(forward).with_state(upstream);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    format!("http://{addr}")
}

#[test]
fn tampered_artifact_is_rejected_with_artifact_integrity_failure() {
    let worker = start_worker(0);
    let skills = cynode_tests::tempdir().unwrap();
    report_skill(skills.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let proxy = rt.block_on(tampering_proxy(worker.addr.clone()));
    let script = vec![
        json!({ "type": "plan_update", "state_patch": [
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "report", "status": "pending" } }
        ], "payload": {} }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": "make-report", "inputs": { "text": "genuine" } } }),
        json!({ "type": "final", "state_patch": [], "payload": { "summary": "done" } }),
    ];
    let (url, model) = model_server(script);
    let state = cynode_tests::tempdir().unwrap();
    let skill_dir = skills.path().display().to_string();
    let out = pm_with(
        state.path(),
        &url,
        &[
            "run",
            "make a report",
            "--worker-endpoint",
            &proxy,
            "--skill-dir",
            "skills",
            "--skill-dir",
            &skill_dir,
        ],
        &[("CYNODE_WORKER_TOKEN", TOKEN)],
    );
    let v = final_state(&out);
    let events = cynode_tests::history_kinds(&v);
    assert!(events.contains(&"artifact_integrity_failure"), "{events:?}");
    assert_eq!(v["state"]["plan"][0]["status"], "failed", "{v}");
    assert_eq!(
        v["state"]["artifacts"],
        json!([]),
        "a rejected artifact must not be attached"
    );
    let third = model.requests()[2].to_string();
    assert!(third.contains("artifact_integrity_failure"), "{third}");
}

#[test]
fn worker_down_then_back_is_retried_without_duplicates() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (url, _model) = model_server(happy_script());
    let state = cynode_tests::tempdir().unwrap();
    let endpoint = format!("http://127.0.0.1:{port}");
    let starter = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(1500));
        start_worker(port)
    });
    let out = pm_with(
        state.path(),
        &url,
        &["run", "greet the world", "--worker-endpoint", &endpoint],
        &[("CYNODE_WORKER_TOKEN", TOKEN)],
    );
    let _worker = starter.join().unwrap();
    let v = completed(&out);
    assert_eq!(v["jobs_dispatched"], 2);
}

/// The whole test's budget: the model server's start and every PM run within it, well
/// under nextest's 300 s backstop.
const REAL_LLM_BUDGET: Duration = Duration::from_secs(230);

/// What a real-model run saw, for the verdict and for a failure message.
fn real_llm_report(model: &LocalModel, state: &Path, id: Option<&str>, stderr: &[u8]) -> String {
    let tps = model
        .last_tokens_per_second()
        .map_or_else(|| "unknown".to_string(), |t| format!("{t:.1}"));
    let (turns, last) = id
        .and_then(|id| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async {
                let url = format!("sqlite://{}", state.join("pm.db").display());
                let store = cynode_pm::store::Store::connect(&url).await.ok()?;
                let journal = store.journal(id).await.ok()?;
                let replies: Vec<_> = journal.iter().filter(|e| e.kind == "model_reply").collect();
                let last = replies.last().map(|e| e.data["raw"].to_string());
                Some((replies.len(), last.unwrap_or_else(|| "none".into())))
            })
        })
        .unwrap_or((0, "none".into()));
    let err = String::from_utf8_lossy(stderr);
    let tail: Vec<String> = err
        .lines()
        .rev()
        .take(6)
        .map(|l| l.chars().take(400).collect())
        .collect();
    format!(
        "{turns} replies passed the contract; the model generated {tps} tokens/s in its last completion; last reply: {last}; PM stderr (last lines, newest first): {tail:?}"
    )
}

/// One `cynode-pm` run against the real model, bounded by `deadline`; a run still going at
/// the deadline fails the test with what it saw.
fn real_pm(model: &LocalModel, state: &Path, args: &[&str], deadline: Instant) -> Output {
    let left = deadline.saturating_duration_since(Instant::now());
    let cmd = pm_command(state, &model.base_url, args, &[]);
    cynode_testkit::output_within(cmd, left).unwrap_or_else(|t| {
        let id = String::from_utf8_lossy(&t.stderr).lines().find_map(|l| {
            l.strip_prefix("session s-")
                .map(|r| format!("s-{}", r.split_whitespace().next().unwrap_or("")))
        });
        panic!(
            "the PM did not finish on the real model within the test's budget ({REAL_LLM_BUDGET:?}, this run {:?}): {}",
            t.elapsed,
            real_llm_report(model, state, id.as_deref(), &t.stderr)
        )
    })
}

/// The real local model (llama-server + SmolLM2-135M, built from the registries by
/// deploy/llm/setup.sh and started by deploy/llm/start.sh on this test's own port, stopped
/// at the end), the real worker and SBA: the loop runs on real, grammar-constrained
/// replies. The 135M model is not clever: it may plan, ask or finish without running
/// anything. When it asks, the test answers once through `sessions resume --answer` (the
/// clarification round trip on the real model). The test bounds its own work so that it
/// ends with its own verdict on a loaded 2-core machine: at most 4 turns per run, 400
/// tokens per reply (a plan reply needs about 250), and REAL_LLM_BUDGET for everything. It asserts the plumbing (real
/// requests answered, replies validated and acted on, a terminal state for a reason the
/// small model explains), not task success; the outcome is printed.
#[test]
fn real_llm_drives_the_loop() {
    let deadline = Instant::now() + REAL_LLM_BUDGET;
    let model = LocalModel::start(
        &workspace_root(),
        cynode_testkit::model::free_port(),
        Duration::from_secs(120),
    );
    let state = cynode_tests::tempdir().unwrap();
    let common = [
        "--no-builtin-skills",
        "--skill-dir",
        "skills/repo-inspect",
        "--skill-dir",
        "skills/search-code",
        "--max-turns",
        "4",
        "--max-tokens",
        "400",
    ];
    let mut args = vec![
        "run",
        "Look at the files in the workspace, then finish with a one-sentence summary.",
    ];
    args.extend(common);
    let mut out = real_pm(&model, state.path(), &args, deadline);
    if final_state(&out)["status"] == "awaiting_input" {
        let id = session_id(&out);
        let mut args = vec![
            "sessions",
            "resume",
            &id,
            "--answer",
            "Run the repo-inspect skill on the workspace now, then reply final.",
        ];
        args.extend(common);
        out = real_pm(&model, state.path(), &args, deadline);
    }
    let v = final_state(&out);
    let id = session_id(&out);
    let report = real_llm_report(&model, state.path(), Some(&id), &out.stderr);
    let replies = cynode_tests::history_count(&v, "model_reply");
    assert!(
        replies >= 1,
        "no reply of the real model passed the contract: {report}; state {v}"
    );
    let status = v["status"].as_str().unwrap();
    eprintln!(
        "real model: status {status}, {} jobs, failure {}; {report}",
        v["jobs_dispatched"], v["failure"]
    );
    assert!(
        matches!(status, "completed" | "failed" | "awaiting_input"),
        "{report}; state {v}"
    );
    if status == "failed" {
        let kind = v["failure"]["kind"].as_str().unwrap();
        assert!(
            matches!(
                kind,
                "budget_exhausted"
                    | "model_contract_violation"
                    | "task_failed"
                    | "policy_violation"
            ),
            "the loop broke for a reason other than the small model's limits: {report}; state {v}"
        );
    }
}

/// The tenant's `allowed_images` are checked against the image the job will actually run
/// in (the one its worker gives its purpose): a tenant whose list excludes it gets
/// `image_not_allowed` fed back and nothing runs; one whose list includes it runs the job.
#[test]
fn the_tenants_allowed_images_are_checked_against_the_image_the_job_runs_in() {
    const IMAGE: &str = "localhost/cynode-sba-test:latest";
    // A denied job leaves t1 open: the final closes it as skipped, with its reason.
    let script = |denied: bool| {
        let close = if denied {
            json!([
                { "op": "replace", "path": "/plan/0/status", "value": "skipped" },
                { "op": "add", "path": "/plan/0/reason", "value": "the image is not allowed" }
            ])
        } else {
            json!([])
        };
        vec![
            json!({ "type": "job_request", "state_patch": [
                { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "write a file", "status": "pending" } }
            ], "payload": { "task_id": "t1", "skill_id": "write-files",
                "inputs": { "files": [{ "path": "ok.txt", "content": "x" }] } } }),
            json!({ "type": "final", "state_patch": close, "payload": { "summary": "done" } }),
        ]
    };
    for (allowed, dispatched) in [
        ("docker.io/library/*", 0),
        ("localhost/cynode-sba-test:*", 1),
    ] {
        let state = cynode_tests::tempdir().unwrap();
        let tenant = state.path().join("tenant.yaml");
        std::fs::write(
            &tenant,
            format!("tenant_id: acme\nallowed_images: [\"{allowed}\"]\n"),
        )
        .unwrap();
        let (url, model) = model_server(script(dispatched == 0));
        let tenant_arg = tenant.display().to_string();
        let out = pm(
            state.path(),
            &url,
            &[
                "--tenant",
                &tenant_arg,
                "run",
                "write a file",
                "--sandbox-image",
                IMAGE,
            ],
            None,
        );
        let v = final_state(&out);
        assert_eq!(out.status.code(), Some(0), "{allowed}: {v}");
        assert_eq!(v["jobs_dispatched"], dispatched, "{allowed}: {v}");
        let second = model.requests()[1].to_string();
        let denied = format!(
            "image_not_allowed: skill `write-files`: image `{IMAGE}` is not in the tenant's allowed_images"
        );
        assert_eq!(
            second.contains(&denied),
            dispatched == 0,
            "{allowed}: {second}"
        );
    }
}
