//! Per-packet Service translation on the pods' devices (`--pod-interface-name-prefix`),
//! through the real daemon and manifests: pods the socket hooks never see reach ClusterIPs,
//! and `--bpf-socket-lb-host-namespace-only` leaves pods' sockets to it.

mod common;

use std::{
    collections::BTreeSet,
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    time::Duration,
};

use common::*;

/// `fastpath_packets_total{result="new_flow"}` from /metrics, 0 if not there yet.
fn new_flows(port: u16) -> f64 {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return 0.0;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(s, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.lines()
        .find_map(|l| l.strip_prefix(r#"fastpath_packets_total{result="new_flow"} "#))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

struct Setup {
    bed: xtask::testbed::Testbed,
    client: xtask::testbed::Pod,
    daemon: Daemon,
    metrics: u16,
    _dir: RmDir,
}

/// Two serving pods, a client pod (pod_ip(9)), and the daemon with the pod path on the
/// bed's `fpv*` devices, plus `extra` flags.
fn setup(tag: &str, extra: &[&str]) -> Setup {
    setup_for(tag, extra, false)
}

/// As [`setup`]; `dual`: pods, client and `demo/web` dual-stack.
fn setup_for(tag: &str, extra: &[&str], dual: bool) -> Setup {
    let (bed, client) = bed_with_client(tag, dual);
    let dir = manifest_dir(tag);
    let manifest = if dual {
        web_manifest_dual(&[1, 2])
    } else {
        web_manifest(&[pod_ip(1), pod_ip(2)])
    };
    std::fs::write(dir.0.join("web.yaml"), manifest).unwrap();
    let metrics = free_port();
    let metrics_addr = format!("127.0.0.1:{metrics}");
    let mut args = vec![
        "--proxy-mode",
        "ebpf",
        "--netns",
        bed.node_netns(),
        "--pod-interface-name-prefix",
        "fpv",
        "--manifests",
        dir.0.to_str().unwrap(),
        "--manifest-poll-period",
        "100ms",
        "--sync-period",
        "1s",
        "--metrics-bind-address",
        &metrics_addr,
    ];
    args.extend_from_slice(extra);
    let daemon = Daemon::start(bed.cgroup_path(), &args);
    let tcp_once = ["tcp", WEB, "--count", "1", "--timeout-ms", "500"];
    assert!(
        eventually(20, || pod_probe(&bed, &client, &tcp_once)[0].is_ok()),
        "the ClusterIP never answered the pod; log:\n{}",
        daemon.log()
    );
    let s = Setup {
        bed,
        client,
        daemon,
        metrics,
        _dir: dir,
    };
    // The first IPv6 packets wait on neighbour discovery along the way; the tests count
    // from a path that is up, as the IPv4 probe above makes it for IPv4.
    let v6_once = ["tcp", WEB6, "--count", "1", "--timeout-ms", "500"];
    assert!(
        !dual || eventually(20, || outside_cgroup(&s, &v6_once)[0].is_ok()),
        "the IPv6 ClusterIP never answered the pod; log:\n{}",
        s.daemon.log()
    );
    s
}

/// Runs the probe in the client pod but outside the hooks' cgroup.
fn outside_cgroup(s: &Setup, args: &[&str]) -> Vec<xtask::probe::Outcome> {
    probe_in(&s.client.netns, args)
}

/// Runs the probe in network namespace `netns`, in no cgroup of the hooks.
fn probe_in(netns: &str, args: &[&str]) -> Vec<xtask::probe::Outcome> {
    let out = std::process::Command::new(probe())
        .arg("--netns")
        .arg(netns)
        .args(args)
        .output()
        .expect("probe runs");
    xtask::probe::parse(&String::from_utf8_lossy(&out.stdout))
}

/// KubeVirt, Kata or gVisor pods: nothing of theirs passes the socket hooks. Their packets
/// are translated on their device, TCP and UDP, and the replies come from the ClusterIP.
#[test]
fn a_pod_outside_the_socket_lb_cgroup_reaches_cluster_ips_over_tcp_and_udp() {
    outside_pod_reaches(&setup("podout", &[]), WEB, WEB_DNS);
}

/// A client that closed its connection to a ClusterIP and then dials a backend pod's own
/// address may reuse the same source port at once (a RST leaves no TIME_WAIT, and the
/// destination differs). That connection's answers match the reply entry of the closed
/// Service flow; a SYN-ACK there is another connection's, and must not be turned back
/// into the ClusterIP's (the client would drop it: a connect or read timeout).
#[test]
fn a_pod_dialling_a_backend_from_a_closed_service_flows_port_is_not_translated() {
    let s = setup("podreuse", &[]);
    let direct = format!("{}:8080", pod_ip(1));
    for (i, port) in (40_100u16..40_110).enumerate() {
        let port = port.to_string();
        let from = [
            "--source-port",
            port.as_str(),
            "--reset",
            "--timeout-ms",
            "1000",
        ];
        // Both pods serve the Service: this connection reached pod 1 or pod 2, and the
        // next one from this port goes to pod 1 directly either way.
        let service = outside_cgroup(&s, &[&["tcp", WEB][..], &from[..]].concat());
        assert!(
            service.len() == 1 && service[0].is_ok(),
            "connection {i} to the Service: {service:?}"
        );
        let outcome = outside_cgroup(&s, &[&["tcp", direct.as_str()][..], &from[..]].concat());
        assert!(
            outcome.len() == 1 && outcome[0].is_ok(),
            "connection {i} to {direct} from port {port}, which a Service flow had used: \
             {outcome:?}"
        );
    }
}

/// The same over IPv6, with a dual-stack Service: the v6 ClusterIP is translated on the
/// pod's device too, and the v4 one still is beside it.
#[test]
fn a_pod_outside_the_socket_lb_cgroup_reaches_ipv6_cluster_ips_over_tcp_and_udp() {
    let s = setup_for("podout6", &[], true);
    outside_pod_reaches(&s, WEB6, WEB6_DNS);
    outside_pod_reaches(&s, WEB, WEB_DNS);
}

/// 20 TCP connections and 20 fresh UDP sockets to `web` and `web_dns` reach both pods and
/// see only the ClusterIP; one connected UDP socket stays on one backend.
fn outside_pod_reaches(s: &Setup, web: &str, web_dns: &str) {
    let tcp = outside_cgroup(s, &["tcp", web, "--count", "20", "--timeout-ms", "1000"]);
    assert!(
        tcp.iter().all(|a| a.is_ok()),
        "every connection succeeds: {tcp:?}\n{}",
        s.daemon.log()
    );
    let both: BTreeSet<String> = ["pod-1", "pod-2"].map(String::from).into();
    assert_eq!(
        reached(&tcp),
        both,
        "20 connections reach both pods: {tcp:?}"
    );
    assert!(tcp.iter().all(|a| peer(a) == Some(web)), "{tcp:?}");

    let udp = outside_cgroup(
        s,
        &[
            "udp",
            web_dns,
            "--count",
            "20",
            "--fresh-socket",
            "--timeout-ms",
            "1000",
        ],
    );
    assert!(
        udp.iter().all(|a| a.is_ok()),
        "every datagram is answered: {udp:?}"
    );
    assert_eq!(reached(&udp), both, "20 sockets reach both pods: {udp:?}");
    assert!(
        udp.iter().all(|a| from(a) == Some(web_dns)),
        "replies come from the ClusterIP: {udp:?}"
    );

    let connected = outside_cgroup(
        s,
        &[
            "udp",
            web_dns,
            "--connected",
            "--count",
            "10",
            "--timeout-ms",
            "1000",
        ],
    );
    assert!(
        connected
            .iter()
            .all(|a| a.is_ok() && from(a) == Some(web_dns)),
        "{connected:?}"
    );
    assert_eq!(
        reached(&connected).len(),
        1,
        "one socket, one flow, one backend: {connected:?}"
    );
}

/// Hairpin: a pod that is one of its Service's backends reaches the Service from outside
/// the hooks' cgroup, over TCP and UDP, v4 and v6, and every flow that picks the pod itself
/// lands on it. Without a source rewrite the pod would get a packet from its own address on
/// its device, which its stack drops as a martian, and such flows would time out.
#[test]
fn a_pod_reaches_itself_through_its_cluster_ip_on_its_device() {
    let s = setup_for("hairpin", &[], true);
    let pod1 = s.bed.pods()[0].netns.clone();
    let from_pod1 = |args: &[&str]| probe_in(&pod1, args);
    for (web, web_dns) in [(WEB, WEB_DNS), (WEB6, WEB6_DNS)] {
        let tcp = from_pod1(&["tcp", web, "--count", "20", "--timeout-ms", "1000"]);
        let udp = from_pod1(&[
            "udp",
            web_dns,
            "--count",
            "20",
            "--fresh-socket",
            "--timeout-ms",
            "1000",
        ]);
        for (what, out, shown) in [("tcp", &tcp, peer as Shown), ("udp", &udp, from)] {
            assert!(
                out.iter().all(|a| a.is_ok()),
                "{what} to {web}: every flow from pod-1 is answered, those it picks itself \
                 too: {out:?}\n{}",
                s.daemon.log()
            );
            assert!(
                reached(out).contains("pod-1"),
                "{what} to {web}: 20 flows never picked pod-1 itself: {out:?}"
            );
            assert!(
                out.iter()
                    .all(|a| shown(a).is_some_and(|p| p == web || p == web_dns)),
                "{what}: pod-1 sees only the ClusterIP: {out:?}"
            );
        }
    }
}

type Shown = fn(&xtask::probe::Outcome) -> Option<&str>;

/// Cilium's socketLB.hostNamespaceOnly: with the flag, a pod's TCP inside the cgroup is
/// left to its device (new flows counted there); without it, the socket hook takes it and
/// the device sees no new flow. The host's own sockets keep socket load-balancing.
#[test]
fn host_namespace_only_leaves_pods_sockets_to_their_devices() {
    let only = setup("hostonly", &["--bpf-socket-lb-host-namespace-only"]);
    let before = new_flows(only.metrics);
    let tcp = pod_probe(
        &only.bed,
        &only.client,
        &["tcp", WEB, "--count", "10", "--timeout-ms", "1000"],
    );
    assert!(
        tcp.iter().all(|a| a.is_ok() && peer(a) == Some(WEB)),
        "{tcp:?}"
    );
    assert!(
        eventually(5, || new_flows(only.metrics) >= before + 10.0),
        "the pod's 10 connections were not translated on its device: {} new flows",
        new_flows(only.metrics) - before
    );
    // The bed's node namespace is the host here: its sockets are still translated at
    // connect(), so the device count does not move for them.
    let settled = new_flows(only.metrics);
    let host = tcp_n(&only, 10);
    assert!(host.iter().all(|a| a.is_ok()), "{host:?}");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        new_flows(only.metrics),
        settled,
        "host connections went per packet"
    );
    drop(only);

    let both = setup("podsock", &[]);
    std::thread::sleep(Duration::from_millis(1500));
    let before = new_flows(both.metrics);
    let tcp = pod_probe(
        &both.bed,
        &both.client,
        &["tcp", WEB, "--count", "10", "--timeout-ms", "1000"],
    );
    assert!(tcp.iter().all(|a| a.is_ok()), "{tcp:?}");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        new_flows(both.metrics),
        before,
        "without the flag a pod's TCP is the socket hook's"
    );
}

fn tcp_n(s: &Setup, n: usize) -> Vec<xtask::probe::Outcome> {
    tcp(&s.bed, WEB, n)
}

/// `demo/web` on node ports 30080 (TCP) and 30053 (UDP), `demo/local` the same under
/// externalTrafficPolicy Local on 30180 and 30153, both served by pods 1 and 2 on this node
/// ("node-a", the daemon's name).
fn node_port_manifest() -> String {
    let service = |name: &str, ip: &str, base: u16, policy: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: demo}}\n\
             spec:\n  type: NodePort\n  clusterIP: {ip}\n  externalTrafficPolicy: {policy}\n  \
             ports:\n  - {{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: {tcp}}}\n  \
             - {{name: dns, port: 53, targetPort: 5353, protocol: UDP, nodePort: {udp}}}\n---\n\
             apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  \
             namespace: demo\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\n\
             ports:\n- {{name: http, port: 8080, protocol: TCP}}\n- {{name: dns, port: 5353, protocol: UDP}}\n\
             endpoints:\n- {{addresses: [{p1}], nodeName: node-a, conditions: {{ready: true}}}}\n\
             - {{addresses: [{p2}], nodeName: node-a, conditions: {{ready: true}}}}\n---\n",
            tcp = base,
            udp = base - 27,
            p1 = pod_ip(1),
            p2 = pod_ip(2),
        )
    };
    service("web", "198.19.0.10", 30080, "Cluster")
        + &service("local", "198.19.0.11", 30180, "Local")
}

