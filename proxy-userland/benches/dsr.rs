//! `cargo bench --bench dsr`: traffic from outside to an external IP whose pods all run on
//! other nodes than the one it enters by, SNAT against direct server return (issue 23,
//! point 2), on the cluster bed (xtask/src/cluster: three nodes, one `fastpath` each, run
//! as deploy/ ships it plus `--bpf-lb-mode`).
//!
//! Two beds run at once, one per mode, with the same workload: a Service with 4 pods on
//! node-2 and node-3, its external IP routed by the fabric to node-1. The outside client
//! opens TCP connections (connect, one reply line, close with a reset) and sends UDP
//! requests on fresh sockets, in interleaved rounds whose order rotates. Per mode it prints
//! the median over rounds of the rate and p50/p99 latency, and the packets node-1 sent the
//! client per request (an nftables counter on the fabric): the bandwidth DSR saves the
//! entry node. A round whose conditions are bad (support/conditions.rs: load, ports,
//! failures) makes its row FAILED. Bounded: FASTPATH_BENCH_ROUNDS rounds (default 5) of
//! FASTPATH_BENCH_CONNS requests (default 1000) per workload. Writes target/bench/dsr.md.

use std::{fmt::Write as _, net::Ipv4Addr, path::Path, time::Duration};

use anyhow::{Context as _, Result};
use xtask::cluster::{Cluster, ClusterOptions, Shipped, controller::Deployment, objects};

#[path = "support/conditions.rs"]
mod conditions;
#[path = "support/timing.rs"]
mod timing;

use conditions::Watch;
use timing::{Attempts, median, spread};

const FASTPATH: &str = env!("CARGO_BIN_EXE_fastpath");
const PROBE: &str = env!("CARGO_BIN_EXE_fastpath-probe");
const SERVICE_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 60);
const EXTERNAL: Ipv4Addr = Ipv4Addr::new(198, 19, 1, 60);
const MODES: [&str; 2] = ["snat", "dsr"];
const WORKLOADS: [&str; 2] = ["TCP connect + reply", "UDP request"];

/// A bed in `mode` with the workload in place.
fn bed(mode: &str) -> Result<(Cluster, Deployment)> {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let mut c = Cluster::start(
        &format!("bdsr{}", &mode[..1]),
        ClusterOptions {
            modes: vec!["ebpf".into(); 3],
            fastpath: FASTPATH.into(),
            probe: PROBE.into(),
            shipped: Shipped::load(&deploy)?,
            extra_args: vec![format!("--bpf-lb-mode={mode}")],
        },
    )?;
    let d = Deployment::create(&mut c, "far", SERVICE_IP, 0, None, 4, &|k| 1 + k % 2)?;
    let mut svc = objects::service("far", SERVICE_IP, 0, None);
    svc["spec"]["externalIPs"] = serde_json::json!([EXTERNAL.to_string()]);
    c.api.apply("services", svc);
    c.route_to_node(EXTERNAL, 0)?;
    // Every node hears of the pods and the external IP.
    std::thread::sleep(Duration::from_secs(2));
    Ok((c, d))
}

#[derive(Default)]
struct Series {
    rate: Vec<f64>,
    p50: Vec<f64>,
    p99: Vec<f64>,
    entry_packets: Vec<f64>,
    failures: usize,
    problems: Vec<String>,
}

/// One round of one workload on bed `c`: what the client measured, and the packets
/// node-1 sent it per request.
fn round(c: &Cluster, workload: usize, count: usize) -> Result<(Attempts, f64, Vec<String>)> {
    c.count_to_outside()?;
    let watch = Watch::start(&[&c.outside.netns]);
    let count_s = count.to_string();
    let args: Vec<String> = match workload {
        0 => vec!["tcp".into(), format!("{EXTERNAL}:80"), "--reset".into()],
        _ => vec![
            "udp".into(),
            format!("{EXTERNAL}:53"),
            "--fresh-socket".into(),
        ],
    };
    let out = c
        .probe_outside()
        .args(&args)
        .args(["--count", &count_s, "--timeout-ms", "1000"])
        .output()
        .context("running the probe")?;
    let attempts = Attempts::parse(&String::from_utf8_lossy(&out.stdout));
    let problems = watch
        .finish(attempts.failures)
        .problems(conditions::max_load());
    let entry = c.packets_to_outside()?[0] as f64 / count as f64;
    Ok((attempts, entry, problems))
}

