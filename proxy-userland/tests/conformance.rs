//! One behavioural conformance matrix: each user-visible behaviour of a Service is written
//! once, as a function of the proxy mode, and run against every dataplane (`ebpf`,
//! `iptables`, `userspace`) through the real `fastpath` binary (`--proxy-mode`), fed by
//! manifest files, with real clients in a test bed's namespaces. One test per (behaviour,
//! mode): `<behaviour>::<mode>`, e.g. `cargo test --test conformance userspace`.
//!
//! The client runs in the bed's node namespace and client cgroup, which every mode serves:
//! the eBPF programs are attached to that cgroup, and the iptables and userspace rules live
//! in that namespace (`--netns`; OUTPUT for the node's own traffic, PREROUTING for pods).
//! Service addresses are routed into a dead-end device there in every mode, so an address
//! nobody proxies fails the same way everywhere (the connect times out).
//!
//! A behaviour a mode cannot offer calls [`skip`], which prints why; the README's mode table
//! lists the same.

mod common;
mod nat_common;

use std::{
    fmt::Write as _,
    net::Ipv4Addr,
    path::PathBuf,
    time::{Duration, Instant},
};

use common::*;
use nat_common::*;
use xtask::{probe::Outcome, testbed::Testbed};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Ebpf,
    Nftables,
    Iptables,
    Userspace,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Nftables => "nftables",
            Mode::Iptables => "iptables",
            Mode::Userspace => "userspace",
        }
    }
}

/// A behaviour this mode does not offer: says so on stderr (shown with --nocapture and in
/// the summary of a failing run) and passes.
#[allow(dead_code)]
fn skip(mode: Mode, behaviour: &str, why: &str) {
    eprintln!("SKIP {behaviour}::{}: {why}", mode.name());
}

/// `matrix!(a, b)`: for each behaviour `fn a(mode: Mode)`, a module `a` with the tests
/// `ebpf`, `iptables` and `userspace`.
macro_rules! matrix {
    ($($behaviour:ident),* $(,)?) => {$(
        mod $behaviour {
            #[test]
            fn ebpf() {
                super::$behaviour(super::Mode::Ebpf)
            }
            #[test]
            fn nftables() {
                super::$behaviour(super::Mode::Nftables)
            }
            #[test]
            fn iptables() {
                super::$behaviour(super::Mode::Iptables)
            }
            #[test]
            fn userspace() {
                super::$behaviour(super::Mode::Userspace)
            }
        }
    )*};
}

matrix!(
    basic_endpoint,
    multiport,
    same_port_tcp_and_udp,
    no_endpoints_refused,
    endpoint_removal_and_addition,
    service_recreated,
    client_ip_affinity_and_timeout,
    udp_preserved_when_server_pod_cycles,
    hairpin,
    service_proxy_name_and_headless_skipped,
    terminating_endpoints_fallback,
    prefer_same_node,
    service_range_refused,
);

// ---- the world each behaviour runs in ------------------------------------------------------

/// A service port: (name, port, targetPort, protocol).
type Port = (&'static str, u16, u16, &'static str);
const HTTP: Port = ("http", 80, 8080, "TCP");
const ALT: Port = ("alt", 81, 8081, "TCP");
const DNS: Port = ("dns", 53, 5353, "UDP");
const DNS_TCP: Port = ("dns-tcp", 53, 5353, "TCP");

/// Each pod runs two servers: `pod-N` on TCP 8080 and UDP 5353, and `pod-N.b` on TCP 8081
/// and TCP 5353, so every reply says which pod and which target port answered.
struct World {
    mode: Mode,
    bed: Testbed,
    daemon: Daemon,
    manifests: PathBuf,
    /// The pid of each pod's first server (index 0 is pod-1).
    servers: Vec<u32>,
}

impl World {
    /// A bed with `pods` pods and the daemon in `mode`, serving `yaml`.
    fn new(mode: Mode, tag: &str, pods: u8, yaml: &str) -> World {
        World::with_args(mode, tag, pods, yaml, &[])
    }

