//! `cynode-pm serve` as a real process over HTTP, with a real bwrap worker, the real SBA,
//! a scripted OpenAI-compatible model, and SQLite or a real PostgreSQL: auth and tenant
//! isolation, idempotent create, the SSE stream in order and resumed after a dropped
//! connection, artifacts, cancel stopping the worker job, metrics, and two replicas with
//! one killed mid-session.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cynode_testkit::OwnedChild;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use cynode_testkit::postgres_url;
use cynode_tests::{model_server, start_worker, workspace_root, Worker, TOKEN};

pub(crate) const TENANT_A: &str = "token-of-tenant-a-0123456789";
pub(crate) const TENANT_B: &str = "token-of-tenant-b-0123456789";

/// One `cynode-pm serve` process; killed on drop.
/// A `cynode-pm serve` replica; dropping it kills its process group.
pub(crate) struct Replica {
    child: OwnedChild,
    pub(crate) base: String,
}

impl Replica {
    /// The replica's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }
}

fn start_replica(
    dir: &Path,
    name: &str,
    db: &str,
    model: &str,
    worker: &Worker,
    extra: &[&str],
) -> Replica {
    let endpoint = format!("http://{}", worker.addr);
    start_replica_with(
        dir,
        name,
        db,
        model,
        &["--worker-endpoint", &endpoint],
        extra,
    )
}

/// A replica whose workers are given by `workers` (`--worker-endpoint …` or
/// `--workers-file …`).
pub(crate) fn start_replica_with(
    dir: &Path,
    name: &str,
    db: &str,
    model: &str,
    workers: &[&str],
    extra: &[&str],
) -> Replica {
    std::fs::write(
        dir.join("tokens"),
        format!("{TENANT_A} acme\n{TENANT_B} globex\n"),
    )
    .unwrap();
    let state = dir.join(name);
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    let mut cmd = Command::new(cynode_tests::bin("cynode-pm"));
    cmd.arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .arg("--api-tokens-file")
        .arg(dir.join("tokens"))
        .args(["--replica-id", name, "--datastore-endpoint", db])
        .args(workers)
        .args(["--model-base-url", model])
        .arg("--state-dir")
        .arg(&state)
        .args(extra)
        .env("CYNODE_WORKER_TOKEN", TOKEN)
        .current_dir(workspace_root())
        .stdout(Stdio::null())
        .stderr(log);
    let mut child = OwnedChild::spawn(cmd);
    // The port it bound, from its `cynode-pm listening` log line.
    let log = dir.join(format!("{name}.log"));
    let t = Instant::now();
    let addr = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let addr = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["fields"]["message"] == "cynode-pm listening")
            .and_then(|v| v["fields"]["addr"].as_str().map(str::to_string));
        if let Some(a) = addr {
            break a;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60) && child.try_wait().is_none(),
            "replica {name} did not start within 60 s, or exited: {text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    Replica {
        child,
        base: format!("http://{addr}"),
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

