//! Workspaces (seeding, tar, changesets), `replay` and `check`, on the bwrap backend (the
//! workspace logic is the same for every backend; podman runs the changeset case too).

use std::path::Path;
use std::process::Command;

use serde_json::json;

use crate::harness::{command_job, env, sba_job, seed_config, unique, Server, TOKEN};

/// Runs git on the host (test set-up only) and requires success.
pub(crate) fn git(dir: &Path, args: &[&str]) {
    let ok = Command::new("git")
        .args([
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@example.invalid",
            "-C",
        ])
        .arg(dir)
        .args(args)
        .status()
        .unwrap()
        .success();
    assert!(ok, "git {args:?}");
}

/// A source repository with a commit, plus things that must never be copied.
fn source_repo(root: &Path) -> std::path::PathBuf {
    let src = root.join("repo");
    cynode_testkit::write_tree(
        &src,
        &[
            ("src/main.rs", "fn main() {\n    println!(\"v1\");\n}\n"),
            (".env", "API_TOKEN=never-copy-me\n"),
            (".ssh/id_rsa", "never-copy-me\n"),
            ("node_modules/dep/index.js", "x\n"),
            (".gitignore", ".env\nnode_modules/\n"),
        ],
    );
    std::os::unix::fs::symlink("/etc/passwd", src.join("leak")).unwrap();
    git(&src, &["init", "-q"]);
    git(&src, &["add", "src/main.rs", ".gitignore"]);
    git(&src, &["commit", "-q", "-m", "init"]);
    src
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_from_host_dir_skips_secrets_and_changeset_applies() {
    env();
    let seeds = tempfile::tempdir().unwrap();
    let src = source_repo(seeds.path());
    for backend in ["bwrap", "podman"] {
        let sv = Server::start(backend, &seed_config(seeds.path()));
        let ws = unique("ws");
        let (code, info) = sv.seed_workspace(&ws, &src).await;
        assert_eq!(code, 201, "{info}");
        assert_eq!(
            info["skipped"],
            json!([".env", ".ssh", "leak", "node_modules"])
        );
        // A job of this workspace sees the code and none of the secrets.
        let mut job = command_job(
            &unique("j"),
            "t",
            &[
                "sh",
                "-c",
                "ls -a; sed -i s/v1/v2/ src/main.rs; echo new > NOTES.md",
            ],
        );
        job["workspace_id"] = json!(ws);
        let (_, v) = sv.post("/v1/worker/jobs:run", &job).await;
        assert_eq!(v["status"], "completed", "{v}");
        assert_eq!(v["stdout"], ".\n..\n.git\n.gitignore\nsrc\n");
        // The changeset is a git diff that applies to the source.
        let r = sv
            .get_raw(&format!("/v1/worker/workspaces/{ws}/changeset"))
            .await;
        assert_eq!(r.status().as_u16(), 200);
        let diff = r.text().await.unwrap();
        assert!(
            diff.contains("diff --git a/src/main.rs b/src/main.rs"),
            "{diff}"
        );
        assert!(diff.contains("+    println!(\"v2\");"), "{diff}");
        assert!(diff.contains("diff --git a/NOTES.md b/NOTES.md"), "{diff}");
        let check = seeds.path().join(format!("check-{backend}"));
        git(
            seeds.path(),
            &[
                "clone",
                "-q",
                src.to_str().unwrap(),
                check.to_str().unwrap(),
            ],
        );
        std::fs::write(check.join("cs.diff"), &diff).unwrap();
        git(&check, &["apply", "cs.diff"]);
        assert_eq!(
            std::fs::read_to_string(check.join("NOTES.md")).unwrap(),
            "new\n"
        );
        // Seeding again is a no-op on an existing workspace.
        let (code, _) = sv.seed_workspace(&ws, &src).await;
        assert_eq!(code, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_outside_the_roots_is_refused() {
    env();
    let seeds = tempfile::tempdir().unwrap();
    let sv = Server::start("bwrap", &seed_config(seeds.path()));
    let (code, v) = sv.seed_workspace(&unique("ws"), "/etc").await;
    assert_eq!(code, 400);
    assert_eq!(
        v["detail"],
        "seed_from: not under any of this node's seed_roots"
    );
}

/// A tar of `(name, bytes)` regular files, the names written raw.
pub(crate) fn tar_of(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        // set_path refuses `..`; write the raw name so the node's own check is tested.
        let name = h.as_old_mut().name.as_mut();
        name[..path.len()].copy_from_slice(path.as_bytes());
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    b.into_inner().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tar_seed_and_export_round_trip() {
    env();
    let sv = Server::start("bwrap", "");
    let ws = unique("ws");
    let body = tar_of(&[("app/hello.txt", b"hello tar\n")]);
    let (code, v) = sv.put_tar(&ws, body).await;
    assert_eq!(code, 201, "{v}");
    let mut job = command_job(
        &unique("j"),
        "t",
        &["sh", "-c", "cat app/hello.txt; echo out > app/out.txt"],
    );
    job["workspace_id"] = json!(ws);
    let (_, v) = sv.post("/v1/worker/jobs:run", &job).await;
    assert_eq!(v["stdout"], "hello tar\n");
    let bytes = sv
        .get_raw(&format!("/v1/worker/workspaces/{ws}/tar"))
        .await
        .bytes()
        .await
        .unwrap();
    let mut names: Vec<String> = tar::Archive::new(&bytes[..])
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().display().to_string())
        .filter(|p| p.ends_with(".txt"))
        .collect();
    names.sort();
    assert_eq!(names, ["app/hello.txt", "app/out.txt"]);
    // A second seed of a workspace with content is refused.
    let r = sv
        .client
        .put(sv.url(&format!("/v1/worker/workspaces/{ws}/tar")))
        .bearer_auth(TOKEN)
        .body(tar_of(&[("x", b"y")]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 409);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tar_with_path_escape_is_refused_and_writes_nothing() {
    env();
    let sv = Server::start("bwrap", "");
    let ws = unique("ws");
    let r = sv
        .client
        .put(sv.url(&format!("/v1/worker/workspaces/{ws}/tar")))
        .bearer_auth(TOKEN)
        .body(tar_of(&[
            ("ok.txt", b"fine"),
            ("../../escaped.txt", b"evil"),
        ]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .contains("escapes the workspace"),
        "{v}"
    );
    assert!(!sv.state_dir().join("escaped.txt").exists());
    assert!(!sv.state_dir().join("workspaces/escaped.txt").exists());
    assert!(!sv.state_dir().join("workspaces").join(&ws).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_reports_match_and_mismatch() {
    env();
    let sv = Server::start("bwrap", "");
    let same = unique("j");
    let body = sba_job(
        &same,
        "t",
        json!([{ "id": "s", "type": "run_command", "arguments": { "command": "sh", "args": ["-c", "echo stable > out.txt; cat out.txt"] } }]),
        json!(["out.txt"]),
    );
    let (_, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(v["status"], "completed", "{v}");
    let differs = unique("j");
    let (_, v) = sv
        .run_job(&differs, "t", &["cat", "/proc/sys/kernel/random/uuid"])
        .await;
    assert_eq!(v["status"], "completed");
    let config = sv.dir.path().join("worker.yaml");
    let run = |id: &str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_cynode-worker"));
        cmd.args(["replay", id, "--config"]).arg(&config);
        cynode_testkit::output_bounded(cmd, std::time::Duration::from_secs(120))
    };
    let out = run(&same);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (out.status.code(), report["matches"].clone()),
        (Some(0), json!(true)),
        "{report}"
    );
    let out = run(&differs);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert!(
        report["differences"][0]
            .as_str()
            .unwrap()
            .starts_with("stdout: "),
        "{report}"
    );
}

#[test]
fn check_prints_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cynode-worker"));
    cmd.args(["check", "--backend", "bwrap", "--state-dir"])
        .arg(dir.path())
        .env_remove("WORKER_API_BEARER_TOKEN");
    let out = cynode_testkit::output_bounded(cmd, std::time::Duration::from_secs(60));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("MISSING token: no usable bearer token"),
        "{text}"
    );
}
