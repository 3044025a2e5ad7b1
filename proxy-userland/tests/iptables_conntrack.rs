//! The iptables proxier's UDP conntrack clean-up with a real conntrack table: entries made
//! by real datagrams through the proxier's rules, in a test bed's node namespace.

mod common;
mod nat_common;

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, UdpSocket},
    ops::Range,
    time::{Duration, Instant},
};

use common::*;
use nat_common::*;
use proxy_userland::dataplane::{
    Dataplane, Scope,
    iptables::{Family, IptablesConfig, IptablesDataplane},
    netns::in_netns,
};

/// One datagram to `to` from each source port in `ports`, each from a socket of its own,
/// as many clients (or one resolver's queries) leave them: one conntrack entry per port.
/// Returns how many were sent.
fn udp_clients(netns: &str, to: &str, ports: Range<u16>) -> usize {
    in_netns(Some(netns), || {
        ports
            .filter(|&port| {
                UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port))
                    .and_then(|s| s.send_to(b"q", to))
                    .is_ok()
            })
            .count()
    })
    .expect("enter the node namespace")
}

/// The node's UDP conntrack entries to `dst` (ip:port) whose replies come from `reply_src`
/// (an ip), as `conntrack -L` shows them.
fn entries(netns: &str, dst: &str, reply_src: &str) -> usize {
    let (ip, port) = dst.rsplit_once(':').expect("ip:port");
    let mut cmd = std::process::Command::new("ip");
    cmd.args(["netns", "exec", netns, "conntrack", "-L", "-p", "udp"]);
    // conntrack prints its summary on stderr; the entries on stdout.
    let out = xtask::cmd::output(&mut cmd).unwrap_or_default();
    out.lines()
        .filter(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            // The nth `key=value` of the line: the original direction's come first.
            let field =
                |key: &str, nth: usize| words.iter().filter_map(|w| w.strip_prefix(key)).nth(nth);
            field("dst=", 0) == Some(ip)
                && field("dport=", 0) == Some(port)
                && field("src=", 1) == Some(reply_src)
        })
        .count()
}

/// When a node's pods are lost, every UDP client of their services leaves a conntrack entry
/// to a dead address. One `conntrack -D` process per entry made 109 of them cost a sync
/// 2.5 s, and the 2,000 a sync allowed about 30 s, with every other change waiting. Over
/// ctnetlink, in one batch, 2,000 go within a second; entries of other services and to
/// other addresses stay.
#[test]
fn a_sync_deletes_two_thousand_stale_udp_entries_within_a_second() {
    const STALE: u16 = 2000;
    let (bed, _pods) = bed_with_pods("iptctbatch", 2);
    route_services(&bed);
    let mut dp = IptablesDataplane::new(IptablesConfig {
        netns: Some(bed.node_netns().to_string()),
        families: vec![Family::V4],
        cleanup_on_exit: true,
        ..Default::default()
    })
    .expect("iptables proxier in the node namespace");
    let web = web_service("web", WEB_IP);
    let other = web_service("other", Ipv4Addr::new(198, 19, 0, 11));
    let with_web_on = |pod| {
        state_of(vec![
            (web.clone(), Some(web_endpoints(vec![ready(pod_ip(pod))]))),
            (other.clone(), Some(web_endpoints(vec![ready(pod_ip(2))]))),
        ])
    };
    let report = dp.sync(&with_web_on(1), &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");

    let ns = bed.node_netns();
    let (pod1, pod2) = (pod_ip(1).to_string(), pod_ip(2).to_string());
    let direct = format!("{pod2}:5353");
    // Ports outside the ephemeral range, so none is taken.
    assert_eq!(
        udp_clients(ns, WEB_DNS, 20_000..20_000 + STALE),
        usize::from(STALE)
    );
    assert_eq!(udp_clients(ns, "198.19.0.11:53", 23_000..23_050), 50);
    assert_eq!(udp_clients(ns, &direct, 24_000..24_050), 50);
    assert_eq!(
        entries(ns, WEB_DNS, &pod1),
        usize::from(STALE),
        "one entry per client, translated to pod-1"
    );
    assert_eq!(entries(ns, "198.19.0.11:53", &pod2), 50);
    assert_eq!(entries(ns, &direct, &pod2), 50);

    // pod-1 is lost and replaced by pod-2.
    let changed = BTreeSet::from([web.key.clone()]);
    let started = Instant::now();
    let report = dp.sync(&with_web_on(2), &node(), Scope::Changed(&changed));
    let took = started.elapsed();
    println!("the sync that deleted {STALE} stale UDP conntrack entries took {took:?}");
    assert!(report.failed.is_empty(), "{report:?}");
    // First: after the ~30 s a process per entry took, the UDP timeout (30 s) would have
    // removed every entry, stale or not.
    assert!(
        took < Duration::from_secs(1),
        "the sync took {took:?} to delete {STALE} entries"
    );

    assert_eq!(entries(ns, WEB_DNS, &pod1), 0, "no entry to pod-1 is left");
    assert_eq!(
        entries(ns, "198.19.0.11:53", &pod2),
        50,
        "the other service's entries stay"
    );
    assert_eq!(entries(ns, &direct, &pod2), 50, "untranslated entries stay");
}
