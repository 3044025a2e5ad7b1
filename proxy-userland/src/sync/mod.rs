//! Turning model changes into dataplane syncs.
//!
//! - [`runner`]: the bounded-frequency schedule (kube-proxy's BoundedFrequencyRunner): at
//!   most one sync per min interval, at least one per max interval, retries after failures,
//!   and bursts of triggers coalesced into one sync.

pub mod runner;

pub use runner::{BoundedFrequency, SyncPeriods};
