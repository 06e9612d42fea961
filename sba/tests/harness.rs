//! Test harness: a temporary workspace/job layout and a way to run the real binary on it.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use cynode_protocol::JobResult;
use serde_json::{json, Value};

/// The binary under test.
pub fn sba_bin() -> &'static str {
    env!("CARGO_BIN_EXE_cynode-sba")
}

/// A fresh sandbox layout: `<tmp>/workspace`, `<tmp>/job`, `<tmp>/job/artifacts`, and
/// `<tmp>/outside` (a directory next to the workspace that no job may touch).
pub struct Sandbox {
    pub dir: tempfile::TempDir,
}

impl Sandbox {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        for sub in ["workspace", "job", "outside"] {
            std::fs::create_dir_all(dir.path().join(sub)).expect("mkdir");
        }
        std::fs::write(dir.path().join("outside/secret.txt"), "top secret\n").expect("write");
        Sandbox { dir }
    }

    pub fn ws(&self) -> PathBuf {
        self.dir.path().join("workspace")
    }

    pub fn job_dir(&self) -> PathBuf {
        self.dir.path().join("job")
    }

    pub fn outside(&self) -> PathBuf {
        self.dir.path().join("outside")
    }

    pub fn artifacts(&self) -> PathBuf {
        self.job_dir().join("artifacts")
    }

    pub fn result_path(&self) -> PathBuf {
        self.job_dir().join("result.json")
    }

    /// Writes a file into the workspace (test setup, not through the runner).
    pub fn put(&self, rel: &str, content: &str) {
        let p = self.ws().join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, content).expect("write");
    }

    pub fn read(&self, rel: &str) -> String {
        std::fs::read_to_string(self.ws().join(rel)).expect("read")
    }

    /// The base command: file mode, this sandbox's paths, `--allow-root` (tests run as root
    /// in CI), a clean environment, and the workspace as the working directory, as a
    /// sandbox starts the runner.
    pub fn command(&self) -> Command {
        self.command_as(true)
    }

    /// The base command, with or without `--allow-root`.
    pub fn command_as(&self, allow_root: bool) -> Command {
        let mut c = Command::new(sba_bin());
        c.arg("--job")
            .arg(self.job_dir().join("job.json"))
            .arg("--result")
            .arg(self.result_path())
            .arg("--artifacts")
            .arg(self.artifacts())
            .arg("--workspace")
            .arg(self.ws())
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .current_dir(self.ws())
            .stdin(Stdio::null());
        if allow_root {
            c.arg("--allow-root");
        }
        c
    }

    pub fn write_job(&self, job: &Value) {
        std::fs::write(
            self.job_dir().join("job.json"),
            serde_json::to_vec_pretty(job).expect("json"),
        )
        .expect("write job");
    }

    /// Runs `job` and returns the exit code, the parsed result and the raw output.
    /// Runs `job` in a fresh sandbox the caller does not need afterwards.
    pub fn run_once(job: &Value) -> Run {
        Sandbox::new().run(job)
    }

    pub fn run(&self, job: &Value) -> Run {
        self.run_env(job, &[])
    }

    /// [`Sandbox::run`] with `env` set for the runner.
    pub fn run_env(&self, job: &Value, env: &[(&str, &str)]) -> Run {
        self.write_job(job);
        let mut c = self.command();
        c.envs(env.iter().copied());
        // Bounded by the test, in a process group it owns: a runner that hangs fails here.
        let output = cynode_testkit::output_bounded(c, std::time::Duration::from_secs(120));
        self.finish(output)
    }

    pub fn finish(&self, output: Output) -> Run {
        let text = std::fs::read_to_string(self.result_path()).unwrap_or_else(|e| {
            panic!(
                "no result.json ({e}); stdout: {}\nstderr: {}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )
        });
        let result: JobResult = serde_json::from_str(&text).unwrap_or_else(|e| {
            panic!("result.json does not parse as the protocol type: {e}\n{text}")
        });
        Run {
            code: output.status.code(),
            result,
            raw: serde_json::from_str(&text).expect("json"),
            output,
        }
    }
}

