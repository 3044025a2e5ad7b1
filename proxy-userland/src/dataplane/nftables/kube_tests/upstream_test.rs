//! The tracer and the transaction helpers checked against kube-proxy's own expected dumps
//! (helpers_test.go's unit tests, proxier_test.go's baseRules and TestOverallNFTablesRules'
//! dump, addresses remapped as [`super`] says), with packet expectations taken from
//! upstream's tests of the same kinds of service.

use super::*;

/// proxier_test.go's baseRules.
pub const BASE_RULES: &str = include_str!("fixtures/base_rules.nft");
/// TestOverallNFTablesRules' services, after baseRules.
pub const OVERALL: &str = include_str!("fixtures/overall_nftables_rules.nft");

fn overall() -> Dump {
    Dump::parse(&format!("{BASE_RULES}\n{OVERALL}")).expect("upstream's dump parses")
}

/// Packet expectations for TestOverallNFTablesRules' services, from upstream's tests of
/// the same kinds of service (named in the comments).
pub fn overall_flows() -> Vec<Flow<'static>> {
    let svc4 = "198.18.180.4:80, 198.18.180.5:80";
    vec![
        // TestClusterIPGeneral's cases, on svc1.
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
            "svc1 does not accept other ports",
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
            "DROP",
            false,
        ),
        // TestInternalExternalMasquerade's "external to ClusterIP", "node to ClusterIP".
        flow(
            "external to ClusterIP",
            TEST_EXTERNAL_CLIENT,
            "198.19.0.41",
            80,
            "198.18.180.1:80",
            true,
        ),
        flow(
            "node to ClusterIP",
            TEST_NODE_IP,
            "198.19.0.41",
            80,
            "198.18.180.1:80",
            true,
        ),
        // svc2: eTP Local, its one endpoint not local (TestExternalTrafficPolicyLocal,
        // TestTerminatingEndpointsTrafficPolicyLocal "no locally-usable endpoints").
        flow(
            "pod to LB with eTP:Local",
            "198.18.0.2",
            "198.19.250.4",
            80,
            "198.18.180.2:80",
            false,
        ),
        flow(
            "external to LB, no local endpoints",
            TEST_EXTERNAL_CLIENT,
            "198.19.250.4",
            80,
            "DROP",
            false,
        ),
        flow(
            "external to external IP, no local endpoints",
            TEST_EXTERNAL_CLIENT,
            "198.19.227.22",
            80,
            "DROP",
            false,
        ),
        flow(
            "external to NodePort, no local endpoints",
            TEST_EXTERNAL_CLIENT,
            TEST_NODE_IP,
            3001,
            "DROP",
            false,
        ),
        flow(
            "node to external IP with eTP:Local",
            TEST_NODE_IP,
            "198.19.227.22",
            80,
            "198.18.180.2:80",
            true,
        ),
        flow(
            "pod to NodePort with eTP:Local",
            "198.18.0.2",
            TEST_NODE_IP,
            3001,
            "198.18.180.2:80",
            false,
        ),
        // svc3: NodePort (TestNodePorts).
        flow(
            "external to nodePort",
            TEST_EXTERNAL_CLIENT,
            TEST_NODE_IP,
            3003,
            "198.18.180.3:80",
            true,
        ),
        flow(
            "node to nodePort",
            TEST_NODE_IP,
            TEST_NODE_IP,
            3003,
            "198.18.180.3:80",
            true,
        ),
        flow(
            "secondary nodeIP ignores NodePorts",
            TEST_EXTERNAL_CLIENT,
            TEST_NODE_IP_ALT,
            3003,
            "",
            false,
        ),
        // svc4: external IP, eTP Cluster (TestExternalTrafficPolicyCluster).
        flow(
            "pod to external IP",
            "198.18.0.2",
            "198.19.227.33",
            80,
            svc4,
            true,
        ),
        flow(
            "external to external IP",
            TEST_EXTERNAL_CLIENT,
            "198.19.227.33",
            80,
            svc4,
            true,
        ),
        flow(
            "pod to cluster IP, two endpoints",
            "198.18.0.2",
            "198.19.0.44",
            80,
            svc4,
            false,
        ),
        // svc5: source ranges and affinity (TestLoadBalancer).
        flow(
            "accepted external to LB",
            TEST_EXTERNAL_CLIENT,
            "198.19.250.8",
            80,
            "198.18.180.3:80",
            true,
        ),
        flow(
            "blocked external to LB",
            TEST_EXTERNAL_CLIENT_BLOCKED,
            "198.19.250.8",
            80,
            "DROP",
            false,
        ),
        flow(
            "pod to LB (blocked by LoadBalancerSourceRanges)",
            "198.18.0.2",
            "198.19.250.8",
            80,
            "DROP",
            false,
        ),
        flow(
            "nodePort bypasses LoadBalancerSourceRanges",
            TEST_EXTERNAL_CLIENT_BLOCKED,
            TEST_NODE_IP,
            3002,
            "198.18.180.3:80",
            true,
        ),
        flow(
            "pod to cluster IP with affinity",
            "198.18.0.2",
            "198.19.0.45",
            80,
            "198.18.180.3:80",
            false,
        ),
        // svc6: no endpoints (TestNoEndpointsReject).
        flow(
            "pod to cluster IP with no endpoints",
            "198.18.0.2",
            "198.19.0.46",
            80,
            "REJECT",
            false,
        ),
        flow(
            "external to cluster IP with no endpoints",
            TEST_EXTERNAL_CLIENT,
            "198.19.0.46",
            80,
            "REJECT",
            false,
        ),
    ]
}

