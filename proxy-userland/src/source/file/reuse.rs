//! A changed file is read again in full, but only the pieces of its text that changed (a
//! document, or an item of a JSON List) are converted: decoding, checking and converting a
//! file of 500 EndpointSlices took ~40 ms, for the one slice that changed.
//!
//! Each piece is known by a hash of its text (keyed per process, so no file can be made to
//! collide on purpose). A piece that had a problem is not remembered: it is converted, and
//! its problem reported, on every read, as before.
//!
//! A file that is one JSON List (how generated folders and `kubectl get -o json` come) is
//! kept as where each item was, its key, and the List's own text around the items. The next
//! read takes the items whose text is still in place from both ends (the key is a hash of
//! the text) and parses only the items between: splitting and hashing the whole of a
//! 500-item List took ~1 ms, for the one item that changed. The List's own text
//! (apiVersion, kind, what surrounds the items) must be what it was, or the file is read as
//! any other. Not the whole text: at 10,000 services x 10 endpoints that was 12 MB kept
//! beside the objects it made.

use std::{
    collections::HashMap,
    hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState},
    net::IpAddr,
    ops::Range,
    path::Path,
    sync::{Arc, OnceLock},
};

use serde_json::{Value, value::RawValue};

use super::{Loaded, Location, Slice, split_documents};
use crate::model::Service;

/// What one read of a file made of each piece of its text, by the text's hash: the
/// positions of its objects in that read's lists.
#[derive(Debug, Default)]
pub struct Pieces {
    made: HashMap<u64, Made, BuildHasherDefault<KeyHasher>>,
    /// Checking depends on the node's addresses: another set, and nothing is reused.
    node_ips: Vec<IpAddr>,
    /// Where the items of the file were, when it is one JSON List.
    list: Option<ListText>,
    /// This read parsed only what changed in the List (for tests to see which way it went).
    #[cfg(test)]
    compared: bool,
}

#[derive(Clone, Debug)]
struct Made {
    services: Range<usize>,
    slices: Range<usize>,
    skipped: usize,
}

/// A file that is one JSON List, as last read.
#[derive(Debug)]
struct ListText {
    /// The text outside the items, one part after the other: before the first item,
    /// between each two, after the last.
    outside: String,
    /// The whole text's length.
    len: usize,
    /// The line the List starts at, for problems' places.
    line: usize,
    /// What the List's items default to (a ServiceList's are Services).
    item_type: OwnedItemType,
    /// Each item's bytes in the text, in order, and its piece key.
    items: Vec<(Range<usize>, u64)>,
}

impl ListText {
    /// `items` (their bytes in `text`, in order, and keys) and the text around them.
    fn new(
        text: &str,
        line: usize,
        item_type: OwnedItemType,
        items: Vec<(Range<usize>, u64)>,
    ) -> Self {
        let inside: usize = items.iter().map(|(r, _)| r.len()).sum();
        let mut outside = String::with_capacity(text.len() - inside);
        let mut at = 0;
        for (range, _) in &items {
            outside.push_str(&text[at..range.start]);
            at = range.end;
        }
        outside.push_str(&text[at..]);
        ListText {
            outside,
            len: text.len(),
            line,
            item_type,
            items,
        }
    }

