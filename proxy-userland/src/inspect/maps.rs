//! Reading what the eBPF dataplane has programmed from its pinned maps (`--bpf-pin-dir`),
//! read-only, with the map types `proxy-common` shares with the programs. Everything in the
//! maps is in network byte order.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
};

use aya::maps::{HashMap, Map, MapData};
use proxy_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, Backend4, Backend6, BackendId, Ct4Key, Ct4Value,
    Ct6Key, Ct6Value, CtKey, CtValue, Service4Key, Service6Key, ServiceValue,
    backend::flags as backend_flags, maps as names, nat, service::scope,
};

use crate::{
    dataplane::{
        bpf::{
            loader::PinLayout,
            maps::{MapAddr, forward_entries, socket_addr},
        },
        frontends::{BackendAddr, Frontend, FrontendScope},
    },
    model::Protocol,
};

/// One frontend as the service map holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProgrammedFrontend {
    pub rev_nat_index: u16,
    pub affinity_timeout: u32,
    /// The backends in slots 1..=count; a slot whose backend is missing is left out.
    pub backends: Vec<BackendAddr>,
}

/// One packet-path flow (its forward entry).
#[derive(Clone, Debug, PartialEq)]
pub struct Flow {
    pub proto: Option<Protocol>,
    pub client: SocketAddr,
    pub frontend: SocketAddr,
    pub backend: SocketAddr,
    pub snat: Option<SocketAddr>,
    pub seen_reply: bool,
    pub closing: bool,
    /// Seconds since the flow's last packet (CLOCK_MONOTONIC, as bpf_ktime_get_ns).
    pub idle_secs: f64,
}

/// One ClientIP affinity entry.
#[derive(Clone, Debug, PartialEq)]
pub struct Affinity {
    /// The client's address (packet path, IPv4), or None for a socket-path entry, whose
    /// client is a network namespace (by cookie), and for an IPv6 client, whose address the
    /// key holds folded (both None then).
    pub client_ip: Option<IpAddr>,
    pub netns_cookie: Option<u64>,
    pub rev_nat_index: u16,
    pub backend: Option<BackendAddr>,
    pub idle_secs: f64,
}

/// The pinned maps of one daemon.
pub struct PinnedMaps {
    dir: PathBuf,
}

fn open<K: aya::Pod, V: aya::Pod>(
    dir: &Path,
    name: &str,
) -> anyhow::Result<HashMap<MapData, K, V>> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path)
        .map_err(|e| anyhow::anyhow!("cannot open the pinned map {}: {e}", path.display()))?;
    let map = Map::from_map_data(data)?;
    Ok(HashMap::try_from(map)?)
}

fn idle(last_ns: u64) -> f64 {
    crate::dataplane::bpf::flow_gc::monotonic_ns().saturating_sub(last_ns) as f64 / 1e9
}

fn v4(a: u32) -> Ipv4Addr {
    Ipv4Addr::from(a.to_ne_bytes())
}

fn proto(n: u8) -> Option<Protocol> {
    Protocol::from_number(n)
}

impl PinnedMaps {
    /// The maps under `pin_dir` (the daemon's `--bpf-pin-dir`), if a daemon pinned any.
    pub fn open(pin_dir: &Path) -> anyhow::Result<Self> {
        let dir = PinLayout::new(pin_dir).maps;
        if !dir.join(names::SERVICES4).exists() {
            anyhow::bail!(
                "no pinned fastpath maps under {} (is the daemon running in eBPF mode with \
                 --bpf-pin-dir {}?)",
                dir.display(),
                pin_dir.display()
            );
        }
        Ok(Self { dir })
    }

    fn backends(&self) -> anyhow::Result<BTreeMap<BackendId, BackendAddr>> {
        let mut out = BTreeMap::new();
        let b4: HashMap<_, BackendId, Backend4> = open(&self.dir, names::BACKENDS4)?;
        for (id, b) in b4.iter().filter_map(Result::ok) {
            if let Some(p) = proto(b.proto) {
                let local = b.flags & backend_flags::LOCAL != 0;
                let ip = IpAddr::V4(v4(b.address));
                out.insert(
                    id,
                    BackendAddr {
                        ip,
                        port: u16::from_be(b.port),
                        proto: p,
                        local,
                    },
                );
            }
        }
        let b6: HashMap<_, BackendId, Backend6> = open(&self.dir, names::BACKENDS6)?;
        for (id, b) in b6.iter().filter_map(Result::ok) {
            if let Some(p) = proto(b.proto) {
                let local = b.flags & backend_flags::LOCAL != 0;
                let ip = IpAddr::V6(Ipv6Addr::from(b.address));
                out.insert(
                    id,
                    BackendAddr {
                        ip,
                        port: u16::from_be(b.port),
                        proto: p,
                        local,
                    },
                );
            }
        }
        Ok(out)
    }

