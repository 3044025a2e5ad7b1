//! fastpath: a kube-proxy that programs Kubernetes Services into eBPF maps.
//!
//! Data flows as in kube-proxy: sources -> change tracker -> bounded-frequency sync runner
//! -> one dataplane.
//!
//! - [`config`]: command-line flags and the KubeProxyConfiguration file they override.
//! - [`source`]: where Services and EndpointSlices come from (manifest files; the API server).
//! - [`model`]: the normalized service/endpoint model, the change tracker, and the endpoint
//!   selection rules every dataplane shares.
//! - [`sync`]: the bounded-frequency runner that turns changes into dataplane syncs.
//! - [`dataplane`]: the [`dataplane::Dataplane`] trait and its backends: eBPF, and the
//!   iptables and userspace fallbacks.
//! - [`admin`]: /healthz, /livez, /readyz, /metrics and the health check node ports.
//! - [`node_setup`]: conntrack sysctls and the OOM score, as kube-proxy sets them (opt-in).
//! - [`events`]: Kubernetes Events about objects that cannot be used or programmed.
//! - [`inspect`]: `fastpath inspect` and `fastpath explain`, the operator's view.
//! - [`daemon`]: wiring it all together, start to graceful shutdown.
//! - [`shutdown`]: the signals that end the daemon.

pub mod admin;
pub mod config;
pub mod daemon;
pub mod dataplane;
pub mod events;
pub mod inspect;
pub mod model;
pub mod node_setup;
pub mod shutdown;
pub mod source;
pub mod sync;
