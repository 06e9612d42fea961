//! No host path is readable inside a sandbox: a job and a session command read every
//! `/proc/*/cmdline`, `/proc/*/environ`, `/proc/*/mountinfo` and `/proc/*/maps` they can
//! (PID 1's included: bwrap's own under bwrap), in one shell command, and the host parses
//! the dump. Nothing in it may name the node's directory (its state directory, the
//! test's temp directory), the image's exported root filesystem, the worker's build
//! directory, or any other host path that is not part of the image: a path that exists on
//! the host and not in the image, taken from argv, environment, a mount's root, source and
//! options, and a mapped file. A mount point is a path inside the sandbox, never checked.
//!
//! Runs on every backend of the shared suites, on bwrap with warm sandboxes
//! (`bwrap_warm`), and on the microVM. Where a backend shows a host path that the node
//! cannot hide, it is matched by [`residual`] (and listed in THREAT_MODEL's residuals), by
//! backend, as narrowly as it shows, with the reason.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;

use crate::harness::{env, session_guard, unique, Server};

on_both_backends!(host_paths: no_host_path_in_any_proc_file);

/// The contract-only backend, bwrap with warm sandboxes (a `bwrap_warm` node's first job
/// is warm, `bwrap_warm::wait_first_slot`) and the engines with their warm pools
/// (`warm_pool.rs`); the changeset sandbox (bwrap on every backend: one run).
mod more {
    on_both_backends!(@one host_paths microvm [no_host_path_in_any_proc_file]);
    on_both_backends!(@one host_paths bwrap_warm [no_host_path_in_any_proc_file]);
    on_both_backends!(@one host_paths podman_warm [no_host_path_in_any_proc_file]);
    on_both_backends!(@one host_paths docker_warm [no_host_path_in_any_proc_file]);
    on_both_backends!(@one host_paths runsc_warm [no_host_path_in_any_proc_file]);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_host_path_in_the_changeset_sandbox() {
        crate::cases::setup();
        crate::host_paths::no_host_path_in_the_changeset_sandbox().await;
    }
}

/// Dumps, for every process it can see, each of the four files it can read, NULs as
/// newlines, each under a `== <path>` line; ends with `== end`.
const DUMP: &str = "for p in /proc/[0-9]*; do for f in cmdline environ mountinfo maps; do \
     if tr '\\0' '\\n' < $p/$f > /tmp/.d 2>/dev/null; then echo \"== $p/$f\"; cat /tmp/.d; fi; \
     done; done; rm -f /tmp/.d; echo '== end'";

/// Why `leak`, shown by a sandbox of `backend`, is a known residual the node cannot hide;
/// `None` for every other leak.
fn residual(backend: &str, view: &HostView, leak: &Leak) -> Option<&'static str> {
    let bwrap = matches!(backend, "bwrap" | "bwrap_warm");
    // PID 1 of a bwrap sandbox is bwrap's reaper: its maps name bwrap's binary and the
    // shared libraries it loads, the host distribution's paths.
    if bwrap
        && leak.file == "/proc/1/maps"
        && (Some(leak.what.as_str()) == view.bwrap.as_deref()
            || (leak.what.starts_with("/usr/lib/") || leak.what.starts_with("/lib"))
                && leak.what.contains(".so"))
    {
        return Some("bwrap's own binary and libraries in its PID 1's maps");
    }
    // A node that is not root binds the root filesystem directory itself as `/`: the
    // root of that mount is the directory's path in the filesystem that holds it (a bind
    // mount's root is a path in its source filesystem). A root node binds an overlay view
    // of it, whose root is `/` (`backend::bwrap::root_view`).
    // SAFETY: geteuid has no preconditions.
    let node_is_root = unsafe { libc::geteuid() } == 0;
    if bwrap && !node_is_root && leak.file.ends_with("/mountinfo") {
        let f: Vec<&str> = leak.line.split(' ').collect();
        if f.get(4) == Some(&"/") && f.get(3) == Some(&view.rootfs_root.as_str()) {
            return Some("the root filesystem's directory as the root of `/` in mountinfo");
        }
    }
    // Podman's and Docker's root is an overlay mount of the engine's image store, whose
    // options name its layer directories on the host.
    if matches!(backend, "podman" | "docker" | "podman_warm" | "docker_warm")
        && leak.file.ends_with("/mountinfo")
    {
        let f: Vec<&str> = leak.line.split(' ').collect();
        let sep = f.iter().position(|x| *x == "-");
        let fstype = sep.and_then(|i| f.get(i + 1));
        if f.get(3) == Some(&"/") && f.get(4) == Some(&"/") && fstype == Some(&"overlay") {
            return Some("the engine's image layers in the options of its overlay root");
        }
        // The files the engine writes for each container and binds in: their root is the
        // container's directory in the engine's storage.
        let engine_files = [
            "/etc/hosts",
            "/etc/hostname",
            "/etc/resolv.conf",
            "/etc/passwd",
            "/etc/group",
        ];
        let root = f.get(3).copied().unwrap_or("");
        let in_container_dir = root.contains("/overlay-containers/")
            || root.starts_with("/var/lib/docker/containers/");
        if in_container_dir && f.get(4).is_some_and(|at| engine_files.contains(at)) {
            return Some("the engine's per-container files, bound from its storage");
        }
        // A session container's init (`--init`): the engine binds the host's binary in.
        let init_at = ["/run/podman-init", "/usr/sbin/docker-init"];
        if f.get(4).is_some_and(|at| init_at.contains(at)) && f.get(3) == Some(&leak.what.as_str())
        {
            return Some("the engine's init binary, bound from the host into a session");
        }
    }
    None
}

