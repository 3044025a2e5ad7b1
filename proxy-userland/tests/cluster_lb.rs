//! The packet path's load-balancing across nodes, on the cluster bed (see
//! xtask/src/cluster): three nodes, one daemon each, run as deploy/ ships it with Maglev as
//! the default algorithm, direct server return and host routing. The fabric is the outside "ECMP
//! router": it routes a Service's external IP to one node, then to another, as a router
//! rehashing its next hops does. One bed for the binary; its phases run in order.

mod common;

use std::{collections::BTreeMap, net::Ipv4Addr, path::Path, time::Duration};

use common::{FASTPATH, PROBE, count_forwarded, forwarded};
use serde_json::json;
use xtask::{
    cluster::{
        Cluster, ClusterOptions, Shipped,
        controller::{Deployment, Timing},
        objects,
    },
    probe::parse_line,
};

const WEB_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 40);
const WEB_EXTERNAL: Ipv4Addr = Ipv4Addr::new(198, 19, 1, 40);
const RND_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 41);
const RND_EXTERNAL: Ipv4Addr = Ipv4Addr::new(198, 19, 1, 41);
/// A Service whose pods are all on node-2 and node-3, reached through node-1.
const FAR_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 42);
const FAR_EXTERNAL: Ipv4Addr = Ipv4Addr::new(198, 19, 1, 42);
/// Flows per measurement: one outside client port each.
const FLOWS: u16 = 300;

fn cluster(tag: &str, extra: &[&str]) -> Cluster {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    Cluster::start(
        tag,
        ClusterOptions {
            modes: vec!["ebpf".into(); 3],
            fastpath: FASTPATH.into(),
            probe: PROBE.into(),
            shipped: Shipped::load(&deploy).expect("deploy/ manifests"),
            extra_args: extra.iter().map(|a| a.to_string()).collect(),
        },
    )
    .expect("cluster bed")
}

/// A 6-replica Deployment over the three nodes whose Service also has `external` as an
/// external IP, and `annotations`.
fn deployment(
    c: &mut Cluster,
    name: &str,
    (ip, external): (Ipv4Addr, Ipv4Addr),
    shift: u16,
    annotations: serde_json::Value,
    placement: &dyn Fn(usize) -> usize,
) -> Deployment {
    let d = Deployment::create(c, name, ip, shift, None, 6, placement).expect(name);
    let mut svc = objects::service(name, ip, shift, None);
    svc["metadata"]["annotations"] = annotations;
    svc["spec"]["externalIPs"] = json!([external.to_string()]);
    c.api.apply("services", svc);
    d
}

/// The fabric sends traffic for `external` to node `i`.
fn route_to(c: &Cluster, external: Ipv4Addr, i: usize) {
    c.route_to_node(external, i).expect("route");
}

/// Sends the [`FLOWS`] flows (client ports from `base`) to `external`'s UDP port through
/// node `i`: which backend answered each, by client port.
fn flows_through(c: &Cluster, external: Ipv4Addr, i: usize, base: u16) -> BTreeMap<u16, String> {
    route_to(c, external, i);
    let out = c
        .probe_outside()
        .args([
            "udp",
            &format!("{external}:53"),
            "--fresh-socket",
            "--port-step",
        ])
        .args([
            "--source-port",
            &base.to_string(),
            "--count",
            &FLOWS.to_string(),
        ])
        .args(["--timeout-ms", "1000"])
        .output()
        .expect("probe");
    let lines = String::from_utf8_lossy(&out.stdout);
    let answers: BTreeMap<u16, String> = (base..)
        .zip(lines.lines().filter_map(parse_line))
        .filter_map(|(port, o)| o.name().map(|n| (port, n.to_string())))
        .collect();
    assert_eq!(
        answers.len(),
        usize::from(FLOWS),
        "through {}: only {} of {FLOWS} flows answered:\n{lines}",
        c.nodes[i].name,
        answers.len()
    );
    answers
}

/// Flows whose backend differs between two measurements.
fn moved(a: &BTreeMap<u16, String>, b: &BTreeMap<u16, String>) -> usize {
    a.iter()
        .filter(|(port, name)| b.get(port) != Some(name))
        .count()
}

fn share(n: usize) -> f64 {
    n as f64 / f64::from(FLOWS)
}

/// The bed's workloads: `web` (Maglev, the default) and `rnd` (opted out) with pods on
/// every node; `far` (Maglev) with pods on node-2 and node-3 only.
struct Workloads {
    web: Deployment,
    _rnd: Deployment,
    _far: Deployment,
}

