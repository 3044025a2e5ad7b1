//! The frontends' filter (`proxy_common::filter`), which the daemon keeps: every address
//! with a master entry in a service map, and every node address, has its slot set before
//! the entry is written and cleared only after the last such address goes.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    net::IpAddr,
};

use aya::{
    Ebpf,
    maps::{Array, MapData, MapError},
};
use proxy_common::{
    filter::{self, ENTRIES, ENTRY_SLOTS, Entry},
    maps as names,
    nat::addr6,
};

use super::{LoadError, v4};
use crate::dataplane::frontends::Frontend;

/// A filter slot: the array element and the byte within it.
type Slot = (u32, usize);

fn addr_slot(ip: IpAddr) -> Slot {
    match ip {
        IpAddr::V4(a) => filter::addr_slot(&[v4(a)]),
        IpAddr::V6(a) => filter::addr_slot(&addr6(a.octets())),
    }
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
    /// The elements as the map holds them (or will once `dirty` is written), each read
    /// when first needed: a new map is all zeros, a pinned one as an earlier daemon left it.
    written: Vec<Option<Entry>>,
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
        Ok(Self {
            map,
            masters: HashSet::new(),
            nodes: HashSet::new(),
            refs: HashMap::new(),
            slots: HashMap::new(),
            written: vec![None; ENTRIES as usize],
            dirty: None,
        })
    }

    /// Element `index` as the map holds it.
    fn element(&mut self, index: u32) -> Entry {
        let map = &self.map;
        // Unreadable, it reads as all set: a write then keeps every slot an earlier daemon
        // may have set, and a slot left set only costs lookups.
        *self.written[index as usize]
            .get_or_insert_with(|| map.get(&index, 0).unwrap_or([1; ENTRY_SLOTS]))
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
            let entry = self.element(index);
            self.map.set(index, entry, 0)?;
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
        // Every slot to set first, then the stale ones cleared: a live address's slot is
        // never clear, whatever element a packet reads in between.
        for (index, entry) in (0..ENTRIES).zip(&want) {
            let old = self.element(index);
            let merged: Entry = std::array::from_fn(|b| entry[b] | old[b]);
            if merged != old {
                self.write(index, merged)?;
            }
        }
        for (index, entry) in (0..ENTRIES).zip(&want) {
            if *entry != self.element(index) {
                self.write(index, *entry)?;
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
        let mut entry = self.element(index);
        if entry[byte] == 0 {
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
        let mut entry = self.element(index);
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
        self.written[index as usize] = Some(entry);
        Ok(())
    }
}
