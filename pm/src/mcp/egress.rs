//! The gateway's way out: `web.fetch`, `web.search` and `api.call`, under the egress
//! rules the worker's proxy applies (the `cynode-egress` crate, one copy for both).
//!
//! - `web.fetch {url, method?: GET|HEAD, headers?}` reaches only a destination the job's
//!   [`Policy`] allows (the tenant's `egress.allow`, narrowed by the skill's declared
//!   `egress`). The name is resolved here (the shared resolver, not the system's NSS),
//!   every answer checked (a loopback, private, link-local or metadata address only when
//!   the ceiling lists that IP), and the connection goes only to those addresses: the
//!   request's client has a resolver that knows nothing else, so a second answer cannot
//!   move it. No redirect is followed (a 3xx comes back with its `location`).
//! - `api.call {route, method, path, body?, headers?}` goes to a credentialed route of
//!   the PM's own settings (`egress.routes`, as worker.yaml's), only when the tenant's
//!   `egress.routes_allowed` names it; the route's headers (values from the PM's
//!   environment, read once at start) are added here and never leave in a reply, the
//!   audit or a log line: a reply that echoes one has it replaced by `<redacted>`.
//! - `web.search {query, max_results?}` asks the PM's search route (`egress.search`: a
//!   SearxNG-compatible JSON API, `GET {base_url}/search?q=…&format=json`) exactly as
//!   `web.fetch` would fetch that URL (the route's host must be in the job's egress),
//!   with the query and result count bounded and the answer read to
//!   `search.max_response_bytes` at most; it gives back `[{title, url, snippet}]`. No
//!   route: `search_not_configured`; an answer over the bound or off the API:
//!   `search_upstream_invalid`.
//! - All: hop-by-hop and credential headers of the caller are dropped, at most
//!   [`MAX_REQUEST_HEADERS`] kept; the reply is bounded in time ([`Settings`]'s
//!   `timeout_seconds`) and size (`max_body_bytes`: the rest is dropped, `truncated`), and
//!   carries only a safe subset of the origin's headers, each cut.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use base64::Engine;
use cynode_egress::allowlist::{Host, Verdict};
use cynode_egress::routes::{split_route_path, RouteConfig, RoutePathError, Routes};
use cynode_egress::{Policy, Redactor, Resolver};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Most headers a caller may send.
pub const MAX_REQUEST_HEADERS: usize = 32;
/// Longest header value a caller may send, and longest one given back.
pub const MAX_HEADER_VALUE: usize = 1024;

/// The PM's egress settings for the gateway: `egress:` in the file `--gateway-egress-file`
/// names (YAML or JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// Credentialed routes, the worker's shape: `<name>: {upstream: "https://…",
    /// headers: {"Header": {env: PM_VAR}}, ca_file?}`.
    pub routes: BTreeMap<String, RouteConfig>,
    /// Name servers `web.fetch` asks (UDP, TCP on truncation); empty: the host's
    /// `/etc/resolv.conf` and `/etc/hosts`.
    pub nameservers: Vec<SocketAddr>,
    /// An extra CA `web.fetch` trusts beside the system's roots.
    pub ca_file: Option<PathBuf>,
    /// Largest reply body kept; the rest is dropped and the reply says `truncated`.
    pub max_body_bytes: usize,
    /// Bound on one call, connect to last byte.
    pub timeout_seconds: u64,
    /// `web.search`'s route: a SearxNG-compatible JSON API. Unset: `web.search` is
    /// refused as `search_not_configured`.
    pub search: Option<SearchSettings>,
}

/// `web.search`'s route: `GET {base_url}/search?q=…&format=json` (SearxNG's API), reached
/// as `web.fetch` reaches a URL: the search host must be in the job's egress, resolved
/// and pinned, no redirect followed, bounded in time by `timeout_seconds`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchSettings {
    /// `http(s)://host[:port][/path]`, without query or fragment.
    pub base_url: String,
    /// Most results given back (at most [`MAX_SEARCH_RESULTS`]; a call may ask fewer).
    #[serde(default = "default_search_results")]
    pub max_results: usize,
    /// Largest answer read from the search API; a longer one is refused, not cut.
    #[serde(default = "default_search_bytes")]
    pub max_response_bytes: usize,
}

