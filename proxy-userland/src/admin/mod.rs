//! The admin side of the daemon: what operators and the kubelet ask it.
//!
//! - [`health`]: /healthz and /livez (kube-proxy's semantics) and /readyz, on
//!   `--healthz-bind-address` (default 0.0.0.0:10256, as kube-proxy).
//! - [`metrics`]: /metrics in the Prometheus text format or OpenMetrics, on
//!   `--metrics-bind-address` (default 127.0.0.1:10249, as kube-proxy).
//! - [`healthcheck`]: one health check node port server per `externalTrafficPolicy: Local`
//!   load balancer, for the cloud load balancer to find the nodes with endpoints.
//! - [`http`]: the HTTP/1.1 server they share (hyper, with a connection cap and head limits).
//!
//! The sync loop writes an [`AdminState`] after each sync, and the Kubernetes source the
//! node's eligibility; the servers only read it, so a slow scrape never delays a sync.

pub mod debug;
pub mod health;
pub mod healthcheck;
pub mod http;
pub mod metrics;

use std::{
    future::Future,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use prometheus_client::metrics::{counter::Counter, family::Family};
use tokio::{net::TcpListener, task::JoinHandle};
use tracing::{info, warn};

use self::{
    health::ProxierHealth,
    healthcheck::NoLocalEndpoints,
    http::{Handler, Request, Response},
    metrics::{CodeLabel, Format, Metrics},
};
use crate::{
    config::Args,
    dataplane::bpf::maps::{Occupancy, PacketStats},
};

/// How long to wait before trying a busy admin port again (kube-proxy: 5 s).
const REBIND_PERIOD: Duration = Duration::from_secs(5);

/// Shared by the sync loop (writer) and the admin servers (readers).
pub struct AdminState {
    pub health: ProxierHealth,
    pub metrics: Metrics,
    pub debug: debug::DebugState,
    proxy_mode: Mutex<&'static str>,
    /// The tracker's change totals when the last sync took its changes: what came after
    /// is pending.
    synced_totals: Mutex<(u64, u64)>,
}

/// What one sync did, as the admin side records it.
#[derive(Clone, Debug, Default)]
pub struct SyncRecord {
    pub took: Duration,
    pub full: bool,
    /// Services that could not be programmed (and will be retried).
    pub failed: usize,
    /// When the oldest change this sync programmed arrived, if it programmed any.
    pub pending_since: Option<Instant>,
    pub occupancy: Option<Occupancy>,
    /// The packet path's counters, when it is attached.
    pub packet_stats: Option<PacketStats>,
    pub services: usize,
    pub services_changed_total: u64,
    pub endpoints_changed_total: u64,
    /// Connected UDP sockets of removed backends reset, and resets that failed.
    pub udp_socket_resets: (usize, usize),
    /// Service ports with a Local traffic policy and no local endpoint after this sync.
    pub no_local_endpoints: NoLocalEndpoints,
}

/// Why an admin server did not start.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("cannot serve {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
}

impl AdminState {
    pub fn new(health_timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            health: ProxierHealth::new(health_timeout),
            metrics: Metrics::new(),
            debug: Default::default(),
            proxy_mode: Mutex::new(""),
            synced_totals: Mutex::new((0, 0)),
        })
    }

    pub fn set_proxy_mode(&self, mode: &'static str) {
        *self.proxy_mode.lock().unwrap_or_else(|p| p.into_inner()) = mode;
    }

    fn proxy_mode(&self) -> &'static str {
        *self.proxy_mode.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A change arrived that a sync has yet to program.
    pub fn queued(&self) {
        let now = SystemTime::now();
        self.health.queued(now);
        self.metrics
            .last_queued_timestamp
            .set(metrics::unix_seconds(now));
    }

    /// Counts what the change tracker has recorded so far.
    pub fn changes_seen(&self, services_total: u64, endpoints_total: u64) {
        let m = &self.metrics;
        Metrics::catch_up(&m.service_changes, services_total);
        Metrics::catch_up(&m.endpoint_changes, endpoints_total);
        let (services_synced, endpoints_synced) =
            *self.synced_totals.lock().unwrap_or_else(|p| p.into_inner());
        m.service_changes_pending
            .set(services_total.saturating_sub(services_synced) as i64);
        m.endpoint_changes_pending
            .set(endpoints_total.saturating_sub(endpoints_synced) as i64);
    }

    /// What the Node says about this node's eligibility for load-balancer traffic.
    pub fn set_node_eligible(&self, eligible: bool) -> bool {
        self.health.set_node_eligible(eligible)
    }

    /// A sync finished.
    pub fn synced(&self, r: &SyncRecord) {
        let now = SystemTime::now();
        let m = &self.metrics;
        m.observe_sync(r.took, r.full);
        *self.synced_totals.lock().unwrap_or_else(|p| p.into_inner()) =
            (r.services_changed_total, r.endpoints_changed_total);
        self.changes_seen(r.services_changed_total, r.endpoints_changed_total);
        m.set_no_local_endpoints(r.no_local_endpoints.internal, r.no_local_endpoints.external);
        m.services.set(r.services as i64);
        if let Some(o) = &r.occupancy {
            m.set_occupancy(o);
        }
        if let Some(s) = &r.packet_stats {
            m.set_packet_stats(s);
        }
        for (result, n) in [
            ("done", r.udp_socket_resets.0),
            ("failed", r.udp_socket_resets.1),
        ] {
            let counter = m
                .udp_socket_resets
                .get_or_create(&metrics::ResultLabel { result });
            counter.inc_by(n as u64);
        }
        if let Some(since) = r.pending_since {
            m.network_programming.observe(since.elapsed().as_secs_f64());
        }
        if r.failed > 0 {
            m.sync_failures.inc();
            m.service_failures.inc_by(r.failed as u64);
            // The failed services stay pending: health turns bad if they stay failed.
        } else {
            self.health.updated(now);
            m.last_sync_timestamp.set(metrics::unix_seconds(now));
        }
        self.health.set_ready();
    }
}

