//! `fastpath inspect` and `fastpath explain` against the real daemon, and against what real
//! packets do: explain names a backend set X, and real connections land only within X (and
//! reach all of it); a service it explains as refused refuses a real connect.

mod common;
mod inspect_common;
mod nat_common;

use std::{collections::BTreeSet, net::Ipv4Addr, process::Command};

use common::*;
use inspect_common::{json, tool};
use serde_json::Value;

/// demo/web: pod-1 (here) and pod-2 (node-b) ready, pod-3 serving but terminating (stays
/// out while ready ones exist); demo/local: internalTrafficPolicy Local over pod-1 and
/// pod-2; demo/empty: no endpoints.
const MANIFESTS: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  clusterIP: 198.19.0.10
  clusterIPs: [198.19.0.10]
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
endpoints:
- {addresses: [198.18.1.11], conditions: {ready: true}, nodeName: node-a}
- {addresses: [198.18.1.12], conditions: {ready: true}, nodeName: node-b}
- {addresses: [198.18.1.13], conditions: {ready: false, serving: true, terminating: true}, nodeName: node-a}
---
apiVersion: v1
kind: Service
metadata: {name: local, namespace: demo}
spec:
  clusterIP: 198.19.0.12
  clusterIPs: [198.19.0.12]
  internalTrafficPolicy: Local
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: local-1, namespace: demo, labels: {kubernetes.io/service-name: local}}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
endpoints:
- {addresses: [198.18.1.11], conditions: {ready: true}, nodeName: node-a}
- {addresses: [198.18.1.12], conditions: {ready: true}, nodeName: node-b}
---
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: demo}
spec:
  clusterIP: 198.19.0.11
  clusterIPs: [198.19.0.11]
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP}
"#;

fn explain(admin: &str, pins: &str, proto: &str, dst: &str) -> Value {
    json(&[
        "explain",
        proto,
        dst,
        "--admin",
        admin,
        "--bpf-pin-dir",
        pins,
    ])
}

fn strings(v: &Value) -> BTreeSet<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// The pod name (`pod-N`) serving at 198.18.1.(10+N):port.
fn pod_names(addrs: &BTreeSet<String>) -> BTreeSet<String> {
    addrs
        .iter()
        .map(|a| {
            let ip: Ipv4Addr = a.split(':').next().unwrap().parse().unwrap();
            format!("pod-{}", ip.octets()[3] - 10)
        })
        .collect()
}

/// Connects `count` times and checks every connection landed within `eligible` and every
/// eligible backend was reached.
fn assert_lands_within(
    bed: &xtask::testbed::Testbed,
    target: &str,
    eligible: &BTreeSet<String>,
    count: usize,
) {
    let outcomes = tcp(bed, target, count);
    assert!(outcomes.iter().all(|o| o.is_ok()), "{target}: {outcomes:?}");
    assert_eq!(
        reached(&outcomes),
        pod_names(eligible),
        "{target}: connections vs explain's set"
    );
}

fn eligible_of(ex: &Value) -> BTreeSet<String> {
    strings(&ex["eligible"])
}

