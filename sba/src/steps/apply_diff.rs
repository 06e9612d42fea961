//! `apply_unified_diff`: native and all-or-nothing.
//!
//! Two phases: first every file is read (confined) and every hunk applied in memory; only
//! when all of them succeeded is anything written, each file atomically. A failure in the
//! first phase leaves the workspace untouched and names the file and hunk.

use std::collections::HashMap;
use std::path::PathBuf;

use cynode_protocol::job::ApplyUnifiedDiffArgs;
use cynode_protocol::result::{ApplyDiffOutput, StepOutput};

use super::StepContext;
use crate::confine::{display, read_all};
use crate::error::{Result, StepError};
use crate::patch::{apply_hunks, parse_patch, FileChangeKind, PatchError};

/// Largest file a diff may edit.
const MAX_FILE_BYTES: u64 = 256 * 1024 * 1024;

/// One file's planned change.
struct Planned {
    kind: FileChangeKind,
    old: Option<PathBuf>,
    new: Option<PathBuf>,
    content: Vec<u8>,
    mode: u32,
}

/// Runs the step.
pub fn run(ctx: &StepContext<'_>, args: &ApplyUnifiedDiffArgs) -> Result<StepOutput> {
    let patches = parse_patch(&args.diff).map_err(map_patch_error)?;
    // Phase 1: read and apply everything in memory. `current` holds the latest content of
    // files touched earlier in the same diff.
    let mut current: HashMap<PathBuf, Option<Vec<u8>>> = HashMap::new();
    let mut plan = Vec::with_capacity(patches.len());
    for (i, fp) in patches.iter().enumerate() {
        let old = fp.old_path.as_deref().map(|p| ctx.path(p)).transpose()?;
        let new = fp.new_path.as_deref().map(|p| ctx.path(p)).transpose()?;
        let shown = fp.display_path().to_string();
        let (original, existing_mode) = match (&fp.kind, &old) {
            (FileChangeKind::Create, _) => {
                let target = new
                    .as_ref()
                    .ok_or_else(|| StepError::internal("create without a path"))?;
                let exists = match current.get(target) {
                    Some(state) => state.is_some(),
                    None => ctx.ws.lstat(target)?.is_some(),
                };
                if exists {
                    return Err(StepError::failed(format!(
                        "file {} of the diff: {shown} already exists",
                        i + 1
                    )));
                }
                (Vec::new(), None)
            }
            (_, Some(old_rel)) => read_current(ctx, &mut current, old_rel, &shown)?,
            (_, None) => return Err(StepError::internal("diff entry without an old path")),
        };
        if ctx.check_time().is_err() {
            return Err(ctx.deadline_error());
        }
        let content = if fp.hunks.is_empty() {
            original
        } else {
            apply_hunks(i, &shown, &original, fp).map_err(map_patch_error)?
        };
        let mode = fp
            .new_mode
            .map(|m| m & 0o777)
            .or(existing_mode)
            .unwrap_or(0o644);
        match fp.kind {
            FileChangeKind::Delete => {
                if let Some(o) = &old {
                    current.insert(o.clone(), None);
                }
            }
            FileChangeKind::Rename => {
                if let Some(o) = &old {
                    current.insert(o.clone(), None);
                }
                if let Some(n) = &new {
                    current.insert(n.clone(), Some(content.clone()));
                }
            }
            FileChangeKind::Create | FileChangeKind::Modify => {
                if let Some(n) = &new {
                    current.insert(n.clone(), Some(content.clone()));
                }
            }
        }
        plan.push(Planned {
            kind: fp.kind,
            old,
            new,
            content,
            mode,
        });
    }
    // Phase 2: every hunk applied; write.
    let mut out = ApplyDiffOutput::default();
    for p in plan {
        match (p.kind, p.old, p.new) {
            (FileChangeKind::Create, _, Some(new)) => {
                ctx.ws
                    .write_atomic(&new, &mut p.content.as_slice(), p.mode, false)?;
                out.files_created.push(display(&new));
            }
            (FileChangeKind::Modify, _, Some(new)) => {
                ctx.ws
                    .write_atomic(&new, &mut p.content.as_slice(), p.mode, true)?;
                out.files_modified.push(display(&new));
            }
            (FileChangeKind::Delete, Some(old), _) => {
                ctx.ws.remove_file(&old)?;
                out.files_deleted.push(display(&old));
            }
            (FileChangeKind::Rename, Some(old), Some(new)) => {
                ctx.ws
                    .write_atomic(&new, &mut p.content.as_slice(), p.mode, false)?;
                ctx.ws.remove_file(&old)?;
                out.files_deleted.push(display(&old));
                out.files_created.push(display(&new));
            }
            _ => return Err(StepError::internal("inconsistent diff entry")),
        }
    }
    Ok(StepOutput::ApplyUnifiedDiff(out))
}

fn read_current(
    ctx: &StepContext<'_>,
    current: &mut HashMap<PathBuf, Option<Vec<u8>>>,
    rel: &PathBuf,
    shown: &str,
) -> Result<(Vec<u8>, Option<u32>)> {
    if let Some(state) = current.get(rel) {
        return match state {
            Some(bytes) => Ok((bytes.clone(), None)),
            None => Err(StepError::failed(format!(
                "{shown} was already removed by this diff"
            ))),
        };
    }
    let (mut file, size) = ctx.ws.open_read(rel)?;
    if size > MAX_FILE_BYTES {
        return Err(StepError::failed(format!(
            "{shown} is larger than {MAX_FILE_BYTES} bytes"
        )));
    }
    let mode = rustix::fs::fstat(&file).map(|st| st.st_mode & 0o777).ok();
    let bytes = read_all(&mut file, MAX_FILE_BYTES)
        .map_err(|e| StepError::io("apply_unified_diff: read", shown, &e))?;
    Ok((bytes, mode))
}

fn map_patch_error(e: PatchError) -> StepError {
    match e {
        PatchError::PathEscape { path } => StepError::escape(&path, "named by the diff"),
        other => StepError::failed(format!("diff does not apply: {other}")),
    }
}
