//! Node ports, external IPs and load-balancer IPs: per-packet NAT on the node's devices.
//!
//! Sockets on this node never need this (the cgroup hooks translate them); traffic from
//! other hosts does. The ingress program turns the first packet of a flow into a backend
//! choice recorded in [`CT4`], rewrites the destination to the backend and, when the
//! backend is on another node under externalTrafficPolicy Cluster, the source to this
//! node (SNAT) so the reply comes back here. Packets it rewrote to leave the node are sent
//! straight out of the right device after a FIB lookup: their source is now a local address,
//! which the stack would drop as martian if it routed them itself. Replies are translated
//! back at ingress (SNATed flows: the reply is addressed to us) or at egress (flows to local
//! backends, which answer the client directly through the node).
//!
//! IPv4 only; IPv6, fragments and anything not TCP or UDP pass untouched.

use core::{ffi::c_void, mem};

use aya_ebpf::{
    bindings::{
        BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT,
        bpf_fib_lookup as FibParams,
    },
    helpers::{
        bpf_fib_lookup, bpf_get_prandom_u32, bpf_ktime_get_ns, bpf_redirect, bpf_redirect_neigh,
    },
    maps::lpm_trie::Key as LpmKey,
    programs::TcContext,
};
use proxy_common::{
    AffinityKey, AffinityValue, Backend4, Ct4Key, Ct4Value, Service4Key, ServiceValue,
    SourceRange4, backend, nat, proto,
    service::{flags, scope},
};

use crate::{
    lb::pick_slot,
    maps::{
        AFFINITY, BACKENDS4, CT4, DEVICE_ADDRS4, NODE_ADDRS4, SERVICES4, SOURCE_RANGES4, count,
    },
};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const IP_TOT_LEN: usize = ETH_HLEN + 2;
const IP_FRAG: usize = ETH_HLEN + 6;
const IP_PROTO: usize = ETH_HLEN + 9;
const IP_CSUM: usize = ETH_HLEN + 10;
const IP_SRC: usize = ETH_HLEN + 12;
const IP_DST: usize = ETH_HLEN + 16;
const AF_INET: u8 = 2;
const FIB_SUCCESS: i64 = 0;
const FIB_NOT_FWDED: i64 = 4;
const FIB_NO_NEIGH: i64 = 7;
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
}

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

    fn csum_offset(&self) -> usize {
        self.l4 + if self.proto == proto::TCP { 16 } else { 6 }
    }

    fn timeout_ns(&self) -> u64 {
        if self.proto == proto::TCP { nat::CT_TCP_TIMEOUT_NS } else { nat::CT_UDP_TIMEOUT_NS }
    }
}

#[inline(always)]
fn parse(ctx: &TcContext) -> Option<Flow> {
    let eth_proto: u16 = ctx.load(12).ok()?;
    if u16::from_be(eth_proto) != ETH_P_IP {
        return None;
    }
    let ver_ihl: u8 = ctx.load(ETH_HLEN).ok()?;
    if ver_ihl >> 4 != 4 {
        return None;
    }
    let ihl = usize::from(ver_ihl & 0x0f) * 4;
    if ihl < 20 {
        return None;
    }
    // Fragments carry no ports after the first; leave them to the stack.
    let frag: u16 = ctx.load(IP_FRAG).ok()?;
    if u16::from_be(frag) & 0x3fff != 0 {
        return None;
    }
    let proto: u8 = ctx.load(IP_PROTO).ok()?;
    if proto != proto::TCP && proto != proto::UDP {
        return None;
    }
    let l4 = ETH_HLEN + ihl;
    Some(Flow {
        saddr: ctx.load(IP_SRC).ok()?,
        daddr: ctx.load(IP_DST).ok()?,
        sport: ctx.load(l4).ok()?,
        dport: ctx.load(l4 + 2).ok()?,
        proto,
        l4,
    })
}

