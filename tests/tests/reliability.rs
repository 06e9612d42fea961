//! `cynode-pm run` keeps its promises when killed, run twice, or handed odd names
//! (real `cynode-pm` processes, real local
//! bwrap workers, a scripted model). Every wait is bounded here, with its own message.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::Router;
use serde_json::{json, Value};

use cynode_tests::{
    model_server, rootfs, serve_in_background, start_worker, workspace_file, workspace_root,
};

/// One `cynode-pm` process; killed (SIGKILL) and reaped on drop.
pub(crate) struct Pm {
    pub(crate) child: Child,
    out: PathBuf,
    err: PathBuf,
}

impl Drop for Pm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Pm {
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// Waits (at most `within`) for the exit; returns the code and the JSON on stdout.
    pub(crate) fn finish(&mut self, within: Duration) -> (Option<i32>, Value) {
        let t = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(
                t.elapsed() < within,
                "cynode-pm {} still running after {within:?}: {}",
                self.pid(),
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut text = String::new();
        std::fs::File::open(&self.out)
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        let v = serde_json::from_str(&text).unwrap_or(Value::Null);
        (status.code(), v)
    }

    /// The session id the PM printed.
    pub(crate) fn session_id(&self, within: Duration) -> String {
        let mut found = None;
        wait_for(within, "the session id on stderr", || {
            found = self.stderr().lines().find_map(|l| {
                l.strip_prefix("session s-")
                    .map(|r| format!("s-{}", r.split_whitespace().next().unwrap_or("")))
            });
            found.is_some()
        });
        found.unwrap()
    }
}

/// Starts `cynode-pm --output json ARGS --state-dir STATE` with a local bwrap worker and
/// the model at `model`; its output goes to files under `logs`.
pub(crate) fn spawn_pm(
    logs: &Path,
    name: &str,
    state: &Path,
    model: &str,
    args: &[&str],
    envs: &[(&str, &str)],
) -> Pm {
    let out = logs.join(format!("{name}.out"));
    let err = logs.join(format!("{name}.err"));
    let child = Command::new(cynode_tests::bin("cynode-pm"))
        .args(["--output", "json"])
        .args(args)
        // The scripted sessions ask and finish freely, as with a person at the terminal.
        .args(args.contains(&"run").then_some("--interactive"))
        .arg("--state-dir")
        .arg(state)
        .args(["--local-backend", "bwrap", "--local-bwrap-rootfs"])
        .arg(rootfs())
        .args(["--model-base-url", model])
        // A failed test leaves no local worker running for long (see Keeper).
        .env("CYNODE_LOCAL_WORKER_GRACE_SECONDS", "30")
        .envs(envs.iter().copied())
        .env_remove("CYNODE_PM_FAILPOINT")
        .current_dir(workspace_root())
        // A group of its own, as a shell gives a job: Ctrl-C is SIGINT to the group.
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    Pm { child, out, err }
}

/// Polls `ok` every 50 ms until it holds; fails naming `what` after `within`.
pub(crate) fn wait_for(within: Duration, what: &str, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether `pid` is a live (not zombie) process.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// The direct children of `pid`.
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(text) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(
                    text.split_whitespace()
                        .filter_map(|p| p.parse::<u32>().ok()),
                );
            }
        }
    }
    out
}

/// A test-only skill `slow-mark`: appends a line to `runs.txt` in the workspace (one per
/// run of the job), sleeps `seconds`, then writes `done.txt`.
pub(crate) fn slow_skill(dir: &Path) {
    cynode_tests::write_skill(
        &dir.join("slow-mark"),
        "skill_id: slow-mark\nversion: 1.0.0\ndescription: mark a run, wait, mark done\npurpose: base-tools\nallowed_commands: [sh]\nlimits:\n  max_runtime_seconds: 120\n  max_output_bytes: 65536\ninputs_schema:\n  type: object\n  additionalProperties: false\n  required: [seconds]\n  properties:\n    seconds: { type: integer, minimum: 0, maximum: 60 }\n",
        r#"{ "constraints": { "max_runtime_seconds": 120, "max_output_bytes": 65536, "allowed_commands": ["sh"], "allowed_paths": ["/workspace"] },
  "steps": [ { "id": "mark", "type": "run_command", "arguments": { "command": "sh",
    "args": ["-c", "echo run >> runs.txt; sleep {{ inputs.seconds }}; echo done > done.txt"], "timeout_seconds": 110 } } ] }"#,
        r#"{ "seconds": 1 }"#,
    );
}

