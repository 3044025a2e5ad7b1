//! Node ports, external IPs and load-balancer IPs through the eBPF packet path: real tc
//! programs on the test bed's node devices, real packets from a client namespace that
//! stands for another host.

mod common;
mod nat_common;

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    thread,
    time::Duration,
};

use common::*;
use nat_common::*;
use proxy_userland::{
    dataplane::{
        Dataplane, Scope,
        bpf::{AttachOptions, BpfDataplane, PacketPathConfig, loader, maps::PacketFlow},
    },
    model::{Endpoint, Service},
};
use xtask::testbed::{Pod, Testbed};

const NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;

/// The eBPF dataplane with the node-port programs on `devices` of the bed's node namespace.
fn attach(bed: &Testbed, devices: &[&str]) -> BpfDataplane {
    attach_xdp(bed, devices, false)
}

/// As [`attach`], with native XDP ahead of tc where the device allows it.
fn attach_xdp(bed: &Testbed, devices: &[&str], xdp: bool) -> BpfDataplane {
    attach_opts(bed, devices, xdp, None)
}

fn attach_opts(
    bed: &Testbed,
    devices: &[&str],
    xdp: bool,
    pin_dir: Option<&std::path::Path>,
) -> BpfDataplane {
    attach_cidrs(bed, devices, xdp, pin_dir, vec![])
}

/// As [`attach_opts`], with `--nodeport-addresses` CIDRs.
fn attach_cidrs(
    bed: &Testbed,
    devices: &[&str],
    xdp: bool,
    pin_dir: Option<&std::path::Path>,
    node_port_cidrs: Vec<(IpAddr, u8)>,
) -> BpfDataplane {
    let packet = PacketPathConfig {
        netns: Some(bed.node_netns().to_string()),
        devices: devices.iter().map(|d| d.to_string()).collect(),
        node_port_cidrs,
        xdp,
    };
    let opts = AttachOptions {
        packet: Some(packet),
        pin_dir: pin_dir.map(Into::into),
        ..Default::default()
    };
    BpfDataplane::attach_with(bed.cgroup_path(), &opts).expect("programs load and attach")
}

fn on(node: &str, ep: Endpoint) -> Endpoint {
    ep.placed(|at| {
        at.node_name = Some(node.into());
    })
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
    tcp_from_within(client, target, count, 1000)
}

fn tcp_from_within(
    client: &Pod,
    target: &str,
    count: usize,
    timeout_ms: u32,
) -> Vec<xtask::probe::Outcome> {
    probe_from(
        &client.netns,
        &[
            "tcp",
            target,
            "--count",
            &count.to_string(),
            "--timeout-ms",
            &timeout_ms.to_string(),
        ],
    )
}

/// Both of the bed's pods, on this node.
fn local_pods() -> proxy_userland::model::EndpointSet {
    web_endpoints(vec![
        on("node-a", ready(pod_ip(1))),
        on("node-a", ready(pod_ip(2))),
    ])
}

/// Every attempt succeeded, `pods` pods answered, and the client only ever saw `target`.
fn assert_served(attempts: &[xtask::probe::Outcome], target: &str, pods: usize) {
    assert!(attempts.iter().all(|a| a.is_ok()), "{attempts:?}");
    assert_eq!(names(attempts).len(), pods, "{attempts:?}");
    assert!(
        attempts.iter().all(|a| peer(a) == Some(target)),
        "the client only sees {target}: {attempts:?}"
    );
}

/// The pods that answered (by name, also from servers that echo the peer).
fn names(outcomes: &[xtask::probe::Outcome]) -> BTreeSet<String> {
    outcomes
        .iter()
        .filter_map(|o| o.name().map(str::to_string))
        .collect()
}

