//! IPv6 socket hooks: the [`Family`] glue between `bpf_sock_addr` and the v6 maps.

use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};

use aya_ebpf::programs::SockAddrContext;
use proxy_common::{Addr6, SockRevNat6Key, SockRevNat6Value};

use crate::{
    ip::{V6, bytes, words},
    lb::{self, Family},
    maps::{Lookup, SOCK_REVNAT6},
};

// The context holds the address as four network-order words, as [`Addr6`] does; the
// reverse-NAT map as 16 bytes. Both are the same bytes in memory (see `ip::words`).
impl Family for V6 {
    #[inline(always)]
    fn read_user(ctx: &SockAddrContext) -> (Addr6, u16) {
        let sa = ctx.sock_addr;
        // SAFETY: `sa` is the context the kernel passed this program, valid for its whole
        // run; these are u32 reads, through raw pointers, of the four words of user_ip6 and
        // of user_port.
        unsafe {
            let p = addr_of!((*sa).user_ip6) as *const u32;
            let w = [
                read_volatile(p),
                read_volatile(p.add(1)),
                read_volatile(p.add(2)),
                read_volatile(p.add(3)),
            ];
            let port = read_volatile(addr_of!((*sa).user_port));
            (w, port as u16)
        }
    }

    #[inline(always)]
    fn write_user(ctx: &SockAddrContext, w: Addr6, port: u16) {
        let sa = ctx.sock_addr;
        // SAFETY: as in `read_user`, as u32 writes, which connect, sendmsg, recvmsg and
        // getpeername programs may make; nothing holds a reference into the context.
        unsafe {
            let p = addr_of_mut!((*sa).user_ip6) as *mut u32;
            write_volatile(p, w[0]);
            write_volatile(p.add(1), w[1]);
            write_volatile(p.add(2), w[2]);
            write_volatile(p.add(3), w[3]);
            write_volatile(addr_of_mut!((*sa).user_port), u32::from(port));
        }
    }

    #[inline(always)]
    fn remember(cookie: u64, backend: (Addr6, u16), frontend: (Addr6, u16), rev: u16) {
        let key = SockRevNat6Key {
            cookie,
            address: bytes(backend.0),
            port: backend.1,
            _pad: [0; 6],
        };
        let value = SockRevNat6Value {
            address: bytes(frontend.0),
            port: frontend.1,
            rev_nat_index: rev,
        };
        let _ = SOCK_REVNAT6.insert(key, value, 0);
    }

    #[inline(always)]
    fn recall(cookie: u64, backend: (Addr6, u16)) -> Option<(Addr6, u16)> {
        let key = SockRevNat6Key {
            cookie,
            address: bytes(backend.0),
            port: backend.1,
            _pad: [0; 6],
        };
        SOCK_REVNAT6.lookup(key).map(|v| (words(v.address), v.port))
    }
}

pub fn try_connect6(ctx: &SockAddrContext) -> Result<i32, ()> {
    lb::translate::<V6>(ctx)
}

pub fn try_sendmsg6(ctx: &SockAddrContext) -> Result<i32, ()> {
    lb::translate::<V6>(ctx)
}

pub fn try_rev_translate6(ctx: &SockAddrContext) -> Result<i32, ()> {
    lb::rev_translate::<V6>(ctx)
}
