//! Kernel-enforced disk limits: a job's /workspace and /job are ext4
//! volumes of `limits.disk_mb` on loop devices. Jobs writing as fast as they can (dd,
//! fallocate, a file unlinked while held open, a flood of small files) stop at the
//! volume's size on the host, fail `resource_limit_exceeded`, and the node stays up; the
//! sandbox's mountinfo does not show the state directory; `:ack` gives the volume back.
//! A session's workspace is a volume too: a command writing at full speed stops there; and
//! so is a workspace seeded through the API (staged on its own volume, which is moved onto
//! the workspace): a seed larger than the limit is refused and leaves nothing. Volumes
//! never outlive their node: its clean stop and its janitor (after a kill) unmount them,
//! and its next start mounts them again with their content.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::harness::{command_job, eventually, unique, wait_janitor_done, Server};
use crate::workspaces::tar_of;

on_both_backends!(
    disk_volumes:
    disk_volume_stops_full_speed_writers_at_the_limit,
    disk_volume_bounds_the_file_count,
    disk_volume_hides_the_state_dir_from_mountinfo_and_goes_with_ack,
    disk_volume_holds_a_sessions_workspace,
    disk_volumes_go_with_their_node,
);

const MIB: u64 = 1024 * 1024;

/// Bytes allocated on the host's filesystem (`host`'s device; the volumes mounted on
/// the way are not crossed, their images are counted) by the files at `paths` and
/// beneath them.
fn host_bytes(host: &Path, paths: &[PathBuf]) -> u64 {
    let Ok(dev) = std::fs::symlink_metadata(host).map(|m| m.dev()) else {
        return 0;
    };
    let mut total = 0;
    for p in paths {
        let mut stack = vec![p.clone()];
        while let Some(d) = stack.pop() {
            let Ok(m) = std::fs::symlink_metadata(&d) else {
                continue;
            };
            if m.dev() != dev {
                continue;
            }
            total += m.blocks() * 512;
            if m.is_dir() {
                if let Ok(rd) = std::fs::read_dir(&d) {
                    stack.extend(rd.flatten().map(|e| e.path()));
                }
            }
        }
    }
    total
}

/// Samples [`host_bytes`] of `paths` every few milliseconds until dropped; `peak()` is
/// the most seen.
struct PeakSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PeakSampler {
    fn start(host: PathBuf, paths: Vec<PathBuf>) -> PeakSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let (s, p) = (Arc::clone(&stop), Arc::clone(&peak));
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(host_bytes(&host, &paths), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
            p.fetch_max(host_bytes(&host, &paths), Ordering::Relaxed);
        });
        PeakSampler {
            stop,
            peak,
            thread: Some(thread),
        }
    }

    fn peak(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}

impl Drop for PeakSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Everything on the host a job with `job` and `task` can fill: its job directory, its
/// workspace, and the images of their volumes.
fn job_paths(sv: &Server, job: &str, task: &str) -> Vec<PathBuf> {
    let st = sv.state_dir();
    vec![
        st.join("jobs").join(job),
        st.join("workspaces").join(task),
        st.join("volumes").join(format!("job-{job}.img")),
        st.join("volumes").join(format!("ws-{task}.img")),
    ]
}

