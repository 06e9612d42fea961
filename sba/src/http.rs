//! A deliberately tiny blocking HTTP/1.1 client for the three things the runner talks to:
//! lifecycle callbacks, the inference endpoint and the node's gateway socket.
//!
//! One request per connection (`Connection: close`) over TCP (`http://host:port/path`) or a
//! Unix socket (`http+unix://<percent-encoded socket path>/path`), so the runner needs no
//! HTTP stack and works in a sandbox with no network at all. Every call is bounded: an
//! absolute deadline (socket timeouts are re-armed from it before each read and write, in
//! short slices so an interrupt flag is seen promptly) and a cap on the response body.
//! Bodies with `Content-Length`, `Transfer-Encoding: chunked` or neither (read to EOF)
//! are understood; nothing else of HTTP is.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Longest a single blocking read or write waits before the deadline and the interrupt
/// flag are checked again.
const SLICE: Duration = Duration::from_millis(200);
/// Cap on the status line plus headers.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Where a request goes: the connection and the path prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Tcp { authority: String, path: String },
    Unix { socket: String, path: String },
}

/// Why a request did not produce a response.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("cannot connect: {0}")]
    Connect(std::io::Error),
    #[error("i/o error: {0}")]
    Io(std::io::Error),
    #[error("deadline reached")]
    Timeout,
    #[error("interrupted")]
    Interrupted,
    #[error("response body over the cap of {0} bytes")]
    TooLarge(usize),
    #[error("malformed response: {0}")]
    Malformed(String),
}

/// A complete response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

/// Bounds of one request.
#[derive(Debug, Clone, Copy)]
pub struct Limits<'a> {
    pub deadline: Instant,
    pub max_body: usize,
    /// Set when the runner is asked to stop: the request ends with [`HttpError::Interrupted`].
    pub cancel: Option<&'a AtomicBool>,
}

/// Why a URL cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    #[error("no socket path in `{0}`")]
    NoSocket(String),
    #[error("no host in `{0}`")]
    NoHost(String),
    #[error("unsupported url `{0}`: expected http:// or http+unix://")]
    Unsupported(String),
    #[error("bad percent escape in `{0}`")]
    BadEscape(String),
    #[error("socket path in `{0}` is not UTF-8")]
    NotUtf8(String),
}

/// Parses `http://…` or `http+unix://…`.
pub fn parse_url(url: &str) -> Result<Target, UrlError> {
    if let Some(rest) = url.strip_prefix("http+unix://") {
        let (sock, path) = split_path(rest);
        let socket = percent_decode(sock)?;
        if socket.is_empty() {
            return Err(UrlError::NoSocket(url.to_string()));
        }
        return Ok(Target::Unix { socket, path });
    }
    if let Some(rest) = url.strip_prefix("http://") {
        let (authority, path) = split_path(rest);
        if authority.is_empty() {
            return Err(UrlError::NoHost(url.to_string()));
        }
        return Ok(Target::Tcp {
            authority: authority.to_string(),
            path,
        });
    }
    Err(UrlError::Unsupported(url.to_string()))
}

fn split_path(rest: &str) -> (&str, String) {
    match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].to_string()),
        None => (rest, "/".to_string()),
    }
}

fn percent_decode(s: &str) -> Result<String, UrlError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| UrlError::BadEscape(s.to_string()))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| UrlError::NotUtf8(s.to_string()))
}

impl Target {
    /// The path part of the URL.
    pub fn path(&self) -> &str {
        match self {
            Target::Tcp { path, .. } | Target::Unix { path, .. } => path,
        }
    }

    /// The same connection with another path.
    pub fn with_path(&self, new: &str) -> Target {
        match self {
            Target::Tcp { authority, .. } => Target::Tcp {
                authority: authority.clone(),
                path: new.to_string(),
            },
            Target::Unix { socket, .. } => Target::Unix {
                socket: socket.clone(),
                path: new.to_string(),
            },
        }
    }

    /// The URL again, for messages (percent-encoding of the socket path is not redone).
    pub fn display(&self) -> String {
        match self {
            Target::Tcp { authority, path } => format!("http://{authority}{path}"),
            Target::Unix { socket, path } => format!("http+unix://{socket}{path}"),
        }
    }
}

/// Sends one request and reads the whole response within `lim`.
pub fn send(
    target: &Target,
    method: &str,
    body: Option<&[u8]>,
    lim: &Limits<'_>,
) -> Result<Response, HttpError> {
    send_with(target, method, body, &[("Accept", "application/json")], lim)
}

