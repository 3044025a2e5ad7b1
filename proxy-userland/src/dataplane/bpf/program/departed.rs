//! Connected UDP sockets whose backend left their frontend: noted during a sync, reset
//! after it (see [`super::super::stale_sockets`]).

use std::{collections::BTreeSet, net::SocketAddr};

use super::{BackendAddr, Frontend, FrontendScope, Programmer, stale_sockets};
use crate::model::{Protocol, ServiceKey};

impl Programmer {
    pub(super) fn note_departed(
        &mut self,
        owner: &ServiceKey,
        fe: &Frontend,
        gone: impl IntoIterator<Item = BackendAddr>,
    ) {
        // Only sockets can be reset; the packet path re-picks for flows whose backend went.
        if fe.proto == Protocol::Udp && fe.scope == FrontendScope::Socket {
            let frontend = SocketAddr::new(fe.ip, fe.port);
            self.departed_udp.extend(
                gone.into_iter()
                    .map(|b| ((frontend, SocketAddr::new(b.ip, b.port)), owner.clone())),
            );
        }
    }

    /// Destroys connected UDP sockets our programs pointed at backends that just left their
    /// frontend (see [`stale_sockets`]). Returns (destroyed, failed). A reset that cannot be
    /// done leaves a client sending into the void, so each one is logged as a warning with
    /// its services and counted (`fastpath_udp_socket_resets_total{result="failed"}`): a
    /// socket the kernel refused counts once, and so does a client namespace that could not
    /// be searched at all (its sockets are unknown). The sync itself succeeded either way.
    pub(super) fn reset_departed_udp(&mut self) -> (usize, usize) {
        let departed = std::mem::take(&mut self.departed_udp);
        let Some(cgroup) = &self.cgroup else {
            return (0, 0);
        };
        if departed.is_empty() {
            return (0, 0);
        }
        let peers: BTreeSet<SocketAddr> = departed.keys().map(|(_, b)| *b).collect();
        let maps = &self.maps;
        let ours = |cookie: u64, peer: SocketAddr| {
            maps.translated_from(cookie, peer)
                .is_some_and(|fe| departed.contains_key(&(fe, peer)))
        };
        let services: BTreeSet<String> = departed.values().map(ToString::to_string).collect();
        let services = services.into_iter().collect::<Vec<_>>().join(",");
        let (mut done, mut failed) = (0, 0);
        let namespaces = stale_sockets::client_namespaces(cgroup);
        if namespaces.hidden > 0 {
            failed += namespaces.hidden;
            tracing::warn!(
                service = %services,
                processes = namespaces.hidden,
                "cannot reset connected UDP sockets of removed backends: processes in the cgroup \
                 are in a PID namespace this daemon cannot see (run it with hostPID: true); \
                 their sockets keep sending to a backend that is gone"
            );
        }
        for ns in namespaces.found {
            match stale_sockets::destroy_in(&ns, &peers, &ours) {
                Ok((r, err)) => {
                    done += r.done;
                    failed += r.failed;
                    if let Some(e) = err {
                        tracing::warn!(
                            service = %services,
                            sockets = r.failed,
                            "cannot reset connected UDP sockets of removed backends; they keep \
                             sending to a backend that is gone: {e}"
                        );
                    }
                }
                Err(e) => {
                    failed += 1;
                    tracing::warn!(
                        service = %services,
                        namespaces = 1,
                        "cannot reset connected UDP sockets of removed backends in a client \
                         namespace; any there keep sending to a backend that is gone: {e}"
                    );
                }
            }
        }
        if done > 0 {
            tracing::info!(service = %services, sockets = done, "reset connected UDP sockets of removed backends");
        }
        (done, failed)
    }
}
