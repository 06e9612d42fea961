//! Destination patterns and allowlists: `host`, `*.suffix` or an IP address, each with an
//! optional `:port` (80 and 443 when none is given). Names are ASCII, case-insensitive and
//! compared without a trailing dot; anything else (internationalised names, numeric
//! look-alikes such as `127.1`, empty labels, wildcards elsewhere than in front) is refused
//! when parsed, so it can neither be listed nor requested.
//!
//! A job's list narrows the node's ceiling and never widens it ([`Allowlist::narrow`]).

use std::collections::BTreeSet;
use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The ports a pattern without `:port` allows.
pub const DEFAULT_PORTS: [u16; 2] = [80, 443];

/// Why a pattern, host or authority is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    #[error("empty host")]
    Empty,
    #[error(
        "`{0}`: only ASCII names are accepted (write internationalised names in their xn-- form)"
    )]
    NonAscii(String),
    #[error("`{0}`: not a valid host name")]
    BadName(String),
    #[error("`{0}`: a numeric name that is not a dotted-quad IPv4 address")]
    NumericName(String),
    #[error("`{0}`: a wildcard is allowed only as a leading `*.` before a name")]
    BadWildcard(String),
    #[error("`{0}`: not a valid port (1-65535)")]
    BadPort(String),
    #[error("`{0}`: not a valid IP address")]
    BadAddress(String),
    #[error("`{0}`: user information (`@`) is not accepted in a destination")]
    UserInfo(String),
}

/// A destination host as requested: a normalised name or an IP address (IPv4-mapped IPv6
/// addresses are given as IPv4).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Host {
    Name(String),
    Ip(IpAddr),
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Name(n) => f.write_str(n),
            Host::Ip(IpAddr::V6(v6)) => write!(f, "[{v6}]"),
            Host::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

impl Host {
    /// Parses a bare host: `[v6]`, a dotted-quad IPv4 address, a bare IPv6 address, or a
    /// name.
    pub fn parse(text: &str) -> Result<Host, PatternError> {
        if let Some(inner) = text.strip_prefix('[') {
            let v6 = inner
                .strip_suffix(']')
                .and_then(|a| Ipv6Addr::from_str(a).ok())
                .ok_or_else(|| PatternError::BadAddress(text.to_string()))?;
            return Ok(Host::Ip(canonical(IpAddr::V6(v6))));
        }
        if let Ok(ip) = IpAddr::from_str(text) {
            return Ok(Host::Ip(canonical(ip)));
        }
        normalize_name(text).map(Host::Name)
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it maps; any other address unchanged.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// Lower-cases a host name, drops one trailing dot, and checks it: ASCII letters, digits
/// and `-` in labels of 1-63 characters not starting or ending with `-`, at most 253 in
/// all, and a last label that is not numeric (so `127.1` or `0x7f000001` never pass as a
/// name).
pub fn normalize_name(text: &str) -> Result<String, PatternError> {
    if !text.is_ascii() {
        return Err(PatternError::NonAscii(text.to_string()));
    }
    let lower = text.to_ascii_lowercase();
    let name = lower.strip_suffix('.').unwrap_or(&lower);
    if name.is_empty() {
        return Err(PatternError::Empty);
    }
    if name.contains('*') {
        return Err(PatternError::BadWildcard(text.to_string()));
    }
    if name.len() > 253 {
        return Err(PatternError::BadName(text.to_string()));
    }
    for label in name.split('.') {
        let ok = !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !ok {
            return Err(PatternError::BadName(text.to_string()));
        }
    }
    let last = name.rsplit('.').next().unwrap_or(name);
    let hex = last
        .strip_prefix("0x")
        .is_some_and(|h| h.bytes().all(|b| b.is_ascii_hexdigit()));
    if last.bytes().all(|b| b.is_ascii_digit()) || hex {
        return Err(PatternError::NumericName(text.to_string()));
    }
    Ok(name.to_string())
}

/// Parses a port: decimal digits only, 1-65535.
pub fn parse_port(text: &str) -> Result<u16, PatternError> {
    if text.is_empty() || text.len() > 5 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(PatternError::BadPort(text.to_string()));
    }
    match text.parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(PatternError::BadPort(text.to_string())),
    }
}

