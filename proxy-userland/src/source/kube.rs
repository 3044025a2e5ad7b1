//! The Kubernetes source: kube-rs watchers on v1 Services, discovery.k8s.io/v1
//! EndpointSlices, networking.k8s.io/v1 ServiceCIDRs (where the API server has them) and
//! this node's Node, turned into [`SourceEvent`]s.
//!
//! The watchers list, then watch from the list's resourceVersion, re-watch after a dropped
//! connection and relist at once after 410 Gone; other errors wait as [`super::backoff`]
//! says (at most 2 s, reset by any success), so a change made while the API server was
//! away is programmed within seconds of its return. A relist
//! arrives as Init, InitApply..., InitDone; we buffer it and hand the tracker one full
//! replacement, so objects deleted while we were not watching disappear too. Nothing is
//! programmed until Services and EndpointSlices have both finished their first list
//! (kube-proxy's OnServiceSynced / OnEndpointSlicesSynced).
//!
//! The Node watch also decides whether this node should still get load-balancer traffic
//! (kube-proxy's node eligibility, [`node_eligible`]), which /healthz reports.

use std::{future::Future, path::PathBuf, sync::Arc, time::Instant};

use futures::{Stream, StreamExt};
use k8s_openapi::api::{core::v1, discovery::v1::EndpointSlice, networking::v1::ServiceCIDR};
use kube::{
    Api, Client, Config, Resource, ResourceExt,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::watcher,
};
use tokio::sync::mpsc;
use tracing::{error, info, warn};

use super::{
    SourceEvent,
    backoff::with_backoff,
    lazy::{self, Decoded, Lazy, Malformed},
};
use crate::{
    admin::AdminState,
    events::{self, EventRecorder},
    model::{NodeInfo, ServiceKey, convert, service_cidr},
};

/// The label kube-proxy uses to let another proxy own a service.
const SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
const HEADLESS: &str = "service.kubernetes.io/headless";
const ZONE: &str = "topology.kubernetes.io/zone";
/// The taint the cluster autoscaler puts on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// kube-proxy's node eligibility (proxy_health.go SyncNode): a node being deleted, or
/// tainted for deletion by the cluster autoscaler, should be drained from load balancers.
pub fn node_eligible(node: &v1::Node) -> bool {
    let deleting = node.metadata.deletion_timestamp.is_some();
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
    !deleting && !tainted
}

#[derive(Clone, Debug, Default)]
pub struct KubeConfig {
    /// A kubeconfig file; without one, in-cluster config (or $KUBECONFIG, ~/.kube/config).
    pub kubeconfig: Option<PathBuf>,
    /// Overrides the API server URL from the kubeconfig.
    pub master: Option<String>,
}

/// A client from a kubeconfig, the in-cluster service account, or the usual fallbacks.
pub async fn client(cfg: &KubeConfig) -> anyhow::Result<Client> {
    use anyhow::Context as _;
    let mut config = match &cfg.kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("invalid kubeconfig {}", path.display()))?
        }
        None => Config::infer()
            .await
            .context("no in-cluster config and no kubeconfig found")?,
    };
    if let Some(master) = &cfg.master {
        config.cluster_url = master
            .parse()
            .with_context(|| format!("--master {master:?} is not a URL"))?;
    }
    Client::try_from(config).context("cannot build a Kubernetes client")
}

/// The label selector both watchers use, as kube-proxy's informers do: skip headless
/// services and services that belong to another proxy.
pub fn label_selector(proxy_name: Option<&str>) -> String {
    match proxy_name {
        Some(name) => format!("{SERVICE_PROXY_NAME}={name},!{HEADLESS}"),
        None => format!("!{SERVICE_PROXY_NAME},!{HEADLESS}"),
    }
}