/// Rewrites one address and port of the packet (`source` picks which), fixing the IP and
/// L4 checksums incrementally. `f` holds the values the packet has now.
#[inline(always)]
fn rewrite(ctx: &mut TcContext, f: &Flow, source: bool, addr: u32, port: u16) -> Result<(), ()> {
    let (old_addr, old_port, addr_off, port_off) = if source {
        (f.saddr, f.sport, IP_SRC, f.l4)
    } else {
        (f.daddr, f.dport, IP_DST, f.l4 + 2)
    };
    // A UDP checksum of 0 means "none" and must stay 0.
    let mangled = if f.proto == proto::UDP { u64::from(BPF_F_MARK_MANGLED_0) } else { 0 };
    let csum = f.csum_offset();
    if addr != old_addr {
        let pseudo = u64::from(BPF_F_PSEUDO_HDR) | mangled | 4;
        ctx.l4_csum_replace(csum, u64::from(old_addr), u64::from(addr), pseudo).map_err(drop)?;
        ctx.l3_csum_replace(IP_CSUM, u64::from(old_addr), u64::from(addr), 4).map_err(drop)?;
        ctx.store(addr_off, &addr, 0).map_err(drop)?;
    }
    if port != old_port {
        ctx.l4_csum_replace(csum, u64::from(old_port), u64::from(port), mangled | 2)
            .map_err(drop)?;
        ctx.store(port_off, &port, 0).map_err(drop)?;
    }
    Ok(())
}

/// Where a packet to `daddr` leaves the node: the FIB's answer for it.
#[inline(always)]
fn fib_lookup(ctx: &TcContext, f: &Flow, saddr: u32, daddr: u32) -> (i64, FibParams) {
    let mut p: FibParams = unsafe { mem::zeroed() };
    p.family = AF_INET;
    p.l4_protocol = f.proto;
    p.sport = f.sport;
    p.dport = f.dport;
    p.__bindgen_anon_1.tot_len = ctx.load::<u16>(IP_TOT_LEN).map(u16::from_be).unwrap_or(0);
    p.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    p.__bindgen_anon_3.ipv4_src = saddr;
    p.__bindgen_anon_4.ipv4_dst = daddr;
    let ret = unsafe {
        bpf_fib_lookup(
            ctx.skb.skb as *mut c_void,
            &mut p,
            mem::size_of::<FibParams>() as i32,
            0,
        )
    };
    (ret, p)
}

/// Sends the (already translated) packet out of the device the FIB names, with its MACs
/// set, bypassing the stack. Not forwardable (e.g. addressed to this node): let it in.
#[inline(always)]
fn redirect(ctx: &mut TcContext, fib: (i64, FibParams)) -> i32 {
    let (ret, p) = fib;
    match ret {
        FIB_SUCCESS => {
            if ctx.store(0, &p.dmac, 0).is_err() || ctx.store(6, &p.smac, 0).is_err() {
                return TC_ACT_SHOT as i32;
            }
            unsafe { bpf_redirect(p.ifindex, 0) as i32 }
        }
        // The next hop's MAC is not known yet: let the kernel resolve it.
        FIB_NO_NEIGH => unsafe { bpf_redirect_neigh(p.ifindex, core::ptr::null_mut(), 0, 0) as i32 },
        FIB_NOT_FWDED => TC_ACT_OK as i32,
        _ => {
            count(nat::stat::DROP_NAT);
            TC_ACT_SHOT as i32
        }
    }
}