/// One finding: the file it was read from, its line, and what in it is a host path.
#[derive(Debug)]
struct Leak {
    file: String,
    line: String,
    what: String,
}

/// What a dump names of the host (see the module docs).
struct HostView {
    /// Substrings that name the node or this test on the host.
    needles: Vec<String>,
    /// The image's root filesystem (a path in it is the image's).
    image: PathBuf,
    /// bwrap's binary on the host.
    bwrap: Option<String>,
    /// The image's root filesystem as a path in the filesystem that holds it (the root of
    /// a bind mount of it).
    rootfs_root: String,
}

impl HostView {
    fn for_server(sv: &Server) -> HostView {
        let mut needles = vec![
            sv.dir.path().display().to_string(),
            sv.state_dir().display().to_string(),
            env().rootfs.display().to_string(),
            "/var/cache/cynode".to_string(),
            // Any test's temp directory (tempfile's names).
            format!("{}/.tmp", std::env::temp_dir().display()),
            // The engines' storage and run directories (a container's own are gone by the
            // time the dump is parsed, so the existence check cannot see them).
            "/var/lib/containers/".to_string(),
            "/containers/storage/".to_string(),
            "overlay-containers".to_string(),
            "/run/libpod".to_string(),
            "/var/lib/docker/".to_string(),
            "/run/docker".to_string(),
            "/var/run/docker".to_string(),
        ];
        if let Some(target) = PathBuf::from(env!("CARGO_BIN_EXE_cynode-worker"))
            .parent()
            .and_then(Path::parent)
        {
            needles.push(target.display().to_string());
        }
        if let Ok(exe) = std::env::current_exe() {
            needles.push(exe.display().to_string());
        }
        let bwrap = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|d| d.join("bwrap"))
            .find(|p| p.is_file())
            .and_then(|p| p.canonicalize().ok())
            .map(|p| p.display().to_string());
        HostView {
            needles,
            image: env().rootfs.clone(),
            bwrap,
            rootfs_root: root_in_filesystem(&env().rootfs),
        }
    }

    /// Whether `path` (absolute) is a host path outside the image: it exists on the host
    /// and not in the image, and is none of the sandbox's own mount points' trees nor a
    /// directory of the `PATH` the node gives sandboxes.
    fn is_host_only(&self, path: &str) -> bool {
        let sandbox_own = ["/proc", "/sys", "/dev", "/job", "/workspace", "/tmp"];
        if path == "/"
            || cynode_worker::sandbox::DEFAULT_PATH
                .split(':')
                .any(|d| d == path)
            || sandbox_own
                .iter()
                .any(|p| path == *p || path.starts_with(&format!("{p}/")))
        {
            return false;
        }
        let in_image = self.image.join(path.trim_start_matches('/'));
        Path::new(path).symlink_metadata().is_ok() && in_image.symlink_metadata().is_err()
    }

    /// The host paths in `text`: needles anywhere, and absolute paths (split at blanks,
    /// `=`, `,` and `:`) that [`HostView::is_host_only`].
    fn findings(&self, text: &str) -> Vec<String> {
        let mut out: Vec<String> = self
            .needles
            .iter()
            .filter(|n| text.contains(n.as_str()))
            .cloned()
            .collect();
        out.extend(
            text.split(|c: char| c.is_whitespace() || matches!(c, '=' | ',' | ':'))
                .filter(|t| t.starts_with('/') && self.is_host_only(t))
                .map(str::to_string),
        );
        out
    }

    /// The leaks of one `== <file>` section's `line`.
    fn check_line(&self, file: &str, line: &str, leaks: &mut Vec<Leak>) {
        // mountinfo: `id parent maj:min root mountpoint options [optional…] - fstype
        // source super-options`; the mount point is a path of the sandbox.
        let checked = if file.ends_with("/mountinfo") {
            let f: Vec<&str> = line.split(' ').collect();
            let sep = f.iter().position(|x| *x == "-").unwrap_or(f.len());
            let mut parts = vec![f.get(3).copied().unwrap_or("")];
            parts.extend(f.iter().skip(sep + 1));
            parts.join(" ")
        } else if file.ends_with("/maps") {
            // `start-end perms offset dev inode path`
            line.split_whitespace()
                .skip(5)
                .collect::<Vec<_>>()
                .join(" ")
        } else {
            line.to_string()
        };
        for what in self.findings(&checked) {
            leaks.push(Leak {
                file: file.to_string(),
                line: line.to_string(),
                what,
            });
        }
    }

    /// Every leak of a dump (the [`DUMP`] format), without `backend`'s residuals.
    fn leaks(&self, dump: &str, backend: &str) -> Vec<Leak> {
        let mut leaks = Vec::new();
        let mut file = String::new();
        for line in dump.lines() {
            if let Some(f) = line.strip_prefix("== ") {
                file = f.to_string();
                continue;
            }
            self.check_line(&file, line, &mut leaks);
        }
        leaks.retain(|l| residual(backend, self, l).is_none());
        leaks
    }
}

