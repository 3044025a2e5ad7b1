//! The userspace proxier with real traffic: relays whose sockets live in the test bed's
//! node namespace, reached through REDIRECT portals in that namespace's nat table.

mod common;
mod nat_common;

use std::{collections::BTreeSet, time::Duration};

use common::*;
use nat_common::*;
use proxy_userland::{
    dataplane::{
        Dataplane, Scope,
        frontends::Frontend,
        userspace::{UserspaceConfig, UserspaceDataplane, relay::RelayConfig},
    },
    model::Protocol,
};
use xtask::testbed::Testbed;

fn proxier(bed: &Testbed, idle: Duration) -> UserspaceDataplane {
    route_services(bed);
    UserspaceDataplane::new(UserspaceConfig {
        netns: Some(bed.node_netns().to_string()),
        relay: RelayConfig {
            udp_idle_timeout: idle,
        },
        cleanup_on_exit: true,
    })
    .expect("userspace proxier in the node namespace")
}

#[test]
fn tcp_and_udp_services_are_relayed_round_robin() {
    let (mut bed, _pods) = bed_with_pods("usrr", 2);
    let ext = external_client(&mut bed);
    let mut dp = proxier(&bed, Duration::from_secs(1));
    let eps = web_endpoints(vec![ready(pod_ip(1)), ready(pod_ip(2))]);
    let report = dp.sync(
        &state_of(vec![(web_service("web", WEB_IP), Some(eps))]),
        &node(),
        Scope::Full,
    );
    assert!(report.failed.is_empty(), "{report:?}");
    assert_eq!(report.frontends_written, 2);

    let attempts = tcp(&bed, WEB, 10);
    assert!(attempts.iter().all(|a| a.is_ok()), "{attempts:?}");
    let replies: Vec<_> = attempts
        .iter()
        .map(|a| a.reply().unwrap().to_string())
        .collect();
    // Round robin: strictly alternating.
    assert!(replies.windows(2).all(|w| w[0] != w[1]), "{replies:?}");
    assert!(
        attempts.iter().all(|a| peer(a) == Some(WEB)),
        "{attempts:?}"
    );

    // A fresh socket per attempt is a new flow each time: both pods answer, and every
    // answer comes from the cluster IP, whatever the redirect did.
    let udp = run_probe(
        &bed,
        &[
            "udp",
            WEB_DNS,
            "--count",
            "6",
            "--timeout-ms",
            "2000",
            "--fresh-socket",
        ],
    );
    assert!(
        udp.iter().all(|a| a.is_ok() && from(a) == Some(WEB_DNS)),
        "{udp:?}"
    );
    assert_eq!(reached(&udp).len(), 2, "{udp:?}");
    let connected = run_probe(
        &bed,
        &[
            "udp",
            WEB_DNS,
            "--count",
            "3",
            "--timeout-ms",
            "2000",
            "--connected",
        ],
    );
    assert!(
        connected
            .iter()
            .all(|a| a.is_ok() && peer(a) == Some(WEB_DNS)),
        "{connected:?}"
    );

    // From another namespace (a pod, through KUBE-PORTALS-CONTAINER in PREROUTING).
    let from_pod = probe_from(
        &ext.netns,
        &["tcp", WEB, "--count", "4", "--timeout-ms", "2000"],
    );
    assert!(from_pod.iter().all(|a| a.is_ok()), "{from_pod:?}");
    let from_pod_udp = probe_from(
        &ext.netns,
        &["udp", WEB_DNS, "--count", "2", "--timeout-ms", "2000"],
    );
    assert!(
        from_pod_udp
            .iter()
            .all(|a| a.is_ok() && from(a) == Some(WEB_DNS)),
        "{from_pod_udp:?}"
    );
}

