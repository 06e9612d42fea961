//! The `agent-task` skill does a real task end to end: `cynode-pm skills run agent-task`
//! hands "make the failing test pass" to an agent in the sandbox of a real worker (bwrap,
//! Podman and Docker), with a workspace whose test fails. The model is scripted (it reads
//! the file, writes the fix, runs the check, completes its todo items and finishes), so the path itself is proven:
//! the task and criteria reach the model's prompt, the fix lands in the workspace, the
//! job's own `run_command` step shows the test passing, and the PM verifies the result.
//! With no worker flags, `skills run` starts its own local worker and gives it the model of
//! `CYNODE_MODEL_BASE_URL`, or, for a model that takes a key (`CYNODE_MODEL_API_KEY`), its
//! inference relay: the agent fixes the test there too, and the key stays in the PM.
//! Once more with the real local model (SmolLM2-135M): the job ends with a complete
//! result, fixed or failed by name, and what the model did is printed.

use std::path::Path;
use std::process::{Command, Output};

use cynode_testkit::output_bounded;
use serde_json::{json, Value};

use cynode_tests::model::model_server;
use cynode_tests::pm::PM_LIMIT;
use cynode_tests::worker::{serve_worker, TOKEN};
use cynode_tests::{bin, rootfs, tempdir, workspace_root};

const IMAGE: &str = "localhost/cynode-sba-test:latest";

/// The project the agent is given: `add.sh` subtracts, and `test.sh` says so.
fn seed(ws: &Path) {
    std::fs::create_dir_all(ws).unwrap();
    std::fs::write(ws.join("add.sh"), "echo $(($1 - $2))\n").unwrap();
    std::fs::write(
        ws.join("test.sh"),
        "got=$(sh add.sh 2 3)\nif [ \"$got\" = 5 ]; then echo '1 passed'; else echo \"FAILED: add 2 3 gave $got\"; exit 1; fi\n",
    )
    .unwrap();
}

/// What the scripted agent answers, turn by turn.
fn script() -> Vec<Value> {
    let act = |ty: &str, args: Value| {
        json!({ "thought": format!("{ty}"), "action": { "type": ty, "arguments": args } })
            .to_string()
    };
    [
        act("read_file", json!({ "path": "add.sh" })),
        act(
            "write_file",
            json!({ "path": "add.sh", "content": "echo $(($1 + $2))\n" }),
        ),
        act(
            "run_command",
            json!({ "command": "sh", "args": ["test.sh"] }),
        ),
        act("todo", json!({ "complete": ["ac-1", "step-check"] })),
        act(
            "finish",
            json!({ "status": "success", "final_answer": "add.sh adds; sh test.sh: 1 passed" }),
        ),
    ]
    .into_iter()
    .map(Value::String)
    .collect()
}

fn worker_config(dir: &Path, backend: &str, model_url: &str) -> std::path::PathBuf {
    std::fs::write(dir.join("token"), TOKEN).unwrap();
    let cfg = format!(
        "listen: 127.0.0.1:0\nbackend: {backend}\nstate_dir: {}\ntoken_file: {}\n\
         seed_roots: [{}]\n\
         bwrap:\n  rootfs:\n    \"{IMAGE}\": {}\n\
         inference:\n  base_url: {model_url}\n  models: [smollm2]\n",
        dir.join("state").display(),
        dir.join("token").display(),
        dir.display(),
        rootfs().display()
    );
    let path = dir.join("w.yaml");
    std::fs::write(&path, cfg).unwrap();
    path
}

