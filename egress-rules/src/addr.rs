//! Which addresses the egress proxy never connects to unless the operator listed them:
//! loopback, private, shared (CGNAT), link-local, cloud metadata, multicast, broadcast,
//! unspecified, documentation and other reserved ranges, and IPv6 forms that embed such an
//! IPv4 address (mapped, compatible, NAT64, 6to4) or tunnel to one (Teredo). Every IPv6
//! address outside global unicast (2000::/3) is refused too.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Why an address is special, for the audit's reason; `None`: an ordinary public address.
pub fn special(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => special_v4(v4),
        IpAddr::V6(v6) => special_v6(v6),
    }
}

fn in_v4(ip: Ipv4Addr, net: [u8; 4], bits: u32) -> bool {
    let mask = if bits == 0 {
        0
    } else {
        u32::MAX << (32 - bits)
    };
    u32::from(ip) & mask == u32::from(Ipv4Addr::from(net)) & mask
}

fn special_v4(ip: Ipv4Addr) -> Option<&'static str> {
    const METADATA: [Ipv4Addr; 2] = [
        Ipv4Addr::new(169, 254, 169, 254),
        Ipv4Addr::new(100, 100, 100, 200),
    ];
    const TABLE: &[([u8; 4], u32, &str)] = &[
        ([0, 0, 0, 0], 8, "unspecified"),
        ([10, 0, 0, 0], 8, "private"),
        ([100, 64, 0, 0], 10, "shared (CGNAT)"),
        ([127, 0, 0, 0], 8, "loopback"),
        ([169, 254, 0, 0], 16, "link-local"),
        ([172, 16, 0, 0], 12, "private"),
        ([192, 0, 0, 0], 24, "reserved"),
        ([192, 0, 2, 0], 24, "documentation"),
        ([192, 88, 99, 0], 24, "reserved"),
        ([192, 168, 0, 0], 16, "private"),
        ([198, 18, 0, 0], 15, "benchmarking"),
        ([198, 51, 100, 0], 24, "documentation"),
        ([203, 0, 113, 0], 24, "documentation"),
        ([224, 0, 0, 0], 4, "multicast"),
        ([255, 255, 255, 255], 32, "broadcast"),
        ([240, 0, 0, 0], 4, "reserved"),
    ];
    if METADATA.contains(&ip) {
        return Some("metadata");
    }
    TABLE
        .iter()
        .find(|(net, bits, _)| in_v4(ip, *net, *bits))
        .map(|(_, _, why)| *why)
}

fn in_v6(ip: Ipv6Addr, net: [u16; 8], bits: u32) -> bool {
    let mask = if bits == 0 {
        0
    } else {
        u128::MAX << (128 - bits)
    };
    u128::from(ip) & mask == u128::from(Ipv6Addr::from(net)) & mask
}

/// The IPv4 address in the low 32 bits.
fn low_v4(ip: Ipv6Addr) -> Ipv4Addr {
    Ipv4Addr::from((u128::from(ip) & 0xffff_ffff) as u32)
}

