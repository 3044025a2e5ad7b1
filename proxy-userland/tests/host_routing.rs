//! `--bpf-host-routing` through the real daemon: what its remembered FIB answers (see
//! `proxy-ebpf/src/route.rs`) must not get wrong.

mod common;

use std::{
    net::Ipv4Addr,
    process::Stdio,
    time::{Duration, Instant},
};

use common::*;
use xtask::testbed::{Pod, Testbed};

/// A node port whose one backend is pod 1, over UDP.
fn manifest() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: dns, namespace: demo}}\n\
         spec:\n  type: NodePort\n  clusterIP: 198.19.0.10\n  \
         ports:\n  - {{name: dns, port: 53, targetPort: 5353, protocol: UDP, nodePort: 30053}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: dns-1\n  \
         namespace: demo\n  labels: {{kubernetes.io/service-name: dns}}\naddressType: IPv4\n\
         ports:\n- {{name: dns, port: 5353, protocol: UDP}}\n\
         endpoints:\n- {{addresses: [{}], nodeName: node-a, conditions: {{ready: true}}}}\n",
        pod_ip(1)
    )
}

/// The client host's address.
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 1);

/// What every test here starts from: pod 1 answering UDP on 5353, the node port of
/// [`manifest`] in a manifest folder, and a client host ("ext", [`CLIENT`]).
struct Bed {
    bed: Testbed,
    pod: Pod,
    ext: Pod,
    dir: RmDir,
}

impl Bed {
    fn new(tag: &str) -> Self {
        let mut bed = Testbed::new(tag).expect("test bed");
        let pod = bed.add_pod("pod-1", pod_ip(1), None).expect("pod");
        bed.serve(probe(), &pod, &["--udp", "0.0.0.0:5353"])
            .expect("pod server");
        let ext = bed
            .add_pod("ext", CLIENT, None)
            .expect("external client namespace");
        let dir = manifest_dir(tag);
        std::fs::write(dir.0.join("dns.yaml"), manifest()).unwrap();
        Self { bed, pod, ext, dir }
    }

    /// The daemon with the pod path on `pod_devices` and `extra` flags.
    fn daemon(&self, pod_devices: &str, extra: &[&str]) -> Daemon {
        node_port_daemon(&self.bed, pod_devices, &self.ext, &self.dir.0, extra)
    }

    fn node_port(&self) -> String {
        format!("{}:30053", self.bed.node_ipv4())
    }
}

