//! What is programmed in the maps, and the diff that brings the maps to the model.
//!
//! Per frontend (address, port, protocol) the update order is Cilium's: backends first, then
//! the slots, then the master entry that publishes the new count, then the slots and
//! backends that are no longer referenced. A program racing with an update therefore sees
//! either the old or the new backend set, never a count that points at a missing slot. If a
//! write fails midway the frontend is rolled back to what it was, so a full map leaves the
//! service as it was and says so, instead of half-programmed.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::SocketAddr,
    path::PathBuf,
    time::{Duration, Instant},
};

use aya::maps::MapError;
use proxy_common::{BackendId, ServiceValue, service::flags};
use smallvec::SmallVec;
use thin_vec::ThinVec;

use super::{
    lb::LbConfig,
    maps::{Occupancy, ServiceMaps},
    stale_sockets,
};
// The frontend types and their derivation from the model are shared with the other
// dataplanes (see `dataplane::frontends`); re-exported where the eBPF code finds them.
pub use crate::dataplane::frontends::{
    BackendAddr, DesiredFrontend, Frontend, FrontendScope, desired_external_socket_frontends,
    desired_frontends, desired_packet_frontends, serving_udp_endpoints,
};
#[cfg(test)]
use crate::model::{EndpointSet, Service};
use crate::{
    dataplane::{Scope, SyncReport, frontends::frontend_name},
    model::{LbAlgorithm, NodeInfo, ProxyState, ServiceKey},
};

mod adopt;
mod departed;
mod first;
mod maglev;
mod table;

#[derive(Debug, thiserror::Error)]
pub enum ProgramError {
    #[error("{frontend} is already used by service {owner}")]
    Conflict { frontend: String, owner: ServiceKey },
    #[error("{frontend}: {count} backends is more than the {max} a frontend can hold")]
    TooManyBackends {
        frontend: String,
        count: usize,
        max: usize,
    },
    #[error("no free reverse-NAT index (65535 frontends programmed)")]
    RevNatExhausted,
    #[error("writing {what} for {frontend} failed: {source} (map full?)")]
    Map {
        what: &'static str,
        frontend: String,
        source: MapError,
    },
}

struct FrontendState {
    owner: ServiceKey,
    rev_nat_index: u16,
    /// What it is programmed as, but for the backends: those are `ids`, in order, and
    /// [`Programmer::backend_addrs`] gives their addresses. A list of the addresses beside
    /// the ids was ~13 MiB of the daemon's RSS at 50,000 frontends of ten backends.
    settings: Settings,
    /// Exactly as long as it holds: a `Vec` was 8 bytes more in every entry.
    ids: Box<[BackendId]>,
}

/// A [`DesiredFrontend`] without its backends.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Settings {
    affinity_timeout: Option<u32>,
    snat: bool,
    maglev: bool,
    dsr: bool,
    /// Almost always empty: one word, where a `Vec` is three, in each of 50,000 entries.
    source_ranges: ThinVec<(std::net::IpAddr, u8)>,
}

impl Settings {
    fn of(want: &DesiredFrontend) -> Self {
        Self {
            affinity_timeout: want.affinity_timeout,
            snat: want.snat,
            maglev: want.maglev,
            dsr: want.dsr,
            source_ranges: want.source_ranges.iter().copied().collect(),
        }
    }

    fn matches(&self, want: &DesiredFrontend) -> bool {
        self.affinity_timeout == want.affinity_timeout
            && self.snat == want.snat
            && self.maglev == want.maglev
            && self.dsr == want.dsr
            && self.source_ranges[..] == want.source_ranges[..]
    }
}

struct BackendRef {
    id: BackendId,
    refs: u32,
}

/// A pool of small integers, reusing freed ones first so ids stay dense.
struct IdPool {
    next: u32,
    max: u32,
    free: Vec<u32>,
}

impl IdPool {
    fn new(max: u32) -> Self {
        Self {
            next: 1,
            max,
            free: Vec::new(),
        }
    }

    fn alloc(&mut self) -> Option<u32> {
        self.free.pop().or_else(|| {
            (self.next <= self.max).then(|| {
                self.next += 1;
                self.next - 1
            })
        })
    }

    fn release(&mut self, id: u32) {
        self.free.push(id);
    }

