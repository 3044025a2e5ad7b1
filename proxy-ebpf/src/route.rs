//! The FIB's answers for the flows the packet path sends on itself, remembered per CPU.
//!
//! Host routing and SNAT send each packet out of the device the FIB names, with the MACs it
//! names. A lookup (the routing table, then the neighbour table, ~130 ns here) is a large
//! share of such a packet's cost, and every packet of a flow asks the same question. So
//! each CPU keeps the answers of its recent flows, one per slot of a direct-mapped table:
//! keyed by everything the lookup is given (the tuple the packet leaves with and the device
//! it came in by), so a hit is the answer the FIB would give, as of at most [`TTL_NS`] ago.
//! A route, a neighbour's address or a pod's device that changes is followed within that
//! time; until then a packet may be sent where the flow's packets went a moment before.
//! Only full answers (FIB_SUCCESS) are kept: the others have the stack or the kernel's
//! neighbour code finish the job, and are rare.
//!
//! Where nothing on the node routes by port (no routing rule selects ports, no multipath
//! hash reads them), every flow between two addresses gets the same answer: the daemon
//! says so (`FP_ROUTE_KEYS`, kept up to date as rules and sysctls change) and the ports
//! are left out of the key. A new flow's first packet then finds the answer its address
//! pair's last flow left, where it would ask the FIB (and miss the cache on a slot of its
//! own): two lookups saved per TCP connection.
//!
//! Per CPU, so that no other CPU can rewrite a slot while a program reads it: the tc and
//! XDP programs, the only ones that use it, run with bottom halves off, one at a time on a
//! CPU. `tests/host_routing.rs` moves a backend's address to another device under a live
//! flow.

use aya_ebpf::bindings::bpf_fib_lookup as FibParams;
use proxy_common::filter::{finish, mix};

use crate::{
    flow::{Leaving, ROUTE_SLOTS, Route},
    ip::Ip,
    kernel,
    maps::{Lookup, POD_DEVICES, ROUTE_KEYS},
    packet::{FIB_SUCCESS, Packet},
};

/// How long an answer is used before the FIB is asked again.
const TTL_NS: u64 = 1_000_000_000;

/// What a slot knows of whether its device is one of the pods': only asked for where a
/// packet may go into a pod's namespace.
const POD_UNKNOWN: u8 = 0;
const POD_NO: u8 = 1;
const POD_YES: u8 = 2;

/// The FIB's answer for a packet leaving as `to`: as [`Ip::fib_lookup`] (on tc, without
/// the MTU check), remembered or fresh, with `p`'s device and MACs filled in on success;
/// and, with `want_pod`, whether that device is one of the pods' (in the pods' device
/// map). `now` is the packet's clock if read (see `flow::clock`), else 0.
#[inline(always)]
pub fn lookup<P: Packet, I: Ip>(
    pkt: &P,
    p: &mut FibParams,
    now: u64,
    to: &Leaving<I::Addr>,
    want_pod: bool,
) -> (i64, bool) {
    let in_ifindex = pkt.ifindex();
    let (sport, dport) = if by_address() {
        (0, 0)
    } else {
        (to.sport, to.dport)
    };
    let mut h = mix(in_ifindex, u32::from(sport) | (u32::from(dport) << 16));
    h = mix(h, u32::from(to.proto));
    for i in 0..I::WORDS {
        h = mix(mix(h, I::word(&to.saddr, i)), I::word(&to.daddr, i));
    }
    let slot = I::routes().get_ptr_mut(finish(h) & (ROUTE_SLOTS - 1));
    let now = if now == 0 { kernel::now_ns() } else { now };
    if let Some(slot) = slot {
        // SAFETY: a non-null pointer from the per-CPU array is this CPU's element of the
        // map's value type, alive as long as the map; only programs on this CPU touch it,
        // one at a time, and this is the only reference into it.
        let r = unsafe { &mut *slot };
        if now < r.expires_ns
            && r.in_ifindex == in_ifindex
            && r.sport == sport
            && r.dport == dport
            && r.proto == to.proto
            && I::same(&r.saddr, &to.saddr)
            && I::same(&r.daddr, &to.daddr)
        {
            p.ifindex = r.out_ifindex;
            copy_mac(&mut p.smac, &r.smac);
            copy_mac(&mut p.dmac, &r.dmac);
            if want_pod && r.pod == POD_UNKNOWN {
                r.pod = pod_device(r.out_ifindex);
            }
            return (FIB_SUCCESS, r.pod == POD_YES);
        }
    }
    let ret = I::fib_lookup(pkt, p, to, 0);
    if ret != FIB_SUCCESS {
        return (ret, false);
    }
    let pod = if want_pod {
        pod_device(p.ifindex)
    } else {
        POD_UNKNOWN
    };
    if let Some(slot) = slot {
        // SAFETY: as above; the reference above has ended.
        let r = unsafe { &mut *slot };
        *r = Route {
            saddr: to.saddr,
            daddr: to.daddr,
            sport,
            dport,
            in_ifindex,
            out_ifindex: p.ifindex,
            proto: to.proto,
            pod,
            _pad: [0; 2],
            smac: p.smac,
            dmac: p.dmac,
            _pad2: 0,
            expires_ns: now + TTL_NS,
        };
    }
    (FIB_SUCCESS, pod == POD_YES)
}

/// Whether the daemon found that no port steers a route here (see the module docs).
/// A MAC copied a byte at a time, inline: an array assignment between two maps' values
/// compiles to a call to a subprogram that moves it byte by byte in a loop (BPF has no
/// memmove of its own), on every redirected packet.
#[inline(always)]
fn copy_mac(dst: &mut [u8; 6], src: &[u8; 6]) {
    for (d, s) in dst.iter_mut().zip(src) {
        // SAFETY: `d` is a live, exclusive byte of `dst`; volatile keeps the compiler from
        // turning the stores back into a memmove call.
        unsafe { core::ptr::write_volatile(d, *s) };
    }
}

#[inline(always)]
fn by_address() -> bool {
    ROUTE_KEYS
        .get(0)
        .is_some_and(|v| *v == proxy_common::maps::ROUTES_BY_ADDRESS)
}

#[inline(always)]
fn pod_device(ifindex: u32) -> u8 {
    if POD_DEVICES.lookup(ifindex).is_some() {
        POD_YES
    } else {
        POD_NO
    }
}
