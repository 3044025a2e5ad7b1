//! The fake API server's storage: the resource table, objects keyed like etcd keys, the global
//! resource version, the event history that watches replay, selectors, and Status errors.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    fmt,
    ops::Bound,
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use serde_json::{Map, Value, json};

/// One kind of object the server stores.
#[derive(Debug)]
pub(super) struct ResourceDef {
    /// The plural, as in URLs: `services`.
    pub plural: &'static str,
    pub singular: &'static str,
    pub kind: &'static str,
    /// `""` for the core group.
    pub group: &'static str,
    pub version: &'static str,
    pub namespaced: bool,
    /// Field selector labels besides `metadata.name` and `metadata.namespace`.
    pub fields: &'static [&'static str],
}

impl ResourceDef {
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }
}

pub(super) const RESOURCES: &[ResourceDef] = &[
    ResourceDef {
        plural: "services",
        singular: "service",
        kind: "Service",
        group: "",
        version: "v1",
        namespaced: true,
        fields: &["spec.clusterIP", "spec.type"],
    },
    ResourceDef {
        plural: "endpoints",
        singular: "endpoints",
        kind: "Endpoints",
        group: "",
        version: "v1",
        namespaced: true,
        fields: &[],
    },
    ResourceDef {
        plural: "nodes",
        singular: "node",
        kind: "Node",
        group: "",
        version: "v1",
        namespaced: false,
        fields: &["spec.unschedulable"],
    },
    ResourceDef {
        plural: "namespaces",
        singular: "namespace",
        kind: "Namespace",
        group: "",
        version: "v1",
        namespaced: false,
        fields: &["status.phase"],
    },
    ResourceDef {
        plural: "endpointslices",
        singular: "endpointslice",
        kind: "EndpointSlice",
        group: "discovery.k8s.io",
        version: "v1",
        namespaced: true,
        fields: &["addressType"],
    },
    ResourceDef {
        plural: "servicecidrs",
        singular: "servicecidr",
        kind: "ServiceCIDR",
        group: "networking.k8s.io",
        version: "v1",
        namespaced: false,
        fields: &[],
    },
];

/// The index in [`RESOURCES`] of a resource named by plural, singular or kind (any case), or
/// `plural.group`.
pub(super) fn resource_index(name: &str) -> Option<usize> {
    RESOURCES.iter().position(|r| {
        name == r.plural
            || name == r.singular
            || name.eq_ignore_ascii_case(r.kind)
            || name == r.qualified()
    })
}

/// A Kubernetes `Status` failure, as the server answers errors.
#[derive(Clone, Debug, PartialEq)]
pub struct Status {
    pub code: u16,
    /// `NotFound`, `AlreadyExists`, `Conflict`, `Expired`, `BadRequest`, `Invalid`, ...
    pub reason: String,
    pub message: String,
    pub details: Option<Value>,
}

impl Status {
    pub fn new(code: u16, reason: &str, message: impl Into<String>) -> Status {
        Status {
            code,
            reason: reason.to_string(),
            message: message.into(),
            details: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Status {
        Status::new(400, "BadRequest", message)
    }

    fn with_details(mut self, details: Value) -> Status {
        self.details = Some(details);
        self
    }

    pub(super) fn not_found(def: &ResourceDef, name: &str) -> Status {
        Status::new(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", def.qualified()),
        )
        .with_details(json!({"name": name, "group": def.group, "kind": def.plural}))
    }

    pub fn expired(message: impl Into<String>) -> Status {
        Status::new(410, "Expired", message)
    }

    pub fn too_old(rv: u64, oldest: u64) -> Status {
        Status::expired(format!("too old resource version: {rv} ({oldest})"))
    }

    pub fn too_large(rv: u64, current: u64) -> Status {
        Status::new(504, "Timeout", format!("Too large resource version: {rv}, current: {current}"))
            .with_details(json!({
                "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                "retryAfterSeconds": 1
            }))
    }

    /// The Status object, as sent in bodies and in watch ERROR events.
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            v["details"] = d.clone();
        }
        v
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({} {})", self.message, self.code, self.reason)
    }
}

impl std::error::Error for Status {}

// ---------------------------------------------------------------------------------------------
// Selectors

#[derive(Clone, Debug, PartialEq)]
enum Requirement {
    Exists(String),
    NotExists(String),
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Gt(String, i64),
    Lt(String, i64),
}

/// A parsed label selector (`a=b,c!=d,e,!f,g in (h,i),j notin (k),l>1`).
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct LabelSelector(Vec<Requirement>);

fn valid_label_key(k: &str) -> bool {
    let (prefix, name) = match k.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.as_bytes()[name.len() - 1].is_ascii_alphanumeric();
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-.".contains(&b))
    });
    name_ok && prefix_ok
}