    fn item_type(&self) -> ItemType<'_> {
        self.item_type
            .as_ref()
            .map(|(a, k)| (a.as_str(), k.as_str()))
    }

    /// The text around the items, with where each part was: part `k` precedes item `k`,
    /// the last follows the last item.
    fn parts(&self) -> Vec<(Range<usize>, &str)> {
        let mut parts = Vec::with_capacity(self.items.len() + 1);
        let (mut at, mut taken) = (0, 0);
        // Each item's (start, end), then the end of the text, where the last part ends.
        let items = self.items.iter().map(|(r, _)| (r.start, r.end));
        for (start, end) in items.chain(std::iter::once((self.len, self.len))) {
            let n = start - at;
            parts.push((at..start, &self.outside[taken..taken + n]));
            taken += n;
            at = end;
        }
        parts
    }

    /// The items of `new`, this List's file written again, each as its text and key.
    /// Items whose text is where it was, counted from the start and from the end, are
    /// taken by their key (a hash of the text), the text around them by comparing it;
    /// between, an item whose text is the next old item's is taken the same way, and only
    /// the others are parsed. `None` when the List's own text is not all the same, or what
    /// lies between the kept items is not items: the file is then read in full.
    fn items_of<'t>(&self, new: &'t str) -> Option<Vec<(&'t str, u64)>> {
        let n = self.items.len();
        let first = self.items.first()?.0.clone();
        let last = self.items.last()?.0.clone();
        let parts = self.parts();
        let item_type = self.item_type();
        let is = |text: Option<&str>, key: u64| text.is_some_and(|t| hash((item_type, t)) == key);
        let shift = |at: usize| (at + new.len()).checked_sub(self.len);
        // What precedes the first item and follows the last, in place.
        let (head, tail) = (parts[0].1, parts[n].1);
        if new.len() < head.len() + tail.len() || !new.starts_with(head) || !new.ends_with(tail) {
            return None;
        }
        let mut kept_front = 0;
        while kept_front < n {
            let (range, key) = &self.items[kept_front];
            let (before, text) = &parts[kept_front];
            if new.get(before.clone()) != Some(*text) || !is(new.get(range.clone()), *key) {
                break;
            }
            kept_front += 1;
        }
        let from = match kept_front {
            0 => first.start,
            k => self.items[k - 1].0.end,
        };
        let mut kept_back = 0;
        while kept_front + kept_back < n {
            let k = n - 1 - kept_back;
            let (range, key) = &self.items[k];
            let (after, text) = &parts[k + 1];
            // Not into what the start kept.
            let Some(start) = shift(range.start).filter(|&s| s >= from) else {
                break;
            };
            let after = shift(after.start)?..shift(after.end)?;
            if new.get(after) != Some(*text) || !is(new.get(start..start + range.len()), *key) {
                break;
            }
            kept_back += 1;
        }
        let to = shift(match kept_back {
            0 => last.end,
            m => self.items[n - m].0.start,
        })?;
        let between = new.get(from..to)?;
        let old_between: Vec<(usize, u64)> = (self.items[kept_front..n - kept_back].iter())
            .map(|(range, key)| (range.len(), *key))
            .collect();
        let middle = items_between(
            between,
            (kept_front > 0, kept_back > 0),
            &old_between,
            |item| hash((item_type, item)),
            |item, key| is(Some(item), key),
        )?;
        let mut items = Vec::with_capacity(kept_front + middle.len() + kept_back);
        for (range, key) in &self.items[..kept_front] {
            items.push((new.get(range.clone())?, *key));
        }
        for (at, len, key) in middle {
            items.push((new.get(from + at..from + at + len)?, key));
        }
        for (range, key) in &self.items[n - kept_back..] {
            items.push((new.get(shift(range.start)?..shift(range.end)?)?, *key));
        }
        Some(items)
    }
}

