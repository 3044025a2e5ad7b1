//! The test bed itself: wiring, reachability, and that nothing is left behind. Needs root.

use std::{
    fs,
    io::{Read as _, Write as _},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use xtask::{
    Testbed, cgroup, netns, probe, reap_stale,
    testbed::{NODE_IPV4, NODE_IPV6, RUN_DIR},
};

fn v6(s: &str) -> Ipv6Addr {
    s.parse().unwrap()
}

/// What a bed leaves on the machine, by name.
fn traces(id: &str) -> Vec<String> {
    let mut found: Vec<String> = netns::list()
        .into_iter()
        .filter(|n| n.starts_with(id))
        .map(|n| format!("netns {n}"))
        .collect();
    let cg = cgroup::find_cgroup2_mount().unwrap().unwrap().join(id);
    if cg.exists() {
        found.push(format!("cgroup {}", cg.display()));
    }
    let dir = Path::new(RUN_DIR).join(id);
    if dir.exists() {
        found.push(format!("folder {}", dir.display()));
    }
    found
}

#[test]
fn drop_removes_everything() {
    let mut bed = Testbed::new("drop").unwrap();
    let id = bed.id().to_string();
    let a = bed
        .add_pod("a", Ipv4Addr::new(198, 18, 7, 1), Some(v6("2001:db8:7::1")))
        .unwrap();
    bed.add_pod("b", Ipv4Addr::new(198, 18, 7, 2), None)
        .unwrap();
    let sleeper = bed
        .spawn(Command::new("sleep").arg("60"), Duration::from_secs(1))
        .unwrap();

    assert!(netns::exists(bed.node_netns()));
    assert!(netns::exists(&a.netns));
    assert!(bed.cgroup_path().join("cgroup.procs").exists());
    assert!(bed.dir().is_dir());
    // Helpers run in the helpers cgroup, not in the client one.
    let helpers = cgroup::procs_recursive(bed.helper_cgroup());
    assert_eq!(helpers, vec![sleeper]);
    assert!(cgroup::procs_recursive(bed.cgroup_path()).is_empty());
    assert_eq!(traces(&id).len(), 5, "{:?}", traces(&id)); // 3 netns, cgroup, folder

    drop(bed);
    assert_eq!(traces(&id), Vec::<String>::new());
    // The pid may be reused by now, but not by our sleeper.
    let cmdline = fs::read_to_string(format!("/proc/{sleeper}/cmdline")).unwrap_or_default();
    assert_ne!(cmdline, "sleep\u{0}60\u{0}", "the helper outlived its bed");
}

#[test]
fn close_reports_success_and_cleans_up() {
    let mut bed = Testbed::new("close").unwrap();
    let id = bed.id().to_string();
    bed.add_pod("x", Ipv4Addr::new(198, 18, 8, 1), None)
        .unwrap();
    bed.close().unwrap();
    assert_eq!(traces(&id), Vec::<String>::new());
}

#[test]
fn pods_reach_the_node_and_each_other() {
    let mut bed = Testbed::new("reach").unwrap();
    let a = bed
        .add_pod("a", Ipv4Addr::new(198, 18, 9, 1), Some(v6("2001:db8:9::1")))
        .unwrap();
    let b = bed
        .add_pod("b", Ipv4Addr::new(198, 18, 9, 2), Some(v6("2001:db8:9::2")))
        .unwrap();

    // node -> pod, IPv4 and IPv6; the client's address is the node's.
    for (addr, node) in [
        (
            SocketAddr::from((a.ipv4, 7000)),
            std::net::IpAddr::from(NODE_IPV4),
        ),
        (
            SocketAddr::from((a.ipv6.unwrap(), 7000)),
            std::net::IpAddr::from(NODE_IPV6),
        ),
    ] {
        let listener = netns::in_netns(&a.netns, || TcpListener::bind(addr))
            .unwrap()
            .unwrap();
        let mut client = netns::in_netns(bed.node_netns(), || {
            TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        })
        .unwrap()
        .unwrap();
        let (mut conn, from) = listener.accept().unwrap();
        assert_eq!(from.ip(), node);
        conn.write_all(b"hi").unwrap();
        drop(conn);
        let mut reply = String::new();
        client.read_to_string(&mut reply).unwrap();
        assert_eq!(reply, "hi");
    }

    // pod -> pod through the node namespace, UDP.
    let server = netns::in_netns(&b.netns, || UdpSocket::bind((b.ipv4, 7001)))
        .unwrap()
        .unwrap();
    let client = netns::in_netns(&a.netns, || UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)))
        .unwrap()
        .unwrap();
    client.send_to(b"ping", (b.ipv4, 7001)).unwrap();
    server
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut buf = [0u8; 16];
    let (n, from) = server.recv_from(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"ping");
    assert_eq!(from.ip(), std::net::IpAddr::from(a.ipv4));

    // Nothing routes outside the test ranges.
    let out = xtask::cmd::ip(["-n", bed.node_netns(), "route", "get", "192.0.2.1"]);
    assert!(
        out.is_err(),
        "node namespace has a route to 192.0.2.1: {out:?}"
    );
}

