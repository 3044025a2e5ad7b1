//! The programmer's frontends, with the totals the metrics read after every sync kept as
//! entries come and go: summing them over 50,000 frontends after each sync cost the sync
//! thread a walk of the whole table per change.

use std::collections::HashMap;

use super::{Frontend, FrontendState};

#[derive(Default)]
pub(super) struct FrontendTable {
    entries: HashMap<Frontend, FrontendState>,
    /// Service map entries: a master and a slot per backend for each frontend.
    service_entries: usize,
    /// Affinity match entries: a backend slot of a frontend with session affinity.
    affinity_entries: usize,
}

impl FrontendTable {
    fn count(&mut self, st: &FrontendState, sign: isize) {
        let slots = st.ids.len() as isize;
        self.service_entries = self
            .service_entries
            .saturating_add_signed(sign * (1 + slots));
        if st.settings.affinity_timeout.is_some() {
            self.affinity_entries = self.affinity_entries.saturating_add_signed(sign * slots);
        }
    }

    pub(super) fn insert(&mut self, fe: Frontend, st: FrontendState) -> Option<FrontendState> {
        self.count(&st, 1);
        let old = self.entries.insert(fe, st);
        if let Some(old) = &old {
            self.count(old, -1);
        }
        old
    }

    pub(super) fn remove(&mut self, fe: &Frontend) -> Option<FrontendState> {
        let old = self.entries.remove(fe);
        if let Some(old) = &old {
            self.count(old, -1);
        }
        old
    }

    pub(super) fn get(&self, fe: &Frontend) -> Option<&FrontendState> {
        self.entries.get(fe)
    }

    /// Only the owner may change in place: the totals do not depend on it.
    pub(super) fn set_owner(
        &mut self,
        fe: &Frontend,
        owner: super::ServiceKey,
    ) -> Option<super::ServiceKey> {
        self.entries
            .get_mut(fe)
            .map(|st| std::mem::replace(&mut st.owner, owner))
    }

    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub(super) fn keys(&self) -> impl Iterator<Item = &Frontend> {
        self.entries.keys()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &FrontendState> {
        self.entries.values()
    }

    pub(super) fn service_entries(&self) -> usize {
        self.service_entries
    }

    pub(super) fn affinity_entries(&self) -> usize {
        self.affinity_entries
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Protocol, ServiceKey};

    fn state(backends: u32, affinity: bool) -> FrontendState {
        FrontendState {
            owner: ServiceKey::new("default", "web"),
            rev_nat_index: 1,
            settings: super::super::Settings {
                affinity_timeout: affinity.then_some(10_800),
                snat: false,
                maglev: false,
                dsr: false,
                source_ranges: Default::default(),
            },
            ids: (1..=backends).collect(),
        }
    }

    #[test]
    fn totals_follow_inserts_replacements_and_removals() {
        let fe = |port| Frontend::socket("198.19.0.1".parse().unwrap(), port, Protocol::Tcp);
        let mut t = FrontendTable::default();
        t.insert(fe(80), state(3, false));
        t.insert(fe(81), state(2, true));
        assert_eq!((t.service_entries(), t.affinity_entries()), (4 + 3, 2));
        // A frontend rewritten with other backends and no affinity.
        t.insert(fe(81), state(5, false));
        assert_eq!((t.service_entries(), t.affinity_entries()), (4 + 6, 0));
        t.set_owner(&fe(80), ServiceKey::new("default", "other"));
        assert_eq!(t.service_entries(), 10, "the owner does not count");
        t.remove(&fe(80));
        t.remove(&fe(80));
        assert_eq!((t.service_entries(), t.len()), (6, 1));
        t.remove(&fe(81));
        assert_eq!((t.service_entries(), t.affinity_entries()), (0, 0));
    }
}
