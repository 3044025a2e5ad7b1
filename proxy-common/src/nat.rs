//! The packet path's NAT state, after Cilium's `ct4`/`snat4` maps and `lb4_src_range`.
//!
//! Traffic from outside the node to a node port, external IP or load-balancer IP is
//! translated per packet by the tc programs on the node's devices. The first packet of a
//! flow picks a backend and records two entries in one LRU map: the *forward* entry (keyed
//! by the tuple as the client sent it) pins the flow to that backend and source port, and
//! the *reply* entry (keyed by the tuple as the backend answers) restores what the client
//! expects to see. Entries age out by LRU and by their `last_seen_ns`.

/// `CtKey::dir`.
pub mod dir {
    /// Client -> frontend, as it arrives at the node.
    pub const FORWARD: u8 = 0;
    /// Backend -> client (or -> our SNAT address), as the backend answers.
    pub const REPLY: u8 = 1;
}

/// An IPv6 address as the packet path's maps hold it: the packet's 16 bytes as four words
/// (word-aligned, so the programs move it in four loads rather than sixteen).
pub type Addr6 = [u32; 4];

/// The bytes of an address in [`Addr6`] form, and back.
pub const fn addr6(b: [u8; 16]) -> Addr6 {
    let mut w = [0u32; 4];
    let mut i = 0;
    while i < 4 {
        w[i] = u32::from_ne_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
        i += 1;
    }
    w
}

pub const fn octets6(w: Addr6) -> [u8; 16] {
    let mut b = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        b[i] = w[i / 4].to_ne_bytes()[i % 4];
        i += 1;
    }
    b
}

/// Key of the flow maps. `A` is the address as in the packet: `u32` for IPv4 (`FP_CT4`),
/// [`Addr6`] for IPv6 (`FP_CT6`); one layout, so the programs are written once for both.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtKey<A> {
    pub saddr: A,
    pub daddr: A,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub dir: u8,
    pub _pad: [u8; 2],
}
pub type Ct4Key = CtKey<u32>;
pub type Ct6Key = CtKey<Addr6>;
const _: () = assert!(core::mem::size_of::<Ct4Key>() == 16);
const _: () = assert!(core::mem::size_of::<Ct6Key>() == 40);

/// A forward entry says where the flow goes: `addr:port` is the backend, `snat_addr:snat_port`
/// the source we give it (0: the client's own). A reply entry says what the client sees:
/// `addr:port` is the frontend the reply must come from and `snat_addr:snat_port` the
/// client to send it back to (0: the destination is already the client).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtValue<A> {
    pub addr: A,
    pub port: u16,
    pub rev_nat_index: u16,
    pub snat_addr: A,
    pub snat_port: u16,
    /// [`ct_flags`] bits.
    pub flags: u16,
    /// Forward entries: the backend chosen, to notice when it leaves.
    pub backend_id: u32,
    pub _pad2: u32,
    /// bpf_ktime_get_ns() of the last packet.
    pub last_seen_ns: u64,
}
pub type Ct4Value = CtValue<u32>;
pub type Ct6Value = CtValue<Addr6>;

impl<A: Copy> CtValue<A> {
    /// The key of the reply entry that forward entry `self`, of a flow from
    /// `client`:`client_port`, names: the backend answers the SNAT address and port when
    /// the flow has them (`snat`: `snat_addr` is not zero), else the client. The programs
    /// pair a flow's two entries by it, and the daemon's collector judges them by it.
    /// `snat` comes from the caller: comparing an IPv6 address here would make LLVM call
    /// `bcmp` in the programs.
    #[inline(always)]
    pub fn reply_key(&self, snat: bool, client: A, client_port: u16, proto: u8) -> CtKey<A> {
        CtKey {
            saddr: self.addr,
            daddr: if snat { self.snat_addr } else { client },
            sport: self.port,
            dport: if snat { self.snat_port } else { client_port },
            proto,
            dir: dir::REPLY,
            _pad: [0; 2],
        }
    }
}
const _: () = assert!(core::mem::size_of::<Ct4Value>() == 32);
const _: () = assert!(core::mem::size_of::<Ct6Value>() == 56);

