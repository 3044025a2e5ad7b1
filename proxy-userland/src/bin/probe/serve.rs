//! `serve`: answers TCP connections with the name and a newline, UDP datagrams with the
//! name, and (with `--http`, see [`super::http`]) keep-alive HTTP GETs.

use std::{
    io::{self, ErrorKind, Write as _},
    mem,
    net::{SocketAddr, TcpListener, UdpSocket},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};

use super::http;

/// Where `serve` listens.
pub struct Listen {
    pub tcp: Vec<SocketAddr>,
    pub udp: Vec<SocketAddr>,
    pub http: Vec<SocketAddr>,
}

fn listener(addr: SocketAddr) -> Result<TcpListener> {
    let fd = bound_socket(addr, libc::SOCK_STREAM).with_context(|| format!("TCP {addr}"))?;
    // SAFETY: listen on a valid socket fd.
    if unsafe { libc::listen(fd.as_raw_fd(), 128) } != 0 {
        return Err(io::Error::last_os_error()).with_context(|| format!("listen on TCP {addr}"));
    }
    Ok(TcpListener::from(fd))
}

pub fn serve(replier: &Replier, listen: &Listen, drain: Option<Duration>) -> Result<()> {
    let listeners = listen
        .tcp
        .iter()
        .map(|&a| listener(a))
        .collect::<Result<Vec<_>>>()?;
    let http_listeners = listen
        .http
        .iter()
        .map(|&a| listener(a))
        .collect::<Result<Vec<_>>>()?;
    let mut sockets = Vec::new();
    for &addr in &listen.udp {
        let fd = bound_socket(addr, libc::SOCK_DGRAM).with_context(|| format!("UDP {addr}"))?;
        sockets.push(UdpSocket::from(fd));
    }
    if let Some(drain) = drain {
        http::drain_on_sigterm(drain);
    }
    let mut threads = Vec::new();
    for listener in listeners {
        let replier = replier.clone();
        threads.push(thread::spawn(move || tcp_server(&listener, &replier)));
    }
    for socket in sockets {
        let replier = replier.clone();
        threads.push(thread::spawn(move || udp_server(&socket, &replier)));
    }
    for listener in http_listeners {
        let replier = replier.clone();
        threads.push(thread::spawn(move || {
            http::http_server(&listener, &replier)
        }));
    }
    let mut stdout = io::stdout().lock();
    writeln!(stdout, "ready")
        .and_then(|()| stdout.flush())
        .context("writing to stdout")?;
    drop(stdout);
    for t in threads {
        let _ = t.join();
    }
    bail!("all servers stopped")
}

/// What the server answers: its name, and with `--echo-peer` `@` and the client's address.
#[derive(Clone)]
pub struct Replier {
    pub name: String,
    pub echo_peer: bool,
}

impl Replier {
    pub fn reply(&self, from: SocketAddr) -> String {
        if self.echo_peer {
            // SocketAddr's Display writes IPv6 as [ip]:port.
            format!("{}@{from}", self.name)
        } else {
            self.name.clone()
        }
    }
}

fn tcp_server(listener: &TcpListener, replier: &Replier) {
    loop {
        match listener.accept() {
            Ok((mut conn, from)) => {
                let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
                let _ = conn.write_all(format!("{}\n", replier.reply(from)).as_bytes());
                let _ = conn.shutdown(std::net::Shutdown::Write);
            }
            Err(e) => {
                eprintln!("fastpath-probe: accept: {e}");
                thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn udp_server(socket: &UdpSocket, replier: &Replier) {
    let mut buf = [0u8; 2048];
    loop {
        match socket.recv_from(&mut buf) {
            Ok((_, from)) => {
                if let Err(e) = socket.send_to(replier.reply(from).as_bytes(), from) {
                    eprintln!("fastpath-probe: reply to {from}: {e}");
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => {
                eprintln!("fastpath-probe: recv: {e}");
                thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// A socket bound to `addr`, with SO_REUSEADDR, and IPV6_V6ONLY for IPv6 (so that
/// `0.0.0.0:P` and `[::]:P` can be served side by side).
fn bound_socket(addr: SocketAddr, kind: libc::c_int) -> io::Result<OwnedFd> {
    let domain = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain syscall; the returned fd is checked and then owned.
    let raw = unsafe { libc::socket(domain, kind | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    set_int_opt(&fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    if addr.is_ipv6() {
        set_int_opt(&fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1)?;
    }
    let rc = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_in is plain data; all-zero is valid.
            let mut sa: libc::sockaddr_in = unsafe { mem::zeroed() };
            sa.sin_family = libc::AF_INET as libc::sa_family_t;
            sa.sin_port = a.port().to_be();
            sa.sin_addr = libc::in_addr {
                s_addr: u32::from_ne_bytes(a.ip().octets()),
            };
            // SAFETY: the pointer and length describe `sa`.
            unsafe {
                libc::bind(
                    fd.as_raw_fd(),
                    (&raw const sa).cast(),
                    mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
                )
            }
        }
        SocketAddr::V6(a) => {
            // SAFETY: sockaddr_in6 is plain data; all-zero is valid.
            let mut sa: libc::sockaddr_in6 = unsafe { mem::zeroed() };
            sa.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sa.sin6_port = a.port().to_be();
            sa.sin6_flowinfo = a.flowinfo();
            sa.sin6_addr = libc::in6_addr {
                s6_addr: a.ip().octets(),
            };
            sa.sin6_scope_id = a.scope_id();
            // SAFETY: the pointer and length describe `sa`.
            unsafe {
                libc::bind(
                    fd.as_raw_fd(),
                    (&raw const sa).cast(),
                    mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
                )
            }
        }
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

fn set_int_opt(
    fd: &OwnedFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: the pointer and length describe `value`.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&raw const value).cast(),
            mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}
