//! The daemon's wiring: a source feeding the sync engine (its own thread: change tracker,
//! bounded-frequency runner, dataplane; see [`crate::sync::engine`]), the admin and health
//! check servers, and what the engine reports going to them. Returns when `shutdown`
//! resolves, after the dataplane has been torn down.

use std::future::Future;

use anyhow::Context as _;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, info, warn};

use crate::{
    admin::{self, AdminState, healthcheck::HealthCheckServers},
    config::Args,
    dataplane::{self, Dataplane, StartOptions},
    events::EventRecorder,
    model::NodeInfo,
    node_setup,
    source::{
        kube::{self, KubeConfig},
        manifests,
    },
    sync::{Engine, EngineConfig, SyncPeriods, report::Reports},
};

pub async fn run(args: Args, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    if args.cleanup {
        // Tools and netlink block: not on the runtime.
        return tokio::task::spawn_blocking(move || cleanup(&args))
            .await
            .context("--cleanup")?;
    }
    let node = NodeInfo {
        name: args.node_name(),
        zone: args.zone.clone(),
    };
    info!(node = %node.name, "starting fastpath");
    match args.node_setup() {
        Some(setup) => node_setup::apply_to_node(&setup),
        None => debug!("node set-up is off (--node-setup or fastpath.nodeSetup turn it on)"),
    }

    // The source first: a bad kubeconfig should fail before anything touches the kernel.
    let (events_tx, events) = mpsc::channel(1024);
    let (stop_tx, stop_rx) = watch::channel(());
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.changed().await;
        }
    };
    // The admin state first: the Kubernetes source reports the node's eligibility to it.
    let admin = AdminState::new(args.health_timeout());
    let mut recorder = EventRecorder::disabled();
    let mut node_client = None;
    let source = match &args.manifests {
        Some(path) => {
            info!(path = %path.display(), "reading Services and EndpointSlices from manifests");
            let watch = manifests::run(
                path.clone(),
                args.manifest_poll_period,
                events_tx,
                stopped(),
            );
            on_own_thread("manifests", watch).context("cannot start the manifest source")?
        }
        None => {
            let cfg = KubeConfig {
                kubeconfig: args.kubeconfig.clone(),
                master: args.master.clone(),
            };
            let client = kube::client(&cfg).await?;
            info!("watching Services and EndpointSlices on the API server");
            recorder = EventRecorder::new(client.clone(), &node.name);
            node_client = Some(client.clone());
            tokio::spawn(kube::run(
                client,
                node.name.clone(),
                args.service_proxy_name.clone(),
                recorder.clone(),
                admin.clone(),
                events_tx,
                stopped(),
            ))
        }
    };

    // Health is served before the dataplane loads, so probes see a slow start as such. The
    // first sync is pending from the start: a proxy that never manages one turns unhealthy.
    admin.queued();
    admin
        .debug
        .set_context(admin::debug::DebugContext::from_args(&args));
    let admin_tasks = admin::start(&args, &admin, &stopped).await?;
    let health_checks = HealthCheckServers::new(args.healthcheck_bind_address, admin.clone());

    // The mode: --proxy-mode (or the config file's), else the best the node can run.
    // Probing and loading block (bpf(), iptables), so not on the runtime.
    let primary = match primary_needed(&args) {
        true => resolve_primary(&args, node_client.as_ref(), &node.name).await?,
        false => Vec::new(),
    };
    let mut start = StartOptions::from_args(&args, &primary)
        .map_err(anyhow::Error::msg)
        .context("cannot start the dataplane")?;
    if args.detect_local_mode.as_deref() == Some(crate::config::LOCAL_MODE_NODE) {
        start.render.local_traffic = node_pod_cidrs(node_client.as_ref(), &node.name).await?;
    }
    // The engine starts first and builds the model from the source's lists while the
    // programs load (over a second at 50,000 services): the first sync starts as soon as
    // the dataplane is up. Its spacing depends on the mode, known only then.
    let cfg = EngineConfig {
        periods: SyncPeriods::default(),
        node,
        service_ranges: args.service_cluster_ip_range.clone(),
    };
    let (loaded, loading) = oneshot::channel();
    let (engine, engine_events) =
        Engine::spawn_loading(loading, cfg, events).context("cannot start the sync engine")?;
    let requested = args.proxy_mode.or(args.file_mode);
    let (proxier, decision) =
        tokio::task::spawn_blocking(move || dataplane::select_and_start(requested, &start))
            .await
            .context("starting the dataplane")??;
    admin.set_proxy_mode(proxier.name());
    let periods = SyncPeriods {
        min: args.min_sync_period_for(decision.mode),
        max: args.sync_period,
        ..Default::default()
    };
    if let Err((unused, _)) = loaded.send((proxier, periods)) {
        // The engine stopped while it loaded (the source ended): take it down as the
        // engine would have; what follows reports why.
        let _ = tokio::task::spawn_blocking(move || unused.teardown()).await;
    }
    let reports = Reports {
        admin: admin.clone(),
        health_checks,
        recorder,
    };
    let mut reports = tokio::spawn(reports.run(engine_events));

    tokio::pin!(shutdown);
    // The engine ends by itself only when the source stopped (or it failed).
    tokio::select! {
        _ = &mut shutdown => {}
        _ = &mut reports => {}
    }
    // Stops the engine (after a sync under way) and tears the dataplane down; then its
    // reports channel closes and the health check servers come back to be closed.
    let clean = engine.shutdown().await;
    let health_checks = reports.await;
    let _ = stop_tx.send(());
    drop(health_checks);
    for task in admin_tasks {
        let _ = task.await;
    }
    if let Err(e) = source.await {
        warn!("the source ended badly: {e}");
    }
    if clean.is_err() {
        anyhow::bail!("the sync engine failed; see the log above");
    }
    info!("bye");
    Ok(())
}

