//! What the iptables proxier really programmed, read back from `iptables-save` (and
//! `ip6tables-save`) through the proxier's own [`Tools`]: per frontend, the chain its
//! traffic jumps to and the backends the KUBE-SVC/KUBE-SVL chains spread it over (with each
//! one's share and ClientIP affinity), found by following the jumps down to the KUBE-SEP
//! chains' DNAT targets, and the filter table's REJECT/DROP for frontends without any.
//!
//! This is read from the kernel, not derived from the model, so rules someone changed
//! behind the daemon's back (or a sync that failed) show as they are.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use super::maps::ProgrammedFrontend;
use crate::{
    dataplane::{
        frontends::{BackendAddr, Frontend, FrontendScope},
        iptables::{
            Family, Table,
            apply::{Saved, SavedTable, Tools},
            render::{KUBE_EXTERNAL_SERVICES, KUBE_MARK_MASQ, KUBE_NODEPORTS, KUBE_SERVICES},
        },
    },
    model::Protocol,
};

/// A frontend as the rules match it: address (unspecified for a node port), port, protocol.
pub type Key = (IpAddr, u16, Protocol);

/// One backend a balancing chain sends to.
#[derive(Clone, Debug, PartialEq)]
pub struct RuleBackend {
    /// The KUBE-SEP chain's DNAT target; None when that chain has no DNAT rule.
    pub addr: Option<SocketAddr>,
    pub sep: String,
    /// The share of new connections it gets (the statistic matches multiplied out).
    pub probability: f64,
}

/// Where one frontend's traffic goes, from one kind of client.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Resolved {
    /// The chains it passes, from the frontend's rule on: `KUBE-EXT-x -> KUBE-SVC-x`.
    pub path: Vec<String>,
    pub backends: Vec<RuleBackend>,
    /// `-m recent --rcheck --seconds N` in the balancing chain.
    pub affinity_timeout: Option<u32>,
    /// A KUBE-FW chain's source ranges.
    pub source_ranges: Vec<String>,
}

/// One frontend's rule in KUBE-SERVICES or KUBE-NODEPORTS (nat).
#[derive(Clone, Debug, PartialEq)]
pub struct RuleFrontend {
    /// The service port, from the rule's comment.
    pub service: Option<String>,
    /// cluster IP, external IP, loadbalancer IP, node port.
    pub kind: &'static str,
    pub chain: String,
}

/// One ClientIP affinity list: the `recent` list a KUBE-SEP chain sets and the balancing
/// chain checks.
#[derive(Clone, Debug, PartialEq)]
pub struct AffinityList {
    /// A frontend whose traffic checks it (a cluster IP's, if the service has one).
    pub frontend: Frontend,
    pub service: Option<String>,
    pub sep: String,
    pub backend: Option<SocketAddr>,
    pub timeout_secs: Option<u32>,
}

/// The clients in a `/proc/net/xt_recent/NAME` listing (`src=ADDR ttl: .. last_seen: ..`).
pub fn parse_recent(text: &str) -> Vec<IpAddr> {
    text.lines()
        .filter_map(|l| {
            l.split_whitespace()
                .next()?
                .strip_prefix("src=")?
                .parse()
                .ok()
        })
        .collect()
}

/// Both families' nat and filter tables, as saved.
#[derive(Clone, Debug, Default)]
pub struct Programmed {
    /// Each family's nat chains (IPv4, IPv6): both families name a service port's chains
    /// alike.
    nat: [BTreeMap<String, Vec<Vec<String>>>; 2],
    pub frontends: BTreeMap<Key, RuleFrontend>,
    /// Frontends the filter table rejects or drops (no endpoints, none usable here), with
    /// the rule's comment.
    pub refused: BTreeMap<Key, (&'static str, String)>,
    /// nftables mode: each frontend's way from this node (true) and from elsewhere, read
    /// from the table ([`super::nft_rules`]) instead of walked through `nat`.
    nft_resolved: Option<BTreeMap<(Key, bool), Resolved>>,
    nft_targets: BTreeMap<SocketAddr, String>,
    /// nftables mode: the clients each `affinity-` set holds.
    pub nft_affinity: BTreeMap<String, Vec<IpAddr>>,
}

/// A saved rule's words, quotes removed (`--comment "a b"` is one word).
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let (mut quoted, mut any) = (false, false);
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' if quoted => cur.extend(chars.next()),
            '"' => {
                quoted = !quoted;
                any = true;
            }
            c if c.is_whitespace() && !quoted => {
                if any || !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                any = false;
            }
            c => cur.push(c),
        }
    }
    if any || !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The word after `flag`.
