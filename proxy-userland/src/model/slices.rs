//! [`Slices`]: the slices of one service by name, as a sorted vector.
//!
//! Almost every service has one slice (a slice holds up to 100 endpoints), and a
//! `BTreeMap` allocates a node for eleven entries even for one: ~800 bytes per service, 8 MB
//! of the model at 10,000 services. A sorted vector holds what is there and keeps the map's
//! order and lookups (binary search over a handful of names).

use std::{collections::BTreeMap, ops::Index, sync::Arc};

/// Generic over the slice type so that this container needs nothing from the model's
/// endpoint types, which hold it (`Slices<SliceInfo>`).
///
/// Names are shared strings: the change tracker's slice index holds the same copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slices<T>(Vec<(Arc<str>, T)>);

impl<T> Default for Slices<T> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<T> Slices<T> {
    fn find(&self, name: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(n, _)| (**n).cmp(name))
    }

    /// Sets slice `name`; returns the slice it replaced.
    pub fn insert(&mut self, name: impl Into<Arc<str>>, slice: T) -> Option<T> {
        let name = name.into();
        match self.find(&name) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, slice)),
            Err(i) => {
                // Exactly one more: a Vec grown by a push holds four (~200 spare bytes for
                // the one slice almost every service has), and the model keeps it.
                self.0.reserve_exact(1);
                self.0.insert(i, (name, slice));
                None
            }
        }
    }

    pub fn remove(&mut self, name: &str) -> Option<T> {
        self.find(name).ok().map(|i| self.0.remove(i).1)
    }

    pub fn get(&self, name: &str) -> Option<&T> {
        self.find(name).ok().map(|i| &self.0[i].1)
    }

    pub fn contains_key(&self, name: &str) -> bool {
        self.find(name).is_ok()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Slice names, in order.
    pub fn keys(&self) -> impl Iterator<Item = &Arc<str>> {
        self.0.iter().map(|(n, _)| n)
    }

    /// Slices, in the order of their names.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.0.iter().map(|(_, s)| s)
    }

    /// (name, slice), in order.
    pub fn iter(&self) -> impl Iterator<Item = (&Arc<str>, &T)> {
        self.0.iter().map(|(n, s)| (n, s))
    }
}

impl<T, N: Into<Arc<str>>> FromIterator<(N, T)> for Slices<T> {
    /// A name given twice keeps its last slice, as collecting into a map would.
    fn from_iter<I: IntoIterator<Item = (N, T)>>(iter: I) -> Self {
        let mut slices = Slices::default();
        for (name, slice) in iter {
            slices.insert(name, slice);
        }
        slices.0.shrink_to_fit();
        slices
    }
}

impl<T, const N: usize> From<[(String, T); N]> for Slices<T> {
    fn from(slices: [(String, T); N]) -> Self {
        slices.into_iter().collect()
    }
}

impl<T> Index<&str> for Slices<T> {
    type Output = T;

    fn index(&self, name: &str) -> &T {
        self.get(name)
            .unwrap_or_else(|| panic!("no slice named {name:?}"))
    }
}

/// As a map of name to slice (what /debug/model has always shown).
impl<T: serde::Serialize> serde::Serialize for Slices<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter().map(|(n, s)| (&**n, s)))
    }
}

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for Slices<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        BTreeMap::<String, T>::deserialize(d).map(|m| m.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::SliceInfo;

    fn slice(n: u16) -> SliceInfo {
        SliceInfo {
            ports: vec![super::super::SlicePort {
                name: String::new(),
                port: n,
                protocol: super::super::Protocol::Tcp,
            }],
            endpoints: vec![],
        }
    }

    #[test]
    fn behaves_as_a_sorted_map() {
        let mut s = Slices::default();
        assert_eq!(s.insert("b", slice(2)), None);
        assert_eq!(s.insert("a", slice(1)), None);
        assert_eq!(s.insert("c", slice(3)), None);
        assert_eq!(s.insert("b", slice(20)), Some(slice(2)));
        assert_eq!(s.keys().map(|k| &**k).collect::<Vec<_>>(), ["a", "b", "c"]);
        assert_eq!(s["b"], slice(20));
        assert!(s.contains_key("c") && !s.contains_key("d"));
        assert_eq!(s.remove("a"), Some(slice(1)));
        assert_eq!(s.remove("a"), None);
        assert_eq!(s.len(), 2);
        let json = serde_json::to_string(&s).unwrap();
        let back: Slices<SliceInfo> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
        let from_pairs: Slices<SliceInfo> =
            [("c".to_string(), slice(3)), ("b".to_string(), slice(20))]
                .into_iter()
                .collect();
        assert_eq!(from_pairs, s);
    }
}
