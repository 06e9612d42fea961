//! Attacks through workspaces, each by a real job or a hostile tar: a workspace `.git`
//! that makes the node's changeset run commands (fsmonitor, diff.external, textconv and
//! clean filters), tars that seed links out of the workspace, seeding while a sandbox runs
//! in the workspace, and tar export of links. Each asserts that nothing reached the host.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

// Archives written raw, so the node's own checks are what is tested.
use cynode_testkit::tar::tar_of as tar;

use crate::harness::{command_job, env, seed_config, unique, Server, TOKEN};
use crate::workspaces::git;

const BACKENDS: [&str; 2] = ["bwrap", "podman"];

/// A host directory any uid may write to, so a command run on the host (as root or not)
/// would leave its mark there.
fn marker_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    d
}

fn assert_empty(dir: &Path, what: &str) {
    let found: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            let p = e.path();
            format!("{}: {:?}", p.display(), std::fs::read_to_string(&p).ok())
        })
        .collect();
    assert!(found.is_empty(), "{what}: the host was reached: {found:?}");
}

/// A committed repository at `root/name` with `a.txt`.
fn repo(root: &Path, name: &str) -> PathBuf {
    let r = root.join(name);
    std::fs::create_dir_all(&r).unwrap();
    std::fs::write(r.join("a.txt"), "one\n").unwrap();
    git(&r, &["init", "-q"]);
    git(&r, &["add", "a.txt"]);
    git(&r, &["commit", "-q", "-m", "init"]);
    r
}

fn tar_of_dir(dir: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    b.append_dir_all(".", dir).unwrap();
    b.into_inner().unwrap()
}

