//! What every hook shares: which protocol a socket speaks, and how a backend slot is picked.

use aya_ebpf::{bindings::bpf_sock_addr, helpers::bpf_set_retval, programs::SockAddrContext};
use proxy_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, ServiceValue, nat, proto,
    service::{flags, scope},
    sockcfg,
};

use crate::{
    PROCEED, REJECT,
    ip::Ip,
    kernel,
    maps::{AFFINITY, AFFINITY_MATCH, Lookup, SOCK_CONFIG, count},
};

const SOCK_STREAM: u32 = 1;
const SOCK_DGRAM: u32 = 2;
const ECONNREFUSED: i32 = 111;

/// The socket's protocol as the service map spells it, or `None` for sockets we never
/// translate (raw, ICMP, ...). Some kernels report protocol 0 for the default protocol, so
/// the socket type decides then.
#[inline(always)]
pub fn socket_proto(sa: &bpf_sock_addr) -> Option<u8> {
    match sa.protocol {
        6 => Some(proto::TCP),
        17 => Some(proto::UDP),
        132 => Some(proto::SCTP),
        0 => match sa.type_ {
            SOCK_STREAM => Some(proto::TCP),
            SOCK_DGRAM => Some(proto::UDP),
            _ => None,
        },
        _ => None,
    }
}

/// Whether this socket's traffic is the pods' devices' to translate (see
/// `proxy_common::sockcfg`): a socket outside the host namespace, with the pod path told to
/// take its UDP (the default with a pod path) or everything (host-namespace-only sockets).
#[inline(always)]
fn left_to_pod_path(ctx: &SockAddrContext, proto: u8) -> bool {
    let Some(cfg) = SOCK_CONFIG.get(0) else {
        return false;
    };
    let mut wanted = sockcfg::flags::POD_ALL_PER_PACKET;
    if proto == proto::UDP {
        wanted |= sockcfg::flags::POD_UDP_PER_PACKET;
    }
    if cfg.flags & wanted == 0 {
        return false;
    }
    let netns = kernel::netns_cookie(ctx);
    netns != cfg.host_netns_cookie
}

/// A backend slot in `1..=count`, uniformly. Callers never pass 0, but where the compiler
/// cannot see that it would keep a division-by-zero panic, which BPF cannot load.
#[inline(always)]
pub fn pick_slot(count: u16) -> u16 {
    let r = kernel::random_u32();
    (r % u32::from(count.max(1))) as u16 + 1
}

/// Refuse the socket call with ECONNREFUSED, as kube-proxy's REJECT rule does for a service
/// without endpoints: the client fails at once instead of waiting for a timeout. Kernels
/// without bpf_set_retval report EPERM instead, which still fails fast.
#[inline(always)]
pub fn refuse() -> i32 {
    // SAFETY: takes a plain value and touches no memory of ours; only the cgroup hooks
    // call this, the programs the kernel allows it in.
    unsafe { bpf_set_retval(-ECONNREFUSED) };
    REJECT
}

/// What differs between IPv4 and IPv6 at the socket: how an address is read from and
/// written to the context, and where the reverse view is kept. The maps of frontends and
/// backends are the family's [`Ip`] ones. The translation itself is written once, in
/// [`translate`] and [`rev_translate`].
pub trait Family: Ip {
    /// The destination the application asked for (address, port in network byte order).
    fn read_user(ctx: &SockAddrContext) -> (Self::Addr, u16);
    fn write_user(ctx: &SockAddrContext, addr: Self::Addr, port: u16);
    /// Remembers that this socket's traffic to `backend` is really traffic to `frontend`.
    fn remember(cookie: u64, backend: (Self::Addr, u16), frontend: (Self::Addr, u16), rev: u16);
    /// The frontend this socket meant when it talks to `backend`, if it was translated.
    fn recall(cookie: u64, backend: (Self::Addr, u16)) -> Option<(Self::Addr, u16)>;
}

/// The master or slot entry of a frontend as the node's sockets see it.
#[inline(always)]
fn service<F: Family>(addr: F::Addr, port: u16, proto: u8, slot: u16) -> Option<ServiceValue> {
    F::service(addr, port, proto, slot, scope::SOCKET)
}

#[inline(always)]
fn backend<F: Family>(id: u32) -> Option<(F::Addr, u16)> {
    F::backend(id).map(|b| (b.addr, b.port))
}