#[test]
fn node_port_reaches_local_pods_over_tcp_and_udp_and_replies_come_from_the_node() {
    let (mut bed, _pods) = bed_with_echoing_pods("npbasic", 2);
    let ext = external_client(&mut bed);
    let mut dp = attach(&bed, &[&ext.node_veth]);
    let svc = node_port_service("web", WEB_IP, NODE_PORT);
    let report = dp.sync(
        &state_of(vec![(svc.clone(), Some(local_pods()))]),
        &node(),
        Scope::Full,
    );
    assert!(report.failed.is_empty(), "{report:?}");

    let target = node_addr(&bed, NODE_PORT);
    let attempts = tcp_from(&ext, &target, 30);
    assert_served(&attempts, &target, 2);
    // The backends are on this node: no SNAT, the pods see the client itself.
    let client = format!("{}:", ext.ipv4);
    assert!(
        attempts
            .iter()
            .all(|a| a.seen_from().is_some_and(|s| s.starts_with(&client))),
        "{attempts:?}"
    );

    let udp_target = node_addr(&bed, UDP_NODE_PORT);
    let udp = probe_from(
        &ext.netns,
        &[
            "udp",
            &udp_target,
            "--count",
            "10",
            "--timeout-ms",
            "1000",
            "--fresh-socket",
        ],
    );
    for a in &udp {
        assert!(a.is_ok(), "{a:?}");
        assert_eq!(
            from(a),
            Some(udp_target.as_str()),
            "reply from the node port: {a:?}"
        );
    }
    // Every flow the pods saw was a new one in the programs' counters. Two fresh UDP
    // sockets may draw the same port (one flow, as for conntrack: about one run in 600;
    // it failed a full suite once), so the flows are counted as the pods saw them.
    let flows = |outcomes: &[xtask::probe::Outcome]| {
        outcomes
            .iter()
            .filter_map(|a| a.seen_from())
            .collect::<BTreeSet<_>>()
            .len() as u64
    };
    assert_eq!(
        flows(&attempts),
        30,
        "each connection its own port: {attempts:?}"
    );
    let stats = dp.programmer().maps().packet_stats();
    assert!(
        stats.new_flows >= 30 + flows(&udp),
        "{stats:?}, UDP flows {}",
        flows(&udp)
    );

    // A port nobody serves is left to the node's stack, which refuses it.
    let other = tcp_from(&ext, &node_addr(&bed, 30999), 1);
    assert_eq!(other[0].errno(), Some("ECONNREFUSED"), "{other:?}");

    // The node gets another address: from the next full sync on, node ports answer there.
    xtask::cmd::ip([
        "-n",
        bed.node_netns(),
        "addr",
        "add",
        "198.18.0.5/32",
        "dev",
        &ext.node_veth,
    ])
    .expect("second address");
    dp.sync(
        &state_of(vec![(svc, Some(local_pods()))]),
        &node(),
        Scope::Full,
    );
    let attempts = tcp_from(&ext, &format!("198.18.0.5:{NODE_PORT}"), 5);
    assert!(attempts.iter().all(|a| a.is_ok()), "{attempts:?}");
}

/// The outside client's IPv6 address, beside its IPv4 one (see `external_client`).
const EXT6: &str = "2001:db8:2::1";

