//! Attacks on the sandbox launch, each made by a real job (or session) in a real sandbox
//! on both backends: request values that would become engine flags, the node's secrets in
//! a sandbox's environment, the CPU limit, nested namespaces and mounts, and tracing the
//! runner. Each asserts that nothing reached the host. Plus the init-binary check of the
//! Podman backend.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::json;

use crate::harness::{command_job, env, sba_job, session_guard, unique, Server, TOKEN};

on_both_backends!(
    sandbox_escapes:
    escape_image_flags_are_refused,
    escape_no_node_secret_in_any_environ,
    escape_cpu_limit_holds,
    escape_nested_namespaces_and_mounts_are_denied,
    escape_runner_cannot_be_traced,
);

/// Podman only: the init binary of session containers.
mod podman_init {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn escape_missing_init_binary_is_named_by_readyz_and_check() {
        crate::cases::setup();
        crate::sandbox_escapes::missing_init_binary_is_named().await;
    }
}

/// Secrets the node holds in its environment during [`escape_no_node_secret_in_any_environ`].
const FAKE_API_KEY: &str = "sk-fake-cynode-model-key-5b0e1c9d";
const FAKE_UPSTREAM_KEY: &str = "fake-upstream-inference-key-77aa10";

/// A worker holding every kind of secret a node may have in its environment: its bearer
/// token from `WORKER_API_BEARER_TOKEN`, not from a file, and API keys.
fn secret_node(backend: &'static str) -> Server {
    Server::start_with_env(
        backend,
        "",
        &[
            ("WORKER_API_BEARER_TOKEN", TOKEN),
            ("CYNODE_MODEL_API_KEY", FAKE_API_KEY),
            ("OPENAI_API_KEY", FAKE_API_KEY),
            ("INFERENCE_UPSTREAM_KEY", FAKE_UPSTREAM_KEY),
        ],
    )
}

/// A host path that a successful escape would create; under a directory of this test.
fn host_marker(dir: &Path) -> String {
    dir.join("escaped-marker").display().to_string()
}

/// Item 2: `sandbox.image` smuggling engine flags (`--volume=/:/host:rw`) with a command
/// that would put the real image after them; on jobs:run, POST /jobs and sessions.
pub async fn escape_image_flags_are_refused(backend: &'static str) {
    let sv = Server::start(backend, "");
    let outside = tempfile::tempdir().unwrap();
    let marker = host_marker(outside.path());
    let image = env().image.clone();
    let script = format!("id > /host{marker}; cat /host/etc/shadow > /host{marker}.shadow");
    for flag in [
        "--volume=/:/host:rw",
        "-v=/:/host:rw",
        "--privileged",
        "--volume=/:/host:rw localhost/x",
    ] {
        for path in ["/v1/worker/jobs:run", "/v1/worker/jobs"] {
            let id = unique("j");
            let mut body = command_job(&id, "t", &["sh", "--user=0:0", &image, "-c", &script]);
            body["sandbox"]["image"] = json!(flag);
            let (code, v) = sv.post(path, &body).await;
            assert_eq!(code, 400, "{flag} on {path}: {v}");
            assert_eq!(v["type"], "urn:cynodeai:error:validation", "{v}");
            assert!(
                v["detail"]
                    .as_str()
                    .unwrap_or("")
                    .starts_with("sandbox.image"),
                "{v}"
            );
            assert!(!sv.state_dir().join("jobs").join(&id).exists());
        }
        let sid = unique("s");
        let _guard = session_guard(backend, &sid);
        let body =
            json!({ "version": 1, "session_id": sid, "task_id": unique("t"), "image": flag });
        let (code, v) = sv.post("/v1/worker/sessions", &body).await;
        assert_eq!(code, 400, "{flag} on sessions: {v}");
        assert!(
            v["detail"].as_str().unwrap_or("").starts_with("image"),
            "{v}"
        );
    }
    assert!(!Path::new(&marker).exists(), "the job wrote on the host");
    assert!(!Path::new(&format!("{marker}.shadow")).exists());
    // The real image still runs.
    let (code, v) = sv.run_job(&unique("j"), "t", &["echo", "ok"]).await;
    assert_eq!((code, v["stdout"].clone()), (200, json!("ok\n")), "{v}");
}

