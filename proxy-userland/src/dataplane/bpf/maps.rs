//! Typed handles on the maps, and the byte-order conversions between the model and them.
//!
//! Everything the maps hold is in network byte order (see `proxy-common`), so conversions
//! live here and nowhere else.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use aya::{
    Ebpf,
    maps::{
        Array, HashMap, HashOfMaps, IterableMap, Map, MapData, MapError, PerCpuArray,
        lpm_trie::{Key as LpmKey, LpmTrie},
    },
};
use proxy_common::{
    Addr6, AffinityKey, AffinityMatchKey, AffinityValue, Backend4, Backend6, BackendId, Ct4Key,
    Ct4Value, Ct6Key, Ct6Value, CtKey, CtValue, Service4Key, Service6Key, ServiceValue,
    SockRevNat4Key, SockRevNat4Value, SockRevNat6Key, SockRevNat6Value, SourceRange, SourceRange4,
    SourceRange6,
    backend::flags as backend_flags,
    maglev::Chunk,
    maps as names,
    nat::{self, addr6, octets6},
    service::scope,
};

use super::loader::LoadError;
use crate::{
    dataplane::frontends::{BackendAddr, Frontend, FrontendScope},
    model::Protocol,
};

pub(crate) mod batch;
mod census;
mod deferred;
mod filter;
mod maglev;
mod ranges;

pub use census::{CENSUS_PERIOD, CensusThread, LruCensus, LruCounts};
pub use deferred::Writer as DeferredWriter;

/// Handles on both flow tables and the programs' counters, of the flow-table collector's
/// own (see [`flow_gc`](super::flow_gc), which sweeps with them).
pub struct FlowTables {
    pub ct4: HashMap<MapData, Ct4Key, Ct4Value>,
    pub ct6: HashMap<MapData, Ct6Key, Ct6Value>,
    pub stats: PerCpuArray<MapData, u64>,
}

pub struct ServiceMaps {
    services4: HashMap<MapData, Service4Key, ServiceValue>,
    backends4: HashMap<MapData, BackendId, Backend4>,
    services6: HashMap<MapData, Service6Key, ServiceValue>,
    backends6: HashMap<MapData, BackendId, Backend6>,
    // Written by the programs only; the daemon reads them for occupancy and tests.
    sock_revnat4: HashMap<MapData, SockRevNat4Key, SockRevNat4Value>,
    sock_revnat6: HashMap<MapData, SockRevNat6Key, SockRevNat6Value>,
    // Written by the programs, which honour an entry only while the match map (written by
    // the daemon) holds its backend for its frontend; see `proxy_common::affinity`.
    affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    affinity_match: HashMap<MapData, AffinityMatchKey, u8>,
    // The packet path: flows (written by the programs), source ranges, node and device
    // addresses, and the programs' counters.
    ct4: HashMap<MapData, Ct4Key, Ct4Value>,
    ct6: HashMap<MapData, Ct6Key, Ct6Value>,
    source_ranges4: LpmTrie<MapData, SourceRange4, u8>,
    source_ranges6: LpmTrie<MapData, SourceRange6, u8>,
    node_addrs4: HashMap<MapData, u32, u32>,
    node_addrs6: HashMap<MapData, Addr6, u32>,
    device_addrs4: HashMap<MapData, u32, u32>,
    device_addrs6: HashMap<MapData, u32, Addr6>,
    // The service ranges (see `ranges`).
    service_ranges4: LpmTrie<MapData, u32, u8>,
    service_ranges6: LpmTrie<MapData, Addr6, u8>,
    stats: PerCpuArray<MapData, u64>,
    /// Reverse-NAT index -> Maglev table (see `maglev`).
    maglev: HashOfMaps<MapData, u32, Array<MapData, Chunk>>,
    /// Backends both backend maps hold at most, as the kernel sized them (--bpf-lb-map-max,
    /// the default, or a pinned map's own size).
    backend_capacity: u32,
    /// While a first sync's writes trail behind it (see [`deferred`]): where they go.
    deferred: Option<deferred::Queue>,
    /// The addresses and node ports the packet programs look up at all (see
    /// `proxy_common::filter`).
    front_filter: filter::FrontFilter,
}

/// An address as the maps hold it (network byte order): `u32` or `[u8; 16]`.
pub trait MapAddr: Copy + Default + PartialEq + aya::Pod {
    fn ip(self) -> IpAddr;
}

