//! Command-line flags, and the `--config` file they override.
//!
//! Flags are named as kube-proxy's where kube-proxy has the setting. `--config FILE` reads a
//! KubeProxyConfiguration ([`file`]); a flag given on the command line wins over the file,
//! the file wins over a flag's default. Every value is checked once, at start-up, by
//! [`Args::from_matches`]: a bad one stops the daemon with a message naming the flag or field.

pub mod file;
pub mod mode;
mod tunables;
pub mod values;

use std::{
    fmt,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    str::FromStr,
    time::Duration,
};

use clap::{ArgMatches, FromArgMatches, Parser, ValueEnum, parser::ValueSource};
pub use file::KubeProxyConfiguration;
pub use values::{Cidr, HostRouting, LogLevel, NodePortAddress};

use self::mode::Mode;
use crate::{
    model::{LbAlgorithm, LbMode},
    node_setup::NodeSetup,
};

#[derive(Debug, Clone, Parser)]
#[command(
    name = "fastpath",
    version,
    about = "A kube-proxy that load-balances Services in eBPF"
)]
// The last occurrence of a flag wins, as with kube-proxy's flags; wrappers can then append
// overrides to a fixed command line.
#[command(args_override_self = true)]
pub struct Args {
    /// A KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1) YAML or JSON file; flags
    /// given on the command line override it.
    #[arg(long, value_name = "FILE", value_parser = values::path)]
    pub config: Option<PathBuf>,

    /// Read Services and EndpointSlices from this YAML/JSON file or folder instead of a
    /// cluster; it is re-read when it changes.
    #[arg(long, value_name = "PATH", value_parser = values::path)]
    pub manifests: Option<PathBuf>,

    /// Kubeconfig file for the API server; default: in-cluster config, then $KUBECONFIG or
    /// ~/.kube/config. Ignored with --manifests.
    #[arg(long, value_name = "FILE", value_parser = values::path)]
    pub kubeconfig: Option<PathBuf>,

    /// The API server URL, overriding the kubeconfig's.
    #[arg(long, value_name = "URL", value_parser = values::url)]
    pub master: Option<String>,

    /// The cgroup v2 whose processes get Service load-balancing. Default: the root of the
    /// cgroup2 mount (every process on the node).
    #[arg(long, value_name = "DIR", value_parser = values::path)]
    pub cgroup_path: Option<PathBuf>,

    /// Pin the eBPF maps and program links in this bpffs folder (e.g. /sys/fs/bpf/fastpath)
    /// so a restart or upgrade keeps Services working while no daemon runs; the next daemon
    /// adopts what is there. Without it, everything goes when the daemon exits.
    #[arg(long, value_name = "DIR", value_parser = values::path)]
    pub bpf_pin_dir: Option<PathBuf>,

    /// Entries of the eBPF service and backend maps (as Cilium's --bpf-lb-map-max); default:
    /// 262144 service entries and 131072 backends. Services that do not fit fail one by one,
    /// with an error and an Event, and the rest keep working.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=16_777_216))]
    pub bpf_lb_map_max: Option<u32>,

    /// Entries of each address family's eBPF flow table (node ports, external and
    /// load-balancer IPs, the pod path), two per flow; default 262144. Cilium splits it
    /// between --bpf-ct-global-tcp-max and --bpf-ct-global-any-max. A new flow that finds
    /// the table full is dropped and counted, and the table is collected at once.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(16..=16_777_216))]
    pub bpf_ct_max: Option<u32>,

    /// How often idle entries of the eBPF flow table are collected (Cilium's flag; at least
    /// 1s). A table that fills up is collected within a second whatever this says.
    #[arg(long, value_parser = values::interval, default_value = "30s")]
    pub conntrack_gc_interval: Duration,

    /// How the packet path (node ports, external and load-balancer IPs) picks a new flow's
    /// backend: `random`, or `maglev` (every node picks the same backend for a flow, so a
    /// flow moved between nodes keeps it). A Service's `service.cilium.io/lb-algorithm`
    /// annotation overrides it.
    #[arg(long, value_enum, default_value_t = LbAlgorithm::Random)]
    pub bpf_lb_algorithm: LbAlgorithm,

    /// Entries of each Maglev table: a prime of Cilium's list (251, 509, 1021, 2039, 4093,
    /// 8191, 16381, 32749, 65521, 131071), well above 100 times a Service's backends.
    /// Each table costs 4 bytes an entry.
    #[arg(long, value_name = "M", default_value_t = proxy_common::maglev::DEFAULT_TABLE_SIZE, value_parser = values::maglev_table_size)]
    pub bpf_lb_maglev_table_size: u32,

    /// Seed of the Maglev hashes; must be the same on every node.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub bpf_lb_maglev_hash_seed: u32,

    /// How traffic from other hosts reaches a backend on another node: `snat` (replies come
    /// back through the entry node), `dsr` (the backend's node answers the client
    /// directly), or `hybrid` (DSR for TCP, SNAT for UDP).
    #[arg(long, value_enum, default_value_t = LbMode::Snat)]
    pub bpf_lb_mode: LbMode,

    /// Remove everything fastpath left on this node (pinned eBPF objects in --bpf-pin-dir
    /// or /sys/fs/bpf/fastpath, iptables chains) and exit, like kube-proxy --cleanup.
    #[arg(long)]
    pub cleanup: bool,

    /// This node's name, used for Local traffic policies and topology; default: hostname.
    #[arg(long, value_name = "NAME", value_parser = values::node_name)]
    pub hostname_override: Option<String>,

    /// This node's zone (topology.kubernetes.io/zone), for topology-aware routing when no
    /// Node object is available.
    #[arg(long, value_name = "ZONE", value_parser = values::label_value)]
    pub zone: Option<String>,

    /// Only serve services labelled service.kubernetes.io/service-proxy-name=NAME.
    #[arg(long, value_name = "NAME", value_parser = values::label_value)]
    pub service_proxy_name: Option<String>,

    /// Shortest time between two syncs; changes within it are coalesced into one sync.
    #[arg(long, value_parser = values::duration, default_value = "0s")]
    pub min_sync_period: Duration,

    /// Longest time between two syncs: a full resync runs at least this often. /healthz
    /// fails when pending changes wait longer than twice this.
    #[arg(long, value_parser = values::duration, default_value = "30s")]
    pub sync_period: Duration,

    /// How often the manifest source checks its files for changes (inotify wakes it sooner
    /// where the file system reports changes).
    #[arg(long, value_parser = values::duration, default_value = "500ms")]
    pub manifest_poll_period: Duration,

    /// Log filter (error, warn, info, debug, trace, or a tracing directive).
    #[arg(long, value_name = "LEVEL", default_value = "info")]
    pub log_level: LogLevel,

    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Where /healthz, /livez and /readyz are served (IP:PORT; empty: not served).
    #[arg(long, value_name = "IP:PORT", default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: Listen,

    /// Where /metrics is served (IP:PORT; empty: not served).
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: Listen,

    /// Exit when the health or metrics port cannot be bound, instead of retrying.
    #[arg(long, default_value_t = false)]
    pub bind_address_hard_fail: bool,

