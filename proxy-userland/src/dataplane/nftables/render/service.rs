//! One service's objects: kube-proxy's syncProxyRules loop body (nftables mode), per port.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
};

use super::{
    Container, MARK_MASQ, REJECT_CHAIN, Target,
    endpoints::{SLOT_KEYS, Spread},
    names::{PortNames, endpoint_names},
};
use crate::{
    dataplane::{
        frontends::PortEndpoints,
        iptables::{
            Family,
            names::{proto_lower, service_port_name},
            render::cidr_contains,
        },
    },
    model::{Service, endpoint::PortEndpoint},
};

/// What one service adds to the table: its chains with their rules, its affinity sets, and
/// its elements of the shared sets and maps. Kept per service so that a partial sync can
/// compare a changed service's objects with what it wrote before.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceObjects {
    /// Each chain (named as kube-proxy does) with its rules, in order.
    pub chains: BTreeMap<String, Vec<String>>,
    /// Affinity sets and their timeout in seconds.
    pub affinity_sets: BTreeMap<String, u32>,
    /// Elements by (container, key): the verdict (empty for a set) and a comment.
    pub elements: BTreeMap<(Container, String), (String, Option<String>)>,
    /// Its endpoints' addresses, sorted, once each: their `hairpin-endpoints` pairs, which
    /// services share and [`super::Rendered`] counts. Kept as addresses, not as element
    /// text: at 50,000 services of 10 endpoints that text was most of the mode's memory.
    pub hairpin: Vec<IpAddr>,
    /// Chains that end in a DNAT through an endpoint map, with their endpoints in key
    /// order (the map's slot is the table's choice: [`super::Rendered`] holds them).
    pub spreads: BTreeMap<String, Spread>,
}

impl ServiceObjects {
    fn chain(&mut self, name: &str) -> &mut Vec<String> {
        self.chains.entry(name.to_string()).or_default()
    }

    fn element(&mut self, c: Container, key: String, verdict: String, comment: Option<&str>) {
        self.elements
            .entry((c, key))
            .or_insert((verdict, comment.map(str::to_string)));
    }
}

fn externally_accessible(svc: &Service) -> bool {
    svc.ports.iter().any(|p| p.node_port.is_some())
        || !svc.load_balancer_ips.is_empty()
        || !svc.external_ips.is_empty()
}