/// The items in `text`, the part of a List's items between kept ones, as (offset, length,
/// key) in `text`. `after`: an item precedes `text`, which then starts with its comma;
/// `before`: an item follows, and `text` ends with the comma before it. `None` when `text`
/// is not that (or an item nests deeper than the JSON parser allows).
///
/// `old` is what was between the same kept items before, each item as its length and key.
/// Where the next old item's text comes next (`is(text, key)`: that text has that key), it
/// is that item; else one item is parsed (and keyed with `key_of`), and the walk goes on
/// after the old item it equals, if any, or after the one it replaced. Two items changed
/// far apart in a List of 500 then cost two parses, not the parse of every item between.
fn items_between(
    text: &str,
    (after, before): (bool, bool),
    old: &[(usize, u64)],
    key_of: impl Fn(&str) -> u64,
    is: impl Fn(&str, u64) -> bool,
) -> Option<Vec<(usize, usize, u64)>> {
    let bytes = text.as_bytes();
    let skip_ws = |mut at: usize| {
        while at < bytes.len() && matches!(bytes[at], b' ' | b'\t' | b'\n' | b'\r') {
            at += 1;
        }
        at
    };
    // An item's text ends a value only if what follows cannot continue it (a number).
    let ends_value =
        |at: usize| at == bytes.len() || matches!(bytes[at], b' ' | b'\t' | b'\n' | b'\r' | b',');
    let mut found = Vec::new();
    let mut next_old = 0;
    let mut old_at: Option<HashMap<u64, usize, BuildHasherDefault<KeyHasher>>> = None;
    let (mut want_item, mut last_comma) = (!after, false);
    let mut at = 0;
    loop {
        at = skip_ws(at);
        if at == bytes.len() {
            break;
        }
        if !want_item {
            if bytes[at] != b',' {
                return None;
            }
            (at, want_item, last_comma) = (at + 1, true, true);
            continue;
        }
        if bytes[at] == b',' {
            return None;
        }
        let rest = &text[at..];
        let kept = old.get(next_old).filter(|&&(len, key)| {
            rest.get(..len)
                .is_some_and(|item| ends_value(at + len) && is(item, key))
        });
        let (len, key) = match kept {
            Some(&(len, key)) => {
                next_old += 1;
                (len, key)
            }
            None => {
                let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<&RawValue>();
                let item = stream.next()?.ok()?.get();
                if item.as_ptr() != rest.as_ptr() {
                    return None;
                }
                let key = key_of(item);
                let index = old_at.get_or_insert_with(|| {
                    (old.iter().enumerate())
                        .map(|(i, (_, key))| (*key, i))
                        .collect()
                });
                next_old = index.get(&key).map_or(next_old + 1, |i| i + 1);
                (item.len(), key)
            }
        };
        found.push((at, len, key));
        (at, want_item, last_comma) = (at + len, false, false);
    }
    // Ended after an item: no item may follow without a comma. Ended after a comma: an
    // item must follow. Ended where it began: nothing between two items needs a comma.
    let whole = match (want_item, last_comma) {
        (false, _) => !before,
        (true, true) => before,
        (true, false) => true,
    };
    whole.then_some(found)
}

/// The (apiVersion, kind) a List's items default to.
type ItemType<'a> = Option<(&'a str, &'a str)>;

/// [`ItemType`], kept.
type OwnedItemType = Option<(String, String)>;

/// A List's item: its text and its piece key.
type Item<'a> = (&'a str, u64);

/// The last read of the same file: its objects, in the order read, and its pieces.
#[derive(Clone, Copy)]
pub struct Previous<'a> {
    pub services: &'a [Arc<Service>],
    pub slices: &'a [Arc<Slice>],
    pub pieces: &'a Pieces,
}

/// The piece keys are already keyed hashes: the map uses them as they are instead of
/// hashing them again (SipHash per lookup was a tenth of a re-read).
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed here; anything else is folded in, not dropped.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, key: u64) {
        self.0 = key;
    }
}

fn hash(piece: impl std::hash::Hash) -> u64 {
    static KEYS: OnceLock<RandomState> = OnceLock::new();
    KEYS.get_or_init(RandomState::new).hash_one(piece)
}

/// `text` (the file at `path`) into `loaded`, as [`Loaded::load_text`] does.
pub(super) fn load_text(
    loaded: &mut Loaded,
    previous: Option<Previous>,
    path: &Path,
    mut text: String,
) -> Pieces {
    let node_ips = loaded.node_ips.clone();
    let mut reader = Reader {
        previous: previous.filter(|p| p.pieces.node_ips == node_ips),
        loaded,
        pieces: Pieces {
            made: HashMap::with_capacity_and_hasher(
                previous.map_or(0, |p| p.pieces.made.len()),
                BuildHasherDefault::default(),
            ),
            node_ips,
            list: None,
            #[cfg(test)]
            compared: false,
        },
    };
    if text.starts_with('\u{feff}') {
        text.drain(..'\u{feff}'.len_utf8());
    }
    let list = reader.previous.and_then(|p| p.pieces.list.as_ref());
    if let Some(list) = list
        && let Some(items) = list.items_of(&text)
    {
        let at = list_location(path, list.line);
        if reader.items(&at, list.item_type(), &items) {
            let items = ranges(&text, &items);
            #[cfg(test)]
            {
                reader.pieces.compared = true;
            }
            reader.pieces.list = Some(ListText::new(
                &text,
                list.line,
                list.item_type.clone(),
                items,
            ));
            return reader.pieces;
        }
    }
    let docs = split_documents(&text);
    let single = docs.len() == 1;
    for (index, (line, doc)) in docs.into_iter().enumerate() {
        let at = Location {
            path: path.to_owned(),
            document: index + 1,
            line,
            item: None,
        };
        if let Some((item_type, items)) = reader.json_list(&at, doc) {
            if single {
                let items = ranges(&text, &items);
                reader.pieces.list = Some(ListText::new(&text, line, item_type, items));
            }
            continue;
        }
        let key = hash(doc);
        if reader.reuse(key) {
            continue;
        }
        let start = reader.mark();
        reader.loaded.load_document(at, doc);
        reader.record(key, start);
    }
    reader.pieces
}

