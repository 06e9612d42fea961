//! The warm pools of Podman, Docker and Podman with gVisor (`podman.pool_size`,
//! `docker.pool_size`; `worker/src/backend/engine/pool.rs`), on the real engines: the
//! attack tests first (a job cannot see or use the waiter or its control socket, has a
//! cold job's credentials, and never shares a container with another job), then the
//! node's side (a killed worker leaves no pooled container, `/metrics` counts claims and
//! misses, a miss runs cold), and the whole contract suite (`cases.rs`) once more on each
//! engine with its pool on (`podman_warm`, `docker_warm`, `runsc_warm`: pool_size 2,
//! filled before the node listens).

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::{
    command_job, engine_cli, engine_names, env, process_with_arg, unique, Server,
};

/// The pool waiter, built once (deploy/worker/build-waiter.sh).
pub fn waiter() -> &'static PathBuf {
    static W: OnceLock<PathBuf> = OnceLock::new();
    W.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        PathBuf::from(cynode_testkit::setup_script(
            &root,
            &["deploy/worker/build-waiter.sh"],
        ))
    })
}

/// `engine`'s pool section: `size` per image, filled at start for the test image when
/// `prefill`. `runsc` is Podman's section with gVisor's runtime.
fn pool_config(engine: &str, size: usize, prefill: bool) -> String {
    let images = if prefill {
        format!("[\"{}\"]", env().image)
    } else {
        "[]".into()
    };
    let (section, runtime) = match engine {
        "runsc" => ("podman", "  runtime: runsc\n"),
        other => (other, ""),
    };
    format!(
        "{section}:\n{runtime}  pool_size: {size}\n  pool_images: {images}\n  pool_waiter: {}\n",
        waiter().display()
    )
}

/// The harness's config for `podman_warm` / `docker_warm` / `runsc_warm`: the engine
/// with a pool of 2 filled for the test image before the node listens.
pub fn backend_config(backend: &str, extra: &str) -> String {
    let (engine, section) = match backend {
        "docker_warm" => {
            crate::harness::docker_ready();
            ("docker", "docker")
        }
        "runsc_warm" => ("runsc", "podman"),
        _ => ("podman", "podman"),
    };
    assert!(
        !extra.lines().any(|l| l.starts_with(&format!("{section}:"))),
        "{backend} sets the {section} section itself"
    );
    format!("backend: {section}\n{}", pool_config(engine, 2, true))
}

/// A node on `engine` (podman, docker or runsc) with a pool of `size`.
fn warm_server(engine: &'static str, size: usize, prefill: bool) -> Server {
    if engine == "docker" {
        crate::harness::docker_ready();
    }
    Server::start(engine, &pool_config(engine, size, prefill))
}

