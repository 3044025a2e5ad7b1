//! The iptables proxier with real rules and real packets: rules restored inside a test
//! bed's node namespace (never the host's tables), clients in that namespace and in an
//! "external" one.

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
        Dataplane, Scope,
        iptables::{Family, IptablesConfig, IptablesDataplane},
    },
    model::Endpoint,
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

fn on(node: &str, ep: Endpoint) -> Endpoint {
    Endpoint {
        node_name: Some(node.into()),
        ..ep
    }
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
    let (mut bed, _pods) = bed_with_pods("iptnodep", 2);
    let ext = external_client(&mut bed);
    let mut dp = proxier(&bed);
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
    let report = dp.sync(
        &state_of(vec![(cluster, Some(eps())), (local, Some(eps()))]),
        &node(),
        Scope::Full,
    );
    assert!(report.failed.is_empty(), "{report:?}");

    let node_ip = bed.node_ipv4().to_string();
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

#[test]
fn dual_stack_services_are_programmed_in_both_families() {
    let mut bed = Testbed::new("iptv6").expect("test bed");
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
    let mut dp = IptablesDataplane::new(IptablesConfig {
        netns: Some(bed.node_netns().to_string()),
        families: vec![Family::V4, Family::V6],
        ..Default::default()
    })
    .expect("proxier");
    let mut svc = web_service("web", WEB_IP);
    svc.cluster_ips.push("2001:db8:5::10".parse().unwrap());
    let mut v6 = ready(pod_ip(1));
    v6.ip = IpAddr::V6("2001:db8:1::11".parse().unwrap());
    let eps = web_endpoints(vec![ready(pod_ip(1)), v6]);
    let report = dp.sync(&state_of(vec![(svc, Some(eps))]), &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");

    assert_eq!(tcp(&bed, WEB, 1)[0].reply(), Some("pod-1"));
    let v6 = tcp(&bed, "[2001:db8:5::10]:80", 3);
    assert!(v6.iter().all(|a| a.reply() == Some("pod-1")), "{v6:?}");
    assert!(
        v6.iter().all(|a| peer(a) == Some("[2001:db8:5::10]:80")),
        "{v6:?}"
    );
}
