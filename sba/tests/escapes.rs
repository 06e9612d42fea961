//! Escape suite: every way a job might read, write, list, search, patch or run outside its
//! workspace is refused with `policy_violation`, and nothing outside is read or changed.

use std::os::unix::fs::{symlink, MetadataExt};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::harness::{self, job, job_with, one, Run, Sandbox};

/// The content of `<outside>/secret.txt`; it must never show up in a result or artifact.
const SECRET: &str = "top secret";
/// The message every confinement refusal carries.
const ESCAPE: &str = "path escapes workspace";

/// What lies outside the workspace: file contents (the harness snapshot) plus every entry
/// with its kind and mode, so an empty directory, a new symlink or a chmod is noticed too.
#[derive(Debug, PartialEq, Eq)]
struct Outside {
    files: Vec<(PathBuf, Vec<u8>)>,
    entries: Vec<(PathBuf, String, u32)>,
}

impl Outside {
    fn of(sb: &Sandbox) -> Self {
        Outside {
            files: harness::snapshot(&sb.outside()),
            entries: entries(&sb.outside()),
        }
    }
}

/// Every entry under `dir` (not following symlinks) with its kind and mode.
fn entries(dir: &Path) -> Vec<(PathBuf, String, u32)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)
            .unwrap_or_else(|e| panic!("read_dir {}: {e}", d.display()))
            .flatten()
        {
            let p = e.path();
            let meta = std::fs::symlink_metadata(&p)
                .unwrap_or_else(|e| panic!("lstat {}: {e}", p.display()));
            let kind = if meta.file_type().is_symlink() {
                format!(
                    "symlink -> {}",
                    std::fs::read_link(&p)
                        .unwrap_or_else(|e| panic!("readlink {}: {e}", p.display()))
                        .display()
                )
            } else if meta.is_dir() {
                stack.push(p.clone());
                "dir".to_string()
            } else {
                "file".to_string()
            };
            out.push((p, kind, meta.mode()));
        }
    }
    out.sort();
    out
}

/// A job-step JSON object.
fn step(id: &str, step_type: &str, arguments: Value) -> Value {
    json!({ "id": id, "type": step_type, "arguments": arguments })
}

/// A run_command step running `/bin/sh -c script`.
fn sh(id: &str, script: &str) -> Value {
    step(
        id,
        "run_command",
        json!({ "command": "/bin/sh", "args": ["-c", script] }),
    )
}

/// A run_command step running `ln -s target name` in the workspace.
fn ln_s(id: &str, target: &Path, name: &str) -> Value {
    step(
        id,
        "run_command",
        json!({ "command": "ln", "args": ["-s", target.display().to_string(), name] }),
    )
}

/// Asserts that the job failed with `policy_violation` at step `index` (earlier steps
/// succeeded, later ones were skipped) and that the message contains `needle`.
fn assert_refused(run: &Run, index: usize, needle: &str) {
    let raw = &run.raw;
    assert_eq!(run.failure(), "policy_violation", "{raw:#}");
    assert!(
        run.message().contains(needle),
        "message {:?} lacks {needle:?}",
        run.message()
    );
    assert_eq!(raw["status"], "failure", "{raw:#}");
    assert_eq!(run.code, Some(1), "{raw:#}");
    assert_eq!(raw["error"]["type"], "policy_violation", "{raw:#}");
    let Some(steps) = raw["steps"].as_array() else {
        panic!("no steps array: {raw:#}")
    };
    for (i, s) in steps.iter().enumerate() {
        let want = match i.cmp(&index) {
            std::cmp::Ordering::Less => "success",
            std::cmp::Ordering::Equal => "failure",
            std::cmp::Ordering::Greater => "skipped",
        };
        assert_eq!(s["status"], want, "step {i}: {raw:#}");
    }
    let refused = run.step(index);
    assert_eq!(refused["failure_code"], "policy_violation", "{raw:#}");
    let Some(step_message) = refused["error"].as_str() else {
        panic!("step {index} has no error message: {raw:#}")
    };
    assert!(
        step_message.contains(needle),
        "step message {step_message:?} lacks {needle:?}"
    );
}