    /// The address the per-service health check node port servers (externalTrafficPolicy:
    /// Local load balancers) listen on.
    #[arg(long, value_name = "IP", default_value = "0.0.0.0")]
    pub healthcheck_bind_address: IpAddr,

    /// kube-proxy's --bind-address: when not unspecified, the node's primary IP of its
    /// family for `--nodeport-addresses primary`; the proxies themselves do not bind to it.
    #[arg(long, value_name = "IP")]
    pub bind_address: Option<IpAddr>,

    /// The pods' CIDRs, comma-separated (for dataplanes that tell local traffic apart).
    #[arg(long, value_name = "CIDR[,CIDR]", value_delimiter = ',', action = clap::ArgAction::Set)]
    pub cluster_cidr: Vec<Cidr>,

    /// The service ranges ClusterIPs come from, comma-separated, one per family at most
    /// (kube-apiserver's flag). With the ServiceCIDR objects' ranges, new traffic to an
    /// address inside them that no Service serves is refused instead of routed on.
    #[arg(long, value_name = "CIDR[,CIDR]", value_delimiter = ',', action = clap::ArgAction::Set)]
    pub service_cluster_ip_range: Vec<Cidr>,

    /// How pods' traffic is told apart (iptables mode: which traffic to a Service is
    /// masqueraded, and which skips externalTrafficPolicy Local): ClusterCIDR (sources in
    /// --cluster-cidr; default), NodeCIDR (sources in the Node's spec.podCIDRs),
    /// BridgeInterface (in on --pod-bridge-interface) or InterfaceNamePrefix (in on a device
    /// named --pod-interface-name-prefix*).
    #[arg(long, value_name = "MODE")]
    pub detect_local_mode: Option<String>,

    /// The bridge pods' traffic comes in on, for --detect-local-mode BridgeInterface.
    #[arg(long, value_name = "DEV")]
    pub pod_bridge_interface: Option<String>,

    /// Masquerade all traffic sent to Services (NAT dataplanes only).
    #[arg(long, default_value_t = false)]
    pub masquerade_all: bool,

    /// iptables mode: the tools to run, "system" (whatever `iptables` is), "legacy" or
    /// "nft": for a node whose other software uses the other one. Both restore 10,000
    /// services in seconds; nft applies one change far faster (see docs/benchmarks.md).
    #[arg(long, value_name = "BACKEND", default_value = "system", value_parser = ["system", "legacy", "nft"])]
    pub iptables_backend: String,

    /// The fwmark bit (0-31) that marks packets to masquerade (NAT dataplanes only).
    #[arg(long = "iptables-masquerade-bit", default_value_t = 14,
          value_parser = clap::value_parser!(u8).range(0..=31))]
    pub masquerade_bit: u8,

    /// Addresses node ports are served on: CIDRs, or "primary" (default: all): the node's
    /// primary IP per family, from --bind-address, else the Node's addresses, else the
    /// default route's device; decided at start-up, which fails if none is found.
    #[arg(
        long = "nodeport-addresses",
        value_name = "CIDR",
        value_delimiter = ',',
        action = clap::ArgAction::Set
    )]
    pub node_port_addresses: Vec<NodePortAddress>,

    /// eBPF mode: the devices whose traffic from other hosts gets node ports, external IPs
    /// and load-balancer IPs (tc programs on each): names, "auto" (the devices of the IPv4
    /// default routes; without one, the packet path is off with a warning) or "none".
    #[arg(
        long = "nodeport-devices",
        value_name = "DEV",
        value_delimiter = ',',
        default_value = "auto",
        value_parser = values::device_name,
        // A later occurrence replaces the list, as for every other flag.
        action = clap::ArgAction::Set
    )]
    pub nodeport_devices: Vec<String>,

    /// The pods' devices (host side) start with this (kube-proxy's, for
    /// --detect-local-mode=InterfaceNamePrefix). In eBPF mode it also turns on per-packet
    /// Service translation on those devices (tc), found as pods come and go: pods' UDP is
    /// translated there instead of at the socket (a connected UDP client moves on by itself
    /// when its backend leaves), and with --bpf-socket-lb-host-namespace-only all of their
    /// traffic. Comma-separated for several prefixes.
    #[arg(long, value_name = "PREFIX", value_delimiter = ',', action = clap::ArgAction::Set)]
    pub pod_interface_name_prefix: Vec<String>,

    /// eBPF: "auto" also takes as pods' devices (see --pod-interface-name-prefix) the veth
    /// devices of this namespace whose peer is in another network namespace, but for any
    /// that holds one of the node's addresses (those of the default routes' devices, and
    /// --bind-address): pods' devices found without knowing the CNI's prefix. "none": only
    /// the prefixes.
    #[arg(long = "pod-interfaces", value_name = "MODE", default_value = "none",
          value_parser = ["auto", "none"])]
    pub pod_interfaces: String,

    /// eBPF: socket load-balancing for the host's network namespace only (Cilium's
    /// socketLB.hostNamespaceOnly); pods' sockets keep the ClusterIP they dialled and their
    /// packets are translated on their devices (needs --pod-interface-name-prefix).
    #[arg(long, default_value_t = false)]
    pub bpf_socket_lb_host_namespace_only: bool,

    /// eBPF pod path: a translated packet for a pod on this node goes straight into that
    /// pod's namespace (bpf_redirect_peer, as Cilium's BPF host routing), and its reply
    /// straight out, skipping the host's routing and netfilter. "auto" (the default): only
    /// while no netfilter hook a forwarded packet crosses holds more than counters, logging
    /// and accepts, so that a CNI's NetworkPolicy or a firewall there is never skipped;
    /// "true" (the flag alone): always; "false": never.
    #[arg(long, value_enum, value_name = "WHEN", num_args = 0..=1,
          default_value_t = HostRouting::Auto, default_missing_value = "true")]
    pub bpf_host_routing: HostRouting,

    /// eBPF: "native" runs the node-port ingress work in XDP ahead of tc on devices whose
    /// driver supports native XDP (the others keep tc); "disabled" uses tc alone.
    #[arg(long = "nodeport-acceleration", value_name = "MODE", default_value = "disabled",
          value_parser = ["native", "disabled"])]
    pub nodeport_acceleration: String,

    /// Apply the conntrack and OOM settings to the node (kube-proxy does so always; off by
    /// default here so that running on a workstation never changes its sysctls).
    #[arg(long, default_value_t = false)]
    pub node_setup: bool,

    /// Never change the node, even when the config file asks to (wins over --node-setup).
    #[arg(long, default_value_t = false)]
    pub skip_node_setup: bool,

    /// nf_conntrack_max is max(this x CPUs, --conntrack-min); 0 leaves it alone.
    #[arg(long, default_value_t = 32768)]
    pub conntrack_max_per_core: u32,

    /// The least nf_conntrack_max, whatever the CPU count.
    #[arg(long, default_value_t = 131072)]
    pub conntrack_min: u32,

    /// nf_conntrack_tcp_timeout_established; 0 leaves it alone.
    #[arg(long, value_parser = values::seconds, default_value = "24h")]
    pub conntrack_tcp_timeout_established: Duration,

    /// nf_conntrack_tcp_timeout_close_wait; 0 leaves it alone.
    #[arg(long, value_parser = values::seconds, default_value = "1h")]
    pub conntrack_tcp_timeout_close_wait: Duration,

    /// Set nf_conntrack_tcp_be_liberal (with --node-setup), so that conntrack marks no
    /// out-of-window TCP packet INVALID, and leave out the rule that drops INVALID packets
    /// forwarded to Services (iptables mode), as kube-proxy does.
    #[arg(long, default_value_t = false)]
    pub conntrack_tcp_be_liberal: bool,

    /// The daemon's /proc/self/oom_score_adj, -1000..1000.
    #[arg(long, default_value_t = -999, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i32).range(-1000..=1000))]
    pub oom_score_adj: i32,

    /// The dataplane: ebpf, iptables or userspace. Default: the best this node can run
    /// (eBPF, else iptables, else userspace), with the reasons logged. A mode the node
    /// cannot run is refused with the reasons.
    #[arg(long, value_enum, value_name = "MODE")]
    pub proxy_mode: Option<Mode>,

    /// Run the iptables and userspace proxiers in the network namespace /run/netns/NAME
    /// instead of our own: for tests (a test bed's node namespace), and for proxying one
    /// namespace from outside it.
    #[arg(long, value_name = "NAME", value_parser = values::netns_name)]
    pub netns: Option<String>,

    /// Remove the iptables and userspace proxiers' rules when stopping. By default they stay,
    /// as kube-proxy's do, so Services keep working while the proxy restarts.
    #[arg(long, default_value_t = false)]
    pub cleanup_on_exit: bool,

    /// The config file's `mode` (`--proxy-mode` on the command line wins over it).
    #[arg(skip)]
    pub file_mode: Option<Mode>,

    /// The config file's `iptables.minSyncPeriod`, when neither `--min-sync-period` nor the
    /// file's top-level `minSyncPeriod` is given: the iptables mode's alone (see
    /// [`Args::min_sync_period_for`]).
    #[arg(skip)]
    pub iptables_min_sync_period: Option<Duration>,

    /// Notes from loading the config file (ignored fields), logged once logging is up.
    #[arg(skip)]
    pub config_warnings: Vec<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// A listen address: `IP:PORT`, or empty for "do not serve".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Listen(pub Option<SocketAddr>);

