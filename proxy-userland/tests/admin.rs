//! The admin side end to end: the real `fastpath` daemon on manifests, with its health,
//! metrics and health check node port servers on loopback ports, asked over real HTTP.
//! Every request goes to 127.0.0.1; the daemon's programs stay in the test bed's cgroup.

mod common;

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    time::Duration,
};

use common::*;

const WEB: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  clusterIP: 198.19.0.10
  clusterIPs: [198.19.0.10]
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP}
  - {name: dns, port: 53, targetPort: 5353, protocol: UDP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
- {name: dns, port: 5353, protocol: UDP}
endpoints:
- {addresses: [198.18.1.11], conditions: {ready: true}, nodeName: node-a}
- {addresses: [198.18.1.12], conditions: {ready: true}, nodeName: node-b}
"#;

/// A LoadBalancer with externalTrafficPolicy Local; HCPORT and NODE2 are filled in.
const LB: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: lb, namespace: demo}
spec:
  type: LoadBalancer
  clusterIP: 198.19.0.40
  clusterIPs: [198.19.0.40]
  externalTrafficPolicy: Local
  healthCheckNodePort: HCPORT
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30080}
status:
  loadBalancer:
    ingress: [{ip: 198.19.100.1}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-1, namespace: demo, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
endpoints:
- {addresses: [198.18.1.11], conditions: {ready: true}, nodeName: NODE1}
- {addresses: [198.18.1.12], conditions: {ready: true}, nodeName: node-b}
"#;

/// A port nobody listens on right now, on loopback.
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET http://127.0.0.1:port/path: (status, body), or None if nobody answers.
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}

/// The value of the sample line `name` (e.g. `x_count` or `x{map="services"}`).
fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

struct RmDir(PathBuf);
impl Drop for RmDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn health_metrics_and_health_check_node_ports_over_http() {
    let (bed, _pods) = bed_with_pods("admin", 2);
    let dir = std::env::temp_dir().join(format!("fastpath-admin-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let _rm = RmDir(dir.clone());
    let (health, metrics, hc) = (free_port(), free_port(), free_port());
    let lb = |node1: &str| {
        LB.replace("HCPORT", &hc.to_string())
            .replace("NODE1", node1)
    };
    std::fs::write(dir.join("web.yaml"), WEB).unwrap();
    std::fs::write(dir.join("lb.yaml"), lb("node-a")).unwrap();

    let health_addr = format!("127.0.0.1:{health}");
    let metrics_addr = format!("127.0.0.1:{metrics}");
    let mut daemon = Daemon::start(
        bed.cgroup_path(),
        &[
            "--manifests",
            dir.to_str().unwrap(),
            "--manifest-poll-period",
            "100ms",
            "--healthz-bind-address",
            &health_addr,
            "--metrics-bind-address",
            &metrics_addr,
            "--healthcheck-bind-address",
            "127.0.0.1",
        ],
    );

    assert!(
        eventually(20, || get(health, "/readyz").is_some_and(|(s, _)| s == 200)),
        "/readyz never answered 200; log:\n{}",
        daemon.log()
    );
    let (status, body) = get(health, "/healthz").unwrap();
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("healthz is JSON");
    assert!(
        v["lastUpdated"].is_string() && v["currentTime"].is_string(),
        "{body}"
    );
    assert_eq!(get(health, "/livez").map(|r| r.0), Some(200));
    assert_eq!(get(health, "/nope").map(|r| r.0), Some(404));

    let (status, text) = get(metrics, "/metrics").unwrap();
    assert_eq!(status, 200);
    let count = sample(&text, "kubeproxy_sync_proxy_rules_duration_seconds_count").unwrap_or(0.0);
    assert!(count >= 1.0, "no sync recorded:\n{text}");
    assert!(
        sample(&text, "kubeproxy_sync_proxy_rules_last_timestamp_seconds").unwrap_or(0.0) > 0.0
    );
    assert!(
        sample(&text, "kubeproxy_sync_proxy_rules_service_changes_total").unwrap_or(0.0) >= 2.0,
        "{text}"
    );
    // Socket frontends, each a master entry plus one slot per backend: web's two ports
    // with two pods each (2 x 3), lb's one port with both pods (internal traffic policy
    // is Cluster), on its ClusterIP, on its load-balancer IP and on its node port, which
    // the node reaches directly: 15. Backends are shared by address: pod-1 and pod-2 on
    // 8080/TCP and 5353/UDP: 4. Nothing connected yet: no reverse-NAT entry.
    assert_eq!(
        sample(&text, "fastpath_bpf_map_entries{map=\"services\"}"),
        Some(15.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "fastpath_bpf_map_entries{map=\"backends\"}"),
        Some(4.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "fastpath_bpf_map_entries{map=\"sock_revnat\"}"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "fastpath_healthcheck_node_port_servers"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        get(metrics, "/proxyMode").map(|r| r.1),
        Some("ebpf".to_string())
    );

    // The health check node port: one local endpoint (pod-1 is on node-a, pod-2 is not).
    let (status, body) = get(hc, "/").expect("health check node port answers");
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"service": {"namespace": "demo", "name": "lb"}, "localEndpoints": 1, "serviceProxyHealthy": true})
    );

