//! The packet-flow tables of kube-proxy's nftables proxier_test.go, run over what our
//! renderer writes, traced with [`super::tracer`].

use super::{fake::FakeProxier, upstream_test::overall_flows, *};
use crate::{
    dataplane::iptables::kube_tests::{ep, ep_cond, make_test_service, port, slice, state},
    model::Protocol::{Sctp, Tcp, Udp},
};

const P80: &[(&str, u16, crate::model::Protocol)] = &[("p80", 80, Tcp)];
const UNNAMED_80: &[(&str, u16, crate::model::Protocol)] = &[("", 80, Tcp)];
const NODE: &str = super::TEST_NODE_NAME;

#[test]
fn test_no_endpoints_reject() {
    let svc = make_test_service("ns1", "svc1", "198.19.0.41", |s| {
        s.external_ips = vec![ip(TEST_EXTERNAL_IP)];
        s.ports = vec![port("p80", 80, Tcp, Some(3001))];
        s.load_balancer_ips = vec![ip("198.19.250.4")];
    });
    let dump = FakeProxier::v4().sync(&state(vec![(svc, None)]));
    run_packet_flow_tests(
        "TestNoEndpointsReject",
        &dump,
        TEST_NODE_IPS,
        &[
            flow(
                "pod to cluster IP with no endpoints",
                "198.18.0.2",
                "198.19.0.41",
                80,
                "REJECT",
                false,
            ),
            flow(
                "external to external IP with no endpoints",
                TEST_EXTERNAL_CLIENT,
                TEST_EXTERNAL_IP,
                80,
                "REJECT",
                false,
            ),
            flow(
                "pod to NodePort with no endpoints",
                "198.18.0.2",
                TEST_NODE_IP,
                3001,
                "REJECT",
                false,
            ),
            flow(
                "external to NodePort with no endpoints",
                TEST_EXTERNAL_CLIENT,
                TEST_NODE_IP,
                3001,
                "REJECT",
                false,
            ),
            flow(
                "pod to LoadBalancer IP with no endpoints",
                "198.18.0.2",
                "198.19.250.4",
                80,
                "REJECT",
                false,
            ),
            flow(
                "external to LoadBalancer IP with no endpoints",
                TEST_EXTERNAL_CLIENT,
                "198.19.250.4",
                80,
                "REJECT",
                false,
            ),
        ],
    );
}

#[test]
fn test_cluster_ip_general() {
    let svc1 = make_test_service("ns1", "svc1", "198.19.0.41", |s| {
        s.ports = vec![port("http", 80, Tcp, None)]
    });
    let svc2 = make_test_service("ns2", "svc2", "198.19.0.42", |s| {
        s.ports = vec![
            port("http", 80, Tcp, None),
            port("https", 443, Tcp, None),
            port("dns-udp", 53, Udp, None),
            port("dns-tcp", 53, Tcp, None),
            port("dns-sctp", 53, Sctp, None),
        ]
    });
    let eps1 = slice(vec![ep("198.18.180.1", Some(NODE))], &[("http", 80, Tcp)]);
    let eps2 = slice(
        vec![
            ep("198.18.180.1", Some(NODE)),
            ep("198.18.182.1", Some("node2")),
        ],
        &[
            ("http", 80, Tcp),
            ("https", 8443, Tcp),
            ("dns-udp", 53, Udp),
            ("dns-tcp", 5353, Tcp),
            ("dns-sctp", 53, Sctp),
        ],
    );
    let dump = FakeProxier::v4().sync(&state(vec![(svc1, Some(eps1)), (svc2, Some(eps2))]));
    let both = |p: &str| format!("198.18.180.1:{p}, 198.18.182.1:{p}");
    let (b80, b8443, b5353, b53) = (both("80"), both("8443"), both("5353"), both("53"));
    let with = |protocol, f| Flow { protocol, ..f };
    run_packet_flow_tests(
        "TestClusterIPGeneral",
        &dump,
        TEST_NODE_IPS,
        &[
            flow(
                "simple clusterIP",
                "198.18.180.2",
                "198.19.0.41",
                80,
                "198.18.180.1:80",
                false,
            ),
            flow(
                "hairpin to cluster IP",
                "198.18.180.1",
                "198.19.0.41",
                80,
                "198.18.180.1:80",
                true,
            ),
            flow(
                "clusterIP with multiple endpoints",
                "198.18.180.2",
                "198.19.0.42",
                80,
                &b80,
                false,
            ),
            flow(
                "clusterIP with TargetPort",
                "198.18.180.2",
                "198.19.0.42",
                443,
                &b8443,
                false,
            ),
            with(
                "tcp",
                flow(
                    "clusterIP with TCP, UDP, and SCTP on same port (TCP)",
                    "198.18.180.2",
                    "198.19.0.42",
                    53,
                    &b5353,
                    false,
                ),
            ),
            with(
                "udp",
                flow(
                    "clusterIP with TCP, UDP, and SCTP on same port (UDP)",
                    "198.18.180.2",
                    "198.19.0.42",
                    53,
                    &b53,
                    false,
                ),
            ),
            with(
                "sctp",
                flow(
                    "clusterIP with TCP, UDP, and SCTP on same port (SCTP)",
                    "198.18.180.2",
                    "198.19.0.42",
                    53,
                    &b53,
                    false,
                ),
            ),
            with(
                "udp",
                flow(
                    "TCP-only port does not match UDP traffic",
                    "198.18.180.2",
                    "198.19.0.42",
                    80,
                    "REJECT",
                    false,
                ),
            ),
            flow(
                "svc1 does not accept svc2's ports",
                "198.18.180.2",
                "198.19.0.41",
                443,
                "REJECT",
                false,
            ),
            flow(
                "packet to unallocated cluster ip",
                "198.18.180.2",
                "198.19.0.50",
                80,
                UNALLOCATED_CLUSTER_IP,
                false,
            ),
        ],
    );
}

