//! Moving a connection's bytes one way, from one socket to another, for the egress proxy:
//! bounded by the job's byte budget and by the connection's idle timeout, in both the wait
//! for bytes to read and the wait for room to write them.
//!
//! The bytes go from socket to socket through a pipe with splice(2), so they never enter
//! the node's memory: the kernel moves page references instead of copying each byte out of
//! the kernel and back in. Only when no pipe can be made (out of descriptors) does a
//! connection fall back to a userspace buffer, with the same bounds.
//!
//! Every chunk read is taken from the job's budget before any of it is written, and only
//! what the budget grants is written: the job's connections together carry exactly their
//! budget and no byte more, and the connection that reaches it is cut. The
//! per-connection counters count what was written.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rustix::pipe::{PipeFlags, SpliceFlags};
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The pipe's capacity asked for (the kernel rounds it to pages; an unprivileged node may
/// get less). One chunk is at most this much.
const PIPE_SIZE: usize = 1024 * 1024;
/// The buffer of the fallback copy.
const COPY_BUF: usize = 256 * 1024;

/// Bytes carried so far against a ceiling, for all of a job's connections.
#[derive(Debug)]
pub(super) struct Budget {
    used: AtomicU64,
    max: u64,
}

impl Budget {
    pub(super) fn new(max: u64) -> Budget {
        Budget {
            used: AtomicU64::new(0),
            max,
        }
    }

    /// Counts `n` more bytes, all or none: false when they do not all fit, and then the
    /// budget is spent (nothing more goes through for the job).
    pub(super) fn charge(&self, n: usize) -> bool {
        let n = n as u64;
        let fits = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                used.checked_add(n).filter(|&after| after <= self.max)
            })
            .is_ok();
        if !fits {
            self.used.fetch_max(self.max, Ordering::Relaxed);
        }
        fits
    }

    /// Takes up to `n` bytes from the budget and returns how many it granted; fewer than
    /// `n` means the budget is now spent.
    fn take(&self, n: usize) -> usize {
        let mut granted = 0;
        let _ = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                granted = self.max.saturating_sub(used).min(n as u64);
                Some(used + granted)
            });
        granted as usize
    }

    pub(super) fn spent(&self) -> bool {
        self.used() >= self.max
    }

    /// Bytes charged so far (never more than the budget).
    pub(super) fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }
}

/// Why copying stopped early.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Stop {
    Idle,
    Budget,
    Io(String),
}

impl Stop {
    pub(super) fn reason(&self) -> String {
        match self {
            Stop::Idle => "idle timeout".into(),
            Stop::Budget => "byte budget exhausted".into(),
            Stop::Io(e) => format!("connection error: {e}"),
        }
    }
}

/// The last time either direction of a connection moved a byte.
pub(super) struct Activity {
    start: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    pub(super) fn new() -> Activity {
        Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn idle_for(&self) -> Duration {
        let now = self.start.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last_ms.load(Ordering::Relaxed)))
    }
}

/// One direction of a connection and its bounds.
pub(super) struct Pump<'a> {
    pub(super) from: &'a TcpStream,
    pub(super) to: &'a TcpStream,
    pub(super) budget: &'a Budget,
    pub(super) idle: Duration,
    /// Bytes written to `to`.
    pub(super) counter: &'a AtomicU64,
    /// Shared by both directions: a connection is idle when neither moves.
    pub(super) activity: &'a Activity,
}

