//! The service map, after Cilium's `lb4_key`/`lb4_service`.
//!
//! One frontend (address, port, protocol) owns `count + 1` entries: slot 0 is the master entry
//! holding `count` and the service's flags; slots `1..=count` each hold one backend id. The
//! daemon writes backends, then slots, then the master last, so a program that read a count
//! always finds the slots it names.

use bytemuck::{Pod, Zeroable};

/// Key of the IPv4 service map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct Service4Key {
    /// Frontend address, network byte order.
    pub address: u32,
    /// Frontend port, network byte order.
    pub dport: u16,
    /// 0 for the master entry, 1..=count for backend slots.
    pub backend_slot: u16,
    /// IP protocol ([`crate::proto`]).
    pub proto: u8,
    /// [`scope`] of the entry: which traffic it applies to.
    pub scope: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<Service4Key>() == 12);

/// Key of the IPv6 service map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct Service6Key {
    /// Frontend address, network byte order.
    pub address: [u8; 16],
    pub dport: u16,
    pub backend_slot: u16,
    pub proto: u8,
    pub scope: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<Service6Key>() == 24);

/// Value of both service maps. In the master entry (slot 0) `backend_id` is unused and
/// `count`, `rev_nat_index`, `flags` and `affinity_timeout` describe the service; in a backend
/// slot only `backend_id` matters.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct ServiceValue {
    pub backend_id: u32,
    /// Number of backend slots. Zero means the service exists but has no usable endpoint,
    /// and connections to it are refused.
    pub count: u16,
    /// Index into the reverse-NAT map for the packet path; identifies the frontend.
    pub rev_nat_index: u16,
    /// [`flags`] bits.
    pub flags: u16,
    pub _pad: [u8; 2],
    /// ClientIP affinity timeout in seconds; 0 when the service has no affinity.
    pub affinity_timeout: u32,
}
const _: () = assert!(core::mem::size_of::<ServiceValue>() == 16);

/// `Service*Key::scope`: which hook reads the entry. A service may look different from the
/// node's own sockets (internalTrafficPolicy, ClusterIPs) than from packets arriving from
/// outside (externalTrafficPolicy, node ports, external and load-balancer IPs), as in
/// Cilium's two-scope services.
pub mod scope {
    /// Read by the socket hooks: connections made on this node.
    pub const SOCKET: u8 = 0;
    /// Read by the packet hooks (tc, XDP) on the node's devices: traffic from elsewhere.
    /// A node port's entry has address 0 and matches any address of the node.
    pub const PACKET: u8 = 1;
}

/// `ServiceValue::flags`.
pub mod flags {
    /// ClientIP session affinity is on.
    pub const AFFINITY: u16 = 1 << 0;
    /// Packet path: rewrite the source of traffic sent to a backend on another node to this
    /// node's address (externalTrafficPolicy: Cluster), so replies come back through us.
    pub const SNAT: u16 = 1 << 1;
    /// Packet path: only clients in the service's loadBalancerSourceRanges may use it.
    pub const SOURCE_RANGES: u16 = 1 << 2;
    /// Packet path: a new flow takes its backend from the frontend's Maglev table (see
    /// `crate::maglev`), falling back to a uniform pick while the table is missing.
    pub const MAGLEV: u16 = 1 << 3;
    /// Packet path: a flow to a backend on another node is sent there with its source kept
    /// and the frontend in an IP option (IPv4) or destination option (IPv6); the backend's
    /// node answers the client itself (direct server return). Takes the place of [`SNAT`].
    pub const DSR: u16 = 1 << 4;
}

impl Service4Key {
    pub const fn new(address: u32, dport: u16, proto: u8, backend_slot: u16) -> Self {
        Self::scoped(address, dport, proto, backend_slot, scope::SOCKET)
    }

    pub const fn scoped(address: u32, dport: u16, proto: u8, backend_slot: u16, scope: u8) -> Self {
        Self {
            address,
            dport,
            backend_slot,
            proto,
            scope,
            _pad: [0; 2],
        }
    }
}

impl Service6Key {
    pub const fn new(address: [u8; 16], dport: u16, proto: u8, backend_slot: u16) -> Self {
        Self::scoped(address, dport, proto, backend_slot, scope::SOCKET)
    }

    pub const fn scoped(
        address: [u8; 16],
        dport: u16,
        proto: u8,
        backend_slot: u16,
        scope: u8,
    ) -> Self {
        Self {
            address,
            dport,
            backend_slot,
            proto,
            scope,
            _pad: [0; 2],
        }
    }
}

impl ServiceValue {
    pub const fn master(count: u16, rev_nat_index: u16, flags: u16, affinity_timeout: u32) -> Self {
        Self {
            backend_id: 0,
            count,
            rev_nat_index,
            flags,
            _pad: [0; 2],
            affinity_timeout,
        }
    }

    pub const fn slot(backend_id: u32) -> Self {
        Self {
            backend_id,
            count: 0,
            rev_nat_index: 0,
            flags: 0,
            _pad: [0; 2],
            affinity_timeout: 0,
        }
    }
}
