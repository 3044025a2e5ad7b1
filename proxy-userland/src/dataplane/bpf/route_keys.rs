//! Whether ports steer routes on this node, kept in `FP_ROUTE_KEYS` for the packet path
//! (see the eBPF crate's `route`): where they do not, the FIB's answers are remembered per
//! address pair, so a new flow's packets need not ask the FIB.
//!
//! Two things make the FIB answer flows between the same two addresses differently by port:
//! a routing rule with a port range (`ip rule add sport|dport ...`), and a multipath route
//! hashed on ports (`fib_multipath_hash_policy` 1, or 3 with port fields). What else a
//! rule may select (protocol, incoming device) is in the key, and what the packet path
//! never passes the FIB (marks, TOS, flow labels, users) is the same for every flow.
//!
//! A thread of its own looks at both at start, whenever the kernel reports a rule change,
//! and twice a second anyway (sysctls send no news). Until it has looked, and while a look
//! fails, the key is the whole tuple, as it always is where ports do steer.

use std::{io, mem::size_of, sync::atomic::Ordering, time::Duration};

use aya::maps::{Array, MapData};
use bytemuck::{Pod, Zeroable};
use proxy_common::maps::ROUTES_BY_ADDRESS;

use crate::dataplane::{
    netlink::{NetlinkSocket, attributes},
    netns,
    watcher::Watcher,
};

const RTM_NEWRULE: u16 = 32;
const RTM_GETRULE: u16 = 34;
const FRA_SPORT_RANGE: u16 = 23;
const FRA_DPORT_RANGE: u16 = 24;
/// rtnetlink's rule groups as bind's bit mask: RTNLGRP_IPV4_RULE (8), RTNLGRP_IPV6_RULE (19).
const RULE_GROUPS: u32 = (1 << (8 - 1)) | (1 << (19 - 1));
/// `fib_multipath_hash_fields` bits that read ports: outer and inner, source and
/// destination (include/net/ip_fib.h).
const PORT_FIELDS: u32 = (1 << 4) | (1 << 5) | (1 << 10) | (1 << 11);
/// How long the thread waits for news of a rule before looking anyway.
const RECHECK: Duration = Duration::from_millis(500);

/// `struct fib_rule_hdr` (linux/fib_rules.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
struct FibRuleHdr {
    family: u8,
    dst_len: u8,
    src_len: u8,
    tos: u8,
    table: u8,
    res1: u8,
    res2: u8,
    action: u8,
    flags: u32,
}
const _: () = assert!(size_of::<FibRuleHdr>() == 12);

/// Why ports may steer a route in this thread's network namespace; None where they cannot.
pub fn ports_steer_routes() -> io::Result<Option<String>> {
    for family in [libc::AF_INET, libc::AF_INET6] {
        if let Some(why) = rule_by_port(family)? {
            return Ok(Some(why));
        }
    }
    for family in ["ipv4", "ipv6"] {
        let sysctl = |name: &str| read_sysctl(&format!("/proc/sys/net/{family}/{name}"));
        // No file: no such family (IPv6 disabled), or a kernel without the knob.
        let Some(policy) = sysctl("fib_multipath_hash_policy")? else {
            continue;
        };
        if multipath_hashes_ports(policy, sysctl("fib_multipath_hash_fields")?) {
            return Ok(Some(format!(
                "net.{family}.fib_multipath_hash_policy is {policy}: multipath routes hash ports"
            )));
        }
    }
    Ok(None)
}

/// Whether a multipath hash `policy` (with `fields`, policy 3's) reads ports. A policy this
/// code does not know is taken to.
fn multipath_hashes_ports(policy: u32, fields: Option<u32>) -> bool {
    match policy {
        // Layer 3; layer 3 of the inner packet.
        0 | 2 => false,
        3 => fields.is_none_or(|f| f & PORT_FIELDS != 0),
        _ => true,
    }
}

fn read_sysctl(path: &str) -> io::Result<Option<u32>> {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let text = text.trim();
            // The fields are written in hex ("0x0037"), the policy in decimal.
            let value = match text.strip_prefix("0x") {
                Some(hex) => u32::from_str_radix(hex, 16),
                None => text.parse(),
            };
            value
                .map(Some)
                .map_err(|e| io::Error::other(format!("{path}: {text:?}: {e}")))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io::Error::other(format!("{path}: {e}"))),
    }
}

/// A rule of `family` that selects ports, described; one RTM_GETRULE dump.
fn rule_by_port(family: libc::c_int) -> io::Result<Option<String>> {
    let rule = FibRuleHdr {
        family: family as u8,
        ..FibRuleHdr::default()
    };
    let socket = NetlinkSocket::route_dump(RTM_GETRULE, bytemuck::bytes_of(&rule))?;
    let mut found = None;
    let dumped = socket.read_dump("rtnetlink rule", |ty, body| {
        if ty == RTM_NEWRULE && found.is_none() {
            found = port_selector(body).map(|which| {
                let family = if family == libc::AF_INET {
                    "IPv4"
                } else {
                    "IPv6"
                };
                format!("an {family} routing rule selects {which} ports")
            });
        }
    });
    match dumped {
        // No rules for a family the kernel does not have (IPv6 disabled).
        Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => Ok(None),
        Err(e) => Err(e),
        Ok(()) => Ok(found),
    }
}