/// The pods that answered, by name (the servers echo the peer they saw after it).
fn names(outcomes: &[xtask::probe::Outcome]) -> BTreeSet<String> {
    outcomes
        .iter()
        .filter_map(|o| o.name().map(str::to_string))
        .collect()
}

/// A client on another host reaches node ports whose backends are pods on this node, with
/// the pod path on those pods' devices: the pods' replies must reach the node device's
/// egress to be shown as from the node port, not be turned back on the pods' devices into
/// packets from the node's own address, which the stack drops as martians. TCP and UDP,
/// externalTrafficPolicy Cluster and Local.
#[test]
fn node_ports_reach_pods_of_this_node_with_the_pod_path_on_their_devices() {
    node_ports_reach_local_pods("podnp", false);
}

/// The same with `--bpf-host-routing`: a node port's packets for pods on this node go from
/// the node device's tc straight into the pod, past the host's stack (its forward hook
/// counts none of them once the neighbours are known); answers are as before. The client
/// and the pods send full checksums, which the receivers verify: the programs rewrite
/// every packet of these flows, its MACs, addresses and checksums in one store.
#[test]
fn host_routing_takes_node_port_traffic_to_local_pods_past_the_hosts_stack() {
    node_ports_reach_local_pods("podnphr", true);
}