/// What a new connection to an address of the service range that no service holds gets.
/// kube-proxy's nftables mode drops it, and its client waits for a timeout; ours rejects
/// it, as every mode of ours does (docs/modes.md).
const UNALLOCATED_CLUSTER_IP: &str = "REJECT";

#[test]
fn test_load_balancer() {
    let svc = make_test_service("ns1", "svc1", "198.19.0.41", |s| {
        s.ports = vec![port("p80", 80, Tcp, Some(3001))];
        s.load_balancer_ips = vec![ip("198.19.250.4"), ip("198.19.250.8")];
        s.load_balancer_source_ranges = vec![(ip("198.19.128.0"), 24), (ip("198.19.240.0"), 25)];
    });
    let eps = slice(vec![ep("198.18.180.1", None)], P80);
    let dump = FakeProxier::v4().sync(&state(vec![(svc, Some(eps))]));
    let ep = "198.18.180.1:80";
    run_packet_flow_tests(
        "TestLoadBalancer",
        &dump,
        TEST_NODE_IPS,
        &[
            flow(
                "pod to cluster IP",
                "198.18.0.2",
                "198.19.0.41",
                80,
                ep,
                false,
            ),
            flow(
                "external to nodePort",
                TEST_EXTERNAL_CLIENT,
                TEST_NODE_IP,
                3001,
                ep,
                true,
            ),
            flow(
                "nodePort bypasses LoadBalancerSourceRanges",
                TEST_EXTERNAL_CLIENT_BLOCKED,
                TEST_NODE_IP,
                3001,
                ep,
                true,
            ),
            flow(
                "accepted external to LB1",
                TEST_EXTERNAL_CLIENT,
                "198.19.250.4",
                80,
                ep,
                true,
            ),
            flow(
                "accepted external to LB2",
                TEST_EXTERNAL_CLIENT,
                "198.19.250.8",
                80,
                ep,
                true,
            ),
            flow(
                "blocked external to LB1",
                TEST_EXTERNAL_CLIENT_BLOCKED,
                "198.19.250.4",
                80,
                "DROP",
                false,
            ),
            flow(
                "blocked external to LB2",
                TEST_EXTERNAL_CLIENT_BLOCKED,
                "198.19.250.8",
                80,
                "DROP",
                false,
            ),
            flow(
                "pod to LB1 (blocked by LoadBalancerSourceRanges)",
                "198.18.0.2",
                "198.19.250.4",
                80,
                "DROP",
                false,
            ),
            flow(
                "pod to LB2 (blocked by LoadBalancerSourceRanges)",
                "198.18.0.2",
                "198.19.250.8",
                80,
                "DROP",
                false,
            ),
            flow(
                "node to LB1 (allowed by LoadBalancerSourceRanges)",
                TEST_NODE_IP,
                "198.19.250.4",
                80,
                ep,
                true,
            ),
            flow(
                "node to LB2 (allowed by LoadBalancerSourceRanges)",
                TEST_NODE_IP,
                "198.19.250.8",
                80,
                ep,
                true,
            ),
            flow(
                "same node to LB1, SNATted to LB1 (implicitly allowed)",
                "198.19.250.4",
                "198.19.250.4",
                80,
                ep,
                true,
            ),
            flow(
                "same node to LB2, SNATted to LB2 (implicitly allowed)",
                "198.19.250.8",
                "198.19.250.8",
                80,
                ep,
                true,
            ),
        ],
    );
}

