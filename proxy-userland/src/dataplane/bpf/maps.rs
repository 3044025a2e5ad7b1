//! Typed handles on the maps, and the byte-order conversions between the model and them.
//!
//! Everything the maps hold is in network byte order (see `proxy-common`), so conversions
//! live here and nowhere else.

use std::net::{IpAddr, SocketAddr};

use aya::{
    Ebpf,
    maps::{HashMap, MapData, MapError},
};
use proxy_common::{
    AffinityKey, AffinityValue, Backend4, Backend6, BackendId, Service4Key, Service6Key, ServiceValue, SockRevNat4Key,
    SockRevNat4Value, SockRevNat6Key, SockRevNat6Value, maps as names,
};

use crate::model::Protocol;

use super::{
    loader::LoadError,
    program::{BackendAddr, Frontend},
};

pub struct ServiceMaps {
    services4: HashMap<MapData, Service4Key, ServiceValue>,
    backends4: HashMap<MapData, BackendId, Backend4>,
    services6: HashMap<MapData, Service6Key, ServiceValue>,
    backends6: HashMap<MapData, BackendId, Backend6>,
    // Written by the programs only; the daemon reads them for occupancy and tests.
    sock_revnat4: HashMap<MapData, SockRevNat4Key, SockRevNat4Value>,
    sock_revnat6: HashMap<MapData, SockRevNat6Key, SockRevNat6Value>,
    // Written by the programs; the daemon deletes entries that point at removed backends.
    affinity: HashMap<MapData, AffinityKey, AffinityValue>,
}

fn take<K: aya::Pod, V: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &'static str,
) -> Result<HashMap<MapData, K, V>, LoadError> {
    let map = ebpf.take_map(name).ok_or(LoadError::MissingMap { name })?;
    HashMap::try_from(map).map_err(|source| LoadError::Map { name, source })
}

fn v4(ip: std::net::Ipv4Addr) -> u32 {
    u32::from_ne_bytes(ip.octets())
}

impl ServiceMaps {
    pub fn take(ebpf: &mut Ebpf) -> Result<Self, LoadError> {
        Ok(Self {
            services4: take(ebpf, names::SERVICES4)?,
            backends4: take(ebpf, names::BACKENDS4)?,
            services6: take(ebpf, names::SERVICES6)?,
            backends6: take(ebpf, names::BACKENDS6)?,
            sock_revnat4: take(ebpf, names::SOCK_REVNAT4)?,
            sock_revnat6: take(ebpf, names::SOCK_REVNAT6)?,
            affinity: take(ebpf, names::AFFINITY)?,
        })
    }

    pub fn put_backend(&mut self, id: BackendId, b: &BackendAddr) -> Result<(), MapError> {
        let (port, proto) = (b.port.to_be(), b.proto.number());
        match b.ip {
            IpAddr::V4(ip) => self.backends4.insert(
                id,
                Backend4 { address: v4(ip), port, proto, flags: 0 },
                0,
            ),
            IpAddr::V6(ip) => self.backends6.insert(
                id,
                Backend6 { address: ip.octets(), port, proto, flags: 0 },
                0,
            ),
        }
    }

    pub fn del_backend(&mut self, id: BackendId, b: &BackendAddr) -> Result<(), MapError> {
        ignore_missing(match b.ip {
            IpAddr::V4(_) => self.backends4.remove(&id),
            IpAddr::V6(_) => self.backends6.remove(&id),
        })
    }

    pub fn put_service(
        &mut self,
        fe: &Frontend,
        slot: u16,
        value: ServiceValue,
    ) -> Result<(), MapError> {
        let (port, proto) = (fe.port.to_be(), fe.proto.number());
        match fe.ip {
            IpAddr::V4(ip) => {
                self.services4.insert(Service4Key::new(v4(ip), port, proto, slot), value, 0)
            }
            IpAddr::V6(ip) => {
                self.services6.insert(Service6Key::new(ip.octets(), port, proto, slot), value, 0)
            }
        }
    }

    pub fn del_service(&mut self, fe: &Frontend, slot: u16) -> Result<(), MapError> {
        let (port, proto) = (fe.port.to_be(), fe.proto.number());
        ignore_missing(match fe.ip {
            IpAddr::V4(ip) => self.services4.remove(&Service4Key::new(v4(ip), port, proto, slot)),
            IpAddr::V6(ip) => {
                self.services6.remove(&Service6Key::new(ip.octets(), port, proto, slot))
            }
        })
    }

