//! Services and EndpointSlices read from manifest files, so that the proxy runs (and can be
//! tested) without a cluster.
//!
//! The path is one file or a folder of `*.yaml`, `*.yml` and `*.json` files (not recursive;
//! dot files, such as editor swap files, are left out). Files hold what `kubectl apply -f`
//! takes: multi-document YAML, JSON, and `List` objects with `items`. Only v1 Service,
//! discovery.k8s.io/v1 EndpointSlice and networking.k8s.io/v1 ServiceCIDR are read; other
//! kinds are ignored, so a folder of ordinary application manifests works as is.
//!
//! Every Service and EndpointSlice is checked as the API server would check it
//! ([`crate::model::validate`]): a manifest cannot do what a cluster would refuse, such as a
//! cluster IP of 127.0.0.1 or of the node's own address. YAML is read with depth, size and
//! event budgets, so a hostile file (100,000 nested `[`) is refused in microseconds.
//!
//! Errors are per object: one malformed document is reported and the others still load.
//! Refusing the whole file would take every service in it down because of one typo, and
//! with a watched folder a half-saved file would do the same until the next save.

use std::{
    fmt, fs,
    io::{self, Read},
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

use k8s_openapi::api::{
    core::v1::Service as K8sService, discovery::v1::EndpointSlice, networking::v1::ServiceCIDR,
};
use serde_json::Value;
use tracing::debug;

use crate::model::{
    Cidr, Service, ServiceKey, SliceInfo,
    convert::{self, ConvertError},
    service_cidr, validate,
};

mod reuse;

pub use reuse::{Pieces, Previous};

/// A manifest file larger than this is refused unread (10,000 services are about 3 MiB).
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// An EndpointSlice as read: the service it feeds, its name, what it holds.
pub type Slice = (ServiceKey, String, SliceInfo);

/// Everything read from the path in one go. Objects are shared: a file read again reuses
/// what its unchanged pieces made last time instead of copying them (a copy of 500
/// EndpointSlices cost ~0.3 ms for each changed slice).
#[derive(Debug, Default)]
pub struct Loaded {
    pub services: Vec<Arc<Service>>,
    pub slices: Vec<Arc<Slice>>,
    /// ServiceCIDR objects: (name, ranges). Few, and converted on every read.
    pub service_cidrs: Vec<(String, Vec<Cidr>)>,
    /// Problems found, each naming where; the objects listed above loaded regardless.
    pub errors: Vec<LoadError>,
    /// Services and EndpointSlices that are well formed but not proxied (headless,
    /// ExternalName, another proxy's, FQDN slices, slices without a service).
    pub skipped: usize,
    /// The node's addresses, refused as cluster IPs.
    node_ips: Vec<IpAddr>,
}

/// Where in the input a problem is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub path: PathBuf,
    /// 1-based position of the YAML document in the file.
    pub document: usize,
    /// 1-based line at which the document starts.
    pub line: usize,
    /// 0-based index in `items` when the document is a List.
    pub item: Option<usize>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: document {} (line {})",
            self.path.display(),
            self.document,
            self.line
        )?;
        if let Some(item) = self.item {
            write!(f, ", items[{item}]")?;
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file or folder could not be read (missing, permissions, not UTF-8).
    #[error("{}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },

    /// The document is not valid YAML (or JSON), or exceeds the reader's limits (nesting
    /// depth, node count).
    #[error("{at}: invalid YAML: {source}")]
    Syntax {
        at: Location,
        source: serde_saphyr::Error,
    },

    /// The document is YAML but not a Kubernetes object.
    #[error("{at}: not a Kubernetes object: {reason}")]
    NotAnObject { at: Location, reason: &'static str },

    /// A Service or EndpointSlice whose fields do not have the right types.
    #[error("{at}: {object}: {message}")]
    Decode {
        at: Location,
        object: String,
        message: String,
    },

    /// A Service or EndpointSlice whose values are invalid (out of range, not an IP, ...).
    #[error("{at}: {source}")]
    Convert { at: Location, source: ConvertError },
}

impl LoadError {
    /// The file (or folder) the problem is in.
    pub fn path(&self) -> &Path {
        match self {
            Self::Read { path, .. } => path,
            Self::Syntax { at, .. }
            | Self::NotAnObject { at, .. }
            | Self::Decode { at, .. }
            | Self::Convert { at, .. } => &at.path,
        }
    }
}

/// Reads `path` (a manifest file or a folder of them). Never fails as a whole: problems are
/// collected in [`Loaded::errors`] next to whatever did load.
pub fn load(path: &Path) -> Loaded {
    load_for_node(path, &node_addresses())
}

/// [`load`], refusing `node_ips` as cluster IPs.
pub fn load_for_node(path: &Path, node_ips: &[IpAddr]) -> Loaded {
    let mut loaded = Loaded {
        node_ips: node_ips.to_vec(),
        ..Loaded::default()
    };
    let files = if path.is_dir() {
        match manifest_files(path) {
            Ok(files) => files.into_iter().map(|(f, _)| f).collect(),
            Err(source) => {
                loaded.errors.push(LoadError::Read {
                    path: path.to_owned(),
                    source,
                });
                return loaded;
            }
        }
    } else {
        vec![path.to_owned()]
    };
    for file in files {
        match read_bounded(&file) {
            Ok(text) => loaded.load_text(&file, &text),
            Err(source) => loaded.errors.push(LoadError::Read { path: file, source }),
        }
    }
    loaded
}

/// One manifest file (or, as [`load_for_node`], a folder), converting only the pieces of
/// text that `previous`, the last read of the same file, did not hold. Returns with what
/// was read what this read made of each piece, for the next.
pub fn load_file(path: &Path, node_ips: &[IpAddr], previous: Option<Previous>) -> (Loaded, Pieces) {
    if path.is_dir() {
        return (load_for_node(path, node_ips), Pieces::default());
    }
    match read_bounded(path) {
        Ok(text) => load_file_text(path, text, node_ips, previous),
        Err(source) => {
            let mut loaded = Loaded {
                node_ips: node_ips.to_vec(),
                ..Loaded::default()
            };
            loaded.errors.push(LoadError::Read {
                path: path.to_owned(),
                source,
            });
            (loaded, Pieces::default())
        }
    }
}

/// [`load_file`] on a file's text already read (`path` only names it in errors): the
/// entry point the fuzz targets share with the daemon.
pub fn load_file_text(
    path: &Path,
    text: String,
    node_ips: &[IpAddr],
    previous: Option<Previous>,
) -> (Loaded, Pieces) {
    let mut loaded = Loaded {
        node_ips: node_ips.to_vec(),
        ..Loaded::default()
    };
    let pieces = reuse::load_text(&mut loaded, previous, path, text);
    (loaded, pieces)
}

/// Reads a file of at most [`MAX_FILE_BYTES`].
fn read_bounded(path: &Path) -> io::Result<String> {
    let file = fs::File::open(path)?;
    // Sized up front: through `take`, read_to_string cannot see the size and grows the
    // string step by step, copying a 600 KB file several times.
    let len = file.metadata().map_or(0, |m| m.len().min(MAX_FILE_BYTES));
    let mut text = String::with_capacity(usize::try_from(len).unwrap_or(0) + 1);
    file.take(MAX_FILE_BYTES + 1).read_to_string(&mut text)?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!("larger than {MAX_FILE_BYTES} bytes; not read"),
        ));
    }
    Ok(text)
}

