//! kube-proxy's `TestCategorizeEndpoints` (pkg/proxy/topology_test.go), case by case, run
//! through [`categorize`]. Addresses are the project's test range instead of upstream's.
//!
//! Where we differ on purpose, the case says so:
//! - Upstream's "PTE disabled" cases are left out: ProxyTerminatingEndpoints is GA and
//!   always on in kube-proxy too, as here.
//! - The topology annotation cases ("hints annotation == disabled", "aUto", empty) follow
//!   today's kube-proxy, which honours hints whatever the annotation says (the EndpointSlice
//!   controller only writes hints for services that asked): the hinted zone is used.
//! - Upstream tells "not used" (nil) from "none" (empty set); our lists are empty in both
//!   cases, so an expected `None` is checked as empty.
//! - The PreferSameNode cases (`test_categorize_endpoints_prefer_same_node`) run with the
//!   PreferSameTrafficDistribution gate on, as it is locked in 1.35; upstream's cases with
//!   the gate off are left out. Node `node-1` of upstream is `node-a` here.

use std::collections::BTreeSet;

use super::*;
use crate::model::{Protocol, ServiceKey};

/// An endpoint row: (last octet of 198.18.5.x, zone hints, ready, serving, terminating,
/// on this node).
type Row = (u8, &'static [&'static str], bool, bool, bool, bool);

const R: (bool, bool, bool) = (true, true, false); // ready
const U: (bool, bool, bool) = (false, false, false); // not ready, not serving
const T: (bool, bool, bool) = (false, true, true); // serving and terminating

fn row(n: u8, hints: &'static [&'static str], c: (bool, bool, bool), local: bool) -> Row {
    (n, hints, c.0, c.1, c.2, local)
}

struct Case {
    name: &'static str,
    zone: Option<&'static str>,
    internal_local: bool,
    external_local: bool,
    node_port: bool,
    endpoints: Vec<Row>,
    cluster: Option<&'static [u8]>,
    local: Option<&'static [u8]>,
    /// Needed only when both lists are used.
    all: Option<&'static [u8]>,
    only_remote: bool,
    /// hints.forNodes, by endpoint (last octet).
    node_hints: Vec<(u8, &'static [&'static str])>,
}

impl Case {
    fn new(name: &'static str, endpoints: Vec<Row>) -> Self {
        Case {
            name,
            zone: None,
            internal_local: false,
            external_local: false,
            node_port: false,
            endpoints,
            cluster: None,
            local: None,
            all: None,
            only_remote: false,
            node_hints: Vec::new(),
        }
    }
    fn node_hints(mut self, hints: &[(u8, &'static [&'static str])]) -> Self {
        self.node_hints = hints.to_vec();
        self
    }
    fn zone(mut self, z: &'static str) -> Self {
        self.zone = Some(z);
        self
    }
    fn itp_local(mut self) -> Self {
        self.internal_local = true;
        self
    }
    fn etp_local(mut self) -> Self {
        self.external_local = true;
        self
    }
    fn node_port(mut self) -> Self {
        self.node_port = true;
        self
    }
    fn cluster(mut self, c: &'static [u8]) -> Self {
        self.cluster = Some(c);
        self
    }
    fn local(mut self, l: &'static [u8]) -> Self {
        self.local = Some(l);
        self
    }
    fn all(mut self, a: &'static [u8]) -> Self {
        self.all = Some(a);
        self
    }
    fn only_remote(mut self) -> Self {
        self.only_remote = true;
        self
    }
}

fn addr(n: u8) -> String {
    format!("198.18.5.{n}")
}

fn set_of(ns: &[u8]) -> BTreeSet<String> {
    ns.iter().map(|&n| addr(n)).collect()
}

fn got(list: &[PortEndpoint]) -> BTreeSet<String> {
    list.iter().map(|p| p.ip.to_string()).collect()
}

