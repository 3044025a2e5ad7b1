//! One service port's rules: kube-proxy's syncProxyRules loop body.

use std::net::{IpAddr, SocketAddr};

use super::{
    Family, KUBE_EXTERNAL_SERVICES, KUBE_MARK_MASQ, KUBE_NODEPORTS, KUBE_PROXY_FIREWALL,
    KUBE_SERVICES, Rule, Ruleset, cidr, cidr_contains, probability,
};
use crate::{
    dataplane::{
        frontends::PortEndpoints,
        iptables::names::{self, PortChains},
    },
    model::{Service, endpoint::PortEndpoint},
};

/// What one family's rendering of a service port needs besides the port.
pub(super) struct Target<'a> {
    pub cluster_ip: IpAddr,
    pub family: Family,
    /// The matches for pods' traffic and for the rest ([`super::LocalTraffic::matches`]).
    pub local: Option<(String, String)>,
    /// kube-proxy's large-cluster mode: the endpoint rules go without comments.
    pub large_cluster: bool,
    pub masquerade_all: bool,
    /// The node's addresses of the family.
    pub node_ips: &'a [IpAddr],
}

pub(super) fn render_port(
    rs: &mut Ruleset,
    nodeport_rules: &mut Vec<String>,
    svc: &Service,
    pe: &PortEndpoints<'_>,
    t: &Target<'_>,
) {
    let (cluster_ip, family) = (t.cluster_ip, t.family);
    let port = pe.port;
    let c = &pe.categorized;
    let spn = names::service_port_name(svc, port);
    let proto = names::proto_lower(port.protocol);
    let chains = PortChains::new(&spn, port.protocol);
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

    let cluster_eps = &c.cluster;
    let local_eps = &c.local;
    // Usable endpoints anywhere (kube-proxy's CategorizeEndpoints' hasAnyEndpoints): decides
    // between REJECT (none at all) and DROP (none here, a Local policy).
    let has_endpoints = c.has_any_endpoints;
    let uses_cluster_endpoints = !svc.internal_policy_local || externally_accessible(svc);
    let uses_local_endpoints =
        svc.internal_policy_local || (svc.external_policy_local && externally_accessible(svc));

    let cluster_policy_chain = chains.svc.as_str();
    let local_policy_chain = chains.svl.as_str();
    let (internal_chain, has_internal) = if svc.internal_policy_local {
        (local_policy_chain, has_endpoints && !local_eps.is_empty())
    } else {
        (cluster_policy_chain, has_endpoints)
    };
    let (external_policy_chain, has_external) = if svc.external_policy_local {
        (local_policy_chain, has_endpoints && !local_eps.is_empty())
    } else {
        (cluster_policy_chain, has_endpoints)
    };
    let external_chain = chains.ext.as_str();
    let uses_cluster_chain = !cluster_eps.is_empty() && uses_cluster_endpoints;
    let uses_local_chain = !local_eps.is_empty() && uses_local_endpoints;
    let uses_external_chain = has_endpoints && externally_accessible(svc);
    // Only with endpoints: without, nothing jumps to the external chain, and the load
    // balancer IPs are rejected in the filter table instead (kube-proxy's usesFWChain).
    let uses_fw_chain = has_endpoints && !lb_ips.is_empty() && !source_ranges.is_empty();
    let lb_chain = if uses_fw_chain {
        chains.fw.as_str()
    } else {
        external_chain
    };

    // What the filter table does with traffic the nat table did not translate.
    let (internal_filter, external_filter) = if !has_endpoints {
        let why = format!("{spn} has no endpoints");
        (Some(("REJECT", why.clone())), Some(("REJECT", why)))
    } else {
        let why = format!("{spn} has no local endpoints");
        (
            (!has_internal).then(|| ("DROP", why.clone())),
            (!has_external).then_some(("DROP", why)),
        )
    };

    // The cluster IP.
    let cluster_comment = format!("{spn} cluster IP");
    if has_internal {
        rs.nat_rules.push(
            Rule::new(KUBE_SERVICES)
                .comment(&cluster_comment)
                .proto_port(proto, Some(cluster_ip), port.port)
                .jump(internal_chain),
        );
    } else if let Some((target, why)) = &internal_filter {
        rs.filter_rules.push(
            Rule::new(KUBE_SERVICES)
                .comment(why)
                .proto_port(proto, Some(cluster_ip), port.port)
                .jump(target),
        );
    }

    // External IPs.
    for &ip in &external_ips {
        if has_endpoints {
            rs.nat_rules.push(
                Rule::new(KUBE_SERVICES)
                    .comment(&format!("{spn} external IP"))
                    .proto_port(proto, Some(ip), port.port)
                    .jump(external_chain),
            );
        }
        if let Some((target, why)) = &external_filter {
            rs.filter_rules.push(
                Rule::new(KUBE_EXTERNAL_SERVICES)
                    .comment(why)
                    .proto_port(proto, Some(ip), port.port)
                    .jump(target),
            );
        }
    }

    // Load balancer IPs.
    for &ip in &lb_ips {
        if has_endpoints {
            rs.nat_rules.push(
                Rule::new(KUBE_SERVICES)
                    .comment(&format!("{spn} loadbalancer IP"))
                    .proto_port(proto, Some(ip), port.port)
                    .jump(lb_chain),
            );
        }
        if uses_fw_chain {
            rs.filter_rules.push(
                Rule::new(KUBE_PROXY_FIREWALL)
                    .comment(&format!("{spn} traffic not accepted by {}", chains.fw))
                    .proto_port(proto, Some(ip), port.port)
                    .jump("DROP"),
            );
        }
    }
    if let Some((target, why)) = &external_filter {
        for &ip in &lb_ips {
            rs.filter_rules.push(
                Rule::new(KUBE_EXTERNAL_SERVICES)
                    .comment(why)
                    .proto_port(proto, Some(ip), port.port)
                    .jump(target),
            );
        }
    }

    // Node ports. Like kube-proxy, not subject to loadBalancerSourceRanges.
    if let Some(node_port) = port.node_port {
        if has_endpoints {
            nodeport_rules.push(
                Rule::new(KUBE_NODEPORTS)
                    .comment(&spn)
                    .proto_port(proto, None, node_port)
                    .jump(external_chain),
            );
        }
        if let Some((target, why)) = &external_filter {
            rs.filter_rules.push(
                Rule::new(KUBE_EXTERNAL_SERVICES)
                    .comment(why)
                    .arg("-m addrtype --dst-type LOCAL")
                    .proto_port(proto, None, node_port)
                    .jump(target),
            );
        }
    }

    // The health check node port is served by the proxy; let it in whatever the endpoints.
    if let Some(hc) = svc.health_check_node_port {
        rs.filter_rules.push(
            Rule::new(KUBE_NODEPORTS)
                .comment(&format!("{spn} health check node port"))
                .proto_port("tcp", None, hc)
                .jump("ACCEPT"),
        );
    }

    // Masquerade cluster IP traffic that may leave the node with a source the endpoint
    // cannot answer.
    if has_internal {
        let base = || {
            Rule::new(internal_chain)
                .comment(&cluster_comment)
                .proto_port(proto, Some(cluster_ip), port.port)
        };
        if t.masquerade_all {
            rs.nat_rules.push(base().jump(KUBE_MARK_MASQ));
        } else if let Some((_, not_local)) = &t.local {
            rs.nat_rules
                .push(base().arg(not_local).jump(KUBE_MARK_MASQ));
        }
    }

    if uses_external_chain {
        rs.nat_chains.push(external_chain.to_string());
        if !svc.external_policy_local {
            // Endpoints may be on another node: masquerade so replies come back through us.
            rs.nat_rules.push(
                Rule::new(external_chain)
                    .comment(&format!(
                        "masquerade traffic for {spn} external destinations"
                    ))
                    .jump(KUBE_MARK_MASQ),
            );
        } else {
            // Local policy keeps the client's source address, with exceptions.
            if let Some((local, _)) = &t.local {
                // Pods reaching an external address behave as if they went out and back in
                // through a load balancer: neither policy applies.
                rs.nat_rules.push(
                    Rule::new(external_chain)
                        .comment(&format!("pod traffic for {spn} external destinations"))
                        .arg(local)
                        .jump(cluster_policy_chain),
                );
            }
            // The node itself: its source address is local, so masquerade, and use every
            // endpoint.
            rs.nat_rules.push(
                Rule::new(external_chain)
                    .comment(&format!(
                        "masquerade LOCAL traffic for {spn} external destinations"
                    ))
                    .arg("-m addrtype --src-type LOCAL")
                    .jump(KUBE_MARK_MASQ),
            );
            rs.nat_rules.push(
                Rule::new(external_chain)
                    .comment(&format!(
                        "route LOCAL traffic for {spn} external destinations"
                    ))
                    .arg("-m addrtype --src-type LOCAL")
                    .jump(cluster_policy_chain),
            );
        }
        if has_external {
            rs.nat_rules
                .push(Rule::new(external_chain).jump(external_policy_chain));
        }
    }

    if uses_fw_chain {
        let fw = chains.fw.as_str();
        rs.nat_chains.push(fw.to_string());
        let comment = format!("{spn} loadbalancer IP");
        for &(ip, len) in &source_ranges {
            rs.nat_rules.push(
                Rule::new(fw)
                    .comment(&comment)
                    .arg(format!("-s {}", cidr(ip, len)))
                    .jump(external_chain),
            );
        }
        // A node that is inside the ranges may reach the LB IP from itself; where the LB IP
        // is a local address, such a connection's source is the LB IP (kube-proxy's
        // allowFromNode).
        let node_allowed = t
            .node_ips
            .iter()
            .any(|&ip| !ip.is_loopback() && source_ranges.iter().any(|&r| cidr_contains(r, ip)));
        if node_allowed {
            for &ip in &lb_ips {
                rs.nat_rules.push(
                    Rule::new(fw)
                        .comment(&comment)
                        .arg(format!("-s {ip}"))
                        .jump(external_chain),
                );
            }
        }
        // What is left was not DNATed, so KUBE-PROXY-FIREWALL (filter) drops it.
        rs.nat_rules.push(
            Rule::new(fw)
                .comment(&format!(
                    "other traffic to {spn} will be dropped by KUBE-PROXY-FIREWALL"
                ))
                .0,
        );
    }

    if uses_cluster_chain {
        rs.nat_chains.push(cluster_policy_chain.to_string());
        write_balancing(
            rs,
            svc,
            (&spn, t.large_cluster),
            port.protocol,
            cluster_policy_chain,
            cluster_eps,
        );
    }
    if uses_local_chain {
        rs.nat_chains.push(local_policy_chain.to_string());
        write_balancing(
            rs,
            svc,
            (&spn, t.large_cluster),
            port.protocol,
            local_policy_chain,
            local_eps,
        );
    }

    // One chain per endpoint either policy may use.
    for ep in &c.all_reachable {
        let addr = SocketAddr::new(ep.ip, ep.port);
        let sep = names::endpoint_chain(&spn, port.protocol, addr);
        rs.nat_chains.push(sep.clone());
        // A pod reaching itself through the service: masquerade, or it would answer itself
        // directly and the client would drop the reply.
        rs.nat_rules.push(
            Rule::new(&sep)
                .endpoint_comment(t.large_cluster, &spn)
                .arg(format!("-s {}", ep.ip))
                .jump(KUBE_MARK_MASQ),
        );
        let mut dnat = Rule::new(&sep).endpoint_comment(t.large_cluster, &spn);
        if svc.affinity_timeout.is_some() {
            dnat = dnat.arg(format!("-m recent --name {sep} --set"));
        }
        rs.nat_rules.push(
            dnat.arg(format!("-m {proto} -p {proto}"))
                .jump(&format!("DNAT --to-destination {addr}")),
        );
    }
}