/// The node's `cynode_worker_pool_<name>` value.
pub async fn pool_metric(sv: &Server, name: &str) -> u64 {
    let text = sv.get_raw("/metrics").await.text().await.unwrap();
    let prefix = format!("cynode_worker_pool_{name}{{");
    text.lines()
        .find(|l| l.starts_with(&prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {prefix} in /metrics:\n{text}"))
}

/// Waits (bounded) until `n` pooled containers are idle.
async fn wait_idle(sv: &Server, n: u64) {
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        if pool_metric(sv, "idle").await >= n {
            return;
        }
        assert!(Instant::now() < until, "the pool never had {n} idle");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// This node's pooled containers, by its label.
fn pool_containers(sv: &Server) -> Vec<String> {
    let cli = engine_cli(sv.backend).unwrap();
    let node = crate::harness::node_id(&sv.state_dir());
    engine_names(cli, &format!("label=io.cynode.node={node}"))
        .into_iter()
        .filter(|n| n.starts_with("cynode-pool-"))
        .collect()
}

/// A job in a warm container cannot find the control socket, cannot open the waiter's
/// descriptors, memory or executable through /proc, nor read its environment (gVisor lets
/// another uid read `/proc/1/environ`: the waiter zeroes it), cannot signal it (it
/// still reports the job's own exit code 7 afterwards), and runs with no capability, an
/// empty bounding set, no_new_privs and the seccomp filter, as its workspace's uid.
pub async fn a_job_cannot_reach_the_waiter_or_its_socket(engine: &'static str) {
    let sv = warm_server(engine, 1, true);
    wait_idle(&sv, 1).await;
    let probe = r#"
echo "ctl:$(ls -A /.cynode 2>/dev/null | wc -l)"
for s in $(find / -xdev -type s 2>/dev/null); do echo "sock:$s"; done
for f in fd mem exe cwd root; do
  if ls -L /proc/1/$f >/dev/null 2>&1 && cat /proc/1/$f >/dev/null 2>&1; then echo "$f:open"; else echo "$f:denied"; fi
done
if tr '\0' '\n' < /proc/1/environ 2>/dev/null | grep -q =; then echo environ:open; else echo environ:denied; fi
for sig in KILL TERM STOP INT; do kill -$sig 1 2>/dev/null && echo "$sig:sent" || echo "$sig:denied"; done
grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status | tr -d '\t'
setpriv --dump | grep -i '^no_new_privs' | tr -d ' '
unshare -U true 2>/dev/null; echo "unshare:$?"
echo "uid:$(id -u) gid:$(id -g) groups:$(id -G)"
grep '^Uid:' /proc/1/status | tr -d '\t'
exit 7
"#;
    let (_, v) = sv.run_job(&unique("j"), "t", &["sh", "-c", probe]).await;
    assert_eq!(v["exit_code"], 7, "{v}");
    let out = v["stdout"].as_str().unwrap();
    assert_eq!(
        pool_metric(&sv, "claims_total").await,
        1,
        "the job was not warm: {v}"
    );
    // A claim that failed ran the job cold.
    assert_eq!(pool_metric(&sv, "failures_total").await, 0, "{v}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines.contains(&"ctl:0"), "{out}");
    assert!(!out.contains("sock:"), "a socket is reachable: {out}");
    for f in ["fd", "environ", "mem", "exe", "cwd", "root"] {
        assert!(lines.contains(&format!("{f}:denied").as_str()), "{out}");
    }
    for s in ["KILL", "TERM", "STOP", "INT"] {
        assert!(lines.contains(&format!("{s}:denied").as_str()), "{out}");
    }
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        // gVisor's /proc/self/status has no CapAmb line (the waiter clears the ambient
        // set before the job's exec, and an empty permitted set leaves none anyway).
        if engine == "runsc" && cap == "CapAmb" && !out.contains("CapAmb:") {
            continue;
        }
        assert!(
            lines.contains(&format!("{cap}:0000000000000000").as_str()),
            "{cap}: {out}"
        );
    }
    // gVisor's status has no NoNewPrivs line; prctl answers on every engine.
    assert!(
        lines.contains(&"NoNewPrivs:1") || engine == "runsc",
        "{out}"
    );
    assert!(lines.contains(&"no_new_privs:1"), "{out}");
    assert!(lines.contains(&"Seccomp:2"), "{out}");
    // The node's filter, not only some filter: a user namespace is refused.
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("unshare:") && *l != "unshare:0"),
        "{out}"
    );
    let ids = lines.iter().find(|l| l.starts_with("uid:")).unwrap();
    let uid: u32 = ids[4..].split(' ').next().unwrap().parse().unwrap();
    assert!(uid >= 1000, "{out}");
    assert_eq!(*ids, format!("uid:{uid} gid:{uid} groups:{uid}"), "{out}");
    assert!(
        lines.iter().any(|l| l.starts_with("Uid:0")),
        "the waiter is root: {out}"
    );
}

/// The same probe sees the same sandbox cold and warm: uid, groups and their names (Podman adds a passwd/group entry for the uid; the claim adds the same), working directory,
/// environment (but the host name), capabilities, limits, the job's mounts' options, and
/// the mount options of /etc/passwd and /etc/group (not their filesystem's: Podman's come
/// from its storage, the claim's from a tmpfs of its own).
pub async fn warm_and_cold_jobs_see_the_same_sandbox(engine: &'static str) {
    let probe = r#"
id; pwd; env | grep -v '^HOSTNAME=' | sort
ulimit -n; ulimit -u
grep -E '^(Cap|NoNewPrivs|Seccomp)' /proc/self/status
grep -E ' /(job|workspace|tmp) ' /proc/self/mounts | cut -d' ' -f2,3,4 | sort
touch /x 2>&1 | sed 's/.*: //'; ls -ld /job /workspace | cut -c1-10
tail -n 2 /etc/passwd /etc/group; grep -E ' /etc/(passwd|group) ' /proc/self/mountinfo | cut -d' ' -f5,6 | sort
"#;
    let cold = Server::start(engine, "");
    let (_, c) = cold
        .run_job(&unique("j"), "same", &["sh", "-c", probe])
        .await;
    let warm = warm_server(engine, 1, true);
    wait_idle(&warm, 1).await;
    let (_, w) = warm
        .run_job(&unique("j"), "same", &["sh", "-c", probe])
        .await;
    assert_eq!(pool_metric(&warm, "claims_total").await, 1);
    assert_eq!(pool_metric(&warm, "failures_total").await, 0, "{w}");
    assert_eq!(c["status"], "completed", "{c}");
    let scrub = |v: &Value| {
        v["stdout"]
            .as_str()
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with("CYNODE_JOB_ID="))
            .map(|l| gvisor_options(engine, l))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(scrub(&w), scrub(&c), "warm:\n{w}\ncold:\n{c}");
    assert_eq!(
        (&w["status"], &w["exit_code"]),
        (&c["status"], &c["exit_code"])
    );
}

/// Under gVisor, a mount line without what a warm job cannot match: the gofer's
/// descriptor numbers, and the options of /etc/passwd and /etc/group, which Podman mounts
/// `ro,noexec` for a cold job and the waiter binds as they are (gVisor takes no remount):
/// root's files, 0644, which a job (another uid, no capability) cannot write either way.
fn gvisor_options(engine: &str, line: &str) -> String {
    if engine != "runsc" {
        return line.to_string();
    }
    if line.starts_with("/etc/passwd ") || line.starts_with("/etc/group ") {
        return line.split(' ').next().unwrap_or("").to_string();
    }
    line.split(',')
        .filter(|o| !o.starts_with("rfdno=") && !o.starts_with("wfdno="))
        .collect::<Vec<_>>()
        .join(",")
}

/// Two jobs never share a container: the second does not see what the first left in /tmp
/// or /dev/shm, has another host name, and the first's background process is gone once
/// it has answered.
pub async fn two_jobs_never_share_a_container(engine: &'static str) {
    let sv = warm_server(engine, 2, true);
    wait_idle(&sv, 2).await;
    let marker = crate::harness::marker();
    let first = format!(
        "echo one > /tmp/mark; echo one > /dev/shm/mark 2>/dev/null; (sleep {marker} &); hostname"
    );
    let (_, one) = sv.run_job(&unique("j"), "t", &["sh", "-c", &first]).await;
    assert_eq!(one["status"], "completed", "{one}");
    let (_, two) = sv
        .run_job(
            &unique("j"),
            "t",
            &[
                "sh",
                "-c",
                "cat /tmp/mark /dev/shm/mark 2>/dev/null; echo end; hostname",
            ],
        )
        .await;
    assert_eq!(pool_metric(&sv, "claims_total").await, 2, "{one} {two}");
    assert_eq!(pool_metric(&sv, "failures_total").await, 0, "{one} {two}");
    let (h1, h2) = (
        one["stdout"].as_str().unwrap().trim(),
        two["stdout"].as_str().unwrap().trim(),
    );
    assert!(
        h2.starts_with("end\n"),
        "the second job saw the first's files: {h2}"
    );
    assert_ne!(h1, h2.trim_start_matches("end\n"), "same host name");
    let until = Instant::now() + Duration::from_secs(20);
    while process_with_arg(&marker) {
        assert!(
            Instant::now() < until,
            "the first job's background process outlived it"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Pooled containers end with their node: SIGKILLed, its idle containers stop by
/// themselves (their waiter reads end of file); restarted on the same state, none of the
/// old ones is left and the pool is filled anew.
pub async fn a_killed_worker_leaves_no_pool_container(engine: &'static str) {
    let mut sv = warm_server(engine, 2, true);
    wait_idle(&sv, 2).await;
    let before = pool_containers(&sv);
    assert_eq!(before.len(), 2, "{before:?}");
    // SAFETY: kill(2) of the worker this test started.
    unsafe { libc::kill(sv.pid() as i32, libc::SIGKILL) };
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let left = pool_containers(&sv);
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < until,
            "pooled containers outlived their killed node: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    sv.kill9_and_restart();
    wait_idle(&sv, 2).await;
    let after = pool_containers(&sv);
    assert_eq!(after.len(), 2, "{after:?}");
    assert!(
        after.iter().all(|n| !before.contains(n)),
        "{before:?} {after:?}"
    );
    let slots: Vec<String> = std::fs::read_dir(sv.state_dir().join("pool"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "empty")
        .collect();
    let mut sorted = slots.clone();
    sorted.sort();
    let mut want = after.clone();
    want.sort();
    assert_eq!(sorted, want, "slot directories of the old run are left");
}

/// A miss runs cold and succeeds; the next job, once the pool has refilled, is warm;
/// `/metrics` counts both, and two jobs at once on a pool of one are one claim and one
/// miss.
pub async fn a_miss_runs_cold_and_metrics_count_it(engine: &'static str) {
    let sv = warm_server(engine, 1, false);
    assert_eq!(pool_metric(&sv, "size").await, 1);
    assert_eq!(pool_metric(&sv, "idle").await, 0);
    let (_, v) = sv.run_job(&unique("j"), "t", &["echo", "cold"]).await;
    assert_eq!(v["stdout"], "cold\n", "{v}");
    assert_eq!(
        (
            pool_metric(&sv, "misses_total").await,
            pool_metric(&sv, "claims_total").await
        ),
        (1, 0)
    );
    wait_idle(&sv, 1).await;
    let (_, v) = sv.run_job(&unique("j"), "t", &["echo", "warm"]).await;
    assert_eq!(v["stdout"], "warm\n", "{v}");
    assert_eq!(pool_metric(&sv, "claims_total").await, 1);
    wait_idle(&sv, 1).await;
    let a = command_job(&unique("j"), "t", &["sh", "-c", "sleep 1; echo a"]);
    let b = command_job(&unique("j"), "t2", &["sh", "-c", "sleep 1; echo b"]);
    let (ra, rb) = tokio::join!(
        sv.post("/v1/worker/jobs:run", &a),
        sv.post("/v1/worker/jobs:run", &b)
    );
    assert_eq!(
        (ra.1["stdout"].clone(), rb.1["stdout"].clone()),
        (json!("a\n"), json!("b\n"))
    );
    assert_eq!(
        (
            pool_metric(&sv, "misses_total").await,
            pool_metric(&sv, "claims_total").await
        ),
        (2, 2)
    );
    assert_eq!(pool_metric(&sv, "failures_total").await, 0);
}

/// A gVisor claim mounts the job's workspace on the host, under its slot's staging
/// directory. A node SIGKILLed in the middle of such a job leaves that mount behind; the
/// restarted node removes the old slot directories, and must unmount beneath them first:
/// removing through the mount would delete the workspace. The workspace keeps what the job
/// wrote, nothing stays mounted under the pool's directory, and its old slots are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gvisor_node_leaves_its_workspace_whole() {
    crate::cases::setup();
    let mut sv = warm_server("runsc", 1, true);
    wait_idle(&sv, 1).await;
    let task = unique("t");
    let job = command_job(
        &unique("j"),
        &task,
        &["sh", "-c", "echo kept > /workspace/keep; sleep 120"],
    );
    let (code, _) = sv.post("/v1/worker/jobs", &job).await;
    assert_eq!(code, 202);
    let kept = sv.state_dir().join("workspaces").join(&task).join("keep");
    let pool = std::fs::canonicalize(sv.state_dir().join("pool")).unwrap();
    // The mount points under the pool's directory.
    let staged = || -> Vec<String> {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
            .filter(|p| p.starts_with(&pool.display().to_string()))
            .collect()
    };
    let until = Instant::now() + Duration::from_secs(60);
    // The idle slot's staging directory, then the job's two directories on it.
    while !(kept.is_file() && staged().len() >= 3) {
        assert!(
            Instant::now() < until,
            "the warm job never wrote its workspace"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(pool_metric(&sv, "claims_total").await, 1);
    let before = staged();
    assert!(
        before.iter().any(|p| p.ends_with("/mnt/workspace")),
        "{before:?}"
    );
    sv.kill9_and_restart();
    wait_idle(&sv, 1).await;
    let after = staged();
    assert!(
        before.iter().all(|p| !after.contains(p)),
        "the old slot's mounts are left: {after:?}"
    );
    assert_eq!(std::fs::read_to_string(&kept).unwrap(), "kept\n");
    let (_, v) = sv
        .run_job(&unique("j"), &task, &["cat", "/workspace/keep"])
        .await;
    assert_eq!(v["stdout"], "kept\n", "{v}");
}

/// The worker config `text` as the node loads it.
pub fn load_config(
    text: &str,
) -> Result<cynode_worker::config::Config, cynode_worker::config::ConfigError> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w.yaml");
    std::fs::write(&p, text).unwrap();
    cynode_worker::config::Config::load(&p)
}

/// `pool_size` is bounded, and taken with gVisor.
#[test]
fn pool_size_is_validated() {
    let load = |text: &str| load_config(text).map(|c| c.podman.pool_size);
    assert_eq!(load("podman:\n  pool_size: 4\n").unwrap(), 4);
    assert_eq!(load("backend: podman\n").unwrap(), 0);
    let e = format!("{:?}", load("podman:\n  pool_size: 17\n").unwrap_err());
    assert!(e.contains("maximum"), "{e}");
    assert_eq!(
        load("podman:\n  pool_size: 2\n  runtime: runsc\n").unwrap(),
        2
    );
}

/// Each attack and node test on both engines.
macro_rules! on_warm_engines {
    ($($case:ident),* $(,)?) => {
        mod podman { $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                crate::cases::setup();
                super::$case("podman").await;
            }
        )* }
        mod docker { $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                crate::cases::setup();
                super::$case("docker").await;
            }
        )* }
        mod runsc { $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                crate::cases::setup();
                super::$case("runsc").await;
            }
        )* }
    };
}

