//! What the nftables proxier really programmed, read back from `nft list table` (families
//! `ip` and `ip6`, table `fastpath`) into the same [`Programmed`] the iptables reader
//! builds: per frontend of the `service-ips` and `service-nodeports` maps, the chains its
//! traffic passes and the endpoints the spread sends it to, each with its share; the
//! `no-endpoint-*` maps' reject or drop; the `affinity-` sets' clients.
//!
//! As for iptables, this is read from the kernel, not derived from the model, so a table
//! someone changed (or a sync that failed) shows as it is.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use anyhow::Context as _;

use super::rules::{Key, Programmed, Resolved, RuleBackend, RuleFrontend};
use crate::{
    dataplane::{
        iptables::apply::run_bounded,
        netns,
        nftables::{
            listing::{Dump, Element},
            render::{Container, TABLE},
        },
    },
    model::Protocol,
};

/// Reads both families' tables in `netns` (None: this one). A family without our table is
/// left out with a note; neither having one is an error.
pub fn read(netns: Option<&str>) -> anyhow::Result<(Programmed, Vec<String>)> {
    let mut dumps = Vec::new();
    let mut notes = Vec::new();
    for family in ["ip", "ip6"] {
        let mut cmd = netns::command(netns, "nft");
        cmd.args(["list", "table", family, TABLE]);
        let text = match run_bounded(cmd, None) {
            Ok(out) => out,
            Err(e) => {
                notes.push(format!("{family} {TABLE}: {e}"));
                continue;
            }
        };
        let dump = Dump::from_listing(&text)
            .with_context(|| format!("reading `nft list table {family} {TABLE}`"))?;
        dumps.push(dump);
    }
    anyhow::ensure!(
        !dumps.is_empty(),
        "cannot read the nftables tables: {}",
        notes.join("; ")
    );
    Ok((programmed(&dumps), notes))
}

/// The frontends, resolutions and refusals of `dumps` (one per family).
pub fn programmed(dumps: &[Dump]) -> Programmed {
    let mut frontends = BTreeMap::new();
    let mut refused = BTreeMap::new();
    let mut resolved = BTreeMap::new();
    let mut targets = BTreeMap::new();
    let mut affinity = BTreeMap::new();
    for dump in dumps {
        let v6 = dump.family == "ip6";
        let any_addr = if v6 {
            IpAddr::V6(Ipv6Addr::UNSPECIFIED)
        } else {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        };
        let elements = |c: Container| {
            dump.sets
                .get(c.name())
                .map_or(&[][..], |s| s.elements.as_slice())
        };
        let cluster_ips: Vec<&str> = elements(Container::ClusterIps)
            .iter()
            .filter_map(|e| e.key.first().map(String::as_str))
            .collect();
        let firewalled: Vec<&Element> = elements(Container::FirewallIps).iter().collect();
        for e in elements(Container::ServiceIps) {
            let (Some(key), Some(chain)) = (ip_key(&e.key), goto(e)) else {
                continue;
            };
            let kind = if cluster_ips.contains(&e.key[0].as_str()) {
                "cluster IP"
            } else if firewalled.iter().any(|f| f.key == e.key) {
                "loadbalancer IP"
            } else {
                "external or loadbalancer IP"
            };
            let ranges = firewalled
                .iter()
                .find(|f| f.key == e.key)
                .and_then(|f| goto(f))
                .map(|fw| source_ranges(dump, fw))
                .unwrap_or_default();
            add_frontend(
                dump,
                key,
                kind,
                chain,
                &ranges,
                &mut frontends,
                &mut resolved,
            );
        }
        for e in elements(Container::ServiceNodeports) {
            let (Some(key), Some(chain)) = (port_key(&e.key, any_addr), goto(e)) else {
                continue;
            };
            add_frontend(
                dump,
                key,
                "node port",
                chain,
                &[],
                &mut frontends,
                &mut resolved,
            );
        }
        let no_endpoints = [
            (Container::NoEndpointServices, false),
            (Container::NoEndpointNodeports, true),
        ];
        for (c, node_port) in no_endpoints {
            for e in elements(c) {
                let key = if node_port {
                    port_key(&e.key, any_addr)
                } else {
                    ip_key(&e.key)
                };
                let Some(key) = key else { continue };
                let verdict = match e.value.as_deref() {
                    Some("drop") => ("dropped", "no endpoint this policy may use here"),
                    Some(v) if v.starts_with("goto") || v.starts_with("jump") => {
                        ("rejected", "the service has no endpoints")
                    }
                    _ => continue,
                };
                refused.insert(key, (verdict.0, verdict.1.to_string()));
            }
        }
        for (name, chain) in &dump.chains {
            for rule in &chain.rules {
                if let Some(to) = dnat_of(rule) {
                    targets.insert(to, service_of(name).unwrap_or_default());
                }
            }
        }
        for (name, set) in &dump.sets {
            if name.starts_with("affinity-") {
                let clients = set
                    .elements
                    .iter()
                    .filter_map(|e| e.key.first()?.parse().ok())
                    .collect();
                affinity.insert(name.clone(), clients);
            }
        }
    }
    Programmed::from_nftables(frontends, refused, resolved, targets, affinity)
}

