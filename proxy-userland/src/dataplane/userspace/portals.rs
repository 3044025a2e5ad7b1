//! The "portals" that steer service traffic into the relays, as kube-proxy's userspace
//! mode had them: nat KUBE-PORTALS-CONTAINER (from PREROUTING: traffic from pods and other
//! hosts) and KUBE-PORTALS-HOST (from OUTPUT: the node's own processes), each REDIRECTing a
//! frontend to its relay's port.
//!
//! Traffic into the service ranges that no portal redirected is rejected in the same chain,
//! last (no Service holds the address, or not on that port).
//!
//! A frontend without endpoints gets no portal but a REJECT in the filter table chain
//! KUBE-PORTALS-FILTER (from INPUT, FORWARD and OUTPUT, as kube-proxy's filter
//! KUBE-SERVICES), so a connect is refused at once instead of being accepted by a relay
//! that has nowhere to send it. The same chain drops new traffic to a relay's port that no
//! portal redirected (`! --ctstate DNAT`): the relays listen on every address, because
//! REDIRECT picks the address (127.0.0.1 from OUTPUT, the receiving device's primary
//! address from PREROUTING), but must only be reachable through a cluster IP.
//!
//! kube-proxy DNATed host traffic to a host address instead, because REDIRECT in OUTPUT
//! sends it to 127.0.0.1 and UDP answers then came from the wrong address; our UDP relay
//! answers from the address each datagram was redirected to, so REDIRECT works for both.

use std::fmt::Write as _;

use crate::{
    dataplane::{
        frontends::Frontend,
        iptables::{Table, apply::Jump, names::proto_lower},
    },
    model::Cidr,
};

pub const PORTALS_CONTAINER: &str = "KUBE-PORTALS-CONTAINER";
pub const PORTALS_HOST: &str = "KUBE-PORTALS-HOST";
pub const PORTALS_FILTER: &str = "KUBE-PORTALS-FILTER";
/// Chains older userspace proxies also made; removed as leftovers, never created.
pub const LEGACY_CHAINS: [&str; 3] = [
    "KUBE-NODEPORT-CONTAINER",
    "KUBE-NODEPORT-HOST",
    "KUBE-NODEPORT-NON-LOCAL",
];

pub const JUMPS: &[Jump] = &[
    Jump {
        table: Table::Nat,
        from: "PREROUTING",
        to: PORTALS_CONTAINER,
        comment: "handle ClusterIPs; NOTE: this must be before the NodePort rules",
        extra: &[],
    },
    Jump {
        table: Table::Nat,
        from: "OUTPUT",
        to: PORTALS_HOST,
        comment: "handle ClusterIPs; NOTE: this must be before the NodePort rules",
        extra: &[],
    },
    Jump {
        table: Table::Filter,
        from: "INPUT",
        to: PORTALS_FILTER,
        comment: "userspace service portals firewall",
        extra: &["-m", "conntrack", "--ctstate", "NEW"],
    },
    Jump {
        table: Table::Filter,
        from: "FORWARD",
        to: PORTALS_FILTER,
        comment: "userspace service portals firewall",
        extra: &["-m", "conntrack", "--ctstate", "NEW"],
    },
    Jump {
        table: Table::Filter,
        from: "OUTPUT",
        to: PORTALS_FILTER,
        comment: "userspace service portals firewall",
        extra: &["-m", "conntrack", "--ctstate", "NEW"],
    },
];

/// True for the chains of the userspace mode (for leftovers cleanup).
pub fn is_userspace_chain(table: Table, chain: &str) -> bool {
    match table {
        Table::Nat => {
            chain == PORTALS_CONTAINER
                || chain == PORTALS_HOST
                || LEGACY_CHAINS[..2].contains(&chain)
        }
        Table::Filter => chain == PORTALS_FILTER || chain == LEGACY_CHAINS[2],
    }
}

/// One relay to steer to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Portal {
    /// For the rule comment, e.g. `demo/web`.
    pub service: String,
    pub frontend: Frontend,
    pub relay_port: u16,
    /// False: refuse the frontend's traffic (REJECT) instead of redirecting it.
    pub has_endpoints: bool,
}