/// The most results `web.search` ever gives back.
pub const MAX_SEARCH_RESULTS: usize = 50;
/// The longest query `web.search` takes, in bytes.
pub const MAX_QUERY_BYTES: usize = 512;
/// The longest title, URL and snippet of one result given back (each is cut, marked).
pub const MAX_RESULT_FIELD: usize = 2048;
/// The name a `web.search` refused for want of a route starts with.
pub const SEARCH_NOT_CONFIGURED: &str = "search_not_configured";
/// The name a `web.search` whose upstream answered off the API starts with.
pub const SEARCH_BAD_ANSWER: &str = "search_upstream_invalid";

fn default_search_results() -> usize {
    10
}

fn default_search_bytes() -> usize {
    1 << 20
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            routes: BTreeMap::new(),
            nameservers: Vec::new(),
            ca_file: None,
            max_body_bytes: 4 << 20,
            timeout_seconds: 30,
            search: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SettingsFile {
    #[serde(default)]
    egress: Settings,
}

/// Why the gateway's egress cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("{0}")]
    File(String),
    #[error("{0}")]
    Routes(#[from] cynode_egress::routes::RouteError),
    #[error("{0}")]
    Resolver(#[from] cynode_egress::resolve::ResolveError),
    #[error("the gateway's egress is already set up")]
    Twice,
}

/// Reads the settings file (`egress:` at its top).
pub fn load(path: &std::path::Path) -> Result<Settings, SetupError> {
    crate::settings_file::load("gateway egress file", path, |t| {
        serde_yaml::from_str::<SettingsFile>(t)
    })
    .map(|f| f.egress)
    .map_err(|e| SetupError::File(e.to_string()))
}

/// The gateway's egress, built once per process.
pub struct Egress {
    resolver: Resolver,
    routes: Routes,
    tls: cynode_tls::ClientTls,
    max_body: usize,
    timeout: Duration,
    search: Option<SearchSettings>,
}

impl std::fmt::Debug for Egress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Egress")
            .field("routes", &self.routes)
            .field("max_body", &self.max_body)
            .field("timeout", &self.timeout)
            .field("search", &self.search)
            .finish()
    }
}

static EGRESS: OnceLock<Egress> = OnceLock::new();

impl Egress {
    /// Builds it, reading each route's header values from `env`.
    pub fn build(s: &Settings, env: impl Fn(&str) -> Option<String>) -> Result<Egress, SetupError> {
        let timeout = Duration::from_secs(s.timeout_seconds.max(1));
        let routes = Routes::build(&s.routes, env, timeout)?;
        if let Some(search) = &s.search {
            check_search_base(&search.base_url).map_err(SetupError::File)?;
        }
        let resolver = if s.nameservers.is_empty() {
            Resolver::system()?
        } else {
            Resolver::with_nameservers(&s.nameservers)
        };
        Ok(Egress {
            resolver,
            routes,
            tls: cynode_tls::ClientTls {
                ca_file: s.ca_file.clone(),
                ..Default::default()
            },
            max_body: s.max_body_bytes.max(1),
            timeout,
            search: s.search.clone(),
        })
    }
}

/// Sets up this process's gateway egress from `s`, the route secrets read from the
/// environment now (`serve` and `run` call it once at start).
pub fn install(s: &Settings) -> Result<(), SetupError> {
    install_with(s, |v| std::env::var(v).ok())
}

/// [`install`] with the route secrets read through `env` (tests).
pub fn install_with(s: &Settings, env: impl Fn(&str) -> Option<String>) -> Result<(), SetupError> {
    let e = Egress::build(s, env)?;
    EGRESS.set(e).map_err(|_| SetupError::Twice)
}

/// This process's gateway egress: the installed one, or the defaults (the system's
/// resolver, no routes) on first use.
fn egress() -> Result<&'static Egress, String> {
    if let Some(e) = EGRESS.get() {
        return Ok(e);
    }
    let e = Egress::build(&Settings::default(), |_| None).map_err(|e| e.to_string())?;
    Ok(EGRESS.get_or_init(|| e))
}

