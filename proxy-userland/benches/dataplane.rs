//! `cargo xtask bench`: the eBPF and iptables dataplanes side by side on this machine.
//!
//! Control plane: a synthetic model of N services x 10 endpoints programmed into real maps
//! (eBPF) or through real iptables-restore in a throw-away network namespace (iptables, with
//! the nft and the legacy tools): the full initial sync, then single-endpoint updates
//! (median and p99; at most 200, and no more than a minute of them), and the growth of this
//! process's resident memory. Data path: new TCP connections (connect, one reply line,
//! close with a reset) from a client namespace to a ClusterIP through eBPF and through the
//! iptables mode, against the same pod dialled directly (with no programs attached, and with
//! the socket programs attached, which look the pod up and let it pass), with 1 service and
//! at every size; and from a pod outside the socket hooks' cgroup, the ClusterIP translated per packet on
//! the pod's device (the pod path) against a pod dialling a pod IP with no programs on
//! either device, the two taking turns connection by connection in one run (on this VM,
//! separate runs of one path differ by up to 2x); and the same pod dialling the backend
//! pod's own address past the pod path's programs (no Service: what every pod's traffic
//! pays for the pod path).
//! The paths take turns in every round (in a rotating order), and only one dataplane
//! is installed at a time; within each run, the path's connections take turns with direct
//! connections to the pod IP, connection by connection (`fastpath-probe tcp --alternate`:
//! the socket paths' direct arm makes its sockets outside the hooked cgroup, iptables' in
//! the bed without rules), and each row is compared with the direct arm of its own runs.
//! On this VM separate runs of one path differ by up to 2x; the two arms of a run, by a
//! few percent. The table has the median of the rounds and their spread. Every run checks
//! its own conditions (support/conditions.rs: failed connections, ports held in the client
//! namespace, the load average against FASTPATH_BENCH_MAX_LOAD, default the CPU count) and
//! a row with a bad run is FAILED with the reason instead of reported as a number. The data
//! path runs on one CPU (FASTPATH_BENCH_CPU, default the last; `none` to not pin): see
//! `conditions::pin_to_one_cpu` for why.
//!
//! Everything runs in namespaces the bench creates, with 198.18.0.0/15 addresses only, and
//! every loop is bounded. Sizes: FASTPATH_BENCH_SIZES (default "100,1000,10000");
//! connections per data-path run: FASTPATH_BENCH_CONNS (default 2000); rounds:
//! FASTPATH_BENCH_ROUNDS (default 5); FASTPATH_BENCH_ONLY=control|data runs one part;
//! FASTPATH_BENCH_NFT_MAX / FASTPATH_BENCH_LEGACY_MAX: no iptables-nft / iptables-legacy
//! control-plane rows above that many services (default: every size).

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
        bpf::{AttachOptions, BpfDataplane, PodPathConfig, host_stack::HostRouting},
        iptables::{Family, IptablesConfig, IptablesDataplane, apply::Backend},
    },
    model::{NodeInfo, ProxyState, ServiceKey},
};
use xtask::testbed::{Pod, Testbed};

const PROBE: &str = env!("CARGO_BIN_EXE_fastpath-probe");
const UPDATES: usize = 200;
const UPDATE_BUDGET: Duration = Duration::from_secs(30);

#[path = "../tests/common.rs"]
#[allow(unused_imports)]
mod common;
#[path = "support/conditions.rs"]
mod conditions;
#[path = "../tests/nat_common.rs"]
#[allow(unused_imports)]
mod nat_common;
#[path = "support/synthetic.rs"]
mod synthetic;
#[path = "support/timing.rs"]
mod timing;

use conditions::{Conditions, Watch};
use synthetic::{ENDPOINTS_PER_SERVICE, endpoint_ip};
use timing::{Attempts, median, percentile, spread};

fn synthetic_state(n: u32, salt: u32) -> ProxyState {
    synthetic::state(n, salt)
}