#[test]
fn test_node_ports() {
    struct Case {
        name: &'static str,
        v6: bool,
        nodeport_addresses: Option<Vec<(&'static str, u8)>>,
        allow_alt_node_ip: bool,
    }
    let cases = [
        Case {
            name: "ipv4",
            v6: false,
            nodeport_addresses: None,
            allow_alt_node_ip: false,
        },
        Case {
            name: "ipv4, multiple nodeport-addresses",
            v6: false,
            nodeport_addresses: Some(vec![
                ("198.19.128.0", 24),
                ("198.19.129.0", 24),
                ("2001:db8::", 64),
            ]),
            allow_alt_node_ip: true,
        },
        Case {
            name: "ipv6",
            v6: true,
            nodeport_addresses: None,
            allow_alt_node_ip: false,
        },
        Case {
            name: "ipv6, multiple nodeport-addresses",
            v6: true,
            nodeport_addresses: Some(vec![
                ("198.19.128.0", 24),
                ("198.19.129.0", 24),
                ("2001:db8::", 64),
                ("2001:db8:1::2", 128),
            ]),
            allow_alt_node_ip: true,
        },
    ];
    for c in cases {
        let (svc_ip, ep1, ep2, node_ip, pod, outside, alt) = if c.v6 {
            (
                "2001:db8:172:30::41",
                "2001:db8:10:180::1",
                "2001:db8:10:180::2:1",
                TEST_NODE_IPV6,
                "2001:db8:10::2",
                "2001:db8:5200::1",
                TEST_NODE_IPV6_ALT,
            )
        } else {
            (
                "198.19.0.41",
                "198.18.180.1",
                "198.18.182.1",
                TEST_NODE_IP,
                "198.18.0.2",
                TEST_EXTERNAL_CLIENT,
                TEST_NODE_IP_ALT,
            )
        };
        let mut fp = if c.v6 {
            FakeProxier::v6()
        } else {
            FakeProxier::v4()
        };
        if let Some(addrs) = &c.nodeport_addresses {
            fp.nodeport_addresses = addrs.iter().map(|&(a, l)| (ip(a), l)).collect();
        }
        let svc = make_test_service("ns1", "svc1", svc_ip, |s| {
            s.ports = vec![port("p80", 80, Tcp, Some(3001))];
        });
        let eps = slice(vec![ep(ep1, None), ep(ep2, Some(NODE))], P80);
        let dump = fp.sync(&state(vec![(svc, Some(eps))]));
        let hp = |a: &str| std::net::SocketAddr::new(ip(a), 80).to_string();
        let output = format!("{}, {}", hp(ep1), hp(ep2));
        let test = format!("TestNodePorts/{}", c.name);
        let mut flows = vec![
            flow("pod to cluster IP", pod, svc_ip, 80, &output, false),
            flow(
                "external to nodePort",
                outside,
                node_ip,
                3001,
                &output,
                true,
            ),
            flow("node to nodePort", node_ip, node_ip, 3001, &output, true),
        ];
        if c.allow_alt_node_ip {
            flows.push(flow(
                "external to nodePort on secondary IP",
                outside,
                alt,
                3001,
                &output,
                true,
            ));
        } else {
            flows.push(flow(
                "secondary nodeIP ignores NodePorts",
                outside,
                alt,
                3001,
                "",
                false,
            ));
        }
        run_packet_flow_tests(&test, &dump, TEST_NODE_IPS, &flows);
    }
}

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

/// TestOverallNFTablesRules' services through our renderer: upstream's packet expectations
/// on its dump ([`OVERALL_FLOWS`]) hold on ours too.
#[test]
fn test_overall_nftables_rules() {
    let fp = FakeProxier::v4();
    let ours = fp.text(&overall_state());
    // Upstream's dump, but for our one deliberate difference; the endpoint chains' hashes
    // (of upstream's endpoint addresses) are masked on both sides.
    let upstream = format!(
        "{}\n{}",
        super::upstream_test::BASE_RULES,
        super::upstream_test::OVERALL
    )
    .replace(
        "ip daddr { 198.19.0.0/17 } drop comment \"Drop traffic to unallocated ClusterIPs\"",
        "ip daddr { 198.19.0.0/17 } reject comment \"Reject traffic to unallocated ClusterIPs\"",
    );
    assert_transaction_equal(&mask_hashes(&upstream), &mask_hashes(&ours));

    let dump = fp.sync(&overall_state());
    let flows: Vec<Flow<'_>> = overall_flows()
        .into_iter()
        .map(|f| match f.name {
            "packet to unallocated cluster ip" => Flow {
                output: UNALLOCATED_CLUSTER_IP,
                ..f
            },
            _ => f,
        })
        .collect();
    run_packet_flow_tests("TestOverallNFTablesRules", &dump, TEST_NODE_IPS, &flows);
}

/// `endpoint-5OJB2KTY-ns1/...` -> `endpoint-HASH-ns1/...`, for every chain or set kind
/// whose hash covers an endpoint address.
fn mask_hashes(text: &str) -> String {
    let mut out = text.to_string();
    for kind in ["endpoint-", "affinity-"] {
        let mut from = 0;
        while let Some(at) = out[from..].find(kind) {
            let start = from + at + kind.len();
            let hash = out.get(start..start + 9).unwrap_or_default();
            if hash.len() == 9
                && hash.ends_with('-')
                && hash[..8]
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit())
            {
                out.replace_range(start..start + 8, "HASH");
            }
            from = start;
        }
    }
    out
}

