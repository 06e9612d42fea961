//! Attacks on the sandbox walls: vsock and the x32 ABI in a job's sandbox, and
//! a workspace's git clean filter escaping the changeset sandbox's limits. Each runs in a
//! real sandbox, with raw syscalls from [`crate::syscall_probe`], on both backends.

use std::path::Path;
use std::time::Duration;

use crate::harness::{unique, Server, TOKEN};
use crate::syscall_probe::{result, run_line, X32};

on_both_backends!(
    hardening:
    hardening_vsock_and_x32_are_denied,
    hardening_changeset_filter_is_confined_like_a_job,
);

/// Item 7 and 11: `socket(AF_VSOCK)` fails with EPERM/EACCES (a network namespace does not
/// separate vsock), an x32 syscall is refused (EPERM, or SIGSYS by the OCI profile's
/// bad-architecture action; ENOSYS would mean the call reached the kernel), and an
/// ordinary AF_UNIX socket still works.
pub async fn hardening_vsock_and_x32_are_denied(backend: &'static str) {
    let sv = Server::start(backend, "");
    let socket = libc::SYS_socket as u32;
    let script = [
        run_line("vsock", socket, [libc::AF_VSOCK as u32, 1, 0]),
        run_line("alg", socket, [libc::AF_ALG as u32, 5, 0]),
        run_line("unix", socket, [libc::AF_UNIX as u32, 1, 0]),
        run_line("x32getpid", X32 | libc::SYS_getpid as u32, [0; 3]),
        run_line("x32movepages", X32 | 533, [0; 3]),
    ]
    .join("; ");
    let (code, v) = sv.run_job(&unique("j"), "t", &["sh", "-c", &script]).await;
    assert_eq!(code, 200, "{v}");
    let out = v["stdout"].as_str().unwrap_or_default();
    eprintln!("{backend}: {out}");
    let got = |name: &str| result(out, name).unwrap_or_else(|| panic!("no {name}= in {v}"));
    assert!(
        [libc::EPERM, libc::EACCES].contains(&got("vsock")),
        "{backend}: socket(AF_VSOCK): {out}"
    );
    assert_eq!(got("alg"), libc::EPERM, "{backend}: socket(AF_ALG): {out}");
    assert_eq!(got("unix"), 0, "{backend}: socket(AF_UNIX): {out}");
    // gVisor's kernel has no x32 system calls at all: ENOSYS, nothing runs.
    let refused: &[i32] = if backend == "runsc" {
        &[libc::EPERM, 128 + libc::SIGSYS, libc::ENOSYS]
    } else {
        &[libc::EPERM, 128 + libc::SIGSYS]
    };
    for x32 in ["x32getpid", "x32movepages"] {
        assert!(
            refused.contains(&got(x32)),
            "{backend}: {x32} was not refused: {out}"
        );
    }
}

/// The clean filter of [`hardening_changeset_filter_is_confined_like_a_job`]: raw syscalls
/// the job sandbox refuses, a nested user namespace, a fork bomb, memory and /dev/shm
/// fills, all reported on its stdout, which becomes the changeset's content of `a.txt`.
fn attack_script() -> String {
    let probes = [
        run_line(
            "unshare",
            libc::SYS_unshare as u32,
            [libc::CLONE_NEWUSER as u32, 0, 0],
        ),
        run_line("keyctl", libc::SYS_keyctl as u32, [0, (-3i32) as u32, 0]),
        run_line("iouring", libc::SYS_io_uring_setup as u32, [1, 0, 0]),
        run_line("perf", libc::SYS_perf_event_open as u32, [0, 0, 0]),
        run_line("ptrace", libc::SYS_ptrace as u32, [0, 0, 0]),
        run_line(
            "vsock",
            libc::SYS_socket as u32,
            [libc::AF_VSOCK as u32, 1, 0],
        ),
    ]
    .join("\n");
    format!(
        "exec 2>/dev/null\ncd /tmp\n{probes}\n\
         unshare -Ur true; echo unshare_r=$?\n\
         dd if=/dev/zero of=/dev/null bs=300M count=1; echo bigmem=$?\n\
         dd if=/dev/zero of=/dev/shm/fill bs=1M count=400; echo shm_kib=$(du -sk /dev/shm/fill | cut -f1)\n\
         rm -f /dev/shm/fill\n\
         (i=0; while [ $i -lt 300 ]; do sleep 1000 </dev/null >/dev/null 2>&1 & echo $! >> /tmp/bomb; i=$((i+1)); done)\n\
         set -- /proc/[0-9]*; echo procs=$#\n\
         while read p; do kill -9 $p; done < /tmp/bomb\n"
    )
}

