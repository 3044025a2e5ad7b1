//! What the watched path holds, file by file, and which copy of each object is in force.

use std::{
    collections::{HashMap, HashSet},
    hash::Hash,
    net::IpAddr,
    path::Path,
    sync::Arc,
};

use super::fingerprint::{Fingerprint, Named, Stamp};
use crate::{
    model::{Cidr, Service, ServiceKey},
    source::{
        SourceEvent,
        file::{self, LoadError, Pieces, Previous, Slice},
    },
};

/// One file's objects as last read, in file order, with the stamp the file had then.
#[derive(Default)]
pub(super) struct FileObjects {
    pub(super) stamp: Option<Stamp>,
    services: Vec<Arc<Service>>,
    slices: Vec<Arc<Slice>>,
    service_cidrs: Vec<(String, Vec<Cidr>)>,
    skipped: usize,
    /// What each piece of its text made, so that the next read converts only what changed.
    pieces: Pieces,
}

/// The files holding one object, in file order, each with the object's last position in
/// it. Almost always one.
type Holders = Vec<(Arc<Path>, usize)>;

/// What the watched path holds, file by file, and which copy of each object is in force
/// (the last holder's).
#[derive(Default)]
pub(super) struct Manifests {
    pub(super) files: HashMap<Arc<Path>, FileObjects>,
    pub(super) services: HashMap<ServiceKey, Holders>,
    pub(super) slices: HashMap<(Arc<str>, String), Holders>,
    /// Every file's ServiceCIDRs as last sent (none before the first).
    service_cidrs: Vec<(String, Vec<Cidr>)>,
}

/// What one look at the path found.
pub(super) struct Read {
    pub(super) events: Vec<SourceEvent>,
    /// The problems in the files read this time (the others' were reported before).
    pub(super) errors: Vec<LoadError>,
    pub(super) services: usize,
    pub(super) slices: usize,
    pub(super) skipped: usize,
}

/// One file to bring up to date: gone from the path, or to read (again) with the stamp it
/// had when listed (`None`: it vanished meanwhile).
enum Update<'a> {
    Gone(&'a Path),
    Read(&'a Path, Option<&'a Stamp>),
}

/// The objects a look changed, each with its copy in force before the look, taken when the
/// first file holding it was applied. Events are made from these at the end, so an object
/// moved between two files in one look is no change rather than a removal and an addition
/// (which a sync in between would have programmed).
#[derive(Default)]
struct Touched {
    services: HashMap<ServiceKey, Option<Arc<Service>>>,
    slices: HashMap<(Arc<str>, String), Option<Arc<Slice>>>,
}

impl Manifests {
    /// Brings the state to `now`, the path's fingerprint: files gone are dropped, files
    /// whose stamp changed are read again. Returns the objects whose copy in force changed.
    pub(super) fn refresh(&mut self, now: &Fingerprint, node_ips: &[IpAddr]) -> Read {
        // A set, not a scan: a folder may hold a file per object, thousands of them.
        let listed: HashSet<&Path> = now.0.iter().map(|(f, _)| f.as_path()).collect();
        let gone: Vec<Arc<Path>> = (self.files.keys())
            .filter(|f| !listed.contains(&***f))
            .cloned()
            .collect();
        let mut updates: Vec<Update> = gone.iter().map(|f| Update::Gone(f)).collect();
        for (file, stamp) in &now.0 {
            if !self.unchanged(file, stamp.as_ref()) {
                updates.push(Update::Read(file, stamp.as_ref()));
            }
        }
        self.apply_updates(updates, node_ips)
    }

    /// Brings only the files inotify named up to date, without looking at the others: a
    /// folder of a file per object made every change look at all of them (9 µs a file:
    /// 92 ms at 10,000 services). `None` when none of them changed.
    pub(super) fn refresh_named(&mut self, named: &Named, node_ips: &[IpAddr]) -> Option<Read> {
        let updates: Vec<Update> = (named.iter())
            .filter_map(|(file, stamp)| match stamp {
                None => self
                    .files
                    .contains_key(file.as_path())
                    .then_some(Update::Gone(file)),
                Some(s) => (!self.unchanged(file, Some(s))).then_some(Update::Read(file, Some(s))),
            })
            .collect();
        (!updates.is_empty()).then(|| self.apply_updates(updates, node_ips))
    }

    /// Whether `file` was read with `stamp` (a file without one is always read again).
    fn unchanged(&self, file: &Path, stamp: Option<&Stamp>) -> bool {
        let cached = self.files.get(file).and_then(|c| c.stamp.as_ref());
        cached.is_some() && cached == stamp
    }

