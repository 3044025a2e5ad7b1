//! `--nodeport-addresses primary` through the real `fastpath` binary: node ports answer on
//! the node's primary address only, not on its other addresses, in eBPF mode (the packet
//! path on the client's device), iptables and nftables mode, with a client namespace standing for
//! another host.

mod common;
mod nat_common;

use common::*;
use nat_common::*;
use xtask::testbed::{Pod, Testbed};

const NODE_PORT: u16 = 30080;
/// The node's second address, on the client's device: reachable, but not primary.
const OTHER: &str = "198.18.0.5";

/// `demo/web` with node port 30080 on its TCP port, served by pod-1.
fn manifest() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: demo}}\nspec:\n  \
         type: NodePort\n  clusterIP: 198.19.0.10\n  ports:\n  \
         - {{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: {NODE_PORT}}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-abc\n  \
         namespace: demo\n  labels: {{kubernetes.io/service-name: web}}\naddressType: IPv4\n\
         ports:\n- {{name: http, port: 8080, protocol: TCP}}\nendpoints:\n\
         - addresses: [\"{}\"]\n  conditions: {{ready: true}}\n  nodeName: node-a\n",
        pod_ip(1)
    )
}

/// A bed with pod-1, an outside client, and the node's second address on its device.
fn bed(tag: &str) -> (Testbed, Vec<Pod>, Pod) {
    let (mut bed, pods) = bed_with_pods(tag, 1);
    let ext = external_client(&mut bed);
    xtask::cmd::ip([
        "-n",
        bed.node_netns(),
        "addr",
        "add",
        &format!("{OTHER}/32"),
        "dev",
        &ext.node_veth,
    ])
    .expect("second node address");
    std::fs::write(bed.dir().join("manifests.yaml"), manifest()).unwrap();
    (bed, pods, ext)
}

fn daemon(bed: &Testbed, mode: &str, ext: &Pod, extra: &[&str]) -> Daemon {
    let manifests = bed.dir().join("manifests.yaml");
    let mut args = vec![
        "--proxy-mode",
        mode,
        "--netns",
        bed.node_netns(),
        "--manifests",
        manifests.to_str().unwrap(),
        "--nodeport-devices",
        &ext.node_veth,
        "--nodeport-addresses",
        "primary",
    ];
    args.extend_from_slice(extra);
    Daemon::start(bed.cgroup_path(), &args)
}

fn attempt(ext: &Pod, addr: &str) -> xtask::probe::Outcome {
    let target = format!("{addr}:{NODE_PORT}");
    probe_from(
        &ext.netns,
        &["tcp", &target, "--count", "1", "--timeout-ms", "1000"],
    )
    .remove(0)
}

/// The node port answers on `serving` (pod-1) and not on `not_serving`.
fn assert_only_on(d: &Daemon, ext: &Pod, serving: &str, not_serving: &str) {
    assert!(
        eventually(20, || attempt(ext, serving).reply() == Some("pod-1")),
        "node port on {serving}:\n{}",
        d.log()
    );
    for _ in 0..3 {
        let a = attempt(ext, not_serving);
        assert!(
            !a.is_ok(),
            "{not_serving} is not the primary address: {a:?}\n{}",
            d.log()
        );
    }
}

/// server.go detectNodeIPs: --bind-address names the primary IP of its family.
fn primary_is_the_bind_address(mode: &str) {
    let (bed, _pods, ext) = bed(&format!("npprim{}", &mode[..1]));
    let node_ip = bed.node_ipv4().to_string();
    let d = daemon(&bed, mode, &ext, &["--bind-address", &node_ip]);
    assert_only_on(&d, &ext, &node_ip, OTHER);
    let log = d.log();
    assert!(
        log.contains("--nodeport-addresses primary resolved") && log.contains(&node_ip),
        "{log}"
    );
}

#[test]
fn primary_is_the_bind_address_ebpf() {
    primary_is_the_bind_address("ebpf")
}

#[test]
fn primary_is_the_bind_address_iptables() {
    primary_is_the_bind_address("iptables")
}

#[test]
fn primary_is_the_bind_address_nftables() {
    primary_is_the_bind_address("nftables")
}

/// No --bind-address and no Node (the file source): the first address of the default
/// route's device (the node address on the client's veth, added before [`OTHER`]), with a
/// warning that says so.
#[test]
fn primary_falls_back_to_the_default_route_device() {
    let (bed, _pods, ext) = bed("npprimd");
    xtask::cmd::ip([
        "-n",
        bed.node_netns(),
        "route",
        "replace",
        "default",
        "dev",
        &ext.node_veth,
    ])
    .expect("default route");
    let node_ip = bed.node_ipv4().to_string();
    let d = daemon(&bed, "iptables", &ext, &[]);
    assert_only_on(&d, &ext, &node_ip, OTHER);
    let log = d.log();
    assert!(
        log.contains("using the default route device") && log.contains(&node_ip),
        "{log}"
    );
}

/// Nothing to resolve `primary` from: start-up fails with status 2 and says why, rather
/// than serving node ports on every address.
#[test]
fn primary_without_any_address_fails_start_up() {
    let (bed, _pods, ext) = bed("npprimf");
    let _ = xtask::cmd::ip(["-n", bed.node_netns(), "route", "del", "default"]);
    let mut d = daemon(&bed, "iptables", &ext, &[]);
    let status = d.wait_exit(20).expect("start-up fails");
    assert_eq!(status.code(), Some(2), "{}", d.log());
    assert!(
        d.log().contains("--nodeport-addresses primary"),
        "{}",
        d.log()
    );
}

/// The Kubernetes source, no --bind-address: the Node's InternalIP, even listed after an
/// ExternalIP (utilnode.GetNodeHostIPs), here the node's second address.
#[test]
fn primary_is_the_nodes_internal_ip() {
    use serde_json::json;
    let (bed, _pods, ext) = bed("npprimk");
    let api = xtask::apiserver::ApiServer::start().expect("test API server");
    let node_ip = bed.node_ipv4().to_string();
    api.create(
        "nodes",
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
               "status": {"addresses": [
                   {"type": "Hostname", "address": "node-a"},
                   {"type": "ExternalIP", "address": node_ip},
                   {"type": "InternalIP", "address": OTHER}]}}),
    );
    api.create(
        "services",
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "web", "namespace": "demo"},
               "spec": {"type": "NodePort", "clusterIP": "198.19.0.10",
                        "clusterIPs": ["198.19.0.10"],
                        "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                                   "protocol": "TCP", "nodePort": NODE_PORT}]}}),
    );
    api.create(
        "endpointslices",
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": "web-1", "namespace": "demo",
                            "labels": {"kubernetes.io/service-name": "web"}},
               "addressType": "IPv4",
               "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
               "endpoints": [{"addresses": [pod_ip(1).to_string()],
                              "conditions": {"ready": true}, "nodeName": "node-a"}]}),
    );
    let kubeconfig = bed.dir().join("kubeconfig.yaml");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let d = Daemon::start(
        bed.cgroup_path(),
        &[
            "--proxy-mode",
            "iptables",
            "--netns",
            bed.node_netns(),
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
            "--nodeport-addresses",
            "primary",
        ],
    );
    assert_only_on(&d, &ext, OTHER, &node_ip);
    let log = d.log();
    assert!(
        log.contains("--nodeport-addresses primary resolved") && !log.contains("default route"),
        "{log}"
    );
}
