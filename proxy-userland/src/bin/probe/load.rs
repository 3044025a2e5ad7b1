//! `fastpath-probe load`: clients that keep sending requests and count every one, the way a
//! user judges a cluster while a Deployment rolls: requests, failures by error, the longest
//! time without a success, and which backends answered.
//!
//! Each client is a thread. Kinds:
//! - `tcp=ADDR[,ADDR...]`: a new TCP connection per request (round robin over the addresses,
//!   e.g. every node's NodePort), reading the server's one-line answer;
//! - `http=ADDR`: HTTP/1.1 keep-alive on one connection, reconnecting only when the server
//!   says `Connection: close` (or the connection failed);
//! - `udp=ADDR`: a fresh socket per request;
//! - `udp-connected=ADDR`: one connected socket for the whole run that never reconnects, as a
//!   statsd or DNS client that ignores send errors;
//! - `lb=TARGET@HEALTH[,TARGET@HEALTH...]`: an outside load balancer: new TCP connections to
//!   the targets whose health check (HTTP GET on HEALTH, kube-proxy's healthCheckNodePort)
//!   last answered 200, checked every 100 ms.
//!
//! Every `--report-ms` and at the end, one JSON line on stdout:
//! `{"final":false,"clients":[{"name":..,"requests":..,"ok":..,"failures":{"ETIMEDOUT":1},
//! "longest_gap_ms":..,"last_failure_unix_ms":..,"backends":{"pod-a":12}}]}`, where
//! `last_failure_unix_ms` is when the last failed request was sent.
//! The run ends after `--duration-ms`, or at SIGTERM/SIGINT (with a final line).

use std::{
    collections::BTreeMap,
    io::{self, BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result, bail};

use super::{MAX_REPLY, err_line, printable};

/// Set by SIGTERM/SIGINT: finish with a final report.
static STOP: AtomicBool = AtomicBool::new(false);
/// Health checks of `lb` clients run this often.
const HEALTH_EVERY: Duration = Duration::from_millis(100);
/// Longest HTTP response head or body we read.
const MAX_HTTP: usize = 8192;

/// One client as given on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientSpec {
    Tcp(Vec<SocketAddr>),
    Http(SocketAddr),
    Udp(SocketAddr),
    UdpConnected(SocketAddr),
    Lb(Vec<(SocketAddr, SocketAddr)>),
}

impl std::str::FromStr for ClientSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, addrs) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: expected KIND=ADDR[,ADDR...]"))?;
        let parse = |a: &str| {
            a.parse::<SocketAddr>()
                .map_err(|e| format!("{a:?} in {s:?}: {e}"))
        };
        let list = || addrs.split(',').map(parse).collect::<Result<Vec<_>, _>>();
        let one = || match list()?.as_slice() {
            [a] => Ok(*a),
            _ => Err(format!("{s:?}: {kind} takes exactly one address")),
        };
        Ok(match kind {
            "tcp" => ClientSpec::Tcp(list()?),
            "http" => ClientSpec::Http(one()?),
            "udp" => ClientSpec::Udp(one()?),
            "udp-connected" => ClientSpec::UdpConnected(one()?),
            "lb" => ClientSpec::Lb(
                addrs
                    .split(',')
                    .map(|pair| {
                        let (t, h) = pair
                            .split_once('@')
                            .ok_or_else(|| format!("{pair:?} in {s:?}: expected TARGET@HEALTH"))?;
                        Ok((parse(t)?, parse(h)?))
                    })
                    .collect::<Result<Vec<_>, String>>()?,
            ),
            _ => return Err(format!("unknown client kind {kind:?} in {s:?}")),
        })
    }
}

