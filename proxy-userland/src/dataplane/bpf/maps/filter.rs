//! The frontends' filter (`proxy_common::filter`), which the daemon keeps: every address
//! with a master entry in a service map, and every node address, has its slot set before
//! the entry is written and cleared only after the last such address goes. Also the
//! seeding of both filters from maps that a daemon without them left pinned.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    net::IpAddr,
};

use aya::{
    Ebpf,
    maps::{Array, MapData, MapError},
};
use proxy_common::{
    Addr6, Ct4Key, Ct4Value, Ct6Key, Ct6Value, Service4Key, Service6Key, ServiceValue,
    filter::{self, ENTRIES, ENTRY_SLOTS, Entry},
    maps as names,
    nat::{self, addr6},
};

use super::{LoadError, v4};
use crate::dataplane::frontends::Frontend;

/// A filter slot: the array element and the byte within it.
type Slot = (u32, usize);

fn words_hash(words: &[u32]) -> u32 {
    words.iter().fold(0, |h, w| filter::mix(h, *w))
}

fn addr_hash(ip: IpAddr) -> u32 {
    match ip {
        IpAddr::V4(a) => words_hash(&[v4(a)]),
        IpAddr::V6(a) => words_hash(&addr6(a.octets())),
    }
}

fn addr_slot(ip: IpAddr) -> Slot {
    filter::slot(addr_hash(ip))
}

fn reply_slot(addr_words: &[u32], port: u16, proto: u8) -> Slot {
    filter::slot(filter::mix(
        words_hash(addr_words),
        filter::port_word(port, proto),
    ))
}

/// What the frontends' filter holds, and why.
pub struct FrontFilter {
    map: Array<MapData, Entry>,
    /// Frontends with a master entry (slot 0) written or queued.
    masters: HashSet<Frontend>,
    /// The node addresses, as last set.
    nodes: HashSet<IpAddr>,
    /// Per live address: its masters, plus one if it is a node address.
    refs: HashMap<IpAddr, u32>,
    /// Per slot: the live addresses that land there.
    slots: HashMap<Slot, u32>,
    /// The elements as the map holds them, or will once `dirty` is written.
    written: Vec<Entry>,
    /// While a first sync's writes trail behind it (see `deferred`): elements changed and
    /// not written yet. At once, a first sync would make a bpf() call per new address;
    /// collected, at most one per element, after the sync.
    dirty: Option<BTreeSet<u32>>,
}

impl FrontFilter {
    pub fn take(ebpf: &mut Ebpf) -> Result<Self, LoadError> {
        let name = names::FRONT_FILTER;
        let map = ebpf.take_map(name).ok_or(LoadError::MissingMap { name })?;
        let map: Array<MapData, Entry> =
            Array::try_from(map).map_err(|source| LoadError::Map { name, source })?;
        // A pinned filter keeps what an earlier daemon set until `adopt` rewrites it.
        let written = (0..ENTRIES)
            .map(|i| map.get(&i, 0).unwrap_or([0; ENTRY_SLOTS]))
            .collect();
        Ok(Self {
            map,
            masters: HashSet::new(),
            nodes: HashSet::new(),
            refs: HashMap::new(),
            slots: HashMap::new(),
            written,
            dirty: None,
        })
    }

    /// Collects changes instead of writing them, until [`Self::flush`]. For a first sync
    /// into empty maps only: until then a frontend's master entry may be visible before its
    /// slot, and its packets go untranslated as they did before the entry.
    pub fn defer(&mut self) {
        self.dirty.get_or_insert_with(BTreeSet::new);
    }

    /// Writes what [`Self::defer`] collected, and writes at once again.
    pub fn flush(&mut self) -> Result<(), MapError> {
        let Some(dirty) = self.dirty.take() else {
            return Ok(());
        };
        for index in dirty {
            self.map.set(index, self.written[index as usize], 0)?;
        }
        Ok(())
    }

