//! `list_tree`: a structured, sorted tree that never follows symlinks.
//!
//! Bounded by `max_depth`, by [`MAX_ENTRIES`], and by `max_output_bytes` (estimated JSON
//! size); hitting a bound sets `truncated`. The contents of `.git` are not listed (the
//! directory itself is): they are noise for every consumer of this step.

use std::os::fd::OwnedFd;

use cynode_protocol::job::ListTreeArgs;
use cynode_protocol::result::{EntryType, ListTreeOutput, StepOutput, TreeNode};
use rustix::fs::{AtFlags, FileType};

use super::StepContext;
use crate::confine::display;
use crate::error::{Result, StepError};
use crate::walk::{open_child_dir, read_entries, MAX_WALK_DEPTH};

/// Hard cap on entries in one tree.
pub const MAX_ENTRIES: usize = 1_000_000;
/// Rough JSON bytes per entry besides its name.
const ENTRY_OVERHEAD: usize = 48;

struct Budget<'c, 'a> {
    ctx: &'c StepContext<'a>,
    entries: usize,
    bytes: usize,
    truncated: bool,
    max_depth: u32,
}

/// Runs the step.
pub fn run(ctx: &StepContext<'_>, args: &ListTreeArgs) -> Result<StepOutput> {
    let rel = ctx.path(args.path.as_deref().unwrap_or(""))?;
    let dir = ctx.ws.open_dir(&rel)?;
    let mut budget = Budget {
        ctx,
        entries: 0,
        bytes: ctx.output_cap(),
        truncated: false,
        max_depth: args.max_depth.unwrap_or(u32::MAX).min(MAX_WALK_DEPTH),
    };
    let children = walk(&dir, 1, &mut budget)?;
    let name = display(&rel);
    Ok(StepOutput::ListTree(ListTreeOutput {
        tree: TreeNode {
            name,
            entry_type: EntryType::Dir,
            size_bytes: None,
            children,
        },
        truncated: budget.truncated,
    }))
}

fn walk(dir: &OwnedFd, depth: u32, budget: &mut Budget<'_, '_>) -> Result<Vec<TreeNode>> {
    let entries = read_entries(dir).map_err(|e| StepError::io("list_tree", "directory", &e))?;
    let mut nodes = Vec::with_capacity(entries.len());
    for e in entries {
        if budget.entries >= MAX_ENTRIES || budget.bytes < e.name.len() + ENTRY_OVERHEAD {
            budget.truncated = true;
            break;
        }
        budget.entries += 1;
        budget.bytes -= e.name.len() + ENTRY_OVERHEAD;
        if budget.entries.is_multiple_of(4096) {
            budget.ctx.check_time()?;
        }
        let name = e.name.to_string_lossy().into_owned();
        let node = match e.file_type {
            FileType::Directory => {
                let children = if depth < budget.max_depth && e.name != ".git" {
                    match open_child_dir(dir, &e.name) {
                        Ok(child) => walk(&child, depth + 1, budget)?,
                        Err(_) => Vec::new(),
                    }
                } else {
                    Vec::new()
                };
                TreeNode {
                    name,
                    entry_type: EntryType::Dir,
                    size_bytes: None,
                    children,
                }
            }
            FileType::RegularFile => TreeNode {
                size_bytes: rustix::fs::statat(dir, &e.name, AtFlags::SYMLINK_NOFOLLOW)
                    .ok()
                    .map(|st| st.st_size as u64),
                name,
                entry_type: EntryType::File,
                children: Vec::new(),
            },
            FileType::Symlink => TreeNode {
                name,
                entry_type: EntryType::Symlink,
                size_bytes: None,
                children: Vec::new(),
            },
            _ => TreeNode {
                name,
                entry_type: EntryType::Other,
                size_bytes: None,
                children: Vec::new(),
            },
        };
        nodes.push(node);
        if budget.truncated {
            break;
        }
    }
    Ok(nodes)
}
