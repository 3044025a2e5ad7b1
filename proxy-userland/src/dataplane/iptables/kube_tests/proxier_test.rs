//! The packet-flow tables of kube-proxy's proxier_test.go, run over our rules.

use std::collections::BTreeMap;

use super::{
    tracer::{Dump, Flow, check_rule_jumps, run_packet_flow_tests},
    *,
};
use crate::model::Protocol::{Sctp, Tcp, Udp};

pub(super) const P80: &[(&str, u16, Protocol)] = &[("p80", 80, Tcp)];
pub(super) const UNNAMED_80: &[(&str, u16, Protocol)] = &[("", 80, Tcp)];

pub(super) fn flow<'a>(
    name: &'a str,
    source: &'a str,
    dest: &'a str,
    port: u16,
    output: &'a str,
    masq: bool,
) -> Flow<'a> {
    Flow {
        name,
        source,
        protocol: "",
        dest,
        port,
        output,
        masq,
    }
}

/// Renders `st` as kube-proxy's fake proxier would sync it, checks the jumps, and returns
/// the parsed rules for tracing.
fn synced(st: &ProxyState, family: Family, cfg: &RenderConfig) -> Dump {
    let text = sync_text(st, family, cfg);
    if let Err(e) = check_rule_jumps(&text) {
        panic!("{e}\n{text}");
    }
    Dump::parse(&text)
}

pub(super) fn v4(st: &ProxyState) -> Dump {
    synced(st, Family::V4, &fake_config(Family::V4))
}

#[test]
fn test_no_endpoints_reject() {
    let svc = make_test_service("ns1", "svc1", "198.19.0.41", |s| {
        s.external_ips = vec![ip(TEST_EXTERNAL_IP)];
        s.ports = vec![port("p80", 80, Tcp, Some(3001))];
        s.load_balancer_ips = vec![ip("198.19.250.4")];
    });
    let dump = v4(&state(vec![(svc, None)]));
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
    let eps1 = slice(
        vec![ep("198.18.180.1", Some(TEST_NODE_NAME))],
        &[("http", 80, Tcp)],
    );
    let eps2 = slice(
        vec![
            ep("198.18.180.1", Some(TEST_NODE_NAME)),
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
    let dump = v4(&state(vec![(svc1, Some(eps1)), (svc2, Some(eps2))]));
    let both = |p: &str| format!("198.18.180.1:{p}, 198.18.182.1:{p}");
    let (b80, b8443, b5353, b53) = (both("80"), both("8443"), both("5353"), both("53"));
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
            Flow {
                protocol: "tcp",
                ..flow(
                    "clusterIP with TCP, UDP, and SCTP on same port (TCP)",
                    "198.18.180.2",
                    "198.19.0.42",
                    53,
                    &b5353,
                    false,
                )
            },
            Flow {
                protocol: "udp",
                ..flow(
                    "clusterIP with TCP, UDP, and SCTP on same port (UDP)",
                    "198.18.180.2",
                    "198.19.0.42",
                    53,
                    &b53,
                    false,
                )
            },
            Flow {
                protocol: "sctp",
                ..flow(
                    "clusterIP with TCP, UDP, and SCTP on same port (SCTP)",
                    "198.18.180.2",
                    "198.19.0.42",
                    53,
                    &b53,
                    false,
                )
            },
            Flow {
                protocol: "udp",
                ..flow(
                    "TCP-only port does not match UDP traffic",
                    "198.18.180.2",
                    "198.19.0.42",
                    80,
                    "",
                    false,
                )
            },
            flow(
                "svc1 does not accept svc2's ports",
                "198.18.180.2",
                "198.19.0.41",
                443,
                "",
                false,
            ),
        ],
    );
}

/// The nftables proxier's TestClusterIPGeneral, whose last three cases need the service
/// ranges (kube-proxy's ServiceCIDRs; here also --service-cluster-ip-range): a cluster IP
/// on a port or protocol it does not serve is rejected, as upstream; an address of the
/// range no service holds is rejected too, where upstream drops it (a deliberate
/// difference, see docs/modes.md). Outside the range nothing changes.
#[test]
fn test_cluster_ip_general_with_service_ranges() {
    let svc1 = make_test_service("ns1", "svc1", "198.19.0.41", |s| {
        s.ports = vec![port("http", 80, Tcp, None)]
    });
    let svc2 = make_test_service("ns2", "svc2", "198.19.0.42", |s| {
        s.ports = vec![port("http", 80, Tcp, None), port("dns-udp", 53, Udp, None)]
    });
    let eps1 = slice(
        vec![ep("198.18.180.1", Some(TEST_NODE_NAME))],
        &[("http", 80, Tcp)],
    );
    let eps2 = slice(
        vec![ep("198.18.182.1", Some("node2"))],
        &[("http", 80, Tcp), ("dns-udp", 53, Udp)],
    );
    let cfg = RenderConfig {
        service_ranges: vec![(ip("198.19.0.0"), 16), (ip("2001:db8:5::"), 112)],
        ..fake_config(Family::V4)
    };
    let st = state(vec![(svc1, Some(eps1)), (svc2, Some(eps2))]);
    let dump = synced(&st, Family::V4, &cfg);
    run_packet_flow_tests(
        "TestClusterIPGeneral (nftables, service ranges)",
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
            Flow {
                protocol: "udp",
                ..flow(
                    "TCP-only port does not match UDP traffic",
                    "198.18.180.2",
                    "198.19.0.42",
                    80,
                    "REJECT",
                    false,
                )
            },
            flow(
                "svc1 does not accept svc2's ports",
                "198.18.180.2",
                "198.19.0.41",
                53,
                "REJECT",
                false,
            ),
            flow(
                "packet to unallocated cluster ip",
                "198.18.180.2",
                "198.19.0.50",
                80,
                "REJECT",
                false,
            ),
            flow(
                "packet outside the service range",
                "198.18.180.2",
                "198.18.9.9",
                80,
                "",
                false,
            ),
        ],
    );
    // Each family writes its own ranges only.
    let text = sync_text(&st, Family::V4, &cfg);
    assert!(!text.contains("2001:db8:5::"), "{text}");
}

