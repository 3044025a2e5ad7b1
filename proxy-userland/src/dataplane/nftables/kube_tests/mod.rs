//! kube-proxy's own nftables proxier tests (pkg/proxy/nftables/proxier_test.go and
//! helpers_test.go), ported: a port of its packet tracer ([`tracer`]) over a parsed dump
//! ([`dump`]), checked first against upstream's own expected dumps ([`upstream_test`]).
//! Each test is named after its upstream case.
//!
//! Upstream's test addresses are mapped into the ranges this project may use (as in the
//! iptables mode's port, plus the service range, which must leave the node addresses out):
//!
//! | upstream                              | here                                  |
//! |---------------------------------------|---------------------------------------|
//! | pods 10.0.0.0/8 (10.0.0.2)            | 198.18.0.0/16 (198.18.0.2)            |
//! | endpoints 10.180.0.N, 10.180.2.1, 10.0.1.N | 198.18.180.N, 198.18.182.1, 198.18.1.N |
//! | service range 172.30.0.0/16           | 198.19.0.0/17                         |
//! | cluster IPs 172.30.0.N, 172.30.1.1    | 198.19.0.N, 198.19.1.1                |
//! | node 192.168.0.2, 192.168.1.2 (/24s)  | 198.19.128.2, 198.19.129.2 (/24s)     |
//! | external IPs 192.168.99.N             | 198.19.227.N                          |
//! | LB IPs 1.2.3.4, 5.6.7.8, 9.10.11.12   | 198.19.250.4, 198.19.250.8, 198.19.250.12 |
//! | outside 203.0.113.0/24 (/25 allowed)  | 198.19.240.0/24 (/25 allowed)         |
//! | IPv6 pods fd00:10::/64, fd00:10::2    | 2001:db8:10::/64, 2001:db8:10::2      |
//! | IPv6 fd00:172:30::41, fd00:10:180::N  | 2001:db8:172:30::41, 2001:db8:10:180::N |
//! | IPv6 service range fd00:10:96::/112   | 2001:db8:10:96::/112                  |
//! | IPv6 outside 2600:5200::1             | 2001:db8:5200::1                      |
//!
//! Upstream's table `kube-proxy` is our `fastpath`. Chain names in the fixtures keep
//! upstream's hashes: to the tracer a name is only a name.

mod convert_test;
mod fake;
mod full_sync_test;
mod listing_test;
mod metrics_test;
mod names_test;
mod policy_test;
mod proxier_test;
mod sync_test;
mod tracer;
mod upstream_test;

use std::net::IpAddr;

pub use self::tracer::trace_packet;
pub use crate::dataplane::iptables::kube_tests::TEST_NODE_NAME;
pub use crate::dataplane::nftables::listing::Dump;

pub const TEST_NODE_IP: &str = "198.19.128.2";
pub const TEST_NODE_IP_ALT: &str = "198.19.129.2";
pub const TEST_EXTERNAL_IP: &str = "198.19.227.11";
pub const TEST_NODE_IPV6: &str = "2001:db8::1";
pub const TEST_NODE_IPV6_ALT: &str = "2001:db8:1::2";
pub const TEST_EXTERNAL_CLIENT: &str = "198.19.240.2";
pub const TEST_EXTERNAL_CLIENT_BLOCKED: &str = "198.19.240.130";
/// Upstream's testNodeIPs: what `fib ... type local` matches.
pub const TEST_NODE_IPS: &[&str] = &[
    TEST_NODE_IP,
    TEST_NODE_IP_ALT,
    TEST_EXTERNAL_IP,
    TEST_NODE_IPV6,
    TEST_NODE_IPV6_ALT,
];

pub fn ip(s: &str) -> IpAddr {
    s.trim()
        .parse()
        .unwrap_or_else(|e| panic!("test address {s:?}: {e}"))
}

/// One row of a packet-flow table (kube-proxy's packetFlowTest); protocol "" is tcp.
#[derive(Clone, Debug)]
pub struct Flow<'a> {
    pub name: &'a str,
    pub source: &'a str,
    pub protocol: &'a str,
    pub dest: &'a str,
    pub port: u16,
    pub output: &'a str,
    pub masq: bool,
}

pub fn flow<'a>(
    name: &'a str,
    source: &'a str,
    dest: &'a str,
    port: u16,
    output: &'a str,
    masq: bool,
) -> Flow<'a> {
    Flow {
        name,
        source,
        protocol: "",
        dest,
        port,
        output,
        masq,
    }
}

