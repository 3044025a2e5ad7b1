//! Addresses as kube-proxy reads them from Services and EndpointSlices: k8s.io/utils/net's
//! ParseIPSloppy and ParseCIDRSloppy, Go 1.16's parsers, under which an IPv4 octet may have
//! leading zeros and is decimal (`198.19.0.041` is `198.19.0.41`). API servers before
//! Kubernetes 1.22 stored such addresses, and objects written then still hold them; a strict
//! parse would refuse the whole Service.

use std::net::{IpAddr, Ipv4Addr};

/// An address as ParseIPSloppy reads it: IPv6 as usual; IPv4 as four decimal octets, each
/// any run of digits (leading zeros allowed) whose value is at most 255.
pub fn parse_ip(s: &str) -> Option<IpAddr> {
    if s.contains(':') {
        return s.parse().ok();
    }
    parse_ipv4(s).map(IpAddr::V4)
}

fn parse_ipv4(s: &str) -> Option<Ipv4Addr> {
    let mut octets = [0u8; 4];
    let mut parts = s.split('.');
    for octet in &mut octets {
        let part = parts.next()?;
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        // Go's dtoi stops at 0xFFFFFF; the zeros in front do not count toward it.
        let digits = part.trim_start_matches('0');
        if digits.len() > 3 {
            return None;
        }
        *octet = if digits.is_empty() {
            0
        } else {
            digits.parse().ok()?
        };
    }
    parts.next().is_none().then(|| Ipv4Addr::from(octets))
}

/// `address/prefix` as ParseCIDRSloppy reads it: the address by [`parse_ip`], the prefix
/// length in decimal (leading zeros allowed, as Go's ParseCIDR does).
pub fn parse_cidr_parts(s: &str) -> Result<(IpAddr, u8), &'static str> {
    let (addr, prefix) = s.split_once('/').ok_or("missing /prefix")?;
    let addr = parse_ip(addr).ok_or("bad address")?;
    // u8::from_str accepts a leading '+', which no CIDR parser does.
    if prefix.is_empty() || !prefix.bytes().all(|b| b.is_ascii_digit()) {
        return Err("bad prefix length");
    }
    let digits = prefix.trim_start_matches('0');
    let prefix: u8 = match digits {
        "" => 0,
        d => d.parse().map_err(|_| "bad prefix length")?,
    };
    Ok((addr, prefix))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_zeros_are_decimal() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(parse_ip("198.19.0.041"), Some(ip("198.19.0.41")));
        assert_eq!(parse_ip("198.019.000.1"), Some(ip("198.19.0.1")));
        assert_eq!(parse_ip("0198.18.0.0001"), Some(ip("198.18.0.1")));
        assert_eq!(parse_ip("198.18.0.1"), Some(ip("198.18.0.1")));
        assert_eq!(parse_ip("2001:db8::41"), Some(ip("2001:db8::41")));
        for bad in [
            "198.18.0.256",
            "198.18.0",
            "198.18.0.1.2",
            "198.18..1",
            "198.18.0.+1",
            "198.18.0.1 ",
            "0x10.0.0.1",
            "198.18.0.1000",
            "",
            "2001:db8::g",
        ] {
            assert_eq!(parse_ip(bad), None, "{bad:?}");
        }
        assert_eq!(
            parse_cidr_parts("198.19.240.000/025"),
            Ok((ip("198.19.240.0"), 25))
        );
        assert!(parse_cidr_parts("198.19.240.0/+25").is_err());
        assert!(parse_cidr_parts("198.19.240.0/256").is_err());
    }
}
