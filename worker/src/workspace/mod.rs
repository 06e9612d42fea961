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
//! Changesets run git inside a bubblewrap sandbox ([`changeset`]); tar export walks the
//! tree with lstat semantics ([`export`]).

mod beneath;
pub mod changeset;
pub mod export;
pub mod seed;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
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
use changeset::ChangesetLimits;
use export::ExportLimits;
use seed::{SeedError, SeedLimits, SeedReport, Staging};

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
    let state = node.cfg.state_dir.clone();
    let baselines = node.cfg.baselines_dir();
    let report = tokio::task::spawn_blocking(move || -> Result<SeedReport, SeedError> {
        let Some(src) = source else {
            make_sandbox_dir(&dir)?;
            return Ok(SeedReport::default());
        };
        let stage = Staging::new(&state)?;
        let report = seed::copy_tree(&src, &stage, &excludes, SeedLimits::default())?;
        if std::fs::symlink_metadata(stage.path().join(".git")).is_err() {
            // The pristine copy is taken from the private tree, before any sandbox sees it.
            let base = Staging::new(&state)?;
            seed::copy_tree(stage.path(), &base, &[], SeedLimits::default())?;
            std::fs::create_dir_all(&baselines)?;
            let _ = std::fs::remove_dir_all(&baseline);
            base.publish(&baseline)?;
        }
        stage.publish(&dir)?;
        Ok(report)
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?
    .map_err(seed_error)?;
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
    std::os::unix::fs::lchown(p, Some(SANDBOX_UID), Some(SANDBOX_UID))
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

fn seed_error(e: SeedError) -> ApiError {
    match e {
        SeedError::Refused(m) => ApiError::Invalid(ValidationError::new("body", m)),
        SeedError::HasContent => ApiError::Conflict("workspace already has content".into()),
        SeedError::Io(e) => ApiError::Internal(format!("seeding failed: {e}")),
    }
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
    let state = node.cfg.state_dir.clone();
    let report = tokio::task::spawn_blocking(move || -> Result<SeedReport, SeedError> {
        let stage = Staging::new(&state)?;
        let report =
            seed::unpack_tar(&body, &stage, SeedLimits::default()).map_err(|e| match e {
                SeedError::Io(e) => SeedError::Refused(format!("invalid tar: {e}")),
                other => other,
            })?;
        stage.publish(&dir)?;
        Ok(report)
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?
    .map_err(|e| match e {
        SeedError::HasContent => ApiError::Conflict(format!("workspace {id} already has content")),
        other => seed_error(other),
    })?;
    tracing::info!(workspace_id = %id, files = report.files, skipped = report.skipped.len(), "workspace seeded from tar");
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

/// An `AsyncRead` that turns a clean end into an error when the producer failed, so a
/// broken export ends the HTTP body with an error instead of a short, valid-looking tar.
struct FailAtEnd {
    inner: tokio::io::DuplexStream,
    failed: Arc<AtomicBool>,
}

impl tokio::io::AsyncRead for FailAtEnd {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if let std::task::Poll::Ready(Ok(())) = &r {
            if buf.filled().len() == before && self.failed.load(Ordering::SeqCst) {
                return std::task::Poll::Ready(Err(std::io::Error::other(
                    "workspace export failed",
                )));
            }
        }
        r
    }
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
    let failed = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&failed);
    tokio::task::spawn_blocking(move || {
        let bridge = tokio_util::io::SyncIoBridge::new(writer);
        if let Err(e) = export::export(&dir, bridge, ExportLimits::default()) {
            flag.store(true, Ordering::SeqCst);
            tracing::warn!(error = %e, "workspace tar export failed midway");
        }
    });
    let reader = FailAtEnd {
        inner: reader,
        failed,
    };
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
    // Whether `.git` exists is the sandbox's choice; either way git runs sandboxed.
    let has_git = std::fs::symlink_metadata(dir.join(".git")).is_ok();
    if !has_git && !baseline.exists() {
        make_sandbox_dir(&baseline).map_err(|e| ApiError::Internal(e.to_string()))?;
    }
    let bwrap = node
        .cfg
        .bwrap
        .binary
        .clone()
        .unwrap_or_else(|| "bwrap".into());
    let text = changeset::changeset(&bwrap, &dir, &baseline, has_git, ChangesetLimits::default())
        .await
        .map_err(|e| {
            tracing::warn!(workspace_id = %id, error = %e, "changeset failed");
            ApiError::Internal(e.to_string())
        })?;
    let mut resp = text.into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/x-diff; charset=utf-8"),
    );
    Ok(resp)
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
        let stage = Staging::new(state.path()).unwrap();
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
