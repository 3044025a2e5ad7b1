//! `fastpath explain <proto> <ip:port> [--from <ip>]`: what the proxy on this node does with
//! one connection. The answer comes from the code the dataplanes program from: the
//! frontends of [`crate::dataplane::frontends`] say which backends are eligible, and
//! [`crate::model::select`]'s rules say why the others are not.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
};

use serde::Serialize;

use super::{maps::ProgrammedFrontend, view};
use crate::{
    admin::debug::ModelDump,
    dataplane::{
        frontends::{BackendAddr, Frontend, FrontendScope},
        iptables::names::service_port_name,
    },
    model::{Protocol, Service, ServicePort, endpoint::PortEndpoint, select},
};

#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
pub struct Matched {
    /// `namespace/name:port`.
    pub service: String,
    /// ClusterIP, ExternalIP, LoadBalancer or NodePort.
    pub kind: &'static str,
    /// The frontend as the dataplane keys it.
    pub frontend: String,
    /// The traffic policy that picks the backends, e.g. `internalTrafficPolicy=Cluster`.
    pub policy: String,
}

#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub address: String,
    pub state: &'static str,
    pub node: Option<String>,
    pub zone: Option<String>,
    pub eligible: bool,
    pub reason: String,
}

#[derive(Serialize, Clone, Debug)]
pub struct Explanation {
    pub protocol: String,
    pub destination: String,
    pub from: Option<String>,
    /// this node, a pod on this node, or another host.
    pub client: &'static str,
    pub mode: String,
    pub matched: Option<Matched>,
    /// The hook or chain that translates it.
    pub hook: Option<String>,
    /// Every endpoint of the service port, eligible or not, and why.
    pub candidates: Vec<Candidate>,
    /// `ip:port` of the backends a connection may reach.
    pub eligible: Vec<String>,
    /// The backends the maps (eBPF) or the rules (iptables) hold for the frontend, to compare.
    pub programmed: Option<Vec<String>>,
    pub affinity_timeout: Option<u32>,
    /// translated, refused, rejected, dropped, not-a-service or not-translated-here.
    pub verdict: &'static str,
    pub detail: String,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Client {
    ThisNode,
    LocalPod,
    Remote,
}

impl Client {
    fn word(self) -> &'static str {
        match self {
            Client::ThisNode => "this node",
            Client::LocalPod => "a pod on this node",
            Client::Remote => "another host",
        }
    }
}

fn addr(b: &BackendAddr) -> String {
    SocketAddr::new(b.ip, b.port).to_string()
}

/// The service port `dst` names, and how: cluster, external and load-balancer IPs first,
/// then node ports (any address, as the packet path matches them).
fn find(
    model: &ModelDump,
    proto: Protocol,
    dst: SocketAddr,
) -> Option<(&Service, &ServicePort, &'static str)> {
    let by_ip = model.services.iter().find_map(|svc| {
        let kind = if svc.cluster_ips.contains(&dst.ip()) {
            "ClusterIP"
        } else if svc.external_ips.contains(&dst.ip()) {
            "ExternalIP"
        } else if svc.load_balancer_ips.contains(&dst.ip()) {
            "LoadBalancer"
        } else {
            return None;
        };
        let port = svc
            .ports
            .iter()
            .find(|p| p.protocol == proto && p.port == dst.port())?;
        Some((svc, port, kind))
    });
    by_ip.or_else(|| {
        model.services.iter().find_map(|svc| {
            let port = svc
                .ports
                .iter()
                .find(|p| p.protocol == proto && p.node_port == Some(dst.port()))?;
            Some((svc, port, "NodePort"))
        })
    })
}

