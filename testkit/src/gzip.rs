//! gzip(1) as a test's compressor: what an upstream that compresses its answers sends,
//! made by the real tool rather than by the code under test's own libraries.

use std::io::Write;
use std::process::{Command, Stdio};

/// `bytes` gzip-compressed by gzip(1) (`-n`: no name or time, so the output is stable).
pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    filter(&["-c", "-n"], bytes)
}

/// `bytes` decompressed by gzip(1).
pub fn gunzip(bytes: &[u8]) -> Vec<u8> {
    filter(&["-d", "-c"], bytes)
}

fn filter(args: &[&str], input: &[u8]) -> Vec<u8> {
    let mut child = Command::new("gzip")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("gzip {args:?} did not start: {e}"));
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input)
            .unwrap_or_else(|e| panic!("gzip {args:?}: cannot write its input: {e}"));
    }
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("gzip {args:?}: {e}"));
    assert!(out.status.success(), "gzip {args:?}: {out:?}");
    out.stdout
}
