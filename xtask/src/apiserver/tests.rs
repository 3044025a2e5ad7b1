//! Tests of the fake API server through real HTTP, with a tiny client over TcpStream.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use serde_json::{Value, json};

use super::ApiServer;

const TIMEOUT: Duration = Duration::from_secs(5);

/// One HTTP/1.1 connection, kept alive across requests.
struct Client {
    stream: TcpStream,
    buf: Vec<u8>,
}

struct Response {
    code: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Response {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// What a watch stream yields next.
#[derive(Debug)]
enum Next {
    Event(Value),
    /// The chunked body ended cleanly.
    End,
    /// The connection closed or broke mid-body.
    Closed,
    /// Nothing arrived in time.
    Timeout,
}

impl Client {
    fn connect(addr: SocketAddr) -> Client {
        let stream = TcpStream::connect_timeout(&addr, TIMEOUT).expect("connect");
        stream.set_read_timeout(Some(TIMEOUT)).unwrap();
        Client {
            stream,
            buf: Vec::new(),
        }
    }

    fn send(&mut self, method: &str, target: &str, body: Option<&Value>, extra: &str) {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let req = format!(
            "{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: application/json\r\n{extra}\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        self.stream.write_all(req.as_bytes()).expect("send");
    }

    /// Reads more bytes into the buffer; false on EOF, error or timeout.
    fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 8192];
        match self.stream.read(&mut chunk) {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
        }
    }

    fn line(&mut self) -> Option<String> {
        loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line = String::from_utf8_lossy(&self.buf[..i]).into_owned();
                self.buf.drain(..i + 2);
                return Some(line);
            }
            if !self.fill() {
                return None;
            }
        }
    }

    fn head(&mut self) -> (u16, Vec<(String, String)>) {
        let status = self.line().expect("status line");
        let code = status
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .expect("status code");
        let mut headers = Vec::new();
        loop {
            let line = self.line().expect("header line");
            if line.is_empty() {
                break;
            }
            let (k, v) = line.split_once(':').expect("header");
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
        (code, headers)
    }

    fn response(&mut self) -> Response {
        let (code, headers) = self.head();
        let len: usize = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .map(|(_, v)| v.parse().unwrap())
            .expect("content-length on a plain response");
        while self.buf.len() < len {
            assert!(self.fill(), "body cut short");
        }
        let body = self.buf.drain(..len).collect();
        Response {
            code,
            headers,
            body,
        }
    }

    fn request(&mut self, method: &str, target: &str, body: Option<&Value>) -> Response {
        self.send(method, target, body, "");
        self.response()
    }

    fn get(&mut self, target: &str) -> Response {
        self.request("GET", target, None)
    }

    /// Starts a watch; returns the reader once the head is in.
    fn watch(mut self, target: &str) -> Watch {
        self.send("GET", target, None, "");
        let (code, headers) = self.head();
        assert_eq!(code, 200, "watch {target}");
        assert!(
            headers
                .iter()
                .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v == "chunked")
        );
        Watch {
            client: self,
            lines: Vec::new(),
            ended: false,
        }
    }
}

struct Watch {
    client: Client,
    /// Bytes of the body not yet split into lines.
    lines: Vec<u8>,
    ended: bool,
}