/// Runs the three watchers until `shutdown` resolves or the receiver goes away. Objects
/// that cannot be converted get a Warning Event through `events`; the node's eligibility
/// goes straight to `admin` (it changes what /healthz answers, not what is programmed).
/// The addresses of Node `name` (status.addresses as (type, address)), read once; None if
/// it cannot be read. For `--nodeport-addresses primary`, decided before the dataplane
/// starts, so it does not wait for the watch.
pub async fn node_addresses(client: Client, name: &str) -> Option<Vec<(String, String)>> {
    match Api::<v1::Node>::all(client).get(name).await {
        Ok(node) => Some(
            node.status
                .and_then(|s| s.addresses)
                .unwrap_or_default()
                .into_iter()
                .map(|a| (a.type_, a.address))
                .collect(),
        ),
        Err(e) => {
            warn!("reading Node {name} for its addresses: {e}");
            None
        }
    }
}

/// The pod CIDRs of Node `name` (spec.podCIDRs, else spec.podCIDR), for
/// `--detect-local-mode NodeCIDR`. kube-proxy's waitForPodCIDR: polled until the node has
/// them, for at most `wait`; an error says why there are none.
pub async fn node_pod_cidrs(
    client: Client,
    name: &str,
    wait: std::time::Duration,
) -> Result<Vec<String>, String> {
    let api = Api::<v1::Node>::all(client);
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let last = match api.get(name).await {
            Ok(node) => {
                let spec = node.spec.unwrap_or_default();
                let cidrs = match spec.pod_cidrs {
                    Some(list) if !list.is_empty() => list,
                    _ => spec.pod_cidr.into_iter().collect(),
                };
                if !cidrs.is_empty() {
                    return Ok(cidrs);
                }
                format!("Node {name} has no spec.podCIDRs")
            }
            Err(e) => format!("reading Node {name}: {e}"),
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(last);
        }
        info!("{last}; waiting for them");
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

pub async fn run(
    client: Client,
    node_name: String,
    proxy_name: Option<String>,
    events: EventRecorder,
    admin: Arc<AdminState>,
    tx: mpsc::Sender<SourceEvent>,
    shutdown: impl Future<Output = ()>,
) {
    let selector = label_selector(proxy_name.as_deref());
    let config = watcher::Config::default().labels(&selector);
    // Each list is scanned in one task and decoded in another (see `lazy`), so the next
    // page is fetched while this one is decoded, and Services and EndpointSlices alongside.
    let services = OwnTask::spawn(
        OwnTask::spawn(with_backoff(watcher(
            Api::<Lazy<v1::Service>>::all(client.clone()),
            config.clone(),
        )))
        .map(lazy::decode),
    );
    let slices = OwnTask::spawn(
        OwnTask::spawn(with_backoff(watcher(
            Api::<Lazy<EndpointSlice>>::all(client.clone()),
            config,
        )))
        .map(lazy::decode),
    );
    let nodes = with_backoff(watcher(
        Api::<v1::Node>::all(client.clone()),
        watcher::Config::default().fields(&format!("metadata.name={node_name}")),
    ));
    let service_cidrs = with_backoff(watcher(
        Api::<ServiceCIDR>::all(client),
        watcher::Config::default(),
    ));
    let mut pump = Pump {
        tx,
        proxy_name,
        node_name,
        events,
        admin,
        node_seen: false,
        node_listed: false,
        service_buf: None,
        slice_buf: None,
        services_listed: false,
        slices_listed: false,
        synced_sent: false,
        service_cidr_buf: None,
        service_cidrs_served: true,
        service_list_began: None,
        slice_list_began: None,
    };
    tokio::pin!(services, slices, nodes, service_cidrs, shutdown);
    loop {
        let more = tokio::select! {
            _ = &mut shutdown => return,
            Some(ev) = services.next() => pump.service(ev).await,
            Some(ev) = slices.next() => pump.slice(ev).await,
            Some(ev) = nodes.next() => pump.node(ev).await,
            Some(ev) = service_cidrs.next(), if pump.service_cidrs_served => {
                pump.service_cidr(ev).await
            }
            else => return,
        };
        if !more {
            return;
        }
    }
}

/// A stream driven in a task of its own, its items handed over a channel. A watcher decodes
/// its list pages while it is polled: polled from the pump's task, the first lists of
/// Services and EndpointSlices (50,000 objects each in the daemon bench) took turns on one
/// CPU, and the slices' list is what the first sync waits for. Dropping it stops the task.
struct OwnTask<T> {
    items: mpsc::Receiver<T>,
    task: tokio::task::JoinHandle<()>,
}

impl<T: Send + 'static> OwnTask<T> {
    /// Room for a few list pages' worth of objects between the watcher and the pump.
    const BUFFERED: usize = 1024;

    fn spawn<S: Stream<Item = T> + Send + 'static>(stream: S) -> Self {
        let (tx, items) = mpsc::channel(Self::BUFFERED);
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(item) = stream.next().await {
                if tx.send(item).await.is_err() {
                    return;
                }
            }
        });
        OwnTask { items, task }
    }
}

