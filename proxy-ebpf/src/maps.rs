//! The maps. Layout and capacities come from `proxy-common`; the daemon may resize them at
//! load time.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{self, HashOfMaps},
    macros::{btf_map, map},
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
};
use bytemuck::Pod;
use proxy_common::{
    Addr6, AffinityKey, AffinityMatchKey, AffinityValue, Backend4, Backend6, BackendId, Ct4Key,
    Ct4Value, Ct6Key, Ct6Value, Service4Key, Service6Key, ServiceValue, SockConfig, SockRevNat4Key,
    SockRevNat4Value, SockRevNat6Key, SockRevNat6Value, SourceRange4, SourceRange6, filter,
    maglev::{Chunk, TABLES_MAX},
    maps::{
        AFFINITY_MATCH_MAX, AFFINITY_MAX, BACKENDS_MAX, CT_MAX, NODE_ADDRS_MAX, POD_DEVICES_MAX,
        SERVICE_RANGES_MAX, SERVICES_MAX, SOCK_REVNAT_MAX, SOURCE_RANGES_MAX,
    },
    nat::stat,
};

use crate::flow::{ROUTE_SLOTS, Route, Scratch};

// The service and backend maps are written by the daemon only, and allocate an entry when
// it is written (Cilium's default, `--preallocate-bpf-maps=false`): preallocated, they cost
// their full `--bpf-lb-map-max` size in the memory cgroup however few Services there are,
// and zeroing it (~0.8 GB at 2^21 entries) took a CPU-second from the first lists.
#[map(name = "FP_SERVICES4")]
pub static SERVICES4: HashMap<Service4Key, ServiceValue> =
    HashMap::with_max_entries(SERVICES_MAX, BPF_F_NO_PREALLOC);

#[map(name = "FP_BACKENDS4")]
pub static BACKENDS4: HashMap<BackendId, Backend4> =
    HashMap::with_max_entries(BACKENDS_MAX, BPF_F_NO_PREALLOC);

#[map(name = "FP_SOCK_RNAT4")]
pub static SOCK_REVNAT4: LruHashMap<SockRevNat4Key, SockRevNat4Value> =
    LruHashMap::with_max_entries(SOCK_REVNAT_MAX, 0);

#[map(name = "FP_SERVICES6")]
pub static SERVICES6: HashMap<Service6Key, ServiceValue> =
    HashMap::with_max_entries(SERVICES_MAX, BPF_F_NO_PREALLOC);

#[map(name = "FP_BACKENDS6")]
pub static BACKENDS6: HashMap<BackendId, Backend6> =
    HashMap::with_max_entries(BACKENDS_MAX, BPF_F_NO_PREALLOC);

#[map(name = "FP_SOCK_RNAT6")]
pub static SOCK_REVNAT6: LruHashMap<SockRevNat6Key, SockRevNat6Value> =
    LruHashMap::with_max_entries(SOCK_REVNAT_MAX, 0);

/// Shared by both families: the key is the client's netns and the frontend's index.
#[map(name = "FP_AFFINITY")]
pub static AFFINITY: LruHashMap<AffinityKey, AffinityValue> =
    LruHashMap::with_max_entries(AFFINITY_MAX, 0);

/// Which (backend, frontend) pairs an affinity entry may still name; written by the daemon
/// only (see `proxy_common::affinity`).
#[map(name = "FP_AFF_MATCH")]
pub static AFFINITY_MATCH: HashMap<AffinityMatchKey, u8> =
    HashMap::with_max_entries(AFFINITY_MATCH_MAX, BPF_F_NO_PREALLOC);

