//! Every step type's success and failure, through the real binary.

use serde_json::json;

use crate::harness::{job, job_with, one, sh, Sandbox};

#[test]
fn run_command_captures_stdout_stderr_and_exit_code() {
    let run = Sandbox::run_once(&sh("echo out; echo err >&2"));
    assert_eq!(run.code, Some(0));
    assert_eq!(run.failure(), "none");
    let r = &run.step(0)["result"];
    assert_eq!(
        (
            r["exit_code"].clone(),
            r["stdout"].clone(),
            r["stderr"].clone(),
            r["truncated"].clone()
        ),
        (json!(0), json!("out\n"), json!("err\n"), json!(false))
    );
    assert_eq!(run.step(0)["status"], "success");
}

#[test]
fn run_command_is_argv_only_never_a_shell() {
    let run = Sandbox::run_once(&one(
        "run_command",
        json!({ "command": "echo", "args": ["$HOME; rm -rf /", "`id`"] }),
    ));
    assert_eq!(run.step(0)["result"]["stdout"], "$HOME; rm -rf / `id`\n");
}

#[test]
fn run_command_nonzero_exit_is_step_failed() {
    let run = Sandbox::run_once(&job(json!([
        { "id": "a", "type": "run_command", "arguments": { "command": "sh", "args": ["-c", "exit 3"] } },
        { "id": "b", "type": "run_command", "arguments": { "command": "true" } }
    ])));
    assert_eq!(run.code, Some(1));
    assert_eq!(run.failure(), "step_failed");
    assert_eq!(run.message(), "step a: command `sh` exited with status 3");
    assert_eq!(run.step(0)["result"]["exit_code"], 3);
    assert_eq!(run.step(1)["status"], "skipped");
    assert_eq!(
        run.raw["error"],
        json!({ "type": "step_failed", "message": run.message() })
    );
}

#[test]
fn run_command_environment_is_explicit() {
    let sb = Sandbox::new();
    sb.write_job(&one(
        "run_command",
        json!({ "command": "sh", "args": ["-c", "env | sort"], "env": { "GREETING": "hi" } }),
    ));
    let out = sb
        .command()
        .env("SECRET_TOKEN", "do-not-leak")
        .env("CYNODE_TASK_ID", "task-from-node")
        .output()
        .unwrap();
    let run = sb.finish(out);
    let stdout = run.step(0)["result"]["stdout"]
        .as_str()
        .unwrap()
        .to_string();
    let names: Vec<&str> = stdout
        .lines()
        .map(|l| l.split('=').next().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "CYNODE_ARTIFACTS_DIR",
            "CYNODE_JOB_ID",
            "CYNODE_TASK_ID",
            "CYNODE_WORKSPACE_DIR",
            "GREETING",
            "HOME",
            "LANG",
            "PATH",
            "PWD"
        ]
    );
    assert!(
        stdout.contains("CYNODE_TASK_ID=task-from-node\n"),
        "{stdout}"
    );
    assert!(!stdout.contains("do-not-leak"));
}

/// The node's egress proxy variables reach a step (a `restricted` job's tools find the
/// proxy through them); other variables of the runner still do not.
#[test]
fn run_command_gets_the_egress_proxy_variables() {
    let sb = Sandbox::new();
    sb.write_job(&one(
        "run_command",
        json!({ "command": "sh", "args": ["-c", "echo \"$HTTPS_PROXY $http_proxy $NO_PROXY $CYNODE_EGRESS_ROUTES_URL [$ALL_PROXY]\""] }),
    ));
    let out = sb
        .command()
        .env("HTTPS_PROXY", "http://127.0.0.1:3128")
        .env("http_proxy", "http://127.0.0.1:3128")
        .env("NO_PROXY", "localhost,127.0.0.1")
        .env("CYNODE_EGRESS_ROUTES_URL", "http://127.0.0.1:3128/routes")
        .env("ALL_PROXY", "socks5://elsewhere")
        .output()
        .unwrap();
    let run = sb.finish(out);
    assert_eq!(
        run.step(0)["result"]["stdout"],
        "http://127.0.0.1:3128 http://127.0.0.1:3128 localhost,127.0.0.1 http://127.0.0.1:3128/routes []\n"
    );
}

#[test]
fn run_command_may_not_override_cynode_variables() {
    let run = Sandbox::run_once(&one(
        "run_command",
        json!({ "command": "true", "env": { "CYNODE_JOB_ID": "forged" } }),
    ));
    assert_eq!(run.failure(), "policy_violation");
    assert_eq!(run.message(), "step s1: env may not override CYNODE_JOB_ID");
}

