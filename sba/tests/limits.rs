//! Deadlines, process cleanup and memory bounds under hostile commands.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::{job_with, process_with_arg, sh, sh_with, Sandbox};

/// Runs the binary and returns its output plus the peak RSS of the runner itself, taken
/// from wait4 on it.
#[allow(clippy::zombie_processes)] // reaped by wait4 below, which clippy cannot see
fn run_measured(sb: &Sandbox) -> (std::process::Output, u64) {
    use std::io::Read;
    let mut child = sb
        .command()
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = Vec::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_end(&mut stdout)
        .unwrap();
    let mut stderr = Vec::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_end(&mut stderr)
        .unwrap();
    let mut status = 0;
    // SAFETY: zeroed rusage filled by wait4 for our own child.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers; the pid is our child and not yet reaped.
    let rc = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut ru) };
    assert_eq!(rc, child.id() as i32);
    use std::os::unix::process::ExitStatusExt;
    let status = std::process::ExitStatus::from_raw(status);
    (
        std::process::Output {
            status,
            stdout,
            stderr,
        },
        ru.ru_maxrss as u64 * 1024,
    )
}

#[test]
fn timeout_kills_a_grandchild_that_ignores_sigterm_and_holds_the_pipe() {
    let sb = Sandbox::new();
    let marker = "973.1717";
    let script =
        format!("(trap '' TERM; exec sleep {marker}) & trap '' TERM; sleep {marker}; wait");
    sb.write_job(&sh_with(&script, json!({ "max_runtime_seconds": 2 })));
    let t = Instant::now();
    let out = sb.command().output().unwrap();
    let took = t.elapsed();
    let run = sb.finish(out);
    assert_eq!(run.failure(), "timeout");
    assert!(took < Duration::from_secs(2 + 5), "runner took {took:?}");
    assert!(
        !process_with_arg(marker),
        "a process of the step survived the runner"
    );
}

/// Runs `script` as one step, which must succeed printing `stdout` and leave no process
/// with `marker` in its command line alive; returns how long the run took.
fn runs_and_leaves_nothing(script: &str, stdout: &str, marker: &str) -> Duration {
    let sb = Sandbox::new();
    let t = Instant::now();
    let run = sb.run(&sh(script));
    let took = t.elapsed();
    assert_eq!(run.failure(), "none", "{}", run.message());
    assert_eq!(run.step(0)["result"]["stdout"], stdout);
    assert!(
        !process_with_arg(marker),
        "a process of the step survived: {script}"
    );
    took
}

#[test]
fn orphans_that_leave_the_process_group_are_reaped() {
    let marker = "871.2323";
    // setsid moves the daemon out of the step's process group; the subreaper still gets it.
    let script = format!("setsid sleep {marker} > /dev/null 2>&1 < /dev/null & echo started");
    runs_and_leaves_nothing(&script, "started\n", marker);
}

#[test]
fn a_background_process_holding_stdout_does_not_hang_the_step() {
    let marker = "655.4242";
    let took = runs_and_leaves_nothing(&format!("sleep {marker} & echo done"), "done\n", marker);
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[test]
fn one_gib_of_output_under_a_one_mib_cap_stays_small() {
    let sb = Sandbox::new();
    sb.write_job(&job_with(
        json!([{ "id": "s1", "type": "run_command", "arguments": { "command": "head", "args": ["-c", "1073741824", "/dev/zero"] } }]),
        json!({ "max_output_bytes": 1048576, "max_runtime_seconds": 120 }),
    ));
    let (out, max_rss) = run_measured(&sb);
    let run = sb.finish(out);
    assert_eq!(run.failure(), "constraint_violation");
    assert_eq!(
        run.message(),
        "step s1: output of `head` exceeded max_output_bytes: 1073741824 bytes produced, cap 1048576"
    );
    let stdout_len = run.step(0)["result"]["stdout"].as_str().unwrap().len();
    assert!(stdout_len <= 1048576 + 64, "{stdout_len}");
    assert!(
        max_rss < 64 * 1024 * 1024,
        "runner peak RSS {max_rss} bytes"
    );
}

#[test]
fn stdin_larger_than_a_pipe_buffer_is_fed_without_deadlock() {
    let sb = Sandbox::new();
    let big = "x".repeat(1024 * 1024);
    let run = sb.run(&job_with(
        json!([{ "id": "s1", "type": "run_command", "arguments": { "command": "wc", "args": ["-c"], "stdin": big } }]),
        json!({ "max_output_bytes": 4096 }),
    ));
    assert_eq!(run.failure(), "none", "{}", run.message());
    assert_eq!(
        run.step(0)["result"]["stdout"].as_str().unwrap().trim(),
        "1048576"
    );
}
