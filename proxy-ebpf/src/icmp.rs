//! ICMP "fragmentation needed" and ICMPv6 "packet too big" errors about a flow
//! [`crate::nodeport`] translates, translated back so they reach the end that sent the
//! packet they quote.
//!
//! Path MTU discovery depends on it: a router between this node and a backend on another
//! node answers a packet too big for its next link with an error to the packet's source,
//! our SNAT address, quoting the packet as it left here (our address and SNAT port to the
//! backend). Untranslated, no socket here matches it and the client, which never learns the
//! smaller MTU, stalls. Translated, the client gets an error from the frontend that quotes
//! its own packet (client to frontend), which its socket matches.
//!
//! The quoted tuple, reversed, is a key of the flow table: a reply entry when the error is
//! about a packet that went toward the backend, a forward entry when it is about a reply
//! that went toward the client. Only the first 8 bytes of the quoted L4 header (the ports)
//! are sure to be there; the quoted L4 checksum is left as it is, as receivers ignore it.

use proxy_common::{CtKey, CtValue, nat, proto};

use crate::{
    flow::Flow,
    ip::{ETH_HLEN, Ip, scratch},
    kernel,
    maps::{Lookup, count},
    packet::{FIB_NOT_FWDED, FIB_SUCCESS, Packet},
    rewrite::store_macs,
};

/// Offsets in an ICMP header: its checksum, and the packet it quotes.
const CSUM: usize = 2;
const QUOTE: usize = 8;

/// Whether the frame is an ICMP packet of this family (not a fragment).
#[inline(always)]
pub fn is_icmp<P: Packet, I: Ip>(pkt: &P) -> bool {
    matches!(I::header_at(pkt, ETH_HLEN), Some((p, _)) if p == I::ICMP)
}

/// Translates an ICMP error about one of our flows; anything else passes untouched.
/// `ingress`: the packet arrived on this device (it may be sent on to another one); else it
/// is leaving through it. Not inlined: the TCP/UDP path already uses the stack BPF allows,
/// and this one gets a frame of its own beside it. Returns the verdict itself (see
/// `nodeport::redirect_from_tc`).
#[inline(never)]
pub fn translate<P: Packet, I: Ip>(pkt: &mut P, ingress: bool) -> i32 {
    translate_error::<P, I>(pkt, ingress).unwrap_or(P::PASS)
}

#[inline(always)]
fn translate_error<P: Packet, I: Ip>(pkt: &mut P, ingress: bool) -> Result<i32, ()> {
    let Some(s) = scratch::<I>() else {
        return Ok(P::PASS);
    };
    let Some(icmp) = quoted::<P, I>(pkt, &mut s.flow) else {
        return Ok(P::PASS);
    };
    let (q, e) = (&s.flow, &mut s.work.forward);
    let now = kernel::now_ns();
    let csum = icmp + CSUM;
    let (out_src, out_dst): (I::Addr, I::Addr) =
        (pkt.load(I::SRC).ok_or(())?, pkt.load(I::DST).ok_or(())?);

    // About a packet that went toward the backend: it becomes an error from the frontend
    // to the client about the client's packet to the frontend.
    if entry::<I>(q, nat::dir::REPLY, now, e) {
        let snat = !I::is_zero(&e.snat_addr);
        let client = if snat {
            (e.snat_addr, e.snat_port)
        } else {
            (q.saddr, q.sport)
        };
        rewrite_quoted::<P, I>(pkt, q, csum, client, (e.addr, e.port))?;
        // Sent on from here, or past the stack's routing already: it may come from the
        // frontend. Otherwise the stack routes it, and would take a local source for a
        // martian.
        let from = if snat || !ingress { e.addr } else { out_src };
        set_outer::<P, I>(pkt, csum, I::SRC, out_src, from)?;
        set_outer::<P, I>(pkt, csum, I::DST, out_dst, client.0)?;
        count(nat::stat::ICMP_TRANSLATED);
        if snat && ingress {
            return Ok(send_on::<P, I>(pkt, &mut s.work.fib, from, client.0));
        }
        return Ok(P::PASS);
    }
    if !ingress {
        return Ok(P::PASS);
    }
    // About a reply that went toward the client: it becomes an error to the backend about
    // its reply, as the backend sent it.
    if entry::<I>(q, nat::dir::FORWARD, now, e) {
        let snat = !I::is_zero(&e.snat_addr);
        let client = if snat {
            (e.snat_addr, e.snat_port)
        } else {
            (q.daddr, q.dport)
        };
        rewrite_quoted::<P, I>(pkt, q, csum, (e.addr, e.port), client)?;
        let from = if snat { e.snat_addr } else { out_src };
        set_outer::<P, I>(pkt, csum, I::SRC, out_src, from)?;
        set_outer::<P, I>(pkt, csum, I::DST, out_dst, e.addr)?;
        count(nat::stat::ICMP_TRANSLATED);
        if snat {
            return Ok(send_on::<P, I>(pkt, &mut s.work.fib, from, e.addr));
        }
    }
    Ok(P::PASS)
}

/// For an ICMP error quoting a TCP or UDP packet: the quoted tuple into `q` (its `l4` the
/// quoted L4 header's offset), and the ICMP header's offset.
#[inline(always)]
fn quoted<P: Packet, I: Ip>(pkt: &P, q: &mut Flow<I::Addr>) -> Option<usize> {
    let (p, icmp) = I::header_at(pkt, ETH_HLEN)?;
    let (ty, code): (u8, u8) = (pkt.load(icmp)?, pkt.load(icmp + 1)?);
    if p != I::ICMP || !I::icmp_error(ty, code) {
        return None;
    }
    let ip = icmp + QUOTE;
    let (p, l4) = I::header_at(pkt, ip)?;
    if p != proto::TCP && p != proto::UDP {
        return None;
    }
    q.saddr = pkt.load(ip + I::SRC - ETH_HLEN)?;
    q.daddr = pkt.load(ip + I::DST - ETH_HLEN)?;
    q.sport = pkt.load(l4)?;
    q.dport = pkt.load(l4 + 2)?;
    q.proto = p;
    q.l4 = l4;
    q.tcp_flags = 0;
    Some(icmp)
}