#[test]
fn test_overall_nftables_rules_dump_traces() {
    run_packet_flow_tests(
        "TestOverallNFTablesRules (upstream dump)",
        &overall(),
        TEST_NODE_IPS,
        &overall_flows(),
    );
}

/// Protocols are told apart: a UDP packet to a TCP-only port is refused, as upstream's
/// "TCP-only port does not match UDP traffic".
#[test]
fn test_overall_nftables_rules_dump_protocols() {
    let dump = overall();
    run_packet_flow_tests(
        "TestClusterIPGeneral protocols (upstream dump)",
        &dump,
        TEST_NODE_IPS,
        &[
            Flow {
                protocol: "udp",
                ..flow(
                    "TCP-only port does not match UDP traffic",
                    "198.18.180.2",
                    "198.19.0.41",
                    80,
                    "REJECT",
                    false,
                )
            },
            Flow {
                protocol: "sctp",
                ..flow(
                    "nor SCTP",
                    "198.18.180.2",
                    "198.19.0.42",
                    80,
                    "REJECT",
                    false,
                )
            },
        ],
    );
}

/// An IPv6 dump written as upstream's NewFakeProxier(IPv6) would, with TestNodePorts'
/// "ipv6" expectations.
#[test]
fn test_node_ports_ipv6_dump_traces() {
    let base = BASE_RULES
        .replace("add table ip ", "add table ip6 ")
        .replace(" ip fastpath ", " ip6 fastpath ")
        .replace("ipv4_addr", "ipv6_addr")
        .replace("ip daddr", "ip6 daddr")
        .replace("198.19.0.0/17", "2001:db8:10:96::/112")
        .replace("{ 198.19.128.2 }", "{ 2001:db8::1 }");
    let svc = "
add chain ip6 fastpath service-ULMVA6XW-ns1/svc1/tcp/p80
add rule ip6 fastpath service-ULMVA6XW-ns1/svc1/tcp/p80 ip6 daddr 2001:db8:172:30::41 ip6 saddr != 2001:db8:10::/64 jump mark-for-masquerade
add rule ip6 fastpath service-ULMVA6XW-ns1/svc1/tcp/p80 numgen random mod 2 vmap { 0 : goto endpoint-A-ns1/svc1/tcp/p80__2001.db8.10.180..1/80 , 1 : goto endpoint-B-ns1/svc1/tcp/p80__2001.db8.10.180..2.1/80 }
add chain ip6 fastpath external-ULMVA6XW-ns1/svc1/tcp/p80
add rule ip6 fastpath external-ULMVA6XW-ns1/svc1/tcp/p80 jump mark-for-masquerade
add rule ip6 fastpath external-ULMVA6XW-ns1/svc1/tcp/p80 goto service-ULMVA6XW-ns1/svc1/tcp/p80
add chain ip6 fastpath endpoint-A-ns1/svc1/tcp/p80__2001.db8.10.180..1/80
add rule ip6 fastpath endpoint-A-ns1/svc1/tcp/p80__2001.db8.10.180..1/80 ip6 saddr 2001:db8:10:180::1 jump mark-for-masquerade
add rule ip6 fastpath endpoint-A-ns1/svc1/tcp/p80__2001.db8.10.180..1/80 meta l4proto tcp dnat to [2001:db8:10:180::1]:80
add chain ip6 fastpath endpoint-B-ns1/svc1/tcp/p80__2001.db8.10.180..2.1/80
add rule ip6 fastpath endpoint-B-ns1/svc1/tcp/p80__2001.db8.10.180..2.1/80 ip6 saddr 2001:db8:10:180::2:1 jump mark-for-masquerade
add rule ip6 fastpath endpoint-B-ns1/svc1/tcp/p80__2001.db8.10.180..2.1/80 meta l4proto tcp dnat to [2001:db8:10:180::2:1]:80
add element ip6 fastpath cluster-ips { 2001:db8:172:30::41 }
add element ip6 fastpath service-ips { 2001:db8:172:30::41 . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }
add element ip6 fastpath service-nodeports { tcp . 3001 : goto external-ULMVA6XW-ns1/svc1/tcp/p80 }
";
    let dump = Dump::parse(&format!("{base}\n{svc}")).expect("parses");
    let both = "[2001:db8:10:180::1]:80, [2001:db8:10:180::2:1]:80";
    run_packet_flow_tests(
        "TestNodePorts ipv6 (upstream layout)",
        &dump,
        TEST_NODE_IPS,
        &[
            flow(
                "pod to cluster IP",
                "2001:db8:10::2",
                "2001:db8:172:30::41",
                80,
                both,
                false,
            ),
            flow(
                "external to nodePort",
                "2001:db8:5200::1",
                TEST_NODE_IPV6,
                3001,
                both,
                true,
            ),
            flow(
                "node to nodePort",
                TEST_NODE_IPV6,
                TEST_NODE_IPV6,
                3001,
                both,
                true,
            ),
            flow(
                "secondary nodeIP ignores NodePorts",
                "2001:db8:5200::1",
                TEST_NODE_IPV6_ALT,
                3001,
                "",
                false,
            ),
        ],
    );
}

