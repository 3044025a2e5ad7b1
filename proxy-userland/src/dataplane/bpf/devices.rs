//! The node's devices for the packet path: which ones get the node-port programs, their
//! indexes and addresses, and which addresses node ports answer on.
//!
//! Read once at start-up, in the network namespace the devices live in (the host's, or a
//! test bed's node namespace).

use std::{
    ffi::{CStr, CString},
    net::{IpAddr, Ipv4Addr},
};

use crate::dataplane::netns::{self, NetnsError};

/// What the packet path is asked to cover.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PacketPathConfig {
    /// The devices' network namespace (a name under /run/netns); None: ours.
    pub netns: Option<String>,
    /// Devices to attach to; empty: those of the IPv4 default routes.
    pub devices: Vec<String>,
    /// Node ports answer only on addresses in these ranges (kube-proxy's
    /// `--nodeport-addresses`); empty: on every address of the node.
    pub node_port_cidrs: Vec<(IpAddr, u8)>,
    /// Run the ingress work in XDP, ahead of tc, on devices whose driver supports native
    /// XDP; the others keep tc alone.
    pub xdp: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("no device for node ports: none given and no IPv4 default route to take it from")]
    NoDevices,
    #[error("device {0:?} does not exist")]
    Unknown(String),
    #[error("reading the node's addresses: {0}")]
    Addresses(std::io::Error),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    pub name: String,
    pub ifindex: u32,
    /// The address SNATed traffic leaves this device with: its first IPv4 address.
    pub ipv4: Option<Ipv4Addr>,
    /// Native XDP runs ahead of tc on it (set once attached).
    pub xdp: bool,
}

/// The devices to attach to and the addresses node ports answer on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeDevices {
    pub devices: Vec<Device>,
    pub node_port_addrs: Vec<Ipv4Addr>,
}

impl NodeDevices {
    pub fn read(cfg: &PacketPathConfig) -> Result<Self, DeviceError> {
        in_netns(cfg.netns.as_deref(), || read_here(cfg))?
    }

    /// (ifindex, address) of every device that has an IPv4 address, for the SNAT map.
    pub fn snat_addresses(&self) -> Vec<(u32, Ipv4Addr)> {
        self.devices
            .iter()
            .filter_map(|d| Some((d.ifindex, d.ipv4?)))
            .collect()
    }
}

fn read_here(cfg: &PacketPathConfig) -> Result<NodeDevices, DeviceError> {
    let names = if cfg.devices.is_empty() {
        default_route_devices()
    } else {
        cfg.devices.clone()
    };
    if names.is_empty() {
        return Err(DeviceError::NoDevices);
    }
    let addrs = interface_addresses().map_err(DeviceError::Addresses)?;
    let mut devices = Vec::new();
    for name in names {
        let ifindex = if_index(&name).ok_or_else(|| DeviceError::Unknown(name.clone()))?;
        let ipv4 = addrs.iter().find(|(n, _)| *n == name).map(|(_, a)| *a);
        devices.push(Device {
            name,
            ifindex,
            ipv4,
            xdp: false,
        });
    }
    let mut node_port_addrs: Vec<Ipv4Addr> = addrs
        .iter()
        .map(|(_, a)| *a)
        .filter(|a| !a.is_loopback())
        .filter(|a| {
            cfg.node_port_cidrs.is_empty() || cfg.node_port_cidrs.iter().any(|c| contains(*c, *a))
        })
        .collect();
    node_port_addrs.sort();
    node_port_addrs.dedup();
    Ok(NodeDevices {
        devices,
        node_port_addrs,
    })
}

fn contains((net, len): (IpAddr, u8), a: Ipv4Addr) -> bool {
    let IpAddr::V4(net) = net else { return false };
    let mask = u32::MAX
        .checked_shl(32 - u32::from(len.min(32)))
        .unwrap_or(0);
    u32::from(net) & mask == u32::from(a) & mask
}

fn if_index(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    // SAFETY: a valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (i != 0).then_some(i)
}

/// (interface name, IPv4 address) of every address in this thread's network namespace.
fn interface_addresses() -> std::io::Result<Vec<(String, Ipv4Addr)>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null()
            // SAFETY: non-null, so a sockaddr of the list; every sockaddr_* starts with it.
            || i32::from(unsafe { (*ifa.ifa_addr).sa_family }) != libc::AF_INET
        {
            continue;
        }
        // SAFETY: an AF_INET address is a sockaddr_in.
        let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
        // SAFETY: getifaddrs gives every entry a NUL-terminated name, alive until the list
        // is freed; we copy it out before then.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        out.push((name, Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))));
    }
    // SAFETY: the list came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The devices of the IPv4 default routes, from this thread's view of /proc/net/route.
fn default_route_devices() -> Vec<String> {
    let table = std::fs::read_to_string("/proc/thread-self/net/route").unwrap_or_default();
    let mut out: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 7 && f[1] == "00000000" && f[7] == "00000000").then(|| f[0].to_string())
        })
        .collect();
    out.dedup();
    out
}

/// Runs `f` inside `ns` (None: where we are): on a thread of its own that enters the
/// namespace, so ours never changes namespace.
pub fn in_netns<T: Send>(ns: Option<&str>, f: impl FnOnce() -> T + Send) -> Result<T, NetnsError> {
    let Some(ns) = ns else { return Ok(f()) };
    std::thread::scope(|scope| {
        let handle = scope.spawn(move || {
            netns::enter(ns)?;
            Ok(f())
        });
        handle
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_filter_matches_prefixes() {
        let net = ("198.18.0.0".parse().unwrap(), 16);
        assert!(contains(net, Ipv4Addr::new(198, 18, 3, 4)));
        assert!(!contains(net, Ipv4Addr::new(198, 19, 0, 1)));
        assert!(contains(
            ("0.0.0.0".parse().unwrap(), 0),
            Ipv4Addr::new(198, 19, 0, 1)
        ));
        assert!(!contains(
            ("2001:db8::".parse().unwrap(), 32),
            Ipv4Addr::new(198, 19, 0, 1)
        ));
    }
}