fn assert_limit_failure(backend: &str, what: &str, v: &serde_json::Value) {
    assert_eq!(v["status"], "failed", "{backend} {what}: {v}");
    assert!(
        v["failure_reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("resource_limit_exceeded")),
        "{backend} {what}: {v}"
    );
}

fn is_loop_mount(p: &Path) -> bool {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let p = p.display().to_string();
    text.lines()
        .any(|l| l.split(' ').nth(4) == Some(p.as_str()) && l.contains(" - ext4 /dev/loop"))
}

/// With `disk_mb: 256`, jobs writing 1 GiB as fast as they can, each its own way, leave
/// at most 1.05 × 256 MiB on the host (sampled while they run), fail
/// `resource_limit_exceeded`, and the node keeps answering.
pub async fn disk_volume_stops_full_speed_writers_at_the_limit(backend: &'static str) {
    let sv = Server::start(backend, "limits:\n  disk_mb: 256\n  disk_max_files: 4000\n");
    let cases = [
        ("dd", "dd if=/dev/zero of=/workspace/fill bs=1048576 count=1024 2>&1; echo done"),
        ("dd into /job", "dd if=/dev/zero of=/job/fill bs=1048576 count=1024 2>&1; echo done"),
        ("fallocate", "fallocate -l 1073741824 /workspace/big; echo done"),
        (
            "unlinked open file",
            "exec 3>/workspace/gone && rm /workspace/gone && { dd if=/dev/zero bs=1048576 count=1024 >&3; } 2>&1 | grep -o 'No space left'; echo done",
        ),
    ];
    for (what, script) in cases {
        let (job, task) = (unique("j"), unique("t"));
        let sampler = PeakSampler::start(sv.state_dir(), job_paths(&sv, &job, &task));
        let (code, v) = sv.run_job(&job, &task, &["sh", "-c", script]).await;
        let peak = sampler.peak();
        assert_eq!(code, 200, "{v}");
        eprintln!(
            "{backend}: {what}: peak {} MiB on the host; {}",
            peak / MIB,
            v["failure_reason"]
        );
        // A file unlinked and held open fills the volume and is freed when its writer
        // exits, which can be sooner than the guard's next `statfs` read (every 20 ms);
        // its dirty pages never reach the image, so the image's high-water mark does not
        // grow either. The kernel held the bytes all the same (the peak below): the writer
        // got ENOSPC. Either the guard saw it (failed) or the writer's ENOSPC shows.
        if what == "unlinked open file" && v["status"] == "completed" {
            assert!(
                v["stdout"].as_str().unwrap_or("").contains("No space left"),
                "{backend} {what}: neither the guard nor the kernel stopped the writer: {v}"
            );
        } else {
            assert_limit_failure(backend, what, &v);
        }
        assert!(
            peak <= 256 * MIB * 105 / 100,
            "{backend} {what}: {} MiB on the host, over 1.05 × 256 MiB: {v}",
            peak / MIB
        );
        let (code, _) = sv.get("/healthz").await;
        assert_eq!(code, 200, "{backend} {what}: the node is down");
    }
}

/// With `disk_max_files: 2000`, a job creating 5000 files gets no more than the volume's
/// inodes (2000, rounded up to whole inode-table blocks), and fails
/// `resource_limit_exceeded`.
pub async fn disk_volume_bounds_the_file_count(backend: &'static str) {
    let sv = Server::start(backend, "limits:\n  disk_mb: 256\n  disk_max_files: 2000\n");
    let (job, task) = (unique("j"), unique("t"));
    let script = "i=0; while [ $i -lt 5000 ]; do : > /workspace/f$i 2>/dev/null || break; i=$((i+1)); done; echo made=$i";
    let (code, v) = sv.run_job(&job, &task, &["sh", "-c", script]).await;
    assert_eq!(code, 200, "{v}");
    eprintln!("{backend}: {} {}", v["stdout"], v["failure_reason"]);
    assert_limit_failure(backend, "file flood", &v);
    let made: u64 = v["stdout"]
        .as_str()
        .and_then(|s| s.trim().strip_prefix("made="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(u64::MAX);
    // A file count the kernel held: the flood stopped itself on ENOSPC, short of 5000 …
    // unless the guard stopped the sandbox first (then no count was printed).
    assert!(
        made <= 2000 + 64 || v["stdout"].as_str() == Some(""),
        "{backend}: {made} files made under disk_max_files 2000: {v}"
    );
    let (code, _) = sv.get("/healthz").await;
    assert_eq!(code, 200);
}

/// The sandbox's /proc/self/mountinfo does not name the state directory (the volumes'
/// roots are their filesystems' roots); the job directory and the workspace are volumes
/// while the job is kept, and `:ack` unmounts the job's and deletes its image.
pub async fn disk_volume_hides_the_state_dir_from_mountinfo_and_goes_with_ack(
    backend: &'static str,
) {
    let sv = Server::start(backend, "limits:\n  disk_mb: 64\n");
    let (job, task) = (unique("j"), unique("t"));
    let (code, v) = sv
        .run_job(&job, &task, &["cat", "/proc/self/mountinfo"])
        .await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["status"], "completed", "{v}");
    let out = v["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("/workspace"), "{backend}: {out}");
    let state = sv.state_dir();
    for needle in [
        state.display().to_string(),
        sv.dir.path().display().to_string(),
    ] {
        assert!(
            !out.contains(&needle),
            "{backend}: the sandbox sees {needle} in mountinfo:\n{out}"
        );
    }
    let job_dir = state.join("jobs").join(&job).join("job");
    let image = state.join("volumes").join(format!("job-{job}.img"));
    assert!(is_loop_mount(&job_dir), "{backend}: /job is no volume");
    assert!(
        is_loop_mount(&state.join("workspaces").join(&task)),
        "{backend}: /workspace is no volume"
    );
    assert!(
        image.is_file(),
        "{backend}: no image at {}",
        image.display()
    );
    let (code, body) = sv
        .post(
            &format!("/v1/worker/jobs/{job}:ack"),
            &serde_json::json!({}),
        )
        .await;
    assert!((200..300).contains(&code), "{code} {body}");
    assert!(
        !is_loop_mount(&job_dir),
        "{backend}: the volume stayed mounted"
    );
    assert!(!image.exists(), "{backend}: the image stayed");
    assert!(!state.join("jobs").join(&job).exists());
}

/// A workspace a session creates is a volume: with `disk_mb: 64`, a command writing
/// 512 MiB at full speed leaves at most 1.05 × 64 MiB on the host and its exec fails
/// `resource_limit_exceeded`; the node keeps answering.
pub async fn disk_volume_holds_a_sessions_workspace(backend: &'static str) {
    let sv = Server::start(backend, "limits:\n  disk_mb: 64\n");
    let (id, task) = (unique("s"), unique("t"));
    let _cleanup = crate::harness::session_guard(backend, &id);
    let body = serde_json::json!({ "version": 1, "session_id": id, "task_id": task,
        "image": crate::harness::env().image });
    let (code, info) = sv.post("/v1/worker/sessions", &body).await;
    assert_eq!(code, 201, "{info}");
    let state = sv.state_dir();
    let ws = state.join("workspaces").join(&task);
    assert!(
        is_loop_mount(&ws),
        "{backend}: the session's workspace is no volume"
    );
    let image = state.join("volumes").join(format!("ws-{task}.img"));
    let sampler = PeakSampler::start(state.clone(), vec![ws, image]);
    let exec = serde_json::json!({ "version": 1, "timeout_seconds": 120, "command": ["sh", "-c",
        "dd if=/dev/zero of=/workspace/fill bs=1048576 count=512 2>&1; echo done"] });
    let (code, v) = sv
        .post(&format!("/v1/worker/sessions/{id}/exec"), &exec)
        .await;
    let peak = sampler.peak();
    assert_eq!(code, 200, "{v}");
    eprintln!("{backend}: session dd: peak {} MiB on the host", peak / MIB);
    assert_limit_failure(backend, "session dd", &v);
    assert!(
        peak <= 64 * MIB * 105 / 100,
        "{backend}: {} MiB on the host, over 1.05 × 64 MiB: {v}",
        peak / MIB
    );
    let (code, _) = sv.get("/healthz").await;
    assert_eq!(code, 200, "{backend}: the node is down");
}

/// The images in the node's volume directory whose names start with `prefix`.
fn images(sv: &Server, prefix: &str) -> Vec<String> {
    std::fs::read_dir(sv.state_dir().join("volumes"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// A workspace seeded through the API (tar, and `seed_from` a host directory) is a
/// volume named after it: its content is there, a job writing at full speed in it stops
/// at ≤ 1.05 × `disk_mb`; a tar larger than the limit is refused with a 400 that says so,
/// and leaves no workspace, image or staging tree. The workspace logic is the backend's
/// (bwrap here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_workspaces_are_volumes() {
    crate::cases::setup();
    let seeds = tempfile::tempdir().unwrap();
    std::fs::write(seeds.path().join("from-host.txt"), "host\n").unwrap();
    let config = format!(
        "limits:\n  disk_mb: 64\n  max_request_bytes: 134217728\n{}",
        crate::harness::seed_config(seeds.path())
    );
    let sv = Server::start("bwrap", &config);
    let state = sv.state_dir();
    let ws = unique("ws");
    let (code, v) = sv
        .put_tar(&ws, tar_of(&[("app/hello.txt", b"hello\n")]))
        .await;
    assert!((200..300).contains(&code), "{code} {v}");
    assert!(
        is_loop_mount(&state.join("workspaces").join(&ws)),
        "the seeded workspace is no volume"
    );
    assert_eq!(images(&sv, &format!("ws-{ws}.img")).len(), 1);
    let host = unique("wh");
    let (code, v) = sv.seed_workspace(&host, seeds.path()).await;
    assert_eq!(code, 201, "{v}");
    assert!(
        is_loop_mount(&state.join("workspaces").join(&host)),
        "the host-seeded workspace is no volume"
    );

    let job = unique("j");
    let mut req = crate::harness::command_job(&job, "t-seeded", &["sh", "-c",
        "cat app/hello.txt; dd if=/dev/zero of=/workspace/fill bs=1048576 count=512 2>&1; echo done"]);
    req["workspace_id"] = serde_json::json!(ws);
    let sampler = PeakSampler::start(
        state.clone(),
        vec![
            state.join("workspaces").join(&ws),
            state.join("volumes").join(format!("ws-{ws}.img")),
        ],
    );
    let (code, v) = sv.post("/v1/worker/jobs:run", &req).await;
    let peak = sampler.peak();
    assert_eq!(code, 200, "{v}");
    assert!(
        v["stdout"].as_str().unwrap_or("").starts_with("hello\n"),
        "{v}"
    );
    assert_limit_failure("bwrap", "seeded dd", &v);
    assert!(
        peak <= 64 * MIB * 105 / 100,
        "{} MiB on the host: {v}",
        peak / MIB
    );

    let big = unique("wb");
    let (code, v) = sv
        .put_tar(&big, tar_of(&[("big.bin", &vec![7u8; 80 * MIB as usize])]))
        .await;
    assert_eq!(code, 400, "{v}");
    assert!(
        v["detail"].as_str().unwrap_or("").contains("disk limit"),
        "{v}"
    );
    assert!(!state.join("workspaces").join(&big).exists());
    assert!(images(&sv, &format!("ws-{big}")).is_empty());
    assert!(images(&sv, "seed-").is_empty(), "{:?}", images(&sv, ""));
    let staged: Vec<_> = std::fs::read_dir(state.join("staging"))
        .unwrap()
        .flatten()
        .collect();
    assert!(staged.is_empty(), "staging left: {staged:?}");
    let (code, _) = sv.get("/healthz").await;
    assert_eq!(code, 200);
}

/// A seed and a job racing to create the same new workspace: whichever comes first makes
/// it, and the other sees it whole. A job must never run in the directory a seed is
/// about to cover with its volume (its writes would be hidden beneath the mount), and a
/// seed that succeeded must be what the workspace shows. The windows are narrow (a seed's
/// mkdir to its volume's move; a job's mkdir to its volume's mount), so a run need not hit
/// one: this checks the outcome, and `workspace::tests::a_workspace_is_not_made_while_its_
/// creation_lock_is_held` the lock that closes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_and_a_job_racing_on_a_new_workspace_lose_nothing() {
    crate::cases::setup();
    let sv = Server::start("bwrap", "limits:\n  disk_mb: 64\n");
    let mut seeded = 0;
    for i in 0..30 {
        let ws = unique("race");
        let mut job = crate::harness::command_job(
            &unique("j"),
            "t-race",
            &["sh", "-c", "echo mine > mine.txt"],
        );
        job["workspace_id"] = serde_json::json!(ws);
        let tar = tar_of(&[("seed.txt", b"seed\n")]);
        // The seed starts 0 to 10 ms after the job, so the rounds cover the window from
        // the seed's mkdir to its volume's move, and some jobs come first.
        let lag = Duration::from_micros((i * 337 % 10_000) as u64);
        let seed = async {
            tokio::time::sleep(lag).await;
            sv.put_tar(&ws, tar).await
        };
        let (seed, run) = tokio::join!(seed, sv.post("/v1/worker/jobs:run", &job));
        assert_eq!(run.0, 200, "job {i}: {}", run.1);
        assert_eq!(run.1["status"], "completed", "job {i}: {}", run.1);
        let mut look = crate::harness::command_job(
            &unique("j"),
            "t-race",
            &[
                "sh",
                "-c",
                "cat mine.txt; cat seed.txt 2>/dev/null || echo no-seed",
            ],
        );
        look["workspace_id"] = serde_json::json!(ws);
        let (code, v) = sv.post("/v1/worker/jobs:run", &look).await;
        assert_eq!(code, 200, "{v}");
        let out = v["stdout"].as_str().unwrap_or("");
        assert!(
            out.starts_with("mine\n"),
            "round {i}: the job's write is not in the workspace (seed: {} {}): {v}",
            seed.0,
            seed.1
        );
        if (200..300).contains(&seed.0) {
            seeded += 1;
            assert!(
                out.ends_with("seed\n"),
                "round {i}: the seed succeeded but its file is not in the workspace: {v}"
            );
        } else {
            assert!(out.ends_with("no-seed\n"), "round {i}: {} {v}", seed.1);
            assert!(
                (400..500).contains(&seed.0),
                "round {i}: a refused seed is a client error: {} {}",
                seed.0,
                seed.1
            );
        }
    }
    eprintln!("{seeded} of 30 seeds came first");
    assert_eq!(
        images(&sv, "seed-"),
        Vec::<String>::new(),
        "staging volumes left"
    );
}

/// A stopped node leaves nothing mounted; a volume still in use then (an open directory on
/// it, as a sandbox that outlived the node would hold it) is detached, and the node says
/// so. Its next start mounts the volumes again: a retained job's directory, a workspace
/// holding a `lost+found` of the sandbox's own, and the held workspace, whose image stays
/// attached to its loop device: the restarted node mounts the same device, so both see
/// one filesystem.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_unmounted_while_the_node_is_down_are_mounted_again() {
    crate::cases::setup();
    let mut sv = Server::start("bwrap", "limits:\n  disk_mb: 64\n");
    let state = sv.state_dir();
    let (held, plain, kept) = (unique("held"), unique("plain"), unique("j"));
    let run = |id: &str, ws: &str, script: &str| {
        let mut job = crate::harness::command_job(id, "t-stop", &["sh", "-c", script]);
        job["workspace_id"] = serde_json::json!(ws);
        job
    };
    completed(
        &sv,
        &run(
            &kept,
            &held,
            "echo held > held.txt; echo out > /job/artifacts/a.txt",
        ),
    )
    .await;
    // An open directory on the held workspace's volume keeps it (and its loop device)
    // alive after it is unmounted, as a sandbox that outlived the node would.
    let holder = std::fs::File::open(state.join("workspaces").join(&held)).unwrap();
    let held_dev = holder.metadata().unwrap().dev();
    completed(
        &sv,
        &run(
            &unique("j"),
            &plain,
            "mkdir lost+found && echo keep > lost+found/keep && echo plain > plain.txt",
        ),
    )
    .await;

    sv.terminate();
    let mounts = cynode_testkit::mounts::mounts_beneath(&state);
    assert!(mounts.is_empty(), "a stopped node left {mounts:?}");
    let held_dir = state.join("workspaces").join(&held).display().to_string();
    let log = sv.log.lock().unwrap().clone();
    assert!(
        log.iter()
            .any(|l| l.contains("still in use: detached") && l.contains(&held_dir)),
        "no log line of the held volume's detach: {log:#?}"
    );
    let held_image = state.join("volumes").join(format!("ws-{held}.img"));
    assert!(
        attached(&held_image),
        "the test's premise: the holder keeps {} attached",
        held_image.display()
    );

    sv.restart();
    for dir in [
        state.join("workspaces").join(&held),
        state.join("workspaces").join(&plain),
        state.join("jobs").join(&kept).join("job"),
    ] {
        assert!(
            is_loop_mount(&dir),
            "{} is not mounted again",
            dir.display()
        );
    }
    let (code, v) = sv.get(&format!("/v1/worker/jobs/{kept}")).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        std::fs::read_to_string(state.join("jobs").join(&kept).join("job/artifacts/a.txt"))
            .unwrap(),
        "out\n"
    );
    let (code, v) = sv
        .post(
            "/v1/worker/jobs:run",
            &run(&unique("j"), &held, "cat held.txt; echo after > after.txt"),
        )
        .await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["stdout"], "held\n", "{v}");
    // One filesystem: the same device, and what the node's job wrote is what the holder
    // sees.
    let ws_meta = std::fs::metadata(state.join("workspaces").join(&held)).unwrap();
    assert_eq!(
        ws_meta.dev(),
        held_dev,
        "the held workspace is another filesystem now"
    );
    let through_holder = PathBuf::from(format!(
        "/proc/self/fd/{}/after.txt",
        std::os::fd::AsRawFd::as_raw_fd(&holder)
    ));
    assert_eq!(std::fs::read_to_string(&through_holder).unwrap(), "after\n");
    let (code, v) = sv
        .post(
            "/v1/worker/jobs:run",
            &run(&unique("j"), &plain, "cat plain.txt lost+found/keep"),
        )
        .await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["stdout"], "plain\nkeep\n", "{v}");
    drop(holder);
}

