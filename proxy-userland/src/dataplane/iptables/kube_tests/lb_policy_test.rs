//! More of kube-proxy's packet-flow tables, run over our rules: the Cluster half of the
//! terminating-endpoint tests (pkg/proxy/iptables/proxier_test.go; the Local half is in
//! proxier_test.rs), and the ipvs proxier's TestLoadBalancerSourceRanges
//! (pkg/proxy/ipvs/proxier_test.go), whose ipset checks become packet flows here. Addresses
//! as in the table of mod.rs.

use super::{
    proxier_test::{P80, UNNAMED_80, v4},
    tracer::{Flow, run_packet_flow_tests},
    *,
};
use crate::model::Protocol::Tcp;

/// Every flow here goes to port 80.
fn flow<'a>(
    name: &'a str,
    source: &'a str,
    dest: &'a str,
    output: &'a str,
    masq: bool,
) -> Flow<'a> {
    super::proxier_test::flow(name, source, dest, 80, output, masq)
}

/// With Cluster traffic policies, ready endpoints anywhere are used; only when none is
/// ready anywhere do the serving-terminating ones (on any node) take over.
#[test]
fn test_terminating_endpoints_traffic_policy_cluster() {
    // Upstream also sets healthCheckNodePort 30000, which the API server clears for an
    // externalTrafficPolicy: Cluster service and our conversion ignores: left out.
    let svc = make_test_service("ns1", "svc1", "198.19.1.1", |s| {
        s.ports = vec![port("", 80, Tcp, None)];
        s.load_balancer_ips = vec![ip("198.19.250.4")];
    });
    let here = Some(TEST_NODE_NAME);
    let there = Some("another-node");
    let cases = [
        (
            "ready endpoints exist",
            vec![
                ep_cond("198.18.1.1", here, true, true, false),
                ep_cond("198.18.1.2", here, true, true, false),
                // Ignored: there are ready endpoints.
                ep_cond("198.18.1.3", there, false, true, true),
                // Ignored: not serving.
                ep_cond("198.18.1.4", there, false, false, true),
                ep_cond("198.18.1.5", there, true, true, false),
            ],
            "198.18.1.1:80, 198.18.1.2:80, 198.18.1.5:80",
        ),
        (
            "only terminating endpoints exist",
            vec![
                ep_cond("198.18.1.2", here, false, true, true),
                ep_cond("198.18.1.3", here, false, true, true),
                ep_cond("198.18.1.4", there, false, false, true),
                ep_cond("198.18.1.5", there, false, true, true),
            ],
            "198.18.1.2:80, 198.18.1.3:80, 198.18.1.5:80",
        ),
        (
            "terminating endpoints on remote node",
            vec![ep_cond("198.18.1.5", Some("node-1"), false, true, true)],
            "198.18.1.5:80",
        ),
        (
            "no usable endpoints on any node",
            vec![
                ep_cond("198.18.1.5", here, false, false, true),
                ep_cond("198.18.1.5", Some("node-1"), false, false, true),
            ],
            "REJECT",
        ),
    ];
    for (name, eps, want) in cases {
        let test = format!("TestTerminatingEndpointsTrafficPolicyCluster/{name}");
        let dump = v4(&state(vec![(svc.clone(), Some(slice(eps, UNNAMED_80)))]));
        let masq = want != "REJECT";
        run_packet_flow_tests(
            &test,
            &dump,
            TEST_NODE_IPS,
            &[
                flow("pod to clusterIP", "198.18.0.2", "198.19.1.1", want, false),
                flow(
                    "external to LB",
                    TEST_EXTERNAL_CLIENT,
                    "198.19.250.4",
                    want,
                    masq,
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
                    "REJECT",
                    false,
                ),
                flow(
                    "external to LB after endpoints deleted",
                    TEST_EXTERNAL_CLIENT,
                    "198.19.250.4",
                    "REJECT",
                    false,
                ),
            ],
        );
    }
}

/// A load balancer without node ports whose source range is the pods' network
/// (upstream's 10.0.0.0/8): traffic to the LB IP from inside the range reaches the
/// endpoint, from outside it is dropped; the cluster IP is not subject to the ranges.
#[test]
fn test_load_balancer_source_ranges() {
    let svc = make_test_service("ns1", "svc1", "198.19.0.41", |s| {
        s.ports = vec![port("p80", 80, Tcp, None)];
        s.load_balancer_ips = vec![ip("198.19.250.4")];
        s.load_balancer_source_ranges = vec![(ip(POD_CIDR.0), POD_CIDR.1)];
    });
    let dump = v4(&state(vec![(
        svc,
        Some(slice(vec![ep("198.18.180.1", None)], P80)),
    )]));
    let e = "198.18.180.1:80";
    run_packet_flow_tests(
        "TestLoadBalancerSourceRanges",
        &dump,
        TEST_NODE_IPS,
        &[
            flow(
                "pod in the source range to LB",
                "198.18.0.2",
                "198.19.250.4",
                e,
                true,
            ),
            flow(
                "external outside the source range to LB",
                TEST_EXTERNAL_CLIENT,
                "198.19.250.4",
                "DROP",
                false,
            ),
            flow("pod to cluster IP", "198.18.0.2", "198.19.0.41", e, false),
            flow(
                "external to cluster IP",
                TEST_EXTERNAL_CLIENT,
                "198.19.0.41",
                e,
                true,
            ),
        ],
    );
}