    /// Marks `id` as taken (found in a pinned map).
    fn reserve(&mut self, id: u32) {
        if id >= self.next {
            self.free.extend(self.next..id);
            self.next = id + 1;
        } else {
            self.free.retain(|&f| f != id);
        }
    }
}

/// A service's frontends, sorted: almost always one or two, where a `BTreeSet` would
/// allocate a node for eleven (~250 bytes per service, 2.5 MB at 10,000 services). One is
/// held inline, as most services have one port and one family.
#[derive(Default)]
struct FrontendSet(SmallVec<[Frontend; 1]>);

impl FrontendSet {
    fn insert(&mut self, fe: Frontend) {
        if let Err(i) = self.0.binary_search(&fe) {
            self.0.insert(i, fe);
        }
    }

    fn remove(&mut self, fe: &Frontend) {
        if let Ok(i) = self.0.binary_search(fe) {
            self.0.remove(i);
        }
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn iter(&self) -> std::slice::Iter<'_, Frontend> {
        self.0.iter()
    }
}

/// The owner of frontends adopted from pinned maps until a service claims them; the first
/// full sync removes those nobody claims.
fn adopted() -> ServiceKey {
    ServiceKey::new("", "")
}

pub struct Programmer {
    maps: ServiceMaps,
    frontends: table::FrontendTable,
    owners: HashMap<ServiceKey, FrontendSet>,
    backends: HashMap<BackendAddr, BackendRef>,
    /// The inverse of `backends`: each id's address, by id (ids are dense).
    backend_addrs: Vec<Option<BackendAddr>>,
    backend_ids: IdPool,
    rev_nat_ids: IdPool,
    /// Where the programs are attached: whose sockets to reset.
    cgroup: Option<PathBuf>,
    /// (frontend, backend) pairs a UDP frontend lost during the current sync, and whose.
    departed_udp: BTreeMap<(SocketAddr, SocketAddr), ServiceKey>,
    /// Per service, per UDP socket frontend, the serving endpoints it is not programmed
    /// with (terminating ones while ready ones exist, those the traffic policy leaves out):
    /// sockets connected to them keep them until they stop serving, and are reset then.
    /// Only non-empty entries; see [`Programmer::track_lingering`].
    lingering: HashMap<ServiceKey, departed::Lingering>,
    /// Whether packet programs are attached, so node ports, external and load-balancer
    /// IPs get packet-scope frontends.
    packet_path: bool,
    lb: LbConfig,
    /// Frontends (by reverse-NAT index) whose Maglev table this process wrote: a table
    /// adopted from pinned maps may have another size or seed, and is rewritten once.
    maglev_written: HashSet<u16>,
}

impl Programmer {
    /// `cgroup`: where the programs are attached; None skips resetting UDP sockets.
    pub fn new(maps: ServiceMaps, cgroup: Option<PathBuf>) -> Self {
        // Ids are shared by both families' backend maps: as many as both hold, so the maps
        // (sized by --bpf-lb-map-max) are the limit and refuse what does not fit.
        let backend_ids = IdPool::new(maps.backend_capacity());
        Self {
            cgroup,
            departed_udp: BTreeMap::new(),
            lingering: HashMap::new(),
            packet_path: false,
            lb: LbConfig::default(),
            maglev_written: HashSet::new(),
            maps,
            frontends: Default::default(),
            owners: HashMap::new(),
            backends: HashMap::new(),
            backend_addrs: Vec::new(),
            backend_ids,
            rev_nat_ids: IdPool::new(u32::from(u16::MAX)),
        }
    }

    pub fn maps(&self) -> &ServiceMaps {
        &self.maps
    }

    pub fn maps_mut(&mut self) -> &mut ServiceMaps {
        &mut self.maps
    }

    /// The packet path's backend choice and forwarding mode, for frontends written from now
    /// on.
    pub fn set_lb(&mut self, lb: LbConfig) {
        self.lb = lb;
    }

    /// From now on, program the packet-scope frontends too (the tc programs are attached).
    pub fn enable_packet_path(&mut self) {
        self.packet_path = true;
    }

    /// Service and backend map entries, from what this programmer wrote (a master entry
    /// and a slot per backend for each frontend; one entry per distinct backend), so it
    /// costs no bpf() call. The kernel-filled maps are left at 0: see
    /// [`ServiceMaps::lru_census`].
    pub fn occupancy(&self) -> Occupancy {
        Occupancy {
            services: self.frontends.service_entries(),
            backends: self.backends.len(),
            affinity_match: self.frontends.affinity_entries(),
            ..Occupancy::default()
        }
    }