/// [`send`] with the caller's extra headers (fixed names and values of the runner's own,
/// never taken from a job or a model: no CR or LF is checked for).
pub fn send_with(
    target: &Target,
    method: &str,
    body: Option<&[u8]>,
    headers: &[(&str, &str)],
    lim: &Limits<'_>,
) -> Result<Response, HttpError> {
    let (mut stream, host) = connect(target, lim)?;
    let mut head = format!(
        "{method} {} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nUser-Agent: cynode-sba\r\n",
        target.path()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    head.push_str("\r\n");
    let mut conn = Conn {
        stream: &mut stream,
        lim,
        buf: Vec::new(),
    };
    conn.write_all(head.as_bytes())?;
    if let Some(b) = body {
        conn.write_all(b)?;
    }
    conn.read_response()
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn arm(&self, lim: &Limits<'_>) -> Result<(), HttpError> {
        if lim.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(HttpError::Interrupted);
        }
        let left = lim.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(HttpError::Timeout);
        }
        let slice = Some(left.min(SLICE));
        let r = match self {
            Stream::Tcp(s) => s
                .set_read_timeout(slice)
                .and_then(|()| s.set_write_timeout(slice)),
            Stream::Unix(s) => s
                .set_read_timeout(slice)
                .and_then(|()| s.set_write_timeout(slice)),
        };
        r.map_err(HttpError::Io)
    }
}

fn connect(target: &Target, lim: &Limits<'_>) -> Result<(Stream, String), HttpError> {
    match target {
        Target::Tcp { authority, .. } => {
            let addr = resolve(authority).map_err(HttpError::Connect)?;
            let left = lim.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(HttpError::Timeout);
            }
            let s = TcpStream::connect_timeout(&addr, left).map_err(|e| {
                if e.kind() == std::io::ErrorKind::TimedOut {
                    HttpError::Timeout
                } else {
                    HttpError::Connect(e)
                }
            })?;
            let _ = s.set_nodelay(true);
            Ok((Stream::Tcp(s), authority.clone()))
        }
        Target::Unix { socket, .. } => {
            let s = UnixStream::connect(socket).map_err(HttpError::Connect)?;
            Ok((Stream::Unix(s), "localhost".into()))
        }
    }
}

/// `localhost` is resolved here, not through NSS: a static binary's resolver may not read
/// /etc/hosts, and a sandbox with no network has nothing else to ask anyway.
fn resolve(authority: &str) -> std::io::Result<SocketAddr> {
    let (host, port) = authority.rsplit_once(':').unwrap_or((authority, "80"));
    let port: u16 = port
        .parse()
        .map_err(|_| std::io::Error::other(format!("bad port in `{authority}`")))?;
    if host.eq_ignore_ascii_case("localhost") {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (host, port)
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other(format!("`{authority}` resolved to nothing")))
}

struct Conn<'s, 'l> {
    stream: &'s mut Stream,
    lim: &'l Limits<'l>,
    buf: Vec<u8>,
}

fn is_retry(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock
            | std::io::ErrorKind::TimedOut
            | std::io::ErrorKind::Interrupted
    )
}

impl Conn<'_, '_> {
    fn write_all(&mut self, mut data: &[u8]) -> Result<(), HttpError> {
        while !data.is_empty() {
            self.stream.arm(self.lim)?;
            let r = match self.stream {
                Stream::Tcp(s) => s.write(data),
                Stream::Unix(s) => s.write(data),
            };
            match r {
                Ok(0) => return Err(HttpError::Io(std::io::ErrorKind::WriteZero.into())),
                Ok(n) => data = &data[n..],
                Err(e) if is_retry(&e) => {}
                Err(e) => return Err(HttpError::Io(e)),
            }
        }
        Ok(())
    }