impl FromStr for Listen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(Listen(None));
        }
        s.parse()
            .map(|a| Listen(Some(a)))
            .map_err(|_| format!("{s:?} is not IP:PORT (e.g. 0.0.0.0:10256 or [::]:10256)"))
    }
}

impl fmt::Display for Listen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(a) => write!(f, "{a}"),
            None => Ok(()),
        }
    }
}

/// A flag or config value that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Cli(#[from] clap::Error),
    #[error(transparent)]
    File(#[from] file::FileError),
    #[error("{origin}: {field}: {message}")]
    Invalid {
        origin: String,
        field: String,
        message: String,
    },
}

pub const LOCAL_MODE_CLUSTER: &str = "ClusterCIDR";
pub const LOCAL_MODE_NODE: &str = "NodeCIDR";
pub const LOCAL_MODE_BRIDGE: &str = "BridgeInterface";
pub const LOCAL_MODE_PREFIX: &str = "InterfaceNamePrefix";
const DETECT_LOCAL_MODES: &[&str] = &[
    LOCAL_MODE_CLUSTER,
    LOCAL_MODE_NODE,
    LOCAL_MODE_BRIDGE,
    LOCAL_MODE_PREFIX,
];

/// A detect-local setting's name as a flag and as a config file field, for errors.
#[derive(Debug)]
struct DetectLocalField {
    flag: &'static str,
    file: &'static str,
}

impl Args {
    /// Parses the command line and the config file it names, merged and checked.
    pub fn from_matches(matches: &ArgMatches) -> Result<Self, ConfigError> {
        let mut args = Args::from_arg_matches(matches)?;
        if let Some(path) = args.config.clone() {
            let cfg = KubeProxyConfiguration::load(&path)?;
            let given = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
            args.merge_file(&cfg, &path.display().to_string(), given)?;
        }
        args.validate()?;
        Ok(args)
    }

    /// `from_matches` on an argument list (tests, wrappers).
    pub fn try_from_iter<I, T>(iter: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::CommandFactory;
        let matches = Args::command().try_get_matches_from(iter)?;
        Self::from_matches(&matches)
    }

