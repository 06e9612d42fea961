//! Fuzzes the unified diff engine: `parse_patch` and `apply_hunks`.
//!
//! Input layout: `<diff text> 0xFF <original file bytes>`. The diff text is everything
//! before the first 0xFF byte; 0xFF never occurs in UTF-8, so every valid diff text
//! (NUL bytes included) can be expressed, and the original file after the separator
//! may contain any bytes (0xFF included). Without a 0xFF the whole input is the diff
//! and the original file is empty. A diff part that is not UTF-8 is skipped.
//!
//! Every `FilePatch` is applied to the same original bytes. For a `Create` patch the
//! runner passes an empty original, so that is tried as well. Nothing may panic.

#![no_main]

use cynode_sba::patch::{apply_hunks, parse_patch, FileChangeKind};
use libfuzzer_sys::fuzz_target;

const SEPARATOR: u8 = 0xFF;

fuzz_target!(|data: &[u8]| {
    let (diff, original) = match data.iter().position(|&b| b == SEPARATOR) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(diff) = std::str::from_utf8(diff) else {
        return;
    };
    let patches = match parse_patch(diff) {
        Ok(p) => p,
        Err(e) => {
            // Error messages are user-facing; formatting them must not panic either.
            let _ = e.to_string();
            return;
        }
    };
    for (i, fp) in patches.iter().enumerate() {
        let path = fp.display_path();
        match apply_hunks(i, path, original, fp) {
            Ok(out) => {
                if fp.kind == FileChangeKind::Delete {
                    assert!(out.is_empty(), "a successful delete must leave no bytes");
                }
            }
            Err(e) => {
                let _ = e.to_string();
            }
        }
        if fp.kind == FileChangeKind::Create && !original.is_empty() {
            if let Err(e) = apply_hunks(i, path, &[], fp) {
                let _ = e.to_string();
            }
        }
    }
});
