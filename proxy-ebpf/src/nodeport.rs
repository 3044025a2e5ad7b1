//! Node ports, external IPs and load-balancer IPs: per-packet NAT on the node's devices.
//!
//! Sockets on this node never need this (the cgroup hooks translate them); traffic from
//! other hosts does. On ingress (tc, or XDP before it where the driver allows), the first
//! packet of a flow picks a backend, recorded in the flow table; the destination becomes
//! the backend and, when the backend is on another node under externalTrafficPolicy
//! Cluster, the source becomes this node (SNAT) so the reply comes back here. Packets that must leave
//! again are sent straight out of the device the FIB names: their source is now a local
//! address, which the stack would drop as martian if it routed them itself. Replies are
//! translated back at ingress (SNATed flows: the reply is addressed to us) or at tc egress
//! (flows to local backends, which answer the client directly through the node).
//!
//! Written once over [`Packet`] for both hooks and over [`Ip`] for both families, each with
//! its own flow table. Fragments, IPv6 extension headers and anything not TCP or UDP pass
//! untouched.

use aya_ebpf::bindings::{BPF_NOEXIST, bpf_fib_lookup as FibParams};
use proxy_common::{
    AffinityKey, AffinityValue, CtKey, CtValue, ServiceValue, backend, nat, proto,
    service::{flags, scope},
    sockcfg,
};

use crate::{
    dsr, filter,
    flow::{self, Flow, Frontend, FrontendAt, Leaving, Nat, Scratch, Work},
    icmp,
    ip::{Backend, Ip, V4, V6, scratch},
    kernel,
    lb::{pick_slot, serves},
    maglev,
    maps::{AFFINITY, Lookup, SOCK_CONFIG, count},
    packet::{FIB_NOT_FWDED, Packet},
    refuse,
    rewrite::{apply, store_macs},
    route,
};

/// Tries at finding a free SNAT port before giving up on a new flow.
const SNAT_TRIES: u32 = 8;

/// Reads the packet's tuple into `f`; None for packets that are not ours to translate.
#[inline(always)]
fn parse<P: Packet, I: Ip>(pkt: &P, f: &mut Flow<I::Addr>) -> Option<()> {
    let (proto, l4) = I::l4(pkt)?;
    f.saddr = pkt.load(I::SRC)?;
    f.daddr = pkt.load(I::DST)?;
    f.sport = pkt.load(l4)?;
    f.dport = pkt.load(l4 + 2)?;
    f.proto = proto;
    f.l4 = l4;
    f.tcp_flags = if proto == proto::TCP {
        pkt.load(l4 + 13)?
    } else {
        0
    };
    Some(())
}

/// Translates the packet and sends it out of the device the FIB names for its new
/// destination; if this hook cannot (XDP), passes it untouched for tc to do the same with
/// the flow entries already in place. A packet it cannot rewrite passes as it is.
#[inline(always)]
fn translate_and_redirect<P: Packet, I: Ip>(
    pkt: &mut P,
    f: &Flow<I::Addr>,
    nat: &Nat<I::Addr>,
    fib: &mut FibParams,
    now: u64,
) -> i32 {
    // XDP always passes, so the compiler would drop the return value of a call and leave
    // the return register undefined, which the verifier rejects: XDP keeps it inline.
    if P::XDP {
        return redirect_translated::<P, I>(pkt, f, nat, fib, now).unwrap_or(P::PASS);
    }
    redirect_from_tc::<P, I>(pkt, f, nat, fib, now)
}

/// Not inlined (see [`new_flow`]), and returning the verdict itself: a result returned
/// through memory leaves a stack address in the return register, which the verifier
/// rejects.
#[inline(never)]
fn redirect_from_tc<P: Packet, I: Ip>(
    pkt: &mut P,
    f: &Flow<I::Addr>,
    nat: &Nat<I::Addr>,
    fib: &mut FibParams,
    now: u64,
) -> i32 {
    redirect_translated::<P, I>(pkt, f, nat, fib, now).unwrap_or(P::PASS)
}

