//! What a service asks of any dataplane, derived from the model once so that every backend
//! agrees: per service port, the endpoints each traffic policy may use on this node; per
//! cluster IP, the frontend (address, port, protocol) and its backends.
//!
//! The eBPF backend programs [`desired_frontends`] into its maps and the userspace proxier
//! opens one relay per frontend; the iptables proxier, which also serves node ports and
//! external addresses, renders from [`port_endpoints`].

use std::{collections::BTreeMap, net::IpAddr};

use crate::model::{
    EndpointSet, NodeInfo, Protocol, Service, ServicePort,
    select::{self, Categorized},
};

/// A service address as the dataplanes match it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    pub ip: IpAddr,
    pub port: u16,
    pub proto: Protocol,
}

/// Where a backend slot sends traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendAddr {
    pub ip: IpAddr,
    pub port: u16,
    pub proto: Protocol,
}

/// What a frontend should look like.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredFrontend {
    pub backends: Vec<BackendAddr>,
    pub affinity_timeout: Option<u32>,
}

pub(crate) fn frontend_name(fe: &Frontend) -> String {
    match fe.ip {
        IpAddr::V4(ip) => format!("{ip}:{}/{}", fe.port, fe.proto),
        IpAddr::V6(ip) => format!("[{ip}]:{}/{}", fe.port, fe.proto),
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
            let mut backends: Vec<BackendAddr> = chosen
                .iter()
                .filter(|e| e.ip.is_ipv4() == ip.is_ipv4())
                .map(|e| BackendAddr {
                    ip: e.ip,
                    port: e.port,
                    proto: port.protocol,
                })
                .collect();
            backends.sort();
            backends.dedup();
            let fe = Frontend {
                ip,
                port: port.port,
                proto: port.protocol,
            };
            out.insert(
                fe,
                DesiredFrontend {
                    backends,
                    affinity_timeout: svc.affinity_timeout,
                },
            );
        }
    }
    out
}
