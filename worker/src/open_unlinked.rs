//! What files a sandbox unlinked but still holds open take on disk: the part of its disk
//! use no walk of its tree can see (the disk guard's second half, see
//! [`crate::disk_guard`]).
//!
//! A sandbox's processes are the host processes running as its workspace's uid
//! ([`crate::uid_pool`]: a uid belongs to one workspace, and nothing in a sandbox can change
//! its uid). For each of them (`/proc/<pid>`, opened once as a directory fd, so a pid
//! reused meanwhile fails rather than being read), its open descriptors (`fd/`) and the
//! files it maps (`map_files/`) are each `stat`ed through their magic link, which leads to
//! the open file itself, never by a path in the sandbox's tree. A regular file with no link
//! left (`st_nlink == 0`) on one of the guarded devices counts its allocated blocks, once
//! however many descriptors hold it. The work is bounded: at most [`Bounds::max_entries`]
//! descriptors and mappings per scan, and a deadline; past either the scan fails, which the
//! guard counts as a breach.
//!
//! Not seen: a descriptor in flight in a unix socket's queue (sent with `SCM_RIGHTS` and not
//! yet received) belongs to no process. The kernel-enforced volumes ([`crate::loopfs`])
//! hold those too.

use std::collections::HashSet;
use std::ffi::CStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Instant;

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

/// What one scan may do.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Descriptors and mappings looked at, over every process.
    pub max_entries: u64,
    pub deadline: Instant,
}

/// Why a scan stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScanError {
    #[error("the sandbox's processes hold more than {0} descriptors and mappings")]
    TooManyEntries(u64),
    #[error("the scan of the sandbox's open files took longer than its bound")]
    TooSlow,
    #[error("cannot read /proc: {0}")]
    Proc(Errno),
}

fn open_dir(dir: BorrowedFd<'_>, name: &str) -> Result<OwnedFd, Errno> {
    crate::fd_walk::open_dir_at(dir, std::ffi::OsStr::new(name))
}

/// The real and effective uids in `/proc/<pid>/status`.
fn uids_of(pid_dir: BorrowedFd<'_>) -> Option<(u32, u32)> {
    let fd = rfs::openat(
        pid_dir,
        "status",
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    let mut buf = vec![0u8; 4096];
    let mut len = 0;
    while len < buf.len() {
        match rustix::io::read(&fd, &mut buf[len..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => len += n,
        }
    }
    let text = std::str::from_utf8(&buf[..len]).ok()?;
    let line = text.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    let mut ids = line.split_whitespace().filter_map(|v| v.parse().ok());
    Some((ids.next()?, ids.next()?))
}

/// Adds the unlinked regular files on `devs` that the entries of `dir` (`fd/` or
/// `map_files/` of one process) lead to.
fn add_entries(
    dir: BorrowedFd<'_>,
    devs: &[u64],
    seen: &mut HashSet<(u64, u64)>,
    entries: &mut u64,
    bytes: &mut u64,
    b: &Bounds,
) -> Result<(), ScanError> {
    let Ok(list) = rfs::Dir::read_from(dir) else {
        return Ok(()); // the process is gone
    };
    for ent in list {
        let Ok(ent) = ent else { return Ok(()) };
        let name: &CStr = ent.file_name();
        if name.to_bytes().first() == Some(&b'.') {
            continue;
        }
        *entries += 1;
        if *entries > b.max_entries {
            return Err(ScanError::TooManyEntries(b.max_entries));
        }
        if entries.is_multiple_of(1024) && Instant::now() > b.deadline {
            return Err(ScanError::TooSlow);
        }
        // Following the magic link: it leads to the open file itself.
        let Ok(st) = rfs::statat(dir, name, AtFlags::empty()) else {
            continue; // closed since it was listed
        };
        if FileType::from_raw_mode(st.st_mode) == FileType::RegularFile
            && st.st_nlink == 0
            && devs.contains(&st.st_dev)
            && seen.insert((st.st_dev, st.st_ino))
        {
            let allocated = u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512);
            *bytes = bytes.saturating_add(allocated);
        }
    }
    Ok(())
}

/// Bytes allocated to regular files on `devs` that no directory links any more and that
/// a process running as one of `owners` (real or effective uid) holds open or mapped.
pub fn unlinked_bytes(owners: &[u32], devs: &[u64], b: Bounds) -> Result<u64, ScanError> {
    if owners.is_empty() || devs.is_empty() {
        return Ok(0);
    }
    let proc_fd = rfs::open(
        "/proc",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(ScanError::Proc)?;
    let mut pids = Vec::new();
    for ent in rfs::Dir::read_from(&proc_fd).map_err(ScanError::Proc)? {
        let ent = ent.map_err(ScanError::Proc)?;
        if let Ok(pid) = std::str::from_utf8(ent.file_name().to_bytes()) {
            if pid.bytes().all(|c| c.is_ascii_digit()) {
                pids.push(pid.to_string());
            }
        }
    }
    let (mut seen, mut entries, mut bytes) = (HashSet::new(), 0u64, 0u64);
    for pid in pids {
        if Instant::now() > b.deadline {
            return Err(ScanError::TooSlow);
        }
        let Ok(pid_dir) = open_dir(proc_fd.as_fd(), &pid) else {
            continue; // exited
        };
        let Some((real, effective)) = uids_of(pid_dir.as_fd()) else {
            continue;
        };
        if !owners.contains(&real) && !owners.contains(&effective) {
            continue;
        }
        for sub in ["fd", "map_files"] {
            if let Ok(d) = open_dir(pid_dir.as_fd(), sub) {
                add_entries(d.as_fd(), devs, &mut seen, &mut entries, &mut bytes, &b)?;
            }
        }
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::MetadataExt;
    use std::time::Duration;

    fn bounds() -> Bounds {
        Bounds {
            max_entries: 1_000_000,
            deadline: Instant::now() + Duration::from_secs(30),
        }
    }

    /// This process's own unlinked file counts once it is unlinked, once however many
    /// descriptors hold it, and only on its device.
    #[test]
    fn an_unlinked_open_file_counts_once() {
        let t = tempfile::tempdir().unwrap();
        let dev = std::fs::metadata(t.path()).unwrap().dev();
        let me = rustix::process::getuid().as_raw();
        let p = t.path().join("f");
        let mut f = std::fs::File::create(&p).unwrap();
        f.write_all(&vec![1u8; 4 << 20]).unwrap();
        f.sync_all().unwrap();
        let before = unlinked_bytes(&[me], &[dev], bounds()).unwrap();
        let _again = std::fs::File::open(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        let after = unlinked_bytes(&[me], &[dev], bounds()).unwrap();
        assert!(after >= before + (4 << 20), "{before} -> {after}");
        assert!(
            after < before + (5 << 20),
            "counted twice: {before} -> {after}"
        );
        assert_eq!(unlinked_bytes(&[me], &[dev ^ 1], bounds()).unwrap(), 0);
        assert_eq!(unlinked_bytes(&[4_000_123], &[dev], bounds()).unwrap(), 0);
        let tight = Bounds {
            max_entries: 1,
            ..bounds()
        };
        assert_eq!(
            unlinked_bytes(&[me], &[dev], tight),
            Err(ScanError::TooManyEntries(1))
        );
    }
}
