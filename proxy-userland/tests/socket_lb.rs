//! The eBPF socket load-balancer with real programs, real sockets and real namespaces: a
//! client in the test bed's cgroup connects to a ClusterIP and must land on a pod.

mod common;

use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use common::*;
use proxy_userland::{
    dataplane::{Dataplane, Scope, bpf::BpfDataplane},
    model::NodeInfo,
};

fn attach(bed: &xtask::testbed::Testbed) -> BpfDataplane {
    BpfDataplane::attach(bed.cgroup_path()).expect("programs load and attach")
}

#[test]
fn tcp_to_cluster_ip_reaches_every_ready_backend() {
    let (bed, _pods) = bed_with_pods("tcpspread", 3);
    let mut dp = attach(&bed);
    let eps = web_endpoints(vec![ready(pod_ip(1)), ready(pod_ip(2)), ready(pod_ip(3))]);
    let state = state_of(vec![(web_service("web", WEB_IP), Some(eps))]);
    let report = dp.sync(&state, &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");

    let attempts = tcp(&bed, WEB, 60);
    assert!(
        attempts.iter().all(|a| a.is_ok()),
        "every connection succeeds: {attempts:?}"
    );
    let seen = reached(&attempts);
    let all: BTreeSet<String> = ["pod-1", "pod-2", "pod-3"].map(String::from).into();
    assert_eq!(seen, all, "60 connections spread over all three pods");
    for pod in &all {
        let n = attempts
            .iter()
            .filter(|a| a.reply() == Some(pod.as_str()))
            .count();
        // Uniform choice: P(a pod gets fewer than 5 of 60) is about 1e-5.
        assert!(n >= 5, "{pod} got only {n} of 60 connections");
    }
    // The application sees the address it dialled, not the pod's.
    assert!(attempts.iter().all(|a| peer(a) == Some(WEB)));
}

#[test]
fn udp_replies_come_from_the_cluster_ip() {
    let (bed, _pods) = bed_with_pods("udprev", 2);
    let mut dp = attach(&bed);
    let eps = web_endpoints(vec![ready(pod_ip(1)), ready(pod_ip(2))]);
    dp.sync(
        &state_of(vec![(web_service("web", WEB_IP), Some(eps))]),
        &node(),
        Scope::Full,
    );

    let unconnected = run_probe(
        &bed,
        &["udp", WEB_DNS, "--count", "10", "--timeout-ms", "2000"],
    );
    for a in &unconnected {
        assert!(a.is_ok(), "unconnected UDP gets a reply: {a:?}");
        assert!(a.reply().is_some_and(|r| r.starts_with("pod-")));
        assert_eq!(from(a), Some(WEB_DNS), "{a:?}");
    }
    let connected = run_probe(
        &bed,
        &[
            "udp",
            WEB_DNS,
            "--count",
            "5",
            "--timeout-ms",
            "2000",
            "--connected",
        ],
    );
    for a in &connected {
        assert!(a.is_ok(), "connected UDP gets a reply: {a:?}");
        assert_eq!(from(a), Some(WEB_DNS), "{a:?}");
        assert_eq!(peer(a), Some(WEB_DNS), "{a:?}");
    }
}

#[test]
fn a_removed_endpoint_gets_no_new_connections() {
    let (bed, _pods) = bed_with_pods("epremove", 3);
    let mut dp = attach(&bed);
    let svc = web_service("web", WEB_IP);
    let three = web_endpoints(vec![ready(pod_ip(1)), ready(pod_ip(2)), ready(pod_ip(3))]);
    dp.sync(
        &state_of(vec![(svc.clone(), Some(three))]),
        &node(),
        Scope::Full,
    );
    assert!(reached(&tcp(&bed, WEB, 40)).contains("pod-3"));

    let two = web_endpoints(vec![ready(pod_ip(1)), ready(pod_ip(2))]);
    let state = state_of(vec![(svc.clone(), Some(two))]);
    let changed = BTreeSet::from([svc.key.clone()]);
    let report = dp.sync(&state, &node(), Scope::Changed(&changed));
    assert!(report.failed.is_empty(), "{report:?}");

    let attempts = tcp(&bed, WEB, 40);
    assert!(attempts.iter().all(|a| a.is_ok()), "{attempts:?}");
    let seen = reached(&attempts);
    assert!(
        !seen.contains("pod-3"),
        "pod-3 was removed but still reached: {attempts:?}"
    );
    assert_eq!(seen.len(), 2);
}

#[test]
fn a_service_without_endpoints_refuses_at_once() {
    let (bed, _pods) = bed_with_pods("noeps", 1);
    let mut dp = attach(&bed);
    let empty = web_service("empty", Ipv4Addr::new(198, 19, 0, 11));
    dp.sync(&state_of(vec![(empty, None)]), &node(), Scope::Full);

    let started = Instant::now();
    let attempts = tcp(&bed, "198.19.0.11:80", 3);
    let took = started.elapsed();
    for a in &attempts {
        assert!(!a.is_ok(), "{a:?}");
        assert_eq!(
            a.errno(),
            Some("ECONNREFUSED"),
            "refused like kube-proxy's REJECT: {a:?}"
        );
    }
    // Well under the 2 s connect timeout the probe would otherwise wait, three times over.
    assert!(took.as_secs_f64() < 1.5, "refusal took {took:?}");

    let udp = run_probe(
        &bed,
        &[
            "udp",
            "198.19.0.11:53",
            "--count",
            "1",
            "--timeout-ms",
            "500",
        ],
    );
    assert_eq!(udp[0].errno(), Some("ECONNREFUSED"), "{udp:?}");
}

#[test]
fn traffic_to_other_addresses_is_untouched() {
    let (bed, _pods) = bed_with_pods("untouched", 2);
    let mut dp = attach(&bed);
    let eps = web_endpoints(vec![ready(pod_ip(1)), ready(pod_ip(2))]);
    dp.sync(
        &state_of(vec![(web_service("web", WEB_IP), Some(eps))]),
        &node(),
        Scope::Full,
    );

    // Straight to pod-1 always lands on pod-1, and reports pod-1 as the peer.
    let direct = tcp(&bed, "198.18.1.11:8080", 20);
    assert!(
        direct.iter().all(|a| a.reply() == Some("pod-1")),
        "{direct:?}"
    );
    assert!(direct.iter().all(|a| peer(a) == Some("198.18.1.11:8080")));
    // A port the service does not have is not translated: nothing routes the ClusterIP.
    let other_port = tcp(&bed, "198.19.0.10:8080", 1);
    assert!(!other_port[0].is_ok(), "{other_port:?}");
    assert_ne!(
        other_port[0].errno(),
        Some("ECONNREFUSED"),
        "not refused by us: {other_port:?}"
    );
}

#[test]
fn one_endpoint_change_rewrites_one_frontend() {
    let (bed, _pods) = bed_with_pods("incr", 2);
    let mut dp = attach(&bed);
    let mut entries = Vec::new();
    for i in 0..50u8 {
        let svc = web_service(&format!("svc-{i}"), Ipv4Addr::new(198, 19, 1, i));
        entries.push((
            svc,
            Some(web_endpoints(vec![ready(pod_ip(1)), ready(pod_ip(2))])),
        ));
    }
    let state = state_of(entries.clone());
    let first = dp.sync(&state, &node(), Scope::Full);
    assert_eq!(first.frontends_written, 100, "50 services x 2 ports");
    let occupancy = dp.programmer().occupancy();
    // 100 frontends x (master + 2 slots); 2 backends per port, shared by every service.
    assert_eq!(occupancy.services, 300);
    assert_eq!(occupancy.backends, 4);

    // A full resync with nothing changed writes nothing.
    assert_eq!(dp.sync(&state, &node(), Scope::Full).frontends_written, 0);

    // svc-7 loses pod-2.
    entries[7].1 = Some(web_endpoints(vec![ready(pod_ip(1))]));
    let state = state_of(entries);
    let key = proxy_userland::model::ServiceKey::new("demo", "svc-7");
    let report = dp.sync(&state, &node(), Scope::Changed(&BTreeSet::from([key])));
    assert_eq!(
        report.frontends_written, 2,
        "only svc-7's two ports are rewritten"
    );
    assert_eq!(dp.programmer().occupancy().services, 298);

    let attempts = tcp(&bed, "198.19.1.7:80", 20);
    assert!(
        attempts.iter().all(|a| a.reply() == Some("pod-1")),
        "{attempts:?}"
    );
    let others = tcp(&bed, "198.19.1.8:80", 30);
    assert_eq!(reached(&others).len(), 2, "svc-8 still uses both pods");
}

#[test]
fn removing_a_service_removes_its_entries() {
    let (bed, _pods) = bed_with_pods("svcremove", 1);
    let mut dp = attach(&bed);
    let svc = web_service("web", WEB_IP);
    let state = state_of(vec![(
        svc.clone(),
        Some(web_endpoints(vec![ready(pod_ip(1))])),
    )]);
    dp.sync(&state, &node(), Scope::Full);
    assert!(tcp(&bed, WEB, 1)[0].is_ok());

    let report = dp.sync(&state_of(vec![]), &node(), Scope::Full);
    assert_eq!(report.frontends_removed, 2);
    let occupancy = dp.programmer().occupancy();
    assert_eq!((occupancy.services, occupancy.backends), (0, 0));
    let after = tcp(&bed, WEB, 1);
    assert!(
        !after[0].is_ok(),
        "the ClusterIP is no longer translated: {after:?}"
    );
}

#[test]
fn client_ip_affinity_keeps_a_client_on_its_backend_until_it_goes_or_times_out() {
    let (bed, _pods) = bed_with_pods("affinity", 4);
    let mut dp = attach(&bed);
    let mut svc = web_service("web", WEB_IP);
    svc.affinity_timeout = Some(1);
    let all = vec![
        ready(pod_ip(1)),
        ready(pod_ip(2)),
        ready(pod_ip(3)),
        ready(pod_ip(4)),
    ];
    dp.sync(
        &state_of(vec![(svc.clone(), Some(web_endpoints(all.clone())))]),
        &node(),
        Scope::Full,
    );

    // Back-to-back connections (each probe is a new process, same client netns) stick.
    let first = tcp(&bed, WEB, 20);
    let stuck = reached(&first);
    assert_eq!(stuck.len(), 1, "one client, one backend: {first:?}");
    let pod = stuck.into_iter().next().unwrap();
    assert_eq!(reached(&tcp(&bed, WEB, 10)), BTreeSet::from([pod.clone()]));

    // Its backend leaves: the client moves to another one and sticks there.
    let rest = without_pod(&all, &pod);
    let changed = BTreeSet::from([svc.key.clone()]);
    dp.sync(
        &state_of(vec![(svc.clone(), Some(web_endpoints(rest)))]),
        &node(),
        Scope::Changed(&changed),
    );
    let moved = reached(&tcp(&bed, WEB, 20));
    assert_eq!(moved.len(), 1, "{moved:?}");
    assert!(!moved.contains(&pod), "still sent to the removed {pod}");

    // After the 1 s timeout a client may get a new backend: over eight idle gaps, three
    // backends, seeing only one is a (1/3)^7 chance.
    let mut after_idle = BTreeSet::new();
    for _ in 0..8 {
        std::thread::sleep(Duration::from_millis(1200));
        after_idle.extend(reached(&tcp(&bed, WEB, 1)));
    }
    assert!(
        after_idle.len() >= 2,
        "affinity outlived its timeout: {after_idle:?}"
    );
}

/// Affinity switched off, the client's backend leaving meanwhile, then affinity back on
/// with a long timeout: what the client had before must not bring it back to the backend
/// that left. The backend stays another service's, so its id still leads somewhere.
#[test]
fn affinity_turned_off_and_on_forgets_a_backend_that_left_meanwhile() {
    let (bed, _pods) = bed_with_pods("affoffon", 4);
    let mut dp = attach(&bed);
    let mut svc = web_service("web", WEB_IP);
    svc.affinity_timeout = Some(600);
    let other = web_service("other", Ipv4Addr::new(198, 19, 0, 20));
    let all: Vec<_> = (1..=4).map(|i| ready(pod_ip(i))).collect();
    let sync = |dp: &mut BpfDataplane, svc: &proxy_userland::model::Service, eps: &[_]| {
        let report = dp.sync(
            &state_of(vec![
                (svc.clone(), Some(web_endpoints(eps.to_vec()))),
                (other.clone(), Some(web_endpoints(all.clone()))),
            ]),
            &node(),
            Scope::Full,
        );
        assert!(report.failed.is_empty(), "{report:?}");
    };
    sync(&mut dp, &svc, &all);
    let stuck = reached(&tcp(&bed, WEB, 10));
    assert_eq!(stuck.len(), 1, "one client, one backend: {stuck:?}");
    let pod = stuck.into_iter().next().unwrap();

    svc.affinity_timeout = None;
    sync(&mut dp, &svc, &all);
    let rest = without_pod(&all, &pod);
    sync(&mut dp, &svc, &rest);
    svc.affinity_timeout = Some(600);
    sync(&mut dp, &svc, &rest);

    let after = tcp(&bed, WEB, 10);
    assert!(after.iter().all(|a| a.is_ok()), "{after:?}");
    let after = reached(&after);
    assert!(
        !after.contains(&pod),
        "sent to the removed {pod}: {after:?}"
    );
    assert_eq!(after.len(), 1, "and sticks again: {after:?}");
}

/// A long-lived connected UDP client (statsd, a DNS forwarder) whose backend dies: its
/// socket is reset so it reconnects to a live backend, instead of sending into the void.
#[test]
fn connected_udp_clients_of_a_removed_backend_are_reset_not_black_holed() {
    use std::{
        io::{BufRead, BufReader},
        process::Stdio,
        sync::mpsc,
    };

    let (bed, pods) = bed_with_pods("udpstale", 2);
    let mut dp = attach(&bed);
    let svc = web_service("web", WEB_IP);
    let both = web_endpoints(vec![ready(pod_ip(1)), ready(pod_ip(2))]);
    dp.sync(
        &state_of(vec![(svc.clone(), Some(both))]),
        &node(),
        Scope::Full,
    );

    let mut client = bed
        .client(probe())
        .args(["udp", WEB_DNS, "--connected", "--reconnect-on-error"])
        .args([
            "--count",
            "80",
            "--interval-ms",
            "50",
            "--timeout-ms",
            "200",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("probe client");
    let (tx, rx) = mpsc::channel();
    let stdout = client.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let next = || {
        rx.recv_timeout(Duration::from_secs(5))
            .expect("a probe line within 5 s")
    };
    let first = next();
    let victim = xtask::probe::parse_line(&first)
        .and_then(|o| o.reply().map(str::to_string))
        .unwrap_or_else(|| panic!("first attempt failed: {first}"));
    let i: usize = victim.trim_start_matches("pod-").parse().unwrap();

    // The pod dies without a word: its address now swallows UDP silently.
    let dead = &pods[i - 1];
    let drop_udp = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &dead.netns,
            "iptables",
            "-I",
            "INPUT",
            "-p",
            "udp",
            "-j",
            "DROP",
        ])
        .status()
        .expect("iptables runs");
    assert!(drop_udp.success());
    let survivor = ready(pod_ip(if i == 1 { 2 } else { 1 }));
    let changed = BTreeSet::from([svc.key.clone()]);
    let report = dp.sync(
        &state_of(vec![(svc, Some(web_endpoints(vec![survivor])))]),
        &node(),
        Scope::Changed(&changed),
    );
    assert_eq!(
        report.udp_sockets_reset, 1,
        "the client's socket is reset: {report:?}"
    );

    // Within a few attempts the client is told, reconnects, and is served again.
    let mut after = Vec::new();
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(5)) {
        after.push(line);
        if after.len() == 15 {
            break;
        }
    }
    let _ = client.kill();
    let _ = client.wait();
    let outcomes: Vec<_> = after
        .iter()
        .filter_map(|l| xtask::probe::parse_line(l))
        .collect();
    let recovered = outcomes
        .iter()
        .position(|o| o.is_ok() && o.reply() != Some(victim.as_str()));
    let recovered =
        recovered.unwrap_or_else(|| panic!("never served again after {victim} died: {after:?}"));
    assert!(
        recovered <= 4,
        "recovery took {recovered} attempts: {after:?}"
    );
    assert!(
        outcomes[recovered..]
            .iter()
            .all(|o| o.is_ok() && o.reply() != Some(victim.as_str())),
        "once reconnected it stays on live backends: {after:?}"
    );
}

