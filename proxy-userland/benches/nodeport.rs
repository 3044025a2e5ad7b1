//! `cargo bench --bench nodeport`: node-port traffic from another host, through the eBPF
//! packet path (tc alone, and native XDP ahead of tc), through the iptables mode (what a
//! kube-proxy user has: DNAT in the nat table), and straight to the pod's IP, on this
//! machine's veth devices, with 1 and with N services programmed.
//!
//! A client namespace ("another host") opens TCP connections (connect, one reply line, close
//! with a reset) and sends UDP requests on one connected socket to a node port whose two
//! backends run on the node (direct: to a third pod, whose device carries no programs in
//! any run), in interleaved rounds whose order
//! rotates, so drift and noise hit every path alike. tc, XDP and direct share a bed that
//! never has iptables rules; iptables has its own, with the rules installed once per size.
//! TCP runs take turns, connection by connection (`fastpath-probe tcp --alternate`), with a
//! second host whose device into the node carries no programs dialling a pod directly:
//! separate runs of one path differ by up to 2x on a VM, a paired run's two arms by a few
//! percent, so the Targets (node port no more than 5% slower than direct) are judged on the
//! paired ratio. Every run's conditions are checked (support/conditions.rs); a row with a
//! bad run is FAILED. Per path it prints the median over rounds of the rate and of the p50/p99
//! latencies, and the rounds' spread, and writes the table to target/bench/nodeport.md.
//! Bounded: FASTPATH_BENCH_ROUNDS rounds (default 5) of FASTPATH_BENCH_CONNS connections
//! (default 2000) and as many UDP requests; FASTPATH_BENCH_NODEPORT_SIZES (default "1,10000");
//! FASTPATH_BENCH_NODEPORT_PATHS (default all: "tc,xdp,iptables,direct,hostrouting") runs
//! only the paths named, for profiling one; addresses in 198.18.0.0/15 only. Pinned to one CPU as the data-path bench is
//! (FASTPATH_BENCH_CPU; see support/conditions.rs).

use std::{fmt::Write as _, path::Path, time::Duration};

use anyhow::{Context as _, Result};
use proxy_userland::{
    dataplane::{
        Dataplane, Scope,
        bpf::{
            AttachOptions, BpfDataplane, PacketPathConfig, PodPathConfig, host_stack::HostRouting,
        },
        iptables::{Family, IptablesConfig, IptablesDataplane, apply::Backend},
    },
    model::ProxyState,
};
use xtask::testbed::{Pod, Testbed};

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

use conditions::Watch;
use timing::{Attempts, median, spread};

const PROBE: &str = env!("CARGO_BIN_EXE_fastpath-probe");
const NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `demo/web` with its node ports and two pods on this node, plus `extra` ClusterIP
/// services x 10 endpoints.
fn state(extra: u32) -> ProxyState {
    let mut svc = common::web_service("web", common::WEB_IP);
    svc.ports[0].node_port = Some(NODE_PORT);
    svc.ports[1].node_port = Some(UDP_NODE_PORT);
    let local = |i| {
        (common::ready(common::pod_ip(i))).placed(|at| {
            at.node_name = Some("node-a".into());
        })
    };
    let eps = common::web_endpoints(vec![local(1), local(2)]);
    let mut state = synthetic::state(extra, 0);
    synthetic::merge(&mut state, common::state_of(vec![(svc, Some(eps))]));
    state
}