fn node_ports_reach_local_pods(tag: &str, host_routing: bool) {
    let (mut bed, pods) = bed_with_echoing_pods(tag, 2);
    let ext = bed
        .add_pod("ext", Ipv4Addr::new(198, 18, 2, 1), None)
        .expect("external client namespace");
    let dir = manifest_dir(tag);
    std::fs::write(dir.0.join("np.yaml"), node_port_manifest()).unwrap();
    let pod_devices = format!("{},{}", pods[0].node_veth, pods[1].node_veth);
    let mut extra: Vec<&str> = Vec::new();
    if host_routing {
        extra.push("--bpf-host-routing");
        for p in pods.iter().chain([&ext]) {
            send_full_checksums(p);
        }
    }
    let daemon = node_port_daemon(&bed, &pod_devices, &ext, &dir.0, &extra);
    let node = bed.node_ipv4();
    let probe = |args: &[&str]| {
        let out = std::process::Command::new(probe())
            .arg("--netns")
            .arg(&ext.netns)
            .args(args)
            .output()
            .expect("probe runs");
        xtask::probe::parse(&String::from_utf8_lossy(&out.stdout))
    };
    // The daemon is up once the Cluster service's node port answers at all (the bug
    // leaves it answering never, or only from the other pod's device by chance).
    let tcp_web = format!("{node}:30080");
    assert!(
        eventually(20, || probe(&[
            "tcp",
            &tcp_web,
            "--count",
            "4",
            "--timeout-ms",
            "500"
        ])
        .iter()
        .any(|o| o.is_ok())),
        "the node port never answered; log:\n{}",
        daemon.log()
    );
    let both: BTreeSet<String> = ["pod-1", "pod-2"].map(String::from).into();
    let client = format!("{}:", ext.ipv4);
    // With host routing: a first pass makes the pods' neighbours known, the second is
    // counted.
    let passes = if host_routing { 2 } else { 1 };
    for pass in 0..passes {
        if host_routing && pass == 1 {
            // Both ways: the requests into the pods and the pods' replies out to the client.
            count_forwarded(bed.node_netns(), "");
        }
        for base in [30080u16, 30180] {
            let target = format!("{node}:{base}");
            let tcp = probe(&["tcp", &target, "--count", "16", "--timeout-ms", "1000"]);
            assert!(
                tcp.iter()
                    .all(|o| o.is_ok() && peer(o) == Some(target.as_str())),
                "every connection to {target} succeeds with the node port as its peer: {tcp:?}\n{}",
                daemon.log()
            );
            assert_eq!(names(&tcp), both, "16 connections reach both pods: {tcp:?}");
            assert!(
                tcp.iter()
                    .all(|o| o.seen_from().is_some_and(|s| s.starts_with(&client))),
                "local backends see the client itself (no SNAT): {tcp:?}"
            );
            let udp_target = format!("{node}:{}", base - 27);
            let udp = probe(&[
                "udp",
                &udp_target,
                "--count",
                "16",
                "--fresh-socket",
                "--timeout-ms",
                "1000",
            ]);
            assert!(
                udp.iter()
                    .all(|o| o.is_ok() && from(o) == Some(udp_target.as_str())),
                "every datagram to {udp_target} is answered from the node port: {udp:?}"
            );
            assert_eq!(names(&udp), both, "16 sockets reach both pods: {udp:?}");
        }
    }
    if host_routing {
        let forwarded = forwarded(bed.node_netns());
        assert_eq!(
            forwarded, 0,
            "the host forwarded {forwarded} of the node ports' packets (requests or replies)"
        );
    }
}