fn run(case: &Case) {
    let node = NodeInfo {
        name: "node-a".into(),
        zone: case.zone.map(Into::into),
    };
    let svc = Service {
        internal_policy_local: case.internal_local,
        external_policy_local: case.external_local,
        ..Service::cluster_ip(
            ServiceKey::new("ns1", "svc1"),
            vec!["198.19.0.1".parse().unwrap()],
            vec![ServicePort {
                name: "p80".into(),
                port: 80,
                protocol: Protocol::Tcp,
                node_port: case.node_port.then_some(30080),
            }],
        )
    };
    let eps: Vec<PortEndpoint> = case
        .endpoints
        .iter()
        .map(
            |&(n, hints, ready, serving, terminating, local)| PortEndpoint {
                ip: addr(n).parse().unwrap(),
                port: 80,
                endpoint: Endpoint {
                    ip: addr(n).parse().unwrap(),
                    ready,
                    serving,
                    terminating,
                    placement: crate::model::endpoint::Where {
                        node_name: Some(if local { "node-a" } else { "node-b" }.into()),
                        zone_hints: hints.iter().map(|&h| h.into()).collect(),
                        node_hints: case
                            .node_hints
                            .iter()
                            .filter(|(m, _)| *m == n)
                            .flat_map(|(_, h)| h.iter().map(|&h| h.into()))
                            .collect(),
                        ..Default::default()
                    }
                    .into(),
                },
            },
        )
        .collect();
    let c = categorize(&svc, &eps, &node);
    let name = case.name;
    assert_eq!(
        got(&c.cluster),
        set_of(case.cluster.unwrap_or(&[])),
        "{name}: cluster"
    );
    assert_eq!(
        got(&c.local),
        set_of(case.local.unwrap_or(&[])),
        "{name}: local"
    );
    let all = match (case.cluster, case.local) {
        (Some(c), None) => set_of(c),
        (None, Some(l)) => set_of(l),
        _ => set_of(case.all.unwrap_or(&[])),
    };
    assert_eq!(got(&c.all_reachable), all, "{name}: all endpoints");
    assert_eq!(
        c.has_any_endpoints,
        !all.is_empty() || case.only_remote,
        "{name}: has any endpoints"
    );
}

const ZA: &[&str] = &["zone-a"];
const ZB: &[&str] = &["zone-b"];
const ZC: &[&str] = &["zone-c"];
const NONE: &[&str] = &[];

/// The four endpoints most hint cases use: zone-a, zone-b, zone-c, zone-a, all ready.
fn abca() -> Vec<Row> {
    vec![
        row(3, ZA, R, false),
        row(4, ZB, R, false),
        row(5, ZC, R, false),
        row(6, ZA, R, false),
    ]
}

