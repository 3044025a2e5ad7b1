//! What a service asks of any dataplane, derived from the model once so that every backend
//! agrees: per service port, the endpoints each traffic policy may use on this node; per
//! cluster IP, the frontend (address, port, protocol) and its backends.
//!
//! The eBPF backend programs [`desired_frontends`] into its maps, plus
//! [`desired_packet_frontends`] for its tc programs; the userspace proxier opens one relay
//! per frontend; the iptables proxier, which also serves node ports and external
//! addresses, renders from [`port_endpoints`].

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
};

use crate::model::{
    EndpointSet, NodeInfo, Protocol, Service, ServicePort,
    endpoint::PortEndpoint,
    select::{self, Categorized},
};

/// Which traffic a frontend applies to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FrontendScope {
    /// Connections made on this node (cluster IPs; internalTrafficPolicy).
    #[default]
    Socket,
    /// Packets arriving from other hosts (node ports, external and load-balancer IPs;
    /// externalTrafficPolicy). A node port's frontend has the unspecified address: it
    /// answers on every node address.
    Packet,
}

/// A service address as the dataplanes match it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    pub ip: IpAddr,
    pub port: u16,
    pub proto: Protocol,
    pub scope: FrontendScope,
}

impl Frontend {
    /// A frontend for connections made on this node.
    pub fn socket(ip: IpAddr, port: u16, proto: Protocol) -> Self {
        Self {
            ip,
            port,
            proto,
            scope: FrontendScope::Socket,
        }
    }

    /// A frontend for packets from other hosts.
    pub fn packet(ip: IpAddr, port: u16, proto: Protocol) -> Self {
        Self {
            ip,
            port,
            proto,
            scope: FrontendScope::Packet,
        }
    }
}

/// Where a backend slot sends traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendAddr {
    pub ip: IpAddr,
    pub port: u16,
    pub proto: Protocol,
    /// The endpoint runs on this node.
    pub local: bool,
}

/// What a frontend should look like.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredFrontend {
    pub backends: Vec<BackendAddr>,
    pub affinity_timeout: Option<u32>,
    /// Packet path: masquerade traffic sent to other nodes' backends
    /// (externalTrafficPolicy: Cluster).
    pub snat: bool,
    /// Packet path: only these clients (loadBalancerSourceRanges); empty: everyone.
    pub source_ranges: Vec<(IpAddr, u8)>,
    /// Packet path: a new flow's backend comes from a Maglev table (the eBPF dataplane
    /// sets it from `--bpf-lb-algorithm` and the service's annotation).
    pub maglev: bool,
    /// Packet path, with `snat`: other nodes' backends answer the client directly (DSR,
    /// from `--bpf-lb-mode`) instead of through this node.
    pub dsr: bool,
}

pub(crate) fn frontend_name(fe: &Frontend) -> String {
    let ip = match fe.ip {
        IpAddr::V4(ip) if ip.is_unspecified() => "<node>".to_string(),
        IpAddr::V4(ip) => ip.to_string(),
        IpAddr::V6(ip) => format!("[{ip}]"),
    };
    match fe.scope {
        FrontendScope::Socket => format!("{ip}:{}/{}", fe.port, fe.proto),
        FrontendScope::Packet => format!("{ip}:{}/{} (external)", fe.port, fe.proto),
    }
}

impl std::fmt::Display for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&frontend_name(self))
    }
}

/// One service port with its endpoints sorted by traffic policy (see [`select::categorize`]).
#[derive(Clone, Debug)]
pub struct PortEndpoints<'a> {
    pub port: &'a ServicePort,
    pub categorized: Categorized,
}

/// Every port of `svc` with its categorized endpoints on `node`. With `family` set
/// (`Some(true)` for IPv4, `Some(false)` for IPv6) only endpoints of that family are
/// considered, as kube-proxy's per-family proxiers see them.
pub fn port_endpoints<'a>(
    svc: &'a Service,
    endpoints: Option<&EndpointSet>,
    node: &NodeInfo,
    family: Option<bool>,
) -> Vec<PortEndpoints<'a>> {
    svc.ports
        .iter()
        .map(|port| {
            let mut eps = endpoints
                .map(|set| select::endpoints_for_port(set, port))
                .unwrap_or_default();
            if let Some(v4) = family {
                eps.retain(|e| e.ip.is_ipv4() == v4);
            }
            PortEndpoints {
                port,
                categorized: select::categorize(svc, &eps, node),
            }
        })
        .collect()
}