/// A new pod's device gets the programs as it appears, not at the next look at the
/// devices: its first datagrams to a ClusterIP, sent right after its network is set up,
/// are answered. (Looking twice a second left a pod up to half a second with its UDP sent
/// to the ClusterIP as it was.)
#[test]
fn a_new_pods_device_is_covered_as_it_appears() {
    let mut s = setup("podnew", &[]);
    for k in 0..3u8 {
        let pod = s
            .bed
            .add_pod(&format!("late-{k}"), pod_ip(20 + k), None)
            .expect("a new pod");
        let added = std::time::Instant::now();
        let answered = loop {
            let out = std::process::Command::new(probe())
                .arg("--netns")
                .arg(&pod.netns)
                .args(["udp", WEB_DNS, "--count", "1", "--timeout-ms", "20"])
                .output()
                .expect("probe runs");
            let ok = xtask::probe::parse(&String::from_utf8_lossy(&out.stdout))
                .first()
                .is_some_and(|o| o.is_ok());
            if ok || added.elapsed() > std::time::Duration::from_secs(3) {
                break ok.then(|| added.elapsed());
            }
        };
        let took = answered.unwrap_or_else(|| {
            panic!(
                "pod late-{k} never reached the ClusterIP; log:\n{}",
                s.daemon.log()
            )
        });
        println!("pod late-{k}: first answer {took:?} after its device appeared");
        assert!(
            took < std::time::Duration::from_millis(150),
            "pod late-{k}'s device was covered only after {took:?}"
        );
    }
}

