//! Attacks on what the node reads back from a sandbox, and on its idempotency (links out
//! of the sandbox, FIFOs, huge results, stored results). A real job in a real sandbox
//! does each attack, on every backend; the tests assert that nothing reached the host: no
//! host file read through a link, the node answering while a FIFO sits at result.json, no
//! RSS growth from a huge result, no unbounded hashing, no unbounded disk use, no stored
//! result handed to another request.

use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::{command_job, sba_job, unique, Server};

on_both_backends!(
    host_reads:
    symlinked_result_is_never_read,
    fifo_result_does_not_hang_the_node,
    huge_sparse_result_is_read_bounded,
    artifact_caps_each_fail_the_job,
    artifact_hashing_is_bounded_in_time,
    disk_limit_stops_a_job_filling_its_workspace,
    job_id_reuse_with_another_request_is_409,
    swapped_artifacts_dir_and_artifact_links_are_never_followed,
);

/// An SBA job whose one step runs `script` with `sh -c`.
fn sh_step_job(id: &str, task: &str, script: &str) -> Value {
    sba_job(
        id,
        task,
        json!([{ "id": "s", "type": "run_command",
                 "arguments": { "command": "sh", "args": ["-c", script] } }]),
        json!([]),
    )
}

fn reason(v: &Value) -> String {
    v["failure_reason"].as_str().unwrap_or_default().to_string()
}

/// The worker process of `sv` (its command line names the server's config file).
fn worker_pid(sv: &Server) -> u32 {
    let needle = sv.dir.path().join("worker.yaml").display().to_string();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(c) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let c = String::from_utf8_lossy(&c).replace('\0', " ");
        if c.contains("cynode-worker") && c.contains(&needle) {
            return pid;
        }
    }
    panic!("no worker process for {needle}");
}

