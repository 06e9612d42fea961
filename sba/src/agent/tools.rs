//! Gateway tools as agent actions: the model's `tool_call` goes to the PM's tool gateway
//! through the node's socket in the job directory (`/job/gateway.sock`; the node adds the
//! job's token there, the runner never holds one).
//!
//! - Only the tools the job lists in `context.mcp_tools` are called; any other name is
//!   refused here, before anything is sent ([`unlisted`]), and the refusal is the model's
//!   observation. The gateway applies its own allowlist and the token's task scope on top.
//! - One MCP `tools/call` per request (JSON-RPC over streamable HTTP, stateless: no
//!   `initialize`, as the gateway serves it), with a JSON or an SSE reply understood.
//! - Bounded: the reply is read up to [`MAX_REPLY_BYTES`] within [`CALL_TIMEOUT`] (and the
//!   job deadline); what enters the prompt is cut to [`MAX_RESULT_BYTES`].
//! - `artifact.put` may be given `content` (UTF-8 text) instead of `content_base64` and
//!   `sha256`: the runner encodes it and states its digest (a model cannot hash reliably).
//!
//! Every call, refused or not, becomes a [`ToolCallRecord`] in result.json (tool,
//! outcome, bytes).

use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use base64::Engine;
use cynode_protocol::result::{ToolCallOutcome, ToolCallRecord};
use cynode_protocol::FailureCode;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::text::cut;
use crate::http::{self, HttpError, Limits, Target};

/// Where the node serves the gateway socket inside the sandbox.
pub const DEFAULT_GATEWAY_URL: &str = "http+unix://%2Fjob%2Fgateway.sock/";
/// Cap on one gateway reply (an 8 MiB artifact, base64 once in `structuredContent`: the
/// gateway sends a big result's JSON once, with a short text, and its envelope).
pub const MAX_REPLY_BYTES: usize = 12 << 20;
/// Cap on what of a reply the model reads.
pub const MAX_RESULT_BYTES: usize = 4 * 1024;
/// Bound on one call (the job deadline bounds it too).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// The MCP protocol version the runner speaks.
pub const PROTOCOL_VERSION: &str = "2025-06-18";

/// The argument hint the prompt shows for a known gateway tool.
pub fn hint(tool: &str) -> &'static str {
    match tool {
        "artifact.put" => {
            r#"{"path": "<name>", "content": "<text>"}: store a file as an artifact of this task"#
        }
        "artifact.get" => {
            r#"{"path": "<name>"} or {"sha256": "<hex>"}: read an artifact of this task (content_base64)"#
        }
        "artifact.list" => "{}: list the artifacts of this task",
        "skills.list" => "{}: list the skill catalog",
        "skills.get" => r#"{"skill_id": "<id>"}: read one skill"#,
        "help.tools" => "{}: list the gateway's tools",
        _ => "see help.tools",
    }
}

/// The refusal of a tool the job does not list, or `None` when it is listed.
pub fn unlisted(tool: &str, allowed: &[String]) -> Option<String> {
    if allowed.iter().any(|t| t == tool) {
        return None;
    }
    Some(if allowed.is_empty() {
        format!("tool `{tool}` refused: this job lists no tools (context.mcp_tools)")
    } else {
        format!(
            "tool `{tool}` refused: not in context.mcp_tools ({})",
            allowed.join(", ")
        )
    })
}

/// What one call came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Called {
    pub record: ToolCallRecord,
    /// What the model reads (cut to [`MAX_RESULT_BYTES`]).
    pub text: String,
    /// Set when the call ran into the job deadline or an interrupt: the job ends.
    pub fatal: Option<(FailureCode, String)>,
}

impl Called {
    /// A call refused before anything was sent.
    pub fn refused(tool: &str, why: String) -> Called {
        Called {
            record: ToolCallRecord {
                tool: tool.to_string(),
                outcome: ToolCallOutcome::Refused,
                bytes: 0,
                duration_ms: 0,
                error: Some(why.clone()),
            },
            text: why,
            fatal: None,
        }
    }
}

/// The gateway socket and the JSON-RPC ids used so far.
#[derive(Debug, Clone)]
pub struct Gateway {
    target: Target,
    url: String,
    next_id: u64,
}

impl Gateway {
    /// The gateway at `url` (`http+unix://…` or `http://…`).
    pub fn new(url: &str) -> Result<Gateway, http::UrlError> {
        Ok(Gateway {
            target: http::parse_url(url)?,
            url: url.to_string(),
            next_id: 1,
        })
    }

