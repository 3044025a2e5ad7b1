//! A model of the node's tables standing in for the iptables tools (kube-proxy's
//! iptablestest.FakeIPTables): `iptables-restore --noflush` applied to in-memory tables,
//! all of the input or none of it, with the kernel's checks that matter to us (a rule may
//! only jump to a chain that exists; a chain another rule jumps to cannot be deleted).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::{Arc, Mutex},
};

use crate::dataplane::iptables::{
    apply::{ApplyError, Saved, Tools},
    conntrack::Flow,
    render::{Family, Table},
};

const BUILTIN: &[(&str, &[&str])] = &[
    ("filter", &["INPUT", "FORWARD", "OUTPUT"]),
    ("nat", &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"]),
];
const TARGETS: &[&str] = &[
    "ACCEPT",
    "DROP",
    "REJECT",
    "RETURN",
    "DNAT",
    "SNAT",
    "MASQUERADE",
    "MARK",
];

#[derive(Clone, Debug, Default)]
pub struct Tables {
    /// table -> chain -> rules (whole `-A CHAIN ...` lines), built-in chains included.
    pub chains: BTreeMap<String, BTreeMap<String, Vec<String>>>,
}

#[derive(Debug, Default)]
pub struct FakeState {
    pub tables: Tables,
    pub restores: Vec<String>,
    pub flows: Vec<Flow>,
    pub deleted: Vec<Flow>,
    /// conntrack_delete calls: one per sync that deletes anything.
    pub delete_batches: usize,
    pub addresses: Vec<IpAddr>,
    pub version: String,
    /// As nf_tables' generation: moved by every table a restore commits and every edit
    /// from outside.
    pub generation: u32,
    /// How many times the tables were read back (`iptables-save`).
    pub saves: usize,
}

/// Cloned handles share one state: the test keeps one, the proxier owns another.
#[derive(Clone, Debug)]
pub struct FakeTools {
    pub family: Family,
    pub state: Arc<Mutex<FakeState>>,
}

fn fail(msg: impl Into<String>) -> ApplyError {
    ApplyError::Failed {
        command: "iptables-restore (fake)".into(),
        status: "exit status: 1".into(),
        stderr: msg.into(),
    }
}

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

impl Tables {
    fn new() -> Self {
        let mut t = Tables::default();
        for (table, chains) in BUILTIN {
            let m = t.chains.entry(table.to_string()).or_default();
            for c in *chains {
                m.insert(c.to_string(), Vec::new());
            }
        }
        t
    }

    fn apply(&mut self, text: &str) -> Result<(), ApplyError> {
        let mut table: Option<String> = None;
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') || line == "-S" {
                continue;
            }
            if let Some(t) = line.strip_prefix('*') {
                table = Some(t.to_string());
                continue;
            }
            let Some(name) = table.clone() else {
                return Err(fail(format!("line outside a table: {line}")));
            };
            let chains = self.chains.entry(name.clone()).or_default();
            if line == "COMMIT" {
                for rules in chains.values() {
                    for r in rules {
                        if let Some(t) = target(r)
                            && !TARGETS.contains(&t)
                            && !chains.contains_key(t)
                        {
                            return Err(fail(format!("Chain '{t}' does not exist")));
                        }
                    }
                }
                table = None;
            } else if let Some(rest) = line.strip_prefix(':') {
                let chain = rest
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                let builtin = BUILTIN
                    .iter()
                    .any(|(t, cs)| *t == name && cs.contains(&chain.as_str()));
                if !builtin {
                    chains.insert(chain, Vec::new());
                }
            } else if let Some(rest) = line.strip_prefix("-A ") {
                let chain = rest.split_whitespace().next().unwrap_or_default();
                let rules = chains
                    .get_mut(chain)
                    .ok_or_else(|| fail(format!("Chain '{chain}' does not exist")))?;
                rules.push(line.to_string());
            } else if let Some(rest) = line.strip_prefix("-I ") {
                let mut words = rest.splitn(3, ' ');
                let chain = words.next().unwrap_or_default();
                let _position = words.next();
                let body = words.next().unwrap_or_default();
                let rules = chains
                    .get_mut(chain)
                    .ok_or_else(|| fail(format!("Chain '{chain}' does not exist")))?;
                rules.insert(0, format!("-A {chain} {body}"));
            } else if let Some(rest) = line.strip_prefix("-D ") {
                let chain = rest.split_whitespace().next().unwrap_or_default();
                let want = format!("-A {rest}");
                let rules = chains
                    .get_mut(chain)
                    .ok_or_else(|| fail(format!("Chain '{chain}' does not exist")))?;
                let i = rules
                    .iter()
                    .position(|r| *r == want)
                    .ok_or_else(|| fail("Bad rule (does a matching rule exist in that chain?)"))?;
                rules.remove(i);
            } else if let Some(chain) = line.strip_prefix("-X ") {
                let chain = chain.trim();
                if chains.values().flatten().any(|r| target(r) == Some(chain)) {
                    return Err(fail(format!(
                        "CHAIN_USER_DEL failed (Device or resource busy): chain {chain}"
                    )));
                }
                chains
                    .remove(chain)
                    .ok_or_else(|| fail(format!("Chain '{chain}' does not exist")))?;
            } else {
                return Err(fail(format!("cannot parse: {line}")));
            }
        }
        Ok(())
    }

    /// As `iptables-save` prints them.
    pub fn save_text(&self) -> String {
        let mut out = String::from("# Generated by iptables-save v1.8.9 (fake)\n");
        for (table, chains) in &self.chains {
            out.push_str(&format!("*{table}\n"));
            for c in chains.keys() {
                out.push_str(&format!(":{c} - [0:0]\n"));
            }
            for rules in chains.values() {
                for r in rules {
                    out.push_str(r);
                    out.push('\n');
                }
            }
            out.push_str("COMMIT\n");
        }
        out
    }
}

