//! Per-task workspaces: created on first use, persisted across a task's jobs, optionally
//! seeded from a host directory (under the configured `seed_roots`) or an uploaded tar,
//! and exportable as a tar or as a `git diff`-style changeset.
//!
//! Seeding (see [`seed`]) builds the tree in a private staging directory with no-follow
//! operations, keeps a symlink only when it resolves inside the finished tree, and then
//! renames the tree into place; and leaves out secret-bearing paths (`.env*`,
//! `.ssh/`, `.aws/`, `.netrc`, `*.pem`, `id_rsa*`, credential files…) and the configured
//! dependency caches; `.git` is kept so local git and changesets work. A seeded workspace
//! without `.git` gets a pristine baseline copy, which its changeset is computed against.
//! Changesets run git inside a bubblewrap sandbox ([`mod@changeset`]); tar export walks the
//! tree with lstat semantics ([`export`]).
//!
//! The HTTP routes are in [`crate::http::workspaces`]; this module knows no HTTP.

mod beneath;
pub mod changeset;
pub mod export;
pub mod seed;

use std::path::{Path, PathBuf};

use cynode_protocol::worker_api::{check_id, API_VERSION};
use cynode_protocol::worker_workspaces::{CreateWorkspace, WorkspaceInfo};
use cynode_protocol::ValidationError;

use crate::backend::SandboxBackend;
use crate::config::Config;
use crate::uid_pool::{UidError, UidPool};
use changeset::ChangesetLimits;
use export::{ExportLimits, TarStream};
use seed::{SeedError, SeedLimits, SeedReport, Staging};

