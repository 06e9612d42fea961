//! A session's files API on the real server, once per backend: the attacks first (paths
//! that leave the workspace, links planted by the sandbox, FIFOs and devices, hard links to
//! files outside, a 20,000-deep tree and a directory past the listing bound, a body over
//! the bound), then reads, writes and listings against what the sandbox's own commands
//! see.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::harness::{answer, env, session_guard, unique, RemoveOnDrop, Server, TOKEN};

on_both_backends!(
    session_files:
    paths_that_leave_the_workspace_are_refused,
    special_files_and_outside_hard_links_are_refused_without_blocking,
    deep_and_wide_directories_are_bounded,
    a_write_over_the_bound_is_refused_and_leaves_nothing,
    files_are_read_written_and_listed_as_the_sandbox_sees_them,
);

// On the microVM (each command a VM of its own under TCG here): the cases that show its
// sessions keep their promises, not every one again.
on_both_backends!(@one session_files microvm [
    paths_that_leave_the_workspace_are_refused,
    files_are_read_written_and_listed_as_the_sandbox_sees_them
]);

/// A running session of a test.
pub(crate) struct Session {
    pub id: String,
    pub task: String,
    pub _cleanup: RemoveOnDrop,
}

impl Session {
    pub(crate) async fn start(sv: &Server) -> Session {
        let id = unique("s");
        let task = unique("t");
        let cleanup = session_guard(sv.backend, &id);
        let body = json!({ "version": 1, "session_id": id, "task_id": task, "image": env().image });
        let (code, v) = sv.post("/v1/worker/sessions", &body).await;
        assert_eq!(code, 201, "{v}");
        Session {
            id,
            task,
            _cleanup: cleanup,
        }
    }

    /// Runs `script` with `sh -c` and answers (exit code, stdout).
    pub(crate) async fn sh(&self, sv: &Server, script: &str) -> (i64, String) {
        let (code, v) = sv
            .post(
                &format!("/v1/worker/sessions/{}/exec", self.id),
                &json!({ "version": 1, "command": ["sh", "-c", script] }),
            )
            .await;
        assert_eq!(code, 200, "{v}");
        (
            v["exit_code"].as_i64().unwrap(),
            v["stdout"].as_str().unwrap().to_string(),
        )
    }

    fn files(&self, query: &str) -> String {
        format!("/v1/worker/sessions/{}/files?{query}", self.id)
    }

    fn workspace(&self, sv: &Server) -> PathBuf {
        sv.state_dir().join("workspaces").join(&self.task)
    }
}

fn q(path: &str) -> String {
    format!("path={}", urlencode(path))
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

async fn put(sv: &Server, path: &str, body: Vec<u8>) -> (u16, Value) {
    let r = sv
        .client
        .put(sv.url(path))
        .bearer_auth(TOKEN)
        .body(body)
        .send()
        .await
        .expect("put");
    answer(r).await
}

/// GET of a file: status and raw bytes.
async fn get_bytes(sv: &Server, path: &str) -> (u16, Vec<u8>) {
    let r = sv.get_raw(path).await;
    let code = r.status().as_u16();
    (code, r.bytes().await.unwrap().to_vec())
}

fn assert_refused(code: u16, v: &Value, status: u16, detail_has: &str) {
    assert_eq!(code, status, "{v}");
    assert_eq!(v["type"], "urn:cynodeai:error:validation", "{v}");
    let d = v["detail"].as_str().unwrap_or_default();
    assert!(d.contains(detail_has), "detail {d:?} lacks {detail_has:?}");
}

/// Names in the workspace's listing.
async fn names(sv: &Server, s: &Session, dir: &str) -> Vec<String> {
    let (code, v) = sv.get(&s.files(&format!("{}&list=true", q(dir)))).await;
    assert_eq!(code, 200, "{v}");
    // A workspace on a disk volume of its own has the filesystem's lost+found.
    v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap().to_string())
        .filter(|n| n != "lost+found")
        .collect()
}

