//! The upstream cases that start from API objects rather than the model: TestBadIPs and
//! TestLoadBalancerIngressRouteTypeProxy, read by our conversion and rendered by ours.

use super::{fake::FakeProxier, proxier_test::mask_hashes, upstream_test::BASE_RULES, *};
use crate::{
    dataplane::iptables::kube_tests::state,
    model::{EndpointSet, ProxyState, convert},
};

/// A Service and its one EndpointSlice, from YAML, through our conversion.
fn from_yaml(svc: &str, slice: &str) -> ProxyState {
    let svc: k8s_openapi::api::core::v1::Service = serde_saphyr::from_str(svc).unwrap();
    let slice: k8s_openapi::api::discovery::v1::EndpointSlice =
        serde_saphyr::from_str(slice).unwrap();
    let svc = convert::service(&svc, None)
        .expect("converted, not refused")
        .expect("proxied");
    let (_, name, info) = convert::endpoint_slice(&slice)
        .expect("converted, not refused")
        .expect("kept");
    let eps = EndpointSet {
        slices: crate::model::Slices::from([(name, info)]),
    };
    state(vec![(svc, Some(eps))])
}

const SLICE: &str = r#"
metadata:
  name: svc1-1
  namespace: ns1
  labels: {kubernetes.io/service-name: svc1}
addressType: IPv4
ports: [{name: p80, port: 80, protocol: TCP}]
endpoints: [{addresses: [198.18.180.001]}]
"#;

/// Addresses with leading zeros in the Service and its endpoints come out as nft reads
/// them, as upstream's expected dump has them.
#[test]
fn test_bad_ips() {
    let st = from_yaml(
        r#"
metadata: {name: svc1, namespace: ns1}
spec:
  type: LoadBalancer
  clusterIP: 198.19.0.041
  ports: [{name: p80, port: 80, protocol: TCP, nodePort: 3001}]
  externalIPs: [198.19.227.022]
  loadBalancerSourceRanges: [198.19.240.000/025]
status: {loadBalancer: {ingress: [{ip: 198.19.250.004}]}}
"#,
        SLICE,
    );
    let want = format!(
        "{BASE_RULES}
add chain ip fastpath service-ULMVA6XW-ns1/svc1/tcp/p80
add rule ip fastpath service-ULMVA6XW-ns1/svc1/tcp/p80 ip daddr 198.19.0.41 ip saddr != 198.18.0.0/16 jump mark-for-masquerade
add rule ip fastpath service-ULMVA6XW-ns1/svc1/tcp/p80 numgen random mod 1 vmap {{ 0 : goto endpoint-5OJB2KTY-ns1/svc1/tcp/p80__198.18.180.1/80 }}
add chain ip fastpath external-ULMVA6XW-ns1/svc1/tcp/p80
add rule ip fastpath external-ULMVA6XW-ns1/svc1/tcp/p80 jump mark-for-masquerade
add rule ip fastpath external-ULMVA6XW-ns1/svc1/tcp/p80 goto service-ULMVA6XW-ns1/svc1/tcp/p80
add chain ip fastpath endpoint-5OJB2KTY-ns1/svc1/tcp/p80__198.18.180.1/80
add rule ip fastpath endpoint-5OJB2KTY-ns1/svc1/tcp/p80__198.18.180.1/80 ip saddr 198.18.180.1 jump mark-for-masquerade
add rule ip fastpath endpoint-5OJB2KTY-ns1/svc1/tcp/p80__198.18.180.1/80 meta l4proto tcp dnat to 198.18.180.1:80
add chain ip fastpath firewall-ULMVA6XW-ns1/svc1/tcp/p80
add rule ip fastpath firewall-ULMVA6XW-ns1/svc1/tcp/p80 ip saddr != {{ 198.19.240.0/25 }} drop
add element ip fastpath cluster-ips {{ 198.19.0.41 }}
add element ip fastpath service-ips {{ 198.19.0.41 . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }}
add element ip fastpath service-ips {{ 198.19.227.22 . tcp . 80 : goto external-ULMVA6XW-ns1/svc1/tcp/p80 }}
add element ip fastpath service-ips {{ 198.19.250.4 . tcp . 80 : goto external-ULMVA6XW-ns1/svc1/tcp/p80 }}
add element ip fastpath service-nodeports {{ tcp . 3001 : goto external-ULMVA6XW-ns1/svc1/tcp/p80 }}
add element ip fastpath firewall-ips {{ 198.19.250.4 . tcp . 80 : goto firewall-ULMVA6XW-ns1/svc1/tcp/p80 }}
"
    )
    // Our one deliberate difference from upstream's dump (docs/modes.md).
    .replace(
        "ip daddr { 198.19.0.0/17 } drop comment \"Drop traffic to unallocated ClusterIPs\"",
        "ip daddr { 198.19.0.0/17 } reject comment \"Reject traffic to unallocated ClusterIPs\"",
    );
    let fp = FakeProxier::v4();
    assert_transaction_equal(&mask_hashes(&want), &mask_hashes(&fp.text(&st)));
    let e = "198.18.180.1:80";
    run_packet_flow_tests(
        "TestBadIPs",
        &fp.sync(&st),
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
                "external to external IP",
                TEST_EXTERNAL_CLIENT,
                "198.19.227.22",
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

/// An ingress IP with `ipMode: Proxy` is the load balancer's own address, not one for the
/// node to capture: no service-ips element. `VIP` or no mode: captured. (Upstream's cases
/// with the LoadBalancerIPMode gate off do not apply: the field is GA and always read.)
#[test]
fn test_load_balancer_ingress_route_type_proxy() {
    for (name, mode, want) in [
        ("ipMode Proxy", Some("Proxy"), false),
        ("ipMode VIP", Some("VIP"), true),
        ("ipMode nil", None, true),
    ] {
        let ingress = match mode {
            Some(m) => format!("{{ip: 198.19.250.4, ipMode: {m}}}"),
            None => "{ip: 198.19.250.4}".to_string(),
        };
        let st = from_yaml(
            &format!(
                r#"
metadata: {{name: svc1, namespace: ns1}}
spec:
  type: LoadBalancer
  clusterIP: 198.19.0.41
  ports: [{{name: p80, port: 80, protocol: TCP, nodePort: 3001}}]
status: {{loadBalancer: {{ingress: [{ingress}]}}}}
"#
            ),
            SLICE,
        );
        let dump = FakeProxier::v4().sync(&st);
        let found = dump.sets["service-ips"]
            .elements
            .iter()
            .any(|e| e.key == ["198.19.250.4", "tcp", "80"]);
        assert_eq!(found, want, "{name}");
    }
}