/// The reader's limits for one manifest document. Kubernetes objects nest about ten deep;
/// the node and event budgets leave room for a List of 10,000 Services.
fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_depth: 64,
            flow_nesting_limit: 64,
            max_nodes: 5_000_000,
            max_events: 10_000_000,
            max_documents: 1,
        },
        with_snippet: false,
    }
}

/// This node's interface addresses (every family, every interface), which no cluster IP
/// may be. An error reads as "none": validation then only misses that one rule.
pub fn node_addresses() -> Vec<IpAddr> {
    let mut addrs = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below, once.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return addrs;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr is non-null and points at a sockaddr whose sa_family says
            // which sockaddr_* it is; we read only that type.
            unsafe {
                match i32::from((*ifa.ifa_addr).sa_family) {
                    libc::AF_INET => {
                        let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                        addrs.push(IpAddr::from(
                            u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
                        ));
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                        addrs.push(IpAddr::from(sin6.sin6_addr.s6_addr));
                    }
                    _ => {}
                }
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: `head` came from getifaddrs and is freed once; nothing borrows it any more.
    unsafe { libc::freeifaddrs(head) };
    addrs
}

/// Whether a file of this name is read as a manifest: `*.yaml`, `*.yml` or `*.json`, not
/// a dot file (editors' swap files).
pub(super) fn is_manifest_name(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    let extension = Path::new(name).extension().and_then(|e| e.to_str());
    !name.starts_with('.')
        && extension.is_some_and(|e| {
            ["yaml", "yml", "json"]
                .iter()
                .any(|m| e.eq_ignore_ascii_case(m))
        })
}

/// The manifests in `dir`, sorted so that later files override earlier ones predictably.
pub(super) fn manifest_files(dir: &Path) -> io::Result<Vec<(PathBuf, fs::Metadata)>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if !is_manifest_name(&path) {
            continue;
        }
        // Followed, as ConfigMap volumes present their keys as symlinks; one stat, which
        // the poll's fingerprint reuses (a folder may hold a file per object).
        if let Ok(meta) = fs::metadata(&path)
            && meta.is_file()
        {
            files.push((path, meta));
        }
    }
    // By bytes: for names in one folder that is Path's order, without its walk over the
    // components of each path (most of the sort's time for thousands of files).
    files.sort_by(|a, b| a.0.as_os_str().cmp(b.0.as_os_str()));
    Ok(files)
}

