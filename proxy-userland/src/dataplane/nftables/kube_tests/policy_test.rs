//! The traffic-policy and masquerade tables of kube-proxy's nftables proxier_test.go
//! (external and internal traffic policy, terminating endpoints, TestInternalExternalMasquerade).

use super::{
    fake::FakeProxier,
    proxier_test::{NODE, P80, UNNAMED_80},
    *,
};
use crate::{
    dataplane::iptables::kube_tests::{ep, ep_cond, make_test_service, port, slice, state},
    model::Protocol::Tcp,
};

fn lb_with_policy(local: bool) -> crate::model::ProxyState {
    let svc = make_test_service("ns1", "svc1", "198.19.0.41", |s| {
        s.external_policy_local = local;
        s.external_ips = vec![ip(TEST_EXTERNAL_IP)];
        s.ports = vec![port("p80", 80, Tcp, Some(3001))];
        s.health_check_node_port = local.then_some(30000);
        s.load_balancer_ips = vec![ip("198.19.250.4")];
    });
    let eps = slice(
        vec![ep("198.18.180.1", None), ep("198.18.182.1", Some(NODE))],
        P80,
    );
    state(vec![(svc, Some(eps))])
}

#[test]
fn test_external_traffic_policy_local() {
    let dump = FakeProxier::v4().sync(&lb_with_policy(true));
    let both = "198.18.180.1:80, 198.18.182.1:80";
    let local = "198.18.182.1:80";
    run_packet_flow_tests(
        "TestExternalTrafficPolicyLocal",
        &dump,
        TEST_NODE_IPS,
        &[
            flow(
                "pod to cluster IP hits both endpoints, unmasqueraded",
                "198.18.0.2",
                "198.19.0.41",
                80,
                both,
                false,
            ),
            flow(
                "pod to external IP hits both endpoints, unmasqueraded",
                "198.18.0.2",
                TEST_EXTERNAL_IP,
                80,
                both,
                false,
            ),
            flow(
                "external to external IP hits only local endpoint, unmasqueraded",
                TEST_EXTERNAL_CLIENT,
                TEST_EXTERNAL_IP,
                80,
                local,
                false,
            ),
            flow(
                "pod to LB IP hits only both endpoints, unmasqueraded",
                "198.18.0.2",
                "198.19.250.4",
                80,
                both,
                false,
            ),
            flow(
                "external to LB IP hits only local endpoint, unmasqueraded",
                TEST_EXTERNAL_CLIENT,
                "198.19.250.4",
                80,
                local,
                false,
            ),
            flow(
                "pod to NodePort hits both endpoints, unmasqueraded",
                "198.18.0.2",
                TEST_NODE_IP,
                3001,
                both,
                false,
            ),
            flow(
                "external to NodePort hits only local endpoint, unmasqueraded",
                TEST_EXTERNAL_CLIENT,
                TEST_NODE_IP,
                3001,
                local,
                false,
            ),
        ],
    );
}

#[test]
fn test_external_traffic_policy_cluster() {
    let dump = FakeProxier::v4().sync(&lb_with_policy(false));
    let both = "198.18.180.1:80, 198.18.182.1:80";
    run_packet_flow_tests(
        "TestExternalTrafficPolicyCluster",
        &dump,
        TEST_NODE_IPS,
        &[
            flow(
                "pod to cluster IP hits both endpoints, unmasqueraded",
                "198.18.0.2",
                "198.19.0.41",
                80,
                both,
                false,
            ),
            flow(
                "pod to external IP hits both endpoints, masqueraded",
                "198.18.0.2",
                TEST_EXTERNAL_IP,
                80,
                both,
                true,
            ),
            flow(
                "external to external IP hits both endpoints, masqueraded",
                TEST_EXTERNAL_CLIENT,
                TEST_EXTERNAL_IP,
                80,
                both,
                true,
            ),
            flow(
                "pod to LB IP hits both endpoints, masqueraded",
                "198.18.0.2",
                "198.19.250.4",
                80,
                both,
                true,
            ),
            flow(
                "external to LB IP hits both endpoints, masqueraded",
                TEST_EXTERNAL_CLIENT,
                "198.19.250.4",
                80,
                both,
                true,
            ),
            flow(
                "pod to NodePort hits both endpoints, masqueraded",
                "198.18.0.2",
                TEST_NODE_IP,
                3001,
                both,
                true,
            ),
            flow(
                "external to NodePort hits both endpoints, masqueraded",
                TEST_EXTERNAL_CLIENT,
                TEST_NODE_IP,
                3001,
                both,
                true,
            ),
        ],
    );
}