#[test]
fn client_ip_affinity_and_endpoint_changes() {
    let (bed, _pods) = bed_with_pods("usaff", 3);
    let mut dp = proxier(&bed, Duration::from_secs(1));
    let mut svc = web_service("web", WEB_IP);
    svc.affinity_timeout = Some(600);
    let three = web_endpoints(vec![ready(pod_ip(1)), ready(pod_ip(2)), ready(pod_ip(3))]);
    dp.sync(
        &state_of(vec![(svc.clone(), Some(three))]),
        &node(),
        Scope::Full,
    );
    let attempts = tcp(&bed, WEB, 12);
    assert!(attempts.iter().all(|a| a.is_ok()), "{attempts:?}");
    let stuck = reached(&attempts);
    assert_eq!(stuck.len(), 1, "{attempts:?}");

    // The client's backend goes away: it moves, and stays on the new one.
    let gone = stuck.iter().next().unwrap().clone();
    let rest: Vec<_> = (1..=3u8)
        .filter(|i| format!("pod-{i}") != gone)
        .map(|i| ready(pod_ip(i)))
        .collect();
    let changed = BTreeSet::from([svc.key.clone()]);
    let report = dp.sync(
        &state_of(vec![(svc.clone(), Some(web_endpoints(rest)))]),
        &node(),
        Scope::Changed(&changed),
    );
    assert_eq!(report.frontends_written, 2);
    let after = reached(&tcp(&bed, WEB, 8));
    assert_eq!(after.len(), 1);
    assert!(!after.contains(&gone));

    // No endpoints: connections are refused at once instead of letting them hang.
    dp.sync(
        &state_of(vec![(svc.clone(), None)]),
        &node(),
        Scope::Changed(&changed),
    );
    let refused = tcp(&bed, WEB, 1);
    assert_eq!(refused[0].errno(), Some("ECONNREFUSED"), "{refused:?}");

    // The service removed: its portals go, so the cluster IP is no longer answered.
    dp.sync(&state_of(vec![]), &node(), Scope::Full);
    let nat = saved(bed.node_netns(), "iptables-save");
    assert!(!nat.contains("REDIRECT"), "{nat}");
    dp.shutdown();
    let after = saved(bed.node_netns(), "iptables-save");
    assert!(chains_with(&after, "KUBE-PORTALS").is_empty(), "{after}");
}

#[test]
fn idle_udp_flows_are_forgotten() {
    let (bed, _pods) = bed_with_pods("usidle", 1);
    let mut dp = proxier(&bed, Duration::from_millis(800));
    let eps = web_endpoints(vec![ready(pod_ip(1))]);
    dp.sync(
        &state_of(vec![(web_service("web", WEB_IP), Some(eps))]),
        &node(),
        Scope::Full,
    );
    let fe = Frontend::socket(WEB_IP.into(), 53, Protocol::Udp);

    let udp = run_probe(
        &bed,
        &[
            "udp",
            WEB_DNS,
            "--count",
            "3",
            "--timeout-ms",
            "2000",
            "--fresh-socket",
        ],
    );
    assert!(udp.iter().all(|a| a.is_ok()), "{udp:?}");
    let flows = dp.relays().udp_flows(fe).unwrap();
    assert!(flows >= 1, "the flows are still there right after");
    assert!(
        eventually(5, || dp.relays().udp_flows(fe).unwrap() == 0),
        "idle flows expire"
    );
    // And a new datagram makes a new flow.
    assert!(
        run_probe(
            &bed,
            &["udp", WEB_DNS, "--count", "1", "--timeout-ms", "2000"]
        )[0]
        .is_ok()
    );
}