    fn apply_updates(&mut self, updates: Vec<Update>, node_ips: &[IpAddr]) -> Read {
        let mut touched = Touched::default();
        let mut errors = Vec::new();
        for update in updates {
            let (file, stamp) = match update {
                Update::Gone(file) => {
                    let key = self.files.get_key_value(file).map(|(k, _)| k.clone());
                    if let Some(key) = key {
                        self.apply(key, None, &mut touched);
                    }
                    continue;
                }
                Update::Read(file, stamp) => (file, stamp),
            };
            let cached = self.files.get_key_value(file);
            let name = cached.map_or_else(|| Arc::from(file), |(k, _)| k.clone());
            let previous = cached.map(|(_, c)| Previous {
                services: &c.services,
                slices: &c.slices,
                pieces: &c.pieces,
            });
            let (mut loaded, pieces) = file::load_file(file, node_ips, previous);
            errors.append(&mut loaded.errors);
            // No stamp (it vanished meanwhile): kept without one, so it is read again.
            let objects = FileObjects {
                stamp: stamp.cloned(),
                services: loaded.services,
                slices: loaded.slices,
                service_cidrs: loaded.service_cidrs,
                skipped: loaded.skipped,
                pieces,
            };
            self.apply(name, Some(objects), &mut touched);
        }
        let mut events = self.events(touched);
        events.extend(self.service_cidr_event());
        Read {
            events,
            errors,
            services: self.services.len(),
            slices: self.slices.len(),
            skipped: self.files.values().map(|f| f.skipped).sum(),
        }
    }

    /// Replaces what `file` holds with `new` (`None`: the file is gone), noting in
    /// `touched` the objects that may have changed.
    fn apply(&mut self, file: Arc<Path>, new: Option<FileObjects>, touched: &mut Touched) {
        let Self {
            files,
            services,
            slices,
            ..
        } = self;
        let old = files.remove(&file).unwrap_or_default();
        let kept = new.is_some();
        let new = new.unwrap_or_default();
        let others = &*files;
        diff(
            services,
            &file,
            (&old.services, &new.services),
            |f, i| &others[f].services[i],
            (|svc| svc.key.clone(), |a, b| a.key == b.key),
            &mut touched.services,
        );
        diff(
            slices,
            &file,
            (&old.slices, &new.slices),
            |f, i| &others[f].slices[i],
            (
                |slice| (slice.0.namespace.clone(), slice.1.clone()),
                |a, b| a.1 == b.1 && a.0.namespace == b.0.namespace,
            ),
            &mut touched.slices,
        );
        if kept {
            files.insert(file, new);
        }
    }

    /// An event for each touched object whose copy in force is not what it was.
    fn events(&self, touched: Touched) -> Vec<SourceEvent> {
        let in_force = |holders: Option<&Holders>| holders.and_then(|h| h.last()).cloned();
        let mut events = Vec::new();
        for (key, before) in touched.services {
            let now = in_force(self.services.get(&key)).map(|(f, i)| &self.files[&f].services[i]);
            if before.as_ref() != now {
                events.push(SourceEvent::Service {
                    key,
                    service: now.map(|svc| Service::clone(svc)),
                });
            }
        }
        for ((namespace, name), before) in touched.slices {
            let id = (namespace, name);
            let now = in_force(self.slices.get(&id)).map(|(f, i)| &self.files[&f].slices[i]);
            if before.as_ref() == now {
                continue;
            }
            let (namespace, name) = (id.0.to_string(), id.1);
            events.push(match now.map(|slice| &**slice) {
                Some((owner, name, info)) => SourceEvent::Slice {
                    namespace,
                    owner: Some(owner.clone()),
                    name: name.clone(),
                    slice: Some(info.clone()),
                },
                // The tracker knows which service it fed.
                None => SourceEvent::Slice {
                    namespace,
                    owner: None,
                    name,
                    slice: None,
                },
            });
        }
        events
    }

    /// Every file's ServiceCIDRs, when they differ from what was sent last: a few objects,
    /// replaced as a whole. The same name in two files counts once per file; the ranges
    /// are a union, so that changes nothing.
    fn service_cidr_event(&mut self) -> Option<SourceEvent> {
        let mut files: Vec<(&Arc<Path>, &FileObjects)> = self.files.iter().collect();
        files.sort_by(|a, b| a.0.cmp(b.0));
        let now: Vec<(String, Vec<Cidr>)> = (files.into_iter())
            .flat_map(|(f, o)| {
                (o.service_cidrs.iter())
                    .map(move |(n, c)| (format!("{n}@{}", f.display()), c.clone()))
            })
            .collect();
        if self.service_cidrs == now {
            return None;
        }
        self.service_cidrs = now.clone();
        Some(SourceEvent::ReplaceServiceCidrs(now))
    }