    /// The backends a frontend is programmed with, for tests and diagnostics.
    pub fn programmed(&self, fe: &Frontend) -> Option<Vec<BackendAddr>> {
        self.frontends.get(fe).map(|s| self.addrs_of(&s.ids))
    }

    /// The addresses of backends this programmer holds, in the order of `ids`.
    fn addrs_of(&self, ids: &[BackendId]) -> Vec<BackendAddr> {
        ids.iter().filter_map(|&id| self.addr_of(id)).collect()
    }

    fn addr_of(&self, id: BackendId) -> Option<BackendAddr> {
        self.backend_addrs.get(id as usize).copied().flatten()
    }

    /// What `st` is programmed as, in full.
    fn desired_of(&self, st: &FrontendState) -> DesiredFrontend {
        DesiredFrontend {
            backends: self.addrs_of(&st.ids),
            affinity_timeout: st.settings.affinity_timeout,
            snat: st.settings.snat,
            source_ranges: st.settings.source_ranges.to_vec(),
            maglev: st.settings.maglev,
            dsr: st.settings.dsr,
        }
    }

    /// Whether `st` is programmed exactly as `want`.
    fn is_programmed_as(&self, st: &FrontendState, want: &DesiredFrontend) -> bool {
        st.settings.matches(want)
            && st.ids.len() == want.backends.len()
            && (st.ids.iter().zip(&want.backends)).all(|(&id, b)| self.addr_of(id) == Some(*b))
    }

    /// Records `id` as `b`'s (acquired, or adopted from pinned maps).
    fn set_addr(&mut self, id: BackendId, b: BackendAddr) {
        let at = id as usize;
        if self.backend_addrs.len() <= at {
            self.backend_addrs.resize(at + 1, None);
        }
        self.backend_addrs[at] = Some(b);
    }

    pub fn frontend_count(&self) -> usize {
        self.frontends.len()
    }

    pub fn sync(&mut self, state: &ProxyState, node: &NodeInfo, scope: Scope<'_>) -> SyncReport {
        // The first sync into maps that hold nothing of ours lets its writes trail behind.
        if matches!(scope, Scope::Full)
            && self.frontends.is_empty()
            && self.backends.is_empty()
            && let Some(report) = self.sync_deferred(state, node)
        {
            return report;
        }
        self.sync_now(state, node, scope)
    }

    fn sync_now(&mut self, state: &ProxyState, node: &NodeInfo, scope: Scope<'_>) -> SyncReport {
        let keys: Vec<ServiceKey> = match scope {
            Scope::Full => {
                let mut all: BTreeSet<ServiceKey> = state.services.keys().cloned().collect();
                // Adopted frontends wait for their services to claim them; see below.
                all.extend(self.owners.keys().filter(|k| **k != adopted()).cloned());
                all.into_iter().collect()
            }
            Scope::Changed(set) => set.iter().cloned().collect(),
        };
        let mut report = SyncReport::default();
        // Where a full sync's time goes, for the debug log: deriving what each service
        // wants, and writing it.
        let (mut deriving, mut writing) = (Duration::ZERO, Duration::ZERO);
        for key in keys {
            let began = Instant::now();
            let (desired, serving) = state
                .services
                .get(&key)
                .map(|svc| {
                    let eps = state.endpoints.get(&key).map(|e| &**e);
                    let mut all = desired_frontends(svc, eps, node);
                    all.extend(desired_external_socket_frontends(svc, eps, node));
                    let serving = serving_udp_endpoints(svc, eps, all.keys());
                    if self.packet_path {
                        let mut packet = desired_packet_frontends(svc, eps, node);
                        let algorithm = svc.lb_algorithm.unwrap_or(self.lb.algorithm);
                        for (fe, want) in &mut packet {
                            want.maglev = algorithm == LbAlgorithm::Maglev;
                            want.dsr = want.snat && self.lb.mode.dsr_for(fe.proto);
                        }
                        all.extend(packet);
                    }
                    (all, serving)
                })
                .unwrap_or_default();
            report.services_synced += 1;
            // Before the writes, whose departures it filters.
            self.track_lingering(&key, &desired, serving);
            let derived = Instant::now();
            if let Err(e) = self.sync_service(&key, &desired, &mut report) {
                report.failed.push((key, e.to_string()));
            }
            deriving += derived - began;
            writing += derived.elapsed();
        }
        if matches!(scope, Scope::Full) {
            tracing::debug!(
                services = report.services_synced,
                ?deriving,
                ?writing,
                "full sync of the service maps"
            );
        }
        if matches!(scope, Scope::Full) {
            // Adopted frontends no service claimed belong to services deleted while no
            // daemon ran.
            let unclaimed: Vec<Frontend> = self
                .owners
                .get(&adopted())
                .map(|s| s.iter().copied().collect())
                .unwrap_or_default();
            for fe in unclaimed {
                match self.remove_frontend(&fe) {
                    Ok(()) => report.frontends_removed += 1,
                    Err(e) => report.failed.push((adopted(), e.to_string())),
                }
            }
        }
        (report.udp_sockets_reset, report.udp_socket_resets_failed) = self.reset_departed_udp();
        report
    }