impl MapAddr for u32 {
    fn ip(self) -> IpAddr {
        Ipv4Addr::from(self.to_ne_bytes()).into()
    }
}

impl MapAddr for Addr6 {
    fn ip(self) -> IpAddr {
        Ipv6Addr::from(octets6(self)).into()
    }
}

/// `addr:port` of a map entry.
pub fn socket_addr<A: MapAddr>(addr: A, port: u16) -> SocketAddr {
    SocketAddr::new(addr.ip(), u16::from_be(port))
}

/// The forward entries (one per flow) of a flow table.
pub fn forward_entries<A: MapAddr>(
    ct: &HashMap<MapData, CtKey<A>, CtValue<A>>,
) -> impl Iterator<Item = (CtKey<A>, CtValue<A>)> + '_
where
    CtKey<A>: aya::Pod,
    CtValue<A>: aya::Pod,
{
    ct.iter()
        .filter_map(Result::ok)
        .filter(|(k, _)| k.dir == nat::dir::FORWARD)
}

/// One flow of the packet path, as its forward entry records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PacketFlow {
    pub client: SocketAddr,
    pub frontend: SocketAddr,
    pub backend: SocketAddr,
    /// The source the backend sees, when it is not the client's.
    pub snat: Option<SocketAddr>,
    /// The client sent FIN or RST: the flow's entries (and SNAT port) go soon.
    pub closing: bool,
}

/// What the packet programs counted, summed over CPUs (see `proxy_common::nat::stat`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PacketStats {
    pub new_flows: u64,
    pub translated: u64,
    pub dropped_no_backend: u64,
    pub dropped_source_range: u64,
    pub dropped_nat: u64,
    /// Packets XDP translated ahead of tc.
    pub xdp: u64,
    /// ICMP errors about translated flows, translated back.
    pub icmp_translated: u64,
    /// ICMP errors translated back that could not be sent on.
    pub icmp_dropped: u64,
    /// Socket calls refused: inside a service range, and no frontend serves the address.
    pub refused_service_range: u64,
    /// New flows dropped because the flow table was full.
    pub dropped_flow_table_full: u64,
}

fn take<K: aya::Pod, V: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &'static str,
) -> Result<HashMap<MapData, K, V>, LoadError> {
    let map = ebpf.take_map(name).ok_or(LoadError::MissingMap { name })?;
    HashMap::try_from(map).map_err(|source| LoadError::Map { name, source })
}

/// The size the kernel gave map `name`.
fn max_entries<V: aya::Pod>(
    map: &impl IterableMap<BackendId, V>,
    name: &'static str,
) -> Result<u32, LoadError> {
    (map.map().info())
        .map(|info| info.max_entries())
        .map_err(|source| LoadError::Map { name, source })
}

fn take_trie<K: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &'static str,
) -> Result<LpmTrie<MapData, K, u8>, LoadError> {
    let map = ebpf.take_map(name).ok_or(LoadError::MissingMap { name })?;
    LpmTrie::try_from(map).map_err(|source| LoadError::Map { name, source })
}

fn v4(ip: std::net::Ipv4Addr) -> u32 {
    u32::from_ne_bytes(ip.octets())
}

fn backend_flags_of(b: &BackendAddr) -> u8 {
    if b.local { backend_flags::LOCAL } else { 0 }
}

/// `b`, whose address is `ip`, as the v4 backend map holds it.
fn backend4(ip: Ipv4Addr, b: &BackendAddr) -> Backend4 {
    Backend4 {
        address: v4(ip),
        port: b.port.to_be(),
        proto: b.proto.number(),
        flags: backend_flags_of(b),
    }
}

/// `b`, whose address is `ip`, as the v6 backend map holds it.
fn backend6(ip: Ipv6Addr, b: &BackendAddr) -> Backend6 {
    Backend6 {
        address: ip.octets(),
        port: b.port.to_be(),
        proto: b.proto.number(),
        flags: backend_flags_of(b),
    }
}

fn scope_of(s: FrontendScope) -> u8 {
    match s {
        FrontendScope::Socket => scope::SOCKET,
        FrontendScope::Packet => scope::PACKET,
    }
}

fn key4(fe: &Frontend, ip: std::net::Ipv4Addr, slot: u16) -> Service4Key {
    Service4Key::scoped(
        v4(ip),
        fe.port.to_be(),
        fe.proto.number(),
        slot,
        scope_of(fe.scope),
    )
}

