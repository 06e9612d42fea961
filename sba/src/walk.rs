//! Directory walking beneath the workspace without ever following a symlink.
//!
//! Directories are opened relative to their parent's fd with `O_NOFOLLOW | O_DIRECTORY`,
//! so a symlink swapped in during the walk is reported as a symlink, never entered.

use std::ffi::OsString;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags};

/// Deepest directory level any walk descends to.
pub const MAX_WALK_DEPTH: u32 = 256;

/// One directory entry: name and type (stat'ed when the kernel did not say).
#[derive(Debug)]
pub struct Entry {
    pub name: OsString,
    pub file_type: FileType,
}

/// Lists a directory sorted by name (byte order) for deterministic output.
pub fn read_entries(dir: &OwnedFd) -> std::io::Result<Vec<Entry>> {
    let mut out = Vec::new();
    let mut iter = Dir::read_from(dir)?;
    while let Some(entry) = iter.read() {
        let entry = entry?;
        let bytes = entry.file_name().to_bytes();
        if bytes == b"." || bytes == b".." {
            continue;
        }
        let name = OsString::from_vec(bytes.to_vec());
        let mut file_type = entry.file_type();
        if file_type == FileType::Unknown {
            file_type = rustix::fs::statat(dir, &name, AtFlags::SYMLINK_NOFOLLOW)
                .map(|st| FileType::from_raw_mode(st.st_mode))
                .unwrap_or(FileType::Unknown);
        }
        out.push(Entry { name, file_type });
    }
    out.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Opens a child directory without following a symlink.
pub fn open_child_dir(dir: &impl AsFd, name: &OsString) -> std::io::Result<OwnedFd> {
    Ok(rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// Opens a child regular file without following a symlink; `None` when it is not a
/// single-link regular file (hard links and specials are skipped by walks).
pub fn open_child_file(dir: &impl AsFd, name: &OsString) -> Option<(std::fs::File, u64)> {
    let fd = rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    let st = rustix::fs::fstat(&fd).ok()?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile || st.st_nlink > 1 {
        return None;
    }
    Some((std::fs::File::from(fd), st.st_size as u64))
}

/// Calls `visit(relative_path, dir_fd, name)` for every regular file under `start`
/// (depth-first, sorted), skipping the contents of `.git`. Stops early when `visit`
/// returns false.
pub fn for_each_file(
    start: OwnedFd,
    start_rel: &std::path::Path,
    visit: &mut dyn FnMut(&std::path::Path, &OwnedFd, &OsString) -> bool,
) -> std::io::Result<()> {
    let mut stack = vec![(start, start_rel.to_path_buf(), 0u32)];
    while let Some((dir, rel, depth)) = stack.pop() {
        let entries = read_entries(&dir)?;
        let mut subdirs = Vec::new();
        for e in entries {
            let path = rel.join(&e.name);
            match e.file_type {
                FileType::RegularFile if !visit(&path, &dir, &e.name) => return Ok(()),
                FileType::Directory if e.name != ".git" && depth < MAX_WALK_DEPTH => {
                    if let Ok(fd) = open_child_dir(&dir, &e.name) {
                        subdirs.push((fd, path, depth + 1));
                    }
                }
                _ => {}
            }
        }
        // Reverse so the stack pops them in sorted order.
        stack.extend(subdirs.into_iter().rev());
    }
    Ok(())
}