fn valid_label_value(v: &str) -> bool {
    v.is_empty()
        || (v.len() <= 63
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            && v.as_bytes()[0].is_ascii_alphanumeric()
            && v.as_bytes()[v.len() - 1].is_ascii_alphanumeric())
}

/// Splits at commas that are not inside parentheses.
fn split_terms(s: &str) -> Result<Vec<&str>, String> {
    let mut terms = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth < 0 {
                    return Err(format!(
                        "unable to parse requirement: unbalanced ')' in {s:?}"
                    ));
                }
            }
            ',' if depth == 0 => {
                terms.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!(
            "unable to parse requirement: unbalanced '(' in {s:?}"
        ));
    }
    terms.push(&s[start..]);
    Ok(terms)
}

impl LabelSelector {
    pub fn parse(s: &str) -> Result<LabelSelector, String> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(LabelSelector::default());
        }
        let mut reqs = Vec::new();
        for term in split_terms(s)? {
            reqs.push(Self::parse_term(term.trim())?);
        }
        Ok(LabelSelector(reqs))
    }

    fn parse_term(t: &str) -> Result<Requirement, String> {
        let err = |why: &str| format!("unable to parse requirement: {why}: {t:?}");
        let key = |k: &str| {
            let k = k.trim();
            if valid_label_key(k) {
                Ok(k.to_string())
            } else {
                Err(err("invalid label key"))
            }
        };
        let value = |v: &str| {
            let v = v.trim();
            if valid_label_value(v) {
                Ok(v.to_string())
            } else {
                Err(err("invalid label value"))
            }
        };
        if t.is_empty() {
            return Err(err("found '', expected: !, identifier, or 'end of string'"));
        }
        if let Some(k) = t.strip_prefix('!') {
            return Ok(Requirement::NotExists(key(k)?));
        }
        if let Some((k, v)) = t.split_once("!=") {
            return Ok(Requirement::Ne(key(k)?, value(v)?));
        }
        if let Some((k, v)) = t.split_once("==") {
            return Ok(Requirement::Eq(key(k)?, value(v)?));
        }
        if let Some((k, v)) = t.split_once('=') {
            return Ok(Requirement::Eq(key(k)?, value(v)?));
        }
        for (op, gt) in [('>', true), ('<', false)] {
            if let Some((k, v)) = t.split_once(op) {
                let n: i64 = v
                    .trim()
                    .parse()
                    .map_err(|_| err("for 'gt', 'lt' operators, the value must be an integer"))?;
                return Ok(if gt {
                    Requirement::Gt(key(k)?, n)
                } else {
                    Requirement::Lt(key(k)?, n)
                });
            }
        }
        let mut words = t.splitn(2, char::is_whitespace);
        let k = key(words.next().unwrap_or_default())?;
        let Some(rest) = words.next().map(str::trim) else {
            return Ok(Requirement::Exists(k));
        };
        let (op, list) = if let Some(l) = rest.strip_prefix("notin") {
            ("notin", l)
        } else if let Some(l) = rest.strip_prefix("in") {
            ("in", l)
        } else {
            return Err(err("expected one of =, ==, !=, in, notin"));
        };
        let list = list.trim();
        let Some(inner) = list.strip_prefix('(').and_then(|l| l.strip_suffix(')')) else {
            return Err(err("expected a parenthesised value list"));
        };
        let values = inner.split(',').map(value).collect::<Result<Vec<_>, _>>()?;
        if inner.trim().is_empty() {
            return Err(err(
                "for 'in', 'notin' operators, values set can't be empty",
            ));
        }
        Ok(if op == "in" {
            Requirement::In(k, values)
        } else {
            Requirement::NotIn(k, values)
        })
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels").and_then(Value::as_object);
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
            Requirement::Eq(k, v) => get(k) == Some(v.as_str()),
            Requirement::Ne(k, v) => get(k) != Some(v.as_str()),
            Requirement::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Requirement::NotIn(k, vs) => get(k).is_none_or(|x| !vs.iter().any(|v| v == x)),
            Requirement::Gt(k, n) => get(k)
                .and_then(|x| x.parse::<i64>().ok())
                .is_some_and(|x| x > *n),
            Requirement::Lt(k, n) => get(k)
                .and_then(|x| x.parse::<i64>().ok())
                .is_some_and(|x| x < *n),
        })
    }
}

