//! The iptables proxier with real rules and real packets: rules restored inside a test
//! bed's node namespace (never the host's tables), clients in that namespace and in an
//! "external" one. The behaviours both rule-based modes share (node ports, the Local
//! policy, dual stack, load-balancer source ranges) run against the nftables proxier too.

mod common;
mod nat_common;

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    time::Instant,
};

use common::*;
use nat_common::*;
use proxy_userland::{
    dataplane::{
        Dataplane, Scope, SyncReport,
        iptables::{Family, IptablesConfig, IptablesDataplane, RenderConfig},
        nftables::{NftablesConfig, NftablesDataplane},
    },
    model::{Endpoint, NodeInfo, ProxyState, ServiceRanges},
};
use xtask::testbed::Testbed;

fn proxier(bed: &Testbed) -> IptablesDataplane {
    route_services(bed);
    IptablesDataplane::new(IptablesConfig {
        netns: Some(bed.node_netns().to_string()),
        families: vec![Family::V4],
        cleanup_on_exit: true,
        ..Default::default()
    })
    .expect("iptables proxier in the node namespace")
}

/// The rule-based dataplanes: a behaviour written once runs against each.
#[derive(Clone, Copy)]
enum Rules {
    Iptables,
    Nftables,
}

enum RuleProxier {
    Iptables(IptablesDataplane),
    Nftables(NftablesDataplane),
}

impl Rules {
    /// A short prefix for the bed's names.
    fn tag(self) -> &'static str {
        match self {
            Rules::Iptables => "ipt",
            Rules::Nftables => "nft",
        }
    }

    /// The proxier in the bed's node namespace.
    fn proxier(self, bed: &Testbed, families: Vec<Family>, render: RenderConfig) -> RuleProxier {
        let netns = Some(bed.node_netns().to_string());
        match self {
            Rules::Iptables => RuleProxier::Iptables(
                IptablesDataplane::new(IptablesConfig {
                    netns,
                    families,
                    render,
                    cleanup_on_exit: true,
                    ..Default::default()
                })
                .expect("iptables proxier in the node namespace"),
            ),
            Rules::Nftables => RuleProxier::Nftables(
                NftablesDataplane::new(NftablesConfig {
                    netns,
                    families,
                    render,
                    cleanup_on_exit: true,
                })
                .expect("nftables proxier in the node namespace"),
            ),
        }
    }
}

impl RuleProxier {
    fn sync(&mut self, state: &ProxyState, node: &NodeInfo, scope: Scope<'_>) -> SyncReport {
        match self {
            RuleProxier::Iptables(dp) => dp.sync(state, node, scope),
            RuleProxier::Nftables(dp) => dp.sync(state, node, scope),
        }
    }
}

fn on(node: &str, ep: Endpoint) -> Endpoint {
    ep.placed(|at| {
        at.node_name = Some(node.into());
    })
}

#[test]
fn cluster_ip_reaches_every_backend_over_tcp_and_udp() {
    let (bed, _pods) = bed_with_pods("iptspread", 3);
    let mut dp = proxier(&bed);
    let eps = web_endpoints(vec![ready(pod_ip(1)), ready(pod_ip(2)), ready(pod_ip(3))]);
    let report = dp.sync(
        &state_of(vec![(web_service("web", WEB_IP), Some(eps))]),
        &node(),
        Scope::Full,
    );
    assert!(report.failed.is_empty(), "{report:?}");
    assert_eq!(report.frontends_written, 2);

    let attempts = tcp(&bed, WEB, 60);
    assert!(attempts.iter().all(|a| a.is_ok()), "{attempts:?}");
    let all: BTreeSet<String> = ["pod-1", "pod-2", "pod-3"].map(String::from).into();
    assert_eq!(reached(&attempts), all);
    for pod in &all {
        let n = attempts
            .iter()
            .filter(|a| a.reply() == Some(pod.as_str()))
            .count();
        // 1/3, 1/2, 1: each pod a third. P(fewer than 5 of 60) is about 1e-5.
        assert!(n >= 5, "{pod} got only {n} of 60 connections");
    }
    assert!(
        attempts.iter().all(|a| peer(a) == Some(WEB)),
        "conntrack undoes the DNAT"
    );

    let udp = run_probe(
        &bed,
        &[
            "udp",
            WEB_DNS,
            "--count",
            "10",
            "--timeout-ms",
            "2000",
            "--fresh-socket",
        ],
    );
    for a in &udp {
        assert!(a.is_ok(), "{a:?}");
        assert_eq!(
            from(a),
            Some(WEB_DNS),
            "the reply comes from the cluster IP: {a:?}"
        );
    }
}

