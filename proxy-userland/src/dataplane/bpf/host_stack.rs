//! `--bpf-host-routing auto`: host routing wherever it skips nothing the host does to
//! forwarded traffic.
//!
//! Host routing sends translated packets for this node's pods straight into them, and
//! their replies straight out, past the host's netfilter hooks. A CNI that enforces
//! NetworkPolicy there (a `forward` chain that drops, iptables' FORWARD), a firewall, or a
//! mark that steers routing would be skipped without a word. So `auto` (the default) turns
//! it on only while no netfilter hook a forwarded packet crosses (prerouting, forward,
//! postrouting, a device's ingress) holds anything but counters, logging and accepts: in
//! nftables (iptables-nft included) and in legacy iptables, in every namespace the
//! programs' devices are in. NAT chains do not count: they see a connection's first packet
//! only, and the programs translate before them.
//!
//! A thread of its own looks at start, then whenever nf_tables announces a change in the
//! first namespace (nfnetlink's nftables group: a rule a CNI adds is honoured as soon as
//! the ruleset is listed, not at the next poll), and twice a second in any case: the
//! nf_tables generation says whether to list the ruleset again; legacy tables, which
//! announce nothing and have no generation, are listed every few seconds while they exist.
//! A look that fails counts as "filtered": host routing is left off rather than risk
//! skipping a policy.

use std::{
    collections::BTreeSet,
    io,
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use aya::maps::{Array, MapData};
use proxy_common::{SockConfig, sockcfg::flags};
use serde_json::Value;

pub use crate::config::HostRouting;
use crate::dataplane::{iptables, netlink::NetlinkSocket, netns, watcher::Watcher};

/// How often the thread looks without news.
const LOOK: Duration = Duration::from_millis(500);
/// The least time between two looks: a burst of changes (a CNI's batch, one message per
/// object) is listed once, not once per message.
const SETTLE: Duration = Duration::from_millis(20);
/// nfnetlink's group for nf_tables changes (NFNLGRP_NFTABLES, 7), as bind's bit mask.
const NFTABLES_GROUP: u32 = 1 << (7 - 1);
/// How often what has no generation to go by (legacy iptables, a namespace without
/// nf_tables) is listed again.
const SLOW_LOOK: Duration = Duration::from_secs(5);

/// The hooks a forwarded packet crosses.
const FORWARD_HOOKS: [&str; 4] = ["prerouting", "forward", "postrouting", "ingress"];
/// Statements that leave a packet's fate and routing alone.
const HARMLESS: [&str; 7] = [
    "match", "counter", "log", "accept", "continue", "return", "limit",
];

/// What in an `nft -j list ruleset` listing acts on forwarded traffic, if anything.
pub fn nft_filters(listing: &str) -> Result<Option<String>, String> {
    let doc: Value = serde_json::from_str(listing).map_err(|e| format!("nft -j: {e}"))?;
    let items = doc
        .get("nftables")
        .and_then(Value::as_array)
        .ok_or("nft -j: no \"nftables\" array")?;
    let name = |o: &Value, key: &str| o.get(key).and_then(Value::as_str).unwrap_or("").to_string();
    let mut base = BTreeSet::new();
    for chain in items.iter().filter_map(|i| i.get("chain")) {
        let hook = name(chain, "hook");
        if !FORWARD_HOOKS.contains(&hook.as_str()) || name(chain, "type") == "nat" {
            continue;
        }
        let id = (
            name(chain, "family"),
            name(chain, "table"),
            name(chain, "name"),
        );
        if name(chain, "policy") == "drop" {
            return Ok(Some(format!(
                "nftables chain {} {} {} drops by default",
                id.0, id.1, id.2
            )));
        }
        base.insert(id);
    }
    for rule in items.iter().filter_map(|i| i.get("rule")) {
        let id = (
            name(rule, "family"),
            name(rule, "table"),
            name(rule, "chain"),
        );
        if !base.contains(&id) {
            continue;
        }
        let harmful = rule
            .get("expr")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_object)
            .flat_map(|statement| statement.keys())
            .find(|k| !HARMLESS.contains(&k.as_str()));
        if let Some(what) = harmful {
            return Ok(Some(format!(
                "nftables chain {} {} {} has a rule that may act on forwarded packets ({what})",
                id.0, id.1, id.2
            )));
        }
    }
    Ok(None)
}

/// What in an `iptables-legacy-save` listing of one table acts on forwarded traffic.
pub fn legacy_filters(table: &str, listing: &str) -> Option<String> {
    listing.lines().find_map(|line| {
        let chain = line.split_whitespace().next()?;
        let on_hook = |c: &str| ["PREROUTING", "FORWARD", "POSTROUTING"].contains(&c);
        if let Some(c) = chain.strip_prefix(':')
            && on_hook(c)
            && line.split_whitespace().nth(1) != Some("ACCEPT")
        {
            return Some(format!(
                "legacy iptables {table} {c} does not accept by default"
            ));
        }
        let mut words = line.split_whitespace();
        (words.next() == Some("-A") && words.next().is_some_and(on_hook))
            .then(|| format!("legacy iptables {table} has rules on a forwarded packet's path"))
    })
}

