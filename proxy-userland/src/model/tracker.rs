//! The current cluster state and what changed since the last sync.
//!
//! This is kube-proxy's ServiceChangeTracker and EndpointsChangeTracker in one. Sources feed
//! it object by object (a watch) or whole lists (a file re-read, a relist after the API
//! server said 410 Gone); a sync loop takes a snapshot plus the set of services to
//! reprogram. Recording only real changes matters: informers resend unchanged objects on
//! every resync, and a relist returns everything, so a naive tracker would reprogram the
//! whole node every few minutes.
//!
//! A change of endpoints is recorded only while the service itself is known. Slices of
//! services we do not proxy (headless services, other proxies') churn with their pods and
//! would otherwise wake the sync loop for nothing; their slices are still kept, so that a
//! service that becomes ours later starts with its endpoints, and adding it records it.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    mem,
    sync::Arc,
};

use imbl::OrdMap;
use tracing::warn;

use super::{EndpointSet, ProxyState, Service, ServiceKey, ServiceRanges, SliceInfo};

/// A snapshot to program and the services that differ from the previous snapshot.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Changes {
    /// The whole state, not just the changed part, so that a dataplane can also do a full
    /// resync from it. Cloning it only bumps reference counts.
    pub state: ProxyState,
    /// Services added, removed, changed, or whose endpoints changed. A key may name a
    /// service that no longer exists in `state`: that means "remove it".
    pub changed: BTreeSet<ServiceKey>,
}

/// Holds the current [`ProxyState`] and the keys changed since the last
/// [`take_changes`](Self::take_changes).
/// A slice's namespace and name.
type SliceId = (Arc<str>, Arc<str>);

#[derive(Debug, Default)]
pub struct ChangeTracker {
    state: ProxyState,
    /// The state at the last [`take_changes`](Self::take_changes) (a cheap persistent
    /// copy): a key whose state comes back to it, such as a Service added and deleted
    /// between two syncs, is no change, as kube-proxy's change trackers drop an item whose
    /// previous and current are equal.
    synced: ProxyState,
    changed: BTreeSet<ServiceKey>,
    /// Which service each slice belongs to, so that a slice whose
    /// `kubernetes.io/service-name` label changes leaves its old service instead of feeding
    /// two services at once. By (namespace, slice name), to the service's name (a slice
    /// feeds a service of its own namespace); the strings are the model's own copies, not
    /// new ones (the index was ~7 MiB of the daemon's RSS at 50,000 services as a
    /// `BTreeMap` of owned keys).
    slice_owner: HashMap<SliceId, Arc<str>>,
    services_changed_total: u64,
    endpoints_changed_total: u64,
}

