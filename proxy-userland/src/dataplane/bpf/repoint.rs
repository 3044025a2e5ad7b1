//! A connected UDP socket whose backend left, pointed at its Service again instead of
//! destroyed, so a client that never reconnects keeps working (issue 23 point 3).
//!
//! The socket hooks translate a connected UDP socket's peer once, at connect(). When the
//! backend goes, destroying the socket ([`super::stale_sockets`]) tells the application,
//! but one that ignores send errors and never reconnects (statsd clients, some DNS stubs)
//! is then cut off for good: every send fails with EDESTADDRREQ. kube-proxy's conntrack
//! deletion lets such a client carry on, and so does our pod path. Here the daemon takes a
//! copy of the socket's descriptor from a process that holds it (pidfd_getfd(2), Linux 5.6)
//! and connect()s it to the Service address again: the socket belongs to the client's
//! cgroup, so our connect hook picks a live backend and writes the reverse-NAT entry, and
//! the application sees nothing but its replies coming from the new pod.
//!
//! It needs ptrace access to the process (CAP_SYS_PTRACE, or the same uid and no more
//! capabilities than ours); where that is missing, or the Service has no backend left,
//! the socket is destroyed as before.

use std::{
    collections::HashMap,
    io,
    net::{SocketAddr, UdpSocket},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
};

/// The descriptors of some processes, by socket inode: built once per namespace, and only
/// when a socket is to be re-pointed.
#[derive(Debug, Default)]
pub struct Owners {
    by_inode: HashMap<u64, (u32, RawFd)>,
    /// Processes whose `/proc/PID/fd` we may not list (another user's: the directory is
    /// theirs, mode 0500, and the DaemonSet has no CAP_DAC_READ_SEARCH), with the size of
    /// their descriptor table: their descriptors are then tried one by one through
    /// pidfd_getfd, which ptrace access alone allows.
    opaque: Vec<(u32, RawFd)>,
}

/// At most this many descriptors are looked at per namespace: a process with a huge fd
/// table must not stall the sync's clean-up.
const MAX_FDS: usize = 200_000;

impl Owners {
    /// The socket descriptors of `pids` (their `/proc/PID/fd` links `socket:[INODE]`); a
    /// process whose descriptors we may not read is left out.
    pub fn of(pids: &[u32]) -> Owners {
        let mut by_inode = HashMap::new();
        let mut opaque = Vec::new();
        let mut seen = 0usize;
        for &pid in pids {
            let dir = match std::fs::read_dir(format!("/proc/{pid}/fd")) {
                Ok(dir) => dir,
                Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                    if let Some(size) = fd_table_size(pid) {
                        opaque.push((pid, size));
                    }
                    continue;
                }
                Err(_) => continue,
            };
            for entry in dir.flatten() {
                seen += 1;
                if seen > MAX_FDS {
                    return Owners { by_inode, opaque };
                }
                let Ok(fd) = entry.file_name().to_string_lossy().parse::<RawFd>() else {
                    continue;
                };
                let Ok(target) = std::fs::read_link(entry.path()) else {
                    continue;
                };
                let inode = target
                    .to_str()
                    .and_then(|t| t.strip_prefix("socket:["))
                    .and_then(|t| t.strip_suffix(']'))
                    .and_then(|t| t.parse::<u64>().ok());
                if let Some(inode) = inode {
                    by_inode.entry(inode).or_insert((pid, fd));
                }
            }
        }
        Owners { by_inode, opaque }
    }

    /// connect()s the socket with `inode` to `frontend`, from a copy of a holder's
    /// descriptor. Err when no holder is found or the kernel refuses a step.
    pub fn reconnect(&self, inode: u64, frontend: SocketAddr) -> io::Result<()> {
        let copy = match self.by_inode.get(&inode) {
            Some(&(pid, fd)) => {
                let pidfd = pidfd_open(pid)?;
                let copy = getfd(&pidfd, fd)?;
                // The number may have been reused for another file since the listing.
                if inode_of(&copy) != Some(inode) {
                    return Err(io::Error::other("the descriptor now holds another file"));
                }
                copy
            }
            None => self.search_opaque(inode)?,
        };
        // Dropping it closes only our copy.
        UdpSocket::from(copy).connect(frontend)
    }

    /// The socket with `inode` among the descriptors of the processes we could not list.
    fn search_opaque(&self, inode: u64) -> io::Result<OwnedFd> {
        let mut tried = 0usize;
        let mut last_error = None;
        for &(pid, size) in &self.opaque {
            let pidfd = match pidfd_open(pid) {
                Ok(p) => p,
                Err(e) => {
                    last_error = Some(e);
                    continue;
                }
            };
            for fd in 0..size {
                tried += 1;
                if tried > MAX_FDS {
                    break;
                }
                match getfd(&pidfd, fd) {
                    Ok(copy) if inode_of(&copy) == Some(inode) => return Ok(copy),
                    Ok(_) => {}
                    // EBADF: no file at that number.
                    Err(e) if e.raw_os_error() == Some(libc::EBADF) => {}
                    Err(e) => {
                        last_error = Some(e);
                        break;
                    }
                }
            }
        }
        Err(last_error
            .unwrap_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no process holds it")))
    }
}

/// The size of `pid`'s descriptor table (`FDSize` in /proc/PID/status, which anyone may
/// read): every descriptor number it has is below it.
fn fd_table_size(pid: u32) -> Option<RawFd> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("FDSize:"))
        .and_then(|v| v.trim().parse().ok())
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).map_err(io::Error::other)?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just gave us, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) })
}

/// A copy of descriptor `fd` of the process behind `pidfd` (pidfd_getfd(2)).
fn getfd(pidfd: &OwnedFd, fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd takes our pidfd, the target's descriptor number and flags, and
    // returns a new descriptor of ours or -1.
    let copy = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if copy < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just gave us, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(copy as RawFd) })
}

fn inode_of(fd: &OwnedFd) -> Option<u64> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a `stat` into the buffer we pass, sized for it.
    let ok = unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) };
    // SAFETY: fstat succeeded, so it filled the buffer.
    (ok == 0).then(|| unsafe { st.assume_init() }.st_ino)
}
