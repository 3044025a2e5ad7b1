//! The Prometheus metrics, under kube-proxy's names where kube-proxy has the metric
//! (pkg/proxy/metrics), so existing dashboards and alerts keep working; fastpath's own are
//! prefixed `fastpath_`.
//!
//! Exposed in the OpenMetrics text format, which Prometheus scrapes natively.

use std::{
    sync::atomic::AtomicU64,
    time::{Duration, SystemTime},
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets, linear_buckets},
    },
    registry::Registry,
};

use crate::dataplane::bpf::maps::{Occupancy, PacketStats};

pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MapLabel {
    pub map: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

pub struct Metrics {
    registry: Registry,
    pub sync_duration: Histogram,
    pub sync_full_duration: Histogram,
    pub sync_partial_duration: Histogram,
    pub network_programming: Histogram,
    pub last_sync_timestamp: Gauge<f64, AtomicU64>,
    pub last_queued_timestamp: Gauge<f64, AtomicU64>,
    pub service_changes: Counter,
    pub endpoint_changes: Counter,
    pub sync_failures: Counter,
    pub service_failures: Counter,
    pub map_entries: Family<MapLabel, Gauge>,
    pub packets: Family<ResultLabel, Counter>,
    pub udp_socket_resets: Family<ResultLabel, Counter>,
    pub services: Gauge,
    pub healthcheck_servers: Gauge,
}

/// kube-proxy's buckets for sync durations: 1 ms to about 16 s.
fn sync_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 15)
}

