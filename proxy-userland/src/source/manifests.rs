//! The manifest source as events: the path ([`super::file`] reads it) is sent once as a
//! full list, then every change as the objects it added, changed or removed.
//!
//! A change used to re-send the full list, which the tracker then compared with every
//! service: at 10,000 services 330 ms from a file written to the BPF map, growing with the
//! service count. Now a change re-reads the files whose stamp changed, compares their
//! objects with what they held before, and sends only the difference; the poll is woken by
//! inotify as soon as a file is written.
//!
//! An object (a Service, or an EndpointSlice by namespace and name) found more than once
//! resolves as when the whole list was applied in order: files by name, objects in file
//! order, the last copy wins. Removing the winning copy brings back the one before it.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    ffi::OsString,
    future::Future,
    hash::Hash,
    io,
    net::IpAddr,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use tokio::{sync::mpsc, time::MissedTickBehavior};
use tracing::{error, info, warn};

use super::{
    SourceEvent,
    file::{self, LoadError, Pieces, Previous, Slice},
    inotify::{DirWatch, Woken},
};
use crate::model::{Service, ServiceKey};

/// What a poll compares to decide whether to re-read: the file list and each file's
/// identity, size and times. Inode and ctime catch a file replaced by rename (how editors
/// and ConfigMap volumes update) even when mtime and size happen to match.
#[derive(Debug, PartialEq, Eq)]
struct Fingerprint(Vec<(PathBuf, Option<Stamp>)>);

#[derive(Clone, Debug, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
    ctime: (i64, i64),
}

fn fingerprint(path: &Path) -> Fingerprint {
    if !path.is_dir() {
        return Fingerprint(vec![(path.to_owned(), stamp_of(path))]);
    }
    match file::manifest_files(path) {
        Ok(files) => Fingerprint(
            (files.into_iter())
                .map(|(file, meta)| (file, Some(Stamp::of(&meta))))
                .collect(),
        ),
        Err(_) => Fingerprint(vec![(path.to_owned(), None)]),
    }
}

fn stamp_of(file: &Path) -> Option<Stamp> {
    std::fs::metadata(file).ok().map(|m| Stamp::of(&m))
}

