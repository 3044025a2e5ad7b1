//! Where Services and EndpointSlices come from. Each source produces Kubernetes objects,
//! converts them with [`crate::model::convert`] and feeds a
//! [`ChangeTracker`](crate::model::tracker::ChangeTracker).
//!
//! A `kube` source (watching the API server) will be added next to [`file`].

pub mod file;
