//! `cynode-pm skills run` and `cynode-pm jobs run`: one job without the model loop, through
//! the real binary and a real local worker on bubblewrap (the test image's root
//! filesystem). Each outcome has its own exit code and one JSON object on stdout.

use std::path::Path;
use std::process::{Command, Output};

use cynode_testkit::output_bounded;
use serde_json::{json, Value};

use cynode_tests::pm::PM_LIMIT;
use cynode_tests::{bin, rootfs, tempdir, workspace_root};

/// `cynode-pm --output json ARGS… --state-dir STATE` with a local bwrap worker.
fn pm(state: &Path, args: &[&str]) -> (i32, Value, String) {
    let mut c = Command::new(bin("cynode-pm"));
    c.env("CYNODE_LOCAL_WORKER_GRACE_SECONDS", "5")
        .args(["--output", "json"])
        .args(args)
        .arg("--state-dir")
        .arg(state)
        .args(["--local-backend", "bwrap", "--local-bwrap-rootfs"])
        .arg(rootfs())
        .current_dir(workspace_root());
    let out: Output = output_bounded(c, PM_LIMIT);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: stdout {} stderr {stderr}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    (out.status.code().unwrap_or(-1), v, stderr)
}

/// A workspace with a README and a state directory, in one temporary directory.
struct Fixture {
    dir: cynode_tests::TempDir,
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempdir().unwrap();
        // The sandbox's user reads the seed and the worker's state beneath it.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let ws = dir.path().join("ws");
        std::fs::create_dir_all(&ws).unwrap();
        std::fs::write(ws.join("README.md"), "# demo\nhello\n").unwrap();
        Fixture { dir }
    }
    fn ws(&self) -> String {
        self.dir.path().join("ws").display().to_string()
    }
    fn state(&self) -> std::path::PathBuf {
        self.dir.path().join("state")
    }
    fn file(&self, name: &str, v: &Value) -> String {
        let p = self.dir.path().join(name);
        std::fs::write(&p, v.to_string()).unwrap();
        p.display().to_string()
    }
    /// `skills render repo-inspect` with `inputs` by the binary, then `jobs run` of that
    /// job.json on the workspace.
    fn render_and_run(&self, inputs: &Value) -> (i32, Value, String) {
        let inputs = self.file("inputs.json", inputs);
        let mut render = Command::new(bin("cynode-pm"));
        render.args(["skills", "render", "repo-inspect", "--inputs", &inputs]);
        let out = output_bounded(render, PM_LIMIT);
        assert!(out.status.success(), "{out:?}");
        let job = self.dir.path().join("job.json");
        std::fs::write(&job, &out.stdout).unwrap();
        pm(
            &self.state(),
            &[
                "jobs",
                "run",
                job.to_str().unwrap(),
                "--workspace",
                &self.ws(),
            ],
        )
    }
}

#[test]
fn a_skill_runs_and_its_artifacts_are_verified() {
    let f = Fixture::new();
    let inputs = f.file("inputs.json", &json!({ "files": ["README.md"] }));
    let (code, v, stderr) = pm(
        &f.state(),
        &[
            "skills",
            "run",
            "repo-inspect",
            "--inputs",
            &inputs,
            "--workspace",
            &f.ws(),
        ],
    );
    assert_eq!((code, &v["ok"]), (0, &json!(true)), "{v} {stderr}");
    let job = &v["job"];
    assert_eq!(job["status"], "completed", "{v}");
    assert_eq!(job["skill_id"], "repo-inspect");
    let arts = job["artifacts"].as_array().unwrap();
    assert_eq!(arts.len(), 1, "{v}");
    assert_eq!(arts[0]["path"], "README.md");
    // Stored content-addressed, the bytes the workspace held.
    let sha = arts[0]["sha256"].as_str().unwrap();
    let stored = f.state().join("artifacts").join(&sha[..2]).join(sha);
    assert_eq!(std::fs::read_to_string(stored).unwrap(), "# demo\nhello\n");
    assert_eq!(job["rejected_artifacts"], json!([]));
    // The seed directory itself is untouched.
    assert_eq!(
        std::fs::read_dir(f.dir.path().join("ws")).unwrap().count(),
        1
    );
}

/// `jobs run` of a rendered job.json that succeeds: exit 0, and its artifact is the
/// workspace's bytes under the sha256 the PM verified.
#[test]
fn a_rendered_job_runs_and_its_artifacts_are_verified() {
    let f = Fixture::new();
    let (code, v, stderr) = f.render_and_run(&json!({ "files": ["README.md"] }));
    assert_eq!((code, &v["ok"]), (0, &json!(true)), "{v} {stderr}");
    assert_eq!(v["job"]["status"], "completed", "{v}");
    let arts = v["job"]["artifacts"].as_array().unwrap();
    assert_eq!(arts.len(), 1, "{v}");
    let sha = arts[0]["sha256"].as_str().unwrap();
    let stored = f.state().join("artifacts").join(&sha[..2]).join(sha);
    assert_eq!(std::fs::read_to_string(stored).unwrap(), "# demo\nhello\n");
}

