//! The model as `iptables-restore` input: a pure function, so the whole ruleset can be
//! checked in unit tests without a kernel.
//!
//! The layout is kube-proxy's iptables mode (pkg/proxy/iptables/proxier.go), chain for
//! chain, so that anyone who has debugged kube-proxy can read it:
//!
//! ```text
//! nat    PREROUTING/OUTPUT -> KUBE-SERVICES --(cluster IP)--> KUBE-SVC-x | KUBE-SVL-x
//!                                         \--(external IP, LB IP)--> KUBE-EXT-x | KUBE-FW-x
//!                                          \-(last: dst LOCAL)--> KUBE-NODEPORTS -> KUBE-EXT-x
//!        KUBE-EXT-x  -> mark for masquerade (Cluster policy) -> KUBE-SVC-x | KUBE-SVL-x
//!        KUBE-SVC-x  -> affinity (-m recent) then -m statistic 1/n, 1/(n-1), ... -> KUBE-SEP-y
//!        KUBE-SEP-y  -> hairpin masquerade, DNAT to the endpoint
//!        POSTROUTING -> KUBE-POSTROUTING: MASQUERADE what KUBE-MARK-MASQ marked
//! filter OUTPUT/FORWARD -> KUBE-SERVICES: REJECT cluster IPs without endpoints, and
//!                          (last) anything else into the service ranges
//!        INPUT/FORWARD  -> KUBE-EXTERNAL-SERVICES: REJECT/DROP node ports and external IPs
//!                          without (local) endpoints
//!        FORWARD -> KUBE-FORWARD: accept marked and established traffic
//!        *       -> KUBE-PROXY-FIREWALL: drop LB traffic KUBE-FW-x did not let through
//! ```
//!
//! Each family is rendered on its own (iptables-restore and ip6tables-restore), from the
//! services with a cluster IP of that family and the endpoints of that family, as
//! kube-proxy's per-family proxiers do.

mod rendered;
mod service;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::IpAddr,
};

pub use self::rendered::{Rendered, Replaced};
use self::service::{Target, render_port};
use crate::{
    dataplane::frontends::port_endpoints,
    model::{EndpointSet, NodeInfo, ProxyState, Service},
};

pub const KUBE_SERVICES: &str = "KUBE-SERVICES";
pub const KUBE_EXTERNAL_SERVICES: &str = "KUBE-EXTERNAL-SERVICES";
pub const KUBE_NODEPORTS: &str = "KUBE-NODEPORTS";
pub const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";
pub const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";
pub const KUBE_FORWARD: &str = "KUBE-FORWARD";
pub const KUBE_PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";

/// The fixed nat chains; per-service chains come and go with the services.
pub const NAT_CHAINS: [&str; 4] = [
    KUBE_SERVICES,
    KUBE_NODEPORTS,
    KUBE_POSTROUTING,
    KUBE_MARK_MASQ,
];
pub const FILTER_CHAINS: [&str; 5] = [
    KUBE_SERVICES,
    KUBE_EXTERNAL_SERVICES,
    KUBE_FORWARD,
    KUBE_NODEPORTS,
    KUBE_PROXY_FIREWALL,
];
/// Prefixes of the per-service nat chains.
pub const SERVICE_CHAIN_PREFIXES: [&str; 5] = [
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-EXT-",
    "KUBE-FW-",
    "KUBE-SEP-",
];

/// True for any chain this mode creates in `table` (for leftovers and stale-chain cleanup).
pub fn is_our_chain(table: Table, chain: &str) -> bool {
    match table {
        Table::Nat => {
            NAT_CHAINS.contains(&chain)
                || SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p))
        }
        Table::Filter => FILTER_CHAINS.contains(&chain),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Table {
    Filter,
    Nat,
}

