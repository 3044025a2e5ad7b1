//! A fake Kubernetes API server for tests: real HTTP/1.1 list/watch on 127.0.0.1, plain http,
//! no auth, close enough to a real one that kube-rs (`kube::Api::list`,
//! `kube::runtime::watcher`) talks to it as to a cluster.
//!
//! What it serves:
//! - core v1 `services`, `endpoints` (namespaced), `nodes`, `namespaces` (cluster-scoped), and
//!   discovery.k8s.io/v1 `endpointslices`, networking.k8s.io/v1 `servicecidrs`
//!   (cluster-scoped), at the usual paths
//!   (`/api/v1/services`, `/api/v1/namespaces/{ns}/services[/{name}]`, `/api/v1/nodes[/{name}]`,
//!   `/apis/discovery.k8s.io/v1[/namespaces/{ns}]/endpointslices[/{name}]`,
//!   `/apis/networking.k8s.io/v1/servicecidrs[/{name}]`);
//! - GET (get, list, watch), POST (create), PUT (replace), DELETE, and PATCH with
//!   `application/merge-patch+json` (other patch types answer 415);
//! - `/api`, `/api/v1`, `/apis`, `/apis/{group}[/v1]`, `/version`, `/healthz`,
//!   `/livez`, `/readyz`.
//!
//! Semantics follow the API conventions: one global resourceVersion bumped by every change;
//! lists honour `labelSelector` (`=`, `==`, `!=`, `in`, `notin`, exists, `!`, `>`, `<`),
//! `fieldSelector` (`metadata.name`, `metadata.namespace` and a few per-resource fields),
//! `limit`/`continue` (consistent snapshots at the first page's resourceVersion) and
//! `resourceVersion`/`resourceVersionMatch` as in the list semantics table (unset: most recent;
//! "0": any; N: not older than N, or exact with `limit` or `resourceVersionMatch=Exact`).
//! Watches replay the retained history after their resourceVersion and then stream live
//! events, send synthetic ADDED events for the current state when started from "0" or no
//! resourceVersion, convert events for objects entering or leaving the selectors into
//! ADDED/DELETED like the watch cache, send BOOKMARKs when allowed, support
//! `sendInitialEvents=true` (streaming lists), end cleanly after `timeoutSeconds`, and answer a
//! too old resourceVersion (after [`ApiServer::compact`]) with one ERROR event carrying a 410
//! `Expired` Status. Errors are Status objects with the real reasons and codes.
//!
//! Not modelled: authentication, admission (no ClusterIP allocation, no namespace existence
//! checks, no defaulting beyond metadata), status subresources, finalizers, strategic merge
//! and server-side apply patches, protobuf/CBOR/table output (Accept is ignored: always JSON),
//! and aggregated discovery.

mod http;
mod store;

