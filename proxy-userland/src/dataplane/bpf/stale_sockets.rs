//! Connected UDP clients of a removed backend, moved to a live one ([`super::repoint`]) or,
//! where that cannot be done, told instead of black-holed.
//!
//! Socket-level load balancing rewrites a connected UDP socket's peer once, at connect().
//! When that backend leaves the service (its pod is gone), the client would keep sending
//! into the void for as long as it keeps the socket — the stale-conntrack problem of
//! kube-proxy and the stale socket-LB state of Cilium. So when a UDP backend leaves a
//! frontend, we find the connected UDP sockets that our programs pointed at it and destroy
//! them through sock_diag (SOCK_DESTROY, as `ss -K` does): the application gets an error
//! (ECONNABORTED, then EDESTADDRREQ) on its next call and opens a new socket, which the
//! programs send to a live backend.
//!
//! sock_diag answers for one network namespace, so we visit the namespace of every process
//! in the cgroup the programs are attached to, each once, from a short-lived thread that
//! joins it (setns changes only the calling thread's namespace).

use std::{
    collections::BTreeSet,
    fs::File,
    io,
    mem::size_of,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::{fd::AsRawFd, unix::fs::MetadataExt},
    path::Path,
};

use bytemuck::{Pod, Zeroable};

use super::repoint::Owners;
use crate::dataplane::netlink::{NLMSG_ERROR, NetlinkSocket, NlMsgHdr, error_in};

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
/// UDP sockets report TCP_ESTABLISHED (1) once connected.
const CONNECTED: u32 = 1 << 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
struct SockId {
    sport: u16,
    dport: u16,
    src: [u32; 4],
    dst: [u32; 4],
    ifindex: u32,
    cookie: [u32; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
struct DiagReq {
    family: u8,
    protocol: u8,
    ext: u8,
    pad: u8,
    states: u32,
    id: SockId,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
struct DiagMsg {
    family: u8,
    state: u8,
    timer: u8,
    retrans: u8,
    id: SockId,
    expires: u32,
    rqueue: u32,
    wqueue: u32,
    uid: u32,
    inode: u32,
}

const _: () = assert!(size_of::<DiagReq>() == 56 && size_of::<DiagMsg>() == 72);

/// A connected UDP socket as sock_diag reports it.
#[derive(Clone, Copy, Debug)]
pub struct UdpSocketInfo {
    pub cookie: u64,
    pub peer: SocketAddr,
    pub inode: u64,
    id: SockId,
    family: u8,
}

/// One client network namespace and the processes of the cgroup in it.
#[derive(Debug)]
pub struct ClientNamespace {
    pub ns: File,
    pub pids: Vec<u32>,
}

/// The network namespaces of the processes in a cgroup tree.
#[derive(Debug, Default)]
pub struct ClientNamespaces {
    /// Each namespace once.
    pub found: Vec<ClientNamespace>,
    /// Processes listed as pid 0: they are in a PID namespace we cannot see into (the
    /// daemon runs in a container without `hostPID`), so their sockets cannot be reached.
    pub hidden: usize,
    /// Processes whose namespace could not be opened though they live (EACCES: without
    /// CAP_SYS_PTRACE, /proc/PID/ns/net of a process with another uid or capabilities we
    /// lack is closed to us), and the last such error: their sockets cannot be reached.
    pub unopened: usize,
    pub unopened_error: Option<io::Error>,
}

/// The network namespaces of every process in `cgroup` and below, once each.
pub fn client_namespaces(cgroup: &Path) -> ClientNamespaces {
    let mut seen = std::collections::BTreeMap::new();
    let mut out = ClientNamespaces::default();
    let mut dirs = vec![cgroup.to_path_buf()];
    // Bounded: cgroup trees are shallow, but a loop in a bind mount must not hang us.
    while let Some(dir) = dirs.pop().filter(|_| seen.len() < 100_000) {
        if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            for pid in procs.lines() {
                // The kernel lists a process outside our PID namespace as 0.
                if pid == "0" {
                    out.hidden += 1;
                    continue;
                }
                let ns = match File::open(format!("/proc/{pid}/ns/net")) {
                    Ok(ns) => ns,
                    // The process exited meanwhile: nothing of it to reset.
                    Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH)) => {
                        continue;
                    }
                    Err(e) => {
                        out.unopened += 1;
                        out.unopened_error = Some(e);
                        continue;
                    }
                };
                let Ok(meta) = ns.metadata() else { continue };
                let Ok(pid) = pid.parse::<u32>() else {
                    continue;
                };
                let at = *seen.entry((meta.dev(), meta.ino())).or_insert_with(|| {
                    out.found.push(ClientNamespace {
                        ns,
                        pids: Vec::new(),
                    });
                    out.found.len() - 1
                });
                out.found[at].pids.push(pid);
            }
        }
        if let Ok(entries) = std::fs::read_dir(&dir) {
            dirs.extend(
                entries
                    .flatten()
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.path()),
            );
        }
    }
    out
}

/// What one namespace's reset came to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resets {
    /// Sockets connected to their Service again ([`super::repoint`]): the client noticed
    /// nothing.
    pub repointed: usize,
    /// Sockets destroyed.
    pub done: usize,
    /// Sockets the kernel refused to destroy (EPERM without CAP_NET_ADMIN, EOPNOTSUPP on a
    /// kernel without CONFIG_INET_DIAG_DESTROY): they keep sending into the void.
    pub failed: usize,
}

