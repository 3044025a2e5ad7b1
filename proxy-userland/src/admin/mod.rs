//! The admin side of the daemon: what operators and the kubelet ask it.
//!
//! - [`health`]: /healthz and /livez (kube-proxy's semantics) and /readyz, on
//!   `--healthz-bind-address` (default 0.0.0.0:10256, as kube-proxy).
//! - [`metrics`]: /metrics in Prometheus text, on `--metrics-bind-address` (default
//!   127.0.0.1:10249, as kube-proxy).
//! - [`healthcheck`]: one health check node port server per `externalTrafficPolicy: Local`
//!   load balancer, for the cloud load balancer to find the nodes with endpoints.
//! - [`http`]: the small HTTP/1.1 responder they share.
//!
//! The sync loop writes an [`AdminState`] after each sync; the servers only read it, so a
//! slow scrape never delays a sync.

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

use tokio::{net::TcpListener, task::JoinHandle};
use tracing::{info, warn};

use self::{
    health::ProxierHealth,
    http::{Handler, Request, Response},
    metrics::Metrics,
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
        Metrics::catch_up(&self.metrics.service_changes, services_total);
        Metrics::catch_up(&self.metrics.endpoint_changes, endpoints_total);
    }

    /// A sync finished.
    pub fn synced(&self, r: &SyncRecord) {
        let now = SystemTime::now();
        let m = &self.metrics;
        m.observe_sync(r.took, r.full);
        self.changes_seen(r.services_changed_total, r.endpoints_changed_total);
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
    Arc::new(move |req: &Request| match req.path.as_str() {
        "/healthz" | "/livez" => {
            let status = state.health.status(SystemTime::now());
            Response::json(if status.healthy { 200 } else { 503 }, status.json())
        }
        "/readyz" => {
            if state.health.is_ready() {
                Response::text(200, "ok\n")
            } else {
                Response::text(503, "not ready: the first sync has not run yet\n")
            }
        }
        _ => Response::not_found(),
    })
}

/// /metrics, plus kube-proxy's /proxyMode and a plain /healthz on the metrics port.
pub fn metrics_handler(state: Arc<AdminState>) -> Handler {
    Arc::new(move |req: &Request| match req.path.as_str() {
        "/metrics" => {
            let mut r = Response::text(200, state.metrics.encode());
            r.content_type = metrics::CONTENT_TYPE;
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
        match TcpListener::bind(addr).await {
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
        if let Ok(listener) = TcpListener::bind(addr).await {
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
        })
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
        assert_eq!(m.content_type, metrics::CONTENT_TYPE);
        assert!(
            m.body
                .contains("kubeproxy_sync_proxy_rules_duration_seconds")
        );
        assert_eq!(get(&h, "/proxyMode").body, "ebpf");
    }
}