pub(super) fn render_port(
    out: &mut ServiceObjects,
    svc: &Service,
    pe: &PortEndpoints<'_>,
    t: &Target<'_>,
) {
    let family = t.family;
    let ip_x = if family.is_v4() { "ip" } else { "ip6" };
    let port = pe.port;
    let c = &pe.categorized;
    let spn = service_port_name(svc, port);
    let proto = proto_lower(port.protocol);
    let names = PortNames::new(svc, port);
    let same_family = |ips: &[IpAddr]| -> Vec<IpAddr> {
        ips.iter()
            .copied()
            .filter(|ip| Family::of(ip) == family)
            .collect()
    };
    let external_ips = same_family(&svc.external_ips);
    let lb_ips = same_family(&svc.load_balancer_ips);
    let source_ranges: Vec<(IpAddr, u8)> = svc
        .load_balancer_source_ranges
        .iter()
        .copied()
        .filter(|(ip, _)| Family::of(ip) == family)
        .collect();

    let has_endpoints = c.has_any_endpoints;
    let accessible = externally_accessible(svc);
    let uses_cluster_endpoints = !svc.internal_policy_local || accessible;
    let uses_local_endpoints =
        svc.internal_policy_local || (svc.external_policy_local && accessible);
    let uses_cluster_chain = !c.cluster.is_empty() && uses_cluster_endpoints;
    let uses_local_chain = !c.local.is_empty() && uses_local_endpoints;

    let (internal_chain, has_internal) = if svc.internal_policy_local {
        (&names.local, has_endpoints && !c.local.is_empty())
    } else {
        (&names.cluster, has_endpoints)
    };
    let (external_policy_chain, has_external) = if svc.external_policy_local {
        (&names.local, has_endpoints && !c.local.is_empty())
    } else {
        (&names.cluster, has_endpoints)
    };
    let uses_external_chain = has_endpoints && accessible;

    let reject = format!("goto {REJECT_CHAIN}");
    let (internal_verdict, external_verdict) = if !has_endpoints {
        (reject.clone(), reject)
    } else {
        ("drop".to_string(), "drop".to_string())
    };
    let key = |ip: IpAddr| format!("{ip} . {proto} . {}", port.port);
    let comment = Some(spn.as_str());

    // The cluster IP.
    out.element(
        Container::ClusterIps,
        t.cluster_ip.to_string(),
        String::new(),
        None,
    );
    if has_internal {
        out.element(
            Container::ServiceIps,
            key(t.cluster_ip),
            format!("goto {internal_chain}"),
            None,
        );
    } else {
        out.element(
            Container::NoEndpointServices,
            key(t.cluster_ip),
            internal_verdict,
            comment,
        );
    }

    // External IPs, then load balancer IPs: into the external chain; rejected or dropped
    // when no endpoint may take external traffic.
    let uses_fw_chain = !lb_ips.is_empty() && !source_ranges.is_empty();
    for &ip in &external_ips {
        if has_endpoints {
            let v = format!("goto {}", names.external);
            out.element(Container::ServiceIps, key(ip), v, None);
        }
        if !has_external {
            let v = external_verdict.clone();
            out.element(Container::NoEndpointServices, key(ip), v, comment);
        }
    }
    for &ip in &lb_ips {
        if has_endpoints {
            let v = format!("goto {}", names.external);
            out.element(Container::ServiceIps, key(ip), v, None);
        }
        if uses_fw_chain {
            let v = format!("goto {}", names.firewall);
            out.element(Container::FirewallIps, key(ip), v, None);
        }
        if !has_external {
            let v = external_verdict.clone();
            out.element(Container::NoEndpointServices, key(ip), v, comment);
        }
    }

    // The node port. Like kube-proxy, not subject to loadBalancerSourceRanges.
    if let Some(node_port) = port.node_port {
        let np_key = format!("{proto} . {node_port}");
        if has_endpoints {
            let v = format!("goto {}", names.external);
            out.element(Container::ServiceNodeports, np_key.clone(), v, None);
        }
        if !has_external {
            let v = external_verdict.clone();
            out.element(Container::NoEndpointNodeports, np_key, v, comment);
        }
    }

    // Masquerade cluster IP traffic from outside the cluster: its replies must come back
    // through this node.
    if has_internal {
        let dst = format!("{ip_x} daddr {}", t.cluster_ip);
        if t.masquerade_all {
            out.chain(internal_chain)
                .push(format!("{dst} jump {MARK_MASQ}"));
        } else if let Some((_, not_local)) = &t.local {
            out.chain(internal_chain)
                .push(format!("{dst} {not_local} jump {MARK_MASQ}"));
        }
    }

    if uses_external_chain {
        let ext = out.chain(&names.external);
        if !svc.external_policy_local {
            ext.push(format!("jump {MARK_MASQ}"));
        } else {
            if let Some((local, _)) = &t.local {
                ext.push(format!(
                    "{local} goto {} comment \"short-circuit pod traffic\"",
                    names.cluster
                ));
            }
            ext.push(format!(
                "fib saddr type local jump {MARK_MASQ} comment \"masquerade local traffic\""
            ));
            ext.push(format!(
                "fib saddr type local goto {} comment \"short-circuit local traffic\"",
                names.cluster
            ));
        }
        if has_external {
            ext.push(format!("goto {external_policy_chain}"));
        }
    }

    if uses_fw_chain {
        let mut sources: Vec<String> = source_ranges
            .iter()
            .map(|&(ip, len)| format!("{ip}/{len}"))
            .collect();
        // A node inside the ranges may reach the LB IP from itself; where the LB IP is a
        // local address, such a connection's source is the LB IP (kube-proxy's
        // allowFromNode).
        let node_allowed = t
            .node_ips
            .iter()
            .any(|&ip| !ip.is_loopback() && source_ranges.iter().any(|&r| cidr_contains(r, ip)));
        if node_allowed {
            sources.extend(lb_ips.iter().map(IpAddr::to_string));
        }
        out.chain(&names.firewall).push(format!(
            "{ip_x} saddr != {{ {} }} drop",
            sources.join(" , ")
        ));
    }

    let affinity = svc.affinity_timeout;
    if let Some(timeout) = affinity {
        for ep in &c.all_reachable {
            let (_, set) = endpoint_names(svc, port, SocketAddr::new(ep.ip, ep.port));
            out.affinity_sets.insert(set, timeout);
        }
    }
    if uses_cluster_chain {
        balance(out, svc, pe, &names.cluster, &c.cluster, ip_x);
    }
    if uses_local_chain {
        balance(out, svc, pe, &names.local, &c.local, ip_x);
    }

    for ep in &c.all_reachable {
        // A pod reaching itself through the service must be masqueraded, or it would
        // answer itself directly and drop the reply: nat-postrouting matches the pair.
        out.hairpin.push(ep.ip);
        // Without affinity an endpoint needs no chain: its DNAT sits in the spread.
        let Some(_) = affinity else { continue };
        let addr = SocketAddr::new(ep.ip, ep.port);
        let (chain, set) = endpoint_names(svc, port, addr);
        let rules = out.chain(&chain);
        rules.push(format!("update @{set} {{ {ip_x} saddr }}"));
        rules.push(dnat(proto, addr));
    }
}