/// State with one endpoint of service `i` moved.
fn with_update(state: &ProxyState, i: u32, step: u32) -> ProxyState {
    let mut next = state.clone();
    let key = ServiceKey::new("bench", format!("svc-{i}"));
    let mut eps: Vec<_> = (0..ENDPOINTS_PER_SERVICE)
        .map(|j| common::ready(endpoint_ip(i * ENDPOINTS_PER_SERVICE + j)))
        .collect();
    eps[0] = common::ready(endpoint_ip(200_000 + step));
    next.endpoints
        .insert(key, std::sync::Arc::new(common::web_endpoints(eps)));
    next
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .map(str::to_string)
        })
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

struct ControlRow {
    backend: &'static str,
    services: u32,
    full_sync: Duration,
    /// A full sync with nothing changed: what the periodic sync (every --sync-period)
    /// costs, and what a change arriving meanwhile waits behind.
    periodic: Duration,
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
    anyhow::ensure!(
        report.failed.is_empty(),
        "{backend} full sync failed: {:?}",
        &report.failed[..1]
    );
    let started = Instant::now();
    let report = dp.sync(&state, &node, Scope::Full);
    let periodic = started.elapsed();
    anyhow::ensure!(report.failed.is_empty(), "{backend} periodic sync failed");
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
        periodic,
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
    /// Why a run of this row measured the bench rather than the path (see
    /// support/conditions.rs); a row with any is FAILED.
    problems: Vec<String>,
    /// Most sockets the client namespace held after a run, and its ephemeral ports.
    sockets: usize,
    ports: usize,
    max_load_seen: f64,
    /// For a path measured by taking turns with its direct baseline (see
    /// [`pod_path_pair`]): the baseline's rate in each of this row's runs.
    paired_base: Vec<f64>,
}

impl DataRow {
    fn new(path: &'static str, services: u32) -> Self {
        DataRow {
            path,
            services,
            rates: vec![],
            p50: vec![],
            p99: vec![],
            failures: 0,
            problems: vec![],
            sockets: 0,
            ports: 0,
            max_load_seen: 0.0,
            paired_base: vec![],
        }
    }

    fn add(&mut self, a: &Attempts, c: &Conditions, max_load: f64) {
        self.rates.push(a.rate());
        self.p50.push(a.p50().as_secs_f64() * 1e3);
        self.p99.push(a.p99().as_secs_f64() * 1e3);
        self.failures += a.failures;
        self.sockets = self.sockets.max(c.sockets_after);
        self.ports = c.ports;
        self.max_load_seen = self.max_load_seen.max(c.load_before).max(c.load_after);
        for p in c.problems(max_load) {
            eprintln!(
                "bench: WARNING: {} at {} services: {p}; the row is FAILED",
                self.path, self.services
            );
            self.problems.push(p);
        }
    }

    fn failed(&self) -> bool {
        !self.problems.is_empty()
    }

    fn rate(&self) -> f64 {
        median(&mut self.rates.clone())
    }
}

/// `count` connections, one probe process, timed per attempt by the probe itself; the rate
/// is over the attempts' own time, so the probe's start-up does not count.
fn connections(bed: &Testbed, target: &str, count: usize) -> Result<Attempts> {
    let out = probe_tcp(bed.client(Path::new(PROBE)), target, count, &[])?;
    Ok(Attempts::parse(&out))
}

/// As [`connections`], from a pod's namespace: outside the cgroup the socket hooks are
/// attached to, so only the pod path (tc on the pod's device) can translate.
fn connections_from_pod(pod: &Pod, target: &str, count: usize) -> Result<Attempts> {
    let mut probe = std::process::Command::new(PROBE);
    probe.arg("--netns").arg(&pod.netns);
    Ok(Attempts::parse(&probe_tcp(probe, target, count, &[])?))
}

/// The pods of the pod-path comparison. The translated arm runs from `client` to the
/// ClusterIP, whose one backend is the bed's first pod; the direct arm from `direct_client`
/// to `direct_server`, a second pair of pods whose devices carry no programs: the baseline
/// is a pod's connection with nothing of ours on its way, as on a node without fastpath.
struct PodPair {
    client: Pod,
    direct_client: Pod,
    direct_server: String,
}

