//! The model as an nftables transaction, for `nft -f -`: a pure function, so the whole
//! ruleset can be checked in unit tests without a kernel.
//!
//! The layout is kube-proxy's nftables mode (pkg/proxy/nftables/proxier.go), object for
//! object, in a table `fastpath` of family `ip` or `ip6` instead of `kube-proxy`:
//!
//! ```text
//! nat-prerouting/nat-output -> services: ip daddr . meta l4proto . th dport vmap @service-ips
//!                                        (node address) meta l4proto . th dport vmap @service-nodeports
//!     service-ips -> goto service-X (Cluster policy) | local-X (Local) | external-X
//!     external-X  -> mark for masquerade (Cluster policy), short-circuits, goto the policy chain
//!     service-X   -> dnat to numgen random mod n offset B map @endpoints-tcp-XX (no affinity;
//!                    kube-proxy: numgen random mod n vmap { i : goto endpoint-Y })
//!                    | affinity sets first, then numgen random mod k 0 goto endpoint-Y
//!     endpoint-Y  -> affinity update, dnat to the endpoint (with affinity only)
//! nat-postrouting -> hairpin pairs (@hairpin-endpoints) marked, then masquerading:
//!                    masquerade what mark-for-masquerade marked
//! filter-*        -> firewall-check (@firewall-ips: loadBalancerSourceRanges), service- and
//!                    nodeport-endpoints-check (@no-endpoint-*: reject or drop), cluster-ips-check
//!                    (a held cluster IP on another port, or an address of the service ranges
//!                    nobody holds: reject)
//! ```
//!
//! Text is written as knftables' Fake `Dump()` writes it, one `add` statement per line, so
//! upstream's expected dumps map onto ours with the table name changed. [`render_full`] is
//! the state of one family's table; [`Rendered`] keeps it per service for partial syncs.

pub mod endpoints;
mod names;
mod service;
mod transaction;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::IpAddr,
    sync::Arc,
};

pub use self::{
    endpoints::{ElementChange, Slots},
    names::{PortNames, endpoint_names, is_service_chain},
    service::{ServiceObjects, spread},
    transaction::{Partial, Undo, elements_text},
};
use crate::{
    dataplane::{
        frontends::port_endpoints,
        iptables::render::{Family, LocalTraffic, RenderConfig, nodeport_cidrs_of},
    },
    model::{NodeInfo, ProxyState, Service, ServiceKey},
};

/// Our table's name, in the families `ip` and `ip6`.
pub const TABLE: &str = "fastpath";

pub const SERVICES: &str = "services";
pub const MARK_MASQ: &str = "mark-for-masquerade";
pub const MASQUERADING: &str = "masquerading";
pub const REJECT_CHAIN: &str = "reject-chain";
pub const FIREWALL_CHECK: &str = "firewall-check";
pub const SERVICE_ENDPOINTS_CHECK: &str = "service-endpoints-check";
pub const NODEPORT_ENDPOINTS_CHECK: &str = "nodeport-endpoints-check";
pub const CLUSTER_IPS_CHECK: &str = "cluster-ips-check";
pub const NODEPORT_IPS: &str = "nodeport-ips";
pub const HAIRPIN: &str = "hairpin-endpoints";

/// The sets and maps every service adds elements to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Container {
    ClusterIps,
    ServiceIps,
    ServiceNodeports,
    NoEndpointServices,
    NoEndpointNodeports,
    FirewallIps,
    /// `ip . ip` for every endpoint address: a DNAT to the client itself (hairpin).
    Hairpin,
}

impl Container {
    pub fn name(self) -> &'static str {
        match self {
            Container::ClusterIps => "cluster-ips",
            Container::ServiceIps => "service-ips",
            Container::ServiceNodeports => "service-nodeports",
            Container::NoEndpointServices => "no-endpoint-services",
            Container::NoEndpointNodeports => "no-endpoint-nodeports",
            Container::FirewallIps => "firewall-ips",
            Container::Hairpin => HAIRPIN,
        }
    }
}

/// `ip` or `ip6`: the table's family and the address match's prefix.
pub fn family_name(family: Family) -> &'static str {
    if family.is_v4() { "ip" } else { "ip6" }
}

/// What one family's rendering of a service port needs besides the port.
pub(crate) struct Target<'a> {
    pub cluster_ip: IpAddr,
    pub family: Family,
    /// The matches for pods' traffic and for the rest, in nft syntax.
    pub local: Option<(String, String)>,
    pub masquerade_all: bool,
    pub node_ips: &'a [IpAddr],
}