#[test]
fn maglev_and_dsr_across_nodes() {
    let mut c = cluster(
        "clmaglev",
        &[
            "--bpf-lb-algorithm=maglev",
            "--bpf-lb-mode=dsr",
            "--bpf-host-routing",
        ],
    );
    let nodes = c.nodes.len();
    let everywhere = move |k: usize| k % nodes;
    let web = deployment(
        &mut c,
        "web",
        (WEB_IP, WEB_EXTERNAL),
        0,
        json!({}),
        &everywhere,
    );
    // Opted out by annotation: the kube-proxy spread, for comparison.
    let opt_out = json!({"service.cilium.io/lb-algorithm": "random"});
    let rnd = deployment(
        &mut c,
        "rnd",
        (RND_IP, RND_EXTERNAL),
        300,
        opt_out,
        &everywhere,
    );
    let far = deployment(
        &mut c,
        "far",
        (FAR_IP, FAR_EXTERNAL),
        600,
        json!({}),
        &|k| 1 + k % 2,
    );
    // Every node hears of the pods and the external IPs.
    std::thread::sleep(Duration::from_secs(2));
    let mut w = Workloads {
        web,
        _rnd: rnd,
        _far: far,
    };
    let results = vec![
        catch("DSR keeps replies off the entry node", || {
            dsr_replies_skip_the_entry_node(&c)
        }),
        catch("a live TCP connection moved between nodes", || {
            a_moved_connection_keeps_its_backend(&mut c)
        }),
        catch("Maglev across nodes and a backend change", || {
            maglev_agrees_across_nodes_and_moves_few(&mut c, &mut w)
        }),
    ];
    let failed: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    if !failed.is_empty() {
        let logs: Vec<String> = (0..c.nodes.len())
            .map(|i| format!("--- {} log:\n{}", c.nodes[i].name, c.daemon_log(i)))
            .collect();
        panic!("{}\n{}", failed.join("\n"), logs.join("\n"));
    }
}

/// Runs a phase, turning its panic into an error so the next phases still run.
fn catch(phase: &str, f: impl FnOnce()) -> Result<(), String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|e| {
        let msg = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        format!("{phase}: {msg}")
    })
}

/// Point 2: TCP and UDP through node-1 to pods on node-2 and node-3: every request
/// answered, UDP answers come from the service address, and node-1 sent the client
/// nothing (the backends' nodes did).
fn dsr_replies_skip_the_entry_node(c: &Cluster) {
    route_to(c, FAR_EXTERNAL, 0);
    c.count_to_outside().expect("fabric counters");
    let tcp = c
        .probe_outside()
        .args(["tcp", &format!("{FAR_EXTERNAL}:80"), "--count", "50"])
        .output()
        .expect("probe tcp");
    let udp = c
        .probe_outside()
        .args([
            "udp",
            &format!("{FAR_EXTERNAL}:53"),
            "--count",
            "50",
            "--fresh-socket",
        ])
        .output()
        .expect("probe udp");
    let tcp: Vec<_> = String::from_utf8_lossy(&tcp.stdout)
        .lines()
        .filter_map(parse_line)
        .collect();
    let udp: Vec<_> = String::from_utf8_lossy(&udp.stdout)
        .lines()
        .filter_map(parse_line)
        .collect();
    let counts = c.packets_to_outside().expect("fabric counters");
    println!("DSR: packets each node sent the client: {counts:?}");
    assert!(
        tcp.len() == 50 && tcp.iter().all(|o| o.is_ok()),
        "tcp: {tcp:?}"
    );
    assert!(
        udp.len() == 50 && udp.iter().all(|o| o.is_ok()),
        "udp: {udp:?}"
    );
    let service = format!("{FAR_EXTERNAL}:53");
    for o in &udp {
        if let xtask::probe::Outcome::Ok { from, .. } = o {
            assert_eq!(
                from.as_deref(),
                Some(service.as_str()),
                "a UDP answer's source"
            );
        }
    }
    assert_eq!(
        counts[0], 0,
        "the entry node sent the client {} packets",
        counts[0]
    );
    assert!(
        counts[1] > 0 && counts[2] > 0,
        "the backends' nodes answered: {counts:?}"
    );
}

