//! `--bpf-host-routing` through the real daemon: what its remembered FIB answers (see
//! `proxy-ebpf/src/route.rs`) must not get wrong.

mod common;

use std::{net::Ipv4Addr, process::Stdio, time::Duration};

use common::*;
use xtask::testbed::Testbed;

/// A node port whose one backend is pod 1, over UDP.
fn manifest() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: dns, namespace: demo}}\n\
         spec:\n  type: NodePort\n  clusterIP: 198.19.0.10\n  \
         ports:\n  - {{name: dns, port: 53, targetPort: 5353, protocol: UDP, nodePort: 30053}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: dns-1\n  \
         namespace: demo\n  labels: {{kubernetes.io/service-name: dns}}\naddressType: IPv4\n\
         ports:\n- {{name: dns, port: 5353, protocol: UDP}}\n\
         endpoints:\n- {{addresses: [{}], nodeName: node-a, conditions: {{ready: true}}}}\n",
        pod_ip(1)
    )
}

/// A pod replaced by one with the same address on another device (its runtime recreated
/// it; the endpoint never changed) gets a live flow's packets within about a second: the
/// node port's host-routed packets follow the FIB's new answer, not the one remembered for
/// the flow, whose device is gone. One connected UDP socket on another host sends through
/// the replacement; before it and a moment after it, every datagram is answered, by the
/// pod of the moment.
#[test]
fn a_flow_follows_its_backends_address_to_a_new_device() {
    let mut bed = Testbed::new("hrmove").expect("test bed");
    let old = bed.add_pod("pod-1", pod_ip(1), None).expect("pod");
    bed.serve(probe(), &old, &["--udp", "0.0.0.0:5353"])
        .expect("pod server");
    let ext = bed
        .add_pod("ext", Ipv4Addr::new(198, 18, 2, 1), None)
        .expect("external client namespace");
    let dir = manifest_dir("hrmove");
    std::fs::write(dir.0.join("dns.yaml"), manifest()).unwrap();
    // The replacement's device will be the bed's next: fpv2 (ext has fpv1).
    let pod_devices = format!("{},fpv2", old.node_veth);
    let daemon = node_port_daemon(&bed, &pod_devices, &ext, &dir.0, &["--bpf-host-routing"]);
    let target = format!("{}:30053", bed.node_ipv4());
    let udp = |args: &[&str]| {
        let mut cmd = std::process::Command::new(probe());
        cmd.arg("--netns")
            .arg(&ext.netns)
            .args(["udp", &target, "--connected"])
            .args(args);
        cmd
    };
    assert!(
        eventually(20, || {
            let out = udp(&["--count", "2", "--timeout-ms", "300"])
                .output()
                .expect("probe runs");
            xtask::probe::parse(&String::from_utf8_lossy(&out.stdout))
                .iter()
                .all(|o| o.is_ok())
        }),
        "the node port never answered; log:\n{}",
        daemon.log()
    );
    // 100 datagrams, one every 50 ms, each waiting up to 100 ms for its answer: the
    // replacement comes after the first 20 or so.
    let sender = udp(&[
        "--count",
        "100",
        "--interval-ms",
        "50",
        "--timeout-ms",
        "100",
    ])
    .stdout(Stdio::piped())
    .spawn()
    .expect("probe runs");
    std::thread::sleep(Duration::from_millis(1500));
    bed.remove_pod("pod-1").expect("pod removed");
    let new = bed.add_pod("pod-1b", pod_ip(1), None).expect("pod again");
    assert_eq!(new.node_veth, "fpv2", "the bed numbers devices as assumed");
    bed.serve(probe(), &new, &["--udp", "0.0.0.0:5353"])
        .expect("pod server");
    let out = sender.wait_with_output().expect("probe ends");
    let outcomes = xtask::probe::parse(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(outcomes.len(), 100, "one line per datagram: {outcomes:?}");
    let by = |o: &xtask::probe::Outcome| {
        o.is_ok()
            .then(|| o.reply().and_then(|r| r.split_whitespace().next()))
            .flatten()
            .map(str::to_string)
    };
    let answered: Vec<Option<String>> = outcomes.iter().map(by).collect();
    assert!(
        answered[..10].iter().all(|a| a.as_deref() == Some("pod-1")),
        "before the replacement pod 1 answers every datagram: {answered:?}"
    );
    // About 30 datagrams go out between the replacement and the last 40 (some 2.5 s of
    // sending, with the answers' waits): a second to forget the old device, and the time
    // the daemon takes to put the programs on the new one.
    assert!(
        answered[60..]
            .iter()
            .all(|a| a.as_deref() == Some("pod-1b")),
        "the new pod answers every datagram from a moment after it came: {answered:?}\n{}",
        daemon.log()
    );
}