    /// As [`World::new`], with `extra` flags for the daemon (they win over the defaults).
    fn with_args(mode: Mode, tag: &str, pods: u8, yaml: &str, extra: &[&str]) -> World {
        let mut bed = Testbed::new(&format!("cf{tag}{}", &mode.name()[..1])).expect("test bed");
        let mut servers = Vec::new();
        for i in 1..=pods {
            let pod = bed
                .add_pod(&format!("pod-{i}"), pod_ip(i), None)
                .expect("pod");
            let a = bed
                .serve(
                    probe(),
                    &pod,
                    &["--tcp", "0.0.0.0:8080", "--udp", "0.0.0.0:5353"],
                )
                .expect("server");
            let b_name = format!("pod-{i}.b");
            bed.serve(
                probe(),
                &pod,
                &[
                    "--name",
                    &b_name,
                    "--tcp",
                    "0.0.0.0:8081",
                    "--tcp",
                    "0.0.0.0:5353",
                ],
            )
            .expect("server");
            servers.push(a);
        }
        route_services(&bed);
        let manifests = bed.dir().join("manifests.yaml");
        std::fs::write(&manifests, yaml).unwrap();
        let mut args = vec![
            "--proxy-mode",
            mode.name(),
            "--netns",
            bed.node_netns(),
            "--manifests",
            manifests.to_str().unwrap(),
            "--manifest-poll-period",
            "100ms",
            "--healthz-bind-address",
            "",
            "--metrics-bind-address",
            "",
        ];
        args.extend_from_slice(extra);
        let daemon = Daemon::start(bed.cgroup_path(), &args);
        World {
            mode,
            bed,
            daemon,
            manifests,
            servers,
        }
    }

    /// Replaces the manifests (atomically, so the daemon never reads half a file).
    fn set(&self, yaml: &str) {
        let tmp = self.manifests.with_extension("tmp");
        std::fs::write(&tmp, yaml).unwrap();
        std::fs::rename(&tmp, &self.manifests).unwrap();
    }

    fn tcp(&self, target: &str, count: usize) -> Vec<Outcome> {
        tcp(&self.bed, target, count)
    }

    fn udp(&self, target: &str, count: usize) -> Vec<Outcome> {
        let n = count.to_string();
        run_probe(
            &self.bed,
            &[
                "udp",
                target,
                "--count",
                &n,
                "--timeout-ms",
                "1000",
                "--fresh-socket",
            ],
        )
    }

    /// Waits (up to 20 s) until `check` holds, or fails with the daemon's log.
    fn until(&self, what: &str, mut check: impl FnMut() -> bool) {
        assert!(
            eventually(20, &mut check),
            "{} mode: {what}\n--- daemon log ---\n{}",
            self.mode.name(),
            self.daemon.log()
        );
    }
}

/// Every attempt answered, and the answers came from exactly `want`.
fn served_by(outcomes: &[Outcome], want: &[&str]) -> bool {
    outcomes.iter().all(Outcome::is_ok)
        && reached(outcomes) == want.iter().map(|s| s.to_string()).collect()
}

fn service(name: &str, ip: Option<Ipv4Addr>, ports: &[Port], extra: &str) -> String {
    let (cluster_ip, cluster_ips) = match ip {
        Some(ip) => (ip.to_string(), format!("[{ip}]")),
        None => ("None".into(), "[None]".into()),
    };
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: demo\n{extra}\
         spec:\n  clusterIP: {cluster_ip}\n  clusterIPs: {cluster_ips}\n  ports:\n"
    );
    for (pname, port, target, proto) in ports {
        let _ = writeln!(
            y,
            "  - {{name: {pname}, port: {port}, targetPort: {target}, protocol: {proto}}}"
        );
    }
    y.push_str("---\n");
    y
}

/// An EndpointSlice for service `name`: each endpoint is (pod index, conditions).
fn slice(name: &str, ports: &[Port], endpoints: &[(u8, &str)]) -> String {
    let mut y = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  \
         namespace: demo\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports:\n"
    );
    for (pname, _, target, proto) in ports {
        let _ = writeln!(y, "- {{name: {pname}, port: {target}, protocol: {proto}}}");
    }
    if endpoints.is_empty() {
        y.push_str("endpoints: []\n");
    } else {
        y.push_str("endpoints:\n");
        for (i, conditions) in endpoints {
            let _ = writeln!(
                y,
                "- addresses: [{}]\n  nodeName: node-a\n  conditions: {conditions}",
                pod_ip(*i)
            );
        }
    }
    y.push_str("---\n");
    y
}

