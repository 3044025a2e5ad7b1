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
//! filter OUTPUT/FORWARD -> KUBE-SERVICES: REJECT cluster IPs without endpoints
//!        INPUT/FORWARD  -> KUBE-EXTERNAL-SERVICES: REJECT/DROP node ports and external IPs
//!                          without (local) endpoints
//!        FORWARD -> KUBE-FORWARD: accept marked and established traffic
//!        *       -> KUBE-PROXY-FIREWALL: drop LB traffic KUBE-FW-x did not let through
//! ```
//!
//! Each family is rendered on its own (iptables-restore and ip6tables-restore), from the
//! services with a cluster IP of that family and the endpoints of that family, as
//! kube-proxy's per-family proxiers do.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use super::names::{self, PortChains};
use crate::{
    dataplane::frontends::{PortEndpoints, port_endpoints},
    model::{EndpointSet, NodeInfo, ProxyState, Service, ServiceKey, endpoint::PortEndpoint},
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
    /// The pods' CIDRs (--cluster-cidr): traffic to a cluster IP from outside them is
    /// masqueraded, and pod traffic to an external destination skips the Local policy.
    pub cluster_cidrs: Vec<(IpAddr, u8)>,
    /// The fwmark bit that asks KUBE-POSTROUTING to masquerade (--iptables-masquerade-bit).
    pub masquerade_bit: u8,
}

impl Default for RenderConfig {
    fn default() -> Self {
        RenderConfig {
            masquerade_all: false,
            cluster_cidrs: Vec::new(),
            masquerade_bit: 14,
        }
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
        self.text(stale, |_, _| true, false)
    }

    /// As [`restore_text`](Self::restore_text); with `list_first`, the nat table's input
    /// starts with [`LIST_FIRST`] (iptables-nft and many chains).
    pub fn restore_text_listing(
        &self,
        stale: &BTreeSet<(Table, String)>,
        list_first: bool,
    ) -> String {
        self.text(stale, |_, _| true, list_first)
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
        any.then(|| self.text(stale, |t, c| changed.contains(&(t, c.to_string())), false))
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
        list_first: bool,
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
            if list_first && table == Table::Nat {
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
            for c in gone {
                let _ = writeln!(out, "-X {c}");
            }
            out.push_str("COMMIT\n");
        }
        out
    }
}

/// The chain a rendered rule (`-A CHAIN ...`) appends to.
fn rule_chain(rule: &str) -> Option<&str> {
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

    rs.filter_rules.push(
        Rule::new(KUBE_FORWARD)
            .arg("-m conntrack --ctstate INVALID")
            .jump("DROP"),
    );
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
            .jump("MASQUERADE --random-fully"),
    );
    rs.nat_rules.push(
        Rule::new(KUBE_MARK_MASQ)
            .arg(format!("-j MARK --or-mark {mark:#x}"))
            .0,
    );
    rs
}

/// The last rule of nat KUBE-SERVICES. It must stay last: node ports match any local
/// address, so every more specific service address must have been tried first.
fn tail(family: Family) -> String {
    let local_dst = match family {
        Family::V4 => "-m addrtype --dst-type LOCAL",
        // No route_localnet for IPv6: DNAT from ::1 cannot leave the node.
        Family::V6 => "-m addrtype --dst-type LOCAL ! -d ::1/128",
    };
    Rule::new(KUBE_SERVICES)
        .comment("kubernetes service nodeports; NOTE: this must be the last rule in this chain")
        .arg(local_dst)
        .jump(KUBE_NODEPORTS)
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

/// Renders one service for one family; None when it has no cluster IP of the family.
pub fn render_service(
    svc: &Service,
    eps: Option<&EndpointSet>,
    node: &NodeInfo,
    family: Family,
    cfg: &RenderConfig,
) -> Option<ServiceRules> {
    let &cluster_ip = svc.cluster_ips.iter().find(|ip| Family::of(ip) == family)?;
    let local_cidr = cfg
        .cluster_cidrs
        .iter()
        .find(|(ip, _)| Family::of(ip) == family)
        .copied();
    let target = Target {
        cluster_ip,
        family,
        local_cidr,
        masquerade_all: cfg.masquerade_all,
    };
    let mut out = ServiceRules::default();
    for pe in port_endpoints(svc, eps, node, Some(family.is_v4())) {
        render_port(&mut out.rules, &mut out.nodeports, svc, &pe, &target);
    }
    Some(out)
}

/// A family's ruleset kept in parts, so that a change re-renders and restores only the
/// services it touched (kube-proxy's partial sync): the fixed chains and rules, each
/// service's share in key order, then the services' node-port rules, then the last rule of
/// KUBE-SERVICES. [`ruleset`](Self::ruleset) joins them into what [`render`] returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    head: Ruleset,
    tail: String,
    services: BTreeMap<ServiceKey, Arc<ServiceRules>>,
}

/// What [`Rendered::rerender`] replaced: each service whose rules changed, with its rules
/// before (None: it had none).
pub type Replaced = Vec<(ServiceKey, Option<Arc<ServiceRules>>)>;

impl Rendered {
    pub fn new(state: &ProxyState, node: &NodeInfo, family: Family, cfg: &RenderConfig) -> Self {
        let services = state
            .services
            .iter()
            .filter_map(|(key, svc)| {
                let eps = state.endpoints.get(key).map(|e| &**e);
                Some((
                    key.clone(),
                    Arc::new(render_service(svc, eps, node, family, cfg)?),
                ))
            })
            .collect();
        Rendered {
            head: head(cfg),
            tail: tail(family),
            services,
        }
    }

