//! Clients that count every request (`fastpath-probe load`), run on a node or outside, and
//! their reports: per client, requests, failures by error, the longest gap, the backends.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use super::Cluster;

/// One client's counts (see the probe's `load` module for the fields).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientReport {
    /// Where it ran (a node's name, or "outside").
    pub place: String,
    /// Its kind and target, e.g. `udp-connected 198.19.0.10:53`.
    pub name: String,
    pub requests: u64,
    pub ok: u64,
    pub failures: BTreeMap<String, u64>,
    pub longest_gap_ms: u64,
    pub last_failure_unix_ms: Option<u64>,
    pub backends: BTreeMap<String, u64>,
}

impl ClientReport {
    pub fn failed(&self) -> u64 {
        self.failures.values().sum()
    }

    /// The kind: the name's first word.
    pub fn kind(&self) -> &str {
        self.name.split_whitespace().next().unwrap_or_default()
    }
}

/// A running load process.
pub struct Load {
    pub place: String,
    pid: u32,
    out: PathBuf,
}

/// Parses one report line of the probe into its clients.
pub fn parse_report(place: &str, line: &str) -> Result<(bool, Vec<ClientReport>)> {
    let v: Value = serde_json::from_str(line).with_context(|| format!("report {line:?}"))?;
    let counts = |v: &Value| -> BTreeMap<String, u64> {
        v.as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, n)| (k.clone(), n.as_u64().unwrap_or(0)))
                    .collect()
            })
            .unwrap_or_default()
    };
    let clients = v["clients"]
        .as_array()
        .context("a report without clients")?
        .iter()
        .map(|c| ClientReport {
            place: place.to_string(),
            name: c["name"].as_str().unwrap_or_default().to_string(),
            requests: c["requests"].as_u64().unwrap_or(0),
            ok: c["ok"].as_u64().unwrap_or(0),
            failures: counts(&c["failures"]),
            longest_gap_ms: c["longest_gap_ms"].as_u64().unwrap_or(0),
            last_failure_unix_ms: c["last_failure_unix_ms"].as_u64(),
            backends: counts(&c["backends"]),
        })
        .collect();
    Ok((v["final"].as_bool().unwrap_or(false), clients))
}

impl Load {
    /// The latest report, if one came yet.
    pub fn latest(&self) -> Vec<ClientReport> {
        let text = fs::read_to_string(&self.out).unwrap_or_default();
        text.lines()
            .rev()
            .find_map(|l| parse_report(&self.place, l).ok())
            .map(|(_, c)| c)
            .unwrap_or_default()
    }

    /// Stops the clients (SIGTERM) and returns their final counts.
    pub fn finish(self, c: &mut Cluster) -> Result<Vec<ClientReport>> {
        c.bed.signal(self.pid, libc::SIGTERM)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = fs::read_to_string(&self.out).unwrap_or_default();
            if let Some(last) = text
                .lines()
                .filter_map(|l| parse_report(&self.place, l).ok())
                .find(|(f, _)| *f)
            {
                let _ = c.bed.stop(self.pid);
                return Ok(last.1);
            }
            if Instant::now() >= deadline {
                let _ = c.bed.stop(self.pid);
                bail!("the {} load clients gave no final report", self.place);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Cluster {
    /// Starts `fastpath-probe load` as `cmd` (from [`Cluster::probe_on`] or
    /// [`Cluster::probe_outside`]) with `clients` (`KIND=ADDR` specs), each sending a
    /// request every `interval`, for at most `duration`; `place` names where it runs in
    /// reports.
    pub fn start_load(
        &mut self,
        place: &str,
        mut cmd: Command,
        clients: &[String],
        interval: Duration,
        duration: Duration,
    ) -> Result<Load> {
        static RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let out = self.bed.dir().join(format!("load-{place}-{run}.jsonl"));
        cmd.arg("load")
            .args(clients.iter().flat_map(|c| ["--client", c.as_str()]))
            .arg(format!("--duration-ms={}", duration.as_millis()))
            .arg(format!("--interval-ms={}", interval.as_millis()))
            .arg("--report-ms=250")
            .stdout(fs::File::create(&out)?)
            .stderr(Stdio::inherit());
        let pid = self.bed.spawn(&mut cmd, Duration::from_secs(5))?;
        let load = Load {
            place: place.to_string(),
            pid,
            out,
        };
        // The first report says the clients run (a bad option ends the process at once).
        let deadline = Instant::now() + Duration::from_secs(10);
        while load.latest().is_empty() {
            if let Some(status) = self.bed.try_wait(pid)? {
                bail!("the {place} load clients exited at start ({status})");
            }
            if Instant::now() >= deadline {
                bail!("the {place} load clients gave no report within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(load)
    }
}

/// A table of client reports: one row per client, with failures by error.
pub fn table(reports: &[ClientReport]) -> String {
    let mut out = format!(
        "{:<8} {:<44} {:>8} {:>7} {:>8}  {}\n",
        "where", "client", "requests", "failed", "gap ms", "failures by error / backends"
    );
    for r in reports {
        let failures: Vec<String> = r.failures.iter().map(|(e, n)| format!("{e}={n}")).collect();
        let detail = if failures.is_empty() {
            format!("{} backends", r.backends.len())
        } else {
            failures.join(" ")
        };
        let _ = writeln!(
            out,
            "{:<8} {:<44} {:>8} {:>7} {:>8}  {detail}",
            r.place,
            r.name,
            r.requests,
            r.failed(),
            r.longest_gap_ms
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_report_line_parses() {
        let line = r#"{"final":true,"clients":[{"name":"udp 198.19.0.10:53","requests":5,"ok":4,"failures":{"ETIMEDOUT":1},"longest_gap_ms":1020,"last_failure_unix_ms":17,"backends":{"web-g1-1":4}}]}"#;
        let (last, clients) = parse_report("node-1", line).unwrap();
        assert!(last);
        assert_eq!(clients.len(), 1);
        let c = &clients[0];
        assert_eq!((c.requests, c.ok, c.failed()), (5, 4, 1));
        assert_eq!(c.kind(), "udp");
        assert_eq!(c.last_failure_unix_ms, Some(17));
        assert!(table(&clients).contains("ETIMEDOUT=1"));
        assert!(parse_report("x", "not json").is_err());
    }
}
