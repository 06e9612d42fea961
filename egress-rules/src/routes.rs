//! Credentialed routes (API egress): `egress.routes.<name>` (in worker.yaml, or the PM's
//! settings) names an `https://` upstream and headers whose values come from the
//! process's environment. On the worker the sandbox sends plain HTTP to
//! `$CYNODE_EGRESS_ROUTES_URL/<name>/…` (the proxy's own listener, path `/routes/<name>/…`);
//! on the PM a gateway `api.call` names the route. Either way the holder adds the headers
//! and speaks TLS upstream. The values live only in this process: marked sensitive, never
//! in a Debug output, a log line, an audit record or anything sent back to the sandbox.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use reqwest::header::{HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};

use crate::allowlist::split_authority;
use crate::redact::Redactor;

/// The path prefix routes are served under.
pub const ROUTES_PREFIX: &str = "/routes/";

/// One route as configured.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// `https://host[:port][/base/path]`; requests go below the base path.
    pub upstream: String,
    /// Header name → where its value comes from.
    #[serde(default)]
    pub headers: BTreeMap<String, HeaderSource>,
    /// Extra CA for the upstream (the system's roots are trusted too).
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
}

/// Where a route header's value comes from: an environment variable of the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderSource {
    pub env: String,
}

/// Why the routes cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("route name `{0}`: use lower-case letters, digits, `-` and `_`")]
    Name(String),
    #[error("route `{0}`: upstream must be https://host[:port][/path]")]
    Upstream(String),
    #[error("route `{route}`: header `{header}` is not a valid header name")]
    HeaderName { route: String, header: String },
    #[error("route `{route}`: environment variable `{env}` for header `{header}` is unset or not a valid header value")]
    Env {
        route: String,
        header: String,
        env: String,
    },
    #[error("route `{route}`: {message}")]
    Client { route: String, message: String },
}

/// A usable route.
pub struct Route {
    /// `https://authority`.
    origin: String,
    /// The base path without a trailing `/` (may be empty).
    base_path: String,
    /// The port the upstream listens on (for the audit).
    pub port: u16,
    headers: Vec<(HeaderName, HeaderValue)>,
    /// The header values, to be found and replaced in what the upstream answers.
    redactor: Redactor,
    client: reqwest::Client,
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.headers.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("Route")
            .field("origin", &self.origin)
            .field("base_path", &self.base_path)
            .field("headers", &names)
            .finish()
    }
}

/// All of a node's routes, by name.
#[derive(Debug, Default)]
pub struct Routes {
    map: BTreeMap<String, Route>,
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

impl Routes {
    /// Builds the routes, reading each header value with `env` (the node's environment in
    /// production). A route whose value is missing is an error: better refused at start
    /// than sent without its credential.
    pub fn build(
        config: &BTreeMap<String, RouteConfig>,
        env: impl Fn(&str) -> Option<String>,
        connect_timeout: Duration,
    ) -> Result<Routes, RouteError> {
        let mut map = BTreeMap::new();
        for (name, rc) in config {
            if !valid_name(name) {
                return Err(RouteError::Name(name.clone()));
            }
            let bad = || RouteError::Upstream(name.clone());
            let rest = rc.upstream.strip_prefix("https://").ok_or_else(bad)?;
            let split = rest.find('/').unwrap_or(rest.len());
            let (authority, path) = rest.split_at(split);
            if path.contains(['?', '#']) {
                return Err(bad());
            }
            let (_, port) = split_authority(authority).map_err(|_| bad())?;
            let mut headers = Vec::new();
            for (header, source) in &rc.headers {
                let hn = HeaderName::from_bytes(header.as_bytes()).map_err(|_| {
                    RouteError::HeaderName {
                        route: name.clone(),
                        header: header.clone(),
                    }
                })?;
                let mut value = env(&source.env)
                    .and_then(|v| HeaderValue::from_str(&v).ok())
                    .ok_or_else(|| RouteError::Env {
                        route: name.clone(),
                        header: header.clone(),
                        env: source.env.clone(),
                    })?;
                value.set_sensitive(true);
                headers.push((hn, value));
            }
            let tls = cynode_tls::ClientTls {
                ca_file: rc.ca_file.clone(),
                ..Default::default()
            };
            let builder = reqwest::Client::builder()
                .no_proxy()
                .redirect(reqwest::redirect::Policy::none())
                .connect_timeout(connect_timeout);
            let client_err = |message: String| RouteError::Client {
                route: name.clone(),
                message,
            };
            let client = tls
                .apply(builder)
                .map_err(|e| client_err(e.to_string()))?
                .build()
                .map_err(|e| client_err(e.to_string()))?;
            map.insert(
                name.clone(),
                Route {
                    origin: format!("https://{authority}"),
                    base_path: path.trim_end_matches('/').to_string(),
                    port: port.unwrap_or(443),
                    redactor: Redactor::new(headers.iter().map(|(_, v)| v.as_bytes())),
                    headers,
                    client,
                },
            );
        }
        Ok(Routes { map })
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn get(&self, name: &str) -> Option<&Route> {
        self.map.get(name)
    }

    /// The configured route names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.map.keys().map(String::as_str)
    }
}

/// Why a route path is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RoutePathError {
    #[error("no such route")]
    Unknown,
    #[error("a route path may not contain `.`/`..` segments, encoded dots or slashes, backslashes or a fragment")]
    Traversal,
}

