//! Which endpoints a service port uses on this node.
//!
//! This follows kube-proxy's `CategorizeEndpoints` (pkg/proxy/topology.go), so that a
//! service behaves the same whichever proxy the node runs:
//!
//! * Ready endpoints are used; only when there are none anywhere (for the Cluster list) or
//!   none on this node (for the Local list) do serving-but-terminating endpoints stand in,
//!   so that connections drain to pods that are shutting down instead of failing.
//! * Topology hints narrow the Cluster list, as kube-proxy 1.35's `topologyModeFromHints`
//!   and `availableForTopology` decide (see [`topology`]): to the endpoints hinted for this
//!   node (PreferSameNode) when every ready endpoint has node hints and one is hinted for
//!   this node; else to those hinted for this node's zone (PreferSameZone, PreferClose,
//!   topology-mode Auto) when every ready endpoint has zone hints and one is hinted for the
//!   zone; else to none of them: every ready endpoint. A partly hinted set means the
//!   EndpointSlice controller is mid-update or has given up on hints, and following half of
//!   them would overload some endpoints.
//! * Like kube-proxy, hints are honoured whenever they are present, whatever the service's
//!   `trafficDistribution` or topology annotation says: the EndpointSlice controller only
//!   writes hints for services that asked, so the hints are the decision.
//!   [`Service::prefer_close`](super::Service::prefer_close) is therefore informational here.
//! * The Local lists (`internalTrafficPolicy` / `externalTrafficPolicy: Local`) ignore
//!   hints: they are node-local already.

use std::{
    collections::{BTreeMap, btree_map::Entry},
    net::IpAddr,
};

use super::{Endpoint, EndpointSet, NodeInfo, Service, ServicePort, endpoint::PortEndpoint};

/// Every endpoint that serves `port`, over all of the service's slices.
///
/// A slice serves the port when it lists a port of the same name and protocol; the number
/// comes from the slice (it is the target port). The same address and port may appear in
/// two slices while the EndpointSlice controller moves an endpoint between them; only one
/// copy is kept, the healthiest (ready, then serving, then not terminating), so that a
/// backend never gets double weight and a stale not-ready copy never hides a ready one.
/// The result is sorted by (ip, port) so that identical input programs identical maps.
pub fn endpoints_for_port(set: &EndpointSet, port: &ServicePort) -> Vec<PortEndpoint> {
    let mut best: BTreeMap<(IpAddr, u16), PortEndpoint> = BTreeMap::new();
    for slice in set.slices.values() {
        let matching = slice
            .ports
            .iter()
            .filter(|sp| sp.name == port.name && sp.protocol == port.protocol);
        for slice_port in matching {
            for ep in &slice.endpoints {
                let candidate = || PortEndpoint {
                    ip: ep.ip,
                    port: slice_port.port,
                    endpoint: ep.clone(),
                };
                match best.entry((ep.ip, slice_port.port)) {
                    Entry::Vacant(v) => {
                        v.insert(candidate());
                    }
                    // Ties keep the first copy, i.e. the one from the slice whose name sorts
                    // first: deterministic, whatever order the slices arrived in.
                    Entry::Occupied(mut o) if health(ep) > health(&o.get().endpoint) => {
                        o.insert(candidate());
                    }
                    Entry::Occupied(_) => {}
                }
            }
        }
    }
    best.into_values().collect()
}

/// Orders duplicates of one endpoint: ready beats serving beats neither, and among equals
/// one that is not terminating wins.
fn health(ep: &Endpoint) -> (bool, bool, bool) {
    (ep.ready, ep.serving, !ep.terminating)
}

