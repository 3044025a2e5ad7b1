//! What differs between IPv4 and IPv6 for every hook: the maps a family's frontends,
//! backends and flows live in, and, for the packet path, where its header keeps the
//! addresses. [`crate::lb`] and [`crate::nodeport`] are written once over [`Ip`].

use core::mem;

use aya_ebpf::{
    bindings::bpf_fib_lookup as FibParams,
    helpers::bpf_fib_lookup,
    maps::{HashMap, PerCpuArray, lpm_trie::Key as LpmKey},
};
use proxy_common::{
    Addr6, CtKey, CtValue, FlowAddr, Service4Key, Service6Key, ServiceValue, SourceRange, maglev,
    nat::{self, dsr},
    proto,
};

use crate::{
    flow::{Flow, Leaving, Route, Scratch},
    maps::{
        BACKENDS4, BACKENDS6, CT4, CT6, DEVICE_ADDRS4, DEVICE_ADDRS6, HEAD4, HEAD6, Lookup,
        NODE_ADDRS4, NODE_ADDRS6, ROUTES4, ROUTES6, SCRATCH4, SCRATCH6, SERVICE_RANGES4,
        SERVICE_RANGES6, SERVICES4, SERVICES6, SOURCE_RANGES4, SOURCE_RANGES6,
    },
    packet::Packet,
};

pub const ETH_HLEN: usize = 14;

pub struct V4;
pub struct V6;

/// A backend as the packet path needs it.
#[derive(Clone, Copy)]
pub struct Backend<A> {
    pub addr: A,
    /// Network byte order.
    pub port: u16,
    /// `proxy_common::backend::flags` bits.
    pub flags: u8,
}

pub trait Ip {
    /// An address as the maps and the packet hold it (network byte order).
    type Addr: FlowAddr;
    /// The EtherType of this family's packets.
    const ETH_P: u16;
    /// Offsets of the source and destination address in the frame.
    const SRC: usize;
    const DST: usize;
    /// The header checksum's offset (IPv4); IPv6 has none.
    const L3_CSUM: Option<usize>;
    /// The address in 32-bit words, for checksum updates.
    const WORDS: usize;
    /// Where the L4 header starts in a frame whose IP header has no options or extension
    /// headers.
    const L4_PLAIN: usize;
    /// Such a frame's bytes from the destination MAC to the L4 destination port, as 16-bit
    /// words: what a translation rewrites (see `crate::rewrite`).
    type Head: bytemuck::Pod + AsMut<[u16]>;
    /// This CPU's room for a [`Self::Head`] (`maps::HEAD4`, `HEAD6`).
    fn head() -> Option<*mut Self::Head>;
    /// Word `i` (< [`Self::WORDS`]) of `a`, as in memory.
    fn word(a: &Self::Addr, i: usize) -> u32;

    /// Compared word by word: an array comparison would call memcmp, which BPF lacks.
    #[inline(always)]
    fn same(a: &Self::Addr, b: &Self::Addr) -> bool {
        let mut i = 0;
        while i < Self::WORDS {
            if Self::word(a, i) != Self::word(b, i) {
                return false;
            }
            i += 1;
        }
        true
    }

    #[inline(always)]
    fn is_zero(a: &Self::Addr) -> bool {
        Self::same(a, &Self::Addr::default())
    }

    /// For a TCP or UDP packet of this family that is no fragment and carries no extension
    /// header: its protocol and the offset of its L4 header. None for anything else, which
    /// the stack handles as it would without us.
    #[inline(always)]
    fn l4<P: Packet>(pkt: &P) -> Option<(u8, usize)> {
        Self::header_at(pkt, ETH_HLEN).filter(|&(proto, _)| tcp_or_udp(proto))
    }
    /// For the IP header of this family at `at` (the packet's own, or the one an ICMP error
    /// quotes), if it heads no fragment but the first and no extension header follows it:
    /// the next protocol and its offset.
    fn header_at<P: Packet>(pkt: &P, at: usize) -> Option<(u8, usize)>;
    /// This family's ICMP protocol number.
    const ICMP: u8;
    /// Whether the ICMP checksum covers the IP addresses (ICMPv6's pseudo header).
    const ICMP_PSEUDO: bool;
    /// Whether ICMP type `ty`, code `code` is an error we translate back: the one path MTU
    /// discovery needs. Others (unreachable, time exceeded) are left to the stack, as
    /// before: passed on, they would turn a client's retried connection attempt into a
    /// hard failure where it now retries.
    fn icmp_error(ty: u8, code: u8) -> bool;
    /// The packet's IP length (header and payload), for the FIB's MTU check.
    fn tot_len<P: Packet>(pkt: &P) -> u16;
    /// Sets the FIB lookup's family and addresses.
    fn fib_params(p: &mut FibParams, saddr: Self::Addr, daddr: Self::Addr);

