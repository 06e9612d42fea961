//! Test support shared by the crates' integration tests.
//!
//! A test that starts a process owns it: [`OwnedChild`] puts the child in a process group
//! of its own and gives it a parent-death signal, so the whole group ends when the test
//! drops it (pass or panic), and the child ends even when the test process is killed
//! outright. [`output_bounded`] runs a command to the end within a deadline the test sets,
//! and fails with its own message (what ran, how long, what it printed) instead of leaving
//! the runner's time-out to end it.
//!
//! [`LocalModel`] is the local model server as a test-owned resource, [`scripted_model`]
//! the one scripted OpenAI-compatible server of the tests, and [`TestCa`]
//! makes the certificates of the TLS tests; [`flood`] opens the stalled connections of the
//! listener tests and reads what the flooded process holds; [`mod@tar`] writes hostile
//! tar archives raw; [`mounts`] finds what a worker left mounted beneath a directory.
//! [`postgres_url`] starts the test PostgreSQL; [`gzip`] compresses as gzip(1) does.
//! [`upstream`] mirrors upstream CyNodeAI's
//! contract types with Go's JSON semantics, for the interoperability tests.
//!
//! The `cynode-reap` binary is the last line of defence in CI: it runs the test command as
//! a child subreaper and fails when anything the run started is still alive afterwards.

pub mod certs;
pub mod flood;
pub mod gzip;
pub mod model;
pub mod mounts;
pub mod postgres;
pub mod proc;
pub mod scripted_model;
pub mod tar;
pub mod upstream;

pub use certs::{CertFiles, TestCa};
pub use model::LocalModel;
pub use postgres::postgres_url;
pub use proc::{
    output_bounded, output_bounded_with_input, output_within, setup_script, OwnedChild, TimedOut,
};
pub use scripted_model::{Reply, ScriptedModel};

/// The string `field` of each item of the JSON array `list`, in order.
///
/// # Panics
/// When `list` is not an array or an item's `field` is not a string.
pub fn field_strs<'a>(list: &'a serde_json::Value, field: &str) -> Vec<&'a str> {
    let items = list
        .as_array()
        .unwrap_or_else(|| panic!("not an array: {list}"));
    items
        .iter()
        .map(|item| {
            item[field]
                .as_str()
                .unwrap_or_else(|| panic!("no string {field} in {item}"))
        })
        .collect()
}

/// Writes each (relative path, content) under `root`, creating parent directories.
///
/// # Panics
/// When a directory or file cannot be written.
pub fn write_tree(root: &std::path::Path, files: &[(&str, &str)]) {
    for (rel, content) in files {
        let path = root.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .unwrap_or_else(|e| panic!("mkdir {}: {e}", parent.display()));
        }
        std::fs::write(&path, content).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
}