async fn changeset(sv: &Server, ws: &str) -> (u16, String) {
    let r = sv
        .client
        .get(sv.url(&format!("/v1/worker/workspaces/{ws}/changeset")))
        .bearer_auth(TOKEN)
        .timeout(Duration::from_secs(180))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn run_in(sv: &Server, ws: &str, script: &str) -> Value {
    let mut job = command_job(&unique("j"), "t", &["sh", "-c", script]);
    job["workspace_id"] = json!(ws);
    let (_, v) = sv.post("/v1/worker/jobs:run", &job).await;
    assert_eq!(v["status"], "completed", "{v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changeset_ignores_a_jobs_fsmonitor() {
    env();
    let src = tempfile::tempdir().unwrap();
    let body = tar_of_dir(&repo(src.path(), "r"));
    for backend in BACKENDS {
        let marks = marker_dir();
        let m = marks.path().join("fsmonitor");
        let sv = Server::start(backend, "");
        let ws = unique("ws");
        assert_eq!(sv.put_tar(&ws, body.clone()).await.0, 201);
        // The job makes its repository run `id` through core.fsmonitor (and friends).
        let script = format!(
            "printf '[core]\\n\\tfsmonitor = \"id > {m}\"\\n\\thooksPath = /nonexistent\\n[diff]\\n\\texternal = \"id >> {m}\"\\n' >> .git/config; echo two > a.txt",
            m = m.display()
        );
        run_in(&sv, &ws, &script).await;
        let (code, diff) = changeset(&sv, &ws).await;
        assert_empty(marks.path(), backend);
        assert_eq!(code, 200, "{backend}: {diff}");
        assert!(diff.contains("-one\n+two\n"), "{backend}: {diff}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changeset_ignores_diff_external_of_a_seeded_repo() {
    env();
    let seeds = tempfile::tempdir().unwrap();
    let marks = marker_dir();
    let m = marks.path().join("external");
    let r = repo(seeds.path(), "evil");
    let mut cfg = std::fs::read_to_string(r.join(".git/config")).unwrap();
    cfg.push_str(&format!("[diff]\n\texternal = \"id > {}\"\n", m.display()));
    std::fs::write(r.join(".git/config"), cfg).unwrap();
    for backend in BACKENDS {
        let sv = Server::start(backend, &seed_config(seeds.path()));
        let ws = unique("ws");
        let (code, info) = sv.seed_workspace(&ws, &r).await;
        assert_eq!(code, 201, "{info}");
        run_in(&sv, &ws, "echo two > a.txt").await;
        let (code, diff) = changeset(&sv, &ws).await;
        assert_empty(marks.path(), backend);
        assert_eq!(code, 200, "{backend}: {diff}");
        assert!(
            diff.contains("diff --git a/a.txt b/a.txt"),
            "{backend}: {diff}"
        );
        assert!(diff.contains("-one\n+two\n"), "{backend}: {diff}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changeset_ignores_textconv_and_filter_drivers() {
    env();
    let src = tempfile::tempdir().unwrap();
    let body = tar_of_dir(&repo(src.path(), "r"));
    for backend in BACKENDS {
        let marks = marker_dir();
        let m = marks.path().display().to_string();
        let sv = Server::start(backend, "");
        let ws = unique("ws");
        assert_eq!(sv.put_tar(&ws, body.clone()).await.0, 201);
        let script = format!(
            "echo '* diff=evil filter=evil' > .gitattributes; mkdir -p .git/info; echo '* diff=evil filter=evil' > .git/info/attributes; \
             printf '[diff \"evil\"]\\n\\ttextconv = \"id > {m}/textconv; cat\"\\n[filter \"evil\"]\\n\\tclean = \"id > {m}/clean; cat\"\\n\\tsmudge = \"id > {m}/smudge; cat\"\\n' >> .git/config; \
             echo two > a.txt; touch -d '2001-01-01 00:00:00' a.txt"
        );
        run_in(&sv, &ws, &script).await;
        let (code, diff) = changeset(&sv, &ws).await;
        assert_empty(marks.path(), backend);
        assert_eq!(code, 200, "{backend}: {diff}");
        assert!(diff.contains("+two\n"), "{backend}: {diff}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changeset_without_git_is_against_the_baseline() {
    env();
    let seeds = tempfile::tempdir().unwrap();
    let src = seeds.path().join("plain");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    std::fs::write(src.join("keep.txt"), "k\n").unwrap();
    std::fs::write(src.join("sub/edit.txt"), "old\n").unwrap();
    std::fs::write(src.join("gone.txt"), "g\n").unwrap();
    let sv = Server::start("bwrap", &seed_config(seeds.path()));
    let ws = unique("ws");
    let (code, info) = sv.seed_workspace(&ws, &src).await;
    assert_eq!(code, 201, "{info}");
    run_in(
        &sv,
        &ws,
        "echo new > sub/edit.txt; rm gone.txt; echo added > added.txt",
    )
    .await;
    let (code, diff) = changeset(&sv, &ws).await;
    assert_eq!(code, 200, "{diff}");
    for h in [
        "a/added.txt b/added.txt",
        "a/gone.txt b/gone.txt",
        "a/sub/edit.txt b/sub/edit.txt",
    ] {
        assert!(diff.contains(&format!("diff --git {h}\n")), "{h}: {diff}");
    }
    assert!(!diff.contains("keep.txt"), "{diff}");
    // It applies to a copy of the source.
    let check = seeds.path().join("check");
    std::fs::create_dir_all(check.join("sub")).unwrap();
    for f in ["keep.txt", "sub/edit.txt", "gone.txt"] {
        std::fs::copy(src.join(f), check.join(f)).unwrap();
    }
    std::fs::write(check.join("cs.diff"), &diff).unwrap();
    git(&check, &["apply", "cs.diff"]);
    assert_eq!(
        std::fs::read_to_string(check.join("sub/edit.txt")).unwrap(),
        "new\n"
    );
    assert!(!check.join("gone.txt").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_tars_never_reach_outside_the_workspace() {
    use tar::EntryType::{Char, Directory, Fifo, Link, Regular, Symlink};
    env();
    let sv = Server::start("bwrap", "");
    // <dir>/outside is what `../../../outside` from a workspace reaches.
    let outside = sv.dir.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    let etc_probe = format!("cynode-probe-{}", unique("p"));
    // Refused: a path through a link (`d -> .`, then d/d/d/l -> ../../../outside and a
    // file through it), `..`, and a size the body does not hold.
    let refused: Vec<(&str, Vec<u8>)> = vec![
        (
            "a link chain: d -> . then d/d/d/l -> ../../../outside",
            tar(&[
                ("d", Symlink, ".", b""),
                ("d/d/d/l", Symlink, "../../../outside", b""),
            ]),
        ),
        (
            "through d -> .",
            tar(&[
                ("d", Symlink, ".", b""),
                ("d/d/d/l", Symlink, "../../../outside", b""),
                ("d/d/d/l/pwned", Regular, "", b"evil"),
            ]),
        ),
        (
            "link then file through it",
            tar(&[
                ("up", Symlink, "../../../outside", b""),
                ("up/pwned", Regular, "", b"evil"),
            ]),
        ),
        (
            "dotdot",
            tar(&[("../../../outside/pwned", Regular, "", b"evil")]),
        ),
        ("huge entry", {
            let mut t = tar(&[("big", Regular, "", b"x")]);
            // Claim ~1 TiB in the header without the bytes.
            let mut h = tar::Header::new_gnu();
            h.set_size(1 << 40);
            h.set_mode(0o644);
            h.set_entry_type(Regular);
            h.set_path("huge").unwrap();
            h.set_cksum();
            t.truncate(t.len() - 1024);
            t.extend_from_slice(h.as_bytes());
            t.extend_from_slice(&[b'x'; 4096]);
            t
        }),
    ];
    for (what, body) in refused {
        let ws = unique("ws");
        let (code, v) = sv.put_tar(&ws, body).await;
        assert_eq!(code, 400, "{what}: {v}");
        assert!(
            !sv.state_dir().join("workspaces").join(&ws).exists(),
            "{what}: a refused tar left a workspace"
        );
    }
    // Neutralised: links that only really (not lexically) lead out, absolute links,
    // hard links, devices and FIFOs are left out; the rest is seeded.
    let ws = unique("ws");
    let (code, v) = sv
        .put_tar(
            &ws,
            tar(&[
                ("d", Symlink, ".", b""),
                ("x", Directory, "", b""),
                ("x/l", Symlink, "../d/d/../../../../outside", b""),
                ("x/m", Symlink, "../d/d/../..", b""),
                ("abs", Symlink, "/etc", b""),
                ("abs/", Directory, "", b""),
                (&format!("abs/{etc_probe}"), Regular, "", b"evil"),
                ("hard", Link, "../../../outside/secret", b""),
                ("hard2", Link, "/etc/shadow", b""),
                ("null", Char, "", b""),
                ("fifo", Fifo, "", b""),
                ("ok.txt", Regular, "", b"fine"),
            ]),
        )
        .await;
    assert_eq!(code, 201, "{v}");
    assert_eq!(
        v["skipped"],
        json!(["abs", "fifo", "hard", "hard2", "null", "x/l", "x/m"]),
        "{v}"
    );
    let dir = sv.state_dir().join("workspaces").join(&ws);
    for gone in ["x/l", "x/m", "hard", "hard2", "null", "fifo"] {
        assert!(
            std::fs::symlink_metadata(dir.join(gone)).is_err(),
            "{gone} was seeded"
        );
    }
    assert!(std::fs::symlink_metadata(dir.join("abs")).unwrap().is_dir());
    // A real job sees what was seeded, and the links that stayed resolve inside.
    let v = run_in(&sv, &ws, "cat ok.txt; ls abs; readlink d").await;
    assert_eq!(v["stdout"], format!("fine{etc_probe}\n.\n"), "{v}");
    assert_empty(&outside, "tar seeding");
    assert!(
        !Path::new("/etc").join(&etc_probe).exists(),
        "wrote into the host's /etc"
    );
    assert_empty(&sv.state_dir().join("staging"), "staging left behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeding_while_a_sandbox_runs_in_the_workspace_writes_nothing_outside() {
    env();
    for backend in BACKENDS {
        let sv = Server::start(backend, "");
        let marks = marker_dir();
        let ws = unique("ws");
        let job_id = unique("j");
        // The sandbox keeps swapping in a link where the tar has a directory.
        let script = format!(
            "end=$(( $(date +%s) + 6 )); while [ $(date +%s) -lt $end ]; do ln -sfn {} app 2>/dev/null; rm -f app; done",
            marks.path().display()
        );
        let mut job = command_job(&job_id, "t", &["sh", "-c", &script]);
        job["workspace_id"] = json!(ws);
        let (code, v) = sv.post("/v1/worker/jobs", &job).await;
        assert!(code == 202 || code == 200, "{v}");
        sv.wait_for(&job_id, Duration::from_secs(120), |v| {
            v["status"] == "in_progress"
        })
        .await;
        let body = tar(&[
            ("app", tar::EntryType::Directory, "", b""),
            ("app/hello.txt", tar::EntryType::Regular, "", b"seeded"),
        ]);
        let mut seeded = false;
        for _ in 0..50 {
            let (code, v) = sv.put_tar(&ws, body.clone()).await;
            assert!(code == 201 || code == 409, "{backend}: {v}");
            if code == 201 {
                seeded = true;
                break;
            }
        }
        let end = sv.wait_terminal(&job_id).await;
        assert_empty(marks.path(), backend);
        let dir = sv.state_dir().join("workspaces").join(&ws);
        if seeded {
            assert!(std::fs::symlink_metadata(dir.join("app")).unwrap().is_dir());
            assert_eq!(
                std::fs::read_to_string(dir.join("app/hello.txt")).unwrap(),
                "seeded"
            );
        }
        eprintln!(
            "{backend}: seeded during the job: {seeded}; job {}",
            end["status"]
        );
        // No staging directory at all (no seed attempt got that far) leaves nothing behind
        // either.
        let staging = sv.state_dir().join("staging");
        if staging.exists() {
            assert_empty(&staging, "staging left behind");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tar_export_never_follows_links() {
    env();
    let shadow = std::fs::read("/etc/shadow").unwrap();
    let probe = &shadow[..shadow.len().min(24)];
    for backend in BACKENDS {
        let sv = Server::start(backend, "");
        let ws = unique("ws");
        let job = "mkdir d; echo hi > d/f; ln -s /etc/shadow shadow; ln -s / hostroot; ln -s ../../.. up; mkfifo fifo";
        let mut j = command_job(&unique("j"), "t", &["sh", "-c", job]);
        j["workspace_id"] = json!(ws);
        let (_, v) = sv.post("/v1/worker/jobs:run", &j).await;
        assert_eq!(v["status"], "completed", "{v}");
        let r = sv.get_raw(&format!("/v1/worker/workspaces/{ws}/tar")).await;
        assert_eq!(r.status().as_u16(), 200);
        let bytes = r.bytes().await.unwrap();
        assert!(
            !bytes.windows(probe.len()).any(|w| w == probe),
            "{backend}: /etc/shadow was exported"
        );
        let mut seen = Vec::new();
        for e in tar::Archive::new(&bytes[..]).entries().unwrap() {
            let e = e.unwrap();
            let p = e.path().unwrap().display().to_string();
            let l = e.link_name().unwrap().map(|l| l.display().to_string());
            seen.push((p, e.header().entry_type(), l));
        }
        let has = |p: &str, k: tar::EntryType, l: Option<&str>| {
            seen.contains(&(p.to_string(), k, l.map(str::to_string)))
        };
        assert!(
            has("shadow", tar::EntryType::Symlink, Some("/etc/shadow")),
            "{seen:?}"
        );
        assert!(
            has("up", tar::EntryType::Symlink, Some("../../..")),
            "{seen:?}"
        );
        assert!(has("d/f", tar::EntryType::Regular, None), "{seen:?}");
        assert!(
            !seen
                .iter()
                .any(|s| s.0.starts_with("hostroot/") || s.0.starts_with("up/") || s.0 == "fifo"),
            "{backend}: {seen:?}"
        );
    }
}
