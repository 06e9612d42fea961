//! The deployment files in deploy/: `deploy/check.sh` validates every Containerfile, the
//! compose file, the Kubernetes manifests and the systemd units offline, and its
//! `--self-test` proves it fails on deliberately broken copies. The worker
//! configurations the deployments ship are parsed here with the worker's own config type
//! (unknown keys are errors), which no schema tool knows.
//!
//! A test binary of its own (not a module of tests/all.rs) so that
//! `cargo nextest run -p cynode-pm --test deploy` checks the deployment files alone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use cynode_worker::config::{BackendKind, Config};
use serde::Deserialize;

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
