//! Running iptables: atomic restores of our chains, reading the tables back, the jump rules
//! from the built-in chains, and removing our chains again.
//!
//! Every command can run in another network namespace (see [`crate::dataplane::netns`]).
//! Restores use `--noflush`, so only the chains named in the input are replaced; everything
//! else in the tables (the node's own firewall, CNI rules) is left as it is.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write as _,
    net::IpAddr,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use super::{
    conntrack::{self, Deleted, Flow},
    ctnetlink,
    render::{Family, Table},
};
use crate::dataplane::netns;

/// How long iptables may wait for the xtables lock (legacy backend) before failing.
const LOCK_WAIT_SECS: &str = "5";
/// Upper bound for any one iptables command; a hung one is killed.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("cannot run `{command}`: {source} (is its package installed?)")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("`{command}` did not finish within {COMMAND_TIMEOUT:?} and was killed")]
    Timeout { command: String },
    #[error("{what} over netlink: {source}")]
    Netlink {
        what: &'static str,
        source: std::io::Error,
    },
}

/// Which implementation of the iptables tools to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// `iptables`, whichever the system's alternatives point at.
    #[default]
    System,
    /// `iptables-legacy`: the x_tables kernel interface.
    Legacy,
    /// `iptables-nft`: nf_tables underneath.
    Nft,
}

/// The iptables tools of one family, optionally in a network namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Runner {
    pub family: Family,
    pub netns: Option<String>,
    pub backend: Backend,
}

fn describe(cmd: &Command) -> String {
    let mut out = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        out.push(' ');
        out.push_str(&a.to_string_lossy());
    }
    out
}

impl Runner {
    pub fn new(family: Family, netns: Option<String>) -> Self {
        Runner {
            family,
            netns,
            backend: Backend::System,
        }
    }

    pub fn with_backend(self, backend: Backend) -> Self {
        Runner { backend, ..self }
    }

    fn tool(&self, suffix: &str) -> Command {
        let base = match self.family {
            Family::V4 => "iptables",
            Family::V6 => "ip6tables",
        };
        let backend = match self.backend {
            Backend::System => "",
            Backend::Legacy => "-legacy",
            Backend::Nft => "-nft",
        };
        netns::command(self.netns.as_deref(), format!("{base}{backend}{suffix}"))
    }

    fn run(&self, cmd: Command, input: Option<&str>) -> Result<String, ApplyError> {
        run_bounded(cmd, input)
    }

    /// `iptables-restore --noflush`: the whole input is applied in one transaction, or not
    /// at all.
    pub fn restore(&self, text: &str) -> Result<(), ApplyError> {
        let mut cmd = self.tool("-restore");
        cmd.args(["-w", LOCK_WAIT_SECS, "--noflush"]);
        self.run(cmd, Some(text)).map(drop)
    }

    /// `iptables-save` of every table, parsed.
    pub fn save(&self) -> Result<Saved, ApplyError> {
        self.run(self.tool("-save"), None).map(|s| Saved::parse(&s))
    }

    /// `iptables -t TABLE ARGS...`.
    pub fn iptables(&self, table: Table, args: &[String]) -> Result<String, ApplyError> {
        let mut cmd = self.tool("");
        cmd.args(["-w", LOCK_WAIT_SECS, "-t", table.name()])
            .args(args);
        self.run(cmd, None)
    }

    /// `iptables --version`, e.g. "iptables v1.8.9 (nf_tables)".
    pub fn version(&self) -> Result<String, ApplyError> {
        let mut cmd = self.tool("");
        cmd.arg("--version");
        self.run(cmd, None).map(|s| s.trim().to_string())
    }

    fn family_flag(&self) -> &'static str {
        match self.family {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        }
    }
}