/// Netfilter's state in one namespace, and what it says.
struct Look {
    ns: Option<String>,
    generation: Option<u32>,
    nft_at: Option<Instant>,
    nft: Result<Option<String>, String>,
    legacy_at: Option<Instant>,
    legacy: Result<Option<String>, String>,
}

impl Look {
    fn new(ns: Option<String>) -> Self {
        Self {
            ns,
            generation: None,
            nft_at: None,
            nft: Err("not looked yet".into()),
            legacy_at: None,
            legacy: Ok(None),
        }
    }

    /// Looks again where something may have changed; what acts on forwarded traffic.
    fn refresh(&mut self) -> Result<Option<String>, String> {
        let ns = self.ns.as_deref();
        let generation = iptables::generation::read(ns).ok();
        // Listed again when the generation moved; without one to go by (no nf_tables),
        // or after a failed listing, every few seconds.
        let stale = self.nft_at.is_none_or(|t| t.elapsed() >= SLOW_LOOK);
        let unsure = generation.is_none() || self.nft.is_err();
        if generation != self.generation || (unsure && stale) {
            let cmd = netns::command(ns, "nft");
            self.nft = match iptables::apply::run_bounded(
                with_args(cmd, &["-j", "list", "ruleset"]),
                None,
            ) {
                Ok(listing) => nft_filters(&listing),
                Err(e) => Err(e.to_string()),
            };
            self.generation = generation;
            self.nft_at = Some(Instant::now());
        }
        if self.legacy_at.is_none_or(|t| t.elapsed() >= SLOW_LOOK) {
            self.legacy = legacy_here(ns);
            self.legacy_at = Some(Instant::now());
        }
        match (&self.nft, &self.legacy) {
            (Err(e), _) | (_, Err(e)) => Err(e.clone()),
            (Ok(Some(why)), _) | (_, Ok(Some(why))) => Ok(Some(why.clone())),
            _ => Ok(None),
        }
    }
}

fn with_args(mut cmd: std::process::Command, args: &[&str]) -> std::process::Command {
    cmd.args(args);
    cmd
}

/// Legacy iptables' tables in `ns` that may act on forwarded traffic, listed.
fn legacy_here(ns: Option<&str>) -> Result<Option<String>, String> {
    for (names, save) in [
        ("ip_tables_names", "iptables-legacy-save"),
        ("ip6_tables_names", "ip6tables-legacy-save"),
    ] {
        let path = format!("/proc/thread-self/net/{names}");
        let read = || std::fs::read_to_string(&path).unwrap_or_default();
        let tables = netns::in_netns(ns, read).map_err(|e| e.to_string())?;
        for table in tables.lines().filter(|t| *t != "nat") {
            let cmd = with_args(netns::command(ns, save), &["-t", table]);
            let listing = iptables::apply::run_bounded(cmd, None)
                .map_err(|e| format!("legacy iptables table {table} is loaded: {e}"))?;
            if let Some(why) = legacy_filters(table, &listing) {
                return Ok(Some(why));
            }
        }
    }
    Ok(None)
}

/// Keeps `SockConfig`'s host-routing bit in step with the host's netfilter until dropped.
pub struct AutoHostRouting {
    _watcher: Watcher,
}

impl AutoHostRouting {
    /// Starts watching `namespaces` (None: ours), the ones the programs' devices are in.
    /// `map`: the config map, whose entry the socket hooks' settings are already in.
    pub fn start(
        map: Array<MapData, SockConfig>,
        namespaces: Vec<Option<String>>,
    ) -> io::Result<Self> {
        Watcher::spawn("fp-host-routing", move |stop| {
            let first = namespaces.first().cloned().flatten();
            let news = ruleset_news(first.as_deref())
                .inspect_err(|e| {
                    tracing::warn!(
                        "host routing: no nf_tables events ({e}); looking twice a second"
                    )
                })
                .ok();
            let mut looks: Vec<Look> = namespaces.into_iter().map(Look::new).collect();
            let mut map = map;
            let mut on = None;
            while !stop.load(Ordering::Relaxed) {
                let verdict = looks
                    .iter_mut()
                    .map(Look::refresh)
                    .find(|v| !matches!(v, Ok(None)))
                    .unwrap_or(Ok(None));
                let want = matches!(verdict, Ok(None));
                if on != Some(want) {
                    match set_host_routing(&mut map, want) {
                        Ok(()) => {
                            on = Some(want);
                            report(&verdict);
                        }
                        Err(e) => tracing::warn!("host routing: {e}"),
                    }
                }
                std::thread::sleep(SETTLE);
                NetlinkSocket::wait_or_sleep(news.as_ref(), LOOK, "host routing");
            }
        })
        .map(|w| Self { _watcher: w })
    }
}

