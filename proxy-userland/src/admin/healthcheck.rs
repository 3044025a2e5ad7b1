//! Health check node ports, as kube-proxy's pkg/proxy/healthcheck service servers.
//!
//! A LoadBalancer Service with `externalTrafficPolicy: Local` only works on nodes that have
//! one of its endpoints, so its `healthCheckNodePort` tells the cloud load balancer which
//! nodes those are: each node answers 200 with the number of local endpoints, or 503 with
//! none, and the load balancer sends traffic only to the nodes that answered 200. One
//! listener per such service is opened when it appears and closed when it goes.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    os::fd::AsRawFd,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::{
    AdminState,
    http::{self, Handler, Request, Response},
};
use crate::model::{EndpointSet, NodeInfo, ProxyState, Service, ServiceKey, select};

/// What should be served: port and local endpoint count per service.
pub type Desired = BTreeMap<ServiceKey, (u16, usize)>;

/// The services that need a health check server on this node, and their local endpoint
/// counts.
///
/// Counted are distinct ready endpoints on this node over all ports. Terminating endpoints,
/// which [`select::categorize`] falls back to for traffic, do not count: a node with only
/// draining pods should lose new load-balancer traffic, which is what reporting 0 does (as
/// kube-proxy's LocalReadyEndpoints).
pub fn desired(state: &ProxyState, node: &NodeInfo) -> Desired {
    (state.services.iter())
        .filter_map(|(key, svc)| {
            let hc = health_check(svc, state.endpoints.get(key).map(|s| &**s), node)?;
            Some((key.clone(), hc))
        })
        .collect()
}

/// One service's part of [`desired`]: its health check port and local endpoint count.
pub fn health_check(
    svc: &Service,
    set: Option<&EndpointSet>,
    node: &NodeInfo,
) -> Option<(u16, usize)> {
    let port = svc
        .health_check_node_port
        .filter(|_| svc.external_policy_local)?;
    let mut local = std::collections::BTreeSet::new();
    if let Some(set) = set {
        for sp in &svc.ports {
            let eps = select::endpoints_for_port(set, sp);
            let c = select::categorize(svc, &eps, node);
            local.extend(
                c.local
                    .iter()
                    .filter(|pe| pe.endpoint.ready)
                    .map(|pe| pe.ip),
            );
        }
    }
    Some((port, local.len()))
}

/// Service ports whose Local traffic policy finds no endpoint on this node although the
/// service has endpoints elsewhere (kube-proxy's
/// `kubeproxy_sync_proxy_rules_no_local_endpoints_total`): their traffic under that policy
/// is dropped here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoLocalEndpoints {
    /// `internalTrafficPolicy: Local`.
    pub internal: usize,
    /// `externalTrafficPolicy: Local` on a service reachable from outside.
    pub external: usize,
}

/// Counts [`NoLocalEndpoints`] in `state`, per service port as kube-proxy does.
pub fn no_local_endpoints(state: &ProxyState, node: &NodeInfo) -> NoLocalEndpoints {
    let mut out = NoLocalEndpoints::default();
    for (key, svc) in &state.services {
        out += service_no_local_endpoints(svc, state.endpoints.get(key).map(|s| &**s), node);
    }
    out
}

/// One service's part of [`no_local_endpoints`].
pub fn service_no_local_endpoints(
    svc: &Service,
    set: Option<&EndpointSet>,
    node: &NodeInfo,
) -> NoLocalEndpoints {
    let mut out = NoLocalEndpoints::default();
    let externally_accessible = svc.ports.iter().any(|p| p.node_port.is_some())
        || !svc.load_balancer_ips.is_empty()
        || !svc.external_ips.is_empty();
    let external_local = svc.external_policy_local && externally_accessible;
    if !svc.internal_policy_local && !external_local {
        return out;
    }
    let Some(set) = set else {
        return out;
    };
    for sp in &svc.ports {
        let eps = select::endpoints_for_port(set, sp);
        let c = select::categorize(svc, &eps, node);
        if !c.has_any_endpoints || !c.local.is_empty() {
            continue;
        }
        out.internal += usize::from(svc.internal_policy_local);
        out.external += usize::from(external_local);
    }
    out
}