fn key6(fe: &Frontend, ip: std::net::Ipv6Addr, slot: u16) -> Service6Key {
    Service6Key::scoped(
        ip.octets(),
        fe.port.to_be(),
        fe.proto.number(),
        slot,
        scope_of(fe.scope),
    )
}

fn source_range_key<A>(rev_nat_index: u16, addr: A, len: u8, bits: u8) -> LpmKey<SourceRange<A>>
where
    SourceRange<A>: aya::Pod,
{
    let data = SourceRange {
        rev_nat_index,
        _pad: 0,
        addr,
    };
    LpmKey::new(
        nat::SOURCE_RANGE_PREFIX_BITS + u32::from(len.min(bits)),
        data,
    )
}

impl ServiceMaps {
    pub fn take(ebpf: &mut Ebpf) -> Result<Self, LoadError> {
        let backends4 = take(ebpf, names::BACKENDS4)?;
        let backends6 = take(ebpf, names::BACKENDS6)?;
        let backend_capacity = max_entries(&backends4, names::BACKENDS4)?
            .saturating_add(max_entries(&backends6, names::BACKENDS6)?);
        Ok(Self {
            deferred: None,
            front_filter: filter::FrontFilter::take(ebpf)?,
            backend_capacity,
            backends4,
            backends6,
            services4: take(ebpf, names::SERVICES4)?,
            services6: take(ebpf, names::SERVICES6)?,
            sock_revnat4: take(ebpf, names::SOCK_REVNAT4)?,
            sock_revnat6: take(ebpf, names::SOCK_REVNAT6)?,
            affinity: take(ebpf, names::AFFINITY)?,
            affinity_match: take(ebpf, names::AFFINITY_MATCH)?,
            ct4: take(ebpf, names::CT4)?,
            ct6: take(ebpf, names::CT6)?,
            source_ranges4: take_trie(ebpf, names::SOURCE_RANGES4)?,
            source_ranges6: take_trie(ebpf, names::SOURCE_RANGES6)?,
            node_addrs4: take(ebpf, names::NODE_ADDRS4)?,
            node_addrs6: take(ebpf, names::NODE_ADDRS6)?,
            device_addrs4: take(ebpf, names::DEVICE_ADDRS4)?,
            device_addrs6: take(ebpf, names::DEVICE_ADDRS6)?,
            service_ranges4: take_trie(ebpf, names::SERVICE_RANGES4)?,
            service_ranges6: take_trie(ebpf, names::SERVICE_RANGES6)?,
            maglev: {
                let name = names::MAGLEV;
                let map = ebpf.take_map(name).ok_or(LoadError::MissingMap { name })?;
                HashOfMaps::try_from(map).map_err(|source| LoadError::Map { name, source })?
            },
            stats: {
                let name = names::STATS;
                let map = ebpf.take_map(name).ok_or(LoadError::MissingMap { name })?;
                PerCpuArray::try_from(map).map_err(|source| LoadError::Map { name, source })?
            },
        })
    }

    pub fn del_backend(&mut self, id: BackendId, b: &BackendAddr) -> Result<(), MapError> {
        ignore_missing(match b.ip {
            IpAddr::V4(_) => self.backends4.remove(&id),
            IpAddr::V6(_) => self.backends6.remove(&id),
        })
    }

    pub fn put_service(
        &mut self,
        fe: &Frontend,
        slot: u16,
        value: ServiceValue,
    ) -> Result<(), MapError> {
        if slot == 0 {
            self.front_filter.master_put(fe)?;
        }
        if let Some(q) = &mut self.deferred {
            q.service(fe, slot, value);
            return Ok(());
        }
        match fe.ip {
            IpAddr::V4(ip) => self.services4.insert(key4(fe, ip, slot), value, 0),
            IpAddr::V6(ip) => self.services6.insert(key6(fe, ip, slot), value, 0),
        }
    }

    pub fn del_service(&mut self, fe: &Frontend, slot: u16) -> Result<(), MapError> {
        ignore_missing(match fe.ip {
            IpAddr::V4(ip) => self.services4.remove(&key4(fe, ip, slot)),
            IpAddr::V6(ip) => self.services6.remove(&key6(fe, ip, slot)),
        })?;
        if slot == 0 {
            self.front_filter.master_gone(fe);
        }
        Ok(())
    }

    /// After a restart on pinned maps: the filters hold exactly `masters` (what the maps
    /// held, besides what this daemon wrote).
    pub fn adopt_front_filter(
        &mut self,
        masters: impl IntoIterator<Item = Frontend>,
    ) -> Result<(), MapError> {
        self.front_filter.adopt(masters)
    }

