//! The proxier over a model of the tables: kube-proxy's TestSyncProxyRulesRepeated, and the
//! sync bugs of issue 11 (each of these fails without its fix).

use std::{collections::BTreeSet, net::SocketAddr};

use super::{fake::FakeTools, tracer::check_rule_jumps, *};
use crate::{
    dataplane::{
        Dataplane, Scope,
        iptables::{IptablesConfig, IptablesDataplane, Table, conntrack::Flow, render::render},
    },
    model::Protocol::{Tcp, Udp},
};

fn proxier(fake: &FakeTools) -> IptablesDataplane {
    let cfg = IptablesConfig {
        render: RenderConfig {
            local_traffic: LocalTraffic::Cidrs(vec![(ip(POD_CIDR.0), POD_CIDR.1)]),
            ..Default::default()
        },
        ..Default::default()
    };
    IptablesDataplane::with_tools(cfg, vec![Box::new(fake.clone())]).expect("proxier")
}

fn fake() -> FakeTools {
    let f = FakeTools::new(Family::V4);
    f.with(|s| s.addresses = vec![ip("127.0.0.1"), ip(TEST_NODE_IP)]);
    f
}

fn web(name: &str, cluster_ip: &str) -> Service {
    make_test_service("ns1", name, cluster_ip, |s| {
        s.ports = vec![port("p80", 80, Tcp, None)]
    })
}

fn eps80(ips: &[&str]) -> EndpointSet {
    slice(
        ips.iter().map(|a| ep(a, None)).collect(),
        &[("p80", 80, Tcp)],
    )
}