/// Asserts that `dump` (of `what`) read files and shows no host path.
fn assert_no_host_path(view: &HostView, backend: &str, what: &str, dump: &str) {
    assert!(
        dump.contains("/mountinfo\n") && dump.ends_with("== end\n"),
        "{what}: the dump is incomplete:\n{dump}"
    );
    let leaks = view.leaks(dump, backend);
    assert!(
        leaks.is_empty(),
        "{what} on {backend}: {} host path(s) readable inside:\n{}",
        leaks.len(),
        leaks
            .iter()
            .map(|l| format!("  {} in {}: {}", l.what, l.file, l.line))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// A job and a session command read every cmdline, environ, mountinfo and maps file
/// they can; none names a host path.
pub async fn no_host_path_in_any_proc_file(backend: &'static str) {
    let sv = Server::start(backend, "");
    let view = HostView::for_server(&sv);
    let (code, v) = sv.run_job(&unique("j"), "t", &["sh", "-c", DUMP]).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_no_host_path(&view, backend, "job", v["stdout"].as_str().unwrap_or(""));
    match backend {
        // The first job started cold; the next one through a pre-spawned starter.
        "bwrap" => {
            crate::harness::eventually("a bwrap starter ready", Duration::from_secs(30), || {
                metric_now(&sv, "cynode_worker_bwrap_starters_ready").is_some_and(|n| n > 0)
            })
            .await;
            let (code, v) = sv.run_job(&unique("j"), "t", &["sh", "-c", DUMP]).await;
            assert_eq!((code, &v["exit_code"]), (200, &json!(0)), "{v}");
            assert!(
                metric_now(&sv, "cynode_worker_bwrap_starts_total{pool=\"warm\"}")
                    .is_some_and(|n| n > 0),
                "no job started through a starter"
            );
            let out = v["stdout"].as_str().unwrap_or("");
            assert_no_host_path(&view, backend, "starter job", out);
        }
        "bwrap_warm" => assert!(
            metric_now(&sv, "cynode_worker_bwrap_warm_claims_total").is_some_and(|n| n > 0),
            "the job was not warm"
        ),
        _ => {}
    }

    let sid = unique("s");
    let _guard = session_guard(backend, &sid);
    let body =
        json!({ "version": 1, "session_id": sid, "task_id": unique("t"), "image": env().image });
    let (code, v) = sv.post("/v1/worker/sessions", &body).await;
    assert_eq!(code, 201, "{v}");
    let (code, v) = sv
        .post(
            &format!("/v1/worker/sessions/{sid}/exec"),
            &json!({ "version": 1, "command": ["sh", "-c", DUMP] }),
        )
        .await;
    assert_eq!(code, 200, "{v}");
    assert_no_host_path(
        &view,
        backend,
        "session command",
        v["stdout"].as_str().unwrap_or(""),
    );
    let (code, _) = sv
        .post(
            &format!("/v1/worker/sessions/{sid}/end"),
            &json!({ "version": 1 }),
        )
        .await;
    assert!(code < 300, "end: {code}");
}

/// `dir` as a path in the filesystem that holds it: what mountinfo shows as the root of a
/// bind mount of it (the longest mount point above it taken off).
fn root_in_filesystem(dir: &Path) -> String {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let best = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            Some((*f.get(3)?, Path::new(*f.get(4)?)))
        })
        .filter(|(_, at)| dir.starts_with(at))
        .max_by_key(|(_, at)| at.as_os_str().len());
    match best {
        Some((root, at)) => {
            let rest = dir.strip_prefix(at).unwrap_or(&dir);
            if rest.as_os_str().is_empty() {
                root.to_string()
            } else {
                Path::new(root).join(rest).display().to_string()
            }
        }
        None => dir.display().to_string(),
    }
}

