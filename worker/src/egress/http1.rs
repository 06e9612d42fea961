//! The strict HTTP/1.1 the egress proxy accepts from a sandbox: a bounded request head
//! with CRLF line ends, no obs-fold, at most one framing (one `Content-Length`, or
//! `Transfer-Encoding: chunked` alone), and a target in absolute form (`http://…`) or, for
//! CONNECT, in authority form (`host:port`). Anything ambiguous is refused rather than
//! interpreted, so the proxy and the origin can never disagree on where a request ends.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};

use super::allowlist::{split_authority, Host, PatternError};

/// Headers a request head may carry (more is "too large").
pub const MAX_HEADERS: usize = 128;

/// A stream and the bytes already read from it but not yet used.
#[derive(Debug)]
pub struct BufConn<S> {
    pub stream: S,
    pub pending: Vec<u8>,
}

/// Why a head could not be read or is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    #[error("closed before a complete request head")]
    Closed,
    #[error("timed out waiting for the request head")]
    Timeout,
    #[error("request header too large")]
    TooLarge,
    #[error("malformed request: {0}")]
    Malformed(String),
    #[error("ambiguous request framing refused: {0}")]
    Smuggling(&'static str),
    #[error("read failed: {0}")]
    Io(String),
}

impl<S: AsyncRead + Unpin> BufConn<S> {
    pub fn new(stream: S) -> BufConn<S> {
        BufConn {
            stream,
            pending: Vec::new(),
        }
    }

    /// Reads more bytes into `pending`; `Ok(0)` at end of stream.
    pub async fn fill(&mut self, idle: Duration) -> Result<usize, HeadError> {
        let mut chunk = [0u8; 8192];
        let n = tokio::time::timeout(idle, self.stream.read(&mut chunk))
            .await
            .map_err(|_| HeadError::Timeout)?
            .map_err(|e| HeadError::Io(e.to_string()))?;
        self.pending.extend_from_slice(&chunk[..n]);
        Ok(n)
    }

    /// Reads a head (through the blank line) of at most `max` bytes and takes it out of
    /// `pending`; what follows stays there. `deadline` bounds the whole head.
    pub async fn read_head(
        &mut self,
        max: usize,
        deadline: Duration,
    ) -> Result<Vec<u8>, HeadError> {
        let until = tokio::time::Instant::now() + deadline;
        let mut searched = 0;
        loop {
            if let Some(end) = find(&self.pending[searched..], b"\r\n\r\n") {
                let end = searched + end + 4;
                if end > max {
                    return Err(HeadError::TooLarge);
                }
                return Ok(self.pending.drain(..end).collect());
            }
            if self.pending.len() > max {
                return Err(HeadError::TooLarge);
            }
            if bare_lf(&self.pending) {
                return Err(HeadError::Malformed("bare LF line end".into()));
            }
            searched = self.pending.len().saturating_sub(3);
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            if self.fill(left).await? == 0 {
                return Err(HeadError::Closed);
            }
        }
    }

    /// Reads one line through its CRLF, at most `max` bytes.
    pub async fn read_line(&mut self, max: usize, idle: Duration) -> Result<Vec<u8>, HeadError> {
        let mut searched = 0;
        loop {
            if let Some(end) = find(&self.pending[searched..], b"\r\n") {
                let end = searched + end + 2;
                if end > max {
                    return Err(HeadError::TooLarge);
                }
                return Ok(self.pending.drain(..end).collect());
            }
            if self.pending.len() > max {
                return Err(HeadError::TooLarge);
            }
            searched = self.pending.len().saturating_sub(1);
            if self.fill(idle).await? == 0 {
                return Err(HeadError::Closed);
            }
        }
    }
}

/// A LF not preceded by CR (which a head ending in bare LFs would never get past).
fn bare_lf(bytes: &[u8]) -> bool {
    bytes
        .iter()
        .enumerate()
        .any(|(i, b)| *b == b'\n' && (i == 0 || bytes[i - 1] != b'\r'))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// How a request body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    None,
    Length(u64),
    Chunked,
}

/// A parsed request head.
#[derive(Debug, Clone)]
pub struct RequestHead {
    pub method: String,
    pub target: String,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub version: u8,
    pub headers: Vec<(String, Vec<u8>)>,
    pub framing: Framing,
}

impl RequestHead {
    /// The values of header `name` (case-insensitive).
    pub fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }
}

