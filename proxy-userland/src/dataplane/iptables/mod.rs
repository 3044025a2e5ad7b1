//! The iptables proxier: kube-proxy's iptables mode, for nodes where the eBPF dataplane
//! cannot run.
//!
//! - [`names`]: kube-proxy's chain names (hashes of service port and endpoint).
//! - [`render`]: the model as `iptables-restore` input, a pure function.
//! - [`apply`]: running the tools (optionally in another network namespace), the jump
//!   rules, and removing our chains.
//!
//! Every sync renders the whole ruleset of each family (cheap) and restores only the chains
//! whose rules differ from what was last written, as kube-proxy's partial syncs do: a sync
//! that changes nothing runs no restore, and one endpoint change rewrites that service's
//! chains in one atomic `iptables-restore --noflush`, whatever the number of services. The
//! first sync, and any sync that finds our chains tampered with, restores everything.
//!
//! Full syncs also read the tables back: if someone flushed them or deleted a jump, the
//! ruleset is rewritten and the jumps put back. Rules are kept when the proxy stops (as
//! kube-proxy does: traffic keeps flowing through a restart) unless asked to remove them.

pub mod apply;
pub mod names;
pub mod render;

use std::collections::{BTreeMap, BTreeSet};

use tracing::{debug, info, warn};

pub use self::render::{Family, RenderConfig, Rendered, Table};
use self::{
    apply::{ApplyError, Jump, Runner},
    render::{
        KUBE_EXTERNAL_SERVICES, KUBE_FORWARD, KUBE_NODEPORTS, KUBE_POSTROUTING,
        KUBE_PROXY_FIREWALL, KUBE_SERVICES,
    },
};
use super::{
    Dataplane, Scope, SyncReport,
    frontends::{DesiredFrontend, Frontend, desired_frontends},
};
use crate::model::{NodeInfo, ProxyState, ServiceKey};

const NEW: &[&str] = &["-m", "conntrack", "--ctstate", "NEW"];

/// kube-proxy's jumps from the built-in chains into its own.
pub const JUMPS: &[Jump] = &[
    Jump {
        table: Table::Filter,
        from: "INPUT",
        to: KUBE_EXTERNAL_SERVICES,
        comment: "kubernetes externally-visible service portals",
        extra: NEW,
    },
    Jump {
        table: Table::Filter,
        from: "FORWARD",
        to: KUBE_EXTERNAL_SERVICES,
        comment: "kubernetes externally-visible service portals",
        extra: NEW,
    },
    Jump {
        table: Table::Filter,
        from: "INPUT",
        to: KUBE_NODEPORTS,
        comment: "kubernetes health check service ports",
        extra: &[],
    },
    Jump {
        table: Table::Filter,
        from: "FORWARD",
        to: KUBE_SERVICES,
        comment: "kubernetes service portals",
        extra: NEW,
    },
    Jump {
        table: Table::Filter,
        from: "OUTPUT",
        to: KUBE_SERVICES,
        comment: "kubernetes service portals",
        extra: NEW,
    },
    Jump {
        table: Table::Filter,
        from: "FORWARD",
        to: KUBE_FORWARD,
        comment: "kubernetes forwarding rules",
        extra: &[],
    },
    Jump {
        table: Table::Filter,
        from: "INPUT",
        to: KUBE_PROXY_FIREWALL,
        comment: "kubernetes load balancer firewall",
        extra: NEW,
    },
    Jump {
        table: Table::Filter,
        from: "OUTPUT",
        to: KUBE_PROXY_FIREWALL,
        comment: "kubernetes load balancer firewall",
        extra: NEW,
    },
    Jump {
        table: Table::Filter,
        from: "FORWARD",
        to: KUBE_PROXY_FIREWALL,
        comment: "kubernetes load balancer firewall",
        extra: NEW,
    },
    Jump {
        table: Table::Nat,
        from: "OUTPUT",
        to: KUBE_SERVICES,
        comment: "kubernetes service portals",
        extra: &[],
    },
    Jump {
        table: Table::Nat,
        from: "PREROUTING",
        to: KUBE_SERVICES,
        comment: "kubernetes service portals",
        extra: &[],
    },
    Jump {
        table: Table::Nat,
        from: "POSTROUTING",
        to: KUBE_POSTROUTING,
        comment: "kubernetes postrouting rules",
        extra: &[],
    },
];