/// The value of the `/metrics` line named `name` (blocking; called from `eventually`).
fn metric_now(sv: &Server, name: &str) -> Option<u64> {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(&sv.addr).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let req = format!(
        "GET /metrics HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
        sv.addr,
        crate::harness::TOKEN
    );
    c.write_all(req.as_bytes()).ok()?;
    let mut text = String::new();
    c.read_to_string(&mut text).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// A seeded repository's clean filter, which runs in the changeset sandbox (bwrap over the
/// host's `/usr` and the workspace, on every backend), dumps what it can read as the new
/// content of a file; the changeset shows it. Nothing in it names the node's directory,
/// this test's, the image's root filesystem or the build directory (the host's `/usr` is
/// that sandbox's content by design, so only these are checked).
pub async fn no_host_path_in_the_changeset_sandbox() {
    let sv = Server::start("bwrap", "");
    let view = HostView::for_server(&sv);
    let src = tempfile::tempdir().unwrap();
    let r = src.path().join("r");
    std::fs::create_dir_all(&r).unwrap();
    std::fs::write(r.join("a.txt"), "one\n").unwrap();
    crate::workspaces::git(&r, &["init", "-q"]);
    crate::workspaces::git(&r, &["add", "a.txt"]);
    crate::workspaces::git(&r, &["commit", "-q", "-m", "init"]);
    std::fs::create_dir_all(r.join(".git/info")).unwrap();
    std::fs::write(r.join(".git/info/attributes"), "a.txt filter=dump\n").unwrap();
    std::fs::write(r.join(".git/dump.sh"), format!("cat >/dev/null\n{DUMP}\n")).unwrap();
    let mut cfg = std::fs::read_to_string(r.join(".git/config")).unwrap();
    cfg.push_str("[filter \"dump\"]\n\tclean = sh .git/dump.sh\n");
    std::fs::write(r.join(".git/config"), cfg).unwrap();
    std::fs::write(r.join("a.txt"), "two\n").unwrap();
    let mut tar = tar::Builder::new(Vec::new());
    tar.follow_symlinks(false);
    tar.append_dir_all(".", &r).unwrap();
    let ws = unique("ws");
    let (code, v) = sv.put_tar(&ws, tar.into_inner().unwrap()).await;
    assert_eq!(code, 201, "{v}");
    let resp = sv
        .client
        .get(sv.url(&format!("/v1/worker/workspaces/{ws}/changeset")))
        .bearer_auth(crate::harness::TOKEN)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let diff = resp.text().await.unwrap();
    assert_eq!(status, 200, "{diff}");
    let dump: String = diff
        .lines()
        .filter_map(|l| l.strip_prefix('+'))
        .filter(|l| !l.starts_with("++"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(
        dump.contains("== /proc/1/cmdline\n") && dump.ends_with("== end\n"),
        "the filter's dump is incomplete:\n{diff}"
    );
    let leaks: Vec<String> = dump
        .lines()
        .flat_map(|l| {
            view.needles
                .iter()
                .filter(|n| l.contains(n.as_str()))
                .map(move |n| format!("  {n}: {l}"))
        })
        .collect();
    assert!(
        leaks.is_empty(),
        "host paths readable in the changeset sandbox:\n{}",
        leaks.join("\n")
    );
}
