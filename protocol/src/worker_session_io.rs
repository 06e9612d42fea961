//! Worker API bodies of a session's files and streamed execs (this project's extension).
//!
//! - Files: `GET …/sessions/{id}/files?path=P` answers the file's bytes;
//!   `GET …/files?path=D&list=true` a [`FileListing`]; `PUT …/files?path=P` (the body is the
//!   file's bytes) a [`FileWritten`].
//! - Streamed execs: `POST …/exec` with `"stream": true` answers an [`ExecStarted`] at once;
//!   `GET …/execs/{exec_id}` an [`ExecState`] (with `?wait=true&timeout_ms=N`, once the
//!   command ended or the wait ran out); `GET …/execs/{exec_id}/output` the output as
//!   server-sent events: `stdout` and `stderr` ([`OutputChunk`]), `cut` ([`OutputCut`]),
//!   then `exit` (an [`ExecState`]).
//! - A streamed exec started with `"stdin": true` takes its standard input from
//!   `POST …/execs/{exec_id}/stdin` (the body is the bytes; `?close=true` closes it after
//!   them), answered a [`StdinWritten`]; `POST …/execs/{exec_id}:signal` with an
//!   [`ExecSignalRequest`] signals the command, answered a [`SignalSent`].

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::worker_sessions::ExecResponse;

/// What a directory entry is (never followed: a link is `symlink`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
    Unknown,
}

/// One entry of a [`FileListing`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// The name; bytes that are not UTF-8 are written `\xNN`.
    pub name: String,
    pub kind: FileKind,
    /// Bytes (the link's own length for a link).
    pub size: u64,
    /// Permission bits (`0o7777` of `st_mode`).
    pub mode: u32,
}

/// `GET …/files?path=D&list=true` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FileListing {
    pub version: u32,
    pub session_id: String,
    /// The directory, relative to `/workspace` (`""` is the workspace itself).
    pub path: String,
    /// Sorted by name; at most the node's bound of them.
    pub entries: Vec<FileEntry>,
    /// The directory holds more entries than the bound: `entries` are some of them.
    pub truncated: bool,
}

/// `PUT …/files?path=P` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FileWritten {
    pub version: u32,
    pub session_id: String,
    pub path: String,
    pub bytes: u64,
    /// sha256 of the bytes written, lowercase hex.
    pub sha256: String,
}

/// `POST …/exec` response with `"stream": true`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecStarted {
    pub version: u32,
    pub session_id: String,
    /// Unguessable (128 random bits); names the exec under its session only.
    pub exec_id: String,
}

/// `GET …/execs/{exec_id}` response, and the data of the output's `exit` event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecState {
    pub version: u32,
    pub session_id: String,
    pub exec_id: String,
    pub running: bool,
    /// Bytes the command wrote to stdout so far (kept or cut).
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    /// Once the command ended: how (its `stdout` and `stderr` are empty: the output is
    /// read from `…/output`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<ExecResponse>,
}

/// A `stdout` or `stderr` event's data: the bytes `[offset, offset + len)` of that stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OutputChunk {
    pub offset: u64,
    /// The bytes, base64 (standard alphabet, padded).
    pub data: String,
}

/// A `cut` event's data: the bytes `[from, to)` of `stream` the node no longer keeps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OutputCut {
    /// `stdout` or `stderr`.
    pub stream: String,
    pub from: u64,
    pub to: u64,
}

/// The named error of a write to the stdin of an exec that has ended or closed it (409).
pub const EXEC_ENDED: &str = "exec_ended";
/// The named error of a stdin write the command did not take within the node's bound
/// (409; the bytes stay queued, in order).
pub const STDIN_BLOCKED: &str = "stdin_blocked";
/// The named error of `"stdin": true` on a backend that cannot give a command a stdin.
pub const STDIN_UNSUPPORTED: &str = "stdin_unsupported";
/// The named error of a stdin write to an exec started without `"stdin": true` (409).
pub const STDIN_NOT_OPEN: &str = "stdin_not_open";
/// The named error of a signal on a backend that cannot deliver one (409).
pub const SIGNAL_UNSUPPORTED: &str = "signal_unsupported";

/// `POST …/execs/{exec_id}/stdin` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StdinWritten {
    pub version: u32,
    pub session_id: String,
    pub exec_id: String,
    /// Bytes of this call, now in the command's stdin pipe.
    pub bytes: u64,
    /// Bytes written to the exec's stdin in all.
    pub total_bytes: u64,
    /// The stdin is closed (this call's `close=true`, or an earlier one).
    pub closed: bool,
}

/// `POST …/execs/{exec_id}:signal` request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecSignalRequest {
    /// One of `TERM`, `INT`, `KILL`, `HUP`, `QUIT`, `USR1`, `USR2`.
    pub signal: String,
}

/// `POST …/execs/{exec_id}:signal` response: the signal was delivered to the command's
/// process group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SignalSent {
    pub version: u32,
    pub session_id: String,
    pub exec_id: String,
    pub signal: String,
}