/// A test-only skill `odd-names`: writes each of `names` under `out/` and collects them.
fn odd_names_skill(dir: &Path) {
    cynode_tests::write_skill(
        &dir.join("odd-names"),
        "skill_id: odd-names\nversion: 1.0.0\ndescription: write files with odd names\npurpose: base-tools\nallowed_commands: []\nlimits:\n  max_runtime_seconds: 60\n  max_output_bytes: 65536\ninputs_schema:\n  type: object\n  additionalProperties: false\n  required: [names]\n  properties:\n    names: { type: array, items: { type: string, maxLength: 200 } }\n",
        r#"{ "artifacts": ["out/**"], "steps": [
  {%- for n in inputs.names %}{% if not loop.first %},{% endif %}
  { "id": {{ "w" ~ loop.index }}, "type": "write_file", "arguments": { "path": {{ "out/" ~ n }}, "content": {{ "bytes of " ~ n }} } }
  {%- endfor %} ] }"#,
        r#"{ "names": ["a"] }"#,
    );
}

/// Plans t1, runs `slow-mark` for it, then finishes.
fn slow_script(seconds: u64) -> Vec<Value> {
    cynode_tests::one_job_script(
        "slow",
        "slow-mark",
        json!({ "seconds": seconds }),
        "slow job over",
    )
}

