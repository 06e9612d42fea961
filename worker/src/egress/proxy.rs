//! The proxy itself, one per job, served on a listener the caller has already bound (the
//! node binds it inside the sandbox's network namespace). Each client connection carries
//! one request: plain HTTP is forwarded with `Connection: close`, CONNECT becomes a tunnel.
//! Every connection ends in exactly one audit record.

use std::borrow::Cow;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cynode_protocol::egress::{EgressAudit, EgressDecision, EgressRecord};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::allowlist::{Host, Verdict};
use super::audit::AuditLog;
use super::http1::{self, BufConn, Framing, HeadError};
use super::netns::Netns;
use super::relay::{Activity, Budget, Pump, Stop};
use super::resolve::{ResolveError, Resolver};
use super::routes::{self, Routes, ROUTES_PREFIX};
use super::{EgressLimits, Policy};

/// Bound on an upstream response head.
const RESPONSE_HEAD_MAX: usize = 64 * 1024;
/// Bound on a chunk-size or trailer line.
const CHUNK_LINE_MAX: usize = 4096;
/// What a refused client may still send before the connection is dropped.
const LINGER_BYTES: usize = 256 * 1024;
/// Bound on a request body sent on a credentialed route (it is read whole first).
const ROUTE_BODY_MAX: u64 = 16 * 1024 * 1024;

struct Shared {
    policy: Policy,
    resolver: Resolver,
    routes: Arc<Routes>,
    limits: EgressLimits,
    audit: AuditLog,
    /// Bytes carried so far, both ways, all connections.
    budget: Budget,
    connections: Arc<Semaphore>,
    /// The proxy's own listen address: an absolute-form request to it names a route.
    local_addr: SocketAddr,
    /// The sandbox's own loopback listeners this proxy reaches inside its namespace.
    loopback: Option<SandboxLoopback>,
}

/// The sandbox's own loopback listeners (its inference listener) that the proxy serves:
/// an absolute-form request or CONNECT to `127.0.0.1:<port>` or `localhost:<port>` is
/// connected inside the sandbox's network namespace ([`Netns::connect`]) instead of being
/// judged by the allowlist, as clients that ignore `NO_PROXY` (busybox wget) send it.
/// This reaches nothing the sandbox could not reach directly, and never the node's own
/// loopback. Other loopback ports go through the allowlist like any other target.
#[derive(Debug, Clone)]
pub struct SandboxLoopback {
    pub netns: Netns,
    pub ports: Vec<u16>,
}

impl SandboxLoopback {
    fn serves(&self, host: &Host, port: u16) -> bool {
        self.ports.contains(&port)
            && match host {
                Host::Ip(ip) => *ip == IpAddr::V4(Ipv4Addr::LOCALHOST),
                Host::Name(name) => name.eq_ignore_ascii_case("localhost"),
            }
    }

    async fn connect(&self, port: u16, timeout: Duration) -> io::Result<TcpStream> {
        let netns = self.netns.clone();
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let stream = tokio::task::spawn_blocking(move || netns.connect(addr, timeout))
            .await
            .map_err(io::Error::other)??;
        stream.set_nonblocking(true)?;
        let _ = stream.set_nodelay(true);
        TcpStream::from_std(stream)
    }
}

/// A running proxy for one job.
pub struct EgressProxy {
    shared: Arc<Shared>,
    cancel: CancellationToken,
    tracker: TaskTracker,
    local_addr: SocketAddr,
}

impl std::fmt::Debug for EgressProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressProxy")
            .field("local_addr", &self.local_addr)
            .finish()
    }
}