/// Splits `/routes/<name>/<rest>` into the name and the rest (with its query), refusing
/// anything that could leave the route's base path once the upstream normalises it.
pub fn split_route_path(target: &str) -> Result<(&str, &str), RoutePathError> {
    let after = target
        .strip_prefix(ROUTES_PREFIX)
        .ok_or(RoutePathError::Unknown)?;
    let (name, rest) = match after.find(['/', '?']) {
        Some(i) => after.split_at(i),
        None => (after, ""),
    };
    let path = rest.split('?').next().unwrap_or("");
    let lower = rest.to_ascii_lowercase();
    if rest.contains(['#', '\\'])
        || lower.contains("%2e")
        || lower.contains("%2f")
        || lower.contains("%5c")
        || path.split('/').any(|seg| seg == "." || seg == "..")
    {
        return Err(RoutePathError::Traversal);
    }
    Ok((name, rest))
}

impl Route {
    /// The upstream URL for `rest` (as returned by [`split_route_path`]).
    pub fn url(&self, rest: &str) -> String {
        let rest = if rest.is_empty() || rest.starts_with('?') {
            format!("/{rest}")
        } else {
            rest.to_string()
        };
        format!("{}{}{}", self.origin, self.base_path, rest)
    }

    /// The headers this route sets (their names replace any the sandbox sent).
    pub fn headers(&self) -> &[(HeaderName, HeaderValue)] {
        &self.headers
    }

    /// The route's secrets (its header values), to be replaced in everything its upstream
    /// answers before any of it goes back to the caller.
    pub fn redactor(&self) -> &Redactor {
        &self.redactor
    }

    /// The client for this route's upstream: no proxy, no redirects, its CA.
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// `https://authority` of the upstream (no secret in it).
    pub fn origin(&self) -> &str {
        &self.origin
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(upstream: &str) -> BTreeMap<String, RouteConfig> {
        let mut headers = BTreeMap::new();
        headers.insert(
            "Authorization".to_string(),
            HeaderSource {
                env: "TOKEN_VAR".into(),
            },
        );
        [(
            "git".to_string(),
            RouteConfig {
                upstream: upstream.into(),
                headers,
                ca_file: None,
            },
        )]
        .into()
    }

    fn env(name: &str) -> Option<String> {
        (name == "TOKEN_VAR").then(|| "Bearer very-secret-value".to_string())
    }

    #[test]
    fn routes_build_and_hide_their_values() {
        cynode_tls::install_provider();
        let t = Duration::from_secs(5);
        let r = Routes::build(&cfg("https://git.example:8443/api/v4/"), env, t).unwrap();
        let route = r.get("git").unwrap();
        assert_eq!(route.port, 8443);
        assert_eq!(
            route.url("/projects?x=1"),
            "https://git.example:8443/api/v4/projects?x=1"
        );
        assert_eq!(route.url(""), "https://git.example:8443/api/v4/");
        let shown = format!("{r:?} {:?}", route.headers());
        assert!(!shown.contains("very-secret-value"), "{shown}");
        assert!(shown.contains("authorization"), "{shown}");
        for bad in [
            "http://git.example/",
            "https://",
            "https://a b/",
            "https://a.com/x?y",
        ] {
            assert!(Routes::build(&cfg(bad), env, t).is_err(), "{bad}");
        }
        let missing = Routes::build(&cfg("https://a.com"), |_| None, t).unwrap_err();
        assert!(missing.to_string().contains("TOKEN_VAR"));
        assert!(!missing.to_string().contains("very-secret"));
    }

    #[test]
    fn route_paths_cannot_leave_the_base() {
        assert_eq!(
            split_route_path("/routes/git/a/b?c=d").unwrap(),
            ("git", "/a/b?c=d")
        );
        assert_eq!(split_route_path("/routes/git").unwrap(), ("git", ""));
        assert_eq!(split_route_path("/routes/git?x").unwrap(), ("git", "?x"));
        assert_eq!(split_route_path("/other"), Err(RoutePathError::Unknown));
        for bad in [
            "/routes/git/../x",
            "/routes/git/a/./b",
            "/routes/git/..",
            "/routes/git/%2e%2e/x",
            "/routes/git/a%2Fb",
            "/routes/git/a\\b",
            "/routes/git/a#b",
        ] {
            assert_eq!(
                split_route_path(bad),
                Err(RoutePathError::Traversal),
                "{bad}"
            );
        }
        // Dots in a query are data, not path.
        assert!(split_route_path("/routes/git/a?v=../x").is_ok());
    }
}