/// `--nodeport-addresses` with IPv4 CIDRs only: the IPv6 node ports still answer, on
/// every IPv6 address of the node, as kube-proxy's NewNodePortAddresses decides (a family
/// without CIDRs is all of its addresses).
#[test]
fn nodeport_addresses_of_one_family_leave_the_other_on_every_address() {
    let (mut bed, _pods) = bed_with_dual_stack_pods("npfam", 1, &[]);
    let ext = bed
        .add_pod("ext", Ipv4Addr::new(198, 18, 2, 1), EXT6.parse().ok())
        .expect("external client namespace");
    let v4_only = vec![(IpAddr::V4(bed.node_ipv4()), 32)];
    let mut dp = attach_cidrs(&bed, &[&ext.node_veth], false, None, v4_only);
    let mut svc = node_port_service("web", WEB_IP, NODE_PORT);
    svc.cluster_ips.push("2001:db8:ff00::10".parse().unwrap());
    let eps = web_endpoints(
        [ready(pod_ip(1)), ready6(1)]
            .into_iter()
            .map(|e| on("node-a", e))
            .collect(),
    );
    let report = dp.sync(&state_of(vec![(svc, Some(eps))]), &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");
    let v6 = format!("[{}]:{NODE_PORT}", bed.node_ipv6());
    assert!(
        eventually(10, || tcp_from(&ext, &v6, 1)[0].is_ok()),
        "the IPv6 node port never answered with IPv4-only --nodeport-addresses"
    );
    let v4 = format!("{}:{NODE_PORT}", bed.node_ipv4());
    assert!(tcp_from(&ext, &v4, 3).iter().all(|o| o.is_ok()));
}

/// A dual-stack Service's node ports answer on the node's IPv6 address as on its IPv4
/// one, each family served by the pods' addresses of that family, without SNAT for local
/// pods, and the replies come from the node port.
/// Both families' node ports, to pods on this node. The client and the pods send full
/// checksums, which the receivers verify after our programs rewrote the packets.
#[test]
fn dual_stack_node_port_reaches_local_pods_over_both_families() {
    let (mut bed, pods) = bed_with_dual_stack_pods("npdual", 2, &["--echo-peer"]);
    let ext = bed
        .add_pod("ext", Ipv4Addr::new(198, 18, 2, 1), EXT6.parse().ok())
        .expect("external client namespace");
    for p in pods.iter().chain([&ext]) {
        send_full_checksums(p);
    }
    let mut dp = attach(&bed, &[&ext.node_veth]);
    let mut svc = node_port_service("web", WEB_IP, NODE_PORT);
    svc.cluster_ips.push("2001:db8:ff00::10".parse().unwrap());
    let eps = web_endpoints(
        [ready(pod_ip(1)), ready(pod_ip(2)), ready6(1), ready6(2)]
            .into_iter()
            .map(|e| on("node-a", e))
            .collect(),
    );
    let report = dp.sync(&state_of(vec![(svc, Some(eps))]), &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");

    let node6 = format!("[{}]", bed.node_ipv6());
    // The first IPv6 packets wait on neighbour discovery; count from a path that is up.
    let v6_once = format!("{node6}:{NODE_PORT}");
    assert!(
        eventually(10, || tcp_from(&ext, &v6_once, 1)[0].is_ok()),
        "the IPv6 node port never answered"
    );
    for (node_ip, client) in [
        (bed.node_ipv4().to_string(), ext.ipv4.to_string()),
        (node6, format!("[{EXT6}]")),
    ] {
        let target = format!("{node_ip}:{NODE_PORT}");
        let attempts = tcp_from(&ext, &target, 20);
        assert_served(&attempts, &target, 2);
        assert!(
            attempts.iter().all(|a| a
                .seen_from()
                .is_some_and(|s| s.starts_with(&format!("{client}:")))),
            "the pods see the client itself: {attempts:?}"
        );
        let udp_target = format!("{node_ip}:{UDP_NODE_PORT}");
        // 20, not 10: both pods must answer, and 10 fresh flows all landed on one pod in a
        // CI run (1 in 512 per family).
        let udp = probe_from(
            &ext.netns,
            &[
                "udp",
                &udp_target,
                "--count",
                "20",
                "--timeout-ms",
                "1000",
                "--fresh-socket",
            ],
        );
        assert!(
            udp.iter().all(|a| from(a) == Some(udp_target.as_str())),
            "replies from the node port: {udp:?}"
        );
        assert_eq!(names(&udp).len(), 2, "{udp:?}");
    }
    let flows = dp.programmer().maps().packet_flows();
    assert!(
        flows
            .iter()
            .any(|f| f.backend.ip() == IpAddr::V6(pod_ip6(1)))
            && flows
                .iter()
                .all(|f| f.client.ip().is_ipv4() == f.backend.ip().is_ipv4()),
        "{flows:?}"
    );
}

#[test]
fn local_policy_uses_only_this_nodes_endpoints_and_drops_without_one() {
    let (mut bed, _pods) = bed_with_echoing_pods("nplocal", 2);
    let ext = external_client(&mut bed);
    let mut dp = attach(&bed, &[&ext.node_veth]);
    let mut local = node_port_service("local", WEB_IP, NODE_PORT);
    local.external_policy_local = true;
    let mut elsewhere = node_port_service("elsewhere", Ipv4Addr::new(198, 19, 0, 12), 30180);
    elsewhere.external_policy_local = true;
    // pod-1 runs on this node, pod-2 on another.
    let eps = || {
        web_endpoints(vec![
            on("node-a", ready(pod_ip(1))),
            on("node-b", ready(pod_ip(2))),
        ])
    };
    let remote_only = web_endpoints(vec![on("node-b", ready(pod_ip(2)))]);
    let state = state_of(vec![(local, Some(eps())), (elsewhere, Some(remote_only))]);
    let report = dp.sync(&state, &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");

    let attempts = tcp_from(&ext, &node_addr(&bed, NODE_PORT), 20);
    assert!(
        attempts.iter().all(|a| a.name() == Some("pod-1")),
        "{attempts:?}"
    );
    // The pod sees the client's own address: no SNAT under the Local policy.
    let client = format!("{}:", ext.ipv4);
    assert!(
        attempts
            .iter()
            .all(|a| a.seen_from().is_some_and(|s| s.starts_with(&client))),
        "{attempts:?}"
    );

    // No endpoint here: dropped (kube-proxy drops too, so a load balancer's health check
    // steers clients to nodes that have one), and counted.
    let before = dp.programmer().maps().packet_stats().dropped_no_backend;
    let attempts = tcp_from(&ext, &node_addr(&bed, 30180), 2);
    assert!(attempts.iter().all(|a| !a.is_ok()), "{attempts:?}");
    assert!(dp.programmer().maps().packet_stats().dropped_no_backend > before);
}

#[test]
fn external_and_load_balancer_ips_serve_and_source_ranges_keep_others_out() {
    external_and_lb_ips_serve("npextlb", false);
}

/// The same with the Service dual-stack and its external and load-balancer IPs IPv6.
#[test]
fn ipv6_external_and_load_balancer_ips_serve_and_source_ranges_keep_others_out() {
    external_and_lb_ips_serve("npextlb6", true);
}

/// An external IP serves every client; a load-balancer IP only those in its
/// loadBalancerSourceRanges. `v6`: the addresses (clients' included) are IPv6.
fn external_and_lb_ips_serve(tag: &str, v6: bool) {
    let (mut bed, _pods) = bed_with_dual_stack_pods(tag, 2, &[]);
    let ip = |v4: &str, v6_ip: &str| -> IpAddr { if v6 { v6_ip } else { v4 }.parse().unwrap() };
    let ext = bed
        .add_pod("ext", Ipv4Addr::new(198, 18, 2, 1), EXT6.parse().ok())
        .expect("external client namespace");
    // A second outside client, in a range the load balancer does not allow.
    let stranger = bed
        .add_pod(
            "stranger",
            Ipv4Addr::new(198, 18, 4, 1),
            "2001:db8:4::1".parse().ok(),
        )
        .expect("client");
    let mut dp = attach(&bed, &[&ext.node_veth, &stranger.node_veth]);
    let mut svc = web_service("web", WEB_IP);
    svc.cluster_ips.push("2001:db8:ff00::10".parse().unwrap());
    svc.external_ips = vec![ip("198.19.1.1", "2001:db8:ff01::1")];
    svc.load_balancer_ips = vec![ip("198.19.1.2", "2001:db8:ff01::2")];
    let (range, len) = if v6 {
        ("2001:db8:2::", 48)
    } else {
        ("198.18.2.0", 24)
    };
    svc.load_balancer_source_ranges = vec![(range.parse().unwrap(), len)];
    let eps = [ready(pod_ip(1)), ready(pod_ip(2)), ready6(1), ready6(2)];
    let eps = web_endpoints(eps.into_iter().map(|e| on("node-a", e)).collect());
    let report = dp.sync(&state_of(vec![(svc, Some(eps))]), &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");

    let external = SocketAddr::new(ip("198.19.1.1", "2001:db8:ff01::1"), 80).to_string();
    let lb = SocketAddr::new(ip("198.19.1.2", "2001:db8:ff01::2"), 80).to_string();
    for client in [&ext, &stranger] {
        // The first IPv6 packets wait on neighbour discovery; count from a path that is up.
        assert!(
            !v6 || eventually(10, || tcp_from(client, &external, 1)[0].is_ok()),
            "the IPv6 external IP never answered"
        );
        let attempts = tcp_from(client, &external, 10);
        assert!(
            attempts.iter().all(|a| a.is_ok()),
            "external IP serves everyone: {attempts:?}"
        );
        assert!(
            attempts.iter().all(|a| peer(a) == Some(external.as_str())),
            "{attempts:?}"
        );
    }
    let attempts = tcp_from(&ext, &lb, 20);
    assert!(attempts.iter().all(|a| a.is_ok()), "{attempts:?}");
    assert_eq!(names(&attempts).len(), 2, "{attempts:?}");

    let before = dp.programmer().maps().packet_stats().dropped_source_range;
    let attempts = tcp_from(&stranger, &lb, 2);
    assert!(
        attempts.iter().all(|a| !a.is_ok()),
        "outside loadBalancerSourceRanges: {attempts:?}"
    );
    assert!(dp.programmer().maps().packet_stats().dropped_source_range > before);
}

#[test]
fn client_ip_affinity_holds_for_traffic_from_outside() {
    let (mut bed, _pods) = bed_with_dual_stack_pods("npaff", 3, &[]);
    let ext = bed
        .add_pod("ext", Ipv4Addr::new(198, 18, 2, 1), EXT6.parse().ok())
        .expect("external client namespace");
    let mut dp = attach(&bed, &[&ext.node_veth]);
    let mut svc = node_port_service("web", WEB_IP, NODE_PORT);
    svc.cluster_ips.push("2001:db8:ff00::10".parse().unwrap());
    svc.affinity_timeout = Some(600);
    let eps = (1..=3).flat_map(|i| [ready(pod_ip(i)), ready6(i)]);
    let eps = web_endpoints(eps.map(|e| on("node-a", e)).collect());
    dp.sync(&state_of(vec![(svc, Some(eps))]), &node(), Scope::Full);

    // Each family on its own: the IPv6 client (its address folded into the key) too.
    for node_ip in [IpAddr::V4(bed.node_ipv4()), IpAddr::V6(bed.node_ipv6())] {
        let target = SocketAddr::new(node_ip, NODE_PORT).to_string();
        // The first IPv6 packets wait on neighbour discovery; count from a path that is up.
        assert!(
            eventually(10, || tcp_from(&ext, &target, 1)[0].is_ok()),
            "{target} never answered"
        );
        let attempts = tcp_from(&ext, &target, 20);
        assert!(attempts.iter().all(|a| a.is_ok()), "{attempts:?}");
        assert_eq!(
            names(&attempts).len(),
            1,
            "one client, one backend: {attempts:?}"
        );
    }
}

/// The client's backend leaves the service but stays another's (so its id still leads
/// somewhere): new flows from the client must go elsewhere, and stick there.
#[test]
fn client_ip_affinity_from_outside_lets_go_of_a_backend_that_left() {
    let (mut bed, _pods) = bed_with_pods("npaffgo", 3);
    let ext = external_client(&mut bed);
    let mut dp = attach(&bed, &[&ext.node_veth]);
    let mut svc = node_port_service("web", WEB_IP, NODE_PORT);
    svc.affinity_timeout = Some(600);
    let other = web_service("other", Ipv4Addr::new(198, 19, 0, 20));
    let all: Vec<_> = (1..=3).map(|i| on("node-a", ready(pod_ip(i)))).collect();
    let sync = |dp: &mut BpfDataplane, eps: &[Endpoint]| {
        let report = dp.sync(
            &state_of(vec![
                (svc.clone(), Some(web_endpoints(eps.to_vec()))),
                (other.clone(), Some(web_endpoints(all.clone()))),
            ]),
            &node(),
            Scope::Full,
        );
        assert!(report.failed.is_empty(), "{report:?}");
    };
    sync(&mut dp, &all);
    let target = node_addr(&bed, NODE_PORT);
    let first = tcp_from(&ext, &target, 10);
    assert!(first.iter().all(|a| a.is_ok()), "{first:?}");
    let stuck = names(&first);
    assert_eq!(stuck.len(), 1, "one client, one backend: {first:?}");
    let pod = stuck.into_iter().next().unwrap();

    let rest = without_pod(&all, &pod);
    sync(&mut dp, &rest);
    let after = tcp_from(&ext, &target, 10);
    assert!(after.iter().all(|a| a.is_ok()), "{after:?}");
    let moved = names(&after);
    assert!(!moved.contains(&pod), "still sent to the removed {pod}");
    assert_eq!(moved.len(), 1, "and sticks again: {after:?}");
}

#[test]
fn a_connected_udp_client_of_a_removed_backend_moves_to_a_live_one() {
    let (mut bed, _pods) = bed_with_pods("npudpgo", 2);
    let ext = external_client(&mut bed);
    let mut dp = attach(&bed, &[&ext.node_veth]);
    let svc = node_port_service("web", WEB_IP, NODE_PORT);
    let both = local_pods();
    dp.sync(
        &state_of(vec![(svc.clone(), Some(both))]),
        &node(),
        Scope::Full,
    );

    // One socket, one flow, a datagram every 100 ms for 3 s, like a statsd client.
    let target = node_addr(&bed, UDP_NODE_PORT);
    let netns = ext.netns.clone();
    let client = thread::spawn(move || {
        probe_from(
            &netns,
            &[
                "udp",
                &target,
                "--connected",
                "--count",
                "30",
                "--interval-ms",
                "100",
                "--timeout-ms",
                "500",
            ],
        )
    });
    thread::sleep(Duration::from_millis(800));
    // Remove whichever pod the flow went to: the flow table says.
    let first = dp
        .programmer()
        .maps()
        .packet_flows()
        .into_iter()
        .next()
        .expect("a flow");
    let gone = if first.backend.ip() == IpAddr::V4(pod_ip(1)) {
        1
    } else {
        2
    };
    let stay = 3 - gone;
    let changed = BTreeSet::from([svc.key.clone()]);
    let one = web_endpoints(vec![on("node-a", ready(pod_ip(stay)))]);
    let report = dp.sync(
        &state_of(vec![(svc, Some(one))]),
        &node(),
        Scope::Changed(&changed),
    );
    assert!(report.failed.is_empty(), "{report:?}");

    let attempts = client.join().expect("client thread");
    assert_eq!(attempts.len(), 30);
    let last = &attempts[20..];
    assert!(
        last.iter()
            .all(|a| a.reply() == Some(format!("pod-{stay}").as_str())),
        "after the removal the same socket is served by pod-{stay}: {attempts:?}"
    );
    let lost = attempts.iter().filter(|a| !a.is_ok()).count();
    assert!(
        lost <= 1,
        "at most the datagram in flight is lost: {attempts:?}"
    );
}

#[test]
fn native_xdp_serves_node_ports_on_veth_ahead_of_tc() {
    let (mut bed, _pods) = bed_with_pods("npxdp", 2);
    let ext = external_client(&mut bed);
    // The loopback device has no native XDP: it keeps tc alone, and nothing fails.
    let mut dp = attach_xdp(&bed, &[&ext.node_veth, "lo"], true);
    let devices = &dp.node_devices().expect("packet path attached").devices;
    let xdp: Vec<(&str, bool)> = devices.iter().map(|d| (d.name.as_str(), d.xdp)).collect();
    assert_eq!(
        xdp,
        [(ext.node_veth.as_str(), true), ("lo", false)],
        "veth runs native XDP, lo does not"
    );
    let svc = node_port_service("web", WEB_IP, NODE_PORT);
    dp.sync(
        &state_of(vec![(svc, Some(local_pods()))]),
        &node(),
        Scope::Full,
    );

    assert_xdp_serves(&dp, &ext, bed.node_ipv4().into());
}

/// 30 TCP connections and a UDP socket from `ext` to the node ports on `node_ip` are
/// served by both pods, the client seeing only the node port, and XDP did the work.
fn assert_xdp_serves(dp: &BpfDataplane, ext: &Pod, node_ip: IpAddr) {
    let before = dp.programmer().maps().packet_stats();
    let target = SocketAddr::new(node_ip, NODE_PORT).to_string();
    assert_served(&tcp_from(ext, &target, 30), &target, 2);
    let udp_target = SocketAddr::new(node_ip, UDP_NODE_PORT).to_string();
    let udp = probe_from(
        &ext.netns,
        &["udp", &udp_target, "--count", "5", "--timeout-ms", "1000"],
    );
    assert!(
        udp.iter().all(|a| from(a) == Some(udp_target.as_str())),
        "{udp:?}"
    );
    let stats = dp.programmer().maps().packet_stats();
    let (new_flows, xdp) = (stats.new_flows - before.new_flows, stats.xdp - before.xdp);
    // 30 TCP connections and one UDP socket.
    assert!(
        xdp >= new_flows && new_flows >= 31,
        "XDP did the work: {before:?} -> {stats:?}"
    );
}

/// The IPv6 twin of the test above: a dual-stack Service's IPv6 node port, served by XDP.
#[test]
fn native_xdp_serves_ipv6_node_ports_on_veth_ahead_of_tc() {
    let (mut bed, _pods) = bed_with_dual_stack_pods("npxdp6", 2, &[]);
    let ext = bed
        .add_pod("ext", Ipv4Addr::new(198, 18, 2, 1), EXT6.parse().ok())
        .expect("external client namespace");
    let mut dp = attach_xdp(&bed, &[&ext.node_veth], true);
    let mut svc = node_port_service("web", WEB_IP, NODE_PORT);
    svc.cluster_ips.push("2001:db8:ff00::10".parse().unwrap());
    let eps = web_endpoints(
        [ready6(1), ready6(2)]
            .into_iter()
            .map(|e| on("node-a", e))
            .collect(),
    );
    dp.sync(&state_of(vec![(svc, Some(eps))]), &node(), Scope::Full);

    let node6 = IpAddr::V6(bed.node_ipv6());
    let target = SocketAddr::new(node6, NODE_PORT).to_string();
    // The first IPv6 packets wait on neighbour discovery; count from a path that is up.
    assert!(
        eventually(10, || tcp_from(&ext, &target, 1)[0].is_ok()),
        "the IPv6 node port never answered"
    );
    assert_xdp_serves(&dp, &ext, node6);
}

#[test]
fn pinned_node_port_flows_survive_a_restart_of_the_daemon() {
    let (mut bed, _pods) = bed_with_pods("nppin", 2);
    let ext = external_client(&mut bed);
    let fs = Bpffs::mount(bed.dir());
    let pin = fs.0.join("fastpath");
    let svc = node_port_service("web", WEB_IP, NODE_PORT);
    let eps = || Some(local_pods());
    let mut first = attach_opts(&bed, &[&ext.node_veth], false, Some(&pin));
    first.sync(&state_of(vec![(svc.clone(), eps())]), &node(), Scope::Full);

    // Bounded loops across the restart: new TCP connections every 20 ms, and one UDP flow
    // (one connected socket) every 50 ms.
    let spawn = |args: Vec<String>| {
        let netns = ext.netns.clone();
        thread::spawn(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            probe_from(&netns, &args)
        })
    };
    let to_strings = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let (tcp_target, udp_target) = (node_addr(&bed, NODE_PORT), node_addr(&bed, UDP_NODE_PORT));
    let tcp = spawn(to_strings(&[
        "tcp",
        &tcp_target,
        "--count",
        "100",
        "--interval-ms",
        "20",
        "--timeout-ms",
        "1000",
    ]));
    let udp = spawn(to_strings(&[
        "udp",
        &udp_target,
        "--connected",
        "--count",
        "40",
        "--interval-ms",
        "50",
        "--timeout-ms",
        "1000",
    ]));
    thread::sleep(Duration::from_millis(400));
    drop(first); // the daemon exits; its pinned links keep translating...
    thread::sleep(Duration::from_millis(600));
    let mut second = attach_opts(&bed, &[&ext.node_veth], false, Some(&pin)); // ...until the next one
    let report = second.sync(&state_of(vec![(svc, eps())]), &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");
    assert_eq!(report.frontends_written, 0, "adopted as it was");

    let tcp = tcp.join().expect("tcp client");
    let failed: Vec<_> = tcp.iter().filter(|a| !a.is_ok()).collect();
    assert!(
        failed.is_empty(),
        "{} of 100 connections failed: {failed:?}",
        failed.len()
    );
    let udp = udp.join().expect("udp client");
    assert!(udp.iter().all(|a| a.is_ok()), "{udp:?}");
    assert_eq!(
        names(&udp).len(),
        1,
        "the pinned flow table kept the UDP flow on its backend: {udp:?}"
    );
    loader::remove_pinned(&pin).unwrap();
}

/// A second node ("node B", 198.18.0.2) joined to the bed's node (A), with one pod
/// (198.18.3.1) behind it that answers with the address it saw; A's end of the link is the
/// returned device name.
fn add_node_b(bed: &mut Testbed) -> String {
    add_node_b_for(bed, false)
}

/// As [`add_node_b`]; `dual`: node B and its pod also at [`NODE_B6`] and [`POD_B6`].
fn add_node_b_for(bed: &mut Testbed, dual: bool) -> String {
    let b = bed
        .add_dual_stack_peer_node("b", NODE_B, dual.then_some(NODE_B6))
        .expect("node B");
    let pod = bed
        .add_dual_stack_pod_on(&b, "pod-b", POD_B, dual.then_some(POD_B6))
        .expect("pod on node B");
    let mut args = vec![
        "--tcp",
        "0.0.0.0:8080",
        "--udp",
        "0.0.0.0:5353",
        "--echo-peer",
    ];
    if dual {
        args.extend(["--tcp", "[::]:8080", "--udp", "[::]:5353"]);
    }
    bed.serve(probe(), &pod, &args).expect("pod-b serves");
    // Its answers come back through our programs' double rewrite: checked in full.
    send_full_checksums(&pod);
    b.bed_veth
}

const NODE_B: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
const POD_B: Ipv4Addr = Ipv4Addr::new(198, 18, 3, 1);
const NODE_B6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xff, 0, 0, 0, 0, 2);
const POD_B6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 3, 0, 0, 0, 0, 1);

#[test]
fn node_port_on_node_a_reaches_a_pod_on_node_b_through_snat() {
    reaches_a_pod_on_node_b_through_snat("nptwo", false);
}

/// The same over IPv6: a dual-stack Service, the client at node A's IPv6 node port, pod-b
/// seeing node A's IPv6 address.
#[test]
fn ipv6_node_port_on_node_a_reaches_a_pod_on_node_b_through_snat() {
    reaches_a_pod_on_node_b_through_snat("nptwo6", true);
}

/// A client outside reaches node A's node port (its IPv6 one with `v6`, the Service then
/// dual-stack); the only endpoint, pod-b, is on node B (Cluster policy). The client and
/// pod-b send full checksums, which the receivers verify after both addresses and both
/// ports were rewritten.
fn reaches_a_pod_on_node_b_through_snat(tag: &str, v6: bool) {
    let (mut bed, _pods) = bed_with_pods(tag, 1);
    let ext = bed
        .add_pod("ext", Ipv4Addr::new(198, 18, 2, 1), EXT6.parse().ok())
        .expect("external client namespace");
    send_full_checksums(&ext);
    let link = add_node_b_for(&mut bed, v6);
    let mut dp = attach(&bed, &[&ext.node_veth, &link]);
    let mut svc = node_port_service("web", WEB_IP, NODE_PORT);
    let mut eps = vec![on("node-b", ready(POD_B))];
    let (node_a, pod_b) = if v6 {
        svc.cluster_ips.push("2001:db8:ff00::10".parse().unwrap());
        let pod_b6 = Endpoint {
            ip: IpAddr::V6(POD_B6),
            ..ready(POD_B)
        };
        eps.push(on("node-b", pod_b6));
        (IpAddr::V6(bed.node_ipv6()), IpAddr::V6(POD_B6))
    } else {
        (IpAddr::V4(bed.node_ipv4()), IpAddr::V4(POD_B))
    };
    let report = dp.sync(
        &state_of(vec![(svc, Some(web_endpoints(eps)))]),
        &node(),
        Scope::Full,
    );
    assert!(report.failed.is_empty(), "{report:?}");

    let node_at = |port| SocketAddr::new(node_a, port).to_string();
    let target = node_at(NODE_PORT);
    // The first IPv6 packets wait on neighbour discovery; count from a path that is up.
    assert!(
        !v6 || eventually(10, || tcp_from(&ext, &target, 1)[0].is_ok()),
        "the IPv6 node port never answered"
    );
    let attempts = tcp_from(&ext, &target, 20);
    assert!(
        attempts.iter().all(|a| a.name() == Some("pod-b")),
        "{attempts:?}"
    );
    assert!(
        attempts.iter().all(|a| peer(a) == Some(target.as_str())),
        "{attempts:?}"
    );
    // pod-b saw node A's address (SNAT), so its replies came back through A.
    let seen = match node_a {
        IpAddr::V4(a) => format!("{a}:"),
        IpAddr::V6(a) => format!("[{a}]:"),
    };
    assert!(
        attempts
            .iter()
            .all(|a| a.seen_from().is_some_and(|s| s.starts_with(&seen))),
        "{attempts:?}"
    );
    let udp_target = node_at(UDP_NODE_PORT);
    let udp = probe_from(
        &ext.netns,
        &[
            "udp",
            &udp_target,
            "--count",
            "5",
            "--timeout-ms",
            "1000",
            "--fresh-socket",
        ],
    );
    for a in &udp {
        assert_eq!(
            (a.name(), from(a)),
            (Some("pod-b"), Some(udp_target.as_str())),
            "{a:?}"
        );
    }
    // Every flow went to pod-b with this node's address as its source, so the replies came
    // back here to be translated.
    // The TCP connections have ended: their SNAT ports go back to the pool within seconds,
    // so many short connections cannot use them all up. (A closing packet is seen on the
    // node's softirq after the client returns: give the last one a moment.)
    let all_closing = |flows: &[PacketFlow]| {
        let tcp_flows = flows.iter().filter(|f| f.frontend.port() == NODE_PORT);
        tcp_flows.clone().count() >= 20 && tcp_flows.clone().all(|f| f.closing)
    };
    eventually(2, || all_closing(&dp.programmer().maps().packet_flows()));
    let flows = dp.programmer().maps().packet_flows();
    assert!(flows.len() >= 25, "{flows:?}");
    assert!(all_closing(&flows), "{flows:?}");
    assert!(
        flows
            .iter()
            .all(|f| f.backend.ip() == pod_b && f.snat.map(|s| s.ip()) == Some(node_a)),
        "{flows:?}"
    );
}

/// XDP cannot hand a packet to another node's veth (the receiving side would need XDP too),
/// so flows that leave the node again are left to tc, and still work.
#[test]
fn with_xdp_a_pod_on_another_node_is_still_reached_through_tc() {
    let (mut bed, _pods) = bed_with_pods("npxdptwo", 1);
    let ext = external_client(&mut bed);
    let link = add_node_b(&mut bed);
    let mut dp = attach_xdp(&bed, &[&ext.node_veth, &link], true);
    let svc = node_port_service("web", WEB_IP, NODE_PORT);
    let eps = web_endpoints(vec![on("node-b", ready(POD_B))]);
    dp.sync(&state_of(vec![(svc, Some(eps))]), &node(), Scope::Full);
    let target = node_addr(&bed, NODE_PORT);
    // 3 s lets a connection survive one lost SYN (the kernel resends it after 1 s), which a
    // loaded CI machine's veths occasionally cause; a drop of ours is caught by the counters.
    let attempts = tcp_from_within(&ext, &target, 20, 3000);
    let stats = dp.programmer().maps().packet_stats();
    assert!(
        attempts.iter().all(|a| a.name() == Some("pod-b")),
        "{attempts:?} {stats:?}"
    );
    let dropped = stats.dropped_no_backend + stats.dropped_source_range + stats.dropped_nat;
    assert_eq!(dropped, 0, "{stats:?}");
    assert_eq!(stats.xdp, 0, "XDP left these flows to tc: {stats:?}");
}

#[test]
fn the_node_itself_reaches_its_node_ports_on_cluster_endpoints() {
    let (mut bed, _pods) = bed_with_dual_stack_pods("npself", 2, &[]);
    let ext = external_client(&mut bed);
    let mut dp = attach(&bed, &[&ext.node_veth]);
    // Local policy, and pod-2 runs elsewhere: from the node itself every endpoint serves, as
    // with kube-proxy. Dual-stack: the node's IPv6 address too.
    let mut svc = node_port_service("web", WEB_IP, NODE_PORT);
    svc.cluster_ips.push("2001:db8:ff00::10".parse().unwrap());
    svc.external_policy_local = true;
    let eps = web_endpoints(vec![
        on("node-a", ready(pod_ip(1))),
        on("node-b", ready(pod_ip(2))),
        on("node-a", ready6(1)),
        on("node-b", ready6(2)),
    ]);
    dp.sync(&state_of(vec![(svc, Some(eps))]), &node(), Scope::Full);

    for node_ip in [IpAddr::V4(bed.node_ipv4()), IpAddr::V6(bed.node_ipv6())] {
        let target = SocketAddr::new(node_ip, NODE_PORT).to_string();
        // The first IPv6 packets wait on neighbour discovery; count from a path that is up.
        assert!(
            eventually(10, || tcp(&bed, &target, 1)[0].is_ok()),
            "{target} never answered"
        );
        assert_served(&tcp(&bed, &target, 30), &target, 2);
    }
}
