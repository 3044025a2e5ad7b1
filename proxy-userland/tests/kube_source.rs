//! The Kubernetes source end to end: the `fastpath` daemon watches the in-repo test API
//! server over real HTTP list/watch (through kube-rs, exactly as with a cluster), and real
//! connections in the test bed show the kernel following every change, including across a
//! dropped watch and a 410 Gone relist.

mod common;
mod nat_common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use xtask::{
    apiserver::ApiServer,
    testbed::{Pod, Testbed},
};

fn service(name: &str, ip: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "demo"},
        "spec": {
            "type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]
        }
    })
}

fn slice(name: &str, service: &str, ips: &[&str]) -> Value {
    let endpoints: Vec<Value> = ips
        .iter()
        .map(|ip| json!({"addresses": [ip], "conditions": {"ready": true}, "nodeName": "node-a"}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "demo", "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints
    })
}

fn node() -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "zone-a"}}})
}

const POD1: &str = "198.18.1.11";
const POD2: &str = "198.18.1.12";
const POD3: &str = "198.18.1.13";

#[test]
fn daemon_follows_the_api_server_through_watch_drops_and_410() {
    let (bed, _pods) = bed_with_pods("kube", 3);
    let api = ApiServer::start().expect("test API server");
    api.set_bookmark_interval(Duration::from_millis(200));
    api.create("nodes", node());
    api.create("services", service("web", "198.19.0.10"));
    api.create("endpointslices", slice("web-1", "web", &[POD1, POD2]));
    api.create("endpointslices", slice("web-2", "web", &[POD3]));
    // Another proxy's service and a headless one are not ours.
    let mut other = service("other", "198.19.0.30");
    other["metadata"]["labels"] =
        json!({"service.kubernetes.io/service-proxy-name": "someone-else"});
    api.create("services", other);
    api.create("endpointslices", slice("other-1", "other", &[POD1]));

    let kubeconfig = Kubeconfig::new(&api, "kube");
    let mut daemon = Daemon::start(bed.cgroup_path(), &["--kubeconfig", kubeconfig.path()]);

    // A service split over two slices reaches all three pods.
    assert!(
        eventually(20, || reached(&tcp(&bed, "198.19.0.10:80", 40)).len() == 3),
        "web never reached all three pods; log:\n{}",
        daemon.log()
    );
    assert!(
        !tcp(&bed, "198.19.0.30:80", 1)[0].is_ok(),
        "another proxy's service is not ours"
    );

    // An endpoint leaves: new connections stop reaching it.
    api.update("endpointslices", slice("web-2", "web", &[]));
    assert!(
        eventually(10, || !reached(&tcp(&bed, "198.19.0.10:80", 30))
            .contains("pod-3")),
        "pod-3 still reached; log:\n{}",
        daemon.log()
    );

    // A new service appears.
    api.create("services", service("api", "198.19.0.20"));
    api.create("endpointslices", slice("api-1", "api", &[POD2]));
    assert!(eventually(10, || tcp(&bed, "198.19.0.20:80", 1)[0].reply()
        == Some("pod-2")));

    // The watches drop after history was compacted past what the proxy has seen, so each
    // watcher's resume gets 410 Gone and must relist; changes made meanwhile must end up
    // programmed with no stale entries, whichever path delivers them.
    assert!(
        api.wait_for_watches(4, Duration::from_secs(10)),
        "four watches open (Services, EndpointSlices, the Node, ServiceCIDRs)"
    );
    api.set_bookmark_interval(Duration::ZERO);
    std::thread::sleep(Duration::from_millis(300));
    let mut node_b = node();
    node_b["metadata"]["name"] = json!("node-b");
    api.create("nodes", node_b);
    api.compact();
    api.clear_requests();
    api.drop_watches();
    api.delete("services", Some("demo"), "api");
    api.delete("endpointslices", Some("demo"), "api-1");
    api.update("endpointslices", slice("web-1", "web", &[POD1]));
    assert!(
        eventually(20, || {
            let web = reached(&tcp(&bed, "198.19.0.10:80", 20));
            web.len() == 1 && web.contains("pod-1") && !tcp(&bed, "198.19.0.20:80", 1)[0].is_ok()
        }),
        "after the relist web should use pod-1 only and api be gone; log:\n{}",
        daemon.log()
    );
    // Both kinds relist; the slices' relist may land before the services' does.
    let relisted = |path: &str| {
        api.requests()
            .iter()
            .any(|r| r.starts_with(&format!("GET {path}")) && !r.contains("watch=true"))
    };
    assert!(
        eventually(20, || relisted("/api/v1/services")
            && relisted("/apis/discovery.k8s.io/v1/endpointslices")),
        "the proxy relisted after 410: {:?}",
        api.requests()
    );

    let status = daemon.stop();
    assert!(status.success(), "{status:?}\n{}", daemon.log());
}