#[derive(Debug, thiserror::Error)]
pub enum IptablesError {
    #[error("{0}")]
    Apply(#[from] ApplyError),
    #[error("neither iptables nor ip6tables can be used: {0}")]
    NoFamily(String),
}

#[derive(Clone, Debug, Default)]
pub struct IptablesConfig {
    /// Run every command in this network namespace (`/run/netns/NAME`).
    pub netns: Option<String>,
    pub render: RenderConfig,
    /// Which families to program; empty: each one whose tool works.
    pub families: Vec<Family>,
    /// Remove our chains when the proxier shuts down (default: keep them, like kube-proxy).
    pub cleanup_on_exit: bool,
    /// Which iptables tools to run (default: the system's `iptables`).
    pub backend: apply::Backend,
}

struct FamilyState {
    runner: Runner,
    /// The tools are iptables-nft (big restores start with [`render::LIST_FIRST`]).
    nft: bool,
    /// What the last successful restore left in the tables, per service.
    last: Option<Rendered>,
    /// Our chains in the tables as we last left them (or found them at start).
    chains: BTreeSet<(Table, String)>,
    /// Each service's frontends as last programmed.
    frontends: BTreeMap<ServiceKey, BTreeMap<Frontend, DesiredFrontend>>,
}

pub struct IptablesDataplane {
    cfg: IptablesConfig,
    families: Vec<FamilyState>,
    restores: u64,
}

fn is_ours(t: Table, c: &str) -> bool {
    render::is_our_chain(t, c)
}

fn our_chains_in(saved: &apply::Saved) -> BTreeSet<(Table, String)> {
    [Table::Filter, Table::Nat]
        .into_iter()
        .flat_map(|t| {
            saved
                .chains_matching(t, is_ours)
                .into_iter()
                .map(move |c| (t, c))
        })
        .collect()
}

impl IptablesDataplane {
    /// Checks the tools of each family (one that does not work is skipped with a warning,
    /// unless it was asked for) and reads what our chains look like now.
    pub fn new(cfg: IptablesConfig) -> Result<Self, IptablesError> {
        let wanted = if cfg.families.is_empty() {
            vec![Family::V4, Family::V6]
        } else {
            cfg.families.clone()
        };
        let mut families = Vec::new();
        let mut errors = Vec::new();
        for family in wanted {
            let runner = Runner::new(family, cfg.netns.clone()).with_backend(cfg.backend);
            match runner.save() {
                Ok(saved) => families.push(FamilyState {
                    chains: our_chains_in(&saved),
                    nft: match cfg.backend {
                        apply::Backend::Nft => true,
                        apply::Backend::Legacy => false,
                        apply::Backend::System => {
                            runner.version().is_ok_and(|v| v.contains("nf_tables"))
                        }
                    },
                    runner,
                    last: None,
                    frontends: BTreeMap::new(),
                }),
                Err(e) if cfg.families.is_empty() => {
                    warn!(?family, "not programming this family: {e}");
                    errors.push(e.to_string());
                }
                Err(e) => return Err(e.into()),
            }
        }
        if families.is_empty() {
            return Err(IptablesError::NoFamily(errors.join("; ")));
        }
        Ok(IptablesDataplane {
            cfg,
            families,
            restores: 0,
        })
    }

    /// How many restores have run: tests use it to see that unchanged syncs write nothing.
    pub fn restores(&self) -> u64 {
        self.restores
    }

    pub fn families(&self) -> Vec<Family> {
        self.families.iter().map(|f| f.runner.family).collect()
    }

    /// Stops the proxier: removes our chains and jumps if configured to, else leaves them
    /// so that traffic keeps flowing until the next proxy takes over.
    pub fn shutdown(&mut self) {
        if !self.cfg.cleanup_on_exit {
            info!("leaving the iptables rules in place (no --cleanup-on-exit)");
            return;
        }
        for f in &self.families {
            match apply::remove_chains(&f.runner, is_ours) {
                Ok(n) => {
                    info!(family = ?f.runner.family, chains = n, "removed our iptables chains")
                }
                Err(e) => {
                    warn!(family = ?f.runner.family, "cannot remove our iptables chains: {e}")
                }
            }
        }
    }