/// Why `pe` is or is not among `chosen` for a frontend under `policy_local`.
fn reason(
    pe: &PortEndpoint,
    chosen: bool,
    policy_local: bool,
    model: &ModelDump,
    v4: bool,
    topology: Option<select::Topology<'_>>,
) -> String {
    let ep = &pe.endpoint;
    let local = select::is_local(ep, &model.node);
    let serving_terminating = !ep.ready && ep.serving && ep.terminating;
    if chosen {
        let mut why = String::from(if serving_terminating {
            "serving but terminating: used because no ready endpoint is left"
        } else {
            "ready"
        });
        if policy_local {
            why.push_str(", on this node (Local policy)");
        }
        return why;
    }
    if pe.ip.is_ipv4() != v4 {
        return "other IP family than the destination".into();
    }
    if !ep.ready && !ep.serving {
        return if ep.terminating {
            "terminating and no longer serving".into()
        } else {
            "not ready".into()
        };
    }
    if policy_local && !local {
        let on = ep.node_name().unwrap_or("no node");
        return format!(
            "on {on}; the Local policy uses only this node's ({}) endpoints",
            model.node.name
        );
    }
    if serving_terminating {
        return "serving but terminating: used only when no ready endpoint is left".into();
    }
    if let Some(select::Topology::SameNode(node)) = topology
        && !topology.is_some_and(|t| t.allows(ep))
    {
        return format!(
            "topology hints (PreferSameNode) send it to node(s) {}; this node ({node}) has \
             endpoints of its own",
            ep.node_hints().join(",")
        );
    }
    if let Some(select::Topology::SameZone(zone)) = topology
        && !ep.zone_hints().is_empty()
        && !ep.zone_hints().iter().any(|z| &**z == zone)
    {
        return format!(
            "topology hints send it to zone(s) {}; this node is in {zone}",
            ep.zone_hints().join(",")
        );
    }
    "not chosen by the endpoint selection".into()
}

fn in_ranges(ranges: &[(IpAddr, u8)], ip: IpAddr) -> bool {
    ranges.iter().any(|&(net, len)| match (net, ip) {
        (IpAddr::V4(n), IpAddr::V4(i)) => {
            let mask = if len == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(len.min(32)))
            };
            u32::from(n) & mask == u32::from(i) & mask
        }
        (IpAddr::V6(n), IpAddr::V6(i)) => {
            let mask = if len == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(len.min(128)))
            };
            u128::from(n) & mask == u128::from(i) & mask
        }
        _ => false,
    })
}

/// The service range (as the daemon published it) that holds `ip`, if any.
fn service_range_of(model: &ModelDump, ip: IpAddr) -> Option<&str> {
    model.service_ranges.iter().map(String::as_str).find(|r| {
        r.parse::<crate::model::Cidr>()
            .is_ok_and(|c| c.contains(ip))
    })
}