    /// Every object's copy in force, for the first full list, then the ServiceCIDRs.
    pub(super) fn first_list(events: Vec<SourceEvent>) -> Vec<SourceEvent> {
        let (mut services, mut slices) = (Vec::new(), Vec::new());
        let mut cidrs = None;
        for ev in events {
            match ev {
                ev @ SourceEvent::ReplaceServiceCidrs(_) => cidrs = Some(ev),
                SourceEvent::Service {
                    service: Some(svc), ..
                } => services.push(svc),
                SourceEvent::Slice {
                    owner: Some(owner),
                    name,
                    slice: Some(slice),
                    ..
                } => slices.push((owner, name, slice)),
                // From nothing, every change is an addition.
                _ => {}
            }
        }
        let mut out = vec![SourceEvent::ReplaceAll { services, slices }];
        // Before Synced, so the first sync programs the ranges too.
        out.extend(cidrs);
        out.push(SourceEvent::Synced);
        out
    }
}

/// Moves one kind of object of `file` from `old` to `new` in `index`, noting in `touched`
/// the copy in force before of every object that may change (the first time it is
/// touched in this look). `others` finds an object in a file other than `file`, which is
/// not being changed.
fn diff<'a, K: Hash + Eq + Clone, T: PartialEq + Clone>(
    index: &mut HashMap<K, Holders>,
    file: &Arc<Path>,
    (old, new): (&'a [T], &'a [T]),
    others: impl Fn(&Path, usize) -> &'a T,
    (key_of, same_key): (impl Fn(&T) -> K, impl Fn(&T, &T) -> bool),
    touched: &mut HashMap<K, Option<T>>,
) {
    let mut touch = |holders: &mut Holders, key: &K| {
        if !touched.contains_key(key) {
            let before = holders.last().map(|(f, i)| match **f == **file {
                true => &old[*i],
                false => others(f, *i),
            });
            touched.insert(key.clone(), before.cloned());
        }
    };
    // The common edit: the same objects in the same places, a few of them changed. Each
    // changed one that is its key's last copy in the file is the file's copy, at the same
    // place; no positions move. (Many changed: the general way, which is linear.)
    let aligned = old.len() == new.len() && old.iter().zip(new).all(|(o, n)| same_key(o, n));
    let changed: Vec<usize> = match aligned {
        true => (0..new.len())
            .filter(|&i| old[i] != new[i])
            .take(65)
            .collect(),
        false => Vec::new(),
    };
    if aligned && changed.len() <= 64 {
        for i in changed {
            let n = &new[i];
            if new[i + 1..].iter().any(|later| same_key(later, n)) {
                continue;
            }
            let key = key_of(n);
            if let Some(holders) = index.get_mut(&key) {
                touch(holders, &key);
            }
        }
        return;
    }
    // Each object's last position in the file, before and after.
    let mut at: HashMap<K, (Option<usize>, Option<usize>)> =
        HashMap::with_capacity(old.len().max(new.len()));
    for (i, t) in old.iter().enumerate() {
        at.entry(key_of(t)).or_default().0 = Some(i);
    }
    for (i, t) in new.iter().enumerate() {
        at.entry(key_of(t)).or_default().1 = Some(i);
    }
    let in_file = |holders: &Holders| holders.binary_search_by(|(f, _)| (**f).cmp(&**file));
    for (key, (was, now)) in at {
        if let (Some(w), Some(n)) = (was, now)
            && old[w] == new[n]
        {
            // The same object: in force or not, nothing changes but where it is.
            if w != n
                && let Some(holders) = index.get_mut(&key)
                && let Ok(p) = in_file(holders)
            {
                holders[p].1 = n;
            }
            continue;
        }
        let holders = index.entry(key.clone()).or_default();
        touch(holders, &key);
        match (in_file(holders), now) {
            (Ok(p), Some(n)) => holders[p].1 = n,
            (Ok(p), None) => {
                holders.remove(p);
            }
            (Err(p), Some(n)) => holders.insert(p, (file.clone(), n)),
            (Err(_), None) => {}
        }
        if holders.is_empty() {
            index.remove(&key);
        }
    }
}