/// A parsed field selector (`metadata.name=x,metadata.namespace!=y`).
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    pub fn parse(s: &str, def: &ResourceDef) -> Result<FieldSelector, String> {
        let s = s.trim();
        let mut reqs = Vec::new();
        if s.is_empty() {
            return Ok(FieldSelector(reqs));
        }
        for term in s.split(',') {
            let term = term.trim();
            let (field, eq, value) = if let Some((f, v)) = term.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, true, v)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, true, v)
            } else {
                return Err(format!(
                    "invalid selector: '{s}'; can't understand '{term}'"
                ));
            };
            let field = field.trim();
            if !(field == "metadata.name"
                || field == "metadata.namespace"
                || def.fields.contains(&field))
            {
                return Err(format!("field label not supported: {field}"));
            }
            reqs.push((field.to_string(), eq, value.trim().to_string()));
        }
        Ok(FieldSelector(reqs))
    }

    pub fn push_name(&mut self, name: &str) {
        self.0.push(("metadata.name".into(), true, name.into()));
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(field, eq, want)| {
            let pointer = format!("/{}", field.replace('.', "/"));
            let have = match obj.pointer(&pointer) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Bool(b)) => b.to_string(),
                Some(Value::Number(n)) => n.to_string(),
                // Unset booleans read as false, as Go's zero values do.
                None if field == "spec.unschedulable" => "false".into(),
                _ => String::new(),
            };
            (have == *want) == *eq
        })
    }
}

/// What a list or watch selects: one resource, optionally one namespace, and selectors.
#[derive(Clone, Debug)]
pub(super) struct Filter {
    pub res: usize,
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
}

impl Filter {
    pub fn matches(&self, obj: &Value) -> bool {
        if let Some(ns) = &self.namespace
            && namespace_of(obj) != Some(ns.as_str())
        {
            return false;
        }
        self.labels.matches(obj) && self.fields.matches(obj)
    }

    pub fn has_selectors(&self) -> bool {
        !self.labels.is_empty() || !self.fields.is_empty()
    }