/// Asserts that nothing outside changed and that the secret reached neither the result,
/// the runner's output, nor the artifacts directory.
fn assert_nothing_leaked(sb: &Sandbox, run: &Run, before: &Outside) {
    assert_eq!(&Outside::of(sb), before, "the outside directory changed");
    let text = std::fs::read_to_string(sb.result_path())
        .unwrap_or_else(|e| panic!("read result.json: {e}"));
    assert!(!text.contains(SECRET), "secret in result.json: {text}");
    assert!(
        !run.raw.to_string().contains(SECRET),
        "secret in the parsed result"
    );
    for out in [&run.output.stdout, &run.output.stderr] {
        assert!(
            !String::from_utf8_lossy(out).contains(SECRET),
            "secret in the runner's output"
        );
    }
    let digest = hex::encode(Sha256::digest(format!("{SECRET}\n")));
    assert!(
        !text.contains(&digest),
        "the secret's sha256 is in result.json: {text}"
    );
    // Regular files only: a symlink a step planted there is not something the runner copied.
    for (path, kind, _) in entries(&sb.artifacts()) {
        if kind == "file" {
            let content = std::fs::read(&path)
                .unwrap_or_else(|e| panic!("read artifact {}: {e}", path.display()));
            assert!(
                !String::from_utf8_lossy(&content).contains(SECRET),
                "secret copied into artifact {}",
                path.display()
            );
        }
    }
}

/// Runs `job`, expecting step `index` to be refused with a message containing `needle`
/// and nothing outside to be read or changed.
fn refused(sb: &Sandbox, job: &Value, index: usize, needle: &str) -> Run {
    let before = Outside::of(sb);
    let run = sb.run(job);
    assert_refused(&run, index, needle);
    assert_nothing_leaked(sb, &run, &before);
    run
}

/// Runs `job`, expecting success and nothing outside to be read or changed.
fn succeeds_without_leak(sb: &Sandbox, job: &Value) -> Run {
    let before = Outside::of(sb);
    let run = sb.run(job);
    assert_eq!(run.failure(), "none", "{:#}", run.raw);
    assert_eq!(run.raw["status"], "success", "{:#}", run.raw);
    assert_nothing_leaked(sb, &run, &before);
    run
}

fn secret_path(sb: &Sandbox) -> PathBuf {
    sb.outside().join("secret.txt")
}

fn lexists(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok()
}

// --- read_file ---------------------------------------------------------------------------

#[test]
fn read_file_with_dotdot_is_refused() {
    let sb = Sandbox::new();
    let run = refused(
        &sb,
        &one("read_file", json!({ "path": "../outside/secret.txt" })),
        0,
        ESCAPE,
    );
    run.assert_refused_before_start(
        "step s1: path escapes workspace: ../outside/secret.txt (`..` climbs above the root)",
    );
}

#[test]
fn read_file_with_dotdot_after_a_subdirectory_is_refused() {
    let sb = Sandbox::new();
    sb.put("a/file.txt", "inside");
    refused(
        &sb,
        &one("read_file", json!({ "path": "a/../../outside/secret.txt" })),
        0,
        ESCAPE,
    );
}

#[test]
fn read_file_with_dotdot_under_the_contract_root_is_refused() {
    let sb = Sandbox::new();
    refused(
        &sb,
        &one(
            "read_file",
            json!({ "path": "/workspace/../outside/secret.txt" }),
        ),
        0,
        ESCAPE,
    );
}

#[test]
fn read_file_of_absolute_etc_passwd_is_refused() {
    let sb = Sandbox::new();
    let run = refused(
        &sb,
        &one("read_file", json!({ "path": "/etc/passwd" })),
        0,
        ESCAPE,
    );
    assert_eq!(
        run.message(),
        "step s1: path escapes workspace: /etc/passwd (absolute path outside the workspace)"
    );
    assert!(!run.raw.to_string().contains("root:"), "{:#}", run.raw);
}

#[test]
fn read_file_of_absolute_outside_path_is_refused() {
    let sb = Sandbox::new();
    let path = secret_path(&sb).display().to_string();
    refused(&sb, &one("read_file", json!({ "path": path })), 0, ESCAPE);
}

#[test]
fn read_file_of_absolute_path_climbing_out_of_the_workspace_is_refused() {
    let sb = Sandbox::new();
    let path = format!("{}/../outside/secret.txt", sb.ws().display());
    refused(&sb, &one("read_file", json!({ "path": path })), 0, ESCAPE);
}

