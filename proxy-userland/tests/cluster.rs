//! A cluster, not a node: three nodes, one real daemon each, run as deploy/ ships it (the
//! ConfigMap's config, the DaemonSet's args and capability set), fed by the in-repo API
//! server over list/watch, with pods on every node and clients that count every request
//! while things move (see xtask/src/cluster). Each test prints, per client kind and node,
//! requests, failures by error and the longest gap.
//!
//! The tests take one lock: each bed runs three daemons and a dozen clients, and two at once
//! on a small machine would measure the machine.

mod common;

use std::{net::Ipv4Addr, path::Path, sync::Mutex, time::Duration};

use common::{FASTPATH, PROBE};
use xtask::{
    cluster::{
        Cluster, ClusterOptions, Shipped,
        controller::{Deployment, Timing},
        load::{ClientReport, Load, table},
    },
    testbed::Pod,
};

static ONE_BED_AT_A_TIME: Mutex<()> = Mutex::new(());

const WEB_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
/// Pause between one client's requests: 20 requests a second per client.
const INTERVAL: Duration = Duration::from_millis(50);

fn cluster(tag: &str, modes: &[&str]) -> Cluster {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    Cluster::start(
        tag,
        ClusterOptions {
            modes: modes.iter().map(|m| m.to_string()).collect(),
            fastpath: FASTPATH.into(),
            probe: PROBE.into(),
            shipped: Shipped::load(&deploy).expect("deploy/ manifests"),
        },
    )
    .expect("cluster bed")
}

/// A client pod on every node (198.18.(10+N).200).
fn client_pods(c: &mut Cluster) -> Vec<Pod> {
    (0..c.nodes.len())
        .map(|i| {
            let ip = Ipv4Addr::new(198, 18, 10 + c.nodes[i].index, 200);
            c.add_pod_netns(i, &format!("client-{}", i + 1), ip)
                .expect("client pod")
        })
        .collect()
}

/// The four kinds of in-cluster client, against Service `ip`.
fn in_cluster_clients(ip: Ipv4Addr) -> Vec<String> {
    vec![
        format!("tcp={ip}:80"),
        format!("http={ip}:81"),
        format!("udp={ip}:53"),
        format!("udp-connected={ip}:53"),
    ]
}

/// Starts the in-cluster clients in every client pod (skipping nodes in `skip`) and the
/// outside client on the node ports of the other nodes.
fn start_loads(c: &mut Cluster, pods: &[Pod], skip: &[usize], secs: u64) -> Vec<Load> {
    let duration = Duration::from_secs(secs);
    let mut loads = Vec::new();
    for (i, pod) in pods.iter().enumerate() {
        if skip.contains(&i) {
            continue;
        }
        let cmd = c.probe_on(i, &pod.netns);
        let place = c.nodes[i].name.clone();
        let clients = in_cluster_clients(WEB_IP);
        loads.push(start(c, &place, cmd, &clients, duration));
    }
    let node_ports: Vec<String> = c
        .nodes
        .iter()
        .enumerate()
        .filter(|(i, _)| !skip.contains(i))
        .map(|(_, n)| format!("{}:30080", n.ipv4))
        .collect();
    let cmd = c.probe_outside();
    loads.push(start(
        c,
        "outside",
        cmd,
        &[format!("tcp={}", node_ports.join(","))],
        duration,
    ));
    loads
}

fn start(
    c: &mut Cluster,
    place: &str,
    cmd: std::process::Command,
    clients: &[String],
    duration: Duration,
) -> Load {
    c.start_load(place, cmd, clients, INTERVAL, duration)
        .expect("load clients")
}

fn finish(c: &mut Cluster, loads: Vec<Load>) -> Vec<ClientReport> {
    loads
        .into_iter()
        .flat_map(|l| l.finish(c).expect("final report"))
        .collect()
}

/// Every client made requests, and none failed.
fn zero_failures(phase: &str, reports: &[ClientReport]) -> Result<(), String> {
    println!("{phase}:\n{}", table(reports));
    let bad: Vec<String> = reports
        .iter()
        .filter(|r| r.failed() > 0 || r.ok == 0)
        .map(|r| format!("{} {}: {:?} of {}", r.place, r.name, r.failures, r.requests))
        .collect();
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!("{phase}: {}", bad.join("; ")))
    }
}

/// A rolling update of a 6-replica Deployment over 3 nodes under load.
fn rolling_update_under_load(c: &mut Cluster, phase: &str) -> Result<(), String> {
    let nodes = c.nodes.len();
    let mut web = Deployment::create(c, "web", WEB_IP, 0, None, 6, &|k| k % nodes)
        .map_err(|e| format!("{e:#}"))?;
    let pods = client_pods(c);
    std::thread::sleep(Duration::from_secs(2));
    let loads = start_loads(c, &pods, &[], 120);
    std::thread::sleep(Duration::from_secs(2));
    web.rolling_update(c, Timing::default(), &|n| n)
        .map_err(|e| format!("{e:#}"))?;
    std::thread::sleep(Duration::from_secs(1));
    let reports = finish(c, loads);
    let result = zero_failures(phase, &reports);
    // The rollout reached every client: the new pods answered them all.
    let stale: Vec<String> = reports
        .iter()
        .filter(|r| !r.backends.keys().any(|b| b.contains("-g2-")))
        .map(|r| format!("{} {}", r.place, r.name))
        .collect();
    result.and_then(|()| {
        if stale.is_empty() {
            Ok(())
        } else {
            Err(format!("{phase}: never reached a new pod: {stale:?}"))
        }
    })
}

#[test]
fn a_rolling_update_fails_no_request_with_every_node_in_ebpf_mode() {
    let _one = ONE_BED_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = cluster("clebpf", &["ebpf", "ebpf", "ebpf"]);
    let result = rolling_update_under_load(&mut c, "rolling update, 3 x ebpf");
    if let Err(e) = result {
        panic!("{e}\nnode-1 log:\n{}", c.daemon_log(0));
    }
}
