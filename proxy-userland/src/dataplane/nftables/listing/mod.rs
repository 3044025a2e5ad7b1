//! One nftables table read from `add ...` statements, as knftables' Fake `Dump()` writes
//! them and `nft -f -` reads them (one statement a line), or from `nft list table`: its
//! chains (with their hooks), its rules as text, and its sets' and maps' elements. `flush`
//! and `delete` statements are applied in order, so a transaction can be played over an
//! earlier dump. Input that is not an nftables table is an error, never a panic (fuzzed:
//! `fuzz/fuzz_targets/nft_listing.rs`).

mod endpoint_maps;

#[cfg(test)]
pub use endpoint_maps::inline_text;

use std::collections::BTreeMap;

/// A base chain's hook: the chain runs for every packet passing `hook`, ordered by
/// `priority` (lower first) among the hook's chains.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hook {
    pub kind: String,
    pub hook: String,
    pub priority: i32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chain {
    pub hook: Option<Hook>,
    pub rules: Vec<String>,
}

/// One element of a set or map: the key's parts (split at ` . `) and, in a map, the value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Element {
    pub key: Vec<String>,
    pub value: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Set {
    pub is_map: bool,
    /// The default timeout of elements added by the packet path (`timeout 3h`), in seconds.
    pub timeout_secs: Option<u32>,
    pub elements: Vec<Element>,
}

/// nft's durations: `10800s`, `3h`, `1d2h3m4s` (a trailing `ms` part is dropped).
pub fn parse_duration(text: &str) -> Option<u32> {
    let mut total: u64 = 0;
    let mut number = String::new();
    let mut chars = text.trim().chars().peekable();
    let mut any = false;
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            number.push(c);
            continue;
        }
        let value: u64 = number.parse().ok()?;
        number.clear();
        let unit = match c {
            'd' => 86_400,
            'h' => 3_600,
            'm' if chars.peek() == Some(&'s') => {
                chars.next();
                0
            }
            'm' => 60,
            's' => 1,
            _ => return None,
        };
        total = total.checked_add(value.checked_mul(unit)?)?;
        any = true;
    }
    if !number.is_empty() {
        return None;
    }
    any.then(|| u32::try_from(total).ok()).flatten()
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dump {
    /// `ip` or `ip6`, from the first statement.
    pub family: String,
    pub table: String,
    /// Chains by name, in the order they were added.
    pub chains: BTreeMap<String, Chain>,
    pub chain_order: Vec<String>,
    /// Sets and maps by name (they share one namespace in nftables).
    pub sets: BTreeMap<String, Set>,
}

/// A statement the parser does not understand, with its line number (from 1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    pub line: usize,
    pub message: String,
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

impl std::error::Error for ParseError {}

/// nft's named priorities (`nft(8)`, "PRIORITY"), for chains written with them.
fn named_priority(name: &str) -> Option<i32> {
    Some(match name {
        "raw" => -300,
        "mangle" => -150,
        "dstnat" => -100,
        "filter" => 0,
        "security" => 50,
        "srcnat" => 100,
        _ => return None,
    })
}

/// `-110`, `dstnat`, `dstnat - 10`, `filter + 5`.
fn parse_priority(text: &str) -> Option<i32> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let base = |w: &str| w.parse::<i32>().ok().or_else(|| named_priority(w));
    match words.as_slice() {
        [one] => {
            // `dstnat-10` written without spaces.
            if let Some(v) = base(one) {
                return Some(v);
            }
            let (at, _) = one
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == '+' || c == '-')?;
            let (name, off) = one.split_at(at);
            Some(base(name)? + off.parse::<i32>().ok()?)
        }
        [name, "+", off] => Some(base(name)? + off.parse::<i32>().ok()?),
        [name, "-", off] => Some(base(name)? - off.parse::<i32>().ok()?),
        _ => None,
    }
}