#[test]
fn a_service_without_endpoints_is_refused() {
    let (bed, _pods) = bed_with_pods("iptnoeps", 1);
    let mut dp = proxier(&bed);
    let empty = web_service("empty", Ipv4Addr::new(198, 19, 0, 11));
    dp.sync(&state_of(vec![(empty, None)]), &node(), Scope::Full);

    let started = Instant::now();
    let attempts = tcp(&bed, "198.19.0.11:80", 3);
    for a in &attempts {
        assert_eq!(
            a.errno(),
            Some("ECONNREFUSED"),
            "REJECT in the filter table: {a:?}"
        );
    }
    assert!(
        started.elapsed().as_secs_f64() < 1.5,
        "refused at once, not timed out"
    );
    let filter = saved(bed.node_netns(), "iptables-save");
    assert!(
        filter.contains("\"demo/empty:http has no endpoints\""),
        "{filter}"
    );
}

#[test]
fn client_ip_affinity_keeps_a_client_on_one_backend() {
    let (bed, _pods) = bed_with_pods("iptaff", 3);
    let mut dp = proxier(&bed);
    let mut svc = web_service("web", WEB_IP);
    svc.affinity_timeout = Some(600);
    let eps = web_endpoints(vec![ready(pod_ip(1)), ready(pod_ip(2)), ready(pod_ip(3))]);
    dp.sync(&state_of(vec![(svc, Some(eps))]), &node(), Scope::Full);

    let attempts = tcp(&bed, WEB, 20);
    assert!(attempts.iter().all(|a| a.is_ok()), "{attempts:?}");
    assert_eq!(
        reached(&attempts).len(),
        1,
        "one client, one backend: {attempts:?}"
    );
}

#[test]
fn node_port_is_reached_from_another_namespace_and_local_policy_keeps_it_local() {
    node_port_and_local_policy(Rules::Iptables)
}

#[test]
fn node_port_is_reached_from_another_namespace_and_local_policy_keeps_it_local_nftables() {
    node_port_and_local_policy(Rules::Nftables)
}

