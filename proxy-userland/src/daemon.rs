//! The daemon: a source feeding the change tracker, the bounded-frequency runner deciding
//! when to sync, and the dataplane doing it. Returns when `shutdown` resolves, after the
//! dataplane has been torn down.

use std::{collections::BTreeSet, future::Future, path::PathBuf, sync::Arc, time::Instant};

use anyhow::Context as _;
use tokio::sync::{mpsc, watch};
use tracing::{debug, error, info, warn};

use crate::{
    admin::{
        self, AdminState, SyncRecord,
        healthcheck::{self, HealthCheckServers},
    },
    config::Args,
    dataplane::bpf::maps::Occupancy,
    dataplane::{self, Dataplane, Proxier, Scope, StartOptions},
    events::{self as k8s_events, EventRecorder},
    model::{NodeInfo, ServiceKey, tracker::ChangeTracker},
    node_setup,
    source::{
        SourceEvent,
        file::{self, Loaded},
        kube::{self, KubeConfig},
    },
    sync::{BoundedFrequency, SyncPeriods, runner::Due},
};

pub async fn run(args: Args, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    if args.cleanup {
        return cleanup(&args);
    }
    let mut node = NodeInfo {
        name: args.node_name(),
        zone: args.zone.clone(),
    };
    info!(node = %node.name, "starting fastpath");
    match args.node_setup() {
        Some(setup) => node_setup::apply_to_node(&setup),
        None => debug!("node set-up is off (--node-setup or fastpath.nodeSetup turn it on)"),
    }

    // The source first: a bad kubeconfig should fail before anything touches the kernel.
    let (events_tx, mut events) = mpsc::channel(1024);
    let (stop_tx, stop_rx) = watch::channel(());
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.changed().await;
        }
    };
    let mut recorder = EventRecorder::disabled();
    let source = match &args.manifests {
        Some(path) => {
            info!(path = %path.display(), "reading Services and EndpointSlices from manifests");
            spawn_file_source(
                path.clone(),
                args.manifest_poll_period,
                events_tx,
                stopped(),
            )
        }
        None => {
            let cfg = KubeConfig {
                kubeconfig: args.kubeconfig.clone(),
                master: args.master.clone(),
            };
            let client = kube::client(&cfg).await?;
            info!("watching Services and EndpointSlices on the API server");
            recorder = EventRecorder::new(client.clone(), &node.name);
            tokio::spawn(kube::run(
                client,
                node.name.clone(),
                args.service_proxy_name.clone(),
                recorder.clone(),
                events_tx,
                stopped(),
            ))
        }
    };

    // Health is served before the dataplane loads, so probes see a slow start as such. The
    // first sync is pending from the start: a proxy that never manages one turns unhealthy.
    let admin = AdminState::new(args.health_timeout());
    admin.queued();
    admin.debug.set_context(admin::debug::DebugContext::from_args(&args));
    let admin_tasks = admin::start(&args, &admin, &stopped).await?;
    let mut health_checks = HealthCheckServers::new(args.healthcheck_bind_address, admin.clone());

    // The mode: --proxy-mode (or the config file's), else the best the node can run.
    let start = StartOptions::from_args(&args)
        .map_err(anyhow::Error::msg)
        .context("cannot start the dataplane")?;
    let (mut proxier, _mode) =
        dataplane::select_and_start(args.proxy_mode.or(args.file_mode), &start)?;
    admin.set_proxy_mode(proxier.name());

    let periods = SyncPeriods {
        min: args.min_sync_period,
        max: args.sync_period,
        ..Default::default()
    };
    let mut runner = BoundedFrequency::new(periods, Instant::now());
    let mut tracker = ChangeTracker::new();
    // Nothing is programmed until the source has delivered its first full lists, so a
    // restart never briefly drops services that simply have not been read yet.
    let mut listed = false;
    let mut synced_once = false;
    let mut full_pending = false;
    let mut retry: BTreeSet<ServiceKey> = BTreeSet::new();
    // When the oldest change not yet programmed arrived (network programming latency).
    let mut pending_since: Option<Instant> = None;

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
                if tracker.has_changes() || full_pending {
                    pending_since.get_or_insert_with(Instant::now);
                    admin.queued();
                }
                admin.changes_seen(
                    tracker.services_changed_total(),
                    tracker.endpoints_changed_total(),
                );
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
                    let note = format!("cannot program the service: {err}; retrying");
                    let regarding = EventRecorder::service_ref(key);
                    recorder.warn(regarding, k8s_events::REASON_PROGRAM_FAILED, "Program", note);
                    retry.insert(key.clone());
                }
                runner.ran(due, started, !report.failed.is_empty());
                let took = started.elapsed();
                admin.synced(&SyncRecord {
                    took,
                    full,
                    failed: report.failed.len(),
                    pending_since: pending_since.take(),
                    occupancy: bpf_occupancy(&proxier),
                    packet_stats: packet_stats(&proxier),
                    services: changes.state.services.len(),
                    services_changed_total: tracker.services_changed_total(),
                    endpoints_changed_total: tracker.endpoints_changed_total(),
                    udp_socket_resets: (report.udp_sockets_reset, report.udp_socket_resets_failed),
                });
                admin.debug.publish(&changes.state, &node);
                let want = healthcheck::desired(&changes.state, &node);
                for (key, port, err) in health_checks.update(&want) {
                    let note = format!("cannot open health check node port {port}: {err}");
                    let regarding = EventRecorder::service_ref(&key);
                    let reason = k8s_events::REASON_PROGRAM_FAILED;
                    recorder.warn(regarding, reason, "OpenHealthCheckNodePort", note);
                }
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
    drop(health_checks);
    for task in admin_tasks {
        let _ = task.await;
    }
    if let Err(e) = source.await {
        warn!("the source ended badly: {e}");
    }
    let mode = proxier.name();
    proxier.shutdown();
    info!(mode, "dataplane stopped; bye");
    Ok(())
}

