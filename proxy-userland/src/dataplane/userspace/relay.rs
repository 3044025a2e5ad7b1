//! The relays: one TCP or UDP listener per service frontend, on a port the kernel picks,
//! forwarding to a backend the [`Balancer`] chooses.
//!
//! They run on a tokio runtime of their own, on one thread that first enters the proxier's
//! network namespace if it has one: every socket (listeners, connections to backends) is
//! then made in that namespace. The sync loop drives them through blocking calls that
//! return once the kernel has the listener, so the iptables rules written next never point
//! at a port nobody listens on.
//!
//! UDP answers must leave from the address the client's datagram was redirected to, or
//! conntrack cannot undo the redirect; the listener reads that address with IP_PKTINFO and
//! sends with it. IPv4 only.

use std::{
    collections::HashMap,
    io, mem,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    os::fd::{AsRawFd as _, RawFd},
    ptr,
    sync::{Arc, Mutex, mpsc as std_mpsc},
    time::{Duration, Instant},
};

use tokio::{
    io::Interest,
    net::{TcpListener, TcpStream, UdpSocket},
    sync::mpsc,
    task::JoinHandle,
};
use tracing::{debug, warn};

use super::balancer::Balancer;
use crate::{
    dataplane::{frontends::Frontend, netns},
    model::Protocol,
};

