//! The sync engine: the change tracker, the bounded-frequency runner, retries and the
//! dataplane, on a thread of their own.
//!
//! A sync may block for seconds (iptables-restore, sock_diag, map writes on a busy node), so
//! it never runs on the tokio runtime that serves health checks and watches the API server.
//! The async side talks to the engine through channels only: [`SourceEvent`]s in (the same
//! bounded channel the sources write to, so a busy engine slows the sources down instead of
//! queueing without limit), [`EngineEvent`]s out (what the admin side, the health check
//! servers and Events need; see [`super::report`]).
//!
//! The engine waits with a small current-thread tokio runtime of its own, only to select over
//! the input channel, the stop signal and the next sync's deadline; the sync itself runs
//! outside it.

use std::{
    collections::BTreeSet,
    io,
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use tokio::sync::{mpsc, oneshot};
use tracing::{debug, error, info, warn};

use super::{BoundedFrequency, SyncPeriods, local_policy::LocalPolicy, runner::Due};
use crate::{
    admin::{SyncRecord, healthcheck},
    dataplane::{
        Dataplane, Scope,
        bpf::maps::{CensusThread, LruCounts, Occupancy},
    },
    model::{
        Cidr, NodeInfo, ProxyState, ServiceKey, service_cidr::ServiceRangeSources,
        tracker::ChangeTracker,
    },
    source::SourceEvent,
};

/// How many queued source events the engine applies before it looks at its schedule again,
/// so a flood of events cannot postpone a due sync for long.
const DRAIN_MAX: usize = 1024;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub periods: SyncPeriods,
    /// The node as known at start; [`SourceEvent::Node`] updates it.
    pub node: NodeInfo,
    /// `--service-cluster-ip-range`; ServiceCIDR objects add theirs.
    pub service_ranges: Vec<Cidr>,
}

/// What the engine tells the async side.
#[derive(Debug)]
pub enum EngineEvent {
    /// Source events were applied. `pending`: they changed something a sync has yet to
    /// program. The totals are the tracker's so far.
    Received {
        pending: bool,
        services_changed_total: u64,
        endpoints_changed_total: u64,
    },
    /// A sync ran.
    Synced(Box<SyncOutcome>),
    /// The kernel-filled maps were counted (every [`CENSUS_PERIOD`](crate::dataplane::bpf::maps::CENSUS_PERIOD)); the other entries
    /// are the last sync's.
    Occupancy(Occupancy),
}

/// One sync, as the async side needs it.
#[derive(Debug)]
pub struct SyncOutcome {
    /// For [`crate::admin::AdminState::synced`].
    pub record: SyncRecord,
    /// Services that could not be programmed, and why; they are retried.
    pub failed: Vec<(ServiceKey, String)>,
    /// The health check node ports this node should serve now.
    pub health_checks: healthcheck::Desired,
    /// The model this sync programmed, and the node it was programmed for.
    pub state: ProxyState,
    pub node: NodeInfo,
}

#[derive(Debug, thiserror::Error)]
#[error("the sync engine panicked")]
pub struct EnginePanicked;

/// The engine's thread. Dropping the handle stops the engine without waiting for it.
pub struct Engine {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Starts the engine on its own thread, driving `dataplane` from `input`. The returned
    /// receiver yields what it did; it closes when the engine has stopped and torn the
    /// dataplane down (told to, or because `input` closed).
    pub fn spawn<D>(
        dataplane: D,
        cfg: EngineConfig,
        input: mpsc::Receiver<SourceEvent>,
    ) -> io::Result<(Engine, mpsc::UnboundedReceiver<EngineEvent>)>
    where
        D: Dataplane + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let periods = cfg.periods;
        let _ = tx.send((dataplane, periods));
        Self::spawn_loading(rx, cfg, input)
    }

    /// As [`spawn`](Self::spawn), with the dataplane (and the sync periods its mode calls
    /// for) still loading: until it arrives the engine takes the source's events, so the
    /// model is built while the programs load and the first sync can start at once. If the
    /// sender is dropped instead, the engine stops.
    pub fn spawn_loading<D>(
        dataplane: oneshot::Receiver<(D, SyncPeriods)>,
        cfg: EngineConfig,
        mut input: mpsc::Receiver<SourceEvent>,
    ) -> io::Result<(Engine, mpsc::UnboundedReceiver<EngineEvent>)>
    where
        D: Dataplane + Send + 'static,
    {
        let (stop_tx, mut stop_rx) = oneshot::channel();
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()?;
        let thread = std::thread::Builder::new()
            .name("sync-engine".into())
            .spawn(move || {
                // Held until the dataplane is down: the channel closing says it is.
                let out = out_tx.clone();
                let occupancy = Arc::new(Mutex::new(Occupancy::default()));
                let mut lp = Loop::new(cfg, out_tx.clone(), occupancy.clone());
                let Some((mut dataplane, periods)) =
                    lp.wait_for_dataplane(&rt, dataplane, &mut input, &mut stop_rx)
                else {
                    return;
                };
                lp.set_periods(periods);
                let census = start_census(&dataplane, &occupancy, &out_tx);
                lp.run(&rt, &mut dataplane, input, stop_rx);
                // Its map handles go before the dataplane does.
                drop(census);
                let mode = dataplane.name();
                dataplane.teardown();
                info!(mode, "dataplane stopped");
                drop(out);
            })?;
        Ok((
            Engine {
                stop: Some(stop_tx),
                thread: Some(thread),
            },
            out_rx,
        ))
    }

    /// Tells the engine to stop and waits (blocking) until it has torn the dataplane down.
    /// A sync under way finishes first. `Err` if the engine panicked.
    pub fn stop(mut self) -> Result<(), EnginePanicked> {
        self.signal();
        match self.thread.take().map(JoinHandle::join) {
            Some(Err(_)) => {
                error!("the sync engine panicked");
                Err(EnginePanicked)
            }
            _ => Ok(()),
        }
    }

    /// [`stop`](Self::stop), waited for on a blocking thread so the runtime keeps serving.
    pub async fn shutdown(self) -> Result<(), EnginePanicked> {
        tokio::task::spawn_blocking(move || self.stop())
            .await
            .unwrap_or(Err(EnginePanicked))
    }

    fn signal(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.signal();
    }
}