/// The endpoints of one service port, sorted into what each traffic policy may use.
///
/// Every list is sorted by (ip, port).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Categorized {
    /// What `Cluster` traffic policy uses: ready endpoints anywhere (narrowed by topology),
    /// or serving-terminating ones when none is ready. Empty when the service never uses
    /// Cluster policy.
    pub cluster: Vec<PortEndpoint>,
    /// What `Local` traffic policy uses: ready endpoints on this node, or serving-terminating
    /// ones on this node when none is ready. Empty when the service never uses Local policy.
    pub local: Vec<PortEndpoint>,
    /// The union of `cluster` and `local`: every endpoint this node may send to, e.g. for
    /// conntrack cleanup or for maps shared by both policies.
    pub all_reachable: Vec<PortEndpoint>,
    /// Whether a usable (ready, or serving and terminating) endpoint exists anywhere in the
    /// cluster. With a Local policy and no local endpoint, this decides between rejecting
    /// (the service has no endpoints at all) and dropping (the endpoints are elsewhere and
    /// the client should retry via another node).
    pub has_any_endpoints: bool,
}

/// kube-proxy's `ExternallyAccessible`, at service level: the model's ports differ only in
/// their node ports, and a service has node ports on all of its ports or none.
fn externally_accessible(svc: &Service) -> bool {
    svc.ports.iter().any(|p| p.node_port.is_some())
        || !svc.load_balancer_ips.is_empty()
        || !svc.external_ips.is_empty()
}

/// Cluster endpoints are needed for internal traffic under Cluster policy, and for any
/// external traffic: even with `externalTrafficPolicy: Local`, traffic from pods to an
/// external IP is short-circuited to Cluster endpoints.
fn uses_cluster_endpoints(svc: &Service) -> bool {
    !svc.internal_policy_local || externally_accessible(svc)
}

fn uses_local_endpoints(svc: &Service) -> bool {
    svc.internal_policy_local || (svc.external_policy_local && externally_accessible(svc))
}

/// The endpoint runs on `node`.
pub fn is_local(ep: &Endpoint, node: &NodeInfo) -> bool {
    !node.name.is_empty() && ep.node_name() == Some(node.name.as_str())
}

fn is_serving_terminating(ep: &Endpoint) -> bool {
    ep.serving && ep.terminating
}

/// How the Cluster list is narrowed by topology hints on this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology<'a> {
    /// The endpoints hinted for this node (PreferSameNode).
    SameNode(&'a str),
    /// The endpoints hinted for this node's zone (PreferSameZone, PreferClose, Auto).
    SameZone(&'a str),
}

impl Topology<'_> {
    /// kube-proxy's availableForTopology: no fallback here, that was decided in
    /// [`topology`].
    pub fn allows(self, ep: &Endpoint) -> bool {
        let has = |hints: &[std::sync::Arc<str>], want: &str| hints.iter().any(|h| &**h == want);
        match self {
            Topology::SameNode(node) => has(ep.node_hints(), node),
            Topology::SameZone(zone) => has(ep.zone_hints(), zone),
        }
    }
}

/// kube-proxy 1.35's topologyModeFromHints (pkg/proxy/topology.go), over the ready
/// endpoints only:
/// 1. every one has node hints and at least one is hinted for this node's name:
///    PreferSameNode (the PreferSameTrafficDistribution gate is GA, so always on);
/// 2. else every one has zone hints and at least one is hinted for this node's zone
///    (topology.kubernetes.io/zone; none or empty matches nothing): PreferSameZone;
/// 3. else no topology (None): every ready endpoint.
///
/// The EndpointSlice controller hints an endpoint for its own node (and zone) under
/// PreferSameNode, so a node with a ready endpoint of the service keeps to it, and one
/// without falls back to its zone's, then to all.
pub fn topology<'a>(eps: &[PortEndpoint], node: &'a NodeInfo) -> Option<Topology<'a>> {
    let node_name = node.name.as_str();
    let zone = node.zone.as_deref().unwrap_or("");
    let (mut all_node_hints, mut for_node) = (true, false);
    let (mut all_zone_hints, mut for_zone) = (true, false);
    for ep in eps.iter().map(|pe| &pe.endpoint).filter(|ep| ep.ready) {
        if ep.zone_hints().is_empty() {
            all_zone_hints = false;
        } else if !zone.is_empty() && ep.zone_hints().iter().any(|h| &**h == zone) {
            for_zone = true;
        }
        if ep.node_hints().is_empty() {
            all_node_hints = false;
        } else if !node_name.is_empty() && ep.node_hints().iter().any(|h| &**h == node_name) {
            for_node = true;
        }
    }
    if all_node_hints && for_node {
        return Some(Topology::SameNode(node_name));
    }
    (all_zone_hints && for_zone).then_some(Topology::SameZone(zone))
}