impl<T> Stream for OwnTask<T> {
    type Item = T;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<T>> {
        self.items.poll_recv(cx)
    }
}

impl<T> Drop for OwnTask<T> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Converts watcher events into source events, buffering relists.
struct Pump {
    tx: mpsc::Sender<SourceEvent>,
    proxy_name: Option<String>,
    node_name: String,
    events: EventRecorder,
    admin: Arc<AdminState>,
    /// The Node has been seen (ever), and in the list being received.
    node_seen: bool,
    node_listed: bool,
    service_buf: Option<Vec<crate::model::Service>>,
    slice_buf: Option<Vec<(ServiceKey, String, crate::model::SliceInfo)>>,
    services_listed: bool,
    slices_listed: bool,
    synced_sent: bool,
    service_cidr_buf: Option<Vec<(String, Vec<crate::model::Cidr>)>>,
    /// False once the API server said it has no ServiceCIDR resource (before 1.33, or the
    /// API off): the configured ranges are all there is, and the watch stops.
    service_cidrs_served: bool,
    /// When the list under way began (for the log line that says how long it took).
    service_list_began: Option<Instant>,
    slice_list_began: Option<Instant>,
}

fn object_key<K: ResourceExt>(obj: &K) -> ServiceKey {
    ServiceKey::new(
        obj.namespace().unwrap_or_else(|| "default".into()),
        obj.name_any(),
    )
}

/// The key of an object known only by its reference (one that could not be decoded).
fn reference_key(r: &k8s_openapi::api::core::v1::ObjectReference) -> ServiceKey {
    ServiceKey::new(
        r.namespace.clone().unwrap_or_else(|| "default".into()),
        r.name.clone().unwrap_or_default(),
    )
}

/// The event for a slice that is gone, or no longer usable: the tracker knows its owner.
fn slice_gone(key: ServiceKey) -> SourceEvent {
    SourceEvent::Slice {
        namespace: key.namespace.to_string(),
        owner: None,
        name: key.name.to_string(),
        slice: None,
    }
}

impl Pump {
    async fn send(&mut self, ev: SourceEvent) -> bool {
        self.tx.send(ev).await.is_ok()
    }

    async fn maybe_synced(&mut self) -> bool {
        if self.services_listed && self.slices_listed && !self.synced_sent {
            self.synced_sent = true;
            info!("initial lists of Services and EndpointSlices received");
            return self.send(SourceEvent::Synced).await;
        }
        true
    }

    /// A Service as the model has it; `None` when it is skipped or malformed (logged).
    fn convert_service(&self, svc: &v1::Service) -> Option<crate::model::Service> {
        match convert::service(svc, self.proxy_name.as_deref()) {
            Ok(s) => s,
            Err(e) => {
                error!("{e}; the service is not programmed until it is fixed");
                let note = format!("{e}; fastpath does not program it until it is fixed");
                self.events
                    .warn(svc.object_ref(&()), events::REASON_INVALID, "Convert", note);
                None
            }
        }
    }

    fn convert_slice(
        &self,
        slice: &EndpointSlice,
    ) -> Option<(ServiceKey, String, crate::model::SliceInfo)> {
        match convert::endpoint_slice(slice) {
            Ok(s) => s,
            Err(e) => {
                error!("{e}; the slice is ignored until it is fixed");
                let note = format!("{e}; fastpath ignores it until it is fixed");
                self.events.warn(
                    slice.object_ref(&()),
                    events::REASON_INVALID,
                    "Convert",
                    note,
                );
                None
            }
        }
    }

