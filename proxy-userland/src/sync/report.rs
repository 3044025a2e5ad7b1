//! The async side of the sync engine: what it reports goes to the admin state (health,
//! metrics), the health check node port servers and Kubernetes Events. All of it is quick
//! and non-blocking, so it runs on the runtime.

use std::sync::Arc;

use tokio::sync::mpsc;

use super::engine::{EngineEvent, SyncOutcome};
use crate::{
    admin::{AdminState, healthcheck::HealthCheckServers},
    events::{self as k8s_events, EventRecorder},
};

/// Where the engine's reports go.
pub struct Reports {
    pub admin: Arc<AdminState>,
    pub health_checks: HealthCheckServers,
    pub recorder: EventRecorder,
}

impl Reports {
    /// Applies the engine's reports until it stops (its channel closes). Returns the
    /// health check servers, so the caller decides when they close.
    pub async fn run(
        mut self,
        mut events: mpsc::UnboundedReceiver<EngineEvent>,
    ) -> HealthCheckServers {
        while let Some(ev) = events.recv().await {
            self.apply(ev);
        }
        self.health_checks
    }

    pub fn apply(&mut self, ev: EngineEvent) {
        match ev {
            EngineEvent::Received {
                pending,
                services_changed_total,
                endpoints_changed_total,
            } => {
                if pending {
                    self.admin.queued();
                }
                self.admin
                    .changes_seen(services_changed_total, endpoints_changed_total);
            }
            EngineEvent::Synced(outcome) => self.synced(*outcome),
            EngineEvent::Occupancy(o) => self.admin.metrics.set_occupancy(&o),
        }
    }

    fn synced(&mut self, outcome: SyncOutcome) {
        self.admin.synced(&outcome.record);
        self.admin.debug.publish(&outcome.state, &outcome.node);
        for (key, err) in &outcome.failed {
            let note = format!("cannot program the service: {err}; retrying");
            let regarding = EventRecorder::service_ref(key);
            self.recorder.warn(
                regarding,
                k8s_events::REASON_PROGRAM_FAILED,
                "Program",
                note,
            );
        }
        for (key, port, err) in self.health_checks.update(&outcome.health_checks) {
            let note = format!("cannot open health check node port {port}: {err}");
            let regarding = EventRecorder::service_ref(&key);
            let reason = k8s_events::REASON_PROGRAM_FAILED;
            self.recorder
                .warn(regarding, reason, "OpenHealthCheckNodePort", note);
        }
    }
}