const READY: &str = "{ready: true}";
const TERMINATING: &str = "{ready: false, serving: true, terminating: true}";

fn ready_pods(pods: &[u8]) -> Vec<(u8, &'static str)> {
    pods.iter().map(|&i| (i, READY)).collect()
}

/// Service `web` at [`WEB_IP`] with `ports` and ready endpoints on `pods`.
fn web(ports: &[Port], pods: &[u8]) -> String {
    service("web", Some(WEB_IP), ports, "") + &slice("web", ports, &ready_pods(pods))
}

fn at(ip: Ipv4Addr, port: u16) -> String {
    format!("{ip}:{port}")
}

// ---- the behaviours ------------------------------------------------------------------------

/// A ClusterIP reaches its endpoints, and the client sees the address it dialled.
fn basic_endpoint(mode: Mode) {
    let w = World::new(mode, "basic", 2, &web(&[HTTP], &[1, 2]));
    w.until("20 connections reach both pods", || {
        served_by(&w.tcp(WEB, 20), &["pod-1", "pod-2"])
    });
    let a = w.tcp(WEB, 3);
    assert!(a.iter().all(|o| peer(o) == Some(WEB)), "{a:?}");
}

/// Two ports of one service lead to their own target ports.
fn multiport(mode: Mode) {
    let w = World::new(mode, "mport", 1, &web(&[HTTP, ALT], &[1]));
    let alt = at(WEB_IP, 81);
    w.until("both ports answer", || {
        served_by(&w.tcp(WEB, 2), &["pod-1"]) && served_by(&w.tcp(&alt, 2), &["pod-1.b"])
    });
}

/// One port number over TCP and UDP: each protocol reaches its own server.
fn same_port_tcp_and_udp(mode: Mode) {
    let w = World::new(mode, "tcpudp", 1, &web(&[DNS, DNS_TCP], &[1]));
    let dns = at(WEB_IP, 53);
    w.until("TCP and UDP on port 53 answer", || {
        served_by(&w.tcp(&dns, 2), &["pod-1.b"]) && served_by(&w.udp(&dns, 2), &["pod-1"])
    });
    let udp = w.udp(&dns, 2);
    assert!(udp.iter().all(|o| from(o) == Some(dns.as_str())), "{udp:?}");
}

/// A service without endpoints refuses the connect at once (kube-proxy's REJECT).
fn no_endpoints_refused(mode: Mode) {
    let yaml = service("web", Some(WEB_IP), &[HTTP], "") + &slice("web", &[HTTP], &[]);
    let w = World::new(mode, "noeps", 1, &yaml);
    w.until("connections are refused", || {
        w.tcp(WEB, 1)[0].errno() == Some("ECONNREFUSED")
    });
    let started = Instant::now();
    let a = w.tcp(WEB, 3);
    assert!(a.iter().all(|o| o.errno() == Some("ECONNREFUSED")), "{a:?}");
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "refused at once, not timed out"
    );
}

/// Endpoints leave and join: new connections follow.
fn endpoint_removal_and_addition(mode: Mode) {
    let w = World::new(mode, "epchg", 3, &web(&[HTTP], &[1, 2]));
    w.until("both pods serve", || {
        served_by(&w.tcp(WEB, 20), &["pod-1", "pod-2"])
    });
    w.set(&web(&[HTTP], &[1]));
    w.until("only pod-1 serves after pod-2 left", || {
        served_by(&w.tcp(WEB, 10), &["pod-1"])
    });
    w.set(&web(&[HTTP], &[1, 3]));
    w.until("pod-3 serves after it joined", || {
        served_by(&w.tcp(WEB, 20), &["pod-1", "pod-3"])
    });
}