/// `count` connections from each arm of `pods`, taking turns connection by connection
/// (`fastpath-probe tcp --alternate`), the pod-path arm's to `target`: returns (pod-path
/// arm, direct arm).
fn pod_path_pair(pods: &PodPair, target: &str, count: usize) -> Result<(Attempts, Attempts)> {
    let mut probe = std::process::Command::new(PROBE);
    probe.arg("--netns").arg(&pods.client.netns);
    let direct = format!("{}={}", pods.direct_client.netns, pods.direct_server);
    paired(probe, target, &direct, count)
}

/// `count` connections from `bed`'s client to `target`, taking turns with connections to
/// the pod IP in `clean`'s node namespace (which never has iptables rules) from a socket
/// made in `direct_cgroup` (one without socket programs; None: the client's own): returns
/// (the path's arm, the direct arm).
fn paired_with_direct(
    bed: &Testbed,
    target: &str,
    clean: &Testbed,
    direct_cgroup: Option<&Path>,
    count: usize,
) -> Result<(Attempts, Attempts)> {
    let mut direct = format!("{}={POD}", clean.node_netns());
    if let Some(cgroup) = direct_cgroup {
        direct = format!("{direct}@{}", cgroup.display());
    }
    paired(bed.client(Path::new(PROBE)), target, &direct, count)
}

/// `count` connections from `probe` to `target` taking turns with the `direct` arm
/// (`--alternate` syntax).
fn paired(
    probe: std::process::Command,
    target: &str,
    direct: &str,
    count: usize,
) -> Result<(Attempts, Attempts)> {
    let out = probe_tcp(probe, target, count, &["--alternate", direct])?;
    Attempts::parse_pair(&out, count)
}

/// The probe's output for `count` TCP connections to `target` (`extra`: more flags).
fn probe_tcp(
    mut probe: std::process::Command,
    target: &str,
    count: usize,
    extra: &[&str],
) -> Result<String> {
    let out = probe
        // --reset: each connection closes with a RST, so none lingers in TIME_WAIT holding
        // an ephemeral port (thousands per run to one destination would exhaust them).
        .args([
            "tcp",
            target,
            "--count",
            &count.to_string(),
            "--timeout-ms",
            "1000",
            "--reset",
        ])
        .args(extra)
        .output()
        .context("running the probe")?;
    anyhow::ensure!(
        out.status.success(),
        "the probe failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

const DATA_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
const POD: &str = "198.18.1.11:8080";
const CLUSTER_IP: &str = "198.19.0.10:80";

fn data_state(extra: u32) -> ProxyState {
    let mut state = synthetic_state(extra, 0);
    // One backend, as the direct rows dial one pod: the paths differ only in translation.
    let web = common::web_service("web", DATA_SERVICE_IP);
    let eps = common::web_endpoints(vec![common::ready(common::pod_ip(1))]);
    synthetic::merge(&mut state, common::state_of(vec![(web, Some(eps))]));
    state
}

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

const DIRECT: &str = "direct to pod IP";
const DIRECT_HOOKED: &str = "direct to pod IP, eBPF attached";
const EBPF: &str = "ClusterIP via eBPF";
const IPTABLES: &str = "ClusterIP via iptables";
const POD_DIRECT: &str = "from a pod: direct to pod IP";
const POD_PATH: &str = "from a pod: ClusterIP via pod path (tc)";
const POD_HOST_ROUTED: &str =
    "from a pod: ClusterIP via pod path, host routing (tc, redirect_peer)";
const POD_PATH_POD_IP: &str = "from a pod: pod IP past the pod path's programs";

/// The paths the data-path table compares. To add one (a per-packet ClusterIP translation,
/// say), add a variant here, its label in `label`, and how one run is made in
/// `data_path`'s match; the table, the comparison with direct and the targets follow.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PathKind {
    Direct,
    /// Direct, with the socket programs attached and synced: what the hooks cost a
    /// connection that is not to a service (they look it up and let it pass).
    DirectHooked,
    Ebpf,
    Iptables,
    /// From a pod outside the socket hooks' cgroup, straight to a pod IP with nothing of
    /// ours on the way: the pod path's baseline, one veth hop longer than the node's own
    /// sockets take. Not a run of its own: measured taking turns with the pod path's
    /// connections (see [`pod_path_pair`]).
    PodDirect,
    /// A pod to the ClusterIP, translated per packet on its device
    /// (`--pod-interface-name-prefix`).
    PodPath,
    /// The same with `--bpf-host-routing`: translated packets go straight into the other
    /// pod's namespace.
    PodHostRouted,
    /// A pod to another pod's own address with the pod path on both devices: no Service,
    /// nothing to translate, what every pod's traffic pays for the pod path.
    PodPathPodIp,
}

impl PathKind {
    /// The rows of the table, in order.
    const ALL: [PathKind; 8] = [
        PathKind::Direct,
        PathKind::DirectHooked,
        PathKind::Ebpf,
        PathKind::Iptables,
        PathKind::PodDirect,
        PathKind::PodPath,
        PathKind::PodHostRouted,
        PathKind::PodPathPodIp,
    ];

    fn label(self) -> &'static str {
        match self {
            PathKind::Direct => DIRECT,
            PathKind::DirectHooked => DIRECT_HOOKED,
            PathKind::Ebpf => EBPF,
            PathKind::Iptables => IPTABLES,
            PathKind::PodDirect => POD_DIRECT,
            PathKind::PodPath => POD_PATH,
            PathKind::PodHostRouted => POD_HOST_ROUTED,
            PathKind::PodPathPodIp => POD_PATH_POD_IP,
        }
    }
}

