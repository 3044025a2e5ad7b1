//! Transactions that change a table: a full sync's, in bounded parts, and a partial
//! sync's, from what a service held to what it holds now.

use std::{collections::BTreeSet, net::IpAddr, sync::Arc};

use super::{
    Container, ElementChange, Rendered, ServiceObjects, Slots, TABLE, Writer, endpoints,
    family_name, hairpin_pair, render_service,
};
use crate::{
    dataplane::iptables::render::{Family, RenderConfig},
    model::{NodeInfo, ProxyState, ServiceKey},
};

impl Rendered {
    /// A full sync's transaction: the table deleted and made again in one atomic step,
    /// which also removes every object no longer wanted (stale chains, affinity sets,
    /// changed base chains). Connections keep their NAT: it lives in conntrack.
    pub fn full_transaction(&self) -> String {
        let f = family_name(self.family);
        format!(
            "add table {f} {TABLE}\ndelete table {f} {TABLE}\n{}",
            self.text()
        )
    }

    /// A full sync's transactions, each of about `budget` bytes of text at most (a service
    /// is never split, so each transaction leaves each service as it was or as it is now):
    /// the fixed objects first, then the services in key order, then the hairpin pairs.
    ///
    /// Written over `previous`, what the table holds as far as we know: every chain is
    /// written again (flushed and refilled), every element added again (which changes
    /// nothing where it is already), and what `previous` held that is no longer wanted is
    /// deleted, as a partial sync does; the chains that went are returned to delete later.
    /// Without `previous` the table is deleted first: a crashed run's or a failed sync's
    /// leftovers go with it, and so, until the last transaction, does what it served.
    ///
    /// One `nft -f` of the whole table would need about 30 times its text in memory (1.2
    /// GiB at 10,000 services), in the daemon's cgroup (docs/modes.md).
    ///
    /// Build `self` with [`Rendered::new_over`] `previous`, so chains keep their slots.
    pub fn full_transactions(
        &mut self,
        previous: Option<&Rendered>,
        budget: usize,
    ) -> (Vec<String>, Vec<String>) {
        let f = family_name(self.family);
        let mut first = Writer::new(self.family);
        if previous.is_none() {
            first.head = format!("add table {f} {TABLE}\ndelete table {f} {TABLE}\n");
        }
        first.head.push_str(&refill(&self.head));
        let mut txs = Vec::new();
        // A table that fits the budget is still written in one transaction.
        let mut w = first;
        let mut stale = Vec::new();
        let mut deleted_sets = Vec::new();
        // An element two services claim goes to the first in key order, as in `text()`.
        let mut claimed: BTreeSet<(Container, String)> = BTreeSet::new();
        let empty = Arc::new(ServiceObjects::default());
        let keys: BTreeSet<&ServiceKey> = (self.services.keys())
            .chain(previous.iter().flat_map(|p| p.services.keys()))
            .collect();
        for key in keys {
            let n = self.services.get(key).unwrap_or(&empty);
            let o = previous.and_then(|p| p.services.get(key)).unwrap_or(&empty);
            let refill = Some(&mut claimed);
            partial(
                &mut w,
                self.family,
                &self.slots,
                (o, n),
                &mut stale,
                &mut deleted_sets,
                refill,
            );
            for set in deleted_sets.drain(..) {
                w.line("delete", "set", &set);
            }
            if w.len() >= budget {
                txs.push(w.take());
            }
        }
        let gone = previous.into_iter().flat_map(|p| p.hairpin_refs.keys());
        let gone = gone.filter(|p| !self.hairpin_refs.contains_key(*p));
        let pairs = (self.hairpin_refs.keys().map(|p| (p, true))).chain(gone.map(|p| (p, false)));
        for (&ip, wanted) in pairs {
            if wanted {
                w.element(Container::Hairpin, &hairpin_pair(ip), "", None);
            } else {
                w.delete_element(Container::Hairpin, &hairpin_pair(ip));
            }
            if w.len() >= budget {
                txs.push(w.take());
            }
        }
        if !w.is_empty() {
            txs.push(w.take());
        }
        let wanted: BTreeSet<&str> = (self.services.values())
            .flat_map(|o| o.spreads.keys().map(String::as_str))
            .collect();
        self.slots.release_unless(|chain| wanted.contains(chain));
        (txs, stale)
    }