/// Data of the source-range LPM trie key: the prefix covers `rev_nat_index` and `_pad`
/// (32 bits) plus the CIDR's own length, so a lookup matches one frontend's ranges only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SourceRange<A> {
    pub rev_nat_index: u16,
    pub _pad: u16,
    /// Network byte order.
    pub addr: A,
}
pub type SourceRange4 = SourceRange<u32>;
pub type SourceRange6 = SourceRange<Addr6>;
const _: () = assert!(core::mem::size_of::<SourceRange4>() == 8);
const _: () = assert!(core::mem::size_of::<SourceRange6>() == 20);

/// The address types the flow maps come in: `u32` and [`Addr6`], for which the size
/// assertions above hold. Sealed, so no other type makes a `CtKey` that has padding.
pub trait FlowAddr: bytemuck::Pod + Default + sealed::Sealed {}
impl FlowAddr for u32 {}
impl FlowAddr for Addr6 {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for u32 {}
    impl Sealed for super::Addr6 {}
}

// `bytemuck` cannot derive its traits for generic types, so they are declared by hand.
macro_rules! pod {
    ($($t:ident),* $(,)?) => {
        $(
            // SAFETY: every field is an integer or an integer array, valid for any bits
            // (all zeroes included); for both `FlowAddr` types the size assertions above
            // equal the sum of the fields' sizes, so there is no padding byte.
            unsafe impl<A: FlowAddr> bytemuck::Zeroable for $t<A> {}
            // SAFETY: as for `Zeroable`; the types are also `Copy` and `'static`.
            unsafe impl<A: FlowAddr> bytemuck::Pod for $t<A> {}
        )*
    };
}
pod!(CtKey, CtValue, SourceRange);

/// Bits of the trie key's prefix taken by `rev_nat_index` and `_pad`.
pub const SOURCE_RANGE_PREFIX_BITS: u32 = 32;

/// Where the source ports of SNATed flows come from: above the default ephemeral range
/// (32768-60999), so they never collide with the node's own connections.
pub const SNAT_PORT_MIN: u16 = 61_000;
pub const SNAT_PORT_MAX: u16 = 65_535;

/// `CtValue::flags`.
pub mod ct_flags {
    /// The backend has answered: the flow is established.
    pub const SEEN_REPLY: u16 = 1 << 0;
    /// A FIN or RST went by: the flow is ending, and its SNAT port is soon free again.
    pub const CLOSING: u16 = 1 << 1;
    /// The flow goes by direct server return: on the entry node its replies never pass, on
    /// the backend's node the entry was made from the packet's DSR option. Either way it
    /// counts as answered.
    pub const DSR: u16 = 1 << 2;
    /// Reply entries of flows without SNAT, from when they are written: whether the
    /// frontend the replies come from is one of the node's addresses is in
    /// [`NODE_ADDRESS`], so that no reply looks it up. Entries without it (older daemons')
    /// are looked up.
    pub const NODE_ADDRESS_KNOWN: u16 = 1 << 3;
    pub const NODE_ADDRESS: u16 = 1 << 4;
}

/// The IPv4 option that carries a DSR flow's frontend to the backend's node (Cilium's
/// layout: type, length 8, port, address, all in network byte order).
pub mod dsr {
    /// Copied on fragmentation (bit 7), class 0, number 26: Cilium's.
    pub const OPT4_TYPE: u8 = 0x9a;
    pub const OPT4_LEN: u8 = 8;
    /// The IPv6 destination option carrying the frontend: type 0x1b (skipped by a host
    /// that does not know it, may not change en route), 20 bytes of data (address, port,
    /// padding); with the extension header's own two bytes and a PadN option, 24 bytes.
    pub const OPT6_TYPE: u8 = 0x1b;
    pub const OPT6_LEN: u8 = 20;
    pub const EXT6_LEN: usize = 24;
}

