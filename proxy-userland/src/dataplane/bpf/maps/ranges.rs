//! The service ranges' tries: which addresses the socket hooks refuse when no frontend
//! serves them.

use std::net::IpAddr;

use aya::maps::{MapData, MapError, lpm_trie::Key as LpmKey, lpm_trie::LpmTrie};
use proxy_common::nat::addr6;

use super::{ServiceMaps, ignore_missing, v4};
use crate::model::Cidr;

impl ServiceMaps {
    /// Makes the tries hold exactly `cidrs`: adds the new ranges first, then removes the
    /// ones that went, so a range kept across the change is never missing meanwhile.
    pub fn set_service_ranges(&mut self, cidrs: &[Cidr]) -> Result<(), MapError> {
        let (mut want4, mut want6) = (Vec::new(), Vec::new());
        for c in cidrs {
            match c.addr {
                IpAddr::V4(a) => want4.push((u32::from(c.prefix), v4(a))),
                IpAddr::V6(a) => want6.push((u32::from(c.prefix), addr6(a.octets()))),
            }
        }
        replace_trie(&mut self.service_ranges4, &want4)?;
        replace_trie(&mut self.service_ranges6, &want6)
    }

    /// The ranges the tries hold, for tests and adoption checks.
    pub fn service_ranges(&self) -> Vec<Cidr> {
        let v4 = (self.service_ranges4.keys().filter_map(Result::ok)).map(|k| Cidr {
            addr: IpAddr::V4(k.data().to_ne_bytes().into()),
            prefix: k.prefix_len() as u8,
        });
        let v6 = (self.service_ranges6.keys().filter_map(Result::ok)).map(|k| Cidr {
            addr: IpAddr::V6(proxy_common::nat::octets6(k.data()).into()),
            prefix: k.prefix_len() as u8,
        });
        let mut out: Vec<Cidr> = v4.chain(v6).collect();
        out.sort();
        out
    }
}

fn replace_trie<A: aya::Pod + PartialEq>(
    trie: &mut LpmTrie<MapData, A, u8>,
    want: &[(u32, A)],
) -> Result<(), MapError> {
    for &(len, addr) in want {
        trie.insert(&LpmKey::new(len, addr), 1, 0)?;
    }
    let stale: Vec<LpmKey<A>> = (trie.keys().filter_map(Result::ok))
        .filter(|k| !want.contains(&(k.prefix_len(), k.data())))
        .collect();
    for k in stale {
        ignore_missing(trie.remove(&k))?;
    }
    Ok(())
}