impl Stamp {
    fn of(m: &std::fs::Metadata) -> Self {
        Stamp {
            modified: m.modified().ok(),
            len: m.len(),
            inode: m.ino(),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }
}

impl Fingerprint {
    /// The folder's files named by inotify, each with its stamp now, or `None` when it is
    /// no longer a manifest file there; the fingerprint updated to match.
    fn update_named(&mut self, dir: &Path, names: BTreeSet<OsString>) -> Named {
        let mut named = Vec::with_capacity(names.len());
        for name in names {
            let file = dir.join(name);
            let stamp = (file::is_manifest_name(&file) && file.is_file())
                .then(|| stamp_of(&file))
                .flatten();
            // Sorted as manifest_files sorts.
            match (self.0.binary_search_by(|(f, _)| f.cmp(&file)), &stamp) {
                (Ok(i), Some(s)) => self.0[i].1 = Some(s.clone()),
                (Ok(i), None) => {
                    self.0.remove(i);
                }
                (Err(i), Some(s)) => self.0.insert(i, (file.clone(), Some(s.clone()))),
                (Err(_), None) => {}
            }
            named.push((file, stamp));
        }
        named
    }
}

/// Files inotify named, each with its stamp (`None`: gone).
type Named = Vec<(PathBuf, Option<Stamp>)>;

/// One file's objects as last read, in file order, with the stamp the file had then.
#[derive(Default)]
struct FileObjects {
    stamp: Option<Stamp>,
    services: Vec<Arc<Service>>,
    slices: Vec<Arc<Slice>>,
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
struct Manifests {
    files: HashMap<Arc<Path>, FileObjects>,
    services: HashMap<ServiceKey, Holders>,
    slices: HashMap<(Arc<str>, String), Holders>,
}

/// What one look at the path found.
struct Read {
    events: Vec<SourceEvent>,
    /// The problems in the files read this time (the others' were reported before).
    errors: Vec<LoadError>,
    services: usize,
    slices: usize,
    skipped: usize,
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
    fn refresh(&mut self, now: &Fingerprint, node_ips: &[IpAddr]) -> Read {
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
    fn refresh_named(&mut self, named: &Named, node_ips: &[IpAddr]) -> Option<Read> {
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
                skipped: loaded.skipped,
                pieces,
            };
            self.apply(name, Some(objects), &mut touched);
        }
        Read {
            events: self.events(touched),
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

    /// Every object's copy in force, for the first full list.
    fn first_list(events: Vec<SourceEvent>) -> [SourceEvent; 2] {
        let (mut services, mut slices) = (Vec::new(), Vec::new());
        for ev in events {
            match ev {
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
        [
            SourceEvent::ReplaceAll { services, slices },
            SourceEvent::Synced,
        ]
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

/// Polls below this would spin; a watched manifest folder does not need it.
const MIN_POLL: Duration = Duration::from_millis(10);

/// Reads `path`, sends it as one full list and [`SourceEvent::Synced`], then, whenever a
/// file appeared, vanished or was modified, the objects that changed. Looks when inotify
/// reports something in the folder and every `poll` regardless. Returns when `shutdown`
/// resolves or the receiver is gone.
///
/// The poll is a handful of `stat` calls and works on every file system, including the
/// symlink swaps of ConfigMap volumes. Each problem is logged once, when its file is read.
pub async fn run(
    path: PathBuf,
    poll: Duration,
    tx: mpsc::Sender<SourceEvent>,
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    let mut ticker = tokio::time::interval(poll.max(MIN_POLL));
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut wake = match DirWatch::for_manifests(&path) {
        Ok(w) => Some(w),
        Err(e) => {
            warn!("cannot watch {} ({e}); polling only", path.display());
            None
        }
    };
    let mut last: Option<Fingerprint> = None;
    let mut state = Manifests::default();
    let mut first = true;
    // The node's addresses (no cluster IP may be one), read again at each poll, not at
    // each change: getifaddrs dumps every interface, a hundred on a node full of pods.
    let mut node_ips = Vec::new();

    loop {
        let (ticked, woken) = tokio::select! {
            biased;
            () = &mut shutdown => return,
            _ = ticker.tick() => (true, Ok(Woken::All)),
            woken = changed(&mut wake) => (false, woken),
        };
        let woken = match (&mut wake, woken) {
            (Some(w), Ok(woken)) => {
                w.arm();
                woken
            }
            (_, Err(e)) => {
                warn!("inotify failed ({e}); polling only");
                wake = None;
                Woken::All
            }
            (None, Ok(woken)) => woken,
        };
        let (p, previous, to_engine) = (path.clone(), last.take(), tx.clone());
        let mut taken = std::mem::take(&mut state);
        let full = first;
        let mut addrs = std::mem::take(&mut node_ips);
        // Fingerprint before reading: a change during the read is then seen by the next
        // look instead of being lost. Reading and parsing block: not on the runtime. The
        // events go to the engine from here: a hop back through the runtime cost a wake-up
        // (and, on a busy machine, a wait for a CPU) per change.
        let work = tokio::task::spawn_blocking(move || {
            let mut sent = None;
            if ticked || full {
                addrs = file::node_addresses();
            }
            // inotify named the files that changed: look at those only. The poll (and any
            // wake-up that may concern every file) looks at the whole folder.
            let (now, read) = match (woken, previous) {
                (Woken::Names(names), Some(mut now)) if p.is_dir() => {
                    let named = now.update_named(&p, names);
                    (now, taken.refresh_named(&named, &addrs))
                }
                (_, previous) => {
                    let now = fingerprint(&p);
                    let changed = previous.as_ref() != Some(&now);
                    let read = changed.then(|| taken.refresh(&now, &addrs));
                    (now, read)
                }
            };
            if let Some(mut read) = read {
                report(&p, &read);
                let events = std::mem::take(&mut read.events);
                let events: Vec<SourceEvent> = match full {
                    true => Manifests::first_list(events).into(),
                    false => events,
                };
                sent = Some(
                    events
                        .into_iter()
                        .all(|ev| to_engine.blocking_send(ev).is_ok()),
                );
            }
            (now, sent, taken, addrs)
        });
        let (now, sent) = tokio::select! {
            biased;
            () = &mut shutdown => return,
            done = work => match done {
                Ok((now, sent, back, addrs)) => {
                    (state, node_ips) = (back, addrs);
                    (now, sent)
                }
                Err(e) => {
                    // The state went with the task: start over with a full list.
                    error!(path = %path.display(), "reading manifests failed: {e}");
                    first = true;
                    continue;
                }
            },
        };
        last = Some(now);
        match sent {
            // The engine is gone.
            Some(false) => return,
            Some(true) => first = false,
            None => {}
        }
    }
}

async fn changed(wake: &mut Option<DirWatch>) -> io::Result<Woken> {
    match wake {
        Some(w) => w.changed().await,
        None => std::future::pending().await,
    }
}

fn report(path: &Path, read: &Read) {
    for err in &read.errors {
        error!("{err}");
    }
    let (services, slices, skipped, errors) =
        (read.services, read.slices, read.skipped, read.errors.len());
    if errors == 0 {
        info!(path = %path.display(), services, slices, skipped, "manifests loaded");
    } else {
        warn!(path = %path.display(), services, slices, skipped, errors, "manifests loaded with errors");
    }
}

#[cfg(test)]
#[path = "manifests_tests.rs"]
mod tests;
