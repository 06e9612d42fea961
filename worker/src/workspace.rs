//! Per-task workspaces: created on first use, persisted across a task's jobs, optionally
//! seeded from a host directory (under the configured `seed_roots`) or an uploaded tar,
//! and exportable as a tar or as a `git diff`-style changeset.
//!
//! Seeding from a host directory never follows a symlink out of the source (symlinks are
//! kept only when they stay inside it), and leaves out secret-bearing paths (`.env*`,
//! `.ssh/`, `.aws/`, `.netrc`, `*.pem`, `id_rsa*`, credential files…) and the configured
//! dependency caches; `.git` is kept so local git and changesets work. A seeded workspace
//! without `.git` gets a pristine baseline copy, which its changeset is computed against.

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cynode_protocol::worker_api::{check_id, API_VERSION};
use cynode_protocol::ValidationError;
use serde::{Deserialize, Serialize};

use crate::api::{ApiError, StrictJson};
use crate::executor::SANDBOX_UID;
use crate::node::Node;

/// `POST /v1/worker/workspaces`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CreateWorkspace {
    pub version: u32,
    pub workspace_id: String,
    /// Host directory to copy in on creation; must lie under a configured seed root.
    #[serde(default)]
    pub seed_from: Option<PathBuf>,
}

/// What a create or seed did.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct WorkspaceInfo {
    pub version: u32,
    pub workspace_id: String,
    pub created: bool,
    pub files: u64,
    pub bytes: u64,
    /// Paths left out (secrets, caches, symlinks leading out), relative to the source.
    pub skipped: Vec<String>,
}

/// The routes of this module, mounted behind the node's auth.
pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route("/v1/worker/workspaces", post(create))
        .route(
            "/v1/worker/workspaces/{id}/tar",
            get(export_tar).put(seed_tar),
        )
        .route("/v1/worker/workspaces/{id}/changeset", get(changeset))
}

fn workspace_dir(node: &Node, id: &str) -> Result<PathBuf, ApiError> {
    check_id("workspace_id", id).map_err(ApiError::Invalid)?;
    Ok(node.cfg.workspaces_dir().join(id))
}

fn is_empty_dir(p: &Path) -> bool {
    std::fs::read_dir(p)
        .map(|mut d| d.next().is_none())
        .unwrap_or(true)
}

