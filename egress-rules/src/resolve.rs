//! Where a permitted destination may be reached: the proxy resolves the name itself
//! (hickory, never the sandbox's or the host's NSS), refuses the whole answer if any
//! address is special ([`crate::addr`]) and not listed by the operator, and hands back the
//! addresses the connection is then made to. Each connection resolves once and connects to
//! a returned `SocketAddr`, so a second answer (DNS rebinding) can never change where an
//! already-checked connection goes.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use hickory_resolver::config::{
    LookupIpStrategy, NameServerConfig, NameServerConfigGroup, ResolveHosts, ResolverConfig,
    ResolverOpts,
};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::proto::xfer::Protocol;
use hickory_resolver::TokioResolver;

use crate::addr;
use crate::allowlist::{canonical, Host};

/// Why a destination has no usable address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("cannot read the system resolver configuration: {0}")]
    SystemConfig(String),
    #[error("name lookup failed: {0}")]
    Lookup(String),
    #[error("the name has no address")]
    NoAddress,
    #[error("resolves to {why} address {ip}, which the node's egress allowlist does not list")]
    Special { ip: IpAddr, why: &'static str },
}

/// The proxy's resolver.
#[derive(Clone)]
pub struct Resolver {
    inner: TokioResolver,
}

impl std::fmt::Debug for Resolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Resolver")
    }
}

fn options() -> ResolverOpts {
    let mut opts = ResolverOpts::default();
    opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    opts.timeout = Duration::from_secs(5);
    opts.attempts = 2;
    // Every name is looked up as given (fully qualified): no search domains.
    opts.ndots = 0;
    opts
}

impl Resolver {
    /// The host's resolver configuration (`/etc/resolv.conf`, and `/etc/hosts`).
    pub fn system() -> Result<Resolver, ResolveError> {
        let builder = TokioResolver::builder_tokio()
            .map_err(|e| ResolveError::SystemConfig(e.to_string()))?;
        Ok(Resolver {
            inner: builder.with_options(options()).build(),
        })
    }

    /// These name servers only, over UDP (TCP when an answer is truncated); no hosts
    /// file.
    pub fn with_nameservers(servers: &[SocketAddr]) -> Resolver {
        let mut group = NameServerConfigGroup::new();
        for s in servers {
            group.push(NameServerConfig::new(*s, Protocol::Udp));
            group.push(NameServerConfig::new(*s, Protocol::Tcp));
        }
        let config = ResolverConfig::from_parts(None, Vec::new(), group);
        let mut opts = options();
        opts.use_hosts_file = ResolveHosts::Never;
        let inner = TokioResolver::builder_with_config(config, TokioConnectionProvider::default())
            .with_options(opts)
            .build();
        Resolver { inner }
    }

    /// The addresses `host` may be reached at: an IP literal as itself (the allowlist has
    /// already listed it); a name's answers, all of them ordinary or listed in `listed`.
    pub async fn addresses(
        &self,
        host: &Host,
        port: u16,
        listed: &BTreeSet<IpAddr>,
    ) -> Result<Vec<SocketAddr>, ResolveError> {
        let name = match host {
            Host::Ip(ip) => return Ok(vec![SocketAddr::new(canonical(*ip), port)]),
            Host::Name(n) => format!("{n}."),
        };
        let answer = self
            .inner
            .lookup_ip(name)
            .await
            .map_err(|e| ResolveError::Lookup(e.to_string()))?;
        let ips: Vec<IpAddr> = answer.iter().map(canonical).collect();
        if ips.is_empty() {
            return Err(ResolveError::NoAddress);
        }
        check(&ips, listed)?;
        let mut unique = Vec::new();
        for ip in ips {
            if !unique.contains(&ip) {
                unique.push(ip);
            }
        }
        Ok(unique
            .into_iter()
            .map(|ip| SocketAddr::new(ip, port))
            .collect())
    }
}

/// Refuses the whole answer when one address is special and not listed: a name that mixes
/// public and private answers is not to be trusted with either.
pub fn check(ips: &[IpAddr], listed: &BTreeSet<IpAddr>) -> Result<(), ResolveError> {
    for ip in ips {
        let ip = canonical(*ip);
        if let Some(why) = addr::special(ip) {
            if !listed.contains(&ip) {
                return Err(ResolveError::Special { ip, why });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_special_answer_refuses_the_name_unless_listed() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let none = BTreeSet::new();
        assert!(check(&[ip("93.184.215.14")], &none).is_ok());
        let err = check(&[ip("93.184.215.14"), ip("127.0.0.1")], &none).unwrap_err();
        assert_eq!(
            err,
            ResolveError::Special {
                ip: ip("127.0.0.1"),
                why: "loopback"
            }
        );
        assert!(err.to_string().contains("loopback address 127.0.0.1"));
        let listed: BTreeSet<IpAddr> = [ip("10.0.0.5")].into();
        assert!(check(&[ip("10.0.0.5")], &listed).is_ok());
        assert!(check(&[ip("::ffff:10.0.0.5")], &listed).is_ok());
        assert!(check(&[ip("10.0.0.6")], &listed).is_err());
        assert!(check(&[ip("::ffff:169.254.169.254")], &listed).is_err());
    }
}
