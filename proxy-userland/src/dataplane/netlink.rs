//! A bare netlink socket: what sock_diag (UDP socket resets), nf_tables (the ruleset
//! generation) and ctnetlink (conntrack clean-up) need: requests and their replies.

use std::{
    io,
    mem::size_of,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::Duration,
};

/// The header of every netlink message (linux/netlink.h `nlmsghdr`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct NlMsgHdr {
    pub len: u32,
    pub ty: u16,
    pub flags: u16,
    pub seq: u32,
    pub pid: u32,
}
const _: () = assert!(size_of::<NlMsgHdr>() == 16);

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

    /// Sets an integer socket option.
    pub fn set_option(
        &self,
        level: libc::c_int,
        name: libc::c_int,
        value: libc::c_int,
    ) -> io::Result<()> {
        // SAFETY: the option value points at a c_int of the size given, alive for the call.
        let set = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                level,
                name,
                (&raw const value).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if set != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Reads an integer socket option.
    pub fn option(&self, level: libc::c_int, name: libc::c_int) -> io::Result<libc::c_int> {
        let mut value: libc::c_int = 0;
        let mut len = size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: value and len are ours, writable, and len says how much value holds.
        let got = unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                level,
                name,
                (&raw mut value).cast(),
                &raw mut len,
            )
        };
        if got != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(value)
    }

    /// Sends one datagram to the kernel: one message, or several back to back, which the
    /// kernel handles in order within this one call.
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

    /// Joins the multicast `groups` (e.g. `RTMGRP_LINK`): the kernel then tells this socket
    /// of every such change.
    pub fn join_groups(&self, groups: u32) -> io::Result<()> {
        // SAFETY: sockaddr_nl is plain data, for which all-zero is valid.
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        sa.nl_groups = groups;
        // SAFETY: the pointer and length describe `sa`, alive for the call.
        let rc = unsafe {
            libc::bind(
                self.fd.as_raw_fd(),
                (&raw const sa).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// A socket of netlink `protocol` made in `ns` (None: ours) that has joined `groups`:
    /// told of every such change made there.
    pub fn news_in(ns: Option<&str>, protocol: libc::c_int, groups: u32) -> io::Result<Self> {
        let open = || {
            let socket = Self::open(libc::SOCK_RAW, protocol)?;
            socket.join_groups(groups)?;
            Ok(socket)
        };
        super::netns::in_netns(ns, open).map_err(|e| io::Error::other(e.to_string()))?
    }

    /// Waits up to `timeout` for a message; true if one came. All queued messages are then
    /// read and dropped: the caller only wants to know that something changed (an overrun,
    /// ENOBUFS, counts as a change too).
    pub fn wait_for_news(&self, timeout: Duration) -> io::Result<bool> {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd, alive for the call.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            };
        }
        if n == 0 {
            return Ok(false);
        }
        let mut buf = [0u8; 8192];
        // Bounded: a flood of changes is read in pieces across calls.
        for _ in 0..1024 {
            // SAFETY: the pointer and length describe `buf`, writable and ours.
            let r = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if r < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::ENOBUFS) | Some(libc::EINTR) => continue,
                    _ if e.kind() == io::ErrorKind::WouldBlock => break,
                    _ => return Err(e),
                }
            }
        }
        Ok(true)
    }

    /// [`Self::wait_for_news`] on `socket` if there is one, else a sleep of `timeout`; a
    /// read error is reported (as `what`'s) and slept off.
    pub fn wait_or_sleep(socket: Option<&Self>, timeout: Duration, what: &str) {
        match socket.map(|s| s.wait_for_news(timeout)) {
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                tracing::warn!("{what}: reading events: {e}");
                std::thread::sleep(timeout);
            }
            None => std::thread::sleep(timeout),
        }
    }

    /// A route-netlink socket (no capability needed) that has asked for a dump of `ty`
    /// with the family header `body`: [`Self::read_dump`] reads the answer.
    pub fn route_dump(ty: u16, body: &[u8]) -> io::Result<Self> {
        const NLM_F_REQUEST: u16 = 0x1;
        const NLM_F_DUMP: u16 = 0x300;
        let socket = Self::open(libc::SOCK_DGRAM, libc::NETLINK_ROUTE)?
            .with_recv_timeout(Duration::from_secs(5))?;
        let hdr = NlMsgHdr {
            len: (size_of::<NlMsgHdr>() + body.len()) as u32,
            ty,
            flags: NLM_F_REQUEST | NLM_F_DUMP,
            seq: 1,
            pid: 0,
        };
        let mut req = Vec::with_capacity(hdr.len as usize);
        req.extend_from_slice(bytemuck::bytes_of(&hdr));
        req.extend_from_slice(body);
        socket.send(&req)?;
        Ok(socket)
    }

    /// Reads the answer to a dump request sent on this socket: `each(type, payload)` for
    /// every message, until NLMSG_DONE; NLMSG_ERROR ends it with that error. Bounded: a
    /// dump that has not ended after [`MAX_DUMP_RECVS`] datagrams is an error. `what` names
    /// the dump in errors.
    pub fn read_dump(&self, what: &str, mut each: impl FnMut(u16, &[u8])) -> io::Result<()> {
        const HDR: usize = size_of::<NlMsgHdr>();
        let mut buf = vec![0u8; 64 * 1024];
        for _ in 0..MAX_DUMP_RECVS {
            let n = self.recv(&mut buf)?;
            let mut off = 0;
            while off + HDR <= n {
                let len = u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]])
                    as usize;
                let ty = u16::from_ne_bytes([buf[off + 4], buf[off + 5]]);
                if len < HDR || off + len > n {
                    return Err(io::Error::other(format!("truncated {what} message")));
                }
                let body = &buf[off + HDR..off + len];
                match ty {
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => return Err(error_in(body)),
                    _ => each(ty, body),
                }
                // Messages are 4-byte aligned.
                off += (len + 3) & !3;
            }
        }
        Err(io::Error::other(format!("{what} dump did not end")))
    }
}

pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
/// Bounds a dump: no namespace has this many datagrams to read.
pub const MAX_DUMP_RECVS: usize = 100_000;

/// The errno in an NLMSG_ERROR payload (0 is an acknowledgement).
pub fn error_in(body: &[u8]) -> io::Error {
    let code = body
        .get(..4)
        .map_or(-libc::EIO, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
    io::Error::from_raw_os_error(-code)
}

/// The flag bits of an attribute's type (NLA_F_NESTED, NLA_F_NET_BYTEORDER).
const NLA_TYPE_MASK: u16 = 0x3fff;

fn align(len: usize) -> usize {
    (len + 3) & !3
}

/// (type without flag bits, payload) of each attribute (`rtattr`, `nlattr`) in `buf`;
/// stops at a malformed one.
pub fn attributes(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        let len = usize::from(u16::from_ne_bytes([*buf.first()?, *buf.get(1)?]));
        let ty = u16::from_ne_bytes([*buf.get(2)?, *buf.get(3)?]) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            return None;
        }
        let payload = &buf[4..len];
        buf = &buf[align(len).min(buf.len())..];
        Some((ty, payload))
    })
}

/// One attribute as the kernel writes it, padded: what [`attributes`] reads back.
pub fn attribute(ty: u16, payload: &[u8]) -> Vec<u8> {
    let mut a = ((4 + payload.len()) as u16).to_ne_bytes().to_vec();
    a.extend_from_slice(&ty.to_ne_bytes());
    a.extend_from_slice(payload);
    a.resize(align(a.len()), 0);
    a
}