    /// The entry the programs would read, for tests and diagnostics.
    pub fn get_service(&self, fe: &Frontend, slot: u16) -> Option<ServiceValue> {
        match fe.ip {
            IpAddr::V4(ip) => self.services4.get(&key4(fe, ip, slot), 0).ok(),
            IpAddr::V6(ip) => self.services6.get(&key6(fe, ip, slot), 0).ok(),
        }
    }

    /// Every service map entry: (frontend, slot, value), both families; for adopting what a
    /// previous daemon programmed into pinned maps.
    pub fn service_entries(&self) -> Vec<(Frontend, u16, ServiceValue)> {
        let v4 = self
            .services4
            .iter()
            .filter_map(Result::ok)
            .filter_map(|(k, v)| {
                let fe = Frontend {
                    ip: IpAddr::V4(std::net::Ipv4Addr::from(k.address.to_ne_bytes())),
                    port: u16::from_be(k.dport),
                    proto: Protocol::from_number(k.proto)?,
                    scope: scope_from(k.scope)?,
                };
                Some((fe, k.backend_slot, v))
            });
        let v6 = self
            .services6
            .iter()
            .filter_map(Result::ok)
            .filter_map(|(k, v)| {
                let fe = Frontend {
                    ip: IpAddr::V6(std::net::Ipv6Addr::from(k.address)),
                    port: u16::from_be(k.dport),
                    proto: Protocol::from_number(k.proto)?,
                    scope: scope_from(k.scope)?,
                };
                Some((fe, k.backend_slot, v))
            });
        v4.chain(v6).collect()
    }

    /// Every backend: (id, where it points).
    pub fn backend_entries(&self) -> Vec<(BackendId, BackendAddr)> {
        let v4 = self
            .backends4
            .iter()
            .filter_map(Result::ok)
            .filter_map(|(id, b)| {
                let ip = IpAddr::V4(std::net::Ipv4Addr::from(b.address.to_ne_bytes()));
                Some((id, backend_addr(ip, b.port, b.proto, b.flags)?))
            });
        let v6 = self
            .backends6
            .iter()
            .filter_map(Result::ok)
            .filter_map(|(id, b)| {
                let ip = IpAddr::V6(std::net::Ipv6Addr::from(b.address));
                Some((id, backend_addr(ip, b.port, b.proto, b.flags)?))
            });
        v4.chain(v6).collect()
    }

    /// The frontend a socket (by cookie) was translated from when our programs pointed it
    /// at `backend`; None if they did not.
    pub fn translated_from(&self, cookie: u64, backend: SocketAddr) -> Option<SocketAddr> {
        let port = backend.port().to_be();
        match backend.ip() {
            IpAddr::V4(ip) => {
                let key = SockRevNat4Key {
                    cookie,
                    address: v4(ip),
                    port,
                    _pad: [0; 2],
                };
                let v = self.sock_revnat4.get(&key, 0).ok()?;
                let fe = std::net::Ipv4Addr::from(v.address.to_ne_bytes());
                Some(SocketAddr::new(IpAddr::V4(fe), u16::from_be(v.port)))
            }
            IpAddr::V6(ip) => {
                let key = SockRevNat6Key {
                    cookie,
                    address: ip.octets(),
                    port,
                    _pad: [0; 6],
                };
                let v = self.sock_revnat6.get(&key, 0).ok()?;
                let fe = std::net::Ipv6Addr::from(v.address);
                Some(SocketAddr::new(IpAddr::V6(fe), u16::from_be(v.port)))
            }
        }
    }

    /// Lets the programs honour affinity entries of frontend `rev_nat_index` that name one
    /// of `ids`. Written before the slots and master that hand these backends out, so a
    /// client's first pick sticks.
    pub fn put_affinity_matches(
        &mut self,
        rev_nat_index: u16,
        ids: &[BackendId],
    ) -> Result<(), MapError> {
        for &id in ids {
            self.affinity_match
                .insert(AffinityMatchKey::new(id, rev_nat_index), 0, 0)?;
        }
        Ok(())
    }

