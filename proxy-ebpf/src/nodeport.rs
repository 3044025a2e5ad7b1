//! Node ports, external IPs and load-balancer IPs: per-packet NAT on the node's devices.
//!
//! Sockets on this node never need this (the cgroup hooks translate them); traffic from
//! other hosts does. On ingress (tc, or XDP before it where the driver allows), the first
//! packet of a flow picks a backend, recorded in [`CT4`]; the destination becomes the
//! backend and, when the backend is on another node under externalTrafficPolicy Cluster,
//! the source becomes this node (SNAT) so the reply comes back here. Packets that must leave
//! again are sent straight out of the device the FIB names: their source is now a local
//! address, which the stack would drop as martian if it routed them itself. Replies are
//! translated back at ingress (SNATed flows: the reply is addressed to us) or at tc egress
//! (flows to local backends, which answer the client directly through the node).
//!
//! Written once over [`Packet`] for both hooks. IPv4 only; IPv6, fragments and anything
//! not TCP or UDP pass untouched.

use aya_ebpf::{bindings::BPF_NOEXIST, maps::lpm_trie::Key as LpmKey};
use proxy_common::{
    AffinityKey, AffinityValue, Backend4, Ct4Key, Ct4Value, Service4Key, ServiceValue,
    SourceRange4, backend, nat, proto,
    service::{flags, scope},
};

use crate::{
    kernel,
    lb::pick_slot,
    maps::{
        AFFINITY, BACKENDS4, CT4, DEVICE_ADDRS4, Lookup, NODE_ADDRS4, SERVICES4, SOURCE_RANGES4,
        count,
    },
    packet::{FIB_NOT_FWDED, Packet},
};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const IP_TOT_LEN: usize = ETH_HLEN + 2;
const IP_FRAG: usize = ETH_HLEN + 6;
const IP_PROTO: usize = ETH_HLEN + 9;
const IP_CSUM: usize = ETH_HLEN + 10;
const IP_SRC: usize = ETH_HLEN + 12;
const IP_DST: usize = ETH_HLEN + 16;
/// Tries at finding a free SNAT port before giving up on a new flow.
const SNAT_TRIES: u32 = 8;

/// The tuple of one IPv4 TCP or UDP packet, addresses and ports as in the packet.
#[derive(Clone, Copy)]
struct Flow {
    saddr: u32,
    daddr: u32,
    sport: u16,
    dport: u16,
    proto: u8,
    /// Offset of the L4 header.
    l4: usize,
    /// TCP flags (0 for UDP).
    tcp_flags: u8,
}

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

