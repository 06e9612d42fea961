//! Capturing a sandbox's stdout/stderr concurrently from the start: the first `cap` bytes
//! are kept (cut back to a UTF-8 boundary), the rest is drained and counted so the
//! sandbox never blocks on a full pipe.
//!
//! A streamed session exec also sees every byte as it is read: it runs the backend's exec
//! within [`tapped`], and the backends drain their client's output with
//! [`spawn_stdout`] and [`spawn_stderr`], which hand each read to the [`Tap`] in scope
//! (none outside a streamed exec).

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::task::JoinHandle;

/// How long output may keep flowing after a client exits.
pub const DRAIN_BOUND: Duration = Duration::from_secs(2);

/// A stream still being drained.
pub type Pending = JoinHandle<Captured>;

/// The kept head of one stream.
#[derive(Debug, Default)]
pub struct Captured {
    pub text: String,
    pub truncated: bool,
}

/// Which output stream of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    Stdout,
    Stderr,
}

/// Where a streamed exec's output goes as it is read (besides the capture).
pub trait Tap: Send + Sync {
    fn write(&self, which: Which, bytes: &[u8]);
}

tokio::task_local! {
    static TAP: std::sync::Arc<dyn Tap>;
}

/// Runs `f` (a backend's exec) with `tap` receiving its output.
pub async fn tapped<F: std::future::Future>(tap: std::sync::Arc<dyn Tap>, f: F) -> F::Output {
    TAP.scope(tap, f).await
}

/// How long a stream whose command has ended ([`spawn_until`]) may stay quiet before its
/// capture ends: what the command wrote before its exit is already in the pipe.
pub const QUIET_AFTER_END: Duration = Duration::from_millis(50);
/// How long such a stream is read at most once its command has ended (a process left
/// behind may write without pause).
pub const READ_AFTER_END: Duration = Duration::from_millis(500);

/// [`spawn`] of a sandbox's stdout, handed to the [`Tap`] in scope as well.
pub fn spawn_stdout<R: AsyncRead + Unpin + Send + 'static>(
    stream: Option<R>,
    cap: usize,
) -> Pending {
    spawn_until(stream, cap, Which::Stdout, None)
}

/// [`spawn`] of a sandbox's stderr, handed to the [`Tap`] in scope as well.
pub fn spawn_stderr<R: AsyncRead + Unpin + Send + 'static>(
    stream: Option<R>,
    cap: usize,
) -> Pending {
    spawn_until(stream, cap, Which::Stderr, None)
}

/// [`spawn_stdout`] or [`spawn_stderr`] of a command whose pipe may outlive it (a process
/// it left in a session holds the write end): once `ended` fires, the capture reads on
/// until end of file, [`QUIET_AFTER_END`] without a byte or [`READ_AFTER_END`] in all,
/// and keeps what it has, as an engine's `exec` stops relaying once its command has
/// exited.
pub fn spawn_until<R: AsyncRead + Unpin + Send + 'static>(
    stream: Option<R>,
    cap: usize,
    which: Which,
    ended: Option<tokio_util::sync::CancellationToken>,
) -> Pending {
    spawn_tapped(
        stream,
        cap,
        TAP.try_with(|t| (t.clone(), which)).ok(),
        ended,
    )
}

/// Starts draining `stream` in the background.
pub fn spawn<R: AsyncRead + Unpin + Send + 'static>(stream: Option<R>, cap: usize) -> Pending {
    spawn_tapped(stream, cap, None, None)
}

