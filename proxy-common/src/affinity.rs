//! ClientIP session affinity for the socket path, after Cilium's `lb_affinity_*` maps.
//!
//! At the socket there is no client IP yet, but every socket of a pod shares its network
//! namespace, so the netns cookie stands for "this client". The entry remembers which
//! backend the client last got for one frontend (its reverse-NAT index) and when.
//!
//! Entries are never deleted when a backend leaves (that would mean walking the whole LRU
//! map): a program honours one only while [`AffinityMatchKey`] (its backend, its frontend)
//! is in the match map, which the daemon keeps equal to the backend sets of the frontends
//! with affinity. Stale entries are ignored, then rewritten or evicted.

use bytemuck::{Pod, Zeroable};

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct AffinityKey {
    /// Network namespace cookie of the client socket.
    pub client: u64,
    /// The frontend, by its reverse-NAT index.
    pub rev_nat_index: u16,
    pub _pad: [u8; 6],
}
const _: () = assert!(core::mem::size_of::<AffinityKey>() == 16);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct AffinityValue {
    pub backend_id: u32,
    pub _pad: u32,
    /// bpf_ktime_get_ns() of the last connection that used this entry.
    pub last_used_ns: u64,
}
const _: () = assert!(core::mem::size_of::<AffinityValue>() == 16);

/// A backend of a frontend with ClientIP affinity; the value is a `u8` that says nothing.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct AffinityMatchKey {
    pub backend_id: u32,
    /// The frontend, by its reverse-NAT index.
    pub rev_nat_index: u16,
    pub _pad: u16,
}
const _: () = assert!(core::mem::size_of::<AffinityMatchKey>() == 8);

impl AffinityMatchKey {
    pub const fn new(backend_id: u32, rev_nat_index: u16) -> Self {
        Self {
            backend_id,
            rev_nat_index,
            _pad: 0,
        }
    }
}