#[test]
fn run_command_stdin_and_working_dir() {
    let sb = Sandbox::new();
    sb.put("sub/marker", "");
    let run = sb.run(&one(
        "run_command",
        json!({ "command": "sh", "args": ["-c", "cat; ls"], "stdin": "from stdin\n", "working_dir": "sub" }),
    ));
    assert_eq!(run.step(0)["result"]["stdout"], "from stdin\nmarker\n");
}

/// The step's process starts in its directory, keeps the name it was given as argv[0],
/// and a script without `#!` is run by the shell, whether the runner is already in that
/// directory (the usual case, started without a fork) or the child changes into it.
#[test]
fn run_command_starts_in_its_directory_with_its_name_and_runs_scripts_without_a_shebang() {
    let sb = Sandbox::new();
    sb.put("plain.sh", "echo plain:$(pwd)\n");
    sb.put("sub/plain.sh", "echo sub:$(pwd)\n");
    for rel in ["plain.sh", "sub/plain.sh"] {
        let p = sb.ws().join(rel);
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    let ws = sb.ws().canonicalize().unwrap();
    let run = sb.run(&job(json!([
        { "id": "a", "type": "run_command", "arguments": { "command": "sh", "args": ["-c", "echo $0 $(pwd)"] } },
        { "id": "b", "type": "run_command", "arguments": { "command": "sh", "args": ["-c", "echo $0 $(pwd)"], "working_dir": "sub" } },
        { "id": "c", "type": "run_command", "arguments": { "command": "./plain.sh" } },
        { "id": "d", "type": "run_command", "arguments": { "command": "./plain.sh", "working_dir": "sub" } }
    ])));
    assert_eq!(run.failure(), "none", "{}", run.raw);
    let out = |i| {
        run.step(i)["result"]["stdout"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(out(0), format!("sh {}\n", ws.display()));
    assert_eq!(out(1), format!("sh {}/sub\n", ws.display()));
    assert_eq!(out(2), format!("plain:{}\n", ws.display()));
    assert_eq!(out(3), format!("sub:{}/sub\n", ws.display()));
}

#[test]
fn run_command_stdin_is_closed_when_not_given() {
    let run = Sandbox::run_once(&one("run_command", json!({ "command": "cat" })));
    assert_eq!(run.failure(), "none");
    assert_eq!(run.step(0)["result"]["stdout"], "");
}

#[test]
fn run_command_step_timeout_is_a_timeout() {
    let run = Sandbox::run_once(&one(
        "run_command",
        json!({ "command": "sleep", "args": ["30"], "timeout_seconds": 1 }),
    ));
    assert_eq!(run.failure(), "timeout");
    assert_eq!(
        run.result.status,
        cynode_protocol::result::JobStatus::Timeout
    );
    assert_eq!(run.step(0)["status"], "timeout");
    assert_eq!(
        run.message(),
        "step s1: command `sleep` exceeded its timeout_seconds of 1s"
    );
}

#[test]
fn write_file_creates_with_mode_and_hash() {
    let sb = Sandbox::new();
    let run = sb.run(&one(
        "write_file",
        json!({ "path": "bin/tool.sh", "content": "#!/bin/sh\necho hi\n", "mode": "0755" }),
    ));
    let content = "#!/bin/sh\necho hi\n";
    assert_eq!(
        run.step(0)["result"],
        json!({
            "path": "bin/tool.sh",
            "size_bytes": 18,
            "sha256": hex_sha256(content.as_bytes()),
            "created": true
        })
    );
    assert_eq!(
        std::fs::read_to_string(sb.ws().join("bin/tool.sh")).unwrap(),
        content
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(sb.ws().join("bin/tool.sh"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o755);
}

fn hex_sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

#[test]
fn write_file_base64() {
    let sb = Sandbox::new();
    let run = sb.run(&one(
        "write_file",
        json!({ "path": "b.bin", "content": "AAEC/w==", "encoding": "base64" }),
    ));
    assert_eq!(run.failure(), "none");
    assert_eq!(
        std::fs::read(sb.ws().join("b.bin")).unwrap(),
        [0, 1, 2, 255]
    );
}

#[test]
fn write_file_refuses_overwrite_unless_allowed() {
    let sb = Sandbox::new();
    sb.put("a.txt", "old");
    let run = sb.run(&one(
        "write_file",
        json!({ "path": "a.txt", "content": "new" }),
    ));
    assert_eq!(run.failure(), "policy_violation");
    assert_eq!(
        run.message(),
        "step s1: refusing to overwrite existing file a.txt: constraints.allow_overwrite is false"
    );
    assert_eq!(sb.read("a.txt"), "old");
    let run = sb.run(&job_with(
        json!([{ "id": "s1", "type": "write_file", "arguments": { "path": "a.txt", "content": "new" } }]),
        json!({ "allow_overwrite": true }),
    ));
    assert_eq!(run.failure(), "none");
    assert_eq!(run.step(0)["result"]["created"], false);
    assert_eq!(sb.read("a.txt"), "new");
}

#[test]
fn write_file_invalid_base64_fails_the_step() {
    let sb = Sandbox::new();
    let run = sb.run(&one(
        "write_file",
        json!({ "path": "b.bin", "content": "***", "encoding": "base64" }),
    ));
    assert_eq!(run.failure(), "step_failed");
    assert!(!sb.ws().join("b.bin").exists());
}

#[test]
fn read_file_text_binary_and_truncated() {
    let sb = Sandbox::new();
    sb.put("t.txt", "hello world\n");
    std::fs::write(sb.ws().join("b.bin"), [0u8, 159, 146, 150]).unwrap();
    let run = sb.run(&job(json!([
        { "id": "t", "type": "read_file", "arguments": { "path": "t.txt" } },
        { "id": "b", "type": "read_file", "arguments": { "path": "b.bin" } },
        { "id": "c", "type": "read_file", "arguments": { "path": "t.txt", "max_bytes": 5 } }
    ])));
    assert_eq!(
        run.step(0)["result"],
        json!({
            "content": "hello world\n", "encoding": "utf8", "size_bytes": 12, "truncated": false,
            "sha256": hex_sha256(b"hello world\n")
        })
    );
    assert_eq!(
        run.step(1)["result"],
        json!({
            "content": "AJ+Slg==", "encoding": "base64", "size_bytes": 4, "truncated": false,
            "sha256": hex_sha256(&[0u8, 159, 146, 150])
        })
    );
    assert_eq!(
        run.step(2)["result"],
        json!({
            "content": "hello", "encoding": "utf8", "size_bytes": 12, "truncated": true,
            "sha256": hex_sha256(b"hello world\n")
        })
    );
}

#[test]
fn read_file_missing_is_step_failed() {
    let run = Sandbox::run_once(&one("read_file", json!({ "path": "nope.txt" })));
    assert_eq!(run.failure(), "step_failed");
    assert_eq!(
        run.message(),
        "step s1: access nope.txt: no such file or directory"
    );
}

const GIT_DIFF: &str = "diff --git a/src/lib.rs b/src/lib.rs
index 1111111..2222222 100644
--- a/src/lib.rs
+++ b/src/lib.rs
@@ -1,3 +1,3 @@
 fn a() {}
-fn b() {}
+fn b() { println!(\"patched\"); }
 fn c() {}
diff --git a/NEW.md b/NEW.md
new file mode 100644
index 0000000..3333333
--- /dev/null
+++ b/NEW.md
@@ -0,0 +1,2 @@
+# New
+no newline here
\\ No newline at end of file
diff --git a/old.txt b/old.txt
deleted file mode 100644
index 4444444..0000000
--- a/old.txt
+++ /dev/null
@@ -1 +0,0 @@
-bye
";

#[test]
fn apply_unified_diff_handles_git_diff_output() {
    let sb = Sandbox::new();
    sb.put("src/lib.rs", "fn a() {}\nfn b() {}\nfn c() {}\n");
    sb.put("old.txt", "bye\n");
    let run = sb.run(&one("apply_unified_diff", json!({ "diff": GIT_DIFF })));
    assert_eq!(run.failure(), "none", "{}", run.message());
    assert_eq!(
        run.step(0)["result"],
        json!({ "files_modified": ["src/lib.rs"], "files_created": ["NEW.md"], "files_deleted": ["old.txt"] })
    );
    assert_eq!(
        sb.read("src/lib.rs"),
        "fn a() {}\nfn b() { println!(\"patched\"); }\nfn c() {}\n"
    );
    assert_eq!(sb.read("NEW.md"), "# New\nno newline here");
    assert!(!sb.ws().join("old.txt").exists());
}

#[test]
fn apply_unified_diff_is_all_or_nothing() {
    let sb = Sandbox::new();
    // lib.rs applies, but old.txt does not match: nothing may change.
    sb.put("src/lib.rs", "fn a() {}\nfn b() {}\nfn c() {}\n");
    sb.put("old.txt", "something else\n");
    let before = crate::harness::snapshot(&sb.ws());
    let run = sb.run(&one("apply_unified_diff", json!({ "diff": GIT_DIFF })));
    assert_eq!(run.failure(), "step_failed");
    let msg = run.message();
    assert!(msg.contains("old.txt") && msg.contains("hunk 1"), "{msg}");
    assert_eq!(crate::harness::snapshot(&sb.ws()), before);
}

#[test]
fn apply_unified_diff_refuses_binary_patches() {
    let sb = Sandbox::new();
    let diff = "diff --git a/img.png b/img.png\nindex 1..2 100644\nGIT binary patch\nliteral 5\nMcmZ?wbaG+V00\n\n";
    let run = sb.run(&one("apply_unified_diff", json!({ "diff": diff })));
    assert_eq!(run.failure(), "step_failed");
    run.assert_message_contains("binary");
}

#[test]
fn list_tree_is_sorted_typed_and_depth_bounded() {
    let sb = Sandbox::new();
    sb.put("b/c/d.txt", "1234");
    sb.put("a.txt", "x");
    std::os::unix::fs::symlink("a.txt", sb.ws().join("link")).unwrap();
    let run = sb.run(&job(json!([
        { "id": "all", "type": "list_tree", "arguments": {} },
        { "id": "shallow", "type": "list_tree", "arguments": { "max_depth": 1 } }
    ])));
    assert_eq!(
        run.step(0)["result"],
        json!({ "tree": { "name": ".", "type": "dir", "children": [
            { "name": "a.txt", "type": "file", "size_bytes": 1 },
            { "name": "b", "type": "dir", "children": [
                { "name": "c", "type": "dir", "children": [
                    { "name": "d.txt", "type": "file", "size_bytes": 4 } ] } ] },
            { "name": "link", "type": "symlink" }
        ] }, "truncated": false })
    );
    assert_eq!(
        run.step(1)["result"]["tree"]["children"][1],
        json!({ "name": "b", "type": "dir" })
    );
}

#[test]
fn list_tree_truncates_at_the_output_cap() {
    let sb = Sandbox::new();
    for i in 0..200 {
        sb.put(&format!("f{i:03}.txt"), "");
    }
    let run = sb.run(&job_with(
        json!([{ "id": "s1", "type": "list_tree", "arguments": {} }]),
        json!({ "max_output_bytes": 2000 }),
    ));
    assert_eq!(run.failure(), "none");
    assert_eq!(run.step(0)["result"]["truncated"], true);
    let n = run.step(0)["result"]["tree"]["children"]
        .as_array()
        .unwrap()
        .len();
    assert!(n > 10 && n < 200, "{n}");
}

#[test]
fn list_tree_missing_path_fails() {
    let run = Sandbox::run_once(&one("list_tree", json!({ "path": "nope" })));
    assert_eq!(run.failure(), "step_failed");
}

#[test]
fn search_files_finds_lines_and_honours_include() {
    let sb = Sandbox::new();
    sb.put("src/a.rs", "fn main() {}\n// TODO: fix\n");
    sb.put("src/b.py", "# TODO: python\n");
    sb.put("bin.dat", "TODO\0binary");
    sb.put(".git/config", "TODO in git\n");
    let run = sb.run(&job(json!([
        { "id": "all", "type": "search_files", "arguments": { "pattern": "TODO" } },
        { "id": "rs", "type": "search_files", "arguments": { "pattern": "TODO", "include": "**/*.rs" } }
    ])));
    assert_eq!(
        run.step(0)["result"],
        json!({ "matches": [
            { "path": "src/a.rs", "line": 2, "text": "// TODO: fix" },
            { "path": "src/b.py", "line": 1, "text": "# TODO: python" }
        ], "truncated": false })
    );
    assert_eq!(
        run.step(1)["result"]["matches"].as_array().unwrap().len(),
        1
    );
}

#[test]
fn search_files_invalid_pattern_fails() {
    let run = Sandbox::run_once(&one("search_files", json!({ "pattern": "(unclosed" })));
    run.assert_failure("step_failed", "step s1: invalid pattern");
}

#[test]
fn artifacts_are_collected_with_hashes() {
    let sb = Sandbox::new();
    let mut j = job(json!([
        { "id": "s1", "type": "run_command", "arguments": { "command": "sh", "args": ["-c",
          "mkdir -p reports && echo '<xml/>' > reports/junit.xml && echo cov > coverage.txt && echo direct > \"$CYNODE_ARTIFACTS_DIR/direct.log\""] } }
    ]));
    j["artifacts"] = json!(["reports/**", "coverage.txt"]);
    let run = sb.run(&j);
    assert_eq!(run.failure(), "none", "{}", run.message());
    assert_eq!(
        run.raw["artifacts"],
        json!([
            { "path": "coverage.txt", "sha256": hex_sha256(b"cov\n"), "size_bytes": 4 },
            { "path": "direct.log", "sha256": hex_sha256(b"direct\n"), "size_bytes": 7 },
            { "path": "reports/junit.xml", "sha256": hex_sha256(b"<xml/>\n"), "size_bytes": 7 }
        ])
    );
    assert_eq!(
        std::fs::read(sb.artifacts().join("reports/junit.xml")).unwrap(),
        b"<xml/>\n"
    );
}