impl Table {
    pub fn name(self) -> &'static str {
        match self {
            Table::Filter => "filter",
            Table::Nat => "nat",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(ip: &IpAddr) -> Family {
        if ip.is_ipv4() { Family::V4 } else { Family::V6 }
    }

    pub fn is_v4(self) -> bool {
        self == Family::V4
    }
}

/// The knobs kube-proxy exposes for this ruleset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderConfig {
    /// Masquerade all traffic to cluster IPs (kube-proxy's --masquerade-all).
    pub masquerade_all: bool,
    /// How pods' traffic is told apart (--detect-local-mode): traffic to a cluster IP from
    /// elsewhere is masqueraded, and pods' traffic to an external destination skips the
    /// Local policy.
    pub local_traffic: LocalTraffic,
    /// The fwmark bit that asks KUBE-POSTROUTING to masquerade (--iptables-masquerade-bit).
    pub masquerade_bit: u8,
    /// Node ports answer only on the node's addresses in these networks
    /// (--nodeport-addresses); empty: on every local address.
    pub nodeport_addresses: Vec<(IpAddr, u8)>,
    /// conntrack.tcpBeLiberal: conntrack marks no out-of-window TCP packet INVALID, so the
    /// rule dropping INVALID forwarded packets is left out, as kube-proxy does.
    pub conntrack_tcp_liberal: bool,
    /// Found on the node, not configured: the iptables binary knows MASQUERADE's
    /// `--random-fully` (see [`super::apply::has_random_fully`]).
    pub random_fully: bool,
    /// Found on the node, not configured: its addresses of the family being rendered, for
    /// `nodeport_addresses` and for letting the node through loadBalancerSourceRanges.
    pub node_ips: Vec<IpAddr>,
    /// From the model: the service ranges (`--service-cluster-ip-range`, ServiceCIDRs); new
    /// traffic into them that the nat table did not translate is rejected.
    pub service_ranges: Vec<(IpAddr, u8)>,
}

impl Default for RenderConfig {
    fn default() -> Self {
        RenderConfig {
            masquerade_all: false,
            local_traffic: LocalTraffic::Cidrs(Vec::new()),
            masquerade_bit: 14,
            nodeport_addresses: Vec::new(),
            conntrack_tcp_liberal: false,
            random_fully: false,
            node_ips: Vec::new(),
            service_ranges: Vec::new(),
        }
    }
}

/// kube-proxy's LocalTrafficDetector (pkg/proxy/util/localdetector.go): what marks a
/// packet as from a pod on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LocalTraffic {
    /// Sources in these networks, at most one per family (ClusterCIDR: --cluster-cidr;
    /// NodeCIDR: the Node's spec.podCIDRs). None of a family: that family tells nothing
    /// apart, kube-proxy's no-op detector.
    Cidrs(Vec<(IpAddr, u8)>),
    /// Packets in on this device (BridgeInterface), or on any whose name starts with the
    /// part before a `+` (InterfaceNamePrefix: `veth+`), in both families.
    Interface(String),
}

impl LocalTraffic {
    /// The matches (if local, if not local) for `family`; None: not told apart there.
    pub fn matches(&self, family: Family) -> Option<(String, String)> {
        match self {
            LocalTraffic::Cidrs(cidrs) => cidrs
                .iter()
                .find(|(ip, _)| Family::of(ip) == family)
                .map(|&(ip, len)| {
                    let net = cidr(ip, len);
                    (format!("-s {net}"), format!("! -s {net}"))
                }),
            LocalTraffic::Interface(dev) if dev.is_empty() || dev == "+" => None,
            LocalTraffic::Interface(dev) => Some((format!("-i {dev}"), format!("! -i {dev}"))),
        }
    }
}

/// Whether `ip` is in the network `net`/`len` (same family only).
pub fn cidr_contains((net, len): (IpAddr, u8), ip: IpAddr) -> bool {
    match (net, ip) {
        (IpAddr::V4(n), IpAddr::V4(a)) => {
            let mask = u32::MAX
                .checked_shl(32 - u32::from(len.min(32)))
                .unwrap_or(0);
            u32::from(n) & mask == u32::from(a) & mask
        }
        (IpAddr::V6(n), IpAddr::V6(a)) => {
            let mask = u128::MAX
                .checked_shl(128 - u32::from(len.min(128)))
                .unwrap_or(0);
            u128::from(n) & mask == u128::from(a) & mask
        }
        _ => false,
    }
}

/// The `--nodeport-addresses` networks of `family`; None: node ports answer on every
/// address of that family. kube-proxy's NewNodePortAddresses (pkg/proxy/util) keeps a
/// family's CIDRs only and, when none is left, matches all of the family (`0.0.0.0/0` or
/// `::/0`): CIDRs of one family never turn off the other family's node ports.
pub fn nodeport_cidrs_of(
    cidrs: &[(IpAddr, u8)],
    family: Family,
) -> Option<impl Iterator<Item = (IpAddr, u8)> + '_> {
    let mut mine = cidrs
        .iter()
        .copied()
        .filter(move |(net, _)| Family::of(net) == family)
        .peekable();
    mine.peek().is_some().then_some(mine)
}

