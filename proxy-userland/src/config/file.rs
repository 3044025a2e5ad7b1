//! The `--config` file: kube-proxy's `KubeProxyConfiguration` (kubeproxy.config.k8s.io/v1alpha1)
//! as YAML or JSON, plus fastpath's own settings under `fastpath:`.
//!
//! Decoding is strict as kube-proxy's is: an unknown field is an error, not a silent no-op,
//! so a typo never leaves a setting at its default unnoticed. kube-proxy fields that fastpath
//! has no use for (`ipvs`, `featureGates`, ...) are accepted, so that a kubeadm-made file
//! loads, and reported as ignored. Only the shape is checked here; the values are checked
//! when they are merged into the flags (see [`super::Args::merge_file`]), where each error
//! names its field.

use std::{io::Read, path::Path};

use serde::{Deserialize, de::IgnoredAny as Value};

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";
/// A KubeProxyConfiguration is a few kilobytes; anything this large is not one.
pub const MAX_BYTES: u64 = 1 << 20;

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    pub api_version: Option<String>,
    pub kind: Option<String>,

    pub bind_address: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub bind_address_hard_fail: Option<bool>,
    pub mode: Option<String>,
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: Option<String>,
    pub detect_local_mode: Option<String>,
    pub iptables: Option<Iptables>,
    pub node_port_addresses: Option<Vec<String>>,
    pub hostname_override: Option<String>,
    pub conntrack: Option<Conntrack>,
    pub oom_score_adj: Option<i32>,
    /// Since Kubernetes 1.31 the periods also live at the top level; they win over
    /// `iptables.*`, as in kube-proxy.
    pub sync_period: Option<String>,
    pub min_sync_period: Option<String>,
    pub client_connection: Option<ClientConnection>,
    pub logging: Option<Logging>,

    /// fastpath's own settings; a file with this key is not for kube-proxy.
    pub fastpath: Option<Fastpath>,

    // kube-proxy fields without meaning here: accepted, reported by `ignored_fields`.
    pub feature_gates: Option<Value>,
    pub enable_profiling: Option<Value>,
    pub show_hidden_metrics_for_version: Option<Value>,
    pub ipvs: Option<Value>,
    pub nftables: Option<Value>,
    pub winkernel: Option<Value>,
    pub detect_local: Option<DetectLocal>,
    pub config_sync_period: Option<Value>,
    pub port_range: Option<Value>,
    pub windows_run_as_service: Option<Value>,
    pub udp_idle_timeout: Option<Value>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Iptables {
    pub masquerade_bit: Option<i32>,
    pub masquerade_all: Option<bool>,
    pub min_sync_period: Option<String>,
    pub sync_period: Option<String>,
    pub localhost_nodeports: Option<Value>,
}

/// What `detectLocalMode` BridgeInterface and InterfaceNamePrefix match on.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DetectLocal {
    pub bridge_interface: Option<String>,
    pub interface_name_prefix: Option<String>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Conntrack {
    pub max_per_core: Option<i32>,
    pub min: Option<i32>,
    pub tcp_established_timeout: Option<String>,
    pub tcp_close_wait_timeout: Option<String>,
    pub tcp_be_liberal: Option<bool>,
    pub udp_timeout: Option<Value>,
    pub udp_stream_timeout: Option<Value>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClientConnection {
    pub kubeconfig: Option<String>,
    pub accept_content_types: Option<Value>,
    pub content_type: Option<Value>,
    pub qps: Option<Value>,
    pub burst: Option<Value>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Logging {
    /// `text` or `json`.
    pub format: Option<String>,
    /// klog verbosity: 0-3 is info, 4 debug, 5 and up trace.
    pub verbosity: Option<u32>,
    pub flush_frequency: Option<Value>,
    pub vmodule: Option<Value>,
    pub options: Option<Value>,
}

/// Settings kube-proxy does not have, in the camelCase of their flags.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Fastpath {
    pub manifests: Option<String>,
    pub manifest_poll_period: Option<String>,
    pub cgroup_path: Option<String>,
    pub zone: Option<String>,
    pub service_proxy_name: Option<String>,
    pub healthcheck_bind_address: Option<String>,
    /// Apply `conntrack` and `oomScoreAdj` to the node (off unless set: a developer's
    /// machine keeps its sysctls).
    pub node_setup: Option<bool>,
    pub log_level: Option<String>,
    /// `--pod-interfaces`: "auto" or "none".
    pub pod_interfaces: Option<String>,
    /// `--bpf-host-routing`: "auto", "true" or "false".
    pub bpf_host_routing: Option<String>,
    /// `--service-cluster-ip-range`: comma-separated, one CIDR per family.
    #[serde(rename = "serviceClusterIPRange")]
    pub service_cluster_ip_range: Option<String>,
    /// The eBPF dataplane's tunables (see `super::tunables`), as their flags take them.
    pub bpf_lb_map_max: Option<u64>,
    pub bpf_ct_max: Option<u64>,
    pub conntrack_gc_interval: Option<String>,
    pub bpf_lb_algorithm: Option<String>,
    pub bpf_lb_maglev_table_size: Option<u64>,
    pub bpf_lb_maglev_hash_seed: Option<u64>,
    pub bpf_lb_mode: Option<String>,
}

/// Why a config file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("config file {path}: {source}")]
    Parse {
        path: String,
        // Boxed: the reader's error is large, and every config Result carries it.
        source: Box<serde_saphyr::Error>,
    },
    #[error("config file {path}: {field}: {message}")]
    Decode {
        path: String,
        field: String,
        message: String,
    },
    #[error("config file {path}: larger than {MAX_BYTES} bytes; not a KubeProxyConfiguration")]
    TooLarge { path: String },
    #[error("config file {path}: {field} must be {expected:?}, not {found:?}")]
    Header {
        path: String,
        field: &'static str,
        expected: &'static str,
        found: String,
    },
}