/// Where a call went, or tried to, for the audit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dest {
    pub host: String,
    pub port: u16,
}

/// A refused or failed call: the reason (no secret, no body), and the status it maps to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denied {
    pub status: axum::http::StatusCode,
    pub reason: String,
}

fn denied(status: axum::http::StatusCode, reason: impl Into<String>) -> Denied {
    Denied {
        status,
        reason: reason.into(),
    }
}

fn forbidden(reason: impl Into<String>) -> Denied {
    denied(axum::http::StatusCode::FORBIDDEN, reason)
}

fn bad(reason: impl Into<String>) -> Denied {
    denied(axum::http::StatusCode::UNPROCESSABLE_ENTITY, reason)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FetchArgs {
    pub url: String,
    #[serde(default)]
    pub method: Option<String>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallArgs {
    pub route: String,
    pub method: String,
    pub path: String,
    #[serde(default)]
    pub body: Option<String>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

/// Headers a caller never sets: hop-by-hop ones, the framing and host (the client's),
/// and credentials (a job's credentials come from a route, never from the job).
fn never_forwarded(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
            | "expect"
            | "authorization"
            | "cookie"
            | "cookie2"
            | "x-api-key"
            | "forwarded"
            | "x-forwarded-for"
    ) || name.starts_with("proxy-")
}

/// The caller's headers that may go: bounded, valid, none of [`never_forwarded`] or
/// `also_dropped`.
fn request_headers(
    given: &BTreeMap<String, String>,
    also_dropped: &[&str],
) -> Result<HeaderMap, Denied> {
    if given.len() > MAX_REQUEST_HEADERS {
        return Err(bad(format!(
            "headers: at most {MAX_REQUEST_HEADERS} headers"
        )));
    }
    let mut out = HeaderMap::new();
    for (k, v) in given {
        let name = HeaderName::from_bytes(k.as_bytes())
            .map_err(|_| bad("headers: a header name is not valid"))?;
        if never_forwarded(name.as_str()) || also_dropped.contains(&name.as_str()) {
            continue;
        }
        if v.len() > MAX_HEADER_VALUE {
            return Err(bad(format!(
                "headers: `{name}` is longer than {MAX_HEADER_VALUE} bytes"
            )));
        }
        let value = HeaderValue::from_str(v)
            .map_err(|_| bad(format!("headers: `{name}` has a value that is not valid")))?;
        out.append(name, value);
    }
    Ok(out)
}

/// The origin's headers given back: a safe subset, each value cut.
const REPLY_HEADERS: [&str; 11] = [
    "content-type",
    "content-length",
    "content-encoding",
    "content-language",
    "cache-control",
    "etag",
    "last-modified",
    "location",
    "retry-after",
    "date",
    "age",
];

fn reply_headers(h: &HeaderMap, secrets: &Redactor) -> Map {
    let mut out = Map::new();
    for name in REPLY_HEADERS {
        if let Some(v) = h.get(name) {
            let bytes = secrets.redact(v.as_bytes());
            let text = String::from_utf8_lossy(&bytes);
            out.insert(
                name.to_string(),
                Value::String(crate::gateway::clip(&text, MAX_HEADER_VALUE)),
            );
        }
    }
    out
}

type Map = serde_json::Map<String, Value>;

/// A resolver that knows only the addresses checked for this one request: whatever
/// name the client asks for, these are the answer (the pin).
struct Pinned(Vec<SocketAddr>);

impl reqwest::dns::Resolve for Pinned {
    fn resolve(&self, _name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let addrs = self.0.clone();
        Box::pin(async move {
            let it: reqwest::dns::Addrs = Box::new(addrs.into_iter());
            Ok(it)
        })
    }
}

/// Reads the reply: status, safe headers, the body up to `max` (then `truncated`), as
/// text when it is UTF-8 and base64 otherwise; `secrets` replaced in headers and body.
async fn read_reply(
    mut resp: reqwest::Response,
    max: usize,
    secrets: &Redactor,
) -> Result<(Value, u64), Denied> {
    let status = resp.status().as_u16();
    let headers = reply_headers(resp.headers(), secrets);
    let mut body: Vec<u8> = Vec::new();
    let mut truncated = false;
    // Redacted as it comes, so a secret across two pieces, or across the cut at `max`,
    // is found whole.
    let mut redacting = secrets.stream();
    loop {
        let chunk = resp.chunk().await.map_err(|e| {
            denied(
                axum::http::StatusCode::BAD_GATEWAY,
                format!("the reply broke off: {}", without_url(&e)),
            )
        })?;
        let Some(chunk) = chunk else {
            redacting.finish(&mut body);
            break;
        };
        redacting.push(&chunk, &mut body);
        if body.len() > max {
            break;
        }
    }
    drop(resp);
    if body.len() > max {
        body.truncate(max);
        truncated = true;
    }
    let n = body.len() as u64;
    let (encoding, text) = match String::from_utf8(body) {
        Ok(t) => ("text", t),
        Err(e) => (
            "base64",
            base64::engine::general_purpose::STANDARD.encode(e.as_bytes()),
        ),
    };
    Ok((
        json!({ "status": status, "headers": headers, "body": text, "encoding": encoding,
                "truncated": truncated, "body_bytes": n }),
        n,
    ))
}

/// A reqwest error's text without its URL (a path or query may carry what the job put
/// there; the audit names host and port only).
fn without_url(e: &reqwest::Error) -> String {
    let mut s = String::new();
    let mut cur: Option<&dyn std::error::Error> = Some(e);
    if e.is_timeout() {
        return "timed out".into();
    }
    if e.is_connect() {
        s.push_str("cannot connect");
    }
    while let Some(c) = cur {
        cur = c.source();
        if let Some(src) = cur {
            if !s.is_empty() {
                s.push_str(": ");
            }
            s.push_str(&src.to_string());
        }
    }
    if s.is_empty() {
        s = "request failed".into();
    }
    crate::gateway::clip(&s, 200)
}

/// `web.fetch` for a job whose destinations are `policy`; `dest` is filled as soon as
/// the destination is known (for the audit, refused or not).
pub async fn web_fetch(
    policy: &Policy,
    a: FetchArgs,
    dest: &mut Option<Dest>,
) -> Result<(Value, u64), Denied> {
    let e = egress().map_err(|r| denied(axum::http::StatusCode::SERVICE_UNAVAILABLE, r))?;
    fetch(e, policy, a, dest, e.max_body).await
}

/// [`web_fetch`] with the reply's body cut at `max_body`.
async fn fetch(
    e: &Egress,
    policy: &Policy,
    a: FetchArgs,
    dest: &mut Option<Dest>,
    max_body: usize,
) -> Result<(Value, u64), Denied> {
    let method = match a.method.as_deref().unwrap_or("GET") {
        "GET" => reqwest::Method::GET,
        "HEAD" => reqwest::Method::HEAD,
        _ => return Err(bad("method: GET or HEAD")),
    };
    if a.url.len() > 8192 {
        return Err(bad("url: longer than 8192 bytes"));
    }
    let mut url = url::Url::parse(&a.url).map_err(|_| bad("url: not a valid URL"))?;
    let default_port = match url.scheme() {
        "http" => 80,
        "https" => 443,
        _ => return Err(bad("url: only http:// and https:// URLs")),
    };
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad("url: user information is not accepted"));
    }
    url.set_fragment(None);
    let raw_host = url.host_str().unwrap_or_default().to_string();
    let host = Host::parse(&raw_host).map_err(|e| bad(format!("url: {e}")))?;
    let port = url.port().unwrap_or(default_port);
    *dest = Some(Dest {
        host: host.to_string(),
        port,
    });
    match policy.allow.check(&host, port) {
        Verdict::Allowed => {}
        Verdict::PortNotAllowed => {
            return Err(forbidden(format!(
                "port {port} of {host} is not in the task's egress allowlist"
            )))
        }
        Verdict::NotListed => {
            return Err(forbidden(format!(
                "{host} is not in the task's egress allowlist"
            )))
        }
    }
    if let Host::Name(n) = &host {
        // The normalised name (lower case, no trailing dot) is what the client sends.
        url.set_host(Some(n)).map_err(|_| bad("url: bad host"))?;
    }
    let addrs = tokio::time::timeout(
        e.timeout,
        e.resolver.addresses(&host, port, &policy.listed_ips),
    )
    .await
    .map_err(|_| {
        denied(
            axum::http::StatusCode::GATEWAY_TIMEOUT,
            "name lookup timed out",
        )
    })?
    .map_err(|err| match err {
        cynode_egress::resolve::ResolveError::Special { .. } => forbidden(err.to_string()),
        other => denied(axum::http::StatusCode::BAD_GATEWAY, other.to_string()),
    })?;
    let headers = request_headers(&a.headers, &[])?;
    let builder = reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(e.timeout)
        .pool_max_idle_per_host(0)
        .dns_resolver(Arc::new(Pinned(addrs)));
    let client = e
        .tls
        .apply(builder)
        .and_then(|b| {
            b.build()
                .map_err(|x| cynode_tls::TlsError::Config(x.to_string()))
        })
        .map_err(|x| denied(axum::http::StatusCode::INTERNAL_SERVER_ERROR, x.to_string()))?;
    let call = async {
        let resp = client
            .request(method, url)
            .headers(headers)
            .send()
            .await
            .map_err(|x| denied(axum::http::StatusCode::BAD_GATEWAY, without_url(&x)))?;
        read_reply(resp, max_body, &Redactor::default()).await
    };
    tokio::time::timeout(e.timeout, call)
        .await
        .unwrap_or_else(|_| {
            Err(denied(
                axum::http::StatusCode::GATEWAY_TIMEOUT,
                format!("no whole reply within {} s", e.timeout.as_secs()),
            ))
        })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchArgs {
    pub query: String,
    #[serde(default)]
    pub max_results: Option<usize>,
}

/// A search base URL the PM accepts: http(s), a host, no user, query or fragment.
fn check_search_base(base: &str) -> Result<(), String> {
    let why = |w: &str| format!("egress.search.base_url `{base}`: {w}");
    let u = url::Url::parse(base).map_err(|_| why("not a URL"))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(why("only http:// and https://"));
    }
    if u.host_str().is_none_or(str::is_empty) {
        return Err(why("no host"));
    }
    if !u.username().is_empty() || u.password().is_some() {
        return Err(why("user information is not accepted"));
    }
    if u.query().is_some() || u.fragment().is_some() {
        return Err(why("no query or fragment"));
    }
    Ok(())
}