    /// Reads more bytes into the buffer; `Ok(false)` at EOF.
    fn fill(&mut self) -> Result<bool, HttpError> {
        let mut chunk = [0u8; 16 * 1024];
        loop {
            self.stream.arm(self.lim)?;
            let r = match self.stream {
                Stream::Tcp(s) => s.read(&mut chunk),
                Stream::Unix(s) => s.read(&mut chunk),
            };
            match r {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return Ok(true);
                }
                Err(e) if is_retry(&e) => {}
                Err(e) => return Err(HttpError::Io(e)),
            }
        }
    }

    /// Takes one CRLF-terminated line (without the CRLF) off the buffer.
    fn line(&mut self, cap: usize) -> Result<String, HttpError> {
        loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line = String::from_utf8_lossy(&self.buf[..i]).into_owned();
                self.buf.drain(..i + 2);
                return Ok(line);
            }
            if self.buf.len() > cap {
                return Err(HttpError::Malformed("header line too long".into()));
            }
            if !self.fill()? {
                return Err(HttpError::Malformed("connection closed mid-header".into()));
            }
        }
    }

    fn take(&mut self, n: usize) -> Result<Vec<u8>, HttpError> {
        while self.buf.len() < n {
            if !self.fill()? {
                return Err(HttpError::Malformed("connection closed mid-body".into()));
            }
        }
        Ok(self.buf.drain(..n).collect())
    }

    fn read_response(&mut self) -> Result<Response, HttpError> {
        let status_line = self.line(MAX_HEAD_BYTES)?;
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| HttpError::Malformed(format!("bad status line `{status_line}`")))?;
        let mut length: Option<usize> = None;
        let mut chunked = false;
        let mut head_bytes = status_line.len();
        loop {
            let line = self.line(MAX_HEAD_BYTES)?;
            head_bytes += line.len() + 2;
            if head_bytes > MAX_HEAD_BYTES {
                return Err(HttpError::Malformed("headers too long".into()));
            }
            if line.is_empty() {
                break;
            }
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                length =
                    Some(value.parse().map_err(|_| {
                        HttpError::Malformed(format!("bad content-length `{value}`"))
                    })?);
            } else if name.eq_ignore_ascii_case("transfer-encoding")
                && value.to_ascii_lowercase().contains("chunked")
            {
                chunked = true;
            }
        }
        let max = self.lim.max_body;
        let body = if chunked {
            let mut body = Vec::new();
            loop {
                let size_line = self.line(1024)?;
                let hex = size_line.split(';').next().unwrap_or("").trim();
                let size = usize::from_str_radix(hex, 16)
                    .map_err(|_| HttpError::Malformed(format!("bad chunk size `{hex}`")))?;
                if size == 0 {
                    while !self.line(MAX_HEAD_BYTES)?.is_empty() {}
                    break;
                }
                if body.len() + size > max {
                    return Err(HttpError::TooLarge(max));
                }
                body.extend(self.take(size)?);
                self.line(16)?;
            }
            body
        } else if let Some(n) = length {
            if n > max {
                return Err(HttpError::TooLarge(max));
            }
            self.take(n)?
        } else {
            while self.fill()? {
                if self.buf.len() > max {
                    return Err(HttpError::TooLarge(max));
                }
            }
            std::mem::take(&mut self.buf)
        };
        Ok(Response { status, body })
    }
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
        assert_eq!(parse_url("http://h:1").unwrap().path(), "/");
        assert!(parse_url("https://x").is_err());
        assert!(parse_url("http+unix://%zz/").is_err());
    }

    fn serve_once(reply: &'static [u8]) -> (String, std::thread::JoinHandle<Vec<u8>>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let h = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut got = Vec::new();
            let mut b = [0u8; 4096];
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut b).unwrap();
                got.extend_from_slice(&b[..n]);
            }
            s.write_all(reply).unwrap();
            got
        });
        (addr, h)
    }

    fn lim(max_body: usize) -> Limits<'static> {
        Limits {
            deadline: Instant::now() + Duration::from_secs(5),
            max_body,
            cancel: None,
        }
    }

    #[test]
    fn reads_chunked_and_sized_bodies() {
        let (addr, h) = serve_once(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n",
        );
        let t = parse_url(&format!("http://{addr}/p")).unwrap();
        let r = send(&t, "GET", None, &lim(100)).unwrap();
        assert_eq!(
            r,
            Response {
                status: 200,
                body: b"abcde".to_vec()
            }
        );
        let req = String::from_utf8(h.join().unwrap()).unwrap();
        assert!(req.starts_with("GET /p HTTP/1.1\r\n"), "{req}");

        let (addr, _h) = serve_once(b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\nno");
        let t = parse_url(&format!("http://{addr}/")).unwrap();
        let r = send(&t, "POST", Some(b"{}"), &lim(100)).unwrap();
        assert_eq!((r.status, r.body), (404, b"no".to_vec()));
    }

    #[test]
    fn caps_the_body() {
        let (addr, _h) = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789");
        let t = parse_url(&format!("http://{addr}/")).unwrap();
        assert!(matches!(
            send(&t, "GET", None, &lim(5)),
            Err(HttpError::TooLarge(5))
        ));
    }

    #[test]
    fn a_silent_server_times_out_at_the_deadline() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let t = parse_url(&format!("http://{}/", l.local_addr().unwrap())).unwrap();
        let start = Instant::now();
        let r = send(
            &t,
            "GET",
            None,
            &Limits {
                deadline: Instant::now() + Duration::from_millis(300),
                max_body: 10,
                cancel: None,
            },
        );
        assert!(matches!(r, Err(HttpError::Timeout)), "{r:?}");
        assert!(start.elapsed() < Duration::from_secs(2));
        drop(l);
    }
}