fn dnat(proto: &str, to: SocketAddr) -> String {
    format!("meta l4proto {proto} dnat to {to}")
}

/// Affinity first (a client seen recently goes back to its endpoint), then an even spread.
/// Without affinity, one DNAT through an endpoint map (`numgen random mod n`, see
/// [`super::endpoints`]). With affinity, a goto per endpoint: endpoint i of n is taken
/// with probability 1/(n-i) by the i-th rule, as the iptables mode's `statistic` rules
/// do, so each gets 1/n.
///
/// kube-proxy writes one `numgen random mod n vmap { ... }` to a chain per endpoint. We
/// differ twice (docs/modes.md):
/// - Each such map is an anonymous set, and binding one makes the kernel walk the whole
///   transaction (`__nft_set_trans_bind`, Linux 6.x): a first sync of 3,000 services took
///   over 30 s, and one of 10,000 over 120 s.
/// - Every `nft` run (nft 1.0.6) first dumps all chains, and the kernel's dump is quadratic
///   in their number: a one-service change at 10,000 services took 2.4 s with a chain per
///   endpoint, 0.07 s without. Only affinity, which needs a set per endpoint, keeps them.
fn balance(
    out: &mut ServiceObjects,
    svc: &Service,
    pe: &PortEndpoints<'_>,
    chain: &str,
    eps: &[PortEndpoint],
    ip_x: &str,
) {
    let proto = proto_lower(pe.port.protocol);
    let rules = out.chain(chain);
    if svc.affinity_timeout.is_none() {
        let endpoints: Vec<SocketAddr> =
            eps.iter().map(|e| SocketAddr::new(e.ip, e.port)).collect();
        if endpoints.len() as u64 > u64::from(SLOT_KEYS) {
            rules.extend(inline(proto, &endpoints));
        } else {
            out.spreads
                .insert(chain.to_string(), Spread { proto, endpoints });
        }
        return;
    }
    let chains: Vec<(String, String)> = eps
        .iter()
        .map(|e| endpoint_names(svc, pe.port, SocketAddr::new(e.ip, e.port)))
        .collect();
    for (ep_chain, set) in &chains {
        rules.push(format!("{ip_x} saddr @{set} goto {ep_chain}"));
    }
    let gotos: Vec<String> = chains.iter().map(|(c, _)| format!("goto {c}")).collect();
    rules.extend(spread(gotos.iter().map(String::as_str)));
}

/// The spread as one rule per endpoint: for a chain whose endpoints outgrow a slot, or
/// when every slot is taken.
pub(super) fn inline(proto: &str, endpoints: &[SocketAddr]) -> Vec<String> {
    let dnats: Vec<String> = endpoints.iter().map(|&e| dnat(proto, e)).collect();
    spread(dnats.iter().map(String::as_str))
}

/// The rules that apply one of `actions` (a DNAT or a goto), each as likely as the others:
/// nft's listing form of `numgen random mod k == 0 ACTION`, the last action unconditional.
pub fn spread<'a>(actions: impl ExactSizeIterator<Item = &'a str>) -> Vec<String> {
    let n = actions.len();
    actions
        .enumerate()
        .map(|(i, action)| match n - i {
            1 => action.to_string(),
            left => format!("numgen random mod {left} 0 {action}"),
        })
        .collect()
}
