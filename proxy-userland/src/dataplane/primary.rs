//! `--nodeport-addresses primary`: node ports on the node's primary address of each family
//! only, as kube-proxy (server.go detectNodeIPs, then a /32 or /128 per family).
//!
//! Decided once at start-up, like kube-proxy: a Node whose addresses change later keeps
//! the node ports where they were until the daemon restarts.

use std::net::IpAddr;

use tracing::{info, warn};

/// Start-up cannot tell which addresses `primary` means; main turns it into exit status 2,
/// as for a bad flag, because serving node ports on every address instead would silently
/// expose them where the operator asked not to.
#[derive(Debug, thiserror::Error)]
#[error(
    "--nodeport-addresses primary: cannot find this node's primary address ({0}); \
     pass --bind-address or --nodeport-addresses CIDRs"
)]
pub struct PrimaryError(pub String);

/// kube-proxy's utilnode.GetNodeHostIPs over a Node's status.addresses (type, address):
/// the first InternalIP (else ExternalIP), then the first of those of the other family.
/// Addresses that do not parse are skipped, as the API server lets anything through.
pub fn node_host_ips<'a>(addresses: impl IntoIterator<Item = (&'a str, &'a str)>) -> Vec<IpAddr> {
    let addresses: Vec<(&str, IpAddr)> = addresses
        .into_iter()
        .filter_map(|(kind, a)| Some((kind, a.trim().parse().ok()?)))
        .collect();
    let all: Vec<IpAddr> = ["InternalIP", "ExternalIP"]
        .iter()
        .flat_map(|kind| addresses.iter().filter(move |(k, _)| k == kind))
        .map(|(_, a)| *a)
        .collect();
    let Some(&first) = all.first() else {
        return Vec::new();
    };
    let mut out = vec![first];
    out.extend(all.iter().find(|a| a.is_ipv4() != first.is_ipv4()));
    out
}

/// The node's IP per family, as kube-proxy's detectNodeIPs: the Node's (the first is the
/// primary family), with `--bind-address` replacing its own family's when it is not
/// unspecified. Returns (IPv4, IPv6); None where kube-proxy would fall back to loopback.
pub fn detect_node_ips(
    raw_node_ips: &[IpAddr],
    bind_address: Option<IpAddr>,
) -> (Option<IpAddr>, Option<IpAddr>) {
    let mut v4 = raw_node_ips.iter().copied().find(IpAddr::is_ipv4);
    let mut v6 = raw_node_ips.iter().copied().find(IpAddr::is_ipv6);
    match bind_address {
        Some(b) if b.is_unspecified() => {}
        Some(b @ IpAddr::V4(_)) => v4 = Some(b),
        Some(b @ IpAddr::V6(_)) => v6 = Some(b),
        None => {}
    }
    (v4, v6)
}

/// The CIDRs `primary` stands for: each family's node IP as a /32 or /128, loopback left
/// out (kube-proxy's "can't determine this node's IP").
pub fn primary_cidrs(v4: Option<IpAddr>, v6: Option<IpAddr>) -> Vec<(IpAddr, u8)> {
    v4.into_iter()
        .chain(v6)
        .filter(|a| !a.is_loopback() && !a.is_unspecified())
        .map(|a| (a, if a.is_ipv4() { 32 } else { 128 }))
        .collect()
}

/// Where the node's IPs may come from, best first.
#[derive(Debug, Default)]
pub struct PrimarySources {
    pub bind_address: Option<IpAddr>,
    /// The Node's addresses, through [`node_host_ips`]; None: no Node (file source, or
    /// none in time).
    pub node_ips: Option<Vec<IpAddr>>,
}