#[test]
fn a_failing_job_exits_1_with_its_failure() {
    let f = Fixture::new();
    // A file the workspace lacks.
    let (code, v, stderr) = f.render_and_run(&json!({ "files": ["missing.txt"] }));
    assert_eq!(code, 1, "{v} {stderr}");
    assert_eq!(v["ok"], false);
    assert_eq!(v["error"]["kind"], "job_failed", "{v}");
    assert_eq!(v["error"]["job"]["status"], "failed", "{v}");
    assert!(!v["error"]["job"]["failure"].is_null(), "{v}");
}

#[test]
fn bad_inputs_and_a_bad_job_are_refused_by_field_before_any_worker() {
    let f = Fixture::new();
    let inputs = f.file("inputs.json", &json!({ "pattern": 5 }));
    let (code, v, _) = pm(
        &f.state(),
        &[
            "skills",
            "run",
            "search-code",
            "--inputs",
            &inputs,
            "--workspace",
            &f.ws(),
        ],
    );
    assert_eq!(code, 4, "{v}");
    assert_eq!(v["error"]["kind"], "invalid_inputs", "{v}");
    assert_eq!(v["error"]["path"], "/pattern", "{v}");
    // A job.json with a field the protocol does not know.
    let job = f.file(
        "job.json",
        &json!({ "protocol_version": "1", "job_id": "j", "task_id": "t", "skill_id": "search-code", "steps": [], "surprise": 1 }),
    );
    let (code, v, _) = pm(&f.state(), &["jobs", "run", &job, "--workspace", &f.ws()]);
    assert_eq!(code, 4, "{v}");
    assert_eq!(v["error"]["kind"], "invalid_job", "{v}");
    assert!(v["error"]["path"].as_str().is_some(), "{v}");
    // Refused before anything started: not even the state directory exists.
    assert!(!f.state().exists());
}

#[test]
fn a_policy_denial_exits_5_with_the_rules() {
    let f = Fixture::new();
    // The tenant allows shorter jobs than the skill asks for.
    let tenant = f.dir.path().join("tenant.yaml");
    std::fs::write(&tenant, "tenant_id: tight\nmax_runtime_seconds: 5\n").unwrap();
    let inputs = f.file("inputs.json", &json!({ "pattern": "hello" }));
    let (code, v, stderr) = pm(
        &f.state(),
        &[
            "--tenant",
            tenant.to_str().unwrap(),
            "skills",
            "run",
            "search-code",
            "--inputs",
            &inputs,
            "--workspace",
            &f.ws(),
        ],
    );
    assert_eq!(code, 5, "{v} {stderr}");
    assert_eq!(v["error"]["kind"], "policy_denied", "{v}");
    assert!(!v["error"]["deny"].as_array().unwrap().is_empty(), "{v}");
    // The PM seed's shape of a policy error, beside ours.
    assert_eq!(v["error"]["type"], "error", "{v}");
    assert_eq!(v["error"]["reason"], "policy_violation", "{v}");
}

/// Artifact bytes that do not match the sha256 the sandbox reported (a proxy between the
/// PM and a real worker appends to every artifact it forwards): exit 6, nothing stored.
#[test]
fn an_artifact_that_does_not_match_its_sha256_exits_6() {
    let worker = cynode_tests::start_worker(0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let proxy = rt.block_on(crate::e2e::tampering_proxy(worker.addr.clone()));
    let f = Fixture::new();
    let skills = f.dir.path().join("skills");
    cynode_tests::write_skill(
        &skills.join("make-report"),
        "skill_id: make-report\nversion: 1.0.0\ndescription: write report.txt and collect it\npurpose: base-tools\nallowed_commands: []\nlimits:\n  max_runtime_seconds: 60\n  max_output_bytes: 65536\ninputs_schema:\n  type: object\n  additionalProperties: false\n  required: [text]\n  properties:\n    text: { type: string, maxLength: 1000 }\n",
        r#"{ "artifacts": ["report.txt"], "steps": [ { "id": "w", "type": "write_file", "arguments": { "path": "report.txt", "content": {{ inputs.text }} } } ] }"#,
        r#"{ "text": "x" }"#,
    );
    let inputs = f.file("inputs.json", &json!({ "text": "genuine" }));
    let mut c = Command::new(bin("cynode-pm"));
    c.env("CYNODE_WORKER_TOKEN", cynode_tests::TOKEN)
        .args(["--output", "json", "--skill-dir"])
        .arg(&skills)
        .args([
            "skills",
            "run",
            "make-report",
            "--inputs",
            &inputs,
            "--worker-endpoint",
            &proxy,
        ])
        .arg("--state-dir")
        .arg(f.state());
    let out = output_bounded(c, PM_LIMIT);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    assert_eq!(out.status.code(), Some(6), "{v}");
    assert_eq!(v["error"]["kind"], "artifact_integrity_failure", "{v}");
    let job = &v["error"]["job"];
    assert_eq!(job["status"], "completed", "{v}");
    assert_eq!(job["artifacts"], json!([]), "{v}");
    let rejected = job["rejected_artifacts"].as_array().unwrap();
    assert_eq!(rejected[0]["path"], "report.txt", "{v}");
    assert!(
        rejected[0]["error"]
            .as_str()
            .unwrap()
            .contains("expected sha256"),
        "{v}"
    );
    assert!(
        !f.state().join("artifacts").exists()
            || std::fs::read_dir(f.state().join("artifacts"))
                .unwrap()
                .count()
                == 0
    );
}