fn add_frontend(
    dump: &Dump,
    key: Key,
    kind: &'static str,
    chain: &str,
    source_ranges: &[String],
    frontends: &mut BTreeMap<Key, RuleFrontend>,
    resolved: &mut BTreeMap<(Key, bool), Resolved>,
) {
    frontends.insert(
        key,
        RuleFrontend {
            service: service_of(chain),
            kind,
            chain: chain.to_string(),
        },
    );
    for from_node in [true, false] {
        let mut r = resolve(dump, chain, from_node);
        r.source_ranges = source_ranges.to_vec();
        resolved.insert((key, from_node), r);
    }
}

/// `ip . proto . port` as a frontend.
fn ip_key(key: &[String]) -> Option<Key> {
    let [ip, proto, port] = key else { return None };
    Some((ip.parse().ok()?, port.parse().ok()?, proto_of(proto)?))
}

/// `proto . port` (a node port) as a frontend on any address.
fn port_key(key: &[String], any: IpAddr) -> Option<Key> {
    let [proto, port] = key else { return None };
    Some((any, port.parse().ok()?, proto_of(proto)?))
}

fn proto_of(word: &str) -> Option<Protocol> {
    Protocol::from_k8s(Some(&word.to_ascii_uppercase()))
}

/// A map element's `goto CHAIN`.
fn goto(e: &Element) -> Option<&str> {
    e.value.as_deref()?.strip_prefix("goto ").map(str::trim)
}

/// `ns/name:port` from a per-service chain's name, `service-HASH-ns/name/proto/port`.
fn service_of(chain: &str) -> Option<String> {
    let (_, rest) = chain.split_once('-')?;
    let (_, path) = rest.split_once('-')?;
    let parts: Vec<&str> = path.split("__").next()?.split('/').collect();
    let [ns, name, _proto, port] = parts[..] else {
        return None;
    };
    Some(format!("{ns}/{name}:{port}"))
}

/// The rule without its trailing `comment "..."`.
fn without_comment(rule: &str) -> &str {
    match rule.find(" comment \"") {
        Some(i) => &rule[..i],
        None => rule,
    }
}

/// The address a rule DNATs to (`dnat to A:P`, `dnat ip to A:P`).
fn dnat_of(rule: &str) -> Option<SocketAddr> {
    let rule = without_comment(rule);
    let (_, after) = rule.split_once("dnat ")?;
    let after = after
        .strip_prefix("ip ")
        .or_else(|| after.strip_prefix("ip6 "))
        .unwrap_or(after);
    after.strip_prefix("to ")?.split(' ').next()?.parse().ok()
}