/// Resolves `primary` into CIDRs, logging what was chosen and why. `default_route` (the
/// addresses of the default route's device) is read only when nothing better is known.
pub fn resolve(
    src: PrimarySources,
    default_route: impl FnOnce() -> Result<Vec<IpAddr>, String>,
) -> Result<Vec<(IpAddr, u8)>, PrimaryError> {
    let node_ips = src.node_ips.unwrap_or_default();
    let (v4, v6) = detect_node_ips(&node_ips, src.bind_address);
    let mut cidrs = primary_cidrs(v4, v6);
    if cidrs.is_empty() {
        let addrs = default_route().map_err(PrimaryError)?;
        let v4 = addrs.iter().copied().find(IpAddr::is_ipv4);
        let v6 = addrs.iter().copied().find(IpAddr::is_ipv6);
        cidrs = primary_cidrs(v4, v6);
        if cidrs.is_empty() {
            return Err(PrimaryError(
                "no usable --bind-address, no Node addresses, and the default route's \
                 device has no address"
                    .into(),
            ));
        }
        warn!(
            addresses = ?cidrs,
            "--nodeport-addresses primary: no --bind-address and no Node addresses; \
             using the default route device's addresses"
        );
    } else {
        info!(addresses = ?cidrs, bind_address = ?src.bind_address, node_ips = ?node_ips,
              "--nodeport-addresses primary resolved");
    }
    Ok(cidrs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|s| ip(s)).collect()
    }

    /// name, the Node's IPs, --bind-address, the IPv4 and IPv6 node IPs wanted.
    type DetectCase<'a> = (
        &'a str,
        &'a [&'a str],
        &'a str,
        Option<&'a str>,
        Option<&'a str>,
    );
    /// name, the Node's (type, address) list, the host IPs wanted.
    type HostIpsCase<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a [&'a str]);

    /// server_test.go Test_detectNodeIPs, with kube-proxy's loopback fallback as None.
    #[test]
    fn test_detect_node_ips() {
        let cases: &[DetectCase] = &[
            (
                "Bind address IPv4 unicast address and no Node object",
                &[],
                "198.18.0.1",
                Some("198.18.0.1"),
                None,
            ),
            (
                "Bind address IPv6 unicast address and no Node object",
                &[],
                "2001:db8::2",
                None,
                Some("2001:db8::2"),
            ),
            ("No Valid IP found and no bind address", &[], "", None, None),
            (
                "No Valid IP found and unspecified bind address",
                &[],
                "0.0.0.0",
                None,
                None,
            ),
            (
                "Bind address 0.0.0.0 and node with IPv4 InternalIP set",
                &["198.18.1.1"],
                "0.0.0.0",
                Some("198.18.1.1"),
                None,
            ),
            (
                "Bind address :: and node with IPv4 InternalIP set",
                &["198.18.1.1"],
                "::",
                Some("198.18.1.1"),
                None,
            ),
            (
                "Bind address 0.0.0.0 and node with IPv6 InternalIP set",
                &["2001:db8::1"],
                "0.0.0.0",
                None,
                Some("2001:db8::1"),
            ),
            (
                "Dual stack, primary IPv4",
                &["198.18.90.90", "2001:db8::2"],
                "::",
                Some("198.18.90.90"),
                Some("2001:db8::2"),
            ),
            (
                "Dual stack, primary IPv6",
                &["2001:db8::2", "198.18.90.90"],
                "0.0.0.0",
                Some("198.18.90.90"),
                Some("2001:db8::2"),
            ),
            (
                "Dual stack, override IPv4",
                &["2001:db8::2", "198.18.90.90"],
                "198.18.80.80",
                Some("198.18.80.80"),
                Some("2001:db8::2"),
            ),
            (
                "Dual stack, override IPv6",
                &["198.18.90.90", "2001:db8::2"],
                "2001:db8::555",
                Some("198.18.90.90"),
                Some("2001:db8::555"),
            ),
        ];
        for (name, raw, bind, want4, want6) in cases {
            let bind = (!bind.is_empty()).then(|| ip(bind));
            let got = detect_node_ips(&ips(raw), bind);
            assert_eq!(got, (want4.map(ip), want6.map(ip)), "{name}");
        }
    }

    /// server_test.go: an override to loopback is kept as the node IP, but `primary`
    /// then has nothing to serve on in that family ("Dual stack, override primary
    /// family, IPv4").
    #[test]
    fn loopback_bind_address_leaves_that_family_out() {
        let (v4, v6) = detect_node_ips(
            &ips(&["2001:db8::2", "198.18.90.90"]),
            Some(ip("127.0.0.1")),
        );
        assert_eq!(primary_cidrs(v4, v6), [(ip("2001:db8::2"), 128)]);
    }

    /// utilnode TestGetNodeHostIPs, the cases that apply to one Node's addresses.
    #[test]
    fn test_get_node_host_ips() {
        let cases: &[HostIpsCase] = &[
            ("no addresses", &[], &[]),
            ("NodeHostName only", &[("Hostname", "host.example")], &[]),
            (
                "IPv4-only, simple",
                &[
                    ("InternalIP", "198.18.1.1"),
                    ("ExternalIP", "198.19.1.1"),
                    ("ExternalIP", "198.19.1.2"),
                ],
                &["198.18.1.1"],
            ),
            (
                "IPv4-only, external-first",
                &[
                    ("ExternalIP", "198.19.1.1"),
                    ("ExternalIP", "198.19.1.2"),
                    ("InternalIP", "198.18.1.1"),
                ],
                &["198.18.1.1"],
            ),
            (
                "IPv4-only, no internal",
                &[("ExternalIP", "198.19.1.1"), ("ExternalIP", "198.19.1.2")],
                &["198.19.1.1"],
            ),
            (
                "dual-stack node",
                &[
                    ("InternalIP", "198.18.1.1"),
                    ("ExternalIP", "198.19.1.1"),
                    ("InternalIP", "2001:db8::1"),
                    ("ExternalIP", "2001:db8:1::1"),
                ],
                &["198.18.1.1", "2001:db8::1"],
            ),
            (
                "dual-stack node, different order",
                &[
                    ("InternalIP", "198.18.1.1"),
                    ("InternalIP", "2001:db8::1"),
                    ("ExternalIP", "198.19.1.1"),
                    ("ExternalIP", "2001:db8:1::1"),
                ],
                &["198.18.1.1", "2001:db8::1"],
            ),
            (
                "dual-stack node, IPv6-first, no internal IPv4",
                &[
                    ("InternalIP", "2001:db8::1"),
                    ("ExternalIP", "198.19.1.1"),
                    ("ExternalIP", "2001:db8:1::1"),
                ],
                &["2001:db8::1", "198.19.1.1"],
            ),
            (
                "garbage address skipped",
                &[("InternalIP", "not-an-ip"), ("InternalIP", "198.18.1.1")],
                &["198.18.1.1"],
            ),
        ];
        for (name, addrs, want) in cases {
            assert_eq!(node_host_ips(addrs.iter().copied()), ips(want), "{name}");
        }
    }

    #[test]
    fn resolve_prefers_bind_address_then_node_then_default_route() {
        let never = || -> Result<Vec<IpAddr>, String> { panic!("default route not needed") };
        let bind = PrimarySources {
            bind_address: Some(ip("198.18.0.5")),
            node_ips: Some(ips(&["198.18.0.6", "2001:db8::6"])),
        };
        assert_eq!(
            resolve(bind, never).unwrap(),
            [(ip("198.18.0.5"), 32), (ip("2001:db8::6"), 128)]
        );
        let node = PrimarySources {
            node_ips: Some(ips(&["198.18.0.6"])),
            ..Default::default()
        };
        assert_eq!(resolve(node, never).unwrap(), [(ip("198.18.0.6"), 32)]);
        let route = resolve(PrimarySources::default(), || {
            Ok(ips(&["198.18.0.7", "198.18.0.8", "2001:db8::7"]))
        });
        assert_eq!(
            route.unwrap(),
            [(ip("198.18.0.7"), 32), (ip("2001:db8::7"), 128)]
        );
    }

    #[test]
    fn resolve_fails_rather_than_serving_everywhere() {
        let e = resolve(PrimarySources::default(), || Ok(Vec::new())).unwrap_err();
        assert!(e.to_string().contains("--nodeport-addresses"), "{e}");
        let e = resolve(PrimarySources::default(), || Err("no default route".into())).unwrap_err();
        assert!(e.to_string().contains("no default route"), "{e}");
    }
}