async fn create(
    State(node): State<Arc<Node>>,
    StrictJson(req): StrictJson<CreateWorkspace>,
) -> Result<Response, ApiError> {
    if req.version != API_VERSION {
        return Err(ApiError::Invalid(ValidationError::new(
            "version",
            "expected 1",
        )));
    }
    let dir = workspace_dir(&node, &req.workspace_id)?;
    let mut info = WorkspaceInfo {
        version: API_VERSION,
        workspace_id: req.workspace_id.clone(),
        ..Default::default()
    };
    if dir.exists() && !is_empty_dir(&dir) {
        return Ok((StatusCode::OK, Json(info)).into_response());
    }
    let source = match &req.seed_from {
        Some(src) => Some(allowed_source(&node.cfg.seed_roots, src)?),
        None => None,
    };
    let excludes = node.cfg.seed_exclude_dirs.clone();
    let baseline = node.cfg.baselines_dir().join(&req.workspace_id);
    let report = tokio::task::spawn_blocking(move || -> std::io::Result<SeedReport> {
        make_sandbox_dir(&dir)?;
        let Some(src) = source else {
            return Ok(SeedReport::default());
        };
        let report = copy_tree(&src, &dir, &excludes)?;
        if !dir.join(".git").exists() {
            let _ = std::fs::remove_dir_all(&baseline);
            copy_tree(&dir, &baseline, &[])?;
        }
        Ok(report)
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?
    .map_err(|e| ApiError::Internal(format!("seeding failed: {e}")))?;
    info.created = true;
    info.files = report.files;
    info.bytes = report.bytes;
    info.skipped = report.skipped;
    tracing::info!(workspace_id = %req.workspace_id, files = info.files, skipped = info.skipped.len(), "workspace created");
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

/// The canonical source when it lies under a seed root.
fn allowed_source(roots: &[PathBuf], src: &Path) -> Result<PathBuf, ApiError> {
    let refuse = |why: &str| ApiError::Invalid(ValidationError::new("seed_from", why.to_string()));
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

fn make_sandbox_dir(p: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(p)?;
    std::os::unix::fs::chown(p, Some(SANDBOX_UID), Some(SANDBOX_UID))
}

/// What a copy did.
#[derive(Debug, Default)]
pub struct SeedReport {
    pub files: u64,
    pub bytes: u64,
    pub skipped: Vec<String>,
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

/// Copies `src` into `dst` without following symlinks out of `src`, leaving out secrets
/// and `exclude_dirs`; everything created is owned by the sandbox user.
pub fn copy_tree(src: &Path, dst: &Path, exclude_dirs: &[String]) -> std::io::Result<SeedReport> {
    let mut report = SeedReport::default();
    make_sandbox_dir(dst)?;
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let mut entries: Vec<_> = std::fs::read_dir(src.join(&rel))?.flatten().collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let name = e.file_name().to_string_lossy().into_owned();
            let rel_path = rel.join(&name);
            let shown = rel_path.display().to_string();
            let meta = std::fs::symlink_metadata(e.path())?;
            let ft = meta.file_type();
            if is_secret(&name) || (ft.is_dir() && exclude_dirs.contains(&name)) {
                report.skipped.push(shown);
                continue;
            }
            let target = dst.join(&rel_path);
            if ft.is_dir() {
                make_sandbox_dir(&target)?;
                stack.push(rel_path);
            } else if ft.is_file() {
                std::fs::copy(e.path(), &target)?;
                std::os::unix::fs::chown(&target, Some(SANDBOX_UID), Some(SANDBOX_UID))?;
                report.files += 1;
                report.bytes += meta.len();
            } else if ft.is_symlink() {
                let link = std::fs::read_link(e.path())?;
                if symlink_stays_inside(&rel, &link) {
                    std::os::unix::fs::symlink(&link, &target)?;
                    std::os::unix::fs::lchown(&target, Some(SANDBOX_UID), Some(SANDBOX_UID))?;
                } else {
                    report.skipped.push(shown);
                }
            } else {
                report.skipped.push(shown);
            }
        }
    }
    report.skipped.sort();
    Ok(report)
}

/// A link at `dir/<name>` to `target` stays inside the tree when it is relative and its
/// `..`s never climb above the root.
fn symlink_stays_inside(dir: &Path, target: &Path) -> bool {
    if target.is_absolute() {
        return false;
    }
    let mut depth = dir.components().count() as i64;
    for c in target.components() {
        match c {
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => return false,
        }
        if depth < 0 {
            return false;
        }
    }
    true
}

async fn seed_tar(
    State(node): State<Arc<Node>>,
    UrlPath(id): UrlPath<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let dir = workspace_dir(&node, &id)?;
    if dir.exists() && !is_empty_dir(&dir) {
        return Err(ApiError::Conflict(format!(
            "workspace {id} already has content"
        )));
    }
    let dir2 = dir.clone();
    let report = tokio::task::spawn_blocking(move || unpack_tar(&body, &dir2))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(ApiError::Invalid(ValidationError::new(
                "body",
                format!("invalid tar: {e}"),
            )));
        }
    };
    let info = WorkspaceInfo {
        version: API_VERSION,
        workspace_id: id,
        created: true,
        files: report.files,
        bytes: report.bytes,
        skipped: report.skipped,
    };
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

/// Unpacks a tar into `dst`: no absolute paths, no `..`, links only inside; devices and
/// other specials are skipped.
pub fn unpack_tar(bytes: &[u8], dst: &Path) -> std::io::Result<SeedReport> {
    make_sandbox_dir(dst)?;
    let mut report = SeedReport::default();
    let mut archive = tar::Archive::new(bytes);
    archive.set_preserve_ownerships(false);
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.into_owned();
        let shown = path.display().to_string();
        let safe = path
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
        if !safe {
            return Err(std::io::Error::other(format!(
                "entry {shown} escapes the workspace"
            )));
        }
        let kind = entry.header().entry_type();
        let keep = match kind {
            tar::EntryType::Regular | tar::EntryType::Directory => true,
            tar::EntryType::Symlink => entry
                .link_name()?
                .map(|l| symlink_stays_inside(path.parent().unwrap_or(Path::new("")), &l))
                .unwrap_or(false),
            _ => false,
        };
        if !keep {
            report.skipped.push(shown);
            continue;
        }
        if !entry.unpack_in(dst)? {
            return Err(std::io::Error::other(format!(
                "entry {shown} escapes the workspace"
            )));
        }
        if kind == tar::EntryType::Regular {
            report.files += 1;
            report.bytes += entry.header().size()?;
        }
    }
    chown_tree(dst)?;
    Ok(report)
}

fn chown_tree(root: &Path) -> std::io::Result<()> {
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        std::os::unix::fs::lchown(&d, Some(SANDBOX_UID), Some(SANDBOX_UID))?;
        for e in std::fs::read_dir(&d)?.flatten() {
            let ft = e.file_type()?;
            if ft.is_dir() {
                stack.push(e.path());
            } else {
                std::os::unix::fs::lchown(e.path(), Some(SANDBOX_UID), Some(SANDBOX_UID))?;
            }
        }
    }
    Ok(())
}

async fn export_tar(
    State(node): State<Arc<Node>>,
    UrlPath(id): UrlPath<String>,
) -> Result<Response, ApiError> {
    let dir = workspace_dir(&node, &id)?;
    if !dir.is_dir() {
        return Err(ApiError::NotFound(format!("workspace {id} not found")));
    }
    let (reader, writer) = tokio::io::duplex(256 * 1024);
    tokio::task::spawn_blocking(move || {
        let bridge = tokio_util::io::SyncIoBridge::new(writer);
        let mut builder = tar::Builder::new(bridge);
        builder.follow_symlinks(false);
        let res = builder
            .append_dir_all(".", &dir)
            .and_then(|()| builder.finish());
        if let Err(e) = res {
            tracing::warn!(error = %e, "workspace tar export failed midway");
        }
    });
    let mut resp = Body::from_stream(tokio_util::io::ReaderStream::new(reader)).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-tar"),
    );
    Ok(resp)
}