/// `iptables-restore --noflush` input that replaces the portal chains with `portals`, and
/// rejects (last) new traffic into the IPv4 `service_ranges` that no portal redirected.
pub fn render(portals: &[Portal], service_ranges: &[Cidr]) -> String {
    let mut out = String::from("*nat\n");
    let _ = writeln!(out, ":{PORTALS_CONTAINER} - [0:0]");
    let _ = writeln!(out, ":{PORTALS_HOST} - [0:0]");
    for chain in [PORTALS_CONTAINER, PORTALS_HOST] {
        for p in portals.iter().filter(|p| p.has_endpoints) {
            let proto = proto_lower(p.frontend.proto);
            let _ = writeln!(
                out,
                "-A {chain} -m comment --comment \"{} {}\" -m {proto} -p {proto} -d {} --dport {} -j REDIRECT --to-ports {}",
                comment(&p.service),
                p.frontend,
                p.frontend.ip,
                p.frontend.port,
                p.relay_port
            );
        }
    }
    out.push_str("COMMIT\n*filter\n");
    let _ = writeln!(out, ":{PORTALS_FILTER} - [0:0]");
    for p in portals.iter().filter(|p| !p.has_endpoints) {
        let proto = proto_lower(p.frontend.proto);
        let _ = writeln!(
            out,
            "-A {PORTALS_FILTER} -m comment --comment \"{} {} has no endpoints\" -m {proto} -p {proto} -d {} --dport {} -j REJECT",
            comment(&p.service),
            p.frontend,
            p.frontend.ip,
            p.frontend.port,
        );
    }
    for p in portals {
        let proto = proto_lower(p.frontend.proto);
        let _ = writeln!(
            out,
            "-A {PORTALS_FILTER} -m comment --comment \"{} {} relay, only through its portal\" -m addrtype --dst-type LOCAL -m {proto} -p {proto} --dport {} -m conntrack ! --ctstate DNAT -j DROP",
            comment(&p.service),
            p.frontend,
            p.relay_port,
        );
    }
    // Redirected traffic is addressed to this node by now: what is still addressed into a
    // range has no service at that address and port.
    for r in service_ranges.iter().filter(|r| r.addr.is_ipv4()) {
        let _ = writeln!(
            out,
            "-A {PORTALS_FILTER} -m comment --comment \"no service at this address and port in the service range\" -d {r} -j REJECT",
        );
    }
    out.push_str("COMMIT\n");
    out
}

fn comment(service: &str) -> String {
    service.replace(['"', '\\'], "")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    #[test]
    fn each_frontend_is_redirected_in_both_chains() {
        let fe = Frontend::socket("198.19.0.10".parse().unwrap(), 53, Protocol::Udp);
        let text = render(
            &[Portal {
                service: "demo/web".into(),
                frontend: fe,
                relay_port: 40001,
                has_endpoints: true,
            }],
            &[],
        );
        for chain in [PORTALS_CONTAINER, PORTALS_HOST] {
            assert!(text.contains(&format!(
                "-A {chain} -m comment --comment \"demo/web 198.19.0.10:53/UDP\" -m udp -p udp -d 198.19.0.10 --dport 53 -j REDIRECT --to-ports 40001\n"
            )), "{text}");
        }
        assert!(
            text.starts_with("*nat\n:KUBE-PORTALS-CONTAINER - [0:0]\n:KUBE-PORTALS-HOST - [0:0]\n")
        );
        // The relay's port is closed to traffic no portal redirected.
        assert!(text.contains(
            "-A KUBE-PORTALS-FILTER -m comment --comment \"demo/web 198.19.0.10:53/UDP relay, only through its portal\" -m addrtype --dst-type LOCAL -m udp -p udp --dport 40001 -m conntrack ! --ctstate DNAT -j DROP\n"
        ), "{text}");
        assert!(!text.contains("REJECT"), "{text}");
        assert!(text.ends_with("COMMIT\n"));
        // No portals still declares (and so empties) every chain.
        assert_eq!(render(&[], &[]).lines().count(), 7);
    }

    #[test]
    fn a_frontend_without_endpoints_is_rejected_not_redirected() {
        let fe = Frontend::socket("198.19.0.11".parse().unwrap(), 80, Protocol::Tcp);
        let text = render(
            &[Portal {
                service: "demo/empty".into(),
                frontend: fe,
                relay_port: 40002,
                has_endpoints: false,
            }],
            &[],
        );
        assert!(!text.contains("REDIRECT"), "{text}");
        assert!(text.contains(
            "-A KUBE-PORTALS-FILTER -m comment --comment \"demo/empty 198.19.0.11:80/TCP has no endpoints\" -m tcp -p tcp -d 198.19.0.11 --dport 80 -j REJECT\n"
        ), "{text}");
    }

    #[test]
    fn the_service_ranges_are_rejected_last_ipv4_only() {
        let fe = Frontend::socket("198.19.0.10".parse().unwrap(), 80, Protocol::Tcp);
        let ranges = [
            "198.19.0.0/16".parse().unwrap(),
            "2001:db8::/112".parse().unwrap(),
        ];
        let text = render(
            &[Portal {
                service: "demo/web".into(),
                frontend: fe,
                relay_port: 40001,
                has_endpoints: true,
            }],
            &ranges,
        );
        let filter: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("-A KUBE-PORTALS-FILTER"))
            .collect();
        assert_eq!(
            filter.last(),
            Some(
                &"-A KUBE-PORTALS-FILTER -m comment --comment \"no service at this address and port in the service range\" -d 198.19.0.0/16 -j REJECT"
            ),
            "{text}"
        );
        assert!(
            !text.contains("2001:db8"),
            "the relays are IPv4 only: {text}"
        );
    }
}