/// One document as a value. JSON (what `kubectl get -o json` writes, and how big generated
/// folders come) goes through serde_json first: the YAML reader took ~3 s for 10,000
/// services of JSON, and a change to one file waited for all of them. JSON that serde_json
/// refuses (or nests deeper than its 128 levels) falls back to the YAML reader, whose
/// message and limits then apply as for any document.
fn parse_document(doc: &str) -> Result<Value, serde_saphyr::Error> {
    let head = doc.trim_start();
    if (head.starts_with('{') || head.starts_with('['))
        && let Ok(value) = serde_json::from_str(doc)
    {
        return Ok(value);
    }
    serde_saphyr::from_str_with_options(doc, yaml_options())
}

/// Splits a multi-document YAML text into (first line, text) per document.
///
/// A multi-document iterator cannot be used for this: after a syntax error one
/// yields the same error forever and never reaches the next document, which would turn one
/// typo into a lost file. A line starting with `---` is always a document marker (YAML
/// forbids that line inside a scalar), so cutting there is exact. A leading chunk with no
/// content (comments before the first `---`) is not a document.
fn split_documents(text: &str) -> Vec<(usize, &str)> {
    let mut docs = Vec::new();
    let (mut start, mut start_line, mut offset) = (0, 1, 0);
    for (i, line) in text.split_inclusive('\n').enumerate() {
        let is_marker = line
            .strip_prefix("---")
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r', '\n']));
        if is_marker && offset > 0 {
            docs.push((start_line, &text[start..offset]));
            (start, start_line) = (offset, i + 1);
        }
        offset += line.len();
    }
    docs.push((start_line, &text[start..]));
    if docs.len() > 1 && !has_content(docs[0].1) {
        docs.remove(0);
    }
    docs
}

fn has_content(text: &str) -> bool {
    text.lines()
        .map(str::trim_start)
        .any(|l| !l.is_empty() && !l.starts_with('#'))
}

/// Pads `text` so that the YAML reader's "line N" counts from the start of the file. Only
/// done to re-parse for an error message, which keeps the common path linear.
fn at_file_line(line: usize, text: &str) -> String {
    let mut padded = "\n".repeat(line - 1);
    padded.push_str(text);
    padded
}

/// `Kind namespace/name`, as far as the document says, for error messages.
fn describe(kind: &str, value: &Value) -> String {
    let meta = value.get("metadata");
    let field = |k| {
        meta.and_then(|m| m.get(k))
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    };
    format!(
        "{kind} {}/{}",
        field("namespace").unwrap_or("default"),
        field("name").unwrap_or("<unnamed>")
    )
}

/// Decodes with the field path in the error (`spec.ports[0].port: invalid type ...`).
fn decode_value<T: serde::de::DeserializeOwned>(value: &Value) -> Result<T, String> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        match path.as_str() {
            "" | "." => e.into_inner().to_string(),
            _ => format!("{path}: {}", e.into_inner()),
        }
    })
}