    /// What a watch with this filter sees of `ev`, as the real watch cache does it: objects
    /// that start matching arrive as ADDED, objects that stop matching leave as DELETED.
    pub fn convert(&self, ev: &Event) -> Option<(&'static str, Value)> {
        if ev.res != self.res {
            return None;
        }
        let cur = self.matches(&ev.obj);
        match ev.kind {
            EventKind::Added => cur.then(|| ("ADDED", ev.obj.clone())),
            EventKind::Deleted => cur.then(|| ("DELETED", ev.obj.clone())),
            EventKind::Modified => {
                let old = ev.prev.as_ref().is_some_and(|p| self.matches(p));
                match (cur, old) {
                    (true, true) => Some(("MODIFIED", ev.obj.clone())),
                    (true, false) => Some(("ADDED", ev.obj.clone())),
                    (false, true) => {
                        let mut prev = ev.prev.clone().unwrap_or_default();
                        set_rv(&mut prev, ev.rv);
                        Some(("DELETED", prev))
                    }
                    (false, false) => None,
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Objects

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum EventKind {
    Added,
    Modified,
    Deleted,
}

/// One change to the store.
#[derive(Debug)]
pub(super) struct Event {
    pub rv: u64,
    pub res: usize,
    pub kind: EventKind,
    pub key: String,
    /// The object after the change; for deletes its last state, with the deletion's RV.
    pub obj: Value,
    /// The object before the change (None for creates).
    pub prev: Option<Value>,
}

pub(super) fn name_of(obj: &Value) -> Option<&str> {
    obj.pointer("/metadata/name").and_then(Value::as_str)
}

pub(super) fn namespace_of(obj: &Value) -> Option<&str> {
    obj.pointer("/metadata/namespace").and_then(Value::as_str)
}

fn set_rv(obj: &mut Value, rv: u64) {
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("resourceVersion".into(), Value::String(rv.to_string()));
    }
}

pub(super) fn key_of(def: &ResourceDef, namespace: Option<&str>, name: &str) -> String {
    if def.namespaced {
        format!("{}/{name}", namespace.unwrap_or("default"))
    } else {
        name.to_string()
    }
}

/// An object as list items carry it: without kind and apiVersion, as a real server sends
/// them. Serialized from the stored object, not from a copy: copying every object of a
/// 500-item page was most of what a list page cost the server.
pub(super) struct ListItem<'a>(pub &'a Value);

impl serde::Serialize for ListItem<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        let Value::Object(map) = self.0 else {
            return self.0.serialize(s);
        };
        let fields = map
            .iter()
            .filter(|(k, _)| *k != "kind" && *k != "apiVersion");
        let mut out = s.serialize_map(None)?;
        for (k, v) in fields {
            out.serialize_entry(k, v)?;
        }
        out.end()
    }
}

/// RFC 7386 JSON merge patch.
pub(super) fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    if let Value::Object(t) = target {
        for (k, v) in p {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// State

/// A live watch's inbox; mutations push into it, so a compaction does not take events from
/// watches already running.
#[derive(Debug)]
pub(super) struct WatchSlot {
    pub filter: Filter,
    pub queue: Vec<(&'static str, Value)>,
    /// Set by drop_watches: the watch must end abruptly.
    pub dropped: bool,
}

#[derive(Debug)]
pub(super) struct State {
    /// The global resource version: that of the latest change (1 before any).
    pub rv: u64,
    /// The history holds every event with rv > floor.
    pub floor: u64,
    pub stores: Vec<BTreeMap<String, Value>>,
    pub history: VecDeque<Arc<Event>>,
    pub max_history: usize,
    pub watches: HashMap<u64, WatchSlot>,
    pub next_watch: u64,
    pub bookmark_interval: Duration,
    rng: u64,
}

impl State {
    pub fn new() -> State {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
            ^ u64::from(std::process::id()).rotate_left(32);
        State {
            rv: 1,
            floor: 1,
            stores: RESOURCES.iter().map(|_| BTreeMap::new()).collect(),
            history: VecDeque::new(),
            max_history: 100_000,
            watches: HashMap::new(),
            next_watch: 1,
            bookmark_interval: Duration::from_secs(1),
            rng: seed | 1,
        }
    }

    fn random(&mut self) -> u64 {
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn uid(&mut self) -> String {
        let (a, b) = (self.random(), self.random());
        let b = (b & 0x3fff_ffff_ffff_ffff) | 0x8000_0000_0000_0000;
        let a = (a & 0xffff_ffff_ffff_0fff) | 0x4000;
        format!(
            "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
            a >> 32,
            (a >> 16) & 0xffff,
            a & 0xffff,
            b >> 48,
            b & 0xffff_ffff_ffff
        )
    }

    /// Records a change: bumps nothing (the caller has), appends to the history, fans out to
    /// the live watches.
    fn record(&mut self, ev: Event) {
        let ev = Arc::new(ev);
        for slot in self.watches.values_mut() {
            if let Some(e) = slot.filter.convert(&ev) {
                slot.queue.push(e);
            }
        }
        self.history.push_back(ev);
        while self.history.len() > self.max_history {
            if let Some(old) = self.history.pop_front() {
                self.floor = old.rv;
            }
        }
    }

    /// Drops the whole event history: watches and exact lists from older RVs get 410.
    pub fn compact(&mut self) {
        self.history.clear();
        self.floor = self.rv;
    }

    /// Checks kind/apiVersion and fills in metadata for a create; returns the object's key.
    fn admit(
        &mut self,
        res: usize,
        path_ns: Option<&str>,
        obj: &mut Value,
    ) -> Result<String, Status> {
        let def = &RESOURCES[res];
        let Some(map) = obj.as_object_mut() else {
            return Err(Status::bad_request(
                "the body of the request must be a JSON object",
            ));
        };
        check_type(def, map)?;
        map.insert("kind".into(), def.kind.into());
        map.insert("apiVersion".into(), def.api_version().into());
        let meta = map.entry("metadata").or_insert_with(|| json!({}));
        let Some(meta) = meta.as_object_mut() else {
            return Err(Status::bad_request("metadata must be an object"));
        };
        if def.namespaced {
            let body_ns = meta
                .get("namespace")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty());
            let ns = match (path_ns, body_ns) {
                (Some(p), Some(b)) if p != b => {
                    return Err(Status::bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
                (Some(p), _) => p.to_string(),
                (None, Some(b)) => b.to_string(),
                (None, None) => "default".to_string(),
            };
            meta.insert("namespace".into(), ns.into());
        } else {
            meta.remove("namespace");
        }
        let name = meta
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if name.is_empty() {
            return Err(Status::new(
                422,
                "Invalid",
                format!(
                    "{} \"\" is invalid: metadata.name: Required value: name or generateName is required",
                    def.kind
                ),
            ));
        }
        if name.len() > 253
            || !name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-.".contains(&b))
        {
            return Err(Status::new(
                422,
                "Invalid",
                format!(
                    "{} \"{name}\" is invalid: metadata.name: Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.'",
                    def.kind
                ),
            ));
        }
        Ok(key_of(
            def,
            meta.get("namespace").and_then(Value::as_str),
            &name,
        ))
    }

    pub fn create(
        &mut self,
        res: usize,
        path_ns: Option<&str>,
        mut obj: Value,
    ) -> Result<Value, Status> {
        let def = &RESOURCES[res];
        // generateName
        if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
            let named = meta
                .get("name")
                .and_then(Value::as_str)
                .is_some_and(|n| !n.is_empty());
            if let (false, Some(prefix)) = (named, meta.get("generateName").and_then(Value::as_str))
            {
                let prefix = prefix.to_string();
                const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
                let mut r = self.random();
                let suffix: String = (0..5)
                    .map(|_| {
                        let c = ALPHABET[(r % ALPHABET.len() as u64) as usize] as char;
                        r /= ALPHABET.len() as u64;
                        c
                    })
                    .collect();
                meta.insert("name".into(), format!("{prefix}{suffix}").into());
            }
        }
        let key = self.admit(res, path_ns, &mut obj)?;
        if self.stores[res].contains_key(&key) {
            let name = name_of(&obj).unwrap_or_default();
            return Err(Status::new(
                409,
                "AlreadyExists",
                format!("{} \"{name}\" already exists", def.qualified()),
            )
            .with_details(json!({"name": name, "group": def.group, "kind": def.plural})));
        }
        let uid = self.uid();
        self.rv += 1;
        let rv = self.rv;
        if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.insert("uid".into(), uid.into());
            meta.insert("resourceVersion".into(), rv.to_string().into());
            meta.insert("creationTimestamp".into(), rfc3339_now().into());
            meta.remove("deletionTimestamp");
        }
        self.stores[res].insert(key.clone(), obj.clone());
        self.record(Event {
            rv,
            res,
            kind: EventKind::Added,
            key,
            obj: obj.clone(),
            prev: None,
        });
        Ok(obj)
    }

    /// Replaces an object. `path` is the namespace and name from the URL, if any; when the
    /// body carries metadata.resourceVersion and `check_rv`, it must be the current one.
    pub fn update(
        &mut self,
        res: usize,
        path: Option<(Option<&str>, &str)>,
        mut obj: Value,
        check_rv: bool,
    ) -> Result<Value, Status> {
        let def = &RESOURCES[res];
        if let Some((_, name)) = path {
            match name_of(&obj) {
                Some(n) if n != name => {
                    return Err(Status::bad_request(format!(
                        "the name of the object ({n}) does not match the name on the URL ({name})"
                    )));
                }
                Some(_) => {}
                None => {
                    if let Some(meta) = obj
                        .as_object_mut()
                        .map(|m| m.entry("metadata").or_insert_with(|| json!({})))
                        && let Some(meta) = meta.as_object_mut()
                    {
                        meta.insert("name".into(), name.into());
                    }
                }
            }
        }
        let key = self.admit(res, path.and_then(|p| p.0), &mut obj)?;
        let name = name_of(&obj).unwrap_or_default().to_string();
        let Some(old) = self.stores[res].get(&key).cloned() else {
            return Err(Status::not_found(def, &name));
        };
        let old_rv = old
            .pointer("/metadata/resourceVersion")
            .cloned()
            .unwrap_or_default();
        let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) else {
            return Err(Status::bad_request("metadata must be an object"));
        };
        match meta.get("resourceVersion").and_then(Value::as_str) {
            Some(want) if check_rv && !want.is_empty() && Some(want) != old_rv.as_str() => {
                return Err(Status::new(
                    409,
                    "Conflict",
                    format!(
                        "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                        def.qualified()
                    ),
                )
                .with_details(json!({"name": name, "group": def.group, "kind": def.plural})));
            }
            _ => {}
        }
        // Server-owned fields stay as they were.
        for f in ["uid", "creationTimestamp"] {
            match old.pointer(&format!("/metadata/{f}")) {
                Some(v) => meta.insert(f.into(), v.clone()),
                None => meta.remove(f),
            };
        }
        meta.insert("resourceVersion".into(), old_rv);
        if obj == old {
            return Ok(old); // a no-op update changes nothing, not even the resourceVersion
        }
        self.rv += 1;
        let rv = self.rv;
        set_rv(&mut obj, rv);
        self.stores[res].insert(key.clone(), obj.clone());
        self.record(Event {
            rv,
            res,
            kind: EventKind::Modified,
            key,
            obj: obj.clone(),
            prev: Some(old),
        });
        Ok(obj)
    }

    pub fn delete(
        &mut self,
        res: usize,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, Status> {
        let def = &RESOURCES[res];
        let key = key_of(def, namespace, name);
        let Some(old) = self.stores[res].remove(&key) else {
            return Err(Status::not_found(def, name));
        };
        self.rv += 1;
        let rv = self.rv;
        let mut obj = old.clone();
        set_rv(&mut obj, rv);
        self.record(Event {
            rv,
            res,
            kind: EventKind::Deleted,
            key,
            obj: obj.clone(),
            prev: Some(old),
        });
        Ok(obj)
    }

    pub fn get(&self, res: usize, namespace: Option<&str>, name: &str) -> Result<Value, Status> {
        let def = &RESOURCES[res];
        self.stores[res]
            .get(&key_of(def, namespace, name))
            .cloned()
            .ok_or_else(|| Status::not_found(def, name))
    }

    /// One page of `res`: its live objects (`at` None), or as they were at resource version
    /// `at` (floor <= at <= rv), without copying the store: the live objects, with those
    /// changed after `at` seen as they were then. The page starts after the continue token's
    /// key with a B-tree range, so it costs the page, the changes since `at` and, on a first
    /// page without selectors, one count of the rest; a paged list of 50,000 objects used to
    /// walk the whole store for every page.
    pub fn page(
        &self,
        res: usize,
        at: Option<u64>,
        filter: &Filter,
        cont: Option<&Continue>,
        limit: Option<usize>,
    ) -> Result<Page<'_>, Status> {
        let start = cont.map(|c| c.start.as_str());
        // Within a namespace, keys share the prefix `namespace/`.
        let prefix = filter
            .namespace
            .as_deref()
            .filter(|_| RESOURCES[res].namespaced)
            .map(|ns| format!("{ns}/"));
        let prefix = prefix.as_deref();
        let in_range =
            |k: &str| start.is_none_or(|s| k > s) && prefix.is_none_or(|p| k.starts_with(p));
        let count_rest = cont.is_none() && !filter.has_selectors();
        let live = keys_after(&self.stores[res], start, prefix);
        let mut page = match at {
            None => collect_page(live, filter, limit, count_rest),
            Some(at) => {
                if at < self.floor {
                    return Err(Status::too_old(at, self.floor));
                }
                // Each key changed after `at`, and its state at `at`: what its earliest later
                // event says (walking newest to oldest, the last insert wins).
                let mut then: BTreeMap<&str, Option<&Value>> = BTreeMap::new();
                for ev in self.history.iter().rev().take_while(|e| e.rv > at) {
                    if ev.res != res || !in_range(&ev.key) {
                        continue;
                    }
                    let before = match ev.kind {
                        EventKind::Added => None,
                        _ => ev.prev.as_ref(),
                    };
                    then.insert(ev.key.as_str(), before);
                }
                let unchanged = live.filter(|(k, _)| !then.contains_key(k));
                let restored = then.iter().filter_map(|(k, v)| v.map(|v| (*k, v)));
                collect_page(merge_sorted(unchanged, restored), filter, limit, count_rest)
            }
        };
        if let Some(c) = cont {
            // A continued page lists the same snapshot: what followed the last page, less
            // this one.
            page.remaining = c.remaining.map(|r| r.saturating_sub(page.items.len()));
        }
        if page.next.is_none() {
            page.remaining = Some(0);
        }
        Ok(page)
    }

    /// Events of the history with rv > `after`, as `filter` sees them.
    pub fn replay(&self, filter: &Filter, after: u64) -> Vec<(&'static str, Value)> {
        let start = self.history.partition_point(|e| e.rv <= after);
        self.history
            .range(start..)
            .filter_map(|e| filter.convert(e))
            .collect()
    }
}

fn check_type(def: &ResourceDef, map: &Map<String, Value>) -> Result<(), Status> {
    let api_version = def.api_version();
    if let Some(k) = map.get("kind").and_then(Value::as_str)
        && !k.is_empty()
        && k != def.kind
    {
        return Err(Status::bad_request(format!(
            "the kind {k:?} does not match {} for {}",
            def.kind, def.plural
        )));
    }
    if let Some(v) = map.get("apiVersion").and_then(Value::as_str)
        && !v.is_empty()
        && v != api_version
    {
        return Err(Status::bad_request(format!(
            "the apiVersion {v:?} does not match {api_version} for {}",
            def.plural
        )));
    }
    Ok(())
}

/// The objects of `store` after key `start` (exclusive) and, with `prefix`, under it.
fn keys_after<'a, 'p>(
    store: &'a BTreeMap<String, Value>,
    start: Option<&str>,
    prefix: Option<&'p str>,
) -> impl Iterator<Item = (&'a str, &'a Value)> + use<'a, 'p> {
    let lower = match (start, prefix) {
        (Some(s), Some(p)) if s < p => Bound::Included(p),
        (Some(s), _) => Bound::Excluded(s),
        (None, Some(p)) => Bound::Included(p),
        (None, None) => Bound::Unbounded,
    };
    store
        .range::<str, _>((lower, Bound::Unbounded))
        .map(|(k, v)| (k.as_str(), v))
        .take_while(move |(k, _)| prefix.is_none_or(|p| k.starts_with(p)))
}

/// Two iterators sorted by key, as one (keys are distinct between them).
fn merge_sorted<'a>(
    a: impl Iterator<Item = (&'a str, &'a Value)>,
    b: impl Iterator<Item = (&'a str, &'a Value)>,
) -> impl Iterator<Item = (&'a str, &'a Value)> {
    let (mut a, mut b) = (a.peekable(), b.peekable());
    std::iter::from_fn(move || match (a.peek(), b.peek()) {
        (Some(x), Some(y)) if y.0 < x.0 => b.next(),
        (Some(_), _) => a.next(),
        (None, _) => b.next(),
    })
}

/// One page of a list: the stored objects themselves (serialize them with [`ListItem`]).
#[derive(Debug)]
pub(super) struct Page<'a> {
    pub items: Vec<&'a Value>,
    /// The key to continue after, when more objects match.
    pub next: Option<String>,
    /// How many matching objects follow this page, when known.
    pub remaining: Option<usize>,
    /// How many stored objects the page looked at: what it cost.
    pub scanned: usize,
}

/// The first `limit` objects of `objects` (in key order) that `filter` selects; with
/// `count_rest`, also how many more match (else it stops at the first one).
fn collect_page<'a>(
    objects: impl Iterator<Item = (&'a str, &'a Value)>,
    filter: &Filter,
    limit: Option<usize>,
    count_rest: bool,
) -> Page<'a> {
    let mut page = Page {
        items: Vec::new(),
        next: None,
        remaining: None,
        scanned: 0,
    };
    let mut last_key = None;
    let mut rest = 0;
    for (key, obj) in objects {
        page.scanned += 1;
        if !filter.matches(obj) {
            continue;
        }
        if limit.is_some_and(|l| page.items.len() >= l) {
            rest += 1;
            if count_rest {
                continue;
            }
            break;
        }
        page.items.push(obj);
        last_key = Some(key);
    }
    if rest > 0 {
        page.next = last_key.map(str::to_string);
        page.remaining = count_rest.then_some(rest);
    }
    page
}

