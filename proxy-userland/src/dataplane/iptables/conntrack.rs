//! UDP conntrack clean-up, as kube-proxy reconciles it (pkg/proxy/conntrack/cleanup.go).
//!
//! A UDP "connection" lives in conntrack as long as packets keep coming, and every packet
//! of it follows the DNAT chosen for the first one. When a UDP endpoint goes away, a
//! client that keeps sending from the same port (a DNS resolver, a game, a syslog sender)
//! would keep sending to the dead address forever; when a service had no endpoints, its
//! entries are not translated at all. So after each sync that changed a UDP service, the
//! entries whose original destination is a service address (cluster, external or
//! load-balancer IP and port, or a node port) and whose reply does not come from one of
//! that service's serving endpoints are deleted; the next packet is then translated by
//! the current rules.
//!
//! Beyond kube-proxy's reconciler (which skips services without endpoints), a UDP service
//! that lost all its endpoints or was deleted gets its translated entries deleted too, so
//! that the client is refused at once instead of sending into a dead pod.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
};

use super::render::Family;
use crate::model::{EndpointSet, Protocol, Service, select};

/// One UDP conntrack entry: the original tuple and the reply's source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Flow {
    pub orig_src: IpAddr,
    pub orig_dst: IpAddr,
    pub orig_sport: u16,
    pub orig_dport: u16,
    /// Where replies come from: the endpoint the entry was translated to, or the original
    /// destination when it was not translated.
    pub reply_src: IpAddr,
    pub reply_sport: u16,
    /// The kernel's id of the entry (ctnetlink's CTA_ID), when listed over netlink: a
    /// delete that carries it removes this entry only, not a new one that took its tuple
    /// since the listing.
    pub id: Option<u32>,
}

/// What one batch of deletions did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Deleted {
    pub deleted: usize,
    /// Gone before we asked (expired, or deleted by someone else): no error.
    pub already_gone: usize,
    /// The entries the kernel refused to delete, with its reason.
    pub failed: Vec<(Flow, String)>,
}

impl Flow {
    fn translated(&self) -> bool {
        self.reply_src != self.orig_dst || self.reply_sport != self.orig_dport
    }
}

/// The UDP entries in `conntrack -L -p udp` output; lines that do not parse are skipped.
pub fn parse_list(text: &str) -> Vec<Flow> {
    parse_entries(text)
        .into_iter()
        .filter(|e| e.proto == "udp")
        .map(|e| Flow {
            orig_src: e.orig.src.ip(),
            orig_dst: e.orig.dst.ip(),
            orig_sport: e.orig.src.port(),
            orig_dport: e.orig.dst.port(),
            reply_src: e.reply.src.ip(),
            reply_sport: e.reply.src.port(),
            id: None,
        })
        .collect()
}

/// One direction of a conntrack entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuple {
    pub src: SocketAddr,
    pub dst: SocketAddr,
}

/// One entry of `conntrack -L`, any protocol with ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// `tcp`, `udp`, `sctp`.
    pub proto: String,
    /// Seconds until the entry expires unless another packet comes.
    pub timeout_secs: u64,
    /// The protocol's state (`ESTABLISHED`, `TIME_WAIT`; none for UDP).
    pub state: Option<String>,
    pub orig: Tuple,
    /// Where replies come from and go to: the backend, and the client or the SNAT address.
    pub reply: Tuple,
    pub unreplied: bool,
    pub assured: bool,
}

/// The entries in `conntrack -L` output: `PROTO NUM TIMEOUT [STATE] src= dst= sport= dport=
/// [[UNREPLIED]] src= dst= sport= dport= [[ASSURED]] ...`. Lines without two tuples with
/// ports (ICMP, the summary) are skipped.
pub fn parse_entries(text: &str) -> Vec<Entry> {
    text.lines().filter_map(parse_entry).collect()
}

fn parse_entry(line: &str) -> Option<Entry> {
    let mut words = line.split_whitespace();
    let proto = words.next()?.to_string();
    let _number: u8 = words.next()?.parse().ok()?;
    let timeout_secs: u64 = words.next()?.parse().ok()?;
    let (mut src, mut dst, mut sport, mut dport) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut state, mut unreplied, mut assured) = (None, false, false);
    for w in words {
        let Some((k, v)) = w.split_once('=') else {
            match w {
                "[UNREPLIED]" => unreplied = true,
                "[ASSURED]" => assured = true,
                _ if src.is_empty() && w.chars().all(|c| c.is_ascii_uppercase() || c == '_') => {
                    state = Some(w.to_string())
                }
                _ => {}
            }
            continue;
        };
        match k {
            "src" => src.push(v.parse::<IpAddr>().ok()?),
            "dst" => dst.push(v.parse::<IpAddr>().ok()?),
            "sport" => sport.push(v.parse::<u16>().ok()?),
            "dport" => dport.push(v.parse::<u16>().ok()?),
            _ => {}
        }
    }
    let tuple = |i: usize| -> Option<Tuple> {
        Some(Tuple {
            src: SocketAddr::new(*src.get(i)?, *sport.get(i)?),
            dst: SocketAddr::new(*dst.get(i)?, *dport.get(i)?),
        })
    };
    Some(Entry {
        proto,
        timeout_secs,
        state,
        orig: tuple(0)?,
        reply: tuple(1)?,
        unreplied,
        assured,
    })
}