impl EgressProxy {
    /// Serves `listener` (already bound, e.g. inside a sandbox's network namespace) until
    /// [`EgressProxy::finish`]: forward proxy for `policy`, `routes` under
    /// `/routes/<name>/`, and the sandbox's own `loopback` listeners. Must be called
    /// inside a tokio runtime.
    pub fn start(
        listener: std::net::TcpListener,
        job_id: &str,
        policy: Policy,
        resolver: Resolver,
        routes: Arc<Routes>,
        limits: EgressLimits,
        loopback: Option<SandboxLoopback>,
    ) -> io::Result<EgressProxy> {
        listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(listener)?;
        let local_addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            audit: AuditLog::new(job_id, limits.max_audit_records),
            connections: Arc::new(Semaphore::new(limits.max_connections)),
            budget: Budget::new(limits.max_total_bytes),
            policy,
            resolver,
            routes,
            limits,
            local_addr,
            loopback,
        });
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        tracker.spawn(accept_loop(
            listener,
            shared.clone(),
            cancel.clone(),
            tracker.clone(),
        ));
        Ok(EgressProxy {
            shared,
            cancel,
            tracker,
            local_addr,
        })
    }

    /// Where the listener is (in the namespace it was bound in).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The audit so far.
    pub fn audit(&self) -> EgressAudit {
        self.shared.audit.snapshot()
    }

    /// Connections still being served (each is audited when it ends): the tracker's
    /// tasks but the accept loop.
    pub fn open_connections(&self) -> usize {
        self.tracker.len().saturating_sub(1)
    }

    /// Bytes carried so far, both ways.
    pub fn bytes_used(&self) -> u64 {
        self.shared.budget.used()
    }

    /// Stops accepting, ends open connections (each audited as "job ended"), and returns
    /// the audit.
    pub async fn finish(self) -> EgressAudit {
        self.cancel.cancel();
        self.tracker.close();
        self.tracker.wait().await;
        self.shared.audit.snapshot()
    }
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    tracker: TaskTracker,
) {
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, _)) => {
                let permit = shared.connections.clone().try_acquire_owned().ok();
                tracker.spawn(connection(shared.clone(), stream, permit, cancel.clone()));
            }
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(target: "cynode_worker::egress", error = %e, "egress accept failed");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        }
    }
}

/// What one connection amounted to.
struct Attempt {
    host: String,
    port: u16,
    method: String,
    up: AtomicU64,
    down: AtomicU64,
}

/// How a connection ended.
enum Outcome {
    /// Let through; the reason says how it ended (`ok`, `idle timeout`, …).
    Allowed(String),
    /// Refused, with the status the client is told (`None`: just closed).
    Denied(Option<u16>, String),
}

fn denied(status: u16, reason: impl Into<String>) -> Outcome {
    Outcome::Denied(Some(status), reason.into())
}

async fn connection(
    shared: Arc<Shared>,
    stream: TcpStream,
    permit: Option<OwnedSemaphorePermit>,
    cancel: CancellationToken,
) {
    let _ = stream.set_nodelay(true);
    let mut client = BufConn::new(stream);
    let mut attempt = Attempt {
        host: String::new(),
        port: 0,
        method: String::new(),
        up: AtomicU64::new(0),
        down: AtomicU64::new(0),
    };
    let outcome = match permit {
        None => denied(503, "too many connections for this job"),
        Some(_) if shared.budget.spent() => denied(429, "byte budget exhausted"),
        Some(_permit) => {
            tokio::select! {
                o = handle(&shared, &mut client, &mut attempt) => o,
                _ = cancel.cancelled() => Outcome::Allowed("job ended".into()),
            }
        }
    };
    let (decision, reason) = match outcome {
        Outcome::Allowed(how) => (EgressDecision::Allowed, how),
        Outcome::Denied(status, reason) => {
            if let Some(status) = status {
                let _ = tokio::time::timeout(
                    Duration::from_secs(2),
                    write_refusal(&mut client.stream, status, &reason),
                )
                .await;
            }
            (EgressDecision::Denied, reason)
        }
    };
    shared.audit.record(EgressRecord {
        host: attempt.host,
        port: attempt.port,
        method: attempt.method,
        decision,
        reason,
        bytes_up: attempt.up.into_inner(),
        bytes_down: attempt.down.into_inner(),
    });
}

