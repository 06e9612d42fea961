//! Disk-limit attacks: a session command writing past `disk_mb` is
//! stopped like a job, on both backends.

use serde_json::json;

use crate::harness::{env, session_guard, unique, Server};

on_both_backends!(
    disk_attacks:
    disk_session_command_over_the_limit_is_stopped,
    disk_deep_tree_and_fallocate_are_breaches,
);

/// A job's workspace dir on the host (the workspace of task `task`).
fn workspace(sv: &Server, task: &str) -> std::path::PathBuf {
    sv.state_dir().join("workspaces").join(task)
}

/// A tree deeper than PATH_MAX (the guard cannot measure it by paths: a breach, never "no
/// breach"), and one `fallocate` of 1 GiB under `disk_mb: 48`: both fail the job
/// `resource_limit_exceeded`, and the data is removed.
pub async fn disk_deep_tree_and_fallocate_are_breaches(backend: &'static str) {
    let sv = Server::start(backend, "limits:\n  disk_mb: 48\n  disk_max_files: 4000\n");
    // 100 MiB written into a file 31 levels of 200-byte names deep (past PATH_MAX, so a
    // walk by path cannot reach it): the file is opened at depth 15, its tree moved under
    // another 15 levels, then written through the open descriptor. The fd walk measures it,
    // so the breach is on bytes, not "could not be measured".
    let deep = "d=$(printf 'd%.0s' $(seq 200)); p=A; q=B; i=0; while [ $i -lt 15 ]; do p=$p/$d; q=$q/$d; i=$((i+1)); done; mkdir -p $p $q || exit 9; exec 3>$q/big || exit 9; mv B $p/ || exit 9; dd if=/dev/zero bs=1048576 count=100 >&3 2>/dev/null; echo made";
    let big = "fallocate -l 1073741824 /workspace/big; echo made";
    for (what, script) in [("deep tree", deep), ("fallocate", big)] {
        let task = unique("t");
        let (code, v) = sv.run_job(&unique("j"), &task, &["sh", "-c", script]).await;
        assert_eq!(code, 200, "{v}");
        eprintln!("{backend}: {what}: {}", v["failure_reason"]);
        assert_eq!(v["status"], "failed", "{backend} {what}: {v}");
        assert!(
            v["failure_reason"]
                .as_str()
                .is_some_and(|r| r.starts_with("resource_limit_exceeded")),
            "{backend} {what}: {v}"
        );
        assert!(
            !v["failure_reason"]
                .as_str()
                .unwrap_or_default()
                .contains("could not be measured"),
            "{backend} {what}: measured, not refused: {v}"
        );
        let ws = workspace(&sv, &task);
        assert!(
            ws.is_dir(),
            "{backend} {what}: no workspace at {}",
            ws.display()
        );
        assert_eq!(
            std::fs::read_dir(&ws).map(|d| d.count()).unwrap_or(0),
            0,
            "{backend} {what}: the data stayed in {}",
            ws.display()
        );
    }
}

/// A session command writing 200 MiB under `disk_mb: 48` fails `resource_limit_exceeded`
/// and does not write it all; the session ends.
pub async fn disk_session_command_over_the_limit_is_stopped(backend: &'static str) {
    let sv = Server::start(backend, "limits:\n  disk_mb: 48\n");
    let sid = unique("s");
    let task = unique("t");
    let _guard = session_guard(backend, &sid);
    let body = json!({ "version": 1, "session_id": sid, "task_id": task, "image": env().image });
    let (code, v) = sv.post("/v1/worker/sessions", &body).await;
    assert_eq!(code, 201, "{v}");
    let script = "dd if=/dev/zero of=/workspace/fill bs=1048576 count=200 && echo wrote-all";
    let (code, v) = sv
        .post(
            &format!("/v1/worker/sessions/{sid}/exec"),
            &json!({ "version": 1, "command": ["sh", "-c", script] }),
        )
        .await;
    assert_eq!(code, 200, "{v}");
    eprintln!("{backend}: {v}");
    assert_eq!(v["status"], "failed", "{backend}: {v}");
    assert!(
        v["failure_reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("resource_limit_exceeded")),
        "{backend}: {v}"
    );
    let ws = sv.state_dir().join("workspaces").join(&task);
    assert!(ws.is_dir(), "{backend}: the workspace went");
    assert!(!ws.join("fill").exists(), "{backend}: the data stayed");
    let (_, info) = sv.get(&format!("/v1/worker/sessions/{sid}")).await;
    assert_eq!(info["status"], "ended", "{backend}: {info}");
}