/// Checks line ends and folding, then parses.
fn lines_ok(head: &[u8]) -> Result<(), HeadError> {
    for (i, b) in head.iter().enumerate() {
        if *b == b'\n' && (i == 0 || head[i - 1] != b'\r') {
            return Err(HeadError::Malformed("bare LF line end".into()));
        }
        if *b == b'\r' && head.get(i + 1) != Some(&b'\n') {
            return Err(HeadError::Malformed("bare CR".into()));
        }
        if *b == b'\n' && matches!(head.get(i + 1), Some(b' ' | b'\t')) {
            return Err(HeadError::Smuggling("obs-fold (folded header line)"));
        }
    }
    Ok(())
}

/// Parses and checks a request head (as returned by [`BufConn::read_head`]).
pub fn parse_request(head: &[u8]) -> Result<RequestHead, HeadError> {
    lines_ok(head)?;
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(HeadError::Malformed("incomplete".into())),
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooLarge),
        Err(e) => return Err(HeadError::Malformed(e.to_string())),
    }
    let method = req.method.unwrap_or_default().to_string();
    let target = req.path.unwrap_or_default().to_string();
    let version = req.version.unwrap_or(1);
    let headers: Vec<(String, Vec<u8>)> = req
        .headers
        .iter()
        .map(|h| (h.name.to_string(), h.value.to_vec()))
        .collect();
    let mut head = RequestHead {
        method,
        target,
        version,
        headers,
        framing: Framing::None,
    };
    head.framing = framing(&head)?;
    Ok(head)
}

fn framing(head: &RequestHead) -> Result<Framing, HeadError> {
    let lengths: Vec<&[u8]> = head.values("content-length").collect();
    let encodings: Vec<&[u8]> = head.values("transfer-encoding").collect();
    match (lengths.as_slice(), encodings.as_slice()) {
        ([], []) => Ok(Framing::None),
        ([_, _, ..], _) => Err(HeadError::Smuggling("more than one Content-Length")),
        ([_], [_, ..]) => Err(HeadError::Smuggling(
            "both Content-Length and Transfer-Encoding",
        )),
        ([len], []) => {
            let text = std::str::from_utf8(len).unwrap_or("");
            if text.is_empty() || text.len() > 19 || !text.bytes().all(|b| b.is_ascii_digit()) {
                return Err(HeadError::Smuggling("invalid Content-Length"));
            }
            text.parse()
                .map(Framing::Length)
                .map_err(|_| HeadError::Smuggling("invalid Content-Length"))
        }
        ([], [te]) if head.version == 1 && te.eq_ignore_ascii_case(b"chunked") => {
            Ok(Framing::Chunked)
        }
        ([], _) => Err(HeadError::Smuggling(
            "Transfer-Encoding other than a single `chunked` on HTTP/1.1",
        )),
    }
}

/// Where a plain (non-CONNECT) request goes: host, port and the origin-form target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub host: Host,
    pub port: u16,
    pub path: String,
}

/// Why a request target is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    #[error("not a proxy request: the target must be an absolute http:// URI")]
    NotAbsolute,
    #[error("https:// targets must be tunnelled with CONNECT")]
    Https,
    #[error("unsupported scheme (only http://, or CONNECT)")]
    Scheme,
    #[error("a fragment (`#`) is not accepted in a request target")]
    Fragment,
    #[error("CONNECT needs host:port")]
    ConnectPort,
    #[error("bad destination: {0}")]
    Host(#[from] PatternError),
}

/// Parses an absolute-form target `http://authority[/path][?query]`.
pub fn absolute_target(target: &str) -> Result<Target, TargetError> {
    if target.starts_with('/') || target == "*" {
        return Err(TargetError::NotAbsolute);
    }
    if target.contains('#') {
        return Err(TargetError::Fragment);
    }
    let lower_scheme = target
        .get(..8)
        .map(|s| s.to_ascii_lowercase())
        .unwrap_or_default();
    let rest = if lower_scheme.starts_with("http://") {
        &target[7..]
    } else if lower_scheme.starts_with("https://") {
        return Err(TargetError::Https);
    } else {
        return Err(TargetError::Scheme);
    };
    let split = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(split);
    let path = if path.is_empty() {
        "/".to_string()
    } else if path.starts_with('?') {
        format!("/{path}")
    } else {
        path.to_string()
    };
    let (host, port) = split_authority(authority)?;
    Ok(Target {
        host,
        port: port.unwrap_or(80),
        path,
    })
}

