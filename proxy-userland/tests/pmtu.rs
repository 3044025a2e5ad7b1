//! Path MTU discovery through node ports: an ICMP "fragmentation needed" (ICMPv6 "packet
//! too big") about a translated packet reaches the client translated back, so its TCP
//! connection shrinks its segments instead of stalling.
//!
//! ```text
//!   ext ── [node A: node port, SNAT] ── [node B] ──(route mtu 1280)── pod-b
//! ```
//! Node B forwards to pod-b over a path narrower than the client's: it answers the
//! client's full-size segments with an error to their source as it sees it, node A's SNAT
//! address, quoting node A's address and SNAT port. Only node A can tell the client.

mod common;
mod nat_common;

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    thread,
    time::{Duration, Instant},
};

use common::*;
use proxy_userland::{
    dataplane::{
        Dataplane, Scope,
        bpf::{AttachOptions, BpfDataplane, PacketPathConfig},
    },
    model::Endpoint,
};
use xtask::{netns::in_netns, testbed::Testbed};

const NODE_PORT: u16 = 30080;
const EXT: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 1);
const EXT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 1);
const NODE_B: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
const NODE_B6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xff, 0, 0, 0, 0, 2);
const POD_B: Ipv4Addr = Ipv4Addr::new(198, 18, 3, 1);
const POD_B6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 3, 0, 0, 0, 0, 1);
/// The narrow path's MTU (IPv6's minimum, so one value serves both families).
const MTU: u32 = 1280;
/// What the client sends: dozens of full-size segments.
const REQUEST: usize = 64 * 1024;
/// Bounds every socket wait: a stalled connection fails the test within this.
const WAIT: Duration = Duration::from_secs(10);

#[test]
fn pmtu_discovery_works_through_a_node_port_to_a_pod_on_another_node() {
    pmtu_through_snat("pmtu4", false);
}

#[test]
fn ipv6_pmtu_discovery_works_through_a_node_port_to_a_pod_on_another_node() {
    pmtu_through_snat("pmtu6", true);
}

fn pmtu_through_snat(tag: &str, v6: bool) {
    let mut bed = Testbed::new(tag).expect("test bed");
    let ext = bed.add_pod("ext", EXT, Some(EXT6)).expect("client");
    let b = bed
        .add_dual_stack_peer_node("b", NODE_B, v6.then_some(NODE_B6))
        .expect("node B");
    let pod = bed
        .add_dual_stack_pod_on(&b, "pod-b", POD_B, v6.then_some(POD_B6))
        .expect("pod on node B");
    // pod-b's own device keeps 1500 (it advertises the usual MSS); node B's route to it is
    // the narrow hop.
    let route = if v6 {
        format!(
            "-n {} -6 route replace {POD_B6}/128 dev {} src {NODE_B6} mtu {MTU}",
            b.netns, pod.node_veth
        )
    } else {
        format!(
            "-n {} route replace {POD_B}/32 dev {} src {NODE_B} mtu {MTU}",
            b.netns, pod.node_veth
        )
    };
    xtask::cmd::ip(route.split_whitespace()).expect("narrow route on node B");

    let packet = PacketPathConfig {
        netns: Some(bed.node_netns().to_string()),
        devices: vec![ext.node_veth.clone(), b.bed_veth.clone()],
        node_port_cidrs: vec![],
        xdp: false,
    };
    let opts = AttachOptions {
        packet: Some(packet),
        ..Default::default()
    };
    let mut dp = BpfDataplane::attach_with(bed.cgroup_path(), &opts).expect("programs attach");
    let mut svc = web_service("web", WEB_IP);
    svc.ports[0].node_port = Some(NODE_PORT);
    let (node_a, pod_ip, any) = if v6 {
        svc.cluster_ips.push("2001:db8:ff00::10".parse().unwrap());
        (IpAddr::V6(bed.node_ipv6()), IpAddr::V6(POD_B6), "[::]:8080")
    } else {
        (
            IpAddr::V4(bed.node_ipv4()),
            IpAddr::V4(POD_B),
            "0.0.0.0:8080",
        )
    };
    let backend = Endpoint {
        ip: pod_ip,
        ..ready(POD_B)
    }
    .placed(|at| {
        at.node_name = Some("node-b".into());
    });
    let eps = web_endpoints(vec![backend]);
    let report = dp.sync(&state_of(vec![(svc, Some(eps))]), &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");

    let listener = in_netns(&pod.netns, || TcpListener::bind(any))
        .expect("pod-b's namespace")
        .expect("pod-b listens");
    let server = thread::spawn(move || receive_and_count(&listener));

    let target = SocketAddr::new(node_a, NODE_PORT);
    let sent = in_netns(&ext.netns, || send(target)).expect("client's namespace");
    let received = server.join().expect("server thread");
    let stats = dp.programmer().maps().packet_stats();
    assert_eq!(
        (sent, received),
        (Ok(REQUEST), Ok(REQUEST)),
        "the client's {REQUEST} bytes arrive through the narrow path: {stats:?}"
    );
    assert!(stats.icmp_translated >= 1, "{stats:?}");
    assert_eq!(stats.icmp_dropped, 0, "{stats:?}");
    // The client learnt the path's MTU, for the node port's address.
    let node_a = node_a.to_string();
    let route = xtask::cmd::ip(["-n", &ext.netns, "route", "get", &node_a]).expect("route get");
    assert!(route.contains(&format!("mtu {MTU}")), "{route}");
}

/// Connects to `target`, sends [`REQUEST`] bytes, and returns how many the server says it
/// received (it answers with the count once the client has finished sending).
fn send(target: SocketAddr) -> Result<usize, String> {
    let mut s = TcpStream::connect_timeout(&target, WAIT).map_err(|e| format!("connect: {e}"))?;
    s.set_write_timeout(Some(WAIT)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(WAIT)).map_err(|e| e.to_string())?;
    s.write_all(&[b'x'; REQUEST])
        .map_err(|e| format!("send: {e}"))?;
    s.shutdown(std::net::Shutdown::Write)
        .map_err(|e| e.to_string())?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)
        .map_err(|e| format!("the server's count: {e}"))?;
    answer
        .trim()
        .parse()
        .map_err(|_| format!("answer {answer:?}"))
}

/// Accepts one connection (within [`WAIT`]), reads it to its end and answers with the
/// number of bytes read.
fn receive_and_count(listener: &TcpListener) -> Result<usize, String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + WAIT;
    let mut conn = loop {
        match listener.accept() {
            Ok((conn, _)) => break conn,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(format!("accept: {e}")),
        }
    };
    conn.set_nonblocking(false).map_err(|e| e.to_string())?;
    conn.set_read_timeout(Some(WAIT))
        .map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 16 * 1024];
    let mut total = 0;
    // Bounded: every read either returns data, the end, or times out.
    loop {
        match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => total += n,
            Err(e) => return Err(format!("after {total} bytes: {e}")),
        }
    }
    conn.write_all(total.to_string().as_bytes())
        .map_err(|e| e.to_string())?;
    Ok(total)
}