/// TestOverallNFTablesRules' services and slices.
fn overall_state() -> crate::model::ProxyState {
    let p80 = |node_port| vec![port("p80", 80, Tcp, node_port)];
    let svc1 = make_test_service("ns1", "svc1", "198.19.0.41", |s| s.ports = p80(None));
    let svc2 = make_test_service("ns2", "svc2", "198.19.0.42", |s| {
        s.external_policy_local = true;
        s.ports = p80(Some(3001));
        s.load_balancer_ips = vec![ip("198.19.250.4")];
        s.external_ips = vec![ip("198.19.227.22")];
        s.health_check_node_port = Some(30000);
    });
    let svc3 = make_test_service("ns3", "svc3", "198.19.0.43", |s| s.ports = p80(Some(3003)));
    let svc4 = make_test_service("ns4", "svc4", "198.19.0.44", |s| {
        s.external_ips = vec![ip("198.19.227.33")];
        s.ports = p80(None);
    });
    let svc5 = make_test_service("ns5", "svc5", "198.19.0.45", |s| {
        s.ports = p80(Some(3002));
        s.load_balancer_ips = vec![ip("198.19.250.8")];
        s.health_check_node_port = Some(30000);
        s.load_balancer_source_ranges = vec![(ip("198.19.240.0"), 25)];
        s.affinity_timeout = Some(10800);
    });
    let svc6 = make_test_service("ns6", "svc6", "198.19.0.46", |s| s.ports = p80(None));
    state(vec![
        (svc1, Some(slice(vec![ep("198.18.180.1", None)], P80))),
        (svc2, Some(slice(vec![ep("198.18.180.2", None)], P80))),
        (svc3, Some(slice(vec![ep("198.18.180.3", None)], P80))),
        (
            svc4,
            Some(slice(
                vec![ep("198.18.180.4", None), ep("198.18.180.5", Some(NODE))],
                P80,
            )),
        ),
        (svc5, Some(slice(vec![ep("198.18.180.3", None)], P80))),
        (svc6, None),
    ])
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