impl ChangeTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// The current state, including changes not taken yet.
    pub fn state(&self) -> &ProxyState {
        &self.state
    }

    /// Whether anything was recorded since the last [`take_changes`](Self::take_changes).
    pub fn has_changes(&self) -> bool {
        !self.changed.is_empty()
    }

    /// A snapshot and the keys changed since the previous call, which are then forgotten.
    pub fn take_changes(&mut self) -> Changes {
        self.synced = self.state.clone();
        Changes {
            state: self.state.clone(),
            changed: mem::take(&mut self.changed),
        }
    }

    /// How many service additions, updates and removals were recorded in total.
    pub fn services_changed_total(&self) -> u64 {
        self.services_changed_total
    }

    /// How many endpoint set changes (of known services) were recorded in total.
    pub fn endpoints_changed_total(&self) -> u64 {
        self.endpoints_changed_total
    }

    /// Sets the service ranges; whether they changed. A change concerns no one service:
    /// the caller asks for a full sync.
    pub fn set_service_ranges(&mut self, ranges: ServiceRanges) -> bool {
        if self.state.service_ranges == ranges {
            return false;
        }
        self.state.service_ranges = ranges;
        true
    }

    /// Sets or removes (`None`) one service. `None` is also what a source passes for a
    /// service that conversion skipped, since an update can turn a service headless.
    pub fn apply_service(&mut self, key: ServiceKey, svc: Option<Service>) {
        if let Some(svc) = &svc
            && svc.key != key
        {
            warn!(key = %key, service = %svc.key, "service stored under a key that is not its own");
        }
        let changed = match svc {
            Some(mut svc) => match self.state.services.get(&key) {
                Some(current) if **current == svc => false,
                _ => {
                    svc.key = self.shared_key(svc.key);
                    self.state.services.insert(svc.key.clone(), Arc::new(svc));
                    true
                }
            },
            None => self.state.services.remove(&key).is_some(),
        };
        if changed {
            self.services_changed_total += 1;
            self.record(key);
        }
    }

    /// Records `key` as changed, or forgets it when its state is back to the last taken.
    fn record(&mut self, key: ServiceKey) {
        let (was, now) = (&self.synced, &self.state);
        let service_differs = was.services.get(&key) != now.services.get(&key);
        // Endpoints of a service we do not have are not worth a sync (see the module docs).
        let endpoints_differ =
            now.services.contains_key(&key) && was.endpoints.get(&key) != now.endpoints.get(&key);
        if service_differs || endpoints_differ {
            self.changed.insert(key);
        } else {
            self.changed.remove(&key);
        }
    }

    /// Sets or removes (`None`) one slice of `owner`. Removing a service's last slice
    /// removes its entry from [`ProxyState::endpoints`], so "no entry" always means "no
    /// slices".
    pub fn apply_slice(&mut self, owner: ServiceKey, slice_name: String, slice: Option<SliceInfo>) {
        let owner = self.shared_key(owner);
        // The index's copy of the name when it has one, else a new one the index and the
        // model then share.
        let id = match self
            .slice_owner
            .get_key_value(&(owner.namespace.clone(), Arc::from(slice_name.as_str())))
        {
            Some((id, _)) => id.clone(),
            None => (owner.namespace.clone(), Arc::from(slice_name)),
        };
        // A slice that moved to another service (its label changed) leaves the old one. For
        // a delete, the owner comes from the deleted object, which may lag behind the
        // label we last saw; the index knows where the slice actually is.
        if let Some(previous) = self.slice_owner.get(&id).filter(|p| ***p != *owner.name) {
            let previous = ServiceKey {
                namespace: owner.namespace.clone(),
                name: Arc::clone(previous),
            };
            self.remove_slice(previous, &id.1);
        }

        match slice {
            Some(slice) => {
                self.slice_owner.insert(id.clone(), owner.name.clone());
                let current = self
                    .state
                    .endpoints
                    .get(&owner)
                    .and_then(|set| set.slices.get(&id.1));
                if current == Some(&slice) {
                    return;
                }
                let set = self.state.endpoints.entry(owner.clone()).or_default();
                Arc::make_mut(set).slices.insert(id.1, slice);
                self.endpoints_changed(owner);
            }
            None => {
                self.slice_owner.remove(&id);
                self.remove_slice(owner, &id.1);
            }
        }
    }

    /// `key` as the model already holds it (services first), so that the two maps, the
    /// services and the slice index share one copy of its name instead of one each.
    fn shared_key(&self, key: ServiceKey) -> ServiceKey {
        let held = (self.state.services.get_key_value(&key).map(|(k, _)| k))
            .or_else(|| self.state.endpoints.get_key_value(&key).map(|(k, _)| k));
        match held {
            Some(k) => k.clone(),
            None => key,
        }
    }

    fn remove_slice(&mut self, owner: ServiceKey, slice_name: &str) {
        let Some(set) = self.state.endpoints.get_mut(&owner) else {
            return;
        };
        if !set.slices.contains_key(slice_name) {
            return;
        }
        if set.slices.len() == 1 {
            self.state.endpoints.remove(&owner);
        } else {
            Arc::make_mut(set).slices.remove(slice_name);
        }
        self.endpoints_changed(owner);
    }

    fn endpoints_changed(&mut self, owner: ServiceKey) {
        if self.state.services.contains_key(&owner) {
            self.endpoints_changed_total += 1;
            self.record(owner);
        }
    }

    /// Replaces everything with a full list, recording only what really differs from the
    /// current state. Unchanged entries keep their current `Arc`s, so snapshots taken
    /// before and after share them.
    ///
    /// When a service or a slice appears twice, the last one wins, as if the list had been
    /// applied one object at a time.
    pub fn replace_all(
        &mut self,
        services: Vec<Service>,
        slices: Vec<(ServiceKey, String, SliceInfo)>,
    ) {
        self.replace_services(services);
        self.replace_slices(slices);
    }

    /// Replaces every service with a full list (a relist of Services alone), keeping the
    /// slices as they are. Each key whose decision [`record`](Self::record) makes is
    /// decided again by the later step that touches it, so the two halves of
    /// [`replace_all`](Self::replace_all) record what one pass over both would.
    pub fn replace_services(&mut self, services: Vec<Service>) {
        let mut new_services: OrdMap<ServiceKey, Arc<Service>> = OrdMap::new();
        for mut svc in services {
            let arc = match self.state.services.get(&svc.key) {
                Some(current) if **current == svc => Arc::clone(current),
                _ => {
                    svc.key = self.shared_key(svc.key);
                    Arc::new(svc)
                }
            };
            new_services.insert(arc.key.clone(), arc);
        }
        let changed = changed_keys(&self.state.services, &new_services);
        self.services_changed_total += changed.len() as u64;
        self.state.services = new_services;
        for key in changed {
            self.record(key);
        }
    }

    /// Replaces every slice with a full list (a relist of EndpointSlices alone), keeping
    /// the services as they are.
    pub fn replace_slices(&mut self, slices: Vec<(ServiceKey, String, SliceInfo)>) {
        let mut slice_owner: HashMap<SliceId, Arc<str>> = HashMap::with_capacity(slices.len());
        let mut new_sets: BTreeMap<ServiceKey, EndpointSet> = BTreeMap::new();
        for (owner, name, slice) in slices {
            let owner = self.shared_key(owner);
            let name: Arc<str> = Arc::from(name);
            // A slice listed under two owners (its label changed between two list entries)
            // belongs to the last one, as with apply_slice.
            if let Some(previous) =
                slice_owner.insert((owner.namespace.clone(), name.clone()), owner.name.clone())
                && previous != owner.name
                && let Some(set) = new_sets.get_mut(&ServiceKey {
                    namespace: owner.namespace.clone(),
                    name: previous,
                })
            {
                set.slices.remove(&name);
            }
            new_sets
                .entry(owner)
                .or_default()
                .slices
                .insert(name, slice);
        }
        let new_endpoints: OrdMap<ServiceKey, Arc<EndpointSet>> = new_sets
            .into_iter()
            .filter(|(_, set)| !set.slices.is_empty())
            .map(|(key, set)| {
                let arc = match self.state.endpoints.get(&key) {
                    Some(current) if **current == set => Arc::clone(current),
                    _ => Arc::new(set),
                };
                (key, arc)
            })
            .collect();
        let mut changed = changed_keys(&self.state.endpoints, &new_endpoints);
        // Endpoints of services we do not know are not worth a sync (see the module docs).
        changed.retain(|key| self.state.services.contains_key(key));
        self.endpoints_changed_total += changed.len() as u64;
        self.state.endpoints = new_endpoints;
        for key in changed {
            self.record(key);
        }
        self.slice_owner = slice_owner;
    }

    /// Removes a slice known only by namespace and name (deleted, or no longer usable),
    /// from whichever service it fed.
    pub fn forget_slice(&mut self, namespace: &str, slice_name: &str) {
        let id: SliceId = (Arc::from(namespace), Arc::from(slice_name));
        if let Some(name) = self.slice_owner.remove(&id) {
            let owner = ServiceKey {
                namespace: id.0,
                name,
            };
            self.remove_slice(owner, slice_name);
        }
    }
}

