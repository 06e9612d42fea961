//! `cynode-worker check` names what Docker and gVisor lack: no daemon answering, runsc not
//! registered with the daemon (or without the flags the node needs), the runsc binary
//! missing, the pool waiter Docker's `restricted` jobs and gVisor's sessions need; and
//! passes on a host deploy/install-deps.sh and deploy/docker/start.sh set up.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use cynode_testkit::output_bounded;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_what_docker_and_runsc_lack() {
    crate::cases::setup();
    crate::harness::docker_ready();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();

    // No daemon: the real client, pointed at a socket nothing listens on.
    let no_daemon = script(
        d,
        "docker-no-daemon",
        &format!("exec docker -H unix://{}/none.sock \"$@\"", d.display()),
    );
    let out = check(
        d,
        &format!("backend: docker\ndocker:\n  binary: {no_daemon}\n"),
    );
    assert_missing(&out, "backend docker: no Docker daemon answers");
    assert_missing(&out, "start dockerd");

    // A daemon without runsc among its runtimes.
    let unregistered = script(
        d,
        "docker-no-runsc",
        "[ \"$1\" = info ] && { echo '{\"runc\":{\"path\":\"runc\"}}'; exit 0; }\nexec docker \"$@\"",
    );
    let out = check(
        d,
        &format!("backend: docker\ndocker:\n  binary: {unregistered}\n  runtime: runsc\n"),
    );
    assert_missing(&out, "the Docker daemon has no runtime named runsc");
    assert_missing(&out, "/etc/docker/daemon.json");

    // Podman with runsc, whose binary is not there.
    let out = check(
        d,
        "backend: podman\npodman:\n  runtime: runsc\n  runsc_path: /nonexistent/cynode/runsc\n",
    );
    assert_missing(
        &out,
        "podman.runtime is runsc, but /nonexistent/cynode/runsc is missing",
    );

    // gVisor without the pool waiter its session commands run through.
    let out = check(
        d,
        &format!(
            "backend: podman\npodman:\n  runtime: runsc\n  pool_waiter: {}\n",
            d.join("no-waiter").display()
        ),
    );
    assert_missing(
        &out,
        "gVisor session commands run under the node's seccomp filter",
    );
    assert_missing(&out, "build-waiter.sh");

    // The host as the project's scripts set it up: both pass.
    for (config, ok) in [
        (
            "backend: docker\ndocker:\n  runtime: runsc\n",
            "ok   backend docker: docker ",
        ),
        (
            "backend: podman\npodman:\n  runtime: runsc\n",
            "ok   backend podman: podman ",
        ),
    ] {
        let out = check(d, config);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(ok) && l.contains("(runtime runsc)")),
            "{config}: {stdout}"
        );
        assert_eq!(out.status.code(), Some(0), "{config}: {stdout}");
    }
}

/// Docker without the pool waiter: `check` passes (jobs without egress run cold) but says
/// that `restricted` jobs will fail, and such a job fails at start naming the waiter and
/// how to build it, with nothing left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_without_the_waiter_names_it_for_restricted_jobs() {
    crate::cases::setup();
    crate::harness::docker_ready();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let missing = d.join("no-waiter");
    let lines = format!(
        "backend: docker\ndocker:\n  pool_waiter: {}\n",
        missing.display()
    );
    let out = check(d, &lines);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("ok   backend docker: ")
                && l.contains("`restricted` (egress) jobs will fail")
                && l.contains(&missing.display().to_string())
                && l.contains("deploy/worker/build-waiter.sh")),
        "{stdout}"
    );
    let sv = crate::harness::Server::start(
        "docker",
        &format!(
            "docker:\n  pool_waiter: {}\negress:\n  allow: [\"origin.test\"]\n",
            missing.display()
        ),
    );
    let job = serde_json::json!({ "version": 1, "task_id": "t-nowaiter",
        "job_id": crate::harness::unique("nw"),
        "sandbox": { "image": crate::harness::env().image, "command": ["true"],
            "network_policy": "restricted", "timeout_seconds": 60 } });
    let (code, resp) = sv.post("/v1/worker/jobs:run", &job).await;
    assert_eq!(code, 200, "{resp}");
    assert_eq!(resp["status"], "failed", "{resp}");
    let text = resp.to_string();
    assert!(
        text.contains("pool waiter") && text.contains("build-waiter.sh"),
        "{resp}"
    );
    assert!(
        crate::harness::engine_names("docker", &format!("name=^cynode-pool-{}-", sv.pid()))
            .is_empty(),
        "a container was left"
    );
}

/// Writes an executable shell script `name` in `dir`; returns its path.
fn script(dir: &Path, name: &str, body: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.display().to_string()
}

/// Runs `cynode-worker check` on `backend_lines` plus a token and a state directory in `dir`.
pub fn check(dir: &Path, backend_lines: &str) -> std::process::Output {
    let token = dir.join("token");
    std::fs::write(&token, crate::harness::TOKEN).unwrap();
    let config = dir.join("worker.yaml");
    std::fs::write(
        &config,
        format!(
            "{backend_lines}state_dir: {}\ntoken_file: {}\n",
            dir.join("state").display(),
            token.display()
        ),
    )
    .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cynode-worker"));
    cmd.args(["check", "--config"])
        .arg(&config)
        .current_dir(dir)
        .env_remove("WORKER_API_BEARER_TOKEN");
    output_bounded(cmd, Duration::from_secs(120))
}

fn assert_missing(out: &std::process::Output, needle: &str) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("MISSING ") && l.contains(needle)),
        "no MISSING line with {needle:?}: {stdout}"
    );
}
