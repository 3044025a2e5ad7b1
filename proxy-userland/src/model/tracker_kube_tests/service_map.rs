//! kube-proxy's service map tests (pkg/proxy/service_test.go): TestServiceToServiceMap,
//! TestServiceMapUpdateHeadless, TestUpdateServiceTypeExternalName,
//! TestBuildServiceMapAddRemove and TestBuildServiceMapServiceUpdate, through
//! [`convert::service`] and [`ChangeTracker`].
//!
//! Upstream's cluster IPs 172.16.55.N are 198.19.55.N here (10.0.0.1: 198.19.0.1), its
//! load-balancer ingress 10.1.2.N is 198.19.2.N, spec.loadBalancerIP 5.6.7.8 is 198.19.6.8,
//! the external IP 8.8.8.8 is 198.19.8.8, the source ranges 0.0.0.0/1 and 10.1.2.0/28 are
//! 198.18.0.0/15 and 198.18.2.0/28; the IPv6 addresses were already in 2001:db8::/32.
//!
//! Where we differ on purpose:
//! - Upstream's tracker serves one IP family and drops (or filters) what is of the other. Our
//!   model is dual-stack: a service keeps every address it has, and each dataplane programs
//!   each family from it (the iptables renderer once per family). The "filtered" cases
//!   therefore expect every address kept, with its family.
//! - `UDPStaleClusterIP` is not the tracker's: UDP conntrack entries are reconciled after each
//!   sync against the current endpoints (dataplane/iptables/conntrack.rs).
//! - Upstream's ServicePortMap has an entry per service port; ours a [`Service`] with its
//!   ports, so "service map length" is counted in ports.

use k8s_openapi::api::core::v1 as core;

use super::*;

fn k8s(ns: &str, name: &str, body: &str) -> core::Service {
    let text = format!("metadata: {{name: {name}, namespace: {ns}}}\n{body}");
    serde_saphyr::from_str(&text).expect("test Service decodes")
}

/// Everything upstream compares, on one line: cluster IPs, ports (with node ports), the
/// health check node port, external IPs, load-balancer IPs and source ranges.
fn summary(svc: &Service) -> String {
    let list = |v: Vec<String>| v.join(",");
    format!(
        "ips={} ports={} hc={} ext={} lb={} ranges={}",
        list(svc.cluster_ips.iter().map(ToString::to_string).collect()),
        list(
            svc.ports
                .iter()
                .map(|p| match p.node_port {
                    Some(np) => format!("{}:{}/{}@{np}", p.name, p.port, p.protocol),
                    None => format!("{}:{}/{}", p.name, p.port, p.protocol),
                })
                .collect()
        ),
        svc.health_check_node_port
            .map_or("-".into(), |p| p.to_string()),
        list(svc.external_ips.iter().map(ToString::to_string).collect()),
        list(
            svc.load_balancer_ips
                .iter()
                .map(ToString::to_string)
                .collect()
        ),
        list(
            svc.load_balancer_source_ranges
                .iter()
                .map(|(a, l)| format!("{a}/{l}"))
                .collect()
        ),
    )
}

fn add(t: &mut ChangeTracker, svc: &core::Service) {
    let key = ServiceKey::new(
        svc.metadata.namespace.clone().unwrap(),
        svc.metadata.name.clone().unwrap(),
    );
    t.apply_service(
        key,
        convert::service(svc, None).expect("test Services are well formed"),
    );
}

fn delete(t: &mut ChangeTracker, svc: &core::Service) {
    let key = ServiceKey::new(
        svc.metadata.namespace.clone().unwrap(),
        svc.metadata.name.clone().unwrap(),
    );
    t.apply_service(key, None);
}

fn port_count(t: &ChangeTracker) -> usize {
    t.state().services.values().map(|s| s.ports.len()).sum()
}

/// HCServiceNodePorts.
fn hc_ports(t: &ChangeTracker) -> BTreeMap<String, u16> {
    t.state()
        .services
        .iter()
        .filter_map(|(k, s)| s.health_check_node_port.map(|p| (k.to_string(), p)))
        .collect()
}