/// Explains a connection of `proto` to `dst` from `from` (None: a process on this node).
pub fn explain(
    model: &ModelDump,
    programmed: Option<&BTreeMap<Frontend, ProgrammedFrontend>>,
    proto: Protocol,
    dst: SocketAddr,
    from: Option<IpAddr>,
) -> Explanation {
    let client = match from {
        None => Client::ThisNode,
        Some(ip) if view::is_local_pod(model, ip) => Client::LocalPod,
        Some(_) => Client::Remote,
    };
    let mut ex = Explanation {
        protocol: proto.to_string(),
        destination: dst.to_string(),
        from: from.map(|f| f.to_string()),
        client: client.word(),
        mode: model.mode.clone(),
        matched: None,
        hook: None,
        candidates: vec![],
        eligible: vec![],
        programmed: None,
        affinity_timeout: None,
        verdict: "not-a-service",
        detail: String::new(),
    };
    let mode = model.mode.as_str();
    let Some((svc, port, kind)) = find(model, proto, dst) else {
        if let Some(range) = service_range_of(model, dst.ip()) {
            ex.verdict = if model.mode == "ebpf" {
                "refused"
            } else {
                "rejected"
            };
            let how = match model.mode.as_str() {
                "ebpf" => "connect() and sendmsg() fail with ECONNREFUSED; nothing is sent",
                "nftables" => "the cluster-ips-check rule rejects it",
                "iptables" | "userspace" => {
                    "a REJECT rule answers it (a TCP reset, else ICMP port unreachable)"
                }
                _ => "refused once the dataplane is up",
            };
            ex.detail = format!(
                "{} is inside the service range {range} and no Service this proxy serves has \
                 {proto} {dst}: refused at once ({how})",
                dst.ip()
            );
            return ex;
        }
        ex.detail = format!(
            "no Service this proxy serves has {proto} {dst}; fastpath leaves the traffic alone"
        );
        return ex;
    };
    let v4 = dst.is_ipv4();
    // Which frontend: traffic from this node (or its pods) is handled at the socket, from
    // other hosts per packet; external addresses reached from this node short-circuit to the
    // Cluster endpoints.
    let scope = if client == Client::Remote {
        FrontendScope::Packet
    } else {
        FrontendScope::Socket
    };
    let fe_ip = if kind == "NodePort" && v4 {
        IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)
    } else if kind == "NodePort" {
        IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
    } else {
        dst.ip()
    };
    let fe = Frontend {
        ip: fe_ip,
        port: if kind == "NodePort" {
            dst.port()
        } else {
            port.port
        },
        proto,
        scope,
    };
    let (policy, policy_local) = match (kind, scope) {
        ("ClusterIP", _) => ("internalTrafficPolicy", svc.internal_policy_local),
        (_, FrontendScope::Socket) => ("short-circuit from this node: Cluster", false),
        (_, FrontendScope::Packet) => ("externalTrafficPolicy", svc.external_policy_local),
    };
    ex.matched = Some(Matched {
        service: service_port_name(svc, port),
        kind,
        frontend: fe.to_string(),
        policy: if policy.contains(':') {
            policy.to_string()
        } else {
            format!(
                "{policy}={}",
                if policy_local { "Local" } else { "Cluster" }
            )
        },
    });
    ex.affinity_timeout = svc.affinity_timeout;
    if !model.synced {
        ex.detail
            .push_str("the daemon has not synced yet: nothing is programmed. ");
    }
    if mode == "ebpf" && kind == "ClusterIP" && client == Client::Remote {
        ex.verdict = "not-translated-here";
        ex.detail.push_str(
            "in eBPF mode a ClusterIP is translated at the client's socket, by the proxy on the \
             client's own node; a packet to it from another host is not touched here",
        );
        return ex;
    }
    // The frontend's backends, as the dataplanes derive them. iptables renders a ClusterIP
    // from other hosts with the same internal list as the socket frontend.
    let frontends = view::model_frontends(model);
    let lookup = if mode != "ebpf" && kind == "ClusterIP" {
        Frontend {
            scope: FrontendScope::Socket,
            ..fe
        }
    } else {
        fe
    };
    let Some(m) = frontends.get(&lookup) else {
        ex.verdict = "not-translated-here";
        ex.detail.push_str(&format!(
            "the service has no frontend {lookup} on this node"
        ));
        return ex;
    };
    ex.hook = Some(super::hook::hook(mode, model, proto, v4, scope, m, kind));
    let chosen = &m.desired.backends;
    ex.eligible = chosen.iter().map(addr).collect();
    let all = m
        .endpoints
        .map(|set| select::endpoints_for_port(set, port))
        .unwrap_or_default();
    let topology = select::topology(&all, &model.node);
    ex.candidates = all
        .iter()
        .map(|pe| {
            let eligible = chosen.iter().any(|b| b.ip == pe.ip && b.port == pe.port);
            Candidate {
                address: SocketAddr::new(pe.ip, pe.port).to_string(),
                state: view::state_word(&pe.endpoint),
                node: pe.endpoint.node_name().map(str::to_owned),
                zone: pe.endpoint.zone().map(str::to_owned),
                eligible,
                reason: reason(pe, eligible, policy_local, model, v4, topology),
            }
        })
        .collect();
    if let Some(p) = programmed {
        let mut got: Vec<String> = p
            .get(&fe)
            .map(|p| p.backends.iter().map(addr).collect())
            .unwrap_or_default();
        got.sort();
        let mut want = ex.eligible.clone();
        want.sort();
        if got != want {
            let (what, why) = if mode == "iptables" || mode == "nftables" {
                (
                    "the rules send",
                    "a sync is pending or failed, or someone changed the rules",
                )
            } else {
                ("the maps hold", "a sync is pending or failed")
            };
            let _ = write!(
                ex.detail,
                "{what} {got:?} for this frontend, not the model's {want:?} ({why}). "
            );
        }
        ex.programmed = Some(got);
    }
    if scope == FrontendScope::Packet
        && kind == "LoadBalancer"
        && !svc.load_balancer_source_ranges.is_empty()
        && let Some(from) = from
        && !in_ranges(&svc.load_balancer_source_ranges, from)
    {
        ex.verdict = "dropped";
        let ranges: Vec<String> = svc
            .load_balancer_source_ranges
            .iter()
            .map(|(n, l)| format!("{n}/{l}"))
            .collect();
        let _ = write!(
            ex.detail,
            "{from} is outside loadBalancerSourceRanges ({})",
            ranges.join(", ")
        );
        return ex;
    }
    if chosen.is_empty() {
        let anywhere = all
            .iter()
            .any(|pe| pe.endpoint.ready || (pe.endpoint.serving && pe.endpoint.terminating));
        let why = if anywhere {
            "no endpoint the traffic policy may use on this node"
        } else {
            "the service has no ready or serving endpoint"
        };
        let (verdict, what) = match (mode, scope) {
            ("ebpf", FrontendScope::Socket) => (
                "refused",
                "connect()/sendmsg() fails at once with ECONNREFUSED",
            ),
            ("ebpf", FrontendScope::Packet) => (
                "dropped",
                "the packet is dropped (counted as fastpath_packets_total{result=\"dropped_no_backend\"})",
            ),
            ("iptables", _) if anywhere => (
                "dropped",
                "the filter table DROPs it (as kube-proxy; the client times out)",
            ),
            ("iptables", _) => (
                "rejected",
                "the filter table REJECTs it: the client sees connection refused",
            ),
            ("nftables", _) if anywhere => (
                "dropped",
                "@no-endpoint-services drops it (as kube-proxy; the client times out)",
            ),
            ("nftables", _) => (
                "rejected",
                "@no-endpoint-services rejects it: the client sees connection refused",
            ),
            _ => ("refused", "the relay refuses it"),
        };
        ex.verdict = verdict;
        let _ = write!(ex.detail, "{why}: {what}");
        return ex;
    }
    ex.verdict = "translated";
    let _ = write!(
        ex.detail,
        "to one of {} backend(s), chosen at random per {}",
        chosen.len(),
        if scope == FrontendScope::Socket {
            "connection (per datagram for unconnected UDP)"
        } else {
            "flow"
        }
    );
    if let Some(t) = svc.affinity_timeout {
        let _ = write!(
            ex.detail,
            "; ClientIP affinity keeps a client on its backend for {t}s"
        );
    }
    ex
}