/// Reads every environ it can: PID 1's, its own, and every process's it can see.
const READ_ENVIRONS: &str = "for f in /proc/1/environ /proc/self/environ /proc/[0-9]*/environ; do \
     if tr '\\0' '\\n' < $f > /tmp/e 2>/dev/null; then echo \"== $f\"; cat /tmp/e; fi; done; \
     echo done";

fn assert_no_secret(what: &str, out: &str) {
    assert!(
        out.contains("== /proc/self/environ"),
        "{what}: read nothing: {out}"
    );
    for secret in [TOKEN, FAKE_API_KEY, FAKE_UPSTREAM_KEY] {
        assert!(
            !out.contains(secret),
            "{what}: a node secret is visible:\n{out}"
        );
    }
    for name in [
        "WORKER_API_BEARER_TOKEN",
        "CYNODE_MODEL_API_KEY",
        "OPENAI_API_KEY",
        "INFERENCE_UPSTREAM_KEY",
    ] {
        assert!(!out.contains(name), "{what}: {name} is visible:\n{out}");
    }
}

/// Item 3: the node's environment (bearer token, API keys) is invisible in every environ
/// a job or a session command can read.
pub async fn escape_no_node_secret_in_any_environ(backend: &'static str) {
    let node = secret_node(backend);
    let id = unique("j");
    let (code, v) = node.run_job(&id, "t", &["sh", "-c", READ_ENVIRONS]).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_no_secret("job", v["stdout"].as_str().unwrap());

    let sid = unique("s");
    let _guard = session_guard(backend, &sid);
    let body =
        json!({ "version": 1, "session_id": sid, "task_id": unique("t"), "image": env().image });
    let (code, v) = node.post("/v1/worker/sessions", &body).await;
    assert_eq!(code, 201, "{v}; log: {:?}", node.log.lock().unwrap());
    let exec = format!("/v1/worker/sessions/{sid}/exec");
    let (code, v) = node
        .post(
            &exec,
            &json!({ "version": 1, "command": ["sh", "-c", READ_ENVIRONS] }),
        )
        .await;
    assert_eq!(code, 200, "{v}");
    assert_no_secret("session", v["stdout"].as_str().unwrap());
    let (code, _) = node
        .post(
            &format!("/v1/worker/sessions/{sid}/end"),
            &json!({ "version": 1 }),
        )
        .await;
    assert!(code < 300, "end: {code}");
}

/// Item 9: with `cpus: 0.5`, two busy loops get at most about half a CPU.
pub async fn escape_cpu_limit_holds(backend: &'static str) {
    let sv = Server::start(backend, "limits:\n  cpus: 0.5\n");
    // Two busy loops for ~3 s of wall time; then their CPU ticks (utime + stime) and the
    // wall time between the two /proc/uptime readings.
    let script = "read u0 x < /proc/uptime; \
        (while :; do :; done) & a=$!; (while :; do :; done) & b=$!; \
        sleep 3; \
        read u1 x < /proc/uptime; \
        ta=$(cut -d' ' -f14,15 /proc/$a/stat); tb=$(cut -d' ' -f14,15 /proc/$b/stat); \
        kill -9 $a $b; echo $u0 $u1 $ta $tb";
    let id = unique("j");
    let (code, v) = sv
        .post(
            "/v1/worker/jobs",
            &command_job(&id, "t", &["sh", "-c", script]),
        )
        .await;
    assert_eq!(code, 202, "{v}");
    // On a loaded host even unlimited loops may get little CPU, so the rate alone cannot
    // tell; the quota the kernel enforces is read from the host while the job runs.
    let quota = sandbox_cpu_quota(backend, &id).await;
    assert_eq!(quota, Some(0.5), "{backend}: the sandbox's CPU quota");
    let done = sv.wait_terminal(&id).await;
    assert_eq!(done["status"], "completed", "{done}");
    let v = &done["result"];
    let out = v["stdout"].as_str().unwrap_or("");
    let f: Vec<f64> = out.split_whitespace().map(|x| x.parse().unwrap()).collect();
    assert_eq!(f.len(), 6, "unexpected output: {v}");
    let wall = f[1] - f[0];
    // USER_HZ is 100 on Linux.
    let cpu = (f[2] + f[3] + f[4] + f[5]) / 100.0;
    let rate = cpu / wall;
    eprintln!("{backend}: {cpu:.2} CPU-s in {wall:.2} s = {rate:.2} CPUs (limit 0.5)");
    assert!(wall >= 2.5, "the loops ran only {wall} s: {v}");
    // Under gVisor, /proc/<pid>/stat is gVisor's own task accounting, which does not see
    // the host's CFS throttling of the sandbox (it showed 1.4 CPUs in one run and under
    // 0.5 in the next): there the host-side quota above is what holds the limit.
    if backend != "runsc" {
        assert!(
            rate <= 0.5 * 1.3,
            "{backend}: two busy loops used {cpu:.2} CPU-s in {wall:.2} s ({rate:.2} CPUs) under cpus: 0.5"
        );
    }
}

