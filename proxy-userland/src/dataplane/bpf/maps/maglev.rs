//! Writing a frontend's Maglev table (see `proxy_common::maglev`): a new inner array map,
//! filled, then swapped into the outer map in one update, so a program reads either the
//! old table or the new one, never a mix.

use std::os::fd::{AsFd as _, AsRawFd as _};

use aya::maps::{Array, IterableMap as _, MapData, MapError};
use proxy_common::{
    BackendId,
    maglev::{Chunk, Header, elements, position},
};

use super::{ServiceMaps, batch, ignore_missing};

/// linux/bpf.h: an inner map whose size may differ from the outer map's template.
const BPF_F_INNER_MAP: u32 = 1 << 12;

impl ServiceMaps {
    /// Frontend `rev_nat_index`'s table: entry `i` sends new flows to backend `ids[i]`.
    pub fn put_maglev(&mut self, rev_nat_index: u16, ids: &[BackendId]) -> Result<(), MapError> {
        let size = u32::try_from(ids.len()).map_err(|_| MapError::OutOfBounds {
            index: u32::MAX,
            max_entries: u32::MAX,
        })?;
        let count = elements(size);
        let mut chunks = vec![Chunk::default(); count as usize];
        chunks[0] = Header { size }.chunk();
        for (i, &id) in (0u32..).zip(ids) {
            let (element, word) = position(i);
            chunks[element as usize].ids[word] = id;
        }
        let mut table = Array::<MapData, Chunk>::create(count, BPF_F_INNER_MAP)?;
        let indexes: Vec<u32> = (0..count).collect();
        let fd = table.map().fd().as_fd().as_raw_fd();
        if batch::update_batch_fd(fd, &indexes, &chunks).is_err() {
            for (i, chunk) in indexes.iter().zip(&chunks) {
                table.set(*i, chunk, 0)?;
            }
        }
        self.maglev.insert(u32::from(rev_nat_index), &table, 0)
    }

    /// Drops frontend `rev_nat_index`'s table; new flows then pick uniformly.
    pub fn del_maglev(&mut self, rev_nat_index: u16) -> Result<(), MapError> {
        ignore_missing(self.maglev.remove(&u32::from(rev_nat_index)))
    }
}