    fn sync_service(
        &mut self,
        key: &ServiceKey,
        desired: &BTreeMap<Frontend, DesiredFrontend>,
        report: &mut SyncReport,
    ) -> Result<(), ProgramError> {
        // Refuse a frontend another service holds before writing anything.
        for fe in desired.keys() {
            if let Some(st) = self.frontends.get(fe)
                && st.owner != *key
                && st.owner != adopted()
            {
                return Err(ProgramError::Conflict {
                    frontend: frontend_name(fe),
                    owner: st.owner.clone(),
                });
            }
        }
        let mut written: Vec<(Frontend, Option<(ServiceKey, DesiredFrontend)>)> = Vec::new();
        for (fe, want) in desired {
            let before = self
                .frontends
                .get(fe)
                .map(|st| (st.owner.clone(), self.desired_of(st)));
            match self.write_frontend(key, fe, want) {
                Ok(true) => {
                    report.frontends_written += 1;
                    written.push((*fe, before));
                }
                Ok(false) => {}
                Err(e) => {
                    // All of the service or none of it: put back the frontends this sync
                    // already changed, so no port of it runs ahead of the others.
                    for (fe, before) in written.into_iter().rev() {
                        let undone = match before {
                            Some((owner, old)) => self.write_frontend(&owner, &fe, &old).map(drop),
                            None => self.remove_frontend(&fe),
                        };
                        if let Err(u) = undone {
                            tracing::error!(service = %key, frontend = %fe, "rolling back failed: {u}");
                        }
                        report.frontends_written -= 1;
                    }
                    return Err(e);
                }
            }
        }
        let stale: Vec<Frontend> = self
            .owners
            .get(key)
            .map(|set| {
                set.iter()
                    .filter(|fe| !desired.contains_key(fe))
                    .copied()
                    .collect()
            })
            .unwrap_or_default();
        for fe in stale {
            self.remove_frontend(&fe)?;
            report.frontends_removed += 1;
        }
        Ok(())
    }