/// Issue 22 point 4 on the pod path: a pod's UDP to an address inside the service range
/// that no Service holds is answered at once with ICMP port unreachable from its device, so
/// its connected socket gets ECONNREFUSED, as a node process's connect() does; a held
/// address still answers from the same socket kind.
#[test]
fn a_pods_udp_to_an_unused_service_address_is_refused_at_once() {
    let s = setup("podrange", &["--service-cluster-ip-range", "198.19.0.0/17"]);
    udp_refused_at_once(&s, "198.19.0.99:53", WEB_DNS, "198.18.250.1:53");
}

/// The same over IPv6 (ICMPv6 destination unreachable, port unreachable), the IPv4 range
/// beside it.
#[test]
fn a_pods_ipv6_udp_to_an_unused_service_address_is_refused_at_once() {
    let ranges = "198.19.0.0/17,2001:db8:ff00::/112";
    let s = setup_for("podrange6", &["--service-cluster-ip-range", ranges], true);
    udp_refused_at_once(
        &s,
        "[2001:db8:ff00::99]:53",
        WEB6_DNS,
        "[2001:db8:fe00::1]:53",
    );
    udp_refused_at_once(&s, "198.19.0.99:53", WEB_DNS, "198.18.250.1:53");
}

/// From the client pod: 5 fresh connected UDP sockets to `unheld` are refused within a
/// second, `served` answers, and `outside` (out of the ranges) is not refused by us.
fn udp_refused_at_once(s: &Setup, unheld: &str, served: &str, outside: &str) {
    let udp = |target: &str, count: &str, timeout: &str| {
        outside_cgroup(
            s,
            &[
                "udp",
                target,
                "--count",
                count,
                "--timeout-ms",
                timeout,
                "--fresh-socket",
                "--connected",
            ],
        )
    };
    let started = std::time::Instant::now();
    let refused = udp(unheld, "5", "1000");
    let took = started.elapsed();
    assert!(
        refused.iter().all(|o| o.errno() == Some("ECONNREFUSED")),
        "{unheld}: {refused:?}\nlog:\n{}",
        s.daemon.log()
    );
    assert!(
        took < Duration::from_millis(1000),
        "{unheld}: 5 refusals took {took:?}, not at once"
    );
    let answered = udp(served, "5", "1000");
    assert!(answered.iter().all(|o| o.is_ok()), "{served}: {answered:?}");
    // Not ours: left to the routes (a timeout or another error, not our refusal).
    let left = udp(outside, "1", "300");
    assert!(
        left.iter().all(|o| o.errno() != Some("ECONNREFUSED")),
        "{outside}: {left:?}"
    );
}

