//! Lifecycle callbacks: POST `{"status":"in_progress",…}` and `{"status":"completed",…}` to
//! `SBA_JOB_STATUS_URL` (design.md §3.3).
//!
//! A deliberately tiny HTTP/1.1 client (one POST, `Connection: close`, bounded time) over
//! TCP (`http://host:port/path`) or a Unix socket (`http+unix://<percent-encoded socket
//! path>/path`), so the runner needs no HTTP stack and works with no network at all.
//! Callbacks are best effort: a failure is logged, never fails the job.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// Bound on connecting, sending and reading the answer.
pub const CALLBACK_TIMEOUT: Duration = Duration::from_secs(5);

/// Where callbacks go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Tcp { authority: String, path: String },
    Unix { socket: String, path: String },
}

/// Parses `http://…` or `http+unix://…`.
pub fn parse_url(url: &str) -> Result<Target, String> {
    if let Some(rest) = url.strip_prefix("http+unix://") {
        let (sock, path) = split_path(rest);
        let socket = percent_decode(sock)?;
        if socket.is_empty() {
            return Err(format!("no socket path in `{url}`"));
        }
        return Ok(Target::Unix { socket, path });
    }
    if let Some(rest) = url.strip_prefix("http://") {
        let (authority, path) = split_path(rest);
        if authority.is_empty() {
            return Err(format!("no host in `{url}`"));
        }
        return Ok(Target::Tcp {
            authority: authority.to_string(),
            path,
        });
    }
    Err(format!(
        "unsupported callback url `{url}`: expected http:// or http+unix://"
    ))
}

fn split_path(rest: &str) -> (&str, String) {
    match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].to_string()),
        None => (rest, "/".to_string()),
    }
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent escape in `{s}`"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("socket path in `{s}` is not UTF-8"))
}

/// POSTs `body` as JSON; returns the HTTP status code.
pub fn post(target: &Target, body: &[u8]) -> std::io::Result<u16> {
    match target {
        Target::Tcp { authority, path } => {
            let addr = authority
                .to_socket_addrs()?
                .next()
                .ok_or_else(|| std::io::Error::other("address resolved to nothing"))?;
            let mut s = TcpStream::connect_timeout(&addr, CALLBACK_TIMEOUT)?;
            s.set_read_timeout(Some(CALLBACK_TIMEOUT))?;
            s.set_write_timeout(Some(CALLBACK_TIMEOUT))?;
            exchange(&mut s, authority, path, body)
        }
        Target::Unix { socket, path } => {
            let mut s = UnixStream::connect(socket)?;
            s.set_read_timeout(Some(CALLBACK_TIMEOUT))?;
            s.set_write_timeout(Some(CALLBACK_TIMEOUT))?;
            exchange(&mut s, "localhost", path, body)
        }
    }
}

fn exchange<S: Read + Write>(
    s: &mut S,
    host: &str,
    path: &str,
    body: &[u8],
) -> std::io::Result<u16> {
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\nUser-Agent: cynode-sba\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    s.flush()?;
    let mut buf = [0u8; 256];
    let mut got = Vec::new();
    while !got.windows(2).any(|w| w == b"\r\n") && got.len() < 256 {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&got);
    line.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| {
            std::io::Error::other(format!(
                "bad status line `{}`",
                line.lines().next().unwrap_or("")
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse() {
        assert_eq!(
            parse_url("http://127.0.0.1:8080/v1/status").unwrap(),
            Target::Tcp {
                authority: "127.0.0.1:8080".into(),
                path: "/v1/status".into()
            }
        );
        assert_eq!(
            parse_url("http+unix://%2Frun%2Fcynode%2Fjob.sock/status").unwrap(),
            Target::Unix {
                socket: "/run/cynode/job.sock".into(),
                path: "/status".into()
            }
        );
        assert!(parse_url("https://x").is_err());
        assert!(parse_url("http+unix://%zz/").is_err());
    }
}