impl Flow {
    fn key(&self, dir: u8) -> Ct4Key {
        Ct4Key {
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
    fn expired(&self, last_seen: u64, flags: u16, now: u64) -> bool {
        now.wrapping_sub(last_seen) > nat::ct_timeout_ns(self.proto, flags)
    }

    /// A FIN or RST: the connection is ending.
    fn ending(&self) -> bool {
        self.tcp_flags & (TCP_FIN | TCP_RST) != 0
    }

    /// A SYN without ACK: a client opening a connection (maybe reusing a port).
    fn opening(&self) -> bool {
        self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }

    /// The flags an entry of this flow carries after this packet.
    fn mark(&self, flags: u16) -> u16 {
        if self.ending() {
            flags | nat::ct_flags::CLOSING
        } else {
            flags
        }
    }
}

/// What to turn a packet into: a new destination, and maybe a new source.
#[derive(Clone, Copy)]
struct Nat {
    dst: Option<(u32, u16)>,
    src: Option<(u32, u16)>,
}

impl Nat {
    /// The flow as it will look once translated.
    fn applied_to(&self, f: &Flow) -> Flow {
        let mut out = *f;
        if let Some((a, p)) = self.dst {
            (out.daddr, out.dport) = (a, p);
        }
        if let Some((a, p)) = self.src {
            (out.saddr, out.sport) = (a, p);
        }
        out
    }
}

#[inline(always)]
fn parse<P: Packet>(pkt: &P) -> Option<Flow> {
    let eth_proto: u16 = pkt.load(12)?;
    if u16::from_be(eth_proto) != ETH_P_IP {
        return None;
    }
    let ver_ihl: u8 = pkt.load(ETH_HLEN)?;
    if ver_ihl >> 4 != 4 {
        return None;
    }
    let ihl = usize::from(ver_ihl & 0x0f) * 4;
    if ihl < 20 {
        return None;
    }
    // Fragments carry no ports after the first; leave them to the stack.
    let frag: u16 = pkt.load(IP_FRAG)?;
    if u16::from_be(frag) & 0x3fff != 0 {
        return None;
    }
    let proto: u8 = pkt.load(IP_PROTO)?;
    if proto != proto::TCP && proto != proto::UDP {
        return None;
    }
    let l4 = ETH_HLEN + ihl;
    Some(Flow {
        saddr: pkt.load(IP_SRC)?,
        daddr: pkt.load(IP_DST)?,
        sport: pkt.load(l4)?,
        dport: pkt.load(l4 + 2)?,
        proto,
        l4,
        tcp_flags: if proto == proto::TCP {
            pkt.load(l4 + 13)?
        } else {
            0
        },
    })
}

/// Rewrites one address and port of the packet (`source` picks which), fixing the IP and
/// L4 checksums incrementally. `f` holds the values the packet has now.
#[inline(always)]
fn rewrite<P: Packet>(pkt: &mut P, f: &Flow, source: bool, addr: u32, port: u16) -> Result<(), ()> {
    let (old_addr, old_port, addr_off, port_off) = if source {
        (f.saddr, f.sport, IP_SRC, f.l4)
    } else {
        (f.daddr, f.dport, IP_DST, f.l4 + 2)
    };
    let udp = f.proto == proto::UDP;
    let csum = f.l4 + if udp { 6 } else { 16 };
    if addr != old_addr {
        pkt.l4_csum_replace(csum, old_addr, addr, 4, true, udp)?;
        pkt.l3_csum_replace(IP_CSUM, old_addr, addr)?;
        pkt.store(addr_off, &addr)?;
    }
    if port != old_port {
        pkt.l4_csum_replace(csum, u32::from(old_port), u32::from(port), 2, false, udp)?;
        pkt.store(port_off, &port)?;
    }
    Ok(())
}

#[inline(always)]
fn apply<P: Packet>(pkt: &mut P, f: &Flow, nat: &Nat) -> Result<(), ()> {
    if P::XDP {
        count(nat::stat::XDP);
    }
    let mut now = *f;
    if let Some((a, p)) = nat.dst {
        rewrite(pkt, &now, false, a, p)?;
        (now.daddr, now.dport) = (a, p);
    }
    if let Some((a, p)) = nat.src {
        rewrite(pkt, &now, true, a, p)?;
    }
    Ok(())
}

/// Translates the packet and sends it out of the device the FIB names for its new
/// destination; if this hook cannot (XDP), passes it untouched for tc to do the same with
/// the flow entries already in place.
#[inline(always)]
fn translate_and_redirect<P: Packet>(pkt: &mut P, f: &Flow, nat: &Nat) -> Result<i32, ()> {
    let out = nat.applied_to(f);
    let tot_len = pkt.load::<u16>(IP_TOT_LEN).map(u16::from_be).unwrap_or(0);
    let (ret, fib) = pkt.fib_lookup(
        out.proto, out.sport, out.dport, out.saddr, out.daddr, tot_len,
    );
    if ret == FIB_NOT_FWDED {
        apply(pkt, f, nat)?;
        return Ok(P::PASS);
    }
    if P::XDP {
        return Ok(P::PASS);
    }
    if !P::can_redirect(ret) {
        count(nat::stat::DROP_NAT);
        return Ok(P::DROP);
    }
    apply(pkt, f, nat)?;
    if ret == crate::packet::FIB_SUCCESS {
        pkt.store(0, &fib.dmac)?;
        pkt.store(6, &fib.smac)?;
    }
    Ok(pkt.redirect(ret, fib.ifindex))
}

/// A reply (backend -> client, or -> our SNAT address) of a flow we translate: what it
/// must become, and whether it was SNATed (then it is addressed to us and must be sent on).
#[inline(always)]
fn reply_nat(f: &Flow, now: u64) -> Option<(Nat, bool)> {
    let entry = CT4.get_ptr_mut(f.key(nat::dir::REPLY))?;
    // SAFETY: a non-null lookup result is an 8-aligned Ct4Value that stays allocated while
    // we run (see `maps::Lookup`), and ours is the only reference into it in this program.
    // Other CPUs may update the same entry at the same time, as every BPF program sharing a
    // map may, beyond what Rust's memory model describes; each field is an aligned integer
    // written whole, so the worst is one packet's timestamp or flags update being lost.
    let e = unsafe { &mut *entry };
    if f.expired(e.last_seen_ns, e.flags, now) {
        return None;
    }
    e.last_seen_ns = now;
    e.flags = f.mark(e.flags | nat::ct_flags::SEEN_REPLY);
    let snat = e.snat_addr != 0;
    let nat = Nat {
        src: Some((e.addr, e.port)),
        dst: snat.then_some((e.snat_addr, e.snat_port)),
    };
    Some((nat, snat))
}

/// Where a frontend's entries are stored: its address (0 for node ports) and scope.
type FrontendAt = (u32, u8);

/// The master entry of the frontend this packet is addressed to: its own address (external
/// and load-balancer IPs), or any node address (node ports, stored with address 0). From a
/// pod, first the frontends the node's own sockets see (ClusterIPs, internalTrafficPolicy),
/// as kube-proxy's PREROUTING rules treat a pod's packets.
#[inline(always)]
fn frontend(f: &Flow, from_pod: bool) -> Option<(FrontendAt, ServiceValue)> {
    if from_pod {
        let key = Service4Key::scoped(f.daddr, f.dport, f.proto, 0, scope::SOCKET);
        if let Some(m) = SERVICES4.lookup(key) {
            return Some(((f.daddr, scope::SOCKET), m));
        }
    }
    let key = Service4Key::scoped(f.daddr, f.dport, f.proto, 0, scope::PACKET);
    if let Some(m) = SERVICES4.lookup(key) {
        return Some(((f.daddr, scope::PACKET), m));
    }
    NODE_ADDRS4.lookup(f.daddr)?;
    let key = Service4Key::scoped(0, f.dport, f.proto, 0, scope::PACKET);
    SERVICES4.lookup(key).map(|m| ((0, scope::PACKET), m))
}

#[inline(always)]
fn slot_backend(fe: FrontendAt, f: &Flow, slot: u16) -> Option<(u32, Backend4)> {
    let key = Service4Key::scoped(fe.0, f.dport, f.proto, slot, fe.1);
    let id = SERVICES4.lookup(key)?.backend_id;
    BACKENDS4.lookup(id).map(|b| (id, b))
}

/// A backend for a new flow: the client's previous one under ClientIP affinity, if still
/// there and within the timeout; else a uniform pick.
#[inline(always)]
fn choose_backend(
    fe: FrontendAt,
    f: &Flow,
    master: &ServiceValue,
    now: u64,
) -> Option<(u32, Backend4)> {
    if master.flags & flags::AFFINITY == 0 {
        return slot_backend(fe, f, pick_slot(master.count));
    }
    let key = AffinityKey {
        client: nat::AFFINITY_CLIENT_IP | u64::from(f.saddr),
        rev_nat_index: master.rev_nat_index,
        _pad: [0; 6],
    };
    let timeout_ns = u64::from(master.affinity_timeout) * 1_000_000_000;
    let mut chosen = None;
    if let Some(prev) = AFFINITY.lookup(key)
        && now.wrapping_sub(prev.last_used_ns) <= timeout_ns
        && let Some(b) = BACKENDS4.lookup(prev.backend_id)
    {
        chosen = Some((prev.backend_id, b));
    }
    let chosen = match chosen {
        Some(c) => c,
        None => slot_backend(fe, f, pick_slot(master.count))?,
    };
    let value = AffinityValue {
        backend_id: chosen.0,
        _pad: 0,
        last_used_ns: now,
    };
    let _ = AFFINITY.insert(key, value, 0);
    Some(chosen)
}

/// A source port on `snat_addr` no other flow to `backend` uses, claimed by writing the
/// reply entry that will translate the backend's answers.
#[inline(always)]
fn claim_snat_port(
    f: &Flow,
    b: &Backend4,
    snat_addr: u32,
    reply: &Ct4Value,
    now: u64,
) -> Option<u16> {
    let span = u32::from(nat::SNAT_PORT_MAX - nat::SNAT_PORT_MIN) + 1;
    for _ in 0..SNAT_TRIES {
        let r = kernel::random_u32();
        let port = (nat::SNAT_PORT_MIN + (r % span) as u16).to_be();
        let key = Ct4Key {
            saddr: b.address,
            daddr: snat_addr,
            sport: b.port,
            dport: port,
            proto: f.proto,
            dir: nat::dir::REPLY,
            _pad: [0; 2],
        };
        if CT4.insert(key, reply, u64::from(BPF_NOEXIST)).is_ok() {
            return Some(port);
        }
        // Taken: by a live flow, or by one idle past its timeout that we may reuse.
        if let Some(old) = CT4.lookup(key)
            && f.expired(old.last_seen_ns, old.flags, now)
            && CT4.insert(key, reply, 0).is_ok()
        {
            return Some(port);
        }
    }
    None
}

/// Whether the client may use this frontend (loadBalancerSourceRanges).
#[inline(always)]
fn source_allowed(master: &ServiceValue, saddr: u32) -> bool {
    if master.flags & flags::SOURCE_RANGES == 0 {
        return true;
    }
    let key = LpmKey::new(
        nat::SOURCE_RANGE_PREFIX_BITS + 32,
        SourceRange4 {
            rev_nat_index: master.rev_nat_index,
            _pad: 0,
            addr: saddr,
        },
    );
    SOURCE_RANGES4.get(key).is_some()
}

/// The address SNATed traffic to `backend` leaves with: the one configured for the device
/// the FIB sends it out of.
#[inline(always)]
fn snat_address<P: Packet>(pkt: &P, f: &Flow, backend: u32) -> Option<u32> {
    let (ret, p) = pkt.fib_lookup(f.proto, f.sport, f.dport, 0, backend, 0);
    if ret != crate::packet::FIB_SUCCESS && ret != crate::packet::FIB_NO_NEIGH {
        return None;
    }
    DEVICE_ADDRS4.lookup(p.ifindex)
}

/// A new flow to a frontend: pick the backend and record both directions. Returns the
/// forward entry, or the verdict for a packet that may not pass.
#[inline(always)]
fn new_flow<P: Packet>(
    pkt: &P,
    f: &Flow,
    fe: FrontendAt,
    master: &ServiceValue,
    now: u64,
) -> Result<Ct4Value, i32> {
    let drop_as = |stat| {
        count(stat);
        P::DROP
    };
    if !source_allowed(master, f.saddr) {
        return Err(drop_as(nat::stat::DROP_SOURCE_RANGE));
    }
    // No endpoint (anywhere, or on this node under externalTrafficPolicy Local): drop, as
    // kube-proxy does for traffic from outside.
    if master.count == 0 {
        return Err(drop_as(nat::stat::DROP_NO_BACKEND));
    }
    let Some((backend_id, b)) = choose_backend(fe, f, master, now) else {
        return Err(drop_as(nat::stat::DROP_NO_BACKEND));
    };
    let snat = master.flags & flags::SNAT != 0 && b.flags & backend::flags::LOCAL == 0;
    let mut reply = Ct4Value {
        addr: f.daddr,
        port: f.dport,
        rev_nat_index: master.rev_nat_index,
        backend_id,
        last_seen_ns: now,
        ..Default::default()
    };
    let (mut snat_addr, mut snat_port) = (0, 0);
    if snat {
        let Some(addr) = snat_address(pkt, f, b.address) else {
            return Err(drop_as(nat::stat::DROP_NAT));
        };
        reply.snat_addr = f.saddr;
        reply.snat_port = f.sport;
        let Some(port) = claim_snat_port(f, &b, addr, &reply, now) else {
            return Err(drop_as(nat::stat::DROP_NAT));
        };
        (snat_addr, snat_port) = (addr, port);
    } else {
        let key = Ct4Key {
            saddr: b.address,
            daddr: f.saddr,
            sport: b.port,
            dport: f.sport,
            proto: f.proto,
            dir: nat::dir::REPLY,
            _pad: [0; 2],
        };
        if CT4.insert(key, reply, 0).is_err() {
            return Err(drop_as(nat::stat::DROP_NAT));
        }
    }
    let forward = Ct4Value {
        addr: b.address,
        port: b.port,
        rev_nat_index: master.rev_nat_index,
        snat_addr,
        snat_port,
        backend_id,
        last_seen_ns: now,
        ..Default::default()
    };
    if CT4.insert(f.key(nat::dir::FORWARD), forward, 0).is_err() {
        return Err(drop_as(nat::stat::DROP_NAT));
    }
    count(nat::stat::NEW_FLOW);
    Ok(forward)
}

/// The forward entry of a flow we already translate, if it still holds; refreshes both
/// entries. The flow starts over when its backend left the service (a UDP client of a
/// removed backend moves on instead of sending into the void), when its reply entry
/// expired or went to another flow (its SNAT port was reused), or when a closing TCP flow's
/// client port opens a new connection.
#[inline(always)]
fn known_flow(f: &Flow, now: u64) -> Option<Ct4Value> {
    let entry = CT4.get_ptr_mut(f.key(nat::dir::FORWARD))?;
    // SAFETY: as in `reply_nat`: a live, aligned Ct4Value of plain integers, and the only
    // reference into it (`r` below is another key's entry: the direction differs).
    let e = unsafe { &mut *entry };
    match BACKENDS4.lookup(e.backend_id) {
        Some(b) if b.address == e.addr && b.port == e.port => {}
        _ => return None,
    }
    let snat = e.snat_addr != 0;
    let reply_key = Ct4Key {
        saddr: e.addr,
        daddr: if snat { e.snat_addr } else { f.saddr },
        sport: e.port,
        dport: if snat { e.snat_port } else { f.sport },
        proto: f.proto,
        dir: nat::dir::REPLY,
        _pad: [0; 2],
    };
    // SAFETY: as for `e`; a REPLY key, so a different entry from `e`'s FORWARD one.
    let r = unsafe { &mut *CT4.get_ptr_mut(reply_key)? };
    let ours = !snat || (r.snat_addr == f.saddr && r.snat_port == f.sport);
    let last_seen = if e.last_seen_ns > r.last_seen_ns {
        e.last_seen_ns
    } else {
        r.last_seen_ns
    };
    if !ours
        || f.expired(last_seen, r.flags, now)
        || (f.opening() && r.flags & nat::ct_flags::CLOSING != 0)
    {
        return None;
    }
    e.last_seen_ns = now;
    r.last_seen_ns = now;
    e.flags = f.mark(e.flags);
    r.flags = f.mark(r.flags);
    count(nat::stat::TRANSLATED);
    Some(*e)
}

/// Ingress on a node device (tc, or XDP ahead of it).
#[inline(always)]
pub fn ingress<P: Packet>(pkt: &mut P) -> Result<i32, ()> {
    translate_ingress(pkt, false)
}

/// tc ingress on a pod's device: what the pod sends to ClusterIPs (and to node ports,
/// external and load-balancer IPs) is translated as the node's own sockets would be, with
/// a flow entry per connection. A UDP flow keeps its backend while that backend lives and
/// moves on by itself when it leaves (see [`known_flow`]); replies from a local backend are
/// turned back here, at the backend's own device, the others at the client's (egress).
#[inline(always)]
pub fn ingress_from_pod<P: Packet>(pkt: &mut P) -> Result<i32, ()> {
    translate_ingress(pkt, true)
}

#[inline(always)]
fn translate_ingress<P: Packet>(pkt: &mut P, from_pod: bool) -> Result<i32, ()> {
    let Some(f) = parse(pkt) else {
        return Ok(P::PASS);
    };
    let now = kernel::now_ns();
    if let Some((nat, snat)) = reply_nat(&f, now) {
        count(nat::stat::TRANSLATED);
        if snat {
            return translate_and_redirect(pkt, &f, &nat);
        }
        apply(pkt, &f, &nat)?;
        return Ok(P::PASS);
    }
    let Some((fe, master)) = frontend(&f, from_pod) else {
        return Ok(P::PASS);
    };
    let e = match known_flow(&f, now) {
        Some(e) => e,
        None => match new_flow(pkt, &f, fe, &master, now) {
            Ok(e) => e,
            Err(verdict) => return Ok(verdict),
        },
    };
    let nat = Nat {
        dst: Some((e.addr, e.port)),
        src: (e.snat_addr != 0).then_some((e.snat_addr, e.snat_port)),
    };
    if e.snat_addr != 0 {
        return translate_and_redirect(pkt, &f, &nat);
    }
    // A local backend: the stack delivers it to the pod as it would any forwarded packet.
    apply(pkt, &f, &nat)?;
    Ok(P::PASS)
}

/// tc egress on a node device: replies of local backends leaving for the client. On a
/// pod's device: replies to the pod, from wherever its backend is.
#[inline(always)]
pub fn egress<P: Packet>(pkt: &mut P) -> Result<i32, ()> {
    if let Some(f) = parse(pkt) {
        let now = kernel::now_ns();
        if let Some((nat, _)) = reply_nat(&f, now) {
            count(nat::stat::TRANSLATED);
            apply(pkt, &f, &nat)?;
        }
    }
    Ok(P::PASS)
}
