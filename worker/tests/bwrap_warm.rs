//! Warm bwrap sandboxes (`bwrap.warm_slots`; `backend/bwrap/warm.rs`), on real bwrap: the
//! attack tests first (a warm job sees exactly a cold job's sandbox, reaches nothing of
//! the waiter, and never shares a sandbox with another job), then the node's side (the
//! limits hold, a new workspace's first job is warm, a killed node leaves no slot behind,
//! `/metrics` counts claims), and the sandbox-escape and hardening attacks once more with
//! them on; `warm_pool.rs` runs the contract suite on `bwrap_warm` too. A `bwrap_warm`
//! node is ready for its first job when the harness returns it ([`wait_first_slot`]).

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::harness::{process_with_arg, unique, Server};

/// The bwrap section's lines for a test backend name: warm sandboxes for `bwrap_warm`.
pub fn bwrap_lines(backend: &str) -> String {
    if backend == "bwrap_warm" {
        format!(
            "  warm_slots: 4\n  pool_waiter: {}\n",
            crate::warm_pool::waiter().display()
        )
    } else {
        String::new()
    }
}

/// For a `bwrap_warm` node just started: waits (bounded, blocking) until the warm sandbox
/// it makes for its first new workspace is idle, so that the first job of a test finds it
/// (the contract and attack suites run warm from their first job). Gives up quietly when
/// `/metrics` does not answer 200 (a test with a token of its own).
pub fn wait_first_slot(addr: &str) {
    use std::io::{Read, Write};
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until {
        let Ok(mut c) = std::net::TcpStream::connect(addr) else {
            return;
        };
        let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
        let req = format!(
            "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
            crate::harness::TOKEN
        );
        let mut text = String::new();
        if c.write_all(req.as_bytes()).is_err() || c.read_to_string(&mut text).is_err() {
            return;
        }
        let (code, body) = crate::harness::status_and_body(&text);
        if code != 200 {
            return;
        }
        let idle = body
            .lines()
            .find_map(|l| l.strip_prefix("cynode_worker_bwrap_warm_idle "))
            .and_then(|v| v.trim().parse::<u64>().ok());
        if idle.is_some_and(|n| n >= 1) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the warm sandbox for the first workspace was not made within 30 s");
}

/// `cynode_worker_bwrap_warm_<name>` from `/metrics`.
async fn warm_metric(sv: &Server, name: &str) -> u64 {
    let text = sv.get_raw("/metrics").await.text().await.unwrap();
    let key = format!("cynode_worker_bwrap_warm_{name} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {key}in:\n{text}"))
}

