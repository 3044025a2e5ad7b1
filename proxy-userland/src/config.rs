//! Command-line flags.

use std::{path::PathBuf, time::Duration};

use clap::Parser;

#[derive(Debug, Clone, Parser)]
#[command(name = "fastpath", version, about = "A kube-proxy that load-balances Services in eBPF")]
pub struct Args {
    /// Read Services and EndpointSlices from this YAML/JSON file or folder instead of a
    /// cluster; it is re-read when it changes.
    #[arg(long, value_name = "PATH")]
    pub manifests: Option<PathBuf>,

    /// Kubeconfig file for the API server; default: in-cluster config, then $KUBECONFIG or
    /// ~/.kube/config. Ignored with --manifests.
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,

    /// The API server URL, overriding the kubeconfig's.
    #[arg(long, value_name = "URL")]
    pub master: Option<String>,

    /// The cgroup v2 whose processes get Service load-balancing. Default: the root of the
    /// cgroup2 mount (every process on the node).
    #[arg(long, value_name = "DIR")]
    pub cgroup_path: Option<PathBuf>,

    /// This node's name, used for Local traffic policies and topology; default: hostname.
    #[arg(long, value_name = "NAME")]
    pub hostname_override: Option<String>,

    /// This node's zone (topology.kubernetes.io/zone), for topology-aware routing when no
    /// Node object is available.
    #[arg(long, value_name = "ZONE")]
    pub zone: Option<String>,

    /// Only serve services labelled service.kubernetes.io/service-proxy-name=NAME.
    #[arg(long, value_name = "NAME")]
    pub service_proxy_name: Option<String>,

    /// Shortest time between two syncs; changes within it are coalesced into one sync.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
    pub min_sync_period: Duration,

    /// Longest time between two syncs: a full resync runs at least this often.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    pub sync_period: Duration,

    /// How often the manifest source checks its files for changes.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "500ms")]
    pub manifest_poll_period: Duration,

    /// Log filter (error, warn, info, debug, trace, or a tracing directive).
    #[arg(long, default_value = "info")]
    pub log_level: String,
}

impl Args {
    /// The node name: the override, else the kernel's hostname.
    pub fn node_name(&self) -> String {
        if let Some(name) = &self.hostname_override {
            return name.to_lowercase();
        }
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_lowercase())
            .unwrap_or_else(|_| "localhost".to_string())
    }
}

/// The cgroup2 mount point, from /proc/self/mounts.
pub fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_dev, dir, fstype) = (fields.next()?, fields.next()?, fields.next()?);
        (fstype == "cgroup2").then(|| PathBuf::from(dir))
    })
}