/// `--bpf-host-routing`: a pod's translated traffic to pods on its node goes straight into
/// their namespace, TCP and UDP, v4 and v6, replies included: once the pods' neighbour
/// entries are known the host forwards none of it (an nftables counter on the node's
/// forward hook, which every packet of these flows passes without the flag, stays at 0),
/// and the clients see the ClusterIP as before.
#[test]
fn host_routing_takes_pods_translated_traffic_past_the_hosts_stack() {
    let s = setup_for("hostrt", &["--bpf-host-routing"], true);
    // A packet for a pod whose neighbour entry the host has yet to resolve goes through
    // the stack, which resolves it: a first round makes them known.
    outside_pod_reaches(&s, WEB, WEB_DNS);
    outside_pod_reaches(&s, WEB6, WEB6_DNS);
    count_forwarded(s.bed.node_netns(), "");
    outside_pod_reaches(&s, WEB, WEB_DNS);
    outside_pod_reaches(&s, WEB6, WEB6_DNS);
    let forwarded = forwarded(s.bed.node_netns());
    assert_eq!(
        forwarded, 0,
        "the host forwarded {forwarded} packets of the pods' translated flows"
    );
}

/// A Service's ports are frontends at one address, which the packet path's filter
/// (`proxy_common::filter`) holds while any of them is left: a Service that drops its TCP
/// port keeps its UDP one on the pods' devices. Once the Service goes its address is no
/// frontend's, and it serves again when the Service comes back.
#[test]
fn a_service_that_drops_a_port_keeps_its_others_on_the_pods_devices() {
    let s = setup("podports", &[]);
    let file = s._dir.0.join("web.yaml");
    let whole = std::fs::read_to_string(&file).unwrap();
    let http = "  - {name: http, port: 80, targetPort: 8080, protocol: TCP}\n";
    assert!(whole.contains(http), "{whole}");
    let tcp_once = ["tcp", WEB, "--count", "1", "--timeout-ms", "300"];
    let udp_once = ["udp", WEB_DNS, "--count", "1", "--timeout-ms", "500"];
    assert!(outside_cgroup(&s, &udp_once)[0].is_ok());

    std::fs::write(&file, whole.replace(http, "")).unwrap();
    assert!(
        eventually(10, || !outside_cgroup(&s, &tcp_once)[0].is_ok()),
        "the dropped port still answers; log:\n{}",
        s.daemon.log()
    );
    let udp = outside_cgroup(
        &s,
        &["udp", WEB_DNS, "--count", "20", "--timeout-ms", "500"],
    );
    assert!(
        udp.len() == 20 && udp.iter().all(|o| o.is_ok() && from(o) == Some(WEB_DNS)),
        "the port left must keep answering from the ClusterIP: {udp:?}\n{}",
        s.daemon.log()
    );

    std::fs::remove_file(&file).unwrap();
    assert!(
        eventually(10, || !outside_cgroup(&s, &udp_once)[0].is_ok()),
        "the Service is gone but its UDP port still answers"
    );
    std::fs::write(&file, &whole).unwrap();
    assert!(
        eventually(10, || outside_cgroup(&s, &udp_once)[0].is_ok()
            && outside_cgroup(&s, &tcp_once)[0].is_ok()),
        "the Service is back but its ports do not answer; log:\n{}",
        s.daemon.log()
    );
}