pub async fn paths_that_leave_the_workspace_are_refused(backend: &'static str) {
    let sv = Server::start(backend, "");
    let s = Session::start(&sv).await;
    // The sandbox plants links: to a secret, to the root, to /etc.
    let (code, out) = s
        .sh(
            &sv,
            "ln -s /etc/shadow shadow && ln -s / up && ln -s /etc etc && mkdir d && echo ok",
        )
        .await;
    assert_eq!((code, out.as_str()), (0, "ok\n"));
    // A host file the node must never write through a link.
    let outside = tempfile::tempdir().unwrap();
    let host_target = outside.path().join("pwn");
    let through_root = format!("up{}", host_target.display());
    for (path, detail) in [
        ("../x", "`..`"),
        ("d/../../x", "`..`"),
        ("/etc/passwd", "absolute"),
        ("a\0b", "NUL"),
        ("shadow", "symbolic link"),
        ("up/etc/shadow", "symbolic link"),
        ("etc/passwd", "symbolic link"),
        (through_root.as_str(), "symbolic link"),
    ] {
        let (code, v) = sv.get(&s.files(&q(path))).await;
        assert_refused(code, &v, 400, detail);
        let (code, v) = put(&sv, &s.files(&q(path)), b"owned".to_vec()).await;
        assert_refused(code, &v, 400, detail);
        let (code, v) = sv.get(&s.files(&format!("{}&list=true", q(path)))).await;
        assert_eq!(code, 400, "list {path:?}: {v}");
    }
    assert!(!host_target.exists(), "written through a link");
    // The links are still links (not replaced by a write), and nothing else appeared.
    let (_, v) = sv.get(&s.files("list=true")).await;
    let kinds: Vec<(String, String)> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap().into(),
                e["kind"].as_str().unwrap().into(),
            )
        })
        .filter(|(n, _): &(String, String)| n != "lost+found")
        .collect();
    let want: Vec<(String, String)> = [
        ("d", "dir"),
        ("etc", "symlink"),
        ("shadow", "symlink"),
        ("up", "symlink"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(kinds, want);
    assert!(!s.workspace(&sv).parent().unwrap().join("x").exists());
}

pub async fn special_files_and_outside_hard_links_are_refused_without_blocking(
    backend: &'static str,
) {
    let sv = Server::start(backend, "");
    let s = Session::start(&sv).await;
    // A FIFO: a read must neither block nor read it (the request is bounded by the
    // client's own timeout); a write must not replace it.
    // Made on the host: under gVisor a FIFO the sandbox makes lives in its own kernel only.
    rustix::fs::mknodat(
        rustix::fs::CWD,
        s.workspace(&sv).join("p"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o666),
        0,
    )
    .unwrap();
    let (code, v) = sv.get(&s.files(&q("p"))).await;
    assert_refused(code, &v, 400, "not a regular file but a fifo");
    let (code, v) = put(&sv, &s.files(&q("p")), b"x".to_vec()).await;
    assert_refused(code, &v, 400, "fifo");
    // A device node, where the sandbox can make one at all (it should not).
    let (code, _) = s.sh(&sv, "mknod c c 1 3").await;
    if code == 0 {
        let (code, v) = sv.get(&s.files(&q("c"))).await;
        assert_refused(code, &v, 400, "character device");
    }
    // A hard link to a file outside the workspace cannot be made from inside.
    let (code, out) = s
        .sh(
            &sv,
            "ln /etc/passwd hl 2>/dev/null; ln /etc/hostname hl2 2>/dev/null; for f in hl hl2; do [ -e $f ] && echo $f; done; true",
        )
        .await;
    assert_eq!(code, 0);
    assert!(
        !out.lines().any(|l| l.starts_with("hl")),
        "a hard link to a file outside the workspace was made: {out}"
    );
    // Made by the host (root) where the filesystem allows it: not served.
    let secret = sv.state_dir().join(unique("secret"));
    std::fs::write(&secret, "node secret").unwrap();
    let linked = s.workspace(&sv).join("hostlink");
    if std::fs::hard_link(&secret, &linked).is_ok() {
        let (code, v) = sv.get(&s.files(&q("hostlink"))).await;
        assert_refused(code, &v, 400, "hard link");
        std::fs::remove_file(&linked).unwrap();
    }
    std::fs::remove_file(&secret).unwrap();
    // A listing names them for what they are, following nothing.
    let (_, v) = sv.get(&s.files("list=true")).await;
    let p = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "p")
        .cloned();
    assert_eq!(p.map(|e| e["kind"].clone()), Some(json!("fifo")));
}