impl Watch {
    fn next(&mut self, timeout: Duration) -> Next {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.lines.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.lines.drain(..=i).collect();
                return Next::Event(serde_json::from_slice(&line).expect("event JSON"));
            }
            if self.ended {
                return Next::End;
            }
            // Read one chunk.
            let c = &mut self.client;
            let size_line = loop {
                if let Some(i) = c.buf.windows(2).position(|w| w == b"\r\n") {
                    let l = String::from_utf8_lossy(&c.buf[..i]).into_owned();
                    c.buf.drain(..i + 2);
                    break l;
                }
                let now = Instant::now();
                if now >= deadline {
                    return Next::Timeout;
                }
                c.stream
                    .set_read_timeout(Some((deadline - now).max(Duration::from_millis(1))))
                    .unwrap();
                let mut chunk = [0u8; 8192];
                match c.stream.read(&mut chunk) {
                    Ok(0) => return Next::Closed,
                    Ok(n) => c.buf.extend_from_slice(&chunk[..n]),
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) =>
                    {
                        return Next::Timeout;
                    }
                    Err(_) => return Next::Closed,
                }
            };
            let size = usize::from_str_radix(size_line.trim(), 16).expect("chunk size");
            c.stream.set_read_timeout(Some(TIMEOUT)).unwrap();
            while c.buf.len() < size + 2 {
                if !c.fill() {
                    return Next::Closed;
                }
            }
            let data: Vec<u8> = c.buf.drain(..size + 2).collect();
            if size == 0 {
                self.ended = true;
            } else {
                self.lines.extend_from_slice(&data[..size]);
            }
        }
    }

    /// The next event that is not a BOOKMARK.
    fn event(&mut self) -> Value {
        loop {
            match self.next(TIMEOUT) {
                Next::Event(e) if e["type"] == "BOOKMARK" => continue,
                Next::Event(e) => return e,
                other => panic!("expected an event, got {other:?}"),
            }
        }
    }
}

fn service(name: &str, labels: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {"clusterIP": "198.19.96.10", "ports": [{"port": 80, "protocol": "TCP"}]},
    })
}

fn rv_of(v: &Value) -> u64 {
    v["metadata"]["resourceVersion"]
        .as_str()
        .expect("resourceVersion")
        .parse()
        .expect("numeric RV")
}

