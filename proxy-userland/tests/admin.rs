//! The admin side end to end: the real `fastpath` daemon on manifests, with its health,
//! metrics and health check node port servers on loopback ports, asked over real HTTP.
//! Every request goes to 127.0.0.1; the daemon's programs stay in the test bed's cgroup.

mod common;

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream},
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
        LOCAL_LB
            .replace("HCPORT", &hc.to_string())
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
    let out = xtask::seccomp::command(FASTPATH)
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
    let lb = LOCAL_LB
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
    let metrics_text = || get(metrics, "/metrics").map(|r| r.1).unwrap_or_default();
    assert!(
        eventually(10, || {
            sample(
                &metrics_text(),
                "fastpath_packets_total{result=\"new_flow\"}",
            )
            .is_some_and(|n| n >= 21.0)
        }),
        "the packet counters reach /metrics; log:\n{}",
        daemon.log()
    );
    // The flow table is an LRU the kernel fills: its entries are counted off the sync path,
    // every 30 s (docs/metrics.md, fastpath_bpf_map_entries), so the count may lag that long.
    assert!(
        eventually(45, || {
            sample(
                &metrics_text(),
                "fastpath_bpf_map_entries{map=\"conntrack\"}",
            )
            .is_some_and(|n| n >= 42.0)
        }),
        "the flow table's entries reach /metrics within the census period; log:\n{}",
        daemon.log()
    );
    assert!(daemon.stop().success(), "{}", daemon.log());
}

/// `curl` as an operator would run it, in the network namespace `netns` (or here): the
/// status code and body, or None if curl got no answer within 2 s.
fn curl(netns: Option<&str>, url: &str, accept: Option<&str>) -> Option<(u16, String, String)> {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = std::process::Command::new("ip");
            c.args(["netns", "exec", ns, "curl"]);
            c
        }
        None => std::process::Command::new("curl"),
    };
    cmd.args(["-sS", "-m", "2", "-D", "-", url]);
    if let Some(a) = accept {
        cmd.args(["-H", &format!("Accept: {a}")]);
    }
    let out = cmd.output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let content_type = head
        .lines()
        .find_map(|l| {
            l.strip_prefix("Content-Type: ")
                .or_else(|| l.strip_prefix("content-type: "))
        })
        .unwrap_or_default()
        .to_string();
    Some((status, content_type, body.to_string()))
}