/// A statement the tracer cannot read, or a jump to a missing chain, fails the trace
/// instead of passing for a non-match (upstream's "unmatched rule" error).
#[test]
fn test_trace_reports_unknown_statements() {
    let mut dump = overall();
    dump.chains
        .get_mut("services")
        .unwrap()
        .rules
        .insert(0, "ip dscp 0x2e drop".into());
    let t = trace_packet(&dump, ip("198.18.0.2"), "tcp", ip("198.19.0.41"), 80, &[]);
    assert!(t.errors.iter().any(|e| e.contains("ip dscp")), "{t:?}");

    // A numgen map that jumps back to its own chain: bounded work, and an error.
    let dump = Dump::parse(&format!(
        "{BASE_RULES}
add chain ip fastpath loop
add rule ip fastpath loop numgen random mod 2 vmap {{ 0 : goto loop , 1 : goto loop }}
add element ip fastpath service-ips {{ 198.19.0.8 . tcp . 80 : goto loop }}"
    ))
    .unwrap();
    let t = trace_packet(&dump, ip("198.18.0.2"), "tcp", ip("198.19.0.8"), 80, &[]);
    assert!(!t.errors.is_empty(), "{t:?}");

    let dump = Dump::parse(&format!(
        "{BASE_RULES}\nadd element ip fastpath service-ips {{ 198.19.0.9 . tcp . 80 : goto nowhere }}"
    ))
    .unwrap();
    let t = trace_packet(&dump, ip("198.18.0.2"), "tcp", ip("198.19.0.9"), 80, &[]);
    assert!(t.errors.iter().any(|e| e.contains("nowhere")), "{t:?}");
}

