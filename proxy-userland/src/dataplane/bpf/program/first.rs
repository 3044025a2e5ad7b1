//! The first sync into empty maps, with its map writes on a thread of their own (see
//! `maps::deferred`), and the way back to programming service by service if the kernel
//! refuses any of them.

use super::{Frontend, Programmer};
use crate::{
    dataplane::{Scope, SyncReport},
    model::{NodeInfo, ProxyState},
};

impl Programmer {
    /// A full sync whose service and backend writes a writer thread issues behind it. None
    /// when that cannot be done (no batch updates, no thread) or the kernel refused a
    /// write: then nothing of it is left, and the caller syncs service by service.
    pub(super) fn sync_deferred(
        &mut self,
        state: &ProxyState,
        node: &NodeInfo,
    ) -> Option<SyncReport> {
        let writer = self.maps.defer_writes()?;
        let outcome = std::thread::scope(|scope| {
            let spawned = std::thread::Builder::new()
                .name("map-writer".into())
                .spawn_scoped(scope, move || writer.run());
            let handle = match spawned {
                Ok(handle) => handle,
                Err(e) => {
                    self.maps.stop_deferring();
                    tracing::warn!("cannot start the map writer thread: {e}");
                    return None;
                }
            };
            let report = self.sync_now(state, node, Scope::Full);
            // Hands the writer the last entries and ends its queue.
            self.maps.stop_deferring();
            let written = handle
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the map writer panicked")));
            Some((report, written))
        });
        match outcome? {
            (report, Ok(())) => Some(report),
            (_, Err(e)) => {
                tracing::info!(
                    "the first sync's map writes failed ({e}); programming the services one by one"
                );
                self.forget_everything();
                None
            }
        }
    }

    /// Removes every frontend and backend this programmer wrote or queued, and what it
    /// knows of them.
    fn forget_everything(&mut self) {
        let all: Vec<Frontend> = self.frontends.keys().copied().collect();
        for fe in all {
            if let Err(e) = self.remove_frontend(&fe) {
                tracing::warn!(frontend = %fe, "removing it after the failed bulk write: {e}");
            }
        }
        // Nothing was ever served: no socket to reset.
        self.departed_udp.clear();
    }
}