#[test]
fn explain_matches_real_connections_and_inspect_lists_the_maps() {
    let (bed, _pods) = bed_with_pods("explain", 3);
    std::fs::write(bed.dir().join("svc.yaml"), MANIFESTS).unwrap();
    let bpffs = Bpffs::mount(bed.dir());
    let pins = bpffs.0.join("fastpath");
    let (pins, admin) = (pins.to_str().unwrap(), format!("127.0.0.1:{}", free_port()));
    let daemon = Daemon::start(
        bed.cgroup_path(),
        &[
            "--manifests",
            bed.dir().join("svc.yaml").to_str().unwrap(),
            "--metrics-bind-address",
            &admin,
            "--bpf-pin-dir",
            pins,
            "--proxy-mode",
            "ebpf",
            "--service-cluster-ip-range",
            "198.19.0.0/24",
        ],
    );
    let synced = || {
        xtask::seccomp::command(FASTPATH)
            .args([
                "explain",
                "tcp",
                "198.19.0.10:80",
                "--admin",
                &admin,
                "-o",
                "json",
            ])
            .output()
            .ok()
            .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok())
            .is_some_and(|v| v["verdict"] == "translated")
    };
    assert!(
        eventually(20, synced),
        "explain never saw demo/web synced; log:\n{}",
        daemon.log()
    );

    // Ready endpoints on both nodes; the serving-terminating one stays out, and says why.
    let ex = explain(&admin, pins, "tcp", WEB);
    let want: BTreeSet<String> = ["198.18.1.11:8080", "198.18.1.12:8080"]
        .map(String::from)
        .into();
    assert_eq!(eligible_of(&ex), want, "{ex:#}");
    assert_eq!(ex["matched"]["service"], "demo/web:http");
    assert_eq!(ex["matched"]["kind"], "ClusterIP");
    assert!(
        ex["hook"].as_str().unwrap().contains("cgroup/connect4"),
        "{ex:#}"
    );
    assert_eq!(
        strings(&ex["programmed"]),
        want,
        "the maps hold the same set"
    );
    let pod3 = ex["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["address"] == "198.18.1.13:8080")
        .unwrap();
    assert_eq!(pod3["eligible"], false);
    assert_eq!(pod3["state"], "serving-terminating");
    assert!(
        pod3["reason"]
            .as_str()
            .unwrap()
            .contains("no ready endpoint"),
        "{pod3}"
    );
    assert_lands_within(&bed, WEB, &want, 20);

    // internalTrafficPolicy Local: only this node's pod.
    let ex = explain(&admin, pins, "tcp", "198.19.0.12:80");
    let want: BTreeSet<String> = ["198.18.1.11:8080".to_string()].into();
    assert_eq!(eligible_of(&ex), want, "{ex:#}");
    let remote = ex["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["address"] == "198.18.1.12:8080")
        .unwrap();
    assert!(
        remote["reason"].as_str().unwrap().contains("Local policy"),
        "{remote}"
    );
    assert_lands_within(&bed, "198.19.0.12:80", &want, 10);

    // No endpoints: explain says refused, and a real connect is refused.
    let ex = explain(&admin, pins, "tcp", "198.19.0.11:80");
    assert_eq!(ex["verdict"], "refused", "{ex:#}");
    assert!(ex["eligible"].as_array().unwrap().is_empty());
    let outcomes = tcp(&bed, "198.19.0.11:80", 3);
    assert!(
        outcomes.iter().all(|o| o.errno() == Some("ECONNREFUSED")),
        "{outcomes:?}"
    );

    // A Service's address on a port and protocol it does not serve, inside the service
    // range: refused, as the hooks refuse it.
    let ex = explain(&admin, pins, "udp", "198.19.0.10:80");
    assert_eq!(ex["verdict"], "refused", "{ex:#}");
    // Not a service at all, outside the range: left alone.
    let ex = explain(&admin, pins, "udp", "198.19.5.10:80");
    assert_eq!(ex["verdict"], "not-a-service", "{ex:#}");

    // inspect services: the frontends with their names, from the maps and the daemon.
    let rows: Value = serde_json::from_str(&tool(&[
        "inspect",
        "services",
        "--admin",
        &admin,
        "--bpf-pin-dir",
        pins,
        "-o",
        "json",
    ]))
    .unwrap();
    let row = |fe: &str| {
        rows.as_array()
            .unwrap()
            .iter()
            .find(|r| r["frontend"] == fe)
            .cloned()
    };
    let web = row("198.19.0.10:80/TCP").expect("demo/web's frontend is listed");
    assert_eq!(web["service"], "demo/web:http");
    assert_eq!(web["scope"], "socket");
    assert_eq!(web["in_sync"], true);
    let states: BTreeSet<(String, String)> = web["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["address"].as_str().unwrap().into(),
                b["state"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        states,
        [("198.18.1.11:8080", "ready"), ("198.18.1.12:8080", "ready")]
            .map(|(a, s)| (a.to_string(), s.to_string()))
            .into()
    );
    let empty = row("198.19.0.11:80/TCP").expect("demo/empty's frontend is listed");
    assert_eq!(empty["no_backends"], "refused (ECONNREFUSED)");
    let table = tool(&[
        "inspect",
        "services",
        "--admin",
        &admin,
        "--bpf-pin-dir",
        pins,
    ]);
    assert!(table.starts_with("FRONTEND"), "{table}");
    // What an operator sees (and docs/inspect.md shows).
    eprintln!("$ fastpath inspect services\n{table}");
    let text = tool(&[
        "explain",
        "tcp",
        WEB,
        "--admin",
        &admin,
        "--bpf-pin-dir",
        pins,
    ]);
    eprintln!("$ fastpath explain tcp {WEB}\n{text}");
    assert!(text.contains("verdict:  translated"), "{text}");
    let text = tool(&["explain", "tcp", "198.19.0.11:80", "--admin", &admin]);
    eprintln!("$ fastpath explain tcp 198.19.0.11:80\n{text}");
    // An address of the service range that no Service holds: explain says it is refused,
    // and a real client is refused; inspect lists the range.
    let ex = explain(&admin, pins, "tcp", "198.19.0.99:80");
    assert_eq!(ex["verdict"], "refused", "{ex:#}");
    assert!(
        ex["detail"]
            .as_str()
            .unwrap_or("")
            .contains("198.19.0.0/24"),
        "{ex:#}"
    );
    let out = run_probe(
        &bed,
        &[
            "tcp",
            "198.19.0.99:80",
            "--count",
            "1",
            "--timeout-ms",
            "300",
        ],
    );
    assert_eq!(out[0].errno(), Some("ECONNREFUSED"), "{out:?}");
    assert!(
        table.contains("service ranges: 198.19.0.0/24"),
        "inspect services should list the ranges:\n{table}"
    );
    assert!(
        table.lines().any(|l| l.contains("198.19.0.12:80/TCP")
            && l.contains("demo/local:http")
            && l.contains("internal=Local")
            && l.contains("198.18.1.11:8080")),
        "{table}"
    );

    // Without the daemon the maps alone still answer, by address.
    drop(daemon);
    let out = xtask::seccomp::command(FASTPATH)
        .args([
            "inspect",
            "services",
            "--admin",
            "127.0.0.1:1",
            "--bpf-pin-dir",
            pins,
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.lines()
            .any(|l| l.contains("198.19.0.10:80/TCP") && l.contains('?')),
        "{text}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("showing addresses only"));
}

#[test]
fn explain_in_iptables_mode_names_the_chains_and_matches_real_connections() {
    explain_in_rule_mode("iptables");
}

#[test]
fn explain_in_nftables_mode_names_the_chains_and_matches_real_connections() {
    explain_in_rule_mode("nftables");
}

/// A rule-based mode: explain names the service's chain, the one the mode's own tool
/// lists; real connections land within the eligible backends; a service without endpoints
/// is refused; `inspect services` reads the same chain and both backends from the kernel.
fn explain_in_rule_mode(mode: &str) {
    let (bed, _pods) = bed_with_pods(&format!("explain{}", &mode[..3]), 3);
    nat_common::route_services(&bed);
    std::fs::write(bed.dir().join("svc.yaml"), MANIFESTS).unwrap();
    let admin = format!("127.0.0.1:{}", free_port());
    let mut daemon = Daemon::start(
        bed.cgroup_path(),
        &[
            "--manifests",
            bed.dir().join("svc.yaml").to_str().unwrap(),
            "--metrics-bind-address",
            &admin,
            "--proxy-mode",
            mode,
            "--netns",
            bed.node_netns(),
            "--cleanup-on-exit",
        ],
    );
    let synced = || {
        xtask::seccomp::command(FASTPATH)
            .args(["explain", "tcp", WEB, "--admin", &admin, "-o", "json"])
            .output()
            .ok()
            .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok())
            .is_some_and(|v| v["verdict"] == "translated" && v["mode"] == mode)
    };
    assert!(
        eventually(30, synced),
        "explain never saw demo/web synced; log:\n{}",
        daemon.log()
    );

    let ex = explain(&admin, "/nonexistent", "tcp", WEB);
    let want: BTreeSet<String> = ["198.18.1.11:8080", "198.18.1.12:8080"]
        .map(String::from)
        .into();
    assert_eq!(eligible_of(&ex), want, "{ex:#}");
    assert_eq!(
        ex["programmed"].as_array().map(Vec::len),
        Some(2),
        "read back from the kernel: {ex:#}"
    );
    let hook = ex["hook"].as_str().unwrap();
    let (via, prefix, listing) = match mode {
        "iptables" => (
            "KUBE-SERVICES -> KUBE-SVC-",
            "KUBE-SVC-",
            vec!["iptables-save", "-t", "nat"],
        ),
        _ => (
            "services -> @service-ips -> service-",
            "service-",
            vec!["nft", "list", "table", "ip", "fastpath"],
        ),
    };
    assert!(hook.contains(via), "{hook}");
    // The chain explain names is the one the mode's own tool shows for the service.
    let chain = hook.split(" -> ").find(|c| c.starts_with(prefix)).unwrap();
    let listed = Command::new("ip")
        .args(["netns", "exec", bed.node_netns()])
        .args(&listing)
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout);
    let names_it = |l: &&str| match mode {
        "iptables" => l.contains("demo/web:http") && l.contains(&format!("-j {chain}")),
        _ => l.contains(&format!("goto {chain}")),
    };
    assert!(
        listed.lines().any(|l| names_it(&l)),
        "{chain} not in:\n{listed}"
    );
    assert_lands_within(&bed, WEB, &want, 20);

    let ex = explain(&admin, "/nonexistent", "tcp", "198.19.0.11:80");
    assert_eq!(ex["verdict"], "rejected", "{ex:#}");
    let outcomes = tcp(&bed, "198.19.0.11:80", 3);
    assert!(
        outcomes.iter().all(|o| o.errno() == Some("ECONNREFUSED")),
        "{outcomes:?}"
    );

    let rows: Value = serde_json::from_str(&tool(&[
        "inspect", "services", "--admin", &admin, "-o", "json",
    ]))
    .unwrap();
    let web = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["frontend"] == "198.19.0.10:80/TCP")
        .unwrap();
    assert_eq!(web["chain"], chain, "{web:#}");
    let backends = web["backends"].as_array().unwrap();
    assert_eq!(backends.len(), 2, "{web:#}");
    for b in backends {
        assert_eq!(b["probability"], 0.5, "{web:#}");
    }
    assert_eq!(web["in_sync"], true, "{web:#}");
    daemon.stop();
}

/// A NodePort from another host: explain names the packet path and its backends, real
/// connections land within them, and `inspect flows` lists those connections' flows.
#[test]
fn explain_and_inspect_flows_follow_node_port_traffic_from_another_host() {
    let np = NodePortBed::new("explainnp");
    let daemon = np.daemon(&[]);
    let (pins, admin, target) = (np.pins(), np.admin.as_str(), np.target());
    let from_ext = |count: usize| np.connect_from_ext(count);
    assert!(
        eventually(20, || from_ext(1)[0].is_ok()),
        "the NodePort never answered; log:\n{}",
        daemon.log()
    );

    let ex: Value = serde_json::from_str(&tool(&[
        "explain",
        "tcp",
        &target,
        "--from",
        "198.18.2.1",
        "--admin",
        admin,
        "--bpf-pin-dir",
        pins,
        "-o",
        "json",
    ]))
    .unwrap();
    assert_eq!(ex["client"], "another host");
    assert_eq!(ex["matched"]["kind"], "NodePort");
    assert_eq!(ex["matched"]["frontend"], "<node>:30080/TCP (external)");
    assert!(
        ex["hook"].as_str().unwrap().contains("tc ingress"),
        "{ex:#}"
    );
    let want: BTreeSet<String> = ["198.18.1.11:8080", "198.18.1.12:8080"]
        .map(String::from)
        .into();
    assert_eq!(eligible_of(&ex), want, "{ex:#}");
    let attempts = from_ext(20);
    assert!(attempts.iter().all(|o| o.is_ok()), "{attempts:?}");
    assert_eq!(reached(&attempts), pod_names(&want));

    // The ClusterIP is the client's own node's business in eBPF mode.
    let ex = explain(admin, pins, "tcp", WEB);
    assert_eq!(ex["verdict"], "translated");
    let out = tool(&[
        "explain",
        "tcp",
        WEB,
        "--from",
        "198.18.2.1",
        "--admin",
        admin,
        "-o",
        "json",
    ]);
    let ex: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(ex["verdict"], "not-translated-here", "{ex:#}");

    // The flows of those connections: from the client, to the node port, on a pod.
    let flows: Value = serde_json::from_str(&tool(&[
        "inspect",
        "flows",
        "--admin",
        admin,
        "--bpf-pin-dir",
        pins,
        "-o",
        "json",
    ]))
    .unwrap();
    let ours: Vec<&Value> = flows
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["client"].as_str().unwrap().starts_with("198.18.2.1:"))
        .collect();
    assert!(ours.len() >= 20, "{flows:#}");
    for f in &ours {
        assert_eq!(f["frontend"], target.as_str(), "{f}");
        assert_eq!(f["service"], "demo/web:http", "{f}");
        assert!(want.contains(f["backend"].as_str().unwrap()), "{f}");
        assert!(f["snat"].is_null(), "local backends see the client: {f}");
    }
    let table = tool(&["inspect", "flows", "--admin", admin, "--bpf-pin-dir", pins]);
    eprintln!(
        "$ fastpath inspect flows\n{}",
        table.lines().take(4).collect::<Vec<_>>().join("\n")
    );
    let text = tool(&[
        "explain",
        "tcp",
        &target,
        "--from",
        "198.18.2.1",
        "--admin",
        admin,
        "--bpf-pin-dir",
        pins,
    ]);
    eprintln!("$ fastpath explain tcp {target} --from 198.18.2.1\n{text}");
}

