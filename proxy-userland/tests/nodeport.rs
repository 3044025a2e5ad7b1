//! Node ports, external IPs and load-balancer IPs through the eBPF packet path: real tc
//! programs on the test bed's node devices, real packets from a client namespace that
//! stands for another host.

mod common;
mod nat_common;

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use common::*;
use nat_common::*;
use proxy_userland::{
    dataplane::{
        Dataplane, Scope,
        bpf::{BpfDataplane, PacketPathConfig},
    },
    model::{Endpoint, Service},
};
use xtask::testbed::{Pod, Testbed};

const NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;

/// The eBPF dataplane with the node-port programs on `devices` of the bed's node namespace.
fn attach(bed: &Testbed, devices: &[&str]) -> BpfDataplane {
    let packet = PacketPathConfig {
        netns: Some(bed.node_netns().to_string()),
        devices: devices.iter().map(|d| d.to_string()).collect(),
        node_port_cidrs: vec![],
    };
    BpfDataplane::attach_with(bed.cgroup_path(), None, Some(&packet))
        .expect("programs load and attach")
}

fn on(node: &str, ep: Endpoint) -> Endpoint {
    Endpoint { node_name: Some(node.into()), ..ep }
}

/// `demo/<name>` with node ports on both of its ports.
fn node_port_service(name: &str, cluster_ip: Ipv4Addr, base: u16) -> Service {
    let mut svc = web_service(name, cluster_ip);
    svc.ports[0].node_port = Some(base);
    svc.ports[1].node_port = Some(base - 27);
    svc
}

fn node_addr(bed: &Testbed, port: u16) -> String {
    format!("{}:{port}", bed.node_ipv4())
}

fn tcp_from(client: &Pod, target: &str, count: usize) -> Vec<xtask::probe::Outcome> {
    probe_from(&client.netns, &["tcp", target, "--count", &count.to_string(), "--timeout-ms", "1000"])
}

fn names(outcomes: &[xtask::probe::Outcome]) -> BTreeSet<String> {
    outcomes.iter().filter_map(|o| o.reply().map(str::to_string)).collect()
}

#[test]
fn node_port_reaches_local_pods_over_tcp_and_udp_and_replies_come_from_the_node() {
    let (mut bed, _pods) = bed_with_pods("npbasic", 2);
    let ext = external_client(&mut bed);
    let mut dp = attach(&bed, &[&ext.node_veth]);
    let svc = node_port_service("web", WEB_IP, NODE_PORT);
    let eps = web_endpoints(vec![on("node-a", ready(pod_ip(1))), on("node-a", ready(pod_ip(2)))]);
    let report = dp.sync(&state_of(vec![(svc, Some(eps))]), &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");

    let target = node_addr(&bed, NODE_PORT);
    let attempts = tcp_from(&ext, &target, 30);
    assert!(attempts.iter().all(|a| a.is_ok()), "{attempts:?}");
    assert_eq!(names(&attempts).len(), 2, "both pods serve the node port: {attempts:?}");
    assert!(
        attempts.iter().all(|a| peer(a) == Some(target.as_str())),
        "the client talks to the node port, never to a pod: {attempts:?}"
    );

    let udp_target = node_addr(&bed, UDP_NODE_PORT);
    let udp = probe_from(
        &ext.netns,
        &["udp", &udp_target, "--count", "10", "--timeout-ms", "1000", "--fresh-socket"],
    );
    for a in &udp {
        assert!(a.is_ok(), "{a:?}");
        assert_eq!(from(a), Some(udp_target.as_str()), "reply from the node port: {a:?}");
    }
    let stats = dp.programmer().maps().packet_stats();
    assert!(stats.new_flows >= 40, "{stats:?}");

    // A port nobody serves is left to the node's stack, which refuses it.
    let other = tcp_from(&ext, &node_addr(&bed, 30999), 1);
    assert_eq!(other[0].errno(), Some("ECONNREFUSED"), "{other:?}");
}
