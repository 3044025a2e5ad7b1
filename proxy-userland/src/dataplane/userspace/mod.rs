//! The userspace proxier: kube-proxy's oldest mode, for nodes that can run neither eBPF nor
//! the iptables proxier's matches. Each service frontend (cluster IP, port, protocol) gets a
//! relay listening on a local port; iptables REDIRECT rules (the "portals") send the
//! frontend's traffic to it, and the relay connects to a backend itself.
//!
//! - [`balancer`]: round robin and ClientIP affinity.
//! - [`relay`]: the TCP and UDP relays, on their own thread and runtime.
//! - [`portals`]: the REDIRECT rules.
//!
//! Slower than the other modes (every byte crosses userspace) and the backends see the
//! node's address as the client; it serves IPv4 cluster IPs over TCP and UDP only (no node
//! ports, external IPs or traffic policies beyond what the frontends' backend lists carry).

pub mod balancer;
pub mod portals;
pub mod relay;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
};

use tracing::{info, warn};

use self::{
    portals::Portal,
    relay::{RelayConfig, RelayError, Relays},
};
use super::{
    Dataplane, Scope, SyncReport,
    frontends::{DesiredFrontend, Frontend, desired_frontends},
    iptables::{
        Family,
        apply::{self, ApplyError, Runner},
    },
};
use crate::model::{NodeInfo, Protocol, ProxyState, ServiceKey};