#[test]
fn test_internal_traffic_policy() {
    // (name, internalTrafficPolicy Local, endpoints (address, node), output)
    type Case<'a> = (&'a str, bool, [(&'a str, &'a str); 3], &'a str);
    let cases: [Case<'_>; 4] = [
        (
            "internalTrafficPolicy is cluster",
            false,
            [
                ("198.18.1.1", NODE),
                ("198.18.1.2", "node1"),
                ("198.18.1.3", "node2"),
            ],
            "198.18.1.1:80, 198.18.1.2:80, 198.18.1.3:80",
        ),
        (
            "internalTrafficPolicy is local and there is one local endpoint",
            true,
            [
                ("198.18.1.1", NODE),
                ("198.18.1.2", "node1"),
                ("198.18.1.3", "node2"),
            ],
            "198.18.1.1:80",
        ),
        (
            "internalTrafficPolicy is local and there are multiple local endpoints",
            true,
            [
                ("198.18.1.1", NODE),
                ("198.18.1.2", NODE),
                ("198.18.1.3", "node2"),
            ],
            "198.18.1.1:80, 198.18.1.2:80",
        ),
        (
            "internalTrafficPolicy is local and there are no local endpoints",
            true,
            [
                ("198.18.1.1", "node0"),
                ("198.18.1.2", "node1"),
                ("198.18.1.3", "node2"),
            ],
            "DROP",
        ),
    ];
    for (name, local, endpoints, output) in cases {
        let svc = make_test_service("ns1", "svc1", "198.19.1.1", |s| {
            s.internal_policy_local = local;
            s.ports = vec![port("", 80, Tcp, None)];
        });
        let eps = slice(
            endpoints.iter().map(|(a, n)| ep(a, Some(n))).collect(),
            UNNAMED_80,
        );
        let fp = FakeProxier::v4();
        let dump = fp.sync(&state(vec![(svc.clone(), Some(eps))]));
        let test = format!("TestInternalTrafficPolicy/{name}");
        run_packet_flow_tests(
            &test,
            &dump,
            TEST_NODE_IPS,
            &[flow(
                "pod to ClusterIP",
                "198.18.0.2",
                "198.19.1.1",
                80,
                output,
                false,
            )],
        );
        let dump = fp.sync(&state(vec![(svc, None)]));
        run_packet_flow_tests(
            &test,
            &dump,
            TEST_NODE_IPS,
            &[flow(
                "endpoints deleted",
                "198.18.0.2",
                "198.19.1.1",
                80,
                "REJECT",
                false,
            )],
        );
    }
}

