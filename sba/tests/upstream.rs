//! The SBA against upstream CyNodeAI's contract: jobs in upstream's shape (built from a
//! faithful mirror of its `sbajob.JobSpec`, marshalled as Go marshals it) run on the real
//! binary, and every result.json decodes with the mirror of its `sbajob.Result` (Go's
//! encoding/json semantics, cynode_testkit::upstream) and carries the values upstream
//! reads. Test names follow upstream's BDD features (features/agents/sba_*.feature):
//! `<feature>__<scenario>`, hence the double underscore.
#![allow(non_snake_case)]

use cynode_testkit::upstream::{self, SbaResult};
use serde_json::{json, Value};

use crate::harness::{Run, Sandbox};

/// Upstream's job.json: `steps` of `{type, args}`, marshalled from the Go mirror.
fn upstream_job(steps: Value, max_output_bytes: i64) -> Value {
    let spec = upstream::JobSpec {
        protocol_version: "1.0".into(),
        job_id: "job-1".into(),
        task_id: "task-1".into(),
        constraints: upstream::JobConstraints {
            max_runtime_seconds: 30,
            max_output_bytes,
            ext_net_allowed: false,
        },
        steps: Some(serde_json::from_value(steps).unwrap()),
        ..Default::default()
    };
    serde_json::to_value(spec).unwrap()
}

/// result.json as upstream's worker decodes it (`json.Unmarshal` into `sbajob.Result`).
fn as_upstream(sb: &Sandbox) -> SbaResult {
    let text = std::fs::read_to_string(sb.result_path()).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!("upstream's sbajob.Result cannot decode result.json: {e}\n{text}")
    })
}

fn echo_ok() -> Value {
    json!([{ "type": "run_command", "args": { "argv": ["echo", "ok"] } }])
}

#[test]
fn sba_runner__runner_executes_run_command_step_and_writes_success_result() {
    let sb = Sandbox::new();
    let run = sb.run(&upstream_job(echo_ok(), 1024));
    assert_eq!((run.code, run.failure()), (Some(0), "none".to_string()));
    for key in ["protocol_version", "job_id", "status", "steps"] {
        assert!(
            run.raw.get(key).is_some(),
            "result lacks {key}: {}",
            run.raw
        );
    }
    // The step got an id by position; upstream reads its index, exit code and output.
    assert_eq!(run.step(0)["id"], "step-1");
    let up = as_upstream(&sb);
    assert_eq!(up.status, "success");
    assert_eq!(
        up.steps.unwrap(),
        [upstream::StepResult {
            index: 0,
            step_type: "run_command".into(),
            status: "success".into(),
            exit_code: Some(0),
            output: "ok\n".into(),
            error: String::new(),
        }]
    );
}

#[test]
fn sba_runner__runner_produces_result_with_step_output() {
    let sb = Sandbox::new();
    sb.put("notes/a.txt", "alpha\nbeta\n");
    let run = sb.run(&upstream_job(
        json!([
            { "type": "run_command", "args": { "argv": ["printf", "hello"] } },
            { "type": "write_file", "args": { "path": "/out/b.txt", "content": "beta two\n" } },
            { "type": "read_file", "args": { "path": "notes/a.txt" } },
            { "type": "list_tree", "args": { "path": "notes" } },
            { "type": "search_files", "args": { "pattern": "beta", "path": "/" } },
            { "type": "apply_unified_diff", "args": { "diff": "--- a/notes/a.txt\n+++ b/notes/a.txt\n@@ -1,2 +1,2 @@\n alpha\n-beta\n+gamma\n" } }
        ]),
        65536,
    ));
    assert_eq!(run.failure(), "none", "{}", run.raw);
    // A leading `/` is beneath the workspace, as upstream's runner reads it.
    assert_eq!(sb.read("out/b.txt"), "beta two\n");
    assert_eq!(sb.read("notes/a.txt"), "alpha\ngamma\n");
    let up = as_upstream(&sb);
    let got: Vec<(i64, String, String)> = up
        .steps
        .unwrap()
        .into_iter()
        .map(|s| (s.index, s.step_type, s.output))
        .collect();
    assert_eq!(
        got,
        [
            (0, "run_command".into(), "hello".into()),
            (1, "write_file".into(), String::new()),
            (2, "read_file".into(), "alpha\nbeta\n".into()),
            (3, "list_tree".into(), "a.txt\n".into()),
            (
                4,
                "search_files".into(),
                "notes/a.txt:2:beta\nout/b.txt:1:beta two\n".into()
            ),
            (
                5,
                "apply_unified_diff".into(),
                "patching file notes/a.txt\n".into()
            ),
        ]
    );
}

#[test]
fn sba_runner__runner_reads_job_from_stdin_and_writes_result_to_stdout() {
    let sb = Sandbox::new();
    let job_path = sb.dir.path().join("stdin.json");
    std::fs::write(
        &job_path,
        serde_json::to_vec(&upstream_job(echo_ok(), 1024)).unwrap(),
    )
    .unwrap();
    let out_path = sb.dir.path().join("stdout.json");
    let mut cmd = sb.command();
    cmd.arg("--stdin")
        .stdin(std::fs::File::open(&job_path).unwrap())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::process::Stdio::null());
    let mut child = cynode_testkit::OwnedChild::spawn(cmd);
    let status = child
        .wait_timeout(std::time::Duration::from_secs(60))
        .expect("cynode-sba --stdin did not finish within 60 s");
    assert_eq!(status.code(), Some(0));
    let out = std::fs::read(&out_path).unwrap();
    let text = String::from_utf8_lossy(&out);
    assert!(
        text.contains("\"protocol_version\"") && text.contains("\"status\""),
        "{text}"
    );
    let up: SbaResult = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (up.status.as_str(), up.steps.unwrap()[0].output.as_str()),
        ("success", "ok\n")
    );
}

