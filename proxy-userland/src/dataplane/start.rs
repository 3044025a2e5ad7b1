//! Starting the dataplane the mode selection chose, behind the one [`Proxier`] the sync
//! loop drives.

use std::path::PathBuf;

use tracing::info;

use super::{
    Proxier,
    bpf::{BpfDataplane, LoadError},
    iptables::{IptablesConfig, IptablesDataplane, IptablesError, RenderConfig},
    userspace::{UserspaceConfig, UserspaceDataplane, UserspaceError, relay::RelayConfig},
};
use crate::mode::{self, Mode, ModeDecision, ModeError, Probes};

/// What any dataplane may need to start.
#[derive(Clone, Debug, Default)]
pub struct StartOptions {
    /// eBPF: the cgroup v2 to attach to; None: the root of the cgroup2 mount.
    pub cgroup: Option<PathBuf>,
    /// eBPF: pin maps and links here (a bpffs folder) so restarts keep traffic flowing.
    pub bpf_pin_dir: Option<PathBuf>,
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
            let dp = BpfDataplane::attach_pinned(&cgroup, opts.bpf_pin_dir.as_deref()).map_err(
                |source| StartError::Bpf {
                    cgroup: cgroup.display().to_string(),
                    source: Box::new(source),
                },
            )?;
            info!(cgroup = %cgroup.display(), "eBPF socket load-balancing attached");
            Ok(Proxier::Bpf(Box::new(dp)))
        }
        Mode::Iptables => {
            let dp = IptablesDataplane::new(IptablesConfig {
                netns: opts.netns.clone(),
                render: opts.render.clone(),
                families: Vec::new(),
                cleanup_on_exit: opts.cleanup_on_exit,
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
    mode::cleanup_leftovers(decision.mode, opts.netns.as_deref());
    match start(decision.mode, opts) {
        Ok(proxier) => Ok((proxier, decision)),
        // Probes passed but the real load failed (a verifier rejection, a map the kernel
        // will not create): a node that was not forced into eBPF still gets Services.
        Err(e) if requested.is_none() && decision.mode == Mode::Ebpf => {
            tracing::error!("the eBPF dataplane failed to start: {e}; falling back");
            let probes = Probes { bpf_syscall: Err(format!("loading our programs failed: {e}")), ..probes };
            let decision = mode::decide(None, &probes)?;
            info!(mode = %decision.mode, reasons = ?decision.reasons, "proxy mode chosen after the eBPF failure");
            mode::cleanup_leftovers(decision.mode, opts.netns.as_deref());
            Ok((start(decision.mode, opts)?, decision))
        }
        Err(e) => Err(e),
    }
}

impl StartOptions {
    /// The options the daemon's flags ask for.
    pub fn from_args(args: &crate::config::Args) -> Result<StartOptions, String> {
        let mut cluster_cidrs = Vec::new();
        for c in &args.cluster_cidr {
            cluster_cidrs.push(
                crate::model::convert::parse_cidr(c.trim())
                    .map_err(|e| format!("--cluster-cidr {c:?}: {e}"))?,
            );
        }
        Ok(StartOptions {
            cgroup: args.cgroup_path.clone(),
            bpf_pin_dir: args.bpf_pin_dir.clone(),
            netns: args.netns.clone(),
            cleanup_on_exit: args.cleanup_on_exit,
            render: RenderConfig {
                masquerade_all: args.masquerade_all,
                cluster_cidrs,
                masquerade_bit: args.masquerade_bit,
            },
            relay: RelayConfig::default(),
        })
    }
}