#[test]
fn test_dump_parse_errors() {
    for (text, want) in [
        (
            "add rule ip fastpath missing ip daddr 198.19.0.1 drop",
            "no chain missing",
        ),
        (
            "add element ip fastpath nope { 198.19.0.1 }",
            "no set or map nope",
        ),
        (
            "add chain ip fastpath c { type nat hook output priority lots ; }",
            "priority",
        ),
        (
            "add table ip fastpath\nadd chain ip other c",
            "but this dump is of ip fastpath",
        ),
        (
            "replace rule ip fastpath c handle 4 drop",
            "unknown statement",
        ),
        ("add", "too short"),
    ] {
        let err = Dump::parse(text).expect_err(text);
        assert!(err.to_string().contains(want), "{text}: {err}");
    }
}

/// flush/delete statements played over a dump, as a partial sync's transaction is.
#[test]
fn test_dump_applies_flush_and_delete() {
    let text = format!(
        "{BASE_RULES}\n{OVERALL}
flush chain ip fastpath service-ULMVA6XW-ns1/svc1/tcp/p80
delete element ip fastpath service-ips {{ 198.19.0.41 . tcp . 80 }}
add element ip fastpath no-endpoint-services {{ 198.19.0.41 . tcp . 80 comment \"ns1/svc1:p80\" : goto reject-chain }}
delete chain ip fastpath endpoint-5OJB2KTY-ns1/svc1/tcp/p80__198.18.180.1/80"
    );
    let dump = Dump::parse(&text).unwrap();
    assert_eq!(dump.chain_text("service-ULMVA6XW-ns1/svc1/tcp/p80"), "");
    assert!(
        !dump
            .chains
            .contains_key("endpoint-5OJB2KTY-ns1/svc1/tcp/p80__198.18.180.1/80")
    );
    run_packet_flow_tests(
        "flush/delete",
        &dump,
        TEST_NODE_IPS,
        &[flow(
            "endpoints deleted",
            "198.18.0.2",
            "198.19.0.41",
            80,
            "REJECT",
            false,
        )],
    );
}

// helpers_test.go's testInput / testExpected, in our table and addresses.
const TEST_INPUT: &str = r#"
add table ip fastpath { comment "rules for kube-proxy" ; }

add chain ip fastpath mark-for-masquerade
add rule ip fastpath mark-for-masquerade mark set mark or 0x4000
add chain ip fastpath masquerading
add rule ip fastpath masquerading mark and 0x4000 == 0 return
add rule ip fastpath masquerading mark set mark xor 0x4000
add rule ip fastpath masquerading masquerade fully-random

add set ip fastpath firewall { type ipv4_addr . inet_proto . inet_service ; comment "destinations that are subject to LoadBalancerSourceRanges" ; }
add set ip fastpath firewall-allow { type ipv4_addr . inet_proto . inet_service . ipv4_addr ; flags interval ; comment "destinations+sources that are allowed by LoadBalancerSourceRanges" ; }
add chain ip fastpath firewall-check
add chain ip fastpath firewall-allow-check
add rule ip fastpath firewall-allow-check ip daddr . meta l4proto . th dport . ip saddr @firewall-allow return
add rule ip fastpath firewall-allow-check drop
add rule ip fastpath firewall-check ip daddr . meta l4proto . th dport @firewall jump firewall-allow-check

# svc1
add chain ip fastpath service-ULMVA6XW-ns1/svc1/tcp/p80
add rule ip fastpath service-ULMVA6XW-ns1/svc1/tcp/p80 ip daddr 198.19.0.41 tcp dport 80 ip saddr != 198.18.0.0/16 jump mark-for-masquerade
add rule ip fastpath service-ULMVA6XW-ns1/svc1/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-5OJB2KTY-ns1/svc1/tcp/p80__198.18.180.1/80 }

add chain ip fastpath endpoint-5OJB2KTY-ns1/svc1/tcp/p80__198.18.180.1/80
add rule ip fastpath endpoint-5OJB2KTY-ns1/svc1/tcp/p80__198.18.180.1/80 ip saddr 198.18.180.1 jump mark-for-masquerade
add rule ip fastpath endpoint-5OJB2KTY-ns1/svc1/tcp/p80__198.18.180.1/80 meta l4proto tcp dnat to 198.18.180.1:80

add element ip fastpath service-ips { 198.19.0.41 . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }

# svc2
add chain ip fastpath service-42NFTM6N-ns2/svc2/tcp/p80
add rule ip fastpath service-42NFTM6N-ns2/svc2/tcp/p80 ip daddr 198.19.0.42 tcp dport 80 ip saddr != 198.18.0.0/16 jump mark-for-masquerade
add rule ip fastpath service-42NFTM6N-ns2/svc2/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-SGOXE6O3-ns2/svc2/tcp/p80__198.18.180.2/80 }
add chain ip fastpath external-42NFTM6N-ns2/svc2/tcp/p80
add rule ip fastpath external-42NFTM6N-ns2/svc2/tcp/p80 ip saddr 198.18.0.0/16 goto service-42NFTM6N-ns2/svc2/tcp/p80 comment "short-circuit pod traffic"
add rule ip fastpath external-42NFTM6N-ns2/svc2/tcp/p80 fib saddr type local jump mark-for-masquerade comment "masquerade local traffic"
add rule ip fastpath external-42NFTM6N-ns2/svc2/tcp/p80 fib saddr type local goto service-42NFTM6N-ns2/svc2/tcp/p80 comment "short-circuit local traffic"
add chain ip fastpath endpoint-SGOXE6O3-ns2/svc2/tcp/p80__198.18.180.2/80
add rule ip fastpath endpoint-SGOXE6O3-ns2/svc2/tcp/p80__198.18.180.2/80 ip saddr 198.18.180.2 jump mark-for-masquerade
add rule ip fastpath endpoint-SGOXE6O3-ns2/svc2/tcp/p80__198.18.180.2/80 meta l4proto tcp dnat to 198.18.180.2:80