/// The search URL for `query`: `{base}/search?q=<query>&format=json`.
fn search_url(base: &str, query: &str) -> Result<url::Url, Denied> {
    let mut u = url::Url::parse(base.trim_end_matches('/'))
        .map_err(|_| bad("the search route's base_url is not a URL"))?;
    let path = format!("{}/search", u.path().trim_end_matches('/'));
    u.set_path(&path);
    u.query_pairs_mut()
        .append_pair("q", query)
        .append_pair("format", "json");
    Ok(u)
}

/// `s` cut to [`MAX_RESULT_FIELD`] bytes on a character boundary, and whether it was.
fn cut_field(s: &str) -> (String, bool) {
    if s.len() <= MAX_RESULT_FIELD {
        return (s.to_string(), false);
    }
    let mut end = MAX_RESULT_FIELD;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    (s[..end].to_string(), true)
}

/// SearxNG's answer as the normalised list `[{title, url, snippet}]` (`content` is the
/// snippet), at most `max` results; a result without a string `url` is skipped, each
/// field cut to [`MAX_RESULT_FIELD`] (the result then says `truncated`).
fn normalise_results(answer: &Value, max: usize) -> Result<Vec<Value>, String> {
    let list = answer
        .get("results")
        .and_then(Value::as_array)
        .ok_or("the answer has no `results` list")?;
    let text = |r: &Value, k: &str| r.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let mut out = Vec::new();
    for r in list {
        if out.len() >= max {
            break;
        }
        let Some(url) = r.get("url").and_then(Value::as_str) else {
            continue;
        };
        let snippet = match r.get("content").and_then(Value::as_str) {
            Some(c) => c.to_string(),
            None => text(r, "snippet"),
        };
        let (title, t1) = cut_field(&text(r, "title"));
        let (url, t2) = cut_field(url);
        let (snippet, t3) = cut_field(&snippet);
        let mut v = json!({ "title": title, "url": url, "snippet": snippet });
        if t1 || t2 || t3 {
            v["truncated"] = json!(true);
        }
        out.push(v);
    }
    Ok(out)
}

