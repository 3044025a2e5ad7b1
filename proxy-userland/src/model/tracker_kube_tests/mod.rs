//! kube-proxy's endpoints change-tracker tests (pkg/proxy/endpointschangetracker_test.go),
//! case by case: upstream's EndpointSlice objects go through [`convert::endpoint_slice`] and
//! [`ChangeTracker`], and the resulting state is read back per service port with
//! [`endpoints_for_port`], as upstream reads its EndpointsMap.
//!
//! Upstream's addresses 1.1.1.N, 2.2.2.N, 3.3.3.3 and 4.4.4.N are 198.18.1.N, 198.18.2.N,
//! 198.18.3.3 and 198.18.4.N here; generateEndpointSlice's 10.0.S.N is 198.18.S.N. An
//! endpoint is written `ip:port flags`, the flags being r(eady) s(erving) t(erminating)
//! l(ocal).
//!
//! Where we differ on purpose, and what is not ported:
//! - Our tracker records a change of endpoints only for a service it knows (see tracker.rs):
//!   slices of headless services would otherwise wake the sync loop for nothing. Each case
//!   therefore first adds the services its slices belong to; upstream's tracker needs none.
//! - `expectedConntrackCleanupRequired` is not the tracker's business here: UDP conntrack
//!   entries are reconciled after every sync from the endpoints themselves
//!   (dataplane/iptables/conntrack.rs).
//! - Upstream orders an endpoint list by its `ip:port` string, we by address: lists are
//!   compared as sets.
//! - An address listed in two slices of a service at once (an endpoint moving between
//!   slices) keeps its healthiest copy, and among equals the one of the slice whose name
//!   sorts first (select.rs); upstream's table expects the local copy to win. See
//!   "add a slice that overlaps with existing state and partial ports".
//! - TestLastChangeTriggerTime: we do not read the last-change-trigger-time annotation; the
//!   sync latency metric counts from when the watch delivered the change (admin/metrics.rs).
//! - TestCheckoutChanges checks upstream's per-change previous/current maps, which we do not
//!   keep: a sync gets the whole state and the names of the services that changed.
//! - TestGetLocalEndpointIPs is covered by the local ready counts of every case below.

mod endpoint_slice_update;
mod service_map;
mod update_endpoints_map;

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::{api::discovery::v1 as discovery, apimachinery::pkg::apis::meta::v1::ObjectMeta};

use super::ChangeTracker;
use crate::model::{
    NodeInfo, Protocol, Service, ServiceKey, ServicePort, convert,
    select::{endpoints_for_port, is_local},
};

const TEST_HOSTNAME: &str = "test-hostname";

type Map = BTreeMap<String, BTreeSet<String>>;

/// A slice's endpoints and its ports (name, number).
type Fixture = (Vec<discovery::Endpoint>, Vec<(&'static str, i32)>);

fn at(ip: &str) -> discovery::Endpoint {
    discovery::Endpoint {
        addresses: vec![ip.into()],
        ..Default::default()
    }
}

fn here(ip: &str) -> discovery::Endpoint {
    discovery::Endpoint {
        node_name: Some(TEST_HOSTNAME.into()),
        ..at(ip)
    }
}

fn cond(
    mut e: discovery::Endpoint,
    ready: bool,
    serving: bool,
    terminating: bool,
) -> discovery::Endpoint {
    e.conditions = Some(discovery::EndpointConditions {
        ready: Some(ready),
        serving: Some(serving),
        terminating: Some(terminating),
    });
    e
}

/// An EndpointSlice `<service>-<n>` labelled for `ns/service`, with ports of `protocol`.
fn k8s_slice(
    ns: &str,
    svc: &str,
    n: u32,
    protocol: &str,
    (endpoints, ports): Fixture,
) -> discovery::EndpointSlice {
    discovery::EndpointSlice {
        metadata: ObjectMeta {
            name: Some(format!("{svc}-{n}")),
            namespace: Some(ns.into()),
            labels: Some([(convert::LABEL_SERVICE_NAME.to_string(), svc.to_string())].into()),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints,
        ports: (!ports.is_empty()).then(|| {
            ports
                .into_iter()
                .map(|(name, port)| discovery::EndpointPort {
                    name: Some(name.into()),
                    port: Some(port),
                    protocol: Some(protocol.into()),
                    ..Default::default()
                })
                .collect()
        }),
    }
}

/// makeTestEndpointSlice: UDP ports, as upstream's table uses.
fn mk(ns: &str, svc: &str, n: u32, f: fn() -> Fixture) -> Option<discovery::EndpointSlice> {
    Some(k8s_slice(ns, svc, n, "UDP", f()))
}

/// Feeds one slice (or its deletion) to the tracker; false when conversion skips it.
fn apply(t: &mut ChangeTracker, slice: &discovery::EndpointSlice, delete: bool) -> bool {
    match convert::endpoint_slice(slice).expect("test slices are well formed") {
        Some((owner, name, info)) => {
            t.apply_slice(owner, name, (!delete).then_some(info));
            true
        }
        None => false,
    }
}

fn tracker_with_services(names: &[(&str, &str)]) -> ChangeTracker {
    let mut t = ChangeTracker::new();
    for &(ns, name) in names {
        let key = ServiceKey::new(ns, name);
        let svc = Service::cluster_ip(key.clone(), vec!["198.19.0.1".parse().unwrap()], vec![]);
        t.apply_service(key, Some(svc));
    }
    t.take_changes();
    t
}

/// Upstream's EndpointsMap: `ns/name:port` to its endpoints, ports without endpoints left
/// out.
fn endpoints_map(t: &ChangeTracker, hostname: &str) -> Map {
    let node = NodeInfo {
        name: hostname.into(),
        zone: None,
    };
    let mut out = Map::new();
    for (key, set) in &t.state().endpoints {
        let ports: BTreeSet<(String, Protocol)> = set
            .slices
            .values()
            .flat_map(|s| s.ports.iter().map(|p| (p.name.clone(), p.protocol)))
            .collect();
        for (name, protocol) in ports {
            let port = ServicePort {
                name: name.clone(),
                port: 0,
                protocol,
                node_port: None,
            };
            let flag = |on: bool, c: char| if on { c } else { '-' };
            let lines: BTreeSet<String> = endpoints_for_port(set, &port)
                .iter()
                .map(|pe| {
                    let e = &pe.endpoint;
                    format!(
                        "{}:{} {}{}{}{}",
                        pe.ip,
                        pe.port,
                        flag(e.ready, 'r'),
                        flag(e.serving, 's'),
                        flag(e.terminating, 't'),
                        flag(is_local(e, &node), 'l')
                    )
                })
                .collect();
            if !lines.is_empty() {
                out.insert(format!("{key}:{name}"), lines);
            }
        }
    }
    out
}

/// LocalReadyEndpoints: distinct ready local addresses per service, over all its ports.
fn local_ready(t: &ChangeTracker) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for (key, set) in &t.state().endpoints {
        let ips: BTreeSet<_> = set
            .slices
            .values()
            .flat_map(|s| &s.endpoints)
            .filter(|e| e.ready && e.node_name() == Some(TEST_HOSTNAME))
            .map(|e| e.ip)
            .collect();
        if !ips.is_empty() {
            out.insert(key.to_string(), ips.len());
        }
    }
    out
}

fn map(entries: &[(&str, &[&str])]) -> Map {
    entries
        .iter()
        .map(|(k, v)| (k.to_string(), v.iter().map(|s| s.to_string()).collect()))
        .collect()
}