/// Parses a CONNECT target `host:port`.
pub fn connect_target(target: &str) -> Result<(Host, u16), TargetError> {
    match split_authority(target)? {
        (host, Some(port)) => Ok((host, port)),
        (_, None) => Err(TargetError::ConnectPort),
    }
}

/// Headers that belong to one hop and are never forwarded, besides those the
/// `Connection` header names and every `Proxy-*` header.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "host",
    "expect",
];

/// The request head sent upstream: origin-form target, `Host` from the target, hop-by-hop
/// and `Proxy-*` headers removed, `Connection: close`.
pub fn upstream_request(head: &RequestHead, target: &Target) -> Vec<u8> {
    let named: Vec<String> = head
        .values("connection")
        .flat_map(|v| {
            String::from_utf8_lossy(v)
                .split(',')
                .map(|t| t.trim().to_ascii_lowercase())
                .collect::<Vec<_>>()
        })
        .filter(|t| !t.is_empty())
        .collect();
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(format!("{} {} HTTP/1.1\r\n", head.method, target.path).as_bytes());
    let host = match target.port {
        80 => target.host.to_string(),
        p => format!("{}:{p}", target.host),
    };
    out.extend_from_slice(format!("Host: {host}\r\n").as_bytes());
    for (name, value) in &head.headers {
        let lower = name.to_ascii_lowercase();
        let framing = lower == "content-length" || lower == "transfer-encoding";
        if !framing
            && (HOP_BY_HOP.contains(&lower.as_str())
                || lower.starts_with("proxy-")
                || named.contains(&lower))
        {
            continue;
        }
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"Connection: close\r\n\r\n");
    out
}

/// A response head from upstream, rewritten for the sandbox: hop-by-hop headers removed
/// (the framing headers kept), `Connection: close`. Returns the head and its status.
pub fn downstream_response(head: &[u8]) -> Result<(Vec<u8>, u16), HeadError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    match resp.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(HeadError::Malformed("incomplete".into())),
        Err(e) => return Err(HeadError::Malformed(format!("upstream response: {e}"))),
    }
    let code = resp.code.unwrap_or(502);
    let reason = resp.reason.unwrap_or("");
    let mut out = Vec::with_capacity(head.len() + 32);
    out.extend_from_slice(format!("HTTP/1.1 {code} {reason}\r\n").as_bytes());
    for h in resp.headers.iter() {
        let lower = h.name.to_ascii_lowercase();
        let framing = lower == "content-length" || lower == "transfer-encoding";
        if !framing && (HOP_BY_HOP.contains(&lower.as_str()) || lower.starts_with("proxy-")) {
            continue;
        }
        if lower == "host" {
            continue;
        }
        out.extend_from_slice(h.name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"Connection: close\r\n\r\n");
    Ok((out, code))
}