impl Explanation {
    pub fn text(&self) -> String {
        let mut s = String::new();
        let from = self
            .from
            .as_ref()
            .map_or(String::new(), |f| format!(" from {f}"));
        let _ = writeln!(
            s,
            "{} {}{} ({}; {} mode)",
            self.protocol, self.destination, from, self.client, self.mode
        );
        match &self.matched {
            None => {}
            Some(m) => {
                let _ = writeln!(
                    s,
                    "  service:  {} ({} frontend {}), {}",
                    m.service, m.kind, m.frontend, m.policy
                );
            }
        }
        if let Some(h) = &self.hook {
            let _ = writeln!(s, "  hook:     {h}");
        }
        if !self.candidates.is_empty() {
            let _ = writeln!(
                s,
                "  backends: {} of {} eligible",
                self.eligible.len(),
                self.candidates.len()
            );
            let mut t = super::table::Table::new(&["", "ADDRESS", "STATE", "NODE", "WHY"]);
            for c in &self.candidates {
                t.row(vec![
                    if c.eligible {
                        "  +".into()
                    } else {
                        "  -".into()
                    },
                    c.address.clone(),
                    c.state.to_string(),
                    c.node.clone().unwrap_or_else(|| "-".into()),
                    c.reason.clone(),
                ]);
            }
            // The header row carries no information an operator needs twice.
            for line in t.render().lines().skip(1) {
                let _ = writeln!(s, "  {line}");
            }
        } else if self.matched.is_some() {
            let _ = writeln!(s, "  backends: none (no endpoints)");
        }
        if let Some(p) = &self.programmed {
            let _ = writeln!(
                s,
                "  {:<9} {}",
                if self.mode == "iptables" || self.mode == "nftables" {
                    "rules:"
                } else {
                    "maps:"
                },
                if p.is_empty() {
                    "no backend".into()
                } else {
                    p.join(", ")
                }
            );
        }
        let _ = writeln!(
            s,
            "  verdict:  {}: {}",
            self.verdict,
            self.detail.trim_end()
        );
        s
    }
}
