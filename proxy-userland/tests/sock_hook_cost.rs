//! What the socket hooks cost per connection as the service count grows, measured in the
//! kernel (`kernel.bpf_stats_enabled`: each program's run_time_ns and run_cnt), which a
//! shared, busy machine disturbs far less than wall-clock rates. Issue 23 point 5: from
//! outside, dialling a pod IP through the hooks lost 4.4% at 10,000 services and nothing at
//! 1, so the per-call cost must not grow with the service count.

mod common;
#[path = "../benches/support/synthetic.rs"]
mod synthetic;

use common::*;
use proxy_userland::dataplane::{Dataplane, Scope, bpf::BpfDataplane};

const POD: &str = "198.18.1.11:8080";
const CONNECTIONS: usize = 2000;
/// cgroup sock_addr programs: connect4 and getpeername4 run for a TCP connect.
const SOCK_ADDR: u64 = 18;
/// cgroup sock programs: sock_release runs when the socket closes.
const CGROUP_SOCK: u64 = 9;

/// ns per hook run and runs per connection, over `count` connections to `target`; the
/// sock_release program's ns per run is printed beside them.
fn measure(bed: &xtask::testbed::Testbed, target: &str, count: usize) -> (f64, f64) {
    let (ns0, cnt0) = prog_stats(SOCK_ADDR);
    let (rel_ns0, rel_cnt0) = prog_stats(CGROUP_SOCK);
    let outcomes = run_probe(
        bed,
        &[
            "tcp",
            target,
            "--count",
            &count.to_string(),
            "--timeout-ms",
            "1000",
            "--reset",
        ],
    );
    assert!(
        outcomes.iter().all(|o| o.is_ok()),
        "every connection succeeds"
    );
    let (ns1, cnt1) = prog_stats(SOCK_ADDR);
    let (rel_ns1, rel_cnt1) = prog_stats(CGROUP_SOCK);
    if count >= CONNECTIONS {
        let rel_runs = (rel_cnt1 - rel_cnt0).max(1);
        eprintln!(
            "  {target}: sock_release {:.0} ns/run, {:.2} runs/conn",
            (rel_ns1 - rel_ns0) as f64 / rel_runs as f64,
            rel_runs as f64 / count as f64
        );
    }
    let runs = (cnt1 - cnt0).max(1);
    ((ns1 - ns0) as f64 / runs as f64, runs as f64 / count as f64)
}

#[test]
fn socket_hook_cost_does_not_grow_with_services() {
    let (bed, _pods) = bed_with_pods("hookcost", 1);
    let _stats = BpfStatsOn::enable();
    let mut per_call = Vec::new();
    for n in [1u32, 1_000, 10_000] {
        let mut state = synthetic::state(n - 1, 0);
        let eps = web_endpoints(vec![ready(pod_ip(1))]);
        synthetic::merge(
            &mut state,
            state_of(vec![(web_service("web", WEB_IP), Some(eps))]),
        );
        let mut dp = BpfDataplane::attach(bed.cgroup_path()).expect("programs attach");
        let report = dp.sync(&state, &node(), Scope::Full);
        assert!(report.failed.is_empty(), "{report:?}");
        // Warm the maps' and the stack's caches before counting.
        measure(&bed, POD, 200);
        let (pod_ns, pod_runs) = measure(&bed, POD, CONNECTIONS);
        let (svc_ns, svc_runs) = measure(&bed, WEB, CONNECTIONS);
        eprintln!(
            "hook cost at {n} services: pod IP {pod_ns:.0} ns/run ({pod_runs:.2} runs/conn), \
             ClusterIP {svc_ns:.0} ns/run ({svc_runs:.2} runs/conn)"
        );
        per_call.push((n, pod_ns, svc_ns));
        if n == 10_000 {
            // A long-running node: more translated connections than the reverse-NAT map
            // holds, each closed. Before the sock_release hook every one left its entry, the
            // LRU map was full and each new connect evicted one: the hooks cost about twice
            // as much (422 and 702 ns).
            let fill = proxy_common::maps::SOCK_REVNAT_MAX as usize + 10_000;
            // The probe makes at most 10,000 connections a run.
            for _ in 0..fill.div_ceil(10_000) {
                measure(&bed, WEB, 10_000);
            }
            let left = dp.programmer().maps().occupancy().sock_revnat;
            eprintln!("reverse-NAT entries after {fill} closed connections: {left}");
            assert!(
                left < 1_000,
                "closed sockets keep their reverse-NAT entries: {left} after {fill} connections"
            );
            // A run's cost on this VM can double for a few seconds (a 1,589 ns ClusterIP
            // run against 618 ns the next minute): a pair over the bound below is measured
            // again, up to twice. A full map is over it every time.
            let (_, pod_fresh, svc_fresh) = per_call[per_call.len() - 1];
            let mut after = (0.0, 0.0);
            for _ in 0..3 {
                let (pod_ns, _) = measure(&bed, POD, CONNECTIONS);
                let (svc_ns, _) = measure(&bed, WEB, CONNECTIONS);
                eprintln!(
                    "hook cost at {n} services, after {fill} connections: pod IP {pod_ns:.0} \
                     ns/run, ClusterIP {svc_ns:.0} ns/run"
                );
                after = (pod_ns, svc_ns);
                if busy_costs_as_fresh(after, (pod_fresh, svc_fresh)) {
                    break;
                }
            }
            per_call.push((n, after.0, after.1));
        }
        drop(dp);
    }
    let (_, pod1, svc1) = per_call[0];
    let (_, pod10k, svc10k) = per_call[2];
    let (_, pod_after, svc_after) = per_call[3];
    // A busy node's hooks cost what a fresh one's do.
    assert!(
        busy_costs_as_fresh((pod_after, svc_after), (pod10k, svc10k)),
        "after many connections: pod IP {pod_after:.0} ns/run (fresh {pod10k:.0}), \
         ClusterIP {svc_after:.0} ns/run (fresh {svc10k:.0})"
    );
    // Slack for a shared machine's noise; a lookup that grew with the count would be far
    // above it (the outside measurement implied ~3 us per connect at 10,000).
    assert!(
        pod10k < pod1 * 2.0 + 200.0,
        "pod IP: {pod10k:.0} ns/run at 10,000 services against {pod1:.0} at 1"
    );
    assert!(
        svc10k < svc1 * 2.0 + 200.0,
        "ClusterIP: {svc10k:.0} ns/run at 10,000 services against {svc1:.0} at 1"
    );
}

/// Whether the (pod IP, ClusterIP) ns per run after many connections are within half again
/// (and 100 ns) of a fresh node's.
fn busy_costs_as_fresh(after: (f64, f64), fresh: (f64, f64)) -> bool {
    after.0 < fresh.0 * 1.5 + 100.0 && after.1 < fresh.1 * 1.5 + 100.0
}