/// Splits `host[:port]` / `[v6][:port]`; the port is `None` when absent. User information
/// is refused.
pub fn split_authority(text: &str) -> Result<(Host, Option<u16>), PatternError> {
    if text.contains('@') {
        return Err(PatternError::UserInfo(text.to_string()));
    }
    if text.starts_with('[') {
        let end = text
            .find(']')
            .ok_or_else(|| PatternError::BadAddress(text.to_string()))?;
        let host = Host::parse(&text[..=end])?;
        let rest = &text[end + 1..];
        if rest.is_empty() {
            return Ok((host, None));
        }
        let port = rest
            .strip_prefix(':')
            .ok_or_else(|| PatternError::BadAddress(text.to_string()))?;
        return Ok((host, Some(parse_port(port)?)));
    }
    if text.matches(':').count() > 1 {
        // A bare IPv6 address: no port can follow it.
        return Ipv6Addr::from_str(text)
            .map(|v6| (Host::Ip(canonical(IpAddr::V6(v6))), None))
            .map_err(|_| PatternError::BadAddress(text.to_string()));
    }
    match text.split_once(':') {
        Some((host, port)) => Ok((Host::parse(host)?, Some(parse_port(port)?))),
        None => Ok((Host::parse(text)?, None)),
    }
}

/// Which hosts a pattern matches.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HostPattern {
    /// Exactly this name.
    Name(String),
    /// Any name with at least one more label in front of this suffix (`*.a.com` matches
    /// `x.a.com` and `x.y.a.com`, not `a.com`).
    Suffix(String),
    /// Exactly this address, given as an IP literal.
    Ip(IpAddr),
}

impl HostPattern {
    fn matches(&self, host: &Host) -> bool {
        match (self, host) {
            (HostPattern::Name(p), Host::Name(n)) => p == n,
            (HostPattern::Suffix(s), Host::Name(n)) => is_below(n, s),
            (HostPattern::Ip(p), Host::Ip(ip)) => p == ip,
            _ => false,
        }
    }

    /// Whether every host `other` matches is matched by `self`.
    fn covers(&self, other: &HostPattern) -> bool {
        match (self, other) {
            (HostPattern::Suffix(s), HostPattern::Name(n)) => is_below(n, s),
            (HostPattern::Suffix(s), HostPattern::Suffix(t)) => t == s || is_below(t, s),
            (a, b) => a == b,
        }
    }
}

/// `name` ends with `.suffix` and has at least one label more.
fn is_below(name: &str, suffix: &str) -> bool {
    name.len() > suffix.len() + 1
        && name.ends_with(suffix)
        && name.as_bytes()[name.len() - suffix.len() - 1] == b'.'
}

/// One allowlist entry: hosts and a port (`None`: 80 and 443).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Pattern {
    pub host: HostPattern,
    pub port: Option<u16>,
}

impl Pattern {
    /// Parses `host`, `*.suffix`, `1.2.3.4`, `[v6]` or `v6`, each with an optional
    /// `:port` (not after a bare IPv6 address).
    pub fn parse(text: &str) -> Result<Pattern, PatternError> {
        if let Some(rest) = text.strip_prefix("*.") {
            let (suffix, port) = match rest.split_once(':') {
                Some((s, p)) => (s, Some(parse_port(p)?)),
                None => (rest, None),
            };
            let suffix =
                normalize_name(suffix).map_err(|_| PatternError::BadWildcard(text.to_string()))?;
            return Ok(Pattern {
                host: HostPattern::Suffix(suffix),
                port,
            });
        }
        if text.contains('*') {
            return Err(PatternError::BadWildcard(text.to_string()));
        }
        let (host, port) = split_authority(text)?;
        let host = match host {
            Host::Name(n) => HostPattern::Name(n),
            Host::Ip(ip) => HostPattern::Ip(ip),
        };
        Ok(Pattern { host, port })
    }

    /// The ports this pattern allows.
    pub fn ports(&self) -> Vec<u16> {
        match self.port {
            Some(p) => vec![p],
            None => DEFAULT_PORTS.to_vec(),
        }
    }

    fn allows_port(&self, port: u16) -> bool {
        match self.port {
            Some(p) => p == port,
            None => DEFAULT_PORTS.contains(&port),
        }
    }

    /// Whether `host:port` is allowed by this pattern.
    pub fn matches(&self, host: &Host, port: u16) -> bool {
        self.allows_port(port) && self.host.matches(host)
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            HostPattern::Name(n) => f.write_str(n)?,
            HostPattern::Suffix(s) => write!(f, "*.{s}")?,
            HostPattern::Ip(IpAddr::V6(v6)) => write!(f, "[{v6}]")?,
            HostPattern::Ip(ip) => write!(f, "{ip}")?,
        }
        match self.port {
            Some(p) => write!(f, ":{p}"),
            None => Ok(()),
        }
    }
}

impl TryFrom<String> for Pattern {
    type Error = PatternError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Pattern::parse(&s)
    }
}

impl From<Pattern> for String {
    fn from(p: Pattern) -> String {
        p.to_string()
    }
}

