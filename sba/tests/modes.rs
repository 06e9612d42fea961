//! Stdin mode, env overrides, exit codes and lifecycle callbacks over real sockets.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::process::Stdio;
use std::thread::JoinHandle;

use serde_json::{json, Value};

use crate::harness::{one, sba_bin, Sandbox};

#[test]
fn stdin_mode_prints_the_result_and_logs_on_stderr() {
    let sb = Sandbox::new();
    let job = one("run_command", json!({ "command": "echo", "args": ["hi"] }));
    let mut cmd = std::process::Command::new(sba_bin());
    cmd.args(["--stdin", "--allow-root", "--workspace"])
        .arg(sb.ws())
        .arg("--artifacts")
        .arg(sb.artifacts())
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::piped());
    let out = cynode_testkit::output_bounded_with_input(
        cmd,
        &serde_json::to_vec(&job).unwrap(),
        std::time::Duration::from_secs(60),
    );
    assert_eq!(out.status.code(), Some(0));
    let result: cynode_protocol::JobResult = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(result.status, cynode_protocol::result::JobStatus::Success);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(!stderr.is_empty());
    for line in stderr.lines() {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["level"].is_string(), "{line}");
    }
    assert!(!sb.result_path().exists());
}

#[test]
fn env_overrides_replace_flags() {
    let sb = Sandbox::new();
    let job_path = sb.dir.path().join("elsewhere.json");
    let result_path = sb.dir.path().join("out.json");
    std::fs::write(
        &job_path,
        serde_json::to_vec(&one("run_command", json!({ "command": "true" }))).unwrap(),
    )
    .unwrap();
    let out = std::process::Command::new(sba_bin())
        .arg("--allow-root")
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("SBA_JOB_PATH", &job_path)
        .env("SBA_RESULT_PATH", &result_path)
        .env("SBA_WORKSPACE", sb.ws())
        .env("SBA_ARTIFACTS_DIR", sb.artifacts())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let result: cynode_protocol::JobResult =
        serde_json::from_slice(&std::fs::read(&result_path).unwrap()).unwrap();
    assert_eq!(result.job_id, "job-1");
}

#[test]
fn file_mode_logs_json_lines_on_stdout() {
    let run = Sandbox::run_once(&one("run_command", json!({ "command": "true" })));
    let stdout = String::from_utf8(run.output.stdout.clone()).unwrap();
    let messages: Vec<String> = stdout
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["fields"]["message"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(messages, ["job validated", "step finished", "job finished"]);
}

/// Upstream CyNodeAI: `steps: []` without `inference` is valid, a job with nothing to do.
#[test]
fn no_steps_and_no_inference_is_a_job_with_nothing_to_do() {
    let sb = Sandbox::new();
    let mut job = one("run_command", json!({ "command": "true" }));
    job["steps"] = json!([]);
    let run = sb.run(&job);
    assert_eq!(
        (run.code, run.failure(), run.result.steps.len()),
        (Some(0), "none".to_string(), 0),
        "{}",
        run.raw
    );
}

#[test]
fn exit_2_when_no_result_can_be_written() {
    let sb = Sandbox::new();
    sb.write_job(&one("run_command", json!({ "command": "true" })));
    let out = sb
        .command()
        .arg("--result")
        .arg(sb.dir.path().join("missing-dir/result.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// Serves the runner's two lifecycle callbacks (in progress, then the end) from a thread,
/// each on what `accept` yields; joined, it gives each one's request line and body.
pub(crate) fn two_callbacks<S: Read + Write + Send + 'static>(
    mut accept: impl FnMut() -> S + Send + 'static,
) -> JoinHandle<Vec<(String, Value)>> {
    std::thread::spawn(move || (0..2).map(|_| serve_one(accept())).collect())
}

/// [`two_callbacks`] on a TCP port of 127.0.0.1: the port and the server.
pub(crate) fn tcp_callbacks() -> (u16, JoinHandle<Vec<(String, Value)>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    (port, two_callbacks(move || listener.accept().unwrap().0))
}

/// Reads one HTTP request from `stream`, answers 200, returns the JSON body.
pub(crate) fn serve_one<S: Read + Write>(stream: S) -> (String, Value) {
    let mut reader = BufReader::new(stream);
    let mut request_line = String::new();
    reader.read_line(&mut request_line).unwrap();
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if line == "\r\n" || line.is_empty() {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap();
        }
    }
    let mut body = vec![0; len];
    reader.read_exact(&mut body).unwrap();
    let mut stream = reader.into_inner();
    stream
        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        .unwrap();
    (request_line, serde_json::from_slice(&body).unwrap())
}

#[test]
fn lifecycle_callbacks_reach_a_real_http_listener() {
    let (port, server) = tcp_callbacks();
    let sb = Sandbox::new();
    let url = format!("http://127.0.0.1:{port}/v1/jobs/job-1/status");
    let run = sb.run_env(
        &one("run_command", json!({ "command": "echo", "args": ["x"] })),
        &[("SBA_JOB_STATUS_URL", &url)],
    );
    let got = server.join().unwrap();
    assert_eq!(got[0].0.trim_end(), "POST /v1/jobs/job-1/status HTTP/1.1");
    assert_eq!(
        got[0].1,
        json!({ "status": "in_progress", "job_id": "job-1" })
    );
    assert_eq!(got[1].1["status"], "completed");
    assert_eq!(got[1].1["job_id"], "job-1");
    // The completed callback carries the same result that was written to the file.
    assert_eq!(got[1].1["result"], run.raw);
}

#[test]
fn lifecycle_callbacks_over_a_unix_socket() {
    let sb = Sandbox::new();
    let sock = sb.dir.path().join("status.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let server = two_callbacks(move || listener.accept().unwrap().0);
    let encoded = sock.display().to_string().replace('/', "%2F");
    let url = format!("http+unix://{encoded}/status");
    let run = sb.run_env(
        &one("run_command", json!({ "command": "false" })),
        &[("SBA_JOB_STATUS_URL", &url)],
    );
    let got = server.join().unwrap();
    assert_eq!(got[0].1["status"], "in_progress");
    assert_eq!(got[1].1["result"]["failure_code"], "step_failed");
    assert_eq!(got[1].1["result"], run.raw);
}

#[test]
fn an_unreachable_callback_does_not_fail_the_job() {
    let sb = Sandbox::new();
    // Bind and drop to get a port with nothing listening.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    sb.write_job(&one("run_command", json!({ "command": "true" })));
    let out = sb
        .command()
        .env(
            "SBA_JOB_STATUS_URL",
            format!("http://127.0.0.1:{port}/status"),
        )
        .output()
        .unwrap();
    let run = sb.finish(out);
    assert_eq!(run.failure(), "none");
    assert_eq!(run.code, Some(0));
}
