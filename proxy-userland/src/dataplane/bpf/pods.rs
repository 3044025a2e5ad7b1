//! Per-packet Service translation on the pods' devices (kube-proxy's
//! `--detect-local-mode=InterfaceNamePrefix`): the host ends of the pods' veths, chosen by
//! name prefix, get `fp_pod_in` on tc ingress (a pod's packets to a ClusterIP, translated
//! with the flow table) and `fp_pod_out` on tc egress (replies, shown as from the ClusterIP).
//!
//! Pods come and go, and their devices with them, so a thread of its own (never the async
//! runtime) looks at the namespace's devices whenever the kernel reports a device change
//! (rtnetlink's link group), and twice a second anyway: new matching devices get the
//! programs within milliseconds of appearing, through BPF links it holds, a device that went takes its links with it and its
//! entry is forgotten. Without a pin directory the links close when the watcher stops, i.e.
//! with the daemon; with one they are pinned there ([`pins`]) and outlive it, as the socket
//! hooks' do, so pods' UDP stays translated while the daemon restarts.

use std::{
    collections::BTreeMap,
    ffi::CStr,
    io,
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use aya::programs::ProgramFd;

use crate::config::HostRouting;
use crate::dataplane::{netlink::NetlinkSocket, netns, watcher::Watcher};

mod auto;
mod pins;

/// How often the devices are listed again without news of a change.
const RESCAN: Duration = Duration::from_millis(500);

/// What the pod path is asked to cover.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodPathConfig {
    /// The namespace of the pods' host-side devices (a name under /run/netns); None: ours.
    pub netns: Option<String>,
    /// Devices whose names start with one of these are pods' devices.
    pub prefixes: Vec<String>,
    /// `--pod-interfaces auto`: so are the veths found by [`auto::pod_devices`].
    pub auto: bool,
    /// The node's addresses known from its configuration (`--bind-address`), beside those
    /// of the default routes' devices: a veth holding one is the node's uplink.
    pub node_addresses: Vec<std::net::IpAddr>,
    /// Socket load-balancing for the host namespace only (Cilium's
    /// socketLB.hostNamespaceOnly): pods' TCP is translated per packet too.
    pub host_namespace_only: bool,
    /// Whether translated packets for pods on this node go straight into their namespace
    /// (`--bpf-host-routing`; see `proxy_common::sockcfg::flags::HOST_ROUTING` and
    /// `host_stack`, which turns it on and off for `Auto`).
    pub host_routing: HostRouting,
}

impl PodPathConfig {
    fn matches(&self, name: &str) -> bool {
        self.prefixes
            .iter()
            .any(|p| !p.is_empty() && name.starts_with(p.as_str()))
    }
}

const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;

/// `bpf_attr` for BPF_LINK_CREATE with the tcx member (linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct LinkCreateTcx {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
    relative_fd: u32,
    _pad: u32,
    expected_revision: u64,
}
const _: () = assert!(std::mem::size_of::<LinkCreateTcx>() == 32);

