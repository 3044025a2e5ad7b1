//! Counting the maps the kernel programs fill (socket reverse NAT, affinity, packet-path
//! flows), off the sync path.
//!
//! These are LRU maps of up to 262,144 entries; the only way to count them is to walk their
//! keys, one bpf() call per key (200-500 ms for a full map). A sync must never pay that, so
//! the walk runs on a low-priority thread of its own at most every [`CENSUS_PERIOD`], on
//! duplicated map handles, pausing between chunks, and stopping at each map's size (a walk
//! whose position was evicted restarts from the first key, so under churn it could
//! otherwise go on for ever). The counts are therefore up to a period old.

use std::{
    os::fd::AsFd as _,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use aya::{
    Pod,
    maps::{HashMap, IterableMap as _, Map, MapData, MapError},
};

use super::ServiceMaps;

/// How often the kernel-filled maps are counted.
pub const CENSUS_PERIOD: Duration = Duration::from_secs(30);
/// Keys walked between two pauses.
const CHUNK: usize = 4096;
const PAUSE: Duration = Duration::from_millis(2);

/// Entries of the maps the kernel programs fill, as last counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LruCounts {
    pub sock_revnat: usize,
    pub affinity: usize,
    /// Packet-path flow entries (two per flow).
    pub conntrack: usize,
}

/// Handles of their own on the kernel-filled maps, for a thread that counts them.
pub struct LruCensus {
    sock_revnat4: Walk,
    sock_revnat6: Walk,
    affinity: Walk,
    ct4: Walk,
    ct6: Walk,
}

/// One map's key walk, type-erased so the census holds maps of different key types.
struct Walk(Box<dyn Fn(&AtomicBool) -> usize + Send>);

impl Walk {
    fn new<K: Pod + Send + 'static, V: Pod + Send + 'static>(
        map: &HashMap<MapData, K, V>,
    ) -> Result<Self, MapError> {
        let max = map.map().info()?.max_entries() as usize;
        let own = own_handle(map)?;
        Ok(Walk(Box::new(move |stop: &AtomicBool| {
            let mut n = 0;
            for key in own.keys() {
                if key.is_err() || n >= max {
                    break;
                }
                n += 1;
                if n % CHUNK == 0 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    std::thread::sleep(PAUSE);
                }
            }
            n
        })))
    }
}

/// A handle of our own on the same map, for another thread.
pub(super) fn own_handle<K: Pod, V: Pod>(
    map: &HashMap<MapData, K, V>,
) -> Result<HashMap<MapData, K, V>, MapError> {
    HashMap::try_from(Map::from_map_data(own_data(map.map())?)?)
}

/// A duplicate of a map's descriptor.
pub(super) fn own_data(data: &MapData) -> Result<MapData, MapError> {
    let fd = data
        .fd()
        .as_fd()
        .try_clone_to_owned()
        .map_err(MapError::IoError)?;
    MapData::from_fd(fd)
}

impl ServiceMaps {
    /// Handles on the kernel-filled maps for [`LruCensus::count`] on another thread.
    pub fn lru_census(&self) -> Result<LruCensus, MapError> {
        Ok(LruCensus {
            sock_revnat4: Walk::new(&self.sock_revnat4)?,
            sock_revnat6: Walk::new(&self.sock_revnat6)?,
            affinity: Walk::new(&self.affinity)?,
            ct4: Walk::new(&self.ct4)?,
            ct6: Walk::new(&self.ct6)?,
        })
    }
}

impl LruCensus {
    /// Counts every map, each walk bounded by the map's size. Returns early (with partial
    /// counts) once `stop` is set.
    pub fn count(&self, stop: &AtomicBool) -> LruCounts {
        LruCounts {
            sock_revnat: (self.sock_revnat4.0)(stop) + (self.sock_revnat6.0)(stop),
            affinity: (self.affinity.0)(stop),
            conntrack: (self.ct4.0)(stop) + (self.ct6.0)(stop),
        }
    }

    /// Counts every [`CENSUS_PERIOD`] on a low-priority thread, calling `report` with each
    /// result, until the returned guard is dropped.
    pub fn spawn(
        self,
        report: impl Fn(LruCounts) + Send + 'static,
    ) -> std::io::Result<CensusThread> {
        let stop = Arc::new(AtomicBool::new(false));
        let (wake, sleep) = std::sync::mpsc::channel::<()>();
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("map-census".into())
            .spawn(move || {
                crate::dataplane::watcher::lower_priority();
                loop {
                    let counts = self.count(&flag);
                    if flag.load(Ordering::Relaxed) {
                        return;
                    }
                    report(counts);
                    // Woken early only to stop (the sender is dropped).
                    if sleep.recv_timeout(CENSUS_PERIOD)
                        != Err(std::sync::mpsc::RecvTimeoutError::Timeout)
                    {
                        return;
                    }
                }
            })?;
        Ok(CensusThread {
            stop,
            wake: Some(wake),
            thread: Some(thread),
        })
    }
}

/// The census thread; dropping it stops the thread and waits for it, so the map handles
/// are closed when it returns.
pub struct CensusThread {
    stop: Arc<AtomicBool>,
    wake: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for CensusThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        drop(self.wake.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
