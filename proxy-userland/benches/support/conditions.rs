//! The bench's own conditions, checked around every measured run: a run whose number would
//! measure the bench or the machine rather than the dataplane is marked FAILED, with the
//! reason, instead of being reported.
//!
//! - failed connections or requests;
//! - the client namespace holding many of its ephemeral ports (TIME_WAIT and the like);
//! - the 1-minute load average, read from /proc/loadavg before and after, above a
//!   threshold (default: the number of CPUs, i.e. something waited for a CPU).
#![allow(dead_code)]

use std::process::Command;

/// A setting from the environment (`FASTPATH_BENCH_*`), or `default` when it is unset or
/// does not parse.
pub fn setting<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The 1-minute load average.
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

/// CPU time the hypervisor took from this VM ("steal", /proc/stat), in seconds summed over
/// the CPUs. `None` where the kernel does not say.
pub fn stolen_secs() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = stat.lines().next()?.strip_prefix("cpu ")?;
    let steal: u64 = cpu.split_whitespace().nth(7)?.parse().ok()?;
    // SAFETY: sysconf only reads a system value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| steal as f64 / hz as f64)
}

/// The share of the machine's CPU time the hypervisor took during `wall`, from two
/// [`stolen_secs`] readings, in percent.
pub fn stolen_percent(before: Option<f64>, after: Option<f64>, wall: std::time::Duration) -> f64 {
    match (before, after) {
        (Some(b), Some(a)) if wall.as_secs_f64() > 0.0 => {
            100.0 * (a - b).max(0.0) / (wall.as_secs_f64() * online_cpus() as f64)
        }
        _ => 0.0,
    }
}

/// The highest load a run may see: FASTPATH_BENCH_MAX_LOAD, or the number of CPUs.
pub fn max_load() -> f64 {
    std::env::var("FASTPATH_BENCH_MAX_LOAD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| online_cpus() as f64)
}

/// The machine's CPUs, whatever this process is pinned to (`available_parallelism`
/// counts only the CPUs it may run on, 1 after [`pin_to_one_cpu`]).
pub fn online_cpus() -> usize {
    // SAFETY: sysconf only reads a system value.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(1)
}

/// Pins this process, and so every process it starts after (clients, servers), to one CPU:
/// FASTPATH_BENCH_CPU, default the last one; `none` leaves placement to the scheduler.
///
/// On a VM, a connection whose client and server land on different vCPUs pays a cross-CPU
/// wake-up (an IPI, often a VM exit) that one on a single vCPU does not, and the scheduler
/// chooses anew for every run: rounds of the same path spread by 2x and two paths doing the
/// same work differ by tens of percent. On one CPU every path pays the same.
pub fn pin_to_one_cpu() -> Option<usize> {
    let cpus = online_cpus();
    let cpu = match std::env::var("FASTPATH_BENCH_CPU").ok().as_deref() {
        Some("none") => return None,
        Some(v) => v.parse().ok().filter(|&c| c < cpus)?,
        None => cpus - 1,
    };
    // SAFETY: cpu_set_t is plain data, zeroed is an empty set; CPU_SET writes within it
    // (cpu < CPU_SETSIZE, as cpu < the CPU count); sched_setaffinity only reads the set.
    let pinned = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    };
    if !pinned {
        eprintln!("bench: WARNING: could not pin to CPU {cpu}; placement is the scheduler's");
    }
    pinned.then_some(cpu)
}

/// How many ephemeral ports a namespace has (`ip_local_port_range`).
pub fn ephemeral_ports(netns: &str) -> usize {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            netns,
            "cat",
            "/proc/sys/net/ipv4/ip_local_port_range",
        ])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    let v: Vec<usize> = out
        .split_whitespace()
        .filter_map(|s| s.parse().ok())
        .collect();
    match v[..] {
        [lo, hi] if hi >= lo => hi - lo + 1,
        _ => 28_232, // the kernel's default range
    }
}

/// TCP sockets in a namespace (every state but LISTEN): what holds ephemeral ports.
pub fn tcp_sockets(netns: &str) -> usize {
    Command::new("ss")
        .args(["-N", netns, "-Htan", "state", "all", "exclude", "listening"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().count())
        .unwrap_or(0)
}

/// What one run saw of its own conditions.
#[derive(Clone, Debug, Default)]
pub struct Conditions {
    pub load_before: f64,
    pub load_after: f64,
    /// Sockets in the client namespace after the run, against its ephemeral ports.
    pub sockets_after: usize,
    pub ports: usize,
    pub failures: usize,
}

/// Watches one run: `start` before, `finish` after.
pub struct Watch {
    netns: Vec<String>,
    load_before: f64,
}

impl Watch {
    /// `netns`: the client namespaces whose ports the run uses.
    pub fn start(netns: &[&str]) -> Watch {
        Watch {
            netns: netns.iter().map(|s| s.to_string()).collect(),
            load_before: load_average(),
        }
    }

    pub fn finish(self, failures: usize) -> Conditions {
        let (mut sockets, mut ports) = (0, usize::MAX);
        for ns in &self.netns {
            sockets = sockets.max(tcp_sockets(ns));
            ports = ports.min(ephemeral_ports(ns));
        }
        Conditions {
            load_before: self.load_before,
            load_after: load_average(),
            sockets_after: sockets,
            ports: if ports == usize::MAX { 0 } else { ports },
            failures,
        }
    }
}

impl Conditions {
    /// Why the run is meaningless, if it is.
    pub fn problems(&self, max_load: f64) -> Vec<String> {
        let mut out = Vec::new();
        if self.failures > 0 {
            out.push(format!("{} failed", self.failures));
        }
        // A quarter of the range is far more than one run needs when connections close with
        // a reset; more means ports were piling up and the next runs would be starved.
        if self.ports > 0 && self.sockets_after * 4 > self.ports {
            out.push(format!(
                "{} sockets hold ports in the client namespace (of {})",
                self.sockets_after, self.ports
            ));
        }
        let load = self.load_before.max(self.load_after);
        if load > max_load {
            out.push(format!("load average {load:.2} > {max_load:.2}"));
        }
        out
    }
}