fn agent_task_fixes_the_failing_test(backend: &str) {
    let dir = tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let ws = dir.path().join("ws");
    seed(&ws);
    let (model_url, model) = model_server(script());
    let (_worker, addr) = serve_worker(&worker_config(dir.path(), backend, &model_url));
    let inputs = task_inputs(dir.path());

    let mut c = Command::new(bin("cynode-pm"));
    c.env("CYNODE_WORKER_TOKEN", TOKEN)
        .args([
            "--output",
            "json",
            "skills",
            "run",
            "agent-task",
            "--inputs",
        ])
        .arg(&inputs)
        .arg("--workspace")
        .arg(&ws)
        .args(["--worker-endpoint", &format!("http://{addr}")])
        .args(["--sandbox-image", IMAGE])
        .arg("--state-dir")
        .arg(dir.path().join("pm"))
        .current_dir(workspace_root());
    let out: Output = output_bounded(c, PM_LIMIT);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {} {stderr}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(out.status.code(), Some(0), "{v:#}\n{stderr}");

    // The job's own run_command step ran the check, and it passed.
    assert_fixed(&v, &ws);

    // The model saw the task and the criterion, in that order, in its first prompt.
    let first = model.requests()[0].to_string();
    let task = first.find("fix add.sh so that it adds").expect(&first);
    let criterion = first.find("sh test.sh prints 1 passed").expect(&first);
    assert!(task < criterion, "{first}");

    // The fix is in the caller's workspace copy the worker kept.
    let fixed = std::fs::read_dir(dir.path().join("state/workspaces"))
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|e| std::fs::read_to_string(e.path().join("add.sh")).ok())
        .collect::<Vec<_>>();
    assert_eq!(fixed, ["echo $(($1 + $2))\n"], "{v:#}");
}

#[test]
fn bwrap_agent_task_fixes_a_failing_test() {
    agent_task_fixes_the_failing_test("bwrap");
}

#[test]
fn podman_agent_task_fixes_a_failing_test() {
    agent_task_fixes_the_failing_test("podman");
}

#[test]
fn docker_agent_task_fixes_a_failing_test() {
    agent_task_fixes_the_failing_test("docker");
}

/// The inputs of the task in `dir`: fix add.sh so that `sh test.sh` passes.
fn task_inputs(dir: &Path) -> std::path::PathBuf {
    let inputs = dir.join("inputs.json");
    std::fs::write(
        &inputs,
        json!({
            "task": "The test in test.sh fails: fix add.sh so that it adds its two arguments",
            "acceptance_criteria": ["the tests pass: sh test.sh prints 1 passed"],
            "check_command": ["sh", "test.sh"]
        })
        .to_string(),
    )
    .unwrap();
    inputs
}

/// `cynode-pm skills run agent-task` with no worker flags: its own local bwrap worker on
/// the test rootfs, the model at `CYNODE_MODEL_BASE_URL` (and `envs`); the parsed output.
fn skills_run_on_the_local_worker(
    dir: &Path,
    ws: &Path,
    model_url: &str,
    envs: &[(&str, &str)],
) -> (Output, Value) {
    let inputs = task_inputs(dir).display().to_string();
    let args = ["skills", "run", "agent-task", "--inputs", inputs.as_str()];
    pm_on_the_local_worker(dir, ws, model_url, envs, &args)
}

/// `cynode-pm --output json ARGS… --workspace WS` on its own local bwrap worker, the model
/// at `CYNODE_MODEL_BASE_URL` (and `envs`); the parsed output.
fn pm_on_the_local_worker(
    dir: &Path,
    ws: &Path,
    model_url: &str,
    envs: &[(&str, &str)],
    args: &[&str],
) -> (Output, Value) {
    let mut c = Command::new(bin("cynode-pm"));
    for var in [
        "CYNODE_WORKER_ENDPOINT",
        "CYNODE_WORKERS_FILE",
        "CYNODE_MODEL_API_KEY",
        "CYNODE_PM_FAILPOINT",
    ] {
        c.env_remove(var);
    }
    c.env("CYNODE_MODEL_BASE_URL", model_url)
        .env("CYNODE_LOCAL_WORKER_GRACE_SECONDS", "30")
        .envs(envs.iter().copied())
        .args(["--output", "json"])
        .args(args)
        .arg("--workspace")
        .arg(ws)
        .args(["--local-backend", "bwrap", "--local-bwrap-rootfs"])
        .arg(rootfs())
        .args(["--sandbox-image", IMAGE])
        .arg("--state-dir")
        .arg(dir.join("pm"))
        .current_dir(workspace_root());
    let out = output_bounded(c, PM_LIMIT);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out, v)
}