    /// Re-renders the services `keys` from `state` (one it lacks: gone) and returns a
    /// partial transaction that turns the table from what `self` held into the new state,
    /// and the chains that went stale (flushed now, to delete once nothing refers to
    /// them), with what undoes the change to `self` should the transaction fail. None when
    /// nothing changed.
    pub fn rerender<'a>(
        &mut self,
        state: &ProxyState,
        node: &NodeInfo,
        cfg: &RenderConfig,
        keys: impl IntoIterator<Item = &'a ServiceKey>,
    ) -> Option<(Partial, Vec<String>, Undo)> {
        let mut undo = Undo::default();
        let mut w = Writer::new(self.family);
        let mut stale = Vec::new();
        let mut deleted_sets = Vec::new();
        let mut hairpin_changes = Vec::new();
        // Slots of spreads that went: given back once the transaction is written, so no
        // other chain takes one in the same transaction.
        let mut released: Vec<String> = Vec::new();
        for key in keys {
            let new = state.services.get(key).and_then(|svc| {
                let eps = state.endpoints.get(key).map(|e| &**e);
                render_service(svc, eps, node, self.family, cfg).map(Arc::new)
            });
            let old = self.services.get(key).cloned();
            if new.as_deref() == old.as_deref() {
                continue;
            }
            let empty = ServiceObjects::default();
            let (o, n) = (
                old.as_deref().unwrap_or(&empty),
                new.as_deref().unwrap_or(&empty),
            );
            for (chain, spread) in &n.spreads {
                if self.slots.get(chain).is_none() {
                    self.slots.hold(chain, spread.proto);
                    undo.held.push(chain.clone());
                }
            }
            released.extend(
                (o.spreads.keys())
                    .filter(|c| !n.spreads.contains_key(*c))
                    .cloned(),
            );
            partial(
                &mut w,
                self.family,
                &self.slots,
                (o, n),
                &mut stale,
                &mut deleted_sets,
                None,
            );
            // Both lists are sorted: what is only in one of them.
            let only_in = |a: &[IpAddr], b: &[IpAddr]| -> Vec<IpAddr> {
                a.iter()
                    .copied()
                    .filter(|ip| b.binary_search(ip).is_err())
                    .collect()
            };
            for ip in only_in(&n.hairpin, &o.hairpin) {
                undo.hairpin.push((ip, self.hairpin_refs.get(&ip).copied()));
                let refs = self.hairpin_refs.entry(ip).or_default();
                *refs += 1;
                if *refs == 1 {
                    hairpin_changes.push(ElementChange::Hairpin { ip, add: true });
                }
            }
            for ip in only_in(&o.hairpin, &n.hairpin) {
                undo.hairpin.push((ip, self.hairpin_refs.get(&ip).copied()));
                if let Some(refs) = self.hairpin_refs.get_mut(&ip) {
                    *refs -= 1;
                    if *refs == 0 {
                        self.hairpin_refs.remove(&ip);
                        hairpin_changes.push(ElementChange::Hairpin { ip, add: false });
                    }
                }
            }
            undo.services.push((key.clone(), old));
            match new {
                Some(n) => self.services.insert(key.clone(), n),
                None => self.services.remove(key),
            };
        }
        for chain in &released {
            if let Some(slot) = self.slots.get(chain) {
                undo.released.push((chain.clone(), slot));
            }
        }
        for chain in &released {
            self.slots.release(chain);
        }
        for set in deleted_sets {
            w.line("delete", "set", &set);
        }
        for c in hairpin_changes {
            w.change(c);
        }
        if w.is_empty() {
            return None;
        }
        let partial = if w.text.is_empty() {
            Partial::Elements(std::mem::take(&mut w.changes))
        } else {
            Partial::Text(w.take())
        };
        Some((partial, stale, undo))
    }

    /// Takes `self` back to what it was before the [`Rendered::rerender`] that returned
    /// `undo`: its transaction failed, and Linux applied none of it, so the table still
    /// holds that.
    pub fn undo(&mut self, undo: Undo) {
        for (key, old) in undo.services.into_iter().rev() {
            match old {
                Some(o) => self.services.insert(key, o),
                None => self.services.remove(&key),
            };
        }
        for (ip, refs) in undo.hairpin.into_iter().rev() {
            match refs {
                Some(r) => self.hairpin_refs.insert(ip, r),
                None => self.hairpin_refs.remove(&ip),
            };
        }
        for chain in &undo.held {
            self.slots.release(chain);
        }
        for (chain, slot) in undo.released {
            self.slots.restore(&chain, slot);
        }
    }
}

/// What a [`Rendered::rerender`] changed in the `Rendered`, to take back.
#[derive(Debug, Default)]
pub struct Undo {
    /// Each service rendered again, with what it held before (None: it was not there).
    services: Vec<(ServiceKey, Option<Arc<ServiceObjects>>)>,
    /// Hairpin counts before each change, in order.
    hairpin: Vec<(IpAddr, Option<u32>)>,
    /// Chains that took a slot, and chains that gave theirs back.
    held: Vec<String>,
    released: Vec<(String, endpoints::Slot)>,
}

/// A partial sync's transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Partial {
    /// Only elements change (endpoints moved within their services' counts): no rule, so
    /// no `nft` run and no validation of the table.
    Elements(Vec<ElementChange>),
    /// Anything else: one `nft -f` text.
    Text(String),
}

impl Partial {
    /// The transaction as `nft -f` text.
    pub fn text(&self, family: Family) -> String {
        match self {
            Partial::Text(t) => t.clone(),
            Partial::Elements(changes) => elements_text(family, changes),
        }
    }
}

