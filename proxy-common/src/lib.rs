//! Map keys and values shared by the kernel programs (`proxy-ebpf`) and the daemon
//! (`proxy-userland`).
//!
//! Every type is `#[repr(C)]` with its padding spelled out, so both sides agree on the layout
//! byte for byte; `bytemuck::Pod` refuses to derive on a type with hidden padding, and each type
//! carries a size assertion. Addresses and ports are stored in network byte order, exactly as
//! the kernel hands them to a `sock_addr` program, so the hot path never swaps bytes.
//!
//! - [`service`]: the service map (frontend + backend slot -> master entry or backend id).
//! - [`backend`]: the backend map (backend id -> address, port).
//! - [`revnat`]: reverse translation for sockets (cookie + backend -> service).
//! - [`affinity`]: which backend a client got last, for ClientIP session affinity, and which
//!   backends may still be honoured.
//! - [`nat`]: the packet path's connection tracking and source ranges (node ports,
//!   external and load-balancer IPs).
//! - [`maglev`]: Maglev lookup tables and the flow hash every node computes alike.
//! - [`filter`]: byte filters that spare packets no Service's the hash-map lookups.
//! - [`sockcfg`]: what the socket hooks leave to the pods' devices (per-packet path).
//! - [`maps`]: names and sizes of the maps, shared so the loader and programs cannot drift.
#![no_std]

pub mod affinity;
pub mod backend;
pub mod filter;
pub mod maglev;
pub mod maps;
pub mod nat;
pub mod revnat;
pub mod service;
pub mod sockcfg;

pub use affinity::{AffinityKey, AffinityMatchKey, AffinityValue};
pub use backend::{Backend4, Backend6, BackendId};
pub use nat::{
    Addr6, Ct4Key, Ct4Value, Ct6Key, Ct6Value, CtKey, CtValue, FlowAddr, SourceRange, SourceRange4,
    SourceRange6,
};
pub use revnat::{SockRevNat4Key, SockRevNat4Value, SockRevNat6Key, SockRevNat6Value};
pub use service::{Service4Key, Service6Key, ServiceValue};
pub use sockcfg::SockConfig;

/// IP protocol numbers as used in the maps (the same as `IPPROTO_*`).
pub mod proto {
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const SCTP: u8 = 132;
}

/// Implements `aya::Pod` for the daemon side. Sound because every type here is also
/// `bytemuck::Pod`, which proves it has no padding and no invalid bit patterns.
macro_rules! user_pod {
    ($($t:ty),* $(,)?) => {
        $(
            // SAFETY: `$t` is `bytemuck::Pod` (checked just below), so it is plain data
            // without padding, valid for any bytes, as `aya::Pod` requires.
            #[cfg(feature = "user")]
            unsafe impl aya::Pod for $t {}
            #[cfg(feature = "user")]
            const _: fn() = || {
                fn is_pod<T: bytemuck::Pod>() {}
                is_pod::<$t>();
            };
        )*
    };
}

user_pod!(
    AffinityKey,
    AffinityMatchKey,
    AffinityValue,
    Service4Key,
    Service6Key,
    ServiceValue,
    Backend4,
    Backend6,
    SockRevNat4Key,
    SockRevNat4Value,
    SockRevNat6Key,
    SockRevNat6Value,
    Ct4Key,
    Ct4Value,
    Ct6Key,
    Ct6Value,
    SourceRange4,
    SourceRange6,
    SockConfig,
    maglev::Chunk,
);