#[test]
fn rejects_addresses_outside_the_test_ranges() {
    let mut bed = Testbed::new("ranges").unwrap();
    assert!(bed.add_pod("a", Ipv4Addr::new(10, 0, 0, 1), None).is_err());
    assert!(
        bed.add_pod("a", Ipv4Addr::new(198, 18, 10, 1), Some(v6("fd00::1")))
            .is_err()
    );
    assert!(bed.add_pod("a", NODE_IPV4, None).is_err());
    assert!(
        bed.add_pod("bad name", Ipv4Addr::new(198, 18, 10, 1), None)
            .is_err()
    );
    bed.add_pod("a", Ipv4Addr::new(198, 18, 10, 1), None)
        .unwrap();
    assert!(
        bed.add_pod("a", Ipv4Addr::new(198, 18, 10, 2), None)
            .is_err(),
        "duplicate name"
    );
    assert!(
        bed.add_pod("b", Ipv4Addr::new(198, 18, 10, 1), None)
            .is_err(),
        "duplicate address"
    );
    assert!(bed.pods().len() == 1);
}

#[test]
fn reap_stale_removes_what_dead_processes_left() {
    let mut child = Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let me = std::process::id();
    let cg2 = cgroup::cgroup2_mount().unwrap();

    // Leftovers of a dead pid, and of a pid reused by someone else (us, with a wrong start
    // time on record); and a live bed's that must stay.
    let stale_ids = [
        format!("fp-stale-{dead}-0"),
        format!("fp-reused-{me}-999999"),
    ];
    let live_id = format!("fp-live-{me}-999998");
    for id in stale_ids.iter().chain([&live_id]) {
        netns::add(&format!("{id}-node")).unwrap();
        cgroup::create(&cg2.join(id).join("client")).unwrap();
        fs::create_dir_all(Path::new(RUN_DIR).join(id)).unwrap();
    }
    fs::write(
        Path::new(RUN_DIR).join(&stale_ids[1]).join("owner"),
        format!("{me} 1\n"),
    )
    .unwrap();
    let start = fs::read_to_string(format!("/proc/{me}/stat")).unwrap();
    let start = start[start.rfind(')').unwrap() + 1..]
        .split_whitespace()
        .nth(19)
        .unwrap()
        .to_string();
    fs::write(
        Path::new(RUN_DIR).join(&live_id).join("owner"),
        format!("{me} {start}\n"),
    )
    .unwrap();

    let reaped = reap_stale().unwrap();
    for id in &stale_ids {
        assert_eq!(
            traces(id),
            Vec::<String>::new(),
            "{id} not reaped; reaped {reaped:?}"
        );
    }
    assert_eq!(
        traces(&live_id).len(),
        3,
        "a live owner's things were reaped"
    );

    netns::delete(&format!("{live_id}-node")).unwrap();
    cgroup::remove_tree(&cg2.join(&live_id), Duration::from_secs(2)).unwrap();
    fs::remove_dir_all(Path::new(RUN_DIR).join(&live_id)).unwrap();
}

#[test]
fn in_netns_runs_in_the_namespace() {
    let bed = Testbed::new("inns").unwrap();
    let links = netns::in_netns(bed.node_netns(), || {
        fs::read_to_string("/proc/thread-self/net/dev").unwrap()
    })
    .unwrap();
    // A fresh namespace has only loopback.
    assert_eq!(
        links.lines().filter(|l| l.contains(':')).count(),
        1,
        "{links}"
    );
    assert!(netns::in_netns("fp-no-such-namespace", || ()).is_err());
}

#[test]
fn a_panicking_test_leaves_nothing() {
    let id = std::sync::Mutex::new(String::new());
    let result = std::panic::catch_unwind(|| {
        let mut bed = Testbed::new("panic").unwrap();
        *id.lock().unwrap() = bed.id().to_string();
        bed.add_pod("a", Ipv4Addr::new(198, 18, 11, 1), None)
            .unwrap();
        panic!("on purpose");
    });
    assert!(result.is_err());
    assert_eq!(traces(&id.lock().unwrap()), Vec::<String>::new());
}

