//! Where Services and EndpointSlices come from, as a stream of [`SourceEvent`]s.
//!
//! - [`manifests`]: a YAML/JSON file or folder of manifests ([`file`] reads them), followed
//!   object by object as its files change (no cluster needed).
//! - [`kube`]: kube-rs watchers on the API server ([`lazy`]: their objects decoded beside
//!   the next list page's fetch).
//!
//! Both convert objects with [`crate::model::convert`]; the daemon applies the events to the
//! [`ChangeTracker`](crate::model::tracker::ChangeTracker).

pub mod backoff;
pub mod file;
mod inotify;
pub mod kube;
pub mod lazy;
pub mod manifests;

use crate::model::{Cidr, NodeInfo, Service, ServiceKey, SliceInfo};

#[derive(Clone, Debug, PartialEq)]
pub enum SourceEvent {
    /// Every service and slice at once (the manifests' first read): nothing else exists.
    ReplaceAll {
        services: Vec<Service>,
        slices: Vec<(ServiceKey, String, SliceInfo)>,
    },
    /// A full list of services (the initial list, or a relist after 410 Gone).
    ReplaceServices(Vec<Service>),
    /// A full list of slices, as (owner, slice name, slice).
    ReplaceSlices(Vec<(ServiceKey, String, SliceInfo)>),
    /// One service added, changed (`Some`) or removed or no longer ours (`None`).
    Service {
        key: ServiceKey,
        service: Option<Service>,
    },
    /// One slice changed (`Some`, with its owner) or gone/unusable (`None`; the owner may
    /// be unknown then, the tracker remembers it).
    Slice {
        namespace: String,
        owner: Option<ServiceKey>,
        name: String,
        slice: Option<SliceInfo>,
    },
    /// What we learnt about this node (its zone).
    Node(NodeInfo),
    /// Every ServiceCIDR object at once (a list or relist), as (name, its ranges).
    ReplaceServiceCidrs(Vec<(String, Vec<Cidr>)>),
    /// One ServiceCIDR object added or changed (`Some`), or removed (`None`).
    ServiceCidr {
        name: String,
        cidrs: Option<Vec<Cidr>>,
    },
    /// The initial lists are complete: programming may start.
    Synced,
}
