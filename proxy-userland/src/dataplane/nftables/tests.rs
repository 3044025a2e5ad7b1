//! The proxier over a fake `nft` that records its transactions.

use std::{collections::BTreeSet, sync::Arc};

use super::{apply::FakeNft, *};
use crate::model::{
    Endpoint, EndpointSet, Protocol, Service, ServiceKey, ServicePort, SliceInfo, SlicePort,
};

fn ep(ip: &str) -> Endpoint {
    Endpoint {
        ip: ip.parse().unwrap(),
        ready: true,
        serving: true,
        terminating: false,
        placement: crate::model::endpoint::Where::on_node("node-a").into(),
    }
}

fn svc(name: &str, ip: &str) -> Service {
    Service::cluster_ip(
        ServiceKey::new("ns1", name),
        vec![ip.parse().unwrap()],
        vec![ServicePort {
            name: "p80".into(),
            port: 80,
            protocol: Protocol::Tcp,
            node_port: None,
        }],
    )
}

fn eps(ips: &[&str]) -> Arc<EndpointSet> {
    Arc::new(EndpointSet {
        slices: crate::model::Slices::from([(
            "s".into(),
            SliceInfo {
                ports: vec![SlicePort {
                    name: "p80".into(),
                    port: 80,
                    protocol: Protocol::Tcp,
                }],
                endpoints: ips.iter().map(|ip| ep(ip)).collect(),
            },
        )]),
    })
}

fn node() -> NodeInfo {
    NodeInfo {
        name: "node-a".into(),
        zone: None,
    }
}