#[inline(always)]
fn redirect_translated<P: Packet, I: Ip>(
    pkt: &mut P,
    f: &Flow<I::Addr>,
    nat: &Nat<I::Addr>,
    fib: &mut FibParams,
    now: u64,
) -> Result<i32, ()> {
    let to = leaving::<I>(f, nat);
    // On tc, no length (as `route` asks): the kernel then checks the socket buffer against
    // the device's MTU, segment by segment for a GSO packet, whose IP length counts all its
    // segments and would fail the check (a client's TSO burst, dropped whole).
    let ret = if P::XDP {
        let tot_len = I::tot_len(pkt);
        I::fib_lookup(pkt, fib, &to, tot_len)
    } else {
        route::lookup::<P, I>(pkt, fib, now, &to, false).0
    };
    if ret == FIB_NOT_FWDED {
        apply::<P, I>(pkt, f, nat, None)?;
        pkt.note_settled(true);
        return Ok(P::PASS);
    }
    if P::XDP {
        return Ok(P::PASS);
    }
    if !P::can_redirect(ret) {
        count(nat::stat::DROP_NAT);
        return Ok(P::DROP);
    }
    // Without a neighbour entry the kernel fills the MACs in (see `Packet::redirect`).
    let macs = (ret == crate::packet::FIB_SUCCESS).then_some(&*fib);
    apply::<P, I>(pkt, f, nat, macs)?;
    pkt.note_settled(true);
    Ok(pkt.redirect(ret, fib.ifindex))
}

/// The tuple a packet of `f` leaves with once `nat` is applied.
#[inline(always)]
fn leaving<I: Ip>(f: &Flow<I::Addr>, nat: &Nat<I::Addr>) -> Leaving<I::Addr> {
    let (daddr, dport) = nat.dst.unwrap_or((f.daddr, f.dport));
    let (saddr, sport) = nat.src.unwrap_or((f.saddr, f.sport));
    Leaving {
        saddr,
        daddr,
        sport,
        dport,
        proto: f.proto,
    }
}

/// A reply (backend -> client, or -> our SNAT address) of a flow we translate: what it
/// must become, into `out` (with a `dst` when the flow was SNATed: then the reply is
/// addressed to us and must be sent on), and the reply entry's flags.
#[inline(always)]
fn reply_nat<I: Ip>(f: &Flow<I::Addr>, out: &mut Nat<I::Addr>, now: &mut u64) -> Option<u16> {
    if !filter::may_be_reply::<I>(&f.saddr, f.sport, f.proto) {
        return None;
    }
    let entry = I::ct().get_ptr_mut(f.key(nat::dir::REPLY))?;
    let now = flow::clock(now);
    // SAFETY: a non-null lookup result is an 8-aligned CtValue that stays allocated while
    // we run (see `maps::Lookup`), and ours is the only reference into it in this program.
    // Other CPUs may update the same entry at the same time, as every BPF program sharing a
    // map may, beyond what Rust's memory model describes; each field is an aligned integer
    // written whole, so the worst is one packet's timestamp or flags update being lost.
    let e = unsafe { &mut *entry };
    if f.expired(e.last_seen_ns, e.flags, now) {
        return None;
    }
    // A SYN-ACK to a connection that ended answers another one on the same tuple, which
    // is not ours: the client dialled the backend itself from the port it had used for
    // the Service (a new connection to the Service would have renewed the entry). The
    // entry goes, or that connection's later packets would be turned back too.
    if f.accepting() && e.flags & nat::ct_flags::CLOSING != 0 {
        let _ = I::ct().remove(f.key(nat::dir::REPLY));
        return None;
    }
    e.last_seen_ns = now;
    e.flags = f.mark(e.flags | nat::ct_flags::SEEN_REPLY);
    let snat = !I::is_zero(&e.snat_addr);
    *out = Nat {
        src: Some((e.addr, e.port)),
        dst: snat.then_some((e.snat_addr, e.snat_port)),
    };
    Some(e.flags)
}

/// Whether a reply translated by `nat`, of a flow whose reply entry has `flags`, would come
/// from one of the node's addresses.
#[inline(always)]
fn restores_node_address<I: Ip>(nat: &Nat<I::Addr>, flags: u16) -> bool {
    if flags & nat::ct_flags::NODE_ADDRESS_KNOWN != 0 {
        return flags & nat::ct_flags::NODE_ADDRESS != 0;
    }
    nat.src.is_some_and(|(addr, _)| I::node_address(addr))
}

/// Which frontends the filters say a packet may be addressed to (see
/// [`filter`]): most packets are no Service's, and the filters spare them every lookup.
#[derive(Clone, Copy)]
struct MayBe {
    /// A frontend at the packet's own destination address.
    own: bool,
    /// A node port (then only if the destination is a node address).
    node_port: bool,
}

impl MayBe {
    #[inline(always)]
    fn of<I: Ip>(f: &Flow<I::Addr>) -> Self {
        Self {
            own: filter::may_be_frontend::<I>(&f.daddr),
            node_port: filter::may_be_node_port(f.dport, f.proto),
        }
    }

    fn any(self) -> bool {
        self.own || self.node_port
    }
}