/// Each of `items` (slices of `text`) as its bytes in `text`, with its key.
fn ranges(text: &str, items: &[(&str, u64)]) -> Vec<(Range<usize>, u64)> {
    let base = text.as_ptr() as usize;
    (items.iter())
        .map(|(item, key)| {
            let at = item.as_ptr() as usize - base;
            (at..at + item.len(), *key)
        })
        .collect()
}

fn list_location(path: &Path, line: usize) -> Location {
    Location {
        path: path.to_owned(),
        document: 1,
        line,
        item: None,
    }
}

/// What the previous read made of the piece `key`, if it holds it.
type Held<'a> = (&'a [Arc<Service>], &'a [Arc<Slice>], usize);

fn held(previous: Option<Previous<'_>>, key: u64) -> Option<Held<'_>> {
    let prev = previous?;
    let made = prev.pieces.made.get(&key)?;
    Some((
        prev.services.get(made.services.clone())?,
        prev.slices.get(made.slices.clone())?,
        made.skipped,
    ))
}

struct Reader<'a> {
    loaded: &'a mut Loaded,
    previous: Option<Previous<'a>>,
    pieces: Pieces,
}

/// How far the lists were: services, slices, skipped, errors, ServiceCIDRs.
type Mark = (usize, usize, usize, usize, usize);

