//! IPv4 socket hooks: the [`Family`] glue between `bpf_sock_addr` and the v4 maps.

use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};

use aya_ebpf::programs::SockAddrContext;
use proxy_common::{SockRevNat4Key, SockRevNat4Value};

use crate::{
    ip::V4,
    lb::{self, Family},
    maps::{Lookup, SOCK_REVNAT4},
};

impl Family for V4 {
    #[inline(always)]
    fn read_user(ctx: &SockAddrContext) -> (u32, u16) {
        let sa = ctx.sock_addr;
        // Full-width reads: the verifier only allows narrow context loads at some offsets.
        // SAFETY: `sa` is the context the kernel passed this program, valid for its whole
        // run; these are reads of two of its u32 fields, through raw pointers.
        unsafe {
            let addr = read_volatile(addr_of!((*sa).user_ip4));
            let port = read_volatile(addr_of!((*sa).user_port));
            (addr, port as u16)
        }
    }

    #[inline(always)]
    fn write_user(ctx: &SockAddrContext, addr: u32, port: u16) {
        let sa = ctx.sock_addr;
        // user_port only accepts 4-byte stores; the port sits in its low 16 bits.
        // SAFETY: as in `read_user`; connect, sendmsg, recvmsg and getpeername programs may
        // write these two fields, and nothing holds a reference into the context.
        unsafe {
            write_volatile(addr_of_mut!((*sa).user_ip4), addr);
            write_volatile(addr_of_mut!((*sa).user_port), u32::from(port));
        }
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
    fn recall(cookie: u64, backend: (u32, u16)) -> Option<(u32, u16)> {
        let key = SockRevNat4Key {
            cookie,
            address: backend.0,
            port: backend.1,
            _pad: [0; 2],
        };
        SOCK_REVNAT4.lookup(key).map(|v| (v.address, v.port))
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
