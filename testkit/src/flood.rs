//! Connection floods for the listener tests, and what the flooded process holds.
//!
//! [`open`] makes connections that never finish a request: silent ones, slowloris heads,
//! huge heads. [`closed_within`] counts how many of them the server has closed by a
//! deadline. [`held_descriptors`] and [`rss_kib`] read a process's open descriptors and
//! resident memory from `/proc`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// What each flooding connection sends before it stalls.
#[derive(Debug, Clone, Copy)]
pub enum Stall {
    /// Nothing at all (over TLS: no handshake either).
    Silent,
    /// The start of a request head, never finished (slowloris).
    PartialHead,
    /// A request head of about this many bytes, never finished.
    HugeHead(usize),
}

/// The bytes a [`Stall`] sends.
pub fn stall_bytes(stall: Stall) -> Vec<u8> {
    match stall {
        Stall::Silent => Vec::new(),
        Stall::PartialHead => b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: a".to_vec(),
        Stall::HugeHead(n) => {
            let mut h = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: ".to_vec();
            h.resize(n, b'a');
            h
        }
    }
}

/// `n` TCP connections to `addr` that each send `stall` and stop. A write the server no
/// longer reads gives up after two seconds (the connection stays open).
pub fn open(addr: &str, n: usize, stall: Stall) -> Vec<TcpStream> {
    let bytes = stall_bytes(stall);
    (0..n)
        .filter_map(|_| {
            let mut s = TcpStream::connect(addr).ok()?;
            s.set_write_timeout(Some(Duration::from_secs(2))).ok()?;
            let _ = s.write_all(&bytes);
            Some(s)
        })
        .collect()
}

/// How many of `streams` the server has closed by `limit` from now (a read returns end of
/// file or an error other than a timeout; anything it answered first is read and dropped).
pub fn closed_within<S: Read>(
    streams: Vec<S>,
    limit: Duration,
    set_timeout: impl Fn(&S, Duration),
) -> usize {
    let until = Instant::now() + limit;
    let mut closed = 0;
    for mut s in streams {
        let mut buf = [0u8; 8192];
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            set_timeout(&s, left);
            match s.read(&mut buf) {
                Ok(0) => {
                    closed += 1;
                    break;
                }
                Ok(_) => continue,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    break
                }
                Err(_) => {
                    closed += 1;
                    break;
                }
            }
        }
    }
    closed
}

/// [`closed_within`] for TCP streams.
pub fn tcp_closed_within(streams: Vec<TcpStream>, limit: Duration) -> usize {
    closed_within(streams, limit, |s, d| {
        let _ = s.set_read_timeout(Some(d));
    })
}

/// Asks `/healthz` once on a kept-alive connection to `addr`, then nothing more: whether the
/// server closed it within `limit` (its idle timeout plus slack).
///
/// # Panics
/// When the connection or its first answer fails.
pub fn idle_keepalive_closed_within(addr: &str, limit: Duration) -> bool {
    let mut idle = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap_or_else(|e| panic!("send the request: {e}"));
    idle.set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap_or_else(|e| panic!("read timeout: {e}"));
    let mut first = [0u8; 12];
    idle.read_exact(&mut first)
        .unwrap_or_else(|e| panic!("the first answer: {e}"));
    assert_eq!(&first, b"HTTP/1.1 200");
    tcp_closed_within(vec![idle], limit) == 1
}

/// The number of descriptors process `pid` holds open.
///
/// # Panics
/// When `/proc/<pid>/fd` cannot be read.
pub fn held_descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/fd: {e}"))
        .count()
}

/// What process `pid`'s descriptors are, counted by kind (`socket`, `pipe`, `/dev/loop`,
/// `anon_inode:[pidfd]`, a path's first two components…): for a failure message.
pub fn descriptor_kinds(pid: u32) -> std::collections::BTreeMap<String, usize> {
    let mut kinds = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let target = std::fs::read_link(e.path())
            .map(|t| t.display().to_string())
            .unwrap_or_else(|_| "?".into());
        let kind = if target.starts_with('/') {
            target.split('/').take(3).collect::<Vec<_>>().join("/")
        } else if target.starts_with("anon_inode:") {
            target
        } else {
            target.split(':').next().unwrap_or_default().to_string()
        };
        *kinds.entry(kind).or_insert(0) += 1;
    }
    kinds
}

/// The resident memory of process `pid` (`VmRSS`), in KiB.
///
/// # Panics
/// When `/proc/<pid>/status` cannot be read or has no `VmRSS`.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status"))
}
