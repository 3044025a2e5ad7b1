//! The state of one packet's translation: its tuple, the frontend it is addressed to, and
//! the per-CPU scratch space the node-port and ICMP code work in. Plain data, so that the
//! maps and the per-family glue can name it without depending on the translation itself.

use aya_ebpf::bindings::bpf_fib_lookup as FibParams;
use proxy_common::{CtKey, CtValue, ServiceValue, nat};

/// The tuple of one TCP or UDP packet, addresses and ports as in the packet.
#[derive(Clone, Copy)]
pub struct Flow<A> {
    pub(crate) saddr: A,
    pub(crate) daddr: A,
    pub(crate) sport: u16,
    pub(crate) dport: u16,
    pub(crate) proto: u8,
    /// Offset of the L4 header.
    pub(crate) l4: usize,
    /// TCP flags (0 for UDP).
    pub(crate) tcp_flags: u8,
}

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

impl<A: Copy> Flow<A> {
    pub(crate) fn key(&self, dir: u8) -> CtKey<A> {
        CtKey {
            saddr: self.saddr,
            daddr: self.daddr,
            sport: self.sport,
            dport: self.dport,
            proto: self.proto,
            dir,
            _pad: [0; 2],
        }
    }

    /// Whether an entry last seen at `last_seen` with `flags` is past its time.
    pub(crate) fn expired(&self, last_seen: u64, flags: u16, now: u64) -> bool {
        crate::kernel::age(now, last_seen) > nat::ct_timeout_ns(self.proto, flags)
    }

    /// A FIN or RST: the connection is ending.
    pub(crate) fn ending(&self) -> bool {
        self.tcp_flags & (TCP_FIN | TCP_RST) != 0
    }

    /// A SYN without ACK: a client opening a connection (maybe reusing a port).
    pub(crate) fn opening(&self) -> bool {
        self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }

    /// A SYN-ACK: a server accepting a connection.
    pub(crate) fn accepting(&self) -> bool {
        self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK
    }

    /// The flags an entry of this flow carries after this packet.
    pub(crate) fn mark(&self, flags: u16) -> u16 {
        if self.ending() {
            flags | nat::ct_flags::CLOSING
        } else {
            flags
        }
    }
}

/// What one packet's translation works on, kept in a per-CPU map (`maps::SCRATCH4`,
/// `SCRATCH6`) rather than on the stack: with IPv6 addresses the flow, its two entries and
/// the FIB's parameters do not fit the 512 bytes BPF allows beside everything else. A
/// program runs to its end on its CPU before the next one there starts (softirq), so one
/// entry per CPU is enough.
pub struct Scratch<A> {
    pub(crate) flow: Flow<A>,
    pub(crate) work: Work<A>,
}

/// The parts of [`Scratch`] a new flow, a reply and a redirect fill in.
pub(crate) struct Work<A> {
    pub(crate) frontend: Frontend<A>,
    /// A reply's translation.
    pub(crate) nat: Nat<A>,
    pub(crate) fib: FibParams,
    pub(crate) reply: CtValue<A>,
    pub(crate) forward: CtValue<A>,
    /// bpf_ktime_get_ns() for this packet once read, 0 before (see [`clock`]).
    pub(crate) now: u64,
}

/// The time of a packet's work (`Work::now`), read once, and only for packets that turn
/// out to be ours (most packets a device sees are not).
#[inline(always)]
pub(crate) fn clock(now: &mut u64) -> u64 {
    if *now == 0 {
        *now = crate::kernel::now_ns();
    }
    *now
}

/// What to turn a packet into: a new destination, and maybe a new source.
#[derive(Clone, Copy)]
pub(crate) struct Nat<A> {
    pub(crate) dst: Option<(A, u16)>,
    pub(crate) src: Option<(A, u16)>,
}

/// Where a frontend's entries are stored: its address (0 for node ports) and scope.
pub(crate) type FrontendAt<A> = (A, u8);

/// A frontend a packet is addressed to, and its master entry.
pub(crate) struct Frontend<A> {
    pub(crate) at: FrontendAt<A>,
    pub(crate) master: ServiceValue,
}

/// The tuple a packet leaves with: what the FIB is asked about (`Ip::fib_lookup`).
pub struct Leaving<A> {
    pub saddr: A,
    pub daddr: A,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
}

/// Slots per CPU and family of the FIB's remembered answers (see `route`).
pub const ROUTE_SLOTS: u32 = 1024;

/// One answer of the FIB remembered (see `route`): the lookup, by the tuple a packet leaves
/// with and the device it came in by, and where the FIB sent it.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Route<A> {
    pub(crate) saddr: A,
    pub(crate) daddr: A,
    pub(crate) sport: u16,
    pub(crate) dport: u16,
    pub(crate) in_ifindex: u32,
    pub(crate) out_ifindex: u32,
    pub(crate) proto: u8,
    /// Whether `out_ifindex` is in the pods' device map, if asked (`route::POD_*`).
    pub(crate) pod: u8,
    pub(crate) _pad: [u8; 2],
    pub(crate) smac: [u8; 6],
    pub(crate) dmac: [u8; 6],
    pub(crate) _pad2: u32,
    /// bpf_ktime_get_ns() until which the answer is used; 0 for a slot never filled.
    pub(crate) expires_ns: u64,
}
const _: () = assert!(core::mem::size_of::<Route<u32>>() == 48);
const _: () = assert!(core::mem::size_of::<Route<proxy_common::Addr6>>() == 72);
