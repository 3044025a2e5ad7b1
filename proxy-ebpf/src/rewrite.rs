//! Writing a flow's translation into its packet: the addresses and ports, the checksums
//! that cover them and, for a packet we send on ourselves, the Ethernet addresses.
//!
//! A header without options (almost every packet) takes one store of its first bytes,
//! from the destination MAC to the destination port, with the IPv4 header checksum worked
//! out here, and one checksum helper call per kind of L4 change (addresses, which the
//! pseudo header covers, and ports, which it does not). Field by field, every address word
//! and port cost a store and one or two checksum calls, and the MACs one more: 6 helper
//! calls for a destination NAT, 10 for a double one, where this takes 3. A translated
//! packet's ingress run pays for each call (the socket buffer checks and fix-ups behind
//! it), on every packet of the flow.

use aya_ebpf::bindings::bpf_fib_lookup as FibParams;
use proxy_common::proto;

use crate::{
    flow::{Flow, Nat},
    ip::Ip,
    packet::{Packet, fold},
};

/// Writes `nat` into the packet, whose tuple as parsed is `f`, and the FIB's MACs from
/// `macs` where given.
#[inline(always)]
pub fn apply<P: Packet, I: Ip>(
    pkt: &mut P,
    f: &Flow<I::Addr>,
    nat: &Nat<I::Addr>,
    macs: Option<&FibParams>,
) -> Result<(), ()> {
    if P::XDP {
        crate::maps::count(proxy_common::nat::stat::XDP);
    }
    if f.l4 == I::L4_PLAIN {
        return apply_at_once::<P, I>(pkt, f, nat, macs);
    }
    // Each rewrite reads only the fields it replaces, so both work from the tuple as parsed.
    if let Some((a, p)) = nat.dst {
        rewrite::<P, I>(pkt, f, false, a, p)?;
    }
    if let Some((a, p)) = nat.src {
        rewrite::<P, I>(pkt, f, true, a, p)?;
    }
    match macs {
        Some(fib) => store_macs(pkt, fib),
        None => Ok(()),
    }
}

/// The one-store path of [`apply`], for a header without options. The headers' 16-bit
/// words are read in memory order; a one's-complement sum is the same in either byte order,
/// so checksums come out right without swapping anything. Not inlined: the headers' copy
/// gets a stack frame of its own, which the redirecting callers' frames have no room for.
#[inline(never)]
fn apply_at_once<P: Packet, I: Ip>(
    pkt: &mut P,
    f: &Flow<I::Addr>,
    nat: &Nat<I::Addr>,
    macs: Option<&FibParams>,
) -> Result<(), ()> {
    let head = I::head().ok_or(())?;
    // SAFETY: a non-null lookup result is this CPU's entry of the map, which stays
    // allocated while we run; programs on one CPU run one at a time, and nothing else in
    // this one refers to it.
    let head = unsafe { &mut *head };
    pkt.load_into(0, head)?;
    let words = head.as_mut();
    // Sums of (!old + new) over the changed 16-bit words: each is the difference its
    // checksum must take in.
    let (mut addrs, mut ports) = (0u32, 0u32);
    let port_word = I::L4_PLAIN / 2;
    if let Some((a, p)) = nat.dst {
        put_addr::<I>(words, I::DST / 2, &a, &mut addrs);
        put_word(words, port_word + 1, p, &mut ports);
    }
    if let Some((a, p)) = nat.src {
        put_addr::<I>(words, I::SRC / 2, &a, &mut addrs);
        put_word(words, port_word, p, &mut ports);
    }
    if let Some(at) = I::L3_CSUM {
        let w = at / 2;
        words[w] = !fold(u32::from(!words[w]) + addrs);
    }
    if let Some(fib) = macs {
        for i in 0..3 {
            words[i] = u16::from_ne_bytes([fib.dmac[2 * i], fib.dmac[2 * i + 1]]);
            words[3 + i] = u16::from_ne_bytes([fib.smac[2 * i], fib.smac[2 * i + 1]]);
        }
    }
    pkt.store(0, &*head)?;
    let (csum, udp) = l4_csum(f);
    if addrs != 0 {
        pkt.l4_csum_diff(csum, addrs, true, udp)?;
    }
    if ports != 0 {
        pkt.l4_csum_diff(csum, ports, false, udp)?;
    }
    Ok(())
}

/// Where the packet's L4 checksum is, and whether it is UDP's (where 0 means "none").
#[inline(always)]
fn l4_csum<A>(f: &Flow<A>) -> (usize, bool) {
    let udp = f.proto == proto::UDP;
    (f.l4 + if udp { 6 } else { 16 }, udp)
}

/// Puts `addr` at word `at`, adding what changed to `diff`.
#[inline(always)]
fn put_addr<I: Ip>(words: &mut [u16], at: usize, addr: &I::Addr, diff: &mut u32) {
    for i in 0..I::WORDS {
        // A 32-bit word as in memory: its first two bytes are the low half on this
        // little-endian target.
        let w = I::word(addr, i);
        put_word(words, at + 2 * i, w as u16, diff);
        put_word(words, at + 2 * i + 1, (w >> 16) as u16, diff);
    }
}

#[inline(always)]
fn put_word(words: &mut [u16], at: usize, new: u16, diff: &mut u32) {
    let old = words[at];
    if old != new {
        *diff += u32::from(!old) + u32::from(new);
        words[at] = new;
    }
}

/// Rewrites one address and port of the packet (`source` picks which), fixing the IP and
/// L4 checksums incrementally, a word of the address at a time. `f` holds the values the
/// packet has now.
#[inline(always)]
fn rewrite<P: Packet, I: Ip>(
    pkt: &mut P,
    f: &Flow<I::Addr>,
    source: bool,
    addr: I::Addr,
    port: u16,
) -> Result<(), ()> {
    let (old_addr, old_port, addr_off, port_off) = if source {
        (f.saddr, f.sport, I::SRC, f.l4)
    } else {
        (f.daddr, f.dport, I::DST, f.l4 + 2)
    };
    let (csum, udp) = l4_csum(f);
    if !I::same(&addr, &old_addr) {
        for i in 0..I::WORDS {
            let (from, to) = (I::word(&old_addr, i), I::word(&addr, i));
            if from != to {
                pkt.l4_csum_replace(csum, from, to, 4, true, udp)?;
                if let Some(l3) = I::L3_CSUM {
                    pkt.l3_csum_replace(l3, from, to)?;
                }
            }
        }
        pkt.store(addr_off, &addr)?;
    }
    if port != old_port {
        pkt.l4_csum_replace(csum, u32::from(old_port), u32::from(port), 2, false, udp)?;
        pkt.store(port_off, &port)?;
    }
    Ok(())
}

/// Writes the FIB's MACs into the Ethernet header: one store of both, where two would
/// each cost a helper call.
#[inline(always)]
pub fn store_macs<P: Packet>(pkt: &mut P, fib: &FibParams) -> Result<(), ()> {
    let mut macs = [0u8; 12];
    macs[..6].copy_from_slice(&fib.dmac);
    macs[6..].copy_from_slice(&fib.smac);
    pkt.store(0, &macs)
}