/// The `ip saddr != { a , b } drop` ranges of a firewall chain.
fn source_ranges(dump: &Dump, chain: &str) -> Vec<String> {
    let Some(c) = dump.chains.get(chain) else {
        return Vec::new();
    };
    c.rules
        .iter()
        .filter_map(|r| {
            let (_, set) = r.split_once("saddr != ")?;
            let inner = set.split_once('{')?.1.split_once('}')?.0;
            Some(
                inner
                    .split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect::<Vec<_>>(),
            )
        })
        .flatten()
        .collect()
}

/// Where traffic entering `start` goes: external chains lead on (from this node, to the
/// "short-circuit local traffic" chain; from elsewhere, to the policy chain), a balancing
/// chain spreads it over its endpoints.
fn resolve(dump: &Dump, start: &str, from_node: bool) -> Resolved {
    let mut out = Resolved::default();
    let mut chain = start.to_string();
    // Bounded: external -> service/local is the longest path the renderer writes.
    for _ in 0..4 {
        out.path.push(chain.clone());
        let Some(c) = dump.chains.get(&chain) else {
            return out;
        };
        let rules: Vec<&str> = c.rules.iter().map(|r| without_comment(r).trim()).collect();
        let is_spread = rules
            .iter()
            .any(|r| r.starts_with("numgen ") || dnat_of(r).is_some());
        if is_spread {
            spread(dump, &chain, &rules, &mut out);
            return out;
        }
        let local = rules
            .iter()
            .find_map(|r| r.strip_prefix("fib saddr type local goto "));
        let plain = rules.iter().find_map(|r| r.strip_prefix("goto "));
        match (from_node, local, plain) {
            (true, Some(next), _) | (_, _, Some(next)) => chain = next.trim().to_string(),
            _ => return out,
        }
    }
    out
}