    /// Takes every setting of `cfg` that was not `given` on the command line. Empty strings
    /// and zero periods count as unset, as kube-proxy's defaulting treats them, so that a
    /// kubeadm-generated file (full of `""` and `0s`) changes nothing it does not mean to.
    pub fn merge_file(
        &mut self,
        cfg: &KubeProxyConfiguration,
        origin: &str,
        given: impl Fn(&str) -> bool,
    ) -> Result<(), ConfigError> {
        let invalid = |field: &str, message: String| ConfigError::Invalid {
            origin: origin.to_string(),
            field: field.to_string(),
            message,
        };
        let duration = |field: &str, s: &Option<String>| typed(origin, field, s, values::duration);
        let seconds = |field: &str, s: &Option<String>| typed(origin, field, s, values::seconds);
        let listen = |field: &str, s: &Option<String>| -> Result<Option<Listen>, ConfigError> {
            set(s)
                .map(|s| s.parse::<Listen>().map_err(|e| invalid(field, e)))
                .transpose()
        };

        if let (Some(v), false) = (
            listen("healthzBindAddress", &cfg.healthz_bind_address)?,
            given("healthz_bind_address"),
        ) {
            self.healthz_bind_address = v;
        }
        if let (Some(v), false) = (
            listen("metricsBindAddress", &cfg.metrics_bind_address)?,
            given("metrics_bind_address"),
        ) {
            self.metrics_bind_address = v;
        }
        if let (Some(v), false) = (cfg.bind_address_hard_fail, given("bind_address_hard_fail")) {
            self.bind_address_hard_fail = v;
        }
        if let Some(s) = set(&cfg.bind_address) {
            let ip = s
                .parse()
                .map_err(|_| invalid("bindAddress", format!("{s:?} is not an IP address")))?;
            if !given("bind_address") {
                self.bind_address = Some(ip);
            }
        }
        if let Some(mode) = set(&cfg.mode) {
            // kube-proxy's ipvs is not among ours: refused, not approximated.
            self.file_mode = Some(mode.parse::<Mode>().map_err(|e| invalid("mode", e))?);
        }
        if let (Some(s), false) = (set(&cfg.cluster_cidr), given("cluster_cidr")) {
            self.cluster_cidr = s
                .split(',')
                .map(str::parse)
                .collect::<Result<_, _>>()
                .map_err(|m| invalid("clusterCIDR", m))?;
            check_cidrs(&self.cluster_cidr).map_err(|m| invalid("clusterCIDR", m))?;
        }
        if let (Some(s), false) = (set(&cfg.detect_local_mode), given("detect_local_mode")) {
            self.detect_local_mode = Some(s);
        }
        // detectLocal's names count only for the mode that reads them, as in kube-proxy: a
        // prefix left there must not turn on the eBPF pod path.
        let detect = cfg.detect_local.clone().unwrap_or_default();
        match self.detect_local_mode.as_deref() {
            Some(LOCAL_MODE_BRIDGE) => {
                if let (Some(s), false) =
                    (set(&detect.bridge_interface), given("pod_bridge_interface"))
                {
                    self.pod_bridge_interface = Some(s);
                }
            }
            Some(LOCAL_MODE_PREFIX) => {
                if let (Some(s), false) = (
                    set(&detect.interface_name_prefix),
                    given("pod_interface_name_prefix"),
                ) {
                    self.pod_interface_name_prefix = vec![s];
                }
            }
            _ => {}
        }
        self.check_detect_local_mode()
            .map_err(|(field, m)| invalid(field.file, m))?;
        if let (Some(list), false) = (&cfg.node_port_addresses, given("node_port_addresses")) {
            self.node_port_addresses = list
                .iter()
                .map(|a| a.parse())
                .collect::<Result<_, _>>()
                .map_err(|m| invalid("nodePortAddresses", m))?;
            check_node_port_addresses(&self.node_port_addresses)
                .map_err(|m| invalid("nodePortAddresses", m))?;
        }
        if let (Some(s), false) = (set(&cfg.hostname_override), given("hostname_override")) {
            self.hostname_override =
                Some(values::node_name(&s).map_err(|m| invalid("hostnameOverride", m))?);
        }
        if let (Some(v), false) = (cfg.oom_score_adj, given("oom_score_adj")) {
            check_oom(v).map_err(|m| invalid("oomScoreAdj", m))?;
            self.oom_score_adj = v;
        }

        // Periods: top-level, else iptables.*, as kube-proxy 1.31+ reads them; but
        // iptables.minSyncPeriod holds back the iptables mode only, as it does kube-proxy's
        // iptables proxier and no other (see min_sync_period_for).
        let ipt = cfg.iptables.clone().unwrap_or_default();
        let sync = match duration("syncPeriod", &cfg.sync_period)? {
            Some(d) => Some(d),
            None => duration("iptables.syncPeriod", &ipt.sync_period)?,
        };
        if let (Some(d), false) = (sync.filter(|d| !d.is_zero()), given("sync_period")) {
            self.sync_period = d;
        }
        let min_sync = duration("minSyncPeriod", &cfg.min_sync_period)?;
        let iptables_min_sync = duration("iptables.minSyncPeriod", &ipt.min_sync_period)?;
        if !given("min_sync_period") {
            match min_sync {
                Some(d) => self.min_sync_period = d,
                None => self.iptables_min_sync_period = iptables_min_sync,
            }
        }
        if let (Some(bit), false) = (ipt.masquerade_bit, given("masquerade_bit")) {
            self.masquerade_bit = u8::try_from(bit).ok().filter(|b| *b <= 31).ok_or_else(|| {
                invalid(
                    "iptables.masqueradeBit",
                    format!("{bit} is not a bit number 0-31"),
                )
            })?;
        }
        if let (Some(v), false) = (ipt.masquerade_all, given("masquerade_all")) {
            self.masquerade_all = v;
        }

        let ct = cfg.conntrack.clone().unwrap_or_default();
        let count = |field: &str, v: i32| {
            u32::try_from(v).map_err(|_| invalid(field, format!("{v} is negative")))
        };
        if let (Some(v), false) = (ct.max_per_core, given("conntrack_max_per_core")) {
            self.conntrack_max_per_core = count("conntrack.maxPerCore", v)?;
        }
        if let (Some(v), false) = (ct.min, given("conntrack_min")) {
            self.conntrack_min = count("conntrack.min", v)?;
        }
        if let (Some(d), false) = (
            seconds(
                "conntrack.tcpEstablishedTimeout",
                &ct.tcp_established_timeout,
            )?,
            given("conntrack_tcp_timeout_established"),
        ) {
            self.conntrack_tcp_timeout_established = d;
        }
        if let (Some(d), false) = (
            seconds("conntrack.tcpCloseWaitTimeout", &ct.tcp_close_wait_timeout)?,
            given("conntrack_tcp_timeout_close_wait"),
        ) {
            self.conntrack_tcp_timeout_close_wait = d;
        }
        if let (Some(v), false) = (ct.tcp_be_liberal, given("conntrack_tcp_be_liberal")) {
            self.conntrack_tcp_be_liberal = v;
        }

        if let Some(cc) = &cfg.client_connection
            && let (Some(path), None) = (
                typed(
                    origin,
                    "clientConnection.kubeconfig",
                    &cc.kubeconfig,
                    values::path,
                )?,
                &self.kubeconfig,
            )
        {
            self.kubeconfig = Some(path);
        }
        if let Some(log) = &cfg.logging {
            if let (Some(format), false) = (set(&log.format), given("log_format")) {
                self.log_format =
                    <LogFormat as ValueEnum>::from_str(&format, true).map_err(|_| {
                        invalid(
                            "logging.format",
                            format!("{format:?} is not a log format (text or json)"),
                        )
                    })?;
            }
            if let (Some(v), false) = (log.verbosity, given("log_level")) {
                self.log_level = LogLevel::from_verbosity(v);
            }
        }

        if let Some(fp) = &cfg.fastpath {
            let manifests = typed(origin, "fastpath.manifests", &fp.manifests, values::path)?;
            let cgroup_path = typed(origin, "fastpath.cgroupPath", &fp.cgroup_path, values::path)?;
            let zone = typed(origin, "fastpath.zone", &fp.zone, values::label_value)?;
            let proxy_name = typed(
                origin,
                "fastpath.serviceProxyName",
                &fp.service_proxy_name,
                values::label_value,
            )?;
            self.manifests = self.manifests.take().or(manifests);
            self.cgroup_path = self.cgroup_path.take().or(cgroup_path);
            self.zone = self.zone.take().or(zone);
            self.service_proxy_name = self.service_proxy_name.take().or(proxy_name);
            if let (Some(d), false) = (
                duration("fastpath.manifestPollPeriod", &fp.manifest_poll_period)?,
                given("manifest_poll_period"),
            ) {
                self.manifest_poll_period = d;
            }
            if let (Some(s), false) = (
                set(&fp.healthcheck_bind_address),
                given("healthcheck_bind_address"),
            ) {
                self.healthcheck_bind_address = s.parse().map_err(|_| {
                    invalid(
                        "fastpath.healthcheckBindAddress",
                        format!("{s:?} is not an IP address"),
                    )
                })?;
            }
            if let (Some(v), false) = (set(&fp.pod_interfaces), given("pod_interfaces")) {
                if v != "auto" && v != "none" {
                    return Err(invalid(
                        "fastpath.podInterfaces",
                        format!("{v:?} is neither \"auto\" nor \"none\""),
                    ));
                }
                self.pod_interfaces = v;
            }
            if let (Some(v), false) = (set(&fp.bpf_host_routing), given("bpf_host_routing")) {
                self.bpf_host_routing = HostRouting::from_str(&v, false).map_err(|_| {
                    invalid(
                        "fastpath.bpfHostRouting",
                        format!("{v:?} is not \"auto\", \"true\" or \"false\""),
                    )
                })?;
            }
            if let (Some(s), false) = (
                set(&fp.service_cluster_ip_range),
                given("service_cluster_ip_range"),
            ) {
                let field = "fastpath.serviceClusterIPRange";
                self.service_cluster_ip_range = s
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()
                    .map_err(|m| invalid(field, m))?;
                check_cidrs(&self.service_cluster_ip_range).map_err(|m| invalid(field, m))?;
            }
            if let (Some(v), false) = (fp.node_setup, given("node_setup")) {
                self.node_setup = v;
            }
            if let (Some(level), false) = (
                typed(origin, "fastpath.logLevel", &fp.log_level, |s| s.parse())?,
                given("log_level"),
            ) {
                self.log_level = level;
            }
            tunables::merge(self, fp, origin, &given)?;
        }

        for field in cfg.ignored_fields() {
            self.config_warnings.push(format!(
                "{origin}: {field} has no effect in fastpath; ignored"
            ));
        }
        Ok(())
    }

