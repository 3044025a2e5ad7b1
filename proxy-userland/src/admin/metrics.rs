//! The Prometheus metrics, under kube-proxy's names where kube-proxy has the metric
//! (pkg/proxy/metrics), so existing dashboards and alerts keep working; fastpath's own are
//! prefixed `fastpath_`.
//!
//! Served as kube-proxy serves them: the Prometheus text format 0.0.4, unless the scraper's
//! Accept header prefers OpenMetrics ([`Format::negotiate`]). The registry encodes
//! OpenMetrics; [`to_text_format`] rewrites that into the text format.

use std::{
    sync::atomic::AtomicU64,
    time::{Duration, SystemTime},
};

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder},
    metrics::{
        MetricType, TypedMetric,
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets, linear_buckets},
    },
    registry::Registry,
};

use crate::dataplane::bpf::maps::{Occupancy, PacketStats};

pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The two exposition formats /metrics speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4: what kube-proxy answers unless asked otherwise.
    Text,
    OpenMetrics,
}

impl Format {
    /// The format for an Accept header, as Prometheus' expfmt negotiates it: the acceptable
    /// media ranges by falling quality (ties in the header's order); the first that is
    /// OpenMetrics (version 1.0.0, 0.0.1 or none) or the text format (0.0.4 or none)
    /// wins; anything else (`*/*`, protobuf, no header) gets the text format.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Text;
        };
        let mut ranges: Vec<(f32, usize, &str, Option<&str>)> = Vec::new();
        for (i, part) in accept.split(',').enumerate() {
            let mut params = part.split(';').map(str::trim);
            let media = params.next().unwrap_or_default();
            let (mut q, mut version) = (1.0f32, None);
            for p in params {
                match p
                    .split_once('=')
                    .map(|(k, v)| (k.trim(), v.trim().trim_matches('"')))
                {
                    Some(("q", v)) => q = v.parse().unwrap_or(0.0),
                    Some(("version", v)) => version = Some(v),
                    _ => {}
                }
            }
            if q > 0.0 {
                ranges.push((q, i, media, version));
            }
        }
        ranges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for (_, _, media, version) in ranges {
            if media.eq_ignore_ascii_case("application/openmetrics-text")
                && matches!(version, None | Some("1.0.0") | Some("0.0.1"))
            {
                return Format::OpenMetrics;
            }
            if media.eq_ignore_ascii_case("text/plain") && matches!(version, None | Some("0.0.4")) {
                return Format::Text;
            }
        }
        Format::Text
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::Text => TEXT_CONTENT_TYPE,
            Format::OpenMetrics => OPENMETRICS_CONTENT_TYPE,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MapLabel {
    pub map: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

/// An HTTP status code, as kube-proxy labels its healthz and livez counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    pub code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TrafficPolicyLabel {
    pub traffic_policy: &'static str,
}

/// A gauge family declared untyped. kube-proxy's
/// `kubeproxy_sync_proxy_rules_no_local_endpoints_total` is a gauge with a counter's
/// `_total` suffix, which `promtool check metrics` rejects ("non-counter metrics should not
/// have _total suffix"). Declaring it untyped keeps kube-proxy's name and values (Prometheus
/// stores both kinds alike, so queries and dashboards work unchanged) and passes the lint.
#[derive(Clone, Debug)]
pub struct UntypedGauges<S: Clone + std::hash::Hash + Eq>(pub Family<S, Gauge>);

impl<S: Clone + std::hash::Hash + Eq> Default for UntypedGauges<S> {
    fn default() -> Self {
        Self(Family::default())
    }
}

impl<S: Clone + std::hash::Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync> EncodeMetric
    for UntypedGauges<S>
{
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Unknown
    }
}

impl<S: Clone + std::hash::Hash + Eq> TypedMetric for UntypedGauges<S> {
    const TYPE: MetricType = MetricType::Unknown;
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
    pub service_changes_pending: Gauge,
    pub endpoint_changes_pending: Gauge,
    pub no_local_endpoints: UntypedGauges<TrafficPolicyLabel>,
    pub healthz_answers: Family<CodeLabel, Counter>,
    pub livez_answers: Family<CodeLabel, Counter>,
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
            service_changes_pending: Gauge::default(),
            endpoint_changes_pending: Gauge::default(),
            no_local_endpoints: UntypedGauges::default(),
            healthz_answers: Family::default(),
            livez_answers: Family::default(),
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
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            m.service_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            m.endpoint_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints (a gauge, as in \
             kube-proxy; declared untyped because of its _total suffix)",
            m.no_local_endpoints.clone(),
        );
        registry.register(
            "kubeproxy_proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            m.healthz_answers.clone(),
        );
        registry.register(
            "kubeproxy_proxy_livez",
            "Cumulative proxy livez HTTP status",
            m.livez_answers.clone(),
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
            "Packets the eBPF packet path handled (from other hosts, and from pods on their \
             devices with the pod path), by what became of them: \
             new_flow, translated, dropped_no_backend, dropped_source_range, dropped_nat, \
             dropped_flow_table_full (a new flow found the flow table full), \
             icmp_translated (ICMP 'too big' errors about a flow, translated back), icmp_dropped; xdp \
             counts those XDP translated itself; refused_service_range counts socket calls \
             refused at connect/sendmsg (an address in a service range that no Service serves)",
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
            ("affinity_match", o.affinity_match),
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
            ("icmp_translated", s.icmp_translated),
            ("icmp_dropped", s.icmp_dropped),
            ("refused_service_range", s.refused_service_range),
            ("dropped_flow_table_full", s.dropped_flow_table_full),
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

    /// The services with a Local traffic policy and no local endpoint, as of the last sync.
    pub fn set_no_local_endpoints(&self, internal: usize, external: usize) {
        for (traffic_policy, n) in [("internal", internal), ("external", external)] {
            self.no_local_endpoints
                .0
                .get_or_create(&TrafficPolicyLabel { traffic_policy })
                .set(n as i64);
        }
    }

    /// The exposition, in OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The exposition in `format`.
    pub fn encode_as(&self, format: Format) -> String {
        match format {
            Format::OpenMetrics => self.encode(),
            Format::Text => to_text_format(&self.encode()),
        }
    }
}

