use std::{
    collections::{BTreeSet, HashSet},
    ffi::OsString,
    fs,
    path::PathBuf,
    sync::Arc,
};

use super::*;
use crate::{
    model::tracker::ChangeTracker,
    source::file::{
        LoadError,
        testdata::{TempDir, service_yaml, slice_yaml},
    },
};

/// Events, one line each: `svc shop/web 198.19.96.1`, `svc shop/web -`,
/// `slice shop/web-1 shop/web 198.18.1.1`, `slice shop/web-1 -`.
fn lines(events: &[SourceEvent]) -> Vec<String> {
    let mut out: Vec<String> = events
        .iter()
        .map(|ev| match ev {
            SourceEvent::Service {
                key,
                service: Some(svc),
            } => format!("svc {key} {}", svc.cluster_ips[0]),
            SourceEvent::Service { key, service: None } => format!("svc {key} -"),
            SourceEvent::Slice {
                namespace,
                owner: Some(owner),
                name,
                slice: Some(slice),
            } => format!("slice {namespace}/{name} {owner} {}", slice.endpoints[0].ip),
            SourceEvent::Slice {
                namespace,
                name,
                slice: None,
                ..
            } => format!("slice {namespace}/{name} -"),
            other => format!("{other:?}"),
        })
        .collect();
    out.sort();
    out
}

/// Follows a folder as the watcher does, and checks after every look that the events sent
/// so far leave the tracker as the full list read afresh would: the rule for duplicates
/// (the last copy in file order wins) is the full list's.
struct Follow {
    dir: TempDir,
    state: Manifests,
    tracker: ChangeTracker,
    /// Looks at the files written or removed since the last look only, as after an inotify
    /// wake-up naming them, once a first look at the whole folder has been made.
    named: Option<(Option<Fingerprint>, BTreeSet<OsString>)>,
}

impl Follow {
    /// `named`: look as after inotify wake-ups; else as after polls.
    fn new(named: bool) -> Self {
        Self {
            dir: TempDir::new(),
            state: Manifests::default(),
            tracker: ChangeTracker::new(),
            named: named.then(Default::default),
        }
    }

    /// Written as a new file renamed over the old one: a new inode, so the change is seen
    /// even within the file system's timestamp granularity.
    fn write(&mut self, name: &str, docs: &[String]) {
        let tmp = self.dir.write(&format!("{name}.tmp"), &docs.join("---\n"));
        fs::rename(tmp, self.dir.0.join(name)).unwrap();
        self.note(name);
    }

    fn remove(&mut self, name: &str) {
        fs::remove_file(self.dir.0.join(name)).unwrap();
        self.note(name);
    }

    fn note(&mut self, name: &str) {
        if let Some((_, names)) = &mut self.named {
            names.insert(name.into());
        }
    }

    fn look(&mut self) -> Vec<String> {
        let dir = self.dir.0.clone();
        let read = match &mut self.named {
            Some((Some(now), names)) => {
                let named = now.update_named(&dir, std::mem::take(names));
                let read = self.state.refresh_named(&named, &[]);
                assert_eq!(
                    *now,
                    fingerprint(&dir),
                    "the named files updated the fingerprint"
                );
                read.unwrap_or(Read {
                    events: vec![],
                    errors: vec![],
                    services: self.state.services.len(),
                    slices: self.state.slices.len(),
                    skipped: 0,
                })
            }
            Some((first, names)) => {
                let now = fingerprint(&dir);
                names.clear();
                let read = self.state.refresh(&now, &[]);
                *first = Some(now);
                read
            }
            None => self.state.refresh(&fingerprint(&dir), &[]),
        };
        assert!(read.errors.is_empty(), "{:?}", read.errors);
        let got = lines(&read.events);
        for ev in read.events {
            apply(&mut self.tracker, ev);
        }
        let loaded = file::load_for_node(&self.dir.0, &[]);
        let mut fresh = ChangeTracker::new();
        fresh.replace_all(
            loaded
                .services
                .into_iter()
                .map(Arc::unwrap_or_clone)
                .collect(),
            loaded
                .slices
                .into_iter()
                .map(Arc::unwrap_or_clone)
                .collect(),
        );
        assert_eq!(self.tracker.state(), fresh.state(), "after {got:?}");
        assert_eq!(read.services, fresh.state().services.len());
        got
    }
}