/// A balancing chain's endpoints: rule i of n takes 1/k of what reaches it
/// (`numgen random mod k 0 ...`), the last rule the rest.
fn spread(dump: &Dump, chain: &str, rules: &[&str], out: &mut Resolved) {
    let mut left = 1.0f64;
    for rule in rules {
        if let Some(set) = rule
            .split_once("saddr @")
            .map(|(_, s)| s.split(' ').next().unwrap_or_default())
        {
            out.affinity_timeout = dump.sets.get(set).and_then(|s| s.timeout_secs);
            continue;
        }
        let (share, action) = match rule.strip_prefix("numgen random mod ") {
            Some(rest) => {
                let Some((k, action)) = rest.split_once(' ') else {
                    continue;
                };
                let action = action.strip_prefix("== ").unwrap_or(action);
                let Some(action) = action.strip_prefix("0 ") else {
                    continue;
                };
                let Ok(k) = k.parse::<f64>() else { continue };
                (left / k.max(1.0), action)
            }
            None if rule.starts_with("goto ") || dnat_of(rule).is_some() => (left, *rule),
            None => continue,
        };
        left -= share;
        let (sep, addr) = match action.strip_prefix("goto ") {
            Some(ep_chain) => {
                let ep_chain = ep_chain.trim();
                let addr = dump
                    .chains
                    .get(ep_chain)
                    .and_then(|c| c.rules.iter().find_map(|r| dnat_of(r)));
                (ep_chain.to_string(), addr)
            }
            None => (chain.to_string(), dnat_of(action)),
        };
        out.backends.push(RuleBackend {
            addr,
            sep,
            probability: share,
        });
        if left <= 1e-12 {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        dataplane::{
            iptables::{Family, RenderConfig, render::LocalTraffic},
            nftables::render::render_full,
        },
        model::{
            Service, ServiceKey, ServicePort,
            testing::{ep, eps, node, state},
        },
    };

    fn web(affinity: Option<u32>) -> Service {
        let mut s = Service::cluster_ip(
            ServiceKey::new("demo", "web"),
            vec!["198.19.0.10".parse().unwrap()],
            vec![ServicePort {
                // The name the testing slices' port has.
                name: "p80".into(),
                port: 80,
                protocol: Protocol::Tcp,
                node_port: Some(30080),
            }],
        );
        s.affinity_timeout = affinity;
        s
    }

    fn read_back(svc: Service, endpoints: Vec<&str>) -> Programmed {
        let list = endpoints.iter().map(|ip| ep(ip, "node-b")).collect();
        let st = state(vec![(svc, Some(eps(list)))]);
        let cfg = RenderConfig {
            local_traffic: LocalTraffic::Cidrs(vec![("198.18.0.0".parse().unwrap(), 16)]),
            ..RenderConfig::default()
        };
        let text = render_full(&st, &node(), Family::V4, &cfg);
        programmed(&[Dump::parse(&text).unwrap()])
    }

    #[test]
    fn a_cluster_ip_and_node_port_resolve_to_their_endpoints_with_even_shares() {
        let p = read_back(web(None), vec!["198.18.1.11", "198.18.1.12", "198.18.1.13"]);
        let key = ("198.19.0.10".parse().unwrap(), 80, Protocol::Tcp);
        let fe = &p.frontends[&key];
        assert_eq!(fe.kind, "cluster IP");
        assert_eq!(fe.service.as_deref(), Some("demo/web:p80"));
        let r = p.resolve(&key, true).unwrap();
        let got: Vec<(String, f64)> = r
            .backends
            .iter()
            .map(|b| (b.addr.unwrap().to_string(), b.probability))
            .collect();
        assert_eq!(got.len(), 3, "{r:?}");
        for (addr, share) in &got {
            assert!(addr.ends_with(":80"), "{got:?}");
            assert!((share - 1.0 / 3.0).abs() < 1e-9, "{got:?}");
        }
        let np = (IpAddr::V4(Ipv4Addr::UNSPECIFIED), 30080, Protocol::Tcp);
        let r = p.resolve(&np, false).unwrap();
        assert_eq!(r.path.len(), 2, "external, then the service chain: {r:?}");
        assert_eq!(r.backends.len(), 3);
        assert_eq!(p.dnat_targets().len(), 3);
    }

    #[test]
    fn affinity_endpoints_resolve_through_their_chains() {
        let p = read_back(web(Some(600)), vec!["198.18.1.11", "198.18.1.12"]);
        let key = ("198.19.0.10".parse().unwrap(), 80, Protocol::Tcp);
        let r = p.resolve(&key, true).unwrap();
        assert_eq!(r.affinity_timeout, Some(600));
        assert!(
            r.backends.iter().all(|b| b.sep.starts_with("endpoint-")),
            "{r:?}"
        );
        assert!(r.backends.iter().all(|b| b.addr.is_some()), "{r:?}");
    }

    #[test]
    fn a_service_without_endpoints_is_rejected() {
        let p = read_back(web(None), vec![]);
        let key = ("198.19.0.10".parse().unwrap(), 80, Protocol::Tcp);
        assert!(!p.frontends.contains_key(&key));
        assert_eq!(p.refused[&key].0, "rejected");
    }

    #[test]
    fn durations_and_names_read_as_nft_writes_them() {
        use crate::dataplane::nftables::listing::parse_duration;
        assert_eq!(parse_duration("3h"), Some(10_800));
        assert_eq!(parse_duration("10800s"), Some(10_800));
        assert_eq!(parse_duration("1d2h3m4s500ms"), Some(93_784));
        assert_eq!(parse_duration("h"), None);
        assert_eq!(parse_duration("12"), None);
        assert_eq!(
            service_of("service-ULMVA6XW-ns1/svc1/tcp/p80").as_deref(),
            Some("ns1/svc1:p80")
        );
        assert_eq!(
            dnat_of("numgen random mod 2 0 meta l4proto tcp dnat ip to 198.18.1.1:80"),
            Some("198.18.1.1:80".parse().unwrap())
        );
        assert_eq!(
            dnat_of("meta l4proto tcp dnat to [2001:db8::1]:80"),
            Some("[2001:db8::1]:80".parse().unwrap())
        );
    }
}