const V6_CLUSTER: &str = "2001:db8:85a3::8a2e:370:7334";
const V6_EXTERNAL: &str = "2001:db8:85a3::8a2e:370:7335";

/// A ClusterIP service `test/<name>` with one TCP port 12345 and both families' ingress.
fn family_case(name: &str, cluster_ip: &str, external: &str, ranges: &str) -> core::Service {
    k8s(
        "test",
        name,
        &format!(
            "spec: {{clusterIP: \"{cluster_ip}\", externalIPs: [{external}], \
             loadBalancerSourceRanges: [{ranges}], ports: [{{name: testPort, port: 12345, protocol: TCP}}]}}\n\
             status: {{loadBalancer: {{ingress: [{{ip: 198.19.8.8}}, {{ip: \"{V6_EXTERNAL}\"}}]}}}}\n"
        ),
    )
}

#[test]
fn test_service_to_service_map() {
    let lb = |name: &str, ingress: &str, extra: &str, ports: &str| {
        k8s(
            "ns1",
            name,
            &format!(
                "spec: {{type: LoadBalancer, clusterIP: {}, loadBalancerIP: 198.19.6.8, ports: [{ports}]{extra}}}\n\
                 status: {{loadBalancer: {{ingress: [{{ip: {ingress}}}]}}}}\n",
                if name == "load-balancer" {
                    "198.19.55.11"
                } else {
                    "198.19.55.12"
                },
            ),
        )
    };
    let both_lb = format!("lb=198.19.8.8,{V6_EXTERNAL}");
    let cases: Vec<(&str, Option<core::Service>, Option<String>)> = vec![
        ("nothing", None, None),
        (
            "headless service",
            Some(k8s("ns2", "headless", "spec: {type: ClusterIP, clusterIP: None, ports: [{name: rpc, protocol: UDP, port: 1234}]}")),
            None,
        ),
        (
            "headless sctp service",
            Some(k8s("ns2", "headless", "spec: {type: ClusterIP, clusterIP: None, ports: [{name: sip, protocol: SCTP, port: 7777}]}")),
            None,
        ),
        (
            "headless service without port",
            Some(k8s("ns2", "headless-without-port", "spec: {type: ClusterIP, clusterIP: None}")),
            None,
        ),
        (
            "cluster ip service",
            Some(k8s(
                "ns2",
                "cluster-ip",
                "spec: {type: ClusterIP, clusterIP: 198.19.55.4, ports: [{name: p1, protocol: UDP, port: 1234, nodePort: 4321}, {name: p2, protocol: UDP, port: 1235, nodePort: 5321}]}",
            )),
            Some("ips=198.19.55.4 ports=p1:1234/UDP@4321,p2:1235/UDP@5321 hc=- ext= lb= ranges=".into()),
        ),
        (
            "nodeport service",
            Some(k8s(
                "ns2",
                "node-port",
                "spec: {type: NodePort, clusterIP: 198.19.55.10, ports: [{name: port1, protocol: UDP, port: 345, nodePort: 678}, {name: port2, protocol: TCP, port: 344, nodePort: 677}]}",
            )),
            Some("ips=198.19.55.10 ports=port1:345/UDP@678,port2:344/TCP@677 hc=- ext= lb= ranges=".into()),
        ),
        // spec.loadBalancerIP is a request to the cloud; only the status counts, upstream
        // and here.
        (
            "load balancer service",
            Some(lb(
                "load-balancer",
                "198.19.2.4",
                "",
                "{name: port3, protocol: UDP, port: 8675, nodePort: 30061}, {name: port4, protocol: UDP, port: 8676, nodePort: 30062}",
            )),
            Some("ips=198.19.55.11 ports=port3:8675/UDP@30061,port4:8676/UDP@30062 hc=- ext= lb=198.19.2.4 ranges=".into()),
        ),
        (
            "load balancer service with only local traffic policy",
            Some(lb(
                "only-local-load-balancer",
                "198.19.2.3",
                ", externalTrafficPolicy: Local, healthCheckNodePort: 345",
                "{name: portx, protocol: UDP, port: 8677, nodePort: 30063}, {name: porty, protocol: UDP, port: 8678, nodePort: 30064}",
            )),
            Some("ips=198.19.55.12 ports=portx:8677/UDP@30063,porty:8678/UDP@30064 hc=345 ext= lb=198.19.2.3 ranges=".into()),
        ),
        (
            "external name service",
            Some(k8s(
                "ns2",
                "external-name",
                "spec: {type: ExternalName, clusterIP: 198.19.55.4, externalName: foo2.bar.com, ports: [{name: portz, protocol: UDP, port: 1235, nodePort: 5321}]}",
            )),
            None,
        ),
        // Kept whole: see the module docs.
        (
            "service with ipv6 clusterIP under ipv4 mode, service should be filtered",
            Some(family_case("invalidIPv6InIPV4Mode", V6_CLUSTER, "", "")),
            Some(format!("ips={V6_CLUSTER} ports=testPort:12345/TCP hc=- ext= {both_lb} ranges=")),
        ),
        (
            "service with ipv4 clusterIP under ipv6 mode, service should be filtered",
            Some(family_case("invalidIPv4InIPV6Mode", "198.19.0.1", "", "")),
            Some(format!("ips=198.19.0.1 ports=testPort:12345/TCP hc=- ext= {both_lb} ranges=")),
        ),
        (
            "service with ipv4 configurations under ipv4 mode",
            Some(family_case("validIPv4", "198.19.0.1", "198.19.8.8", "198.18.0.0/15")),
            Some(format!("ips=198.19.0.1 ports=testPort:12345/TCP hc=- ext=198.19.8.8 {both_lb} ranges=198.18.0.0/15")),
        ),
        (
            "service with ipv6 configurations under ipv6 mode",
            Some(family_case("validIPv6", V6_CLUSTER, &format!("\"{V6_EXTERNAL}\""), "\"2001:db8::/32\"")),
            Some(format!("ips={V6_CLUSTER} ports=testPort:12345/TCP hc=- ext={V6_EXTERNAL} {both_lb} ranges=2001:db8::/32")),
        ),
        (
            "service with both ipv4 and ipv6 configurations under ipv4 mode, ipv6 fields should be filtered",
            Some(family_case(
                "filterIPv6InIPV4Mode",
                "198.19.0.1",
                &format!("198.19.8.8, \"{V6_EXTERNAL}\""),
                "198.18.0.0/15, \"2001:db8::/32\"",
            )),
            Some(format!(
                "ips=198.19.0.1 ports=testPort:12345/TCP hc=- ext=198.19.8.8,{V6_EXTERNAL} {both_lb} ranges=198.18.0.0/15,2001:db8::/32"
            )),
        ),
        (
            "service with both ipv4 and ipv6 configurations under ipv6 mode, ipv4 fields should be filtered",
            Some(family_case(
                "filterIPv4InIPV6Mode",
                V6_CLUSTER,
                &format!("198.19.8.8, \"{V6_EXTERNAL}\""),
                "198.18.0.0/15, \"2001:db8::/32\"",
            )),
            Some(format!(
                "ips={V6_CLUSTER} ports=testPort:12345/TCP hc=- ext=198.19.8.8,{V6_EXTERNAL} {both_lb} ranges=198.18.0.0/15,2001:db8::/32"
            )),
        ),
        (
            "service with extra space in LoadBalancerSourceRanges",
            Some(k8s(
                "test",
                "extra-space",
                "spec: {clusterIP: 198.19.0.1, loadBalancerSourceRanges: [\" 198.18.2.0/28\"], ports: [{name: testPort, port: 12345, protocol: TCP}]}",
            )),
            Some("ips=198.19.0.1 ports=testPort:12345/TCP hc=- ext= lb= ranges=198.18.2.0/28".into()),
        ),
    ];
    for (desc, svc, want) in cases {
        let mut t = ChangeTracker::new();
        if let Some(svc) = &svc {
            add(&mut t, svc);
        }
        let got: Vec<String> = t.state().services.values().map(|s| summary(s)).collect();
        assert_eq!(got, want.into_iter().collect::<Vec<_>>(), "{desc}");
    }
}

