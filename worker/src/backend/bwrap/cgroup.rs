//! The cgroups that hold a node's bwrap sandboxes' memory, pids and CPU limits:
//! `cynode/<node id>/<sandbox>` in the v2 hierarchy, or in each of the v1 `pids`,
//! `memory` and `cpu` hierarchies. A sandbox's client joins its cgroup between fork and
//! exec ([`join_cgroups`]), so every process of the sandbox, bwrap's own included, is in it
//! and can be killed through it. [`remove_node_cgroups`] kills and removes all of one
//! node's: the start-up reconciliation and the node's janitor ([`crate::janitor`]) use it.
//!
//! Only the node makes these directories (a sandbox has its own cgroup namespace and no
//! cgroupfs), so the names read here are the node's; `cgroup.procs` is the kernel's.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::sandbox::ResourceLimits;

const CGROUP_ROOT: &str = "/sys/fs/cgroup";
const CGROUP_PARENT: &str = "cynode";

/// CFS period for the v1 `cpu.cfs_period_us` and the v2 `cpu.max`.
const CPU_PERIOD_US: u64 = 100_000;

/// Moves the calling process into each cgroup whose `cgroup.procs` path is in `procs`
/// (between fork and exec: only open/write/close on paths prepared before the fork).
pub(super) fn join_cgroups(procs: &[CString]) -> std::io::Result<()> {
    // SAFETY: getpid has no preconditions.
    let mut pid = unsafe { libc::getpid() } as u32;
    let mut buf = [0u8; 12];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (pid % 10) as u8;
        pid /= 10;
        if pid == 0 || i == 0 {
            break;
        }
    }
    let digits = &buf[i..];
    for path in procs {
        // SAFETY: path is a valid NUL-terminated string owned by the closure.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: writing a valid buffer to the fd just opened.
        let n = unsafe { libc::write(fd, digits.as_ptr().cast(), digits.len()) };
        // SAFETY: closing the fd just opened.
        unsafe { libc::close(fd) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

pub(super) enum CgroupLayout {
    V1,
    V2,
}

/// The cgroup directories of one sandbox.
pub(super) struct Cgroup {
    dirs: Vec<PathBuf>,
}

impl Cgroup {
    pub(super) fn layout() -> Option<CgroupLayout> {
        let root = Path::new(CGROUP_ROOT);
        if root.join("cgroup.controllers").exists() {
            Some(CgroupLayout::V2)
        } else if root.join("pids").is_dir()
            && root.join("memory").is_dir()
            && root.join("cpu").is_dir()
        {
            Some(CgroupLayout::V1)
        } else {
            None
        }
    }

    /// `cynode/<node id>` in each hierarchy: a node only ever touches its own sandboxes.
    pub(super) fn parent_dirs(node: &str) -> Vec<PathBuf> {
        let root = Path::new(CGROUP_ROOT);
        match Self::layout() {
            Some(CgroupLayout::V2) => vec![root.join(CGROUP_PARENT).join(node)],
            Some(CgroupLayout::V1) => vec![
                root.join("pids").join(CGROUP_PARENT).join(node),
                root.join("memory").join(CGROUP_PARENT).join(node),
                root.join("cpu").join(CGROUP_PARENT).join(node),
            ],
            None => Vec::new(),
        }
    }

    pub(super) fn create(
        node: &str,
        name: &str,
        limits: &ResourceLimits,
    ) -> std::io::Result<Cgroup> {
        let layout = Self::layout()
            .ok_or_else(|| std::io::Error::other("no cgroup hierarchy for limits"))?;
        let memory = (limits.memory_mb * 1024 * 1024).to_string();
        let pids = limits.pids.to_string();
        let cg = Cgroup {
            dirs: Self::parent_dirs(node)
                .into_iter()
                .map(|p| p.join(name))
                .collect(),
        };
        for d in &cg.dirs {
            std::fs::create_dir_all(d)?;
        }
        let write = |dir: &Path, file: &str, value: &str| std::fs::write(dir.join(file), value);
        if let (CgroupLayout::V2, Some(leaf)) = (&layout, cg.dirs.first()) {
            // v2: the controllers must be enabled on every ancestor of the leaf.
            let mut ancestors: Vec<&Path> = leaf.ancestors().skip(1).collect();
            ancestors.retain(|a| a.starts_with(CGROUP_ROOT));
            for a in ancestors.into_iter().rev() {
                let _ = write(a, "cgroup.subtree_control", "+pids +memory +cpu");
            }
        }
        // CPU: `cpus` CPUs' worth of time per period; none (or a nonsense value) means no
        // limit, like podman's `--cpus=0`.
        let quota = (limits.cpus.is_finite() && limits.cpus > 0.0)
            .then(|| ((limits.cpus * CPU_PERIOD_US as f64) as u64).max(1000));
        let res = match layout {
            CgroupLayout::V2 => {
                let d = &cg.dirs[0];
                write(d, "pids.max", &pids)
                    .and_then(|()| write(d, "memory.max", &memory))
                    .map(|()| {
                        let _ = write(d, "memory.swap.max", "0");
                    })
                    .and_then(|()| match quota {
                        Some(q) => write(d, "cpu.max", &format!("{q} {CPU_PERIOD_US}")),
                        None => Ok(()),
                    })
            }
            CgroupLayout::V1 => write(&cg.dirs[0], "pids.max", &pids)
                .and_then(|()| write(&cg.dirs[1], "memory.limit_in_bytes", &memory))
                .map(|()| {
                    let _ = write(&cg.dirs[1], "memory.memsw.limit_in_bytes", &memory);
                })
                .and_then(|()| match quota {
                    Some(q) => write(&cg.dirs[2], "cpu.cfs_period_us", &CPU_PERIOD_US.to_string())
                        .and_then(|()| write(&cg.dirs[2], "cpu.cfs_quota_us", &q.to_string())),
                    None => Ok(()),
                }),
        };
        if let Err(e) = res {
            cg.destroy();
            return Err(e);
        }
        Ok(cg)
    }

    pub(super) fn procs_files(&self) -> Vec<CString> {
        self.dirs
            .iter()
            .filter_map(|d| {
                use std::os::unix::ffi::OsStrExt;
                CString::new(d.join("cgroup.procs").as_os_str().as_bytes()).ok()
            })
            .collect()
    }

    /// Renames the cgroup to `name` (same parent; its processes stay in it); on failure it
    /// keeps its name.
    pub(super) fn rename(&mut self, name: &str) {
        for d in &mut self.dirs {
            let to = d.with_file_name(name);
            match std::fs::rename(&*d, &to) {
                Ok(()) => *d = to,
                Err(e) => {
                    tracing::warn!(cgroup = %d.display(), to = %to.display(), error = %e, "cannot rename a sandbox cgroup");
                }
            }
        }
    }

    /// SIGKILLs every process still in the cgroup, until none is left (at most about
    /// half a second): checked again after 0.1 ms, then at doubling pauses up to 10 ms (a
    /// killed process leaves the list within a millisecond or so).
    pub(super) fn kill_all(&self) {
        let until = Instant::now() + Duration::from_millis(500);
        let mut pause = Duration::from_micros(100);
        // v2 (5.14+): the kernel kills the whole cgroup at once, forks in flight included.
        for d in &self.dirs {
            let _ = std::fs::write(d.join("cgroup.kill"), "1");
        }
        loop {
            let mut any = false;
            for d in &self.dirs {
                let Ok(text) = std::fs::read_to_string(d.join("cgroup.procs")) else {
                    continue;
                };
                for pid in text.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                    any = true;
                    // SAFETY: signalling a process in our own sandbox cgroup.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                    }
                }
            }
            if !any || Instant::now() >= until {
                return;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }

    pub(super) fn destroy(&self) {
        for d in &self.dirs {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// Kills every process in `node`'s sandbox cgroups (in every hierarchy), removes those
/// cgroups and then the node's own directory: what a node leaves when it is gone. Returns
/// how many sandboxes' cgroups there were. Blocking (each cgroup's kill waits, bounded,
/// for its processes to go).
pub fn remove_node_cgroups(node: &str) -> usize {
    let mut names = std::collections::BTreeSet::new();
    for dir in Cgroup::parent_dirs(node) {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                let cg = Cgroup {
                    dirs: vec![e.path()],
                };
                cg.kill_all();
                cg.destroy();
                names.insert(e.file_name());
            }
        }
        let _ = std::fs::remove_dir(&dir);
    }
    names.len()
}
