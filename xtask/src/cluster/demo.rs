//! `cargo xtask cluster`: the cluster bed shown to a newcomer. Three nodes (by default) come
//! up, each with a real fastpath run as deploy/ ships it; a 6-replica Deployment serves
//! behind a Service; a client pod on every node and a client outside keep sending requests
//! while a live table shows, per node, requests a second, failures and which pods answer.
//! The Deployment is rolled, then fastpath is upgraded node by node; then a summary, and
//! everything is removed (at the end, or at Ctrl-C).

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::Ipv4Addr,
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use super::{
    Cluster, ClusterOptions, Shipped,
    controller::{Deployment, Timing},
    load::{ClientReport, Load, table},
};
use crate::signals;

const WEB_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);

/// What `cargo xtask cluster` was asked for.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    /// One mode per node (`ebpf`, `iptables`).
    pub modes: Vec<String>,
    /// Keep the cluster (and the table) running after the show until Ctrl-C.
    pub wait: bool,
}

/// Builds, runs the show, removes everything.
pub fn cluster_demo(opts: &DemoOptions) -> Result<()> {
    crate::require_root("the cluster demo")?;
    crate::setup::setup()?;
    crate::run::build_release()?;
    let shipped = Shipped::load(&crate::workspace_root().join("deploy"))?;
    signals::install().context("installing the Ctrl-C handler")?;
    println!(
        "cluster: starting {} nodes ({}), each running fastpath as deploy/ ships it",
        opts.modes.len(),
        opts.modes.join(", ")
    );
    let mut c = Cluster::start(
        "cdemo",
        ClusterOptions {
            modes: opts.modes.clone(),
            fastpath: crate::run::release_binary("fastpath")?,
            probe: crate::run::release_binary("fastpath-probe")?,
            shipped,
            extra_args: Vec::new(),
        },
    )?;
    for n in &c.nodes {
        println!(
            "cluster: {} at {} ({}, {} mode), pods in 198.18.{}.0/24",
            n.name,
            n.ipv4,
            n.zone,
            n.mode,
            10 + n.index
        );
    }
    let nodes = c.nodes.len();
    let mut web = Deployment::create(&mut c, "web", WEB_IP, 0, None, 6, &|k| k % nodes)?;
    println!(
        "cluster: Service demo/web on {WEB_IP} (tcp 80, http 81, udp 53; NodePort 30080) with \
         6 pods: {}",
        web.pods
            .iter()
            .map(|p| format!("{} on {}", p.endpoint.pod, p.endpoint.node))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let clients: Vec<_> = (0..nodes)
        .map(|i| c.add_pod_netns(i, &format!("client-{}", i + 1)))
        .collect::<Result<_>>()?;
    // A pod's containers start after its network is set up; here the clients would start
    // within a millisecond, before the pod path has put its programs on the new pods'
    // veths (a few milliseconds after they appear).
    thread::sleep(Duration::from_secs(1));
    let mut loads = Vec::new();
    for (i, pod) in clients.iter().enumerate() {
        let cmd = c.probe_on(i, &pod.netns);
        let clients = [
            format!("tcp={WEB_IP}:80"),
            format!("http={WEB_IP}:81"),
            format!("udp={WEB_IP}:53"),
            format!("udp-connected={WEB_IP}:53"),
        ];
        let place = c.nodes[i].name.clone();
        loads.push(c.start_load(&place, cmd, &clients, Duration::from_millis(50), HOUR)?);
    }
    let ports: Vec<String> = c
        .nodes
        .iter()
        .map(|n| format!("{}:30080", n.ipv4))
        .collect();
    let cmd = c.probe_outside();
    loads.push(c.start_load(
        "outside",
        cmd,
        &[format!("tcp={}", ports.join(","))],
        Duration::from_millis(50),
        HOUR,
    )?);
    println!(
        "cluster: clients on every node (new TCP connection, HTTP keep-alive, UDP fresh socket, \
         UDP connected socket) and outside (every NodePort); Ctrl-C stops and removes it all\n"
    );

    let stop_table = AtomicBool::new(false);
    let outcome = thread::scope(|s| {
        s.spawn(|| live_table(&loads, &stop_table));
        let outcome = show(&mut c, &mut web, opts.wait);
        stop_table.store(true, Ordering::SeqCst);
        outcome
    });
    let reports: Vec<ClientReport> = loads
        .into_iter()
        .flat_map(|l| l.finish(&mut c).unwrap_or_default())
        .collect();
    println!("\ncluster: every request, counted:\n{}", table(&reports));
    let failed: u64 = reports.iter().map(ClientReport::failed).sum();
    println!(
        "cluster: {} requests, {failed} failed; removing the cluster",
        reports.iter().map(|r| r.requests).sum::<u64>()
    );
    drop(c);
    println!("cluster: removed");
    outcome
}

/// The clients' own bound: the show takes a minute or two; `--wait` up to an hour.
const HOUR: Duration = Duration::from_secs(3600);

/// The scripted part: steady traffic, a rollout, fastpath upgraded node by node.
fn show(c: &mut Cluster, web: &mut Deployment, wait: bool) -> Result<()> {
    let pause = |secs: u64| {
        let until = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < until && !signals::stop_requested() {
            thread::sleep(Duration::from_millis(100));
        }
        !signals::stop_requested()
    };
    if !pause(4) {
        return Ok(());
    }
    println!(
        "cluster: rolling Deployment web (new pod listed, old one terminating and draining, then removed)"
    );
    web.rolling_update(c, Timing::default(), &|n| n)?;
    if !pause(3) {
        return Ok(());
    }
    for i in 0..c.nodes.len() {
        if signals::stop_requested() {
            return Ok(());
        }
        println!(
            "cluster: upgrading fastpath on {} (SIGTERM; a new daemon adopts the pinned state)",
            c.nodes[i].name
        );
        c.upgrade(i)?;
        if !pause(2) {
            return Ok(());
        }
    }
    println!(
        "cluster: done{}",
        if wait { "; Ctrl-C to stop" } else { "" }
    );
    while wait && pause(1) {}
    Ok(())
}

/// Every second, per place: requests a second, failures so far, the pods that answered in
/// that second.
fn live_table(loads: &[Load], stop: &AtomicBool) {
    let mut before: BTreeMap<String, (u64, BTreeMap<String, u64>)> = BTreeMap::new();
    let started = Instant::now();
    let mut last = Instant::now();
    while !stop.load(Ordering::SeqCst) {
        thread::sleep(Duration::from_millis(100));
        if last.elapsed() < Duration::from_secs(1) {
            continue;
        }
        let secs = last.elapsed().as_secs_f64();
        last = Instant::now();
        let mut out = format!("--- {:>4.0} s\n", started.elapsed().as_secs_f64());
        for load in loads {
            let reports = load.latest();
            let requests: u64 = reports.iter().map(|r| r.requests).sum();
            let failed: u64 = reports.iter().map(ClientReport::failed).sum();
            let mut answered: BTreeMap<String, u64> = BTreeMap::new();
            for r in &reports {
                for (pod, n) in &r.backends {
                    *answered.entry(pod.clone()).or_default() += n;
                }
            }
            let (old_requests, old_answered) = before.remove(&load.place).unwrap_or_default();
            let pods: Vec<&str> = answered
                .iter()
                .filter(|(pod, n)| old_answered.get(*pod).is_none_or(|o| o < *n))
                .map(|(pod, _)| pod.as_str())
                .collect();
            let _ = writeln!(
                out,
                "{:<8} {:>5.0} req/s  {:>3} failed  answering: {}",
                load.place,
                (requests - old_requests.min(requests)) as f64 / secs,
                failed,
                pods.join(" ")
            );
            before.insert(load.place.clone(), (requests, answered));
        }
        print!("{out}");
    }
}