/// kube-proxy's runPacketFlowTests: every row traced, every mismatch (and every statement
/// the tracer could not read) reported at once.
pub fn run_packet_flow_tests(test: &str, dump: &Dump, node_ips: &[&str], flows: &[Flow<'_>]) {
    let local: Vec<IpAddr> = node_ips.iter().map(|s| ip(s)).collect();
    let mut failures = Vec::new();
    for f in flows {
        let proto = if f.protocol.is_empty() {
            "tcp"
        } else {
            f.protocol
        };
        let t = trace_packet(dump, ip(f.source), proto, ip(f.dest), f.port, &local);
        if t.output != f.output || t.masq != f.masq || !t.errors.is_empty() {
            failures.push(format!(
                "{test} / {:?}: {proto} {} -> {}:{}: got output {:?} masq {}, want {:?} masq {}\nerrors: {:?}\nmatched:\n  {}",
                f.name,
                f.source,
                f.dest,
                f.port,
                t.output,
                t.masq,
                f.output,
                f.masq,
                t.errors,
                t.matches.join("\n  ")
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// kube-proxy's sortNFTablesTransaction: blank lines and comments dropped, then tables,
/// chains, rules, sets, maps and elements, each by object name; rules keep their order.
pub fn sort_transaction(tx: &str) -> Vec<String> {
    fn rank(kind: &str) -> u8 {
        match kind {
            "table" => 10,
            "chain" => 9,
            "rule" => 8,
            "set" => 7,
            "map" => 6,
            "element" => 5,
            _ => 0,
        }
    }
    let mut lines: Vec<(usize, &str)> = tx
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .enumerate()
        .collect();
    lines.sort_by(|(ia, a), (ib, b)| {
        let wa: Vec<&str> = a.split(' ').collect();
        let wb: Vec<&str> = b.split(' ').collect();
        fn kind<'a>(w: &[&'a str]) -> &'a str {
            w.get(1).copied().unwrap_or_default()
        }
        fn name<'a>(w: &[&'a str]) -> &'a str {
            w.get(4).copied().unwrap_or_default()
        }
        rank(kind(&wb))
            .cmp(&rank(kind(&wa)))
            .then_with(|| name(&wa).cmp(name(&wb)))
            .then_with(|| {
                if kind(&wa) == "rule" && kind(&wb) == "rule" {
                    ia.cmp(ib)
                } else {
                    a.cmp(b)
                }
            })
    });
    lines.into_iter().map(|(_, l)| l.to_string()).collect()
}

