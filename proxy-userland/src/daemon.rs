//! The daemon: a source feeding the change tracker, the bounded-frequency runner deciding
//! when to sync, and the dataplane doing it. Returns when `shutdown` resolves, after the
//! dataplane has been torn down.

use std::{collections::BTreeSet, future::Future, path::PathBuf, sync::Arc, time::Instant};

use anyhow::Context as _;
use tokio::sync::{mpsc, watch};
use tracing::{debug, error, info, warn};

use crate::{
    config::{self, Args},
    dataplane::{Dataplane, Proxier, Scope, bpf::BpfDataplane},
    model::{NodeInfo, ServiceKey, tracker::ChangeTracker},
    source::{
        SourceEvent,
        file::{self, Loaded},
        kube::{self, KubeConfig},
    },
    sync::{BoundedFrequency, SyncPeriods, runner::Due},
};

pub async fn run(args: Args, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let cgroup: PathBuf = match &args.cgroup_path {
        Some(p) => p.clone(),
        None => config::cgroup2_mount()
            .context("no cgroup2 file system is mounted; mount one or pass --cgroup-path")?,
    };
    let mut node = NodeInfo { name: args.node_name(), zone: args.zone.clone() };
    info!(node = %node.name, "starting fastpath");

    // The source first: a bad kubeconfig should fail before anything touches the kernel.
    let (events_tx, mut events) = mpsc::channel(1024);
    let (stop_tx, stop_rx) = watch::channel(());
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.changed().await;
        }
    };
    let source = match &args.manifests {
        Some(path) => {
            info!(path = %path.display(), "reading Services and EndpointSlices from manifests");
            spawn_file_source(path.clone(), args.manifest_poll_period, events_tx, stopped())
        }
        None => {
            let cfg = KubeConfig { kubeconfig: args.kubeconfig.clone(), master: args.master.clone() };
            let client = kube::client(&cfg).await?;
            info!("watching Services and EndpointSlices on the API server");
            tokio::spawn(kube::run(
                client,
                node.name.clone(),
                args.service_proxy_name.clone(),
                events_tx,
                stopped(),
            ))
        }
    };

    let dataplane = BpfDataplane::attach(&cgroup)
        .with_context(|| format!("cannot start the eBPF dataplane on {}", cgroup.display()))?;
    info!(cgroup = %cgroup.display(), "eBPF socket load-balancing attached");
    let mut proxier = Proxier::Bpf(dataplane);

    let periods = SyncPeriods { min: args.min_sync_period, max: args.sync_period, ..Default::default() };
    let mut runner = BoundedFrequency::new(periods, Instant::now());
    let mut tracker = ChangeTracker::new();
    // Nothing is programmed until the source has delivered its first full lists, so a
    // restart never briefly drops services that simply have not been read yet.
    let mut listed = false;
    let mut synced_once = false;
    let mut full_pending = false;
    let mut retry: BTreeSet<ServiceKey> = BTreeSet::new();

    tokio::pin!(shutdown);
    loop {
        let (at, due) = runner.next_run();
        tokio::select! {
            _ = &mut shutdown => break,
            ev = events.recv() => {
                let Some(ev) = ev else {
                    warn!("the source stopped");
                    break;
                };
                match ev {
                    SourceEvent::Synced => listed = true,
                    SourceEvent::Node(info) => {
                        if info != node {
                            info!(zone = ?info.zone, "node information changed; resyncing everything");
                            node = info;
                            full_pending = true;
                        }
                    }
                    other => apply(&mut tracker, other),
                }
                if tracker.has_changes() || full_pending || (listed && !synced_once) {
                    runner.trigger();
                }
            }
            _ = tokio::time::sleep_until(at.into()), if listed => {
                let started = Instant::now();
                let changes = tracker.take_changes();
                let mut keys = changes.changed;
                keys.append(&mut retry);
                let full = due == Due::Periodic || !synced_once || std::mem::take(&mut full_pending);
                let scope = if full { Scope::Full } else { Scope::Changed(&keys) };
                let report = proxier.sync(&changes.state, &node, scope);
                for (key, err) in &report.failed {
                    error!(service = %key, "cannot program service: {err}");
                    retry.insert(key.clone());
                }
                runner.ran(due, started, !report.failed.is_empty());
                let took = started.elapsed();
                if !synced_once {
                    info!(
                        services = changes.state.services.len(),
                        frontends = report.frontends_written,
                        ?took,
                        "initial sync done; proxy is ready"
                    );
                    synced_once = true;
                } else if report.frontends_written + report.frontends_removed > 0 {
                    info!(written = report.frontends_written, removed = report.frontends_removed,
                        ?took, "service frontends updated");
                } else {
                    debug!(?due, services = report.services_synced, ?took, "sync found nothing to change");
                }
            }
        }
    }

    let _ = stop_tx.send(());
    if let Err(e) = source.await {
        warn!("the source ended badly: {e}");
    }
    drop(proxier);
    info!("eBPF programs detached and maps released; bye");
    Ok(())
}

fn apply(tracker: &mut ChangeTracker, ev: SourceEvent) {
    match ev {
        SourceEvent::ReplaceAll { services, slices } => tracker.replace_all(services, slices),
        SourceEvent::ReplaceServices(services) => tracker.replace_services(services),
        SourceEvent::ReplaceSlices(slices) => tracker.replace_slices(slices),
        SourceEvent::Service { key, service } => tracker.apply_service(key, service),
        SourceEvent::Slice { owner: Some(owner), name, slice, .. } => {
            tracker.apply_slice(owner, name, slice)
        }
        SourceEvent::Slice { namespace, owner: None, name, .. } => {
            tracker.forget_slice(&namespace, &name)
        }
        SourceEvent::Node(_) | SourceEvent::Synced => {}
    }
}

/// The manifest source as events: every re-read is one full replacement, and the first one
/// is also the initial list.
fn spawn_file_source(
    path: PathBuf,
    poll: std::time::Duration,
    tx: mpsc::Sender<SourceEvent>,
    stopped: impl Future<Output = ()> + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    let (loaded_tx, mut loaded_rx) = watch::channel(Arc::new(Loaded::default()));
    tokio::spawn(async move {
        let watcher = tokio::spawn(file::watch(path, poll, loaded_tx, stopped));
        let mut first = true;
        while loaded_rx.changed().await.is_ok() {
            let loaded = loaded_rx.borrow_and_update().clone();
            let ev = SourceEvent::ReplaceAll {
                services: loaded.services.clone(),
                slices: loaded.slices.clone(),
            };
            if tx.send(ev).await.is_err() || (first && tx.send(SourceEvent::Synced).await.is_err())
            {
                break;
            }
            first = false;
        }
        let _ = watcher.await;
    })
}