    /// Calls `tool` with `arguments` (an object); never panics, never retries.
    pub fn call(
        &mut self,
        tool: &str,
        arguments: &Value,
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Called {
        let t = Instant::now();
        let id = self.next_id;
        self.next_id += 1;
        let body = json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": { "name": tool, "arguments": prepare(tool, arguments) } });
        let body = serde_json::to_vec(&body).unwrap_or_default();
        let lim = Limits {
            deadline: deadline.min(Instant::now() + CALL_TIMEOUT),
            max_body: MAX_REPLY_BYTES,
            cancel: Some(cancel),
        };
        let headers = [
            ("Accept", "application/json, text/event-stream"),
            ("Mcp-Protocol-Version", PROTOCOL_VERSION),
            ("Mcp-Method", "tools/call"),
        ];
        let sent = http::send_with(&self.target, "POST", Some(&body), &headers, &lim);
        let (outcome, bytes, text, fatal) = match sent {
            Ok(r) => {
                let (outcome, text) = read_reply(r.status, &r.body, id);
                (outcome, r.body.len() as u64, text, None)
            }
            Err(e) => {
                let fatal = match &e {
                    HttpError::Timeout if Instant::now() >= deadline => Some((
                        FailureCode::Timeout,
                        format!("job deadline (constraints.max_runtime_seconds) reached during the gateway call {tool}"),
                    )),
                    HttpError::Interrupted => Some((
                        FailureCode::InternalError,
                        "runner interrupted by SIGTERM".to_string(),
                    )),
                    _ => None,
                };
                let why = match &e {
                    HttpError::Connect(_) => format!(
                        "no gateway at {} ({e}): the node gave this job no tool gateway",
                        self.url
                    ),
                    _ => format!("the gateway call failed: {e}"),
                };
                (ToolCallOutcome::Error, 0, why, fatal)
            }
        };
        let error = (outcome != ToolCallOutcome::Ok).then(|| cut(&text, 500));
        Called {
            record: ToolCallRecord {
                tool: tool.to_string(),
                outcome,
                bytes,
                duration_ms: t.elapsed().as_millis() as u64,
                error,
            },
            text: cut(&text, MAX_RESULT_BYTES),
            fatal,
        }
    }
}

/// The arguments as sent: `artifact.put` with `content` becomes `content_base64` +
/// `sha256` of those bytes; everything else goes as the model wrote it.
fn prepare(tool: &str, arguments: &Value) -> Value {
    let mut args = arguments.clone();
    if tool == "artifact.put" {
        if let Some(obj) = args.as_object_mut() {
            if !obj.contains_key("content_base64") {
                if let Some(Value::String(text)) = obj.remove("content") {
                    let b64 = base64::engine::general_purpose::STANDARD.encode(text.as_bytes());
                    obj.insert("content_base64".into(), Value::String(b64));
                    obj.entry("sha256").or_insert_with(|| {
                        Value::String(hex::encode(Sha256::digest(text.as_bytes())))
                    });
                }
            }
        }
    }
    args
}

/// The outcome and the text of a gateway reply to the request with JSON-RPC id `id`.
fn read_reply(status: u16, body: &[u8], id: u64) -> (ToolCallOutcome, String) {
    let raw = String::from_utf8_lossy(body);
    if !(200..300).contains(&status) {
        let detail = serde_json::from_slice::<Value>(body)
            .ok()
            .and_then(|v| v["detail"].as_str().map(str::to_string))
            .unwrap_or_else(|| cut(raw.trim(), 300));
        let why = match status {
            401 | 403 => {
                format!("the gateway refused this job's credentials (HTTP {status}): {detail}")
            }
            _ => format!("the gateway answered HTTP {status}: {detail}"),
        };
        return (ToolCallOutcome::Error, why);
    }
    let Some(msg) = json_rpc_message(&raw) else {
        return (
            ToolCallOutcome::Error,
            format!(
                "the gateway's reply is not a JSON-RPC message: {}",
                cut(raw.trim(), 300)
            ),
        );
    };
    if msg["id"] != json!(id) {
        return (
            ToolCallOutcome::Error,
            format!(
                "the gateway's reply answers JSON-RPC id {}, not this call's {id}",
                cut(&msg["id"].to_string(), 64)
            ),
        );
    }
    if let Some(e) = msg.get("error") {
        let detail = e["data"]["detail"]
            .as_str()
            .or(e["message"].as_str())
            .unwrap_or("refused");
        return (
            ToolCallOutcome::Refused,
            format!("refused by the gateway: {detail}"),
        );
    }
    let result = &msg["result"];
    let content = if result["structuredContent"].is_null() {
        result["content"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n")
    } else {
        result["structuredContent"].to_string()
    };
    if result["isError"] == true {
        let detail = result["structuredContent"]["detail"]
            .as_str()
            .map(str::to_string)
            .unwrap_or(content);
        return (
            ToolCallOutcome::Refused,
            format!("refused by the gateway: {detail}"),
        );
    }
    if result.is_null() {
        return (
            ToolCallOutcome::Error,
            "the gateway's reply has neither result nor error".into(),
        );
    }
    (ToolCallOutcome::Ok, content)
}

/// The JSON-RPC message of a reply: the body itself, or the last `data:` event of an SSE
/// stream that holds one.
fn json_rpc_message(raw: &str) -> Option<Value> {
    if let Ok(v) = serde_json::from_str::<Value>(raw.trim()) {
        return v.is_object().then_some(v);
    }
    raw.lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
        .find(|v| v.get("jsonrpc").is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::os::unix::net::UnixListener;

    /// A one-shot gateway on a Unix socket: answers each connection with `reply(request
    /// body)`, and hands the request heads and bodies back.
    struct FakeGateway {
        url: String,
        seen: std::sync::mpsc::Receiver<(String, Value)>,
        _dir: tempfile::TempDir,
    }

    fn fake(replies: Vec<(u16, String)>) -> FakeGateway {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gw.sock");
        let l = UnixListener::bind(&path).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for (status, body) in replies {
                let Ok((s, _)) = l.accept() else { return };
                let mut r = BufReader::new(s.try_clone().unwrap());
                let mut head = String::new();
                let mut len = 0;
                loop {
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
                        break;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        len = v.trim().parse().unwrap();
                    }
                    head.push_str(&line);
                }
                let mut b = vec![0; len];
                r.read_exact(&mut b).unwrap();
                tx.send((head, serde_json::from_slice(&b).unwrap()))
                    .unwrap();
                let mut s = s;
                let _ = write!(
                    s,
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        let enc = path.display().to_string().replace('/', "%2F");
        FakeGateway {
            url: format!("http+unix://{enc}/"),
            seen: rx,
            _dir: dir,
        }
    }

    fn call(url: &str, tool: &str, args: Value) -> Called {
        let stop = AtomicBool::new(false);
        Gateway::new(url).unwrap().call(
            tool,
            &args,
            Instant::now() + Duration::from_secs(10),
            &stop,
        )
    }

    #[test]
    fn unlisted_tools_are_refused_with_the_list() {
        let allowed = vec!["artifact.put".to_string(), "skills.get".to_string()];
        assert_eq!(unlisted("skills.get", &allowed), None);
        let why = unlisted("db.query", &allowed).unwrap();
        assert!(
            why.contains("`db.query`") && why.contains("artifact.put, skills.get"),
            "{why}"
        );
        assert!(unlisted("skills.get", &[])
            .unwrap()
            .contains("lists no tools"));
        let c = Called::refused("db.query", why);
        assert_eq!(c.record.outcome, ToolCallOutcome::Refused);
        assert_eq!(c.record.bytes, 0);
    }

    #[test]
    fn a_call_is_one_mcp_tools_call_and_its_result_is_read() {
        let reply = json!({ "jsonrpc": "2.0", "id": 1, "result": {
            "content": [{ "type": "text", "text": "{\"skill_id\":\"x\"}" }],
            "structuredContent": { "skill_id": "x" }, "isError": false } })
        .to_string();
        let gw = fake(vec![(200, reply.clone())]);
        let c = call(&gw.url, "skills.get", json!({ "skill_id": "x" }));
        assert_eq!(c.record.outcome, ToolCallOutcome::Ok, "{c:?}");
        assert_eq!(c.record.bytes, reply.len() as u64);
        assert_eq!(c.record.error, None);
        assert_eq!(c.text, r#"{"skill_id":"x"}"#);
        let (head, body) = gw.seen.recv().unwrap();
        assert!(head.starts_with("POST / HTTP/1.1"), "{head}");
        assert!(
            head.contains("Accept: application/json, text/event-stream"),
            "{head}"
        );
        assert!(head.contains("Mcp-Protocol-Version: 2025-06-18"), "{head}");
        assert!(
            !head.to_ascii_lowercase().contains("authorization"),
            "{head}"
        );
        assert_eq!(body["method"], "tools/call");
        assert_eq!(
            body["params"],
            json!({ "name": "skills.get", "arguments": { "skill_id": "x" } })
        );
    }

    #[test]
    fn artifact_put_text_is_encoded_and_hashed_by_the_runner() {
        let gw = fake(vec![(200, json!({ "jsonrpc": "2.0", "id": 1, "result": { "content": [], "structuredContent": {} } }).to_string())]);
        call(
            &gw.url,
            "artifact.put",
            json!({ "path": "a.txt", "content": "hi\n" }),
        );
        let (_, body) = gw.seen.recv().unwrap();
        let a = &body["params"]["arguments"];
        assert_eq!(a["content_base64"], "aGkK");
        assert_eq!(a["sha256"], hex::encode(Sha256::digest(b"hi\n")));
        assert!(a.get("content").is_none());
        // Given base64 already, nothing is changed.
        let given = json!({ "path": "a", "content_base64": "eA==", "sha256": "00" });
        assert_eq!(prepare("artifact.put", &given), given);
    }

    #[test]
    fn gateway_refusals_and_failures_are_told_apart() {
        let forbidden = json!({ "jsonrpc": "2.0", "id": 1, "error": { "code": -32602,
            "message": "`db.query`: db.* tools are never offered to a sandbox",
            "data": { "detail": "`db.query`: db.* tools are never offered to a sandbox" } } });
        let problem = json!({ "jsonrpc": "2.0", "id": 1, "result": { "content": [],
            "structuredContent": { "status": 404, "detail": "artifact of this task not found" }, "isError": true } });
        let sse = format!(
            "event: message\ndata: {}\n\n",
            json!({ "jsonrpc": "2.0", "id": 1, "result": { "content": [{ "type": "text", "text": "fine" }] } })
        );
        let gw = fake(vec![
            (200, forbidden.to_string()),
            (200, problem.to_string()),
            (
                401,
                json!({ "detail": "unknown or revoked gateway token" }).to_string(),
            ),
            (200, "not json".into()),
            (200, sse),
        ]);
        let c = call(&gw.url, "db.query", json!({}));
        assert_eq!(c.record.outcome, ToolCallOutcome::Refused);
        assert!(c.text.contains("never offered"), "{}", c.text);
        let c = call(&gw.url, "artifact.get", json!({ "path": "x" }));
        assert_eq!(c.record.outcome, ToolCallOutcome::Refused);
        assert!(c.text.contains("not found"), "{}", c.text);
        let c = call(&gw.url, "artifact.list", json!({}));
        assert_eq!(c.record.outcome, ToolCallOutcome::Error);
        assert!(
            c.text.contains("HTTP 401") && c.text.contains("revoked"),
            "{}",
            c.text
        );
        let c = call(&gw.url, "artifact.list", json!({}));
        assert_eq!(c.record.outcome, ToolCallOutcome::Error);
        let c = call(&gw.url, "artifact.list", json!({}));
        assert_eq!(c.record.outcome, ToolCallOutcome::Ok, "{c:?}");
        assert_eq!(c.text, "fine");
        assert!(c.fatal.is_none());
    }

    #[test]
    fn a_reply_to_another_id_is_an_error() {
        let reply = json!({ "jsonrpc": "2.0", "id": 7, "result": {
            "content": [{ "type": "text", "text": "for someone else" }] } });
        let sse = format!(
            "event: message\ndata: {}\n\n",
            json!({ "jsonrpc": "2.0", "id": "1", "result": { "content": [] } })
        );
        let gw = fake(vec![(200, reply.to_string()), (200, sse)]);
        for _ in 0..2 {
            let c = call(&gw.url, "skills.list", json!({}));
            assert_eq!(c.record.outcome, ToolCallOutcome::Error, "{c:?}");
            assert!(c.text.contains("not this call's 1"), "{}", c.text);
        }
    }

    #[test]
    fn large_results_are_cut_before_the_prompt_and_no_gateway_is_an_error() {
        let big = "x".repeat(100_000);
        let reply = json!({ "jsonrpc": "2.0", "id": 1, "result": { "content": [{ "type": "text", "text": big }] } }).to_string();
        let gw = fake(vec![(200, reply.clone())]);
        let c = call(&gw.url, "artifact.get", json!({ "path": "big" }));
        assert_eq!(c.record.outcome, ToolCallOutcome::Ok);
        assert_eq!(c.record.bytes, reply.len() as u64);
        assert!(c.text.len() < MAX_RESULT_BYTES + 64, "{}", c.text.len());
        assert!(
            c.text.ends_with("bytes cut]"),
            "{}",
            &c.text[c.text.len() - 40..]
        );
        // Cut once: the model's observation keeps the note.
        let obs = super::super::prompt::tool_observation(
            "artifact.get",
            ToolCallOutcome::Ok,
            &c.text,
            10,
            3,
        );
        assert!(obs.contains("bytes cut]\n\n[remaining time"), "{obs}");

        let c = call(
            "http+unix://%2Fnonexistent%2Fgw.sock/",
            "artifact.list",
            json!({}),
        );
        assert_eq!(c.record.outcome, ToolCallOutcome::Error);
        assert!(c.text.contains("no gateway"), "{}", c.text);
        assert!(c.fatal.is_none());
    }
}