/// The frontends one service needs on this node and the backends of each: every ClusterIP
/// of every port, with the endpoints ClusterIP traffic may use here, of the same family.
pub fn desired_frontends(
    svc: &Service,
    endpoints: Option<&EndpointSet>,
    node: &NodeInfo,
) -> BTreeMap<Frontend, DesiredFrontend> {
    let mut out = BTreeMap::new();
    for pe in port_endpoints(svc, endpoints, node, None) {
        let port = pe.port;
        let chosen = pe.categorized.internal(svc);
        for &ip in &svc.cluster_ips {
            let fe = Frontend::socket(ip, port.port, port.protocol);
            out.insert(
                fe,
                DesiredFrontend {
                    backends: backend_addrs(chosen, ip.is_ipv4(), port, node),
                    affinity_timeout: svc.affinity_timeout,
                    ..Default::default()
                },
            );
        }
    }
    out
}

/// The endpoints of one family as backends, sorted so the same endpoints always land in
/// the same slots.
fn backend_addrs(
    chosen: &[PortEndpoint],
    v4: bool,
    port: &ServicePort,
    node: &NodeInfo,
) -> Vec<BackendAddr> {
    let mut backends: Vec<BackendAddr> = chosen
        .iter()
        .filter(|e| e.ip.is_ipv4() == v4)
        .map(|e| BackendAddr {
            ip: e.ip,
            port: e.port,
            proto: port.protocol,
            local: select::is_local(&e.endpoint, node),
        })
        .collect();
    backends.sort();
    backends.dedup();
    backends
}

/// For each UDP socket-scope frontend among `frontends`, every serving endpoint (ready, or
/// terminating but still serving) of its port and family, whatever the traffic policy
/// picks for new flows. kube-proxy clears a UDP flow only once its endpoint is no longer
/// serving (pkg/proxy/conntrack/cleanup.go): a terminating pod keeps its existing clients
/// until it leaves the slice, so a socket connected to one of these must be left alone.
pub fn serving_udp_endpoints<'a>(
    svc: &Service,
    endpoints: Option<&EndpointSet>,
    frontends: impl IntoIterator<Item = &'a Frontend>,
) -> BTreeMap<Frontend, BTreeSet<SocketAddr>> {
    let Some(set) = endpoints else {
        return BTreeMap::new();
    };
    let udp: Vec<&Frontend> = frontends
        .into_iter()
        .filter(|fe| fe.proto == Protocol::Udp && fe.scope == FrontendScope::Socket)
        .collect();
    let mut out = BTreeMap::new();
    for port in svc.ports.iter().filter(|p| p.protocol == Protocol::Udp) {
        // A node port's socket frontend has the unspecified address (no ClusterIP is).
        let of_port = |fe: &&&Frontend| {
            if fe.ip.is_unspecified() {
                port.node_port == Some(fe.port)
            } else {
                port.port == fe.port
            }
        };
        let mine: Vec<&Frontend> = udp.iter().filter(of_port).copied().collect();
        if mine.is_empty() {
            continue;
        }
        let serving: Vec<SocketAddr> = select::endpoints_for_port(set, port)
            .into_iter()
            .filter(|e| e.endpoint.serving)
            .map(|e| SocketAddr::new(e.ip, e.port))
            .collect();
        for fe in mine {
            let of_family: BTreeSet<SocketAddr> = serving
                .iter()
                .filter(|a| a.is_ipv4() == fe.ip.is_ipv4())
                .copied()
                .collect();
            if !of_family.is_empty() {
                out.insert(*fe, of_family);
            }
        }
    }
    out
}