    /// Renders the services `keys` again from `state` (a key it lacks: the service is
    /// gone) and returns those whose rules changed, with their rules before, for
    /// [`partial_restore_text`](Self::partial_restore_text) and [`undo`](Self::undo).
    pub fn rerender<'a>(
        &mut self,
        state: &ProxyState,
        keys: impl IntoIterator<Item = &'a ServiceKey>,
        node: &NodeInfo,
        family: Family,
        cfg: &RenderConfig,
    ) -> Replaced {
        let mut replaced = Vec::new();
        for key in keys {
            let new = state.services.get(key).and_then(|svc| {
                let eps = state.endpoints.get(key).map(|e| &**e);
                render_service(svc, eps, node, family, cfg)
            });
            if self.services.get(key).map(|r| &**r) == new.as_ref() {
                continue;
            }
            let old = match new {
                Some(rules) => self.services.insert(key.clone(), Arc::new(rules)),
                None => self.services.remove(key),
            };
            replaced.push((key.clone(), old));
        }
        replaced
    }

    /// Puts back what [`rerender`](Self::rerender) replaced (the restore failed).
    pub fn undo(&mut self, replaced: Replaced) {
        for (key, old) in replaced.into_iter().rev() {
            match old {
                Some(rules) => self.services.insert(key, rules),
                None => self.services.remove(&key),
            };
        }
    }

    /// A service's own chains now (empty if it has none).
    pub fn own_chains(&self, key: &ServiceKey) -> impl Iterator<Item = &str> {
        self.services
            .get(key)
            .into_iter()
            .flat_map(|r| r.rules.nat_chains.iter().map(String::as_str))
    }

    /// Every rule of `table`, in order.
    fn rules(&self, table: Table) -> Box<dyn Iterator<Item = &String> + '_> {
        match table {
            Table::Filter => Box::new(
                self.head
                    .filter_rules
                    .iter()
                    .chain(self.services.values().flat_map(|s| &s.rules.filter_rules)),
            ),
            Table::Nat => Box::new(
                self.head
                    .nat_rules
                    .iter()
                    .chain(self.services.values().flat_map(|s| &s.rules.nat_rules))
                    .chain(self.services.values().flat_map(|s| &s.nodeports))
                    .chain(std::iter::once(&self.tail)),
            ),
        }
    }

    /// The services it holds rules for.
    pub fn keys(&self) -> impl Iterator<Item = &ServiceKey> {
        self.services.keys()
    }

    /// Every chain, fixed and per service.
    pub fn chains(&self) -> BTreeSet<(Table, String)> {
        let fixed = [Table::Filter, Table::Nat]
            .into_iter()
            .flat_map(|t| self.head.chains(t).iter().map(move |c| (t, c.clone())));
        let own = self
            .services
            .values()
            .flat_map(|s| s.rules.nat_chains.iter().map(|c| (Table::Nat, c.clone())));
        fixed.chain(own).collect()
    }

    /// How many rules the nat table holds.
    pub fn nat_rule_count(&self) -> usize {
        let services: usize = self
            .services
            .values()
            .map(|s| s.rules.nat_rules.len() + s.nodeports.len())
            .sum();
        self.head.nat_rules.len() + services + 1
    }

    /// The whole ruleset.
    pub fn ruleset(&self) -> Ruleset {
        let own = self
            .services
            .values()
            .flat_map(|s| s.rules.nat_chains.iter().cloned());
        Ruleset {
            filter_chains: self.head.filter_chains.clone(),
            filter_rules: self.rules(Table::Filter).cloned().collect(),
            nat_chains: self.head.nat_chains.iter().cloned().chain(own).collect(),
            nat_rules: self.rules(Table::Nat).cloned().collect(),
        }
    }

    /// Restore input for what `replaced` changed, now that [`rerender`](Self::rerender)
    /// put the new rules in: the changed services' own chains whose rules differ, each
    /// fixed chain (KUBE-SERVICES, KUBE-NODEPORTS, ...) in full if some service's rules in
    /// it differ, and the `stale` chains deleted. One endpoint change thus restores a few
    /// chains, whatever the number of services. None when nothing differs.
    pub fn partial_restore_text(
        &self,
        replaced: &Replaced,
        stale: &BTreeSet<(Table, String)>,
        list_first: bool,
    ) -> Option<String> {
        let mut fixed: BTreeSet<(Table, &str)> = BTreeSet::new();
        let mut own: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        let none = ServiceRules::default();
        for (key, old) in replaced {
            let new = self.services.get(key).map_or(&none, |r| &**r);
            let (now, before) = (new.by_chain(), old.as_deref().unwrap_or(&none).by_chain());
            for (&(table, chain), rules) in &before {
                if is_fixed_chain(table, chain) && now.get(&(table, chain)) != Some(rules) {
                    fixed.insert((table, chain));
                }
            }
            for ((table, chain), rules) in now {
                if before.get(&(table, chain)) == Some(&rules) {
                    continue;
                }
                if is_fixed_chain(table, chain) {
                    fixed.insert((table, chain));
                } else {
                    own.insert(chain, rules);
                }
            }
        }
        if fixed.is_empty() && own.is_empty() && stale.is_empty() {
            return None;
        }
        let mut out = String::new();
        for table in [Table::Filter, Table::Nat] {
            let gone: Vec<&String> = stale
                .iter()
                .filter(|(t, _)| *t == table)
                .map(|(_, c)| c)
                .collect();
            let fixed_here: BTreeSet<&str> = fixed
                .iter()
                .filter(|(t, _)| *t == table)
                .map(|(_, c)| *c)
                .collect();
            let own_here: Vec<(&str, &Vec<&str>)> = match table {
                Table::Nat => own.iter().map(|(c, r)| (*c, r)).collect(),
                Table::Filter => Vec::new(),
            };
            let _ = writeln!(out, "*{}", table.name());
            if list_first && table == Table::Nat {
                out.push_str(LIST_FIRST);
            }
            let declared = fixed_here
                .iter()
                .copied()
                .chain(own_here.iter().map(|(c, _)| *c));
            for c in declared.chain(gone.iter().map(|c| c.as_str())) {
                let _ = writeln!(out, ":{c} - [0:0]");
            }
            if !fixed_here.is_empty() {
                for r in self.rules(table) {
                    if rule_chain(r).is_some_and(|c| fixed_here.contains(c)) {
                        out.push_str(r);
                        out.push('\n');
                    }
                }
            }
            for r in own_here.iter().flat_map(|(_, rules)| rules.iter()) {
                out.push_str(r);
                out.push('\n');
            }
            for c in gone {
                let _ = writeln!(out, "-X {c}");
            }
            out.push_str("COMMIT\n");
        }
        Some(out)
    }
}