#[test]
fn read_file_of_proc_self_root_is_refused() {
    let sb = Sandbox::new();
    let run = refused(
        &sb,
        &one("read_file", json!({ "path": "/proc/self/root/etc/passwd" })),
        0,
        ESCAPE,
    );
    assert!(!run.raw.to_string().contains("root:"), "{:#}", run.raw);
}

// --- symlinks made by earlier steps ------------------------------------------------------

#[test]
fn read_file_through_final_symlink_made_by_a_step_is_refused() {
    let sb = Sandbox::new();
    let j = job(json!([
        ln_s("s1", &secret_path(&sb), "leak"),
        step("s2", "read_file", json!({ "path": "leak" })),
    ]));
    let run = refused(&sb, &j, 1, ESCAPE);
    run.assert_message_starts_with("step s2: path escapes workspace: leak");
    assert!(
        lexists(&sb.ws().join("leak")),
        "the step did create the link"
    );
}

#[test]
fn read_file_through_relative_symlink_chain_is_refused() {
    let sb = Sandbox::new();
    // a -> b -> ../outside/secret.txt: each link is relative, the chain still leads out.
    symlink("b", sb.ws().join("a")).expect("symlink");
    symlink("../outside/secret.txt", sb.ws().join("b")).expect("symlink");
    refused(&sb, &one("read_file", json!({ "path": "a" })), 0, ESCAPE);
}

#[test]
fn read_file_through_symlinked_dir_made_by_a_step_is_refused() {
    let sb = Sandbox::new();
    let j = job(json!([
        ln_s("s1", &sb.outside(), "d"),
        step("s2", "read_file", json!({ "path": "d/secret.txt" })),
    ]));
    refused(&sb, &j, 1, ESCAPE);
}

#[test]
fn write_file_through_symlinked_dir_made_by_a_step_is_refused() {
    let sb = Sandbox::new();
    let j = job(json!([
        ln_s("s1", &sb.outside(), "d"),
        step(
            "s2",
            "write_file",
            json!({ "path": "d/x.txt", "content": "pwned" })
        ),
    ]));
    refused(&sb, &j, 1, ESCAPE);
    assert!(!lexists(&sb.outside().join("x.txt")));
}

#[test]
fn write_file_creating_dirs_through_dangling_outward_symlink_is_refused() {
    let sb = Sandbox::new();
    let target = sb.outside().join("made-by-job");
    let j = job(json!([
        ln_s("s1", &target, "dangle"),
        step(
            "s2",
            "write_file",
            json!({ "path": "dangle/sub.txt", "content": "pwned" })
        ),
    ]));
    refused(&sb, &j, 1, ESCAPE);
    assert!(!lexists(&target), "a directory was created outside");
}

#[test]
fn write_file_onto_dangling_outward_symlink_does_not_create_the_target() {
    let sb = Sandbox::new();
    let target = sb.outside().join("target.txt");
    let j = job_with(
        json!([
            ln_s("s1", &target, "dangle"),
            step(
                "s2",
                "write_file",
                json!({ "path": "dangle", "content": "pwned" })
            ),
        ]),
        json!({ "allow_overwrite": true }),
    );
    let before = Outside::of(&sb);
    let run = sb.run(&j);
    assert!(
        !lexists(&target),
        "write_file followed the dangling link out: {:#}",
        run.raw
    );
    assert_nothing_leaked(&sb, &run, &before);
    // Either the link itself was replaced inside the workspace, or the write was refused.
    let link = sb.ws().join("dangle");
    if run.failure() == "none" {
        let meta = std::fs::symlink_metadata(&link).expect("lstat");
        assert!(meta.is_file(), "dangle should now be a regular file");
        assert_eq!(sb.read("dangle"), "pwned");
    } else {
        assert_refused(&run, 1, "");
        assert!(std::fs::symlink_metadata(&link)
            .expect("lstat")
            .file_type()
            .is_symlink());
    }
}

#[test]
fn write_file_onto_outward_file_symlink_replaces_the_link_not_the_target() {
    let sb = Sandbox::new();
    symlink(secret_path(&sb), sb.ws().join("leak")).expect("symlink");
    let j = job_with(
        json!([step(
            "s1",
            "write_file",
            json!({ "path": "leak", "content": "pwned" })
        )]),
        json!({ "allow_overwrite": true }),
    );
    let before = Outside::of(&sb);
    let run = sb.run(&j);
    assert_nothing_leaked(&sb, &run, &before);
    if run.failure() == "none" {
        assert!(std::fs::symlink_metadata(sb.ws().join("leak"))
            .expect("lstat")
            .is_file());
        assert_eq!(sb.read("leak"), "pwned");
    } else {
        assert_refused(&run, 0, "");
    }
}

