//! An image's labels, as the node reads them when it accepts a job or a session, and the
//! one use made of them: `io.cynodeai.sandbox.agent-compatible` ([`AGENT_COMPATIBLE`]).
//!
//! The label is the image author's claim that the image can host an agent (the SBA's
//! runner, the tools the agent calls). The node reads it from the image's metadata, never
//! from a file inside the image's root filesystem:
//! - Podman and Docker (and gVisor, which runs under them): `image inspect` of the engine
//!   ([`inspect_labels`]); nothing is ever pulled.
//! - bubblewrap and the microVM, whose images are root filesystem directories
//!   (`bwrap.rootfs`, `microvm.rootfs`): the file `<rootfs>.labels.json` beside the
//!   directory, a JSON object of string labels that `deploy/sba/export-rootfs.sh` writes
//!   from the engine's metadata when it exports the image ([`label_file`]). Beside, not
//!   inside: the rootfs is the image's content, its metadata is the operator's. The file
//!   is read without following links, regular files only, bounded in size and time; a
//!   missing file is an image without labels.
//!
//! [`check_agent_image`] refuses an agent job or session on an image without the label
//! (value exactly `true`) with [`NOT_AGENT_COMPATIBLE`], unless the node's config says
//! `allow_unlabelled_agent_images: true`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use cynode_protocol::ValidationError;

use crate::config::{BackendKind, Config};

/// The label an agent-compatible image carries, with the value `true`.
pub const AGENT_COMPATIBLE: &str = "io.cynodeai.sandbox.agent-compatible";
/// The name a refusal's message starts with.
pub const NOT_AGENT_COMPATIBLE: &str = "image_not_agent_compatible";
/// What the label file's name adds to the root filesystem directory's.
pub const LABEL_FILE_SUFFIX: &str = ".labels.json";
/// Bound on the label file and on the engine's answer.
pub const MAX_LABEL_BYTES: u64 = 256 * 1024;
/// Bound on reading the label file, and on the engine's `image inspect`.
const READ_TIME: Duration = Duration::from_secs(5);
const INSPECT_TIME: Duration = Duration::from_secs(30);

/// An image's labels.
pub type Labels = BTreeMap<String, String>;

/// Why an image's labels could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LabelError {
    /// bwrap or the microVM has no root filesystem for the image.
    #[error("no root filesystem is configured for image `{0}` (bwrap.rootfs)")]
    NoRootfs(String),
    /// The label file beside the root filesystem is unreadable or not a JSON object of
    /// strings.
    #[error("label file {path}: {why}")]
    File { path: String, why: String },
    /// The engine's `image inspect` failed or answered something else than labels.
    #[error("{engine} image inspect {image}: {why}")]
    Inspect {
        engine: String,
        image: String,
        why: String,
    },
}

/// Whether `labels` say the image is agent-compatible (the value exactly `true`).
pub fn agent_compatible(labels: &Labels) -> bool {
    labels.get(AGENT_COMPATIBLE).map(String::as_str) == Some("true")
}

/// The label file of the root filesystem directory `rootfs`: `<rootfs>.labels.json`
/// beside it; `None` for a path without a final name (`/`).
pub fn label_file(rootfs: &Path) -> Option<PathBuf> {
    let name = rootfs.file_name()?;
    let mut file = name.to_os_string();
    file.push(LABEL_FILE_SUFFIX);
    Some(rootfs.with_file_name(file))
}

/// The labels of the root filesystem directory `rootfs`, from its label file; no file is
/// no labels.
pub fn read_label_file(rootfs: &Path) -> Result<Labels, LabelError> {
    let Some(path) = label_file(rootfs) else {
        return Ok(Labels::new());
    };
    let file_err = |why: String| LabelError::File {
        path: path.display().to_string(),
        why,
    };
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return Err(file_err("not a file name the node reads".into()));
    };
    let bytes = match crate::sandbox_files::read_file_beneath(dir, name, MAX_LABEL_BYTES, READ_TIME)
    {
        Ok(b) => b,
        Err(crate::sandbox_files::ReadError::Missing { .. }) => return Ok(Labels::new()),
        Err(e) => return Err(file_err(e.to_string())),
    };
    parse_labels(&bytes).map_err(file_err)
}

/// A JSON object of string labels; `null` (an engine's answer for an image without
/// labels) is none.
fn parse_labels(bytes: &[u8]) -> Result<Labels, String> {
    let v: Option<Labels> = serde_json::from_slice(bytes)
        .map_err(|e| format!("not a JSON object of string labels: {e}"))?;
    Ok(v.unwrap_or_default())
}

