//! `cynode-reap [--grace SECONDS] -- COMMAND…`: runs COMMAND as a child subreaper and
//! fails when anything COMMAND started is still alive after it.
//!
//! Every process the command starts, however it detaches (double fork, `setsid`, a
//! daemon), is re-parented to this process when its own parent dies, so after the command
//! exits this process's remaining children are exactly what the run left behind. They get
//! `--grace` seconds (default 10) to end by themselves; then each is named with its command
//! line, killed, and the exit status is 1. Otherwise the command's own status is returned.
//! Processes that were alive before the run (a model server a person started, a database
//! cluster) are never children of this process, so they are never touched.

use std::collections::BTreeMap;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut grace = Duration::from_secs(10);
    if args.first().map(String::as_str) == Some("--grace") && args.len() > 1 {
        match args[1].parse::<u64>() {
            Ok(s) => grace = Duration::from_secs(s),
            Err(_) => return usage(),
        }
        args.drain(..2);
    }
    if args.first().map(String::as_str) != Some("--") || args.len() < 2 {
        return usage();
    }
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes an integer flag.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        eprintln!(
            "cynode-reap: cannot become a child subreaper: {}",
            std::io::Error::last_os_error()
        );
        return ExitCode::from(2);
    }
    let status = match Command::new(&args[1]).args(&args[2..]).status() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cynode-reap: cannot run {}: {e}", args[1]);
            return ExitCode::from(2);
        }
    };
    let code = status.code().unwrap_or(1);
    let left = survivors(grace);
    if left.is_empty() {
        eprintln!("cynode-reap: no process of the run outlived it");
        return ExitCode::from(code.clamp(0, 255) as u8);
    }
    eprintln!(
        "cynode-reap: {} process(es) started by the run were still alive {}s after it; killing them:",
        left.len(),
        grace.as_secs()
    );
    for (pid, cmdline) in &left {
        eprintln!("cynode-reap:   pid {pid}: {cmdline}");
        // SAFETY: signalling our own (re-parented) child, not yet reaped.
        unsafe {
            libc::kill(*pid, libc::SIGKILL);
        }
    }
    reap_until(Instant::now() + Duration::from_secs(10));
    ExitCode::from(1)
}

fn usage() -> ExitCode {
    eprintln!("usage: cynode-reap [--grace SECONDS] -- COMMAND [ARG…]");
    ExitCode::from(2)
}

/// Reaps exited children until `until`; returns the live ones left (pid → command line).
fn survivors(grace: Duration) -> BTreeMap<i32, String> {
    reap_until(Instant::now() + grace)
}

fn reap_until(until: Instant) -> BTreeMap<i32, String> {
    loop {
        // SAFETY: non-blocking wait for any child; the status output is a plain int.
        while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
        let live = children();
        if live.is_empty() || Instant::now() >= until {
            return live;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Live (non-zombie) processes whose parent is this process.
fn children() -> BTreeMap<i32, String> {
    let me = std::process::id().to_string();
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the parenthesised command name: state, ppid, …
        let mut rest = stat
            .rsplit_once(')')
            .map(|(_, r)| r)
            .unwrap_or("")
            .split_whitespace();
        let (state, ppid) = (rest.next(), rest.next());
        if ppid == Some(me.as_str()) && state != Some("Z") {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|b| {
                    String::from_utf8_lossy(&b)
                        .replace('\0', " ")
                        .trim()
                        .to_string()
                })
                .unwrap_or_default();
            out.insert(pid, cmdline);
        }
    }
    out
}
