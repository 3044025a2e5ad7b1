//! Reading endpoint maps back: a DNAT through `@endpoints-tcp-XX` stands for the spread it
//! picks from, written out as one rule per endpoint (`numgen random mod k 0 ... dnat to
//! A:P`, the form a chain whose endpoints outgrow a slot has anyway), so `inspect`, the
//! ported kube-proxy tests and their tracer read one form. Maps that hold an element no
//! rule can reach, or miss one a rule can, are errors: a partial sync got them wrong.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
};

use super::Dump;
use crate::dataplane::nftables::render::{endpoints::MAP_PREFIX, spread};

/// A rule's DNAT through an endpoint map: what comes before `dnat`, n, the offset, the map.
fn map_dnat(rule: &str) -> Option<(&str, u32, u32, &str)> {
    let at = rule.find("dnat ")?;
    let (prefix, rest) = rule.split_at(at);
    let rest = rest.strip_prefix("dnat ")?;
    let rest = rest
        .strip_prefix("ip ")
        .or_else(|| rest.strip_prefix("ip6 "))?;
    let rest = rest.strip_prefix("addr . port ").unwrap_or(rest);
    let rest = rest.strip_prefix("to numgen random mod ")?;
    let (n, rest) = rest.split_once(' ')?;
    let (offset, rest) = match rest.strip_prefix("offset ") {
        Some(r) => {
            let (o, r) = r.split_once(' ')?;
            (o.parse().ok()?, r)
        }
        None => (0, rest),
    };
    let map = rest.strip_prefix("map @")?;
    (!map.contains(' ')).then_some((prefix, n.parse().ok()?, offset, map))
}

/// An endpoint map's value, `A . P`.
fn endpoint_of(value: &str) -> Option<SocketAddr> {
    let (ip, port) = value.split_once(" . ")?;
    Some(SocketAddr::new(
        ip.trim().parse::<IpAddr>().ok()?,
        port.trim().parse().ok()?,
    ))
}

impl Dump {
    /// Replaces every DNAT through an endpoint map with its spread, and drops the maps.
    pub(super) fn inline_endpoint_maps(&mut self) -> Result<(), String> {
        let mut maps: BTreeMap<String, BTreeMap<u32, SocketAddr>> = BTreeMap::new();
        for (name, set) in &self.sets {
            if !name.starts_with(MAP_PREFIX) {
                continue;
            }
            let mut by_key = BTreeMap::new();
            for e in &set.elements {
                let key = e.key.first().and_then(|k| k.trim().parse::<u32>().ok());
                let to = e.value.as_deref().and_then(endpoint_of);
                match (key, to) {
                    (Some(k), Some(to)) => by_key.insert(k, to),
                    _ => {
                        return Err(format!(
                            "map {name}: element {e:?} is not key : addr . port"
                        ));
                    }
                };
            }
            maps.insert(name.clone(), by_key);
        }
        let mut reached: BTreeSet<(String, u32)> = BTreeSet::new();
        for (chain_name, chain) in &mut self.chains {
            let mut rules = Vec::with_capacity(chain.rules.len());
            for rule in &chain.rules {
                let Some((prefix, n, offset, map)) = map_dnat(rule) else {
                    rules.push(rule.clone());
                    continue;
                };
                let elements = maps
                    .get(map)
                    .ok_or_else(|| format!("chain {chain_name}: no map {map}"))?;
                let mut dnats = Vec::new();
                for i in 0..n {
                    let key = offset
                        .checked_add(i)
                        .ok_or_else(|| format!("chain {chain_name}: keys past 2^32"))?;
                    let to = elements.get(&key).ok_or_else(|| {
                        format!("chain {chain_name}: map {map} has no key {key} of {n}")
                    })?;
                    reached.insert((map.to_string(), key));
                    dnats.push(format!("{prefix}dnat to {to}"));
                }
                rules.extend(spread(dnats.iter().map(String::as_str)));
            }
            chain.rules = rules;
        }
        for (map, elements) in &maps {
            if let Some(key) = elements
                .keys()
                .find(|&&k| !reached.contains(&(map.clone(), k)))
            {
                return Err(format!("map {map} holds key {key}, which no rule reaches"));
            }
        }
        self.sets.retain(|name, _| !name.starts_with(MAP_PREFIX));
        Ok(())
    }
}