/// The labels of `image` from `cfg`'s engine (`image inspect`, nothing pulled).
pub async fn inspect_labels(cfg: &Config, image: &str) -> Result<Labels, LabelError> {
    let engine = match cfg.backend {
        BackendKind::Docker => &cfg.docker,
        _ => &cfg.podman,
    };
    let err = |why: String| LabelError::Inspect {
        engine: engine.binary.clone(),
        image: image.to_string(),
        why,
    };
    crate::image_ref::check(image).map_err(|e| err(e.to_string()))?;
    let mut cmd = tokio::process::Command::new(&engine.binary);
    super::client_env(&mut cmd)
        .args([
            "image",
            "inspect",
            "--format",
            "{{json .Config.Labels}}",
            "--",
            image,
        ])
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let workdir = super::engine::client_workdir(&cfg.state_dir);
    if std::fs::create_dir_all(&workdir).is_ok() {
        cmd.current_dir(&workdir);
    }
    let out = tokio::time::timeout(INSPECT_TIME, cmd.output())
        .await
        .map_err(|_| err(format!("no answer within {}s", INSPECT_TIME.as_secs())))?
        .map_err(|e| err(e.to_string()))?;
    if !out.status.success() {
        return Err(err(super::engine::last_line(&out.stderr)));
    }
    if out.stdout.len() as u64 > MAX_LABEL_BYTES {
        return Err(err(format!(
            "labels over {MAX_LABEL_BYTES} bytes ({} bytes)",
            out.stdout.len()
        )));
    }
    parse_labels(&out.stdout).map_err(err)
}

/// The labels of `image` on `cfg`'s backend: the engine's metadata, or the label file
/// beside the image's root filesystem directory.
pub async fn labels_of(cfg: &Config, image: &str) -> Result<Labels, LabelError> {
    match cfg.backend {
        BackendKind::Podman | BackendKind::Docker => inspect_labels(cfg, image).await,
        BackendKind::Bwrap | BackendKind::Microvm => {
            let rootfs = match cfg.backend {
                BackendKind::Microvm => cfg.microvm.rootfs.get(image),
                _ => None,
            }
            .or_else(|| cfg.bwrap.rootfs.get(image))
            .ok_or_else(|| LabelError::NoRootfs(image.to_string()))?
            .clone();
            tokio::task::spawn_blocking(move || read_label_file(&rootfs))
                .await
                .map_err(|e| LabelError::File {
                    path: image.to_string(),
                    why: e.to_string(),
                })?
        }
        #[cfg(test)]
        BackendKind::Fake => Ok(Labels::default()),
    }
}

/// One line about `image`'s agent label for `cynode-worker check`.
pub async fn describe(cfg: &Config, image: &str) -> String {
    match labels_of(cfg, image).await {
        Ok(l) if agent_compatible(&l) => format!("agent-compatible ({AGENT_COMPATIBLE}=true)"),
        Ok(l) => match l.get(AGENT_COMPATIBLE) {
            Some(v) => format!("not agent-compatible ({AGENT_COMPATIBLE}={v:?})"),
            None => format!("not agent-compatible (no {AGENT_COMPATIBLE} label)"),
        },
        Err(e) => format!("agent label unknown: {e}"),
    }
}

/// Refuses an agent job or session (`field` names the request's image field) on an
/// image without [`AGENT_COMPATIBLE`]`=true`, unless `cfg.allow_unlabelled_agent_images`.
/// The message starts with [`NOT_AGENT_COMPATIBLE`].
pub async fn check_agent_image(
    cfg: &Config,
    image: &str,
    field: &str,
) -> Result<(), ValidationError> {
    if cfg.allow_unlabelled_agent_images {
        return Ok(());
    }
    let why = match labels_of(cfg, image).await {
        Ok(l) if agent_compatible(&l) => return Ok(()),
        Ok(l) => match l.get(AGENT_COMPATIBLE) {
            Some(v) => format!("its label {AGENT_COMPATIBLE} is {v:?}, not \"true\""),
            None => format!("it has no label {AGENT_COMPATIBLE}"),
        },
        Err(e) => format!("its labels cannot be read ({e})"),
    };
    tracing::info!(image, reason = %why, "{NOT_AGENT_COMPATIBLE}");
    Err(ValidationError::new(
        field,
        format!(
            "{NOT_AGENT_COMPATIBLE}: image `{image}` cannot run an agent: {why}; \
             label the image {AGENT_COMPATIBLE}=true, or set the node's \
             allow_unlabelled_agent_images: true"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_label_file_is_beside_the_rootfs() {
        assert_eq!(
            label_file(Path::new("/var/cache/cynode/rootfs/abc")),
            Some(PathBuf::from("/var/cache/cynode/rootfs/abc.labels.json"))
        );
        assert_eq!(
            label_file(Path::new("/srv/img/")),
            Some(PathBuf::from("/srv/img.labels.json"))
        );
        assert_eq!(label_file(Path::new("/")), None);
    }

    #[test]
    fn only_true_is_compatible() {
        for (v, want) in [("true", true), ("True", false), ("yes", false), ("", false)] {
            let l = Labels::from([(AGENT_COMPATIBLE.to_string(), v.to_string())]);
            assert_eq!(agent_compatible(&l), want, "{v}");
        }
        assert!(!agent_compatible(&Labels::new()));
    }

    #[test]
    fn labels_parse_strictly() {
        assert_eq!(parse_labels(b"null").unwrap(), Labels::new());
        assert!(parse_labels(b"{\"a\": 1}").is_err());
        assert!(parse_labels(b"[\"a\"]").is_err());
        assert_eq!(parse_labels(b"{\"a\": \"b\"}").unwrap()["a"], "b");
    }
}
