//! The `sandbox.*` tools of `cynode-pm mcp` and `/v1/mcp`: the sandbox API
//! (`/v1/sandboxes…`) as MCP tools, over the same operations
//! ([`crate::app::sandboxes`]: ownership, the tenant's policy), so an MCP client gets
//! exactly what an API caller gets.
//!
//! | tool | arguments | result |
//! |---|---|---|
//! | `sandbox.create` | purpose?, env?, network_policy?, egress_allow?, use_inference?, idle_timeout_seconds?, max_lifetime_seconds?, on_idle?, from_snapshot? | the worker's SessionInfo |
//! | `sandbox.get`, `sandbox.resume`, `sandbox.end` | sandbox_id | SessionInfo |
//! | `sandbox.suspend` | sandbox_id, memory? | SessionInfo |
//! | `sandbox.exec` | sandbox_id, command, timeout_seconds?, env?, stream?, stdin? | ExecResponse, or ExecStarted with `stream` |
//! | `sandbox.exec_output` | sandbox_id, exec_id, stdout_offset?, stderr_offset?, wait_seconds? | the output events from those offsets, the offsets to go on from, and whether the exec ended |
//! | `sandbox.exec_state` | sandbox_id, exec_id, wait?, timeout_ms? | ExecState |
//! | `sandbox.stdin` | sandbox_id, exec_id, data, close? | StdinWritten |
//! | `sandbox.signal` | sandbox_id, exec_id, signal | SignalSent |
//! | `sandbox.files` | sandbox_id, path | FileListing |
//! | `sandbox.file_read` | sandbox_id, path | the bytes (base64) and their size |
//! | `sandbox.file_write` | sandbox_id, path, content or content_base64 | FileWritten |
//! | `sandbox.snapshot` | sandbox_id | SnapshotInfo (the tenant's) |
//! | `sandbox.snapshots` | sandbox_id | SnapshotList |
//! | `sandbox.snapshot_delete` | snapshot_id | the worker's answer |
//! | `sandbox.fork` | snapshot_id, purpose? | a new sandbox's SessionInfo |

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine;
use rmcp::schemars::{self, JsonSchema};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use cynode_protocol::pm_sandboxes::CreateSandbox;

use super::tool_kit::{parse, tool, ToolError, ToolSpec};
use crate::app::auth::Tenant;
use crate::app::problem::Problem;
use crate::app::sandboxes::{self, Call};
use crate::app::AppState;

/// How long `sandbox.exec_output` may wait for output, at most.
pub const MAX_OUTPUT_WAIT_SECONDS: u64 = 30;
/// The most output bytes (as the worker's SSE text) one `sandbox.exec_output` returns.
const MAX_OUTPUT_BYTES: usize = 1 << 20;
/// The largest file `sandbox.file_read` returns inline.
pub const MAX_INLINE_FILE_BYTES: usize = 8 << 20;

/// `sandbox.get`, `sandbox.resume`, `sandbox.end`, `sandbox.snapshot`, `sandbox.snapshots`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxArgs {
    pub sandbox_id: String,
}

/// `sandbox.suspend`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SuspendArgs {
    pub sandbox_id: String,
    /// Keep the processes too (only where the worker's engine can checkpoint them).
    #[serde(default)]
    pub memory: bool,
}

/// `sandbox.exec`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecArgs {
    pub sandbox_id: String,
    /// argv, run in /workspace.
    pub command: Vec<String>,
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Answer an exec id at once; the output comes from `sandbox.exec_output`.
    #[serde(default)]
    pub stream: bool,
    /// With `stream`: a standard input written with `sandbox.stdin`.
    #[serde(default)]
    pub stdin: bool,
}

/// `sandbox.exec_output`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OutputArgs {
    pub sandbox_id: String,
    pub exec_id: String,
    /// Byte offsets to read from (default 0), as the last call's result gave them.
    #[serde(default)]
    pub stdout_offset: u64,
    #[serde(default)]
    pub stderr_offset: u64,
    /// Read for up to this many seconds (at most 30, default 5) unless the exec ends.
    #[serde(default)]
    pub wait_seconds: Option<u64>,
}

/// `sandbox.exec_state`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StateArgs {
    pub sandbox_id: String,
    pub exec_id: String,
    /// Answer once the exec ended.
    #[serde(default)]
    pub wait: bool,
    /// With `wait`: answer the state after this many milliseconds at most.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

/// `sandbox.stdin`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StdinArgs {
    pub sandbox_id: String,
    pub exec_id: String,
    /// Text written to the command's standard input.
    #[serde(default)]
    pub data: String,
    /// Close the standard input after writing.
    #[serde(default)]
    pub close: bool,
}