impl KubeProxyConfiguration {
    pub fn load(path: &Path) -> Result<Self, FileError> {
        let origin = path.display().to_string();
        let read_error = |source| FileError::Read {
            path: origin.clone(),
            source,
        };
        // Bounded read: `--config /dev/zero` must fail, not fill memory.
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_BYTES + 1).read_to_string(&mut text))
            .map_err(read_error)?;
        if text.len() as u64 > MAX_BYTES {
            return Err(FileError::TooLarge { path: origin });
        }
        Self::parse(&text, &origin)
    }

    /// Parses one document; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, FileError> {
        // YAML to a tree first (with the reader's budgets), then to the struct with the field
        // path in any error: `conntrack.maxPerCore: invalid type ...`.
        let tree: serde_json::Value = serde_saphyr::from_str_with_options(text, yaml_options())
            .map_err(|source| FileError::Parse {
                path: origin.to_string(),
                source: Box::new(source),
            })?;
        let cfg: Self = serde_path_to_error::deserialize(&tree).map_err(|e| {
            let field = e.path().to_string();
            FileError::Decode {
                path: origin.to_string(),
                field,
                message: e.into_inner().to_string(),
            }
        })?;
        for (field, expected, found) in [
            ("apiVersion", API_VERSION, &cfg.api_version),
            ("kind", KIND, &cfg.kind),
        ] {
            if found.as_deref() != Some(expected) {
                return Err(FileError::Header {
                    path: origin.to_string(),
                    field,
                    expected,
                    found: found.clone().unwrap_or_default(),
                });
            }
        }
        Ok(cfg)
    }

    /// The kube-proxy fields present in the file that fastpath does not use.
    pub fn ignored_fields(&self) -> Vec<&'static str> {
        let top = [
            ("featureGates", self.feature_gates.is_some()),
            ("enableProfiling", self.enable_profiling.is_some()),
            (
                "showHiddenMetricsForVersion",
                self.show_hidden_metrics_for_version.is_some(),
            ),
            ("ipvs", self.ipvs.is_some()),
            ("nftables", self.nftables.is_some()),
            ("winkernel", self.winkernel.is_some()),
            ("configSyncPeriod", self.config_sync_period.is_some()),
            ("portRange", self.port_range.is_some()),
            ("windowsRunAsService", self.windows_run_as_service.is_some()),
            ("udpIdleTimeout", self.udp_idle_timeout.is_some()),
        ];
        let ipt = self.iptables.as_ref();
        let ct = self.conntrack.as_ref();
        let cc = self.client_connection.as_ref();
        let log = self.logging.as_ref();
        let nested = [
            (
                "iptables.localhostNodePorts",
                ipt.is_some_and(|i| i.localhost_nodeports.is_some()),
            ),
            (
                "conntrack.udpTimeout",
                ct.is_some_and(|c| c.udp_timeout.is_some()),
            ),
            (
                "conntrack.udpStreamTimeout",
                ct.is_some_and(|c| c.udp_stream_timeout.is_some()),
            ),
            (
                "clientConnection.acceptContentTypes",
                cc.is_some_and(|c| c.accept_content_types.is_some()),
            ),
            (
                "clientConnection.contentType",
                cc.is_some_and(|c| c.content_type.is_some()),
            ),
            ("clientConnection.qps", cc.is_some_and(|c| c.qps.is_some())),
            (
                "clientConnection.burst",
                cc.is_some_and(|c| c.burst.is_some()),
            ),
            (
                "logging.flushFrequency",
                log.is_some_and(|l| l.flush_frequency.is_some()),
            ),
            ("logging.vmodule", log.is_some_and(|l| l.vmodule.is_some())),
            ("logging.options", log.is_some_and(|l| l.options.is_some())),
        ];
        top.into_iter()
            .chain(nested)
            .filter(|(_, set)| *set)
            .map(|(name, _)| name)
            .collect()
    }
}

/// The YAML reader's limits for a config file: one small document, shallow.
fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_documents: 1,
            max_depth: 16,
            max_nodes: 10_000,
            max_events: 100_000,
            max_total_scalar_bytes: MAX_BYTES as usize,
        },
        with_snippet: false,
    }
}
