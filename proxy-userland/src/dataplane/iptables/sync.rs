//! One family's sync: what to restore, when to rewrite everything, and the UDP conntrack
//! clean-up after it.
//!
//! As kube-proxy's syncProxyRules: most syncs restore only the chains whose rules changed
//! (partial sync). Everything is rewritten (full restore) on the first sync, after any
//! failed restore, when the node's addresses change, once every [`FULL_RESYNC`] on a
//! periodic sync, and whenever a periodic sync finds that the tables no longer hold what we
//! last wrote: chains added or removed, a jump missing, or any of our chains with other
//! rules than ours (each rule compared by its target, destination, port and DNAT address,
//! so a flushed or edited chain is noticed, whatever iptables-save's formatting).

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use tracing::{debug, info, warn};

use super::{
    JUMPS,
    apply::{ApplyError, Saved, Tools},
    conntrack::{self, Flow, UdpTargets},
    render::{self, FullRestore, RenderConfig, Rendered, Table, rule_chain},
};
use crate::{
    dataplane::frontends::{DesiredFrontend, Frontend, desired_frontends},
    model::{NodeInfo, ProxyState, ServiceKey},
};

/// A periodic sync rewrites everything at least this often, as kube-proxy's
/// FullSyncPeriod: it repairs what the comparison with the tables cannot see.
pub const FULL_RESYNC: Duration = Duration::from_secs(3600);
/// A periodic sync reads the tables back at least this often, even when the nf_tables
/// generation says nobody else has committed (see [`counted_restore`] for what it may
/// miss).
pub const READ_BACK_MAX_AGE: Duration = Duration::from_secs(300);
/// At most this many conntrack entries are deleted in one sync; the rest wait for the next
/// one that looks. They go in one netlink batch (a few milliseconds per thousand), so the
/// bound is for a table gone wild, not for the sync's time as with one `conntrack -D`
/// process per entry (2,000 took about 30 s).
const MAX_CONNTRACK_DELETES: usize = 20_000;

pub(super) struct FamilyState {
    pub tools: Box<dyn Tools>,
    /// The tools are iptables-nft (big restores start with [`render::LIST_FIRST`]).
    pub nft: bool,
    /// The iptables binary knows `--random-fully`.
    pub random_fully: bool,
    /// The render configuration in effect (the node's addresses filled in).
    pub render: Option<RenderConfig>,
    /// What the last successful restore left in the tables, per service.
    pub last: Option<Rendered>,
    /// Our chains in the tables as we last left them (or found them at start).
    pub chains: BTreeSet<(Table, String)>,
    /// Stale chains that could not be deleted (something else jumps to them): flushed and
    /// left alone until the next full restore tries again.
    pub undeletable: BTreeSet<(Table, String)>,
    /// A restore failed: the next sync rewrites everything.
    pub needs_full: bool,
    pub last_full: Option<Instant>,
    /// Each service's frontends as last programmed.
    pub frontends: BTreeMap<ServiceKey, BTreeMap<Frontend, DesiredFrontend>>,
    /// Each UDP service's targets and serving endpoints, as last programmed.
    pub udp: BTreeMap<ServiceKey, UdpTargets>,
    /// The conntrack tool failed once already (warned; later failures are debug).
    pub conntrack_warned: bool,
    /// The nf_tables commits this sync's restores made (None: unknown, after a failure).
    pub commits: Option<u32>,
    /// This sync read the tables back and checked them, or rewrote them whole: they hold
    /// `last` whatever was in them before.
    pub verified: bool,
}

impl FamilyState {
    pub fn new(
        tools: Box<dyn Tools>,
        nft: bool,
        random_fully: bool,
        chains: BTreeSet<(Table, String)>,
    ) -> Self {
        FamilyState {
            tools,
            nft,
            random_fully,
            render: None,
            last: None,
            chains,
            undeletable: BTreeSet::new(),
            needs_full: false,
            last_full: None,
            frontends: BTreeMap::new(),
            udp: BTreeMap::new(),
            conntrack_warned: false,
            commits: Some(0),
            verified: false,
        }
    }

    /// The nf_tables generation, with the nft tools only (legacy iptables bypasses it).
    pub fn generation(&self) -> Option<u32> {
        if self.nft {
            self.tools.generation()
        } else {
            None
        }
    }
}

pub(super) fn our_chains_in(saved: &Saved) -> BTreeSet<(Table, String)> {
    [Table::Filter, Table::Nat]
        .into_iter()
        .flat_map(|t| {
            saved
                .chains_matching(t, render::is_our_chain)
                .into_iter()
                .map(move |c| (t, c))
        })
        .collect()
}