/// The node-port programs on `ext`'s device; with `pods`, also the pod path on those
/// devices with host routing, so a node port's packets for them skip the host's stack.
fn attach(
    bed: &Testbed,
    ext: &Pod,
    xdp: bool,
    pods: Option<&[Pod]>,
    state: &ProxyState,
) -> Result<BpfDataplane> {
    let packet = PacketPathConfig {
        netns: Some(bed.node_netns().to_string()),
        devices: vec![ext.node_veth.clone()],
        node_port_cidrs: vec![],
        xdp,
    };
    let pods = pods.map(|pods| PodPathConfig {
        netns: Some(bed.node_netns().to_string()),
        prefixes: pods.iter().map(|p| p.node_veth.clone()).collect(),
        host_routing: HostRouting::True,
        ..Default::default()
    });
    let mut dp = BpfDataplane::attach_with(
        bed.cgroup_path(),
        &AttachOptions {
            packet: Some(packet),
            pods,
            ..Default::default()
        },
    )?;
    if xdp {
        let devices = dp.node_devices().context("packet path")?;
        anyhow::ensure!(
            devices.devices.iter().all(|d| d.xdp),
            "no native XDP on {:?}",
            devices.devices
        );
    }
    let report = dp.sync(state, &common::node(), Scope::Full);
    anyhow::ensure!(report.failed.is_empty(), "sync failed: {:?}", report.failed);
    Ok(dp)
}

fn probe(ext: &Pod, args: &[&str]) -> Result<Attempts> {
    Ok(Attempts::parse(&probe_output(ext, args)?))
}

