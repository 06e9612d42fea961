//! The command line as a user meets it: the real `cynode-pm` binary with its stdout
//! closed by the reader (`cynode-pm … | head`), and the layout of `--help`.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use cynode_testkit::OwnedChild;

const LIMIT: Duration = Duration::from_secs(60);

fn pm_bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_cynode-pm"))
}

/// Runs `cynode-pm args…` from `dir` with its stdout a pipe whose read end is already
/// closed (the reader went away before the first byte: every write fails with EPIPE, no
/// race with the pipe's buffer); returns the exit code and stderr.
fn with_stdout_closed(dir: &Path, args: &[&str]) -> (Option<i32>, String) {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut cmd = pm_bin();
    cmd.args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped());
    let mut child = OwnedChild::spawn(cmd);
    let mut stderr = child.child_mut().stderr.take().unwrap();
    let reading = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let status = child
        .wait_timeout(LIMIT)
        .unwrap_or_else(|| panic!("cynode-pm {args:?} did not finish within {LIMIT:?}"));
    child.kill();
    (status.code(), reading.join().unwrap())
}

/// Every command that prints to stdout, in both output forms: a closed stdout ends it
/// with status 0 and nothing on stderr (no panic, no "Broken pipe", no backtrace).
#[test]
fn a_closed_stdout_ends_every_printing_command_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let inputs = root.join("skills/search-code/examples/basic.json");
    let inputs = inputs.to_str().unwrap();
    // A job for `policy check`, rendered by the binary itself.
    let mut render = pm_bin();
    render
        .args(["skills", "render", "search-code", "--inputs", inputs])
        .current_dir(dir.path());
    let out = cynode_testkit::output_bounded(render, LIMIT);
    assert!(out.status.success(), "{out:?}");
    let job = dir.path().join("job.json");
    std::fs::write(&job, &out.stdout).unwrap();
    let job = job.to_str().unwrap();
    let state = dir.path().join("state");
    let state = state.to_str().unwrap();
    // An empty store: `sessions list` prints `[]`, `sessions show` an error.
    let session = {
        let mut list = pm_bin();
        list.args(["--output", "json", "sessions", "list", "--state-dir", state])
            .current_dir(dir.path());
        let out = cynode_testkit::output_bounded(list, LIMIT);
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(session.trim(), "[]");
    let commands: &[&[&str]] = &[
        &["openapi"],
        &["skills", "list"],
        &["skills", "show", "search-code"],
        &["skills", "validate"],
        &["skills", "contract"],
        &["skills", "render", "search-code", "--inputs", inputs],
        &["policy", "check", job],
        &["sessions", "list", "--state-dir", state],
        // An error report is printed to stdout in JSON form.
        &["sessions", "show", "s-none", "--state-dir", state],
    ];
    for args in commands {
        for json in [false, true] {
            let mut all: Vec<&str> = if json {
                vec!["--output", "json"]
            } else {
                vec![]
            };
            all.extend_from_slice(args);
            if !json && args[0] == "sessions" && args[1] == "list" {
                // Human `sessions list` of an empty store prints nothing at all.
                continue;
            }
            let (code, stderr) = with_stdout_closed(dir.path(), &all);
            assert!(
                !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
                "cynode-pm {all:?}: {stderr}"
            );
            // Human `sessions show` of an unknown id says so on stderr and exits 2,
            // printing nothing to stdout.
            if !json && args[0] == "sessions" && args[1] == "show" {
                assert_eq!(code, Some(2), "cynode-pm {all:?}: {stderr}");
                continue;
            }
            assert_eq!(code, Some(0), "cynode-pm {all:?}: {stderr}");
            assert_eq!(stderr, "", "cynode-pm {all:?}");
        }
    }
}

/// `run --help` lists the command's own options first and the global ones last, under
/// headings of their own.
#[test]
fn run_help_groups_options_under_headings() {
    let mut cmd = pm_bin();
    cmd.args(["run", "--help"]);
    let out = cynode_testkit::output_bounded(cmd, LIMIT);
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8_lossy(&out.stdout);
    // Each option line (`  --flag …` or `  -x, --flag …`) with the heading it sits under.
    let mut heading = String::new();
    let mut under = std::collections::BTreeMap::<String, String>::new();
    let mut order = Vec::<String>::new();
    for line in help.lines() {
        if !line.starts_with(' ') && line.ends_with(':') {
            heading = line.trim_end_matches(':').to_string();
            order.push(heading.clone());
        } else if let Some(flag) = line
            .trim_start()
            .split([' ', ','])
            .find(|w| w.starts_with("--"))
        {
            if line.starts_with("  ") && !line.starts_with("          ") {
                under.insert(flag.to_string(), heading.clone());
            }
        }
    }
    let expect = [
        ("--workspace", "Options"),
        ("--non-interactive", "Options"),
        ("--model-base-url", "Model"),
        ("--model-timeout-seconds", "Model"),
        ("--worker-endpoint", "Worker"),
        ("--sandbox-image", "Worker"),
        ("--local-backend", "Local worker"),
        ("--state-dir", "State"),
        ("--max-turns", "Session"),
        ("--skill-dir", "Skills & policy"),
        ("--policy-endpoint", "Skills & policy"),
        ("--output", "Global options"),
        ("--otlp-endpoint", "Global options"),
    ];
    for (flag, h) in expect {
        assert_eq!(
            under.get(flag).map(String::as_str),
            Some(h),
            "{flag} in:\n{help}"
        );
    }
    let pos = |h: &str| {
        order
            .iter()
            .position(|o| o == h)
            .unwrap_or_else(|| panic!("no {h}:\n{help}"))
    };
    assert!(pos("Options") < pos("Model"), "{help}");
    assert!(pos("Model") < pos("Global options"), "{help}");
    assert_eq!(
        order.last().map(String::as_str),
        Some("Global options"),
        "{help}"
    );
}