impl ClientSpec {
    fn name(&self) -> String {
        let join = |v: &[SocketAddr]| {
            v.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        match self {
            ClientSpec::Tcp(a) => format!("tcp {}", join(a)),
            ClientSpec::Http(a) => format!("http {a}"),
            ClientSpec::Udp(a) => format!("udp {a}"),
            ClientSpec::UdpConnected(a) => format!("udp-connected {a}"),
            ClientSpec::Lb(p) => format!(
                "lb {}",
                join(&p.iter().map(|(t, _)| *t).collect::<Vec<_>>())
            ),
        }
    }
}

/// What the load run is told.
pub struct LoadOptions {
    pub clients: Vec<ClientSpec>,
    pub duration: Duration,
    pub interval: Duration,
    pub timeout: Duration,
    pub report: Duration,
}

/// One client's counts so far.
#[derive(Default)]
struct Stats {
    requests: u64,
    ok: u64,
    failures: BTreeMap<String, u64>,
    backends: BTreeMap<String, u64>,
    last_ok: Option<Instant>,
    longest_gap: Duration,
    last_failure_unix_ms: Option<u128>,
}

impl Stats {
    fn record(&mut self, started: Instant, outcome: Result<String, String>) {
        self.requests += 1;
        match outcome {
            Ok(backend) => {
                self.ok += 1;
                let now = Instant::now();
                let since = self.last_ok.unwrap_or(started);
                self.longest_gap = self.longest_gap.max(now - since);
                self.last_ok = Some(now);
                *self.backends.entry(backend).or_default() += 1;
            }
            Err(error) => {
                *self.failures.entry(error).or_default() += 1;
                // When the failed request was sent: a timeout reports a second later.
                self.last_failure_unix_ms = (SystemTime::now() - started.elapsed())
                    .duration_since(UNIX_EPOCH)
                    .ok()
                    .map(|d| d.as_millis());
            }
        }
    }

    fn json(&self, name: &str, run_started: Instant) -> serde_json::Value {
        // A client still waiting for its next success is in a gap too.
        let open_gap = Instant::now() - self.last_ok.unwrap_or(run_started);
        serde_json::json!({
            "name": name,
            "requests": self.requests,
            "ok": self.ok,
            "failures": self.failures,
            "longest_gap_ms": self.longest_gap.max(open_gap).as_millis() as u64,
            "last_failure_unix_ms": self.last_failure_unix_ms.map(|m| m as u64),
            "backends": self.backends,
        })
    }
}

extern "C" fn on_stop(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Runs every client until the duration is over or a stop signal comes, reporting as it goes.
pub fn run(opts: LoadOptions) -> Result<()> {
    if opts.clients.is_empty() {
        bail!("load needs at least one --client");
    }
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_stop as *const () as libc::sighandler_t) };
    }
    let run_started = Instant::now();
    let deadline = run_started + opts.duration;
    let running = || !STOP.load(Ordering::SeqCst) && Instant::now() < deadline;
    let stats: Vec<(String, Arc<Mutex<Stats>>)> = opts
        .clients
        .iter()
        .map(|c| (c.name(), Arc::default()))
        .collect();
    thread::scope(|s| {
        for (spec, (_, st)) in opts.clients.iter().zip(&stats) {
            let (interval, timeout) = (opts.interval, opts.timeout);
            s.spawn(move || client_loop(spec, st, interval, timeout, &running));
        }
        let mut next = run_started + opts.report;
        while running() {
            thread::sleep(Duration::from_millis(10));
            if Instant::now() >= next {
                next += opts.report;
                if report(&stats, run_started, false).is_err() {
                    STOP.store(true, Ordering::SeqCst);
                }
            }
        }
    });
    report(&stats, run_started, true).context("writing the final report")
}

fn report(
    stats: &[(String, Arc<Mutex<Stats>>)],
    run_started: Instant,
    last: bool,
) -> io::Result<()> {
    let clients: Vec<serde_json::Value> = stats
        .iter()
        .map(|(name, st)| {
            st.lock()
                .unwrap_or_else(|e| e.into_inner())
                .json(name, run_started)
        })
        .collect();
    let line = serde_json::json!({"final": last, "clients": clients});
    let mut out = io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()
}

fn client_loop(
    spec: &ClientSpec,
    stats: &Mutex<Stats>,
    interval: Duration,
    timeout: Duration,
    running: &dyn Fn() -> bool,
) {
    let mut http: Option<BufReader<TcpStream>> = None;
    let mut connected: Option<UdpSocket> = None;
    let health = match spec {
        ClientSpec::Lb(pairs) => Some(HealthChecks::start(pairs, timeout)),
        _ => None,
    };
    let mut turn = 0usize;
    while running() {
        let started = Instant::now();
        let outcome = match spec {
            ClientSpec::Tcp(targets) => {
                turn += 1;
                tcp_request(targets[turn % targets.len()], timeout)
            }
            ClientSpec::Http(addr) => http_request(&mut http, *addr, timeout),
            ClientSpec::Udp(addr) => {
                udp_socket(*addr, timeout).and_then(|s| udp_exchange(&s, timeout))
            }
            // Made once (retried only until that first socket exists), then kept whatever
            // happens to it: this client never reconnects.
            ClientSpec::UdpConnected(addr) => match &connected {
                Some(s) => udp_exchange(s, timeout),
                None => udp_socket(*addr, timeout).and_then(|s| {
                    let answer = udp_exchange(&s, timeout);
                    connected = Some(s);
                    answer
                }),
            },
            ClientSpec::Lb(_) => {
                let healthy = health
                    .as_ref()
                    .map(HealthChecks::healthy)
                    .unwrap_or_default();
                if healthy.is_empty() {
                    Err("ENOHEALTHY".to_string())
                } else {
                    turn += 1;
                    tcp_request(healthy[turn % healthy.len()], timeout)
                }
            }
        };
        stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .record(started, outcome);
        thread::sleep(interval.saturating_sub(started.elapsed()));
    }
    if let Some(h) = health {
        h.stop();
    }
}

