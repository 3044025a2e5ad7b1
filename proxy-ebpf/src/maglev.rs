//! A new flow's backend from its frontend's Maglev table (see `proxy_common::maglev`).

use proxy_common::{
    ServiceValue,
    maglev::{Header, position},
};

use crate::{
    flow::Flow,
    ip::{Backend, Ip},
    maps::MAGLEV,
};

/// The hash seed (`--bpf-lb-maglev-hash-seed`), set by the daemon at load time: a
/// read-only global, the same on every node of a cluster.
#[unsafe(no_mangle)]
static MAGLEV_SEED: u32 = 0;

/// The backend the frontend's table gives this flow; None while the frontend has no
/// table (just added, or a table that could not be written), and the caller picks
/// uniformly instead.
#[inline(always)]
pub fn backend<I: Ip>(f: &Flow<I::Addr>, master: &ServiceValue) -> Option<(u32, Backend<I::Addr>)> {
    let table = u32::from(master.rev_nat_index);
    // SAFETY: the daemon only ever replaces a table whole (a new inner map swapped in),
    // never writes into one a program may be reading, and the values are plain integers
    // copied out at once.
    let header = unsafe { MAGLEV.get_value(&table, &0) }.map(Header::of)?;
    if header.size == 0 {
        return None;
    }
    // SAFETY: a read-only global the loader set before the program was loaded.
    let seed = unsafe { core::ptr::read_volatile(&MAGLEV_SEED) };
    let (element, word) = position(I::maglev_hash(f, seed) % header.size);
    // SAFETY: as for the header.
    let chunk = unsafe { MAGLEV.get_value(&table, &element) }?;
    let id = *chunk.ids.get(word)?;
    I::backend(id).map(|b| (id, b))
}