/// Per size, `rounds` rounds in which every path makes one run, in an order that rotates
/// from round to round, so drift and noise hit all alike.
///
/// Direct and eBPF share one test bed that never has iptables rules: installing and
/// removing the iptables rules in a namespace left connections there stalling now and
/// then (p99 ~12 ms instead of ~0.1 ms) for the runs after, whichever path they took. So
/// iptables gets a bed of its own, with the rules installed once per size, as on a node in
/// iptables mode. eBPF is attached and synced for each of its runs and detached after.
/// Connections close with a reset, so no run leaves TIME_WAIT sockets for the next; every
/// run's conditions are checked (support/conditions.rs) and a row with a bad run is FAILED.
fn data_path(sizes: &[u32], conns: usize, rounds: usize) -> Result<Vec<DataRow>> {
    let max_load = conditions::max_load();
    let (mut bed, _pods) = common::bed_with_pods("bench", 1);
    let client_pod = bed.add_pod("client", common::pod_ip(9), None)?;
    let direct_server = bed.add_pod("plain", common::pod_ip(2), None)?;
    bed.serve(
        Path::new(PROBE),
        &direct_server,
        &["--name", "plain", "--tcp", "0.0.0.0:8080"],
    )?;
    let pods = PodPair {
        client: client_pod,
        direct_client: bed.add_pod("plainclient", common::pod_ip(8), None)?,
        direct_server: format!("{}:8080", direct_server.ipv4),
    };
    let pod_path = AttachOptions {
        pods: Some(PodPathConfig {
            netns: Some(bed.node_netns().to_string()),
            // The bed's pods' host-side devices are fpv0 (the backend), fpv1 (the client),
            // fpv2 and fpv3 (the direct pair, which must stay bare).
            prefixes: vec!["fpv0".into(), "fpv1".into()],
            host_namespace_only: false,
            ..PodPathConfig::default()
        }),
        ..AttachOptions::default()
    };
    let mut host_routed = pod_path.clone();
    if let Some(p) = &mut host_routed.pods {
        p.host_routing = HostRouting::True;
    }
    let (ipt_bed, _ipt_pods) = common::bed_with_pods("benchipt", 1);
    // iptables translates after routing: the node needs a route for service addresses.
    nat_common::route_services(&ipt_bed);
    // Warm up (page cache, neighbour entries) so the first round is not penalised.
    connections(&bed, POD, conns.min(200))?;
    connections(&ipt_bed, POD, conns.min(200))?;
    connections_from_pod(&pods.client, POD, conns.min(200))?;
    pod_path_pair(&pods, CLUSTER_IP, conns.min(200))?;
    let node = NodeInfo::default();
    let mut rows = Vec::new();
    for &n in sizes {
        let state = data_state(n.saturating_sub(1));
        // The system's iptables (here iptables-nft), as the iptables mode runs by default.
        let mut ipt = iptables(&ipt_bed, Backend::System)?;
        let report = ipt.sync(&state, &node, Scope::Full);
        anyhow::ensure!(
            report.failed.is_empty(),
            "iptables sync failed: {:?}",
            report.failed.first()
        );
        connections(&ipt_bed, CLUSTER_IP, conns.min(200))?;
        let mut paths: Vec<DataRow> = PathKind::ALL
            .iter()
            .map(|p| DataRow::new(p.label(), n))
            .collect();
        let runs: Vec<usize> = (0..PathKind::ALL.len())
            .filter(|&k| PathKind::ALL[k] != PathKind::PodDirect)
            .collect();
        let pod_direct = PathKind::ALL
            .iter()
            .position(|&k| k == PathKind::PodDirect)
            .expect("a row of ALL");
        for round in 0..rounds {
            for k in 0..runs.len() {
                let which = runs[(round + k) % runs.len()];
                let (attempts, watch) = match PathKind::ALL[which] {
                    PathKind::Direct => {
                        let watch = Watch::start(&[bed.node_netns()]);
                        (connections(&bed, POD, conns)?, watch)
                    }
                    kind @ (PathKind::DirectHooked | PathKind::Ebpf | PathKind::Iptables) => {
                        // The direct arm: the eBPF bed's namespace (no iptables rules), its
                        // sockets made outside the cgroup the socket programs are attached to.
                        let (run_bed, to, bare) = match kind {
                            PathKind::Ebpf => (&bed, CLUSTER_IP, Some(bed.helper_cgroup())),
                            PathKind::DirectHooked => (&bed, POD, Some(bed.helper_cgroup())),
                            _ => (&ipt_bed, CLUSTER_IP, None),
                        };
                        let _dp = if kind == PathKind::Iptables {
                            None
                        } else {
                            Some(synced(BpfDataplane::attach(bed.cgroup_path())?, &state)?)
                        };
                        let watch = Watch::start(&[run_bed.node_netns(), bed.node_netns()]);
                        let (attempts, direct) =
                            paired_with_direct(run_bed, to, &bed, bare, conns)?;
                        let c = watch.finish(attempts.failures + direct.failures);
                        paths[which].paired_base.push(direct.rate());
                        paths[which].add(&attempts, &c, max_load);
                        continue;
                    }
                    PathKind::PodDirect => unreachable!("measured with the pod path's runs"),
                    kind @ (PathKind::PodPath
                    | PathKind::PodHostRouted
                    | PathKind::PodPathPodIp) => {
                        let opts = if kind == PathKind::PodHostRouted {
                            &host_routed
                        } else {
                            &pod_path
                        };
                        let dp =
                            synced(BpfDataplane::attach_with(bed.cgroup_path(), opts)?, &state)?;
                        let watch = Watch::start(&[&pods.client.netns, &pods.direct_client.netns]);
                        let to = if kind == PathKind::PodPathPodIp {
                            POD
                        } else {
                            CLUSTER_IP
                        };
                        let (attempts, direct) = pod_path_pair(&pods, to, conns)?;
                        // Every connection to the ClusterIP must have been translated on
                        // the pod's device, and none to the pod IP, or the row measures
                        // something else.
                        let flows = dp.programmer().maps().packet_stats().new_flows;
                        if kind == PathKind::PodPathPodIp {
                            anyhow::ensure!(
                                flows == 0,
                                "the pod path translated {flows} connections to a pod IP"
                            );
                        } else {
                            anyhow::ensure!(
                                flows >= (conns - attempts.failures) as u64,
                                "the pod path translated {flows} of {conns} connections"
                            );
                        }
                        let c = watch.finish(attempts.failures + direct.failures);
                        paths[which].paired_base.push(direct.rate());
                        if kind == PathKind::PodPath {
                            paths[pod_direct].add(&direct, &c, max_load);
                        }
                        paths[which].add(&attempts, &c, max_load);
                        continue;
                    }
                };
                let c = watch.finish(attempts.failures);
                paths[which].add(&attempts, &c, max_load);
            }
            eprintln!(
                "bench: data path, {n} services, round {} of {rounds} done",
                round + 1
            );
        }
        ipt.shutdown();
        rows.extend(paths);
    }
    Ok(rows)
}