impl Loaded {
    fn load_text(&mut self, path: &Path, text: &str) {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        // JSON is YAML, but a JSON file is one document; no line of it can start with
        // `---`, so the split is harmless.
        for (index, (line, doc)) in split_documents(text).into_iter().enumerate() {
            let at = Location {
                path: path.to_owned(),
                document: index + 1,
                line,
                item: None,
            };
            self.load_document(at, doc);
        }
    }

    fn load_document(&mut self, at: Location, doc: &str) {
        let value: Value = match parse_document(doc) {
            Ok(value) => value,
            Err(e) => {
                let source = serde_saphyr::from_str_with_options::<Value>(
                    &at_file_line(at.line, doc),
                    yaml_options(),
                )
                .err()
                .unwrap_or(e);
                self.errors.push(LoadError::Syntax { at, source });
                return;
            }
        };
        self.load_value(at, value, None);
    }

    /// Loads one object. `list` is the (apiVersion, kind) of the typed List (ServiceList)
    /// the value is an item of, since the API server leaves those out of the items.
    fn load_value(&mut self, at: Location, value: Value, list: Option<(&str, &str)>) {
        if value.is_null() {
            return; // an empty document, e.g. after a trailing `---`
        }
        if !value.is_object() {
            self.errors.push(LoadError::NotAnObject {
                at,
                reason: "not a mapping",
            });
            return;
        }
        let str_field = |k| {
            value
                .get(k)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
        };
        let (Some(api_version), Some(kind)) = (
            str_field("apiVersion").or(list.map(|l| l.0)),
            str_field("kind").or(list.map(|l| l.1)),
        ) else {
            self.errors.push(LoadError::NotAnObject {
                at,
                reason: "apiVersion or kind is missing",
            });
            return;
        };
        let (api_version, kind) = (api_version.to_owned(), kind.to_owned());

        if kind == "List" || (kind.ends_with("List") && value.get("items").is_some()) {
            self.load_list(at, &api_version, &kind, value);
            return;
        }
        match (api_version.as_str(), kind.as_str()) {
            ("v1", "Service") => {
                let Some(svc) = self.decode::<K8sService>(&at, "Service", &value) else {
                    return;
                };
                if let Err(source) = validate::service(&svc, &self.node_ips) {
                    self.errors.push(LoadError::Convert { at, source });
                    return;
                }
                match convert::service(&svc, None) {
                    Ok(Some(svc)) => self.services.push(Arc::new(svc)),
                    Ok(None) => self.skipped += 1,
                    Err(source) => self.errors.push(LoadError::Convert { at, source }),
                }
            }
            ("discovery.k8s.io/v1", "EndpointSlice") => {
                let Some(slice) = self.decode::<EndpointSlice>(&at, "EndpointSlice", &value) else {
                    return;
                };
                if let Err(source) = validate::endpoint_slice(&slice) {
                    self.errors.push(LoadError::Convert { at, source });
                    return;
                }
                match convert::endpoint_slice(&slice) {
                    Ok(Some(slice)) => self.slices.push(Arc::new(slice)),
                    Ok(None) => self.skipped += 1,
                    Err(source) => self.errors.push(LoadError::Convert { at, source }),
                }
            }
            ("networking.k8s.io/v1", "ServiceCIDR") => {
                let Some(obj) = self.decode::<ServiceCIDR>(&at, "ServiceCIDR", &value) else {
                    return;
                };
                match service_cidr::service_cidr(&obj) {
                    Ok(c) => self.service_cidrs.push(c),
                    Err(source) => self.errors.push(LoadError::Convert { at, source }),
                }
            }
            _ => {
                debug!(location = %at, api_version, kind, "ignoring object of a kind the proxy does not use")
            }
        }
    }

    fn load_list(&mut self, at: Location, api_version: &str, kind: &str, mut value: Value) {
        if at.item.is_some() {
            self.errors.push(LoadError::NotAnObject {
                at,
                reason: "a List inside a List",
            });
            return;
        }
        let items = match value.get_mut("items").map(std::mem::take) {
            None | Some(Value::Null) => return,
            Some(Value::Array(items)) => items,
            Some(_) => {
                self.errors.push(LoadError::NotAnObject {
                    at,
                    reason: "List items is not a sequence",
                });
                return;
            }
        };
        // ServiceList items default to v1 Service; a plain List has no such default.
        let item_type = kind
            .strip_suffix("List")
            .filter(|k| !k.is_empty())
            .map(|k| (api_version, k));
        for (i, item) in items.into_iter().enumerate() {
            let at = Location {
                item: Some(i),
                ..at.clone()
            };
            self.load_value(at, item, item_type);
        }
    }

