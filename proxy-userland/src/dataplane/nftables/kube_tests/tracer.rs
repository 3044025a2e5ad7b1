//! A port of kube-proxy's nftables packet tracer (pkg/proxy/nftables/helpers_test.go:
//! `nftablesTracer`, `tracePacket`, `runPacketFlowTests`) over a [`Dump`].
//!
//! As upstream, the tracer knows the statements kube-proxy's layout uses rather than all of
//! nft's grammar; a statement it does not know is an error of the trace, never a silent
//! match. Unlike upstream, it follows the packet through the base chains the dump hooks,
//! in priority order, on the path a real packet takes: `output` for a packet from a node
//! address, else `prerouting`; then `input` if the (possibly DNATed) destination is a node
//! address, else `forward`. Chains after a DNAT see the new destination; then `postrouting`
//! for each endpoint, where ours marks hairpin traffic. Masquerading is read, as upstream
//! does, from the jump to `mark-for-masquerade`.

use std::net::IpAddr;

use crate::dataplane::iptables::render::cidr_contains;
use crate::dataplane::nftables::listing::{Dump, Element, parse_elements, split_top};

/// The chain whose jump marks a packet for masquerading (kube-proxy's markMasqChain).
pub const MARK_MASQ_CHAIN: &str = "mark-for-masquerade";
/// The chain that masquerades marked packets (kube-proxy's masqueradingChain).
const MASQUERADING_CHAIN: &str = "masquerading";

/// What happened to a traced packet, as kube-proxy's tracePacket reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    /// The rules that matched, for failure messages and `explain`.
    pub matches: Vec<String>,
    /// "" (no verdict), "DROP", "REJECT", or the DNAT destinations joined by ", ".
    pub output: String,
    pub masq: bool,
    /// Statements the tracer could not read, unknown chains: a trace with errors is void.
    pub errors: Vec<String>,
}

#[derive(Clone, Copy, Debug)]
struct Packet<'a> {
    src: IpAddr,
    proto: &'a str,
    dst: IpAddr,
    dport: u16,
    dnatted: bool,
}

/// How a chain ended: fell off its end or returned (the caller goes on), or a terminal
/// verdict (drop, reject, accept, DNAT) that ends the base chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Continue,
    Terminal,
}

const MAX_DEPTH: usize = 64;
/// Chains run for one packet at most: numgen maps that jump back would otherwise make the
/// work grow with the number of endpoints to the power of the depth.
const MAX_CHAIN_RUNS: usize = 10_000;

struct Tracer<'a> {
    dump: &'a Dump,
    local: &'a [IpAddr],
    trace: Trace,
    outputs: Vec<String>,
    dropped: bool,
    chain_runs: usize,
}

/// One packet field, as a selector names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    Saddr,
    Daddr,
    Proto,
    Dport,
}

fn parse_field(word: &str) -> Option<Field> {
    Some(match word {
        "ip saddr" | "ip6 saddr" => Field::Saddr,
        "ip daddr" | "ip6 daddr" => Field::Daddr,
        "meta l4proto" => Field::Proto,
        "th dport" => Field::Dport,
        _ => return None,
    })
}

/// Whether `value` (an address, CIDR, range, protocol or port as nft writes it) holds the
/// packet's `field`.
fn value_matches(p: &Packet<'_>, field: Field, value: &str) -> bool {
    let value = value.trim();
    let addr = |ip: IpAddr| {
        if let Some((net, len)) = value.split_once('/') {
            match (net.parse::<IpAddr>(), len.parse::<u8>()) {
                (Ok(net), Ok(len)) => cidr_contains((net, len), ip),
                _ => false,
            }
        } else if let Some((lo, hi)) = value.split_once('-') {
            match (lo.trim().parse::<IpAddr>(), hi.trim().parse::<IpAddr>()) {
                (Ok(lo), Ok(hi)) => lo <= ip && ip <= hi,
                _ => false,
            }
        } else {
            value.parse::<IpAddr>() == Ok(ip)
        }
    };
    match field {
        Field::Saddr => addr(p.src),
        Field::Daddr => addr(p.dst),
        Field::Proto => value == p.proto,
        Field::Dport => match value.split_once('-') {
            Some((lo, hi)) => match (lo.trim().parse::<u16>(), hi.trim().parse::<u16>()) {
                (Ok(lo), Ok(hi)) => lo <= p.dport && p.dport <= hi,
                _ => false,
            },
            None => value.parse::<u16>() == Ok(p.dport),
        },
    }
}

