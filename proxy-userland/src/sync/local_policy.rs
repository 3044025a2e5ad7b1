//! What the Local traffic policies need after each sync (health check ports with their
//! local endpoint counts, and kube-proxy's no-local-endpoints counts), kept between syncs.
//!
//! Both were computed by walking every service after every sync: at 10,000 services that
//! was a quarter of the sync engine's time, ~0.3 ms added to every change. Now a partial
//! sync recomputes only the services it changed; a full sync (which a node change also
//! brings) recomputes all.

use std::collections::{BTreeMap, BTreeSet};

use crate::{
    admin::healthcheck::{self, Desired, NoLocalEndpoints},
    model::{NodeInfo, ProxyState, ServiceKey},
};

/// The per-service results of the last computation and their totals.
#[derive(Default)]
pub struct LocalPolicy {
    /// Only services that count towards something: most have no Local policy.
    counted: BTreeMap<ServiceKey, NoLocalEndpoints>,
    totals: NoLocalEndpoints,
    health_checks: Desired,
}

impl LocalPolicy {
    /// Brings the results up to `state`: for `changed` services, or every one (`None`).
    pub fn update(
        &mut self,
        state: &ProxyState,
        node: &NodeInfo,
        changed: Option<&BTreeSet<ServiceKey>>,
    ) {
        let Some(changed) = changed else {
            *self = Self::default();
            for key in state.services.keys() {
                self.recompute(state, node, key);
            }
            return;
        };
        for key in changed {
            self.recompute(state, node, key);
        }
    }

    fn recompute(&mut self, state: &ProxyState, node: &NodeInfo, key: &ServiceKey) {
        if let Some(before) = self.counted.remove(key) {
            self.totals -= before;
        }
        self.health_checks.remove(key);
        let Some(svc) = state.services.get(key) else {
            return;
        };
        let set = state.endpoints.get(key).map(|s| &**s);
        let counts = healthcheck::service_no_local_endpoints(svc, set, node);
        if counts != NoLocalEndpoints::default() {
            self.totals += counts;
            self.counted.insert(key.clone(), counts);
        }
        if let Some(hc) = healthcheck::health_check(svc, set, node) {
            self.health_checks.insert(key.clone(), hc);
        }
    }

    pub fn no_local_endpoints(&self) -> NoLocalEndpoints {
        self.totals
    }

    pub fn health_checks(&self) -> &Desired {
        &self.health_checks
    }
}
