//! A minimal HTTP/1.1 responder for the admin endpoints.
//!
//! Probes, Prometheus scrapes and load-balancer health checks are single GETs with small
//! answers, so this reads one request head, answers it and closes the connection
//! (`Connection: close`). That is all those clients need, and it keeps an HTTP server stack
//! out of the build. Reads and writes are bounded in size and time, and so is the number of
//! connections served at once, so a slow or hostile client cannot pin the daemon.

use std::{future::Future, io, sync::Arc, time::Duration};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::Semaphore,
};
use tracing::debug;

/// The largest request head read; anything longer is answered 431.
const MAX_HEAD: usize = 8 * 1024;
/// A connection gets this long to send its request and take the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once per listener; more are closed at once.
const MAX_CONNECTIONS: usize = 64;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// The path without the query string.
    pub path: String,
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
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        debug!(%peer, "too many admin connections; closing one");
                        continue;
                    };
                    let handler = handler.clone();
                    tokio::spawn(async move {
                        if let Ok(Err(e)) = tokio::time::timeout(IO_TIMEOUT, answer(stream, &handler)).await {
                            debug!(%peer, "admin connection: {e}");
                        }
                        drop(slot);
                    });
                }
                // Out of file descriptors and the like: back off instead of spinning.
                Err(e) => {
                    debug!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

async fn answer(mut stream: TcpStream, handler: &Handler) -> io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    let response = loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&chunk[..n]);
        if let Some(end) = find_end(&head) {
            break match parse(&head[..end]) {
                Some(req) if req.method == "GET" || req.method == "HEAD" => {
                    let mut resp = handler(&req);
                    if req.method == "HEAD" {
                        resp.body.clear();
                    }
                    resp
                }
                Some(_) => Response::text(405, "method not allowed\n"),
                None => Response::text(400, "bad request\n"),
            };
        }
        if head.len() > MAX_HEAD {
            break Response::text(431, "request head too large\n");
        }
    };
    stream.write_all(response.head().as_bytes()).await?;
    stream.write_all(response.body.as_bytes()).await?;
    stream.shutdown().await
}

/// Where the request head ends (after the blank line), if it has.
fn find_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| i + 4)
        .or_else(|| buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2))
}

/// The request line: `METHOD /path?query HTTP/1.x`.
pub fn parse(head: &[u8]) -> Option<Request> {
    let text = std::str::from_utf8(head).ok()?;
    let line = text.lines().next()?;
    let mut parts = line.split(' ');
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return None;
    }
    let path = target.split(['?', '#']).next().unwrap_or("/");
    Some(Request {
        method: method.to_string(),
        path: path.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_request_line() {
        let r = parse(b"GET /healthz?verbose=1 HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        assert_eq!((r.method.as_str(), r.path.as_str()), ("GET", "/healthz"));
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