/// `sandbox.signal`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SignalArgs {
    pub sandbox_id: String,
    pub exec_id: String,
    /// `TERM`, `INT`, `KILL`, `HUP`, `QUIT`, `USR1` or `USR2`.
    pub signal: String,
}

/// `sandbox.files`, `sandbox.file_read`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PathArgs {
    pub sandbox_id: String,
    /// Relative to /workspace.
    pub path: String,
}

/// `sandbox.file_write`: `content` (text) or `content_base64`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteArgs {
    pub sandbox_id: String,
    pub path: String,
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default)]
    pub content_base64: Option<String>,
}

/// `sandbox.snapshot_delete`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotArgs {
    pub snapshot_id: String,
}

/// `sandbox.fork`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkArgs {
    pub snapshot_id: String,
    #[serde(default)]
    pub purpose: Option<String>,
}

/// The `sandbox.*` tools, in a fixed order.
pub fn catalog() -> Vec<ToolSpec> {
    vec![
        tool::<CreateSandbox>("sandbox.create", "Create a sandbox (a session on a worker, under the tenant's policy) to run commands in; a fork with from_snapshot.", false),
        tool::<SandboxArgs>("sandbox.get", "A sandbox: running, suspended or ended, its workspace and network.", true),
        tool::<ExecArgs>("sandbox.exec", "Run a command in the sandbox's /workspace: its exit code and output, or with `stream` an exec id at once.", false),
        tool::<OutputArgs>("sandbox.exec_output", "A streamed exec's output from byte offsets (waiting up to wait_seconds); the offsets to go on from, and whether it ended.", true),
        tool::<StateArgs>("sandbox.exec_state", "A streamed exec's state (running or its exit), waiting for the end with `wait`.", true),
        tool::<StdinArgs>("sandbox.stdin", "Write to a streamed exec's standard input (and close it).", false),
        tool::<SignalArgs>("sandbox.signal", "Send a signal to a streamed exec.", false),
        tool::<SuspendArgs>("sandbox.suspend", "Suspend the sandbox: its sandbox stops, its workspace and settings are kept.", false),
        tool::<SandboxArgs>("sandbox.resume", "Resume a suspended sandbox with the same workspace.", false),
        tool::<SandboxArgs>("sandbox.end", "End the sandbox.", false),
        tool::<PathArgs>("sandbox.files", "List a directory of the sandbox's workspace without an exec.", true),
        tool::<PathArgs>("sandbox.file_read", "Read a file of the sandbox's workspace (base64) without an exec.", true),
        tool::<WriteArgs>("sandbox.file_write", "Write a file of the sandbox's workspace atomically without an exec.", false),
        tool::<SandboxArgs>("sandbox.snapshot", "Snapshot the sandbox's workspace (paused for it): an id to fork from and the tree hash.", false),
        tool::<SandboxArgs>("sandbox.snapshots", "The tenant's snapshots on the sandbox's worker.", true),
        tool::<SnapshotArgs>("sandbox.snapshot_delete", "Delete one of the tenant's snapshots.", false),
        tool::<ForkArgs>("sandbox.fork", "A new sandbox whose workspace is a copy of the snapshot's.", false),
    ]
}

/// The JSON of a worker's answer; a refusal (4xx) is a tool error with its detail.
async fn answer(r: reqwest::Response) -> Result<Value, ToolError> {
    let status = r.status();
    let v = sandboxes::read_json(r).await?;
    if status.is_success() {
        return Ok(v);
    }
    let code = axum::http::StatusCode::from_u16(status.as_u16())
        .unwrap_or(axum::http::StatusCode::BAD_GATEWAY);
    let detail = v["detail"].as_str().unwrap_or("refused by the worker");
    Err(Problem::status(code, detail.to_string()).into())
}

fn json_body(v: &impl serde::Serialize) -> Result<(reqwest::Body, &'static str), ToolError> {
    let b = serde_json::to_vec(v).map_err(|e| Problem::internal(e.to_string()))?;
    Ok((b.into(), "application/json"))
}

