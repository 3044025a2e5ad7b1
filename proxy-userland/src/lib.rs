//! fastpath: a kube-proxy that programs Kubernetes Services into eBPF maps.
//!
//! Data flows as in kube-proxy: sources -> change tracker -> bounded-frequency sync runner
//! -> one dataplane.
//!
//! - [`config`]: command-line flags.
//! - [`source`]: where Services and EndpointSlices come from (manifest files; the API server).
//! - [`model`]: the normalized service/endpoint model, the change tracker, and the endpoint
//!   selection rules every dataplane shares.
//! - [`sync`]: the bounded-frequency runner that turns changes into dataplane syncs.
//! - [`dataplane`]: the [`dataplane::Dataplane`] trait and its backends (eBPF today).
//! - [`daemon`]: wiring it all together, start to graceful shutdown.
//! - [`shutdown`]: the signals that end the daemon.

pub mod config;
pub mod daemon;
pub mod dataplane;
pub mod model;
pub mod shutdown;
pub mod source;
pub mod sync;