    /// Before `fe`'s master entry is written: its address's slot is set. Err if the filter
    /// cannot be written, in which case the entry must not be either: the packet path
    /// would not see it.
    pub fn master_put(&mut self, fe: &Frontend) -> Result<(), MapError> {
        if self.masters.contains(fe) {
            return Ok(());
        }
        self.hold(fe.ip)?;
        self.masters.insert(*fe);
        Ok(())
    }

    /// After `fe`'s master entry is deleted.
    pub fn master_gone(&mut self, fe: &Frontend) {
        if self.masters.remove(fe) {
            self.release(fe.ip);
        }
    }

    /// Before the node addresses become `addrs`: the new ones' slots are set. Returns the
    /// addresses that are leaving, for [`Self::nodes_gone`] once the node maps no longer
    /// hold them.
    pub fn nodes_put(&mut self, addrs: &[IpAddr]) -> Result<Vec<IpAddr>, MapError> {
        let want: HashSet<IpAddr> = addrs.iter().copied().collect();
        for a in &want {
            if !self.nodes.contains(a) {
                self.hold(*a)?;
                self.nodes.insert(*a);
            }
        }
        Ok(self.nodes.difference(&want).copied().collect())
    }

    pub fn nodes_gone(&mut self, gone: &[IpAddr]) {
        for a in gone {
            if self.nodes.remove(a) {
                self.release(*a);
            }
        }
    }

    /// After a restart on pinned maps: `masters` and `nodes` are what the maps hold now
    /// (besides what this daemon wrote), and the filter is rewritten to exactly that,
    /// dropping the slots of addresses that went while no daemon kept it.
    pub fn adopt(
        &mut self,
        masters: impl IntoIterator<Item = Frontend>,
        nodes: impl IntoIterator<Item = IpAddr>,
    ) -> Result<(), MapError> {
        for fe in masters {
            if self.masters.insert(fe) {
                *self.refs.entry(fe.ip).or_default() += 1;
            }
        }
        for a in nodes {
            if self.nodes.insert(a) {
                *self.refs.entry(a).or_default() += 1;
            }
        }
        self.slots.clear();
        for a in self.refs.keys() {
            *self.slots.entry(addr_slot(*a)).or_default() += 1;
        }
        let mut want = vec![[0u8; ENTRY_SLOTS]; ENTRIES as usize];
        for (index, byte) in self.slots.keys() {
            want[*index as usize][*byte] = 1;
        }
        // Slots to set first, then the rest: a live address's slot is never clear.
        for setting in [true, false] {
            for (i, entry) in want.iter().enumerate() {
                let old = &self.written[i];
                let sets = entry.iter().zip(old).any(|(n, o)| *n != 0 && *o == 0);
                if entry != old && sets == setting {
                    let merged: Entry = if setting {
                        std::array::from_fn(|b| entry[b] | old[b])
                    } else {
                        *entry
                    };
                    self.write(i as u32, merged)?;
                }
            }
        }
        Ok(())
    }

    fn hold(&mut self, ip: IpAddr) -> Result<(), MapError> {
        if let Some(n) = self.refs.get_mut(&ip) {
            *n += 1;
            return Ok(());
        }
        let (index, byte) = addr_slot(ip);
        if self.written[index as usize][byte] == 0 {
            let mut entry = self.written[index as usize];
            entry[byte] = 1;
            self.write(index, entry)?;
        }
        self.refs.insert(ip, 1);
        *self.slots.entry((index, byte)).or_default() += 1;
        Ok(())
    }

    fn release(&mut self, ip: IpAddr) {
        let Some(n) = self.refs.get_mut(&ip) else {
            return;
        };
        *n -= 1;
        if *n > 0 {
            return;
        }
        self.refs.remove(&ip);
        let slot = addr_slot(ip);
        let Some(others) = self.slots.get_mut(&slot) else {
            return;
        };
        *others -= 1;
        if *others > 0 {
            return;
        }
        self.slots.remove(&slot);
        let (index, byte) = slot;
        let mut entry = self.written[index as usize];
        entry[byte] = 0;
        // A slot left set only costs lookups: nothing to undo if the write fails.
        if let Err(e) = self.write(index, entry) {
            tracing::debug!(error = %e, "cannot clear a frontend filter slot");
        }
    }