    /// A Service or EndpointSlice that could not be decoded: logged, with an Event.
    fn malformed(&self, m: &Malformed, what: &str) {
        error!("{m}; {what}");
        self.events.warn(
            m.object.clone(),
            events::REASON_INVALID,
            "Decode",
            format!("{m}; fastpath {what}"),
        );
    }

    async fn service(&mut self, ev: Decoded<v1::Service>) -> bool {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                warn!("watching Services: {e}; retrying with backoff");
                return true;
            }
        };
        match ev {
            watcher::Event::Init => {
                self.service_buf = Some(Vec::new());
                self.service_list_began = Some(Instant::now());
            }
            watcher::Event::InitApply(Err(m)) => {
                self.malformed(&m, "does not program it until it is fixed")
            }
            watcher::Event::InitApply(Ok(svc)) => {
                if let Some(s) = self.convert_service(&svc) {
                    self.service_buf.get_or_insert_with(Vec::new).push(s);
                }
            }
            watcher::Event::InitDone => {
                let list = self.service_buf.take().unwrap_or_default();
                if let Some(began) = self.service_list_began.take() {
                    info!(services = list.len(), took = ?began.elapsed(), "Services listed");
                }
                if !self.send(SourceEvent::ReplaceServices(list)).await {
                    return false;
                }
                self.services_listed = true;
                return self.maybe_synced().await;
            }
            watcher::Event::Apply(Ok(svc)) => {
                let service = self.convert_service(&svc);
                let key = object_key(&svc);
                return self.send(SourceEvent::Service { key, service }).await;
            }
            // Unusable now: whatever it was before goes.
            watcher::Event::Apply(Err(m)) => {
                self.malformed(&m, "does not program it until it is fixed");
                let key = reference_key(&m.object);
                return self.send(SourceEvent::Service { key, service: None }).await;
            }
            watcher::Event::Delete(svc) => {
                let key = match &svc {
                    Ok(svc) => object_key(svc),
                    Err(m) => reference_key(&m.object),
                };
                return self.send(SourceEvent::Service { key, service: None }).await;
            }
        }
        true
    }

    async fn slice(&mut self, ev: Decoded<EndpointSlice>) -> bool {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                warn!("watching EndpointSlices: {e}; retrying with backoff");
                return true;
            }
        };
        match ev {
            watcher::Event::Init => {
                self.slice_buf = Some(Vec::new());
                self.slice_list_began = Some(Instant::now());
            }
            watcher::Event::InitApply(Err(m)) => self.malformed(&m, "ignores it until it is fixed"),
            watcher::Event::InitApply(Ok(slice)) => {
                if let Some(s) = self.convert_slice(&slice) {
                    self.slice_buf.get_or_insert_with(Vec::new).push(s);
                }
            }
            watcher::Event::InitDone => {
                let list = self.slice_buf.take().unwrap_or_default();
                if let Some(began) = self.slice_list_began.take() {
                    info!(slices = list.len(), took = ?began.elapsed(), "EndpointSlices listed");
                }
                if !self.send(SourceEvent::ReplaceSlices(list)).await {
                    return false;
                }
                self.slices_listed = true;
                return self.maybe_synced().await;
            }
            // Unusable now (cannot be decoded): whatever it fed before must go.
            watcher::Event::Apply(Err(m)) => {
                self.malformed(&m, "ignores it until it is fixed");
                return self.send(slice_gone(reference_key(&m.object))).await;
            }
            watcher::Event::Apply(Ok(slice)) => {
                let ev = match self.convert_slice(&slice) {
                    Some((owner, name, info)) => SourceEvent::Slice {
                        namespace: slice.namespace().unwrap_or_else(|| "default".into()),
                        owner: Some(owner),
                        name,
                        slice: Some(info),
                    },
                    // Unusable now (malformed, FQDN, owner label gone): whatever it fed
                    // before must go.
                    None => slice_gone(object_key(&slice)),
                };
                return self.send(ev).await;
            }
            watcher::Event::Delete(Ok(slice)) => {
                return self.send(slice_gone(object_key(&slice))).await;
            }
            watcher::Event::Delete(Err(m)) => {
                return self.send(slice_gone(reference_key(&m.object))).await;
            }
        }
        true
    }

    async fn node(&mut self, ev: Result<watcher::Event<v1::Node>, watcher::Error>) -> bool {
        match ev {
            Ok(watcher::Event::Apply(node) | watcher::Event::InitApply(node)) => {
                self.node_seen = true;
                self.node_listed = true;
                self.set_eligible(node_eligible(&node));
                let zone = node.labels().get(ZONE).cloned();
                let info = NodeInfo {
                    name: self.node_name.clone(),
                    zone,
                };
                self.send(SourceEvent::Node(info)).await
            }
            Ok(watcher::Event::Delete(_)) => {
                self.set_eligible(false);
                true
            }
            Ok(watcher::Event::Init) => {
                self.node_listed = false;
                true
            }
            // A relist without our Node: it was deleted while we were not watching.
            Ok(watcher::Event::InitDone) => {
                if self.node_seen && !self.node_listed {
                    self.set_eligible(false);
                }
                true
            }
            Err(e) => {
                warn!(
                    "watching Node {}: {e}; retrying with backoff",
                    self.node_name
                );
                true
            }
        }
    }

    /// A ServiceCIDR that cannot be used; `None` after logging it and an Event.
    fn convert_service_cidr(&self, obj: &ServiceCIDR) -> Option<(String, Vec<crate::model::Cidr>)> {
        match service_cidr::service_cidr(obj) {
            Ok(c) => Some(c),
            Err(e) => {
                error!("{e}; its ranges are not refused until it is fixed");
                let note = format!("{e}; fastpath ignores its ranges until it is fixed");
                self.events
                    .warn(obj.object_ref(&()), events::REASON_INVALID, "Convert", note);
                None
            }
        }
    }

    async fn service_cidr(
        &mut self,
        ev: Result<watcher::Event<ServiceCIDR>, watcher::Error>,
    ) -> bool {
        let ev = match ev {
            Ok(ev) => ev,
            Err(watcher::Error::InitialListFailed(kube::Error::Api(s))) if s.code == 404 => {
                info!(
                    "the API server has no ServiceCIDR objects; the service ranges are --service-cluster-ip-range alone"
                );
                self.service_cidrs_served = false;
                return true;
            }
            Err(e) => {
                warn!("watching ServiceCIDRs: {e}; retrying with backoff");
                return true;
            }
        };
        match ev {
            watcher::Event::Init => self.service_cidr_buf = Some(Vec::new()),
            watcher::Event::InitApply(obj) => {
                if let Some(c) = self.convert_service_cidr(&obj) {
                    self.service_cidr_buf.get_or_insert_with(Vec::new).push(c);
                }
            }
            watcher::Event::InitDone => {
                let list = self.service_cidr_buf.take().unwrap_or_default();
                return self.send(SourceEvent::ReplaceServiceCidrs(list)).await;
            }
            watcher::Event::Apply(obj) => {
                let name = obj.name_any();
                let cidrs = self.convert_service_cidr(&obj).map(|(_, c)| c);
                return self.send(SourceEvent::ServiceCidr { name, cidrs }).await;
            }
            watcher::Event::Delete(obj) => {
                let name = obj.name_any();
                return self
                    .send(SourceEvent::ServiceCidr { name, cidrs: None })
                    .await;
            }
        }
        true
    }

    fn set_eligible(&self, eligible: bool) {
        if self.admin.health.set_node_eligible(eligible) {
            if eligible {
                info!(node = %self.node_name, "the node is eligible for load-balancer traffic again");
            } else {
                warn!(node = %self.node_name, "the node is being deleted or tainted {TO_BE_DELETED_TAINT}: /healthz answers 503 so load balancers drain it");
            }
        }
    }
}