fn arg<'a>(w: &'a [String], flag: &str) -> Option<&'a str> {
    w.iter()
        .position(|x| x == flag)
        .and_then(|i| w.get(i + 1))
        .map(String::as_str)
}

fn has(w: &[String], flag: &str) -> bool {
    w.iter().any(|x| x == flag)
}

fn target(w: &[String]) -> Option<&str> {
    arg(w, "-j").or_else(|| arg(w, "-g"))
}

/// `198.19.0.10/32` or `2001:db8::1/128` (a host); anything wider is no frontend.
fn host(cidr: &str) -> Option<IpAddr> {
    match cidr.split_once('/') {
        Some((ip, "32" | "128")) => ip.parse().ok(),
        None => cidr.parse().ok(),
        Some(_) => None,
    }
}

fn proto_of(w: &[String]) -> Option<Protocol> {
    Protocol::from_k8s(Some(&arg(w, "-p")?.to_ascii_uppercase()))
}

/// `198.18.1.11:8080` or `[2001:db8::11]:8080`.
fn dnat_target(w: &[String]) -> Option<SocketAddr> {
    arg(w, "--to-destination")?.parse().ok()
}

fn family_index(family: Family) -> usize {
    match family {
        Family::V4 => 0,
        Family::V6 => 1,
    }
}

