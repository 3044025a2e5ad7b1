//! A port of kube-proxy's packet tracer (pkg/proxy/iptables/proxier_test.go: `tracePacket`,
//! `iptablesTracer`) and of its `checkIPTablesRuleJumps`, over the `iptables-restore`
//! text our renderer writes.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

/// One option of a rule, maybe negated (`! -s 198.18.0.0/16`).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Opt {
    negated: bool,
    value: String,
}

impl Opt {
    fn matches(&self, test: impl Fn(&str) -> bool) -> bool {
        test(&self.value) != self.negated
    }
}

/// A rule as the tracer reads it: the matches it knows, the target, and the raw line.
#[derive(Clone, Debug, Default)]
pub struct Rule {
    pub raw: String,
    source: Option<Opt>,
    destination: Option<Opt>,
    protocol: Option<Opt>,
    dport: Option<Opt>,
    src_type: Option<Opt>,
    dst_type: Option<Opt>,
    jump: Option<String>,
    dnat: Option<String>,
    probability: bool,
    /// Matches on history (`-m recent --rcheck`, `--mark`, `--ctstate`): never match.
    state_check: bool,
}

fn parse_rule(line: &str) -> Rule {
    let mut rule = Rule {
        raw: line.to_string(),
        ..Default::default()
    };
    // Split respecting double quotes (comments).
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for ch in line.chars() {
        match ch {
            '"' => quoted = !quoted,
            ' ' if !quoted => {
                if !cur.is_empty() {
                    words.push(std::mem::take(&mut cur));
                }
            }
            _ => cur.push(ch),
        }
    }
    if !cur.is_empty() {
        words.push(cur);
    }
    let mut negated = false;
    let mut after_jump = false;
    let mut i = 2; // skip "-A CHAIN"
    while i < words.len() {
        let w = words[i].as_str();
        let next = words.get(i + 1).cloned().unwrap_or_default();
        let opt = |negated| {
            Some(Opt {
                negated,
                value: next.clone(),
            })
        };
        let mut takes_value = true;
        match w {
            "!" => {
                negated = true;
                i += 1;
                continue;
            }
            "-s" => rule.source = opt(negated),
            "-d" => rule.destination = opt(negated),
            "-p" => rule.protocol = opt(negated),
            "--dport" => rule.dport = opt(negated),
            "--src-type" => rule.src_type = opt(negated),
            "--dst-type" => rule.dst_type = opt(negated),
            "-j" | "-g" => {
                rule.jump = Some(next.clone());
                after_jump = true;
            }
            "--to-destination" => rule.dnat = Some(next.clone()),
            "--probability" => rule.probability = true,
            "--rcheck" => {
                rule.state_check = true;
                takes_value = false;
            }
            "--mark" | "--ctstate" if !after_jump => rule.state_check = true,
            _ => takes_value = false,
        }
        negated = false;
        i += if takes_value { 2 } else { 1 };
    }
    rule
}

/// Restore text parsed: per table, the chains declared (in order) and each chain's rules.
#[derive(Clone, Debug, Default)]
pub struct Dump {
    pub tables: BTreeMap<String, DumpTable>,
}

#[derive(Clone, Debug, Default)]
pub struct DumpTable {
    pub created: Vec<String>,
    pub deleted: BTreeSet<String>,
    pub rules: BTreeMap<String, Vec<Rule>>,
}

impl Dump {
    pub fn parse(text: &str) -> Dump {
        let mut dump = Dump::default();
        let mut table = String::new();
        for line in text.lines() {
            if let Some(t) = line.strip_prefix('*') {
                table = t.to_string();
                dump.tables.entry(table.clone()).or_default();
                continue;
            }
            let Some(t) = dump.tables.get_mut(&table) else {
                continue;
            };
            if let Some(rest) = line.strip_prefix(':') {
                t.created.push(
                    rest.split_whitespace()
                        .next()
                        .unwrap_or_default()
                        .to_string(),
                );
            } else if let Some(rest) = line.strip_prefix("-A ") {
                let chain = rest
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                t.rules.entry(chain).or_default().push(parse_rule(line));
            } else if let Some(c) = line.strip_prefix("-X ") {
                t.deleted.insert(c.trim().to_string());
            }
        }
        dump
    }

    pub fn chain(&self, table: &str, chain: &str) -> &[Rule] {
        self.tables
            .get(table)
            .and_then(|t| t.rules.get(chain))
            .map(Vec::as_slice)
            .unwrap_or_default()
    }
}

