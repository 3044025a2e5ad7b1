//! The maps. Layout and capacities come from `proxy-common`; the daemon may resize them at
//! load time.

use aya_ebpf::{
    macros::map,
    maps::{HashMap, LruHashMap},
};
use proxy_common::{
    AffinityKey, AffinityValue, Backend4, Backend6, BackendId, Service4Key, Service6Key, ServiceValue, SockRevNat4Key,
    SockRevNat4Value, SockRevNat6Key, SockRevNat6Value,
    maps::{AFFINITY_MAX, BACKENDS_MAX, SERVICES_MAX, SOCK_REVNAT_MAX},
};

#[map(name = "FP_SERVICES4")]
pub static SERVICES4: HashMap<Service4Key, ServiceValue> =
    HashMap::with_max_entries(SERVICES_MAX, 0);

#[map(name = "FP_BACKENDS4")]
pub static BACKENDS4: HashMap<BackendId, Backend4> = HashMap::with_max_entries(BACKENDS_MAX, 0);

#[map(name = "FP_SOCK_RNAT4")]
pub static SOCK_REVNAT4: LruHashMap<SockRevNat4Key, SockRevNat4Value> =
    LruHashMap::with_max_entries(SOCK_REVNAT_MAX, 0);

#[map(name = "FP_SERVICES6")]
pub static SERVICES6: HashMap<Service6Key, ServiceValue> =
    HashMap::with_max_entries(SERVICES_MAX, 0);

#[map(name = "FP_BACKENDS6")]
pub static BACKENDS6: HashMap<BackendId, Backend6> = HashMap::with_max_entries(BACKENDS_MAX, 0);

#[map(name = "FP_SOCK_RNAT6")]
pub static SOCK_REVNAT6: LruHashMap<SockRevNat6Key, SockRevNat6Value> =
    LruHashMap::with_max_entries(SOCK_REVNAT_MAX, 0);

/// Shared by both families: the key is the client's netns and the frontend's index.
#[map(name = "FP_AFFINITY")]
pub static AFFINITY: LruHashMap<AffinityKey, AffinityValue> =
    LruHashMap::with_max_entries(AFFINITY_MAX, 0);