/// The packet path's counters, when the eBPF dataplane has it attached.
fn packet_stats(proxier: &Proxier) -> Option<crate::dataplane::bpf::maps::PacketStats> {
    match proxier {
        Proxier::Bpf(d) if d.node_devices().is_some() => Some(d.programmer().maps().packet_stats()),
        _ => None,
    }
}

/// Map occupancy for the metrics, from the dataplanes that have BPF maps.
fn bpf_occupancy(proxier: &Proxier) -> Option<Occupancy> {
    match proxier {
        Proxier::Bpf(d) => Some(d.programmer().occupancy()),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

/// `--cleanup`: remove every mode's leftovers on this node (or in --netns), then exit.
fn cleanup(args: &Args) -> anyhow::Result<()> {
    // "ebpf" as the mode to keep makes it remove the iptables and userspace chains; the
    // pins go below, wherever --bpf-pin-dir put them.
    crate::mode::cleanup_leftovers(crate::mode::Mode::Ebpf, args.netns.as_deref());
    if args.netns.is_none() {
        let pins = args
            .bpf_pin_dir
            .clone()
            .unwrap_or_else(|| crate::mode::BPF_PIN_DIR.into());
        dataplane::bpf::loader::remove_pinned(&pins)?;
        info!(pins = %pins.display(), "removed pinned eBPF programs and maps");
    }
    info!("clean-up done");
    Ok(())
}

fn apply(tracker: &mut ChangeTracker, ev: SourceEvent) {
    match ev {
        SourceEvent::ReplaceAll { services, slices } => tracker.replace_all(services, slices),
        SourceEvent::ReplaceServices(services) => tracker.replace_services(services),
        SourceEvent::ReplaceSlices(slices) => tracker.replace_slices(slices),
        SourceEvent::Service { key, service } => tracker.apply_service(key, service),
        SourceEvent::Slice {
            owner: Some(owner),
            name,
            slice,
            ..
        } => tracker.apply_slice(owner, name, slice),
        SourceEvent::Slice {
            namespace,
            owner: None,
            name,
            ..
        } => tracker.forget_slice(&namespace, &name),
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
