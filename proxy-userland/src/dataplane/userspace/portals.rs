//! The "portals" that steer service traffic into the relays, as kube-proxy's userspace
//! mode had them: nat KUBE-PORTALS-CONTAINER (from PREROUTING: traffic from pods and other
//! hosts) and KUBE-PORTALS-HOST (from OUTPUT: the node's own processes), each REDIRECTing a
//! frontend to its relay's port.
//!
//! kube-proxy DNATed host traffic to a host address instead, because REDIRECT in OUTPUT
//! sends it to 127.0.0.1 and UDP answers then came from the wrong address; our UDP relay
//! answers from the address each datagram was redirected to, so REDIRECT works for both.

use std::fmt::Write as _;

use crate::dataplane::{
    frontends::Frontend,
    iptables::{Table, apply::Jump, names::proto_lower},
};

pub const PORTALS_CONTAINER: &str = "KUBE-PORTALS-CONTAINER";
pub const PORTALS_HOST: &str = "KUBE-PORTALS-HOST";
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
];

/// True for the chains of the userspace mode (for leftovers cleanup).
pub fn is_userspace_chain(table: Table, chain: &str) -> bool {
    match table {
        Table::Nat => {
            chain == PORTALS_CONTAINER
                || chain == PORTALS_HOST
                || LEGACY_CHAINS[..2].contains(&chain)
        }
        Table::Filter => chain == LEGACY_CHAINS[2],
    }
}

/// One relay to steer to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Portal {
    /// For the rule comment, e.g. `demo/web`.
    pub service: String,
    pub frontend: Frontend,
    pub relay_port: u16,
}

/// `iptables-restore --noflush` input that replaces both portal chains with `portals`.
pub fn render(portals: &[Portal]) -> String {
    let mut out = String::from("*nat\n");
    let _ = writeln!(out, ":{PORTALS_CONTAINER} - [0:0]");
    let _ = writeln!(out, ":{PORTALS_HOST} - [0:0]");
    for chain in [PORTALS_CONTAINER, PORTALS_HOST] {
        for p in portals {
            let proto = proto_lower(p.frontend.proto);
            let _ = writeln!(
                out,
                "-A {chain} -m comment --comment \"{} {}\" -m {proto} -p {proto} -d {} --dport {} -j REDIRECT --to-ports {}",
                p.service.replace(['"', '\\'], ""),
                p.frontend,
                p.frontend.ip,
                p.frontend.port,
                p.relay_port
            );
        }
    }
    out.push_str("COMMIT\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    #[test]
    fn each_frontend_is_redirected_in_both_chains() {
        let fe = Frontend::socket("198.19.0.10".parse().unwrap(), 53, Protocol::Udp);
        let text = render(&[Portal {
            service: "demo/web".into(),
            frontend: fe,
            relay_port: 40001,
        }]);
        for chain in [PORTALS_CONTAINER, PORTALS_HOST] {
            assert!(text.contains(&format!(
                "-A {chain} -m comment --comment \"demo/web 198.19.0.10:53/UDP\" -m udp -p udp -d 198.19.0.10 --dport 53 -j REDIRECT --to-ports 40001\n"
            )), "{text}");
        }
        assert!(
            text.starts_with("*nat\n:KUBE-PORTALS-CONTAINER - [0:0]\n:KUBE-PORTALS-HOST - [0:0]\n")
        );
        assert!(text.ends_with("COMMIT\n"));
        // No portals still declares (and so empties) both chains.
        assert_eq!(render(&[]).lines().count(), 4);
    }
}