    fn decode<T: serde::de::DeserializeOwned>(
        &mut self,
        at: &Location,
        kind: &str,
        value: &Value,
    ) -> Option<T> {
        match decode_value(value) {
            Ok(object) => Some(object),
            Err(message) => {
                self.errors.push(LoadError::Decode {
                    at: at.clone(),
                    object: describe(kind, value),
                    message,
                });
                None
            }
        }
    }
}

/// Folders and manifests for this module's tests and the watcher's.
#[cfg(test)]
pub(super) mod testdata {
    use std::{
        fs,
        path::PathBuf,
        sync::atomic::{AtomicUsize, Ordering},
    };

    /// A fresh folder under the system temp dir, removed on drop.
    pub struct TempDir(pub PathBuf);

    impl TempDir {
        pub fn new() -> Self {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let name = format!(
                "fastpath-file-test-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            );
            let path = std::env::temp_dir().join(name);
            let _ = fs::remove_dir_all(&path);
            fs::create_dir_all(&path).unwrap();
            Self(path)
        }

        pub fn write(&self, name: &str, text: &str) -> PathBuf {
            let path = self.0.join(name);
            fs::write(&path, text).unwrap();
            path
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    pub fn service_yaml(name: &str, ip: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: shop\nspec:\n  clusterIP: {ip}\n  ports:\n  - name: http\n    port: 80\n"
        )
    }

    pub fn slice_yaml(service: &str, name: &str, ip: &str) -> String {
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: shop\n  labels:\n    kubernetes.io/service-name: {service}\naddressType: IPv4\nports:\n- name: http\n  port: 8080\nendpoints:\n- addresses: [{ip}]\n"
        )
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{testdata::*, *};

    fn names(loaded: &Loaded) -> (Vec<String>, Vec<String>) {
        (
            loaded.services.iter().map(|s| s.key.to_string()).collect(),
            loaded
                .slices
                .iter()
                .map(|s| format!("{}:{}", s.0, s.1))
                .collect(),
        )
    }

    fn messages(loaded: &Loaded) -> Vec<String> {
        loaded.errors.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn multi_document_file() {
        let dir = TempDir::new();
        let text = format!(
            "# a comment before the first document\n---\n{}---\n{}---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: other}}\n---\n# empty\n---\n",
            service_yaml("web", "198.19.96.10"),
            slice_yaml("web", "web-abc", "198.18.1.1"),
        );
        let path = dir.write("app.yaml", &text);
        let loaded = load(&path);
        assert!(loaded.errors.is_empty(), "{:?}", messages(&loaded));
        assert_eq!(
            names(&loaded),
            (vec!["shop/web".into()], vec!["shop/web:web-abc".into()])
        );
        assert_eq!(loaded.skipped, 0);
        let (_, _, slice) = &*loaded.slices[0];
        assert_eq!(slice.endpoints[0].ip.to_string(), "198.18.1.1");
        assert_eq!(
            loaded.services[0].cluster_ips[0].to_string(),
            "198.19.96.10"
        );
    }

    #[test]
    fn folder_of_files() {
        let dir = TempDir::new();
        dir.write("b.yml", &slice_yaml("web", "web-abc", "198.18.1.1"));
        dir.write("a.yaml", &service_yaml("web", "198.19.96.10"));
        dir.write("c.json", r#"{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "api", "namespace": "shop"},
            "spec": {"clusterIP": "198.19.96.11", "ports": [{"port": 443}]}}"#);
        dir.write("notes.txt", "not: yaml: at: all: [");
        dir.write(".a.yaml.swp", "not: yaml: at: all: [");
        fs::create_dir(dir.0.join("nested.yaml")).unwrap();
        dir.write(
            "nested.yaml/ignored.yaml",
            &service_yaml("nested", "198.19.96.12"),
        );

        let loaded = load(&dir.0);
        assert!(loaded.errors.is_empty(), "{:?}", messages(&loaded));
        assert_eq!(
            names(&loaded),
            (
                vec!["shop/web".into(), "shop/api".into()],
                vec!["shop/web:web-abc".into()]
            ),
            "files are read in name order, not recursively"
        );
    }

    #[test]
    fn malformed_documents_are_reported_and_the_rest_loads() {
        let dir = TempDir::new();
        let text = [
            service_yaml("good-1", "198.19.96.1"),
            service_yaml("bad-port", "198.19.96.2").replace("port: 80", "port: 70000"),
            service_yaml("wrong-type", "198.19.96.3").replace("port: 80", "port: eighty"),
            "apiVersion: v1\nkind: Service\nmetadata: {name: broken\nspec: [\n".to_owned(),
            service_yaml("good-2", "198.19.96.4"),
            "just a string\n".to_owned(),
            "metadata: {name: kindless}\n".to_owned(),
            slice_yaml("good-1", "good-1-x", "198.18.1.1"),
        ]
        .join("---\n");
        let path = dir.write("mixed.yaml", &text);
        let loaded = load(&path);
        assert_eq!(
            names(&loaded),
            (
                vec!["shop/good-1".into(), "shop/good-2".into()],
                vec!["shop/good-1:good-1-x".into()]
            )
        );
        let p = path.display();
        // Line numbers count from the start of the file.
        let want = [
            format!(
                "{p}: document 2 (line 11): Service shop/bad-port: spec.ports[0].port \"70000\": must be between 1 and 65535, inclusive"
            ),
            format!(
                "{p}: document 3 (line 22): Service shop/wrong-type: spec.ports[0].port: invalid type: string \"eighty\", expected i32"
            ),
            format!("{p}: document 4 (line 33): invalid YAML: "),
            format!("{p}: document 6 (line 49): not a Kubernetes object: not a mapping"),
            format!(
                "{p}: document 7 (line 51): not a Kubernetes object: apiVersion or kind is missing"
            ),
        ];
        let got = messages(&loaded);
        assert_eq!(got.len(), want.len(), "{got:#?}");
        for (got, want) in got.iter().zip(&want) {
            assert!(got.starts_with(want.as_str()), "{got}\nwant {want}");
        }
        // The syntax error's line counts from the start of the file.
        assert!(
            got[2].contains("line 36") || got[2].contains("line 37"),
            "{}",
            got[2]
        );
        assert!(matches!(loaded.errors[0], LoadError::Convert { .. }));
        assert!(matches!(loaded.errors[1], LoadError::Decode { .. }));
        assert!(matches!(loaded.errors[2], LoadError::Syntax { .. }));
        assert!(loaded.errors.iter().all(|e| e.path() == path));
    }

    #[test]
    fn list_kinds() {
        let dir = TempDir::new();
        let text = r#"
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: web}
  spec: {clusterIP: 198.19.96.1, ports: [{port: 80}]}
- apiVersion: v1
  kind: Service
  metadata: {name: bad, namespace: shop}
  spec: {clusterIP: 198.19.96.2, ports: [{port: 80, protocol: QUIC}]}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}
  addressType: IPv4
  endpoints: [{addresses: [198.18.1.1]}]
- apiVersion: v1
  kind: Service
  metadata: {name: typo}
  spec: {ports: {port: 80}}
- apiVersion: apps/v1
  kind: Deployment
  metadata: {name: ignored}
---
apiVersion: v1
kind: ServiceList
items:
- metadata: {name: listed}
  spec: {clusterIP: 198.19.96.3, ports: [{port: 80}]}
- metadata: {name: headless}
  spec: {clusterIP: None}
"#;
        let path = dir.write("lists.yaml", text);
        let loaded = load(&path);
        assert_eq!(
            names(&loaded),
            (
                vec!["default/web".into(), "default/listed".into()],
                vec!["default/web:web-1".into()]
            )
        );
        assert_eq!(loaded.skipped, 1, "the headless service");
        let p = path.display();
        assert_eq!(
            messages(&loaded),
            [
                format!(
                    "{p}: document 1 (line 1), items[1]: Service shop/bad: spec.ports[0].protocol \"QUIC\": supported values: TCP, UDP, SCTP"
                ),
                format!(
                    "{p}: document 1 (line 1), items[3]: Service default/typo: spec.ports: invalid type: map, expected a sequence"
                ),
            ]
        );
    }

