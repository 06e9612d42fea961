//! The microvm backend: attacks on the guest kernel itself: a kernel panic the
//! job provokes, a timeout, the pool's one-job-per-VM rule. The backend contract's cases
//! run on it with every other backend's (`backends.rs`, `backends::microvm::<case>`).

use std::time::Duration;

use serde_json::json;

use crate::harness::{command_job, unique, Server};

/// The test environment plus the guest kernel and init (cached after the first build).
pub fn setup() {
    static ONCE: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    crate::cases::setup();
    ONCE.get_or_init(|| {
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        cynode_testkit::setup_script(&root, &["deploy/microvm/build-kernel.sh"]);
        cynode_testkit::setup_script(&root, &["deploy/microvm/build-init.sh"]);
    });
}

/// QEMU processes started for `sv`'s state directory.
fn vms_of(sv: &Server) -> usize {
    let needle = sv.state_dir().display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.starts_with("qemu-system") && c.contains(&needle))
        .count()
}

/// Waits up to 30 s for `sv` to have `n` VMs.
async fn wait_for_vms(sv: &Server, n: usize) {
    let t = std::time::Instant::now();
    while vms_of(sv) != n {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{} VMs, want {n}",
            vms_of(sv)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_job_runs_on_its_own_kernel() {
    setup();
    let sv = Server::start("microvm", "");
    let (_, v) = sv
        .run_job(&unique("j"), "t", &["sh", "-c", "uname -r; id -u; id -g"])
        .await;
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let out = v["stdout"].as_str().unwrap_or_default();
    let mut lines = out.lines();
    let guest = lines.next().unwrap_or_default();
    assert!(guest.starts_with("6.1."), "{v}");
    assert_ne!(guest, host.trim(), "{v}");
    assert_eq!(lines.collect::<Vec<_>>(), ["1000", "1000"], "{v}");
}

/// A job that exhausts its memory (300 MB against 128 MiB: a 64 MiB guest sometimes
/// failed to boot its init at all) in a guest booted with `panic_on_oom=2` panics the
/// guest kernel: the job fails, the console shows the panic, no QEMU is left, and the
/// node runs the next job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_kernel_panic_leaves_the_node_alone() {
    setup();
    let sv = Server::start(
        "microvm",
        "limits:\n  memory_mb: 128\nmicrovm:\n  pool_size: 0\n  kernel_args: [\"sysctl.vm.panic_on_oom=2\"]\n",
    );
    let body = command_job(
        &unique("j"),
        "t",
        &[
            "sh",
            "-c",
            "x=$(head -c 300000000 /dev/zero | tr '\\0' a); echo ${#x}",
        ],
    );
    let (_, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(v["status"], "failed", "{v}");
    let reason = v["failure_reason"].as_str().unwrap_or_default();
    assert!(reason.contains("ended without reporting an exit"), "{v}");
    assert!(reason.contains("Kernel panic"), "{v}");
    assert_eq!(vms_of(&sv), 0);
    let (_, v) = sv.run_job(&unique("j"), "t", &["echo", "alive"]).await;
    assert_eq!(v["stdout"], "alive\n", "{v}");
    let (code, _) = sv.get("/readyz").await;
    assert_eq!(code, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_kills_the_vm() {
    setup();
    let sv = Server::start("microvm", "microvm:\n  pool_size: 0\n");
    let mut body = command_job(&unique("j"), "t", &["sleep", "600"]);
    body["sandbox"]["timeout_seconds"] = json!(2);
    let t = std::time::Instant::now();
    let (_, v) = sv.post("/v1/worker/jobs:run", &body).await;
    assert_eq!(v["status"], "timeout", "{v}");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    assert_eq!(vms_of(&sv), 0, "a QEMU survived its job's timeout");
    assert_eq!(
        crate::harness::mounts_with(&sv.state_dir().display().to_string()),
        Vec::<String>::new()
    );
}

/// Each pooled VM serves one job: two jobs see two boots (different boot ids), and the
/// pool is refilled to its size after each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_pooled_vm_serves_one_job() {
    setup();
    let sv = Server::start("microvm", "microvm:\n  pool_size: 1\n");
    wait_for_vms(&sv, 1).await;
    let mut boots = Vec::new();
    for _ in 0..2 {
        let (_, v) = sv
            .run_job(
                &unique("j"),
                "t",
                &["sh", "-c", "cat /proc/sys/kernel/random/boot_id; ls /tmp"],
            )
            .await;
        assert_eq!(v["status"], "completed", "{v}");
        boots.push(v["stdout"].as_str().unwrap_or_default().to_string());
        wait_for_vms(&sv, 1).await;
    }
    assert_ne!(boots[0], boots[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_kvm_kernel_vmm_and_pool() {
    setup();
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("worker.yaml");
    std::fs::write(
        &cfg,
        format!(
            "backend: microvm\nstate_dir: {}\n",
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cynode-worker"))
        .args(["check", "--config"])
        .arg(&cfg)
        .env("WORKER_API_BEARER_TOKEN", "x".repeat(32))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("ok   backend microvm: "))
        .unwrap_or_else(|| panic!("{text}"));
    for part in [
        "KVM API 12",
        "kernel 6.1.",
        "QEMU emulator version",
        "mksquashfs",
        "pool 0 idle of 2",
    ] {
        assert!(line.contains(part), "{part}: {line}");
    }
}

/// The guest's root holds `/dev/null` and `/dev/console` beneath its `/dev` mount point:
/// a guest whose kernel could open no console (a virtio console probed late under TCG)
/// starts its init without standard streams, and the init's runtime opens `/dev/null` for
/// them before `main`, aborting where there is none (the guest then dies at boot with
/// SIGSEGV from abort's last resort, as PID 1 ignores SIGABRT).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guests_root_has_the_device_nodes_an_init_without_a_console_needs() {
    setup();
    let cache = tempfile::tempdir().unwrap();
    let init =
        std::path::Path::new(cynode_worker::config::microvm::DEFAULT_CACHE).join("cynode-vminit");
    let image = cynode_worker::backend::microvm::rootfs::squashfs_for(
        "mksquashfs",
        &crate::harness::env().rootfs,
        &init,
        cache.path(),
    )
    .await
    .expect("the root is made");
    let mut cmd = std::process::Command::new("unsquashfs");
    cmd.args(["-lln", "-d", ""]).arg(&image).arg("dev");
    let out = cynode_testkit::output_bounded(cmd, Duration::from_secs(60));
    assert!(out.status.success(), "{out:?}");
    let listing = String::from_utf8_lossy(&out.stdout);
    for (node, mode, numbers) in [
        ("/dev/null", "crw-rw-rw-", "1,  3"),
        ("/dev/console", "crw-------", "5,  1"),
    ] {
        let line = listing
            .lines()
            .find(|l| l.ends_with(node))
            .unwrap_or_else(|| panic!("no {node} in the root:\n{listing}"));
        assert!(line.starts_with(mode) && line.contains(numbers), "{line}");
    }
}

/// The share's `/workspace` is an idmapped mount: the workspace's own host uid is the
/// guest's 1000, and nothing else is. A file the guest makes is stored as the workspace's
/// uid; a file of root or of another uid planted in the workspace is shown as nobody's and
/// the guest can neither change root's nor read the other uid's private one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_share_maps_only_the_workspaces_uid() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    setup();
    let sv = Server::start("microvm", "");
    let task = unique("t");
    let (_, v) = sv
        .run_job(
            &unique("j"),
            &task,
            &[
                "sh",
                "-c",
                "echo mine >/workspace/mine && stat -c '%u %g' /workspace",
            ],
        )
        .await;
    assert_eq!(v["stdout"], "1000 1000\n", "{v}");
    let ws = sv.state_dir().join("workspaces").join(&task);
    let ws_uid = std::fs::metadata(&ws).unwrap().uid();
    assert_ne!(ws_uid, 1000);
    let mine = std::fs::metadata(ws.join("mine")).unwrap();
    assert_eq!((mine.uid(), mine.gid()), (ws_uid, ws_uid));
    std::fs::write(ws.join("root_file"), "root's\n").unwrap();
    std::fs::set_permissions(ws.join("root_file"), std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::write(ws.join("other_file"), "private\n").unwrap();
    std::os::unix::fs::chown(ws.join("other_file"), Some(ws_uid + 1), Some(ws_uid + 1)).unwrap();
    std::fs::set_permissions(
        ws.join("other_file"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let script = "stat -c '%u %u' /workspace/root_file /workspace/other_file | tr '\\n' ' '; \
                  echo x >>/workspace/root_file 2>/dev/null && echo WROTE; \
                  cat /workspace/other_file 2>/dev/null && echo READ; \
                  chmod 666 /workspace/root_file 2>/dev/null && echo CHMOD; echo end";
    let (_, v) = sv.run_job(&unique("j"), &task, &["sh", "-c", script]).await;
    assert_eq!(v["stdout"], "65534 65534 65534 65534 end\n", "{v}");
    assert_eq!(
        std::fs::read_to_string(ws.join("root_file")).unwrap(),
        "root's\n"
    );
    let root_file = std::fs::metadata(ws.join("root_file")).unwrap();
    assert_eq!((root_file.uid(), root_file.mode() & 0o777), (0, 0o644));
}