/// Whether node ports answer on `ip` under `--nodeport-addresses` `cidrs`, per family as
/// [`nodeport_cidrs_of`] decides.
pub fn nodeport_address_allowed(cidrs: &[(IpAddr, u8)], ip: IpAddr) -> bool {
    match nodeport_cidrs_of(cidrs, Family::of(&ip)) {
        None => true,
        Some(mut nets) => nets.any(|net| cidr_contains(net, ip)),
    }
}

/// One family's ruleset: the chains each table must hold and their rules, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ruleset {
    pub filter_chains: Vec<String>,
    pub filter_rules: Vec<String>,
    pub nat_chains: Vec<String>,
    pub nat_rules: Vec<String>,
}

impl Ruleset {
    pub fn chains(&self, table: Table) -> &[String] {
        match table {
            Table::Filter => &self.filter_chains,
            Table::Nat => &self.nat_chains,
        }
    }

    /// `iptables-restore --noflush` input: every chain listed is flushed and refilled;
    /// `stale` chains (ours, no longer wanted) are flushed and deleted. Nothing else in the
    /// tables is touched.
    pub fn restore_text(&self, stale: &BTreeSet<(Table, String)>) -> String {
        self.text(stale, |_, _| true, &FullRestore::default())
    }

    /// As [`restore_text`](Self::restore_text), with the extras of a full restore.
    pub fn restore_text_with(
        &self,
        stale: &BTreeSet<(Table, String)>,
        extra: &FullRestore,
    ) -> String {
        self.text(stale, |_, _| true, extra)
    }

    /// As [`restore_text`](Self::restore_text), but only for the chains whose rules differ
    /// from `previous` (what the tables hold now): kube-proxy's partial sync. One endpoint
    /// change then rewrites a couple of chains instead of every service's, which keeps
    /// iptables-nft's cost per change small at any cluster size. None when nothing differs.
    /// (The proxier itself keeps a [`Rendered`], which re-renders only changed services.)
    pub fn partial_restore_text(
        &self,
        previous: &Ruleset,
        stale: &BTreeSet<(Table, String)>,
    ) -> Option<String> {
        let (now, before) = (self.by_chain(), previous.by_chain());
        let changed: BTreeSet<&(Table, String)> = now
            .iter()
            .filter(|(k, rules)| before.get(*k) != Some(*rules))
            .map(|(k, _)| k)
            .collect();
        let any = !stale.is_empty() || !changed.is_empty();
        any.then(|| {
            self.text(
                stale,
                |t, c| changed.contains(&(t, c.to_string())),
                &FullRestore::default(),
            )
        })
    }

    /// Each chain's rules, keyed by (table, chain); chains without rules included.
    fn by_chain(&self) -> BTreeMap<(Table, String), Vec<&str>> {
        let mut out = BTreeMap::new();
        for (table, chains, rules) in [
            (Table::Filter, &self.filter_chains, &self.filter_rules),
            (Table::Nat, &self.nat_chains, &self.nat_rules),
        ] {
            for c in chains {
                out.insert((table, c.clone()), Vec::new());
            }
            for r in rules {
                if let Some(chain) = rule_chain(r) {
                    out.entry((table, chain.to_string()))
                        .or_insert_with(Vec::new)
                        .push(r.as_str());
                }
            }
        }
        out
    }

    fn text(
        &self,
        stale: &BTreeSet<(Table, String)>,
        include: impl Fn(Table, &str) -> bool,
        extra: &FullRestore,
    ) -> String {
        let mut out = String::new();
        for (table, chains, rules) in [
            (Table::Filter, &self.filter_chains, &self.filter_rules),
            (Table::Nat, &self.nat_chains, &self.nat_rules),
        ] {
            let gone: Vec<&String> = stale
                .iter()
                .filter(|(t, _)| *t == table)
                .map(|(_, c)| c)
                .collect();
            let _ = writeln!(out, "*{}", table.name());
            if extra.list_first && table == Table::Nat {
                out.push_str(LIST_FIRST);
            }
            for c in chains
                .iter()
                .filter(|c| include(table, c))
                .chain(gone.iter().copied())
            {
                let _ = writeln!(out, ":{c} - [0:0]");
            }
            for r in rules
                .iter()
                .filter(|r| rule_chain(r).is_some_and(|c| include(table, c)))
            {
                out.push_str(r);
                out.push('\n');
            }
            // The jumps into our chains, in the same transaction as the chains themselves.
            for (_, line) in extra.jumps.iter().filter(|(t, _)| *t == table) {
                out.push_str(line);
                out.push('\n');
            }
            if !extra.keep_stale {
                for c in gone {
                    let _ = writeln!(out, "-X {c}");
                }
            }
            out.push_str("COMMIT\n");
        }
        out
    }
}