#[test]
fn test_categorize_endpoints() {
    let cases = vec![
        Case::new("hints enabled, hints annotation == auto", abca())
            .zone("zone-a")
            .cluster(&[3, 6]),
        // Differs from the old upstream table on purpose (see the module docs): hints are
        // honoured whatever the annotation says, as kube-proxy does today.
        Case::new("hints, hints annotation == disabled, hints ignored", abca())
            .zone("zone-a")
            .cluster(&[3, 6]),
        Case::new(
            "externalTrafficPolicy: Local, topology ignored for Local endpoints",
            vec![
                row(3, ZA, R, true),
                row(4, ZB, R, true),
                row(5, ZC, R, false),
                row(6, ZA, R, false),
            ],
        )
        .zone("zone-a")
        .etp_local()
        .node_port()
        .cluster(&[3, 6])
        .local(&[3, 4])
        .all(&[3, 4, 6]),
        Case::new(
            "internalTrafficPolicy: Local, topology ignored for Local endpoints",
            vec![
                row(3, ZA, R, true),
                row(4, ZB, R, true),
                row(5, ZC, R, false),
                row(6, ZA, R, false),
            ],
        )
        .zone("zone-a")
        .itp_local()
        .node_port()
        .cluster(&[3, 6])
        .local(&[3, 4])
        .all(&[3, 4, 6]),
        Case::new("empty node labels", vec![row(3, ZA, R, false)]).cluster(&[3]),
        Case::new("empty zone label", vec![row(3, ZA, R, false)])
            .zone("")
            .cluster(&[3]),
        Case::new(
            "node in different zone, no endpoint filtering",
            vec![row(3, ZA, R, false)],
        )
        .zone("zone-b")
        .cluster(&[3]),
        Case::new("normal endpoint filtering, auto annotation", abca())
            .zone("zone-a")
            .cluster(&[3, 6]),
        Case::new(
            "unready endpoint",
            vec![
                row(3, ZA, R, false),
                row(4, ZB, R, false),
                row(5, ZC, R, false),
                row(6, ZA, U, false),
            ],
        )
        .zone("zone-a")
        .cluster(&[3]),
        Case::new(
            "only unready endpoints in same zone (should not filter)",
            vec![
                row(3, ZA, U, false),
                row(4, ZB, R, false),
                row(5, ZC, R, false),
                row(6, ZA, U, false),
            ],
        )
        .zone("zone-a")
        .cluster(&[4, 5]),
        Case::new(
            "missing hints, no filtering applied",
            vec![
                row(3, ZA, R, false),
                row(4, ZB, R, false),
                row(5, NONE, R, false),
                row(6, ZA, R, false),
            ],
        )
        .zone("zone-a")
        .cluster(&[3, 4, 5, 6]),
        Case::new(
            "multiple hints per endpoint, filtering includes any endpoint with zone included",
            vec![
                row(3, &["zone-a", "zone-b", "zone-c"], R, false),
                row(4, &["zone-b", "zone-c"], R, false),
                row(5, &["zone-b", "zone-d"], R, false),
                row(6, ZC, R, false),
            ],
        )
        .zone("zone-c")
        .cluster(&[3, 4, 6]),
        Case::new(
            "conflicting topology and localness require merging allEndpoints",
            vec![
                row(10, ZA, R, true),
                row(11, ZB, R, true),
                row(12, ZA, R, false),
                row(13, ZB, R, false),
            ],
        )
        .zone("zone-a")
        .etp_local()
        .node_port()
        .cluster(&[10, 12])
        .local(&[10, 11])
        .all(&[10, 11, 12]),
        Case::new("internalTrafficPolicy: Local, with empty endpoints", vec![])
            .itp_local()
            .local(&[]),
        Case::new(
            "internalTrafficPolicy: Local, but all endpoints are remote",
            vec![row(10, NONE, R, false), row(11, NONE, R, false)],
        )
        .itp_local()
        .local(&[])
        .only_remote(),
        Case::new(
            "internalTrafficPolicy: Local, all endpoints are local",
            vec![row(10, NONE, R, true), row(11, NONE, R, true)],
        )
        .itp_local()
        .local(&[10, 11]),
        Case::new(
            "internalTrafficPolicy: Local, some endpoints are local",
            vec![row(10, NONE, R, true), row(11, NONE, R, false)],
        )
        .itp_local()
        .local(&[10]),
        Case::new(
            "Cluster traffic policy, endpoints not Ready",
            vec![row(10, NONE, U, false), row(11, NONE, U, false)],
        )
        .cluster(&[]),
        Case::new(
            "Cluster traffic policy, some endpoints are Ready",
            vec![row(10, NONE, U, false), row(11, NONE, R, false)],
        )
        .cluster(&[11]),
        Case::new(
            "Cluster traffic policy, PTE enabled, all endpoints are terminating",
            vec![row(10, NONE, T, true), row(11, NONE, T, false)],
        )
        .cluster(&[10, 11]),
        Case::new(
            "iTP: Local, eTP: Cluster, some endpoints local",
            vec![row(10, NONE, R, true), row(11, NONE, R, false)],
        )
        .itp_local()
        .node_port()
        .cluster(&[10, 11])
        .local(&[10])
        .all(&[10, 11]),
        Case::new(
            "iTP: Cluster, eTP: Local, some endpoints local",
            vec![row(10, NONE, R, true), row(11, NONE, R, false)],
        )
        .etp_local()
        .node_port()
        .cluster(&[10, 11])
        .local(&[10])
        .all(&[10, 11]),
        Case::new(
            "iTP: Local, eTP: Local, some endpoints local",
            vec![row(10, NONE, R, true), row(11, NONE, R, false)],
        )
        .itp_local()
        .etp_local()
        .node_port()
        .cluster(&[10, 11])
        .local(&[10])
        .all(&[10, 11]),
        Case::new(
            "iTP: Local, eTP: Local, all endpoints remote",
            vec![row(10, NONE, R, false), row(11, NONE, R, false)],
        )
        .itp_local()
        .etp_local()
        .node_port()
        .cluster(&[10, 11])
        .local(&[])
        .all(&[10, 11]),
        Case::new(
            "iTP: Local, eTP: Local, PTE enabled, all endpoints remote and terminating",
            vec![row(10, NONE, T, false), row(11, NONE, T, false)],
        )
        .itp_local()
        .etp_local()
        .node_port()
        .cluster(&[10, 11])
        .local(&[])
        .all(&[10, 11])
        .only_remote(),
        Case::new(
            "iTP: Cluster, eTP: Local, PTE enabled, with terminating endpoints",
            vec![
                row(10, NONE, R, false),
                row(11, NONE, U, true),
                row(12, NONE, T, true),
                row(13, NONE, T, false),
            ],
        )
        .etp_local()
        .node_port()
        .cluster(&[10])
        .local(&[12])
        .all(&[10, 12]),
        Case::new(
            "externalTrafficPolicy ignored if not externally accessible",
            vec![row(10, NONE, R, false), row(11, NONE, R, true)],
        )
        .etp_local()
        .cluster(&[10, 11]),
        Case::new(
            "no cluster endpoints for iTP:Local internal-only service",
            vec![row(10, NONE, R, false), row(11, NONE, R, true)],
        )
        .itp_local()
        .local(&[11]),
    ];
    for case in &cases {
        run(case);
    }
}

