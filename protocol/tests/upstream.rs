//! Upstream CyNodeAI's shapes (fixtures/upstream/, copied field for field from its Go
//! types at the commit its README names) read with this project's types: its requests
//! and job.json are accepted as documented second forms, its responses are read
//! tolerantly, and the job.json this project sends an upstream
//! worker passes upstream's own strict decoder (cynode_testkit::upstream). Tests named
//! `<feature>__<scenario>` follow upstream's BDD features.
#![allow(non_snake_case)]

use std::path::PathBuf;

use cynode_protocol::job::{
    ApplyUnifiedDiffArgs, ExecutionMode, JobSpec, ListTreeArgs, ReadFileArgs, RunCommandArgs,
    SearchFilesArgs, StepAction, WriteFileArgs,
};
use cynode_protocol::result::{ArtifactRecord, JobStatus, StepStatus};
use cynode_protocol::worker_api::{RunJobRequest, RunJobResponse, WorkerJobStatus};
use cynode_protocol::FailureCode;
use cynode_testkit::upstream;
use serde_json::{json, Value};

fn fixture(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/upstream")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The field path of the first error our strict parser reports for `v`.
fn first_error_path(v: &Value) -> String {
    JobSpec::from_json(v.to_string().as_bytes())
        .unwrap_err()
        .first()
        .unwrap()
        .path
        .clone()
}

#[test]
fn fixtures_name_their_upstream_commit() {
    assert!(fixture("README.md").contains(upstream::UPSTREAM_COMMIT));
}

#[test]
fn worker_node_sba__an_upstream_sba_dispatch_with_command_null_parses_and_validates() {
    let req: RunJobRequest =
        serde_json::from_str(&fixture("run_job_request_sba_agent.json")).unwrap();
    req.validate().unwrap();
    assert!(req.sandbox.command.is_empty());
    assert_eq!(req.sandbox.image, "cynodeai-cynode-sba:dev");
    let job = JobSpec::from_json(req.sandbox.job_spec_json.unwrap().as_bytes()).unwrap();
    assert_eq!(job.effective_mode(), ExecutionMode::AgentInference);
    assert_eq!(job.inference.unwrap().allowed_models, ["qwen3.5:0.8b"]);
    assert_eq!(
        job.context.unwrap().task_context,
        "Reply back with the current time"
    );
}

#[test]
fn worker_node_sandbox_execution__a_prompt_mode_request_parses_and_validates() {
    let req: RunJobRequest =
        serde_json::from_str(&fixture("run_job_request_prompt_mode.json")).unwrap();
    req.validate().unwrap();
    assert_eq!(req.sandbox.use_inference, Some(true));
    assert_eq!(req.sandbox.env["CYNODE_PROMPT"], "say hi");
}

#[test]
fn sba_contract__valid_sba_job_spec_with_supported_protocol_version_passes_validation() {
    let text = fixture("job_direct_steps.json");
    // Upstream's own strict decoder accepts the fixture, and so do we.
    upstream::parse_and_validate_job_spec(text.as_bytes()).unwrap();
    let job = JobSpec::from_json(text.as_bytes()).unwrap();
    let steps: Vec<(String, StepAction)> =
        job.steps.into_iter().map(|s| (s.id, s.action)).collect();
    assert_eq!(
        steps,
        [
            (
                "step-1".to_string(),
                StepAction::RunCommand(RunCommandArgs {
                    command: "echo".into(),
                    args: vec!["ok".into()],
                    working_dir: Some("src".into()),
                    ..Default::default()
                })
            ),
            (
                "step-2".to_string(),
                StepAction::WriteFile(WriteFileArgs {
                    path: "notes/hello.txt".into(),
                    content: "hello\n".into(),
                    ..Default::default()
                })
            ),
            (
                "step-3".to_string(),
                StepAction::ReadFile(ReadFileArgs {
                    path: "notes/hello.txt".into(),
                    max_bytes: None
                })
            ),
            (
                "step-4".to_string(),
                StepAction::ApplyUnifiedDiff(ApplyUnifiedDiffArgs {
                    diff: "--- a/notes/hello.txt\n+++ b/notes/hello.txt\n@@ -1 +1 @@\n-hello\n+hello, world\n".into()
                })
            ),
            ("step-5".to_string(), StepAction::ListTree(ListTreeArgs::default())),
            (
                "step-6".to_string(),
                StepAction::SearchFiles(SearchFilesArgs {
                    pattern: "hello".into(),
                    path: Some("notes".into()),
                    include: Some("*.txt".into())
                })
            ),
        ]
    );
}

#[test]
fn sba_contract__sba_job_spec_with_unknown_field_fails_validation() {
    let mut v: Value = serde_json::from_str(&fixture("job_direct_steps.json")).unwrap();
    v["steps"][0]["args"]["timeout"] = 5.into();
    assert_eq!(first_error_path(&v), "steps[0].args.timeout");
    let mut v: Value = serde_json::from_str(&fixture("job_direct_steps.json")).unwrap();
    v["surprise"] = true.into();
    assert_eq!(first_error_path(&v), "surprise");
}

#[test]
fn sba_contract__sba_job_spec_with_unknown_major_protocol_version_fails_validation() {
    let mut v: Value = serde_json::from_str(&fixture("job_direct_steps.json")).unwrap();
    v["protocol_version"] = "99.0".into();
    assert_eq!(first_error_path(&v), "protocol_version");
    assert!(upstream::parse_and_validate_job_spec(v.to_string().as_bytes()).is_err());
}

#[test]
fn sba_contract__sba_job_spec_with_missing_required_job_id_fails_validation() {
    let mut v: Value = serde_json::from_str(&fixture("job_direct_steps.json")).unwrap();
    v["job_id"] = "".into();
    assert_eq!(first_error_path(&v), "job_id");
}

/// Item 12: `exit_code` omitted when 0, `run_diagnostics` and `inference_used` unknown
/// to us, `artifacts: null`, no `task_id`, timestamps, resource usage or step ids.
#[test]
fn upstream_responses_are_read_tolerantly() {
    let r: RunJobResponse =
        serde_json::from_str(&fixture("run_job_response_sba_direct.json")).unwrap();
    assert_eq!((r.status, r.exit_code), (WorkerJobStatus::Completed, 0));
    let sba = r.sba_result.unwrap();
    assert_eq!(sba.status, JobStatus::Success);
    assert_eq!((sba.task_id.as_str(), sba.started_at.as_str()), ("", ""));
    assert!(sba.artifacts.is_empty());
    let s: Vec<(u64, StepStatus, String, Option<i32>)> = sba
        .steps
        .iter()
        .map(|s| (s.index, s.status, s.output.clone(), s.exit_code))
        .collect();
    assert_eq!(
        s,
        [
            (0, StepStatus::Success, "ok\n".to_string(), None),
            (1, StepStatus::Success, String::new(), None)
        ]
    );

    let r: RunJobResponse =
        serde_json::from_str(&fixture("run_job_response_sba_step_failed.json")).unwrap();
    assert_eq!((r.status, r.exit_code), (WorkerJobStatus::Failed, 1));
    let sba = r.sba_result.unwrap();
    assert_eq!(sba.failure_code, Some(FailureCode::StepFailed));
    let step = &sba.steps[0];
    assert_eq!(
        (step.exit_code, step.error.as_deref(), step.failure_code),
        (Some(3), Some("exit status 3"), None)
    );
    assert_eq!(
        sba.artifacts,
        [ArtifactRecord {
            path: "report.txt".into(),
            sha256: String::new(),
            size_bytes: 0
        }]
    );

    let r: RunJobResponse =
        serde_json::from_str(&fixture("run_job_response_timeout.json")).unwrap();
    assert_eq!(
        (r.status, r.exit_code, r.sba_result.is_none()),
        (WorkerJobStatus::Timeout, -1, true)
    );
}

/// A result.json written before the upstream alignment (`steps[].error` an object) still
/// reads: as the message with its code in front.
#[test]
fn a_legacy_step_error_object_still_reads() {
    let r: cynode_protocol::JobResult = serde_json::from_value(json!({
        "protocol_version": "1.0", "job_id": "j", "status": "failure",
        "steps": [{ "id": "a", "type": "run_command", "status": "failure",
                    "error": { "type": "step_failed", "message": "boom" } }]
    }))
    .unwrap();
    assert_eq!(r.steps[0].error.as_deref(), Some("step_failed: boom"));
}

/// Our inputs stay strict: a request or a job with a field we do not know is refused.
#[test]
fn our_inputs_stay_strict() {
    let mut v: Value = serde_json::from_str(&fixture("run_job_request_prompt_mode.json")).unwrap();
    v["sandbox"]["run_diagnostics"] = json!({});
    assert!(serde_json::from_value::<RunJobRequest>(v).is_err());
    let mut v: Value = serde_json::from_str(&fixture("run_job_request_prompt_mode.json")).unwrap();
    v["priority"] = 1.into();
    assert!(serde_json::from_value::<RunJobRequest>(v).is_err());
}

/// The job.json this project sends an upstream worker passes upstream's strict decoder
/// (`ParseAndValidateJobSpec`) and reads back as the same steps.
#[test]
fn a_job_for_an_upstream_worker_passes_upstreams_strict_decoder() {
    let ours = json!({
        "protocol_version": "1.0", "job_id": "j-1", "task_id": "t-1", "skill_id": "go-test",
        "constraints": { "max_runtime_seconds": 60, "max_output_bytes": 4096,
                         "allowed_commands": ["go"], "allowed_paths": ["/workspace"], "allow_overwrite": true },
        "artifacts": ["out/**"],
        "context": { "task_context": "test it", "preferences": { "style": "terse", "depth": 2 }, "skills": null },
        "steps": [
            { "id": "test", "type": "run_command", "arguments": { "command": "go", "args": ["test", "./..."],
              "working_dir": "/workspace/mod", "env": { "GOFLAGS": "-mod=mod" }, "timeout_seconds": 30 } },
            { "id": "w", "type": "write_file", "arguments": { "path": "a.txt", "content": "x", "mode": "0644" } },
            { "id": "r", "type": "read_file", "arguments": { "path": "a.txt", "max_bytes": 10 } },
            { "id": "d", "type": "apply_unified_diff", "arguments": { "diff": "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-x\n+y\n" } },
            { "id": "t", "type": "list_tree", "arguments": { "path": ".", "max_depth": 2 } },
            { "id": "s", "type": "search_files", "arguments": { "pattern": "y", "include": "*.txt" } }
        ]
    });
    let job = JobSpec::from_json(ours.to_string().as_bytes()).unwrap();
    let up = serde_json::to_vec(&job.to_upstream().unwrap()).unwrap();
    let parsed = upstream::parse_and_validate_job_spec(&up)
        .unwrap_or_else(|e| panic!("{e}\n{}", String::from_utf8_lossy(&up)));
    assert_eq!(
        parsed.context.unwrap().preferences.unwrap()["depth"],
        "2",
        "non-string preferences go as their JSON text"
    );
    assert_eq!(
        parsed.steps.unwrap()[0].args,
        Some(json!({ "argv": ["env", "GOFLAGS=-mod=mod", "go", "test", "./..."], "cwd": "mod" }))
    );
    let back = JobSpec::from_json(&up).unwrap();
    let types: Vec<&str> = back
        .steps
        .iter()
        .map(|s| s.action.step_type().as_str())
        .collect();
    assert_eq!(
        types,
        [
            "run_command",
            "write_file",
            "read_file",
            "apply_unified_diff",
            "list_tree",
            "search_files"
        ]
    );
}

#[test]
fn what_upstream_cannot_express_is_named() {
    let job = JobSpec::from_json(
        json!({
            "protocol_version": "1.0", "job_id": "j", "task_id": "t",
            "constraints": { "max_runtime_seconds": 5, "max_output_bytes": 5 },
            "steps": [
                { "id": "a", "type": "run_command", "arguments": { "command": "cat", "stdin": "x" } },
                { "id": "b", "type": "write_file", "arguments": { "path": "b", "content": "eA==", "encoding": "base64" } }
            ]
        })
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    let e = job.to_upstream().unwrap_err();
    let paths: Vec<&str> = e.0.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(
        paths,
        ["steps[0].arguments.stdin", "steps[1].arguments.encoding"]
    );
}

fn phase2(name: &str) -> String {
    fixture(&format!("d59af45/{name}"))
}

#[test]
fn phase2_fixtures_name_their_upstream_commit() {
    assert!(phase2("README.md").contains("d59af459d26da045427bd471053201b22258e68f"));
}

/// Upstream `mvp/phase-2` (d59af45): job.json's context carries the agent persona.
#[test]
fn phase2__a_job_context_with_a_persona_is_read_and_written_back() {
    let text = phase2("job_context_persona.json");
    let job = JobSpec::from_json(text.as_bytes()).unwrap();
    let ctx = job.context.clone().unwrap();
    assert_eq!(ctx.persona_title, "Release engineer");
    assert_eq!(
        ctx.persona_description,
        "Careful, terse; verifies every claim against the repository."
    );
    assert_eq!(ctx.baseline_context, "You run inside a CyNode sandbox.");
    let ours: Value = serde_json::to_value(&job).unwrap();
    assert_eq!(ours["context"]["persona_title"], "Release engineer");
    let theirs = job.to_upstream().unwrap();
    assert_eq!(theirs["context"]["persona_title"], "Release engineer");
    assert_eq!(
        theirs["context"]["persona_description"],
        ctx.persona_description
    );
    // Without a persona, neither field is written.
    let mut plain = job;
    if let Some(c) = plain.context.as_mut() {
        c.persona_title.clear();
        c.persona_description.clear();
    }
    let v = serde_json::to_value(&plain).unwrap();
    assert!(v["context"].get("persona_title").is_none(), "{v}");
}

/// Upstream `mvp/phase-2`: `sandbox.network_policy` is empty, none, restricted or allow.
#[test]
fn phase2__network_policy_none_restricted_and_allow_are_read() {
    for p in ["none", "restricted", "allow"] {
        let text = phase2(&format!("run_job_request_network_policy_{p}.json"));
        let req: RunJobRequest = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{p}: {e}"));
        let back = serde_json::to_value(req.sandbox.network_policy).unwrap();
        assert_eq!(back, json!(p));
    }
}

/// Upstream `mvp/phase-2`: `exit_code` is a `*int`; a `null` reads as "no exit code" (-1).
#[test]
fn phase2__a_response_with_exit_code_null_reads_as_no_exit_code() {
    let resp: RunJobResponse =
        serde_json::from_str(&phase2("run_job_response_exit_code_null.json")).unwrap();
    assert_eq!(resp.exit_code, -1);
    assert_eq!(resp.status, WorkerJobStatus::Failed);
}