fn status_text(status: u16) -> &'static str {
    match status {
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        411 => "Length Required",
        413 => "Content Too Large",
        408 => "Request Timeout",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Error",
    }
}

async fn write_refusal(stream: &mut TcpStream, status: u16, reason: &str) -> io::Result<()> {
    let body = format!("cynode egress: {reason}\n");
    let head = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\nX-Cynode-Egress: denied\r\n\r\n",
        status_text(status),
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await?;
    // A lingering close: read (and drop) what the client is still sending, so closing
    // with unread data does not reset the connection before it has read the refusal.
    let mut sink = [0u8; 8192];
    let mut left = LINGER_BYTES;
    while left > 0 {
        match stream.read(&mut sink).await {
            Ok(0) | Err(_) => break,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
    Ok(())
}

fn head_refusal(e: HeadError) -> Outcome {
    match e {
        HeadError::TooLarge => denied(431, "request header too large"),
        HeadError::Timeout => denied(408, "timed out waiting for the request head"),
        HeadError::Closed => Outcome::Denied(None, "closed before a complete request".into()),
        HeadError::Io(e) => Outcome::Denied(None, format!("read failed: {e}")),
        e @ (HeadError::Malformed(_) | HeadError::Smuggling(_)) => denied(400, e.to_string()),
    }
}

async fn handle(
    shared: &Shared,
    client: &mut BufConn<TcpStream>,
    attempt: &mut Attempt,
) -> Outcome {
    let limits = &shared.limits;
    let head = match client
        .read_head(limits.max_header_bytes, limits.idle_timeout)
        .await
    {
        Ok(h) => h,
        Err(e) => return head_refusal(e),
    };
    let request = match http1::parse_request(&head) {
        Ok(r) => r,
        Err(e) => return head_refusal(e),
    };
    attempt.method = request.method.clone();
    let is_connect = request.method.eq_ignore_ascii_case("CONNECT");
    if !is_connect && !shared.routes.is_empty() {
        if let Some(path) = route_path(shared, &request.target) {
            return route(shared, client, &request, &path, attempt).await;
        }
    }
    let target = if is_connect {
        http1::connect_target(&request.target).map(|(host, port)| http1::Target {
            host,
            port,
            path: String::new(),
        })
    } else {
        http1::absolute_target(&request.target)
    };
    let target = match target {
        Ok(t) => t,
        Err(e) => return denied(400, e.to_string()),
    };
    attempt.host = target.host.to_string();
    attempt.port = target.port;

    if let Some(lo) = shared
        .loopback
        .as_ref()
        .filter(|lo| lo.serves(&target.host, target.port))
    {
        let upstream = match lo.connect(target.port, shared.limits.connect_timeout).await {
            Ok(s) => s,
            Err(e) => {
                return denied(
                    502,
                    format!("the sandbox's listener at port {}: {e}", target.port),
                )
            }
        };
        return if is_connect {
            tunnel(shared, client, upstream, attempt).await
        } else {
            forward(shared, client, upstream, &request, &target, attempt).await
        };
    }
    match shared.policy.allow.check(&target.host, target.port) {
        Verdict::Allowed => {}
        Verdict::PortNotAllowed => {
            return denied(
                403,
                format!("port {} is not allowed for this host", target.port),
            )
        }
        Verdict::NotListed => {
            let what = match target.host {
                Host::Ip(_) => "IP literal not listed in the egress allowlist",
                Host::Name(_) => "not in the egress allowlist",
            };
            return denied(403, what);
        }
    }
    let upstream = match pinned_connect(shared, &target.host, target.port).await {
        Ok(s) => s,
        Err(o) => return o,
    };
    if is_connect {
        tunnel(shared, client, upstream, attempt).await
    } else {
        forward(shared, client, upstream, &request, &target, attempt).await
    }
}

/// The route path (`/routes/<name>/…`) a request target names: the origin form, or the
/// absolute form addressed to the proxy itself, as clients that ignore `NO_PROXY` send a
/// request for `$CYNODE_EGRESS_ROUTES_URL` (`http://127.0.0.1:3128/routes/…`) to their
/// proxy. The proxy itself is exactly its listen address (`127.0.0.1:3128` in a
/// sandbox), or `localhost` with its port when it listens on a loopback address. `None`:
/// not a route request; the target goes through the allowlist like any other.
fn route_path<'t>(shared: &Shared, target: &'t str) -> Option<Cow<'t, str>> {
    if target.starts_with(ROUTES_PREFIX) {
        return Some(Cow::Borrowed(target));
    }
    let t = http1::absolute_target(target).ok()?;
    let own = shared.local_addr;
    let to_self = t.port == own.port()
        && match &t.host {
            Host::Ip(ip) => *ip == own.ip(),
            Host::Name(name) => name == "localhost" && own.ip().is_loopback(),
        };
    (to_self && t.path.starts_with(ROUTES_PREFIX)).then_some(Cow::Owned(t.path))
}

