//! The import graph between the files of a crate, and its cycles.
//!
//! A crate's module tree is read from its roots (`lib.rs`, `main.rs`) by following `mod`
//! declarations (test modules left out). Every path of a file's code that starts with
//! `crate::`, `super::` or `self::` (in a `use` tree, braces expanded, or inline) is
//! resolved to a module path. A module's own file may name its children (it declares and
//! re-exports them) and a child may name its ancestors' items: that is the tree, not a
//! cycle. An import edge joins two siblings: where the importing file's module path and
//! the imported path part, the two child modules of their common ancestor (each with all
//! its files and submodules). A cycle is a set of siblings that reach each other.
//!
//! Comments and the contents of string and character literals are blanked before any of
//! this, so a doc link or a message never counts as an import.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// `text` with comments removed and string and character literals emptied (`""`, `' '`),
/// line breaks kept.
pub fn code_only(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    while i < c.len() {
        match c[i] {
            '/' if c.get(i + 1) == Some(&'/') => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
            }
            '/' if c.get(i + 1) == Some(&'*') => {
                let mut depth = 0;
                while i < c.len() {
                    if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                        depth += 1;
                        i += 2;
                    } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        if c[i] == '\n' {
                            out.push('\n');
                        }
                        i += 1;
                    }
                }
            }
            'r' if !(i > 0 && ident(c[i - 1])) && matches!(c.get(i + 1), Some('"') | Some('#')) => {
                // A raw string: r"…", r#"…"#, …
                let mut j = i + 1;
                let mut hashes = 0;
                while c.get(j) == Some(&'#') {
                    hashes += 1;
                    j += 1;
                }
                if c.get(j) != Some(&'"') {
                    out.push('r');
                    i += 1;
                    continue;
                }
                j += 1;
                loop {
                    match c.get(j) {
                        None => break,
                        Some('"') if (1..=hashes).all(|k| c.get(j + k) == Some(&'#')) => {
                            j += 1 + hashes;
                            break;
                        }
                        Some('\n') => out.push('\n'),
                        _ => {}
                    }
                    j += 1;
                }
                out.push_str("\"\"");
                i = j;
            }
            '"' => {
                i += 1;
                while i < c.len() && c[i] != '"' {
                    if c[i] == '\\' {
                        i += 1;
                    } else if c[i] == '\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
                out.push_str("\"\"");
                i += 1;
            }
            '\'' => {
                // A character literal ('x', '\n', '\u{1F600}') or a lifetime ('a).
                if c.get(i + 1) == Some(&'\\') {
                    let mut j = i + 2;
                    while j < c.len() && c[j] != '\'' {
                        j += 1;
                    }
                    out.push_str("' '");
                    i = j + 1;
                } else if c.get(i + 2) == Some(&'\'') {
                    out.push_str("' '");
                    i += 3;
                } else {
                    out.push('\'');
                    i += 1;
                }
            }
            ch => {
                out.push(ch);
                i += 1;
            }
        }
    }
    out
}

/// `code` (from [`code_only`]) without its `#[cfg(test)]` inline modules: a file's unit
/// tests may reach anything, they are not part of what the crate builds on.
pub fn without_test_modules(code: &str) -> String {
    let mut out = code.to_string();
    while let Some(at) = out.find("#[cfg(test)]") {
        let rest = &out[at + "#[cfg(test)]".len()..];
        let trimmed = rest.trim_start();
        let is_inline_mod = trimmed
            .strip_prefix("pub ")
            .unwrap_or(trimmed)
            .starts_with("mod ")
            && trimmed
                .find('{')
                .is_some_and(|b| trimmed.find(';').is_none_or(|s| b < s));
        let end = if is_inline_mod {
            let open = at
                + "#[cfg(test)]".len()
                + (rest.len() - trimmed.len())
                + trimmed.find('{').unwrap_or(0);
            let mut depth = 0usize;
            let mut end = out.len();
            for (k, ch) in out[open..].char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = open + k + 1;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            end
        } else {
            // An attribute on one item (`#[cfg(test)] mod tests;`, a helper): drop the
            // attribute only; a test-only file module is skipped by the tree.
            at + "#[cfg(test)]".len()
        };
        out.replace_range(at..end, "");
    }
    out
}

/// One file of a crate's module tree.
#[derive(Debug)]
pub struct File {
    /// Relative to the workspace root.
    pub path: String,
    /// Its module path from the crate root (`["llm", "contract", "patch"]`).
    pub module: Vec<String>,
    /// Its code without comments, literals and test modules.
    pub code: String,
}