/// The flow table is collected: connections through a node port that ended (both sides
/// closed) stay in `fastpath inspect flows` for the closing timeout (10 s), then leave it,
/// taken by the daemon's collector (every second here with `--conntrack-gc-interval`,
/// every 30 s by default).
#[test]
fn ended_node_port_connections_leave_the_flow_table_after_the_closing_timeout() {
    let np = NodePortBed::new("ctgc");
    let daemon = np.daemon(&["--conntrack-gc-interval", "1s"]);
    np.connections_once_up(&daemon, 10);
    let ended_at = std::time::Instant::now();
    let flows = || np.flows().as_array().map_or(0, Vec::len);
    let listed = flows();
    assert!(listed >= 11, "{listed} flows listed");
    std::thread::sleep(std::time::Duration::from_secs(5));
    assert_eq!(flows(), listed, "nothing goes before the closing timeout");
    assert!(
        eventually(20, || flows() == 0),
        "{} flows left; log:\n{}",
        flows(),
        daemon.log()
    );
    assert!(ended_at.elapsed() >= std::time::Duration::from_secs(10));
}

/// Two pods behind a NodePort (`web_node_port_manifest`), a client on another host, and
/// maps pinned on a private bpffs.
struct NodePortBed {
    // Fields drop in this order: the bpffs is unmounted before the bed's folder goes.
    _bpffs: Bpffs,
    pins: std::path::PathBuf,
    admin: String,
    ext: xtask::testbed::Pod,
    bed: xtask::testbed::Testbed,
}