    /// The entry the programs would read, for tests and diagnostics.
    pub fn get_service(&self, fe: &Frontend, slot: u16) -> Option<ServiceValue> {
        let (port, proto) = (fe.port.to_be(), fe.proto.number());
        match fe.ip {
            IpAddr::V4(ip) => {
                self.services4.get(&Service4Key::new(v4(ip), port, proto, slot), 0).ok()
            }
            IpAddr::V6(ip) => {
                self.services6.get(&Service6Key::new(ip.octets(), port, proto, slot), 0).ok()
            }
        }
    }

    /// Every service map entry: (frontend, slot, value), both families; for adopting what a
    /// previous daemon programmed into pinned maps.
    pub fn service_entries(&self) -> Vec<(Frontend, u16, ServiceValue)> {
        let v4 = self.services4.iter().filter_map(Result::ok).filter_map(|(k, v)| {
            let fe = Frontend {
                ip: IpAddr::V4(std::net::Ipv4Addr::from(k.address.to_ne_bytes())),
                port: u16::from_be(k.dport),
                proto: Protocol::from_number(k.proto)?,
            };
            Some((fe, k.backend_slot, v))
        });
        let v6 = self.services6.iter().filter_map(Result::ok).filter_map(|(k, v)| {
            let fe = Frontend {
                ip: IpAddr::V6(std::net::Ipv6Addr::from(k.address)),
                port: u16::from_be(k.dport),
                proto: Protocol::from_number(k.proto)?,
            };
            Some((fe, k.backend_slot, v))
        });
        v4.chain(v6).collect()
    }

    /// Every backend: (id, where it points).
    pub fn backend_entries(&self) -> Vec<(BackendId, BackendAddr)> {
        let v4 = self.backends4.iter().filter_map(Result::ok).filter_map(|(id, b)| {
            let ip = IpAddr::V4(std::net::Ipv4Addr::from(b.address.to_ne_bytes()));
            Some((id, BackendAddr { ip, port: u16::from_be(b.port), proto: Protocol::from_number(b.proto)? }))
        });
        let v6 = self.backends6.iter().filter_map(Result::ok).filter_map(|(id, b)| {
            let ip = IpAddr::V6(std::net::Ipv6Addr::from(b.address));
            Some((id, BackendAddr { ip, port: u16::from_be(b.port), proto: Protocol::from_number(b.proto)? }))
        });
        v4.chain(v6).collect()
    }

    /// The frontend a socket (by cookie) was translated from when our programs pointed it
    /// at `backend`; None if they did not.
    pub fn translated_from(&self, cookie: u64, backend: SocketAddr) -> Option<SocketAddr> {
        let port = backend.port().to_be();
        match backend.ip() {
            IpAddr::V4(ip) => {
                let key = SockRevNat4Key { cookie, address: v4(ip), port, _pad: [0; 2] };
                let v = self.sock_revnat4.get(&key, 0).ok()?;
                let fe = std::net::Ipv4Addr::from(v.address.to_ne_bytes());
                Some(SocketAddr::new(IpAddr::V4(fe), u16::from_be(v.port)))
            }
            IpAddr::V6(ip) => {
                let key = SockRevNat6Key { cookie, address: ip.octets(), port, _pad: [0; 6] };
                let v = self.sock_revnat6.get(&key, 0).ok()?;
                let fe = std::net::Ipv6Addr::from(v.address);
                Some(SocketAddr::new(IpAddr::V6(fe), u16::from_be(v.port)))
            }
        }
    }

    /// Forgets which backend clients had for frontend `rev_nat_index` where `stale` says
    /// so: a client must not stick to a backend that left the service, and a reused index
    /// must not inherit another frontend's clients. Returns how many entries went.
    pub fn purge_affinity(&mut self, rev_nat_index: u16, stale: impl Fn(BackendId) -> bool) -> usize {
        let doomed: Vec<AffinityKey> = self
            .affinity
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, v)| k.rev_nat_index == rev_nat_index && stale(v.backend_id))
            .map(|(k, _)| k)
            .collect();
        doomed.iter().filter(|k| self.affinity.remove(k).is_ok()).count()
    }

    /// Entries per map, for metrics and leak checks.
    pub fn occupancy(&self) -> Occupancy {
        Occupancy {
            services: self.services4.keys().count() + self.services6.keys().count(),
            backends: self.backends4.keys().count() + self.backends6.keys().count(),
            sock_revnat: self.sock_revnat4.keys().count() + self.sock_revnat6.keys().count(),
            affinity: self.affinity.keys().count(),
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Occupancy {
    pub services: usize,
    pub backends: usize,
    pub sock_revnat: usize,
    pub affinity: usize,
}

/// Deleting what is already gone is success: the goal is its absence.
fn ignore_missing(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}