    /// From now on, affinity entries of frontend `rev_nat_index` naming one of `ids` are
    /// ignored: a client must not stick to a backend that left. The entries themselves
    /// stay until a connection rewrites them or the LRU evicts them, so this costs one
    /// bpf() call per backend, never a walk of the affinity map.
    pub fn del_affinity_matches(&mut self, rev_nat_index: u16, ids: &[BackendId]) {
        for &id in ids {
            let _ = self
                .affinity_match
                .remove(&AffinityMatchKey::new(id, rev_nat_index));
        }
    }

    /// Every (backend, frontend) pair affinity entries may name; for adopting pinned maps.
    pub fn affinity_match_entries(&self) -> Vec<AffinityMatchKey> {
        self.affinity_match.keys().filter_map(Result::ok).collect()
    }

    /// Lets `ranges` use the frontend `rev_nat_index` (loadBalancerSourceRanges). Written
    /// before the master entry that turns the check on.
    pub fn put_source_ranges(
        &mut self,
        rev_nat_index: u16,
        ranges: &[(IpAddr, u8)],
    ) -> Result<(), MapError> {
        for &(ip, len) in ranges {
            match ip {
                IpAddr::V4(ip) => self.source_ranges4.insert(
                    &source_range_key(rev_nat_index, v4(ip), len, 32),
                    1,
                    0,
                )?,
                IpAddr::V6(ip) => self.source_ranges6.insert(
                    &source_range_key(rev_nat_index, addr6(ip.octets()), len, 128),
                    1,
                    0,
                )?,
            }
        }
        Ok(())
    }

    pub fn del_source_ranges(&mut self, rev_nat_index: u16, ranges: &[(IpAddr, u8)]) {
        for &(ip, len) in ranges {
            let _ = match ip {
                IpAddr::V4(ip) => {
                    self.source_ranges4
                        .remove(&source_range_key(rev_nat_index, v4(ip), len, 32))
                }
                IpAddr::V6(ip) => self.source_ranges6.remove(&source_range_key(
                    rev_nat_index,
                    addr6(ip.octets()),
                    len,
                    128,
                )),
            };
        }
    }

    /// Every source range: (frontend's reverse-NAT index, network, prefix length); for
    /// adopting pinned maps.
    pub fn source_range_entries(&self) -> Vec<(u16, (IpAddr, u8))> {
        let mut out = range_entries(&self.source_ranges4);
        out.extend(range_entries(&self.source_ranges6));
        out
    }

    /// Makes the node-port addresses exactly `addrs`, and the SNAT addresses of each device
    /// (ifindex) exactly `devices` (one per family at most).
    pub fn set_node_addresses(
        &mut self,
        addrs: &[IpAddr],
        devices: &[(u32, IpAddr)],
    ) -> Result<(), MapError> {
        let (mut nodes4, mut nodes6) = (BTreeMap::new(), BTreeMap::new());
        for a in addrs {
            match a {
                IpAddr::V4(a) => drop(nodes4.insert(v4(*a), 1)),
                IpAddr::V6(a) => drop(nodes6.insert(addr6(a.octets()), 1)),
            }
        }
        let (mut devices4, mut devices6) = (BTreeMap::new(), BTreeMap::new());
        for (i, a) in devices {
            match a {
                IpAddr::V4(a) => drop(devices4.insert(*i, v4(*a))),
                IpAddr::V6(a) => drop(devices6.insert(*i, addr6(a.octets()))),
            }
        }
        replace_all(&mut self.node_addrs4, nodes4)?;
        replace_all(&mut self.node_addrs6, nodes6)?;
        replace_all(&mut self.device_addrs4, devices4)?;
        replace_all(&mut self.device_addrs6, devices6)
    }

    /// Every flow the packet programs track: where it goes and the source it was given.
    pub fn packet_flows(&self) -> Vec<PacketFlow> {
        let mut out = packet_flows(&self.ct4);
        out.extend(packet_flows(&self.ct6));
        out
    }

    /// Handles of their own on the flow tables and the programs' counters, for the
    /// collector's thread.
    pub fn flow_tables(&self) -> Result<FlowTables, MapError> {
        Ok(FlowTables {
            ct4: census::own_handle(&self.ct4)?,
            ct6: census::own_handle(&self.ct6)?,
            stats: PerCpuArray::try_from(Map::from_map_data(census::own_data(self.stats.map())?)?)?,
        })
    }

