//! Parser for unified diffs: `git diff` output and plain `diff -u` output.

use super::{FileChangeKind, FilePatch, Hunk, HunkLine, LineKind, PatchError};

/// Parses the text of a unified diff into one [`FilePatch`] per file section.
///
/// Accepts `git diff` output (`diff --git` headers with their extended header lines)
/// and plain `diff -u` output (`---`/`+++` pairs, timestamps after a tab are ignored).
/// Text outside file sections (commit messages, `diff -ru` command lines, `Index:`
/// lines, mail signatures) is ignored. Paths lose one leading `a/` or `b/` component
/// (`rename from`/`rename to` paths are taken as they are) and are checked: absolute
/// paths, `..` components, empty paths and NUL bytes give [`PatchError::PathEscape`].
///
/// # Errors
///
/// [`PatchError::PathEscape`] for a bad path, [`PatchError::Binary`] for binary
/// patches, [`PatchError::Unsupported`] for copies, symlinks and submodules,
/// [`PatchError::MalformedHunkHeader`], [`PatchError::HunkCountMismatch`] and
/// [`PatchError::Malformed`] for broken patch text, and [`PatchError::NoChanges`] when
/// the text contains no file section.
pub fn parse_patch(diff: &str) -> Result<Vec<FilePatch>, PatchError> {
    let mut parser = Parser {
        lines: diff.split_inclusive('\n').collect(),
        pos: 0,
        files: Vec::new(),
    };
    parser.run()?;
    if parser.files.is_empty() {
        return Err(PatchError::NoChanges);
    }
    Ok(parser.files)
}

/// Removes a trailing `\n` and then a trailing `\r`.
fn trim_eol(s: &str) -> &str {
    let s = s.strip_suffix('\n').unwrap_or(s);
    s.strip_suffix('\r').unwrap_or(s)
}

/// Strips one leading `a/` or `b/` component.
fn strip_ab(s: &str) -> &str {
    s.strip_prefix("a/")
        .or_else(|| s.strip_prefix("b/"))
        .unwrap_or(s)
}

