//! The daemon: a source feeding the change tracker, the bounded-frequency runner deciding
//! when to sync, and the dataplane doing it. Returns when `shutdown` resolves, after the
//! dataplane has been torn down.

use std::{collections::BTreeSet, future::Future, path::PathBuf, sync::Arc, time::Instant};

use anyhow::Context as _;
use tokio::sync::watch;
use tracing::{debug, error, info, warn};

use crate::{
    config::{self, Args},
    dataplane::{Dataplane, Proxier, Scope, bpf::BpfDataplane},
    model::{NodeInfo, ServiceKey, tracker::ChangeTracker},
    source::file::{self, Loaded},
    sync::{BoundedFrequency, SyncPeriods, runner::Due},
};

pub async fn run(args: Args, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let manifests = args
        .manifests
        .clone()
        .context("no source given: pass --manifests PATH (a YAML file or folder)")?;
    let cgroup: PathBuf = match &args.cgroup_path {
        Some(p) => p.clone(),
        None => config::cgroup2_mount()
            .context("no cgroup2 file system is mounted; mount one or pass --cgroup-path")?,
    };
    let node = NodeInfo { name: args.node_name(), zone: args.zone.clone() };
    info!(node = %node.name, "starting fastpath");

    let dataplane = BpfDataplane::attach(&cgroup)
        .with_context(|| format!("cannot start the eBPF dataplane on {}", cgroup.display()))?;
    info!(cgroup = %cgroup.display(), "eBPF socket load-balancing attached");
    let mut proxier = Proxier::Bpf(dataplane);

    let (loaded_tx, mut loaded_rx) = watch::channel(Arc::new(Loaded::default()));
    let (stop_tx, mut stop_rx) = watch::channel(());
    let source = tokio::spawn(file::watch(manifests, args.manifest_poll_period, loaded_tx, async move {
        let _ = stop_rx.changed().await;
    }));

    let periods = SyncPeriods { min: args.min_sync_period, max: args.sync_period, ..Default::default() };
    let mut runner = BoundedFrequency::new(periods, Instant::now());
    let mut tracker = ChangeTracker::new();
    // Nothing is programmed until the source has delivered its first full list, so a
    // restart never briefly drops services that simply have not been read yet.
    let mut listed = false;
    let mut synced_once = false;
    let mut retry: BTreeSet<ServiceKey> = BTreeSet::new();

    tokio::pin!(shutdown);
    loop {
        let (at, due) = runner.next_run();
        tokio::select! {
            _ = &mut shutdown => break,
            changed = loaded_rx.changed() => {
                if changed.is_err() {
                    warn!("the manifest source stopped");
                    break;
                }
                let loaded = loaded_rx.borrow_and_update().clone();
                tracker.replace_all(loaded.services.clone(), loaded.slices.clone());
                if !listed || tracker.has_changes() {
                    runner.trigger();
                }
                listed = true;
            }
            _ = tokio::time::sleep_until(at.into()), if listed => {
                let started = Instant::now();
                let changes = tracker.take_changes();
                let mut keys = changes.changed;
                keys.append(&mut retry);
                let full = due == Due::Periodic || !synced_once;
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
                } else {
                    debug!(?due, services = report.services_synced, written = report.frontends_written,
                        removed = report.frontends_removed, ?took, "sync done");
                    if report.frontends_written + report.frontends_removed > 0 {
                        info!(written = report.frontends_written, removed = report.frontends_removed,
                            ?took, "service frontends updated");
                    }
                }
            }
        }
    }

    let _ = stop_tx.send(());
    if let Err(e) = source.await {
        warn!("the manifest source ended badly: {e}");
    }
    drop(proxier);
    info!("eBPF programs detached and maps released; bye");
    Ok(())
}
