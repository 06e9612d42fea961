//! Native, all-or-nothing unified diff engine working purely on in-memory bytes.
//!
//! The engine has two stages:
//!
//! 1. [`parse_patch`] turns the text of a unified diff (`git diff` output or plain
//!    `diff -u` output) into a list of [`FilePatch`]es. Paths are validated here:
//!    absolute paths, `..` components, empty paths and NUL bytes are refused with
//!    [`PatchError::PathEscape`]. Binary patches, copies, symlinks and submodules are
//!    refused as well.
//! 2. [`apply_hunks`] applies the hunks of one [`FilePatch`] to the original bytes of
//!    that file and returns the new bytes. Nothing touches the filesystem: the caller
//!    reads every file, applies every [`FilePatch`], and only writes anything once all
//!    of them succeeded.
//!
//! Matching is exact (GNU `patch` with fuzz 0): every context and removed line must
//! match byte for byte (a `\r` before the `\n` is part of the line). A hunk is tried at
//! its stated position (shifted by the offset at which the previous hunk applied) and
//! then at increasing distances above and below it. Hunks apply in order and never
//! overlap.

mod apply;
mod parse;
#[cfg(test)]
mod tests;

use std::fmt;

pub use apply::apply_hunks;
pub use parse::parse_patch;

/// What a [`FilePatch`] does to its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileChangeKind {
    /// Change an existing file in place (`old_path == new_path`, both `Some`).
    Modify,
    /// Create a new file (`old_path` is `None`); the original must be empty.
    Create,
    /// Delete a file (`new_path` is `None`); the hunks must remove every line.
    Delete,
    /// Move `old_path` to `new_path`, applying the hunks (if any) on the way.
    Rename,
}

/// The changes a patch makes to one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilePatch {
    /// Path of the file before the change, relative to the workspace (`None` = `/dev/null`).
    pub old_path: Option<String>,
    /// Path of the file after the change, relative to the workspace (`None` = `/dev/null`).
    pub new_path: Option<String>,
    /// What happens to the file.
    pub kind: FileChangeKind,
    /// Mode after the change (`new file mode`, `new mode`), e.g. `0o100755`.
    pub new_mode: Option<u32>,
    /// Mode before the change (`deleted file mode`, `old mode`), e.g. `0o100644`.
    pub old_mode: Option<u32>,
    /// The hunks, in patch order.
    pub hunks: Vec<Hunk>,
}

impl FilePatch {
    /// The path to name in messages: the new path, or the old one for deletions.
    #[must_use]
    pub fn display_path(&self) -> &str {
        self.new_path
            .as_deref()
            .or(self.old_path.as_deref())
            .unwrap_or("")
    }
}

/// One `@@ -l,s +l,s @@` hunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hunk {
    /// First old line (1-based; 0 for an empty old range).
    pub old_start: usize,
    /// Number of old lines stated in the header.
    pub old_lines: usize,
    /// First new line (1-based; 0 for an empty new range).
    pub new_start: usize,
    /// Number of new lines stated in the header.
    pub new_lines: usize,
    /// The header line as written, without its line ending.
    pub header: String,
    /// Body lines, in order.
    pub lines: Vec<HunkLine>,
}

/// The role of a line in a hunk body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineKind {
    /// ` ` line: present on both sides.
    Context,
    /// `-` line: only in the old file.
    Remove,
    /// `+` line: only in the new file.
    Add,
}

/// One body line of a hunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HunkLine {
    /// Context, removed or added.
    pub kind: LineKind,
    /// The line's bytes without the leading marker, including its line ending
    /// (`\n`, or `\r\n` for CRLF files); without one when the line was followed by
    /// `\ No newline at end of file`.
    pub content: String,
}

/// Why a hunk could not be applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HunkFailure {
    /// A context or removed line differs from the file (1-based line of the file,
    /// checked at the hunk's expected position).
    ContextMismatch {
        line: usize,
        expected: String,
        found: String,
    },
    /// The hunk needs lines past the end of the file.
    FileEndsBeforeHunk { line: usize, file_lines: usize },
    /// The hunk only matches at a place already consumed by the previous hunk.
    OverlapsPreviousHunk,
    /// The hunk's last line has no newline, so it must end at the end of the file,
    /// but it matches only elsewhere.
    NotAtEndOfFile,
    /// The hunk would add lines after a last line that has no newline.
    MissingNewlineAtEndOfFile,
}