/// A deleted Service's live flow ends, even for a client that keeps sending and a backend
/// that stays (another Service has it too), though a flow's packets skip the service maps
/// for up to a second after its last full look (see `forward_entry` in
/// `proxy-ebpf/src/nodeport.rs`): the frontends' filter, checked first, says at once that
/// nothing is at the address (unless another address shares its slot: then within that
/// second). One flow (the same source port each time) is answered up to the deletion;
/// once the maps have no Service at its address, it is refused within 1.5 s, as a new
/// flow is at once.
#[test]
fn a_deleted_services_live_udp_flow_ends_within_a_second() {
    let s = setup("podwin", &[]);
    // The same endpoints under a second Service keep the backends in the maps.
    let web = std::fs::read_to_string(s._dir.0.join("web.yaml")).unwrap();
    let web2 = web
        .replace("name: web,", "name: web2,")
        .replace("198.19.0.10", "198.19.0.11")
        .replace("service-name: web}", "service-name: web2}")
        .replace("name: web-abc", "name: web2-abc");
    std::fs::write(s._dir.0.join("web2.yaml"), web2).unwrap();
    let web2_once = [
        "udp",
        "198.19.0.11:53",
        "--count",
        "1",
        "--timeout-ms",
        "300",
    ];
    assert!(
        eventually(10, || outside_cgroup(&s, &web2_once)[0].is_ok()),
        "the second Service never answered; log:\n{}",
        s.daemon.log()
    );
    let same_flow = [
        "udp",
        WEB_DNS,
        "--connected",
        "--source-port",
        "40053",
        "--count",
        "1",
        "--timeout-ms",
        "300",
    ];
    for _ in 0..8 {
        let o = outside_cgroup(&s, &same_flow);
        assert!(
            o[0].is_ok(),
            "the flow is answered before the deletion: {o:?}"
        );
        std::thread::sleep(Duration::from_millis(150));
    }
    std::fs::remove_file(s._dir.0.join("web.yaml")).unwrap();
    let new_flow = ["udp", WEB_DNS, "--count", "1", "--timeout-ms", "300"];
    assert!(
        eventually(10, || !outside_cgroup(&s, &new_flow)[0].is_ok()),
        "the Service is gone from the maps but a new flow is answered; log:\n{}",
        s.daemon.log()
    );
    // The flow keeps sending through its second of grace.
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_millis(1500) {
        outside_cgroup(&s, &same_flow);
        std::thread::sleep(Duration::from_millis(100));
    }
    let after: Vec<_> = (0..5).map(|_| outside_cgroup(&s, &same_flow)).collect();
    assert!(
        after.iter().all(|o| !o[0].is_ok()),
        "1.5 s after its Service left the maps the flow is still answered: {after:?}"
    );
}