/// kube-proxy's `ExternallyAccessible`.
fn externally_accessible(svc: &Service) -> bool {
    svc.ports.iter().any(|p| p.node_port.is_some())
        || !svc.load_balancer_ips.is_empty()
        || !svc.external_ips.is_empty()
}

/// Affinity first (a client seen recently goes back to its endpoint), then the random
/// spread: rule i of n matches with probability 1/(n-i), so each endpoint gets 1/n overall
/// and the last rule always matches. `(spn, large_cluster)`: the service port's name, and
/// whether its `spn -> endpoint` comments are left out.
fn write_balancing(
    rs: &mut Ruleset,
    svc: &Service,
    (spn, large_cluster): (&str, bool),
    proto: crate::model::Protocol,
    chain: &str,
    eps: &[PortEndpoint],
) {
    let seps: Vec<(SocketAddr, String)> = eps
        .iter()
        .map(|e| {
            let addr = SocketAddr::new(e.ip, e.port);
            (addr, names::endpoint_chain(spn, proto, addr))
        })
        .collect();
    if let Some(timeout) = svc.affinity_timeout {
        for (addr, sep) in &seps {
            rs.nat_rules.push(
                Rule::new(chain)
                    .endpoint_comment(large_cluster, &format!("{spn} -> {addr}"))
                    .arg(format!(
                        "-m recent --name {sep} --rcheck --seconds {timeout} --reap"
                    ))
                    .jump(sep),
            );
        }
    }
    let n = seps.len();
    for (i, (addr, sep)) in seps.iter().enumerate() {
        let mut r = Rule::new(chain).endpoint_comment(large_cluster, &format!("{spn} -> {addr}"));
        if i + 1 < n {
            r = r.arg(format!(
                "-m statistic --mode random --probability {}",
                probability(n - i)
            ));
        }
        rs.nat_rules.push(r.jump(sep));
    }
}