#[test]
fn a_full_sync_then_only_what_changed_then_full_after_a_failure() {
    let fake = FakeNft::new(Family::V4);
    let mut dp =
        NftablesDataplane::with_tools(NftablesConfig::default(), vec![Box::new(fake.clone())]);
    let mut st = ProxyState::default();
    for (name, ip, ep_ip) in [
        ("svc1", "198.19.0.41", "198.18.180.1"),
        ("svc2", "198.19.0.42", "198.18.180.2"),
    ] {
        let s = svc(name, ip);
        st.endpoints.insert(s.key.clone(), eps(&[ep_ip]));
        st.services.insert(s.key.clone(), Arc::new(s));
    }
    let r = dp.sync(&st, &node(), Scope::Full);
    assert!(r.failed.is_empty(), "{r:?}");
    let t = fake.recorded();
    assert_eq!(t.len(), 1);
    assert!(t[0].starts_with("add table ip fastpath\ndelete table ip fastpath\n"));
    assert!(t[0].contains("198.19.0.42 . tcp . 80"));

    // Nothing changed: nothing written, full scope or not.
    dp.sync(&st, &node(), Scope::Full);
    assert_eq!(fake.recorded().len(), 1, "{:?}", fake.recorded());

    // svc2 gains an endpoint: one partial transaction, about svc2 only.
    let key2 = ServiceKey::new("ns1", "svc2");
    st.endpoints
        .insert(key2.clone(), eps(&["198.18.180.2", "198.18.180.3"]));
    let changed = BTreeSet::from([key2.clone()]);
    dp.sync(&st, &node(), Scope::Changed(&changed));
    let t = fake.recorded();
    assert_eq!(t.len(), 2);
    let partial = &t[1];
    assert!(!partial.contains("delete table"), "{partial}");
    assert!(
        partial.contains("meta l4proto tcp dnat ip addr . port to numgen random mod 2 offset"),
        "{partial}"
    );
    assert!(partial.contains(": 198.18.180.3 . 80 }"), "{partial}");
    assert!(!partial.contains("svc1"), "{partial}");

    // One endpoint replaced by another: element changes alone, no rule (no validation of
    // the table by Linux; over netlink with the real runner).
    st.endpoints
        .insert(key2.clone(), eps(&["198.18.180.2", "198.18.180.4"]));
    dp.sync(&st, &node(), Scope::Changed(&changed));
    let t = fake.recorded();
    assert_eq!(t.len(), 3);
    let moved: Vec<&str> = t[2].lines().collect();
    assert!(
        moved
            .iter()
            .all(|l| !l.contains(" rule ") && !l.contains(" chain ")),
        "only elements: {moved:?}"
    );
    assert!(
        moved.iter().any(|l| l.ends_with(": 198.18.180.4 . 80 }")),
        "{moved:?}"
    );
    assert!(
        moved.contains(
            &"delete element ip fastpath hairpin-endpoints { 198.18.180.3 . 198.18.180.3 }"
        ),
        "{moved:?}"
    );

    // A failed transaction: the service is reported, and the next sync is a full one.
    fake.set_fail(true);
    st.endpoints.insert(key2.clone(), eps(&["198.18.180.3"]));
    let r = dp.sync(&st, &node(), Scope::Changed(&changed));
    assert_eq!(r.failed.len(), 1);
    fake.set_fail(false);
    dp.sync(&st, &node(), Scope::Changed(&changed));
    let t = fake.recorded();
    // Linux applied none of the failed transaction, so the table is known: the full sync
    // rewrites it in place, and every service keeps working meanwhile.
    let full = t.last().unwrap();
    assert!(!full.contains("delete table ip fastpath"), "{full}");
    assert!(full.contains("198.18.180.3 . 80"), "{full}");
    assert!(
        full.contains(
            "delete element ip fastpath hairpin-endpoints { 198.18.180.2 . 198.18.180.2 }"
        ),
        "what the table held and no longer should goes: {full}"
    );

    // A failed full sync leaves the table unknown: the next one deletes and rebuilds it.
    fake.set_fail(true);
    st.endpoints.insert(key2.clone(), eps(&["198.18.180.5"]));
    let partial_failed = dp.sync(&st, &node(), Scope::Changed(&changed));
    assert!(!partial_failed.failed.is_empty());
    let runs = fake.recorded().len();
    let full_failed = dp.sync(&st, &node(), Scope::Changed(&changed));
    assert!(!full_failed.failed.is_empty());
    assert_eq!(
        fake.recorded().len(),
        runs,
        "the fake recorded a failed run"
    );
    fake.set_fail(false);
    dp.sync(&st, &node(), Scope::Changed(&changed));
    let t = fake.recorded();
    let rebuilt = t.last().unwrap();
    assert!(
        rebuilt.starts_with("add table ip fastpath\ndelete table ip fastpath\n"),
        "{rebuilt}"
    );
    assert!(rebuilt.contains("198.18.180.5 . 80"), "{rebuilt}");

    // The service goes: its elements are deleted and its chains flushed.
    st.services.remove(&key2);
    st.endpoints.remove(&key2);
    dp.sync(&st, &node(), Scope::Changed(&changed));
    let last = fake.recorded().last().unwrap().clone();
    assert!(
        last.contains("delete element ip fastpath service-ips { 198.19.0.42 . tcp . 80 }"),
        "{last}"
    );
    assert!(last.contains("flush chain ip fastpath service-"), "{last}");
}

/// Deletes the named network namespace when dropped, test failed or not.
struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.0])
            .status();
    }
}

