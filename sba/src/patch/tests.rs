//! Unit tests for the patch engine.

use super::*;

/// Parses a single-file patch and applies it to `original`.
fn apply_one(diff: &str, original: &str) -> Result<String, PatchError> {
    let files = parse_patch(diff)?;
    assert_eq!(files.len(), 1, "expected exactly one file in {files:?}");
    let out = apply_hunks(0, files[0].display_path(), original.as_bytes(), &files[0])?;
    Ok(String::from_utf8(out).unwrap())
}

fn line(kind: LineKind, content: &str) -> HunkLine {
    HunkLine {
        kind,
        content: content.to_string(),
    }
}

fn numbered(n: usize) -> String {
    (1..=n).map(|i| format!("line {i}\n")).collect()
}

#[test]
fn simple_modify() {
    let diff = "\
diff --git a/src/lib.rs b/src/lib.rs
index 3b18e51..a042389 100644
--- a/src/lib.rs
+++ b/src/lib.rs
@@ -1,3 +1,3 @@
 fn a() {}
-fn b() {}
+fn b() { println!(\"b\"); }
 fn c() {}
";
    let files = parse_patch(diff).unwrap();
    assert_eq!(
        files,
        vec![FilePatch {
            old_path: Some("src/lib.rs".into()),
            new_path: Some("src/lib.rs".into()),
            kind: FileChangeKind::Modify,
            new_mode: None,
            old_mode: None,
            hunks: vec![Hunk {
                old_start: 1,
                old_lines: 3,
                new_start: 1,
                new_lines: 3,
                header: "@@ -1,3 +1,3 @@".into(),
                lines: vec![
                    line(LineKind::Context, "fn a() {}\n"),
                    line(LineKind::Remove, "fn b() {}\n"),
                    line(LineKind::Add, "fn b() { println!(\"b\"); }\n"),
                    line(LineKind::Context, "fn c() {}\n"),
                ],
            }],
        }]
    );
    assert_eq!(
        apply_one(diff, "fn a() {}\nfn b() {}\nfn c() {}\n").unwrap(),
        "fn a() {}\nfn b() { println!(\"b\"); }\nfn c() {}\n"
    );
}

#[test]
fn multiple_hunks_with_offsets() {
    // The first hunk adds two lines; the second hunk's numbers refer to the old file.
    let diff = "\
--- a/f.txt
+++ b/f.txt
@@ -1,3 +1,5 @@
 line 1
+new a
+new b
 line 2
 line 3
@@ -8,3 +10,2 @@
 line 8
-line 9
 line 10
";
    let expected = "line 1\nnew a\nnew b\nline 2\nline 3\nline 4\nline 5\nline 6\nline 7\n\
line 8\nline 10\nline 11\nline 12\n";
    assert_eq!(apply_one(diff, &numbered(12)).unwrap(), expected);
}

#[test]
fn hunk_found_at_shifted_position() {
    let diff = "\
--- a/f.txt
+++ b/f.txt
@@ -5,3 +5,3 @@
 line 5
-line 6
+LINE SIX
 line 7
";
    // Three extra lines at the top: the hunk is found 3 lines further down.
    let shifted_down = format!("x\ny\nz\n{}", numbered(10));
    assert_eq!(
        apply_one(diff, &shifted_down).unwrap(),
        format!(
            "x\ny\nz\n{}",
            numbered(10).replace("line 6\n", "LINE SIX\n")
        )
    );
    // Two lines fewer at the top: the hunk is found 2 lines further up.
    let shifted_up: String = numbered(10)
        .lines()
        .skip(2)
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(
        apply_one(diff, &shifted_up).unwrap(),
        "line 3\nline 4\nline 5\nLINE SIX\nline 7\nline 8\nline 9\nline 10\n"
    );
}

#[test]
fn offset_of_previous_hunk_carries_over() {
    // Both hunks are 2 lines off; the second is found at the first's offset directly.
    let diff = "\
--- a/f.txt
+++ b/f.txt
@@ -2,1 +2,1 @@
-line 2
+LINE 2
@@ -9 +9 @@
-line 9
+LINE 9
";
    let original = format!("top 1\ntop 2\n{}", numbered(10));
    assert_eq!(
        apply_one(diff, &original).unwrap(),
        format!(
            "top 1\ntop 2\n{}",
            numbered(10)
                .replace("line 2\n", "LINE 2\n")
                .replace("line 9\n", "LINE 9\n")
        )
    );
}

#[test]
fn create_file() {
    let diff = "\
diff --git a/docs/new.md b/docs/new.md
new file mode 100644
index 0000000..e69de29
--- /dev/null
+++ b/docs/new.md
@@ -0,0 +1,2 @@
+# Title
+text
";
    let files = parse_patch(diff).unwrap();
    assert_eq!(files[0].kind, FileChangeKind::Create);
    assert_eq!(files[0].old_path, None);
    assert_eq!(files[0].new_path.as_deref(), Some("docs/new.md"));
    assert_eq!(files[0].new_mode, Some(0o100644));
    assert_eq!(apply_one(diff, "").unwrap(), "# Title\ntext\n");
    assert_eq!(
        apply_one(diff, "already here\n").unwrap_err(),
        PatchError::CreateTargetNotEmpty {
            file_index: 0,
            path: "docs/new.md".into()
        }
    );
}

#[test]
fn create_empty_file_without_hunks() {
    let diff = "\
diff --git a/empty b/empty
new file mode 100755
index 0000000..e69de29
";
    let files = parse_patch(diff).unwrap();
    assert_eq!(
        files,
        vec![FilePatch {
            old_path: None,
            new_path: Some("empty".into()),
            kind: FileChangeKind::Create,
            new_mode: Some(0o100755),
            old_mode: None,
            hunks: vec![],
        }]
    );
    assert_eq!(apply_hunks(0, "empty", b"", &files[0]).unwrap(), b"");
}

#[test]
fn delete_file() {
    let diff = "\
diff --git a/old.sh b/old.sh
deleted file mode 100755
index 1234567..0000000
--- a/old.sh
+++ /dev/null
@@ -1,2 +0,0 @@
-#!/bin/sh
-echo hi
";
    let files = parse_patch(diff).unwrap();
    assert_eq!(files[0].kind, FileChangeKind::Delete);
    assert_eq!(files[0].old_path.as_deref(), Some("old.sh"));
    assert_eq!(files[0].new_path, None);
    assert_eq!(files[0].old_mode, Some(0o100755));
    assert_eq!(apply_one(diff, "#!/bin/sh\necho hi\n").unwrap(), "");
    assert_eq!(
        apply_one(diff, "#!/bin/sh\necho hi\nmore\n").unwrap_err(),
        PatchError::DeleteNotEmpty {
            file_index: 0,
            path: "old.sh".into(),
            remaining_bytes: 5
        }
    );
}

#[test]
fn mode_change_only() {
    let diff = "\
diff --git a/run.sh b/run.sh
old mode 100644
new mode 100755
diff --git a/b.txt b/b.txt
index 1111111..2222222 100644
--- a/b.txt
+++ b/b.txt
@@ -1 +1 @@
-b
+B
";
    let files = parse_patch(diff).unwrap();
    assert_eq!(files.len(), 2);
    assert_eq!(
        files[0],
        FilePatch {
            old_path: Some("run.sh".into()),
            new_path: Some("run.sh".into()),
            kind: FileChangeKind::Modify,
            new_mode: Some(0o100755),
            old_mode: Some(0o100644),
            hunks: vec![],
        }
    );
    assert_eq!(
        apply_hunks(0, "run.sh", b"echo\n", &files[0]).unwrap(),
        b"echo\n"
    );
    assert_eq!(apply_hunks(1, "b.txt", b"b\n", &files[1]).unwrap(), b"B\n");
}

#[test]
fn rename_without_edits() {
    let diff = "\
diff --git a/old/name.rs b/new/name.rs
similarity index 100%
rename from old/name.rs
rename to new/name.rs
";
    let files = parse_patch(diff).unwrap();
    assert_eq!(
        files,
        vec![FilePatch {
            old_path: Some("old/name.rs".into()),
            new_path: Some("new/name.rs".into()),
            kind: FileChangeKind::Rename,
            new_mode: None,
            old_mode: None,
            hunks: vec![],
        }]
    );
    assert_eq!(
        apply_hunks(0, "new/name.rs", b"x\n", &files[0]).unwrap(),
        b"x\n"
    );
}

#[test]
fn rename_with_edits() {
    let diff = "\
diff --git a/a.txt b/b/c.txt
similarity index 80%
rename from a.txt
rename to b/c.txt
index 1111111..2222222 100644
--- a/a.txt
+++ b/b/c.txt
@@ -1,3 +1,3 @@
 one
-two
+2
 three
";
    let files = parse_patch(diff).unwrap();
    assert_eq!(files[0].kind, FileChangeKind::Rename);
    assert_eq!(files[0].old_path.as_deref(), Some("a.txt"));
    // `rename to` paths carry no a/ b/ prefix, so `b/c.txt` stays as it is.
    assert_eq!(files[0].new_path.as_deref(), Some("b/c.txt"));
    assert_eq!(
        apply_one(diff, "one\ntwo\nthree\n").unwrap(),
        "one\n2\nthree\n"
    );
}

#[test]
fn no_newline_removed_at_end() {
    // Old file ends with a newline, new file does not.
    let diff = "\
--- a/f
+++ b/f
@@ -1,2 +1,2 @@
 a
-b
+b
\\ No newline at end of file
";
    assert_eq!(apply_one(diff, "a\nb\n").unwrap(), "a\nb");
}

#[test]
fn no_newline_added_at_end() {
    // Old file lacks the final newline, new file has it and one more line.
    let diff = "\
--- a/f
+++ b/f
@@ -1,2 +1,3 @@
 a
-b
\\ No newline at end of file
+b
+c
";
    assert_eq!(apply_one(diff, "a\nb").unwrap(), "a\nb\nc\n");
    // The hunk's old side ends without newline, so it cannot match "b\n".
    assert_eq!(
        apply_one(diff, "a\nb\n").unwrap_err().to_string(),
        "file 1 (f), hunk 1 (@@ -1,2 +1,3 @@): context mismatch at line 2: \
         expected \"b\", found \"b\""
    );
}

#[test]
fn no_newline_on_both_sides() {
    let diff = "\
--- a/f
+++ b/f
@@ -1,2 +1,2 @@
-a
+A
 b
\\ No newline at end of file
";
    assert_eq!(apply_one(diff, "a\nb").unwrap(), "A\nb");
}

#[test]
fn new_side_without_newline_must_end_at_eof() {
    let diff = "\
--- a/f
+++ b/f
@@ -1 +1 @@
-a
+a
\\ No newline at end of file
";
    assert_eq!(
        apply_one(diff, "a\nb\n").unwrap_err().to_string(),
        "file 1 (f), hunk 1 (@@ -1 +1 @@): hunk ends without a newline at end of file but \
         does not match at end of file"
    );
}

#[test]
fn crlf_lines_preserved() {
    let diff =
        "--- a/win.txt\r\n+++ b/win.txt\r\n@@ -1,3 +1,3 @@\r\n one\r\n-two\r\n+TWO\r\n three\r\n";
    let files = parse_patch(diff).unwrap();
    assert_eq!(files[0].new_path.as_deref(), Some("win.txt"));
    assert_eq!(files[0].hunks[0].header, "@@ -1,3 +1,3 @@");
    assert_eq!(
        apply_one(diff, "one\r\ntwo\r\nthree\r\nfour\r\n").unwrap(),
        "one\r\nTWO\r\nthree\r\nfour\r\n"
    );
    // LF hunk lines do not match CRLF file lines.
    let lf = "--- a/win.txt\n+++ b/win.txt\n@@ -1,1 +1,1 @@\n-one\n+ONE\n";
    assert_eq!(
        apply_one(lf, "one\r\n").unwrap_err().to_string(),
        "file 1 (win.txt), hunk 1 (@@ -1,1 +1,1 @@): context mismatch at line 1: \
         expected \"one\", found \"one\\r\""
    );
}

#[test]
fn context_mismatch_names_file_and_hunk() {
    let diff = "\
diff --git a/x.txt b/x.txt
--- a/x.txt
+++ b/x.txt
@@ -1 +1 @@
-a
+A
diff --git a/src/y.rs b/src/y.rs
--- a/src/y.rs
+++ b/src/y.rs
@@ -1,2 +1,2 @@ fn main() {
 keep
-old
+new
@@ -5,3 +5,3 @@ fn other() {
 five
-six
+SIX
 seven
";
    let files = parse_patch(diff).unwrap();
    let original = "keep\nold\n3\n4\nfive\nsix?\nseven\n";
    let err = apply_hunks(1, "src/y.rs", original.as_bytes(), &files[1]).unwrap_err();
    assert_eq!(
        err,
        PatchError::HunkFailed {
            file_index: 1,
            path: "src/y.rs".into(),
            hunk: 2,
            header: "@@ -5,3 +5,3 @@ fn other() {".into(),
            reason: HunkFailure::ContextMismatch {
                line: 6,
                expected: "six".into(),
                found: "six?".into()
            },
        }
    );
    assert_eq!(
        err.to_string(),
        "file 2 (src/y.rs), hunk 2 (@@ -5,3 +5,3 @@ fn other() {): context mismatch at line 6: \
         expected \"six\", found \"six?\""
    );
}

#[test]
fn file_ends_before_hunk() {
    let diff = "--- a/f\n+++ b/f\n@@ -3,2 +3,2 @@\n c\n-d\n+D\n";
    assert_eq!(
        apply_one(diff, "a\nb\nc\n").unwrap_err(),
        PatchError::HunkFailed {
            file_index: 0,
            path: "f".into(),
            hunk: 1,
            header: "@@ -3,2 +3,2 @@".into(),
            reason: HunkFailure::FileEndsBeforeHunk {
                line: 4,
                file_lines: 3
            },
        }
    );
    assert_eq!(
        apply_one(diff, "a\nb\nc\n").unwrap_err().to_string(),
        "file 1 (f), hunk 1 (@@ -3,2 +3,2 @@): file ends before hunk: hunk needs line 4 but \
         file has 3 lines"
    );
}

#[test]
fn overlapping_hunks_rejected() {
    // The second hunk needs "b" which the first hunk already consumed.
    let diff = "\
--- a/f
+++ b/f
@@ -1,2 +1,2 @@
 a
-b
+B
@@ -2,2 +2,2 @@
 b
-c
+C
";
    assert_eq!(
        apply_one(diff, "a\nb\nc\nd\n").unwrap_err().to_string(),
        "file 1 (f), hunk 2 (@@ -2,2 +2,2 @@): hunk overlaps previous hunk"
    );
}

#[test]
fn hunks_out_of_order_rejected() {
    let diff = "\
--- a/f
+++ b/f
@@ -4 +4 @@
-line 4
+LINE 4
@@ -2 +2 @@
-line 2
+LINE 2
";
    assert_eq!(
        apply_one(diff, &numbered(5)).unwrap_err(),
        PatchError::HunkFailed {
            file_index: 0,
            path: "f".into(),
            hunk: 2,
            header: "@@ -2 +2 @@".into(),
            reason: HunkFailure::OverlapsPreviousHunk,
        }
    );
}

#[test]
fn binary_patches_refused() {
    let git_binary = "\
diff --git a/img.png b/img.png
index 1111111..2222222 100644
GIT binary patch
literal 5
McmZ?wbhEdP0009a1^@s6
";
    assert_eq!(
        parse_patch(git_binary).unwrap_err(),
        PatchError::Binary {
            file_index: 0,
            path: "img.png".into()
        }
    );
    let differ = "\
diff --git a/x b/x
--- a/x
+++ b/x
@@ -1 +1 @@
-x
+y
diff --git a/logo.bin b/logo.bin
index 1111111..2222222 100644
Binary files a/logo.bin and b/logo.bin differ
";
    assert_eq!(
        parse_patch(differ).unwrap_err().to_string(),
        "file 2 (logo.bin): binary patches are not supported"
    );
    assert_eq!(
        parse_patch("Binary files old/a.bin and new/a.bin differ\n").unwrap_err(),
        PatchError::Binary {
            file_index: 0,
            path: "new/a.bin".into()
        }
    );
}

#[test]
fn path_escapes_rejected() {
    let cases = [
        ("--- a/../x\n+++ b/../x\n@@ -1 +1 @@\n-a\n+b\n", "a/../x"),
        ("--- ../x\n+++ ../x\n@@ -1 +1 @@\n-a\n+b\n", "../x"),
        (
            "--- /etc/passwd\n+++ /etc/passwd\n@@ -1 +1 @@\n-a\n+b\n",
            "/etc/passwd",
        ),
        (
            "--- a/../../x\n+++ b/../../x\n@@ -1 +1 @@\n-a\n+b\n",
            "a/../../x",
        ),
        (
            "--- a/src/../../x\n+++ b/src/../../x\n@@ -1 +1 @@\n-a\n+b\n",
            "a/src/../../x",
        ),
        ("--- /dev/null\n+++ b/\n@@ -0,0 +1 @@\n+b\n", "b/"),
        ("--- /dev/null\n+++ b/x\0y\n@@ -0,0 +1 @@\n+b\n", "b/x\0y"),
        (
            "diff --git a/x b/x\nrename from x\nrename to ../../y\n",
            "../../y",
        ),
        (
            "diff --git a/x b/x\nrename from /abs\nrename to y\n",
            "/abs",
        ),
        (
            "diff --git \"a/..\" \"b/..\"\nnew file mode 100644\n",
            "b/..",
        ),
    ];
    for (diff, path) in cases {
        let err = parse_patch(diff).unwrap_err();
        assert_eq!(
            err,
            PatchError::PathEscape { path: path.into() },
            "{diff:?}"
        );
    }
    assert_eq!(
        parse_patch(cases[2].0).unwrap_err().to_string(),
        "path escapes workspace: /etc/passwd"
    );
    // `..` inside a name is fine.
    let ok = parse_patch("--- a/x..y\n+++ b/x..y\n@@ -1 +1 @@\n-a\n+b\n").unwrap();
    assert_eq!(ok[0].new_path.as_deref(), Some("x..y"));
}

#[test]
fn malformed_hunk_header() {
    let diff = "\
diff --git a/f b/f
--- a/f
+++ b/f
@@ -1,2 +1,2 @@
 a
-b
+c
@@ -x,1 +1 @@
-q
";
    assert_eq!(
        parse_patch(diff).unwrap_err(),
        PatchError::MalformedHunkHeader {
            file_index: 0,
            path: "f".into(),
            hunk: 2,
            line: 8,
            header: "@@ -x,1 +1 @@".into()
        }
    );
    assert_eq!(
        parse_patch(diff).unwrap_err().to_string(),
        "file 1 (f), hunk 2 (@@ -x,1 +1 @@): malformed hunk header at patch line 8"
    );
    for bad in [
        "@@",
        "@@ -1 +1",
        "@@ -1,2 +1,2@@",
        "@@ -1,2, +1,2 @@",
        "@@@ -1 -1 +1 @@@",
    ] {
        let diff = format!("--- a/f\n+++ b/f\n{bad}\n-a\n+b\n");
        assert!(
            matches!(
                parse_patch(&diff),
                Err(PatchError::MalformedHunkHeader { .. })
            ),
            "{bad}"
        );
    }
}

#[test]
fn hunk_count_mismatch() {
    // Too few lines: the header promises 3 old lines, the body has 2.
    let short = "--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n";
    assert_eq!(
        parse_patch(short).unwrap_err(),
        PatchError::HunkCountMismatch {
            file_index: 0,
            path: "f".into(),
            hunk: 1,
            line: 3,
            header: "@@ -1,3 +1,3 @@".into(),
            expected_old: 3,
            expected_new: 3,
            found_old: 2,
            found_new: 2,
        }
    );
    // Too few lines, followed by another hunk.
    let short2 = "--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n@@ -9 +9 @@\n-x\n+y\n";
    assert_eq!(
        parse_patch(short2).unwrap_err().to_string(),
        "file 1 (f), hunk 1 (@@ -1,3 +1,3 @@): hunk line count mismatch at patch line 3: \
         header says 3 old and 3 new lines, body has 2 old and 2 new lines"
    );
    // Too many lines.
    let long = "--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n a\n-b\n+B\n c\n";
    assert_eq!(
        parse_patch(long).unwrap_err().to_string(),
        "file 1 (f), hunk 1 (@@ -1,2 +1,2 @@): hunk line count mismatch at patch line 3: \
         header says 2 old and 2 new lines, body has 3 old and 3 new lines"
    );
    // An added line where the header allows no more new lines.
    let extra_add = "--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n+c\n";
    assert!(matches!(
        parse_patch(extra_add),
        Err(PatchError::HunkCountMismatch {
            found_old: 1,
            found_new: 2,
            ..
        })
    ));
}

#[test]
fn counts_omitted_mean_one() {
    let diff = "--- a/f\n+++ b/f\n@@ -2 +2 @@\n-b\n+B\n";
    let files = parse_patch(diff).unwrap();
    let h = &files[0].hunks[0];
    assert_eq!(
        (h.old_start, h.old_lines, h.new_start, h.new_lines),
        (2, 1, 2, 1)
    );
    assert_eq!(apply_one(diff, "a\nb\nc\n").unwrap(), "a\nB\nc\n");
}

#[test]
fn zero_context_insertion_and_deletion() {
    // `git diff -U0` style: insert after line 2, delete line 4.
    let diff = "\
--- a/f
+++ b/f
@@ -2,0 +3 @@
+inserted
@@ -4 +4,0 @@
-line 4
";
    assert_eq!(
        apply_one(diff, &numbered(5)).unwrap(),
        "line 1\nline 2\ninserted\nline 3\nline 5\n"
    );
    // Insertion past the end of the file.
    let far = "--- a/f\n+++ b/f\n@@ -9,0 +10 @@\n+x\n";
    assert_eq!(
        apply_one(far, &numbered(3)).unwrap_err().to_string(),
        "file 1 (f), hunk 1 (@@ -9,0 +10 @@): file ends before hunk: hunk needs line 9 but \
         file has 3 lines"
    );
    // Appending after a last line without newline would glue the lines together.
    let append = "--- a/f\n+++ b/f\n@@ -1,0 +2 @@\n+x\n";
    assert_eq!(
        apply_one(append, "a").unwrap_err().to_string(),
        "file 1 (f), hunk 1 (@@ -1,0 +2 @@): cannot add lines after last line: file does not \
         end with a newline"
    );
    assert_eq!(apply_one(append, "a\n").unwrap(), "a\nx\n");
}

#[test]
fn plain_diff_u_with_timestamps() {
    let diff = "\
diff -u orig/hello.c new/hello.c
--- hello.c.orig\t2024-05-01 10:00:00.000000000 +0200
+++ hello.c\t2024-05-01 10:05:00.000000000 +0200
@@ -1,4 +1,4 @@
 #include <stdio.h>
 int main(void) {
-    printf(\"hi\\n\");
+    printf(\"hello\\n\");
 }
--- /dev/null\t1970-01-01 00:00:00.000000000 +0000
+++ notes.txt\t2024-05-01 10:05:00.000000000 +0200
@@ -0,0 +1 @@
+note
";
    let files = parse_patch(diff).unwrap();
    assert_eq!(files.len(), 2);
    // Differing plain names: the shorter base name wins (like GNU patch).
    assert_eq!(files[0].old_path.as_deref(), Some("hello.c"));
    assert_eq!(files[0].new_path.as_deref(), Some("hello.c"));
    assert_eq!(files[0].kind, FileChangeKind::Modify);
    assert_eq!(files[1].kind, FileChangeKind::Create);
    assert_eq!(files[1].new_path.as_deref(), Some("notes.txt"));
    let out = apply_hunks(
        0,
        "hello.c",
        b"#include <stdio.h>\nint main(void) {\n    printf(\"hi\\n\");\n}\n",
        &files[0],
    )
    .unwrap();
    assert_eq!(
        out,
        b"#include <stdio.h>\nint main(void) {\n    printf(\"hello\\n\");\n}\n"
    );
    assert_eq!(
        apply_hunks(1, "notes.txt", b"", &files[1]).unwrap(),
        b"note\n"
    );
}

#[test]
fn plain_diff_n_epoch_timestamps_mean_missing_file() {
    let diff = "\
diff -ruN a/new.txt b/new.txt
--- a/new.txt\t1970-01-01 00:00:00.000000000 +0000
+++ b/new.txt\t2024-05-01 10:05:00.000000000 +0200
@@ -0,0 +1,2 @@
+hello
+world
diff -ruN a/gone.txt b/gone.txt
--- a/gone.txt\t2024-05-01 10:05:00.000000000 +0200
+++ b/gone.txt\t1970-01-01 01:00:00.000000000 +0100
@@ -1 +0,0 @@
-bye
";
    let files = parse_patch(diff).unwrap();
    let summary: Vec<_> = files
        .iter()
        .map(|f| (f.kind, f.old_path.as_deref(), f.new_path.as_deref()))
        .collect();
    assert_eq!(
        summary,
        vec![
            (FileChangeKind::Create, None, Some("new.txt")),
            (FileChangeKind::Delete, Some("gone.txt"), None),
        ]
    );
    assert_eq!(
        apply_hunks(0, "new.txt", b"", &files[0]).unwrap(),
        b"hello\nworld\n"
    );
    assert_eq!(
        apply_hunks(1, "gone.txt", b"bye\n", &files[1]).unwrap(),
        b""
    );
}

#[test]
fn quoted_paths_unquoted() {
    let diff = "\
diff --git \"a/with space\" \"b/with space\"
index 1111111..2222222 100644
--- \"a/with space\"
+++ \"b/with space\"
@@ -1 +1 @@
-x
+y
diff --git \"a/tab\\there\" \"b/caf\\303\\251 \\\"q\\\"\"
similarity index 100%
rename from \"tab\\there\"
rename to \"caf\\303\\251 \\\"q\\\"\"
diff --git a/plain name.txt b/plain name.txt
old mode 100644
new mode 100755
";
    let files = parse_patch(diff).unwrap();
    assert_eq!(files.len(), 3);
    assert_eq!(files[0].new_path.as_deref(), Some("with space"));
    assert_eq!(files[0].old_path.as_deref(), Some("with space"));
    assert_eq!(files[1].kind, FileChangeKind::Rename);
    assert_eq!(files[1].old_path.as_deref(), Some("tab\there"));
    assert_eq!(files[1].new_path.as_deref(), Some("café \"q\""));
    assert_eq!(files[2].new_path.as_deref(), Some("plain name.txt"));
    assert_eq!(
        parse_patch("--- \"a/bad\\q\"\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n").unwrap_err(),
        PatchError::Malformed {
            line: 1,
            message: "invalid quoted path: \"a/bad\\q\"".into()
        }
    );
}

#[test]
fn real_git_diff_output() {
    // Literal output of `git diff` for a small multi-file change.
    let diff = "\
diff --git a/Cargo.toml b/Cargo.toml
index 5c6ef2a..0b4b1d3 100644
--- a/Cargo.toml
+++ b/Cargo.toml
@@ -1,6 +1,7 @@
 [package]
 name = \"demo\"
 version = \"0.1.0\"
 edition = \"2021\"
 
 [dependencies]
+anyhow = \"1\"
diff --git a/src/main.rs b/src/main.rs
index e7a11a9..7d3b5a5 100644
--- a/src/main.rs
+++ b/src/main.rs
@@ -1,3 +1,6 @@
-fn main() {
-    println!(\"Hello, world!\");
+use anyhow::Result;
+
+fn main() -> Result<()> {
+    println!(\"Hello, demo!\");
+    Ok(())
 }
diff --git a/src/util.rs b/src/util.rs
new file mode 100644
index 0000000..3f1c0d2
--- /dev/null
+++ b/src/util.rs
@@ -0,0 +1,3 @@
+pub fn twice(x: u32) -> u32 {
+    x * 2
+}
";
    let files = parse_patch(diff).unwrap();
    let kinds: Vec<_> = files.iter().map(|f| (f.display_path(), f.kind)).collect();
    assert_eq!(
        kinds,
        vec![
            ("Cargo.toml", FileChangeKind::Modify),
            ("src/main.rs", FileChangeKind::Modify),
            ("src/util.rs", FileChangeKind::Create),
        ]
    );
    let cargo =
        "[package]\nname = \"demo\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n[dependencies]\n";
    assert_eq!(
        apply_hunks(0, "Cargo.toml", cargo.as_bytes(), &files[0]).unwrap(),
        format!("{cargo}anyhow = \"1\"\n").into_bytes()
    );
    let main = "fn main() {\n    println!(\"Hello, world!\");\n}\n";
    assert_eq!(
        String::from_utf8(apply_hunks(1, "src/main.rs", main.as_bytes(), &files[1]).unwrap())
            .unwrap(),
        "use anyhow::Result;\n\nfn main() -> Result<()> {\n    println!(\"Hello, demo!\");\n    Ok(())\n}\n"
    );
    assert_eq!(
        apply_hunks(2, "src/util.rs", b"", &files[2]).unwrap(),
        b"pub fn twice(x: u32) -> u32 {\n    x * 2\n}\n"
    );
}

#[test]
fn format_patch_mail_is_accepted() {
    let mail = "\
From 1234567890abcdef Mon Sep 17 00:00:00 2001
From: Dev <dev@example.com>
Subject: [PATCH] tweak

Some explanation.
---
 f.txt | 2 +-
 1 file changed, 1 insertion(+), 1 deletion(-)

diff --git a/f.txt b/f.txt
index 1111111..2222222 100644
--- a/f.txt
+++ b/f.txt
@@ -1,2 +1,2 @@
-old
+new
 tail
-- 
2.43.0

";
    assert_eq!(apply_one(mail, "old\ntail\n").unwrap(), "new\ntail\n");
}

#[test]
fn stripped_empty_context_line_and_missing_final_newline() {
    // Editors often strip the lone space of an empty context line, and the patch text
    // may lack its final newline.
    let diff = "--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n a\n\n-b\n+B";
    assert_eq!(apply_one(diff, "a\n\nb\n").unwrap(), "a\n\nB\n");
}

#[test]
fn structural_errors() {
    assert_eq!(parse_patch("").unwrap_err(), PatchError::NoChanges);
    assert_eq!(
        parse_patch("just some text\n").unwrap_err().to_string(),
        "patch contains no file changes"
    );
    assert_eq!(
        parse_patch("@@ -1 +1 @@\n-a\n+b\n")
            .unwrap_err()
            .to_string(),
        "malformed patch at line 1: hunk without a file header (missing --- and +++ lines)"
    );
    assert_eq!(
        parse_patch("diff --git a/f b/f\n--- a/f\n@@ -1 +1 @@\n").unwrap_err(),
        PatchError::Malformed {
            line: 3,
            message: "--- line without a following +++ line".into()
        }
    );
    assert_eq!(
        parse_patch("--- /dev/null\n+++ /dev/null\n").unwrap_err(),
        PatchError::Malformed {
            line: 1,
            message: "both file names are /dev/null".into()
        }
    );
    assert_eq!(
        parse_patch("diff --git a/f b/f\nnew file mode 10x644\n").unwrap_err(),
        PatchError::Malformed {
            line: 2,
            message: "invalid file mode: 10x644".into()
        }
    );
    assert_eq!(
        parse_patch("--- a/f\n+++ b/f\n@@ -1 +1 @@\n\\ No newline at end of file\n-a\n+b\n")
            .unwrap_err(),
        PatchError::Malformed {
            line: 4,
            message: "\"\\ No newline at end of file\" without a preceding hunk line".into()
        }
    );
    assert_eq!(
        parse_patch("diff --git a/x b/y\n--- a/x\n+++ b/y\n@@ -1 +1 @@\n-a\n+b\n").unwrap_err(),
        PatchError::Malformed {
            line: 1,
            message: "old and new file names differ without rename headers: x and y".into()
        }
    );
}

#[test]
fn unsupported_features_refused() {
    assert_eq!(
        parse_patch("diff --git a/l b/l\nnew file mode 120000\n--- /dev/null\n+++ b/l\n@@ -0,0 +1 @@\n+/etc/passwd\n\\ No newline at end of file\n")
            .unwrap_err()
            .to_string(),
        "file 1 (l): unsupported symlink (mode 120000)"
    );
    assert_eq!(
        parse_patch("diff --git a/a b/b\nsimilarity index 100%\ncopy from a\ncopy to b\n")
            .unwrap_err(),
        PatchError::Unsupported {
            file_index: 0,
            path: "b".into(),
            what: "copy patch".into()
        }
    );
}

#[test]
fn error_trait_is_implemented() {
    let err: Box<dyn std::error::Error> = Box::new(PatchError::PathEscape {
        path: "../x".into(),
    });
    assert_eq!(err.to_string(), "path escapes workspace: ../x");
}

#[test]
fn many_files_and_hunks() {
    // 500 files x 10 hunks, every hunk shifted by lines inserted at the top.
    let mut diff = String::new();
    let mut originals = Vec::new();
    for f in 0..500 {
        diff.push_str(&format!(
            "diff --git a/d/f{f}.txt b/d/f{f}.txt\n--- a/d/f{f}.txt\n+++ b/d/f{f}.txt\n"
        ));
        for h in 0..10 {
            let at = h * 20 + 5;
            diff.push_str(&format!(
                "@@ -{},3 +{},3 @@\n line {}\n-line {}\n+LINE {}\n line {}\n",
                at - 1,
                at - 1,
                at - 1,
                at,
                at,
                at + 1
            ));
        }
        originals.push(format!("head\n{}", numbered(220)));
    }
    let files = parse_patch(&diff).unwrap();
    assert_eq!(files.len(), 500);
    for (i, (fp, orig)) in files.iter().zip(&originals).enumerate() {
        let out = apply_hunks(i, fp.display_path(), orig.as_bytes(), fp).unwrap();
        let mut expected = orig.clone();
        for h in 0..10 {
            let at = h * 20 + 5;
            expected = expected.replace(&format!("line {at}\n"), &format!("LINE {at}\n"));
        }
        assert_eq!(String::from_utf8(out).unwrap(), expected);
    }
}

/// Tiny deterministic PRNG so the robustness test needs no dependency.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

#[test]
fn never_panics_on_mutated_input() {
    let seeds = [
        "diff --git a/f b/f\nindex 1..2 100644\n--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@ x\n a\n-b\n\\ No newline at end of file\n+B\n c\n",
        "--- \"a/q\\303\"\t2020\n+++ b/q\n@@ -0,0 +1 @@\n+x\n@@ -2 +2,0 @@\n-y\n",
        "diff --git a/x b/y\nrename from x\nrename to y\nold mode 100644\nnew mode 100755\n",
        "--- a/f\r\n+++ b/f\r\n@@ -1 +1 @@\r\n-a\r\n+b\r\n",
    ];
    let alphabet: &[&str] = &[
        "\n",
        " ",
        "-",
        "+",
        "@",
        "@@ -",
        ",",
        "0",
        "1",
        "9",
        "\\",
        "\"",
        "\\3",
        "a/",
        "/",
        "..",
        "\r",
        "\t",
        "diff --git ",
        "--- ",
        "+++ ",
        "/dev/null",
        "99999999999999999999",
        "é",
    ];
    let originals: [&[u8]; 4] = [b"", b"a\nb\nc\n", b"a\r\nb", b"\n\n\n"];
    let mut rng = Lcg(42);
    for round in 0..20_000u32 {
        let seed = seeds[round as usize % seeds.len()];
        let mut s = seed.to_string();
        for _ in 0..(rng.next() % 4 + 1) {
            let mut at = (rng.next() as usize) % (s.len() + 1);
            while !s.is_char_boundary(at) {
                at -= 1;
            }
            match rng.next() % 3 {
                0 => s.insert_str(at, alphabet[rng.next() as usize % alphabet.len()]),
                1 => {
                    let mut end = (at + (rng.next() as usize % 8)).min(s.len());
                    while !s.is_char_boundary(end) {
                        end -= 1;
                    }
                    s.replace_range(at..end, "");
                }
                _ => s.truncate(at),
            }
        }
        if let Ok(files) = parse_patch(&s) {
            for (i, fp) in files.iter().enumerate() {
                for orig in originals {
                    let _ = apply_hunks(i, fp.display_path(), orig, fp);
                }
            }
        }
    }
}
