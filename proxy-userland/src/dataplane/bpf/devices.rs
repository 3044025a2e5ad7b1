//! The node's devices for the packet path: which ones get the node-port programs, their
//! indexes and addresses, and which addresses node ports answer on.
//!
//! Read once at start-up, in the network namespace the devices live in (the host's, or a
//! test bed's node namespace).

use std::{
    ffi::{CStr, CString},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use crate::dataplane::{
    iptables::render::nodeport_address_allowed,
    netns::{NetnsError, in_netns},
};

/// What the packet path is asked to cover.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PacketPathConfig {
    /// The devices' network namespace (a name under /run/netns); None: ours.
    pub netns: Option<String>,
    /// Devices to attach to; empty: those of the default routes (IPv4 and IPv6).
    pub devices: Vec<String>,
    /// Node ports answer only on addresses in these ranges (kube-proxy's
    /// `--nodeport-addresses`); none of a family: on every address of that family.
    pub node_port_cidrs: Vec<(IpAddr, u8)>,
    /// Run the ingress work in XDP, ahead of tc, on devices whose driver supports native
    /// XDP; the others keep tc alone.
    pub xdp: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("no device for node ports: none given and no default route to take it from")]
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
    /// The addresses SNATed traffic leaves this device with: its first IPv4 address, and
    /// its first IPv6 address that is not link-local.
    pub ipv4: Option<Ipv4Addr>,
    pub ipv6: Option<Ipv6Addr>,
    /// Native XDP runs ahead of tc on it (set once attached).
    pub xdp: bool,
}

/// The devices to attach to and the addresses node ports answer on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeDevices {
    pub devices: Vec<Device>,
    pub node_port_addrs: Vec<IpAddr>,
}

impl NodeDevices {
    pub fn read(cfg: &PacketPathConfig) -> Result<Self, DeviceError> {
        in_netns(cfg.netns.as_deref(), || read_here(cfg))?
    }

    /// (ifindex, address) of every device's SNAT addresses, for the SNAT maps.
    pub fn snat_addresses(&self) -> Vec<(u32, IpAddr)> {
        self.devices
            .iter()
            .flat_map(|d| {
                let v4 = d.ipv4.map(|a| (d.ifindex, a.into()));
                v4.into_iter().chain(d.ipv6.map(|a| (d.ifindex, a.into())))
            })
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
        let mine = || addrs.iter().filter(|(n, _)| *n == name).map(|(_, a)| *a);
        let ipv4 = mine().find_map(|a| match a {
            IpAddr::V4(a) => Some(a),
            IpAddr::V6(_) => None,
        });
        let ipv6 = mine().find_map(|a| match a {
            IpAddr::V6(a) => Some(a),
            IpAddr::V4(_) => None,
        });
        devices.push(Device {
            name,
            ifindex,
            ipv4,
            ipv6,
            xdp: false,
        });
    }
    let mut node_port_addrs: Vec<IpAddr> = addrs
        .iter()
        .map(|(_, a)| *a)
        .filter(|a| !a.is_loopback())
        .filter(|a| nodeport_address_allowed(&cfg.node_port_cidrs, *a))
        .collect();
    node_port_addrs.sort();
    node_port_addrs.dedup();
    Ok(NodeDevices {
        devices,
        node_port_addrs,
    })
}

/// The addresses of the first default route's device in `netns` (None: ours), IPv4 ones
/// first: the fallback for `--nodeport-addresses primary` when nothing names the node's IP.
pub fn default_route_addresses(netns: Option<&str>) -> Result<Vec<IpAddr>, String> {
    in_netns(netns, || {
        let Some(dev) = default_route_devices().into_iter().next() else {
            return Err("no default route".to_string());
        };
        let addrs = interface_addresses().map_err(|e| format!("reading addresses: {e}"))?;
        let mut mine: Vec<IpAddr> = addrs
            .into_iter()
            .filter(|(n, a)| *n == dev && !a.is_loopback())
            .map(|(_, a)| a)
            .collect();
        // Stable: each family keeps the kernel's order, whose first is the primary one.
        mine.sort_by_key(|a| a.is_ipv6());
        Ok(mine)
    })
    .map_err(|e| e.to_string())?
}