fn headless_and_external_name_record_nothing(services: &[core::Service]) {
    let mut t = ChangeTracker::new();
    for svc in services {
        add(&mut t, svc);
    }
    assert_eq!(port_count(&t), 0);
    assert!(hc_ports(&t).is_empty());
    assert!(!t.has_changes(), "services we do not proxy are no change");
}

#[test]
fn test_service_map_update_headless() {
    headless_and_external_name_record_nothing(&[
        k8s(
            "ns2",
            "headless",
            "spec: {type: ClusterIP, clusterIP: None, ports: [{name: rpc, protocol: UDP, port: 1234}]}",
        ),
        k8s(
            "ns2",
            "headless-without-port",
            "spec: {type: ClusterIP, clusterIP: None}",
        ),
    ]);
}

#[test]
fn test_update_service_type_external_name() {
    headless_and_external_name_record_nothing(&[k8s(
        "ns2",
        "external-name",
        "spec: {type: ExternalName, clusterIP: 198.19.55.4, externalName: foo2.bar.com, ports: [{name: blah, protocol: UDP, port: 1235, nodePort: 5321}]}",
    )]);
}

fn changed(t: &mut ChangeTracker) -> Vec<String> {
    t.take_changes()
        .changed
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[test]
fn test_build_service_map_add_remove() {
    let services = [
        k8s(
            "ns2",
            "cluster-ip",
            "spec: {type: ClusterIP, clusterIP: 198.19.55.4, ports: [{name: port1, protocol: UDP, port: 1234, nodePort: 4321}, {name: port2, protocol: UDP, port: 1235, nodePort: 5321}]}",
        ),
        k8s(
            "ns2",
            "node-port",
            "spec: {type: NodePort, clusterIP: 198.19.55.10, ports: [{name: port1, protocol: UDP, port: 345, nodePort: 678}, {name: port2, protocol: TCP, port: 344, nodePort: 677}]}",
        ),
        k8s(
            "ns1",
            "load-balancer",
            "spec: {type: LoadBalancer, clusterIP: 198.19.55.11, loadBalancerIP: 198.19.6.8, ports: [{name: foobar, protocol: UDP, port: 8675, nodePort: 30061}, {name: baz, protocol: UDP, port: 8676, nodePort: 30062}]}\n\
             status: {loadBalancer: {ingress: [{ip: 198.19.2.4}]}}",
        ),
        k8s(
            "ns1",
            "only-local-load-balancer",
            "spec: {type: LoadBalancer, clusterIP: 198.19.55.12, loadBalancerIP: 198.19.6.8, externalTrafficPolicy: Local, healthCheckNodePort: 345, \
             ports: [{name: foobar2, protocol: UDP, port: 8677, nodePort: 30063}, {name: baz, protocol: UDP, port: 8678, nodePort: 30064}]}\n\
             status: {loadBalancer: {ingress: [{ip: 198.19.2.3}]}}",
        ),
    ];
    let mut t = ChangeTracker::new();
    for svc in &services {
        add(&mut t, svc);
    }
    assert_eq!(port_count(&t), 8);
    assert_eq!(
        hc_ports(&t),
        BTreeMap::from([("ns1/only-local-load-balancer".to_string(), 345)])
    );
    assert_eq!(changed(&mut t).len(), 4);

    // services[0] without its first port; the others deleted.
    let one_service = k8s(
        "ns2",
        "cluster-ip",
        "spec: {type: ClusterIP, clusterIP: 198.19.55.4, ports: [{name: p2, protocol: UDP, port: 1235, nodePort: 5321}]}",
    );
    add(&mut t, &one_service);
    for svc in &services[1..] {
        delete(&mut t, svc);
    }
    assert_eq!(port_count(&t), 1);
    assert!(hc_ports(&t).is_empty());
    assert_eq!(
        changed(&mut t),
        [
            "ns1/load-balancer",
            "ns1/only-local-load-balancer",
            "ns2/cluster-ip",
            "ns2/node-port"
        ]
    );
}

#[test]
fn test_build_service_map_service_update() {
    let v1 = k8s(
        "ns1",
        "svc1",
        "spec: {type: ClusterIP, clusterIP: 198.19.55.4, ports: [{name: p1, protocol: UDP, port: 1234, nodePort: 4321}, {name: p2, protocol: TCP, port: 1235, nodePort: 5321}]}",
    );
    let v2 = k8s(
        "ns1",
        "svc1",
        "spec: {type: LoadBalancer, clusterIP: 198.19.55.4, loadBalancerIP: 198.19.6.8, externalTrafficPolicy: Local, healthCheckNodePort: 345, \
         ports: [{name: p1, protocol: UDP, port: 1234, nodePort: 4321, targetPort: 7002}, {name: p2, protocol: TCP, port: 1235, nodePort: 5321, targetPort: 7003}]}\n\
         status: {loadBalancer: {ingress: [{ip: 198.19.2.3}]}}",
    );
    let mut t = ChangeTracker::new();
    add(&mut t, &v1);
    assert_eq!((port_count(&t), hc_ports(&t).len()), (2, 0));
    assert_eq!(changed(&mut t), ["ns1/svc1"]);

    // To a load balancer.
    add(&mut t, &v2);
    assert_eq!((port_count(&t), hc_ports(&t).len()), (2, 1));
    assert_eq!(changed(&mut t), ["ns1/svc1"]);

    // No change: the map and the health check ports stay, and nothing is to be synced.
    add(&mut t, &v2);
    assert_eq!((port_count(&t), hc_ports(&t).len()), (2, 1));
    assert!(changed(&mut t).is_empty());

    // And back to ClusterIP.
    add(&mut t, &v1);
    assert_eq!((port_count(&t), hc_ports(&t).len()), (2, 0));
    assert_eq!(changed(&mut t), ["ns1/svc1"]);
}

/// TestServiceCacheLeaks: a Service added and deleted between two syncs leaves nothing
/// pending (and so does one changed and changed back), instead of asking for a sync of a
/// service that is not there.
#[test]
fn test_service_cache_leaks() {
    let svc = k8s(
        "ns1",
        "svc1",
        "spec: {clusterIP: 198.19.55.4, ports: [{name: p, port: 80}]}",
    );
    let mut t = ChangeTracker::new();
    add(&mut t, &svc);
    assert!(t.has_changes());
    delete(&mut t, &svc);
    assert!(
        !t.has_changes(),
        "added and deleted before a sync: nothing pending"
    );
    assert!(t.take_changes().changed.is_empty());

    add(&mut t, &svc);
    assert_eq!(t.take_changes().changed.len(), 1);
    let moved = k8s(
        "ns1",
        "svc1",
        "spec: {clusterIP: 198.19.55.4, ports: [{name: p, port: 81}]}",
    );
    add(&mut t, &moved);
    assert!(t.has_changes());
    add(&mut t, &svc);
    assert!(
        !t.has_changes(),
        "changed and changed back: nothing pending"
    );

    // Endpoints that come and go between two syncs, likewise.
    let key = ServiceKey::new("ns1", "svc1");
    let slice = crate::model::SliceInfo {
        ports: vec![],
        endpoints: vec![],
    };
    t.apply_slice(key.clone(), "s1".into(), Some(slice));
    assert!(t.has_changes());
    t.apply_slice(key, "s1".into(), None);
    assert!(!t.has_changes());
    assert!(t.state().endpoints.is_empty());
}
