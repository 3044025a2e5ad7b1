//! The eBPF dataplane: socket-level load balancing through cgroup `sock_addr` programs.
//!
//! - [`loader`]: loads the embedded object and attaches the programs to a cgroup v2 and,
//!   for node ports and external addresses, to the node's devices.
//! - [`devices`]: which devices those are, and the node's addresses.
//! - [`filter_seed`]: the packet path's filters filled from pinned maps made without them.
//! - [`flow_gc`]: the flow table's collector (idle flows, and room for new ones).
//! - [`maps`]: typed access to the service, backend and reverse-NAT maps, written in the
//!   order that keeps every lookup consistent.
//! - [`program`]: what is programmed now, and the diff that brings it to the model.
//! - [`pods`]: per-packet Service translation on the pods' devices, which come and go.
//! - [`host_stack`]: `--bpf-host-routing auto`, host routing while the host's netfilter
//!   does nothing to forwarded traffic.
//! - [`route_keys`]: whether ports steer routes here, which says how the packet path
//!   may remember the FIB's answers.
//! - [`stale_sockets`]: connected UDP sockets of removed backends, destroyed so clients
//!   reconnect instead of sending into the void.

pub mod devices;
mod filter_seed;
pub mod flow_gc;
pub mod host_stack;
pub mod lb;
pub mod loader;
pub mod maglev;
pub mod maps;
pub mod pods;
pub mod program;
pub mod repoint;
pub mod route_keys;
pub mod stale_sockets;

use std::path::{Path, PathBuf};

pub use devices::PacketPathConfig;
pub use loader::LoadError;
pub use pods::PodPathConfig;

use self::{loader::Attached, maps::ServiceMaps, program::Programmer};
use super::{Dataplane, Scope, SyncReport, watcher::Watcher};
use crate::model::{NodeInfo, ProxyState, ServiceRanges};

/// How to load and attach the programs.
#[derive(Clone, Debug, Default)]
pub struct AttachOptions {
    /// Pin maps and links here (a bpffs folder); see [`loader`].
    pub pin_dir: Option<PathBuf>,
    /// Attach the node-port programs to these devices; None: socket load-balancing only.
    pub packet: Option<PacketPathConfig>,
    /// Entries of the service and backend maps (Cilium's `--bpf-lb-map-max`); None: the
    /// built-in sizes. A full map fails the services that do not fit, not the daemon.
    pub lb_map_max: Option<u32>,
    /// Per-packet Service translation on the pods' devices; None: off.
    pub pods: Option<PodPathConfig>,
    /// The packet path's backend choice and forwarding mode.
    pub lb: lb::LbConfig,
    /// Entries of each family's flow table; None: the built-in size (262,144).
    pub ct_max: Option<u32>,
    /// How often the flow table's idle entries are collected (see [`flow_gc`]); None: the
    /// default.
    pub ct_gc_interval: Option<std::time::Duration>,
}

pub struct BpfDataplane {
    programmer: Programmer,
    /// What the packet path was asked to cover, to re-read the node's addresses.
    packet: Option<PacketPathConfig>,
    /// The service ranges the tries hold (`None`: not written yet, or a write failed:
    /// pinned tries may hold a previous daemon's).
    service_ranges: Option<ServiceRanges>,
    // Held for its links: dropping it detaches the programs and frees the maps.
    _attached: Attached,
    /// The flow table's collector, stopped with the dataplane.
    _flow_gc: Watcher,
}

impl BpfDataplane {
    /// Loads and attaches the programs to the cgroup v2 at `cgroup`. Every socket created by
    /// a process in that cgroup or below it is load-balanced from then on.
    pub fn attach(cgroup: &Path) -> Result<Self, LoadError> {
        Self::attach_pinned(cgroup, None)
    }

    /// As [`attach`](Self::attach), pinning maps and links under `pin_dir` when given (see
    /// [`loader`]): what a previous daemon programmed there is adopted and reconciled by the
    /// first full sync, and on exit everything stays for the next one.
    pub fn attach_pinned(cgroup: &Path, pin_dir: Option<&Path>) -> Result<Self, LoadError> {
        Self::attach_with(
            cgroup,
            &AttachOptions {
                pin_dir: pin_dir.map(Path::to_path_buf),
                ..Default::default()
            },
        )
    }

