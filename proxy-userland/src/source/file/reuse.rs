//! A changed file is read again in full, but only the pieces of its text that changed (a
//! document, or an item of a JSON List) are converted: decoding, checking and converting a
//! file of 500 EndpointSlices took ~40 ms, for the one slice that changed.
//!
//! Each piece is known by a hash of its text (keyed per process, so no file can be made to
//! collide on purpose). A piece that had a problem is not remembered: it is converted, and
//! its problem reported, on every read, as before.

use std::{
    collections::HashMap,
    hash::{BuildHasher, RandomState},
    net::IpAddr,
    ops::Range,
    path::Path,
    sync::OnceLock,
};

use serde_json::{Value, value::RawValue};

use super::{Loaded, Location, split_documents};
use crate::model::{Service, ServiceKey, SliceInfo};

/// What one read of a file made of each piece of its text, by the text's hash: the
/// positions of its objects in that read's lists.
#[derive(Debug, Default)]
pub struct Pieces {
    made: HashMap<u64, Made>,
    /// Checking depends on the node's addresses: another set, and nothing is reused.
    node_ips: Vec<IpAddr>,
}

#[derive(Clone, Debug)]
struct Made {
    services: Range<usize>,
    slices: Range<usize>,
    skipped: usize,
}

type Slice = (ServiceKey, String, SliceInfo);

/// The last read of the same file: its objects, in the order read, and its pieces.
#[derive(Clone, Copy)]
pub struct Previous<'a> {
    pub services: &'a [Service],
    pub slices: &'a [Slice],
    pub pieces: &'a Pieces,
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
    text: &str,
) -> Pieces {
    let node_ips = loaded.node_ips.clone();
    let mut reader = Reader {
        previous: previous.filter(|p| p.pieces.node_ips == node_ips),
        loaded,
        pieces: Pieces {
            made: HashMap::new(),
            node_ips,
        },
    };
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    for (index, (line, doc)) in split_documents(text).into_iter().enumerate() {
        let at = Location {
            path: path.to_owned(),
            document: index + 1,
            line,
            item: None,
        };
        if reader.json_list(&at, doc) {
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

/// What the previous read made of the piece `key`, if it holds it.
fn held(previous: Option<Previous<'_>>, key: u64) -> Option<(&[Service], &[Slice], usize)> {
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

/// How far the lists were: services, slices, skipped, errors.
type Mark = (usize, usize, usize, usize);

impl Reader<'_> {
    fn mark(&self) -> Mark {
        let l = &self.loaded;
        (l.services.len(), l.slices.len(), l.skipped, l.errors.len())
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

    /// Remembers what the piece `key` made since `start`, unless it had a problem.
    fn record(&mut self, key: u64, start: Mark) {
        let now = self.mark();
        if now.3 == start.3 {
            let made = Made {
                services: start.0..now.0,
                slices: start.1..now.1,
                skipped: now.2 - start.2,
            };
            self.pieces.made.insert(key, made);
        }
    }

    /// `doc` as a JSON List, item by item; false (nothing done) when it is not one, or an
    /// item is not JSON the value parser takes (too deep): it is then read as any document,
    /// whose reader reports what is wrong.
    fn json_list(&mut self, at: &Location, doc: &str) -> bool {
        #[derive(serde::Deserialize)]
        struct RawList<'a> {
            #[serde(rename = "apiVersion")]
            api_version: String,
            kind: String,
            #[serde(borrow)]
            items: Option<Vec<&'a RawValue>>,
        }
        if !doc.trim_start().starts_with('{') {
            return false;
        }
        let Ok(RawList {
            api_version,
            kind,
            items: Some(items),
        }) = serde_json::from_str::<RawList>(doc)
        else {
            return false;
        };
        if api_version.is_empty() || !kind.ends_with("List") {
            return false;
        }
        // ServiceList items default to v1 Service, as in Loaded::load_list; the same text
        // in another kind of List is another piece.
        let item_type = kind
            .strip_suffix("List")
            .filter(|k| !k.is_empty())
            .map(|k| (api_version.as_str(), k));
        // Parsed first, so that a refused item leaves nothing half done.
        let mut parsed = Vec::with_capacity(items.len());
        for item in &items {
            let key = hash((item_type, item.get()));
            let value = match held(self.previous, key) {
                Some(_) => None,
                None => match serde_json::from_str::<Value>(item.get()) {
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
        slices
            .map(|(_, _, s)| s.endpoints[0].ip.to_string())
            .collect()
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
        stale.slices[0].2.endpoints[0].ip = "198.18.9.9".parse().unwrap();
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
        stale.services[0].cluster_ips[0] = "198.19.96.9".parse().unwrap();
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
}