#[test]
fn symlink_swapped_in_between_steps_is_refused() {
    let sb = Sandbox::new();
    let swap = format!("rm -r d && ln -s '{}' d", sb.outside().display());
    let j = job(json!([
        step(
            "s1",
            "write_file",
            json!({ "path": "d/a.txt", "content": "inside" })
        ),
        sh("s2", &swap),
        step("s3", "read_file", json!({ "path": "d/secret.txt" })),
    ]));
    let run = refused(&sb, &j, 2, ESCAPE);
    run.assert_message_starts_with("step s3: path escapes workspace");
    assert!(std::fs::symlink_metadata(sb.ws().join("d"))
        .expect("lstat")
        .file_type()
        .is_symlink());
}

#[test]
fn read_file_through_symlink_to_proc_self_root_is_refused() {
    let sb = Sandbox::new();
    symlink("/proc/self/root", sb.ws().join("p")).expect("symlink");
    let run = refused(
        &sb,
        &one("read_file", json!({ "path": "p/etc/passwd" })),
        0,
        ESCAPE,
    );
    assert!(!run.raw.to_string().contains("root:"), "{:#}", run.raw);
}

#[test]
fn read_file_of_hard_link_to_outside_file_is_refused() {
    let sb = Sandbox::new();
    std::fs::hard_link(secret_path(&sb), sb.ws().join("leak")).expect("hard link");
    let run = refused(&sb, &one("read_file", json!({ "path": "leak" })), 0, ESCAPE);
    assert_eq!(
        run.message(),
        "step s1: path escapes workspace: leak (file has several hard links)"
    );
}

// --- write_file --------------------------------------------------------------------------

#[test]
fn write_file_with_dotdot_is_refused() {
    let sb = Sandbox::new();
    let j = one(
        "write_file",
        json!({ "path": "../outside/new.txt", "content": "pwned" }),
    );
    refused(&sb, &j, 0, ESCAPE);
    assert!(!lexists(&sb.outside().join("new.txt")));
}

#[test]
fn write_file_of_absolute_outside_path_is_refused() {
    let sb = Sandbox::new();
    let path = sb.outside().join("new.txt");
    let j = one(
        "write_file",
        json!({ "path": path.display().to_string(), "content": "pwned" }),
    );
    refused(&sb, &j, 0, ESCAPE);
    assert!(!lexists(&path));
}

#[test]
fn write_file_overwriting_outside_secret_by_absolute_path_is_refused() {
    let sb = Sandbox::new();
    let path = secret_path(&sb).display().to_string();
    let j = job_with(
        json!([step(
            "s1",
            "write_file",
            json!({ "path": path, "content": "pwned" })
        )]),
        json!({ "allow_overwrite": true }),
    );
    refused(&sb, &j, 0, ESCAPE);
}

// --- apply_unified_diff ------------------------------------------------------------------

#[test]
fn diff_with_dotdot_paths_is_refused() {
    let sb = Sandbox::new();
    let diff = "--- a/../outside/secret.txt\n+++ b/../outside/secret.txt\n@@ -1 +1 @@\n-top secret\n+pwned\n";
    let run = refused(
        &sb,
        &one("apply_unified_diff", json!({ "diff": diff })),
        0,
        ESCAPE,
    );
    assert_eq!(run.step(0)["result"], json!(null));
}

#[test]
fn diff_through_symlinked_dir_is_refused() {
    let sb = Sandbox::new();
    symlink(sb.outside(), sb.ws().join("link")).expect("symlink");
    let diff = "--- a/link/secret.txt\n+++ b/link/secret.txt\n@@ -1 +1 @@\n-top secret\n+pwned\n";
    refused(
        &sb,
        &one("apply_unified_diff", json!({ "diff": diff })),
        0,
        ESCAPE,
    );
}

#[test]
fn diff_through_relative_symlinked_dir_is_refused() {
    let sb = Sandbox::new();
    symlink("../outside", sb.ws().join("up")).expect("symlink");
    let diff = "--- a/up/secret.txt\n+++ b/up/secret.txt\n@@ -1 +1 @@\n-top secret\n+pwned\n";
    refused(
        &sb,
        &one("apply_unified_diff", json!({ "diff": diff })),
        0,
        ESCAPE,
    );
}