/// `dp` holding `state`: attached per run, so that only one dataplane is installed at a
/// time.
fn synced(mut dp: BpfDataplane, state: &ProxyState) -> Result<BpfDataplane> {
    let report = dp.sync(state, &NodeInfo::default(), Scope::Full);
    anyhow::ensure!(
        report.failed.is_empty(),
        "eBPF sync failed: {:?}",
        report.failed.first()
    );
    Ok(dp)
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
    let conns: usize = std::env::var("FASTPATH_BENCH_CONNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000)
        .clamp(10, 100_000);
    let rounds: usize = std::env::var("FASTPATH_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5)
        .clamp(1, 50);

    let env_max = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(u32::MAX)
    };
    let (nft_max, legacy_max) = (
        env_max("FASTPATH_BENCH_NFT_MAX"),
        env_max("FASTPATH_BENCH_LEGACY_MAX"),
    );
    let only = std::env::var("FASTPATH_BENCH_ONLY").unwrap_or_default();
    let started = Instant::now();
    let mut control = Vec::new();
    for &n in sizes.iter().filter(|_| only != "data") {
        eprintln!("bench: control plane, {n} services x {ENDPOINTS_PER_SERVICE} endpoints");
        let bed = Testbed::new("benchcp")?;
        let mut bpf = BpfDataplane::attach(bed.cgroup_path())?;
        control.push(control_plane("ebpf", &mut bpf, n)?);
        drop(bpf);
        for (name, backend, max) in [
            ("iptables-nft", Backend::Nft, nft_max),
            ("iptables-legacy", Backend::Legacy, legacy_max),
        ] {
            if n > max {
                continue;
            }
            let mut ipt = iptables(&bed, backend)?;
            control.push(control_plane(name, &mut ipt, n)?);
            ipt.shutdown();
        }
    }
    let control_took = started.elapsed();
    let started = Instant::now();
    let (data, cpu) = if only == "control" {
        (Vec::new(), None)
    } else {
        eprintln!("bench: data path, {rounds} rounds of {conns} connections per path");
        // After the control plane, which keeps its threads' placement.
        let cpu = conditions::pin_to_one_cpu();
        eprintln!("bench: data path pinned to CPU {cpu:?} (FASTPATH_BENCH_CPU)");
        // 1 service, then every size: eBPF must keep up with direct at each.
        let mut at: Vec<u32> = std::iter::once(1).chain(sizes.iter().copied()).collect();
        at.dedup();
        (data_path(&at, conns, rounds)?, cpu)
    };
    let data_took = started.elapsed();

    let mut out = String::new();
    let _ = writeln!(
        out,
        "Machine: {}; bench took {:.0} s (control plane) + {:.0} s (data path).\n",
        machine(),
        control_took.as_secs_f64(),
        data_took.as_secs_f64()
    );
    if !control.is_empty() {
        control_table(&mut out, &control);
    }
    if !data.is_empty() {
        data_table(&mut out, &data, rounds, conns, cpu);
    }
    targets(&mut out, &control, &data);
    print!("{out}");
    let dir = xtask::target_dir().join("bench");
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("results.md");
    std::fs::write(&file, &out)?;
    eprintln!("bench: results written to {}", file.display());
    Ok(())
}

/// Kernel, CPUs, the iptables tools and the load average, for the table's header.
fn machine() -> String {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let kernel = read("/proc/sys/kernel/osrelease");
    let cpus = conditions::online_cpus();
    let iptables = std::process::Command::new("iptables")
        .arg("-V")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let load: Vec<String> = read("/proc/loadavg")
        .split_whitespace()
        .take(3)
        .map(str::to_string)
        .collect();
    format!(
        "Linux {kernel}, {cpus} CPUs, {iptables}, load average {} at the end",
        load.join(" ")
    )
}

fn control_table(out: &mut String, control: &[ControlRow]) {
    let _ = writeln!(
        out,
        "## Control plane ({ENDPOINTS_PER_SERVICE} endpoints per service)\n"
    );
    let _ = writeln!(
        out,
        "| dataplane | services | full sync (ms) | periodic sync, nothing changed (ms) | update p50 (ms) | update p99 (ms) | updates | RSS growth (MiB) |"
    );
    let _ = writeln!(
        out,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for r in control {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {:.1} |",
            r.backend,
            r.services,
            ms(r.full_sync),
            ms(r.periodic),
            ms(r.update_p50),
            ms(r.update_p99),
            r.updates,
            r.rss_growth_kib as f64 / 1024.0
        );
    }
}

/// The direct path a row is compared with: the same client dialling the pod IP.
fn baseline(path: &str) -> &'static str {
    if path == POD_PATH || path == POD_HOST_ROUTED || path == POD_PATH_POD_IP {
        POD_DIRECT
    } else {
        DIRECT
    }
}