/// `web.search {query, max_results?}` through the PM's search route, for a job whose
/// destinations are `policy` (the route's host must be among them): `{query, results:
/// [{title, url, snippet}], count}`.
pub async fn web_search(
    policy: &Policy,
    a: SearchArgs,
    dest: &mut Option<Dest>,
) -> Result<(Value, u64), Denied> {
    let e = egress().map_err(|r| denied(axum::http::StatusCode::SERVICE_UNAVAILABLE, r))?;
    let Some(search) = &e.search else {
        return Err(denied(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "{SEARCH_NOT_CONFIGURED}: this PM has no search route \
                 (gateway egress file: egress.search.base_url)"
            ),
        ));
    };
    let query = a.query.trim();
    if query.is_empty() {
        return Err(bad("query: must not be empty"));
    }
    if query.len() > MAX_QUERY_BYTES {
        return Err(bad(format!("query: longer than {MAX_QUERY_BYTES} bytes")));
    }
    if query.chars().any(char::is_control) {
        return Err(bad("query: control characters are not accepted"));
    }
    let ceiling = search.max_results.clamp(1, MAX_SEARCH_RESULTS);
    let max = match a.max_results {
        Some(0) => return Err(bad("max_results: must be positive")),
        Some(n) => n.min(ceiling),
        None => ceiling,
    };
    let url = search_url(&search.base_url, query)?;
    let cap = search.max_response_bytes.max(1);
    let fetched = FetchArgs {
        url: url.to_string(),
        method: None,
        headers: BTreeMap::from([("accept".to_string(), "application/json".to_string())]),
    };
    let (reply, n) = fetch(e, policy, fetched, dest, cap).await?;
    let upstream = |why: String| {
        denied(
            axum::http::StatusCode::BAD_GATEWAY,
            format!("{SEARCH_BAD_ANSWER}: {why}"),
        )
    };
    if reply["truncated"] == true {
        return Err(upstream(format!("the answer is over {cap} bytes")));
    }
    let status = reply["status"].as_u64().unwrap_or(0);
    if status != 200 {
        return Err(upstream(format!("the search API answered {status}")));
    }
    if reply["encoding"] != "text" {
        return Err(upstream("the answer is not UTF-8 text".into()));
    }
    let answer: Value = serde_json::from_str(reply["body"].as_str().unwrap_or_default())
        .map_err(|x| upstream(format!("the answer is not JSON: {x}")))?;
    let results = normalise_results(&answer, max).map_err(|w| upstream(w.to_string()))?;
    Ok((
        json!({ "query": query, "count": results.len(), "results": results }),
        n,
    ))
}

