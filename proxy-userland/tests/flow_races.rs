//! The packet path's flow table with both CPUs translating one connection at once: the
//! client's packets are translated on the CPU that sends them, the server's on the one
//! that answers, each stamping the entries with its own reading of the clock.

mod common;
mod nat_common;

use common::*;
use proxy_userland::dataplane::{
    Dataplane, Scope,
    bpf::{AttachOptions, BpfDataplane, PodPathConfig},
};

fn connect(client: &xtask::testbed::Pod, target: &str, n: usize) -> Vec<xtask::probe::Outcome> {
    nat_common::probe_from(
        &client.netns,
        &["tcp", target, "--count", &n.to_string(), "--reset"],
    )
}

/// Each TCP connection through the pod path stays one flow from its SYN to its reset.
///
/// A reply entry stamped by the server's CPU after the client's packet had read its clock
/// looked ~584 years old to that packet (a wrapping difference), so the client's packet
/// started the flow over: 2 to 12 extra flows in half the rounds of 2,200 connections. The
/// flow started over had a reply entry that was never answered and never closed, and it
/// turned a later direct connection's SYN-ACK, from the same client port, into the
/// ClusterIP's: that connection timed out (about 1 in 2,000, `packet_hook_cost`'s flake).
/// `bpf_stats` on, as `packet_hook_cost` has it, widens the window between a program's
/// clock and the other CPU's writes.
#[test]
fn every_connection_stays_one_flow_while_both_cpus_translate_it() {
    let (mut bed, _pods) = bed_with_pods("flowrace", 1);
    let client = bed.add_pod("client", pod_ip(9), None).expect("client pod");
    let _stats = BpfStatsOn::enable();
    let direct = format!("{}:8080", pod_ip(1));
    for round in 0..4 {
        let opts = AttachOptions {
            pods: Some(PodPathConfig {
                netns: Some(bed.node_netns().to_string()),
                prefixes: vec!["fpv".into()],
                ..PodPathConfig::default()
            }),
            ..AttachOptions::default()
        };
        let mut dp = BpfDataplane::attach_with(bed.cgroup_path(), &opts).expect("attach");
        let eps = web_endpoints(vec![ready(pod_ip(1))]);
        let state = state_of(vec![(web_service("web", WEB_IP), Some(eps))]);
        assert!(dp.sync(&state, &node(), Scope::Full).failed.is_empty());
        let through = connect(&client, WEB, 2200);
        assert!(
            through.len() == 2200 && through.iter().all(|o| o.is_ok()),
            "round {round}: every connection to the ClusterIP succeeds: {:?}",
            through.iter().find(|o| !o.is_ok())
        );
        let flows = dp.programmer().maps().packet_stats().new_flows;
        assert_eq!(
            flows, 2200,
            "round {round}: 2,200 connections made {flows} flows: live ones were started over"
        );
        // The same client ports, now to the pod itself: no entry of the flows above may
        // turn these connections' answers into the ClusterIP's.
        let straight = connect(&client, &direct, 2000);
        let failed: Vec<_> = straight.iter().filter(|o| !o.is_ok()).collect();
        assert!(
            straight.len() == 2000 && failed.is_empty(),
            "round {round}: {} of 2,000 direct connections failed: {failed:?}",
            failed.len()
        );
    }
}