/// kube-proxy's buckets for network programming latency: fine below a minute, coarse above.
fn programming_buckets() -> Vec<f64> {
    linear_buckets(0.25, 0.25, 2)
        .chain(linear_buckets(1.0, 1.0, 59))
        .chain(linear_buckets(60.0, 5.0, 12))
        .chain(linear_buckets(120.0, 30.0, 7))
        .collect()
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let m = Metrics {
            sync_duration: Histogram::new(sync_buckets()),
            sync_full_duration: Histogram::new(sync_buckets()),
            sync_partial_duration: Histogram::new(sync_buckets()),
            network_programming: Histogram::new(programming_buckets()),
            last_sync_timestamp: Gauge::default(),
            last_queued_timestamp: Gauge::default(),
            service_changes: Counter::default(),
            endpoint_changes: Counter::default(),
            sync_failures: Counter::default(),
            service_failures: Counter::default(),
            map_entries: Family::default(),
            packets: Family::default(),
            udp_socket_resets: Family::default(),
            services: Gauge::default(),
            healthcheck_servers: Gauge::default(),
            registry: Registry::default(),
        };
        // Counters get their `_total` suffix from the encoder.
        registry.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            m.sync_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            m.sync_full_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            m.sync_partial_duration.clone(),
        );
        registry.register(
            "kubeproxy_network_programming_duration_seconds",
            "In-cluster network programming latency in seconds, measured from when fastpath \
             received the change (not from the EndpointSlice trigger-time annotation)",
            m.network_programming.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            m.last_sync_timestamp.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            m.last_queued_timestamp.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            m.service_changes.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            m.endpoint_changes.clone(),
        );
        registry.register(
            "fastpath_sync_failures",
            "Syncs in which at least one service could not be programmed",
            m.sync_failures.clone(),
        );
        registry.register(
            "fastpath_service_program_failures",
            "Services that a sync could not program (each is retried)",
            m.service_failures.clone(),
        );
        registry.register(
            "fastpath_bpf_map_entries",
            "Entries in each BPF map after the last sync",
            m.map_entries.clone(),
        );
        registry.register(
            "fastpath_packets",
            "Packets from other hosts the eBPF packet path handled, by what became of them: \
             new_flow, translated, dropped_no_backend, dropped_source_range, dropped_nat; \
             xdp counts those XDP translated itself",
            m.packets.clone(),
        );
        registry.register(
            "fastpath_udp_socket_resets",
            "Connected UDP sockets pointed at a removed backend: done = destroyed so the \
             client learns of it; failed = a reset that could not be done (the kernel refused \
             one socket, or a client namespace could not be entered, counted once), each \
             logged as a warning",
            m.udp_socket_resets.clone(),
        );
        registry.register(
            "fastpath_services",
            "Services this node proxies",
            m.services.clone(),
        );
        registry.register(
            "fastpath_healthcheck_node_port_servers",
            "Health check node port servers open (externalTrafficPolicy: Local services)",
            m.healthcheck_servers.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Records one finished sync.
    pub fn observe_sync(&self, took: Duration, full: bool) {
        let secs = took.as_secs_f64();
        self.sync_duration.observe(secs);
        if full {
            self.sync_full_duration.observe(secs);
        } else {
            self.sync_partial_duration.observe(secs);
        }
    }

    pub fn set_occupancy(&self, o: &Occupancy) {
        let maps = [
            ("services", o.services),
            ("backends", o.backends),
            ("sock_revnat", o.sock_revnat),
            ("affinity", o.affinity),
            ("conntrack", o.conntrack),
        ];
        for (map, n) in maps {
            self.map_entries
                .get_or_create(&MapLabel { map })
                .set(n as i64);
        }
    }

    /// Brings the packet counters up to the programs' totals.
    pub fn set_packet_stats(&self, s: &PacketStats) {
        let all = [
            ("new_flow", s.new_flows),
            ("translated", s.translated),
            ("dropped_no_backend", s.dropped_no_backend),
            ("dropped_source_range", s.dropped_source_range),
            ("dropped_nat", s.dropped_nat),
            ("xdp", s.xdp),
        ];
        for (result, n) in all {
            Self::catch_up(&self.packets.get_or_create(&ResultLabel { result }), n);
        }
    }

    /// Brings a counter up to a running total kept elsewhere (the change tracker's).
    pub fn catch_up(counter: &Counter, total: u64) {
        let current = counter.get();
        if total > current {
            counter.inc_by(total - current);
        }
    }

    /// The exposition, in OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

pub fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposes_kube_proxy_names_and_map_gauges() {
        let m = Metrics::new();
        m.observe_sync(Duration::from_millis(3), true);
        m.observe_sync(Duration::from_millis(1), false);
        Metrics::catch_up(&m.service_changes, 5);
        Metrics::catch_up(&m.service_changes, 3); // never backwards
        m.set_occupancy(&Occupancy {
            services: 4,
            backends: 6,
            sock_revnat: 0,
            conntrack: 2,
            ..Default::default()
        });
        m.set_packet_stats(&PacketStats {
            new_flows: 3,
            dropped_source_range: 1,
            ..Default::default()
        });
        m.set_packet_stats(&PacketStats {
            new_flows: 5,
            dropped_source_range: 1,
            ..Default::default()
        });
        m.last_sync_timestamp.set(unix_seconds(
            SystemTime::UNIX_EPOCH + Duration::from_secs(7),
        ));
        let text = m.encode();
        for line in [
            "kubeproxy_sync_proxy_rules_duration_seconds_count 2",
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count 1",
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_count 1",
            "kubeproxy_sync_proxy_rules_service_changes_total 5",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 0",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds 7.0",
            "fastpath_bpf_map_entries{map=\"services\"} 4",
            "fastpath_bpf_map_entries{map=\"backends\"} 6",
            "fastpath_bpf_map_entries{map=\"sock_revnat\"} 0",
            "fastpath_bpf_map_entries{map=\"conntrack\"} 2",
            "fastpath_packets_total{result=\"new_flow\"} 5",
            "fastpath_packets_total{result=\"dropped_source_range\"} 1",
            "fastpath_sync_failures_total 0",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"0.25\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in:\n{text}"
            );
        }
        assert!(text.trim_end().ends_with("# EOF"));
    }

    #[test]
    fn programming_buckets_are_kube_proxys() {
        let b = programming_buckets();
        assert_eq!(b.len(), 2 + 59 + 12 + 7);
        assert_eq!(
            (b[0], b[1], b[2], *b.last().unwrap()),
            (0.25, 0.5, 1.0, 300.0)
        );
    }
}
