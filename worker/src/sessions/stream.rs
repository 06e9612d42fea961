//! Streamed session execs: `"stream": true` starts the command and answers its exec id at
//! once; the output is kept on the node, to be read (and read again after a dropped
//! connection) from a byte offset, and the command's end is waited for separately.
//!
//! - Each exec keeps a ring per stream (stdout, stderr) of at most
//!   `limits.exec_output_ring_bytes`: the newest bytes. Offsets are per stream and count
//!   every byte the command wrote, kept or not. A reader from an offset the ring no longer
//!   holds first gets a [`OutputEvent::Cut`] naming the bytes `[from, to)` it will never
//!   see, then the bytes from `to`. However much a command writes, an exec holds its two
//!   rings and the capture's `limits.output_cap_bytes` heads, nothing more.
//! - The output flows from the backends' drains ([`crate::backend::capture::Tap`]), so a
//!   streamed exec runs exactly as a plain one: same sandbox, limits, disk guard and
//!   egress, one command at a time per session.
//! - Exec ids are 128 random bits (UUID v4) and name an exec under its session only: the
//!   same id under another session is not found (404), as is a guessed one. The node's
//!   bearer token guards every call, as every session route.
//! - A session keeps at most [`MAX_KEPT_EXECS`] finished execs (the oldest go first) and
//!   each for [`FINISHED_TTL`] after its end; an exec of an ended session goes with it
//!   once expired. A session runs one command at a time, so at most one exec per session
//!   is live.
//! - Standard input: an exec started with `"stdin": true` (streamed only) gets a pipe as
//!   its stdin; every other command's stdin stays closed. `POST …/execs/{exec_id}/stdin`
//!   writes the request's body (at most [`MAX_STDIN_CALL`] bytes a call, [`MAX_STDIN_TOTAL`]
//!   an exec; over either: 413 and nothing written) and answers once the bytes are in the
//!   pipe; `?close=true` closes the stdin after them (the command reads end of file).
//!   Writes are one at a time and in order. A write the command does not take within
//!   [`STDIN_BOUND`] is answered 409 `stdin_blocked` (its bytes stay queued, in order); a
//!   write to an exec that ended or whose stdin is closed is 409 `exec_ended`; one to an
//!   exec started without a stdin 409 `stdin_not_open`. The microVM gives commands no
//!   stdin: `"stdin": true` is refused there (400 `stdin_unsupported`).
//! - Signals: `POST …/execs/{exec_id}:signal` with `{"signal": "TERM"}` (one of
//!   [`Signal::ALL`]: TERM, INT, KILL, HUP, QUIT, USR1, USR2; any other 400 naming
//!   `signal`) delivers it to the command's process group in the sandbox, through the
//!   backend ([`crate::backend::exec_io`]); 409 `exec_ended` once the command ended, and
//!   while it is still starting (`exec_starting`, retry). A command a signal ended reports
//!   `exit_code` 128 + the signal's number (143 for TERM) and a `failure_reason` naming the
//!   signal sent. The microVM cannot signal a command: 409 `signal_unsupported`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cynode_protocol::worker_api::{check_id, API_VERSION};
use cynode_protocol::worker_session_io::{
    ExecStarted, ExecState, SignalSent, StdinWritten, EXEC_ENDED, SIGNAL_UNSUPPORTED,
    STDIN_BLOCKED, STDIN_NOT_OPEN, STDIN_UNSUPPORTED,
};
use cynode_protocol::worker_sessions::{ExecRequest, ExecResponse};
use cynode_protocol::ValidationError;
use tokio::sync::{mpsc, oneshot, watch};

use super::{SessionError, Sessions};
use crate::backend::capture::{Tap, Which};
use crate::backend::exec_io::{ExecIo, Signal, SignalError, StdinChunk};