    // Its local pod moves away: 503 with none.
    std::fs::write(dir.join("lb.yaml"), lb("node-c")).unwrap();
    assert!(
        eventually(10, || get(hc, "/").is_some_and(
            |(s, b)| s == 503 && b.contains("\"localEndpoints\":0")
        )),
        "the health check did not follow the endpoints; log:\n{}",
        daemon.log()
    );
    // The service goes: so does its server.
    std::fs::remove_file(dir.join("lb.yaml")).unwrap();
    assert!(
        eventually(10, || get(hc, "/").is_none()),
        "the health check node port stayed open; log:\n{}",
        daemon.log()
    );

    let status = daemon.stop();
    assert!(status.success(), "clean exit: {status:?}\n{}", daemon.log());
    assert!(
        get(health, "/healthz").is_none(),
        "health server stops with the daemon"
    );
    assert!(
        get(metrics, "/metrics").is_none(),
        "metrics server stops with the daemon"
    );
}

#[test]
fn a_bad_config_file_stops_the_daemon_with_the_field_named() {
    let dir = std::env::temp_dir().join(format!("fastpath-admin-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let _rm = RmDir(dir.clone());
    let path = dir.join("config.yaml");
    std::fs::write(
        &path,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nconntrack: {maxPerCore: -5}\n",
    )
    .unwrap();
    let out = std::process::Command::new(FASTPATH)
        .args([
            "--config",
            path.to_str().unwrap(),
            "--manifests",
            "/nonexistent",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("conntrack.maxPerCore") && err.contains("negative"),
        "{err}"
    );
}

/// The daemon's flags put its node-port programs on a device of the bed's node namespace;
/// a client on "another host" reaches the NodePort, and /metrics says where packets went.
#[test]
fn the_daemon_serves_node_ports_from_other_hosts_and_counts_their_packets() {
    let (mut bed, _pods) = bed_with_pods("adminnp", 2);
    let ext = bed
        .add_pod("ext", Ipv4Addr::new(198, 18, 2, 1), None)
        .expect("client");
    let dir = bed.dir().join("manifests");
    std::fs::create_dir_all(&dir).unwrap();
    // lb: NodePort 30080, externalTrafficPolicy Local, pod-1 on this node.
    let lb = LB
        .replace("HCPORT", &free_port().to_string())
        .replace("NODE1", "node-a");
    std::fs::write(dir.join("lb.yaml"), lb).unwrap();
    let metrics = free_port();
    let metrics_addr = format!("127.0.0.1:{metrics}");
    let mut daemon = Daemon::start(
        bed.cgroup_path(),
        &[
            "--manifests",
            dir.to_str().unwrap(),
            "--netns",
            bed.node_netns(),
            "--nodeport-devices",
            &ext.node_veth,
            "--sync-period",
            "1s",
            "--metrics-bind-address",
            &metrics_addr,
            "--healthcheck-bind-address",
            "127.0.0.1",
        ],
    );
    let target = format!("{}:30080", bed.node_ipv4());
    let client = |count: &str| {
        let mut cmd = std::process::Command::new(PROBE);
        cmd.args([
            "--netns",
            &ext.netns,
            "tcp",
            &target,
            "--count",
            count,
            "--timeout-ms",
            "1000",
        ]);
        xtask::probe::parse(&xtask::cmd::output(&mut cmd).expect("probe runs"))
    };
    assert!(
        eventually(20, || client("1")[0].is_ok()),
        "the NodePort never answered; log:\n{}",
        daemon.log()
    );
    let attempts = client("20");
    assert!(
        attempts.iter().all(|a| a.reply() == Some("pod-1")),
        "the Local policy's pod: {attempts:?}"
    );
    assert!(
        eventually(10, || {
            let text = get(metrics, "/metrics").map(|r| r.1).unwrap_or_default();
            sample(&text, "fastpath_packets_total{result=\"new_flow\"}").is_some_and(|n| n >= 21.0)
                && sample(&text, "fastpath_bpf_map_entries{map=\"conntrack\"}")
                    .is_some_and(|n| n >= 42.0)
        }),
        "the packet counters reach /metrics; log:\n{}",
        daemon.log()
    );
    assert!(daemon.stop().success(), "{}", daemon.log());
}
