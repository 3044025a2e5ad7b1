//! The one dataplane interface the sync loop drives, and its backends.
//!
//! The sync loop hands every backend the same [`ProxyState`] plus the services that changed
//! since the last sync; how that becomes kernel state is the backend's business. Chosen once
//! at start-up ([`start`], [`mode`]), dispatched through [`Proxier`] without dynamic
//! dispatch.
//!
//! - [`bpf`]: socket-level load balancing with cgroup eBPF programs (the default).
//! - [`nftables`]: kube-proxy's nftables mode, the first fallback.
//! - [`iptables`]: kube-proxy's iptables mode, the next one.
//! - [`userspace`]: relays reached through iptables REDIRECT, the last resort.
//! - [`frontends`]: what a service asks of any dataplane, derived from the model once.
//! - [`mode`]: probing the node and choosing the mode, as kube-proxy's getProxyMode.
//! - [`leftovers`]: kube-proxy's nftables and IPVS modes' state, removed when we start.
//! - [`netns`]: running a proxier for another network namespace.
//! - [`watcher`]: the threads that keep looking at the kernel's devices, rules and hooks.

pub mod bpf;
pub mod frontends;
pub mod iptables;
pub mod leftovers;
pub mod mode;
pub mod netlink;
pub mod netns;
pub mod nftables;
pub mod primary;
pub mod start;
pub mod userspace;
pub mod watcher;

use std::collections::BTreeSet;

use self::bpf::maps::{LruCensus, Occupancy, PacketStats};
pub use self::start::{StartError, StartOptions, select_and_start, start};
use crate::model::{NodeInfo, ProxyState, ServiceKey};

/// What one sync did, for logs and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Services whose frontends were (re)computed.
    pub services_synced: usize,
    /// Frontends (address, port, protocol) written or rewritten.
    pub frontends_written: usize,
    pub frontends_removed: usize,
    /// Connected UDP sockets destroyed because their backend left the service.
    pub udp_sockets_reset: usize,
    /// Resets of such sockets that could not be done (see `bpf::program`), each logged.
    pub udp_socket_resets_failed: usize,
    /// Services that could not be programmed; they keep their previous state and are retried.
    pub failed: Vec<(ServiceKey, String)>,
}

/// Which services a sync must look at.
#[derive(Clone, Copy, Debug)]
pub enum Scope<'a> {
    /// Everything in the state, and anything programmed that the state no longer has.
    Full,
    /// Only these services.
    Changed(&'a BTreeSet<ServiceKey>),
}

/// A backend that turns the model into kernel state.
pub trait Dataplane {
    /// A short name for logs ("ebpf", "iptables", "userspace").
    fn name(&self) -> &'static str;

    /// Brings the kernel in line with `state` for the services in `scope`. Services that fail
    /// are listed in the report and left as they were; the rest are programmed.
    fn sync(&mut self, state: &ProxyState, node: &NodeInfo, scope: Scope<'_>) -> SyncReport;

    /// Entries in the dataplane's BPF maps, for the metrics, if it has any. Called after
    /// every sync, so it must be cheap: no walk over a map.
    fn occupancy(&self) -> Option<Occupancy> {
        None
    }

    /// Handles for counting the maps the kernel fills, on another thread (see
    /// [`bpf::maps::LruCensus`]), if the dataplane has such maps.
    fn lru_census(&self) -> Option<LruCensus> {
        None
    }

    /// The packet path's counters, if it is attached.
    fn packet_stats(&self) -> Option<PacketStats> {
        None
    }

    /// Stops the dataplane, when the sync engine stops.
    fn teardown(self)
    where
        Self: Sized,
    {
    }
}

/// The dataplane chosen at start-up.
pub enum Proxier {
    // Boxed: the eBPF dataplane is large next to the others.
    Bpf(Box<bpf::BpfDataplane>),
    Nftables(nftables::NftablesDataplane),
    Iptables(iptables::IptablesDataplane),
    Userspace(userspace::UserspaceDataplane),
}

impl Proxier {
    /// Stops the dataplane. eBPF programs detach (their links close); the iptables and
    /// userspace proxiers keep their rules unless started with `cleanup_on_exit`, so traffic
    /// keeps flowing while the proxy restarts, as with kube-proxy.
    pub fn shutdown(self) {
        match self {
            Proxier::Bpf(d) => drop(d),
            Proxier::Nftables(mut d) => d.shutdown(),
            Proxier::Iptables(mut d) => d.shutdown(),
            Proxier::Userspace(mut d) => d.shutdown(),
        }
    }
}

impl Dataplane for Proxier {
    fn name(&self) -> &'static str {
        match self {
            Proxier::Bpf(d) => d.name(),
            Proxier::Nftables(d) => d.name(),
            Proxier::Iptables(d) => d.name(),
            Proxier::Userspace(d) => d.name(),
        }
    }

    fn sync(&mut self, state: &ProxyState, node: &NodeInfo, scope: Scope<'_>) -> SyncReport {
        match self {
            Proxier::Bpf(d) => d.sync(state, node, scope),
            Proxier::Nftables(d) => d.sync(state, node, scope),
            Proxier::Iptables(d) => d.sync(state, node, scope),
            Proxier::Userspace(d) => d.sync(state, node, scope),
        }
    }

    fn occupancy(&self) -> Option<Occupancy> {
        match self {
            Proxier::Bpf(d) => Some(d.programmer().occupancy()),
            _ => None,
        }
    }

    fn lru_census(&self) -> Option<LruCensus> {
        match self {
            Proxier::Bpf(d) => d
                .programmer()
                .maps()
                .lru_census()
                .inspect_err(|e| tracing::warn!("cannot count the reverse-NAT and flow maps: {e}"))
                .ok(),
            _ => None,
        }
    }

    fn packet_stats(&self) -> Option<PacketStats> {
        match self {
            // Every eBPF dataplane: the socket hooks count refusals too.
            Proxier::Bpf(d) => Some(d.programmer().maps().packet_stats()),
            _ => None,
        }
    }

    fn teardown(self) {
        self.shutdown()
    }
}
