//! The backend maps: backend id -> where to send the connection.

use bytemuck::{Pod, Zeroable};

/// Backend ids are allocated by the daemon, start at 1 and are shared by every service that
/// uses the same (address, port, protocol).
pub type BackendId = u32;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct Backend4 {
    /// Network byte order.
    pub address: u32,
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    /// [`flags`] bits.
    pub flags: u8,
}
const _: () = assert!(core::mem::size_of::<Backend4>() == 8);

/// `Backend*::flags`.
pub mod flags {
    /// The backend runs on this node: the packet path reaches it without SNAT, and its
    /// replies are translated back as they leave the node.
    pub const LOCAL: u8 = 1 << 0;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct Backend6 {
    pub address: [u8; 16],
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
}
const _: () = assert!(core::mem::size_of::<Backend6>() == 20);
