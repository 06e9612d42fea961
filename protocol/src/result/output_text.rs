//! A step result as the one text upstream CyNodeAI reads at `steps[].output`, in the
//! forms its own runner writes (agents/internal/sba/runner.go).

use super::{StepOutput, TreeNode};
use crate::result::EntryType;

/// What upstream's runner appends to output it cut.
const TRUNCATED: &str = "...[truncated]";

impl StepOutput {
    /// The step's output in upstream's form: run_command's stdout then stderr (upstream
    /// runs it with combined output; the two streams are kept apart here, so their
    /// interleaving is lost), read_file's content, list_tree's paths relative to the
    /// listed directory one a line (directories with a trailing `/`), search_files'
    /// `path:line:text` lines, apply_unified_diff's `patching file P` lines (as GNU patch
    /// prints them); empty for write_file.
    pub fn upstream_output(&self) -> String {
        match self {
            StepOutput::RunCommand(r) => {
                let mut s = String::with_capacity(r.stdout.len() + r.stderr.len());
                s.push_str(&r.stdout);
                s.push_str(&r.stderr);
                s
            }
            StepOutput::WriteFile(_) => String::new(),
            StepOutput::ReadFile(r) => r.content.clone(),
            StepOutput::ApplyUnifiedDiff(d) => d
                .files_modified
                .iter()
                .chain(&d.files_created)
                .chain(&d.files_deleted)
                .map(|p| format!("patching file {p}\n"))
                .collect(),
            StepOutput::ListTree(t) => {
                let mut s = String::new();
                list(&t.tree, "", &mut s);
                if t.truncated {
                    s.push_str(TRUNCATED);
                }
                s
            }
            StepOutput::SearchFiles(f) => {
                let mut s: String = f
                    .matches
                    .iter()
                    .map(|m| format!("{}:{}:{}\n", m.path, m.line, m.text))
                    .collect();
                if f.truncated {
                    s.push_str(TRUNCATED);
                }
                s
            }
        }
    }
}

/// The children of `node`, depth first, as `prefix/name` lines.
fn list(node: &TreeNode, prefix: &str, out: &mut String) {
    for child in &node.children {
        let path = format!("{prefix}{}", child.name);
        if child.entry_type == EntryType::Dir {
            out.push_str(&path);
            out.push_str("/\n");
            list(child, &format!("{path}/"), out);
        } else {
            out.push_str(&path);
            out.push('\n');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result::{ListTreeOutput, RunCommandOutput, SearchFilesOutput, SearchMatch};

    fn node(name: &str, entry_type: EntryType, children: Vec<TreeNode>) -> TreeNode {
        TreeNode {
            name: name.into(),
            entry_type,
            size_bytes: None,
            children,
        }
    }

    #[test]
    fn list_tree_reads_like_upstreams_walk() {
        let tree = node(
            ".",
            EntryType::Dir,
            vec![
                node("README", EntryType::File, vec![]),
                node(
                    "src",
                    EntryType::Dir,
                    vec![node("main.rs", EntryType::File, vec![])],
                ),
                node("link", EntryType::Symlink, vec![]),
            ],
        );
        let out = StepOutput::ListTree(ListTreeOutput {
            tree,
            truncated: false,
        });
        assert_eq!(out.upstream_output(), "README\nsrc/\nsrc/main.rs\nlink\n");
    }

    #[test]
    fn commands_and_searches() {
        let rc = StepOutput::RunCommand(RunCommandOutput {
            exit_code: Some(0),
            signal: None,
            stdout: "out\n".into(),
            stderr: "err\n".into(),
            duration_ms: 1,
            truncated: false,
        });
        assert_eq!(rc.upstream_output(), "out\nerr\n");
        let sf = StepOutput::SearchFiles(SearchFilesOutput {
            matches: vec![SearchMatch {
                path: "a/b.txt".into(),
                line: 3,
                text: "hello".into(),
            }],
            truncated: true,
        });
        assert_eq!(sf.upstream_output(), "a/b.txt:3:hello\n...[truncated]");
    }
}
