//! Map names (as the loader finds them in the object) and their default capacities.
//!
//! Names stay under 16 bytes: the kernel truncates map names to BPF_OBJ_NAME_LEN.

pub const SERVICES4: &str = "FP_SERVICES4";
pub const BACKENDS4: &str = "FP_BACKENDS4";
pub const SOCK_REVNAT4: &str = "FP_SOCK_RNAT4";
pub const SERVICES6: &str = "FP_SERVICES6";
pub const BACKENDS6: &str = "FP_BACKENDS6";
pub const SOCK_REVNAT6: &str = "FP_SOCK_RNAT6";
pub const AFFINITY: &str = "FP_AFFINITY";
/// (backend id, reverse-NAT index) of every backend of a frontend with affinity.
pub const AFFINITY_MATCH: &str = "FP_AFF_MATCH";
pub const CT4: &str = "FP_CT4";
pub const CT6: &str = "FP_CT6";
pub const SOURCE_RANGES4: &str = "FP_SRC_RANGE4";
pub const SOURCE_RANGES6: &str = "FP_SRC_RANGE6";
/// This node's addresses that node ports answer on (address -> 1).
pub const NODE_ADDRS4: &str = "FP_NODE_ADDR4";
pub const NODE_ADDRS6: &str = "FP_NODE_ADDR6";
/// The address SNATed traffic leaves each device with (ifindex -> address).
pub const DEVICE_ADDRS4: &str = "FP_DEV_ADDR4";
pub const DEVICE_ADDRS6: &str = "FP_DEV_ADDR6";
/// The service ranges (`--service-cluster-ip-range`, ServiceCIDRs): LPM tries, network ->
/// 1. A socket call to an address inside them that no frontend serves is refused.
pub const SERVICE_RANGES4: &str = "FP_SVC_RANGE4";
pub const SERVICE_RANGES6: &str = "FP_SVC_RANGE6";
pub const STATS: &str = "FP_STATS";
/// See [`crate::filter`].
pub const FRONT_FILTER: &str = "FP_FRONT_BITS";
pub const REPLY_FILTER: &str = "FP_REPLY_BITS2";
/// Pinned maps of earlier daemons that no program reads any more: removed once this
/// daemon's programs are attached.
pub const RETIRED: [&str; 1] = ["FP_REPLY_BITS"];
pub const NODE_PORTS: &str = "FP_NODE_PORTS";
/// The host ends of the pods' devices the pod path is attached to (ifindex -> 1): where a
/// translated packet may be redirected into a pod's namespace (see `sockcfg::HOST_ROUTING`).
pub const POD_DEVICES: &str = "FP_POD_DEVS";
pub const POD_DEVICES_MAX: u32 = 16_384;
/// Reverse-NAT index -> the frontend's Maglev table (an inner array map; see `maglev`).
pub const MAGLEV: &str = "FP_MAGLEV";
/// One entry: what the socket hooks leave to the pods' devices (see `sockcfg`).
pub const SOCK_CONFIG: &str = "FP_SOCK_CFG";
/// One entry: [`ROUTES_BY_ADDRESS`] where no port steers a route on this node, else 0
/// (see the eBPF crate's `route`). Written by the daemon, which watches the routing rules.
pub const ROUTE_KEYS: &str = "FP_ROUTE_KEYS";
/// [`ROUTE_KEYS`]' value that lets the FIB's answers be remembered per address pair.
pub const ROUTES_BY_ADDRESS: u32 = 1;

/// Service entries: one master plus one per backend slot, for every frontend.
pub const SERVICES_MAX: u32 = 262_144;
pub const BACKENDS_MAX: u32 = 131_072;
/// LRU: old sockets' entries are evicted first.
pub const SOCK_REVNAT_MAX: u32 = 262_144;
/// LRU: clients that have not connected for longest are forgotten first.
pub const AFFINITY_MAX: u32 = 65_536;
/// One entry per backend slot of a frontend with affinity, both families: at most the two
/// service maps' entries. Allocated as used (no preallocation), so the bound costs nothing.
pub const AFFINITY_MATCH_MAX: u32 = 2 * SERVICES_MAX;

/// LRU: two entries per flow from outside the node; the oldest flows go first.
pub const CT_MAX: u32 = 262_144;
pub const SOURCE_RANGES_MAX: u32 = 16_384;
pub const NODE_ADDRS_MAX: u32 = 256;
/// A cluster has a few ServiceCIDRs (one per family, plus the ones added as it grows).
pub const SERVICE_RANGES_MAX: u32 = 256;

/// Every name above, for clean-up and leak checks.
pub const ALL: [&str; 26] = [
    SERVICES4,
    BACKENDS4,
    SOCK_REVNAT4,
    SERVICES6,
    BACKENDS6,
    SOCK_REVNAT6,
    AFFINITY,
    AFFINITY_MATCH,
    CT4,
    CT6,
    SOURCE_RANGES4,
    SOURCE_RANGES6,
    NODE_ADDRS4,
    NODE_ADDRS6,
    DEVICE_ADDRS4,
    DEVICE_ADDRS6,
    SERVICE_RANGES4,
    SERVICE_RANGES6,
    STATS,
    SOCK_CONFIG,
    ROUTE_KEYS,
    MAGLEV,
    POD_DEVICES,
    FRONT_FILTER,
    REPLY_FILTER,
    NODE_PORTS,
];