/// Parses a chunk-size line (`1a;ext\r\n`): hex digits, at most 15 of them.
pub fn chunk_size(line: &[u8]) -> Result<u64, HeadError> {
    let body = line
        .strip_suffix(b"\r\n")
        .ok_or(HeadError::Smuggling("bad chunk size line"))?;
    let digits = body.split(|b| *b == b';').next().unwrap_or_default();
    if digits.is_empty() || digits.len() > 15 || !digits.iter().all(u8::is_ascii_hexdigit) {
        return Err(HeadError::Smuggling("bad chunk size"));
    }
    let text = std::str::from_utf8(digits).map_err(|_| HeadError::Smuggling("bad chunk size"))?;
    u64::from_str_radix(text, 16).map_err(|_| HeadError::Smuggling("bad chunk size"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<RequestHead, HeadError> {
        parse_request(s.as_bytes())
    }

    #[test]
    fn framing_is_unambiguous_or_refused() {
        let ok = parse("POST http://a.com/x HTTP/1.1\r\nHost: a.com\r\nContent-Length: 5\r\n\r\n")
            .unwrap();
        assert_eq!(ok.framing, Framing::Length(5));
        let ok =
            parse("POST http://a.com/ HTTP/1.1\r\nTransfer-Encoding: Chunked\r\n\r\n").unwrap();
        assert_eq!(ok.framing, Framing::Chunked);
        for (bad, expected) in [
            (
                "POST http://a.com/ HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
                HeadError::Smuggling("both Content-Length and Transfer-Encoding"),
            ),
            (
                "POST http://a.com/ HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
                HeadError::Smuggling("more than one Content-Length"),
            ),
            (
                "POST http://a.com/ HTTP/1.1\r\nContent-Length: +5\r\n\r\n",
                HeadError::Smuggling("invalid Content-Length"),
            ),
            (
                "POST http://a.com/ HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\n",
                HeadError::Smuggling("invalid Content-Length"),
            ),
            (
                "POST http://a.com/ HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
                HeadError::Smuggling("Transfer-Encoding other than a single `chunked` on HTTP/1.1"),
            ),
            (
                "POST http://a.com/ HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
                HeadError::Smuggling("Transfer-Encoding other than a single `chunked` on HTTP/1.1"),
            ),
            (
                "GET http://a.com/ HTTP/1.1\r\nX-A: 1\r\n  folded\r\n\r\n",
                HeadError::Smuggling("obs-fold (folded header line)"),
            ),
        ] {
            assert_eq!(parse(bad).unwrap_err(), expected, "{bad:?}");
        }
        assert!(matches!(
            parse("GET http://a.com/ HTTP/1.1\nHost: a\n\n"),
            Err(HeadError::Malformed(_))
        ));
        assert!(matches!(
            parse("GET http://a.com/ HTTP/1.1\r\nX: a\rb\r\n\r\n"),
            Err(HeadError::Malformed(_))
        ));
        let many = format!(
            "GET http://a.com/ HTTP/1.1\r\n{}\r\n",
            (0..200)
                .map(|i| format!("X-{i}: v\r\n"))
                .collect::<String>()
        );
        assert_eq!(parse(&many).unwrap_err(), HeadError::TooLarge);
    }

    #[test]
    fn targets_are_absolute_http_or_connect_authorities() {
        let t = absolute_target("http://PyPI.org./simple/?x=1").unwrap();
        assert_eq!(t.host, Host::Name("pypi.org".into()));
        assert_eq!((t.port, t.path.as_str()), (80, "/simple/?x=1"));
        let t = absolute_target("http://a.com:8080?q").unwrap();
        assert_eq!((t.port, t.path.as_str()), (8080, "/?q"));
        assert_eq!(absolute_target("http://[::1]:81").unwrap().port, 81);
        assert_eq!(absolute_target("/x"), Err(TargetError::NotAbsolute));
        assert_eq!(absolute_target("https://a.com/"), Err(TargetError::Https));
        assert_eq!(absolute_target("ftp://a.com/"), Err(TargetError::Scheme));
        assert_eq!(
            absolute_target("http://a.com/#f"),
            Err(TargetError::Fragment)
        );
        assert!(matches!(
            absolute_target("http://u:p@a.com/"),
            Err(TargetError::Host(PatternError::UserInfo(_)))
        ));
        assert!(absolute_target("http://127.1/").is_err());
        assert_eq!(
            connect_target("a.com:443").unwrap(),
            (Host::Name("a.com".into()), 443)
        );
        assert_eq!(connect_target("a.com"), Err(TargetError::ConnectPort));
    }

    #[test]
    fn hop_by_hop_and_proxy_headers_are_not_forwarded() {
        let head = parse(
            "GET http://a.com:8080/p HTTP/1.1\r\nHost: evil.com\r\nProxy-Authorization: Basic eA==\r\nConnection: keep-alive, X-Secret\r\nX-Secret: s\r\nKeep-Alive: 5\r\nAccept: */*\r\n\r\n",
        )
        .unwrap();
        let t = absolute_target(&head.target).unwrap();
        let out = String::from_utf8(upstream_request(&head, &t)).unwrap();
        assert_eq!(
            out,
            "GET /p HTTP/1.1\r\nHost: a.com:8080\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        );
    }

    #[test]
    fn chunk_sizes_are_strict() {
        assert_eq!(chunk_size(b"1a\r\n").unwrap(), 26);
        assert_eq!(chunk_size(b"0;ext=1\r\n").unwrap(), 0);
        for bad in [
            &b"\r\n"[..],
            b"-1\r\n",
            b"1a\n",
            b"0x1\r\n",
            b"ffffffffffffffff\r\n",
        ] {
            assert!(chunk_size(bad).is_err(), "{bad:?}");
        }
    }
}