/// Finished execs a session keeps.
pub const MAX_KEPT_EXECS: usize = 16;
/// How long a finished exec is kept.
pub const FINISHED_TTL: Duration = Duration::from_secs(600);
/// The longest a wait (`?wait=true`) lasts.
pub const MAX_WAIT: Duration = Duration::from_secs(300);
/// The most bytes one output event carries.
pub const CHUNK_BYTES: usize = 32 * 1024;
/// The most bytes one stdin write carries.
pub const MAX_STDIN_CALL: usize = 1024 * 1024;
/// The most bytes an exec's stdin takes in all.
pub const MAX_STDIN_TOTAL: u64 = 64 * 1024 * 1024;
/// How long a stdin write waits for the command to take its bytes.
pub const STDIN_BOUND: Duration = Duration::from_secs(10);

/// The newest `cap` bytes of one stream, and how many were written in all.
#[derive(Debug)]
struct Ring {
    data: VecDeque<u8>,
    total: u64,
    cap: usize,
}

impl Ring {
    fn new(cap: usize) -> Self {
        Ring {
            data: VecDeque::new(),
            total: 0,
            cap,
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        self.total += bytes.len() as u64;
        let bytes = &bytes[bytes.len().saturating_sub(self.cap)..];
        let over = (self.data.len() + bytes.len()).saturating_sub(self.cap);
        self.data.drain(..over);
        self.data.extend(bytes);
    }

    /// The offset of the oldest byte kept.
    fn start(&self) -> u64 {
        self.total - self.data.len() as u64
    }

    /// At most `max` bytes from `offset` (which is kept).
    fn read(&self, offset: u64, max: usize) -> Vec<u8> {
        let skip = (offset - self.start()) as usize;
        self.data.iter().skip(skip).take(max).copied().collect()
    }
}

#[derive(Debug)]
struct RecState {
    rings: [Ring; 2],
    result: Option<ExecResponse>,
    finished: Option<Instant>,
    /// Signals delivered to the command, in order.
    signals: Vec<Signal>,
}

/// The writing end of an exec's stdin.
#[derive(Debug)]
struct StdinState {
    /// `None` once closed (or for an exec without stdin).
    tx: Option<mpsc::Sender<StdinChunk>>,
    total: u64,
}

/// One streamed exec.
#[derive(Debug)]
pub struct ExecRecord {
    exec_id: String,
    session_id: String,
    state: Mutex<RecState>,
    /// Bumped on every change (output, the end).
    changed: watch::Sender<u64>,
    /// The command's stdin and signals.
    io: Arc<ExecIo>,
    /// Whether it was started with a stdin.
    has_stdin: bool,
    /// Held by one stdin write at a time.
    stdin: tokio::sync::Mutex<StdinState>,
}

fn index(which: Which) -> usize {
    match which {
        Which::Stdout => 0,
        Which::Stderr => 1,
    }
}

impl Tap for ExecRecord {
    fn write(&self, which: Which, bytes: &[u8]) {
        if let Ok(mut s) = self.state.lock() {
            s.rings[index(which)].push(bytes);
        }
        self.changed.send_modify(|v| *v += 1);
    }
}

impl ExecRecord {
    pub(super) fn new(session_id: &str, ring_bytes: usize, stdin: bool) -> Arc<Self> {
        let (io, tx) = ExecIo::new(stdin);
        Arc::new(ExecRecord {
            exec_id: uuid::Uuid::new_v4().simple().to_string(),
            session_id: session_id.to_string(),
            state: Mutex::new(RecState {
                rings: [Ring::new(ring_bytes), Ring::new(ring_bytes)],
                result: None,
                finished: None,
                signals: Vec::new(),
            }),
            changed: watch::channel(0).0,
            io,
            has_stdin: stdin,
            stdin: tokio::sync::Mutex::new(StdinState { tx, total: 0 }),
        })
    }