/// The master entry of the frontend this packet is addressed to: its own address (external
/// and load-balancer IPs), or any node address (node ports, stored with address 0). From a
/// pod, first the frontends the node's own sockets see (ClusterIPs, internalTrafficPolicy),
/// as kube-proxy's PREROUTING rules treat a pod's packets.
#[inline(always)]
fn frontend<I: Ip>(f: &Flow<I::Addr>, from_pod: bool, may: MayBe) -> Option<Frontend<I::Addr>> {
    let at = |addr, scope| {
        I::service(addr, f.dport, f.proto, 0, scope).map(|master| Frontend {
            at: (addr, scope),
            master,
        })
    };
    if may.own {
        if from_pod && let Some(fe) = at(f.daddr, scope::SOCKET) {
            return Some(fe);
        }
        if let Some(fe) = at(f.daddr, scope::PACKET) {
            return Some(fe);
        }
    }
    if !may.node_port || !I::node_address(f.daddr) {
        return None;
    }
    at(I::Addr::default(), scope::PACKET)
}

#[inline(always)]
fn slot_backend<I: Ip>(
    fe: FrontendAt<I::Addr>,
    f: &Flow<I::Addr>,
    slot: u16,
) -> Option<(u32, Backend<I::Addr>)> {
    let id = I::service(fe.0, f.dport, f.proto, slot, fe.1)?.backend_id;
    I::backend(id).map(|b| (id, b))
}

/// A fresh pick for a new flow: from the frontend's Maglev table where it has one, else
/// uniform.
#[inline(always)]
fn pick_backend<I: Ip>(
    fe: FrontendAt<I::Addr>,
    f: &Flow<I::Addr>,
    master: &ServiceValue,
) -> Option<(u32, Backend<I::Addr>)> {
    if master.flags & flags::MAGLEV != 0
        && let Some(chosen) = maglev::backend::<I>(f, master)
    {
        return Some(chosen);
    }
    slot_backend::<I>(fe, f, pick_slot(master.count))
}

