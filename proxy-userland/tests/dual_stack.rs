//! IPv6 and dual-stack through the socket programs (connect6, sendmsg6, recvmsg6,
//! getpeername6): one service with a v4 and a v6 ClusterIP, pods with both families.

mod common;

use common::*;
use proxy_userland::{
    dataplane::{Dataplane, Scope, bpf::BpfDataplane},
    model::NodeInfo,
};
use xtask::testbed::Testbed;

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