    /// Writes one frontend if it differs from what is programmed; true if it wrote.
    fn write_frontend(
        &mut self,
        key: &ServiceKey,
        fe: &Frontend,
        want: &DesiredFrontend,
    ) -> Result<bool, ProgramError> {
        if let Some(old) = self.frontends.get(fe)
            && self.is_programmed_as(old, want)
        {
            let rev = old.rev_nat_index;
            if want.maglev && !self.maglev_written.contains(&rev) {
                let ids = old.ids.to_vec();
                self.write_maglev(fe, rev, &want.backends, &ids)?;
            }
            let Some(old) = self.frontends.get(fe) else {
                return Ok(false);
            };
            if old.owner != *key {
                // Adopted from pinned maps exactly as wanted: claim it, write nothing.
                let Some(previous) = self.frontends.set_owner(fe, key.clone()) else {
                    return Ok(false);
                };
                self.disown(&previous, fe);
                self.owners.entry(key.clone()).or_default().insert(*fe);
            }
            return Ok(false);
        }
        let old = self.frontends.get(fe);
        let max = usize::from(u16::MAX);
        if want.backends.len() > max {
            return Err(ProgramError::TooManyBackends {
                frontend: frontend_name(fe),
                count: want.backends.len(),
                max,
            });
        }
        let (old_ids, old_backends, old_ranges) = old
            .map(|o| {
                (
                    o.ids.to_vec(),
                    self.addrs_of(&o.ids),
                    o.settings.source_ranges.to_vec(),
                )
            })
            .unwrap_or_default();
        let old_owner = old.map(|o| o.owner.clone());
        let had_maglev = old.is_some_and(|o| o.settings.maglev);
        let had_affinity = old.is_some_and(|o| o.settings.affinity_timeout.is_some());
        let (rev_nat_index, new_rev) = match old {
            Some(o) => (o.rev_nat_index, false),
            None => (
                self.rev_nat_ids
                    .alloc()
                    .ok_or(ProgramError::RevNatExhausted)? as u16,
                true,
            ),
        };

        let old_matched: &[BackendId] = if had_affinity { &old_ids } else { &[] };
        let result = self.publish(fe, want, rev_nat_index, &old_ids, old_matched, &old_ranges);
        let ids = match result {
            Ok(ids) => ids,
            Err(e) => {
                if new_rev {
                    self.rev_nat_ids.release(u32::from(rev_nat_index));
                }
                return Err(e);
            }
        };

        // Readers now use the new set: drop what it no longer needs.
        if !want.maglev
            && had_maglev
            && let Err(e) = self.drop_maglev(fe, rev_nat_index)
        {
            tracing::warn!(frontend = %fe, "{e}");
        }
        let kept: BTreeSet<BackendId> = ids.iter().copied().collect();
        let gone: BTreeSet<BackendId> = old_ids
            .iter()
            .copied()
            .filter(|id| !kept.contains(id))
            .collect();
        // Affinity entries naming a backend that left are ignored from now on. With affinity
        // off, none is honoured, and none may be when it comes back on: the backends may
        // have left meanwhile, or their ids gone to another service's.
        if had_affinity {
            let stale: Vec<BackendId> = if want.affinity_timeout.is_none() {
                old_ids.clone()
            } else {
                gone.iter().copied().collect()
            };
            self.maps.del_affinity_matches(rev_nat_index, &stale);
        }
        for slot in ids.len() + 1..=old_ids.len() {
            let _ = self.maps.del_service(fe, slot as u16);
        }
        let dropped: Vec<_> = old_ranges
            .iter()
            .filter(|r| !want.source_ranges.contains(r))
            .copied()
            .collect();
        self.maps.del_source_ranges(rev_nat_index, &dropped);
        let gone: Vec<BackendAddr> =
            // `want.backends` is sorted (see desired_frontends).
            old_backends.iter().filter(|b| want.backends.binary_search(b).is_err()).copied().collect();
        self.note_departed(key, fe, gone);
        for b in &old_backends {
            self.release_backend(b);
        }
        if let Some(previous) = old_owner.filter(|o| o != key) {
            self.disown(&previous, fe);
        }
        self.frontends.insert(
            *fe,
            FrontendState {
                owner: key.clone(),
                rev_nat_index,
                settings: Settings::of(want),
                ids: ids.into(),
            },
        );
        self.owners.entry(key.clone()).or_default().insert(*fe);
        Ok(true)
    }