/// Resolves once and connects to one of the checked addresses: the connection is pinned to
/// what was checked.
async fn pinned_connect(shared: &Shared, host: &Host, port: u16) -> Result<TcpStream, Outcome> {
    let limits = &shared.limits;
    let addrs = tokio::time::timeout(
        limits.connect_timeout,
        shared
            .resolver
            .addresses(host, port, &shared.policy.listed_ips),
    )
    .await
    .map_err(|_| denied(504, "name lookup timed out"))?
    .map_err(|e| match e {
        e @ ResolveError::Special { .. } => denied(403, e.to_string()),
        e => denied(502, e.to_string()),
    })?;
    let mut last = String::from("no address");
    for addr in addrs {
        match tokio::time::timeout(limits.connect_timeout, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "connect timed out".into(),
        }
    }
    Err(denied(502, format!("cannot connect: {last}")))
}

/// Writes `bytes` to `w`, counting them against the budget and `counter`.
async fn send<W: AsyncWrite + Unpin>(
    shared: &Shared,
    w: &mut W,
    bytes: &[u8],
    counter: &AtomicU64,
) -> Result<(), Stop> {
    if bytes.is_empty() {
        return Ok(());
    }
    if !shared.budget.charge(bytes.len()) {
        return Err(Stop::Budget);
    }
    w.write_all(bytes)
        .await
        .map_err(|e| Stop::Io(e.to_string()))?;
    counter.fetch_add(bytes.len() as u64, Ordering::Relaxed);
    Ok(())
}

/// Copies one direction of a connection under the job's bounds (see `relay.rs`).
async fn pump(
    shared: &Shared,
    from: &TcpStream,
    to: &TcpStream,
    counter: &AtomicU64,
    activity: &Activity,
) -> Result<(), Stop> {
    Pump {
        from,
        to,
        budget: &shared.budget,
        idle: shared.limits.idle_timeout,
        counter,
        activity,
    }
    .run()
    .await
}

async fn tunnel(
    shared: &Shared,
    client: &mut BufConn<TcpStream>,
    mut upstream: TcpStream,
    attempt: &Attempt,
) -> Outcome {
    if let Err(e) = client
        .stream
        .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .await
    {
        return Outcome::Allowed(format!("connection error: {e}"));
    }
    let early = std::mem::take(&mut client.pending);
    if let Err(stop) = send(shared, &mut upstream, &early, &attempt.up).await {
        return Outcome::Allowed(stop.reason());
    }
    let activity = Activity::new();
    let result = tokio::try_join!(
        pump(shared, &client.stream, &upstream, &attempt.up, &activity),
        pump(shared, &upstream, &client.stream, &attempt.down, &activity),
    );
    match result {
        Ok(_) => Outcome::Allowed("ok".into()),
        Err(stop) => Outcome::Allowed(stop.reason()),
    }
}