add element ip fastpath service-ips { 198.19.0.42 . tcp . 80 : goto service-42NFTM6N-ns2/svc2/tcp/p80 }
add element ip fastpath service-ips { 198.19.227.22 . tcp . 80 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }
add element ip fastpath service-ips { 198.19.250.4 . tcp . 80 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }
add element ip fastpath service-nodeports { tcp . 3001 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }

add element ip fastpath no-endpoint-nodeports { tcp . 3001 comment "ns2/svc2:p80" : drop }
add element ip fastpath no-endpoint-services { 198.19.250.4 . tcp . 80 comment "ns2/svc2:p80" : drop }
add element ip fastpath no-endpoint-services { 198.19.227.22 . tcp . 80 comment "ns2/svc2:p80" : drop }
"#;

const TEST_EXPECTED: &str = r#"
add table ip fastpath { comment "rules for kube-proxy" ; }
add chain ip fastpath endpoint-5OJB2KTY-ns1/svc1/tcp/p80__198.18.180.1/80
add chain ip fastpath endpoint-SGOXE6O3-ns2/svc2/tcp/p80__198.18.180.2/80
add chain ip fastpath external-42NFTM6N-ns2/svc2/tcp/p80
add chain ip fastpath firewall-allow-check
add chain ip fastpath firewall-check
add chain ip fastpath mark-for-masquerade
add chain ip fastpath masquerading
add chain ip fastpath service-42NFTM6N-ns2/svc2/tcp/p80
add chain ip fastpath service-ULMVA6XW-ns1/svc1/tcp/p80
add rule ip fastpath endpoint-5OJB2KTY-ns1/svc1/tcp/p80__198.18.180.1/80 ip saddr 198.18.180.1 jump mark-for-masquerade
add rule ip fastpath endpoint-5OJB2KTY-ns1/svc1/tcp/p80__198.18.180.1/80 meta l4proto tcp dnat to 198.18.180.1:80
add rule ip fastpath endpoint-SGOXE6O3-ns2/svc2/tcp/p80__198.18.180.2/80 ip saddr 198.18.180.2 jump mark-for-masquerade
add rule ip fastpath endpoint-SGOXE6O3-ns2/svc2/tcp/p80__198.18.180.2/80 meta l4proto tcp dnat to 198.18.180.2:80
add rule ip fastpath external-42NFTM6N-ns2/svc2/tcp/p80 ip saddr 198.18.0.0/16 goto service-42NFTM6N-ns2/svc2/tcp/p80 comment "short-circuit pod traffic"
add rule ip fastpath external-42NFTM6N-ns2/svc2/tcp/p80 fib saddr type local jump mark-for-masquerade comment "masquerade local traffic"
add rule ip fastpath external-42NFTM6N-ns2/svc2/tcp/p80 fib saddr type local goto service-42NFTM6N-ns2/svc2/tcp/p80 comment "short-circuit local traffic"
add rule ip fastpath firewall-allow-check ip daddr . meta l4proto . th dport . ip saddr @firewall-allow return
add rule ip fastpath firewall-allow-check drop
add rule ip fastpath firewall-check ip daddr . meta l4proto . th dport @firewall jump firewall-allow-check
add rule ip fastpath mark-for-masquerade mark set mark or 0x4000
add rule ip fastpath masquerading mark and 0x4000 == 0 return
add rule ip fastpath masquerading mark set mark xor 0x4000
add rule ip fastpath masquerading masquerade fully-random
add rule ip fastpath service-42NFTM6N-ns2/svc2/tcp/p80 ip daddr 198.19.0.42 tcp dport 80 ip saddr != 198.18.0.0/16 jump mark-for-masquerade
add rule ip fastpath service-42NFTM6N-ns2/svc2/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-SGOXE6O3-ns2/svc2/tcp/p80__198.18.180.2/80 }
add rule ip fastpath service-ULMVA6XW-ns1/svc1/tcp/p80 ip daddr 198.19.0.41 tcp dport 80 ip saddr != 198.18.0.0/16 jump mark-for-masquerade
add rule ip fastpath service-ULMVA6XW-ns1/svc1/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-5OJB2KTY-ns1/svc1/tcp/p80__198.18.180.1/80 }
add set ip fastpath firewall { type ipv4_addr . inet_proto . inet_service ; comment "destinations that are subject to LoadBalancerSourceRanges" ; }
add set ip fastpath firewall-allow { type ipv4_addr . inet_proto . inet_service . ipv4_addr ; flags interval ; comment "destinations+sources that are allowed by LoadBalancerSourceRanges" ; }
add element ip fastpath no-endpoint-nodeports { tcp . 3001 comment "ns2/svc2:p80" : drop }
add element ip fastpath no-endpoint-services { 198.19.227.22 . tcp . 80 comment "ns2/svc2:p80" : drop }
add element ip fastpath no-endpoint-services { 198.19.250.4 . tcp . 80 comment "ns2/svc2:p80" : drop }
add element ip fastpath service-ips { 198.19.0.41 . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }
add element ip fastpath service-ips { 198.19.0.42 . tcp . 80 : goto service-42NFTM6N-ns2/svc2/tcp/p80 }
add element ip fastpath service-ips { 198.19.227.22 . tcp . 80 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }
add element ip fastpath service-ips { 198.19.250.4 . tcp . 80 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }
add element ip fastpath service-nodeports { tcp . 3001 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }
"#;