/// The keys whose entries differ between `old` and `new` (added, removed or changed), in
/// one merge of the two sorted maps.
fn changed_keys<V: PartialEq>(
    old: &OrdMap<ServiceKey, Arc<V>>,
    new: &OrdMap<ServiceKey, Arc<V>>,
) -> Vec<ServiceKey> {
    let mut changed = Vec::new();
    let (mut a, mut b) = (old.iter().peekable(), new.iter().peekable());
    loop {
        match (a.peek(), b.peek()) {
            (Some((ka, va)), Some((kb, vb))) => match ka.cmp(kb) {
                std::cmp::Ordering::Less => {
                    changed.push((*ka).clone());
                    a.next();
                }
                std::cmp::Ordering::Greater => {
                    changed.push((*kb).clone());
                    b.next();
                }
                std::cmp::Ordering::Equal => {
                    if !Arc::ptr_eq(va, vb) && va != vb {
                        changed.push((*ka).clone());
                    }
                    a.next();
                    b.next();
                }
            },
            (Some((k, _)), None) => {
                changed.push((*k).clone());
                a.next();
            }
            (None, Some((k, _))) => {
                changed.push((*k).clone());
                b.next();
            }
            (None, None) => return changed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Endpoint, Protocol, ServicePort, SlicePort};

    fn key(name: &str) -> ServiceKey {
        ServiceKey::new("default", name)
    }

    fn svc(name: &str, port: u16) -> Service {
        Service::cluster_ip(
            key(name),
            vec!["198.19.96.1".parse().unwrap()],
            vec![ServicePort {
                name: "http".into(),
                port,
                protocol: Protocol::Tcp,
                node_port: None,
            }],
        )
    }

    fn slice(ips: &[&str]) -> SliceInfo {
        SliceInfo {
            ports: vec![SlicePort {
                name: "http".into(),
                port: 8080,
                protocol: Protocol::Tcp,
            }],
            endpoints: ips
                .iter()
                .map(|ip| Endpoint {
                    ip: ip.parse().unwrap(),
                    ready: true,
                    serving: true,
                    terminating: false,
                    placement: Default::default(),
                })
                .collect(),
        }
    }

    fn changed(t: &mut ChangeTracker) -> Vec<String> {
        t.take_changes()
            .changed
            .into_iter()
            .map(|k| k.name.to_string())
            .collect()
    }

    fn slice_names(t: &ChangeTracker, name: &str) -> Option<Vec<String>> {
        t.state()
            .endpoints
            .get(&key(name))
            .map(|set| set.slices.keys().map(|k| k.to_string()).collect())
    }

    /// Two services with one slice each, changes already taken.
    fn two_services() -> ChangeTracker {
        let mut t = ChangeTracker::new();
        t.apply_service(key("a"), Some(svc("a", 80)));
        t.apply_service(key("b"), Some(svc("b", 80)));
        t.apply_slice(key("a"), "a-1".into(), Some(slice(&["198.18.0.1"])));
        t.apply_slice(key("b"), "b-1".into(), Some(slice(&["198.18.1.1"])));
        t.take_changes();
        t
    }

    #[test]
    fn service_add_update_delete() {
        let mut t = ChangeTracker::new();
        assert!(!t.has_changes());
        t.apply_service(key("a"), Some(svc("a", 80)));
        assert!(t.has_changes());
        let c = t.take_changes();
        assert_eq!(c.changed, BTreeSet::from([key("a")]));
        assert_eq!(*c.state.services[&key("a")], svc("a", 80));
        assert!(!t.has_changes(), "take_changes forgets");

        t.apply_service(key("a"), Some(svc("a", 81)));
        assert_eq!(changed(&mut t), ["a"]);
        t.apply_service(key("a"), None);
        assert_eq!(changed(&mut t), ["a"]);
        assert!(t.state().services.is_empty());
        assert_eq!(t.services_changed_total(), 3);
    }

    #[test]
    fn no_op_updates_record_nothing() {
        let mut t = two_services();
        t.apply_service(key("a"), Some(svc("a", 80)));
        t.apply_slice(key("a"), "a-1".into(), Some(slice(&["198.18.0.1"])));
        t.apply_service(key("gone"), None);
        t.apply_slice(key("a"), "never-seen".into(), None);
        assert!(!t.has_changes());
        assert_eq!(
            (t.services_changed_total(), t.endpoints_changed_total()),
            (2, 2)
        );
    }

    #[test]
    fn endpoint_change_marks_only_that_service() {
        let mut t = two_services();
        t.apply_slice(
            key("a"),
            "a-1".into(),
            Some(slice(&["198.18.0.1", "198.18.0.2"])),
        );
        assert_eq!(changed(&mut t), ["a"]);
        assert_eq!(t.endpoints_changed_total(), 3);
        assert_eq!(
            t.services_changed_total(),
            2,
            "the service itself did not change"
        );
    }

    #[test]
    fn a_service_split_over_two_slices() {
        let mut t = two_services();
        t.apply_slice(key("a"), "a-2".into(), Some(slice(&["198.18.0.9"])));
        assert_eq!(changed(&mut t), ["a"]);
        assert_eq!(slice_names(&t, "a").unwrap(), ["a-1", "a-2"]);

        t.apply_slice(key("a"), "a-1".into(), None);
        assert_eq!(changed(&mut t), ["a"]);
        assert_eq!(slice_names(&t, "a").unwrap(), ["a-2"]);

        t.apply_slice(key("a"), "a-2".into(), None);
        assert_eq!(changed(&mut t), ["a"]);
        assert_eq!(
            slice_names(&t, "a"),
            None,
            "the last slice takes the entry with it"
        );
        assert!(
            t.state().services.contains_key(&key("a")),
            "the service stays"
        );
    }

    #[test]
    fn removing_a_service_keeps_its_endpoints_for_a_comeback() {
        let mut t = two_services();
        t.apply_service(key("a"), None);
        assert_eq!(changed(&mut t), ["a"]);
        assert!(slice_names(&t, "a").is_some());
        t.apply_service(key("a"), Some(svc("a", 80)));
        assert_eq!(changed(&mut t), ["a"]);
    }

    #[test]
    fn slices_of_unknown_services_are_kept_but_not_recorded() {
        let mut t = ChangeTracker::new();
        t.apply_slice(key("headless"), "h-1".into(), Some(slice(&["198.18.0.1"])));
        assert!(!t.has_changes());
        assert_eq!(t.endpoints_changed_total(), 0);
        assert_eq!(slice_names(&t, "headless").unwrap(), ["h-1"]);

        t.apply_service(key("headless"), Some(svc("headless", 80)));
        let c = t.take_changes();
        assert_eq!(c.changed, BTreeSet::from([key("headless")]));
        assert!(
            c.state.endpoints.contains_key(&key("headless")),
            "arrives with its endpoints"
        );
    }

    #[test]
    fn a_slice_that_changes_owner_leaves_the_old_one() {
        let mut t = two_services();
        t.apply_slice(key("b"), "a-1".into(), Some(slice(&["198.18.0.1"])));
        assert_eq!(changed(&mut t), ["a", "b"]);
        assert_eq!(slice_names(&t, "a"), None);
        assert_eq!(slice_names(&t, "b").unwrap(), ["a-1", "b-1"]);

        // A delete that still names the old owner finds the slice anyway.
        t.apply_slice(key("a"), "a-1".into(), None);
        assert_eq!(changed(&mut t), ["b"]);
        assert_eq!(slice_names(&t, "b").unwrap(), ["b-1"]);
    }

    #[test]
    fn snapshots_do_not_see_later_changes() {
        let mut t = two_services();
        let before = t.take_changes().state;
        t.apply_slice(key("a"), "a-1".into(), Some(slice(&["198.18.0.7"])));
        t.apply_service(key("b"), Some(svc("b", 90)));
        assert_eq!(
            before.endpoints[&key("a")].slices["a-1"],
            slice(&["198.18.0.1"])
        );
        assert_eq!(before.services[&key("b")].ports[0].port, 80);
        assert_ne!(&before, t.state());
    }

    #[test]
    fn partial_relists_and_forgetting_a_slice() {
        let mut t = ChangeTracker::new();
        t.replace_all(
            vec![svc("a", 80), svc("b", 80)],
            vec![(key("a"), "a-1".into(), slice(&["198.18.1.1"]))],
        );
        t.take_changes();
        // A relist of services that drops b keeps a's endpoints.
        t.replace_services(vec![svc("a", 80)]);
        let c = t.take_changes();
        assert_eq!(c.changed, BTreeSet::from([key("b")]));
        assert!(c.state.endpoints.contains_key(&key("a")));
        // A relist of slices that changes a's endpoints marks only a.
        t.replace_slices(vec![(key("a"), "a-1".into(), slice(&["198.18.1.2"]))]);
        assert_eq!(t.take_changes().changed, BTreeSet::from([key("a")]));
        // A slice deleted without its owner label is found by name.
        t.forget_slice("default", "a-1");
        let c = t.take_changes();
        assert_eq!(c.changed, BTreeSet::from([key("a")]));
        assert!(!c.state.endpoints.contains_key(&key("a")));
        t.forget_slice("default", "no-such-slice");
        assert!(!t.has_changes());
    }

    #[test]
    fn replace_all_records_only_real_changes() {
        let mut t = ChangeTracker::new();
        let services = vec![svc("a", 80), svc("b", 80), svc("c", 80)];
        let slices = vec![
            (key("a"), "a-1".to_owned(), slice(&["198.18.0.1"])),
            (key("a"), "a-2".to_owned(), slice(&["198.18.0.2"])),
            (key("b"), "b-1".to_owned(), slice(&["198.18.1.1"])),
            (key("headless"), "h-1".to_owned(), slice(&["198.18.9.1"])),
        ];
        t.replace_all(services.clone(), slices.clone());
        assert_eq!(
            changed(&mut t),
            ["a", "b", "c"],
            "endpoints of unknown services are not a change"
        );
        assert_eq!(slice_names(&t, "headless").unwrap(), ["h-1"]);
        let first = t.state().clone();

        t.replace_all(services.clone(), slices.clone());
        assert!(!t.has_changes(), "the same list again is no change");
        assert!(
            Arc::ptr_eq(&first.services[&key("a")], &t.state().services[&key("a")]),
            "unchanged Arcs are kept"
        );
        assert!(Arc::ptr_eq(
            &first.endpoints[&key("a")],
            &t.state().endpoints[&key("a")]
        ));

        // b's endpoints change, c goes away, d arrives, a is untouched.
        let services = vec![svc("a", 80), svc("b", 80), svc("d", 80)];
        let mut slices = slices;
        slices[2].2 = slice(&["198.18.1.2"]);
        slices[3].2 = slice(&["198.18.9.2"]);
        t.replace_all(services.clone(), slices.clone());
        assert_eq!(changed(&mut t), ["b", "c", "d"]);
        assert!(Arc::ptr_eq(
            &first.endpoints[&key("a")],
            &t.state().endpoints[&key("a")]
        ));

        // Dropping one of a's two slices, and b's only one.
        slices.retain(|(_, name, _)| name != "a-2" && name != "b-1");
        t.replace_all(services, slices);
        assert_eq!(changed(&mut t), ["a", "b"]);
        assert_eq!(slice_names(&t, "a").unwrap(), ["a-1"]);
        assert_eq!(slice_names(&t, "b"), None);

        t.replace_all(vec![], vec![]);
        assert_eq!(changed(&mut t), ["a", "b", "d"]);
        assert_eq!(t.state(), &ProxyState::default());
    }

    #[test]
    fn replace_all_service_change_is_counted() {
        let mut t = two_services();
        let (s0, e0) = (t.services_changed_total(), t.endpoints_changed_total());
        t.replace_all(
            vec![svc("a", 81), svc("b", 80)],
            vec![
                (key("a"), "a-1".into(), slice(&["198.18.0.1"])),
                (key("b"), "b-1".into(), slice(&["198.18.1.9"])),
            ],
        );
        assert_eq!(changed(&mut t), ["a", "b"]);
        assert_eq!(
            (
                t.services_changed_total() - s0,
                t.endpoints_changed_total() - e0
            ),
            (1, 1)
        );
    }

    #[test]
    fn replace_all_last_duplicate_wins() {
        let mut t = ChangeTracker::new();
        t.replace_all(
            vec![svc("a", 80), svc("a", 81)],
            vec![
                (key("a"), "s".into(), slice(&["198.18.0.1"])),
                (key("b"), "s".into(), slice(&["198.18.0.2"])),
                (key("a"), "t".into(), slice(&["198.18.0.3"])),
                (key("a"), "t".into(), slice(&["198.18.0.4"])),
            ],
        );
        assert_eq!(t.state().services[&key("a")].ports[0].port, 81);
        assert_eq!(slice_names(&t, "a").unwrap(), ["t"], "slice s moved to b");
        assert_eq!(
            t.state().endpoints[&key("a")].slices["t"],
            slice(&["198.18.0.4"])
        );
        assert_eq!(slice_names(&t, "b").unwrap(), ["s"]);
    }

    #[test]
    fn replace_all_then_incremental_updates_agree() {
        let mut t = ChangeTracker::new();
        t.replace_all(
            vec![svc("a", 80)],
            vec![(key("a"), "a-1".into(), slice(&["198.18.0.1"]))],
        );
        t.take_changes();
        // The owner index was rebuilt by replace_all: a move is still noticed.
        t.apply_service(key("b"), Some(svc("b", 80)));
        t.apply_slice(key("b"), "a-1".into(), Some(slice(&["198.18.0.1"])));
        assert_eq!(changed(&mut t), ["a", "b"]);
        assert_eq!(slice_names(&t, "a"), None);
    }
}

#[cfg(test)]
#[path = "tracker_kube_tests/mod.rs"]
mod kube_tests;