async fn forward(
    shared: &Shared,
    client: &mut BufConn<TcpStream>,
    upstream: TcpStream,
    request: &http1::RequestHead,
    target: &http1::Target,
    attempt: &Attempt,
) -> Outcome {
    let mut upstream = BufConn::new(upstream);
    let head = http1::upstream_request(request, target);
    if let Err(stop) = send(shared, &mut upstream.stream, &head, &attempt.up).await {
        return Outcome::Allowed(stop.reason());
    }
    let expects_continue = request
        .values("expect")
        .any(|v| v.eq_ignore_ascii_case(b"100-continue"));
    if expects_continue && request.framing != Framing::None {
        let _ = client
            .stream
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await;
    }
    if let Err(stop) = relay_body(
        shared,
        client,
        &mut upstream.stream,
        request.framing,
        attempt,
    )
    .await
    {
        return match stop {
            BodyStop::Refused(why) => denied(400, why),
            BodyStop::Stop(s) => Outcome::Allowed(s.reason()),
        };
    }
    // Response heads, interim (1xx) ones first.
    loop {
        let head = match upstream
            .read_head(RESPONSE_HEAD_MAX, shared.limits.idle_timeout)
            .await
        {
            Ok(h) => h,
            Err(e) => return Outcome::Allowed(format!("bad upstream response: {e}")),
        };
        let (head, code) = match http1::downstream_response(&head) {
            Ok(h) => h,
            Err(e) => return Outcome::Allowed(e.to_string()),
        };
        if let Err(stop) = send(shared, &mut client.stream, &head, &attempt.down).await {
            return Outcome::Allowed(stop.reason());
        }
        if !(100..200).contains(&code) || code == 101 {
            break;
        }
    }
    let rest = std::mem::take(&mut upstream.pending);
    if let Err(stop) = send(shared, &mut client.stream, &rest, &attempt.down).await {
        return Outcome::Allowed(stop.reason());
    }
    let activity = Activity::new();
    match pump(
        shared,
        &upstream.stream,
        &client.stream,
        &attempt.down,
        &activity,
    )
    .await
    {
        Ok(()) => Outcome::Allowed("ok".into()),
        Err(stop) => Outcome::Allowed(stop.reason()),
    }
}

enum BodyStop {
    Refused(String),
    Stop(Stop),
}

impl From<Stop> for BodyStop {
    fn from(s: Stop) -> Self {
        BodyStop::Stop(s)
    }
}

fn body_err(e: HeadError) -> BodyStop {
    match e {
        HeadError::Timeout => BodyStop::Stop(Stop::Idle),
        HeadError::Io(e) => BodyStop::Stop(Stop::Io(e)),
        HeadError::Closed => BodyStop::Stop(Stop::Io("client closed mid-body".into())),
        e => BodyStop::Refused(e.to_string()),
    }
}

/// Copies exactly `n` bytes of body from the client.
async fn copy_exact<W: AsyncWrite + Unpin>(
    shared: &Shared,
    client: &mut BufConn<TcpStream>,
    upstream: &mut W,
    mut n: u64,
    attempt: &Attempt,
) -> Result<(), BodyStop> {
    while n > 0 {
        if client.pending.is_empty()
            && client
                .fill(shared.limits.idle_timeout)
                .await
                .map_err(body_err)?
                == 0
        {
            return Err(BodyStop::Stop(Stop::Io("client closed mid-body".into())));
        }
        let take = client
            .pending
            .len()
            .min(usize::try_from(n).unwrap_or(usize::MAX));
        let chunk: Vec<u8> = client.pending.drain(..take).collect();
        send(shared, upstream, &chunk, &attempt.up).await?;
        n -= take as u64;
    }
    Ok(())
}

