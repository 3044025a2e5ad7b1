//! A full BPF map fails the services that do not fit, one by one and whole, with a clear
//! error; the rest keep working, and the failed ones are programmed once there is room.

mod common;

use std::{collections::BTreeSet, net::Ipv4Addr};

use common::*;
use proxy_userland::{
    dataplane::{
        Dataplane, Scope,
        bpf::{AttachOptions, BpfDataplane, program::Frontend},
    },
    model::Protocol,
};

#[test]
fn a_service_that_does_not_fit_fails_whole_and_the_others_keep_working() {
    let (bed, _pods) = bed_with_pods("mapfull", 2);
    // Room for 9 service entries: `web` takes 6 (two ports, a master and two slots each),
    // so `web2` fits its first port (dns) but not its second: the first must be undone.
    let opts = AttachOptions {
        lb_map_max: Some(9),
        ..Default::default()
    };
    let mut dp = BpfDataplane::attach_with(bed.cgroup_path(), &opts).expect("programs load");
    let big_ip = Ipv4Addr::new(198, 19, 0, 20);
    let two = || Some(web_endpoints(vec![ready(pod_ip(1)), ready(pod_ip(2))]));
    let web = web_service("web", WEB_IP);
    // Services are programmed in name order: `web` first, then `web2`.
    let big = web_service("web2", big_ip);
    let report = dp.sync(
        &state_of(vec![(web.clone(), two()), (big.clone(), two())]),
        &node(),
        Scope::Full,
    );

    assert_eq!(report.failed.len(), 1, "{report:?}");
    let (failed, why) = &report.failed[0];
    assert_eq!(failed, &big.key);
    assert!(
        why.contains("map full"),
        "the error says what is wrong: {why}"
    );
    // Not half-programmed: neither of big's ports is in the maps.
    for (port, proto) in [(80, Protocol::Tcp), (53, Protocol::Udp)] {
        let fe = Frontend::socket(big_ip.into(), port, proto);
        assert!(
            dp.programmer().programmed(&fe).is_none(),
            "{fe} left behind"
        );
        assert!(
            dp.programmer().maps().get_service(&fe, 0).is_none(),
            "{fe} in the map"
        );
    }
    assert!(
        tcp(&bed, WEB, 10).iter().all(|a| a.is_ok()),
        "web keeps working"
    );

    // web goes: big fits now, and the retry programs it.
    let changed = BTreeSet::from([web.key.clone(), big.key.clone()]);
    let report = dp.sync(
        &state_of(vec![(big, two())]),
        &node(),
        Scope::Changed(&changed),
    );
    assert!(report.failed.is_empty(), "{report:?}");
    let attempts = tcp(&bed, "198.19.0.20:80", 10);
    assert!(attempts.iter().all(|a| a.is_ok()), "{attempts:?}");
}

/// The same through the daemon as deploy/ runs it (the configmap's config, the DaemonSet's
/// capabilities, maps pinned): the kernel refuses `web2`'s entries (E2BIG, its service map
/// holds 9), and the user sees that service fail alone, in the log and the metrics, while
/// `web` answers.
#[test]
fn the_daemon_reports_a_service_the_kernel_refuses_and_serves_the_others() {
    let (bed, _pods) = bed_with_pods("mapfulld", 2);
    let dir = manifest_dir("mapfulld");
    let web = web_manifest(&[pod_ip(1), pod_ip(2)]);
    let web2 = web
        .replace("198.19.0.10", "198.19.0.20")
        .replace("name: web,", "name: web2,")
        .replace("name: web-abc", "name: web2-abc")
        .replace("service-name: web}", "service-name: web2}");
    std::fs::write(dir.0.join("services.yaml"), format!("{web}---\n{web2}")).unwrap();
    let metrics_port = free_port();
    let shipped = start_as_shipped(
        &bed,
        &[
            &format!("--manifests={}", dir.0.display()),
            "--bpf-lb-map-max=9",
            &format!("--metrics-bind-address=127.0.0.1:{metrics_port}"),
        ],
    );

    assert!(
        eventually(20, || tcp(&bed, WEB, 1)[0].is_ok()),
        "web never answered; log:\n{}",
        shipped.daemon.log()
    );
    let failures = || {
        let text = http_get(bed.node_netns(), metrics_port, "/metrics");
        text.lines()
            .find_map(|l| l.strip_prefix("fastpath_service_program_failures_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert!(
        eventually(20, || failures() >= 1.0),
        "no failure counted; metrics:\n{}",
        http_get(bed.node_netns(), metrics_port, "/metrics")
    );
    let log = shipped.daemon.log();
    let refused: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("cannot program service"))
        .collect();
    assert!(
        !refused.is_empty() && refused.iter().all(|l| l.contains("demo/web2")),
        "only web2 fails, and the log says so: {refused:?}"
    );
    assert!(
        refused.iter().all(|l| l.contains("map full")),
        "the error says why: {refused:?}"
    );
    // The first sync writes in bulk (dataplane/bpf/maps/deferred.rs); refused, it starts
    // over service by service, which is what isolated web2 above.
    assert!(
        log.contains("programming the services one by one"),
        "the bulk write was refused and redone service by service; log:\n{log}"
    );
    assert!(
        tcp(&bed, "198.19.0.20:80", 3).iter().all(|a| !a.is_ok()),
        "web2 is not half-programmed"
    );
    assert!(
        tcp(&bed, WEB, 10).iter().all(|a| a.is_ok()),
        "web keeps working"
    );
    drop(shipped);
}
