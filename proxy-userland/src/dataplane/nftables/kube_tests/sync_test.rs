//! kube-proxy's TestSyncProxyRulesRepeated, over our renderer's partial transactions: each
//! change is rendered as a partial transaction, played over the table as it was, and the
//! result must be what a full render of the new state holds (plus the flushed chains
//! kept until they are deleted), in as many operations as upstream's transaction has.

use std::{collections::BTreeSet, time::Duration};

use super::{fake::FakeProxier, *};
use crate::{
    dataplane::{
        iptables::{
            Family,
            kube_tests::{ep, make_test_service, node, port, slice, state},
        },
        nftables::{
            apply::FakeNft,
            render::Rendered,
            sync::{FamilyState, sync_family},
        },
    },
    model::{Protocol::Tcp, ProxyState, Service, ServiceKey},
};

fn svc(n: u8, port_name: &str, p: u16) -> Service {
    make_test_service(
        &format!("ns{n}"),
        &format!("svc{n}"),
        &format!("198.19.0.4{n}"),
        |s| {
            s.ports = vec![port(port_name, p, Tcp, None)];
        },
    )
}

struct Table {
    fp: FakeProxier,
    rendered: Rendered,
    /// What nft holds: every transaction so far played over the first.
    text: String,
}

impl Table {
    fn new(st: &ProxyState) -> Self {
        let fp = FakeProxier::v4();
        let rendered = Rendered::new(st, &node(), fp.family, &fp.config());
        let text = rendered.text();
        Table { fp, rendered, text }
    }

    /// Syncs `keys` to `st`: returns the number of operations and the chains gone stale.
    fn sync(&mut self, st: &ProxyState, keys: &[&str]) -> (usize, Vec<String>) {
        let keys: Vec<ServiceKey> = keys
            .iter()
            .map(|k| {
                let (ns, name) = k.split_once('/').unwrap();
                ServiceKey::new(ns, name)
            })
            .collect();
        match self
            .rendered
            .rerender(st, &node(), &self.fp.config(), &keys)
        {
            None => (0, Vec::new()),
            Some((tx, stale, _)) => {
                let tx = tx.text(self.fp.family);
                self.text.push_str(&tx);
                (tx.lines().count(), stale)
            }
        }
    }

    /// The table now equals a full render of `st` plus the empty chains `flushed`.
    #[track_caller]
    fn assert_holds(&self, st: &ProxyState, flushed: &[&str]) {
        let mut want = self.fp.text(st);
        for c in flushed {
            want.push_str(&format!("add chain ip fastpath {c}\n"));
        }
        let want = Dump::parse(&want).unwrap().to_statements();
        let got = Dump::parse(&self.text).unwrap().to_statements();
        assert_transaction_equal(&want, &got);
    }
}

