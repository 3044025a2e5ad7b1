//! `cargo xtask bench`: the eBPF and iptables dataplanes side by side on this machine.
//!
//! Control plane: a synthetic model of N services x 10 endpoints programmed into real maps
//! (eBPF) or through real iptables-restore in a throw-away network namespace: the full
//! initial sync, then single-endpoint updates (median and p99), and the growth of this
//! process's resident memory. Data path: new TCP connections (connect, one reply line,
//! close) from a client namespace to a ClusterIP through each dataplane, against the same
//! pods dialled directly, with 1 and with N services programmed.
//!
//! Everything runs in namespaces the bench creates, with 198.18.0.0/15 addresses only, and
//! every loop is bounded. Sizes: FASTPATH_BENCH_SIZES (default "100,1000,10000");
//! connections per data-path run: FASTPATH_BENCH_CONNS (default 2000); iptables rows only up
//! to FASTPATH_BENCH_IPTABLES_MAX services (default: every size), since at 10,000 services
//! each iptables update takes seconds on a small machine.

use std::{
    collections::BTreeSet,
    fmt::Write as _,
    net::Ipv4Addr,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use proxy_userland::{
    dataplane::{
        Dataplane, Scope,
        bpf::BpfDataplane,
        iptables::{IptablesConfig, IptablesDataplane},
    },
    model::{NodeInfo, Protocol, ProxyState, Service, ServiceKey, ServicePort},
};
use xtask::testbed::Testbed;

const PROBE: &str = env!("CARGO_BIN_EXE_fastpath-probe");
const ENDPOINTS_PER_SERVICE: u32 = 10;
const UPDATES: usize = 200;

/// iptables re-renders and restores the whole ruleset per update; at 10,000 services that
/// is seconds each, so it gets fewer samples (the count is in the table).
fn updates_for(backend: &str, n: u32) -> usize {
    match backend {
        "iptables" => (20_000 / n.max(1) as usize).clamp(10, UPDATES),
        _ => UPDATES,
    }
}

#[path = "../tests/common.rs"]
#[allow(dead_code, unused_imports)]
mod common;
#[path = "../tests/nat_common.rs"]
#[allow(dead_code, unused_imports)]
mod nat_common;

fn service_ip(i: u32) -> Ipv4Addr {
    // 198.19.0.0/16, leaving 198.19.0.x for the data-path service.
    let n = i + 256;
    Ipv4Addr::new(198, 19, (n >> 8) as u8, n as u8)
}

fn endpoint_ip(k: u32) -> Ipv4Addr {
    // 198.18.16.0 - 198.18.255.255: clear of the bench pods in 198.18.1.x.
    let n = 16 * 256 + k % (240 * 256);
    Ipv4Addr::new(198, 18, (n >> 8) as u8, n as u8)
}

fn synthetic_service(i: u32) -> Service {
    let mut svc = common::web_service(&format!("svc-{i}"), service_ip(i));
    svc.key = ServiceKey::new("bench", format!("svc-{i}"));
    svc.ports = vec![ServicePort { name: "http".into(), port: 80, protocol: Protocol::Tcp, node_port: None }];
    svc
}

fn synthetic_state(n: u32, salt: u32) -> ProxyState {
    let entries = (0..n)
        .map(|i| {
            let eps = (0..ENDPOINTS_PER_SERVICE)
                .map(|j| common::ready(endpoint_ip(i * ENDPOINTS_PER_SERVICE + j + salt)))
                .collect();
            (synthetic_service(i), Some(common::web_endpoints(eps)))
        })
        .collect();
    common::state_of(entries)
}

/// State with one endpoint of service `i` moved.
fn with_update(state: &ProxyState, i: u32, step: u32) -> ProxyState {
    let mut next = state.clone();
    let key = ServiceKey::new("bench", format!("svc-{i}"));
    let mut eps: Vec<_> = (0..ENDPOINTS_PER_SERVICE)
        .map(|j| common::ready(endpoint_ip(i * ENDPOINTS_PER_SERVICE + j)))
        .collect();
    eps[0] = common::ready(endpoint_ip(200_000 + step));
    next.endpoints.insert(key, std::sync::Arc::new(common::web_endpoints(eps)));
    next
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).map(str::to_string))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