/// The errno name of a failed step (see [`err_line`]): `err NAME ...` -> `NAME`.
fn error_name(op: &str, e: &io::Error, timeout: Duration) -> String {
    let line = err_line(op, e, timeout);
    line.split_whitespace()
        .nth(1)
        .unwrap_or("EOTHER")
        .to_string()
}

fn tcp_request(addr: SocketAddr, timeout: Duration) -> Result<String, String> {
    let mut stream = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| error_name("connect", &e, timeout))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| error_name("setsockopt", &e, timeout))?;
    let mut buf = Vec::with_capacity(64);
    (&mut stream)
        .take(MAX_REPLY as u64)
        .read_to_end(&mut buf)
        .map_err(|e| error_name("read", &e, timeout))?;
    match printable(&buf) {
        name if name == "-" => Err("EMPTY".to_string()),
        name => Ok(name),
    }
}

fn http_request(
    conn: &mut Option<BufReader<TcpStream>>,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<String, String> {
    if conn.is_none() {
        let stream = TcpStream::connect_timeout(&addr, timeout)
            .map_err(|e| error_name("connect", &e, timeout))?;
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .map_err(|e| error_name("setsockopt", &e, timeout))?;
        *conn = Some(BufReader::new(stream));
    }
    let reader = conn.as_mut().expect("connected above");
    let result = http_exchange(reader, timeout);
    // Reconnect after a failure, or when the server asked to close.
    match &result {
        Ok((_, true)) | Err(_) => *conn = None,
        Ok((_, false)) => {}
    }
    result.map(|(body, _)| body)
}

/// One GET on a kept-alive connection: the body and whether the server closes it.
fn http_exchange(
    reader: &mut BufReader<TcpStream>,
    timeout: Duration,
) -> Result<(String, bool), String> {
    reader
        .get_mut()
        .write_all(b"GET / HTTP/1.1\r\nHost: fastpath\r\n\r\n")
        .map_err(|e| error_name("write", &e, timeout))?;
    let mut status_line = String::new();
    let mut length = None;
    let mut close = false;
    let mut head = 0usize;
    loop {
        let mut line = String::new();
        let n = reader
            .read_line(&mut line)
            .map_err(|e| error_name("read", &e, timeout))?;
        head += n;
        if n == 0 {
            return Err("EOF".to_string());
        }
        if head > MAX_HTTP {
            return Err("EHTTP".to_string());
        }
        let line = line.trim_end();
        if status_line.is_empty() {
            status_line = line.to_string();
            continue;
        }
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            if k == "content-length" {
                length = v.parse::<usize>().ok().filter(|&l| l <= MAX_HTTP);
            } else if k == "connection" && v.eq_ignore_ascii_case("close") {
                close = true;
            }
        }
    }
    if status_line.split_whitespace().nth(1) != Some("200") {
        return Err("EHTTP".to_string());
    }
    let mut body = vec![0u8; length.ok_or_else(|| "EHTTP".to_string())?];
    reader
        .read_exact(&mut body)
        .map_err(|e| error_name("read", &e, timeout))?;
    Ok((printable(&body), close))
}

/// A UDP socket connected to `addr`, with the request timeout set.
fn udp_socket(addr: SocketAddr, timeout: Duration) -> Result<UdpSocket, String> {
    let s =
        UdpSocket::bind(super::any_local(addr, 0)).map_err(|e| error_name("bind", &e, timeout))?;
    s.connect(addr)
        .map_err(|e| error_name("connect", &e, timeout))?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| error_name("setsockopt", &e, timeout))?;
    Ok(s)
}

