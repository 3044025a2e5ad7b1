//! Filling the packet path's filters (`proxy_common::filter`) when they are made afresh
//! beside maps that a daemon without them left pinned: every frontend and node address,
//! every reply entry. The loader does it before attaching any program of ours, so none
//! writes the replies' filter meanwhile.

use std::collections::HashMap;

use aya::{
    Ebpf,
    maps::{Array, MapError},
};
use proxy_common::{
    Addr6, Ct4Key, Ct4Value, Ct6Key, Ct6Value, Service4Key, Service6Key, ServiceValue,
    filter::{self, ENTRY_SLOTS, Entry},
    maps as names,
    nat::{self, addr6},
};

/// What went wrong, and with which map.
pub type SeedError = (&'static str, Option<MapError>);

/// Fills the frontends' filter (`front`) and the replies' (`reply`) from the maps they
/// guard; returns how many entries each took.
pub fn seed(ebpf: &mut Ebpf, front: bool, reply: bool) -> Result<(usize, usize), SeedError> {
    let mut front_slots = Vec::new();
    let mut reply_slots = Vec::new();
    if front {
        let services4 = keys::<Service4Key, ServiceValue>(ebpf, names::SERVICES4)?;
        front_slots.extend(services4.map(|k| filter::addr_slot(&[k.address])));
        let services6 = keys::<Service6Key, ServiceValue>(ebpf, names::SERVICES6)?;
        front_slots.extend(services6.map(|k| filter::addr_slot(&addr6(k.address))));
        let nodes4 = keys::<u32, u32>(ebpf, names::NODE_ADDRS4)?;
        front_slots.extend(nodes4.map(|a| filter::addr_slot(&[a])));
        let nodes6 = keys::<Addr6, u32>(ebpf, names::NODE_ADDRS6)?;
        front_slots.extend(nodes6.map(|a| filter::addr_slot(&a)));
    }
    if reply {
        let replies4 = keys::<Ct4Key, Ct4Value>(ebpf, names::CT4)?;
        reply_slots.extend(
            replies4
                .filter(|k| k.dir == nat::dir::REPLY)
                .map(|k| filter::reply_slot(&[k.saddr], k.sport, k.proto)),
        );
        let replies6 = keys::<Ct6Key, Ct6Value>(ebpf, names::CT6)?;
        reply_slots.extend(
            replies6
                .filter(|k| k.dir == nat::dir::REPLY)
                .map(|k| filter::reply_slot(&k.saddr, k.sport, k.proto)),
        );
    }
    set_slots(ebpf, names::FRONT_FILTER, &front_slots)?;
    set_slots(ebpf, names::REPLY_FILTER, &reply_slots)?;
    Ok((front_slots.len(), reply_slots.len()))
}

fn keys<K: aya::Pod, V: aya::Pod>(
    ebpf: &Ebpf,
    name: &'static str,
) -> Result<impl Iterator<Item = K>, SeedError> {
    let map = ebpf.map(name).ok_or((name, None))?;
    let map = aya::maps::HashMap::<_, K, V>::try_from(map).map_err(|e| (name, Some(e)))?;
    Ok(map
        .keys()
        .filter_map(Result::ok)
        .collect::<Vec<_>>()
        .into_iter())
}

fn set_slots(ebpf: &mut Ebpf, name: &'static str, slots: &[(u32, usize)]) -> Result<(), SeedError> {
    if slots.is_empty() {
        return Ok(());
    }
    let map = ebpf.map_mut(name).ok_or((name, None))?;
    let mut map = Array::<_, Entry>::try_from(map).map_err(|e| (name, Some(e)))?;
    let mut entries: HashMap<u32, Entry> = HashMap::new();
    for (index, byte) in slots {
        entries.entry(*index).or_insert([0; ENTRY_SLOTS])[*byte] = 1;
    }
    for (index, entry) in entries {
        map.set(index, entry, 0).map_err(|e| (name, Some(e)))?;
    }
    Ok(())
}
