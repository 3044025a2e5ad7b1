//! Shared by the iptables and userspace proxier tests: the test bed's node namespace made
//! to route service addresses, a client in another namespace, and reading the namespace's
//! tables back.
#![allow(dead_code)]

use std::{net::Ipv4Addr, process::Command};

use xtask::{
    probe::Outcome,
    testbed::{Pod, Testbed},
};

/// Routes 198.19.0.0/16 (the tests' service range) in the bed's node namespace into a veth
/// pair that stays inside it (the test kernel has no dummy devices). Without a route a
/// connect() to a cluster IP fails before the nat table can translate it; kube-proxy nodes
/// have a default route for that.
pub fn route_services(bed: &Testbed) {
    let ns = bed.node_netns();
    xtask::cmd::ip([
        "-n", ns, "link", "add", "fpsvc0", "type", "veth", "peer", "name", "fpsvc1",
    ])
    .expect("service route device");
    xtask::cmd::ip(["-n", ns, "link", "set", "fpsvc0", "up"]).expect("device up");
    xtask::cmd::ip(["-n", ns, "link", "set", "fpsvc1", "up"]).expect("device up");
    xtask::cmd::ip(["-n", ns, "route", "add", "198.19.0.0/16", "dev", "fpsvc0"])
        .expect("service route");
}

/// A namespace outside the node that reaches it over a veth pair, like a client on another
/// host: a test-bed pod that serves nothing, at 198.18.2.1.
pub fn external_client(bed: &mut Testbed) -> Pod {
    bed.add_pod("ext", Ipv4Addr::new(198, 18, 2, 1), None)
        .expect("external client namespace")
}

/// Runs the probe client in `netns` (no cgroup) and parses its lines.
pub fn probe_from(netns: &str, args: &[&str]) -> Vec<Outcome> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fastpath-probe"));
    cmd.arg("--netns").arg(netns).args(args);
    let out = xtask::cmd::output(&mut cmd).expect("probe runs");
    let outcomes = xtask::probe::parse(&out);
    assert!(!outcomes.is_empty(), "probe printed no result for {args:?}");
    outcomes
}

/// `iptables-save` (or `ip6tables-save`) inside `netns`.
pub fn saved(netns: &str, tool: &str) -> String {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", netns, tool]);
    xtask::cmd::output(&mut cmd).expect("iptables-save runs")
}

/// The chain names declared in `iptables-save` output that start with `prefix`.
pub fn chains_with(saved: &str, prefix: &str) -> Vec<String> {
    saved
        .lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| c.starts_with(prefix))
        .map(str::to_string)
        .collect()
}