/// Waits (bounded) until every warm sandbox wanted is made (then the last job's
/// workspace has one idle), and at least `n` are idle.
async fn wait_idle(sv: &Server, n: u64) {
    let until = Instant::now() + Duration::from_secs(30);
    while warm_metric(sv, "pending").await > 0 || warm_metric(sv, "idle").await < n {
        assert!(
            Instant::now() < until,
            "warm sandboxes not made within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs `script` as job `task`'s next job after a first one has warmed its uid, and
/// checks that it was warm (claimed, no failed claim).
async fn warm_job(sv: &Server, task: &str, script: &str) -> Value {
    warm_run(sv, task, &["sh", "-c", script]).await
}

/// [`warm_job`] with `argv` as it is.
async fn warm_run(sv: &Server, task: &str, argv: &[&str]) -> Value {
    let (_, first) = sv.run_job(&unique("w"), task, &["true"]).await;
    assert_eq!(first["status"], "completed", "{first}");
    wait_idle(sv, 1).await;
    let claims = warm_metric(sv, "claims_total").await;
    let (_, v) = sv.run_job(&unique("j"), task, argv).await;
    assert!(
        warm_metric(sv, "claims_total").await > claims,
        "the job was not warm: {v}"
    );
    assert_eq!(warm_metric(sv, "failures_total").await, 0, "{v}");
    v
}

/// A mountinfo line without what differs between any two sandboxes (mount ids) and what a
/// claim's moved mounts cannot share with bwrap's binds (their propagation: a cold job's
/// binds are slaves of the host's mounts, a warm job's receive nothing from the host).
fn mount_line(l: &str) -> String {
    let f: Vec<&str> = l.split(' ').collect();
    let sep = f.iter().position(|x| *x == "-").unwrap_or(f.len());
    let mut out = f[3..6].to_vec();
    out.extend(&f[sep..]);
    // Each job has disk volumes of its own.
    let out = out.join(" ");
    match out.find("/dev/loop") {
        Some(i) => {
            let end = out[i + 9..]
                .find(|c: char| !c.is_ascii_digit())
                .map_or(out.len(), |e| i + 9 + e);
            format!("{}/dev/loopN{}", &out[..i], &out[end..])
        }
        None => out,
    }
}

const PROBE: &str = r#"
id; pwd; env | sort; hostname
ulimit -n; ulimit -u; ulimit -s
grep -E '^(Cap|NoNewPrivs|Seccomp)' /proc/self/status
ls /proc/self/fd | sort | tr '\n' ' '; echo
tr '\0' '\n' < /proc/1/cmdline | head -n 1
cat /proc/self/mountinfo
touch /x 2>&1 | sed 's/.*: //'; ls -ld /job /workspace /tmp | cut -c1-10
cat /proc/self/cgroup | sed 's/cynode-[^/]*$/JOB/'
"#;

/// The same probe sees the same sandbox cold and warm: identity, working directory,
/// environment, host name, limits, capabilities and filters, open descriptors, the
/// processes of its pid namespace, PID 1, its mounts and their options, its cgroup.
pub async fn warm_and_cold_jobs_see_the_same_sandbox() {
    let cold = Server::start("bwrap", "");
    let (_, c) = cold
        .run_job(&unique("j"), "same", &["sh", "-c", PROBE])
        .await;
    let sv = Server::start("bwrap_warm", "");
    let w = warm_job(&sv, "same", PROBE).await;
    assert_eq!(c["status"], "completed", "{c}");
    let scrub = |v: &Value| {
        v["stdout"]
            .as_str()
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with("CYNODE_JOB_ID="))
            .map(|l| {
                if l.split(' ').nth(4).is_some_and(|p| p.starts_with('/')) && l.contains(" - ") {
                    mount_line(l)
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(scrub(&w), scrub(&c), "warm:\n{w}\ncold:\n{c}");
    assert_eq!(
        (&w["status"], &w["exit_code"], &w["stderr"]),
        (&c["status"], &c["exit_code"], &c["stderr"])
    );
}

/// What bwrap itself reports fails the same way warm: a missing command, a missing
/// working directory's command, a command that is not executable; exit codes pass through.
pub async fn warm_failures_are_bwraps_own() {
    let cold = Server::start("bwrap", "");
    let sv = Server::start("bwrap_warm", "");
    for argv in [
        vec!["no-such-command"],
        vec!["/etc/passwd"],
        vec!["sh", "-c", "echo out; echo err >&2; exit 7"],
        vec!["sh", "-c", "kill -9 $$"],
    ] {
        let (_, c) = cold.run_job(&unique("j"), "t", &argv).await;
        let w = warm_run(&sv, "t", &argv).await;
        assert_eq!(
            (&w["status"], &w["exit_code"], &w["stderr"], &w["stdout"]),
            (&c["status"], &c["exit_code"], &c["stderr"], &c["stdout"]),
            "{argv:?}: warm {w} cold {c}"
        );
    }
}

/// A warm job holds no descriptor of the waiter or the node, sees no other process than
/// its own (not the next slot made for its uid while it runs), and nothing of the waiter
/// is left in its process: its command line, environment and executable are the job's.
pub async fn a_warm_job_reaches_nothing_of_the_waiter() {
    let sv = Server::start("bwrap_warm", "");
    let probe = r#"
sleep 1
echo "fds:$(ls /proc/self/fd | sort | tr '\n' ' ')"
# Counted without a pipeline (whether a pipe's reader has started yet is a race): PID 1,
# this shell and the one `ls`.
set -- $(ls /proc); n=0; for p; do case $p in *[!0-9]*) ;; *) n=$((n+1));; esac; done
echo "procs:$n"
w=pool; for f in /proc/[0-9]*/cmdline /proc/[0-9]*/environ; do
  case $f in /proc/1/*|/proc/$$/*) continue;; esac
  grep -q -e "$w-waiter" -e "--bwrap" "$f" 2>/dev/null && echo "seen:$f"
done
tr '\0' '\n' < /proc/1/cmdline | grep -c "$w-waiter" | sed 's/^/path:/'
echo "exe:$(readlink /proc/$$/exe)"
tr '\0' '\n' < /proc/$$/environ | grep -c . | sed 's/^/envc:/'
echo "ppid:$PPID"
"#;
    let (_, cold) = Server::start("bwrap", "")
        .run_job(&unique("j"), "t", &["sh", "-c", probe])
        .await;
    let v = warm_job(&sv, "t", probe).await;
    let out = v["stdout"].as_str().unwrap();
    let lines: Vec<&str> = out.lines().collect();
    let cold_out = cold["stdout"].as_str().unwrap();
    // The same descriptors (0-2, and the one `ls` reads /proc/self/fd through) and the
    // same processes as a cold job: nothing of the waiter, nor the slot made next.
    for what in ["fds:", "procs:"] {
        let of = |o: &str| o.lines().find(|l| l.starts_with(what)).map(str::to_string);
        assert_eq!(of(out), of(cold_out), "warm {out} cold {cold_out}");
    }
    assert!(lines.contains(&"fds:0 1 2 3 "), "{out}");
    assert!(!out.contains("seen:"), "the waiter is visible: {out}");
    // PID 1 is bwrap's, whose arguments name the waiter's descriptor, never its path.
    assert!(lines.contains(&"path:0"), "{out}");
    assert!(
        lines.contains(&"exe:/bin/busybox")
            || lines.contains(&"exe:/bin/sh")
            || lines.iter().any(|l| l.starts_with("exe:/usr/bin/")),
        "{out}"
    );
    assert!(lines.contains(&"ppid:1"), "{out}");
    let envc: usize = lines
        .iter()
        .find_map(|l| l.strip_prefix("envc:"))
        .unwrap()
        .parse()
        .unwrap();
    assert!(envc > 0 && envc < 20, "{out}");
}

/// Two jobs of one workspace never share a sandbox: the second does not see what the
/// first left in /tmp, and the first's background process is gone once it has answered.
pub async fn two_jobs_never_share_a_warm_sandbox() {
    let sv = Server::start("bwrap_warm", "");
    let marker = crate::harness::marker();
    let first = format!("echo one > /tmp/mark; (sleep {marker} &); echo started");
    let one = warm_job(&sv, "t", &first).await;
    assert_eq!(one["status"], "completed", "{one}");
    wait_idle(&sv, 1).await;
    let claims = warm_metric(&sv, "claims_total").await;
    let (_, two) = sv
        .run_job(
            &unique("j"),
            "t",
            &["sh", "-c", "cat /tmp/mark 2>/dev/null; echo end"],
        )
        .await;
    assert_eq!(warm_metric(&sv, "claims_total").await, claims + 1, "{two}");
    assert_eq!(
        two["stdout"].as_str().unwrap(),
        "end\n",
        "the second job saw the first's files: {two}"
    );
    let until = Instant::now() + Duration::from_secs(20);
    while process_with_arg(&marker) {
        assert!(
            Instant::now() < until,
            "the first job's background process outlived it"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A warm job keeps a cold job's limits: its timeout, its kernel-enforced disk limit (the
/// job directory's volume came with the claim's clone), its output cap.
pub async fn a_warm_job_keeps_its_limits() {
    let sv = Server::start("bwrap_warm", "limits:\n  disk_mb: 64\n");
    let (_, first) = sv.run_job(&unique("w"), "lim", &["true"]).await;
    assert_eq!(first["status"], "completed", "{first}");
    wait_idle(&sv, 1).await;
    let claims = warm_metric(&sv, "claims_total").await;
    let started = Instant::now();
    let mut body = crate::harness::command_job(&unique("j"), "lim", &["sleep", "30"]);
    body["sandbox"]["timeout_seconds"] = 2.into();
    let (_, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(v["status"], "timeout", "{v}");
    assert!(started.elapsed() < Duration::from_secs(20), "{v}");
    wait_idle(&sv, 1).await;
    let id = unique("j");
    let (_, d) = sv
        .run_job(
            &id,
            "lim",
            &["dd", "if=/dev/zero", "of=/job/fill", "bs=1M", "count=256"],
        )
        .await;
    assert_eq!(
        warm_metric(&sv, "claims_total").await,
        claims + 2,
        "not warm: {v} {d}"
    );
    // What dd wrote (1 MiB records), by its own count; it was stopped by the volume
    // (ENOSPC) or by the guard.
    let err = d["stderr"].as_str().unwrap_or_default();
    let written: u64 = err
        .lines()
        .find_map(|l| l.strip_suffix(" records out"))
        .and_then(|n| n.split('+').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    // dd killed by the guard before it reports writes nothing here; the reason says it.
    assert!(
        written <= 68,
        "{written} MiB: the disk limit did not hold warm: {d}"
    );
    assert!(
        d["failure_reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("resource_limit_exceeded")),
        "{d}"
    );
}

/// A node makes a warm sandbox for the uid its next new workspace gets before any job
/// (`expect_uid` after its start), so even its first job is warm; a restarted node makes
/// one for the next free uid, not for one a workspace holds.
pub async fn a_new_workspaces_first_job_is_warm() {
    let mut sv = Server::start("bwrap_warm", "");
    wait_idle(&sv, 1).await;
    let (_, v) = sv.run_job(&unique("j"), "first", &["true"]).await;
    assert_eq!(v["status"], "completed", "{v}");
    assert_eq!(warm_metric(&sv, "claims_total").await, 1, "not warm: {v}");
    sv.terminate_and_restart();
    wait_idle(&sv, 1).await;
    let (_, v) = sv.run_job(&unique("j"), "second", &["true"]).await;
    assert_eq!(v["status"], "completed", "{v}");
    assert_eq!(warm_metric(&sv, "claims_total").await, 1, "not warm: {v}");
    assert_eq!(warm_metric(&sv, "failures_total").await, 0, "{v}");
}

/// A node killed with warm sandboxes idle leaves none of them running, and after its
/// restart none of their cgroups.
pub async fn a_killed_node_leaves_no_warm_sandbox() {
    let mut sv = Server::start("bwrap_warm", "");
    let (_, first) = sv.run_job(&unique("w"), "k", &["true"]).await;
    assert_eq!(first["status"], "completed", "{first}");
    wait_idle(&sv, 2).await;
    let old_pid = sv.pid();
    let prefix = format!("warm-{old_pid}-");
    // This node's slots: the processes in its warm cgroups.
    let slots: Vec<i32> = crate::harness::processes()
        .into_iter()
        .map(|(pid, _, _)| pid)
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
                .is_ok_and(|c| c.contains(&prefix))
        })
        .collect();
    assert!(
        slots.len() >= 4,
        "two slots, each bwrap and its sandbox: {slots:?}"
    );
    let node = crate::bwrap_starters::node_cgroups(&sv);
    sv.kill9_and_restart();
    let until = Instant::now() + Duration::from_secs(20);
    while slots.iter().any(|p| crate::bwrap_starters::runs(*p)) {
        assert!(
            Instant::now() < until,
            "warm sandboxes outlived their killed node"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, again) = sv.run_job(&unique("j"), "k", &["true"]).await;
    assert_eq!(again["status"], "completed", "{again}");
    let old: Vec<_> = node
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flat_map(|d| d.flatten())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert!(old.is_empty(), "{old:?}");
}

/// `check` says whether the warm sandboxes can be used: how many, or that the waiter is
/// missing (named with the script that builds it).
#[test]
fn check_names_the_warm_sandboxes_and_a_missing_waiter() {
    crate::cases::setup();
    let dir = tempfile::tempdir().unwrap();
    let e = crate::harness::env();
    let lines = |waiter: &str| {
        format!(
            "backend: bwrap\nbwrap:\n  warm_slots: 3\n  pool_waiter: {waiter}\n  rootfs:\n    \"{}\": {}\n",
            e.image,
            e.rootfs.display()
        )
    };
    let out = crate::engine_check::check(
        dir.path(),
        &lines(&crate::warm_pool::waiter().display().to_string()),
    );
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("3 warm sandboxes"), "{text}");
    let out = crate::engine_check::check(dir.path(), &lines("/nonexistent/waiter"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("warm_slots 3 unused (no pool waiter at /nonexistent/waiter"),
        "{text}"
    );
}

#[test]
fn warm_slots_is_validated() {
    let load = |text: &str| crate::warm_pool::load_config(text).map(|c| c.bwrap.warm_slots);
    assert_eq!(load("backend: bwrap\n").unwrap(), 0);
    assert_eq!(load("bwrap:\n  warm_slots: 4\n").unwrap(), 4);
    let e = format!("{:?}", load("bwrap:\n  warm_slots: 17\n").unwrap_err());
    assert!(e.contains("maximum"), "{e}");
}

macro_rules! bwrap_warm_tests {
    ($($case:ident),* $(,)?) => { $(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $case() {
            crate::cases::setup_for("bwrap_warm");
            super::$case().await;
        }
    )* };
}

mod on_bwrap {
    bwrap_warm_tests!(
        warm_and_cold_jobs_see_the_same_sandbox,
        warm_failures_are_bwraps_own,
        a_warm_job_reaches_nothing_of_the_waiter,
        two_jobs_never_share_a_warm_sandbox,
        a_warm_job_keeps_its_limits,
        a_new_workspaces_first_job_is_warm,
        a_killed_node_leaves_no_warm_sandbox,
    );
}

/// The sandbox-escape and hardening attacks once more in warm sandboxes (a `bwrap_warm`
/// node's first job is warm: [`wait_first_slot`]).
mod attacks {
    on_both_backends!(@one sandbox_escapes bwrap_warm [
        escape_image_flags_are_refused,
        escape_no_node_secret_in_any_environ,
        escape_cpu_limit_holds,
        escape_nested_namespaces_and_mounts_are_denied,
        escape_runner_cannot_be_traced
    ]);
}
mod hardening {
    on_both_backends!(@one hardening bwrap_warm [hardening_vsock_and_x32_are_denied]);
}
