//! kube-proxy's nftables TestNoEndpointsMetric: the no-local-endpoints gauge the sync
//! publishes (`kubeproxy_sync_proxy_rules_no_local_endpoints_total`), counted from the
//! model as every mode of ours does.

use super::*;
use crate::{
    admin::healthcheck::no_local_endpoints,
    dataplane::iptables::kube_tests::{ep, make_test_service, node, port, slice, state},
    model::Protocol::Tcp,
};

#[test]
fn test_no_endpoints_metric() {
    let local3 = [
        ("198.18.1.1", TEST_NODE_NAME),
        ("198.18.1.2", "node1"),
        ("198.18.1.3", "node2"),
    ];
    let remote3 = [
        ("198.18.1.1", "node0"),
        ("198.18.1.2", "node1"),
        ("198.18.1.3", "node2"),
    ];
    // (name, internal Local, external Local, endpoints, want internal, want external)
    type Case<'a> = (&'a str, bool, bool, &'a [(&'a str, &'a str)], usize, usize);
    let cases: [Case<'_>; 7] = [
        (
            "internalTrafficPolicy is set and there are local endpoints",
            true,
            false,
            &local3,
            0,
            0,
        ),
        (
            "externalTrafficPolicy is set and there are local endpoints",
            false,
            true,
            &local3,
            0,
            0,
        ),
        (
            "both policies are set and there are local endpoints",
            true,
            true,
            &local3,
            0,
            0,
        ),
        (
            "internalTrafficPolicy is set and there are no local endpoints",
            true,
            false,
            &remote3,
            1,
            0,
        ),
        (
            "externalTrafficPolicy is set and there are no local endpoints",
            false,
            true,
            &remote3,
            0,
            1,
        ),
        (
            "both policies are set and there are no local endpoints",
            true,
            true,
            &remote3,
            1,
            1,
        ),
        (
            "both policies are set and there are no endpoints at all",
            true,
            true,
            &[],
            0,
            0,
        ),
    ];
    for (name, internal, external, endpoints, want_internal, want_external) in cases {
        let svc = make_test_service("ns1", "svc1", "198.19.1.1", |s| {
            s.internal_policy_local = internal;
            // Upstream makes the service a NodePort one when it sets the external policy.
            s.external_policy_local = external;
            s.ports = vec![port("", 80, Tcp, external.then_some(123))];
        });
        let eps = slice(
            endpoints.iter().map(|(a, n)| ep(a, Some(n))).collect(),
            &[("", 80, Tcp)],
        );
        let got = no_local_endpoints(&state(vec![(svc, Some(eps))]), &node());
        assert_eq!(
            (got.internal, got.external),
            (want_internal, want_external),
            "{name}"
        );
    }
}