/// What identifies a rule across iptables-save's rewriting of it: its target, destination,
/// destination port and DNAT address (`-d 198.19.0.10` is saved as `-d 198.19.0.10/32`,
/// the matches in another order).
fn signature(rule: &str) -> [Option<&str>; 4] {
    let mut sig = [None; 4];
    let mut words = rule.split_whitespace();
    while let Some(w) = words.next() {
        let slot = match w {
            "-j" | "-g" => 0,
            "-d" => 1,
            "--dport" => 2,
            "--to-destination" => 3,
            _ => continue,
        };
        sig[slot] = words
            .next()
            .map(|v| v.trim_end_matches("/32").trim_end_matches("/128"));
    }
    sig
}

/// Why the tables no longer hold what `last` says we wrote, if they do not.
fn tampered(
    saved: &Saved,
    last: &Rendered,
    present: &BTreeSet<(Table, String)>,
    known: &BTreeSet<(Table, String)>,
) -> Option<String> {
    if present != known {
        return Some("chains were added or deleted".into());
    }
    if let Some(j) = JUMPS.iter().find(|j| !j.present_in(saved)) {
        return Some(format!("the jump from {} to {} is missing", j.from, j.to));
    }
    for table in [Table::Filter, Table::Nat] {
        let mut have: BTreeMap<&str, Vec<[Option<&str>; 4]>> = BTreeMap::new();
        for (chain, line) in saved
            .table(table)
            .map(|t| t.rules.as_slice())
            .unwrap_or_default()
        {
            if render::is_our_chain(table, chain) {
                have.entry(chain.as_str())
                    .or_default()
                    .push(signature(line));
            }
        }
        let mut want: BTreeMap<&str, Vec<[Option<&str>; 4]>> = BTreeMap::new();
        for r in last.rules(table) {
            if let Some(chain) = rule_chain(r) {
                want.entry(chain).or_default().push(signature(r));
            }
        }
        for (t, chain) in last.chains().iter().filter(|(t, _)| *t == table) {
            let (h, w) = (have.get(chain.as_str()), want.get(chain.as_str()));
            if h.map_or(0, Vec::len) != w.map_or(0, Vec::len)
                || h.zip(w).is_some_and(|(h, w)| h != w)
            {
                return Some(format!(
                    "the {} chain {chain} holds other rules than ours",
                    t.name()
                ));
            }
        }
    }
    None
}

/// Runs one restore, adding the nf_tables commits it made to `commits`: the generation's
/// move across it, which must be no more than its tables (iptables-nft-restore commits at
/// most once per COMMIT line, and not at all for a table it changes nothing in). A move
/// beyond that was someone else's; a failed restore may have committed some of its
/// tables. Either way the count becomes unknown. (Someone else committing during our
/// restore while it left a table unchanged goes unseen; the read-back every
/// [`READ_BACK_MAX_AGE`] bounds that.)
fn counted_restore(
    tools: &dyn Tools,
    nft: bool,
    commits: &mut Option<u32>,
    text: &str,
) -> Result<(), ApplyError> {
    let generation = || if nft { tools.generation() } else { None };
    let before = generation();
    let result = tools.restore(text);
    let after = generation();
    let tables = text.lines().filter(|l| l.trim() == "COMMIT").count();
    *commits = match (&result, *commits, before, after) {
        (Ok(()), Some(n), Some(before), Some(after))
            if (after.wrapping_sub(before) as usize) <= tables =>
        {
            Some(n.wrapping_add(after.wrapping_sub(before)))
        }
        _ => None,
    };
    result
}