impl Pump<'_> {
    /// Copies `from` to `to` until `from` ends (then shuts `to`'s writing side down), the
    /// connection is idle in both directions for the idle timeout, or the budget is spent.
    pub(super) async fn run(self) -> Result<(), Stop> {
        match Pipe::new() {
            Ok(pipe) => self.spliced(&pipe).await,
            Err(e) => {
                tracing::debug!(target: "cynode_worker::egress", error = %e,
                    "no pipe for splice, copying through a buffer");
                self.copied().await
            }
        }
    }

    async fn spliced(&self, pipe: &Pipe) -> Result<(), Stop> {
        let flags = SpliceFlags::NONBLOCK | SpliceFlags::MOVE;
        loop {
            // The pipe is empty here: an EAGAIN can only mean the socket has nothing.
            let n = self
                .io(self.from, Interest::READABLE, || {
                    rustix::pipe::splice(self.from.as_fd(), None, &pipe.w, None, pipe.size, flags)
                        .map_err(io::Error::from)
                })
                .await?;
            if n == 0 {
                shutdown_write(self.to);
                return Ok(());
            }
            self.activity.touch();
            // What is not granted stays in the pipe, which goes with the connection.
            let granted = self.budget.take(n);
            let mut left = granted;
            while left > 0 {
                let m = self
                    .io(self.to, Interest::WRITABLE, || {
                        rustix::pipe::splice(&pipe.r, None, self.to.as_fd(), None, left, flags)
                            .map_err(io::Error::from)
                    })
                    .await?;
                if m == 0 {
                    return Err(Stop::Io("the socket took no bytes".into()));
                }
                left -= m;
                self.counter.fetch_add(m as u64, Ordering::Relaxed);
                self.activity.touch();
            }
            if granted < n {
                return Err(Stop::Budget);
            }
        }
    }

    async fn copied(&self) -> Result<(), Stop> {
        let mut buf = vec![0u8; COPY_BUF];
        loop {
            let n = self
                .io(self.from, Interest::READABLE, || {
                    rustix::io::read(self.from, &mut buf[..]).map_err(io::Error::from)
                })
                .await?;
            if n == 0 {
                shutdown_write(self.to);
                return Ok(());
            }
            self.activity.touch();
            let granted = self.budget.take(n);
            let mut done = 0;
            while done < granted {
                let m = self
                    .io(self.to, Interest::WRITABLE, || {
                        rustix::io::write(self.to, &buf[done..granted]).map_err(io::Error::from)
                    })
                    .await?;
                if m == 0 {
                    return Err(Stop::Io("the socket took no bytes".into()));
                }
                done += m;
                self.counter.fetch_add(m as u64, Ordering::Relaxed);
                self.activity.touch();
            }
            if granted < n {
                return Err(Stop::Budget);
            }
        }
    }

    /// Runs the non-blocking `op` on `socket` once it is ready for `interest`, waiting no
    /// longer than the connection's idle timeout since either direction last moved.
    async fn io<R>(
        &self,
        socket: &TcpStream,
        interest: Interest,
        mut op: impl FnMut() -> io::Result<R>,
    ) -> Result<R, Stop> {
        loop {
            match tokio::time::timeout(self.idle, socket.async_io(interest, &mut op)).await {
                Ok(Ok(r)) => return Ok(r),
                Ok(Err(e)) => return Err(Stop::Io(e.to_string())),
                Err(_) => {
                    if self.activity.idle_for() >= self.idle {
                        return Err(Stop::Idle);
                    }
                }
            }
        }
    }
}

/// A pipe for splicing, both ends non-blocking.
struct Pipe {
    r: OwnedFd,
    w: OwnedFd,
    size: usize,
}

impl Pipe {
    fn new() -> io::Result<Pipe> {
        let (r, w) = rustix::pipe::pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK)?;
        let size = match rustix::pipe::fcntl_setpipe_size(&w, PIPE_SIZE) {
            Ok(size) => size,
            // Above the node's pipe limits: the default size still works.
            Err(_) => rustix::pipe::fcntl_getpipe_size(&w)?,
        };
        Ok(Pipe { r, w, size })
    }
}