/// What a full restore may add to the ruleset's text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FullRestore {
    /// Start the nat table's input with [`LIST_FIRST`] (iptables-nft and many chains).
    pub list_first: bool,
    /// Rules for the built-in chains (`-I INPUT 1 ...`), per table.
    pub jumps: Vec<(Table, String)>,
    /// Flush the stale chains but do not delete them (something else still jumps to them).
    pub keep_stale: bool,
}

/// The chain a rendered rule (`-A CHAIN ...`) appends to.
pub(crate) fn rule_chain(rule: &str) -> Option<&str> {
    rule.strip_prefix("-A ")?.split(' ').next()
}

/// kube-proxy's probability for rule `i` of `n` (`1/(n-i)`), with its ten decimals.
pub fn probability(remaining: usize) -> String {
    format!("{:.10}", 1.0 / remaining as f64)
}

fn cidr(ip: IpAddr, len: u8) -> String {
    format!("{ip}/{len}")
}

/// A rule being built: `-A CHAIN` and its arguments.
struct Rule(String);

impl Rule {
    fn new(chain: &str) -> Self {
        Rule(format!("-A {chain}"))
    }
    fn arg(mut self, a: impl AsRef<str>) -> Self {
        self.0.push(' ');
        self.0.push_str(a.as_ref());
        self
    }
    /// kube-proxy's appendServiceCommentLocked: the comment, unless in large-cluster mode.
    fn endpoint_comment(self, large_cluster: bool, c: &str) -> Self {
        if large_cluster { self } else { self.comment(c) }
    }
    fn comment(self, c: &str) -> Self {
        // Names in comments are Kubernetes names and IPs: no quotes or backslashes to escape.
        let c = c.replace(['"', '\\'], "");
        self.arg("-m comment --comment").arg(format!("\"{c}\""))
    }
    fn proto_port(self, proto: &str, dst: Option<IpAddr>, dport: u16) -> Self {
        let r = self.arg(format!("-m {proto} -p {proto}"));
        let r = match dst {
            Some(ip) => r.arg(format!("-d {ip}")),
            None => r,
        };
        r.arg(format!("--dport {dport}"))
    }
    fn jump(self, target: &str) -> String {
        self.arg(format!("-j {target}")).0
    }
}

/// Renders `state` for one family. Deterministic: the same state always gives the same
/// text, so a sync can compare it with the last one and skip an unchanged restore.
pub fn render(state: &ProxyState, node: &NodeInfo, family: Family, cfg: &RenderConfig) -> Ruleset {
    Rendered::new(state, node, family, cfg).ruleset()
}