#[test]
fn test_load_balancer() {
    let svc = make_test_service("ns1", "svc1", "198.19.0.41", |s| {
        s.ports = vec![port("p80", 80, Tcp, Some(3001))];
        s.load_balancer_ips = vec![ip("198.19.250.4"), ip("198.19.250.8")];
        s.load_balancer_source_ranges = vec![(ip("198.19.128.0"), 24), (ip("198.19.240.0"), 25)];
    });
    let dump = v4(&state(vec![(
        svc,
        Some(slice(vec![ep("198.18.180.1", None)], P80)),
    )]));
    let e = "198.18.180.1:80";
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
                e,
                false,
            ),
            flow(
                "external to nodePort",
                TEST_EXTERNAL_CLIENT,
                TEST_NODE_IP,
                3001,
                e,
                true,
            ),
            flow(
                "nodePort bypasses LoadBalancerSourceRanges",
                TEST_EXTERNAL_CLIENT_BLOCKED,
                TEST_NODE_IP,
                3001,
                e,
                true,
            ),
            flow(
                "accepted external to LB1",
                TEST_EXTERNAL_CLIENT,
                "198.19.250.4",
                80,
                e,
                true,
            ),
            flow(
                "accepted external to LB2",
                TEST_EXTERNAL_CLIENT,
                "198.19.250.8",
                80,
                e,
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
                e,
                true,
            ),
            flow(
                "node to LB2 (allowed by LoadBalancerSourceRanges)",
                TEST_NODE_IP,
                "198.19.250.8",
                80,
                e,
                true,
            ),
            flow(
                "same node to LB1, SNATted to LB1 (implicitly allowed)",
                "198.19.250.4",
                "198.19.250.4",
                80,
                e,
                true,
            ),
            flow(
                "same node to LB2, SNATted to LB2 (implicitly allowed)",
                "198.19.250.8",
                "198.19.250.8",
                80,
                e,
                true,
            ),
        ],
    );
}

/// TestBadIPs: addresses that API servers before 1.22 accepted (IPv4 octets with leading
/// zeros, decimal under Go 1.16's parser) reach the rules as kube-proxy's ParseIPSloppy
/// reads them, instead of the Service being refused. Built from the API objects, since the
/// reading happens in [`crate::model::convert`].
#[test]
fn test_bad_ips() {
    let svc: k8s_openapi::api::core::v1::Service = serde_saphyr::from_str(
        r#"
metadata: {name: svc1, namespace: ns1}
spec:
  type: LoadBalancer
  clusterIP: 198.19.0.041
  ports: [{name: p80, port: 80, nodePort: 3001}]
  externalIPs: [198.19.227.011]
  loadBalancerSourceRanges: [198.19.240.000/025]
status: {loadBalancer: {ingress: [{ip: 198.19.250.004}]}}
"#,
    )
    .unwrap();
    let slice: k8s_openapi::api::discovery::v1::EndpointSlice = serde_saphyr::from_str(
        r#"
metadata:
  name: svc1-1
  namespace: ns1
  labels: {kubernetes.io/service-name: svc1}
addressType: IPv4
ports: [{name: p80, port: 80}]
endpoints: [{addresses: [198.18.180.001]}]
"#,
    )
    .unwrap();
    let svc = crate::model::convert::service(&svc, None)
        .expect("leading zeros are read, not refused")
        .expect("proxied");
    let (_, name, info) = crate::model::convert::endpoint_slice(&slice)
        .expect("leading zeros are read, not refused")
        .expect("kept");
    let eps = EndpointSet {
        slices: crate::model::Slices::from([(name, info)]),
    };
    let dump = v4(&state(vec![(svc, Some(eps))]));
    let e = "198.18.180.1:80";
    run_packet_flow_tests(
        "TestBadIPs",
        &dump,
        TEST_NODE_IPS,
        &[
            flow(
                "pod to cluster IP",
                "198.18.0.2",
                "198.19.0.41",
                80,
                e,
                false,
            ),
            flow(
                "external to nodePort",
                TEST_EXTERNAL_CLIENT,
                TEST_NODE_IP,
                3001,
                e,
                true,
            ),
            flow(
                "external to external IP",
                TEST_EXTERNAL_CLIENT,
                "198.19.227.11",
                80,
                e,
                true,
            ),
            flow(
                "accepted external to LB",
                TEST_EXTERNAL_CLIENT,
                "198.19.250.4",
                80,
                e,
                true,
            ),
            flow(
                "blocked external to LB",
                TEST_EXTERNAL_CLIENT_BLOCKED,
                "198.19.250.4",
                80,
                "DROP",
                false,
            ),
        ],
    );
}

