//! Writing result.json (and the agent's todo.json) atomically: a temp file in the same
//! directory, renamed over the name, so a reader sees either nothing or the complete
//! document.
//!
//! The file is not fsynced. What a reader of result.json needs is atomicity against a
//! process that dies, and the rename gives that: the page cache outlives any process. The
//! node, the one reader that must survive the host, keeps the result in its own store
//! (SQLite, `synchronous=FULL`) before it answers; after a power cut it finds a result
//! the runner had just written empty or missing, and names the job's failure
//! (`result.json invalid`, `result.json missing`) rather than use it. An fsync here cost
//! each job about 0.3 ms of the runner's overhead.

use std::io::Write;
use std::path::Path;

use cynode_protocol::JobResult;

/// Writes `result` to `path` so a reader sees either nothing or the complete document.
pub fn write_atomic(path: &Path, result: &JobResult) -> std::io::Result<()> {
    write_json_atomic(path, result)
}

/// Writes any JSON document to `path` atomically.
pub fn write_json_atomic<T: serde::Serialize>(path: &Path, value: &T) -> std::io::Result<()> {
    let bytes = serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("result path has no file name"))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let mut f = std::fs::File::create(&tmp)?;
    let res = f.write_all(&bytes).and_then(|()| f.write_all(b"\n"));
    drop(f);
    if let Err(e) = res.and_then(|()| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(())
}
