//! Kubernetes Events for what an operator should see on the object itself (`kubectl
//! describe service`): a Service or EndpointSlice fastpath cannot read, a Service it cannot
//! program. Published through kube-rs's events Recorder (events.k8s.io/v1) when the
//! daemon watches a cluster; with manifests there is no cluster, and the recorder does
//! nothing (the log line that accompanies each event is still written).
//!
//! Publishing never blocks the caller: each event is sent from its own task. The same
//! event for the same object is sent at most once per [`REPEAT_AFTER`], since failed
//! services are retried every second or so and each retry would otherwise be an API call.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tracing::{debug, warn};

use crate::model::ServiceKey;

/// How soon the same event about the same object is published again.
pub const REPEAT_AFTER: Duration = Duration::from_secs(300);
/// Events hold at most 1 kB of note.
const MAX_NOTE: usize = 1000;
/// Above this many remembered events, forget the expired ones.
const MAX_REMEMBERED: usize = 1024;

/// Reasons, in the API's PascalCase.
pub const REASON_INVALID: &str = "FastpathInvalidObject";
pub const REASON_PROGRAM_FAILED: &str = "FastpathProgrammingFailed";

#[derive(Clone, Default)]
pub struct EventRecorder {
    inner: Option<Arc<Inner>>,
}

struct Inner {
    recorder: Recorder,
    recent: Dedup,
    warned: AtomicBool,
}

impl EventRecorder {
    /// Records nothing (the manifest source).
    pub fn disabled() -> Self {
        Self::default()
    }

    /// Publishes as controller "fastpath", instance `node` (which node said it).
    pub fn new(client: Client, node: &str) -> Self {
        let reporter = Reporter {
            controller: "fastpath".into(),
            instance: Some(node.to_string()),
        };
        Self {
            inner: Some(Arc::new(Inner {
                recorder: Recorder::new(client, reporter),
                recent: Dedup::default(),
                warned: AtomicBool::new(false),
            })),
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// A reference to a v1 Service, for events about a service known only by its key.
    pub fn service_ref(key: &ServiceKey) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Service".into()),
            namespace: Some(key.namespace.to_string()),
            name: Some(key.name.to_string()),
            ..Default::default()
        }
    }

    /// Publishes a Warning about `regarding`, unless the same one went out recently.
    /// Must be called inside the runtime.
    pub fn warn(
        &self,
        regarding: ObjectReference,
        reason: &'static str,
        action: &'static str,
        note: String,
    ) {
        let Some(inner) = &self.inner else { return };
        let object = format!(
            "{}/{}/{}",
            regarding.kind.as_deref().unwrap_or(""),
            regarding.namespace.as_deref().unwrap_or(""),
            regarding.name.as_deref().unwrap_or("")
        );
        if !inner
            .recent
            .first_in_a_while((object.clone(), reason, note.clone()), Instant::now())
        {
            return;
        }
        let event = Event {
            type_: EventType::Warning,
            reason: reason.into(),
            note: Some(truncate(note, MAX_NOTE)),
            action: action.into(),
            secondary: None,
        };
        let inner = inner.clone();
        tokio::spawn(async move {
            if let Err(e) = inner.recorder.publish(&event, &regarding).await {
                // Usually RBAC: say so once, loudly, then quietly.
                if !inner.warned.swap(true, Ordering::Relaxed) {
                    warn!(%object, "cannot publish a Kubernetes Event ({e}); check the events RBAC rules");
                } else {
                    debug!(%object, "cannot publish a Kubernetes Event: {e}");
                }
            }
        });
    }
}

/// Remembers what was sent when, by (object, reason, note).
#[derive(Default)]
struct Dedup(Mutex<HashMap<(String, &'static str, String), Instant>>);

impl Dedup {
    fn first_in_a_while(&self, key: (String, &'static str, String), now: Instant) -> bool {
        let mut recent = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if recent.len() > MAX_REMEMBERED {
            recent.retain(|_, at| now.duration_since(*at) < REPEAT_AFTER);
        }
        match recent.get(&key) {
            Some(at) if now.duration_since(*at) < REPEAT_AFTER => false,
            _ => {
                recent.insert(key, now);
                true
            }
        }
    }
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disabled_recorder_does_nothing_even_outside_a_runtime() {
        let r = EventRecorder::disabled();
        assert!(!r.is_enabled());
        r.warn(
            EventRecorder::service_ref(&ServiceKey::new("a", "b")),
            REASON_INVALID,
            "Convert",
            "x".into(),
        );
    }

    #[test]
    fn the_same_event_is_sent_once_per_window() {
        let d = Dedup::default();
        let t0 = Instant::now();
        let key = || {
            (
                "Service/demo/web".to_string(),
                REASON_PROGRAM_FAILED,
                "map full".to_string(),
            )
        };
        assert!(d.first_in_a_while(key(), t0));
        assert!(!d.first_in_a_while(key(), t0 + Duration::from_secs(1)));
        let other = (
            "Service/demo/web".to_string(),
            REASON_PROGRAM_FAILED,
            "other".to_string(),
        );
        assert!(
            d.first_in_a_while(other, t0 + Duration::from_secs(1)),
            "a different note is news"
        );
        assert!(d.first_in_a_while(key(), t0 + REPEAT_AFTER));
    }

    #[test]
    fn notes_are_cut_at_a_character_boundary() {
        assert_eq!(truncate("ééé".into(), 3), "é");
        assert_eq!(truncate("abc".into(), 10), "abc");
    }

    #[test]
    fn service_refs_name_the_v1_service() {
        let r = EventRecorder::service_ref(&ServiceKey::new("demo", "web"));
        assert_eq!(
            (r.kind.as_deref(), r.namespace.as_deref(), r.name.as_deref()),
            (Some("Service"), Some("demo"), Some("web"))
        );
    }
}
