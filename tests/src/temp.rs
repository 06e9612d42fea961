//! Temporary directories of the tests that may hold a worker's state directory. A worker
//! lets go of its disk volumes (loop-device filesystems, `cynode_worker::loopfs`) when it
//! stops, and its janitor does after a kill; [`TempDir`] unmounts nothing itself. Its
//! drop waits (bounded) for a worker still stopping (a PM's local worker after its
//! grace), then fails the test when anything is still mounted beneath it or a loop
//! device still holds a file of it, and removes it.

use std::path::Path;
use std::time::Duration;

/// How long a drop waits for a worker beneath the directory to let go of its volumes.
const LET_GO: Duration = Duration::from_secs(60);

/// A temporary directory whose drop checks that no worker left a mount beneath it.
#[derive(Debug)]
pub struct TempDir(tempfile::TempDir);

/// A new [`TempDir`] (under `$TMPDIR`).
pub fn tempdir() -> std::io::Result<TempDir> {
    tempfile::tempdir().map(TempDir)
}

impl TempDir {
    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // A test that failed already is not failed again (nor held up).
        if std::thread::panicking() {
            return;
        }
        if let Err(left) = cynode_testkit::mounts::wait_nothing_left(self.0.path(), LET_GO) {
            panic!(
                "a worker left these beneath {}: {left:#?}",
                self.0.path().display()
            );
        }
    }
}

/// The file `name` of the local worker's workspace `workspace` (a session's), for a PM
/// state directory `state`: read in place while the workspace's volume is mounted, else
/// out of its image (`debugfs`, read-only, nothing mounted) once the worker let go of it;
/// a plain directory when the worker had no volumes. `None` when there is no such file.
pub fn workspace_file(state: &Path, workspace: &str, name: &str) -> Option<String> {
    let node = state.join("worker/state");
    let dir = node.join("workspaces").join(workspace);
    let image = node.join("volumes").join(format!("ws-{workspace}.img"));
    let mounted = !cynode_testkit::mounts::mounts_beneath(&dir).is_empty();
    if mounted || !image.exists() {
        return std::fs::read_to_string(dir.join(name)).ok();
    }
    let mut cmd = std::process::Command::new("debugfs");
    cmd.arg("-R").arg(format!("cat /{name}")).arg(&image);
    let out = cynode_testkit::output_bounded(cmd, Duration::from_secs(30));
    let err = String::from_utf8_lossy(&out.stderr);
    (out.status.success() && !err.contains("not found"))
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}