/// Which ports an RTM_NEWRULE body's rule selects, if any.
fn port_selector(body: &[u8]) -> Option<&'static str> {
    attributes(body.get(size_of::<FibRuleHdr>()..)?).find_map(|(ty, _)| match ty {
        FRA_SPORT_RANGE => Some("source"),
        FRA_DPORT_RANGE => Some("destination"),
        _ => None,
    })
}

/// Why ports may steer a route in any of `namespaces` (None: ours), the ones the packet
/// path's devices are in.
fn verdict(namespaces: &[Option<String>]) -> io::Result<Option<String>> {
    for ns in namespaces {
        let found = netns::in_netns(ns.as_deref(), ports_steer_routes)
            .map_err(|e| io::Error::other(e.to_string()))??;
        if found.is_some() {
            return Ok(found);
        }
    }
    Ok(None)
}

/// A socket told of every rule change in `ns` (None: ours), where it was made.
fn rule_news(ns: Option<&str>) -> io::Result<NetlinkSocket> {
    NetlinkSocket::news_in(ns, libc::NETLINK_ROUTE, RULE_GROUPS)
}

/// Keeps `FP_ROUTE_KEYS` up to date until dropped.
pub struct RouteKeys {
    _watcher: Watcher,
}

impl RouteKeys {
    /// Looks once and writes the answer (so the caller knows the map takes it), then keeps
    /// looking from a thread. `namespaces`: where the programs' devices are (None: ours);
    /// rule news comes from the first, the others are looked at twice a second.
    pub fn start(map: Array<MapData, u32>, namespaces: Vec<Option<String>>) -> io::Result<Self> {
        let mut keys = Keys {
            map,
            by_address: None,
        };
        keys.update(verdict(&namespaces))?;
        Watcher::spawn("fp-route-keys", move |stop| {
            let first = namespaces.first().cloned().flatten();
            let news = rule_news(first.as_deref())
                .inspect_err(|e| {
                    tracing::warn!("route keys: no rule events ({e}); looking twice a second")
                })
                .ok();
            while !stop.load(Ordering::Relaxed) {
                NetlinkSocket::wait_or_sleep(news.as_ref(), RECHECK, "route keys");
                if let Err(e) = keys.update(verdict(&namespaces)) {
                    tracing::warn!("route keys: {e}");
                }
            }
        })
        .map(|w| Self { _watcher: w })
    }
}

/// The map and what was last written to it.
struct Keys {
    map: Array<MapData, u32>,
    by_address: Option<bool>,
}

impl Keys {
    /// Writes what a look found, if it changed: by address where ports steer nothing, by
    /// the whole tuple where they may or the look failed.
    fn update(&mut self, verdict: io::Result<Option<String>>) -> io::Result<()> {
        let by_address = matches!(verdict, Ok(None));
        if self.by_address == Some(by_address) {
            return Ok(());
        }
        let value = if by_address { ROUTES_BY_ADDRESS } else { 0 };
        self.map
            .set(0, value, 0)
            .map_err(|e| io::Error::other(format!("writing the route keys: {e}")))?;
        self.by_address = Some(by_address);
        match verdict {
            Ok(None) => tracing::info!(
                "no port steers a route: the FIB's answers are kept per address pair"
            ),
            Ok(Some(why)) => tracing::info!("{why}: the FIB's answers are kept per flow"),
            Err(e) => tracing::warn!(
                "cannot tell whether ports steer routes ({e}): the FIB's answers are kept per flow"
            ),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::netlink::attribute;

    #[test]
    fn only_port_hashing_policies_count() {
        assert!(!multipath_hashes_ports(0, None));
        assert!(multipath_hashes_ports(1, None));
        assert!(!multipath_hashes_ports(2, Some(0x37)));
        // Custom: the default fields (0x0037) include both ports; addresses alone do not.
        assert!(multipath_hashes_ports(3, Some(0x0037)));
        assert!(!multipath_hashes_ports(3, Some(0x0003)));
        assert!(multipath_hashes_ports(3, Some(0x0800)));
        assert!(multipath_hashes_ports(3, None));
        assert!(multipath_hashes_ports(7, Some(0)));
    }

    #[test]
    fn rules_with_port_ranges_are_found_and_bad_bodies_are_not_trusted() {
        let mut body = bytemuck::bytes_of(&FibRuleHdr {
            family: libc::AF_INET as u8,
            ..FibRuleHdr::default()
        })
        .to_vec();
        body.extend(attribute(6, &100u32.to_ne_bytes()));
        assert_eq!(port_selector(&body), None);
        let mut dport = body.clone();
        dport.extend(attribute(FRA_DPORT_RANGE, &[0x40, 0x9c, 0x9f, 0x9c]));
        assert_eq!(port_selector(&dport), Some("destination"));
        body.extend(attribute(FRA_SPORT_RANGE, &[0, 0, 0, 0]));
        assert_eq!(port_selector(&body), Some("source"));
        assert_eq!(port_selector(&body[..5]), None);
    }
}