/// Item 6: a workspace whose git clean filter (its own `.git/config` and attributes,
/// which the node's changeset runs) tries what a job's sandbox refuses. Everything is
/// refused or bounded by the job's limits: seccomp, no nested user namespace, the pids
/// and memory limits of a cgroup, a small /dev/shm.
pub async fn hardening_changeset_filter_is_confined_like_a_job(backend: &'static str) {
    let sv = Server::start(backend, "limits:\n  pids: 64\n  memory_mb: 128\n");
    let src = tempfile::tempdir().unwrap();
    let r = src.path().join("r");
    std::fs::create_dir_all(&r).unwrap();
    std::fs::write(r.join("a.txt"), "one\n").unwrap();
    crate::workspaces::git(&r, &["init", "-q"]);
    crate::workspaces::git(&r, &["add", "a.txt"]);
    crate::workspaces::git(&r, &["commit", "-q", "-m", "init"]);
    std::fs::create_dir_all(r.join(".git/info")).unwrap();
    std::fs::write(r.join(".git/info/attributes"), "a.txt filter=evil\n").unwrap();
    std::fs::write(r.join(".git/attack.sh"), attack_script()).unwrap();
    let mut cfg = std::fs::read_to_string(r.join(".git/config")).unwrap();
    cfg.push_str("[filter \"evil\"]\n\tclean = sh .git/attack.sh\n");
    std::fs::write(r.join(".git/config"), cfg).unwrap();
    std::fs::write(r.join("a.txt"), "two\n").unwrap();
    let ws = unique("ws");
    let (code, v) = sv.put_tar(&ws, tar_of_dir(&r)).await;
    assert_eq!(code, 201, "{v}");

    let resp = sv
        .client
        .get(sv.url(&format!("/v1/worker/workspaces/{ws}/changeset")))
        .bearer_auth(TOKEN)
        .timeout(Duration::from_secs(180))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let diff = resp.text().await.unwrap();
    assert_eq!(status, 200, "{backend}: {diff}");
    // The filter's report is the new content of a.txt: `+name=value` lines.
    let report: String = diff
        .lines()
        .filter_map(|l| l.strip_prefix('+'))
        .map(|l| format!("{l}\n"))
        .collect();
    let got = |name: &str| {
        result(&report, name).unwrap_or_else(|| panic!("{backend}: no {name}= in {diff}"))
    };
    eprintln!("{backend}: changeset filter report:\n{report}");
    for denied in ["unshare", "keyctl", "iouring", "perf", "ptrace", "vsock"] {
        assert_eq!(got(denied), libc::EPERM, "{backend}: {denied}: {report}");
    }
    assert_ne!(got("unshare_r"), 0, "{backend}: unshare -Ur: {report}");
    assert_ne!(
        got("bigmem"),
        0,
        "{backend}: 300 MiB under a 128 MiB limit: {report}"
    );
    assert!(got("shm_kib") <= 1024, "{backend}: /dev/shm: {report}");
    assert!(got("procs") <= 64, "{backend}: pids: {report}");
    assert!(
        no_changeset_cgroup_left(&sv),
        "{backend}: a changeset cgroup was left"
    );
}

/// No `changeset-*` cgroup of `sv`'s node remains (its id is the state directory's
/// hash, as the node derives it).
fn no_changeset_cgroup_left(sv: &Server) -> bool {
    crate::harness::node_cgroup_dirs(&sv.state_dir())
        .iter()
        .filter_map(|p| std::fs::read_dir(p).ok())
        .flat_map(|d| d.flatten())
        .all(|g| !g.file_name().to_string_lossy().starts_with("changeset-"))
}

fn tar_of_dir(dir: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    b.append_dir_all(".", dir).unwrap();
    b.into_inner().unwrap()
}
