//! Artifact collection: files the steps left in the artifacts directory, plus workspace
//! files matching the job's `artifacts` globs (copied in without following symlinks),
//! each reported with its sha256 and size.

use std::path::Path;

use cynode_protocol::result::ArtifactRecord;
use globset::{Glob, GlobSetBuilder};
use rustix::fs::{Mode, OFlags};

use crate::confine::{display, hash_reader, Workspace};
use crate::error::{Result, StepError};
use crate::walk::{for_each_file, open_child_file};

/// Most artifacts one job reports.
pub const MAX_ARTIFACTS: usize = 10_000;

/// Copies glob matches from the workspace into `out` and lists everything in `out`.
pub fn collect(ws: &Workspace, out: &Workspace, globs: &[String]) -> Result<Vec<ArtifactRecord>> {
    if !globs.is_empty() {
        copy_matches(ws, out, globs)?;
    }
    let mut records = Vec::new();
    let root = out.open_at(
        Path::new(""),
        OFlags::RDONLY | OFlags::DIRECTORY,
        Mode::empty(),
    )?;
    for_each_file(root, Path::new(""), &mut |path, dir, name| {
        if let Some((mut file, _)) = open_child_file(dir, name) {
            if let Ok((size_bytes, sha256)) = hash_reader(&mut file) {
                records.push(ArtifactRecord {
                    path: display(path),
                    sha256,
                    size_bytes,
                });
            }
        }
        records.len() < MAX_ARTIFACTS
    })
    .map_err(|e| StepError::io("collect artifacts in", "artifacts directory", &e))?;
    records.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(records)
}

fn copy_matches(ws: &Workspace, out: &Workspace, globs: &[String]) -> Result<()> {
    let mut builder = GlobSetBuilder::new();
    for g in globs {
        let glob = Glob::new(g.trim_start_matches("./"))
            .map_err(|e| StepError::failed(format!("invalid artifacts glob `{g}`: {e}")))?;
        builder.add(glob);
    }
    let set = builder
        .build()
        .map_err(|e| StepError::failed(format!("invalid artifacts globs: {e}")))?;
    let root = ws.open_at(
        Path::new(""),
        OFlags::RDONLY | OFlags::DIRECTORY,
        Mode::empty(),
    )?;
    let mut failure = None;
    let mut copied = 0usize;
    for_each_file(root, Path::new(""), &mut |path, dir, name| {
        if !set.is_match(path) {
            return true;
        }
        let Some((mut file, _)) = open_child_file(dir, name) else {
            return true;
        };
        if let Err(e) = out.write_atomic(path, &mut file, 0o644, true) {
            failure = Some(e);
            return false;
        }
        copied += 1;
        copied < MAX_ARTIFACTS
    })
    .map_err(|e| StepError::io("collect artifacts in", "workspace", &e))?;
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