// ---- kube-proxy's TestEndpointsMapFromESC (pkg/proxy/endpointslicecache_test.go) ----------

/// kube-proxy's generateEndpointSlice, our way: endpoints 1..=n at 198.18.<group>.<i>,
/// neither ready nor serving when `i % unready_mod == 0`, terminating (so not ready) when
/// `i % terminating_mod == 0`, on `hosts[i % hosts.len()]`, serving the named ports
/// `port-0`, `port-1`, ...
fn generated(
    group: u8,
    n: u8,
    unready_mod: u8,
    terminating_mod: u8,
    hosts: &[&str],
    ports: &[u16],
) -> crate::model::SliceInfo {
    crate::model::SliceInfo {
        ports: ports
            .iter()
            .enumerate()
            .map(|(i, &port)| crate::model::SlicePort {
                name: format!("port-{i}"),
                port,
                protocol: Protocol::Tcp,
            })
            .collect(),
        endpoints: (1..=n)
            .map(|i| {
                let terminating = i % terminating_mod == 0;
                let serving = i % unready_mod != 0;
                Endpoint {
                    ip: format!("198.18.{group}.{i}").parse().unwrap(),
                    ready: serving && !terminating,
                    serving,
                    terminating,
                    placement: crate::model::endpoint::Where {
                        node_name: (!hosts.is_empty())
                            .then(|| hosts[usize::from(i) % hosts.len()].into()),
                        ..Default::default()
                    }
                    .into(),
                }
            })
            .collect(),
    }
}

fn set_of_slices(slices: Vec<crate::model::SliceInfo>) -> EndpointSet {
    EndpointSet {
        slices: slices
            .into_iter()
            .enumerate()
            .map(|(i, s)| (format!("svc1-{i}"), s))
            .collect(),
    }
}

/// `endpoints_for_port` of `port-<index>` as "ip:port flags" lines, flags being
/// r(eady) s(erving) t(erminating) l(ocal to host1).
fn port_map(set: &EndpointSet, index: usize) -> Vec<String> {
    let port = ServicePort {
        name: format!("port-{index}"),
        port: 80,
        protocol: Protocol::Tcp,
        node_port: None,
    };
    let host1 = NodeInfo {
        name: "host1".into(),
        zone: None,
    };
    let mut out: Vec<String> = endpoints_for_port(set, &port)
        .iter()
        .map(|pe| {
            let e = &pe.endpoint;
            let flag = |on: bool, c: char| if on { c } else { '-' };
            format!(
                "{}:{} {}{}{}{}",
                pe.ip,
                pe.port,
                flag(e.ready, 'r'),
                flag(e.serving, 's'),
                flag(e.terminating, 't'),
                flag(is_local(e, &host1), 'l')
            )
        })
        .collect();
    out.sort();
    out
}