fn element_matches(p: &Packet<'_>, fields: &[Field], e: &Element) -> bool {
    e.key.len() == fields.len()
        && fields
            .iter()
            .zip(&e.key)
            .all(|(f, v)| value_matches(p, *f, v))
}

/// Splits `text` after its first `n` words.
fn after_words(text: &str, n: usize) -> (&str, &str) {
    let mut idx = 0;
    for _ in 0..n {
        let t = text[idx..].trim_start();
        idx = text.len() - t.len();
        idx += t.find(' ').unwrap_or(t.len());
    }
    (text[..idx].trim(), text[idx..].trim_start())
}

/// The next `{ ... }` at the start of `text` and what follows it.
fn take_braced(text: &str) -> Option<(&str, &str)> {
    let text = text.trim_start().strip_prefix('{')?;
    let mut depth = 1usize;
    for (i, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some((&text[..i], &text[i + 1..]));
                }
            }
            _ => {}
        }
    }
    None
}

/// A rule with its trailing `comment "..."` removed.
fn strip_comment(rule: &str) -> &str {
    match rule.find(" comment \"") {
        Some(i) if rule.ends_with('"') => &rule[..i],
        _ => rule,
    }
}

/// What one statement of a rule does.
enum Step<'r> {
    /// A match: false ends the rule.
    Match(bool),
    /// A statement without effect on the trace (`counter`, `update @set { ... }`).
    Skip,
    /// A verdict (or a map lookup that found one): evaluated as a statement of its own.
    Verdict(String),
    /// No element of the map matched: the rule ends.
    NoVerdict,
    Numgen(Vec<String>),
    /// One rule of our endpoint spread, with its action: sometimes taken, so both ways
    /// are followed.
    NumgenShare(&'r str),
    Dnat(&'r str),
}

impl Tracer<'_> {
    fn lookup(&self, name: &str) -> Result<&[Element], String> {
        self.dump
            .sets
            .get(name)
            .map(|s| s.elements.as_slice())
            .ok_or_else(|| format!("no set or map {name}"))
    }

    /// Reads the statement at the start of `rule`; returns what it does and the rest.
    fn step<'r>(&self, p: &Packet<'_>, rule: &'r str) -> Result<(Step<'r>, &'r str), String> {
        let local = |ip: IpAddr| self.local.contains(&ip);
        // ct state new / ct state { a, b } / ct status dnat
        if let Some(rest) = rule.strip_prefix("ct state ") {
            let (neg, rest) = strip_neg(rest);
            let (states, rest) = list_or_word(rest);
            let hit = states.iter().any(|s| s == "new");
            return Ok((Step::Match(hit != neg), rest));
        }
        if let Some(rest) = rule.strip_prefix("ct status ") {
            let (neg, rest) = strip_neg(rest);
            let (states, rest) = list_or_word(rest);
            let hit = states.iter().any(|s| s == "dnat") && p.dnatted;
            return Ok((Step::Match(hit != neg), rest));
        }
        for (prefix, ip) in [("fib saddr type ", p.src), ("fib daddr type ", p.dst)] {
            if let Some(rest) = rule.strip_prefix(prefix) {
                let (neg, rest) = strip_neg(rest);
                let (types, rest) = list_or_word(rest);
                let hit = types.iter().any(|t| t == "local") && local(ip);
                return Ok((Step::Match(hit != neg), rest));
            }
        }
        if let Some(rest) = rule.strip_prefix("counter") {
            return Ok((Step::Skip, rest));
        }
        if let Some(rest) = rule.strip_prefix("update @") {
            let (_, rest) = after_words(rest, 1);
            let (_, rest) = take_braced(rest).ok_or("update without { }")?;
            return Ok((Step::Skip, rest));
        }
        if let Some(rest) = rule.strip_prefix("numgen random mod ") {
            let (_, rest) = after_words(rest, 1);
            let Some(rest) = rest.strip_prefix("vmap") else {
                // Ours: `numgen random mod K 0 ACTION`, one endpoint's share.
                let rest = rest.strip_prefix("== ").unwrap_or(rest);
                let (value, action) = after_words(rest, 1);
                if value != "0" || action.is_empty() {
                    return Err(format!("numgen match {value:?} without an action"));
                }
                return Ok((Step::NumgenShare(action), ""));
            };
            let (body, rest) = take_braced(rest).ok_or("numgen vmap without { }")?;
            let chains = parse_elements(body)
                .into_iter()
                .map(|e| e.value.unwrap_or_default())
                .collect();
            return Ok((Step::Numgen(chains), rest));
        }
        let dnat = ["dnat to ", "dnat ip to ", "dnat ip6 to "];
        if let Some(rest) = dnat.iter().find_map(|d| rule.strip_prefix(d)) {
            let (to, rest) = after_words(rest, 1);
            return Ok((Step::Dnat(to), rest));
        }
        for verdict in ["drop", "reject", "accept", "return", "jump ", "goto "] {
            if rule.starts_with(verdict) {
                let words = if verdict.ends_with(' ') { 2 } else { 1 };
                let (v, rest) = after_words(rule, words);
                // `reject with tcp reset` and the like: the kind of reject is not traced.
                let rest = if verdict == "reject" && rest.starts_with("with ") {
                    ""
                } else {
                    rest
                };
                return Ok((Step::Verdict(v.to_string()), rest));
            }
        }
        // `tcp dport 80`: protocol and port in one.
        for proto in ["tcp", "udp", "sctp"] {
            if let Some(rest) = rule
                .strip_prefix(proto)
                .and_then(|r| r.strip_prefix(" dport "))
            {
                let (neg, rest) = strip_neg(rest);
                let (ports, rest) = list_or_word(rest);
                let hit =
                    p.proto == proto && ports.iter().any(|v| value_matches(p, Field::Dport, v));
                return Ok((Step::Match(hit != neg), rest));
            }
        }
        self.selector(p, rule)
    }

    /// `FIELD [. FIELD...] (@set | vmap @map | vmap { } | [!=] VALUE | [!=] { VALUES })`.
    fn selector<'r>(&self, p: &Packet<'_>, rule: &'r str) -> Result<(Step<'r>, &'r str), String> {
        let mut fields = Vec::new();
        let mut rest = rule;
        loop {
            let (two, after) = after_words(rest, 2);
            let field = parse_field(two).ok_or_else(|| format!("unknown statement {rest:?}"))?;
            fields.push(field);
            match after.strip_prefix(". ") {
                Some(more) => rest = more,
                None => {
                    rest = after;
                    break;
                }
            }
        }
        if let Some(r) = rest.strip_prefix("vmap ") {
            let (elements, r) = if let Some(name) = r.strip_prefix('@') {
                let (name, r) = after_words(name, 1);
                (self.lookup(name)?.to_vec(), r)
            } else {
                let (body, r) = take_braced(r).ok_or("vmap without @map or { }")?;
                (parse_elements(body), r)
            };
            let found = elements.iter().find(|e| element_matches(p, &fields, e));
            return Ok(match found {
                Some(e) => (Step::Verdict(e.value.clone().unwrap_or_default()), r),
                None => (Step::NoVerdict, r),
            });
        }
        let (neg, r) = strip_neg(rest);
        if let Some(name) = r.strip_prefix('@') {
            let (name, r) = after_words(name, 1);
            let hit = self
                .lookup(name)?
                .iter()
                .any(|e| element_matches(p, &fields, e));
            return Ok((Step::Match(hit != neg), r));
        }
        let [field] = fields[..] else {
            return Err(format!("concatenation without a set: {rule:?}"));
        };
        let (values, r) = list_or_word(r);
        let hit = values.iter().any(|v| value_matches(p, field, v));
        Ok((Step::Match(hit != neg), r))
    }

    /// Runs the packet through `chain`; upstream's runChain.
    fn run_chain(&mut self, chain: &str, p: &mut Packet<'_>, depth: usize) -> End {
        self.chain_runs += 1;
        if self.chain_runs > MAX_CHAIN_RUNS {
            if self.chain_runs == MAX_CHAIN_RUNS + 1 {
                self.trace
                    .errors
                    .push(format!("more than {MAX_CHAIN_RUNS} chains run"));
            }
            return End::Terminal;
        }
        if depth > MAX_DEPTH {
            self.trace
                .errors
                .push(format!("jumps nest deeper than {MAX_DEPTH} at {chain}"));
            return End::Terminal;
        }
        let Some(c) = self.dump.chains.get(chain) else {
            self.trace.errors.push(format!("unknown chain {chain:?}"));
            return End::Terminal;
        };
        for raw in &c.rules {
            match self.run_rule(raw, p, depth) {
                Ok(Some(end)) => return end,
                Ok(None) => {}
                Err(e) => {
                    self.trace
                        .errors
                        .push(format!("{e} in rule {raw:?} of {chain}"));
                }
            }
        }
        End::Continue
    }

    /// Ok(None): go on with the next rule; Ok(Some(end)): the chain ends so.
    fn run_rule(
        &mut self,
        raw: &str,
        p: &mut Packet<'_>,
        depth: usize,
    ) -> Result<Option<End>, String> {
        self.run_statements(raw, strip_comment(raw).trim(), p, depth)
    }

    /// Runs `rule`, the statements of `raw` from some point on.
    fn run_statements(
        &mut self,
        raw: &str,
        mut rule: &str,
        p: &mut Packet<'_>,
        depth: usize,
    ) -> Result<Option<End>, String> {
        while !rule.is_empty() {
            let (step, rest) = self.step(p, rule)?;
            let rest = rest.trim_start();
            match step {
                Step::Match(true) | Step::Skip => rule = rest,
                Step::Match(false) | Step::NoVerdict => return Ok(None),
                Step::Dnat(to) => {
                    self.trace.matches.push(raw.to_string());
                    self.outputs.push(to.to_string());
                    return Ok(Some(End::Terminal));
                }
                Step::Numgen(chains) => {
                    for target in chains {
                        let Some(chain) = target
                            .strip_prefix("goto ")
                            .or(target.strip_prefix("jump "))
                        else {
                            return Err(format!("numgen value {target:?}"));
                        };
                        self.trace.matches.push(raw.to_string());
                        // Every endpoint is followed, to list them all, as upstream does.
                        let mut each = *p;
                        self.run_chain(chain.trim(), &mut each, depth + 1);
                    }
                    return Ok(Some(End::Terminal));
                }
                Step::NumgenShare(action) => {
                    // Every endpoint is followed, as for a numgen map; then the next rule.
                    let mut each = *p;
                    self.run_statements(raw, action, &mut each, depth)?;
                    return Ok(None);
                }
                Step::Verdict(v) => {
                    if !rest.is_empty() {
                        return Err(format!("statements after the verdict {v:?}"));
                    }
                    let (word, target) = v.split_once(' ').unwrap_or((v.as_str(), ""));
                    let target = target.trim();
                    match word {
                        "drop" | "reject" => {
                            self.trace.matches.push(raw.to_string());
                            self.outputs.push(word.to_uppercase());
                            self.dropped = true;
                            return Ok(Some(End::Terminal));
                        }
                        "accept" => {
                            self.trace.matches.push(raw.to_string());
                            return Ok(Some(End::Terminal));
                        }
                        "return" => {
                            self.trace.matches.push(raw.to_string());
                            return Ok(Some(End::Continue));
                        }
                        // Where the mark is acted on: the trace reads the mark instead.
                        "jump" if target == MASQUERADING_CHAIN => return Ok(None),
                        "jump" if target == MARK_MASQ_CHAIN => {
                            self.trace.matches.push(raw.to_string());
                            self.trace.masq = true;
                            return Ok(None);
                        }
                        "jump" | "goto" => {
                            self.trace.matches.push(raw.to_string());
                            let end = self.run_chain(target, p, depth + 1);
                            return Ok(match (end, word) {
                                (End::Terminal, _) => Some(End::Terminal),
                                // After a goto the calling chain does not go on.
                                (End::Continue, "goto") => Some(End::Continue),
                                _ => None,
                            });
                        }
                        _ => return Err(format!("unknown verdict {v:?}")),
                    }
                }
            }
        }
        Ok(None)
    }

    /// Runs the base chains of `hook`; false if the packet was dropped or rejected.
    fn run_hook(&mut self, hook: &str, p: &mut Packet<'_>) -> bool {
        for (chain, h) in self.dump.hooked(hook) {
            let before = self.outputs.len();
            self.run_chain(chain, p, 0);
            if self.dropped {
                return false;
            }
            if h.kind == "nat" && self.outputs.len() > before && !p.dnatted {
                match endpoint_addr(&self.outputs[before]) {
                    Some(addr) => {
                        p.dst = addr;
                        p.dnatted = true;
                    }
                    None => self
                        .trace
                        .errors
                        .push(format!("bad DNAT destination {:?}", self.outputs[before])),
                }
            }
        }
        true
    }
}