#[test]
fn test_sort_nftables_transaction() {
    let want: Vec<String> = TEST_EXPECTED.trim().lines().map(String::from).collect();
    assert_eq!(sort_transaction(TEST_INPUT), want);
}

#[test]
fn test_diff_nftables_transaction() {
    assert_eq!(diff_transaction(TEST_INPUT, TEST_EXPECTED), None);
    assert_transaction_equal(TEST_INPUT, TEST_EXPECTED);
    let not_expected: String = TEST_EXPECTED.lines().skip(2).collect::<Vec<_>>().join("\n");
    let diff = diff_transaction(TEST_INPUT, &not_expected).expect("a diff");
    assert!(diff.contains("- add table ip fastpath"), "{diff}");
}

#[test]
fn test_diff_nftables_chain() {
    let dump = Dump::parse(
        "add table ip fastpath
add chain ip fastpath mark-masq-chain
add chain ip fastpath masquerade-chain
add chain ip fastpath empty-chain
add rule ip fastpath mark-masq-chain mark set mark or 0x4000
add rule ip fastpath masquerade-chain mark and 0x4000 == 0 return
add rule ip fastpath masquerade-chain mark set mark xor 0x4000
add rule ip fastpath masquerade-chain masquerade fully-random",
    )
    .unwrap();
    assert_eq!(
        diff_chain(&dump, "mark-masq-chain", "mark set mark or 0x4000"),
        None
    );
    assert_eq!(
        diff_chain(&dump, "mark-masq-chain", "mark set mark or 0x4000\n"),
        None
    );
    let masq = "mark and 0x4000 == 0 return\nmark set mark xor 0x4000\nmasquerade fully-random";
    assert_eq!(diff_chain(&dump, "masquerade-chain", masq), None);
    assert!(
        diff_chain(
            &dump,
            "masquerade-chain",
            "mark set mark xor 0x4000\nmasquerade fully-random"
        )
        .is_some()
    );
    assert_eq!(diff_chain(&dump, "empty-chain", ""), None);
    assert_eq!(diff_chain(&dump, "empty-chain", "\n"), None);
}