fn address_matches(value: &str, ip: IpAddr) -> bool {
    let (addr, len) = match value.split_once('/') {
        Some((a, l)) => (a, l.parse::<u8>().ok()),
        None => (value, None),
    };
    let Ok(net) = addr.parse::<IpAddr>() else {
        return false;
    };
    let len = len.unwrap_or(if net.is_ipv4() { 32 } else { 128 });
    crate::dataplane::iptables::render::cidr_contains((net, len), ip)
}

/// What happened to a traced packet, as kube-proxy's tracePacket reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    /// The rules that matched, for failure messages.
    pub matches: Vec<String>,
    /// "" (no rule), "ACCEPT", "DROP", "REJECT", or the DNAT destinations joined by ", ".
    pub output: String,
    pub masq: bool,
}

struct Tracer<'a> {
    dump: &'a Dump,
    local_ips: BTreeSet<IpAddr>,
    matches: Vec<String>,
    outputs: Vec<String>,
    mark_masq: bool,
}

impl Tracer<'_> {
    fn rule_matches(&self, r: &Rule, src: IpAddr, proto: &str, dst: IpAddr, dport: u16) -> bool {
        let local = |ip: IpAddr| self.local_ips.contains(&ip);
        let checks = [
            r.source
                .as_ref()
                .is_none_or(|o| o.matches(|v| address_matches(v, src))),
            r.src_type
                .as_ref()
                .is_none_or(|o| o.matches(|v| v == "LOCAL" && local(src))),
            r.protocol
                .as_ref()
                .is_none_or(|o| o.matches(|v| v == proto)),
            r.destination
                .as_ref()
                .is_none_or(|o| o.matches(|v| address_matches(v, dst))),
            r.dst_type
                .as_ref()
                .is_none_or(|o| o.matches(|v| v == "LOCAL" && local(dst))),
            r.dport
                .as_ref()
                .is_none_or(|o| o.matches(|v| v == dport.to_string())),
        ];
        checks.iter().all(|c| *c) && !r.state_check
    }

    /// Runs the packet through `chain`; true if it hit a terminal target.
    fn run_chain(
        &mut self,
        table: &str,
        chain: &str,
        src: IpAddr,
        proto: &str,
        dst: IpAddr,
        dport: u16,
    ) -> bool {
        for r in self.dump.chain(table, chain) {
            let Some(jump) = r.jump.as_deref() else {
                continue;
            };
            if !self.rule_matches(r, src, proto, dst, dport) {
                continue;
            }
            self.matches.push(r.raw.clone());
            match jump {
                "KUBE-MARK-MASQ" => self.mark_masq = true,
                "ACCEPT" | "REJECT" | "DROP" => {
                    self.outputs.push(jump.to_string());
                    return true;
                }
                "DNAT" => {
                    self.outputs.push(r.dnat.clone().unwrap_or_default());
                    return true;
                }
                _ => {
                    let terminated = self.run_chain(table, jump, src, proto, dst, dport);
                    // A probabilistic jump goes on collecting the other endpoints.
                    if terminated && !r.probability {
                        return true;
                    }
                }
            }
        }
        false
    }
}

/// Where a packet from `src` to `dst`:`dport` ends up. Our rules are traced from the chains
/// the built-in chains jump to: nat KUBE-SERVICES (PREROUTING and OUTPUT), then after a
/// DNAT the filter chains with the new destination, as kube-proxy's tracer does.
pub fn trace_packet(
    dump: &Dump,
    src: &str,
    proto: &str,
    dst: &str,
    dport: u16,
    node_ips: &[&str],
) -> Trace {
    let mut local_ips: BTreeSet<IpAddr> = ["127.0.0.1", "::1"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    local_ips.extend(node_ips.iter().map(|s| s.parse::<IpAddr>().unwrap()));
    let mut t = Tracer {
        dump,
        local_ips,
        matches: Vec::new(),
        outputs: Vec::new(),
        mark_masq: false,
    };
    let src: IpAddr = src.parse().unwrap();
    let mut dst: IpAddr = dst.parse().unwrap();
    t.run_chain("nat", "KUBE-SERVICES", src, proto, dst, dport);
    if let Some(first) = t.outputs.first() {
        let host = first.rsplit_once(':').map_or(first.as_str(), |(h, _)| h);
        dst = host.trim_matches(['[', ']']).parse().unwrap();
    }
    for chain in [
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-FIREWALL",
    ] {
        t.run_chain("filter", chain, src, proto, dst, dport);
    }
    Trace {
        matches: t.matches,
        output: t.outputs.join(", "),
        masq: t.mark_masq,
    }
}

/// One row of a packet-flow table (kube-proxy's packetFlowTest).
pub struct Flow<'a> {
    pub name: &'a str,
    pub source: &'a str,
    pub protocol: &'a str,
    pub dest: &'a str,
    pub port: u16,
    pub output: &'a str,
    pub masq: bool,
}

