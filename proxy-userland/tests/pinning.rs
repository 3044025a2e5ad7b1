//! Pinned maps and links: a daemon restart (or upgrade) keeps connections flowing, the next
//! daemon adopts what the last one programmed, and clean-up removes it all.

mod common;
mod nat_common;

use std::{net::Ipv4Addr, path::Path, process::Output, time::Duration};

use aya::programs::{SchedClassifier, tc::TcAttachType};
use common::*;
use nat_common::*;
use proxy_userland::{
    dataplane::{
        Dataplane, Scope,
        bpf::{BpfDataplane, loader},
    },
    model::NodeInfo,
};

fn links_pinned(pin: &Path) -> usize {
    std::fs::read_dir(loader::PinLayout::new(pin).links)
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn restart_keeps_connections_flowing_and_reconciles_what_changed_meanwhile() {
    let (bed, _pods) = bed_with_pods("pinning", 2);
    let fs = Bpffs::mount(bed.dir());
    let pin = fs.0.join("fastpath");
    let node = NodeInfo::default();
    let web = web_service("web", Ipv4Addr::new(198, 19, 0, 10));
    let old = web_service("old", Ipv4Addr::new(198, 19, 0, 11));
    let eps = || Some(web_endpoints(vec![ready(pod_ip(1)), ready(pod_ip(2))]));

    let mut first = BpfDataplane::attach_pinned(bed.cgroup_path(), Some(&pin)).unwrap();
    first.sync(
        &state_of(vec![(web.clone(), eps()), (old.clone(), eps())]),
        &node,
        Scope::Full,
    );
    assert!(tcp(&bed, "198.19.0.11:80", 1)[0].is_ok());

    // A bounded loop of new connections, 20 ms apart, across the whole restart.
    let client = std::thread::spawn({
        let mut cmd = bed.client(probe());
        cmd.args([
            "tcp",
            "198.19.0.10:80",
            "--count",
            "150",
            "--interval-ms",
            "20",
            "--timeout-ms",
            "1000",
        ]);
        move || cmd.output().expect("probe runs")
    });
    std::thread::sleep(Duration::from_millis(500));
    drop(first); // the daemon exits...
    std::thread::sleep(Duration::from_millis(700)); // ...nobody runs for a while...
    // ...and the next one starts while "old" was deleted meanwhile.
    let mut second = BpfDataplane::attach_pinned(bed.cgroup_path(), Some(&pin)).unwrap();
    let report = second.sync(&state_of(vec![(web.clone(), eps())]), &node, Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");
    assert_eq!(
        report.frontends_written, 0,
        "web was adopted as it was: nothing rewritten"
    );
    assert_eq!(
        report.frontends_removed, 2,
        "old's two ports, deleted while no daemon ran"
    );

    let out = client.join().unwrap();
    let outcomes = xtask::probe::parse(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(outcomes.len(), 150);
    let failed: Vec<_> = outcomes.iter().filter(|o| !o.is_ok()).collect();
    assert!(
        failed.is_empty(),
        "{} of 150 connections failed across the restart: {failed:?}",
        failed.len()
    );
    assert_eq!(reached(&outcomes).len(), 2);

    assert!(
        !tcp(&bed, "198.19.0.11:80", 1)[0].is_ok(),
        "the deleted service is gone"
    );
    assert_eq!(
        links_pinned(&pin),
        loader::SOCK_PROGRAMS.len() + 1,
        "one generation of links (socket hooks and sock_release) remains, not two"
    );

    // The maps are the same ones: an endpoint change still lands.
    let one = Some(web_endpoints(vec![ready(pod_ip(2))]));
    let changed = std::collections::BTreeSet::from([web.key.clone()]);
    second.sync(&state_of(vec![(web, one)]), &node, Scope::Changed(&changed));
    assert!(
        tcp(&bed, "198.19.0.10:80", 20)
            .iter()
            .all(|o| o.reply() == Some("pod-2"))
    );

    // Clean-up detaches everything, even while a daemon still holds its handles.
    // (The kernel releases an unpinned link from a work queue: allow it a moment.)
    loader::remove_pinned(&pin).unwrap();
    drop(second);
    assert!(
        eventually(3, || !tcp(&bed, "198.19.0.10:80", 1)[0].is_ok()),
        "no translation after clean-up"
    );
}

/// The programs honour an affinity entry only while the match map holds its backend for
/// its frontend. A restarted daemon adopts the frontends without rewriting them, so it must
/// make that map whole itself: after a daemon that never wrote it (an upgrade), or one that
/// stopped midway and left an entry too many.
#[test]
fn restart_rebuilds_which_affinity_backends_count() {
    use aya::maps::{HashMap, Map, MapData};
    use proxy_common::{AffinityMatchKey, maps::AFFINITY_MATCH};

    let (bed, _pods) = bed_with_pods("pinaff", 3);
    let fs = Bpffs::mount(bed.dir());
    let pin = fs.0.join("fastpath");
    let node = NodeInfo::default();
    let mut web = web_service("web", Ipv4Addr::new(198, 19, 0, 10));
    web.affinity_timeout = Some(600);
    let all: Vec<_> = (1..=3).map(|i| ready(pod_ip(i))).collect();
    let state = |eps: &[_]| state_of(vec![(web.clone(), Some(web_endpoints(eps.to_vec())))]);

    let mut first = BpfDataplane::attach_pinned(bed.cgroup_path(), Some(&pin)).unwrap();
    first.sync(&state(&all), &node, Scope::Full);
    let stuck = reached(&tcp(&bed, "198.19.0.10:80", 10));
    assert_eq!(stuck.len(), 1, "one client, one backend: {stuck:?}");
    let pod = stuck.into_iter().next().unwrap();
    drop(first);

    // A daemon from before the match map pinned everything else.
    let path = loader::PinLayout::new(&pin).maps.join(AFFINITY_MATCH);
    std::fs::remove_file(&path).unwrap();
    let open_matches = || -> HashMap<MapData, AffinityMatchKey, u8> {
        let map = Map::from_map_data(MapData::from_pin(&path).unwrap()).unwrap();
        HashMap::try_from(map).unwrap()
    };
    let entries = |m: &HashMap<MapData, AffinityMatchKey, u8>| {
        let mut k: Vec<_> = m.keys().filter_map(Result::ok).collect();
        k.sort();
        k
    };

    let mut second = BpfDataplane::attach_pinned(bed.cgroup_path(), Some(&pin)).unwrap();
    let report = second.sync(&state(&all), &node, Scope::Full);
    assert_eq!(report.frontends_written, 0, "adopted as it was: {report:?}");
    let mut matches = open_matches();
    let rebuilt = entries(&matches);
    assert_eq!(rebuilt.len(), 6, "three backends of two affinity frontends");
    let sticks = reached(&tcp(&bed, "198.19.0.10:80", 10));
    assert_eq!(sticks, std::collections::BTreeSet::from([pod.clone()]));

    // One that stopped midway left an entry too many.
    let bogus = AffinityMatchKey::new(4000, rebuilt[0].rev_nat_index);
    matches.insert(bogus, 0, 0).unwrap();
    drop(second);
    let mut third = BpfDataplane::attach_pinned(bed.cgroup_path(), Some(&pin)).unwrap();
    third.sync(&state(&all), &node, Scope::Full);
    assert_eq!(entries(&matches), rebuilt, "the entry too many dropped");

    // And kept in step: the client's backend leaves, the client moves and sticks.
    let rest = without_pod(&all, &pod);
    third.sync(&state(&rest), &node, Scope::Full);
    assert_eq!(matches.keys().count(), 4);
    assert_eq!(
        third.programmer().occupancy().affinity_match,
        4,
        "counted as written"
    );
    // The client's entry stays in the LRU map, but counts no more, nor shows.
    let inspect = proxy_userland::inspect::maps::PinnedMaps::open(&pin).unwrap();
    let shown = inspect.affinity().unwrap();
    assert!(shown.is_empty(), "{shown:?}");
    let moved = reached(&tcp(&bed, "198.19.0.10:80", 10));
    assert_eq!(moved.len(), 1, "{moved:?}");
    assert!(!moved.contains(&pod), "still sent to the removed {pod}");

    drop(matches);
    loader::remove_pinned(&pin).unwrap();
}

#[test]
fn pinned_daemon_keeps_services_after_exit_until_cleanup() {
    let (bed, _pods) = bed_with_pods("pincleanup", 2);
    let fs = Bpffs::mount(bed.dir());
    let pin = fs.0.join("fastpath");
    let dir = bed.dir().join("manifests");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("web.yaml"),
        r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  clusterIP: 198.19.0.10
  ports: [{name: http, port: 80, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: [198.18.1.11]}, {addresses: [198.18.1.12]}]
"#,
    )
    .unwrap();
    let pin_arg = pin.to_str().unwrap();
    let mut daemon = Daemon::start(
        bed.cgroup_path(),
        &[
            "--manifests",
            dir.to_str().unwrap(),
            "--proxy-mode",
            "ebpf",
            "--bpf-pin-dir",
            pin_arg,
        ],
    );
    assert!(
        eventually(20, || tcp(&bed, "198.19.0.10:80", 1)[0].is_ok()),
        "never reachable; log:\n{}",
        daemon.log()
    );
    assert!(daemon.stop().success(), "{}", daemon.log());
    // No daemon runs, and Services still work: the programs stay attached through the pins.
    let without_daemon = tcp(&bed, "198.19.0.10:80", 20);
    assert!(
        without_daemon.iter().all(|o| o.is_ok()),
        "{without_daemon:?}"
    );
    assert_eq!(reached(&without_daemon).len(), 2);

    let cleanup = xtask::seccomp::command(FASTPATH)
        .args(["--cleanup", "--bpf-pin-dir", pin_arg])
        .output()
        .unwrap();
    assert!(
        cleanup.status.success(),
        "{}",
        String::from_utf8_lossy(&cleanup.stderr)
    );
    assert!(
        eventually(3, || !tcp(&bed, "198.19.0.10:80", 1)[0].is_ok()),
        "nothing translates after --cleanup"
    );
    assert!(!pin.exists(), "the pin folder is gone");
}

/// Our programs on `device` in the bed's node namespace (tcx, ingress and egress).
fn tc_programs(bed: &xtask::testbed::Testbed, device: &str) -> Vec<String> {
    xtask::netns::in_netns(bed.node_netns(), || {
        let mut names = Vec::new();
        for dir in [TcAttachType::Ingress, TcAttachType::Egress] {
            let (_, progs) = SchedClassifier::query_tcx(device, dir).expect("tcx query");
            names.extend(
                progs
                    .iter()
                    .filter_map(|p| p.name_as_str().map(str::to_string)),
            );
        }
        names
    })
    .unwrap()
}

/// What a proxier for the bed's node namespace can leave there: chains (either family),
/// nftables tables other than iptables-nft's own, and our tc programs on `device`.
fn ours_in_node(bed: &xtask::testbed::Testbed, device: &str) -> Vec<String> {
    let mut ours = Vec::new();
    for tool in ["iptables-save", "ip6tables-save"] {
        let saved = saved(bed.node_netns(), tool);
        ours.extend(
            chains_with(&saved, "KUBE-")
                .into_iter()
                .chain(chains_with(&saved, "FASTPATH"))
                .map(|c| format!("{tool}: chain {c}")),
        );
    }
    let mut nft = std::process::Command::new("ip");
    nft.args(["netns", "exec", bed.node_netns(), "nft", "list", "tables"]);
    let tables = xtask::cmd::output(&mut nft).expect("nft list tables");
    ours.extend(
        tables
            .lines()
            .filter(|t| {
                !["filter", "nat", "mangle", "raw", "security"]
                    .iter()
                    .any(|n| t.ends_with(&format!(" {n}")))
            })
            .map(|t| format!("nft: {t}")),
    );
    ours.extend(
        tc_programs(bed, device)
            .into_iter()
            .map(|p| format!("tc on {device}: {p}")),
    );
    ours
}

#[test]
fn cleanup_for_a_namespace_leaves_nothing_of_ours() {
    let (bed, pods) = bed_with_pods("cleanall", 2);
    route_services(&bed);
    let fs = Bpffs::mount(bed.dir());
    let pin = fs.0.join("fastpath");
    let pin_arg = pin.to_str().unwrap();
    let device = pods[0].node_veth.as_str();
    let manifests = bed.dir().join("manifests.yaml");
    std::fs::write(&manifests, web_manifest(&[pod_ip(1), pod_ip(2)])).unwrap();
    let daemon = |mode: &str, extra: &[&str]| start_in_node(&bed, mode, &manifests, extra);

    // eBPF mode with pins: its cgroup programs and its tc programs stay after it stops.
    let mut ebpf = daemon(
        "ebpf",
        &["--bpf-pin-dir", pin_arg, "--nodeport-devices", device],
    );
    assert!(
        eventually(20, || tcp(&bed, WEB, 1)[0].is_ok()),
        "never reachable:\n{}",
        ebpf.log()
    );
    assert!(ebpf.stop().success(), "{}", ebpf.log());
    assert!(!tc_programs(&bed, device).is_empty(), "tc programs pinned");
    // The iptables mode's chains stay after a plain stop too, as kube-proxy's do.
    let mut ipt = daemon("iptables", &[]);
    assert!(
        eventually(20, || !chains_with(
            &saved(bed.node_netns(), "iptables-save"),
            "KUBE-SVC-"
        )
        .is_empty()),
        "{}",
        ipt.log()
    );
    assert!(ipt.stop().success(), "{}", ipt.log());
    assert!(!ours_in_node(&bed, device).is_empty());

    let cleanup = cleanup_in(&bed, pin_arg);
    let log = String::from_utf8_lossy(&cleanup.stdout);
    let left = ours_in_node(&bed, device);
    assert!(left.is_empty(), "left after --cleanup: {left:#?}\n{log}");
    assert!(!pin.exists(), "the pin folder is gone:\n{log}");
    // Nothing translates any more: the cgroup programs went with their pinned links.
    assert!(
        !tcp(&bed, WEB, 1)[0].is_ok(),
        "the ClusterIP still answers after --cleanup"
    );
}

/// A node moved off eBPF mode (here to iptables, the proxier in a namespace, as on the
/// cluster bed's nodes) loses the pinned programs of the folder it was told with
/// --bpf-pin-dir: left pinned, they would go on translating with maps nobody updates.
#[test]
fn another_mode_removes_the_pins_of_its_bpf_pin_dir() {
    let (bed, _pods) = bed_with_pods("pinmode", 1);
    let fs = Bpffs::mount(bed.dir());
    let pin = fs.0.join("node-a");
    let web = web_service("web", Ipv4Addr::new(198, 19, 0, 10));
    let eps = Some(web_endpoints(vec![ready(pod_ip(1))]));
    let mut ebpf = BpfDataplane::attach_pinned(bed.cgroup_path(), Some(&pin)).unwrap();
    ebpf.sync(
        &state_of(vec![(web, eps)]),
        &NodeInfo::default(),
        Scope::Full,
    );
    drop(ebpf);
    assert!(
        tcp(&bed, "198.19.0.10:80", 1)[0].is_ok(),
        "pinned: translated with no daemon"
    );

    proxy_userland::dataplane::mode::cleanup_leftovers(
        proxy_userland::dataplane::mode::Mode::Iptables,
        Some(bed.node_netns()),
        Some(&pin),
    );
    assert!(!pin.exists(), "{} is still there", pin.display());
    assert!(
        eventually(3, || !tcp(&bed, "198.19.0.10:80", 1)[0].is_ok()),
        "the ClusterIP is still translated by the eBPF programs"
    );
}

fn pod_links_pinned(pin: &Path) -> usize {
    std::fs::read_dir(loader::PinLayout::new(pin).pod_links)
        .map(|d| d.count())
        .unwrap_or(0)
}

/// With the pod path on, the socket hooks leave pods' UDP to the pods' devices: their links
/// are pinned too, so a pod's UDP to a ClusterIP keeps its answers while no daemon runs (an
/// upgrade), the next daemon replaces them, a device that goes takes its pins along, and
/// `--cleanup` removes them.
#[test]
fn pods_udp_keeps_getting_answers_through_a_restart_with_pinned_pod_links() {
    let b = PinnedPods::new("pinpods", &[pod_ip(1), pod_ip(2)]);
    let first = b.answering_daemon();
    // Each datagram from a new socket, across the restart.
    let udp = b.udp_across(150, true);
    b.stop(first); // the daemon exits...
    std::thread::sleep(Duration::from_millis(700)); // ...nobody runs for a while...
    let mut second = b.daemon(); // ...and the next one starts.
    answered_from_the_cluster_ip(udp, 150, &second, "the restart");
    // Three pods' devices, an ingress and an egress link each: one generation, not two.
    assert!(
        eventually(5, || pod_links_pinned(&b.pin) == 6),
        "{} pod links pinned",
        pod_links_pinned(&b.pin)
    );

    // A pod goes: its device's pins go with it.
    xtask::cmd::ip(["-n", b.bed.node_netns(), "link", "del", "fpv1"]).expect("pod device gone");
    assert!(
        eventually(5, || pod_links_pinned(&b.pin) == 4),
        "{} pod links pinned after fpv1 went",
        pod_links_pinned(&b.pin)
    );

    assert!(second.stop().success(), "{}", second.log());
    let veth = &b.client.node_veth;
    assert!(
        !tc_programs(&b.bed, veth).is_empty(),
        "the pod's programs stay attached without a daemon"
    );
    cleanup_in(&b.bed, b.pin_arg());
    assert!(
        eventually(3, || tc_programs(&b.bed, veth).is_empty()),
        "left on the pod's device after --cleanup: {:?}",
        tc_programs(&b.bed, veth)
    );
    assert!(!b.pin.exists(), "the pin folder is gone");
}

/// The filters that spare packets no Service's the map lookups (`proxy_common::filter`)
/// came after the maps they guard. A daemon upgraded from one without them makes them
/// afresh beside pinned flows, and must fill them before its programs read them: else the
/// pod's live flow, one connected UDP socket, would lose its answers (their reply entry
/// filtered out) and its datagrams their translation.
#[test]
fn an_upgrade_that_adds_the_filters_keeps_a_pods_udp_flow_answered() {
    use proxy_common::maps::{FRONT_FILTER, NODE_PORTS, REPLY_FILTER};

    let b = PinnedPods::new("pinflt", &[pod_ip(1)]);
    let first = b.answering_daemon();
    // One socket, one flow, across the upgrade.
    let udp = b.udp_across(120, false);
    b.stop(first);
    let maps = loader::PinLayout::new(&b.pin).maps;
    for name in [FRONT_FILTER, NODE_PORTS, REPLY_FILTER] {
        std::fs::remove_file(maps.join(name)).expect("the filter was pinned");
    }
    let mut second = b.daemon();
    answered_from_the_cluster_ip(udp, 120, &second, "the upgrade");
    assert!(second.stop().success(), "{}", second.log());
    cleanup_in(&b.bed, b.pin_arg());
}

/// The replies' filter was laid out anew (`FP_REPLY_BITS` -> `FP_REPLY_BITS2`: a client's
/// ports share a cache line). A daemon upgraded from the old layout finds only the old
/// map pinned: it fills the new one from the pinned flows before its programs read it, so
/// the pod's live UDP flow keeps its answers, and removes the old pin once its programs
/// are attached.
#[test]
fn an_upgrade_that_relays_the_reply_filter_keeps_the_flow_and_drops_the_old_pin() {
    use proxy_common::maps::{REPLY_FILTER, RETIRED};

    let b = PinnedPods::new("pinrly", &[pod_ip(1)]);
    let first = b.answering_daemon();
    let udp = b.udp_across(120, false);
    b.stop(first);
    let maps = loader::PinLayout::new(&b.pin).maps;
    // What the earlier daemon left: its filter under the old name, none under the new.
    std::fs::rename(maps.join(REPLY_FILTER), maps.join(RETIRED[0])).expect("renamed");
    let mut second = b.daemon();
    answered_from_the_cluster_ip(udp, 120, &second, "the upgrade");
    assert!(
        maps.join(REPLY_FILTER).exists() && !maps.join(RETIRED[0]).exists(),
        "the new filter is pinned and the old one gone: {:?}",
        std::fs::read_dir(&maps).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
    );
    assert!(second.stop().success(), "{}", second.log());
    cleanup_in(&b.bed, b.pin_arg());
}

/// A bed whose client pod's UDP to `demo/web` takes the pod path, with daemons that pin
/// in a bpffs of its own.
struct PinnedPods {
    // Unmounted before the bed goes (fields drop in order).
    _fs: Bpffs,
    pin: std::path::PathBuf,
    manifests: std::path::PathBuf,
    bed: xtask::testbed::Testbed,
    client: xtask::testbed::Pod,
}

impl PinnedPods {
    /// `demo/web`'s endpoints are `pods`.
    fn new(tag: &str, pods: &[Ipv4Addr]) -> Self {
        let (bed, client) = bed_with_client(tag, false);
        let fs = Bpffs::mount(bed.dir());
        let manifests = bed.dir().join("manifests.yaml");
        std::fs::write(&manifests, web_manifest(pods)).unwrap();
        Self {
            pin: fs.0.join("fastpath"),
            _fs: fs,
            manifests,
            bed,
            client,
        }
    }

    fn pin_arg(&self) -> &str {
        self.pin.to_str().unwrap()
    }

    /// A daemon with the pod path on the bed's pods' devices, maps and links pinned.
    fn daemon(&self) -> Daemon {
        Daemon::start(
            self.bed.cgroup_path(),
            &[
                "--proxy-mode",
                "ebpf",
                "--netns",
                self.bed.node_netns(),
                "--pod-interface-name-prefix",
                "fpv",
                "--manifests",
                self.manifests.to_str().unwrap(),
                "--bpf-pin-dir",
                self.pin_arg(),
                "--healthz-bind-address",
                "",
                "--metrics-bind-address",
                "",
            ],
        )
    }

    /// A daemon whose pod path answers the client's UDP already.
    fn answering_daemon(&self) -> Daemon {
        let daemon = self.daemon();
        let once = ["udp", WEB_DNS, "--count", "1", "--timeout-ms", "500"];
        assert!(
            eventually(20, || pod_probe(&self.bed, &self.client, &once)[0].is_ok()),
            "the pod's UDP never got an answer; log:\n{}",
            daemon.log()
        );
        daemon
    }

    /// `count` datagrams 20 ms apart from the client pod, from one socket or (`fresh`) a
    /// new one each, started half a second before this returns.
    fn udp_across(&self, count: usize, fresh: bool) -> std::thread::JoinHandle<Output> {
        let mut cmd = pod_client(&self.bed, &self.client);
        let count = count.to_string();
        cmd.args(["udp", WEB_DNS, "--count", &count, "--interval-ms", "20"]);
        cmd.args(["--timeout-ms", "1000"]);
        if fresh {
            cmd.arg("--fresh-socket");
        }
        let udp = std::thread::spawn(move || cmd.output().expect("probe runs"));
        std::thread::sleep(Duration::from_millis(500));
        udp
    }

    fn stop(&self, mut daemon: Daemon) {
        assert!(daemon.stop().success(), "{}", daemon.log());
    }
}

/// Every one of the `count` datagrams of `udp` was answered, from the ClusterIP, across
/// `what`; `daemon`'s log if not.
fn answered_from_the_cluster_ip(
    udp: std::thread::JoinHandle<Output>,
    count: usize,
    daemon: &Daemon,
    what: &str,
) {
    let out = udp.join().unwrap();
    let outcomes = xtask::probe::parse(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(outcomes.len(), count);
    let failed: Vec<_> = outcomes.iter().filter(|o| !o.is_ok()).collect();
    assert!(
        failed.is_empty(),
        "{} of {count} datagrams went unanswered across {what}: {failed:?}\n{}",
        failed.len(),
        daemon.log()
    );
    let elsewhere: Vec<_> = outcomes
        .iter()
        .filter(|o| from(o) != Some(WEB_DNS))
        .collect();
    assert!(
        elsewhere.is_empty(),
        "replies must come from the ClusterIP: {elsewhere:?}\n{}",
        daemon.log()
    );
}

/// `fastpath --cleanup` for the bed's node namespace and pin folder `pin_arg`, which must
/// succeed; its output.
fn cleanup_in(bed: &xtask::testbed::Testbed, pin_arg: &str) -> std::process::Output {
    let cleanup = xtask::seccomp::command(FASTPATH)
        .args([
            "--cleanup",
            "--netns",
            bed.node_netns(),
            "--bpf-pin-dir",
            pin_arg,
        ])
        .output()
        .unwrap();
    assert!(
        cleanup.status.success(),
        "{}",
        String::from_utf8_lossy(&cleanup.stderr)
    );
    cleanup
}
