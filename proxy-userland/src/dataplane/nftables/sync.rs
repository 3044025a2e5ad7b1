//! One family's sync, as kube-proxy's nftables syncProxyRules: a full sync at start, after
//! a failed one, when the node's addresses or the service ranges change and once an hour;
//! otherwise a partial one, one transaction holding only what the changed services changed:
//! over netlink when only endpoint and hairpin elements change, else through `nft`.
//! A full sync is one transaction where the table is small, else several of bounded size
//! (`Rendered::full_transactions`). Chains a
//! partial sync leaves unused are flushed at once and deleted a second later (kube-proxy:
//! before Linux 6.2 a chain is still "in use" for a moment after the map element that
//! pointed at it is gone). Then the UDP conntrack clean-up, as the iptables mode does it.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use tracing::{debug, info, warn};

use super::{
    apply::Nft,
    render::{Partial, Rendered, TABLE, family_name},
};
use crate::{
    dataplane::iptables::{
        Family, RenderConfig,
        apply::ApplyError,
        conntrack::{self, Flow, UdpTargets},
    },
    model::{NodeInfo, ProxyState, ServiceKey},
};

/// A periodic sync rewrites everything at least this often (kube-proxy's FullSyncPeriod).
pub const FULL_RESYNC: Duration = Duration::from_secs(3600);
/// The most text one `nft -f` run of a full sync gets. nft 1.0.6 holds about 30 times its
/// input in memory (1.2 GiB for the 48 MB of 10,000 services in kube-proxy's layout), and
/// it runs in the daemon's cgroup: the DaemonSet's limit is 512Mi.
pub const FULL_SYNC_BUDGET: usize = 2 << 20;
/// A stale chain is deleted no sooner than this after it was flushed.
const STALE_CHAIN_GRACE: Duration = Duration::from_secs(1);
const MAX_CONNTRACK_DELETES: usize = 20_000;

pub struct FamilyState {
    pub nft: Box<dyn Nft>,
    /// The render configuration in effect (the node's addresses filled in).
    pub render: Option<RenderConfig>,
    /// What the table holds, per service, after the last successful transaction.
    pub last: Option<Rendered>,
    pub needs_full: bool,
    /// Whether the table may hold something other than `last`: a full sync then deletes
    /// it and writes it anew. A failed partial transaction leaves it known (Linux applied
    /// none of it), so the full sync after it rewrites the table in place and services
    /// keep working meanwhile; a failed full sync, or an `nft` killed, does not.
    pub unknown: bool,
    pub last_full: Option<Instant>,
    /// Flushed chains to delete, and when they were flushed.
    pub stale: BTreeMap<String, Instant>,
    pub udp: BTreeMap<ServiceKey, UdpTargets>,
    pub conntrack_warned: bool,
    /// A full sync's text per `nft -f` run ([`FULL_SYNC_BUDGET`]; tests set less).
    pub budget: usize,
}

impl FamilyState {
    pub fn new(nft: Box<dyn Nft>) -> Self {
        FamilyState {
            nft,
            render: None,
            last: None,
            needs_full: false,
            unknown: true,
            last_full: None,
            stale: BTreeMap::new(),
            udp: BTreeMap::new(),
            conntrack_warned: false,
            budget: FULL_SYNC_BUDGET,
        }
    }

    pub fn family(&self) -> Family {
        self.nft.family()
    }
}

/// What one sync wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Written {
    pub transactions: u64,
    pub full: bool,
    /// The services whose objects changed (all of them on a full sync).
    pub services: usize,
}

