//! The admin endpoints' HTTP/1.1 server: hyper, one request per connection.
//!
//! Probes, Prometheus scrapes and load-balancer health checks are single GETs with small
//! answers, so each connection carries one request and is closed after its answer
//! (`Connection: close`), and handlers are plain functions from a [`Request`] to a
//! [`Response`].
//!
//! These ports answer the kubelet's liveness probe and cloud load balancers, and the
//! health check node ports listen on every address, so any host can reach them: a slow or
//! hostile client must not be able to make them fail. Hence:
//! - the request head must arrive within [`HEAD_TIMEOUT`] (hyper's header read timeout)
//!   and fit in [`MAX_HEAD`] bytes, else the answer is 431 (slowloris clients dribbling
//!   bytes are cut off);
//! - a connection is done within [`HEAD_TIMEOUT`] + [`WRITE_TIMEOUT`] whatever the client
//!   does with the answer;
//! - the kernel holds a connection until its first bytes arrive (TCP_DEFER_ACCEPT, as
//!   nginx's `deferred`), in a backlog sized for thousands, so idle connections take no
//!   place here until they send something or the head timeout has passed;
//! - at most [`MAX_CONNECTIONS`] connections per listener are served at once, and when a new
//!   one arrives at the limit the *oldest* still sending its head is dropped, not the
//!   newcomer: a probe, which sends its request at once and is answered in microseconds,
//!   always gets through, while an attacker's half-open connections are the ones that keep
//!   being the oldest. hyper has no such policy, so the accept loop keeps it.

use std::{
    collections::VecDeque,
    convert::Infallible,
    future::Future,
    io,
    net::SocketAddr,
    os::fd::AsRawFd,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use http_body_util::Full;
use hyper::{
    Method, StatusCode,
    body::{Bytes, Incoming},
    header::{self, HeaderName, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpListener, TcpStream},
    task::AbortHandle,
};
use tracing::debug;

/// The largest request head read; anything longer is answered 431.
pub const MAX_HEAD: usize = 8 * 1024;
/// A connection gets this long to send its whole request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(3);
/// And this long to take the answer.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once per listener; a new one beyond it drops the oldest.
pub const MAX_CONNECTIONS: usize = 64;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// The path without the query string.
    pub path: String,
    /// The Accept header, if any (/metrics negotiates its format with it).
    pub accept: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
}

impl Response {
    pub fn text(status: u16, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            headers: vec![],
            body: body.into(),
        }
    }

    pub fn json(status: u16, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "application/json",
            headers: vec![],
            body: body.into(),
        }
    }

    pub fn not_found() -> Self {
        Self::text(404, "404 page not found\n")
    }

    /// As hyper sends it. A header a handler got wrong is left out (and logged) rather than
    /// failing the answer: the status is what probes and load balancers read.
    fn into_hyper(self) -> hyper::Response<Full<Bytes>> {
        let mut out = hyper::Response::new(Full::new(Bytes::from(self.body)));
        *out.status_mut() =
            StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let headers = out.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(self.content_type),
        );
        headers.insert(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        );
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        for (name, value) in self.headers {
            match (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(&value),
            ) {
                (Ok(name), Ok(value)) => {
                    headers.insert(name, value);
                }
                _ => debug!(name, value, "admin answer: not a valid header, left out"),
            }
        }
        out
    }
}

pub type Handler = Arc<dyn Fn(&Request) -> Response + Send + Sync>;

/// What a handler sees of a request hyper parsed: its method, the path of an origin-form
/// (or absolute-form) target, and the Accept header. `None` for any other target form
/// (`*`, an authority) or a header that is not text.
fn request<B>(req: &hyper::Request<B>) -> Option<Request> {
    let path = req.uri().path();
    if !path.starts_with('/') || req.uri().path_and_query().is_none() {
        return None;
    }
    let accept = match req.headers().get(header::ACCEPT) {
        Some(value) => Some(value.to_str().ok()?.trim().to_string()),
        None => None,
    };
    Some(Request {
        method: req.method().as_str().to_string(),
        path: path.to_string(),
        accept,
    })
}

/// `handler`'s answer to `req`; GET and HEAD only, as the endpoints are read-only.
fn answer<B>(handler: &Handler, req: &hyper::Request<B>) -> Response {
    match request(req) {
        // hyper sends HEAD's answer without its body, and with the length GET's would have.
        Some(r) if req.method() == Method::GET || req.method() == Method::HEAD => handler(&r),
        Some(_) => Response::text(405, "method not allowed\n"),
        None => Response::text(400, "bad request\n"),
    }
}

