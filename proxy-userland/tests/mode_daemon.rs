//! The `fastpath` binary in the fallback modes, run for a test bed's node namespace
//! (`--netns`): `--proxy-mode iptables` reaches a ClusterIP, keeps its rules across a stop
//! (as kube-proxy does), and a following `--proxy-mode userspace` clears them away and
//! serves the same ClusterIP through its relays, then removes its own on exit when asked.

mod common;
mod nat_common;

use common::*;
use nat_common::*;

/// The daemon for the bed's node namespace, in `mode` (None: the mode it chooses).
fn start(bed: &xtask::testbed::Testbed, mode: Option<&str>, extra: &[&str]) -> Daemon {
    let manifests = bed.dir().join("manifests.yaml");
    let manifests = manifests.to_str().unwrap();
    let mut args = match mode {
        Some(mode) => vec!["--proxy-mode", mode],
        None => vec![],
    };
    args.extend([
        "--netns",
        bed.node_netns(),
        "--manifests",
        manifests,
        // Not needed here, and the host's ports may be taken by other tests' daemons.
        "--healthz-bind-address",
        "",
        "--metrics-bind-address",
        "",
    ]);
    args.extend_from_slice(extra);
    Daemon::start(bed.cgroup_path(), &args)
}

/// Every connection succeeds and both pods serve. 20 tries: with 6, all landing on one pod
/// (1 in 32) failed a check now and then.
fn all_ok(bed: &xtask::testbed::Testbed) -> bool {
    let a = tcp(bed, WEB, 20);
    a.iter().all(|x| x.is_ok()) && reached(&a).len() == 2
}

#[test]
fn daemon_runs_iptables_then_userspace_for_a_namespace() {
    let (bed, _pods) = bed_with_pods("modedmn", 2);
    route_services(&bed);
    std::fs::write(
        bed.dir().join("manifests.yaml"),
        web_manifest(&[pod_ip(1), pod_ip(2)]),
    )
    .unwrap();

    let mut ipt = start(&bed, Some("iptables"), &[]);
    assert!(
        eventually(20, || all_ok(&bed)),
        "ClusterIP through the iptables mode:\n{}",
        ipt.log()
    );
    let log = ipt.log();
    assert!(
        log.contains("proxy mode chosen") && log.contains("iptables was asked for"),
        "{log}"
    );
    assert!(ipt.stop().success(), "{}", ipt.log());
    // Kept on a plain stop: Services keep working while the proxy restarts.
    assert!(!chains_with(&saved(bed.node_netns(), "iptables-save"), "KUBE-SVC-").is_empty());
    assert!(all_ok(&bed), "traffic still flows after the proxy stopped");

    let mut us = start(&bed, Some("userspace"), &["--cleanup-on-exit"]);
    assert!(
        eventually(20, || {
            let nat = saved(bed.node_netns(), "iptables-save");
            // The nat portals, plus the filter chain that refuses services without endpoints.
            let mut portals = chains_with(&nat, "KUBE-PORTALS-");
            portals.sort();
            portals
                == [
                    "KUBE-PORTALS-CONTAINER",
                    "KUBE-PORTALS-FILTER",
                    "KUBE-PORTALS-HOST",
                ]
                && chains_with(&nat, "KUBE-SVC-").is_empty()
        }),
        "the userspace mode replaced the iptables mode's chains:\n{}",
        us.log()
    );
    assert!(
        eventually(20, || all_ok(&bed)),
        "ClusterIP through the relays:\n{}",
        us.log()
    );
    assert!(us.stop().success(), "{}", us.log());
    let after = saved(bed.node_netns(), "iptables-save");
    assert!(
        chains_with(&after, "KUBE-").is_empty(),
        "--cleanup-on-exit leaves nothing: {after}"
    );
}

#[test]
fn a_mode_the_node_cannot_run_is_refused_clearly() {
    let bed = xtask::testbed::Testbed::new("modebad").expect("test bed");
    std::fs::write(
        bed.dir().join("manifests.yaml"),
        web_manifest(&[pod_ip(1), pod_ip(2)]),
    )
    .unwrap();
    // No such namespace: iptables cannot run there, and the daemon says so and exits.
    let manifests = bed.dir().join("manifests.yaml");
    let mut d = Daemon::start(
        bed.cgroup_path(),
        &[
            "--proxy-mode",
            "iptables",
            "--netns",
            "fp-no-such-namespace",
            "--manifests",
            manifests.to_str().unwrap(),
            "--healthz-bind-address",
            "",
            "--metrics-bind-address",
            "",
        ],
    );
    let status = d.wait_exit(20).expect("the daemon gives up by itself");
    assert!(!status.success());
    let log = d.log();
    assert!(
        log.contains("--proxy-mode iptables cannot run on this node"),
        "{log}"
    );
}

#[test]
fn when_the_ebpf_load_fails_the_daemon_falls_back_and_says_why() {
    let (bed, _pods) = bed_with_pods("modefall", 2);
    route_services(&bed);
    std::fs::write(
        bed.dir().join("manifests.yaml"),
        web_manifest(&[pod_ip(1), pod_ip(2)]),
    )
    .unwrap();
    // The probes pass, but the maps cannot be pinned in a folder that is not on bpffs, so
    // loading fails as a verifier rejection would: after the probes, at load time.
    let not_bpffs = bed.dir().join("not-bpffs");
    let pin = [
        "--bpf-pin-dir",
        not_bpffs.to_str().unwrap(),
        "--cleanup-on-exit",
    ];
    let mut d = start(&bed, None, &pin);
    assert!(
        eventually(20, || all_ok(&bed)),
        "Services work through the fallback:\n{}",
        d.log()
    );
    let log = d.log();
    assert!(log.contains("the eBPF dataplane failed to start"), "{log}");
    assert!(
        log.contains("is it on a bpffs mount?"),
        "the reason is named: {log}"
    );
    assert!(
        log.contains("proxy mode chosen after the eBPF failure"),
        "{log}"
    );
    // The next mode the node runs: nftables (kernel 5.13+, nft works here).
    let table = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            bed.node_netns(),
            "nft",
            "list",
            "table",
            "ip",
            "fastpath",
        ])
        .output()
        .expect("nft");
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("chain service-"), "{table}\n{log}");
    assert!(d.stop().success(), "{}", d.log());
}