/// A service deleted and created again (with a new cluster IP) works again; its old
/// address no longer does.
fn service_recreated(mode: Mode) {
    let w = World::new(mode, "recreate", 1, &web(&[HTTP], &[1]));
    w.until("the service serves", || {
        served_by(&w.tcp(WEB, 2), &["pod-1"])
    });
    w.set("");
    w.until("the deleted service is gone", || {
        !tcp_quick(&w.bed, WEB).is_ok()
    });
    let new_ip = Ipv4Addr::new(198, 19, 0, 20);
    w.set(&(service("web", Some(new_ip), &[HTTP], "") + &slice("web", &[HTTP], &ready_pods(&[1]))));
    let new = at(new_ip, 80);
    w.until("the recreated service serves", || {
        served_by(&w.tcp(&new, 2), &["pod-1"])
    });
    let old = tcp_quick(&w.bed, WEB);
    assert!(!old.is_ok(), "the old address is not served: {old:?}");
}

/// sessionAffinity ClientIP keeps a client on one pod, until timeoutSeconds of silence.
fn client_ip_affinity_and_timeout(mode: Mode) {
    let yaml = service("web", Some(WEB_IP), &[HTTP], "")
        .replace(
            "  ports:\n",
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 2}}\n  ports:\n",
        )
        + &slice("web", &[HTTP], &ready_pods(&[1, 2, 3]));
    let w = World::new(mode, "affinity", 3, &yaml);
    w.until("the service serves", || w.tcp(WEB, 1)[0].is_ok());
    let a = w.tcp(WEB, 10);
    let stuck = reached(&a);
    assert!(
        a.iter().all(Outcome::is_ok) && stuck.len() == 1,
        "all on one pod: {a:?}"
    );
    // After more than the timeout without traffic, the choice is free again: with three
    // pods a new pick stays on the same one with probability 1/3 (round robin: never), so
    // 8 tries all on it would happen about once in 6,500 runs.
    let mut seen = Vec::new();
    for _ in 0..8 {
        std::thread::sleep(Duration::from_millis(2600));
        let b = w.tcp(WEB, 1);
        seen.push(b[0].reply().unwrap_or("error").to_string());
        if !stuck.contains(&seen[seen.len() - 1]) && b[0].is_ok() {
            return;
        }
    }
    panic!(
        "{} mode: never left {stuck:?} after the affinity timeout: {seen:?}",
        mode.name()
    );
}

/// kube-proxy's e2e "should be able to preserve UDP traffic when server pod cycles for a
/// ClusterIP service": a client sends from one source port, a new socket per datagram
/// (`nc -u -p 12345` in a loop); its server pod is replaced by another; the client must
/// reach the new pod.
fn udp_preserved_when_server_pod_cycles(mode: Mode) {
    let mut w = World::new(mode, "udpcycle", 2, &web(&[DNS], &[1]));
    w.until("pod-1 serves", || served_by(&w.udp(WEB_DNS, 1), &["pod-1"]));

    let mut cmd = w.bed.client(probe());
    cmd.args([
        "udp",
        WEB_DNS,
        "--count",
        "40",
        "--interval-ms",
        "100",
        "--timeout-ms",
        "300",
        "--fresh-socket",
        "--source-port",
        "12345",
    ]);
    let client = std::thread::spawn(move || xtask::cmd::output(&mut cmd));
    std::thread::sleep(Duration::from_millis(1000));
    // pod-1 goes (its server stops), pod-2 replaces it.
    let pid = w.servers[0];
    w.bed.stop(pid).expect("stop pod-1's server");
    w.set(&web(&[DNS], &[2]));
    let out = xtask::probe::parse(&client.join().unwrap().expect("probe runs"));
    assert_eq!(
        out.first().and_then(Outcome::reply),
        Some("pod-1"),
        "{out:?}"
    );
    assert!(
        out.len() > 5
            && out[out.len() - 5..]
                .iter()
                .all(|o| o.reply() == Some("pod-2")),
        "{} mode: the client's traffic reached the new pod: {out:?}\n{}",
        mode.name(),
        w.daemon.log()
    );
}

/// A pod reaching its own service lands on itself.
fn hairpin(mode: Mode) {
    let w = World::new(mode, "hairpin", 1, &web(&[HTTP], &[1]));
    // From pod-1's namespace (and the client cgroup, which the eBPF programs serve; the
    // iptables and userspace rules see it arrive from the pod's veth).
    let pod_ns = w.bed.pods()[0].netns.clone();
    let from_pod = || {
        let mut cmd = std::process::Command::new(PROBE);
        cmd.arg("--netns")
            .arg(&pod_ns)
            .arg("--cgroup")
            .arg(w.bed.cgroup_path());
        cmd.args(["tcp", WEB, "--count", "2", "--timeout-ms", "1000"]);
        xtask::probe::parse(&xtask::cmd::output(&mut cmd).expect("probe runs"))
    };
    w.until("pod-1 reaches itself through its service", || {
        served_by(&from_pod(), &["pod-1"])
    });
}