// ---------------------------------------------------------------------------------------------
// Continue tokens: base64url(JSON), like a real server's.

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

fn b64_encode(data: &[u8]) -> String {
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, &b)| acc | u32::from(b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(B64[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

fn b64_decode(s: &str) -> Option<Vec<u8>> {
    let s = s.trim_end_matches('=');
    let mut out = Vec::new();
    let mut acc = 0u32;
    let mut bits = 0;
    for c in s.bytes() {
        let v = match c {
            b'+' => 62,
            b'/' => 63,
            _ => B64.iter().position(|&x| x == c)? as u32,
        };
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

/// Where a paged list goes on: the snapshot's resource version, the last key sent, and how
/// many objects followed it (when the list has no selectors).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Continue {
    pub rv: u64,
    pub start: String,
    pub remaining: Option<usize>,
}

pub(super) fn encode_continue(c: &Continue) -> String {
    let mut v = json!({"v": "meta.k8s.io/v1", "rv": c.rv, "start": c.start});
    if let Some(r) = c.remaining {
        v["remaining"] = r.into();
    }
    b64_encode(v.to_string().as_bytes())
}

pub(super) fn decode_continue(token: &str) -> Option<Continue> {
    let v: Value = serde_json::from_slice(&b64_decode(token)?).ok()?;
    if v.get("v")?.as_str()? != "meta.k8s.io/v1" {
        return None;
    }
    Some(Continue {
        rv: v.get("rv")?.as_u64()?,
        start: v.get("start")?.as_str()?.to_string(),
        remaining: v
            .get("remaining")
            .and_then(Value::as_u64)
            .and_then(|r| usize::try_from(r).ok()),
    })
}

// ---------------------------------------------------------------------------------------------
// Time

/// Now, as RFC 3339 in UTC with whole seconds (`2025-01-02T03:04:05Z`).
pub(super) fn rfc3339_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"name": "a", "namespace": "n", "labels": labels}})
    }

    #[test]
    fn apiserver_label_selectors() {
        let o = obj(json!({"app": "web", "tier": "1", "service.kubernetes.io/headless": ""}));
        let m = |s: &str| LabelSelector::parse(s).unwrap().matches(&o);
        assert!(m(""));
        assert!(m("app=web"));
        assert!(m("app==web,tier"));
        assert!(!m("app!=web"));
        assert!(m("x!=y"));
        assert!(m("!x"));
        assert!(!m("!service.kubernetes.io/headless"));
        assert!(!m(
            "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
        ));
        assert!(m("app in (db, web)"));
        assert!(!m("app notin (db,web)"));
        assert!(m("x notin (a)"));
        assert!(m("tier>0,tier<2"));
        for bad in [
            "app=",
            "=x",
            "a b",
            "app in db",
            "a in ()",
            "a,,b",
            "a=(b",
            "-a=b",
            "x>y",
        ] {
            if bad == "app=" {
                assert!(LabelSelector::parse(bad).is_ok(), "empty value is allowed");
                continue;
            }
            assert!(
                LabelSelector::parse(bad).is_err(),
                "{bad:?} should not parse"
            );
        }
    }

    #[test]
    fn apiserver_field_selectors() {
        let def = &RESOURCES[0];
        let o = obj(json!({}));
        let m = |s: &str| FieldSelector::parse(s, def).unwrap().matches(&o);
        assert!(m("metadata.name=a,metadata.namespace==n"));
        assert!(!m("metadata.name!=a"));
        assert!(FieldSelector::parse("spec.bogus=x", def).is_err());
        let node = json!({"metadata": {"name": "n1"}, "spec": {}});
        assert!(
            FieldSelector::parse("spec.unschedulable=false", &RESOURCES[2])
                .unwrap()
                .matches(&node)
        );
    }

    #[test]
    fn apiserver_continue_tokens_and_time() {
        for s in ["", "a", "ab", "abc", "default/web-1"] {
            for remaining in [None, Some(7)] {
                let c = Continue {
                    rv: 42,
                    start: s.to_string(),
                    remaining,
                };
                let t = encode_continue(&c);
                assert_eq!(decode_continue(&t), Some(c), "{t}");
            }
        }
        assert_eq!(decode_continue("!!"), None);
        let t = rfc3339_now();
        assert_eq!(t.len(), 20, "{t}");
        assert!(t.starts_with("20") && t.ends_with('Z'));
    }

    /// Pages through `res` at `at` the way a client does (limit, then continue tokens);
    /// returns the names listed and the most objects any continued page looked at.
    fn list_all(
        state: &State,
        filter: &Filter,
        at: u64,
        limit: usize,
    ) -> (Vec<String>, usize, Option<usize>) {
        let mut names = Vec::new();
        let mut worst = 0;
        let mut cont: Option<Continue> = None;
        let mut first_remaining = None;
        loop {
            let page = state
                .page(0, Some(at), filter, cont.as_ref(), Some(limit))
                .unwrap();
            names.extend(page.items.iter().map(|o| name_of(o).unwrap().to_string()));
            if cont.is_some() {
                worst = worst.max(page.scanned);
            } else {
                first_remaining = page.remaining;
            }
            let Some(next) = page.next else { break };
            if let Some(r) = cont.as_ref().and_then(|c| c.remaining) {
                assert_eq!(page.remaining, Some(r - page.items.len()), "counts down");
            }
            cont = Some(Continue {
                rv: at,
                start: next,
                remaining: page.remaining,
            });
        }
        (names, worst, first_remaining)
    }

    /// A paged list must cost each page its own size, not the store's: 20,000 services in
    /// pages of 500 used to walk the whole store for every page (quadratic in the count).
    #[test]
    fn apiserver_list_pages_cost_the_page_not_the_store() {
        const N: usize = 20_000;
        const LIMIT: usize = 500;
        let mut state = State::new();
        for i in 0..N {
            let ns = if i % 10 == 0 { "other" } else { "default" };
            let labels = if i % 2 == 0 {
                json!({"even": "y"})
            } else {
                json!({})
            };
            let svc = json!({"metadata": {"name": format!("s{i:05}"), "namespace": ns, "labels": labels}});
            state.create(0, None, svc).unwrap();
        }
        let at = state.rv;
        // Changes after the snapshot: the list still shows it as it was at `at`.
        state.delete(0, Some("default"), "s00001").unwrap();
        let late = json!({"metadata": {"name": "late", "namespace": "default"}});
        state.create(0, None, late).unwrap();

        let all = Filter {
            res: 0,
            namespace: None,
            labels: LabelSelector::default(),
            fields: FieldSelector::default(),
        };
        let (names, worst, remaining) = list_all(&state, &all, at, LIMIT);
        assert_eq!(names.len(), N);
        assert!(names.contains(&"s00001".to_string()) && !names.contains(&"late".to_string()));
        assert_eq!(remaining, Some(N - LIMIT));
        assert!(
            worst <= LIMIT + 1,
            "a continued page looked at {worst} objects"
        );

        // A label selector that matches 4 in 9 in `default`: a page looks at about 9/4 its size.
        let even = Filter {
            labels: LabelSelector::parse("even=y").unwrap(),
            ..all.clone()
        };
        let (names, worst, _) = list_all(&state, &even, at, LIMIT);
        assert_eq!(names.len(), N / 2);
        assert!(
            worst <= 3 * LIMIT,
            "a continued page looked at {worst} objects"
        );

        // A namespace: the range starts at it and ends with it.
        let other = Filter {
            namespace: Some("other".into()),
            ..all.clone()
        };
        let (names, worst, remaining) = list_all(&state, &other, at, LIMIT);
        assert_eq!(names.len(), N / 10);
        assert_eq!(remaining, Some(N / 10 - LIMIT));
        assert!(
            worst <= LIMIT + 1,
            "a continued page looked at {worst} objects"
        );
    }

    #[test]
    fn apiserver_merge_patch() {
        let mut t = json!({"a": 1, "b": {"c": 2, "d": 3}});
        merge_patch(&mut t, &json!({"a": null, "b": {"c": 5}, "e": [1]}));
        assert_eq!(t, json!({"b": {"c": 5, "d": 3}, "e": [1]}));
    }
}