impl fmt::Display for HunkFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ContextMismatch {
                line,
                expected,
                found,
            } => write!(
                f,
                "context mismatch at line {line}: expected {expected:?}, found {found:?}"
            ),
            Self::FileEndsBeforeHunk { line, file_lines } => write!(
                f,
                "file ends before hunk: hunk needs line {line} but file has {file_lines} lines"
            ),
            Self::OverlapsPreviousHunk => f.write_str("hunk overlaps previous hunk"),
            Self::NotAtEndOfFile => f.write_str(
                "hunk ends without a newline at end of file but does not match at end of file",
            ),
            Self::MissingNewlineAtEndOfFile => {
                f.write_str("cannot add lines after last line: file does not end with a newline")
            }
        }
    }
}

/// Everything that can go wrong while parsing or applying a patch.
///
/// `file_index` is the 0-based position of the file in [`parse_patch`]'s result;
/// messages show it 1-based. `hunk` is 1-based within its file. `line` in parse
/// errors is the 1-based line number in the patch text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PatchError {
    /// The patch text is not a well-formed unified diff.
    Malformed { line: usize, message: String },
    /// A `@@` line that is not `@@ -l[,s] +l[,s] @@[ section]`.
    MalformedHunkHeader {
        file_index: usize,
        path: String,
        hunk: usize,
        line: usize,
        header: String,
    },
    /// A hunk body does not have the number of lines its header states.
    HunkCountMismatch {
        file_index: usize,
        path: String,
        hunk: usize,
        line: usize,
        header: String,
        expected_old: usize,
        expected_new: usize,
        found_old: usize,
        found_new: usize,
    },
    /// A binary patch (`GIT binary patch`, `Binary files ... differ`).
    Binary { file_index: usize, path: String },
    /// A path that is absolute, contains `..`, is empty or contains NUL.
    PathEscape { path: String },
    /// A feature this engine refuses (copies, symlinks, submodules).
    Unsupported {
        file_index: usize,
        path: String,
        what: String,
    },
    /// The patch contains no file sections at all.
    NoChanges,
    /// A hunk does not apply.
    HunkFailed {
        file_index: usize,
        path: String,
        hunk: usize,
        header: String,
        reason: HunkFailure,
    },
    /// The file to be created is not empty.
    CreateTargetNotEmpty { file_index: usize, path: String },
    /// The file to be deleted still has content after applying the hunks.
    DeleteNotEmpty {
        file_index: usize,
        path: String,
        remaining_bytes: usize,
    },
}

impl fmt::Display for PatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Malformed { line, message } => {
                write!(f, "malformed patch at line {line}: {message}")
            }
            Self::MalformedHunkHeader {
                file_index,
                path,
                hunk,
                line,
                header,
            } => write!(
                f,
                "file {} ({path}), hunk {hunk} ({header}): malformed hunk header at patch line {line}",
                file_index.saturating_add(1)
            ),
            Self::HunkCountMismatch {
                file_index,
                path,
                hunk,
                line,
                header,
                expected_old,
                expected_new,
                found_old,
                found_new,
            } => write!(
                f,
                "file {} ({path}), hunk {hunk} ({header}): hunk line count mismatch at patch line \
                 {line}: header says {expected_old} old and {expected_new} new lines, body has \
                 {found_old} old and {found_new} new lines",
                file_index.saturating_add(1)
            ),
            Self::Binary { file_index, path } => write!(
                f,
                "file {} ({path}): binary patches are not supported",
                file_index.saturating_add(1)
            ),
            Self::PathEscape { path } => write!(f, "path escapes workspace: {path}"),
            Self::Unsupported {
                file_index,
                path,
                what,
            } => write!(
                f,
                "file {} ({path}): unsupported {what}",
                file_index.saturating_add(1)
            ),
            Self::NoChanges => f.write_str("patch contains no file changes"),
            Self::HunkFailed {
                file_index,
                path,
                hunk,
                header,
                reason,
            } => write!(
                f,
                "file {} ({path}), hunk {hunk} ({header}): {reason}",
                file_index.saturating_add(1)
            ),
            Self::CreateTargetNotEmpty { file_index, path } => write!(
                f,
                "file {} ({path}): file to be created is not empty",
                file_index.saturating_add(1)
            ),
            Self::DeleteNotEmpty {
                file_index,
                path,
                remaining_bytes,
            } => write!(
                f,
                "file {} ({path}): file to be deleted is not empty after applying hunks \
                 ({remaining_bytes} bytes remain)",
                file_index.saturating_add(1)
            ),
        }
    }
}

impl std::error::Error for PatchError {}