// Built once per wake-up and matched at once: boxing the event would only add an allocation.
#[allow(clippy::large_enum_variant)]
enum Wake {
    Stop,
    Closed,
    Event(SourceEvent),
    Due(Due),
    /// Time to hand back what was freed since the last full sync's purge.
    Purge,
}

/// How long after a full sync the engine returns freed heap pages a second time: jemalloc
/// keeps pages it frees for a second (main.rs), and what the sync's aftermath frees (the
/// decoded lists' last buffers, the old snapshot) would otherwise stay until the next
/// allocation-heavy moment, as the idle daemon has none.
const PURGE_AGAIN_AFTER: Duration = Duration::from_millis(1500);

/// The engine's state between wake-ups.
struct Loop {
    tracker: ChangeTracker,
    runner: BoundedFrequency,
    node: NodeInfo,
    out: mpsc::UnboundedSender<EngineEvent>,
    /// Nothing is programmed until the source has delivered its first full lists, so a
    /// restart never briefly drops services that simply have not been read yet.
    listed: bool,
    synced_once: bool,
    full_pending: bool,
    retry: BTreeSet<ServiceKey>,
    /// When the oldest change not yet programmed arrived (network programming latency).
    pending_since: Option<Instant>,
    /// When to return freed heap pages again, after a full sync.
    purge_at: Option<Instant>,
    /// Map entries: services and backends as the dataplane counts them at each sync, the
    /// kernel-filled maps as the census last counted them.
    occupancy: Arc<Mutex<Occupancy>>,
    local_policy: LocalPolicy,
    service_ranges: ServiceRangeSources,
}

impl Loop {
    fn new(
        cfg: EngineConfig,
        out: mpsc::UnboundedSender<EngineEvent>,
        occupancy: Arc<Mutex<Occupancy>>,
    ) -> Self {
        let service_ranges = ServiceRangeSources::new(cfg.service_ranges);
        let mut tracker = ChangeTracker::new();
        tracker.set_service_ranges(service_ranges.union());
        Loop {
            tracker,
            runner: BoundedFrequency::new(cfg.periods, Instant::now()),
            node: cfg.node,
            out,
            listed: false,
            synced_once: false,
            full_pending: false,
            retry: BTreeSet::new(),
            pending_since: None,
            purge_at: None,
            occupancy,
            local_policy: LocalPolicy::default(),
            service_ranges,
        }
    }

    /// Applies the source's events until the dataplane has loaded; `None` if told to stop,
    /// or if the source or the loader went away first.
    fn wait_for_dataplane<D>(
        &mut self,
        rt: &tokio::runtime::Runtime,
        mut dataplane: oneshot::Receiver<(D, SyncPeriods)>,
        input: &mut mpsc::Receiver<SourceEvent>,
        stop: &mut oneshot::Receiver<()>,
    ) -> Option<(D, SyncPeriods)> {
        let began = Instant::now();
        loop {
            let wake = rt.block_on(async {
                tokio::select! {
                    biased;
                    _ = &mut *stop => None,
                    loaded = &mut dataplane => Some(Err(loaded.ok())),
                    ev = input.recv() => Some(Ok(ev)),
                }
            });
            match wake? {
                Err(loaded) => {
                    debug!(waited = ?began.elapsed(), "the dataplane is up");
                    return loaded;
                }
                Ok(None) => {
                    warn!("the source stopped");
                    return None;
                }
                Ok(Some(ev)) => {
                    self.apply(ev);
                    self.drain(input);
                    self.after_events();
                }
            }
        }
    }