/// `mod name;` declarations of `code` (file modules; inline ones have a body).
fn file_modules(code: &str) -> Vec<String> {
    code.split(';')
        .filter_map(|stmt| {
            let words: Vec<&str> = stmt.split_whitespace().collect();
            let k = words.iter().rposition(|w| *w == "mod")?;
            let name = *words.get(k + 1)?;
            let before_ok = words[..k]
                .iter()
                .all(|w| w.starts_with("pub") || w.starts_with("#[") || w.ends_with(']'));
            (k + 2 == words.len()
                && before_ok
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !stmt.contains('{')
                && !stmt.contains('}'))
            .then(|| name.to_string())
        })
        .collect()
}

/// The files of the module tree rooted at `root` (`lib.rs` or `main.rs`), test modules
/// (`mod tests;`) left out.
pub fn module_tree(workspace: &Path, root: &Path) -> Vec<File> {
    fn walk(
        workspace: &Path,
        file: PathBuf,
        dir: PathBuf,
        module: Vec<String>,
        out: &mut Vec<File>,
    ) {
        let text = fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let code = without_test_modules(&code_only(&text));
        for child in file_modules(&code).into_iter().filter(|m| m != "tests") {
            let mut path = module.clone();
            path.push(child.clone());
            let flat = dir.join(format!("{child}.rs"));
            let nested = dir.join(&child).join("mod.rs");
            if flat.is_file() {
                walk(workspace, flat, dir.join(&child), path, out);
            } else if nested.is_file() {
                walk(workspace, nested, dir.join(&child), path, out);
            } else {
                panic!(
                    "{}: mod {child}: neither {} nor {}",
                    file.display(),
                    flat.display(),
                    nested.display()
                );
            }
        }
        let rel = file
            .strip_prefix(workspace)
            .unwrap_or(&file)
            .display()
            .to_string();
        out.push(File {
            path: rel,
            module,
            code,
        });
    }
    let mut out = Vec::new();
    let dir = root.parent().expect("a root in a directory").to_path_buf();
    walk(workspace, root.to_path_buf(), dir, Vec::new(), &mut out);
    out
}

/// Expands one `use` tree (`super::{a::X, b::{self, Y}}`) into its paths.
pub fn expand_use(tree: &str) -> Vec<Vec<String>> {
    fn split_top(s: &str) -> Vec<&str> {
        let (mut depth, mut start, mut parts) = (0, 0, Vec::new());
        for (i, ch) in s.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&s[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&s[start..]);
        parts
            .into_iter()
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .collect()
    }
    fn walk(prefix: &[String], tree: &str, out: &mut Vec<Vec<String>>) {
        let tree = tree.trim();
        if let Some(open) = tree.find('{') {
            let head = tree[..open].trim().trim_end_matches("::");
            let inner = tree[open + 1..tree.rfind('}').unwrap_or(tree.len())].trim();
            let mut p = prefix.to_vec();
            p.extend(
                head.split("::")
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(String::from),
            );
            for part in split_top(inner) {
                walk(&p, part, out);
            }
        } else {
            let path = tree.split(" as ").next().unwrap_or(tree);
            let mut p = prefix.to_vec();
            p.extend(
                path.split("::")
                    .map(str::trim)
                    .filter(|s| !s.is_empty() && *s != "*")
                    .map(String::from),
            );
            if p.last().is_some_and(|s| s == "self") && p.len() > 1 {
                p.pop();
            }
            out.push(p);
        }
    }
    let mut out = Vec::new();
    walk(&[], tree, &mut out);
    out
}

/// Every path of `code` that starts with `crate`, `super` or `self`, as written (the
/// `use` trees expanded).
pub fn relative_paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = String::new();
    // `use` statements first (their braces), then the paths inline in the rest.
    let mut cursor = 0;
    let bytes = code.as_bytes();
    while let Some(found) = code[cursor..].find("use ") {
        let at = cursor + found;
        let starts_word =
            at == 0 || !(bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_');
        let Some(end) = code[at..].find(';').map(|e| at + e) else {
            break;
        };
        rest.push_str(&code[cursor..at]);
        if starts_word {
            out.extend(expand_use(&code[at + 4..end]));
            cursor = end + 1;
        } else {
            rest.push_str("use ");
            cursor = at + 4;
        }
    }
    rest.push_str(&code[cursor..]);
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    for start in ["crate::", "super::", "self::"] {
        for (i, _) in rest.match_indices(start) {
            let before = rest[..i].chars().next_back();
            if before.is_some_and(|c| is_ident(c) || c == '$' || c == ':') {
                continue;
            }
            let mut path = Vec::new();
            let mut tail = &rest[i..];
            loop {
                let seg: String = tail.chars().take_while(|c| is_ident(*c)).collect();
                if seg.is_empty() {
                    break;
                }
                tail = &tail[seg.len()..];
                path.push(seg);
                match tail.strip_prefix("::") {
                    Some(t) => tail = t,
                    None => break,
                }
            }
            out.push(path);
        }
    }
    out.retain(|p| {
        p.first()
            .is_some_and(|s| ["crate", "super", "self"].contains(&s.as_str()))
    });
    out
}