fn strip_neg(text: &str) -> (bool, &str) {
    match text.strip_prefix("!= ") {
        Some(rest) => (true, rest),
        None => (false, text.strip_prefix("== ").unwrap_or(text)),
    }
}

/// `{ a, b }` or one word, and what follows.
fn list_or_word(text: &str) -> (Vec<String>, &str) {
    if let Some((body, rest)) = take_braced(text) {
        let values = split_top(body, ",")
            .into_iter()
            .filter(|v| !v.is_empty())
            .collect();
        return (values, rest.trim_start());
    }
    let (word, rest) = after_words(text, 1);
    (vec![word.to_string()], rest)
}

/// The address of `198.18.0.1:80` or `[2001:db8::1]:80`.
pub fn endpoint_addr(text: &str) -> Option<IpAddr> {
    if let Ok(sa) = text.parse::<std::net::SocketAddr>() {
        return Some(sa.ip());
    }
    text.parse().ok()
}

/// Where a packet from `src` to `dst`:`dport` ends up; `local` are the node's addresses
/// (what `fib ... type local` matches).
pub fn trace_packet(
    dump: &Dump,
    src: IpAddr,
    proto: &str,
    dst: IpAddr,
    dport: u16,
    local: &[IpAddr],
) -> Trace {
    let mut t = Tracer {
        dump,
        local,
        trace: Trace::default(),
        outputs: Vec::new(),
        dropped: false,
        chain_runs: 0,
    };
    let mut p = Packet {
        src,
        proto,
        dst,
        dport,
        dnatted: false,
    };
    let first = if local.contains(&src) {
        "output"
    } else {
        "prerouting"
    };
    if t.run_hook(first, &mut p) {
        let next = if local.contains(&p.dst) {
            "input"
        } else if first == "output" {
            // Sent by the node to another host: no further hook of ours but postrouting.
            ""
        } else {
            "forward"
        };
        if (next.is_empty() || t.run_hook(next, &mut p)) && p.dnatted {
            // Ours marks a DNAT to the client itself in nat-postrouting, where upstream's
            // endpoint chain marks it: run it for each endpoint the packet may go to.
            let ends: Vec<IpAddr> = t.outputs.iter().filter_map(|o| endpoint_addr(o)).collect();
            for dst in ends {
                t.run_hook("postrouting", &mut Packet { dst, ..p });
            }
        }
    }
    t.trace.output = t.outputs.join(", ");
    t.trace
}
