//! The iptables proxier: kube-proxy's iptables mode, for nodes where the eBPF dataplane
//! cannot run.
//!
//! - [`names`]: kube-proxy's chain names (hashes of service port and endpoint).
//! - [`render`]: the model as `iptables-restore` input, a pure function.
//! - [`apply`]: running the tools (optionally in another network namespace) behind the
//!   [`apply::Tools`] interface, the jump rules, and removing our chains.
//! - `sync`: partial and full restores, repairing tampered tables, conntrack clean-up.
//! - [`conntrack`]: which UDP conntrack entries a change makes stale.
//! - [`generation`]: the nf_tables generation, which tells the periodic sync whether anyone
//!   has committed since it last knew the tables.
//!
//! Every sync renders the services it looks at and restores only the chains whose rules
//! differ from what was last written, as kube-proxy's partial syncs do: a sync that changes
//! nothing runs no restore, and one endpoint change rewrites that service's chains in one
//! atomic `iptables-restore --noflush`, whatever the number of services. The first sync
//! (chains and the jumps into them in one transaction), a sync after a failed restore, and
//! a periodic sync that finds our rules changed by someone else, or an hour after the last
//! one, rewrite everything. Rules are kept when the proxy stops (as kube-proxy does:
//! traffic keeps flowing through a restart) unless asked to remove them.

pub mod apply;
pub mod conntrack;
mod ctnetlink;
pub mod generation;
pub mod names;
pub mod render;
mod sync;

#[cfg(test)]
pub(crate) mod kube_tests;

use tracing::{info, warn};

pub use self::render::{Family, RenderConfig, Rendered, Table};
use self::{
    apply::{ApplyError, Jump, Runner, Tools},
    render::{
        KUBE_EXTERNAL_SERVICES, KUBE_FORWARD, KUBE_NODEPORTS, KUBE_POSTROUTING,
        KUBE_PROXY_FIREWALL, KUBE_SERVICES,
    },
    sync::FamilyState,
};
use super::{Dataplane, Scope, SyncReport};
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

pub struct IptablesDataplane {
    cfg: IptablesConfig,
    families: Vec<FamilyState>,
    restores: u64,
    /// The nf_tables generation at which every family's tables were known to hold what
    /// they last wrote (read back and checked, or written by us with no commit of anyone
    /// else between). One per namespace: every family's and table's commits move it.
    known_generation: Option<u32>,
    /// When every family's tables were last read back and checked (or rewritten whole).
    verified_at: Option<std::time::Instant>,
}

fn is_ours(t: Table, c: &str) -> bool {
    render::is_our_chain(t, c)
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
        let mut tools: Vec<Box<dyn Tools>> = Vec::new();
        let mut errors = Vec::new();
        for family in wanted {
            let runner = Runner::new(family, cfg.netns.clone()).with_backend(cfg.backend);
            match runner.save() {
                Ok(_) => tools.push(Box::new(runner)),
                Err(e) if cfg.families.is_empty() => {
                    warn!(?family, "not programming this family: {e}");
                    errors.push(e.to_string());
                }
                Err(e) => return Err(e.into()),
            }
        }
        if tools.is_empty() {
            return Err(IptablesError::NoFamily(errors.join("; ")));
        }
        Self::with_tools(cfg, tools)
    }

    /// The proxier over the given tools, one per family: the real ones ([`new`](Self::new)),
    /// or a model of the tables in unit tests.
    pub fn with_tools(
        cfg: IptablesConfig,
        tools: Vec<Box<dyn Tools>>,
    ) -> Result<Self, IptablesError> {
        let mut families = Vec::new();
        for tools in tools {
            let saved = tools.save()?;
            let version = tools.version().unwrap_or_default();
            let nft = match cfg.backend {
                apply::Backend::Nft => true,
                apply::Backend::Legacy => false,
                apply::Backend::System => version.contains("nf_tables"),
            };
            // Old nodes are where this mode runs: MASQUERADE --random-fully only where the
            // tools know it, as kube-proxy decides.
            let random_fully = apply::has_random_fully(&version);
            if !random_fully {
                info!(family = ?tools.family(), %version, "iptables too old for --random-fully; masquerading without it");
            }
            families.push(FamilyState::new(
                tools,
                nft,
                random_fully,
                sync::our_chains_in(&saved),
            ));
        }
        Ok(IptablesDataplane {
            cfg,
            families,
            restores: 0,
            known_generation: None,
            verified_at: None,
        })
    }

    /// How many restores have run: tests use it to see that unchanged syncs write nothing.
    pub fn restores(&self) -> u64 {
        self.restores
    }

    /// Whether the next periodic sync can skip reading the tables back: the tools are
    /// iptables-nft and nobody else has committed since the tables were known to hold our
    /// rules.
    pub fn tables_known_unchanged(&self) -> bool {
        self.known_generation.is_some() && self.known_generation == self.generation()
    }

    /// The namespace's nf_tables generation, which every family's commits move (None:
    /// some family's tools are legacy, or it cannot be read).
    fn generation(&self) -> Option<u32> {
        let mut generations = self.families.iter().map(|f| f.generation());
        let first = generations.next()??;
        generations.all(|g| g == Some(first)).then_some(first)
    }

    pub fn families(&self) -> Vec<Family> {
        self.families.iter().map(|f| f.tools.family()).collect()
    }

    /// Stops the proxier: removes our chains and jumps if configured to, else leaves them
    /// so that traffic keeps flowing until the next proxy takes over.
    pub fn shutdown(&mut self) {
        if !self.cfg.cleanup_on_exit {
            info!("leaving the iptables rules in place (no --cleanup-on-exit)");
            return;
        }
        for f in &self.families {
            let family = f.tools.family();
            match apply::remove_chains(f.tools.as_ref(), is_ours) {
                Ok(n) => info!(?family, chains = n, "removed our iptables chains"),
                Err(e) => warn!(?family, "cannot remove our iptables chains: {e}"),
            }
        }
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
        // Known again at the end only if this sync succeeds with no one else committing.
        let known = self.known_generation.take();
        let before = self.generation();
        let untouched = known.is_some()
            && known == before
            && self
                .verified_at
                .is_some_and(|t| t.elapsed() < sync::READ_BACK_MAX_AGE);
        let mut ok = true;
        for f in &mut self.families {
            match sync::sync_family(
                f,
                &self.cfg.render,
                state,
                node,
                changed,
                untouched,
                &mut self.restores,
            ) {
                Ok((w, r)) => {
                    report.frontends_written += w;
                    report.frontends_removed += r;
                }
                Err(e) => {
                    ok = false;
                    // One restore carries every service: they all stay as they were.
                    let msg = format!("{:?}: {e}", f.tools.family());
                    for k in &keys {
                        report.failed.push((k.clone(), msg.clone()));
                    }
                    if keys.is_empty() {
                        warn!("iptables sync failed: {msg}");
                    }
                }
            }
        }
        // The tables hold what we last wrote if they did before this sync (known, or read
        // back and checked, or rewritten whole, in every family) and the only commits since
        // were our restores'.
        let ours = self
            .families
            .iter()
            .try_fold(0u32, |n, f| Some(n.wrapping_add(f.commits?)));
        let read_back = self.families.iter().all(|f| f.verified);
        if ok && read_back {
            self.verified_at = Some(std::time::Instant::now());
        }
        let verified = untouched || read_back;
        self.known_generation = match (before, ours, self.generation()) {
            (Some(before), Some(ours), Some(after))
                if ok && verified && after == before.wrapping_add(ours) =>
            {
                Some(after)
            }
            _ => None,
        };
        report
    }
}