/// A failed step's `error` was an object, which upstream's
/// decoder refuses, so the whole result was lost.
#[test]
fn sba_contract__sba_result_contract_has_required_shape_for_orchestrator_storage() {
    let sb = Sandbox::new();
    let run = sb.run(&upstream_job(
        json!([
            { "type": "run_command", "args": { "argv": ["sh", "-c", "echo partial; exit 3"] } },
            { "type": "run_command", "args": { "argv": ["true"] } }
        ]),
        1024,
    ));
    assert_eq!(run.failure(), "step_failed");
    for key in ["protocol_version", "job_id", "status", "steps", "artifacts"] {
        assert!(
            run.raw.get(key).is_some(),
            "result lacks {key}: {}",
            run.raw
        );
    }
    let up = as_upstream(&sb);
    assert_eq!(
        (up.status.as_str(), up.failure_code.as_deref()),
        ("failure", Some("step_failed"))
    );
    let steps = up.steps.unwrap();
    assert_eq!(
        steps[0],
        upstream::StepResult {
            index: 0,
            step_type: "run_command".into(),
            status: "failure".into(),
            exit_code: Some(3),
            output: "partial\n".into(),
            error: "command `sh` exited with status 3".into(),
        }
    );
    assert_eq!((steps[1].index, steps[1].status.as_str()), (1, "skipped"));
    // Our own fields stay: the code beside the message, the typed result.
    assert_eq!(run.step(0)["failure_code"], "step_failed");
    assert_eq!(run.step(0)["result"]["exit_code"], 3);
}

/// Runs the echo job changed by `edit`; asserts it is refused as `schema_validation` with
/// a message starting with `prefix`.
fn refused_with(edit: impl FnOnce(&mut Value), prefix: &str) -> Sandbox {
    let sb = Sandbox::new();
    let mut job = upstream_job(echo_ok(), 1024);
    edit(&mut job);
    sb.run(&job).assert_failure("schema_validation", prefix);
    sb
}

#[test]
fn sba_contract__sba_job_spec_with_unknown_field_fails_validation() {
    let sb = refused_with(
        |j| j["steps"][0]["args"]["shell"] = true.into(),
        "steps[0].args.shell: unknown field `shell`",
    );
    // Even a refusal decodes upstream.
    assert_eq!(
        as_upstream(&sb).failure_code.as_deref(),
        Some("schema_validation")
    );
}

#[test]
fn sba_contract__sba_job_spec_with_unknown_major_protocol_version_fails_validation() {
    refused_with(
        |j| j["protocol_version"] = "99.0".into(),
        "protocol_version: ",
    );
}

#[test]
fn sba_contract__sba_job_spec_with_missing_required_job_id_fails_validation() {
    refused_with(|j| j["job_id"] = "".into(), "job_id: ");
}

#[test]
fn sba_failure_codes__result_shape_with_constraint_violation_when_output_exceeds_max_output_bytes()
{
    let sb = Sandbox::new();
    let run = sb.run(&upstream_job(
        json!([{ "type": "run_command", "args": { "argv": ["printf", "0123456789"] } }]),
        5,
    ));
    assert_eq!(
        run.result.status,
        cynode_protocol::result::JobStatus::Failure
    );
    let up = as_upstream(&sb);
    assert_eq!(
        (up.status.as_str(), up.failure_code.as_deref()),
        ("failure", Some("constraint_violation"))
    );
}

#[test]
fn sba_tools__apply_unified_diff_tool_rejects_diff_that_escapes_workspace() {
    let sb = Sandbox::new();
    let run = sb.run(&upstream_job(
        json!([{ "type": "apply_unified_diff", "args": { "diff": "--- a/../outside/secret.txt\n+++ b/../outside/secret.txt\n@@ -1 +1 @@\n-top secret\n+owned\n" } }]),
        1024,
    ));
    assert_eq!(
        run.result.status,
        cynode_protocol::result::JobStatus::Failure
    );
    run.assert_message_contains("path escapes workspace");
    assert_eq!(
        std::fs::read_to_string(sb.outside().join("secret.txt")).unwrap(),
        "top secret\n"
    );
    let up = as_upstream(&sb);
    assert!(up
        .failure_message
        .unwrap()
        .contains("path escapes workspace"));
}

#[test]
fn sba_lifecycle__when_status_url_is_set_sba_sends_in_progress_then_completion() {
    let (port, server) = crate::modes::tcp_callbacks();
    let sb = Sandbox::new();
    sb.write_job(&upstream_job(echo_ok(), 1024));
    let mut cmd = sb.command();
    cmd.env(
        "SBA_JOB_STATUS_URL",
        format!("http://127.0.0.1:{port}/status"),
    );
    let out = cynode_testkit::output_bounded(cmd, std::time::Duration::from_secs(60));
    let run: Run = sb.finish(out);
    let got = server.join().unwrap();
    let stages: Vec<Value> = got.iter().map(|(_, b)| b["status"].clone()).collect();
    assert_eq!(stages, [json!("in_progress"), json!("completed")]);
    assert_eq!(
        run.result.status,
        cynode_protocol::result::JobStatus::Success
    );
    let carried: SbaResult = serde_json::from_value(got[1].1["result"].clone()).unwrap();
    assert_eq!(carried.status, "success");
}
