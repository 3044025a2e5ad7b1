//! Reverse translation for the socket path.
//!
//! When connect/sendmsg rewrites a service address to a backend, the program records
//! (socket cookie, backend address, backend port) -> (service address, port). recvmsg and
//! getpeername look that up so an application only ever sees the address it asked for: a UDP
//! client gets its DNS reply from the ClusterIP, not from a pod it never heard of.

use bytemuck::{Pod, Zeroable};

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SockRevNat4Key {
    pub cookie: u64,
    /// Backend address, network byte order.
    pub address: u32,
    /// Backend port, network byte order.
    pub port: u16,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<SockRevNat4Key>() == 16);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SockRevNat4Value {
    /// Service address, network byte order.
    pub address: u32,
    /// Service port, network byte order.
    pub port: u16,
    pub rev_nat_index: u16,
}
const _: () = assert!(core::mem::size_of::<SockRevNat4Value>() == 8);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SockRevNat6Key {
    pub cookie: u64,
    pub address: [u8; 16],
    pub port: u16,
    pub _pad: [u8; 6],
}
const _: () = assert!(core::mem::size_of::<SockRevNat6Key>() == 32);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SockRevNat6Value {
    pub address: [u8; 16],
    pub port: u16,
    pub rev_nat_index: u16,
}
const _: () = assert!(core::mem::size_of::<SockRevNat6Value>() == 20);