impl std::ops::AddAssign for NoLocalEndpoints {
    fn add_assign(&mut self, other: Self) {
        self.internal += other.internal;
        self.external += other.external;
    }
}

impl std::ops::SubAssign for NoLocalEndpoints {
    fn sub_assign(&mut self, other: Self) {
        self.internal -= other.internal;
        self.external -= other.external;
    }
}

/// The open health check servers.
pub struct HealthCheckServers {
    bind: IpAddr,
    admin: Arc<AdminState>,
    servers: BTreeMap<ServiceKey, Server>,
    /// Ports that could not be bound, so that each failure is logged once, not every sync.
    failed: BTreeMap<ServiceKey, u16>,
}

struct Server {
    port: u16,
    local: Arc<AtomicUsize>,
    task: JoinHandle<()>,
    /// A second descriptor of the task's listening socket, to take the port back at once.
    listening: std::net::TcpListener,
}

impl Server {
    /// Stops the server and frees its port now. The aborted task drops its listener only
    /// when the runtime next polls it, and a bind of the same port in the same sync (the
    /// port handed to another service) would fail with EADDRINUSE until then; shutting the
    /// socket down takes it out of the listening state at once, whoever still holds it.
    fn close(self) {
        self.task.abort();
        // SAFETY: shutdown(2) on a descriptor this struct owns (`listening`, open until it
        // drops at the end of this function); it touches no memory of ours.
        let rc = unsafe { libc::shutdown(self.listening.as_raw_fd(), libc::SHUT_RDWR) };
        if rc != 0 {
            warn!(
                port = self.port,
                "cannot close the health check node port at once: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

impl HealthCheckServers {
    pub fn new(bind: IpAddr, admin: Arc<AdminState>) -> Self {
        Self {
            bind,
            admin,
            servers: BTreeMap::new(),
            failed: BTreeMap::new(),
        }
    }

    /// Opens, updates and closes servers to match `want`. Must run inside the runtime.
    /// Returns the services whose port could not be opened now, with the error (a port
    /// already failing is retried at every update but reported only once).
    pub fn update(&mut self, want: &Desired) -> Vec<(ServiceKey, u16, String)> {
        let gone: Vec<ServiceKey> = self
            .servers
            .iter()
            .filter(|(key, s)| want.get(*key).is_none_or(|(port, _)| *port != s.port))
            .map(|(key, _)| key.clone())
            .collect();
        for key in gone {
            if let Some(s) = self.servers.remove(&key) {
                info!(service = %key, port = s.port, "health check node port closed");
                s.close();
            }
        }
        self.failed
            .retain(|key, port| want.get(key).is_some_and(|(p, _)| p == port));

        let mut errors = Vec::new();
        for (key, &(port, count)) in want {
            if let Some(s) = self.servers.get(key) {
                s.local.store(count, Ordering::Relaxed);
                continue;
            }
            match self.open(key, port, count) {
                Ok(server) => {
                    self.failed.remove(key);
                    info!(service = %key, port, local_endpoints = count, "health check node port open");
                    self.servers.insert(key.clone(), server);
                }
                Err(e) => {
                    if self.failed.insert(key.clone(), port).is_none() {
                        warn!(service = %key, port, "cannot open the health check node port: {e}; retrying at each sync");
                        errors.push((key.clone(), port, e.to_string()));
                    }
                }
            }
        }
        self.admin
            .metrics
            .healthcheck_servers
            .set(self.servers.len() as i64);
        errors
    }

    fn open(&self, key: &ServiceKey, port: u16, count: usize) -> std::io::Result<Server> {
        let listener = http::listen(SocketAddr::new(self.bind, port))?;
        let listening = listener.try_clone()?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let local = Arc::new(AtomicUsize::new(count));
        let handler = handler(key.clone(), local.clone(), self.admin.clone());
        // Stopped by abort (update, drop); the daemon drops us on shutdown.
        let task = tokio::spawn(http::serve(listener, handler, std::future::pending()));
        Ok(Server {
            port,
            local,
            task,
            listening,
        })
    }

    /// The open servers' ports, for tests and diagnostics.
    pub fn ports(&self) -> BTreeMap<ServiceKey, u16> {
        self.servers
            .iter()
            .map(|(k, s)| (k.clone(), s.port))
            .collect()
    }
}

impl Drop for HealthCheckServers {
    fn drop(&mut self) {
        for s in self.servers.values() {
            s.task.abort();
        }
    }
}

/// kube-proxy's answer: 200 with local endpoints and a healthy proxy, else 503, on any path.
fn handler(key: ServiceKey, local: Arc<AtomicUsize>, admin: Arc<AdminState>) -> Handler {
    Arc::new(move |_req: &Request| {
        let count = local.load(Ordering::Relaxed);
        let healthy = admin.health.is_healthy();
        let body = serde_json::json!({
            "service": {"namespace": &*key.namespace, "name": &*key.name},
            "localEndpoints": count,
            "serviceProxyHealthy": healthy,
        });
        let status = if count > 0 && healthy { 200 } else { 503 };
        let mut resp = Response::json(status, body.to_string());
        resp.headers
            .push(("X-Load-Balancing-Endpoint-Weight", count.to_string()));
        resp
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc as StdArc;

    use super::*;
    use crate::model::{
        Endpoint, EndpointSet, Protocol, Service, ServicePort, SliceInfo, SlicePort,
    };

    fn ep(ip: &str, node: &str, ready: bool) -> Endpoint {
        Endpoint {
            ip: ip.parse().unwrap(),
            ready,
            serving: true,
            terminating: !ready,
            placement: crate::model::endpoint::Where::on_node(node).into(),
        }
    }

    fn lb(name: &str, local_policy: bool, hc: Option<u16>) -> Service {
        Service {
            key: ServiceKey::new("demo", name),
            cluster_ips: vec!["198.19.0.40".parse().unwrap()],
            ports: vec![
                ServicePort {
                    name: "http".into(),
                    port: 80,
                    protocol: Protocol::Tcp,
                    node_port: Some(30080),
                },
                ServicePort {
                    name: "alt".into(),
                    port: 81,
                    protocol: Protocol::Tcp,
                    node_port: Some(30081),
                },
            ],
            external_ips: vec![],
            load_balancer_ips: vec!["198.19.100.1".parse().unwrap()],
            load_balancer_source_ranges: vec![],
            affinity_timeout: None,
            external_policy_local: local_policy,
            internal_policy_local: false,
            health_check_node_port: hc,
            prefer_close: false,
            lb_algorithm: None,
        }
    }

    fn state(services: Vec<Service>, endpoints: Vec<Endpoint>) -> ProxyState {
        let ports = vec![
            SlicePort {
                name: "http".into(),
                port: 8080,
                protocol: Protocol::Tcp,
            },
            SlicePort {
                name: "alt".into(),
                port: 8081,
                protocol: Protocol::Tcp,
            },
        ];
        let set = EndpointSet {
            slices: crate::model::Slices::from([("s".into(), SliceInfo { ports, endpoints })]),
        };
        let mut st = ProxyState::default();
        for svc in services {
            st.endpoints
                .insert(svc.key.clone(), StdArc::new(set.clone()));
            st.services.insert(svc.key.clone(), StdArc::new(svc));
        }
        st
    }

    /// The engine keeps these between syncs and recomputes only the services a sync
    /// changed: after any walk of changes, what it keeps is what a walk of every service
    /// gives.
    #[test]
    fn kept_between_syncs_as_computed_afresh() {
        use crate::{model::tracker::ChangeTracker, sync::local_policy::LocalPolicy};
        let node = NodeInfo {
            name: "node-a".into(),
            zone: None,
        };
        let ports = vec![SlicePort {
            name: "http".into(),
            port: 8080,
            protocol: Protocol::Tcp,
        }];
        let (mut tracker, mut kept) = (ChangeTracker::new(), LocalPolicy::default());
        let mut seed: u64 = 3;
        let mut counted = 0;
        for step in 0..300 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let r = (seed >> 33) as usize;
            let name = format!("s{}", r % 5);
            let key = ServiceKey::new("demo", &name);
            match (r / 5) % 4 {
                0 => {
                    let mut svc = lb(&name, r >> 8 & 1 == 0, (r >> 9 & 1 == 0).then_some(32000));
                    svc.internal_policy_local = r >> 10 & 3 == 0;
                    tracker.apply_service(key, Some(svc));
                }
                1 => tracker.apply_service(key, None),
                2 => {
                    let at = if r >> 8 & 1 == 0 { "node-a" } else { "node-b" };
                    let ready = r >> 9 & 3 != 0;
                    let endpoints = vec![ep(&format!("198.18.1.{}", r % 200), at, ready)];
                    let ports = ports.clone();
                    tracker.apply_slice(key, "s".into(), Some(SliceInfo { ports, endpoints }));
                }
                _ => tracker.apply_slice(key, "s".into(), None),
            }
            let changes = tracker.take_changes();
            let full = step % 17 == 0;
            kept.update(&changes.state, &node, (!full).then_some(&changes.changed));
            assert_eq!(
                kept.health_checks(),
                &desired(&changes.state, &node),
                "step {step}"
            );
            let afresh = no_local_endpoints(&changes.state, &node);
            assert_eq!(kept.no_local_endpoints(), afresh, "step {step}");
            counted += usize::from(afresh != NoLocalEndpoints::default());
        }
        assert!(
            counted >= 10,
            "the walk reached services without local endpoints: {counted}"
        );
    }

    #[test]
    fn counts_distinct_ready_local_endpoints_of_local_policy_services_only() {
        let node = NodeInfo {
            name: "node-a".into(),
            zone: None,
        };
        let st = state(
            vec![lb("local", true, Some(32000)), lb("cluster", false, None)],
            vec![
                ep("198.18.1.11", "node-a", true),
                ep("198.18.1.12", "node-a", true),
                ep("198.18.1.13", "node-a", false),
                ep("198.18.1.14", "node-b", true),
            ],
        );
        let d = desired(&st, &node);
        assert_eq!(
            d,
            Desired::from([(ServiceKey::new("demo", "local"), (32000, 2))])
        );
        let elsewhere = NodeInfo {
            name: "node-c".into(),
            zone: None,
        };
        assert_eq!(
            desired(&st, &elsewhere)[&ServiceKey::new("demo", "local")],
            (32000, 0)
        );
    }

    #[test]
    fn only_terminating_local_endpoints_count_as_none() {
        let node = NodeInfo {
            name: "node-a".into(),
            zone: None,
        };
        let st = state(
            vec![lb("local", true, Some(32000))],
            vec![ep("198.18.1.13", "node-a", false)],
        );
        assert_eq!(desired(&st, &node)[&ServiceKey::new("demo", "local")].1, 0);
    }

    #[test]
    fn counts_local_policy_ports_without_local_endpoints() {
        let node = NodeInfo {
            name: "node-a".into(),
            zone: None,
        };
        let mut internal = lb("internal", false, None);
        internal.internal_policy_local = true;
        let st = state(
            vec![
                lb("local", true, Some(32000)),
                lb("cluster", false, None),
                internal,
            ],
            vec![ep("198.18.1.14", "node-b", true)],
        );
        // Two ports each: both of "local" (external), both of "internal"; "cluster" none.
        assert_eq!(
            no_local_endpoints(&st, &node),
            NoLocalEndpoints {
                internal: 2,
                external: 2
            }
        );
        let here = NodeInfo {
            name: "node-b".into(),
            zone: None,
        };
        assert_eq!(no_local_endpoints(&st, &here), NoLocalEndpoints::default());
        let empty = state(vec![lb("local", true, Some(32000))], vec![]);
        assert_eq!(
            no_local_endpoints(&empty, &node),
            NoLocalEndpoints::default(),
            "no endpoints at all is not 'no local endpoints'"
        );
    }

    /// A port no one listens on now, for a service's health check.
    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// One GET to the health check server on `port` of 127.0.0.1: the whole answer.
    async fn get_from(port: u16) -> std::io::Result<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        Ok(out)
    }

    #[tokio::test]
    async fn servers_open_answer_and_close_with_their_services() {
        let admin = AdminState::new(std::time::Duration::from_secs(60));
        let mut servers = HealthCheckServers::new("127.0.0.1".parse().unwrap(), admin);
        // A free port for the service.
        let port = free_port();
        let key = ServiceKey::new("demo", "lb");
        let get = || get_from(port);
        assert!(
            servers
                .update(&Desired::from([(key.clone(), (port, 2))]))
                .is_empty()
        );
        let out = get().await.unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        let body: serde_json::Value =
            serde_json::from_str(out.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"service": {"namespace": "demo", "name": "lb"}, "localEndpoints": 2, "serviceProxyHealthy": true})
        );

        servers.update(&Desired::from([(key.clone(), (port, 0))]));
        assert!(
            get().await.unwrap().starts_with("HTTP/1.1 503"),
            "no local endpoints: 503"
        );

        servers.update(&Desired::new());
        assert!(servers.ports().is_empty());
        // The abort lands at the task's next poll; give it a moment.
        let mut closed = false;
        for _ in 0..50 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_err()
            {
                closed = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(closed, "the port is closed once the service is gone");
    }

    /// From kube-proxy's TestServer: a service's health check node port freed and taken by
    /// another service in the same sync (a Service deleted and another created with its
    /// port, between two syncs) is served at once by the new one. The old listener used to
    /// close only when its aborted task next ran, so the new bind failed with EADDRINUSE
    /// and the port stayed closed until a later sync, long enough for a load balancer to
    /// drain the node.
    #[tokio::test]
    async fn test_server_port_freed_and_taken_again_in_one_sync() {
        let admin = AdminState::new(std::time::Duration::from_secs(60));
        let mut servers = HealthCheckServers::new("127.0.0.1".parse().unwrap(), admin);
        let port = free_port();
        let (a, b) = (ServiceKey::new("demo", "a"), ServiceKey::new("demo", "b"));
        assert!(servers.update(&Desired::from([(a, (port, 1))])).is_empty());
        let errors = servers.update(&Desired::from([(b.clone(), (port, 3))]));
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(servers.ports(), BTreeMap::from([(b, port)]));
        let out = get_from(port).await.unwrap();
        let body: serde_json::Value =
            serde_json::from_str(out.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        assert_eq!(body["service"]["name"], "b", "{out}");
        assert_eq!(body["localEndpoints"], 3, "{out}");
    }

    /// kube-proxy's TestServerWithSelectiveListeningAddress. kube-proxy opens a service's
    /// health check node port on each node address within `--nodeport-addresses` (its case:
    /// 127.0.0.0/8, so 127.0.0.1:9376). We differ on purpose: one listener per service, on
    /// `--healthcheck-bind-address` (default 0.0.0.0, every address), so that no address
    /// that comes or goes after start-up is missed; the operator narrows it with the flag.
    /// The case binds 127.0.0.1 and checks that only that address answers.
    #[tokio::test]
    async fn test_server_with_selective_listening_address() {
        let admin = AdminState::new(std::time::Duration::from_secs(60));
        let mut servers = HealthCheckServers::new("127.0.0.1".parse().unwrap(), admin);
        let node = NodeInfo {
            name: "hostname".into(),
            zone: None,
        };

        // Sync nothing.
        assert!(
            servers
                .update(&desired(&ProxyState::default(), &node))
                .is_empty()
        );
        assert!(servers.ports().is_empty());

        // Endpoints of a service we do not know open nothing.
        let key = ServiceKey::new("a", "b");
        let mut st = state(
            vec![lb("b", true, Some(9376))],
            vec![ep("198.18.1.1", "hostname", true)],
        );
        let svc = st.services.remove(&ServiceKey::new("demo", "b")).unwrap();
        let eps = st.endpoints.remove(&ServiceKey::new("demo", "b")).unwrap();
        st.endpoints.insert(key.clone(), eps.clone());
        assert!(desired(&st, &node).is_empty());

        // A real service, with no endpoints: its port opens on 127.0.0.1 only and answers 503.
        st.endpoints.clear();
        let port = free_port();
        let mut svc = (*svc).clone();
        svc.key = key.clone();
        svc.health_check_node_port = Some(port);
        st.services.insert(key.clone(), StdArc::new(svc));
        let want = desired(&st, &node);
        assert_eq!(want, Desired::from([(key.clone(), (port, 0))]));
        assert!(servers.update(&want).is_empty());
        assert_eq!(servers.ports(), BTreeMap::from([(key, port)]));
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 503"), "{out}");
        assert!(
            tokio::net::TcpStream::connect(("127.0.0.2", port))
                .await
                .is_err(),
            "another loopback address does not answer"
        );
    }
}
