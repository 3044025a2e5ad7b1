//! The admin ports under abuse, through the real daemon as deploy/ runs it (its config, its
//! capabilities, its seccomp profile where the tests trace calls, and containerd's default
//! soft limit of 1,024 open files): while slow clients, oversized request heads and
//! thousands of idle connections hit the health, metrics and health check node port
//! servers at once, `curl` (a real client) keeps getting every answer within 100 ms, as
//! the kubelet's probes and a cloud load balancer's health checks must.
//!
//! Everything runs in the bed's node namespace, on the ports the shipped config names; no
//! packet leaves it.

mod common;

use std::{
    io::{ErrorKind, Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use common::*;

/// How long the attack lasts; every loop below also stops at its own count bound.
const ATTACK: Duration = Duration::from_secs(10);
/// The longest a probe may take, connect to last byte, as curl measures it.
const PROBE_LIMIT: Duration = Duration::from_millis(100);
/// Idle connections (nothing ever sent) each attacker keeps open, one attacker per server.
const IDLE_PER_SERVER: usize = 1_000;
/// Connections each idle attacker may open in all, reopening what the daemon drops; bounds
/// the ephemeral ports used against one server address.
const IDLE_CONNECTS: usize = 12_000;
/// Slowloris connections per server, a byte every 200 ms.
const SLOW_PER_SERVER: usize = 50;
/// Oversized heads per server (64 KiB each), sent back to back.
const OVERSIZED: usize = 2_000;
/// containerd's default soft RLIMIT_NOFILE for a container (its hard limit is higher).
const CONTAINER_SOFT_NOFILE: u64 = 1024;

const HC_PORT: u16 = 32001;

/// The shipped config's health and metrics addresses.
fn shipped_admin_addresses(config: &std::path::Path) -> (SocketAddr, SocketAddr) {
    let text = std::fs::read_to_string(config).unwrap();
    let addr = |key: &str| -> SocketAddr {
        let value = text
            .lines()
            .find_map(|l| l.trim().strip_prefix(key))
            .unwrap_or_else(|| panic!("{key} in the shipped config"));
        value.trim().parse().expect("an address with a port")
    };
    (addr("healthzBindAddress:"), addr("metricsBindAddress:"))
}

/// Lifts this process's soft open-file limit to `want` (the attack's connections), or
/// says why it cannot.
fn raise_nofile(want: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    assert!(
        lim.rlim_max >= want,
        "the attack needs {want} open files; the hard limit is {}",
        lim.rlim_max
    );
    lim.rlim_cur = lim.rlim_cur.max(want);
    // SAFETY: setrlimit reads the struct we own.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
}

/// `curl` in the namespace: (HTTP code, curl's own total time), or what went wrong.
fn curl_timed(ns: &str, url: &str) -> Result<(u16, Duration), String> {
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{ns}"))
        .args(["curl", "-s", "-o", "/dev/null", "--max-time", "2"])
        .args(["-w", "%{http_code} %{time_total}", url])
        .output()
        .map_err(|e| format!("curl: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let parsed = text.split_once(' ').and_then(|(code, secs)| {
        Some((
            code.parse().ok()?,
            Duration::from_secs_f64(secs.parse().ok()?),
        ))
    });
    match parsed {
        Some((code, took)) if out.status.success() => Ok((code, took)),
        _ => Err(format!("curl exit {:?}: {text}", out.status.code())),
    }
}

/// What the attackers achieved, for the report and the checks that the attack happened.
#[derive(Default)]
struct Tally {
    idle_open_peak: AtomicUsize,
    idle_connects: AtomicUsize,
    idle_dropped_by_daemon: AtomicUsize,
    slow_reopened: AtomicUsize,
    oversized_431: AtomicUsize,
    oversized_other: AtomicUsize,
}

fn until(stop: &AtomicBool, started: Instant) -> bool {
    !stop.load(Ordering::Relaxed) && started.elapsed() < ATTACK
}

/// Keeps IDLE_PER_SERVER connections open that never send a byte, reopening those the
/// daemon drops.
fn idle_attacker(addr: SocketAddr, stop: &AtomicBool, tally: &Tally) {
    let started = Instant::now();
    let mut conns: Vec<TcpStream> = Vec::with_capacity(IDLE_PER_SERVER);
    while until(stop, started) {
        let before = conns.len();
        conns.retain(|s| {
            let (mut s, mut b) = (s, [0u8; 1]);
            // Nonblocking: WouldBlock is a connection the daemon still holds.
            matches!(s.read(&mut b), Err(e) if e.kind() == ErrorKind::WouldBlock)
        });
        tally
            .idle_dropped_by_daemon
            .fetch_add(before - conns.len(), Ordering::Relaxed);
        while conns.len() < IDLE_PER_SERVER
            && tally.idle_connects.load(Ordering::Relaxed) < IDLE_CONNECTS * 3
            && until(stop, started)
        {
            let Ok(s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
                break;
            };
            tally.idle_connects.fetch_add(1, Ordering::Relaxed);
            s.set_nonblocking(true).unwrap();
            conns.push(s);
        }
        tally
            .idle_open_peak
            .fetch_max(conns.len(), Ordering::Relaxed);
        thread::sleep(Duration::from_millis(200));
    }
}

/// SLOW_PER_SERVER connections sending a never-ending head a byte every 200 ms.
fn slow_attacker(addr: SocketAddr, stop: &AtomicBool, tally: &Tally) {
    let started = Instant::now();
    let connect = || {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
        s.set_write_timeout(Some(Duration::from_millis(100))).ok()?;
        s.write_all(b"GET /healthz HTTP/1.1\r\nX-Slow: ").ok()?;
        Some(s)
    };
    let mut conns: Vec<Option<TcpStream>> = (0..SLOW_PER_SERVER).map(|_| connect()).collect();
    while until(stop, started) {
        for c in conns.iter_mut() {
            let alive = c.as_mut().is_some_and(|s| s.write_all(b"a").is_ok());
            if !alive && tally.slow_reopened.fetch_add(1, Ordering::Relaxed) < 20_000 {
                *c = connect();
            }
        }
        thread::sleep(Duration::from_millis(200));
    }
}

/// OVERSIZED request heads of 64 KiB, one connection each, reading what comes back.
fn oversized_attacker(addr: SocketAddr, stop: &AtomicBool, tally: &Tally) {
    let started = Instant::now();
    let mut head = b"GET /healthz HTTP/1.1\r\nX-Big: ".to_vec();
    head.resize(64 * 1024, b'a');
    head.extend_from_slice(b"\r\n\r\n");
    for _ in 0..OVERSIZED {
        if !until(stop, started) {
            break;
        }
        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
            continue;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
        // The daemon answers and closes before taking it all.
        let _ = s.write_all(&head);
        let mut answer = [0u8; 12];
        let got = s.read(&mut answer).unwrap_or(0);
        let counter = if answer[..got].starts_with(b"HTTP/1.1 431") {
            &tally.oversized_431
        } else {
            &tally.oversized_other
        };
        counter.fetch_add(1, Ordering::Relaxed);
        thread::sleep(Duration::from_millis(20));
    }
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

#[test]
fn probes_are_answered_within_100ms_while_slow_oversized_and_idle_clients_attack() {
    raise_nofile(4 * (IDLE_PER_SERVER + SLOW_PER_SERVER) as u64 + 512);
    let (bed, _pods) = bed_with_pods("abuse", 1);
    let ns = bed.node_netns().to_string();
    let manifests = manifest_dir("abuse");
    // A ready endpoint on this node: the health check node port answers 200.
    let lb = LOCAL_LB
        .replace("HCPORT", &HC_PORT.to_string())
        .replace("NODE1", "node-a");
    std::fs::write(manifests.0.join("lb.yaml"), lb).unwrap();
    let (health_addr, metrics_addr) = shipped_admin_addresses(&shipped_config(bed.dir()));
    let (health, metrics) = (health_addr.port(), metrics_addr.port());
    // containerd's soft limit on open files, inherited through nsenter and setpriv; the
    // health and metrics servers where the shipped config puts them (the helper moves them
    // to ports the kernel picks).
    let nofile = format!("--nofile={CONTAINER_SOFT_NOFILE}:{}", 4 * 4096);
    let shipped = start_as_shipped_wrapped(
        &["prlimit", &nofile, "--"],
        &bed,
        &[
            &format!("--manifests={}", manifests.0.display()),
            &format!("--healthz-bind-address={health_addr}"),
            &format!("--metrics-bind-address={metrics_addr}"),
        ],
    );
    let mut daemon = shipped.daemon;
    let probes = [
        format!("http://127.0.0.1:{health}/healthz"),
        format!("http://127.0.0.1:{metrics}/metrics"),
        format!("http://127.0.0.1:{HC_PORT}/"),
    ];
    assert!(
        eventually(20, || probes
            .iter()
            .all(|u| curl_timed(&ns, u).is_ok_and(|(code, _)| code == 200))),
        "the admin servers never all answered 200; log:\n{}",
        daemon.log()
    );

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let mut attackers = Vec::new();
    for port in [health, metrics, HC_PORT] {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let kinds: [fn(SocketAddr, &AtomicBool, &Tally); 3] =
            [idle_attacker, slow_attacker, oversized_attacker];
        for attack in kinds {
            let (ns, stop, tally) = (ns.clone(), stop.clone(), tally.clone());
            attackers.push(thread::spawn(move || {
                xtask::netns::enter(&ns).expect("into the node namespace");
                attack(addr, &stop, &tally);
            }));
        }
    }

    // Probe every server in turn while the attack runs, and watch the daemon's files.
    thread::sleep(Duration::from_millis(500));
    let (mut took, mut failed, mut fds_peak) = (Vec::new(), Vec::new(), 0);
    let end = Instant::now() + ATTACK - Duration::from_secs(1);
    while Instant::now() < end {
        for url in &probes {
            match curl_timed(&ns, url) {
                Ok((200, t)) if t <= PROBE_LIMIT => took.push(t),
                other => failed.push(format!("{url}: {other:?}")),
            }
        }
        fds_peak = fds_peak.max(open_fds(daemon.pid()));
        thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    for a in attackers {
        a.join().unwrap();
    }
    took.sort();
    let pct = |p: usize| took.get(took.len().saturating_sub(1) * p / 100).copied();
    let t = &tally;
    eprintln!(
        "{} probes answered, p50 {:?} p99 {:?} max {:?}; {} failed\n\
         idle: {} open at once per server at the peak, {} opened, {} closed on them; \
         slowloris reopened {}; oversized heads: {} answered 431, {} otherwise; \
         the daemon's open files peaked at {fds_peak}",
        took.len(),
        pct(50),
        pct(99),
        took.last(),
        failed.len(),
        t.idle_open_peak.load(Ordering::Relaxed),
        t.idle_connects.load(Ordering::Relaxed),
        t.idle_dropped_by_daemon.load(Ordering::Relaxed),
        t.slow_reopened.load(Ordering::Relaxed),
        t.oversized_431.load(Ordering::Relaxed),
        t.oversized_other.load(Ordering::Relaxed),
    );
    // The attack happened as meant.
    assert!(
        t.idle_open_peak.load(Ordering::Relaxed) >= IDLE_PER_SERVER,
        "the idle attackers never held their connections"
    );
    assert!(
        t.idle_dropped_by_daemon.load(Ordering::Relaxed) > 0
            && t.slow_reopened.load(Ordering::Relaxed) > 0,
        "the daemon never shed a connection"
    );
    assert!(
        t.oversized_431.load(Ordering::Relaxed) > 100,
        "oversized heads were not answered 431"
    );
    // What the kubelet and the load balancer see.
    assert!(took.len() >= 60, "only {} probes answered", took.len());
    assert!(
        failed.is_empty(),
        "{} of {} probes failed or took over {PROBE_LIMIT:?}: {failed:#?}\nlog:\n{}",
        failed.len(),
        failed.len() + took.len(),
        daemon.log()
    );
    // Thousands of connections never cost the daemon more than its container's soft limit.
    assert!(
        fds_peak > 0 && (fds_peak as u64) < CONTAINER_SOFT_NOFILE,
        "the daemon held {fds_peak} files"
    );
    assert!(daemon.stop().success(), "{}", daemon.log());
}