    /// Backends, slots, then the master entry. On failure everything written is undone and
    /// the frontend reads exactly as before.
    fn publish(
        &mut self,
        fe: &Frontend,
        want: &DesiredFrontend,
        rev_nat_index: u16,
        old_ids: &[BackendId],
        old_matched: &[BackendId],
        old_ranges: &[(std::net::IpAddr, u8)],
    ) -> Result<Vec<BackendId>, ProgramError> {
        // The table this frontend had, to put back if the write fails.
        let old_maglev: Option<Vec<BackendId>> = self
            .frontends
            .get(fe)
            .filter(|o| o.settings.maglev)
            .map(|_| old_ids.to_vec());
        let mut ids = Vec::with_capacity(want.backends.len());
        let added_ranges: Vec<_> = want
            .source_ranges
            .iter()
            .filter(|r| !old_ranges.contains(r))
            .copied()
            .collect();
        let mut matched = Vec::new();
        let undo = |this: &mut Self, ids: &[BackendId], matched: &[BackendId], slots_written| {
            if want.maglev {
                this.restore_maglev(fe, rev_nat_index, old_maglev.as_deref());
            }
            this.maps.del_source_ranges(rev_nat_index, &added_ranges);
            this.maps.del_affinity_matches(rev_nat_index, matched);
            for slot in 1..=slots_written {
                match old_ids.get(slot - 1) {
                    Some(&id) => {
                        let _ = this
                            .maps
                            .put_service(fe, slot as u16, ServiceValue::slot(id));
                    }
                    None => {
                        let _ = this.maps.del_service(fe, slot as u16);
                    }
                }
            }
            for b in &want.backends[..ids.len()] {
                this.release_backend(b);
            }
        };
        // Ids first, then the backends no other frontend has written in one bpf() call.
        let mut fresh = Vec::new();
        let mut acquired = Ok(());
        for b in &want.backends {
            match self.acquire_backend(b) {
                Some((id, new)) => {
                    ids.push(id);
                    if new {
                        fresh.push((id, *b));
                    }
                }
                None => {
                    acquired = Err(MapError::OutOfBounds {
                        index: self.backend_ids.max,
                        max_entries: self.backend_ids.max,
                    });
                    break;
                }
            }
        }
        if let Err(source) = acquired.and_then(|()| self.maps.put_backends(&fresh)) {
            undo(self, &ids, &matched, 0);
            return Err(ProgramError::Map {
                what: "a backend",
                frontend: frontend_name(fe),
                source,
            });
        }
        if want.affinity_timeout.is_some() {
            let before: BTreeSet<BackendId> = old_matched.iter().copied().collect();
            matched = ids
                .iter()
                .copied()
                .filter(|id| !before.contains(id))
                .collect();
            if let Err(source) = self.maps.put_affinity_matches(rev_nat_index, &matched) {
                undo(self, &ids, &matched, 0);
                return Err(ProgramError::Map {
                    what: "the affinity backends",
                    frontend: frontend_name(fe),
                    source,
                });
            }
        }
        // Before the master names the table, so new flows find it in place.
        if want.maglev
            && let Err(e) = self.write_maglev(fe, rev_nat_index, &want.backends, &ids)
        {
            undo(self, &ids, &matched, 0);
            return Err(e);
        }
        let (mut flag_bits, timeout) = match want.affinity_timeout {
            Some(t) => (flags::AFFINITY, t),
            None => (0, 0),
        };
        if want.snat {
            flag_bits |= flags::SNAT;
        }
        if !want.source_ranges.is_empty() {
            flag_bits |= flags::SOURCE_RANGES;
        }
        if want.maglev {
            flag_bits |= flags::MAGLEV;
        }
        if want.dsr {
            flag_bits |= flags::DSR;
        }
        let master = ServiceValue::master(ids.len() as u16, rev_nat_index, flag_bits, timeout);
        let mut slots: Vec<(u16, ServiceValue)> = ids
            .iter()
            .enumerate()
            .filter(|&(i, id)| old_ids.get(i) != Some(id))
            .map(|(i, &id)| ((i + 1) as u16, ServiceValue::slot(id)))
            .collect();
        // Without new source ranges to write in between, the master goes last in the slots'
        // own batch: the kernel writes a batch in order and stops at the first entry it
        // refuses, so the master is still published after every slot, in one bpf() call
        // where there were two (a third of a first sync's calls).
        let master_in_batch = added_ranges.is_empty();
        if master_in_batch {
            slots.push((0, master));
        }
        if let Err(source) = self.maps.put_slots(fe, &slots) {
            // Any of them may be written: put every slot back.
            undo(self, &ids, &matched, ids.len());
            return Err(ProgramError::Map {
                what: if master_in_batch {
                    "a backend slot or the master entry"
                } else {
                    "a backend slot"
                },
                frontend: frontend_name(fe),
                source,
            });
        }
        if master_in_batch {
            return Ok(ids);
        }
        if let Err(source) = self.maps.put_source_ranges(rev_nat_index, &added_ranges) {
            undo(self, &ids, &matched, ids.len());
            return Err(ProgramError::Map {
                what: "the source ranges",
                frontend: frontend_name(fe),
                source,
            });
        }
        if let Err(source) = self.maps.put_service(fe, 0, master) {
            undo(self, &ids, &matched, ids.len());
            return Err(ProgramError::Map {
                what: "the master entry",
                frontend: frontend_name(fe),
                source,
            });
        }
        Ok(ids)
    }