/// connect and sendmsg: turn a service frontend into one of its backends.
#[inline(always)]
pub fn translate<F: Family>(ctx: &SockAddrContext) -> Result<i32, ()> {
    // SAFETY: the context the kernel passed this program, valid for its whole run; the
    // reference ends with `socket_proto`'s field reads, before `write_user` writes to it.
    let Some(proto) = socket_proto(unsafe { &*ctx.sock_addr }) else {
        return Ok(PROCEED);
    };
    if left_to_pod_path(ctx, proto) {
        return Ok(PROCEED);
    }
    let (user_addr, port) = F::read_user(ctx);
    // `addr` is where the frontend is stored; the application keeps seeing `user_addr`.
    // For an address of this node, the node ports (stored under address 0) too, so the
    // node's own connections to `<node address>:<node port>` work as kube-proxy's do.
    let (addr, master) = match service::<F>(user_addr, port, proto, 0) {
        Some(m) => (user_addr, m),
        None if F::node_address(user_addr) => {
            let any = F::Addr::default();
            let Some(m) = service::<F>(any, port, proto, 0) else {
                return Ok(PROCEED);
            };
            (any, m)
        }
        None if unallocated_service_address::<F>(user_addr) => {
            count(nat::stat::REFUSED_SERVICE_RANGE);
            return Ok(refuse());
        }
        None => return Ok(PROCEED),
    };
    if master.count == 0 {
        return Ok(refuse());
    }
    let backend = if master.flags & flags::AFFINITY != 0 {
        affine_backend::<F>(ctx, addr, port, proto, &master)?
    } else {
        let slot = service::<F>(addr, port, proto, pick_slot(master.count)).ok_or(())?;
        backend::<F>(slot.backend_id).ok_or(())?
    };
    let cookie = kernel::socket_cookie(ctx);
    F::remember(cookie, backend, (user_addr, port), master.rev_nat_index);
    F::write_user(ctx, backend.0, backend.1);
    Ok(PROCEED)
}

/// No frontend serves this address (on this port and protocol) and it is inside a service
/// range: an address no Service holds, or a Service's address on a port it does not
/// serve. Left alone, the call would go to the default route and hang; kube-proxy's
/// nftables mode drops the first and rejects the second, we refuse both.
#[inline(always)]
fn unallocated_service_address<F: Family>(addr: F::Addr) -> bool {
    F::in_service_range(addr)
}

/// ClientIP affinity: the backend this client (its netns) got last for this frontend, if
/// that was within the timeout and the backend still serves this frontend (the match map
/// says so; the daemon leaves entries of backends that left); otherwise a fresh pick,
/// which becomes the client's backend.
#[inline(always)]
fn affine_backend<F: Family>(
    ctx: &SockAddrContext,
    addr: F::Addr,
    port: u16,
    proto: u8,
    master: &ServiceValue,
) -> Result<(F::Addr, u16), ()> {
    let key = AffinityKey {
        client: kernel::netns_cookie(ctx),
        rev_nat_index: master.rev_nat_index,
        _pad: [0; 6],
    };
    let now = kernel::now_ns();
    let timeout_ns = u64::from(master.affinity_timeout) * 1_000_000_000;
    if let Some(prev) = AFFINITY.lookup(key) {
        let (id, last) = (prev.backend_id, prev.last_used_ns);
        if kernel::age(now, last) <= timeout_ns
            && serves(id, master.rev_nat_index)
            && let Some(backend) = backend::<F>(id)
        {
            let value = AffinityValue {
                backend_id: id,
                _pad: 0,
                last_used_ns: now,
            };
            let _ = AFFINITY.insert(key, value, 0);
            return Ok(backend);
        }
    }
    let slot = service::<F>(addr, port, proto, pick_slot(master.count)).ok_or(())?;
    let backend = backend::<F>(slot.backend_id).ok_or(())?;
    let value = AffinityValue {
        backend_id: slot.backend_id,
        _pad: 0,
        last_used_ns: now,
    };
    let _ = AFFINITY.insert(key, value, 0);
    Ok(backend)
}

/// Whether backend `id` still serves the frontend `rev_nat_index` (which has affinity):
/// what an affinity entry remembers is honoured only then.
#[inline(always)]
pub fn serves(id: u32, rev_nat_index: u16) -> bool {
    AFFINITY_MATCH
        .lookup(AffinityMatchKey::new(id, rev_nat_index))
        .is_some()
}

/// recvmsg and getpeername: show the application the frontend it asked for.
#[inline(always)]
pub fn rev_translate<F: Family>(ctx: &SockAddrContext) -> Result<i32, ()> {
    let cookie = kernel::socket_cookie(ctx);
    if let Some((addr, port)) = F::recall(cookie, F::read_user(ctx)) {
        F::write_user(ctx, addr, port);
    }
    Ok(PROCEED)
}
