//! `fastpath inspect` in iptables mode reads what the kernel holds, not the daemon's model:
//! `inspect services` lists the backends the KUBE-SVC/KUBE-SEP chains DNAT to (with their
//! shares and affinity) and `inspect flows` the conntrack entries of real connections, each
//! naming the backend the connection really reached. A balancing rule deleted behind the
//! daemon's back shows as a difference from the model, and real connections follow the rules.

mod common;
mod inspect_common;
mod nat_common;

use std::{collections::BTreeSet, process::Command};

use common::*;
use inspect_common::*;
use serde_json::Value;

/// demo/web: pod-1 (here) and pod-2 (node-b) ready; demo/sticky: the same pods with
/// ClientIP affinity.
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
---
apiVersion: v1
kind: Service
metadata: {name: sticky, namespace: demo}
spec:
  clusterIP: 198.19.0.13
  clusterIPs: [198.19.0.13]
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 300}}
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: sticky-1, namespace: demo, labels: {kubernetes.io/service-name: sticky}}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
endpoints:
- {addresses: [198.18.1.11], conditions: {ready: true}, nodeName: node-a}
- {addresses: [198.18.1.12], conditions: {ready: true}, nodeName: node-b}
"#;

const STICKY: &str = "198.19.0.13:80";

/// The backend address of pod `pod-N` (198.18.1.(10+N):8080).
fn pod_backend(name: &str) -> String {
    let n: u8 = name.strip_prefix("pod-").unwrap().parse().unwrap();
    format!("{}:8080", pod_ip(n))
}

/// Each connection has a conntrack flow from the client the pod saw (or to it, as the
/// SNAT address), to `frontend`, on the pod that answered.
fn assert_flows_match(
    flows: &Value,
    outcomes: &[xtask::probe::Outcome],
    frontend: &str,
    service: &str,
) -> Vec<Value> {
    let mut matched = Vec::new();
    for o in outcomes {
        let (name, seen) = (o.name().unwrap(), o.seen_from().unwrap());
        let found = flows.as_array().unwrap().iter().find(|f| {
            f["frontend"] == frontend
                && (f["client"] == seen || f["snat"] == seen)
                && f["proto"] == "TCP"
        });
        let f = found.unwrap_or_else(|| panic!("no flow for {seen} -> {frontend}: {flows:#}"));
        assert_eq!(f["backend"], pod_backend(name).as_str(), "{f}");
        assert_eq!(f["service"], service, "{f}");
        assert!(f["expires_secs"].as_u64().is_some(), "{f}");
        matched.push(f.clone());
    }
    matched
}

