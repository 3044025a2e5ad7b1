//! `cargo xtask bench`: the eBPF and iptables dataplanes side by side on this machine.
//!
//! Control plane: a synthetic model of N services x 10 endpoints programmed into real maps
//! (eBPF) or through real iptables-restore in a throw-away network namespace (iptables, with
//! the nft and the legacy tools): the full initial sync, then single-endpoint updates
//! (median and p99; at most 200, and no more than a minute of them), and the growth of this
//! process's resident memory. Data path: new TCP connections (connect, one reply line,
//! close) from a client namespace to a ClusterIP through each dataplane, against the same
//! pod dialled directly, with 1 and with N services programmed; direct and eBPF alternate
//! in rounds so noise hits both alike.
//!
//! Everything runs in namespaces the bench creates, with 198.18.0.0/15 addresses only, and
//! every loop is bounded. Sizes: FASTPATH_BENCH_SIZES (default "100,1000,10000");
//! connections per data-path run: FASTPATH_BENCH_CONNS (default 2000); rounds:
//! FASTPATH_BENCH_ROUNDS (default 5); iptables-nft rows only up to FASTPATH_BENCH_NFT_MAX
//! services (default 1000: beyond, one restore takes many minutes on a small machine).

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
        iptables::{Family, IptablesConfig, IptablesDataplane, apply::Backend},
    },
    model::{NodeInfo, Protocol, ProxyState, Service, ServiceKey, ServicePort},
};
use xtask::testbed::Testbed;

const PROBE: &str = env!("CARGO_BIN_EXE_fastpath-probe");
const ENDPOINTS_PER_SERVICE: u32 = 10;
const UPDATES: usize = 200;
const UPDATE_BUDGET: Duration = Duration::from_secs(60);

#[path = "../tests/common.rs"]
#[allow(dead_code, unused_imports)]
mod common;
#[path = "../tests/nat_common.rs"]
#[allow(dead_code, unused_imports)]
mod nat_common;
#[path = "support/timing.rs"]
mod timing;

use timing::{Attempts, median, percentile};

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
    // At most UPDATES updates, and no more than UPDATE_BUDGET of them: the count is in the
    // table.
    let mut samples = Vec::with_capacity(UPDATES);
    let mut current = state;
    let budget = Instant::now() + UPDATE_BUDGET;
    for step in 0..UPDATES as u32 {
        if step >= 10 && Instant::now() > budget {
            break;
        }
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
        updates: samples.len(),
        rss_growth_kib: rss_kib().saturating_sub(rss_before),
    })
}

/// One path at one size: the median over rounds of each round's rate and latencies.
struct DataRow {
    path: &'static str,
    services: u32,
    rates: Vec<f64>,
    p50: Vec<f64>,
    p99: Vec<f64>,
    failures: usize,
}

impl DataRow {
    fn new(path: &'static str, services: u32) -> Self {
        DataRow { path, services, rates: vec![], p50: vec![], p99: vec![], failures: 0 }
    }

    fn add(&mut self, a: &Attempts) {
        self.rates.push(a.rate());
        self.p50.push(a.p50().as_secs_f64() * 1e3);
        self.p99.push(a.p99().as_secs_f64() * 1e3);
        self.failures += a.failures;
    }

    fn rate(&self) -> f64 {
        median(&mut self.rates.clone())
    }
}

/// `count` connections, one probe process, timed per attempt by the probe itself; the rate
/// is over the attempts' own time, so the probe's start-up does not count.
fn connections(bed: &Testbed, target: &str, count: usize) -> Result<Attempts> {
    let out = bed
        .client(Path::new(PROBE))
        .args(["tcp", target, "--count", &count.to_string(), "--timeout-ms", "1000"])
        .output()
        .context("running the probe")?;
    Ok(Attempts::parse(&String::from_utf8_lossy(&out.stdout)))
}

const DATA_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
const POD: &str = "198.18.1.11:8080";
const CLUSTER_IP: &str = "198.19.0.10:80";

fn data_state(extra: u32) -> ProxyState {
    let mut state = synthetic_state(extra, 0);
    // One backend, as the direct rows dial one pod: the paths differ only in translation.
    let web = common::web_service("web", DATA_SERVICE_IP);
    let eps = common::web_endpoints(vec![common::ready(common::pod_ip(1))]);
    let single = common::state_of(vec![(web, Some(eps))]);
    state.services.extend(single.services);
    state.endpoints.extend(single.endpoints);
    state
}