fn main() -> Result<()> {
    let rounds = conditions::setting("FASTPATH_BENCH_ROUNDS", 5usize).clamp(1, 50);
    let count = conditions::setting("FASTPATH_BENCH_CONNS", 1000usize).clamp(10, 10_000);
    let beds: Vec<(Cluster, Deployment)> = MODES.iter().map(|m| bed(m)).collect::<Result<_>>()?;
    let mut series: Vec<Vec<Series>> = (0..MODES.len())
        .map(|_| (0..WORKLOADS.len()).map(|_| Series::default()).collect())
        .collect();
    for r in 0..rounds {
        for k in 0..MODES.len() {
            let m = (r + k) % MODES.len();
            for (w, s) in series[m].iter_mut().enumerate() {
                let (a, entry, problems) = round(&beds[m].0, w, count)?;
                s.rate.push(a.rate());
                s.p50.push(a.p50().as_secs_f64() * 1e3);
                s.p99.push(a.p99().as_secs_f64() * 1e3);
                s.entry_packets.push(entry);
                s.failures += a.failures;
                for p in problems {
                    if !s.problems.contains(&p) {
                        s.problems.push(p);
                    }
                }
            }
        }
    }
    let mut table = String::new();
    writeln!(
        table,
        "| mode | workload | per second (median) | rounds' range | vs SNAT | p50 (ms) | p99 (ms) | node-1's packets to the client per request | failures | row |"
    )?;
    writeln!(
        table,
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    )?;
    let snat_rates: Vec<f64> = series[0]
        .iter_mut()
        .map(|s| median(&mut s.rate.clone()))
        .collect();
    for (m, per_mode) in series.iter_mut().enumerate() {
        for (w, s) in per_mode.iter_mut().enumerate() {
            let (lo, hi) = spread(&s.rate);
            let rate = median(&mut s.rate);
            let vs = if m == 0 || snat_rates[w] <= 0.0 {
                String::new()
            } else {
                format!("{:+.1}%", (rate / snat_rates[w] - 1.0) * 100.0)
            };
            writeln!(
                table,
                "| {} | {} | {rate:.0} | {lo:.0}-{hi:.0} | {vs} | {:.3} | {:.3} | {:.2} | {} | {} |",
                MODES[m],
                WORKLOADS[w],
                median(&mut s.p50),
                median(&mut s.p99),
                median(&mut s.entry_packets),
                s.failures,
                if s.problems.is_empty() {
                    "ok".to_string()
                } else {
                    format!("FAILED: {}", s.problems.join("; "))
                }
            )?;
        }
    }
    // DSR's promise, judged: the entry node sends the client nothing, in every round.
    let dsr_rounds_ok = series[1].iter().all(|s| s.problems.is_empty());
    let most: f64 = series[1]
        .iter()
        .flat_map(|s| s.entry_packets.iter().copied())
        .fold(0.0, f64::max);
    let verdict = if !dsr_rounds_ok {
        "NOT judged (a round's conditions failed it)"
    } else if most == 0.0 {
        "met"
    } else {
        "NOT met"
    };
    writeln!(
        table,
        "\n## Targets\n\n- DSR keeps replies off the entry node: {verdict} (at most {most:.2} of node-1's packets to the client per request, in any round)."
    )?;
    println!("{table}");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("dsr.md"), &table)?;
    drop(beds);
    Ok(())
}