/// `row`'s rate over its direct baseline's, round by round: over the baseline measured in
/// the same run where the row has one (taking turns connection by connection), else over
/// the baseline's run of the same round (neighbours in time).
fn ratios(row: &DataRow, data: &[DataRow]) -> Vec<f64> {
    if !row.paired_base.is_empty() {
        return row
            .rates
            .iter()
            .zip(&row.paired_base)
            .filter(|(_, d)| **d > 0.0)
            .map(|(r, d)| r / d)
            .collect();
    }
    let base = baseline(row.path);
    let Some(direct) = data
        .iter()
        .find(|d| d.services == row.services && d.path == base)
    else {
        return Vec::new();
    };
    row.rates
        .iter()
        .zip(&direct.rates)
        .filter(|(_, d)| **d > 0.0)
        .map(|(r, d)| r / d)
        .collect()
}

fn data_table(out: &mut String, data: &[DataRow], rounds: usize, conns: usize, cpu: Option<usize>) {
    let placement = cpu.map_or_else(
        || "clients and servers placed by the scheduler".to_string(),
        |c| format!("clients and servers pinned to CPU {c}"),
    );
    let _ = writeln!(
        out,
        "\n## Data path ({rounds} rounds of {conns} new TCP connections per path: connect, read one line, close; {placement})\n"
    );
    let _ = writeln!(
        out,
        "| path | services | connections/s (median of rounds) | rounds' range | vs direct (median of rounds) | vs direct, rounds' range | latency p50 (ms) | latency p99 (ms) | failures | client sockets after a run (most) / ports | load (most) | row |"
    );
    let _ = writeln!(
        out,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    );
    for r in data {
        let (lo, hi) = spread(&r.rates);
        let mut vs = ratios(r, data);
        let (vlo, vhi) = spread(&vs);
        let pct = |x: f64| format!("{:+.1}%", (x - 1.0) * 100.0);
        let (vs_median, vs_range) = if r.path == DIRECT || r.path == POD_DIRECT || vs.is_empty() {
            (String::new(), String::new())
        } else {
            (
                pct(median(&mut vs)),
                format!("{} to {}", pct(vlo), pct(vhi)),
            )
        };
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {lo:.0}-{hi:.0} | {vs_median} | {vs_range} | {:.3} | {:.3} | {} | {} / {} | {:.2} | {} |",
            r.path,
            r.services,
            r.rate(),
            median(&mut r.p50.clone()),
            median(&mut r.p99.clone()),
            r.failures,
            r.sockets,
            r.ports,
            r.max_load_seen,
            if r.failed() {
                format!("FAILED: {}", dedup(&r.problems).join("; "))
            } else {
                "ok".into()
            }
        );
    }
}