/// Whether a loop device holds `image` (from sysfs).
fn attached(image: &Path) -> bool {
    std::fs::read_dir("/sys/block").unwrap().flatten().any(|e| {
        std::fs::read_to_string(e.path().join("loop/backing_file"))
            .is_ok_and(|s| Path::new(s.trim_end()) == image)
    })
}

/// A volume that cannot be mounted again at start (here: its directory got a file while it
/// was unmounted) is never deleted, and its workspace is refused rather than used empty; once
/// the directory is clean, the next start mounts it again with its content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_that_cannot_be_mounted_again_is_kept_and_its_workspace_refused() {
    crate::cases::setup();
    let mut sv = Server::start("bwrap", "limits:\n  disk_mb: 64\n");
    let state = sv.state_dir();
    let ws = unique("kept");
    let job = |script: &str| {
        let mut j = crate::harness::command_job(&unique("j"), "t-keep", &["sh", "-c", script]);
        j["workspace_id"] = serde_json::json!(ws);
        j
    };
    completed(&sv, &job("echo mine > mine.txt")).await;
    sv.terminate();
    let dir = state.join("workspaces").join(&ws);
    let image = state.join("volumes").join(format!("ws-{ws}.img"));
    assert!(!is_loop_mount(&dir));
    std::fs::write(dir.join("stray"), "").unwrap();

    sv.restart();
    assert!(image.exists(), "the image was deleted");
    assert!(!is_loop_mount(&dir));
    let (code, v) = sv
        .post("/v1/worker/jobs:run", &job("echo other > other.txt"))
        .await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["status"], "failed", "{v}");
    assert!(
        v.to_string().contains("is not mounted"),
        "the refusal names the volume: {v}"
    );
    assert!(
        !dir.join("other.txt").exists(),
        "a job ran beneath the volume"
    );

    sv.terminate();
    std::fs::remove_file(dir.join("stray")).unwrap();
    sv.restart();
    assert!(is_loop_mount(&dir), "not mounted again once clean");
    let (code, v) = sv.post("/v1/worker/jobs:run", &job("cat mine.txt")).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["stdout"], "mine\n", "{v}");
}

