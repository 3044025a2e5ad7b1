//! Adopting what a previous daemon left in pinned maps: the first sync after a restart
//! then changes only what differs, instead of rewriting every frontend.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use proxy_common::{AffinityMatchKey, BackendId, service::flags};

use super::{BackendAddr, BackendRef, FrontendState, Programmer, Settings, adopted};

impl Programmer {
    /// Reads back what a previous daemon left in pinned maps, so the first sync changes
    /// only what differs instead of rewriting (and briefly disturbing) every frontend.
    /// Entries that reference nothing are deleted. Returns how many frontends were adopted.
    pub fn adopt_existing(&mut self) -> usize {
        let backends: HashMap<BackendId, BackendAddr> =
            self.maps.backend_entries().into_iter().collect();
        let mut ranges: HashMap<u16, Vec<(std::net::IpAddr, u8)>> = HashMap::new();
        for (rev, range) in self.maps.source_range_entries() {
            ranges.entry(rev).or_default().push(range);
        }
        let mut masters = BTreeMap::new();
        let mut slots = HashMap::new();
        for (fe, slot, value) in self.maps.service_entries() {
            if slot == 0 {
                masters.insert(fe, value);
            } else {
                slots.insert((fe, slot), value.backend_id);
            }
        }
        for (fe, master) in &masters {
            let mut source_ranges = ranges.remove(&master.rev_nat_index).unwrap_or_default();
            source_ranges.sort();
            let mut ids = Vec::new();
            for slot in 1..=master.count {
                // A gap means a half-written frontend; keep the prefix, the sync rewrites it.
                let Some(id) = slots.remove(&(*fe, slot)) else {
                    break;
                };
                let Some(b) = backends.get(&id) else { break };
                ids.push(id);
                self.set_addr(id, *b);
                self.backends
                    .entry(*b)
                    .or_insert(BackendRef { id, refs: 0 })
                    .refs += 1;
                self.backend_ids.reserve(id);
            }
            self.rev_nat_ids.reserve(u32::from(master.rev_nat_index));
            self.owners.entry(adopted()).or_default().insert(*fe);
            let st = FrontendState {
                owner: adopted(),
                rev_nat_index: master.rev_nat_index,
                settings: Settings {
                    affinity_timeout: (master.flags & flags::AFFINITY != 0)
                        .then_some(master.affinity_timeout),
                    snat: master.flags & flags::SNAT != 0,
                    maglev: master.flags & flags::MAGLEV != 0,
                    dsr: master.flags & flags::DSR != 0,
                    source_ranges: source_ranges.into(),
                },
                ids: ids.into(),
            };
            self.frontends.insert(*fe, st);
        }
        if let Err(e) = self.maps.adopt_front_filter(masters.keys().copied()) {
            // Slots an earlier daemon set stay set: they cost lookups, never a flow.
            tracing::warn!(error = %e, "cannot rewrite the frontends' filter");
        }
        for ((fe, slot), _) in slots {
            if self
                .frontends
                .get(&fe)
                .is_none_or(|st| usize::from(slot) > st.ids.len())
            {
                let _ = self.maps.del_service(&fe, slot);
            }
        }
        for (id, b) in &backends {
            if self.backends.get(b).is_none_or(|r| r.id != *id) {
                let _ = self.maps.del_backend(*id, b);
            }
        }
        // Ranges of frontends that are gone.
        for (rev, r) in ranges {
            self.maps.del_source_ranges(rev, &r);
        }
        self.adopt_affinity_matches();
        masters.len()
    }

    /// Makes the affinity match map follow the adopted backend sets: drops what a daemon
    /// that stopped midway left, writes what a daemon without the map never wrote.
    fn adopt_affinity_matches(&mut self) {
        let want: BTreeSet<AffinityMatchKey> = self
            .frontends
            .values()
            .filter(|st| st.settings.affinity_timeout.is_some())
            .flat_map(|st| {
                st.ids
                    .iter()
                    .map(|&id| AffinityMatchKey::new(id, st.rev_nat_index))
            })
            .collect();
        let mut have = BTreeSet::new();
        for k in self.maps.affinity_match_entries() {
            if want.contains(&k) {
                have.insert(k);
            } else {
                self.maps
                    .del_affinity_matches(k.rev_nat_index, &[k.backend_id]);
            }
        }
        for k in want.difference(&have) {
            if let Err(e) = self
                .maps
                .put_affinity_matches(k.rev_nat_index, &[k.backend_id])
            {
                // Only stickiness suffers: its clients pick afresh each time until it changes.
                tracing::warn!("cannot restore a ClientIP affinity backend: {e}");
            }
        }
    }
}
