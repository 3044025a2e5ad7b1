//! Filters: maps of one byte per slot that tell the packet programs, without a hash-map
//! lookup, that a packet needs none.
//!
//! Every packet on a pod's device (and on a node device) runs the packet programs, and most
//! are no Service's: pod to pod, node to node. For each, the programs looked up the service
//! map two or three times (the destination under each scope, then as a node address) and
//! the flow table once (a reply entry), all misses in maps of a quarter of a million
//! buckets, the cost of every pod's traffic. A filter slot is a byte in an array map, which
//! the verifier inlines: a zero byte says "nothing here" at the price of a hash and a load.
//!
//! - `FP_FRONT_BITS` (512 KiB), kept by the daemon: the slot of every address that has a
//!   master entry in a service map. Set before the entry is written, cleared after the last
//!   entry at the address goes.
//! - `FP_NODE_PORTS` (64 KiB), kept by the daemon: a byte per port number, with a bit per
//!   protocol ([`proto_bit`]), for every node port (master entries under address 0, which
//!   packets to any node address reach). Exact, so a packet to a node address on another
//!   port (the kubelet's, SSH) skips the node-address and node-port lookups.
//! - `FP_REPLY_BITS2` (512 KiB), kept by the programs: the slot of every (backend address,
//!   port, protocol) a reply entry was written for, set before the entry. Never cleared: its
//!   keys are bounded by the backends that ever had a per-packet flow, and a stale slot
//!   costs one lookup. An address and protocol pick the element, the port the byte in it
//!   ([`reply_slot`]): every packet a client sends from its ever-new ports reads the one
//!   cache line, where a slot hashed from the port too missed the cache on each new
//!   connection's packets (`FP_REPLY_BITS`, hashed so, was replaced by this map).
//!
//! One byte per slot rather than one bit: a program sets a slot with a plain store, where
//! setting a bit needs an atomic read-modify-write (kernel 5.12) for two CPUs not to lose
//! each other's. A false positive only costs the lookups the filter would have saved.

/// Array elements per filter: 524,288 slots, so that 10,000 frontend addresses leave a
/// packet for another address a 2% chance of a needless lookup (50,000: 9%).
pub const ENTRIES: u32 = 8192;
/// Slots per element: one cache line.
pub const ENTRY_SLOTS: usize = 64;
/// One element of a filter: a byte per slot, non-zero for "maybe".
pub type Entry = [u8; ENTRY_SLOTS];

/// Elements of the node ports' filter: a byte per port number.
pub const PORT_ENTRIES: u32 = 65_536 / ENTRY_SLOTS as u32;

/// The node ports' filter slot of `port` (host order).
#[inline(always)]
pub const fn port_slot(port: u16) -> (u32, usize) {
    (
        (port as u32) / ENTRY_SLOTS as u32,
        (port as usize) % ENTRY_SLOTS,
    )
}

/// A protocol's bit in the node ports' filter; 0 for one that has no node ports.
#[inline(always)]
pub const fn proto_bit(proto: u8) -> u8 {
    match proto {
        crate::proto::TCP => 1,
        crate::proto::UDP => 2,
        crate::proto::SCTP => 4,
        _ => 0,
    }
}

/// Where hash `h` (from [`addr_hash`]) lands: the element and the byte within it.
#[inline(always)]
pub const fn slot(h: u32) -> (u32, usize) {
    let h = finish(h);
    ((h >> 6) & (ENTRIES - 1), (h as usize) & (ENTRY_SLOTS - 1))
}

/// murmur3's finaliser: every bit of a hash [`mix`]ed together reaches every output bit,
/// so that any of them picks a slot.
#[inline(always)]
pub const fn finish(h: u32) -> u32 {
    let mut h = h;
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// Folds one 32-bit word (an address word as stored, a port and protocol) into `h`.
#[inline(always)]
pub const fn mix(h: u32, word: u32) -> u32 {
    (h ^ word).wrapping_mul(0x9e37_79b1).rotate_left(13)
}

/// The hash of an address given word by word as stored (`word(i)` for `i < n`: one word
/// for IPv4, four for IPv6), written once for the programs and the daemon, which must
/// agree on every slot. Word by word, as the programs read addresses.
#[inline(always)]
pub fn addr_hash(n: usize, word: impl Fn(usize) -> u32) -> u32 {
    let mut h = 0;
    let mut i = 0;
    while i < n {
        h = mix(h, word(i));
        i += 1;
    }
    h
}

/// The replies' filter slot of a backend's address (its [`addr_hash`]), port (as stored,
/// network order) and protocol: the element from the address and protocol, the byte from
/// the port.
#[inline(always)]
pub fn reply_slot_of(addr_hash: u32, port: u16, proto: u8) -> (u32, usize) {
    let (element, _) = slot(mix(addr_hash, u32::from(proto)));
    (element, usize::from(u16::from_be(port)) & (ENTRY_SLOTS - 1))
}

/// The frontends' filter slot of an address given as its words (the daemon's side).
pub fn addr_slot(words: &[u32]) -> (u32, usize) {
    slot(addr_hash(words.len(), |i| words[i]))
}

/// The replies' filter slot of a backend's address (as in [`addr_slot`]), port and
/// protocol.
pub fn reply_slot(words: &[u32], port: u16, proto: u8) -> (u32, usize) {
    reply_slot_of(addr_hash(words.len(), |i| words[i]), port, proto)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_spread_over_the_whole_filter() {
        // 4,096 consecutive addresses (a ClusterIP range's start) into 524,288 slots: a
        // spread hash leaves about 1/256 of them sharing a slot.
        let mut seen = [false; (ENTRIES as usize) * ENTRY_SLOTS];
        let mut shared = 0;
        for a in 0u32..4096 {
            let (e, b) = addr_slot(&[(0xc612_0000u32 + a).to_be()]);
            let i = e as usize * ENTRY_SLOTS + b;
            shared += usize::from(seen[i]);
            seen[i] = true;
        }
        assert!(shared < 40, "{shared} of 4,096 addresses share a slot");
    }

    #[test]
    fn a_sources_ports_share_its_element_and_sources_spread() {
        let client = [0xc612_0201u32.to_be()];
        let (element, _) = reply_slot(&client, 40_000u16.to_be(), crate::proto::TCP);
        let mut bytes = [false; ENTRY_SLOTS];
        for p in 40_000u16..40_064 {
            let (e, b) = reply_slot(&client, p.to_be(), crate::proto::TCP);
            assert_eq!(e, element, "port {p}");
            bytes[b] = true;
        }
        assert!(
            bytes.iter().all(|b| *b),
            "64 ports fill the element's bytes"
        );
        let (udp, _) = reply_slot(&client, 40_000u16.to_be(), crate::proto::UDP);
        assert_ne!(udp, element, "a protocol has elements of its own");
        // 4,096 backends' addresses over 8,192 elements: a spread hash leaves about a
        // fifth of them sharing one.
        let mut seen = [false; ENTRIES as usize];
        let mut shared = 0;
        for a in 0u32..4096 {
            let (e, _) = reply_slot(&[(0xc613_0000u32 + a).to_be()], 8080u16.to_be(), 6);
            shared += usize::from(seen[e as usize]);
            seen[e as usize] = true;
        }
        assert!(
            shared < 1_000,
            "{shared} of 4,096 addresses share an element"
        );
    }
}