    /// Records how the command ended (its output is in the rings, not in `result`); a
    /// command a delivered signal ended says so.
    pub(super) fn finish(&self, mut result: ExecResponse) {
        result.stdout.clear();
        result.stderr.clear();
        if let Ok(mut s) = self.state.lock() {
            if let Some(sig) = s
                .signals
                .iter()
                .rev()
                .find(|sig| result.exit_code == 128 + sig.number())
            {
                result.failure_reason = Some(format!(
                    "command ended by SIG{}, sent through the exec's :signal",
                    sig.name()
                ));
            }
            s.result = Some(result);
            s.finished = Some(Instant::now());
        }
        self.changed.send_modify(|v| *v += 1);
    }

    fn ended(&self) -> bool {
        self.state.lock().map_or(true, |s| s.result.is_some())
    }

    fn snapshot(&self) -> ExecState {
        let (running, out, err, result) = match self.state.lock() {
            Ok(s) => (
                s.result.is_none(),
                s.rings[0].total,
                s.rings[1].total,
                s.result.clone(),
            ),
            Err(_) => (false, 0, 0, None),
        };
        ExecState {
            version: API_VERSION,
            session_id: self.session_id.clone(),
            exec_id: self.exec_id.clone(),
            running,
            stdout_bytes: out,
            stderr_bytes: err,
            result,
        }
    }
}

/// The node's streamed execs.
#[derive(Debug, Default)]
pub(super) struct Execs {
    map: Mutex<HashMap<String, Arc<ExecRecord>>>,
}

impl Execs {
    pub(super) fn insert(&self, rec: Arc<ExecRecord>) {
        if let Ok(mut m) = self.map.lock() {
            prune(&mut m, &rec.session_id);
            m.insert(rec.exec_id.clone(), rec);
        }
    }

    fn get(&self, session_id: &str, exec_id: &str) -> Result<Arc<ExecRecord>, SessionError> {
        let mut m = self.map.lock().map_err(|_| SessionError::poisoned())?;
        prune(&mut m, session_id);
        m.get(exec_id)
            .filter(|r| r.session_id == session_id)
            .cloned()
            .ok_or_else(|| SessionError::FileNotFound {
                path: format!("exec {exec_id} of session {session_id}"),
            })
    }
}

/// Drops finished execs past [`FINISHED_TTL`], and `session_id`'s finished ones beyond
/// [`MAX_KEPT_EXECS`] (oldest first).
fn prune(m: &mut HashMap<String, Arc<ExecRecord>>, session_id: &str) {
    let now = Instant::now();
    let finished = |r: &ExecRecord| r.state.lock().ok().and_then(|s| s.finished);
    m.retain(|_, r| finished(r).is_none_or(|t| now.duration_since(t) < FINISHED_TTL));
    let mut mine: Vec<(Instant, String)> = m
        .values()
        .filter(|r| r.session_id == session_id)
        .filter_map(|r| finished(r).map(|t| (t, r.exec_id.clone())))
        .collect();
    if mine.len() >= MAX_KEPT_EXECS {
        mine.sort();
        for (_, id) in mine.iter().take(mine.len() + 1 - MAX_KEPT_EXECS) {
            m.remove(id);
        }
    }
}

/// The response of a command whose task failed.
fn failed(session_id: &str, why: String) -> ExecResponse {
    let now = cynode_protocol::time::now_rfc3339();
    ExecResponse {
        version: API_VERSION,
        session_id: session_id.to_string(),
        status: cynode_protocol::worker_api::WorkerJobStatus::Failed,
        exit_code: -1,
        stdout: String::new(),
        stderr: String::new(),
        truncated: Default::default(),
        started_at: now.clone(),
        ended_at: now,
        failure_reason: Some(why),
        egress: None,
        egress_dropped: 0,
    }
}

/// What a reader of an exec's output gets next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputEvent {
    /// `bytes` of `which`, from `offset`.
    Chunk {
        which: Which,
        offset: u64,
        bytes: Vec<u8>,
    },
    /// The bytes `[from, to)` of `which` are no longer kept.
    Cut { which: Which, from: u64, to: u64 },
    /// The command ended and everything kept was read.
    Exit(Box<ExecState>),
}