/// Runs `cmd` with `input` on stdin, bounded by [`COMMAND_TIMEOUT`]; stdout on success.
/// Any tool the proxier runs goes through here (iptables, and nft/ipset for other modes'
/// leftovers), so none can hang a sync or the start.
pub fn run_bounded(mut cmd: Command, input: Option<&str>) -> Result<String, ApplyError> {
    let command = describe(&cmd);
    let mut child = cmd
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| ApplyError::Spawn {
            command: command.clone(),
            source,
        })?;
    // Written from a thread: iptables-restore consumes its input as it applies it, so a
    // slow restore would block a plain write, and the time limit below with it.
    let writer = match (input, child.stdin.take()) {
        (Some(text), Some(mut stdin)) => {
            let text = text.to_string();
            // A write error shows up as the command's failure below.
            Some(std::thread::spawn(move || {
                drop(stdin.write_all(text.as_bytes()))
            }))
        }
        _ => None,
    };
    // Read the pipes on threads so a large iptables-save cannot fill them and stall.
    let mut out_pipe = child.stdout.take();
    let mut err_pipe = child.stderr.take();
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(p) = out_pipe.as_mut() {
            let _ = std::io::Read::read_to_string(p, &mut s);
        }
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(p) = err_pipe.as_mut() {
            let _ = std::io::Read::read_to_string(p, &mut s);
        }
        s
    });
    let deadline = Instant::now() + COMMAND_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                // The killed child closed its end: the writer fails and ends.
                if let Some(w) = writer {
                    let _ = w.join();
                }
                return Err(ApplyError::Timeout { command });
            }
            Err(source) => return Err(ApplyError::Spawn { command, source }),
        }
    };
    if let Some(w) = writer {
        let _ = w.join();
    }
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    if status.success() {
        Ok(stdout)
    } else {
        Err(ApplyError::Failed {
            command,
            status: status.to_string(),
            stderr: stderr.trim().to_string(),
        })
    }
}

/// Everything the iptables proxier runs on the node: the iptables tools of one family, the
/// conntrack table and the address list. [`Runner`] runs the real tools; unit tests put a
/// model of the tables in its place.
pub trait Tools: Send {
    fn family(&self) -> Family;
    /// `iptables-restore --noflush`: all of `text` in one transaction, or none of it.
    fn restore(&self, text: &str) -> Result<(), ApplyError>;
    /// `iptables-save` of every table, parsed.
    fn save(&self) -> Result<Saved, ApplyError>;
    /// `iptables -t TABLE ARGS...`.
    fn iptables(&self, table: Table, args: &[String]) -> Result<String, ApplyError>;
    /// `iptables --version`.
    fn version(&self) -> Result<String, ApplyError>;
    /// The UDP entries of this family's conntrack table (over ctnetlink).
    fn conntrack_udp(&self) -> Result<Vec<Flow>, ApplyError>;
    /// Every entry of this family's conntrack table (`fastpath inspect flows`).
    fn conntrack_entries(&self) -> Result<Vec<conntrack::Entry>, ApplyError>;
    /// The `recent` match's list `name` (`/proc/net/xt_recent/NAME`): ClientIP affinity.
    fn recent_list(&self, name: &str) -> Result<String, ApplyError>;
    /// Deletes UDP conntrack entries, all in one batch (gone already is no error). Err:
    /// the batch could not be sent or its answers read; an entry the kernel refused is
    /// in [`Deleted::failed`].
    fn conntrack_delete(&self, flows: &[Flow]) -> Result<Deleted, ApplyError>;
    /// The node's addresses of this family (loopback included).
    fn local_addresses(&self) -> Result<Vec<IpAddr>, ApplyError>;
    /// The nf_tables generation (see [`super::generation`]), where it can be read; only
    /// asked when the tools are iptables-nft.
    fn generation(&self) -> Option<u32> {
        None
    }
}

impl Tools for Runner {
    fn family(&self) -> Family {
        self.family
    }
    fn restore(&self, text: &str) -> Result<(), ApplyError> {
        Runner::restore(self, text)
    }
    fn save(&self) -> Result<Saved, ApplyError> {
        Runner::save(self)
    }
    fn iptables(&self, table: Table, args: &[String]) -> Result<String, ApplyError> {
        Runner::iptables(self, table, args)
    }
    fn version(&self) -> Result<String, ApplyError> {
        Runner::version(self)
    }
    fn conntrack_udp(&self) -> Result<Vec<Flow>, ApplyError> {
        ctnetlink::list_udp(self.netns.as_deref(), self.family).map_err(|source| {
            ApplyError::Netlink {
                what: "listing the UDP conntrack entries",
                source,
            }
        })
    }
    fn conntrack_entries(&self) -> Result<Vec<conntrack::Entry>, ApplyError> {
        let mut cmd = netns::command(self.netns.as_deref(), "conntrack");
        cmd.args(["-L", "-f", self.family_flag()]);
        self.run(cmd, None)
            .map(|out| conntrack::parse_entries(&out))
    }
    fn recent_list(&self, name: &str) -> Result<String, ApplyError> {
        // The list is a file of the namespace's /proc/net, so it is read from inside it; the
        // name comes from saved rules and must not climb out of the directory.
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            return Err(ApplyError::Failed {
                command: format!("read /proc/net/xt_recent/{name}"),
                status: "not run".into(),
                stderr: "not a recent list's name".into(),
            });
        }
        let mut cmd = netns::command(self.netns.as_deref(), "cat");
        cmd.arg(format!("/proc/net/xt_recent/{name}"));
        self.run(cmd, None)
    }
    fn conntrack_delete(&self, flows: &[Flow]) -> Result<Deleted, ApplyError> {
        ctnetlink::delete(self.netns.as_deref(), self.family, flows).map_err(|source| {
            ApplyError::Netlink {
                what: "deleting UDP conntrack entries",
                source,
            }
        })
    }
    fn local_addresses(&self) -> Result<Vec<IpAddr>, ApplyError> {
        let mut cmd = netns::command(self.netns.as_deref(), "ip");
        cmd.args(["-j", "addr", "show"]);
        let out = self.run(cmd, None)?;
        Ok(parse_ip_addr_json(&out)
            .into_iter()
            .filter(|ip| Family::of(ip) == self.family)
            .collect())
    }
    fn generation(&self) -> Option<u32> {
        super::generation::read(self.netns.as_deref())
            .map_err(|e| tracing::debug!("nf_tables generation: {e}"))
            .ok()
    }
}