/// Point 1: keep-alive HTTP connections through node-1, moved to node-2 mid-stream.
/// With Maglev (and DSR: the backend sees the client itself on both paths) each keeps
/// its connection and backend; with random choice (the opted-out service) they reset.
fn a_moved_connection_keeps_its_backend(c: &mut Cluster) {
    const CONNECTIONS: usize = 6;
    let mut reports = Vec::new();
    for (external, name) in [(FAR_EXTERNAL, "maglev"), (RND_EXTERNAL, "random")] {
        route_to(c, external, 0);
        let clients = vec![format!("http={external}:81"); CONNECTIONS];
        let cmd = c.probe_outside();
        let load = c
            .start_load(
                name,
                cmd,
                &clients,
                Duration::from_millis(50),
                Duration::from_secs(20),
            )
            .expect("load");
        // Every connection made, and answering, through node-1.
        let began = std::time::Instant::now();
        while !(load.latest().len() == CONNECTIONS && load.latest().iter().all(|r| r.ok >= 5)) {
            assert!(
                began.elapsed() < Duration::from_secs(10),
                "{name}: the clients never got going"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let before = load.latest();
        route_to(c, external, 1);
        std::thread::sleep(Duration::from_secs(2));
        let r = load.finish(c).expect("report");
        println!(
            "{name}, moved from node-1 to node-2:\n{}",
            xtask::cluster::load::table(&r)
        );
        // Requests after the move: more than before it, for every connection.
        for (b, a) in before.iter().zip(&r) {
            assert!(
                a.requests >= b.requests + 10,
                "{name}: too few requests after the move: {b:?} then {a:?}"
            );
        }
        reports.push(r);
    }
    for r in &reports[0] {
        assert!(r.ok > 0 && r.failed() == 0, "maglev: {r:?}");
        assert_eq!(
            r.backends.len(),
            1,
            "maglev: the connection changed backend: {r:?}"
        );
    }
    let broken = reports[1]
        .iter()
        .filter(|r| r.failed() > 0 || r.backends.len() > 1)
        .count();
    assert!(
        broken > 0,
        "random: no connection broke when moved: {:?}",
        reports[1]
    );
}

fn maglev_agrees_across_nodes_and_moves_few(c: &mut Cluster, w: &mut Workloads) {
    // Host routing, under the DaemonSet's capabilities: once node-1 knows its pods'
    // neighbours (other flows first), its stack forwards none of the flows' packets for its
    // own pods (its pod range); tc delivers them.
    flows_through(c, WEB_EXTERNAL, 0, 42_000);
    let node_1 = c.nodes[0].clone();
    let own_pods = format!("iifname \"eth0\" ip daddr {}/24", node_1.pod_gateway());
    count_forwarded(&node_1.netns, &own_pods);
    let web_1 = flows_through(c, WEB_EXTERNAL, 0, 40_000);
    let stack_forwarded = forwarded(&node_1.netns);
    assert_eq!(
        stack_forwarded, 0,
        "node-1's stack forwarded {stack_forwarded} packets to its own pods"
    );
    let web_2 = flows_through(c, WEB_EXTERNAL, 1, 40_000);
    let rnd_1 = flows_through(c, RND_EXTERNAL, 0, 41_000);
    let rnd_2 = flows_through(c, RND_EXTERNAL, 1, 41_000);
    let backends: std::collections::BTreeSet<&String> = web_1.values().collect();
    let (web_moved, rnd_moved) = (moved(&web_1, &web_2), moved(&rnd_1, &rnd_2));
    println!(
        "node-1 then node-2, {FLOWS} flows: maglev {web_moved} changed backend ({} backends \
         used), random {rnd_moved} ({:.0}%)",
        backends.len(),
        100.0 * share(rnd_moved)
    );
    assert_eq!(backends.len(), 6, "maglev spread over {backends:?}");
    assert_eq!(
        web_moved, 0,
        "with Maglev every node picks the flow's backend alike"
    );
    // Random agrees with the first node about 1 time in 6.
    assert!(
        share(rnd_moved) > 0.5,
        "the opted-out service chose alike on two nodes for {} of {FLOWS} flows",
        FLOWS as usize - rnd_moved
    );

    // One of the six backends leaves (scaled to 5, as a rollout's surplus pod goes).
    let nodes = c.nodes.len();
    w.web
        .scale(c, 5, Timing::default(), &|k| k % nodes)
        .expect("scale to 5");
    std::thread::sleep(Duration::from_secs(1));
    let web_3 = flows_through(c, WEB_EXTERNAL, 2, 40_000);
    let left: std::collections::BTreeSet<&String> = web_3.values().collect();
    let gone: Vec<&&String> = backends.difference(&left).collect();
    assert_eq!(gone.len(), 1, "one backend left: {backends:?} -> {left:?}");
    let on_leaver = web_1.values().filter(|n| *n == *gone[0]).count();
    let all_moved = moved(&web_1, &web_3);
    println!(
        "after one of 6 backends left, through node-3: {all_moved} of {FLOWS} flows changed \
         backend ({:.1}%), {on_leaver} of them had the backend that left",
        100.0 * share(all_moved)
    );
    // The leaver's flows must move; of the others, Maglev moves a few percent at most.
    assert!(
        share(all_moved.saturating_sub(on_leaver)) <= 0.05,
        "{} flows of staying backends moved",
        all_moved - on_leaver
    );
    assert!(
        share(all_moved) <= 1.0 / 6.0 + 0.08,
        "{all_moved} of {FLOWS} flows moved: more than about 1/6"
    );
}