/// Runs `sandbox.*` tool `tool`; `None` when `tool` is not one of them.
pub async fn call(
    st: &AppState,
    tenant: &Tenant,
    tool: &str,
    args: &Map<String, Value>,
) -> Option<Result<Value, ToolError>> {
    let run = async {
        use reqwest::Method;
        let one = |suffix: &'static str, path: &'static [&'static str], method: Method| {
            move |id: String| async move {
                let c = Call::simple(method, suffix, path);
                answer(sandboxes::call(st, tenant, &id, c).await?).await
            }
        };
        match tool {
            "sandbox.create" => {
                let req: CreateSandbox = parse(tool, args)?;
                answer(sandboxes::create(st, tenant, &req).await?).await
            }
            "sandbox.fork" => {
                let a: ForkArgs = parse(tool, args)?;
                let req = CreateSandbox {
                    purpose: a.purpose,
                    from_snapshot: Some(a.snapshot_id),
                    ..CreateSandbox::default()
                };
                answer(sandboxes::create(st, tenant, &req).await?).await
            }
            "sandbox.get" => {
                let a: SandboxArgs = parse(tool, args)?;
                one("", &[], Method::GET)(a.sandbox_id).await
            }
            "sandbox.resume" => {
                let a: SandboxArgs = parse(tool, args)?;
                one(":resume", &[], Method::POST)(a.sandbox_id).await
            }
            "sandbox.end" => {
                let a: SandboxArgs = parse(tool, args)?;
                one("", &["end"], Method::POST)(a.sandbox_id).await
            }
            "sandbox.snapshots" => {
                let a: SandboxArgs = parse(tool, args)?;
                one("", &["snapshots"], Method::GET)(a.sandbox_id).await
            }
            "sandbox.suspend" => {
                let a: SuspendArgs = parse(tool, args)?;
                let mut c = Call::simple(Method::POST, ":suspend", &[]);
                c.body = Some(json_body(&json!({ "memory": a.memory }))?);
                answer(sandboxes::call(st, tenant, &a.sandbox_id, c).await?).await
            }
            "sandbox.exec" => {
                let a: ExecArgs = parse(tool, args)?;
                let req = json!({
                    "version": 1, "command": a.command, "timeout_seconds": a.timeout_seconds,
                    "env": a.env, "stream": a.stream, "stdin": a.stdin,
                });
                let mut c = Call::simple(Method::POST, "", &["exec"]);
                c.body = Some(json_body(&req)?);
                c.stream = true;
                answer(sandboxes::call(st, tenant, &a.sandbox_id, c).await?).await
            }
            "sandbox.exec_state" => {
                let a: StateArgs = parse(tool, args)?;
                let mut q = vec![("wait", a.wait.to_string())];
                if let Some(t) = a.timeout_ms {
                    q.push(("timeout_ms", t.to_string()));
                }
                let path = ["execs", a.exec_id.as_str()];
                let mut c = Call::simple(Method::GET, "", &path);
                c.query = &q;
                c.stream = true;
                answer(sandboxes::call(st, tenant, &a.sandbox_id, c).await?).await
            }
            "sandbox.stdin" => {
                let a: StdinArgs = parse(tool, args)?;
                let q = [("close", a.close.to_string())];
                let path = ["execs", a.exec_id.as_str(), "stdin"];
                let mut c = Call::simple(Method::POST, "", &path);
                c.query = &q;
                c.body = Some((a.data.into_bytes().into(), "application/octet-stream"));
                answer(sandboxes::call(st, tenant, &a.sandbox_id, c).await?).await
            }
            "sandbox.signal" => {
                let a: SignalArgs = parse(tool, args)?;
                let head = format!("{}:signal", a.exec_id);
                let path = ["execs", head.as_str()];
                let mut c = Call::simple(Method::POST, "", &path);
                c.body = Some(json_body(&json!({ "signal": a.signal }))?);
                answer(sandboxes::call(st, tenant, &a.sandbox_id, c).await?).await
            }
            "sandbox.exec_output" => {
                let a: OutputArgs = parse(tool, args)?;
                exec_output(st, tenant, &a).await
            }
            "sandbox.files" => {
                let a: PathArgs = parse(tool, args)?;
                let q = [("path", a.path.clone()), ("list", "true".to_string())];
                let mut c = Call::simple(Method::GET, "", &["files"]);
                c.query = &q;
                answer(sandboxes::call(st, tenant, &a.sandbox_id, c).await?).await
            }
            "sandbox.file_read" => {
                let a: PathArgs = parse(tool, args)?;
                let q = [("path", a.path.clone())];
                let mut c = Call::simple(Method::GET, "", &["files"]);
                c.query = &q;
                let r = sandboxes::call(st, tenant, &a.sandbox_id, c).await?;
                if !r.status().is_success() {
                    return answer(r).await;
                }
                let bytes = sandboxes::read_bounded(r, MAX_INLINE_FILE_BYTES).await?;
                Ok(json!({
                    "path": a.path,
                    "size_bytes": bytes.len(),
                    "content_base64": base64::engine::general_purpose::STANDARD.encode(&bytes),
                }))
            }
            "sandbox.file_write" => {
                let a: WriteArgs = parse(tool, args)?;
                let bytes = match (a.content, a.content_base64) {
                    (Some(t), None) => t.into_bytes(),
                    (None, Some(b)) => base64::engine::general_purpose::STANDARD
                        .decode(b.as_bytes())
                        .map_err(|e| {
                            ToolError::BadArguments(format!("{tool}: content_base64: {e}"))
                        })?,
                    _ => {
                        return Err(ToolError::BadArguments(format!(
                            "{tool}: exactly one of content and content_base64"
                        )))
                    }
                };
                let q = [("path", a.path.clone())];
                let mut c = Call::simple(Method::PUT, "", &["files"]);
                c.query = &q;
                c.body = Some((bytes.into(), "application/octet-stream"));
                answer(sandboxes::call(st, tenant, &a.sandbox_id, c).await?).await
            }
            "sandbox.snapshot" => {
                let a: SandboxArgs = parse(tool, args)?;
                let (status, v) = sandboxes::snapshot(st, tenant, &a.sandbox_id).await?;
                if (200..300).contains(&status) {
                    Ok(v)
                } else {
                    let code = axum::http::StatusCode::from_u16(status)
                        .unwrap_or(axum::http::StatusCode::BAD_GATEWAY);
                    let detail = v["detail"].as_str().unwrap_or("refused by the worker");
                    Err(Problem::status(code, detail.to_string()).into())
                }
            }
            "sandbox.snapshot_delete" => {
                let a: SnapshotArgs = parse(tool, args)?;
                answer(sandboxes::delete_snapshot(st, tenant, &a.snapshot_id).await?).await
            }
            _ => Err(ToolError::UnknownTool(tool.to_string())),
        }
    };
    if !tool.starts_with("sandbox.") {
        return None;
    }
    Some(run.await)
}

