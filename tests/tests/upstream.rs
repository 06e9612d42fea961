//! Our PM against a worker that speaks only upstream CyNodeAI's Worker API: an
//! in-process stand-in serving exactly upstream's endpoint set over real HTTP
//! (`GET /healthz`, `GET /readyz`, synchronous `POST /v1/worker/jobs:run`; anything
//! else 404 as Go's mux answers), which decodes requests and job.json with the mirrors
//! of upstream's types (cynode_testkit::upstream: Go's JSON semantics, the job spec
//! strict as `ParseAndValidateJobSpec`), runs the real static cynode-sba on a fresh
//! workspace per job as upstream's executor does, decodes result.json as upstream does
//! and answers upstream's response shape (`exit_code` omitted when 0,
//! `run_diagnostics`). The real `cynode-pm run` drives a scripted model's session through
//! it to completion.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use cynode_testkit::upstream::{self, RunJobResponse, SbaResult};
use serde_json::{json, Value};

use cynode_tests::{completed, model_server, pm_with, rootfs, serve_in_background};

const TOKEN: &str = "upstream-worker-token-0123456789";
const IMAGE: &str = "localhost/cynode-sba-test:latest";

/// What the stand-in saw.
#[derive(Clone, Default)]
struct Seen {
    /// `METHOD path -> status` of every request.
    calls: Arc<Mutex<Vec<String>>>,
    /// Each job.json, as upstream's strict decoder read it.
    jobs: Arc<Mutex<Vec<upstream::JobSpec>>>,
}

#[derive(Clone)]
struct StandIn {
    sba: PathBuf,
    seen: Seen,
}

fn note(s: &StandIn, what: String) {
    s.seen.calls.lock().unwrap().push(what);
}

async fn healthz(State(s): State<StandIn>) -> &'static str {
    note(&s, "GET /healthz -> 200".into());
    "ok"
}

async fn readyz(State(s): State<StandIn>) -> &'static str {
    note(&s, "GET /readyz -> 200".into());
    "ready"
}

/// Go's ServeMux for any other path.
async fn not_found(State(s): State<StandIn>, method: axum::http::Method, uri: Uri) -> Response {
    note(&s, format!("{method} {} -> 404", uri.path()));
    (StatusCode::NOT_FOUND, "404 page not found\n").into_response()
}