/// Unquotes a C-style quoted git path at the start of `s`; returns it and the rest.
fn unquote(s: &str) -> Option<(String, &str)> {
    let b = s.as_bytes();
    if b.first() != Some(&b'"') {
        return None;
    }
    let mut out = Vec::new();
    let mut i = 1usize;
    while let Some(&c) = b.get(i) {
        match c {
            b'"' => {
                let rest = s.get(i + 1..)?;
                return String::from_utf8(out).ok().map(|o| (o, rest));
            }
            b'\\' => {
                let e = *b.get(i + 1)?;
                i += 2;
                let byte = match e {
                    b'a' => 7,
                    b'b' => 8,
                    b't' => b'\t',
                    b'n' => b'\n',
                    b'v' => 11,
                    b'f' => 12,
                    b'r' => b'\r',
                    b'"' | b'\\' => e,
                    b'0'..=b'7' => {
                        let d2 = *b.get(i)?;
                        let d3 = *b.get(i + 1)?;
                        if !(b'0'..=b'7').contains(&d2) || !(b'0'..=b'7').contains(&d3) {
                            return None;
                        }
                        i += 2;
                        let v = u32::from(e - b'0') * 64
                            + u32::from(d2 - b'0') * 8
                            + u32::from(d3 - b'0');
                        u8::try_from(v).ok()?
                    }
                    _ => return None,
                };
                out.push(byte);
            }
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    None
}

/// Splits the part of a `diff --git` line after `diff --git ` into its two raw names.
fn parse_git_names(rest: &str) -> Option<(String, String)> {
    if rest.starts_with('"') {
        let (a, r) = unquote(rest)?;
        let r = r.strip_prefix(' ')?;
        let b = if r.starts_with('"') {
            let (b, tail) = unquote(r)?;
            if !tail.trim_end().is_empty() {
                return None;
            }
            b
        } else {
            r.to_string()
        };
        return Some((a, b));
    }
    if rest.ends_with('"') {
        for (i, _) in rest.match_indices(" \"") {
            if let (Some(a), Some(r)) = (rest.get(..i), rest.get(i + 1..)) {
                if let Some((b, tail)) = unquote(r) {
                    if tail.is_empty() {
                        return Some((a.to_string(), b));
                    }
                }
            }
        }
    }
    // Both unquoted: prefer the split where both names agree (names may contain spaces).
    for (i, _) in rest.match_indices(' ') {
        if let (Some(a), Some(b)) = (rest.get(..i), rest.get(i + 1..)) {
            if strip_ab(a) == strip_ab(b) {
                return Some((a.to_string(), b.to_string()));
            }
        }
    }
    let (a, b) = match rest.find(" b/") {
        Some(i) => (rest.get(..i)?, rest.get(i + 1..)?),
        None => rest.split_once(' ')?,
    };
    Some((a.to_string(), b.to_string()))
}

/// Parses the name on a `---`/`+++` line (after the marker). `None` is `/dev/null`;
/// the flag tells whether the timestamp is the Unix epoch (`diff -N`'s mark for a
/// file that does not exist).
fn parse_header_name(v: &str) -> Result<(Option<String>, bool), String> {
    let (name, tail) = if v.starts_with('"') {
        match unquote(v) {
            Some((n, rest)) => (n, rest),
            None => return Err(format!("invalid quoted path: {v}")),
        }
    } else {
        let (cut, tail) = v.split_once('\t').unwrap_or((v, ""));
        (cut.trim_end_matches(' ').to_string(), tail)
    };
    let stamp = tail.trim();
    let epoch = stamp.starts_with("1970-01-01 ")
        || stamp.starts_with("1969-12-31 ")
        || (stamp.contains(" Jan  1 ") && stamp.ends_with(" 1970"))
        || (stamp.contains(" Dec 31 ") && stamp.ends_with(" 1969"));
    if name == "/dev/null" {
        Ok((None, epoch))
    } else {
        Ok((Some(name), epoch))
    }
}

/// Parses a path value of an extended header line (`rename from <path>`).
fn parse_plain_value(v: &str) -> Result<String, String> {
    if v.starts_with('"') {
        match unquote(v) {
            Some((n, tail)) if tail.trim_end().is_empty() => Ok(n),
            _ => Err(format!("invalid quoted path: {v}")),
        }
    } else {
        Ok(v.to_string())
    }
}

/// Parses an octal file mode such as `100644`.
fn parse_mode(v: &str) -> Option<u32> {
    let v = v.trim();
    if v.is_empty() || v.len() > 7 || !v.bytes().all(|c| (b'0'..=b'7').contains(&c)) {
        return None;
    }
    u32::from_str_radix(v, 8).ok()
}

/// Takes a decimal number from the start of `s`.
fn take_num(s: &str) -> Option<(usize, &str)> {
    let end = s.bytes().take_while(u8::is_ascii_digit).count();
    if end == 0 {
        return None;
    }
    let n = s.get(..end)?.parse::<usize>().ok()?;
    Some((n, s.get(end..)?))
}

/// Takes `l[,s]` (count defaults to 1).
fn take_range(s: &str) -> Option<(usize, usize, &str)> {
    let (start, rest) = take_num(s)?;
    match rest.strip_prefix(',') {
        Some(r) => {
            let (count, rest) = take_num(r)?;
            Some((start, count, rest))
        }
        None => Some((start, 1, rest)),
    }
}

/// Parses `@@ -l[,s] +l[,s] @@[ section]`.
fn parse_hunk_header(l: &str) -> Option<(usize, usize, usize, usize)> {
    let r = l.strip_prefix("@@ -")?;
    let (os, ol, r) = take_range(r)?;
    let r = r.strip_prefix(" +")?;
    let (ns, nl, r) = take_range(r)?;
    r.strip_prefix(" @@")?;
    Some((os, ol, ns, nl))
}

/// Checks a path (as written, after unquoting) and strips its `a/`/`b/` prefix.
fn resolve_path(raw: &str, strip: bool) -> Result<String, PatchError> {
    let p = if strip { strip_ab(raw) } else { raw };
    let escapes = p.is_empty()
        || p.contains('\0')
        || p.starts_with('/')
        || p.split('/').any(|c| c == "..")
        || p.split('/').all(|c| c.is_empty() || c == ".");
    if escapes {
        return Err(PatchError::PathEscape {
            path: raw.to_string(),
        });
    }
    Ok(p.to_string())
}

/// GNU `patch`'s preference among candidate names: fewest components, then shortest
/// base name, then shortest name; the first wins ties.
fn best_name(a: String, b: String) -> String {
    let key = |s: &str| {
        let comps = s.split('/').filter(|c| !c.is_empty()).count();
        let base = s.rsplit('/').next().map_or(0, str::len);
        (comps, base, s.len())
    };
    if key(&b) < key(&a) {
        b
    } else {
        a
    }
}

/// The raw names and extended header facts of one file section.
#[derive(Default)]
struct Section {
    git: bool,
    line: usize,
    git_old: Option<String>,
    git_new: Option<String>,
    /// `---` name: `Some(None)` is `/dev/null`.
    minus: Option<Option<String>>,
    /// The `---` timestamp is the Unix epoch.
    minus_epoch: bool,
    /// The `+++` timestamp is the Unix epoch.
    plus_epoch: bool,
    /// `+++` name: `Some(None)` is `/dev/null`.
    plus: Option<Option<String>>,
    rename_from: Option<String>,
    rename_to: Option<String>,
    created: bool,
    deleted: bool,
    old_mode: Option<u32>,
    new_mode: Option<u32>,
}

impl Section {
    /// A best-effort name for messages, before the paths are validated.
    fn display_name(&self) -> String {
        let candidates = [
            self.plus.clone().flatten(),
            self.minus.clone().flatten(),
            self.git_new.clone(),
            self.git_old.clone(),
        ];
        candidates
            .into_iter()
            .flatten()
            .map(|n| strip_ab(&n).to_string())
            .next()
            .or_else(|| self.rename_to.clone())
            .unwrap_or_else(|| "?".to_string())
    }
}

struct Parser<'a> {
    lines: Vec<&'a str>,
    pos: usize,
    files: Vec<FilePatch>,
}

impl<'a> Parser<'a> {
    fn peek(&self, k: usize) -> Option<&'a str> {
        self.lines.get(self.pos.saturating_add(k)).copied()
    }

    fn malformed(&self, message: impl Into<String>) -> PatchError {
        PatchError::Malformed {
            line: self.pos + 1,
            message: message.into(),
        }
    }

    fn run(&mut self) -> Result<(), PatchError> {
        while let Some(raw) = self.peek(0) {
            let l = trim_eol(raw);
            if l.starts_with("diff --git ") {
                self.git_section()?;
            } else if l.starts_with("--- ") && self.peek(1).is_some_and(|n| n.starts_with("+++ ")) {
                self.plain_section()?;
            } else if l.starts_with("@@") {
                return Err(
                    self.malformed("hunk without a file header (missing --- and +++ lines)")
                );
            } else if let Some(path) = binary_files_line(l) {
                return Err(PatchError::Binary {
                    file_index: self.files.len(),
                    path,
                });
            } else if l == "GIT binary patch" {
                return Err(PatchError::Binary {
                    file_index: self.files.len(),
                    path: "?".to_string(),
                });
            } else {
                self.pos += 1;
            }
        }
        Ok(())
    }

    /// Parses the `---` and `+++` lines at the current position (both must be there).
    fn minus_plus(&mut self, s: &mut Section) -> Result<(), PatchError> {
        let minus = self.peek(0).map(trim_eol).unwrap_or("");
        let minus = minus.strip_prefix("--- ").unwrap_or("");
        let (name, epoch) = parse_header_name(minus).map_err(|m| self.malformed(m))?;
        s.minus = Some(name);
        s.minus_epoch = epoch;
        self.pos += 1;
        let plus = match self
            .peek(0)
            .map(trim_eol)
            .and_then(|p| p.strip_prefix("+++ "))
        {
            Some(p) => p,
            None => return Err(self.malformed("--- line without a following +++ line")),
        };
        let (name, epoch) = parse_header_name(plus).map_err(|m| self.malformed(m))?;
        s.plus = Some(name);
        s.plus_epoch = epoch;
        self.pos += 1;
        Ok(())
    }

    fn plain_section(&mut self) -> Result<(), PatchError> {
        let mut s = Section {
            line: self.pos + 1,
            ..Section::default()
        };
        self.minus_plus(&mut s)?;
        let hunks = self.hunks(&s)?;
        self.finish(s, hunks)
    }

    fn git_section(&mut self) -> Result<(), PatchError> {
        let first = self.peek(0).map(trim_eol).unwrap_or("");
        let rest = first.strip_prefix("diff --git ").unwrap_or("");
        let mut s = Section {
            git: true,
            line: self.pos + 1,
            ..Section::default()
        };
        if let Some((a, b)) = parse_git_names(rest) {
            s.git_old = Some(a);
            s.git_new = Some(b);
        }
        self.pos += 1;
        while let Some(raw) = self.peek(0) {
            let l = trim_eol(raw);
            if let Some(v) = l.strip_prefix("old mode ") {
                s.old_mode = Some(self.mode(v)?);
            } else if let Some(v) = l.strip_prefix("new mode ") {
                s.new_mode = Some(self.mode(v)?);
            } else if let Some(v) = l.strip_prefix("deleted file mode ") {
                s.old_mode = Some(self.mode(v)?);
                s.deleted = true;
            } else if let Some(v) = l.strip_prefix("new file mode ") {
                s.new_mode = Some(self.mode(v)?);
                s.created = true;
            } else if let Some(v) = l
                .strip_prefix("rename from ")
                .or_else(|| l.strip_prefix("rename old "))
            {
                s.rename_from = Some(parse_plain_value(v).map_err(|m| self.malformed(m))?);
            } else if let Some(v) = l
                .strip_prefix("rename to ")
                .or_else(|| l.strip_prefix("rename new "))
            {
                s.rename_to = Some(parse_plain_value(v).map_err(|m| self.malformed(m))?);
            } else if l.starts_with("copy from ") || l.starts_with("copy to ") {
                return Err(PatchError::Unsupported {
                    file_index: self.files.len(),
                    path: s.display_name(),
                    what: "copy patch".to_string(),
                });
            } else if l.starts_with("similarity index ")
                || l.starts_with("dissimilarity index ")
                || l.starts_with("index ")
            {
                // Informational only.
            } else if l == "GIT binary patch" || binary_files_line(l).is_some() {
                return Err(PatchError::Binary {
                    file_index: self.files.len(),
                    path: s.display_name(),
                });
            } else if l.starts_with("--- ") {
                self.minus_plus(&mut s)?;
                break;
            } else {
                // `@@`, the next `diff --git`, or unrelated text: the header is over.
                break;
            }
            self.pos += 1;
        }
        let hunks = self.hunks(&s)?;
        self.finish(s, hunks)
    }

    fn mode(&self, v: &str) -> Result<u32, PatchError> {
        parse_mode(v).ok_or_else(|| self.malformed(format!("invalid file mode: {}", v.trim())))
    }

    /// Parses all hunks at the current position.
    fn hunks(&mut self, s: &Section) -> Result<Vec<Hunk>, PatchError> {
        let mut hunks: Vec<Hunk> = Vec::new();
        while let Some(raw) = self.peek(0) {
            let l = trim_eol(raw);
            if !l.starts_with("@@") {
                break;
            }
            let number = hunks.len() + 1;
            let header_line = self.pos + 1;
            let Some((old_start, old_lines, new_start, new_lines)) = parse_hunk_header(l) else {
                return Err(PatchError::MalformedHunkHeader {
                    file_index: self.files.len(),
                    path: s.display_name(),
                    hunk: number,
                    line: header_line,
                    header: l.to_string(),
                });
            };
            self.pos += 1;
            let body_start = self.pos;
            let mismatch = |this: &Self| {
                let (found_old, found_new) = count_body(&this.lines, body_start);
                PatchError::HunkCountMismatch {
                    file_index: this.files.len(),
                    path: s.display_name(),
                    hunk: number,
                    line: header_line,
                    header: l.to_string(),
                    expected_old: old_lines,
                    expected_new: new_lines,
                    found_old,
                    found_new,
                }
            };
            let mut rem_old = old_lines;
            let mut rem_new = new_lines;
            let mut old_ended = false;
            let mut new_ended = false;
            let mut body: Vec<HunkLine> = Vec::new();
            loop {
                let Some(raw) = self.peek(0) else {
                    if rem_old == 0 && rem_new == 0 {
                        break;
                    }
                    return Err(mismatch(self));
                };
                let (kind, content) = match raw.as_bytes().first() {
                    Some(b'\\') => {
                        self.no_newline_marker(&mut body, &mut old_ended, &mut new_ended)?;
                        self.pos += 1;
                        continue;
                    }
                    _ if rem_old == 0 && rem_new == 0 => break,
                    Some(b' ') => (LineKind::Context, raw.get(1..).unwrap_or("")),
                    Some(b'-') => (LineKind::Remove, raw.get(1..).unwrap_or("")),
                    Some(b'+') => (LineKind::Add, raw.get(1..).unwrap_or("")),
                    // An empty context line whose leading space was stripped.
                    Some(b'\n') => (LineKind::Context, raw),
                    Some(b'\r') if raw == "\r\n" => (LineKind::Context, raw),
                    _ => return Err(mismatch(self)),
                };
                let (uses_old, uses_new) = match kind {
                    LineKind::Context => (true, true),
                    LineKind::Remove => (true, false),
                    LineKind::Add => (false, true),
                };
                if (uses_old && rem_old == 0) || (uses_new && rem_new == 0) {
                    return Err(mismatch(self));
                }
                if (uses_old && old_ended) || (uses_new && new_ended) {
                    return Err(self.malformed(
                        "line after \"\\ No newline at end of file\" on the same side of the hunk",
                    ));
                }
                if uses_old {
                    rem_old -= 1;
                }
                if uses_new {
                    rem_new -= 1;
                }
                let mut content = content.to_string();
                if !content.ends_with('\n') {
                    // The last line of a patch that lacks its final newline.
                    content.push('\n');
                }
                body.push(HunkLine { kind, content });
                self.pos += 1;
            }
            if let Some(raw) = self.peek(0) {
                if looks_like_extra_hunk_line(raw, self.peek(1)) {
                    return Err(mismatch(self));
                }
            }
            hunks.push(Hunk {
                old_start,
                old_lines,
                new_start,
                new_lines,
                header: l.to_string(),
                lines: body,
            });
        }
        Ok(hunks)
    }

    /// Handles `\ No newline at end of file`: the previous line loses its newline.
    fn no_newline_marker(
        &self,
        body: &mut [HunkLine],
        old_ended: &mut bool,
        new_ended: &mut bool,
    ) -> Result<(), PatchError> {
        let Some(last) = body.last_mut() else {
            return Err(
                self.malformed("\"\\ No newline at end of file\" without a preceding hunk line")
            );
        };
        if last.content.ends_with('\n') {
            last.content.pop();
        }
        match last.kind {
            LineKind::Context => {
                *old_ended = true;
                *new_ended = true;
            }
            LineKind::Remove => *old_ended = true,
            LineKind::Add => *new_ended = true,
        }
        Ok(())
    }

    /// Turns a parsed section into a [`FilePatch`] with validated paths.
    fn finish(&mut self, s: Section, hunks: Vec<Hunk>) -> Result<(), PatchError> {
        let file_index = self.files.len();
        let bad = |message: &str| PatchError::Malformed {
            line: s.line,
            message: message.to_string(),
        };
        // Plain `diff -N` marks a missing file with an epoch timestamp and empty ranges.
        let epoch_missing = |epoch: bool, empty: fn(&Hunk) -> bool| {
            !s.git && epoch && !hunks.is_empty() && hunks.iter().all(empty)
        };
        let old_null = matches!(s.minus, Some(None))
            || epoch_missing(s.minus_epoch, |h| h.old_start == 0 && h.old_lines == 0);
        let new_null = matches!(s.plus, Some(None))
            || epoch_missing(s.plus_epoch, |h| h.new_start == 0 && h.new_lines == 0);
        if old_null && new_null {
            return Err(bad("both file names are /dev/null"));
        }
        let create = s.created || old_null;
        let delete = s.deleted || new_null;
        if create && delete {
            return Err(bad("file is both created and deleted"));
        }
        let minus = s.minus.clone().flatten().or_else(|| s.git_old.clone());
        let plus = s.plus.clone().flatten().or_else(|| s.git_new.clone());
        let missing = || bad("cannot determine the file name");
        let (kind, old_path, new_path) = if s.rename_from.is_some() || s.rename_to.is_some() {
            if create || delete {
                return Err(bad("rename of a created or deleted file"));
            }
            let (Some(from), Some(to)) = (&s.rename_from, &s.rename_to) else {
                return Err(bad("rename needs both rename from and rename to"));
            };
            (
                FileChangeKind::Rename,
                Some(resolve_path(from, false)?),
                Some(resolve_path(to, false)?),
            )
        } else if create {
            let new = plus.ok_or_else(missing)?;
            (
                FileChangeKind::Create,
                None,
                Some(resolve_path(&new, true)?),
            )
        } else if delete {
            let old = minus.ok_or_else(missing)?;
            (
                FileChangeKind::Delete,
                Some(resolve_path(&old, true)?),
                None,
            )
        } else {
            let old = resolve_path(&minus.ok_or_else(missing)?, true)?;
            let new = resolve_path(&plus.ok_or_else(missing)?, true)?;
            let path = if old == new {
                old
            } else if s.git {
                return Err(bad(&format!(
                    "old and new file names differ without rename headers: {old} and {new}"
                )));
            } else {
                best_name(old, new)
            };
            (FileChangeKind::Modify, Some(path.clone()), Some(path))
        };
        let fp = FilePatch {
            old_path,
            new_path,
            kind,
            new_mode: s.new_mode,
            old_mode: s.old_mode,
            hunks,
        };
        for mode in [fp.old_mode, fp.new_mode].into_iter().flatten() {
            let what = match mode & 0o170000 {
                0 | 0o100000 => continue,
                0o120000 => format!("symlink (mode {mode:o})"),
                0o160000 => format!("submodule (mode {mode:o})"),
                _ => format!("file mode {mode:o}"),
            };
            return Err(PatchError::Unsupported {
                file_index,
                path: fp.display_path().to_string(),
                what,
            });
        }
        self.files.push(fp);
        Ok(())
    }
}

