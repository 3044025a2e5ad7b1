//! Starting the dataplane the mode selection chose, behind the one [`Proxier`] the sync
//! loop drives.

use std::path::PathBuf;

use tracing::{info, warn};

use super::{
    Proxier,
    bpf::{AttachOptions, BpfDataplane, LoadError, PacketPathConfig, PodPathConfig},
    iptables::{
        IptablesConfig, IptablesDataplane, IptablesError, RenderConfig, apply::Backend,
        render::LocalTraffic,
    },
    mode::{self, Mode, ModeDecision, ModeError, Probes},
    nftables::{NftablesConfig, NftablesDataplane, NftablesError},
    userspace::{UserspaceConfig, UserspaceDataplane, UserspaceError, relay::RelayConfig},
};

/// What any dataplane may need to start.
#[derive(Clone, Debug, Default)]
pub struct StartOptions {
    /// eBPF: the cgroup v2 to attach to; None: the root of the cgroup2 mount.
    pub cgroup: Option<PathBuf>,
    /// eBPF: pin maps and links here (a bpffs folder) so restarts keep traffic flowing.
    pub bpf_pin_dir: Option<PathBuf>,
    /// eBPF: node ports, external and load-balancer IPs on these devices; None: off.
    pub packet: Option<PacketPathConfig>,
    /// eBPF: the devices were not named, so failing to find or attach to them turns the
    /// packet path off with a warning instead of failing the mode.
    pub packet_auto: bool,
    /// eBPF: entries of the service and backend maps; None: built-in sizes.
    pub bpf_lb_map_max: Option<u32>,
    /// eBPF: entries of each family's flow table; None: the built-in size.
    pub bpf_ct_max: Option<u32>,
    /// eBPF: how often the flow table's idle entries are collected; None: the default.
    pub conntrack_gc_interval: Option<std::time::Duration>,
    /// eBPF: per-packet Service translation on the pods' devices; None: off.
    pub pods: Option<PodPathConfig>,
    /// eBPF: the packet path's backend choice and forwarding mode.
    pub bpf_lb: super::bpf::lb::LbConfig,
    /// iptables: which tools (the system's, legacy or nft).
    pub iptables_backend: Backend,
    /// iptables and userspace: run in this network namespace instead of our own.
    pub netns: Option<String>,
    /// iptables and userspace: remove our rules when stopping (default: keep them).
    pub cleanup_on_exit: bool,
    pub render: RenderConfig,
    pub relay: RelayConfig,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Mode(#[from] ModeError),
    #[error("no cgroup2 file system is mounted; mount one or pass --cgroup-path")]
    NoCgroup,
    #[error("cannot start the eBPF dataplane on {cgroup}: {source}")]
    Bpf {
        cgroup: String,
        source: Box<LoadError>,
    },
    #[error("cannot start the nftables proxier: {0}")]
    Nftables(#[from] NftablesError),
    #[error("cannot start the iptables proxier: {0}")]
    Iptables(#[from] IptablesError),
    #[error("cannot start the userspace proxier: {0}")]
    Userspace(#[from] UserspaceError),
    #[error("{0}")]
    Netns(#[from] super::netns::NetnsError),
}

/// Starts `mode`'s dataplane. Does not probe or clean up; see [`select_and_start`].
pub fn start(mode: Mode, opts: &StartOptions) -> Result<Proxier, StartError> {
    if let Some(ns) = &opts.netns {
        super::netns::check_name(ns)?;
    }
    match mode {
        Mode::Ebpf => {
            let cgroup = match &opts.cgroup {
                Some(c) => c.clone(),
                None => crate::config::cgroup2_mount().ok_or(StartError::NoCgroup)?,
            };
            let mut attach = AttachOptions {
                pin_dir: opts.bpf_pin_dir.clone(),
                packet: opts.packet.clone(),
                lb_map_max: opts.bpf_lb_map_max,
                pods: opts.pods.clone(),
                lb: opts.bpf_lb,
                ct_max: opts.bpf_ct_max,
                ct_gc_interval: opts.conntrack_gc_interval,
            };
            let attached = match BpfDataplane::attach_with(&cgroup, &attach) {
                // Devices nobody named, or a kernel that refuses the packet programs: keep
                // socket load-balancing rather than leave eBPF mode for it.
                Err(e) if opts.packet_auto && e.is_packet_path() => {
                    tracing::warn!("node ports from other hosts are off: {e}");
                    attach.packet = None;
                    BpfDataplane::attach_with(&cgroup, &attach)
                }
                other => other,
            };
            let dp = attached.map_err(|source| StartError::Bpf {
                cgroup: cgroup.display().to_string(),
                source: Box::new(source),
            })?;
            info!(cgroup = %cgroup.display(), "eBPF socket load-balancing attached");
            Ok(Proxier::Bpf(Box::new(dp)))
        }
        Mode::Nftables => {
            let dp = NftablesDataplane::new(NftablesConfig {
                netns: opts.netns.clone(),
                render: opts.render.clone(),
                families: Vec::new(),
                cleanup_on_exit: opts.cleanup_on_exit,
            })?;
            info!(families = ?dp.families(), netns = ?opts.netns, "nftables proxier ready");
            Ok(Proxier::Nftables(dp))
        }
        Mode::Iptables => {
            let dp = IptablesDataplane::new(IptablesConfig {
                netns: opts.netns.clone(),
                render: opts.render.clone(),
                families: Vec::new(),
                cleanup_on_exit: opts.cleanup_on_exit,
                backend: opts.iptables_backend,
            })?;
            info!(families = ?dp.families(), netns = ?opts.netns, "iptables proxier ready");
            Ok(Proxier::Iptables(dp))
        }
        Mode::Userspace => {
            let dp = UserspaceDataplane::new(UserspaceConfig {
                netns: opts.netns.clone(),
                relay: opts.relay,
                cleanup_on_exit: opts.cleanup_on_exit,
            })?;
            info!(netns = ?opts.netns, "userspace proxier ready");
            Ok(Proxier::Userspace(dp))
        }
    }
}

/// Probes the node, decides the mode (`requested`, or the best available), logs why,
/// removes the other modes' leftovers and starts it.
pub fn select_and_start(
    requested: Option<Mode>,
    opts: &StartOptions,
) -> Result<(Proxier, ModeDecision), StartError> {
    let want_bpf = matches!(requested, None | Some(Mode::Ebpf));
    let probes = Probes::detect(opts.cgroup.as_deref(), opts.netns.as_deref(), want_bpf);
    let decision = mode::decide(requested, &probes)?;
    info!(mode = %decision.mode, reasons = ?decision.reasons, "proxy mode chosen");
    mode::cleanup_leftovers(
        decision.mode,
        opts.netns.as_deref(),
        opts.bpf_pin_dir.as_deref(),
    );
    match start(decision.mode, opts) {
        Ok(proxier) => Ok((proxier, decision)),
        // Probes passed but the real load failed (a verifier rejection, a map the kernel
        // will not create): a node that was not forced into eBPF still gets Services.
        Err(e) if requested.is_none() && decision.mode == Mode::Ebpf => {
            tracing::error!("the eBPF dataplane failed to start: {e}; falling back");
            let probes = Probes {
                bpf_syscall: Err(format!("loading our programs failed: {e}")),
                ..probes
            };
            let decision = mode::decide(None, &probes)?;
            info!(mode = %decision.mode, reasons = ?decision.reasons, "proxy mode chosen after the eBPF failure");
            mode::cleanup_leftovers(
                decision.mode,
                opts.netns.as_deref(),
                opts.bpf_pin_dir.as_deref(),
            );
            Ok((start(decision.mode, opts)?, decision))
        }
        Err(e) => Err(e),
    }
}

impl StartOptions {
    /// The options the daemon's flags ask for. `primary`: what `--nodeport-addresses
    /// primary` resolved to ([`super::primary::resolve`]); it must not be empty when the
    /// flag says primary, or node ports would answer on every address.
    pub fn from_args(
        args: &crate::config::Args,
        primary: &[(std::net::IpAddr, u8)],
    ) -> Result<StartOptions, String> {
        let mut node_port_cidrs: Vec<(std::net::IpAddr, u8)> = Vec::new();
        for a in &args.node_port_addresses {
            match a {
                crate::config::NodePortAddress::Cidr(c) => node_port_cidrs.push((c.addr, c.prefix)),
                crate::config::NodePortAddress::Primary if primary.is_empty() => {
                    return Err("--nodeport-addresses primary was not resolved".into());
                }
                crate::config::NodePortAddress::Primary => {
                    node_port_cidrs.extend_from_slice(primary)
                }
            }
        }
        let devices: Vec<String> = args
            .nodeport_devices
            .iter()
            .map(|d| d.trim().to_string())
            .filter(|d| !d.is_empty())
            .collect();
        let packet_auto = devices.iter().any(|d| d == "auto");
        let packet = (!devices.iter().any(|d| d == "none")).then(|| PacketPathConfig {
            netns: args.netns.clone(),
            devices: devices.iter().filter(|d| *d != "auto").cloned().collect(),
            node_port_cidrs: node_port_cidrs.clone(),
            xdp: args.nodeport_acceleration == "native",
        });
        Ok(StartOptions {
            cgroup: args.cgroup_path.clone(),
            bpf_pin_dir: args.bpf_pin_dir.clone(),
            packet,
            packet_auto,
            bpf_lb_map_max: args.bpf_lb_map_max,
            bpf_ct_max: args.bpf_ct_max,
            conntrack_gc_interval: Some(args.conntrack_gc_interval),
            bpf_lb: super::bpf::lb::LbConfig {
                algorithm: args.bpf_lb_algorithm,
                mode: args.bpf_lb_mode,
                maglev_table_size: args.bpf_lb_maglev_table_size,
                maglev_seed: args.bpf_lb_maglev_hash_seed,
            },
            pods: args.pod_devices_named().then(|| PodPathConfig {
                netns: args.netns.clone(),
                prefixes: args.pod_interface_name_prefix.clone(),
                auto: args.pod_interfaces == "auto",
                node_addresses: args.bind_address.into_iter().collect(),
                host_namespace_only: args.bpf_socket_lb_host_namespace_only,
                host_routing: args.bpf_host_routing,
            }),
            iptables_backend: match args.iptables_backend.as_str() {
                "legacy" => Backend::Legacy,
                "nft" => Backend::Nft,
                _ => Backend::System,
            },
            netns: args.netns.clone(),
            cleanup_on_exit: args.cleanup_on_exit,
            render: RenderConfig {
                masquerade_all: args.masquerade_all,
                local_traffic: local_traffic(args),
                masquerade_bit: args.masquerade_bit,
                nodeport_addresses: node_port_cidrs,
                conntrack_tcp_liberal: args.conntrack_tcp_be_liberal,
                ..RenderConfig::default()
            },
            relay: RelayConfig::default(),
        })
    }
}

/// How pods' traffic is told apart, kube-proxy's getLocalDetectors: --detect-local-mode and
/// the names it reads. NodeCIDR's CIDRs come from the Node, read by the daemon before the
/// start ([`LocalTraffic::NodeCidrs`] is left empty here).
pub fn local_traffic(args: &crate::config::Args) -> LocalTraffic {
    use crate::config::{LOCAL_MODE_BRIDGE, LOCAL_MODE_NODE, LOCAL_MODE_PREFIX};
    match args.detect_local_mode.as_deref() {
        Some(LOCAL_MODE_NODE) => LocalTraffic::Cidrs(Vec::new()),
        Some(LOCAL_MODE_BRIDGE) => {
            LocalTraffic::Interface(args.pod_bridge_interface.clone().unwrap_or_default())
        }
        Some(LOCAL_MODE_PREFIX) => LocalTraffic::Interface(format!(
            "{}+",
            args.pod_interface_name_prefix
                .first()
                .map_or("", String::as_str)
        )),
        _ => {
            if args.cluster_cidr.is_empty() {
                // kube-proxy accepts this too, with the same warning, and then tells
                // nothing apart: nothing masqueraded for being from outside the pods.
                warn!(
                    "--detect-local-mode ClusterCIDR without --cluster-cidr: pods' traffic is \
                     not told apart from the node's"
                );
            }
            LocalTraffic::Cidrs(
                args.cluster_cidr
                    .iter()
                    .map(|c| (c.addr, c.prefix))
                    .collect(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    fn args(flags: &[&str]) -> crate::config::Args {
        crate::config::Args::try_parse_from(
            std::iter::once("fastpath").chain(flags.iter().copied()),
        )
        .expect("flags parse")
    }

    fn opts(flags: &[&str]) -> StartOptions {
        StartOptions::from_args(&args(flags), &[("198.19.0.1".parse().unwrap(), 32)])
            .expect("options")
    }

    /// kube-proxy's TestGetLocalDetectors (cmd/kube-proxy/app/server_linux_test.go): the
    /// detector each --detect-local-mode builds, as the matches it gives per family.
    /// NodeCIDR's CIDRs come from the Node, read by the daemon (empty here).
    #[test]
    fn test_get_local_detectors() {
        let v4 = |s: &str| Some((format!("-s {s}"), format!("! -s {s}")));
        /// (case, flags, IPv4 matches, IPv6 matches): (if local, if not local).
        type Case<'a> = (
            &'a str,
            &'a [&'a str],
            Option<(String, String)>,
            Option<(String, String)>,
        );
        let cases: &[Case<'_>] = &[
            (
                "LocalModeClusterCIDR, single-stack IPv4 cluster",
                &[
                    "--detect-local-mode",
                    "ClusterCIDR",
                    "--cluster-cidr",
                    "198.18.0.0/15",
                ],
                v4("198.18.0.0/15"),
                None,
            ),
            (
                "LocalModeClusterCIDR, dual-stack cluster",
                &[
                    "--detect-local-mode",
                    "ClusterCIDR",
                    "--cluster-cidr",
                    "198.18.0.0/15,2001:db8::/64",
                ],
                v4("198.18.0.0/15"),
                Some(("-s 2001:db8::/64".into(), "! -s 2001:db8::/64".into())),
            ),
            (
                "LocalModeClusterCIDR, no ClusterCIDR",
                &["--detect-local-mode", "ClusterCIDR"],
                None,
                None,
            ),
            (
                "LocalModeNodeCIDR, before the Node is read",
                &["--detect-local-mode", "NodeCIDR"],
                None,
                None,
            ),
            (
                "LocalModeBridgeInterface",
                &[
                    "--detect-local-mode",
                    "BridgeInterface",
                    "--pod-bridge-interface",
                    "eth",
                ],
                Some(("-i eth".into(), "! -i eth".into())),
                Some(("-i eth".into(), "! -i eth".into())),
            ),
            (
                "LocalModeInterfaceNamePrefix",
                &[
                    "--detect-local-mode",
                    "InterfaceNamePrefix",
                    "--pod-interface-name-prefix",
                    "veth",
                ],
                Some(("-i veth+".into(), "! -i veth+".into())),
                Some(("-i veth+".into(), "! -i veth+".into())),
            ),
        ];
        for (name, flags, want_v4, want_v6) in cases {
            let detector = local_traffic(&args(flags));
            use crate::dataplane::iptables::Family;
            assert_eq!(&detector.matches(Family::V4), want_v4, "{name}");
            assert_eq!(&detector.matches(Family::V6), want_v6, "{name}");
        }
    }

    #[test]
    fn nodeport_addresses_primary_is_never_dropped() {
        let primary = args(&["--nodeport-addresses", "primary"]);
        let err = StartOptions::from_args(&primary, &[]).unwrap_err();
        assert!(err.contains("--nodeport-addresses primary"), "{err}");
        let on = StartOptions::from_args(&primary, &[("198.18.0.1".parse().unwrap(), 32)])
            .expect("options");
        let want = [("198.18.0.1".parse().unwrap(), 32)];
        assert_eq!(on.render.nodeport_addresses, want);
        assert_eq!(on.packet.expect("on").node_port_cidrs, want);
        // No primary: nothing is added, and every address stays a node port's.
        let all = StartOptions::from_args(&args(&[]), &[]).expect("options");
        assert!(all.render.nodeport_addresses.is_empty());
    }

    #[test]
    fn nodeport_devices_choose_the_packet_path() {
        let auto = opts(&[]);
        assert!(auto.packet_auto);
        assert_eq!(
            auto.packet.as_ref().map(|p| p.devices.len()),
            Some(0),
            "auto: default-route devices"
        );

        let named = opts(&[
            "--nodeport-devices",
            "eth1,eth2",
            "--nodeport-addresses",
            "198.18.0.0/15,primary",
        ]);
        let packet = named.packet.expect("on");
        assert!(!named.packet_auto, "named devices must attach or fail");
        assert_eq!(packet.devices, ["eth1", "eth2"]);
        assert_eq!(
            packet.node_port_cidrs,
            [
                ("198.18.0.0".parse().unwrap(), 15),
                ("198.19.0.1".parse().unwrap(), 32)
            ]
        );

        // The last occurrence wins, so a wrapper can turn it off, or on again.
        assert!(
            opts(&["--nodeport-devices", "eth1", "--nodeport-devices", "none"])
                .packet
                .is_none()
        );
        let again = opts(&["--nodeport-devices", "none", "--nodeport-devices", "eth3"]);
        assert_eq!(
            again.packet.map(|p| p.devices),
            Some(vec!["eth3".to_string()])
        );
    }
}