/// Re-points or else destroys, in namespace `client`, each connected UDP socket whose peer
/// is in `peers` and which `frontend_of(cookie, peer)` says our programs translated (the
/// Service address it was connected to). An error means the namespace could not be
/// searched at all (not enterable without CAP_SYS_ADMIN, no sock_diag): how many of its
/// sockets were left is then unknown. A socket that cannot be destroyed does not stop the
/// others; the last such error comes with the counts.
pub fn destroy_in(
    client: &ClientNamespace,
    peers: &BTreeSet<SocketAddr>,
    frontend_of: &(dyn Fn(u64, SocketAddr) -> Option<SocketAddr> + Sync),
) -> io::Result<(Resets, Option<io::Error>)> {
    let ns = &client.ns;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns on a valid namespace fd changes only this (short-lived) thread.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            let diag = DiagSocket::open()?;
            let mut resets = Resets::default();
            let mut last_error = None;
            let mut owners: Option<Owners> = None;
            for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
                for sock in diag.connected_udp(family)? {
                    if !peers.contains(&sock.peer) {
                        continue;
                    }
                    let Some(frontend) = frontend_of(sock.cookie, sock.peer) else {
                        continue;
                    };
                    let owners = owners.get_or_insert_with(|| Owners::of(&client.pids));
                    match owners.reconnect(sock.inode, frontend) {
                        Ok(()) => {
                            resets.repointed += 1;
                            continue;
                        }
                        Err(e) => tracing::debug!(
                            %frontend,
                            "cannot connect a UDP socket of a removed backend again, destroying it: {e}"
                        ),
                    }
                    {
                        match diag.destroy(&sock) {
                            Ok(()) => resets.done += 1,
                            Err(e) => {
                                resets.failed += 1;
                                last_error = Some(e);
                            }
                        }
                    }
                }
            }
            Ok((resets, last_error))
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("sock_diag thread panicked")))
    })
}

struct DiagSocket {
    socket: NetlinkSocket,
}

impl DiagSocket {
    fn open() -> io::Result<Self> {
        Ok(Self {
            socket: NetlinkSocket::open(libc::SOCK_DGRAM, libc::NETLINK_SOCK_DIAG)?,
        })
    }

    fn send(&self, ty: u16, flags: u16, req: &DiagReq) -> io::Result<()> {
        let hdr = NlMsgHdr {
            len: (size_of::<NlMsgHdr>() + size_of::<DiagReq>()) as u32,
            ty,
            flags,
            seq: 1,
            pid: 0,
        };
        let mut buf = Vec::with_capacity(hdr.len as usize);
        buf.extend_from_slice(bytemuck::bytes_of(&hdr));
        buf.extend_from_slice(bytemuck::bytes_of(req));
        self.socket.send(&buf)
    }

    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.socket.recv(buf)
    }

    /// Every connected UDP socket of `family` in this namespace.
    fn connected_udp(&self, family: u8) -> io::Result<Vec<UdpSocketInfo>> {
        let req = DiagReq {
            family,
            protocol: libc::IPPROTO_UDP as u8,
            states: CONNECTED,
            ..Default::default()
        };
        self.send(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, &req)?;
        let mut out = Vec::new();
        self.socket.read_dump("sock_diag", |_, body| {
            if body.len() >= size_of::<DiagMsg>() {
                let msg: DiagMsg = bytemuck::pod_read_unaligned(&body[..size_of::<DiagMsg>()]);
                out.push(UdpSocketInfo {
                    cookie: u64::from(msg.id.cookie[0]) | (u64::from(msg.id.cookie[1]) << 32),
                    peer: peer_of(msg.family, &msg.id),
                    inode: u64::from(msg.inode),
                    id: msg.id,
                    family: msg.family,
                });
            }
        })?;
        Ok(out)
    }

    fn destroy(&self, sock: &UdpSocketInfo) -> io::Result<()> {
        let req = DiagReq {
            family: sock.family,
            protocol: libc::IPPROTO_UDP as u8,
            states: u32::MAX,
            id: sock.id,
            ..Default::default()
        };
        self.send(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, &req)?;
        let mut buf = [0u8; 1024];
        let n = self.recv(&mut buf)?;
        if n >= size_of::<NlMsgHdr>() {
            let hdr: NlMsgHdr = bytemuck::pod_read_unaligned(&buf[..size_of::<NlMsgHdr>()]);
            if hdr.ty == NLMSG_ERROR {
                let err = error_in(&buf[size_of::<NlMsgHdr>()..n]);
                // ENOENT: the socket closed meanwhile, which is what we wanted.
                if err
                    .raw_os_error()
                    .is_some_and(|e| e != 0 && e != libc::ENOENT)
                {
                    return Err(err);
                }
            }
        }
        Ok(())
    }
}

fn peer_of(family: u8, id: &SockId) -> SocketAddr {
    let port = u16::from_be(id.dport);
    let bytes: [u8; 16] = bytemuck::cast(id.dst);
    if i32::from(family) == libc::AF_INET {
        SocketAddr::new(
            IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3])),
            port,
        )
    } else {
        SocketAddr::new(IpAddr::V6(Ipv6Addr::from(bytes)), port)
    }
}
