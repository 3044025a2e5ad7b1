//! Maglev consistent hashing for the packet path, after Cilium's `--bpf-lb-algorithm=maglev`.
//!
//! A frontend with Maglev has a lookup table of `M` backend ids (`M` prime, the same on
//! every node). A new flow takes entry `flow_hash(tuple) % M`. Every node builds the same
//! table from the same backends (by address, not by the node-local ids) and hashes a flow
//! the same way, so a flow that an ECMP router moves to another node, or that outlives its
//! node, finds the same backend there without shared state. When a backend leaves, only
//! about `1/N` of the table's entries change.
//!
//! The table is an inner array map per frontend in a hash of maps keyed by the frontend's
//! reverse-NAT index (Cilium's layout). Its element 0 is a [`Header`]; element `1 + i / 16`
//! holds entries `i` rounded down to a multiple of 16 and up: 64-byte elements, because an
//! array map rounds each element up to 8 bytes and a `u32` per element would double the
//! memory.

use bytemuck::{Pod, Zeroable};

/// Table entries per array element.
pub const CHUNK: usize = 16;

/// One element of a frontend's table: element 0 holds the [`Header`] in its first words.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct Chunk {
    pub ids: [u32; CHUNK],
}
const _: () = assert!(core::mem::size_of::<Chunk>() == 64);

impl Default for Chunk {
    fn default() -> Self {
        Self { ids: [0; CHUNK] }
    }
}

/// What element 0 says of its table: the table carries its own size, so a table written
/// with another `--bpf-lb-maglev-table-size` still reads right until it is rewritten.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// `M`: entries in the table.
    pub size: u32,
}

impl Header {
    pub const fn chunk(self) -> Chunk {
        let mut ids = [0; CHUNK];
        ids[0] = self.size;
        Chunk { ids }
    }

    pub const fn of(chunk: &Chunk) -> Self {
        Self { size: chunk.ids[0] }
    }
}

/// Array elements a table of `size` entries takes, header included.
pub const fn elements(size: u32) -> u32 {
    1 + size.div_ceil(CHUNK as u32)
}

/// Where entry `index` lives: (array element, word in it).
pub const fn position(index: u32) -> (u32, usize) {
    (1 + index / CHUNK as u32, (index % CHUNK as u32) as usize)
}

/// The table sizes Cilium accepts: primes, each about twice the last. `M` should be well
/// above 100 times the largest backend count for the spread to stay within 1%.
pub const TABLE_SIZES: [u32; 10] = [
    251, 509, 1_021, 2_039, 4_093, 8_191, 16_381, 32_749, 65_521, 131_071,
];
pub const DEFAULT_TABLE_SIZE: u32 = 16_381;

/// Frontends that can have a table at once (the outer map's capacity): as many as there
/// are reverse-NAT indexes.
pub const TABLES_MAX: u32 = 65_536;

/// The hash of a flow's tuple (client address and port, frontend address and port,
/// protocol) as words in network byte order, the same on every node for a given `seed`.
/// murmur3's 32-bit body and finalizer: cheap in BPF (no loop over a length the verifier
/// cannot bound) and well spread over the low bits a modulo keeps.
#[inline(always)]
pub fn flow_hash<const N: usize>(words: [u32; N], seed: u32) -> u32 {
    const C1: u32 = 0xcc9e_2d51;
    const C2: u32 = 0x1b87_3593;
    let mut h = seed;
    let mut i = 0;
    while i < N {
        let k = words[i].wrapping_mul(C1).rotate_left(15).wrapping_mul(C2);
        h = (h ^ k)
            .rotate_left(13)
            .wrapping_mul(5)
            .wrapping_add(0xe654_6b64);
        i += 1;
    }
    h ^= (N as u32) * 4;
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// The tuple words of an IPv4 flow, for [`flow_hash`].
#[inline(always)]
pub fn words4(saddr: u32, daddr: u32, sport: u16, dport: u16, proto: u8) -> [u32; 4] {
    [
        saddr,
        daddr,
        (u32::from(sport) << 16) | u32::from(dport),
        u32::from(proto),
    ]
}

/// The tuple words of an IPv6 flow, for [`flow_hash`]: addresses as four words each, as
/// in memory.
#[inline(always)]
pub fn words6(saddr: [u32; 4], daddr: [u32; 4], sport: u16, dport: u16, proto: u8) -> [u32; 10] {
    [
        saddr[0],
        saddr[1],
        saddr[2],
        saddr[3],
        daddr[0],
        daddr[1],
        daddr[2],
        daddr[3],
        (u32::from(sport) << 16) | u32::from(dport),
        u32::from(proto),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_cover_the_table_without_overlap() {
        let size = 251;
        let mut seen = [false; 1 + 251usize.div_ceil(CHUNK) * CHUNK];
        for i in 0..size {
            let (e, w) = position(i);
            assert!(e >= 1 && e < elements(size));
            let flat = (e as usize - 1) * CHUNK + w;
            assert!(!seen[flat]);
            seen[flat] = true;
        }
    }

    #[test]
    fn flow_hashes_spread_over_a_prime_table() {
        // 10,000 client ports of one client to one frontend: each of 7 buckets near 1/7.
        let mut buckets = [0u32; 7];
        for port in 0..10_000u16 {
            let h = flow_hash(words4(0xc612_0001, 0xc613_0001, port, 80, 6), 7);
            buckets[(h % 7) as usize] += 1;
        }
        for b in buckets {
            assert!((1_300..1_560).contains(&b), "{buckets:?}");
        }
        // The seed matters.
        let w = words4(1, 2, 3, 4, 6);
        assert_ne!(flow_hash(w, 1), flow_hash(w, 2));
    }
}
