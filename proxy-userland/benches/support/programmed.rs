//! Whether the dataplane a daemon programs holds a given endpoint of a service, read from
//! outside the daemon as an operator would: the pinned BPF maps (eBPF mode), or the
//! service's chain in the daemon's network namespace (iptables mode).
#![allow(dead_code)]

use std::{net::Ipv4Addr, path::Path, process::Command};

use anyhow::{Context as _, Result};
use aya::maps::{HashMap, Map, MapData};
use proxy_common::{
    Backend4, BackendId, Service4Key, ServiceValue, SockRevNat4Key, SockRevNat4Value,
    SockRevNat6Key, SockRevNat6Value, maps as names,
};
use proxy_userland::{
    dataplane::iptables::names::{PortChains, endpoint_chain},
    model::Protocol,
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