/// A backend for a new flow: the client's previous one under ClientIP affinity, if it
/// still serves the frontend and within the timeout; else a fresh pick.
#[inline(always)]
fn choose_backend<I: Ip>(
    fe: FrontendAt<I::Addr>,
    f: &Flow<I::Addr>,
    master: &ServiceValue,
    now: u64,
) -> Option<(u32, Backend<I::Addr>)> {
    if master.flags & flags::AFFINITY == 0 {
        return pick_backend::<I>(fe, f, master);
    }
    let key = AffinityKey {
        client: I::affinity_client(f.saddr),
        rev_nat_index: master.rev_nat_index,
        _pad: [0; 6],
    };
    let timeout_ns = u64::from(master.affinity_timeout) * 1_000_000_000;
    let mut chosen = None;
    if let Some(prev) = AFFINITY.lookup(key)
        && kernel::age(now, prev.last_used_ns) <= timeout_ns
        && serves(prev.backend_id, master.rev_nat_index)
        && let Some(b) = I::backend(prev.backend_id)
    {
        chosen = Some((prev.backend_id, b));
    }
    let chosen = match chosen {
        Some(c) => c,
        None => pick_backend::<I>(fe, f, master)?,
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
/// reply entry that will translate the backend's answers. Err: the drop's counter.
#[inline(always)]
fn claim_snat_port<I: Ip>(
    f: &Flow<I::Addr>,
    b: &Backend<I::Addr>,
    snat_addr: I::Addr,
    reply: &CtValue<I::Addr>,
    now: u64,
) -> Result<u16, u32> {
    let span = u32::from(nat::SNAT_PORT_MAX - nat::SNAT_PORT_MIN) + 1;
    filter::note_reply::<I>(&b.addr, b.port, f.proto);
    for _ in 0..SNAT_TRIES {
        let r = kernel::random_u32();
        let port = (nat::SNAT_PORT_MIN + (r % span) as u16).to_be();
        let key = CtKey {
            saddr: b.addr,
            daddr: snat_addr,
            sport: b.port,
            dport: port,
            proto: f.proto,
            dir: nat::dir::REPLY,
            _pad: [0; 2],
        };
        match record::<I>(key, reply, u64::from(BPF_NOEXIST)) {
            Ok(()) => return Ok(port),
            Err(nat::stat::DROP_FLOW_TABLE_FULL) => return Err(nat::stat::DROP_FLOW_TABLE_FULL),
            Err(_) => {}
        }
        // Taken: by a live flow, or by one idle past its timeout that we may reuse.
        if let Some(old) = I::ct().lookup(key)
            && f.expired(old.last_seen_ns, old.flags, now)
            && I::ct().insert(key, reply, 0).is_ok()
        {
            return Ok(port);
        }
    }
    Err(nat::stat::DROP_NAT)
}

/// Writes a flow entry; Err: the counter of the drop it causes, a full flow table's apart
/// (see `maps::CT4`).
#[inline(always)]
fn record<I: Ip>(key: CtKey<I::Addr>, value: &CtValue<I::Addr>, flags: u64) -> Result<(), u32> {
    // The kernel's answer when a preallocated hash map has no free element.
    const E2BIG: i32 = 7;
    I::ct().insert(key, value, flags).map_err(|e| {
        if e == -E2BIG {
            nat::stat::DROP_FLOW_TABLE_FULL
        } else {
            nat::stat::DROP_NAT
        }
    })
}

/// Whether the client may use this frontend (loadBalancerSourceRanges).
#[inline(always)]
fn source_allowed<I: Ip>(master: &ServiceValue, saddr: I::Addr) -> bool {
    master.flags & flags::SOURCE_RANGES == 0 || I::in_source_range(master.rev_nat_index, saddr)
}

/// The address SNATed traffic to `backend` leaves with: the one configured for the device
/// the FIB sends it out of.
#[inline(always)]
fn snat_address<P: Packet, I: Ip>(
    pkt: &P,
    f: &Flow<I::Addr>,
    backend: I::Addr,
    p: &mut FibParams,
) -> Option<I::Addr> {
    let to = Leaving {
        saddr: I::Addr::default(),
        daddr: backend,
        sport: f.sport,
        dport: f.dport,
        proto: f.proto,
    };
    let ret = I::fib_lookup(pkt, p, &to, 0);
    if ret != crate::packet::FIB_SUCCESS && ret != crate::packet::FIB_NO_NEIGH {
        return None;
    }
    I::device_address(p.ifindex)
}

/// A new flow to the frontend in `w.frontend`: pick the backend and record both
/// directions, the forward entry left in `w.forward`. Err: the verdict for a packet that may not pass. Not
/// inlined, so its temporaries have a stack frame of their own.
#[inline(never)]
fn new_flow<P: Packet, I: Ip>(
    pkt: &P,
    f: &Flow<I::Addr>,
    now: u64,
    w: &mut Work<I::Addr>,
) -> Result<(), i32> {
    let (fe, master) = (w.frontend.at, &w.frontend.master);
    let drop_as = |stat| {
        count(stat);
        P::DROP
    };
    if !source_allowed::<I>(master, f.saddr) {
        return Err(drop_as(nat::stat::DROP_SOURCE_RANGE));
    }
    // No endpoint (anywhere, or on this node under externalTrafficPolicy Local): drop, as
    // kube-proxy does for traffic from outside.
    if master.count == 0 {
        return Err(drop_as(nat::stat::DROP_NO_BACKEND));
    }
    let Some((backend_id, b)) = choose_backend::<I>(fe, f, master, now) else {
        return Err(drop_as(nat::stat::DROP_NO_BACKEND));
    };
    // Hairpin: a pod's flow that picked the pod itself. With its own address as the source
    // its stack would drop the packet as a martian, so the source becomes the address the
    // pod dialled (kube-proxy masquerades such traffic to the node's address instead).
    let hairpin = I::same(&b.addr, &f.saddr);
    let remote = b.flags & backend::flags::LOCAL == 0;
    // Direct server return for traffic from other hosts to other nodes' backends (the
    // caller clears the flag for a pod's own traffic).
    let dsr = !hairpin && remote && master.flags & flags::DSR != 0;
    let snat = hairpin || (!dsr && master.flags & flags::SNAT != 0 && remote);
    let ct_flags = if dsr { nat::ct_flags::DSR } else { 0 };
    let reply = &mut w.reply;
    *reply = CtValue {
        addr: f.daddr,
        port: f.dport,
        rev_nat_index: master.rev_nat_index,
        backend_id,
        last_seen_ns: now,
        flags: ct_flags,
        ..Default::default()
    };
    let (mut snat_addr, mut snat_port) = (I::Addr::default(), 0);
    if snat {
        let addr = if hairpin {
            f.daddr
        } else {
            let Some(addr) = snat_address::<P, I>(pkt, f, b.addr, &mut w.fib) else {
                return Err(drop_as(nat::stat::DROP_NAT));
            };
            addr
        };
        reply.snat_addr = f.saddr;
        reply.snat_port = f.sport;
        let port = claim_snat_port::<I>(f, &b, addr, reply, now).map_err(drop_as)?;
        (snat_addr, snat_port) = (addr, port);
    } else {
        let key = CtKey {
            saddr: b.addr,
            daddr: f.saddr,
            sport: b.port,
            dport: f.sport,
            proto: f.proto,
            dir: nat::dir::REPLY,
            _pad: [0; 2],
        };
        // Node ports are on node addresses; other frontends may be (an external IP).
        let node_address = I::is_zero(&fe.0) || I::node_address(f.daddr);
        reply.flags |= nat::ct_flags::NODE_ADDRESS_KNOWN;
        if node_address {
            reply.flags |= nat::ct_flags::NODE_ADDRESS;
        }
        // By reference: the entry stays in the scratch map instead of a stack copy.
        let reply: &CtValue<I::Addr> = reply;
        filter::note_reply::<I>(&b.addr, b.port, f.proto);
        record::<I>(key, reply, 0).map_err(drop_as)?;
    }
    let forward = &mut w.forward;
    *forward = CtValue {
        addr: b.addr,
        port: b.port,
        rev_nat_index: master.rev_nat_index,
        snat_addr,
        snat_port,
        backend_id,
        last_seen_ns: now,
        flags: ct_flags,
        ..Default::default()
    };
    record::<I>(f.key(nat::dir::FORWARD), forward, 0).map_err(drop_as)?;
    count(nat::stat::NEW_FLOW);
    Ok(())
}

/// How long a known flow's packets go without its frontend and its reply entry being
/// looked up (see [`forward_entry`]): only a flow's first packet past it refreshes both
/// entries, and the forward entry's `last_seen_ns` says when that was.
const REFRESH_NS: u64 = 1_000_000_000;

/// Whether the backend a flow's forward entry `e` chose is still in the service maps,
/// with the address and port the flow was given.
#[inline(always)]
fn backend_holds<I: Ip>(e: &CtValue<I::Addr>) -> bool {
    matches!(I::backend(e.backend_id), Some(b) if I::same(&b.addr, &e.addr) && b.port == e.port)
}

/// Whether the flow with forward entry `e`, whose backend still serves, holds, looked at
/// whole: checks and refreshes both its entries. The flow starts over when its reply entry
/// expired or went to another flow (its SNAT port was reused), or when a closing TCP
/// flow's client port opens a new connection.
#[inline(always)]
fn known_flow<I: Ip>(f: &Flow<I::Addr>, e: &mut CtValue<I::Addr>, now: u64) -> bool {
    let snat = !I::is_zero(&e.snat_addr);
    let reply_key = e.reply_key(snat, f.saddr, f.sport, f.proto);
    let Some(r) = I::ct().get_ptr_mut(reply_key) else {
        return false;
    };
    // SAFETY: as in `reply_nat`: a live, aligned CtValue of plain integers; a REPLY key,
    // so a different entry from `e`'s FORWARD one.
    let r = unsafe { &mut *r };
    let ours = !snat || (I::same(&r.snat_addr, &f.saddr) && r.snat_port == f.sport);
    let last_seen = if e.last_seen_ns > r.last_seen_ns {
        e.last_seen_ns
    } else {
        r.last_seen_ns
    };
    if !ours
        || f.expired(last_seen, r.flags, now)
        || (f.opening() && r.flags & nat::ct_flags::CLOSING != 0)
    {
        return false;
    }
    e.last_seen_ns = now;
    r.last_seen_ns = now;
    e.flags = f.mark(e.flags);
    r.flags = f.mark(r.flags);
    true
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

/// Which family's code a frame goes to; other EtherTypes (ARP, ...) are not ours.
#[inline(always)]
fn eth_proto<P: Packet>(pkt: &P) -> u16 {
    pkt.load::<u16>(12).map(u16::from_be).unwrap_or(0)
}

#[inline(always)]
fn translate_ingress<P: Packet>(pkt: &mut P, from_pod: bool) -> Result<i32, ()> {
    pkt.note_settled(false);
    match eth_proto(pkt) {
        // XDP cannot send the translated error on (see `Packet::can_redirect`): tc does.
        V4::ETH_P if icmp::is_icmp::<P, V4>(pkt) && !P::XDP => {
            Ok(icmp::translate::<P, V4>(pkt, true))
        }
        V6::ETH_P if icmp::is_icmp::<P, V6>(pkt) && !P::XDP => {
            Ok(icmp::translate::<P, V6>(pkt, true))
        }
        V4::ETH_P => translate_ingress_ip::<P, V4>(pkt, from_pod),
        V6::ETH_P => translate_ingress_ip::<P, V6>(pkt, from_pod),
        _ => Ok(P::PASS),
    }
}

// Not inlined: each family's path gets a stack frame of its own, where inlined both would
// share one and overflow the 512 bytes BPF allows.
#[inline(never)]
fn translate_ingress_ip<P: Packet, I: Ip>(pkt: &mut P, from_pod: bool) -> Result<i32, ()> {
    let Some(Scratch { flow: f, work: w }) = scratch::<I>() else {
        return Ok(P::PASS);
    };
    if parse::<P, I>(pkt, f).is_none() {
        return Ok(P::PASS);
    }
    let f = &*f;
    w.now = 0;
    // A DSR flow's packet from its entry node, for a backend here: remember what the
    // backend's answers must come from, and deliver it.
    if !from_pod && let Some(frontend) = dsr::frontend::<P, I>(pkt) {
        record_dsr_reply::<I>(f, frontend, w);
        return Ok(P::PASS);
    }
    // A flow's packet has a forward entry or a reply entry; only looking says which. The
    // likelier is looked up first, so that most packets make one lookup in the flow table
    // rather than two.
    let forward_first = likely_forward::<I>(f);
    let mut found = if forward_first {
        forward_entry::<P, I>(f, from_pod, w)
    } else {
        Found::Nothing
    };
    if found != Found::Flow {
        // A bare SYN is no reply of a flow we translate (a server answers with SYN-ACK):
        // it opens a flow of ours or is none of ours, without a look at the reply filter,
        // whose slot for a fresh client port is seldom in the cache.
        if !f.opening()
            && let Some(flags) = reply_nat::<I>(f, &mut w.nat, &mut w.now)
        {
            return Ok(translate_reply::<P, I>(pkt, f, from_pod, flags, w));
        }
        // No reply of ours: nor will the egress of the device it leaves by find one (the
        // same lookup), which may skip it.
        pkt.note_settled(true);
        if !forward_first {
            found = forward_entry::<P, I>(f, from_pod, w);
        }
    }
    let fresh = match found {
        Found::Flow => false,
        Found::Frontend => {
            let now = flow::clock(&mut w.now);
            if let Err(verdict) = new_flow::<P, I>(pkt, f, now, w) {
                return Ok(verdict);
            }
            true
        }
        Found::Pass => return Ok(P::PASS),
        Found::Nothing => {
            // A pod's UDP to an address of the service ranges nobody holds: refused at
            // once, as the socket hooks refuse it (TCP from pods stays with the hooks).
            if from_pod && f.proto == proto::UDP && I::in_service_range(f.daddr) {
                count(nat::stat::REFUSED_SERVICE_RANGE);
                return Ok(if I::ETH_P == V4::ETH_P {
                    refuse::port_unreachable4(pkt)
                } else {
                    refuse::port_unreachable6(pkt)
                });
            }
            return Ok(P::PASS);
        }
    };
    let e = &w.forward;
    let snat = !I::is_zero(&e.snat_addr);
    let nat = Nat {
        dst: Some((e.addr, e.port)),
        src: snat.then_some((e.snat_addr, e.snat_port)),
    };
    if e.flags & nat::ct_flags::DSR != 0 {
        // The first packet here (the backend's node may not know the flow) and every SYN
        // (a retried or reused connection) carry the frontend.
        let option = fresh || f.opening();
        return Ok(dsr_forward::<P, I>(pkt, f, &nat, option, &mut w.fib));
    }
    if snat {
        return Ok(translate_and_redirect::<P, I>(
            pkt, f, &nat, &mut w.fib, w.now,
        ));
    }
    // A local backend: the stack delivers it to the pod as it would any forwarded packet,
    // or, with host routing on, we do.
    Ok(to_local_pod::<P, I>(pkt, f, &nat, &mut w.fib, w.now))
}

/// What [`forward_entry`] found for a packet.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Found {
    /// No frontend: a reply, or not ours.
    Nothing,
    /// A frontend (in `w.frontend`) but no flow to it yet.
    Frontend,
    /// A frontend and the packet's flow to it (in `w.forward`).
    Flow,
    /// A frontend this hook leaves to another (XDP: DSR's, which grows the packet).
    Pass,
}

/// Whether the packet looks like a flow's forward packet rather than a reply. Clients send
/// from the higher port: ephemeral ports (Linux: 32768 and up) to a service's port or a
/// node port (30000-32767), and SNATed flows' replies come back to SNAT's ports (61000 and
/// up). It only orders the lookups: a packet it guesses wrong is looked up both ways.
#[inline(always)]
fn likely_forward<I: Ip>(f: &Flow<I::Addr>) -> bool {
    u16::from_be(f.dport) < u16::from_be(f.sport)
}

/// The flow the packet belongs to, if known (into `w.forward`), and otherwise the frontend
/// it is addressed to (into `w.frontend`).
///
/// A flow starts over when its backend left the service (a UDP client of a removed backend
/// moves on instead of sending into the void). Within [`REFRESH_NS`] of the flow's last
/// full look, a packet that does not open a connection is not looked up in the service
/// maps (a removed Service's flows still end at once, as the filters checked first clear
/// its slot; where another address shares the slot, within that second), and one that
/// does not end it either skips the reply entry too: that entry can neither have expired
/// (every timeout is far longer) nor gone to another flow. Not inlined: it has two callers,
/// and its temporaries get a frame of their own.
#[inline(never)]
fn forward_entry<P: Packet, I: Ip>(
    f: &Flow<I::Addr>,
    from_pod: bool,
    w: &mut Work<I::Addr>,
) -> Found {
    let may = MayBe::of::<I>(f);
    if !may.any() {
        return Found::Nothing;
    }
    let entry = I::ct().get_ptr_mut(f.key(nat::dir::FORWARD));
    let now = if entry.is_some() {
        flow::clock(&mut w.now)
    } else {
        0
    };
    // Whether the entry may still be the flow's, as far as looked at.
    let mut holds = entry.is_some();
    if let Some(entry) = entry {
        // SAFETY: as in `reply_nat`: a live, aligned CtValue of plain integers, and the
        // only reference into it in this program.
        let e = unsafe { &mut *entry };
        // A connection opening on the port of one that ended is a new flow: its reply
        // entry, marked closing with this one, need not be looked at.
        let reopened = f.opening() && e.flags & nat::ct_flags::CLOSING != 0;
        if reopened || !backend_holds::<I>(e) {
            holds = false;
        } else if !f.opening() && kernel::age(now, e.last_seen_ns) < REFRESH_NS {
            // DSR grows the packet, which XDP cannot: tc takes such flows whole.
            if P::XDP && e.flags & nat::ct_flags::DSR != 0 {
                return Found::Pass;
            }
            let quiet = !f.ending() && e.flags & nat::ct_flags::CLOSING == 0;
            if quiet || known_flow::<I>(f, e, now) {
                count(nat::stat::TRANSLATED);
                w.forward = *e;
                return Found::Flow;
            }
            holds = false;
        }
    }
    let Some(fe) = frontend::<I>(f, from_pod, may) else {
        return Found::Nothing;
    };
    if P::XDP && fe.master.flags & flags::DSR != 0 {
        return Found::Pass;
    }
    w.frontend = fe;
    if from_pod {
        // A pod's traffic to a node port or external IP keeps the plain path.
        w.frontend.master.flags &= !flags::DSR;
    }
    if let Some(entry) = entry
        && holds
    {
        // SAFETY: as above; the reference above has ended.
        let e = unsafe { &mut *entry };
        if known_flow::<I>(f, e, now) {
            count(nat::stat::TRANSLATED);
            w.forward = *e;
            return Found::Flow;
        }
    }
    Found::Frontend
}

/// A reply of a flow we translate (`w.nat` and its entry's `flags`, see [`reply_nat`]),
/// turned back into what its client expects.
#[inline(always)]
fn translate_reply<P: Packet, I: Ip>(
    pkt: &mut P,
    f: &Flow<I::Addr>,
    from_pod: bool,
    flags: u16,
    w: &mut Work<I::Addr>,
) -> i32 {
    let (nat, fib, now) = (&w.nat, &mut w.fib, w.now);
    // An SNATed flow's reply is addressed to us, and goes on to the client.
    let snat = nat.dst.is_some();
    if from_pod && !snat && restores_node_address::<I>(nat, flags) {
        // A local backend's reply to a node port (or to any frontend on a node address):
        // from the node's own address, the stack routing it from here would drop it as a
        // martian. With host routing it goes out of the device the FIB names, past the
        // host's stack as the request came in. Otherwise it goes on as the backend sent it,
        // and the egress of the device it leaves by (the node device's, or the client
        // pod's) turns it back, as it does without the pod path.
        if !host_routing() {
            return P::PASS;
        }
        count(nat::stat::TRANSLATED);
        return translate_and_redirect::<P, I>(pkt, f, nat, fib, now);
    }
    count(nat::stat::TRANSLATED);
    if snat {
        return translate_and_redirect::<P, I>(pkt, f, nat, fib, now);
    }
    if from_pod {
        return to_local_pod::<P, I>(pkt, f, nat, fib, now);
    }
    if apply::<P, I>(pkt, f, nat, None).is_err() {
        return P::PASS;
    }
    pkt.note_settled(true);
    P::PASS
}

/// Whether the daemon turned host routing on (see `proxy_common::sockcfg::flags`).
#[inline(always)]
fn host_routing() -> bool {
    SOCK_CONFIG
        .get(0)
        .is_some_and(|c| c.flags & sockcfg::flags::HOST_ROUTING != 0)
}

/// A translated packet for a local backend (or a local backend's reply to a pod): with
/// host routing on and a destination behind one of the pods' devices, straight into that
/// pod's namespace, past the host's routing, netfilter and backlog queue; otherwise on
/// through the host's stack. Not inlined, as [`redirect_from_tc`].
#[inline(never)]
fn to_local_pod<P: Packet, I: Ip>(
    pkt: &mut P,
    f: &Flow<I::Addr>,
    nat: &Nat<I::Addr>,
    fib: &mut FibParams,
    now: u64,
) -> i32 {
    // The route first, so that its MACs go into the packet with the translation.
    let peer = !P::XDP && host_routing() && {
        let (ret, pod) = route::lookup::<P, I>(pkt, fib, now, &leaving::<I>(f, nat), true);
        ret == crate::packet::FIB_SUCCESS && pod
    };
    if apply::<P, I>(pkt, f, nat, peer.then_some(&*fib)).is_err() {
        return P::PASS;
    }
    pkt.note_settled(true);
    if !peer {
        return P::PASS;
    }
    pkt.redirect_peer(fib.ifindex)
}

/// Sends a DSR flow's packet to its backend's node: destination translated, source kept,
/// the frontend in an option when `option`, out of the device the FIB names. Not inlined,
/// as [`redirect_from_tc`].
#[inline(never)]
fn dsr_forward<P: Packet, I: Ip>(
    pkt: &mut P,
    f: &Flow<I::Addr>,
    nat: &Nat<I::Addr>,
    option: bool,
    fib: &mut FibParams,
) -> i32 {
    if nat.dst.is_none() {
        return P::PASS;
    }
    let (ret, _) = route::lookup::<P, I>(pkt, fib, 0, &leaving::<I>(f, nat), false);
    if !P::can_redirect(ret) {
        count(nat::stat::DROP_NAT);
        return P::DROP;
    }
    if apply::<P, I>(pkt, f, nat, None).is_err() {
        return P::PASS;
    }
    // Without its option the backend's answer would come from its own address, which the
    // client drops: still better sent than dropped here (the backend's node may know the
    // flow from an earlier packet).
    if option {
        let _ = dsr::push::<P, I>(pkt, f.daddr, f.dport);
    }
    pkt.note_settled(true);
    if ret == crate::packet::FIB_SUCCESS && store_macs(pkt, fib).is_err() {
        return P::DROP;
    }
    pkt.redirect(ret, fib.ifindex)
}

/// On the backend's node: the reply entry that turns the backend's answers to the client
/// back into the frontend's (at this node's egress), from a DSR option.
#[inline(always)]
fn record_dsr_reply<I: Ip>(f: &Flow<I::Addr>, frontend: (I::Addr, u16), w: &mut Work<I::Addr>) {
    w.reply = CtValue {
        addr: frontend.0,
        port: frontend.1,
        last_seen_ns: kernel::now_ns(),
        flags: nat::ct_flags::DSR,
        ..Default::default()
    };
    let key = CtKey {
        saddr: f.daddr,
        daddr: f.saddr,
        sport: f.dport,
        dport: f.sport,
        proto: f.proto,
        dir: nat::dir::REPLY,
        _pad: [0; 2],
    };
    let reply: &CtValue<I::Addr> = &w.reply;
    filter::note_reply::<I>(&f.daddr, f.dport, f.proto);
    let _ = I::ct().insert(key, reply, 0);
}

/// tc egress on a node device: replies of local backends leaving for the client. On a
/// pod's device: replies to the pod, from wherever its backend is.
#[inline(always)]
pub fn egress<P: Packet>(pkt: &mut P) -> Result<i32, ()> {
    // Translated at ingress, or looked up there and found no reply of ours: nothing here
    // can be a reply still to turn back.
    if pkt.was_settled() {
        return Ok(P::PASS);
    }
    match eth_proto(pkt) {
        V4::ETH_P if icmp::is_icmp::<P, V4>(pkt) => Ok(icmp::translate::<P, V4>(pkt, false)),
        V6::ETH_P if icmp::is_icmp::<P, V6>(pkt) => Ok(icmp::translate::<P, V6>(pkt, false)),
        V4::ETH_P => egress_ip::<P, V4>(pkt),
        V6::ETH_P => egress_ip::<P, V6>(pkt),
        _ => Ok(P::PASS),
    }
}

#[inline(never)]
fn egress_ip<P: Packet, I: Ip>(pkt: &mut P) -> Result<i32, ()> {
    let Some(s) = scratch::<I>() else {
        return Ok(P::PASS);
    };
    if parse::<P, I>(pkt, &mut s.flow).is_some() {
        let f = &s.flow;
        s.work.now = 0;
        if reply_nat::<I>(f, &mut s.work.nat, &mut s.work.now).is_some() {
            count(nat::stat::TRANSLATED);
            apply::<P, I>(pkt, f, &s.work.nat, None)?;
        }
    }
    Ok(P::PASS)
}