    /// One family's sync. A full sync (`changed` None) renders every service and reads the
    /// tables back; otherwise only the `changed` services are rendered again. Either way
    /// only the chains whose rules differ are restored, except on the first sync and after
    /// tampering, which restore everything.
    fn sync_family(
        f: &mut FamilyState,
        cfg: &IptablesConfig,
        state: &ProxyState,
        node: &NodeInfo,
        changed: Option<&BTreeSet<ServiceKey>>,
        restores: &mut u64,
    ) -> Result<(usize, usize), ApplyError> {
        let family = f.runner.family;
        let mut force = f.last.is_none();
        let mut saved = None;
        if changed.is_none() {
            let s = f.runner.save()?;
            let present = our_chains_in(&s);
            if f.last.is_some() && present != f.chains {
                warn!(
                    ?family,
                    "our iptables chains were changed by someone else; rewriting them"
                );
                force = true;
            }
            // Chains a previous run left that we do not want any more are deleted below.
            f.chains.extend(present);
            if JUMPS.iter().any(|j| !j.present_in(&s)) {
                force = true;
            }
            saved = Some(s);
        }
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
                let replaced = last.rerender(state, &keys, node, family, &cfg.render);
                // Stale: on a full sync every chain of ours not wanted, else the chains the
                // changed services no longer have.
                let (stale, added) = match changed {
                    None => {
                        let wanted = last.chains();
                        (
                            f.chains.difference(&wanted).cloned().collect(),
                            Some(wanted),
                        )
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
                let listing =
                    render::list_first(f.nft, declared + stale.len(), last.nat_rule_count());
                if let Some(text) = last.partial_restore_text(&replaced, &stale, listing) {
                    debug!(?family, bytes = text.len(), "iptables-restore (partial)");
                    if let Err(e) = f.runner.restore(&text) {
                        last.undo(replaced);
                        return Err(e);
                    }
                    *restores += 1;
                }
                match added {
                    Some(wanted) => f.chains = wanted,
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
                let rendered = Rendered::new(state, node, family, &cfg.render);
                let ruleset = rendered.ruleset();
                let wanted = rendered.chains();
                let stale: BTreeSet<(Table, String)> =
                    f.chains.difference(&wanted).cloned().collect();
                // What the nat table holds now, for the choice of listing it first.
                let present = saved
                    .as_ref()
                    .and_then(|s| s.table(Table::Nat))
                    .map_or(0, |t| t.rules.len());
                let listing = render::list_first(f.nft, wanted.len() + stale.len(), present);
                let text = ruleset.restore_text_listing(&stale, listing);
                debug!(?family, bytes = text.len(), "iptables-restore (full)");
                f.runner.restore(&text)?;
                *restores += 1;
                f.last = Some(rendered);
                f.chains = wanted;
            }
        }
        f.frontends.extend(frontends);
        f.frontends.retain(|_, fes| !fes.is_empty());
        // After the restore, so the chains the jumps point at exist.
        if let Some(saved) = saved {
            let n = apply::ensure_jumps(&f.runner, JUMPS, &saved)?;
            if n > 0 {
                info!(
                    ?family,
                    jumps = n,
                    "installed the jumps into our iptables chains"
                );
            }
        }
        Ok((written, removed))
    }
}

impl Dataplane for IptablesDataplane {
    fn name(&self) -> &'static str {
        "iptables"
    }

    fn sync(&mut self, state: &ProxyState, node: &NodeInfo, scope: Scope<'_>) -> SyncReport {
        let mut report = SyncReport::default();
        let keys: Vec<ServiceKey> = match scope {
            Scope::Full => state.services.keys().cloned().collect(),
            Scope::Changed(set) => set.iter().cloned().collect(),
        };
        report.services_synced = keys.len();
        let changed = match scope {
            Scope::Full => None,
            Scope::Changed(set) => Some(set),
        };
        for f in &mut self.families {
            match Self::sync_family(f, &self.cfg, state, node, changed, &mut self.restores) {
                Ok((w, r)) => {
                    report.frontends_written += w;
                    report.frontends_removed += r;
                }
                Err(e) => {
                    // One restore carries every service: they all stay as they were.
                    let msg = format!("{:?}: {e}", f.runner.family);
                    for k in &keys {
                        report.failed.push((k.clone(), msg.clone()));
                    }
                    if keys.is_empty() {
                        warn!("iptables sync failed: {msg}");
                    }
                }
            }
        }
        report
    }
}