/// Where UDP clients send to reach a service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum UdpTarget {
    /// A cluster, external or load-balancer IP and the service port.
    Addr(SocketAddr),
    /// A node port, on any node address.
    NodePort(u16),
}

/// Each UDP target of some services with the serving endpoints behind it (empty: none).
pub type UdpTargets = BTreeMap<UdpTarget, BTreeSet<SocketAddr>>;

/// One service's UDP targets in `family`, with its serving endpoints of that family. As in
/// kube-proxy, traffic policies and topology are not taken into account: an entry to any
/// serving endpoint may stay.
pub fn udp_targets(svc: &Service, eps: Option<&EndpointSet>, family: Family) -> UdpTargets {
    let mut out = UdpTargets::new();
    let ours = |ip: &&IpAddr| Family::of(ip) == family;
    for port in svc.ports.iter().filter(|p| p.protocol == Protocol::Udp) {
        let serving: BTreeSet<SocketAddr> = eps
            .map(|set| select::endpoints_for_port(set, port))
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.endpoint.serving && Family::of(&e.ip) == family)
            .map(|e| SocketAddr::new(e.ip, e.port))
            .collect();
        let addrs = svc
            .cluster_ips
            .iter()
            .chain(&svc.external_ips)
            .chain(&svc.load_balancer_ips);
        for &ip in addrs.filter(ours) {
            out.insert(
                UdpTarget::Addr(SocketAddr::new(ip, port.port)),
                serving.clone(),
            );
        }
        // A single-stack service of the other family has no node port in this family.
        if let Some(np) = port.node_port
            && svc.cluster_ips.iter().any(|ip| Family::of(ip) == family)
        {
            out.insert(UdpTarget::NodePort(np), serving.clone());
        }
    }
    out
}

/// What a sync's UDP conntrack clean-up must look at, for the rule-based modes: updates
/// `remembered` (each service's UDP targets and their serving endpoints, as last synced)
/// for `keys`, and returns every remembered target with its endpoints, plus the targets
/// that went away with none. None when nothing changed, unless a full sync has targets to
/// check anyway.
pub fn targets_to_clean(
    remembered: &mut BTreeMap<crate::model::ServiceKey, UdpTargets>,
    state: &crate::model::ProxyState,
    keys: &BTreeSet<crate::model::ServiceKey>,
    family: Family,
    full: bool,
) -> Option<UdpTargets> {
    let mut gone: Vec<UdpTarget> = Vec::new();
    let mut any_change = false;
    for key in keys {
        let now = state
            .services
            .get(key)
            .map(|svc| udp_targets(svc, state.endpoints.get(key).map(|e| &**e), family))
            .unwrap_or_default();
        let before = remembered.get(key);
        if before == Some(&now) || (before.is_none() && now.is_empty()) {
            continue;
        }
        any_change = true;
        gone.extend(
            before
                .into_iter()
                .flat_map(|b| b.keys())
                .filter(|t| !now.contains_key(t)),
        );
        if now.is_empty() {
            remembered.remove(key);
        } else {
            remembered.insert(key.clone(), now);
        }
    }
    if !any_change && (!full || remembered.is_empty()) {
        return None;
    }
    let mut targets: UdpTargets = gone.into_iter().map(|t| (t, BTreeSet::new())).collect();
    for t in remembered.values() {
        for (target, eps) in t {
            targets
                .entry(*target)
                .or_default()
                .extend(eps.iter().copied());
        }
    }
    Some(targets)
}