#[test]
fn node_namespace_forwards() {
    let bed = Testbed::new("fwd").unwrap();
    for key in ["ipv4/ip_forward", "ipv6/conf/all/forwarding"] {
        let value = netns::in_netns(bed.node_netns(), || {
            fs::read_to_string(format!("/proc/sys/net/{key}")).unwrap()
        })
        .unwrap();
        assert_eq!(value.trim(), "1", "{key}");
    }
}

/// `serve` waits for "ready", reports a server that dies first, and kills servers on drop.
#[test]
fn serve_waits_for_ready() {
    use std::os::unix::fs::PermissionsExt as _;
    let mut bed = Testbed::new("serve").unwrap();
    let pod = bed
        .add_pod("a", Ipv4Addr::new(198, 18, 12, 1), None)
        .unwrap();
    let fake = bed.dir().join("fake-probe");
    fs::write(
        &fake,
        "#!/bin/sh\necho starting\necho ready\nexec sleep 60\n",
    )
    .unwrap();
    fs::set_permissions(&fake, fs::Permissions::from_mode(0o755)).unwrap();
    let pid = bed.serve(&fake, &pod, &["--tcp", "0.0.0.0:1"]).unwrap();
    assert_eq!(cgroup::procs_recursive(bed.helper_cgroup()), vec![pid]);

    let err = bed
        .serve(Path::new("/bin/false"), &pod, &["--tcp", "0.0.0.0:1"])
        .unwrap_err();
    assert!(
        format!("{err:#}").contains("exited before it was ready"),
        "{err:#}"
    );

    let helpers = bed.helper_cgroup().to_path_buf();
    drop(bed);
    assert!(!helpers.exists());
}

/// `fastpath-probe` of this build: next to the folder holding this test's executable
/// (`<target>/<profile>/deps/`). xtask cannot depend on proxy-userland, so if it is not
/// built yet we build it there.
fn probe_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap();
    let probe = profile_dir.join("fastpath-probe");
    if !probe.is_file() {
        let mut build = xtask::cargo();
        build.args(["build", "-p", "proxy-userland", "--bin", "fastpath-probe"]);
        build.arg("--target-dir").arg(profile_dir.parent().unwrap());
        if profile_dir.ends_with("release") {
            build.arg("--release");
        }
        eprintln!("building `{}`", xtask::cmd::describe(&build));
        xtask::cmd::run(&mut build).unwrap();
    }
    assert!(probe.is_file(), "no {}", probe.display());
    probe
}

/// Runs the probe client in `netns` (no cgroup) and parses its lines.
fn probe_from(probe_bin: &Path, netns: &str, args: &[&str]) -> Vec<probe::Outcome> {
    let mut cmd = Command::new(probe_bin);
    cmd.arg("--netns").arg(netns).args(args);
    let outcomes = probe::parse(&xtask::cmd::output(&mut cmd).unwrap());
    assert!(!outcomes.is_empty(), "probe printed no result for {args:?}");
    outcomes
}

/// Packets (received, sent) by interface `dev` of namespace `netns`.
fn packets(netns: &str, dev: &str) -> (u64, u64) {
    let table = netns::in_netns(netns, || {
        fs::read_to_string("/proc/thread-self/net/dev").unwrap()
    })
    .unwrap();
    let line = table
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix(&format!("{dev}:"))
                .map(str::to_string)
        })
        .unwrap_or_else(|| panic!("no {dev} in netns {netns}: {table}"));
    let fields: Vec<u64> = line
        .split_whitespace()
        .map(|f| f.parse().unwrap())
        .collect();
    (fields[1], fields[9])
}

