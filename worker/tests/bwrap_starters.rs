//! The bwrap backend's pre-spawned starters (`backend/bwrap/starter.rs`): each serves
//! exactly one job (concurrent jobs each get their own argv, environment and cgroup, never
//! another's), the pool shows in `/metrics`, and a node killed with starters waiting
//! leaves no starter process, and after its restart no starter cgroup, behind.

use std::path::PathBuf;
use std::time::Duration;

use crate::harness::{command_job, Server};

/// `name value` of a metrics line starting with `name`.
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
}

async fn metrics(sv: &Server) -> String {
    sv.get_raw("/metrics").await.text().await.unwrap()
}

/// The node's cgroup directories (v1 pids hierarchy or v2), from its state directory.
pub fn node_cgroups(sv: &Server) -> Vec<PathBuf> {
    let mut dirs = crate::harness::node_cgroup_dirs(&sv.state_dir());
    dirs.retain(|p| p.is_dir());
    dirs
}

/// The starter cgroups of the node and the processes in them.
fn starters(sv: &Server) -> Vec<(PathBuf, Vec<i32>)> {
    node_cgroups(sv)
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flat_map(|d| d.flatten())
        .filter(|e| e.file_name().to_string_lossy().starts_with("starter-"))
        .map(|e| {
            let procs = std::fs::read_to_string(e.path().join("cgroup.procs"))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect();
            (e.path(), procs)
        })
        .collect()
}

/// Whether process `pid` exists and has not exited. An exited one may stay a zombie for
/// a while: its new parent (under CI, `cynode-reap`, the run's subreaper) reaps it only
/// at the end, and a zombie runs nothing.
pub fn runs(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit(')')
        .next()
        .and_then(|r| r.split_whitespace().next());
    !matches!(state, Some("Z" | "X"))
}

/// Waits (at most 30 s) until `f` holds.
async fn eventually(what: &str, f: impl FnMut() -> bool) {
    crate::harness::eventually(what, Duration::from_secs(30), f).await;
}

/// 16 jobs, 4 at a time, each printing its own job id (from its environment) and argv
/// marker: every answer carries its own, never another job's; the metrics count warm
/// starts, and every starter made went to one job or is still ready.
pub async fn each_bwrap_starter_serves_one_job(backend: &'static str) {
    let sv = Server::start(backend, "queue:\n  max_running: 4\n");
    // The pool starts with the first job.
    let (code, v) = sv
        .run_job("st-first", "st-task", &["sh", "-c", "echo first"])
        .await;
    assert_eq!(
        (code, v["status"].as_str()),
        (200, Some("completed")),
        "{v}"
    );
    let m = metrics(&sv).await;
    eventually("two starters ready", || {
        starters(&sv).iter().filter(|(_, p)| !p.is_empty()).count() >= 2
    })
    .await;
    let sv = std::sync::Arc::new(sv);
    let mut jobs = tokio::task::JoinSet::new();
    for i in 0..16 {
        let sv = std::sync::Arc::clone(&sv);
        jobs.spawn(async move {
            let id = format!("st-{i}");
            let body = command_job(
                &id,
                &format!("st-task-{i}"),
                &["sh", "-c", &format!("echo \"$CYNODE_JOB_ID marker-{i}\"")],
            );
            let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
            (id, i, code, v)
        });
    }
    while let Some(done) = jobs.join_next().await {
        let (id, i, code, v) = done.unwrap();
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["status"], "completed", "{v}");
        assert_eq!(
            v["stdout"].as_str().unwrap().trim(),
            format!("{id} marker-{i}"),
            "job {id} got another job's sandbox: {v}"
        );
    }
    let m2 = metrics(&sv).await;
    let warm = metric(&m2, "cynode_worker_bwrap_starts_total{pool=\"warm\"}");
    let cold = metric(&m2, "cynode_worker_bwrap_starts_total{pool=\"cold\"}");
    let made = metric(&m2, "cynode_worker_bwrap_starters_made_total");
    let ready = metric(&m2, "cynode_worker_bwrap_starters_ready");
    assert_eq!(
        metric(&m2, "cynode_worker_bwrap_starters_target"),
        2,
        "{m2}"
    );
    assert_eq!(
        warm + cold,
        17,
        "every job started once, warm or cold:\n{m}\n{m2}"
    );
    assert!(warm >= 2, "the pool served no job:\n{m2}");
    // A starter is made once and used at most once: the ones made are the ones that
    // served a job, are ready, or failed (counted).
    let failures = metric(&m2, "cynode_worker_bwrap_starter_failures_total");
    assert!(
        made >= warm + ready && made <= warm + ready + failures + 1,
        "made {made}, warm {warm}, ready {ready}, failures {failures}:\n{m2}"
    );
    // Every job's cgroup went with it: only the ready starters' remain.
    eventually("only starter cgroups left", || {
        node_cgroups(&sv)
            .iter()
            .filter_map(|d| std::fs::read_dir(d).ok())
            .flat_map(|d| d.flatten())
            .filter(|e| e.path().is_dir())
            .all(|e| e.file_name().to_string_lossy().starts_with("starter-"))
    })
    .await;
}

/// A node SIGKILLed with starters waiting: they die with it (nothing runs in their
/// cgroups), and the restarted node removes their cgroups and serves jobs.
pub async fn a_killed_node_leaves_no_bwrap_starter(backend: &'static str) {
    let mut sv = Server::start(backend, "");
    let (code, v) = sv.run_job("sk-1", "sk-task", &["true"]).await;
    assert_eq!(
        (code, v["status"].as_str()),
        (200, Some("completed")),
        "{v}"
    );
    eventually("two starters ready", || {
        starters(&sv).iter().filter(|(_, p)| !p.is_empty()).count() >= 2
    })
    .await;
    let before: Vec<(PathBuf, Vec<i32>)> = starters(&sv);
    let pids: Vec<i32> = before.iter().flat_map(|(_, p)| p.clone()).collect();
    assert!(!pids.is_empty(), "{before:?}");
    sv.kill9_and_restart();
    eventually("the old starters' processes are gone", || {
        pids.iter().all(|p| !runs(*p))
    })
    .await;
    for (dir, _) in &before {
        assert!(
            !dir.exists(),
            "the restarted node left a starter cgroup of the killed one: {}",
            dir.display()
        );
    }
    let (code, v) = sv.run_job("sk-2", "sk-task", &["true"]).await;
    assert_eq!(
        (code, v["status"].as_str()),
        (200, Some("completed")),
        "{v}"
    );
}

mod bwrap {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_bwrap_starter_serves_one_job() {
        crate::cases::setup();
        super::each_bwrap_starter_serves_one_job("bwrap").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_killed_node_leaves_no_bwrap_starter() {
        crate::cases::setup();
        super::a_killed_node_leaves_no_bwrap_starter("bwrap").await;
    }
}