/// Makes `depth` nested directories `d` beneath `top` on the host (one name at a time:
/// never a path past PATH_MAX).
fn deep_tree(top: &Path, depth: usize) {
    use rustix::fs::{mkdirat, openat, Mode, OFlags};
    std::fs::create_dir(top).unwrap();
    let mut dir = rustix::fs::open(top, OFlags::DIRECTORY | OFlags::RDONLY, Mode::empty()).unwrap();
    for _ in 0..depth {
        mkdirat(dir.as_fd(), "d", Mode::from_raw_mode(0o755)).unwrap();
        dir = openat(
            dir.as_fd(),
            "d",
            OFlags::DIRECTORY | OFlags::RDONLY | OFlags::NOFOLLOW,
            Mode::empty(),
        )
        .unwrap();
    }
}

pub async fn deep_and_wide_directories_are_bounded(backend: &'static str) {
    let sv = Server::start(backend, "");
    let s = Session::start(&sv).await;
    let ws = s.workspace(&sv);
    let deep = ws.join("deep");
    let _cleanup = RemoveDeep(deep.clone());
    deep_tree(&deep, 20_000);
    let wide = ws.join("wide");
    std::fs::create_dir(&wide).unwrap();
    for i in 0..10_001 {
        std::fs::File::create(wide.join(format!("f{i:05}"))).unwrap();
    }
    // One level at a time, whatever the depth below.
    assert_eq!(names(&sv, &s, "deep").await, vec!["d".to_string()]);
    let thousand = vec!["d"; 1000].join("/");
    assert_eq!(
        names(&sv, &s, &format!("deep/{thousand}")).await,
        vec!["d".to_string()]
    );
    // A path past PATH_MAX is refused before anything is opened.
    let too_long = format!("deep/{}", vec!["d"; 2100].join("/"));
    let (code, v) = sv
        .get(&s.files(&format!("{}&list=true", q(&too_long))))
        .await;
    assert_refused(code, &v, 400, "over the bound");
    // A directory past the bound: the first 10,000 names, and said so.
    let (code, v) = sv.get(&s.files("path=wide&list=true")).await;
    assert_eq!(code, 200);
    assert_eq!(
        (
            v["entries"].as_array().unwrap().len(),
            v["truncated"].clone()
        ),
        (10_000, json!(true))
    );
    let (_, health) = sv.get("/healthz").await;
    assert_eq!(health, json!("ok"));
}

/// Removes a deep tree with the node's own walk (a recursive removal would not cope).
struct RemoveDeep(PathBuf);

impl Drop for RemoveDeep {
    fn drop(&mut self) {
        let _ = cynode_worker::remove_tree::remove_tree(&self.0);
    }
}