/// /healthz, /livez and /readyz.
pub fn health_handler(state: Arc<AdminState>) -> Handler {
    Arc::new(move |req: &Request| health_answer(&state, &req.path, SystemTime::now()))
}

/// The health server's answer to `path` at `now`, as kube-proxy's: /healthz is 503 when the
/// proxy is overdue or the node is not eligible (being deleted or tainted for it, so that
/// load balancers drain it); /livez only when the proxy is overdue, since restarting it
/// would not help a node on its way out. Both are counted by status code.
fn health_answer(state: &AdminState, path: &str, now: SystemTime) -> Response {
    let count = |family: &Family<CodeLabel, Counter>, ok: bool| {
        let code = if ok { "200" } else { "503" };
        family.get_or_create(&CodeLabel { code }).inc();
        if ok { 200 } else { 503 }
    };
    match path {
        "/healthz" => {
            let status = state.health.status(now);
            let ok = status.healthy && status.node_eligible;
            Response::json(
                count(&state.metrics.healthz_answers, ok),
                status.healthz_json(),
            )
        }
        "/livez" => {
            let status = state.health.status(now);
            Response::json(
                count(&state.metrics.livez_answers, status.healthy),
                status.livez_json(),
            )
        }
        "/readyz" => {
            if state.health.is_ready() {
                Response::text(200, "ok\n")
            } else {
                Response::text(503, "not ready: the first sync has not run yet\n")
            }
        }
        _ => Response::not_found(),
    }
}

/// /metrics, plus kube-proxy's /proxyMode and a plain /healthz on the metrics port.
pub fn metrics_handler(state: Arc<AdminState>) -> Handler {
    Arc::new(move |req: &Request| match req.path.as_str() {
        "/metrics" => {
            let format = Format::negotiate(req.accept.as_deref());
            let mut r = Response::text(200, state.metrics.encode_as(format));
            r.content_type = format.content_type();
            r
        }
        "/proxyMode" => Response::text(200, state.proxy_mode()),
        "/healthz" => Response::text(200, "ok"),
        "/debug/model" => state.debug.response(state.proxy_mode()),
        _ => Response::not_found(),
    })
}

/// Starts the health and metrics servers that `args` asks for; they stop when `stopped()`
/// resolves. A port that cannot be bound is an error with `--bind-address-hard-fail`, else
/// a warning and a retry every few seconds (kube-proxy's behaviour).
pub async fn start<F, Fut>(
    args: &Args,
    state: &Arc<AdminState>,
    stopped: F,
) -> Result<Vec<JoinHandle<()>>, AdminError>
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut tasks = Vec::new();
    let servers = [
        (
            "/healthz, /livez and /readyz",
            args.healthz_bind_address.0,
            health_handler(state.clone()),
        ),
        (
            "/metrics",
            args.metrics_bind_address.0,
            metrics_handler(state.clone()),
        ),
    ];
    for (what, addr, handler) in servers {
        let Some(addr) = addr else { continue };
        match http::listen(addr).and_then(TcpListener::from_std) {
            Ok(listener) => {
                let local = listener.local_addr().unwrap_or(addr);
                info!(addr = %local, "serving {what}");
                tasks.push(tokio::spawn(http::serve(listener, handler, stopped())));
            }
            Err(source) if args.bind_address_hard_fail => {
                return Err(AdminError::Bind { what, addr, source });
            }
            Err(e) => {
                warn!(%addr, "cannot serve {what}: {e}; retrying every {}s", REBIND_PERIOD.as_secs());
                tasks.push(tokio::spawn(retry_bind(what, addr, handler, stopped())));
            }
        }
    }
    Ok(tasks)
}

