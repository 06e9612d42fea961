//! Each stable failure code, produced for real, with both failure shapes in agreement.

use serde_json::json;

use crate::harness::{job_with, one, sh, sh_with, Sandbox};

fn assert_failure_shapes(run: &crate::harness::Run, code: &str) {
    assert_eq!(run.failure(), code, "{}", run.message());
    assert_eq!(run.raw["error"]["type"], code);
    assert_eq!(run.raw["error"]["message"], run.raw["failure_message"]);
    assert_eq!(run.code, Some(1));
}

#[test]
fn schema_validation_on_malformed_json() {
    let sb = Sandbox::new();
    std::fs::write(sb.job_dir().join("job.json"), "{ not json").unwrap();
    let run = sb.finish(sb.command().output().unwrap());
    assert_failure_shapes(&run, "schema_validation");
    assert_eq!(run.result.steps, vec![]);
}

#[test]
fn schema_validation_names_the_field() {
    let sb = Sandbox::new();
    let mut j = one("run_command", json!({ "command": "true" }));
    j["protocol_version"] = json!("99.0");
    let run = sb.run(&j);
    assert_failure_shapes(&run, "schema_validation");
    assert_eq!(
        run.message(),
        "protocol_version: unsupported major version 99: this runner reads protocol 1.x"
    );
    // The rejection still names the job it rejects.
    assert_eq!(run.result.job_id, "job-1");

    let mut j = one("run_command", json!({ "command": "true", "shell": true }));
    j["job_id"] = json!("job-2");
    let run = sb.run(&j);
    assert_failure_shapes(&run, "schema_validation");
    run.assert_message_starts_with("steps[0].arguments.shell: unknown field `shell`");

    let run = sb.run(&job_with(
        json!([{ "id": "s1", "type": "run_command", "arguments": { "command": "true" } }]),
        json!({ "max_runtime_seconds": 0 }),
    ));
    assert_eq!(
        run.message(),
        "constraints.max_runtime_seconds: must be positive"
    );
}

#[test]
fn schema_validation_when_job_file_is_missing() {
    let sb = Sandbox::new();
    let run = sb.finish(sb.command().output().unwrap());
    assert_failure_shapes(&run, "schema_validation");
    run.assert_message_starts_with("cannot read job from");
}

#[test]
fn policy_violation_for_disallowed_command() {
    let run = Sandbox::run_once(&job_with(
        json!([{ "id": "s1", "type": "run_command", "arguments": { "command": "/bin/cat", "args": ["/etc/hostname"] } }]),
        json!({ "allowed_commands": ["echo", "git"] }),
    ));
    assert_failure_shapes(&run, "policy_violation");
    // Refused before it started: no result output.
    run.assert_refused_before_start(
        "step s1: command `/bin/cat` is not in constraints.allowed_commands",
    );
}

#[test]
fn step_failed_and_execution_failure() {
    let sb = Sandbox::new();
    let run = sb.run(&one(
        "run_command",
        json!({ "command": "definitely-not-a-command-xyz" }),
    ));
    assert_failure_shapes(&run, "execution_failure");
    assert_eq!(
        run.message(),
        "step s1: cannot start `definitely-not-a-command-xyz`: no such file or directory"
    );
    let run = sb.run(&one("run_command", json!({ "command": "false" })));
    assert_failure_shapes(&run, "step_failed");
}

#[test]
fn timeout_on_the_job_deadline() {
    let run = Sandbox::run_once(&job_with(
        json!([
            { "id": "s1", "type": "run_command", "arguments": { "command": "sleep", "args": ["60"] } },
            { "id": "s2", "type": "run_command", "arguments": { "command": "true" } }
        ]),
        json!({ "max_runtime_seconds": 1 }),
    ));
    assert_failure_shapes(&run, "timeout");
    assert_eq!(run.raw["status"], "timeout");
    assert_eq!(
        run.message(),
        "step s1: job deadline of 1s (constraints.max_runtime_seconds) reached"
    );
    assert_eq!(run.step(0)["status"], "timeout");
    assert_eq!(run.step(1)["status"], "skipped");
}