    /// Whether pods' devices are named, by prefix or `--pod-interfaces auto`: the pod path
    /// is on.
    pub fn pod_devices_named(&self) -> bool {
        !self.pod_interface_name_prefix.is_empty() || self.pod_interfaces == "auto"
    }

    /// Checks what a flag's parser alone cannot (ranges, lists, cross-field rules).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field: &str, message: String| ConfigError::Invalid {
            origin: "flags".into(),
            field: field.to_string(),
            message,
        };
        check_cidrs(&self.cluster_cidr).map_err(|m| invalid("--cluster-cidr", m))?;
        check_cidrs(&self.service_cluster_ip_range)
            .map_err(|m| invalid("--service-cluster-ip-range", m))?;
        self.check_detect_local_mode()
            .map_err(|(field, m)| invalid(field.flag, m))?;
        check_oom(self.oom_score_adj).map_err(|m| invalid("--oom-score-adj", m))?;
        check_node_port_addresses(&self.node_port_addresses)
            .map_err(|m| invalid("--nodeport-addresses", m))?;
        if self.bpf_socket_lb_host_namespace_only && !self.pod_devices_named() {
            // Pods would reach no Service at all.
            return Err(invalid(
                "--bpf-socket-lb-host-namespace-only",
                "needs --pod-interface-name-prefix or --pod-interfaces auto, whose devices then \
                 translate pods' traffic"
                    .into(),
            ));
        }
        if self.masquerade_bit > 31 {
            return Err(invalid(
                "--iptables-masquerade-bit",
                format!("{} is not a bit number 0-31", self.masquerade_bit),
            ));
        }
        if self.sync_period.is_zero() {
            return Err(invalid("--sync-period", "must be more than 0".into()));
        }
        if self.min_sync_period > self.sync_period {
            return Err(invalid(
                "--min-sync-period",
                format!(
                    "{} is longer than the sync period {}",
                    humantime::format_duration(self.min_sync_period),
                    humantime::format_duration(self.sync_period)
                ),
            ));
        }
        if let Some(d) = self
            .iptables_min_sync_period
            .filter(|d| *d > self.sync_period)
        {
            return Err(invalid(
                "iptables.minSyncPeriod",
                format!(
                    "{} is longer than the sync period {}",
                    humantime::format_duration(d),
                    humantime::format_duration(self.sync_period)
                ),
            ));
        }
        if self.manifest_poll_period.is_zero() {
            return Err(invalid(
                "--manifest-poll-period",
                "must be more than 0".into(),
            ));
        }
        if let (Listen(Some(h)), Listen(Some(m))) =
            (self.healthz_bind_address, self.metrics_bind_address)
            && h == m
            && h.port() != 0
        {
            return Err(invalid(
                "--metrics-bind-address",
                format!("{m} is also the healthz address"),
            ));
        }
        Ok(())
    }

    /// kube-proxy's validateDetectLocalMode and validateInterface. ClusterCIDR without a
    /// clusterCIDR is no error there: kube-proxy warns and tells nothing apart (see
    /// [`crate::dataplane::start`]).
    fn check_detect_local_mode(&self) -> Result<(), (DetectLocalField, String)> {
        let mode_field = DetectLocalField {
            flag: "--detect-local-mode",
            file: "detectLocalMode",
        };
        let empty = |flag, file| {
            Err((
                DetectLocalField { flag, file },
                "must not be empty".to_string(),
            ))
        };
        match self.detect_local_mode.as_deref() {
            Some(m) if !DETECT_LOCAL_MODES.contains(&m) => Err((
                mode_field,
                format!(
                    "unknown mode {m:?}; expected one of {}",
                    DETECT_LOCAL_MODES.join(", ")
                ),
            )),
            Some(LOCAL_MODE_BRIDGE)
                if self
                    .pod_bridge_interface
                    .as_deref()
                    .unwrap_or("")
                    .is_empty() =>
            {
                empty("--pod-bridge-interface", "detectLocal.bridgeInterface")
            }
            Some(LOCAL_MODE_PREFIX) => match self.pod_interface_name_prefix.as_slice() {
                [] => empty(
                    "--pod-interface-name-prefix",
                    "detectLocal.interfaceNamePrefix",
                ),
                [p] if p.is_empty() => empty(
                    "--pod-interface-name-prefix",
                    "detectLocal.interfaceNamePrefix",
                ),
                [_] => Ok(()),
                _ => Err((
                    DetectLocalField {
                        flag: "--pod-interface-name-prefix",
                        file: "detectLocal.interfaceNamePrefix",
                    },
                    "InterfaceNamePrefix takes one prefix".into(),
                )),
            },
            _ => Ok(()),
        }
    }

    /// The node name: the override, else the kernel's hostname.
    pub fn node_name(&self) -> String {
        if let Some(name) = &self.hostname_override {
            return name.to_lowercase();
        }
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_lowercase())
            .unwrap_or_else(|_| "localhost".to_string())
    }

    /// The shortest time between two syncs in proxy mode `mode`: `--min-sync-period`, or the
    /// file's top-level `minSyncPeriod`, in every mode; else the file's
    /// `iptables.minSyncPeriod` in the iptables mode only. kube-proxy's 1 s there spaces out
    /// its iptables-restore runs, each of which rewrites the rules; an eBPF map update costs
    /// microseconds, and under churn that second would hold back every change.
    pub fn min_sync_period_for(&self, mode: Mode) -> Duration {
        match (mode, self.iptables_min_sync_period) {
            (Mode::Iptables, Some(d)) => d,
            _ => self.min_sync_period,
        }
    }

    /// How long pending changes may wait for a sync before /healthz fails (kube-proxy: twice
    /// the sync period).
    pub fn health_timeout(&self) -> Duration {
        self.sync_period.saturating_mul(2)
    }

    /// What to change on the node, if anything (see [`crate::node_setup`]).
    pub fn node_setup(&self) -> Option<NodeSetup> {
        (self.node_setup && !self.skip_node_setup).then_some(NodeSetup {
            conntrack_max_per_core: self.conntrack_max_per_core,
            conntrack_min: self.conntrack_min,
            tcp_timeout_established: self.conntrack_tcp_timeout_established,
            tcp_timeout_close_wait: self.conntrack_tcp_timeout_close_wait,
            tcp_be_liberal: self.conntrack_tcp_be_liberal,
            oom_score_adj: Some(self.oom_score_adj),
        })
    }
}