    /// The FIB's answer for a packet leaving as `to`, arriving on our device; `p` is filled
    /// in (the caller's, so the 64-byte struct is not copied around). `tot_len` 0: no MTU
    /// check.
    #[inline(always)]
    fn fib_lookup<P: Packet>(
        pkt: &P,
        p: &mut FibParams,
        to: &Leaving<Self::Addr>,
        tot_len: u16,
    ) -> i64 {
        // SAFETY: bpf_fib_lookup is integers and unions of integers: all zeros is a valid
        // value, and the one the helper expects in the fields we do not set.
        *p = unsafe { mem::zeroed() };
        Self::fib_params(p, to.saddr, to.daddr);
        p.l4_protocol = to.proto;
        p.sport = to.sport;
        p.dport = to.dport;
        p.__bindgen_anon_1.tot_len = tot_len;
        p.ifindex = pkt.ifindex();
        let size = mem::size_of::<FibParams>() as i32;
        // SAFETY: our own program's context, and a live, exclusively borrowed parameter
        // struct of exactly the size passed, which is all the helper reads and writes.
        unsafe { bpf_fib_lookup(pkt.as_ctx(), p, size, 0) }
    }

    /// The master (slot 0) or slot entry of a frontend in `scope`.
    fn service(
        addr: Self::Addr,
        port: u16,
        proto: u8,
        slot: u16,
        scope: u8,
    ) -> Option<ServiceValue>;
    fn backend(id: u32) -> Option<Backend<Self::Addr>>;
    /// This CPU's scratch entry of this family.
    fn scratch() -> Option<*mut Scratch<Self::Addr>>;
    /// This family's remembered FIB answers (see `route`).
    fn routes() -> &'static PerCpuArray<Route<Self::Addr>>;
    /// This family's flow table.
    fn ct() -> &'static HashMap<CtKey<Self::Addr>, CtValue<Self::Addr>>;
    /// Whether node ports answer on `addr`.
    fn node_address(addr: Self::Addr) -> bool;
    /// Whether `addr` is inside a service range (where ClusterIPs come from).
    fn in_service_range(addr: Self::Addr) -> bool;
    /// The address SNATed traffic leaving device `ifindex` gets.
    fn device_address(ifindex: u32) -> Option<Self::Addr>;
    /// Whether `saddr` is in a loadBalancerSourceRange of frontend `rev_nat_index`.
    fn in_source_range(rev_nat_index: u16, saddr: Self::Addr) -> bool;
    /// The affinity map's client for a packet from `saddr`.
    fn affinity_client(saddr: Self::Addr) -> u64;
    /// The flow's Maglev hash (see `proxy_common::maglev`), alike on every node.
    fn maglev_hash(f: &Flow<Self::Addr>, seed: u32) -> u32;
}

/// The fields of a TCP or UDP header start alike: ports first.
#[inline(always)]
fn tcp_or_udp(proto: u8) -> bool {
    proto == proto::TCP || proto == proto::UDP
}

impl Ip for V4 {
    type Addr = u32;
    const ETH_P: u16 = 0x0800;
    const SRC: usize = ETH_HLEN + 12;
    const DST: usize = ETH_HLEN + 16;
    const L3_CSUM: Option<usize> = Some(ETH_HLEN + 10);
    const WORDS: usize = 1;
    const L4_PLAIN: usize = ETH_HLEN + 20;
    type Head = [u16; (ETH_HLEN + 20 + 4) / 2];

    #[inline(always)]
    fn word(a: &u32, _i: usize) -> u32 {
        *a
    }

    const ICMP: u8 = 1;
    const ICMP_PSEUDO: bool = false;

    /// Destination unreachable, fragmentation needed.
    #[inline(always)]
    fn icmp_error(ty: u8, code: u8) -> bool {
        ty == 3 && code == 4
    }

    #[inline(always)]
    fn header_at<P: Packet>(pkt: &P, at: usize) -> Option<(u8, usize)> {
        let ver_ihl: u8 = pkt.load(at)?;
        if ver_ihl >> 4 != 4 {
            return None;
        }
        let ihl = usize::from(ver_ihl & 0x0f) * 4;
        if ihl < 20 {
            return None;
        }
        // Fragments carry no ports after the first; leave them to the stack.
        let frag: u16 = pkt.load(at + 6)?;
        if u16::from_be(frag) & 0x3fff != 0 {
            return None;
        }
        let proto: u8 = pkt.load(at + 9)?;
        Some((proto, at + ihl))
    }

