//! Direct server return in both families, on the test bed: an outside client reaches an
//! external IP on node A (the bed's node namespace), whose only endpoint is pod-b on node
//! B (a peer namespace with its own packet programs, as every node of a DSR cluster has).
//! Node A sends the flow on with the client's address and the frontend in an option; node
//! B turns pod-b's answer into the frontend's and sends it to the client over a link of
//! its own (the bed would route it back through node A otherwise), as a backend's node
//! answers over the network in a cluster.

mod common;
mod nat_common;

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::PathBuf,
};

use common::*;
use nat_common::probe_from;
use proxy_userland::{
    dataplane::{
        Dataplane, Scope,
        bpf::{
            AttachOptions, BpfDataplane, PacketPathConfig,
            lb::{LbConfig, LbMode},
        },
    },
    model::Endpoint,
};
use xtask::{
    probe::Outcome,
    testbed::{PeerNode, Pod, Testbed},
};

const NODE_B: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
const POD_B: Ipv4Addr = Ipv4Addr::new(198, 18, 3, 1);
const NODE_B6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xff, 0, 0, 0, 0, 2);
const POD_B6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 3, 0, 0, 0, 0, 1);
const EXT6: &str = "2001:db8:2::1";

/// The packet programs in `netns` on `devices`, their socket hooks on `cgroup`.
fn attach(cgroup: &std::path::Path, netns: &str, devices: &[&str], mode: LbMode) -> BpfDataplane {
    let opts = AttachOptions {
        packet: Some(PacketPathConfig {
            netns: Some(netns.to_string()),
            devices: devices.iter().map(|d| d.to_string()).collect(),
            node_port_cidrs: vec![],
            xdp: false,
        }),
        lb: LbConfig {
            mode,
            ..LbConfig::default()
        },
        ..Default::default()
    };
    BpfDataplane::attach_with(cgroup, &opts).expect("programs load and attach")
}

/// Node B with pod-b, which answers with the address it saw the client at.
fn node_b(bed: &mut Testbed) -> (PeerNode, Pod) {
    let b = bed
        .add_dual_stack_peer_node("b", NODE_B, Some(NODE_B6))
        .expect("node B");
    let pod = bed
        .add_dual_stack_pod_on(&b, "pod-b", POD_B, Some(POD_B6))
        .expect("pod on node B");
    let args = [
        "--tcp",
        "0.0.0.0:8080",
        "--udp",
        "0.0.0.0:5353",
        "--tcp",
        "[::]:8080",
        "--udp",
        "[::]:5353",
        "--echo-peer",
    ];
    bed.serve(probe(), &pod, &args).expect("pod-b serves");
    (b, pod)
}

#[test]
fn dsr_to_a_pod_on_another_node_keeps_the_client_address_and_answers_from_the_frontend() {
    dsr_to_node_b("dsr4", false);
}

#[test]
fn ipv6_dsr_to_a_pod_on_another_node_keeps_the_client_address_and_answers_from_the_frontend() {
    dsr_to_node_b("dsr6", true);
}

