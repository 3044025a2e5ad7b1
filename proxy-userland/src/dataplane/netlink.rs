//! A bare netlink socket: what sock_diag (UDP socket resets) and nf_tables (the ruleset
//! generation) need, one request and its replies, without a netlink library.

use std::{
    io,
    mem::size_of,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::Duration,
};

pub struct NetlinkSocket {
    fd: OwnedFd,
}

impl NetlinkSocket {
    /// A socket of netlink `protocol` (e.g. `NETLINK_SOCK_DIAG`) in the calling thread's
    /// network namespace, where it stays.
    pub fn open(kind: libc::c_int, protocol: libc::c_int) -> io::Result<Self> {
        // SAFETY: socket takes only integers; the result is checked before use.
        let fd = unsafe { libc::socket(libc::AF_NETLINK, kind | libc::SOCK_CLOEXEC, protocol) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            // SAFETY: a new fd the kernel just returned, owned by nothing else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Receives fail with `WouldBlock` after `timeout` instead of waiting for ever.
    pub fn with_recv_timeout(self, timeout: Duration) -> io::Result<Self> {
        let tv = libc::timeval {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_usec: timeout.subsec_micros() as libc::suseconds_t,
        };
        // SAFETY: the option value points at a timeval of the size given, alive for the
        // call.
        let set = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const tv).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if set != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(self)
    }

    /// Sends one message to the kernel.
    pub fn send(&self, msg: &[u8]) -> io::Result<()> {
        // SAFETY: the pointer and length describe `msg`, which outlives the call.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// Receives one datagram into `buf`; returns its length.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: the pointer and length describe `buf`, writable and exclusively ours.
        let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
}