/// The text between the first `{` and its matching `}`.
fn braced(text: &str) -> Option<&str> {
    let start = text.find('{')?;
    let mut depth = 0usize;
    let mut quoted = false;
    for (i, c) in text[start..].char_indices() {
        match c {
            '"' => quoted = !quoted,
            '{' if !quoted => depth += 1,
            '}' if !quoted => {
                depth -= 1;
                if depth == 0 {
                    return Some(&text[start + 1..start + i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// Splits at `sep` where it is outside quotes and nested braces.
pub fn split_top(text: &str, sep: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut quoted = false;
    let mut last = 0;
    let mut i = 0;
    let bytes = text.as_bytes();
    while i < bytes.len() {
        match bytes[i] {
            b'"' => quoted = !quoted,
            b'{' if !quoted => depth += 1,
            b'}' if !quoted => depth = depth.saturating_sub(1),
            _ if !quoted && depth == 0 && bytes[i..].starts_with(sep.as_bytes()) => {
                parts.push(text[last..i].trim().to_string());
                i += sep.len();
                last = i;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    parts.push(text[last..].trim().to_string());
    parts
}

/// Removes `comment "..."` (and the element options that are not part of the key).
fn strip_options(key: &str) -> String {
    let mut out = String::new();
    let mut words = split_top(key, " ").into_iter().filter(|w| !w.is_empty());
    while let Some(w) = words.next() {
        if matches!(w.as_str(), "comment" | "timeout" | "expires" | "counter") {
            if w != "counter" {
                words.next();
            }
            continue;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(&w);
    }
    out
}

/// The elements of `{ k1 : v1, k2 : v2 }` (or of a set, without values).
pub fn parse_elements(body: &str) -> Vec<Element> {
    split_top(body, ",")
        .into_iter()
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (key, value) = match split_top(&e, " : ").as_slice() {
                [k, v] => (k.clone(), Some(v.trim().to_string())),
                _ => (e.clone(), None),
            };
            Element {
                key: split_top(&strip_options(&key), " . "),
                value,
            }
        })
        .collect()
}

impl Dump {
    pub fn parse(text: &str) -> Result<Dump, ParseError> {
        let mut dump = Dump::default();
        for (i, line) in text.lines().enumerate() {
            dump.apply_line(line).map_err(|message| ParseError {
                line: i + 1,
                message,
            })?;
        }
        dump.inline_endpoint_maps()
            .map_err(|message| ParseError { line: 0, message })?;
        Ok(dump)
    }

    fn apply_line(&mut self, line: &str) -> Result<(), String> {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return Ok(());
        }
        let mut words = line.splitn(5, ' ');
        let verb = words.next().unwrap_or_default();
        let object = words.next().unwrap_or_default();
        let family = words.next().unwrap_or_default();
        let table = words.next().unwrap_or_default();
        let rest = words.next().unwrap_or_default();
        if family.is_empty() || table.is_empty() {
            return Err(format!("too short: {line:?}"));
        }
        if self.table.is_empty() {
            self.family = family.to_string();
            self.table = table.to_string();
        } else if (self.family.as_str(), self.table.as_str()) != (family, table) {
            return Err(format!(
                "table {family} {table}, but this dump is of {} {}",
                self.family, self.table
            ));
        }
        let (name, body) = rest.split_once(' ').unwrap_or((rest, ""));
        match (verb, object) {
            ("add" | "create", "table") => {}
            ("flush", "table") => {
                for c in self.chains.values_mut() {
                    c.rules.clear();
                }
                for s in self.sets.values_mut() {
                    s.elements.clear();
                }
            }
            ("delete" | "destroy", "table") => *self = Dump::default(),
            ("add" | "create", "chain") => self.add_chain(name, body)?,
            ("flush", "chain") => self.chain_mut(name)?.rules.clear(),
            ("delete" | "destroy", "chain") => {
                self.chains.remove(name);
                self.chain_order.retain(|c| c != name);
            }
            ("add" | "insert", "rule") => {
                if body.is_empty() {
                    return Err(format!("empty rule in chain {name}"));
                }
                let rules = &mut self.chain_mut(name)?.rules;
                if verb == "add" {
                    rules.push(body.to_string());
                } else {
                    rules.insert(0, body.to_string());
                }
            }
            ("add" | "create", "set" | "map") => {
                let timeout = braced(body).and_then(|spec| {
                    split_top(spec, ";")
                        .iter()
                        .find_map(|part| part.trim().strip_prefix("timeout ").map(str::to_owned))
                });
                let set = self.sets.entry(name.to_string()).or_default();
                set.is_map = object == "map";
                if let Some(t) = timeout {
                    set.timeout_secs = parse_duration(&t);
                }
            }
            ("flush", "set" | "map") => self.set_mut(name)?.elements.clear(),
            ("delete" | "destroy", "set" | "map") => {
                self.sets.remove(name);
            }
            ("add" | "create", "element") => {
                let elements = braced(body).ok_or_else(|| format!("no {{ }} in {line:?}"))?;
                let new = parse_elements(elements);
                let set = self.set_mut(name)?;
                for e in new {
                    set.elements.retain(|old| old.key != e.key);
                    set.elements.push(e);
                }
            }
            ("delete" | "destroy", "element") => {
                let elements = braced(body).ok_or_else(|| format!("no {{ }} in {line:?}"))?;
                let gone = parse_elements(elements);
                let set = self.set_mut(name)?;
                set.elements
                    .retain(|old| !gone.iter().any(|g| g.key == old.key));
            }
            _ => return Err(format!("unknown statement {verb} {object}")),
        }
        Ok(())
    }

    fn add_chain(&mut self, name: &str, body: &str) -> Result<(), String> {
        let hook = match braced(body) {
            Some(spec) if spec.contains("hook") => {
                let words: Vec<&str> = spec.split_whitespace().collect();
                let after = |key: &str| {
                    words
                        .iter()
                        .position(|w| *w == key)
                        .and_then(|i| words.get(i + 1))
                        .map(|w| w.trim_end_matches(';').to_string())
                };
                let priority_text = spec
                    .split_once("priority")
                    .map(|(_, p)| p.split(';').next().unwrap_or_default().trim())
                    .ok_or_else(|| format!("chain {name}: hook without priority"))?;
                Some(Hook {
                    kind: after("type").ok_or_else(|| format!("chain {name}: no type"))?,
                    hook: after("hook").ok_or_else(|| format!("chain {name}: no hook"))?,
                    priority: parse_priority(priority_text)
                        .ok_or_else(|| format!("chain {name}: priority {priority_text:?}"))?,
                })
            }
            _ => None,
        };
        if !self.chains.contains_key(name) {
            self.chain_order.push(name.to_string());
        }
        let chain = self.chains.entry(name.to_string()).or_default();
        if hook.is_some() {
            chain.hook = hook;
        }
        Ok(())
    }

    fn chain_mut(&mut self, name: &str) -> Result<&mut Chain, String> {
        self.chains
            .get_mut(name)
            .ok_or_else(|| format!("no chain {name}"))
    }

    fn set_mut(&mut self, name: &str) -> Result<&mut Set, String> {
        self.sets
            .get_mut(name)
            .ok_or_else(|| format!("no set or map {name}"))
    }

    /// The base chains on `hook`, lowest priority first (ties by name, for a stable order).
    pub fn hooked(&self, hook: &str) -> Vec<(&str, &Hook)> {
        let mut out: Vec<(&str, &Hook)> = self
            .chains
            .iter()
            .filter_map(|(n, c)| c.hook.as_ref().map(|h| (n.as_str(), h)))
            .filter(|(_, h)| h.hook == hook)
            .collect();
        out.sort_by_key(|(n, h)| (h.priority, *n));
        out
    }

    /// kube-proxy's diffNFTablesChain input: a chain's rules, one a line.
    pub fn chain_text(&self, chain: &str) -> String {
        self.chains
            .get(chain)
            .map(|c| c.rules.join("\n"))
            .unwrap_or_default()
    }
}

impl Dump {
    /// Reads `nft list table FAMILY NAME` output (nft's nested form) into the same model
    /// as [`Dump::parse`], by turning each block into the `add` statements it stands for.
    pub fn from_listing(text: &str) -> Result<Dump, ParseError> {
        let err = |line: usize, message: String| ParseError { line, message };
        let mut statements = String::new();
        let mut table = String::new();
        // (kind, name, header: `{ type ... ; }` parts, elements text, first line)
        let mut block: Option<(String, String, Vec<String>, String, usize)> = None;
        let mut in_elements = false;
        let mut rules: Vec<(String, String)> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let n = i + 1;
            let line = raw.trim();
            if line.is_empty() {
                continue;
            }
            if table.is_empty() {
                let rest = line
                    .strip_prefix("table ")
                    .and_then(|r| r.strip_suffix(" {"))
                    .ok_or_else(|| err(n, format!("expected `table FAMILY NAME {{`: {line:?}")))?;
                table = rest.to_string();
                statements.push_str(&format!("add table {table}\n"));
                continue;
            }
            if let Some((kind, name, header, elements, _)) = block.as_mut() {
                if in_elements {
                    elements.push(' ');
                    elements.push_str(line);
                    in_elements = !line.ends_with('}');
                    continue;
                }
                if line == "}" {
                    let (kind, name, header, elements, _) = block.take().unwrap_or_default();
                    let spec = if header.is_empty() {
                        String::new()
                    } else {
                        format!(" {{ {} ; }}", header.join(" ; "))
                    };
                    statements.push_str(&format!("add {kind} {table} {name}{spec}\n"));
                    if !elements.is_empty() {
                        statements.push_str(&format!("add element {table} {name} {elements}\n"));
                    }
                    continue;
                }
                if let Some(e) = line.strip_prefix("elements = ") {
                    elements.push_str(e);
                    in_elements = !e.ends_with('}');
                    continue;
                }
                if *kind == "chain" {
                    if line.starts_with("type ") {
                        // `type filter hook input priority filter; policy accept;`
                        let hook = line.split(';').next().unwrap_or_default().trim();
                        header.push(hook.to_string());
                    } else if line.starts_with("comment \"") {
                        header.push(line.to_string());
                    } else {
                        rules.push((name.clone(), line.to_string()));
                    }
                } else {
                    header.push(line.to_string());
                }
                continue;
            }
            if line == "}" {
                table.push_str(" (closed)");
                continue;
            }
            if table.ends_with(" (closed)") {
                return Err(err(n, format!("text after the table: {line:?}")));
            }
            if line.starts_with("comment \"") || line.starts_with("flags ") {
                continue;
            }
            let Some((kind, rest)) = line.split_once(' ') else {
                return Err(err(n, format!("unexpected {line:?}")));
            };
            let Some(name) = rest.strip_suffix(" {") else {
                return Err(err(n, format!("unexpected {line:?}")));
            };
            if !matches!(kind, "chain" | "set" | "map") {
                return Err(err(n, format!("unknown block {kind}")));
            }
            block = Some((
                kind.to_string(),
                name.to_string(),
                Vec::new(),
                String::new(),
                n,
            ));
        }
        if let Some((kind, name, .., first)) = block {
            return Err(err(first, format!("{kind} {name} is not closed")));
        }
        let table = table.trim_end_matches(" (closed)").to_string();
        for (chain, rule) in rules {
            statements.push_str(&format!("add rule {table} {chain} {rule}\n"));
        }
        // Line numbers of the statements are not the listing's: report the statement.
        Dump::parse(&statements).map_err(|e| ParseError {
            line: 0,
            message: format!(
                "{}: {:?}",
                e.message,
                statements
                    .lines()
                    .nth(e.line.saturating_sub(1))
                    .unwrap_or_default()
            ),
        })
    }
}

impl Dump {
    /// The dump as `add` statements (chains with their hooks, rules, sets, elements), for
    /// comparing two dumps' contents whatever order they were built in.
    pub fn to_statements(&self) -> String {
        let t = format!("{} {}", self.family, self.table);
        let mut out = format!("add table {t}\n");
        for (name, c) in &self.chains {
            match &c.hook {
                Some(h) => out.push_str(&format!(
                    "add chain {t} {name} {{ type {} hook {} priority {} ; }}\n",
                    h.kind, h.hook, h.priority
                )),
                None => out.push_str(&format!("add chain {t} {name}\n")),
            }
            for r in &c.rules {
                out.push_str(&format!("add rule {t} {name} {r}\n"));
            }
        }
        for (name, s) in &self.sets {
            let kind = if s.is_map { "map" } else { "set" };
            out.push_str(&format!("add {kind} {t} {name}\n"));
            for e in &s.elements {
                let value = e
                    .value
                    .as_ref()
                    .map(|v| format!(" : {v}"))
                    .unwrap_or_default();
                out.push_str(&format!(
                    "add element {t} {name} {{ {}{value} }}\n",
                    e.key.join(" . ")
                ));
            }
        }
        out
    }
}