fn filter(eps: &[PortEndpoint], keep: impl Fn(&Endpoint) -> bool) -> Vec<PortEndpoint> {
    eps.iter()
        .filter(|pe| keep(&pe.endpoint))
        .cloned()
        .collect()
}

/// Splits `eps` (as returned by [`endpoints_for_port`]) into the lists each traffic policy
/// uses on `node`, following kube-proxy's `CategorizeEndpoints`.
///
/// Only the lists the service can use are filled, so an empty `local` on a service with
/// Cluster policies means "not needed", not "no local endpoints".
pub fn categorize(svc: &Service, eps: &[PortEndpoint], node: &NodeInfo) -> Categorized {
    let mut out = Categorized::default();
    if eps.is_empty() {
        return out;
    }

    let uses_cluster = uses_cluster_endpoints(svc);
    let mut topo = None;
    if uses_cluster {
        topo = topology(eps, node);
        out.cluster = filter(eps, |ep| ep.ready && topo.is_none_or(|t| t.allows(ep)));
        // Topology was already abandoned above if it would leave no ready endpoint, so an
        // empty list here means nothing is ready anywhere.
        if out.cluster.is_empty() {
            out.cluster = filter(eps, is_serving_terminating);
        }
        out.has_any_endpoints = !out.cluster.is_empty();
    }

    if !uses_local_endpoints(svc) {
        out.all_reachable = out.cluster.clone();
        return out;
    }

    let mut local_ready = false;
    let mut local_serving_terminating = false;
    for ep in eps.iter().map(|pe| &pe.endpoint) {
        if ep.ready || is_serving_terminating(ep) {
            out.has_any_endpoints = true;
            if is_local(ep, node) {
                local_ready |= ep.ready;
                local_serving_terminating |= !ep.ready;
            }
        }
    }
    let local_fallback = !local_ready && local_serving_terminating;
    if local_ready {
        out.local = filter(eps, |ep| is_local(ep, node) && ep.ready);
    } else if local_fallback {
        out.local = filter(eps, |ep| is_local(ep, node) && is_serving_terminating(ep));
    }

    out.all_reachable = if !uses_cluster {
        out.local.clone()
    } else if topo.is_none() && !local_fallback {
        // Cluster holds every ready endpoint and local only ready ones: a superset.
        out.cluster.clone()
    } else {
        // Cluster may lack local endpoints (other nodes' or zones' hints, or terminating ones that
        // local fell back to), and local lacks remote ones: merge.
        let mut union: BTreeMap<(IpAddr, u16), PortEndpoint> = BTreeMap::new();
        for pe in out.cluster.iter().chain(&out.local) {
            union.entry((pe.ip, pe.port)).or_insert_with(|| pe.clone());
        }
        union.into_values().collect()
    };
    out
}

impl Categorized {
    /// What traffic to the cluster IPs uses: `internalTrafficPolicy` decides.
    pub fn internal(&self, svc: &Service) -> &[PortEndpoint] {
        if svc.internal_policy_local {
            &self.local
        } else {
            &self.cluster
        }
    }

    /// What traffic from outside the cluster (node ports, external and load balancer IPs)
    /// uses: `externalTrafficPolicy` decides.
    pub fn external(&self, svc: &Service) -> &[PortEndpoint] {
        if svc.external_policy_local {
            &self.local
        } else {
            &self.cluster
        }
    }
}