#[test]
fn apiserver_lists_and_gets() {
    let server = ApiServer::start().unwrap();
    let a = server.create("services", service("a", json!({"app": "web"})));
    assert_eq!(a["metadata"]["namespace"], "default");
    assert!(a["metadata"]["uid"].as_str().unwrap().len() == 36);
    assert!(
        a["metadata"]["creationTimestamp"]
            .as_str()
            .unwrap()
            .ends_with('Z')
    );
    server.create(
        "services",
        json!({"metadata": {"name": "b", "namespace": "other"}}),
    );
    server.create(
        "nodes",
        json!({"metadata": {"name": "n1", "namespace": "ignored"}}),
    );
    server.create(
        "endpointslices",
        json!({"metadata": {"name": "a-x1", "labels": {"kubernetes.io/service-name": "a"}}, "addressType": "IPv4", "endpoints": []}),
    );

    let mut c = Client::connect(server.addr());
    let r = c.get("/api/v1/services");
    assert_eq!(r.code, 200);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let list = r.json();
    assert_eq!(list["kind"], "ServiceList");
    assert_eq!(list["apiVersion"], "v1");
    assert_eq!(rv_of(&list), server.resource_version());
    let items = list["items"].as_array().unwrap();
    assert_eq!(items.len(), 2);
    assert!(
        items
            .iter()
            .all(|i| i.get("kind").is_none() && rv_of(i) > 1)
    );
    assert!(list["metadata"].get("continue").is_none());

    // Same connection (keep-alive): namespaced list, single get, cluster-scoped, other group.
    let list = c.get("/api/v1/namespaces/other/services?").json();
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    assert_eq!(list["items"][0]["metadata"]["name"], "b");
    let got = c.get("/api/v1/namespaces/default/services/a");
    assert_eq!(got.code, 200);
    assert_eq!(got.json(), a);
    let node = c.get("/api/v1/nodes/n1").json();
    assert_eq!(node["kind"], "Node");
    assert!(node["metadata"].get("namespace").is_none());
    let slices = c
        .get("/apis/discovery.k8s.io/v1/namespaces/default/endpointslices")
        .json();
    assert_eq!(slices["kind"], "EndpointSliceList");
    assert_eq!(slices["apiVersion"], "discovery.k8s.io/v1");
    assert_eq!(slices["items"][0]["addressType"], "IPv4");

    // Errors are Status objects.
    let missing = c.get("/api/v1/namespaces/default/services/nope");
    assert_eq!(missing.code, 404);
    let st = missing.json();
    assert_eq!(
        (
            st["kind"].as_str(),
            st["reason"].as_str(),
            st["code"].as_u64()
        ),
        (Some("Status"), Some("NotFound"), Some(404))
    );
    assert_eq!(c.get("/api/v1/pods").code, 404);
    assert_eq!(
        c.get("/api/v1/services/a").code,
        404,
        "namespaced object needs a namespace"
    );

    // Discovery and version.
    let version = c.get("/version").json();
    assert_eq!(version["major"], "1");
    assert!(version["gitVersion"].as_str().unwrap().starts_with("v1."));
    assert_eq!(c.get("/api").json()["versions"][0], "v1");
    assert_eq!(
        c.get("/apis").json()["groups"][0]["name"],
        "discovery.k8s.io"
    );
    let core = c.get("/api/v1").json();
    assert!(
        core["resources"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["name"] == "services")
    );

    // Field selectors.
    let list = c
        .get("/api/v1/services?fieldSelector=metadata.namespace%3Dother")
        .json();
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    let list = c
        .get("/api/v1/nodes?fieldSelector=metadata.name%3Dn1")
        .json();
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    assert_eq!(
        c.get("/api/v1/nodes?fieldSelector=spec.bogus%3D1").code,
        400
    );

    // Lists at a resourceVersion: not older than (current, here) and too large (504 after 3 s
    // is too slow for a test, so just the exact too-old case after compaction).
    let rv = server.resource_version();
    assert_eq!(
        rv_of(
            &c.get(&format!("/api/v1/services?resourceVersion={rv}"))
                .json()
        ),
        rv
    );
    assert_eq!(
        rv_of(&c.get("/api/v1/services?resourceVersion=0").json()),
        rv
    );
    server.compact();
    let r = c.get(&format!(
        "/api/v1/services?resourceVersion={}&resourceVersionMatch=Exact",
        rv - 1
    ));
    assert_eq!(r.code, 410);
    assert_eq!(r.json()["reason"], "Expired");
    assert_eq!(
        c.get("/api/v1/services?resourceVersionMatch=Exact").code,
        400
    );
}

#[test]
fn apiserver_watch_sees_changes_in_order() {
    let server = ApiServer::start().unwrap();
    server.create("services", service("old", json!({})));
    let list = Client::connect(server.addr())
        .get("/api/v1/services")
        .json();
    let rv = rv_of(&list);

    let mut w = Client::connect(server.addr())
        .watch(&format!("/api/v1/services?watch=true&timeoutSeconds=30&allowWatchBookmarks=true&resourceVersion={rv}"));
    assert!(server.wait_for_watches(1, TIMEOUT));
    let created = server.create("services", service("web", json!({"app": "web"})));
    let mut changed = created.clone();
    changed["spec"]["ports"][0]["port"] = json!(8080);
    let updated = server.update("services", changed);
    assert!(rv_of(&updated) > rv_of(&created));
    let deleted = server.delete("services", None, "web").expect("deleted");

    let e = w.event();
    assert_eq!(e["type"], "ADDED");
    assert_eq!(e["object"], created);
    assert_eq!(e["object"]["kind"], "Service");
    let e = w.event();
    assert_eq!(e["type"], "MODIFIED");
    assert_eq!(e["object"]["spec"]["ports"][0]["port"], 8080);
    assert_eq!(rv_of(&e["object"]), rv_of(&updated));
    let e = w.event();
    assert_eq!(e["type"], "DELETED");
    assert_eq!(rv_of(&e["object"]), rv_of(&deleted));
    assert!(rv_of(&deleted) > rv_of(&updated));

    // A watch from the list's RV replays the same history; one from "0" starts with the state.
    let mut replay = Client::connect(server.addr())
        .watch(&format!("/api/v1/services?watch=1&resourceVersion={rv}"));
    let kinds: Vec<Value> = (0..3).map(|_| replay.event()["type"].clone()).collect();
    assert_eq!(kinds, [json!("ADDED"), json!("MODIFIED"), json!("DELETED")]);
    let mut fresh =
        Client::connect(server.addr()).watch("/api/v1/services?watch=true&resourceVersion=0");
    let e = fresh.event();
    assert_eq!(
        (e["type"].as_str(), e["object"]["metadata"]["name"].as_str()),
        (Some("ADDED"), Some("old"))
    );
    assert!(matches!(
        fresh.next(Duration::from_millis(200)),
        Next::Timeout
    ));

    // A no-op update is no change at all.
    let before = server.resource_version();
    server.apply("services", server.get("services", None, "old").unwrap());
    assert_eq!(server.resource_version(), before);

    let log = server.requests();
    assert!(
        log.iter()
            .any(|r| r.starts_with("GET /api/v1/services?watch=true&")
                && r.contains(&format!("resourceVersion={rv}")))
    );
}