    /// Master first, so lookups stop at once; then the slots and backends behind it.
    fn remove_frontend(&mut self, fe: &Frontend) -> Result<(), ProgramError> {
        let Some(st) = self.frontends.remove(fe) else {
            return Ok(());
        };
        let map_err = |source| ProgramError::Map {
            what: "removing the master entry",
            frontend: frontend_name(fe),
            source,
        };
        if let Err(e) = self.maps.del_service(fe, 0) {
            self.frontends.insert(*fe, st);
            return Err(map_err(e));
        }
        for slot in 1..=st.ids.len() {
            let _ = self.maps.del_service(fe, slot as u16);
        }
        let backends = self.addrs_of(&st.ids);
        for b in &backends {
            self.release_backend(b);
        }
        self.maps
            .del_source_ranges(st.rev_nat_index, &st.settings.source_ranges);
        self.note_departed(&st.owner, fe, backends);
        if st.settings.affinity_timeout.is_some() {
            self.maps.del_affinity_matches(st.rev_nat_index, &st.ids);
        }
        if st.settings.maglev
            && let Err(e) = self.drop_maglev(fe, st.rev_nat_index)
        {
            tracing::warn!(frontend = %fe, "{e}");
        }
        self.rev_nat_ids.release(u32::from(st.rev_nat_index));
        self.disown(&st.owner, fe);
        Ok(())
    }

    fn disown(&mut self, owner: &ServiceKey, fe: &Frontend) {
        if let Some(set) = self.owners.get_mut(owner) {
            set.remove(fe);
            if set.is_empty() {
                self.owners.remove(owner);
            }
        }
    }

    /// The backend's id, and whether it is new (not yet in the map: the caller writes it).
    /// None when every id is taken.
    fn acquire_backend(&mut self, b: &BackendAddr) -> Option<(BackendId, bool)> {
        if let Some(r) = self.backends.get_mut(b) {
            r.refs += 1;
            return Some((r.id, false));
        }
        let id = self.backend_ids.alloc()?;
        self.backends.insert(*b, BackendRef { id, refs: 1 });
        self.set_addr(id, *b);
        Some((id, true))
    }