/// The endpoints for traffic to `svc`'s cluster IPs on `node`, for a dataplane that needs
/// only that list ([`categorize`] then [`Categorized::internal`]).
pub fn internal_backends(
    svc: &Service,
    eps: &[PortEndpoint],
    node: &NodeInfo,
) -> Vec<PortEndpoint> {
    let c = categorize(svc, eps, node);
    if svc.internal_policy_local {
        c.local
    } else {
        c.cluster
    }
}

/// The endpoints for external traffic to `svc` on `node` ([`categorize`] then
/// [`Categorized::external`]).
pub fn external_backends(
    svc: &Service,
    eps: &[PortEndpoint],
    node: &NodeInfo,
) -> Vec<PortEndpoint> {
    let c = categorize(svc, eps, node);
    if svc.external_policy_local {
        c.local
    } else {
        c.cluster
    }
}

#[cfg(test)]
#[path = "select_kube_tests.rs"]
mod kube_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Protocol, ServiceKey, SliceInfo, SlicePort};

    fn ep(ip: &str) -> Endpoint {
        Endpoint {
            ip: ip.parse().unwrap(),
            ready: true,
            serving: true,
            terminating: false,
            placement: Default::default(),
        }
    }

    fn not_ready(ip: &str) -> Endpoint {
        Endpoint {
            ready: false,
            serving: false,
            ..ep(ip)
        }
    }

    fn terminating(ip: &str) -> Endpoint {
        Endpoint {
            ready: false,
            serving: true,
            terminating: true,
            ..ep(ip)
        }
    }

    fn on(node: &str, e: Endpoint) -> Endpoint {
        e.placed(|at| {
            at.node_name = Some(node.into());
        })
    }

    fn hinted(zones: &[&str], e: Endpoint) -> Endpoint {
        e.placed(|at| {
            at.zone_hints = zones.iter().map(|&z| z.into()).collect();
        })
    }

    fn pe(e: Endpoint) -> PortEndpoint {
        PortEndpoint {
            ip: e.ip,
            port: 8080,
            endpoint: e,
        }
    }

    fn ips(list: &[PortEndpoint]) -> Vec<String> {
        list.iter().map(|p| p.ip.to_string()).collect()
    }

    fn svc() -> Service {
        Service::cluster_ip(
            ServiceKey::new("default", "web"),
            vec!["198.19.96.1".parse().unwrap()],
            vec![port("http", Protocol::Tcp)],
        )
    }

    fn node_port_svc() -> Service {
        Service {
            ports: vec![ServicePort {
                node_port: Some(30080),
                ..port("http", Protocol::Tcp)
            }],
            ..svc()
        }
    }

    fn port(name: &str, protocol: Protocol) -> ServicePort {
        ServicePort {
            name: name.into(),
            port: 80,
            protocol,
            node_port: None,
        }
    }

    fn slice(ports: &[(&str, u16, Protocol)], endpoints: Vec<Endpoint>) -> SliceInfo {
        SliceInfo {
            ports: ports
                .iter()
                .map(|&(name, port, protocol)| SlicePort {
                    name: name.into(),
                    port,
                    protocol,
                })
                .collect(),
            endpoints,
        }
    }

    fn set(slices: Vec<(&str, SliceInfo)>) -> EndpointSet {
        EndpointSet {
            slices: slices.into_iter().map(|(n, s)| (n.to_owned(), s)).collect(),
        }
    }

    fn node(name: &str, zone: Option<&str>) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            zone: zone.map(Into::into),
        }
    }

    #[test]
    fn port_endpoints_match_name_and_protocol() {
        let set = set(vec![
            (
                "a",
                slice(
                    &[("http", 8080, Protocol::Tcp), ("dns", 53, Protocol::Udp)],
                    vec![ep("198.18.0.2"), ep("198.18.0.1")],
                ),
            ),
            (
                "b",
                slice(&[("http", 8080, Protocol::Udp)], vec![ep("198.18.0.3")]),
            ),
            (
                "c",
                slice(&[("metrics", 9090, Protocol::Tcp)], vec![ep("198.18.0.4")]),
            ),
        ]);
        let got = endpoints_for_port(&set, &port("http", Protocol::Tcp));
        assert_eq!(
            ips(&got),
            ["198.18.0.1", "198.18.0.2"],
            "sorted, and only slices serving http/TCP"
        );
        assert!(
            got.iter().all(|p| p.port == 8080),
            "the slice's (target) port is used"
        );
        assert_eq!(
            ips(&endpoints_for_port(&set, &port("dns", Protocol::Udp))),
            ["198.18.0.1", "198.18.0.2"]
        );
        assert!(endpoints_for_port(&set, &port("dns", Protocol::Tcp)).is_empty());
        assert!(
            endpoints_for_port(&EndpointSet::default(), &port("http", Protocol::Tcp)).is_empty()
        );
    }

    #[test]
    fn unnamed_port_matches_unnamed_slice_port() {
        let set = set(vec![(
            "a",
            slice(&[("", 8080, Protocol::Tcp)], vec![ep("198.18.0.1")]),
        )]);
        assert_eq!(endpoints_for_port(&set, &port("", Protocol::Tcp)).len(), 1);
        assert!(endpoints_for_port(&set, &port("http", Protocol::Tcp)).is_empty());
    }

    #[test]
    fn duplicates_across_slices_count_once_and_the_healthiest_wins() {
        let http = &[("http", 8080, Protocol::Tcp)];
        let set = set(vec![
            (
                "a",
                slice(
                    http,
                    vec![
                        not_ready("198.18.0.1"),
                        ep("198.18.0.2"),
                        terminating("198.18.0.3"),
                    ],
                ),
            ),
            (
                "b",
                slice(
                    http,
                    vec![
                        ep("198.18.0.1"),
                        on("node-b", ep("198.18.0.2")),
                        not_ready("198.18.0.3"),
                    ],
                ),
            ),
        ]);
        let got = endpoints_for_port(&set, &port("http", Protocol::Tcp));
        assert_eq!(ips(&got), ["198.18.0.1", "198.18.0.2", "198.18.0.3"]);
        assert!(
            got[0].endpoint.ready,
            "ready beats not ready, whichever slice it is in"
        );
        assert_eq!(
            got[1].endpoint.node_name(),
            None,
            "a tie keeps the copy from the first slice by name"
        );
        assert!(got[2].endpoint.serving, "serving beats not serving");
    }

    #[test]
    fn same_ip_on_different_ports_is_two_backends() {
        let set = set(vec![
            (
                "a",
                slice(&[("http", 8080, Protocol::Tcp)], vec![ep("198.18.0.1")]),
            ),
            (
                "b",
                slice(&[("http", 8081, Protocol::Tcp)], vec![ep("198.18.0.1")]),
            ),
        ]);
        let got = endpoints_for_port(&set, &port("http", Protocol::Tcp));
        assert_eq!(got.iter().map(|p| p.port).collect::<Vec<_>>(), [8080, 8081]);
    }

    #[test]
    fn cluster_policy_uses_ready_endpoints() {
        let eps = [
            pe(ep("198.18.0.1")),
            pe(not_ready("198.18.0.2")),
            pe(terminating("198.18.0.3")),
            pe(ep("198.18.0.4")),
        ];
        let c = categorize(&svc(), &eps, &node("node-a", None));
        assert_eq!(ips(&c.cluster), ["198.18.0.1", "198.18.0.4"]);
        assert!(c.local.is_empty(), "not needed");
        assert_eq!(c.all_reachable, c.cluster);
        assert!(c.has_any_endpoints);
    }

    #[test]
    fn cluster_policy_falls_back_to_serving_terminating() {
        let eps = [
            pe(not_ready("198.18.0.1")),
            pe(terminating("198.18.0.2")),
            pe(Endpoint {
                serving: false,
                ..terminating("198.18.0.3")
            }),
        ];
        let c = categorize(&svc(), &eps, &node("node-a", None));
        assert_eq!(ips(&c.cluster), ["198.18.0.2"]);
        assert!(c.has_any_endpoints);
    }

    #[test]
    fn nothing_usable_means_no_endpoints() {
        let eps = [pe(not_ready("198.18.0.1"))];
        for s in [
            svc(),
            Service {
                internal_policy_local: true,
                ..svc()
            },
        ] {
            let c = categorize(&s, &eps, &node("node-a", None));
            assert_eq!(c, Categorized::default());
        }
        assert_eq!(
            categorize(&svc(), &[], &node("node-a", None)),
            Categorized::default()
        );
    }

    #[test]
    fn zone_hints_narrow_cluster_endpoints() {
        let eps = [
            pe(hinted(&["zone-a"], ep("198.18.0.1"))),
            pe(hinted(&["zone-b"], ep("198.18.0.2"))),
            pe(hinted(&["zone-a", "zone-c"], ep("198.18.0.3"))),
            pe(not_ready("198.18.0.4")), // not ready: its missing hints do not matter
        ];
        let c = categorize(&svc(), &eps, &node("node-a", Some("zone-a")));
        assert_eq!(ips(&c.cluster), ["198.18.0.1", "198.18.0.3"]);
        let c = categorize(&svc(), &eps, &node("node-a", Some("zone-c")));
        assert_eq!(ips(&c.cluster), ["198.18.0.3"]);
    }

    #[test]
    fn zone_hints_are_ignored_unless_complete_and_useful() {
        let partly = [
            pe(hinted(&["zone-a"], ep("198.18.0.1"))),
            pe(ep("198.18.0.2")),
        ];
        let c = categorize(&svc(), &partly, &node("node-a", Some("zone-a")));
        assert_eq!(
            ips(&c.cluster),
            ["198.18.0.1", "198.18.0.2"],
            "one ready endpoint has no hints"
        );

        let hinted_all = [
            pe(hinted(&["zone-a"], ep("198.18.0.1"))),
            pe(hinted(&["zone-b"], ep("198.18.0.2"))),
        ];
        let c = categorize(&svc(), &hinted_all, &node("node-a", Some("zone-z")));
        assert_eq!(c.cluster.len(), 2, "no endpoint for our zone");
        let c = categorize(&svc(), &hinted_all, &node("node-a", None));
        assert_eq!(c.cluster.len(), 2, "node has no zone");
        let c = categorize(&svc(), &hinted_all, &node("node-a", Some("")));
        assert_eq!(c.cluster.len(), 2, "empty zone label");
    }

    #[test]
    fn terminating_fallback_ignores_topology() {
        // Hints are computed on ready endpoints; with none ready there is no topology.
        let eps = [pe(hinted(&["zone-b"], terminating("198.18.0.1")))];
        let c = categorize(&svc(), &eps, &node("node-a", Some("zone-a")));
        assert_eq!(ips(&c.cluster), ["198.18.0.1"]);
    }

    #[test]
    fn internal_local_uses_only_this_node() {
        let s = Service {
            internal_policy_local: true,
            ..svc()
        };
        let eps = [
            pe(on("node-a", ep("198.18.0.1"))),
            pe(on("node-b", ep("198.18.0.2"))),
            pe(on("node-a", not_ready("198.18.0.3"))),
        ];
        let c = categorize(&s, &eps, &node("node-a", None));
        assert!(
            c.cluster.is_empty(),
            "a ClusterIP-only service with internal Local never uses Cluster"
        );
        assert_eq!(ips(&c.local), ["198.18.0.1"]);
        assert_eq!(c.all_reachable, c.local);
        assert!(c.has_any_endpoints);
        assert_eq!(internal_backends(&s, &eps, &node("node-a", None)), c.local);

        let elsewhere = categorize(&s, &eps, &node("node-c", None));
        assert!(elsewhere.local.is_empty());
        assert!(
            elsewhere.has_any_endpoints,
            "endpoints exist, just not here: drop, don't reject"
        );
    }

    #[test]
    fn local_falls_back_to_serving_terminating_on_this_node() {
        let s = Service {
            internal_policy_local: true,
            ..svc()
        };
        let eps = [
            pe(on("node-a", terminating("198.18.0.1"))),
            pe(on("node-b", ep("198.18.0.2"))),
        ];
        let c = categorize(&s, &eps, &node("node-a", None));
        assert_eq!(ips(&c.local), ["198.18.0.1"]);
    }

    #[test]
    fn nameless_node_has_no_local_endpoints() {
        let s = Service {
            internal_policy_local: true,
            ..svc()
        };
        let eps = [pe(ep("198.18.0.1"))];
        assert!(categorize(&s, &eps, &node("", None)).local.is_empty());
    }

    #[test]
    fn external_local_keeps_cluster_endpoints_for_internal_traffic() {
        let s = Service {
            external_policy_local: true,
            ..node_port_svc()
        };
        let eps = [
            pe(on("node-a", ep("198.18.0.1"))),
            pe(on("node-b", ep("198.18.0.2"))),
        ];
        let n = node("node-a", None);
        let c = categorize(&s, &eps, &n);
        assert_eq!(ips(&c.cluster), ["198.18.0.1", "198.18.0.2"]);
        assert_eq!(ips(&c.local), ["198.18.0.1"]);
        assert_eq!(c.all_reachable, c.cluster, "cluster is a superset of local");
        assert_eq!(c.internal(&s), c.cluster.as_slice());
        assert_eq!(c.external(&s), c.local.as_slice());
        assert_eq!(external_backends(&s, &eps, &n), c.local);
        assert_eq!(internal_backends(&s, &eps, &n), c.cluster);
    }

    #[test]
    fn external_local_without_external_access_is_cluster_only() {
        // Conversion never produces this, but categorize must not invent a Local list.
        let s = Service {
            external_policy_local: true,
            ..svc()
        };
        let c = categorize(
            &s,
            &[pe(on("node-a", ep("198.18.0.1")))],
            &node("node-a", None),
        );
        assert!(c.local.is_empty());
        assert_eq!(c.cluster.len(), 1);
    }

    #[test]
    fn internal_local_with_external_access_needs_both() {
        let s = Service {
            internal_policy_local: true,
            external_ips: vec!["198.19.2.1".parse().unwrap()],
            ..svc()
        };
        let eps = [
            pe(on("node-a", ep("198.18.0.1"))),
            pe(on("node-b", ep("198.18.0.2"))),
        ];
        let c = categorize(&s, &eps, &node("node-a", None));
        assert_eq!(ips(&c.cluster), ["198.18.0.1", "198.18.0.2"]);
        assert_eq!(ips(&c.local), ["198.18.0.1"]);
        assert_eq!(c.internal(&s), c.local.as_slice());
        assert_eq!(c.external(&s), c.cluster.as_slice());
    }

    #[test]
    fn all_reachable_merges_when_local_is_not_a_subset() {
        let s = Service {
            external_policy_local: true,
            ..node_port_svc()
        };
        // Local fell back to a terminating endpoint that Cluster (which has a ready one
        // elsewhere) does not include.
        let eps = [
            pe(on("node-a", terminating("198.18.0.1"))),
            pe(on("node-b", ep("198.18.0.2"))),
        ];
        let c = categorize(&s, &eps, &node("node-a", None));
        assert_eq!(ips(&c.cluster), ["198.18.0.2"]);
        assert_eq!(ips(&c.local), ["198.18.0.1"]);
        assert_eq!(ips(&c.all_reachable), ["198.18.0.1", "198.18.0.2"]);

        // Topology left our own (other-zone-hinted) endpoint out of Cluster.
        let eps = [
            pe(on("node-a", hinted(&["zone-b"], ep("198.18.0.1")))),
            pe(on("node-b", hinted(&["zone-a"], ep("198.18.0.2")))),
        ];
        let c = categorize(&s, &eps, &node("node-a", Some("zone-a")));
        assert_eq!(ips(&c.cluster), ["198.18.0.2"]);
        assert_eq!(ips(&c.local), ["198.18.0.1"]);
        assert_eq!(ips(&c.all_reachable), ["198.18.0.1", "198.18.0.2"]);
    }
}