fn full(dp: &mut IptablesDataplane, st: &ProxyState) {
    let report = dp.sync(st, &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");
}

fn changed(
    dp: &mut IptablesDataplane,
    st: &ProxyState,
    keys: &[&str],
) -> crate::dataplane::SyncReport {
    let keys: BTreeSet<ServiceKey> = keys.iter().map(|k| ServiceKey::new("ns1", *k)).collect();
    dp.sync(st, &node(), Scope::Changed(&keys))
}

/// The tables hold exactly what a full render of `st` writes, chain by chain (ours only).
fn assert_tables_hold(fake: &FakeTools, st: &ProxyState) {
    let cfg = RenderConfig {
        local_traffic: LocalTraffic::Cidrs(vec![(ip(POD_CIDR.0), POD_CIDR.1)]),
        random_fully: true,
        node_ips: vec![ip("127.0.0.1"), ip(TEST_NODE_IP)],
        ..Default::default()
    };
    let rs = render(st, &node(), Family::V4, &cfg);
    check_rule_jumps(&rs.restore_text(&Default::default())).unwrap();
    for (table, chains, rules) in [
        (Table::Filter, &rs.filter_chains, &rs.filter_rules),
        (Table::Nat, &rs.nat_chains, &rs.nat_rules),
    ] {
        let ours: BTreeSet<String> = fake
            .chains(table)
            .into_iter()
            .filter(|c| c.starts_with("KUBE-"))
            .collect();
        assert_eq!(
            ours,
            chains.iter().cloned().collect::<BTreeSet<_>>(),
            "{} chains",
            table.name()
        );
        for c in chains {
            let want: Vec<&String> = rules
                .iter()
                .filter(|r| r.split(' ').nth(1) == Some(c.as_str()))
                .collect();
            let have = fake.rules(table, c);
            assert_eq!(
                have.iter().collect::<Vec<_>>(),
                want,
                "{} {c}",
                table.name()
            );
        }
    }
}

#[test]
fn test_sync_proxy_rules_repeated() {
    let fake = fake();
    let mut dp = proxier(&fake);
    let svc1 = web("svc1", "198.19.0.41");
    let svc2 = web("svc2", "198.19.0.42");
    let svc3 = web("svc3", "198.19.0.43");

    // First sync: everything, once.
    let st = state(vec![
        (svc1.clone(), Some(eps80(&["198.18.180.1"]))),
        (svc2.clone(), Some(eps80(&["198.18.180.2"]))),
    ]);
    full(&mut dp, &st);
    assert_eq!(fake.restores().len(), 1);
    assert_tables_hold(&fake, &st);

    // Add svc3: only its chains and KUBE-SERVICES are written.
    let st = state(vec![
        (svc1.clone(), Some(eps80(&["198.18.180.1"]))),
        (svc2.clone(), Some(eps80(&["198.18.180.2"]))),
        (svc3.clone(), Some(eps80(&["198.18.180.3"]))),
    ]);
    assert!(changed(&mut dp, &st, &["svc3"]).failed.is_empty());
    let text = fake.restores().last().unwrap().clone();
    assert!(
        text.contains("198.18.180.3:80") && !text.contains("198.18.180.1:80"),
        "{text}"
    );
    assert_tables_hold(&fake, &st);

    // Delete svc2: its chains are deleted, nobody else's rewritten.
    let st = state(vec![
        (svc1.clone(), Some(eps80(&["198.18.180.1"]))),
        (svc3.clone(), Some(eps80(&["198.18.180.3"]))),
    ]);
    assert!(changed(&mut dp, &st, &["svc2"]).failed.is_empty());
    let text = fake.restores().last().unwrap().clone();
    assert_eq!(
        text.matches("-X KUBE-").count(),
        2,
        "svc2's SVC and SEP chains: {text}"
    );
    assert!(!text.contains("198.18.180.3:80"), "{text}");
    assert_tables_hold(&fake, &st);

    // Nothing changed: nothing written, also on a full sync.
    let before = fake.restores().len();
    assert!(changed(&mut dp, &st, &["svc1"]).failed.is_empty());
    full(&mut dp, &st);
    assert_eq!(fake.restores().len(), before);

    // svc3 gets a second endpoint, then loses both.
    let st = state(vec![
        (svc1.clone(), Some(eps80(&["198.18.180.1"]))),
        (svc3.clone(), Some(eps80(&["198.18.180.3", "198.18.180.4"]))),
    ]);
    assert!(changed(&mut dp, &st, &["svc3"]).failed.is_empty());
    assert_tables_hold(&fake, &st);
    let st = state(vec![
        (svc1.clone(), Some(eps80(&["198.18.180.1"]))),
        (svc3.clone(), None),
    ]);
    assert!(changed(&mut dp, &st, &["svc3"]).failed.is_empty());
    assert!(
        fake.rules(Table::Filter, "KUBE-SERVICES")
            .iter()
            .any(|r| r.contains("has no endpoints"))
    );
    assert_tables_hold(&fake, &st);
}

/// Issue 11: the jumps from the built-in chains were inserted after the restore, so a crash
/// in between left every service unreachable. Now they come in the same transaction.
#[test]
fn the_first_sync_writes_chains_and_jumps_in_one_restore() {
    let fake = fake();
    let mut dp = proxier(&fake);
    full(
        &mut dp,
        &state(vec![(
            web("svc1", "198.19.0.41"),
            Some(eps80(&["198.18.180.1"])),
        )]),
    );
    let restores = fake.restores();
    assert_eq!(restores.len(), 1, "{restores:#?}");
    assert!(
        restores[0].contains(
            "-I PREROUTING 1 -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
        ),
        "{}",
        restores[0]
    );
    let saved = crate::dataplane::iptables::apply::Saved::parse(&fake.save_text());
    assert!(
        crate::dataplane::iptables::JUMPS
            .iter()
            .all(|j| j.present_in(&saved))
    );
    // And not again.
    full(
        &mut dp,
        &state(vec![(
            web("svc1", "198.19.0.41"),
            Some(eps80(&["198.18.180.1"])),
        )]),
    );
    assert_eq!(fake.rules(Table::Nat, "PREROUTING").len(), 1);
}

/// Issue 11: one LoadBalancer with source ranges and no endpoints made every restore fail
/// (`Chain 'KUBE-EXT-…' does not exist`), so no service on the node was programmed.
#[test]
fn a_load_balancer_with_source_ranges_and_no_endpoints_does_not_break_the_restore() {
    let fake = fake();
    let mut dp = proxier(&fake);
    let lb = make_test_service("ns1", "lb", "198.19.0.44", |s| {
        s.ports = vec![port("p80", 80, Tcp, Some(3001))];
        s.load_balancer_ips = vec![ip("198.19.250.4")];
        s.load_balancer_source_ranges = vec![(ip("198.19.240.0"), 25)];
    });
    let st = state(vec![
        (lb, None),
        (web("svc1", "198.19.0.41"), Some(eps80(&["198.18.180.1"]))),
    ]);
    full(&mut dp, &st);
    assert_tables_hold(&fake, &st);
}

/// Issue 11: flushing one of our chains by hand was never repaired (the check compared
/// chain names and jumps only). The next periodic sync now rewrites everything.
#[test]
fn a_flushed_or_edited_chain_is_rewritten_by_the_next_full_sync() {
    let fake = fake();
    let mut dp = proxier(&fake);
    let st = state(vec![(
        web("svc1", "198.19.0.41"),
        Some(eps80(&["198.18.180.1"])),
    )]);
    full(&mut dp, &st);
    fake.flush(Table::Nat, "KUBE-SERVICES");
    full(&mut dp, &st);
    assert_eq!(fake.restores().len(), 2);
    assert_tables_hold(&fake, &st);

    // A rule edited in place (another DNAT address) is noticed too.
    let sep = fake
        .chains(Table::Nat)
        .into_iter()
        .find(|c| c.starts_with("KUBE-SEP-"))
        .unwrap();
    fake.with(|s| {
        let rules = s
            .tables
            .chains
            .get_mut("nat")
            .unwrap()
            .get_mut(&sep)
            .unwrap();
        for r in rules.iter_mut() {
            *r = r.replace("198.18.180.1:80", "198.18.180.9:80");
        }
    });
    full(&mut dp, &st);
    assert_eq!(fake.restores().len(), 3);
    assert_tables_hold(&fake, &st);
}

/// Issue 11: after a restore failed (a foreign rule jumps to a chain of ours that must go),
/// neither the retry nor a full sync recovered. Now the next sync rewrites everything and,
/// if deleting the chain still fails, keeps it (flushed) so that every service is
/// programmed.
#[test]
fn a_failed_restore_is_followed_by_a_full_one_that_programs_every_service() {
    let fake = fake();
    let mut dp = proxier(&fake);
    let (svc1, svc2) = (web("svc1", "198.19.0.41"), web("svc2", "198.19.0.42"));
    let st = state(vec![
        (svc1.clone(), Some(eps80(&["198.18.180.1"]))),
        (svc2.clone(), Some(eps80(&["198.18.180.2"]))),
    ]);
    full(&mut dp, &st);
    let svc1_chain = fake
        .rules(Table::Nat, "KUBE-SERVICES")
        .iter()
        .find(|r| r.contains("198.19.0.41"))
        .unwrap()
        .rsplit(' ')
        .next()
        .unwrap()
        .to_string();
    fake.append(
        Table::Nat,
        &format!("-A OUTPUT -m comment --comment \"someone else\" -j {svc1_chain}"),
    );

    // svc1 goes: deleting its chain fails.
    let st = state(vec![(svc2.clone(), Some(eps80(&["198.18.180.2"])))]);
    assert!(
        !changed(&mut dp, &st, &["svc1"]).failed.is_empty(),
        "the kernel refuses to delete a chain in use"
    );

    // svc2 changes: the next sync rewrites everything, keeping svc1's chain, flushed.
    let st = state(vec![(svc2.clone(), Some(eps80(&["198.18.180.3"])))]);
    let report = changed(&mut dp, &st, &["svc2"]);
    assert!(report.failed.is_empty(), "{report:?}");
    assert!(fake.chains(Table::Nat).contains(&svc1_chain));
    assert!(fake.rules(Table::Nat, &svc1_chain).is_empty());
    assert!(
        !fake
            .rules(Table::Nat, "KUBE-SERVICES")
            .iter()
            .any(|r| r.contains("198.19.0.41"))
    );
    // Later syncs leave the chain alone instead of failing on it again.
    assert!(changed(&mut dp, &st, &["svc2"]).failed.is_empty());
    let report = dp.sync(&st, &node(), Scope::Full);
    assert!(report.failed.is_empty(), "{report:?}");
}

/// Issue 11: `--random-fully` was written whatever the iptables binary; kube-proxy checks
/// for 1.6.2 or later.
#[test]
fn random_fully_only_where_iptables_knows_it() {
    for (version, want) in [
        ("iptables v1.4.21", false),
        ("iptables v1.8.9 (legacy)", true),
    ] {
        let fake = fake();
        fake.with(|s| s.version = version.into());
        let mut dp = proxier(&fake);
        full(&mut dp, &state(vec![]));
        let masq = fake
            .rules(Table::Nat, "KUBE-POSTROUTING")
            .into_iter()
            .find(|r| r.contains("MASQUERADE"))
            .unwrap();
        assert_eq!(masq.contains("--random-fully"), want, "{version}: {masq}");
    }
}

/// Issue 11: `--nodeport-addresses` was ignored in iptables mode. The node's addresses
/// come from the tools; a new address is picked up by the next full sync.
#[test]
fn nodeport_addresses_select_the_node_addresses_that_lead_to_node_ports() {
    let fake = fake();
    fake.with(|s| s.addresses = vec![ip("127.0.0.1"), ip(TEST_NODE_IP), ip(TEST_NODE_IP_ALT)]);
    let cfg = IptablesConfig {
        render: RenderConfig {
            nodeport_addresses: vec![(ip("198.19.129.0"), 24)],
            ..Default::default()
        },
        ..Default::default()
    };
    let mut dp = IptablesDataplane::with_tools(cfg, vec![Box::new(fake.clone())]).unwrap();
    let st = state(vec![]);
    full(&mut dp, &st);
    let tail = |f: &FakeTools| -> Vec<String> {
        f.rules(Table::Nat, "KUBE-SERVICES")
            .into_iter()
            .filter(|r| r.ends_with("-j KUBE-NODEPORTS"))
            .collect()
    };
    assert_eq!(
        tail(&fake),
        [format!(
            "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -d {TEST_NODE_IP_ALT} -j KUBE-NODEPORTS"
        )]
    );
    fake.with(|s| s.addresses.push(ip("198.19.129.7")));
    full(&mut dp, &st);
    assert_eq!(tail(&fake).len(), 2);
}

fn udp_flow(client_port: u16, dst: &str, dport: u16, reply: &str) -> Flow {
    let reply: SocketAddr = reply.parse().unwrap();
    Flow {
        orig_src: ip("198.18.0.2"),
        orig_dst: ip(dst),
        orig_sport: client_port,
        orig_dport: dport,
        reply_src: reply.ip(),
        reply_sport: reply.port(),
        id: None,
    }
}

/// Issue 11: UDP conntrack entries to a removed endpoint were never deleted, so a client
/// that kept its source port stayed on the dead pod (kube-proxy's e2e "should be able to
/// preserve UDP traffic when server pod cycles for a ClusterIP service"; the namespace
/// test in tests/iptables_mode.rs runs it with real packets).
#[test]
fn udp_entries_to_removed_endpoints_are_deleted() {
    let fake = fake();
    let mut dp = proxier(&fake);
    let dns = make_test_service("ns1", "dns", "198.19.0.53", |s| {
        s.ports = vec![port("dns", 53, Udp, Some(30053))]
    });
    let eps = |ips: &[&str]| {
        Some(slice(
            ips.iter().map(|a| ep(a, None)).collect(),
            &[("dns", 5353, Udp)],
        ))
    };
    full(
        &mut dp,
        &state(vec![(dns.clone(), eps(&["198.18.1.11", "198.18.1.12"]))]),
    );
    let to_11 = udp_flow(12345, "198.19.0.53", 53, "198.18.1.11:5353");
    let to_12 = udp_flow(12346, "198.19.0.53", 53, "198.18.1.12:5353");
    let node_port_11 = udp_flow(12347, TEST_NODE_IP, 30053, "198.18.1.11:5353");
    let other = udp_flow(12348, "198.18.9.9", 9999, "198.18.9.9:9999");
    fake.with(|s| s.flows = vec![to_11, to_12, node_port_11, other]);

    // .11 goes: its entries (cluster IP and node port) go with it.
    changed(
        &mut dp,
        &state(vec![(dns.clone(), eps(&["198.18.1.12"]))]),
        &["dns"],
    );
    fake.with(|s| assert_eq!(s.flows, [to_12, other]));
    // Both in one batch, not one deletion (a process, once) per entry.
    fake.with(|s| assert_eq!(s.delete_batches, 1));

    // The service goes: its last translated entry goes; the unrelated one stays.
    changed(&mut dp, &state(vec![]), &["dns"]);
    fake.with(|s| assert_eq!(s.flows, [other]));
}

/// With iptables-nft, a periodic sync reads the tables back (iptables-save: ~5 s at 10,000
/// services, with every change waiting) only when nf_tables' generation says someone else
/// committed since they were last known to hold our rules; our own restores keep them
/// known. What it repairs is unchanged.
#[test]
fn a_periodic_sync_reads_the_tables_back_only_after_someone_else_committed() {
    let fake = fake();
    fake.with(|s| s.version = "iptables v1.8.9 (nf_tables)".into());
    let mut dp = proxier(&fake);
    let saves = || fake.state.lock().unwrap().saves;
    let (svc1, svc2) = (web("svc1", "198.19.0.41"), web("svc2", "198.19.0.42"));
    let st = state(vec![
        (svc1.clone(), Some(eps80(&["198.18.180.1"]))),
        (svc2.clone(), Some(eps80(&["198.18.180.2"]))),
    ]);
    full(&mut dp, &st);
    let after_first = saves();
    full(&mut dp, &st);
    assert_eq!(saves(), after_first, "nothing committed: no read-back");

    // Our own partial restore keeps the tables known.
    let st = state(vec![
        (svc1.clone(), Some(eps80(&["198.18.180.1", "198.18.180.3"]))),
        (svc2.clone(), Some(eps80(&["198.18.180.2"]))),
    ]);
    assert!(changed(&mut dp, &st, &["svc1"]).failed.is_empty());
    full(&mut dp, &st);
    assert_eq!(saves(), after_first, "only our commits: no read-back");
    assert_tables_hold(&fake, &st);

    // Someone else's commit: read back, found, repaired; then known again.
    fake.flush(Table::Nat, "KUBE-SERVICES");
    let restores = fake.restores().len();
    full(&mut dp, &st);
    assert_eq!(saves(), after_first + 1);
    assert_eq!(fake.restores().len(), restores + 1, "repaired");
    assert_tables_hold(&fake, &st);
    full(&mut dp, &st);
    assert_eq!(saves(), after_first + 1);
}

/// Legacy iptables does not go through nf_tables: every periodic sync reads back.
#[test]
fn with_legacy_iptables_every_periodic_sync_reads_the_tables_back() {
    let fake = fake();
    let mut dp = proxier(&fake);
    let st = state(vec![(
        web("svc1", "198.19.0.41"),
        Some(eps80(&["198.18.180.1"])),
    )]);
    full(&mut dp, &st);
    let before = fake.state.lock().unwrap().saves;
    full(&mut dp, &st);
    full(&mut dp, &st);
    assert_eq!(fake.state.lock().unwrap().saves, before + 2);
}

/// TestSyncProxyRulesLargeClusterMode: above 1,000 endpoints the endpoint rules lose their
/// comments, from the sync that crosses the line on; a partial sync rewrites only the
/// changed service's, a full one every service's.
#[test]
fn test_sync_proxy_rules_large_cluster_mode() {
    use crate::dataplane::iptables::{names::endpoint_chain, render::LARGE_CLUSTER_ENDPOINTS};
    let half = LARGE_CLUSTER_ENDPOINTS / 2 - 1;
    let many = |net: &str, base: usize| -> Vec<String> {
        (0..half)
            .map(|i| format!("{net}.{}.{}", base + i / 250, i % 250 + 1))
            .collect()
    };
    let (a, b) = (many("198.18", 0), many("198.19", 100));
    fn refs(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    let mut st = state(vec![
        (web("svc1", "198.19.0.41"), Some(eps80(&refs(&a)))),
        (web("svc2", "198.19.0.42"), Some(eps80(&refs(&b)))),
    ]);
    let fake = fake();
    let mut dp = proxier(&fake);
    full(&mut dp, &st);
    let sep_rules = |svc: &str, addr: &str| {
        let chain = endpoint_chain(
            &format!("ns1/{svc}:p80"),
            Tcp,
            format!("{addr}:80").parse().unwrap(),
        );
        fake.rules(Table::Nat, &chain)
    };
    let commented = |rules: Vec<String>| {
        assert_eq!(rules.len(), 2, "{rules:?}");
        rules.iter().all(|r| r.contains("--comment"))
    };
    let bare = |rules: Vec<String>| {
        assert_eq!(rules.len(), 2, "{rules:?}");
        rules.iter().all(|r| !r.contains("--comment"))
    };
    assert!(
        commented(sep_rules("svc1", &a[0])),
        "998 endpoints: comments"
    );
    assert!(commented(sep_rules("svc2", &b[0])));

    // Three more endpoints: 1,001, large-cluster mode; the partial sync writes svc3 alone.
    let svc3 = web("svc3", "198.19.0.43");
    st.services.insert(svc3.key.clone(), Arc::new(svc3.clone()));
    st.endpoints.insert(
        svc3.key.clone(),
        Arc::new(eps80(&["198.18.200.4", "198.18.200.8", "198.18.200.12"])),
    );
    let report = changed(&mut dp, &st, &["svc3"]);
    assert!(report.failed.is_empty(), "{report:?}");
    assert!(
        bare(sep_rules("svc3", "198.18.200.4")),
        "1,001 endpoints: none"
    );
    let svc3_chain = fake
        .rules(Table::Nat, "KUBE-SERVICES")
        .into_iter()
        .find(|r| r.contains("198.19.0.43"))
        .expect("svc3 in KUBE-SERVICES");
    let svc_chain = svc3_chain.rsplit(' ').next().unwrap().to_string();
    assert!(
        fake.rules(Table::Nat, &svc_chain)
            .iter()
            .filter(|r| r.contains("KUBE-SEP-"))
            .all(|r| !r.contains("->")),
        "the balancing rules lose their `-> endpoint` comments too"
    );
    let last = fake.restores().last().cloned().unwrap();
    assert!(
        !last.contains("198.18.0.1"),
        "a partial sync leaves svc1 alone"
    );
    assert!(commented(sep_rules("svc1", &a[0])));

    // A full sync writes every service in the mode.
    full(&mut dp, &st);
    assert!(bare(sep_rules("svc1", &a[0])));
    assert!(bare(sep_rules("svc2", &b[0])));

    // Back under the line: svc3 gone, the next full sync writes comments again.
    st.services.remove(&svc3.key);
    st.endpoints.remove(&svc3.key);
    full(&mut dp, &st);
    assert!(commented(sep_rules("svc1", &a[0])));
}
