//! `cargo bench --bench cluster`: the daemon bench's cluster row. The cluster test bed
//! (xtask/src/cluster: nodes as network namespaces on a routed fabric, one real `fastpath`
//! per node run as deploy/ ships it, each with its own cgroup and pin dir, all fed by the
//! in-repo API server over list/watch) with N services x 10 endpoints, all eBPF.
//!
//! Per node: its daemon's first sync (started one node at a time, so each has the machine
//! to itself as on a real node: start until /readyz answers 200 and its pinned maps hold
//! the last service), VmRSS and VmHWM then and at the end; and the network programming
//! latency on EVERY node: from one endpoint change written to the API server (the update
//! call's start) until that node's pinned BPF service and backend maps hold it, read from
//! outside the daemons, every node polled every 0.1 ms; p50 and p99 per node, and for the
//! last node to hold each change. Meanwhile FASTPATH_BENCH_CHURN other endpoint changes
//! per second (default 100), as the single-node rows.
//!
//! The row checks its own conditions (support/conditions.rs): the 1-minute load average
//! before the bed starts and after the changes above FASTPATH_BENCH_MAX_LOAD (default: the
//! CPUs), the hypervisor taking more than FASTPATH_BENCH_MAX_STEAL percent (default 5) of the
//! CPU time during the changes, or other processes (anything but the bench and its daemons)
//! using more than FASTPATH_BENCH_MAX_OTHERS percent (default 25) of the machine's CPU time
//! then, make it FAILED with the reason instead of numbers. The load average lags by a
//! minute and counts whatever ran before; the other processes' share is what the daemons
//! competed with during the changes themselves.
//!
//! Bounded: at most FASTPATH_BENCH_SAMPLES changes (default 100) and
//! FASTPATH_BENCH_PHASE_SECS of them (default 30), each waited for at most 20 s; each first
//! sync at most FASTPATH_BENCH_SYNC_SECS (default 300). Size: FASTPATH_BENCH_CLUSTER_NODES
//! (default 3, 1-9) x FASTPATH_BENCH_CLUSTER_SERVICES (default 10,000, at most 12,000: the
//! shipped map size holds 131,072 backends). Writes target/bench/cluster.md.