/// kube-proxy's runPacketFlowTests: every row traced, every mismatch reported at once.
pub fn run_packet_flow_tests(test: &str, dump: &Dump, node_ips: &[&str], flows: &[Flow<'_>]) {
    let mut failures = Vec::new();
    for f in flows {
        let proto = if f.protocol.is_empty() {
            "tcp"
        } else {
            f.protocol
        };
        let t = trace_packet(dump, f.source, proto, f.dest, f.port, node_ips);
        if t.output != f.output || t.masq != f.masq {
            failures.push(format!(
                "{test} / {:?}: {proto} {} -> {}:{}: got output {:?} masq {}, want {:?} masq {}\nmatched:\n  {}",
                f.name,
                f.source,
                f.dest,
                f.port,
                t.output,
                t.masq,
                f.output,
                f.masq,
                t.matches.join("\n  ")
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// kube-proxy's checkIPTablesRuleJumps: every jump and every `-A` is to a chain the input
/// creates; no chain is jumped to without rules (KUBE-NODEPORTS excepted); no chain is
/// created without being jumped to (the fixed chains excepted).
pub fn check_rule_jumps(text: &str) -> Result<(), String> {
    const BUILTIN_TARGETS: &[&str] = &[
        "ACCEPT",
        "REJECT",
        "DROP",
        "MARK",
        "RETURN",
        "DNAT",
        "SNAT",
        "MASQUERADE",
    ];
    const FIXED: &[&str] = &[
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-POSTROUTING",
        "KUBE-FORWARD",
        "KUBE-MARK-MASQ",
        "KUBE-PROXY-FIREWALL",
    ];
    let dump = Dump::parse(text);
    for (name, t) in &dump.tables {
        let created: BTreeSet<&str> = t
            .created
            .iter()
            .map(String::as_str)
            .filter(|c| !t.deleted.contains(*c))
            .collect();
        let filled: BTreeSet<&str> = t.rules.keys().map(String::as_str).collect();
        let jumped: BTreeSet<&str> = t
            .rules
            .values()
            .flatten()
            .filter_map(|r| r.jump.as_deref())
            .filter(|j| !BUILTIN_TARGETS.contains(j))
            .collect();
        let missing: Vec<&&str> = jumped
            .union(&filled)
            .filter(|c| !created.contains(**c))
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "some chains in {name} are used but were not created: {missing:?}"
            ));
        }
        let empty: Vec<&&str> = jumped
            .iter()
            .filter(|c| !filled.contains(**c) && **c != "KUBE-NODEPORTS")
            .collect();
        if !empty.is_empty() {
            return Err(format!(
                "some chains in {name} are jumped to but have no rules: {empty:?}"
            ));
        }
        let extra: Vec<&&str> = created
            .iter()
            .filter(|c| !jumped.contains(**c) && !FIXED.contains(*c))
            .collect();
        if !extra.is_empty() {
            return Err(format!(
                "some chains in {name} are created but not used: {extra:?}"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // kube-proxy's TestCheckIPTablesRuleJumps cases.
    #[test]
    fn test_check_iptables_rule_jumps() {
        let cases = [
            (
                "valid",
                "*filter\nCOMMIT\n*nat\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-X - [0:0]\n-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n-A KUBE-SERVICES -m tcp -p tcp -d 198.19.0.41 --dport 80 -j KUBE-SVC-X\n-A KUBE-SVC-X -d 198.19.0.41 -j KUBE-MARK-MASQ\nCOMMIT\n",
                "",
            ),
            (
                "can't jump to chain that wasn't created",
                "*filter\nCOMMIT\n*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j KUBE-SVC-X\nCOMMIT\n",
                "some chains in nat are used but were not created",
            ),
            (
                "can't jump to chain that has no rules",
                "*filter\nCOMMIT\n*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-X - [0:0]\n-A KUBE-SERVICES -j KUBE-SVC-X\nCOMMIT\n",
                "some chains in nat are jumped to but have no rules",
            ),
            (
                "can't add rules to a chain that wasn't created",
                "*filter\nCOMMIT\n*nat\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -m tcp\n-A KUBE-SVC-X -j KUBE-MARK-MASQ\nCOMMIT\n",
                "some chains in nat are used but were not created",
            ),
            (
                "can't create chain and then not use it",
                "*filter\nCOMMIT\n*nat\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-X - [0:0]\n-A KUBE-SERVICES -m tcp\nCOMMIT\n",
                "some chains in nat are created but not used",
            ),
        ];
        for (name, input, want) in cases {
            match check_rule_jumps(input) {
                Ok(()) => assert!(want.is_empty(), "{name}: no error, want {want:?}"),
                Err(e) => assert!(!want.is_empty() && e.starts_with(want), "{name}: {e}"),
            }
        }
    }

    // kube-proxy's TestTracePacket, over static rules in our addresses.
    #[test]
    fn test_trace_packet() {
        let rules = "\
*filter
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
-A KUBE-NODEPORTS -m comment --comment \"ns2/svc2:p80 health check node port\" -m tcp -p tcp --dport 30000 -j ACCEPT
-A KUBE-SERVICES -m comment --comment \"ns6/svc6:p80 has no endpoints\" -m tcp -p tcp -d 198.19.0.46 --dport 80 -j REJECT
-A KUBE-EXTERNAL-SERVICES -m comment --comment \"ns2/svc2:p80 has no local endpoints\" -m tcp -p tcp -d 198.19.227.22 --dport 80 -j DROP
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-A - [0:0]
:KUBE-SVC-B - [0:0]
:KUBE-EXT-B - [0:0]
:KUBE-SEP-1 - [0:0]
:KUBE-SEP-2 - [0:0]
:KUBE-SEP-3 - [0:0]
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SERVICES -m tcp -p tcp -d 198.19.0.41 --dport 80 -j KUBE-SVC-A
-A KUBE-SERVICES -m tcp -p tcp -d 198.19.0.44 --dport 80 -j KUBE-SVC-B
-A KUBE-SERVICES -m tcp -p tcp -d 198.19.227.22 --dport 80 -j KUBE-EXT-B
-A KUBE-EXT-B -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ
-A KUBE-EXT-B -m addrtype --src-type LOCAL -j KUBE-SVC-B
-A KUBE-SVC-A -j KUBE-SEP-1
-A KUBE-SVC-B -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-2
-A KUBE-SVC-B -j KUBE-SEP-3
-A KUBE-SEP-1 -m tcp -p tcp -j DNAT --to-destination 198.18.180.1:80
-A KUBE-SEP-2 -m tcp -p tcp -j DNAT --to-destination 198.18.180.4:80
-A KUBE-SEP-3 -m tcp -p tcp -j DNAT --to-destination 198.18.180.5:80
COMMIT
";
        let dump = Dump::parse(rules);
        run_packet_flow_tests(
            "TestTracePacket",
            &dump,
            &["198.19.128.2"],
            &[
                Flow {
                    name: "no match",
                    source: "198.18.0.2",
                    protocol: "",
                    dest: "198.18.0.3",
                    port: 80,
                    output: "",
                    masq: false,
                },
                Flow {
                    name: "single endpoint",
                    source: "198.18.0.2",
                    protocol: "",
                    dest: "198.19.0.41",
                    port: 80,
                    output: "198.18.180.1:80",
                    masq: false,
                },
                Flow {
                    name: "multiple endpoints",
                    source: "198.18.0.2",
                    protocol: "",
                    dest: "198.19.0.44",
                    port: 80,
                    output: "198.18.180.4:80, 198.18.180.5:80",
                    masq: false,
                },
                Flow {
                    name: "LOCAL, KUBE-MARK-MASQ",
                    source: "198.19.128.2",
                    protocol: "",
                    dest: "198.19.227.22",
                    port: 80,
                    output: "198.18.180.4:80, 198.18.180.5:80",
                    masq: true,
                },
                Flow {
                    name: "DROP",
                    source: "198.19.240.2",
                    protocol: "",
                    dest: "198.19.227.22",
                    port: 80,
                    output: "DROP",
                    masq: false,
                },
                Flow {
                    name: "ACCEPT (NodePortHealthCheck)",
                    source: "198.19.128.2",
                    protocol: "",
                    dest: "198.19.128.2",
                    port: 30000,
                    output: "ACCEPT",
                    masq: false,
                },
                Flow {
                    name: "REJECT",
                    source: "198.18.0.2",
                    protocol: "",
                    dest: "198.19.0.46",
                    port: 80,
                    output: "REJECT",
                    masq: false,
                },
            ],
        );
    }
}
