//! One shared copy of the values that repeat across the model: an endpoint's node name
//! and zone, its zone hints, and (through an [`ArcPool`]) its whole placement. Every endpoint of a cluster names one of a few hundred
//! nodes; a `String` each was an allocation and 24 bytes per endpoint, about 0.5 KiB per
//! service of ten endpoints in the daemon's RSS (malloc's minimum chunk included).
//!
//! The pool forgets strings nobody else holds any more when it has doubled since it last
//! looked, so node names that come and go do not pile up.

use std::{
    borrow::Borrow,
    collections::HashSet,
    fmt,
    hash::Hash,
    ops::Deref,
    sync::{Arc, Mutex},
};

struct Pool<T> {
    strings: HashSet<T>,
    /// The pool's size that triggers the next sweep.
    sweep_at: usize,
}

const FIRST_SWEEP: usize = 1024;

static POOL: Mutex<Option<Pool<Arc<str>>>> = Mutex::new(None);
static NAMES: Mutex<Option<Pool<Name>>> = Mutex::new(None);

/// The shared copy of `key` in `pool`; `held` tells how many hold a copy (the pool's own
/// included).
fn shared<T: Borrow<Q> + Hash + Eq + Clone, Q: Hash + Eq + ?Sized>(
    pool: &Mutex<Option<Pool<T>>>,
    key: &Q,
    make: impl FnOnce(&Q) -> T,
    held: impl Fn(&T) -> usize,
) -> T {
    // A panic while the lock was held cannot leave the set half-changed in a way that
    // matters: at worst a value is missing and gets a copy of its own.
    let mut guard = pool.lock().unwrap_or_else(|p| p.into_inner());
    let pool = guard.get_or_insert_with(|| Pool {
        strings: HashSet::new(),
        sweep_at: FIRST_SWEEP,
    });
    if let Some(shared) = pool.strings.get(key) {
        return shared.clone();
    }
    if pool.strings.len() >= pool.sweep_at {
        pool.strings.retain(|k| held(k) > 1);
        pool.sweep_at = (pool.strings.len() * 2).max(FIRST_SWEEP);
    }
    let shared = make(key);
    pool.strings.insert(shared.clone());
    shared
}

/// A pool of shared copies of one type's values, for a `static`: the values that repeat
/// over many endpoints.
pub struct ArcPool<T>(Mutex<Option<Pool<Arc<T>>>>);

impl<T: Hash + Eq + Clone> ArcPool<T> {
    pub const fn new() -> Self {
        Self(Mutex::new(None))
    }

    /// The shared copy of `value`.
    pub fn shared(&self, value: T) -> Arc<T> {
        // A copy only when the pool has none: once per distinct value.
        shared(&self.0, &value, |v| Arc::new(v.clone()), Arc::strong_count)
    }
}

impl<T: Hash + Eq + Clone> Default for ArcPool<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// The shared copy of `s`.
pub fn intern(s: &str) -> Arc<str> {
    shared(&POOL, s, |s| Arc::from(s), Arc::strong_count)
}

/// A node or zone name: a shared copy ([`intern`]) behind a thin pointer. Every endpoint
/// holds two; as `Option<Arc<str>>` (a pointer and a length) they were 32 of an endpoint's
/// 72 bytes, ~7.6 MiB of the model at 50,000 services of ten endpoints.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Name(Arc<String>);

impl Name {
    pub fn new(s: &str) -> Self {
        shared(
            &NAMES,
            s,
            |s| Name(Arc::new(s.to_owned())),
            |n| Arc::strong_count(&n.0),
        )
    }
}

impl Deref for Name {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

/// As a `str`: the pool looks names up by their text (`Hash` and `Eq` agree, both are the
/// `String`'s).
impl Borrow<str> for Name {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<&str> for Name {
    fn from(s: &str) -> Self {
        Name::new(s)
    }
}

impl From<String> for Name {
    fn from(s: String) -> Self {
        Name::new(&s)
    }
}

impl PartialEq<str> for Name {
    fn eq(&self, other: &str) -> bool {
        **self.0 == *other
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self.0, f)
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Serde for `Option<Arc<str>>` fields, interning what it reads (`#[serde(with)]`); the
/// workspace's serde has no `rc` feature, and turning it on would rebuild every crate that
/// uses serde.
pub mod opt {
    use serde::{Deserialize as _, Deserializer, Serializer};

    use super::Name;

    pub fn serialize<S: Serializer>(v: &Option<Name>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.serialize_some(&**v),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Name>, D::Error> {
        Ok(Option::<String>::deserialize(d)?.map(|v| Name::new(&v)))
    }
}

/// Serde for `Vec<Arc<str>>` fields, as [`opt`].
pub mod list {
    use std::sync::Arc;

    use serde::{Deserialize as _, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[Arc<str>], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.iter().map(|v| &**v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Arc<str>>, D::Error> {
        Ok(Vec::<String>::deserialize(d)?
            .iter()
            .map(|v| super::intern(v))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_strings_share_one_copy() {
        let a = intern("intern-test-node-a");
        let b = intern(&String::from("intern-test-node-a"));
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(&*a, "intern-test-node-a");
        assert!(!Arc::ptr_eq(&a, &intern("intern-test-node-b")));
    }

    #[test]
    fn strings_nobody_holds_are_swept() {
        // Enough distinct strings to pass a sweep threshold; none of them is kept.
        for i in 0..FIRST_SWEEP * 3 {
            drop(intern(&format!("intern-test-churn-{i}")));
        }
        let kept = intern("intern-test-kept");
        for i in 0..FIRST_SWEEP * 3 {
            drop(intern(&format!("intern-test-churn-again-{i}")));
        }
        let guard = POOL.lock().unwrap();
        let pool = guard.as_ref().unwrap();
        // Other tests intern concurrently, but never thousands of strings.
        assert!(
            pool.strings.len() < FIRST_SWEEP * 3,
            "{}",
            pool.strings.len()
        );
        assert!(pool.strings.contains("intern-test-kept"));
        drop(kept);
    }

    #[test]
    fn serde_reads_and_writes_plain_strings() {
        #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
        struct T {
            #[serde(with = "opt")]
            a: Option<Name>,
            #[serde(with = "list")]
            b: Vec<Arc<str>>,
        }
        let t = T {
            a: Some("x".into()),
            b: vec!["y".into(), "z".into()],
        };
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(json, r#"{"a":"x","b":["y","z"]}"#);
        assert_eq!(serde_json::from_str::<T>(&json).unwrap(), t);
        let none: T = serde_json::from_str(r#"{"a":null,"b":[]}"#).unwrap();
        assert_eq!((none.a, none.b.len()), (None, 0));
    }
}