/// The live entry, in direction `dir`, of the flow whose packet `q` quotes (the quoted
/// tuple reversed is how that flow's answers look), copied into `out`.
#[inline(always)]
fn entry<I: Ip>(q: &Flow<I::Addr>, dir: u8, now: u64, out: &mut CtValue<I::Addr>) -> bool {
    let key = CtKey {
        saddr: q.daddr,
        daddr: q.saddr,
        sport: q.dport,
        dport: q.sport,
        proto: q.proto,
        dir,
        _pad: [0; 2],
    };
    match I::ct().lookup(key) {
        Some(e) if !q.expired(e.last_seen_ns, e.flags, now) => {
            *out = e;
            true
        }
        _ => false,
    }
}

/// Gives the quoted packet source `src` and destination `dst`, keeping its IPv4 header
/// checksum and the ICMP checksum right.
#[inline(always)]
fn rewrite_quoted<P: Packet, I: Ip>(
    pkt: &mut P,
    q: &Flow<I::Addr>,
    csum: usize,
    src: (I::Addr, u16),
    dst: (I::Addr, u16),
) -> Result<(), ()> {
    let ip = csum - CSUM + QUOTE;
    let ip_csum = I::L3_CSUM.map(|c| ip + c - ETH_HLEN);
    let before: u16 = match ip_csum {
        Some(c) => pkt.load(c).ok_or(())?,
        None => 0,
    };
    set_quoted_addr::<P, I>(pkt, csum, ip_csum, ip + I::SRC - ETH_HLEN, q.saddr, src.0)?;
    set_quoted_addr::<P, I>(pkt, csum, ip_csum, ip + I::DST - ETH_HLEN, q.daddr, dst.0)?;
    // The quoted header's checksum is part of the ICMP payload too.
    if let Some(c) = ip_csum {
        let after: u16 = pkt.load(c).ok_or(())?;
        if after != before {
            pkt.l4_csum_replace(csum, u32::from(before), u32::from(after), 2, false, false)?;
        }
    }
    set_quoted_port(pkt, csum, q.l4, q.sport, src.1)?;
    set_quoted_port(pkt, csum, q.l4 + 2, q.dport, dst.1)
}

#[inline(always)]
fn set_quoted_addr<P: Packet, I: Ip>(
    pkt: &mut P,
    csum: usize,
    ip_csum: Option<usize>,
    at: usize,
    old: I::Addr,
    new: I::Addr,
) -> Result<(), ()> {
    if I::same(&old, &new) {
        return Ok(());
    }
    for i in 0..I::WORDS {
        let (from, to) = (I::word(&old, i), I::word(&new, i));
        if from != to {
            pkt.l4_csum_replace(csum, from, to, 4, false, false)?;
            if let Some(c) = ip_csum {
                pkt.l3_csum_replace(c, from, to)?;
            }
        }
    }
    pkt.store(at, &new)
}

#[inline(always)]
fn set_quoted_port<P: Packet>(
    pkt: &mut P,
    csum: usize,
    at: usize,
    old: u16,
    new: u16,
) -> Result<(), ()> {
    if old == new {
        return Ok(());
    }
    pkt.l4_csum_replace(csum, u32::from(old), u32::from(new), 2, false, false)?;
    pkt.store(at, &new)
}

/// One of the error's own addresses: in its IPv4 header checksum, or in ICMPv6's pseudo
/// header.
#[inline(always)]
fn set_outer<P: Packet, I: Ip>(
    pkt: &mut P,
    csum: usize,
    at: usize,
    old: I::Addr,
    new: I::Addr,
) -> Result<(), ()> {
    if I::same(&old, &new) {
        return Ok(());
    }
    for i in 0..I::WORDS {
        let (from, to) = (I::word(&old, i), I::word(&new, i));
        if from != to {
            if I::ICMP_PSEUDO {
                pkt.l4_csum_replace(csum, from, to, 4, true, false)?;
            }
            if let Some(l3) = I::L3_CSUM {
                pkt.l3_csum_replace(l3, from, to)?;
            }
        }
    }
    pkt.store(at, &new)
}

/// Sends the translated error out of the device the FIB names: its source may now be a
/// local address, which the stack would drop as martian if it routed it itself.
#[inline(always)]
fn send_on<P: Packet, I: Ip>(
    pkt: &mut P,
    fib: &mut aya_ebpf::bindings::bpf_fib_lookup,
    saddr: I::Addr,
    daddr: I::Addr,
) -> i32 {
    let tot_len = I::tot_len(pkt);
    let to = crate::flow::Leaving {
        saddr,
        daddr,
        sport: 0,
        dport: 0,
        proto: I::ICMP,
    };
    let ret = I::fib_lookup(pkt, fib, &to, tot_len);
    if ret == FIB_NOT_FWDED {
        return P::PASS;
    }
    if !P::can_redirect(ret) {
        count(nat::stat::ICMP_DROPPED);
        return P::DROP;
    }
    if ret == FIB_SUCCESS && store_macs(pkt, fib).is_err() {
        count(nat::stat::ICMP_DROPPED);
        return P::DROP;
    }
    pkt.redirect(ret, fib.ifindex)
}