/// kube-proxy's LocalTrafficDetector as nft matches (IfLocalNFT, IfNotLocalNFT).
fn local_matches(local: &LocalTraffic, family: Family) -> Option<(String, String)> {
    let ip_x = family_name(family);
    match local {
        LocalTraffic::Cidrs(cidrs) => {
            cidrs
                .iter()
                .find(|(ip, _)| Family::of(ip) == family)
                .map(|&(ip, len)| {
                    (
                        format!("{ip_x} saddr {ip}/{len}"),
                        format!("{ip_x} saddr != {ip}/{len}"),
                    )
                })
        }
        LocalTraffic::Interface(dev) if dev.is_empty() || dev == "+" => None,
        LocalTraffic::Interface(dev) => {
            // iptables' `veth+` prefix is nft's `veth*`.
            let dev = match dev.strip_suffix('+') {
                Some(prefix) => format!("\"{prefix}*\""),
                None => dev.clone(),
            };
            Some((format!("iifname {dev}"), format!("iifname != {dev}")))
        }
    }
}

/// Renders one service for one family; None when it has no cluster IP of the family.
pub fn render_service(
    svc: &Service,
    eps: Option<&crate::model::EndpointSet>,
    node: &NodeInfo,
    family: Family,
    cfg: &RenderConfig,
) -> Option<ServiceObjects> {
    let &cluster_ip = svc.cluster_ips.iter().find(|ip| Family::of(ip) == family)?;
    let target = Target {
        cluster_ip,
        family,
        local: local_matches(&cfg.local_traffic, family),
        masquerade_all: cfg.masquerade_all,
        node_ips: &cfg.node_ips,
    };
    let mut out = ServiceObjects::default();
    for pe in port_endpoints(svc, eps, node, Some(family.is_v4())) {
        service::render_port(&mut out, svc, &pe, &target);
    }
    out.hairpin.sort();
    out.hairpin.dedup();
    out.hairpin.shrink_to_fit();
    Some(out)
}

/// Writes statements for one family's table: `add table ip fastpath ...` and so on.
pub struct Writer {
    family: Family,
    prefix: String,
    /// What must come first (the table made, the fixed objects), ahead of the maps.
    pub head: String,
    pub text: String,
    /// Endpoint maps this transaction declared so far.
    declared: BTreeSet<(&'static str, u8)>,
    decls: String,
    /// Element changes, written after the text.
    pub changes: Vec<ElementChange>,
}

impl Writer {
    pub fn new(family: Family) -> Self {
        Writer {
            family,
            prefix: format!("{} {TABLE}", family_name(family)),
            head: String::new(),
            text: String::new(),
            declared: BTreeSet::new(),
            decls: String::new(),
            changes: Vec::new(),
        }
    }

    /// `VERB KIND ip fastpath REST`, e.g. `add rule ip fastpath services ...`.
    pub fn line(&mut self, verb: &str, kind: &str, rest: &str) {
        let _ = writeln!(self.text, "{verb} {kind} {} {rest}", self.prefix);
    }

    /// Declares endpoint map `shard` once per transaction, ahead of every rule and element
    /// that names it.
    fn uses_map(&mut self, proto: &'static str, shard: u8) {
        if self.declared.insert((proto, shard)) {
            self.decls
                .push_str(&endpoints::declaration(self.family, proto, shard));
        }
    }

    pub fn change(&mut self, change: ElementChange) {
        if let ElementChange::Endpoint { proto, shard, .. } = change {
            self.uses_map(proto, shard);
        }
        self.changes.push(change);
    }

    /// The rule that ends `chain` with its spread: one DNAT through the chain's slot, or a
    /// rule per endpoint where it has none.
    pub fn spread(
        &mut self,
        chain: &str,
        spread: &endpoints::Spread,
        slot: Option<endpoints::Slot>,
    ) {
        match slot {
            Some(slot) => {
                self.uses_map(slot.proto, slot.shard);
                let n = spread.endpoints.len();
                self.rule(chain, &endpoints::rule(self.family, spread.proto, n, slot));
            }
            None => {
                for r in service::inline(spread.proto, &spread.endpoints) {
                    self.rule(chain, &r);
                }
            }
        }
    }

    /// Everything written so far as one `nft -f` text (the head, the maps used, the text,
    /// element changes last), leaving the writer empty.
    pub fn take(&mut self) -> String {
        let mut out = std::mem::take(&mut self.head);
        out.push_str(&std::mem::take(&mut self.decls));
        out.push_str(&std::mem::take(&mut self.text));
        for c in std::mem::take(&mut self.changes) {
            c.write(self.family, &mut out);
        }
        self.declared.clear();
        out
    }

