//! Writing many entries of one map in one bpf() call (`BPF_MAP_UPDATE_BATCH`, Linux 5.6),
//! and reading them so ([`read_all`], `BPF_MAP_LOOKUP_BATCH`).
//!
//! A frontend is a backend entry per new backend, a slot per backend and a master entry: one
//! bpf() call each was ~21 calls a service, most of a first sync's time at 50,000 services.
//! aya 0.14 has no batch API, so the command is issued here on the map's descriptor. A kernel
//! without it (EINVAL, ENOTSUPP) gets the entries one call each, and is not asked again.
//! The kernel stops at the first entry it refuses (ENOMEM, E2BIG for a full map), keeping the
//! ones before it: callers undo the whole write, as they do when a single entry fails.

use std::{
    io,
    net::IpAddr,
    os::fd::{AsFd as _, AsRawFd as _, RawFd},
    sync::atomic::{AtomicBool, Ordering},
};

use aya::{
    Pod,
    maps::{HashMap, IterableMap as _, MapData, MapError},
    sys::SyscallError,
};
use proxy_common::{BackendId, ServiceValue};

use super::ServiceMaps;
use crate::dataplane::frontends::{BackendAddr, Frontend};

/// `enum bpf_cmd` in linux/bpf.h.
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
/// Entries a [`read_all`] call asks for at once: a few hundred kilobytes of buffers for the
/// largest flow-table entries, and far more than one hash bucket ever holds.
const READ_CHUNK: usize = 4096;
/// The kernel's internal "not supported" (not in libc), returned for map types without a
/// batch operation.
const ENOTSUPP: i32 = 524;

/// Set once the kernel refused the command itself; every write then goes one entry a call.
static UNSUPPORTED: AtomicBool = AtomicBool::new(false);

/// The `batch` member of `union bpf_attr` (linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Inserts (or replaces) `keys[i] -> values[i]` for every i, in order.
pub fn insert_all<K: Pod, V: Pod>(
    map: &mut HashMap<MapData, K, V>,
    keys: &[K],
    values: &[V],
) -> Result<(), MapError> {
    debug_assert_eq!(keys.len(), values.len());
    if keys.len() > 1 && !UNSUPPORTED.load(Ordering::Relaxed) {
        match update_batch(map.map(), keys, values) {
            Ok(()) => return Ok(()),
            Err(e) => match e.raw_os_error() {
                Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP) => {
                    tracing::info!(
                        "the kernel has no BPF_MAP_UPDATE_BATCH ({e}): map entries are written one at a time"
                    );
                    UNSUPPORTED.store(true, Ordering::Relaxed);
                }
                _ => {
                    return Err(MapError::SyscallError(SyscallError {
                        call: "bpf_map_update_batch",
                        io_error: e,
                    }));
                }
            },
        }
    }
    keys.iter()
        .zip(values)
        .try_for_each(|(k, v)| map.insert(k, v, 0))
}

/// Whether batch updates may be tried (none has been refused as unknown).
pub fn supported() -> bool {
    !UNSUPPORTED.load(Ordering::Relaxed)
}

/// One `BPF_MAP_UPDATE_BATCH`.
fn update_batch<K: Pod, V: Pod>(map: &MapData, keys: &[K], values: &[V]) -> io::Result<()> {
    update_batch_fd(map.fd().as_fd().as_raw_fd(), keys, values)
}

/// One `BPF_MAP_UPDATE_BATCH` on the map behind `fd`, which must be open for the call and
/// whose key and value types are `K` and `V`; nothing for no entries. An unknown command
/// (an old kernel) is remembered, so that [`supported`] says so.
pub fn update_batch_fd<K: Pod, V: Pod>(fd: RawFd, keys: &[K], values: &[V]) -> io::Result<()> {
    if keys.is_empty() {
        return Ok(());
    }
    let count = u32::try_from(keys.len().min(values.len()))
        .map_err(|_| io::Error::from_raw_os_error(libc::E2BIG))?;
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count,
        map_fd: fd as u32,
        ..BatchAttr::default()
    };
    // SAFETY: `keys` and `values` are `Pod` slices of `count` entries of the map's key and
    // value types that outlive the call; the kernel only reads them, and writes the number
    // of entries done back into `attr.count`, unread.
    let Err(e) = (unsafe { batch_call(BPF_MAP_UPDATE_BATCH, &mut attr) }) else {
        return Ok(());
    };
    if matches!(
        e.raw_os_error(),
        Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP)
    ) {
        UNSUPPORTED.store(true, Ordering::Relaxed);
    }
    Err(e)
}