#[test]
fn test_sync_proxy_rules_repeated() {
    let p80 = |ip: &str| slice(vec![ep(ip, None)], &[("p80", 80, Tcp)]);
    let (svc1, svc2, svc3, svc4) = (
        svc(1, "p80", 80),
        svc(2, "p8080", 8080),
        svc(3, "p80", 80),
        svc(4, "p80", 80),
    );
    let eps2 = slice(vec![ep("198.18.2.1", None)], &[("p8080", 8080, Tcp)]);
    let mut st = state(vec![
        (svc1.clone(), Some(p80("198.18.1.1"))),
        (svc2.clone(), Some(eps2)),
    ]);
    let mut t = Table::new(&st);
    t.assert_holds(&st, &[]);

    // Add a new service and its endpoints.
    st = state(vec![
        (svc1.clone(), Some(p80("198.18.1.1"))),
        (
            svc2.clone(),
            Some(slice(vec![ep("198.18.2.1", None)], &[("p8080", 8080, Tcp)])),
        ),
        (svc3.clone(), Some(p80("198.18.3.1"))),
    ]);
    let (ops, _) = t.sync(&st, &["ns3/svc3"]);
    t.assert_holds(&st, &[]);
    // Upstream: 2 elements, add+flush 2 chains, 2 rules in each (10). Ours has no endpoint
    // chain: the endpoint map declared, add+flush 1 chain, 2 rules, 4 elements (the
    // endpoint's in its map and the hairpin pair too).
    assert_eq!(ops, 9);

    // Delete a service: its chains are flushed, not deleted yet.
    st = state(vec![
        (svc1.clone(), Some(p80("198.18.1.1"))),
        (svc3.clone(), Some(p80("198.18.3.1"))),
    ]);
    let (ops, stale) = t.sync(&st, &["ns2/svc2"]);
    let svc2_chains: Vec<&str> = stale.iter().map(String::as_str).collect();
    assert_eq!(svc2_chains.len(), 1, "{stale:?}");
    assert!(
        svc2_chains
            .iter()
            .any(|c| c.starts_with("service-MHHHYRWA-ns2/svc2/tcp/p8080")),
        "{stale:?}"
    );
    t.assert_holds(&st, &svc2_chains);
    // Its 3 elements deleted and its chain flushed, as upstream; and its endpoint's map
    // element, with the map declared.
    assert_eq!(ops, 6);
    // (Deleting stale chains once nothing uses them is the sync's job, not the render's.)
    for c in &svc2_chains {
        t.text.push_str(&format!("delete chain ip fastpath {c}\n"));
    }

    // Add a service, sync, then add its endpoints.
    st.services
        .insert(svc4.key.clone(), std::sync::Arc::new(svc4.clone()));
    let (ops, _) = t.sync(&st, &["ns4/svc4"]);
    t.assert_holds(&st, &[]);
    assert_eq!(ops, 2, "cluster-ips and no-endpoint-services");
    st = state(vec![
        (svc1.clone(), Some(p80("198.18.1.1"))),
        (svc3.clone(), Some(p80("198.18.3.1"))),
        (svc4.clone(), Some(p80("198.18.4.1"))),
    ]);
    let (ops, _) = t.sync(&st, &["ns4/svc4"]);
    t.assert_holds(&st, &[]);
    // As for svc3, and its no-endpoint element deleted.
    assert_eq!(ops, 9);

    // Change an endpoint of an existing service: upstream's old endpoint chain goes stale;
    // ours has none, and swaps the endpoint's map element and its hairpin pair: elements
    // only (with the map declared), no rule.
    let with3 = |eps| {
        state(vec![
            (svc1.clone(), Some(p80("198.18.1.1"))),
            (svc3.clone(), eps),
            (svc4.clone(), Some(p80("198.18.4.1"))),
        ])
    };
    st = with3(Some(p80("198.18.3.2")));
    let (ops, stale) = t.sync(&st, &["ns3/svc3"]);
    assert!(stale.is_empty(), "{stale:?}");
    t.assert_holds(&st, &[]);
    assert_eq!(ops, 5);

    // Add an endpoint to a service.
    let two = || {
        slice(
            vec![ep("198.18.3.2", None), ep("198.18.3.3", None)],
            &[("p80", 80, Tcp)],
        )
    };
    st = with3(Some(two()));
    let (ops, _) = t.sync(&st, &["ns3/svc3"]);
    t.assert_holds(&st, &[]);
    // Upstream rewrites all 3 chains of the service (12 operations); ours has one, whose
    // DNAT rule names the new count (map declared, add, flush, 2 rules), and adds the new
    // endpoint's map element and hairpin pair.
    assert_eq!(ops, 7);

    // Empty a service's endpoints: its chains are flushed (upstream's 3, our 1).
    st = with3(Some(slice(vec![], &[("p80", 80, Tcp)])));
    let (ops, stale) = t.sync(&st, &["ns3/svc3"]);
    assert_eq!(stale.len(), 1, "{stale:?}");
    let flushed: Vec<&str> = stale.iter().map(String::as_str).collect();
    t.assert_holds(&st, &flushed);
    // The flush, 2 elements swapped, 2 hairpin pairs and 2 map elements deleted (with
    // the map declared).
    assert_eq!(ops, 8);
    run_packet_flow_tests(
        "TestSyncProxyRulesRepeated",
        &Dump::parse(&t.text).unwrap(),
        TEST_NODE_IPS,
        &[flow(
            "emptied service",
            "198.18.0.2",
            "198.19.0.43",
            80,
            "REJECT",
            false,
        )],
    );

    // Restore them at once: the chains are written again.
    st = with3(Some(two()));
    let (ops, stale) = t.sync(&st, &["ns3/svc3"]);
    assert!(stale.is_empty(), "{stale:?}");
    t.assert_holds(&st, &[]);
    // The service chain (add, flush, 2 rules), its elements swapped back, both map elements
    // (with the map declared) and both hairpin pairs: no endpoint chains to write again
    // (docs/modes.md).
    assert_eq!(ops, 11);
    run_packet_flow_tests(
        "TestSyncProxyRulesRepeated",
        &Dump::parse(&t.text).unwrap(),
        TEST_NODE_IPS,
        &[flow(
            "restored service",
            "198.18.0.2",
            "198.19.0.43",
            80,
            "198.18.3.2:80, 198.18.3.3:80",
            false,
        )],
    );

    // Sync with no new changes: no transaction.
    assert_eq!(t.sync(&st, &["ns1/svc1", "ns3/svc3", "ns4/svc4"]).0, 0);
}