    /// About how long [`Writer::take`]'s text would be.
    pub fn len(&self) -> usize {
        const CHANGE: usize = 64;
        self.head.len() + self.decls.len() + self.text.len() + CHANGE * self.changes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.head.is_empty() && self.text.is_empty() && self.changes.is_empty()
    }

    /// A service's chains, every one declared before any rule (a rule may go to a chain
    /// that comes later in name order), with their spreads' endpoints.
    pub fn chains(&mut self, objs: &ServiceObjects, slots: &Slots) {
        for name in objs.chains.keys() {
            self.line("add", "chain", name);
        }
        for (name, rules) in &objs.chains {
            for r in rules {
                self.rule(name, r);
            }
            if let Some(spread) = objs.spreads.get(name) {
                let slot = slots.get(name);
                self.spread(name, spread, slot);
                if let Some(slot) = slot {
                    for c in endpoints::diff(slot, &[], &spread.endpoints, true) {
                        self.change(c);
                    }
                }
            }
        }
    }

    pub fn rule(&mut self, chain: &str, rule: &str) {
        let _ = writeln!(self.text, "add rule {} {chain} {rule}", self.prefix);
    }

    pub fn affinity_set(&mut self, name: &str, timeout: u32, family: Family) {
        let ty = if family.is_v4() {
            "ipv4_addr"
        } else {
            "ipv6_addr"
        };
        self.line(
            "add",
            "set",
            &format!("{name} {{ type {ty} ; flags dynamic,timeout ; timeout {timeout}s ; }}"),
        );
    }

    /// `add element ip fastpath MAP { KEY [comment "C"] [: VERDICT] }`.
    pub fn element(&mut self, c: Container, key: &str, verdict: &str, comment: Option<&str>) {
        let mut body = format!("{} {{ {key}", c.name());
        if let Some(comment) = comment {
            let _ = write!(body, " comment \"{}\"", comment.replace('"', ""));
        }
        if !verdict.is_empty() {
            let _ = write!(body, " : {verdict}");
        }
        body.push_str(" }");
        self.line("add", "element", &body);
    }

