//! The packet path's load-balancing across nodes, on the cluster bed (see
//! xtask/src/cluster): three nodes, one daemon each, run as deploy/ ships it with Maglev as
//! the default algorithm. The fabric is the outside "ECMP router": it routes a Service's
//! external IP to one node, then to another, as a router rehashing its next hops does.
//!
//! A flow is one UDP client port of the outside client; which backend answered is its
//! reply. A node sees a flow it never saw before, so its choice is the algorithm's alone.

mod common;

use std::{collections::BTreeMap, net::Ipv4Addr, path::Path, time::Duration};

use common::{FASTPATH, PROBE};
use serde_json::json;
use xtask::{
    cluster::{
        Cluster, ClusterOptions, Shipped,
        controller::{Deployment, Timing},
        objects,
    },
    cmd::ip,
    probe::parse_line,
};

const WEB_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 40);
const WEB_EXTERNAL: Ipv4Addr = Ipv4Addr::new(198, 19, 1, 40);
const RND_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 41);
const RND_EXTERNAL: Ipv4Addr = Ipv4Addr::new(198, 19, 1, 41);
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
    ip: Ipv4Addr,
    external: Ipv4Addr,
    shift: u16,
    annotations: serde_json::Value,
) -> Deployment {
    let nodes = c.nodes.len();
    let d = Deployment::create(c, name, ip, shift, None, 6, &|k| k % nodes).expect(name);
    let mut svc = objects::service(name, ip, shift, None);
    svc["metadata"]["annotations"] = annotations;
    svc["spec"]["externalIPs"] = json!([external.to_string()]);
    c.api.apply("services", svc);
    d
}

/// The fabric sends traffic for `external` to node `i`.
fn route_to(c: &Cluster, external: Ipv4Addr, i: usize) {
    let via = c.nodes[i].ipv4.to_string();
    let dst = format!("{external}/32");
    ip([
        "-n",
        c.bed.node_netns(),
        "route",
        "replace",
        &dst,
        "via",
        &via,
    ])
    .expect("route");
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

#[test]
fn maglev_gives_a_flow_the_same_backend_on_every_node_and_a_backend_change_moves_few() {
    let mut c = cluster("clmaglev", &["--bpf-lb-algorithm=maglev"]);
    let mut web = deployment(&mut c, "web", WEB_IP, WEB_EXTERNAL, 0, json!({}));
    // Opted out by annotation: the kube-proxy spread, for comparison.
    let opt_out = json!({"service.cilium.io/lb-algorithm": "random"});
    let _rnd = deployment(&mut c, "rnd", RND_IP, RND_EXTERNAL, 300, opt_out);
    // Every node hears of the pods and the external IPs.
    std::thread::sleep(Duration::from_secs(2));

    let web_1 = flows_through(&c, WEB_EXTERNAL, 0, 40_000);
    let web_2 = flows_through(&c, WEB_EXTERNAL, 1, 40_000);
    let rnd_1 = flows_through(&c, RND_EXTERNAL, 0, 41_000);
    let rnd_2 = flows_through(&c, RND_EXTERNAL, 1, 41_000);
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
    web.scale(&mut c, 5, Timing::default(), &|k| k % nodes)
        .expect("scale to 5");
    std::thread::sleep(Duration::from_secs(1));
    let web_3 = flows_through(&c, WEB_EXTERNAL, 2, 40_000);
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