pub fn sync_family(
    f: &mut FamilyState,
    base: &RenderConfig,
    state: &ProxyState,
    node: &NodeInfo,
    changed: Option<&BTreeSet<ServiceKey>>,
) -> Result<Written, ApplyError> {
    let family = f.family();
    let mut force = f.last.is_none()
        || f.needs_full
        || (changed.is_none() && f.last_full.is_none_or(|t| t.elapsed() >= FULL_RESYNC));
    if changed.is_none() || f.render.is_none() {
        let mut render = base.clone();
        render.node_ips = match f.nft.local_addresses() {
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
            .filter(|c| Family::of(&c.addr) == family)
            .map(|c| (c.addr, c.prefix))
            .collect();
        if f.render.as_ref() != Some(&render) {
            force = true;
            f.render = Some(render);
        }
    }
    let cfg = f.render.clone().unwrap_or_default();
    let mut written = Written::default();

    // Chains flushed by an earlier sync, unless a service took them back since.
    let due: Vec<String> = f
        .stale
        .iter()
        .filter(|(_, t)| t.elapsed() >= STALE_CHAIN_GRACE)
        .map(|(c, _)| c.clone())
        .collect();
    if !force && !due.is_empty() {
        let in_use: BTreeSet<&String> = f
            .last
            .iter()
            .flat_map(|l| l.services.values())
            .flat_map(|o| o.chains.keys())
            .collect();
        let f_name = family_name(family);
        let text: String = due
            .iter()
            .filter(|c| !in_use.contains(c))
            .map(|c| format!("delete chain {f_name} {TABLE} {c}\n"))
            .collect();
        if !text.is_empty() {
            match f.nft.run(&text) {
                Ok(()) => written.transactions += 1,
                // Left for the next full sync, which deletes the table with everything.
                Err(e) => warn!(?family, "cannot delete stale nftables chains: {e}"),
            }
        }
        for c in &due {
            f.stale.remove(c);
        }
    }

    let keys: BTreeSet<ServiceKey> = match changed {
        Some(set) => set.clone(),
        None => state
            .services
            .keys()
            .chain(f.last.iter().flat_map(|l| l.services.keys()))
            .chain(f.udp.keys())
            .cloned()
            .collect(),
    };

    match f.last.as_mut() {
        Some(last) if !force => {
            if let Some((partial, stale, undo)) = last.rerender(state, node, &cfg, &keys) {
                let done = match &partial {
                    Partial::Elements(changes) => {
                        debug!(?family, elements = changes.len(), "elements (partial)");
                        f.nft.run_elements(changes)
                    }
                    Partial::Text(text) => {
                        debug!(?family, bytes = text.len(), "nft -f (partial)");
                        f.nft.run(text)
                    }
                };
                if let Err(e) = done {
                    f.needs_full = true;
                    if matches!(e, ApplyError::Timeout { .. }) {
                        f.unknown = true;
                    } else {
                        last.undo(undo);
                    }
                    return Err(e);
                }
                written.transactions += 1;
                written.services = keys.len();
                let now = Instant::now();
                f.stale.extend(stale.into_iter().map(|c| (c, now)));
            }
        }
        _ => {
            // A table we know is written over; after a failed full sync or a killed `nft`
            // (or with none) it is made anew, since what it holds is not known.
            let previous = f.last.take().filter(|_| !f.unknown);
            let mut rendered = Rendered::new_over(state, node, family, &cfg, previous.as_ref());
            let (txs, stale) = rendered.full_transactions(previous.as_ref(), f.budget);
            let bytes: usize = txs.iter().map(String::len).sum();
            debug!(?family, bytes, transactions = txs.len(), "nft -f (full)");
            for text in &txs {
                if let Err(e) = f.nft.run(text) {
                    f.needs_full = true;
                    f.unknown = true;
                    return Err(e);
                }
                written.transactions += 1;
            }
            written.full = true;
            written.services = rendered.services.len();
            f.last = Some(rendered);
            if previous.is_none() {
                f.stale.clear();
            }
            let now = Instant::now();
            f.stale.extend(stale.into_iter().map(|c| (c, now)));
            f.needs_full = false;
            f.unknown = false;
            f.last_full = Some(Instant::now());
        }
    }
    clean_udp_conntrack(f, state, &keys, changed.is_none());
    Ok(written)
}

/// Deletes the UDP conntrack entries the sync made stale: entries to a UDP target that went,
/// or to an endpoint that no longer serves it (see the iptables mode's `conntrack`).
fn clean_udp_conntrack(
    f: &mut FamilyState,
    state: &ProxyState,
    keys: &BTreeSet<ServiceKey>,
    full: bool,
) {
    let family = f.family();
    let Some(targets) = conntrack::targets_to_clean(&mut f.udp, state, keys, family, full) else {
        return;
    };
    let flows = match f.nft.conntrack_udp() {
        Ok(flows) => flows,
        Err(e) => {
            if !std::mem::replace(&mut f.conntrack_warned, true) {
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
    match f.nft.conntrack_delete(&stale) {
        Ok(done) if done.deleted > 0 => info!(
            ?family,
            deleted = done.deleted,
            "deleted stale UDP conntrack entries"
        ),
        Ok(_) => {}
        Err(e) => warn!(?family, "cannot delete stale UDP conntrack entries: {e}"),
    }
}
