//! The normalized view of the cluster that every dataplane consumes.
//!
//! Sources (files, the API server) produce Kubernetes objects; [`convert`] turns them into
//! these plain types, rejecting what is malformed; [`tracker`] keeps the current set and says
//! which services changed; [`select`] decides which endpoints a service port should use on
//! this node. A dataplane only ever reads [`ProxyState`].

pub mod convert;
pub mod endpoint;
pub mod intern;
pub mod select;
pub mod service;
pub mod service_cidr;
pub mod slices;
pub mod sloppy_ip;
#[cfg(test)]
pub mod testing;
pub mod tracker;
pub mod validate;

use std::sync::Arc;

pub use endpoint::{Endpoint, EndpointSet, SliceInfo, SlicePort};
use imbl::OrdMap;
pub use service::{LbAlgorithm, LbMode, Protocol, Service, ServiceKey, ServicePort};
pub use service_cidr::{Cidr, ServiceRanges};
pub use slices::Slices;

/// What this node must program: every service that is ours, and the endpoints of each.
///
/// Persistent maps of `Arc`s: a snapshot (for a sync, for /debug/model) is a clone that
/// shares every node with the tracker's copy, so taking one costs the same at 50,000
/// services as at 10, and the tracker's next change copies only the path it touches. With
/// `BTreeMap`s, two full copies per sync (every key's two strings) were most of a sync's
/// time at 10,000 services.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProxyState {
    pub services: OrdMap<ServiceKey, Arc<Service>>,
    pub endpoints: OrdMap<ServiceKey, Arc<EndpointSet>>,
    /// Where ClusterIPs come from: an address inside them that no service serves is refused.
    pub service_ranges: ServiceRanges,
}

/// Facts about the node the proxy runs on, used to pick endpoints (topology, Local
/// policies).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeInfo {
    pub name: String,
    pub zone: Option<String>,
}