use std::{
    collections::HashMap,
    io::{self, Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    path::Path,
    sync::{
        Arc, Condvar, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use serde_json::{Value, json};
pub use store::Status;
use store::{FieldSelector, Filter, LabelSelector, RESOURCES, ResourceDef, State, WatchSlot};

use self::http::{Parsed, Request};

/// How long a list or watch waits for a resourceVersion newer than the current one.
const TOO_LARGE_WAIT: Duration = Duration::from_secs(3);
/// Default watch length when the client gives no timeoutSeconds.
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);
/// Idle keep-alive connections are closed after this long.
const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// Longest any server thread blocks before looking at the shutdown flag.
const TICK: Duration = Duration::from_millis(50);

/// The fake API server. Dropping it stops the server and all its threads.
pub struct ApiServer {
    inner: Arc<Inner>,
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

struct Conn {
    stream: TcpStream,
    watching: bool,
}

struct Inner {
    state: Mutex<State>,
    /// Signalled on every change to `state` (and on shutdown).
    changed: Condvar,
    shutdown: AtomicBool,
    conns: Mutex<HashMap<u64, Conn>>,
    next_conn: AtomicU64,
    threads: Mutex<Vec<JoinHandle<()>>>,
    requests: Mutex<Vec<String>>,
    addr: SocketAddr,
    /// Asked for by [`ApiServer::stop_listening`]: the port is closed until cleared.
    outage: AtomicBool,
    /// The accept loop's answer: the port is closed now.
    closed: AtomicBool,
    /// The network namespace the port is in (a name under /run/netns); None: ours.
    netns: Option<String>,
    /// Resources this server pretends not to have (an older API server's), by plural.
    hidden: Mutex<Vec<&'static str>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn stopping(&self) -> bool {
        self.shutdown.load(Ordering::SeqCst)
    }

    /// Runs `f` on the state and wakes the watches.
    fn mutate<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let out = f(&mut self.state());
        self.changed.notify_all();
        out
    }
}

fn resource(name: &str) -> Result<usize, Status> {
    store::resource_index(name).ok_or_else(|| {
        Status::new(
            404,
            "NotFound",
            format!("the server doesn't have a resource type {name:?}"),
        )
    })
}

impl ApiServer {
    /// Starts a server on 127.0.0.1 on a free port.
    pub fn start() -> anyhow::Result<ApiServer> {
        Self::start_on(None, SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// Starts a server on `ip` (a free port) inside network namespace `netns`, as a
    /// cluster's API server is reached over the nodes' network: daemons in other
    /// namespaces connect to it through their routes. The server's threads stay in ours.
    pub fn start_in(netns: &str, ip: std::net::IpAddr) -> anyhow::Result<ApiServer> {
        crate::testbed::check_test_ip(ip)?;
        Self::start_on(Some(netns.to_string()), SocketAddr::new(ip, 0))
    }

    fn start_on(netns: Option<String>, addr: SocketAddr) -> anyhow::Result<ApiServer> {
        let listener = bind(netns.as_deref(), addr).context("binding the fake API server")?;
        let addr = listener.local_addr()?;
        let inner = Arc::new(Inner {
            state: Mutex::new(State::new()),
            changed: Condvar::new(),
            shutdown: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            threads: Mutex::new(Vec::new()),
            requests: Mutex::new(Vec::new()),
            addr,
            outage: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            netns,
            hidden: Mutex::new(Vec::new()),
        });
        let accept = {
            let inner = inner.clone();
            thread::Builder::new()
                .name("fake-apiserver".into())
                .spawn(move || accept_loop(&inner, listener))
                .context("spawning the fake API server")?
        };
        Ok(ApiServer {
            inner,
            addr,
            accept: Some(accept),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// From now on answer `plural`'s paths with 404 NotFound, as an API server from before
    /// the resource existed does (ServiceCIDRs before Kubernetes 1.33).
    pub fn hide(&self, plural: &'static str) {
        lock(&self.inner.hidden).push(plural);
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The current global resourceVersion (that of the latest change).
    pub fn resource_version(&self) -> u64 {
        self.inner.state().rv
    }

    /// Creates an object of `resource` (`"services"`, `"endpointslices"`, `"nodes"`, ...; the
    /// singular or the kind work too) and returns it as stored. Namespaced objects without a
    /// namespace go to "default". Panics if it cannot (unknown resource, already exists,
    /// invalid); see [`ApiServer::try_create`].
    #[track_caller]
    pub fn create(&self, resource: &str, obj: Value) -> Value {
        self.try_create(resource, obj)
            .unwrap_or_else(|e| panic!("fake apiserver: create {resource}: {e}"))
    }

    pub fn try_create(&self, resource_name: &str, obj: Value) -> Result<Value, Status> {
        let res = resource(resource_name)?;
        self.inner.mutate(|s| s.create(res, None, obj))
    }

    /// Replaces an existing object (found by the body's namespace and name). If the body has
    /// metadata.resourceVersion it must be the current one (409 Conflict otherwise). Panics on
    /// failure; see [`ApiServer::try_update`].
    #[track_caller]
    pub fn update(&self, resource: &str, obj: Value) -> Value {
        self.try_update(resource, obj)
            .unwrap_or_else(|e| panic!("fake apiserver: update {resource}: {e}"))
    }

    pub fn try_update(&self, resource_name: &str, obj: Value) -> Result<Value, Status> {
        let res = resource(resource_name)?;
        self.inner.mutate(|s| s.update(res, None, obj, true))
    }

    /// Creates the object, or replaces it unconditionally if it exists.
    #[track_caller]
    pub fn apply(&self, resource_name: &str, obj: Value) -> Value {
        let res = resource(resource_name).unwrap_or_else(|e| panic!("fake apiserver: apply: {e}"));
        self.inner
            .mutate(|s| match s.update(res, None, obj.clone(), false) {
                Err(e) if e.code == 404 => s.create(res, None, obj),
                other => other,
            })
            .unwrap_or_else(|e| panic!("fake apiserver: apply {resource_name}: {e}"))
    }

    /// Deletes an object (namespace None means "default" for namespaced resources); returns its
    /// last state, or None if there was no such object.
    pub fn delete(
        &self,
        resource_name: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Option<Value> {
        let res = resource(resource_name).ok()?;
        self.inner.mutate(|s| s.delete(res, namespace, name)).ok()
    }

    pub fn get(&self, resource_name: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let res = resource(resource_name).ok()?;
        self.inner.state().get(res, namespace, name).ok()
    }

    /// All objects of a resource, in key order.
    pub fn list(&self, resource_name: &str) -> Vec<Value> {
        match resource(resource_name) {
            Ok(res) => self.inner.state().stores[res].values().cloned().collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Drops the event history, as an etcd compaction does: watches and exact lists from any
    /// resourceVersion older than the current one now get 410 Expired. Running watches keep
    /// getting their events.
    pub fn compact(&self) {
        self.inner.mutate(State::compact);
    }

    /// Abruptly closes every open watch connection (no chunked terminator), as a dropped
    /// connection or an API server restart would; waits (up to 2 s) until they are gone.
    pub fn drop_watches(&self) {
        let dropped: Vec<u64> = self.inner.mutate(|s| {
            s.watches.values_mut().for_each(|w| w.dropped = true);
            s.watches.keys().copied().collect()
        });
        for c in lock(&self.inner.conns).values().filter(|c| c.watching) {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut state = self.inner.state();
        while dropped.iter().any(|id| state.watches.contains_key(id)) && Instant::now() < deadline {
            state = self
                .inner
                .changed
                .wait_timeout(state, TICK)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// An outage, as when the API server restarts: the port is closed (connections are
    /// refused) and every client connection is dropped, until [`ApiServer::start_listening`].
    /// The objects stay, and so does the history unless [`ApiServer::compact`] is called
    /// meanwhile. Returns once the port is closed (false if that took over 2 s).
    pub fn stop_listening(&self) -> bool {
        self.inner.outage.store(true, Ordering::SeqCst);
        let closed = wait_until(|| self.inner.closed.load(Ordering::SeqCst));
        self.drop_connections();
        closed
    }

    /// Ends an outage: the same port takes connections again. Returns once it does (false
    /// if the port could not be bound again within 2 s).
    pub fn start_listening(&self) -> bool {
        self.inner.outage.store(false, Ordering::SeqCst);
        wait_until(|| !self.inner.closed.load(Ordering::SeqCst))
    }

    /// Closes every client connection, idle keep-alive ones included.
    pub fn drop_connections(&self) {
        self.drop_watches();
        for c in lock(&self.inner.conns).values() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
    }

    /// How often watches that allow bookmarks get one (default 1 s; zero disables them).
    pub fn set_bookmark_interval(&self, interval: Duration) {
        self.inner.mutate(|s| s.bookmark_interval = interval);
    }

    /// Watches currently open.
    pub fn open_watches(&self) -> usize {
        self.inner
            .state()
            .watches
            .values()
            .filter(|w| !w.dropped)
            .count()
    }

    /// Waits until at least `n` watches are open; false on timeout.
    pub fn wait_for_watches(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut state = self.inner.state();
        loop {
            if state.watches.values().filter(|w| !w.dropped).count() >= n {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            state = self
                .inner
                .changed
                .wait_timeout(state, (deadline - now).min(TICK))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Every request seen so far, as `"METHOD target"` with the target as sent (path and
    /// percent-encoded query), e.g. `"GET /api/v1/services?limit=500"`.
    pub fn requests(&self) -> Vec<String> {
        lock(&self.inner.requests).clone()
    }

    pub fn clear_requests(&self) {
        lock(&self.inner.requests).clear();
    }

    /// Writes a kubeconfig pointing at this server (cluster, user and context all named
    /// "fake", namespace "default", no credentials).
    pub fn write_kubeconfig(&self, path: &Path) -> anyhow::Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\npreferences: {{}}\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    \
             namespace: default\ncurrent-context: fake\n",
            self.url()
        );
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.inner.shutdown.store(true, Ordering::SeqCst);
        self.inner.changed.notify_all();
        if let Some(t) = self.accept.take() {
            let _ = t.join(); // the listener closes with it
        }
        for c in lock(&self.inner.conns).values() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        let threads = std::mem::take(&mut *lock(&self.inner.threads));
        for t in threads {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Connections

/// Polls `f` every few milliseconds for up to 2 s.
fn wait_until(f: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(2);
    while !f() {
        if Instant::now() > deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(5));
    }
    true
}

/// A non-blocking listener on `addr`, made inside `netns` when given (a socket keeps the
/// namespace it was made in).
fn bind(netns: Option<&str>, addr: SocketAddr) -> std::io::Result<TcpListener> {
    let make = || TcpListener::bind(addr).and_then(|l| l.set_nonblocking(true).map(|()| l));
    match netns {
        None => make(),
        Some(ns) => {
            crate::netns::in_netns(ns, make).map_err(|e| std::io::Error::other(format!("{e:#}")))?
        }
    }
}

fn accept_loop(inner: &Arc<Inner>, listener: TcpListener) {
    let mut listener = Some(listener);
    while !inner.stopping() {
        if inner.outage.load(Ordering::SeqCst) {
            listener = None; // closes the port
            inner.closed.store(true, Ordering::SeqCst);
            thread::sleep(Duration::from_millis(5));
            continue;
        }
        let Some(l) = &listener else {
            // std sets SO_REUSEADDR, so the port can be bound again at once.
            match bind(inner.netns.as_deref(), inner.addr) {
                Ok(l) => {
                    listener = Some(l);
                    inner.closed.store(false, Ordering::SeqCst);
                }
                Err(_) => thread::sleep(Duration::from_millis(20)),
            }
            continue;
        };
        match l.accept() {
            Ok((stream, _)) => {
                let id = inner.next_conn.fetch_add(1, Ordering::SeqCst);
                let setup = stream
                    .set_nonblocking(false)
                    .and_then(|()| stream.set_nodelay(true))
                    .and_then(|()| stream.set_read_timeout(Some(TICK)))
                    .and_then(|()| stream.set_write_timeout(Some(Duration::from_secs(5))))
                    .and_then(|()| stream.try_clone());
                let Ok(clone) = setup else { continue };
                lock(&inner.conns).insert(
                    id,
                    Conn {
                        stream: clone,
                        watching: false,
                    },
                );
                let worker = inner.clone();
                let spawned = thread::Builder::new()
                    .name(format!("fake-apiserver-{id}"))
                    .spawn(move || {
                        serve_connection(&worker, stream, id);
                        lock(&worker.conns).remove(&id);
                    });
                let mut threads = lock(&inner.threads);
                threads.retain(|t| !t.is_finished());
                match spawned {
                    Ok(t) => threads.push(t),
                    Err(_) => {
                        lock(&inner.conns).remove(&id);
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(5))
            }
            Err(_) => thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// What to do with the connection after a response.
#[derive(PartialEq)]
enum After {
    KeepAlive,
    Close,
}

fn serve_connection(inner: &Inner, mut stream: TcpStream, id: u64) {
    let mut buf = Vec::new();
    let mut sent_continue = false;
    let mut idle_since = Instant::now();
    let mut chunk = [0u8; 16 * 1024];
    while !inner.stopping() {
        match http::parse(&buf) {
            Ok(Parsed::Complete(req, used)) => {
                buf.drain(..used);
                sent_continue = false;
                lock(&inner.requests).push(format!("{} {}", req.method, req.target));
                let keep = req.keep_alive;
                let after = handle(inner, &mut stream, id, &req);
                if after == After::Close || !keep {
                    break;
                }
                idle_since = Instant::now();
                continue;
            }
            Ok(Parsed::Partial { expect_continue }) => {
                if expect_continue && !sent_continue {
                    sent_continue = true;
                    if stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").is_err() {
                        break;
                    }
                }
            }
            Err(e) => {
                let status = Status::new(
                    e.code,
                    match e.code {
                        400 => "BadRequest",
                        413 => "RequestEntityTooLarge",
                        _ => "",
                    },
                    e.message,
                );
                let _ = stream.write_all(&json_response(e.code, &status.to_json(), false));
                break;
            }
        }
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                idle_since = Instant::now();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                if idle_since.elapsed() > IDLE_TIMEOUT {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
}

fn json_response(code: u16, body: &Value, keep_alive: bool) -> Vec<u8> {
    let mut text = serde_json::to_vec(body).unwrap_or_default();
    text.push(b'\n');
    http::response(code, "application/json", &text, keep_alive)
}

fn respond(stream: &mut TcpStream, req: &Request, result: Result<(u16, Value), Status>) -> After {
    let bytes = match result {
        Ok((code, body)) => json_response(code, &body, req.keep_alive),
        Err(status) => json_response(status.code, &status.to_json(), req.keep_alive),
    };
    match stream.write_all(&bytes) {
        Ok(()) => After::KeepAlive,
        Err(_) => After::Close,
    }
}

// ---------------------------------------------------------------------------------------------
// Routing

enum Route {
    Json(Value),
    Text(&'static str),
    Collection {
        res: usize,
        ns: Option<String>,
    },
    Object {
        res: usize,
        ns: Option<String>,
        name: String,
    },
}

fn not_found() -> Status {
    Status::new(
        404,
        "NotFound",
        "the server could not find the requested resource",
    )
}

fn group_resources(group: &str, version: &str) -> Vec<(usize, &'static ResourceDef)> {
    RESOURCES
        .iter()
        .enumerate()
        .filter(|(_, r)| r.group == group && r.version == version)
        .collect()
}

fn groups() -> Vec<&'static str> {
    let mut gs: Vec<&str> = RESOURCES
        .iter()
        .map(|r| r.group)
        .filter(|g| !g.is_empty())
        .collect();
    gs.dedup();
    gs
}

fn group_json(group: &str) -> Value {
    let gv = json!({"groupVersion": format!("{group}/v1"), "version": "v1"});
    json!({"name": group, "versions": [gv.clone()], "preferredVersion": gv})
}

fn resource_list(group: &str, version: &str) -> Value {
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    let resources: Vec<Value> = group_resources(group, version)
        .into_iter()
        .map(|(_, r)| {
            json!({
                "name": r.plural,
                "singularName": r.singular,
                "namespaced": r.namespaced,
                "kind": r.kind,
                "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
            })
        })
        .collect();
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources})
}

fn route(inner: &Inner, path: &str) -> Result<Route, Status> {
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let server_address = inner.addr.to_string();
    let (group, version, rest) = match segs.as_slice() {
        ["api"] => {
            return Ok(Route::Json(json!({
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
            })));
        }
        ["apis"] => {
            let groups: Vec<Value> = groups().into_iter().map(group_json).collect();
            return Ok(Route::Json(
                json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}),
            ));
        }
        ["apis", g] if groups().contains(g) => {
            let mut v = group_json(g);
            v["kind"] = "APIGroup".into();
            v["apiVersion"] = "v1".into();
            return Ok(Route::Json(v));
        }
        ["version"] => {
            return Ok(Route::Json(json!({
                "major": "1",
                "minor": "33",
                "gitVersion": "v1.33.0-fastpath-fake",
                "gitCommit": "0000000000000000000000000000000000000000",
                "gitTreeState": "clean",
                "buildDate": "2025-04-23T00:00:00Z",
                "goVersion": "go1.24.2",
                "compiler": "gc",
                "platform": "linux/amd64",
            })));
        }
        ["healthz" | "livez" | "readyz"] => return Ok(Route::Text("ok")),
        ["api", "v1", rest @ ..] => ("", "v1", rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Err(not_found()),
    };
    let resources = group_resources(group, version);
    if resources.is_empty() {
        return Err(not_found());
    }
    let hidden = lock(&inner.hidden).clone();
    let find = |plural: &str| {
        (!hidden.contains(&plural))
            .then(|| resources.iter().find(|(_, r)| r.plural == plural).copied())
            .flatten()
    };
    match rest {
        [] => Ok(Route::Json(resource_list(group, version))),
        [plural] => find(plural)
            .map(|(res, _)| Route::Collection { res, ns: None })
            .ok_or_else(not_found),
        ["namespaces", ns, plural] => match find(plural) {
            Some((res, r)) if r.namespaced => Ok(Route::Collection {
                res,
                ns: Some(ns.to_string()),
            }),
            _ => Err(not_found()),
        },
        ["namespaces", ns, plural, name] => match find(plural) {
            Some((res, r)) if r.namespaced => Ok(Route::Object {
                res,
                ns: Some(ns.to_string()),
                name: name.to_string(),
            }),
            _ => Err(not_found()),
        },
        [plural, name] => match find(plural) {
            Some((res, r)) if !r.namespaced => Ok(Route::Object {
                res,
                ns: None,
                name: name.to_string(),
            }),
            _ => Err(not_found()),
        },
        _ => Err(not_found()),
    }
}

fn method_not_allowed(req: &Request) -> Status {
    Status::new(
        405,
        "MethodNotAllowed",
        format!(
            "the server does not allow this method on the requested resource: {}",
            req.method
        ),
    )
}

fn parse_body(req: &Request) -> Result<Value, Status> {
    serde_json::from_slice(&req.body).map_err(|e| {
        Status::bad_request(format!(
            "the body of the request could not be decoded as JSON: {e}"
        ))
    })
}

fn is_true(v: Option<&str>) -> bool {
    matches!(v, Some("true" | "1" | "True"))
}

fn handle(inner: &Inner, stream: &mut TcpStream, conn: u64, req: &Request) -> After {
    let route = match route(inner, &req.path) {
        Ok(r) => r,
        Err(e) => return respond(stream, req, Err(e)),
    };
    match (req.method.as_str(), route) {
        ("GET", Route::Json(v)) => respond(stream, req, Ok((200, v))),
        ("GET", Route::Text(t)) => {
            let bytes = http::response(
                200,
                "text/plain; charset=utf-8",
                t.as_bytes(),
                req.keep_alive,
            );
            if stream.write_all(&bytes).is_ok() {
                After::KeepAlive
            } else {
                After::Close
            }
        }
        (_, Route::Json(_) | Route::Text(_)) => respond(stream, req, Err(method_not_allowed(req))),
        ("GET", Route::Collection { res, ns }) => {
            if is_true(req.param("watch")) {
                watch(inner, stream, conn, req, res, ns, None)
            } else {
                match list(inner, req, res, ns) {
                    Ok(mut text) => {
                        text.push(b'\n');
                        let bytes = http::response(200, "application/json", &text, req.keep_alive);
                        match stream.write_all(&bytes) {
                            Ok(()) => After::KeepAlive,
                            Err(_) => After::Close,
                        }
                    }
                    Err(status) => respond(stream, req, Err(status)),
                }
            }
        }
        ("POST", Route::Collection { res, ns }) => {
            let result = if RESOURCES[res].namespaced && ns.is_none() {
                Err(method_not_allowed(req))
            } else {
                parse_body(req).and_then(|obj| inner.mutate(|s| s.create(res, ns.as_deref(), obj)))
            };
            respond(stream, req, result.map(|v| (201, v)))
        }
        (_, Route::Collection { .. }) => respond(stream, req, Err(method_not_allowed(req))),
        ("GET", Route::Object { res, ns, name }) => {
            if is_true(req.param("watch")) {
                watch(inner, stream, conn, req, res, ns, Some(name))
            } else {
                let result = inner.state().get(res, ns.as_deref(), &name);
                respond(stream, req, result.map(|v| (200, v)))
            }
        }
        ("PUT", Route::Object { res, ns, name }) => {
            let result = parse_body(req).and_then(|obj| {
                inner.mutate(|s| s.update(res, Some((ns.as_deref(), &name)), obj, true))
            });
            respond(stream, req, result.map(|v| (200, v)))
        }
        ("DELETE", Route::Object { res, ns, name }) => {
            let result = inner.mutate(|s| s.delete(res, ns.as_deref(), &name));
            respond(stream, req, result.map(|v| (200, v)))
        }
        ("PATCH", Route::Object { res, ns, name }) => {
            let ct = req.header("content-type").unwrap_or_default();
            let result = if ct.split(';').next().unwrap_or_default().trim()
                != "application/merge-patch+json"
            {
                Err(Status::new(
                    415,
                    "UnsupportedMediaType",
                    format!(
                        "the body of the request was in an unknown format - accepted media types include: application/merge-patch+json (got {ct:?})"
                    ),
                ))
            } else {
                parse_body(req).and_then(|patch| {
                    inner.mutate(|s| {
                        let mut obj = s.get(res, ns.as_deref(), &name)?;
                        store::merge_patch(&mut obj, &patch);
                        s.update(res, Some((ns.as_deref(), &name)), obj, true)
                    })
                })
            };
            respond(stream, req, result.map(|v| (200, v)))
        }
        (_, Route::Object { .. }) => respond(stream, req, Err(method_not_allowed(req))),
    }
}

// ---------------------------------------------------------------------------------------------
// List

fn parse_rv(s: &str) -> Result<u64, Status> {
    s.parse::<u64>()
        .map_err(|_| Status::bad_request(format!("invalid resource version {s:?}")))
}

fn filter_of(req: &Request, res: usize, ns: Option<String>) -> Result<Filter, Status> {
    let labels = LabelSelector::parse(req.param("labelSelector").unwrap_or_default())
        .map_err(Status::bad_request)?;
    let fields = FieldSelector::parse(
        req.param("fieldSelector").unwrap_or_default(),
        &RESOURCES[res],
    )
    .map_err(Status::bad_request)?;
    Ok(Filter {
        res,
        namespace: ns,
        labels,
        fields,
    })
}

/// Waits (bounded) until the global resourceVersion reaches `rv`.
fn wait_for_rv<'a>(
    inner: &'a Inner,
    mut state: MutexGuard<'a, State>,
    rv: u64,
) -> Result<MutexGuard<'a, State>, Status> {
    let deadline = Instant::now() + TOO_LARGE_WAIT;
    while state.rv < rv {
        let now = Instant::now();
        if now >= deadline || inner.stopping() {
            return Err(Status::too_large(rv, state.rv));
        }
        state = inner
            .changed
            .wait_timeout(state, (deadline - now).min(TICK))
            .map(|(g, _)| g)
            .unwrap_or_else(|e| e.into_inner().0);
    }
    Ok(state)
}

enum ListAt {
    Current,
    NotOlderThan(u64),
    Exact(u64),
}

/// A list's response body, serialized while the store is locked (the page borrows its
/// objects).
fn list(inner: &Inner, req: &Request, res: usize, ns: Option<String>) -> Result<Vec<u8>, Status> {
    let def = &RESOURCES[res];
    let filter = filter_of(req, res, ns)?;
    if is_true(req.param("sendInitialEvents")) {
        return Err(Status::new(
            422,
            "Invalid",
            "sendInitialEvents: Forbidden: sendInitialEvents is forbidden for list",
        ));
    }
    let limit = match req.param("limit") {
        None | Some("") => None,
        Some(l) => match l.parse::<i64>() {
            Ok(n) if n > 0 => Some(n as usize),
            Ok(_) => None,
            Err(_) => return Err(Status::bad_request(format!("invalid limit {l:?}"))),
        },
    };
    let rv = req.param("resourceVersion").filter(|s| !s.is_empty());
    let rvm = req.param("resourceVersionMatch").filter(|s| !s.is_empty());
    let cont = req.param("continue").filter(|s| !s.is_empty());

    let (at, cont, limit) = if let Some(token) = cont {
        if rvm.is_some() {
            return Err(Status::bad_request(
                "resourceVersionMatch is forbidden when continue is provided",
            ));
        }
        if rv.is_some_and(|v| v != "0") {
            return Err(Status::bad_request(
                "specifying resource version is not allowed when using continue",
            ));
        }
        let Some(cont) = store::decode_continue(token) else {
            return Err(Status::bad_request(
                "continue key is not valid: illegal base64 data or bad version",
            ));
        };
        (ListAt::Exact(cont.rv), Some(cont), limit)
    } else {
        match (rvm, rv) {
            (None, None) => (ListAt::Current, None, limit),
            // "Any": served like the watch cache does, which ignores the limit.
            (None | Some("NotOlderThan"), Some("0")) => (ListAt::Current, None, None),
            (None, Some(v)) if limit.is_some() => (ListAt::Exact(parse_rv(v)?), None, limit),
            (None | Some("NotOlderThan"), Some(v)) => {
                (ListAt::NotOlderThan(parse_rv(v)?), None, limit)
            }
            (Some("Exact"), Some(v)) if v != "0" => (ListAt::Exact(parse_rv(v)?), None, limit),
            (Some("Exact"), _) => {
                return Err(Status::bad_request(
                    "resourceVersionMatch \"Exact\" requires a non-zero resourceVersion",
                ));
            }
            (Some("NotOlderThan"), None) => {
                return Err(Status::bad_request(
                    "resourceVersionMatch is forbidden unless resourceVersion is provided",
                ));
            }
            (Some(m), _) => {
                return Err(Status::bad_request(format!(
                    "unsupported resourceVersionMatch {m:?}: supported values are \"Exact\", \"NotOlderThan\""
                )));
            }
        }
    };

    let mut state = inner.state();
    let (list_rv, page) = match at {
        ListAt::Current => (state.rv, state.page(res, None, &filter, None, limit)?),
        ListAt::NotOlderThan(n) => {
            state = wait_for_rv(inner, state, n)?;
            (state.rv, state.page(res, None, &filter, None, limit)?)
        }
        ListAt::Exact(n) => {
            state = wait_for_rv(inner, state, n)?;
            if n < state.floor {
                return Err(if cont.is_some() {
                    Status::expired(
                        "The provided continue parameter is too old to display a consistent list result. \
                         You can start a new list without the continue parameter, or use the continue token \
                         in this response to retrieve the remainder of the results. Continuing with the \
                         provided token results in an inconsistent list - objects that were created, \
                         modified, or deleted between the time the first chunk was returned and now may \
                         show up in the list.",
                    )
                } else {
                    Status::too_old(n, state.floor)
                });
            }
            (n, state.page(res, Some(n), &filter, cont.as_ref(), limit)?)
        }
    };

    let mut metadata = json!({"resourceVersion": list_rv.to_string()});
    if let Some(last) = page.next {
        metadata["continue"] = store::encode_continue(&store::Continue {
            rv: list_rv,
            start: last,
            remaining: page.remaining,
        })
        .into();
        if let Some(remaining) = page.remaining.filter(|_| !filter.has_selectors()) {
            metadata["remainingItemCount"] = remaining.into();
        }
    }
    let body = json!({
        "kind": format!("{}List", def.kind),
        "apiVersion": def.api_version(),
        "metadata": metadata,
    });
    let items: Vec<store::ListItem> = page.items.iter().map(|o| store::ListItem(o)).collect();
    let text = serde_json::to_vec(&ListBody {
        head: &body,
        items: &items,
    });
    drop(state);
    text.map_err(|e| Status::new(500, "InternalError", e.to_string()))
}

/// `{kind, apiVersion, metadata, items}`: the head's fields, then the items.
struct ListBody<'a> {
    head: &'a Value,
    items: &'a [store::ListItem<'a>],
}

impl serde::Serialize for ListBody<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        let mut out = s.serialize_map(None)?;
        if let Value::Object(head) = self.head {
            for (k, v) in head {
                out.serialize_entry(k, v)?;
            }
        }
        out.serialize_entry("items", self.items)?;
        out.end()
    }
}

// ---------------------------------------------------------------------------------------------
// Watch

fn event_line(kind: &str, obj: &Value) -> Vec<u8> {
    let mut line = serde_json::to_vec(&json!({"type": kind, "object": obj})).unwrap_or_default();
    line.push(b'\n');
    line
}

fn bookmark(def: &ResourceDef, rv: u64, initial_end: bool) -> Value {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    json!({"kind": def.kind, "apiVersion": def.api_version(), "metadata": meta})
}

/// Whether the client has closed its end (without consuming anything it sent).
fn peer_closed(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let mut b = [0u8; 1];
    let closed = match stream.peek(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        ),
    };
    stream.set_nonblocking(false).is_err() || closed
}

fn set_watching(inner: &Inner, conn: u64, watching: bool) {
    if let Some(c) = lock(&inner.conns).get_mut(&conn) {
        c.watching = watching;
    }
}

/// Parses the watch parameters and registers the watch; on success returns its id, the
/// events to send first, and the resourceVersion bookmarks start from.
struct WatchStart {
    id: u64,
    initial: Vec<u8>,
    /// If set, send this Status as the only event and end.
    expired: Option<Status>,
}

fn start_watch(
    inner: &Inner,
    req: &Request,
    res: usize,
    ns: Option<String>,
    name: Option<String>,
) -> Result<WatchStart, Status> {
    let def = &RESOURCES[res];
    let mut filter = filter_of(req, res, ns)?;
    if let Some(n) = &name {
        filter.fields.push_name(n);
    }
    let bookmarks = is_true(req.param("allowWatchBookmarks"));
    let initial_events = match req.param("sendInitialEvents") {
        None | Some("") => None,
        Some("true" | "1") => Some(true),
        Some("false" | "0") => Some(false),
        Some(v) => {
            return Err(Status::bad_request(format!(
                "invalid sendInitialEvents {v:?}"
            )));
        }
    };
    let rvm = req.param("resourceVersionMatch").filter(|s| !s.is_empty());
    match (initial_events, rvm) {
        (None, Some(_)) => {
            return Err(Status::new(
                422,
                "Invalid",
                "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
            ));
        }
        (Some(_), m) if m != Some("NotOlderThan") => {
            return Err(Status::new(
                422,
                "Invalid",
                "resourceVersionMatch: Unsupported value: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
            ));
        }
        (Some(true), _) if !bookmarks => {
            return Err(Status::new(
                422,
                "Invalid",
                "allowWatchBookmarks: Required value: allowWatchBookmarks required when sendInitialEvents is true",
            ));
        }
        _ => {}
    }
    let rv = match req.param("resourceVersion").filter(|s| !s.is_empty()) {
        None | Some("0") => None,
        Some(v) => Some(parse_rv(v)?),
    };

    let mut state = inner.state();
    if let Some(n) = rv {
        state = wait_for_rv(inner, state, n)?;
    }
    let mut initial = Vec::new();
    let mut expired = None;
    let send_state = initial_events.unwrap_or(rv.is_none());
    if send_state {
        for obj in state.stores[res].values().filter(|o| filter.matches(o)) {
            initial.extend(event_line("ADDED", obj));
        }
        if initial_events == Some(true) {
            initial.extend(event_line("BOOKMARK", &bookmark(def, state.rv, true)));
        }
    } else if let Some(n) = rv {
        if n < state.floor {
            expired = Some(Status::too_old(n, state.floor));
        } else {
            for (kind, obj) in state.replay(&filter, n) {
                initial.extend(event_line(kind, &obj));
            }
        }
    }
    let id = state.next_watch;
    state.next_watch += 1;
    if expired.is_none() {
        state.watches.insert(
            id,
            WatchSlot {
                filter,
                queue: Vec::new(),
                dropped: false,
            },
        );
    }
    drop(state);
    inner.changed.notify_all();
    Ok(WatchStart {
        id,
        initial,
        expired,
    })
}

fn watch(
    inner: &Inner,
    stream: &mut TcpStream,
    conn: u64,
    req: &Request,
    res: usize,
    ns: Option<String>,
    name: Option<String>,
) -> After {
    let def = &RESOURCES[res];
    let timeout = match req.param("timeoutSeconds").filter(|s| !s.is_empty()) {
        None => DEFAULT_WATCH_TIMEOUT,
        Some(t) => match t.parse::<u64>() {
            Ok(n) => Duration::from_secs(n),
            Err(_) => {
                return respond(
                    stream,
                    req,
                    Err(Status::bad_request(format!("invalid timeoutSeconds {t:?}"))),
                );
            }
        },
    };
    let deadline = Instant::now() + timeout;
    let bookmarks = is_true(req.param("allowWatchBookmarks"));
    let start = match start_watch(inner, req, res, ns, name) {
        Ok(s) => s,
        Err(e) => return respond(stream, req, Err(e)),
    };
    let id = start.id;
    let unregister = || {
        inner.state().watches.remove(&id);
        inner.changed.notify_all();
    };

    let mut out = http::chunked_head(200, "application/json");
    if let Some(status) = start.expired {
        http::push_chunk(&mut out, &event_line("ERROR", &status.to_json()));
        out.extend_from_slice(http::LAST_CHUNK);
        return if stream.write_all(&out).is_ok() {
            After::KeepAlive
        } else {
            After::Close
        };
    }
    set_watching(inner, conn, true);
    http::push_chunk(&mut out, &start.initial);
    if stream.write_all(&out).is_err() {
        unregister();
        return After::Close;
    }

    let mut last_bookmark = Instant::now();
    let mut last_peek = Instant::now();
    let after = loop {
        let mut state = inner.state();
        let interval = state.bookmark_interval;
        let bookmark_due = |now: Instant, last: Instant| {
            bookmarks && !interval.is_zero() && now.duration_since(last) >= interval
        };
        while let Some(slot) = state.watches.get(&id) {
            let now = Instant::now();
            if !slot.queue.is_empty()
                || slot.dropped
                || inner.stopping()
                || now >= deadline
                || bookmark_due(now, last_bookmark)
            {
                break;
            }
            if now.duration_since(last_peek) >= TICK {
                break; // go look whether the client is still there
            }
            let mut wait = (deadline - now).min(TICK);
            if bookmarks && !interval.is_zero() {
                wait = wait.min((last_bookmark + interval).saturating_duration_since(now));
            }
            state = inner
                .changed
                .wait_timeout(state, wait.max(Duration::from_millis(1)))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        let now = Instant::now();
        let Some(slot) = state.watches.get_mut(&id) else {
            break After::Close;
        };
        if slot.dropped || inner.stopping() {
            break After::Close;
        }
        let events = std::mem::take(&mut slot.queue);
        let rv = state.rv;
        drop(state);

        let mut out = Vec::new();
        for (kind, obj) in &events {
            http::push_chunk(&mut out, &event_line(kind, obj));
        }
        if bookmark_due(now, last_bookmark) {
            http::push_chunk(&mut out, &event_line("BOOKMARK", &bookmark(def, rv, false)));
            last_bookmark = now;
        }
        let done = now >= deadline;
        if done {
            out.extend_from_slice(http::LAST_CHUNK);
        }
        if !out.is_empty() && stream.write_all(&out).is_err() {
            break After::Close;
        }
        if done {
            break After::KeepAlive;
        }
        if now.duration_since(last_peek) >= TICK {
            last_peek = now;
            if peer_closed(stream) {
                break After::Close;
            }
        }
    };
    unregister();
    set_watching(inner, conn, false);
    if after == After::Close {
        let _ = stream.shutdown(Shutdown::Both); // abrupt: no last chunk
    }
    after
}

#[cfg(test)]
mod tests;