fn apply(t: &mut ChangeTracker, ev: SourceEvent) {
    match ev {
        SourceEvent::Service { key, service } => t.apply_service(key, service),
        SourceEvent::Slice {
            owner: Some(owner),
            name,
            slice,
            ..
        } => t.apply_slice(owner, name, slice),
        SourceEvent::Slice {
            namespace,
            owner: None,
            name,
            ..
        } => t.forget_slice(&namespace, &name),
        other => panic!("not a per-object event: {other:?}"),
    }
}

fn svc(name: &str, ip: &str) -> String {
    service_yaml(name, ip)
}

fn slice(service: &str, name: &str, ip: &str) -> String {
    slice_yaml(service, name, ip)
}

#[test]
fn a_change_sends_what_was_added_changed_or_removed() {
    for named in [false, true] {
        let mut f = Follow::new(named);
        f.write(
            "a.yaml",
            &[
                svc("web", "198.19.96.1"),
                slice("web", "web-1", "198.18.1.1"),
            ],
        );
        f.write("b.yaml", &[svc("api", "198.19.96.2")]);
        assert_eq!(
            f.look(),
            [
                "slice shop/web-1 shop/web 198.18.1.1",
                "svc shop/api 198.19.96.2",
                "svc shop/web 198.19.96.1",
            ]
        );
        assert!(f.look().is_empty(), "nothing changed");

        // One endpoint changes: one event.
        f.write(
            "a.yaml",
            &[
                svc("web", "198.19.96.1"),
                slice("web", "web-1", "198.18.1.2"),
            ],
        );
        assert_eq!(f.look(), ["slice shop/web-1 shop/web 198.18.1.2"]);

        // Rewritten with the same objects in another order: nothing.
        f.write(
            "a.yaml",
            &[
                slice("web", "web-1", "198.18.1.2"),
                svc("web", "198.19.96.1"),
            ],
        );
        assert!(f.look().is_empty());

        // Added, and removed from a file that stays.
        f.write(
            "b.yaml",
            &[svc("api", "198.19.96.2"), svc("db", "198.19.96.3")],
        );
        assert_eq!(f.look(), ["svc shop/db 198.19.96.3"]);
        f.write("b.yaml", &[svc("db", "198.19.96.3")]);
        assert_eq!(f.look(), ["svc shop/api -"]);

        // A file deleted takes its objects with it.
        f.remove("a.yaml");
        assert_eq!(f.look(), ["slice shop/web-1 -", "svc shop/web -"]);
        assert_eq!(f.state.files.len(), 1);
        assert_eq!(f.state.slices.len(), 0);
    }
}

#[test]
fn an_object_moving_between_files_is_no_change() {
    for named in [false, true] {
        let mut f = Follow::new(named);
        f.write(
            "a.yaml",
            &[svc("web", "198.19.96.1"), svc("api", "198.19.96.2")],
        );
        f.write("b.yaml", &[slice("web", "web-1", "198.18.1.1")]);
        assert_eq!(f.look().len(), 3);

        // Both files change before the next look: web and its slice swap files.
        f.write(
            "a.yaml",
            &[
                svc("api", "198.19.96.2"),
                slice("web", "web-1", "198.18.1.1"),
            ],
        );
        f.write("b.yaml", &[svc("web", "198.19.96.1")]);
        assert!(f.look().is_empty());

        // Moved and changed at once: one event, for the change.
        f.remove("b.yaml");
        f.write("c.yaml", &[svc("web", "198.19.96.9")]);
        assert_eq!(f.look(), ["svc shop/web 198.19.96.9"]);

        // Moved in two looks: gone, then back.
        f.remove("c.yaml");
        assert_eq!(f.look(), ["svc shop/web -"]);
        f.write("d.yaml", &[svc("web", "198.19.96.9")]);
        assert_eq!(f.look(), ["svc shop/web 198.19.96.9"]);
    }
}

