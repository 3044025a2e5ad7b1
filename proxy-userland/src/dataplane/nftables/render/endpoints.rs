//! The endpoint choice as data: a service chain without affinity DNATs through one lookup,
//! `dnat ip addr . port to numgen random mod N offset BASE map @endpoints-tcp-XX`, whose map
//! holds endpoint i at key BASE + i. Replacing an endpoint is then two element changes,
//! which Linux commits without validating the table: a rule or a verdict element makes it
//! walk every chain reachable from the base chains (about 50 ms at 10,000 services), and
//! an element of a map of plain data does not.
//!
//! Each chain holds a slot (a shard and a base) while it has a spread. The slots are
//! spread over [`SHARDS`] maps per protocol, because Linux checks each new element of a
//! map against every rule that uses the map: one map for 10,000 chains made a full sync
//! take 57 s instead of 3.5 s. A map per protocol, because nft 1.0.6 types a map's value
//! by a protocol's header (`typeof ... tcp dport`), and a map typed `th dport` cannot be
//! named by a rule of a later transaction that matched `meta l4proto tcp`. Maps are
//! declared by the transactions that first use them.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
};

use super::{HAIRPIN, TABLE, family_name, hairpin_pair};
use crate::dataplane::iptables::Family;

/// How many endpoint maps a family's table may have.
pub const SHARDS: u16 = 256;
/// Keys per slot: a chain with more endpoints than this keeps the spread as rules.
pub const SLOT_KEYS: u32 = 1 << 16;
/// The endpoint maps' common prefix: `endpoints-tcp-00` to `endpoints-sctp-ff`.
pub const MAP_PREFIX: &str = "endpoints-";

/// Where one chain's endpoints live: map `endpoints-{proto}-{shard:02x}`, keys
/// `base..base + n`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Slot {
    pub proto: &'static str,
    pub shard: u8,
    pub base: u32,
}

impl Slot {
    pub fn map(self) -> String {
        map_name(self.proto, self.shard)
    }
}

pub fn map_name(proto: &str, shard: u8) -> String {
    format!("{MAP_PREFIX}{proto}-{shard:02x}")
}

/// One chain's endpoints in the order of the keys (the protocol for its DNAT rule).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spread {
    pub proto: &'static str,
    pub endpoints: Vec<SocketAddr>,
}

/// The slots held, by chain. Indices freed are used again, lowest first. Two are equal
/// when they hold the same slots, whatever order they handed them out in.
#[derive(Clone, Debug, Default)]
pub struct Slots {
    by_chain: BTreeMap<String, Slot>,
    /// Per shard: the next index never used, and the indices given back.
    next: BTreeMap<u8, u32>,
    free: BTreeMap<u8, Vec<u32>>,
    /// The shard the next new slot goes to (round robin).
    turn: u16,
}

impl PartialEq for Slots {
    fn eq(&self, other: &Self) -> bool {
        self.by_chain == other.by_chain
    }
}

impl Eq for Slots {}

impl Slots {
    pub fn get(&self, chain: &str) -> Option<Slot> {
        self.by_chain.get(chain).copied()
    }

    /// The chain's slot in the maps of `proto` (a chain has one protocol), held from now
    /// on; None when every slot is taken.
    pub fn hold(&mut self, chain: &str, proto: &'static str) -> Option<Slot> {
        if let Some(&slot) = self.by_chain.get(chain) {
            return Some(slot);
        }
        for _ in 0..SHARDS {
            let shard = (self.turn % SHARDS) as u8;
            self.turn = (self.turn + 1) % SHARDS;
            let index = match self.free.get_mut(&shard).and_then(Vec::pop) {
                Some(i) => i,
                None => {
                    let next = self.next.entry(shard).or_insert(1);
                    // Index 0 is never used: a base of 0 would read as no offset.
                    if u64::from(*next) * u64::from(SLOT_KEYS) > u64::from(u32::MAX) {
                        continue;
                    }
                    *next += 1;
                    *next - 1
                }
            };
            let slot = Slot {
                proto,
                shard,
                base: index * SLOT_KEYS,
            };
            self.by_chain.insert(chain.to_string(), slot);
            return Some(slot);
        }
        None
    }

    /// Holds `slot` for `chain` again, as it was before it was given back.
    pub fn restore(&mut self, chain: &str, slot: Slot) {
        if let Some(free) = self.free.get_mut(&slot.shard) {
            free.retain(|&i| i != slot.base / SLOT_KEYS);
        }
        self.by_chain.insert(chain.to_string(), slot);
    }

    /// Gives back `chain`'s slot, if it holds one.
    pub fn release(&mut self, chain: &str) {
        if let Some(slot) = self.by_chain.remove(chain) {
            let free = self.free.entry(slot.shard).or_default();
            free.push(slot.base / SLOT_KEYS);
            // Lowest first, so a table that shrinks and grows again reuses its keys.
            free.sort_unstable_by(|a, b| b.cmp(a));
        }
    }

    /// Gives back every slot whose chain `keep` does not want.
    pub fn release_unless(&mut self, keep: impl Fn(&str) -> bool) {
        let gone: Vec<String> = (self.by_chain.keys())
            .filter(|c| !keep(c))
            .cloned()
            .collect();
        for chain in gone {
            self.release(&chain);
        }
    }
}