use std::{
    fmt::Write as _,
    net::Ipv4Addr,
    path::Path,
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use xtask::cluster::{Cluster, ClusterOptions, Shipped};

#[path = "support/cluster.rs"]
mod cluster;
#[path = "support/conditions.rs"]
mod conditions;
#[path = "support/programmed.rs"]
mod programmed;
#[path = "support/timing.rs"]
mod timing;

use cluster::{changed_endpoints, marker_ip, service_ip, service_name};
use programmed::PinnedMaps;
use timing::percentile;

const FASTPATH: &str = env!("CARGO_BIN_EXE_fastpath");
const PROBE: &str = env!("CARGO_BIN_EXE_fastpath-probe");
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(20);
/// The shipped healthz port (deploy/configmap.yaml), on each node's loopback.
const HEALTHZ_PORT: u16 = 10256;

struct Opts {
    nodes: usize,
    services: u32,
    samples: usize,
    churn: u32,
    phase: Duration,
    sync_limit: Duration,
    max_load: f64,
    max_steal: f64,
    max_others: f64,
}

impl Opts {
    fn from_env() -> Opts {
        Opts {
            nodes: conditions::setting("FASTPATH_BENCH_CLUSTER_NODES", 3usize).clamp(1, 9),
            services: conditions::setting("FASTPATH_BENCH_CLUSTER_SERVICES", 10_000u32)
                .clamp(2, 12_000),
            samples: conditions::setting("FASTPATH_BENCH_SAMPLES", 100usize).clamp(5, 2000),
            churn: conditions::setting("FASTPATH_BENCH_CHURN", 100u32).min(1000),
            phase: Duration::from_secs(
                conditions::setting("FASTPATH_BENCH_PHASE_SECS", 30u64).clamp(5, 3600),
            ),
            sync_limit: Duration::from_secs(
                conditions::setting("FASTPATH_BENCH_SYNC_SECS", 300u64).clamp(10, 3600),
            ),
            max_load: conditions::max_load(),
            max_steal: conditions::setting("FASTPATH_BENCH_MAX_STEAL", 5.0f64),
            max_others: conditions::setting("FASTPATH_BENCH_MAX_OTHERS", 25.0f64),
        }
    }
}

/// What one node measured.
struct NodeResult {
    name: String,
    first_sync: Duration,
    rss_kib: u64,
    hwm_kib: u64,
    rss_end_kib: u64,
    /// Latencies of the changes that arrived on this node, sorted.
    samples: Vec<Duration>,
    timed_out: usize,
}

/// What the row measured.
struct Measured {
    nodes: Vec<NodeResult>,
    /// Per change that arrived everywhere: until the last node held it, sorted.
    everywhere: Vec<Duration>,
    changes: usize,
    /// One look at every node's maps (median).
    look: Duration,
    churned: usize,
    churn_secs: f64,
    load_before: f64,
    load_after: f64,
    /// Percent of the CPU time the hypervisor took during the changes.
    stolen: f64,
    /// Percent of the machine's CPU time that processes other than the bench and its
    /// daemons used during the changes.
    others: f64,
    /// Why the row is meaningless, if it is.
    problems: Vec<String>,
}

fn main() -> Result<()> {
    let opts = Opts::from_env();
    let started = Instant::now();
    eprintln!(
        "bench: cluster, {} nodes x {} services x {} endpoints",
        opts.nodes,
        opts.services,
        cluster::ENDPOINTS
    );
    let result = run(&opts).map_err(|e| format!("{e:#}"));
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Cluster bench took {:.0} s.\n",
        started.elapsed().as_secs_f64()
    );
    table(&mut out, &opts, &result);
    targets(&mut out, &opts, &result);
    print!("{out}");
    let dir = xtask::target_dir().join("bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("cluster.md"), &out)?;
    eprintln!(
        "bench: results written to {}",
        dir.join("cluster.md").display()
    );
    Ok(())
}

/// VmRSS and VmHWM of a process, in KiB.
fn rss_of(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse().ok()))
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// CPU time (user + system, all threads) of a process, in clock ticks; `self` for ours.
fn cpu_ticks(pid: &str) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name, which may hold spaces and ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    // utime and stime are fields 14 and 15, i.e. 11 and 12 after the state (field 3).
    f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0)
}

/// The machine's busy CPU time (everything but idle, iowait and steal), in clock ticks.
fn busy_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = stat
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("cpu "))
        .unwrap_or("")
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal
    [0, 1, 2, 5, 6].iter().filter_map(|&i| v.get(i)).sum()
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf only reads a system value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as f64 } else { 100.0 }
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join(" / ")
}

