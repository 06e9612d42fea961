//! Per-uid kernel budgets: the kernel keeps some counts per user (inotify
//! instances, `fs.inotify.max_user_instances`, 128 here), so tenants that share a host uid
//! share those budgets, and one job could take them all. Each workspace runs as a host uid
//! of its own (`sandbox_uids`): a job holding every inotify instance its uid may have
//! leaves another workspace's job its whole budget. On both backends.

use std::time::{Duration, Instant};

use crate::harness::{unique, Server};
use crate::syscall_probe::{elf_of, printf_escaped, result, run_line};

on_both_backends!(
    tenant_uids:
    tenant_inotify_budget_is_not_shared_across_workspaces,
);

/// `inotify_init1` on x86_64.
const INOTIFY_INIT1: u32 = 294;

/// A static ELF that makes inotify instances until the kernel refuses one (or `cap` are
/// made), writes how many it holds (4 bytes, little-endian) to stdout, and then holds them
/// until it is killed.
fn holder(cap: u32) -> Vec<u8> {
    let mut code = vec![
        0x31, 0xDB, // xor ebx, ebx            ; held = 0
        0xB8, // loop: mov eax, inotify_init1
    ];
    code.extend_from_slice(&INOTIFY_INIT1.to_le_bytes());
    code.extend_from_slice(&[
        0x31, 0xFF, // xor edi, edi            ; flags 0
        0x0F, 0x05, // syscall
        0x48, 0x85, 0xC0, // test rax, rax
        0x78, 0x0A, // js done
        0xFF, 0xC3, // inc ebx
        0x81, 0xFB, // cmp ebx, cap
    ]);
    code.extend_from_slice(&cap.to_le_bytes());
    code.extend_from_slice(&[
        0x72, 0xE8, // jb loop
        0x53, // done: push rbx
        0xB8, 0x01, 0x00, 0x00, 0x00, // mov eax, 1 (write)
        0xBF, 0x01, 0x00, 0x00, 0x00, // mov edi, 1 (stdout)
        0x48, 0x89, 0xE6, // mov rsi, rsp
        0xBA, 0x04, 0x00, 0x00, 0x00, // mov edx, 4
        0x0F, 0x05, // syscall
        0xB8, 0x22, 0x00, 0x00, 0x00, // hold: mov eax, 34 (pause)
        0x0F, 0x05, // syscall
        0xEB, 0xF7, // jmp hold
    ]);
    elf_of(&code)
}

/// The host's `fs.inotify.max_user_instances`.
fn max_user_instances() -> u32 {
    std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances")
        .expect("fs.inotify.max_user_instances")
        .trim()
        .parse()
        .expect("a number")
}

/// Job A (its own workspace) takes every inotify instance its uid may have and holds them;
/// job B, on another workspace, still makes one. The two ran as different host uids.
pub async fn tenant_inotify_budget_is_not_shared_across_workspaces(backend: &'static str) {
    use std::os::unix::fs::MetadataExt;
    let max = max_user_instances();
    let sv = Server::start(backend, "");
    let (task_a, task_b, job_a) = (unique("ta"), unique("tb"), unique("ja"));
    // Past the limit: the kernel refuses one before the cap, so A holds its uid's whole budget.
    let cap = max + 16;
    let hold = format!(
        "printf '{}' > ./hold && chmod 755 ./hold && exec ./hold > /workspace/held",
        printf_escaped(&holder(cap))
    );
    let body = crate::harness::command_job(&job_a, &task_a, &["sh", "-c", &hold]);
    let (code, v) = sv.post("/v1/worker/jobs", &body).await;
    assert_eq!(code, 202, "{backend}: {v}");
    let held_file = sv.state_dir().join("workspaces").join(&task_a).join("held");
    let until = Instant::now() + Duration::from_secs(120);
    let held = loop {
        if let Ok(b) = std::fs::read(&held_file) {
            if b.len() == 4 {
                break u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        let (_, st) = sv.get(&format!("/v1/worker/jobs/{job_a}")).await;
        assert!(
            !matches!(
                st["status"].as_str(),
                Some("completed" | "failed" | "timeout" | "canceled")
            ),
            "{backend}: job A ended before holding its instances: {st}"
        );
        assert!(Instant::now() < until, "{backend}: job A never reported");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("{backend}: job A holds {held} inotify instances (limit {max})");
    // gVisor (runsc) keeps inotify in its own kernel, never charged to a host uid: there A
    // meets no limit at all, and B must still succeed.
    assert!(
        held >= 1 && (held < cap || backend == "runsc"),
        "{backend}: job A must have met its uid's limit: held {held} of cap {cap}"
    );

    // Job B, another workspace: its own budget is untouched.
    let probe = format!(
        ": > /workspace/mine; {}",
        run_line("one", INOTIFY_INIT1, [0; 3])
    );
    let (code, v) = sv
        .run_job(&unique("jb"), &task_b, &["sh", "-c", &probe])
        .await;
    assert_eq!(code, 200, "{backend}: {v}");
    let out = v["stdout"].as_str().unwrap_or_default();
    assert_eq!(
        result(out, "one"),
        Some(0),
        "{backend}: job B could not make one inotify instance (24 = EMFILE: the budget is shared): {v}"
    );

    // Two host uids, neither root nor the node's.
    let uid_a = std::fs::metadata(&held_file).unwrap().uid();
    let mine = sv.state_dir().join("workspaces").join(&task_b).join("mine");
    let uid_b = std::fs::metadata(&mine).unwrap().uid();
    eprintln!("{backend}: host uids: A {uid_a}, B {uid_b}");
    assert_ne!(
        uid_a, uid_b,
        "{backend}: both workspaces run as one host uid"
    );
    assert!(uid_a != 0 && uid_b != 0, "{backend}: root-owned files");

    let (code, v) = sv
        .post(
            &format!("/v1/worker/jobs/{job_a}:stop"),
            &serde_json::json!({}),
        )
        .await;
    assert_eq!(code, 200, "{backend}: {v}");
    let end = sv.wait_terminal(&job_a).await;
    assert_eq!(end["status"], "canceled", "{backend}: {end}");
}

/// The holder itself, on the host: it makes `cap` instances, says so and keeps running.
#[test]
fn holder_reports_what_it_holds_and_keeps_running() {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("hold");
    std::fs::write(&p, holder(3)).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut child = std::process::Command::new(&p)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut n = [0u8; 4];
    child.stdout.take().unwrap().read_exact(&mut n).unwrap();
    assert_eq!(u32::from_le_bytes(n), 3);
    let fds = std::fs::read_dir(format!("/proc/{}/fd", child.id()))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy() == "anon_inode:inotify")
        .count();
    assert_eq!(fds, 3);
    assert!(child.try_wait().unwrap().is_none(), "the holder exited");
    child.kill().unwrap();
    child.wait().unwrap();
}