/// A pod replaced by one with the same address on another device (its runtime recreated
/// it; the endpoint never changed) gets a live flow's packets within about a second: the
/// node port's host-routed packets follow the FIB's new answer, not the one remembered for
/// the flow, whose device is gone. One connected UDP socket on another host sends through
/// the replacement; before it and a moment after it, every datagram is answered, by the
/// pod of the moment.
#[test]
fn a_flow_follows_its_backends_address_to_a_new_device() {
    let b = Bed::new("hrmove");
    // The replacement's device will be the bed's next: fpv2 (ext has fpv1).
    let pod_devices = format!("{},fpv2", b.pod.node_veth);
    let daemon = b.daemon(&pod_devices, &["--bpf-host-routing"]);
    let target = b.node_port();
    // The manifest folder stays while the daemon reads it.
    let Bed {
        mut bed,
        ext,
        dir: _dir,
        ..
    } = b;
    let udp = |args: &[&str]| {
        let mut cmd = std::process::Command::new(probe());
        cmd.arg("--netns")
            .arg(&ext.netns)
            .args(["udp", &target, "--connected"])
            .args(args);
        cmd
    };
    assert!(
        eventually(20, || {
            let out = udp(&["--count", "2", "--timeout-ms", "300"])
                .output()
                .expect("probe runs");
            xtask::probe::parse(&String::from_utf8_lossy(&out.stdout))
                .iter()
                .all(|o| o.is_ok())
        }),
        "the node port never answered; log:\n{}",
        daemon.log()
    );
    // 100 datagrams, one every 50 ms, each waiting up to 100 ms for its answer: the
    // replacement comes after the first 20 or so.
    let sender = udp(&[
        "--count",
        "100",
        "--interval-ms",
        "50",
        "--timeout-ms",
        "100",
    ])
    .stdout(Stdio::piped())
    .spawn()
    .expect("probe runs");
    std::thread::sleep(Duration::from_millis(1500));
    bed.remove_pod("pod-1").expect("pod removed");
    let new = bed.add_pod("pod-1b", pod_ip(1), None).expect("pod again");
    assert_eq!(new.node_veth, "fpv2", "the bed numbers devices as assumed");
    bed.serve(probe(), &new, &["--udp", "0.0.0.0:5353"])
        .expect("pod server");
    let out = sender.wait_with_output().expect("probe ends");
    let outcomes = xtask::probe::parse(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(outcomes.len(), 100, "one line per datagram: {outcomes:?}");
    let by = |o: &xtask::probe::Outcome| {
        o.is_ok()
            .then(|| o.reply().and_then(|r| r.split_whitespace().next()))
            .flatten()
            .map(str::to_string)
    };
    let answered: Vec<Option<String>> = outcomes.iter().map(by).collect();
    assert!(
        answered[..10].iter().all(|a| a.as_deref() == Some("pod-1")),
        "before the replacement pod 1 answers every datagram: {answered:?}"
    );
    // About 30 datagrams go out between the replacement and the last 40 (some 2.5 s of
    // sending, with the answers' waits): a second to forget the old device, and the time
    // the daemon takes to put the programs on the new one.
    assert!(
        answered[60..]
            .iter()
            .all(|a| a.as_deref() == Some("pod-1b")),
        "the new pod answers every datagram from a moment after it came: {answered:?}\n{}",
        daemon.log()
    );
}

/// A routing rule that selects ports is followed, from the daemon's start and when it is
/// added later: the reply of a flow whose client port the rule sends to a prohibit route
/// is never delivered, even a moment after a flow between the same two addresses from
/// another port was. Where no rule or multipath hash reads ports, the packet path keeps
/// the FIB's answers per address pair (see `route_keys`); a daemon that did so under such
/// a rule would send the second flow's reply where the first one's went.
#[test]
fn routing_rules_that_select_ports_are_followed() {
    let b = Bed::new("hrrule");
    let (client, ext, target) = (CLIENT, &b.ext, b.node_port());
    let node = b.bed.node_netns().to_string();
    let ip = |args: &[&str]| {
        netns_ip(&node, args);
    };
    // Replies to the client's ports 40000-40999 may not leave the node.
    let client_route = format!("{client}/32");
    ip(&["route", "add", "prohibit", &client_route, "table", "100"]);
    let rule = ["dport", "40000-40999", "table", "100", "priority", "100"];
    ip(&[&["rule", "add"][..], &rule].concat());
    let daemon = b.daemon(&b.pod.node_veth, &["--bpf-host-routing"]);
    let answered_from = |port: u16| {
        let out = std::process::Command::new(probe())
            .arg("--netns")
            .arg(&ext.netns)
            .args(["udp", &target, "--source-port", &port.to_string()])
            .args(["--count", "1", "--timeout-ms", "300"])
            .output()
            .expect("probe runs");
        let outcomes = xtask::probe::parse(&String::from_utf8_lossy(&out.stdout));
        !outcomes.is_empty() && outcomes.iter().all(|o| o.is_ok())
    };
    assert!(
        eventually(20, || answered_from(50001)),
        "the node port never answered; log:\n{}",
        daemon.log()
    );
    // Each pair within a second: the first flow's answer is still remembered when the
    // second one's reply looks.
    let pairs = |round: &str, base: u16| {
        for i in 0..3 {
            assert!(
                answered_from(50_000 + base + i),
                "{round}: a port outside the rule's range"
            );
            assert!(
                !answered_from(40_000 + base + i),
                "{round}: a reply the rule prohibits was delivered; log:\n{}",
                daemon.log()
            );
        }
    };
    pairs("rule there from the start", 10);
    let said = |what: &str| daemon.log().matches(what).count();
    let by_port = "routing rule selects destination ports";
    let by_address = "no port steers a route";
    assert_eq!(
        said(by_port),
        1,
        "the daemon saw the rule; log:\n{}",
        daemon.log()
    );
    ip(&[&["rule", "del"][..], &rule].concat());
    assert!(
        eventually(10, || said(by_address) == 1),
        "the daemon saw the rule go; log:\n{}",
        daemon.log()
    );
    assert!(
        answered_from(40_020),
        "with the rule gone, its ports are answered"
    );
    ip(&[&["rule", "add"][..], &rule].concat());
    assert!(
        eventually(10, || said(by_port) == 2),
        "the daemon saw the rule come back; log:\n{}",
        daemon.log()
    );
    pairs("rule added while running", 30);
}

/// `--bpf-host-routing auto`, the default: host routing while the node's netfilter does
/// nothing to forwarded traffic, and the stack's path as soon as it does. A counting rule
/// leaves it on (the node forwards none of the node port's packets); a rule that drops
/// the client's datagrams to the pod is honoured within moments of being added, where
/// host routing would carry them past it; once the rule goes, host routing is back.
#[test]
fn auto_host_routing_gives_way_to_a_forward_filter() {
    let b = Bed::new("hrauto");
    let (client, ext, target) = (CLIENT, &b.ext, b.node_port());
    let daemon = b.daemon(&b.pod.node_veth, &[]);
    let answered = |count: &str| {
        let out = std::process::Command::new(probe())
            .arg("--netns")
            .arg(&ext.netns)
            .args(["udp", &target, "--fresh-socket", "--count", count])
            .args(["--timeout-ms", "300"])
            .output()
            .expect("probe runs");
        let outcomes = xtask::probe::parse(&String::from_utf8_lossy(&out.stdout));
        outcomes.iter().filter(|o| o.is_ok()).count()
    };
    let said = |what: &str| daemon.log().matches(what).count();
    let (on, off) = ("host routing on", "host routing off");
    assert!(
        eventually(20, || answered("1") == 1 && said(on) == 1),
        "the node port never answered with host routing on; log:\n{}",
        daemon.log()
    );
    let node = b.bed.node_netns().to_string();
    count_forwarded(&node, "");
    assert_eq!(answered("10"), 10, "a counting rule changes nothing");
    assert_eq!(
        forwarded(&node),
        0,
        "host routing carried every packet past the stack"
    );
    assert_eq!((said(on), said(off)), (1, 0), "log:\n{}", daemon.log());

    let nft = |args: &str| {
        netns_nft(&node, &args.split_whitespace().collect::<Vec<_>>());
    };
    nft("add table inet fpblock");
    nft("add chain inet fpblock fw { type filter hook forward priority 0 ; }");
    nft(&format!(
        "add rule inet fpblock fw ip saddr {client} udp dport 5353 drop"
    ));
    assert!(
        eventually(5, || answered("1") == 0),
        "the client's datagrams still reach the pod past a rule that drops them; log:\n{}",
        daemon.log()
    );
    assert!(
        daemon
            .log()
            .contains("host routing off: nftables chain inet fpblock fw"),
        "the daemon says why; log:\n{}",
        daemon.log()
    );
    nft("delete table inet fpblock");
    assert!(
        eventually(5, || answered("1") == 1 && said(on) == 2),
        "with the rule gone, host routing is back; log:\n{}",
        daemon.log()
    );

    // A rule is honoured as nf_tables announces it, not at the next look (twice a second,
    // which would make the median wait ~250 ms): from the rule's commit until the daemon
    // says host routing is off, five times.
    let mut waits = Vec::new();
    for k in 0..5 {
        nft("add table inet fpblock");
        nft("add chain inet fpblock fw { type filter hook forward priority 0 ; }");
        let offs = said(off);
        nft("add rule inet fpblock fw ip saddr 198.18.2.99 drop");
        let added = Instant::now();
        while said(off) == offs && added.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(2));
        }
        waits.push(added.elapsed());
        nft("delete table inet fpblock");
        assert!(
            eventually(5, || said(on) == 3 + k),
            "host routing comes back each time; log:\n{}",
            daemon.log()
        );
    }
    waits.sort();
    assert!(
        waits[2] < Duration::from_millis(150),
        "host routing goes off within moments of a rule that filters: {waits:?}"
    );
}

