//! IPv6 and dual-stack through the socket programs (connect6, sendmsg6, recvmsg6,
//! getpeername6): one service with a v4 and a v6 ClusterIP, pods with both families; the
//! service ranges of both families.

mod common;

use std::time::{Duration, Instant};

use common::*;
use proxy_userland::{
    dataplane::{Dataplane, Scope, bpf::BpfDataplane},
    model::{NodeInfo, ServiceRanges},
};
use xtask::{probe::Outcome, testbed::Testbed};

#[test]
fn dual_stack_service_balances_each_family_to_its_own_pods() {
    let mut bed = Testbed::new("dualstack").expect("test bed");
    for i in 1..=2u8 {
        let pod = bed
            .add_pod(&format!("pod-{i}"), pod_ip(i), Some(pod_ip6(i)))
            .unwrap();
        bed.serve(
            probe(),
            &pod,
            &[
                "--name",
                &format!("pod-{i}"),
                "--tcp",
                "0.0.0.0:8080",
                "--udp",
                "0.0.0.0:5353",
                "--tcp",
                "[::]:8080",
                "--udp",
                "[::]:5353",
            ],
        )
        .unwrap();
    }
    let mut dp = BpfDataplane::attach(bed.cgroup_path()).unwrap();
    let mut svc = web_service("web", "198.19.0.10".parse().unwrap());
    svc.cluster_ips.push("2001:db8:ff00::10".parse().unwrap());
    let eps = web_endpoints(vec![
        ready(pod_ip(1)),
        ready(pod_ip(2)),
        ready6(1),
        ready6(2),
    ]);
    let report = dp.sync(
        &state_of(vec![(svc, Some(eps))]),
        &NodeInfo::default(),
        Scope::Full,
    );
    assert!(report.failed.is_empty(), "{report:?}");
    assert_eq!(report.frontends_written, 4, "two ports x two families");

    let v6 = tcp(&bed, "[2001:db8:ff00::10]:80", 40);
    assert!(v6.iter().all(|o| o.is_ok()), "{v6:?}");
    assert_eq!(
        reached(&v6).len(),
        2,
        "v6 connections spread over both pods"
    );
    assert!(
        v6.iter().all(|o| peer(o) == Some("[2001:db8:ff00::10]:80")),
        "{v6:?}"
    );

    let udp6 = run_probe(
        &bed,
        &[
            "udp",
            "[2001:db8:ff00::10]:53",
            "--count",
            "5",
            "--timeout-ms",
            "2000",
        ],
    );
    for o in &udp6 {
        assert!(o.is_ok(), "{o:?}");
        assert_eq!(
            from(o),
            Some("[2001:db8:ff00::10]:53"),
            "v6 reply from the ClusterIP: {o:?}"
        );
    }
    let connected6 = run_probe(
        &bed,
        &[
            "udp",
            "[2001:db8:ff00::10]:53",
            "--count",
            "3",
            "--timeout-ms",
            "2000",
            "--connected",
        ],
    );
    assert!(
        connected6
            .iter()
            .all(|o| peer(o) == Some("[2001:db8:ff00::10]:53")),
        "{connected6:?}"
    );

    // The v4 ClusterIP of the same service still works beside it.
    assert_eq!(reached(&tcp(&bed, "198.19.0.10:80", 30)).len(), 2);
}

/// The service ranges in both families at the socket: an address of a range that no
/// Service holds, or a held one on a port it does not serve, is refused at connect (TCP)
/// and at sendmsg (UDP) with ECONNREFUSED, and each refusal is counted; a held address
/// serves, an address outside the ranges is not refused, and a range taken away refuses
/// nothing any more.
#[test]
fn addresses_no_service_holds_in_the_service_ranges_are_refused_in_both_families() {
    let mut bed = Testbed::new("svcrange6").expect("test bed");
    let pod = bed.add_pod("pod-1", pod_ip(1), Some(pod_ip6(1))).unwrap();
    bed.serve(
        probe(),
        &pod,
        &[
            "--name",
            "pod-1",
            "--tcp",
            "0.0.0.0:8080",
            "--tcp",
            "[::]:8080",
        ],
    )
    .unwrap();
    let mut dp = BpfDataplane::attach(bed.cgroup_path()).unwrap();
    let mut svc = web_service("web", "198.19.0.10".parse().unwrap());
    svc.cluster_ips.push("2001:db8:ff00::10".parse().unwrap());
    let eps = web_endpoints(vec![ready(pod_ip(1)), ready6(1)]);
    let mut state = state_of(vec![(svc, Some(eps))]);
    state.service_ranges = ServiceRanges::new(vec![
        "198.19.0.0/17".parse().unwrap(),
        "2001:db8:ff00::/112".parse().unwrap(),
    ]);
    let report = dp.sync(&state, &NodeInfo::default(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");
    assert_eq!(
        dp.programmer().maps().service_ranges(),
        state.service_ranges.cidrs()
    );

    for held in ["[2001:db8:ff00::10]:80", "198.19.0.10:80"] {
        let ok = tcp(&bed, held, 3);
        assert!(
            ok.iter().all(|o| o.reply() == Some("pod-1")),
            "{held}: {ok:?}"
        );
    }
    let refused = |o: &[Outcome]| o.iter().all(|o| o.errno() == Some("ECONNREFUSED"));
    let targets = [
        "[2001:db8:ff00::99]:80",
        "[2001:db8:ff00::10]:81",
        "198.19.0.99:80",
        "198.19.0.10:81",
    ];
    for target in targets {
        let started = Instant::now();
        let out = tcp(&bed, target, 5);
        assert!(refused(&out), "{target}: {out:?}");
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{target}: at once"
        );
    }
    // sendmsg on an unconnected socket: the datagram never leaves.
    for target in ["[2001:db8:ff00::99]:53", "198.19.0.99:53"] {
        let out = run_probe(
            &bed,
            &["udp", target, "--count", "2", "--timeout-ms", "1000"],
        );
        assert!(refused(&out), "UDP {target}: {out:?}");
    }
    assert_eq!(
        dp.programmer().maps().packet_stats().refused_service_range,
        4 * 5 + 2 * 2,
        "every refusal is counted"
    );
    for outside in ["[2001:db8:fe00::1]:80", "198.19.200.1:80"] {
        let out = run_probe(
            &bed,
            &["tcp", outside, "--count", "1", "--timeout-ms", "300"],
        );
        assert_ne!(out[0].errno(), Some("ECONNREFUSED"), "{outside}: {out:?}");
    }

    // Without the ranges nothing is refused any more.
    state.service_ranges = ServiceRanges::default();
    dp.sync(&state, &NodeInfo::default(), Scope::Full);
    assert!(dp.programmer().maps().service_ranges().is_empty());
    let out = run_probe(
        &bed,
        &[
            "tcp",
            "[2001:db8:ff00::99]:80",
            "--count",
            "1",
            "--timeout-ms",
            "300",
        ],
    );
    assert_ne!(out[0].errno(), Some("ECONNREFUSED"), "{out:?}");
}