/// "ping" and the answer's first line.
fn udp_exchange(socket: &UdpSocket, timeout: Duration) -> Result<String, String> {
    super::drain(socket);
    socket
        .send(b"ping")
        .map_err(|e| error_name("send", &e, timeout))?;
    let mut buf = [0u8; MAX_REPLY];
    loop {
        match socket.recv(&mut buf) {
            Ok(n) => return Ok(printable(&buf[..n])),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(error_name("recv", &e, timeout)),
        }
    }
}

/// The health checks of an `lb` client: one thread asks every target's health address in
/// turn and keeps which answered 200 last time.
struct HealthChecks {
    healthy: Arc<Mutex<Vec<SocketAddr>>>,
    stop: Arc<AtomicBool>,
    thread: thread::JoinHandle<()>,
}

impl HealthChecks {
    /// Checks every target once before returning, as a load balancer sends nothing to a
    /// target before its first health check passed; then keeps checking on a thread.
    fn start(pairs: &[(SocketAddr, SocketAddr)], timeout: Duration) -> Self {
        let check = move |pairs: &[(SocketAddr, SocketAddr)]| -> Vec<SocketAddr> {
            pairs
                .iter()
                .filter(|(_, health)| health_ok(*health, timeout))
                .map(|(target, _)| *target)
                .collect()
        };
        let healthy = Arc::new(Mutex::new(check(pairs)));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (healthy, stop, pairs) = (healthy.clone(), stop.clone(), pairs.to_vec());
            thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) && !STOP.load(Ordering::SeqCst) {
                    thread::sleep(HEALTH_EVERY);
                    let up = check(&pairs);
                    *healthy.lock().unwrap_or_else(|e| e.into_inner()) = up;
                }
            })
        };
        HealthChecks {
            healthy,
            stop,
            thread,
        }
    }

    fn healthy(&self) -> Vec<SocketAddr> {
        self.healthy
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.thread.join();
    }
}

/// GET / on a health check port answered 200 (as cloud load balancers judge it).
fn health_ok(addr: SocketAddr, timeout: Duration) -> bool {
    let Ok(stream) = TcpStream::connect_timeout(&addr, timeout) else {
        return false;
    };
    if stream.set_read_timeout(Some(timeout)).is_err() {
        return false;
    }
    let mut reader = BufReader::new(stream);
    if reader
        .get_mut()
        .write_all(b"GET / HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut status = String::new();
    reader.read_line(&mut status).is_ok() && status.split_whitespace().nth(1) == Some("200")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_specs_parse_and_bad_ones_say_why() {
        let sa = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert_eq!(
            "tcp=198.18.0.11:30080,198.18.0.12:30080".parse(),
            Ok(ClientSpec::Tcp(vec![
                sa("198.18.0.11:30080"),
                sa("198.18.0.12:30080")
            ]))
        );
        assert_eq!(
            "udp-connected=198.19.0.10:53".parse(),
            Ok(ClientSpec::UdpConnected(sa("198.19.0.10:53")))
        );
        assert_eq!(
            "lb=198.18.0.11:30080@198.18.0.11:30300".parse(),
            Ok(ClientSpec::Lb(vec![(
                sa("198.18.0.11:30080"),
                sa("198.18.0.11:30300")
            )]))
        );
        for bad in [
            "tcp",
            "udp=1.2.3",
            "http=198.19.0.10:81,198.19.0.10:82",
            "sctp=198.19.0.1:1",
            "lb=198.18.0.11:1",
        ] {
            assert!(bad.parse::<ClientSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_gap_counts_from_the_last_success_and_failures_by_error() {
        let mut st = Stats::default();
        let t0 = Instant::now();
        st.record(t0, Ok("pod-a".into()));
        st.record(t0, Err("ETIMEDOUT".into()));
        thread::sleep(Duration::from_millis(30));
        st.record(t0, Ok("pod-b".into()));
        let j = st.json("x", t0);
        assert_eq!(j["requests"], 3);
        assert_eq!(j["ok"], 2);
        assert_eq!(j["failures"]["ETIMEDOUT"], 1);
        assert_eq!(j["backends"]["pod-b"], 1);
        assert!(j["longest_gap_ms"].as_u64().unwrap() >= 30, "{j}");
        assert!(j["last_failure_unix_ms"].as_u64().is_some());
    }
}
