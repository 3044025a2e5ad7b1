//! The normalized view of the cluster that every dataplane consumes.
//!
//! Sources (files, the API server) produce Kubernetes objects; [`convert`] turns them into
//! these plain types, rejecting what is malformed; [`tracker`] keeps the current set and says
//! which services changed; [`select`] decides which endpoints a service port should use on
//! this node. A dataplane only ever reads [`ProxyState`].

pub mod convert;
pub mod endpoint;
pub mod select;
pub mod service;
pub mod tracker;
pub mod validate;

use std::{collections::BTreeMap, sync::Arc};

pub use endpoint::{Endpoint, EndpointSet, SliceInfo, SlicePort};
pub use service::{Protocol, Service, ServiceKey, ServicePort};

/// What this node must program: every service that is ours, and the endpoints of each.
///
/// Values are `Arc`s so that a sync can hold a snapshot while the tracker moves on.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProxyState {
    pub services: BTreeMap<ServiceKey, Arc<Service>>,
    pub endpoints: BTreeMap<ServiceKey, Arc<EndpointSet>>,
}

/// Facts about the node the proxy runs on, used to pick endpoints (topology, Local
/// policies).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeInfo {
    pub name: String,
    pub zone: Option<String>,
}