/// The packet path's flows: forward and reply entries (see `proxy_common::nat`).
///
/// A plain, preallocated hash map, not an LRU one: a new flow takes an element from a
/// per-CPU free list, where an LRU map now and then refills that list and rotates its lists
/// under a global lock, touching cold entries, which made a connection's program time
/// vary from 3.3 to 6.0 us between runs of the node-port bench (3.4 to 3.6 us without it;
/// docs/benchmarks.md). Entries go when the daemon's collector finds them expired, or when
/// it evicts the oldest of a table near full; a new flow that finds the table full is
/// dropped and counted (`stat::DROP_FLOW_TABLE_FULL`), and its client's retry finds room
/// once the collector has run (see `flow_gc` in the daemon).
#[map(name = "FP_CT4")]
pub static CT4: HashMap<Ct4Key, Ct4Value> = HashMap::with_max_entries(CT_MAX, 0);

#[map(name = "FP_CT6")]
pub static CT6: HashMap<Ct6Key, Ct6Value> = HashMap::with_max_entries(CT_MAX, 0);

/// loadBalancerSourceRanges per frontend (aya adds the BPF_F_NO_PREALLOC tries need).
#[map(name = "FP_SRC_RANGE4")]
pub static SOURCE_RANGES4: LpmTrie<SourceRange4, u8> =
    LpmTrie::with_max_entries(SOURCE_RANGES_MAX, 0);

#[map(name = "FP_SRC_RANGE6")]
pub static SOURCE_RANGES6: LpmTrie<SourceRange6, u8> =
    LpmTrie::with_max_entries(SOURCE_RANGES_MAX, 0);

/// The service ranges, network -> 1 (see `proxy_common::maps::SERVICE_RANGES4`).
#[map(name = "FP_SVC_RANGE4")]
pub static SERVICE_RANGES4: LpmTrie<u32, u8> = LpmTrie::with_max_entries(SERVICE_RANGES_MAX, 0);

#[map(name = "FP_SVC_RANGE6")]
pub static SERVICE_RANGES6: LpmTrie<Addr6, u8> = LpmTrie::with_max_entries(SERVICE_RANGES_MAX, 0);

#[map(name = "FP_NODE_ADDR4")]
pub static NODE_ADDRS4: HashMap<u32, u32> = HashMap::with_max_entries(NODE_ADDRS_MAX, 0);

#[map(name = "FP_NODE_ADDR6")]
pub static NODE_ADDRS6: HashMap<Addr6, u32> = HashMap::with_max_entries(NODE_ADDRS_MAX, 0);

/// Device (ifindex) -> the address SNATed traffic leaves it with.
#[map(name = "FP_DEV_ADDR4")]
pub static DEVICE_ADDRS4: HashMap<u32, u32> = HashMap::with_max_entries(NODE_ADDRS_MAX, 0);

#[map(name = "FP_DEV_ADDR6")]
pub static DEVICE_ADDRS6: HashMap<u32, Addr6> = HashMap::with_max_entries(NODE_ADDRS_MAX, 0);

/// The pods' devices the pod path is attached to (see `proxy_common::maps::POD_DEVICES`).
#[map(name = "FP_POD_DEVS")]
pub static POD_DEVICES: HashMap<u32, u32> = HashMap::with_max_entries(POD_DEVICES_MAX, 0);

/// What the socket hooks leave to the pods' devices; written by the daemon at start.
#[map(name = "FP_SOCK_CFG")]
pub static SOCK_CONFIG: Array<SockConfig> = Array::with_max_entries(1, 0);

/// Whether the FIB's answers may be keyed by addresses alone (see `route`); written by the
/// daemon.
#[map(name = "FP_ROUTE_KEYS")]
pub static ROUTE_KEYS: Array<u32> = Array::with_max_entries(1, 0);

/// Per CPU, what one packet's translation works on (see `flow::Scratch`); not shared
/// with the daemon.
#[map(name = "FP_SCRATCH4")]
pub static SCRATCH4: PerCpuArray<Scratch<u32>> = PerCpuArray::with_max_entries(1, 0);

#[map(name = "FP_SCRATCH6")]
pub static SCRATCH6: PerCpuArray<Scratch<Addr6>> = PerCpuArray::with_max_entries(1, 0);

