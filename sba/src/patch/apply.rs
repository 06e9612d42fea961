//! Applying the hunks of one [`FilePatch`] to a file's bytes in memory.

use super::{FileChangeKind, FilePatch, Hunk, HunkFailure, LineKind, PatchError};

/// Applies `patch`'s hunks to `original` and returns the new content.
///
/// `file_index` (0-based position in [`super::parse_patch`]'s result) and `path` only
/// serve error messages. For [`FileChangeKind::Create`] the caller passes an empty
/// slice (the file must not exist); for [`FileChangeKind::Delete`] the result is
/// always empty on success (the caller deletes the file). Context and removed lines
/// must match exactly; each hunk is tried at its stated position shifted by the
/// previous hunk's offset, then ever further above and below it. Hunks apply in order
/// and must not overlap.
///
/// # Errors
///
/// [`PatchError::HunkFailed`] when a hunk does not apply (with the reason),
/// [`PatchError::CreateTargetNotEmpty`] when a file to be created has content, and
/// [`PatchError::DeleteNotEmpty`] when a deleted file keeps content.
pub fn apply_hunks(
    file_index: usize,
    path: &str,
    original: &[u8],
    patch: &FilePatch,
) -> Result<Vec<u8>, PatchError> {
    if patch.kind == FileChangeKind::Create && !original.is_empty() {
        return Err(PatchError::CreateTargetNotEmpty {
            file_index,
            path: path.to_string(),
        });
    }
    let out = if patch.hunks.is_empty() {
        original.to_vec()
    } else {
        apply_all(file_index, path, original, &patch.hunks)?
    };
    if patch.kind == FileChangeKind::Delete && !out.is_empty() {
        return Err(PatchError::DeleteNotEmpty {
            file_index,
            path: path.to_string(),
            remaining_bytes: out.len(),
        });
    }
    Ok(out)
}

/// The original file split into lines that keep their line endings.
struct Text<'a> {
    bytes: &'a [u8],
    /// Byte offset of each line start, plus the total length at the end.
    starts: Vec<usize>,
}

impl<'a> Text<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        const LO: u64 = 0x0101_0101_0101_0101;
        const HI: u64 = 0x8080_8080_8080_8080;
        const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
        const NL: u64 = LO * b'\n' as u64;
        let mut starts = Vec::with_capacity(bytes.len() / 24 + 2);
        starts.push(0);
        // Find newlines eight bytes at a time: a byte of `x` is zero exactly where the
        // input byte is `\n`, and `!t & HI` marks exactly the zero bytes of `x`.
        let mut chunks = bytes.chunks_exact(8);
        let mut base = 0usize;
        for chunk in chunks.by_ref() {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            let x = u64::from_le_bytes(word) ^ NL;
            let t = ((x & LOW7) + LOW7) | x;
            let mut m = !t & HI;
            while m != 0 {
                starts.push(base + (m.trailing_zeros() / 8) as usize + 1);
                m &= m - 1;
            }
            base += 8;
        }
        for (i, &b) in chunks.remainder().iter().enumerate() {
            if b == b'\n' {
                starts.push(base + i + 1);
            }
        }
        if starts.last() != Some(&bytes.len()) {
            starts.push(bytes.len());
        }
        Text { bytes, starts }
    }

    /// Number of lines.
    fn len(&self) -> usize {
        self.starts.len().saturating_sub(1)
    }

    /// Line `k` (0-based) with its line ending, if it exists.
    fn line(&self, k: usize) -> Option<&'a [u8]> {
        let a = *self.starts.get(k)?;
        let b = *self.starts.get(k.checked_add(1)?)?;
        self.bytes.get(a..b)
    }

    /// Bytes of lines `from..to`.
    fn range(&self, from: usize, to: usize) -> &'a [u8] {
        match (self.starts.get(from), self.starts.get(to)) {
            (Some(&a), Some(&b)) => self.bytes.get(a..b).unwrap_or(&[]),
            _ => &[],
        }
    }

    fn ends_without_newline(&self) -> bool {
        self.bytes.last().is_some_and(|&b| b != b'\n')
    }
}

/// Facts about a hunk needed while searching for it.
struct Shape<'h> {
    old: Vec<&'h [u8]>,
    has_new: bool,
    /// The hunk's last line (either side) has no newline: it must end at end of file.
    needs_eof: bool,
}

impl<'h> Shape<'h> {
    fn new(hunk: &'h Hunk) -> Self {
        let old: Vec<&[u8]> = hunk
            .lines
            .iter()
            .filter(|l| l.kind != LineKind::Add)
            .map(|l| l.content.as_bytes())
            .collect();
        let last_new = hunk.lines.iter().rev().find(|l| l.kind != LineKind::Remove);
        let needs_eof = old.last().is_some_and(|l| !l.ends_with(b"\n"))
            || last_new.is_some_and(|l| !l.content.ends_with('\n'));
        Shape {
            old,
            has_new: last_new.is_some(),
            needs_eof,
        }
    }

    /// Do the old lines equal the file's lines starting at `pos`?
    fn content_matches(&self, text: &Text<'_>, pos: usize) -> bool {
        if pos.saturating_add(self.old.len()) > text.len() {
            return false;
        }
        self.old
            .iter()
            .enumerate()
            .all(|(k, want)| text.line(pos + k) == Some(*want))
    }