    #[inline(always)]
    fn tot_len<P: Packet>(pkt: &P) -> u16 {
        pkt.load::<u16>(ETH_HLEN + 2).map(u16::from_be).unwrap_or(0)
    }

    #[inline(always)]
    fn fib_params(p: &mut FibParams, saddr: u32, daddr: u32) {
        p.family = 2; // AF_INET
        p.__bindgen_anon_3.ipv4_src = saddr;
        p.__bindgen_anon_4.ipv4_dst = daddr;
    }

    #[inline(always)]
    fn service(addr: u32, port: u16, proto: u8, slot: u16, scope: u8) -> Option<ServiceValue> {
        let key = Service4Key::scoped(addr, port, proto, slot, scope);
        SERVICES4.lookup(key)
    }

    #[inline(always)]
    fn backend(id: u32) -> Option<Backend<u32>> {
        BACKENDS4.lookup(id).map(|b| Backend {
            addr: b.address,
            port: b.port,
            flags: b.flags,
        })
    }

    #[inline(always)]
    fn scratch() -> Option<*mut Scratch<u32>> {
        SCRATCH4.get_ptr_mut(0)
    }

    #[inline(always)]
    fn head() -> Option<*mut Self::Head> {
        HEAD4.get_ptr_mut(0)
    }

    #[inline(always)]
    fn routes() -> &'static PerCpuArray<Route<u32>> {
        &ROUTES4
    }

    #[inline(always)]
    fn ct() -> &'static HashMap<CtKey<u32>, CtValue<u32>> {
        &CT4
    }

    #[inline(always)]
    fn node_address(addr: u32) -> bool {
        NODE_ADDRS4.lookup(addr).is_some()
    }

    #[inline(always)]
    fn in_service_range(addr: u32) -> bool {
        SERVICE_RANGES4.get(LpmKey::new(32, addr)).is_some()
    }

    #[inline(always)]
    fn device_address(ifindex: u32) -> Option<u32> {
        DEVICE_ADDRS4.lookup(ifindex)
    }

    #[inline(always)]
    fn in_source_range(rev_nat_index: u16, saddr: u32) -> bool {
        let key = LpmKey::new(
            nat::SOURCE_RANGE_PREFIX_BITS + 32,
            range(rev_nat_index, saddr),
        );
        SOURCE_RANGES4.get(key).is_some()
    }

    #[inline(always)]
    fn affinity_client(saddr: u32) -> u64 {
        nat::affinity_client4(saddr)
    }

    #[inline(always)]
    fn maglev_hash(f: &Flow<u32>, seed: u32) -> u32 {
        let w = maglev::words4(f.saddr, f.daddr, f.sport, f.dport, f.proto);
        maglev::flow_hash(w, seed)
    }
}

/// IPv6's fixed header; what follows it is the L4 header only when `next header` says so.
pub const IP6_HLEN: usize = 40;
/// IPv6's next-header number of the destination options header.
pub const NEXTHDR_DEST: u8 = 60;

// Word-typed addresses: as bytes (align 1) the compiler moves and spills them a byte at a
// time, which overflows the stack. The service and backend maps keep bytes, converted at
// their lookups.
impl Ip for V6 {
    type Addr = Addr6;
    const ETH_P: u16 = 0x86dd;
    const SRC: usize = ETH_HLEN + 8;
    const DST: usize = ETH_HLEN + 24;
    const L3_CSUM: Option<usize> = None;
    const WORDS: usize = 4;
    const L4_PLAIN: usize = ETH_HLEN + IP6_HLEN;
    type Head = [u16; (ETH_HLEN + IP6_HLEN + 4) / 2];

    #[inline(always)]
    fn word(a: &Addr6, i: usize) -> u32 {
        a[i & 3]
    }

    const ICMP: u8 = 58;
    const ICMP_PSEUDO: bool = true;

    /// Packet too big.
    #[inline(always)]
    fn icmp_error(ty: u8, _code: u8) -> bool {
        ty == 2
    }

    // Extension headers (fragments among them) are left to the stack: Services see plain
    // TCP and UDP, and walking a chain of headers costs the verifier a loop per packet.
    #[inline(always)]
    fn header_at<P: Packet>(pkt: &P, at: usize) -> Option<(u8, usize)> {
        let ver: u8 = pkt.load(at)?;
        if ver >> 4 != 6 {
            return None;
        }
        let next: u8 = pkt.load(at + 6)?;
        // One extension header is ours to read: a DSR flow's frontend (see `dsr`), which
        // the stack skips too.
        if next == NEXTHDR_DEST {
            let upper = dsr_option6(pkt, at)?;
            return Some((upper, at + IP6_HLEN + dsr::EXT6_LEN));
        }
        Some((next, at + IP6_HLEN))
    }