    pub fn delete_element(&mut self, c: Container, key: &str) {
        self.line("delete", "element", &format!("{} {{ {key} }}", c.name()));
    }
}

/// The fixed objects: table, base chains and the jumps from them, the shared sets and
/// maps, and the rules that dispatch through them.
fn head(family: Family, cfg: &RenderConfig) -> String {
    let mut w = Writer::new(family);
    let ip_x = family_name(family);
    let addr = if family.is_v4() {
        "ipv4_addr"
    } else {
        "ipv6_addr"
    };
    let no_localhost = if family.is_v4() {
        "ip daddr != 127.0.0.0/8"
    } else {
        "ip6 daddr != ::1"
    };
    let mark = 1u32 << cfg.masquerade_bit.min(31);
    let mark = format!("{mark:#x}");
    let nodeport_nets: Option<Vec<(IpAddr, u8)>> =
        nodeport_cidrs_of(&cfg.nodeport_addresses, family).map(Iterator::collect);

    w.text.push_str(&format!(
        "add table {ip_x} {TABLE} {{ comment \"rules for kube-proxy\" ; }}\n"
    ));
    w.line(
        "add",
        "set",
        &format!("cluster-ips {{ type {addr} ; comment \"Active ClusterIPs\" ; }}"),
    );
    w.line(
        "add",
        "set",
        &format!(
            "{HAIRPIN} {{ type {addr} . {addr} ; comment \"endpoint addresses, each twice: DNAT to the client itself\" ; }}"
        ),
    );
    if nodeport_nets.is_some() {
        w.line(
            "add",
            "set",
            &format!(
                "{NODEPORT_IPS} {{ type {addr} ; comment \"IPs that accept NodePort traffic\" ; }}"
            ),
        );
    }
    let maps = [
        (
            Container::FirewallIps,
            true,
            "destinations that are subject to LoadBalancerSourceRanges",
        ),
        (
            Container::NoEndpointNodeports,
            false,
            "vmap to drop or reject packets to service nodeports with no endpoints",
        ),
        (
            Container::NoEndpointServices,
            true,
            "vmap to drop or reject packets to services with no endpoints",
        ),
        (
            Container::ServiceIps,
            true,
            "ClusterIP, ExternalIP and LoadBalancer IP traffic",
        ),
        (Container::ServiceNodeports, false, "NodePort traffic"),
    ];
    for (c, with_ip, comment) in maps {
        let key = if with_ip {
            format!("{addr} . inet_proto . inet_service")
        } else {
            "inet_proto . inet_service".to_string()
        };
        w.line(
            "add",
            "map",
            &format!(
                "{} {{ type {key} : verdict ; comment \"{comment}\" ; }}",
                c.name()
            ),
        );
    }

    let base = [
        ("filter-prerouting-pre-dnat", "filter", "prerouting", -110),
        ("filter-output-pre-dnat", "filter", "output", -110),
        ("filter-forward", "filter", "forward", 0),
        ("filter-input", "filter", "input", 0),
        ("filter-output", "filter", "output", 0),
        ("nat-output", "nat", "output", -100),
        ("nat-postrouting", "nat", "postrouting", 100),
        ("nat-prerouting", "nat", "prerouting", -100),
    ];
    for (name, ty, hook, prio) in base {
        w.line(
            "add",
            "chain",
            &format!("{name} {{ type {ty} hook {hook} priority {prio} ; }}"),
        );
    }
    for name in [
        CLUSTER_IPS_CHECK,
        FIREWALL_CHECK,
        MARK_MASQ,
        MASQUERADING,
        NODEPORT_ENDPOINTS_CHECK,
        SERVICES,
        SERVICE_ENDPOINTS_CHECK,
    ] {
        w.line("add", "chain", name);
    }
    w.line(
        "add",
        "chain",
        &format!(
            "{REJECT_CHAIN} {{ comment \"helper for @no-endpoint-services / @no-endpoint-nodeports\" ; }}"
        ),
    );

    w.rule(
        CLUSTER_IPS_CHECK,
        &format!(
            "{ip_x} daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\""
        ),
    );
    let ranges: Vec<String> = cfg
        .service_ranges
        .iter()
        .filter(|(ip, _)| Family::of(ip) == family)
        .map(|(ip, len)| format!("{ip}/{len}"))
        .collect();
    if !ranges.is_empty() {
        // kube-proxy drops here, and its clients wait for a timeout; every mode of ours
        // refuses at once (docs/modes.md).
        w.rule(
            CLUSTER_IPS_CHECK,
            &format!(
                "{ip_x} daddr {{ {} }} reject comment \"Reject traffic to unallocated ClusterIPs\"",
                ranges.join(" , ")
            ),
        );
    }
    let new = "ct state new jump";
    w.rule(
        "filter-prerouting-pre-dnat",
        &format!("{new} {FIREWALL_CHECK}"),
    );
    w.rule(
        "filter-forward",
        &format!("{new} {SERVICE_ENDPOINTS_CHECK}"),
    );
    w.rule("filter-forward", &format!("{new} {CLUSTER_IPS_CHECK}"));
    w.rule("filter-input", &format!("{new} {NODEPORT_ENDPOINTS_CHECK}"));
    w.rule("filter-input", &format!("{new} {SERVICE_ENDPOINTS_CHECK}"));
    w.rule("filter-output", &format!("{new} {SERVICE_ENDPOINTS_CHECK}"));
    w.rule("filter-output-pre-dnat", &format!("{new} {FIREWALL_CHECK}"));
    w.rule("filter-output", &format!("{new} {CLUSTER_IPS_CHECK}"));
    w.rule(
        FIREWALL_CHECK,
        &format!("{ip_x} daddr . meta l4proto . th dport vmap @firewall-ips"),
    );
    w.rule(MARK_MASQ, &format!("mark set mark or {mark}"));
    w.rule(MASQUERADING, &format!("mark and {mark} == 0 return"));
    w.rule(MASQUERADING, &format!("mark set mark xor {mark}"));
    w.rule(MASQUERADING, "masquerade fully-random");
    w.rule("nat-output", &format!("jump {SERVICES}"));
    w.rule(
        "nat-postrouting",
        &format!("ct status dnat {ip_x} saddr . {ip_x} daddr @{HAIRPIN} jump {MARK_MASQ}"),
    );
    w.rule("nat-postrouting", &format!("jump {MASQUERADING}"));
    w.rule("nat-prerouting", &format!("jump {SERVICES}"));
    let nodeport_dst = match &nodeport_nets {
        Some(_) => format!("{ip_x} daddr @{NODEPORT_IPS}"),
        None => no_localhost.to_string(),
    };
    w.rule(
        NODEPORT_ENDPOINTS_CHECK,
        &format!("{nodeport_dst} meta l4proto . th dport vmap @no-endpoint-nodeports"),
    );
    w.rule(REJECT_CHAIN, "reject");
    w.rule(
        SERVICES,
        &format!("{ip_x} daddr . meta l4proto . th dport vmap @service-ips"),
    );
    let nodeport_dst = match &nodeport_nets {
        Some(_) => format!("{ip_x} daddr @{NODEPORT_IPS}"),
        None => format!("fib daddr type local {no_localhost}"),
    };
    w.rule(
        SERVICES,
        &format!("{nodeport_dst} meta l4proto . th dport vmap @service-nodeports"),
    );
    if let Some(nets) = &nodeport_nets {
        let mut ips: Vec<IpAddr> = cfg
            .node_ips
            .iter()
            .copied()
            .filter(|ip| Family::of(ip) == family && !ip.is_loopback())
            .filter(|ip| {
                nets.iter()
                    .any(|&net| crate::dataplane::iptables::render::cidr_contains(net, *ip))
            })
            .collect();
        ips.sort();
        ips.dedup();
        for ip in ips {
            w.line("add", "element", &format!("{NODEPORT_IPS} {{ {ip} }}"));
        }
    }
    w.rule(
        SERVICE_ENDPOINTS_CHECK,
        &format!("{ip_x} daddr . meta l4proto . th dport vmap @no-endpoint-services"),
    );
    w.text
}

/// One family's table kept in parts, for partial syncs: the fixed objects and each
/// service's own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    pub family: Family,
    pub(super) head: String,
    pub services: BTreeMap<ServiceKey, Arc<ServiceObjects>>,
    /// How many services hold each hairpin element: a pod often backs several services,
    /// and its element may only go with the last of them.
    pub(super) hairpin_refs: BTreeMap<IpAddr, u32>,
    /// The endpoint map slot of every chain with a spread.
    pub(super) slots: Slots,
}