/// The proxier's own sync ([`sync_family`]) over a fake `nft` whose transactions are
/// played over one [`Dump`], as knftables' Fake holds the table.
struct Synced {
    fs: FamilyState,
    fake: FakeNft,
    played: usize,
    table: String,
}

impl Synced {
    fn new() -> Self {
        let mut fake = FakeNft::new(Family::V4);
        fake.addresses = FakeProxier::v4().config().node_ips;
        Synced {
            fs: FamilyState::new(Box::new(fake.clone())),
            fake,
            played: 0,
            table: String::new(),
        }
    }

    /// One sync of the services `changed` (None: all); returns the transactions it ran.
    fn sync(&mut self, st: &ProxyState, changed: Option<&[&str]>) -> Vec<String> {
        let keys: Option<BTreeSet<ServiceKey>> = changed.map(|c| {
            c.iter()
                .map(|k| {
                    let (ns, name) = k.split_once('/').unwrap();
                    ServiceKey::new(ns, name)
                })
                .collect()
        });
        let cfg = model_range_less().config();
        sync_family(&mut self.fs, &cfg, st, &node(), keys.as_ref()).expect("sync");
        let all = self.fake.recorded();
        let new = all[self.played..].to_vec();
        self.played = all.len();
        for tx in &new {
            self.table.push_str(tx);
        }
        new
    }

    /// upstream's ageStaleChains: as if the grace period had passed.
    fn age_stale_chains(&mut self) {
        for t in self.fs.stale.values_mut() {
            *t = t.checked_sub(Duration::from_secs(2)).unwrap_or(*t);
        }
    }

    fn dump(&self) -> Dump {
        Dump::parse(&self.table).expect("the transactions parse")
    }
}

/// TestSyncProxyRulesRepeated's stale-chain steps, through the proxier's sync: a deleted
/// service's chains are flushed, kept, and deleted in a transaction of their own once
/// aged; an emptied and refilled service gets its chains back.
#[test]
fn test_sync_proxy_rules_repeated_stale_chains() {
    let p80 = |ip: &str| slice(vec![ep(ip, None)], &[("p80", 80, Tcp)]);
    let (svc1, svc2, svc3) = (svc(1, "p80", 80), svc(2, "p8080", 8080), svc(3, "p80", 80));
    let eps2 = || slice(vec![ep("198.18.2.1", None)], &[("p8080", 8080, Tcp)]);
    let mut s = Synced::new();
    let st = state(vec![
        (svc1.clone(), Some(p80("198.18.1.1"))),
        (svc2.clone(), Some(eps2())),
        (svc3.clone(), Some(p80("198.18.3.1"))),
    ]);
    assert_eq!(s.sync(&st, None).len(), 1);
    let full = model_range_less().text(&st);
    assert_transaction_equal(
        &Dump::parse(&full).unwrap().to_statements(),
        &s.dump().to_statements(),
    );

    // Delete a service; its chains will be flushed, but not immediately deleted.
    let st = state(vec![
        (svc1.clone(), Some(p80("198.18.1.1"))),
        (svc3.clone(), Some(p80("198.18.3.1"))),
    ]);
    assert_eq!(s.sync(&st, Some(&["ns2/svc2"])).len(), 1);
    let svc2_chains: Vec<String> = s
        .dump()
        .chains
        .keys()
        .filter(|c| c.contains("ns2/svc2"))
        .cloned()
        .collect();
    // Upstream flushes the service's and its endpoint's chain; ours has only the first.
    assert_eq!(svc2_chains.len(), 1, "{svc2_chains:?}");
    for c in &svc2_chains {
        assert_eq!(s.dump().chain_text(c), "", "{c} is flushed");
    }
    assert_eq!(s.fs.stale.len(), 1);

    // Not yet aged: a sync with nothing changed deletes nothing.
    assert!(s.sync(&st, Some(&[])).is_empty());
    // Fake the passage of time: the stale chains go, in a transaction of their own.
    s.age_stale_chains();
    let txs = s.sync(&st, Some(&[]));
    assert_eq!(txs.len(), 1, "{txs:?}");
    assert!(
        txs[0]
            .lines()
            .all(|l| l.starts_with("delete chain ip fastpath ")),
        "{txs:?}"
    );
    assert!(svc2_chains.iter().all(|c| !s.dump().chains.contains_key(c)));
    assert!(s.fs.stale.is_empty());
    assert_transaction_equal(
        &Dump::parse(&model_range_less().text(&st))
            .unwrap()
            .to_statements(),
        &s.dump().to_statements(),
    );

    // Empty a service's endpoints and restore them after the stale chains aged: the
    // chains are flushed, then written again; none is deleted from under the service.
    let empty = state(vec![
        (svc1.clone(), Some(p80("198.18.1.1"))),
        (svc3.clone(), Some(slice(vec![], &[("p80", 80, Tcp)]))),
    ]);
    s.sync(&empty, Some(&["ns3/svc3"]));
    s.age_stale_chains();
    s.sync(&st, Some(&["ns3/svc3"]));
    assert_transaction_equal(
        &Dump::parse(&model_range_less().text(&st))
            .unwrap()
            .to_statements(),
        &s.dump().to_statements(),
    );
    run_packet_flow_tests(
        "TestSyncProxyRulesRepeated (sync)",
        &s.dump(),
        TEST_NODE_IPS,
        &[flow(
            "restored service",
            "198.18.0.2",
            "198.19.0.43",
            80,
            "198.18.3.1:80",
            false,
        )],
    );
    // Sync with no new changes: no transaction.
    assert!(s.sync(&st, Some(&["ns1/svc1", "ns3/svc3"])).is_empty());
}