impl NodePortBed {
    fn new(tag: &str) -> Self {
        let (mut bed, _pods) = bed_with_pods(tag, 2);
        let ext = bed
            .add_pod("ext", Ipv4Addr::new(198, 18, 2, 1), None)
            .expect("client");
        let manifest = web_node_port_manifest(&[pod_ip(1), pod_ip(2)]);
        std::fs::write(bed.dir().join("web.yaml"), manifest).unwrap();
        let bpffs = Bpffs::mount(bed.dir());
        let pins = bpffs.0.join("fastpath");
        let admin = format!("127.0.0.1:{}", free_port());
        Self {
            _bpffs: bpffs,
            pins,
            admin,
            ext,
            bed,
        }
    }

    fn pins(&self) -> &str {
        self.pins.to_str().unwrap()
    }

    fn target(&self) -> String {
        format!("{}:30080", self.bed.node_ipv4())
    }

    /// The daemon with node ports on the client's device, the admin server and the pins,
    /// and `extra`.
    fn daemon(&self, extra: &[&str]) -> Daemon {
        let manifests = self.bed.dir().join("web.yaml");
        let args = [
            "--manifests",
            manifests.to_str().unwrap(),
            "--netns",
            self.bed.node_netns(),
            "--nodeport-devices",
            &self.ext.node_veth,
            "--metrics-bind-address",
            &self.admin,
            "--bpf-pin-dir",
            self.pins(),
        ];
        Daemon::start(self.bed.cgroup_path(), &[&args[..], extra].concat())
    }