    fn release_backend(&mut self, b: &BackendAddr) {
        let Some(r) = self.backends.get_mut(b) else {
            return;
        };
        r.refs -= 1;
        if r.refs == 0 {
            let id = r.id;
            self.backends.remove(b);
            if let Some(addr) = self.backend_addrs.get_mut(id as usize) {
                *addr = None;
            }
            let _ = self.maps.del_backend(id, b);
            self.backend_ids.release(id);
        }
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::model::{Endpoint, Protocol, ServicePort, SliceInfo, SlicePort};

    #[test]
    fn the_programmers_tables_stay_compact() {
        // One entry per frontend and per service: at 50,000 services each byte here is
        // ~64 KiB of the daemon's RSS (the tables' buckets round up to a power of two).
        let frontend = std::mem::size_of::<(Frontend, FrontendState)>();
        let owner = std::mem::size_of::<(ServiceKey, FrontendSet)>();
        assert!(frontend <= 104, "a frontend's entry is {frontend} bytes");
        assert!(owner <= 64, "a service's entry is {owner} bytes");
    }

    fn ep(ip: &str, ready: bool, terminating: bool) -> Endpoint {
        Endpoint {
            ip: ip.parse().unwrap(),
            ready,
            serving: ready || terminating,
            terminating,
            placement: crate::model::endpoint::Where::on_node("node-a").into(),
        }
    }

    fn svc(cluster_ips: &[&str]) -> Service {
        Service {
            key: ServiceKey::new("demo", "web"),
            cluster_ips: cluster_ips.iter().map(|ip| ip.parse().unwrap()).collect(),
            ports: vec![
                ServicePort {
                    name: "http".into(),
                    port: 80,
                    protocol: Protocol::Tcp,
                    node_port: None,
                },
                ServicePort {
                    name: "dns".into(),
                    port: 53,
                    protocol: Protocol::Udp,
                    node_port: None,
                },
            ],
            external_ips: vec![],
            load_balancer_ips: vec![],
            load_balancer_source_ranges: vec![],
            affinity_timeout: Some(600),
            external_policy_local: false,
            internal_policy_local: false,
            health_check_node_port: None,
            prefer_close: false,
            lb_algorithm: None,
        }
    }

    fn set(endpoints: Vec<Endpoint>) -> EndpointSet {
        let ports = vec![
            SlicePort {
                name: "http".into(),
                port: 8080,
                protocol: Protocol::Tcp,
            },
            SlicePort {
                name: "dns".into(),
                port: 5353,
                protocol: Protocol::Udp,
            },
        ];
        EndpointSet {
            slices: crate::model::Slices::from([("s".into(), SliceInfo { ports, endpoints })]),
        }
    }

    fn node() -> NodeInfo {
        NodeInfo {
            name: "node-a".into(),
            zone: None,
        }
    }

    fn fe(ip: &str, port: u16, proto: Protocol) -> Frontend {
        Frontend::socket(ip.parse().unwrap(), port, proto)
    }

    fn be(ip: &str, port: u16, proto: Protocol) -> BackendAddr {
        BackendAddr {
            ip: ip.parse().unwrap(),
            port,
            proto,
            local: true,
        }
    }

    #[test]
    fn each_cluster_ip_and_port_is_a_frontend_with_its_target_ports() {
        let eps = set(vec![
            ep("198.18.1.12", true, false),
            ep("198.18.1.11", true, false),
        ]);
        let d = desired_frontends(&svc(&["198.19.0.10"]), Some(&eps), &node());
        assert_eq!(d.len(), 2);
        let http = &d[&fe("198.19.0.10", 80, Protocol::Tcp)];
        // Sorted, so the same endpoints always land in the same slots.
        assert_eq!(
            http.backends,
            vec![
                be("198.18.1.11", 8080, Protocol::Tcp),
                be("198.18.1.12", 8080, Protocol::Tcp)
            ]
        );
        assert_eq!(http.affinity_timeout, Some(600));
        let dns = &d[&fe("198.19.0.10", 53, Protocol::Udp)];
        assert_eq!(dns.backends[0], be("198.18.1.11", 5353, Protocol::Udp));
    }

    #[test]
    fn dual_stack_frontends_only_get_backends_of_their_family() {
        let eps = set(vec![
            ep("198.18.1.11", true, false),
            ep("2001:db8::11", true, false),
        ]);
        let d = desired_frontends(
            &svc(&["198.19.0.10", "2001:db8:1::10"]),
            Some(&eps),
            &node(),
        );
        assert_eq!(d.len(), 4);
        assert_eq!(
            d[&fe("198.19.0.10", 80, Protocol::Tcp)].backends,
            vec![be("198.18.1.11", 8080, Protocol::Tcp)]
        );
        assert_eq!(
            d[&fe("2001:db8:1::10", 80, Protocol::Tcp)].backends,
            vec![be("2001:db8::11", 8080, Protocol::Tcp)]
        );
    }

    #[test]
    fn no_endpoints_still_makes_a_frontend_so_it_is_refused() {
        let d = desired_frontends(&svc(&["198.19.0.10"]), None, &node());
        assert_eq!(d.len(), 2);
        assert!(d.values().all(|f| f.backends.is_empty()));
    }

    #[test]
    fn terminating_endpoints_serve_only_when_nothing_is_ready() {
        let eps = set(vec![
            ep("198.18.1.11", true, false),
            ep("198.18.1.12", false, true),
        ]);
        let d = desired_frontends(&svc(&["198.19.0.10"]), Some(&eps), &node());
        assert_eq!(d[&fe("198.19.0.10", 80, Protocol::Tcp)].backends.len(), 1);

        let draining = set(vec![ep("198.18.1.12", false, true)]);
        let d = desired_frontends(&svc(&["198.19.0.10"]), Some(&draining), &node());
        assert_eq!(
            d[&fe("198.19.0.10", 80, Protocol::Tcp)].backends,
            vec![be("198.18.1.12", 8080, Protocol::Tcp)],
            "a draining backend beats refusing every connection"
        );
    }

    #[test]
    fn id_pool_reuses_freed_ids_and_stops_at_its_max() {
        let mut pool = IdPool::new(3);
        assert_eq!(
            (pool.alloc(), pool.alloc(), pool.alloc(), pool.alloc()),
            (Some(1), Some(2), Some(3), None)
        );
        pool.release(2);
        assert_eq!(pool.alloc(), Some(2));
    }
}
