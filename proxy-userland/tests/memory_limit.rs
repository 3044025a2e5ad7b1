//! The daemon inside the DaemonSet's memory limit at scale: the real binary run as deploy/
//! runs it (the ConfigMap's config, the DaemonSet's capabilities, maps pinned), fed over
//! list/watch by the in-repo API server, in a memory cgroup limited to the daemon
//! container's `resources.limits.memory` read from deploy/daemonset.yaml, as the kubelet
//! would make it. Kernels since 5.11 charge BPF maps to the memory cgroup of the process
//! that creates them, so the preallocated maps count against the limit with the heap.
//!
//! It prints what it measured: the cgroup's peak (memory.peak or v1's
//! memory.max_usage_in_bytes), the highest of its samples, the daemon's VmRSS and VmHWM.

mod common;
#[path = "../benches/support/programmed.rs"]
mod programmed;

use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::{Duration, Instant},
};

use common::*;
use programmed::PinnedMaps;
use serde_json::{Value, json};
use xtask::{
    apiserver::ApiServer,
    memcg::{Hierarchy, MemoryCgroup},
    testbed::NODE_IPV4,
};

/// The daemon bench's largest row, and more than most large clusters hold: 50,000
/// Services, each of one port with 10 endpoints, 550,000 map entries (the maps sized to
/// 1,048,576 as an operator would size them, docs/deploying.md). It did not fit in 512Mi
/// until the daemon's heap shrank (2026-12-05: peak 521 MiB then, 456 MiB now); the test
/// ran 3 endpoints a Service until then.
const SERVICES: u32 = 50_000;
const ENDPOINTS: u32 = 10;
const NAMESPACE: &str = "scale";
/// Endpoint changes written after the first sync, at most [`CHURN_RATE`] a second.
const CHURN: u32 = 2_000;
const CHURN_RATE: u32 = 500;
/// Services deleted, and as many new ones created, among the churn.
const REPLACED: u32 = 100;

/// Service `i`'s ClusterIP: 198.19.1.0 upwards (198.19.0.x is the bed's own).
fn service_ip(i: u32) -> Ipv4Addr {
    let n = i + 256;
    Ipv4Addr::new(198, 19, (n >> 8) as u8, n as u8)
}

/// Endpoint `j` of service `i`, and its port. The test range holds fewer addresses than a
/// cluster this size has pods, so each block of services that uses up the 61,440 addresses
/// 198.18.16.0 - 198.18.255.255 takes them again on another port: every (address, port)
/// is its own backend, as every pod of a real cluster is.
fn endpoint(i: u32, j: u32) -> (Ipv4Addr, u16) {
    const ADDRESSES: u32 = 240 * 256;
    let n = 16 * 256 + (i * ENDPOINTS + j) % ADDRESSES;
    let port = 8080 + (i / (ADDRESSES / ENDPOINTS)) as u16;
    (Ipv4Addr::new(198, 18, (n >> 8) as u8, n as u8), port)
}

fn service_name(i: u32) -> String {
    format!("svc-{i}")
}

fn service(i: u32) -> Value {
    let ip = service_ip(i).to_string();
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": service_name(i), "namespace": NAMESPACE},
        "spec": {
            "type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]
        }
    })
}

fn slice(i: u32, ips: &[Ipv4Addr], port: u16) -> Value {
    let endpoints: Vec<Value> = ips
        .iter()
        .map(|ip| json!({"addresses": [ip.to_string()], "conditions": {"ready": true}, "nodeName": "node-b"}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{}-1", service_name(i)), "namespace": NAMESPACE,
                     "labels": {"kubernetes.io/service-name": service_name(i)}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints
    })
}

/// Service `i`'s slice as first created.
fn initial_slice(i: u32) -> Value {
    let (ips, ports): (Vec<Ipv4Addr>, Vec<u16>) = (0..ENDPOINTS).map(|j| endpoint(i, j)).unzip();
    slice(i, &ips, ports[0])
}

/// The Service the test connects through: the last one created, on the bed's pod `pod`.
const SAMPLE: u32 = SERVICES - 1;

fn sample_slice(pod: u8) -> Value {
    slice(SAMPLE, &[pod_ip(pod)], 8080)
}

/// The API server in the bed's node namespace (where the daemon runs), holding node-a and
/// the 50,000 Services with their slices; the history of the load dropped, as a
/// long-running server would have compacted it.
fn loaded_api_server(bed: &xtask::testbed::Testbed) -> ApiServer {
    let api = ApiServer::start_in(bed.node_netns(), NODE_IPV4.into()).expect("API server");
    api.create(
        "nodes",
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}}),
    );
    for i in 0..SERVICES {
        api.create("services", service(i));
        let slice = match i {
            SAMPLE => sample_slice(1),
            _ => initial_slice(i),
        };
        api.create("endpointslices", slice);
    }
    api.compact();
    api
}