/// Socket-scope frontends for the service's external and load-balancer IPs, and for its
/// node ports on this node's addresses (stored under the unspecified address of each of
/// its families): connections from this node to them go straight to the Cluster
/// endpoints, as kube-proxy short-circuits them (whatever externalTrafficPolicy says),
/// instead of leaving the node for a load balancer that sends them back.
pub fn desired_external_socket_frontends(
    svc: &Service,
    endpoints: Option<&EndpointSet>,
    node: &NodeInfo,
) -> BTreeMap<Frontend, DesiredFrontend> {
    let mut out = BTreeMap::new();
    let node_ports = svc.ports.iter().any(|p| p.node_port.is_some());
    if svc.external_ips.is_empty() && svc.load_balancer_ips.is_empty() && !node_ports {
        return out;
    }
    for pe in port_endpoints(svc, endpoints, node, None) {
        let cluster = |v4: bool| DesiredFrontend {
            backends: backend_addrs(&pe.categorized.cluster, v4, pe.port, node),
            affinity_timeout: svc.affinity_timeout,
            ..Default::default()
        };
        if let Some(np) = pe.port.node_port {
            for v4 in families(svc) {
                out.insert(Frontend::socket(any(v4), np, pe.port.protocol), cluster(v4));
            }
        }
        for &ip in svc.external_ips.iter().chain(&svc.load_balancer_ips) {
            out.insert(
                Frontend::socket(ip, pe.port.port, pe.port.protocol),
                cluster(ip.is_ipv4()),
            );
        }
    }
    out
}

/// The frontends the packet path (tc programs on the node's devices) needs for traffic from
/// other hosts: per port, the node port on every node address, and the port on each
/// external IP and load-balancer IP, with the endpoints `externalTrafficPolicy` allows
/// here. Each of the service's families (see [`families`]) on its own, as kube-proxy's
/// per-family proxiers see it.
pub fn desired_packet_frontends(
    svc: &Service,
    endpoints: Option<&EndpointSet>,
    node: &NodeInfo,
) -> BTreeMap<Frontend, DesiredFrontend> {
    let mut out = BTreeMap::new();
    for v4 in families(svc) {
        out.extend(packet_frontends_of(svc, endpoints, node, v4));
    }
    out
}

/// The families a service's node ports serve: those of its ClusterIPs (IPv4 when it has
/// none), as kube-proxy's proxier of a family skips services without an address of it.
fn families(svc: &Service) -> Vec<bool> {
    let mut out: Vec<bool> = [true, false]
        .into_iter()
        .filter(|&v4| svc.cluster_ips.iter().any(|ip| ip.is_ipv4() == v4))
        .collect();
    if out.is_empty() {
        out.push(true);
    }
    out
}

/// Where node ports are stored: the family's unspecified address.
fn any(v4: bool) -> IpAddr {
    if v4 {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    }
}

/// [`desired_packet_frontends`] of one family (`v4`: IPv4, else IPv6).
fn packet_frontends_of(
    svc: &Service,
    endpoints: Option<&EndpointSet>,
    node: &NodeInfo,
    v4: bool,
) -> BTreeMap<Frontend, DesiredFrontend> {
    let mut out = BTreeMap::new();
    let of_family = |ips: &[IpAddr]| {
        ips.iter()
            .copied()
            .filter(|ip| ip.is_ipv4() == v4)
            .collect::<Vec<_>>()
    };
    let (external_ips, lb_ips) = (
        of_family(&svc.external_ips),
        of_family(&svc.load_balancer_ips),
    );
    if svc.ports.iter().all(|p| p.node_port.is_none())
        && external_ips.is_empty()
        && lb_ips.is_empty()
    {
        return out;
    }
    let mut ranges: Vec<(IpAddr, u8)> = svc
        .load_balancer_source_ranges
        .iter()
        .copied()
        .filter(|(ip, _)| ip.is_ipv4() == v4)
        .collect();
    // Sorted as the maps give them back, so an adopted frontend compares equal.
    ranges.sort();
    ranges.dedup();
    for pe in port_endpoints(svc, endpoints, node, Some(v4)) {
        let port = pe.port;
        let want = |source_ranges: &[(IpAddr, u8)]| DesiredFrontend {
            backends: backend_addrs(pe.categorized.external(svc), v4, port, node),
            affinity_timeout: svc.affinity_timeout,
            snat: !svc.external_policy_local,
            source_ranges: source_ranges.to_vec(),
            ..Default::default()
        };
        if let Some(np) = port.node_port {
            out.insert(Frontend::packet(any(v4), np, port.protocol), want(&[]));
        }
        for &ip in &external_ips {
            out.insert(Frontend::packet(ip, port.port, port.protocol), want(&[]));
        }
        // kube-proxy applies the source ranges to the load-balancer IPs only.
        for &ip in &lb_ips {
            out.insert(
                Frontend::packet(ip, port.port, port.protocol),
                want(&ranges),
            );
        }
    }
    out
}