/// One family's sync. A full sync (`changed` None) renders every service and reads the
/// tables back, unless they are `untouched` (nobody else has committed since they were
/// known to hold our rules); otherwise only the `changed` services are rendered again.
/// Returns the frontends written and removed.
pub(super) fn sync_family(
    f: &mut FamilyState,
    base: &RenderConfig,
    state: &ProxyState,
    node: &NodeInfo,
    changed: Option<&BTreeSet<ServiceKey>>,
    untouched: bool,
    restores: &mut u64,
) -> Result<(usize, usize), ApplyError> {
    let family = f.tools.family();
    let periodic_full = changed.is_none() && f.last_full.is_none_or(|t| t.elapsed() >= FULL_RESYNC);
    let mut force = f.last.is_none() || f.needs_full || periodic_full;
    let mut saved = None;
    f.commits = Some(0);
    f.verified = false;
    if changed.is_none() || force || f.render.is_none() {
        let mut render = base.clone();
        render.random_fully = f.random_fully;
        render.node_ips = match f.tools.local_addresses() {
            Ok(ips) => ips,
            Err(e) => {
                warn!(?family, "cannot list the node's addresses: {e}");
                f.render
                    .as_ref()
                    .map(|r| r.node_ips.clone())
                    .unwrap_or_default()
            }
        };
        render.service_ranges = (state.service_ranges.cidrs().iter())
            .filter(|c| render::Family::of(&c.addr) == family)
            .map(|c| (c.addr, c.prefix))
            .collect();
        if f.render.as_ref() != Some(&render) {
            // The rules depend on the node's addresses and the service ranges: write them
            // all again.
            force = true;
            f.render = Some(render);
        }
        // Nobody has committed since the tables were known to hold our rules: reading
        // them back (seconds at 10,000 services, with changes waiting) would find them so.
        if force || !untouched {
            let s = f.tools.save()?;
            let present = our_chains_in(&s);
            if !force
                && let Some(last) = &f.last
                && let Some(why) = tampered(&s, last, &present, &f.chains)
            {
                warn!(
                    ?family,
                    "our iptables rules were changed by someone else ({why}); rewriting them all"
                );
                force = true;
            }
            // Chains a previous run left that we do not want any more are deleted below.
            f.chains.extend(present);
            saved = Some(s);
            f.verified = true;
        }
    }
    let cfg = f.render.clone().unwrap_or_default();
    // The services to look at: the changed ones, or on a full sync every one we
    // know of, now or from before.
    let keys: BTreeSet<ServiceKey> = match changed {
        Some(set) => set.clone(),
        None => {
            let known = f.last.iter().flat_map(Rendered::keys);
            state
                .services
                .keys()
                .chain(f.frontends.keys())
                .chain(f.udp.keys())
                .chain(known)
                .cloned()
                .collect()
        }
    };

    let mut frontends = BTreeMap::new();
    let (mut written, mut removed) = (0, 0);
    for key in &keys {
        let mut now = BTreeMap::new();
        if let Some(svc) = state.services.get(key) {
            let eps = state.endpoints.get(key).map(|e| &**e);
            now.extend(
                desired_frontends(svc, eps, node)
                    .into_iter()
                    .filter(|(fe, _)| render::Family::of(&fe.ip) == family),
            );
        }
        let before = f.frontends.get(key);
        written += now
            .iter()
            .filter(|(fe, d)| before.and_then(|b| b.get(fe)) != Some(d))
            .count();
        removed += before.map_or(0, |b| b.keys().filter(|fe| !now.contains_key(fe)).count());
        frontends.insert(key.clone(), now);
    }

    match f.last.as_mut() {
        Some(last) if !force => {
            let replaced = last.rerender(state, &keys, node, family, &cfg);
            // Stale: on a full sync every chain of ours not wanted, else the chains the
            // changed services no longer have; never those known to be in use elsewhere.
            let (stale, added) = match changed {
                None => {
                    let wanted = last.chains();
                    let stale = f
                        .chains
                        .difference(&wanted)
                        .filter(|c| !f.undeletable.contains(*c))
                        .cloned()
                        .collect();
                    (stale, Some(wanted))
                }
                Some(_) => {
                    let mut stale = BTreeSet::new();
                    for (key, old) in &replaced {
                        let now: BTreeSet<&str> = last.own_chains(key).collect();
                        for c in old.iter().flat_map(|o| &o.rules.nat_chains) {
                            if !now.contains(c.as_str()) {
                                stale.insert((Table::Nat, c.clone()));
                            }
                        }
                    }
                    (stale, None)
                }
            };
            let declared: usize = replaced
                .iter()
                .map(|(k, _)| last.own_chains(k).count())
                .sum();
            let listing = render::list_first(f.nft, declared + stale.len(), last.nat_rule_count());
            if let Some(text) = last.partial_restore_text(&replaced, &stale, listing) {
                debug!(?family, bytes = text.len(), "iptables-restore (partial)");
                if let Err(e) = counted_restore(&*f.tools, f.nft, &mut f.commits, &text) {
                    last.undo(replaced);
                    f.needs_full = true;
                    return Err(e);
                }
                *restores += 1;
            }
            match added {
                Some(wanted) => {
                    f.chains = wanted;
                    f.chains.extend(f.undeletable.iter().cloned());
                }
                None => {
                    for c in &stale {
                        f.chains.remove(c);
                    }
                    for (key, _) in &replaced {
                        f.chains
                            .extend(last.own_chains(key).map(|c| (Table::Nat, c.to_string())));
                    }
                }
            }
        }
        _ => {
            let saved = match saved {
                Some(s) => s,
                None => f.tools.save()?,
            };
            full_restore(f, &cfg, state, node, &saved, restores)?;
        }
    }
    f.frontends.extend(frontends);
    f.frontends.retain(|_, fes| !fes.is_empty());
    f.verified |= force;
    clean_udp_conntrack(f, state, &keys, changed.is_none());
    Ok((written, removed))
}

