//! What a test's worker left mounted: the mounts beneath a directory (from
//! `/proc/self/mountinfo`) and the loop devices whose backing file lies beneath it (from
//! sysfs, what `losetup -a` lists). Tests run in parallel, so a test looks only beneath
//! its own directories, never at the host's counts. The kit unmounts nothing itself: a
//! worker's volumes are the worker's to let go of (its clean stop, its janitor after a
//! kill), and a test that finds one left fails.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The mount points at or beneath `dir` (`dir` as the kernel names it: its real path).
pub fn mounts_beneath(dir: &Path) -> Vec<PathBuf> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape)
        .filter(|p| p.starts_with(&dir))
        .collect()
}

/// The loop devices whose backing file lies beneath `dir`, each as `/dev/loopN: file`.
pub fn loop_devices_beneath(dir: &Path) -> Vec<String> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let Ok(block) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    block
        .flatten()
        .filter_map(|e| {
            let file = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            let file = file.trim_end_matches('\n');
            Path::new(file)
                .starts_with(&dir)
                .then(|| format!("/dev/{}: {file}", e.file_name().to_string_lossy()))
        })
        .collect()
}

/// What is left beneath `dir`: its mounts and loop devices, one line each.
pub fn left_beneath(dir: &Path) -> Vec<String> {
    let mut left: Vec<String> = mounts_beneath(dir)
        .iter()
        .map(|p| format!("mounted: {}", p.display()))
        .collect();
    left.extend(
        loop_devices_beneath(dir)
            .into_iter()
            .map(|l| format!("loop device: {l}")),
    );
    left
}

/// Waits (at most `within`: a loop device lets go of its file a moment after its last
/// mount went) until nothing is mounted beneath `dir` and no loop device holds a file
/// beneath it; what is still left otherwise.
pub fn wait_nothing_left(dir: &Path, within: Duration) -> Result<(), Vec<String>> {
    let until = Instant::now() + within;
    loop {
        let left = left_beneath(dir);
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() >= until {
            return Err(left);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Undoes mountinfo's octal escapes (`\040` for a space, …).
fn unescape(s: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}
