//! Maglev lookup tables (Eisenbud et al., NSDI 2016, as Cilium builds them): which of a
//! frontend's backends each of the table's `M` entries names.
//!
//! Each backend gets a preference order over the entries from two hashes of its address
//! (an offset and a skip, `M` prime so every skip visits every entry); backends take turns
//! claiming their next free preferred entry until the table is full. Every node computes
//! the same table from the same backends, whatever ids they have here, and the backends'
//! shares differ by at most one entry. The flow side is `proxy_common::maglev`.

use std::net::IpAddr;

use proxy_common::maglev::flow_hash;

use crate::dataplane::frontends::BackendAddr;

/// Seeds of a backend's two hashes, mixed with the cluster's seed.
const OFFSET_SEED: u32 = 0x6d61_676c;
const SKIP_SEED: u32 = 0x6576_3031;

/// A backend's identity for hashing: its address, port and protocol, in the same words on
/// every node.
fn identity(b: &BackendAddr) -> [u32; 6] {
    let ip = match b.ip {
        IpAddr::V4(ip) => {
            let mut w = [0u32; 4];
            w[3] = u32::from(ip);
            w
        }
        IpAddr::V6(ip) => {
            let o = ip.octets();
            std::array::from_fn(|i| {
                u32::from_be_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
            })
        }
    };
    [
        ip[0],
        ip[1],
        ip[2],
        ip[3],
        u32::from(b.port),
        u32::from(b.proto.number()),
    ]
}

/// The table: entry `i` is an index into `backends`. Empty for no backends. `size` must be
/// prime (see `proxy_common::maglev::TABLE_SIZES`) and is at least 2.
pub fn table(backends: &[BackendAddr], size: u32, seed: u32) -> Vec<u32> {
    let m = u64::from(size);
    if backends.is_empty() || m < 2 {
        return Vec::new();
    }
    // Backends take turns in the order of their identities, not of the list: the same
    // backends give the same table on every node.
    let mut order: Vec<(usize, [u32; 6])> = backends
        .iter()
        .enumerate()
        .map(|(i, b)| (i, identity(b)))
        .collect();
    order.sort_by_key(|(_, id)| *id);
    let prefs: Vec<(u32, u64, u64)> = order
        .iter()
        .map(|&(i, id)| {
            let offset = u64::from(flow_hash(id, seed ^ OFFSET_SEED)) % m;
            let skip = u64::from(flow_hash(id, seed ^ SKIP_SEED)) % (m - 1) + 1;
            (i as u32, offset, skip)
        })
        .collect();
    let mut next = vec![0u64; backends.len()];
    let mut entries = vec![u32::MAX; size as usize];
    let mut filled = 0u64;
    'fill: loop {
        for (i, &(index, offset, skip)) in prefs.iter().enumerate() {
            // Each backend's preferences visit every entry once (m prime, skip < m), so
            // a free one is found before `next` wraps.
            let mut c = (offset + next[i] * skip) % m;
            while entries[c as usize] != u32::MAX {
                next[i] += 1;
                c = (offset + next[i] * skip) % m;
            }
            entries[c as usize] = index;
            next[i] += 1;
            filled += 1;
            if filled == m {
                break 'fill;
            }
        }
    }
    entries
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    fn backends(n: u8) -> Vec<BackendAddr> {
        (1..=n)
            .map(|i| BackendAddr {
                ip: IpAddr::from([198, 18, 11, i]),
                port: 8080,
                proto: Protocol::Tcp,
                local: false,
            })
            .collect()
    }

    /// Entries of `after` (indexes into `b_after`) that name another backend than in
    /// `before` (indexes into `b_before`).
    fn moved(
        before: &[u32],
        b_before: &[BackendAddr],
        after: &[u32],
        b_after: &[BackendAddr],
    ) -> usize {
        before
            .iter()
            .zip(after)
            .filter(|(x, y)| {
                let (x, y) = (&b_before[**x as usize], &b_after[**y as usize]);
                (x.ip, x.port) != (y.ip, y.port)
            })
            .count()
    }

    #[test]
    fn every_backend_gets_an_equal_share_within_one_entry() {
        for n in [1, 2, 3, 7, 10, 100] {
            let b = backends(n);
            let t = table(&b, 16_381, 0);
            assert_eq!(t.len(), 16_381);
            let mut share = vec![0u32; usize::from(n)];
            for &i in &t {
                share[i as usize] += 1;
            }
            let (lo, hi) = (share.iter().min().unwrap(), share.iter().max().unwrap());
            assert!(hi - lo <= 1, "{n} backends: shares {lo}..{hi}");
        }
    }

    #[test]
    fn the_table_depends_on_the_backends_not_on_their_order_of_arrival() {
        let b = backends(5);
        let mut reversed = b.clone();
        reversed.reverse();
        let t = table(&b, 4_093, 9);
        let r = table(&reversed, 4_093, 9);
        // Same backend at every entry, whatever its index in the list.
        assert_eq!(moved(&t, &b, &r, &reversed), 0);
        // Whether the backend is local to this node does not matter either.
        let mut here = b.clone();
        here[2].local = true;
        assert_eq!(moved(&t, &b, &table(&here, 4_093, 9), &here), 0);
    }

    #[test]
    fn a_backend_leaving_moves_little_more_than_its_own_share() {
        // The 1/N that must move (the leaver's), and few others: the paper's bound.
        for n in [3u8, 5, 10, 50] {
            let b = backends(n);
            let t = table(&b, 16_381, 0);
            let mut fewer = b.clone();
            let gone = fewer.remove(usize::from(n / 2));
            let t2 = table(&fewer, 16_381, 0);
            let own = t.iter().filter(|&&i| b[i as usize] == gone).count();
            let moved = moved(&t, &b, &t2, &fewer);
            let extra = (moved - own) as f64 / 16_381.0;
            println!("{n} backends, one leaves: {moved} of 16381 entries move ({own} its own)");
            assert!(
                extra < 0.02,
                "{n} backends: {extra:.3} of the table moved beyond the leaver's share"
            );
            // A backend added back restores the table exactly.
            assert_eq!(table(&b, 16_381, 0), t);
        }
    }

    #[test]
    fn another_seed_is_another_table() {
        let b = backends(4);
        assert_ne!(table(&b, 251, 1), table(&b, 251, 2));
    }
}
