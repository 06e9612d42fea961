//! Workspace snapshots and forks on the real server, once per backend: the snapshot's
//! tree hash is the workspace's; two sessions from one snapshot are independent of each
//! other and of the original; another task can neither fork nor see a snapshot; a hostile
//! workspace (links to / and out, FIFOs, a device node, hard links, a 20,000-deep tree)
//! is snapshotted without reading outside it, or refused by name within bounds; retention
//! removes a snapshot; deleting one frees the task's budget.

use std::os::unix::fs::FileTypeExt;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::{assert_field_starts, env, session_guard, unique, Server};
use crate::session_suspend::{
    create, hash, resume, sh, sh_ok, suspend, workspace_dir, Session, CONFIG,
};

on_both_backends!(
    session_snapshots:
    two_forks_of_one_snapshot_are_independent,
    another_task_cannot_fork_list_or_delete,
    hostile_workspace_is_snapshotted_within_bounds,
    retention_removes_a_snapshot,
    delete_frees_the_budget,
);

// On the microVM (each command a VM of its own under TCG here): the cases that show its
// sessions keep their promises, not every one again.
on_both_backends!(@one session_snapshots microvm [
    two_forks_of_one_snapshot_are_independent
]);

/// Makes `n` nested directories `d/d/…` under `root`, one name at a time beneath fds.
fn deep_tree(root: &std::path::Path, n: usize) {
    use rustix::fs::{mkdirat, openat, Mode, OFlags};
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mut fd = openat(rustix::fs::CWD, root, flags, Mode::empty()).unwrap();
    for _ in 0..n {
        mkdirat(&fd, "d", Mode::from_raw_mode(0o755)).unwrap();
        fd = openat(&fd, "d", flags, Mode::empty()).unwrap();
    }
}

/// How many `d` directories are nested under `root`.
fn depth(root: &std::path::Path) -> usize {
    use rustix::fs::{openat, Mode, OFlags};
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mut fd = openat(rustix::fs::CWD, root, flags, Mode::empty()).unwrap();
    let mut n = 0;
    while let Ok(next) = openat(&fd, "d", flags, Mode::empty()) {
        fd = next;
        n += 1;
    }
    n
}

async fn snapshot(sv: &Server, id: &str) -> (u16, Value) {
    sv.post(&format!("/v1/worker/sessions/{id}/snapshots"), &json!({}))
        .await
}

async fn snapshot_ok(sv: &Server, id: &str) -> Value {
    let (code, snap) = snapshot(sv, id).await;
    assert_eq!(code, 201, "{snap}");
    snap
}

/// A session of `task` from snapshot `snap` on a new workspace; the create response.
async fn fork(sv: &Server, task: &str, snap: &str) -> (u16, Value, Session) {
    let id = unique("f");
    let ws = unique("w");
    let cleanup = session_guard(sv.backend, &id);
    let (code, info) = sv
        .post(
            "/v1/worker/sessions",
            &json!({ "version": 1, "session_id": id, "task_id": task, "image": env().image,
                     "workspace_id": ws, "from_snapshot": snap }),
        )
        .await;
    (
        code,
        info,
        Session {
            id,
            task: task.to_string(),
            workspace: ws,
            _cleanup: cleanup,
        },
    )
}

