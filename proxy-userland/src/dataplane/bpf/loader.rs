//! Loading the embedded object and attaching its programs.
//!
//! Without a pin directory everything lives as long as the daemon: its exit detaches the
//! programs and frees the maps. With one (a bpffs folder, as blixt's loader does), maps and
//! links are pinned there, so a restart or an upgrade keeps every connection flowing: the
//! programs stay attached while no daemon runs, the next daemon reuses the maps and reads
//! back what they hold, attaches its programs beside the old ones and only then detaches
//! those. Two generations running at once is harmless: the first translates a ClusterIP to
//! a pod, the second sees a pod address and lets it through.

use std::{
    fs::File,
    io,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfError, EbpfLoader,
    programs::{
        CgroupAttachMode, CgroupSock, CgroupSockAddr, ProgramError, SchedClassifier, TcAttachType,
        Xdp, XdpMode,
        links::{FdLink, PinnedLink},
    },
};
use proxy_common::maps as map_names;

use super::{
    AttachOptions,
    devices::{DeviceError, NodeDevices},
    host_stack::{AutoHostRouting, HostRouting},
    pods::{self, PodDevices},
    route_keys::RouteKeys,
};
use crate::dataplane::netns::in_netns;

/// Maps of this layout live in `<pin dir>/maps-v<N>`: a daemon with another layout never
/// reads maps it does not understand.
pub const MAP_LAYOUT_VERSION: u32 = 1;

/// The socket programs, v4 and v6, by their function names in `proxy-ebpf`.
pub const SOCK_PROGRAMS: [&str; 8] = [
    "fp_connect4",
    "fp_sendmsg4",
    "fp_recvmsg4",
    "fp_getpeer4",
    "fp_connect6",
    "fp_sendmsg6",
    "fp_recvmsg6",
    "fp_getpeer6",
];

/// The cgroup sock_release program that deletes a closing socket's reverse-NAT entry.
pub const SOCK_RELEASE: &str = "fp_sock_release";

