//! `search_files`: a regular expression over the workspace's text files.
//!
//! Symlinks are never followed, hard-linked and binary files (a NUL in the first 8 KiB) are
//! skipped, files over [`MAX_FILE_BYTES`] are skipped, `.git` is not searched. Results are
//! sorted by path and line, bounded by [`MAX_MATCHES`] and `max_output_bytes`.

use std::io::Read;

use cynode_protocol::job::SearchFilesArgs;
use cynode_protocol::result::{SearchFilesOutput, SearchMatch, StepOutput};
use regex::bytes::Regex;

use super::StepContext;
use crate::confine::display;
use crate::error::{Result, StepError};
use crate::walk::{for_each_file, open_child_file};

/// Most matches one search returns.
pub const MAX_MATCHES: usize = 10_000;
/// Larger files are not searched.
pub const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;
/// Longest line text kept in a match.
const MAX_LINE_CHARS: usize = 500;

/// Runs the step.
pub fn run(ctx: &StepContext<'_>, args: &SearchFilesArgs) -> Result<StepOutput> {
    let re = Regex::new(&args.pattern)
        .map_err(|e| StepError::failed(format!("invalid pattern: {e}")))?;
    let include = match &args.include {
        Some(glob) => Some(
            globset::Glob::new(glob)
                .map_err(|e| StepError::failed(format!("invalid include glob: {e}")))?
                .compile_matcher(),
        ),
        None => None,
    };
    let rel = ctx.path(args.path.as_deref().unwrap_or(""))?;
    let dir = ctx.ws.open_dir(&rel)?;
    let mut matches = Vec::new();
    let mut bytes_left = ctx.output_cap();
    let mut truncated = false;
    let mut visited = 0usize;
    let mut time_error = None;
    let mut buf = Vec::new();
    for_each_file(dir, &rel, &mut |path, dir, name| {
        visited += 1;
        if visited.is_multiple_of(256) {
            if let Err(e) = ctx.check_time() {
                time_error = Some(e);
                return false;
            }
        }
        if include.as_ref().is_some_and(|m| !m.is_match(path)) {
            return true;
        }
        let Some((mut file, size)) = open_child_file(dir, name) else {
            return true;
        };
        if size > MAX_FILE_BYTES {
            return true;
        }
        buf.clear();
        if file.read_to_end(&mut buf).is_err() || buf.iter().take(8192).any(|b| *b == 0) {
            return true;
        }
        let shown = display(path);
        for (i, line) in buf.split(|b| *b == b'\n').enumerate() {
            if !re.is_match(line) {
                continue;
            }
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let text: String = String::from_utf8_lossy(line)
                .chars()
                .take(MAX_LINE_CHARS)
                .collect();
            let cost = shown.len() + text.len() + 32;
            if matches.len() >= MAX_MATCHES || cost > bytes_left {
                truncated = true;
                return false;
            }
            bytes_left -= cost;
            matches.push(SearchMatch {
                path: shown.clone(),
                line: i as u64 + 1,
                text,
            });
        }
        true
    })
    .map_err(|e| StepError::io("search_files", &display(&rel), &e))?;
    if let Some(e) = time_error {
        return Err(e);
    }
    Ok(StepOutput::SearchFiles(SearchFilesOutput {
        matches,
        truncated,
    }))
}