#[test]
fn diff_deleting_through_symlinked_dir_is_refused() {
    let sb = Sandbox::new();
    symlink(sb.outside(), sb.ws().join("link")).expect("symlink");
    let diff = "--- a/link/secret.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-top secret\n";
    refused(
        &sb,
        &one("apply_unified_diff", json!({ "diff": diff })),
        0,
        ESCAPE,
    );
    assert!(secret_path(&sb).exists());
}

#[test]
fn diff_creating_absolute_etc_path_is_refused() {
    let sb = Sandbox::new();
    let existed = lexists(Path::new("/etc/evil"));
    let diff = "--- /dev/null\n+++ /etc/evil\n@@ -0,0 +1 @@\n+pwned\n";
    refused(
        &sb,
        &one("apply_unified_diff", json!({ "diff": diff })),
        0,
        ESCAPE,
    );
    assert_eq!(lexists(Path::new("/etc/evil")), existed);
}

#[test]
fn diff_creating_absolute_outside_path_is_refused() {
    let sb = Sandbox::new();
    let target = sb.outside().join("evil");
    let diff = format!(
        "--- /dev/null\n+++ {}\n@@ -0,0 +1 @@\n+pwned\n",
        target.display()
    );
    refused(
        &sb,
        &one("apply_unified_diff", json!({ "diff": diff })),
        0,
        ESCAPE,
    );
    assert!(!lexists(&target));
}

#[test]
fn diff_renaming_a_file_out_of_the_workspace_is_refused() {
    let sb = Sandbox::new();
    sb.put("mine.txt", "mine\n");
    let diff = "diff --git a/mine.txt b/../outside/mine.txt\nsimilarity index 100%\n\
                rename from mine.txt\nrename to ../outside/mine.txt\n";
    refused(
        &sb,
        &one("apply_unified_diff", json!({ "diff": diff })),
        0,
        ESCAPE,
    );
    assert_eq!(sb.read("mine.txt"), "mine\n");
}

#[test]
fn diff_on_hard_link_to_outside_file_is_refused() {
    let sb = Sandbox::new();
    std::fs::hard_link(secret_path(&sb), sb.ws().join("leak")).expect("hard link");
    let diff = "--- a/leak\n+++ b/leak\n@@ -1 +1 @@\n-top secret\n+pwned\n";
    refused(
        &sb,
        &one("apply_unified_diff", json!({ "diff": diff })),
        0,
        "hard links",
    );
}

// --- list_tree ---------------------------------------------------------------------------

#[test]
fn list_tree_of_parent_is_refused() {
    let sb = Sandbox::new();
    let run = refused(&sb, &one("list_tree", json!({ "path": ".." })), 0, ESCAPE);
    assert!(!run.raw.to_string().contains("secret.txt"), "{:#}", run.raw);
}

#[test]
fn list_tree_of_outward_symlink_is_refused() {
    let sb = Sandbox::new();
    symlink(sb.outside(), sb.ws().join("link")).expect("symlink");
    let run = refused(&sb, &one("list_tree", json!({ "path": "link" })), 0, ESCAPE);
    assert!(!run.raw.to_string().contains("secret.txt"), "{:#}", run.raw);
}

#[test]
fn list_tree_reports_outward_symlinks_without_children() {
    let sb = Sandbox::new();
    sb.put("a.txt", "a");
    symlink(sb.outside(), sb.ws().join("link")).expect("symlink");
    symlink(secret_path(&sb), sb.ws().join("leak")).expect("symlink");
    let run = succeeds_without_leak(&sb, &one("list_tree", json!({})));
    assert_eq!(
        run.step(0)["result"]["tree"],
        json!({
            "name": ".",
            "type": "dir",
            "children": [
                { "name": "a.txt", "type": "file", "size_bytes": 1 },
                { "name": "leak", "type": "symlink" },
                { "name": "link", "type": "symlink" }
            ]
        })
    );
    assert!(!run.raw.to_string().contains("secret.txt"), "{:#}", run.raw);
}

// --- search_files ------------------------------------------------------------------------