/// The fixed chains and the fixed rules, as kube-proxy writes them.
fn head(cfg: &RenderConfig) -> Ruleset {
    let mut rs = Ruleset::default();
    let mark = 1u32 << cfg.masquerade_bit.min(31);
    let mark_match = format!("-m mark --mark {mark:#x}/{mark:#x}");

    rs.filter_chains
        .extend(FILTER_CHAINS.iter().map(|c| c.to_string()));
    rs.nat_chains
        .extend(NAT_CHAINS.iter().map(|c| c.to_string()));

    // Packets conntrack calls INVALID (out of the TCP window) would otherwise reach the
    // pod un-NATed and be answered with a reset (kubernetes#74840); with be_liberal set
    // conntrack marks none of them, and kube-proxy leaves the rule out (#117924).
    if !cfg.conntrack_tcp_liberal {
        rs.filter_rules.push(
            Rule::new(KUBE_FORWARD)
                .arg("-m conntrack --ctstate INVALID")
                .jump("DROP"),
        );
    }
    rs.filter_rules.push(
        Rule::new(KUBE_FORWARD)
            .comment("kubernetes forwarding rules")
            .arg(&mark_match)
            .jump("ACCEPT"),
    );
    rs.filter_rules.push(
        Rule::new(KUBE_FORWARD)
            .comment("kubernetes forwarding conntrack rule")
            .arg("-m conntrack --ctstate RELATED,ESTABLISHED")
            .jump("ACCEPT"),
    );
    rs.nat_rules.push(
        Rule::new(KUBE_POSTROUTING)
            .arg(format!("-m mark ! --mark {mark:#x}/{mark:#x}"))
            .jump("RETURN"),
    );
    // Clear the mark, so a packet re-entering the stack (e.g. through a tunnel) is not
    // masqueraded again.
    rs.nat_rules.push(
        Rule::new(KUBE_POSTROUTING)
            .arg(format!("-j MARK --xor-mark {mark:#x}"))
            .0,
    );
    rs.nat_rules.push(
        Rule::new(KUBE_POSTROUTING)
            .comment("kubernetes service traffic requiring SNAT")
            .jump(if cfg.random_fully {
                "MASQUERADE --random-fully"
            } else {
                "MASQUERADE"
            }),
    );
    rs.nat_rules.push(
        Rule::new(KUBE_MARK_MASQ)
            .arg(format!("-j MARK --or-mark {mark:#x}"))
            .0,
    );
    rs
}

/// The last rules of nat KUBE-SERVICES. They must stay last: node ports match any local
/// address, so every more specific service address must have been tried first. Without
/// --nodeport-addresses any local address leads to the node ports; with it, one rule per
/// node address in those networks, as kube-proxy writes them.
fn tail(family: Family, cfg: &RenderConfig) -> Vec<String> {
    let rule = || {
        Rule::new(KUBE_SERVICES)
            .comment("kubernetes service nodeports; NOTE: this must be the last rule in this chain")
    };
    let Some(nets) = nodeport_cidrs_of(&cfg.nodeport_addresses, family) else {
        let local_dst = match family {
            Family::V4 => "-m addrtype --dst-type LOCAL",
            // No route_localnet for IPv6: DNAT from ::1 cannot leave the node.
            Family::V6 => "-m addrtype --dst-type LOCAL ! -d ::1/128",
        };
        return vec![rule().arg(local_dst).jump(KUBE_NODEPORTS)];
    };
    let nets: Vec<(IpAddr, u8)> = nets.collect();
    let mut ips: Vec<IpAddr> = cfg
        .node_ips
        .iter()
        .copied()
        .filter(|ip| Family::of(ip) == family && !(ip.is_ipv6() && ip.is_loopback()))
        .filter(|ip| nets.iter().any(|&net| cidr_contains(net, *ip)))
        .collect();
    ips.sort();
    ips.dedup();
    ips.into_iter()
        .map(|ip| rule().arg(format!("-d {ip}")).jump(KUBE_NODEPORTS))
        .collect()
}

/// The last rules of filter KUBE-SERVICES: new traffic (from the node, or forwarded)
/// still addressed into a service range here was not translated by the nat table: no
/// Service holds the address, or not on that port. Rejected, so the client learns at once
/// instead of the packet leaving by the default route. After the services' own filter
/// rules, so a Local policy's DROP stays a drop. kube-proxy's nftables mode rejects the
/// second case and drops the first (see docs/modes.md).
///
/// TCP is answered with a reset: a connecting socket takes an ICMPv6 error only at its
/// first SYN retransmit (1 s later, measured), a reset at once, in both families.
fn filter_tail(family: Family, cfg: &RenderConfig) -> Vec<String> {
    let rule = |net, len| {
        Rule::new(KUBE_SERVICES)
            .comment("no service at this address and port in the service range")
            .arg(format!("-d {}", cidr(net, len)))
    };
    (cfg.service_ranges.iter())
        .filter(|(net, _)| Family::of(net) == family)
        .flat_map(|&(net, len)| {
            [
                rule(net, len)
                    .arg("-p tcp")
                    .jump("REJECT --reject-with tcp-reset"),
                rule(net, len).jump("REJECT"),
            ]
        })
        .collect()
}

/// One service's share of a family's ruleset: its own nat chains (SVC, SVL, EXT, FW, SEP)
/// and the rules it appends to them and to the fixed chains, in render order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceRules {
    /// Its own chains (`filter_chains` stays empty) and its rules.
    pub rules: Ruleset,
    /// Its rules in nat KUBE-NODEPORTS, which come after every service's other rules.
    pub nodeports: Vec<String>,
}