/// TestSyncProxyRulesStartup: the table already holds part of the state (an earlier
/// proxier's); the first sync leaves exactly the new state. Upstream's first sync keeps
/// what it finds and adds the rest; ours replaces the table in one transaction (`delete
/// table` and all of it again), so its operation count is not upstream's.
#[test]
fn test_sync_proxy_rules_startup() {
    let p80 = |ips: &[&str]| {
        slice(
            ips.iter().map(|ip| ep(ip, None)).collect(),
            &[("p80", 80, Tcp)],
        )
    };
    let (svc1, svc2, svc3) = (svc(1, "p80", 80), svc(2, "p8080", 8080), svc(3, "p80", 80));
    let eps2 = slice(vec![ep("198.18.2.1", None)], &[("p8080", 8080, Tcp)]);
    let before = state(vec![
        (svc1.clone(), Some(p80(&["198.18.1.1"]))),
        (svc2.clone(), Some(eps2.clone())),
    ]);
    let mut s = Synced::new();
    s.table = model_range_less().text(&before);
    let st = state(vec![
        (svc1, Some(p80(&["198.18.1.1", "198.18.1.2"]))),
        (svc2, Some(eps2)),
        (svc3, None),
    ]);
    let txs = s.sync(&st, None);
    assert_eq!(txs.len(), 1);
    assert!(
        txs[0].starts_with("add table ip fastpath\ndelete table ip fastpath\n"),
        "{}",
        txs[0]
    );
    assert_transaction_equal(
        &Dump::parse(&model_range_less().text(&st))
            .unwrap()
            .to_statements(),
        &s.dump().to_statements(),
    );
    run_packet_flow_tests(
        "TestSyncProxyRulesStartup",
        &s.dump(),
        TEST_NODE_IPS,
        &[
            flow(
                "svc1's second endpoint",
                "198.18.0.2",
                "198.19.0.41",
                80,
                "198.18.1.1:80, 198.18.1.2:80",
                false,
            ),
            flow(
                "svc3 without endpoints",
                "198.18.0.2",
                "198.19.0.43",
                80,
                "REJECT",
                false,
            ),
        ],
    );
}

/// The settings the proxier's sync renders with here: the service range comes from the
/// model, which these tests leave empty.
fn model_range_less() -> FakeProxier {
    FakeProxier {
        service_range: false,
        ..FakeProxier::v4()
    }
}
