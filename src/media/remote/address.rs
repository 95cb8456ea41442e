//! Which addresses the server may fetch images from: public unicast only. A URL naming a
//! loopback, private or otherwise internal address would let a client make the server reach
//! what only the server can reach (cloud metadata endpoints, admin ports, the LAN).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Why `ip` may not be fetched from (a short description of its range), or `None` for a
/// public unicast address.
pub fn refused_range(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => refused_v4(v4),
        IpAddr::V6(v6) => refused_v6(v6),
    }
}

fn refused_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let o = ip.octets();
    let n = u32::from(ip);
    let within = |net: [u8; 4], bits: u32| n >> (32 - bits) == u32::from_be_bytes(net) >> (32 - bits);
    Some(match () {
        _ if within([0, 0, 0, 0], 8) => "unspecified (\"this network\")",
        _ if within([127, 0, 0, 0], 8) => "loopback",
        _ if within([10, 0, 0, 0], 8) || within([172, 16, 0, 0], 12) || within([192, 168, 0, 0], 16) => {
            "private (RFC 1918)"
        }
        _ if within([100, 64, 0, 0], 10) => "shared (carrier-grade NAT)",
        _ if within([169, 254, 0, 0], 16) => "link-local",
        _ if within([224, 0, 0, 0], 4) => "multicast",
        _ if o == [255, 255, 255, 255] => "broadcast",
        _ if within([240, 0, 0, 0], 4) => "reserved",
        _ if within([192, 0, 0, 0], 24) => "reserved (IETF protocol assignments)",
        _ if within([192, 0, 2, 0], 24) || within([198, 51, 100, 0], 24) || within([203, 0, 113, 0], 24) => {
            "documentation"
        }
        _ if within([198, 18, 0, 0], 15) => "benchmarking",
        _ => return None,
    })
}

fn refused_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    let embedded = |hi: u16, lo: u16| Ipv4Addr::from(((hi as u32) << 16) | lo as u32);
    // Forms that carry an IPv4 address: judged by that address.
    if let Some(v4) = ip.to_ipv4_mapped() {
        return refused_v4(v4);
    }
    if s[..6] == [0; 6] && !(s[6] == 0 && s[7] <= 1) {
        // IPv4-compatible (::a.b.c.d, deprecated), still routed as IPv4 by some stacks.
        return refused_v4(embedded(s[6], s[7]));
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return refused_v4(embedded(s[6], s[7])); // NAT64
    }
    if s[0] == 0x2002 {
        return refused_v4(embedded(s[1], s[2])); // 6to4
    }
    Some(match () {
        _ if ip.is_unspecified() => "unspecified",
        _ if ip.is_loopback() => "loopback",
        _ if s[0] & 0xfe00 == 0xfc00 => "unique-local",
        _ if s[0] & 0xffc0 == 0xfe80 => "link-local",
        _ if s[0] & 0xffc0 == 0xfec0 => "site-local",
        _ if s[0] & 0xff00 == 0xff00 => "multicast",
        _ if s[0] == 0x2001 && s[1] == 0x0db8 => "documentation",
        _ if s[..4] == [0x100, 0, 0, 0] => "reserved (discard)",
        // Only 2000::/3 is assigned for global unicast.
        _ if s[0] & 0xe000 != 0x2000 => "reserved (outside 2000::/3)",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(s: &str) -> Option<&'static str> {
        refused_range(s.parse().unwrap())
    }

    #[test]
    fn internal_ipv4_ranges_are_refused() {
        for (ip, range) in [
            ("0.0.0.0", "unspecified"),
            ("0.1.2.3", "unspecified"),
            ("127.0.0.1", "loopback"),
            ("127.255.255.254", "loopback"),
            ("10.0.0.1", "private"),
            ("10.255.255.255", "private"),
            ("172.16.0.1", "private"),
            ("172.31.255.255", "private"),
            ("192.168.1.1", "private"),
            ("100.64.0.1", "carrier-grade NAT"),
            ("100.127.255.255", "carrier-grade NAT"),
            ("169.254.169.254", "link-local"),
            ("224.0.0.1", "multicast"),
            ("239.255.255.250", "multicast"),
            ("255.255.255.255", "broadcast"),
            ("240.0.0.1", "reserved"),
            ("192.0.2.1", "documentation"),
            ("198.18.0.1", "benchmarking"),
        ] {
            let got = refused(ip).unwrap_or_else(|| panic!("{ip} was allowed"));
            assert!(got.contains(range), "{ip}: {got}");
        }
    }

    #[test]
    fn public_ipv4_is_allowed_right_next_to_the_ranges() {
        for ip in [
            "1.1.1.1",
            "8.8.8.8",
            "9.255.255.255",
            "11.0.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "192.167.255.255",
            "192.169.0.0",
            "100.63.255.255",
            "100.128.0.0",
            "169.253.255.255",
            "169.255.0.0",
            "223.255.255.255",
            "126.255.255.255",
            "128.0.0.0",
            "1.0.0.0",
        ] {
            assert_eq!(refused(ip), None, "{ip}");
        }
    }

    #[test]
    fn internal_ipv6_ranges_are_refused() {
        for (ip, range) in [
            ("::", "unspecified"),
            ("::1", "loopback"),
            ("fc00::1", "unique-local"),
            ("fd12:3456::1", "unique-local"),
            ("fe80::1", "link-local"),
            ("febf::1", "link-local"),
            ("fec0::1", "site-local"),
            ("ff02::1", "multicast"),
            ("2001:db8::1", "documentation"),
            // IPv4 inside IPv6: judged by the IPv4 address.
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:10.1.2.3", "private"),
            ("::ffff:169.254.169.254", "link-local"),
            ("::ffff:100.64.0.1", "carrier-grade NAT"),
            ("::ffff:0.0.0.0", "unspecified"),
            ("::ffff:255.255.255.255", "broadcast"),
            ("::127.0.0.1", "loopback"),
            ("64:ff9b::10.0.0.1", "private"),
            ("2002:c0a8:0101::1", "private"), // 6to4 of 192.168.1.1
            ("64:ff9b:1::1", "reserved"),
            ("fe00::1", "reserved"),
            ("4000::1", "reserved"),
        ] {
            let got = refused(ip).unwrap_or_else(|| panic!("{ip} was allowed"));
            assert!(got.contains(range), "{ip}: {got}");
        }
    }

    #[test]
    fn public_ipv6_is_allowed() {
        for ip in [
            "2606:4700:4700::1111",
            "2001:4860:4860::8888",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2002:0808:0808::1",
            "3fff:ffff::1",
        ] {
            assert_eq!(refused(ip), None, "{ip}");
        }
    }
}
