//! cynode-tests: tests that span the workspace's binaries, and tests about the whole
//! workspace (see ARCHITECTURE.md, "tests/"). The library holds what they share: where
//! the workspace and the built binaries are.

use std::path::PathBuf;

/// The workspace root (the directory holding ARCHITECTURE.md).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default()
}

/// The path of the workspace binary `name` (`cynode-pm`, `cynode-worker`), built into the
/// same target directory as the running test: `cargo nextest run --workspace` builds it,
/// because its own package has integration tests.
///
/// # Panics
/// When it is not built, naming the command that builds it.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("the test's own path: {e}"));
    // <target>/<profile>/deps/<test>: the binaries are in <target>/<profile>.
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(PathBuf::from)
        .unwrap_or_default();
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is not built: run the tests with `cargo nextest run --workspace`, or `cargo build --bins` first",
        path.display()
    );
    path
}
