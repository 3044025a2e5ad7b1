//! `fastpath-probe tcp ADDR --alternate NETNS=ADDR ...`: attempts that take turns between
//! several (network namespace, address) "arms", so that a benchmark comparing two paths
//! measures both in the same moments.
//!
//! Separate runs of each path, even interleaved round by round, leave every run at the
//! mercy of what the machine does during it: on a VM, runs of one path a second apart
//! differ by up to 2x, far more than the few percent a comparison must resolve. Taking
//! turns attempt by attempt, a slow moment falls on both arms alike. The turns go A B, B A,
//! A B, ..., so neither arm always follows the other.
//!
//! The namespace (and, where an arm names one, the cgroup) is switched between attempts,
//! outside the timed part: a socket belongs to the namespace its thread was in when it was
//! made, and to the cgroup its process was in, which decides which socket programs see it.

use std::{
    fs::File,
    io::{self, Write as _},
    net::SocketAddr,
    path::{Path, PathBuf},
    str::FromStr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use super::{enter_netns, join_cgroup, open_netns, valid_netns_name};

/// One `--alternate` value, `NETNS=ADDR[@CGROUP]`: where the attempt's socket lives (and,
/// with `@CGROUP`, the cgroup v2 it is made in) and what it dials.
#[derive(Debug, Clone)]
pub struct ArmSpec {
    pub netns: String,
    pub addr: SocketAddr,
    pub cgroup: Option<PathBuf>,
}

impl FromStr for ArmSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (netns, rest) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: expected NETNS=ADDR:PORT[@CGROUP]"))?;
        let (addr, cgroup) = match rest.split_once('@') {
            Some((addr, cgroup)) if !cgroup.is_empty() => (addr, Some(PathBuf::from(cgroup))),
            Some(_) => return Err(format!("{s:?}: an empty cgroup after '@'")),
            None => (rest, None),
        };
        if !valid_netns_name(netns) {
            return Err(format!("bad network namespace name {netns:?}"));
        }
        let addr = addr
            .parse()
            .map_err(|e| format!("{addr:?}: not an address and port ({e})"))?;
        Ok(ArmSpec {
            netns: netns.to_string(),
            addr,
            cgroup,
        })
    }
}

struct Arm {
    netns: File,
    addr: SocketAddr,
    /// The arm's cgroup, where arms differ in cgroup.
    cgroup: Option<PathBuf>,
}

/// How many turns, and each attempt's time limit.
pub struct Turns {
    /// Rounds in which every arm makes one attempt (`--count`).
    pub rounds: u32,
    pub timeout: Duration,
    /// Pause between rounds.
    pub interval: Duration,
}

/// `turns.rounds` rounds; in each, every arm makes one attempt (`attempt` given the
/// address), printed as the attempt's line followed by `arm=K ns=N us=N` (K: 0 for ADDR in
/// the namespace and cgroup (`own_cgroup`, the probe's `--cgroup`) the probe started in,
/// then the `--alternate` arms in order).
pub fn run(
    addr: SocketAddr,
    own_cgroup: Option<&Path>,
    others: &[ArmSpec],
    turns: &Turns,
    mut attempt: impl FnMut(SocketAddr, Duration) -> String,
) -> Result<()> {
    let switches_cgroup = others.iter().any(|o| o.cgroup.is_some());
    if switches_cgroup && own_cgroup.is_none() {
        bail!("an --alternate arm names a cgroup: the probe needs --cgroup for its own arm");
    }
    let cgroup = |arm: Option<&Path>| {
        switches_cgroup
            .then(|| arm.or(own_cgroup).map(Path::to_path_buf))
            .flatten()
    };
    let mut arms = vec![Arm {
        netns: File::open("/proc/self/ns/net")
            .context("opening this process's network namespace")?,
        addr,
        cgroup: cgroup(None),
    }];
    for spec in others {
        arms.push(Arm {
            netns: open_netns(&spec.netns)?,
            addr: spec.addr,
            cgroup: cgroup(spec.cgroup.as_deref()),
        });
    }
    let mut stdout = io::stdout().lock();
    let mut order: Vec<usize> = (0..arms.len()).collect();
    for round in 0..turns.rounds {
        if round > 0 {
            order.reverse();
            if !turns.interval.is_zero() {
                std::thread::sleep(turns.interval);
            }
        }
        for &k in &order {
            let arm = &arms[k];
            enter(arm).with_context(|| format!("entering the namespace of arm {k}"))?;
            let started = Instant::now();
            let line = attempt(arm.addr, turns.timeout);
            let took = started.elapsed();
            let written = writeln!(
                stdout,
                "{line} arm={k} ns={} us={}",
                took.as_nanos(),
                took.as_micros()
            );
            if written.and_then(|()| stdout.flush()).is_err() {
                return Ok(()); // stdout closed: nobody is listening
            }
        }
    }
    Ok(())
}

fn enter(arm: &Arm) -> Result<()> {
    if let Some(cgroup) = &arm.cgroup {
        join_cgroup(cgroup)?;
    }
    Ok(enter_netns(&arm.netns)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arm_specs_parse_or_say_what_is_wrong() {
        let arm: ArmSpec = "bench-p-client=198.18.1.11:8080".parse().unwrap();
        assert_eq!(arm.netns, "bench-p-client");
        assert_eq!(arm.addr, "198.18.1.11:8080".parse().unwrap());
        let v6: ArmSpec = "ns=[2001:db8::1]:80".parse().unwrap();
        assert_eq!(v6.addr.port(), 80);
        assert_eq!(v6.cgroup, None);
        let hooked: ArmSpec = "ns=198.18.1.11:80@/sys/fs/cgroup/x".parse().unwrap();
        assert_eq!(
            hooked.cgroup.as_deref(),
            Some(Path::new("/sys/fs/cgroup/x"))
        );
        for bad in [
            "198.18.1.11:8080",
            "=198.18.1.11:80",
            "../x=198.18.1.11:80",
            "ns=nope",
            "ns=198.18.1.11:80@",
        ] {
            assert!(bad.parse::<ArmSpec>().is_err(), "{bad} parsed");
        }
    }
}