/// TestTerminatingEndpointsTrafficPolicyLocal / Cluster: one LB service, the slices and
/// expectations of upstream's cases.
fn terminating_cases(local: bool) {
    let svc = make_test_service("ns1", "svc1", "198.19.1.1", |s| {
        s.external_policy_local = local;
        s.ports = vec![port("", 80, Tcp, None)];
        s.health_check_node_port = Some(30000);
        s.load_balancer_ips = vec![ip("198.19.250.4")];
    });
    let other = if local { "node-1" } else { "another-node" };
    type Case<'a> = (&'a str, Vec<crate::model::Endpoint>, &'a str, &'a str, bool);
    let cases: Vec<Case<'_>> = if local {
        vec![
            (
                "ready endpoints exist",
                vec![
                    ep_cond("198.18.1.1", Some(NODE), true, true, false),
                    ep_cond("198.18.1.2", Some(NODE), true, true, false),
                    ep_cond("198.18.1.3", Some(NODE), false, true, true),
                    ep_cond("198.18.1.4", Some(NODE), false, false, true),
                    ep_cond("198.18.1.5", Some(other), true, true, false),
                ],
                "198.18.1.1:80, 198.18.1.2:80, 198.18.1.5:80",
                "198.18.1.1:80, 198.18.1.2:80",
                false,
            ),
            (
                "only terminating endpoints exist",
                vec![
                    ep_cond("198.18.1.2", Some(NODE), false, true, true),
                    ep_cond("198.18.1.3", Some(NODE), false, true, true),
                    ep_cond("198.18.1.4", Some(NODE), false, false, true),
                    ep_cond("198.18.1.5", Some(other), true, true, false),
                ],
                "198.18.1.5:80",
                "198.18.1.2:80, 198.18.1.3:80",
                false,
            ),
            (
                "terminating endpoints on remote node",
                vec![ep_cond("198.18.1.5", Some(other), false, true, true)],
                "198.18.1.5:80",
                "DROP",
                false,
            ),
            (
                "no usable endpoints on any node",
                vec![
                    ep_cond("198.18.1.5", Some(NODE), false, false, true),
                    ep_cond("198.18.1.5", Some(other), false, false, true),
                ],
                "REJECT",
                "REJECT",
                false,
            ),
        ]
    } else {
        vec![
            (
                "ready endpoints exist",
                vec![
                    ep_cond("198.18.1.1", Some(NODE), true, true, false),
                    ep_cond("198.18.1.2", Some(NODE), true, true, false),
                    ep_cond("198.18.1.3", Some(other), false, true, true),
                    ep_cond("198.18.1.4", Some(other), false, false, true),
                    ep_cond("198.18.1.5", Some(other), true, true, false),
                ],
                "198.18.1.1:80, 198.18.1.2:80, 198.18.1.5:80",
                "198.18.1.1:80, 198.18.1.2:80, 198.18.1.5:80",
                true,
            ),
            (
                "only terminating endpoints exist",
                vec![
                    ep_cond("198.18.1.2", Some(NODE), false, true, true),
                    ep_cond("198.18.1.3", Some(NODE), false, true, true),
                    ep_cond("198.18.1.4", Some(other), false, false, true),
                    ep_cond("198.18.1.5", Some(other), false, true, true),
                ],
                "198.18.1.2:80, 198.18.1.3:80, 198.18.1.5:80",
                "198.18.1.2:80, 198.18.1.3:80, 198.18.1.5:80",
                true,
            ),
            (
                "terminating endpoints on remote node",
                vec![ep_cond("198.18.1.5", Some("node-1"), false, true, true)],
                "198.18.1.5:80",
                "198.18.1.5:80",
                true,
            ),
            (
                "no usable endpoints on any node",
                vec![
                    ep_cond("198.18.1.5", Some(NODE), false, false, true),
                    ep_cond("198.18.1.5", Some("node-1"), false, false, true),
                ],
                "REJECT",
                "REJECT",
                false,
            ),
        ]
    };
    let upstream = if local {
        "TestTerminatingEndpointsTrafficPolicyLocal"
    } else {
        "TestTerminatingEndpointsTrafficPolicyCluster"
    };
    let fp = FakeProxier::v4();
    for (name, endpoints, to_cluster_ip, to_lb, lb_masq) in cases {
        let test = format!("{upstream}/{name}");
        let dump = fp.sync(&state(vec![(
            svc.clone(),
            Some(slice(endpoints, UNNAMED_80)),
        )]));
        run_packet_flow_tests(
            &test,
            &dump,
            TEST_NODE_IPS,
            &[
                flow(
                    "pod to clusterIP",
                    "198.18.0.2",
                    "198.19.1.1",
                    80,
                    to_cluster_ip,
                    false,
                ),
                flow(
                    "external to LB",
                    TEST_EXTERNAL_CLIENT,
                    "198.19.250.4",
                    80,
                    to_lb,
                    lb_masq,
                ),
            ],
        );
        let dump = fp.sync(&state(vec![(svc.clone(), None)]));
        run_packet_flow_tests(
            &test,
            &dump,
            TEST_NODE_IPS,
            &[
                flow(
                    "pod to clusterIP after endpoints deleted",
                    "198.18.0.2",
                    "198.19.1.1",
                    80,
                    "REJECT",
                    false,
                ),
                flow(
                    "external to LB after endpoints deleted",
                    TEST_EXTERNAL_CLIENT,
                    "198.19.250.4",
                    80,
                    "REJECT",
                    false,
                ),
            ],
        );
    }
}

