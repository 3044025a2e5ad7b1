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

/// Service entries: one master plus one per backend slot, for every frontend.
pub const SERVICES_MAX: u32 = 262_144;
pub const BACKENDS_MAX: u32 = 131_072;
/// LRU: old sockets' entries are evicted first.
pub const SOCK_REVNAT_MAX: u32 = 262_144;
/// LRU: clients that have not connected for longest are forgotten first.
pub const AFFINITY_MAX: u32 = 65_536;

/// Every name above, for clean-up and leak checks.
pub const ALL: [&str; 7] =
    [SERVICES4, BACKENDS4, SOCK_REVNAT4, SERVICES6, BACKENDS6, SOCK_REVNAT6, AFFINITY];