struct ControlRow {
    backend: &'static str,
    services: u32,
    full_sync: Duration,
    update_p50: Duration,
    update_p99: Duration,
    updates: usize,
    rss_growth_kib: u64,
}

fn control_plane<D: Dataplane>(backend: &'static str, dp: &mut D, n: u32) -> Result<ControlRow> {
    let node = NodeInfo::default();
    let rss_before = rss_kib();
    let state = synthetic_state(n, 0);
    let started = Instant::now();
    let report = dp.sync(&state, &node, Scope::Full);
    let full_sync = started.elapsed();
    anyhow::ensure!(report.failed.is_empty(), "{backend} full sync failed: {:?}", &report.failed[..1]);
    let updates = updates_for(backend, n);
    let mut samples = Vec::with_capacity(updates);
    let mut current = state;
    for step in 0..updates as u32 {
        let i = (step * 7919) % n;
        let next = with_update(&current, i, step);
        let changed = BTreeSet::from([ServiceKey::new("bench", format!("svc-{i}"))]);
        let started = Instant::now();
        let report = dp.sync(&next, &node, Scope::Changed(&changed));
        samples.push(started.elapsed());
        anyhow::ensure!(report.failed.is_empty(), "{backend} update failed");
        current = next;
    }
    samples.sort();
    Ok(ControlRow {
        backend,
        services: n,
        full_sync,
        update_p50: percentile(&samples, 0.5),
        update_p99: percentile(&samples, 0.99),
        updates,
        rss_growth_kib: rss_kib().saturating_sub(rss_before),
    })
}

struct DataRow {
    path: String,
    services: u32,
    conns_per_sec: f64,
    p50: Duration,
    p99: Duration,
    failures: usize,
}

/// `count` connections, one probe process, timed per attempt by the probe itself; the rate
/// is over the attempts' own time, so the probe's start-up does not count.
fn connections(bed: &Testbed, target: &str, count: usize) -> Result<(f64, Duration, Duration, usize)> {
    let out = bed
        .client(Path::new(PROBE))
        .args(["tcp", target, "--count", &count.to_string(), "--timeout-ms", "1000"])
        .output()
        .context("running the probe")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lat: Vec<Duration> = Vec::new();
    let mut failures = 0;
    for line in text.lines() {
        if !line.starts_with("ok ") {
            failures += 1;
            continue;
        }
        if let Some(us) = line.split_whitespace().find_map(|w| w.strip_prefix("us=")) {
            lat.push(Duration::from_micros(us.parse().unwrap_or(0)));
        }
    }
    lat.sort();
    let busy: Duration = lat.iter().sum();
    let rate = if busy.is_zero() { 0.0 } else { lat.len() as f64 / busy.as_secs_f64() };
    Ok((rate, percentile(&lat, 0.5), percentile(&lat, 0.99), failures))
}

const DATA_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);

fn data_state(extra: u32) -> ProxyState {
    let mut state = synthetic_state(extra, 0);
    let web = common::web_service("web", DATA_SERVICE_IP);
    let eps = common::web_endpoints((1..=2).map(|i| common::ready(common::pod_ip(i))).collect());
    let single = common::state_of(vec![(web, Some(eps))]);
    state.services.extend(single.services);
    state.endpoints.extend(single.endpoints);
    state
}