    /// 100,000 nested `[` took a minute with the old reader, holding up every other file.
    #[test]
    fn deeply_nested_yaml_is_refused_fast_and_the_rest_loads() {
        let dir = TempDir::new();
        dir.write("a.yaml", &service_yaml("web", "198.19.0.1"));
        dir.write("b.yaml", &"[".repeat(100_000));
        dir.write("c.json", &format!("{}{}", "{\"a\":".repeat(100_000), "1"));
        let block: String = (0..200)
            .map(|i| format!("{}a:\n", "  ".repeat(i)))
            .collect();
        dir.write(
            "d.yaml",
            &format!("apiVersion: v1\nkind: List\nitems:\n{block}"),
        );
        let started = std::time::Instant::now();
        let loaded = load_for_node(&dir.0, &[]);
        let took = started.elapsed();
        assert!(took < Duration::from_secs(1), "took {took:?}");
        assert_eq!(names(&loaded).0, ["shop/web"]);
        let got = messages(&loaded);
        assert_eq!(got.len(), 3, "{got:#?}");
        for (err, file) in loaded.errors.iter().zip(["b.yaml", "c.json", "d.yaml"]) {
            assert!(matches!(err, LoadError::Syntax { .. }), "{err}");
            assert!(err.path().ends_with(file), "{err}");
        }
    }