fn node_port_and_local_policy(rules: Rules) {
    let (mut bed, _pods) = bed_with_pods(&format!("{}nodep", rules.tag()), 2);
    let ext = external_client(&mut bed);
    route_services(&bed);
    let mut dp = rules.proxier(&bed, vec![Family::V4], RenderConfig::default());
    let mut cluster = web_service("web", WEB_IP);
    cluster.ports[0].node_port = Some(30080);
    let mut local = web_service("local", Ipv4Addr::new(198, 19, 0, 12));
    local.ports[0].node_port = Some(30081);
    local.external_policy_local = true;
    // pod-1 runs on this node, pod-2 elsewhere.
    let eps = || {
        web_endpoints(vec![
            on("node-a", ready(pod_ip(1))),
            on("node-b", ready(pod_ip(2))),
        ])
    };
    // Local policy with every endpoint elsewhere: nothing here may answer.
    let mut remote = web_service("remote", Ipv4Addr::new(198, 19, 0, 13));
    remote.ports[0].node_port = Some(30082);
    remote.external_policy_local = true;
    let elsewhere = web_endpoints(vec![on("node-b", ready(pod_ip(2)))]);
    let report = dp.sync(
        &state_of(vec![
            (cluster, Some(eps())),
            (local, Some(eps())),
            (remote, Some(elsewhere)),
        ]),
        &node(),
        Scope::Full,
    );
    assert!(report.failed.is_empty(), "{report:?}");

    let node_ip = bed.node_ipv4().to_string();
    let dropped = probe_from(
        &ext.netns,
        &[
            "tcp",
            &format!("{node_ip}:30082"),
            "--count",
            "2",
            "--timeout-ms",
            "500",
        ],
    );
    assert!(
        dropped.iter().all(|a| !a.is_ok()),
        "Local policy without a local endpoint must not reach pod-2 elsewhere: {dropped:?}"
    );
    let attempts = probe_from(
        &ext.netns,
        &[
            "tcp",
            &format!("{node_ip}:30080"),
            "--count",
            "30",
            "--timeout-ms",
            "2000",
        ],
    );
    assert!(attempts.iter().all(|a| a.is_ok()), "{attempts:?}");
    assert_eq!(
        reached(&attempts).len(),
        2,
        "Cluster policy uses both pods: {attempts:?}"
    );

    let attempts = probe_from(
        &ext.netns,
        &[
            "tcp",
            &format!("{node_ip}:30081"),
            "--count",
            "20",
            "--timeout-ms",
            "2000",
        ],
    );
    assert!(
        attempts.iter().all(|a| a.reply() == Some("pod-1")),
        "Local policy: this node's pod only: {attempts:?}"
    );

    // The node itself may use the node port too.
    assert!(
        tcp(&bed, &format!("{node_ip}:30080"), 3)
            .iter()
            .all(|a| a.is_ok())
    );
}

#[test]
fn unchanged_syncs_skip_the_restore_and_removed_services_leave_nothing() {
    let (bed, _pods) = bed_with_pods("iptincr", 2);
    let mut dp = proxier(&bed);
    let a = web_service("a", WEB_IP);
    let b = web_service("b", Ipv4Addr::new(198, 19, 0, 20));
    let two = || Some(web_endpoints(vec![ready(pod_ip(1)), ready(pod_ip(2))]));
    let state = state_of(vec![(a.clone(), two()), (b.clone(), two())]);
    dp.sync(&state, &node(), Scope::Full);
    assert_eq!(dp.restores(), 1);
    let report = dp.sync(&state, &node(), Scope::Full);
    assert_eq!(dp.restores(), 1, "nothing changed, nothing written");
    assert_eq!(report.frontends_written + report.frontends_removed, 0);

    // b loses pod-2: one restore, b's frontends rewritten.
    let state = state_of(vec![
        (a.clone(), two()),
        (b.clone(), Some(web_endpoints(vec![ready(pod_ip(1))]))),
    ]);
    let changed = BTreeSet::from([b.key.clone()]);
    let report = dp.sync(&state, &node(), Scope::Changed(&changed));
    assert_eq!((dp.restores(), report.frontends_written), (2, 2));
    assert!(
        tcp(&bed, "198.19.0.20:80", 10)
            .iter()
            .all(|x| x.reply() == Some("pod-1"))
    );

    // Someone flushes the nat table: the next full sync notices and puts everything back.
    let mut flush = std::process::Command::new("ip");
    flush.args([
        "netns",
        "exec",
        bed.node_netns(),
        "iptables",
        "-t",
        "nat",
        "-F",
    ]);
    xtask::cmd::output(&mut flush).unwrap();
    dp.sync(&state, &node(), Scope::Full);
    assert_eq!(dp.restores(), 3);
    assert!(tcp(&bed, WEB, 4).iter().all(|x| x.is_ok()), "repaired");

    // All services gone: their chains go too.
    dp.sync(&state_of(vec![]), &node(), Scope::Full);
    let nat = saved(bed.node_netns(), "iptables-save");
    for prefix in ["KUBE-SVC-", "KUBE-SEP-"] {
        assert!(chains_with(&nat, prefix).is_empty(), "{nat}");
    }
    assert!(!tcp(&bed, WEB, 1)[0].is_ok());

    // Shutting down with cleanup_on_exit removes our chains and the jumps into them.
    dp.shutdown();
    let after = saved(bed.node_netns(), "iptables-save");
    assert!(chains_with(&after, "KUBE-").is_empty(), "{after}");
    assert!(!after.contains("-j KUBE-"), "{after}");
}