#[test]
fn test_terminating_endpoints_traffic_policy_local() {
    terminating_cases(true);
}

#[test]
fn test_terminating_endpoints_traffic_policy_cluster() {
    terminating_cases(false);
}

#[test]
fn test_internal_external_masquerade() {
    let lb = |name: &str,
              cluster_ip: &str,
              node_port: u16,
              lb_ip: &str,
              f: &dyn Fn(&mut crate::model::Service)| {
        make_test_service(name.replace("svc", "ns").as_str(), name, cluster_ip, |s| {
            s.ports = vec![port("p80", 80, Tcp, Some(node_port))];
            s.health_check_node_port = Some(30000 + node_port - 3000);
            s.load_balancer_ips = vec![ip(lb_ip)];
            f(s);
        })
    };
    let svc1 = lb("svc1", "198.19.0.41", 3001, "198.19.250.4", &|_| {});
    let svc2 = lb("svc2", "198.19.0.42", 3002, "198.19.250.8", &|s| {
        s.external_policy_local = true
    });
    let svc3 = lb("svc3", "198.19.0.43", 3003, "198.19.250.12", &|s| {
        s.internal_policy_local = true
    });
    let eps = |n: u8| {
        slice(
            vec![
                ep(&format!("198.18.180.{n}"), Some(NODE)),
                ep(&format!("198.18.181.{n}"), Some("remote")),
            ],
            P80,
        )
    };
    let st = state(vec![
        (svc1, Some(eps(1))),
        (svc2, Some(eps(2))),
        (svc3, Some(eps(3))),
    ]);
    let (all1, all2, all3) = (
        "198.18.180.1:80, 198.18.181.1:80",
        "198.18.180.2:80, 198.18.181.2:80",
        "198.18.180.3:80, 198.18.181.3:80",
    );
    let (pod, node, out) = ("198.18.0.2", TEST_NODE_IP, TEST_EXTERNAL_CLIENT);
    let base = [
        flow("pod to ClusterIP", pod, "198.19.0.41", 80, all1, false),
        flow("pod to NodePort", pod, node, 3001, all1, true),
        flow("pod to LB", pod, "198.19.250.4", 80, all1, true),
        flow("node to ClusterIP", node, "198.19.0.41", 80, all1, true),
        flow("node to NodePort", node, node, 3001, all1, true),
        flow("node to LB", node, "198.19.250.4", 80, all1, true),
        flow("external to ClusterIP", out, "198.19.0.41", 80, all1, true),
        flow("external to NodePort", out, node, 3001, all1, true),
        flow("external to LB", out, "198.19.250.4", 80, all1, true),
        flow(
            "pod to ClusterIP with eTP:Local",
            pod,
            "198.19.0.42",
            80,
            all2,
            false,
        ),
        flow(
            "pod to NodePort with eTP:Local",
            pod,
            node,
            3002,
            all2,
            false,
        ),
        flow(
            "pod to LB with eTP:Local",
            pod,
            "198.19.250.8",
            80,
            all2,
            false,
        ),
        flow(
            "node to ClusterIP with eTP:Local",
            node,
            "198.19.0.42",
            80,
            all2,
            true,
        ),
        flow(
            "node to NodePort with eTP:Local",
            node,
            node,
            3001,
            all1,
            true,
        ),
        flow(
            "node to LB with eTP:Local",
            node,
            "198.19.250.8",
            80,
            all2,
            true,
        ),
        flow(
            "external to ClusterIP with eTP:Local",
            out,
            "198.19.0.42",
            80,
            all2,
            true,
        ),
        flow(
            "external to NodePort with eTP:Local",
            out,
            node,
            3002,
            "198.18.180.2:80",
            false,
        ),
        flow(
            "external to LB with eTP:Local",
            out,
            "198.19.250.8",
            80,
            "198.18.180.2:80",
            false,
        ),
        flow(
            "pod to ClusterIP with iTP:Local",
            pod,
            "198.19.0.43",
            80,
            "198.18.180.3:80",
            false,
        ),
        flow(
            "pod to NodePort with iTP:Local",
            pod,
            node,
            3003,
            all3,
            true,
        ),
        flow(
            "pod to LB with iTP:Local",
            pod,
            "198.19.250.12",
            80,
            all3,
            true,
        ),
        flow(
            "node to ClusterIP with iTP:Local",
            node,
            "198.19.0.43",
            80,
            "198.18.180.3:80",
            true,
        ),
        flow(
            "node to NodePort with iTP:Local",
            node,
            node,
            3003,
            all3,
            true,
        ),
        flow(
            "node to LB with iTP:Local",
            node,
            "198.19.250.12",
            80,
            all3,
            true,
        ),
        flow(
            "external to ClusterIP with iTP:Local",
            out,
            "198.19.0.43",
            80,
            "198.18.180.3:80",
            true,
        ),
        flow(
            "external to NodePort with iTP:Local",
            out,
            node,
            3003,
            all3,
            true,
        ),
        flow(
            "external to LB with iTP:Local",
            out,
            "198.19.250.12",
            80,
            all3,
            true,
        ),
    ];
    // (name, masqueradeAll, localDetector, overrides: flow -> (output, masq))
    type Overrides = &'static [(&'static str, Option<&'static str>, Option<bool>)];
    let no_detector: Overrides = &[
        ("node to ClusterIP", None, Some(false)),
        ("node to ClusterIP with eTP:Local", None, Some(false)),
        ("node to ClusterIP with iTP:Local", None, Some(false)),
        ("external to ClusterIP", None, Some(false)),
        ("external to ClusterIP with eTP:Local", None, Some(false)),
        ("external to ClusterIP with iTP:Local", None, Some(false)),
        (
            "pod to NodePort with eTP:Local",
            Some("198.18.180.2:80"),
            None,
        ),
        ("pod to LB with eTP:Local", Some("198.18.180.2:80"), None),
    ];
    let masq_all: Overrides = &[
        ("pod to ClusterIP", None, Some(true)),
        ("pod to ClusterIP with eTP:Local", None, Some(true)),
        ("pod to ClusterIP with iTP:Local", None, Some(true)),
    ];
    let both: Overrides = &[
        ("pod to ClusterIP", None, Some(true)),
        ("pod to ClusterIP with eTP:Local", None, Some(true)),
        ("pod to ClusterIP with iTP:Local", None, Some(true)),
        (
            "pod to NodePort with eTP:Local",
            Some("198.18.180.2:80"),
            None,
        ),
        ("pod to LB with eTP:Local", Some("198.18.180.2:80"), None),
    ];
    let cases: [(&str, bool, bool, Overrides); 4] = [
        ("base", false, true, &[]),
        ("no LocalTrafficDetector", false, false, no_detector),
        ("masqueradeAll", true, true, masq_all),
        ("masqueradeAll, no LocalTrafficDetector", true, false, both),
    ];
    for (name, masquerade_all, detector, overrides) in cases {
        let mut fp = FakeProxier::v4();
        fp.masquerade_all = masquerade_all;
        fp.local_detector = detector;
        let dump = fp.sync(&st);
        let mut flows = base.to_vec();
        let mut applied = 0;
        for f in &mut flows {
            if let Some((_, output, masq)) = overrides.iter().find(|(n, ..)| *n == f.name) {
                applied += 1;
                if let Some(o) = output {
                    assert_ne!(
                        f.output, *o,
                        "{name}: {} override is the base value",
                        f.name
                    );
                    f.output = o;
                }
                if let Some(m) = masq {
                    assert_ne!(f.masq, *m, "{name}: {} override is the base value", f.name);
                    f.masq = *m;
                }
            }
        }
        assert_eq!(
            applied,
            overrides.len(),
            "{name}: an override names no flow"
        );
        run_packet_flow_tests(
            &format!("TestInternalExternalMasquerade/{name}"),
            &dump,
            TEST_NODE_IPS,
            &flows,
        );
    }
}