#[test]
fn apiserver_label_selectors_filter_lists_and_watches() {
    let server = ApiServer::start().unwrap();
    server.create("services", service("web", json!({"app": "web"})));
    server.create("services", service("db", json!({"app": "db"})));
    server.create(
        "services",
        service(
            "headless",
            json!({"app": "web", "service.kubernetes.io/headless": ""}),
        ),
    );
    let mut c = Client::connect(server.addr());
    let names = |list: Value| -> Vec<String> {
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        names(c.get("/api/v1/services?labelSelector=app%3Dweb").json()),
        ["headless", "web"]
    );
    assert_eq!(
        names(c.get("/api/v1/services?labelSelector=app!%3Dweb").json()),
        ["db"]
    );
    assert_eq!(
        names(
            c.get("/api/v1/services?labelSelector=app%3Dweb%2C!service.kubernetes.io%2Fheadless")
                .json()
        ),
        ["web"]
    );
    assert_eq!(
        names(
            c.get("/api/v1/services?labelSelector=app+in+(db%2Cweb)%2Capp")
                .json()
        ),
        ["db", "headless", "web"]
    );
    let bad = c.get("/api/v1/services?labelSelector=a%20b%20c");
    assert_eq!(bad.code, 400);
    assert_eq!(bad.json()["reason"], "BadRequest");

    // A watch with a selector sees objects enter (ADDED) and leave (DELETED) it.
    let rv = server.resource_version();
    let mut w = Client::connect(server.addr()).watch(&format!(
        "/api/v1/services?watch=true&labelSelector=app%3Dweb&resourceVersion={rv}"
    ));
    let mut db = server.get("services", None, "db").unwrap();
    db["metadata"]["labels"]["app"] = json!("web");
    server.update("services", db.clone());
    server.create("services", service("other", json!({"app": "other"})));
    db["metadata"]["labels"]["app"] = json!("db");
    db["metadata"]["resourceVersion"] = json!("");
    let back = server.update("services", db);
    let e = w.event();
    assert_eq!(
        (e["type"].as_str(), e["object"]["metadata"]["name"].as_str()),
        (Some("ADDED"), Some("db"))
    );
    let e = w.event();
    assert_eq!(
        (e["type"].as_str(), e["object"]["metadata"]["name"].as_str()),
        (Some("DELETED"), Some("db"))
    );
    assert_eq!(
        e["object"]["metadata"]["labels"]["app"], "web",
        "DELETED carries the last matching state"
    );
    assert_eq!(rv_of(&e["object"]), rv_of(&back));
}

