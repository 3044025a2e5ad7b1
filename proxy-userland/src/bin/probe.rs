//! `fastpath-probe`: a tiny client and server for seeing where a service address leads.
//!
//! `serve` answers every TCP connection with its name and a newline, and every UDP datagram
//! with its name; with `--echo-peer` the name is followed by `@` and the client's address as
//! the server saw it (`NAME@198.18.2.1:40000`, `NAME@[2001:db8::1]:40000`), so a test can
//! tell whether the client's source address was kept or rewritten. `tcp` and `udp` send
//! requests and print one line per attempt:
//!
//! ```text
//! ok <reply> peer=<getpeername>                     (tcp)
//! ok <reply> from=<recvfrom source> peer=<getpeername or ->   (udp)
//! err <ERRNO_NAME> <message>
//! ```
//!
//! The client always exits 0 (the lines say what happened); bad usage, or failing to set up
//! (cgroup, namespace, bind), prints an error and exits 2. With `--cgroup` and `--netns` it first joins a
//! cgroup v2 and a named network namespace, so the test bed can run it as a "pod" or as a
//! client under the proxy's cgroup programs.

use std::{
    fs,
    io::{self, ErrorKind, Read as _, Write as _},
    mem,
    net::{SocketAddr, TcpStream, UdpSocket},
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    process::ExitCode,
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};

#[path = "probe/alternate.rs"]
mod alternate;
#[path = "probe/http.rs"]
mod http;
#[path = "probe/load.rs"]
mod load;
#[path = "probe/serve.rs"]
mod serve;

/// Longest reply we read, and longest we print (a name and an `@[IPv6%scope]:port`).
const MAX_REPLY: usize = 256;
const MAX_PRINTED: usize = 160;
/// Longest `--name`.
const MAX_NAME: usize = 64;

#[derive(Debug, Parser)]
#[command(
    name = "fastpath-probe",
    version,
    about = "Probe where service addresses lead"
)]
struct Cli {
    /// Join this cgroup v2 first (writes our pid to PATH/cgroup.procs).
    #[arg(long, global = true, value_name = "PATH")]
    cgroup: Option<PathBuf>,

    /// Then enter the network namespace /run/netns/NAME (before making any socket).
    #[arg(long, global = true, value_name = "NAME")]
    netns: Option<String>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Answer TCP connections with "NAME\n" and UDP datagrams with "NAME", until killed.
    Serve {
        /// The name to reply with (no spaces, no '@').
        #[arg(long)]
        name: String,
        /// Reply "NAME@ADDR:PORT" instead: the client's address as accept()/recvfrom() saw
        /// it (IPv6 as [ADDR]:PORT).
        #[arg(long)]
        echo_peer: bool,
        /// Listen for TCP here (e.g. 0.0.0.0:8080 or [::]:8080); repeatable.
        #[arg(long, value_name = "ADDR:PORT")]
        tcp: Vec<SocketAddr>,
        /// Answer UDP here; repeatable.
        #[arg(long, value_name = "ADDR:PORT")]
        udp: Vec<SocketAddr>,
        /// Answer HTTP/1.1 GETs here with the name, keeping connections alive; repeatable.
        #[arg(long, value_name = "ADDR:PORT")]
        http: Vec<SocketAddr>,
        /// On SIGTERM keep serving for this long (kept-alive HTTP connections are told to
        /// close), then exit 0, as a pod with a graceful shutdown does. Without it SIGTERM
        /// ends the server at once.
        #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(0..=600_000))]
        drain_ms: Option<u64>,
    },
    /// Keep sending requests with several clients at once and count every one (JSON lines
    /// on stdout; see the `load` module).
    Load {
        /// KIND=ADDR[,ADDR...]: tcp, http, udp, udp-connected, lb (TARGET@HEALTH pairs).
        #[arg(long = "client", value_name = "KIND=ADDR", required = true)]
        clients: Vec<load::ClientSpec>,
        /// Stop after this long.
        #[arg(long, default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
        duration_ms: u64,
        /// Pause between one client's requests.
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=10_000))]
        interval_ms: u64,
        /// Time limit for each connect and each answer.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=60_000))]
        timeout_ms: u64,
        /// A report line this often.
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(10..=60_000))]
        report_ms: u64,
    },
    /// Connect, read the reply line, report the peer; once per attempt.
    Tcp {
        addr: SocketAddr,
        #[command(flatten)]
        attempts: Attempts,
        /// Close each connection with a reset (SO_LINGER 0) instead of a FIN, so it leaves
        /// no TIME_WAIT socket behind: a benchmark making thousands of connections to one
        /// destination then cannot run out of ephemeral ports.
        #[arg(long)]
        reset: bool,
        /// Connect from this local port, every attempt (with --reset, as a client whose
        /// ephemeral port comes round again): what a flow table keyed by ports sees when
        /// connections reuse a tuple.
        #[arg(long, value_name = "PORT", conflicts_with = "alternate")]
        source_port: Option<u16>,
        /// Take turns with attempts from this network namespace (and, with @CGROUP, from a
        /// socket made in that cgroup v2) to this address (repeatable), each line then
        /// saying which arm made it (see the `alternate` module): two paths measured in the
        /// same moments.
        #[arg(long = "alternate", value_name = "NETNS=ADDR[@CGROUP]")]
        alternate: Vec<alternate::ArmSpec>,
    },
    /// Send "ping", wait for the reply, report its source; once per attempt.
    Udp {
        addr: SocketAddr,
        #[command(flatten)]
        attempts: Attempts,
        /// connect() the socket and use send(), instead of sendto() on an unconnected socket.
        #[arg(long)]
        connected: bool,
        /// A new socket for every attempt (default: one socket for all).
        #[arg(long)]
        fresh_socket: bool,
        /// After a socket error (not a mere timeout), use a new socket for the next attempt,
        /// as long-lived UDP clients (statsd, DNS forwarders) do.
        #[arg(long)]
        reconnect_on_error: bool,
        /// Send from this local port (with --fresh-socket: every new socket binds it again,
        /// as `nc -u -p PORT` in a loop does).
        #[arg(long, value_name = "PORT")]
        source_port: Option<u16>,
        /// With --source-port and --fresh-socket: attempt i sends from source port + i, so
        /// each attempt is a flow of its own, and a second run repeats the same flows.
        #[arg(long, requires = "source_port", requires = "fresh_socket")]
        port_step: bool,
    },
}