/// Idle time after which a flow's entries no longer count. An established TCP flow's
/// matches nf_conntrack's order of magnitude without keeping dead flows for days; UDP's is
/// long enough for DNS and statsd clients between bursts. Flows nobody answered and closing
/// TCP flows go quickly, so their SNAT ports return to the pool (4,536 per backend and node
/// address) instead of running out under many short connections.
pub const CT_TCP_TIMEOUT_NS: u64 = 6 * 3600 * 1_000_000_000;
pub const CT_UDP_TIMEOUT_NS: u64 = 120 * 1_000_000_000;
pub const CT_UNANSWERED_TIMEOUT_NS: u64 = 60 * 1_000_000_000;
pub const CT_CLOSING_TIMEOUT_NS: u64 = 10 * 1_000_000_000;

/// How long an entry with these `flags` lives after its last packet.
pub const fn ct_timeout_ns(proto: u8, flags: u16) -> u64 {
    if flags & ct_flags::CLOSING != 0 {
        CT_CLOSING_TIMEOUT_NS
    } else if flags & (ct_flags::SEEN_REPLY | ct_flags::DSR) == 0 {
        CT_UNANSWERED_TIMEOUT_NS
    } else if proto == crate::proto::TCP {
        CT_TCP_TIMEOUT_NS
    } else {
        CT_UDP_TIMEOUT_NS
    }
}

/// Affinity on the packet path keys clients by IP address; this bit keeps those keys apart
/// from the socket path's netns cookies in the shared affinity map.
pub const AFFINITY_CLIENT_IP: u64 = 1 << 63;
/// With [`AFFINITY_CLIENT_IP`]: an IPv6 client, its address folded into the other 62 bits
/// (see [`affinity_client6`]); IPv4 clients have their address in the low 32 bits.
pub const AFFINITY_CLIENT_IP6: u64 = 1 << 62;

/// The affinity map's client for an IPv4 address (as in the packet).
pub const fn affinity_client4(addr: u32) -> u64 {
    AFFINITY_CLIENT_IP | addr as u64
}

/// The affinity map's client for an IPv6 address: its two halves XORed, 62 bits kept. Two
/// clients sharing a key only share a sticky backend; within one /64 that takes interface
/// identifiers that differ in nothing but two bits.
pub const fn affinity_client6(addr: Addr6) -> u64 {
    let high = ((addr[0] as u64) << 32) | addr[1] as u64;
    let low = ((addr[2] as u64) << 32) | addr[3] as u64;
    AFFINITY_CLIENT_IP | AFFINITY_CLIENT_IP6 | ((high ^ low) & (AFFINITY_CLIENT_IP6 - 1))
}

/// Counters in the per-CPU stats array: where packets went, for metrics and debugging.
pub mod stat {
    /// Packets of new flows translated to a backend.
    pub const NEW_FLOW: u32 = 0;
    /// Packets of known flows translated (forward or reply).
    pub const TRANSLATED: u32 = 1;
    /// Dropped: the frontend has no usable backend (e.g. externalTrafficPolicy: Local and
    /// no endpoint on this node).
    pub const DROP_NO_BACKEND: u32 = 2;
    /// Dropped: the client is outside loadBalancerSourceRanges.
    pub const DROP_SOURCE_RANGE: u32 = 3;
    /// Dropped: no free SNAT port, or no route to the backend.
    pub const DROP_NAT: u32 = 4;
    /// Packets XDP translated itself (the rest of the ingress work was tc's).
    pub const XDP: u32 = 5;
    /// ICMP "too big" errors about a translated flow, translated back for its other end (PMTU
    /// discovery through node ports).
    pub const ICMP_TRANSLATED: u32 = 6;
    /// Dropped: an ICMP error translated back but with no route to send it on.
    pub const ICMP_DROPPED: u32 = 7;
    /// Socket calls refused: the address is inside a service range and no frontend
    /// serves it (no Service holds the address, or not on that port and protocol).
    pub const REFUSED_SERVICE_RANGE: u32 = 8;
    /// Dropped: a new flow found the flow table full (the daemon's collector makes room).
    pub const DROP_FLOW_TABLE_FULL: u32 = 9;
    pub const COUNT: u32 = 10;
}