/// Tells the peer that nothing more comes (`shutdown(SHUT_WR)`); a failure (the peer is
/// gone) changes nothing for the caller.
fn shutdown_write(socket: &TcpStream) {
    // SAFETY: the descriptor is borrowed from `socket`, open for the whole call;
    // shutdown(2) reads no memory.
    unsafe {
        libc::shutdown(socket.as_raw_fd(), libc::SHUT_WR);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A connected pair of sockets on 127.0.0.1: (the one the test holds, the relay's).
    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (s, _) = l.accept().await.unwrap();
        (c, s)
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 4093) as u8).collect()
    }

    /// Relays `data` from a source to a sink through one pump, spliced or copied,
    /// and returns what the sink got, how the pump ended and its counter.
    async fn relay(
        data: Vec<u8>,
        budget: &Budget,
        splice: bool,
    ) -> (Vec<u8>, Result<(), Stop>, u64) {
        let (mut source, from) = pair().await;
        let (mut sink, to) = pair().await;
        let writer = tokio::spawn(async move {
            let _ = source.write_all(&data).await;
            let _ = source.shutdown().await;
            // Held open until the relay is done with it.
            let mut rest = Vec::new();
            let _ = source.read_to_end(&mut rest).await;
        });
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let _ = sink.read_to_end(&mut got).await;
            got
        });
        let counter = AtomicU64::new(0);
        let activity = Activity::new();
        let pump = Pump {
            from: &from,
            to: &to,
            budget,
            idle: Duration::from_secs(5),
            counter: &counter,
            activity: &activity,
        };
        let ended = if splice {
            pump.spliced(&Pipe::new().unwrap()).await
        } else {
            pump.copied().await
        };
        drop((from, to));
        let got = reader.await.unwrap();
        writer.await.unwrap();
        (got, ended, counter.into_inner())
    }

    #[tokio::test]
    async fn both_ways_carry_every_byte_in_order_and_count_them() {
        tokio::time::timeout(Duration::from_secs(60), async {
            for splice in [true, false] {
                let data = pattern(5 * 1024 * 1024 + 13);
                let budget = Budget::new(u64::MAX);
                let (got, ended, counted) = relay(data.clone(), &budget, splice).await;
                assert_eq!(ended, Ok(()), "splice {splice}");
                assert!(got == data, "splice {splice}: {} bytes differ", got.len());
                assert_eq!(counted, data.len() as u64);
                assert_eq!(budget.used(), data.len() as u64);
            }
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn the_budget_lets_through_exactly_its_bytes_and_no_more() {
        tokio::time::timeout(Duration::from_secs(60), async {
            for splice in [true, false] {
                // More than the budget: exactly the budget arrives, then the cut.
                let budget = Budget::new(3 * 1024 * 1024 + 1);
                let (got, ended, counted) = relay(pattern(4 << 20), &budget, splice).await;
                assert_eq!(ended, Err(Stop::Budget), "splice {splice}");
                assert_eq!(got.len(), 3 * 1024 * 1024 + 1, "splice {splice}");
                assert!(got == pattern(4 << 20)[..got.len()]);
                assert_eq!(counted, got.len() as u64);
                assert!(budget.spent());
                // Exactly the budget: it all arrives and the connection ends normally.
                let budget = Budget::new(1 << 20);
                let (got, ended, _) = relay(pattern(1 << 20), &budget, splice).await;
                assert_eq!(ended, Ok(()), "splice {splice}");
                assert_eq!(got.len(), 1 << 20);
                // A spent budget refuses the first byte.
                let budget = Budget::new(0);
                let (got, ended, counted) = relay(pattern(10), &budget, splice).await;
                assert_eq!(ended, Err(Stop::Budget), "splice {splice}");
                assert_eq!((got.len(), counted), (0, 0));
            }
        })
        .await
        .unwrap();
    }

    /// A receiver that stops reading (its socket buffers fill) is cut at the idle
    /// timeout: the wait to write is bounded as the wait to read is.
    #[tokio::test]
    async fn a_receiver_that_stops_reading_is_cut_at_the_idle_timeout() {
        tokio::time::timeout(Duration::from_secs(60), async {
            for splice in [true, false] {
                let (mut source, from) = pair().await;
                let (sink, to) = pair().await;
                let writer = tokio::spawn(async move {
                    let chunk = vec![7u8; 1 << 20];
                    loop {
                        if source.write_all(&chunk).await.is_err() {
                            return;
                        }
                    }
                });
                let counter = AtomicU64::new(0);
                let activity = Activity::new();
                let pump = Pump {
                    from: &from,
                    to: &to,
                    budget: &Budget::new(u64::MAX),
                    idle: Duration::from_millis(500),
                    counter: &counter,
                    activity: &activity,
                };
                let started = std::time::Instant::now();
                let ended = if splice {
                    pump.spliced(&Pipe::new().unwrap()).await
                } else {
                    pump.copied().await
                };
                assert_eq!(ended, Err(Stop::Idle), "splice {splice}");
                assert!(started.elapsed() < Duration::from_secs(10));
                assert!(counter.into_inner() > 0);
                drop((from, to, sink));
                writer.await.unwrap();
            }
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn a_silent_source_is_cut_at_the_idle_timeout() {
        tokio::time::timeout(Duration::from_secs(60), async {
            for splice in [true, false] {
                let (_source, from) = pair().await;
                let (_sink, to) = pair().await;
                let counter = AtomicU64::new(0);
                let activity = Activity::new();
                let pump = Pump {
                    from: &from,
                    to: &to,
                    budget: &Budget::new(u64::MAX),
                    idle: Duration::from_millis(300),
                    counter: &counter,
                    activity: &activity,
                };
                let ended = if splice {
                    pump.spliced(&Pipe::new().unwrap()).await
                } else {
                    pump.copied().await
                };
                assert_eq!(ended, Err(Stop::Idle), "splice {splice}");
            }
        })
        .await
        .unwrap();
    }
}