#[test]
fn inspect_in_iptables_mode_shows_the_rules_and_conntrack_and_tampering() {
    let (bed, _pods) = bed_with_echoing_pods("inspipt", 2);
    nat_common::route_services(&bed);
    std::fs::write(bed.dir().join("svc.yaml"), MANIFESTS).unwrap();
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
            // No periodic resync during the test: the rule deleted below stays deleted. The
            // rules go with the bed's namespace.
            "--sync-period",
            "1h",
        ],
    );
    let services = || json(&["inspect", "services", "--admin", &admin]);
    let synced = || {
        xtask::seccomp::command(FASTPATH)
            .args(["inspect", "services", "--admin", &admin, "-o", "json"])
            .output()
            .ok()
            .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok())
            .and_then(|v| v.as_array().cloned())
            .is_some_and(|rows| {
                rows.iter().filter(|r| r["in_sync"] == true).count() == 2
                    && rows
                        .iter()
                        .all(|r| !r["backends"].as_array().unwrap().is_empty())
            })
    };
    assert!(
        eventually(30, synced),
        "inspect never saw both services programmed; log:\n{}",
        daemon.log()
    );

    // The rules' view: both pods at half the new connections each, through the chains
    // iptables-save shows for the service.
    let rows = services();
    let web = row(&rows, "198.19.0.10:80/TCP");
    let want: BTreeSet<String> = ["198.18.1.11:8080", "198.18.1.12:8080"]
        .map(String::from)
        .into();
    assert_eq!(addresses(web), want, "{web:#}");
    assert_eq!(web["service"], "demo/web:http");
    assert!(web["difference"].is_null(), "{web:#}");
    for b in web["backends"].as_array().unwrap() {
        assert_eq!(b["probability"], 0.5, "{b}");
        assert!(b["chain"].as_str().unwrap().starts_with("KUBE-SEP-"), "{b}");
    }
    let chain = web["chain"].as_str().unwrap().to_string();
    assert!(chain.starts_with("KUBE-SVC-"), "{chain}");
    let saved = nat_common::saved(&ns, "iptables-save");
    assert!(
        saved
            .lines()
            .any(|l| l.contains("demo/web:http cluster IP") && l.ends_with(&format!("-j {chain}"))),
        "{chain} not in:\n{saved}"
    );
    let ex = json(&["explain", "tcp", WEB, "--admin", &admin]);
    assert_eq!(
        ex["programmed"],
        serde_json::json!(["198.18.1.11:8080", "198.18.1.12:8080"]),
        "{ex:#}"
    );
    let sticky = row(&rows, "198.19.0.13:80/TCP");
    assert_eq!(sticky["affinity_timeout"], 300, "{sticky:#}");
    assert_eq!(addresses(sticky), want);

    // Real connections land within the rules' backends, and each has its conntrack flow
    // naming the pod it reached.
    let web_conns = tcp(&bed, WEB, 20);
    assert!(web_conns.iter().all(|o| o.is_ok()), "{web_conns:?}");
    let reached: BTreeSet<String> = web_conns
        .iter()
        .map(|o| pod_backend(o.name().unwrap()))
        .collect();
    assert_eq!(reached, want, "connections vs inspect's backends");
    let sticky_conns = tcp(&bed, STICKY, 10);
    let stuck: BTreeSet<&str> = sticky_conns.iter().filter_map(|o| o.name()).collect();
    assert_eq!(
        stuck.len(),
        1,
        "ClientIP affinity: one pod: {sticky_conns:?}"
    );
    let flows = json(&["inspect", "flows", "--admin", &admin]);
    assert_flows_match(&flows, &web_conns, WEB, "demo/web:http");
    assert_flows_match(&flows, &sticky_conns, STICKY, "demo/sticky:http");
    // The affinity the sticky connections left: the `recent` list of the pod they stuck to.
    let affinity = json(&["inspect", "affinity", "--admin", &admin]);
    let client = sticky_conns[0]
        .seen_from()
        .unwrap()
        .rsplit_once(':')
        .unwrap()
        .0;
    let stuck_to = pod_backend(stuck.iter().next().unwrap());
    let entries = affinity.as_array().unwrap();
    assert_eq!(entries.len(), 1, "{affinity:#}");
    assert_eq!(entries[0]["client"], client, "{affinity:#}");
    assert_eq!(entries[0]["backend"], stuck_to.as_str(), "{affinity:#}");
    assert_eq!(entries[0]["frontend"], "198.19.0.13:80/TCP");
    assert_eq!(entries[0]["service"], "demo/sticky:http");
    assert_eq!(entries[0]["timeout_secs"], 300);
    eprintln!(
        "$ fastpath inspect affinity\n{}",
        tool(&["inspect", "affinity", "--admin", &admin])
    );
    let table = tool(&["inspect", "flows", "--admin", &admin]);
    assert!(
        table.starts_with("PROTO") && table.contains("EXPIRES"),
        "{table}"
    );
    eprintln!(
        "$ fastpath inspect flows\n{}",
        table.lines().take(4).collect::<Vec<_>>().join("\n")
    );
    eprintln!(
        "$ fastpath inspect services\n{}",
        tool(&["inspect", "services", "--admin", &admin])
    );

    // Behind the daemon's back: pod-1's balancing rule goes. The rules now send everything
    // to pod-2; inspect says so and how that differs from the model, and so do real packets.
    let rule = saved
        .lines()
        .find(|l| l.starts_with(&format!("-A {chain} ")) && l.contains("-> 198.18.1.11:8080"))
        .unwrap_or_else(|| panic!("no balancing rule for pod-1 in:\n{saved}"))
        .to_string();
    let deleted = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ip netns exec {ns} iptables -t nat -D {}",
            &rule[3..]
        ))
        .status()
        .unwrap();
    assert!(deleted.success(), "cannot delete {rule}");
    let rows = services();
    let web = row(&rows, "198.19.0.10:80/TCP");
    assert_eq!(
        addresses(web),
        ["198.18.1.12:8080".to_string()].into(),
        "{web:#}"
    );
    assert_eq!(web["backends"][0]["probability"], 1.0, "{web:#}");
    assert_eq!(web["in_sync"], false);
    let diff = web["difference"].as_str().unwrap();
    assert!(diff.contains("programmed: 1 backend, model: 2"), "{diff}");
    assert!(diff.contains("not programmed: 198.18.1.11:8080"), "{diff}");
    assert_eq!(row(&rows, "198.19.0.13:80/TCP")["in_sync"], true);
    let table = tool(&["inspect", "services", "--admin", &admin]);
    assert!(
        table.contains("198.19.0.10:80/TCP differs: programmed: 1 backend, model: 2"),
        "{table}"
    );
    eprintln!("$ fastpath inspect services   # after the rule was deleted\n{table}");
    // explain answers from the model, and says the rules differ.
    let ex = json(&["explain", "tcp", WEB, "--admin", &admin]);
    assert_eq!(
        ex["programmed"],
        serde_json::json!(["198.18.1.12:8080"]),
        "{ex:#}"
    );
    assert!(
        ex["detail"].as_str().unwrap().contains("the rules send"),
        "{ex:#}"
    );
    let text = tool(&["explain", "tcp", WEB, "--admin", &admin]);
    eprintln!("$ fastpath explain tcp {WEB}   # after the rule was deleted\n{text}");
    let after = tcp(&bed, WEB, 10);
    assert!(after.iter().all(|o| o.name() == Some("pod-2")), "{after:?}");

    // Without the daemon, the rules alone still answer, by address and comment.
    daemon.stop();
    let out = xtask::seccomp::command(FASTPATH)
        .args([
            "inspect",
            "services",
            "--admin",
            "127.0.0.1:1",
            "--netns",
            &ns,
            "-o",
            "json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Value = serde_json::from_slice(&out.stdout).unwrap();
    let web = row(&rows, "198.19.0.10:80/TCP");
    assert_eq!(web["service"], "demo/web:http");
    assert_eq!(addresses(web), ["198.18.1.12:8080".to_string()].into());
}

/// Node ports from another host: externalTrafficPolicy Local through KUBE-EXT to the
/// KUBE-SVL chain (this node's pod only, the client's address kept), Cluster through
/// KUBE-SVC to both pods, masqueraded. Every frontend's rules agree with the model, real
/// connections land where inspect says, and their conntrack flows show the SNAT.
#[test]
fn inspect_in_iptables_mode_follows_node_ports_from_another_host() {
    let (mut bed, _pods) = bed_with_echoing_pods("inspiptnp", 2);
    let ext = nat_common::external_client(&mut bed);
    let node_port = |name: &str, ip: &str, port: u16, policy: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: demo}}\nspec:\n  \
             type: NodePort\n  clusterIP: {ip}\n  clusterIPs: [{ip}]\n  externalTrafficPolicy: {policy}\n  \
             ports:\n  - {{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: {port}}}\n---\n\
             apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: demo, \
             labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\n\
             ports:\n- {{name: http, port: 8080, protocol: TCP}}\nendpoints:\n\
             - {{addresses: [198.18.1.11], conditions: {{ready: true}}, nodeName: node-a}}\n\
             - {{addresses: [198.18.1.12], conditions: {{ready: true}}, nodeName: node-b}}\n---\n"
        )
    };
    let manifests = node_port("npc", "198.19.0.20", 30080, "Cluster")
        + &node_port("npl", "198.19.0.21", 30081, "Local");
    std::fs::write(bed.dir().join("svc.yaml"), manifests).unwrap();
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
        ],
    );
    let node_ip = bed.node_ipv4().to_string();
    let from_ext = |port: u16, count: usize| {
        nat_common::probe_from(
            &ext.netns,
            &[
                "tcp",
                &format!("{node_ip}:{port}"),
                "--count",
                &count.to_string(),
                "--timeout-ms",
                "2000",
            ],
        )
    };
    assert!(
        eventually(30, || from_ext(30081, 1)[0].is_ok()),
        "the node port never answered; log:\n{}",
        daemon.log()
    );

    // Every frontend's rules agree with the model.
    let rows = services_in_sync(&admin, 10);
    let local = row(&rows, "<node>:30081/TCP (external)");
    assert_eq!(
        addresses(local),
        ["198.18.1.11:8080".to_string()].into(),
        "{local:#}"
    );
    let chain = local["chain"].as_str().unwrap();
    assert!(
        chain.starts_with("KUBE-EXT-") && chain.contains(" -> KUBE-SVL-"),
        "{chain}"
    );
    let cluster = row(&rows, "<node>:30080/TCP (external)");
    assert_eq!(addresses(cluster).len(), 2, "{cluster:#}");
    assert!(
        cluster["chain"].as_str().unwrap().contains(" -> KUBE-SVC-"),
        "{cluster:#}"
    );
    let ex = json(&[
        "explain",
        "tcp",
        &format!("{node_ip}:30081"),
        "--from",
        "198.18.2.1",
        "--admin",
        &admin,
    ]);
    assert_eq!(
        ex["programmed"],
        serde_json::json!(["198.18.1.11:8080"]),
        "{ex:#}"
    );
    assert_eq!(ex["eligible"], ex["programmed"], "{ex:#}");

    // Real connections: the Local node port keeps to pod-1 and the client's address...
    let local_conns = from_ext(30081, 10);
    assert!(
        local_conns.iter().all(|o| o.name() == Some("pod-1")),
        "{local_conns:?}"
    );
    // ...the Cluster one reaches both pods, masqueraded.
    let cluster_conns = from_ext(30080, 20);
    let reached: BTreeSet<&str> = cluster_conns.iter().filter_map(|o| o.name()).collect();
    assert_eq!(reached.len(), 2, "{cluster_conns:?}");
    let flows = json(&["inspect", "flows", "--admin", &admin]);
    for f in assert_flows_match(
        &flows,
        &local_conns,
        &format!("{node_ip}:30081"),
        "demo/npl:http",
    ) {
        assert!(
            f["client"].as_str().unwrap().starts_with("198.18.2.1:"),
            "{f}"
        );
        assert!(f["snat"].is_null(), "Local keeps the client's address: {f}");
    }
    for f in assert_flows_match(
        &flows,
        &cluster_conns,
        &format!("{node_ip}:30080"),
        "demo/npc:http",
    ) {
        assert!(
            f["client"].as_str().unwrap().starts_with("198.18.2.1:"),
            "{f}"
        );
        assert!(f["snat"].is_string(), "Cluster masquerades: {f}");
    }
    eprintln!(
        "$ fastpath inspect services\n{}",
        tool(&["inspect", "services", "--admin", &admin])
    );
    let table = tool(&["inspect", "flows", "--admin", &admin]);
    eprintln!(
        "$ fastpath inspect flows\n{}",
        table.lines().take(3).collect::<Vec<_>>().join("\n")
    );
    daemon.stop();
}