/// Not upstream's: the case of issue 11. A load balancer with source ranges and no
/// endpoints must neither jump to a chain that is not written (which made every restore
/// fail) nor let anything through: every address rejects.
#[test]
fn load_balancer_source_ranges_without_endpoints_reject() {
    let svc = make_test_service("ns1", "svc1", "198.19.0.41", |s| {
        s.ports = vec![port("p80", 80, Tcp, Some(3001))];
        s.load_balancer_ips = vec![ip("198.19.250.4")];
        s.load_balancer_source_ranges = vec![(ip("198.19.240.0"), 25)];
    });
    let dump = v4(&state(vec![(svc, None)]));
    run_packet_flow_tests(
        "LoadBalancerSourceRangesNoEndpoints",
        &dump,
        TEST_NODE_IPS,
        &[
            flow(
                "allowed external to LB",
                TEST_EXTERNAL_CLIENT,
                "198.19.250.4",
                80,
                "REJECT",
                false,
            ),
            flow(
                "blocked external to LB",
                TEST_EXTERNAL_CLIENT_BLOCKED,
                "198.19.250.4",
                80,
                "REJECT",
                false,
            ),
            flow(
                "pod to cluster IP",
                "198.18.0.2",
                "198.19.0.41",
                80,
                "REJECT",
                false,
            ),
        ],
    );
}

/// TestNodePorts: node ports under --nodeport-addresses. Upstream's cases that turn off
/// `--iptables-localhost-nodeports` with no addresses given are left out: we have no such
/// flag and behave as its default (IPv4 node ports answer on 127.0.0.1 too). Neither do we
/// write kubelet's KUBE-FIREWALL rule that upstream's cases check.
#[test]
fn test_node_ports() {
    struct Case {
        name: &'static str,
        family: Family,
        node_port_addresses: &'static [(&'static str, u8)],
        localhost_allowed: bool,
        allow_alt_node_ip: bool,
    }
    let cases = [
        Case {
            name: "ipv4, localhost-nodeports enabled",
            family: Family::V4,
            node_port_addresses: &[],
            localhost_allowed: true,
            allow_alt_node_ip: true,
        },
        Case {
            name: "ipv4, localhost-nodeports enabled, multiple nodeport-addresses",
            family: Family::V4,
            node_port_addresses: &[
                ("198.19.128.0", 24),
                ("198.19.129.0", 24),
                ("2001:db8::", 64),
            ],
            localhost_allowed: false,
            allow_alt_node_ip: true,
        },
        Case {
            name: "ipv6, localhost-nodeports enabled",
            family: Family::V6,
            node_port_addresses: &[],
            localhost_allowed: false,
            allow_alt_node_ip: true,
        },
        Case {
            name: "ipv6, localhost-nodeports disabled, multiple nodeport-addresses",
            family: Family::V6,
            node_port_addresses: &[
                ("198.19.128.0", 24),
                ("198.19.129.0", 24),
                ("2001:db8::", 64),
            ],
            localhost_allowed: false,
            allow_alt_node_ip: false,
        },
        // Not a case of upstream's table, but its NewNodePortAddresses: CIDRs of the other
        // family only mean every address of this one (issue 22).
        Case {
            name: "ipv6, nodeport-addresses of IPv4 only",
            family: Family::V6,
            node_port_addresses: &[("198.19.128.0", 24)],
            localhost_allowed: false,
            allow_alt_node_ip: true,
        },
        Case {
            name: "ipv4, nodeport-addresses of IPv6 only",
            family: Family::V4,
            node_port_addresses: &[("2001:db8::", 64)],
            localhost_allowed: true,
            allow_alt_node_ip: true,
        },
    ];
    for c in cases {
        let v4 = c.family.is_v4();
        let (svc_ip, ep1, ep2) = if v4 {
            ("198.19.0.41", "198.18.180.1", "198.18.182.1")
        } else {
            (
                "2001:db8:172:30::41",
                "2001:db8:10:180::1",
                "2001:db8:10:180::2:1",
            )
        };
        let svc = make_test_service("ns1", "svc1", svc_ip, |s| {
            s.ports = vec![port("p80", 80, Tcp, Some(3001))]
        });
        let eps = slice(vec![ep(ep1, None), ep(ep2, Some(TEST_NODE_NAME))], P80);
        let mut cfg = fake_config(c.family);
        cfg.nodeport_addresses = c
            .node_port_addresses
            .iter()
            .map(|&(a, l)| (ip(a), l))
            .collect();
        let dump = synced(&state(vec![(svc, Some(eps))]), c.family, &cfg);
        let (pod, external, node_ip, alt, localhost) = if v4 {
            (
                "198.18.0.2",
                TEST_EXTERNAL_CLIENT,
                TEST_NODE_IP,
                TEST_NODE_IP_ALT,
                "127.0.0.1",
            )
        } else {
            (
                "2001:db8:10::2",
                "2001:db8:ff::1",
                TEST_NODE_IPV6,
                TEST_NODE_IPV6_ALT,
                "::1",
            )
        };
        let fmt = |a: &str| {
            if v4 {
                format!("{a}:80")
            } else {
                format!("[{a}]:80")
            }
        };
        let output = format!("{}, {}", fmt(ep1), fmt(ep2));
        let mut flows = vec![
            flow("pod to cluster IP", pod, svc_ip, 80, &output, false),
            flow(
                "external to nodePort",
                external,
                node_ip,
                3001,
                &output,
                true,
            ),
            flow("node to nodePort", node_ip, node_ip, 3001, &output, true),
        ];
        if c.localhost_allowed {
            flows.push(flow(
                "localhost to nodePort gets masqueraded",
                localhost,
                localhost,
                3001,
                &output,
                true,
            ));
        } else {
            flows.push(flow(
                "localhost to nodePort is ignored",
                localhost,
                localhost,
                3001,
                "",
                false,
            ));
        }
        if c.allow_alt_node_ip {
            flows.push(flow(
                "external to nodePort on secondary IP",
                external,
                alt,
                3001,
                &output,
                true,
            ));
        } else {
            flows.push(flow(
                "secondary nodeIP ignores NodePorts",
                external,
                alt,
                3001,
                "",
                false,
            ));
        }
        run_packet_flow_tests(
            &format!("TestNodePorts/{}", c.name),
            &dump,
            TEST_NODE_IPS,
            &flows,
        );
    }
}

