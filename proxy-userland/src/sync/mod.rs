//! Turning model changes into dataplane syncs.
//!
//! - [`engine`]: the sync loop on a thread of its own: change tracker, bounded-frequency
//!   runner, retries and the dataplane, fed and read through channels.
//! - [`runner`]: the bounded-frequency schedule (kube-proxy's BoundedFrequencyRunner): at
//!   most one sync per min interval, at least one per max interval, retries after failures,
//!   and bursts of triggers coalesced into one sync.
//! - [`report`]: the async side's use of what the engine reports (health, metrics, health
//!   check node ports, Events).

pub mod engine;
pub(crate) mod local_policy;
pub mod report;
pub mod runner;

pub use engine::{Engine, EngineConfig, EngineEvent, SyncOutcome};
pub use runner::{BoundedFrequency, SyncPeriods};
