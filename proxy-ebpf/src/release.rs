//! The socket release hook: a closing socket's reverse-NAT entry goes with it.
//!
//! Each connect the socket hooks translate writes an entry keyed by the socket's cookie and
//! its backend (`remember` in sock4/sock6), which recvmsg and getpeername read. Nothing
//! else removes it: on a busy node the LRU map filled (262,144 entries), every later connect
//! evicted another socket's entry, and the hooks cost about twice as much
//! (tests/sock_hook_cost.rs). Cilium's `cil_sock_release` does the same. An unconnected UDP
//! socket's entries (one per backend it sent to) are not known here: they still age out of
//! the LRU.

use core::ptr::{addr_of, read_volatile};

use aya_ebpf::programs::SockContext;
use proxy_common::{SockRevNat4Key, SockRevNat6Key};

use crate::{
    PROCEED,
    ip::bytes,
    kernel,
    maps::{Lookup as _, SOCK_REVNAT4, SOCK_REVNAT6},
};

const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;

pub fn try_release(ctx: &SockContext) -> Result<i32, ()> {
    let sk = ctx.sock;
    // SAFETY: `sk` is the socket the kernel passed this program, valid for its whole run;
    // these are reads of fields a sock_release program may read (family, dst_port),
    // through raw pointers, at their own widths.
    let (family, port) = unsafe {
        (
            read_volatile(addr_of!((*sk).family)),
            read_volatile(addr_of!((*sk).dst_port)),
        )
    };
    let cookie = kernel::sock_cookie(ctx);
    match family {
        AF_INET => {
            // SAFETY: as above; dst_ip4 is a readable u32 field.
            let address = unsafe { read_volatile(addr_of!((*sk).dst_ip4)) };
            let key = SockRevNat4Key {
                cookie,
                address,
                port,
                _pad: [0; 2],
            };
            // Absent for a socket no hook translated: a lookup finds that out without the
            // bucket lock a delete takes.
            if SOCK_REVNAT4.lookup(key).is_some() {
                let _ = SOCK_REVNAT4.remove(key);
            }
        }
        AF_INET6 => {
            // SAFETY: as above; the four u32 words of dst_ip6, read one at a time.
            let w = unsafe {
                let p = addr_of!((*sk).dst_ip6) as *const u32;
                [
                    read_volatile(p),
                    read_volatile(p.add(1)),
                    read_volatile(p.add(2)),
                    read_volatile(p.add(3)),
                ]
            };
            let key = SockRevNat6Key {
                cookie,
                address: bytes(w),
                port,
                _pad: [0; 6],
            };
            if SOCK_REVNAT6.lookup(key).is_some() {
                let _ = SOCK_REVNAT6.remove(key);
            }
        }
        _ => {}
    }
    Ok(PROCEED)
}