fn special_v6(ip: Ipv6Addr) -> Option<&'static str> {
    if let Some(v4) = ip.to_ipv4_mapped() {
        return special_v4(v4);
    }
    if ip.is_unspecified() {
        return Some("unspecified");
    }
    if ip.is_loopback() {
        return Some("loopback");
    }
    if in_v6(ip, [0; 8], 96) {
        return Some("IPv4-compatible (deprecated)");
    }
    if in_v6(ip, [0x64, 0xff9b, 0, 0, 0, 0, 0, 0], 96) {
        return special_v4(low_v4(ip));
    }
    if in_v6(ip, [0x2002, 0, 0, 0, 0, 0, 0, 0], 16) {
        let embedded = Ipv4Addr::from(((u128::from(ip) >> 80) & 0xffff_ffff) as u32);
        return special_v4(embedded);
    }
    const TABLE: &[([u16; 8], u32, &str)] = &[
        ([0x64, 0xff9b, 1, 0, 0, 0, 0, 0], 48, "NAT64 local-use"),
        ([0x100, 0, 0, 0, 0, 0, 0, 0], 64, "discard-only"),
        ([0x2001, 0, 0, 0, 0, 0, 0, 0], 32, "Teredo tunnel"),
        ([0x2001, 2, 0, 0, 0, 0, 0, 0], 48, "benchmarking"),
        ([0x2001, 0x10, 0, 0, 0, 0, 0, 0], 28, "reserved (ORCHID)"),
        ([0x2001, 0x20, 0, 0, 0, 0, 0, 0], 28, "reserved (ORCHID)"),
        ([0x2001, 0xdb8, 0, 0, 0, 0, 0, 0], 32, "documentation"),
        ([0x3fff, 0, 0, 0, 0, 0, 0, 0], 20, "documentation"),
        ([0xfc00, 0, 0, 0, 0, 0, 0, 0], 7, "unique local (private)"),
        ([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10, "link-local"),
        ([0xfec0, 0, 0, 0, 0, 0, 0, 0], 10, "site-local"),
        ([0xff00, 0, 0, 0, 0, 0, 0, 0], 8, "multicast"),
    ];
    if let Some((_, _, why)) = TABLE.iter().find(|(net, bits, _)| in_v6(ip, *net, *bits)) {
        return Some(why);
    }
    if !in_v6(ip, [0x2000, 0, 0, 0, 0, 0, 0, 0], 3) {
        return Some("not global unicast");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn why(s: &str) -> Option<&'static str> {
        special(s.parse().unwrap())
    }

    #[test]
    fn special_addresses_are_named() {
        for (ip, expected) in [
            ("127.0.0.1", "loopback"),
            ("127.255.1.2", "loopback"),
            ("10.1.2.3", "private"),
            ("172.16.0.1", "private"),
            ("172.31.255.255", "private"),
            ("192.168.1.1", "private"),
            ("100.64.0.1", "shared (CGNAT)"),
            ("100.127.255.254", "shared (CGNAT)"),
            ("169.254.169.254", "metadata"),
            ("100.100.100.200", "metadata"),
            ("169.254.1.1", "link-local"),
            ("0.0.0.0", "unspecified"),
            ("0.1.2.3", "unspecified"),
            ("224.0.0.1", "multicast"),
            ("239.255.255.250", "multicast"),
            ("255.255.255.255", "broadcast"),
            ("240.0.0.1", "reserved"),
            ("192.0.2.1", "documentation"),
            ("198.51.100.7", "documentation"),
            ("203.0.113.9", "documentation"),
            ("198.18.0.1", "benchmarking"),
            ("::", "unspecified"),
            ("::1", "loopback"),
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:169.254.169.254", "metadata"),
            ("::ffff:10.0.0.1", "private"),
            ("::127.0.0.1", "IPv4-compatible (deprecated)"),
            ("64:ff9b::a00:1", "private"),
            ("64:ff9b::a9fe:a9fe", "metadata"),
            ("2002:7f00:1::", "loopback"),
            ("2002:a9fe:a9fe::1", "metadata"),
            ("2002:c0a8:101::1", "private"),
            ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo tunnel"),
            ("2001:db8::1", "documentation"),
            ("fd00::1", "unique local (private)"),
            ("fd00:ec2::254", "unique local (private)"),
            ("fc00::1", "unique local (private)"),
            ("fe80::1", "link-local"),
            ("fec0::1", "site-local"),
            ("ff02::1", "multicast"),
            ("100::1", "discard-only"),
            ("4000::1", "not global unicast"),
            ("::2", "IPv4-compatible (deprecated)"),
        ] {
            assert_eq!(why(ip), Some(expected), "{ip}");
        }
    }

    #[test]
    fn public_addresses_pass() {
        for ip in [
            "1.1.1.1",
            "8.8.8.8",
            "151.101.0.223",
            "172.32.0.1",
            "100.128.0.1",
            "192.169.0.1",
            "2a04:4e42::223",
            "2606:4700:4700::1111",
            "64:ff9b::808:808",
            "2002:808:808::1",
        ] {
            assert_eq!(why(ip), None, "{ip}");
        }
    }
}