/// The CPU quota (in CPUs) the kernel applies to job `id`'s sandbox, read from the host
/// while it runs: the bwrap sandbox's cgroup (`cpu.cfs_quota_us` / `cpu.max`), or the
/// container's `HostConfig.NanoCpus`.
async fn sandbox_cpu_quota(backend: &str, id: &str) -> Option<f64> {
    let until = std::time::Instant::now() + Duration::from_secs(60);
    let name = format!("cynode-{id}");
    loop {
        let found = if let Some(cli) = crate::harness::engine_cli(backend) {
            let out = Command::new(cli)
                .args(["inspect", "--format", "{{.HostConfig.NanoCpus}}", &name])
                .output()
                .ok()?;
            String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|n| *n > 0.0)
                .map(|n| n / 1e9)
        } else {
            let v1 = glob_one("/sys/fs/cgroup/cpu/cynode", &name).and_then(|d| {
                let q: f64 = read_trim(&d.join("cpu.cfs_quota_us"))?.parse().ok()?;
                let p: f64 = read_trim(&d.join("cpu.cfs_period_us"))?.parse().ok()?;
                (q > 0.0).then_some(q / p)
            });
            v1.or_else(|| {
                let d = glob_one("/sys/fs/cgroup/cynode", &name)?;
                let max = read_trim(&d.join("cpu.max"))?;
                let (q, p) = max.split_once(' ')?;
                Some(q.parse::<f64>().ok()? / p.parse::<f64>().ok()?)
            })
        };
        if found.is_some() {
            return found;
        }
        assert!(
            std::time::Instant::now() < until,
            "{backend}: the sandbox of {id} never appeared"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// `<parent>/<any node>/<name>` if it exists.
fn glob_one(parent: &str, name: &str) -> Option<std::path::PathBuf> {
    std::fs::read_dir(parent)
        .ok()?
        .flatten()
        .map(|e| e.path().join(name))
        .find(|p| p.is_dir())
}

/// Item 10: no new user namespace (so no uid 0 in one), no other new namespace, no setns,
/// no mount, in a job and in a session command.
pub async fn escape_nested_namespaces_and_mounts_are_denied(backend: &'static str) {
    let sv = Server::start(backend, "");
    let script = "unshare -r id; echo r=$?; unshare -U true; echo U=$?; \
        unshare -m true; echo m=$?; unshare -n true; echo n=$?; unshare -p -f true; echo p=$?; \
        mount -t tmpfs none /tmp; echo mount=$?; \
        nsenter -t 1 -U true; echo nsenter=$?; \
        linux32 true; echo linux32=$?";
    let expect = |what: &str, out: &str| {
        for k in ["r", "U", "m", "n", "p", "mount", "nsenter"] {
            let line = out
                .lines()
                .find(|l| l.starts_with(&format!("{k}=")))
                .unwrap_or_else(|| panic!("{what}: no {k}= in {out}"));
            assert_ne!(line, format!("{k}=0"), "{what}: `{k}` succeeded:\n{out}");
        }
        assert!(
            !out.contains("uid=0"),
            "{what}: uid 0 in a new namespace:\n{out}"
        );
        // An ordinary personality change still works (gVisor's kernel has no 32-bit
        // personality: EINVAL there).
        assert!(
            out.contains("linux32=0") || (backend == "runsc" && out.contains("linux32=")),
            "{what}: {out}"
        );
    };
    let (code, v) = sv.run_job(&unique("j"), "t", &["sh", "-c", script]).await;
    assert_eq!(code, 200, "{v}");
    expect(
        "job",
        &format!("{}{}", v["stdout"].as_str().unwrap(), v["stderr"]),
    );

    let sid = unique("s");
    let _guard = session_guard(backend, &sid);
    let body =
        json!({ "version": 1, "session_id": sid, "task_id": unique("t"), "image": env().image });
    let (code, v) = sv.post("/v1/worker/sessions", &body).await;
    assert_eq!(code, 201, "{v}");
    let (code, v) = sv
        .post(
            &format!("/v1/worker/sessions/{sid}/exec"),
            &json!({ "version": 1, "command": ["sh", "-c", script] }),
        )
        .await;
    assert_eq!(code, 200, "{v}");
    expect(
        "session",
        &format!("{}{}", v["stdout"].as_str().unwrap(), v["stderr"]),
    );
    let _ = sv
        .post(
            &format!("/v1/worker/sessions/{sid}/end"),
            &json!({ "version": 1 }),
        )
        .await;
}

/// Item 11: a step cannot read the runner's memory or environment (it is non-dumpable),
/// nor attach to it.
pub async fn escape_runner_cannot_be_traced(backend: &'static str) {
    let sv = Server::start(backend, "");
    let id = unique("j");
    let script = "r=$PPID; tr '\\0' ' ' < /proc/$r/cmdline; echo; \
        cat /proc/$r/environ > /dev/null; echo environ=$?; \
        (exec 3< /proc/$r/mem) 2>/dev/null; echo mem=$?; \
        ls /proc/$r/fd > /dev/null; echo fd=$?; \
        ls /proc/$r/root/ > /dev/null; echo root=$?";
    let body = sba_job(
        &id,
        &unique("t"),
        json!([{ "id": "s", "type": "run_command", "arguments": { "command": "sh", "args": ["-c", script] } }]),
        json!([]),
    );
    let (code, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(code, 200, "{v}");
    let step = &v["sba_result"]["steps"][0]["result"];
    let out = step["stdout"].as_str().unwrap_or_else(|| panic!("{v}"));
    assert!(
        out.lines().next().unwrap_or("").contains("cynode-sba"),
        "the step's parent is not the runner: {out}"
    );
    for k in ["environ", "mem", "fd", "root"] {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k}= in {out}"));
        assert_ne!(
            line,
            format!("{k}=0"),
            "{backend}: a step reached the runner's /proc/<pid>/{k}:\n{out}"
        );
    }
}

/// A Podman node whose init binary is missing says so, naming the binary and the
/// package, in `/readyz` and in `cynode-worker check`.
pub async fn missing_init_binary_is_named() {
    let missing = "/nonexistent/cynode-test/catatonit";
    let sv = Server::start(
        "podman",
        &format!("podman:\n  runtime: runc\n  init_path: {missing}\n"),
    );
    let r = sv.client.get(sv.url("/readyz")).send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    assert_eq!(status, 503, "{text}");
    assert!(
        text.starts_with("not ready: backend podman:") && text.contains(missing),
        "{text}"
    );
    assert!(text.contains("`catatonit`"), "{text}");
    let out = Command::new(env!("CARGO_BIN_EXE_cynode-worker"))
        .args(["check", "--config"])
        .arg(sv.dir.path().join("worker.yaml"))
        .env_remove("WORKER_API_BEARER_TOKEN")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("MISSING backend podman:") && l.contains(missing)),
        "{stdout}"
    );
    // The default path, present on a host set up by deploy/install-deps.sh, is ready.
    let ok = Server::start("podman", "");
    let r = ok.client.get(ok.url("/readyz")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap());
}