/// The packet programs (node ports, external and load-balancer IPs), by function name.
pub const NODEPORT_INGRESS: &str = "fp_nodeport_in";
pub const NODEPORT_EGRESS: &str = "fp_nodeport_out";
pub const NODEPORT_XDP: &str = "fp_nodeport_xdp";
/// The pods' devices' programs (per-packet Service translation for pods), by function name.
pub const POD_INGRESS: &str = "fp_pod_in";
pub const POD_EGRESS: &str = "fp_pod_out";

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot open cgroup {path}: {source} (is cgroup v2 mounted there?)")]
    Cgroup {
        path: String,
        source: std::io::Error,
    },
    #[error("loading the eBPF object failed: {0}")]
    Object(#[from] EbpfError),
    #[error("program {name} is missing from the eBPF object")]
    MissingProgram { name: &'static str },
    #[error("program {name} is not of the type its name says (cgroup sock_addr, sock, tc, XDP)")]
    WrongType { name: &'static str },
    #[error("the kernel refused program {name}: {source}")]
    Program {
        name: &'static str,
        source: ProgramError,
    },
    #[error("map {name} is missing from the eBPF object")]
    MissingMap { name: &'static str },
    #[error("map {name} has an unexpected type: {source}")]
    Map {
        name: &'static str,
        source: aya::maps::MapError,
    },
    #[error("pinning under {path}: {source} (is it on a bpffs mount?)")]
    Pin { path: String, source: io::Error },
    #[error("attaching {name} to device {device}: {source}")]
    Device {
        name: &'static str,
        device: String,
        source: ProgramError,
    },
    #[error(transparent)]
    Devices(#[from] DeviceError),
    #[error("per-packet translation on the pods' devices: {0} (it needs tcx, kernel 6.6 or later)")]
    PodDevices(io::Error),
    #[error("starting a watcher of the host's routing or netfilter: {0}")]
    RouteKeys(io::Error),
}

impl LoadError {
    /// Whether the error concerns only the node-port programs or their devices.
    pub fn is_packet_path(&self) -> bool {
        match self {
            LoadError::Devices(_) | LoadError::Device { .. } => true,
            LoadError::Program { name, .. }
            | LoadError::MissingProgram { name }
            | LoadError::WrongType { name } => {
                [NODEPORT_INGRESS, NODEPORT_EGRESS, NODEPORT_XDP].contains(name)
            }
            _ => false,
        }
    }
}

/// The loaded object with its programs attached. Dropping it detaches them (aya attaches
/// through BPF links, which go when their fd closes) and frees the maps.
pub struct Attached {
    ebpf: Ebpf,
    /// The packet path's devices and addresses, when it is attached.
    pub node_devices: Option<NodeDevices>,
    /// The watcher that keeps the pods' devices' programs attached, when asked for.
    pub pod_devices: Option<PodDevices>,
    /// The watcher that tells the per-packet programs how to key the FIB's answers, while
    /// any is attached.
    _route_keys: Option<RouteKeys>,
    /// The watcher that turns host routing on and off (`--bpf-host-routing auto`).
    _auto_host_routing: Option<AutoHostRouting>,
}

impl Attached {
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }
}

/// The object built by `build.rs` from `proxy-ebpf`.
pub fn object() -> &'static [u8] {
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf"))
}

/// Whether the kernel has `bpf_ktime_get_coarse_ns` (Linux 5.11), which the programs then
/// read the time with.
fn coarse_clock() -> bool {
    aya::util::KernelVersion::current().is_ok_and(|v| v >= aya::util::KernelVersion::new(5, 11, 0))
}

fn pin_err(path: &Path) -> impl FnOnce(io::Error) -> LoadError + '_ {
    move |source| LoadError::Pin {
        path: path.display().to_string(),
        source,
    }
}

/// Pinning works only on bpffs; saying so beats the loader's bare "pinning failed".
fn check_bpffs(dir: &Path) -> Result<(), LoadError> {
    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|e| pin_err(dir)(io::Error::other(e)))?;
    // SAFETY: statfs is integers and arrays of integers; all zeros is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` a writable statfs, both live for the call.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(pin_err(dir)(io::Error::last_os_error()));
    }
    if st.f_type as i64 != BPF_FS_MAGIC {
        return Err(pin_err(dir)(io::Error::other("not a bpffs file system")));
    }
    Ok(())
}

/// Where pinned maps and links go under a pin directory.
pub struct PinLayout {
    pub maps: PathBuf,
    pub links: PathBuf,
    /// The pods' devices' links, which come and go with the pods (see `pods`).
    pub pod_links: PathBuf,
}

impl PinLayout {
    pub fn new(dir: &Path) -> Self {
        Self {
            maps: dir.join(format!("maps-v{MAP_LAYOUT_VERSION}")),
            links: dir.join("links"),
            pod_links: dir.join("pod-links"),
        }
    }
}

/// Detaches and unpins everything a previous daemon pinned under `dir`, every layout
/// version: `fastpath --cleanup`, a forced fresh load, or leaving eBPF mode.
pub fn remove_pinned(dir: &Path) -> Result<(), LoadError> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(pin_err(dir)(e)),
        _ => Ok(()),
    }
}