    /// The sync spacing of the mode the dataplane turned out to be; what the events taken
    /// meanwhile asked for is due at once.
    fn set_periods(&mut self, periods: SyncPeriods) {
        self.runner = BoundedFrequency::new(periods, Instant::now());
        if self.wants_sync() {
            self.runner.trigger();
        }
    }

    /// Whatever else is queued joins the same sync.
    fn drain(&mut self, input: &mut mpsc::Receiver<SourceEvent>) {
        for _ in 0..DRAIN_MAX {
            match input.try_recv() {
                Ok(ev) => self.apply(ev),
                Err(_) => break,
            }
        }
    }

    fn wants_sync(&self) -> bool {
        self.tracker.has_changes() || self.full_pending || (self.listed && !self.synced_once)
    }

    fn run<D: Dataplane>(
        mut self,
        rt: &tokio::runtime::Runtime,
        dp: &mut D,
        mut input: mpsc::Receiver<SourceEvent>,
        mut stop: oneshot::Receiver<()>,
    ) {
        loop {
            let next = self.listed.then(|| self.runner.next_run());
            let purge_at = self.purge_at;
            let wake = rt.block_on(async {
                let purge = async {
                    match purge_at {
                        Some(at) => tokio::time::sleep_until(at.into()).await,
                        None => std::future::pending().await,
                    }
                };
                let due = async {
                    match next {
                        Some((at, due)) => {
                            tokio::time::sleep_until(at.into()).await;
                            due
                        }
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    _ = &mut stop => Wake::Stop,
                    ev = input.recv() => ev.map_or(Wake::Closed, Wake::Event),
                    due = due => Wake::Due(due),
                    _ = purge => Wake::Purge,
                }
            });
            match wake {
                Wake::Stop => break,
                Wake::Closed => {
                    warn!("the source stopped");
                    break;
                }
                Wake::Event(ev) => {
                    self.apply(ev);
                    self.drain(&mut input);
                    self.after_events();
                }
                Wake::Due(due) => self.sync(dp, due),
                Wake::Purge => {
                    self.purge_at = None;
                    return_free_memory();
                }
            }
        }
    }

    fn apply(&mut self, ev: SourceEvent) {
        let t = &mut self.tracker;
        match ev {
            SourceEvent::Synced => self.listed = true,
            SourceEvent::Node(info) => {
                if info != self.node {
                    info!(zone = ?info.zone, "node information changed; resyncing everything");
                    self.node = info;
                    self.full_pending = true;
                }
            }
            SourceEvent::ReplaceServiceCidrs(objects) => {
                self.service_ranges.replace(objects);
                self.ranges_changed();
            }
            SourceEvent::ServiceCidr { name, cidrs } => {
                self.service_ranges.apply(name, cidrs);
                self.ranges_changed();
            }
            SourceEvent::ReplaceAll { services, slices } => {
                let began = Instant::now();
                t.replace_all(services, slices);
                debug!(took = ?began.elapsed(), "the model took a full list");
            }
            SourceEvent::ReplaceServices(services) => {
                let began = Instant::now();
                t.replace_services(services);
                debug!(took = ?began.elapsed(), "the model took a list of Services");
            }
            SourceEvent::ReplaceSlices(slices) => {
                let began = Instant::now();
                t.replace_slices(slices);
                debug!(took = ?began.elapsed(), "the model took a list of EndpointSlices");
            }
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
        }
    }

    /// The ranges concern no one service: a change is programmed by a full sync.
    fn ranges_changed(&mut self) {
        let ranges = self.service_ranges.union();
        if self.tracker.set_service_ranges(ranges.clone()) {
            let ranges: Vec<String> = ranges.cidrs().iter().map(ToString::to_string).collect();
            info!(?ranges, "service ranges changed; resyncing everything");
            self.full_pending = true;
        }
    }

    fn after_events(&mut self) {
        let changed = self.tracker.has_changes() || self.full_pending;
        if self.wants_sync() {
            self.runner.trigger();
        }
        if changed {
            self.pending_since.get_or_insert_with(Instant::now);
        }
        self.send(EngineEvent::Received {
            pending: changed,
            services_changed_total: self.tracker.services_changed_total(),
            endpoints_changed_total: self.tracker.endpoints_changed_total(),
        });
    }

    fn sync<D: Dataplane>(&mut self, dp: &mut D, due: Due) {
        let started = Instant::now();
        let changes = self.tracker.take_changes();
        let mut keys = changes.changed;
        keys.append(&mut self.retry);
        let full =
            due == Due::Periodic || !self.synced_once || std::mem::take(&mut self.full_pending);
        let scope = if full {
            Scope::Full
        } else {
            Scope::Changed(&keys)
        };
        let report = dp.sync(&changes.state, &self.node, scope);
        for (key, err) in &report.failed {
            error!(service = %key, "cannot program service: {err}");
            self.retry.insert(key.clone());
        }
        self.runner.ran(due, started, !report.failed.is_empty());
        self.local_policy
            .update(&changes.state, &self.node, (!full).then_some(&keys));
        let took = started.elapsed();
        let services = changes.state.services.len();
        let record = SyncRecord {
            took,
            full,
            failed: report.failed.len(),
            pending_since: self.pending_since.take(),
            occupancy: dp.occupancy().map(|counted| {
                let mut o = self.occupancy.lock().unwrap_or_else(|p| p.into_inner());
                o.services = counted.services;
                o.backends = counted.backends;
                o.affinity_match = counted.affinity_match;
                *o
            }),
            packet_stats: dp.packet_stats(),
            services,
            services_changed_total: self.tracker.services_changed_total(),
            endpoints_changed_total: self.tracker.endpoints_changed_total(),
            udp_socket_resets: (report.udp_sockets_reset, report.udp_socket_resets_failed),
            no_local_endpoints: self.local_policy.no_local_endpoints(),
        };
        let health_checks = self.local_policy.health_checks().clone();
        if !self.synced_once {
            info!(
                services,
                frontends = report.frontends_written,
                ?took,
                "initial sync done; proxy is ready"
            );
            self.synced_once = true;
        } else if report.frontends_written + report.frontends_removed > 0 {
            info!(
                written = report.frontends_written,
                removed = report.frontends_removed,
                ?took,
                "service frontends updated"
            );
        } else {
            debug!(
                ?due,
                services = report.services_synced,
                ?took,
                "sync found nothing to change"
            );
        }
        self.send(EngineEvent::Synced(Box::new(SyncOutcome {
            record,
            failed: report.failed,
            health_checks,
            state: changes.state,
            node: self.node.clone(),
        })));
        if full {
            // After the sync's own garbage (the keys of every service, at a full sync) is
            // gone too.
            drop(keys);
            return_free_memory();
            self.purge_at = Some(Instant::now() + PURGE_AGAIN_AFTER);
        }
    }

    fn send(&self, ev: EngineEvent) {
        // Nobody listening means the daemon is going away; the stop signal follows.
        let _ = self.out.send(ev);
    }
}

/// Starts counting the kernel-filled maps off the sync path, if the dataplane has any.
fn start_census<D: Dataplane>(
    dp: &D,
    shared: &Arc<Mutex<Occupancy>>,
    out: &mpsc::UnboundedSender<EngineEvent>,
) -> Option<CensusThread> {
    let census = dp.lru_census()?;
    let (shared, out) = (shared.clone(), out.clone());
    let report = move |c: LruCounts| {
        let snapshot = {
            let mut o = shared.lock().unwrap_or_else(|p| p.into_inner());
            o.sock_revnat = c.sock_revnat;
            o.affinity = c.affinity;
            o.conntrack = c.conntrack;
            *o
        };
        let _ = out.send(EngineEvent::Occupancy(snapshot));
    };
    census
        .spawn(report)
        .inspect_err(|e| warn!("cannot start counting the BPF maps: {e}"))
        .ok()
}

/// Gives the heap pages the allocators keep after frees back to the kernel. The first
/// lists (and a relist) decode every object at once, hundreds of MB at 50,000 services,
/// which are converted and dropped. jemalloc (the daemon's allocator, main.rs) keeps freed
/// pages for a second so that the next list page reuses them instead of faulting in zeroed
/// ones; once a full sync is done they are returned at once. glibc's malloc serves only
/// the C libraries now. Run after full syncs only: it walks every arena (a few ms at most).
fn return_free_memory() {
    // "arena.<all>.purge": MALLCTL_ARENAS_ALL is 4096 in jemalloc 5.
    const PURGE_ALL: &std::ffi::CStr = c"arena.4096.purge";
    // SAFETY: a purge takes no value and returns none, which mallctl is told by null
    // pointers and a zero length; the name is a NUL-terminated static string.
    let purged = unsafe {
        tikv_jemalloc_sys::mallctl(
            PURGE_ALL.as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        )
    };
    if purged != 0 {
        debug!(errno = purged, "jemalloc did not purge its arenas");
    }
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes glibc's own arena locks and has no preconditions; it only
    // releases pages no allocation uses.
    unsafe {
        libc::malloc_trim(0);
    }
}
