//! The proxy's own health, with kube-proxy's semantics (pkg/proxy/healthcheck/proxier_health.go).
//!
//! The proxy is healthy unless an update has been waiting too long: once a change is
//! queued, a sync must complete within the timeout (twice the sync period). A node with no
//! pending change is healthy however long ago it last synced, since there was nothing to do.
//! "Ready" is separate and simpler: the first sync has run, so Services work on this node.
//!
//! The node's eligibility (proxy_health.go SyncNode) is kept here too: a Node being deleted
//! or tainted `ToBeDeletedByClusterAutoscaler` turns /healthz (not /livez) to 503.

use std::{
    sync::Mutex,
    time::{Duration, SystemTime},
};

#[derive(Debug)]
pub struct ProxierHealth {
    timeout: Duration,
    state: Mutex<State>,
}

#[derive(Clone, Copy, Debug, Default)]
struct State {
    last_updated: Option<SystemTime>,
    oldest_pending: Option<SystemTime>,
    ready: bool,
    /// The Node says it is going away. Eligible until a Node event says otherwise, as
    /// kube-proxy (and always, without a Node to watch).
    node_ineligible: bool,
}

/// One answer of /healthz.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// The proxy keeps up with changes (what /livez reports).
    pub healthy: bool,
    pub last_updated: Option<SystemTime>,
    pub current_time: SystemTime,
    pub node_eligible: bool,
}

impl Status {
    /// The body kube-proxy's /healthz answers with.
    pub fn healthz_json(&self) -> String {
        serde_json::json!({
            "lastUpdated": self.reported_last_updated(self.healthy && self.node_eligible),
            "currentTime": rfc3339(self.current_time),
            "nodeEligible": self.node_eligible,
        })
        .to_string()
    }

    /// The body of /livez: the same without the node's eligibility, which it ignores.
    pub fn livez_json(&self) -> String {
        serde_json::json!({
            "lastUpdated": self.reported_last_updated(self.healthy),
            "currentTime": rfc3339(self.current_time),
        })
        .to_string()
    }
}

impl Status {
    /// kube-proxy's `lastUpdated`: the current time when the answer is 200 (older releases
    /// reported every sync loop run, even with nothing to do, and monitors watch the value
    /// for staleness), else the time of the last completed update.
    fn reported_last_updated(&self, answering_ok: bool) -> String {
        if answering_ok {
            return rfc3339(self.current_time);
        }
        self.last_updated
            .map_or_else(|| GO_ZERO_TIME.to_string(), rfc3339)
    }
}

/// What Go prints for a zero time.Time, which kube-proxy reports before its first sync.
const GO_ZERO_TIME: &str = "0001-01-01T00:00:00Z";

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

impl ProxierHealth {
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic elsewhere while holding the lock leaves plain data; keep serving it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A change arrived at `now` that a sync has still to program (kube-proxy's
    /// QueuedUpdate): only the oldest one counts.
    pub fn queued(&self, now: SystemTime) {
        let mut s = self.state();
        s.oldest_pending.get_or_insert(now);
    }

    /// A sync completed at `now` leaving nothing to retry (kube-proxy's Updated).
    pub fn updated(&self, now: SystemTime) {
        let mut s = self.state();
        s.last_updated = Some(now);
        s.oldest_pending = None;
    }

    /// The first sync has run.
    pub fn set_ready(&self) {
        self.state().ready = true;
    }

    pub fn is_ready(&self) -> bool {
        self.state().ready
    }

    /// Records the node's eligibility; true if it changed.
    pub fn set_node_eligible(&self, eligible: bool) -> bool {
        let mut s = self.state();
        let changed = s.node_ineligible == eligible;
        s.node_ineligible = !eligible;
        changed
    }

    pub fn status(&self, now: SystemTime) -> Status {
        let s = *self.state();
        let healthy = match s.oldest_pending {
            None => true,
            // A clock stepped backwards makes the wait negative: not overdue.
            Some(since) => now.duration_since(since).unwrap_or_default() < self.timeout,
        };
        Status {
            healthy,
            last_updated: s.last_updated,
            current_time: now,
            node_eligible: !s.node_ineligible,
        }
    }

    /// Whether the proxy keeps up (kube-proxy's IsHealthy: the node's state is ignored;
    /// health check node ports report this as serviceProxyHealthy).
    pub fn is_healthy(&self) -> bool {
        self.status(SystemTime::now()).healthy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
    }

    #[test]
    fn healthy_until_a_queued_change_waits_longer_than_the_timeout() {
        let h = ProxierHealth::new(Duration::from_secs(60));
        assert!(h.status(at(1000)).healthy, "nothing pending: healthy");
        h.queued(at(0));
        h.queued(at(50)); // the oldest pending change is what counts
        assert!(h.status(at(59)).healthy);
        let st = h.status(at(60));
        assert!(!st.healthy);
        assert_eq!(st.last_updated, None);
        h.updated(at(61));
        assert!(
            h.status(at(500)).healthy,
            "synced and nothing new: healthy forever"
        );
        assert_eq!(h.status(at(500)).last_updated, Some(at(61)));
    }

    #[test]
    fn a_clock_stepping_back_is_not_overdue() {
        let h = ProxierHealth::new(Duration::from_secs(60));
        h.queued(at(100));
        assert!(h.status(at(0)).healthy);
    }

    #[test]
    fn readiness_is_the_first_sync() {
        let h = ProxierHealth::new(Duration::from_secs(60));
        assert!(!h.is_ready());
        h.set_ready();
        assert!(h.is_ready());
    }

    #[test]
    fn the_body_has_kube_proxys_fields() {
        let status = Status {
            healthy: false,
            last_updated: None,
            current_time: at(0),
            node_eligible: false,
        };
        let v: serde_json::Value = serde_json::from_str(&status.healthz_json()).unwrap();
        assert_eq!(v["lastUpdated"], GO_ZERO_TIME);
        assert_eq!(v["currentTime"], "2023-11-14T22:13:20.000Z");
        assert_eq!(v["nodeEligible"], false);
        let v: serde_json::Value = serde_json::from_str(&status.livez_json()).unwrap();
        assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
    }
}