/// Whether `chain` is one of the fixed chains every service adds rules to.
fn is_fixed_chain(table: Table, chain: &str) -> bool {
    match table {
        Table::Filter => FILTER_CHAINS.contains(&chain),
        Table::Nat => NAT_CHAINS.contains(&chain),
    }
}

/// A first line for a big restore into the nat table on the nf_tables backend.
/// iptables-nft-restore (1.8.x) notes the chain of every command in a sorted linked list,
/// so that it fetches only those chains from the kernel: quadratic in the number of chains,
/// a full restore of 10,000 services took more than five minutes here. A command without a
/// chain makes it fetch every chain instead and skip that list; listing the table (`-S`)
/// is one that changes nothing. Its output, the table before the restore, is discarded.
pub const LIST_FIRST: &str = "-S\n";

/// Whether a restore declaring `chains` chains into a nat table that holds about `rules`
/// rules should start with [`LIST_FIRST`]: on iptables-nft, when its per-chain bookkeeping
/// (about chains² steps of ~50 ns here) would cost more than listing the table (a few µs
/// a rule).
pub fn list_first(nft: bool, chains: usize, rules: usize) -> bool {
    nft && chains.saturating_mul(chains) > rules.saturating_mul(64).max(1_000_000)
}

/// What one family's rendering of a service port needs besides the port.
struct Target {
    cluster_ip: IpAddr,
    family: Family,
    local_cidr: Option<(IpAddr, u8)>,
    masquerade_all: bool,
}