fn on_node(
    e: proxy_userland::model::Endpoint,
    node: &str,
    zone: &str,
) -> proxy_userland::model::Endpoint {
    e.placed(|at| {
        at.node_name = Some(node.into());
        at.zone = Some(zone.into());
        at.zone_hints = vec![zone.into()];
    })
}

#[test]
fn internal_traffic_policy_local_uses_only_this_nodes_endpoints() {
    let (bed, _pods) = bed_with_pods("itplocal", 3);
    let mut dp = attach(&bed);
    let mut svc = web_service("web", WEB_IP);
    svc.internal_policy_local = true;
    let eps = web_endpoints(vec![
        on_node(ready(pod_ip(1)), "node-a", "zone-a"),
        on_node(ready(pod_ip(2)), "node-b", "zone-a"),
        on_node(ready(pod_ip(3)), "node-a", "zone-b"),
    ]);
    dp.sync(
        &state_of(vec![(svc.clone(), Some(eps))]),
        &node(),
        Scope::Full,
    );
    let seen = reached(&tcp(&bed, WEB, 40));
    assert_eq!(
        seen,
        BTreeSet::from(["pod-1".to_string(), "pod-3".to_string()]),
        "node-a's pods only"
    );

    // No local endpoint: kube-proxy drops such traffic (the client hangs until its
    // timeout); we refuse it, so the client learns at once.
    let remote_only = web_endpoints(vec![on_node(ready(pod_ip(2)), "node-b", "zone-a")]);
    let changed = BTreeSet::from([svc.key.clone()]);
    dp.sync(
        &state_of(vec![(svc, Some(remote_only))]),
        &node(),
        Scope::Changed(&changed),
    );
    let refused = tcp(&bed, WEB, 1);
    assert_eq!(refused[0].errno(), Some("ECONNREFUSED"), "{refused:?}");
}

