//! `cynode-pm serve` refuses what it does not understand, always as problem+json: bodies
//! that are not JSON objects, any Content-Type but application/json (or none), and bodies
//! over `--max-body-bytes` with and without Content-Length.

use std::io::{Read, Write};
use std::time::Duration;

use serde_json::{json, Value};

use crate::service::{start_replica_with, Replica, TENANT_A};
use cynode_tests::model_server;

/// A replica with a small body limit. Its worker endpoint answers nothing: these requests
/// are refused before any session runs (the accepted ones fail later, unobserved).
fn replica(dir: &std::path::Path) -> Replica {
    let (model, _) = model_server(vec![]);
    let db = format!("sqlite://{}", dir.join("pm.db").display());
    start_replica_with(
        dir,
        "input",
        &db,
        &model,
        &["--worker-endpoint", "http://127.0.0.1:9"],
        &["--max-body-bytes", "2048"],
    )
}

/// A raw HTTP/1.1 request (so Content-Length and Transfer-Encoding are exactly as
/// written); returns status, Content-Type and body.
fn raw(base: &str, head: &str, body: &[u8]) -> (u16, String, String) {
    let addr = base.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let req = format!(
        "{head}\r\nHost: {addr}\r\nAuthorization: Bearer {TENANT_A}\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).unwrap();
    // The server may answer (and close) before the whole body is sent.
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).to_string();
    let (headers, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = headers
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let ctype = headers
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_default();
    (status, ctype, body.to_string())
}

fn post(base: &str, path: &str, ctype: Option<&str>, body: &[u8]) -> (u16, String, String) {
    let mut head = format!("POST {path} HTTP/1.1\r\nContent-Length: {}", body.len());
    if let Some(t) = ctype {
        head.push_str(&format!("\r\nContent-Type: {t}"));
    }
    raw(base, &head, body)
}

/// The body of a problem+json answer with this status (chunked bodies unwrapped).
fn problem(answer: &(u16, String, String), status: u16) -> Value {
    let (got, ctype, body) = answer;
    assert_eq!(*got, status, "{answer:?}");
    assert!(
        ctype.starts_with("application/problem+json"),
        "not problem+json: {answer:?}"
    );
    let start = body.find('{').unwrap_or(0);
    let end = body.rfind('}').map_or(body.len(), |e| e + 1);
    let v: Value =
        serde_json::from_str(&body[start..end]).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert_eq!(v["status"], status, "{v}");
    v
}

#[test]
fn bodies_must_be_json_objects_sent_as_application_json() {
    let dir = cynode_tests::tempdir().unwrap();
    let r = replica(dir.path());
    let valid = json!({ "objective": "say hi" }).to_string();

    // Accepted: application/json, with or without parameters.
    for ct in ["application/json", "Application/JSON; charset=utf-8"] {
        let ok = post(&r.base, "/v1/sessions", Some(ct), valid.as_bytes());
        assert_eq!(ok.0, 201, "{ok:?}");
    }

    // 415: another type, a form, or no Content-Type at all, on every body route.
    for path in [
        "/v1/sessions",
        "/v1/jobs:validate",
        "/v1/sessions/s-x/messages",
    ] {
        for ctype in [
            Some("text/plain"),
            Some("application/x-www-form-urlencoded"),
            None,
        ] {
            let a = post(&r.base, path, ctype, valid.as_bytes());
            let p = problem(&a, 415);
            // The one vocabulary (upstream's): a refused media type is `validation`.
            assert_eq!(p["type"], "urn:cynodeai:error:validation", "{p}");
        }
    }

    // 400: JSON that is not an object (serde would read an array as the struct).
    for body in [
        r#"["objective"]"#,
        r#"["objective", null, {}, null]"#,
        "\"objective\"",
        "42",
        "null",
    ] {
        for path in [
            "/v1/sessions",
            "/v1/jobs:validate",
            "/v1/sessions/s-x/messages",
        ] {
            let a = post(&r.base, path, Some("application/json"), body.as_bytes());
            let p = problem(&a, 400);
            assert_eq!(p["type"], "urn:cynodeai:error:validation", "{p}");
            assert!(
                p["detail"].as_str().unwrap().contains("JSON object"),
                "{body} to {path}: {p}"
            );
        }
    }
    // No session came out of any refused request.
    let (code, _, list) = raw(&r.base, "GET /v1/sessions HTTP/1.1", b"");
    assert_eq!(code, 200);
    assert_eq!(list.matches("\"session_id\"").count(), 2, "{list}");
}

#[test]
fn over_the_body_limit_is_413_problem_json_with_and_without_content_length() {
    let dir = cynode_tests::tempdir().unwrap();
    let r = replica(dir.path());
    let big = json!({ "objective": "x".repeat(8192) }).to_string();

    // With Content-Length: refused before the body is read.
    let a = post(
        &r.base,
        "/v1/sessions",
        Some("application/json"),
        big.as_bytes(),
    );
    let p = problem(&a, 413);
    assert_eq!(p["type"], "urn:cynodeai:error:validation", "{p}");
    assert!(p["detail"].as_str().unwrap().contains("2048"), "{p}");

    // Chunked, no Content-Length: refused while reading.
    let mut chunked = Vec::new();
    for part in big.as_bytes().chunks(1000) {
        chunked.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        chunked.extend_from_slice(part);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let a = raw(
        &r.base,
        "POST /v1/sessions HTTP/1.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked",
        &chunked,
    );
    let p = problem(&a, 413);
    assert_eq!(p["type"], "urn:cynodeai:error:validation", "{p}");

    // Other rejections of the framework are problem+json too.
    let a = raw(&r.base, "DELETE /v1/sessions HTTP/1.1", b"");
    let p = problem(&a, 405);
    assert_eq!(p["type"], "urn:cynodeai:error:validation", "{p}");
    let a = raw(&r.base, "GET /v1/sessions?bogus=1 HTTP/1.1", b"");
    let p = problem(&a, 400);
    assert_eq!(p["type"], "urn:cynodeai:error:validation", "{p}");
    let a = raw(&r.base, "GET /v1/no-such-route HTTP/1.1", b"");
    let p = problem(&a, 404);
    assert_eq!(p["type"], "urn:cynodeai:error:not_found", "{p}");
}