/// The `hairpin-endpoints` element of endpoint address `ip`.
pub(super) fn hairpin_pair(ip: IpAddr) -> String {
    format!("{ip} . {ip}")
}

impl Rendered {
    pub fn new(state: &ProxyState, node: &NodeInfo, family: Family, cfg: &RenderConfig) -> Self {
        Self::new_over(state, node, family, cfg, None)
    }

    /// As [`Rendered::new`], for a table that holds `previous`: chains keep their slots,
    /// and new ones take slots `previous` does not hold (its chains' elements go only
    /// when the new table is written).
    pub fn new_over(
        state: &ProxyState,
        node: &NodeInfo,
        family: Family,
        cfg: &RenderConfig,
        previous: Option<&Rendered>,
    ) -> Self {
        let services: BTreeMap<ServiceKey, Arc<ServiceObjects>> = state
            .services
            .iter()
            .filter_map(|(key, svc)| {
                let eps = state.endpoints.get(key).map(|e| &**e);
                let objs = render_service(svc, eps, node, family, cfg)?;
                Some((key.clone(), Arc::new(objs)))
            })
            .collect();
        let mut hairpin_refs: BTreeMap<IpAddr, u32> = BTreeMap::new();
        for objs in services.values() {
            for &ip in &objs.hairpin {
                *hairpin_refs.entry(ip).or_default() += 1;
            }
        }
        let mut slots = previous.map(|p| p.slots.clone()).unwrap_or_default();
        for objs in services.values() {
            for (chain, spread) in &objs.spreads {
                slots.hold(chain, spread.proto);
            }
        }
        Rendered {
            family,
            head: head(family, cfg),
            services,
            hairpin_refs,
            slots,
        }
    }

    /// The table's whole state, as knftables' Fake `Dump()` writes it.
    pub fn text(&self) -> String {
        let mut w = Writer::new(self.family);
        w.head.push_str(&self.head);
        // Two services may claim one element (e.g. the same external IP and port): the
        // first in key order has it, as in a partial sync nobody else may take it.
        let mut seen: BTreeSet<(Container, &str)> = BTreeSet::new();
        for objs in self.services.values() {
            for (name, &timeout) in &objs.affinity_sets {
                w.affinity_set(name, timeout, self.family);
            }
            w.chains(objs, &self.slots);
            for ((c, key), (verdict, comment)) in &objs.elements {
                if seen.insert((*c, key)) {
                    w.element(*c, key, verdict, comment.as_deref());
                }
            }
        }
        for &ip in self.hairpin_refs.keys() {
            w.element(Container::Hairpin, &hairpin_pair(ip), "", None);
        }
        w.take()
    }
}

/// The whole table of one family, as knftables' Fake `Dump()` writes it: the entry point
/// for tests that compare with kube-proxy's expected dumps or trace packets through it.
pub fn render_full(
    state: &ProxyState,
    node: &NodeInfo,
    family: Family,
    cfg: &RenderConfig,
) -> String {
    Rendered::new(state, node, family, cfg).text()
}

#[cfg(test)]
mod tests;
