//! The BPF helpers that take nothing but plain values or the program's own context, as safe
//! functions: one argument for why each call is sound instead of one per call site.

use aya_ebpf::{
    EbpfContext,
    helpers::{
        bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_ktime_get_coarse_ns,
        bpf_ktime_get_ns,
    },
    programs::{SockAddrContext, SockContext},
};

/// Nonzero where the kernel has `bpf_ktime_get_coarse_ns` (Linux 5.11): set by the daemon
/// at load time, read-only, so the verifier drops the branch this kernel cannot take.
#[unsafe(no_mangle)]
static COARSE_CLOCK: u8 = 0;

/// Monotonic nanoseconds (CLOCK_MONOTONIC, as the daemon's census reads it), to a tick.
/// Every timeout stamped with it is a second or longer, and reading the clock source was
/// ~8% of the programs' time per packet (`read_tsc`, measured in a VM); the coarse clock
/// is a load of the last tick's time, as Cilium's jiffies are.
#[inline(always)]
pub fn now_ns() -> u64 {
    // SAFETY: a read-only global the loader set before the program was loaded.
    if unsafe { core::ptr::read_volatile(&COARSE_CLOCK) } != 0 {
        // SAFETY: takes no arguments and touches no memory of ours.
        unsafe { bpf_ktime_get_coarse_ns() }
    } else {
        // SAFETY: as above.
        unsafe { bpf_ktime_get_ns() }
    }
}

/// How long before `now` a map entry was stamped `then`: 0 for a stamp after `now`, which
/// another CPU writes when its packet of the same flow read its clock after this one did.
/// A wrapping difference made such an entry look ~584 years old: expired, so a live
/// flow's next packet started it over as a new flow and lost its state.
#[inline(always)]
pub fn age(now: u64, then: u64) -> u64 {
    now.saturating_sub(then)
}

#[inline(always)]
pub fn random_u32() -> u32 {
    // SAFETY: takes no arguments and touches no memory of ours.
    unsafe { bpf_get_prandom_u32() }
}

/// The cookie of the socket making this call.
#[inline(always)]
pub fn socket_cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: the pointer is the context the kernel passed this sock_addr program, which is
    // what the helper takes; it only reads the socket behind it.
    unsafe { bpf_get_socket_cookie(ctx.as_ptr()) }
}

/// The cookie of the socket a cgroup sock program (create, release) runs for.
#[inline(always)]
pub fn sock_cookie(ctx: &SockContext) -> u64 {
    // SAFETY: the pointer is the bpf_sock context the kernel passed this cgroup sock
    // program, which the helper takes (since Linux 5.8); it only reads the socket.
    unsafe { bpf_get_socket_cookie(ctx.as_ptr()) }
}

/// The cookie of the network namespace of the socket making this call.
#[inline(always)]
pub fn netns_cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: as for `socket_cookie`: our own sock_addr context, only read.
    unsafe { bpf_get_netns_cookie(ctx.as_ptr()) }
}
