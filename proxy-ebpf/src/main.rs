//! fastpath's kernel programs.
//!
//! - [`sock4`]: cgroup `sock_addr` hooks for IPv4 (connect, sendmsg, recvmsg, getpeername):
//!   ClusterIP translation at the socket, before a packet exists.
//! - [`sock6`]: the same for IPv6.
//! - [`release`]: cgroup `sock_release`: a closing socket's reverse-NAT entry goes.
//! - [`refuse`]: a pod's UDP to an unused address of the service ranges, answered with
//!   ICMP port unreachable on the pod path.
//! - [`nodeport`]: tc (and XDP) programs on the node's devices: node ports, external and
//!   load-balancer IPs for traffic from other hosts (DNAT, SNAT, reverse NAT, conntrack).
//!   The same per-packet translation on the pods' devices serves pods whose sockets the
//!   hooks leave alone (their UDP by default, everything with host-namespace-only sockets).
//! - [`dsr`]: direct server return's option, added at the entry node and read at the
//!   backend's.
//! - [`filter`]: whether a packet may be a frontend's or a reply, without a hash lookup.
//! - [`flow`]: one packet's tuple and the per-CPU scratch space its translation works in.
//! - [`icmp`]: ICMP "too big" errors about those flows, translated back for the other end.
//! - [`packet`]: what the node-port logic needs from tc and from XDP, implemented for both.
//! - [`rewrite`]: a flow's translation written into its packet, checksums and MACs with it.
//! - [`route`]: the FIB's answers for the flows the packet path sends on, remembered per
//!   CPU for a second.
//! - [`lb`]: backend selection shared by every hook.
//! - [`maglev`]: a packet-path flow's backend from its frontend's Maglev table.
//! - [`ip`]: what differs between IPv4 and IPv6, for the socket and the packet hooks.
//! - [`kernel`]: the BPF helpers whose calls are always sound, as safe functions.
//! - [`maps`]: the maps, laid out in `proxy-common`.
//!
//! Each entry point is a thin wrapper that calls a `try_*` function and turns its error into
//! "let the socket call proceed untouched": a bug or a missing entry must never take down
//! traffic that is not ours.
#![no_std]
#![no_main]

mod dsr;
mod filter;
mod flow;
mod icmp;
mod ip;
mod kernel;
mod lb;
mod maglev;
mod maps;
mod nodeport;
mod packet;
mod refuse;
mod release;
mod rewrite;
mod route;
mod sock4;
mod sock6;

use aya_ebpf::{
    bindings::{TC_ACT_OK, xdp_action},
    macros::{cgroup_sock, cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, SockContext, TcContext, XdpContext},
};

/// Return values of cgroup sock_addr programs.
pub(crate) const PROCEED: i32 = 1;
pub(crate) const REJECT: i32 = 0;

#[cgroup_sock_addr(connect4)]
pub fn fp_connect4(ctx: SockAddrContext) -> i32 {
    sock4::try_connect4(&ctx).unwrap_or(PROCEED)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn fp_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock4::try_sendmsg4(&ctx).unwrap_or(PROCEED)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn fp_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock4::try_rev_translate4(&ctx).unwrap_or(PROCEED)
}

#[cgroup_sock_addr(getpeername4)]
pub fn fp_getpeer4(ctx: SockAddrContext) -> i32 {
    sock4::try_rev_translate4(&ctx).unwrap_or(PROCEED)
}

#[cgroup_sock_addr(connect6)]
pub fn fp_connect6(ctx: SockAddrContext) -> i32 {
    sock6::try_connect6(&ctx).unwrap_or(PROCEED)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn fp_sendmsg6(ctx: SockAddrContext) -> i32 {
    sock6::try_sendmsg6(&ctx).unwrap_or(PROCEED)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn fp_recvmsg6(ctx: SockAddrContext) -> i32 {
    sock6::try_rev_translate6(&ctx).unwrap_or(PROCEED)
}

#[cgroup_sock_addr(getpeername6)]
pub fn fp_getpeer6(ctx: SockAddrContext) -> i32 {
    sock6::try_rev_translate6(&ctx).unwrap_or(PROCEED)
}

/// A socket closing in the cgroup: its reverse-NAT entry goes (see [`release`]).
#[cgroup_sock(sock_release)]
pub fn fp_sock_release(ctx: SockContext) -> i32 {
    release::try_release(&ctx).unwrap_or(PROCEED)
}

/// tc ingress on each node device: new flows to node ports, external and load-balancer
/// IPs, and replies to SNATed flows. An error lets the packet pass as it came.
#[classifier]
pub fn fp_nodeport_in(mut ctx: TcContext) -> i32 {
    nodeport::ingress(&mut ctx).unwrap_or(TC_ACT_OK)
}

/// tc egress on each node device: replies of local backends leaving for the client.
#[classifier]
pub fn fp_nodeport_out(mut ctx: TcContext) -> i32 {
    nodeport::egress(&mut ctx).unwrap_or(TC_ACT_OK)
}

/// tc ingress on a pod's device (host side): the pod's packets to Services, translated per
/// packet (see [`nodeport::ingress_from_pod`]).
#[classifier]
pub fn fp_pod_in(mut ctx: TcContext) -> i32 {
    nodeport::ingress_from_pod(&mut ctx).unwrap_or(TC_ACT_OK)
}

/// tc egress on a pod's device: replies to the pod come from the Service it addressed.
#[classifier]
pub fn fp_pod_out(mut ctx: TcContext) -> i32 {
    nodeport::egress(&mut ctx).unwrap_or(TC_ACT_OK)
}

/// XDP on node devices whose driver runs it natively: the ingress work of
/// [`fp_nodeport_in`] before the kernel allocates a socket buffer. What it cannot finish
/// (a neighbour not yet resolved) it passes on to tc.
#[xdp]
pub fn fp_nodeport_xdp(mut ctx: XdpContext) -> u32 {
    nodeport::ingress(&mut ctx).map_or(xdp_action::XDP_PASS, |v| v as u32)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