/// A whole table's `add` statements with every DNAT through an endpoint map written as
/// its spread and the maps left out, in place: the form kube-proxy's expected dumps take
/// (`kube_tests::as_ours`). One element a line, as our writer puts them.
#[cfg(test)]
pub fn inline_text(text: &str) -> String {
    let element = |line: &str| -> Option<((String, u32), SocketAddr)> {
        let rest = line.strip_prefix("add element ")?;
        let mut words = rest.splitn(4, ' ');
        let (_, _, map, body) = (words.next()?, words.next()?, words.next()?, words.next()?);
        if !map.starts_with(MAP_PREFIX) {
            return None;
        }
        let body = body.strip_prefix("{ ")?.strip_suffix(" }")?;
        let (key, value) = body.split_once(" : ")?;
        Some(((map.to_string(), key.parse().ok()?), endpoint_of(value)?))
    };
    let elements: BTreeMap<(String, u32), SocketAddr> = text.lines().filter_map(element).collect();
    let mut out = String::new();
    for line in text.lines() {
        let is_map = |kind: &str| {
            line.strip_prefix(kind)
                .and_then(|r| r.splitn(3, ' ').nth(2))
                .is_some_and(|n| n.starts_with(MAP_PREFIX))
        };
        if is_map("add map ") || is_map("add element ") {
            continue;
        }
        let rule = line.strip_prefix("add rule ").and_then(|r| {
            let mut words = r.splitn(4, ' ');
            let head_len = words.by_ref().take(3).map(|w| w.len() + 1).sum::<usize>();
            let (head, body) = r.split_at(head_len);
            Some((head, map_dnat(body)?))
        });
        let Some((head, (prefix, n, offset, map))) = rule else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let dnats: Vec<String> = (0..n)
            .map(|i| {
                let key = offset.wrapping_add(i);
                match elements.get(&(map.to_string(), key)) {
                    Some(to) => format!("{prefix}dnat to {to}"),
                    None => format!("{prefix}dnat to <no key {key} in {map}>"),
                }
            })
            .collect();
        for r in spread(dnats.iter().map(String::as_str)) {
            out.push_str(&format!("add rule {head}{r}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_dnat_reads_as_its_spread_and_stray_keys_are_errors() {
        let table = "add table ip fastpath\n\
            add chain ip fastpath svc\n\
            add map ip fastpath endpoints-tcp-01 { typeof numgen random mod 1 : ip daddr . tcp dport ; }\n\
            add rule ip fastpath svc meta l4proto tcp dnat ip addr . port to numgen random mod 2 offset 65536 map @endpoints-tcp-01\n\
            add element ip fastpath endpoints-tcp-01 { 65536 : 198.18.0.1 . 80 }\n\
            add element ip fastpath endpoints-tcp-01 { 65537 : 198.18.0.2 . 8080 }\n";
        let dump = Dump::parse(table).unwrap();
        assert_eq!(
            dump.chains["svc"].rules,
            [
                "numgen random mod 2 0 meta l4proto tcp dnat to 198.18.0.1:80",
                "meta l4proto tcp dnat to 198.18.0.2:8080"
            ]
        );
        assert!(dump.sets.is_empty());
        // nft's listing drops `addr . port`.
        let listed = table.replace("dnat ip addr . port to", "dnat ip to");
        assert_eq!(Dump::parse(&listed).unwrap(), dump);
        let stray = format!(
            "{table}add element ip fastpath endpoints-tcp-01 {{ 70000 : 198.18.0.3 . 80 }}\n"
        );
        let err = Dump::parse(&stray).unwrap_err();
        assert!(err.message.contains("70000"), "{err:?}");
        let missing = table.replace(
            "add element ip fastpath endpoints-tcp-01 { 65537 : 198.18.0.2 . 8080 }\n",
            "",
        );
        assert!(Dump::parse(&missing).unwrap_err().message.contains("65537"));
    }
}