#[derive(Debug, clap::Args)]
struct Attempts {
    /// How many attempts.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    count: u32,
    /// Time limit for each connect and each reply, in milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    timeout_ms: u64,
    /// Pause between attempts, in milliseconds.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=10_000))]
    interval_ms: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Serve {
        name,
        tcp,
        udp,
        http,
        ..
    } = &cli.command
    {
        if let Err(e) = check_name(name) {
            eprintln!("fastpath-probe: {e}");
            return ExitCode::from(2);
        }
        if tcp.is_empty() && udp.is_empty() && http.is_empty() {
            eprintln!("fastpath-probe: serve needs at least one --tcp, --udp or --http address");
            return ExitCode::from(2);
        }
    }
    if let Err(e) = enter(cli.cgroup.as_deref(), cli.netns.as_deref()) {
        eprintln!("fastpath-probe: {e:#}");
        return ExitCode::from(2);
    }
    match cli.command {
        Command::Serve {
            name,
            echo_peer,
            tcp,
            udp,
            http,
            drain_ms,
        } => exit_code(serve::serve(
            &serve::Replier { name, echo_peer },
            &serve::Listen { tcp, udp, http },
            drain_ms.map(Duration::from_millis),
        )),
        Command::Load {
            clients,
            duration_ms,
            interval_ms,
            timeout_ms,
            report_ms,
        } => exit_code(load::run(load::LoadOptions {
            clients,
            duration: Duration::from_millis(duration_ms),
            interval: Duration::from_millis(interval_ms),
            timeout: Duration::from_millis(timeout_ms),
            report: Duration::from_millis(report_ms),
        })),
        Command::Tcp {
            addr,
            attempts,
            reset,
            alternate,
            ..
        } if !alternate.is_empty() => {
            let turns = alternate::Turns {
                rounds: attempts.count,
                timeout: Duration::from_millis(attempts.timeout_ms),
                interval: Duration::from_millis(attempts.interval_ms),
            };
            let own_cgroup = cli.cgroup.as_deref();
            exit_code(alternate::run(
                addr,
                own_cgroup,
                &alternate,
                &turns,
                |a, t| tcp_attempt(a, t, reset, None),
            ))
        }
        Command::Tcp {
            addr,
            attempts,
            reset,
            source_port,
            ..
        } => {
            each_attempt(&attempts, |timeout| {
                tcp_attempt(addr, timeout, reset, source_port)
            });
            ExitCode::SUCCESS
        }
        Command::Udp {
            addr,
            attempts,
            connected,
            fresh_socket,
            reconnect_on_error,
            source_port,
            port_step,
        } => {
            let mut shared = None;
            let mut next_port = source_port;
            each_attempt(&attempts, |timeout| {
                let port = next_port;
                if port_step {
                    next_port = next_port.and_then(|p| p.checked_add(1));
                }
                let line = udp_attempt(addr, timeout, connected, port, &mut shared);
                let socket_error = line.starts_with("err") && !line.starts_with("err ETIMEDOUT");
                if fresh_socket || (reconnect_on_error && socket_error) {
                    shared = None;
                }
                line
            });
            ExitCode::SUCCESS
        }
    }
}