/// The entries to delete: those sent to a target whose reply does not come from one of the
/// target's serving endpoints; for a target without endpoints (its service lost them all,
/// or is gone), those that were translated.
pub fn stale<'a>(flows: &'a [Flow], targets: &UdpTargets) -> Vec<&'a Flow> {
    flows
        .iter()
        .filter(|f| {
            let reply = SocketAddr::new(f.reply_src, f.reply_sport);
            let wrong = |eps: &BTreeSet<SocketAddr>| {
                if eps.is_empty() {
                    f.translated()
                } else {
                    !eps.contains(&reply)
                }
            };
            let to_addr = targets.get(&UdpTarget::Addr(SocketAddr::new(f.orig_dst, f.orig_dport)));
            let to_node_port = targets.get(&UdpTarget::NodePort(f.orig_dport));
            to_addr.is_some_and(wrong) || to_node_port.is_some_and(wrong)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIST: &str = "\
udp      17 29 src=198.18.0.2 dst=198.19.0.10 sport=12345 dport=53 src=198.18.1.11 dst=198.18.0.2 sport=53 dport=12345 [ASSURED] mark=0 use=1
udp      17 25 src=198.18.0.2 dst=198.19.0.10 sport=12346 dport=53 [UNREPLIED] src=198.19.0.10 dst=198.18.0.2 sport=53 dport=12346 mark=0 use=1
udp      17 25 src=198.18.0.3 dst=198.18.0.1 sport=4000 dport=30053 src=198.18.1.12 dst=198.18.0.1 sport=53 dport=4000 mark=0 use=1
udp      17 25 src=198.18.0.3 dst=198.18.9.9 sport=4001 dport=9999 src=198.18.9.9 dst=198.18.0.3 sport=9999 dport=4001 mark=0 use=1
tcp      6 431999 ESTABLISHED src=198.18.0.2 dst=198.19.0.10 sport=40000 dport=80 src=198.18.1.11 dst=198.18.0.2 sport=80 dport=40000 [ASSURED] mark=0 use=1
conntrack v1.4.7 (conntrack-tools): 5 flow entries have been shown.
";

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn conntrack_listing_parses_into_udp_flows() {
        let flows = parse_list(LIST);
        assert_eq!(flows.len(), 4, "the TCP entry and the summary are skipped");
        assert_eq!(flows[0].reply_src, "198.18.1.11".parse::<IpAddr>().unwrap());
        assert_eq!(
            (
                flows[0].orig_sport,
                flows[0].orig_dport,
                flows[0].reply_sport
            ),
            (12345, 53, 53)
        );
        assert!(flows[0].translated() && !flows[1].translated());
        let all = parse_entries(LIST);
        assert_eq!(all.len(), 5, "the summary is skipped");
        let tcp = &all[4];
        assert_eq!(
            (tcp.proto.as_str(), tcp.timeout_secs, tcp.state.as_deref()),
            ("tcp", 431999, Some("ESTABLISHED"))
        );
        assert_eq!(tcp.reply.src, sa("198.18.1.11:80"));
        assert!(tcp.assured && !tcp.unreplied);
        assert!(all[1].unreplied && all[1].state.is_none());
    }

    #[test]
    fn entries_to_a_removed_endpoint_or_never_translated_are_stale() {
        let flows = parse_list(LIST);
        // The service moved from .11 to .13: the entry to .11 goes, and so does the one made
        // while it had no endpoints (not translated). The node port's entry goes as well;
        // the unrelated entry stays.
        let targets = UdpTargets::from([
            (
                UdpTarget::Addr(sa("198.19.0.10:53")),
                BTreeSet::from([sa("198.18.1.13:53")]),
            ),
            (
                UdpTarget::NodePort(30053),
                BTreeSet::from([sa("198.18.1.13:53")]),
            ),
        ]);
        let gone: Vec<u16> = stale(&flows, &targets)
            .iter()
            .map(|f| f.orig_sport)
            .collect();
        assert_eq!(gone, [12345, 12346, 4000]);

        // Still served by .11 and .12: nothing but the untranslated entry is stale.
        let targets = UdpTargets::from([
            (
                UdpTarget::Addr(sa("198.19.0.10:53")),
                BTreeSet::from([sa("198.18.1.11:53")]),
            ),
            (
                UdpTarget::NodePort(30053),
                BTreeSet::from([sa("198.18.1.12:53")]),
            ),
        ]);
        let gone: Vec<u16> = stale(&flows, &targets)
            .iter()
            .map(|f| f.orig_sport)
            .collect();
        assert_eq!(gone, [12346]);

        // No endpoints any more (or the service is gone): every translated entry goes, the
        // untranslated one (it will be refused) may stay.
        let targets = UdpTargets::from([
            (UdpTarget::Addr(sa("198.19.0.10:53")), BTreeSet::new()),
            (UdpTarget::NodePort(30053), BTreeSet::new()),
        ]);
        let gone: Vec<u16> = stale(&flows, &targets)
            .iter()
            .map(|f| f.orig_sport)
            .collect();
        assert_eq!(gone, [12345, 4000]);
    }
}