/// `sandbox.exec_output`: the worker's output stream from the offsets, read until the
/// exec's `exit` event, `wait_seconds`, or [`MAX_OUTPUT_BYTES`].
async fn exec_output(st: &AppState, tenant: &Tenant, a: &OutputArgs) -> Result<Value, ToolError> {
    let wait = a.wait_seconds.unwrap_or(5);
    if wait > MAX_OUTPUT_WAIT_SECONDS {
        return Err(ToolError::BadArguments(format!(
            "sandbox.exec_output: wait_seconds: at most {MAX_OUTPUT_WAIT_SECONDS}"
        )));
    }
    let q = [
        ("stdout_offset", a.stdout_offset.to_string()),
        ("stderr_offset", a.stderr_offset.to_string()),
    ];
    let path = ["execs", a.exec_id.as_str(), "output"];
    let mut c = Call::simple(reqwest::Method::GET, "", &path);
    c.query = &q;
    c.stream = true;
    let mut r = sandboxes::call(st, tenant, &a.sandbox_id, c).await?;
    if !r.status().is_success() {
        return answer(r).await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(wait);
    let mut text = Vec::new();
    let mut events = Vec::new();
    let (mut out, mut err) = (a.stdout_offset, a.stderr_offset);
    let mut ended = false;
    'read: while text.len() < MAX_OUTPUT_BYTES {
        let chunk = tokio::select! {
            c = r.chunk() => c,
            _ = tokio::time::sleep_until(deadline) => break,
        };
        match chunk {
            Ok(Some(c)) => text.extend_from_slice(&c),
            Ok(None) => break,
            Err(e) => {
                return Err(
                    Problem::unavailable(format!("the output stream broke off: {e}")).into(),
                )
            }
        }
        // Complete events only; a partial one waits for its next chunk.
        while let Some(end) = find(&text, b"\n\n") {
            let ev: Vec<u8> = text.drain(..end + 2).collect();
            let ev = String::from_utf8_lossy(&ev);
            let (mut kind, mut id, mut data) = ("", "", "");
            for line in ev.lines() {
                if let Some(v) = line.strip_prefix("event: ") {
                    kind = v;
                } else if let Some(v) = line.strip_prefix("id: ") {
                    id = v;
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data = v;
                }
            }
            if kind.is_empty() {
                continue;
            }
            if let Some((o, e)) = id.split_once(',') {
                out = o.parse().unwrap_or(out);
                err = e.parse().unwrap_or(err);
            }
            let data: Value = serde_json::from_str(data).unwrap_or(Value::Null);
            events.push(json!({ "event": kind, "data": data }));
            if kind == "exit" {
                ended = true;
                break 'read;
            }
        }
    }
    Ok(json!({ "events": events, "stdout_offset": out, "stderr_offset": err, "ended": ended }))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