pub(crate) async fn call(
    method: reqwest::Method,
    url: &str,
    token: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut r = client().request(method, url).bearer_auth(token);
    if let Some(b) = body {
        r = r.json(&b);
    }
    let resp = r.send().await.unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Polls the session (as tenant A) until `done` accepts it.
async fn wait_session(
    base: &str,
    id: &str,
    within: Duration,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let t = Instant::now();
    loop {
        let (_, v) = call(
            reqwest::Method::GET,
            &format!("{base}/v1/sessions/{id}"),
            TENANT_A,
            None,
        )
        .await;
        if done(&v) {
            return v;
        }
        assert!(t.elapsed() < within, "session {id} is still {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(crate) async fn wait_status(base: &str, id: &str, want: &[&str], within: Duration) -> Value {
    wait_session(base, id, within, |v| {
        want.contains(&v["status"].as_str().unwrap_or(""))
    })
    .await
}

/// Reads SSE events `(id, event, data)` until the stream ends or `stop_after` events.
pub(crate) async fn sse(
    base: &str,
    id: &str,
    last: Option<u64>,
    stop_after: Option<usize>,
) -> Vec<(u64, String, Value)> {
    let mut r = client()
        .get(format!("{base}/v1/sessions/{id}/events"))
        .bearer_auth(TENANT_A);
    if let Some(l) = last {
        r = r.header("Last-Event-ID", l.to_string());
    }
    let mut resp = r.send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut buf = String::new();
    let mut events = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while let Ok(Some(chunk)) = tokio::time::timeout_at(deadline.into(), resp.chunk())
        .await
        .unwrap_or(Ok(None))
    {
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            let (mut eid, mut kind, mut data) = (None, String::new(), Value::Null);
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("id:") {
                    eid = v.trim().parse().ok();
                } else if let Some(v) = line.strip_prefix("event:") {
                    kind = v.trim().to_string();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data = serde_json::from_str(v.trim()).unwrap();
                }
            }
            if let Some(eid) = eid {
                events.push((eid, kind, data));
                if stop_after == Some(events.len()) {
                    return events;
                }
            }
        }
    }
    events
}

fn happy_script() -> Vec<Value> {
    vec![
        json!({ "type": "plan_update", "state_patch": [
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "write the greeting", "status": "pending" } }
        ], "payload": { "note": "one task" } }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": "write-files",
            "inputs": { "files": [{ "path": "hello.txt", "content": "hello from the service\n" }] } } }),
        json!({ "type": "final", "state_patch": [], "payload": { "summary": "wrote hello.txt" } }),
    ]
}