/// How long a blocking call waits for the relay thread.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Connecting to one backend; then the next is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// UDP flows (client address -> upstream socket) one listener keeps at most.
const MAX_UDP_FLOWS: usize = 4096;
const UDP_BUF: usize = 65_536;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RelayConfig {
    /// A UDP flow with no traffic either way for this long is forgotten (its upstream
    /// socket closed); kube-proxy's userspace mode called this --udp-timeout.
    pub udp_idle_timeout: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        // kube-proxy's userspace default was 250 ms, made for DNS; a little longer lets
        // request/response protocols with slower backends keep their flow.
        RelayConfig {
            udp_idle_timeout: Duration::from_secs(2),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("{0}")]
    Netns(#[from] netns::NetnsError),
    #[error("cannot start the relay thread: {0}")]
    Thread(io::Error),
    #[error("the relay thread is gone")]
    Gone,
    #[error("the relay thread did not answer within {CALL_TIMEOUT:?}")]
    Timeout,
    #[error("cannot listen for {frontend}: {source}")]
    Listen { frontend: String, source: io::Error },
    #[error("{0}: the userspace proxier relays IPv4 TCP and UDP only")]
    Unsupported(String),
}

enum Cmd {
    Open {
        fe: Frontend,
        backends: Vec<SocketAddr>,
        affinity: Option<u32>,
        reply: std_mpsc::Sender<Result<u16, RelayError>>,
    },
    Update {
        fe: Frontend,
        backends: Vec<SocketAddr>,
        affinity: Option<u32>,
    },
    Close {
        fe: Frontend,
    },
    Flows {
        fe: Frontend,
        reply: std_mpsc::Sender<usize>,
    },
}

/// The handle the proxier keeps; dropping it stops every relay.
pub struct Relays {
    tx: mpsc::UnboundedSender<Cmd>,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct Listener {
    balancer: Arc<Mutex<Balancer>>,
    flows: Option<Flows>,
    task: JoinHandle<()>,
}

type Flows = Arc<Mutex<HashMap<SocketAddrV4, Arc<Flow>>>>;

struct Flow {
    upstream: UdpSocket,
    backend: SocketAddr,
    /// The task carrying replies back; aborted when the backend leaves the service.
    replies: std::sync::OnceLock<tokio::task::AbortHandle>,
    /// Milliseconds since `epoch` of the last datagram either way.
    last: std::sync::atomic::AtomicU64,
}

impl Relays {
    /// Starts the relay thread, in `netns` if given.
    pub fn start(netns: Option<String>, cfg: RelayConfig) -> Result<Relays, RelayError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("fastpath-relay".into())
            .spawn(move || {
                if let Some(ns) = &netns
                    && let Err(e) = netns::enter(ns)
                {
                    let _ = ready_tx.send(Err(RelayError::Netns(e)));
                    return;
                }
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(RelayError::Thread(e)));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                rt.block_on(serve(rx, cfg));
            })
            .map_err(RelayError::Thread)?;
        match ready_rx.recv_timeout(CALL_TIMEOUT) {
            Ok(Ok(())) => Ok(Relays {
                tx,
                thread: Some(thread),
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(RelayError::Timeout),
        }
    }

    /// Opens a relay for `fe` and returns the local port it listens on.
    pub fn open(
        &self,
        fe: Frontend,
        backends: Vec<SocketAddr>,
        affinity: Option<u32>,
    ) -> Result<u16, RelayError> {
        let (reply, rx) = std_mpsc::channel();
        self.tx
            .send(Cmd::Open {
                fe,
                backends,
                affinity,
                reply,
            })
            .map_err(|_| RelayError::Gone)?;
        rx.recv_timeout(CALL_TIMEOUT)
            .map_err(|_| RelayError::Timeout)?
    }

    pub fn update(
        &self,
        fe: Frontend,
        backends: Vec<SocketAddr>,
        affinity: Option<u32>,
    ) -> Result<(), RelayError> {
        self.tx
            .send(Cmd::Update {
                fe,
                backends,
                affinity,
            })
            .map_err(|_| RelayError::Gone)
    }

    /// Stops listening for `fe`. Established TCP connections and UDP flows run on.
    pub fn close(&self, fe: Frontend) -> Result<(), RelayError> {
        self.tx
            .send(Cmd::Close { fe })
            .map_err(|_| RelayError::Gone)
    }

    /// The UDP flows a relay holds now (for tests and diagnostics).
    pub fn udp_flows(&self, fe: Frontend) -> Result<usize, RelayError> {
        let (reply, rx) = std_mpsc::channel();
        self.tx
            .send(Cmd::Flows { fe, reply })
            .map_err(|_| RelayError::Gone)?;
        rx.recv_timeout(CALL_TIMEOUT)
            .map_err(|_| RelayError::Timeout)
    }
}

impl Drop for Relays {
    fn drop(&mut self) {
        // Closing the channel ends `serve`, which drops the runtime and every task.
        let (tx, _) = mpsc::unbounded_channel();
        drop(mem::replace(&mut self.tx, tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn serve(mut rx: mpsc::UnboundedReceiver<Cmd>, cfg: RelayConfig) {
    let mut listeners: HashMap<Frontend, Listener> = HashMap::new();
    while let Some(cmd) = rx.recv().await {
        match cmd {
            Cmd::Open {
                fe,
                backends,
                affinity,
                reply,
            } => {
                if let Some(old) = listeners.remove(&fe) {
                    old.task.abort();
                }
                let result = open(fe, backends, affinity, cfg).await.map(|(port, l)| {
                    listeners.insert(fe, l);
                    port
                });
                let _ = reply.send(result);
            }
            Cmd::Update {
                fe,
                backends,
                affinity,
            } => {
                if let Some(l) = listeners.get(&fe) {
                    // A UDP flow whose backend left ends now, even if its client keeps
                    // sending: its next datagram picks a backend that is still there (as
                    // kube-proxy clears the conntrack entries of removed UDP endpoints).
                    if let Some(flows) = &l.flows {
                        lock(flows).retain(|_, f| {
                            let keep = backends.contains(&f.backend);
                            if !keep && let Some(task) = f.replies.get() {
                                task.abort();
                            }
                            keep
                        });
                    }
                    lock(&l.balancer).update(backends, affinity);
                }
            }
            Cmd::Close { fe } => {
                if let Some(l) = listeners.remove(&fe) {
                    l.task.abort();
                }
            }
            Cmd::Flows { fe, reply } => {
                let n = listeners
                    .get(&fe)
                    .and_then(|l| l.flows.as_ref())
                    .map_or(0, |f| lock(f).len());
                let _ = reply.send(n);
            }
        }
    }
    for (_, l) in listeners {
        l.task.abort();
    }
}

/// A poisoned lock only means a relay task panicked; the data is still usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

async fn open(
    fe: Frontend,
    backends: Vec<SocketAddr>,
    affinity: Option<u32>,
    cfg: RelayConfig,
) -> Result<(u16, Listener), RelayError> {
    if !fe.ip.is_ipv4() || !matches!(fe.proto, Protocol::Tcp | Protocol::Udp) {
        return Err(RelayError::Unsupported(fe.to_string()));
    }
    let listen_err = |source| RelayError::Listen {
        frontend: fe.to_string(),
        source,
    };
    let balancer = Arc::new(Mutex::new(Balancer::new(backends, affinity)));
    let any = SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0));
    match fe.proto {
        Protocol::Tcp => {
            let listener = TcpListener::bind(any).await.map_err(listen_err)?;
            let port = listener.local_addr().map_err(listen_err)?.port();
            let task = tokio::spawn(tcp_accept(listener, balancer.clone(), fe));
            Ok((
                port,
                Listener {
                    balancer,
                    flows: None,
                    task,
                },
            ))
        }
        _ => {
            let socket = std::net::UdpSocket::bind(any).map_err(listen_err)?;
            set_pktinfo(socket.as_raw_fd()).map_err(listen_err)?;
            socket.set_nonblocking(true).map_err(listen_err)?;
            let socket = UdpSocket::from_std(socket).map_err(listen_err)?;
            let port = socket.local_addr().map_err(listen_err)?.port();
            let flows: Flows = Arc::default();
            let task = tokio::spawn(udp_relay(
                Arc::new(socket),
                balancer.clone(),
                flows.clone(),
                cfg,
                fe,
            ));
            Ok((
                port,
                Listener {
                    balancer,
                    flows: Some(flows),
                    task,
                },
            ))
        }
    }
}

async fn tcp_accept(listener: TcpListener, balancer: Arc<Mutex<Balancer>>, fe: Frontend) {
    loop {
        let (client, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // EMFILE and the like: back off instead of spinning.
                warn!(%fe, "accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let first = lock(&balancer).pick(peer.ip(), Instant::now());
        let Some(first) = first else {
            // No endpoints: reset at once, so the client fails fast and visibly rather
            // than reading an empty answer.
            debug!(%fe, "no endpoints; resetting the connection");
            reset_on_close(client.as_raw_fd());
            continue;
        };
        let balancer = balancer.clone();
        tokio::spawn(async move {
            let tries = lock(&balancer).backends().len().max(1);
            let mut backend = first;
            for _ in 0..tries {
                match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(backend)).await {
                    Ok(Ok(mut upstream)) => {
                        let mut client = client;
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                        return;
                    }
                    Ok(Err(e)) => debug!(%fe, %backend, "connect failed: {e}"),
                    Err(_) => debug!(%fe, %backend, "connect timed out"),
                }
                match lock(&balancer).after(backend) {
                    Some(next) => backend = next,
                    None => return,
                }
            }
        });
    }
}

async fn udp_relay(
    socket: Arc<UdpSocket>,
    balancer: Arc<Mutex<Balancer>>,
    flows: Flows,
    cfg: RelayConfig,
    fe: Frontend,
) {
    let epoch = Instant::now();
    let mut buf = vec![0u8; UDP_BUF];
    loop {
        let fd = socket.as_raw_fd();
        let (n, client, local) = match socket
            .async_io(Interest::READABLE, || recv_with_dst(fd, &mut buf))
            .await
        {
            Ok(r) => r,
            Err(e) => {
                debug!(%fe, "UDP receive failed: {e}");
                continue;
            }
        };
        let existing = lock(&flows).get(&client).cloned();
        let flow = match existing {
            Some(f) => f,
            None => {
                if lock(&flows).len() >= MAX_UDP_FLOWS {
                    debug!(%fe, "too many UDP flows; dropping a datagram");
                    continue;
                }
                let Some(backend) = lock(&balancer).pick((*client.ip()).into(), Instant::now())
                else {
                    continue;
                };
                let upstream = match connect_udp(backend).await {
                    Ok(u) => u,
                    Err(e) => {
                        debug!(%fe, %backend, "UDP upstream failed: {e}");
                        continue;
                    }
                };
                let flow = Arc::new(Flow {
                    upstream,
                    backend,
                    replies: Default::default(),
                    last: Default::default(),
                });
                lock(&flows).insert(client, flow.clone());
                let task = tokio::spawn(udp_flow(
                    socket.clone(),
                    flow.clone(),
                    flows.clone(),
                    client,
                    local,
                    epoch,
                    cfg.udp_idle_timeout,
                ));
                let _ = flow.replies.set(task.abort_handle());
                flow
            }
        };
        flow.last.store(
            epoch.elapsed().as_millis() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        let _ = flow.upstream.send(&buf[..n]).await;
    }
}

async fn connect_udp(backend: SocketAddr) -> io::Result<UdpSocket> {
    let u = UdpSocket::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0))).await?;
    u.connect(backend).await?;
    Ok(u)
}

/// Carries replies of one flow back to its client until the flow is idle.
async fn udp_flow(
    socket: Arc<UdpSocket>,
    flow: Arc<Flow>,
    flows: Flows,
    client: SocketAddrV4,
    local: Ipv4Addr,
    epoch: Instant,
    idle: Duration,
) {
    let mut buf = vec![0u8; UDP_BUF];
    loop {
        match tokio::time::timeout(idle, flow.upstream.recv(&mut buf)).await {
            Ok(Ok(n)) => {
                flow.last.store(
                    epoch.elapsed().as_millis() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
                let fd = socket.as_raw_fd();
                let data = &buf[..n];
                let _ = socket
                    .async_io(Interest::WRITABLE, || send_from(fd, data, client, local))
                    .await;
            }
            // ICMP errors from the backend (ECONNREFUSED): keep the flow until idle.
            Ok(Err(_)) => tokio::time::sleep(Duration::from_millis(10)).await,
            Err(_) => {
                let last =
                    Duration::from_millis(flow.last.load(std::sync::atomic::Ordering::Relaxed));
                if epoch.elapsed().saturating_sub(last) >= idle {
                    break;
                }
            }
        }
    }
    let mut map = lock(&flows);
    if map.get(&client).is_some_and(|f| Arc::ptr_eq(f, &flow)) {
        map.remove(&client);
    }
}

/// SO_LINGER with a zero timeout: closing the socket sends RST instead of FIN.
fn reset_on_close(fd: RawFd) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: fd is a valid socket; the option value outlives the call. Failure only means
    // a FIN instead of a RST.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            ptr::from_ref(&linger).cast(),
            mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

fn set_pktinfo(fd: RawFd) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: fd is a valid socket; the option value is a c_int that outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_IP,
            libc::IP_PKTINFO,
            ptr::from_ref(&on).cast(),
            mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn sockaddr_v4(a: SocketAddrV4) -> libc::sockaddr_in {
    // SAFETY: sockaddr_in is plain old data; all-zero is a valid value.
    let mut sa: libc::sockaddr_in = unsafe { mem::zeroed() };
    sa.sin_family = libc::AF_INET as libc::sa_family_t;
    sa.sin_port = a.port().to_be();
    sa.sin_addr = libc::in_addr {
        s_addr: u32::from(*a.ip()).to_be(),
    };
    sa
}

/// recvmsg with IP_PKTINFO: (length, source, the destination address the datagram had).
fn recv_with_dst(fd: RawFd, buf: &mut [u8]) -> io::Result<(usize, SocketAddrV4, Ipv4Addr)> {
    // SAFETY: plain old data, zero is valid.
    let mut src: libc::sockaddr_in = unsafe { mem::zeroed() };
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = [0u64; 16];
    // SAFETY: as above.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_name = ptr::from_mut(&mut src).cast();
    msg.msg_namelen = mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = mem::size_of_val(&control) as _;
    // SAFETY: every pointer in msg refers to live buffers of the stated sizes.
    let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut dst = Ipv4Addr::UNSPECIFIED;
    // SAFETY: the kernel filled msg_control up to msg_controllen; the CMSG macros stay
    // within it, and the data is read unaligned.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::IPPROTO_IP && (*c).cmsg_type == libc::IP_PKTINFO {
                let info: libc::in_pktinfo = ptr::read_unaligned(libc::CMSG_DATA(c).cast());
                dst = Ipv4Addr::from(u32::from_be(info.ipi_addr.s_addr));
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    let src = SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(src.sin_addr.s_addr)),
        u16::from_be(src.sin_port),
    );
    Ok((n as usize, src, dst))
}

/// sendmsg to `to` with `from` as the source address (IP_PKTINFO), unless unspecified.
fn send_from(fd: RawFd, data: &[u8], to: SocketAddrV4, from: Ipv4Addr) -> io::Result<usize> {
    let mut dst = sockaddr_v4(to);
    let mut iov = libc::iovec {
        iov_base: data.as_ptr().cast_mut().cast(),
        iov_len: data.len(),
    };
    let mut control = [0u64; 8];
    // SAFETY: plain old data, zero is valid.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_name = ptr::from_mut(&mut dst).cast();
    msg.msg_namelen = mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !from.is_unspecified() {
        msg.msg_control = control.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE/CMSG_LEN are arithmetic; the header and data are written inside
        // `control`, which is larger than CMSG_SPACE(sizeof in_pktinfo).
        unsafe {
            msg.msg_controllen = libc::CMSG_SPACE(mem::size_of::<libc::in_pktinfo>() as u32) as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::IPPROTO_IP;
            (*c).cmsg_type = libc::IP_PKTINFO;
            (*c).cmsg_len = libc::CMSG_LEN(mem::size_of::<libc::in_pktinfo>() as u32) as _;
            let info = libc::in_pktinfo {
                ipi_ifindex: 0,
                ipi_spec_dst: libc::in_addr {
                    s_addr: u32::from(from).to_be(),
                },
                ipi_addr: libc::in_addr { s_addr: 0 },
            };
            ptr::write_unaligned(libc::CMSG_DATA(c).cast(), info);
        }
    }
    // SAFETY: every pointer in msg refers to live buffers of the stated sizes.
    let n = unsafe { libc::sendmsg(fd, &msg, 0) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}