#[test]
fn search_files_of_parent_dir_is_refused() {
    let sb = Sandbox::new();
    let j = one(
        "search_files",
        json!({ "pattern": "secret", "path": "../outside" }),
    );
    refused(&sb, &j, 0, ESCAPE);
}

#[test]
fn search_files_in_outward_symlink_dir_is_refused() {
    let sb = Sandbox::new();
    symlink(sb.outside(), sb.ws().join("link")).expect("symlink");
    let j = one(
        "search_files",
        json!({ "pattern": "secret", "path": "link" }),
    );
    refused(&sb, &j, 0, ESCAPE);
}

#[test]
fn search_files_does_not_follow_outward_symlinks() {
    let sb = Sandbox::new();
    sb.put("mine.txt", "my secret\n");
    symlink(sb.outside(), sb.ws().join("link")).expect("symlink");
    symlink(secret_path(&sb), sb.ws().join("leak")).expect("symlink");
    std::fs::hard_link(secret_path(&sb), sb.ws().join("hard")).expect("hard link");
    let run = succeeds_without_leak(&sb, &one("search_files", json!({ "pattern": "secret" })));
    assert_eq!(
        run.step(0)["result"],
        json!({ "matches": [{ "path": "mine.txt", "line": 1, "text": "my secret" }], "truncated": false })
    );
}

// --- run_command -------------------------------------------------------------------------

#[test]
fn run_command_working_dir_parent_is_refused() {
    let sb = Sandbox::new();
    let j = one(
        "run_command",
        json!({ "command": "cat", "args": ["outside/secret.txt"], "working_dir": ".." }),
    );
    let run = refused(&sb, &j, 0, ESCAPE);
    assert_eq!(run.step(0)["result"], json!(null));
}

#[test]
fn run_command_working_dir_through_outward_symlink_is_refused() {
    let sb = Sandbox::new();
    symlink(sb.outside(), sb.ws().join("d")).expect("symlink");
    let j = one(
        "run_command",
        json!({ "command": "/bin/sh", "args": ["-c", "cat secret.txt; echo pwned > new.txt"], "working_dir": "d" }),
    );
    let run = refused(&sb, &j, 0, ESCAPE);
    assert_eq!(run.step(0)["result"], json!(null));
}

#[test]
fn run_command_working_dir_absolute_outside_is_refused() {
    let sb = Sandbox::new();
    let j = one(
        "run_command",
        json!({ "command": "cat", "args": ["secret.txt"], "working_dir": sb.outside().display().to_string() }),
    );
    refused(&sb, &j, 0, ESCAPE);
}

// --- artifacts ---------------------------------------------------------------------------

#[test]
fn artifacts_glob_skips_outward_links() {
    let sb = Sandbox::new();
    sb.put("real.txt", "real");
    symlink(secret_path(&sb), sb.ws().join("leak")).expect("symlink");
    symlink(sb.outside(), sb.ws().join("link")).expect("symlink");
    std::fs::hard_link(secret_path(&sb), sb.ws().join("hard")).expect("hard link");
    let mut j = job(json!([step(
        "s1",
        "write_file",
        json!({ "path": "made.txt", "content": "made" })
    )]));
    j["artifacts"] = json!(["**"]);
    let run = succeeds_without_leak(&sb, &j);
    let listed: Vec<&str> = run.raw["artifacts"]
        .as_array()
        .expect("artifacts array")
        .iter()
        .map(|a| a["path"].as_str().expect("artifact path"))
        .collect();
    assert_eq!(listed, ["made.txt", "real.txt"]);
    let copied: Vec<(String, String)> = entries(&sb.artifacts())
        .into_iter()
        .map(|(p, kind, _)| {
            let rel = p.strip_prefix(sb.artifacts()).expect("under artifacts");
            (rel.display().to_string(), kind)
        })
        .collect();
    assert_eq!(
        copied,
        [
            ("made.txt".to_string(), "file".to_string()),
            ("real.txt".to_string(), "file".to_string())
        ]
    );
}

// --- allowlists --------------------------------------------------------------------------

#[test]
fn write_file_outside_allowed_paths_is_refused() {
    let sb = Sandbox::new();
    let j = job_with(
        json!([step(
            "s1",
            "write_file",
            json!({ "path": "other.txt", "content": "x" })
        )]),
        json!({ "allowed_paths": ["src"] }),
    );
    let run = refused(&sb, &j, 0, "constraints.allowed_paths");
    assert_eq!(
        run.message(),
        "step s1: path other.txt is outside constraints.allowed_paths"
    );
    assert!(!lexists(&sb.ws().join("other.txt")));
}