#[test]
fn terminating_endpoints_take_over_only_when_none_is_ready() {
    let (bed, _pods) = bed_with_pods("terminating", 2);
    let mut dp = attach(&bed);
    let svc = web_service("web", WEB_IP);
    let draining = |e: proxy_userland::model::Endpoint| proxy_userland::model::Endpoint {
        ready: false,
        serving: true,
        terminating: true,
        ..e
    };
    let mixed = web_endpoints(vec![ready(pod_ip(1)), draining(ready(pod_ip(2)))]);
    dp.sync(
        &state_of(vec![(svc.clone(), Some(mixed))]),
        &node(),
        Scope::Full,
    );
    assert_eq!(
        reached(&tcp(&bed, WEB, 30)),
        BTreeSet::from(["pod-1".to_string()])
    );

    // A rollout's last moment: every endpoint is terminating but still serving. Refusing
    // would drop traffic the old pods can still answer.
    let all_draining = web_endpoints(vec![draining(ready(pod_ip(1))), draining(ready(pod_ip(2)))]);
    let changed = BTreeSet::from([svc.key.clone()]);
    dp.sync(
        &state_of(vec![(svc, Some(all_draining))]),
        &node(),
        Scope::Changed(&changed),
    );
    let attempts = tcp(&bed, WEB, 30);
    assert!(attempts.iter().all(|o| o.is_ok()), "{attempts:?}");
    assert_eq!(reached(&attempts).len(), 2);
}

