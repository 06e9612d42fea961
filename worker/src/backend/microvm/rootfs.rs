//! The guest's root filesystem: a read-only squashfs the node makes, once per image
//! directory and init binary, from the same root filesystem directory the bwrap backend
//! uses (`deploy/sba/export-rootfs.sh`). The node adds the guest init
//! ([`cynode_vminit::INIT_PATH`]) and the mount points ([`cynode_vminit::MOUNT_POINTS`]);
//! nothing of a job ever enters it. Uncompressed: it is read from the host's page cache,
//! so the guest spends no time inflating.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use tokio::process::Command;

/// The version of [`make`]'s recipe, part of every image's cache key.
const RECIPE: &str = "2: /dev/null and /dev/console in the root";

/// Device nodes the root holds beneath its `/dev` mount point (name, then mksquashfs's
/// pseudo definition). The kernel gives the init its standard streams on `/dev/console`;
/// when it could open no console (a virtio console probed late), the init's runtime opens
/// `/dev/null` for them before `main`, and aborts where there is none: the root's own
/// nodes serve until the init mounts devtmpfs over `/dev`.
const DEV_NODES: [(&str, &str); 2] = [
    ("dev/null", "/dev/null c 666 0 0 1 3"),
    ("dev/console", "/dev/console c 600 0 0 5 1"),
];

/// Why no root filesystem image could be made.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Make(String),
}

/// The squashfs for `dir` with `init`, made under `cache` if it is not there yet.
/// Concurrent callers for the same image serialise on a lock file.
pub async fn squashfs_for(
    mksquashfs: &str,
    dir: &Path,
    init: &Path,
    cache: &Path,
) -> Result<PathBuf, RootfsError> {
    let read = |path: &Path| {
        let p = path.to_path_buf();
        move |source| RootfsError::Read { path: p, source }
    };
    let init_bytes = tokio::fs::read(init).await.map_err(read(init))?;
    let dir = tokio::fs::canonicalize(dir).await.map_err(read(dir))?;
    let meta = tokio::fs::metadata(&dir).await.map_err(read(&dir))?;
    // The directory's identity and age (export-rootfs.sh replaces it whole), and the init.
    let mut h = Sha256::new();
    h.update(dir.as_os_str().as_encoded_bytes());
    use std::os::unix::fs::MetadataExt;
    h.update(meta.ino().to_le_bytes());
    h.update(meta.mtime().to_le_bytes());
    h.update(Sha256::digest(&init_bytes));
    // The recipe's own version: an image made by an older one is made again.
    h.update(RECIPE.as_bytes());
    let key = hex::encode(h.finalize())[..16].to_string();
    let out = cache.join(format!("{key}.sqfs"));
    if out.is_file() {
        return Ok(out);
    }
    tokio::fs::create_dir_all(cache)
        .await
        .map_err(read(cache))?;
    let cache_dir = cache.to_path_buf();
    let (mk, src, dst, init) = (
        mksquashfs.to_string(),
        dir.clone(),
        out.clone(),
        init.to_path_buf(),
    );
    tokio::task::spawn_blocking(move || {
        // One maker at a time per cache.
        let lock = std::fs::File::create(cache_dir.join(".lock"))
            .map_err(|e| RootfsError::Make(format!("lock: {e}")))?;
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| RootfsError::Make(format!("lock: {e}")))?;
        if dst.is_file() {
            return Ok(());
        }
        make(&mk, &src, &dst, &init)
    })
    .await
    .map_err(|e| RootfsError::Make(e.to_string()))??;
    Ok(out)
}

/// Runs mksquashfs into a temporary name, then renames it to `dst` (mode 0644: QEMU reads
/// it as the sandbox user).
fn make(mksquashfs: &str, src: &Path, dst: &Path, init: &Path) -> Result<(), RootfsError> {
    let tmp = dst.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let init_name = cynode_vminit::INIT_PATH.trim_start_matches('/');
    let mut cmd = std::process::Command::new(mksquashfs);
    cmd.arg(src).arg(&tmp).args([
        "-noappend",
        "-no-xattrs",
        "-quiet",
        "-no-progress",
        "-noI",
        "-noD",
        "-noF",
        "-noX",
        "-all-time",
        "0",
    ]);
    cmd.arg("-p").arg(format!(
        "{} f 755 0 0 cat {}",
        cynode_vminit::INIT_PATH,
        init.display()
    ));
    for dir in cynode_vminit::MOUNT_POINTS {
        cmd.arg("-p").arg(format!("{dir} d 755 0 0"));
    }
    for (_, node) in DEV_NODES {
        cmd.arg("-p").arg(node);
    }
    // -e takes every argument after it: last. An image's own files at the init's name and
    // the device nodes' are left out, so the node's are the ones there.
    cmd.arg("-e").arg(init_name);
    cmd.args(DEV_NODES.map(|(name, _)| name));
    let out = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| RootfsError::Make(format!("cannot run {mksquashfs}: {e}")))?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(RootfsError::Make(format!(
            "{mksquashfs} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))
        .and_then(|()| std::fs::rename(&tmp, dst))
        .map_err(|e| RootfsError::Make(format!("{}: {e}", dst.display())))
}

/// `mksquashfs -version`'s first line, for `check`.
pub async fn mksquashfs_version(mksquashfs: &str) -> Option<String> {
    let out = super::super::client_env(&mut Command::new(mksquashfs))
        .arg("-version")
        .output()
        .await
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .map(str::to_string)
}