/// An element change that needs no rule: what a partial sync that only moves endpoints
/// writes, over netlink where it can (`Nft::run_elements`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElementChange {
    /// Endpoint `key` of map `proto`, `shard`: set to `to`, or deleted (None).
    Endpoint {
        proto: &'static str,
        shard: u8,
        key: u32,
        to: Option<SocketAddr>,
    },
    /// The `hairpin-endpoints` pair of an endpoint address: added or deleted.
    Hairpin { ip: IpAddr, add: bool },
}

impl ElementChange {
    /// The change as `nft -f` statements.
    pub fn write(&self, family: Family, out: &mut String) {
        let f = family_name(family);
        let _ = match *self {
            ElementChange::Endpoint {
                proto,
                shard,
                key,
                to: Some(to),
            } => writeln!(
                out,
                "add element {f} {TABLE} {} {{ {key} : {} . {} }}",
                map_name(proto, shard),
                to.ip(),
                to.port()
            ),
            ElementChange::Endpoint {
                proto,
                shard,
                key,
                to: None,
            } => writeln!(
                out,
                "delete element {f} {TABLE} {} {{ {key} }}",
                map_name(proto, shard)
            ),
            ElementChange::Hairpin { ip, add: true } => writeln!(
                out,
                "add element {f} {TABLE} {HAIRPIN} {{ {} }}",
                hairpin_pair(ip)
            ),
            ElementChange::Hairpin { ip, add: false } => writeln!(
                out,
                "delete element {f} {TABLE} {HAIRPIN} {{ {} }}",
                hairpin_pair(ip)
            ),
        };
    }
}

/// `add map ip fastpath endpoints-PROTO-XX { ... }`: written again by every transaction that
/// uses the map (adding a map that exists changes nothing).
pub fn declaration(family: Family, proto: &str, shard: u8) -> String {
    let f = family_name(family);
    format!(
        "add map {f} {TABLE} {} {{ typeof numgen random mod 1 : {f} daddr . {proto} dport ; comment \"endpoints of the services' chains, by slot\" ; }}\n",
        map_name(proto, shard)
    )
}

/// The rule that ends a chain with a spread of `n` endpoints in `slot`.
pub fn rule(family: Family, proto: &str, n: usize, slot: Slot) -> String {
    format!(
        "meta l4proto {proto} dnat {} addr . port to numgen random mod {n} offset {} map @{}",
        family_name(family),
        slot.base,
        slot.map()
    )
}

/// The changes that turn a chain's endpoints `old` into `new` in its slot; with `all`,
/// every endpoint of `new` is written even where it is already there.
pub fn diff(slot: Slot, old: &[SocketAddr], new: &[SocketAddr], all: bool) -> Vec<ElementChange> {
    let mut deletes = Vec::new();
    let mut adds = Vec::new();
    for i in 0..old.len().max(new.len()) {
        let key = slot.base + i as u32;
        let change = |to| ElementChange::Endpoint {
            proto: slot.proto,
            shard: slot.shard,
            key,
            to,
        };
        match (old.get(i), new.get(i)) {
            (Some(a), Some(b)) if a == b => {
                if all {
                    adds.push(change(Some(*b)));
                }
            }
            (Some(_), Some(b)) => {
                deletes.push(change(None));
                adds.push(change(Some(*b)));
            }
            (Some(_), None) => deletes.push(change(None)),
            (None, Some(b)) => adds.push(change(Some(*b))),
            (None, None) => {}
        }
    }
    deletes.extend(adds);
    deletes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_spread_over_shards_and_are_reused_once_released() {
        let mut s = Slots::default();
        let a = s.hold("a", "tcp").unwrap();
        let b = s.hold("b", "tcp").unwrap();
        assert_ne!(a.shard, b.shard);
        assert_eq!(s.hold("a", "tcp"), Some(a), "a chain keeps its slot");
        assert_ne!(a.base, 0);
        s.release_unless(|c| c != "a");
        assert_eq!(s.get("a"), None);
        // Round robin comes back to a's shard after SHARDS - 1 more.
        let later: Vec<Slot> = (0..SHARDS)
            .map(|i| s.hold(&format!("c{i}"), "tcp").unwrap())
            .collect();
        assert!(later.contains(&a), "a's slot is handed out again");
        let mut all: Vec<Slot> = later.clone();
        all.push(b);
        all.sort();
        all.dedup();
        assert_eq!(all.len(), later.len() + 1, "no slot is held twice");
    }

    #[test]
    fn a_replaced_endpoint_is_one_delete_and_one_add() {
        let slot = Slot {
            proto: "udp",
            shard: 3,
            base: SLOT_KEYS,
        };
        let e = |i: u8| SocketAddr::from(([198, 18, 0, i], 80));
        let changes = diff(slot, &[e(1), e(2), e(3)], &[e(1), e(9), e(3), e(4)], false);
        let to = |key, to| ElementChange::Endpoint {
            proto: "udp",
            shard: 3,
            key,
            to,
        };
        assert_eq!(
            changes,
            [
                to(SLOT_KEYS + 1, None),
                to(SLOT_KEYS + 1, Some(e(9))),
                to(SLOT_KEYS + 3, Some(e(4)))
            ]
        );
        let mut text = String::new();
        for c in &changes {
            c.write(Family::V4, &mut text);
        }
        assert_eq!(
            text,
            "delete element ip fastpath endpoints-udp-03 { 65537 }\n\
             add element ip fastpath endpoints-udp-03 { 65537 : 198.18.0.9 . 80 }\n\
             add element ip fastpath endpoints-udp-03 { 65539 : 198.18.0.4 . 80 }\n"
        );
    }
}
