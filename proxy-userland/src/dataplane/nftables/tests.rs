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
        partial.contains("numgen random mod 2 0 meta l4proto tcp dnat to"),
        "{partial}"
    );
    assert!(partial.contains("dnat to 198.18.180.3:80"), "{partial}");
    assert!(!partial.contains("svc1"), "{partial}");

    // A failed transaction: the service is reported, and the next sync is a full one.
    fake.set_fail(true);
    st.endpoints.insert(key2.clone(), eps(&["198.18.180.3"]));
    let r = dp.sync(&st, &node(), Scope::Changed(&changed));
    assert_eq!(r.failed.len(), 1);
    fake.set_fail(false);
    dp.sync(&st, &node(), Scope::Changed(&changed));
    let t = fake.recorded();
    assert!(
        t.last().unwrap().contains("delete table ip fastpath"),
        "{t:?}"
    );
    assert!(!t.last().unwrap().contains("198.18.180.2:80"));

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