fn spawn_tapped<R: AsyncRead + Unpin + Send + 'static>(
    stream: Option<R>,
    cap: usize,
    tap: Option<(std::sync::Arc<dyn Tap>, Which)>,
    ended: Option<tokio_util::sync::CancellationToken>,
) -> Pending {
    tokio::spawn(async move {
        let Some(mut stream) = stream else {
            return Captured::default();
        };
        let mut kept = Vec::new();
        let mut total = 0usize;
        let mut buf = vec![0u8; 64 * 1024];
        let mut after_end: Option<tokio::time::Instant> = None;
        loop {
            let read = match (&ended, after_end) {
                (Some(end), None) => tokio::select! {
                    r = stream.read(&mut buf) => r,
                    _ = end.cancelled() => {
                        after_end = Some(tokio::time::Instant::now() + READ_AFTER_END);
                        continue;
                    }
                },
                (Some(_), Some(until)) => {
                    let left = until.saturating_duration_since(tokio::time::Instant::now());
                    let quiet = QUIET_AFTER_END.min(left);
                    match tokio::time::timeout(quiet, stream.read(&mut buf)).await {
                        Ok(r) => r,
                        Err(_) => break,
                    }
                }
                (None, _) => stream.read(&mut buf).await,
            };
            match read {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if let Some((tap, which)) = &tap {
                        tap.write(*which, &buf[..n]);
                    }
                    total += n;
                    if kept.len() < cap {
                        let take = n.min(cap - kept.len());
                        kept.extend_from_slice(&buf[..take]);
                    }
                }
            }
        }
        finish(kept, total > cap)
    })
}

/// Waits for a capture task, giving up (and reporting truncation) after `bound`: a
/// descendant that holds the pipe open must not hang the node.
pub async fn collect(handle: Pending, bound: Duration) -> Captured {
    let abort = handle.abort_handle();
    match tokio::time::timeout(bound, handle).await {
        Ok(Ok(c)) => c,
        _ => {
            abort.abort();
            Captured {
                text: String::new(),
                truncated: true,
            }
        }
    }
}

/// Cuts `bytes` back to a UTF-8 boundary and converts; invalid sequences inside become
/// U+FFFD.
fn finish(mut bytes: Vec<u8>, truncated: bool) -> Captured {
    if truncated {
        if let Err(e) = std::str::from_utf8(&bytes) {
            if e.error_len().is_none() {
                bytes.truncate(e.valid_up_to());
            }
        }
    }
    Captured {
        text: String::from_utf8_lossy(&bytes).into_owned(),
        truncated,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_pipe_held_open_after_its_command_ended_keeps_what_was_written() {
        use tokio::io::AsyncWriteExt;
        let (mut w, r) = tokio::net::unix::pipe::pipe().unwrap();
        let ended = tokio_util::sync::CancellationToken::new();
        let pending = spawn_until(Some(r), 64, Which::Stdout, Some(ended.clone()));
        w.write_all(b"before the end\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        ended.cancel();
        // The writer stays open (a process left behind holds it): the capture ends anyway,
        // with what was written, not aborted by the drain bound.
        let c = collect(pending, DRAIN_BOUND).await;
        assert_eq!((c.text.as_str(), c.truncated), ("before the end\n", false));
        drop(w);
    }

    #[tokio::test]
    async fn a_writer_that_never_pauses_after_the_end_leaves_the_head_kept() {
        use tokio::io::AsyncWriteExt;
        let (mut w, r) = tokio::net::unix::pipe::pipe().unwrap();
        let ended = tokio_util::sync::CancellationToken::new();
        let pending = spawn_until(Some(r), 8, Which::Stdout, Some(ended.clone()));
        w.write_all(b"head\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        ended.cancel();
        let writer = tokio::spawn(async move {
            while w.write_all(b"more more more\n").await.is_ok() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        // Ends at its own bound, well before the drain bound would abort it and drop
        // what it kept.
        let c = collect(pending, DRAIN_BOUND).await;
        writer.abort();
        assert!(c.text.starts_with("head\n"), "{c:?}");
        assert!(c.truncated);
    }

    #[tokio::test]
    async fn caps_on_a_utf8_boundary() {
        // "é" is two bytes: a cap of 3 over "aéé" must keep "aé", not half a character.
        let data: &[u8] = "aéé".as_bytes();
        let c = collect(spawn(Some(data), 4), Duration::from_secs(5)).await;
        assert_eq!((c.text.as_str(), c.truncated), ("aé", true));
        let c = collect(spawn(Some("hi".as_bytes()), 4), Duration::from_secs(5)).await;
        assert_eq!((c.text.as_str(), c.truncated), ("hi", false));
    }
}