/// Calls `each` with every entry of `map`, a hash map, until it returns false; Err: a
/// batch read failed (an old kernel refuses the first: EINVAL), maybe after some entries
/// went to `each`, and the caller walks the map key by key instead. A bpf() call reads
/// [`READ_CHUNK`] entries where a walk by keys makes two per entry: reading a full
/// 262,144-entry table takes 64 calls instead of about half a million.
///
/// Each bucket is read whole, once: entries that programs add or delete meanwhile are seen
/// or not, but none twice, where a walk by keys starts over when its key is deleted.
pub fn read_all<K: Pod + Default, V: Pod + Default>(
    map: &MapData,
    mut each: impl FnMut(K, V) -> bool,
) -> io::Result<()> {
    let fd = map.fd().as_fd().as_raw_fd();
    let mut keys = vec![K::default(); READ_CHUNK];
    let mut values = vec![V::default(); READ_CHUNK];
    let mut cursor: Option<u32> = None;
    loop {
        let (n, more, next) = lookup_batch(fd, cursor, &mut keys, &mut values)?;
        for (k, v) in keys.iter().zip(&values).take(n) {
            if !each(*k, *v) {
                return Ok(());
            }
        }
        if !more {
            return Ok(());
        }
        cursor = Some(next);
    }
}

/// One `BPF_MAP_LOOKUP_BATCH` from bucket `cursor` (None: the first): how many entries it
/// wrote into `keys` and `values`, whether buckets are left, and the next one.
fn lookup_batch<K: Pod, V: Pod>(
    fd: RawFd,
    cursor: Option<u32>,
    keys: &mut [K],
    values: &mut [V],
) -> io::Result<(usize, bool, u32)> {
    let in_batch = cursor.unwrap_or(0);
    let mut out_batch = 0u32;
    let capacity = keys.len().min(values.len());
    let mut attr = BatchAttr {
        in_batch: cursor.map_or(0, |_| &in_batch as *const u32 as u64),
        out_batch: &mut out_batch as *mut u32 as u64,
        keys: keys.as_mut_ptr() as u64,
        values: values.as_mut_ptr() as u64,
        count: u32::try_from(capacity).unwrap_or(u32::MAX),
        map_fd: fd as u32,
        ..BatchAttr::default()
    };
    // SAFETY: a hash map's batch token is a u32 bucket index: `in_batch` (read) and
    // `out_batch` (written) point at live u32s. `keys` and `values` are writable `Pod`
    // slices of at least `count` entries of the map's key and value types; the kernel
    // writes at most `count` of each, and the number written into `attr.count`.
    let done = unsafe { batch_call(BPF_MAP_LOOKUP_BATCH, &mut attr) };
    let n = (attr.count as usize).min(capacity);
    let Err(e) = done else {
        return Ok((n, true, out_batch));
    };
    match e.raw_os_error() {
        // The last buckets were read.
        Some(libc::ENOENT) => Ok((n, false, out_batch)),
        _ => Err(e),
    }
}

/// bpf(2) with `cmd`, one of the batch commands, and `attr`.
///
/// # Safety
///
/// Every pointer in `attr` must be valid for what `cmd` does with it (read or written,
/// `count` entries of the map's key and value types) for the whole call.
unsafe fn batch_call(cmd: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: `attr` is the kernel's `bpf_attr.batch` layout (a prefix of the union, whose
    // size is passed), live and writable for the call; what it points at is the caller's
    // promise.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut BatchAttr,
            std::mem::size_of::<BatchAttr>(),
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl ServiceMaps {
    /// Backend entries; see [`insert_all`]. On failure, some of them may be written.
    pub fn put_backends(&mut self, entries: &[(BackendId, BackendAddr)]) -> Result<(), MapError> {
        if let Some(q) = &mut self.deferred {
            q.backends(entries);
            return Ok(());
        }
        let (mut ids4, mut values4, mut ids6, mut values6) = (vec![], vec![], vec![], vec![]);
        for (id, b) in entries {
            match b.ip {
                IpAddr::V4(ip) => {
                    ids4.push(*id);
                    values4.push(super::backend4(ip, b));
                }
                IpAddr::V6(ip) => {
                    ids6.push(*id);
                    values6.push(super::backend6(ip, b));
                }
            }
        }
        insert_all(&mut self.backends4, &ids4, &values4)?;
        insert_all(&mut self.backends6, &ids6, &values6)
    }

    /// Slots `(slot, value)` of one frontend, in order (slot 0, the master, may come last);
    /// see [`insert_all`].
    pub fn put_slots(
        &mut self,
        fe: &Frontend,
        slots: &[(u16, ServiceValue)],
    ) -> Result<(), MapError> {
        if slots.iter().any(|(slot, _)| *slot == 0) {
            self.front_filter.master_put(fe)?;
        }
        if let Some(q) = &mut self.deferred {
            for &(slot, value) in slots {
                q.service(fe, slot, value);
            }
            return Ok(());
        }
        let values: Vec<_> = slots.iter().map(|(_, v)| *v).collect();
        match fe.ip {
            IpAddr::V4(ip) => {
                let keys: Vec<_> = slots.iter().map(|(s, _)| super::key4(fe, ip, *s)).collect();
                insert_all(&mut self.services4, &keys, &values)
            }
            IpAddr::V6(ip) => {
                let keys: Vec<_> = slots.iter().map(|(s, _)| super::key6(fe, ip, *s)).collect();
                insert_all(&mut self.services6, &keys, &values)
            }
        }
    }
}
