//! Pinned maps and links: a daemon restart (or upgrade) keeps connections flowing, the next
//! daemon adopts what the last one programmed, and clean-up removes it all.

mod common;

use std::{net::Ipv4Addr, path::Path, time::Duration};

use common::*;
use proxy_userland::{
    dataplane::{
        Dataplane, Scope,
        bpf::{BpfDataplane, loader},
    },
    model::NodeInfo,
};

fn links_pinned(pin: &Path) -> usize {
    std::fs::read_dir(loader::PinLayout::new(pin).links)
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn restart_keeps_connections_flowing_and_reconciles_what_changed_meanwhile() {
    let (bed, _pods) = bed_with_pods("pinning", 2);
    let fs = Bpffs::mount(bed.dir());
    let pin = fs.0.join("fastpath");
    let node = NodeInfo::default();
    let web = web_service("web", Ipv4Addr::new(198, 19, 0, 10));
    let old = web_service("old", Ipv4Addr::new(198, 19, 0, 11));
    let eps = || Some(web_endpoints(vec![ready(pod_ip(1)), ready(pod_ip(2))]));

    let mut first = BpfDataplane::attach_pinned(bed.cgroup_path(), Some(&pin)).unwrap();
    first.sync(
        &state_of(vec![(web.clone(), eps()), (old.clone(), eps())]),
        &node,
        Scope::Full,
    );
    assert!(tcp(&bed, "198.19.0.11:80", 1)[0].is_ok());

    // A bounded loop of new connections, 20 ms apart, across the whole restart.
    let client = std::thread::spawn({
        let mut cmd = bed.client(probe());
        cmd.args([
            "tcp",
            "198.19.0.10:80",
            "--count",
            "150",
            "--interval-ms",
            "20",
            "--timeout-ms",
            "1000",
        ]);
        move || cmd.output().expect("probe runs")
    });
    std::thread::sleep(Duration::from_millis(500));
    drop(first); // the daemon exits...
    std::thread::sleep(Duration::from_millis(700)); // ...nobody runs for a while...
    // ...and the next one starts while "old" was deleted meanwhile.
    let mut second = BpfDataplane::attach_pinned(bed.cgroup_path(), Some(&pin)).unwrap();
    let report = second.sync(&state_of(vec![(web.clone(), eps())]), &node, Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");
    assert_eq!(
        report.frontends_written, 0,
        "web was adopted as it was: nothing rewritten"
    );
    assert_eq!(
        report.frontends_removed, 2,
        "old's two ports, deleted while no daemon ran"
    );

    let out = client.join().unwrap();
    let outcomes = xtask::probe::parse(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(outcomes.len(), 150);
    let failed: Vec<_> = outcomes.iter().filter(|o| !o.is_ok()).collect();
    assert!(
        failed.is_empty(),
        "{} of 150 connections failed across the restart: {failed:?}",
        failed.len()
    );
    assert_eq!(reached(&outcomes).len(), 2);

    assert!(
        !tcp(&bed, "198.19.0.11:80", 1)[0].is_ok(),
        "the deleted service is gone"
    );
    assert_eq!(
        links_pinned(&pin),
        8,
        "one generation of links remains, not two"
    );

    // The maps are the same ones: an endpoint change still lands.
    let one = Some(web_endpoints(vec![ready(pod_ip(2))]));
    let changed = std::collections::BTreeSet::from([web.key.clone()]);
    second.sync(&state_of(vec![(web, one)]), &node, Scope::Changed(&changed));
    assert!(
        tcp(&bed, "198.19.0.10:80", 20)
            .iter()
            .all(|o| o.reply() == Some("pod-2"))
    );

    // Clean-up detaches everything, even while a daemon still holds its handles.
    // (The kernel releases an unpinned link from a work queue: allow it a moment.)
    loader::remove_pinned(&pin).unwrap();
    drop(second);
    assert!(
        eventually(3, || !tcp(&bed, "198.19.0.10:80", 1)[0].is_ok()),
        "no translation after clean-up"
    );
}

#[test]
fn pinned_daemon_keeps_services_after_exit_until_cleanup() {
    let (bed, _pods) = bed_with_pods("pincleanup", 2);
    let fs = Bpffs::mount(bed.dir());
    let pin = fs.0.join("fastpath");
    let dir = bed.dir().join("manifests");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("web.yaml"),
        r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  clusterIP: 198.19.0.10
  ports: [{name: http, port: 80, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: [198.18.1.11]}, {addresses: [198.18.1.12]}]
"#,
    )
    .unwrap();
    let pin_arg = pin.to_str().unwrap();
    let mut daemon = Daemon::start(
        bed.cgroup_path(),
        &[
            "--manifests",
            dir.to_str().unwrap(),
            "--proxy-mode",
            "ebpf",
            "--bpf-pin-dir",
            pin_arg,
        ],
    );
    assert!(
        eventually(20, || tcp(&bed, "198.19.0.10:80", 1)[0].is_ok()),
        "never reachable; log:\n{}",
        daemon.log()
    );
    assert!(daemon.stop().success(), "{}", daemon.log());
    // No daemon runs, and Services still work: the programs stay attached through the pins.
    let without_daemon = tcp(&bed, "198.19.0.10:80", 20);
    assert!(
        without_daemon.iter().all(|o| o.is_ok()),
        "{without_daemon:?}"
    );
    assert_eq!(reached(&without_daemon).len(), 2);

    let cleanup = std::process::Command::new(FASTPATH)
        .args(["--cleanup", "--bpf-pin-dir", pin_arg])
        .output()
        .unwrap();
    assert!(
        cleanup.status.success(),
        "{}",
        String::from_utf8_lossy(&cleanup.stderr)
    );
    assert!(
        eventually(3, || !tcp(&bed, "198.19.0.10:80", 1)[0].is_ok()),
        "nothing translates after --cleanup"
    );
    assert!(!pin.exists(), "the pin folder is gone");
}