/// The addresses in `ip -j addr show` output (unparseable output: none).
pub fn parse_ip_addr_json(text: &str) -> Vec<IpAddr> {
    let Ok(links) = serde_json::from_str::<Vec<serde_json::Value>>(text) else {
        return Vec::new();
    };
    links
        .iter()
        .filter_map(|l| l.get("addr_info")?.as_array())
        .flatten()
        .filter_map(|a| a.get("local")?.as_str()?.parse().ok())
        .collect()
}

/// Whether the iptables whose `--version` printed `version` knows MASQUERADE's
/// `--random-fully` (1.6.2 and later), as kube-proxy's utiliptables decides it.
pub fn has_random_fully(version: &str) -> bool {
    let Some(v) = version.split_whitespace().find_map(|w| w.strip_prefix('v')) else {
        return false;
    };
    let parts: Vec<u32> = v.split('.').map_while(|p| p.parse().ok()).collect();
    let (major, minor, patch) = (
        parts.first().copied().unwrap_or(0),
        parts.get(1).copied().unwrap_or(0),
        parts.get(2).copied().unwrap_or(0),
    );
    (major, minor, patch) >= (1, 6, 2)
}

/// `iptables-save` output: per table, its chains and their rules as saved (`-A ...` lines).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Saved {
    pub tables: BTreeMap<String, SavedTable>,
    /// Written by iptables-nft-save (its header says nf_tables).
    pub nft: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedTable {
    pub chains: BTreeSet<String>,
    /// `(chain, whole line)` in order.
    pub rules: Vec<(String, String)>,
}

impl Saved {
    pub fn parse(text: &str) -> Saved {
        let mut saved = Saved::default();
        let mut current: Option<String> = None;
        for line in text.lines() {
            let line = line.trim_end();
            if line.starts_with("# Generated by") && line.contains("nf_tables") {
                saved.nft = true;
            }
            if let Some(t) = line.strip_prefix('*') {
                current = Some(t.to_string());
                saved.tables.entry(t.to_string()).or_default();
            } else if line == "COMMIT" {
                current = None;
            } else if let Some(table) = current.as_ref().and_then(|t| saved.tables.get_mut(t)) {
                if let Some(rest) = line.strip_prefix(':')
                    && let Some(name) = rest.split_whitespace().next()
                {
                    table.chains.insert(name.to_string());
                } else if let Some(rest) = line.strip_prefix("-A ")
                    && let Some(chain) = rest.split_whitespace().next()
                {
                    table.rules.push((chain.to_string(), line.to_string()));
                }
            }
        }
        saved
    }

    pub fn table(&self, table: Table) -> Option<&SavedTable> {
        self.tables.get(table.name())
    }