/// Services labelled for another proxy (service.kubernetes.io/service-proxy-name) and
/// headless services are not proxied; the others are, and nothing is reported as failed.
fn service_proxy_name_and_headless_skipped(mode: Mode) {
    let other = Ipv4Addr::new(198, 19, 0, 30);
    let yaml = web(&[HTTP], &[1])
        + &service(
            "other",
            Some(other),
            &[HTTP],
            "  labels: {service.kubernetes.io/service-proxy-name: someone-else}\n",
        )
        + &slice("other", &[HTTP], &ready_pods(&[1]))
        + &service("headless", None, &[HTTP], "")
        + &slice("headless", &[HTTP], &ready_pods(&[1]));
    let w = World::new(mode, "skipped", 1, &yaml);
    w.until("the ordinary service serves", || {
        served_by(&w.tcp(WEB, 2), &["pod-1"])
    });
    let a = tcp_quick(&w.bed, &at(other, 80));
    assert!(!a.is_ok(), "another proxy's service is not ours: {a:?}");
    let log = w.daemon.log();
    assert!(
        !log.lines()
            .any(|l| (l.contains("WARN") || l.contains("ERROR"))
                && (l.contains("headless") || l.contains("demo/other"))),
        "skipped quietly:\n{log}"
    );
}

/// With no ready endpoint left, serving-terminating ones take the traffic (kube-proxy's
/// fallback), and only then.
fn terminating_endpoints_fallback(mode: Mode) {
    let eps = [(1, READY), (2, TERMINATING)];
    let w = World::new(
        mode,
        "term",
        2,
        &(service("web", Some(WEB_IP), &[HTTP], "") + &slice("web", &[HTTP], &eps)),
    );
    w.until("only the ready pod serves", || {
        served_by(&w.tcp(WEB, 10), &["pod-1"])
    });
    w.set(
        &(service("web", Some(WEB_IP), &[HTTP], "") + &slice("web", &[HTTP], &[(2, TERMINATING)])),
    );
    w.until("the terminating pod serves once it is all there is", || {
        served_by(&w.tcp(WEB, 5), &["pod-2"])
    });
}

/// One TCP attempt with a short time limit.
fn tcp_quick(bed: &Testbed, target: &str) -> Outcome {
    run_probe(bed, &["tcp", target, "--count", "1", "--timeout-ms", "500"]).remove(0)
}

/// trafficDistribution PreferSameNode, with the hints the EndpointSlice controller writes
/// for it (each endpoint for its own node and zone): the proxy on a node with an endpoint
/// sends its clients there only; the proxy on a node without one falls back to its zone's
/// endpoints (kube-proxy's topologyModeFromHints), spreading over them.
fn prefer_same_node(mode: Mode) {
    // pod-1 on node-a and pod-2 on node-b, both in zone-a; pod-3 on node-c in zone-b.
    let placed = [
        (1, "node-a", "zone-a"),
        (2, "node-b", "zone-a"),
        (3, "node-c", "zone-b"),
    ];
    let mut yaml = service("web", Some(WEB_IP), &[HTTP], "")
        .replace("spec:\n", "spec:\n  trafficDistribution: PreferSameNode\n");
    let _ = write!(
        yaml,
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  \
         namespace: demo\n  labels: {{kubernetes.io/service-name: web}}\naddressType: IPv4\n\
         ports:\n- {{name: http, port: 8080, protocol: TCP}}\nendpoints:\n"
    );
    for (i, node, zone) in placed {
        let _ = writeln!(
            yaml,
            "- addresses: [{}]\n  nodeName: {node}\n  zone: {zone}\n  conditions: {READY}\n  \
             hints: {{forZones: [{{name: {zone}}}], forNodes: [{{name: {node}}}]}}",
            pod_ip(i)
        );
    }
    yaml.push_str("---\n");

    let here = World::with_args(
        mode,
        "psnl",
        3,
        &yaml,
        &["--hostname-override", "node-a", "--zone", "zone-a"],
    );
    here.until("20 connections from node-a all reach its own pod-1", || {
        served_by(&here.tcp(WEB, 20), &["pod-1"])
    });
    drop(here);

    let elsewhere = World::with_args(
        mode,
        "psnr",
        3,
        &yaml,
        &["--hostname-override", "node-d", "--zone", "zone-a"],
    );
    elsewhere.until(
        "20 connections from node-d (no endpoint) spread over zone-a's pod-1 and pod-2",
        || served_by(&elsewhere.tcp(WEB, 20), &["pod-1", "pod-2"]),
    );
}