/// `path` (as written in the file of module `module`) from the crate root.
pub fn resolve(module: &[String], path: &[String]) -> Option<Vec<String>> {
    let mut at: Vec<String>;
    let mut segs = path.iter().peekable();
    match segs.peek().map(|s| s.as_str()) {
        Some("crate") => {
            segs.next();
            at = Vec::new();
        }
        Some("self") => {
            segs.next();
            at = module.to_vec();
        }
        Some("super") => {
            at = module.to_vec();
            while segs.peek().is_some_and(|s| *s == "super") {
                segs.next();
                at.pop()?;
            }
        }
        _ => return None,
    }
    at.extend(segs.cloned());
    Some(at)
}

/// An import edge between two sibling modules under `parent`, with the file and path
/// that make it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Edge {
    pub parent: Vec<String>,
    pub from: String,
    pub to: String,
    pub witness: String,
}

/// The sibling edges of one crate's files.
pub fn sibling_edges(files: &[File]) -> Vec<Edge> {
    let modules: BTreeSet<&[String]> = files.iter().map(|f| f.module.as_slice()).collect();
    let mut edges = BTreeSet::new();
    for f in files {
        for written in relative_paths(&f.code) {
            let Some(target) = resolve(&f.module, &written) else {
                continue;
            };
            let common = f
                .module
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            if common >= f.module.len() || common >= target.len() {
                continue; // a descendant or an ancestor
            }
            if !modules.contains(&target[..=common]) {
                continue; // an item of the common ancestor's own file
            }
            edges.insert(Edge {
                parent: f.module[..common].to_vec(),
                from: f.module[common].clone(),
                to: target[common].clone(),
                witness: format!("{} names {}", f.path, written.join("::")),
            });
        }
    }
    edges.into_iter().collect()
}

/// The cycles among `edges`: each a strongly connected set of two or more siblings,
/// written `parent: a <-> b (witness; witness)`.
pub fn cycles(edges: &[Edge]) -> Vec<String> {
    let mut by_parent: BTreeMap<&[String], Vec<&Edge>> = BTreeMap::new();
    for e in edges {
        by_parent.entry(&e.parent).or_default().push(e);
    }
    let mut out = Vec::new();
    for (parent, es) in by_parent {
        let nodes: BTreeSet<&str> = es
            .iter()
            .flat_map(|e| [e.from.as_str(), e.to.as_str()])
            .collect();
        let reached: BTreeMap<&str, BTreeSet<&str>> =
            nodes.iter().map(|n| (*n, reach(&es, n))).collect();
        let mut done = BTreeSet::new();
        for n in &nodes {
            if done.contains(n) {
                continue;
            }
            let scc: BTreeSet<&str> = nodes
                .iter()
                .copied()
                .filter(|m| reached[n].contains(m) && reached[m].contains(n))
                .collect();
            done.extend(scc.iter().copied());
            if scc.len() < 2 {
                continue;
            }
            let mut witnesses: Vec<&str> = es
                .iter()
                .filter(|e| scc.contains(e.from.as_str()) && scc.contains(e.to.as_str()))
                .map(|e| e.witness.as_str())
                .collect();
            witnesses.dedup();
            let name = if parent.is_empty() {
                "crate".to_string()
            } else {
                format!("crate::{}", parent.join("::"))
            };
            let members: Vec<&str> = scc.into_iter().collect();
            out.push(format!(
                "{name}: {} ({})",
                members.join(" <-> "),
                witnesses.join("; ")
            ));
        }
    }
    out
}

/// The siblings `from` reaches over `edges`, itself included.
fn reach<'a>(edges: &[&'a Edge], from: &'a str) -> BTreeSet<&'a str> {
    let mut seen = BTreeSet::from([from]);
    let mut todo = vec![from];
    while let Some(n) = todo.pop() {
        for e in edges.iter().filter(|e| e.from == n) {
            if seen.insert(e.to.as_str()) {
                todo.push(&e.to);
            }
        }
    }
    seen
}