/// The job of `v` fixed add.sh: its own check passed, the agent finished, the change is
/// its changeset, and the caller's `ws` is unchanged (the job worked on a copy).
fn assert_fixed(v: &Value, ws: &Path) {
    let job = &v["job"];
    assert_eq!(job["result"]["status"], "success", "{v:#}");
    let check = job["result"]["steps"]
        .as_array()
        .unwrap_or_else(|| panic!("no steps in {v:#}"))
        .iter()
        .find(|s| s["type"] == "run_command")
        .unwrap_or_else(|| panic!("no run_command step in {v:#}"));
    assert_eq!(check["result"]["exit_code"], 0, "{check:#}");
    assert!(
        check["result"]["stdout"]
            .as_str()
            .is_some_and(|o| o.contains("1 passed")),
        "{check:#}"
    );
    assert_eq!(
        job["result"]["final_answer"],
        "add.sh adds; sh test.sh: 1 passed"
    );
    let changeset = job["changeset"].as_str().unwrap_or_default();
    assert!(
        changeset.contains("-echo $(($1 - $2))") && changeset.contains("+echo $(($1 + $2))"),
        "{changeset}"
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("add.sh")).unwrap(),
        "echo $(($1 - $2))\n"
    );
}

/// A temp dir the sandbox user can enter, with the failing project at `ws`.
fn project() -> (cynode_tests::TempDir, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let ws = dir.path().join("ws");
    seed(&ws);
    (dir, ws)
}