/// Rewrites every chain of ours, deletes the stale ones and puts back missing jumps, all
/// in one restore. If deleting a stale chain fails (another rule jumps to it), restores
/// again keeping those chains, flushed, so that the services are programmed anyway.
fn full_restore(
    f: &mut FamilyState,
    cfg: &RenderConfig,
    state: &ProxyState,
    node: &NodeInfo,
    saved: &Saved,
    restores: &mut u64,
) -> Result<(), ApplyError> {
    let family = f.tools.family();
    let rendered = Rendered::new(state, node, family, cfg);
    let ruleset = rendered.ruleset();
    let wanted = rendered.chains();
    let stale: BTreeSet<(Table, String)> = f.chains.difference(&wanted).cloned().collect();
    // What the nat table holds now, for the choice of listing it first.
    let present = saved.table(Table::Nat).map_or(0, |t| t.rules.len());
    let mut extra = FullRestore {
        list_first: render::list_first(f.nft, wanted.len() + stale.len(), present),
        jumps: JUMPS
            .iter()
            .filter(|j| !j.present_in(saved))
            .map(|j| (j.table, j.restore_line()))
            .collect(),
        keep_stale: false,
    };
    let text = ruleset.restore_text_with(&stale, &extra);
    debug!(?family, bytes = text.len(), "iptables-restore (full)");
    let mut kept = BTreeSet::new();
    if let Err(e) = counted_restore(&*f.tools, f.nft, &mut f.commits, &text) {
        if stale.is_empty() {
            f.needs_full = true;
            return Err(e);
        }
        warn!(
            ?family,
            "iptables-restore failed ({e}); trying again without deleting {} stale chains",
            stale.len()
        );
        extra.keep_stale = true;
        let text = ruleset.restore_text_with(&stale, &extra);
        if let Err(e) = counted_restore(&*f.tools, f.nft, &mut f.commits, &text) {
            f.needs_full = true;
            return Err(e);
        }
        kept = stale;
    }
    *restores += 1;
    if !extra.jumps.is_empty() {
        info!(
            ?family,
            jumps = extra.jumps.len(),
            "installed the jumps into our iptables chains"
        );
    }
    f.last = Some(rendered);
    f.chains = wanted.union(&kept).cloned().collect();
    f.undeletable = kept;
    f.needs_full = false;
    f.last_full = Some(Instant::now());
    Ok(())
}

/// Deletes the UDP conntrack entries the sync made stale (see [`conntrack`]): after a
/// change to some UDP service's targets or endpoints, and on full syncs.
fn clean_udp_conntrack(
    f: &mut FamilyState,
    state: &ProxyState,
    keys: &BTreeSet<ServiceKey>,
    full: bool,
) {
    let family = f.tools.family();
    let Some(targets) = conntrack::targets_to_clean(&mut f.udp, state, keys, family, full) else {
        return;
    };
    let flows = match f.tools.conntrack_udp() {
        Ok(flows) => flows,
        Err(e) => {
            if std::mem::replace(&mut f.conntrack_warned, true) {
                debug!(?family, "cannot list UDP conntrack entries: {e}");
            } else {
                warn!(
                    ?family,
                    "cannot list UDP conntrack entries, so UDP clients may stay on removed endpoints: {e}"
                );
            }
            return;
        }
    };
    let stale: Vec<Flow> = conntrack::stale(&flows, &targets)
        .into_iter()
        .take(MAX_CONNTRACK_DELETES)
        .copied()
        .collect();
    if stale.is_empty() {
        return;
    }
    match f.tools.conntrack_delete(&stale) {
        Ok(done) => {
            for (flow, e) in &done.failed {
                debug!(?family, ?flow, "cannot delete a conntrack entry: {e}");
            }
            if done.deleted > 0 {
                info!(
                    ?family,
                    deleted = done.deleted,
                    already_gone = done.already_gone,
                    "deleted stale UDP conntrack entries"
                );
            }
        }
        Err(e) => warn!(?family, "cannot delete stale UDP conntrack entries: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_is_known_by_target_destination_port_and_dnat_address() {
        let ours = "-A KUBE-SERVICES -m comment --comment \"demo/web:http cluster IP\" -m tcp -p tcp -d 198.19.0.10 --dport 80 -j KUBE-SVC-X";
        let saved = "-A KUBE-SERVICES -d 198.19.0.10/32 -p tcp -m comment --comment \"demo/web:http cluster IP\" -m tcp --dport 80 -j KUBE-SVC-X";
        assert_eq!(signature(ours), signature(saved));
        assert_eq!(
            signature(ours),
            [Some("KUBE-SVC-X"), Some("198.19.0.10"), Some("80"), None]
        );
        let dnat = "-A KUBE-SEP-Y -p tcp -m tcp -j DNAT --to-destination 198.18.1.11:8080";
        assert_eq!(signature(dnat)[3], Some("198.18.1.11:8080"));
        assert_ne!(signature(dnat), signature(&dnat.replace(".11:", ".12:")));
    }
}