fn probe_output(ext: &Pod, args: &[&str]) -> Result<String> {
    let out = std::process::Command::new(Path::new(PROBE))
        .arg("--netns")
        .arg(&ext.netns)
        .args(args)
        .output()
        .context("running the probe")?;
    anyhow::ensure!(
        out.status.success(),
        "the probe failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// TCP connections from `ext` to `target`, taking turns connection by connection with
/// connections from `bare` (another host whose device into the node carries no programs)
/// straight to a pod: (the path's, the direct baseline's), measured in the same moments.
fn probe_paired(
    ext: &Pod,
    target: &str,
    bare: &Pod,
    pod: &str,
    count: &str,
) -> Result<(Attempts, Attempts)> {
    let direct = format!("{}={pod}", bare.netns);
    let out = probe_output(
        ext,
        &[
            "tcp",
            target,
            "--count",
            count,
            "--timeout-ms",
            "1000",
            "--reset",
            "--alternate",
            &direct,
        ],
    )?;
    Attempts::parse_pair(&out, count.parse()?)
}

#[derive(Default)]
struct Series {
    rate: Vec<f64>,
    p50: Vec<f64>,
    p99: Vec<f64>,
    failures: usize,
    problems: Vec<String>,
    /// Rate over the direct baseline measured in the same run, per round (TCP, where the
    /// probe takes turns between the two).
    paired: Vec<f64>,
}

impl Series {
    fn add(&mut self, a: &Attempts, problems: Vec<String>) {
        self.rate.push(a.rate());
        self.p50.push(a.p50().as_secs_f64() * 1e3);
        self.p99.push(a.p99().as_secs_f64() * 1e3);
        self.failures += a.failures;
        for p in problems {
            if !self.problems.contains(&p) {
                self.problems.push(p);
            }
        }
    }

    fn row(&mut self, path: &str, workload: &str, services: u32, direct: Option<f64>) -> String {
        let (lo, hi) = spread(&self.rate);
        let rate = median(&mut self.rate);
        let pct = |x: f64| format!("{:+.1}%", (x - 1.0) * 100.0);
        let vs = if self.paired.is_empty() {
            direct
                .filter(|d| *d > 0.0)
                .map_or(String::new(), |d| pct(rate / d))
        } else {
            let (lo, hi) = spread(&self.paired);
            format!(
                "{} (paired; {} to {})",
                pct(median(&mut self.paired)),
                pct(lo),
                pct(hi)
            )
        };
        format!(
            "| {path} | {services} | {workload} | {rate:.0} | {lo:.0}-{hi:.0} | {vs} | {:.3} | {:.3} | {} | {} |",
            median(&mut self.p50),
            median(&mut self.p99),
            self.failures,
            if self.problems.is_empty() {
                "ok".to_string()
            } else {
                format!("FAILED: {}", self.problems.join("; "))
            }
        )
    }
}

const PATHS: [&str; 5] = [
    "tc",
    "XDP + tc",
    "iptables (DNAT)",
    "direct to pod IP",
    "tc, host routing (redirect_peer)",
];

/// Short names of [`PATHS`], for FASTPATH_BENCH_NODEPORT_PATHS.
const PATH_KEYS: [&str; 5] = ["tc", "xdp", "iptables", "direct", "hostrouting"];

/// Which of [`PATHS`] to run: all unless FASTPATH_BENCH_NODEPORT_PATHS names some.
fn selected_paths() -> Result<Vec<bool>> {
    let Ok(list) = std::env::var("FASTPATH_BENCH_NODEPORT_PATHS") else {
        return Ok(vec![true; PATHS.len()]);
    };
    let mut on = vec![false; PATHS.len()];
    for key in list.split(',').map(str::trim).filter(|k| !k.is_empty()) {
        let i = PATH_KEYS.iter().position(|k| *k == key).with_context(|| {
            format!("FASTPATH_BENCH_NODEPORT_PATHS: no path {key:?}; the paths are {PATH_KEYS:?}")
        })?;
        on[i] = true;
    }
    Ok(on)
}

/// The index of "direct to pod IP" in [`PATHS`].
const DIRECT: usize = 3;
/// The index of "tc, host routing" in [`PATHS`].
const TC_HOST_ROUTED: usize = 4;

fn main() -> Result<()> {
    let rounds = env_usize("FASTPATH_BENCH_ROUNDS", 5).clamp(1, 50);
    let count = env_usize("FASTPATH_BENCH_CONNS", 2000)
        .clamp(10, 10_000)
        .to_string();
    let sizes: Vec<u32> = std::env::var("FASTPATH_BENCH_NODEPORT_SIZES")
        .unwrap_or_else(|_| "1,10000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .filter(|&n| (1..=60_000).contains(&n))
        .collect();
    let selected = selected_paths()?;
    let max_load = conditions::max_load();
    // Before the pods' servers start, so they are pinned too.
    let cpu = conditions::pin_to_one_cpu();
    // Pods 1 and 2 are the node port's backends; pod 3, on a device that never carries
    // programs, is what the direct arms dial. With host routing the backends' devices carry
    // the pod path, which a direct connection to them would cross too.
    let (mut bed, pods) = common::bed_with_pods("npbench", 3);
    let backends = &pods[..2];
    let ext = nat_common::external_client(&mut bed);
    // A second host whose device into the node never carries programs: the TCP baseline
    // that each path's connections take turns with.
    let bare_host = std::net::Ipv4Addr::new(198, 18, 2, 2);
    let bare = bed.add_pod("bare", bare_host, None)?;
    let (mut ipt_bed, _ipt_pods) = common::bed_with_pods("npbenchipt", 2);
    let ipt_ext = nat_common::external_client(&mut ipt_bed);
    let node_target = |port: u16| format!("{}:{port}", bed.node_ipv4());
    let (tcp_target, udp_target) = (node_target(NODE_PORT), node_target(UDP_NODE_PORT));
    let (pod_tcp, pod_udp) = (
        format!("{}:8080", common::pod_ip(3)),
        format!("{}:5353", common::pod_ip(3)),
    );
    let mut table = String::new();
    let mut targets = Vec::new();
    writeln!(
        table,
        "| path | services | workload | per second (median) | rounds' range | vs direct | p50 (ms) | p99 (ms) | failures | row |"
    )?;
    writeln!(
        table,
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    )?;
    for &n in &sizes {
        let state = state(n.saturating_sub(1));
        let mut ipt = IptablesDataplane::new(IptablesConfig {
            netns: Some(ipt_bed.node_netns().to_string()),
            families: vec![Family::V4],
            cleanup_on_exit: true,
            backend: Backend::System,
            ..Default::default()
        })?;
        let report = ipt.sync(&state, &common::node(), Scope::Full);
        anyhow::ensure!(
            report.failed.is_empty(),
            "iptables sync failed: {:?}",
            report.failed.first()
        );
        // [path][tcp, udp]
        let mut series: Vec<[Series; 2]> = PATHS.iter().map(|_| Default::default()).collect();
        for round in 0..rounds {
            for k in 0..PATHS.len() {
                let which = (round + k) % PATHS.len();
                if !selected[which] {
                    continue;
                }
                let (client, bare, tcp_to, udp_to) = match which {
                    // iptables' baseline is the clean bed's: a direct connection on the
                    // iptables node would cross its rules too.
                    2 => (&ipt_ext, &bare, &tcp_target, &udp_target),
                    3 => (&ext, &bare, &pod_tcp, &pod_udp),
                    _ => (&ext, &bare, &tcp_target, &udp_target),
                };
                let dp = match which {
                    0 | 1 => Some(attach(&bed, &ext, which == 1, None, &state)?),
                    4 => Some(attach(&bed, &ext, false, Some(backends), &state)?),
                    _ => None,
                };
                let watch = Watch::start(&[&client.netns, &bare.netns]);
                let tcp = if which == DIRECT {
                    probe(
                        client,
                        &[
                            "tcp",
                            tcp_to,
                            "--count",
                            &count,
                            "--timeout-ms",
                            "1000",
                            "--reset",
                        ],
                    )?
                } else {
                    let (tcp, direct) = probe_paired(client, tcp_to, bare, &pod_tcp, &count)?;
                    if direct.rate() > 0.0 {
                        series[which][0].paired.push(tcp.rate() / direct.rate());
                    }
                    tcp
                };
                let tcp_c = watch.finish(tcp.failures);
                let watch = Watch::start(&[&client.netns]);
                let udp = probe(
                    client,
                    &[
                        "udp",
                        udp_to,
                        "--connected",
                        "--count",
                        &count,
                        "--timeout-ms",
                        "1000",
                    ],
                )?;
                let udp_c = watch.finish(udp.failures);
                series[which][0].add(&tcp, tcp_c.problems(max_load));
                series[which][1].add(&udp, udp_c.problems(max_load));
                for p in tcp_c
                    .problems(max_load)
                    .into_iter()
                    .chain(udp_c.problems(max_load))
                {
                    eprintln!(
                        "bench: WARNING: node port, {} at {n} services: {p}; the row is FAILED",
                        PATHS[which]
                    );
                }
                drop(dp);
                std::thread::sleep(Duration::from_millis(200));
            }
            eprintln!(
                "bench: node port, {n} services, round {} of {rounds} done",
                round + 1
            );
        }
        ipt.shutdown();
        let direct = [
            median(&mut series[DIRECT][0].rate.clone()),
            median(&mut series[DIRECT][1].rate.clone()),
        ];
        for which in [0, TC_HOST_ROUTED] {
            let tcp = &series[which][0];
            let mut ratios = tcp.paired.clone();
            if ratios.is_empty() {
                continue;
            }
            let m = median(&mut ratios);
            let verdict = if !tcp.problems.is_empty() {
                "NOT judged (a run's conditions failed it, see the row)"
            } else if m >= 0.95 {
                "met"
            } else {
                "NOT met"
            };
            targets.push(format!(
                "- {} node port no more than 5% slower than direct (TCP connections, taking turns) at {n} services: {verdict} ({:+.1}%).",
                PATHS[which],
                (m - 1.0) * 100.0
            ));
        }
        for (which, pair) in series.iter_mut().enumerate() {
            if !selected[which] {
                continue;
            }
            for (w, (s, workload)) in pair
                .iter_mut()
                .zip(["TCP connections", "UDP requests"])
                .enumerate()
            {
                let vs = (which != DIRECT && selected[DIRECT]).then_some(direct[w]);
                writeln!(table, "{}", s.row(PATHS[which], workload, n, vs))?;
            }
        }
    }
    let placement = cpu.map_or_else(
        || "clients and servers placed by the scheduler".to_string(),
        |c| format!("clients and servers pinned to CPU {c}"),
    );
    let table = format!(
        "Node port from another host, {rounds} interleaved rounds of {count} each, {placement}. \
         TCP rows are compared with direct connections from a second host taking turns with \
         theirs, connection by connection; UDP rows with the direct row's median.\n\n{table}\n\
         ## Targets\n\n{}\n",
        targets.join("\n")
    );
    println!("\n{table}");
    let out = xtask::target_dir().join("bench");
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join("nodeport.md"), &table)?;
    println!("written to {}", out.join("nodeport.md").display());
    Ok(())
}