/// A socket told of every nf_tables change in `ns` (None: ours), where it was made.
fn ruleset_news(ns: Option<&str>) -> io::Result<NetlinkSocket> {
    NetlinkSocket::news_in(ns, libc::NETLINK_NETFILTER, NFTABLES_GROUP)
}

/// Says what a change of host routing follows.
fn report(verdict: &Result<Option<String>, String>) {
    match verdict {
        Ok(None) => {
            tracing::info!("host routing on: nothing in netfilter acts on forwarded traffic")
        }
        Ok(Some(why)) => tracing::info!("host routing off: {why}"),
        Err(e) => tracing::warn!("host routing off: cannot read netfilter's rules ({e})"),
    }
}

/// Sets or clears the host-routing bit, leaving the rest of the entry as it is.
fn set_host_routing(map: &mut Array<MapData, SockConfig>, on: bool) -> io::Result<()> {
    let mut config = map
        .get(&0, 0)
        .map_err(|e| io::Error::other(format!("reading the socket config: {e}")))?;
    if on {
        config.flags |= flags::HOST_ROUTING;
    } else {
        config.flags &= !flags::HOST_ROUTING;
    }
    map.set(0, config, 0)
        .map_err(|e| io::Error::other(format!("writing the socket config: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(chains: &str, rules: &str) -> String {
        format!(
            r#"{{"nftables": [{{"metainfo": {{"json_schema_version": 1}}}}, {chains} {rules}]}}"#
        )
    }

    const FORWARD: &str = r#"{"chain": {"family": "inet", "table": "filter", "name": "forward", "handle": 2, "type": "filter", "hook": "forward", "prio": 0, "policy": "accept"}}"#;

    #[test]
    fn accepting_and_counting_chains_leave_host_routing_on() {
        // Debian's stock /etc/nftables.conf: base chains, no rules.
        assert_eq!(nft_filters(&listing(FORWARD, "")), Ok(None));
        let counter = r#", {"rule": {"family": "inet", "table": "filter", "chain": "forward", "handle": 3, "expr": [{"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}}, {"counter": {"packets": 0, "bytes": 0}}]}}"#;
        assert_eq!(nft_filters(&listing(FORWARD, counter)), Ok(None));
        // A NAT chain's rules see first packets only.
        let nat = r#"{"chain": {"family": "ip", "table": "nat", "name": "POSTROUTING", "handle": 1, "type": "nat", "hook": "postrouting", "prio": 100, "policy": "accept"}}, {"rule": {"family": "ip", "table": "nat", "chain": "POSTROUTING", "handle": 4, "expr": [{"masquerade": null}]}}"#;
        assert_eq!(nft_filters(&listing(nat, "")), Ok(None));
        assert_eq!(nft_filters(r#"{"nftables": []}"#), Ok(None));
    }

    #[test]
    fn drops_jumps_and_drop_policies_turn_it_off() {
        let drop = r#", {"rule": {"family": "inet", "table": "filter", "chain": "forward", "handle": 3, "expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": "198.18.2.1"}}, {"drop": null}]}}"#;
        let why = nft_filters(&listing(FORWARD, drop)).unwrap().unwrap();
        assert!(
            why.contains("inet filter forward") && why.contains("drop"),
            "{why}"
        );
        let jump = r#", {"rule": {"family": "inet", "table": "filter", "chain": "forward", "handle": 3, "expr": [{"jump": {"target": "KUBE-FORWARD"}}]}}"#;
        assert!(nft_filters(&listing(FORWARD, jump)).unwrap().is_some());
        let policy = FORWARD.replace("\"accept\"", "\"drop\"");
        assert!(nft_filters(&listing(&policy, "")).unwrap().is_some());
        // A rule in a chain no forwarded packet crosses does not count.
        let input = FORWARD.replace("\"forward\"", "\"input\"");
        let drop_in = drop.replace("\"forward\"", "\"input\"");
        assert_eq!(nft_filters(&listing(&input, &drop_in)), Ok(None));
        assert!(nft_filters("not json").is_err());
        assert!(nft_filters(r#"{"other": 1}"#).is_err());
    }

    #[test]
    fn legacy_listings_are_read_for_forwarded_packets_path() {
        let empty = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n-A INPUT -j DROP\nCOMMIT\n";
        assert_eq!(legacy_filters("filter", empty), None);
        let docker = empty.replace(":FORWARD ACCEPT", ":FORWARD DROP");
        assert!(legacy_filters("filter", &docker).is_some());
        let rule = empty.replace("-A INPUT -j DROP", "-A FORWARD -s 198.18.2.1/32 -j DROP");
        assert!(legacy_filters("filter", &rule).is_some());
        let mangle = "*mangle\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -j MARK --set-xmark 0x1/0x1\nCOMMIT\n";
        assert!(legacy_filters("mangle", mangle).is_some());
    }
}