fn render_port(
    rs: &mut Ruleset,
    nodeport_rules: &mut Vec<String>,
    svc: &Service,
    pe: &PortEndpoints<'_>,
    t: &Target,
) {
    let (cluster_ip, family, local_cidr) = (t.cluster_ip, t.family, t.local_cidr);
    let port = pe.port;
    let c = &pe.categorized;
    let spn = names::service_port_name(svc, port);
    let proto = names::proto_lower(port.protocol);
    let chains = PortChains::new(&spn, port.protocol);
    let same_family = |ips: &[IpAddr]| -> Vec<IpAddr> {
        ips.iter()
            .copied()
            .filter(|ip| Family::of(ip) == family)
            .collect()
    };
    let external_ips = same_family(&svc.external_ips);
    let lb_ips = same_family(&svc.load_balancer_ips);
    let source_ranges: Vec<(IpAddr, u8)> = svc
        .load_balancer_source_ranges
        .iter()
        .copied()
        .filter(|(ip, _)| Family::of(ip) == family)
        .collect();

    let cluster_eps = &c.cluster;
    let local_eps = &c.local;
    // Usable endpoints anywhere (kube-proxy's CategorizeEndpoints' hasAnyEndpoints): decides
    // between REJECT (none at all) and DROP (none here, a Local policy).
    let has_endpoints = c.has_any_endpoints;
    let uses_cluster_endpoints = !svc.internal_policy_local || externally_accessible(svc);
    let uses_local_endpoints =
        svc.internal_policy_local || (svc.external_policy_local && externally_accessible(svc));

    let cluster_policy_chain = chains.svc.as_str();
    let local_policy_chain = chains.svl.as_str();
    let (internal_chain, has_internal) = if svc.internal_policy_local {
        (local_policy_chain, has_endpoints && !local_eps.is_empty())
    } else {
        (cluster_policy_chain, has_endpoints)
    };
    let (external_policy_chain, has_external) = if svc.external_policy_local {
        (local_policy_chain, has_endpoints && !local_eps.is_empty())
    } else {
        (cluster_policy_chain, has_endpoints)
    };
    let external_chain = chains.ext.as_str();
    let uses_cluster_chain = !cluster_eps.is_empty() && uses_cluster_endpoints;
    let uses_local_chain = !local_eps.is_empty() && uses_local_endpoints;
    let uses_external_chain = has_endpoints && externally_accessible(svc);
    let uses_fw_chain = !lb_ips.is_empty() && !source_ranges.is_empty();
    let lb_chain = if uses_fw_chain {
        chains.fw.as_str()
    } else {
        external_chain
    };

    // What the filter table does with traffic the nat table did not translate.
    let (internal_filter, external_filter) = if !has_endpoints {
        let why = format!("{spn} has no endpoints");
        (Some(("REJECT", why.clone())), Some(("REJECT", why)))
    } else {
        let why = format!("{spn} has no local endpoints");
        (
            (!has_internal).then(|| ("DROP", why.clone())),
            (!has_external).then_some(("DROP", why)),
        )
    };

    // The cluster IP.
    let cluster_comment = format!("{spn} cluster IP");
    if has_internal {
        rs.nat_rules.push(
            Rule::new(KUBE_SERVICES)
                .comment(&cluster_comment)
                .proto_port(proto, Some(cluster_ip), port.port)
                .jump(internal_chain),
        );
    } else if let Some((target, why)) = &internal_filter {
        rs.filter_rules.push(
            Rule::new(KUBE_SERVICES)
                .comment(why)
                .proto_port(proto, Some(cluster_ip), port.port)
                .jump(target),
        );
    }

    // External IPs.
    for &ip in &external_ips {
        if has_endpoints {
            rs.nat_rules.push(
                Rule::new(KUBE_SERVICES)
                    .comment(&format!("{spn} external IP"))
                    .proto_port(proto, Some(ip), port.port)
                    .jump(external_chain),
            );
        }
        if let Some((target, why)) = &external_filter {
            rs.filter_rules.push(
                Rule::new(KUBE_EXTERNAL_SERVICES)
                    .comment(why)
                    .proto_port(proto, Some(ip), port.port)
                    .jump(target),
            );
        }
    }

    // Load balancer IPs.
    for &ip in &lb_ips {
        if has_endpoints {
            rs.nat_rules.push(
                Rule::new(KUBE_SERVICES)
                    .comment(&format!("{spn} loadbalancer IP"))
                    .proto_port(proto, Some(ip), port.port)
                    .jump(lb_chain),
            );
        }
        if uses_fw_chain {
            rs.filter_rules.push(
                Rule::new(KUBE_PROXY_FIREWALL)
                    .comment(&format!("{spn} traffic not accepted by {}", chains.fw))
                    .proto_port(proto, Some(ip), port.port)
                    .jump("DROP"),
            );
        }
    }
    if let Some((target, why)) = &external_filter {
        for &ip in &lb_ips {
            rs.filter_rules.push(
                Rule::new(KUBE_EXTERNAL_SERVICES)
                    .comment(why)
                    .proto_port(proto, Some(ip), port.port)
                    .jump(target),
            );
        }
    }

    // Node ports. Like kube-proxy, not subject to loadBalancerSourceRanges.
    if let Some(node_port) = port.node_port {
        if has_endpoints {
            nodeport_rules.push(
                Rule::new(KUBE_NODEPORTS)
                    .comment(&spn)
                    .proto_port(proto, None, node_port)
                    .jump(external_chain),
            );
        }
        if let Some((target, why)) = &external_filter {
            rs.filter_rules.push(
                Rule::new(KUBE_EXTERNAL_SERVICES)
                    .comment(why)
                    .arg("-m addrtype --dst-type LOCAL")
                    .proto_port(proto, None, node_port)
                    .jump(target),
            );
        }
    }

    // The health check node port is served by the proxy; let it in whatever the endpoints.
    if let Some(hc) = svc.health_check_node_port {
        rs.filter_rules.push(
            Rule::new(KUBE_NODEPORTS)
                .comment(&format!("{spn} health check node port"))
                .proto_port("tcp", None, hc)
                .jump("ACCEPT"),
        );
    }

    // Masquerade cluster IP traffic that may leave the node with a source the endpoint
    // cannot answer.
    if has_internal {
        let base = || {
            Rule::new(internal_chain)
                .comment(&cluster_comment)
                .proto_port(proto, Some(cluster_ip), port.port)
        };
        if t.masquerade_all {
            rs.nat_rules.push(base().jump(KUBE_MARK_MASQ));
        } else if let Some((ip, len)) = local_cidr {
            rs.nat_rules.push(
                base()
                    .arg(format!("! -s {}", cidr(ip, len)))
                    .jump(KUBE_MARK_MASQ),
            );
        }
    }

    if uses_external_chain {
        rs.nat_chains.push(external_chain.to_string());
        if !svc.external_policy_local {
            // Endpoints may be on another node: masquerade so replies come back through us.
            rs.nat_rules.push(
                Rule::new(external_chain)
                    .comment(&format!(
                        "masquerade traffic for {spn} external destinations"
                    ))
                    .jump(KUBE_MARK_MASQ),
            );
        } else {
            // Local policy keeps the client's source address, with exceptions.
            if let Some((ip, len)) = local_cidr {
                // Pods reaching an external address behave as if they went out and back in
                // through a load balancer: neither policy applies.
                rs.nat_rules.push(
                    Rule::new(external_chain)
                        .comment(&format!("pod traffic for {spn} external destinations"))
                        .arg(format!("-s {}", cidr(ip, len)))
                        .jump(cluster_policy_chain),
                );
            }
            // The node itself: its source address is local, so masquerade, and use every
            // endpoint.
            rs.nat_rules.push(
                Rule::new(external_chain)
                    .comment(&format!(
                        "masquerade LOCAL traffic for {spn} external destinations"
                    ))
                    .arg("-m addrtype --src-type LOCAL")
                    .jump(KUBE_MARK_MASQ),
            );
            rs.nat_rules.push(
                Rule::new(external_chain)
                    .comment(&format!(
                        "route LOCAL traffic for {spn} external destinations"
                    ))
                    .arg("-m addrtype --src-type LOCAL")
                    .jump(cluster_policy_chain),
            );
        }
        if has_external {
            rs.nat_rules
                .push(Rule::new(external_chain).jump(external_policy_chain));
        }
    }

    if uses_fw_chain {
        let fw = chains.fw.as_str();
        rs.nat_chains.push(fw.to_string());
        let comment = format!("{spn} loadbalancer IP");
        for &(ip, len) in &source_ranges {
            rs.nat_rules.push(
                Rule::new(fw)
                    .comment(&comment)
                    .arg(format!("-s {}", cidr(ip, len)))
                    .jump(external_chain),
            );
        }
        // What is left was not DNATed, so KUBE-PROXY-FIREWALL (filter) drops it.
        rs.nat_rules.push(
            Rule::new(fw)
                .comment(&format!(
                    "other traffic to {spn} will be dropped by KUBE-PROXY-FIREWALL"
                ))
                .0,
        );
    }

    if uses_cluster_chain {
        rs.nat_chains.push(cluster_policy_chain.to_string());
        write_balancing(
            rs,
            svc,
            &spn,
            port.protocol,
            cluster_policy_chain,
            cluster_eps,
        );
    }
    if uses_local_chain {
        rs.nat_chains.push(local_policy_chain.to_string());
        write_balancing(rs, svc, &spn, port.protocol, local_policy_chain, local_eps);
    }

    // One chain per endpoint either policy may use.
    for ep in &c.all_reachable {
        let addr = SocketAddr::new(ep.ip, ep.port);
        let sep = names::endpoint_chain(&spn, port.protocol, addr);
        rs.nat_chains.push(sep.clone());
        // A pod reaching itself through the service: masquerade, or it would answer itself
        // directly and the client would drop the reply.
        rs.nat_rules.push(
            Rule::new(&sep)
                .comment(&spn)
                .arg(format!("-s {}", ep.ip))
                .jump(KUBE_MARK_MASQ),
        );
        let mut dnat = Rule::new(&sep).comment(&spn);
        if svc.affinity_timeout.is_some() {
            dnat = dnat.arg(format!("-m recent --name {sep} --set"));
        }
        rs.nat_rules.push(
            dnat.arg(format!("-m {proto} -p {proto}"))
                .jump(&format!("DNAT --to-destination {addr}")),
        );
    }
}

