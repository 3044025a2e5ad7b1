//! Whether the dataplane a daemon programs holds a given endpoint of a service, read from
//! outside the daemon as an operator would: the pinned BPF maps (eBPF mode), or the
//! service's chain in the daemon's network namespace (iptables and nftables modes).
#![allow(dead_code)]

use std::{net::Ipv4Addr, path::Path, process::Command};

use anyhow::{Context as _, Result};
use aya::maps::{HashMap, Map, MapData};
use proxy_common::{
    Backend4, BackendId, Service4Key, ServiceValue, SockRevNat4Key, SockRevNat4Value,
    SockRevNat6Key, SockRevNat6Value, maps as names,
};
use proxy_userland::{
    dataplane::{
        iptables::names::{PortChains, endpoint_chain},
        nftables::render::PortNames,
    },
    model::{Protocol, Service, ServiceKey, ServicePort},
};

fn open(dir: &Path, name: &str) -> Result<Map> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
    Map::from_map_data(data).with_context(|| format!("{} is not a map we know", path.display()))
}

/// The pinned service and backend maps of a daemon run with `--bpf-pin-dir`.
pub struct PinnedMaps {
    services: HashMap<MapData, Service4Key, ServiceValue>,
    backends: HashMap<MapData, BackendId, Backend4>,
    dir: std::path::PathBuf,
}

impl PinnedMaps {
    /// `maps`: `<pin dir>/maps-v<N>` (see the loader's PinLayout).
    pub fn open(maps: &Path) -> Result<PinnedMaps> {
        Ok(PinnedMaps {
            services: HashMap::try_from(open(maps, names::SERVICES4)?)?,
            backends: HashMap::try_from(open(maps, names::BACKENDS4)?)?,
            dir: maps.to_path_buf(),
        })
    }

    /// Whether TCP port `port` of `cluster_ip` has a backend at `ip`: the master entry's
    /// count, each slot's backend id, each backend's address (what a connect() would read).
    pub fn holds(&self, cluster_ip: Ipv4Addr, port: u16, ip: Ipv4Addr) -> bool {
        let key = |slot| {
            Service4Key::new(
                u32::from_ne_bytes(cluster_ip.octets()),
                port.to_be(),
                6,
                slot,
            )
        };
        let Ok(master) = self.services.get(&key(0), 0) else {
            return false;
        };
        let want = u32::from_ne_bytes(ip.octets());
        (1..=master.count).any(|slot| {
            self.services
                .get(&key(slot), 0)
                .and_then(|v| self.backends.get(&v.backend_id, 0))
                .is_ok_and(|b| b.address == want)
        })
    }

    /// Fills both socket reverse-NAT maps (LRU) to their size with entries of sockets that
    /// do not exist, as a busy node's would be; returns how many were written.
    pub fn fill_reverse_nat(&self) -> Result<usize> {
        let max = names::SOCK_REVNAT_MAX as u64;
        let mut v4: HashMap<MapData, SockRevNat4Key, SockRevNat4Value> =
            HashMap::try_from(open(&self.dir, names::SOCK_REVNAT4)?)?;
        let mut v6: HashMap<MapData, SockRevNat6Key, SockRevNat6Value> =
            HashMap::try_from(open(&self.dir, names::SOCK_REVNAT6)?)?;
        let mut written = 0;
        for i in 0..max {
            // Cookies far above any the kernel hands out in a test's lifetime.
            let cookie = (1 << 62) + i;
            let (address, port) = (
                u32::from_ne_bytes([198, 18, 3, (i % 250) as u8]),
                8080u16.to_be(),
            );
            let k4 = SockRevNat4Key {
                cookie,
                address,
                port,
                _pad: [0; 2],
            };
            let v = SockRevNat4Value {
                address: u32::from_ne_bytes(WEB),
                port: 80u16.to_be(),
                rev_nat_index: 1,
            };
            written += usize::from(v4.insert(k4, v, 0).is_ok());
            let mut a6 = [0u8; 16];
            a6[..4].copy_from_slice(&[0x20, 0x01, 0x0d, 0xb8]);
            a6[8..].copy_from_slice(&i.to_be_bytes());
            let k6 = SockRevNat6Key {
                cookie,
                address: a6,
                port,
                _pad: [0; 6],
            };
            let v6v = SockRevNat6Value {
                address: a6,
                port: 80u16.to_be(),
                ..Default::default()
            };
            written += usize::from(v6.insert(k6, v6v, 0).is_ok());
        }
        Ok(written)
    }
}

const WEB: [u8; 4] = [198, 19, 0, 10];

/// The iptables chains of a service port in a namespace.
pub struct IptablesChains {
    netns: String,
    spn: String,
    svc_chain: String,
}

impl IptablesChains {
    /// Service `namespace/name`, port named `port` (TCP), in the daemon's namespace.
    pub fn new(netns: &str, namespace: &str, name: &str, port: &str) -> IptablesChains {
        let spn = format!("{namespace}/{name}:{port}");
        IptablesChains {
            netns: netns.into(),
            svc_chain: PortChains::new(&spn, Protocol::Tcp).svc,
            spn,
        }
    }

    /// Whether the service's KUBE-SVC chain jumps to the endpoint chain of `ip:target_port`
    /// (one `iptables -S` of that chain, as the daemon's backend `iptables` reads it).
    pub fn holds(&self, ip: Ipv4Addr, target_port: u16) -> bool {
        let sep = endpoint_chain(&self.spn, Protocol::Tcp, (ip, target_port).into());
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.netns,
                "iptables",
                "-w",
                "-t",
                "nat",
                "-S",
                &self.svc_chain,
            ])
            .output()
            .is_ok_and(|o| {
                o.status.success()
                    && String::from_utf8_lossy(&o.stdout).contains(&format!("-j {sep}"))
            })
    }
}

