//! The deliverable is the PM's evidence report: the real `cynode-pm`, a real
//! local `cynode-worker` (bwrap) running the real SBA, and a scripted model. The report
//! lists each task's jobs with their skill, each step's outcome (exit code, first lines,
//! tree entries, matches) and the verified artifacts, then the model's summary; `run`
//! and `sessions show` print it for a person, `--output json` carries it.

use std::process::Command;

use cynode_testkit::output_bounded;
use cynode_tests::pm::{pm_command, PM_LIMIT};
use cynode_tests::{model_server, session_id, workspace_root};
use serde_json::{json, Value};

/// Writes hello.txt (t1), inspects the tree and reads it back (t2), searches for it
/// (t3), then finishes with `summary`.
fn three_tasks(summary: &str) -> Vec<Value> {
    vec![
        json!({ "type": "plan_update", "state_patch": [
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t1", "description": "write the greeting", "status": "pending" } },
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t2", "description": "look at the tree", "status": "pending" } },
            { "op": "add", "path": "/plan/-", "value": { "task_id": "t3", "description": "find the greeting", "status": "pending" } }
        ], "payload": { "note": "three tasks" } }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t1", "skill_id": "write-files",
            "inputs": { "files": [{ "path": "hello.txt", "content": "hello from the model\nsecond line\n" }] } } }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t2", "skill_id": "repo-inspect",
            "inputs": { "files": ["hello.txt"] } } }),
        json!({ "type": "job_request", "state_patch": [], "payload": { "task_id": "t3", "skill_id": "search-code",
            "inputs": { "pattern": "hello" } } }),
        json!({ "type": "final", "state_patch": [], "payload": { "summary": summary } }),
    ]
}

fn human(cmd: &mut Command) {
    // pm_command asks for JSON; the human form is the same command without it.
    let args: Vec<_> = cmd.get_args().map(|a| a.to_owned()).collect();
    let mut plain = Command::new(cmd.get_program());
    plain
        .args(args.iter().skip(2))
        .current_dir(workspace_root());
    *cmd = plain;
}

#[test]
fn the_deliverable_is_the_evidence_report() {
    let state = cynode_tests::tempdir().unwrap();
    let (url, model) = model_server(three_tasks("wrote, inspected and found the greeting"));
    let mut cmd = pm_command(state.path(), &url, &["run", "greet and check"], &[]);
    human(&mut cmd);
    let out = output_bounded(cmd, PM_LIMIT);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(model.requests().len(), 5);
    for needle in [
        "deliverable (evidence verified by the PM):",
        "task t1 [done]: write the greeting",
        "skill write-files attempt 1: completed",
        "task t2 [done]: look at the tree",
        "skill repo-inspect attempt 1: completed",
        "list_tree: success, ",
        "      | hello from the model",
        "artifact hello.txt sha256:",
        "task t3 [done]: find the greeting",
        "skill search-code attempt 1: completed",
        "      at hello.txt:1",
        "model's summary: wrote, inspected and found the greeting",
    ] {
        assert!(
            stdout.contains(needle),
            "{needle:?} missing from:\n{stdout}"
        );
    }
    // The summary comes last: the model's words follow the evidence.
    assert!(
        stdout
            .trim_end()
            .ends_with("model's summary: wrote, inspected and found the greeting"),
        "{stdout}"
    );

    // `sessions show` prints the same report for a person, and JSON carries it.
    let id = session_id(&out);
    let state_arg = state.path().display().to_string();
    let mut show = Command::new(cynode_tests::bin("cynode-pm"));
    show.args(["sessions", "show", &id, "--state-dir", &state_arg]);
    let shown = output_bounded(show, PM_LIMIT);
    let text = String::from_utf8_lossy(&shown.stdout).to_string();
    assert_eq!(shown.status.code(), Some(0), "{text}");
    assert!(text.contains(&format!("session {id}: completed")), "{text}");
    assert!(text.contains("skill repo-inspect attempt 1"), "{text}");
    assert!(text.contains("artifact hello.txt sha256:"), "{text}");

    let mut show = Command::new(cynode_tests::bin("cynode-pm"));
    show.args([
        "--output",
        "json",
        "sessions",
        "show",
        &id,
        "--state-dir",
        &state_arg,
    ]);
    let v: Value = serde_json::from_slice(&output_bounded(show, PM_LIMIT).stdout).unwrap();
    let report = &v["deliverable"]["report"];
    assert_eq!(v["report"], *report);
    let tasks = report["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 3, "{report}");
    let inspect = &tasks[1]["jobs"][0];
    assert_eq!(inspect["skill_id"], "repo-inspect");
    let tree = &inspect["steps"][0];
    assert_eq!(tree["type"], "list_tree");
    assert!(tree["tree_entries"].as_u64().unwrap() >= 1, "{tree}");
    let read = &inspect["steps"][1];
    assert_eq!(read["output_head"][0], "hello from the model", "{read}");
    let artifact = &inspect["artifacts"][0];
    assert_eq!(artifact["path"], "hello.txt");
    let stored = &v["state"]["artifacts"][0]["sha256"];
    assert_eq!(
        artifact["sha256"], *stored,
        "the verified artifact's sha256"
    );
    let search = &tasks[2]["jobs"][0]["steps"][0];
    assert!(search["matches"].as_u64().unwrap() >= 1, "{search}");
    assert_eq!(report["summary"], "wrote, inspected and found the greeting");
}
