//! Our rendered tables loaded by the real `nft` into a network namespace of their own and
//! read back with `nft list table`: what the kernel holds traces as what we wrote does.
//! Where nft cannot run (not installed, not root) the check says so and is skipped, as the
//! renderer's `nft -c` check is.

use std::{
    io::Write,
    process::{Command, Stdio},
};

use super::{fake::FakeProxier, proxier_test::overall_state, upstream_test::overall_flows, *};
use crate::model::ProxyState;

/// `nft -f -` of `text` in a new network namespace (gone when the command ends), then the
/// table's listing. None where that cannot run here.
fn load_and_list(text: &str, family: &str) -> Option<String> {
    let mut child = Command::new("unshare")
        .args(["--net", "--", "sh", "-c"])
        .arg(format!("nft -f - && nft list table {family} fastpath"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    child.stdin.take()?.write_all(text.as_bytes()).ok()?;
    let out = child.wait_with_output().ok()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        // Only an environment without the tools or the right to use them is skipped; nft
        // refusing our text is a failure.
        let cannot = ["unshare failed", "Operation not permitted", "not found"];
        assert!(
            cannot.iter().any(|c| stderr.contains(c)),
            "nft refused the table: {stderr}\n{text}"
        );
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn check(test: &str, fp: &FakeProxier, st: &ProxyState, flows: &[Flow<'_>]) {
    let family = if fp.family.is_v4() { "ip" } else { "ip6" };
    let Some(listing) = load_and_list(&fp.text(st), family) else {
        eprintln!("nft cannot run here: {test} not checked against the kernel");
        return;
    };
    let dump = Dump::from_listing(&listing)
        .unwrap_or_else(|e| panic!("nft's listing does not parse: {e}\n{listing}"));
    let written = Dump::parse(&fp.text(st)).expect("our text parses");
    let names = |d: &Dump| d.chains.keys().cloned().collect::<Vec<_>>();
    assert_eq!(
        names(&dump),
        names(&written),
        "the kernel holds our chains\n{listing}"
    );
    run_packet_flow_tests(test, &dump, TEST_NODE_IPS, flows);
}

#[test]
fn test_overall_nftables_rules_as_the_kernel_holds_them() {
    let flows: Vec<Flow<'_>> = overall_flows()
        .into_iter()
        .map(|f| match f.name {
            "packet to unallocated cluster ip" => Flow {
                output: "REJECT",
                ..f
            },
            _ => f,
        })
        .collect();
    check(
        "TestOverallNFTablesRules (nft list)",
        &FakeProxier::v4(),
        &overall_state(),
        &flows,
    );
}

#[test]
fn test_node_ports_ipv6_as_the_kernel_holds_them() {
    use crate::{
        dataplane::iptables::kube_tests::{ep, make_test_service, port, slice, state},
        model::Protocol::Tcp,
    };
    let svc = make_test_service("ns1", "svc1", "2001:db8:172:30::41", |s| {
        s.ports = vec![port("p80", 80, Tcp, Some(3001))];
        s.affinity_timeout = Some(10800);
    });
    let eps = slice(
        vec![
            ep("2001:db8:10:180::1", None),
            ep("2001:db8:10:180::2:1", Some(TEST_NODE_NAME)),
        ],
        &[("p80", 80, Tcp)],
    );
    let both = "[2001:db8:10:180::1]:80, [2001:db8:10:180::2:1]:80";
    check(
        "TestNodePorts/ipv6 (nft list)",
        &FakeProxier::v6(),
        &state(vec![(svc, Some(eps))]),
        &[
            flow(
                "pod to cluster IP",
                "2001:db8:10::2",
                "2001:db8:172:30::41",
                80,
                both,
                false,
            ),
            flow(
                "external to nodePort",
                "2001:db8:5200::1",
                TEST_NODE_IPV6,
                3001,
                both,
                true,
            ),
            flow(
                "node to nodePort",
                TEST_NODE_IPV6,
                TEST_NODE_IPV6,
                3001,
                both,
                true,
            ),
            flow(
                "secondary nodeIP ignores NodePorts",
                "2001:db8:5200::1",
                TEST_NODE_IPV6_ALT,
                3001,
                "",
                false,
            ),
            flow(
                "unallocated cluster IP",
                "2001:db8:10::2",
                "2001:db8:10:96::9",
                80,
                "REJECT",
                false,
            ),
        ],
    );
}