/// One finished run.
pub struct Run {
    pub code: Option<i32>,
    pub result: JobResult,
    pub raw: Value,
    pub output: Output,
}

impl Run {
    /// `failure_code` as its wire string (or "none").
    pub fn failure(&self) -> String {
        self.result
            .failure_code
            .map(|c| c.as_str().to_string())
            .unwrap_or_else(|| "none".into())
    }

    pub fn step(&self, i: usize) -> &Value {
        &self.raw["steps"][i]
    }

    pub fn message(&self) -> String {
        self.result.failure_message.clone().unwrap_or_default()
    }

    /// Asserts the failure message starts with `prefix`.
    pub fn assert_message_starts_with(&self, prefix: &str) {
        let m = self.message();
        assert!(
            m.starts_with(prefix),
            "message {m:?} does not start with {prefix:?}"
        );
    }

    /// Asserts the failure message contains `needle`.
    pub fn assert_message_contains(&self, needle: &str) {
        let m = self.message();
        assert!(m.contains(needle), "message {m:?} lacks {needle:?}");
    }

    /// Asserts the run failed with `code` and a message starting with `prefix`.
    pub fn assert_failure(&self, code: &str, prefix: &str) {
        assert_eq!(self.failure(), code, "{}", self.message());
        self.assert_message_starts_with(prefix);
    }

    /// The run failed with exactly `message`, and step `s1` was refused before it started
    /// (it has no result).
    pub fn assert_refused_before_start(&self, message: &str) {
        assert_eq!(self.message(), message);
        assert_eq!(self.step(0)["result"], json!(null));
    }
}

/// A job with the given steps and sensible constraints.
pub fn job(steps: Value) -> Value {
    json!({
        "protocol_version": "1.0",
        "job_id": "job-1",
        "task_id": "task-1",
        "constraints": { "max_runtime_seconds": 30, "max_output_bytes": 65536 },
        "steps": steps
    })
}

/// A job whose constraints are merged with `extra`.
pub fn job_with(steps: Value, extra: Value) -> Value {
    let mut j = job(steps);
    if let (Some(c), Some(e)) = (j["constraints"].as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            c.insert(k.clone(), v.clone());
        }
    }
    j
}

/// A single-step job.
pub fn one(step_type: &str, arguments: Value) -> Value {
    one_with(step_type, arguments, json!({}))
}

/// A single-step job whose constraints are merged with `extra`.
pub fn one_with(step_type: &str, arguments: Value, extra: Value) -> Value {
    job_with(
        json!([{ "id": "s1", "type": step_type, "arguments": arguments }]),
        extra,
    )
}

/// One `run_command` step `s1` running `sh -c script`.
pub fn sh(script: &str) -> Value {
    sh_with(script, json!({}))
}

/// [`sh`] with `constraints` merged into the job's (as [`job_with`]).
pub fn sh_with(script: &str, constraints: Value) -> Value {
    let arguments = json!({ "command": "sh", "args": ["-c", script] });
    one_with("run_command", arguments, constraints)
}

/// Whether any live process has `needle` in its command line.
pub fn process_with_arg(needle: &str) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|e| {
        std::fs::read(e.path().join("cmdline"))
            .map(|c| {
                let text = String::from_utf8_lossy(&c).replace('\0', " ");
                text.contains(needle)
            })
            .unwrap_or(false)
    })
}

/// Waits (bounded) until `path` exists: synchronisation on a condition, not on time.
pub fn wait_for_file(path: &Path, limit: std::time::Duration) -> bool {
    let until = std::time::Instant::now() + limit;
    while std::time::Instant::now() < until {
        if path.exists() {
            return true;
        }
        std::thread::yield_now();
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    false
}

/// Lists every file under `dir` with its content, for before/after comparisons.
pub fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let ft = e.file_type().expect("file type");
            if ft.is_dir() {
                stack.push(p);
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap_or_default()));
            }
        }
    }
    out.sort();
    out
}