/// kube-proxy's /metrics: the Prometheus text format unless the scraper asks for
/// OpenMetrics; the text passes `promtool check metrics` (every metric with HELP and TYPE,
/// counters suffixed `_total`), and carries the kube-proxy metrics that fastpath adds.
#[test]
fn metrics_negotiate_the_format_and_pass_promtool() {
    let (bed, _pods) = bed_with_pods("prom", 2);
    let dir = bed.dir().join("manifests");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("web.yaml"), WEB).unwrap();
    // lb: Local policy, its only ready pod on another node: no local endpoints.
    let lb = LOCAL_LB
        .replace("HCPORT", &free_port().to_string())
        .replace("NODE1", "node-c");
    std::fs::write(dir.join("lb.yaml"), lb).unwrap();
    let (health, metrics) = (free_port(), free_port());
    let (health_addr, metrics_addr) = (
        format!("127.0.0.1:{health}"),
        format!("127.0.0.1:{metrics}"),
    );
    let mut daemon = Daemon::start(
        bed.cgroup_path(),
        &[
            "--manifests",
            dir.to_str().unwrap(),
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
    // Two probes of each kind, so that their counters show.
    for path in ["/healthz", "/healthz", "/livez", "/livez"] {
        assert_eq!(get(health, path).map(|r| r.0), Some(200));
    }
    let url = format!("http://127.0.0.1:{metrics}/metrics");

    let (status, content_type, text) = curl(None, &url, None).expect("curl /metrics");
    assert_eq!(
        (status, content_type.as_str()),
        (200, "text/plain; version=0.0.4; charset=utf-8")
    );
    let (_, ct, same) = curl(None, &url, Some("text/plain;version=0.0.4")).unwrap();
    assert!(
        ct.starts_with("text/plain; version=0.0.4") && !same.contains("# EOF"),
        "{ct}"
    );
    // Prometheus' own scrape header prefers OpenMetrics.
    let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
    let (_, ct, om) = curl(None, &url, Some(prometheus)).unwrap();
    assert!(
        ct.starts_with("application/openmetrics-text; version=1.0.0"),
        "{ct}"
    );
    assert!(
        om.ends_with("# EOF\n")
            && om.contains("# TYPE kubeproxy_sync_proxy_rules_service_changes counter")
    );

    for line in [
        "kubeproxy_proxy_healthz_total{code=\"200\"} 2",
        "kubeproxy_proxy_livez_total{code=\"200\"} 2",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\"} 1",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"} 0",
        "kubeproxy_sync_proxy_rules_service_changes_pending 0",
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending 0",
        "# TYPE kubeproxy_sync_full_proxy_rules_duration_seconds histogram",
        "# TYPE kubeproxy_sync_partial_proxy_rules_duration_seconds histogram",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in:\n{text}"
        );
    }

    if xtask::cmd::which("promtool").is_none() {
        eprintln!(
            "SKIPPED the promtool check: promtool is not installed (Debian: apt-get install prometheus, which `cargo xtask setup` does)"
        );
    } else {
        let mut child = std::process::Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("promtool runs");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "promtool check metrics: {}{}\n{text}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(daemon.stop().success(), "{}", daemon.log());
}

/// Slowloris against all three kinds of admin server at once: 200 connections that send
/// their request a byte at a time and are reopened as soon as the daemon drops them. Every
/// probe (curl, in the same namespace) is answered all the same: the daemon drops the
/// oldest slow connection for each new one, and cuts heads that take over 3 s.
#[test]
fn slow_connections_never_keep_probes_from_the_admin_servers() {
    use std::sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    };
    const SLOW: usize = 200;
    const ATTACK: Duration = Duration::from_secs(12);
    const MAX_RECONNECTS: usize = 20_000;

    let (bed, _pods) = bed_with_pods("slowloris", 2);
    let dir = bed.dir().join("manifests");
    std::fs::create_dir_all(&dir).unwrap();
    // The daemon runs in the bed's node namespace: its ports there are ours to pick.
    let (health, metrics, hc) = (10256u16, 10249u16, 32001u16);
    std::fs::write(
        dir.join("lb.yaml"),
        LOCAL_LB
            .replace("HCPORT", &hc.to_string())
            .replace("NODE1", "node-a"),
    )
    .unwrap();
    let ns = bed.node_netns().to_string();
    // nsenter enters only the network namespace and execs the daemon (same PID).
    let net = format!("--net=/run/netns/{ns}");
    let mut daemon = Daemon::start_wrapped(
        &["nsenter", &net, "--"],
        bed.cgroup_path(),
        &[
            "--manifests",
            dir.to_str().unwrap(),
            "--healthz-bind-address",
            &format!("127.0.0.1:{health}"),
            "--metrics-bind-address",
            &format!("127.0.0.1:{metrics}"),
            "--healthcheck-bind-address",
            "127.0.0.1",
        ],
    );
    let probes = [
        format!("http://127.0.0.1:{health}/healthz"),
        format!("http://127.0.0.1:{metrics}/metrics"),
        format!("http://127.0.0.1:{hc}/"),
    ];
    assert!(
        eventually(20, || probes
            .iter()
            .all(|u| curl(Some(&ns), u, None).is_some_and(|r| r.0 == 200))),
        "the admin servers never all answered 200; log:\n{}",
        daemon.log()
    );

    // The attackers: one thread per server, each keeping its share of SLOW connections
    // open, a byte of a never-ending request head every 200 ms, reopening what is closed.
    let stop = Arc::new(AtomicBool::new(false));
    let reconnects = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let open_now = Arc::new(AtomicUsize::new(0));
    let attackers: Vec<_> = [health, metrics, hc]
        .into_iter()
        .enumerate()
        .map(|(i, port)| {
            let share = SLOW / 3 + usize::from(i < SLOW % 3);
            let (ns, stop, reconnects, peak, open_now) = (
                ns.clone(),
                stop.clone(),
                reconnects.clone(),
                peak.clone(),
                open_now.clone(),
            );
            std::thread::spawn(move || {
                xtask::netns::enter(&ns).expect("into the node namespace");
                let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
                let started = std::time::Instant::now();
                let connect = || {
                    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
                    s.set_write_timeout(Some(Duration::from_millis(100))).ok()?;
                    let mut s = s;
                    s.write_all(b"GET /healthz HTTP/1.1\r\nX-Slow: ").ok()?;
                    Some(s)
                };
                let mut conns: Vec<Option<TcpStream>> = (0..share).map(|_| connect()).collect();
                let n = conns.iter().flatten().count();
                let total = open_now.fetch_add(n, Ordering::SeqCst) + n;
                peak.fetch_max(total, Ordering::SeqCst);
                while !stop.load(Ordering::SeqCst) && started.elapsed() < ATTACK {
                    for c in conns.iter_mut() {
                        let alive = c.as_mut().is_some_and(|s| s.write_all(b"a").is_ok());
                        if !alive && reconnects.fetch_add(1, Ordering::SeqCst) < MAX_RECONNECTS {
                            *c = connect();
                        }
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            })
        })
        .collect();

    // Probe all three while the attack runs.
    std::thread::sleep(Duration::from_millis(500));
    let (mut asked, mut failed) = (0, Vec::new());
    let until = std::time::Instant::now() + ATTACK - Duration::from_secs(2);
    while std::time::Instant::now() < until {
        for url in &probes {
            asked += 1;
            match curl(Some(&ns), url, None) {
                Some((200, _, _)) => {}
                other => failed.push(format!("{url}: {other:?}")),
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    stop.store(true, Ordering::SeqCst);
    for a in attackers {
        a.join().unwrap();
    }
    let (peak, reconnects) = (
        peak.load(Ordering::SeqCst),
        reconnects.load(Ordering::SeqCst),
    );
    eprintln!(
        "{asked} probes during the attack; {peak} slow connections at once, {reconnects} reopened"
    );
    assert!(
        peak >= SLOW,
        "the attack opened {peak} of its {SLOW} connections"
    );
    assert!(reconnects > 0, "the daemon never dropped a slow connection");
    assert!(asked >= 30, "only {asked} probes");
    assert!(
        failed.is_empty(),
        "{} of {asked} probes failed: {failed:#?}\nlog:\n{}",
        failed.len(),
        daemon.log()
    );
    assert!(daemon.stop().success(), "{}", daemon.log());
}