impl FakeTools {
    pub fn new(family: Family) -> Self {
        let state = FakeState {
            tables: Tables::new(),
            version: "iptables v1.8.9 (legacy)".into(),
            ..Default::default()
        };
        FakeTools {
            family,
            state: Arc::new(Mutex::new(state)),
        }
    }

    pub fn with(&self, f: impl FnOnce(&mut FakeState)) {
        let mut s = self.state.lock().unwrap();
        f(&mut s);
        s.generation += 1;
    }

    /// `iptables -t TABLE -F CHAIN`, as someone else on the node might run it.
    pub fn flush(&self, table: Table, chain: &str) {
        self.with(|s| {
            if let Some(rules) = s
                .tables
                .chains
                .get_mut(table.name())
                .and_then(|t| t.get_mut(chain))
            {
                rules.clear();
            }
        });
    }

    /// Appends a foreign rule, e.g. one jumping to one of our chains.
    pub fn append(&self, table: Table, rule: &str) {
        self.with(|s| {
            let chain = rule.split_whitespace().nth(1).unwrap().to_string();
            s.tables
                .chains
                .get_mut(table.name())
                .unwrap()
                .entry(chain)
                .or_default()
                .push(rule.to_string());
        });
    }

    pub fn rules(&self, table: Table, chain: &str) -> Vec<String> {
        let s = self.state.lock().unwrap();
        s.tables
            .chains
            .get(table.name())
            .and_then(|t| t.get(chain))
            .cloned()
            .unwrap_or_default()
    }

    pub fn chains(&self, table: Table) -> BTreeSet<String> {
        let s = self.state.lock().unwrap();
        s.tables
            .chains
            .get(table.name())
            .map(|t| t.keys().cloned().collect())
            .unwrap_or_default()
    }

    pub fn save_text(&self) -> String {
        self.state.lock().unwrap().tables.save_text()
    }

    pub fn restores(&self) -> Vec<String> {
        self.state.lock().unwrap().restores.clone()
    }
}

impl Tools for FakeTools {
    fn family(&self) -> Family {
        self.family
    }
    fn restore(&self, text: &str) -> Result<(), ApplyError> {
        let mut s = self.state.lock().unwrap();
        s.restores.push(text.to_string());
        // All or nothing: work on a copy.
        let mut tables = s.tables.clone();
        tables.apply(text)?;
        s.tables = tables;
        // iptables-nft-restore commits once per table.
        s.generation += text.lines().filter(|l| l.trim() == "COMMIT").count() as u32;
        Ok(())
    }
    fn save(&self) -> Result<Saved, ApplyError> {
        self.state.lock().unwrap().saves += 1;
        Ok(Saved::parse(&self.save_text()))
    }
    fn iptables(&self, table: Table, args: &[String]) -> Result<String, ApplyError> {
        let line = format!("*{}\n{}\nCOMMIT\n", table.name(), args.join(" "));
        self.restore(&line).map(|()| String::new())
    }
    fn version(&self) -> Result<String, ApplyError> {
        Ok(self.state.lock().unwrap().version.clone())
    }
    fn conntrack_udp(&self) -> Result<Vec<Flow>, ApplyError> {
        Ok(self.state.lock().unwrap().flows.clone())
    }
    fn conntrack_entries(
        &self,
    ) -> Result<Vec<crate::dataplane::iptables::conntrack::Entry>, ApplyError> {
        Ok(Vec::new())
    }
    fn recent_list(&self, _name: &str) -> Result<String, ApplyError> {
        Ok(String::new())
    }
    fn conntrack_delete(
        &self,
        flows: &[Flow],
    ) -> Result<crate::dataplane::iptables::conntrack::Deleted, ApplyError> {
        let mut s = self.state.lock().unwrap();
        s.flows.retain(|f| !flows.contains(f));
        s.deleted.extend_from_slice(flows);
        s.delete_batches += 1;
        Ok(crate::dataplane::iptables::conntrack::Deleted {
            deleted: flows.len(),
            ..Default::default()
        })
    }
    fn local_addresses(&self) -> Result<Vec<IpAddr>, ApplyError> {
        Ok(self.state.lock().unwrap().addresses.clone())
    }
    fn generation(&self) -> Option<u32> {
        Some(self.state.lock().unwrap().generation)
    }
}