impl ServiceRules {
    /// Its rules by (table, chain), own chains without rules included.
    fn by_chain(&self) -> BTreeMap<(Table, &str), Vec<&str>> {
        let mut out: BTreeMap<(Table, &str), Vec<&str>> = BTreeMap::new();
        for c in &self.rules.nat_chains {
            out.insert((Table::Nat, c.as_str()), Vec::new());
        }
        let rules = [
            (Table::Filter, &self.rules.filter_rules),
            (Table::Nat, &self.rules.nat_rules),
            (Table::Nat, &self.nodeports),
        ];
        for (table, rules) in rules {
            for r in rules {
                if let Some(chain) = rule_chain(r) {
                    out.entry((table, chain)).or_default().push(r.as_str());
                }
            }
        }
        out
    }
}

/// kube-proxy's largeClusterEndpointsThreshold: above this many endpoints (of a family,
/// over every service port), the endpoint rules are written without their comments, which
/// makes the ruleset some 40% smaller.
pub const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

/// How many endpoints of `family` the ports of `svc` have, counted as kube-proxy counts its
/// endpointsMap for large-cluster mode (each port's endpoints, over all of its slices).
pub fn endpoint_count(svc: &Service, eps: Option<&EndpointSet>, family: Family) -> usize {
    let Some(eps) = eps else { return 0 };
    if !svc.cluster_ips.iter().any(|ip| Family::of(ip) == family) {
        return 0;
    }
    svc.ports
        .iter()
        .map(|port| {
            eps.slices
                .values()
                .filter(|s| {
                    s.ports
                        .iter()
                        .any(|p| p.name == port.name && p.protocol == port.protocol)
                })
                .flat_map(|s| &s.endpoints)
                .filter(|e| Family::of(&e.ip) == family)
                .count()
        })
        .sum()
}

/// Renders one service for one family; None when it has no cluster IP of the family.
/// `large_cluster`: kube-proxy's large-cluster mode, no comments on endpoint rules.
pub fn render_service(
    svc: &Service,
    eps: Option<&EndpointSet>,
    node: &NodeInfo,
    family: Family,
    cfg: &RenderConfig,
    large_cluster: bool,
) -> Option<ServiceRules> {
    let &cluster_ip = svc.cluster_ips.iter().find(|ip| Family::of(ip) == family)?;
    let target = Target {
        cluster_ip,
        family,
        local: cfg.local_traffic.matches(family),
        large_cluster,
        masquerade_all: cfg.masquerade_all,
        node_ips: &cfg.node_ips,
    };
    let mut out = ServiceRules::default();
    for pe in port_endpoints(svc, eps, node, Some(family.is_v4())) {
        render_port(&mut out.rules, &mut out.nodeports, svc, &pe, &target);
    }
    Some(out)
}

/// A first line for a big restore into the nat table on the nf_tables backend.
/// iptables-nft-restore (1.8.x) notes the chain of every command in a sorted linked list,
/// so that it fetches only those chains from the kernel: quadratic in the number of chains,
/// a full restore of 10,000 services took more than five minutes here. A command without a
/// chain makes it fetch every chain instead and skip that list; listing the table (`-S`)
/// is one that changes nothing. Its output, the table before the restore, is discarded.
///
/// On a node where nothing has made the nat table yet, the listing shows the base chains
/// and iptables-nft then takes them for existing: every jump into them fails ("RULE_INSERT
/// failed (No such file or directory): rule in chain OUTPUT"), on every restore. So the
/// base chains we jump from are declared after it, which creates them when missing. In a
/// `--noflush` restore that keeps their rules and sets only the policy, and a nat chain's
/// policy is ACCEPT (kube-proxy never writes another).
pub const LIST_FIRST: &str =
    "-S\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n";

/// Whether a restore declaring `chains` chains into a nat table that holds about `rules`
/// rules should start with [`LIST_FIRST`]: on iptables-nft, when its per-chain bookkeeping
/// (about chains² steps of ~50 ns here) would cost more than listing the table (a few µs
/// a rule).
pub fn list_first(nft: bool, chains: usize, rules: usize) -> bool {
    nft && chains.saturating_mul(chains) > rules.saturating_mul(64).max(1_000_000)
}

#[cfg(test)]
mod tests;