#[test]
fn constraint_violation_when_output_exceeds_the_cap() {
    let run = Sandbox::run_once(&sh_with(
        "yes 0123456789 | head -c 100000",
        json!({ "max_output_bytes": 1000 }),
    ));
    assert_failure_shapes(&run, "constraint_violation");
    assert_eq!(
        run.message(),
        "step s1: output of `sh` exceeded max_output_bytes: 100000 bytes produced, cap 1000"
    );
    let out = run.step(0)["result"]["stdout"].as_str().unwrap();
    assert!(out.starts_with("0123456789\n"), "{out}");
    assert!(out.contains("...[99000 bytes dropped]..."), "{out}");
    assert_eq!(run.step(0)["result"]["truncated"], true);
    // The exit code of the command itself is still reported.
    assert_eq!(run.step(0)["result"]["exit_code"], 0);
}

#[test]
fn resource_limit_exceeded_when_killed_by_sigkill() {
    let sb = Sandbox::new();
    // What the kernel's OOM killer or a pids/memory limit does to a step: SIGKILL.
    let run = sb.run(&sh("kill -KILL $$"));
    assert_failure_shapes(&run, "resource_limit_exceeded");
    assert_eq!(run.step(0)["result"]["exit_code"], json!(null));
    assert_eq!(run.step(0)["result"]["signal"], 9);
}

#[test]
fn ext_net_required_when_a_lookup_fails_without_network() {
    let sb = Sandbox::new();
    let run = sb.run(&sh(
        "echo 'fatal: unable to access: Could not resolve host: example.invalid' >&2; exit 128",
    ));
    assert_failure_shapes(&run, "ext_net_required");
    // With network allowed the same failure is an ordinary step failure.
    let run = sb.run(&sh_with(
        "echo 'Could not resolve host: x' >&2; exit 128",
        json!({ "ext_net_allowed": true }),
    ));
    assert_failure_shapes(&run, "step_failed");
}

#[test]
fn internal_error_when_the_runner_is_terminated() {
    let sb = Sandbox::new();
    let started = sb.ws().join("started");
    sb.write_job(&sh("touch started; exec sleep 30"));
    let mut child = cynode_testkit::OwnedChild::spawn(sb.command());
    assert!(crate::harness::wait_for_file(
        &started,
        std::time::Duration::from_secs(10)
    ));
    let t = std::time::Instant::now();
    child.signal(libc::SIGTERM);
    let status = child
        .wait_timeout(std::time::Duration::from_secs(30))
        .expect("the runner did not exit within 30 s of SIGTERM");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        t.elapsed()
    );
    let run = sb.finish(std::process::Output {
        status,
        stdout: vec![],
        stderr: vec![],
    });
    assert_failure_shapes(&run, "internal_error");
    assert_eq!(run.message(), "step s1: runner interrupted by SIGTERM");
    assert_eq!(run.step(0)["status"], "failure");
    assert!(!run.result.finished_at.is_empty());
}

#[test]
fn refuses_uid_0_without_allow_root() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        // As a normal user the refusal cannot trigger; the run must succeed instead.
        let sb = Sandbox::new();
        sb.write_job(&one("run_command", json!({ "command": "true" })));
        let out = sb.command().output().unwrap();
        assert_eq!(out.status.code(), Some(0));
        return;
    }
    let sb = Sandbox::new();
    sb.write_job(&one(
        "run_command",
        json!({ "command": "touch", "args": ["ran"] }),
    ));
    let run = sb.finish(sb.command_as(false).output().unwrap());
    assert_failure_shapes(&run, "policy_violation");
    assert_eq!(
        run.message(),
        "refusing to run as uid 0: run as a non-root user or pass --allow-root"
    );
    assert!(!sb.ws().join("ran").exists());
}