    fn write(&mut self, index: u32, entry: Entry) -> Result<(), MapError> {
        match &mut self.dirty {
            Some(dirty) => drop(dirty.insert(index)),
            None => self.map.set(index, entry, 0)?,
        }
        self.written[index as usize] = entry;
        Ok(())
    }

    /// Whether `ip`'s slot is set, for tests.
    pub fn is_set(&self, ip: IpAddr) -> bool {
        let (index, byte) = addr_slot(ip);
        self.written[index as usize][byte] != 0
    }
}

/// Fills the filters of a freshly made pin from the maps they guard, which a daemon
/// without them left pinned: every frontend and node address, every reply entry. Called
/// before any program of ours is attached, so none writes the reply filter meanwhile.
pub fn seed(ebpf: &mut Ebpf, front: bool, reply: bool) -> Result<(), LoadError> {
    let mut front_slots = Vec::new();
    let mut reply_slots = Vec::new();
    if front {
        front_slots.extend(
            keys::<Service4Key, ServiceValue>(ebpf, names::SERVICES4)?
                .map(|k| filter::slot(words_hash(&[k.address]))),
        );
        front_slots.extend(
            keys::<Service6Key, ServiceValue>(ebpf, names::SERVICES6)?
                .map(|k| filter::slot(words_hash(&addr6(k.address)))),
        );
        front_slots.extend(
            keys::<u32, u32>(ebpf, names::NODE_ADDRS4)?.map(|a| filter::slot(words_hash(&[a]))),
        );
        front_slots.extend(
            keys::<Addr6, u32>(ebpf, names::NODE_ADDRS6)?.map(|a| filter::slot(words_hash(&a))),
        );
    }
    if reply {
        reply_slots.extend(
            keys::<Ct4Key, Ct4Value>(ebpf, names::CT4)?
                .filter(|k| k.dir == nat::dir::REPLY)
                .map(|k| reply_slot(&[k.saddr], k.sport, k.proto)),
        );
        reply_slots.extend(
            keys::<Ct6Key, Ct6Value>(ebpf, names::CT6)?
                .filter(|k| k.dir == nat::dir::REPLY)
                .map(|k| reply_slot(&k.saddr, k.sport, k.proto)),
        );
    }
    set_slots(ebpf, names::FRONT_FILTER, &front_slots)?;
    set_slots(ebpf, names::REPLY_FILTER, &reply_slots)?;
    if front || reply {
        tracing::info!(
            frontend_entries = front_slots.len(),
            reply_entries = reply_slots.len(),
            "filled new packet-path filters from the pinned maps"
        );
    }
    Ok(())
}

fn keys<K: aya::Pod, V: aya::Pod>(
    ebpf: &Ebpf,
    name: &'static str,
) -> Result<impl Iterator<Item = K>, LoadError> {
    let map = ebpf.map(name).ok_or(LoadError::MissingMap { name })?;
    let map = aya::maps::HashMap::<_, K, V>::try_from(map)
        .map_err(|source| LoadError::Map { name, source })?;
    Ok(map
        .keys()
        .filter_map(Result::ok)
        .collect::<Vec<_>>()
        .into_iter())
}

fn set_slots(ebpf: &mut Ebpf, name: &'static str, slots: &[Slot]) -> Result<(), LoadError> {
    if slots.is_empty() {
        return Ok(());
    }
    let map = ebpf.map_mut(name).ok_or(LoadError::MissingMap { name })?;
    let mut map =
        Array::<_, Entry>::try_from(map).map_err(|source| LoadError::Map { name, source })?;
    let mut entries: HashMap<u32, Entry> = HashMap::new();
    for (index, byte) in slots {
        entries.entry(*index).or_insert([0; ENTRY_SLOTS])[*byte] = 1;
    }
    for (index, entry) in entries {
        map.set(index, entry, 0)
            .map_err(|source| LoadError::Map { name, source })?;
    }
    Ok(())
}