/// fe80::/10: an address of one link only, never a node port's or a SNAT source.
fn link_local(a: &IpAddr) -> bool {
    matches!(a, IpAddr::V6(a) if a.segments()[0] & 0xffc0 == 0xfe80)
}

fn if_index(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    // SAFETY: a valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (i != 0).then_some(i)
}

/// (interface name, address) of every IPv4 address and every IPv6 address that is not
/// link-local in this thread's network namespace.
pub(super) fn interface_addresses() -> std::io::Result<Vec<(String, IpAddr)>> {
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
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: a non-null ifa_addr points at a sockaddr of at least its family's size.
        let addr: IpAddr = match i32::from(unsafe { (*ifa.ifa_addr).sa_family }) {
            libc::AF_INET => {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)).into()
            }
            libc::AF_INET6 => {
                // SAFETY: an AF_INET6 address is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                Ipv6Addr::from(sin6.sin6_addr.s6_addr).into()
            }
            _ => continue,
        };
        if link_local(&addr) {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string of the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        out.push((name, addr));
    }
    // SAFETY: the list came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The devices of the default routes, from this thread's view of /proc/net/route and
/// /proc/net/ipv6_route (where `lo` carries the unreachable defaults, which are not ours).
pub(super) fn default_route_devices() -> Vec<String> {
    let read = |f: &str| std::fs::read_to_string(format!("/proc/thread-self/net/{f}"));
    let v4 = read("route").unwrap_or_default();
    let v6 = read("ipv6_route").unwrap_or_default();
    let v4 = v4.lines().skip(1).filter_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() > 7 && f[1] == "00000000" && f[7] == "00000000").then(|| f[0].to_string())
    });
    let v6 = v6.lines().filter_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let default = f.len() == 10 && f[1] == "00" && f[0].bytes().all(|b| b == b'0');
        (default && f[9] != "lo").then(|| f[9].to_string())
    });
    let mut out: Vec<String> = Vec::new();
    for d in v4.chain(v6) {
        if !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::iptables::render::cidr_contains as contains;

    #[test]
    fn cidr_filter_matches_prefixes() {
        let net = ("198.18.0.0".parse().unwrap(), 16);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(contains(net, ip("198.18.3.4")));
        assert!(!contains(net, ip("198.19.0.1")));
        assert!(contains((ip("0.0.0.0"), 0), ip("198.19.0.1")));
        assert!(!contains((ip("2001:db8::"), 32), ip("198.19.0.1")));
        assert!(contains((ip("2001:db8::"), 32), ip("2001:db8:ff::1")));
        assert!(!contains((ip("2001:db8::"), 48), ip("2001:db8:ff::1")));
        assert!(!contains((ip("198.18.0.0"), 15), ip("2001:db8::1")));
        assert!(link_local(&ip("fe80::1")) && !link_local(&ip("2001:db8::1")));
    }

    /// kube-proxy's NewNodePortAddresses: CIDRs of one family leave the other family's
    /// addresses all open, as if `::/0` (or `0.0.0.0/0`) were given.
    #[test]
    fn nodeport_addresses_of_one_family_keep_the_other() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let v4_only = [(ip("198.18.2.0"), 24)];
        assert!(nodeport_address_allowed(&v4_only, ip("198.18.2.7")));
        assert!(!nodeport_address_allowed(&v4_only, ip("198.18.3.7")));
        assert!(nodeport_address_allowed(&v4_only, ip("2001:db8::7")));
        let both = [(ip("198.18.2.0"), 24), (ip("2001:db8:1::"), 64)];
        assert!(!nodeport_address_allowed(&both, ip("2001:db8::7")));
        assert!(nodeport_address_allowed(&both, ip("2001:db8:1::7")));
        assert!(nodeport_address_allowed(&[], ip("198.19.0.1")));
    }
}
