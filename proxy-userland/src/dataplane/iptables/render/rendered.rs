//! One family's ruleset kept in parts, for kube-proxy's partial syncs.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    sync::Arc,
};

use super::{
    FILTER_CHAINS, Family, LARGE_CLUSTER_ENDPOINTS, LIST_FIRST, NAT_CHAINS, RenderConfig, Ruleset,
    ServiceRules, Table, endpoint_count, filter_tail, head, render_service, rule_chain, tail,
};
use crate::model::{NodeInfo, ProxyState, ServiceKey};

/// A family's ruleset kept in parts, so that a change re-renders and restores only the
/// services it touched (kube-proxy's partial sync): the fixed chains and rules, each
/// service's share in key order, then the services' node-port rules, then the last rule of
/// KUBE-SERVICES. [`ruleset`](Self::ruleset) joins them into what [`render`] returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    head: Ruleset,
    tail: Vec<String>,
    /// The last rules of filter KUBE-SERVICES (the service ranges').
    filter_tail: Vec<String>,
    services: BTreeMap<ServiceKey, Arc<ServiceRules>>,
    /// Each service's endpoints of the family ([`endpoint_count`]), and their sum: over
    /// [`LARGE_CLUSTER_ENDPOINTS`] the services rendered go without endpoint comments.
    endpoints: BTreeMap<ServiceKey, usize>,
    endpoints_total: usize,
}

/// What [`Rendered::rerender`] replaced: each service whose rules changed, with its rules
/// before (None: it had none).
pub type Replaced = Vec<(ServiceKey, Option<Arc<ServiceRules>>)>;

impl Rendered {
    pub fn new(state: &ProxyState, node: &NodeInfo, family: Family, cfg: &RenderConfig) -> Self {
        // As kube-proxy, the mode is decided from every endpoint before anything is written.
        let endpoints: BTreeMap<ServiceKey, usize> = state
            .services
            .iter()
            .map(|(key, svc)| {
                let eps = state.endpoints.get(key).map(|e| &**e);
                (key.clone(), endpoint_count(svc, eps, family))
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        let endpoints_total = endpoints.values().sum();
        let large = endpoints_total > LARGE_CLUSTER_ENDPOINTS;
        let services = state
            .services
            .iter()
            .filter_map(|(key, svc)| {
                let eps = state.endpoints.get(key).map(|e| &**e);
                Some((
                    key.clone(),
                    Arc::new(render_service(svc, eps, node, family, cfg, large)?),
                ))
            })
            .collect();
        Rendered {
            head: head(cfg),
            tail: tail(family, cfg),
            filter_tail: filter_tail(family, cfg),
            services,
            endpoints,
            endpoints_total,
        }
    }

    /// kube-proxy's largeClusterMode: more than [`LARGE_CLUSTER_ENDPOINTS`] endpoints.
    pub fn large_cluster(&self) -> bool {
        self.endpoints_total > LARGE_CLUSTER_ENDPOINTS
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
        let keys: Vec<&ServiceKey> = keys.into_iter().collect();
        // The mode from every endpoint, the changed services' counted again (kube-proxy
        // counts all on each sync); services not rendered now keep their comments, or lack
        // of them, until the next full sync, as in kube-proxy's partial syncs. A failed
        // restore ([`undo`](Self::undo)) is followed by a full sync, which counts anew.
        for key in &keys {
            let n = state.services.get(*key).map_or(0, |svc| {
                endpoint_count(svc, state.endpoints.get(*key).map(|e| &**e), family)
            });
            let old = match n {
                0 => self.endpoints.remove(*key),
                n => self.endpoints.insert((*key).clone(), n),
            };
            self.endpoints_total = self.endpoints_total - old.unwrap_or(0) + n;
        }
        let large = self.large_cluster();
        let mut replaced = Vec::new();
        for key in keys {
            let new = state.services.get(key).and_then(|svc| {
                let eps = state.endpoints.get(key).map(|e| &**e);
                render_service(svc, eps, node, family, cfg, large)
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
    pub fn rules(&self, table: Table) -> Box<dyn Iterator<Item = &String> + '_> {
        match table {
            Table::Filter => Box::new(
                self.head
                    .filter_rules
                    .iter()
                    .chain(self.services.values().flat_map(|s| &s.rules.filter_rules))
                    .chain(&self.filter_tail),
            ),
            Table::Nat => Box::new(
                self.head
                    .nat_rules
                    .iter()
                    .chain(self.services.values().flat_map(|s| &s.rules.nat_rules))
                    .chain(self.services.values().flat_map(|s| &s.nodeports))
                    .chain(&self.tail),
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
        self.head.nat_rules.len() + services + self.tail.len()
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