#[test]
fn test_health_check_node_port() {
    let mut cfg = fake_config(Family::V4);
    cfg.nodeport_addresses = vec![(ip("127.0.0.0"), 8)];
    let svc = make_test_service("ns1", "svc1", "198.19.0.42", |s| {
        s.ports = vec![port("p80", 80, Tcp, Some(3001))];
        s.health_check_node_port = Some(30000);
        s.external_policy_local = true;
    });
    let dump = synced(&state(vec![(svc, None)]), Family::V4, &cfg);
    run_packet_flow_tests(
        "TestHealthCheckNodePort",
        &dump,
        TEST_NODE_IPS,
        &[flow(
            "firewall accepts HealthCheckNodePort",
            "198.19.250.4",
            TEST_NODE_IP,
            30000,
            "ACCEPT",
            false,
        )],
    );
    let dump = synced(&state(vec![]), Family::V4, &cfg);
    run_packet_flow_tests(
        "TestHealthCheckNodePort",
        &dump,
        TEST_NODE_IPS,
        &[flow(
            "HealthCheckNodePort no longer has any rule",
            "198.19.250.4",
            TEST_NODE_IP,
            30000,
            "",
            false,
        )],
    );
}

#[test]
fn test_masquerade_rule() {
    for random_fully in [false, true] {
        let cfg = RenderConfig {
            random_fully,
            ..fake_config(Family::V4)
        };
        let dump = synced(&state(vec![]), Family::V4, &cfg);
        let rules: Vec<&str> = dump
            .chain("nat", "KUBE-POSTROUTING")
            .iter()
            .map(|r| r.raw.as_str())
            .collect();
        let last = if random_fully { " --random-fully" } else { "" };
        assert_eq!(
            rules,
            [
                "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN".to_string(),
                "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000".to_string(),
                format!(
                    "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE{last}"
                ),
            ]
        );
    }
}

fn lb_with_policy(local: bool) -> (Service, EndpointSet) {
    let svc = make_test_service("ns1", "svc1", "198.19.0.41", |s| {
        s.external_policy_local = local;
        s.external_ips = vec![ip(TEST_EXTERNAL_IP)];
        s.ports = vec![port("p80", 80, Tcp, Some(3001))];
        s.health_check_node_port = local.then_some(30000);
        s.load_balancer_ips = vec![ip("198.19.250.4")];
    });
    (
        svc,
        slice(
            vec![
                ep("198.18.180.1", None),
                ep("198.18.182.1", Some(TEST_NODE_NAME)),
            ],
            P80,
        ),
    )
}