#[test]
fn dotdot_out_of_an_allowed_path_is_refused() {
    let sb = Sandbox::new();
    let j = job_with(
        json!([step(
            "s1",
            "write_file",
            json!({ "path": "src/../other.txt", "content": "x" })
        )]),
        json!({ "allowed_paths": ["src"] }),
    );
    refused(&sb, &j, 0, "constraints.allowed_paths");
    assert!(!lexists(&sb.ws().join("other.txt")));
}

#[test]
fn allowed_path_that_is_an_outward_symlink_is_still_confined() {
    let sb = Sandbox::new();
    symlink(sb.outside(), sb.ws().join("src")).expect("symlink");
    let j = job_with(
        json!([step(
            "s1",
            "write_file",
            json!({ "path": "src/x.txt", "content": "pwned" })
        )]),
        json!({ "allowed_paths": ["src"] }),
    );
    refused(&sb, &j, 0, ESCAPE);
}

#[test]
fn run_command_outside_allowed_commands_is_refused() {
    let sb = Sandbox::new();
    let j = job_with(
        json!([step(
            "s1",
            "run_command",
            json!({ "command": "cat", "args": [secret_path(&sb).display().to_string()] })
        )]),
        json!({ "allowed_commands": ["echo"] }),
    );
    let run = refused(&sb, &j, 0, "constraints.allowed_commands");
    run.assert_refused_before_start(
        "step s1: command `cat` is not in constraints.allowed_commands",
    );
}

#[test]
fn artifacts_dir_symlink_planted_by_a_step_is_not_reported() {
    let sb = Sandbox::new();
    let plant = format!(
        "ln -s '{}' \"$CYNODE_ARTIFACTS_DIR/leak\"",
        secret_path(&sb).display()
    );
    let run = succeeds_without_leak(&sb, &job(json!([sh("s1", &plant)])));
    assert_eq!(run.raw["artifacts"], json!([]));
    assert!(
        lexists(&sb.artifacts().join("leak")),
        "the step did plant the link"
    );
}

#[test]
fn artifact_copy_through_symlink_planted_in_artifacts_dir_is_refused() {
    let sb = Sandbox::new();
    sb.put("reports/a.txt", "report");
    let plant = format!(
        "ln -s '{}' \"$CYNODE_ARTIFACTS_DIR/reports\"",
        sb.outside().display()
    );
    let mut j = job(json!([sh("s1", &plant)]));
    j["artifacts"] = json!(["reports/**"]);
    let before = Outside::of(&sb);
    let run = sb.run(&j);
    assert_nothing_leaked(&sb, &run, &before);
    assert_eq!(run.failure(), "policy_violation", "{:#}", run.raw);
    assert_eq!(run.raw["status"], "failure");
    assert_eq!(run.step(0)["status"], "success");
    run.assert_message_starts_with("artifacts: path escapes workspace: reports");
    assert!(!lexists(&sb.outside().join("a.txt")));
}

#[test]
fn allowed_commands_cannot_be_bypassed_with_a_workspace_script() {
    let sb = Sandbox::new();
    let run = sb.run(&job_with(
        serde_json::json!([
            { "id": "w", "type": "write_file", "arguments": { "path": "bin/echo", "content": "#!/bin/sh\ncat ../outside/secret.txt\n", "mode": "0755" } },
            { "id": "rel", "type": "run_command", "arguments": { "command": "./bin/echo" } }
        ]),
        serde_json::json!({ "allowed_commands": ["echo"] }),
    ));
    assert_eq!(run.failure(), "policy_violation");
    assert_eq!(
        run.message(),
        "step rel: command `./bin/echo` is not in constraints.allowed_commands"
    );
    let run = sb.run(&job_with(
        serde_json::json!([
            { "id": "path", "type": "run_command", "arguments": { "command": "echo", "args": ["ok"], "env": { "PATH": "bin" } } }
        ]),
        serde_json::json!({ "allowed_commands": ["echo"] }),
    ));
    // The step's PATH cannot redirect an allowed bare name to the workspace script.
    assert_eq!(run.failure(), "none", "{}", run.message());
    assert_eq!(run.step(0)["result"]["stdout"], "ok\n");
}