/// As with the full list: the last copy in file order wins, and removing it brings back
/// the one before.
#[test]
fn duplicates_resolve_as_the_full_list_did() {
    for named in [false, true] {
        let mut f = Follow::new(named);
        f.write("a.yaml", &[svc("dup", "198.19.96.1")]);
        f.write("b.yaml", &[svc("dup", "198.19.96.2")]);
        assert_eq!(f.look(), ["svc shop/dup 198.19.96.2"]);

        // The copy not in force changes: nothing to send.
        f.write("a.yaml", &[svc("dup", "198.19.96.3")]);
        assert!(f.look().is_empty());
        // The copy in force changes.
        f.write("b.yaml", &[svc("dup", "198.19.96.4")]);
        assert_eq!(f.look(), ["svc shop/dup 198.19.96.4"]);
        // A copy in a later file takes over; removing it gives the earlier one back.
        f.write("c.yaml", &[svc("dup", "198.19.96.5")]);
        assert_eq!(f.look(), ["svc shop/dup 198.19.96.5"]);
        f.remove("c.yaml");
        assert_eq!(f.look(), ["svc shop/dup 198.19.96.4"]);
        f.write("b.yaml", &[]);
        assert_eq!(f.look(), ["svc shop/dup 198.19.96.3"]);

        // Twice in one file: the later one.
        f.write(
            "a.yaml",
            &[svc("dup", "198.19.96.6"), svc("dup", "198.19.96.7")],
        );
        assert_eq!(f.look(), ["svc shop/dup 198.19.96.7"]);
        // Edited in place: the earlier copy changes nothing, the later one does.
        f.write(
            "a.yaml",
            &[svc("dup", "198.19.96.8"), svc("dup", "198.19.96.7")],
        );
        assert!(f.look().is_empty());
        f.write(
            "a.yaml",
            &[svc("dup", "198.19.96.8"), svc("dup", "198.19.96.9")],
        );
        assert_eq!(f.look(), ["svc shop/dup 198.19.96.9"]);
        f.write("a.yaml", &[svc("dup", "198.19.96.7")]);
        assert_eq!(f.look(), ["svc shop/dup 198.19.96.7"]);

        // A slice (namespace and name) listed for two services belongs to the later one.
        f.write("s1.yaml", &[slice("web", "s", "198.18.1.1")]);
        f.write("s2.yaml", &[slice("api", "s", "198.18.1.2")]);
        assert_eq!(f.look(), ["slice shop/s shop/api 198.18.1.2"]);
        f.remove("s2.yaml");
        assert_eq!(f.look(), ["slice shop/s shop/web 198.18.1.1"]);
        f.remove("s1.yaml");
        assert_eq!(f.look(), ["slice shop/s -"]);
    }
}

#[test]
fn a_single_file_path_is_diffed_too() {
    let dir = TempDir::new();
    let path = dir.write(
        "all.yaml",
        &[svc("web", "198.19.96.1"), svc("api", "198.19.96.2")].join("---\n"),
    );
    let mut state = Manifests::default();
    assert_eq!(state.refresh(&fingerprint(&path), &[]).events.len(), 2);
    let tmp = dir.write(
        "all.tmp",
        &[svc("web", "198.19.96.1"), svc("api", "198.19.96.3")].join("---\n"),
    );
    fs::rename(tmp, &path).unwrap();
    let read = state.refresh(&fingerprint(&path), &[]);
    assert_eq!(lines(&read.events), ["svc shop/api 198.19.96.3"]);

    // Gone: a read error, and its objects leave.
    fs::remove_file(&path).unwrap();
    let read = state.refresh(&fingerprint(&path), &[]);
    assert_eq!(read.events.len(), 2);
    assert!(matches!(&read.errors[..], [LoadError::Read { .. }]));
}

/// A change re-reads the changed file only; a file's problem is reported when that file is
/// read, not on every change.
#[test]
fn only_changed_files_are_read_again() {
    let dir = TempDir::new();
    dir.write("a.yaml", &svc("web", "198.19.96.1"));
    let broken = dir.write("b.yaml", "kind: [\n");
    let mut state = Manifests::default();
    let first = state.refresh(&fingerprint(&dir.0), &[]);
    assert_eq!(lines(&first.events), ["svc shop/web 198.19.96.1"]);
    assert_eq!(first.errors.len(), 1);

    // b.yaml is fixed. a.yaml is given its old stamp, as if unchanged: were it read
    // again, it would now say "api".
    let a = dir.0.join("a.yaml");
    fs::write(&a, svc("api", "198.19.96.2")).unwrap();
    fs::write(&broken, svc("db", "198.19.96.3")).unwrap();
    let mut now = fingerprint(&dir.0);
    now.0[0].1 = state.files[a.as_path()].stamp.clone();
    let second = state.refresh(&now, &[]);
    assert_eq!(lines(&second.events), ["svc shop/db 198.19.96.3"]);
    assert!(second.errors.is_empty(), "{:?}", second.errors);
    assert_eq!(second.services, 2);

    // A removed file leaves, a changed one is read again.
    fs::remove_file(&broken).unwrap();
    let third = state.refresh(&fingerprint(&dir.0), &[]);
    assert_eq!(
        lines(&third.events),
        [
            "svc shop/api 198.19.96.2",
            "svc shop/db -",
            "svc shop/web -"
        ]
    );
}