/// Runs `probe` and returns its outcomes and how long the whole run took.
fn timed(probe: impl FnOnce() -> Vec<Outcome>) -> (Vec<Outcome>, Duration) {
    let started = Instant::now();
    let out = probe();
    (out, started.elapsed())
}

/// With `--service-cluster-ip-range 198.19.0.0/17` and a ServiceCIDR manifest for
/// 198.19.128.0/24: a held address serves; an address of the ranges no Service holds, and
/// a held address on a port or protocol it does not serve, are refused at once (TCP
/// connect, and connected UDP), each attempt well within 100 ms (process start included),
/// never a timeout; an address outside the ranges is left alone (here it is routed to a
/// dead end, so it times out as before).
fn service_range_refused(mode: Mode) {
    let yaml = web(&[HTTP], &[1])
        + "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: extra}\n\
           spec: {cidrs: [198.19.128.0/24]}\n";
    let w = World::with_args(
        mode,
        "svcrange",
        1,
        &yaml,
        &["--service-cluster-ip-range", "198.19.0.0/17"],
    );
    w.until("the held address serves", || {
        served_by(&w.tcp(WEB, 2), &["pod-1"])
    });
    let refused = |o: &[Outcome]| o.iter().all(|o| o.errno() == Some("ECONNREFUSED"));
    let unheld = "198.19.0.99:80";
    w.until("the unheld address is refused", || {
        refused(&w.tcp(unheld, 1))
    });
    for target in [unheld, "198.19.0.10:81", "198.19.128.5:80"] {
        let (out, took) = timed(|| w.tcp(target, 10));
        assert!(refused(&out), "{} mode, {target}: {out:?}", mode.name());
        assert!(
            took < Duration::from_millis(1000),
            "{} mode, {target}: 10 refusals took {took:?}, not at once",
            mode.name()
        );
    }
    let udp_connected = |target: &str| {
        run_probe(
            &w.bed,
            &[
                "udp",
                target,
                "--count",
                "5",
                "--timeout-ms",
                "1000",
                "--fresh-socket",
                "--connected",
            ],
        )
    };
    // The socket hooks refuse with ECONNREFUSED. A rule-based mode rejects the datagram
    // in OUTPUT, and the kernel fails a send its own OUTPUT chain rejected with EPERM (a
    // pod's datagram, rejected on FORWARD, gets the ICMP error: ECONNREFUSED).
    let udp_refusal = match mode {
        Mode::Ebpf => "ECONNREFUSED",
        Mode::Nftables | Mode::Iptables | Mode::Userspace => "EPERM",
    };
    for target in ["198.19.0.99:53", "198.19.0.10:53"] {
        let (out, took) = timed(|| udp_connected(target));
        assert!(
            out.iter().all(|o| o.errno() == Some(udp_refusal)),
            "{} mode, UDP {target}: {out:?}",
            mode.name()
        );
        assert!(
            took < Duration::from_millis(1000),
            "{} mode, UDP {target}: 5 refusals took {took:?}",
            mode.name()
        );
    }
    // The held port still works: the range's rule comes after the services'.
    assert!(served_by(&w.tcp(WEB, 3), &["pod-1"]));
    let outside = tcp_quick(&w.bed, "198.19.200.1:80");
    assert_ne!(
        outside.errno(),
        Some("ECONNREFUSED"),
        "{} mode: outside the range nothing is refused: {outside:?}",
        mode.name()
    );
}