/// kube-proxy's `ExternallyAccessible`.
fn externally_accessible(svc: &Service) -> bool {
    svc.ports.iter().any(|p| p.node_port.is_some())
        || !svc.load_balancer_ips.is_empty()
        || !svc.external_ips.is_empty()
}

/// Affinity first (a client seen recently goes back to its endpoint), then the random
/// spread: rule i of n matches with probability 1/(n-i), so each endpoint gets 1/n overall
/// and the last rule always matches.
fn write_balancing(
    rs: &mut Ruleset,
    svc: &Service,
    spn: &str,
    proto: crate::model::Protocol,
    chain: &str,
    eps: &[PortEndpoint],
) {
    let seps: Vec<(SocketAddr, String)> = eps
        .iter()
        .map(|e| {
            let addr = SocketAddr::new(e.ip, e.port);
            (addr, names::endpoint_chain(spn, proto, addr))
        })
        .collect();
    if let Some(timeout) = svc.affinity_timeout {
        for (addr, sep) in &seps {
            rs.nat_rules.push(
                Rule::new(chain)
                    .comment(&format!("{spn} -> {addr}"))
                    .arg(format!(
                        "-m recent --name {sep} --rcheck --seconds {timeout} --reap"
                    ))
                    .jump(sep),
            );
        }
    }
    let n = seps.len();
    for (i, (addr, sep)) in seps.iter().enumerate() {
        let mut r = Rule::new(chain).comment(&format!("{spn} -> {addr}"));
        if i + 1 < n {
            r = r.arg(format!(
                "-m statistic --mode random --probability {}",
                probability(n - i)
            ));
        }
        rs.nat_rules.push(r.jump(sep));
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, sync::Arc};

    use super::*;
    use crate::model::{
        Endpoint, EndpointSet, Protocol, ServiceKey, ServicePort, SliceInfo, SlicePort,
    };

    fn ep(ip: &str, node: &str) -> Endpoint {
        Endpoint {
            ip: ip.parse().unwrap(),
            ready: true,
            serving: true,
            terminating: false,
            node_name: Some(node.into()),
            zone: None,
            zone_hints: vec![],
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

    fn eps(list: Vec<Endpoint>) -> EndpointSet {
        let ports = vec![SlicePort {
            name: "p80".into(),
            port: 80,
            protocol: Protocol::Tcp,
        }];
        EndpointSet {
            slices: BTreeMap::from([(
                "s".into(),
                SliceInfo {
                    ports,
                    endpoints: list,
                },
            )]),
        }
    }

    fn state(entries: Vec<(Service, Option<EndpointSet>)>) -> ProxyState {
        let mut st = ProxyState::default();
        for (s, e) in entries {
            if let Some(e) = e {
                st.endpoints.insert(s.key.clone(), Arc::new(e));
            }
            st.services.insert(s.key.clone(), Arc::new(s));
        }
        st
    }

    fn node() -> NodeInfo {
        NodeInfo {
            name: "node-a".into(),
            zone: None,
        }
    }

    fn v4(st: &ProxyState) -> Ruleset {
        render(st, &node(), Family::V4, &RenderConfig::default())
    }

    fn has(rules: &[String], want: &str) -> bool {
        rules.iter().any(|r| r == want)
    }

    #[test]
    fn a_cluster_ip_is_spread_over_its_endpoints_like_kube_proxy() {
        let s = svc("svc1", "172.30.0.41");
        let st = state(vec![(
            s,
            Some(eps(vec![
                ep("10.180.0.1", "node-a"),
                ep("10.180.0.2", "node-b"),
            ])),
        )]);
        let rs = v4(&st);
        let svc_chain = "KUBE-SVC-XPGD46QRK7WJZT7O";
        let sep1 = "KUBE-SEP-SXIVWICOYRO3J4NJ";
        assert!(rs.nat_chains.iter().any(|c| c == svc_chain));
        assert!(
            has(
                &rs.nat_rules,
                &format!(
                    "-A KUBE-SERVICES -m comment --comment \"ns1/svc1:p80 cluster IP\" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j {svc_chain}"
                )
            ),
            "{:#?}",
            rs.nat_rules
        );
        assert!(
            has(
                &rs.nat_rules,
                &format!(
                    "-A {svc_chain} -m comment --comment \"ns1/svc1:p80 -> 10.180.0.1:80\" -m statistic --mode random --probability 0.5000000000 -j {sep1}"
                )
            ),
            "{:#?}",
            rs.nat_rules
        );
        assert!(has(
            &rs.nat_rules,
            &format!(
                "-A {sep1} -m comment --comment \"ns1/svc1:p80\" -s 10.180.0.1 -j KUBE-MARK-MASQ"
            )
        ));
        assert!(has(
            &rs.nat_rules,
            &format!(
                "-A {sep1} -m comment --comment \"ns1/svc1:p80\" -m tcp -p tcp -j DNAT --to-destination 10.180.0.1:80"
            )
        ));
        // The last endpoint's rule always matches.
        let last = rs
            .nat_rules
            .iter()
            .rfind(|r| r.starts_with(&format!("-A {svc_chain} ")))
            .unwrap();
        assert!(!last.contains("statistic"), "{last}");
        // The node port catch-all is the very last rule of KUBE-SERVICES.
        let last_services = rs
            .nat_rules
            .iter()
            .rfind(|r| r.starts_with("-A KUBE-SERVICES "))
            .unwrap();
        assert!(
            last_services.ends_with("-m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"),
            "{last_services}"
        );
        assert!(rs.filter_rules.iter().all(|r| !r.contains("REJECT")));
    }

    #[test]
    fn probabilities_give_every_endpoint_an_equal_share() {
        assert_eq!(probability(4), "0.2500000000");
        assert_eq!(probability(3), "0.3333333333");
        assert_eq!(probability(2), "0.5000000000");
        // Endpoint i is chosen when rules 0..i miss and rule i hits: 1/n for every i.
        for n in 2..=7usize {
            let mut miss = 1.0;
            for i in 0..n {
                let p = if i + 1 < n { 1.0 / (n - i) as f64 } else { 1.0 };
                let share = miss * p;
                assert!(
                    (share - 1.0 / n as f64).abs() < 1e-9,
                    "n={n} i={i} share={share}"
                );
                miss *= 1.0 - p;
            }
        }
        let four: Vec<Endpoint> = (1..=4)
            .map(|i| ep(&format!("10.180.0.{i}"), "node-a"))
            .collect();
        let rs = v4(&state(vec![(svc("svc1", "172.30.0.41"), Some(eps(four)))]));
        let probs: Vec<&str> = rs
            .nat_rules
            .iter()
            .filter_map(|r| r.split("--probability ").nth(1))
            .map(|r| r.split(' ').next().unwrap())
            .collect();
        assert_eq!(probs, ["0.2500000000", "0.3333333333", "0.5000000000"]);
    }

    #[test]
    fn no_endpoints_is_a_reject_in_the_filter_table_and_nothing_in_nat() {
        let mut s = svc("svc1", "172.30.0.41");
        s.ports[0].node_port = Some(3001);
        s.external_ips = vec!["192.168.99.11".parse().unwrap()];
        let rs = v4(&state(vec![(s, None)]));
        assert!(has(
            &rs.filter_rules,
            "-A KUBE-SERVICES -m comment --comment \"ns1/svc1:p80 has no endpoints\" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j REJECT"
        ));
        assert!(has(
            &rs.filter_rules,
            "-A KUBE-EXTERNAL-SERVICES -m comment --comment \"ns1/svc1:p80 has no endpoints\" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 3001 -j REJECT"
        ));
        assert!(has(
            &rs.filter_rules,
            "-A KUBE-EXTERNAL-SERVICES -m comment --comment \"ns1/svc1:p80 has no endpoints\" -m tcp -p tcp -d 192.168.99.11 --dport 80 -j REJECT"
        ));
        assert!(
            rs.nat_chains
                .iter()
                .all(|c| !c.starts_with("KUBE-SVC-") && !c.starts_with("KUBE-EXT-"))
        );
    }

    #[test]
    fn client_ip_affinity_checks_recent_lists_before_the_random_spread() {
        let mut s = svc("svc1", "172.30.0.41");
        s.affinity_timeout = Some(10800);
        let rs = v4(&state(vec![(
            s,
            Some(eps(vec![
                ep("10.180.0.1", "node-a"),
                ep("10.180.0.2", "node-a"),
            ])),
        )]));
        let in_svc: Vec<&String> = rs
            .nat_rules
            .iter()
            .filter(|r| r.starts_with("-A KUBE-SVC-XPGD46QRK7WJZT7O "))
            .collect();
        assert_eq!(in_svc.len(), 4);
        assert!(in_svc[0].contains("-m recent --name KUBE-SEP-SXIVWICOYRO3J4NJ --rcheck --seconds 10800 --reap -j KUBE-SEP-SXIVWICOYRO3J4NJ"), "{}", in_svc[0]);
        assert!(in_svc[1].contains("--rcheck"));
        assert!(in_svc[2].contains("statistic"));
        assert!(has(
            &rs.nat_rules,
            "-A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment \"ns1/svc1:p80\" -m recent --name KUBE-SEP-SXIVWICOYRO3J4NJ --set -m tcp -p tcp -j DNAT --to-destination 10.180.0.1:80"
        ));
    }

    #[test]
    fn external_traffic_policy_local_uses_svl_and_ext_chains() {
        let mut s = svc("svc1", "172.30.0.41");
        s.ports[0].node_port = Some(3001);
        s.external_policy_local = true;
        let st = state(vec![(
            s,
            Some(eps(vec![
                ep("10.180.0.1", "node-a"),
                ep("10.180.0.2", "node-b"),
            ])),
        )]);
        let rs = v4(&st);
        let h = "XPGD46QRK7WJZT7O";
        let (svc_c, svl, ext) = (
            format!("KUBE-SVC-{h}"),
            format!("KUBE-SVL-{h}"),
            format!("KUBE-EXT-{h}"),
        );
        for c in [&svc_c, &svl, &ext] {
            assert!(
                rs.nat_chains.contains(c),
                "{c} missing from {:?}",
                rs.nat_chains
            );
        }
        assert!(has(
            &rs.nat_rules,
            &format!(
                "-A KUBE-NODEPORTS -m comment --comment \"ns1/svc1:p80\" -m tcp -p tcp --dport 3001 -j {ext}"
            )
        ));
        assert!(has(
            &rs.nat_rules,
            &format!(
                "-A {ext} -m comment --comment \"masquerade LOCAL traffic for ns1/svc1:p80 external destinations\" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ"
            )
        ));
        assert!(has(
            &rs.nat_rules,
            &format!(
                "-A {ext} -m comment --comment \"route LOCAL traffic for ns1/svc1:p80 external destinations\" -m addrtype --src-type LOCAL -j {svc_c}"
            )
        ));
        assert_eq!(
            rs.nat_rules
                .iter()
                .rfind(|r| r.starts_with(&format!("-A {ext} ")))
                .unwrap(),
            &format!("-A {ext} -j {svl}")
        );
        // The local chain only has this node's endpoint; the cluster chain has both.
        assert_eq!(
            rs.nat_rules
                .iter()
                .filter(|r| r.starts_with(&format!("-A {svl} ")))
                .count(),
            1
        );
        assert_eq!(
            rs.nat_rules
                .iter()
                .filter(|r| r.starts_with(&format!("-A {svc_c} ")))
                .count(),
            2
        );
        // No endpoint may be masqueraded for external traffic under Local policy.
        assert!(!has(
            &rs.nat_rules,
            &format!(
                "-A {ext} -m comment --comment \"masquerade traffic for ns1/svc1:p80 external destinations\" -j KUBE-MARK-MASQ"
            )
        ));

        // With no local endpoint, external traffic is dropped (not rejected: other nodes have
        // endpoints, a load balancer should try them).
        let st = state(vec![(
            st.services.values().next().unwrap().as_ref().clone(),
            Some(eps(vec![ep("10.180.0.2", "node-b")])),
        )]);
        let rs = v4(&st);
        assert!(rs.filter_rules.iter().any(|r| r.contains("has no local endpoints") && r.contains("--dport 3001 -j DROP")), "{:#?}", rs.filter_rules);
    }

    #[test]
    fn internal_traffic_policy_local_sends_the_cluster_ip_to_svl() {
        let mut s = svc("svc1", "172.30.0.41");
        s.internal_policy_local = true;
        let rs = v4(&state(vec![(
            s.clone(),
            Some(eps(vec![
                ep("10.180.0.1", "node-a"),
                ep("10.180.0.2", "node-b"),
            ])),
        )]));
        assert!(
            rs.nat_rules
                .iter()
                .any(|r| r.starts_with("-A KUBE-SERVICES ")
                    && r.ends_with("-j KUBE-SVL-XPGD46QRK7WJZT7O"))
        );
        assert!(!rs.nat_chains.iter().any(|c| c.starts_with("KUBE-SVC-")));
        // Only remote endpoints: DROP at the cluster IP.
        let rs = v4(&state(vec![(
            s,
            Some(eps(vec![ep("10.180.0.2", "node-b")])),
        )]));
        assert!(
            rs.filter_rules
                .iter()
                .any(|r| r.contains("has no local endpoints")
                    && r.contains("-d 172.30.0.41")
                    && r.ends_with("-j DROP"))
        );
    }

    #[test]
    fn masquerading_follows_the_cluster_cidr_or_masquerade_all() {
        let s = svc("svc1", "172.30.0.41");
        let st = state(vec![(s, Some(eps(vec![ep("10.180.0.1", "node-a")])))]);
        let cfg = RenderConfig {
            cluster_cidrs: vec![("10.0.0.0".parse().unwrap(), 8)],
            ..Default::default()
        };
        let rs = render(&st, &node(), Family::V4, &cfg);
        assert!(
            rs.nat_rules.iter().any(|r| r.starts_with("-A KUBE-SVC-")
                && r.ends_with("! -s 10.0.0.0/8 -j KUBE-MARK-MASQ"))
        );
        let all = render(
            &st,
            &node(),
            Family::V4,
            &RenderConfig {
                masquerade_all: true,
                ..Default::default()
            },
        );
        assert!(
            all.nat_rules
                .iter()
                .any(|r| r.starts_with("-A KUBE-SVC-")
                    && r.ends_with("--dport 80 -j KUBE-MARK-MASQ"))
        );
        assert!(has(
            &all.nat_rules,
            "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000"
        ));
        assert!(has(
            &all.nat_rules,
            "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully"
        ));
    }

    #[test]
    fn load_balancer_source_ranges_use_a_firewall_chain() {
        let mut s = svc("svc1", "172.30.0.41");
        s.load_balancer_ips = vec!["1.2.3.4".parse().unwrap()];
        s.load_balancer_source_ranges = vec![("203.0.113.0".parse().unwrap(), 25)];
        let rs = v4(&state(vec![(
            s,
            Some(eps(vec![ep("10.180.0.1", "node-a")])),
        )]));
        let fw = "KUBE-FW-XPGD46QRK7WJZT7O";
        assert!(
            rs.nat_rules
                .iter()
                .any(|r| r.contains("-d 1.2.3.4") && r.ends_with(&format!("-j {fw}")))
        );
        assert!(has(
            &rs.nat_rules,
            &format!(
                "-A {fw} -m comment --comment \"ns1/svc1:p80 loadbalancer IP\" -s 203.0.113.0/25 -j KUBE-EXT-XPGD46QRK7WJZT7O"
            )
        ));
        assert!(
            rs.filter_rules
                .iter()
                .any(|r| r.starts_with("-A KUBE-PROXY-FIREWALL ")
                    && r.contains("-d 1.2.3.4")
                    && r.ends_with("-j DROP"))
        );
    }

    #[test]
    fn each_family_gets_its_own_addresses_and_output_is_deterministic() {
        let mut s = svc("svc1", "172.30.0.41");
        s.cluster_ips.push("fd00::41".parse().unwrap());
        let st = state(vec![
            (
                s,
                Some(eps(vec![
                    ep("10.180.0.1", "node-a"),
                    ep("fd00::1", "node-a"),
                ])),
            ),
            (svc("v4only", "172.30.0.42"), None),
        ]);
        let v6 = render(&st, &node(), Family::V6, &RenderConfig::default());
        assert!(v6.nat_rules.iter().any(|r| r.contains("-d fd00::41")));
        assert!(
            v6.nat_rules
                .iter()
                .any(|r| r.ends_with("DNAT --to-destination [fd00::1]:80"))
        );
        assert!(
            v6.nat_rules
                .iter()
                .chain(&v6.filter_rules)
                .all(|r| !r.contains("172.30.") && !r.contains("10.180."))
        );
        assert!(
            v6.filter_rules.iter().all(|r| !r.contains("v4only")),
            "a v4-only service is not in ip6tables"
        );
        assert_eq!(v4(&st), v4(&st));
        let text = v4(&st).restore_text(&BTreeSet::new());
        assert!(text.starts_with("*filter\n:KUBE-SERVICES - [0:0]\n"));
        assert_eq!(text.matches("COMMIT\n").count(), 2);
    }

    #[test]
    fn a_partial_restore_rewrites_only_the_chains_that_changed() {
        let two = |second: &str| {
            state(vec![
                (
                    svc("a", "198.19.0.1"),
                    Some(eps(vec![ep("198.18.1.1", "node-a")])),
                ),
                (
                    svc("b", "198.19.0.2"),
                    Some(eps(vec![ep("198.18.1.1", "node-a"), ep(second, "node-a")])),
                ),
            ])
        };
        let before = v4(&two("198.18.1.2"));
        assert_eq!(
            before.partial_restore_text(&before, &BTreeSet::new()),
            None,
            "nothing differs"
        );

        // b's second endpoint moves: b's service chain and the two endpoint chains change.
        let after = v4(&two("198.18.1.3"));
        let text = after
            .partial_restore_text(&before, &BTreeSet::new())
            .expect("b changed");
        let declared: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix(':')).collect();
        let rules_of = |c: &str| {
            text.lines()
                .filter(|l| l.starts_with(&format!("-A {c} ")))
                .count()
        };
        let b_svc = after.nat_chains.iter().find(|c| {
            c.starts_with("KUBE-SVC-")
                && after
                    .nat_rules
                    .iter()
                    .any(|r| r.starts_with(&format!("-A {c} ")) && r.contains("198.18.1.3"))
        });
        let b_svc = b_svc.expect("b's service chain");
        assert!(
            declared.iter().any(|d| d.starts_with(b_svc.as_str())),
            "{text}"
        );
        assert_eq!(rules_of(b_svc), 2, "{text}");
        assert!(
            !declared.iter().any(|d| d.starts_with("KUBE-SERVICES")),
            "the service jumps did not change: {text}"
        );
        // One SVC chain and one new SEP chain; the old SEP chain is for the caller's `stale`.
        assert_eq!(
            declared
                .iter()
                .filter(|d| d.starts_with("KUBE-SVC-"))
                .count(),
            1,
            "{text}"
        );
        assert_eq!(
            declared
                .iter()
                .filter(|d| d.starts_with("KUBE-SEP-"))
                .count(),
            1,
            "{text}"
        );
    }

    #[test]
    fn stale_chains_are_flushed_and_deleted() {
        let rs = v4(&state(vec![]));
        let stale = BTreeSet::from([(Table::Nat, "KUBE-SVC-GONE".to_string())]);
        let text = rs.restore_text(&stale);
        let nat = &text[text.find("*nat").unwrap()..];
        assert!(nat.contains(":KUBE-SVC-GONE - [0:0]\n"));
        assert!(
            nat.trim_end().ends_with("-X KUBE-SVC-GONE\nCOMMIT"),
            "{nat}"
        );
        assert!(
            is_our_chain(Table::Nat, "KUBE-SEP-X")
                && !is_our_chain(Table::Nat, "KUBE-PORTALS-HOST")
        );
        assert!(
            !is_our_chain(Table::Filter, "KUBE-FIREWALL"),
            "kubelet's chain is not ours"
        );
    }

    #[test]
    fn rendering_again_only_the_changed_services_gives_what_a_full_render_gives() {
        let cfg = RenderConfig::default();
        let two = |second: &str| {
            state(vec![
                (
                    svc("a", "198.19.0.1"),
                    Some(eps(vec![ep("198.18.1.1", "node-a")])),
                ),
                (
                    svc("b", "198.19.0.2"),
                    Some(eps(vec![ep("198.18.1.1", "node-a"), ep(second, "node-a")])),
                ),
            ])
        };
        let before = two("198.18.1.2");
        let mut rendered = Rendered::new(&before, &node(), Family::V4, &cfg);
        assert_eq!(rendered.ruleset(), v4(&before));
        let b = ServiceKey::new("ns1", "b");
        let a = ServiceKey::new("ns1", "a");

        // Nothing changed: nothing replaced, nothing to restore.
        let replaced = rendered.rerender(&before, [&a, &b], &node(), Family::V4, &cfg);
        assert!(replaced.is_empty());
        assert_eq!(
            rendered.partial_restore_text(&replaced, &BTreeSet::new(), false),
            None
        );

        // b's second endpoint moves: b's service chain and its new endpoint chain only.
        let after = two("198.18.1.3");
        let replaced = rendered.rerender(&after, [&b], &node(), Family::V4, &cfg);
        assert_eq!(replaced.len(), 1);
        assert_eq!(rendered.ruleset(), v4(&after));
        let text = rendered
            .partial_restore_text(&replaced, &BTreeSet::new(), false)
            .unwrap();
        let declared: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix(':')).collect();
        assert_eq!(declared.len(), 2, "{text}");
        assert_eq!(
            declared
                .iter()
                .filter(|d| d.starts_with("KUBE-SVC-"))
                .count(),
            1,
            "{text}"
        );
        assert_eq!(
            declared
                .iter()
                .filter(|d| d.starts_with("KUBE-SEP-"))
                .count(),
            1,
            "{text}"
        );
        assert!(text.contains("198.18.1.3:80"), "{text}");
        assert!(!text.contains("198.19.0.1"), "a is untouched: {text}");

        // Undone (the restore failed): as before.
        rendered.undo(replaced);
        assert_eq!(rendered.ruleset(), v4(&before));

        // a goes: KUBE-SERVICES is written whole (without a's jump, with b's), and the old
        // chains the caller names stale are deleted after it.
        let without_a = state(vec![(
            svc("b", "198.19.0.2"),
            Some(eps(vec![
                ep("198.18.1.1", "node-a"),
                ep("198.18.1.2", "node-a"),
            ])),
        )]);
        let replaced = rendered.rerender(&without_a, [&a], &node(), Family::V4, &cfg);
        let old_a: Vec<String> = replaced[0].1.as_ref().unwrap().rules.nat_chains.clone();
        assert_eq!(old_a.len(), 2, "a's SVC and SEP chains");
        let stale: BTreeSet<(Table, String)> =
            old_a.iter().map(|c| (Table::Nat, c.clone())).collect();
        let text = rendered
            .partial_restore_text(&replaced, &stale, true)
            .unwrap();
        let nat = &text[text.find("*nat").unwrap()..];
        assert!(nat.starts_with(&format!("*nat\n{LIST_FIRST}")), "{nat}");
        assert!(nat.contains(":KUBE-SERVICES - [0:0]\n"), "{nat}");
        let services: Vec<&str> = nat
            .lines()
            .filter(|l| l.starts_with("-A KUBE-SERVICES "))
            .collect();
        assert_eq!(services.len(), 2, "b's jump and the node-port rule: {nat}");
        assert!(
            services[0].contains("198.19.0.2") && services[1].contains("KUBE-NODEPORTS"),
            "{nat}"
        );
        for c in &old_a {
            assert!(nat.contains(&format!("-X {c}\n")), "{nat}");
        }
        assert_eq!(rendered.ruleset(), v4(&without_a));
        assert!(
            !text[..text.find("*nat").unwrap()].contains(LIST_FIRST),
            "the filter table is not listed"
        );
    }
}