/// The nftables chain of a service port in a namespace, read over netlink: one rule dump
/// of that chain. `nft list chain` first fetches every chain and rule of the table (0.4 s
/// at 10,000 services) and starts again whenever the daemon commits meanwhile, so under
/// churn one look took tens of seconds.
pub struct NftChain {
    socket: std::os::fd::OwnedFd,
    request: Vec<u8>,
}

const NETLINK_NETFILTER: i32 = 12;
/// (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETRULE
const GETRULE: u16 = (10 << 8) | 7;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;

/// (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETSETELEM
const GETSETELEM: u16 = (10 << 8) | 13;

/// A dump request of `kind` with `body` (nfgenmsg and attributes).
fn request(kind: u16, body: &[u8]) -> Vec<u8> {
    let mut request = Vec::with_capacity(16 + body.len());
    request.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    request.extend_from_slice(&kind.to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    request.extend_from_slice(&flags.to_ne_bytes());
    request.extend_from_slice(&[0; 8]);
    request.extend_from_slice(body);
    request
}

fn attribute(out: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let len = 4 + value.len();
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(out.len() + (4 - len % 4) % 4, 0);
}

impl NftChain {
    /// Service `namespace/name`, port named `port` (TCP), in the daemon's namespace.
    pub fn new(netns: &str, namespace: &str, name: &str, port: &str) -> Result<NftChain> {
        let port = ServicePort {
            name: port.into(),
            port: 80,
            protocol: Protocol::Tcp,
            node_port: None,
        };
        let svc = Service::cluster_ip(ServiceKey::new(namespace, name), vec![], vec![port]);
        let chain = PortNames::new(&svc, &svc.ports[0]).cluster;
        let socket = proxy_userland::dataplane::netns::in_netns(Some(netns), || {
            // SAFETY: socket(2) with constant arguments; the result is checked.
            let fd = unsafe {
                libc::socket(
                    libc::AF_NETLINK,
                    libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                    NETLINK_NETFILTER,
                )
            };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: fd is a socket we just opened and own.
            Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
        })??;
        let mut body = vec![libc::AF_INET as u8, 0, 0, 0];
        attribute(&mut body, 1, b"fastpath\0");
        attribute(&mut body, 2, format!("{chain}\0").as_bytes());
        let request = request(GETRULE, &body);
        Ok(NftChain { socket, request })
    }

    /// Whether the chain DNATs to `ip`:`port`: a rule holds them as data (a DNAT of its
    /// own), or the chain's DNAT goes through an endpoint map that holds them.
    pub fn holds(&self, ip: Ipv4Addr, port: u16) -> bool {
        // NFTA_DATA_VALUE attributes: the address and the port.
        let mut want_ip = vec![8, 0, 1, 0];
        want_ip.extend_from_slice(&ip.octets());
        let mut want_port = vec![6, 0, 1, 0];
        want_port.extend_from_slice(&port.to_be_bytes());
        let (mut ip_seen, mut port_seen) = (false, false);
        let mut map: Option<Vec<u8>> = None;
        let done = self.dump(&self.request, |msg| {
            ip_seen |= msg.windows(8).any(|w| w == want_ip.as_slice());
            port_seen |= msg.windows(8).any(|w| w[..6] == want_port[..]);
            if let Some(at) = msg.windows(10).position(|w| w == b"endpoints-") {
                // The set's name attribute, up to its NUL: `endpoints-tcp-0a`.
                let name = msg[at..].split(|&b| b == 0).next().unwrap_or_default();
                map = Some(name.to_vec());
            }
        });
        if !done {
            return false;
        }
        if ip_seen && port_seen {
            return true;
        }
        let Some(map) = map else { return false };
        // The map's elements: one of them maps to the address and port (a register's
        // layout: the port padded to 4 bytes). Each change's address is new, so it is
        // this service's.
        let mut want = ip.octets().to_vec();
        want.extend_from_slice(&port.to_be_bytes());
        want.extend_from_slice(&[0, 0]);
        let mut body = vec![libc::AF_INET as u8, 0, 0, 0];
        attribute(&mut body, 1, b"fastpath\0");
        let mut name = map;
        name.push(0);
        attribute(&mut body, 2, &name);
        let request = request(GETSETELEM, &body);
        let mut seen = false;
        self.dump(&request, |msg| {
            seen |= msg.windows(want.len()).any(|w| w == want.as_slice());
        }) && seen
    }

    /// Sends a dump request and hands each answer message to `each`; false if the dump
    /// failed or did not end.
    fn dump(&self, request: &[u8], mut each: impl FnMut(&[u8])) -> bool {
        use std::os::fd::AsRawFd as _;
        let fd = self.socket.as_raw_fd();
        // SAFETY: the buffer outlives the call and its length is passed with it.
        let sent = unsafe { libc::send(fd, request.as_ptr().cast(), request.len(), 0) };
        if sent < 0 {
            return false;
        }
        let mut buf = vec![0u8; 64 * 1024];
        for _ in 0..1000 {
            // SAFETY: as above.
            let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
            let Ok(n) = usize::try_from(n) else {
                return false;
            };
            let mut at = 0;
            while at + 16 <= n {
                let len = u32::from_ne_bytes(buf[at..at + 4].try_into().unwrap_or_default());
                let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
                let len = len as usize;
                if len < 16 || at + len > n {
                    return false;
                }
                if kind == NLMSG_DONE {
                    return true;
                }
                if kind == NLMSG_ERROR {
                    return false;
                }
                each(&buf[at..at + len]);
                at += (len + 3) & !3;
            }
        }
        false
    }
}