async fn retry_bind(
    what: &'static str,
    addr: SocketAddr,
    handler: Handler,
    stop: impl Future<Output = ()>,
) {
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = tokio::time::sleep(REBIND_PERIOD) => {}
        }
        if let Ok(listener) = http::listen(addr).and_then(TcpListener::from_std) {
            info!(%addr, "serving {what}");
            return http::serve(listener, handler, stop).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(h: &Handler, path: &str) -> Response {
        h(&Request {
            method: "GET".into(),
            path: path.into(),
            accept: None,
        })
    }

    fn node(tainted: Option<&str>, deleted: bool) -> k8s_openapi::api::core::v1::Node {
        let mut n = k8s_openapi::api::core::v1::Node::default();
        if let Some(key) = tainted {
            n.spec.get_or_insert_default().taints = Some(vec![k8s_openapi::api::core::v1::Taint {
                key: key.into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            }]);
        }
        if deleted {
            n.metadata.deletion_timestamp = Some(
                k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()),
            );
        }
        n
    }

    /// kube-proxy's testProxyHealthUpdater for one proxier: `path` answers 200 until a
    /// queued update waits past the timeout (10 s), and again once it is done. Every answer is
    /// checked against the expected code and counted in `tally` (200s, 503s).
    fn proxy_health_updater(
        state: &AdminState,
        path: &str,
        t0: SystemTime,
        tally: &mut (u64, u64),
    ) {
        let mut now = t0;
        let expect = |now: SystemTime, code: u16, tally: &mut (u64, u64)| {
            let r = health_answer(state, path, now);
            assert_eq!(r.status, code, "{path} at {now:?}: {}", r.body);
            let v: serde_json::Value = serde_json::from_str(&r.body).expect("JSON body");
            assert!(
                v["currentTime"].is_string() && v["lastUpdated"].is_string(),
                "{v}"
            );
            // kube-proxy answers a healthy proxy's lastUpdated with the current time, so
            // that a monitor does not take an idle proxy for a stuck one; an unhealthy
            // one's is its last update.
            assert_eq!(
                v["lastUpdated"] == v["currentTime"],
                code == 200,
                "{path} {code}: {v}"
            );
            if code == 200 {
                tally.0 += 1
            } else {
                tally.1 += 1
            }
        };
        expect(now, 200, tally); // 200 by default
        state.health.updated(now);
        expect(now, 200, tally);
        now += Duration::from_secs(25);
        expect(now, 200, tally); // nothing queued: healthy however long ago
        state.health.queued(now);
        now += Duration::from_secs(25);
        expect(now, 503, tally); // queued and overdue
        state.health.updated(now);
        now += Duration::from_secs(5);
        expect(now, 200, tally);
    }

    fn answers(state: &AdminState, family: &str) -> (u64, u64) {
        let text = state.metrics.encode();
        let count = |code: &str| {
            let line = format!("{family}_total{{code=\"{code}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&line)?.parse().ok())
                .unwrap_or(0)
        };
        (count("200"), count("503"))
    }

    #[test]
    fn test_healthz_server() {
        let state = AdminState::new(Duration::from_secs(10));
        let t0 = SystemTime::now();
        let mut tally = (0, 0);
        proxy_health_updater(&state, "/healthz", t0, &mut tally);
        let later = t0 + Duration::from_secs(60);
        let mut sync_node = |n: &k8s_openapi::api::core::v1::Node, code: u16, eligible: bool| {
            state.set_node_eligible(crate::source::kube::node_eligible(n));
            let r = health_answer(&state, "/healthz", later);
            assert_eq!(r.status, code, "{}", r.body);
            let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
            assert_eq!(v["nodeEligible"], eligible, "{v}");
            if code == 200 {
                tally.0 += 1
            } else {
                tally.1 += 1
            }
        };
        let taint = crate::source::kube::TO_BE_DELETED_TAINT;
        sync_node(&node(Some("other"), false), 200, true);
        sync_node(&node(Some(taint), false), 503, false);
        sync_node(&node(Some("other"), false), 200, true);
        sync_node(&node(None, true), 503, false);
        assert_eq!(answers(&state, "kubeproxy_proxy_healthz"), tally);
        assert_eq!(answers(&state, "kubeproxy_proxy_livez"), (0, 0));
    }

    #[test]
    fn test_livez_server() {
        let state = AdminState::new(Duration::from_secs(10));
        let t0 = SystemTime::now();
        let mut tally = (0, 0);
        proxy_health_updater(&state, "/livez", t0, &mut tally);
        let later = t0 + Duration::from_secs(60);
        let taint = crate::source::kube::TO_BE_DELETED_TAINT;
        for n in [
            node(Some("other"), false),
            node(Some(taint), false),
            node(None, true),
        ] {
            state.set_node_eligible(crate::source::kube::node_eligible(&n));
            let r = health_answer(&state, "/livez", later);
            assert_eq!(r.status, 200, "irrespective of the node: {}", r.body);
            assert!(!r.body.contains("nodeEligible"), "{}", r.body);
            tally.0 += 1;
        }
        assert_eq!(answers(&state, "kubeproxy_proxy_livez"), tally);
    }

    #[test]
    fn readiness_follows_the_first_sync_and_health_the_pending_changes() {
        let state = AdminState::new(Duration::from_secs(60));
        let h = health_handler(state.clone());
        assert_eq!(get(&h, "/readyz").status, 503);
        assert_eq!(get(&h, "/healthz").status, 200);
        state.queued();
        state.synced(&SyncRecord {
            took: Duration::from_millis(2),
            full: true,
            ..Default::default()
        });
        assert_eq!(get(&h, "/readyz").status, 200);
        let r = get(&h, "/livez");
        assert_eq!(r.status, 200);
        assert!(r.body.contains("\"lastUpdated\"") && r.body.contains("\"currentTime\""));
        assert_eq!(get(&h, "/other").status, 404);
    }

    #[test]
    fn a_sync_with_failures_leaves_changes_pending() {
        let state = AdminState::new(Duration::ZERO);
        state.queued();
        state.synced(&SyncRecord {
            failed: 1,
            ..Default::default()
        });
        let h = health_handler(state.clone());
        assert_eq!(
            get(&h, "/healthz").status,
            503,
            "overdue with a zero timeout"
        );
        assert!(
            state
                .metrics
                .encode()
                .contains("fastpath_service_program_failures_total 1")
        );
        state.synced(&SyncRecord::default());
        assert_eq!(get(&h, "/healthz").status, 200);
    }

    #[test]
    fn metrics_port_serves_the_exposition_and_the_mode() {
        let state = AdminState::new(Duration::from_secs(60));
        state.set_proxy_mode("ebpf");
        let h = metrics_handler(state);
        let m = get(&h, "/metrics");
        assert_eq!(
            m.content_type,
            metrics::TEXT_CONTENT_TYPE,
            "text unless asked"
        );
        assert!(
            m.body
                .contains("# TYPE kubeproxy_sync_proxy_rules_service_changes_total counter")
        );
        let om = h(&Request {
            method: "GET".into(),
            path: "/metrics".into(),
            accept: Some(
                "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5".into(),
            ),
        });
        assert_eq!(om.content_type, metrics::OPENMETRICS_CONTENT_TYPE);
        assert!(om.body.ends_with("# EOF\n"), "{}", om.body);
        assert_eq!(get(&h, "/proxyMode").body, "ebpf");
    }

    #[test]
    fn pending_changes_are_those_after_the_last_sync() {
        let state = AdminState::new(Duration::from_secs(60));
        state.changes_seen(3, 5);
        let pending = |s: &AdminState| {
            let t = s.metrics.encode();
            let v = |n: &str| {
                t.lines()
                    .find_map(|l| l.strip_prefix(n)?.strip_prefix(' ')?.parse::<i64>().ok())
            };
            (
                v("kubeproxy_sync_proxy_rules_service_changes_pending"),
                v("kubeproxy_sync_proxy_rules_endpoint_changes_pending"),
            )
        };
        assert_eq!(pending(&state), (Some(3), Some(5)));
        state.synced(&SyncRecord {
            services_changed_total: 3,
            endpoints_changed_total: 5,
            ..Default::default()
        });
        assert_eq!(pending(&state), (Some(0), Some(0)));
        state.changes_seen(3, 7);
        assert_eq!(pending(&state), (Some(0), Some(2)));
    }
}
