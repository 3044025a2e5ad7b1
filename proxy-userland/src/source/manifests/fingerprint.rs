//! What a look at the manifest path compares: each file's identity, size and times.

use std::{
    collections::{BTreeSet, HashSet},
    ffi::OsString,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::SystemTime,
};

use crate::source::file;

/// What a poll compares to decide whether to re-read: the file list and each file's
/// identity, size and times. Inode and ctime catch a file replaced by rename (how editors
/// and ConfigMap volumes update) even when mtime and size happen to match.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Fingerprint(pub(super) Vec<(PathBuf, Option<Stamp>)>);

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
    ctime: (i64, i64),
}

pub(super) fn fingerprint(path: &Path) -> Fingerprint {
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
    pub(super) fn update_named(&mut self, dir: &Path, names: BTreeSet<OsString>) -> Named {
        let mut named = Vec::with_capacity(names.len());
        for name in names {
            let file = dir.join(name);
            let stamp = (file::is_manifest_name(&file) && file.is_file())
                .then(|| stamp_of(&file))
                .flatten();
            // Sorted as manifest_files sorts: by bytes.
            match (
                self.0
                    .binary_search_by(|(f, _)| f.as_os_str().cmp(file.as_os_str())),
                &stamp,
            ) {
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
pub(super) type Named = Vec<(PathBuf, Option<Stamp>)>;

impl Fingerprint {
    /// Folds a whole-folder `scan` into this fingerprint, which looks by name have kept
    /// up to date meanwhile: returns the files whose stamp differs, that appeared, or that
    /// went (`None`), except those in `named`, looked at by name since the scan began, of
    /// which this fingerprint knows better. Both are sorted as [`file::manifest_files`]
    /// sorts (by bytes), so this is one pass, without hashing 20,000 paths.
    pub(super) fn fold_scan(&mut self, scan: Fingerprint, named: &HashSet<PathBuf>) -> Named {
        let mut changed = Vec::new();
        let mut merged = Vec::with_capacity(scan.0.len());
        let mut known = std::mem::take(&mut self.0).into_iter().peekable();
        let mut seen = scan.0.into_iter().peekable();
        loop {
            let order = match (known.peek(), seen.peek()) {
                (None, None) => break,
                (Some(_), None) => std::cmp::Ordering::Less,
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (Some((k, _)), Some((s, _))) => k.as_os_str().cmp(s.as_os_str()),
            };
            match order {
                // Known only here: gone, unless it came after the scan's listing.
                std::cmp::Ordering::Less => {
                    let (file, stamp) = known.next().expect("peeked");
                    if named.contains(&file) {
                        merged.push((file, stamp));
                    } else {
                        changed.push((file, None));
                    }
                }
                // Seen only by the scan: new, unless a look by name since saw it go.
                std::cmp::Ordering::Greater => {
                    let (file, stamp) = seen.next().expect("peeked");
                    if !named.contains(&file) {
                        changed.push((file.clone(), stamp.clone()));
                        merged.push((file, stamp));
                    }
                }
                std::cmp::Ordering::Equal => {
                    let (file, known_stamp) = known.next().expect("peeked");
                    let (_, stamp) = seen.next().expect("peeked");
                    if named.contains(&file) || known_stamp == stamp {
                        merged.push((file, known_stamp));
                    } else {
                        changed.push((file.clone(), stamp.clone()));
                        merged.push((file, stamp));
                    }
                }
            }
        }
        self.0 = merged;
        changed
    }

    /// Whether every file was stat-ed: a scan that could not list the folder or stat one
    /// of its files is looked at in full, so that its problem is reported.
    pub(super) fn complete(&self) -> bool {
        self.0.iter().all(|(_, stamp)| stamp.is_some())
    }
}
