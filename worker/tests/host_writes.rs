//! Attacks on what the node creates, chowns and removes on the host in a job's directory
//!. A real job in a real sandbox plants each trap, on
//! podman and bwrap; the tests assert that the host is untouched: no host directory or file
//! re-owned or overwritten through a planted link, no worker crash on a deep tree, no
//! artifact listed under another file's name.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use cynode_protocol::worker_api::RunJobRequest;
use serde_json::{json, Value};

use crate::harness::{sba_job, unique, Server};

on_both_backends!(
    host_writes: planted_links_in_a_job_directory_are_never_followed,
    a_deep_tree_is_removed_by_ack_and_by_the_retention_sweep,
    artifact_names_that_are_not_utf8_are_refused,
);

/// A root-owned directory (mode 0700) holding a root-owned file (mode 0600, `canary`):
/// the things a planted link points at.
struct Canary {
    _dir: tempfile::TempDir,
    dir: std::path::PathBuf,
    file: std::path::PathBuf,
}

impl Canary {
    fn new() -> Canary {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("root-only");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let file = t.path().join("root-file");
        std::fs::write(&file, b"canary").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        Canary { _dir: t, dir, file }
    }

    fn assert_untouched(&self) {
        let d = std::fs::metadata(&self.dir).unwrap();
        assert_eq!((d.uid(), d.gid()), (0, 0), "canary directory re-owned");
        assert_eq!(d.mode() & 0o7777, 0o700, "canary directory re-moded");
        let f = std::fs::metadata(&self.file).unwrap();
        assert_eq!((f.uid(), f.gid()), (0, 0), "canary file re-owned");
        assert_eq!(f.mode() & 0o7777, 0o600, "canary file re-moded");
        assert_eq!(
            std::fs::read(&self.file).unwrap(),
            b"canary",
            "canary file written"
        );
    }
}

fn node_config(sv: &Server) -> cynode_worker::config::Config {
    cynode_worker::config::Config::load(&sv.dir.path().join("worker.yaml")).unwrap()
}

/// Finding 1: a job replaces `/job/artifacts` and `/job/job.json` with links to a
/// root-owned host directory and file, and its directory is then prepared again (what
/// `replay` did with a predictable job id naming a tenant's retained job). Preparing must
/// refuse the existing directory and touch neither host path; `replay` itself works in a
/// fresh directory under an unpredictable id and leaves the canary alone too.
pub async fn planted_links_in_a_job_directory_are_never_followed(backend: &'static str) {
    let canary = Canary::new();
    let sv = Server::start(backend, "");
    let id = unique("j");
    let plant = format!(
        "rm -rf /job/artifacts && ln -s {} /job/artifacts && ln -s {} /job/job.json && ln -s {} /job/result.json",
        canary.dir.display(),
        canary.file.display(),
        canary.file.display()
    );
    let (code, body) = sv.run_job(&id, "t", &["sh", "-c", &plant]).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["exit_code"], 0, "{body}");
    let jobdir = sv.state_dir().join("jobs").join(&id).join("job");
    assert!(std::fs::symlink_metadata(jobdir.join("artifacts"))
        .unwrap()
        .file_type()
        .is_symlink());

    // The same directory prepared again for an SBA job (which writes job.json).
    let cfg = node_config(&sv);
    let req: RunJobRequest = serde_json::from_value(sba_job(
        &id,
        "t",
        json!([{ "id": "s", "type": "run_command", "arguments": { "command": "true" } }]),
        json!([]),
    ))
    .unwrap();
    let accepted = cynode_worker::executor::check(&cfg, &req)
        .expect("a valid request")
        .with_uid(0x7000_0000);
    let prepared = cynode_worker::executor::PreparedJob::prepare(&cfg, &req, accepted);
    canary.assert_untouched();
    let e = prepared.expect_err("an existing job directory must be refused");
    assert!(e.to_string().contains("exists"), "{e}");

    // replay of the planting job: a fresh directory under a random id.
    let out = replay(&sv, &id);
    assert_eq!(out["job_id"], id.as_str(), "{out}");
    let rid = out["replay_job_id"].as_str().unwrap();
    let suffix = rid.rsplit('-').next().unwrap();
    assert_eq!(suffix.len(), 32, "a random 128-bit suffix: {rid}");
    assert!(suffix.bytes().all(|b| b.is_ascii_hexdigit()), "{rid}");
    assert!(!sv.state_dir().join("jobs").join(rid).exists());
    canary.assert_untouched();
}