fn lines(group: u8, ids: &[u8], port: u16, flags: &str) -> Vec<String> {
    ids.iter()
        .map(|i| format!("198.18.{group}.{i}:{port} {flags}"))
        .collect()
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

const NA: &[&str] = &["node-a"];
const NB: &[&str] = &["node-b"];
const NC: &[&str] = &["node-c"];
const ND: &[&str] = &["node-d"];

/// kube-proxy 1.35's PreferSameNode cases of TestCategorizeEndpoints (hints.forNodes, as
/// the EndpointSlice controller writes them: each endpoint hinted for its own node and
/// zone), and the interplay with the Local policies.
#[test]
fn test_categorize_endpoints_prefer_same_node() {
    // Endpoint 3 runs here (node-a, zone-a), 4 elsewhere in zone-a, 5 and 6 in other zones.
    let here_and_elsewhere = || {
        vec![
            row(3, ZA, R, true),
            row(4, ZA, R, false),
            row(5, ZB, R, false),
            row(6, ZC, R, false),
        ]
    };
    let own_nodes: &[(u8, &[&str])] = &[(3, NA), (4, NB), (5, NC), (6, ND)];
    let cases = vec![
        Case::new("PreferSameNode available", here_and_elsewhere())
            .zone("zone-a")
            .node_hints(own_nodes)
            .cluster(&[3]),
        Case::new(
            "PreferSameNode not available, falls back to PreferSameZone",
            vec![
                row(4, ZA, R, false),
                row(5, ZB, R, false),
                row(6, ZC, R, false),
                row(7, ZA, R, false),
            ],
        )
        .zone("zone-a")
        .node_hints(&[(4, NB), (5, NC), (6, ND), (7, NB)])
        .cluster(&[4, 7]),
        Case::new(
            "PreferSameNode not available and no zone hints for this zone: no topology",
            vec![row(4, ZB, R, false), row(5, ZC, R, false)],
        )
        .zone("zone-a")
        .node_hints(&[(4, NB), (5, NC)])
        .cluster(&[4, 5]),
        Case::new(
            "PreferSameNode ignored if some endpoints unhinted",
            here_and_elsewhere(),
        )
        .zone("zone-a")
        .node_hints(&[(3, NA), (4, NB), (5, NC)])
        .cluster(&[3, 4]),
        Case::new(
            "PreferSameNode without a zone label on the node",
            here_and_elsewhere(),
        )
        .node_hints(own_nodes)
        .cluster(&[3]),
        Case::new(
            "PreferSameNode, the endpoint for this node is not ready",
            vec![
                row(3, ZA, U, true),
                row(4, ZA, R, false),
                row(5, ZB, R, false),
            ],
        )
        .zone("zone-a")
        .node_hints(&[(3, NA), (4, NB), (5, NC)])
        .cluster(&[4]),
        Case::new(
            "PreferSameNode, only a terminating endpoint on this node: no ready one anywhere",
            vec![row(3, ZA, T, true), row(4, ZA, T, false)],
        )
        .zone("zone-a")
        .node_hints(&[(3, NA), (4, NB)])
        .cluster(&[3, 4]),
        Case::new(
            "internalTrafficPolicy: Local, PreferSameNode ignored for Local endpoints",
            vec![
                row(3, ZA, R, true),
                row(4, ZA, R, true),
                row(5, ZB, R, false),
            ],
        )
        .zone("zone-a")
        .itp_local()
        .node_port()
        .node_hints(&[(3, NA), (4, NB), (5, NC)])
        .cluster(&[3])
        .local(&[3, 4])
        .all(&[3, 4]),
        Case::new(
            "externalTrafficPolicy: Local, PreferSameNode for the Cluster list only",
            vec![
                row(3, ZA, R, false),
                row(4, ZA, R, true),
                row(5, ZB, R, false),
            ],
        )
        .zone("zone-a")
        .etp_local()
        .node_port()
        .node_hints(&[(3, NA), (4, NB), (5, NC)])
        .cluster(&[3])
        .local(&[4])
        .all(&[3, 4]),
    ];
    for case in &cases {
        run(case);
    }
}

#[test]
fn test_endpoints_map_from_esc() {
    let name = "1 slice, 2 hosts, ports 80,443";
    let set = set_of_slices(vec![generated(
        1,
        3,
        255,
        255,
        &["host1", "host2"],
        &[80, 443],
    )]);
    for (index, port) in [(0, 80), (1, 443)] {
        let want = sorted(
            [
                lines(1, &[1, 3], port, "rs--"),
                lines(1, &[2], port, "rs-l"),
            ]
            .concat(),
        );
        assert_eq!(port_map(&set, index), want, "{name}");
    }

    let name = "2 slices, same port";
    let set = set_of_slices(vec![
        generated(1, 3, 255, 255, &[], &[80]),
        generated(2, 3, 255, 255, &[], &[80]),
    ]);
    let want = sorted(
        [
            lines(1, &[1, 2, 3], 80, "rs--"),
            lines(2, &[1, 2, 3], 80, "rs--"),
        ]
        .concat(),
    );
    assert_eq!(port_map(&set, 0), want, "{name}");

    let name = "2 overlapping slices, same port";
    let set = set_of_slices(vec![
        generated(1, 3, 255, 255, &[], &[80]),
        generated(1, 4, 255, 255, &[], &[80]),
    ]);
    assert_eq!(
        port_map(&set, 0),
        sorted(lines(1, &[1, 2, 3, 4], 80, "rs--")),
        "{name}"
    );

    // An endpoint ready in either slice is ready.
    let name = "2 slices, overlapping endpoints, some endpoints unready in 1 or both";
    let set = set_of_slices(vec![
        generated(1, 10, 3, 255, &[], &[80]),
        generated(1, 10, 6, 255, &[], &[80]),
    ]);
    let want = sorted(
        [
            lines(1, &[1, 2, 3, 4, 5, 7, 8, 9, 10], 80, "rs--"),
            lines(1, &[6], 80, "----"),
        ]
        .concat(),
    );
    assert_eq!(port_map(&set, 0), want, "{name}");

    let name =
        "2 slices, overlapping endpoints, some endpoints unready and some endpoints terminating";
    let set = set_of_slices(vec![
        generated(1, 10, 3, 5, &[], &[80]),
        generated(1, 10, 6, 5, &[], &[80]),
    ]);
    let want = sorted(
        [
            lines(1, &[1, 2, 3, 4, 7, 8, 9], 80, "rs--"),
            lines(1, &[5, 10], 80, "-st-"),
            lines(1, &[6], 80, "----"),
        ]
        .concat(),
    );
    assert_eq!(port_map(&set, 0), want, "{name}");

    let name = "2 slices, overlapping endpoints, all unready";
    let set = set_of_slices(vec![
        generated(1, 10, 1, 255, &[], &[80]),
        generated(1, 10, 1, 255, &[], &[80]),
    ]);
    let all: Vec<u8> = (1..=10).collect();
    assert_eq!(
        port_map(&set, 0),
        sorted(lines(1, &all, 80, "----")),
        "{name}"
    );

    let name = "Different endpoints with duplicate IPs should not be filtered";
    let set = set_of_slices(vec![
        generated(1, 2, 255, 255, &["host1", "host2"], &[80]),
        generated(1, 2, 255, 255, &["host1", "host2"], &[8080]),
    ]);
    let want = sorted(
        [
            lines(1, &[1], 80, "rs--"),
            lines(1, &[1], 8080, "rs--"),
            lines(1, &[2], 80, "rs-l"),
            lines(1, &[2], 8080, "rs-l"),
        ]
        .concat(),
    );
    assert_eq!(port_map(&set, 0), want, "{name}");
    // "3 slices with different services and namespaces" is the change tracker's job here
    // (slices are grouped by owner before they reach this function): see
    // tracker.rs, a_slice_that_changes_owner_leaves_the_old_one and
    // slices_of_unknown_services_are_kept_but_not_recorded. "Nil port should not break
    // anything" is a conversion case: a slice port without a number is skipped with a warning
    // there (convert.rs).
}
