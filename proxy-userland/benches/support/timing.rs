//! Shared by the benches: percentiles, and the per-attempt times `fastpath-probe` prints.
#![allow(dead_code)]

use std::time::Duration;

/// The `p` quantile (0.0-1.0) of sorted samples; zero for none.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// What one probe run measured: each successful attempt's own time (sorted), and how many
/// attempts failed.
pub struct Attempts {
    pub latencies: Vec<Duration>,
    pub failures: usize,
}

impl Attempts {
    /// Parses the probe's lines (`ok ... us=N` or `err ...`; `ns=N` where the probe gives
    /// it, as a connection of ~20 us is too short for whole microseconds).
    pub fn parse(output: &str) -> Self {
        Self::of_arm(output, None)
    }

    /// The two arms of a probe run with one `--alternate` and `--count count` (lines with
    /// `arm=0` or `arm=1`): (the probe's own target's, the other's). Err unless each arm
    /// reported every attempt, which a comparison needs.
    pub fn parse_pair(output: &str, count: usize) -> anyhow::Result<(Self, Self)> {
        let (own, other) = (Self::of_arm(output, Some(0)), Self::of_arm(output, Some(1)));
        for (arm, a) in [("first", &own), ("second", &other)] {
            let reported = a.latencies.len() + a.failures;
            anyhow::ensure!(
                reported == count,
                "the probe's {arm} arm reported {reported} of {count} attempts"
            );
        }
        Ok((own, other))
    }

    fn of_arm(output: &str, arm: Option<usize>) -> Self {
        let mut latencies = Vec::new();
        let mut failures = 0;
        for line in output.lines() {
            let field = |name: &str| line.split_whitespace().find_map(|w| w.strip_prefix(name));
            if arm.is_some() && field("arm=").and_then(|k| k.parse().ok()) != arm {
                continue;
            }
            if !line.starts_with("ok ") {
                failures += usize::from(line.starts_with("err "));
                continue;
            }
            let took = match (field("ns="), field("us=")) {
                (Some(ns), _) => Duration::from_nanos(ns.parse().unwrap_or(0)),
                (None, Some(us)) => Duration::from_micros(us.parse().unwrap_or(0)),
                (None, None) => continue,
            };
            latencies.push(took);
        }
        latencies.sort();
        Attempts {
            latencies,
            failures,
        }
    }

    /// Attempts per second of the attempts' own time (the probe's start-up does not count).
    pub fn rate(&self) -> f64 {
        let busy: Duration = self.latencies.iter().sum();
        if busy.is_zero() {
            0.0
        } else {
            self.latencies.len() as f64 / busy.as_secs_f64()
        }
    }

    pub fn p50(&self) -> Duration {
        percentile(&self.latencies, 0.5)
    }

    pub fn p99(&self) -> Duration {
        percentile(&self.latencies, 0.99)
    }
}

/// The smallest and the largest of some numbers (infinity and 0 for none).
pub fn spread(xs: &[f64]) -> (f64, f64) {
    (
        xs.iter().copied().fold(f64::INFINITY, f64::min),
        xs.iter().copied().fold(0.0, f64::max),
    )
}

/// The median of some numbers (sorted in place); zero for none.
pub fn median(xs: &mut [f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}