/// `cynode-worker replay ID` against `sv`'s state; its JSON report.
fn replay(sv: &Server, id: &str) -> Value {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_cynode-worker"));
    cmd.args(["replay", id, "--config"])
        .arg(sv.dir.path().join("worker.yaml"));
    let out = cynode_testkit::output_bounded(cmd, Duration::from_secs(180));
    assert!(
        out.status.success(),
        "replay failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "replay output is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// A shell script that builds `/job/c/a/…/a/c/a/…` about 20,500 directories deep without
/// ever naming a path longer than PATH_MAX: chains of 1,024 are made with `mkdir -p` and
/// the tree built so far is moved to the bottom of each new chain.
const DEEP_TREE: &str = "cd /job || exit 1; p=a; for i in 1 2 3 4 5 6 7 8 9 10; do p=$p/$p; done; \
     mkdir -p c/$p || exit 1; \
     for k in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19; do \
       mkdir -p n/$p && mv c n/$p/ && mv n c || exit 1; done";

/// Finding 2: a job leaves a tree about 20,500 directories deep in its job directory.
/// `:ack` removes it and the worker lives on; a second such job, never acked, is removed by
/// the retention sweep of a restarted worker, which lives on too.
pub async fn a_deep_tree_is_removed_by_ack_and_by_the_retention_sweep(backend: &'static str) {
    let mut sv = Server::start(backend, "");
    let jobs = sv.state_dir().join("jobs");
    // Dropped before the server: a tree left by a failure must not overflow the test's
    // own stack in the temp directory's recursive removal.
    let _cleanup = RemoveOnDrop(jobs.clone());
    let (a, b) = (unique("j"), unique("j"));
    for id in [&a, &b] {
        let (code, body) = sv.run_job(id, "t", &["sh", "-c", DEEP_TREE]).await;
        assert_eq!(code, 200, "{body}");
        assert_eq!(body["status"], "completed", "{body}");
        assert!(jobs.join(id).join("job/c/a").is_dir());
    }
    let (code, body) = sv
        .post(&format!("/v1/worker/jobs/{a}:ack"), &json!({}))
        .await;
    assert_eq!(code, 204, "{body}");
    assert!(!jobs.join(&a).exists(), "acked job directory left");
    let (code, _) = sv.get("/healthz").await;
    assert_eq!(code, 200, "the worker died removing a deep tree");

    // Every finished job is past a one-second retention by the time the worker is back.
    sv.extra_config = "retention_seconds: 1\n".into();
    std::thread::sleep(Duration::from_millis(1100));
    sv.terminate_and_restart();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    // The sweep removes the directory, then the record.
    loop {
        let (code, _) = sv.get(&format!("/v1/worker/jobs/{b}")).await;
        if code == 404 && !jobs.join(&b).exists() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the retention sweep left the deep tree (status {code})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (code, _) = sv.get("/healthz").await;
    assert_eq!(code, 200, "the worker died in its retention sweep");
}

/// Removes a tree with the node's own iterative removal when the test ends.
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = cynode_worker::remove_tree::remove_tree(&self.0);
    }
}

/// Finding 10: `x\xff` (not UTF-8) and `x\u{fffd}` (its lossy spelling) side by side in
/// the artifacts. The node never lists one under the other's name: a name that is not UTF-8
/// refuses the artifacts, naming the file with its bytes escaped.
pub async fn artifact_names_that_are_not_utf8_are_refused(backend: &'static str) {
    let sv = Server::start(backend, "");
    let id = unique("j");
    let script = "cd /job/artifacts && printf raw > \"$(printf 'x\\377')\" && printf lossy > \"$(printf 'x\\357\\277\\275')\"";
    let (code, body) = sv.run_job(&id, "t", &["sh", "-c", script]).await;
    assert_eq!(code, 200, "{body}");
    assert!(Path::new(
        &sv.state_dir()
            .join("jobs")
            .join(&id)
            .join("job/artifacts/x\u{fffd}")
    )
    .exists());
    assert_eq!(body["status"], "failed", "{body}");
    assert_eq!(body["artifacts"], Value::Null, "{body}");
    let reason = body["failure_reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("x\\xff") && reason.contains("not UTF-8"),
        "{reason}"
    );

    // With only the UTF-8 one, it is listed and hashed as itself.
    let id = unique("j");
    let script = "cd /job/artifacts && printf lossy > \"$(printf 'x\\357\\277\\275')\"";
    let (_, body) = sv.run_job(&id, "t", &["sh", "-c", script]).await;
    assert_eq!(body["status"], "completed", "{body}");
    assert_eq!(
        body["artifacts"],
        json!([{ "path": "x\u{fffd}", "sha256": crate::harness::sha256_hex(b"lossy"), "size_bytes": 5 }]),
        "{body}"
    );
}