/// Starts node `i`'s daemon and waits for its first sync: /readyz 200, then the last
/// service in its pinned maps. Returns the maps and how long it took.
fn first_sync(c: &mut Cluster, i: usize, opts: &Opts) -> Result<(PinnedMaps, Duration)> {
    let last = opts.services - 1;
    let last_ip = cluster::initial_endpoints(last)[cluster::ENDPOINTS as usize - 1];
    let started = Instant::now();
    c.start_daemon(i)?;
    let mut maps = None;
    loop {
        if let Some(status) = c.daemon_exited(i)? {
            bail!(
                "{}'s daemon exited ({status}): {}",
                c.nodes[i].name,
                tail(&c.daemon_log(i), 5)
            );
        }
        if started.elapsed() > opts.sync_limit {
            bail!(
                "{}'s first sync did not finish in {} s",
                c.nodes[i].name,
                opts.sync_limit.as_secs()
            );
        }
        if maps.is_none()
            && c.http_get(i, HEALTHZ_PORT, "/readyz")
                .is_ok_and(|(code, _)| code == 200)
        {
            maps = Some(PinnedMaps::open(&c.nodes[i].pin_dir.join("maps-v1"))?);
        }
        if let Some(m) = &maps
            && m.holds(service_ip(last), 80, last_ip)
        {
            let took = started.elapsed();
            return Ok((maps.expect("just matched"), took));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run(opts: &Opts) -> Result<Measured> {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let shipped = Shipped::load(&deploy).context("deploy/ manifests")?;
    let load_before = conditions::load_average();
    let mut c = Cluster::build(
        "bcl",
        ClusterOptions {
            modes: vec!["ebpf".into(); opts.nodes],
            fastpath: FASTPATH.into(),
            probe: PROBE.into(),
            shipped,
            extra_args: Vec::new(),
        },
    )?;
    let loading = Instant::now();
    let (services, slices) = cluster::objects(opts.services);
    for s in services {
        c.api
            .try_create("services", s)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    for s in slices {
        c.api
            .try_create("endpointslices", s)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    // Nobody watches yet: a long-running server would have compacted the load's history.
    c.api.compact();
    eprintln!(
        "bench: API server loaded in {:.1} s",
        loading.elapsed().as_secs_f64()
    );

    // One node at a time: on a real cluster each daemon has its node's CPUs to itself.
    let mut nodes = Vec::new();
    let mut maps = Vec::new();
    for i in 0..c.nodes.len() {
        let (m, took) = first_sync(&mut c, i, opts)?;
        let pid = c.daemon_pid(i).context("a daemon just started")?;
        let (rss_kib, hwm_kib) = rss_of(pid);
        eprintln!(
            "bench: {}: first sync {:.2} s, VmRSS {:.1} MiB, VmHWM {:.1} MiB",
            c.nodes[i].name,
            took.as_secs_f64(),
            rss_kib as f64 / 1024.0,
            hwm_kib as f64 / 1024.0
        );
        maps.push(m);
        nodes.push(NodeResult {
            name: c.nodes[i].name.clone(),
            first_sync: took,
            rss_kib,
            hwm_kib,
            rss_end_kib: 0,
            samples: Vec::new(),
            timed_out: 0,
        });
    }
    let pids: Vec<String> = (0..c.nodes.len())
        .filter_map(|i| c.daemon_pid(i))
        .map(|p| p.to_string())
        .collect();
    let ours = || -> u64 { cpu_ticks("self") + pids.iter().map(|p| cpu_ticks(p)).sum::<u64>() };

    let n = opts.services;
    let api = &c.api;
    let stop = AtomicBool::new(false);
    let churned = AtomicUsize::new(0);
    let mut everywhere = Vec::new();
    let mut looks = Vec::new();
    let mut changes = 0;
    let stolen_before = conditions::stolen_secs();
    let (busy_before, ours_before) = (busy_ticks(), ours());
    let phase_started = Instant::now();
    let churn_secs = std::thread::scope(|s| -> Result<f64> {
        // Steady churn on the odd services (the measured changes go to even ones).
        let churn = s.spawn(|| {
            cluster::churn(
                api,
                n,
                opts.churn,
                opts.phase + SAMPLE_TIMEOUT,
                &stop,
                &churned,
            )
        });
        // Let the churn get going first.
        std::thread::sleep(Duration::from_millis(500));
        let measured = (|| -> Result<()> {
            for k in 0..opts.samples {
                if phase_started.elapsed() > opts.phase {
                    break;
                }
                let i = ((k as u32).wrapping_mul(7_919) % n) & !1;
                let ip: Ipv4Addr = marker_ip(k as u32);
                let slice = cluster::slice(&service_name(i), &changed_endpoints(i, ip));
                let mut pending: Vec<usize> = (0..maps.len()).collect();
                let t0 = Instant::now();
                api.try_update("endpointslices", slice)
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                changes += 1;
                let mut last = Duration::ZERO;
                while !pending.is_empty() {
                    let look = Instant::now();
                    pending.retain(|&j| {
                        if maps[j].holds(service_ip(i), 80, ip) {
                            last = t0.elapsed();
                            nodes[j].samples.push(last);
                            false
                        } else {
                            true
                        }
                    });
                    looks.push(look.elapsed());
                    if pending.is_empty() {
                        everywhere.push(last);
                        break;
                    }
                    if t0.elapsed() > SAMPLE_TIMEOUT {
                        for &j in &pending {
                            nodes[j].timed_out += 1;
                        }
                        break;
                    }
                    std::thread::sleep(Duration::from_micros(100));
                }
                // At most ~10 measured changes per second, so they do not pile up.
                std::thread::sleep(Duration::from_millis(100).saturating_sub(t0.elapsed()));
            }
            Ok(())
        })();
        stop.store(true, Ordering::Relaxed);
        let churn_secs = churn.join().unwrap_or(0.0);
        measured.map(|()| churn_secs)
    })?;
    let wall = phase_started.elapsed();
    let stolen = conditions::stolen_percent(stolen_before, conditions::stolen_secs(), wall);
    let (busy, mine) = (
        busy_ticks().saturating_sub(busy_before),
        ours().saturating_sub(ours_before),
    );
    let others_ticks = busy.saturating_sub(mine);
    let others = 100.0 * others_ticks as f64
        / clock_ticks()
        / (wall.as_secs_f64() * conditions::online_cpus() as f64);
    let load_after = conditions::load_average();
    for (i, node) in nodes.iter_mut().enumerate() {
        node.samples.sort();
        node.rss_end_kib = c.daemon_pid(i).map_or(0, |p| rss_of(p).0);
    }
    everywhere.sort();
    looks.sort();

    for n in &nodes {
        eprintln!(
            "bench: {}: p50 {:.2} ms, p99 {:.2} ms over {} changes ({} timed out)",
            n.name,
            ms(percentile(&n.samples, 0.5)),
            ms(percentile(&n.samples, 0.99)),
            n.samples.len(),
            n.timed_out
        );
    }
    eprintln!(
        "bench: load {load_before:.2} before, {load_after:.2} after; steal {stolen:.1}%; others {others:.0}% (CPU ticks: machine {busy}, the bench and its daemons {mine}, over {:.1} s)",
        wall.as_secs_f64()
    );
    let mut problems = Vec::new();
    let load = load_before.max(load_after);
    if load > opts.max_load {
        problems.push(format!(
            "load average {load:.2} > {:.2} (before the bed {load_before:.2}, after the changes {load_after:.2})",
            opts.max_load
        ));
    }
    if stolen > opts.max_steal {
        problems.push(format!(
            "the host took {stolen:.1}% of the CPU time (> {:.1}%)",
            opts.max_steal
        ));
    }
    if others > opts.max_others {
        problems.push(format!(
            "other processes used {others:.0}% of the machine's CPU time (> {:.0}%)",
            opts.max_others
        ));
    }
    if changes == 0 {
        problems.push("no change was measured".into());
    }
    Ok(Measured {
        nodes,
        everywhere,
        changes,
        look: percentile(&looks, 0.5),
        churned: churned.into_inner(),
        churn_secs,
        load_before,
        load_after,
        stolen,
        others,
        problems,
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn table(out: &mut String, opts: &Opts, result: &Result<Measured, String>) {
    let _ = writeln!(
        out,
        "## Network programming latency on every node of a cluster\n\n\
         {} nodes (network namespaces on a routed fabric), one `fastpath` each run as deploy/ \
         ships it (the ConfigMap's config, the DaemonSet's args and capabilities), eBPF, fed by \
         the in-repo API server over list/watch, {} services x {} endpoints. From one endpoint \
         change written to the API server (the update call's start) until each node's pinned \
         BPF service and backend maps hold it, read from outside the daemons (every node every \
         0.1 ms); \"every node\": until the last one held it. At most {} changes and {} s; \
         meanwhile {} other endpoint changes/s. First sync: one node at a time, from the \
         daemon's start until /readyz answers and its maps hold the last service.\n",
        opts.nodes,
        opts.services,
        cluster::ENDPOINTS,
        opts.samples,
        opts.phase.as_secs(),
        opts.churn
    );
    let m = match result {
        Ok(m) if m.problems.is_empty() => m,
        Ok(m) => {
            let _ = writeln!(out, "FAILED: {}\n", m.problems.join("; "));
            return;
        }
        Err(e) => {
            let _ = writeln!(out, "FAILED: {e}\n");
            return;
        }
    };
    let _ = writeln!(
        out,
        "| node | p50 (ms) | p99 (ms) | max (ms) | changes | timed out (>20 s) | first sync (s) | VmRSS after it (MiB) | VmHWM (MiB) | VmRSS at the end (MiB) |"
    );
    let _ = writeln!(
        out,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for n in &m.nodes {
        let _ = writeln!(
            out,
            "| {} | {:.2} | {:.2} | {:.2} | {} | {} | {:.2} | {:.1} | {:.1} | {:.1} |",
            n.name,
            ms(percentile(&n.samples, 0.5)),
            ms(percentile(&n.samples, 0.99)),
            ms(n.samples.last().copied().unwrap_or_default()),
            n.samples.len(),
            n.timed_out,
            n.first_sync.as_secs_f64(),
            mib(n.rss_kib),
            mib(n.hwm_kib),
            mib(n.rss_end_kib)
        );
    }
    let _ = writeln!(
        out,
        "| every node | {:.2} | {:.2} | {:.2} | {} | {} | | | | |",
        ms(percentile(&m.everywhere, 0.5)),
        ms(percentile(&m.everywhere, 0.99)),
        ms(m.everywhere.last().copied().unwrap_or_default()),
        m.everywhere.len(),
        m.changes - m.everywhere.len()
    );
    let _ = writeln!(
        out,
        "\nConditions: churn {:.0} changes/s; one look at every node's maps {:.3} ms; load \
         average {:.2} before the bed, {:.2} after the changes (limit {:.2}); the host took \
         {:.1}% of the CPU time (limit {:.1}%); other processes of the machine used {:.0}% of \
         its CPU time during the changes (limit {:.0}%).",
        if m.churn_secs > 0.0 {
            m.churned as f64 / m.churn_secs
        } else {
            0.0
        },
        ms(m.look),
        m.load_before,
        m.load_after,
        opts.max_load,
        m.stolen,
        opts.max_steal,
        m.others,
        opts.max_others
    );
}

fn targets(out: &mut String, opts: &Opts, result: &Result<Measured, String>) {
    let _ = writeln!(out, "\n## Targets (cluster)\n");
    let what = format!(
        "eBPF, {} nodes x {} services under {} changes/s: change to BPF map p99 under 5 ms on every node",
        opts.nodes, opts.services, opts.churn
    );
    let m = match result {
        Ok(m) if m.problems.is_empty() => m,
        Ok(m) => {
            let _ = writeln!(out, "- {what}: not judged ({}).", m.problems.join("; "));
            return;
        }
        Err(e) => {
            let _ = writeln!(out, "- {what}: not judged (FAILED: {e}).");
            return;
        }
    };
    let per: Vec<String> = m
        .nodes
        .iter()
        .map(|n| format!("{} {:.2} ms", n.name, ms(percentile(&n.samples, 0.99))))
        .collect();
    let lost: usize = m.nodes.iter().map(|n| n.timed_out).sum();
    let met = lost == 0
        && m.nodes.iter().all(|n| {
            !n.samples.is_empty() && percentile(&n.samples, 0.99) < Duration::from_millis(5)
        });
    let why = match (met, lost) {
        (true, _) => String::new(),
        (false, 0) => " See the table.".into(),
        (false, l) => format!(" {l} arrival(s) did not come within 20 s."),
    };
    let others = if m.others >= 10.0 {
        format!(
            " Other processes used {:.0}% of the machine's CPU time meanwhile: the tails say as much about them as about the daemons.",
            m.others
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "- {what}: {} ({}; every node {:.2} ms).{why}{others}",
        if met { "met" } else { "NOT met" },
        per.join(", "),
        ms(percentile(&m.everywhere, 0.99))
    );
}