/// Distinct messages, in order of first appearance.
fn dedup(xs: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for x in xs {
        if !out.contains(x) {
            out.push(x.clone());
        }
    }
    out
}

/// The targets, each with the numbers it is judged on.
fn targets(out: &mut String, control: &[ControlRow], data: &[DataRow]) {
    let _ = writeln!(out, "\n## Targets\n");
    let ebpf: Vec<&ControlRow> = control.iter().filter(|r| r.backend == "ebpf").collect();
    if let (Some(first), Some(last)) = (ebpf.first(), ebpf.last()) {
        let worst = ebpf.iter().map(|r| r.update_p99).max().unwrap_or_default();
        let per_size: Vec<String> = ebpf
            .iter()
            .map(|r| format!("{} ms at {}", ms(r.update_p99), r.services))
            .collect();
        let _ = writeln!(
            out,
            "- eBPF single-endpoint update p99 under 1 ms: {} ({}); at {} services {:.2}x the p99 at {}.",
            if worst < Duration::from_millis(1) {
                "met"
            } else {
                "NOT met"
            },
            per_size.join(", "),
            last.services,
            last.update_p99.as_secs_f64() / first.update_p99.as_secs_f64().max(1e-9),
            first.services
        );
        if let Some(big) = ebpf.iter().find(|r| r.services >= 10_000) {
            let _ = writeln!(
                out,
                "- eBPF full sync of {} services under 1 s: {} ({} ms).",
                big.services,
                if big.full_sync < Duration::from_secs(1) {
                    "met"
                } else {
                    "NOT met"
                },
                ms(big.full_sync)
            );
        }
    }
    for r in data
        .iter()
        .filter(|r| [EBPF, POD_PATH, POD_HOST_ROUTED, POD_PATH_POD_IP].contains(&r.path))
    {
        let mut vs = ratios(r, data);
        if vs.is_empty() {
            continue;
        }
        let m = median(&mut vs);
        let (lo, hi) = spread(&vs);
        let base = baseline(r.path);
        let direct_failed = data
            .iter()
            .any(|d| d.services == r.services && d.path == base && d.failed());
        // Host routing skips the host's stack, which the direct pod path goes through: it
        // may beat it, as Cilium's BPF host routing beats the legacy path.
        let may_beat_direct = r.path == POD_HOST_ROUTED;
        let verdict = if r.failed() || direct_failed {
            "NOT judged (a run's conditions failed it, see the row; rerun on a quiet machine)"
        } else if (m - 1.0).abs() <= 0.05 || (may_beat_direct && m >= 0.95) {
            "met"
        } else if m > 1.0 {
            "NOT met (faster than its direct baseline by more than 5%: the bench measures something besides the path)"
        } else {
            "NOT met"
        };
        let what = if r.path == EBPF {
            "eBPF (socket) within 5% of direct"
        } else if may_beat_direct {
            "pod path with host routing no more than 5% slower than a pod's direct connections"
        } else if r.path == POD_PATH_POD_IP {
            "a pod's traffic to a pod IP past the pod path's programs within 5% of a bare device's"
        } else {
            "pod path (tc) within 5% of a pod's direct connections"
        };
        let _ = writeln!(
            out,
            "- {what} at {} services: {verdict} (median of rounds {:+.1}%, rounds {:+.1}% to {:+.1}%).",
            r.services,
            (m - 1.0) * 100.0,
            (lo - 1.0) * 100.0,
            (hi - 1.0) * 100.0
        );
    }
    let failed: Vec<String> = data
        .iter()
        .filter(|r| r.failed())
        .map(|r| format!("{} at {}", r.path, r.services))
        .collect();
    let _ = writeln!(
        out,
        "- No data-path row measured the bench instead of the path (ports, failures, load): {}.",
        if failed.is_empty() {
            "met".to_string()
        } else {
            format!("NOT met: {}", failed.join(", "))
        }
    );
}