/// Upstream's expected text as we write the same table (render/service.rs `balance`):
/// - an endpoint without affinity has no chain: its DNAT sits in the service chain;
/// - the endpoint choice is rule i of n, `numgen random mod (n-i) 0 ACTION`, the last
///   action plain, instead of one `numgen ... vmap`;
/// - hairpin traffic is marked in nat-postrouting, from a set of `ip . ip` pairs, instead
///   of in each endpoint chain.
///
/// Text without endpoint chains or numgen maps comes back as it was.
pub fn as_ours(upstream: &str) -> String {
    let rule_of = |line: &str| -> Option<(String, String, String)> {
        let rest = line.strip_prefix("add rule ")?;
        let (family, rest) = rest.split_once(' ')?;
        let (_table, rest) = rest.split_once(' ')?;
        let (chain, body) = rest.split_once(' ')?;
        Some((family.to_string(), chain.to_string(), body.to_string()))
    };
    let is_endpoint = |chain: &str| chain.starts_with("endpoint-");
    let mut endpoint_rules: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for line in upstream.lines() {
        if let Some((_, chain, body)) = rule_of(line.trim()).filter(|(_, c, _)| is_endpoint(c)) {
            endpoint_rules.entry(chain).or_default().push(body);
        }
    }
    let with_affinity = |chain: &str| {
        endpoint_rules
            .get(chain)
            .is_some_and(|r| r.iter().any(|b| b.starts_with("update @")))
    };
    let mut pairs: Vec<(String, String)> = Vec::new();
    let mut out = String::new();
    for line in upstream.lines() {
        let trimmed = line.trim();
        let chain_decl = trimmed
            .strip_prefix("add chain ")
            .and_then(|r| r.splitn(3, ' ').nth(2));
        if chain_decl.is_some_and(|c| is_endpoint(c) && !with_affinity(c)) {
            continue;
        }
        if let Some((family, chain, body)) = rule_of(trimmed) {
            if is_endpoint(&chain) {
                if let Some(ip) = body
                    .strip_suffix(" jump mark-for-masquerade")
                    .and_then(|b| b.split(' ').nth(2))
                {
                    pairs.push((family.clone(), ip.to_string()));
                }
                if !with_affinity(&chain) || body.ends_with("jump mark-for-masquerade") {
                    continue;
                }
            }
            if chain == "nat-postrouting"
                && body == "jump masquerading"
                && !upstream.contains("@hairpin-endpoints")
            {
                out.push_str(&format!(
                    "add set {family} fastpath hairpin-endpoints {{ type {t} . {t} ; comment \"endpoint addresses, each twice: DNAT to the client itself\" ; }}\n\
                     add rule {family} fastpath nat-postrouting ct status dnat {family} saddr . {family} daddr @hairpin-endpoints jump mark-for-masquerade\n",
                    t = if family == "ip" { "ipv4_addr" } else { "ipv6_addr" },
                ));
            }
            if let Some(at) = body
                .find("numgen random mod ")
                .filter(|&at| body[at..].contains(" vmap {"))
            {
                let prefix = format!("add rule {family} fastpath {chain} {}", &body[..at]);
                let map = &body[at..];
                let inner = map
                    .split_once('{')
                    .and_then(|(_, b)| b.rsplit_once('}'))
                    .map_or("", |(b, _)| b);
                let actions: Vec<String> = inner
                    .split(',')
                    .filter_map(|e| e.split_once(": goto "))
                    .map(|(_, target)| {
                        let target = target.trim();
                        let dnat = endpoint_rules
                            .get(target)
                            .and_then(|r| r.iter().find(|b| b.contains(" dnat ")));
                        match dnat {
                            Some(d) if !with_affinity(target) => d.clone(),
                            _ => format!("goto {target}"),
                        }
                    })
                    .collect();
                for (i, action) in actions.iter().enumerate() {
                    match actions.len() - i {
                        1 => out.push_str(&format!("{prefix}{action}\n")),
                        k => out.push_str(&format!("{prefix}numgen random mod {k} 0 {action}\n")),
                    }
                }
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    pairs.sort();
    pairs.dedup();
    for (family, ip) in pairs {
        out.push_str(&format!(
            "add element {family} fastpath hairpin-endpoints {{ {ip} . {ip} }}\n"
        ));
    }
    out
}

/// kube-proxy's diffNFTablesTransaction: None when equal once sorted, else the lines only
/// one side has. Either may be upstream's text: both are compared [`as_ours`].
pub fn diff_transaction(expected: &str, got: &str) -> Option<String> {
    let (expected, got) = (as_ours(expected), as_ours(got));
    let (want, have) = (sort_transaction(&expected), sort_transaction(&got));
    if want == have {
        return None;
    }
    let missing: Vec<&String> = want.iter().filter(|l| !have.contains(l)).collect();
    let extra: Vec<&String> = have.iter().filter(|l| !want.contains(l)).collect();
    let mut out = String::new();
    for l in missing {
        out.push_str(&format!("- {l}\n"));
    }
    for l in extra {
        out.push_str(&format!("+ {l}\n"));
    }
    if out.is_empty() {
        let at = want
            .iter()
            .zip(&have)
            .position(|(w, h)| w != h)
            .unwrap_or(0);
        out.push_str(&format!(
            "same lines, in another order; first at line {at}:\n- {}\n+ {}\n",
            want[at], have[at]
        ));
    }
    Some(out)
}

/// kube-proxy's assertNFTablesTransactionEqual.
#[track_caller]
pub fn assert_transaction_equal(expected: &str, got: &str) {
    if let Some(diff) = diff_transaction(expected, got) {
        panic!("tables do not match:\n{diff}\nfull result:\n{got}");
    }
}

/// kube-proxy's diffNFTablesChain: None when `chain` holds exactly `expected`'s rules.
pub fn diff_chain(dump: &Dump, chain: &str, expected: &str) -> Option<String> {
    let got = dump.chain_text(chain);
    (got != expected.trim()).then(|| format!("want:\n{}\ngot:\n{got}", expected.trim()))
}