/// Translates a reply (backend -> client or -> our SNAT address) back to what the client
/// expects. Returns the translated flow and whether it was SNATed (its destination was us),
/// or None if the packet is no reply of ours.
#[inline(always)]
fn translate_reply(ctx: &mut TcContext, f: &Flow) -> Result<Option<(Flow, bool)>, ()> {
    let Some(entry) = CT4.get_ptr_mut(&f.key(nat::dir::REPLY)) else {
        return Ok(None);
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let e = unsafe { &mut *entry };
    if now.wrapping_sub(e.last_seen_ns) > f.timeout_ns() {
        return Ok(None);
    }
    e.last_seen_ns = now;
    let (addr, port, client, client_port) = (e.addr, e.port, e.snat_addr, e.snat_port);
    rewrite(ctx, f, true, addr, port)?;
    let mut out = Flow { saddr: addr, sport: port, ..*f };
    if client != 0 {
        rewrite(ctx, &out, false, client, client_port)?;
        out.daddr = client;
        out.dport = client_port;
    }
    count(nat::stat::TRANSLATED);
    Ok(Some((out, client != 0)))
}

/// The master entry of the frontend this packet is addressed to: its own address (external
/// and load-balancer IPs), or any node address (node ports, stored with address 0).
#[inline(always)]
fn frontend(f: &Flow) -> Option<(u32, ServiceValue)> {
    let key = Service4Key::scoped(f.daddr, f.dport, f.proto, 0, scope::PACKET);
    if let Some(m) = unsafe { SERVICES4.get(&key) } {
        return Some((f.daddr, *m));
    }
    unsafe { NODE_ADDRS4.get(&f.daddr) }?;
    let key = Service4Key::scoped(0, f.dport, f.proto, 0, scope::PACKET);
    unsafe { SERVICES4.get(&key) }.map(|m| (0, *m))
}

#[inline(always)]
fn slot_backend(fe_addr: u32, f: &Flow, slot: u16) -> Option<(u32, Backend4)> {
    let key = Service4Key::scoped(fe_addr, f.dport, f.proto, slot, scope::PACKET);
    let id = unsafe { SERVICES4.get(&key) }?.backend_id;
    unsafe { BACKENDS4.get(&id) }.map(|b| (id, *b))
}

/// A backend for a new flow: the client's previous one under ClientIP affinity, if still
/// there and within the timeout; else a uniform pick.
#[inline(always)]
fn choose_backend(fe_addr: u32, f: &Flow, master: &ServiceValue, now: u64) -> Option<(u32, Backend4)> {
    if master.flags & flags::AFFINITY == 0 {
        return slot_backend(fe_addr, f, pick_slot(master.count));
    }
    let key = AffinityKey {
        client: nat::AFFINITY_CLIENT_IP | u64::from(f.saddr),
        rev_nat_index: master.rev_nat_index,
        _pad: [0; 6],
    };
    let timeout_ns = u64::from(master.affinity_timeout) * 1_000_000_000;
    let mut chosen = None;
    if let Some(prev) = unsafe { AFFINITY.get(&key) }
        && now.wrapping_sub(prev.last_used_ns) <= timeout_ns
        && let Some(b) = unsafe { BACKENDS4.get(&prev.backend_id) }
    {
        chosen = Some((prev.backend_id, *b));
    }
    let chosen = match chosen {
        Some(c) => c,
        None => slot_backend(fe_addr, f, pick_slot(master.count))?,
    };
    let value = AffinityValue { backend_id: chosen.0, _pad: 0, last_used_ns: now };
    let _ = AFFINITY.insert(&key, &value, 0);
    Some(chosen)
}

/// A source port on `snat_addr` no other flow to `backend` uses, claimed by writing the
/// reply entry that will translate the backend's answers.
#[inline(always)]
fn claim_snat_port(f: &Flow, b: &Backend4, snat_addr: u32, reply: &Ct4Value, now: u64) -> Option<u16> {
    let span = u32::from(nat::SNAT_PORT_MAX - nat::SNAT_PORT_MIN) + 1;
    for _ in 0..SNAT_TRIES {
        let r = unsafe { bpf_get_prandom_u32() };
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
        if CT4.insert(&key, reply, u64::from(BPF_NOEXIST)).is_ok() {
            return Some(port);
        }
        // Taken: by a live flow, or by one idle past its timeout that we may reuse.
        if let Some(old) = unsafe { CT4.get(&key) }
            && now.wrapping_sub(old.last_seen_ns) > f.timeout_ns()
            && CT4.insert(&key, reply, 0).is_ok()
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
        SourceRange4 { rev_nat_index: master.rev_nat_index, _pad: 0, addr: saddr },
    );
    SOURCE_RANGES4.get(key).is_some()
}

/// A new flow to a frontend: pick the backend, record both directions, translate.
/// Returns the translated flow and whether it was SNATed, or the verdict to return.
#[inline(always)]
fn new_flow(
    ctx: &mut TcContext,
    f: &Flow,
    fe_addr: u32,
    master: &ServiceValue,
    now: u64,
) -> Result<(Flow, bool), i32> {
    let drop_as = |stat| {
        count(stat);
        TC_ACT_SHOT as i32
    };
    if !source_allowed(master, f.saddr) {
        return Err(drop_as(nat::stat::DROP_SOURCE_RANGE));
    }
    // No endpoint (anywhere, or on this node under externalTrafficPolicy Local): drop, as
    // kube-proxy does for traffic from outside.
    if master.count == 0 {
        return Err(drop_as(nat::stat::DROP_NO_BACKEND));
    }
    let Some((backend_id, b)) = choose_backend(fe_addr, f, master, now) else {
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
        let Some(addr) = snat_address(ctx, f, b.address) else {
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
        if CT4.insert(&key, &reply, 0).is_err() {
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
    if CT4.insert(&f.key(nat::dir::FORWARD), &forward, 0).is_err() {
        return Err(drop_as(nat::stat::DROP_NAT));
    }
    count(nat::stat::NEW_FLOW);
    let out = apply_forward(ctx, f, &forward).map_err(|()| TC_ACT_SHOT as i32)?;
    Ok((out, snat))
}

/// The address SNATed traffic to `backend` leaves with: the one configured for the device
/// the FIB sends it out of.
#[inline(always)]
fn snat_address(ctx: &TcContext, f: &Flow, backend: u32) -> Option<u32> {
    let (ret, p) = fib_lookup(ctx, f, 0, backend);
    if ret != FIB_SUCCESS && ret != FIB_NO_NEIGH {
        return None;
    }
    unsafe { DEVICE_ADDRS4.get(&p.ifindex) }.copied()
}

/// Rewrites a client packet as its forward entry says.
#[inline(always)]
fn apply_forward(ctx: &mut TcContext, f: &Flow, e: &Ct4Value) -> Result<Flow, ()> {
    rewrite(ctx, f, false, e.addr, e.port)?;
    let mut out = Flow { daddr: e.addr, dport: e.port, ..*f };
    if e.snat_addr != 0 {
        rewrite(ctx, &out, true, e.snat_addr, e.snat_port)?;
        out.saddr = e.snat_addr;
        out.sport = e.snat_port;
    }
    Ok(out)
}

/// A packet of a flow we already translate, if its backend still serves: refreshes both
/// entries and translates. A backend that left makes the flow start over (a UDP client of
/// a removed backend moves on instead of sending into the void).
#[inline(always)]
fn known_flow(ctx: &mut TcContext, f: &Flow, now: u64) -> Result<Option<(Flow, bool)>, ()> {
    let Some(entry) = CT4.get_ptr_mut(&f.key(nat::dir::FORWARD)) else {
        return Ok(None);
    };
    let e = unsafe { &mut *entry };
    if now.wrapping_sub(e.last_seen_ns) > f.timeout_ns() {
        return Ok(None);
    }
    match unsafe { BACKENDS4.get(&e.backend_id) } {
        Some(b) if b.address == e.addr && b.port == e.port => {}
        _ => return Ok(None),
    }
    e.last_seen_ns = now;
    let reply_key = Ct4Key {
        saddr: e.addr,
        daddr: if e.snat_addr != 0 { e.snat_addr } else { f.saddr },
        sport: e.port,
        dport: if e.snat_addr != 0 { e.snat_port } else { f.sport },
        proto: f.proto,
        dir: nat::dir::REPLY,
        _pad: [0; 2],
    };
    if let Some(r) = CT4.get_ptr_mut(&reply_key) {
        unsafe { (*r).last_seen_ns = now };
    }
    let value = *e;
    count(nat::stat::TRANSLATED);
    Ok(Some((apply_forward(ctx, f, &value)?, value.snat_addr != 0)))
}

pub fn try_nodeport_ingress(ctx: &mut TcContext) -> Result<i32, ()> {
    let Some(f) = parse(ctx) else {
        return Ok(TC_ACT_OK as i32);
    };
    if let Some((out, snat)) = translate_reply(ctx, &f)? {
        // A reply to a SNATed flow now comes from a local address: out directly.
        if snat {
            return Ok(redirect(ctx, fib_lookup(ctx, &out, out.saddr, out.daddr)));
        }
        return Ok(TC_ACT_OK as i32);
    }
    let Some((fe_addr, master)) = frontend(&f) else {
        return Ok(TC_ACT_OK as i32);
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let (out, snat) = match known_flow(ctx, &f, now)? {
        Some(t) => t,
        None => match new_flow(ctx, &f, fe_addr, &master, now) {
            Ok(t) => t,
            Err(verdict) => return Ok(verdict),
        },
    };
    if snat {
        return Ok(redirect(ctx, fib_lookup(ctx, &out, out.saddr, out.daddr)));
    }
    // A local backend: the stack delivers it to the pod as it would any forwarded packet.
    Ok(TC_ACT_OK as i32)
}

pub fn try_nodeport_egress(ctx: &mut TcContext) -> Result<i32, ()> {
    if let Some(f) = parse(ctx) {
        translate_reply(ctx, &f)?;
    }
    Ok(TC_ACT_OK as i32)
}