    /// Our chains (by `ours`) present in `table`.
    pub fn chains_matching(
        &self,
        table: Table,
        ours: impl Fn(Table, &str) -> bool,
    ) -> BTreeSet<String> {
        self.table(table)
            .map(|t| {
                t.chains
                    .iter()
                    .filter(|c| ours(table, c))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The jump target of a saved rule (`-j X` or `-g X`), if any.
fn target(rule: &str) -> Option<&str> {
    let mut words = rule.split_whitespace();
    let mut found = None;
    while let Some(w) = words.next() {
        if w == "-j" || w == "-g" {
            found = words.next();
        }
    }
    found
}

/// A rule in a built-in chain that sends traffic into one of ours.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Jump {
    pub table: Table,
    pub from: &'static str,
    pub to: &'static str,
    pub comment: &'static str,
    /// Matches before the comment, e.g. `-m conntrack --ctstate NEW`.
    pub extra: &'static [&'static str],
}

impl Jump {
    /// The rule's arguments after the chain name, for `-C`/`-I`/`-D`.
    pub fn args(&self) -> Vec<String> {
        let mut a: Vec<String> = self.extra.iter().map(|s| s.to_string()).collect();
        a.extend(["-m", "comment", "--comment", self.comment, "-j", self.to].map(String::from));
        a
    }

    /// The rule as an `iptables-restore` line inserting it at the top of its chain.
    pub fn restore_line(&self) -> String {
        let mut line = format!("-I {} 1", self.from);
        for e in self.extra {
            line.push(' ');
            line.push_str(e);
        }
        line.push_str(&format!(
            " -m comment --comment \"{}\" -j {}",
            self.comment, self.to
        ));
        line
    }

    /// Whether `saved` already has this jump (same chain, target and comment).
    pub fn present_in(&self, saved: &Saved) -> bool {
        let quoted = format!("--comment \"{}\"", self.comment);
        let bare = format!("--comment {}", self.comment);
        saved.table(self.table).is_some_and(|t| {
            t.rules.iter().any(|(chain, line)| {
                chain == self.from
                    && target(line) == Some(self.to)
                    && (line.contains(&quoted) || line.contains(&bare))
            })
        })
    }
}

/// Inserts the jumps `saved` lacks at the top of their built-in chains (kube-proxy
/// prepends, so that a node firewall's later ACCEPTs cannot bypass the services). Returns
/// how many were inserted. The target chains must exist.
pub fn ensure_jumps(
    runner: &dyn Tools,
    jumps: &[Jump],
    saved: &Saved,
) -> Result<usize, ApplyError> {
    let mut inserted = 0;
    for j in jumps.iter().filter(|j| !j.present_in(saved)) {
        let mut args = vec!["-I".to_string(), j.from.to_string(), "1".to_string()];
        args.extend(j.args());
        runner.iptables(j.table, &args)?;
        inserted += 1;
    }
    Ok(inserted)
}

/// The restore input that deletes every chain `ours` selects in `tables` and every rule
/// elsewhere that jumps to one, as kube-proxy's CleanupLeftovers does. None if there is
/// nothing to delete.
pub fn removal_text(
    saved: &Saved,
    tables: &[Table],
    ours: impl Fn(Table, &str) -> bool,
) -> Option<String> {
    let mut out = String::new();
    let mut any = false;
    for &table in tables {
        let Some(t) = saved.table(table) else {
            continue;
        };
        let chains: Vec<&String> = t.chains.iter().filter(|c| ours(table, c)).collect();
        let jumps: Vec<&String> = t
            .rules
            .iter()
            .filter(|(chain, line)| {
                !ours(table, chain) && target(line).is_some_and(|to| ours(table, to))
            })
            .map(|(_, line)| line)
            .collect();
        if chains.is_empty() && jumps.is_empty() {
            continue;
        }
        any = true;
        out.push_str(&format!("*{}\n", table.name()));
        if table == Table::Nat && super::render::list_first(saved.nft, chains.len(), t.rules.len())
        {
            out.push_str(super::render::LIST_FIRST);
        }
        for c in &chains {
            out.push_str(&format!(":{c} - [0:0]\n"));
        }
        for line in jumps {
            out.push_str(&format!("-D {}\n", &line[3..]));
        }
        for c in &chains {
            out.push_str(&format!("-X {c}\n"));
        }
        out.push_str("COMMIT\n");
    }
    any.then_some(out)
}

/// Deletes our chains (as `ours` selects them) and the jumps into them. Returns how many
/// chains went.
pub fn remove_chains(
    runner: &dyn Tools,
    ours: impl Fn(Table, &str) -> bool,
) -> Result<usize, ApplyError> {
    let saved = runner.save()?;
    let count = [Table::Filter, Table::Nat]
        .iter()
        .map(|&t| saved.chains_matching(t, &ours).len())
        .sum();
    if let Some(text) = removal_text(&saved, &[Table::Filter, Table::Nat], &ours) {
        runner.restore(&text)?;
    }
    Ok(count)
}

#[cfg(test)]
mod tests;
