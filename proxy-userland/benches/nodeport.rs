//! `cargo bench --bench nodeport`: node-port traffic from another host through the eBPF
//! packet path, tc alone against native XDP ahead of tc, on this machine's veth devices.
//!
//! A client namespace ("another host") opens TCP connections (connect, one reply line,
//! close) and sends UDP requests on one connected socket to a node port whose two backends
//! run on the node, in interleaved rounds: tc, XDP, tc, XDP, ... so drift and noise hit both
//! alike. Per path it prints the median over rounds of the rate and of the p50/p99
//! latencies, and the rounds' spread, and writes the table to target/bench/nodeport.md.
//! Bounded: FASTPATH_BENCH_ROUNDS rounds (default 5) of FASTPATH_BENCH_CONNS connections
//! (default 2000) and as many UDP requests; addresses in 198.18.0.0/15 only.

use std::{fmt::Write as _, path::Path, time::Duration};

use anyhow::{Context as _, Result};
use proxy_userland::dataplane::{
    Dataplane, Scope,
    bpf::{AttachOptions, BpfDataplane, PacketPathConfig},
};
use xtask::testbed::{Pod, Testbed};

#[path = "../tests/common.rs"]
#[allow(dead_code, unused_imports)]
mod common;
#[path = "../tests/nat_common.rs"]
#[allow(dead_code, unused_imports)]
mod nat_common;
#[path = "support/timing.rs"]
mod timing;

use timing::{Attempts, median};

const PROBE: &str = env!("CARGO_BIN_EXE_fastpath-probe");
const NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn attach(bed: &Testbed, ext: &Pod, xdp: bool) -> Result<BpfDataplane> {
    let packet = PacketPathConfig {
        netns: Some(bed.node_netns().to_string()),
        devices: vec![ext.node_veth.clone()],
        node_port_cidrs: vec![],
        xdp,
    };
    let mut dp = BpfDataplane::attach_with(
        bed.cgroup_path(),
        &AttachOptions {
            packet: Some(packet),
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
    let mut svc = common::web_service("web", common::WEB_IP);
    svc.ports[0].node_port = Some(NODE_PORT);
    svc.ports[1].node_port = Some(UDP_NODE_PORT);
    let local = |i| proxy_userland::model::Endpoint {
        node_name: Some("node-a".into()),
        ..common::ready(common::pod_ip(i))
    };
    let eps = common::web_endpoints(vec![local(1), local(2)]);
    let report = dp.sync(
        &common::state_of(vec![(svc, Some(eps))]),
        &common::node(),
        Scope::Full,
    );
    anyhow::ensure!(report.failed.is_empty(), "sync failed: {:?}", report.failed);
    Ok(dp)
}

fn probe(ext: &Pod, args: &[&str]) -> Result<Attempts> {
    let out = std::process::Command::new(Path::new(PROBE))
        .arg("--netns")
        .arg(&ext.netns)
        .args(args)
        .output()
        .context("running the probe")?;
    Ok(Attempts::parse(&String::from_utf8_lossy(&out.stdout)))
}

#[derive(Default)]
struct Series {
    rate: Vec<f64>,
    p50: Vec<f64>,
    p99: Vec<f64>,
    failures: usize,
}

impl Series {
    fn add(&mut self, a: &Attempts) {
        self.rate.push(a.rate());
        self.p50.push(a.p50().as_secs_f64() * 1e3);
        self.p99.push(a.p99().as_secs_f64() * 1e3);
        self.failures += a.failures;
    }

    fn row(&mut self, path: &str, workload: &str) -> String {
        let (lo, hi) = (
            self.rate.iter().copied().fold(f64::INFINITY, f64::min),
            self.rate.iter().copied().fold(0.0, f64::max),
        );
        format!(
            "| {path} | {workload} | {:.0} | {lo:.0}-{hi:.0} | {:.3} | {:.3} | {} |",
            median(&mut self.rate),
            median(&mut self.p50),
            median(&mut self.p99),
            self.failures
        )
    }
}

fn main() -> Result<()> {
    let rounds = env_usize("FASTPATH_BENCH_ROUNDS", 5).clamp(1, 50);
    let count = env_usize("FASTPATH_BENCH_CONNS", 2000)
        .clamp(10, 10_000)
        .to_string();
    let (mut bed, _pods) = common::bed_with_pods("npbench", 2);
    let ext = nat_common::external_client(&mut bed);
    let (tcp_target, udp_target) = (
        format!("{}:{NODE_PORT}", bed.node_ipv4()),
        format!("{}:{UDP_NODE_PORT}", bed.node_ipv4()),
    );
    // [tc tcp, tc udp, xdp tcp, xdp udp]
    let mut series: [Series; 4] = Default::default();
    for round in 0..rounds {
        for (i, xdp) in [false, true].into_iter().enumerate() {
            let dp = attach(&bed, &ext, xdp)?;
            let tcp = probe(
                &ext,
                &[
                    "tcp",
                    &tcp_target,
                    "--count",
                    &count,
                    "--timeout-ms",
                    "1000",
                ],
            )?;
            let udp = probe(
                &ext,
                &[
                    "udp",
                    &udp_target,
                    "--connected",
                    "--count",
                    &count,
                    "--timeout-ms",
                    "1000",
                ],
            )?;
            series[2 * i].add(&tcp);
            series[2 * i + 1].add(&udp);
            let stats = dp.programmer().maps().packet_stats();
            eprintln!(
                "round {round} {}: {stats:?}",
                if xdp { "xdp" } else { "tc" }
            );
            drop(dp);
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let mut table = String::new();
    writeln!(
        table,
        "| path | workload | per second (median) | rounds' range | p50 (ms) | p99 (ms) | failures |"
    )?;
    writeln!(table, "| --- | --- | ---: | ---: | ---: | ---: | ---: |")?;
    let names = [
        ("tc", "TCP connections"),
        ("tc", "UDP requests"),
        ("XDP + tc", "TCP connections"),
        ("XDP + tc", "UDP requests"),
    ];
    for (s, (path, workload)) in series.iter_mut().zip(names) {
        writeln!(table, "{}", s.row(path, workload))?;
    }
    println!(
        "\nNode port from another host, {rounds} interleaved rounds of {count} each:\n\n{table}"
    );
    let out = xtask::target_dir().join("bench");
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join("nodeport.md"), &table)?;
    println!("written to {}", out.join("nodeport.md").display());
    Ok(())
}