/// Element changes as one `nft -f` text, the maps they use declared first.
pub fn elements_text(family: Family, changes: &[ElementChange]) -> String {
    let mut w = Writer::new(family);
    for &c in changes {
        w.change(c);
    }
    w.take()
}

/// The fixed objects written over themselves: declared (which changes nothing where they
/// exist), their chains and the node-port address set flushed, then filled again, in one
/// transaction.
fn refill(head: &str) -> String {
    let mut decls = String::new();
    let mut flushes = String::new();
    let mut fills = String::new();
    for line in head.lines() {
        let mut words = line.splitn(5, ' ');
        let (verb, kind) = (words.next(), words.next());
        let (family, table, name) = (words.next(), words.next(), words.next());
        let name = name.and_then(|n| n.split(' ').next()).unwrap_or_default();
        let (family, table) = (family.unwrap_or_default(), table.unwrap_or_default());
        match (verb, kind) {
            (Some("add"), Some("rule" | "element")) => {
                fills.push_str(line);
                fills.push('\n');
                continue;
            }
            (Some("add"), Some("chain")) => {
                flushes.push_str(&format!("flush chain {family} {table} {name}\n"));
            }
            (Some("add"), Some("set")) if name == super::NODEPORT_IPS => {
                flushes.push_str(&format!("flush set {family} {table} {name}\n"));
            }
            _ => {}
        }
        decls.push_str(line);
        decls.push('\n');
    }
    decls + &flushes + &fills
}

/// The statements that turn one service's objects `o` into `n`. With `refill` (a full
/// sync), every chain and element of `n` is written, changed or not, but for elements an
/// earlier service claimed (recorded there).
fn partial(
    w: &mut Writer,
    family: Family,
    slots: &Slots,
    (o, n): (&ServiceObjects, &ServiceObjects),
    stale: &mut Vec<String>,
    deleted_sets: &mut Vec<String>,
    mut refill: Option<&mut BTreeSet<(Container, String)>>,
) {
    let all = refill.is_some();
    // A set made again (new timeout) must first lose the rules that name it: then every
    // chain of the service is rewritten.
    let sets_remade = n
        .affinity_sets
        .iter()
        .any(|(name, t)| o.affinity_sets.get(name).is_some_and(|old| old != t));
    // Elements go first, so no map points at a chain that is about to change shape.
    // (Hairpin elements are shared between services: the caller counts them.)
    for (k @ (c, key), v) in &o.elements {
        if n.elements.get(k) != Some(v) {
            w.delete_element(*c, key);
        }
    }
    // An endpoint map's elements change on their own; its rule only with the count.
    let count =
        |objs: &ServiceObjects, name: &str| objs.spreads.get(name).map(|s| s.endpoints.len());
    let rewritten: Vec<(&String, &Vec<String>)> = n
        .chains
        .iter()
        .filter(|(name, rules)| {
            all || sets_remade
                || o.chains.get(*name) != Some(*rules)
                || count(o, name) != count(n, name)
        })
        .collect();
    let spread_chains: BTreeSet<&String> = o.spreads.keys().chain(n.spreads.keys()).collect();
    for chain in spread_chains {
        let Some(slot) = slots.get(chain) else {
            continue;
        };
        let old = o.spreads.get(chain).map_or(&[][..], |s| &s.endpoints);
        let new = n.spreads.get(chain).map_or(&[][..], |s| &s.endpoints);
        for c in endpoints::diff(slot, old, new, all) {
            w.change(c);
        }
    }
    for (name, _) in &rewritten {
        w.line("add", "chain", name);
        w.line("flush", "chain", name);
    }
    for name in o.chains.keys() {
        if !n.chains.contains_key(name) {
            w.line("flush", "chain", name);
            stale.push(name.clone());
        }
    }
    for (name, &timeout) in &n.affinity_sets {
        match o.affinity_sets.get(name) {
            Some(&old) if old == timeout && !all => {}
            Some(&old) if old == timeout => w.affinity_set(name, timeout, family),
            Some(_) => {
                w.line("delete", "set", name);
                w.affinity_set(name, timeout, family);
            }
            None => w.affinity_set(name, timeout, family),
        }
    }
    for (name, rules) in rewritten {
        for r in rules {
            w.rule(name, r);
        }
        if let Some(spread) = n.spreads.get(name) {
            w.spread(name, spread, slots.get(name));
        }
    }
    for (k @ (c, key), v @ (verdict, comment)) in &n.elements {
        let write = match refill.as_deref_mut() {
            Some(claimed) => claimed.insert(k.clone()),
            None => o.elements.get(k) != Some(v),
        };
        if write {
            w.element(*c, key, verdict, comment.as_deref());
        }
    }
    for name in o.affinity_sets.keys() {
        if !n.affinity_sets.contains_key(name) {
            deleted_sets.push(name.clone());
        }
    }
}