fn data_path(sizes: &[u32], conns: usize, iptables_max: u32) -> Result<Vec<DataRow>> {
    let (bed, _pods) = common::bed_with_pods("bench", 2);
    // iptables translates after routing: the node needs a route for service addresses.
    nat_common::route_services(&bed);
    // Warm up (page cache, neighbour entries) so the first row is not penalised.
    connections(&bed, "198.18.1.11:8080", conns.min(200))?;
    let mut rows = Vec::new();
    let (rate, p50, p99, failures) = connections(&bed, "198.18.1.11:8080", conns)?;
    rows.push(DataRow { path: "direct to pod IP".into(), services: 0, conns_per_sec: rate, p50, p99, failures });
    let node = NodeInfo::default();
    for &n in sizes {
        let state = data_state(n.saturating_sub(1));
        {
            let mut dp = BpfDataplane::attach(bed.cgroup_path())?;
            dp.sync(&state, &node, Scope::Full);
            let (rate, p50, p99, failures) = connections(&bed, "198.19.0.10:80", conns)?;
            rows.push(DataRow { path: "ClusterIP via eBPF".into(), services: n, conns_per_sec: rate, p50, p99, failures });
        }
        if n <= iptables_max {
            let mut dp = IptablesDataplane::new(IptablesConfig {
                netns: Some(bed.node_netns().to_string()),
                cleanup_on_exit: true,
                ..Default::default()
            })?;
            let report = dp.sync(&state, &node, Scope::Full);
            anyhow::ensure!(report.failed.is_empty(), "iptables sync failed: {:?}", report.failed.first());
            let (rate, p50, p99, failures) = connections(&bed, "198.19.0.10:80", conns)?;
            rows.push(DataRow { path: "ClusterIP via iptables".into(), services: n, conns_per_sec: rate, p50, p99, failures });
        }
    }
    Ok(rows)
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

fn main() -> Result<()> {
    // `cargo bench` passes --bench; this harness takes no options.
    let sizes: Vec<u32> = std::env::var("FASTPATH_BENCH_SIZES")
        .unwrap_or_else(|_| "100,1000,10000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .filter(|&n| (1..=60_000).contains(&n))
        .collect();
    let conns: usize = std::env::var("FASTPATH_BENCH_CONNS").ok().and_then(|s| s.parse().ok()).unwrap_or(2000).clamp(10, 100_000);

    let iptables_max: u32 = std::env::var("FASTPATH_BENCH_IPTABLES_MAX")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(u32::MAX);
    let mut control = Vec::new();
    for &n in &sizes {
        eprintln!("bench: control plane, {n} services x {ENDPOINTS_PER_SERVICE} endpoints");
        let bed = Testbed::new("benchcp")?;
        let mut bpf = BpfDataplane::attach(bed.cgroup_path())?;
        control.push(control_plane("ebpf", &mut bpf, n)?);
        drop(bpf);
        if n > iptables_max {
            continue;
        }
        let mut ipt = IptablesDataplane::new(IptablesConfig {
            netns: Some(bed.node_netns().to_string()),
            cleanup_on_exit: true,
            ..Default::default()
        })?;
        control.push(control_plane("iptables", &mut ipt, n)?);
    }
    eprintln!("bench: data path, {conns} connections per run");
    let data = data_path(&[1, *sizes.iter().max().unwrap_or(&1)], conns, iptables_max)?;

    let mut out = String::new();
    let _ = writeln!(out, "## Control plane ({ENDPOINTS_PER_SERVICE} endpoints per service)\n");
    let _ = writeln!(out, "| dataplane | services | full sync (ms) | update p50 (ms) | update p99 (ms) | updates | RSS growth (MiB) |");
    let _ = writeln!(out, "| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &control {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {:.1} |",
            r.backend, r.services, ms(r.full_sync), ms(r.update_p50), ms(r.update_p99), r.updates,
            r.rss_growth_kib as f64 / 1024.0
        );
    }
    let _ = writeln!(out, "\n## Data path ({conns} new TCP connections per row: connect, read one line, close)\n");
    let _ = writeln!(out, "| path | services | connections/s | latency p50 (ms) | latency p99 (ms) | failures |");
    let _ = writeln!(out, "| --- | ---: | ---: | ---: | ---: | ---: |");
    for r in &data {
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {} | {} | {} |",
            r.path, r.services, r.conns_per_sec, ms(r.p50), ms(r.p99), r.failures
        );
    }
    print!("{out}");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("results.md");
    std::fs::write(&file, &out)?;
    eprintln!("bench: results written to {}", file.display());
    Ok(())
}