async fn relay_body(
    shared: &Shared,
    client: &mut BufConn<TcpStream>,
    upstream: &mut TcpStream,
    framing: Framing,
    attempt: &Attempt,
) -> Result<(), BodyStop> {
    let idle = shared.limits.idle_timeout;
    match framing {
        Framing::None => Ok(()),
        Framing::Length(n) => copy_exact(shared, client, upstream, n, attempt).await,
        Framing::Chunked => loop {
            let line = client
                .read_line(CHUNK_LINE_MAX, idle)
                .await
                .map_err(body_err)?;
            let size = http1::chunk_size(&line).map_err(body_err)?;
            send(shared, upstream, &line, &attempt.up).await?;
            if size == 0 {
                loop {
                    let trailer = client
                        .read_line(CHUNK_LINE_MAX, idle)
                        .await
                        .map_err(body_err)?;
                    send(shared, upstream, &trailer, &attempt.up).await?;
                    if trailer == b"\r\n" {
                        return Ok(());
                    }
                }
            }
            copy_exact(shared, client, upstream, size, attempt).await?;
            let end = client.read_line(2, idle).await.map_err(body_err)?;
            if end != b"\r\n" {
                return Err(BodyStop::Refused("chunk not followed by CRLF".into()));
            }
            send(shared, upstream, &end, &attempt.up).await?;
        },
    }
}

/// Hop-by-hop headers, and those the node decides, that a route never takes from the
/// sandbox or passes back to it (`accept-encoding`: the node asks for `identity`).
fn route_skips(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "te"
            | "trailer"
            | "upgrade"
            | "host"
            | "expect"
            | "content-length"
            | "transfer-encoding"
            | "accept-encoding"
    ) || name.starts_with("proxy-")
}

/// Room left in front of a chunk for its size line (eight hex digits and CRLF; leading
/// zeros are valid chunk-size syntax).
const CHUNK_HEAD: usize = 10;