/// One connection's hyper settings: see the module docs.
fn connection_builder() -> http1::Builder {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_header_size(MAX_HEAD)
        // Room for one head and hyper's read-ahead, no more, per connection.
        .max_buf_size(2 * MAX_HEAD)
        .keep_alive(false)
        // The header names clients saw from the earlier responder (and Go's net/http).
        .title_case_headers(true);
    builder
}

/// Connections the kernel queues for a listener before it drops new SYNs. Idle clients
/// wait here (see [`listen`]) rather than in the daemon, so it is sized for thousands;
/// the kernel caps it at net.core.somaxconn (4096 by default).
const BACKLOG: i32 = 4096;

/// A listener for an admin server on `addr`, bound at once (SO_REUSEADDR, so a port
/// closed by an update can be taken again in the same sync), nonblocking for tokio.
///
/// The kernel hands over its connections only once they carry data, or after
/// [`HEAD_TIMEOUT`] (TCP_DEFER_ACCEPT, as nginx's `deferred`): clients notice nothing, as
/// their connect completes at once, but idle connections, however many, take no place
/// in the daemon.
pub fn listen(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    socket.set_nonblocking(true)?;
    let secs = HEAD_TIMEOUT.as_secs() as libc::c_int;
    // SAFETY: the fd is the socket's, open for the call; the option value is a c_int we
    // own, passed with its size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            (&secs as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        // Only what idle connections cost changes: serve anyway.
        debug!(%addr, "TCP_DEFER_ACCEPT: {}", io::Error::last_os_error());
    }
    Ok(socket.into())
}

/// Serves `listener` with `handler` until `stop` resolves.
pub async fn serve(listener: TcpListener, handler: Handler, stop: impl Future<Output = ()>) {
    let builder = connection_builder();
    // The connections being served, oldest first, each with a flag set once its request
    // head is in. Only this loop touches it; finished ones are pruned at the limit.
    let mut live: VecDeque<(AbortHandle, Arc<AtomicBool>)> =
        VecDeque::with_capacity(MAX_CONNECTIONS);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if live.len() >= MAX_CONNECTIONS {
                        live.retain(|(h, _)| !h.is_finished());
                    }
                    if live.len() >= MAX_CONNECTIONS {
                        // The oldest still waiting for its head; one being answered only if
                        // all are (it will be done in a moment anyway).
                        let i = live.iter().position(|(_, headed)| !headed.load(Ordering::Relaxed)).unwrap_or(0);
                        if let Some((oldest, _)) = live.remove(i) {
                            debug!(%peer, "{MAX_CONNECTIONS} admin connections open; dropping the oldest");
                            oldest.abort();
                        }
                    }
                    let headed = Arc::new(AtomicBool::new(false));
                    let task = tokio::spawn(connection(stream, builder.clone(), handler.clone(), headed.clone()));
                    live.push_back((task.abort_handle(), headed));
                    // Let the new connection read the head it has likely sent already
                    // (tokio runs the task just spawned next): under a flood of accepts, a
                    // probe not yet polled would otherwise be the oldest without a head
                    // by the time MAX_CONNECTIONS more arrived, and be dropped.
                    tokio::task::yield_now().await;
                }
                // Out of file descriptors and the like: back off instead of spinning.
                Err(e) => {
                    debug!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
    for (h, _) in live {
        h.abort();
    }
}

/// Serves one connection: one request, its answer, then close.
async fn connection(
    stream: TcpStream,
    builder: http1::Builder,
    handler: Handler,
    headed: Arc<AtomicBool>,
) {
    let peer = stream.peer_addr().ok();
    if let Err(e) = exchange(stream, builder, handler, headed).await {
        debug!(?peer, "admin connection: {e}");
    }
}

/// One request and its answer over `io`, as a listener's connections get them: the entry
/// point of the admin HTTP fuzz target, which has no sockets.
pub async fn serve_one<I>(io: I, handler: Handler) -> Result<(), String>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    exchange(io, connection_builder(), handler, Arc::default()).await
}

