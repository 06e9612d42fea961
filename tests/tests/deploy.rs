//! The deployment files in deploy/: `deploy/check.sh` validates every Containerfile, the
//! compose file, the Kubernetes manifests and the systemd units offline, and its
//! `--self-test` proves it fails on deliberately broken copies. The worker
//! configurations the deployments ship are parsed here with the worker's own config type
//! (unknown keys are errors), which no schema tool knows, and the PM's worker registries
//! (`--workers-file`) with the PM's own parser, checked against the deployment that
//! mounts each one.
//!
//! A test binary of its own (not a module of tests/all.rs) so that
//! `cargo nextest run -p cynode-pm --test deploy` checks the deployment files alone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use cynode_pm::workers::{WorkerEntry, WorkersFile};
use cynode_worker::config::{BackendKind, Config};
use serde::Deserialize;
use serde_yaml::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("pm/ lies in the repository")
        .to_path_buf()
}

fn run_check(args: &[&str]) {
    let out = Command::new("bash")
        .arg(repo().join("deploy/check.sh"))
        .args(args)
        .current_dir(repo())
        .output()
        .expect("cannot run bash");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "deploy/check.sh {args:?} failed ({}):\n{text}",
        out.status
    );
}

#[test]
fn deployment_files_are_valid() {
    run_check(&[]);
}

#[test]
fn checker_fails_on_broken_copies() {
    run_check(&["--self-test"]);
}

