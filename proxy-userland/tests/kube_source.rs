//! The Kubernetes source end to end: the `fastpath` daemon watches the in-repo test API
//! server over real HTTP list/watch (through kube-rs, exactly as with a cluster), and real
//! connections in the test bed show the kernel following every change, including across a
//! dropped watch and a 410 Gone relist.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use xtask::apiserver::ApiServer;

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

    let kubeconfig =
        std::env::temp_dir().join(format!("fastpath-kube-{}.yaml", std::process::id()));
    api.write_kubeconfig(&kubeconfig).unwrap();
    struct Rm(std::path::PathBuf);
    impl Drop for Rm {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _rm = Rm(kubeconfig.clone());
    let mut daemon = Daemon::start(
        bed.cgroup_path(),
        &["--kubeconfig", kubeconfig.to_str().unwrap()],
    );

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
        api.wait_for_watches(3, Duration::from_secs(10)),
        "three watches open"
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