    /// Loads and attaches as `opts` say: pinned, with the node-port programs on the node's
    /// devices (so node ports, external IPs and load-balancer IPs work for traffic from other
    /// hosts), with other map sizes.
    pub fn attach_with(cgroup: &Path, opts: &AttachOptions) -> Result<Self, LoadError> {
        let mut attached = loader::load_and_attach(cgroup, opts)?;
        let maps = ServiceMaps::take(attached.ebpf_mut())?;
        let mut programmer = Programmer::new(maps, Some(cgroup.to_path_buf()));
        programmer.set_lb(opts.lb);
        if let Some(devices) = &attached.node_devices {
            programmer
                .maps_mut()
                .set_node_addresses(&devices.node_port_addrs, &devices.snat_addresses())
                .map_err(|source| LoadError::Map {
                    name: proxy_common::maps::NODE_ADDRS4,
                    source,
                })?;
            programmer.enable_packet_path();
            tracing::info!(
                devices = ?devices.devices.iter().map(|d| &d.name).collect::<Vec<_>>(),
                xdp = ?devices.devices.iter().filter(|d| d.xdp).map(|d| &d.name).collect::<Vec<_>>(),
                node_port_addresses = ?devices.node_port_addrs,
                "node-port programs attached"
            );
        }
        let flow_tables = (programmer.maps().flow_tables()).map_err(|source| LoadError::Map {
            name: proxy_common::maps::CT4,
            source,
        })?;
        if flow_tables.inherited_lru() {
            tracing::info!(
                "the flow table is an LRU map pinned by an earlier version, kept so that its \
                 flows go on; `fastpath --cleanup` (or a reboot) lets the next start make the \
                 faster hash table"
            );
        }
        let flow_gc = flow_tables
            .spawn(opts.ct_gc_interval.unwrap_or(flow_gc::DEFAULT_INTERVAL))
            .map_err(|e| LoadError::Map {
                name: proxy_common::maps::CT4,
                source: aya::maps::MapError::IoError(e),
            })?;
        if opts.pin_dir.is_some() {
            let adopted = programmer.adopt_existing();
            if adopted > 0 {
                tracing::info!(
                    frontends = adopted,
                    "adopted frontends a previous daemon programmed"
                );
            }
        }
        Ok(Self {
            programmer,
            packet: opts.packet.clone(),
            service_ranges: None,
            _attached: attached,
            _flow_gc: flow_gc,
        })
    }

    pub fn programmer(&self) -> &Programmer {
        &self.programmer
    }

    /// Node addresses come and go (DHCP, a second address): every full sync re-reads them,
    /// so node ports answer on the addresses the node has now.
    fn refresh_addresses(&mut self) {
        let (Some(cfg), Some(current)) = (&self.packet, self._attached.node_devices.as_mut())
        else {
            return;
        };
        let fresh = match devices::NodeDevices::read(cfg) {
            Ok(fresh) => fresh,
            Err(e) => return tracing::warn!("cannot re-read the node's addresses: {e}"),
        };
        let snat: Vec<_> = current
            .devices
            .iter()
            .map(|d| {
                fresh
                    .devices
                    .iter()
                    .find(|f| f.name == d.name)
                    .map_or((None, None), |f| (f.ipv4, f.ipv6))
            })
            .collect();
        let unchanged = fresh.node_port_addrs == current.node_port_addrs
            && current
                .devices
                .iter()
                .zip(&snat)
                .all(|(d, a)| (d.ipv4, d.ipv6) == *a);
        if unchanged {
            return;
        }
        for (d, (v4, v6)) in current.devices.iter_mut().zip(snat) {
            (d.ipv4, d.ipv6) = (v4, v6);
        }
        current.node_port_addrs = fresh.node_port_addrs;
        match self
            .programmer
            .maps_mut()
            .set_node_addresses(&current.node_port_addrs, &current.snat_addresses())
        {
            Ok(()) => {
                tracing::info!(node_port_addresses = ?current.node_port_addrs, "the node's addresses changed")
            }
            Err(e) => tracing::warn!("cannot update the node's addresses: {e}"),
        }
    }

    /// Before the services of the same sync: a new range's held addresses are written in
    /// this sync too, so at worst an address is refused a moment before its service exists.
    fn write_service_ranges(&mut self, ranges: &ServiceRanges) {
        match self
            .programmer
            .maps_mut()
            .set_service_ranges(ranges.cidrs())
        {
            Ok(()) => {
                tracing::info!(ranges = ?ranges.cidrs(), "service ranges programmed");
                self.service_ranges = Some(ranges.clone());
            }
            Err(e) => {
                tracing::error!("cannot program the service ranges: {e}; retried at the next sync");
                self.service_ranges = None;
            }
        }
    }

    /// The watcher of the pods' devices, when per-packet translation for pods is on.
    pub fn pod_devices(&self) -> Option<&pods::PodDevices> {
        self._attached.pod_devices.as_ref()
    }

    /// The devices the node-port programs are attached to, if they are.
    pub fn node_devices(&self) -> Option<&devices::NodeDevices> {
        self._attached.node_devices.as_ref()
    }
}

impl Dataplane for BpfDataplane {
    fn name(&self) -> &'static str {
        "ebpf"
    }

    fn sync(&mut self, state: &ProxyState, node: &NodeInfo, scope: Scope<'_>) -> SyncReport {
        if matches!(scope, Scope::Full) {
            self.refresh_addresses();
        }
        if self.service_ranges.as_ref() != Some(&state.service_ranges) {
            self.write_service_ranges(&state.service_ranges);
        }
        self.programmer.sync(state, node, scope)
    }
}