on_warm_engines!(
    a_job_cannot_reach_the_waiter_or_its_socket,
    warm_and_cold_jobs_see_the_same_sandbox,
    two_jobs_never_share_a_container,
    a_killed_worker_leaves_no_pool_container,
    a_miss_runs_cold_and_metrics_count_it,
);

/// The contract suite with the pools on (and bwrap's warm sandboxes, `bwrap_warm.rs`).
macro_rules! contract_warm {
    ($($backend:ident),*) => { $(
        on_both_backends!(@one cases $backend [
            auth_is_required,
            readyz_names_the_backend,
            echo_hello,
            no_network_for_none_and_restricted,
            cynode_env_is_present_and_not_overridable,
            oversized_body_is_413,
            invalid_requests_name_the_field,
            sba_job_end_to_end_with_verified_artifacts,
            in_progress_is_reported_from_the_sandbox,
            missing_result_is_failed_never_success,
            timeout_removes_the_sandbox,
            sigterm_ignoring_job_ends_at_its_timeout,
            fork_bomb_is_contained,
            memory_hog_is_contained,
            resubmit_is_idempotent,
            workspace_persists_across_a_tasks_jobs,
            stop_cancels_and_removes,
            full_queue_answers_503,
            kill9_restart_keeps_results_and_fails_the_interrupted,
            graceful_shutdown_finishes_running_jobs
        ]);
    )* };
}
contract_warm!(podman_warm, docker_warm, runsc_warm, bwrap_warm);