/// `api.call` through route `a.route`, which `allowed` (the tenant's
/// `egress.routes_allowed`) must name.
pub async fn api_call(
    allowed: &[String],
    a: CallArgs,
    dest: &mut Option<Dest>,
) -> Result<(Value, u64), Denied> {
    let e = egress().map_err(|r| denied(axum::http::StatusCode::SERVICE_UNAVAILABLE, r))?;
    if a.route.len() > 64 {
        return Err(bad("route: not a route name"));
    }
    *dest = Some(Dest {
        host: format!("route:{}", a.route),
        port: 0,
    });
    if !allowed.contains(&a.route) {
        return Err(forbidden(format!(
            "route `{}` is not in the tenant's egress.routes_allowed",
            a.route
        )));
    }
    let Some(route) = e.routes.get(&a.route) else {
        return Err(forbidden(format!(
            "route `{}` is not configured on this PM",
            a.route
        )));
    };
    let origin = route.origin().trim_start_matches("https://").to_string();
    *dest = Some(Dest {
        host: origin
            .rsplit_once(':')
            .map(|(h, _)| h.to_string())
            .unwrap_or(origin.clone()),
        port: route.port,
    });
    let method = match a.method.as_str() {
        "GET" => reqwest::Method::GET,
        "HEAD" => reqwest::Method::HEAD,
        "POST" => reqwest::Method::POST,
        "PUT" => reqwest::Method::PUT,
        "PATCH" => reqwest::Method::PATCH,
        "DELETE" => reqwest::Method::DELETE,
        _ => return Err(bad("method: GET, HEAD, POST, PUT, PATCH or DELETE")),
    };
    if !a.path.starts_with('/') || a.path.len() > 4096 {
        return Err(bad("path: must start with `/`, at most 4096 bytes"));
    }
    let target = format!(
        "{}{}{}",
        cynode_egress::routes::ROUTES_PREFIX,
        a.route,
        a.path
    );
    let rest = match split_route_path(&target) {
        Ok((_, rest)) => rest,
        Err(RoutePathError::Traversal) => {
            return Err(bad(RoutePathError::Traversal.to_string()));
        }
        Err(RoutePathError::Unknown) => return Err(bad("path: not a route path")),
    };
    let route_names: Vec<&str> = route.headers().iter().map(|(h, _)| h.as_str()).collect();
    let mut headers = request_headers(&a.headers, &route_names)?;
    for (h, v) in route.headers() {
        headers.insert(h.clone(), v.clone());
    }
    // A compressed answer could carry the secret past the redactor: ask for none.
    headers.insert(
        reqwest::header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    let body = a.body.unwrap_or_default();
    if body.len() > e.max_body {
        return Err(denied(
            axum::http::StatusCode::PAYLOAD_TOO_LARGE,
            format!("body: over {} bytes", e.max_body),
        ));
    }
    let call = async {
        let resp = route
            .client()
            .request(method, route.url(rest))
            .headers(headers)
            .body(body)
            .send()
            .await
            .map_err(|x| denied(axum::http::StatusCode::BAD_GATEWAY, without_url(&x)))?;
        if cynode_egress::redact::is_compressed(resp.headers()) {
            return Err(denied(
                axum::http::StatusCode::BAD_GATEWAY,
                "the route's answer is compressed and cannot be checked for its secret",
            ));
        }
        read_reply(resp, e.max_body, route.redactor()).await
    };
    tokio::time::timeout(e.timeout, call)
        .await
        .unwrap_or_else(|_| {
            Err(denied(
                axum::http::StatusCode::GATEWAY_TIMEOUT,
                format!("no whole reply within {} s", e.timeout.as_secs()),
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_and_hop_by_hop_headers_never_go() {
        let given: BTreeMap<String, String> = [
            ("Authorization", "Bearer x"),
            ("Cookie", "a=b"),
            ("Proxy-Authorization", "x"),
            ("Connection", "close"),
            ("Host", "evil"),
            ("Accept", "text/plain"),
            ("X-Route-Key", "mine"),
        ]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
        let h = request_headers(&given, &["x-route-key"]).unwrap();
        let names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["accept"]);
        let many: BTreeMap<String, String> =
            (0..40).map(|i| (format!("x-{i}"), "v".into())).collect();
        assert!(request_headers(&many, &[]).is_err());
        let crlf: BTreeMap<String, String> = [("x-a".into(), "a\r\nb: c".into())].into();
        assert!(request_headers(&crlf, &[]).is_err());
    }

    #[test]
    fn settings_load_and_a_route_without_its_secret_is_refused_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("gateway-egress.yaml");
        std::fs::write(
            &p,
            "egress:\n  routes:\n    git:\n      upstream: https://git.example/api\n      headers: {Authorization: {env: H5_UNSET_VAR}}\n  timeout_seconds: 5\n",
        )
        .unwrap();
        let s = load(&p).unwrap();
        assert_eq!((s.timeout_seconds, s.max_body_bytes), (5, 4 << 20));
        assert_eq!(s.routes["git"].upstream, "https://git.example/api");
        cynode_tls::install_provider();
        let e = Egress::build(&s, |_| None).unwrap_err().to_string();
        assert!(e.contains("H5_UNSET_VAR"), "{e}");
        std::fs::write(&p, "egress:\n  rutes: {}\n").unwrap();
        let e = load(&p).unwrap_err().to_string();
        assert!(e.contains("gateway-egress.yaml"), "{e}");
    }
}