    /// Once the node port answers, `count` more connections, which must all succeed.
    fn connections_once_up(&self, daemon: &Daemon, count: usize) {
        assert!(
            eventually(20, || self.connect_from_ext(1)[0].is_ok()),
            "the NodePort never answered; log:\n{}",
            daemon.log()
        );
        let outcomes = self.connect_from_ext(count);
        assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
    }

    /// `fastpath inspect flows`, as JSON.
    fn flows(&self) -> Value {
        json(&[
            "inspect",
            "flows",
            "--admin",
            &self.admin,
            "--bpf-pin-dir",
            self.pins(),
        ])
    }

    /// `count` TCP connections from the client to the node port.
    fn connect_from_ext(&self, count: usize) -> Vec<xtask::probe::Outcome> {
        let mut cmd = Command::new(PROBE);
        let (target, count) = (self.target(), count.to_string());
        cmd.args(["--netns", &self.ext.netns, "tcp", &target])
            .args(["--count", &count, "--timeout-ms", "1000"]);
        xtask::probe::parse(&xtask::cmd::output(&mut cmd).expect("probe runs"))
    }
}

/// A node upgraded with its maps pinned: the flow tables a daemon before the hash map
/// pinned are LRU maps. The new daemon keeps them (their flows go on), says so, and the
/// node port works through them: new flows land in the pinned table, as `inspect flows`
/// shows.
#[test]
fn a_flow_table_an_earlier_version_pinned_as_an_lru_map_is_kept_and_used() {
    let np = NodePortBed::new("ctlru");
    let maps = np.pins.join("maps-v1");
    std::fs::create_dir_all(&maps).unwrap();
    for (name, key, value) in [
        (
            "FP_CT4",
            std::mem::size_of::<proxy_common::Ct4Key>(),
            std::mem::size_of::<proxy_common::Ct4Value>(),
        ),
        (
            "FP_CT6",
            std::mem::size_of::<proxy_common::Ct6Key>(),
            std::mem::size_of::<proxy_common::Ct6Value>(),
        ),
    ] {
        pin_lru_map(&maps.join(name), name, key as u32, value as u32, 4096);
    }
    let daemon = np.daemon(&[]);
    np.connections_once_up(&daemon, 5);
    assert!(
        daemon
            .log()
            .contains("the flow table is an LRU map pinned by an earlier version"),
        "log:\n{}",
        daemon.log()
    );
    let flows = np.flows();
    let listed = flows.as_array().map_or(0, Vec::len);
    assert!(
        listed >= 6,
        "{listed} flows in the pinned LRU table: {flows:#}"
    );
}

/// Creates an LRU hash map (what `FP_CT4`/`FP_CT6` were before) and pins it at `path`.
fn pin_lru_map(path: &std::path::Path, name: &str, key: u32, value: u32, max: u32) {
    use std::os::fd::AsRawFd as _;
    const BPF_OBJ_PIN: libc::c_long = 6;
    let fd = create_map(BPF_MAP_TYPE_LRU_HASH, name, key, value, max);
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // union bpf_attr for BPF_OBJ_PIN: the path's address, then the fd.
    let mut pin = [0u8; 128];
    pin[0..8].copy_from_slice(&(c_path.as_ptr() as u64).to_ne_bytes());
    pin[8..12].copy_from_slice(&(fd.as_raw_fd() as u32).to_ne_bytes());
    // SAFETY: bpf(2) reads `pin`, a live buffer of the size passed; `c_path` outlives the
    // call. The pin keeps the map when `fd` closes.
    let pinned = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_PIN, pin.as_ptr(), pin.len()) };
    assert_eq!(
        pinned,
        0,
        "BPF_OBJ_PIN: {}",
        std::io::Error::last_os_error()
    );
}