/// A reader of one exec's output from per-stream offsets.
#[derive(Debug)]
pub struct ExecOutput {
    rec: Arc<ExecRecord>,
    rx: watch::Receiver<u64>,
    offsets: [u64; 2],
    done: bool,
}

impl ExecOutput {
    /// The offsets read up to (stdout, stderr): where a reader that drops resumes.
    pub fn offsets(&self) -> (u64, u64) {
        (self.offsets[0], self.offsets[1])
    }

    /// The next event; waits for output; `None` after [`OutputEvent::Exit`]. Cancel-safe.
    pub async fn next(&mut self) -> Option<OutputEvent> {
        loop {
            if self.done {
                return None;
            }
            self.rx.borrow_and_update();
            {
                let s = self.rec.state.lock().ok()?;
                for (i, which) in [(0, Which::Stdout), (1, Which::Stderr)] {
                    let ring = &s.rings[i];
                    let at = self.offsets[i];
                    if at < ring.start() {
                        self.offsets[i] = ring.start();
                        return Some(OutputEvent::Cut {
                            which,
                            from: at,
                            to: ring.start(),
                        });
                    }
                    if at < ring.total {
                        let bytes = ring.read(at, CHUNK_BYTES);
                        self.offsets[i] += bytes.len() as u64;
                        return Some(OutputEvent::Chunk {
                            which,
                            offset: at,
                            bytes,
                        });
                    }
                }
                if s.result.is_some() {
                    self.done = true;
                    drop(s);
                    return Some(OutputEvent::Exit(Box::new(self.rec.snapshot())));
                }
            }
            if self.rx.changed().await.is_err() {
                // The record is gone with its sender: read what is left, then end.
                self.done = self.rec.state.lock().map_or(true, |s| s.result.is_none());
            }
        }
    }
}

impl Sessions {
    /// Starts `req` (its `stream` set) in the session and answers its exec id at once.
    pub fn exec_streamed(
        &self,
        session_id: &str,
        req: ExecRequest,
    ) -> Result<ExecStarted, SessionError> {
        if req.stdin && !self.inner.backend.exec_io() {
            return Err(SessionError::Invalid(ValidationError::new(
                "stdin",
                format!("{STDIN_UNSUPPORTED}: the microVM gives a command no standard input"),
            )));
        }
        let stdin = req.stdin;
        let rec = ExecRecord::new(
            session_id,
            self.inner.cfg.limits.exec_output_ring_bytes,
            stdin,
        );
        let task = self.launch(
            session_id,
            req,
            Some(rec.clone() as Arc<dyn Tap>),
            Some(rec.io.clone()),
        )?;
        self.inner.execs.insert(rec.clone());
        tracing::info!(session_id, exec_id = %rec.exec_id, stdin, "streamed exec started");
        let done = rec.clone();
        tokio::spawn(async move {
            let resp = match task.await {
                Ok(r) => r,
                Err(e) => failed(&done.session_id, format!("exec task failed: {e}")),
            };
            done.finish(resp);
            // Its stdin closes with it (a write in flight is answered by the pipe).
            done.stdin.lock().await.tx = None;
        });
        Ok(ExecStarted {
            version: API_VERSION,
            session_id: session_id.to_string(),
            exec_id: rec.exec_id.clone(),
        })
    }