/// Runs `job` and checks that it completed; its response.
async fn completed(sv: &Server, job: &serde_json::Value) -> serde_json::Value {
    let (code, v) = sv.post("/v1/worker/jobs:run", job).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["status"], "completed", "{v}");
    v
}

/// Volumes never outlive their node: after a clean stop (SIGTERM), and after a kill -9
/// with a job running and its janitor's sweep, nothing is mounted beneath the state
/// directory and no loop device holds one of its files. Each next start mounts the
/// workspace again, with what the jobs before wrote.
pub async fn disk_volumes_go_with_their_node(backend: &'static str) {
    let mut sv = Server::start(backend, "limits:\n  disk_mb: 64\n");
    let state = sv.state_dir();
    let ws = unique("ws");
    let job = |id: &str, script: &str| {
        let mut j = command_job(id, "t-gone", &["sh", "-c", script]);
        j["workspace_id"] = serde_json::json!(ws);
        j
    };
    completed(&sv, &job(&unique("j"), "echo before > before.txt")).await;
    let ws_dir = state.join("workspaces").join(&ws);
    assert!(is_loop_mount(&ws_dir), "the test's premise: a volume");

    sv.terminate();
    assert_nothing_left(backend, &state, "SIGTERM");
    // Nothing of the node's held them: each was unmounted, none only detached.
    let log = sv.log.lock().unwrap().clone();
    assert!(
        !log.iter().any(|l| l.contains("still in use: detached")),
        "{backend}: {log:#?}"
    );

    sv.restart();
    let v = completed(
        &sv,
        &job(&unique("j"), "cat before.txt; echo after > after.txt"),
    )
    .await;
    assert_eq!(v["stdout"], "before\n", "{backend}: {v}");
    // Killed while a job runs: its sandbox holds the volumes too.
    let running = unique("j");
    let (code, v) = sv
        .post(
            "/v1/worker/jobs",
            &job(&running, "echo up > up.txt; sleep 60"),
        )
        .await;
    assert_eq!(code, 202, "{v}");
    eventually("the job to start", Duration::from_secs(60), || {
        ws_dir.join("up.txt").exists()
    })
    .await;
    sv.kill9();
    wait_janitor_done(&state, Duration::from_secs(75));
    assert_nothing_left(backend, &state, "kill -9 and the janitor's sweep");

    sv.restart();
    let v = completed(&sv, &job(&unique("j"), "cat before.txt after.txt up.txt")).await;
    assert_eq!(v["stdout"], "before\nafter\nup\n", "{backend}: {v}");
}

/// Nothing mounted beneath `state`, no loop device on a file beneath it (a loop device
/// lets go of its file a moment after its last mount went: waited for, at most 10 s).
fn assert_nothing_left(backend: &str, state: &Path, after: &str) {
    if let Err(left) = cynode_testkit::mounts::wait_nothing_left(state, Duration::from_secs(10)) {
        panic!("{backend}: after {after}, the node left {left:#?}");
    }
}