pub async fn a_write_over_the_bound_is_refused_and_leaves_nothing(backend: &'static str) {
    let sv = Server::start(backend, "limits:\n  max_request_bytes: 1048576\n");
    let s = Session::start(&sv).await;
    let (code, v) = put(&sv, &s.files(&q("big")), vec![b'x'; 3 * 1024 * 1024]).await;
    assert!(code == 400 || code == 413, "{code} {v}");
    // An existing file is kept as it was when its replacement is refused.
    let (code, _) = put(&sv, &s.files(&q("kept")), b"old".to_vec()).await;
    assert_eq!(code, 200);
    let (code, v) = put(&sv, &s.files(&q("kept")), vec![b'y'; 2 * 1024 * 1024]).await;
    assert!(code == 400 || code == 413, "{code} {v}");
    assert_eq!(
        get_bytes(&sv, &s.files(&q("kept"))).await,
        (200, b"old".to_vec())
    );
    // Nothing else: no temporary file, no partial target.
    assert_eq!(names(&sv, &s, "").await, vec!["kept".to_string()]);
    let on_host: Vec<String> = std::fs::read_dir(s.workspace(&sv))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "lost+found")
        .collect();
    assert_eq!(on_host, vec!["kept".to_string()]);
}

pub async fn files_are_read_written_and_listed_as_the_sandbox_sees_them(backend: &'static str) {
    let sv = Server::start(backend, "");
    let s = Session::start(&sv).await;
    let body: Vec<u8> = (0..200_000u32).flat_map(|i| i.to_le_bytes()).collect();
    let (code, v) = put(&sv, &s.files(&q("sub/data.bin")), body.clone()).await;
    assert_eq!(code, 404, "a missing parent is not made: {v}");
    s.sh(&sv, "mkdir sub").await;
    let (code, v) = put(&sv, &s.files(&q("sub/data.bin")), body.clone()).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        v,
        json!({ "version": 1, "session_id": s.id, "path": "sub/data.bin",
                "bytes": body.len(), "sha256": crate::harness::sha256_hex(&body) })
    );
    assert_eq!(
        get_bytes(&sv, &s.files(&q("sub/data.bin"))).await,
        (200, body.clone())
    );
    // The sandbox sees the same bytes, owned as its own files are.
    let (code, out) = s
        .sh(
            &sv,
            "sha256sum sub/data.bin | cut -d' ' -f1; touch mine; [ $(stat -c %u sub/data.bin) = $(stat -c %u mine) ] && echo same-owner; stat -c %a sub/data.bin",
        )
        .await;
    assert_eq!(code, 0);
    assert_eq!(
        out,
        format!("{}\nsame-owner\n644\n", crate::harness::sha256_hex(&body))
    );
    // What the sandbox writes is read back; a replacement keeps the file's mode.
    s.sh(&sv, "printf 'from inside' > sub/note; chmod 600 sub/note")
        .await;
    assert_eq!(
        get_bytes(&sv, &s.files(&q("sub/note"))).await,
        (200, b"from inside".to_vec())
    );
    let (code, _) = put(&sv, &s.files(&q("sub/note")), b"replaced".to_vec()).await;
    assert_eq!(code, 200);
    let (_, out) = s.sh(&sv, "cat sub/note; echo; stat -c %a sub/note").await;
    assert_eq!(out, "replaced\n600\n");
    let (code, v) = sv.get(&s.files("path=sub&list=true")).await;
    assert_eq!(code, 200);
    assert_eq!(
        v,
        json!({ "version": 1, "session_id": s.id, "path": "sub", "truncated": false,
                "entries": [
                    { "name": "data.bin", "kind": "file", "size": body.len(), "mode": 0o644 },
                    { "name": "note", "kind": "file", "size": 8, "mode": 0o600 },
                ] })
    );
    // Not found, a directory read as a file, and the session's end.
    let (code, _) = sv.get(&s.files(&q("nope"))).await;
    assert_eq!(code, 404);
    let (code, v) = sv.get(&s.files(&q("sub"))).await;
    assert_refused(code, &v, 400, "directory");
    let (code, v) = sv
        .get("/v1/worker/sessions/no-such-session/files?path=x")
        .await;
    assert_eq!(code, 404, "{v}");
    let r = sv
        .client
        .get(sv.url(&s.files(&q("sub/note"))))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    sv.post(&format!("/v1/worker/sessions/{}/end", s.id), &json!({}))
        .await;
    let (code, _) = sv.get(&s.files(&q("sub/note"))).await;
    assert_eq!(code, 409);
}