/// Why a job's list cannot be used under the node's ceiling.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NarrowError {
    #[error("egress_allow entry {0}")]
    Invalid(#[source] PatternError),
    #[error(
        "egress_allow entry `{pattern}` goes beyond this node's egress allowlist (port {port})"
    )]
    Widens { pattern: String, port: u16 },
}

/// A list of patterns; a destination is allowed when any pattern matches it. Empty: nothing
/// is allowed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Allowlist {
    pub patterns: Vec<Pattern>,
}

/// The answer to "may the sandbox reach `host:port`?".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Allowed,
    /// The host is listed, for other ports only.
    PortNotAllowed,
    NotListed,
}

impl Allowlist {
    /// Parses every entry; the first bad one is the error.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Allowlist, PatternError> {
        let patterns = entries
            .iter()
            .map(|e| Pattern::parse(e.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Allowlist { patterns })
    }

    /// Whether `host:port` is allowed, and if not, whether the host is listed on another
    /// port.
    pub fn check(&self, host: &Host, port: u16) -> Verdict {
        if self.patterns.iter().any(|p| p.matches(host, port)) {
            Verdict::Allowed
        } else if self.patterns.iter().any(|p| p.host.matches(host)) {
            Verdict::PortNotAllowed
        } else {
            Verdict::NotListed
        }
    }

    /// The IP addresses listed as IP literals (on any port): the only private or special
    /// addresses a name may resolve to.
    pub fn listed_ips(&self) -> BTreeSet<IpAddr> {
        self.patterns
            .iter()
            .filter_map(|p| match p.host {
                HostPattern::Ip(ip) => Some(ip),
                _ => None,
            })
            .collect()
    }

    /// Whether `pattern` allows nothing this list does not: for each of its ports, one
    /// pattern here allows that port and every host `pattern` matches.
    pub fn covers(&self, pattern: &Pattern) -> Result<(), u16> {
        for port in pattern.ports() {
            let covered = self
                .patterns
                .iter()
                .any(|c| c.allows_port(port) && c.host.covers(&pattern.host));
            if !covered {
                return Err(port);
            }
        }
        Ok(())
    }

