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

    // No endpoints: the relay resets connections at once instead of letting them hang.
    dp.sync(
        &state_of(vec![(svc.clone(), None)]),
        &node(),
        Scope::Changed(&changed),
    );
    let refused = tcp(&bed, WEB, 1);
    assert_eq!(refused[0].errno(), Some("ECONNRESET"), "{refused:?}");

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
