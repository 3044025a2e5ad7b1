//! The filters the daemon keeps (`proxy_common::filter`): every address with a master entry
//! in a service map has its slot set in the frontends' filter, and every node port its
//! protocol's bit in the node ports' filter, before the entry is written; each is cleared
//! only after the last entry that needs it goes.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    net::IpAddr,
};

use aya::{
    Ebpf,
    maps::{Array, MapData, MapError},
};
use proxy_common::{
    filter::{self, ENTRIES, ENTRY_SLOTS, Entry, PORT_ENTRIES},
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

/// A node-port frontend's key in the node ports' filter: its port and protocol bit.
fn port_key(fe: &Frontend) -> (u16, u8) {
    (fe.port, filter::proto_bit(fe.proto.number()))
}

/// One filter map and its elements as written.
struct Bytes {
    map: Array<MapData, Entry>,
    /// The elements as the map holds them (or will once `dirty` is written), each read
    /// when first needed: a new map is all zeros, a pinned one as an earlier daemon left it.
    written: Vec<Option<Entry>>,
    /// While a first sync's writes trail behind it (see `deferred`): elements changed and
    /// not written yet. At once, a first sync would make a bpf() call per new address;
    /// collected, at most one per element, after the sync.
    dirty: Option<BTreeSet<u32>>,
}

impl Bytes {
    fn take(ebpf: &mut Ebpf, name: &'static str, elements: u32) -> Result<Self, LoadError> {
        let map = ebpf.take_map(name).ok_or(LoadError::MissingMap { name })?;
        let map = Array::try_from(map).map_err(|source| LoadError::Map { name, source })?;
        Ok(Self {
            map,
            written: vec![None; elements as usize],
            dirty: None,
        })
    }

    /// Element `index` as the map holds it.
    fn element(&mut self, index: u32) -> Entry {
        let map = &self.map;
        // Unreadable, it reads as all set: a write then keeps every slot an earlier daemon
        // may have set, and a slot left set only costs lookups.
        *self.written[index as usize]
            .get_or_insert_with(|| map.get(&index, 0).unwrap_or([0xff; ENTRY_SLOTS]))
    }

    /// Sets or clears `bits` of `slot`'s byte.
    fn update(&mut self, (index, byte): Slot, bits: u8, on: bool) -> Result<(), MapError> {
        let mut entry = self.element(index);
        let old = entry[byte];
        entry[byte] = if on { old | bits } else { old & !bits };
        if entry[byte] == old {
            return Ok(());
        }
        self.write(index, entry)
    }

    fn write(&mut self, index: u32, entry: Entry) -> Result<(), MapError> {
        match &mut self.dirty {
            Some(dirty) => drop(dirty.insert(index)),
            None => self.map.set(index, entry, 0)?,
        }
        self.written[index as usize] = Some(entry);
        Ok(())
    }

    /// Makes the map hold `want`: every bit to set first, then the stale ones cleared, so
    /// that a live entry's bit is never clear, whatever element a packet reads in between.
    fn rewrite(&mut self, want: &[Entry]) -> Result<(), MapError> {
        for (index, entry) in (0..).zip(want) {
            let old = self.element(index);
            let merged: Entry = std::array::from_fn(|b| entry[b] | old[b]);
            if merged != old {
                self.write(index, merged)?;
            }
        }
        for (index, entry) in (0..).zip(want) {
            if *entry != self.element(index) {
                self.write(index, *entry)?;
            }
        }
        Ok(())
    }

    fn defer(&mut self) {
        self.dirty.get_or_insert_with(BTreeSet::new);
    }

    fn flush(&mut self) -> Result<(), MapError> {
        let Some(dirty) = self.dirty.take() else {
            return Ok(());
        };
        for index in dirty {
            let entry = self.element(index);
            self.map.set(index, entry, 0)?;
        }
        Ok(())
    }
}

/// What the frontends' and the node ports' filters hold, and why.
pub struct FrontFilter {
    addrs: Bytes,
    ports: Bytes,
    /// Frontends with a master entry (slot 0) written or queued.
    masters: HashSet<Frontend>,
    /// Per address: its masters.
    addr_refs: HashMap<IpAddr, u32>,
    /// Per slot: the addresses that land there.
    addr_slots: HashMap<Slot, u32>,
    /// Per node port and protocol bit: its masters (one per family).
    port_refs: HashMap<(u16, u8), u32>,
}

impl FrontFilter {
    pub fn take(ebpf: &mut Ebpf) -> Result<Self, LoadError> {
        Ok(Self {
            addrs: Bytes::take(ebpf, names::FRONT_FILTER, ENTRIES)?,
            ports: Bytes::take(ebpf, names::NODE_PORTS, PORT_ENTRIES)?,
            masters: HashSet::new(),
            addr_refs: HashMap::new(),
            addr_slots: HashMap::new(),
            port_refs: HashMap::new(),
        })
    }

    /// Collects changes instead of writing them, until [`Self::flush`]. For a first sync
    /// into empty maps only: until then a frontend's master entry may be visible before its
    /// slot, and its packets go untranslated as they did before the entry.
    pub fn defer(&mut self) {
        self.addrs.defer();
        self.ports.defer();
    }

    /// Writes what [`Self::defer`] collected, and writes at once again.
    pub fn flush(&mut self) -> Result<(), MapError> {
        self.addrs.flush()?;
        self.ports.flush()
    }

    /// Before `fe`'s master entry is written: its address's slot (or its node port's bit)
    /// is set. Err if the filter cannot be written, in which case the entry must not be
    /// either: the packet path would not see it.
    pub fn master_put(&mut self, fe: &Frontend) -> Result<(), MapError> {
        if self.masters.contains(fe) {
            return Ok(());
        }
        if fe.ip.is_unspecified() {
            let key = port_key(fe);
            if !self.port_refs.contains_key(&key) {
                self.ports.update(filter::port_slot(key.0), key.1, true)?;
            }
            *self.port_refs.entry(key).or_default() += 1;
        } else {
            self.hold(fe.ip)?;
        }
        self.masters.insert(*fe);
        Ok(())
    }

    /// After `fe`'s master entry is deleted.
    pub fn master_gone(&mut self, fe: &Frontend) {
        if !self.masters.remove(fe) {
            return;
        }
        if !fe.ip.is_unspecified() {
            self.release(fe.ip);
            return;
        }
        let key = port_key(fe);
        let Some(n) = self.port_refs.get_mut(&key) else {
            return;
        };
        *n -= 1;
        if *n == 0 {
            self.port_refs.remove(&key);
            // A bit left set only costs lookups: nothing to undo if the write fails.
            if let Err(e) = self.ports.update(filter::port_slot(key.0), key.1, false) {
                tracing::debug!(error = %e, "cannot clear a node port filter bit");
            }
        }
    }

    /// After a restart on pinned maps: `masters` are what the service maps hold now
    /// (besides what this daemon wrote), and the filters are rewritten to exactly that,
    /// dropping what went while no daemon kept them.
    pub fn adopt(&mut self, masters: impl IntoIterator<Item = Frontend>) -> Result<(), MapError> {
        self.masters.extend(masters);
        self.addr_refs.clear();
        self.port_refs.clear();
        for fe in &self.masters {
            if fe.ip.is_unspecified() {
                let key = port_key(fe);
                *self.port_refs.entry(key).or_default() += 1;
            } else {
                *self.addr_refs.entry(fe.ip).or_default() += 1;
            }
        }
        self.addr_slots.clear();
        for a in self.addr_refs.keys() {
            *self.addr_slots.entry(addr_slot(*a)).or_default() += 1;
        }
        let mut want = vec![[0u8; ENTRY_SLOTS]; ENTRIES as usize];
        for (index, byte) in self.addr_slots.keys() {
            want[*index as usize][*byte] = 1;
        }
        self.addrs.rewrite(&want)?;
        let mut want = vec![[0u8; ENTRY_SLOTS]; PORT_ENTRIES as usize];
        for (port, bit) in self.port_refs.keys() {
            let (index, byte) = filter::port_slot(*port);
            want[index as usize][byte] |= bit;
        }
        self.ports.rewrite(&want)
    }

    fn hold(&mut self, ip: IpAddr) -> Result<(), MapError> {
        if let Some(n) = self.addr_refs.get_mut(&ip) {
            *n += 1;
            return Ok(());
        }
        let slot = addr_slot(ip);
        self.addrs.update(slot, 1, true)?;
        self.addr_refs.insert(ip, 1);
        *self.addr_slots.entry(slot).or_default() += 1;
        Ok(())
    }

    fn release(&mut self, ip: IpAddr) {
        let Some(n) = self.addr_refs.get_mut(&ip) else {
            return;
        };
        *n -= 1;
        if *n > 0 {
            return;
        }
        self.addr_refs.remove(&ip);
        let slot = addr_slot(ip);
        let Some(others) = self.addr_slots.get_mut(&slot) else {
            return;
        };
        *others -= 1;
        if *others > 0 {
            return;
        }
        self.addr_slots.remove(&slot);
        // A slot left set only costs lookups: nothing to undo if the write fails.
        if let Err(e) = self.addrs.update(slot, 1, false) {
            tracing::debug!(error = %e, "cannot clear a frontend filter slot");
        }
    }
}