fn problem(status: StatusCode, title: &str, detail: &str) -> Response {
    let body = json!({ "type": "https://cynode.ai/problems/validation", "title": title, "status": status.as_u16(), "detail": detail });
    (
        status,
        [("content-type", "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

fn now() -> String {
    cynode_protocol::time::now_rfc3339()
}

/// worker-api's handleRunJob and executor.RunJob (SBA path), with the static cynode-sba
/// run directly instead of in a container.
async fn run_job(State(s): State<StandIn>, headers: HeaderMap, body: Bytes) -> Response {
    let authorized = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == format!("Bearer {TOKEN}"));
    if !authorized {
        note(&s, "POST /v1/worker/jobs:run -> 401".into());
        return problem(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "Invalid or missing bearer token",
        );
    }
    let Ok(req) = serde_json::from_slice::<upstream::RunJobRequest>(&body) else {
        note(&s, "POST /v1/worker/jobs:run -> 400".into());
        return problem(
            StatusCode::BAD_REQUEST,
            "Bad Request",
            "Invalid request body",
        );
    };
    if let Err(e) = upstream::validate_run_job_request(&req) {
        note(&s, "POST /v1/worker/jobs:run -> 400".into());
        return problem(StatusCode::BAD_REQUEST, "Bad Request", &e);
    }
    note(&s, "POST /v1/worker/jobs:run -> 200".into());
    let mut resp = RunJobResponse {
        version: 1,
        task_id: req.task_id.clone(),
        job_id: req.job_id.clone(),
        started_at: now(),
        ..Default::default()
    };
    let image = if req.sandbox.image.is_empty() {
        "alpine:latest".to_string()
    } else {
        req.sandbox.image.clone()
    };
    if req.sandbox.job_spec_json.is_empty() || !upstream::is_sba_runner_image(&image) {
        resp.status = "failed".into();
        resp.exit_code = -1;
        resp.stderr = "the stand-in runs SBA jobs only".into();
        resp.ended_at = now();
        return axum::Json(resp).into_response();
    }
    let spec = match upstream::parse_and_validate_job_spec(req.sandbox.job_spec_json.as_bytes()) {
        Ok(spec) => spec,
        Err(e) => {
            // executor.setSBAError
            resp.status = "failed".into();
            resp.exit_code = -1;
            resp.stderr = format!("invalid SBA job_spec_json: {e}");
            resp.ended_at = now();
            return axum::Json(resp).into_response();
        }
    };
    s.seen.jobs.lock().unwrap().push(spec.clone());
    let sba = s.sba.clone();
    let timeout = Duration::from_secs(req.sandbox.timeout_seconds.max(1) as u64);
    let resp = tokio::task::spawn_blocking(move || run_sba(&sba, &req, &spec, resp, timeout))
        .await
        .unwrap();
    axum::Json(resp).into_response()
}

/// prepareSBAJobAndWorkspace + runJobSBA + applySbaResultFromDir: a fresh job directory
/// and workspace, both removed afterwards.
fn run_sba(
    sba: &Path,
    req: &upstream::RunJobRequest,
    spec: &upstream::JobSpec,
    mut resp: RunJobResponse,
    timeout: Duration,
) -> RunJobResponse {
    let job_dir = cynode_tests::tempdir().unwrap();
    let ws = cynode_tests::tempdir().unwrap();
    std::fs::write(job_dir.path().join("job.json"), &req.sandbox.job_spec_json).unwrap();
    let mode = upstream::effective_execution_mode(spec).to_string();
    let mut cmd = std::process::Command::new(sba);
    cmd.arg("--job")
        .arg(job_dir.path().join("job.json"))
        .arg("--result")
        .arg(job_dir.path().join("result.json"))
        .arg("--artifacts")
        .arg(job_dir.path().join("artifacts"))
        .arg("--workspace")
        .arg(ws.path())
        .arg("--allow-root")
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("CYNODE_TASK_ID", &req.task_id)
        .env("CYNODE_JOB_ID", &req.job_id)
        .env("CYNODE_WORKSPACE_DIR", ws.path())
        .env("SBA_EXECUTION_MODE", &mode)
        .env("SBA_DIRECT_STEPS", "1");
    let out = cynode_testkit::output_bounded(cmd, timeout);
    resp.ended_at = now();
    resp.stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    resp.stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    resp.run_diagnostics = Some(upstream::RunDiagnostics {
        runtime: "direct".into(),
        runtime_argv: Some(vec![sba.display().to_string()]),
        job_dir: job_dir.path().display().to_string(),
        workspace_dir: ws.path().display().to_string(),
        image: req.sandbox.image.clone(),
        container_started: true,
    });
    let code = out.status.code().unwrap_or(-1);
    if code != 0 {
        resp.status = "failed".into();
        resp.exit_code = code.into();
    }
    let text = std::fs::read(job_dir.path().join("result.json")).unwrap_or_default();
    match serde_json::from_slice::<SbaResult>(&text) {
        Err(_) => {
            if resp.status.is_empty() {
                resp.status = "failed".into();
                resp.exit_code = -1;
                resp.stderr = "result.json invalid or empty (container may have exited before writing result)".into();
            }
        }
        Ok(r) => {
            match r.status.as_str() {
                "success" => {
                    resp.status = "completed".into();
                    resp.exit_code = 0;
                }
                "failure" => {
                    resp.status = "failed".into();
                    if resp.exit_code == 0 {
                        resp.exit_code = 1;
                    }
                }
                _ => {}
            }
            resp.sba_result = Some(r);
        }
    }
    resp
}

/// Serves upstream's endpoint set on 127.0.0.1; returns its base URL and what it saw.
fn stand_in(sba: PathBuf) -> (String, Seen) {
    let seen = Seen::default();
    let state = StandIn {
        sba,
        seen: seen.clone(),
    };
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/v1/worker/jobs:run", post(run_job))
        .fallback(not_found)
        .with_state(state);
    let addr = serve_in_background(app);
    (format!("http://{addr}"), seen)
}

fn job(task: &str, skill: &str, inputs: Value) -> Value {
    json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": task, "skill_id": skill, "inputs": inputs } })
}

#[test]
fn pm_completes_a_session_on_a_worker_that_speaks_only_the_upstream_api() {
    let sba = rootfs().join("usr/local/bin/cynode-sba");
    assert!(
        sba.is_file(),
        "no static cynode-sba in the test image at {}",
        sba.display()
    );
    let (worker, seen) = stand_in(sba);
    let (model, m) = model_server(vec![
        json!({ "type": "plan_update", "state_patch": [
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "write", "status": "pending" } },
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t2", "description": "search", "status": "pending" } },
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t3", "description": "script", "status": "pending" } }
        ], "payload": { "note": "three tasks" } }),
        job(
            "t1",
            "write-files",
            json!({ "files": [{ "path": "hello.txt", "content": "hello upstream\n" }] }),
        ),
        job("t2", "search-code", json!({ "pattern": "hello" })),
        // A mode upstream's write_file cannot set: refused before it is sent.
        job(
            "t3",
            "write-files",
            json!({ "files": [{ "path": "run.sh", "content": "echo hi\n", "mode": "0755" }] }),
        ),
        // t3 stays open: the final closes it as skipped, with why.
        json!({ "type": "final", "state_patch": [
            { "op": "replace", "path": "/plan/2/status", "value": "skipped" },
            { "op": "add", "path": "/plan/2/reason", "value": "upstream cannot set a file mode" }
        ], "payload": { "summary": "done on upstream" } }),
    ]);
    let state = cynode_tests::tempdir().unwrap();
    let token = state.path().join("worker-token");
    std::fs::write(&token, TOKEN).unwrap();
    let out = pm_with(
        state.path(),
        &model,
        &[
            "run",
            "greet upstream",
            "--worker-endpoint",
            &worker,
            "--worker-token-file",
            &token.display().to_string(),
            "--sandbox-image",
            IMAGE,
        ],
        &[],
    );
    let v = completed(&out);
    assert_eq!(v["deliverable"]["summary"], "done on upstream");
    assert_eq!(v["jobs_dispatched"], 3, "{v}");
    let plan = cynode_tests::plan_statuses(&v);
    assert_eq!(
        plan,
        [
            ("t1".to_string(), "done".to_string()),
            ("t2".to_string(), "done".to_string()),
            ("t3".to_string(), "skipped".to_string())
        ]
    );
    // Only upstream's endpoints answered: the capacity probe's 404 switched the PM to
    // synchronous jobs; it never asked for async jobs, workspaces or artifacts.
    let calls = seen.calls.lock().unwrap().clone();
    assert!(
        calls.contains(&"GET /v1/worker/capacity -> 404".to_string()),
        "{calls:?}"
    );
    let runs = calls
        .iter()
        .filter(|c| *c == "POST /v1/worker/jobs:run -> 200")
        .count();
    assert_eq!(runs, 2, "{calls:?}");
    assert!(
        calls
            .iter()
            .all(|c| c.starts_with("GET /v1/worker/capacity")
                || c.starts_with("GET /readyz")
                || c.starts_with("POST /v1/worker/jobs:run")),
        "{calls:?}"
    );
    // Each job.json passed upstream's strict decoder, steps in upstream's form.
    let jobs = seen.jobs.lock().unwrap().clone();
    let steps: Vec<Value> = jobs
        .iter()
        .map(|j| serde_json::to_value(j.steps.clone()).unwrap())
        .collect();
    assert_eq!(
        steps,
        [
            json!([{ "type": "write_file", "args": { "path": "hello.txt", "content": "hello upstream\n" } }]),
            json!([{ "type": "search_files", "args": { "pattern": "hello", "path": "." } }]),
        ]
    );
    // The model saw each result, its steps named by the job's own ids again (upstream
    // numbers them), and why t3 could not run.
    let reqs = m.requests();
    let after_search = reqs[3].to_string();
    assert!(
        after_search.contains(r#"\"id\":\"search\""#)
            && after_search.contains(r#"\"type\":\"search_files\""#),
        "{after_search}"
    );
    let last = reqs.last().unwrap().to_string();
    assert!(
        last.contains("upstream CyNodeAI cannot express this: write_file always writes mode 0644"),
        "{last}"
    );
}

/// A `jobs:run` that holds until its client goes away, and says when it came and went.
#[derive(Clone, Default)]
struct Held {
    calls: Arc<std::sync::atomic::AtomicUsize>,
    entered: Arc<tokio::sync::Notify>,
    dropped: Arc<tokio::sync::Notify>,
}

struct OnDrop(Arc<tokio::sync::Notify>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

async fn held_run(State(h): State<Held>) -> &'static str {
    h.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let _guard = OnDrop(h.dropped.clone());
    h.entered.notify_one();
    // Upstream runs the job under the request's context; this one outlasts the test.
    tokio::time::sleep(Duration::from_secs(120)).await;
    "{}"
}

/// The async calls over a synchronous upstream worker: `capacity` is synthesised (ready,
/// the PM's own running jobs), `submit` twice runs the job once, `stop` closes the
/// request (the worker's handler is dropped), `ack` forgets the job; workspaces with a
/// seed, artifacts and changesets are refused as not offered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_closes_an_upstream_jobs_request_and_a_second_submit_does_not_run_it_again() {
    use cynode_pm::dispatch::{DispatchError, Flavor, WorkerClient};
    use cynode_protocol::worker_api::{AsyncJobState, RunJobRequest};

    let held = Held::default();
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ready" }))
        .route("/v1/worker/jobs:run", post(held_run))
        .with_state(held.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let client = WorkerClient::new(&base, TOKEN);
    let cap = client.capacity().await.unwrap();
    assert_eq!(
        (cap.backend.as_str(), cap.ready, cap.running),
        ("upstream", true, 0)
    );
    assert_eq!(client.flavor().await, Flavor::Upstream);

    let job = json!({
        "protocol_version": "1.0", "job_id": "held-1", "task_id": "t-1",
        "constraints": { "max_runtime_seconds": 60, "max_output_bytes": 100 },
        "steps": [{ "id": "wait", "type": "run_command", "arguments": { "command": "sleep", "args": ["60"] } }]
    });
    let req = RunJobRequest::sba("t-1", "held-1", IMAGE, job.to_string(), None);
    assert_eq!(
        client.submit(&req).await.unwrap().status,
        AsyncJobState::InProgress
    );
    tokio::time::timeout(Duration::from_secs(20), held.entered.notified())
        .await
        .expect("the jobs:run request did not arrive within 20 s");
    assert_eq!(
        client.submit(&req).await.unwrap().status,
        AsyncJobState::InProgress
    );
    assert_eq!(client.capacity().await.unwrap().running, 1);

    assert_eq!(
        client.stop("held-1").await.unwrap().status,
        AsyncJobState::Canceled
    );
    tokio::time::timeout(Duration::from_secs(20), held.dropped.notified())
        .await
        .expect("the worker's handler was not dropped within 20 s of stop");
    assert_eq!(
        client.status("held-1").await.unwrap().status,
        AsyncJobState::Canceled
    );
    assert_eq!(held.calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    client.ack("held-1").await.unwrap();
    assert!(matches!(
        client.status("held-1").await,
        Err(DispatchError::NotFound(_))
    ));

    client.create_workspace("ws-1", None).await.unwrap();
    let seeded = client
        .create_workspace("ws-1", Some(Path::new("/srv/repo")))
        .await
        .unwrap_err();
    assert!(seeded.to_string().contains("has no workspaces"), "{seeded}");
    assert!(matches!(
        client.artifact("held-1", "out.txt").await,
        Err(DispatchError::NotFound(_))
    ));
    assert!(matches!(
        client.changeset("ws-1").await,
        Err(DispatchError::NotFound(_))
    ));
    server.abort();
}