    /// The packet programs' counters, summed over CPUs.
    pub fn packet_stats(&self) -> PacketStats {
        let get = |i: u32| -> u64 {
            self.stats
                .get(&i, 0)
                .map(|per_cpu| per_cpu.iter().sum())
                .unwrap_or(0)
        };
        PacketStats {
            new_flows: get(nat::stat::NEW_FLOW),
            translated: get(nat::stat::TRANSLATED),
            dropped_no_backend: get(nat::stat::DROP_NO_BACKEND),
            dropped_source_range: get(nat::stat::DROP_SOURCE_RANGE),
            dropped_nat: get(nat::stat::DROP_NAT),
            xdp: get(nat::stat::XDP),
            icmp_translated: get(nat::stat::ICMP_TRANSLATED),
            icmp_dropped: get(nat::stat::ICMP_DROPPED),
            refused_service_range: get(nat::stat::REFUSED_SERVICE_RANGE),
            dropped_flow_table_full: get(nat::stat::DROP_FLOW_TABLE_FULL),
        }
    }

    /// Entries per map, counted by walking every key of every map: for tests and leak
    /// checks only, never per sync (a full reverse-NAT map takes 200-500 ms). The daemon's
    /// metrics use [`Programmer::occupancy`](super::program::Programmer::occupancy) and
    /// [`LruCensus`].
    /// How many backends (both families) the maps hold at most.
    pub fn backend_capacity(&self) -> u32 {
        self.backend_capacity
    }

    pub fn occupancy(&self) -> Occupancy {
        Occupancy {
            services: self.services4.keys().count() + self.services6.keys().count(),
            backends: self.backends4.keys().count() + self.backends6.keys().count(),
            sock_revnat: self.sock_revnat4.keys().count() + self.sock_revnat6.keys().count(),
            affinity: self.affinity.keys().count(),
            affinity_match: self.affinity_match.keys().count(),
            conntrack: self.ct4.keys().count() + self.ct6.keys().count(),
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Occupancy {
    pub services: usize,
    pub backends: usize,
    pub sock_revnat: usize,
    pub affinity: usize,
    /// Backends of frontends with affinity (written by the daemon, exact after every sync).
    pub affinity_match: usize,
    /// Packet-path flow entries (two per flow).
    pub conntrack: usize,
}

fn scope_from(s: u8) -> Option<FrontendScope> {
    match s {
        scope::SOCKET => Some(FrontendScope::Socket),
        scope::PACKET => Some(FrontendScope::Packet),
        _ => None,
    }
}

fn backend_addr(ip: IpAddr, port: u16, proto: u8, flags: u8) -> Option<BackendAddr> {
    Some(BackendAddr {
        ip,
        port: u16::from_be(port),
        proto: Protocol::from_number(proto)?,
        local: flags & backend_flags::LOCAL != 0,
    })
}

fn packet_flows<A: MapAddr>(ct: &HashMap<MapData, CtKey<A>, CtValue<A>>) -> Vec<PacketFlow>
where
    CtKey<A>: aya::Pod,
    CtValue<A>: aya::Pod,
{
    forward_entries(ct)
        .map(|(k, v)| PacketFlow {
            client: socket_addr(k.saddr, k.sport),
            frontend: socket_addr(k.daddr, k.dport),
            backend: socket_addr(v.addr, v.port),
            snat: (v.snat_addr != A::default()).then(|| socket_addr(v.snat_addr, v.snat_port)),
            closing: v.flags & nat::ct_flags::CLOSING != 0,
        })
        .collect()
}

fn range_entries<A: MapAddr>(
    trie: &LpmTrie<MapData, SourceRange<A>, u8>,
) -> Vec<(u16, (IpAddr, u8))>
where
    SourceRange<A>: aya::Pod,
{
    trie.keys()
        .filter_map(Result::ok)
        .filter_map(|k| {
            let len = k.prefix_len().checked_sub(nat::SOURCE_RANGE_PREFIX_BITS)?;
            let d = k.data();
            Some((d.rev_nat_index, (d.addr.ip(), len as u8)))
        })
        .collect()
}

/// Makes `map` hold exactly `want`: writes every entry, then deletes the others.
fn replace_all<K: aya::Pod + Ord, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    want: BTreeMap<K, V>,
) -> Result<(), MapError> {
    for (k, v) in &want {
        map.insert(k, v, 0)?;
    }
    let stale: Vec<K> = map
        .keys()
        .filter_map(Result::ok)
        .filter(|k| !want.contains_key(k))
        .collect();
    for k in stale {
        ignore_missing(map.remove(&k))?;
    }
    Ok(())
}

/// Deleting what is already gone is success: the goal is its absence.
fn ignore_missing(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}