/// Per size: `rounds` rounds of direct, then eBPF (attached for the round only), so drift
/// and noise hit both alike; then iptables, installed once (a full restore at 10,000
/// services takes a while) for `rounds` runs, and removed again.
/// The iptables proxier in the bed's node namespace, removing its rules when shut down.
fn iptables(bed: &Testbed, backend: Backend) -> Result<IptablesDataplane> {
    Ok(IptablesDataplane::new(IptablesConfig {
        netns: Some(bed.node_netns().to_string()),
        families: vec![Family::V4],
        cleanup_on_exit: true,
        backend,
        ..Default::default()
    })?)
}

fn data_path(sizes: &[u32], conns: usize, rounds: usize) -> Result<Vec<DataRow>> {
    let (bed, _pods) = common::bed_with_pods("bench", 1);
    // iptables translates after routing: the node needs a route for service addresses.
    nat_common::route_services(&bed);
    // Warm up (page cache, neighbour entries) so the first round is not penalised.
    connections(&bed, POD, conns.min(200))?;
    let mut rows = Vec::new();
    let node = NodeInfo::default();
    for &n in sizes {
        let state = data_state(n.saturating_sub(1));
        let (mut direct, mut ebpf) = (DataRow::new("direct to pod IP", n), DataRow::new("ClusterIP via eBPF", n));
        for _ in 0..rounds {
            direct.add(&connections(&bed, POD, conns)?);
            let mut dp = BpfDataplane::attach(bed.cgroup_path())?;
            let report = dp.sync(&state, &node, Scope::Full);
            anyhow::ensure!(report.failed.is_empty(), "eBPF sync failed: {:?}", report.failed.first());
            ebpf.add(&connections(&bed, CLUSTER_IP, conns)?);
        }
        rows.push(direct);
        rows.push(ebpf);
        // The rules are the same whichever tool wrote them; legacy writes 10,000 services
        // in seconds.
        let mut dp = iptables(&bed, Backend::Legacy)?;
        let report = dp.sync(&state, &node, Scope::Full);
        anyhow::ensure!(report.failed.is_empty(), "iptables sync failed: {:?}", report.failed.first());
        let mut ipt = DataRow::new("ClusterIP via iptables", n);
        for _ in 0..rounds {
            ipt.add(&connections(&bed, CLUSTER_IP, conns)?);
        }
        rows.push(ipt);
        dp.shutdown();
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
    let rounds: usize = std::env::var("FASTPATH_BENCH_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(5).clamp(1, 50);

    // iptables-nft-restore slows down sharply with the number of chains (a full restore of
    // 10,000 services ran for more than 13 minutes here), so its rows stop at this size;
    // iptables-legacy covers every size.
    let nft_max: u32 = std::env::var("FASTPATH_BENCH_NFT_MAX").ok().and_then(|s| s.parse().ok()).unwrap_or(1000);
    let mut control = Vec::new();
    for &n in &sizes {
        eprintln!("bench: control plane, {n} services x {ENDPOINTS_PER_SERVICE} endpoints");
        let bed = Testbed::new("benchcp")?;
        let mut bpf = BpfDataplane::attach(bed.cgroup_path())?;
        control.push(control_plane("ebpf", &mut bpf, n)?);
        drop(bpf);
        for (name, backend) in [("iptables-nft", Backend::Nft), ("iptables-legacy", Backend::Legacy)] {
            if backend == Backend::Nft && n > nft_max {
                continue;
            }
            let mut ipt = iptables(&bed, backend)?;
            control.push(control_plane(name, &mut ipt, n)?);
            ipt.shutdown();
        }
    }
    eprintln!("bench: data path, {conns} connections per run");
    let data = data_path(&[1, *sizes.iter().max().unwrap_or(&1)], conns, rounds)?;

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
    let _ = writeln!(
        out,
        "\n## Data path ({rounds} rounds of {conns} new TCP connections: connect, read one line, close)\n"
    );
    let _ = writeln!(
        out,
        "| path | services | connections/s (median) | rounds' range | vs direct | latency p50 (ms) | latency p99 (ms) | failures |"
    );
    let _ = writeln!(out, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &data {
        let direct = data.iter().find(|d| d.services == r.services && d.path == "direct to pod IP");
        let vs = direct.map_or(String::new(), |d| format!("{:+.1}%", (r.rate() / d.rate() - 1.0) * 100.0));
        let lo = r.rates.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = r.rates.iter().copied().fold(0.0, f64::max);
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {lo:.0}-{hi:.0} | {vs} | {:.3} | {:.3} | {} |",
            r.path,
            r.services,
            r.rate(),
            median(&mut r.p50.clone()),
            median(&mut r.p99.clone()),
            r.failures
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