/// Attaches `prog` to `ifindex` through a TCX link (kernel >= 6.6), after any program
/// already there; the link goes when the returned fd closes or the device does.
fn tcx_attach(prog: &ProgramFd, ifindex: u32, attach_type: u32) -> io::Result<OwnedFd> {
    let attr = LinkCreateTcx {
        prog_fd: prog.as_fd().as_raw_fd() as u32,
        target_ifindex: ifindex,
        attach_type,
        ..Default::default()
    };
    // SAFETY: `attr` is a valid, fully initialised bpf_attr prefix of the size we pass; the
    // kernel reads only that much.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_CREATE,
            &attr as *const LinkCreateTcx,
            std::mem::size_of::<LinkCreateTcx>() as u32,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd the kernel just returned, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// (ifindex, name) of every device in this thread's network namespace.
fn devices_here() -> Vec<(u32, String)> {
    // SAFETY: if_nameindex returns an array ending in a zero entry, freed below.
    let head = unsafe { libc::if_nameindex() };
    if head.is_null() {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut cur = head;
    // SAFETY: walks the array up to its terminating entry.
    unsafe {
        while (*cur).if_index != 0 && !(*cur).if_name.is_null() {
            let name = CStr::from_ptr((*cur).if_name)
                .to_string_lossy()
                .into_owned();
            out.push(((*cur).if_index, name));
            cur = cur.add(1);
        }
        libc::if_freenameindex(head);
    }
    out
}

struct PodDevice {
    name: String,
    _links: [OwnedFd; 2],
    /// Where its links are pinned (none without a pin directory).
    pins: Vec<PathBuf>,
}

/// The watcher thread; stops and detaches everything on drop.
pub struct PodDevices {
    attached: Arc<AtomicUsize>,
    _watcher: Watcher,
}

/// A socket the kernel tells of every device change in this thread's namespace
/// (RTMGRP_LINK; no capability needed).
fn link_news() -> io::Result<NetlinkSocket> {
    const RTMGRP_LINK: u32 = 1;
    let socket = NetlinkSocket::open(libc::SOCK_RAW, libc::NETLINK_ROUTE)?;
    socket.join_groups(RTMGRP_LINK)?;
    Ok(socket)
}

impl PodDevices {
    /// Attaches to the matching devices there are now (so the caller knows the programs
    /// work here), then keeps watching from a thread. With `pin_dir` (a bpffs folder) the
    /// links are pinned there and replace those a previous daemon pinned (see [`pins`]).
    /// `known`: the map of pods' devices the programs may redirect into, kept in step with
    /// the devices attached to.
    pub fn start(
        cfg: &PodPathConfig,
        (ingress, egress): (ProgramFd, ProgramFd),
        known: KnownDevices,
        pin_dir: Option<&Path>,
    ) -> io::Result<Self> {
        let attached = Arc::new(AtomicUsize::new(0));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let mut pins = pin_dir.map(pins::Pins::open).transpose()?;
        let watcher = {
            let (cfg, attached) = (cfg.clone(), attached.clone());
            Watcher::spawn("fp-pod-devices", move |stop| {
                if let Some(ns) = &cfg.netns
                    && let Err(e) = netns::enter(ns)
                {
                    let _ = ready_tx.send(Err(io::Error::other(e.to_string())));
                    return;
                }
                // Told of every device change from before the first look, so a new
                // pod's device gets the programs as it appears; the looks twice a
                // second remain for what a lost message would hide.
                let news = link_news()
                    .inspect_err(|e| {
                        tracing::warn!("pod devices: no link events ({e}); looking twice a second")
                    })
                    .ok();
                let mut devices: BTreeMap<u32, PodDevice> = BTreeMap::new();
                let mut known = known;
                let progs = (&ingress, &egress);
                let first =
                    rescan(&cfg, progs, &mut devices, pins.as_mut()).and(known.follow(&devices));
                attached.store(devices.len(), Ordering::Relaxed);
                let _ = ready_tx.send(first);
                while !stop.load(Ordering::Relaxed) {
                    NetlinkSocket::wait_or_sleep(news.as_ref(), RESCAN, "pod devices");
                    if let Err(e) =
                        rescan(&cfg, progs, &mut devices, pins.as_mut()).and(known.follow(&devices))
                    {
                        tracing::warn!("pod devices: {e}");
                    }
                    attached.store(devices.len(), Ordering::Relaxed);
                }
            })?
        };
        let devices = PodDevices {
            attached,
            _watcher: watcher,
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(devices),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(io::Error::other("the pod device watcher died")),
        }
    }

    /// How many pod devices carry the programs now.
    pub fn attached(&self) -> usize {
        self.attached.load(Ordering::Relaxed)
    }
}

/// The pods' devices map (`FP_POD_DEVS`), as the programs see it.
pub struct KnownDevices {
    map: aya::maps::HashMap<aya::maps::MapData, u32, u32>,
    /// What this process wrote; None until the first look, which clears what a previous
    /// daemon left (its ifindexes may name other devices now).
    written: Option<std::collections::BTreeSet<u32>>,
}

impl KnownDevices {
    pub fn new(map: aya::maps::HashMap<aya::maps::MapData, u32, u32>) -> Self {
        Self { map, written: None }
    }

    /// Brings the map in line with the devices attached to: gone ones first, so a reused
    /// index never names a device we did not check.
    fn follow(&mut self, devices: &BTreeMap<u32, PodDevice>) -> io::Result<()> {
        let written = match &mut self.written {
            Some(w) => w,
            None => {
                let old: Vec<u32> = self.map.keys().filter_map(Result::ok).collect();
                for k in old {
                    let _ = self.map.remove(&k);
                }
                self.written.insert(Default::default())
            }
        };
        let err = |e: aya::maps::MapError| io::Error::other(format!("the pod device map: {e}"));
        let gone: Vec<u32> = written
            .iter()
            .filter(|i| !devices.contains_key(i))
            .copied()
            .collect();
        for i in gone {
            self.map.remove(&i).map_err(err)?;
            written.remove(&i);
        }
        for &i in devices.keys() {
            if written.insert(i) {
                self.map.insert(i, 1, 0).map_err(err)?;
            }
        }
        Ok(())
    }
}

/// Brings the attachments (and their pins) in line with the devices there are. A device
/// that cannot take the programs is reported (and tried again next time); the others still
/// get them.
fn rescan(
    cfg: &PodPathConfig,
    (ingress, egress): (&ProgramFd, &ProgramFd),
    devices: &mut BTreeMap<u32, PodDevice>,
    pins: Option<&mut pins::Pins>,
) -> io::Result<()> {
    let found = if cfg.auto {
        auto_devices(cfg)?
    } else {
        Default::default()
    };
    let now: BTreeMap<u32, String> = devices_here()
        .into_iter()
        .filter(|(ifindex, name)| cfg.matches(name) || found.contains(ifindex))
        .collect();
    // Gone, or the index now names another device: its links went with the old device, and
    // its pins are all that holds them.
    devices.retain(|ifindex, d| {
        let here = now.get(ifindex) == Some(&d.name);
        if !here {
            pins::remove(&d.pins);
        }
        here
    });
    let mut last_error = None;
    for (ifindex, name) in now.clone() {
        if devices.contains_key(&ifindex) {
            continue;
        }
        let links = tcx_attach(ingress, ifindex, BPF_TCX_INGRESS)
            .and_then(|i| Ok([i, tcx_attach(egress, ifindex, BPF_TCX_EGRESS)?]))
            .and_then(|links| {
                // Unpinned, the links would not outlive us: such a device is tried again.
                let pinned = match pins.as_deref() {
                    Some(p) => p.pin(ifindex, &name, &links)?,
                    None => Vec::new(),
                };
                Ok((links, pinned))
            });
        match links {
            Ok((links, pinned)) => {
                tracing::info!(device = %name, "pod device: per-packet Service translation attached");
                devices.insert(
                    ifindex,
                    PodDevice {
                        name,
                        _links: links,
                        pins: pinned,
                    },
                );
            }
            // It may have gone between the listing and the attach.
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {}
            Err(e) => {
                last_error = Some(io::Error::new(
                    e.kind(),
                    format!("attaching to {name}: {e}"),
                ))
            }
        }
    }
    // A previous daemon's links go once ours serve their device, or with their device; a
    // device we could not attach to keeps them meanwhile.
    if let Some(p) = pins {
        let waiting: std::collections::BTreeSet<String> = now
            .iter()
            .filter(|(ifindex, _)| !devices.contains_key(ifindex))
            .map(|(ifindex, name)| pins::device_key(*ifindex, name))
            .collect();
        p.release_inherited(|key| waiting.contains(key));
    }
    last_error.map_or(Ok(()), Err)
}

/// The devices `--pod-interfaces auto` takes here (see [`auto`]), read afresh: an uplink
/// may get its address or default route after start-up.
fn auto_devices(cfg: &PodPathConfig) -> io::Result<std::collections::BTreeSet<u32>> {
    use super::devices::{default_route_devices, interface_addresses};
    let links = auto::links_here()
        .map_err(|e| io::Error::new(e.kind(), format!("listing devices: {e}")))?;
    let uplinks = default_route_devices();
    let addresses = interface_addresses()?;
    let mut node: std::collections::BTreeSet<std::net::IpAddr> = addresses
        .iter()
        .filter(|(n, _)| uplinks.contains(n))
        .map(|(_, a)| *a)
        .collect();
    node.extend(cfg.node_addresses.iter().filter(|a| !a.is_unspecified()));
    Ok(auto::pod_devices(&links, &uplinks, &addresses, &node))
}

/// bpf_get_netns_cookie() of namespace `ns` (None: ours), as the socket hooks see it.
pub fn netns_cookie(ns: Option<&str>) -> io::Result<u64> {
    const SO_NETNS_COOKIE: libc::c_int = 71;
    let read = || -> io::Result<u64> {
        let sock = std::net::UdpSocket::bind((std::net::Ipv4Addr::LOCALHOST, 0))?;
        let mut cookie: u64 = 0;
        let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
        // SAFETY: `cookie` and `len` are valid for writes of the sizes given.
        let rc = unsafe {
            libc::getsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_NETNS_COOKIE,
                (&mut cookie as *mut u64).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(cookie)
    };
    crate::dataplane::netns::in_netns(ns, read).map_err(|e| io::Error::other(e.to_string()))?
}

/// Tells the socket hooks what the pods' devices take over (see `proxy_common::sockcfg`):
/// with a pod path, pods' UDP (and with `host_namespace_only`, everything of theirs);
/// without one, nothing.
pub fn write_sock_config(ebpf: &mut aya::Ebpf, pods: Option<&PodPathConfig>) -> io::Result<()> {
    use proxy_common::{SockConfig, sockcfg::flags};
    let value = match pods {
        Some(cfg) => SockConfig {
            host_netns_cookie: netns_cookie(cfg.netns.as_deref())?,
            flags: flags::POD_UDP_PER_PACKET
                | if cfg.host_namespace_only {
                    flags::POD_ALL_PER_PACKET
                } else {
                    0
                }
                | if cfg.host_routing == HostRouting::True {
                    flags::HOST_ROUTING
                } else {
                    0
                },
            _pad: 0,
        },
        None => SockConfig::default(),
    };
    let name = proxy_common::maps::SOCK_CONFIG;
    let map = ebpf
        .map_mut(name)
        .ok_or_else(|| io::Error::other(format!("map {name} is missing")))?;
    let mut config: aya::maps::Array<_, SockConfig> = aya::maps::Array::try_from(map)
        .map_err(|e| io::Error::other(format!("map {name}: {e}")))?;
    config
        .set(0, value, 0)
        .map_err(|e| io::Error::other(format!("writing {name}: {e}")))
}