    /// The list a job gets: `None`, the whole ceiling (`self`); `Some(list)`, that list,
    /// refused if any entry allows a destination the ceiling does not.
    pub fn narrow<S: AsRef<str>>(&self, job: Option<&[S]>) -> Result<Allowlist, NarrowError> {
        let Some(job) = job else {
            return Ok(self.clone());
        };
        let list = Allowlist::parse(job).map_err(NarrowError::Invalid)?;
        for p in &list.patterns {
            self.covers(p).map_err(|port| NarrowError::Widens {
                pattern: p.to_string(),
                port,
            })?;
        }
        Ok(list)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(s: &str) -> Host {
        Host::parse(s).unwrap()
    }

    fn list(entries: &[&str]) -> Allowlist {
        Allowlist::parse(entries).unwrap()
    }

    #[test]
    fn patterns_parse_and_normalise() {
        let p = Pattern::parse("PyPI.org.").unwrap();
        assert_eq!(p.host, HostPattern::Name("pypi.org".into()));
        assert_eq!(p.port, None);
        assert_eq!(p.to_string(), "pypi.org");
        let p = Pattern::parse("*.Files.PythonHosted.org:8443").unwrap();
        assert_eq!(p.host, HostPattern::Suffix("files.pythonhosted.org".into()));
        assert_eq!(p.port, Some(8443));
        assert_eq!(
            Pattern::parse("127.0.0.1:8080").unwrap().host,
            HostPattern::Ip("127.0.0.1".parse().unwrap())
        );
        assert_eq!(
            Pattern::parse("[::ffff:10.0.0.1]:80").unwrap(),
            Pattern::parse("10.0.0.1:80").unwrap(),
            "a mapped address is its IPv4 address"
        );
        assert_eq!(
            Pattern::parse("fd00::1").unwrap().to_string(),
            "[fd00::1]",
            "bare IPv6, no port"
        );
    }

    #[test]
    fn odd_names_are_refused_cleanly() {
        for bad in [
            "",
            ".",
            "*",
            "*.",
            "a..b",
            "-a.com",
            "a-.com",
            "a_b.com",
            "a b.com",
            "bücher.de",
            "пример.рф",
            "a.*.com",
            "*a.com",
            "**.a.com",
            "127.1",
            "0x7f000001",
            "1.2.3.4.5",
            "a.com:0",
            "a.com:65536",
            "a.com:+80",
            "a.com:",
            "a.com:80:80",
            "user@a.com",
            "[::1",
            "[::1]x",
            "[a.com]",
            &"a".repeat(64),
            &format!("{}.com", ["abcdefghij"; 25].join(".")),
        ] {
            assert!(Pattern::parse(bad).is_err(), "{bad:?} should be refused");
        }
        assert!(matches!(
            Pattern::parse("bücher.de"),
            Err(PatternError::NonAscii(_))
        ));
        assert!(Pattern::parse("xn--bcher-kva.de").is_ok());
    }

    #[test]
    fn matching_is_by_name_port_and_case() {
        let l = list(&[
            "pypi.org",
            "*.pythonhosted.org",
            "git.example:8443",
            "10.1.2.3",
        ]);
        assert_eq!(l.check(&host("PYPI.ORG."), 443), Verdict::Allowed);
        assert_eq!(l.check(&host("pypi.org"), 80), Verdict::Allowed);
        assert_eq!(l.check(&host("pypi.org"), 8080), Verdict::PortNotAllowed);
        assert_eq!(l.check(&host("evil-pypi.org"), 443), Verdict::NotListed);
        assert_eq!(l.check(&host("pypi.org.evil"), 443), Verdict::NotListed);
        assert_eq!(
            l.check(&host("files.pythonhosted.org"), 443),
            Verdict::Allowed
        );
        assert_eq!(
            l.check(&host("a.b.pythonhosted.org"), 443),
            Verdict::Allowed
        );
        assert_eq!(
            l.check(&host("pythonhosted.org"), 443),
            Verdict::NotListed,
            "a wildcard needs one more label"
        );
        assert_eq!(l.check(&host("xpythonhosted.org"), 443), Verdict::NotListed);
        assert_eq!(l.check(&host("git.example"), 8443), Verdict::Allowed);
        assert_eq!(l.check(&host("git.example"), 443), Verdict::PortNotAllowed);
        assert_eq!(l.check(&host("10.1.2.3"), 443), Verdict::Allowed);
        assert_eq!(l.check(&host("[::ffff:10.1.2.3]"), 443), Verdict::Allowed);
        assert_eq!(l.check(&host("10.1.2.4"), 443), Verdict::NotListed);
        assert_eq!(
            Allowlist::default().check(&host("a.com"), 443),
            Verdict::NotListed
        );
        assert_eq!(
            l.listed_ips().into_iter().collect::<Vec<_>>(),
            vec!["10.1.2.3".parse::<IpAddr>().unwrap()]
        );
    }

    #[test]
    fn a_job_list_narrows_the_ceiling_and_never_widens_it() {
        let ceiling = list(&["*.com", "pypi.org", "git.example:8443", "10.0.0.5"]);
        let ok = |job: &[&str]| ceiling.narrow(Some(job)).unwrap();
        assert_eq!(ok(&["*.a.com"]).patterns.len(), 1);
        ok(&[
            "x.a.com:443",
            "A.COM",
            "pypi.org:80",
            "git.example:8443",
            "10.0.0.5:443",
        ]);
        ok(&[]);
        assert_eq!(ceiling.narrow::<&str>(None).unwrap(), ceiling);
        for widening in [
            "*.org",
            "x.pypi.org",
            "pypi.org:8080",
            "git.example",
            "git.example:443",
            "10.0.0.6",
            "10.0.0.5:22",
            "com.",
            "*.net",
        ] {
            assert!(
                matches!(
                    ceiling.narrow(Some(&[widening])),
                    Err(NarrowError::Widens { .. })
                ),
                "{widening} widens"
            );
        }
        let narrow = list(&["*.a.com"]);
        assert!(narrow.narrow(Some(&["*.com"])).is_err());
        assert!(narrow.narrow(Some(&["a.com"])).is_err());
        assert!(narrow.narrow(Some(&["*.x.a.com", "b.a.com"])).is_ok());
        // A wildcard spread over two port-specific ceiling entries is covered.
        let split = list(&["*.a.com:80", "*.a.com:443"]);
        assert!(split.narrow(Some(&["*.b.a.com"])).is_ok());
        assert!(split.narrow(Some(&["*.b.a.com:8080"])).is_err());
        assert!(matches!(
            ceiling.narrow(Some(&["bücher.com"])),
            Err(NarrowError::Invalid(_))
        ));
    }

    #[test]
    fn serde_round_trips_and_refuses_bad_entries() {
        let l: Allowlist = serde_yaml::from_str("[\"*.a.com:8443\", \"b.com\"]").unwrap();
        assert_eq!(
            serde_json::to_string(&l).unwrap(),
            r#"["*.a.com:8443","b.com"]"#
        );
        assert!(serde_yaml::from_str::<Allowlist>("[\"a.*.com\"]").is_err());
    }
}