    /// Every frontend with its backends, both families and scopes.
    pub fn frontends(&self) -> anyhow::Result<BTreeMap<Frontend, ProgrammedFrontend>> {
        let backends = self.backends()?;
        // (frontend) -> slot -> value
        let mut slots: BTreeMap<Frontend, BTreeMap<u16, ServiceValue>> = BTreeMap::new();
        let scope_of = |s: u8| match s {
            scope::SOCKET => Some(FrontendScope::Socket),
            scope::PACKET => Some(FrontendScope::Packet),
            _ => None,
        };
        let s4: HashMap<_, Service4Key, ServiceValue> = open(&self.dir, names::SERVICES4)?;
        for (k, v) in s4.iter().filter_map(Result::ok) {
            let (Some(p), Some(sc)) = (proto(k.proto), scope_of(k.scope)) else {
                continue;
            };
            let fe = Frontend {
                ip: IpAddr::V4(v4(k.address)),
                port: u16::from_be(k.dport),
                proto: p,
                scope: sc,
            };
            slots.entry(fe).or_default().insert(k.backend_slot, v);
        }
        let s6: HashMap<_, Service6Key, ServiceValue> = open(&self.dir, names::SERVICES6)?;
        for (k, v) in s6.iter().filter_map(Result::ok) {
            let (Some(p), Some(sc)) = (proto(k.proto), scope_of(k.scope)) else {
                continue;
            };
            let ip = IpAddr::V6(Ipv6Addr::from(k.address));
            let fe = Frontend {
                ip,
                port: u16::from_be(k.dport),
                proto: p,
                scope: sc,
            };
            slots.entry(fe).or_default().insert(k.backend_slot, v);
        }
        let mut out = BTreeMap::new();
        for (fe, entries) in slots {
            // Without a master entry the programs do not see the frontend at all.
            let Some(master) = entries.get(&0) else {
                continue;
            };
            let backends = (1..=master.count)
                .filter_map(|slot| backends.get(&entries.get(&slot)?.backend_id).copied())
                .collect();
            out.insert(
                fe,
                ProgrammedFrontend {
                    rev_nat_index: master.rev_nat_index,
                    affinity_timeout: master.affinity_timeout,
                    backends,
                },
            );
        }
        Ok(out)
    }

    /// The packet path's flows, forward entries only (one per flow). Maps pinned by a
    /// daemon without IPv6 flows have no IPv6 table, which is no error.
    pub fn flows(&self) -> anyhow::Result<Vec<Flow>> {
        let ct4: HashMap<_, Ct4Key, Ct4Value> = open(&self.dir, names::CT4)?;
        let mut flows = flows_of(&ct4);
        if let Ok(ct6) = open::<Ct6Key, Ct6Value>(&self.dir, names::CT6) {
            flows.extend(flows_of(&ct6));
        }
        flows.sort_by_key(|f| (f.frontend, f.client));
        Ok(flows)
    }

    /// The ClientIP affinity entries the programs honour, with their backends resolved.
    /// Entries naming a backend that left their frontend stay in the map until rewritten
    /// or evicted; the match map says which are live (maps pinned before it: all).
    pub fn affinity(&self) -> anyhow::Result<Vec<Affinity>> {
        let backends = self.backends()?;
        let map: HashMap<_, AffinityKey, AffinityValue> = open(&self.dir, names::AFFINITY)?;
        let matches = open::<AffinityMatchKey, u8>(&self.dir, names::AFFINITY_MATCH).ok();
        let live = |k: &AffinityKey, v: &AffinityValue| {
            matches.as_ref().is_none_or(|m| {
                m.get(&AffinityMatchKey::new(v.backend_id, k.rev_nat_index), 0)
                    .is_ok()
            })
        };
        let mut out: Vec<Affinity> = map
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, v)| live(k, v))
            .map(|(k, v)| {
                let by_ip = k.client & nat::AFFINITY_CLIENT_IP != 0;
                let v6 = k.client & nat::AFFINITY_CLIENT_IP6 != 0;
                Affinity {
                    client_ip: (by_ip && !v6).then(|| IpAddr::V4(v4(k.client as u32))),
                    netns_cookie: (!by_ip).then_some(k.client),
                    rev_nat_index: k.rev_nat_index,
                    backend: backends.get(&v.backend_id).copied(),
                    idle_secs: idle(v.last_used_ns),
                }
            })
            .collect();
        out.sort_by_key(|a| (a.rev_nat_index, a.client_ip, a.netns_cookie));
        Ok(out)
    }
}

fn flows_of<A: MapAddr>(ct: &HashMap<MapData, CtKey<A>, CtValue<A>>) -> Vec<Flow>
where
    CtKey<A>: aya::Pod,
    CtValue<A>: aya::Pod,
{
    forward_entries(ct)
        .map(|(k, v)| Flow {
            proto: proto(k.proto),
            client: socket_addr(k.saddr, k.sport),
            frontend: socket_addr(k.daddr, k.dport),
            backend: socket_addr(v.addr, v.port),
            snat: (v.snat_addr != A::default()).then(|| socket_addr(v.snat_addr, v.snat_port)),
            seen_reply: v.flags & nat::ct_flags::SEEN_REPLY != 0,
            closing: v.flags & nat::ct_flags::CLOSING != 0,
            idle_secs: idle(v.last_seen_ns),
        })
        .collect()
}