/// A bed whose pod-1 serves TCP 8080 in both families, with both families' service
/// ranges (198.19.0.0/16, 2001:db8:5::/64) routed into the node.
fn dual_stack_bed(tag: &str) -> Testbed {
    let mut bed = Testbed::new(tag).expect("test bed");
    let pod = bed
        .add_pod("pod-1", pod_ip(1), Some("2001:db8:1::11".parse().unwrap()))
        .expect("pod");
    bed.serve(
        probe(),
        &pod,
        &["--tcp", "0.0.0.0:8080", "--tcp", "[::]:8080"],
    )
    .expect("server");
    route_services(&bed);
    xtask::cmd::ip([
        "-n",
        bed.node_netns(),
        "-6",
        "route",
        "add",
        "2001:db8:5::/64",
        "dev",
        "fpsvc0",
    ])
    .unwrap();
    bed
}

#[test]
fn dual_stack_services_are_programmed_in_both_families() {
    dual_stack_services(Rules::Iptables)
}

#[test]
fn dual_stack_services_are_programmed_in_both_families_nftables() {
    dual_stack_services(Rules::Nftables)
}

fn dual_stack_services(rules: Rules) {
    let bed = dual_stack_bed(&format!("{}v6", rules.tag()));
    let mut dp = rules.proxier(&bed, vec![Family::V4, Family::V6], RenderConfig::default());
    let mut svc = web_service("web", WEB_IP);
    svc.cluster_ips.push("2001:db8:5::10".parse().unwrap());
    let mut v6 = ready(pod_ip(1));
    v6.ip = IpAddr::V6("2001:db8:1::11".parse().unwrap());
    let eps = web_endpoints(vec![ready(pod_ip(1)), v6]);
    let report = dp.sync(&state_of(vec![(svc, Some(eps))]), &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");
    // Both families commit in one namespace, so one family's restore is no foreign commit
    // to the other's (it was, and every periodic sync read both back).
    if let RuleProxier::Iptables(dp) = &dp
        && iptables_is_nft()
    {
        assert!(dp.tables_known_unchanged(), "known after our own restores");
    }

    assert_eq!(tcp(&bed, WEB, 1)[0].reply(), Some("pod-1"));
    let v6 = tcp(&bed, "[2001:db8:5::10]:80", 3);
    assert!(v6.iter().all(|a| a.reply() == Some("pod-1")), "{v6:?}");
    assert!(
        v6.iter().all(|a| peer(a) == Some("[2001:db8:5::10]:80")),
        "{v6:?}"
    );
}

/// The service ranges in both families: REJECT, last in filter KUBE-SERVICES, for new
/// traffic into a range that no rule translated (an address no Service holds, or a held
/// one on a port it does not serve): refused at once, where it used to time out on the
/// route. Outside the ranges nothing changes. Leaving takes the rules along.
#[test]
fn the_service_ranges_reject_what_no_service_serves_in_both_families() {
    let bed = dual_stack_bed("iptrange");
    let mut dp = IptablesDataplane::new(IptablesConfig {
        netns: Some(bed.node_netns().to_string()),
        families: vec![Family::V4, Family::V6],
        cleanup_on_exit: true,
        ..Default::default()
    })
    .expect("proxier");
    let mut svc = web_service("web", WEB_IP);
    svc.cluster_ips.push("2001:db8:5::10".parse().unwrap());
    let mut v6 = ready(pod_ip(1));
    v6.ip = IpAddr::V6("2001:db8:1::11".parse().unwrap());
    let mut state = state_of(vec![(svc, Some(web_endpoints(vec![ready(pod_ip(1)), v6])))]);
    state.service_ranges = ServiceRanges::new(vec![
        "198.19.0.0/17".parse().unwrap(),
        "2001:db8:5::/112".parse().unwrap(),
    ]);
    let report = dp.sync(&state, &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");

    for held in [WEB, "[2001:db8:5::10]:80"] {
        let ok = tcp(&bed, held, 3);
        assert!(
            ok.iter().all(|a| a.reply() == Some("pod-1")),
            "{held}: {ok:?}"
        );
    }
    for target in [
        "198.19.0.99:80",
        "198.19.0.10:81",
        "[2001:db8:5::99]:80",
        "[2001:db8:5::10]:81",
    ] {
        let started = Instant::now();
        let out = tcp(&bed, target, 5);
        assert!(
            out.iter().all(|a| a.errno() == Some("ECONNREFUSED")),
            "{target}: {out:?}"
        );
        assert!(
            started.elapsed().as_millis() < 500,
            "{target}: refused at once, not timed out ({:?})",
            started.elapsed()
        );
    }
    for outside in ["198.19.200.1:80", "[2001:db8:5::1:1]:80"] {
        let out = run_probe(
            &bed,
            &["tcp", outside, "--count", "1", "--timeout-ms", "300"],
        );
        assert_eq!(
            out[0].errno(),
            Some("ETIMEDOUT"),
            "{outside}: untouched: {out:?}"
        );
    }

    dp.shutdown();
    for tool in ["iptables-save", "ip6tables-save"] {
        let after = saved(bed.node_netns(), tool);
        assert!(!after.contains("service range"), "{tool}: {after}");
    }
}

fn conntrack_udp(netns: &str) -> String {
    let mut cmd = std::process::Command::new("ip");
    cmd.args(["netns", "exec", netns, "conntrack", "-L", "-p", "udp"]);
    // conntrack prints its summary on stderr; the entries on stdout.
    xtask::cmd::output(&mut cmd).unwrap_or_default()
}

/// kube-proxy's e2e "should be able to preserve UDP traffic when server pod cycles for a
/// ClusterIP service": a client keeps sending from one source port while its server pod is
/// replaced; once the old pod is removed from the service, the client must reach the new
/// one. Without deleting the conntrack entry, every datagram of the flow stays on the old
/// pod for as long as the client keeps sending.
#[test]
fn should_be_able_to_preserve_udp_traffic_when_server_pod_cycles_for_a_cluster_ip_service() {
    let (bed, _pods) = bed_with_pods("iptudpcyc", 2);
    let mut dp = proxier(&bed);
    let svc = web_service("web", WEB_IP);
    let one = |i| {
        state_of(vec![(
            svc.clone(),
            Some(web_endpoints(vec![ready(pod_ip(i))])),
        )])
    };
    let report = dp.sync(&one(1), &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");

    // One socket, so one source port, for the whole run: about 6 s of datagrams.
    let ns = bed.node_netns().to_string();
    let client = std::thread::spawn(move || {
        probe_from(
            &ns,
            &[
                "udp",
                WEB_DNS,
                "--count",
                "40",
                "--interval-ms",
                "150",
                "--timeout-ms",
                "400",
            ],
        )
    });
    std::thread::sleep(std::time::Duration::from_millis(1500));
    // pod-1 is replaced by pod-2 (pod-1's server keeps answering, as a pod that is still
    // terminating would).
    let changed = BTreeSet::from([svc.key.clone()]);
    let report = dp.sync(&one(2), &node(), Scope::Changed(&changed));
    assert!(report.failed.is_empty(), "{report:?}");
    let outcomes = client.join().expect("client thread");
    let replies: Vec<Option<&str>> = outcomes.iter().map(|o| o.reply()).collect();
    assert_eq!(replies.first(), Some(&Some("pod-1")), "{outcomes:?}");
    assert!(
        replies.iter().rev().take(10).all(|r| *r == Some("pod-2")),
        "after the change the same flow reaches the new pod: {outcomes:?}"
    );
    let entries = conntrack_udp(bed.node_netns());
    assert!(
        !entries
            .lines()
            .any(|l| l.contains("dst=198.19.0.10") && l.contains(&format!("src={}", pod_ip(1)))),
        "no entry to the old pod is left: {entries}"
    );
}

/// Issue 11: a chain of ours flushed by hand (`iptables -t nat -F KUBE-SERVICES`) was never
/// repaired, as the check compared chain names and jumps only. The next full sync (the
/// daemon's periodic one) puts it back. A LoadBalancer with source ranges and no endpoints
/// in the same ruleset no longer breaks the restore.
#[test]
fn a_chain_flushed_by_hand_is_repaired_by_the_next_full_sync() {
    let (bed, _pods) = bed_with_pods("iptflush", 1);
    let mut dp = proxier(&bed);
    let mut lb = web_service("lb", Ipv4Addr::new(198, 19, 0, 30));
    lb.load_balancer_ips = vec!["198.19.250.4".parse().unwrap()];
    lb.load_balancer_source_ranges = vec![("198.19.240.0".parse().unwrap(), 25)];
    let web = web_service("web", WEB_IP);
    let with = |eps| {
        state_of(vec![
            (lb.clone(), None),
            (web.clone(), Some(web_endpoints(eps))),
        ])
    };
    let report = dp.sync(
        &with(vec![ready(pod_ip(1)), ready(pod_ip(2))]),
        &node(),
        Scope::Full,
    );
    assert!(report.failed.is_empty(), "{report:?}");
    // With iptables-nft, our own restores leave the tables known (the nf_tables
    // generation moved by their commits alone), so periodic syncs skip reading them back
    // until someone else commits; a partial restore, which may leave a table it names
    // unchanged (no commit for it), keeps them known too.
    let nft = iptables_is_nft();
    if nft {
        assert!(dp.tables_known_unchanged(), "known after our own restore");
    }
    let state = with(vec![ready(pod_ip(1))]);
    let web_key = BTreeSet::from([proxy_userland::model::ServiceKey::new("demo", "web")]);
    let report = dp.sync(&state, &node(), Scope::Changed(&web_key));
    assert!(report.failed.is_empty(), "{report:?}");
    assert!(dp.restores() >= 2, "the change was restored");
    assert!(tcp(&bed, WEB, 2).iter().all(|a| a.is_ok()));
    if nft {
        assert!(dp.tables_known_unchanged(), "known after a partial restore");
    }

    let mut flush = std::process::Command::new("ip");
    flush.args([
        "netns",
        "exec",
        bed.node_netns(),
        "iptables",
        "-t",
        "nat",
        "-F",
        "KUBE-SERVICES",
    ]);
    xtask::cmd::output(&mut flush).unwrap();
    assert!(
        !tcp(&bed, WEB, 1)[0].is_ok(),
        "flushed: the cluster IP leads nowhere"
    );
    assert!(!dp.tables_known_unchanged(), "someone else committed");
    let report = dp.sync(&state, &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");
    assert!(tcp(&bed, WEB, 4).iter().all(|a| a.is_ok()), "repaired");
    if nft {
        assert!(dp.tables_known_unchanged(), "known again after the repair");
    }
}

/// The system's `iptables` is iptables-nft (Debian's default).
fn iptables_is_nft() -> bool {
    std::process::Command::new("iptables")
        .arg("--version")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("nf_tables"))
}

/// Issue 11: where a load balancer's IP is a local address, the node's own connection to
/// it has the LB IP as source; kube-proxy lets it through when the source ranges include
/// the node (allowFromNode). And --nodeport-addresses: node ports answer on the node
/// addresses in those networks only.
#[test]
fn node_reaches_a_local_lb_ip_through_source_ranges_and_node_ports_keep_to_their_addresses() {
    local_lb_ip_and_node_port_addresses(Rules::Iptables)
}

#[test]
fn node_reaches_a_local_lb_ip_through_source_ranges_and_node_ports_keep_to_their_addresses_nftables()
 {
    local_lb_ip_and_node_port_addresses(Rules::Nftables)
}

fn local_lb_ip_and_node_port_addresses(rules: Rules) {
    let (mut bed, _pods) = bed_with_pods(&format!("{}lbnode", rules.tag()), 1);
    let ext = external_client(&mut bed);
    route_services(&bed);
    let ns = bed.node_netns().to_string();
    let node_ip = bed.node_ipv4();
    for addr in ["198.19.250.4/32", "198.18.250.1/32"] {
        xtask::cmd::ip(["-n", &ns, "addr", "add", addr, "dev", "lo"]).expect("local address");
    }
    let render = RenderConfig {
        nodeport_addresses: vec![(IpAddr::V4(node_ip), 32)],
        ..Default::default()
    };
    let mut dp = rules.proxier(&bed, vec![Family::V4], render);
    let mut lb = web_service("lb", WEB_IP);
    lb.ports[0].node_port = Some(30080);
    lb.load_balancer_ips = vec!["198.19.250.4".parse().unwrap()];
    lb.load_balancer_source_ranges = vec![(IpAddr::V4(node_ip), 32)];
    let report = dp.sync(
        &state_of(vec![(lb, Some(web_endpoints(vec![ready(pod_ip(1))])))]),
        &node(),
        Scope::Full,
    );
    assert!(report.failed.is_empty(), "{report:?}");

    let to_lb = tcp(&bed, "198.19.250.4:80", 3);
    assert!(
        to_lb.iter().all(|a| a.reply() == Some("pod-1")),
        "{to_lb:?}"
    );
    // Another host, outside the source ranges, is kept out.
    let outsider = probe_from(
        &ext.netns,
        &[
            "tcp",
            "198.19.250.4:80",
            "--count",
            "2",
            "--timeout-ms",
            "500",
        ],
    );
    assert!(
        outsider.iter().all(|a| !a.is_ok()),
        "a client outside loadBalancerSourceRanges got in: {outsider:?}"
    );
    let on_node_ip = tcp(&bed, &format!("{node_ip}:30080"), 2);
    assert!(
        on_node_ip.iter().all(|a| a.reply() == Some("pod-1")),
        "{on_node_ip:?}"
    );
    let elsewhere = tcp(&bed, "198.18.250.1:30080", 1);
    assert_eq!(
        elsewhere[0].errno(),
        Some("ECONNREFUSED"),
        "not a node port address: {elsewhere:?}"
    );
}

/// A node where nothing has made the nat table yet, with enough services that the restore
/// starts by listing the table (how a big restore avoids iptables-nft's quadratic chain
/// bookkeeping): the first sync programs every service. The listing once made iptables-nft
/// take the nat table's base chains for existing, and every restore failed on the jumps
/// into them ("RULE_INSERT failed ... rule in chain OUTPUT"), on every sync, for good.
#[test]
fn a_big_first_restore_on_a_node_without_a_nat_table_programs_every_service() {
    let (bed, _pods) = bed_with_pods("iptbig", 1);
    let mut dp = proxier(&bed);
    let mut entries: Vec<_> = (0..150u8)
        .map(|i| {
            let ip = Ipv4Addr::new(198, 19, 2, i);
            let eps = (0..10u8)
                .map(|j| ready(Ipv4Addr::new(198, 18, 100 + i / 25, (i % 25) * 10 + j)))
                .collect();
            (
                web_service(&format!("svc-{i}"), ip),
                Some(web_endpoints(eps)),
            )
        })
        .collect();
    entries.push((
        web_service("web", WEB_IP),
        Some(web_endpoints(vec![ready(pod_ip(1))])),
    ));
    let report = dp.sync(&state_of(entries), &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{:?}", report.failed.first());
    let attempts = tcp(&bed, WEB, 5);
    assert!(attempts.iter().all(|a| a.is_ok()), "{attempts:?}");
}