/// Recognises `Binary files X and Y differ` and returns a name for messages.
fn binary_files_line(l: &str) -> Option<String> {
    let inner = l.strip_prefix("Binary files ")?.strip_suffix(" differ")?;
    let name = match inner.split_once(" and ") {
        Some((a, "/dev/null")) => a,
        Some((_, b)) => b,
        None => inner,
    };
    let name = unquote(name).map_or_else(|| name.to_string(), |(n, _)| n);
    Some(strip_ab(&name).to_string())
}

/// After a complete hunk: does the next line look like one more body line?
fn looks_like_extra_hunk_line(raw: &str, next: Option<&str>) -> bool {
    match raw.as_bytes().first() {
        Some(b' ') | Some(b'+') => true,
        Some(b'-') => {
            let l = trim_eol(raw);
            let signature = l == "--" || l == "-- ";
            let next_header = l.starts_with("--- ") && next.is_some_and(|n| n.starts_with("+++ "));
            !signature && !next_header
        }
        _ => false,
    }
}

/// Counts the old/new lines a hunk body really has, for count mismatch messages.
fn count_body(lines: &[&str], start: usize) -> (usize, usize) {
    let (mut old, mut new, mut pending_empty) = (0usize, 0usize, 0usize);
    let mut i = start;
    while let Some(raw) = lines.get(i) {
        let l = trim_eol(raw);
        let next_header =
            l.starts_with("--- ") && lines.get(i + 1).is_some_and(|n| n.starts_with("+++ "));
        if l.starts_with("@@") || l.starts_with("diff --git ") || next_header {
            break;
        }
        match raw.as_bytes().first() {
            Some(b' ') => {
                old += 1 + pending_empty;
                new += 1 + pending_empty;
                pending_empty = 0;
            }
            Some(b'-') => {
                if l == "--" || l == "-- " {
                    break;
                }
                old += 1 + pending_empty;
                new += pending_empty;
                pending_empty = 0;
            }
            Some(b'+') => {
                old += pending_empty;
                new += 1 + pending_empty;
                pending_empty = 0;
            }
            Some(b'\\') => {}
            _ if l.is_empty() => pending_empty += 1,
            _ => break,
        }
        i += 1;
    }
    (old, new)
}