/// 0 for done, 2 (with the error on stderr) for a setup that failed.
fn exit_code(result: Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fastpath-probe: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME {
        bail!("--name must have 1 to {MAX_NAME} characters");
    }
    if name
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || c == '@')
    {
        bail!("--name must not contain spaces, control characters or '@'");
    }
    Ok(())
}

/// Joins the cgroup, then the network namespace. We are single-threaded here, and no socket
/// exists yet, so everything made afterwards lives in the namespace.
fn enter(cgroup: Option<&Path>, netns: Option<&str>) -> Result<()> {
    if let Some(cgroup) = cgroup {
        join_cgroup(cgroup)?;
    }
    if let Some(name) = netns {
        if !valid_netns_name(name) {
            bail!("bad --netns name {name:?}");
        }
        let file = open_netns(name)?;
        enter_netns(&file).with_context(|| format!("entering network namespace {name}"))?;
    }
    Ok(())
}

/// Moves this process into the cgroup v2 at `cgroup`: sockets made afterwards belong to it.
fn join_cgroup(cgroup: &Path) -> Result<()> {
    let procs = cgroup.join("cgroup.procs");
    fs::write(&procs, format!("{}\n", std::process::id())).with_context(|| {
        format!(
            "joining cgroup {} (writing {})",
            cgroup.display(),
            procs.display()
        )
    })
}

/// The named network namespace /run/netns/NAME, opened.
fn open_netns(name: &str) -> Result<fs::File> {
    if !valid_netns_name(name) {
        bail!("bad network namespace name {name:?}");
    }
    let path = Path::new("/run/netns").join(name);
    fs::File::open(&path).with_context(|| format!("opening {}", path.display()))
}

/// A name of a file in /run/netns, and nothing that leads out of it.
fn valid_netns_name(name: &str) -> bool {
    !(name.is_empty() || name.contains('/') || name == "." || name == "..")
}

/// Moves this thread into the network namespace `ns` refers to: sockets made afterwards
/// live there.
fn enter_netns(ns: &impl AsRawFd) -> io::Result<()> {
    // SAFETY: the fd is valid for the call (`ns` holds it open); setns has no memory-safety
    // preconditions.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn each_attempt(attempts: &Attempts, mut attempt: impl FnMut(Duration) -> String) {
    let timeout = Duration::from_millis(attempts.timeout_ms);
    let mut stdout = io::stdout().lock();
    for i in 0..attempts.count {
        if i > 0 && attempts.interval_ms > 0 {
            thread::sleep(Duration::from_millis(attempts.interval_ms));
        }
        let started = std::time::Instant::now();
        let line = attempt(timeout);
        // How long the attempt took (connect + reply), for latency measurements.
        let us = started.elapsed().as_micros();
        if writeln!(stdout, "{line} us={us}")
            .and_then(|()| stdout.flush())
            .is_err()
        {
            return; // stdout closed: nobody is listening
        }
    }
}

// ---- client -------------------------------------------------------------------------------

/// Every local address of `peer`'s family, at `port` (0: any free one).
fn any_local(peer: SocketAddr, port: u16) -> SocketAddr {
    if peer.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, port).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, port).into()
    }
}

/// A TCP connection to `addr`, from `source_port` if given.
fn tcp_connect(
    addr: SocketAddr,
    timeout: Duration,
    source_port: Option<u16>,
) -> io::Result<TcpStream> {
    let Some(port) = source_port else {
        return TcpStream::connect_timeout(&addr, timeout);
    };
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        None,
    )?;
    socket.set_reuse_address(true)?;
    socket.bind(&any_local(addr, port).into())?;
    socket.connect_timeout(&addr.into(), timeout)?;
    Ok(socket.into())
}

fn tcp_attempt(
    addr: SocketAddr,
    timeout: Duration,
    reset: bool,
    source_port: Option<u16>,
) -> String {
    let mut stream = match tcp_connect(addr, timeout, source_port) {
        Ok(stream) => stream,
        Err(e) => return err_line("connect", &e, timeout),
    };
    if reset && let Err(e) = set_linger_zero(&stream) {
        return err_line("setsockopt", &e, timeout);
    }
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "-".to_string(), |p| p.to_string());
    if let Err(e) = stream.set_read_timeout(Some(timeout)) {
        return err_line("setsockopt", &e, timeout);
    }
    let mut buf = [0u8; MAX_REPLY];
    let mut len = 0;
    while len < buf.len() && !buf[..len].contains(&b'\n') {
        match stream.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return format!("{} (peer={peer})", err_line("read", &e, timeout)),
        }
    }
    format!("ok {} peer={peer}", printable(&buf[..len]))
}