fn history_kinds(v: &Value) -> Vec<String> {
    v["state"]["history"]
        .as_array()
        .map(|h| {
            h.iter()
                .map(|e| e["kind"].as_str().unwrap_or("").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// The result.json of every job the local worker kept (for failure messages).
fn job_results(state: &Path) -> String {
    let mut out = String::new();
    if let Ok(jobs) = std::fs::read_dir(state.join("worker/state/jobs")) {
        for j in jobs.flatten() {
            let text = std::fs::read_to_string(j.path().join("result.json")).unwrap_or_default();
            out.push_str(&format!("{}: {text}\n", j.path().display()));
        }
    }
    out
}

pub(crate) fn workspace(state: &Path, session: &str) -> PathBuf {
    state.join("worker/state/workspaces").join(session)
}

const SECRET: &str = "sk-model-key-that-must-not-leak-0123456789";

/// The keeper of a state directory's local worker, from its lease (`keeper.json`);
/// on drop (a failed test too) its process group (keeper, worker) is killed.
pub(crate) struct Keeper {
    keeper: u32,
    worker: u32,
}

impl Keeper {
    pub(crate) fn of(state: &Path, within: Duration) -> Keeper {
        let lease = state.join("worker/keeper.json");
        let mut found = None;
        wait_for(within, "the local worker's lease (keeper.json)", || {
            found = std::fs::read_to_string(&lease)
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok());
            found.is_some()
        });
        let v = found.unwrap();
        Keeper {
            keeper: v["keeper_pid"].as_u64().unwrap() as u32,
            worker: v["worker_pid"].as_u64().unwrap() as u32,
        }
    }

    pub(crate) fn alive(&self) -> bool {
        alive(self.keeper) || alive(self.worker)
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        if self.alive() {
            // SAFETY: SIGKILL to the process group of the keeper this test's PM started
            // (the keeper leads its own session and group).
            unsafe {
                libc::kill(-(self.keeper as i32), libc::SIGKILL);
            }
        }
    }
}

/// The names of the environment variables of `pid`, and whether `secret` is among the
/// values.
fn environment(pid: u32, secret: &str) -> (Vec<String>, bool) {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let names = environ
        .split(|b| *b == 0)
        .filter(|e| !e.is_empty())
        .map(|e| {
            String::from_utf8_lossy(e)
                .split('=')
                .next()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    (names, String::from_utf8_lossy(&environ).contains(secret))
}

/// How a test stops the PM that runs the slow job.
#[derive(Clone, Copy)]
enum Stop {
    /// kill -9 of the PM.
    Kill9,
    /// Ctrl-C at its terminal: SIGINT to its process group.
    CtrlC,
}

/// The local worker outlives its killed `cynode-pm run`: its keeper holds the state
/// directory's lease, the job runs to its end, and `sessions resume` attaches to the same
/// worker and takes the job's result. The job ran once, completed, and the model is never
/// told to redo it. Keeper and worker start from a cleared environment (never the model
/// key), and both are gone once the resumed PM ends.
fn a_job_survives_its_pm_and_resume_takes_its_result(stop: Stop) {
    let logs = cynode_tests::tempdir().unwrap();
    let skills = cynode_tests::tempdir().unwrap();
    slow_skill(skills.path());
    let skill_dir = skills.path().display().to_string();
    let state = cynode_tests::tempdir().unwrap();
    let (url, model) = model_server(slow_script(6));
    let mut pm = spawn_pm(
        logs.path(),
        "first",
        state.path(),
        &url,
        &["--skill-dir", &skill_dir, "run", "run the slow job"],
        &[
            ("CYNODE_MODEL_API_KEY", SECRET),
            ("SOME_UNRELATED_SECRET", SECRET),
            ("CYNODE_LOCAL_WORKER_GRACE_SECONDS", "120"),
        ],
    );
    let id = pm.session_id(Duration::from_secs(120));
    let keeper = Keeper::of(state.path(), Duration::from_secs(120));
    for pid in [keeper.keeper, keeper.worker] {
        let (names, leaked) = environment(pid, SECRET);
        assert!(!leaked, "process {pid} holds a secret: {names:?}");
        for n in &names {
            assert!(
                cynode_pm::local_worker::LOCAL_WORKER_ENV.contains(&n.as_str()),
                "process {pid} got `{n}`, which is not in LOCAL_WORKER_ENV"
            );
        }
    }
    let runs = workspace(state.path(), &id).join("runs.txt");
    wait_for(Duration::from_secs(120), "the slow job to start", || {
        runs.is_file()
    });
    let (pid, signal) = match stop {
        Stop::Kill9 => (pm.pid() as i32, libc::SIGKILL),
        Stop::CtrlC => (-(pm.pid() as i32), libc::SIGINT),
    };
    // SAFETY: a signal to the cynode-pm process (group) this test started, not reaped.
    unsafe {
        libc::kill(pid, signal);
    }
    let _ = pm.child.wait();
    assert!(keeper.alive(), "the local worker died with its PM");

    let mut resumed = spawn_pm(
        logs.path(),
        "resume",
        state.path(),
        &url,
        &["--skill-dir", &skill_dir, "sessions", "resume", &id],
        &[],
    );
    let (code, v) = resumed.finish(Duration::from_secs(180));
    assert_eq!(code, Some(0), "{v} {}", resumed.stderr());
    assert_eq!(v["status"], "completed", "{v}");
    assert!(
        resumed
            .stderr()
            .contains("using the local worker already running"),
        "{}",
        resumed.stderr()
    );
    // The job ran once, to its end, and its result was used (read from the workspace's
    // image: the worker let go of its volume when it stopped).
    assert_eq!(
        workspace_file(state.path(), &id, "runs.txt").as_deref(),
        Some("run\n")
    );
    assert!(workspace_file(state.path(), &id, "done.txt").is_some());
    assert_eq!(v["state"]["plan"][0]["status"], "done", "{v}");
    assert_eq!(v["jobs_dispatched"], 1, "{v}");
    let kinds = history_kinds(&v);
    assert_eq!(
        kinds.iter().filter(|k| *k == "job_dispatched").count(),
        1,
        "{kinds:?}"
    );
    let asked: Vec<String> = model.requests().iter().map(|r| r.to_string()).collect();
    assert!(
        asked.iter().all(|r| !r.contains("worker_restarted")),
        "the model heard worker_restarted"
    );
    // Three replies in all: plan, the job, final; none asked twice.
    assert_eq!(asked.len(), 3, "{asked:?}");
    // The resumed PM released the worker when it ended: nothing is left.
    wait_for(
        Duration::from_secs(30),
        "the keeper and the worker to stop after the resumed PM",
        || !keeper.alive(),
    );
}

#[test]
fn kill_9_of_run_mid_job_then_resume_takes_the_jobs_result() {
    a_job_survives_its_pm_and_resume_takes_its_result(Stop::Kill9);
}

#[test]
fn ctrl_c_of_run_mid_job_then_resume_takes_the_jobs_result() {
    a_job_survives_its_pm_and_resume_takes_its_result(Stop::CtrlC);
}

/// Nothing outlives the grace period. With a grace of 2 s and no PM coming
/// back, the keeper stops the worker (and its sandbox) and exits; the job's sandbox is
/// gone too.
#[test]
fn an_orphaned_local_worker_stops_after_its_grace_period() {
    let logs = cynode_tests::tempdir().unwrap();
    let skills = cynode_tests::tempdir().unwrap();
    slow_skill(skills.path());
    let skill_dir = skills.path().display().to_string();
    let state = cynode_tests::tempdir().unwrap();
    let (url, _model) = model_server(slow_script(40));
    let mut pm = spawn_pm(
        logs.path(),
        "orphan",
        state.path(),
        &url,
        &["--skill-dir", &skill_dir, "run", "run the slow job"],
        &[("CYNODE_LOCAL_WORKER_GRACE_SECONDS", "2")],
    );
    let id = pm.session_id(Duration::from_secs(120));
    let keeper = Keeper::of(state.path(), Duration::from_secs(120));
    let runs = workspace(state.path(), &id).join("runs.txt");
    wait_for(Duration::from_secs(120), "the slow job to start", || {
        runs.is_file()
    });
    let mut tree = vec![keeper.keeper];
    let mut i = 0;
    while i < tree.len() {
        let c = children(tree[i]);
        tree.extend(c);
        i += 1;
    }
    assert!(tree.len() >= 3, "keeper, worker and the sandbox: {tree:?}");
    // SAFETY: SIGKILL to the cynode-pm process this test started (not yet reaped).
    unsafe {
        libc::kill(pm.pid() as i32, libc::SIGKILL);
    }
    let _ = pm.child.wait();
    let killed = Instant::now();
    wait_for(
        Duration::from_secs(40),
        "every process of the orphaned local worker to end after its grace period",
        || tree.iter().all(|p| !alive(*p)),
    );
    println!(
        "{} processes gone {} ms after kill -9 (grace 2 s)",
        tree.len(),
        killed.elapsed().as_millis()
    );
    assert!(!state.path().join("worker/keeper.sock").exists());
    assert!(workspace_file(state.path(), &id, "runs.txt").is_some());
    assert!(workspace_file(state.path(), &id, "done.txt").is_none());
    // Nor does its volume: nothing is mounted beneath the state directory.
    if let Err(left) =
        cynode_testkit::mounts::wait_nothing_left(state.path(), Duration::from_secs(5))
    {
        panic!("the orphaned local worker left {left:#?}");
    }
}

/// `cynode-pm run` with its local worker leaves nothing mounted when it exits: no mount
/// beneath its state directory and no loop device on one of its files (the worker's clean
/// stop unmounts its volumes); what the job wrote is in the workspace's image.
#[test]
fn run_with_its_local_worker_leaves_nothing_mounted() {
    let logs = cynode_tests::tempdir().unwrap();
    let skills = cynode_tests::tempdir().unwrap();
    slow_skill(skills.path());
    let skill_dir = skills.path().display().to_string();
    let state = cynode_tests::tempdir().unwrap();
    let (url, _model) = model_server(slow_script(0));
    let mut pm = spawn_pm(
        logs.path(),
        "mounts",
        state.path(),
        &url,
        &["--skill-dir", &skill_dir, "run", "run the job"],
        &[],
    );
    let (code, v) = pm.finish(Duration::from_secs(180));
    assert_eq!(code, Some(0), "{v} {}", pm.stderr());
    assert_eq!(v["state"]["plan"][0]["status"], "done", "{v}");
    if let Err(left) =
        cynode_testkit::mounts::wait_nothing_left(state.path(), Duration::from_secs(5))
    {
        panic!("cynode-pm run left {left:#?}");
    }
    let id = v["state"]["session_id"].as_str().unwrap();
    assert_eq!(
        workspace_file(state.path(), id, "done.txt").as_deref(),
        Some("done\n")
    );
}

/// A second `run` on the same state directory uses the first one's
/// worker instead of starting a rival that reconciles
/// the first one's job away; both sessions complete and each job ran once.
#[test]
fn two_runs_on_one_state_dir_never_break_each_other() {
    let logs = cynode_tests::tempdir().unwrap();
    let skills = cynode_tests::tempdir().unwrap();
    slow_skill(skills.path());
    let skill_dir = skills.path().display().to_string();
    let state = cynode_tests::tempdir().unwrap();
    let (url_a, _) = model_server(slow_script(4));
    let (url_b, _) = model_server(slow_script(1));
    let mut a = spawn_pm(
        logs.path(),
        "a",
        state.path(),
        &url_a,
        &["--skill-dir", &skill_dir, "run", "first run"],
        &[],
    );
    let id_a = a.session_id(Duration::from_secs(120));
    let keeper = Keeper::of(state.path(), Duration::from_secs(120));
    let runs_a = workspace(state.path(), &id_a).join("runs.txt");
    wait_for(Duration::from_secs(120), "run A's job to start", || {
        runs_a.is_file()
    });
    let mut b = spawn_pm(
        logs.path(),
        "b",
        state.path(),
        &url_b,
        &["--skill-dir", &skill_dir, "run", "second run"],
        &[],
    );
    let (code_a, v_a) = a.finish(Duration::from_secs(180));
    assert_eq!(code_a, Some(0), "run A: {v_a} {}", a.stderr());
    assert_eq!(v_a["status"], "completed", "{v_a}");
    // A's job itself completed (the session would complete either way: the scripted
    // model finishes after any job result).
    assert_eq!(
        v_a["state"]["plan"][0]["status"],
        "done",
        "run B broke run A's job: {v_a}\njobs: {}\nB: {}",
        job_results(state.path()),
        b.stderr()
    );
    assert!(workspace_file(state.path(), &id_a, "done.txt").is_some());
    let (code_b, v_b) = b.finish(Duration::from_secs(180));
    assert_eq!(code_b, Some(0), "run B: {v_b} {}", b.stderr());
    assert_eq!(v_b["status"], "completed", "{v_b}");
    assert_eq!(v_b["state"]["plan"][0]["status"], "done", "{v_b}");
    let id_b = v_b["state"]["session_id"].as_str().unwrap();
    for id in [id_a.as_str(), id_b] {
        let runs = workspace_file(state.path(), id, "runs.txt");
        assert_eq!(runs.as_deref(), Some("run\n"), "session {id}");
    }
    wait_for(
        Duration::from_secs(30),
        "the shared local worker to stop once both PMs released it",
        || !keeper.alive(),
    );
    // B used A's worker (through its keeper) instead of starting a rival.
    assert!(
        b.stderr()
            .contains("using the local worker already running"),
        "run B did not use run A's worker: {}",
        b.stderr()
    );
}

/// Several processes opening a new state directory's database at once
/// all succeed (no `UNIQUE constraint failed: _sqlx_migrations.version`, no `database
/// is locked`).
#[test]
fn processes_opening_a_fresh_state_dir_at_once_all_succeed() {
    for trial in 0..6 {
        let state = cynode_tests::tempdir().unwrap();
        let dir = state.path().join("fresh");
        let mut procs: Vec<Child> = (0..4)
            .map(|_| {
                Command::new(cynode_tests::bin("cynode-pm"))
                    .args(["--output", "json", "sessions", "list", "--state-dir"])
                    .arg(&dir)
                    .current_dir(workspace_root())
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let t = Instant::now();
        for p in &mut procs {
            let status = loop {
                if let Some(s) = p.try_wait().unwrap() {
                    break s;
                }
                assert!(
                    t.elapsed() < Duration::from_secs(120),
                    "trial {trial}: hung"
                );
                std::thread::sleep(Duration::from_millis(20));
            };
            let mut err = String::new();
            p.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            assert!(status.success(), "trial {trial}: {status}: {err}");
        }
    }
}

/// Artifacts whose names hold spaces, `#`, `?`, `%`, `&`, `+` and
/// non-ASCII characters are fetched, verified and stored.
#[test]
fn odd_artifact_names_arrive_end_to_end() {
    let logs = cynode_tests::tempdir().unwrap();
    let skills = cynode_tests::tempdir().unwrap();
    odd_names_skill(skills.path());
    let skill_dir = skills.path().display().to_string();
    let state = cynode_tests::tempdir().unwrap();
    let names = [
        "issue #12 notes.txt",
        "what?x=1&y=2.txt",
        "100% done+more.txt",
        "ünïcødé ✓ 名前.txt",
        "sub dir/a;b,c'd.txt",
        "%2e%2e.txt",
    ];
    let (url, _) = model_server(vec![
        json!({ "type": "plan_update", "state_patch": [
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "odd names", "status": "pending" } }
        ], "payload": {} }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": "odd-names", "inputs": { "names": names } } }),
        json!({ "type": "final", "state_patch": [], "payload": { "summary": "odd names written" } }),
    ]);
    let mut pm = spawn_pm(
        logs.path(),
        "odd",
        state.path(),
        &url,
        &["--skill-dir", &skill_dir, "run", "write odd names"],
        &[],
    );
    let (code, v) = pm.finish(Duration::from_secs(180));
    assert_eq!(code, Some(0), "{v} {}", pm.stderr());
    assert_eq!(v["status"], "completed", "{v}");
    assert!(!v.to_string().contains("artifact_integrity_failure"), "{v}");
    let artifacts = v["state"]["artifacts"].as_array().unwrap();
    for n in names {
        let path = format!("out/{n}");
        let a = artifacts
            .iter()
            .find(|a| a["path"] == path.as_str())
            .unwrap_or_else(|| panic!("artifact `{path}` missing: {artifacts:?}"));
        let sha = a["sha256"].as_str().unwrap();
        use sha2::Digest;
        let want = hex::encode(sha2::Sha256::digest(format!("bytes of {n}").as_bytes()));
        assert_eq!(sha, want, "{path}");
    }
}

/// A worker that refuses the token fails the session at once with an
/// authentication error naming the worker, not after `--worker-wait-seconds`.
#[test]
fn a_wrong_worker_token_fails_at_once_naming_the_worker() {
    let worker = start_worker(0);
    let logs = cynode_tests::tempdir().unwrap();
    let state = cynode_tests::tempdir().unwrap();
    let (url, _) = model_server(vec![
        json!({ "type": "plan_update", "state_patch": [
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "look", "status": "pending" } }
        ], "payload": {} }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": "repo-inspect", "inputs": {} } }),
    ]);
    let endpoint = format!("http://{}", worker.addr);
    let started = Instant::now();
    let mut pm = spawn_pm(
        logs.path(),
        "token",
        state.path(),
        &url,
        &[
            "run",
            "inspect",
            "--worker-endpoint",
            &endpoint,
            "--worker-wait-seconds",
            "300",
        ],
        &[("CYNODE_WORKER_TOKEN", "not-the-worker-token-0123456789")],
    );
    let (code, v) = pm.finish(Duration::from_secs(120));
    let took = started.elapsed();
    println!("wrong token failed after {} ms", took.as_millis());
    assert_eq!(code, Some(1), "{v} {}", pm.stderr());
    assert_eq!(v["failure"]["kind"], "worker_unavailable", "{v}");
    let msg = v["failure"]["message"].as_str().unwrap();
    assert!(
        msg.contains("authentication") && msg.contains(&endpoint) && msg.contains("401"),
        "{msg}"
    );
    assert!(took < Duration::from_secs(60), "took {took:?}");
}

/// A model endpoint that accepts the request and never answers.
fn silent_model() -> String {
    let app = Router::new().route(
        "/v1/chat/completions",
        post(|| async {
            std::future::pending::<()>().await;
            ""
        }),
    );
    format!("http://{}/v1", serve_in_background(app))
}

/// `--model-timeout-seconds` (and `CYNODE_MODEL_TIMEOUT_SECONDS`) bounds
/// how long a model that never answers can hold a turn: each of the 3 transport tries
/// waits that long, so 3 s gives about 10 s, where the default 120 s per try gives
/// 6 minutes (the upper bound leaves room for a loaded machine).
#[test]
fn a_model_that_never_answers_fails_within_the_model_timeout() {
    let url = silent_model();
    let logs = cynode_tests::tempdir().unwrap();
    for (name, args, envs) in [
        (
            "flag",
            vec!["--model-timeout-seconds", "3"],
            vec![("CYNODE_WORKER_TOKEN", "x")],
        ),
        (
            "env",
            vec![],
            vec![
                ("CYNODE_WORKER_TOKEN", "x"),
                ("CYNODE_MODEL_TIMEOUT_SECONDS", "3"),
            ],
        ),
    ] {
        let state = cynode_tests::tempdir().unwrap();
        let mut all = vec![
            "run",
            "say something",
            "--worker-endpoint",
            "http://127.0.0.1:9",
        ];
        all.extend(args);
        let started = Instant::now();
        let mut pm = spawn_pm(logs.path(), name, state.path(), &url, &all, &envs);
        let (code, v) = pm.finish(Duration::from_secs(120));
        let took = started.elapsed();
        println!(
            "{name}: a silent model failed the session after {} ms",
            took.as_millis()
        );
        assert_eq!(code, Some(1), "{name}: {v} {}", pm.stderr());
        assert_eq!(v["failure"]["kind"], "model_unavailable", "{name}: {v}");
        assert!(
            took >= Duration::from_secs(9) && took < Duration::from_secs(120),
            "{name}: took {took:?}"
        );
    }
}

/// On PostgreSQL: replicas opening a new database at once all migrate it
/// without error (the migration, including sqlx's creation of its own table, runs under
/// `pg_advisory_lock`).
#[test]
fn processes_opening_a_fresh_postgres_database_at_once_all_succeed() {
    let admin = cynode_testkit::postgres_url();
    let rt = tokio::runtime::Runtime::new().unwrap();
    for trial in 0..4 {
        let name = format!("cynode_fresh_{}", uuid::Uuid::new_v4().simple());
        rt.block_on(async {
            sqlx::any::install_default_drivers();
            let mut c = <sqlx::AnyConnection as sqlx::Connection>::connect(admin)
                .await
                .unwrap();
            sqlx::query(&format!("CREATE DATABASE {name}"))
                .execute(&mut c)
                .await
                .unwrap();
        });
        let mut url = url::Url::parse(admin).unwrap();
        url.set_path(&format!("/{name}"));
        let mut procs: Vec<Child> = (0..3)
            .map(|_| {
                Command::new(cynode_tests::bin("cynode-pm"))
                    .args([
                        "--output",
                        "json",
                        "sessions",
                        "list",
                        "--datastore-endpoint",
                    ])
                    .arg(url.as_str())
                    .current_dir(workspace_root())
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let t = Instant::now();
        let mut failures = Vec::new();
        for p in &mut procs {
            let status = loop {
                if let Some(s) = p.try_wait().unwrap() {
                    break s;
                }
                assert!(
                    t.elapsed() < Duration::from_secs(120),
                    "trial {trial}: hung"
                );
                std::thread::sleep(Duration::from_millis(20));
            };
            let mut err = String::new();
            p.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            if !status.success() {
                failures.push(format!("{status}: {err}"));
            }
        }
        rt.block_on(async {
            let mut c = <sqlx::AnyConnection as sqlx::Connection>::connect(admin)
                .await
                .unwrap();
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name}"))
                .execute(&mut c)
                .await;
        });
        assert!(failures.is_empty(), "trial {trial}: {failures:?}");
    }
}