/// As deploy/ runs it (the ConfigMap's config, whose pod path and host routing are
/// `auto`, and the DaemonSet's capabilities): the watcher can read netfilter's rules and
/// hear of their changes, so on
/// a node whose netfilter does nothing to forwarded traffic host routing comes on, and a
/// forward rule that drops turns it off, with its reason.
#[test]
fn as_shipped_host_routing_follows_the_nodes_netfilter() {
    let b = Bed::new("hrship");
    let manifests = format!("--manifests={}", b.dir.0.display());
    let shipped = start_as_shipped(&b.bed, &[&manifests]);
    let log = || shipped.daemon.log();
    assert!(
        eventually(20, || log().contains("host routing on")),
        "host routing never came on; log:\n{}",
        log()
    );
    let node = b.bed.node_netns();
    netns_nft(node, &["add", "table", "inet", "fpship"]);
    let chain = "{ type filter hook forward priority 0 ; }";
    netns_nft(node, &["add", "chain", "inet", "fpship", "fw", chain]);
    netns_nft(
        node,
        &[
            "add", "rule", "inet", "fpship", "fw", "udp", "dport", "5353", "drop",
        ],
    );
    assert!(
        eventually(5, || log()
            .contains("host routing off: nftables chain inet fpship fw")),
        "host routing stayed on past a dropping rule; log:\n{}",
        log()
    );
    for failure in ["cannot read netfilter's rules", "no nf_tables events"] {
        assert!(!log().contains(failure), "log:\n{}", log());
    }
}
