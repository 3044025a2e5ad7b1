//! The packet-flow tables of kube-proxy's nftables proxier_test.go, run over what our
//! renderer writes, traced with [`super::tracer`].

use super::{fake::FakeProxier, upstream_test::overall_flows, *};
use crate::{
    dataplane::iptables::kube_tests::{ep, make_test_service, port, slice, state},
    model::Protocol::{Sctp, Tcp, Udp},
};

pub(super) const P80: &[(&str, u16, crate::model::Protocol)] = &[("p80", 80, Tcp)];
pub(super) const UNNAMED_80: &[(&str, u16, crate::model::Protocol)] = &[("", 80, Tcp)];
pub(super) const NODE: &str = super::TEST_NODE_NAME;

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

/// TestOverallNFTablesRules' services through our renderer: upstream's packet expectations
/// on its dump ([`overall_flows`]) hold on ours too.
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
    run_packet_flow_tests(
        "TestOverallNFTablesRules",
        &dump,
        TEST_NODE_IPS,
        &our_overall_flows(),
    );
}

/// Upstream's expectations for TestOverallNFTablesRules' services, with our one
/// deliberate difference: an unallocated cluster IP is refused, not dropped.
pub(super) fn our_overall_flows() -> Vec<Flow<'static>> {
    overall_flows()
        .into_iter()
        .map(|f| match f.name {
            "packet to unallocated cluster ip" => Flow {
                output: UNALLOCATED_CLUSTER_IP,
                ..f
            },
            _ => f,
        })
        .collect()
}

/// `endpoint-5OJB2KTY-ns1/...` -> `endpoint-HASH-ns1/...`, for every chain or set kind
/// whose hash covers an endpoint address.
pub(super) fn mask_hashes(text: &str) -> String {
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
pub(super) fn overall_state() -> crate::model::ProxyState {
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