fn udp_attempt(
    addr: SocketAddr,
    timeout: Duration,
    connected: bool,
    source_port: Option<u16>,
    shared: &mut Option<UdpSocket>,
) -> String {
    if shared.is_none() {
        let port = source_port.unwrap_or(0);
        let socket = match UdpSocket::bind(any_local(addr, port)) {
            Ok(s) => s,
            Err(e) => return err_line("bind", &e, timeout),
        };
        if connected && let Err(e) = socket.connect(addr) {
            return err_line("connect", &e, timeout);
        }
        *shared = Some(socket);
    }
    let socket = shared.as_ref().expect("made above");
    drain(socket);
    let sent = if connected {
        socket.send(b"ping")
    } else {
        socket.send_to(b"ping", addr)
    };
    if let Err(e) = sent {
        return err_line("send", &e, timeout);
    }
    if let Err(e) = socket.set_read_timeout(Some(timeout)) {
        return err_line("setsockopt", &e, timeout);
    }
    let mut buf = [0u8; MAX_REPLY];
    loop {
        match socket.recv_from(&mut buf) {
            Ok((n, from)) => {
                let peer = if connected {
                    socket
                        .peer_addr()
                        .map_or_else(|_| "-".to_string(), |p| p.to_string())
                } else {
                    "-".to_string()
                };
                return format!("ok {} from={from} peer={peer}", printable(&buf[..n]));
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return err_line("recv", &e, timeout),
        }
    }
}

/// Drops late replies to earlier attempts, so each attempt reads its own answer.
fn drain(socket: &UdpSocket) {
    if socket.set_nonblocking(true).is_err() {
        return;
    }
    let mut buf = [0u8; MAX_REPLY];
    for _ in 0..1000 {
        if socket.recv_from(&mut buf).is_err() {
            break;
        }
    }
    let _ = socket.set_nonblocking(false);
}

/// The reply's first line, trimmed, with anything that would break the output format
/// replaced; `-` if empty.
fn printable(bytes: &[u8]) -> String {
    let line = bytes.split(|&b| b == b'\n').next().unwrap_or_default();
    let text = String::from_utf8_lossy(line);
    let text: String = text
        .trim()
        .chars()
        .take(MAX_PRINTED)
        .map(|c| {
            if c.is_whitespace() || c.is_control() {
                '_'
            } else {
                c
            }
        })
        .collect();
    if text.is_empty() {
        "-".to_string()
    } else {
        text
    }
}

fn err_line(op: &str, e: &io::Error, timeout: Duration) -> String {
    let ms = timeout.as_millis();
    match (e.raw_os_error(), e.kind()) {
        (Some(code), _) if code == libc::EAGAIN || code == libc::EWOULDBLOCK => {
            format!("err ETIMEDOUT {op}: no answer within {ms} ms")
        }
        (Some(code), _) => format!("err {} {op}: {}", errno_name(code), strip_os_error(e)),
        (None, ErrorKind::TimedOut | ErrorKind::WouldBlock) => {
            format!("err ETIMEDOUT {op}: no answer within {ms} ms")
        }
        (None, kind) => format!("err EOTHER {op}: {kind}: {e}"),
    }
}

/// "Connection refused (os error 111)" -> "Connection refused".
fn strip_os_error(e: &io::Error) -> String {
    let text = e.to_string();
    match text.rfind(" (os error ") {
        Some(i) => text[..i].to_string(),
        None => text,
    }
}

fn errno_name(code: i32) -> String {
    let name = match code {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EBADF => "EBADF",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EINVAL => "EINVAL",
        libc::EPIPE => "EPIPE",
        libc::ENOBUFS => "ENOBUFS",
        libc::EMSGSIZE => "EMSGSIZE",
        libc::EPROTO => "EPROTO",
        libc::EPROTONOSUPPORT => "EPROTONOSUPPORT",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::EAFNOSUPPORT => "EAFNOSUPPORT",
        libc::EADDRINUSE => "EADDRINUSE",
        libc::EADDRNOTAVAIL => "EADDRNOTAVAIL",
        libc::ENETDOWN => "ENETDOWN",
        libc::ENETUNREACH => "ENETUNREACH",
        libc::ENETRESET => "ENETRESET",
        libc::ECONNABORTED => "ECONNABORTED",
        libc::ECONNRESET => "ECONNRESET",
        libc::EISCONN => "EISCONN",
        libc::ENOTCONN => "ENOTCONN",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::ECONNREFUSED => "ECONNREFUSED",
        libc::EHOSTDOWN => "EHOSTDOWN",
        libc::EHOSTUNREACH => "EHOSTUNREACH",
        libc::EALREADY => "EALREADY",
        libc::EINPROGRESS => "EINPROGRESS",
        _ => return format!("E{code}"),
    };
    name.to_string()
}

/// SO_LINGER on with a zero timeout: close() sends a reset and keeps no TIME_WAIT state.
fn set_linger_zero(stream: &TcpStream) -> io::Result<()> {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: the pointer and length describe `linger`, which outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}