async fn exchange<I>(
    io: I,
    builder: http1::Builder,
    handler: Handler,
    headed: Arc<AtomicBool>,
) -> Result<(), String>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |req: hyper::Request<Incoming>| {
        headed.store(true, Ordering::Relaxed);
        let resp = answer(&handler, &req).into_hyper();
        async move { Ok::<_, Infallible>(resp) }
    });
    let served = builder.serve_connection(TokioIo::new(io), service);
    match tokio::time::timeout(HEAD_TIMEOUT + WRITE_TIMEOUT, served).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("not done in time".into()),
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A listener as the daemon makes them, on a loopback port the kernel picks.
    fn bound() -> TcpListener {
        TcpListener::from_std(listen("127.0.0.1:0".parse().unwrap()).unwrap()).unwrap()
    }

    /// A server with `handler` until aborted: its address and task.
    fn serving(handler: Handler) -> (SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = bound();
        let addr = listener.local_addr().unwrap();
        (
            addr,
            tokio::spawn(serve(listener, handler, std::future::pending())),
        )
    }

    fn hyper_request(method: &str, target: &str, accept: Option<&str>) -> hyper::Request<()> {
        let mut r = hyper::Request::builder().method(method).uri(target);
        if let Some(a) = accept {
            r = r.header("ACCEPT", a);
        }
        r.body(()).unwrap()
    }

    #[test]
    fn a_request_is_its_method_path_and_accept_header() {
        let r = request(&hyper_request("GET", "/healthz?verbose=1", None)).unwrap();
        assert_eq!((r.method.as_str(), r.path.as_str()), ("GET", "/healthz"));
        assert_eq!(r.accept, None);
        let r = request(&hyper_request(
            "GET",
            "/metrics",
            Some("  text/plain;version=0.0.4 "),
        ))
        .unwrap();
        assert_eq!(r.accept.as_deref(), Some("text/plain;version=0.0.4"));
        let absolute = request(&hyper_request("GET", "http://node:10256/livez", None)).unwrap();
        assert_eq!(absolute.path, "/livez");
        assert!(request(&hyper_request("OPTIONS", "*", None)).is_none());
        assert!(request(&hyper_request("CONNECT", "node:10256", None)).is_none());
        let mut bad_accept = hyper_request("GET", "/metrics", None);
        bad_accept.headers_mut().insert(
            header::ACCEPT,
            HeaderValue::from_bytes(b"\xfftext").unwrap(),
        );
        assert!(request(&bad_accept).is_none(), "not text");
    }

    #[test]
    fn only_get_and_head_reach_the_handler() {
        let handler: Handler = Arc::new(|_: &Request| Response::text(200, "ok\n"));
        let status = |method, target| answer(&handler, &hyper_request(method, target, None));
        assert_eq!(status("GET", "/").body, "ok\n");
        assert_eq!(status("HEAD", "/").status, 200);
        assert_eq!(status("POST", "/").status, 405);
        assert_eq!(status("OPTIONS", "*").status, 400);
    }

    #[test]
    fn the_answer_carries_its_type_and_extra_headers() {
        let mut r = Response::json(503, "{}");
        r.headers
            .push(("X-Load-Balancing-Endpoint-Weight", "0".into()));
        r.headers.push(("X-Bad", "line\r\nbreak".into()));
        let out = r.into_hyper();
        assert_eq!(out.status(), 503);
        let h = out.headers();
        assert_eq!(h["content-type"], "application/json");
        assert_eq!(h["x-load-balancing-endpoint-weight"], "0");
        assert_eq!(h["connection"], "close");
        assert!(!h.contains_key("x-bad"), "an invalid value is left out");
        assert_eq!(Response::text(1000, "").into_hyper().status(), 500);
    }

    /// MAX_CONNECTIONS idle connections hold every slot; a new request is answered anyway,
    /// by dropping the oldest of them.
    #[tokio::test]
    async fn the_oldest_connection_makes_room_for_a_new_one() {
        let (addr, server) = serving(Arc::new(|_: &Request| Response::text(200, "ok\n")));
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET / HT").await.unwrap(); // and never the rest
            idle.push(s);
            // Accepted in this order, so the first is the oldest.
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut out = String::new();
        let read = tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut out)).await;
        assert!(read.is_ok() && out.starts_with("HTTP/1.1 200"), "{out:?}");
        // The oldest was closed: it reads EOF (or a reset) at once.
        let mut buf = [0u8; 16];
        let first = tokio::time::timeout(Duration::from_secs(2), idle[0].read(&mut buf)).await;
        assert!(matches!(first, Ok(Ok(0)) | Ok(Err(_))), "{first:?}");
        // The newest idle one is still open.
        let last = tokio::time::timeout(
            Duration::from_millis(200),
            idle[MAX_CONNECTIONS - 1].read(&mut buf),
        )
        .await;
        assert!(last.is_err(), "still waiting for its head: {last:?}");
        server.abort();
    }

    #[tokio::test]
    async fn a_head_that_does_not_arrive_in_time_is_cut_off() {
        let (addr, server) = serving(Arc::new(|_: &Request| Response::text(200, "ok\n")));
        let mut s = TcpStream::connect(addr).await.unwrap();
        let started = std::time::Instant::now();
        let mut buf = [0u8; 16];
        // A byte every 500 ms, as slowloris does, until the server hangs up.
        let closed = loop {
            if s.write_all(b"G").await.is_err() {
                break true;
            }
            match tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break true,
                Ok(Ok(_)) => break false,
                Err(_) if started.elapsed() > HEAD_TIMEOUT * 2 => break false,
                Err(_) => {}
            }
        };
        assert!(closed, "closed without an answer");
        let took = started.elapsed();
        assert!(
            took >= HEAD_TIMEOUT && took < HEAD_TIMEOUT + Duration::from_secs(1),
            "{took:?}"
        );
        server.abort();
    }

    /// A connection that sends nothing at all waits in the kernel for the head timeout
    /// (TCP_DEFER_ACCEPT), then gets the head timeout here, and is closed.
    #[tokio::test]
    async fn a_silent_connection_is_closed_after_the_head_timeout() {
        let (addr, server) = serving(Arc::new(|_: &Request| Response::text(200, "ok\n")));
        let mut s = TcpStream::connect(addr).await.unwrap();
        let started = std::time::Instant::now();
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout(HEAD_TIMEOUT * 3, s.read(&mut buf)).await;
        assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");
        let took = started.elapsed();
        assert!(
            took >= HEAD_TIMEOUT && took < HEAD_TIMEOUT * 2 + Duration::from_millis(1500),
            "{took:?}"
        );
        server.abort();
    }

    /// A head over MAX_HEAD is answered 431 and the handler never runs.
    #[tokio::test]
    async fn an_oversized_head_is_answered_431() {
        let (addr, server) = serving(Arc::new(|_: &Request| panic!("the handler ran")));
        let mut s = TcpStream::connect(addr).await.unwrap();
        let mut head = b"GET /healthz HTTP/1.1\r\nX-Big: ".to_vec();
        head.resize(head.len() + MAX_HEAD * 2, b'a');
        head.extend_from_slice(b"\r\n\r\n");
        // The server may answer and close before taking it all.
        let _ = s.write_all(&head).await;
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut out)).await;
        let out = String::from_utf8_lossy(&out);
        assert!(out.starts_with("HTTP/1.1 431"), "{out:?}");
        server.abort();
    }

    #[tokio::test]
    async fn serves_until_stopped() {
        let listener = bound();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let handler: Handler = Arc::new(|req: &Request| match req.path.as_str() {
            "/hello" => Response::text(200, "hi\n"),
            _ => Response::not_found(),
        });
        let server = tokio::spawn(serve(listener, handler, async {
            let _ = rx.await;
        }));
        let get = |req: &'static [u8]| async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(req).await.unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        let ok = get(b"GET /hello HTTP/1.1\r\nHost: a\r\n\r\n").await;
        assert!(
            ok.starts_with("HTTP/1.1 200 OK") && ok.ends_with("\r\n\r\nhi\n"),
            "{ok}"
        );
        // An HTTP/1.0 client is answered in its version.
        assert!(
            get(b"GET /nope HTTP/1.0\r\n\r\n")
                .await
                .starts_with("HTTP/1.0 404")
        );
        assert!(
            get(b"POST /hello HTTP/1.1\r\n\r\n")
                .await
                .starts_with("HTTP/1.1 405")
        );
        assert!(get(b"garbage\r\n\r\n").await.starts_with("HTTP/1.1 400"));
        let head = get(b"HEAD /hello HTTP/1.1\r\n\r\n").await;
        assert!(
            head.starts_with("HTTP/1.1 200")
                && head.contains("Content-Length: 3\r\n")
                && head.ends_with("\r\n\r\n"),
            "{head}"
        );
        let _ = tx.send(());
        server.await.unwrap();
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "the listener is closed once stopped"
        );
    }
}
