//! A full BPF map fails the services that do not fit, one by one and whole, with a clear
//! error; the rest keep working, and the failed ones are programmed once there is room.

mod common;

use std::{collections::BTreeSet, net::Ipv4Addr};

use common::*;
use proxy_userland::{
    dataplane::{
        Dataplane, Scope,
        bpf::{
            AttachOptions, BpfDataplane,
            flow_gc::{FlowTables, monotonic_ns},
            program::Frontend,
        },
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

/// The packet path's flow table, as shipped but made small (`bpfCtMax: 64` in the
/// ConfigMap: 32 flows) so that one pod's UDP fills it through the pod path: a new flow
/// that finds the table full is dropped and counted; within a second the collector makes
/// room (the longest idle flows go, as an LRU map's would) and says so in the log; new
/// flows are served again, and a client that keeps sending through one socket keeps its
/// flow throughout.
#[test]
fn a_full_flow_table_drops_new_flows_until_the_collector_makes_room() {
    let (bed, client) = bed_with_client("ctfull", false);
    let dir = manifest_dir("ctfull");
    std::fs::write(
        dir.0.join("web.yaml"),
        web_manifest(&[pod_ip(1), pod_ip(2)]),
    )
    .unwrap();
    let metrics_port = free_port();
    // Set where an operator would: in the ConfigMap.
    let small = |config: &str| {
        let edited = config.replace("bpfCtMax: 262144", "bpfCtMax: 64");
        assert_ne!(edited, config, "the ConfigMap sets bpfCtMax");
        edited
    };
    let shipped = start_as_configured(
        &bed,
        &small,
        &[
            &format!("--manifests={}", dir.0.display()),
            &format!("--metrics-bind-address=127.0.0.1:{metrics_port}"),
            // The packet counters reach /metrics with each sync.
            "--sync-period=2s",
        ],
    );
    let log = || shipped.daemon.log();
    let once = ["udp", WEB_DNS, "--count", "1", "--timeout-ms", "300"];
    assert!(
        eventually(20, || pod_probe(&bed, &client, &once)[0].is_ok()),
        "the Service never answered; log:\n{}",
        log()
    );
    // One socket, a datagram every 100 ms for the whole test.
    let busy = pod_client(&bed, &client)
        .args([
            "udp",
            WEB_DNS,
            "--connected",
            "--count",
            "80",
            "--interval-ms",
            "100",
            "--timeout-ms",
            "500",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("probe runs");
    std::thread::sleep(std::time::Duration::from_millis(300));
    // A socket per request, as many short-lived clients (each a flow of its own).
    let fresh = |count: &str| {
        let args = ["udp", WEB_DNS, "--fresh-socket", "--count", count];
        pod_probe(
            &bed,
            &client,
            &[&args[..], &["--timeout-ms", "300"]].concat(),
        )
    };
    let many = fresh("60");
    let answered = many.iter().filter(|o| o.is_ok()).count();
    assert!(
        answered < many.len(),
        "60 new flows fit a table of 32; log:\n{}",
        log()
    );
    // More flows were served than the table holds: the collector made room.
    assert!(
        answered > 32,
        "{answered} of 60 new flows answered; log:\n{}",
        log()
    );
    assert!(
        log().contains("the flow table was full"),
        "the log says what happened; log:\n{}",
        log()
    );
    let busy = busy.wait_with_output().expect("busy client ends");
    let busy = xtask::probe::parse(&String::from_utf8_lossy(&busy.stdout));
    assert_eq!(busy.len(), 80);
    assert!(
        busy.iter().all(|o| o.is_ok()),
        "the busy client's flow was never evicted: {:?}",
        busy.iter().filter(|o| !o.is_ok()).collect::<Vec<_>>()
    );
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let after = fresh("5");
    assert!(
        after.iter().all(|o| o.is_ok()),
        "new flows are served once there is room: {after:?}"
    );
    let dropped = || {
        let text = http_get(bed.node_netns(), metrics_port, "/metrics");
        text.lines()
            .find_map(|l| {
                l.strip_prefix("fastpath_packets_total{result=\"dropped_flow_table_full\"} ")
            })
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert!(
        eventually(10, || dropped() >= 1.0),
        "the drops are counted; metrics:\n{}",
        http_get(bed.node_netns(), metrics_port, "/metrics")
    );
    drop(shipped);
}

/// The collector's sweep of a flow table of the size shipped (262,144 entries), 77% full,
/// as the kernel holds it (a preallocated hash map, read in batches): exactly the flows
/// the programs would start over go (idle past their timeout, or a forward entry whose
/// reply entry is gone); a flow stays while either of its entries saw a packet in time.
/// Prints how long the sweep took.
#[test]
fn a_sweep_of_a_full_size_flow_table_deletes_exactly_the_flows_past_their_time() {
    use std::{collections::HashSet, sync::atomic::AtomicBool, time::Instant};

    use aya::maps::{HashMap, Map, MapData, PerCpuArray};
    use proxy_common::{CtKey, CtValue, maps::CT_MAX, nat, proto};

    let table = |name, key, value, max| {
        let data = MapData::from_fd(create_map(BPF_MAP_TYPE_HASH, name, key, value, max));
        Map::HashMap(data.expect("an aya map of the new one"))
    };
    let mut ct4: HashMap<MapData, CtKey<u32>, CtValue<u32>> =
        HashMap::try_from(table("FP_CT4", 16, 32, CT_MAX)).unwrap();
    let ct6 = HashMap::try_from(table("FP_CT6", 40, 56, 16)).unwrap();
    let stats = MapData::from_fd(create_map(BPF_MAP_TYPE_PERCPU_ARRAY, "FP_STATS", 4, 8, 16));
    let stats = PerCpuArray::try_from(Map::PerCpuArray(stats.unwrap())).unwrap();

    let now = monotonic_ns();
    let past = now.saturating_sub(nat::CT_UDP_TIMEOUT_NS + 60_000_000_000);
    let frontend = u32::from(Ipv4Addr::new(198, 19, 0, 1)).to_be();
    let backend = u32::from(Ipv4Addr::new(198, 18, 1, 2)).to_be();
    // Flow i: a UDP client in 198.18.128.0/17 to the frontend, answered by the backend.
    let flow = |i: u32| {
        let client = (u32::from(Ipv4Addr::new(198, 18, 128, 0)) + i / 50_000).to_be();
        let key = CtKey {
            saddr: client,
            daddr: frontend,
            sport: (10_000 + (i % 50_000) as u16).to_be(),
            dport: 53u16.to_be(),
            proto: proto::UDP,
            dir: nat::dir::FORWARD,
            _pad: [0; 2],
        };
        let forward = CtValue {
            addr: backend,
            port: 5353u16.to_be(),
            ..Default::default()
        };
        let reply_key = forward.reply_key(false, key.saddr, key.sport, key.proto);
        let reply = CtValue {
            addr: frontend,
            port: 53u16.to_be(),
            flags: nat::ct_flags::SEEN_REPLY,
            ..Default::default()
        };
        (key, forward, reply_key, reply)
    };
    // 0..30,000 idle past the timeout; 30,000..65,000 live; 65,000..100,000 live by their
    // reply entries alone; 100,000..101,000 forward entries whose reply entry is gone.
    let mut kept = HashSet::new();
    for i in 0..101_000 {
        let (key, mut forward, reply_key, mut reply) = flow(i);
        let (forward_seen, reply_seen) = match i {
            0..30_000 => (past, past),
            30_000..65_000 => (now, now),
            65_000..100_000 => (past, now),
            _ => (now, now),
        };
        forward.last_seen_ns = forward_seen;
        reply.last_seen_ns = reply_seen;
        ct4.insert(key, forward, 0).unwrap();
        if i < 100_000 {
            ct4.insert(reply_key, reply, 0).unwrap();
        }
        if (30_000..100_000).contains(&i) {
            kept.insert(key);
            kept.insert(reply_key);
        }
    }

    let mut tables = FlowTables { ct4, ct6, stats };
    let started = Instant::now();
    let done = tables.sweep(&AtomicBool::new(false));
    let took = started.elapsed();
    println!(
        "swept 201,000 entries of {CT_MAX} ({} flows expired, {} entries left) in {} ms",
        30_000 + 1_000,
        done.left,
        took.as_millis()
    );
    assert_eq!(done.evicted, 0, "77% full: nothing evicted");
    assert_eq!(done.left, kept.len(), "{done:?}");
    let left: HashSet<CtKey<u32>> = tables.ct4.keys().map(Result::unwrap).collect();
    assert_eq!(left.len(), kept.len());
    let missing = kept.difference(&left).count();
    let extra = left.difference(&kept).count();
    assert_eq!((missing, extra), (0, 0), "live flows lost, dead ones kept");
}
