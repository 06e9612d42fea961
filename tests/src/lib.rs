//! cynode-tests: tests that span the workspace's binaries, and tests about the whole
//! workspace (see ARCHITECTURE.md, "tests/"). The library is their one harness: where the
//! workspace, the built binaries and the test image's root filesystem are ([`bin`],
//! [`rootfs`]); the scripted model ([`model`]); an OTLP trace collector ([`otlp`]); running the PM ([`pm`]) and a worker
//! ([`worker`]); serving a test's own app ([`serve`]); temporary directories that fail a
//! test whose worker left a mount beneath them, and a workspace's files read after its
//! worker let go of its volume ([`temp`]). Every process it starts is owned by
//! the test (killed on drop, pass or panic).

// A harness: what cannot go on fails the test at once, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod model;
pub mod otlp;
pub mod pm;
pub mod serve;
pub mod temp;
pub mod worker;

pub use model::{model_app, model_server, Model};
pub use pm::{
    completed, final_state, happy_script, history_count, history_kinds, one_job_script,
    plan_statuses, pm_on, pm_with, session_id, write_then_search,
};
pub use serve::{serve_https_in_background, serve_in_background};
pub use temp::{tempdir, workspace_file, TempDir};
pub use worker::{serve_worker, start_worker, Worker, TOKEN};

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

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

fn script(args: &[&str]) -> String {
    cynode_testkit::setup_script(&workspace_root(), args)
}

/// The test image's root filesystem for bwrap. The host tools, the static runner, the
/// test image and the binaries are prepared before the tests by `deploy/test-env.sh`
/// (nextest's setup script); this only asks for the exported root filesystem's path.
pub fn rootfs() -> &'static PathBuf {
    static ROOTFS: OnceLock<PathBuf> = OnceLock::new();
    ROOTFS.get_or_init(|| {
        PathBuf::from(script(&[
            "deploy/sba/export-rootfs.sh",
            "localhost/cynode-sba-test:latest",
        ]))
    })
}

/// Writes the test-only skill package `pkg` (its directory is the skill's id): its
/// `skill.yaml`, its `job.json.j2` and one example's inputs.
pub fn write_skill(pkg: &Path, manifest: &str, template: &str, example: &str) {
    std::fs::create_dir_all(pkg.join("examples")).unwrap();
    std::fs::write(pkg.join("skill.yaml"), manifest).unwrap();
    std::fs::write(pkg.join("job.json.j2"), template).unwrap();
    std::fs::write(pkg.join("examples/basic.json"), example).unwrap();
}
