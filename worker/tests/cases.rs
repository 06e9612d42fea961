//! Test cases run against every backend (see `backends.rs`), on the real server.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::{
    assert_field_starts, command_job, env, mounts_with, node_backend, process_with_arg, sba_job,
    sha256_hex, unique, Server, TOKEN,
};

/// No leftovers of `job_id`: no container, no process with `marker`, no mount.
fn assert_no_leaks(sv: &Server, job_id: &str, marker: Option<&str>) {
    if crate::harness::is_engine(sv.backend) {
        assert_eq!(
            crate::harness::job_containers(sv.backend, job_id),
            Vec::<String>::new(),
            "container left for {job_id}"
        );
    }
    if let Some(m) = marker {
        assert!(!process_with_arg(m), "a process with {m} survived");
    }
    // A live gVisor pool slot keeps its staging directory bound on itself (empty once
    // idle: a job's directories go onto it at the claim and are unmounted at its end).
    // The pool refills in the background: a new slot's staging mount comes just before its
    // container, and a spent slot's goes just after its container, so such a mount is
    // given a few seconds to get its container or go; a leaked one stays. A bwrap node's
    // views of its root filesystems (`<state>/roots/`) live as long as the node; the
    // harness checks at its stop that they went.
    let until = Instant::now() + Duration::from_secs(10);
    let roots = format!(" {}/roots/", sv.state_dir().display());
    loop {
        let mounts: Vec<String> = mounts_with(&sv.state_dir().display().to_string())
            .into_iter()
            .filter(|l| !live_gvisor_slot(sv, l) && !l.contains(&roots))
            .collect();
        if mounts.is_empty() || Instant::now() >= until {
            assert_eq!(mounts, Vec::<String>::new());
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether a mountinfo line is a gVisor slot's staging mount (mount point
/// `…/pool/cynode-pool-<n>/mnt`, nothing beneath) whose container still runs.
fn live_gvisor_slot(sv: &Server, line: &str) -> bool {
    let Some(point) = line.split(' ').nth(4) else {
        return false;
    };
    let mut parts = point.rsplit('/');
    let (Some("mnt"), Some(slot), Some("pool")) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let Some(cli) = crate::harness::engine_cli(sv.backend) else {
        return false;
    };
    slot.starts_with("cynode-pool-")
        && crate::harness::engine_names(cli, &format!("name=^{slot}$"))
            .iter()
            .any(|n| n == slot)
}

/// Submits a job that sleeps until stopped (tagged by a unique marker) and waits until it
/// runs; returns its id and the marker.
async fn start_long_job(sv: &Server) -> (String, String) {
    let id = unique("j");
    let marker = crate::harness::marker();
    let (code, body) = sv
        .post(
            "/v1/worker/jobs",
            &command_job(&id, "t", &["sh", "-c", &format!("sleep {marker}")]),
        )
        .await;
    assert_eq!(code, 202, "{body}");
    sv.wait_for(&id, Duration::from_secs(30), |v| {
        v["status"] == "in_progress"
    })
    .await;
    (id, marker)
}

pub async fn auth_is_required(backend: &'static str) {
    let sv = Server::start(backend, "");
    let body = command_job(&unique("j"), "t", &["true"]);
    let r = sv
        .client
        .post(sv.url("/v1/worker/jobs:run"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let r = sv
        .client
        .post(sv.url("/v1/worker/jobs:run"))
        .bearer_auth(format!("{TOKEN}x"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v,
        json!({ "type": "urn:cynodeai:error:authentication", "title": "Unauthorized", "status": 401,
                "detail": "missing or wrong bearer token" })
    );
    // Health endpoints need no token.
    let r = sv.client.get(sv.url("/healthz")).send().await.unwrap();
    assert_eq!(
        (r.status().as_u16(), r.text().await.unwrap()),
        (200, "ok".to_string())
    );
}

/// Plain `/readyz` is exactly `ready` (upstream's contract); the details come as JSON.
pub async fn readyz_names_the_backend(backend: &'static str) {
    let sv = Server::start(backend, "");
    let r = sv.client.get(sv.url("/readyz")).send().await.unwrap();
    assert_eq!(
        (r.status().as_u16(), r.text().await.unwrap()),
        (200, "ready".to_string())
    );
    let r = sv
        .client
        .get(sv.url("/readyz"))
        .header("accept", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["ready"], true, "{v}");
    assert!(
        v["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with(&format!("backend {}", node_backend(backend)))),
        "{v}"
    );
}

pub async fn echo_hello(backend: &'static str) {
    let sv = Server::start(backend, "");
    let id = unique("j");
    let (code, v) = sv.run_job(&id, "t", &["echo", "hello"]).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        (
            v["status"].clone(),
            v["exit_code"].clone(),
            v["stdout"].clone(),
            v["stderr"].clone(),
            v["truncated"].clone()
        ),
        (
            json!("completed"),
            json!(0),
            json!("hello\n"),
            json!(""),
            json!({ "stdout": false, "stderr": false })
        )
    );
    assert_eq!(
        (v["job_id"].as_str(), v["version"].as_u64()),
        (Some(id.as_str()), Some(1))
    );
    assert_no_leaks(&sv, &id, None);
}

pub async fn no_network_for_none_and_restricted(backend: &'static str) {
    let sv = Server::start(backend, "");
    for policy in ["none", "restricted"] {
        let mut body = command_job(
            &unique("j"),
            "t",
            &[
                "sh",
                "-c",
                "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '",
            ],
        );
        body["sandbox"]["network_policy"] = json!(policy);
        let (_, v) = sv.post("/v1/worker/jobs:run", &body).await;
        assert_eq!(v["stdout"], "lo\n", "{policy}: {v}");
    }
    // This node allows no destination: `restricted` is upstream's deny-all, and a request
    // that names destinations is refused rather than silently given none.
    let mut body = command_job(&unique("j"), "t", &["true"]);
    body["sandbox"]["network_policy"] = json!("restricted");
    body["sandbox"]["egress_allow"] = json!(["pypi.org"]);
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(code, 400, "{v}");
    assert_field_starts(&v, "detail", "sandbox.egress_allow");
    let mut body = command_job(&unique("j"), "t", &["true"]);
    body["sandbox"]["network_policy"] = json!("allow");
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(code, 400, "{v}");
    assert_field_starts(&v, "detail", "sandbox.network_policy");
}

pub async fn cynode_env_is_present_and_not_overridable(backend: &'static str) {
    let sv = Server::start(backend, "");
    let id = unique("j");
    let mut body = command_job(
        &id,
        "task-env",
        &["sh", "-c", "env | grep ^CYNODE_ | sort; echo MINE=$MINE"],
    );
    body["sandbox"]["env"] =
        json!({ "CYNODE_JOB_ID": "forged", "CYNODE_WORKSPACE_DIR": "/etc", "MINE": "yes" });
    let (_, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(
        v["stdout"].as_str().unwrap(),
        format!(
            "CYNODE_ARTIFACTS_DIR=/job/artifacts\nCYNODE_JOB_ID={id}\nCYNODE_TASK_ID=task-env\nCYNODE_WORKSPACE_DIR=/workspace\nMINE=yes\n"
        ),
        "{v}"
    );
}

pub async fn oversized_body_is_413(backend: &'static str) {
    let sv = Server::start(backend, "limits:\n  max_request_bytes: 65536\n");
    let mut body = command_job(&unique("j"), "t", &["true"]);
    body["sandbox"]["env"] = json!({ "BIG": "x".repeat(70_000) });
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(code, 413, "{v}");
    assert_eq!(v["type"], "urn:cynodeai:error:validation");
}

pub async fn invalid_requests_name_the_field(backend: &'static str) {
    let sv = Server::start(backend, "");
    let r = sv
        .client
        .post(sv.url("/v1/worker/jobs:run"))
        .bearer_auth(TOKEN)
        .body("{ not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let mut body = command_job(&unique("j"), "t", &["true"]);
    body["sandbox"]["surprise"] = json!(1);
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(code, 400);
    assert_field_starts(&v, "detail", "sandbox.surprise: unknown field");
    let id = unique("j");
    let mut body = sba_job(&id, "t", json!([]), json!([]));
    let mut spec: Value =
        serde_json::from_str(body["sandbox"]["job_spec_json"].as_str().unwrap()).unwrap();
    spec["constraints"]["max_runtime_seconds"] = json!(0);
    body["sandbox"]["job_spec_json"] = json!(spec.to_string());
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(code, 400);
    assert_eq!(
        v["detail"],
        "sandbox.job_spec_json.constraints.max_runtime_seconds: must be positive"
    );
    // Nothing was created for a rejected job.
    assert!(!sv.state_dir().join("jobs").join(&id).exists());
}

pub async fn sba_job_end_to_end_with_verified_artifacts(backend: &'static str) {
    let sv = Server::start(backend, "");
    let id = unique("j");
    let body = sba_job(
        &id,
        &unique("t"),
        json!([
            { "id": "w", "type": "write_file", "arguments": { "path": "report.txt", "content": "all good\n" } },
            { "id": "r", "type": "run_command", "arguments": { "command": "sh", "args": ["-c", "echo ran >> log.txt; cat report.txt"] } }
        ]),
        json!(["report.txt"]),
    );
    let (code, accepted) = sv.post("/v1/worker/jobs", &body).await;
    assert_eq!(
        (code, accepted["status"].clone()),
        (202, json!("accepted")),
        "{accepted}"
    );
    let done = sv.wait_terminal(&id).await;
    assert_eq!(done["status"], "completed", "{done}");
    let result = &done["result"];
    assert_eq!(result["sba_result"]["status"], "success");
    assert_eq!(
        result["sba_result"]["steps"][1]["result"]["stdout"],
        "all good\n"
    );
    let expected =
        json!([{ "path": "report.txt", "sha256": sha256_hex(b"all good\n"), "size_bytes": 9 }]);
    assert_eq!(result["artifacts"], expected);
    assert_eq!(result["sba_result"]["artifacts"], expected);
    // The downloaded bytes hash to what was reported.
    let r = sv
        .get_raw(&format!("/v1/worker/jobs/{id}/artifacts/report.txt"))
        .await;
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(
        sha256_hex(&r.bytes().await.unwrap()),
        sha256_hex(b"all good\n")
    );
    let (code, _) = sv
        .get(&format!(
            "/v1/worker/jobs/{id}/artifacts/..%2F..%2Frequest.json"
        ))
        .await;
    assert!(code == 400 || code == 404, "{code}");
    // in_progress came through the SBA's callback socket before the end.
    assert_no_leaks(&sv, &id, None);
    // Ack deletes the result and the job directory; only then.
    let (code, _) = sv
        .post(&format!("/v1/worker/jobs/{id}:ack"), &json!({}))
        .await;
    assert_eq!(code, 204);
    let (code, _) = sv.get(&format!("/v1/worker/jobs/{id}")).await;
    assert_eq!(code, 404);
    assert!(!sv.state_dir().join("jobs").join(&id).exists());
}

pub async fn in_progress_is_reported_from_the_sandbox(backend: &'static str) {
    let sv = Server::start(backend, "");
    let id = unique("j");
    let body = sba_job(
        &id,
        "t",
        json!([{ "id": "s", "type": "run_command", "arguments": { "command": "sleep", "args": ["3"] } }]),
        json!([]),
    );
    sv.post("/v1/worker/jobs", &body).await;
    let seen = sv
        .wait_for(&id, Duration::from_secs(30), |v| {
            v["status"] == "in_progress" || v["status"] == "completed"
        })
        .await;
    assert_eq!(seen["status"], "in_progress", "{seen}");
    assert_eq!(sv.wait_terminal(&id).await["status"], "completed");
}

pub async fn missing_result_is_failed_never_success(backend: &'static str) {
    let sv = Server::start(backend, "");
    let id = unique("j");
    let mut body = sba_job(
        &id,
        "t",
        json!([{ "id": "s", "type": "run_command", "arguments": { "command": "true" } }]),
        json!([]),
    );
    // The runner writes its result somewhere else: result.json is missing.
    body["sandbox"]["command"] = json!(["--result", "/tmp/elsewhere.json"]);
    let (_, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(v["status"], "failed", "{v}");
    assert_field_starts(&v, "failure_reason", "result.json missing");
    assert_eq!(v.get("sba_result"), None);
}

pub async fn timeout_removes_the_sandbox(backend: &'static str) {
    let sv = Server::start(backend, "");
    let id = unique("j");
    let marker = &crate::harness::marker();
    let mut body = command_job(&id, "t", &["sh", "-c", &format!("sleep {marker}")]);
    body["sandbox"]["timeout_seconds"] = json!(2);
    let t = std::time::Instant::now();
    let (_, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    assert_eq!(
        (v["status"].clone(), v["exit_code"].clone()),
        (json!("timeout"), json!(-1)),
        "{v}"
    );
    assert_no_leaks(&sv, &id, Some(marker));
}

/// A job that ignores SIGTERM (and its children with it: an ignored signal stays ignored
/// across exec) still ends at its timeout: the node kills, it does not ask. On Docker it
/// lived 64 s under a 4 s timeout while the node's `docker rm` was refused.
pub async fn sigterm_ignoring_job_ends_at_its_timeout(backend: &'static str) {
    let sv = Server::start(backend, "");
    let id = unique("j");
    let marker = &crate::harness::marker();
    let script = format!("trap '' TERM INT HUP; sleep {marker}; sleep {marker}");
    let mut body = command_job(&id, "t", &["sh", "-c", &script]);
    body["sandbox"]["timeout_seconds"] = json!(4);
    let t = Instant::now();
    let (_, v) = sv.post("/v1/worker/jobs:run", &body).await;
    eprintln!(
        "{backend}: a 4 s timeout ended the job after {:?}",
        t.elapsed()
    );
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    assert_eq!(
        (v["status"].clone(), v["exit_code"].clone()),
        (json!("timeout"), json!(-1)),
        "{v}"
    );
    assert_no_leaks(&sv, &id, Some(marker));
}

pub async fn fork_bomb_is_contained(backend: &'static str) {
    let sv = Server::start(backend, "limits:\n  pids: 64\n  memory_mb: 256\n");
    let id = unique("j");
    let mut body = command_job(
        &id,
        "t",
        &["sh", "-c", "bomb() { bomb | bomb & }; bomb; sleep 5"],
    );
    body["sandbox"]["timeout_seconds"] = json!(8);
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(code, 200, "{v}");
    assert!(
        matches!(
            v["status"].as_str(),
            Some("timeout" | "failed" | "completed")
        ),
        "{v}"
    );
    assert_no_leaks(&sv, &id, None);
    // The node is still healthy and runs the next job.
    let (_, v) = sv.run_job(&unique("j"), "t", &["echo", "alive"]).await;
    assert_eq!(v["stdout"], "alive\n", "{v}");
}

pub async fn memory_hog_is_contained(backend: &'static str) {
    let sv = Server::start(backend, "limits:\n  memory_mb: 64\n");
    let id = unique("j");
    let body = command_job(
        &id,
        "t",
        &[
            "sh",
            "-c",
            "x=$(head -c 300000000 /dev/zero | tr '\\0' a); echo ${#x}",
        ],
    );
    let (_, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(v["status"], "failed", "{v}");
    assert_eq!(v["exit_code"], 137, "{v}");
    assert_eq!(
        v["failure_reason"],
        "sandbox killed by SIGKILL: memory or pids limit reached"
    );
    assert_no_leaks(&sv, &id, None);
    // Podman's conmon creates an empty `oom` in its working directory on an OOM kill:
    // engine clients run in the node's own directory, never where the node was started.
    assert!(
        !sv.dir.path().join("oom").exists(),
        "an engine helper wrote `oom` into the node's working directory"
    );
}

pub async fn resubmit_is_idempotent(backend: &'static str) {
    let sv = Server::start(backend, "");
    let id = unique("j");
    let task = unique("t");
    let count_a_run = ["sh", "-c", "echo run >> /workspace/count; sleep 1"];
    let body = command_job(&id, &task, &count_a_run);
    let (c1, _) = sv.post("/v1/worker/jobs", &body).await;
    let (c2, again) = sv.post("/v1/worker/jobs", &body).await;
    assert_eq!((c1, c2), (202, 200));
    assert_eq!(again["job_id"], json!(id));
    sv.wait_terminal(&id).await;
    let (c3, _) = sv.post("/v1/worker/jobs", &body).await;
    assert_eq!(c3, 200);
    // Sync resubmission of a finished job returns the stored response, not a new run.
    let (_, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(v["job_id"], json!(id));
    let count =
        std::fs::read_to_string(sv.state_dir().join("workspaces").join(&task).join("count"))
            .unwrap();
    assert_eq!(count, "run\n");
}

pub async fn workspace_persists_across_a_tasks_jobs(backend: &'static str) {
    let sv = Server::start(backend, "");
    let task = unique("t");
    let (_, v) = sv
        .run_job(&unique("j"), &task, &["sh", "-c", "echo first > notes.txt"])
        .await;
    assert_eq!(v["status"], "completed", "{v}");
    let (_, v) = sv.run_job(&unique("j"), &task, &["cat", "notes.txt"]).await;
    assert_eq!(v["stdout"], "first\n");
    // Another task does not see it.
    let (_, v) = sv
        .run_job(&unique("j"), &unique("t"), &["cat", "notes.txt"])
        .await;
    assert_eq!(v["status"], "failed");
}

pub async fn stop_cancels_and_removes(backend: &'static str) {
    let sv = Server::start(backend, "");
    let (id, marker) = start_long_job(&sv).await;
    let (code, _) = sv
        .post(&format!("/v1/worker/jobs/{id}:stop"), &json!({}))
        .await;
    assert_eq!(code, 200);
    let done = sv.wait_terminal(&id).await;
    assert_eq!(done["status"], "canceled", "{done}");
    assert_no_leaks(&sv, &id, Some(&marker));
}

/// A job stopped while its container is still being created: the first remove finds
/// nothing, and the client then starts the container. The node must keep removing until
/// the client is gone, so no container (and no sandbox process) outlives the canceled job.
/// The wrapper stands in for a slow engine: its `run` hands the creation to a process that
/// outlives the client (as conmon does), which starts the container detached 16 s later,
/// past the 10 s the node once waited before it gave up on the client; the client then
/// waits for its container as an attached `podman run` does.
pub async fn stop_while_the_container_is_created_leaves_nothing(backend: &'static str) {
    assert_eq!(backend, "podman", "only an engine creates containers");
    let bin = tempfile::tempdir().unwrap();
    let wrapper = bin.path().join("slow-podman");
    std::fs::write(
        &wrapper,
        r#"#!/bin/sh
[ "$1" = run ] || exec /usr/bin/podman "$@"
shift
name=$(echo "$@" | sed 's/.*--name \([^ ]*\).*/\1/')
(/bin/sleep 16; /usr/bin/podman run --detach "$@" >/dev/null; : > "$(dirname "$0")/created") & wait $!
exec /usr/bin/podman wait "$name"
"#,
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(bin.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut sv = Server::start(
        backend,
        &format!("podman:\n  binary: {}\n", wrapper.display()),
    );
    let (id, marker) = start_long_job(&sv).await;
    let (code, _) = sv
        .post(&format!("/v1/worker/jobs/{id}:stop"), &json!({}))
        .await;
    assert_eq!(code, 200);
    let done = sv
        .wait_for(&id, Duration::from_secs(90), |v| v["status"] == "canceled")
        .await;
    assert_eq!(done["status"], "canceled", "{done}");
    // The late creation has happened (now or after the job ended), and had time to show.
    let created = bin.path().join("created");
    let until = Instant::now() + Duration::from_secs(60);
    while !created.exists() {
        assert!(
            Instant::now() < until,
            "the slow client never created its container"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_no_leaks(&sv, &id, Some(&marker));
    sv.owned.push(bin);
}

pub async fn full_queue_answers_503(backend: &'static str) {
    let sv = Server::start(backend, "queue:\n  max_running: 1\n  max_queued: 1\n");
    let ids: Vec<String> = (0..3).map(|_| unique("j")).collect();
    let mut codes = Vec::new();
    for id in &ids {
        let r = sv
            .client
            .post(sv.url("/v1/worker/jobs"))
            .bearer_auth(TOKEN)
            .json(&command_job(id, "t", &["sleep", "30"]))
            .send()
            .await
            .unwrap();
        codes.push((
            r.status().as_u16(),
            r.headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_string()),
        ));
    }
    assert_eq!(
        codes,
        vec![(202, None), (202, None), (503, Some("5".to_string()))]
    );
    // The first job's task takes the run slot as soon as it is scheduled.
    let t = Instant::now();
    let full = loop {
        let (code, v) = sv.get("/v1/worker/capacity").await;
        assert_eq!(code, 200, "{v}");
        if v["running"] == 1 || t.elapsed() > Duration::from_secs(10) {
            break v;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        (
            &full["max_running"],
            &full["max_queued"],
            &full["queued"],
            &full["backend"]
        ),
        (
            &json!(1),
            &json!(1),
            &json!(1),
            &json!(node_backend(backend))
        ),
        "{full}"
    );
    assert_eq!(full["running"], 1, "{full}");
    // /metrics says the same, and only to a caller with the token.
    let text = sv.get_raw("/metrics").await.text().await.unwrap();
    let b = node_backend(backend);
    for line in [
        format!("cynode_worker_jobs_running{{backend=\"{b}\"}} 1"),
        format!("cynode_worker_jobs_queued{{backend=\"{b}\"}} 1"),
        format!("cynode_worker_jobs_max_running{{backend=\"{b}\"}} 1"),
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line} missing in:\n{text}"
        );
    }
    let anonymous = sv.client.get(sv.url("/metrics")).send().await.unwrap();
    assert_eq!(anonymous.status().as_u16(), 401);
    for id in &ids[..2] {
        sv.post(&format!("/v1/worker/jobs/{id}:stop"), &json!({}))
            .await;
    }
    for id in &ids[..2] {
        assert_eq!(sv.wait_terminal(id).await["status"], "canceled");
    }
    let (_, empty) = sv.get("/v1/worker/capacity").await;
    assert_eq!(
        (&empty["running"], &empty["queued"]),
        (&json!(0), &json!(0)),
        "{empty}"
    );
}

/// A job the database refuses to record answers 500 and gives its queue slot back: after
/// more refused submissions than the queue holds, the node still accepts a full queue.
pub async fn failed_recording_returns_the_queue_slot(backend: &'static str) {
    let sv = Server::start(backend, "queue:\n  max_running: 1\n  max_queued: 1\n");
    let db = sv.state_dir().join("worker.db");
    let opts = sqlx::sqlite::SqliteConnectOptions::new().filename(&db);
    let mut conn = sqlx::ConnectOptions::connect(&opts).await.unwrap();
    sqlx::query(
        "CREATE TRIGGER refuse_jobs BEFORE INSERT ON jobs BEGIN SELECT RAISE(FAIL, 'injected: disk full'); END",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    for _ in 0..3 {
        let (code, body) = sv
            .post(
                "/v1/worker/jobs",
                &command_job(&unique("j"), "t", &["true"]),
            )
            .await;
        assert_eq!(code, 500, "{body}");
    }
    sqlx::query("DROP TRIGGER refuse_jobs")
        .execute(&mut conn)
        .await
        .unwrap();
    let (_, cap) = sv.get("/v1/worker/capacity").await;
    assert_eq!(
        (&cap["running"], &cap["queued"]),
        (&json!(0), &json!(0)),
        "{cap}"
    );
    let ids: Vec<String> = (0..2).map(|_| unique("j")).collect();
    for id in &ids {
        let (code, body) = sv
            .post("/v1/worker/jobs", &command_job(id, "t", &["sleep", "30"]))
            .await;
        assert_eq!(code, 202, "{body}");
    }
    for id in &ids {
        sv.post(&format!("/v1/worker/jobs/{id}:stop"), &json!({}))
            .await;
        sv.wait_terminal(id).await;
    }
}

pub async fn kill9_restart_keeps_results_and_fails_the_interrupted(backend: &'static str) {
    let mut sv = Server::start(backend, "");
    let done_id = unique("j");
    sv.post(
        "/v1/worker/jobs",
        &command_job(&done_id, "t", &["echo", "kept"]),
    )
    .await;
    let before = sv.wait_terminal(&done_id).await;
    assert_eq!(before["status"], "completed");
    let (long_id, marker) = start_long_job(&sv).await;
    sv.kill9_and_restart();
    let (_, after) = sv.get(&format!("/v1/worker/jobs/{done_id}")).await;
    assert_eq!(after, before);
    let (_, interrupted) = sv.get(&format!("/v1/worker/jobs/{long_id}")).await;
    assert_eq!(interrupted["status"], "failed", "{interrupted}");
    assert_eq!(interrupted["result"]["failure_reason"], "worker_restarted");
    if crate::harness::is_engine(backend) {
        assert_eq!(
            crate::harness::job_containers(backend, &long_id),
            Vec::<String>::new()
        );
    }
    // bwrap sandboxes die with the node (--die-with-parent).
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while process_with_arg(&marker) && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !process_with_arg(&marker),
        "sandbox process survived the restart"
    );
}

pub async fn graceful_shutdown_finishes_running_jobs(backend: &'static str) {
    let mut sv = Server::start(backend, "");
    let id = unique("j");
    sv.post(
        "/v1/worker/jobs",
        &command_job(&id, "t", &["sh", "-c", "sleep 2; echo finished"]),
    )
    .await;
    sv.wait_for(&id, Duration::from_secs(30), |v| {
        v["status"] == "in_progress"
    })
    .await;
    let took = sv.terminate_and_restart();
    assert!(
        took >= Duration::from_millis(500),
        "shut down before the job finished: {took:?}"
    );
    let (_, v) = sv.get(&format!("/v1/worker/jobs/{id}")).await;
    assert_eq!(v["status"], "completed", "{v}");
    assert_eq!(
        v["result"]["stdout"],
        "finished
"
    );
}

/// Keeps `env()` referenced so setup runs first even when a filter selects one case.
pub fn setup() {
    let _ = env();
}

/// [`setup`], plus what `backend` needs of its own (the microVM's guest kernel and init).
pub fn setup_for(backend: &str) {
    if backend == "microvm" {
        crate::microvm::setup();
    } else {
        setup();
    }
}
