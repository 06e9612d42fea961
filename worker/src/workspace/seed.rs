//! Seeding a workspace from a host directory or a tar, without a race against sandboxes.
//!
//! Everything is built in a fresh staging directory under `<state>/staging/` (root-owned,
//! mode 0700): no sandbox mounts it or can reach it, so nothing else writes there while the
//! tree is built. Every create and chown goes through a directory fd with no-follow
//! resolution (see [`super::beneath`]), so the tree being built cannot redirect a write either.
//! Every symlink is then resolved against the finished tree, and links leading out are
//! removed. Only then does the tree become the workspace, by one atomic rename: a workspace
//! that does not exist is created by `renameat2(RENAME_NOREPLACE)`; an existing empty one
//! (which a running sandbox may have mounted) is swapped out with `RENAME_EXCHANGE` and
//! removed, and if it turned out not to be empty the swap is undone and seeding is refused.
//!
//! A workspace that does not exist yet is staged on a disk volume of its own
//! ([`Staging::new_volume`], when the node has volumes): the seed is bounded by
//! `limits.disk_mb` while it is built, and publishing moves that mount onto the
//! workspace's new directory (its image renamed `ws-<id>.img`), so the kernel holds the
//! seeded workspace's limit as it holds a job-made one's.

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{self as rfs, FileType, RenameFlags, CWD};
use rustix::io::Errno;

use super::beneath::{self, plain_components};

/// Bounds on what one seed may create.
#[derive(Debug, Clone, Copy)]
pub struct SeedLimits {
    pub max_entries: u64,
    pub max_bytes: u64,
    pub max_depth: usize,
}

impl Default for SeedLimits {
    fn default() -> Self {
        Self {
            max_entries: 200_000,
            max_bytes: 16 << 30,
            max_depth: 128,
        }
    }
}

/// Why seeding failed.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    /// The tar or source tree breaks a rule (the request's fault).
    #[error("{0}")]
    Refused(String),
    /// The workspace received content while it was being seeded.
    #[error("workspace already has content")]
    HasContent,
    /// The workspace is a disk volume (a job or session made it), which a staged tree
    /// cannot be renamed onto: seed a workspace before its first job or session.
    #[error("workspace is a disk volume made by a job or session; seed it before its first job or session")]
    Volume,
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Whether `e` says a filesystem is full (bytes or inodes).
pub fn is_full(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// A tar entry that could not be made: the workspace's volume being full stays an I/O
/// error (the caller says the seed does not fit); anything else refuses the entry.
fn entry_error(shown: &str, e: std::io::Error) -> SeedError {
    if is_full(&e) {
        SeedError::Io(e)
    } else {
        refuse(format!("entry {shown}: {e}"))
    }
}

fn refuse(msg: impl Into<String>) -> SeedError {
    SeedError::Refused(msg.into())
}

/// What a seed did.
#[derive(Debug, Default)]
pub struct SeedReport {
    pub files: u64,
    pub bytes: u64,
    pub skipped: Vec<String>,
}

/// A private directory that a tree is built in; removed on drop unless published.
#[derive(Debug)]
pub struct Staging {
    path: PathBuf,
    root: OwnedFd,
    published: bool,
    /// The host uid the tree is built for (its workspace's).
    owner: u32,
    /// Whether the staging directory is a disk volume ([`Staging::new_volume`]).
    volume: bool,
}

impl Staging {
    /// A fresh staging directory under `<state_dir>/staging`, owned by `owner` (the
    /// workspace's host uid) inside a root-only parent; everything built in it is too.
    pub fn new(state_dir: &Path, owner: u32) -> std::io::Result<Self> {
        Self::make(state_dir, owner, false)
    }

    /// [`Staging::new`] for a workspace that does not exist yet: the staging directory is
    /// a disk volume ([`crate::loopfs`]) when the node has them, and [`Staging::publish`]
    /// moves that volume onto the workspace's path.
    pub fn new_volume(state_dir: &Path, owner: u32) -> std::io::Result<Self> {
        Self::make(state_dir, owner, true)
    }

    fn make(state_dir: &Path, owner: u32, volume: bool) -> std::io::Result<Self> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let parent = state_dir.join("staging");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&parent)?;
        std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o700))?;
        let path = fresh_dir(&parent)?;
        let mut stage = Self {
            root: beneath::open_root(&path)?,
            path,
            published: false,
            owner,
            volume: false,
        };
        if volume {
            // A disk volume of its own (labelled after the staging directory until it
            // is published), so the seeded workspace is bounded by the kernel as a
            // job-made one. Without volumes, a plain directory as before.
            let (dir, name) = crate::job_dir::split(&stage.path)?;
            let label = name.to_string_lossy().into_owned();
            let dir = crate::job_dir::open_node_dir(dir)?;
            if let Some(root) = crate::loopfs::cover(dir.as_fd(), name, &label) {
                stage.root = root;
                stage.volume = true;
            }
        }
        let id = rfs::Uid::from_raw(owner);
        let gid = rfs::Gid::from_raw(owner);
        rfs::fchown(&stage.root, Some(id), Some(gid))?;
        rfs::fchmod(&stage.root, rfs::Mode::from_raw_mode(0o755))?;
        Ok(stage)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the tree is built on a disk volume of its own ([`Staging::new_volume`]).
    pub fn is_volume(&self) -> bool {
        self.volume
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.root.as_fd()
    }

    /// The host uid the tree is built for.
    pub fn owner(&self) -> u32 {
        self.owner
    }

    /// Makes the staged tree the directory `target` (see the module docs).
    pub fn publish(mut self, target: &Path) -> Result<(), SeedError> {
        let _creating = super::creation_lock(target);
        if self.volume {
            return self.publish_volume(target);
        }
        match rfs::renameat_with(CWD, &self.path, CWD, target, RenameFlags::NOREPLACE) {
            Ok(()) => {
                self.published = true;
                return Ok(());
            }
            Err(Errno::EXIST) => {}
            Err(e) => return Err(std::io::Error::from(e).into()),
        }
        // An existing (empty) workspace: swap, then look at what was swapped out. A mount
        // point (a job's disk volume) cannot be swapped: EBUSY, or EXDEV across devices.
        match rfs::renameat_with(CWD, &self.path, CWD, target, RenameFlags::EXCHANGE) {
            Ok(()) => {}
            Err(Errno::BUSY | Errno::XDEV) => return Err(SeedError::Volume),
            Err(e) => return Err(std::io::Error::from(e).into()),
        }
        let old_is_empty = beneath::open_root(&self.path)
            .and_then(|fd| beneath::list(fd.as_fd(), 1))
            .map(|names| names.is_empty())
            .unwrap_or(false);
        if old_is_empty {
            // `self.path` now holds the old, empty workspace; drop removes it.
            return Ok(());
        }
        rfs::renameat_with(CWD, &self.path, CWD, target, RenameFlags::EXCHANGE)
            .map_err(std::io::Error::from)?;
        Err(SeedError::HasContent)
    }
}

