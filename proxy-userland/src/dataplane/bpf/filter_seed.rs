//! Filling the packet path's filters (`proxy_common::filter`) when they are made afresh
//! beside maps that a daemon without them left pinned: every frontend's address or node
//! port, every reply entry. The loader does it before attaching any program of ours, so none
//! writes the replies' filter meanwhile.

use std::collections::HashMap;

use aya::{
    Ebpf,
    maps::{Array, MapError},
};
use proxy_common::{
    Ct4Key, Ct4Value, Ct6Key, Ct6Value, Service4Key, Service6Key, ServiceValue,
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
    let mut port_slots = Vec::new();
    let mut reply_slots = Vec::new();
    if front {
        // Node ports are stored under address 0.
        let mut frontend = |words: &[u32], port: u16, proto: u8| {
            if words.iter().all(|w| *w == 0) {
                let (index, byte) = filter::port_slot(u16::from_be(port));
                port_slots.push(((index, byte), filter::proto_bit(proto)));
            } else {
                front_slots.push((filter::addr_slot(words), 1));
            }
        };
        for k in keys::<Service4Key, ServiceValue>(ebpf, names::SERVICES4)? {
            frontend(&[k.address], k.dport, k.proto);
        }
        for k in keys::<Service6Key, ServiceValue>(ebpf, names::SERVICES6)? {
            frontend(&addr6(k.address), k.dport, k.proto);
        }
    }
    if reply {
        let replies4 = keys::<Ct4Key, Ct4Value>(ebpf, names::CT4)?;
        reply_slots.extend(
            replies4
                .filter(|k| k.dir == nat::dir::REPLY)
                .map(|k| (filter::reply_slot(&[k.saddr], k.sport, k.proto), 1)),
        );
        let replies6 = keys::<Ct6Key, Ct6Value>(ebpf, names::CT6)?;
        reply_slots.extend(
            replies6
                .filter(|k| k.dir == nat::dir::REPLY)
                .map(|k| (filter::reply_slot(&k.saddr, k.sport, k.proto), 1)),
        );
    }
    set_slots(ebpf, names::FRONT_FILTER, &front_slots)?;
    set_slots(ebpf, names::NODE_PORTS, &port_slots)?;
    set_slots(ebpf, names::REPLY_FILTER, &reply_slots)?;
    Ok((front_slots.len() + port_slots.len(), reply_slots.len()))
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

/// Sets `bits` in each slot's byte of filter `name`.
fn set_slots(
    ebpf: &mut Ebpf,
    name: &'static str,
    slots: &[((u32, usize), u8)],
) -> Result<(), SeedError> {
    if slots.is_empty() {
        return Ok(());
    }
    let map = ebpf.map_mut(name).ok_or((name, None))?;
    let mut map = Array::<_, Entry>::try_from(map).map_err(|e| (name, Some(e)))?;
    let mut entries: HashMap<u32, Entry> = HashMap::new();
    for ((index, byte), bits) in slots {
        entries.entry(*index).or_insert([0; ENTRY_SLOTS])[*byte] |= bits;
    }
    for (index, entry) in entries {
        map.set(index, entry, 0).map_err(|e| (name, Some(e)))?;
    }
    Ok(())
}