#[derive(Debug, thiserror::Error)]
pub enum UserspaceError {
    #[error("{0}")]
    Relay(#[from] RelayError),
    #[error("{0}")]
    Apply(#[from] ApplyError),
}

#[derive(Clone, Debug, Default)]
pub struct UserspaceConfig {
    /// Make the relays' sockets and run iptables in this network namespace.
    pub netns: Option<String>,
    pub relay: RelayConfig,
    /// Remove the portal chains on shutdown (they point at relays that are gone then, so
    /// this is usually wanted; kept optional for symmetry with the iptables proxier).
    pub cleanup_on_exit: bool,
}

struct Open {
    owner: ServiceKey,
    port: u16,
    desired: DesiredFrontend,
}

pub struct UserspaceDataplane {
    cfg: UserspaceConfig,
    relays: Relays,
    runner: Runner,
    open: BTreeMap<Frontend, Open>,
    last_text: Option<String>,
    restores: u64,
}

fn backend_addrs(d: &DesiredFrontend) -> Vec<SocketAddr> {
    d.backends
        .iter()
        .map(|b| SocketAddr::new(b.ip, b.port))
        .collect()
}

fn relayable(fe: &Frontend) -> bool {
    fe.ip.is_ipv4() && matches!(fe.proto, Protocol::Tcp | Protocol::Udp)
}

impl UserspaceDataplane {
    pub fn new(cfg: UserspaceConfig) -> Result<Self, UserspaceError> {
        let runner = Runner::new(Family::V4, cfg.netns.clone());
        // Fails early, with iptables' own message, if the tables cannot be used.
        runner.save()?;
        let relays = Relays::start(cfg.netns.clone(), cfg.relay)?;
        Ok(UserspaceDataplane {
            cfg,
            relays,
            runner,
            open: BTreeMap::new(),
            last_text: None,
            restores: 0,
        })
    }

    /// The local port relaying `fe`, if one is open.
    pub fn relay_port(&self, fe: &Frontend) -> Option<u16> {
        self.open.get(fe).map(|o| o.port)
    }

    pub fn relays(&self) -> &Relays {
        &self.relays
    }

    pub fn restores(&self) -> u64 {
        self.restores
    }

    /// Stops the relays; removes the portals if configured to.
    pub fn shutdown(&mut self) {
        if self.cfg.cleanup_on_exit {
            match apply::remove_chains(&self.runner, portals::is_userspace_chain) {
                Ok(_) => info!("removed the userspace portal chains"),
                Err(e) => warn!("cannot remove the userspace portal chains: {e}"),
            }
        }
        for fe in self.open.keys() {
            let _ = self.relays.close(*fe);
        }
        self.open.clear();
    }
}

impl Dataplane for UserspaceDataplane {
    fn name(&self) -> &'static str {
        "userspace"
    }

    fn sync(&mut self, state: &ProxyState, node: &NodeInfo, scope: Scope<'_>) -> SyncReport {
        let mut report = SyncReport::default();
        let keys: BTreeSet<ServiceKey> = match scope {
            Scope::Full => state
                .services
                .keys()
                .chain(self.open.values().map(|o| &o.owner))
                .cloned()
                .collect(),
            Scope::Changed(set) => set.clone(),
        };
        report.services_synced = keys.len();
        let mut failed: BTreeMap<ServiceKey, String> = BTreeMap::new();
        let mut to_close = Vec::new();

        for key in &keys {
            let desired: BTreeMap<Frontend, DesiredFrontend> = state
                .services
                .get(key)
                .map(|svc| desired_frontends(svc, state.endpoints.get(key).map(|e| &**e), node))
                .unwrap_or_default()
                .into_iter()
                .filter(|(fe, _)| relayable(fe))
                .collect();
            for (fe, want) in &desired {
                match self.open.get_mut(fe) {
                    Some(o) if o.owner != *key => {
                        failed.insert(
                            key.clone(),
                            format!("{fe} is already used by service {}", o.owner),
                        );
                    }
                    Some(o) => {
                        if o.desired != *want {
                            match self.relays.update(
                                *fe,
                                backend_addrs(want),
                                want.affinity_timeout,
                            ) {
                                Ok(()) => {
                                    o.desired = want.clone();
                                    report.frontends_written += 1;
                                }
                                Err(e) => {
                                    failed.insert(key.clone(), e.to_string());
                                }
                            }
                        }
                    }
                    None => match self
                        .relays
                        .open(*fe, backend_addrs(want), want.affinity_timeout)
                    {
                        Ok(port) => {
                            self.open.insert(
                                *fe,
                                Open {
                                    owner: key.clone(),
                                    port,
                                    desired: want.clone(),
                                },
                            );
                            report.frontends_written += 1;
                        }
                        Err(e) => {
                            failed.insert(key.clone(), e.to_string());
                        }
                    },
                }
            }
            let stale: Vec<Frontend> = self
                .open
                .iter()
                .filter(|(fe, o)| o.owner == *key && !desired.contains_key(fe))
                .map(|(fe, _)| *fe)
                .collect();
            for fe in stale {
                self.open.remove(&fe);
                to_close.push(fe);
                report.frontends_removed += 1;
            }
        }

        let portals: Vec<Portal> = self
            .open
            .iter()
            .map(|(fe, o)| Portal {
                service: o.owner.to_string(),
                frontend: *fe,
                relay_port: o.port,
                has_endpoints: !o.desired.backends.is_empty(),
            })
            .collect();
        let text = portals::render(&portals, state.service_ranges.cidrs());
        let mut write = self.last_text.as_deref() != Some(text.as_str());
        let mut saved = None;
        if matches!(scope, Scope::Full) || self.last_text.is_none() {
            match self.runner.save() {
                Ok(s) => {
                    write |= portals::JUMPS.iter().any(|j| !j.present_in(&s));
                    saved = Some(s);
                }
                Err(e) => warn!("cannot read the nat table: {e}"),
            }
        }
        let mut result: Result<(), ApplyError> = Ok(());
        if write {
            result = self.runner.restore(&text);
            if result.is_ok() {
                self.restores += 1;
                self.last_text = Some(text);
            }
        }
        if result.is_ok()
            && let Some(s) = saved
        {
            result = apply::ensure_jumps(&self.runner, portals::JUMPS, &s).map(drop);
        }
        if let Err(e) = result {
            for k in &keys {
                failed.entry(k.clone()).or_insert_with(|| e.to_string());
            }
        }
        // Only once no rule points at them any more.
        for fe in to_close {
            let _ = self.relays.close(fe);
        }
        report.failed = failed.into_iter().collect();
        report
    }
}
