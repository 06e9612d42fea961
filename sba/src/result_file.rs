//! Writing result.json (and the agent's todo.json) atomically: a temp file in the same
//! directory, fsync, rename.

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
    let res = f
        .write_all(&bytes)
        .and_then(|()| f.write_all(b"\n"))
        .and_then(|()| f.sync_all());
    drop(f);
    if let Err(e) = res.and_then(|()| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(())
}
