//! Temporary directories of the tests that may hold a worker's state directory: a worker
//! killed by its test, or still exiting (a PM's local worker after its grace), leaves its
//! disk volumes (loop-device filesystems, `cynode_worker::loopfs`) mounted beneath it, and
//! a mount point cannot be removed. [`TempDir`] unmounts them (detached) before the
//! directory goes, on success and on panic.

use std::path::Path;

/// A temporary directory whose drop unmounts the volumes beneath it, then removes it.
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
        cynode_worker::loopfs::unmount_all_beneath(self.0.path());
    }
}