/// The API surface on one datastore.
async fn api_round_trip(db: &str) {
    let dir = cynode_tests::tempdir().unwrap();
    let worker = start_worker(0);
    let (model, script) = model_server(happy_script());
    let r = start_replica(dir.path(), "r1", db, &model, &worker, &[]);
    let base = &r.base;
    use reqwest::Method as M;

    // Auth.
    let (s, v) = call(
        M::GET,
        &format!("{base}/v1/sessions"),
        "wrong-token-0123456789",
        None,
    )
    .await;
    assert_eq!(
        (s, v["type"].as_str()),
        (401, Some("urn:cynodeai:error:authentication"))
    );
    // Bad bodies: a named field, never a crash.
    let (s, v) = call(
        M::POST,
        &format!("{base}/v1/sessions"),
        TENANT_A,
        Some(json!({ "objective": "x", "colour": "red" })),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    assert!(v["detail"].as_str().unwrap().contains("colour"), "{v}");
    let (s, _) = call(
        M::POST,
        &format!("{base}/v1/sessions"),
        TENANT_A,
        Some(json!({ "objective": "x", "tenant": "globex" })),
    )
    .await;
    assert_eq!(s, 403);

    // Idempotent create.
    let create = || async {
        let resp = client()
            .post(format!("{base}/v1/sessions"))
            .bearer_auth(TENANT_A)
            .header("Idempotency-Key", "order-42")
            .json(&json!({ "objective": "greet the world" }))
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
    };
    let (s1, v1) = create().await;
    assert_eq!(s1, 201, "{v1}");
    let id = v1["session_id"].as_str().unwrap().to_string();
    let (s2, v2) = create().await;
    assert_eq!((s2, v2["session_id"].as_str()), (200, Some(id.as_str())));

    // The whole stream, in order, ending at final.
    let events = sse(base, &id, None, None).await;
    let seqs: Vec<u64> = events.iter().map(|e| e.0).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "{events:?}"
    );
    let kinds: Vec<&str> = events.iter().map(|e| e.1.as_str()).collect();
    for k in [
        "created",
        "model_reply",
        "job_dispatched",
        "job_state",
        "job_finished",
        "final",
    ] {
        assert!(kinds.contains(&k), "{k} missing from {kinds:?}");
    }
    assert_eq!(kinds.last(), Some(&"final"));
    // A dropped connection resumes exactly after the last event seen.
    let first = sse(base, &id, None, Some(3)).await;
    let rest = sse(base, &id, Some(first[2].0), None).await;
    let resumed: Vec<u64> = first.iter().chain(rest.iter()).map(|e| e.0).collect();
    assert_eq!(resumed, seqs);

    let v = wait_status(base, &id, &["completed"], Duration::from_secs(30)).await;
    assert_eq!(v["deliverable"]["summary"], "wrote hello.txt");
    assert_eq!(script.requests().len(), 3, "each reply asked for once");
    // The evidence report: the task, its job with its skill and step outcomes, the
    // verified artifacts; the model's summary last and bounded.
    let (s, report) = call(
        M::GET,
        &format!("{base}/v1/sessions/{id}/report"),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!(s, 200, "{report}");
    assert_eq!(report["tasks"][0]["task_id"], "t1", "{report}");
    let job = &report["tasks"][0]["jobs"][0];
    assert_eq!(
        (job["skill_id"].as_str(), job["status"].as_str()),
        (Some("write-files"), Some("completed")),
        "{report}"
    );
    assert!(!job["steps"].as_array().unwrap().is_empty(), "{report}");
    assert_eq!(report["summary"], "wrote hello.txt");
    assert_eq!(v["deliverable"]["report"], report);
    let (s, _) = call(
        M::GET,
        &format!("{base}/v1/sessions/{id}/report"),
        TENANT_B,
        None,
    )
    .await;
    assert_eq!(s, 404);

    // Tenant isolation: B sees nothing of A's.
    let (s, _) = call(M::GET, &format!("{base}/v1/sessions/{id}"), TENANT_B, None).await;
    assert_eq!(s, 404);
    let (_, list_b) = call(M::GET, &format!("{base}/v1/sessions"), TENANT_B, None).await;
    assert_eq!(list_b["sessions"], json!([]));
    let (_, list_a) = call(
        M::GET,
        &format!("{base}/v1/sessions?limit=1"),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!(list_a["sessions"][0]["session_id"], json!(id));
    let (s, _) = call(
        M::GET,
        &format!("{base}/v1/sessions?limit=0"),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!(s, 400);

    // Artifacts: the verified bytes for A, 404 for B.
    let art = &v["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["path"] == "hello.txt");
    if let Some(a) = art {
        let sha = a["sha256"].as_str().unwrap();
        let url = format!("{base}/v1/sessions/{id}/artifacts/{sha}");
        let bytes = client()
            .get(&url)
            .bearer_auth(TENANT_A)
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(hex::encode(Sha256::digest(&bytes)), sha);
        let (s, _) = call(M::GET, &url, TENANT_B, None).await;
        assert_eq!(s, 404);
    }

    // Skills, validation, metrics, health.
    let (s, skills) = call(M::GET, &format!("{base}/v1/skills"), TENANT_A, None).await;
    assert_eq!(s, 200);
    assert!(skills["skills"].as_array().unwrap().len() >= 5);
    let (s, ok) = call(M::POST, &format!("{base}/v1/jobs:validate"), TENANT_A,
        Some(json!({ "skill_id": "write-files", "inputs": { "files": [{ "path": "a.txt", "content": "x" }] } }))).await;
    assert_eq!((s, ok["allowed"].clone()), (200, json!(true)), "{ok}");
    let (s, denied) = call(M::POST, &format!("{base}/v1/jobs:validate"), TENANT_A,
        Some(json!({ "skill_id": "write-files", "inputs": { "files": [{ "path": "../../etc/passwd", "content": "x" }] } }))).await;
    assert_eq!(s, 200);
    assert_eq!(denied["allowed"], false, "{denied}");
    let metrics = client()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("cynode_pm_sessions{status=\"completed\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("cynode_pm_model_calls_total{outcome=\"ok\"} 3"),
        "{metrics}"
    );
    assert!(
        metrics.contains("cynode_pm_jobs_total{outcome=\"completed\"} 1"),
        "{metrics}"
    );
    let ready = client().get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    let (s, _) = call(
        M::POST,
        &format!("{base}/v1/sessions/{id}:cancel"),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!(s, 409, "a completed session cannot be canceled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_on_sqlite() {
    let dir = cynode_tests::tempdir().unwrap();
    api_round_trip(&format!("sqlite://{}", dir.path().join("pm.db").display())).await;
}

/// A fresh database on the test PostgreSQL, so replicas of one test share only it.
pub(crate) async fn fresh_postgres() -> String {
    let base = postgres_url();
    let name = format!("svc_{}", uuid::Uuid::new_v4().simple());
    sqlx::any::install_default_drivers();
    let pool = sqlx::AnyPool::connect(base).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&pool)
        .await
        .unwrap();
    let (prefix, _) = base.rsplit_once('/').unwrap();
    format!("{prefix}/{name}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_on_postgres() {
    api_round_trip(&fresh_postgres().await).await;
}

/// A skill whose job runs `sleep SECONDS` (to have a job to cancel or to outlive a
/// replica).
fn sleep_skill(dir: &Path) -> PathBuf {
    cynode_tests::write_skill(
        &dir.join("skills/nap"),
        "skill_id: nap\nversion: 1.0.0\ndescription: sleep a while\npurpose: base-tools\nallowed_commands: [sleep]\nlimits:\n  max_runtime_seconds: 120\n  max_output_bytes: 65536\ninputs_schema:\n  type: object\n  additionalProperties: false\n  required: [seconds]\n  properties:\n    seconds: { type: integer, minimum: 1, maximum: 60 }\n",
        r#"{ "steps": [ { "id": "nap", "type": "run_command", "arguments": { "command": "sleep", "args": ["{{ inputs.seconds }}"] } } ] }"#,
        r#"{ "seconds": 1 }"#,
    );
    dir.join("skills")
}

fn nap_script(seconds: u32) -> Vec<Value> {
    cynode_tests::one_job_script("nap", "nap", json!({ "seconds": seconds }), "napped")
}

async fn create(base: &str, objective: &str) -> String {
    let (s, v) = call(
        reqwest::Method::POST,
        &format!("{base}/v1/sessions"),
        TENANT_A,
        Some(json!({ "objective": objective })),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    v["session_id"].as_str().unwrap().to_string()
}

async fn wait_active_job(base: &str, id: &str) -> String {
    let v = wait_session(base, id, Duration::from_secs(60), |v| {
        v["active_job_id"].is_string()
    })
    .await;
    v["active_job_id"].as_str().unwrap().to_string()
}

async fn worker_job(worker: &Worker, job: &str) -> Value {
    let r = worker.get(&format!("/v1/worker/jobs/{job}")).await;
    r.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_the_worker_job() {
    let dir = cynode_tests::tempdir().unwrap();
    let skills = sleep_skill(dir.path());
    let worker = start_worker(0);
    let (model, _script) = model_server(nap_script(60));
    let db = format!("sqlite://{}", dir.path().join("pm.db").display());
    let skill_arg = skills.display().to_string();
    let r = start_replica(
        dir.path(),
        "r1",
        &db,
        &model,
        &worker,
        &["--skill-dir", &skill_arg],
    );
    let id = create(&r.base, "nap for a minute").await;
    let job = wait_active_job(&r.base, &id).await;
    // The stream shows the job running live before the cancel (the 6th event).
    let live = sse(&r.base, &id, None, Some(6)).await;
    assert_eq!(
        (live[5].1.as_str(), &live[5].2["data"]["state"]),
        ("job_state", &json!("in_progress")),
        "{live:?}"
    );
    let t = Instant::now();
    let (s, v) = call(
        reqwest::Method::POST,
        &format!("{}/v1/sessions/{id}:cancel", r.base),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!((s, v["status"].as_str()), (200, Some("canceled")), "{v}");
    loop {
        let j = worker_job(&worker, &job).await;
        if j["status"] == "canceled" {
            break;
        }
        assert!(
            j["status"] == "in_progress" || j["status"] == "accepted",
            "the job should be stopped, not {j}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the worker job still runs: {j}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The loop does not overwrite the cancel when the stopped job's result comes back.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let v = wait_status(&r.base, &id, &["canceled"], Duration::from_secs(5)).await;
    assert!(v["deliverable"].is_null(), "{v}");
    // The stream ends with the cancel.
    let events = sse(&r.base, &id, None, None).await;
    assert_eq!(events.last().map(|e| e.1.as_str()), Some("canceled"));
}

/// Two replicas on a fresh PostgreSQL database, one session napping in a worker job.
struct MidJob {
    dir: cynode_tests::TempDir,
    worker: Worker,
    script: cynode_tests::Model,
    db: String,
    replicas: [Replica; 2],
    id: String,
    job: String,
    /// The replica holding the session's lease (index into `replicas`).
    owner: usize,
}

/// Starts [`MidJob`] with `extra` replica flags and waits until the nap job is active.
async fn two_replicas_mid_job(nap: u32, objective: &str, extra: &[&str]) -> MidJob {
    let dir = cynode_tests::tempdir().unwrap();
    let skills = sleep_skill(dir.path());
    let worker = start_worker(0);
    let (model, script) = model_server(nap_script(nap));
    let db = fresh_postgres().await;
    let skill_arg = skills.display().to_string();
    let mut args = vec!["--skill-dir", &skill_arg];
    args.extend_from_slice(extra);
    let replicas = ["r1", "r2"].map(|n| start_replica(dir.path(), n, &db, &model, &worker, &args));
    let id = create(&replicas[0].base, objective).await;
    let job = wait_active_job(&replicas[0].base, &id).await;
    let owner = match lease_owner(&db, &id).await.as_deref() {
        Some("r1") => 0,
        Some("r2") => 1,
        other => panic!("session {id} leased by {other:?}"),
    };
    MidJob {
        dir,
        worker,
        script,
        db,
        replicas,
        id,
        job,
        owner,
    }
}

impl MidJob {
    /// The lease holder (mutable, to signal it) and the other replica.
    fn victim_and_survivor(&mut self) -> (&mut Replica, &Replica) {
        let [r1, r2] = &mut self.replicas;
        if self.owner == 0 {
            (r1, r2)
        } else {
            (r2, r1)
        }
    }

    /// The log of replica `i`.
    fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("r{}.log", i + 1))).unwrap()
    }

    /// Waits for the surviving replica to complete the session, within 30 s of `t`,
    /// with one job and no model call asked twice; returns the session.
    async fn survivor_completes(&self, t: Instant) -> Value {
        let survivor = &self.replicas[1 - self.owner];
        let v = wait_status(
            &survivor.base,
            &self.id,
            &["completed", "failed"],
            Duration::from_secs(60),
        )
        .await;
        assert_eq!(v["status"], "completed", "{v}");
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "takeover took {:?}",
            t.elapsed()
        );
        // No duplicate: three replies asked for once each, one job.
        assert_eq!(self.script.requests().len(), 3, "no model call twice");
        assert_eq!(v["jobs_dispatched"], 1);
        v
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_hands_its_session_to_another() {
    let mut m = two_replicas_mid_job(4, "nap across a crash", &["--lease-seconds", "3"]).await;
    // Kill -9 whichever replica holds the lease, mid-job.
    let (victim, _) = m.victim_and_survivor();
    victim.child.signal(libc::SIGKILL);
    let _ = victim.child.wait_timeout(Duration::from_secs(30));
    m.survivor_completes(Instant::now()).await;
    // The job finished once and its result was acknowledged (then forgotten) by the PM.
    let j = worker_job(&m.worker, &m.job).await;
    assert_eq!(j["status"], 404, "{j}");
    let survivor = &m.replicas[1 - m.owner];
    let (_, full) = call(
        reqwest::Method::GET,
        &format!("{}/v1/sessions/{}", survivor.base, m.id),
        TENANT_A,
        None,
    )
    .await;
    assert_eq!(full["active_job_id"], Value::Null);
    let log = m.log(1 - m.owner);
    assert!(
        log.contains("driving session"),
        "the survivor never took over:\n{log}"
    );
}

/// The replica holding the session's lease, if any.
async fn lease_owner(db: &str, id: &str) -> Option<String> {
    let pool = sqlx::AnyPool::connect(db).await.unwrap();
    sqlx::Row::get(
        &sqlx::query("SELECT lease_owner FROM sessions WHERE session_id = $1")
            .bind(id.to_string())
            .fetch_one(&pool)
            .await
            .unwrap(),
        0,
    )
}

/// SIGTERM (a rolling update, a node drain) hands sessions over at once: the replica
/// ends its event streams, lets the session's step run for the grace, releases the
/// lease and exits 0; the other replica takes over long before the lease would expire,
/// without a second model call or job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_replica_hands_its_session_over_at_once() {
    let mut m = two_replicas_mid_job(
        6,
        "nap across a rolling update",
        &["--lease-seconds", "120", "--shutdown-grace-seconds", "1"],
    )
    .await;
    let id = m.id.clone();
    let (victim, _) = m.victim_and_survivor();
    // A client following the session's events on the replica that goes away.
    let (victim_base, sid) = (victim.base.clone(), id.clone());
    let stream = tokio::spawn(async move { sse(&victim_base, &sid, None, None).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    victim.child.signal(libc::SIGTERM);
    let exit = loop {
        if let Some(st) = victim.child.try_wait() {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the replica did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let exited = t.elapsed();
    assert_eq!(exit.code(), Some(0), "exit {exit:?}");
    let seen = tokio::time::timeout(Duration::from_secs(5), stream)
        .await
        .expect("the event stream must end with the replica")
        .unwrap();
    assert!(
        seen.iter().any(|e| e.1 == "job_dispatched"),
        "the stream delivered the session's events before ending: {seen:?}"
    );
    // The lease is 120 s: completing within 30 s means it was released, not expired.
    m.survivor_completes(t).await;
    assert!(exited < Duration::from_secs(10), "exit took {exited:?}");
    eprintln!(
        "SIGTERM: the replica exited after {exited:?}; the session completed on the other {:?} after the signal",
        t.elapsed()
    );
    let log = m.log(m.owner);
    assert!(log.contains("handing sessions back"), "{log}");
    // The survivor saves the completed session, then lets go of its lease: a second
    // write, so the release is awaited (bounded), not read at once.
    let until = Instant::now() + Duration::from_secs(10);
    while lease_owner(&m.db, &id).await.is_some() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(lease_owner(&m.db, &id).await, None, "released once done");
}

/// The checked-in OpenAPI document is what the handlers describe.
#[test]
fn openapi_document_has_not_drifted() {
    let out = Command::new(cynode_tests::bin("cynode-pm"))
        .arg("openapi")
        .output()
        .unwrap();
    assert!(out.status.success());
    let live = String::from_utf8(out.stdout).unwrap();
    let path = workspace_root().join("docs/openapi.json");
    if std::env::var_os("CYNODE_REGENERATE_OPENAPI").is_some() {
        std::fs::write(&path, &live).unwrap();
    }
    let stored = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        stored == live,
        "docs/openapi.json differs from the handlers: regenerate with \
         CYNODE_REGENERATE_OPENAPI=1 cargo nextest run -p cynode-tests -E 'test(openapi)'"
    );
    let v: Value = serde_json::from_str(&live).unwrap();
    for p in [
        "/v1/sessions",
        "/v1/sessions/{id}",
        "/v1/sessions/{id}/events",
        "/v1/sessions/{id}:cancel",
        "/v1/jobs:validate",
    ] {
        assert!(v["paths"][p].is_object(), "{p} missing");
    }
}