    #[inline(always)]
    fn tot_len<P: Packet>(pkt: &P) -> u16 {
        let payload = pkt.load::<u16>(ETH_HLEN + 4).map(u16::from_be).unwrap_or(0);
        payload.saturating_add(IP6_HLEN as u16)
    }

    #[inline(always)]
    fn fib_params(p: &mut FibParams, saddr: Addr6, daddr: Addr6) {
        p.family = 10; // AF_INET6
        p.__bindgen_anon_3.ipv6_src = saddr;
        p.__bindgen_anon_4.ipv6_dst = daddr;
    }

    #[inline(always)]
    fn service(addr: Addr6, port: u16, proto: u8, slot: u16, scope: u8) -> Option<ServiceValue> {
        let key = Service6Key::scoped(bytes(addr), port, proto, slot, scope);
        SERVICES6.lookup(key)
    }

    #[inline(always)]
    fn backend(id: u32) -> Option<Backend<Addr6>> {
        BACKENDS6.lookup(id).map(|b| Backend {
            addr: words(b.address),
            port: b.port,
            flags: b.flags,
        })
    }

    #[inline(always)]
    fn scratch() -> Option<*mut Scratch<Addr6>> {
        SCRATCH6.get_ptr_mut(0)
    }

    #[inline(always)]
    fn head() -> Option<*mut Self::Head> {
        HEAD6.get_ptr_mut(0)
    }

    #[inline(always)]
    fn routes() -> &'static PerCpuArray<Route<Addr6>> {
        &ROUTES6
    }

    #[inline(always)]
    fn ct() -> &'static HashMap<CtKey<Addr6>, CtValue<Addr6>> {
        &CT6
    }

    #[inline(always)]
    fn node_address(addr: Addr6) -> bool {
        NODE_ADDRS6.lookup(addr).is_some()
    }

    #[inline(always)]
    fn in_service_range(addr: Addr6) -> bool {
        SERVICE_RANGES6.get(LpmKey::new(128, addr)).is_some()
    }

    #[inline(always)]
    fn device_address(ifindex: u32) -> Option<Addr6> {
        DEVICE_ADDRS6.lookup(ifindex)
    }

    #[inline(always)]
    fn in_source_range(rev_nat_index: u16, saddr: Addr6) -> bool {
        let key = LpmKey::new(
            nat::SOURCE_RANGE_PREFIX_BITS + 128,
            range(rev_nat_index, saddr),
        );
        SOURCE_RANGES6.get(key).is_some()
    }

    #[inline(always)]
    fn affinity_client(saddr: Addr6) -> u64 {
        nat::affinity_client6(saddr)
    }

    #[inline(always)]
    fn maglev_hash(f: &Flow<Addr6>, seed: u32) -> u32 {
        let w = maglev::words6(f.saddr, f.daddr, f.sport, f.dport, f.proto);
        maglev::flow_hash(w, seed)
    }
}

#[inline(always)]
fn range<A>(rev_nat_index: u16, addr: A) -> SourceRange<A> {
    SourceRange {
        rev_nat_index,
        _pad: 0,
        addr,
    }
}

/// For the IPv6 header at `at`, followed by a destination options header: the protocol
/// after it, if that header is exactly our DSR option (see `dsr`).
#[inline(always)]
pub fn dsr_option6<P: Packet>(pkt: &P, at: usize) -> Option<u8> {
    let head: [u8; 4] = pkt.load(at + IP6_HLEN)?;
    let ours = head[1] == (dsr::EXT6_LEN / 8 - 1) as u8
        && head[2] == dsr::OPT6_TYPE
        && head[3] == dsr::OPT6_LEN;
    ours.then_some(head[0])
}

/// The same 16 bytes as four words, as the FIB and the socket context hold an IPv6
/// address.
#[inline(always)]
pub fn words(b: [u8; 16]) -> [u32; 4] {
    bytemuck::cast(b)
}

#[inline(always)]
pub fn bytes(w: [u32; 4]) -> [u8; 16] {
    bytemuck::cast(w)
}

/// This CPU's scratch entry (see [`Scratch`]).
#[inline(always)]
pub(crate) fn scratch<I: Ip>() -> Option<&'static mut Scratch<I::Addr>> {
    // SAFETY: a non-null lookup result is this CPU's entry of the map, a `Scratch` that
    // stays allocated while we run (see `maps::Lookup`); programs on one CPU run one at a
    // time (see `Scratch`), so this is the only reference into it.
    I::scratch().map(|s| unsafe { &mut *s })
}
