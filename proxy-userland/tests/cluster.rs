//! A cluster, not a node: three nodes, one real daemon each, run as deploy/ ships it (the
//! ConfigMap's config, the DaemonSet's args and capability set), fed by the in-repo API
//! server over list/watch, with pods on every node and clients that count every request
//! while things move (see xtask/src/cluster). Each test prints, per client kind and node,
//! requests, failures by error and the longest gap.
//!
//! The tests take one lock: each bed runs three daemons and a dozen clients, and two at once
//! on a small machine would measure the machine.

mod common;
#[path = "../benches/support/programmed.rs"]
mod programmed;

use std::{
    net::Ipv4Addr,
    path::Path,
    sync::Mutex,
    time::{Duration, Instant},
};

use common::{FASTPATH, PROBE};
use xtask::{
    cluster::{
        Cluster, ClusterOptions, Shipped,
        controller::{Deployment, Timing},
        load::{ClientReport, Load, table},
        objects::{self, EndpointSpec},
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
            extra_args: std::env::var("FASTPATH_CLUSTER_ARGS")
                .map(|a| a.split_whitespace().map(str::to_string).collect())
                .unwrap_or_default(),
        },
    )
    .expect("cluster bed")
}

/// A client pod on every node.
fn client_pods(c: &mut Cluster) -> Vec<Pod> {
    (0..c.nodes.len())
        .map(|i| {
            c.add_pod_netns(i, &format!("client-{}", i + 1))
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

/// The bed's workload: Service `web` with 6 replicas spread over the nodes, and a client
/// pod on every node.
struct Workload {
    web: Deployment,
    clients: Vec<Pod>,
}

fn workload(c: &mut Cluster) -> Workload {
    let nodes = c.nodes.len();
    let web =
        Deployment::create(c, "web", WEB_IP, 0, None, 6, &|k| k % nodes).expect("Deployment web");
    let clients = client_pods(c);
    // Every node hears of the pods before the clients start.
    std::thread::sleep(Duration::from_secs(2));
    Workload { web, clients }
}

/// 3a: a rolling update of the 6-replica Deployment under load: no request fails, and the
/// new pods answer every client.
fn rolling_update(c: &mut Cluster, w: &mut Workload, phase: &str) -> Result<(), String> {
    let loads = start_loads(c, &w.clients, &[], 120);
    std::thread::sleep(Duration::from_secs(1));
    w.web
        .rolling_update(c, Timing::default(), &|n| n)
        .map_err(|e| format!("{e:#}"))?;
    std::thread::sleep(Duration::from_secs(1));
    let reports = finish(c, loads);
    zero_failures(phase, &reports)?;
    // After the rollout the Deployment holds only new pods.
    let new: Vec<String> = w.web.pods.iter().map(|p| p.endpoint.pod.clone()).collect();
    let stale: Vec<String> = reports
        .iter()
        .filter(|r| !r.backends.keys().any(|b| new.contains(b)))
        .map(|r| format!("{} {}", r.place, r.name))
        .collect();
    if stale.is_empty() {
        Ok(())
    } else {
        Err(format!("{phase}: never reached a new pod: {stale:?}"))
    }
}

/// 3b: fastpath upgraded node by node under load (SIGTERM, a new process adopting what is
/// pinned): no request fails.
fn upgrade_node_by_node(c: &mut Cluster, w: &Workload, phase: &str) -> Result<(), String> {
    let loads = start_loads(c, &w.clients, &[], 120);
    std::thread::sleep(Duration::from_secs(1));
    for i in 0..c.nodes.len() {
        c.upgrade(i).map_err(|e| format!("{e:#}"))?;
        std::thread::sleep(Duration::from_secs(1));
    }
    let reports = finish(c, loads);
    zero_failures(phase, &reports)
}

/// The Deployment scaled from 6 to 9 and back under load: no request fails, and the added
/// pods answered.
fn scale_up_and_down(c: &mut Cluster, w: &mut Workload, phase: &str) -> Result<(), String> {
    let nodes = c.nodes.len();
    let before: Vec<String> = w.web.pods.iter().map(|p| p.endpoint.pod.clone()).collect();
    let loads = start_loads(c, &w.clients, &[], 120);
    std::thread::sleep(Duration::from_secs(1));
    w.web
        .scale(c, 9, Timing::default(), &|k| k % nodes)
        .map_err(|e| format!("{e:#}"))?;
    std::thread::sleep(Duration::from_secs(2));
    w.web
        .scale(c, 6, Timing::default(), &|k| k % nodes)
        .map_err(|e| format!("{e:#}"))?;
    std::thread::sleep(Duration::from_secs(1));
    let reports = finish(c, loads);
    zero_failures(phase, &reports)?;
    let added = |r: &ClientReport| r.backends.keys().any(|b| !before.contains(b));
    if reports.iter().any(added) {
        Ok(())
    } else {
        Err(format!("{phase}: no client ever reached an added pod"))
    }
}

/// 3d: externalTrafficPolicy Local behind an outside load balancer that sends only to nodes
/// whose health check node port answers 200, while the pods move between nodes: no request
/// fails.
fn local_policy_behind_a_load_balancer(c: &mut Cluster, phase: &str) -> Result<(), String> {
    const EDGE_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 20);
    const HEALTH: u16 = 30300;
    let nodes = c.nodes.len();
    // Two replicas on the first two nodes; the update moves each to the next node.
    let mut edge = Deployment::create(c, "edge", EDGE_IP, 100, Some(HEALTH), 2, &|k| k)
        .map_err(|e| format!("{e:#}"))?;
    std::thread::sleep(Duration::from_secs(2));
    let pairs: Vec<String> = c
        .nodes
        .iter()
        .map(|n| format!("{0}:30180@{0}:{HEALTH}", n.ipv4))
        .collect();
    let cmd = c.probe_outside();
    let lb = start(
        c,
        "outside",
        cmd,
        &[format!("lb={}", pairs.join(","))],
        Duration::from_secs(120),
    );
    std::thread::sleep(Duration::from_secs(1));
    edge.rolling_update(c, Timing::default(), &|n| (n + 1) % nodes)
        .map_err(|e| format!("{e:#}"))?;
    std::thread::sleep(Duration::from_secs(1));
    let reports = lb.finish(c).map_err(|e| format!("{e:#}"))?;
    zero_failures(phase, &reports)?;
    // The pods moved: the last node served too.
    let last = edge.pods_on(nodes - 1);
    if reports[0].backends.keys().any(|b| last.contains(b)) {
        Ok(())
    } else {
        Err(format!(
            "{phase}: the moved pods {last:?} never answered: {:?}",
            reports[0].backends
        ))
    }
}

/// 3c: the last node is lost with its pods; clients on the other nodes (UDP included) and
/// outside are back to full success within 1 s of the EndpointSlice update.
fn node_lost(c: &mut Cluster, w: &mut Workload, phase: &str) -> Result<(), String> {
    let lost = c.nodes.len() - 1;
    let loads = start_loads(c, &w.clients, &[lost], 120);
    std::thread::sleep(Duration::from_secs(1));
    let updated = w
        .web
        .lose_node(c, lost, Duration::from_millis(500))
        .map_err(|e| format!("{e:#}"))?;
    std::thread::sleep(Duration::from_secs(4));
    let reports = finish(c, loads);
    println!("{phase} (slice updated at {updated}):\n{}", table(&reports));
    let late: Vec<String> = reports
        .iter()
        .filter(|r| r.last_failure_unix_ms.is_some_and(|t| t > updated + 1000))
        .map(|r| {
            format!(
                "{} {}: last failure {} ms after the update ({:?})",
                r.place,
                r.name,
                r.last_failure_unix_ms.unwrap_or(0) - updated,
                r.failures
            )
        })
        .collect();
    if late.is_empty() {
        Ok(())
    } else {
        Err(format!("{phase}: {}", late.join("; ")))
    }
}

/// Runs every phase even when one fails, then fails with all that went wrong.
fn check_all(c: &Cluster, results: Vec<Result<(), String>>) {
    let errors: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    if !errors.is_empty() {
        let logs: Vec<String> = (0..c.nodes.len())
            .map(|i| {
                format!(
                    "--- {} log (tail):\n{}",
                    c.nodes[i].name,
                    tail(&c.daemon_log(i), 20)
                )
            })
            .collect();
        panic!("{}\n{}", errors.join("\n"), logs.join("\n"));
    }
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[test]
fn an_ebpf_cluster_fails_no_request_through_rollouts_upgrades_and_a_lost_node() {
    let _one = ONE_BED_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = cluster("clebpf", &["ebpf", "ebpf", "ebpf"]);
    let mut w = workload(&mut c);
    let results = vec![
        rolling_update(&mut c, &mut w, "3a rolling update, 3 x ebpf"),
        upgrade_node_by_node(&mut c, &w, "3b fastpath upgraded node by node"),
        scale_up_and_down(&mut c, &mut w, "scaled from 6 to 9 and back"),
        local_policy_behind_a_load_balancer(
            &mut c,
            "3d externalTrafficPolicy Local behind a load balancer",
        ),
        node_lost(&mut c, &mut w, "3c a node lost"),
    ];
    check_all(&c, results);
}

#[test]
fn a_mixed_ebpf_and_iptables_cluster_fails_no_request_through_a_rollout_and_upgrades() {
    let _one = ONE_BED_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = cluster("clmixed", &["ebpf", "ebpf", "iptables"]);
    let mut w = workload(&mut c);
    let results = vec![
        rolling_update(&mut c, &mut w, "3a rolling update, ebpf + ebpf + iptables"),
        upgrade_node_by_node(&mut c, &w, "3b upgraded node by node, mixed"),
    ];
    check_all(&c, results);
}

/// An eBPF node run as deploy/ ships it programs each of several back-to-back endpoint
/// changes at once: the shipped config's 1 s minimum sync period (kube-proxy's, for
/// iptables-restore) holds back only the iptables mode. Read from outside the daemon, in the
/// node's pinned maps, as an operator would.
#[test]
fn an_ebpf_node_run_as_shipped_programs_back_to_back_changes_at_once() {
    const SYNC_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 30);
    let _one = ONE_BED_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let c = cluster("clsync", &["ebpf"]);
    let maps = programmed::PinnedMaps::open(&c.nodes[0].pin_dir.join("maps-v1"))
        .expect("the node's pinned maps");
    c.api
        .apply("services", objects::service("sync", SYNC_IP, 200, None));
    let mut took = Vec::new();
    for k in 0..6u8 {
        // An address no pod has: only the maps are looked at.
        let ip = Ipv4Addr::new(198, 18, 20, 10 + k);
        let endpoint = EndpointSpec {
            pod: format!("sync-{k}"),
            ip,
            node: c.nodes[0].name.clone(),
            zone: c.nodes[0].zone.clone(),
            ready: true,
            serving: true,
            terminating: false,
        };
        let written = Instant::now();
        c.api
            .apply("endpointslices", objects::slice("sync", &[endpoint]));
        while !maps.holds(SYNC_IP, 80, ip) {
            assert!(
                written.elapsed() < Duration::from_secs(10),
                "change {k} never reached the maps; log:\n{}",
                tail(&c.daemon_log(0), 20)
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        took.push(written.elapsed());
    }
    println!("each change until the maps held it: {took:?}");
    // The first change may come after a long idle time; the others come right after a sync.
    let mut rest = took[1..].to_vec();
    rest.sort();
    let median = rest[rest.len() / 2];
    assert!(
        median < Duration::from_millis(250),
        "back-to-back changes waited {median:?} (median) for the dataplane: {took:?}"
    );
}