/// No worker flags: `skills run` starts its local worker with the model of
/// `CYNODE_MODEL_BASE_URL` as its inference upstream, as `run` does, and the agent fixes
/// the test on it.
#[test]
fn local_worker_agent_task_reaches_the_model_of_the_environment() {
    let (dir, ws) = project();
    let (model_url, model) = model_server(script());
    let (out, v) = skills_run_on_the_local_worker(dir.path(), &ws, &model_url, &[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{v:#}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_fixed(&v, &ws);
    let first = model.requests()[0].to_string();
    let task = first.find("fix add.sh so that it adds").expect(&first);
    let criterion = first.find("sh test.sh prints 1 passed").expect(&first);
    assert!(task < criterion, "{first}");
    assert_eq!(model.requests().len(), script().len());
}

/// A model that takes a key (`CYNODE_MODEL_API_KEY`): the local worker of `skills run`
/// reaches it through the PM's inference relay, which adds the key; the job succeeds, every
/// chat request the model got carried the key, and the key is in no file of the state
/// directory, nor in what the PM printed.
#[test]
fn local_worker_agent_task_reaches_a_keyed_model_through_the_relay() {
    use axum::extract::{Request, State};
    use axum::middleware::Next;
    use axum::response::{IntoResponse, Response};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[derive(Default)]
    struct Seen {
        keyed: AtomicUsize,
        refused: AtomicUsize,
    }
    async fn demand_key(
        State((key, seen)): State<(Arc<str>, Arc<Seen>)>,
        req: Request,
        next: Next,
    ) -> Response {
        let ok = req
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v == format!("Bearer {key}"));
        if !ok {
            seen.refused.fetch_add(1, Ordering::SeqCst);
            return (axum::http::StatusCode::UNAUTHORIZED, "a key is required").into_response();
        }
        seen.keyed.fetch_add(1, Ordering::SeqCst);
        next.run(req).await
    }

    let (dir, ws) = project();
    let key = format!("sk-skills-run-{}", uuid::Uuid::new_v4().simple());
    let seen = Arc::new(Seen::default());
    let (app, model) = cynode_tests::model::model_app(script());
    let app = app.layer(axum::middleware::from_fn_with_state(
        (Arc::<str>::from(key.as_str()), Arc::clone(&seen)),
        demand_key,
    ));
    let model_url = format!(
        "http://{}/v1",
        cynode_testkit::scripted_model::serve_in_background(app)
    );
    let (out, v) = skills_run_on_the_local_worker(
        dir.path(),
        &ws,
        &model_url,
        &[("CYNODE_MODEL_API_KEY", key.as_str())],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{v:#}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_fixed(&v, &ws);
    assert_eq!(
        seen.refused.load(Ordering::SeqCst),
        0,
        "a request came without the key"
    );
    assert_eq!(model.requests().len(), script().len());
    assert!(seen.keyed.load(Ordering::SeqCst) >= script().len());

    crate::hosted_model::assert_key_stayed_in_the_pm(&dir.path().join("pm"), &key, &out);
}

/// The same task for the real local model (SmolLM2-135M on llama-server) with the same
/// local worker, as a skill author runs it: `skills render agent-task`, the job's runtime
/// cut to 60 s (the skill's 300 s would let this small model use all its turns), then
/// `jobs run`. The path runs end to end and the job ends with a complete result, either
/// fixed (its own check passing in its `run_command` step) or failed with its failure
/// named (a timeout, or the turns used up); never a crash, a partial result or a changed
/// caller's workspace. The whole answer is printed: it is the transcript of what this model
/// did with the task.
#[test]
fn the_real_model_is_handed_the_failing_test_and_the_job_ends_with_a_complete_result() {
    let (dir, ws) = project();
    let mut render = Command::new(bin("cynode-pm"));
    render
        .args(["skills", "render", "agent-task", "--inputs"])
        .arg(task_inputs(dir.path()))
        .current_dir(workspace_root());
    let rendered = output_bounded(render, PM_LIMIT);
    assert!(rendered.status.success(), "{rendered:?}");
    let mut job: Value = serde_json::from_slice(&rendered.stdout).unwrap();
    job["constraints"]["max_runtime_seconds"] = json!(60);
    let job_file = dir.path().join("job.json");
    std::fs::write(&job_file, job.to_string()).unwrap();
    let model = cynode_testkit::LocalModel::start(
        &workspace_root(),
        cynode_testkit::model::free_port(),
        std::time::Duration::from_secs(300),
    );
    let job_arg = job_file.display().to_string();
    let (out, v) = pm_on_the_local_worker(
        dir.path(),
        &ws,
        &model.base_url,
        &[],
        &["jobs", "run", job_arg.as_str()],
    );
    eprintln!("what the real model's job gave:\n{v:#}");
    match out.status.code() {
        Some(0) => {
            let job = &v["job"];
            assert_eq!(job["result"]["status"], "success", "{v:#}");
            let steps = job["result"]["steps"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            assert!(
                steps.iter().any(|s| s["type"] == "run_command"
                    && s["result"]["exit_code"] == 0
                    && s["result"]["stdout"]
                        .as_str()
                        .is_some_and(|o| o.contains("1 passed"))),
                "a success must show the check passing: {v:#}"
            );
        }
        Some(1) => {
            assert_eq!(v["error"]["kind"], "job_failed", "{v:#}");
            let job = &v["error"]["job"];
            assert!(
                job["status"] == "failed" || job["status"] == "timeout",
                "{v:#}"
            );
            assert!(job["failure"]["code"].is_string(), "{v:#}");
            // The runner says `failure` where the job says `failed` (a refused tool call, a
            // failed step); a timeout is `timeout` in both.
            let said = match job["result"]["status"].as_str() {
                Some("failure") => "failed",
                other => other.unwrap_or("no status"),
            };
            assert_eq!(job["status"], said, "{v:#}");
            assert!(job["result"]["steps"].is_array(), "{v:#}");
        }
        code => panic!(
            "exit {code:?}: {v:#}\n{}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
    assert_eq!(
        std::fs::read_to_string(ws.join("add.sh")).unwrap(),
        "echo $(($1 - $2))\n"
    );
}