/// IPv6: `inspect` reads ip6tables-save and the IPv6 conntrack table the same way, and the
/// flows of real connections to the IPv6 ClusterIP name the pods that answered.
#[test]
fn inspect_in_iptables_mode_reads_ip6tables_and_ipv6_conntrack() {
    let (bed, _pods) = bed_with_dual_stack_pods("inspipt6", 2, &["--echo-peer"]);
    nat_common::route_services(&bed);
    xtask::cmd::ip([
        "-n",
        bed.node_netns(),
        "-6",
        "route",
        "add",
        "2001:db8:ff00::/64",
        "dev",
        "fpsvc0",
    ])
    .expect("IPv6 service route");
    std::fs::write(bed.dir().join("svc.yaml"), web_manifest_dual(&[1, 2])).unwrap();
    let admin = format!("127.0.0.1:{}", free_port());
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
            bed.node_netns(),
        ],
    );
    assert!(
        eventually(30, || tcp(&bed, WEB6, 1)[0].is_ok()),
        "the IPv6 ClusterIP never answered; log:\n{}",
        daemon.log()
    );
    let rows = services_in_sync(&admin, 10);
    let web6 = row(&rows, "[2001:db8:ff00::10]:80/TCP");
    assert_eq!(
        addresses(web6),
        ["[2001:db8:1::11]:8080", "[2001:db8:1::12]:8080"]
            .map(String::from)
            .into(),
        "{web6:#}"
    );
    assert!(web6["chain"].as_str().unwrap().starts_with("KUBE-SVC-"));
    assert_eq!(addresses(row(&rows, "198.19.0.10:80/TCP")).len(), 2);

    let conns = tcp(&bed, WEB6, 20);
    assert!(conns.iter().all(|o| o.is_ok()), "{conns:?}");
    let flows = json(&["inspect", "flows", "--admin", &admin]);
    for o in &conns {
        let seen = o.seen_from().unwrap();
        let f = flows
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["frontend"] == WEB6 && f["client"] == seen)
            .unwrap_or_else(|| panic!("no flow from {seen}: {flows:#}"));
        let n: u8 = o
            .name()
            .unwrap()
            .strip_prefix("pod-")
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(f["backend"], format!("[{}]:8080", pod_ip6(n)), "{f}");
        assert_eq!(f["service"], "demo/web:http", "{f}");
    }
    daemon.stop();
}