/// A pod on a second node is reached from a client of the bed through node A (the bed's node
/// namespace) and node B, keeps the client's address, and goes with the bed.
#[test]
fn pods_on_a_peer_node_are_reached_through_both_nodes() {
    let probe_bin = probe_binary();
    let mut bed = Testbed::new("peer").unwrap();
    let id = bed.id().to_string();
    let ext = bed
        .add_pod("ext", Ipv4Addr::new(198, 18, 2, 1), None)
        .unwrap();
    let b = bed
        .add_peer_node("b", Ipv4Addr::new(198, 18, 13, 1))
        .unwrap();
    assert_eq!(
        (b.netns.clone(), b.bed_veth.as_str()),
        (format!("{id}-n-b"), "fpn0")
    );
    let web = bed
        .add_pod_on(&b, "web", Ipv4Addr::new(198, 18, 13, 10))
        .unwrap();
    let db = bed
        .add_pod_on(&b, "db", Ipv4Addr::new(198, 18, 13, 11))
        .unwrap();
    assert_eq!(
        (web.node_veth.as_str(), db.node_veth.as_str()),
        ("fpv0", "fpv1")
    );
    assert_eq!(bed.pods().len(), 3);
    let forwarding = netns::in_netns(&b.netns, || {
        fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap()
    })
    .unwrap();
    assert_eq!(forwarding.trim(), "1");

    // Clashes with the peer node's or the pods' names and addresses, and foreign ranges.
    for (what, result) in [
        (
            "peer at a pod's address",
            bed.add_peer_node("c", ext.ipv4).err(),
        ),
        (
            "peer at the node's address",
            bed.add_peer_node("c", NODE_IPV4).err(),
        ),
        (
            "peer outside the range",
            bed.add_peer_node("c", Ipv4Addr::new(10, 0, 0, 1)).err(),
        ),
        (
            "second peer b",
            bed.add_peer_node("b", Ipv4Addr::new(198, 18, 14, 1)).err(),
        ),
        (
            "pod at the peer's address",
            bed.add_pod("x", b.ipv4, None).err(),
        ),
        (
            "pod on b named ext",
            bed.add_pod_on(&b, "ext", Ipv4Addr::new(198, 18, 13, 12))
                .err(),
        ),
        (
            "pod on b at db's address",
            bed.add_pod_on(&b, "x", db.ipv4).err(),
        ),
    ] {
        assert!(result.is_some(), "{what} was accepted");
    }
    let mut stranger = b.clone();
    stranger.netns = format!("{id}-n-nowhere");
    assert!(
        bed.add_pod_on(&stranger, "x", Ipv4Addr::new(198, 18, 13, 12))
            .is_err()
    );

    bed.serve(
        &probe_bin,
        &web,
        &[
            "--tcp",
            "198.18.13.10:8080",
            "--udp",
            "198.18.13.10:5353",
            "--echo-peer",
        ],
    )
    .unwrap();
    let before = [packets(bed.node_netns(), "fpn0"), packets(&b.netns, "fpv0")];
    let got = probe_from(
        &probe_bin,
        &ext.netns,
        &[
            "tcp",
            "198.18.13.10:8080",
            "--count",
            "3",
            "--timeout-ms",
            "2000",
        ],
    );
    let udp = probe_from(
        &probe_bin,
        &ext.netns,
        &["udp", "198.18.13.10:5353", "--timeout-ms", "2000"],
    );
    for outcome in got.iter().chain(&udp) {
        assert_eq!(outcome.name(), Some("web"), "{outcome:?}");
        let seen: SocketAddr = outcome.seen_from().unwrap().parse().unwrap();
        assert_eq!(seen.ip(), std::net::IpAddr::from(ext.ipv4), "{outcome:?}");
    }
    // Both ways through node A's link to B and B's link to the pod.
    let after = [packets(bed.node_netns(), "fpn0"), packets(&b.netns, "fpv0")];
    for (before, after) in before.iter().zip(&after) {
        assert!(
            after.0 >= before.0 + 4 && after.1 >= before.1 + 4,
            "{before:?} -> {after:?}"
        );
    }

    // Node A reaches the other pod directly, from its own address; plain sockets.
    let addr = SocketAddr::from((db.ipv4, 7000));
    let listener = netns::in_netns(&db.netns, || TcpListener::bind(addr))
        .unwrap()
        .unwrap();
    let client = netns::in_netns(bed.node_netns(), || {
        TcpStream::connect_timeout(&addr, Duration::from_secs(2))
    })
    .unwrap()
    .unwrap();
    let (_conn, from) = listener.accept().unwrap();
    assert_eq!(from.ip(), std::net::IpAddr::from(NODE_IPV4));
    drop((client, listener));

    // Nothing routes outside the test ranges in the peer node or its pods.
    for ns in [&b.netns, &web.netns] {
        let out = xtask::cmd::ip(["-n", ns, "route", "get", "192.0.2.1"]);
        assert!(out.is_err(), "{ns} has a route to 192.0.2.1: {out:?}");
    }

    assert!(traces(&id).iter().any(|t| t.ends_with("-n-b")));
    bed.close().unwrap();
    assert_eq!(traces(&id), Vec::<String>::new());
}