/// A file's string setting, trimmed; None where it is empty, which kube-proxy's defaulting
/// treats as unset.
fn set(s: &Option<String>) -> Option<String> {
    s.as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

/// A file field through one of the [`values`] parsers; an empty string is unset, and an
/// error gets the field's name.
fn typed<T>(
    origin: &str,
    field: &str,
    s: &Option<String>,
    parse: fn(&str) -> Result<T, String>,
) -> Result<Option<T>, ConfigError> {
    let s = s.as_deref().map(str::trim).filter(|s| !s.is_empty());
    s.map(|s| {
        parse(s).map_err(|message| ConfigError::Invalid {
            origin: origin.to_string(),
            field: field.to_string(),
            message,
        })
    })
    .transpose()
}

/// kube-proxy's rule for clusterCIDR: one CIDR, or two of different families.
fn check_cidrs(cidrs: &[Cidr]) -> Result<(), String> {
    match cidrs {
        [_, _, _, ..] => Err("at most two CIDRs (one per IP family)".into()),
        [a, b] if a.addr.is_ipv4() == b.addr.is_ipv4() => Err(format!(
            "{a} and {b} are of one IP family; two CIDRs must be one IPv4 and one IPv6"
        )),
        _ => Ok(()),
    }
}

/// kube-proxy's rule for nodePortAddresses: `primary` alone, or CIDRs; a mix has no
/// meaning (which of the two would limit the other?).
fn check_node_port_addresses(list: &[NodePortAddress]) -> Result<(), String> {
    if list.len() > 1 && list.contains(&NodePortAddress::Primary) {
        return Err("can't use both 'primary' and CIDRs".into());
    }
    Ok(())
}

fn check_oom(v: i32) -> Result<(), String> {
    if (-1000..=1000).contains(&v) {
        Ok(())
    } else {
        Err(format!("{v} is outside -1000..1000"))
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

#[cfg(test)]
#[path = "config/validation_kube_tests.rs"]
mod validation_kube_tests;

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str =
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

    fn merged(flags: &[&str], yaml: &str) -> Result<Args, ConfigError> {
        use clap::CommandFactory;
        let matches = Args::command()
            .try_get_matches_from(std::iter::once("fastpath").chain(flags.iter().copied()))
            .unwrap();
        let mut args = Args::from_arg_matches(&matches).unwrap();
        let cfg = KubeProxyConfiguration::parse(&format!("{HEADER}{yaml}"), "test.yaml")?;
        args.merge_file(&cfg, "test.yaml", |id| {
            matches.value_source(id) == Some(ValueSource::CommandLine)
        })?;
        args.validate()?;
        Ok(args)
    }

    fn error(flags: &[&str], yaml: &str) -> String {
        merged(flags, yaml)
            .expect_err("should be rejected")
            .to_string()
    }

    /// Host routing is chosen by what the host's netfilter does unless told; the flag alone
    /// turns it on, as before it took a value; a flag beats the file.
    #[test]
    fn host_routing_is_auto_unless_told() {
        let host_routing =
            |flags: &[&str], yaml: &str| merged(flags, yaml).unwrap().bpf_host_routing;
        assert_eq!(host_routing(&[], ""), HostRouting::Auto);
        assert_eq!(host_routing(&["--bpf-host-routing"], ""), HostRouting::True);
        assert_eq!(
            host_routing(&["--bpf-host-routing", "false"], ""),
            HostRouting::False
        );
        assert_eq!(
            host_routing(&["--bpf-host-routing=auto"], ""),
            HostRouting::Auto
        );
        let file = "fastpath: {bpfHostRouting: \"false\"}\n";
        assert_eq!(host_routing(&[], file), HostRouting::False);
        assert_eq!(
            host_routing(&["--bpf-host-routing"], file),
            HostRouting::True
        );
        assert!(Args::try_from_iter(["fastpath", "--bpf-host-routing=always"]).is_err());
    }

    /// The eBPF tunables a ConfigMap sets are taken as their flags would take them; a flag
    /// on the command line still wins.
    #[test]
    fn ebpf_tunables_come_from_the_file_unless_flags_give_them() {
        let file = "fastpath:\n  bpfLbMapMax: 4096\n  bpfCtMax: 65536\n  \
                    conntrackGcInterval: 2m\n  bpfLbAlgorithm: maglev\n  \
                    bpfLbMaglevTableSize: 1021\n  bpfLbMaglevHashSeed: 7\n  bpfLbMode: hybrid\n";
        let a = merged(&[], file).unwrap();
        assert_eq!(a.bpf_lb_map_max, Some(4096));
        assert_eq!(a.bpf_ct_max, Some(65536));
        assert_eq!(a.conntrack_gc_interval, Duration::from_secs(120));
        assert_eq!(a.bpf_lb_algorithm, LbAlgorithm::Maglev);
        assert_eq!(a.bpf_lb_maglev_table_size, 1021);
        assert_eq!(a.bpf_lb_maglev_hash_seed, 7);
        assert_eq!(a.bpf_lb_mode, LbMode::Hybrid);
        let flags = [
            "--bpf-ct-max=64",
            "--conntrack-gc-interval=5s",
            "--bpf-lb-algorithm=random",
            "--bpf-lb-mode=snat",
        ];
        let a = merged(&flags, file).unwrap();
        assert_eq!(a.bpf_ct_max, Some(64));
        assert_eq!(a.conntrack_gc_interval, Duration::from_secs(5));
        assert_eq!(a.bpf_lb_algorithm, LbAlgorithm::Random);
        assert_eq!(a.bpf_lb_mode, LbMode::Snat);
        assert_eq!(
            a.bpf_lb_maglev_table_size, 1021,
            "the file's, no flag for it"
        );
        let a = merged(
            &[],
            "fastpath: {bpfLbAlgorithm: \"\", conntrackGcInterval: \"\"}\n",
        )
        .unwrap();
        assert_eq!(a.bpf_lb_algorithm, LbAlgorithm::Random, "empty is unset");
        assert_eq!(a.conntrack_gc_interval, Duration::from_secs(30));
    }

    #[test]
    fn defaults_match_kube_proxy() {
        let a = Args::try_from_iter(["fastpath"]).unwrap();
        assert_eq!(
            a.healthz_bind_address,
            Listen(Some("0.0.0.0:10256".parse().unwrap()))
        );
        assert_eq!(
            a.metrics_bind_address,
            Listen(Some("127.0.0.1:10249".parse().unwrap()))
        );
        assert_eq!(a.oom_score_adj, -999);
        assert_eq!((a.conntrack_max_per_core, a.conntrack_min), (32768, 131072));
        assert_eq!(a.health_timeout(), Duration::from_secs(60));
        assert!(a.node_setup().is_none(), "node set-up is opt-in");
    }

    /// kube-proxy accepts ClusterCIDR without a clusterCIDR (and tells nothing apart), and
    /// reads detectLocal's names only for the mode that uses them.
    #[test]
    fn detect_local_settings_as_kube_proxy_reads_them() {
        let a = merged(&[], "detectLocalMode: ClusterCIDR\n").expect("accepted");
        assert!(a.cluster_cidr.is_empty());
        let a = merged(
            &[],
            "detectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: veth, bridgeInterface: cbr0}\n",
        )
        .unwrap();
        assert_eq!(a.pod_interface_name_prefix, ["veth"]);
        assert_eq!(a.pod_bridge_interface, None);
        let a = merged(
            &[],
            "detectLocalMode: BridgeInterface\ndetectLocal: {interfaceNamePrefix: veth, bridgeInterface: cbr0}\n",
        )
        .unwrap();
        assert_eq!(a.pod_bridge_interface.as_deref(), Some("cbr0"));
        assert!(a.pod_interface_name_prefix.is_empty(), "no eBPF pod path");
        let a = merged(
            &[
                "--detect-local-mode",
                "BridgeInterface",
                "--pod-bridge-interface",
                "br9",
            ],
            "detectLocal: {bridgeInterface: cbr0}\n",
        )
        .unwrap();
        assert_eq!(
            a.pod_bridge_interface.as_deref(),
            Some("br9"),
            "the flag wins"
        );
        assert!(
            error(&["--detect-local-mode", "BridgeInterface"], "").contains("must not be empty")
        );
    }

    #[test]
    fn the_file_fills_in_what_the_flags_left_at_their_defaults() {
        let a = merged(
            &[],
            "healthzBindAddress: 127.0.0.1:20256\nmetricsBindAddress: \"[::1]:20249\"\n\
             iptables: {syncPeriod: 1m0s, minSyncPeriod: 2s, masqueradeBit: 15}\n\
             conntrack: {maxPerCore: 0, min: 1000, tcpEstablishedTimeout: 12h, tcpBeLiberal: true}\n\
             hostnameOverride: Node-B\noomScoreAdj: -500\nclusterCIDR: 198.18.0.0/15,2001:db8::/48\n\
             detectLocalMode: ClusterCIDR\nnodePortAddresses: [198.18.2.0/24]\n\
             clientConnection: {kubeconfig: /etc/kube/config}\nlogging: {format: json}\n\
             fastpath: {nodeSetup: true, zone: z1, manifestPollPeriod: 1s,\n\
             \x20 serviceClusterIPRange: \"198.19.0.0/16,2001:db8:5::/112\"}\n",
        )
        .unwrap();
        assert_eq!(
            a.service_cluster_ip_range,
            [
                "198.19.0.0/16".parse().unwrap(),
                "2001:db8:5::/112".parse().unwrap()
            ]
        );
        assert_eq!(a.healthz_bind_address.to_string(), "127.0.0.1:20256");
        assert_eq!(a.metrics_bind_address.to_string(), "[::1]:20249");
        assert_eq!(a.sync_period, Duration::from_secs(60));
        assert_eq!(
            a.min_sync_period_for(Mode::Iptables),
            Duration::from_secs(2)
        );
        assert_eq!(a.masquerade_bit, 15);
        assert_eq!(a.node_name(), "node-b");
        assert_eq!(a.kubeconfig, Some(PathBuf::from("/etc/kube/config")));
        assert_eq!(a.log_format, LogFormat::Json);
        assert_eq!(a.zone.as_deref(), Some("z1"));
        let setup = a.node_setup().expect("the file turned node set-up on");
        assert_eq!(
            (setup.conntrack_max_per_core, setup.conntrack_min),
            (0, 1000)
        );
        assert!(setup.tcp_be_liberal);
        assert_eq!(
            setup.tcp_timeout_established,
            Duration::from_secs(12 * 3600)
        );
        assert_eq!(
            setup.tcp_timeout_close_wait,
            Duration::from_secs(3600),
            "default kept"
        );
        assert_eq!(setup.oom_score_adj, Some(-500));
    }

    #[test]
    fn flags_on_the_command_line_win_over_the_file() {
        let a = merged(
            &["--sync-period", "10s", "--healthz-bind-address", "127.0.0.1:1", "--oom-score-adj", "-10", "--skip-node-setup"],
            "syncPeriod: 1m\nhealthzBindAddress: 0.0.0.0:2\noomScoreAdj: 5\nfastpath: {nodeSetup: true}\n",
        )
        .unwrap();
        assert_eq!(a.sync_period, Duration::from_secs(10));
        assert_eq!(a.healthz_bind_address.to_string(), "127.0.0.1:1");
        assert_eq!(a.oom_score_adj, -10);
        assert!(a.node_setup().is_none(), "--skip-node-setup wins");
    }

    #[test]
    fn top_level_periods_win_over_iptables_ones() {
        let a = merged(&[], "syncPeriod: 45s\niptables: {syncPeriod: 1m}\n").unwrap();
        assert_eq!(a.sync_period, Duration::from_secs(45));
        let a = merged(&[], "minSyncPeriod: 3s\niptables: {minSyncPeriod: 1s}\n").unwrap();
        for mode in [Mode::Ebpf, Mode::Iptables, Mode::Userspace] {
            assert_eq!(
                a.min_sync_period_for(mode),
                Duration::from_secs(3),
                "{mode:?}"
            );
        }
    }

    #[test]
    fn iptables_min_sync_period_holds_back_only_the_iptables_mode() {
        let a = merged(&[], "syncPeriod: 30s\niptables: {minSyncPeriod: 1s}\n").unwrap();
        assert_eq!(
            a.min_sync_period_for(Mode::Iptables),
            Duration::from_secs(1)
        );
        assert_eq!(a.min_sync_period_for(Mode::Ebpf), Duration::ZERO);
        assert_eq!(a.min_sync_period_for(Mode::Userspace), Duration::ZERO);
        // The flag is the operator's word for every mode.
        let a = merged(
            &["--min-sync-period", "2s"],
            "iptables: {minSyncPeriod: 1s}\n",
        )
        .unwrap();
        assert_eq!(
            a.min_sync_period_for(Mode::Iptables),
            Duration::from_secs(2)
        );
        assert_eq!(a.min_sync_period_for(Mode::Ebpf), Duration::from_secs(2));
        assert!(
            error(&[], "syncPeriod: 1s\niptables: {minSyncPeriod: 5s}\n")
                .contains("iptables.minSyncPeriod"),
            "checked against the sync period"
        );
    }

    #[test]
    fn kubeadm_style_zero_values_change_nothing() {
        let a = merged(
            &[],
            "bindAddress: 0.0.0.0\nclusterCIDR: \"\"\nhealthzBindAddress: \"\"\nmetricsBindAddress: \"\"\n\
             mode: \"\"\nhostnameOverride: \"\"\noomScoreAdj: null\n\
             iptables: {masqueradeAll: false, masqueradeBit: null, minSyncPeriod: 0s, syncPeriod: 0s}\n\
             conntrack: {maxPerCore: null, min: null, tcpCloseWaitTimeout: null, tcpEstablishedTimeout: null}\n\
             ipvs: {scheduler: \"\"}\nfeatureGates: {}\n",
        )
        .unwrap();
        assert_eq!(a.healthz_bind_address.to_string(), "0.0.0.0:10256");
        assert_eq!(a.sync_period, Duration::from_secs(30));
        assert_eq!(a.oom_score_adj, -999);
        assert_eq!(a.config_warnings.len(), 2, "{:?}", a.config_warnings);
        assert!(a.config_warnings[0].contains("featureGates"));
    }

    #[test]
    fn invalid_values_are_rejected_naming_the_field() {
        for (yaml, field, words) in [
            ("oomScoreAdj: 2000\n", "oomScoreAdj", "-1000..1000"),
            (
                "conntrack: {maxPerCore: -1}\n",
                "conntrack.maxPerCore",
                "negative",
            ),
            (
                "conntrack: {tcpEstablishedTimeout: forever}\n",
                "conntrack.tcpEstablishedTimeout",
                "duration",
            ),
            (
                "iptables: {masqueradeBit: 32}\n",
                "iptables.masqueradeBit",
                "0-31",
            ),
            (
                "iptables: {syncPeriod: 5 parsecs}\n",
                "iptables.syncPeriod",
                "duration",
            ),
            (
                "healthzBindAddress: 0.0.0.0\n",
                "healthzBindAddress",
                "IP:PORT",
            ),
            (
                "metricsBindAddress: localhost:99999\n",
                "metricsBindAddress",
                "IP:PORT",
            ),
            ("mode: ipvs\n", "mode", "unknown proxy mode"),
            ("clusterCIDR: 198.18.0.0/33\n", "clusterCIDR", "not a CIDR"),
            (
                "detectLocalMode: Magic\n",
                "detectLocalMode",
                "unknown mode",
            ),
            (
                "nodePortAddresses: [everything]\n",
                "nodePortAddresses",
                "not a CIDR",
            ),
            (
                "hostnameOverride: \"node_a!\"\n",
                "hostnameOverride",
                "not a valid node name",
            ),
            ("bindAddress: nowhere\n", "bindAddress", "not an IP"),
            ("logging: {format: xml}\n", "logging.format", "text or json"),
            (
                "fastpath: {healthcheckBindAddress: all}\n",
                "fastpath.healthcheckBindAddress",
                "not an IP",
            ),
            (
                "fastpath: {podInterfaces: veth}\n",
                "fastpath.podInterfaces",
                "neither \"auto\" nor \"none\"",
            ),
            (
                "fastpath: {bpfHostRouting: sometimes}\n",
                "fastpath.bpfHostRouting",
                "not \"auto\", \"true\" or \"false\"",
            ),
            (
                "fastpath: {bpfCtMax: 8}\n",
                "fastpath.bpfCtMax",
                "8 is not in 16..=16777216",
            ),
            (
                "fastpath: {bpfLbMapMax: 0}\n",
                "fastpath.bpfLbMapMax",
                "0 is not in 1..=16777216",
            ),
            (
                "fastpath: {conntrackGcInterval: 100ms}\n",
                "fastpath.conntrackGcInterval",
                "under 1s",
            ),
            (
                "fastpath: {bpfLbAlgorithm: round-robin}\n",
                "fastpath.bpfLbAlgorithm",
                "possible values: random, maglev",
            ),
            (
                "fastpath: {bpfLbMaglevTableSize: 1000}\n",
                "fastpath.bpfLbMaglevTableSize",
                "not one of the table sizes",
            ),
            (
                "fastpath: {bpfLbMode: direct}\n",
                "fastpath.bpfLbMode",
                "possible values: snat, dsr, hybrid",
            ),
            (
                "fastpath: {serviceClusterIPRange: 198.19.0.0/16/2}\n",
                "fastpath.serviceClusterIPRange",
                "not a CIDR",
            ),
            (
                "fastpath: {serviceClusterIPRange: \"198.19.0.0/16,198.18.0.0/24\"}\n",
                "fastpath.serviceClusterIPRange",
                "one IPv4 and one IPv6",
            ),
        ] {
            let e = error(&[], yaml);
            assert!(
                e.contains(&format!("test.yaml: {field}: ")) && e.contains(words),
                "{yaml}: {e}"
            );
        }
    }

    #[test]
    fn the_file_is_decoded_strictly() {
        let e = error(&[], "healthzBindAdress: 0.0.0.0:1\n");
        assert!(e.contains("unknown field `healthzBindAdress`"), "{e}");
        let e = error(&[], "conntrack: {maxPercore: 1}\n");
        assert!(e.contains("conntrack") && e.contains("maxPercore"), "{e}");
        let e = error(&[], "oomScoreAdj: lots\n");
        assert!(e.contains("oomScoreAdj"), "{e}");
        let e = error(&[], "fastpath: {nodesetup: true}\n");
        assert!(e.contains("nodesetup"), "{e}");
        let e = error(&[], "fastpath: {bpfCtMax: lots}\n");
        assert!(e.contains("bpfCtMax") && e.contains("invalid type"), "{e}");
    }

    #[test]
    fn the_header_must_name_the_kube_proxy_config_type() {
        let e =
            KubeProxyConfiguration::parse("apiVersion: v1\nkind: KubeProxyConfiguration\n", "f")
                .unwrap_err()
                .to_string();
        assert!(
            e.contains("apiVersion must be \"kubeproxy.config.k8s.io/v1alpha1\""),
            "{e}"
        );
        let e =
            KubeProxyConfiguration::parse("apiVersion: kubeproxy.config.k8s.io/v1alpha1\n", "f")
                .unwrap_err()
                .to_string();
        assert!(e.contains("kind must be"), "{e}");
    }

    #[test]
    fn flags_are_checked_too() {
        for (flags, words) in [
            (&["--oom-score-adj", "-1001"][..], "--oom-score-adj"),
            (
                &["--min-sync-period", "1m", "--sync-period", "30s"][..],
                "longer than the sync period",
            ),
            (&["--sync-period", "0s"][..], "--sync-period"),
            (
                &["--cluster-cidr", "198.18.0.0/15,bad"][..],
                "--cluster-cidr",
            ),
            (
                &["--service-cluster-ip-range", "198.19.0.0/16,198.18.0.0/24"][..],
                "--service-cluster-ip-range",
            ),
            (
                &[
                    "--healthz-bind-address",
                    "127.0.0.1:7",
                    "--metrics-bind-address",
                    "127.0.0.1:7",
                ][..],
                "also the healthz",
            ),
        ] {
            let args = std::iter::once("fastpath").chain(flags.iter().copied());
            let e = Args::try_from_iter(args).expect_err("rejected").to_string();
            assert!(e.contains(words), "{flags:?}: {e}");
        }
        // An empty address turns a server off; the last occurrence of a flag wins.
        let a = Args::try_from_iter([
            "fastpath",
            "--metrics-bind-address",
            "",
            "--healthz-bind-address",
            "127.0.0.1:0",
            "--healthz-bind-address",
            "127.0.0.1:5",
        ])
        .unwrap();
        assert_eq!(a.metrics_bind_address, Listen(None));
        assert_eq!(a.healthz_bind_address.to_string(), "127.0.0.1:5");
    }

    #[test]
    fn a_config_file_is_read_from_disk_and_a_missing_one_is_a_clear_error() {
        let dir = std::env::temp_dir().join(format!("fastpath-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.yaml");
        std::fs::write(&path, format!("{HEADER}metricsBindAddress: 127.0.0.1:0\n")).unwrap();
        let a = Args::try_from_iter(["fastpath".as_ref(), "--config".as_ref(), path.as_os_str()])
            .unwrap();
        assert_eq!(a.metrics_bind_address.to_string(), "127.0.0.1:0");
        let missing = dir.join("nope.yaml");
        let e = Args::try_from_iter([
            "fastpath".as_ref(),
            "--config".as_ref(),
            missing.as_os_str(),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("cannot read config file") && e.contains("nope.yaml"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