#[test]
fn topology_hints_keep_traffic_in_this_nodes_zone() {
    let (bed, _pods) = bed_with_pods("topology", 3);
    let mut dp = attach(&bed);
    let mut svc = web_service("web", WEB_IP);
    svc.prefer_close = true;
    let eps = web_endpoints(vec![
        on_node(ready(pod_ip(1)), "node-a", "zone-a"),
        on_node(ready(pod_ip(2)), "node-b", "zone-a"),
        on_node(ready(pod_ip(3)), "node-c", "zone-b"),
    ]);
    let here = NodeInfo {
        name: "node-a".into(),
        zone: Some("zone-a".into()),
    };
    dp.sync(&state_of(vec![(svc, Some(eps))]), &here, Scope::Full);
    assert_eq!(
        reached(&tcp(&bed, WEB, 40)),
        BTreeSet::from(["pod-1".to_string(), "pod-2".to_string()]),
        "zone-a's endpoints only"
    );
}

#[test]
fn pods_reach_external_and_load_balancer_ips_without_leaving_the_node() {
    let (bed, _pods) = bed_with_pods("extsock", 2);
    let mut dp = attach(&bed);
    let mut svc = web_service("web", WEB_IP);
    svc.external_ips = vec![Ipv4Addr::new(198, 19, 2, 1).into()];
    svc.load_balancer_ips = vec![Ipv4Addr::new(198, 19, 2, 2).into()];
    // Even under externalTrafficPolicy Local, a pod's connection uses every endpoint, as
    // kube-proxy short-circuits it; pod-2 runs elsewhere.
    svc.external_policy_local = true;
    let eps = web_endpoints(vec![
        on_node(ready(pod_ip(1)), "node-a", ""),
        on_node(ready(pod_ip(2)), "node-b", ""),
    ]);
    let report = dp.sync(&state_of(vec![(svc, Some(eps))]), &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");
    for target in ["198.19.2.1:80", "198.19.2.2:80"] {
        let attempts = tcp(&bed, target, 30);
        assert!(attempts.iter().all(|a| a.is_ok()), "{attempts:?}");
        assert_eq!(reached(&attempts).len(), 2, "{attempts:?}");
        assert!(
            attempts.iter().all(|a| peer(a) == Some(target)),
            "{attempts:?}"
        );
    }
}
