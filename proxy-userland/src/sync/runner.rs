//! The bounded-frequency schedule, as pure logic over `Instant`s so it is testable without
//! sleeping. The daemon asks [`BoundedFrequency::next_run`] when to wake up and tells it
//! when a sync ran and whether it failed.

use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncPeriods {
    /// No two syncs closer than this; triggers in between are coalesced.
    pub min: Duration,
    /// A full resync at least this often, changes or not.
    pub max: Duration,
    /// After a failed sync, try again this soon (but never sooner than `min`).
    pub retry: Duration,
}

impl Default for SyncPeriods {
    fn default() -> Self {
        Self {
            min: Duration::ZERO,
            max: Duration::from_secs(30),
            retry: Duration::from_secs(1),
        }
    }
}

/// Why a sync is due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Due {
    /// Something changed: sync what changed.
    Changes,
    /// A retry after a failure: sync what failed, plus any changes.
    Retry,
    /// The max interval passed: sync everything.
    Periodic,
}

#[derive(Debug)]
pub struct BoundedFrequency {
    periods: SyncPeriods,
    last_run: Option<Instant>,
    last_full: Instant,
    pending: bool,
    retry_at: Option<Instant>,
}

impl BoundedFrequency {
    pub fn new(periods: SyncPeriods, now: Instant) -> Self {
        Self {
            periods,
            last_run: None,
            last_full: now,
            pending: false,
            retry_at: None,
        }
    }

    /// Something changed. Many calls before the next run still cost one run.
    pub fn trigger(&mut self) {
        self.pending = true;
    }

    pub fn is_pending(&self) -> bool {
        self.pending || self.retry_at.is_some()
    }

    /// When the next sync should start, and why.
    pub fn next_run(&self) -> (Instant, Due) {
        let earliest = self
            .last_run
            .map_or(self.last_full, |t| t + self.periods.min);
        let periodic = self.last_full + self.periods.max;
        let mut next = (periodic, Due::Periodic);
        if let Some(at) = self.retry_at {
            let at = at.max(earliest);
            if at < next.0 {
                next = (at, Due::Retry);
            }
        }
        if self.pending && earliest <= next.0 {
            next = (earliest, Due::Changes);
        }
        next
    }

    /// A sync of kind `due` started at `started` has finished; `failed` if any part of it
    /// must be retried.
    pub fn ran(&mut self, due: Due, started: Instant, failed: bool) {
        self.last_run = Some(started);
        self.pending = false;
        if due == Due::Periodic {
            self.last_full = started;
        }
        self.retry_at = failed.then(|| started + self.periods.retry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn periods() -> SyncPeriods {
        SyncPeriods {
            min: Duration::from_secs(1),
            max: Duration::from_secs(30),
            retry: Duration::from_secs(5),
        }
    }

    #[test]
    fn a_burst_of_triggers_costs_one_run() {
        let t0 = Instant::now();
        let mut r = BoundedFrequency::new(periods(), t0);
        for _ in 0..100 {
            r.trigger();
        }
        assert_eq!(r.next_run(), (t0, Due::Changes));
        r.ran(Due::Changes, t0, false);
        assert!(!r.is_pending());
        assert_eq!(r.next_run(), (t0 + Duration::from_secs(30), Due::Periodic));
    }

    #[test]
    fn runs_are_at_least_min_apart() {
        let t0 = Instant::now();
        let mut r = BoundedFrequency::new(periods(), t0);
        r.trigger();
        r.ran(Due::Changes, t0, false);
        r.trigger();
        assert_eq!(r.next_run(), (t0 + Duration::from_secs(1), Due::Changes));
    }

    #[test]
    fn failure_schedules_a_retry_and_changes_do_not_wait_for_it() {
        let t0 = Instant::now();
        let mut r = BoundedFrequency::new(periods(), t0);
        r.trigger();
        r.ran(Due::Changes, t0, true);
        assert_eq!(r.next_run(), (t0 + Duration::from_secs(5), Due::Retry));
        r.trigger();
        assert_eq!(r.next_run(), (t0 + Duration::from_secs(1), Due::Changes));
        r.ran(Due::Changes, t0 + Duration::from_secs(1), false);
        assert!(!r.is_pending());
    }

    #[test]
    fn periodic_resync_happens_without_changes() {
        let t0 = Instant::now();
        let mut r = BoundedFrequency::new(periods(), t0);
        let (at, due) = r.next_run();
        assert_eq!((at, due), (t0 + Duration::from_secs(30), Due::Periodic));
        r.ran(due, at, false);
        assert_eq!(r.next_run(), (at + Duration::from_secs(30), Due::Periodic));
    }
}
