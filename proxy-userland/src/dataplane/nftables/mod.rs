//! The nftables proxier: kube-proxy's nftables mode, in tables of our own (`ip fastpath`,
//! `ip6 fastpath`), for nodes where the eBPF dataplane cannot run and nftables can.
//!
//! - [`render`]: the model as an nftables transaction, a pure function.
//! - [`apply`]: running `nft -f -` (optionally in another network namespace) behind the
//!   [`apply::Nft`] interface, and removing our tables.
//! - [`sync`]: full and partial transactions, stale chains, UDP conntrack clean-up.
//! - `elements`: a partial sync that only moves endpoints, as one netlink batch.
//! - [`listing`]: a table read back, from our statements or from `nft list table`: for
//!   `inspect` and `explain`, and for the ported kube-proxy tests' tracer.
//!
//! Every sync is one transaction per family (`nft -f -`, or a netlink batch of element
//! changes): atomic, so a packet sees the old table or the new one. A sync that changes nothing runs none.

pub mod apply;
pub mod elements;
pub mod listing;
pub mod render;
pub mod sync;

#[cfg(test)]
mod kube_tests;

use tracing::{info, warn};

use self::{
    apply::{Nft, NftRunner},
    sync::FamilyState,
};
use super::{
    Dataplane, Scope, SyncReport,
    iptables::{Family, RenderConfig, apply::ApplyError},
};
use crate::model::{NodeInfo, ProxyState, ServiceKey};

#[derive(Debug, thiserror::Error)]
pub enum NftablesError {
    #[error("{0}")]
    Apply(#[from] ApplyError),
}

#[derive(Clone, Debug, Default)]
pub struct NftablesConfig {
    /// Run every command in this network namespace (`/run/netns/NAME`).
    pub netns: Option<String>,
    pub render: RenderConfig,
    /// Which families to program; empty: both.
    pub families: Vec<Family>,
    /// Remove our tables when the proxier shuts down (default: keep them, like kube-proxy).
    pub cleanup_on_exit: bool,
}

pub struct NftablesDataplane {
    cfg: NftablesConfig,
    families: Vec<FamilyState>,
    transactions: u64,
}

impl NftablesDataplane {
    /// The proxier over the real `nft`: checks that it runs (a transaction that makes and
    /// deletes our table, which also clears what a previous run left).
    pub fn new(cfg: NftablesConfig) -> Result<Self, NftablesError> {
        let wanted = if cfg.families.is_empty() {
            vec![Family::V4, Family::V6]
        } else {
            cfg.families.clone()
        };
        let mut tools: Vec<Box<dyn Nft>> = Vec::new();
        for family in wanted {
            let runner = NftRunner::new(family, cfg.netns.clone());
            runner.run(&apply::delete_table_text(family))?;
            tools.push(Box::new(runner));
        }
        Ok(Self::with_tools(cfg, tools))
    }

    /// The proxier over the given tools, one per family: the real ones, or fakes.
    pub fn with_tools(cfg: NftablesConfig, tools: Vec<Box<dyn Nft>>) -> Self {
        NftablesDataplane {
            cfg,
            families: tools.into_iter().map(FamilyState::new).collect(),
            transactions: 0,
        }
    }

    /// How many `nft -f` transactions have run: tests use it to see that unchanged syncs
    /// write nothing.
    pub fn transactions(&self) -> u64 {
        self.transactions
    }

    pub fn families(&self) -> Vec<Family> {
        self.families.iter().map(FamilyState::family).collect()
    }

    /// Stops the proxier: removes our tables if configured to, else leaves them so that
    /// traffic keeps flowing until the next proxy takes over.
    pub fn shutdown(&mut self) {
        if !self.cfg.cleanup_on_exit {
            info!("leaving the nftables tables in place (no --cleanup-on-exit)");
            return;
        }
        for f in &self.families {
            let family = f.family();
            match f.nft.run(&apply::delete_table_text(family)) {
                Ok(()) => info!(?family, "removed our nftables table"),
                Err(e) => warn!(?family, "cannot remove our nftables table: {e}"),
            }
        }
    }
}

impl Dataplane for NftablesDataplane {
    fn name(&self) -> &'static str {
        "nftables"
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
            match sync::sync_family(f, &self.cfg.render, state, node, changed) {
                Ok(w) => {
                    self.transactions += w.transactions;
                    report.frontends_written += w.services;
                }
                Err(e) => {
                    // One transaction carries every service: they all stay as they were.
                    let msg = format!("{:?}: {e}", f.family());
                    for k in &keys {
                        report.failed.push((k.clone(), msg.clone()));
                    }
                    if keys.is_empty() {
                        warn!("nftables sync failed: {msg}");
                    }
                }
            }
        }
        report
    }
}

#[cfg(test)]
mod tests;