/// `--bpf-lb-map-max` as docs/deploying.md sizes it: every frontend's master entry and one
/// per endpoint (50,000 x (1 + 3) = 200,000 here; the 150,000 backends need fewer),
/// rounded up to a power of two for headroom: 262,144.
fn lb_map_max() -> u32 {
    (SERVICES * (1 + ENDPOINTS)).next_power_of_two()
}

/// Whether GET /readyz on the daemon's health port in its namespace answers 200.
fn ready(netns: &str, port: u16) -> bool {
    let answer = http_get(netns, port, "/readyz");
    answer
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        == Some("200")
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

/// VmRSS and VmHWM of `pid`, in bytes.
fn rss_of(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Writes the churn: [`CHURN`] endpoint changes over the Services but the sample (one
/// endpoint replaced by a new address), [`REPLACED`] of those Services deleted and as many
/// new ones created, at most [`CHURN_RATE`] writes a second and for at most 60 s.
fn churn(api: &ApiServer) -> u32 {
    let period = Duration::from_secs(1) / CHURN_RATE;
    let begun = Instant::now();
    let mut writes = 0;
    for c in 0..CHURN {
        if begun.elapsed() > Duration::from_secs(60) {
            break;
        }
        let i = c.wrapping_mul(7_919) % SAMPLE;
        if c % (CHURN / REPLACED) == 0 {
            // A Service goes, and a new one comes on a ClusterIP past the others.
            api.delete(
                "endpointslices",
                Some(NAMESPACE),
                &format!("{}-1", service_name(i)),
            );
            api.delete("services", Some(NAMESPACE), &service_name(i));
            let new = SERVICES + c / (CHURN / REPLACED);
            api.create("services", service(new));
            api.create("endpointslices", initial_slice(new));
            writes += 4;
        } else {
            let (ips, ports): (Vec<Ipv4Addr>, Vec<u16>) = (0..ENDPOINTS)
                .map(|j| match j {
                    0 => (
                        Ipv4Addr::new(198, 18, 2 + (c / 250 % 2) as u8, (c % 250) as u8 + 1),
                        8080,
                    ),
                    _ => endpoint(i, j),
                })
                .unzip();
            // A Service deleted earlier has no slice to update: create it anew then.
            let _ = api.try_update("endpointslices", slice(i, &ips, ports[1]));
            writes += 1;
        }
        std::thread::sleep((period * (writes + 1)).saturating_sub(begun.elapsed()));
    }
    writes
}

/// 50,000 Services x 10 endpoints through the API server, then churn, with the daemon in a
/// memory cgroup limited to the DaemonSet's limit and its maps sized as the docs say:
/// never OOM-killed, still alive and ready, no Service refused, and a Service both seen in
/// the pinned maps and answering a real connection, before and after the churn.
#[test]
fn the_daemon_syncs_50000_services_within_the_daemonsets_memory_limit() {
    let limit = daemonset_memory_limit();
    let (bed, _pods) = bed_with_pods("memlimit", 2);
    let loading = Instant::now();
    let api = loaded_api_server(&bed);
    eprintln!(
        "memory_limit: API server loaded with {SERVICES} services x {ENDPOINTS} endpoints in {:.1} s",
        loading.elapsed().as_secs_f64()
    );
    let kubeconfig = bed.dir().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).expect("kubeconfig");
    let memcg =
        MemoryCgroup::create(&format!("{}-daemon", bed.id()), limit).expect("memory cgroup");
    // The daemon joins the group before its first instruction: the maps it creates at
    // start are charged there, as a container's are.
    let procs = memcg.procs_file();
    let join = [
        "sh",
        "-c",
        r#"echo $$ > "$0" && exec "$@""#,
        procs.to_str().unwrap(),
    ];
    let health_port = free_port();
    let map_max = lb_map_max();
    let started = Instant::now();
    let shipped = start_as_shipped_wrapped(
        &join,
        &bed,
        &[
            &format!("--kubeconfig={}", kubeconfig.display()),
            &format!("--bpf-lb-map-max={map_max}"),
            &format!("--healthz-bind-address=127.0.0.1:{health_port}"),
        ],
    );
    let daemon = &shipped.daemon;
    let pod = |name: &str| BTreeSet::from([name.to_string()]);
    let sample = format!("{}:80", service_ip(SAMPLE));

    // memory.current every 50 ms while the daemon works: the peak where the kernel keeps
    // none, and the shape of the run where it does.
    let stop = AtomicBool::new(false);
    let highest = AtomicU64::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(now) = memcg.current() {
                    highest.fetch_max(now, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        // Ends the sampling however this closure ends, a failed assertion included.
        let _stop = SetOnDrop(&stop);

        let synced = eventually(120, || {
            !daemon_alive(daemon) || ready(bed.node_netns(), health_port)
        }) && daemon_alive(daemon);
        let first_sync = started.elapsed();
        assert!(
            synced,
            "not ready {} s after start (alive: {}, OOM kills: {:?}); log:\n{}",
            first_sync.as_secs(),
            daemon_alive(daemon),
            memcg.oom_kills(),
            tail(&daemon.log())
        );
        let after_sync = memcg.current().unwrap_or(0);
        let (rss_sync, _) = rss_of(daemon.pid());
        // Programmed: a spread of the 50,000 in the pinned maps, and the sample answering.
        let maps = PinnedMaps::open(&shipped.pins.0.join("fastpath/maps-v1")).expect("pinned maps");
        let spread_in = || {
            (0..SAMPLE).step_by(997).all(|i| {
                let (ip, _) = endpoint(i, ENDPOINTS - 1);
                maps.holds(service_ip(i), 80, ip)
            })
        };
        assert!(
            eventually(30, spread_in),
            "services missing from the maps; log:\n{}",
            tail(&daemon.log())
        );
        assert!(
            eventually(20, || reached(&tcp(&bed, &sample, 1)) == pod("pod-1")),
            "{sample} never answered from pod-1; log:\n{}",
            tail(&daemon.log())
        );

        let churning = Instant::now();
        let writes = churn(&api);
        // Last, the sample moves to pod-2: the daemon followed the churn to its end.
        api.update("endpointslices", sample_slice(2));
        let moved = eventually(30, || reached(&tcp(&bed, &sample, 1)) == pod("pod-2"));
        let churn_secs = churning.elapsed().as_secs_f64();
        let still_ready = ready(bed.node_netns(), health_port);

        let oom_kills = memcg.oom_kills().expect("oom_kill count");
        let peak = memcg.peak().expect("peak");
        let (rss, hwm) = rss_of(daemon.pid());
        eprintln!(
            "memory_limit: {}, limit {:.0} MiB, --bpf-lb-map-max={map_max}: first sync {:.1} s, \
             {:.1} MiB charged after it (daemon VmRSS {:.1} MiB); {writes} churn writes in \
             {churn_secs:.1} s; peak {} MiB, highest sample {:.1} MiB, now {:.1} MiB; VmRSS \
             {:.1} MiB, VmHWM {:.1} MiB; OOM kills {oom_kills}",
            match memcg.hierarchy() {
                Hierarchy::V2 => "cgroup v2",
                Hierarchy::V1 => "cgroup v1 (hybrid host)",
            },
            mib(limit),
            first_sync.as_secs_f64(),
            mib(after_sync),
            mib(rss_sync),
            peak.map_or("not kept".into(), |p| format!("{:.1}", mib(p))),
            mib(highest.load(Ordering::Relaxed)),
            mib(memcg.current().unwrap_or(0)),
            mib(rss),
            mib(hwm),
        );
        assert_eq!(
            oom_kills,
            0,
            "the OOM killer struck; log:\n{}",
            tail(&daemon.log())
        );
        assert!(
            daemon_alive(daemon),
            "the daemon is gone; log:\n{}",
            tail(&daemon.log())
        );
        assert!(still_ready, "/readyz no longer 200 after the churn");
        assert!(
            moved,
            "{sample} never moved to pod-2 after the churn; log:\n{}",
            tail(&daemon.log())
        );
        let log = daemon.log();
        let refused: Vec<&str> = (log.lines())
            .filter(|l| l.contains("cannot program service"))
            .take(5)
            .collect();
        assert!(refused.is_empty(), "services refused: {refused:?}");
    });
    // The daemon goes (its pins unmounted), then its group.
    drop(shipped);
    drop(memcg);
}

/// Sets its flag when dropped.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Whether the daemon's process still runs (not gone, not a zombie).
fn daemon_alive(daemon: &Daemon) -> bool {
    std::fs::read_to_string(format!("/proc/{}/stat", daemon.pid()))
        .ok()
        .and_then(|stat| Some(stat.rsplit_once(") ")?.1.chars().next()? != 'Z'))
        .unwrap_or(false)
}

/// The last lines of a log, enough to see why it failed.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}