#[test]
fn apiserver_paginates_consistently() {
    let server = ApiServer::start().unwrap();
    for i in 0..7 {
        server.create("services", service(&format!("s{i}"), json!({})));
    }
    let mut c = Client::connect(server.addr());
    let first = c.get("/api/v1/services?limit=3").json();
    let rv = rv_of(&first);
    assert_eq!(first["items"].as_array().unwrap().len(), 3);
    assert_eq!(first["metadata"]["remainingItemCount"], 4);
    let mut token = first["metadata"]["continue"]
        .as_str()
        .expect("continue")
        .to_string();
    // Changes after the first page do not show in later pages.
    server.create("services", service("s9", json!({})));
    server.delete("services", None, "s6");
    let mut names: Vec<String> = first["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap().into())
        .collect();
    for _ in 0..5 {
        let target = format!(
            "/api/v1/services?limit=3&continue={}",
            token.replace('=', "%3D")
        );
        let page = c.get(&target).json();
        assert_eq!(rv_of(&page), rv);
        names.extend(
            page["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["metadata"]["name"].as_str().unwrap().to_string()),
        );
        match page["metadata"]["continue"].as_str() {
            Some(t) => token = t.to_string(),
            None => break,
        }
    }
    assert_eq!(names, ["s0", "s1", "s2", "s3", "s4", "s5", "s6"]);

    // A list with limit and resourceVersion is exact too; after compaction continue tokens and
    // exact lists expire.
    let exact = c
        .get(&format!("/api/v1/services?limit=100&resourceVersion={rv}"))
        .json();
    assert_eq!(exact["items"].as_array().unwrap().len(), 7);
    let again = c.get("/api/v1/services?limit=2").json();
    let token = again["metadata"]["continue"].as_str().unwrap().to_string();
    server.create("services", service("s10", json!({})));
    server.compact();
    let r = c.get(&format!("/api/v1/services?limit=2&continue={token}"));
    assert_eq!(r.code, 410);
    assert_eq!(r.json()["reason"], "Expired");
    assert_eq!(
        c.get("/api/v1/services?limit=2&continue=garbage!").code,
        400
    );
    assert_eq!(
        c.get(&format!(
            "/api/v1/services?continue={token}&resourceVersion=5"
        ))
        .code,
        400
    );
}

#[test]
fn apiserver_compaction_expires_watches() {
    let server = ApiServer::start().unwrap();
    let rv = server.resource_version();
    server.create("services", service("a", json!({})));
    // A watch already running keeps its events across a compaction.
    let mut running = Client::connect(server.addr())
        .watch(&format!("/api/v1/services?watch=true&resourceVersion={rv}"));
    assert!(server.wait_for_watches(1, TIMEOUT));
    server.create("services", service("b", json!({})));
    server.compact();
    assert_eq!(running.event()["object"]["metadata"]["name"], "a");
    assert_eq!(running.event()["object"]["metadata"]["name"], "b");

    let mut w = Client::connect(server.addr())
        .watch(&format!("/api/v1/services?watch=true&resourceVersion={rv}"));
    let e = w.event();
    assert_eq!(e["type"], "ERROR");
    let st = &e["object"];
    assert_eq!(
        (st["kind"].as_str(), st["status"].as_str()),
        (Some("Status"), Some("Failure"))
    );
    assert_eq!(
        (st["reason"].as_str(), st["code"].as_u64()),
        (Some("Expired"), Some(410))
    );
    assert!(
        st["message"]
            .as_str()
            .unwrap()
            .starts_with(&format!("too old resource version: {rv} ("))
    );
    assert!(matches!(w.next(TIMEOUT), Next::End));
    // The connection stays usable after a cleanly ended watch.
    assert_eq!(w.client.get("/api/v1/services").code, 200);
    // Watching from the current RV is fine.
    let now = server.resource_version();
    let mut ok = Client::connect(server.addr()).watch(&format!(
        "/api/v1/services?watch=true&resourceVersion={now}"
    ));
    server.delete("services", None, "a");
    assert_eq!(ok.event()["type"], "DELETED");
}

#[test]
fn apiserver_drop_watches_closes_them_abruptly() {
    let server = ApiServer::start().unwrap();
    let mut w =
        Client::connect(server.addr()).watch("/api/v1/services?watch=true&timeoutSeconds=60");
    assert!(server.wait_for_watches(1, TIMEOUT));
    let mut idle = Client::connect(server.addr());
    assert_eq!(idle.get("/healthz").code, 200);
    server.drop_watches();
    assert_eq!(server.open_watches(), 0);
    assert!(matches!(w.next(TIMEOUT), Next::Closed));
    // Other connections survive; new watches work.
    assert_eq!(idle.get("/api/v1/nodes").code, 200);
    let mut again = Client::connect(server.addr()).watch("/api/v1/nodes?watch=true");
    server.create("nodes", json!({"metadata": {"name": "n1"}}));
    assert_eq!(again.event()["type"], "ADDED");
}

#[test]
fn apiserver_bookmarks_and_timeouts() {
    let server = ApiServer::start().unwrap();
    server.set_bookmark_interval(Duration::from_millis(100));
    server.create(
        "endpointslices",
        json!({"metadata": {"name": "s"}, "addressType": "IPv4"}),
    );
    let rv = server.resource_version();
    let mut w = Client::connect(server.addr()).watch(&format!(
        "/apis/discovery.k8s.io/v1/endpointslices?watch=true&allowWatchBookmarks=true&timeoutSeconds=1&resourceVersion={rv}"
    ));
    match w.next(TIMEOUT) {
        Next::Event(e) => {
            assert_eq!(e["type"], "BOOKMARK");
            assert_eq!(e["object"]["kind"], "EndpointSlice");
            assert_eq!(e["object"]["apiVersion"], "discovery.k8s.io/v1");
            assert_eq!(rv_of(&e["object"]), rv);
        }
        other => panic!("expected a bookmark, got {other:?}"),
    }
    // timeoutSeconds=1 ends the watch cleanly.
    let start = Instant::now();
    loop {
        match w.next(TIMEOUT) {
            Next::Event(e) => assert_eq!(e["type"], "BOOKMARK"),
            Next::End => break,
            other => panic!("expected the end, got {other:?}"),
        }
    }
    assert!(start.elapsed() < Duration::from_secs(3));
    // Without allowWatchBookmarks there are none.
    let mut quiet =
        Client::connect(server.addr()).watch("/api/v1/services?watch=true&timeoutSeconds=1");
    assert!(matches!(quiet.next(TIMEOUT), Next::End));

    // Streaming list: ADDED for the state, then the initial-events-end bookmark.
    server.set_bookmark_interval(Duration::ZERO);
    let mut s = Client::connect(server.addr()).watch(
        "/apis/discovery.k8s.io/v1/endpointslices?watch=true&sendInitialEvents=true&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan",
    );
    assert_eq!(s.event()["type"], "ADDED");
    match s.next(TIMEOUT) {
        Next::Event(e) => {
            assert_eq!(e["type"], "BOOKMARK");
            assert_eq!(
                e["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
                "true"
            );
        }
        other => panic!("expected the initial-events-end bookmark, got {other:?}"),
    }
    let mut c = Client::connect(server.addr());
    assert_eq!(
        c.get("/api/v1/services?watch=true&sendInitialEvents=true")
            .code,
        422
    );
}

#[test]
fn apiserver_http_mutations_and_bad_requests() {
    let server = ApiServer::start().unwrap();
    let mut c = Client::connect(server.addr());
    let r = c.request(
        "POST",
        "/api/v1/namespaces/prod/services",
        Some(&service("web", json!({}))),
    );
    assert_eq!(r.code, 201);
    let created = r.json();
    assert_eq!(created["metadata"]["namespace"], "prod");
    assert_eq!(
        c.request(
            "POST",
            "/api/v1/namespaces/prod/services",
            Some(&service("web", json!({})))
        )
        .code,
        409
    );
    assert_eq!(
        c.request("POST", "/api/v1/services", Some(&service("x", json!({}))))
            .code,
        405
    );
    assert_eq!(
        c.request(
            "POST",
            "/api/v1/namespaces/prod/services",
            Some(&json!({"metadata": {}}))
        )
        .code,
        422
    );

    // PUT with a stale resourceVersion conflicts; with the current one it succeeds.
    let mut body = created.clone();
    body["spec"]["type"] = json!("NodePort");
    let ok = c.request("PUT", "/api/v1/namespaces/prod/services/web", Some(&body));
    assert_eq!(ok.code, 200);
    let stale = c.request("PUT", "/api/v1/namespaces/prod/services/web", Some(&body));
    assert_eq!(stale.code, 409);
    assert_eq!(stale.json()["reason"], "Conflict");

    // Merge patch; other patch types are refused.
    c.send(
        "PATCH",
        "/api/v1/namespaces/prod/services/web",
        Some(&json!({"metadata": {"labels": {"x": "y"}}})),
        "Content-Type: application/merge-patch+json\r\n",
    );
    let patched = c.response();
    assert_eq!(patched.code, 200);
    assert_eq!(patched.json()["metadata"]["labels"]["x"], "y");
    c.send(
        "PATCH",
        "/api/v1/namespaces/prod/services/web",
        Some(&json!([])),
        "Content-Type: application/json-patch+json\r\n",
    );
    assert_eq!(c.response().code, 415);

    let del = c.request("DELETE", "/api/v1/namespaces/prod/services/web", None);
    assert_eq!(del.code, 200);
    assert_eq!(
        c.request("DELETE", "/api/v1/namespaces/prod/services/web", None)
            .code,
        404
    );
    assert_eq!(
        c.request("POST", "/api/v1/namespaces/prod/services", None)
            .code,
        400,
        "empty body"
    );
    assert_eq!(c.get("/api/v1/services?limit=x").code, 400);
    assert_eq!(
        c.get("/api/v1/services?watch=true&resourceVersion=abc")
            .code,
        400
    );
    assert_eq!(
        c.get("/api/v1/services?watch=true&timeoutSeconds=-1").code,
        400
    );

    // Garbage gets a 400 and the connection closes; the server carries on.
    let mut raw = TcpStream::connect(server.addr()).unwrap();
    raw.set_read_timeout(Some(TIMEOUT)).unwrap();
    raw.write_all(b"NOT HTTP AT ALL\r\n\r\n").unwrap();
    let mut answer = String::new();
    let _ = raw.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    assert!(answer.contains("\"kind\":\"Status\""));
    let mut raw = TcpStream::connect(server.addr()).unwrap();
    raw.write_all(b"GET /api/v1/services HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n")
        .unwrap();
    drop(raw);
    assert_eq!(Client::connect(server.addr()).get("/healthz").code, 200);
    assert_eq!(server.try_create("pods", json!({})).unwrap_err().code, 404);
}

#[test]
fn apiserver_kubeconfig_and_drop() {
    let server = ApiServer::start().unwrap();
    let addr = server.addr();
    let dir = std::env::temp_dir().join(format!("fake-apiserver-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("kubeconfig");
    server.write_kubeconfig(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(&format!("server: http://{addr}\n")));
    assert!(text.contains("current-context: fake\n"));
    std::fs::remove_dir_all(&dir).unwrap();

    // Drop with a watch and an idle connection open is quick and closes the port.
    let mut w = Client::connect(addr).watch("/api/v1/services?watch=true");
    let mut idle = Client::connect(addr);
    assert_eq!(idle.get("/readyz").code, 200);
    let start = Instant::now();
    drop(server);
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "drop took {:?}",
        start.elapsed()
    );
    assert!(matches!(w.next(TIMEOUT), Next::Closed));
    assert!(
        TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err(),
        "port still open"
    );
}