#[test]
fn a_bad_kubeconfig_fails_clearly_and_touches_nothing() {
    let (bed, _pods) = bed_with_pods("kubebad", 1);
    let path = std::env::temp_dir().join(format!("fastpath-badkube-{}.yaml", std::process::id()));
    std::fs::write(&path, "this: is: not a kubeconfig").unwrap();
    let mut daemon = Daemon::start(bed.cgroup_path(), &["--kubeconfig", path.to_str().unwrap()]);
    let status = daemon
        .wait_exit(10)
        .expect("fastpath exits by itself on a bad kubeconfig");
    let _ = std::fs::remove_file(&path);
    assert!(!status.success());
    let log = daemon.log();
    assert!(
        log.contains("kubeconfig"),
        "the error names the kubeconfig:\n{log}"
    );
    assert!(
        !log.contains("attached"),
        "nothing was attached before the source was ready:\n{log}"
    );
}

/// Writes a kubeconfig for `api` and removes it on drop.
struct Kubeconfig(std::path::PathBuf);

impl Kubeconfig {
    fn new(api: &ApiServer, tag: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("fastpath-kube-{tag}-{}.yaml", std::process::id()));
        api.write_kubeconfig(&path).unwrap();
        Kubeconfig(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for Kubeconfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// One connection attempt with a short timeout: the pod that answered, if any.
fn answer(bed: &xtask::testbed::Testbed, target: &str) -> Option<String> {
    run_probe(bed, &["tcp", target, "--count", "1", "--timeout-ms", "300"])[0]
        .reply()
        .map(str::to_string)
}

/// The API server goes away for 30 s (a control-plane upgrade); meanwhile a service is
/// deleted, another created, and the history compacted, so the proxy's watches come back
/// to a 410 Gone. Everything, including a change made right after the return, must be in
/// effect within 5 s of the server's return: the watchers retry at most 2 s apart and
/// relist at once after the 410, instead of applying a backoff grown during the outage.
#[test]
fn changes_made_during_an_api_server_outage_apply_within_5s_of_its_return() {
    let (bed, _pods) = bed_with_pods("kubeout", 3);
    let api = ApiServer::start().expect("test API server");
    api.create("nodes", node());
    api.create("services", service("web", "198.19.0.10"));
    api.create("endpointslices", slice("web-1", "web", &[POD1]));
    api.create("services", service("old", "198.19.0.30"));
    api.create("endpointslices", slice("old-1", "old", &[POD2]));
    let kubeconfig = Kubeconfig::new(&api, "outage");
    let mut daemon = Daemon::start(bed.cgroup_path(), &["--kubeconfig", kubeconfig.path()]);
    assert!(
        eventually(20, || answer(&bed, "198.19.0.10:80").as_deref()
            == Some("pod-1")
            && answer(&bed, "198.19.0.30:80").as_deref() == Some("pod-2")),
        "web and old never answered; log:\n{}",
        daemon.log()
    );
    assert!(
        api.wait_for_watches(3, Duration::from_secs(10)),
        "three watches open"
    );

    assert!(api.stop_listening(), "the API server's port closes");
    let outage = std::time::Instant::now();
    api.delete("services", Some("demo"), "old");
    api.delete("endpointslices", Some("demo"), "old-1");
    api.create("services", service("new", "198.19.0.20"));
    api.create("endpointslices", slice("new-1", "new", &[POD3]));
    api.compact();
    // What was programmed keeps working while the server is away.
    assert_eq!(answer(&bed, "198.19.0.10:80").as_deref(), Some("pod-1"));
    std::thread::sleep(Duration::from_secs(30).saturating_sub(outage.elapsed()));

    api.clear_requests();
    assert!(api.start_listening(), "the API server's port opens again");
    let back = std::time::Instant::now();
    api.create("services", service("after", "198.19.0.40"));
    api.create("endpointslices", slice("after-1", "after", &[POD1]));
    let all_in_effect = || {
        answer(&bed, "198.19.0.20:80").as_deref() == Some("pod-3")
            && answer(&bed, "198.19.0.40:80").as_deref() == Some("pod-1")
            && answer(&bed, "198.19.0.30:80").is_none()
            && answer(&bed, "198.19.0.10:80").as_deref() == Some("pod-1")
    };
    let mut took = None;
    while back.elapsed() < Duration::from_secs(20) {
        if all_in_effect() {
            took = Some(back.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("changes in effect {took:?} after the API server's return");
    let took = took.unwrap_or_else(|| panic!("never in effect; log:\n{}", daemon.log()));
    assert!(
        took <= Duration::from_secs(5),
        "in effect {took:?} after the return, over 5 s; requests: {:?}\nlog:\n{}",
        api.requests(),
        daemon.log()
    );
    // The way back was a relist (the history was compacted).
    assert!(
        api.requests()
            .iter()
            .any(|r| r.starts_with("GET /api/v1/services") && !r.contains("watch=true")),
        "{:?}",
        api.requests()
    );
    assert!(daemon.stop().success(), "{}", daemon.log());
}

/// curl http://127.0.0.1:port/path: (status, JSON body).
fn curl_json(port: u16, path: &str) -> Option<(u16, Value)> {
    let out = std::process::Command::new("curl")
        .args([
            "-sS",
            "-m",
            "2",
            "-w",
            "\n%{http_code}",
            &format!("http://127.0.0.1:{port}{path}"),
        ])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n')?;
    Some((code.trim().parse().ok()?, serde_json::from_str(body).ok()?))
}

/// kubectl patch, as an operator or the cluster autoscaler would: a merge patch of the Node.
fn patch_node(api: &ApiServer, patch: Value) {
    let out = std::process::Command::new("curl")
        .args([
            "-sS",
            "-m",
            "5",
            "-X",
            "PATCH",
            "-H",
            "Content-Type: application/merge-patch+json",
        ])
        .args([
            "--data",
            &patch.to_string(),
            &format!("{}/api/v1/nodes/node-a", api.url()),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// kube-proxy's node eligibility through the real daemon: the cluster autoscaler's
/// ToBeDeletedByClusterAutoscaler taint, and then a deletionTimestamp, turn /healthz to 503
/// with `nodeEligible: false` so that load balancers drain the node, while /livez stays
/// 200 (restarting the proxy would not help).
#[test]
fn healthz_reports_a_node_being_deleted_as_not_eligible() {
    let (bed, _pods) = bed_with_pods("kubenode", 1);
    let api = ApiServer::start().expect("test API server");
    api.create("nodes", node());
    api.create("services", service("web", "198.19.0.10"));
    api.create("endpointslices", slice("web-1", "web", &[POD1]));
    let kubeconfig = Kubeconfig::new(&api, "node");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let bind = format!("127.0.0.1:{port}");
    let mut daemon = Daemon::start(
        bed.cgroup_path(),
        &[
            "--kubeconfig",
            kubeconfig.path(),
            "--healthz-bind-address",
            &bind,
        ],
    );
    let healthz = |code: u16, eligible: bool| {
        curl_json(port, "/healthz").is_some_and(|(c, v)| c == code && v["nodeEligible"] == eligible)
    };
    let livez_ok = || curl_json(port, "/livez").is_some_and(|(c, _)| c == 200);
    assert!(
        eventually(20, || answer(&bed, "198.19.0.10:80").as_deref()
            == Some("pod-1")),
        "web never answered; log:\n{}",
        daemon.log()
    );
    assert!(
        eventually(10, || healthz(200, true) && livez_ok()),
        "/healthz never 200 with nodeEligible true: {:?}\nlog:\n{}",
        curl_json(port, "/healthz"),
        daemon.log()
    );

    let taint = json!({"spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "value": "1700000000", "effect": "NoSchedule"}]}});
    patch_node(&api, taint);
    assert!(
        eventually(10, || healthz(503, false)),
        "tainted: /healthz {:?}\nlog:\n{}",
        curl_json(port, "/healthz"),
        daemon.log()
    );
    assert!(
        livez_ok(),
        "/livez stays 200: {:?}",
        curl_json(port, "/livez")
    );

    // Another taint is no reason to drain the node.
    patch_node(
        &api,
        json!({"spec": {"taints": [{"key": "example.com/other", "effect": "NoSchedule"}]}}),
    );
    assert!(
        eventually(10, || healthz(200, true)),
        "{:?}",
        curl_json(port, "/healthz")
    );

    patch_node(
        &api,
        json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}),
    );
    assert!(
        eventually(10, || healthz(503, false)),
        "being deleted: /healthz {:?}\nlog:\n{}",
        curl_json(port, "/healthz"),
        daemon.log()
    );
    assert!(
        livez_ok(),
        "/livez stays 200: {:?}",
        curl_json(port, "/livez")
    );
    // Services keep working on a node that is being drained.
    assert!(
        eventually(5, || answer(&bed, "198.19.0.10:80").as_deref()
            == Some("pod-1")),
        "web stopped answering; log:\n{}",
        daemon.log()
    );
    assert!(daemon.stop().success(), "{}", daemon.log());
}

/// `trafficDistribution: PreferSameNode` through the API server: the slice's
/// `hints.forNodes` reach the proxy (kube-rs and the in-repo API server carry them), which
/// keeps node-a's clients on node-a's endpoint, and falls back to its zone's endpoints once
/// no endpoint is hinted for node-a.
#[test]
fn prefer_same_node_hints_come_through_the_api_server() {
    let (bed, _pods) = bed_with_pods("kpsn", 3);
    let api = ApiServer::start().expect("test API server");
    api.create("nodes", node());
    let mut svc = service("web", "198.19.0.10");
    svc["spec"]["trafficDistribution"] = json!("PreferSameNode");
    api.create("services", svc);
    let hinted = |nodes: [&str; 3]| {
        let mut s = slice("web-1", "web", &[POD1, POD2, POD3]);
        let zones = ["zone-a", "zone-a", "zone-b"];
        for (i, ep) in s["endpoints"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .enumerate()
        {
            ep["nodeName"] = json!(nodes[i]);
            ep["zone"] = json!(zones[i]);
            ep["hints"] =
                json!({"forZones": [{"name": zones[i]}], "forNodes": [{"name": nodes[i]}]});
        }
        s
    };
    api.create("endpointslices", hinted(["node-a", "node-b", "node-c"]));

    let kubeconfig = Kubeconfig::new(&api, "kpsn");
    let daemon = Daemon::start(bed.cgroup_path(), &["--kubeconfig", kubeconfig.path()]);
    let only = |want: &[&str]| {
        let got = reached(&tcp(&bed, "198.19.0.10:80", 20));
        got == want.iter().map(|s| s.to_string()).collect()
    };
    assert!(
        eventually(20, || only(&["pod-1"])),
        "node-a's clients should reach its own pod-1 only; log:\n{}",
        daemon.log()
    );
    // pod-1 moves to node-e (as the controller would hint it): no endpoint for node-a.
    api.update("endpointslices", hinted(["node-e", "node-b", "node-c"]));
    assert!(
        eventually(20, || only(&["pod-1", "pod-2"])),
        "without an endpoint for node-a, zone-a's pod-1 and pod-2; log:\n{}",
        daemon.log()
    );
}

/// A bed whose daemon reads `api` (given a Node and Service web at 198.19.0.10 with pod-1)
/// with `--service-cluster-ip-range 198.19.0.0/24`, once web serves.
fn web_with_service_range(tag: &str, api: &ApiServer) -> (Testbed, Vec<Pod>, Kubeconfig, Daemon) {
    let (bed, pods) = bed_with_pods(tag, 1);
    api.create("nodes", node());
    api.create("services", service("web", "198.19.0.10"));
    api.create("endpointslices", slice("web-1", "web", &[POD1]));
    let kubeconfig = Kubeconfig::new(api, tag);
    let daemon = Daemon::start(
        bed.cgroup_path(),
        &[
            "--kubeconfig",
            kubeconfig.path(),
            "--service-cluster-ip-range",
            "198.19.0.0/24",
        ],
    );
    assert!(
        eventually(20, || tcp(&bed, "198.19.0.10:80", 1)[0].reply()
            == Some("pod-1")),
        "web never served; log:\n{}",
        daemon.log()
    );
    (bed, pods, kubeconfig, daemon)
}

/// Whether a connect to `target` from the bed's client is refused at once.
fn refused(bed: &Testbed, target: &str) -> bool {
    let out = run_probe(bed, &["tcp", target, "--count", "1", "--timeout-ms", "300"]);
    out[0].errno() == Some("ECONNREFUSED")
}

/// A ServiceCIDR object widens the service ranges beyond `--service-cluster-ip-range`:
/// once the API server has it, an address of its range that no Service holds is refused
/// at connect; when it is deleted, that address is left alone again. The flag's range is
/// refused throughout.
#[test]
fn a_service_cidr_from_the_api_server_widens_the_service_ranges() {
    let api = ApiServer::start().expect("test API server");
    let (bed, _pods, _kubeconfig, daemon) = web_with_service_range("kscidr", &api);
    let refused = |target: &str| refused(&bed, target);
    assert!(refused("198.19.0.99:80"), "the flag's range is refused");
    assert!(!refused("198.19.1.99:80"), "not in any range yet");

    api.create(
        "servicecidrs",
        json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
            "metadata": {"name": "extra"},
            "spec": {"cidrs": ["198.19.1.0/24", "2001:db8:ff01::/112"]}
        }),
    );
    assert!(
        eventually(10, || refused("198.19.1.99:80")),
        "the ServiceCIDR's range is refused; log:
{}",
        daemon.log()
    );
    assert!(refused("[2001:db8:ff01::99]:80"), "and its IPv6 range");
    assert!(
        daemon.log().contains("service ranges changed"),
        "{}",
        daemon.log()
    );

    api.delete("servicecidrs", None, "extra");
    assert!(
        eventually(10, || !refused("198.19.1.99:80")),
        "a deleted ServiceCIDR's range is left alone; log:
{}",
        daemon.log()
    );
    assert!(refused("198.19.0.99:80"), "the flag's range stays");
}

/// An API server from before ServiceCIDRs (Kubernetes 1.32 and older answers 404 for
/// them): the daemon says so once, becomes ready, and the service ranges are
/// `--service-cluster-ip-range` alone, refused as before.
#[test]
fn an_api_server_without_service_cidrs_leaves_the_flags_ranges() {
    let api = ApiServer::start().expect("test API server");
    api.hide("servicecidrs");
    let (bed, _pods, _kubeconfig, daemon) = web_with_service_range("knocidr", &api);
    let refused = |target: &str| refused(&bed, target);
    assert!(refused("198.19.0.99:80"), "the flag's range is refused");
    assert!(!refused("198.19.1.99:80"), "outside every range");
    let log = daemon.log();
    assert!(
        log.contains("the API server has no ServiceCIDR objects"),
        "the daemon should say why only the flag counts; log:\n{log}"
    );
    assert!(
        !log.contains("watching ServiceCIDRs"),
        "a missing resource is not an error to retry; log:\n{log}"
    );
    assert!(
        api.requests()
            .iter()
            .filter(|r| r.contains("servicecidrs"))
            .count()
            <= 2,
        "the daemon should stop asking for ServiceCIDRs: {:?}",
        api.requests()
    );
}

/// `--detect-local-mode NodeCIDR` in the iptables mode: the Node's `spec.podCIDRs` are what
/// tells pods' traffic apart (traffic to a cluster IP from elsewhere is masqueraded), as
/// kube-proxy's NodeCIDR detector; and the service works.
#[test]
fn detect_local_mode_node_cidr_uses_the_nodes_pod_cidrs() {
    let (bed, _pods) = bed_with_pods("kncidr", 1);
    nat_common::route_services(&bed);
    let api = ApiServer::start().expect("test API server");
    let mut n = node();
    n["spec"] = json!({"podCIDRs": ["198.18.1.0/24"], "podCIDR": "198.18.1.0/24"});
    api.create("nodes", n);
    api.create("services", service("web", "198.19.0.10"));
    api.create("endpointslices", slice("web-1", "web", &[POD1]));
    let kubeconfig = Kubeconfig::new(&api, "kncidr");
    let daemon = Daemon::start(
        bed.cgroup_path(),
        &[
            "--kubeconfig",
            kubeconfig.path(),
            "--proxy-mode",
            "iptables",
            "--netns",
            bed.node_netns(),
            "--detect-local-mode",
            "NodeCIDR",
            "--cleanup-on-exit",
        ],
    );
    assert!(
        eventually(20, || tcp(&bed, "198.19.0.10:80", 1)[0].reply()
            == Some("pod-1")),
        "web never answered; log:\n{}",
        daemon.log()
    );
    let save = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            bed.node_netns(),
            "iptables-save",
            "-t",
            "nat",
        ])
        .output()
        .expect("iptables-save");
    let rules = String::from_utf8_lossy(&save.stdout);
    assert!(
        rules.lines().any(|l| l.starts_with("-A KUBE-SVC-")
            && l.contains("! -s 198.18.1.0/24 ")
            && l.ends_with("-j KUBE-MARK-MASQ")),
        "masquerade for sources outside the Node's pod CIDR:\n{rules}"
    );
    assert!(
        daemon.log().contains("pod_cidrs"),
        "the pod CIDRs are logged:\n{}",
        daemon.log()
    );
}

/// An EndpointSlice the API server serves in a shape no Kubernetes version writes (an
/// address that is not a list) is reported on its own: it is logged with its name, and the
/// rest of the list is programmed. Decoded as part of its list page, it failed the whole
/// page, so the first list never finished and nothing was programmed. Fixed through the
/// watch, it is programmed.
#[test]
fn a_malformed_slice_from_the_api_server_fails_alone() {
    let (bed, _pods) = bed_with_pods("kbad", 2);
    let api = ApiServer::start().expect("test API server");
    api.create("nodes", node());
    api.create("services", service("web", "198.19.0.10"));
    api.create("endpointslices", slice("web-1", "web", &[POD1]));
    api.create("services", service("other", "198.19.0.20"));
    let mut bad = slice("other-1", "other", &[POD2]);
    bad["endpoints"][0]["addresses"] = json!(POD2);
    api.create("endpointslices", bad);

    let kubeconfig = Kubeconfig::new(&api, "kbad");
    let mut daemon = Daemon::start(bed.cgroup_path(), &["--kubeconfig", kubeconfig.path()]);
    assert!(
        eventually(20, || answer(&bed, "198.19.0.10:80").as_deref()
            == Some("pod-1")),
        "web should be served beside the malformed slice; log:\n{}",
        daemon.log()
    );
    let log = daemon.log();
    assert!(
        log.lines()
            .any(|l| l.contains("EndpointSlice demo/other-1 cannot be decoded")),
        "the malformed slice is named in the log:\n{log}"
    );
    assert_eq!(
        answer(&bed, "198.19.0.20:80"),
        None,
        "other has no usable endpoint yet"
    );
    api.update("endpointslices", slice("other-1", "other", &[POD2]));
    assert!(
        eventually(20, || answer(&bed, "198.19.0.20:80").as_deref()
            == Some("pod-2")),
        "the fixed slice is programmed; log:\n{}",
        daemon.log()
    );
    assert!(daemon.stop().success(), "{}", daemon.log());
}