async fn next(rx: &mut mpsc::Receiver<SourceEvent>) -> SourceEvent {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("an event within 10s")
        .expect("sender alive")
}

fn quiet(rx: &mut mpsc::Receiver<SourceEvent>) -> bool {
    matches!(rx.try_recv(), Err(mpsc::error::TryRecvError::Empty))
}

#[tokio::test]
async fn run_sends_the_full_list_once_then_changes_only() {
    let dir = TempDir::new();
    let file = dir.write("svc.yaml", &svc("web", "198.19.96.1"));
    let (tx, mut rx) = mpsc::channel(16);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run(dir.0.clone(), Duration::from_millis(20), tx, async {
        let _ = stop_rx.await;
    }));

    match next(&mut rx).await {
        SourceEvent::ReplaceAll { services, slices } => {
            assert_eq!(services.len(), 1);
            assert!(slices.is_empty());
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(next(&mut rx).await, SourceEvent::Synced);

    // Looks that find nothing new send nothing.
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(quiet(&mut rx));

    fs::write(
        &file,
        [svc("web", "198.19.96.1"), svc("api", "198.19.96.2")].join("---\n"),
    )
    .unwrap();
    assert_eq!(lines(&[next(&mut rx).await]), ["svc shop/api 198.19.96.2"]);

    // A broken new file is reported (logged), and changes nothing.
    dir.write("z.yaml", "kind: [\n");
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(quiet(&mut rx));

    fs::remove_file(dir.0.join("svc.yaml")).unwrap();
    let gone = lines(&[next(&mut rx).await, next(&mut rx).await]);
    assert_eq!(gone, ["svc shop/api -", "svc shop/web -"]);

    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("run stops on shutdown")
        .unwrap();
}

/// inotify wakes the look: with a poll of an hour, a change still arrives at once.
#[tokio::test]
async fn a_change_is_seen_before_the_next_poll() {
    let dir = TempDir::new();
    dir.write("a.yaml", &svc("web", "198.19.96.1"));
    let (tx, mut rx) = mpsc::channel(16);
    let task = tokio::spawn(run(
        dir.0.clone(),
        Duration::from_secs(3600),
        tx,
        std::future::pending(),
    ));
    assert!(matches!(
        next(&mut rx).await,
        SourceEvent::ReplaceAll { .. }
    ));
    assert_eq!(next(&mut rx).await, SourceEvent::Synced);

    // Written as the benchmark and kubectl-like tools do: a temporary file renamed over.
    let tmp = dir.write("a.tmp", &svc("web", "198.19.96.2"));
    fs::rename(&tmp, dir.0.join("a.yaml")).unwrap();
    let started = std::time::Instant::now();
    assert_eq!(lines(&[next(&mut rx).await]), ["svc shop/web 198.19.96.2"]);
    assert!(started.elapsed() < Duration::from_secs(5));
    task.abort();
}

#[tokio::test]
async fn run_on_a_single_file_that_appears_later() {
    let dir = TempDir::new();
    let file = dir.0.join("later.yaml");
    let (tx, mut rx) = mpsc::channel(16);
    let task = tokio::spawn(run(
        file.clone(),
        Duration::from_millis(20),
        tx,
        std::future::pending(),
    ));

    match next(&mut rx).await {
        SourceEvent::ReplaceAll { services, .. } => assert!(services.is_empty()),
        other => panic!("{other:?}"),
    }
    assert_eq!(next(&mut rx).await, SourceEvent::Synced);
    fs::write(&file, svc("web", "198.19.96.1")).unwrap();
    assert_eq!(lines(&[next(&mut rx).await]), ["svc shop/web 198.19.96.1"]);
    task.abort();
}

/// The poll's scan of the folder runs beside looks by name: it brings in what they missed,
/// and what they saw after it began wins over it (a file created meanwhile is not gone, a
/// file removed meanwhile does not come back).
#[test]
fn a_scan_folds_in_what_looks_by_name_missed_and_nothing_they_saw() {
    let dir = TempDir::new();
    let write = |name: &str, doc: &str| {
        let tmp = dir.write(&format!("{name}.tmp"), doc);
        fs::rename(tmp, dir.0.join(name)).unwrap();
    };
    write("a.yaml", &svc("a", "198.19.96.1"));
    write("b.yaml", &svc("b", "198.19.96.2"));
    let mut state = Manifests::default();
    let mut known = fingerprint(&dir.0);
    state.refresh(&known, &[]);

    // a changes and its event is missed; then the scan lists the folder.
    write("a.yaml", &svc("a", "198.19.96.3"));
    let scan = fingerprint(&dir.0);
    // Meanwhile c is created and b removed, each looked at by name.
    write("c.yaml", &svc("c", "198.19.96.4"));
    fs::remove_file(dir.0.join("b.yaml")).unwrap();
    let names: BTreeSet<OsString> = ["b.yaml", "c.yaml"].map(OsString::from).into();
    let named = known.update_named(&dir.0, names);
    let by_name = state.refresh_named(&named, &[]).expect("b and c changed");
    assert_eq!(
        lines(&by_name.events),
        ["svc shop/b -", "svc shop/c 198.19.96.4"]
    );

    let seen: HashSet<PathBuf> = named.into_iter().map(|(f, _)| f).collect();
    let changed = known.fold_scan(scan, &seen);
    assert_eq!(changed.len(), 1, "only a: {changed:?}");
    let folded = state.refresh_named(&changed, &[]).expect("a changed");
    assert_eq!(lines(&folded.events), ["svc shop/a 198.19.96.3"]);
    assert_eq!(known, fingerprint(&dir.0));
    assert_eq!(folded.services, 2);

    // Nothing changed since: a scan folds in nothing.
    let again = fingerprint(&dir.0);
    assert!(known.fold_scan(again, &HashSet::new()).is_empty());
}

#[test]
fn the_poll_scans_at_most_two_percent_of_the_time_while_inotify_watches() {
    let ms = Duration::from_millis;
    // A quick scan: every tick.
    assert!(poll_due(ms(500), ms(1), true));
    // 50 ms scans: not before 2.5 s.
    assert!(!poll_due(ms(500), ms(50), true));
    assert!(poll_due(ms(2500), ms(50), true));
    // Without inotify the poll is all there is: every tick.
    assert!(poll_due(ms(500), ms(50), false));
}

/// ServiceCIDR manifests: every file's, sent as one list when any changed (a bad one is
/// reported, naming its field), and nothing when none did; the first list carries them
/// before Synced.
#[test]
fn service_cidrs_are_sent_as_one_list_when_they_change() {
    let cidr = |name: &str, cidrs: &str| {
        format!(
            "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {{name: {name}}}\n\
             spec: {{cidrs: [{cidrs}]}}\n"
        )
    };
    let ranges = |events: &[SourceEvent]| -> Vec<Vec<String>> {
        (events.iter())
            .filter_map(|ev| match ev {
                SourceEvent::ReplaceServiceCidrs(list) => Some(
                    (list.iter().flat_map(|(_, c)| c))
                        .map(ToString::to_string)
                        .collect(),
                ),
                _ => None,
            })
            .collect()
    };
    let dir = TempDir::new();
    dir.write(
        "a.yaml",
        &[
            svc("web", "198.19.96.1"),
            cidr("kubernetes", "198.19.0.0/16"),
        ]
        .join("---\n"),
    );
    dir.write("b.yaml", &cidr("extra", "198.18.128.0/24, 2001:db8::/112"));
    let mut state = Manifests::default();
    let first = state.refresh(&fingerprint(&dir.0), &[]);
    let list = Manifests::first_list(first.events);
    assert_eq!(
        ranges(&list),
        [["198.19.0.0/16", "198.18.128.0/24", "2001:db8::/112"]]
    );
    assert!(matches!(list.last(), Some(SourceEvent::Synced)));

    // A service changes, the ranges do not: no list of them.
    let tmp = dir.write(
        "a.tmp",
        &[
            svc("web", "198.19.96.2"),
            cidr("kubernetes", "198.19.0.0/16"),
        ]
        .join("---\n"),
    );
    fs::rename(tmp, dir.0.join("a.yaml")).unwrap();
    let read = state.refresh(&fingerprint(&dir.0), &[]);
    assert!(ranges(&read.events).is_empty(), "{:?}", read.events);

    // One goes bad: reported, and its ranges leave.
    let tmp = dir.write("b.tmp", &cidr("extra", "198.18.128.0/33"));
    fs::rename(tmp, dir.0.join("b.yaml")).unwrap();
    let read = state.refresh(&fingerprint(&dir.0), &[]);
    assert_eq!(ranges(&read.events), [["198.19.0.0/16"]]);
    let e = read
        .errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    assert!(e.contains("ServiceCIDR extra: spec.cidrs[0]"), "{e}");
}