#[test]
fn test_external_traffic_policy_local() {
    let (svc, eps) = lb_with_policy(true);
    let dump = v4(&state(vec![(svc, Some(eps))]));
    let (both, local) = ("198.18.180.1:80, 198.18.182.1:80", "198.18.182.1:80");
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
    let (svc, eps) = lb_with_policy(false);
    let dump = v4(&state(vec![(svc, Some(eps))]));
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
    // (name, internalTrafficPolicy Local, endpoints as (address, node), output)
    type Case<'a> = (&'a str, bool, [(&'a str, &'a str); 3], &'a str);
    let cases: [Case<'_>; 4] = [
        (
            "internalTrafficPolicy is cluster",
            false,
            [
                ("198.18.1.1", TEST_NODE_NAME),
                ("198.18.1.2", "node1"),
                ("198.18.1.3", "node2"),
            ],
            "198.18.1.1:80, 198.18.1.2:80, 198.18.1.3:80",
        ),
        (
            "internalTrafficPolicy is local and there is one local endpoint",
            true,
            [
                ("198.18.1.1", TEST_NODE_NAME),
                ("198.18.1.2", "node1"),
                ("198.18.1.3", "node2"),
            ],
            "198.18.1.1:80",
        ),
        (
            "internalTrafficPolicy is local and there are multiple local endpoints",
            true,
            [
                ("198.18.1.1", TEST_NODE_NAME),
                ("198.18.1.2", TEST_NODE_NAME),
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
    for (name, local, eps, output) in cases {
        let svc = make_test_service("ns1", "svc1", "198.19.1.1", |s| {
            s.ports = vec![port("", 80, Tcp, None)];
            s.internal_policy_local = local;
        });
        let eps = slice(
            eps.iter().map(|&(a, n)| ep(a, Some(n))).collect(),
            UNNAMED_80,
        );
        let dump = v4(&state(vec![(svc.clone(), Some(eps))]));
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
        let dump = v4(&state(vec![(svc, None)]));
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

#[test]
fn test_terminating_endpoints_traffic_policy_local() {
    let svc = make_test_service("ns1", "svc1", "198.19.1.1", |s| {
        s.external_policy_local = true;
        s.ports = vec![port("", 80, Tcp, None)];
        s.health_check_node_port = Some(30000);
        s.load_balancer_ips = vec![ip("198.19.250.4")];
    });
    let here = Some(TEST_NODE_NAME);
    let cases = [
        (
            "ready endpoints exist",
            vec![
                ep_cond("198.18.1.1", here, true, true, false),
                ep_cond("198.18.1.2", here, true, true, false),
                ep_cond("198.18.1.3", here, false, true, true),
                ep_cond("198.18.1.4", here, false, false, true),
                ep_cond("198.18.1.5", Some("node-1"), true, true, false),
            ],
            "198.18.1.1:80, 198.18.1.2:80, 198.18.1.5:80",
            "198.18.1.1:80, 198.18.1.2:80",
        ),
        (
            "only terminating endpoints exist",
            vec![
                ep_cond("198.18.1.2", here, false, true, true),
                ep_cond("198.18.1.3", here, false, true, true),
                ep_cond("198.18.1.4", here, false, false, true),
                ep_cond("198.18.1.5", Some("node-1"), true, true, false),
            ],
            "198.18.1.5:80",
            "198.18.1.2:80, 198.18.1.3:80",
        ),
        (
            "terminating endpoints on remote node",
            vec![ep_cond("198.18.1.5", Some("node-1"), false, true, true)],
            "198.18.1.5:80",
            "DROP",
        ),
        (
            "no usable endpoints on any node",
            vec![
                ep_cond("198.18.1.5", here, false, false, true),
                ep_cond("198.18.1.5", Some("node-1"), false, false, true),
            ],
            "REJECT",
            "REJECT",
        ),
    ];
    for (name, eps, to_cluster_ip, to_lb) in cases {
        let test = format!("TestTerminatingEndpointsTrafficPolicyLocal/{name}");
        let dump = v4(&state(vec![(svc.clone(), Some(slice(eps, UNNAMED_80)))]));
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
                    false,
                ),
            ],
        );
        let dump = v4(&state(vec![(svc.clone(), None)]));
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

/// Upstream's expected output for TestOverallIPTablesRules, in our addresses, with
/// `{SEP spn ip:port}` for the endpoint chains (their names hash the endpoint's address).
/// Left out on purpose (see docs/modes.md): kubelet's KUBE-FIREWALL chain, the nfacct matches and
/// the localhost node-port rules (`-d 127.0.0.0/8 ... -m nfacct`).
const OVERALL_EXPECTED: &str = r#"*filter
:KUBE-NODEPORTS - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
-A KUBE-NODEPORTS -m comment --comment "ns2/svc2:p80 health check node port" -m tcp -p tcp --dport 30000 -j ACCEPT
-A KUBE-SERVICES -m comment --comment "ns6/svc6:p80 has no endpoints" -m tcp -p tcp -d 198.19.0.46 --dport 80 -j REJECT
-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns2/svc2:p80 has no local endpoints" -m tcp -p tcp -d 198.19.227.22 --dport 80 -j DROP
-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns2/svc2:p80 has no local endpoints" -m tcp -p tcp -d 198.19.250.4 --dport 80 -j DROP
-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns2/svc2:p80 has no local endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 3001 -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A KUBE-PROXY-FIREWALL -m comment --comment "ns5/svc5:p80 traffic not accepted by KUBE-FW-NUKIZ6OKUXPJNT4C" -m tcp -p tcp -d 198.19.250.8 --dport 80 -j DROP
COMMIT
*nat
:KUBE-NODEPORTS - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-EXT-4SW47YFZTEDKD3PK - [0:0]
:KUBE-EXT-GNZBNJ2PO5MGZ6GT - [0:0]
:KUBE-EXT-NUKIZ6OKUXPJNT4C - [0:0]
:KUBE-EXT-X27LE4BHSL4DOUIK - [0:0]
:KUBE-FW-NUKIZ6OKUXPJNT4C - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-POSTROUTING - [0:0]
:{SEP ns4/svc4:p80 198.18.180.5:80} - [0:0]
:{SEP ns5/svc5:p80 198.18.180.3:80} - [0:0]
:{SEP ns3/svc3:p80 198.18.180.3:80} - [0:0]
:{SEP ns2/svc2:p80 198.18.180.2:80} - [0:0]
:{SEP ns1/svc1:p80 198.18.180.1:80} - [0:0]
:{SEP ns4/svc4:p80 198.18.180.4:80} - [0:0]
:KUBE-SVC-4SW47YFZTEDKD3PK - [0:0]
:KUBE-SVC-GNZBNJ2PO5MGZ6GT - [0:0]
:KUBE-SVC-NUKIZ6OKUXPJNT4C - [0:0]
:KUBE-SVC-X27LE4BHSL4DOUIK - [0:0]
:KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
-A KUBE-NODEPORTS -m comment --comment ns2/svc2:p80 -m tcp -p tcp --dport 3001 -j KUBE-EXT-GNZBNJ2PO5MGZ6GT
-A KUBE-NODEPORTS -m comment --comment ns3/svc3:p80 -m tcp -p tcp --dport 3003 -j KUBE-EXT-X27LE4BHSL4DOUIK
-A KUBE-NODEPORTS -m comment --comment ns5/svc5:p80 -m tcp -p tcp --dport 3002 -j KUBE-EXT-NUKIZ6OKUXPJNT4C
-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 198.19.0.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
-A KUBE-SERVICES -m comment --comment "ns2/svc2:p80 cluster IP" -m tcp -p tcp -d 198.19.0.42 --dport 80 -j KUBE-SVC-GNZBNJ2PO5MGZ6GT
-A KUBE-SERVICES -m comment --comment "ns2/svc2:p80 external IP" -m tcp -p tcp -d 198.19.227.22 --dport 80 -j KUBE-EXT-GNZBNJ2PO5MGZ6GT
-A KUBE-SERVICES -m comment --comment "ns2/svc2:p80 loadbalancer IP" -m tcp -p tcp -d 198.19.250.4 --dport 80 -j KUBE-EXT-GNZBNJ2PO5MGZ6GT
-A KUBE-SERVICES -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 198.19.0.43 --dport 80 -j KUBE-SVC-X27LE4BHSL4DOUIK
-A KUBE-SERVICES -m comment --comment "ns4/svc4:p80 cluster IP" -m tcp -p tcp -d 198.19.0.44 --dport 80 -j KUBE-SVC-4SW47YFZTEDKD3PK
-A KUBE-SERVICES -m comment --comment "ns4/svc4:p80 external IP" -m tcp -p tcp -d 198.19.227.33 --dport 80 -j KUBE-EXT-4SW47YFZTEDKD3PK
-A KUBE-SERVICES -m comment --comment "ns5/svc5:p80 cluster IP" -m tcp -p tcp -d 198.19.0.45 --dport 80 -j KUBE-SVC-NUKIZ6OKUXPJNT4C
-A KUBE-SERVICES -m comment --comment "ns5/svc5:p80 loadbalancer IP" -m tcp -p tcp -d 198.19.250.8 --dport 80 -j KUBE-FW-NUKIZ6OKUXPJNT4C
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-EXT-4SW47YFZTEDKD3PK -m comment --comment "masquerade traffic for ns4/svc4:p80 external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-4SW47YFZTEDKD3PK -j KUBE-SVC-4SW47YFZTEDKD3PK
-A KUBE-EXT-GNZBNJ2PO5MGZ6GT -m comment --comment "pod traffic for ns2/svc2:p80 external destinations" -s 198.18.0.0/16 -j KUBE-SVC-GNZBNJ2PO5MGZ6GT
-A KUBE-EXT-GNZBNJ2PO5MGZ6GT -m comment --comment "masquerade LOCAL traffic for ns2/svc2:p80 external destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ
-A KUBE-EXT-GNZBNJ2PO5MGZ6GT -m comment --comment "route LOCAL traffic for ns2/svc2:p80 external destinations" -m addrtype --src-type LOCAL -j KUBE-SVC-GNZBNJ2PO5MGZ6GT
-A KUBE-EXT-NUKIZ6OKUXPJNT4C -m comment --comment "masquerade traffic for ns5/svc5:p80 external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-NUKIZ6OKUXPJNT4C -j KUBE-SVC-NUKIZ6OKUXPJNT4C
-A KUBE-EXT-X27LE4BHSL4DOUIK -m comment --comment "masquerade traffic for ns3/svc3:p80 external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-X27LE4BHSL4DOUIK -j KUBE-SVC-X27LE4BHSL4DOUIK
-A KUBE-FW-NUKIZ6OKUXPJNT4C -m comment --comment "ns5/svc5:p80 loadbalancer IP" -s 198.19.240.0/25 -j KUBE-EXT-NUKIZ6OKUXPJNT4C
-A KUBE-FW-NUKIZ6OKUXPJNT4C -m comment --comment "other traffic to ns5/svc5:p80 will be dropped by KUBE-PROXY-FIREWALL"
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE
-A {SEP ns4/svc4:p80 198.18.180.5:80} -m comment --comment ns4/svc4:p80 -s 198.18.180.5 -j KUBE-MARK-MASQ
-A {SEP ns4/svc4:p80 198.18.180.5:80} -m comment --comment ns4/svc4:p80 -m tcp -p tcp -j DNAT --to-destination 198.18.180.5:80
-A {SEP ns5/svc5:p80 198.18.180.3:80} -m comment --comment ns5/svc5:p80 -s 198.18.180.3 -j KUBE-MARK-MASQ
-A {SEP ns5/svc5:p80 198.18.180.3:80} -m comment --comment ns5/svc5:p80 -m recent --name {SEP ns5/svc5:p80 198.18.180.3:80} --set -m tcp -p tcp -j DNAT --to-destination 198.18.180.3:80
-A {SEP ns3/svc3:p80 198.18.180.3:80} -m comment --comment ns3/svc3:p80 -s 198.18.180.3 -j KUBE-MARK-MASQ
-A {SEP ns3/svc3:p80 198.18.180.3:80} -m comment --comment ns3/svc3:p80 -m tcp -p tcp -j DNAT --to-destination 198.18.180.3:80
-A {SEP ns2/svc2:p80 198.18.180.2:80} -m comment --comment ns2/svc2:p80 -s 198.18.180.2 -j KUBE-MARK-MASQ
-A {SEP ns2/svc2:p80 198.18.180.2:80} -m comment --comment ns2/svc2:p80 -m tcp -p tcp -j DNAT --to-destination 198.18.180.2:80
-A {SEP ns1/svc1:p80 198.18.180.1:80} -m comment --comment ns1/svc1:p80 -s 198.18.180.1 -j KUBE-MARK-MASQ
-A {SEP ns1/svc1:p80 198.18.180.1:80} -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 198.18.180.1:80
-A {SEP ns4/svc4:p80 198.18.180.4:80} -m comment --comment ns4/svc4:p80 -s 198.18.180.4 -j KUBE-MARK-MASQ
-A {SEP ns4/svc4:p80 198.18.180.4:80} -m comment --comment ns4/svc4:p80 -m tcp -p tcp -j DNAT --to-destination 198.18.180.4:80
-A KUBE-SVC-4SW47YFZTEDKD3PK -m comment --comment "ns4/svc4:p80 cluster IP" -m tcp -p tcp -d 198.19.0.44 --dport 80 ! -s 198.18.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-SVC-4SW47YFZTEDKD3PK -m comment --comment "ns4/svc4:p80 -> 198.18.180.4:80" -m statistic --mode random --probability 0.5000000000 -j {SEP ns4/svc4:p80 198.18.180.4:80}
-A KUBE-SVC-4SW47YFZTEDKD3PK -m comment --comment "ns4/svc4:p80 -> 198.18.180.5:80" -j {SEP ns4/svc4:p80 198.18.180.5:80}
-A KUBE-SVC-GNZBNJ2PO5MGZ6GT -m comment --comment "ns2/svc2:p80 cluster IP" -m tcp -p tcp -d 198.19.0.42 --dport 80 ! -s 198.18.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-SVC-GNZBNJ2PO5MGZ6GT -m comment --comment "ns2/svc2:p80 -> 198.18.180.2:80" -j {SEP ns2/svc2:p80 198.18.180.2:80}
-A KUBE-SVC-NUKIZ6OKUXPJNT4C -m comment --comment "ns5/svc5:p80 cluster IP" -m tcp -p tcp -d 198.19.0.45 --dport 80 ! -s 198.18.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-SVC-NUKIZ6OKUXPJNT4C -m comment --comment "ns5/svc5:p80 -> 198.18.180.3:80" -m recent --name {SEP ns5/svc5:p80 198.18.180.3:80} --rcheck --seconds 10800 --reap -j {SEP ns5/svc5:p80 198.18.180.3:80}
-A KUBE-SVC-NUKIZ6OKUXPJNT4C -m comment --comment "ns5/svc5:p80 -> 198.18.180.3:80" -j {SEP ns5/svc5:p80 198.18.180.3:80}
-A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 198.19.0.43 --dport 80 ! -s 198.18.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 -> 198.18.180.3:80" -j {SEP ns3/svc3:p80 198.18.180.3:80}
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 198.19.0.41 --dport 80 ! -s 198.18.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 198.18.180.1:80" -j {SEP ns1/svc1:p80 198.18.180.1:80}
COMMIT
"#;

/// Expands `{SEP spn ip:port}` into the endpoint chain's name.
fn expand_seps(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find("{SEP ") {
        out.push_str(&rest[..i]);
        let end = rest[i..].find('}').unwrap() + i;
        let (spn, addr) = rest[i + 5..end].split_once(' ').unwrap();
        out.push_str(&crate::dataplane::iptables::names::endpoint_chain(
            spn,
            Tcp,
            addr.parse().unwrap(),
        ));
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// A table's chains created, and each chain's rules.
type TableRules = (
    std::collections::BTreeSet<String>,
    BTreeMap<String, Vec<String>>,
);

/// Per table: the chains created, and each chain's rules in order; comments unquoted
/// (iptables-restore reads `--comment ns1/svc1:p80` and `--comment "ns1/svc1:p80"` alike).
fn by_chain(text: &str) -> BTreeMap<String, TableRules> {
    let mut out: BTreeMap<String, TableRules> = BTreeMap::new();
    let mut table = String::new();
    for line in text.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t.to_string();
        } else if let Some(c) = line.strip_prefix(':') {
            out.entry(table.clone())
                .or_default()
                .0
                .insert(c.split(' ').next().unwrap().to_string());
        } else if let Some(r) = line.strip_prefix("-A ") {
            let chain = r.split(' ').next().unwrap().to_string();
            out.entry(table.clone())
                .or_default()
                .1
                .entry(chain)
                .or_default()
                .push(line.replace('"', ""));
        }
    }
    out
}

#[test]
fn test_overall_iptables_rules() {
    let np = |n| port("p80", 80, Tcp, n);
    let svc1 = make_test_service("ns1", "svc1", "198.19.0.41", |s| s.ports = vec![np(None)]);
    let svc2 = make_test_service("ns2", "svc2", "198.19.0.42", |s| {
        s.external_policy_local = true;
        s.ports = vec![np(Some(3001))];
        s.load_balancer_ips = vec![ip("198.19.250.4")];
        s.external_ips = vec![ip("198.19.227.22")];
        s.health_check_node_port = Some(30000);
    });
    let svc3 = make_test_service("ns3", "svc3", "198.19.0.43", |s| {
        s.ports = vec![np(Some(3003))]
    });
    let svc4 = make_test_service("ns4", "svc4", "198.19.0.44", |s| {
        s.external_ips = vec![ip("198.19.227.33")];
        s.ports = vec![np(None)];
    });
    let svc5 = make_test_service("ns5", "svc5", "198.19.0.45", |s| {
        s.ports = vec![np(Some(3002))];
        s.load_balancer_ips = vec![ip("198.19.250.8")];
        s.load_balancer_source_ranges = vec![(ip("198.19.240.0"), 25)];
        s.affinity_timeout = Some(10800);
    });
    let svc6 = make_test_service("ns6", "svc6", "198.19.0.46", |s| s.ports = vec![np(None)]);
    let st = state(vec![
        (svc1, Some(slice(vec![ep("198.18.180.1", None)], P80))),
        (svc2, Some(slice(vec![ep("198.18.180.2", None)], P80))),
        (svc3, Some(slice(vec![ep("198.18.180.3", None)], P80))),
        (
            svc4,
            Some(slice(
                vec![
                    ep("198.18.180.4", None),
                    ep("198.18.180.5", Some(TEST_NODE_NAME)),
                ],
                P80,
            )),
        ),
        (svc5, Some(slice(vec![ep("198.18.180.3", None)], P80))),
        (svc6, None),
    ]);
    let text = sync_text(&st, Family::V4, &fake_config(Family::V4));
    check_rule_jumps(&text).unwrap();
    let (got, want) = (by_chain(&text), by_chain(&expand_seps(OVERALL_EXPECTED)));
    for table in ["filter", "nat"] {
        assert_eq!(got[table].0, want[table].0, "{table} chains\n{text}");
        for (chain, rules) in &want[table].1 {
            assert_eq!(
                got[table].1.get(chain),
                Some(rules),
                "{table} {chain}\n{text}"
            );
        }
        assert_eq!(
            got[table].1.len(),
            want[table].1.len(),
            "{table}: chains with rules\n{text}"
        );
    }
}

/// TestDropInvalidRule: the INVALID drop in KUBE-FORWARD is written unless conntrack is
/// liberal about TCP windows (conntrack.tcpBeLiberal).
#[test]
fn test_drop_invalid_rule() {
    for tcp_liberal in [false, true] {
        let mut cfg = fake_config(Family::V4);
        cfg.conntrack_tcp_liberal = tcp_liberal;
        let text = sync_text(&ProxyState::default(), Family::V4, &cfg);
        let mut want = Vec::new();
        if !tcp_liberal {
            want.push("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP");
        }
        want.extend([
            "-A KUBE-FORWARD -m comment --comment kubernetes forwarding rules -m mark --mark 0x4000/0x4000 -j ACCEPT",
            "-A KUBE-FORWARD -m comment --comment kubernetes forwarding conntrack rule -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        ]);
        assert_eq!(
            by_chain(&text)["filter"].1["KUBE-FORWARD"],
            want,
            "TestDropInvalidRule/tcpLiberal {tcp_liberal}\n{text}"
        );
    }
}