/// Per CPU, the head of the packet being translated, as `rewrite` builds it before its one
/// store (see `ip::Ip::Head`); a map's rather than the stack's, which the redirecting
/// paths have no room on. Not shared with the daemon.
#[map(name = "FP_HEAD4")]
pub static HEAD4: PerCpuArray<[u16; 19]> = PerCpuArray::with_max_entries(1, 0);

#[map(name = "FP_HEAD6")]
pub static HEAD6: PerCpuArray<[u16; 29]> = PerCpuArray::with_max_entries(1, 0);

/// Per CPU, the FIB's recent answers for flows the packet path sends on itself (see
/// `route`); not shared with the daemon.
#[map(name = "FP_ROUTES4")]
pub static ROUTES4: PerCpuArray<Route<u32>> = PerCpuArray::with_max_entries(ROUTE_SLOTS, 0);

#[map(name = "FP_ROUTES6")]
pub static ROUTES6: PerCpuArray<Route<Addr6>> = PerCpuArray::with_max_entries(ROUTE_SLOTS, 0);

/// BPF_F_INNER_MAP: inner maps of any size fit the outer map's slot, so a table's size is
/// the daemon's to choose (`--bpf-lb-maglev-table-size`).
const BPF_F_INNER_MAP: usize = 1 << 12;

/// Reverse-NAT index -> the frontend's Maglev table, written by the daemon only (see
/// `proxy_common::maglev`). The inner map here is a template: the daemon makes each
/// table's array with as many elements as its size needs.
#[btf_map(name = "FP_MAGLEV")]
pub static MAGLEV: HashOfMaps<
    u32,
    btf_maps::Array<Chunk, 1, BPF_F_INNER_MAP>,
    { TABLES_MAX as usize },
> = HashOfMaps::new();

/// See `proxy_common::filter`: the daemon keeps the frontends' filter, the programs the
/// replies'.
#[map(name = "FP_FRONT_BITS")]
pub static FRONT_FILTER: Array<filter::Entry> = Array::with_max_entries(filter::ENTRIES, 0);

#[map(name = "FP_REPLY_BITS2")]
pub static REPLY_FILTER: Array<filter::Entry> = Array::with_max_entries(filter::ENTRIES, 0);

#[map(name = "FP_NODE_PORTS")]
pub static NODE_PORTS: Array<filter::Entry> = Array::with_max_entries(filter::PORT_ENTRIES, 0);

#[map(name = "FP_STATS")]
pub static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(stat::COUNT, 0);

/// A lookup that hands out a copy of the value, never a reference into the map: the daemon
/// and other CPUs change these maps while a program runs.
pub trait Lookup<K, V> {
    fn lookup(&self, key: K) -> Option<V>;
}

macro_rules! copying_lookup {
    ($($map:ident),*) => {
        $(
            impl<K, V: Pod> Lookup<K, V> for $map<K, V> {
                #[inline(always)]
                fn lookup(&self, key: K) -> Option<V> {
                    // SAFETY: a non-null pointer from bpf_map_lookup_elem points at a value
                    // of this map's value size (the map is declared with `V`), 8-aligned,
                    // that stays allocated while the program runs: the program holds the
                    // map, preallocated elements are only ever recycled within it, and the
                    // others are freed after an RCU grace period, which a running program
                    // holds off. A concurrent delete and insert may rewrite the bytes as we
                    // read them; `V: Pod` makes any bytes a valid `V`, and copying them
                    // once, here, means no caller sees a value change under it.
                    self.get_ptr(key).map(|p| unsafe { p.read() })
                }
            }
        )*
    };
}

copying_lookup!(HashMap, LruHashMap);

#[inline(always)]
pub fn count(which: u32) {
    if let Some(c) = STATS.get_ptr_mut(which) {
        // SAFETY: a non-null pointer is this CPU's u64 slot of an index the kernel checked.
        // Only programs on this CPU write it, and they run one at a time unless one
        // interrupts another (then an increment may be lost, which a counter tolerates);
        // any bits are a valid u64.
        unsafe { *c += 1 };
    }
}
