//! IPv4 socket hooks: the [`Family`] glue between `bpf_sock_addr` and the v4 maps.

use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};

use aya_ebpf::{bindings::bpf_sock_addr, programs::SockAddrContext};
use proxy_common::{Service4Key, ServiceValue, SockRevNat4Key, SockRevNat4Value};

use crate::{
    lb::{self, Family},
    maps::{BACKENDS4, NODE_ADDRS4, SERVICES4, SOCK_REVNAT4},
};

pub struct V4;

impl Family for V4 {
    type Addr = u32;

    #[inline(always)]
    fn read_user(sa: *const bpf_sock_addr) -> (u32, u16) {
        // Full-width reads: the verifier only allows narrow context loads at some offsets.
        unsafe {
            let addr = read_volatile(addr_of!((*sa).user_ip4));
            let port = read_volatile(addr_of!((*sa).user_port));
            (addr, port as u16)
        }
    }

    #[inline(always)]
    fn write_user(sa: *mut bpf_sock_addr, addr: u32, port: u16) {
        // user_port only accepts 4-byte stores; the port sits in its low 16 bits.
        unsafe {
            write_volatile(addr_of_mut!((*sa).user_ip4), addr);
            write_volatile(addr_of_mut!((*sa).user_port), u32::from(port));
        }
    }

    #[inline(always)]
    fn service(addr: u32, port: u16, proto: u8, slot: u16) -> Option<ServiceValue> {
        unsafe { SERVICES4.get(Service4Key::new(addr, port, proto, slot)) }.copied()
    }

    #[inline(always)]
    fn backend(id: u32) -> Option<(u32, u16)> {
        unsafe { BACKENDS4.get(id) }.map(|b| (b.address, b.port))
    }

    #[inline(always)]
    fn remember(cookie: u64, backend: (u32, u16), frontend: (u32, u16), rev: u16) {
        let key = SockRevNat4Key {
            cookie,
            address: backend.0,
            port: backend.1,
            _pad: [0; 2],
        };
        let value = SockRevNat4Value {
            address: frontend.0,
            port: frontend.1,
            rev_nat_index: rev,
        };
        // The map is an LRU: a failed insert only loses the reverse view, never the
        // connection itself.
        let _ = SOCK_REVNAT4.insert(key, value, 0);
    }

    #[inline(always)]
    fn node_port_address(addr: u32) -> Option<u32> {
        unsafe { NODE_ADDRS4.get(addr) }.map(|_| 0)
    }

    #[inline(always)]
    fn recall(cookie: u64, backend: (u32, u16)) -> Option<(u32, u16)> {
        let key = SockRevNat4Key {
            cookie,
            address: backend.0,
            port: backend.1,
            _pad: [0; 2],
        };
        unsafe { SOCK_REVNAT4.get(key) }.map(|v| (v.address, v.port))
    }
}

pub fn try_connect4(ctx: &SockAddrContext) -> Result<i32, ()> {
    lb::translate::<V4>(ctx)
}

pub fn try_sendmsg4(ctx: &SockAddrContext) -> Result<i32, ()> {
    lb::translate::<V4>(ctx)
}

pub fn try_rev_translate4(ctx: &SockAddrContext) -> Result<i32, ()> {
    lb::rev_translate::<V4>(ctx)
}
