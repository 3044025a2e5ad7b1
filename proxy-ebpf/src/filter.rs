//! The packet path's filters (see `proxy_common::filter`): whether a packet may be
//! addressed to a frontend, or may be a reply of a flow we translate, answered without a
//! hash-map lookup.

use proxy_common::filter::{self, Entry};

use crate::{
    ip::Ip,
    maps::{FRONT_FILTER, NODE_PORTS, REPLY_FILTER},
};

#[inline(always)]
fn addr_hash<I: Ip>(addr: &I::Addr) -> u32 {
    filter::addr_hash(I::WORDS, |i| I::word(addr, i))
}

#[inline(always)]
fn reply_slot<I: Ip>(addr: &I::Addr, port: u16, proto: u8) -> (u32, usize) {
    filter::reply_slot_of(addr_hash::<I>(addr), port, proto)
}

/// Whether slot `byte` of element `entry` is set; a missing element reads as set, so a
/// filter that cannot answer costs lookups, never a flow.
#[inline(always)]
fn is_set(entry: Option<&Entry>, byte: usize) -> bool {
    match entry {
        Some(e) => e.get(byte).is_none_or(|b| *b != 0),
        None => true,
    }
}

/// Whether `addr` may hold a frontend of its own (a ClusterIP, an external or
/// load-balancer IP; node ports are [`may_be_node_port`]'s).
#[inline(always)]
pub fn may_be_frontend<I: Ip>(addr: &I::Addr) -> bool {
    let (index, byte) = filter::slot(addr_hash::<I>(addr));
    is_set(FRONT_FILTER.get(index), byte)
}

/// Whether `port` (as in the packet) is a node port of `proto`.
#[inline(always)]
pub fn may_be_node_port(port: u16, proto: u8) -> bool {
    let (index, byte) = filter::port_slot(u16::from_be(port));
    match NODE_PORTS.get(index) {
        Some(e) => e
            .get(byte)
            .is_none_or(|b| *b & filter::proto_bit(proto) != 0),
        None => true,
    }
}

/// Whether a packet from `addr`:`port` may be the reply of a flow with a reply entry.
#[inline(always)]
pub fn may_be_reply<I: Ip>(addr: &I::Addr, port: u16, proto: u8) -> bool {
    let (index, byte) = reply_slot::<I>(addr, port, proto);
    is_set(REPLY_FILTER.get(index), byte)
}

/// Notes that a reply entry for answers from `addr`:`port` is about to be written.
#[inline(always)]
pub fn note_reply<I: Ip>(addr: &I::Addr, port: u16, proto: u8) {
    let (index, byte) = reply_slot::<I>(addr, port, proto);
    if let Some(e) = REPLY_FILTER.get_ptr_mut(index) {
        // SAFETY: a non-null pointer from the array is an element of this map's value type
        // that lives as long as the map. A byte store is whole on every CPU, and other
        // CPUs only ever store 1 into slots too: none can undo another's.
        let e = unsafe { &mut *e };
        // Read first: a slot is set for good after a backend's first flow, and a store to
        // it anyway would dirty a cache line the other CPUs read on every packet.
        if let Some(b) = e.get_mut(byte)
            && *b == 0
        {
            *b = 1;
        }
    }
}