/// What `nft list table ip fastpath` (nft 1.0.6) printed after `nft -f` of upstream's
/// TestOverallNFTablesRules dump: the same packets meet the same fate when the tables are
/// read back in nft's own form (named priorities, merged elements, simplified sets).
#[test]
fn test_overall_nftables_rules_listing_traces() {
    let listing = include_str!("fixtures/overall_listing_nft_1.0.6.txt");
    let dump = Dump::from_listing(listing).expect("nft's listing parses");
    assert_eq!(dump.hooked("prerouting")[0].1.priority, -110);
    assert_eq!(
        dump.sets["service-ips"].elements.len(),
        overall().sets["service-ips"].elements.len()
    );
    run_packet_flow_tests(
        "TestOverallNFTablesRules (nft listing)",
        &dump,
        TEST_NODE_IPS,
        &overall_flows(),
    );
}

#[test]
fn test_listing_parse_errors() {
    for (text, want) in [
        ("chain x {\n}", "expected `table FAMILY NAME {`"),
        (
            "table ip fastpath {\n\tchain c {\n\t\tjump d\n",
            "chain c is not closed",
        ),
        (
            "table ip fastpath {\n\tflowtable f {\n\t}\n}",
            "unknown block flowtable",
        ),
        (
            "table ip fastpath {\n\tchain c {\n\t\tjump d\n\t}\n}\ntable ip other {",
            "text after the table",
        ),
    ] {
        let e = Dump::from_listing(text).expect_err(text);
        assert!(e.to_string().contains(want), "{text:?}: {e}");
    }
}

/// Bad input gets an error or a trace with errors, never a panic: every prefix of the
/// fixtures (cut anywhere, also inside a multi-byte character's neighbourhood), and the
/// fixtures with odd characters put in, parsed and traced.
#[test]
fn test_dump_and_listing_never_panic() {
    let listing = include_str!("fixtures/overall_listing_nft_1.0.6.txt");
    let dump_text = format!("{BASE_RULES}\n{OVERALL}");
    let local = [ip(TEST_NODE_IP)];
    let mut inputs: Vec<String> = Vec::new();
    for text in [listing, dump_text.as_str()] {
        let cuts: Vec<usize> = text.char_indices().map(|(i, _)| i).step_by(7).collect();
        inputs.extend(cuts.iter().map(|&i| text[..i].to_string()));
        for odd in ["é", "{", "}", "\"", " : ", " . ", "-", "priority é-1", "@"] {
            inputs.push(text.replacen(' ', odd, 40));
            inputs.push(text.replace("tcp", odd));
        }
    }
    for input in &inputs {
        for dump in [Dump::parse(input), Dump::from_listing(input)]
            .into_iter()
            .flatten()
        {
            for (dst, port) in [
                ("198.19.0.41", 80),
                (TEST_NODE_IP, 3001),
                ("198.19.250.8", 80),
            ] {
                let _ = trace_packet(&dump, ip("198.19.240.2"), "tcp", ip(dst), port, &local);
            }
        }
    }
}