/// A field of /proc/<pid>/status in bytes (`VmHWM`, `VmRSS`).
fn status_bytes(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in status of {pid}"));
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// Free bytes for unprivileged users on the filesystem of `p`.
fn free_bytes(p: &std::path::Path) -> u64 {
    let c = std::ffi::CString::new(p.display().to_string()).unwrap();
    // SAFETY: statvfs fills the zeroed struct for a valid NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    st.f_bavail * st.f_frsize
}

/// Bytes allocated under `p` (st_blocks), never following links.
fn allocated(p: &std::path::Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![p.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            total += m.blocks() * 512;
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    total
}

/// Finding 4: result.json linked to a root-only host file holding a forged success, and
/// /job made read-only so the runner cannot replace the link. The node must not read the
/// host file: the job fails naming the link.
async fn symlinked_result_is_never_read(backend: &'static str) {
    let sv = Server::start(backend, "");
    let id = unique("j");
    let task = unique("t");
    let secret_dir = tempfile::tempdir().unwrap();
    let secret = secret_dir.path().join("secret.json");
    let marker = format!("host-secret-{}", unique("m"));
    let forged = json!({
        "protocol_version": "1.0", "job_id": id, "task_id": task, "status": "success",
        "started_at": "2026-01-01T00:00:00Z", "finished_at": "2026-01-01T00:00:01Z",
        "steps": [], "artifacts": [],
        "resource_usage": { "cpu_time_ms": 0, "max_rss_bytes": 0 },
        "failure_code": null, "failure_message": null, "error": null,
        "final_answer": marker, "todo": null
    });
    // The forgery is a valid result: read through the link, it would be believed.
    serde_json::from_value::<cynode_protocol::JobResult>(forged.clone()).unwrap();
    std::fs::write(&secret, forged.to_string()).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let script = format!(
        "ln -sf {} /job/result.json && chmod 555 /job",
        secret.display()
    );
    let (code, v) = sv
        .post("/v1/worker/jobs:run", &sh_step_job(&id, &task, &script))
        .await;
    assert_eq!(code, 200, "{v}");
    assert_ne!(v["status"], "completed", "{v}");
    assert_eq!(v["status"], "failed", "{v}");
    assert!(
        reason(&v).contains("symbolic link"),
        "the reason must name the link: {v}"
    );
    assert!(!v.to_string().contains(&marker), "host file leaked: {v}");
    assert_eq!(v.get("sba_result"), None, "{v}");
    // The stored status says the same.
    let (_, st) = sv.get(&format!("/v1/worker/jobs/{id}")).await;
    assert_eq!(st["status"], "failed", "{st}");
    assert!(!st.to_string().contains(&marker));
}

/// Finding 5: a FIFO at result.json (and /job read-only). With two such jobs the node must
/// keep answering /healthz and status calls, and both jobs fail naming the FIFO.
async fn fifo_result_does_not_hang_the_node(backend: &'static str) {
    let sv = Server::start(backend, "");
    let ids = [unique("j"), unique("j")];
    for id in &ids {
        let body = sh_step_job(
            id,
            &unique("t"),
            "rm -f /job/result.json; mkfifo /job/result.json && chmod 555 /job",
        );
        let (code, v) = sv.post("/v1/worker/jobs", &body).await;
        assert_eq!(code, 202, "{v}");
    }
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(180);
    let mut done: Vec<Value> = Vec::new();
    while done.len() < ids.len() {
        assert!(Instant::now() < until, "jobs never ended: {done:?}");
        let r = client
            .get(sv.url("/healthz"))
            .send()
            .await
            .expect("/healthz did not answer within 10s: the node hangs");
        assert_eq!(r.status().as_u16(), 200);
        done.clear();
        for id in &ids {
            let r = client
                .get(sv.url(&format!("/v1/worker/jobs/{id}")))
                .bearer_auth(crate::harness::TOKEN)
                .send()
                .await
                .expect("a status call did not answer within 10s: the node hangs");
            let v: Value = r.json().await.unwrap();
            if matches!(
                v["status"].as_str(),
                Some("completed" | "failed" | "timeout" | "canceled")
            ) {
                done.push(v);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for v in &done {
        assert_eq!(v["status"], "failed", "{v}");
        assert!(reason(&v["result"]).contains("fifo"), "{v}");
    }
    // And it still takes work.
    let (_, v) = sv.run_job(&unique("j"), "t", &["true"]).await;
    assert_eq!(v["status"], "completed", "{v}");
}

/// Finding 6: a 1 GiB sparse result.json. The node reads at most its cap: its peak RSS
/// does not grow by the file, and the job fails naming the cap.
async fn huge_sparse_result_is_read_bounded(backend: &'static str) {
    let sv = Server::start(backend, "");
    let pid = worker_pid(&sv);
    // Warm up (first job's allocations) before the baseline.
    sv.run_job(&unique("j"), "t", &["true"]).await;
    let before = status_bytes(pid, "VmHWM");
    let id = unique("j");
    let body = sh_step_job(
        &id,
        &unique("t"),
        "rm -f /job/result.json; truncate -s 1073741824 /job/result.json && chmod 555 /job",
    );
    let (_, v) = sv.post("/v1/worker/jobs:run", &body).await;
    let after = status_bytes(pid, "VmHWM");
    eprintln!(
        "{backend}: worker peak RSS {} MiB before, {} MiB after",
        before >> 20,
        after >> 20
    );
    assert_eq!(v["status"], "failed", "{v}");
    assert!(
        reason(&v).contains("limits.result_max_bytes") && reason(&v).contains("over the cap"),
        "{v}"
    );
    assert!(
        after < before + (256 << 20),
        "worker peak RSS grew from {before} to {after} bytes"
    );
}

/// Finding 8: artifact collection is capped in count, per-file size and total size; each
/// breach fails the job naming the cap, and an 8 GiB sparse artifact is refused at once.
async fn artifact_caps_each_fail_the_job(backend: &'static str) {
    let sv = Server::start(
        backend,
        "limits:\n  artifact_max_files: 50\n  artifact_max_file_mb: 2\n  artifact_max_total_mb: 3\n",
    );
    let cases = [
        (
            "for i in $(seq 1 60); do : > $CYNODE_ARTIFACTS_DIR/f$i; done",
            "limits.artifact_max_files",
        ),
        (
            "truncate -s 8589934592 $CYNODE_ARTIFACTS_DIR/big.bin",
            "limits.artifact_max_file_mb",
        ),
        (
            "for i in 1 2; do head -c 1800000 /dev/zero > $CYNODE_ARTIFACTS_DIR/f$i; done",
            "limits.artifact_max_total_mb",
        ),
    ];
    for (script, key) in cases {
        let id = unique("j");
        let t = Instant::now();
        let (_, v) = sv.run_job(&id, &unique("t"), &["sh", "-c", script]).await;
        assert_eq!(v["status"], "failed", "{script}: {v}");
        assert!(
            reason(&v).starts_with("resource_limit_exceeded: artifacts:")
                && reason(&v).contains(key),
            "{script}: {v}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{script}: took {:?}",
            t.elapsed()
        );
    }
    // Below every cap, artifacts are hashed as before.
    let (_, v) = sv
        .run_job(
            &unique("j"),
            &unique("t"),
            &["sh", "-c", "echo hi > $CYNODE_ARTIFACTS_DIR/ok"],
        )
        .await;
    assert_eq!(v["status"], "completed", "{v}");
    assert_eq!(v["artifacts"][0]["path"], "ok", "{v}");
}

/// Finding 8, the time bound: with the size caps lifted, a 64 GiB sparse artifact would
/// keep the node hashing for minutes; hashing stops at `artifact_hash_seconds`.
async fn artifact_hashing_is_bounded_in_time(backend: &'static str) {
    let sv = Server::start(
        backend,
        "limits:\n  artifact_max_file_mb: 1048576\n  artifact_max_total_mb: 1048576\n  artifact_hash_seconds: 2\n",
    );
    let id = unique("j");
    let t = Instant::now();
    let (_, v) = sv
        .run_job(
            &id,
            &unique("t"),
            &[
                "sh",
                "-c",
                "truncate -s 68719476736 $CYNODE_ARTIFACTS_DIR/huge.bin",
            ],
        )
        .await;
    let took = t.elapsed();
    eprintln!("{backend}: job with a 64 GiB sparse artifact answered in {took:?}");
    assert_eq!(v["status"], "failed", "{v}");
    assert!(reason(&v).contains("limits.artifact_hash_seconds"), "{v}");
    // 2 s of hashing plus the sandbox's start and end, generously.
    assert!(took < Duration::from_secs(45), "took {took:?}");
}

/// Finding 7: a job writing 2 GiB into /workspace is stopped near `disk_mb` (64 MiB): the
/// workspace and the host's free space stay well under 1 GiB. The overshoot is the job's
/// write rate times the guard's interval plus the backend's stop latency (measured: bwrap
/// ~75 MiB, podman ~100 MiB idle and ~540 MiB on a loaded host). A job creating too many
/// files is stopped too.
async fn disk_limit_stops_a_job_filling_its_workspace(backend: &'static str) {
    let sv = Server::start(backend, "limits:\n  disk_mb: 64\n  disk_max_files: 500\n");
    let task = unique("t");
    let free_before = free_bytes(&sv.state_dir());
    let (_, v) = sv
        .run_job(
            &unique("j"),
            &task,
            &[
                "sh",
                "-c",
                "dd if=/dev/zero of=/workspace/fill bs=1048576 count=2048 && echo wrote-all",
            ],
        )
        .await;
    let free_after = free_bytes(&sv.state_dir());
    let used = allocated(&sv.state_dir().join("workspaces").join(&task));
    eprintln!(
        "{backend}: workspace holds {} MiB after the job; host free space dropped {} MiB",
        used >> 20,
        free_before.saturating_sub(free_after) >> 20
    );
    assert_eq!(v["status"], "failed", "{v}");
    assert!(
        reason(&v).starts_with("resource_limit_exceeded") && reason(&v).contains("limits.disk_mb"),
        "{v}"
    );
    assert!(
        !v["stdout"].as_str().unwrap_or("").contains("wrote-all"),
        "{v}"
    );
    assert!(used < 1 << 30, "the job wrote {used} bytes");
    assert!(
        free_before.saturating_sub(free_after) < 1 << 30,
        "host free space dropped by 1 GiB or more"
    );

    let (_, v) = sv.run_job(&unique("j"),
                &unique("t"),
                &[
                    "sh",
                    "-c",
                    "mkdir /workspace/m && cd /workspace/m && for i in $(seq 1 5000); do : > f$i; done; echo made-all",
                ]).await;
    assert_eq!(v["status"], "failed", "{v}");
    assert!(
        reason(&v).starts_with("resource_limit_exceeded")
            && reason(&v).contains("limits.disk_max_files"),
        "{v}"
    );
}

/// Finding 13: the same job_id with the same request returns the stored result; with
/// another task_id or command it is a 409 naming the job, on both endpoints, and the
/// second request never runs.
async fn job_id_reuse_with_another_request_is_409(backend: &'static str) {
    let sv = Server::start(backend, "");
    let id = unique("j");
    let task = unique("t");
    let body = command_job(
        &id,
        &task,
        &["sh", "-c", "echo first; echo run >> /workspace/count"],
    );
    let (code, first) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!((code, first["status"].clone()), (200, json!("completed")));
    let (code, again) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(code, 200);
    assert_eq!(again, first);
    let (code, _) = sv.post("/v1/worker/jobs", &body).await;
    assert_eq!(code, 200);

    let other_task_id = unique("t");
    let mut other_command = body.clone();
    other_command["sandbox"]["command"] =
        json!(["sh", "-c", "echo second; echo run >> /workspace/count"]);
    let mut other_task = body.clone();
    other_task["task_id"] = json!(other_task_id);
    for other in [&other_command, &other_task] {
        for path in ["/v1/worker/jobs:run", "/v1/worker/jobs"] {
            let r = sv
                .client
                .post(sv.url(path))
                .bearer_auth(crate::harness::TOKEN)
                .json(other)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 409, "{path}");
            assert_eq!(r.headers()["content-type"], "application/problem+json");
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["type"], "urn:cynodeai:error:conflict", "{path}: {v}");
            assert!(
                v["detail"].as_str().unwrap_or("").contains(&id),
                "{path}: {v}"
            );
        }
    }
    // Neither other request ran.
    let count =
        std::fs::read_to_string(sv.state_dir().join("workspaces").join(&task).join("count"))
            .unwrap();
    assert_eq!(count, "run\n");
    assert!(!sv
        .state_dir()
        .join("workspaces")
        .join(&other_task_id)
        .exists());

    // An async job reused while it still runs is a conflict too.
    let id2 = unique("j");
    let slow = command_job(&id2, &task, &["sleep", "2"]);
    assert_eq!(sv.post("/v1/worker/jobs", &slow).await.0, 202);
    let mut slow_other = slow.clone();
    slow_other["sandbox"]["command"] = json!(["sleep", "3"]);
    assert_eq!(sv.post("/v1/worker/jobs", &slow_other).await.0, 409);
    assert_eq!(sv.post("/v1/worker/jobs:run", &slow_other).await.0, 409);
    assert_eq!(sv.wait_terminal(&id2).await["status"], "completed");
}

/// Beyond the list: the job swaps /job/artifacts itself for a link to a root-only host
/// directory (or links artifacts to host files). The node neither hashes nor serves what
/// the links point at.
async fn swapped_artifacts_dir_and_artifact_links_are_never_followed(backend: &'static str) {
    use std::os::unix::fs::PermissionsExt;
    let sv = Server::start(backend, "");
    let secret_dir = tempfile::tempdir().unwrap();
    let secret = format!("host-secret-{}", unique("m"));
    std::fs::write(secret_dir.path().join("secret.txt"), &secret).unwrap();
    std::fs::set_permissions(
        secret_dir.path().join("secret.txt"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let secret_sha = crate::harness::sha256_hex(secret.as_bytes());
    let dir = secret_dir.path().display();

    let id = unique("j");
    let script = format!("rm -rf /job/artifacts && ln -s {dir} /job/artifacts");
    let (_, v) = sv.run_job(&id, &unique("t"), &["sh", "-c", &script]).await;
    assert_eq!(v["status"], "failed", "{v}");
    assert!(reason(&v).contains("symbolic link"), "{v}");
    assert!(!v.to_string().contains(&secret_sha), "{v}");
    let r = sv
        .get_raw(&format!("/v1/worker/jobs/{id}/artifacts/secret.txt"))
        .await;
    assert_eq!(r.status().as_u16(), 404);
    assert!(!r.text().await.unwrap().contains(&secret));

    let id = unique("j");
    let script = format!(
        "ln -s {dir}/secret.txt $CYNODE_ARTIFACTS_DIR/leak && ln -s {dir} $CYNODE_ARTIFACTS_DIR/d && echo ok > $CYNODE_ARTIFACTS_DIR/ok"
    );
    let (_, v) = sv.run_job(&id, &unique("t"), &["sh", "-c", &script]).await;
    assert_eq!(v["status"], "completed", "{v}");
    let listed = cynode_testkit::field_strs(&v["artifacts"], "path");
    assert_eq!(listed, vec!["ok"], "{v}");
    for path in ["leak", "d/secret.txt"] {
        let r = sv
            .get_raw(&format!("/v1/worker/jobs/{id}/artifacts/{path}"))
            .await;
        assert_eq!(r.status().as_u16(), 404, "{path}");
        assert!(!r.text().await.unwrap().contains(&secret), "{path}");
    }
}