/// Runs `task` on a thread of its own, with a runtime of its own; the handle ends when it
/// does. For the manifest source: a file written wakes this thread, which does little
/// else, instead of a worker of the shared runtime. Under the daemon bench's load
/// (`perf sched`, 9 s) the shared workers waited over 0.5 ms for a CPU 30 times, up to 3.4
/// ms; the sync engine's own thread never did. In six interleaved runs on a busy machine
/// the p99 from a manifest's rename was 2.8-9.5 ms (median 3.7) this way, 2.9-8.5 ms
/// (median 4.6) on the shared workers.
fn on_own_thread(
    name: &str,
    task: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            rt.block_on(task);
            let _ = done_tx.send(());
        })?;
    let name = name.to_owned();
    Ok(tokio::spawn(async move {
        if done_rx.await.is_err() {
            warn!("the {name} thread ended without finishing (a panic?)");
        }
    }))
}

/// How long start-up waits for the Node to get its pod CIDRs (kube-proxy's
/// timeoutForNodePodCIDR).
const POD_CIDR_WAIT: std::time::Duration = std::time::Duration::from_secs(5 * 60);

/// `--detect-local-mode NodeCIDR`: the Node's pod CIDRs, read once at start-up as
/// kube-proxy does (it restarts when they change; see docs/modes.md).
async fn node_pod_cidrs(
    client: Option<&::kube::Client>,
    node_name: &str,
) -> anyhow::Result<dataplane::iptables::render::LocalTraffic> {
    let Some(client) = client else {
        anyhow::bail!(
            "--detect-local-mode NodeCIDR reads the Node's spec.podCIDRs from the API server; \
             the manifest source has no Node"
        );
    };
    info!(
        node = node_name,
        "waiting for the Node's pod CIDRs (--detect-local-mode NodeCIDR)"
    );
    let cidrs = kube::node_pod_cidrs(client.clone(), node_name, POD_CIDR_WAIT)
        .await
        .map_err(anyhow::Error::msg)
        .context("--detect-local-mode NodeCIDR")?;
    let parsed = cidrs
        .iter()
        .map(|c| {
            crate::model::convert::parse_cidr(c)
                .map_err(|e| anyhow::anyhow!("Node {node_name}: spec.podCIDRs {c:?}: {e}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    info!(node = node_name, pod_cidrs = ?cidrs, "pods' traffic is told apart by the Node's pod CIDRs");
    Ok(dataplane::iptables::render::LocalTraffic::Cidrs(parsed))
}

fn primary_needed(args: &Args) -> bool {
    args.node_port_addresses
        .contains(&crate::config::NodePortAddress::Primary)
}

/// How long start-up waits for the Node before `primary` falls back to the default
/// route's device: a node whose kubelet has not registered yet still gets a proxy.
const NODE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// `--nodeport-addresses primary` as CIDRs: --bind-address, else the Node's addresses
/// (kube source), else the default route's device (the file source, or no Node in time).
async fn resolve_primary(
    args: &Args,
    client: Option<&::kube::Client>,
    node_name: &str,
) -> anyhow::Result<Vec<(std::net::IpAddr, u8)>> {
    use dataplane::primary::{PrimarySources, node_host_ips, resolve};
    let node_ips = match client {
        Some(client) => {
            let get = kube::node_addresses(client.clone(), node_name);
            match tokio::time::timeout(NODE_WAIT, get).await {
                Ok(Some(addrs)) => Some(node_host_ips(
                    addrs.iter().map(|(t, a)| (t.as_str(), a.as_str())),
                )),
                Ok(None) => None,
                Err(_) => {
                    warn!("no answer for Node {node_name} within {NODE_WAIT:?}");
                    None
                }
            }
        }
        _ => None,
    };
    let sources = PrimarySources {
        bind_address: args.bind_address,
        node_ips,
    };
    let netns = args.netns.clone();
    // Reading the routes may enter a network namespace on a thread: not on the runtime.
    tokio::task::spawn_blocking(move || {
        resolve(sources, || {
            dataplane::bpf::devices::default_route_addresses(netns.as_deref())
        })
    })
    .await
    .context("resolving --nodeport-addresses primary")?
    .map_err(anyhow::Error::new)
}

/// `--cleanup`: remove every mode's leftovers on this node (or in --netns), then exit.
fn cleanup(args: &Args) -> anyhow::Result<()> {
    // "ebpf" as the mode to keep makes it remove the iptables and userspace chains and
    // kube-proxy's state of any mode; the pins go below, wherever --bpf-pin-dir put them.
    dataplane::mode::cleanup_leftovers(
        dataplane::mode::Mode::Ebpf,
        args.netns.as_deref(),
        args.bpf_pin_dir.as_deref(),
    );
    // The default pin folder is node-wide, so a namespaced clean-up leaves it to the
    // node's own; one named with --bpf-pin-dir was asked for, wherever the proxier ran.
    if args.netns.is_none() || args.bpf_pin_dir.is_some() {
        let pins = args
            .bpf_pin_dir
            .clone()
            .unwrap_or_else(|| dataplane::mode::BPF_PIN_DIR.into());
        dataplane::bpf::loader::remove_pinned(&pins)?;
        info!(pins = %pins.display(), "removed pinned eBPF programs and maps");
    }
    info!("clean-up done");
    Ok(())
}