/// kube-proxy REJECTs a service without endpoints, so a client (or a health check that only
/// connects) sees the connect fail. The relay used to accept and then reset.
#[test]
fn a_service_without_endpoints_refuses_the_connect() {
    let (mut bed, _pods) = bed_with_pods("usnoeps", 1);
    let ext = external_client(&mut bed);
    let mut dp = proxier(&bed, Duration::from_secs(1));
    let svc = web_service("web", WEB_IP);
    let changed = BTreeSet::from([svc.key.clone()]);
    let report = dp.sync(&state_of(vec![(svc.clone(), None)]), &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");

    let refused_everywhere = |what: &str| {
        let from_node = tcp(&bed, WEB, 2);
        let from_pod = probe_from(
            &ext.netns,
            &["tcp", WEB, "--count", "2", "--timeout-ms", "1000"],
        );
        // From a pod: an ICMP port unreachable. (A UDP send from the node itself fails with
        // EPERM instead, as with kube-proxy's REJECT in OUTPUT.)
        let udp = probe_from(
            &ext.netns,
            &[
                "udp",
                WEB_DNS,
                "--count",
                "1",
                "--timeout-ms",
                "1000",
                "--connected",
            ],
        );
        for a in from_node.iter().chain(&from_pod).chain(&udp) {
            assert_eq!(a.errno(), Some("ECONNREFUSED"), "{what}: {a:?}");
        }
    };
    refused_everywhere("a new service without endpoints");

    let eps = web_endpoints(vec![ready(pod_ip(1))]);
    dp.sync(
        &state_of(vec![(svc.clone(), Some(eps))]),
        &node(),
        Scope::Changed(&changed),
    );
    assert!(tcp(&bed, WEB, 2).iter().all(|a| a.reply() == Some("pod-1")));

    dp.sync(
        &state_of(vec![(svc.clone(), None)]),
        &node(),
        Scope::Changed(&changed),
    );
    refused_everywhere("after its last endpoint left");
}

/// The relays listen on every address (REDIRECT picks the address), but only traffic a
/// portal redirected may reach them: a ClusterIP service is not a node port.
#[test]
fn relays_are_not_reachable_from_other_hosts() {
    let (mut bed, _pods) = bed_with_pods("usguard", 1);
    let ext = external_client(&mut bed);
    let mut dp = proxier(&bed, Duration::from_secs(1));
    let eps = web_endpoints(vec![ready(pod_ip(1))]);
    dp.sync(
        &state_of(vec![(web_service("web", WEB_IP), Some(eps))]),
        &node(),
        Scope::Full,
    );
    let tcp_port = dp
        .relay_port(&Frontend::socket(WEB_IP.into(), 80, Protocol::Tcp))
        .expect("TCP relay");
    let udp_port = dp
        .relay_port(&Frontend::socket(WEB_IP.into(), 53, Protocol::Udp))
        .expect("UDP relay");

    // Through the cluster IP it works from the other host...
    let via_service = probe_from(
        &ext.netns,
        &["tcp", WEB, "--count", "2", "--timeout-ms", "2000"],
    );
    assert!(
        via_service.iter().all(|a| a.reply() == Some("pod-1")),
        "{via_service:?}"
    );
    // ...but not on the relay's port at the node's address.
    let node = bed.node_ipv4();
    let direct = probe_from(
        &ext.netns,
        &[
            "tcp",
            &format!("{node}:{tcp_port}"),
            "--count",
            "1",
            "--timeout-ms",
            "500",
        ],
    );
    assert!(
        !direct[0].is_ok(),
        "the TCP relay answered another host: {direct:?}"
    );
    let direct_udp = probe_from(
        &ext.netns,
        &[
            "udp",
            &format!("{node}:{udp_port}"),
            "--count",
            "1",
            "--timeout-ms",
            "500",
        ],
    );
    assert!(
        !direct_udp[0].is_ok(),
        "the UDP relay answered another host: {direct_udp:?}"
    );
}

/// A UDP client that keeps sending from one socket must not stay on a backend that left
/// the service (kube-proxy clears such conntrack entries); the relay used to keep the flow
/// for as long as datagrams kept coming.
#[test]
fn a_udp_flow_moves_off_a_removed_backend() {
    let (bed, _pods) = bed_with_pods("usudpmove", 2);
    let mut dp = proxier(&bed, Duration::from_secs(1));
    let svc = web_service("web", WEB_IP);
    let changed = BTreeSet::from([svc.key.clone()]);
    let one = web_endpoints(vec![ready(pod_ip(1))]);
    dp.sync(
        &state_of(vec![(svc.clone(), Some(one))]),
        &node(),
        Scope::Full,
    );

    // One socket, a datagram every 100 ms for 3 s: never idle long enough to expire.
    let mut cmd = bed.client(probe());
    cmd.args([
        "udp",
        WEB_DNS,
        "--count",
        "30",
        "--interval-ms",
        "100",
        "--timeout-ms",
        "500",
    ]);
    let client = std::thread::spawn(move || xtask::cmd::output(&mut cmd));
    std::thread::sleep(Duration::from_millis(1000));
    let two = web_endpoints(vec![ready(pod_ip(2))]);
    dp.sync(
        &state_of(vec![(svc.clone(), Some(two))]),
        &node(),
        Scope::Changed(&changed),
    );

    let out = xtask::probe::parse(&client.join().unwrap().expect("probe runs"));
    assert_eq!(out.len(), 30, "{out:?}");
    assert_eq!(out[0].reply(), Some("pod-1"), "{out:?}");
    assert!(
        out[out.len() - 10..]
            .iter()
            .all(|a| a.reply() == Some("pod-2")),
        "the flow moved to the remaining backend: {out:?}"
    );
}