async fn delete(sv: &Server, snap: &str) -> u16 {
    sv.client
        .delete(sv.url(&format!("/v1/worker/snapshots/{snap}")))
        .bearer_auth(crate::harness::TOKEN)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

fn snapshot_files(sv: &Server) -> Vec<String> {
    std::fs::read_dir(sv.state_dir().join("snapshots"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

pub async fn two_forks_of_one_snapshot_are_independent(backend: &'static str) {
    let sv = Server::start(backend, CONFIG);
    let s = create(&sv, json!({})).await;
    sh_ok(&sv, &s.id, "mkdir /workspace/d && echo base > /workspace/d/f && head -c 200000 /dev/urandom > /workspace/blob").await;
    let h = hash(&sv, &s.workspace);
    let snap = snapshot_ok(&sv, &s.id).await;
    let sid = snap["snapshot_id"].as_str().unwrap().to_string();
    assert_eq!(snap["tree_hash"], h, "{snap}");
    assert!(sid.starts_with("snap-") && sid.len() >= 37, "{sid}");
    assert!(snap["bytes"].as_u64().unwrap() > 0, "{snap}");
    assert!(
        ["copy", "reflink"].contains(&snap["copy"].as_str().unwrap()),
        "{snap}"
    );
    // The original moves on after its snapshot.
    sh_ok(&sv, &s.id, "echo original > /workspace/d/f").await;
    let (code, a_info, a) = fork(&sv, &s.task, &sid).await;
    assert_eq!(code, 201, "{a_info}");
    assert_eq!(a_info["workspace_copy"], snap["copy"], "{a_info}");
    let (code, b_info, b) = fork(&sv, &s.task, &sid).await;
    assert_eq!(code, 201, "{b_info}");
    assert_eq!(hash(&sv, &a.workspace), h);
    assert_eq!(hash(&sv, &b.workspace), h);
    assert_eq!(sh_ok(&sv, &a.id, "cat /workspace/d/f").await, "base\n");
    // The fork's files are its own uid's: it can write them.
    sh_ok(
        &sv,
        &a.id,
        "echo a > /workspace/d/f && echo new > /workspace/only-a",
    )
    .await;
    assert_eq!(
        sh_ok(&sv, &b.id, "cat /workspace/d/f; ls /workspace").await,
        "base\nblob\nd\n"
    );
    assert_eq!(sh_ok(&sv, &s.id, "cat /workspace/d/f").await, "original\n");
    assert_eq!(hash(&sv, &b.workspace), h, "b changed with a");
    // Suspend and resume of a fork keep it too.
    let ha = hash(&sv, &a.workspace);
    suspend(&sv, &a.id).await;
    resume(&sv, &a.id).await;
    assert_eq!(hash(&sv, &a.workspace), ha);
    // A fork onto an existing workspace is refused, and that workspace is untouched.
    let id = unique("f");
    let _g = session_guard(sv.backend, &id);
    let (code, r) = sv
        .post(
            "/v1/worker/sessions",
            &json!({ "version": 1, "session_id": id, "task_id": s.task, "image": env().image,
                     "workspace_id": a.workspace, "from_snapshot": sid }),
        )
        .await;
    assert_eq!(code, 409, "{r}");
    assert_eq!(hash(&sv, &a.workspace), ha);
}

pub async fn another_task_cannot_fork_list_or_delete(backend: &'static str) {
    let sv = Server::start(backend, CONFIG);
    let s = create(&sv, json!({})).await;
    sh_ok(&sv, &s.id, "echo secret > /workspace/secret").await;
    let snap = snapshot_ok(&sv, &s.id).await;
    let sid = snap["snapshot_id"].as_str().unwrap().to_string();
    // Another task's session: forking the snapshot is a 404, like an unknown id.
    let other_task = unique("t");
    let (code, r, o) = fork(&sv, &other_task, &sid).await;
    assert_eq!(code, 404, "{r}");
    assert!(
        !workspace_dir(&sv, &o.workspace).exists(),
        "a workspace was made"
    );
    let (code, r, _) = fork(&sv, &other_task, "snap-00000000000000000000000000000000").await;
    assert_eq!(code, 404, "{r}");
    // Its own sessions list none of the first task's snapshots.
    let other = create(&sv, json!({})).await;
    let (code, list) = sv
        .get(&format!("/v1/worker/sessions/{}/snapshots", other.id))
        .await;
    assert_eq!((code, &list["snapshots"]), (200, &json!([])), "{list}");
    // A guessed or malformed id deletes nothing.
    assert_eq!(
        delete(&sv, "snap-00000000000000000000000000000000").await,
        404
    );
    assert_eq!(delete(&sv, "..%2F..%2Fworker.db").await, 400);
    let (_, list) = sv
        .get(&format!("/v1/worker/sessions/{}/snapshots", s.id))
        .await;
    assert_eq!(list["snapshots"].as_array().unwrap().len(), 1, "{list}");
    // A bad from_snapshot is a 400 naming it.
    let (code, r, _) = fork(&sv, &s.task, "../x").await;
    assert_eq!(code, 400, "{r}");
    assert_field_starts(&r, "detail", "from_snapshot");
}

pub async fn hostile_workspace_is_snapshotted_within_bounds(backend: &'static str) {
    let sv = Server::start(backend, CONFIG);
    let s = create(&sv, json!({})).await;
    // Outside files the links point at: never read, never written.
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("target"), "outside").unwrap();
    let out_path = outside.path().join("target");
    sh_ok(
        &sv,
        &s.id,
        &format!(
            "cd /workspace && ln -s / root && ln -s ../../../../.. up && ln -s {} out \
             && (mkfifo fifo || true) && echo data > f && ln f hard && mkdir sub && ln -s /etc/shadow sub/shadow",
            out_path.display()
        ),
    )
    .await;
    // A device node made from the host (a sandbox cannot; the volume is nodev), and the
    // FIFO too where the sandbox's is not on the host's filesystem (gVisor keeps named
    // pipes in its own kernel).
    let ws = workspace_dir(&sv, &s.workspace);
    if std::fs::symlink_metadata(ws.join("fifo")).is_err() {
        rustix::fs::mknodat(
            rustix::fs::CWD,
            ws.join("fifo"),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
    }
    let _ = rustix::fs::mknodat(
        rustix::fs::CWD,
        ws.join("null"),
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::Mode::from_raw_mode(0o666),
        rustix::fs::makedev(1, 3),
    );
    let before = std::fs::metadata(&out_path).unwrap();
    let h = hash(&sv, &s.workspace);
    let snap = snapshot_ok(&sv, &s.id).await;
    assert_eq!(snap["tree_hash"], h, "{snap}");
    let (code, info, f) = fork(&sv, &s.task, snap["snapshot_id"].as_str().unwrap()).await;
    assert_eq!(code, 201, "{info}");
    let fws = workspace_dir(&sv, &f.workspace);
    // The links are links in the fork, with their targets; the FIFO a FIFO.
    assert_eq!(
        std::fs::read_link(fws.join("root")).unwrap(),
        std::path::Path::new("/")
    );
    assert_eq!(std::fs::read_link(fws.join("out")).unwrap(), out_path);
    assert!(std::fs::symlink_metadata(fws.join("fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    assert_eq!(hash(&sv, &f.workspace), h);
    let after = std::fs::metadata(&out_path).unwrap();
    assert_eq!(
        (before.len(), before.modified().unwrap()),
        (after.len(), after.modified().unwrap()),
        "the outside file changed"
    );
    assert_eq!(std::fs::read_to_string(&out_path).unwrap(), "outside");
    // A 20,000-deep tree (made from the host by fd, as a sandbox could with renames):
    // the snapshot is refused by name, within bounds, and nothing is written.
    deep_tree(&ws, 20_000);
    let files = snapshot_files(&sv);
    let t = Instant::now();
    let (code, r) = snapshot(&sv, &s.id).await;
    eprintln!("{backend}: the deep snapshot answered in {:?}", t.elapsed());
    assert_eq!(code, 400, "{r}");
    assert_field_starts(&r, "detail", "workspace: workspace_unhashable");
    assert_eq!(snapshot_files(&sv), files, "a snapshot image was left");
    // Suspend and resume do not walk the tree: the deep workspace comes back whole.
    suspend(&sv, &s.id).await;
    resume(&sv, &s.id).await;
    assert_eq!(depth(&ws), 20_000);
    // The session is usable after all that.
    let (code, r) = sh(&sv, &s.id, "cat /workspace/hard").await;
    assert_eq!((code, r["stdout"].as_str()), (200, Some("data\n")), "{r}");
}

pub async fn retention_removes_a_snapshot(backend: &'static str) {
    let sv = Server::start(
        backend,
        &format!("{CONFIG}session_state:\n  snapshot_retention_seconds: 1\n"),
    );
    let s = create(&sv, json!({})).await;
    let snap = snapshot_ok(&sv, &s.id).await;
    let sid = snap["snapshot_id"].as_str().unwrap().to_string();
    assert!(snapshot_files(&sv).contains(&format!("{sid}.img")));
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, list) = sv
            .get(&format!("/v1/worker/sessions/{}/snapshots", s.id))
            .await;
        if list["snapshots"] == json!([]) && snapshot_files(&sv).is_empty() {
            break;
        }
        assert!(Instant::now() < until, "not removed: {list}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (code, r, _) = fork(&sv, &s.task, &sid).await;
    assert_eq!(code, 404, "{r}");
}

pub async fn delete_frees_the_budget(backend: &'static str) {
    let sv = Server::start(
        backend,
        &format!("{CONFIG}session_state:\n  max_snapshots_per_task: 1\n"),
    );
    let s = create(&sv, json!({})).await;
    let first = snapshot_ok(&sv, &s.id).await;
    let (code, r) = snapshot(&sv, &s.id).await;
    assert_eq!(code, 409, "{r}");
    assert_field_starts(&r, "detail", "snapshot_budget_exceeded");
    assert_eq!(snapshot_files(&sv).len(), 1);
    assert_eq!(
        delete(&sv, first["snapshot_id"].as_str().unwrap()).await,
        204
    );
    assert_eq!(
        delete(&sv, first["snapshot_id"].as_str().unwrap()).await,
        404
    );
    assert!(snapshot_files(&sv).is_empty());
    snapshot_ok(&sv, &s.id).await;
    // A byte budget smaller than one workspace image refuses the first.
    let sv2 = Server::start(
        backend,
        &format!("{CONFIG}session_state:\n  snapshot_budget_mb: 1\n"),
    );
    let s2 = create(&sv2, json!({})).await;
    sh_ok(
        &sv2,
        &s2.id,
        "head -c 3000000 /dev/urandom > /workspace/big",
    )
    .await;
    let (code, r) = snapshot(&sv2, &s2.id).await;
    assert_eq!(code, 409, "{r}");
    assert_field_starts(&r, "detail", "snapshot_budget_exceeded");
    assert!(snapshot_files(&sv2).is_empty());
}

/// Copy-on-write where the filesystem allows it, on a real XFS with reflink: a node whose
/// state directory is on it snapshots and forks by `FICLONE` (`copy: reflink`), so neither
/// copies the workspace's blocks (the filesystem's use grows by far less than the
/// workspace), and a write in the fork leaves the original's blocks as they were.
/// Host-side code alike on every engine: run once, on bwrap.
mod reflink {
    use super::*;
    use std::path::{Path, PathBuf};

    /// An XFS filesystem with reflink on a loop device, mounted for the test (the test's
    /// own mount: unmounted when it drops, checked to leave no mount or loop device).
    struct Xfs {
        dir: tempfile::TempDir,
    }

    impl Xfs {
        fn mount() -> Xfs {
            let dir = tempfile::tempdir().unwrap();
            let img = dir.path().join("xfs.img");
            std::fs::File::create(&img)
                .unwrap()
                .set_len(1 << 30)
                .unwrap();
            let run = |mut cmd: std::process::Command, args: &[&std::ffi::OsStr]| {
                cmd.args(args);
                let shown = format!("{cmd:?}");
                let out = cynode_testkit::output_bounded(cmd, Duration::from_secs(60));
                assert!(out.status.success(), "{shown}: {out:?}");
            };
            let fs = dir.path().join("fs");
            std::fs::create_dir(&fs).unwrap();
            run(
                std::process::Command::new("mkfs.xfs"),
                &[
                    "-q".as_ref(),
                    "-m".as_ref(),
                    "reflink=1".as_ref(),
                    img.as_os_str(),
                ],
            );
            run(
                std::process::Command::new("mount"),
                &[
                    "-o".as_ref(),
                    "loop".as_ref(),
                    img.as_os_str(),
                    fs.as_os_str(),
                ],
            );
            Xfs { dir }
        }

        fn state(&self) -> PathBuf {
            self.dir.path().join("fs/node")
        }

        /// Bytes in use on the filesystem.
        fn used(&self) -> u64 {
            let st = rustix::fs::statvfs(self.dir.path().join("fs")).unwrap();
            (st.f_blocks - st.f_bfree) * st.f_frsize
        }
    }

    impl Drop for Xfs {
        fn drop(&mut self) {
            let fs: &Path = &self.dir.path().join("fs");
            let mut umount = std::process::Command::new("umount");
            umount.arg(fs);
            let _ = cynode_testkit::output_within(umount, Duration::from_secs(30));
            let left =
                cynode_testkit::mounts::wait_nothing_left(self.dir.path(), Duration::from_secs(10));
            if !std::thread::panicking() {
                assert_eq!(left, Ok(()), "the test's XFS is still mounted");
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_snapshot_and_its_fork_share_the_workspaces_blocks_on_xfs() {
        crate::cases::setup();
        let xfs = Xfs::mount();
        let sv = Server::start_on_state("bwrap", CONFIG, xfs.state());
        let s = create(&sv, json!({})).await;
        const MIB: u64 = 1 << 20;
        sh_ok(
            &sv,
            &s.id,
            "head -c 33554432 /dev/urandom > /workspace/blob && sync",
        )
        .await;
        let h = hash(&sv, &s.workspace);
        let before = xfs.used();
        let snap = snapshot_ok(&sv, &s.id).await;
        assert_eq!(snap["copy"], "reflink", "{snap}");
        let sid = snap["snapshot_id"].as_str().unwrap().to_string();
        let (code, info, fork_s) = fork(&sv, &s.task, &sid).await;
        assert_eq!(code, 201, "{info}");
        assert_eq!(info["workspace_copy"], "reflink", "{info}");
        assert_eq!(hash(&sv, &fork_s.workspace), h);
        let grew = xfs.used().saturating_sub(before);
        assert!(
            grew < 8 * MIB,
            "a snapshot and a fork of a 32 MiB workspace took {} MiB: its blocks were copied",
            grew / MIB
        );
        // A write in the fork is the fork's: the original and the snapshot keep theirs.
        sh_ok(
            &sv,
            &fork_s.id,
            "head -c 1048576 /dev/zero | dd of=/workspace/blob conv=notrunc 2>/dev/null && sync",
        )
        .await;
        assert_ne!(hash(&sv, &fork_s.workspace), h);
        assert_eq!(
            hash(&sv, &s.workspace),
            h,
            "the fork's write reached the original"
        );
        let (code, again, second) = fork(&sv, &s.task, &sid).await;
        assert_eq!(code, 201, "{again}");
        assert_eq!(
            hash(&sv, &second.workspace),
            h,
            "the snapshot changed with the fork"
        );
        drop((fork_s, second, s));
        drop(sv);
    }
}