    fn exec_record(
        &self,
        session_id: &str,
        exec_id: &str,
    ) -> Result<Arc<ExecRecord>, SessionError> {
        check_id("session_id", session_id)?;
        if exec_id.len() != 32 || !exec_id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(SessionError::Invalid(ValidationError::new(
                "exec_id",
                "an exec id is 32 hexadecimal digits",
            )));
        }
        // The session itself must be one the node knows (404 otherwise).
        self.show(session_id)?;
        self.inner.execs.get(session_id, exec_id)
    }

    /// The exec as it stands; with `wait`, once it ended or `wait` (at most [`MAX_WAIT`])
    /// ran out.
    pub async fn exec_state(
        &self,
        session_id: &str,
        exec_id: &str,
        wait: Option<Duration>,
    ) -> Result<ExecState, SessionError> {
        let rec = self.exec_record(session_id, exec_id)?;
        if let Some(wait) = wait {
            let mut rx = rec.changed.subscribe();
            let ended = async {
                loop {
                    if rec.state.lock().map_or(true, |s| s.result.is_some()) {
                        return;
                    }
                    if rx.changed().await.is_err() {
                        return;
                    }
                }
            };
            let _ = tokio::time::timeout(wait.min(MAX_WAIT), ended).await;
        }
        Ok(rec.snapshot())
    }

    /// Writes `bytes` to the exec's stdin (answered once they are in the pipe), then with
    /// `close` closes it.
    pub async fn write_stdin(
        &self,
        session_id: &str,
        exec_id: &str,
        bytes: Vec<u8>,
        close: bool,
    ) -> Result<StdinWritten, SessionError> {
        let rec = self.exec_record(session_id, exec_id)?;
        let ended = || {
            SessionError::Conflict(format!(
                "{EXEC_ENDED}: exec {exec_id} has ended or closed its stdin"
            ))
        };
        let blocked = || {
            SessionError::Conflict(format!(
                "{STDIN_BLOCKED}: the command has not read its stdin within {}s; the bytes \
                 written stay queued, in order",
                STDIN_BOUND.as_secs()
            ))
        };
        if !rec.has_stdin {
            return Err(SessionError::Conflict(format!(
                "{STDIN_NOT_OPEN}: exec {exec_id} was started without \"stdin\": true"
            )));
        }
        if bytes.len() > MAX_STDIN_CALL {
            return Err(SessionError::TooLarge(MAX_STDIN_CALL));
        }
        if rec.ended() {
            return Err(ended());
        }
        let deadline = tokio::time::Instant::now() + STDIN_BOUND;
        let mut st = tokio::time::timeout_at(deadline, rec.stdin.lock())
            .await
            .map_err(|_| blocked())?;
        let Some(tx) = st.tx.clone() else {
            return Err(ended());
        };
        let len = bytes.len() as u64;
        if st.total + len > MAX_STDIN_TOTAL {
            return Err(SessionError::TooLarge(MAX_STDIN_TOTAL as usize));
        }
        if !bytes.is_empty() {
            let (ack, done) = oneshot::channel();
            match tokio::time::timeout_at(deadline, tx.send((bytes, ack))).await {
                Err(_) => return Err(blocked()),
                Ok(Err(_)) => return Err(ended()),
                Ok(Ok(())) => st.total += len,
            }
            match tokio::time::timeout_at(deadline, done).await {
                Err(_) => return Err(blocked()),
                Ok(Err(_)) | Ok(Ok(Err(_))) => {
                    st.tx = None;
                    return Err(ended());
                }
                Ok(Ok(Ok(()))) => {}
            }
        }
        drop(tx);
        if close {
            st.tx = None;
        }
        tracing::info!(
            session_id,
            exec_id,
            bytes = len,
            close,
            "exec stdin written"
        );
        Ok(StdinWritten {
            version: API_VERSION,
            session_id: session_id.to_string(),
            exec_id: exec_id.to_string(),
            bytes: len,
            total_bytes: st.total,
            closed: st.tx.is_none(),
        })
    }

    /// Delivers the allowed signal named `name` to the exec's command.
    pub async fn signal_exec(
        &self,
        session_id: &str,
        exec_id: &str,
        name: &str,
    ) -> Result<SignalSent, SessionError> {
        let rec = self.exec_record(session_id, exec_id)?;
        let sig = Signal::parse(name).ok_or_else(|| {
            SessionError::Invalid(ValidationError::new(
                "signal",
                format!(
                    "expected one of {}",
                    Signal::ALL.map(Signal::name).join(", ")
                ),
            ))
        })?;
        if !self.inner.backend.exec_io() {
            return Err(SessionError::Conflict(format!(
                "{SIGNAL_UNSUPPORTED}: the microVM cannot signal a command"
            )));
        }
        let ended = || SessionError::Conflict(format!("{EXEC_ENDED}: exec {exec_id} has ended"));
        if rec.ended() {
            return Err(ended());
        }
        match rec.io.signal(sig).await {
            Ok(()) => {}
            Err(SignalError::Ended) => return Err(ended()),
            Err(SignalError::NotStarted) => {
                return Err(SessionError::Conflict(format!(
                    "exec_starting: exec {exec_id} is not running yet; retry"
                )))
            }
            Err(SignalError::Failed(m)) => return Err(SessionError::Internal(m)),
        }
        if let Ok(mut s) = rec.state.lock() {
            s.signals.push(sig);
        }
        tracing::info!(session_id, exec_id, signal = sig.name(), "exec signalled");
        Ok(SignalSent {
            version: API_VERSION,
            session_id: session_id.to_string(),
            exec_id: exec_id.to_string(),
            signal: sig.name().to_string(),
        })
    }

    /// A reader of the exec's output from `offsets` (stdout, stderr); an offset past what
    /// the stream has written is refused.
    pub fn exec_output(
        &self,
        session_id: &str,
        exec_id: &str,
        offsets: (u64, u64),
    ) -> Result<ExecOutput, SessionError> {
        let rec = self.exec_record(session_id, exec_id)?;
        let (out, err) = {
            let s = rec.state.lock().map_err(|_| SessionError::poisoned())?;
            (s.rings[0].total, s.rings[1].total)
        };
        for (field, at, total) in [
            ("stdout_offset", offsets.0, out),
            ("stderr_offset", offsets.1, err),
        ] {
            if at > total {
                return Err(SessionError::Invalid(ValidationError::new(
                    field,
                    format!("offset {at} is past the {total} bytes written so far"),
                )));
            }
        }
        Ok(ExecOutput {
            rx: rec.changed.subscribe(),
            rec,
            offsets: [offsets.0, offsets.1],
            done: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_newest_bytes_and_counts_them_all() {
        let mut r = Ring::new(4);
        r.push(b"ab");
        r.push(b"cdef");
        assert_eq!(
            (r.start(), r.total, r.read(2, 10)),
            (2, 6, b"cdef".to_vec())
        );
        r.push(b"0123456789");
        assert_eq!(
            (r.start(), r.total, r.read(13, 10)),
            (12, 16, b"789".to_vec())
        );
    }

    #[tokio::test]
    async fn a_reader_from_a_cut_offset_is_told_what_was_cut() {
        let rec = ExecRecord::new("s", 4, false);
        rec.write(Which::Stdout, b"0123456789");
        let mut r = ExecOutput {
            rx: rec.changed.subscribe(),
            rec: rec.clone(),
            offsets: [0, 0],
            done: false,
        };
        assert_eq!(
            r.next().await,
            Some(OutputEvent::Cut {
                which: Which::Stdout,
                from: 0,
                to: 6
            })
        );
        assert_eq!(
            r.next().await,
            Some(OutputEvent::Chunk {
                which: Which::Stdout,
                offset: 6,
                bytes: b"6789".to_vec()
            })
        );
        rec.write(Which::Stderr, b"e");
        assert!(matches!(
            r.next().await,
            Some(OutputEvent::Chunk {
                which: Which::Stderr,
                offset: 0,
                ..
            })
        ));
        assert_eq!(r.offsets(), (10, 1));
    }
}
