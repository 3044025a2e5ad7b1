//! Connected UDP sockets whose backend stopped serving their frontend: noted during a
//! sync, reset after it (see [`super::super::stale_sockets`]).
//!
//! A backend leaving the programmed set is not enough: a terminating endpoint that still
//! serves drops out of it while ready ones exist, but kube-proxy keeps its existing flows
//! until it leaves the slice or stops serving (pkg/proxy/conntrack/cleanup.go). So the
//! programmer remembers, per service, the serving endpoints beyond the programmed ones
//! ("lingering"), and a socket is reset only once its backend is in neither set.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
};

use super::{BackendAddr, DesiredFrontend, Frontend, FrontendScope, Programmer, stale_sockets};
use crate::model::{Protocol, ServiceKey};

/// One service's UDP socket frontends and their serving endpoints beyond the programmed
/// backends.
pub(super) type Lingering = BTreeMap<Frontend, BTreeSet<SocketAddr>>;

fn addr(b: &BackendAddr) -> SocketAddr {
    SocketAddr::new(b.ip, b.port)
}

impl Programmer {
    /// Records service `key`'s lingering endpoints as of this sync (`serving`: every
    /// serving endpoint of its UDP socket frontends, see
    /// [`super::serving_udp_endpoints`]) and notes those of the last sync that serve no
    /// more. Costs the service's own entries only.
    pub(super) fn track_lingering(
        &mut self,
        key: &ServiceKey,
        desired: &BTreeMap<Frontend, DesiredFrontend>,
        serving: BTreeMap<Frontend, BTreeSet<SocketAddr>>,
    ) {
        let programmed = |fe: &Frontend, a: &SocketAddr| {
            desired
                .get(fe)
                .is_some_and(|d| d.backends.iter().any(|b| addr(b) == *a))
        };
        let now: Lingering = serving
            .into_iter()
            .filter_map(|(fe, all)| {
                let extra: BTreeSet<SocketAddr> =
                    all.into_iter().filter(|a| !programmed(&fe, a)).collect();
                (!extra.is_empty()).then_some((fe, extra))
            })
            .collect();
        for (fe, before) in self.lingering.remove(key).unwrap_or_default() {
            let gone: Vec<SocketAddr> = before
                .into_iter()
                .filter(|a| !programmed(&fe, a) && !now.get(&fe).is_some_and(|n| n.contains(a)))
                .collect();
            self.note_departed_addrs(key, &fe, gone);
        }
        if !now.is_empty() {
            self.lingering.insert(key.clone(), now);
        }
    }

    /// Notes backends that left frontend `fe`'s programmed set; those that still serve it
    /// (lingering, see [`Programmer::track_lingering`], called first) keep their sockets.
    pub(super) fn note_departed(
        &mut self,
        owner: &ServiceKey,
        fe: &Frontend,
        gone: impl IntoIterator<Item = BackendAddr>,
    ) {
        let lingering = self.lingering.get(owner).and_then(|l| l.get(fe));
        let gone: Vec<SocketAddr> = gone
            .into_iter()
            .map(|b| addr(&b))
            .filter(|a| !lingering.is_some_and(|l| l.contains(a)))
            .collect();
        self.note_departed_addrs(owner, fe, gone);
    }

    fn note_departed_addrs(&mut self, owner: &ServiceKey, fe: &Frontend, gone: Vec<SocketAddr>) {
        // Only sockets can be reset; the packet path re-picks for flows whose backend went.
        if fe.proto == Protocol::Udp && fe.scope == FrontendScope::Socket {
            let frontend = SocketAddr::new(fe.ip, fe.port);
            self.departed_udp
                .extend(gone.into_iter().map(|b| ((frontend, b), owner.clone())));
        }
    }

    /// Moves connected UDP sockets our programs pointed at backends that just left their
    /// frontend to live ones, or else destroys them (see [`stale_sockets`]). Returns
    /// (moved or destroyed, failed). A reset that cannot be
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
        let frontend_of = |cookie: u64, peer: SocketAddr| {
            maps.translated_from(cookie, peer)
                .filter(|fe| departed.contains_key(&(*fe, peer)))
        };
        let services: BTreeSet<String> = departed.values().map(ToString::to_string).collect();
        let services = services.into_iter().collect::<Vec<_>>().join(",");
        let (mut done, mut failed, mut repointed) = (0, 0, 0);
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
        if let Some(e) = &namespaces.unopened_error {
            failed += namespaces.unopened;
            tracing::warn!(
                service = %services,
                processes = namespaces.unopened,
                "cannot reset connected UDP sockets of removed backends: the network \
                 namespace of processes in the cgroup cannot be opened ({e}; without \
                 CAP_SYS_PTRACE, that of a process with another uid or capabilities the daemon \
                 lacks); their sockets keep sending to a backend that is gone"
            );
        }
        for ns in namespaces.found {
            match stale_sockets::destroy_in(&ns, &peers, &frontend_of) {
                Ok((r, err)) => {
                    repointed += r.repointed;
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
        if repointed > 0 {
            tracing::info!(service = %services, sockets = repointed, "moved connected UDP sockets of removed backends to live ones");
        }
        if done > 0 {
            tracing::info!(service = %services, sockets = done, "reset connected UDP sockets of removed backends");
        }
        (done + repointed, failed)
    }
}