impl Reader<'_> {
    fn mark(&self) -> Mark {
        let l = &self.loaded;
        let cidrs = l.service_cidrs.len();
        (
            l.services.len(),
            l.slices.len(),
            l.skipped,
            l.errors.len(),
            cidrs,
        )
    }

    /// Adds what the previous read made of the piece `key`; false when it holds none.
    fn reuse(&mut self, key: u64) -> bool {
        let Some((services, slices, skipped)) = held(self.previous, key) else {
            return false;
        };
        let start = self.mark();
        self.loaded.services.extend_from_slice(services);
        self.loaded.slices.extend_from_slice(slices);
        self.loaded.skipped += skipped;
        self.record(key, start);
        true
    }

    /// Remembers what the piece `key` made since `start`, unless it had a problem or made
    /// a ServiceCIDR (a handful per cluster: converted again on every read instead).
    fn record(&mut self, key: u64, start: Mark) {
        let now = self.mark();
        if now.3 == start.3 && now.4 == start.4 {
            let made = Made {
                services: start.0..now.0,
                slices: start.1..now.1,
                skipped: now.2 - start.2,
            };
            self.pieces.made.insert(key, made);
        }
    }

    /// `doc` as a JSON List, item by item: its item type and items, each as its text and
    /// key. `None` (nothing done) when it is not one, or an item is not JSON the value
    /// parser takes (too deep): it is then read as any document, whose reader reports
    /// what is wrong.
    fn json_list<'d>(
        &mut self,
        at: &Location,
        doc: &'d str,
    ) -> Option<(OwnedItemType, Vec<Item<'d>>)> {
        #[derive(serde::Deserialize)]
        struct RawList<'a> {
            #[serde(rename = "apiVersion")]
            api_version: String,
            kind: String,
            #[serde(borrow)]
            items: Option<Vec<&'a RawValue>>,
        }
        if !doc.trim_start().starts_with('{') {
            return None;
        }
        let RawList {
            api_version,
            kind,
            items: Some(items),
        } = serde_json::from_str::<RawList>(doc).ok()?
        else {
            return None;
        };
        if api_version.is_empty() || !kind.ends_with("List") {
            return None;
        }
        // ServiceList items default to v1 Service, as in Loaded::load_list; the same text
        // in another kind of List is another piece.
        let item_type = kind
            .strip_suffix("List")
            .filter(|k| !k.is_empty())
            .map(|k| (api_version.clone(), k.to_owned()));
        let typed = item_type.as_ref().map(|(a, k)| (a.as_str(), k.as_str()));
        let items: Vec<(&str, u64)> = (items.iter())
            .map(|item| (item.get(), hash((typed, item.get()))))
            .collect();
        self.items(at, typed, &items).then_some((item_type, items))
    }

    /// A List's items into the lists, reusing what the previous read made of each; false
    /// (nothing done) when an item to convert is not JSON the value parser takes.
    fn items(&mut self, at: &Location, item_type: ItemType, items: &[(&str, u64)]) -> bool {
        // Parsed first, so that a refused item leaves nothing half done.
        let mut parsed = Vec::with_capacity(items.len());
        for &(item, key) in items {
            let value = match held(self.previous, key) {
                Some(_) => None,
                None => match serde_json::from_str::<Value>(item) {
                    Ok(value) => Some(value),
                    Err(_) => return false,
                },
            };
            parsed.push((key, value));
        }
        for (i, (key, value)) in parsed.into_iter().enumerate() {
            match value {
                None => {
                    self.reuse(key);
                }
                Some(value) => {
                    let start = self.mark();
                    let at = Location {
                        item: Some(i),
                        ..at.clone()
                    };
                    self.loaded.load_value(at, value, item_type);
                    self.record(key, start);
                }
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::{super::testdata::*, *};

    fn slice_json(service: &str, ip: &str) -> String {
        format!(
            r#"{{"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {{"name": "{service}-1", "namespace": "shop",
                    "labels": {{"kubernetes.io/service-name": "{service}"}}}},
                "addressType": "IPv4", "endpoints": [{{"addresses": ["{ip}"]}}]}}"#
        )
    }

    fn list(items: &[String]) -> String {
        format!(
            r#"{{"apiVersion": "v1", "kind": "List", "items": [{}]}}"#,
            items.join(",")
        )
    }

    fn read(path: &Path, previous: Option<&(Loaded, Pieces)>) -> (Loaded, Pieces) {
        let previous = previous.map(|(l, p)| Previous {
            services: &l.services,
            slices: &l.slices,
            pieces: p,
        });
        super::super::load_file(path, &[], previous)
    }

    fn ips(loaded: &Loaded) -> Vec<String> {
        let slices = loaded.slices.iter();
        slices.map(|s| s.2.endpoints[0].ip.to_string()).collect()
    }

    #[test]
    fn a_reread_converts_only_changed_items_and_documents() {
        let dir = TempDir::new();
        let items = |b: &str| {
            list(&[
                slice_json("a", "198.18.1.1"),
                slice_json("b", b),
                "{\"kind\": \"Service\"}".to_owned(),
            ])
        };
        let path = dir.write("s.json", &items("198.18.1.2"));
        let first = read(&path, None);
        assert_eq!(ips(&first.0), ["198.18.1.1", "198.18.1.2"]);
        assert_eq!(first.0.errors.len(), 1, "the item without apiVersion");
        assert_eq!(first.1.made.len(), 2, "the item in error is not remembered");

        dir.write("s.json", &items("198.18.1.3"));
        let second = read(&path, Some(&first));
        assert_eq!(ips(&second.0), ["198.18.1.1", "198.18.1.3"]);
        // The problem is reported again, with its place.
        let err = second.0.errors[0].to_string();
        assert!(err.contains("items[2]"), "{err}");

        // What is reused is what the previous read made, not what the text now says: a
        // stale previous read shows it.
        let (mut stale, pieces) = read(&path, None);
        Arc::make_mut(&mut stale.slices[0]).2.endpoints[0].ip = "198.18.9.9".parse().unwrap();
        let third = read(&path, Some(&(stale, pieces)));
        assert_eq!(ips(&third.0), ["198.18.9.9", "198.18.1.3"]);

        // A YAML file is reused document by document.
        let yaml = dir.write(
            "y.yaml",
            &[
                service_yaml("web", "198.19.96.1"),
                slice_yaml("web", "w", "198.18.2.1"),
            ]
            .join("---\n"),
        );
        let (mut stale, pieces) = read(&yaml, None);
        Arc::make_mut(&mut stale.services[0]).cluster_ips[0] = "198.19.96.9".parse().unwrap();
        dir.write(
            "y.yaml",
            &[
                service_yaml("web", "198.19.96.1"),
                slice_yaml("web", "w", "198.18.2.2"),
            ]
            .join("---\n"),
        );
        let again = read(&yaml, Some(&(stale, pieces)));
        assert_eq!(
            again.0.services[0].cluster_ips[0].to_string(),
            "198.19.96.9"
        );
        assert_eq!(ips(&again.0), ["198.18.2.2"]);
    }

    #[test]
    fn other_node_addresses_reuse_nothing() {
        let dir = TempDir::new();
        let path = dir.write("s.yaml", &service_yaml("web", "198.18.0.5"));
        let first = read(&path, None);
        assert_eq!(first.0.services.len(), 1);
        let previous = Previous {
            services: &first.0.services,
            slices: &first.0.slices,
            pieces: &first.1,
        };
        let node: IpAddr = "198.18.0.5".parse().unwrap();
        let (second, _) = super::super::load_file(&path, &[node], Some(previous));
        assert!(second.services.is_empty());
        assert_eq!(second.errors.len(), 1);
    }

    /// An item too deep for the value parser leaves the whole document to the reader that
    /// reports it, as before.
    #[test]
    fn a_list_with_a_refused_item_is_read_as_a_document() {
        let dir = TempDir::new();
        let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
        let path = dir.write("d.json", &list(&[slice_json("a", "198.18.1.1"), deep]));
        let (loaded, pieces) = read(&path, None);
        assert!(loaded.slices.is_empty());
        assert_eq!(loaded.errors.len(), 1, "{:?}", loaded.errors);
        assert!(pieces.made.is_empty());
    }

    fn service_json(name: &str, ip: &str) -> String {
        format!(
            r#"{{"apiVersion": "v1", "kind": "Service",
                "metadata": {{"name": "{name}", "namespace": "shop"}},
                "spec": {{"clusterIP": "{ip}", "ports": [{{"name": "http", "port": 80}}]}}}}"#
        )
    }

    /// What a read gave, as a user would see it: every object and every problem.
    fn seen(loaded: &Loaded) -> Vec<String> {
        let services = loaded.services.iter().map(|s| format!("{s:?}"));
        let slices = loaded.slices.iter().map(|s| format!("{s:?}"));
        let errors = loaded.errors.iter().map(|e| e.to_string());
        (services.chain(slices).chain(errors))
            .chain([format!("skipped {}", loaded.skipped)])
            .collect()
    }

    /// Reads `text` after `previous`, checks that it gives what a first read gives, and
    /// returns it for the next.
    fn reread(dir: &TempDir, text: &str, previous: &(Loaded, Pieces)) -> (Loaded, Pieces) {
        let path = dir.write("l.json", text);
        let again = read(&path, Some(previous));
        let fresh = read(&path, None);
        assert_eq!(seen(&again.0), seen(&fresh.0), "after writing {text}");
        again
    }

    /// A List written again with items changed, added, removed, moved, broken and mended,
    /// and its own text changed: each read after the one before gives what a first read
    /// gives, whether the read compared texts or read the file anew.
    #[test]
    fn a_list_rewritten_reads_as_if_read_first() {
        let dir = TempDir::new();
        let item = |i: usize, v: usize| match i % 3 {
            0 => service_json(&format!("s{i}"), &format!("198.19.{}.{}", i, v % 250)),
            _ => slice_json(&format!("s{i}"), &format!("198.18.{}.{}", i, v % 250)),
        };
        let mut items: Vec<String> = (0..12).map(|i| item(i, 0)).collect();
        let mut prev = read(&dir.write("l.json", &list(&items)), None);
        let mut compared = 0;
        // A fixed walk of edits (a small linear congruential sequence), bounded.
        let mut seed: u64 = 7;
        for step in 0..300 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let r = (seed >> 33) as usize;
            let (at, len) = (r % (items.len() + 1), items.len());
            match (r / 7) % 9 {
                0 if len > 0 => items[at.min(len - 1)] = item(at, step),
                // Two items far apart, as two writers' changes between two reads.
                1 if len > 0 => {
                    items[at.min(len - 1)] = item(at, step);
                    let other = (at + len / 2) % len;
                    items[other] = item(other, step + 1);
                }
                2 => items.insert(at, item(at + 40, step)),
                3 if !items.is_empty() => {
                    items.remove(at.min(items.len() - 1));
                }
                4 if len > 1 => items.swap(0, len - 1),
                // A problem the API server would refuse: reported on every read.
                5 => items.insert(at, slice_json("bad", "127.0.0.1")),
                // Not JSON: the whole document falls to the YAML reader's message.
                6 if step % 4 == 0 => items.insert(at, "{\"kind\": ".to_owned()),
                7 => items.retain(|i| !i.starts_with("{\"kind\": ")),
                _ => items.iter_mut().for_each(|i| *i = i.replace(", ", ",\n  ")),
            }
            let text = match step % 10 {
                // The List's own text changed: kind, then a field after the items.
                0 => list(&items).replace("\"kind\": \"List\"", "\"kind\": \"ServiceList\""),
                5 => format!("{}\n", list(&items).trim_end_matches('}')) + ", \"metadata\": {}}",
                _ => list(&items),
            };
            prev = reread(&dir, &text, &prev);
            compared += usize::from(prev.1.compared);
        }
        // Most edits touch only items; the List's own text changes every few steps.
        assert!((100..280).contains(&compared), "{compared} of 300 compared");
        // Emptied, then filled again.
        prev = reread(&dir, &list(&[]), &prev);
        reread(&dir, &list(&[item(1, 1), item(2, 2)]), &prev);
    }

    /// The unchanged items of a List written again come from the last read, not from
    /// parsing them again; the List's own text changed, every item is read anew.
    #[test]
    fn a_list_rewritten_parses_only_the_changed_items() {
        let dir = TempDir::new();
        let ips_of = |n: &str| {
            (1..=4)
                .map(|i| {
                    slice_json(&format!("s{i}"), &format!("198.18.0.{i}")).replace("198.18.0.3", n)
                })
                .collect::<Vec<_>>()
        };
        let path = dir.write("l.json", &list(&ips_of("198.18.0.3")));
        let (mut stale, pieces) = read(&path, None);
        assert!(
            pieces.list.is_some(),
            "a file of one List is kept as a List"
        );
        for i in [0, 3] {
            Arc::make_mut(&mut stale.slices[i]).2.endpoints[0].ip = "198.18.9.9".parse().unwrap();
        }
        dir.write("l.json", &list(&ips_of("198.18.0.33")));
        let again = read(&path, Some(&(stale, pieces)));
        assert_eq!(
            ips(&again.0),
            ["198.18.9.9", "198.18.0.2", "198.18.0.33", "198.18.9.9"]
        );

        // The kind changed: the items are other pieces now, read from the text.
        let (mut stale, pieces) = again;
        Arc::make_mut(&mut stale.slices[0]).2.endpoints[0].ip = "198.18.9.9".parse().unwrap();
        let relisted = list(&ips_of("198.18.0.33")).replace("\"List\"", "\"EndpointSliceList\"");
        dir.write("l.json", &relisted);
        let third = read(&path, Some(&(stale, pieces)));
        assert_eq!(
            ips(&third.0),
            ["198.18.0.1", "198.18.0.2", "198.18.0.33", "198.18.0.4"]
        );

        // A YAML file, or a file of two documents, is not kept as a List.
        let two = format!(
            "{}\n---\n{}",
            list(&ips_of("1.1.1.1")),
            service_yaml("web", "198.19.0.1")
        );
        assert!(read(&dir.write("two.yaml", &two), None).1.list.is_none());
    }

    #[test]
    fn items_between_kept_items() {
        fn got(t: &str, after: bool, before: bool) -> Option<Vec<&str>> {
            let found = items_between(t, (after, before), &[], |_| 0, |_, _| false)?;
            Some(found.iter().map(|&(at, n, _)| &t[at..at + n]).collect())
        }
        assert_eq!(got(" , ", true, true), Some(vec![]));
        assert_eq!(got("", true, true), None, "two items need a comma");
        assert_eq!(got(" , , ", true, true), None);
        assert_eq!(
            got("", false, true),
            Some(vec![]),
            "no item before the kept one"
        );
        assert_eq!(
            got(",", false, true),
            None,
            "a comma with no item before it"
        );
        assert_eq!(got("", true, false), Some(vec![]));
        assert_eq!(
            got(",{\"a\": 1}, [2] ,", true, true),
            Some(vec!["{\"a\": 1}", "[2]"])
        );
        assert_eq!(got("{\"a\": 1}", false, false), Some(vec!["{\"a\": 1}"]));
        assert_eq!(got(",{\"a\": 1},", true, false), None, "a trailing comma");
        assert_eq!(got("]}, {\"x\": [", true, true), None);
        assert_eq!(got("12 3", false, false), None, "two values need a comma");
    }

    /// Between kept items, the old items found in place are taken by their keys:
    /// only the changed, added or moved ones are parsed, and each item has its key.
    #[test]
    fn items_between_parses_only_what_is_not_the_next_old_item() {
        let old = [
            ("{\"a\": 1}", 1),
            ("[2]", 2),
            ("3", 3),
            ("\"x\"", 4),
            ("{}", 5),
        ];
        let walk = |t: &str| {
            let parsed = std::cell::RefCell::new(Vec::new());
            let lengths: Vec<(usize, u64)> = old.iter().map(|(t, key)| (t.len(), *key)).collect();
            let found = items_between(
                t,
                (true, true),
                &lengths,
                |item| {
                    parsed.borrow_mut().push(item.to_owned());
                    // Keys are of the text, as the real ones.
                    let same = old.iter().find(|(text, _)| *text == item);
                    same.map_or(100 + item.len() as u64, |(_, key)| *key)
                },
                |item, key| old.iter().any(|&(text, k)| k == key && text == item),
            );
            let found = found.map(|f| {
                (f.iter())
                    .map(|&(at, n, key)| format!("{} {key}", &t[at..at + n]))
                    .collect::<Vec<_>>()
            });
            (found, parsed.into_inner())
        };
        // Nothing changed: no parse.
        let (found, parsed) = walk(",{\"a\": 1},[2],3,\"x\",{},");
        assert_eq!(
            found.unwrap(),
            ["{\"a\": 1} 1", "[2] 2", "3 3", "\"x\" 4", "{} 5"]
        );
        assert!(parsed.is_empty());
        // The first and the fourth changed, far apart: two parses.
        let (found, parsed) = walk(",{\"a\": 9},[2],3,\"yy\",{},");
        assert_eq!(
            found.unwrap(),
            ["{\"a\": 9} 108", "[2] 2", "3 3", "\"yy\" 104", "{} 5"]
        );
        assert_eq!(parsed, ["{\"a\": 9}", "\"yy\""]);
        // One removed: the next item is parsed, found to be an old one, and the walk
        // goes on after it.
        let (found, parsed) = walk(", [2] ,3,\"x\",{},");
        assert_eq!(found.unwrap().len(), 4);
        assert_eq!(parsed, ["[2]"]);
        // One added: parsed and taken for a replacement of the next old item, so that
        // one is parsed too and found to be old; the rest follow in place.
        let (found, parsed) = walk(",{\"a\": 1},[7],[2],3,\"x\",{},");
        assert_eq!(found.unwrap().len(), 6);
        assert_eq!(parsed, ["[7]", "[2]"]);
        // A number that only starts like the old one is another number.
        let (found, parsed) = walk(",{\"a\": 1},[2],34,\"x\",{},");
        assert_eq!(found.unwrap()[2], "34 102");
        assert_eq!(parsed, ["34"]);
        // Not items: refused, as when everything was parsed.
        assert!(walk(",{\"a\": 1}[2],3,\"x\",{},").0.is_none());
        assert!(walk(",{\"a\": 1},,[2],").0.is_none());
        assert!(walk(",{\"a\": 1},{\"b\":").0.is_none());
    }
}