/// The real runner in a namespace of the test's: a full sync through `nft`, then an
/// endpoint replaced, which goes as one netlink batch of element changes; the kernel's
/// own listing then DNATs to the new endpoint only and holds its hairpin pair. A batch
/// the kernel refuses changes nothing. Skipped where namespaces or nft cannot be had.
#[test]
fn endpoint_moves_go_over_netlink_and_the_kernel_holds_them() {
    use super::{apply::NftRunner, elements, listing::Dump, render::ElementChange};
    for (family, svc_ip, old, new, kept) in [
        (
            Family::V4,
            "198.19.0.41",
            "198.18.180.1",
            "198.18.180.9",
            "198.18.180.2",
        ),
        (
            Family::V6,
            "2001:db8:1::41",
            "2001:db8:180::1",
            "2001:db8:180::9",
            "2001:db8:180::2",
        ),
    ] {
        let name = format!("fp-nftel-{}-{}", std::process::id(), family.is_v4());
        let made = std::process::Command::new("ip")
            .args(["netns", "add", &name])
            .status();
        if !made.is_ok_and(|s| s.success()) {
            eprintln!("cannot make a network namespace here: skipped");
            return;
        }
        let ns = Netns(name);
        let runner = NftRunner::new(family, Some(ns.0.clone()));
        let mut dp =
            NftablesDataplane::with_tools(NftablesConfig::default(), vec![Box::new(runner)]);
        let s = svc("svc1", svc_ip);
        let mut st = ProxyState::default();
        st.endpoints.insert(s.key.clone(), eps(&[old, kept]));
        st.services.insert(s.key.clone(), Arc::new(s.clone()));
        let r = dp.sync(&st, &node(), Scope::Full);
        if r.failed
            .iter()
            .any(|f| format!("{f:?}").contains("cannot run"))
        {
            eprintln!("nft cannot run here: skipped");
            return;
        }
        assert!(r.failed.is_empty(), "{r:?}");

        st.endpoints.insert(s.key.clone(), eps(&[new, kept]));
        let changed = BTreeSet::from([s.key.clone()]);
        let r = dp.sync(&st, &node(), Scope::Changed(&changed));
        assert!(r.failed.is_empty(), "{r:?}");
        let f = if family.is_v4() { "ip" } else { "ip6" };
        let list = || {
            let out = std::process::Command::new("ip")
                .args([
                    "netns", "exec", &ns.0, "nft", "list", "table", f, "fastpath",
                ])
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        let listing = list();
        let dump = Dump::from_listing(&listing).unwrap_or_else(|e| panic!("{e}\n{listing}"));
        let dnats: Vec<&String> = dump
            .chains
            .values()
            .flat_map(|c| &c.rules)
            .filter(|r| r.contains("dnat to"))
            .collect();
        let at = |ip: &str| match family {
            Family::V4 => format!("dnat to {ip}:80"),
            Family::V6 => format!("dnat to [{ip}]:80"),
        };
        assert_eq!(dnats.len(), 2, "{listing}");
        assert!(dnats.iter().any(|r| r.ends_with(&at(new))), "{listing}");
        assert!(dnats.iter().any(|r| r.ends_with(&at(kept))), "{listing}");
        assert!(listing.contains(&format!("{new} . {new}")), "{listing}");
        assert!(!listing.contains(&format!("{old} . {old}")), "{listing}");

        // A batch with one bad change: refused whole.
        let runner = NftRunner::new(family, Some(ns.0.clone()));
        let ip: std::net::IpAddr = old.parse().unwrap();
        let bad = [
            ElementChange::Hairpin { ip, add: true },
            ElementChange::Endpoint {
                proto: "tcp",
                shard: 0,
                key: 7,
                to: None,
            },
        ];
        let err = super::apply::Nft::run_elements(&runner, &bad).unwrap_err();
        assert!(err.to_string().contains("netlink"), "{err}");
        assert!(
            !list().contains(&format!("{old} . {old}")),
            "half a batch was applied"
        );

        // The largest batch sent over netlink: every change applied, none lost to a full
        // socket buffer.
        let ips: Vec<std::net::IpAddr> = (0..elements::MAX_BATCH as u32)
            .map(|i| match family {
                Family::V4 => {
                    std::net::Ipv4Addr::new(198, 19, 200 + (i / 250) as u8, (i % 250) as u8 + 1)
                        .into()
                }
                Family::V6 => format!("2001:db8:200::{:x}", i + 1).parse().unwrap(),
            })
            .collect();
        let many: Vec<ElementChange> = ips
            .iter()
            .map(|&ip| ElementChange::Hairpin { ip, add: true })
            .collect();
        super::apply::Nft::run_elements(&runner, &many).unwrap();
        let listing = list();
        for ip in [ips[0], ips[ips.len() - 1]] {
            assert!(listing.contains(&format!("{ip} . {ip}")), "{ip}\n{listing}");
        }
    }
}