fn unspecified(family: Family) -> IpAddr {
    match family {
        Family::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        Family::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

impl Programmed {
    /// What the nftables reader found ([`super::nft_rules::programmed`]).
    pub fn from_nftables(
        frontends: BTreeMap<Key, RuleFrontend>,
        refused: BTreeMap<Key, (&'static str, String)>,
        resolved: BTreeMap<(Key, bool), Resolved>,
        targets: BTreeMap<SocketAddr, String>,
        affinity: BTreeMap<String, Vec<IpAddr>>,
    ) -> Self {
        Programmed {
            frontends,
            refused,
            nft_resolved: Some(resolved),
            nft_targets: targets,
            nft_affinity: affinity,
            ..Programmed::default()
        }
    }

    /// Whether this was read from nftables.
    pub fn is_nftables(&self) -> bool {
        self.nft_resolved.is_some()
    }

    /// Reads every family `tools` has. A family whose tool fails is left out with a note in
    /// the returned warnings; all failing is an error.
    pub fn read(tools: &[Box<dyn Tools>]) -> anyhow::Result<(Self, Vec<String>)> {
        let mut p = Programmed::default();
        let mut errors: Vec<String> = Vec::new();
        for t in tools {
            match t.save() {
                Ok(saved) => p.add(t.family(), &saved),
                Err(e) => errors.push(format!("{:?}: {e}", t.family())),
            }
        }
        if errors.len() == tools.len() {
            anyhow::bail!("cannot read the iptables rules: {}", errors.join("; "));
        }
        Ok((p, errors))
    }

    /// Adds one family's tables.
    pub fn add(&mut self, family: Family, saved: &Saved) {
        let empty = SavedTable::default();
        let nat = saved.table(Table::Nat).unwrap_or(&empty);
        for (chain, line) in &nat.rules {
            self.nat[family_index(family)]
                .entry(chain.clone())
                .or_default()
                .push(words(line));
        }
        for (chain, line) in &nat.rules {
            let w = words(line);
            let (Some(to), Some(proto), Some(port)) = (
                target(&w),
                proto_of(&w),
                arg(&w, "--dport").and_then(|p| p.parse().ok()),
            ) else {
                continue;
            };
            if !to.starts_with("KUBE-") || to == KUBE_MARK_MASQ {
                continue;
            }
            let comment = arg(&w, "--comment").unwrap_or("");
            let (ip, kind, service) = match chain.as_str() {
                KUBE_SERVICES => {
                    let Some(ip) = arg(&w, "-d").and_then(host) else {
                        continue;
                    };
                    let (svc, kind) = [" cluster IP", " external IP", " loadbalancer IP"]
                        .iter()
                        .find_map(|k| comment.strip_suffix(k).map(|s| (s, k.trim_start())))
                        .unwrap_or((comment, "service IP"));
                    (ip, kind, svc)
                }
                KUBE_NODEPORTS => (unspecified(family), "node port", comment),
                _ => continue,
            };
            self.frontends.insert(
                (ip, port, proto),
                RuleFrontend {
                    service: (!service.is_empty()).then(|| service.to_string()),
                    kind,
                    chain: to.to_string(),
                },
            );
        }
        let filter = saved.table(Table::Filter).unwrap_or(&empty);
        for (chain, line) in &filter.rules {
            if chain != KUBE_SERVICES && chain != KUBE_EXTERNAL_SERVICES {
                continue;
            }
            let w = words(line);
            let verdict = match target(&w) {
                Some("REJECT") => "rejected",
                Some("DROP") => "dropped",
                _ => continue,
            };
            let (Some(proto), Some(port)) = (
                proto_of(&w),
                arg(&w, "--dport").and_then(|p| p.parse().ok()),
            ) else {
                continue;
            };
            let ip = match arg(&w, "-d") {
                Some(d) => match host(d) {
                    Some(ip) => ip,
                    None => continue,
                },
                None if arg(&w, "--dst-type") == Some("LOCAL") => unspecified(family),
                None => continue,
            };
            let comment = arg(&w, "--comment").unwrap_or("").to_string();
            self.refused.insert((ip, port, proto), (verdict, comment));
        }
    }

    /// The frontend a packet to `dst` matches: its address's, else a node port's.
    pub fn frontend_for(&self, dst: SocketAddr, proto: Protocol) -> Option<&RuleFrontend> {
        let family = if dst.is_ipv4() {
            Family::V4
        } else {
            Family::V6
        };
        self.frontends
            .get(&(dst.ip(), dst.port(), proto))
            .or_else(|| {
                self.frontends
                    .get(&(unspecified(family), dst.port(), proto))
            })
    }

    fn rules(&self, family: Family, chain: &str) -> &[Vec<String>] {
        self.nat[family_index(family)]
            .get(chain)
            .map_or(&[], Vec::as_slice)
    }

    /// Where `key`'s traffic goes: from this node (`from_node`: the node's own address is
    /// the source, as for a connection a process on it makes) or from elsewhere.
    pub fn resolve(&self, key: &Key, from_node: bool) -> Option<Resolved> {
        if let Some(resolved) = &self.nft_resolved {
            return resolved.get(&(*key, from_node)).cloned();
        }
        let fe = self.frontends.get(key)?;
        let family = Family::of(&key.0);
        let mut out = Resolved::default();
        let mut chain = fe.chain.clone();
        // Bounded: KUBE-FW -> KUBE-EXT -> KUBE-SVC/SVL is the longest path kube-proxy writes.
        for _ in 0..4 {
            out.path.push(chain.clone());
            let rules = self.rules(family, &chain);
            if rules
                .iter()
                .any(|w| target(w).is_some_and(|t| t.starts_with("KUBE-SEP-")))
            {
                self.balance(family, rules, &mut out);
                return Some(out);
            }
            let jumps = || {
                rules.iter().filter(|w| {
                    target(w).is_some_and(|t| t.starts_with("KUBE-") && t != KUBE_MARK_MASQ)
                })
            };
            let local = |w: &&Vec<String>| arg(w, "--src-type") == Some("LOCAL");
            // A FW chain lets the source ranges through to the EXT chain.
            let ranges: Vec<String> = jumps()
                .filter(|w| !local(w))
                .filter_map(|w| arg(w, "-s").map(String::from))
                .collect();
            if chain.starts_with("KUBE-FW-") {
                out.source_ranges = ranges;
            }
            let next = if from_node { jumps().find(local) } else { None }.or_else(|| {
                if chain.starts_with("KUBE-FW-") {
                    jumps().next()
                } else {
                    // The unconditional jump: the policy chain. (Pod sources go to the Cluster
                    // chain first under a Local policy; they are not "another host".)
                    jumps().rfind(|w| !has(w, "-s") && !local(w))
                }
            });
            match next.and_then(|w| target(w)) {
                Some(t) => chain = t.to_string(),
                None => return Some(out),
            }
        }
        Some(out)
    }

    /// Affinity checks first, then rule i matches with probability p_i of what the rules
    /// before it left: each backend's share is p_i times the product of (1 - p_j), j < i.
    fn balance(&self, family: Family, rules: &[Vec<String>], out: &mut Resolved) {
        let mut left = 1.0f64;
        for w in rules {
            let Some(sep) = target(w).filter(|t| t.starts_with("KUBE-SEP-")) else {
                continue;
            };
            if has(w, "--rcheck") {
                out.affinity_timeout = arg(w, "--seconds").and_then(|s| s.parse().ok());
                continue;
            }
            let p = if arg(w, "--mode") == Some("random") {
                arg(w, "--probability")
                    .and_then(|p| p.parse::<f64>().ok())
                    .unwrap_or(1.0)
            } else {
                1.0
            };
            let addr = self
                .rules(family, sep)
                .iter()
                .find(|w| target(w) == Some("DNAT"))
                .and_then(|w| dnat_target(w));
            out.backends.push(RuleBackend {
                addr,
                sep: sep.to_string(),
                probability: left * p,
            });
            left *= 1.0 - p;
        }
    }

    /// The frontends as explain looks them up: from this node (socket scope) and from other
    /// hosts (packet scope), each with the backends the rules send that traffic to.
    pub fn as_frontends(&self) -> BTreeMap<Frontend, ProgrammedFrontend> {
        let mut out = BTreeMap::new();
        for &(ip, port, proto) in self.frontends.keys() {
            for (scope, from_node) in [
                (FrontendScope::Socket, true),
                (FrontendScope::Packet, false),
            ] {
                let Some(r) = self.resolve(&(ip, port, proto), from_node) else {
                    continue;
                };
                let backends = r
                    .backends
                    .iter()
                    .filter_map(|b| b.addr)
                    .map(|a| BackendAddr {
                        ip: a.ip(),
                        port: a.port(),
                        proto,
                        local: false,
                    })
                    .collect();
                out.insert(
                    Frontend {
                        ip,
                        port,
                        proto,
                        scope,
                    },
                    ProgrammedFrontend {
                        rev_nat_index: 0,
                        affinity_timeout: r.affinity_timeout.unwrap_or(0),
                        backends,
                    },
                );
            }
        }
        out
    }

    /// Every affinity list the balancing chains check, once each.
    pub fn affinity_lists(&self) -> Vec<AffinityList> {
        let mut out: Vec<AffinityList> = Vec::new();
        let mut seen = std::collections::BTreeSet::new();
        let mut keys: Vec<(&Key, &RuleFrontend)> = self.frontends.iter().collect();
        keys.sort_by_key(|(_, f)| f.kind != "cluster IP");
        for (&(ip, port, proto), rf) in keys {
            let Some(r) = self.resolve(&(ip, port, proto), false) else {
                continue;
            };
            if r.affinity_timeout.is_none() {
                continue;
            }
            let scope = if rf.kind == "cluster IP" {
                FrontendScope::Socket
            } else {
                FrontendScope::Packet
            };
            for b in r.backends {
                if seen.insert(b.sep.clone()) {
                    out.push(AffinityList {
                        frontend: Frontend {
                            ip,
                            port,
                            proto,
                            scope,
                        },
                        service: rf.service.clone(),
                        sep: b.sep,
                        backend: b.addr,
                        timeout_secs: r.affinity_timeout,
                    });
                }
            }
        }
        out
    }

    /// Every address a KUBE-SEP chain DNATs to, with the service port of its frontend.
    pub fn dnat_targets(&self) -> BTreeMap<SocketAddr, String> {
        if self.is_nftables() {
            return self.nft_targets.clone();
        }
        let mut out = BTreeMap::new();
        for (chain, rules) in self.nat.iter().flatten() {
            if !chain.starts_with("KUBE-SEP-") {
                continue;
            }
            for w in rules {
                if let Some(a) = dnat_target(w) {
                    out.insert(a, arg(w, "--comment").unwrap_or("").to_string());
                }
            }
        }
        out
    }
}

/// Reads the rules of `netns` (None: this one) with the `backend` the daemon restores with.
pub fn read_node(netns: Option<&str>, backend: &str) -> anyhow::Result<(Programmed, Vec<String>)> {
    Programmed::read(&runners(netns, backend))
}

/// The real tools of both families.
pub fn runners(netns: Option<&str>, backend: &str) -> Vec<Box<dyn Tools>> {
    use crate::dataplane::iptables::apply::{Backend, Runner};
    let backend = match backend {
        "legacy" => Backend::Legacy,
        "nft" => Backend::Nft,
        _ => Backend::System,
    };
    [Family::V4, Family::V6]
        .into_iter()
        .map(|f| {
            Box::new(Runner::new(f, netns.map(String::from)).with_backend(backend))
                as Box<dyn Tools>
        })
        .collect()
}

#[cfg(test)]
mod tests;