fn load(rel: &str) -> Config {
    Config::load(&repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e:#}"))
}

#[test]
fn shipped_worker_configs_parse_with_the_worker_config_type() {
    let rel = "deploy/k8s/worker.yaml";
    let text = std::fs::read_to_string(repo().join(rel)).expect("read the worker manifests");
    let mut configmaps = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let obj = serde_yaml::Value::deserialize(doc).expect("a YAML document");
        if obj["kind"] == "ConfigMap" {
            let body = obj["data"]["worker.yaml"]
                .as_str()
                .expect("the ConfigMap carries worker.yaml");
            let cfg: Config = serde_yaml::from_str(body)
                .unwrap_or_else(|e| panic!("{rel}: ConfigMap worker.yaml: {e}"));
            configmaps.push(cfg);
        }
    }
    assert_eq!(configmaps.len(), 1, "{rel}: one worker ConfigMap");
    let k8s = &configmaps[0];
    // Host-socket mode: the podman remote client rejects `--runtime`, so it stays empty.
    assert_eq!(
        (
            k8s.backend,
            k8s.listen.to_string(),
            k8s.state_dir.clone(),
            k8s.podman.runtime.as_str()
        ),
        (
            BackendKind::Podman,
            "0.0.0.0:7070".to_string(),
            PathBuf::from("/var/lib/cynode-worker"),
            ""
        )
    );

    let image = load("deploy/worker/worker.container.yaml");
    assert_eq!(
        (
            image.listen.to_string(),
            image.token_file.clone(),
            image.podman.runtime.as_str()
        ),
        (
            "0.0.0.0:7070".to_string(),
            Some(PathBuf::from("/run/secrets/worker-token")),
            ""
        ),
        "the compose file mounts the worker-token secret there; host-socket mode"
    );
    load("deploy/worker/worker.yaml");
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The YAML documents of a (multi-document) manifest file.
fn documents(rel: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(&read(rel))
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{rel}: {e}")))
        .filter(|v| !v.is_null())
        .collect()
}

fn the<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let hits: Vec<&Value> = docs
        .iter()
        .filter(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .collect();
    assert_eq!(hits.len(), 1, "one {kind} {name}");
    hits[0]
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_sequence()
        .map(|s| s.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn registry(rel: &str) -> WorkersFile {
    WorkersFile::parse(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e:#}"))
}

/// `(host, port)` of an `http://host:port` or `https://host:port` endpoint.
fn host_port(w: &WorkerEntry) -> (String, u16) {
    let rest = w
        .endpoint
        .strip_prefix("https://")
        .or_else(|| w.endpoint.strip_prefix("http://"))
        .expect("an http(s) endpoint");
    let (host, port) = rest
        .trim_end_matches('/')
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("{}: endpoint {} names no port", w.id, w.endpoint));
    (host.to_string(), port.parse().expect("a port number"))
}

/// The sandbox purposes deploy/sba/build-full-image.sh labels its image with.
fn full_image_purposes() -> Vec<String> {
    let script = read("deploy/sba/build-full-image.sh");
    let line = script
        .lines()
        .find_map(|l| l.strip_prefix("PURPOSE=\""))
        .expect("build-full-image.sh sets PURPOSE=\"...\"");
    let mut purposes: Vec<String> = line
        .trim_end_matches('"')
        .split(',')
        .map(str::to_string)
        .collect();
    purposes.sort();
    purposes
}

/// Every image the registry names is one the worker allows, and the full SBA image is
/// offered for exactly the purposes it is built (and labelled) for.
fn check_offers(rel: &str, reg: &WorkersFile, worker: &Config) {
    let full = full_image_purposes();
    for w in &reg.workers {
        for (purpose, image) in &w.purposes {
            assert!(
                worker.image_allowed(image),
                "{rel}: {}: {purpose} -> {image}, which the worker does not allow ({:?})",
                w.id,
                worker.images
            );
        }
        let offered: Vec<String> = w
            .purposes
            .iter()
            .filter(|(_, image)| image.as_str() == "localhost/cynode-sba:latest")
            .map(|(p, _)| p.clone())
            .collect();
        assert_eq!(
            offered, full,
            "{rel}: {}: localhost/cynode-sba:latest serves what build-full-image.sh builds",
            w.id
        );
    }
}

/// The worker config the k8s ConfigMap cynode-worker-config carries.
fn k8s_worker_config(docs: &[Value]) -> Config {
    let body = the(docs, "ConfigMap", "cynode-worker-config")["data"]["worker.yaml"]
        .as_str()
        .expect("worker.yaml")
        .to_string();
    serde_yaml::from_str(&body).expect("the worker ConfigMap parses")
}

#[test]
fn k8s_worker_registry_lists_each_node_at_its_hostport() {
    let rel = "deploy/k8s/pm-workers.yaml";
    let reg = registry(rel);

    // kustomization.yaml generates ConfigMap cynode-pm-workers (key workers.yaml) from it.
    let kust = &documents("deploy/k8s/kustomization.yaml")[0];
    let generators = kust["configMapGenerator"]
        .as_sequence()
        .expect("configMapGenerator");
    let gen = generators
        .iter()
        .find(|g| g["name"] == "cynode-pm-workers")
        .expect("a generator for cynode-pm-workers");
    assert_eq!(gen["namespace"], "cynode");
    assert_eq!(strings(&gen["files"]), ["workers.yaml=pm-workers.yaml"]);

    // The PM reads it from that ConfigMap, mounted read-only, and has no single endpoint.
    let pm_docs = documents("deploy/k8s/pm.yaml");
    let pod = &the(&pm_docs, "Deployment", "cynode-pm")["spec"]["template"]["spec"];
    let pm = &pod["containers"][0];
    let args = strings(&pm["args"]);
    assert!(
        args.contains(&"--workers-file=/etc/cynode/workers.yaml"),
        "{args:?}"
    );
    assert!(
        !args
            .iter()
            .any(|a| a.starts_with("--worker-endpoint") || a.starts_with("--worker-token-file")),
        "{args:?}"
    );
    let mounts = pm["volumeMounts"].as_sequence().expect("volumeMounts");
    let mount = |name: &str| {
        mounts
            .iter()
            .find(|m| m["name"] == name)
            .unwrap_or_else(|| panic!("a mount of volume {name}"))
    };
    let volume = |name: &str| {
        pod["volumes"]
            .as_sequence()
            .and_then(|v| v.iter().find(|v| v["name"] == name))
            .unwrap_or_else(|| panic!("volume {name}"))
    };
    assert_eq!(mount("workers")["mountPath"], "/etc/cynode");
    assert_eq!(mount("workers")["readOnly"], true);
    let cm = &volume("workers")["configMap"];
    assert_eq!(cm["name"], "cynode-pm-workers");
    assert_eq!(cm["items"][0]["key"], "workers.yaml");
    assert_eq!(cm["items"][0]["path"], "workers.yaml");

    // Token: the cynode-worker-token Secret (key `token`) the PM mounts.
    assert_eq!(
        volume("worker-token")["secret"]["secretName"],
        "cynode-worker-token"
    );
    let token = format!(
        "{}/token",
        mount("worker-token")["mountPath"].as_str().expect("path")
    );
    let secrets = documents("deploy/k8s/secrets.example.yaml");
    assert!(
        secrets.iter().any(|o| o["kind"] == "Secret"
            && o["metadata"]["name"] == "cynode-worker-token"
            && o["metadata"]["namespace"] == "cynode"
            && o["stringData"]["token"].is_string()),
        "secrets.example.yaml: the PM's cynode-worker-token has the key `token`"
    );

    // Each entry is one node's worker: the DaemonSet's hostPort, never a Service.
    let worker_docs = documents("deploy/k8s/worker.yaml");
    let ds = the(&worker_docs, "DaemonSet", "cynode-worker");
    let port = &ds["spec"]["template"]["spec"]["containers"][0]["ports"][0];
    assert_eq!(port["hostPort"], port["containerPort"]);
    let node_port = port["hostPort"].as_u64().expect("a hostPort") as u16;
    assert!(
        !worker_docs.iter().any(|o| o["kind"] == "Service"),
        "no Service in front of the node-local workers"
    );
    assert!(reg.workers.len() >= 2, "{rel}: shows more than one node");
    // TLS: the worker serves HTTPS and requires client certificates, so every entry is
    // https:// with the CA, certificate and key of the Secret cynode-pm-worker-tls.
    let worker_cfg = k8s_worker_config(&worker_docs);
    assert!(
        worker_cfg
            .tls
            .as_ref()
            .is_some_and(|t| t.client_ca_file.is_some()),
        "the k8s worker requires client certificates"
    );
    assert_eq!(
        volume("worker-tls")["secret"]["secretName"],
        "cynode-pm-worker-tls"
    );
    assert_eq!(mount("worker-tls")["readOnly"], true);
    let tls_dir = mount("worker-tls")["mountPath"]
        .as_str()
        .expect("path")
        .to_string();
    let want_tls = cynode_tls::ClientTls {
        ca_file: Some(format!("{tls_dir}/ca.crt").into()),
        cert_file: Some(format!("{tls_dir}/tls.crt").into()),
        key_file: Some(format!("{tls_dir}/tls.key").into()),
    };
    for w in &reg.workers {
        assert!(w.endpoint.starts_with("https://"), "{rel}: {}", w.endpoint);
        assert!(!w.allow_plain_http, "{rel}: {}", w.id);
        assert_eq!(w.tls.as_ref(), Some(&want_tls), "{rel}: {}", w.id);
        let (host, port) = host_port(w);
        assert_eq!(port, node_port, "{rel}: {}", w.id);
        assert!(!host.contains(".svc"), "{rel}: {host}");
        assert_eq!(
            w.token_file.as_deref(),
            Some(Path::new(&token)),
            "{rel}: {}",
            w.id
        );
    }
    check_offers(rel, &reg, &worker_cfg);
}

#[test]
fn compose_worker_registry_names_the_worker_service_and_its_secret() {
    let rel = "deploy/compose/workers.yaml";
    let reg = registry(rel);
    let mut compose = documents("deploy/compose/compose.yaml").remove(0);
    compose.apply_merge().expect("YAML merge keys");
    let worker_cfg = load("deploy/worker/worker.container.yaml");
    for name in ["pm-1", "pm-2"] {
        let pm = &compose["services"][name];
        let cmd = strings(&pm["command"]);
        assert!(
            cmd.contains(&"--workers-file=/etc/cynode/workers.yaml"),
            "{name}: {cmd:?}"
        );
        assert!(
            !cmd.iter().any(|a| a.starts_with("--worker-endpoint")),
            "{name}: {cmd:?}"
        );
        assert!(
            strings(&pm["volumes"]).contains(&"./workers.yaml:/etc/cynode/workers.yaml:ro"),
            "{name}: mounts {rel} read-only"
        );
        assert!(strings(&pm["secrets"]).contains(&"worker-token"), "{name}");
    }
    assert!(strings(&compose["services"]["worker"]["secrets"]).contains(&"worker-token"));
    assert_eq!(reg.workers.len(), 1);
    let w = &reg.workers[0];
    assert_eq!(
        (w.id.as_str(), host_port(w)),
        ("worker", ("worker".to_string(), worker_cfg.listen.port()))
    );
    // One host, a private bridge: the worker serves plain http and the PM says so.
    assert!(
        w.endpoint.starts_with("http://") && w.allow_plain_http && worker_cfg.tls.is_none(),
        "{rel}: plain http is explicit on both sides"
    );
    // Compose mounts the secret worker-token at /run/secrets/worker-token in every
    // service: the PM presents the token the worker checks.
    assert_eq!(
        w.token_file.as_deref(),
        Some(Path::new("/run/secrets/worker-token"))
    );
    assert_eq!(w.token_file, worker_cfg.token_file);
    check_offers(rel, &reg, &worker_cfg);
}

#[test]
fn systemd_worker_registry_uses_the_units_credential() {
    let rel = "deploy/systemd/workers.yaml";
    let reg = registry(rel);
    let unit = read("deploy/systemd/cynode-pm.service");
    let exec = unit
        .replace("\\\n", " ")
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart=").map(str::to_string))
        .expect("ExecStart");
    let args: Vec<&str> = exec.split_whitespace().collect();
    assert!(
        args.windows(2)
            .any(|a| a == ["--workers-file", "/etc/cynode/workers.yaml"]),
        "{exec}"
    );
    assert!(!args.contains(&"--worker-endpoint"), "{exec}");
    assert!(
        unit.contains("deploy/systemd/workers.yaml /etc/cynode/workers.yaml"),
        "the install steps put {rel} where --workers-file reads it"
    );
    let worker_cfg = load("deploy/worker/worker.yaml");
    assert_eq!(reg.workers.len(), 1);
    let w = &reg.workers[0];
    assert_eq!(
        host_port(w),
        (worker_cfg.listen.ip().to_string(), worker_cfg.listen.port()),
        "{rel}: the local cynode-worker.service"
    );
    // The token is the credential the unit loads from the worker's own token file.
    let cred = w
        .token_file
        .as_deref()
        .and_then(|p| p.strip_prefix("/run/credentials/cynode-pm.service").ok())
        .and_then(|p| p.to_str())
        .expect("token_file is a credential of cynode-pm.service");
    let source = worker_cfg
        .token_file
        .as_deref()
        .expect("worker.yaml names its token file");
    assert!(
        unit.lines()
            .any(|l| l == format!("LoadCredential={cred}:{}", source.display())),
        "cynode-pm.service loads credential {cred} from {}",
        source.display()
    );
    check_offers(rel, &reg, &worker_cfg);
}

/// `deploy/llm/stop.sh PORT` stops the llama-server start.sh recorded for PORT (a fake
/// one here: `sleep` under that name) and removes its pid file; a pid file naming some
/// other process (a recycled pid) leaves that process alone.
#[test]
fn llm_stop_stops_the_recorded_server_and_nothing_else() {
    use cynode_testkit::OwnedChild;
    use std::time::Duration;
    let dir = cynode_tests::tempdir().unwrap();
    let fake = dir.path().join("llama-server");
    std::fs::copy("/bin/sleep", &fake).unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let pid_file = run.join("llama-server-18089.pid");
    let stop = || {
        let mut c = Command::new("bash");
        c.arg(repo().join("deploy/llm/stop.sh"))
            .arg("18089")
            .env("CYNODE_LLM_CACHE", dir.path());
        let out = cynode_testkit::output_bounded(c, Duration::from_secs(30));
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };

    let mut server = OwnedChild::spawn({
        let mut c = Command::new(&fake);
        c.arg("300");
        c
    });
    std::fs::write(&pid_file, server.id().to_string()).unwrap();
    let said = stop();
    assert!(
        said.contains(&format!("stopped llama-server pid {}", server.id())),
        "{said}"
    );
    assert!(server.wait_timeout(Duration::from_secs(10)).is_some());
    assert!(!pid_file.exists());
    assert!(stop().contains("no llama-server"), "nothing left to stop");

    let mut other = OwnedChild::spawn({
        let mut c = Command::new("/bin/sleep");
        c.arg("300");
        c
    });
    std::fs::write(&pid_file, other.id().to_string()).unwrap();
    assert!(stop().contains("no llama-server"));
    assert!(
        other.try_wait().is_none(),
        "a process not named llama-server was signalled"
    );
    other.kill();
}

/// `deploy/run-demo.sh --help` (which builds nothing) documents how the model server it
/// starts is stopped or kept; the script runs cynode-pm as a child (not `exec`), so its
/// EXIT trap reports and stops the model server after the session.
#[test]
fn run_demo_stops_its_model_server_unless_kept() {
    let mut c = Command::new("bash");
    c.arg(repo().join("deploy/run-demo.sh")).arg("--help");
    let out = cynode_testkit::output_bounded(c, std::time::Duration::from_secs(30));
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--keep-model",
        "CYNODE_DEMO_KEEP_MODEL",
        "deploy/llm/stop.sh",
    ] {
        assert!(help.contains(needle), "{needle} not in:\n{help}");
    }
    let mut c = Command::new("bash");
    c.arg(repo().join("deploy/run-demo.sh"))
        .arg("--no-such-flag");
    let out = cynode_testkit::output_bounded(c, std::time::Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let script = read("deploy/run-demo.sh");
    assert!(script.contains("trap model_note EXIT"), "no EXIT trap");
    assert!(
        !script.lines().any(|l| l.trim_start().starts_with("exec ")),
        "an exec would skip the EXIT trap"
    );
    let check = Command::new("bash")
        .arg("-n")
        .arg(repo().join("deploy/run-demo.sh"))
        .output()
        .unwrap();
    assert!(check.status.success(), "{check:?}");
}

/// Runs a copy of `deploy/run-demo.sh` whose build steps, model start and `cynode-pm` are
/// stand-ins (the real `deploy/llm/stop.sh`; a fake llama-server: `sleep` under that name,
/// detached as start.sh does); returns the script's stderr and the fake server's pid.
fn demo_with_stand_ins(dir: &Path, extra: &[&str], envs: &[(&str, &str)]) -> (String, u32) {
    use std::os::unix::fs::PermissionsExt;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let root = dir.join("repo");
    let script = |rel: &str, text: &str| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    std::fs::create_dir_all(root.join("examples/workspace")).unwrap();
    std::fs::copy(
        repo().join("deploy/run-demo.sh"),
        root.join("run-demo.sh.tmp"),
    )
    .ok();
    script("deploy/run-demo.sh", &read("deploy/run-demo.sh"));
    script("deploy/llm/stop.sh", &read("deploy/llm/stop.sh"));
    script("deploy/install-deps.sh", "true\n");
    script("deploy/sba/build-static.sh", "echo /bin/true\n");
    script("deploy/sba/build-test-image.sh", "true\n");
    script("bin/cargo", "true\n");
    std::fs::copy("/bin/sleep", dir.join("llama-server")).unwrap();
    script(
        "deploy/llm/start.sh",
        &format!(
            "mkdir -p \"$CYNODE_LLM_CACHE/run\"\nsetsid {} 120 </dev/null >/dev/null 2>&1 &\n\
             echo $! | tee \"$CYNODE_LLM_CACHE/started.pid\" >\"$CYNODE_LLM_CACHE/run/llama-server-$1.pid\"\n\
             echo CYNODE_MODEL_BASE_URL=http://127.0.0.1:$1/v1\n",
            dir.join("llama-server").display()
        ),
    );
    script("target/release/cynode-pm", "echo session completed >&2\n");
    let path = format!(
        "{}:{}",
        root.join("bin").display(),
        std::env::var("PATH").unwrap()
    );
    let cache = dir.join("cache");
    let mut c = Command::new("bash");
    c.arg(root.join("deploy/run-demo.sh"))
        .args(extra)
        .env_remove("CYNODE_MODEL_BASE_URL")
        .env_remove("CYNODE_DEMO_KEEP_MODEL")
        .env("PATH", path)
        .env("CARGO_TARGET_DIR", root.join("target"))
        .env("CYNODE_LLM_CACHE", &cache)
        .env("CYNODE_DEMO_MODEL_PORT", &port)
        // The run's kept state directory goes with the test's.
        .env("CYNODE_DEMO_DIR", dir)
        .envs(envs.iter().copied());
    let out = cynode_testkit::output_bounded(c, std::time::Duration::from_secs(60));
    let pid: u32 = std::fs::read_to_string(cache.join("started.pid"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    assert!(out.status.success(), "{out:?}");
    let kept = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().starts_with("cynode-demo."));
    assert!(kept, "the run's directory is not under CYNODE_DEMO_DIR");
    (String::from_utf8_lossy(&out.stderr).into_owned(), pid)
}

/// Whether `pid` runs (not a zombie).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit(") ").next().map(|r| !r.starts_with('Z')))
        .unwrap_or(false)
}

#[test]
fn run_demo_stops_the_model_server_it_started_and_keeps_it_when_asked() {
    let dir = cynode_tests::tempdir().unwrap();
    let (said, pid) = demo_with_stand_ins(dir.path(), &[], &[]);
    assert_ne!(pid, 0, "no model server was started: {said}");
    let stopped = !running(pid);
    if !stopped {
        let _ = Command::new("kill").arg(pid.to_string()).status();
    }
    assert!(
        stopped,
        "the server {pid} the demo started still runs: {said}"
    );
    let last = said.lines().last().unwrap_or("");
    assert!(
        last.starts_with("run-demo: stopped the model server the demo started"),
        "{said}"
    );
    // The pid file is gone: the server was stopped by stop.sh.
    let left: Vec<_> = std::fs::read_dir(dir.path().join("cache/run"))
        .unwrap()
        .collect();
    assert!(left.is_empty(), "{left:?}");

    let dir = cynode_tests::tempdir().unwrap();
    let (said, pid) = demo_with_stand_ins(dir.path(), &["--keep-model"], &[]);
    let kept = running(pid);
    // Stop it before asserting, so a failure leaves nothing behind.
    let _ = Command::new("kill").arg(pid.to_string()).status();
    let last = said.lines().last().unwrap_or("");
    assert!(
        kept,
        "--keep-model: the server {pid} is not running: {said}"
    );
    assert!(
        last.contains("is left running") && last.contains("bash deploy/llm/stop.sh"),
        "{said}"
    );
}
