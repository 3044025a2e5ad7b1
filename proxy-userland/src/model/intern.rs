//! One shared copy of the strings that repeat across the model: an endpoint's node name
//! and zone, and its zone hints. Every endpoint of a cluster names one of a few hundred
//! nodes; a `String` each was an allocation and 24 bytes per endpoint, about 0.5 KiB per
//! service of ten endpoints in the daemon's RSS (malloc's minimum chunk included).
//!
//! The pool forgets strings nobody else holds any more when it has doubled since it last
//! looked, so node names that come and go do not pile up.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
};

struct Pool {
    strings: HashSet<Arc<str>>,
    /// The pool's size that triggers the next sweep.
    sweep_at: usize,
}

const FIRST_SWEEP: usize = 1024;

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

/// The shared copy of `s`.
pub fn intern(s: &str) -> Arc<str> {
    // A panic while the lock was held cannot leave the set half-changed in a way that
    // matters: at worst a string is missing and gets a copy of its own.
    let mut guard = POOL.lock().unwrap_or_else(|p| p.into_inner());
    let pool = guard.get_or_insert_with(|| Pool {
        strings: HashSet::new(),
        sweep_at: FIRST_SWEEP,
    });
    if let Some(shared) = pool.strings.get(s) {
        return Arc::clone(shared);
    }
    if pool.strings.len() >= pool.sweep_at {
        pool.strings.retain(|k| Arc::strong_count(k) > 1);
        pool.sweep_at = (pool.strings.len() * 2).max(FIRST_SWEEP);
    }
    let shared: Arc<str> = Arc::from(s);
    pool.strings.insert(Arc::clone(&shared));
    shared
}

/// Serde for `Option<Arc<str>>` fields, interning what it reads (`#[serde(with)]`); the
/// workspace's serde has no `rc` feature, and turning it on would rebuild every crate that
/// uses serde.
pub mod opt {
    use std::sync::Arc;

    use serde::{Deserialize as _, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<Arc<str>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.serialize_some(&**v),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Arc<str>>, D::Error> {
        Ok(Option::<String>::deserialize(d)?.map(|v| super::intern(&v)))
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
            a: Option<Arc<str>>,
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