    /// Is `pos` an acceptable place for the hunk?
    fn fits(&self, text: &Text<'_>, pos: usize) -> bool {
        if !self.content_matches(text, pos) {
            return false;
        }
        let at_eof = pos.saturating_add(self.old.len()) == text.len();
        if self.needs_eof && !at_eof {
            return false;
        }
        // Lines added right after a last line without newline would be glued to it.
        let appends_to_unterminated = at_eof && self.old.is_empty() && pos > 0 && self.has_new;
        !(appends_to_unterminated && text.ends_without_newline())
    }
}

fn apply_all(
    file_index: usize,
    path: &str,
    original: &[u8],
    hunks: &[Hunk],
) -> Result<Vec<u8>, PatchError> {
    let text = Text::new(original);
    let n = text.len();
    let added: usize = hunks
        .iter()
        .flat_map(|h| h.lines.iter())
        .filter(|l| l.kind == LineKind::Add)
        .map(|l| l.content.len())
        .fold(0usize, usize::saturating_add);
    let mut out = Vec::with_capacity(original.len().saturating_add(added));
    // Next original line not yet consumed by a hunk.
    let mut cursor = 0usize;
    let mut offset: i128 = 0;
    for (i, hunk) in hunks.iter().enumerate() {
        let shape = Shape::new(hunk);
        let stated = if shape.old.is_empty() {
            hunk.old_start
        } else {
            hunk.old_start.saturating_sub(1)
        };
        let expected = stated as i128 + offset;
        let Some(pos) = locate(&text, &shape, expected, cursor) else {
            return Err(PatchError::HunkFailed {
                file_index,
                path: path.to_string(),
                hunk: i + 1,
                header: hunk.header.clone(),
                reason: diagnose(&text, &shape, expected, cursor),
            });
        };
        offset = pos as i128 - stated as i128;
        out.extend_from_slice(text.range(cursor, pos));
        for line in &hunk.lines {
            if line.kind != LineKind::Remove {
                out.extend_from_slice(line.content.as_bytes());
            }
        }
        cursor = pos + shape.old.len();
    }
    out.extend_from_slice(text.range(cursor, n));
    Ok(out)
}

/// Finds where the hunk applies: at `expected` or the nearest place around it, not
/// before `lo` (the end of the previous hunk).
fn locate(text: &Text<'_>, shape: &Shape<'_>, expected: i128, lo: usize) -> Option<usize> {
    let n = text.len();
    let hi = n.checked_sub(shape.old.len())?;
    if lo > hi {
        return None;
    }
    if shape.old.is_empty() {
        // Nothing to match: a pure insertion goes exactly where it says.
        let pos = usize::try_from(expected).ok()?;
        return (pos >= lo && pos <= hi && shape.fits(text, pos)).then_some(pos);
    }
    let e = expected.clamp(0, n as i128);
    let (lo_i, hi_i) = (lo as i128, hi as i128);
    let max_d = (e - lo_i).max(hi_i - e).max(0);
    let try_at = |cand: i128| -> Option<usize> {
        if cand < lo_i || cand > hi_i {
            return None;
        }
        let pos = usize::try_from(cand).ok()?;
        shape.fits(text, pos).then_some(pos)
    };
    let mut d: i128 = 0;
    while d <= max_d {
        if let Some(pos) = try_at(e + d) {
            return Some(pos);
        }
        if d > 0 {
            if let Some(pos) = try_at(e - d) {
                return Some(pos);
            }
        }
        d += 1;
    }
    None
}

/// Explains why a hunk did not apply.
fn diagnose(text: &Text<'_>, shape: &Shape<'_>, expected: i128, lo: usize) -> HunkFailure {
    let n = text.len();
    if shape.old.is_empty() {
        if expected < lo as i128 {
            return HunkFailure::OverlapsPreviousHunk;
        }
        if expected > n as i128 {
            return HunkFailure::FileEndsBeforeHunk {
                line: usize::try_from(expected).unwrap_or(usize::MAX),
                file_lines: n,
            };
        }
        return HunkFailure::MissingNewlineAtEndOfFile;
    }
    if (0..lo).any(|p| shape.content_matches(text, p)) {
        return HunkFailure::OverlapsPreviousHunk;
    }
    let e = usize::try_from(expected.max(0)).unwrap_or(usize::MAX);
    for (k, want) in shape.old.iter().enumerate() {
        let idx = e.saturating_add(k);
        match text.line(idx) {
            None => {
                return HunkFailure::FileEndsBeforeHunk {
                    line: idx.saturating_add(1),
                    file_lines: n,
                }
            }
            Some(got) if got != *want => {
                return HunkFailure::ContextMismatch {
                    line: idx + 1,
                    expected: snippet(want),
                    found: snippet(got),
                }
            }
            Some(_) => {}
        }
    }
    if shape.needs_eof {
        HunkFailure::NotAtEndOfFile
    } else {
        HunkFailure::OverlapsPreviousHunk
    }
}

/// A short printable form of a line for messages.
fn snippet(line: &[u8]) -> String {
    const MAX: usize = 80;
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let s = String::from_utf8_lossy(line);
    if s.chars().count() > MAX {
        let mut t: String = s.chars().take(MAX).collect();
        t.push_str("...");
        t
    } else {
        s.into_owned()
    }
}
