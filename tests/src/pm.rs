//! Running `cynode-pm` as the tests do: the real binary, JSON output, a state directory
//! of the test's own, a local bubblewrap worker on the test image, a scripted model; and
//! reading what it printed.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use cynode_testkit::output_bounded;
use serde_json::{json, Value};

use crate::{bin, rootfs, workspace_root};

/// How long one run of `cynode-pm` may take in these tests (scripted model, local worker).
pub const PM_LIMIT: Duration = Duration::from_secs(180);

pub fn pm_with(state: &Path, model: &str, args: &[&str], envs: &[(&str, &str)]) -> Output {
    output_bounded(pm_command(state, model, args, envs), PM_LIMIT)
}

/// [`pm_with`] with a local worker on `backend` (`bwrap`, `podman` or `docker`).
pub fn pm_on(
    backend: &str,
    state: &Path,
    model: &str,
    args: &[&str],
    envs: &[(&str, &str)],
) -> Output {
    output_bounded(pm_command_on(backend, state, model, args, envs), PM_LIMIT)
}

/// The `cynode-pm` command line of these tests: JSON output, the state directory, a local
/// bwrap worker on the test image, the model at `model`.
pub fn pm_command(state: &Path, model: &str, args: &[&str], envs: &[(&str, &str)]) -> Command {
    pm_command_on("bwrap", state, model, args, envs)
}

/// [`pm_command`] with a local worker on `backend`: bwrap on the test image's root
/// filesystem, or an engine on the test image itself.
pub fn pm_command_on(
    backend: &str,
    state: &Path,
    model: &str,
    args: &[&str],
    envs: &[(&str, &str)],
) -> Command {
    let mut c = Command::new(bin("cynode-pm"));
    // A failpoint only where the test sets one (`CYNODE_PM_FAILPOINT` in `envs`).
    c.env_remove("CYNODE_PM_FAILPOINT");
    // A local worker outlives a crashed PM for this long (the crash-resume tests resume
    // within it); a test that fails leaves nothing running for long.
    c.env("CYNODE_LOCAL_WORKER_GRACE_SECONDS", "30");
    c.envs(envs.iter().copied());
    c.args(["--output", "json"]).args(args);
    // The scripted sessions of these tests plan, ask and finish freely, as with a person at
    // the terminal, unless a test asks for `--non-interactive` itself.
    if args.contains(&"run") && !args.contains(&"--non-interactive") {
        c.arg("--interactive");
    }
    c.arg("--state-dir")
        .arg(state)
        .args(["--local-backend", backend]);
    if backend == "bwrap" {
        c.arg("--local-bwrap-rootfs").arg(rootfs());
    }
    c.args(["--model-base-url", model])
        .current_dir(workspace_root());
    c
}

pub fn session_id(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .find_map(|l| {
            l.strip_prefix("session s-")
                .map(|r| format!("s-{}", r.split_whitespace().next().unwrap_or("")))
        })
        .unwrap_or_else(|| panic!("no session id in: {}", String::from_utf8_lossy(&out.stderr)))
}

pub fn final_state(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: stdout {} stderr {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The final state of a run that must have completed (exit 0).
pub fn completed(out: &Output) -> Value {
    let v = final_state(out);
    assert_eq!(
        (out.status.code(), v["status"].clone()),
        (Some(0), json!("completed")),
        "{v}"
    );
    v
}

pub fn happy_script() -> Vec<Value> {
    write_then_search("hello from the model\n", "hello")
}

/// Plans t1 and t2, writes hello.txt with `content` (t1), searches for `pattern` (t2),
/// finishes.
pub fn write_then_search(content: &str, pattern: &str) -> Vec<Value> {
    vec![
        json!({ "type": "plan_update", "state_patch": [
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "write the greeting", "status": "pending" } },
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t2", "description": "find it again", "status": "pending" } }
        ], "payload": { "note": "two tasks" } }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": "write-files",
            "inputs": { "files": [{ "path": "hello.txt", "content": content }] } } }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t2", "skill_id": "search-code",
            "inputs": { "pattern": pattern } } }),
        json!({ "type": "final", "state_patch": [], "payload": { "summary": "wrote hello.txt and found it", "artifacts": [] } }),
    ]
}

/// Plans one task `t1` (`description`), runs `skill_id` with `inputs` for it, then
/// finishes with `summary`.
pub fn one_job_script(
    description: &str,
    skill_id: &str,
    inputs: Value,
    summary: &str,
) -> Vec<Value> {
    vec![
        json!({ "type": "plan_update", "state_patch": [
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": description, "status": "pending" } }
        ], "payload": {} }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": skill_id, "inputs": inputs } }),
        json!({ "type": "final", "state_patch": [], "payload": { "summary": summary } }),
    ]
}

/// How many events of `kind` a session's final state has in its history.
pub fn history_count(state: &Value, kind: &str) -> usize {
    state["state"]["history"]
        .as_array()
        .map_or(0, |h| h.iter().filter(|e| e["kind"] == kind).count())
}

/// The plan of a session's final state, as (task_id, status) pairs in order.
pub fn plan_statuses(state: &Value) -> Vec<(String, String)> {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
    state["state"]["plan"]
        .as_array()
        .map(|plan| {
            plan.iter()
                .map(|p| (text(&p["task_id"]), text(&p["status"])))
                .collect()
        })
        .unwrap_or_default()
}

/// The kinds of a session's history events, in order.
pub fn history_kinds(state: &Value) -> Vec<&str> {
    state["state"]["history"]
        .as_array()
        .map(|h| h.iter().filter_map(|e| e["kind"].as_str()).collect())
        .unwrap_or_default()
}