fn dsr_to_node_b(tag: &str, v6: bool) {
    let (mut bed, _pods) = bed_with_pods(tag, 1);
    let ext = bed
        .add_pod("ext", Ipv4Addr::new(198, 18, 2, 1), EXT6.parse().ok())
        .expect("external client namespace");
    let (b, _pod_b) = node_b(&mut bed);
    direct_link(&b, &ext);
    let mut dp_a = attach(
        bed.cgroup_path(),
        bed.node_netns(),
        &[&ext.node_veth, &b.bed_veth],
        LbMode::Dsr,
    );
    // Node B's socket hooks go on a cgroup of their own, with no process in it: only its
    // packet programs matter here, and they need no Service to read an option.
    let cgroup_b: PathBuf = bed.cgroup_root().join("node-b");
    xtask::cgroup::create(&cgroup_b).expect("node B's cgroup");
    let _dp_b = attach(&cgroup_b, &b.netns, &["eth0", B_TO_CLIENT], LbMode::Dsr);

    let external: IpAddr = if v6 {
        "2001:db8:ff01::50".parse().unwrap()
    } else {
        "198.19.1.50".parse().unwrap()
    };
    let mut svc = web_service("web", Ipv4Addr::new(198, 19, 0, 50));
    svc.cluster_ips.push("2001:db8:ff00::50".parse().unwrap());
    svc.external_ips = vec![external];
    let pod_b = if v6 {
        IpAddr::V6(POD_B6)
    } else {
        IpAddr::V4(POD_B)
    };
    let ep = Endpoint {
        ip: pod_b,
        ..ready(POD_B)
    }
    .placed(|at| at.node_name = Some("node-b".into()));
    let report = dp_a.sync(
        &state_of(vec![(svc, Some(web_endpoints(vec![ep])))]),
        &node(),
        Scope::Full,
    );
    assert!(report.failed.is_empty(), "{report:?}");

    let client: IpAddr = if v6 {
        EXT6.parse().unwrap()
    } else {
        ext.ipv4.into()
    };
    let tcp_target = SocketAddr::new(external, 80).to_string();
    let udp_target = SocketAddr::new(external, 53).to_string();
    // The first IPv6 packets wait on neighbour discovery; count from a path that is up.
    assert!(
        eventually(10, || probe_from(&ext.netns, &["tcp", &tcp_target])
            .first()
            .is_some_and(Outcome::is_ok)),
        "{tcp_target} never answered"
    );
    let family = if client.is_ipv4() { "ip" } else { "ip6" };
    let from_b = format!("iifname \"{}\" {family} daddr {client}", b.bed_veth);
    count_forwarded(bed.node_netns(), &from_b);
    let tcp = probe_from(&ext.netns, &["tcp", &tcp_target, "--count", "20"]);
    let udp = probe_from(
        &ext.netns,
        &["udp", &udp_target, "--count", "20", "--fresh-socket"],
    );
    for (what, outcomes, target) in [("tcp", &tcp, &tcp_target), ("udp", &udp, &udp_target)] {
        assert_eq!(outcomes.len(), 20, "{what}: {outcomes:?}");
        for o in outcomes {
            assert!(o.is_ok(), "{what}: {outcomes:?}");
            // pod-b saw the client itself: no SNAT on the way.
            let seen = o.seen_from().and_then(|s| s.parse::<SocketAddr>().ok());
            assert_eq!(seen.map(|s| s.ip()), Some(client), "{what}: {o:?}");
            // The answer came from the frontend: node B turned it back.
            let answered_from = match o {
                Outcome::Ok { peer, from, .. } => from.as_ref().or(peer.as_ref()),
                Outcome::Err { .. } => None,
            };
            assert_eq!(answered_from, Some(target), "{what}: {o:?}");
        }
    }
    // Node A forwarded none of the answers: they went from node B to the client.
    let from_b = forwarded(bed.node_netns());
    assert_eq!(
        from_b, 0,
        "node A forwarded {from_b} packets from node B to the client"
    );
}

/// Node B's end of its own link to the client.
const B_TO_CLIENT: &str = "fpdb";

/// A link from node B to the client (198.18.99.0/30, 2001:db8:99::/64), and node B's
/// route to the client over it. The client keeps reaching the external IP through node A.
fn direct_link(b: &PeerNode, ext: &Pod) {
    let ip = |args: &[&str]| xtask::cmd::ip(args.iter().copied()).expect("ip");
    ip(&[
        "-n",
        &b.netns,
        "link",
        "add",
        B_TO_CLIENT,
        "type",
        "veth",
        "peer",
        "name",
        "fpde",
        "netns",
        &ext.netns,
    ]);
    for (ns, dev, v4, v6) in [
        (&b.netns, B_TO_CLIENT, "198.18.99.1/30", "2001:db8:99::1/64"),
        (&ext.netns, "fpde", "198.18.99.2/30", "2001:db8:99::2/64"),
    ] {
        ip(&["-n", ns, "addr", "add", v4, "dev", dev]);
        ip(&["-n", ns, "-6", "addr", "add", v6, "dev", dev, "nodad"]);
        ip(&["-n", ns, "link", "set", dev, "up"]);
    }
    ip(&[
        "-n",
        &b.netns,
        "route",
        "add",
        &format!("{}/32", ext.ipv4),
        "via",
        "198.18.99.2",
    ]);
    ip(&[
        "-n",
        &b.netns,
        "-6",
        "route",
        "add",
        &format!("{EXT6}/128"),
        "via",
        "2001:db8:99::2",
    ]);
    // The client's answers arrive on a link its route to the external IP does not use.
    for dev in ["all", "fpde"] {
        xtask::netns::sysctl(&ext.netns, &format!("net/ipv4/conf/{dev}/rp_filter"), "0")
            .expect("rp_filter");
    }
}