/// Frames `out[CHUNK_HEAD..]` as one chunk in place; empties `out` when there is no data
/// (a zero-size chunk would end the body).
fn frame_chunk(out: &mut Vec<u8>) {
    let len = out.len() - CHUNK_HEAD;
    if len == 0 {
        out.clear();
        return;
    }
    let size = format!("{len:08x}\r\n");
    out[..CHUNK_HEAD].copy_from_slice(size.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// A request on a credentialed route (`target`, its `/routes/…` path): read whole
/// (bounded), sent upstream over TLS with the route's headers and `Accept-Encoding:
/// identity`, the answer streamed back with every secret of the route replaced by
/// `<redacted>` in its headers and body (a compressed body is refused: it could not be
/// checked). A body being redacted goes back chunked (close-delimited to an HTTP/1.0
/// client): its length can change. The audit names the route, never a value.
async fn route(
    shared: &Shared,
    client: &mut BufConn<TcpStream>,
    request: &http1::RequestHead,
    target: &str,
    attempt: &mut Attempt,
) -> Outcome {
    let (name, rest) = match routes::split_route_path(target) {
        Ok(p) => p,
        Err(e) => {
            attempt.host = "route".into();
            return denied(400, e.to_string());
        }
    };
    attempt.host = format!("route:{name}");
    let Some(route) = shared.routes.get(name) else {
        return denied(404, "no such route");
    };
    attempt.port = route.port;
    let len = match request.framing {
        Framing::None => 0,
        Framing::Length(n) if n <= ROUTE_BODY_MAX => n,
        Framing::Length(_) => return denied(413, "route request body too large"),
        Framing::Chunked => return denied(411, "route requests need a Content-Length"),
    };
    let Ok(method) = reqwest::Method::from_bytes(request.method.as_bytes()) else {
        return denied(400, "bad method");
    };
    let mut body = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    if let Err(stop) = copy_exact(shared, client, &mut body, len, attempt).await {
        return match stop {
            BodyStop::Refused(why) => denied(400, why),
            BodyStop::Stop(s) => Outcome::Allowed(s.reason()),
        };
    }
    let mut headers = reqwest::header::HeaderMap::new();
    for (n, v) in &request.headers {
        let lower = n.to_ascii_lowercase();
        if route_skips(&lower) || route.headers().iter().any(|(h, _)| h.as_str() == lower) {
            continue;
        }
        if let (Ok(hn), Ok(hv)) = (
            reqwest::header::HeaderName::from_bytes(lower.as_bytes()),
            reqwest::header::HeaderValue::from_bytes(v),
        ) {
            headers.append(hn, hv);
        }
    }
    for (h, v) in route.headers() {
        headers.insert(h.clone(), v.clone());
    }
    headers.insert(
        reqwest::header::ACCEPT_ENCODING,
        reqwest::header::HeaderValue::from_static("identity"),
    );
    let is_head = method == reqwest::Method::HEAD;
    let upstream_call = route
        .client()
        .request(method, route.url(rest))
        .headers(headers)
        .body(body)
        .send();
    let mut response = match tokio::time::timeout(shared.limits.idle_timeout, upstream_call).await {
        Err(_) => return denied(504, "route upstream timed out"),
        // The error names the URL, never a header.
        Ok(Err(e)) => return denied(502, format!("route upstream failed: {e}")),
        Ok(Ok(r)) => r,
    };
    let status = response.status();
    let redactor = route.redactor();
    let has_body = !is_head && !status.is_informational() && status != 204 && status != 304;
    if has_body && cynode_egress::redact::is_compressed(response.headers()) {
        return denied(502, "route answer is compressed and cannot be checked");
    }
    // A body being redacted may change length: no Content-Length, chunked to an HTTP/1.1
    // client, close-delimited to an HTTP/1.0 one.
    let redacting = has_body && !redactor.is_empty();
    let chunked = redacting && request.version >= 1;
    let mut head = format!(
        "HTTP/1.1 {} {}\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or("")
    )
    .into_bytes();
    for (n, v) in response.headers() {
        let name = n.as_str();
        if (route_skips(name) && name != "content-length")
            || (name == "content-length" && redacting)
            // A header named by a secret goes nowhere: `<redacted>` is no header name.
            || matches!(redactor.redact(name.as_bytes()), Cow::Owned(_))
        {
            continue;
        }
        head.extend_from_slice(name.as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(&redactor.redact(v.as_bytes()));
        head.extend_from_slice(b"\r\n");
    }
    if chunked {
        head.extend_from_slice(b"Transfer-Encoding: chunked\r\n");
    }
    head.extend_from_slice(b"Connection: close\r\n\r\n");
    if let Err(stop) = send(shared, &mut client.stream, &head, &attempt.down).await {
        return Outcome::Allowed(stop.reason());
    }
    let mut stream = redactor.stream();
    let mut out = Vec::new();
    let room = if chunked { CHUNK_HEAD } else { 0 };
    loop {
        let chunk = match tokio::time::timeout(shared.limits.idle_timeout, response.chunk()).await {
            Err(_) => return Outcome::Allowed(Stop::Idle.reason()),
            Ok(Err(e)) => return Outcome::Allowed(format!("route upstream failed: {e}")),
            Ok(Ok(c)) => c,
        };
        out.clear();
        out.resize(room, 0);
        let done = match &chunk {
            Some(c) if !redacting => {
                // Nothing to look for: the piece goes as it came.
                if let Err(stop) = send(shared, &mut client.stream, c, &attempt.down).await {
                    return Outcome::Allowed(stop.reason());
                }
                continue;
            }
            Some(c) => {
                stream.push(c, &mut out);
                false
            }
            None if !redacting => break,
            None => {
                stream.finish(&mut out);
                true
            }
        };
        if chunked {
            frame_chunk(&mut out);
            if done {
                out.extend_from_slice(b"0\r\n\r\n");
            }
        }
        if let Err(stop) = send(shared, &mut client.stream, &out, &attempt.down).await {
            return Outcome::Allowed(stop.reason());
        }
        if done {
            break;
        }
    }
    let _ = client.stream.shutdown().await;
    Outcome::Allowed("ok".into())
}
