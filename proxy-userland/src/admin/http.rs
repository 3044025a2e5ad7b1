//! A minimal HTTP/1.1 responder for the admin endpoints.
//!
//! Probes, Prometheus scrapes and load-balancer health checks are single GETs with small
//! answers, so this reads one request head, answers it and closes the connection
//! (`Connection: close`). That is all those clients need, and it keeps an HTTP server stack
//! out of the build.
//!
//! These ports answer the kubelet's liveness probe and cloud load balancers, and the
//! health check node ports listen on every address, so any host can reach them: a slow or
//! hostile client must not be able to make them fail. Hence:
//! - the request head must arrive within [`HEAD_TIMEOUT`] and fit in [`MAX_HEAD`] bytes
//!   (slowloris clients dribbling bytes are cut off);
//! - at most [`MAX_CONNECTIONS`] connections per listener are served at once, and when a new
//!   one arrives at the limit the *oldest* still sending its head is dropped, not the
//!   newcomer: a probe, which
//!   sends its request at once and is answered in microseconds, always gets through, while
//!   an attacker's half-open connections are the ones that keep being the oldest.

use std::{
    collections::VecDeque,
    future::Future,
    io,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::AbortHandle,
};
use tracing::debug;

/// The largest request head read; anything longer is answered 431.
const MAX_HEAD: usize = 8 * 1024;
/// A connection gets this long to send its whole request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(3);
/// And this long to take the answer.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
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

    fn head(&self) -> String {
        let mut head = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n\
             X-Content-Type-Options: nosniff\r\nConnection: close\r\n",
            self.status,
            reason(self.status),
            self.content_type,
            self.body.len(),
        );
        for (name, value) in &self.headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        head
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "",
    }
}

pub type Handler = Arc<dyn Fn(&Request) -> Response + Send + Sync>;

/// Serves `listener` with `handler` until `stop` resolves.
pub async fn serve(listener: TcpListener, handler: Handler, stop: impl Future<Output = ()>) {
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
                    let handler = handler.clone();
                    let headed = Arc::new(AtomicBool::new(false));
                    let flag = headed.clone();
                    let task = tokio::spawn(async move {
                        if let Err(e) = answer(stream, &handler, &flag).await {
                            debug!(%peer, "admin connection: {e}");
                        }
                    });
                    live.push_back((task.abort_handle(), headed));
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

async fn answer(mut stream: TcpStream, handler: &Handler, headed: &AtomicBool) -> io::Result<()> {
    let head = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream)).await {
        Ok(Ok(Some(head))) => {
            headed.store(true, Ordering::Relaxed);
            head
        }
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no complete request head in time",
            ));
        }
    };
    let response = match head {
        Head::TooLarge => Response::text(431, "request head too large\n"),
        Head::Complete(head) => match parse(&head) {
            Some(req) if req.method == "GET" || req.method == "HEAD" => {
                let mut resp = handler(&req);
                if req.method == "HEAD" {
                    resp.body.clear();
                }
                resp
            }
            Some(_) => Response::text(405, "method not allowed\n"),
            None => Response::text(400, "bad request\n"),
        },
    };
    let write = async {
        stream.write_all(response.head().as_bytes()).await?;
        stream.write_all(response.body.as_bytes()).await?;
        stream.shutdown().await
    };
    tokio::time::timeout(WRITE_TIMEOUT, write)
        .await
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "answer not taken in time",
            ))
        })
}

enum Head {
    Complete(Vec<u8>),
    TooLarge,
}

/// Reads one request head; `None` if the client went away first.
async fn read_head(stream: &mut TcpStream) -> io::Result<Option<Head>> {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        head.extend_from_slice(&chunk[..n]);
        if let Some(end) = find_end(&head) {
            head.truncate(end);
            return Ok(Some(Head::Complete(head)));
        }
        if head.len() > MAX_HEAD {
            return Ok(Some(Head::TooLarge));
        }
    }
}

/// Where the request head ends (after the blank line), if it has.
fn find_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| i + 4)
        .or_else(|| buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2))
}

/// The request line (`METHOD /path?query HTTP/1.x`) and the Accept header.
pub fn parse(head: &[u8]) -> Option<Request> {
    let text = std::str::from_utf8(head).ok()?;
    let mut lines = text.lines();
    let line = lines.next()?;
    let mut parts = line.split(' ');
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return None;
    }
    let path = target.split(['?', '#']).next().unwrap_or("/");
    let accept = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("accept"))
        .map(|(_, value)| value.trim().to_string());
    Some(Request {
        method: method.to_string(),
        path: path.to_string(),
        accept,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_request_line() {
        let r = parse(b"GET /healthz?verbose=1 HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        assert_eq!((r.method.as_str(), r.path.as_str()), ("GET", "/healthz"));
        assert_eq!(r.accept, None);
        let r =
            parse(b"GET /metrics HTTP/1.1\r\nACCEPT:  text/plain;version=0.0.4 \r\n\r\n").unwrap();
        assert_eq!(r.accept.as_deref(), Some("text/plain;version=0.0.4"));
        assert!(parse(b"GET healthz HTTP/1.1\r\n\r\n").is_none());
        assert!(parse(b"GET / SPDY/3\r\n\r\n").is_none());
        assert!(parse(b"\xff\xfe\r\n\r\n").is_none());
        assert!(parse(b"").is_none());
    }

    #[test]
    fn the_head_carries_length_and_extra_headers() {
        let mut r = Response::json(503, "{}");
        r.headers
            .push(("X-Load-Balancing-Endpoint-Weight", "0".into()));
        let head = r.head();
        assert!(
            head.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{head}"
        );
        assert!(
            head.contains("Content-Length: 2\r\n")
                && head.contains("X-Load-Balancing-Endpoint-Weight: 0\r\n")
        );
        assert!(head.ends_with("\r\n\r\n"));
    }

    /// MAX_CONNECTIONS idle connections hold every slot; a new request is answered anyway,
    /// by dropping the oldest of them.
    #[tokio::test]
    async fn the_oldest_connection_makes_room_for_a_new_one() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let handler: Handler = Arc::new(|_: &Request| Response::text(200, "ok\n"));
        let server = tokio::spawn(serve(listener, handler, std::future::pending()));
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
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let handler: Handler = Arc::new(|_: &Request| Response::text(200, "ok\n"));
        let server = tokio::spawn(serve(listener, handler, std::future::pending()));
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

    #[tokio::test]
    async fn serves_until_stopped() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
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
        assert!(
            get(b"GET /nope HTTP/1.0\r\n\r\n")
                .await
                .starts_with("HTTP/1.1 404")
        );
        assert!(
            get(b"POST /hello HTTP/1.1\r\n\r\n")
                .await
                .starts_with("HTTP/1.1 405")
        );
        assert!(get(b"garbage\r\n\r\n").await.starts_with("HTTP/1.1 400"));
        let head = get(b"HEAD /hello HTTP/1.1\r\n\r\n").await;
        assert!(
            head.contains("Content-Length: 0") && head.ends_with("\r\n\r\n"),
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