    #[test]
    fn a_cluster_ip_of_the_node_is_refused() {
        let dir = TempDir::new();
        dir.write("a.yaml", &service_yaml("node", "198.18.0.5"));
        dir.write("b.yaml", &service_yaml("web", "198.19.0.1"));
        let loaded = load_for_node(&dir.0, &["198.18.0.5".parse().unwrap()]);
        assert_eq!(names(&loaded).0, ["shop/web"]);
        let got = messages(&loaded);
        assert_eq!(got.len(), 1);
        assert!(
            got[0].ends_with("Service shop/node: spec.clusterIP \"198.18.0.5\": may not be an address of this node"),
            "{}",
            got[0]
        );
        // The node's own addresses, as read from the kernel, include loopback.
        assert!(node_addresses().contains(&"127.0.0.1".parse().unwrap()));
    }

    #[test]
    fn unreadable_paths_are_errors() {
        let dir = TempDir::new();
        let missing = dir.0.join("missing.yaml");
        let loaded = load(&missing);
        assert_eq!(loaded.errors.len(), 1);
        assert!(matches!(&loaded.errors[0], LoadError::Read { path, .. } if *path == missing));

        fs::write(dir.0.join("binary.yaml"), [0xff, 0xfe, 0x00]).unwrap();
        dir.write("ok.yaml", &service_yaml("web", "198.19.96.1"));
        let loaded = load(&dir.0);
        assert_eq!(
            loaded.services.len(),
            1,
            "one unreadable file does not hide the others"
        );
        assert!(matches!(&loaded.errors[..], [LoadError::Read { .. }]));
    }

    #[test]
    fn document_splitting() {
        let docs = |text| {
            split_documents(text)
                .into_iter()
                .map(|(line, t)| (line, t.to_owned()))
                .collect::<Vec<_>>()
        };
        assert_eq!(docs("a: 1\n"), [(1, "a: 1\n".to_owned())]);
        assert_eq!(docs(""), [(1, String::new())]);
        assert_eq!(
            docs("# c\n---\na: 1\n---\nb: 2"),
            [(2, "---\na: 1\n".to_owned()), (4, "---\nb: 2".to_owned())]
        );
        assert_eq!(
            docs("a: 1\n--- # x\n---\t\n--- |\n  text\n"),
            [
                (1, "a: 1\n".to_owned()),
                (2, "--- # x\n".to_owned()),
                (3, "---\t\n".to_owned()),
                (4, "--- |\n  text\n".to_owned()),
            ]
        );
        assert_eq!(
            docs("a: ---\n----\n ---\nb: 1\r\n---\r\nc: 2\n").len(),
            2,
            "only `---` at line start is a marker"
        );
    }

    #[test]
    fn windows_line_endings_and_bom() {
        let dir = TempDir::new();
        let text = format!(
            "\u{feff}{}---\r\n{}",
            service_yaml("a", "198.19.96.1"),
            service_yaml("b", "198.19.96.2")
        )
        .replace('\n', "\r\n")
        .replace("\r\r\n", "\r\n");
        let loaded = load(&dir.write("crlf.yaml", &text));
        assert!(loaded.errors.is_empty(), "{:?}", messages(&loaded));
        assert_eq!(loaded.services.len(), 2);
    }
}
