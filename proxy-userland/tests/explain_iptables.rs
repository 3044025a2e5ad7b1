//! `fastpath explain` in iptables mode against real clients: the verdict it gives a client
//! inside and outside loadBalancerSourceRanges, and the backends topology hints leave, are
//! what real connections get; `inspect services` shows the rules behind it.

mod common;
mod inspect_common;
mod nat_common;

use common::*;
use inspect_common::*;

/// A load balancer IP with loadBalancerSourceRanges: explain says an allowed client is
/// translated and another is dropped, inspect shows the KUBE-FW chain's ranges, and real
/// connections from the two clients do just that. A service with topology hints on a node
/// in zone-a: explain leaves the zone-b pod out, saying why, and real connections keep to
/// zone-a.
#[test]
fn explain_in_iptables_mode_matches_source_ranges_and_topology_for_real_clients() {
    let (mut bed, _pods) = bed_with_pods("inspiptlb", 2);
    nat_common::route_services(&bed);
    let ext = nat_common::external_client(&mut bed);
    let stranger = bed
        .add_pod("stranger", std::net::Ipv4Addr::new(198, 18, 4, 1), None)
        .expect("client outside the ranges");
    std::fs::write(
        bed.dir().join("svc.yaml"),
        r#"
apiVersion: v1
kind: Service
metadata: {name: lb, namespace: demo}
spec:
  type: LoadBalancer
  clusterIP: 198.19.0.40
  clusterIPs: [198.19.0.40]
  loadBalancerSourceRanges: [198.18.2.0/24]
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30090}
status:
  loadBalancer:
    ingress: [{ip: 198.19.1.2}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-1, namespace: demo, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
endpoints:
- {addresses: [198.18.1.11], conditions: {ready: true}, nodeName: node-a}
- {addresses: [198.18.1.12], conditions: {ready: true}, nodeName: node-b}
---
apiVersion: v1
kind: Service
metadata: {name: zoned, namespace: demo}
spec:
  clusterIP: 198.19.0.41
  clusterIPs: [198.19.0.41]
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: zoned-1, namespace: demo, labels: {kubernetes.io/service-name: zoned}}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
endpoints:
- {addresses: [198.18.1.11], conditions: {ready: true}, nodeName: node-b, zone: zone-a, hints: {forZones: [{name: zone-a}]}}
- {addresses: [198.18.1.12], conditions: {ready: true}, nodeName: node-c, zone: zone-b, hints: {forZones: [{name: zone-b}]}}
"#,
    )
    .unwrap();
    let admin = format!("127.0.0.1:{}", free_port());
    let ns = bed.node_netns().to_string();
    let mut daemon = Daemon::start(
        bed.cgroup_path(),
        &[
            "--manifests",
            bed.dir().join("svc.yaml").to_str().unwrap(),
            "--metrics-bind-address",
            &admin,
            "--proxy-mode",
            "iptables",
            "--netns",
            &ns,
            "--zone",
            "zone-a",
        ],
    );
    const LB: &str = "198.19.1.2:80";
    let from = |client: &xtask::testbed::Pod, count: usize| {
        nat_common::probe_from(
            &client.netns,
            &[
                "tcp",
                LB,
                "--count",
                &count.to_string(),
                "--timeout-ms",
                "1000",
            ],
        )
    };
    assert!(
        eventually(30, || from(&ext, 1)[0].is_ok()),
        "the load balancer IP never answered; log:\n{}",
        daemon.log()
    );

    // Every frontend's rules agree with the model.
    let rows = services_in_sync(&admin, 10);
    let lb = row(&rows, "198.19.1.2:80/TCP (external)");
    assert_eq!(
        lb["source_ranges"],
        serde_json::json!(["198.18.2.0/24"]),
        "{lb:#}"
    );
    let chain = lb["chain"].as_str().unwrap();
    assert!(
        chain.starts_with("KUBE-FW-") && chain.contains(" -> KUBE-EXT-"),
        "{chain}"
    );
    assert_eq!(addresses(lb).len(), 2, "{lb:#}");

    let explain = |from: &str| json(&["explain", "tcp", LB, "--from", from, "--admin", &admin]);
    let allowed = explain("198.18.2.1");
    assert_eq!(allowed["verdict"], "translated", "{allowed:#}");
    assert_eq!(allowed["programmed"], allowed["eligible"], "{allowed:#}");
    let dropped = explain("198.18.4.1");
    assert_eq!(dropped["verdict"], "dropped", "{dropped:#}");
    eprintln!(
        "$ fastpath explain tcp {LB} --from 198.18.4.1\n{}",
        tool(&[
            "explain",
            "tcp",
            LB,
            "--from",
            "198.18.4.1",
            "--admin",
            &admin
        ])
    );

    // Real packets agree: the allowed client reaches both pods, the other nothing.
    let attempts = from(&ext, 20);
    assert!(attempts.iter().all(|a| a.is_ok()), "{attempts:?}");
    assert_eq!(reached(&attempts).len(), 2, "{attempts:?}");
    let attempts = from(&stranger, 2);
    assert!(
        attempts.iter().all(|a| !a.is_ok()),
        "outside loadBalancerSourceRanges: {attempts:?}"
    );

    // Topology: zone-a's pod only, and the other one says why.
    const ZONED: &str = "198.19.0.41:80";
    let ex = json(&["explain", "tcp", ZONED, "--admin", &admin]);
    assert_eq!(
        ex["eligible"],
        serde_json::json!(["198.18.1.11:8080"]),
        "{ex:#}"
    );
    assert_eq!(ex["programmed"], ex["eligible"], "{ex:#}");
    let other = ex["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["address"] == "198.18.1.12:8080")
        .unwrap();
    assert!(
        other["reason"].as_str().unwrap().contains("zone"),
        "{other}"
    );
    eprintln!(
        "$ fastpath explain tcp {ZONED}\n{}",
        tool(&["explain", "tcp", ZONED, "--admin", &admin])
    );
    let attempts = tcp(&bed, ZONED, 10);
    assert!(
        attempts.iter().all(|a| a.reply() == Some("pod-1")),
        "{attempts:?}"
    );
    daemon.stop();
}
