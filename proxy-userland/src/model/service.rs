//! Services, normalized from v1 Service.

use std::{fmt, net::IpAddr, sync::Arc};

/// A Service's identity: namespace and name (kube-proxy's NamespacedName).
///
/// Shared strings: a key is held by both maps of the model, the service itself, the
/// tracker's slice index and the eBPF programmer's bookkeeping, and a clone is two
/// reference counts instead of two allocations (~0.5 KiB per service in the daemon's RSS
/// with `String`s). Namespaces repeat over many services, so they are interned.
#[derive(
    Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct ServiceKey {
    #[serde(with = "shared")]
    pub namespace: Arc<str>,
    #[serde(with = "shared")]
    pub name: Arc<str>,
}

impl ServiceKey {
    pub fn new(namespace: impl AsRef<str>, name: impl AsRef<str>) -> Self {
        Self {
            namespace: super::intern::intern(namespace.as_ref()),
            name: Arc::from(name.as_ref()),
        }
    }
}

/// Serde for an `Arc<str>` field, as a plain string (the workspace's serde has no `rc`
/// feature).
mod shared {
    use std::sync::Arc;

    use serde::{Deserialize as _, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Arc<str>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<str>, D::Error> {
        Ok(Arc::from(String::deserialize(d)?))
    }
}

impl fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// The IP protocol number, as the BPF maps and iptables spell it.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => proxy_common::proto::TCP,
            Protocol::Udp => proxy_common::proto::UDP,
            Protocol::Sctp => proxy_common::proto::SCTP,
        }
    }

    /// The inverse of [`number`](Self::number).
    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            proxy_common::proto::TCP => Some(Protocol::Tcp),
            proxy_common::proto::UDP => Some(Protocol::Udp),
            proxy_common::proto::SCTP => Some(Protocol::Sctp),
            _ => None,
        }
    }

    /// Parses the Kubernetes spelling; a missing protocol means TCP, as the API defaults it.
    pub fn from_k8s(s: Option<&str>) -> Option<Self> {
        match s {
            None | Some("TCP") => Some(Protocol::Tcp),
            Some("UDP") => Some(Protocol::Udp),
            Some("SCTP") => Some(Protocol::Sctp),
            Some(_) => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One port of a service. `name` matches the EndpointSlice port of the same name.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ServicePort {
    /// May be empty for a single-port service.
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
    pub node_port: Option<u16>,
}

/// A service this proxy serves. Headless, ExternalName and other proxies' services never
/// become one of these.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Service {
    pub key: ServiceKey,
    /// spec.clusterIPs (dual-stack: up to one per family).
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePort>,
    pub external_ips: Vec<IpAddr>,
    /// status.loadBalancer.ingress[].ip
    pub load_balancer_ips: Vec<IpAddr>,
    /// spec.loadBalancerSourceRanges as (network address, prefix length).
    pub load_balancer_source_ranges: Vec<(IpAddr, u8)>,
    /// Some(seconds) when sessionAffinity is ClientIP.
    pub affinity_timeout: Option<u32>,
    /// externalTrafficPolicy: Local
    pub external_policy_local: bool,
    /// internalTrafficPolicy: Local
    pub internal_policy_local: bool,
    pub health_check_node_port: Option<u16>,
    /// trafficDistribution: PreferClose (or topology-mode Auto hints).
    pub prefer_close: bool,
    /// The packet path's backend choice for this service, where its annotation sets one
    /// (`service.cilium.io/lb-algorithm`); None: the node's `--bpf-lb-algorithm`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lb_algorithm: Option<LbAlgorithm>,
}

/// How the packet path picks a new flow's backend (Cilium's `--bpf-lb-algorithm`).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum LbAlgorithm {
    /// Uniformly at random: kube-proxy's spread.
    #[default]
    Random,
    /// Maglev consistent hashing: every node picks the same backend for a flow.
    Maglev,
}

/// How a flow to a backend on another node travels (Cilium's `--bpf-lb-mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LbMode {
    /// The entry node rewrites the source to itself; replies come back through it.
    #[default]
    Snat,
    /// Direct server return: the backend's node answers the client itself.
    Dsr,
    /// DSR for TCP, SNAT for UDP (Cilium's `hybrid`).
    Hybrid,
}

impl LbMode {
    /// Whether flows of `proto` go by DSR.
    pub fn dsr_for(self, proto: Protocol) -> bool {
        match self {
            Self::Snat => false,
            Self::Dsr => true,
            Self::Hybrid => proto == Protocol::Tcp,
        }
    }
}

impl std::str::FromStr for LbAlgorithm {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "random" => Ok(Self::Random),
            "maglev" => Ok(Self::Maglev),
            other => Err(format!("{other:?} is neither \"random\" nor \"maglev\"")),
        }
    }
}

impl Service {
    /// A plain ClusterIP service: these addresses and ports, every other field as the API
    /// defaults it (no external addresses, no affinity, Cluster traffic policies).
    pub fn cluster_ip(key: ServiceKey, cluster_ips: Vec<IpAddr>, ports: Vec<ServicePort>) -> Self {
        Self {
            key,
            cluster_ips,
            ports,
            external_ips: vec![],
            load_balancer_ips: vec![],
            load_balancer_source_ranges: vec![],
            affinity_timeout: None,
            external_policy_local: false,
            internal_policy_local: false,
            health_check_node_port: None,
            prefer_close: false,
            lb_algorithm: None,
        }
    }
}