impl Staging {
    /// A volume's tree becomes `target`, which must not exist (a job or session that made
    /// it meanwhile has it): the image is renamed after the workspace, the volume moved
    /// onto a new directory there, and the staging directory removed.
    fn publish_volume(mut self, target: &Path) -> Result<(), SeedError> {
        let (parent, name) = crate::job_dir::split(target)?;
        let parent = crate::job_dir::open_node_dir(parent)?;
        match rfs::mkdirat(&parent, name, rfs::Mode::from_raw_mode(0o700)) {
            Ok(()) => {}
            Err(Errno::EXIST) => return Err(SeedError::HasContent),
            Err(e) => return Err(std::io::Error::from(e).into()),
        }
        // The directory beneath the volume is a usable empty workspace of its own, should
        // the move fail or the node die before it: the workspace's uid, 0755.
        let owner = Some(rfs::Uid::from_raw(self.owner));
        rfs::chownat(
            &parent,
            name,
            owner,
            Some(rfs::Gid::from_raw(self.owner)),
            rfs::AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(std::io::Error::from)?;
        rfs::chmodat(
            &parent,
            name,
            rfs::Mode::from_raw_mode(0o755),
            rfs::AtFlags::empty(),
        )
        .map_err(std::io::Error::from)?;
        let label = crate::loopfs::workspace_label(name);
        let moved = crate::loopfs::relabel(&self.path, &label)
            .and_then(|()| crate::loopfs::move_volume(&self.path, parent.as_fd(), name));
        if let Err(e) = moved {
            // Drop releases the volume (under whichever name it has now).
            let _ = rfs::unlinkat(&parent, name, rfs::AtFlags::REMOVEDIR);
            return Err(e.into());
        }
        self.published = true;
        let _ = std::fs::remove_dir(&self.path);
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.published {
            if self.volume {
                crate::loopfs::release_beneath(&self.path);
            }
            // std's remove_dir_all does not follow links.
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Creates a new, uniquely named directory in `parent` (root-only until chowned).
fn fresh_dir(parent: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    loop {
        let p = parent.join(format!(
            "seed-{}-{}-{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        match std::fs::DirBuilder::new().mode(0o700).create(&p) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Creates the parent directories of `parts` beneath `root` (never through a link) and
/// returns the innermost one.
fn parents(root: BorrowedFd<'_>, parts: &[&OsStr], owner: u32) -> Result<OwnedFd, SeedError> {
    let mut cur = beneath::open_dir(root, Path::new("."))?;
    for (i, p) in parts.iter().enumerate() {
        cur = beneath::make_dir(cur.as_fd(), p, 0o755, owner).map_err(|e| {
            let shown: PathBuf = parts[..=i].iter().collect();
            refuse(format!("{}: {e}", shown.display()))
        })?;
    }
    Ok(cur)
}

/// Unpacks a tar into the staging tree: regular files, directories and symlinks; no
/// absolute paths, no `..`, nothing through a link; other entry types are skipped; links
/// that resolve out of the finished tree are removed and reported as skipped.
pub fn unpack_tar(
    bytes: &[u8],
    stage: &Staging,
    limits: SeedLimits,
) -> Result<SeedReport, SeedError> {
    let root = stage.fd();
    let owner = stage.owner();
    let mut report = SeedReport::default();
    let mut links = Vec::new();
    let mut archive = tar::Archive::new(bytes);
    let mut count = 0u64;
    for entry in archive.entries()? {
        let mut entry = entry?;
        count += 1;
        if count > limits.max_entries {
            return Err(refuse(format!("more than {} entries", limits.max_entries)));
        }
        let path = entry.path()?.into_owned();
        let shown = path.display().to_string();
        let Some(parts) = plain_components(&path) else {
            return Err(refuse(format!("entry {shown} escapes the workspace")));
        };
        if parts.len() > limits.max_depth {
            return Err(refuse(format!(
                "entry {shown} is nested deeper than {}",
                limits.max_depth
            )));
        }
        let kind = entry.header().entry_type();
        let Some((name, dirs)) = parts.split_last() else {
            continue; // "." itself
        };
        let mode = entry.header().mode().unwrap_or(0o644);
        match kind {
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let size = entry.header().size()?;
                if report.bytes.saturating_add(size) > limits.max_bytes {
                    return Err(refuse(format!("content over {} bytes", limits.max_bytes)));
                }
                let dir = parents(root, dirs, owner)?;
                let n = beneath::write_file(dir.as_fd(), name, mode, owner, &mut entry)
                    .map_err(|e| entry_error(&shown, e))?;
                report.files += 1;
                report.bytes += n;
            }
            tar::EntryType::Directory => {
                let dir = parents(root, dirs, owner)?;
                beneath::make_dir(dir.as_fd(), name, mode, owner)
                    .map_err(|e| entry_error(&shown, e))?;
            }
            tar::EntryType::Symlink => {
                let Some(target) = entry.link_name()? else {
                    report.skipped.push(shown);
                    continue;
                };
                if target.is_absolute() || target.as_os_str().is_empty() {
                    report.skipped.push(shown);
                    continue;
                }
                let dir = parents(root, dirs, owner)?;
                beneath::write_link(dir.as_fd(), name, &target, owner)
                    .map_err(|e| entry_error(&shown, e))?;
                links.push(path);
            }
            _ => report.skipped.push(shown),
        }
    }
    drop_outward_links(root, links, &mut report)?;
    Ok(report)
}

/// Removes every link in `links` that resolves out of the tree (all are judged against
/// the complete tree first, then removed).
fn drop_outward_links(
    root: BorrowedFd<'_>,
    links: Vec<PathBuf>,
    report: &mut SeedReport,
) -> Result<(), SeedError> {
    let mut outward = Vec::new();
    for l in links {
        // A later entry may have replaced the link; only links still there count.
        let Some(parts) = plain_components(&l) else {
            continue;
        };
        let Some((name, dirs)) = parts.split_last() else {
            continue;
        };
        let Ok(dir) = beneath::open_dir(root, &dirs.iter().collect::<PathBuf>()) else {
            continue;
        };
        if !matches!(beneath::kind(dir.as_fd(), name), Ok((FileType::Symlink, _))) {
            continue;
        }
        if !beneath::link_stays_inside(root, &l)? {
            outward.push((dir, name.to_os_string(), l));
        }
    }
    for (dir, name, l) in outward {
        beneath::remove_non_dir(dir.as_fd(), &name)?;
        report.skipped.push(l.display().to_string());
    }
    report.skipped.sort();
    report.skipped.dedup();
    Ok(())
}

/// Copies the host directory `src` into the staging tree, leaving out secrets,
/// `exclude_dirs`, specials and links that lead out of the tree.
pub fn copy_tree(
    src: &Path,
    stage: &Staging,
    exclude_dirs: &[String],
    limits: SeedLimits,
) -> Result<SeedReport, SeedError> {
    let root = stage.fd();
    let owner = stage.owner();
    let src_root = beneath::open_root(src)?;
    let mut report = SeedReport::default();
    let mut links = Vec::new();
    let mut count = 0u64;
    // (source dir fd, destination dir fd, relative path)
    let mut stack = vec![(
        src_root,
        beneath::open_dir(root, Path::new("."))?,
        PathBuf::new(),
    )];
    while let Some((sdir, ddir, rel)) = stack.pop() {
        for name in beneath::list(sdir.as_fd(), limits.max_entries as usize)? {
            count += 1;
            if count > limits.max_entries {
                return Err(refuse(format!("more than {} entries", limits.max_entries)));
            }
            let rel_path = rel.join(&name);
            let shown = rel_path.display().to_string();
            let Ok((ft, st)) = beneath::kind(sdir.as_fd(), &name) else {
                report.skipped.push(shown);
                continue;
            };
            let n = name.to_string_lossy();
            if super::is_secret(&n)
                || (ft == FileType::Directory && exclude_dirs.contains(&n.to_string()))
            {
                report.skipped.push(shown);
                continue;
            }
            match ft {
                FileType::Directory => {
                    if rel_path.components().count() > limits.max_depth {
                        return Err(refuse(format!("{shown} is nested too deep")));
                    }
                    let s = beneath::open_dir(sdir.as_fd(), Path::new(&name))?;
                    let d = beneath::make_dir(ddir.as_fd(), &name, st.st_mode, owner)?;
                    stack.push((s, d, rel_path));
                }
                FileType::RegularFile => {
                    let (mut f, size) = beneath::open_regular(sdir.as_fd(), &name)?;
                    if report.bytes.saturating_add(size) > limits.max_bytes {
                        return Err(refuse(format!("content over {} bytes", limits.max_bytes)));
                    }
                    let mut bounded = std::io::Read::take(&mut f, size);
                    let n =
                        beneath::write_file(ddir.as_fd(), &name, st.st_mode, owner, &mut bounded)?;
                    report.files += 1;
                    report.bytes += n;
                }
                FileType::Symlink => {
                    let target = beneath::read_link(sdir.as_fd(), &name)?;
                    if target.is_absolute() || target.as_os_str().is_empty() {
                        report.skipped.push(shown);
                        continue;
                    }
                    beneath::write_link(ddir.as_fd(), &name, &target, owner)?;
                    links.push(rel_path);
                }
                _ => report.skipped.push(shown),
            }
        }
    }
    drop_outward_links(root, links, &mut report)?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_and_byte_bounds_are_enforced() {
        use cynode_testkit::tar::tar_of;
        use tar::EntryType::Regular;
        let state = tempfile::tempdir().unwrap();
        let refused = |tar: &[u8], limits: SeedLimits| {
            let stage = Staging::new(state.path(), 4_000_000).unwrap();
            unpack_tar(tar, &stage, limits).unwrap_err().to_string()
        };
        let names: Vec<String> = (0..20).map(|i| format!("f{i}")).collect();
        let twenty: Vec<_> = names
            .iter()
            .map(|n| (n.as_str(), Regular, "", &b"0123456789"[..]))
            .collect();
        let tar = tar_of(&twenty);
        let small = SeedLimits {
            max_entries: 10,
            ..SeedLimits::default()
        };
        assert_eq!(refused(&tar, small), "more than 10 entries");
        let tight = SeedLimits {
            max_bytes: 55,
            ..SeedLimits::default()
        };
        assert_eq!(refused(&tar, tight), "content over 55 bytes");
        let shallow = SeedLimits {
            max_depth: 2,
            ..SeedLimits::default()
        };
        let e = refused(&tar_of(&[("a/b/c/d", Regular, "", b"x")]), shallow);
        assert!(e.contains("nested deeper"), "{e}");
    }

    #[test]
    fn staging_is_removed_unless_published() {
        let state = tempfile::tempdir().unwrap();
        let stage = Staging::new(state.path(), 4_000_000).unwrap();
        let p = stage.path().to_path_buf();
        drop(stage);
        assert!(!p.exists());
        let stage = Staging::new(state.path(), 4_000_000).unwrap();
        let target = state.path().join("ws");
        std::fs::create_dir(&target).unwrap();
        stage.publish(&target).unwrap();
        assert!(target.is_dir());
        assert_eq!(
            std::fs::read_dir(state.path().join("staging"))
                .unwrap()
                .count(),
            0
        );
        // A workspace with content is never replaced.
        std::fs::write(target.join("x"), "keep").unwrap();
        let stage = Staging::new(state.path(), 4_000_000).unwrap();
        assert!(matches!(stage.publish(&target), Err(SeedError::HasContent)));
        assert_eq!(std::fs::read_to_string(target.join("x")).unwrap(), "keep");
    }
}
