//! Endpoints, normalized from discovery.k8s.io/v1 EndpointSlice.

use std::{net::IpAddr, sync::Arc};

use super::{service::Protocol, slices::Slices};

/// A port as an EndpointSlice lists it: every endpoint of that slice serves it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SlicePort {
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
}

/// One endpoint address with its conditions, as kube-proxy reads them: a missing `ready`
/// means ready, a missing `serving` means the value of `ready`, a missing `terminating`
/// means false.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Endpoint {
    pub ip: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// Node names and zones repeat over every endpoint of a node: shared copies
    /// ([`super::intern`]).
    #[serde(with = "super::intern::opt")]
    pub node_name: Option<Arc<str>>,
    #[serde(with = "super::intern::opt")]
    pub zone: Option<Arc<str>>,
    /// hints.forZones[].name
    #[serde(with = "super::intern::list")]
    pub zone_hints: Vec<Arc<str>>,
    /// hints.forNodes[].name: the EndpointSlice controller writes them (with the zone
    /// hints) for `trafficDistribution: PreferSameNode`.
    #[serde(default, with = "super::intern::list")]
    pub node_hints: Vec<Arc<str>>,
}

/// One EndpointSlice, reduced to what routing needs.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SliceInfo {
    pub ports: Vec<SlicePort>,
    pub endpoints: Vec<Endpoint>,
}

/// Every slice of one service, by slice name. A service's endpoints may be split over
/// several slices, and an address may appear in more than one.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EndpointSet {
    pub slices: Slices<SliceInfo>,
}

/// An endpoint resolved for one service port: where to send, plus the conditions that
/// decide whether to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortEndpoint {
    pub ip: IpAddr,
    pub port: u16,
    pub endpoint: Endpoint,
}
