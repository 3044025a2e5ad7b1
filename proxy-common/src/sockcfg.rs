//! What the socket hooks leave to the packet path: the one-entry config map.
//!
//! With per-packet translation on the pods' devices (the daemon's
//! `--pod-interface-name-prefix`), a pod's traffic to a Service can be translated there
//! instead of at its sockets. The socket hooks then tell the host's sockets from the pods'
//! by network namespace cookie: the host namespace (where the pods' devices are) has no such
//! device on its path and is always translated at the socket.

use bytemuck::{Pod, Zeroable};

/// Value of the config map's only entry (index 0). All zero: every socket in the cgroup is
/// translated at the socket, as without a pod path.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SockConfig {
    /// bpf_get_netns_cookie() of the host namespace (SO_NETNS_COOKIE from user space).
    pub host_netns_cookie: u64,
    /// [`flags`] bits.
    pub flags: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<SockConfig>() == 16);

/// `SockConfig::flags`: what sockets outside the host namespace leave to the packet path.
pub mod flags {
    /// UDP: a connected socket keeps the ClusterIP as its peer and each datagram is
    /// translated on the pod's device, where the flow table re-picks a backend when its
    /// backend leaves (no socket reset, no client cooperation).
    pub const POD_UDP_PER_PACKET: u32 = 1 << 0;
    /// Everything: socket load-balancing applies to the host namespace only (Cilium's
    /// socketLB.hostNamespaceOnly), e.g. for meshes that must see the ClusterIP.
    pub const POD_ALL_PER_PACKET: u32 = 1 << 1;
    /// The pod path sends a translated packet for a pod on this node straight into that
    /// pod's namespace (bpf_redirect_peer), past the host's routing and netfilter, as
    /// Cilium's BPF host routing does. Only to devices in the pod device map.
    pub const HOST_ROUTING: u32 = 1 << 2;
}