/// Why a workspace call was refused or failed; the HTTP layer maps each to a status.
#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    /// A bad id, version, seed source or tar (400).
    #[error("{0}")]
    Invalid(#[from] ValidationError),
    /// No such workspace (export and changeset need an existing one).
    #[error("workspace {workspace_id} not found")]
    NotFound { workspace_id: String },
    /// Seeding needs an empty workspace (409).
    #[error("{0}")]
    HasContent(String),
    /// git in its sandbox could not produce the changeset.
    #[error(transparent)]
    Changeset(#[from] changeset::ChangesetError),
    /// Seeding failed on the host.
    #[error("{0}")]
    Internal(String),
    /// No host uid for the workspace (every one of `sandbox_uids` is held: 503).
    #[error(transparent)]
    Uid(#[from] UidError),
}

fn workspace_dir(cfg: &Config, id: &str) -> Result<PathBuf, WorkspaceError> {
    check_id("workspace_id", id)?;
    Ok(cfg.workspaces_dir().join(id))
}

/// The directory of an existing workspace.
fn existing_dir(cfg: &Config, id: &str) -> Result<PathBuf, WorkspaceError> {
    let dir = workspace_dir(cfg, id)?;
    if !dir.is_dir() {
        return Err(WorkspaceError::NotFound {
            workspace_id: id.to_string(),
        });
    }
    Ok(dir)
}

fn is_empty_dir(p: &Path) -> bool {
    std::fs::read_dir(p)
        .map(|mut d| d.next().is_none())
        .unwrap_or(true)
}

/// Creates the workspace, seeded from `seed_from` when given. A workspace that already
/// has content is left as it is and answered with `created: false`.
pub async fn create(
    cfg: &Config,
    uids: &UidPool,
    req: CreateWorkspace,
) -> Result<WorkspaceInfo, WorkspaceError> {
    if req.version != API_VERSION {
        return Err(ValidationError::new("version", "expected 1").into());
    }
    let dir = workspace_dir(cfg, &req.workspace_id)?;
    let mut info = WorkspaceInfo {
        version: API_VERSION,
        workspace_id: req.workspace_id.clone(),
        ..Default::default()
    };
    if dir.exists() && !is_empty_dir(&dir) {
        return Ok(info);
    }
    let source = match &req.seed_from {
        Some(src) => Some(allowed_source(&cfg.seed_roots, src)?),
        None => None,
    };
    let uid = uids.for_workspace(&req.workspace_id).await?;
    let excludes = cfg.seed_exclude_dirs.clone();
    let baseline = cfg.baselines_dir().join(&req.workspace_id);
    let state = cfg.state_dir.clone();
    let baselines = cfg.baselines_dir();
    let report = tokio::task::spawn_blocking(move || -> Result<SeedReport, SeedError> {
        let Some(src) = source else {
            make_workspace(&dir, uid)?;
            return Ok(SeedReport::default());
        };
        let stage = staging_for(&state, uid, &dir)?;
        let report = seed::copy_tree(&src, &stage, &excludes, SeedLimits::default())
            .map_err(|e| fit(e, &stage))?;
        if std::fs::symlink_metadata(stage.path().join(".git")).is_err() {
            // The pristine copy is taken from the private tree, before any sandbox sees it.
            let base = Staging::new(&state, uid)?;
            seed::copy_tree(stage.path(), &base, &[], SeedLimits::default())?;
            std::fs::create_dir_all(&baselines)?;
            let _ = std::fs::remove_dir_all(&baseline);
            base.publish(&baseline)?;
        }
        stage.publish(&dir)?;
        Ok(report)
    })
    .await
    .map_err(|e| WorkspaceError::Internal(e.to_string()))?
    .map_err(seed_error)?;
    info.created = true;
    info.files = report.files;
    info.bytes = report.bytes;
    info.skipped = report.skipped;
    tracing::info!(workspace_id = %req.workspace_id, files = info.files, skipped = info.skipped.len(), "workspace created");
    Ok(info)
}

/// The canonical source when it lies under a seed root.
fn allowed_source(roots: &[PathBuf], src: &Path) -> Result<PathBuf, WorkspaceError> {
    let refuse =
        |why: &str| WorkspaceError::Invalid(ValidationError::new("seed_from", why.to_string()));
    let canon = std::fs::canonicalize(src).map_err(|_| refuse("no such directory"))?;
    if !canon.is_dir() {
        return Err(refuse("not a directory"));
    }
    let ok = roots
        .iter()
        .filter_map(|r| std::fs::canonicalize(r).ok())
        .any(|r| canon.starts_with(&r));
    if ok {
        Ok(canon)
    } else {
        Err(refuse("not under any of this node's seed_roots"))
    }
}

/// Creates the workspace directory `dir` (the node's path) owned by `uid`, mode 0755,
/// when it does not exist: a disk volume of its own, as a job makes it
/// ([`crate::loopfs`]: the kernel holds `limits.disk_mb`), else a plain directory (the
/// disk poller holds the limit while a sandbox runs).
pub fn make_workspace(dir: &Path, uid: u32) -> std::io::Result<()> {
    use std::os::fd::AsFd;
    let _creating = creation_lock(dir);
    if let Some(image) = crate::loopfs::unmounted_image(dir) {
        return Err(std::io::Error::other(format!(
            "the workspace's disk volume {} is not mounted on {} (see the node's log from its start); it is not used without it",
            image.display(),
            dir.display()
        )));
    }
    let (parent, name) = crate::job_dir::split(dir)?;
    let parent = crate::job_dir::open_node_dir(parent)?;
    let label = crate::loopfs::workspace_label(name);
    if crate::loopfs::new_volume_dir(parent.as_fd(), name, &label, uid)? {
        return Ok(());
    }
    crate::job_dir::open_or_create_owned_dir(parent.as_fd(), name, uid).map(drop)
}

/// Held while a workspace directory is made ([`make_workspace`], by jobs, sessions, forks and
/// empty creations) and while a seed is published onto it ([`Staging::publish`]). Each of
/// these is several steps (a directory, then a volume mounted on it, or a swap), and a
/// job that found the directory between a seed's steps would run beneath the seed's
/// volume, its writes hidden once the volume is moved on top. With the lock, each sees the
/// other's work whole or not at all. Striped by path: different workspaces rarely wait on
/// each other, and nothing is held across an await.
pub(crate) fn creation_lock(dir: &Path) -> std::sync::MutexGuard<'static, ()> {
    use std::hash::{Hash, Hasher};
    use std::sync::Mutex;
    const STRIPES: usize = 64;
    static LOCKS: [Mutex<()>; STRIPES] = [const { Mutex::new(()) }; STRIPES];
    let mut h = std::collections::hash_map::DefaultHasher::new();
    dir.hash(&mut h);
    LOCKS[(h.finish() % STRIPES as u64) as usize]
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// An empty baseline directory owned by `uid` (the node's, never a volume).
fn make_sandbox_dir(p: &Path, uid: u32) -> std::io::Result<()> {
    std::fs::create_dir_all(p)?;
    std::os::unix::fs::lchown(p, Some(uid), Some(uid))
}

/// The staging for seeding `dir`: on a volume of its own when `dir` does not exist yet
/// (an existing, empty workspace may be mounted by a running sandbox: it is swapped as a
/// plain directory, [`Staging::publish`]).
fn staging_for(state: &Path, uid: u32, dir: &Path) -> std::io::Result<Staging> {
    if std::fs::symlink_metadata(dir).is_err() {
        Staging::new_volume(state, uid)
    } else {
        Staging::new(state, uid)
    }
}

/// Whether a name carries secrets and is never copied from a host directory.
pub fn is_secret(name: &str) -> bool {
    const EXACT: [&str; 12] = [
        ".ssh",
        ".aws",
        ".netrc",
        ".git-credentials",
        ".npmrc",
        ".pypirc",
        ".docker",
        ".gnupg",
        "credentials",
        "credentials.json",
        ".kube",
        ".azure",
    ];
    EXACT.contains(&name)
        || name.starts_with(".env")
        || name.starts_with("id_rsa")
        || name.starts_with("id_ed25519")
        || name.starts_with("id_ecdsa")
        || name.ends_with(".pem")
        || name.ends_with(".p12")
        || name.ends_with(".pfx")
}

/// A seed into `stage` that failed: a full volume of the stage's own is the seed's fault
/// (it does not fit the workspace's disk limit); any other full filesystem is the node's.
fn fit(e: SeedError, stage: &Staging) -> SeedError {
    match e {
        SeedError::Io(io) if stage.is_volume() && seed::is_full(&io) => SeedError::Refused(format!(
            "the seed does not fit the workspace's disk limit (limits.disk_mb, limits.disk_max_files): {io}"
        )),
        other => other,
    }
}

fn seed_error(e: SeedError) -> WorkspaceError {
    match e {
        SeedError::Refused(m) => ValidationError::new("body", m).into(),
        SeedError::HasContent => WorkspaceError::HasContent("workspace already has content".into()),
        SeedError::Volume => WorkspaceError::HasContent(SeedError::Volume.to_string()),
        SeedError::Io(e) => WorkspaceError::Internal(format!("seeding failed: {e}")),
    }
}

/// Seeds the empty workspace `id` from the tar `body` (no links leading out, no
/// special files, bounded).
pub async fn seed_tar(
    cfg: &Config,
    uids: &UidPool,
    id: String,
    body: impl AsRef<[u8]> + Send + 'static,
) -> Result<WorkspaceInfo, WorkspaceError> {
    let dir = workspace_dir(cfg, &id)?;
    if dir.exists() && !is_empty_dir(&dir) {
        return Err(WorkspaceError::HasContent(format!(
            "workspace {id} already has content"
        )));
    }
    let uid = uids.for_workspace(&id).await?;
    let state = cfg.state_dir.clone();
    let report = tokio::task::spawn_blocking(move || -> Result<SeedReport, SeedError> {
        let stage = staging_for(&state, uid, &dir)?;
        let report = seed::unpack_tar(body.as_ref(), &stage, SeedLimits::default()).map_err(
            |e| match fit(e, &stage) {
                SeedError::Io(e) => SeedError::Refused(format!("invalid tar: {e}")),
                other => other,
            },
        )?;
        stage.publish(&dir)?;
        Ok(report)
    })
    .await
    .map_err(|e| WorkspaceError::Internal(e.to_string()))?
    .map_err(|e| match e {
        SeedError::HasContent => {
            WorkspaceError::HasContent(format!("workspace {id} already has content"))
        }
        other => seed_error(other),
    })?;
    tracing::info!(workspace_id = %id, files = report.files, skipped = report.skipped.len(), "workspace seeded from tar");
    Ok(WorkspaceInfo {
        version: API_VERSION,
        workspace_id: id,
        created: true,
        files: report.files,
        bytes: report.bytes,
        skipped: report.skipped,
    })
}

/// The workspace `id` as a tar stream (see [`export`]); a failure midway ends the stream
/// with an error, never with a short, valid-looking tar.
pub fn export_tar(cfg: &Config, id: &str) -> Result<TarStream, WorkspaceError> {
    let dir = existing_dir(cfg, id)?;
    Ok(TarStream::start(dir, ExportLimits::default()))
}

/// The workspace's changeset (see [`mod@changeset`]), computed by git in an isolated run
/// of `backend`.
pub async fn changeset(
    cfg: &Config,
    uids: &UidPool,
    backend: &dyn SandboxBackend,
    id: &str,
) -> Result<String, WorkspaceError> {
    let dir = existing_dir(cfg, id)?;
    let uid = uids.for_workspace(id).await?;
    let baseline = cfg.baselines_dir().join(id);
    // Whether `.git` exists is the sandbox's choice; either way git runs sandboxed.
    let has_git = std::fs::symlink_metadata(dir.join(".git")).is_ok();
    if !has_git && !baseline.exists() {
        make_sandbox_dir(&baseline, uid).map_err(|e| WorkspaceError::Internal(e.to_string()))?;
    }
    changeset::changeset(
        backend,
        cfg,
        uid,
        &dir,
        &baseline,
        has_git,
        ChangesetLimits::default(),
    )
    .await
    .map_err(|e| {
        tracing::warn!(workspace_id = %id, error = %e, "changeset failed");
        e.into()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_is_not_published_while_its_creation_lock_is_held() {
        let state = tempfile::tempdir().unwrap();
        let target = state.path().join("ws-seeded");
        let stage = Staging::new(state.path(), 0).unwrap();
        std::fs::write(stage.path().join("seed.txt"), "seed\n").unwrap();
        let held = creation_lock(&target);
        let publisher = {
            let target = target.clone();
            std::thread::spawn(move || stage.publish(&target))
        };
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!target.exists(), "published while a job held the lock");
        assert!(!publisher.is_finished());
        drop(held);
        publisher.join().unwrap().unwrap();
        assert_eq!(
            std::fs::read_to_string(target.join("seed.txt")).unwrap(),
            "seed\n"
        );
    }

    #[test]
    fn a_workspace_is_not_made_while_its_creation_lock_is_held() {
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("ws-locked");
        let held = creation_lock(&dir);
        let maker = {
            let dir = dir.clone();
            std::thread::spawn(move || make_workspace(&dir, 0))
        };
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!dir.exists(), "made while a seed held the lock");
        assert!(!maker.is_finished());
        drop(held);
        maker.join().unwrap().unwrap();
        assert!(dir.is_dir());
    }

    #[test]
    fn secrets_are_recognised() {
        for s in [
            ".env",
            ".env.local",
            ".ssh",
            "id_rsa",
            "id_rsa.pub",
            "server.pem",
            ".netrc",
            "credentials.json",
        ] {
            assert!(is_secret(s), "{s}");
        }
        for s in ["src", "main.rs", ".git", "environment.md", "README"] {
            assert!(!is_secret(s), "{s}");
        }
    }

    #[test]
    fn seeding_skips_secrets_caches_and_outward_links() {
        let src = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let s = src.path();
        std::fs::create_dir_all(s.join("src")).unwrap();
        std::fs::create_dir_all(s.join("node_modules/x")).unwrap();
        std::fs::create_dir_all(s.join(".ssh")).unwrap();
        std::fs::create_dir_all(s.join(".git")).unwrap();
        std::fs::create_dir_all(s.join("x")).unwrap();
        std::fs::write(s.join("src/main.rs"), "fn main() {}").unwrap();
        std::fs::write(s.join(".env"), "TOKEN=x").unwrap();
        std::fs::write(s.join("key.pem"), "k").unwrap();
        std::fs::write(s.join(".git/HEAD"), "ref").unwrap();
        std::fs::write(s.join(".ssh/id_rsa"), "k").unwrap();
        std::os::unix::fs::symlink("src/main.rs", s.join("inside")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", s.join("outside")).unwrap();
        // Lexically inside, really outside: `d -> .` makes `../d/d/../..` climb out.
        std::os::unix::fs::symlink(".", s.join("d")).unwrap();
        std::os::unix::fs::symlink("../d/d/../..", s.join("x/l")).unwrap();
        let stage = Staging::new(state.path(), 4_000_000).unwrap();
        let r = seed::copy_tree(
            s,
            &stage,
            &["node_modules".to_string()],
            SeedLimits::default(),
        )
        .unwrap();
        let out = state.path().join("ws");
        stage.publish(&out).unwrap();
        assert_eq!(
            r.skipped,
            [".env", ".ssh", "key.pem", "node_modules", "outside", "x/l"]
        );
        assert_eq!(r.files, 2);
        assert!(out.join(".git/HEAD").is_file());
        assert_eq!(
            std::fs::read_link(out.join("inside")).unwrap(),
            Path::new("src/main.rs")
        );
        assert!(std::fs::symlink_metadata(out.join("outside")).is_err());
        assert!(std::fs::symlink_metadata(out.join("x/l")).is_err());
    }
}