/// Loads the programs and attaches them to `cgroup` and, with `packet`, the node-port
/// programs to its devices (tc ingress and egress). With `pin_dir`, maps are reused from
/// (or pinned to) it and the links are pinned there, replacing an older generation's.
pub fn load_and_attach(cgroup: &Path, opts: &AttachOptions) -> Result<Attached, LoadError> {
    let (pin_dir, packet) = (opts.pin_dir.as_deref(), opts.packet.as_ref());
    let cgroup_file = File::open(cgroup).map_err(|source| LoadError::Cgroup {
        path: cgroup.display().to_string(),
        source,
    })?;
    let layout = pin_dir.map(PinLayout::new);
    let mut loader = EbpfLoader::new();
    let map_paths: Vec<(&str, PathBuf)> = match &layout {
        Some(l) => {
            std::fs::create_dir_all(&l.maps).map_err(pin_err(&l.maps))?;
            std::fs::create_dir_all(&l.links).map_err(pin_err(&l.links))?;
            check_bpffs(&l.maps)?;
            map_names::ALL
                .iter()
                .map(|n| (*n, l.maps.join(n)))
                .collect()
        }
        None => Vec::new(),
    };
    for (name, path) in &map_paths {
        loader.map_pin_path(name, path.as_path());
    }
    if let Some(max) = opts.lb_map_max {
        for name in [
            map_names::SERVICES4,
            map_names::SERVICES6,
            map_names::BACKENDS4,
            map_names::BACKENDS6,
        ] {
            loader.map_max_entries(name, max.max(1));
        }
        // A backend slot of either family's service map can need a match entry.
        loader.map_max_entries(map_names::AFFINITY_MATCH, max.max(1).saturating_mul(2));
    }
    if let Some(max) = opts.ct_max {
        for name in [map_names::CT4, map_names::CT6] {
            loader.map_max_entries(name, max);
        }
    }
    // Read-only in the programs: the verifier sees the value, and every node of a cluster
    // hashes flows alike.
    loader.override_global("MAGLEV_SEED", &opts.lb.maglev_seed, true);
    let coarse_clock = u8::from(coarse_clock());
    loader.override_global("COARSE_CLOCK", &coarse_clock, true);
    // A filter made afresh beside maps a daemon without it left pinned must learn what
    // they hold before a program reads it.
    let fresh = |name: &str| map_paths.iter().any(|(n, p)| *n == name && !p.exists());
    let (front_fresh, reply_fresh) = (
        fresh(map_names::FRONT_FILTER) || fresh(map_names::NODE_PORTS),
        fresh(map_names::REPLY_FILTER),
    );
    let mut ebpf = loader.load(object())?;
    match super::filter_seed::seed(&mut ebpf, front_fresh, reply_fresh) {
        Ok((frontends, replies)) if front_fresh || reply_fresh => tracing::info!(
            frontend_entries = frontends,
            reply_entries = replies,
            "filled new packet-path filters from the pinned maps"
        ),
        Ok(_) => {}
        Err((name, Some(source))) => return Err(LoadError::Map { name, source }),
        Err((name, None)) => return Err(LoadError::MissingMap { name }),
    }
    // A generation tag keeps this daemon's link pins apart from the previous one's until
    // ours are in place.
    let generation = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    );
    let mut pinned_now = Vec::new();
    // With a pin directory a link is pinned there, so it outlives us; without, it stays
    // with its program and goes when we exit.
    let mut pin = |name: &'static str, link: Result<FdLink, String>, tag: &str| {
        let Some(l) = &layout else { return Ok(()) };
        let fd_link = link.map_err(|e| LoadError::Pin {
            path: l.links.display().to_string(),
            source: io::Error::other(format!("link of {name} is not a BPF link: {e}")),
        })?;
        let path = l.links.join(format!("{tag}@{generation}"));
        fd_link
            .pin(&path)
            .map_err(|e| pin_err(&path)(io::Error::other(e)))?;
        pinned_now.push(path);
        Ok::<(), LoadError>(())
    };
    // Program types share no loading trait in aya: these two spell the common steps once.
    macro_rules! loaded {
        ($name:expr, $ty:ty) => {{
            let name = $name;
            let program: &mut $ty = ebpf
                .program_mut(name)
                .ok_or(LoadError::MissingProgram { name })?
                .try_into()
                .map_err(|_| LoadError::WrongType { name })?;
            program
                .load()
                .map_err(|source| LoadError::Program { name, source })?;
            program
        }};
    }
    macro_rules! keep {
        ($program:expr, $name:expr, $link_id:expr, $tag:expr) => {
            if layout.is_some() {
                let name = $name;
                let link = $program
                    .take_link($link_id)
                    .map_err(|source| LoadError::Program { name, source })?;
                pin(
                    name,
                    FdLink::try_from(link).map_err(|e| e.to_string()),
                    $tag,
                )?;
            }
        };
    }
    for name in SOCK_PROGRAMS {
        let program = loaded!(name, CgroupSockAddr);
        // Through a BPF link (kernel >= 5.7) the kernel wants flags 0 and always allows other
        // programs beside ours; `Single` is what passes 0.
        let link_id = program
            .attach(&cgroup_file, CgroupAttachMode::Single)
            .map_err(|source| LoadError::Program { name, source })?;
        keep!(program, name, link_id, name);
    }
    // Before Linux 5.9 there is no sock_release hook: the reverse-NAT entries then age out
    // of their LRU map as they always did, and the socket path works as before.
    let release: Result<(), LoadError> = (|| {
        let name = SOCK_RELEASE;
        let program = loaded!(name, CgroupSock);
        let link_id = program
            .attach(&cgroup_file, CgroupAttachMode::Single)
            .map_err(|source| LoadError::Program { name, source })?;
        keep!(program, name, link_id, name);
        Ok(())
    })();
    if let Err(e) = release {
        tracing::warn!(
            "closing sockets keep their reverse-NAT entries until the LRU evicts them: {e}"
        );
    }
    let mut node_devices = None;
    if let Some(cfg) = packet {
        let mut devices = NodeDevices::read(cfg)?;
        // Interface names resolve in the devices' namespace.
        let netns = cfg.netns.as_deref();
        // Before TCX (6.6) aya attaches tc programs to the clsact qdisc, which must exist.
        let needs_clsact = aya::util::KernelVersion::current()
            .map_or(true, |v| v < aya::util::KernelVersion::new(6, 6, 0));
        for (name, attach_type) in [
            (NODEPORT_INGRESS, TcAttachType::Ingress),
            (NODEPORT_EGRESS, TcAttachType::Egress),
        ] {
            let program = loaded!(name, SchedClassifier);
            for dev in &devices.devices {
                let link_id = in_netns(netns, || {
                    if needs_clsact {
                        // It may be there already: the attach below says if it is not.
                        let _ = aya::programs::tc::qdisc_add_clsact(&dev.name);
                    }
                    program.attach(&dev.name, attach_type)
                })
                .map_err(DeviceError::from)?
                .map_err(|source| LoadError::Device {
                    name,
                    device: dev.name.clone(),
                    source,
                })?;
                keep!(program, name, link_id, &format!("{name}-{}", dev.ifindex));
            }
        }
        if cfg.xdp {
            let name = NODEPORT_XDP;
            let program = loaded!(name, Xdp);
            for dev in &mut devices.devices {
                // A driver without native XDP is no error: tc does the same work there.
                let attached = in_netns(netns, || program.attach(&dev.name, XdpMode::Driver))
                    .map_err(DeviceError::from)?;
                let link_id = match attached {
                    Ok(id) => id,
                    Err(e) => {
                        tracing::info!(device = %dev.name, "no native XDP, tc alone serves it: {e}");
                        continue;
                    }
                };
                dev.xdp = true;
                keep!(program, name, link_id, &format!("{name}-{}", dev.ifindex));
            }
        }
        node_devices = Some(devices);
    }
    let pod_devices = match &opts.pods {
        Some(cfg) => {
            let mut fds = Vec::new();
            for name in [POD_INGRESS, POD_EGRESS] {
                let program = loaded!(name, SchedClassifier);
                let fd = program
                    .fd()
                    .map_err(|source| LoadError::Program { name, source })?;
                fds.push(fd.try_clone().map_err(LoadError::PodDevices)?);
            }
            let egress = fds.pop().expect("two programs");
            let ingress = fds.pop().expect("two programs");
            let pin_dir = layout.as_ref().map(|l| l.pod_links.as_path());
            let name = map_names::POD_DEVICES;
            let map = ebpf.take_map(name).ok_or(LoadError::MissingMap { name })?;
            let map = aya::maps::HashMap::try_from(map)
                .map_err(|source| LoadError::Map { name, source })?;
            let known = pods::KnownDevices::new(map);
            Some(
                PodDevices::start(cfg, (ingress, egress), known, pin_dir)
                    .map_err(LoadError::PodDevices)?,
            )
        }
        None => None,
    };
    // The namespaces the per-packet programs' devices are in: where their packets meet the
    // FIB and the host's netfilter.
    let mut namespaces = Vec::new();
    if node_devices.is_some() {
        namespaces.push(packet.and_then(|p| p.netns.clone()));
    }
    if let Some(p) = &opts.pods {
        namespaces.push(p.netns.clone());
    }
    namespaces.dedup();
    let route_keys = if namespaces.is_empty() {
        None
    } else {
        let name = map_names::ROUTE_KEYS;
        let map = ebpf.take_map(name).ok_or(LoadError::MissingMap { name })?;
        let map =
            aya::maps::Array::try_from(map).map_err(|source| LoadError::Map { name, source })?;
        Some(RouteKeys::start(map, namespaces.clone()).map_err(LoadError::RouteKeys)?)
    };
    // Only once the pods' devices translate may the socket hooks leave pods' traffic to
    // them; without a pod path, a pinned map from an earlier run is set back to "all".
    pods::write_sock_config(&mut ebpf, opts.pods.as_ref()).map_err(LoadError::PodDevices)?;
    let auto_host_routing = match &opts.pods {
        Some(p) if p.host_routing == HostRouting::Auto => {
            let name = map_names::SOCK_CONFIG;
            let map = ebpf.take_map(name).ok_or(LoadError::MissingMap { name })?;
            let map = aya::maps::Array::try_from(map)
                .map_err(|source| LoadError::Map { name, source })?;
            Some(AutoHostRouting::start(map, namespaces).map_err(LoadError::RouteKeys)?)
        }
        _ => None,
    };
    // The socket hooks take pods' traffic again: an earlier run's pod path can go.
    if let (None, Some(l)) = (&opts.pods, &layout) {
        remove_pinned(&l.pod_links)?;
    }
    // Ours are attached: only now let the previous generation go.
    if let Some(l) = &layout {
        let entries = std::fs::read_dir(&l.links).map_err(pin_err(&l.links))?;
        for entry in entries.flatten() {
            let path = entry.path();
            if pinned_now.contains(&path) {
                continue;
            }
            match PinnedLink::from_pin(&path) {
                Ok(old) => drop(old.unpin()),
                Err(_) => drop(std::fs::remove_file(&path)),
            }
        }
        // With the old programs gone, nothing reads the maps they alone used.
        for name in map_names::RETIRED {
            match std::fs::remove_file(l.maps.join(name)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    tracing::warn!("removing the retired pinned map {name}: {e}")
                }
                _ => {}
            }
        }
    }
    Ok(Attached {
        ebpf,
        node_devices,
        pod_devices,
        _route_keys: route_keys,
        _auto_host_routing: auto_host_routing,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_node_port_failures_count_as_packet_path_failures() {
        assert!(LoadError::MissingProgram { name: NODEPORT_XDP }.is_packet_path());
        assert!(
            LoadError::WrongType {
                name: NODEPORT_INGRESS
            }
            .is_packet_path()
        );
        assert!(LoadError::Devices(DeviceError::NoDevices).is_packet_path());
        assert!(
            !LoadError::MissingProgram {
                name: SOCK_PROGRAMS[0]
            }
            .is_packet_path()
        );
        assert!(!LoadError::MissingMap { name: "FP_CT4" }.is_packet_path());
    }
}
