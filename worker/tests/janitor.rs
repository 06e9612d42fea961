//! The node's janitor (`worker/src/janitor.rs`): a node that is gone, killed or stopped,
//! leaves nothing running in its sandbox cgroups, even without a restart, and a node
//! restarted at once never has its own sandboxes swept by its predecessor's janitor.
//!
//! The orphan these tests plant stands for what bwrap leaves when its node is killed during
//! a sandbox's setup (bwrap's PID 1 arms its parent-death signal only after its setup): a
//! process in one of the node's sandbox cgroups that nothing ties to the node. It forks as
//! it runs, as a hostile job would to outrun a kill.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

use crate::bwrap_starters::{node_cgroups, runs};
use crate::harness::{cgroup_pids, eventually, node_cgroup_dirs, unique, Server};

const SWEPT: &str = "the node is gone; its janitor removed its sandboxes";

/// A process tree planted in a cgroup `orphan-<n>` of the node's (each hierarchy where
/// the node has one), not tied to the test or the node; killed and removed when dropped,
/// whatever the test did.
struct Orphan {
    dirs: Vec<PathBuf>,
    child: std::process::Child,
}

impl Orphan {
    fn plant(node_dirs: &[PathBuf]) -> Orphan {
        assert!(!node_dirs.is_empty(), "the node has no cgroup");
        let name = unique("orphan");
        let dirs: Vec<PathBuf> = node_dirs.iter().map(|d| d.join(&name)).collect();
        for d in &dirs {
            std::fs::create_dir(d).unwrap_or_else(|e| panic!("mkdir {}: {e}", d.display()));
            // Bounded, as the node's own sandboxes are: the tree forks until it hits this.
            std::fs::write(d.join("pids.max"), "32").expect("pids.max");
        }
        let procs: Vec<PathBuf> = dirs.iter().map(|d| d.join("cgroup.procs")).collect();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "while :; do sleep 300 & sleep 0.02; done"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: between fork and exec: setsid and writes of this pid to cgroup files
        // (std::fs allocates, acceptable in a test's single-purpose child).
        unsafe {
            cmd.pre_exec(move || {
                libc::setsid();
                for p in &procs {
                    std::fs::write(p, std::process::id().to_string())?;
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("spawn the orphan");
        Orphan { dirs, child }
    }

    /// The processes in the orphan's cgroup (none once it is gone).
    fn pids(&self) -> Vec<i32> {
        self.dirs
            .iter()
            .flat_map(|d| cgroup_pids(d))
            .filter(|p| runs(*p))
            .collect()
    }
}

/// A bwrap node that ran one job (so its cgroups exist), its cgroup directories, and an
/// orphan planted in them.
async fn bwrap_node_with_an_orphan() -> (Server, Vec<PathBuf>, Orphan) {
    let sv = Server::start("bwrap", "");
    let (_, first) = sv.run_job(&unique("j"), "k", &["true"]).await;
    assert_eq!(first["status"], "completed", "{first}");
    let node = node_cgroups(&sv);
    let orphan = Orphan::plant(&node);
    (sv, node, orphan)
}

impl Drop for Orphan {
    fn drop(&mut self) {
        for _ in 0..50 {
            let pids = self.pids();
            if pids.is_empty() {
                break;
            }
            for p in pids {
                // SAFETY: kill(2) of a process this test planted.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        for d in &self.dirs {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// The janitor's log line in `log` (its sweep report), waited for (bounded).
async fn sweep_line(log: &Arc<Mutex<Vec<String>>>) -> Value {
    let find = || {
        log.lock()
            .ok()?
            .iter()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["fields"]["message"] == SWEPT)
    };
    let mut line = None;
    eventually(
        "the janitor reports its sweep",
        Duration::from_secs(15),
        || {
            line = find();
            line.is_some()
        },
    )
    .await;
    line.unwrap()
}

/// A node killed with SIGKILL and not restarted: its janitor kills the orphan (forks
/// included) and removes every cgroup of the node, and says so.
pub async fn a_killed_nodes_janitor_kills_what_its_cgroups_hold() {
    let (mut sv, node, orphan) = bwrap_node_with_an_orphan().await;
    eventually("the orphan forks", Duration::from_secs(10), || {
        orphan.pids().len() >= 3
    })
    .await;
    let log = Arc::clone(&sv.log);
    sv.kill9();
    eventually(
        "the orphan's processes are killed",
        Duration::from_secs(10),
        || orphan.pids().is_empty(),
    )
    .await;
    eventually(
        "the node's cgroups are removed",
        Duration::from_secs(10),
        || node.iter().all(|d| !d.exists()),
    )
    .await;
    let line = sweep_line(&log).await;
    assert!(line["fields"]["removed"].as_u64() >= Some(1), "{line}");
    drop(orphan);
    sv.restart();
}

/// A node that stops on SIGTERM has its sandboxes swept before it exits: nothing is left
/// to wait for once the process is gone.
pub async fn a_stopped_node_exits_with_its_cgroups_removed() {
    let (mut sv, node, orphan) = bwrap_node_with_an_orphan().await;
    eventually("the orphan runs", Duration::from_secs(10), || {
        !orphan.pids().is_empty()
    })
    .await;
    sv.terminate();
    assert!(
        orphan.pids().is_empty(),
        "the orphan outlived its stopped node"
    );
    assert!(
        node.iter().all(|d| !d.exists()),
        "the stopped node left its cgroups: {node:?}"
    );
    drop(orphan);
    sv.restart();
}

/// A node restarted at once waits for its predecessor's janitor (they share the state
/// directory's lock), so the sweep is over before the new node makes any sandbox. The old
/// janitor is held stopped for 2 s after its node's death: the new node waits for the
/// lock (saying so) until the janitor has swept, then serves.
pub async fn a_restarted_node_waits_for_its_predecessors_janitor() {
    let (mut sv, _, orphan) = bwrap_node_with_an_orphan().await;
    let message = |log: &Arc<Mutex<Vec<String>>>, text: &str| -> Option<Value> {
        log.lock()
            .unwrap()
            .iter()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["fields"]["message"] == text)
    };
    let janitor = message(&sv.log, "janitor started").expect("the janitor's start")["fields"]
        ["janitor_pid"]
        .as_i64()
        .expect("its pid") as i32;
    // SAFETY: stopping and resuming the janitor this test's node started.
    unsafe { libc::kill(janitor, libc::SIGSTOP) };
    let resume = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        // SAFETY: as above.
        unsafe { libc::kill(janitor, libc::SIGCONT) };
    });
    let old_log = Arc::clone(&sv.log);
    sv.kill9();
    sv.restart();
    resume.join().unwrap();
    let swept = sweep_line(&old_log).await;
    assert!(
        message(&sv.log, "waiting for the state directory lock").is_some(),
        "the new node did not wait for the old janitor's lock: {:?}",
        sv.log.lock().unwrap()
    );
    let locked = message(&sv.log, "holding the state directory lock").expect("the lock");
    let (swept_at, locked_at) = (
        swept["timestamp"].as_str().unwrap(),
        locked["timestamp"].as_str().unwrap(),
    );
    assert!(
        swept_at <= locked_at,
        "the new node took the lock at {locked_at}, before the old janitor's sweep at {swept_at}"
    );
    assert!(orphan.pids().is_empty());
    let (_, again) = sv
        .run_job(&unique("j"), "k", &["sh", "-c", "sleep 0.2; echo ok"])
        .await;
    assert_eq!(again["status"], "completed", "{again}");
}

/// The race the janitor exists for: a node killed while warm sandboxes are being set up
/// after each job (bwrap_warm makes two or three after every job). Killed at once after a
/// job, five times, the node leaves no process and no cgroup behind, with no restart in
/// between to clean up.
pub async fn a_node_killed_during_sandbox_setups_leaves_nothing() {
    crate::cases::setup_for("bwrap_warm");
    let mut sv = Server::start("bwrap_warm", "");
    for round in 0..5 {
        let (_, done) = sv.run_job(&unique("j"), "k", &["true"]).await;
        assert_eq!(done["status"], "completed", "round {round}: {done}");
        let node = node_cgroups(&sv);
        let procs_in = |dirs: &[PathBuf]| -> Vec<i32> {
            dirs.iter()
                .filter_map(|d| std::fs::read_dir(d).ok())
                .flat_map(|d| d.flatten())
                .flat_map(|e| cgroup_pids(&e.path()))
                .collect()
        };
        sv.kill9();
        eventually(
            &format!("round {round}: the killed node's cgroups are emptied and removed"),
            Duration::from_secs(10),
            || procs_in(&node).is_empty() && node.iter().all(|d| !Path::new(d).exists()),
        )
        .await;
        sv.restart();
        crate::bwrap_warm::wait_first_slot(&sv.addr);
    }
}

/// The janitor started by hand (stdin a terminal or a file, not the node's pipe) sweeps
/// nothing: it refuses with its reason, and a cgroup of its node keeps its process.
#[test]
fn the_janitor_refuses_what_is_not_its_node() {
    crate::cases::setup();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    // The node's directory in the hierarchy this host has (its root lists cgroup.procs).
    let node_dir = node_cgroup_dirs(&state)
        .into_iter()
        .find(|d| {
            d.parent()
                .and_then(Path::parent)
                .is_some_and(|h| h.join("cgroup.procs").exists())
        })
        .expect("a pids or v2 cgroup hierarchy");
    std::fs::create_dir_all(&node_dir).unwrap();
    let orphan = Orphan::plant(std::slice::from_ref(&node_dir));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cynode-worker"));
    cmd.args(["janitor", "--backend", "bwrap", "--state-dir"])
        .arg(&state)
        .env_clear();
    // stdin: /dev/null, as a hand-started janitor's terminal is: not a pipe.
    let out = cynode_testkit::output_within(cmd, Duration::from_secs(30)).unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{out:?}");
    assert!(e.contains("stdin is not a pipe"), "{e}");
    assert!(!orphan.pids().is_empty(), "the refused janitor swept");
    drop(orphan);
    let _ = std::fs::remove_dir(&node_dir);
}

/// An engine keeps a killed node's containers running (conmon or the daemon holds them):
/// a job's until its command ends, a gVisor session's keep-alive until the session's max
/// lifetime. The node's janitor removes them, without a restart; a session's container
/// whose PID 1 is the pool waiter ends by itself (its waiter reads end of file), or is
/// among the janitor's orphans when the sweep comes first.
pub async fn a_killed_nodes_janitor_removes_its_containers(backend: &'static str) {
    let cli = crate::harness::engine_cli(backend).expect("an engine backend");
    let mut sv = Server::start(backend, "");
    let session = unique("s");
    let _cleanup = crate::harness::session_guard(backend, &session);
    let body = serde_json::json!({
        "version": 1, "session_id": session, "task_id": unique("t"),
        "image": crate::harness::env().image,
    });
    let (code, v) = sv.post("/v1/worker/sessions", &body).await;
    assert_eq!(code, 201, "{v}");
    let job = unique("j");
    let (code, v) = sv
        .post(
            "/v1/worker/jobs",
            &crate::harness::command_job(&job, "k", &["sleep", "300"]),
        )
        .await;
    assert_eq!(code, 202, "{v}");
    let containers = || {
        let mut names =
            crate::harness::engine_names(cli, &format!("name=^cynode-session-{session}$"));
        names.extend(crate::harness::job_containers(backend, &job));
        names
    };
    eventually(
        "the session's and the job's containers run",
        Duration::from_secs(60),
        || containers().len() == 2,
    )
    .await;
    let log = Arc::clone(&sv.log);
    sv.kill9();
    eventually(
        "the killed node's containers are removed",
        Duration::from_secs(60),
        || containers().is_empty(),
    )
    .await;
    let line = sweep_line(&log).await;
    assert!(
        line["fields"]["orphans"].as_u64() >= Some(1),
        "{cli}: {line}"
    );
    sv.restart();
}

macro_rules! janitor_tests {
    ($($case:ident),* $(,)?) => { $(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $case() {
            crate::cases::setup_for("bwrap");
            super::$case().await;
        }
    )* };
}

mod on_podman {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_killed_nodes_janitor_removes_its_containers() {
        crate::cases::setup_for("podman");
        super::a_killed_nodes_janitor_removes_its_containers("podman").await;
    }
}

mod on_docker {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_killed_nodes_janitor_removes_its_containers() {
        crate::cases::setup_for("docker");
        super::a_killed_nodes_janitor_removes_its_containers("docker").await;
    }
}

mod on_bwrap {
    janitor_tests!(
        a_killed_nodes_janitor_kills_what_its_cgroups_hold,
        a_stopped_node_exits_with_its_cgroups_removed,
        a_restarted_node_waits_for_its_predecessors_janitor,
        a_node_killed_during_sandbox_setups_leaves_nothing,
    );
}