/// Rewrites an OpenMetrics exposition (as prometheus-client writes it) into the Prometheus
/// text format 0.0.4: a counter family `x` becomes `x_total` in its HELP and TYPE lines (its
/// samples already carry the suffix), `unknown` becomes `untyped`, and what the old format
/// lacks goes (`# UNIT`, `_created` samples, `# EOF`).
pub fn to_text_format(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    // HELP comes before TYPE; it is held until TYPE tells whether the name changes.
    let mut help: Option<(&str, &str)> = None;
    let mut counter: Option<String> = None;
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            help = Some((name, text));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (name, kind) = match kind {
                "counter" => {
                    counter = Some(name.to_string());
                    (format!("{name}_total"), "counter")
                }
                "unknown" => (name.to_string(), "untyped"),
                other => (name.to_string(), other),
            };
            if kind != "counter" {
                counter = None;
            }
            if let Some((_, text)) = help.take() {
                out.push_str(&format!("# HELP {name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
        } else if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        } else if let Some(family) = &counter
            && line
                .strip_prefix(family.as_str())
                .is_some_and(|rest| rest.starts_with("_created"))
        {
            continue;
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
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
            affinity_match: 3,
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
            "fastpath_bpf_map_entries{map=\"affinity_match\"} 3",
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
    fn negotiates_as_expfmt_does() {
        use Format::*;
        for (accept, want) in [
            (None, Text),
            (Some(""), Text),
            (Some("*/*"), Text),
            (Some("text/plain;version=0.0.4"), Text),
            (Some("application/openmetrics-text"), OpenMetrics),
            (
                Some("application/openmetrics-text; version=1.0.0; charset=utf-8"),
                OpenMetrics,
            ),
            // Prometheus' own scrape header: OpenMetrics first.
            (
                Some(
                    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                ),
                OpenMetrics,
            ),
            // Quality wins over order.
            (
                Some("application/openmetrics-text;q=0.2,text/plain;version=0.0.4"),
                Text,
            ),
            (
                Some("text/plain;q=0.2, application/openmetrics-text"),
                OpenMetrics,
            ),
            // Versions we do not speak are skipped.
            (Some("application/openmetrics-text;version=2.0.0"), Text),
            (
                Some(
                    "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited",
                ),
                Text,
            ),
            (Some("application/openmetrics-text;q=0"), Text),
        ] {
            assert_eq!(Format::negotiate(accept), want, "{accept:?}");
        }
    }

    #[test]
    fn text_format_has_help_and_type_under_the_sample_names() {
        let m = Metrics::new();
        Metrics::catch_up(&m.service_changes, 2);
        m.set_no_local_endpoints(1, 0);
        m.healthz_answers
            .get_or_create(&CodeLabel { code: "200" })
            .inc();
        m.observe_sync(Duration::from_millis(3), true);
        let text = m.encode_as(Format::Text);
        for line in [
            "# HELP kubeproxy_sync_proxy_rules_service_changes_total Cumulative proxy rules Service changes.",
            "# TYPE kubeproxy_sync_proxy_rules_service_changes_total counter",
            "kubeproxy_sync_proxy_rules_service_changes_total 2",
            "# TYPE kubeproxy_sync_proxy_rules_no_local_endpoints_total untyped",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"} 1",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\"} 0",
            "# TYPE kubeproxy_proxy_healthz_total counter",
            "kubeproxy_proxy_healthz_total{code=\"200\"} 1",
            "# TYPE kubeproxy_sync_proxy_rules_service_changes_pending gauge",
            "# TYPE kubeproxy_sync_full_proxy_rules_duration_seconds histogram",
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in:\n{text}"
            );
        }
        assert!(!text.contains("# EOF") && !text.contains("# UNIT") && !text.contains("_created"));
        // Every sample's family has HELP and TYPE.
        let typed: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        for sample in text.lines().filter(|l| !l.starts_with('#')) {
            let name = sample.split(['{', ' ']).next().unwrap();
            assert!(
                typed.iter().any(|t| name == *t
                    || name
                        .strip_prefix(t)
                        .is_some_and(|r| ["_bucket", "_sum", "_count"].contains(&r))),
                "{name} has no TYPE:\n{text}"
            );
            let family = typed.iter().find(|t| name.starts_with(**t)).unwrap();
            assert!(
                text.contains(&format!("# HELP {family} ")),
                "{family} has no HELP"
            );
        }
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