async fn changeset(
    State(node): State<Arc<Node>>,
    UrlPath(id): UrlPath<String>,
) -> Result<Response, ApiError> {
    let dir = workspace_dir(&node, &id)?;
    if !dir.is_dir() {
        return Err(ApiError::NotFound(format!("workspace {id} not found")));
    }
    let baseline = node.cfg.baselines_dir().join(&id);
    let text = if dir.join(".git").exists() {
        git_changeset(&dir).await
    } else {
        if !baseline.exists() {
            make_sandbox_dir(&baseline).map_err(|e| ApiError::Internal(e.to_string()))?;
        }
        no_index_changeset(&baseline, &dir).await
    }
    .map_err(ApiError::Internal)?;
    let mut resp = text.into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/x-diff; charset=utf-8"),
    );
    Ok(resp)
}

async fn git(dir: &Path, args: &[&str]) -> Result<(i32, String), String> {
    let out = tokio::process::Command::new("git")
        .arg("-c")
        .arg(format!("safe.directory={}", dir.display()))
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("HOME", "/nonexistent")
        .output()
        .await
        .map_err(|e| format!("cannot run git: {e}"))?;
    let code = out.status.code().unwrap_or(-1);
    if code > 1 {
        return Err(format!(
            "git {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok((code, String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// Tracked changes against HEAD plus every untracked (not ignored) file as an addition.
async fn git_changeset(dir: &Path) -> Result<String, String> {
    let (_, mut text) = git(dir, &["diff", "--binary", "HEAD"]).await?;
    let (_, untracked) = git(dir, &["ls-files", "--others", "--exclude-standard", "-z"]).await?;
    for file in untracked.split('\0').filter(|f| !f.is_empty()) {
        let (_, d) = git(dir, &["diff", "--no-index", "--binary", "/dev/null", file]).await?;
        text.push_str(&d);
    }
    Ok(text)
}

/// `git diff --no-index` between the baseline and the workspace, with the two directory
/// prefixes rewritten to `a/` and `b/` so the result applies with `git apply` or `patch -p1`.
async fn no_index_changeset(baseline: &Path, dir: &Path) -> Result<String, String> {
    let parent = dir.parent().unwrap_or(Path::new("/"));
    let (_, text) = git(
        parent,
        &[
            "diff",
            "--no-index",
            "--binary",
            "--src-prefix=a/",
            "--dst-prefix=b/",
            &baseline.display().to_string(),
            &dir.display().to_string(),
        ],
    )
    .await?;
    let strip = |p: &Path| p.display().to_string().trim_start_matches('/').to_string() + "/";
    Ok(text
        .replace(&format!("a/{}", strip(baseline)), "a/")
        .replace(&format!("b/{}", strip(dir)), "b/")
        .replace(&format!("a/{}", strip(dir)), "a/")
        .replace(&format!("b/{}", strip(baseline)), "b/"))
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn symlinks_inside_only() {
        assert!(symlink_stays_inside(Path::new("a/b"), Path::new("../c")));
        assert!(symlink_stays_inside(Path::new(""), Path::new("x/y")));
        assert!(!symlink_stays_inside(
            Path::new("a"),
            Path::new("../../etc")
        ));
        assert!(!symlink_stays_inside(
            Path::new("a"),
            Path::new("/etc/passwd")
        ));
    }

    #[test]
    fn seeding_skips_secrets_caches_and_outward_links() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        let s = src.path();
        std::fs::create_dir_all(s.join("src")).unwrap();
        std::fs::create_dir_all(s.join("node_modules/x")).unwrap();
        std::fs::create_dir_all(s.join(".ssh")).unwrap();
        std::fs::create_dir_all(s.join(".git")).unwrap();
        std::fs::write(s.join("src/main.rs"), "fn main() {}").unwrap();
        std::fs::write(s.join(".env"), "TOKEN=x").unwrap();
        std::fs::write(s.join("key.pem"), "k").unwrap();
        std::fs::write(s.join(".git/HEAD"), "ref").unwrap();
        std::fs::write(s.join(".ssh/id_rsa"), "k").unwrap();
        std::os::unix::fs::symlink("src/main.rs", s.join("inside")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", s.join("outside")).unwrap();
        let out = dst.path().join("ws");
        let r = copy_tree(s, &out, &["node_modules".to_string()]).unwrap();
        assert_eq!(
            r.skipped,
            [".env", ".ssh", "key.pem", "node_modules", "outside"]
        );
        assert_eq!(r.files, 2);
        assert!(out.join(".git/HEAD").is_file());
        assert_eq!(
            std::fs::read_link(out.join("inside")).unwrap(),
            Path::new("src/main.rs")
        );
        assert!(!out.join("outside").exists());
    }
}
