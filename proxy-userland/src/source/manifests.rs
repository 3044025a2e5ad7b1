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
    collections::HashSet,
    future::Future,
    io,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use tokio::{sync::mpsc, time::MissedTickBehavior};
use tracing::{error, info, warn};

use super::{
    SourceEvent, file,
    inotify::{DirWatch, Woken},
};

mod fingerprint;
mod state;

use fingerprint::{Fingerprint, fingerprint};
use state::{Manifests, Read};

/// Polls below this would spin; a watched manifest folder does not need it.
const MIN_POLL: Duration = Duration::from_millis(10);

/// Reads `path`, sends it as one full list and [`SourceEvent::Synced`], then, whenever a
/// file appeared, vanished or was modified, the objects that changed. Looks when inotify
/// reports something in the folder and every `poll` regardless. Returns when `shutdown`
/// resolves or the receiver is gone.
///
/// The poll works on every file system, including the symlink swaps of ConfigMap volumes.
/// Its stat of every file runs beside the looks inotify wakes, which stat only the files
/// it named: in a folder of 20,000 files the stat-ing takes ~50 ms, and a change arriving
/// meanwhile waited for it. Each problem is logged once, when its file is read.
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
    // The poll's stat of the whole folder, when one is under way, and the files looked at
    // by name since it began.
    let mut scan: Option<tokio::task::JoinHandle<Fingerprint>> = None;
    let mut named_since_scan: HashSet<PathBuf> = HashSet::new();
    // When the last scan began and how long it took: see [`poll_due`].
    let (mut scan_began, mut scan_took) = (Instant::now(), Duration::ZERO);

    loop {
        let look = tokio::select! {
            biased;
            () = &mut shutdown => return,
            done = async { scan.as_mut().expect("guarded").await }, if scan.is_some() => {
                scan = None;
                scan_took = scan_began.elapsed();
                match done {
                    Ok(found) if found.complete() => Look::Scanned(found),
                    _ => Look::Full,
                }
            }
            _ = ticker.tick() => match poll_due(scan_began.elapsed(), scan_took, wake.is_some()) {
                true => Look::Poll,
                false => continue,
            },
            woken = changed(&mut wake) => match (&mut wake, woken) {
                (Some(w), Ok(woken)) => {
                    w.arm();
                    match woken {
                        Woken::Names(names) => Look::Named(names),
                        Woken::All => Look::Poll,
                    }
                }
                (_, Err(e)) => {
                    warn!("inotify failed ({e}); polling only");
                    wake = None;
                    Look::Poll
                }
                (None, Ok(_)) => Look::Poll,
            },
        };
        let look = match look {
            // Nothing read yet: the whole path, now.
            _ if last.is_none() => Look::Full,
            Look::Poll => {
                if scan.is_none() {
                    scan_began = Instant::now();
                    named_since_scan.clear();
                    let p = path.clone();
                    scan = Some(tokio::task::spawn_blocking(move || fingerprint(&p)));
                }
                continue;
            }
            look => look,
        };
        let (p, previous, to_engine) = (path.clone(), last.take(), tx.clone());
        let mut taken = std::mem::take(&mut state);
        let full = first;
        let mut addrs = std::mem::take(&mut node_ips);
        let named_before = match &look {
            Look::Scanned(_) => std::mem::take(&mut named_since_scan),
            _ => HashSet::new(),
        };
        // Reading and parsing block: not on the runtime. The events go to the engine from
        // here: a hop back through the runtime cost a wake-up (and, on a busy machine, a
        // wait for a CPU) per change.
        let work = tokio::task::spawn_blocking(move || {
            if matches!(look, Look::Full | Look::Scanned(_)) {
                addrs = file::node_addresses();
            }
            let mut named_now = Vec::new();
            let (now, read) = match (look, previous) {
                // A folder, looked at now: the path may have become one (or stopped being
                // one) since the start. A single file is read whole.
                (Look::Named(names), Some(mut now)) if p.is_dir() => {
                    let named = now.update_named(&p, names);
                    named_now.extend(named.iter().map(|(f, _)| f.clone()));
                    (now, taken.refresh_named(&named, &addrs))
                }
                (Look::Scanned(found), Some(mut now)) if p.is_dir() => {
                    let changed = now.fold_scan(found, &named_before);
                    (now, taken.refresh_named(&changed, &addrs))
                }
                // Fingerprint before reading: a change during the read is then seen by the
                // next look instead of being lost.
                (_, previous) => {
                    let now = fingerprint(&p);
                    let changed = previous.as_ref() != Some(&now);
                    let read = changed.then(|| taken.refresh(&now, &addrs));
                    (now, read)
                }
            };
            let mut sent = None;
            if let Some(mut read) = read {
                report(&p, &read);
                let events = std::mem::take(&mut read.events);
                let events: Vec<SourceEvent> = match full {
                    true => Manifests::first_list(events),
                    false => events,
                };
                sent = Some(
                    events
                        .into_iter()
                        .all(|ev| to_engine.blocking_send(ev).is_ok()),
                );
            }
            (now, sent, taken, addrs, named_now)
        });
        let (now, sent) = tokio::select! {
            biased;
            () = &mut shutdown => return,
            done = work => match done {
                Ok((now, sent, back, addrs, named_now)) => {
                    (state, node_ips) = (back, addrs);
                    if scan.is_some() {
                        named_since_scan.extend(named_now);
                    }
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

/// Whether the poll's tick should scan the folder, `since` the last scan began, which took
/// `took`. While inotify watches, the scan is a safety net: it waits at least 50 times its
/// own length, so that it takes at most 2% of a CPU (a folder of 20,000 files took ~50
/// ms: every 2.5 s instead of every 500 ms). A wake-up that may concern every file scans
/// at once regardless.
fn poll_due(since: Duration, took: Duration, watching: bool) -> bool {
    !watching || since >= took.saturating_mul(50)
}

/// What a wake-up asks of the next look.
enum Look {
    /// The whole path, now: the first look, a single file, or a scan that failed.
    Full,
    /// The files inotify named.
    Named(std::collections::BTreeSet<std::ffi::OsString>),
    /// Time for the poll, or something that may concern every file: start a scan.
    Poll,
    /// The poll's scan, done: fold it in.
    Scanned(Fingerprint),
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
